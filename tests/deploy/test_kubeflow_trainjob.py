"""examples/kubeflow/trainjob.yaml: valid against the TrainJob schema (tests/deploy/testdata, a subset of
the Kubeflow Trainer v2 CRD with its source recorded in the file), and, run as a node runs it (the
command and args with the manifest's env plus the PET_* variables of the torch plugin), it performs the
start-up build of `activation` and calls run_train_kubeflow.sh with the example config. The volume holds
every path of that config, the W&B key comes from the Secret the header tells users to create, and the
image is the one docker-bake.hcl tags by default. The `torch-distributed` runtime of kubeflow/trainer
(manifests/base/runtimes/torch_distributed.yaml) names its replicated job and its container `node`."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "examples" / "kubeflow" / "trainjob.yaml"
SCHEMA = Path(__file__).parent / "testdata" / "trainjob-v1alpha1.schema.json"
API_KEY = "not-a-real-key-from-the-secret"


@pytest.fixture(scope="module")
def job():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(MANIFEST.read_text())


def node_pod_spec(job) -> dict:
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node"
    return replicated["template"]["spec"]["template"]["spec"]


def test_manifest_matches_the_trainjob_schema(job):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(job), key=lambda e: list(e.path))
    assert [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors] == []
    # list-map keys the schema language cannot express
    pod = node_pod_spec(job)
    for items, key in (
        (job["spec"]["trainer"]["env"], "name"),
        (job["spec"]["runtimePatches"], "manager"),
        (pod["volumes"], "name"),
        (pod["containers"], "name"),
    ):
        keys = [item[key] for item in items]
        assert len(keys) == len(set(keys)), f"duplicate {key}: {keys}"


def test_schema_rejects_what_the_crd_rejects(job):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    bad_name = {**job, "metadata": {"name": "Motif3_Seq"}}  # not an RFC 1035 label
    old_field = {**job, "spec": {**job["spec"], "podTemplateOverrides": []}}  # the pre-runtimePatches API
    no_runtime = {**job, "spec": {k: v for k, v in job["spec"].items() if k != "runtimeRef"}}
    for manifest in (bad_name, old_field, no_runtime):
        assert not validator.is_valid(manifest)


def test_node_command_builds_activation_then_calls_the_wrapper_with_the_example_config(job, tmp_path):
    trainer = job["spec"]["trainer"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "WANDB_")) and k != "CONFIG_FILE"}
    for var in trainer["env"]:
        env[var["name"]] = var.get("value", API_KEY)
    env.update(  # what the torch plugin injects on node 1 of 4
        PET_NNODES=str(trainer["numNodes"]),
        PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]),
        PET_NODE_RANK="1",
        PET_MASTER_ADDR="motif3-seq-pretrain-node-0-0.motif3-seq-pretrain",
        PET_MASTER_PORT="29500",
        DRY_RUN="1",  # the wrapper prints the torchrun command instead of running it
        PIP_TARGET=str(tmp_path / "site"),  # the start-up build installs here, not into the test's environment
        PYTHON=sys.executable,
        TMPDIR=str(tmp_path),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    )
    argv = trainer["command"] + trainer["args"]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # image WORKDIR
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith("[build_activation_at_start] installed activation from")
    assert (tmp_path / "site" / "activation" / "api.py").is_file()
    cmd = shlex.split(lines[-1])
    opts = dict(zip(cmd[1:11:2], cmd[2:11:2]))
    assert cmd[0] == "torchrun" and opts == {
        "--nnodes": "4",
        "--nproc_per_node": "8",
        "--node_rank": "1",
        "--master_addr": "motif3-seq-pretrain-node-0-0.motif3-seq-pretrain",
        "--master_port": "29500",
    }
    config = env["CONFIG_FILE"]
    assert config == "llm_training/motif/train_configs/example_c4_pretrain.toml"
    assert cmd[11:] == ["-m", "llm_training.train", "--job.config_file", config, *trainer["args"]]
    assert API_KEY not in proc.stdout + proc.stderr


def test_volume_holds_every_path_of_the_example_config(job):
    config = tomllib.loads((REPO / "llm_training/motif/train_configs/example_c4_pretrain.toml").read_text())
    paths = [config["job"]["dump_folder"], config["model"]["tokenizer_path"], config["training"]["dataset_path"]]
    pod = node_pod_spec(job)
    claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    (node,) = [c for c in pod["containers"] if c["name"] == "node"]
    mounts = [m["mountPath"].rstrip("/") + "/" for m in node["volumeMounts"] if m["name"] in claims]
    assert [p for p in paths if not any(p.startswith(m) for m in mounts)] == []
    assert config["metrics"]["enable_wandb"] is True
    assert {m["mountPath"] for m in node["volumeMounts"]} >= {"/dev/shm"}


def test_wandb_key_comes_from_the_secret_users_create(job):
    env = {e["name"]: e for e in job["spec"]["trainer"]["env"]}
    ref = env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert "value" not in env["WANDB_API_KEY"]
    create = re.search(r"kubectl create secret generic (\S+) --from-literal=(\S+)=", MANIFEST.read_text())
    assert create and (ref["name"], ref["key"]) == create.groups()
    assert {"WANDB_PROJECT", "WANDB_TEAM", "WANDB_RUN_NAME"} <= set(env)  # the names metrics.py reads


def test_image_is_the_default_bake_tag(job):
    hcl2 = pytest.importorskip("hcl2")
    bake = hcl2.loads((REPO / "docker-bake.hcl").read_text())
    defaults = {k.strip('"'): v["default"].strip('"') for block in bake["variable"] for k, v in block.items()}
    assert job["spec"]["trainer"]["image"] == f"{defaults['REGISTRY']}/llm-training:{defaults['TAG']}"
