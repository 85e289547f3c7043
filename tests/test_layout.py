"""The repository's layout holds as CONTRIBUTING.md states it: the core imports only numpy and
numba besides the standard library, the library imports nothing of the demo, the benchmarks
or the tests, no two modules import each other (directly or around a longer loop), and the
two ports mirror each other file for file except the files CONTRIBUTING names. Reads the
sources with ``ast``; imports nothing of them. Fast; needs no Horovod."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source directory -> the package it is installed as (pyproject.toml's package-dir).
PACKAGES = {
    "hvd_compress": "hvd_compress",
    "pt": "hvd_compress.pt",
    "tf": "hvd_compress.tf",
    "examples": "hvd_compress.examples",
    "benchmarks": "benchmarks",
    "tests": "tests",
}
LIBRARY = ("hvd_compress", "hvd_compress.kernels", "hvd_compress.pt", "hvd_compress.tf")
# llvmlite is numba's compiler, installed with it (the kernels emit LLVM IR through it).
CORE_THIRD_PARTY = {"numpy", "numba", "llvmlite"}


def _modules():
    """{module name: path} of every Python file of the packages."""
    modules = {}
    for directory, package in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = path.relative_to(ROOT / directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _modules()


def _package_of(name):
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name):
    """The absolute names ``name`` imports: ``from a import b`` gives ``a.b`` where that is a
    module of the repository, else ``a``. Imports under ``if TYPE_CHECKING:`` are left out:
    they never run."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package_of(name).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    return found


GRAPH = {name: {i for i in _imports(name) if i in MODULES and i != name} for name in MODULES}


def _in_library(name):
    return any(name == p or name.startswith(p + ".") for p in LIBRARY) and not name.startswith(
        "hvd_compress.examples"
    )


def test_the_library_imports_nothing_of_the_demo_the_benchmarks_or_the_tests():
    reaching_out = {
        name: sorted(i for i in GRAPH[name] if not _in_library(i))
        for name in MODULES
        if _in_library(name)
    }
    assert not {k: v for k, v in reaching_out.items() if v}


def test_the_core_imports_only_numpy_and_numba_besides_the_standard_library():
    core = [n for n, path in MODULES.items() if path.is_relative_to(ROOT / "hvd_compress")]
    outside = {}
    for name in core:
        top = {i.split(".")[0] for i in _imports(name)} - {"hvd_compress"}
        foreign = top - set(sys.stdlib_module_names) - CORE_THIRD_PARTY
        if foreign:
            outside[name] = sorted(foreign)
    assert not outside


def _cycles(graph):
    """The strongly connected components of the import graph with more than one module
    (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other():
    assert not _cycles(GRAPH)


def test_the_cycle_check_finds_a_loop_of_three():
    graph = {name: set(imported) for name, imported in GRAPH.items()}
    graph["tests.harness"].add("tests.test_layout")
    graph["tests.test_layout"] = {"tests.zygote"}
    graph["tests.zygote"].add("tests.harness")
    assert ["tests.harness", "tests.test_layout", "tests.zygote"] in _cycles(graph)


# The files of one port only, each named in CONTRIBUTING.md's layout with the reason.
ONE_PORT_ONLY = {
    "pt/bucketing.py",
    "pt/flight.py",
    "pt/triton_fused.py",
    "pt/triton_kernels.py",
    "tf/callbacks.py",
    "tf/decoding.py",
    "tf/elastic.py",
    "tf/local_aggregation.py",
    "tf/local_variables.py",
    "tf/tape.py",
    "tf/xla.py",
    "tf/xla_fused.py",
}


@pytest.mark.parametrize("port, twin", [("pt", "tf"), ("tf", "pt")])
def test_the_ports_mirror_each_other_file_for_file(port, twin):
    files = {p.name for p in (ROOT / port).glob("*.py")}
    unmatched = {f"{port}/{name}" for name in files if not (ROOT / twin / name).exists()}
    assert unmatched == {f for f in ONE_PORT_ONLY if f.startswith(port + "/")}


def test_contributing_names_every_file_of_one_port():
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert not [f for f in sorted(ONE_PORT_ONLY) if f"`{f}`" not in contributing]
