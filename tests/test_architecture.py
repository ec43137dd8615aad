"""Structural rules of the package, checked on the source: the import graph of `llm_training` has no cycle, no
module under `llm_training/layers/` (model math) uses torch.distributed, and the design the code cites lives in the
repository: no tracked file points at a document outside it, and every `docs/model-spec.md §N` /
`docs/architecture.md §N` citation names a section heading that exists."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llm_training"
REPO = PACKAGE.parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Every llm_training module this module imports, at module level or inside functions (TYPE_CHECKING
    blocks excluded: they never run). `from a.b import c` names a.b.c when that is a module, else a.b."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m == "llm_training" or m.startswith("llm_training.")}


def import_graph() -> dict[str, set[str]]:
    """module -> the llm_training modules it imports (a package's __init__ counts for every module inside it,
    since importing a.b.c runs a/__init__ and a/b/__init__ first)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for target in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            while target and target not in files:  # `from pkg import name` where name is not a module
                target = target.rpartition(".")[0]
            parts = target.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))  # parents' __init__ run first
        own_parents = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")) + 1)}
        graph[name] = {t for t in targets if t in files} - own_parents
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert "llm_training.trainer.trainer" in graph and graph["llm_training.trainer.trainer"]  # the scan sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layers_never_use_torch_distributed():
    offenders = []
    for path in sorted((PACKAGE / "layers").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [ast.unparse(node)]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not offenders, "model code must stay collective-free: " + ", ".join(offenders)


def test_layers_import_nothing_from_distributed():
    """Model math never reaches into the parallelism that is applied to it from outside."""
    graph = import_graph()
    offenders = {
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith("llm_training.layers")
        for target in targets
        if target.startswith("llm_training.distributed")
    }
    assert not offenders, sorted(offenders)


CONTEXT_PARALLEL = "llm_training.distributed.context_parallel"


def test_context_parallel_code_lives_in_its_package_and_is_reached_through_it():
    """Every context-parallel module is under distributed/context_parallel/, and code outside that package uses
    the package's own interface (its __init__), never its algorithm modules (ring, ulysses, halo, ...)."""
    stray = [
        p.name
        for p in (PACKAGE / "distributed").glob("*.py")
        if any(word in p.stem for word in ("ring", "ulysses", "halo", "cp_", "context_parallel", "block_attention"))
    ]
    assert not stray, f"context-parallel modules outside {CONTEXT_PARALLEL}: {stray}"
    graph = import_graph()
    inside = {m for m in graph if m.startswith(CONTEXT_PARALLEL)}
    assert {f"{CONTEXT_PARALLEL}.{m}" for m in ("ring", "ulysses", "halo", "sharding", "block_attention")} <= inside
    reaching_in = {
        f"{module} -> {target}"
        for module, targets in graph.items()
        if not module.startswith(CONTEXT_PARALLEL)
        for target in targets
        if target.startswith(CONTEXT_PARALLEL + ".")
    }
    assert not reaching_in, sorted(reaching_in)


# ---------------------------------------------------------------------- design documents live in the repo
# Spelled in pieces so that this file does not match its own search.
FOREIGN_DOC_REFERENCES = (
    "shared/" + "design",  # the design folder outside the checkout
    "ARCHITECTURE" + ".md",  # now docs/architecture.md
    "performance" + "-notes",  # folded into docs/architecture.md §7
    "model-spec" + " §",  # the old citation form: cite docs/model-spec.md §N
)
CITED_DOCS = ("docs/model-spec.md", "docs/architecture.md")
_SECTION = r"§\d+(?:\.\d+)*"
_SECTION_LIST = rf"{_SECTION}(?:\s*(?:,|/|and|or)\s*{_SECTION})*"
_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


def tracked_text_files() -> dict[str, str]:
    """path -> text of every file git tracks in this checkout (binary files skipped)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (the citation checks read `git ls-files`)")
    files = {}
    for name in out.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file():
            continue
        try:
            files[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return files


def section_numbers(markdown: str) -> set[str]:
    """The numbers of the numbered headings of a markdown page: `## 4. Title` -> "4", `### 8.1 Title` -> "8.1"."""
    return set(_HEADING.findall(markdown))


def cited_sections(text: str, doc: str) -> list[str]:
    """Every section number cited as `<doc> §N` in `text`, including lists such as `<doc> §6, §2.4` (a backtick
    may close the path: `<doc>` §N)."""
    found = []
    for match in re.finditer(re.escape(doc) + rf"`?\s+({_SECTION_LIST})", text):
        found.extend(re.findall(r"§(\d+(?:\.\d+)*)", match.group(1)))
    return found


def test_no_tracked_file_cites_a_document_outside_the_repo():
    offenders = []
    for name, text in sorted(tracked_text_files().items()):
        for lineno, line in enumerate(text.splitlines(), 1):
            offenders += [f"{name}:{lineno}: {ref!r}" for ref in FOREIGN_DOC_REFERENCES if ref in line]
    assert not offenders, "cite the repo's docs/ instead: " + "; ".join(offenders)


def test_every_cited_section_exists():
    files = tracked_text_files()
    missing = []
    for doc in CITED_DOCS:
        assert doc in files, f"{doc} is not tracked"
        headings = section_numbers(files[doc])
        assert headings, f"{doc} has no numbered section headings"
        for name, text in sorted(files.items()):
            missing += [f"{name}: {doc} §{n}" for n in cited_sections(text, doc) if n not in headings]
    assert not missing, "citations of sections that do not exist: " + "; ".join(missing)


def test_model_spec_keeps_every_section_number_the_code_relies_on():
    """The spec's numbering is the citations' address space: its sections stay, in order."""
    spec = (REPO / "docs" / "model-spec.md").read_text(encoding="utf-8")
    numbers = _HEADING.findall(spec)
    expected = ["0", "0.1", "0.2", "1", "1.1", "1.2", "1.3", "2", "2.1", "2.2", "2.3", "2.4", "3", "3.1", "3.2"]
    expected += ["3.3", "3.4", "4", "4.1", "4.2", "5", "6", "7", "8", "8.1", "8.2", "8.3", "9", "10", "11", "12"]
    assert numbers == expected


def test_citation_parsing_on_planted_text():
    page = "# Title\n## 0. Intro\n## 0.1 Config\n### 8.1 Update\n#### not numbered\n## 10. CP\n"
    assert section_numbers(page) == {"0", "0.1", "8.1", "10"}
    text = "see docs/model-spec.md §6, §2.4,\n    §4.2 and `docs/model-spec.md` §0.1. Also docs/model-spec.md §9."
    assert cited_sections(text, "docs/model-spec.md") == ["6", "2.4", "4.2", "0.1", "9"]
    assert cited_sections("docs/architecture.md §2 step 5", "docs/architecture.md") == ["2"]
