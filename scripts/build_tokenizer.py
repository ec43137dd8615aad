#!/usr/bin/env python3
"""Train the bundled test/demo tokenizer (`llm_training/data/assets/tokenizer/`).

A byte-level BPE (vocab 2048, the `motif3_debug` vocabulary) trained with the `tokenizers` library on text we
ship: the demo chat data (rendered as ChatML) and a few paragraphs of our own prose. No downloads. Digits are
split one per token so the arithmetic demo tasks are learnable by a tiny model. The chat template is
ChatML-like: `<|bos|>` then `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message; `<|im_end|>` is the
end-of-turn (eos) token and `<|pad|>` pads. Writes tokenizer.json, tokenizer_config.json (with the
chat_template) and special_tokens_map.json, loadable by `transformers.AutoTokenizer` (4.x and 5.x).

    python scripts/build_tokenizer.py [--out DIR] [--data demo_chat.jsonl] [--vocab-size 2048]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "llm_training" / "data" / "assets"

PAD, BOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, IM_END]  # ids 0..3 in this order

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Our own prose, so the vocabulary also covers ordinary English beyond the demo templates.
PROSE = """
Training a language model is mostly bookkeeping. Every token has to arrive exactly once, in the order the
run expects, and every label has to point at the token that follows it. When a job stops and starts again,
the data loader must pick up where it left off, not a few batches earlier and not a few batches later.
Packing puts several short conversations into one row so that no compute is spent on padding. Each
conversation keeps its own positions, which start again at zero, and attention never looks across the
border between two of them. Only the final answer of the assistant is trained on; the question, the system
prompt and the earlier turns are context.
Bad input is normal. A line may be cut in half, a field may be missing, a role may be misspelled. A careful
loader counts these records, names the file and the line, and stops when too many of them appear.
The weather on the coast changes quickly. In the morning the fog sits on the water; by noon the wind has
carried it inland and the boats go out. Fishermen mend their nets on the pier and talk about the price of
fuel, the size of the catch and the new school that opened on the hill.
Numbers follow simple rules: adding zero changes nothing, multiplying by one changes nothing, and the order
of two numbers in a sum does not matter. Children learn to count on their fingers, then in tens, then in
hundreds, and one day they notice that the counting never has to stop.
"""


def _training_texts(data_path: Path) -> list[str]:
    texts = [PROSE]
    with open(data_path, encoding="utf-8") as f:
        for line in f:
            for message in json.loads(line)["conversations"]:
                texts.append(f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n")
    return texts


def build(out_dir: Path, data_path: Path, vocab_size: int) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(data_path), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_map = {"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "additional_special_tokens": [IM_START],
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({**special_map, "additional_special_tokens": [IM_START]}, indent=2) + "\n"
    )
    print(f"wrote {out_dir} (vocab {tokenizer.get_vocab_size()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSETS / "tokenizer")
    parser.add_argument("--data", type=Path, default=ASSETS / "demo_chat.jsonl")
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()
    build(args.out, args.data, args.vocab_size)


if __name__ == "__main__":
    main()
