#!/usr/bin/env python3
"""Generate the bundled demo chat data set (`llm_training/data/assets/demo_chat.jsonl`).

Every sample is written by this script from fixed templates and a seeded RNG, so the file is
reproducible byte for byte. The tasks are small and regular enough that a tiny model visibly learns them
within a few hundred steps: two-digit arithmetic, word reversal, counting, made-up facts looked up from a
fixed table, system prompts that change the answer format (upper case, terse), multi-turn follow-ups and a
few raw-text samples (one assistant turn, trained on fully).

    python scripts/make_demo_data.py [--out PATH] [--num-samples N] [--seed S] [--exclude PATH]

The held-out validation file (`demo_chat_val.jsonl`, `[validation]` of debug_cpu.toml): samples of another seed
that are not in the training file,

    python scripts/make_demo_data.py --out llm_training/data/assets/demo_chat_val.jsonl --num-samples 200 \
        --seed 4321 --exclude llm_training/data/assets/demo_chat.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "llm_training" / "data" / "assets" / "demo_chat.jsonl"

WORDS = (
    "planet river garden window silver orange marble castle pencil rocket lantern meadow harbor "
    "engine violet shadow thunder candle forest mirror bottle ladder copper dragon island feather "
    "kitten puzzle summer winter autumn spring cloud stone apple banana cherry lemon tiger zebra "
    "falcon dolphin basket bridge camera desert jacket kettle ocean parrot quartz saddle tunnel"
).split()

# Made-up places and their made-up properties: the model can only learn these from the data.
FACT_TABLE = {
    "Zorbia": {"capital": "Quell", "color": "teal", "animal": "glass heron", "river": "Amberflow"},
    "Telmar": {"capital": "Osk", "color": "amber", "animal": "sand fox", "river": "Vey"},
    "Brindle": {"capital": "Harrowgate", "color": "crimson", "animal": "moss bear", "river": "Tull"},
    "Nox Vale": {"capital": "Dunmere", "color": "indigo", "animal": "ash owl", "river": "Pell"},
    "Ostrava Minor": {"capital": "Kell", "color": "gold", "animal": "reed cat", "river": "Silvan"},
    "Quarry Isles": {"capital": "Port Lume", "color": "grey", "animal": "cliff goat", "river": "Brack"},
    "Velden": {"capital": "Aster", "color": "green", "animal": "frost hare", "river": "Oro"},
    "Myrr": {"capital": "Tansy", "color": "violet", "animal": "salt crab", "river": "Wend"},
}
FACT_QUESTIONS = {
    "capital": "What is the capital of {place}?",
    "color": "What color is the flag of {place}?",
    "animal": "What is the national animal of {place}?",
    "river": "Which river runs through {place}?",
}
FACT_ANSWERS = {
    "capital": "The capital of {place} is {value}.",
    "color": "The flag of {place} is {value}.",
    "animal": "The national animal of {place} is the {value}.",
    "river": "The {value} runs through {place}.",
}

SYSTEM_PROMPTS = {
    "plain": "You are a helpful assistant.",
    "upper": "You are a helpful assistant. Always answer in upper case.",
    "terse": "You are a terse assistant. Answer with the result only.",
}

# Raw-text samples: short paragraphs of our own prose, trained on fully as one assistant turn.
PROSE = [
    "The lighthouse keeper counted the ships every evening. Some nights there were three, some nights none, "
    "and on the longest night of the year there were eleven, all of them lit from bow to stern.",
    "A small garden needs little: water in the morning, shade in the afternoon and someone who notices "
    "when the leaves begin to curl.",
    "Trains leave the northern station on the hour. The last one runs at midnight and stops at every "
    "village along the river before it reaches the sea.",
    "The recipe is simple. Mix two cups of flour with one cup of water, add a pinch of salt, knead for ten "
    "minutes and let the dough rest under a cloth until it doubles.",
    "Every map is wrong in some way. The useful ones are wrong about the things you do not need.",
    "When the snow melted, the path behind the mill turned into a stream, and the children raced paper "
    "boats from the gate to the old stone bridge.",
]


def _answer_style(text: str, style: str) -> str:
    return text.upper() if style == "upper" else text


def _arithmetic(rng: random.Random, style: str) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = rng.choice(["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"]).format(
        a=a, op=op, b=b
    )
    answer = str(value) if style == "terse" else f"{a} {op} {b} = {value}."
    return question, answer


def _reverse(rng: random.Random, style: str) -> tuple[str, str]:
    word = rng.choice(WORDS)
    question = rng.choice(["Reverse the word '{w}'.", "Spell '{w}' backwards.", "What is '{w}' reversed?"]).format(
        w=word
    )
    answer = word[::-1] if style == "terse" else f"'{word}' reversed is '{word[::-1]}'."
    return question, answer


def _count(rng: random.Random, style: str) -> tuple[str, str]:
    start = rng.randint(0, 20)
    stop = start + rng.randint(2, 8)
    question = f"Count from {start} to {stop}."
    answer = ", ".join(str(i) for i in range(start, stop + 1))
    return question, answer if style == "terse" else answer + "."


def _fact(rng: random.Random, style: str) -> tuple[str, str]:
    place = rng.choice(sorted(FACT_TABLE))
    key = rng.choice(sorted(FACT_QUESTIONS))
    value = FACT_TABLE[place][key]
    answer = value if style == "terse" else FACT_ANSWERS[key].format(place=place, value=value)
    return FACT_QUESTIONS[key].format(place=place), answer


def _length(rng: random.Random, style: str) -> tuple[str, str]:
    word = rng.choice(WORDS)
    answer = str(len(word)) if style == "terse" else f"'{word}' has {len(word)} letters."
    return f"How many letters are in '{word}'?", answer


TASKS = (_arithmetic, _reverse, _count, _fact, _length)


def make_sample(rng: random.Random) -> dict:
    """One conversation: optional system prompt, 1-3 user/assistant exchanges, or a raw-text sample."""
    if rng.random() < 0.03:
        return {"conversations": [{"role": "assistant", "content": rng.choice(PROSE)}]}
    style = rng.choices(["none", "plain", "upper", "terse"], weights=[5, 2, 2, 2])[0]
    messages = []
    if style != "none":
        messages.append({"role": "system", "content": SYSTEM_PROMPTS[style]})
    num_turns = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    for _ in range(num_turns):
        question, answer = rng.choice(TASKS)(rng, style)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": _answer_style(answer, style)})
    return {"conversations": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--exclude", type=Path, help="a jsonl file whose samples are not written (held-out data)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    excluded = set(args.exclude.read_text(encoding="utf-8").splitlines()) if args.exclude else set()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        written = 0
        while written < args.num_samples:
            line = json.dumps(make_sample(rng), ensure_ascii=False)
            if line not in excluded:
                f.write(line + "\n")
                written += 1
    print(f"wrote {args.num_samples} samples to {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
