"""docker/smoke_test.sh, run against this checkout through a stand-in `docker` client: every command it
sends into the image (imports from the repository root, the start-up build of `activation`, one CPU step
of motif3_debug through run_train_kubeflow.sh) works on the code as it is. The real image build and
`docker run` need Docker and are not run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# `docker run --rm [-e K=V]... [--gpus all] IMAGE CMD...` -> CMD run in the repository root (the image's
# WORKDIR) with those variables. pip installs go to a per-"container" folder (PIP_TARGET, first on
# PYTHONPATH) so the start-up build cannot touch the test's own environment.
FAKE_DOCKER = textwrap.dedent(
    """\
    #!{python}
    import json, os, subprocess, sys, tempfile
    args = sys.argv[1:]
    assert args[:2] == ["run", "--rm"], args
    args, env = args[2:], dict(os.environ)
    while args[0].startswith("-"):
        flag, value, args = args[0], args[1], args[2:]
        if flag == "-e":
            key, _, val = value.partition("=")
            env[key] = val
        else:
            assert (flag, value) == ("--gpus", "all"), (flag, value)
    image, cmd = args[0], args[1:]
    site = tempfile.mkdtemp(prefix="container-site-", dir={tmp!r})
    env.update(PIP_TARGET=site, PYTHONPATH=site)
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"image": image, "cmd": cmd}}) + "\\n")
    sys.exit(subprocess.run(cmd, cwd={repo!r}, env=env).returncode)
    """
)


@pytest.mark.slow  # three interpreter starts, torchrun and one training step: ~15 s on an idle core
def test_smoke_script_commands_run_on_this_checkout(tmp_path):
    log = tmp_path / "docker_runs.jsonl"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text(FAKE_DOCKER.format(python=sys.executable, tmp=str(tmp_path), log=str(log), repo=str(REPO)))
    fake.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "WANDB_")) and k != "PYTHONPATH"}
    env.update(PATH=path, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(REPO / "docker" / "smoke_test.sh"), "registry.test/llm-training:ci"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["image"] for r in runs] == ["registry.test/llm-training:ci"] * 3
    assert "imports ok:" in out and "4/4 skipped" in out and "passed: registry.test/llm-training:ci" in out
    assert runs[2]["cmd"][:2] == ["bash", "run_train_kubeflow.sh"]
    assert "step 1/1" in out  # the training step ran and was logged
    built = next(tmp_path.glob("container-site-*/activation/__init__.py"))  # the start-up build's output
    assert f"{built}" in out  # ... and that copy is the one `import activation` found
