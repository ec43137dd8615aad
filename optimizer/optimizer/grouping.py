"""Parameter grouping: decide, from names and shapes and a list of rules, which optimizer group each
parameter joins — Muon, AdamW with weight decay, or AdamW without weight decay.

Rules are tried in order; the first whose regex `re.search`-matches the parameter's FQN wins, so wrapper
prefixes (`_orig_mod.`, `_checkpoint_wrapped_module.`) do not matter when patterns are anchored at the end.
A parameter no rule matches is an error (listing every unmatched name), as is a Muon parameter that is not
2-D or a 3-D expert stack, and any parameter whose name matches a `forbidden` pattern (e.g. a buffer that
must never be trained).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

GROUPS = ("muon", "adamw_decay", "adamw_no_decay")


@dataclass(frozen=True)
class GroupRule:
    """One routing rule.

    pattern: regex searched in the FQN.
    group: "muon" | "adamw_decay" | "adamw_no_decay".
    expert: Muon only: the parameter is a 3-D stack [E, out, in] of independent matrices.
    row_split: Muon only: orthogonalise each matrix's rows in this many equal blocks (fused gate|up = 2).
    """

    pattern: str
    group: str
    expert: bool = False
    row_split: int = 1

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"GroupRule({self.pattern!r}): group {self.group!r} is not one of {GROUPS}")
        if self.group != "muon" and (self.expert or self.row_split != 1):
            raise ValueError(f"GroupRule({self.pattern!r}): expert/row_split only apply to the muon group")
        re.compile(self.pattern)


@dataclass
class ParamGrouping:
    """Result: per group, the (fqn, parameter, rule) triples in model order."""

    groups: dict[str, list[tuple[str, torch.Tensor, GroupRule]]] = field(
        default_factory=lambda: {g: [] for g in GROUPS}
    )

    def names(self, group: str) -> list[str]:
        return [name for name, _, _ in self.groups[group]]

    def summary(self) -> list[dict]:
        """One row per group: {"group", "tensors", "params"} (params = element count)."""
        return [
            {"group": g, "tensors": len(items), "params": sum(p.numel() for _, p, _ in items)}
            for g, items in self.groups.items()
        ]

    def table(self) -> str:
        """The start-up table: group, #tensors, #params."""
        rows = self.summary()
        total_t, total_p = sum(r["tensors"] for r in rows), sum(r["params"] for r in rows)
        lines = [f"{'group':<16}{'#tensors':>10}{'#params':>16}"]
        lines += [f"{r['group']:<16}{r['tensors']:>10}{r['params']:>16,}" for r in rows]
        lines.append(f"{'total':<16}{total_t:>10}{total_p:>16,}")
        return "\n".join(lines)

    def muon_param_groups(self) -> list[dict]:
        """Muon param-group dicts: one per distinct row_split (Muon reads `row_split` from the group)."""
        by_split: dict[int, list[torch.Tensor]] = {}
        for _, p, rule in self.groups["muon"]:
            by_split.setdefault(rule.row_split, []).append(p)
        return [{"params": ps, "row_split": s} for s, ps in sorted(by_split.items())]


def group_parameters(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    rules: list[GroupRule],
    forbidden: Iterable[str] = (),
) -> ParamGrouping:
    """Route every trainable parameter (requires_grad) by the first matching rule; see module doc."""
    compiled = [(re.compile(r.pattern), r) for r in rules]
    forbidden_re = [re.compile(f) for f in forbidden]
    out = ParamGrouping()
    unmatched: list[str] = []
    for name, p in named_parameters:
        bad = next((f.pattern for f in forbidden_re if f.search(name)), None)
        if bad is not None:
            raise ValueError(
                f"parameter {name!r} matches forbidden pattern {bad!r}: it must not reach an optimizer "
                "(register it as a buffer)"
            )
        if not p.requires_grad:
            continue
        rule = next((r for rx, r in compiled if rx.search(name)), None)
        if rule is None:
            unmatched.append(f"{name} {tuple(p.shape)}")
            continue
        if rule.group == "muon":
            ok = p.ndim == 3 if rule.expert else p.ndim == 2
            if not ok:
                kind = "a 3-D expert stack [E, out, in]" if rule.expert else "a 2-D matrix"
                raise ValueError(
                    f"parameter {name!r} of shape {tuple(p.shape)} is routed to Muon by rule {rule.pattern!r} "
                    f"as {kind}; Muon only takes 2-D matrices and expert stacks marked expert=True"
                )
            if p.shape[-2] % rule.row_split:
                raise ValueError(f"parameter {name!r}: row_split={rule.row_split} does not divide {tuple(p.shape)}")
        out.groups[rule.group].append((name, p, rule))
    if unmatched:
        raise ValueError(
            "no optimizer grouping rule matches these parameters (add a rule for each):\n  " + "\n  ".join(unmatched)
        )
    return out
