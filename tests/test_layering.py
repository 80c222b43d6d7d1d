"""The pure packages (the decision core, the simulator, the run-log schema and records)
import nothing from the shell (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE_PACKAGES = ["pearl/core", "pearl/rollout", "pearl/serving", "pearl/sim"]
PURE_FILES = [  # the run-log schema and its records, shared by simulator and shell
    "pearl/runlog/schema.py",
    "pearl/runlog/records.py",
]
ALLOWED_ROOTS = {"pearl", "numpy", "scipy", "pydantic", "__future__"} | {
    # stdlib modules that do no I/O, spawn nothing and read no clock
    "abc",
    "bisect",
    "collections",
    "dataclasses",
    "enum",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "re",
    "statistics",
    "typing",
    "types",
    "fractions",
    "decimal",
}


# pure but for torch: the trainer's loss (pure tensor functions; torch is not a core
# dependency, so pearl/trainer stays out of PURE_PACKAGES)
TORCH_PURE_FILES = ["pearl/trainer/loss.py"]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _pure_files() -> list[Path]:
    in_packages = [
        p for pkg in PURE_PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")
    ]
    return in_packages + [ROOT / f for f in PURE_FILES]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_pure(module: str, pure: set[str]) -> bool:
    """A pure module, or a name imported from one (``from pearl.core.state import X``)."""
    return module in pure or module.rpartition(".")[0] in pure


def test_there_is_a_core_to_check() -> None:
    assert len(_pure_files()) >= 10


@pytest.mark.parametrize("path", _pure_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_packages_import_only_allowed_modules(path: Path) -> None:
    """Outside pearl only the allowed roots; inside pearl only the pure modules (the shell's
    packages, pearl.io, pearl.cli, pearl.control, ..., are never imported)."""
    pure = {_module(p) for p in _pure_files()}
    for lineno, module in _imports(path):
        root = module.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        assert root in ALLOWED_ROOTS, where
        if root == "pearl":
            assert _is_pure(module, pure), where


@pytest.mark.parametrize("name", TORCH_PURE_FILES)
def test_torch_pure_files_import_only_allowed_modules_and_torch(name: str) -> None:
    for lineno, module in _imports(ROOT / name):
        root = module.split(".")[0]
        assert root in ALLOWED_ROOTS - {"pearl"} | {"torch"}, f"{name}:{lineno} imports {module}"


def test_the_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import subprocess\nfrom mpi4py import MPI\nimport time\n")
    roots = {m.split(".")[0] for _, m in _imports(bad)}
    assert roots - ALLOWED_ROOTS == {"subprocess", "mpi4py", "time"}
    pure = {_module(p) for p in _pure_files()}
    assert _is_pure("pearl.core.state", pure) and _is_pure("pearl.runlog.schema.Record", pure)
    assert not _is_pure("pearl.io.documents", pure) and not _is_pure("pearl.runlog.jsonl", pure)


def _module_graph() -> dict[str, set[str]]:
    """pearl's modules and the pearl modules each imports (anywhere in it, lazily too)."""
    modules = {_module(p): p for p in (ROOT / "pearl").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)  # a submodule
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_pearls_modules() -> None:
    graph = _module_graph()
    assert len(graph) > 50
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
