"""HuggingFace Hub sources (data/hub.py) without the network: the name / config / split / revision / streaming /
cache_dir plumbing into `datasets.load_dataset`, a local dataset folder read through the real `datasets` code both
ways, and a real offline start (HF_HUB_OFFLINE=1) that exits 2 saying what to do."""

import os
import subprocess
import sys

import pytest
import torch
from data_helpers import make_loader, numbered_samples, write_jsonl

from llm_training.config import ConfigManager
from llm_training.config.manager import TRAIN_CONFIGS_DIR
from llm_training.config.toml_writer import toml_value
from llm_training.data import build_dataloader

DEBUG_TOML = TRAIN_CONFIGS_DIR / "debug_cpu.toml"
ROWS = numbered_samples(12)


def hub_config(tmp_path, **keys):
    """The demo config with one [[training.sources]] table of `keys` (short batches)."""
    table = "[[training.sources]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())
    (tmp_path / "hub.toml").write_text(DEBUG_TOML.read_text() + "\n" + table)
    return ConfigManager().parse_args(
        ["--job.config_file", str(tmp_path / "hub.toml"), "--training.seq_len=64", "--training.local_batch_size=2",
         f"--huggingface_dataset.cache_dir={tmp_path / 'cache'}"]
    )  # fmt: skip


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_keys_reach_load_dataset(streaming, tmp_path, hf_tokenizer, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append(dict(path=path, name=name, **kwargs))
        data = datasets.Dataset.from_list(ROWS)
        return data.to_iterable_dataset(num_shards=2) if kwargs["streaming"] else data

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    c = hub_config(tmp_path, hub="org/chat", hub_config="en", split="dev", revision="0123abc", streaming=streaming)
    batch = build_dataloader(c, hf_tokenizer, 0, 1).next_batch()
    assert calls == [
        dict(path="org/chat", name="en", split="dev", revision="0123abc", streaming=streaming,
             cache_dir=str(tmp_path / "cache"))
    ]  # fmt: skip
    assert batch["source_ids"].tolist() == [0, 0] and batch["real_tokens"].min() > 0


@pytest.fixture
def dataset_folder(tmp_path):
    """A dataset laid out as on the Hub (data/<split>-*.parquet), loadable by its folder path; and the same rows as
    jsonl."""
    import datasets

    (tmp_path / "repo" / "data").mkdir(parents=True)
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet"))
    return tmp_path / "repo", write_jsonl(tmp_path / "same.jsonl", ROWS)


def test_a_downloaded_hub_dataset_gives_the_jsonl_batches(dataset_folder, tmp_path, hf_tokenizer):
    repo, jsonl = dataset_folder
    hub = build_dataloader(hub_config(tmp_path, hub=str(repo)), hf_tokenizer, 0, 1)
    local = make_loader(jsonl, hf_tokenizer, local_batch_size=2, shuffle=True, shuffle_seed=1234)
    for _ in range(8):  # two epochs
        a, b = hub.next_batch(), local.next_batch()
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_streamed_hub_dataset_is_read_in_its_order(dataset_folder, tmp_path, hf_tokenizer, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)  # see test_mixture.parquet_path
    repo, jsonl = dataset_folder
    c = hub_config(tmp_path, hub=str(repo), streaming=True)
    c.huggingface_dataset.shuffle = False  # the stream's own order is the file order: the jsonl batches
    hub = build_dataloader(c, hf_tokenizer, 0, 1)
    local = make_loader(jsonl, hf_tokenizer, local_batch_size=2, shuffle=False)
    for _ in range(8):
        a, b = hub.next_batch(), local.next_batch()
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert hub.state_dict()["sources"][0]["stream_records"] == len(ROWS)


def test_offline_start_exits_2_saying_how_to_provide_the_data(tmp_path):
    """A real start with HF_HUB_OFFLINE=1 and a Hub dataset that is not cached (datasets fails at once, no network)."""
    table = '[[training.sources]]\nhub = "no-such-org/no-such-dataset"\nstreaming = true\n'
    (tmp_path / "offline.toml").write_text(DEBUG_TOML.read_text() + "\n" + table)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"))
    run = subprocess.run(
        [sys.executable, "-m", "llm_training.train", "--job.config_file", str(tmp_path / "offline.toml"),
         f"--job.dump_folder={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    for words in ("[[training.sources]] #0 ('no-such-dataset')", "cannot be reached", "OfflineModeIsEnabled",
                  str(tmp_path / "cache"), "[huggingface_dataset] cache_dir", "save_to_disk"):  # fmt: skip
        assert words in run.stderr
