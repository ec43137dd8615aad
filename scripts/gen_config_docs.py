"""Generate docs/config.md (every config key: type, default, allowed values, doc) from the dataclasses.

python scripts/gen_config_docs.py          # rewrite docs/config.md
python scripts/gen_config_docs.py --check  # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from llm_training.config.job_config import PACKAGE_DIR, section_classes
from llm_training.config.manager import table_type, type_name
from llm_training.config.toml_writer import toml_value

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    text = toml_value(value)
    return text.replace(str(PACKAGE_DIR), "<llm_training>")  # machine-independent bundled-asset paths


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `llm_training/config/job_config.py` by `python scripts/gen_config_docs.py`; do not edit.",
        "",
        "Each section is a TOML table; every key can be overridden on the command line as",
        "`--section.key=value` or `--section.key value` (lists comma-separated; a bare `--section.flag`",
        "sets a boolean to true). Precedence: command line > TOML file (`--job.config_file`) > default.",
        "`<llm_training>` stands for the installed package folder (the bundled demo assets).",
        "",
    ]
    for name, cls in section_classes().items():
        lines += [f"## [{name}]", "", *_key_table(cls), ""]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            table = table_type(hints[f.name])
            if table is not None:
                lines += [
                    f"### [[{name}.{f.name}]]",
                    "",
                    (
                        f"Each `[[{name}.{f.name}]]` table of the TOML file has these keys (on the command line: "
                        f"`--{name}.{f.name}.N.KEY=VALUE` sets one key of table N, counted from 0)."
                    ),
                    "",
                    *_key_table(table),
                    "",
                ]
    return "\n".join(lines)


def _key_table(cls: type) -> list[str]:
    """The markdown table of a dataclass's keys: type, default, doc (with the choices)."""
    hints = typing.get_type_hints(cls)
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        doc = f.metadata.get("doc", "")
        if f.metadata.get("choices"):
            doc += f" (one of: {', '.join(f'`{c}`' for c in f.metadata['choices'])})"
        doc = doc.replace("|", "\\|")
        lines.append(f"| `{f.name}` | {type_name(hints[f.name]).replace('|', 'or')} | `{_default_text(f)}` | {doc} |")
    return lines


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
