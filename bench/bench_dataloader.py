#!/usr/bin/env python3
"""Throughput of the chat data loader on the CPU (tokens/s), for packed and padded rows.

Two inputs: the bundled demo data (short samples) and a larger synthetic jsonl written to a temporary folder
(multi-turn chats of a few hundred to a few thousand tokens, built from a seeded random word list). Each run
checks the first batch against the batch contract, warms up, then times `next_batch()` over the given time
budget. "row tok/s" counts every position of every row (what the GPU consumes), "doc tok/s" only the
non-padding tokens. Prints a table and writes JSON.

    python bench/bench_dataloader.py [--seconds 5] [--json outputs/bench/bench_dataloader.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from llm_training.data import (
    BUNDLED_TOKENIZER_PATH,
    DEMO_DATA_PATH,
    ChatDocumentSource,
    ChatTokenizer,
    PackedDataLoader,
    build_tokenizer,
    open_records,
)


def write_synthetic_jsonl(path: Path, num_samples: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = [f"w{k}" for k in range(200)] + "the of and to in is it that was for on are with as".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_samples):
            messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(20, 300)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(20, 600)))})
            f.write(json.dumps({"conversations": messages}) + "\n")


def check_batch(batch: dict, batch_size: int, seq_len: int) -> None:
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    for value in batch.values():
        assert tuple(value.shape) == (batch_size, seq_len)
    trained = batch["labels"] != -100
    assert trained.any()
    # a label is the next input token
    assert (batch["labels"][:, :-1][trained[:, :-1]] == batch["input_ids"][:, 1:][trained[:, :-1]]).all()


def run_case(name: str, path: Path, tokenizer, packing: str, seq_len: int, batch_size: int, seconds: float) -> dict:
    start = time.perf_counter()
    records = open_records(path, "conversations", "train")
    loader = PackedDataLoader(
        ChatDocumentSource(records, ChatTokenizer(tokenizer), seq_len=seq_len),
        seq_len=seq_len,
        local_batch_size=batch_size,
        packing=packing,
        shuffle=True,
        shuffle_seed=0,
    )
    startup_s = time.perf_counter() - start
    check_batch(loader.next_batch(), batch_size, seq_len)
    loader.next_batch()
    tokens_before = loader.counters["tokens"]
    batches, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        loader.next_batch()
        batches += 1
    elapsed = time.perf_counter() - begin
    row_tokens = batches * batch_size * seq_len
    return {
        "data": name,
        "packing": packing,
        "seq_len": seq_len,
        "batch": batch_size,
        "records": len(records),
        "startup_s": round(startup_s, 3),
        "batches": batches,
        "row_tok_per_s": row_tokens / elapsed,
        "doc_tok_per_s": (loader.counters["tokens"] - tokens_before) / elapsed,
        "fill": (loader.counters["tokens"] - tokens_before) / row_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per case")
    parser.add_argument("--synthetic-samples", type=int, default=20000)
    parser.add_argument("--json", type=Path, default=Path("outputs/bench/bench_dataloader.json"))
    args = parser.parse_args()
    tokenizer = build_tokenizer(BUNDLED_TOKENIZER_PATH)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "synthetic.jsonl"
        write_synthetic_jsonl(synthetic, args.synthetic_samples)
        cases = [("demo", DEMO_DATA_PATH, 256, 8), ("synthetic", synthetic, 4096, 8)]
        for name, path, seq_len, batch in cases:
            for packing in ("pack", "pad"):
                results.append(run_case(name, path, tokenizer, packing, seq_len, batch, args.seconds))
    header = (
        f"{'data':<10} {'packing':<7} {'seq_len':>7} {'batch':>5} {'records':>8} {'startup s':>9} "
        f"{'row tok/s':>11} {'doc tok/s':>11} {'fill':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['data']:<10} {r['packing']:<7} {r['seq_len']:>7} {r['batch']:>5} {r['records']:>8} "
            f"{r['startup_s']:>9.3f} {r['row_tok_per_s']:>11,.0f} {r['doc_tok_per_s']:>11,.0f} {r['fill']:>5.2f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
