"""[[training.sources]] and the new [huggingface_dataset] keys in the config: TOML tables, command-line overrides of
one table's key, the resolved-config round trip, and a bad value of every new key exiting 2 from the entrypoint
with one message naming the key and the fix."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest

import llm_training.train as train_module
from llm_training.config import ConfigManager, to_toml
from llm_training.config.manager import TRAIN_CONFIGS_DIR

DEBUG_TOML = TRAIN_CONFIGS_DIR / "debug_cpu.toml"


@pytest.fixture
def data(tmp_path):
    """A jsonl file, a parquet file and a save_to_disk DatasetDict of the same two chats."""
    import datasets

    rows = [
        {"conversations": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(2)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "web.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dsd"))
    return tmp_path


def job_toml(tmp_path, sources: str, extra: str = "") -> str:
    """debug_cpu.toml plus `sources` ([[training.sources]] tables) and `extra` lines."""
    path = tmp_path / "mix.toml"
    path.write_text(DEBUG_TOML.read_text() + "\n" + extra + "\n" + sources)
    return str(path)


def two_sources(data) -> str:
    return (
        f'[[training.sources]]\npath = "{data / "chat.jsonl"}"\nweight = 3\n\n'
        f'[[training.sources]]\nname = "web"\npath = "{data / "web.parquet"}"\nepochs = 2\n'
    )


def test_tables_parse_override_and_round_trip(data, tmp_path):
    c = ConfigManager().parse_args(
        ["--job.config_file", job_toml(tmp_path, two_sources(data)), "--training.sources.1.weight=0.5",
         "--training.sources.0.streaming=false", f"--huggingface_dataset.cache_dir={tmp_path / 'cache'}"]
    )  # fmt: skip
    chat, web = c.training.sources
    assert (chat.resolved_name, chat.weight, chat.epochs) == ("chat", 3.0, 0)
    assert (web.resolved_name, web.weight, web.epochs, web.path) == ("web", 0.5, 2, str(data / "web.parquet"))
    text = to_toml(c)
    assert len(tomllib.loads(text)["training"]["sources"]) == 2
    (tmp_path / "resolved.toml").write_text(text)
    back = ConfigManager().parse_args(["--job.config_file", str(tmp_path / "resolved.toml")])
    back.job.config_file = c.job.config_file
    assert dataclasses.asdict(back) == dataclasses.asdict(c)


def test_default_names():
    from llm_training.config.job_config import DataSource

    assert DataSource(path="/d/web.parquet").resolved_name == "web"
    assert DataSource(path="/d/chat_v2/").resolved_name == "chat_v2"
    assert DataSource(hub="allenai/c4", hub_config="en").resolved_name == "c4-en"


def _error(capsys, argv) -> str:
    assert train_module.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("config error") == 1
    return err


def _table(data, **keys) -> str:
    keys.setdefault("path", str(data / "chat.jsonl"))
    return "[[training.sources]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items() if v is not None)


BAD_TABLES = [
    # (keys of the one source table, words the message must hold)
    ({"weight": 0}, ["#0 ('chat') weight must be > 0", "weight = 1.0"]),
    ({"epochs": -1}, ["#0 ('chat') epochs must be >= 0"]),
    ({"hub": "org/chat"}, ["path / hub: set exactly one of path", "hub"]),
    ({"path": None}, ["set exactly one of path"]),
    ({"hub_config": "en"}, ["hub_config = 'en' applies to hub datasets only", "remove hub_config"]),
    ({"revision": "v1"}, ["revision = 'v1' applies to hub datasets only"]),
    ({"name": "my chat"}, ["'my chat' is not a usable source name", "set name"]),
    ({"path": "{data}/missing.jsonl"}, ["#0 ('missing') data: path:", "missing.jsonl' does not exist"]),
    ({"path": "{data}/dsd", "split": "dev"}, ["#0 ('dsd') data: split: 'dev' is not in", "available splits"]),
    ({"streaming": True}, ["streaming applies to hub and parquet data", "set streaming = false"]),
    ({"path": "{data}/web.parquet", "conversations_field": "msgs"}, ["conversations_field: 'msgs' is not a column"]),
    ({"weight": "heavy"}, ["[[training.sources]] #0 weight: expected float, got 'heavy'"]),
    ({"wieght": 2.0}, ["unknown key 'wieght' in [[training.sources]] table #0", "did you mean 'weight'"]),
]


@pytest.mark.usefixtures("entrypoint_without_setup")
@pytest.mark.parametrize(
    ("keys", "words"), BAD_TABLES, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD_TABLES)]
)
def test_a_bad_source_key_exits_2_naming_it(keys, words, data, tmp_path, capsys):
    keys = {k: v.format(data=data) if isinstance(v, str) else v for k, v in keys.items()}
    err = _error(capsys, ["--job.config_file", job_toml(tmp_path, _table(data, **keys))])
    assert "[[training.sources]]" in err
    for word in words:
        assert word in err


BAD_OVERRIDES = [
    # (command-line arguments on top of two sources, words the message must hold)
    (["--training.sources.1.name=chat"], ["sources #0 and #1 are both named 'chat'"]),
    (["--training.dataset_path=/d/x.jsonl"], ["dataset_path = '/d/x.jsonl' and [[training.sources]]"]),
    (["--training.sources=/d/x.jsonl"], ["[training] sources is a list of tables", "--training.sources.N.KEY"]),
    (["--training.sources.5.weight=1"], ["has 2 table(s)", "no table 5"]),
    (["--training.sources.0.wieght=1"], ["unknown key 'wieght' in [[training.sources]]", "'weight'"]),
    (["--huggingface_dataset.shuffle_buffer=0"], ["[huggingface_dataset] shuffle_buffer must be >= 1"]),
    (["--huggingface_dataset.cache_dir={data}/chat.jsonl"], ["[huggingface_dataset] cache_dir", "is a file"]),
]


@pytest.mark.usefixtures("entrypoint_without_setup")
@pytest.mark.parametrize(("args", "words"), BAD_OVERRIDES, ids=[a[0].split("=")[0] for a, _ in BAD_OVERRIDES])
def test_a_bad_mixture_setting_exits_2_naming_it(args, words, data, tmp_path, capsys):
    err = _error(
        capsys, ["--job.config_file", job_toml(tmp_path, two_sources(data)), *(a.format(data=data) for a in args)]
    )
    for word in words:
        assert word in err


@pytest.mark.usefixtures("entrypoint_without_setup")
def test_sources_must_be_tables(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text(DEBUG_TOML.read_text().replace("[training]\n", "[training]\nsources = 3\n"))
    err = _error(capsys, ["--job.config_file", str(tmp_path / "bad.toml")])
    assert "[training] sources" in err and "must be an array of tables" in err


@pytest.mark.usefixtures("entrypoint_without_setup")
def test_an_unreachable_hub_dataset_exits_2_with_what_to_do(data, tmp_path, capsys, monkeypatch):
    """What datasets raises offline (HF_HUB_OFFLINE=1 or no network, data not cached): a ConnectionError."""
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/chat' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    table = _table(data, path=None, hub="org/chat", hub_config="en", revision="v1")
    err = _error(
        capsys, ["--job.config_file", job_toml(tmp_path, table), f"--huggingface_dataset.cache_dir={tmp_path}"]
    )
    for word in ("[[training.sources]] #0 ('chat-en')", "hub = 'org/chat', hub_config = 'en'", "cannot be reached",
                 "OfflineModeIsEnabled", str(tmp_path), "set [huggingface_dataset] cache_dir", "save_to_disk",
                 "path = "):  # fmt: skip
        assert word in err


def test_the_readme_example_is_a_valid_config(tmp_path):
    readme = (TRAIN_CONFIGS_DIR.parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```toml\n")[1:]]
    (example,) = [b for b in blocks if "[[training.sources]]" in b]
    c = ConfigManager().parse_args(["--job.config_file", job_toml(tmp_path, example)])
    assert [s.resolved_name for s in c.training.sources] == ["chat_sft", "ultrachat"]
    assert c.training.sources[1].streaming and c.huggingface_dataset.cache_dir == "/mnt/hf_datasets"
