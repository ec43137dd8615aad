"""Build a JobConfig from defaults, a TOML file and `--section.key` command-line overrides.

Precedence: command line > TOML file > dataclass defaults. Command-line syntax:
  --section.key=value | --section.key value   (lists: comma-separated, e.g. --compile.components=model,loss)
  --section.flag                              (a bare boolean flag means true; write --section.flag=false for false)
  --section.key.N.subkey=value                (one key of the N-th table (0-based) of a list of tables such as
                                               [[training.sources]]; the tables themselves come from the TOML)
  --help                                      (lists every key with its doc, then exits)
Every value is converted to its field's type; unknown sections/keys, wrong types, values outside a
field's choices and inconsistent combinations raise ConfigError before any heavy work.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from llm_training.config.job_config import MOVED_KEYS, PACKAGE_DIR, JobConfig, section_classes
from llm_training.config.validate import validate_config
from llm_training.errors import ConfigError

TRAIN_CONFIGS_DIR = PACKAGE_DIR / "motif" / "train_configs"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


# ---------------------------------------------------------------------- field types
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `T | None` / `Optional[T]`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def table_type(tp: Any) -> type | None:
    """The dataclass of a list-of-tables field (`list[DataSource]`: [[training.sources]] in TOML), else None."""
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp)
        if dataclasses.is_dataclass(elem):
            return elem
    return None


def type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is list:
        name = f"list[{type_name(typing.get_args(inner)[0])}]"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | None" if optional else name


class _BadValue(Exception):
    """Internal: a value does not fit the field type (turned into a ConfigError with context)."""


def _convert_scalar(value: Any, tp: Any, from_cli: bool) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise _BadValue
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise _BadValue from None
        raise _BadValue
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _BadValue from None
        raise _BadValue
    if tp is str:
        if isinstance(value, str):
            return value
        raise _BadValue
    raise TypeError(f"unsupported config field type {tp!r}")


def convert_value(value: Any, tp: Any, from_cli: bool) -> Any:
    """`value` (a TOML value, or a command-line string when from_cli) as type `tp`; raises _BadValue."""
    inner, optional = _unwrap_optional(tp)
    if optional and (value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    if typing.get_origin(inner) is list:
        (elem_tp,) = typing.get_args(inner)
        if from_cli and isinstance(value, str):
            items = [v.strip() for v in value.split(",")] if value.strip() else []
        elif isinstance(value, list):
            items = value
        else:
            raise _BadValue
        return [_convert_scalar(v, elem_tp, from_cli) for v in items]
    return _convert_scalar(value, inner, from_cli)


# ---------------------------------------------------------------------- error helpers
def _did_you_mean(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"{hint}valid: {', '.join(valid)}"


def _toml_key_line(path: Path, section: str, key: str) -> int | None:
    """Line number (1-based) of `key = ...` inside `[section]` of a TOML file, found by a simple scan."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    current = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.match(r"^\[\[?\s*([A-Za-z0-9_.\-]+)\s*\]", stripped)  # [section] or [[section.tables]]
        if header:
            current = header.group(1)
        elif current == section and re.match(rf"^\"?{re.escape(key)}\"?\s*=", stripped):
            return lineno
    return None


# ---------------------------------------------------------------------- the manager
class ConfigManager:
    """Parses `--job.config_file X.toml` plus `--section.key` overrides into a validated JobConfig."""

    def __init__(self) -> None:
        self.sections = section_classes()

    # -- public API
    def parse_args(self, argv: list[str] | None = None) -> JobConfig:
        """Defaults < TOML (--job.config_file) < command line; validated (world-size-free checks)."""
        argv = sys.argv[1:] if argv is None else list(argv)
        if "-h" in argv or "--help" in argv:
            print(self.help_text())
            raise SystemExit(0)
        overrides = self._parse_cli(argv)
        config = JobConfig()
        self._origins: dict[tuple[str, str], str] = {}  # where each set value came from (for the messages)
        config_file = next((v for (s, k), v in overrides.items() if (s, k) == ("job", "config_file")), "")
        if config_file:
            self._apply_toml(config, self.load_toml(config_file), Path(config_file))
        for (section, key), raw in overrides.items():
            self._set(config, section, key, raw, from_cli=True, origin=f"--{section}.{key}")
        if config_file:
            config.job.config_file = config_file  # the file actually loaded (a dumped config names its source)
        if not config.job.run_name:
            config.job.run_name = Path(config_file).stem if config_file else "default"
        self._check_choices(config)  # on the merged values: a command-line override may replace a TOML value
        validate_config(config)
        return config

    @staticmethod
    def load_toml(path: str | Path) -> dict[str, Any]:
        """Read a TOML file; missing files and syntax errors become ConfigError naming the file."""
        p = Path(path)
        if not p.is_file():
            shipped = sorted(x.name for x in TRAIN_CONFIGS_DIR.glob("*.toml"))
            raise ConfigError(
                f"config file {str(path)!r} not found (cwd {Path.cwd()}); pass an existing TOML file with "
                f"--job.config_file, e.g. one of the shipped configs in {TRAIN_CONFIGS_DIR}: {', '.join(shipped)}"
            )
        try:
            with p.open("rb") as fh:
                return tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"TOML syntax error in {path}: {e}; fix the file at that line") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text ({e})") from None

    def help_text(self) -> str:
        lines = [
            "usage: python -m llm_training.train --job.config_file CONFIG.toml [--section.key=value ...]",
            "       (--section.key value also works; a bare --section.flag sets a boolean to true)",
            "",
        ]
        for name, cls in self.sections.items():
            lines.append(f"[{name}]")
            hints = _field_types(cls)
            for f in dataclasses.fields(cls):
                choices = f.metadata.get("choices")
                extra = f" (one of: {', '.join(choices)})" if choices else ""
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                lines.append(f"  --{name}.{f.name} ({type_name(hints[f.name])}, default {default!r}){extra}")
                lines.append(f"      {f.metadata.get('doc', '')}")
                table = table_type(hints[f.name])
                if table is not None:
                    lines.append(f"      [[{name}.{f.name}]] keys (override one with --{name}.{f.name}.N.KEY=VALUE):")
                    table_hints = _field_types(table)
                    for sub in dataclasses.fields(table):
                        lines.append(
                            f"        {sub.name} ({type_name(table_hints[sub.name])}, default {sub.default!r})"
                        )
                        lines.append(f"            {sub.metadata.get('doc', '')}")
        return "\n".join(lines)

    # -- command line
    def _parse_cli(self, argv: list[str]) -> dict[tuple[str, str], Any]:
        overrides: dict[tuple[str, str], Any] = {}
        i = 0
        while i < len(argv):
            arg = argv[i]
            if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
                raise ConfigError(
                    f"unexpected command-line argument {arg!r}; options look like --section.key=value "
                    f"(e.g. --training.steps=100 or --job.config_file path.toml); see --help"
                )
            name, has_eq, value = arg[2:].partition("=")
            section, _, key = name.partition(".")
            tp = self._field_type(section, key, origin=f"command-line option --{name}")
            if not has_eq:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                if _unwrap_optional(tp)[0] is bool:
                    if nxt is not None and nxt.lower() in _TRUE + _FALSE:
                        value, i = nxt, i + 1
                    else:
                        value = "true"  # bare boolean flag
                elif nxt is None:
                    raise ConfigError(f"--{name} needs a value ({type_name(tp)}): write --{name}=VALUE")
                else:
                    value, i = nxt, i + 1
            overrides[(section, key)] = value
            i += 1
        return overrides

    # -- TOML
    def _apply_toml(self, config: JobConfig, data: dict[str, Any], path: Path) -> None:
        for section, table in data.items():
            if section not in self.sections:
                raise ConfigError(
                    f"unknown section [{section}] in {path}; {_did_you_mean(section, list(self.sections))}"
                )
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: '{section}' must be a table ([{section}] followed by key = value lines)")
            for key, value in table.items():
                line = _toml_key_line(path, section, key)
                origin = f"{path}:{line}" if line else str(path)
                self._set(config, section, key, value, from_cli=False, origin=origin)

    # -- shared
    def _field_type(self, section: str, key: str, origin: str) -> Any:
        """The type of `key` in `section` (for `field.N.subkey`: of that key of the field's tables)."""
        key, dot, rest = key.partition(".")
        tp = self._section_field_type(section, key, origin)
        if not dot:
            return tp
        table = table_type(tp)
        index, _, subkey = rest.partition(".")
        if table is None or not index.isdigit() or not subkey:
            shape = f"--{section}.{key}.N.KEY=VALUE (N: the 0-based table number)" if table else f"--{section}.{key}"
            raise ConfigError(f"{origin}: write {shape}")
        hints = _field_types(table)
        if subkey not in hints:
            raise ConfigError(
                f"unknown key '{subkey}' in [[{section}.{key}]] ({origin}); {_did_you_mean(subkey, list(hints))}"
            )
        return hints[subkey]

    def _section_field_type(self, section: str, key: str, origin: str) -> Any:
        if section not in self.sections:
            raise ConfigError(f"unknown section [{section}] in {origin}; {_did_you_mean(section, list(self.sections))}")
        hints = _field_types(self.sections[section])
        if (section, key) in MOVED_KEYS:
            new_section, new_key = MOVED_KEYS[(section, key)]
            raise ConfigError(
                f"[{section}] {key} ({origin}) moved to [{new_section}] {new_key}: write it there "
                f"(--{new_section}.{new_key}=... on the command line)"
            )
        if key not in hints:
            raise ConfigError(
                f"unknown key '{key}' in section [{section}] ({origin}); {_did_you_mean(key, list(hints))}"
            )
        return hints[key]

    def _set(self, config: JobConfig, section: str, key: str, raw: Any, from_cli: bool, origin: str) -> None:
        tp = self._field_type(section, key, origin)
        if "." in key:
            self._set_table_key(config, section, key, raw, tp, origin)
            return
        table = table_type(tp)
        if table is not None:
            if from_cli:
                raise ConfigError(
                    f"[{section}] {key} is a list of tables: write them in the TOML file as [[{section}.{key}]] "
                    f"tables; on the command line set one key of table N with --{section}.{key}.N.KEY=VALUE"
                )
            value = self._convert_tables(raw, table, section, key, origin)
            setattr(getattr(config, section), key, value)
            self._origins[(section, key)] = origin
            return
        try:
            value = convert_value(raw, tp, from_cli)
        except _BadValue:
            hint = (
                " (a bare --flag means true; use =true/=false)" if _unwrap_optional(tp)[0] is bool and from_cli else ""
            )
            list_hint = (
                " (comma-separated on the command line, a [..] array in TOML)" if "list" in type_name(tp) else ""
            )
            raise ConfigError(
                f"[{section}] {key}: expected {type_name(tp)}{list_hint}, got {raw!r} "
                f"({type(raw).__name__}) from {origin}{hint}"
            ) from None
        setattr(getattr(config, section), key, value)
        self._origins[(section, key)] = origin

    def _convert_tables(self, raw: Any, table: type, section: str, key: str, origin: str) -> list:
        """A TOML array of tables ([[section.key]]) as a list of `table` dataclasses, each value typed."""
        where = f"[[{section}.{key}]]"
        if not isinstance(raw, list) or not all(isinstance(item, dict) for item in raw):
            raise ConfigError(
                f"[{section}] {key} ({origin}) must be an array of tables: write each as a {where} table "
                f"of key = value lines, got {raw!r}"
            )
        hints = _field_types(table)
        items = []
        for n, item in enumerate(raw):
            values = {}
            for subkey, value in item.items():
                if subkey not in hints:
                    raise ConfigError(
                        f"unknown key '{subkey}' in {where} table #{n} ({origin}); {_did_you_mean(subkey, list(hints))}"
                    )
                values[subkey] = self._convert_table_value(
                    value, hints[subkey], f"{where} #{n} {subkey}", origin, False
                )
            items.append(table(**values))
        return items

    def _set_table_key(self, config: JobConfig, section: str, key: str, raw: Any, tp: Any, origin: str) -> None:
        """`--section.field.N.subkey=value`: one key of the N-th table of a list-of-tables field."""
        name, index, subkey = key.split(".", 2)
        tables = getattr(getattr(config, section), name)
        if int(index) >= len(tables):
            raise ConfigError(
                f"{origin}: [[{section}.{name}]] has {len(tables)} table(s) (numbered from 0), so there is no "
                f"table {index}; add the tables in the TOML file"
            )
        value = self._convert_table_value(raw, tp, f"[[{section}.{name}]] #{index} {subkey}", origin, True)
        setattr(tables[int(index)], subkey, value)

    @staticmethod
    def _convert_table_value(raw: Any, tp: Any, what: str, origin: str, from_cli: bool) -> Any:
        try:
            return convert_value(raw, tp, from_cli)
        except _BadValue:
            raise ConfigError(
                f"{what}: expected {type_name(tp)}, got {raw!r} ({type(raw).__name__}) from {origin}"
            ) from None

    def _check_choices(self, config: JobConfig) -> None:
        """Every field with a choice set holds one of its choices (the message names where the value came from)."""
        for section, cls in self.sections.items():
            for f in dataclasses.fields(cls):
                choices = f.metadata.get("choices")
                value = getattr(getattr(config, section), f.name)
                for v in (value if isinstance(value, list) else [value]) if choices else []:
                    if v not in choices:
                        origin = self._origins.get((section, f.name), "the default")
                        raise ConfigError(
                            f"[{section}] {f.name}: {v!r} (from {origin}) is not one of: {', '.join(choices)} "
                            f"({f.name}: {f.metadata['doc']})"
                        )
