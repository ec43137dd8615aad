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


def test_motif_layout_dir_round_trips_exactly_with_its_other_files(tmp_path):
    """A directory in Motif's release layout (bf16 weights, fp32 router / expert bias / PolyNorm / mHC,
    tokenizer + generation config + remote code, a config field we do not know) goes HF -> DCP -> HF with
    the same tensor names, dtypes and bytes, the same config.json and the same other files."""
    from safetensors.torch import save_file

    from llm_training.motif.state_dict_adapter import is_fp32_key
    from tests.motif.motif_vllm_reference import motif_layout_shapes
    from tests.motif.test_motif_layout import motif_config, random_motif_tensors

    src = tmp_path / "release"
    src.mkdir()
    config = motif_config(torch_dtype="bfloat16", some_future_field={"kept": True})
    tensors = {
        k: v if is_fp32_key(k) else v.to(torch.bfloat16) for k, v in random_motif_tensors(config, seed=4).items()
    }
    assert tensors.keys() == motif_layout_shapes(config).keys()
    half = len(tensors) // 2
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(src / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(config, indent=2))
    extra = {"tokenizer.json": '{"model": {}}', "generation_config.json": "{}", "configuration_motif.py": "# code\n"}
    for name, text in extra.items():
        (src / name).write_text(text)

    assert main(["hf-to-dcp", str(src), str(tmp_path / "dcp")]) == 0
    assert main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "out")]) == 0
    out = _all_tensors(tmp_path / "out")
    assert out.keys() == tensors.keys()
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config
    for name, text in extra.items():
        assert (tmp_path / "out" / name).read_text() == text
