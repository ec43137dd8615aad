"""HF export during training ([checkpoint] export_hf_every): the folders appear at the chosen checkpoint steps and
the last one, hold what `convert dcp-to-hf` writes for the same checkpoint, and load back to the trained weights."""

import pytest
import torch
from safetensors.torch import load_file

from llm_training.config import ConfigError
from llm_training.convert import main as convert_main
from llm_training.distributed import ParallelDims
from llm_training.motif import get_flavor
from llm_training.motif.model import Motif3Model
from llm_training.motif.state_dict_adapter import load_hf_checkpoint
from llm_training.trainer import Trainer
from llm_training.trainer.hf_export import hf_export_due

DIMS = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=1)
CPU = torch.device("cpu")


def test_export_steps():
    due = [s for s in range(1, 8) if hf_export_due(s, last_step=7, checkpoint_interval=2, export_every=2)]
    assert due == [4, 7]
    assert not any(hf_export_due(s, 7, 2, 0) for s in range(1, 8))


@pytest.mark.parametrize(
    "overrides, named",
    [(("--checkpoint.export_hf_every=-1",), ">= 0"), (("--checkpoint.enable=false",), "enable = false")],
)
def test_bad_export_settings_are_config_errors(make_config, overrides, named):
    with pytest.raises(ConfigError, match="export_hf_every") as e:
        make_config("--checkpoint.export_hf_every=2", *overrides)
    assert named in str(e.value)


def test_training_exports_hf_folders_that_load_back(make_config, tmp_path):
    trainer = Trainer(
        make_config(
            "--training.steps=5",
            "--checkpoint.interval=1",
            "--checkpoint.export_hf_every=2",
            "--checkpoint.export_dtype=float32",
        ),
        DIMS,
        CPU,
    )
    result = trainer.fit()
    hf_root = result.run_folder / "hf"
    assert sorted(p.name for p in hf_root.iterdir()) == ["step-2", "step-4", "step-5"]  # no .tmp- left

    final = hf_root / "step-5"
    assert convert_main(["dcp-to-hf", str(result.last_checkpoint), str(tmp_path / "converted"), "--dtype=float32"]) == 0
    converted = tmp_path / "converted"
    assert sorted(p.name for p in final.iterdir()) == sorted(p.name for p in converted.iterdir())
    assert (final / "config.json").read_text() == (converted / "config.json").read_text()
    for shard in final.glob("*.safetensors"):
        ours, theirs = load_file(shard), load_file(converted / shard.name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    loaded = Motif3Model(get_flavor("motif3_debug"))
    load_hf_checkpoint(loaded, final)
    trained = trainer.model.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
