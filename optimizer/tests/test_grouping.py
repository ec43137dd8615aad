"""Parameter grouping by rules: first match wins, errors for unmatched / forbidden / wrong-rank params."""

import pytest
import torch
from torch import nn

from optimizer import GroupRule, group_parameters

RULES = [
    GroupRule(r"experts\.gate_up$", "muon", expert=True, row_split=2),
    GroupRule(r"experts\.down$", "muon", expert=True),
    GroupRule(r"norm\.weight$", "adamw_no_decay"),
    GroupRule(r"embed\.weight$", "adamw_decay"),
    GroupRule(r"\.weight$", "muon"),
]


def _named(**shapes):
    return [(k.replace("__", "."), nn.Parameter(torch.zeros(s))) for k, s in shapes.items()]


def test_routes_by_first_matching_rule_and_reports_counts():
    named = _named(
        embed__weight=(10, 4),
        l0__norm__weight=(4,),
        l0__proj__weight=(6, 4),
        experts__gate_up=(3, 8, 4),
        experts__down=(3, 4, 4),
    )
    g = group_parameters(named, RULES)
    assert g.names("muon") == ["l0.proj.weight", "experts.gate_up", "experts.down"]
    assert g.names("adamw_decay") == ["embed.weight"]
    assert g.names("adamw_no_decay") == ["l0.norm.weight"]
    rows = {r["group"]: (r["tensors"], r["params"]) for r in g.summary()}
    assert rows == {"muon": (3, 24 + 96 + 48), "adamw_decay": (1, 40), "adamw_no_decay": (1, 4)}
    assert "total" in g.table() and "212" in g.table()
    splits = {grp["row_split"]: len(grp["params"]) for grp in g.muon_param_groups()}
    assert splits == {1: 2, 2: 1}


def test_frozen_params_are_skipped():
    named = _named(l0__proj__weight=(6, 4))
    named[0][1].requires_grad_(False)
    assert group_parameters(named, RULES).names("muon") == []


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="l0.thing"):
        group_parameters(_named(l0__thing=(3,)), RULES)
    with pytest.raises(ValueError, match="l0.big.weight.*2-D matrix"):
        group_parameters(_named(l0__big__weight=(2, 3, 4)), RULES)  # >2-D, not an expert rule
    with pytest.raises(ValueError, match="forbidden"):
        group_parameters(_named(moe__expert_bias=(4,)), RULES, forbidden=[r"expert_bias$"])
    with pytest.raises(ValueError, match="only apply to the muon group"):
        GroupRule("x", "adamw_decay", row_split=2)
