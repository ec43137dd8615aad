"""What a resumed run fixes and reports right after loading its checkpoint.

* `reapply_lr_schedule`: DCP loads the Stateful entries of a checkpoint in sorted key order, so `lr_scheduler`
  is restored before `optimizer`, whose param groups then bring back the `lr` saved in the checkpoint (the
  value the OLD schedule gave for the next step). Re-applying the current schedule at the restored step makes
  the first resumed step use the current `[training] steps` / `[lr_scheduler]` settings, as a fresh run with
  those settings would (a 3-step run extended to 6 steps matches a 6-step run).
* `changed_config_keys` / `warn_changed_config`: the keys of the resolved config that differ from the one
  stored in the checkpoint (`train_state.config_toml`), reported once (one key of a [[section.key]] table as
  `section.key.N.subkey`).
"""

from __future__ import annotations

import logging
import tomllib

logger = logging.getLogger(__name__)


def reapply_lr_schedule(lr_scheduler) -> None:
    """Set every param group's lr from `lr_scheduler`'s current schedule at its restored step."""
    lr_scheduler.load_state_dict(lr_scheduler.state_dict())


def _flatten(toml_text: str) -> dict[str, object]:
    """`section.key` -> value; a list of tables ([[training.sources]]) as `section.key.N.subkey` -> value."""
    flat = {}
    for section, keys in tomllib.loads(toml_text).items():
        for key, value in keys.items():
            if value and isinstance(value, list) and all(isinstance(v, dict) for v in value):
                flat |= {f"{section}.{key}.{n}.{k}": v for n, table in enumerate(value) for k, v in table.items()}
            else:
                flat[f"{section}.{key}"] = value
    return flat


def changed_config_keys(saved_toml: str, current_toml: str) -> list[tuple[str, object, object]]:
    """(section.key, value in the checkpoint, value now) for every key that differs, sorted by key; a key
    missing on one side (another version of the config) shows None there."""
    saved, current = _flatten(saved_toml), _flatten(current_toml)
    return [
        (k, saved.get(k), current.get(k))
        for k in sorted(saved.keys() | current.keys())
        if saved.get(k) != current.get(k)
    ]


def warn_changed_config(saved_toml: str, current_toml: str) -> None:
    """One warning listing the config keys changed since the checkpoint was written (nothing if none)."""
    changes = changed_config_keys(saved_toml, current_toml)
    if changes:
        logger.warning(
            "resumed with a config that differs from the checkpoint's in %d key(s): %s",
            len(changes),
            "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes),
        )
