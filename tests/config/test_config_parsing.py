"""ConfigManager: defaults < TOML < command line, type conversion, error messages, TOML round trip."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from llm_training.config import ConfigError, ConfigManager, JobConfig, to_toml
from llm_training.config.job_config import ASSETS_DIR


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(*argv: str) -> JobConfig:
    return ConfigManager().parse_args(list(argv))


# ---------------------------------------------------------------------- defaults and precedence
def test_defaults_without_arguments():
    c = parse()
    assert c.model.flavor == "motif3_debug"
    assert c.training.local_batch_size == 8 and c.training.seq_len == 256 and c.training.steps == 300
    assert c.optimizer.name == "muon" and c.optimizer.adamw_betas == [0.9, 0.95]
    assert c.parallelism.data_parallel_shard_degree == -1
    assert Path(c.model.tokenizer_path) == ASSETS_DIR / "tokenizer"
    assert Path(c.training.dataset_path) == ASSETS_DIR / "demo_chat.jsonl"
    assert c.job.run_name == "default" and c.job.config_file == ""


def test_toml_overrides_defaults_and_cli_overrides_toml(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 50\nseq_len = 128\n[optimizer]\nlr = 0.01\n")
    c = parse("--job.config_file", str(path), "--training.steps=70")
    assert c.training.steps == 70  # CLI wins over TOML
    assert c.training.seq_len == 128  # TOML wins over the default
    assert c.optimizer.lr == 0.01
    assert c.training.local_batch_size == 8  # default kept
    assert c.job.config_file == str(path) and c.job.run_name == "job"  # run_name from the file stem


def test_config_file_position_does_not_matter(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 50\n")
    c = parse("--training.steps", "60", f"--job.config_file={path}")
    assert c.training.steps == 60


def test_cli_value_types():
    c = parse(
        "--training.steps",
        "40",
        "--optimizer.lr=3e-4",
        "--optimizer.adamw_betas=0.8,0.99",
        "--compile.components",
        "model",
        "--parallelism.data_parallel_shard_degree",
        "-1",
        "--job.description",
        "hello world",
        "--training.max_norm=2",
    )
    assert c.training.steps == 40 and isinstance(c.training.steps, int)
    assert c.optimizer.lr == pytest.approx(3e-4)
    assert c.optimizer.adamw_betas == [0.8, 0.99]
    assert c.compile.components == ["model"]
    assert c.parallelism.data_parallel_shard_degree == -1
    assert c.job.description == "hello world"
    assert c.training.max_norm == 2.0 and isinstance(c.training.max_norm, float)


def test_bare_boolean_flag_and_explicit_values():
    c = parse("--training.deterministic", "--compile.enable", "true", "--metrics.save_jsonl=false")
    assert c.training.deterministic is True
    assert c.compile.enable is True
    assert c.metrics.save_jsonl is False
    c = parse("--compile.enable", "--training.steps", "30")  # bare flag followed by another option
    assert c.compile.enable is True and c.training.steps == 30


def test_toml_int_accepted_for_float_and_list_of_floats(tmp_path):
    path = write(tmp_path, "[optimizer]\nlr = 1\nadamw_betas = [0, 0.5]\n")
    c = parse("--job.config_file", str(path))
    assert c.optimizer.lr == 1.0 and isinstance(c.optimizer.lr, float)
    assert c.optimizer.adamw_betas == [0.0, 0.5]


def test_optional_fields_are_parsed():
    from llm_training.config.manager import _BadValue, convert_value

    assert convert_value("none", int | None, from_cli=True) is None
    assert convert_value("7", int | None, from_cli=True) == 7
    assert convert_value(None, float | None, from_cli=False) is None
    with pytest.raises(_BadValue):
        convert_value("x", int | None, from_cli=True)


# ---------------------------------------------------------------------- errors
def test_unknown_section_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse("--trainig.steps=5")
    assert "[trainig]" in str(e.value) and "'training'" in str(e.value)
    path = write(tmp_path, "[optimiser]\nlr = 0.1\n")
    with pytest.raises(ConfigError) as e:
        parse("--job.config_file", str(path))
    assert "[optimiser]" in str(e.value) and str(path) in str(e.value) and "'optimizer'" in str(e.value)


def test_unknown_key_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse("--training.stesp=5")
    msg = str(e.value)
    assert "'stesp'" in msg and "[training]" in msg and "did you mean 'steps'" in msg
    path = write(tmp_path, "[training]\nlocal_batch = 4\n")
    with pytest.raises(ConfigError) as e:
        parse("--job.config_file", str(path))
    assert "'local_batch'" in str(e.value) and "local_batch_size" in str(e.value) and str(path) in str(e.value)


def test_wrong_type_from_cli_names_key_type_and_value():
    with pytest.raises(ConfigError) as e:
        parse("--training.steps=ten")
    msg = str(e.value)
    assert "[training] steps" in msg and "expected int" in msg and "'ten'" in msg and "--training.steps" in msg
    with pytest.raises(ConfigError) as e:
        parse("--training.deterministic=maybe")
    assert "expected bool" in str(e.value) and "=true/=false" in str(e.value)


def test_wrong_type_from_toml_names_file_and_line(tmp_path):
    path = write(tmp_path, "[job]\ndescription = 'x'\n\n[training]\nseq_len = 128\nsteps = 3.5\n")
    with pytest.raises(ConfigError) as e:
        parse("--job.config_file", str(path))
    msg = str(e.value)
    assert "[training] steps" in msg and "expected int" in msg and "3.5" in msg
    assert f"{path}:6" in msg  # steps is on line 6


def test_toml_bool_is_not_an_int_and_str_is_not_a_list(tmp_path):
    path = write(tmp_path, "[training]\nsteps = true\n")
    with pytest.raises(ConfigError, match="expected int"):
        parse("--job.config_file", str(path))
    path = write(tmp_path, '[compile]\ncomponents = "model"\n')
    with pytest.raises(ConfigError, match=r"expected list\[str\].*array"):
        parse("--job.config_file", str(path))


def test_choice_fields_list_the_valid_values():
    with pytest.raises(ConfigError) as e:
        parse("--optimizer.name=sgd")
    assert "'sgd'" in str(e.value) and "muon, adamw" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse("--compile.components=model,optimizer")
    assert "'optimizer'" in str(e.value) and "model, loss" in str(e.value)


def test_missing_config_file_lists_shipped_configs(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as e:
        parse("--job.config_file", str(missing))
    assert str(missing) in str(e.value) and "not found" in str(e.value) and "debug_cpu.toml" in str(e.value)


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 5\nseq_len = = 3\n")
    with pytest.raises(ConfigError) as e:
        parse("--job.config_file", str(path))
    assert str(path) in str(e.value) and "line 3" in str(e.value)


def test_malformed_command_line():
    with pytest.raises(ConfigError, match="unexpected command-line argument 'steps'"):
        parse("steps")
    with pytest.raises(ConfigError, match="needs a value"):
        parse("--training.steps")


def test_help_lists_keys_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--training.seq_len" in out and "--parallelism.expert_parallel_degree" in out


# ---------------------------------------------------------------------- resolved-config dump
def test_resolved_config_round_trip(tmp_path):
    c = parse(
        "--training.steps=77",
        "--optimizer.lr=1.5e-4",
        "--job.description",
        'quote " and \\ back',
        "--compile.components=loss",
        "--training.deterministic",
        "--optimizer.adamw_eps=1e-10",
    )
    text = to_toml(c)
    tomllib.loads(text)  # valid TOML
    path = write(tmp_path, text, "config.toml")
    back = parse("--job.config_file", str(path))
    assert back.job.config_file == str(path)
    back.job.config_file = c.job.config_file  # the only field that names the file the config came from
    assert back == c
    assert dataclasses.asdict(back) == dataclasses.asdict(c)


def test_toml_writer_values():
    from llm_training.config.toml_writer import toml_value

    assert tomllib.loads("x = " + toml_value(1e-8))["x"] == 1e-8
    assert tomllib.loads("x = " + toml_value(3.0))["x"] == 3.0
    assert tomllib.loads("x = " + toml_value(float("inf")))["x"] == float("inf")
    assert tomllib.loads("x = " + toml_value('a\nb\t"c"é'))["x"] == 'a\nb\t"c"é'
    assert tomllib.loads("x = " + toml_value([1, 2]))["x"] == [1, 2]
    assert toml_value(True) == "true" and toml_value(-3) == "-3"
