"""`python -m llm_training.convert`: HF -> DCP -> HF round trip keeps every tensor, and the DCP output
loads as initial weights of a fresh model."""

import json

import torch
from safetensors.torch import load_file

from llm_training.convert import main
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.state_dict_adapter import export_hf_checkpoint
from llm_training.trainer.checkpoint import load_model_weights_dcp

ARGS = get_flavor("motif3_debug")


def _all_tensors(hf_dir):
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_hf_to_dcp_to_hf_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Motif3Model(ARGS)
    model.init_weights()
    export_hf_checkpoint(model, tmp_path / "hf", dtype=torch.float32)
    assert main(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    assert main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf2"), "--dtype", "float32"]) == 0
    a, b = _all_tensors(tmp_path / "hf"), _all_tensors(tmp_path / "hf2")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["num_experts"] == ARGS.num_experts

    fresh = Motif3Model(ARGS)
    load_model_weights_dcp(fresh, tmp_path / "dcp")
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k


def test_convert_errors_are_reported(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"hidden_size": "big"}))
    assert main(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 2
    assert "hidden_size" in capsys.readouterr().err
