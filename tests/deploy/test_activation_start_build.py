"""scripts/build_activation_at_start.sh: two concurrent start-up builds from one shared checkout both
succeed, never write into the checkout, ignore its stale build/ and *.egg-info, and clean up after
themselves."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_activation_at_start.sh"


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256): what a build must leave untouched."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def shared_checkout_with_stale_build(root: Path) -> Path:
    """A copy of activations/ as a shared checkout looks after an earlier in-place build: build/lib holds
    a module the source no longer has, and an egg-info lists it."""
    src = root / "shared" / "activations"
    shutil.copytree(REPO / "activations", src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    stale = src / "build" / "lib" / "activation"
    stale.mkdir(parents=True)
    (stale / "removed_module.py").write_text("raise ImportError('stale build output')\n")
    (src / "activation.egg-info").mkdir()
    (src / "activation.egg-info" / "SOURCES.txt").write_text("activation/removed_module.py\n")
    return src


def build_env(src: Path, node_tmp: Path) -> dict[str, str]:
    env = dict(os.environ, ACTIVATION_SRC=str(src), TMPDIR=str(node_tmp), PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    return env


def test_two_concurrent_builds_from_one_shared_checkout(tmp_path):
    src = shared_checkout_with_stale_build(tmp_path)
    before = tree_digest(src)
    node_tmp = tmp_path / "node-tmp"  # both builds on one node: they share TMPDIR as well
    node_tmp.mkdir()
    targets = [tmp_path / "site-a", tmp_path / "site-b"]
    builds = [
        subprocess.Popen(
            ["bash", str(SCRIPT), "--target", str(target)],
            env=build_env(src, node_tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for target in targets
    ]
    outputs = [b.communicate(timeout=300)[0] for b in builds]
    assert [b.returncode for b in builds] == [0, 0], outputs
    assert tree_digest(src) == before  # nothing written into (or removed from) the shared checkout
    assert list(node_tmp.iterdir()) == []  # the node-local copies are gone
    for target in targets:
        assert (target / "activation" / "api.py").is_file()
        assert len(list(target.glob("activation-0.1.0.dist-info"))) == 1
        assert not (target / "activation" / "removed_module.py").exists()  # the stale build/ did not leak in
        probe = subprocess.run(
            [sys.executable, "-c", "import activation; print(activation.__file__)"],
            env=dict(os.environ, PYTHONPATH=str(target)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0, probe.stderr
        assert Path(probe.stdout.strip()) == target / "activation" / "__init__.py"


def test_missing_source_folder_names_the_variable(tmp_path):
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=build_env(tmp_path / "nope", tmp_path), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert f"{tmp_path / 'nope'}/pyproject.toml not found; set ACTIVATION_SRC" in proc.stderr
