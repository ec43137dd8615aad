"""Write a JobConfig as TOML (sections of str/int/float/bool/list values), with each key's doc as a comment.

A small writer of our own, so dumping the resolved config needs no dependency beyond the standard
library (tomllib only reads).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


def toml_value(value: Any) -> str:
    """One value in TOML syntax."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)  # shortest round-tripping form, e.g. 0.002 or 1e-08 (valid TOML floats)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def _is_tables(value: Any) -> bool:
    """A non-empty list of dataclasses: written as an array of tables ([[section.key]])."""
    return isinstance(value, list) and bool(value) and all(dataclasses.is_dataclass(v) for v in value)


def _key_lines(obj: Any, with_docs: bool) -> list[str]:
    """`key = value` lines (each after its doc comment) of a dataclass's plain fields; None values are left out."""
    lines = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or _is_tables(value):
            continue
        if with_docs and f.metadata.get("doc"):
            lines.append(f"# {f.metadata['doc']}")
        lines.append(f"{f.name} = {toml_value(value)}")
    return lines


def to_toml(config: Any, with_docs: bool = True) -> str:
    """The config (a dataclass of section dataclasses) as TOML text; None values are left out, a list of tables
    (e.g. [training] sources) follows its section's keys as [[section.key]] tables (an empty one is `key = []`)."""
    lines: list[str] = []
    for section_field in dataclasses.fields(config):
        section = getattr(config, section_field.name)
        if lines:
            lines.append("")
        lines.append(f"[{section_field.name}]")
        lines += _key_lines(section, with_docs)
        for f in dataclasses.fields(section):
            tables = getattr(section, f.name)
            if not _is_tables(tables):
                continue
            if with_docs and f.metadata.get("doc"):
                lines.append(f"# {f.metadata['doc']}")
            for table in tables:
                lines += [f"[[{section_field.name}.{f.name}]]", *_key_lines(table, with_docs=False)]
    return "\n".join(lines) + "\n"
