"""The import graph: the patch path (patcher/patch, and the CLI on its way to check, apply and revert) never
imports the torch side (patcher/checkpoint) nor torch, transformers, DeepSpeed or safetensors, which a plain
``pip install dsfix`` does not install. Read statically from every file, then checked in a fresh process."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from patcher import __version__

PATCHER = Path(__file__).resolve().parent.parent / "patcher"
FORBIDDEN = ("patcher.checkpoint", "torch", "transformers", "deepspeed", "safetensors")


def imported_modules(path: Path, source: bytes = None, from_too: bool = False) -> list:
    """(line, module) of every import in a file, at any depth (inside functions too), relative ones resolved.
    ``from_too``: a ``from a.b import c`` also gives ``a.b`` itself, which the statement imports first."""
    package = ".".join(path.relative_to(PATCHER.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_bytes() if source is None else source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]
            if from_too and all(a.name != "*" for a in node.names):
                out.append((node.lineno, base))
    return out


def forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


PATCH_FILES = sorted(PATCHER.glob("patch/**/*.py"))


def test_every_patch_module_is_checked():
    names = {p.relative_to(PATCHER / "patch").with_suffix("").as_posix() for p in PATCH_FILES}
    assert {"locate", "resolve", "calls", "signature", "imports", "source", "plan", "state", "diff", "template",
            "names", "flow", "fixers/base", "fixers/script", "fixers/utils", "fixers/module", "fixers/loader"} <= names


@pytest.mark.parametrize("path", PATCH_FILES, ids=[p.name for p in PATCH_FILES])
def test_patch_modules_import_nothing_of_the_torch_side(path):
    assert [f"{path.name}:{line}: {m}" for line, m in imported_modules(path) if forbidden(m)] == []


IMPORT_CASES = [
    # (source in a file of patcher/patch, what the reader finds, whether it is forbidden there)
    ("import torch", "torch", True),
    ("import torchvision", "torchvision", False),
    ("from patcher.checkpoint import verify", "patcher.checkpoint.verify", True),
    ("def f():\n    from transformers import AutoConfig", "transformers.AutoConfig", True),
    ("from ..checkpoint import convert", "patcher.checkpoint.convert", True),
    ("from . import calls", "patcher.patch.calls", False),
    ("import deepspeed.ops as ops", "deepspeed.ops", True),
    ("from safetensors.torch import save_file", "safetensors.torch.save_file", True),
]


@pytest.mark.parametrize("source, module, bad", IMPORT_CASES, ids=[c[0] for c in IMPORT_CASES])
def test_the_reader_sees_every_form(source, module, bad):
    found = imported_modules(PATCHER / "patch" / "probe.py", source.encode())
    assert [(m, forbidden(m)) for _, m in found] == [(module, bad)]


TORCH_SIDE = sorted(".".join(p.relative_to(PATCHER.parent).with_suffix("").parts).removesuffix(".__init__")
                    for p in PATCHER.glob("checkpoint/**/*.py"))
# Modules that define torch classes (an nn.Module subclass) import torch at their top: they are imported only
# inside the functions that need them, after the input was checked.
IMPORT_TORCH = {"patcher.checkpoint.check.critic"}

PROBE = """
import importlib, json, sys
import patcher.cli, patcher.patch.flow
patch_path = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "deepspeed", "safetensors")
                    or m.startswith("patcher.checkpoint"))
for name in sys.argv[1:]:
    importlib.import_module(name)
torch_side = sorted(m for m in ("torch", "transformers", "deepspeed", "safetensors") if m in sys.modules)
print(json.dumps([patch_path, torch_side]))
"""


def test_a_fresh_process_on_the_patch_path_loads_none_of_it():
    """The patch path loads nothing of the torch side; every module of the torch side (its readers and their
    registry, the checks, the writer, the commands and their reports) imports without torch."""
    modules = [m for m in TORCH_SIDE if m not in IMPORT_TORCH]
    assert {"patcher.checkpoint.readers", "patcher.checkpoint.convert.report", "patcher.checkpoint.write.writer",
            "patcher.checkpoint.smoke.worker"} <= set(modules)
    p = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, cwd=PATCHER.parent,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    patch_path, torch_side = json.loads(p.stdout)
    assert patch_path == []
    assert torch_side == []  # the torch side imports torch inside its functions, when a command needs it


# ----------------------------------------------------------------------------- no import circles


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PATCHER.parent).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict:
    """module -> the patcher modules it imports (at any depth: inside functions too). ``from a.b import c`` is
    an edge to ``a.b`` (whose ``__init__`` runs first), and to ``a.b.c`` too when that is a module."""
    files = {module_name(p): p for p in PATCHER.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges = set()
        for _, target in imported_modules(path, from_too=True):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict) -> list:
    """The import circles of ``graph``: each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, []),
])
def test_the_circle_finder(graph, expected):
    assert cycles(graph) == expected


def test_no_module_imports_another_that_imports_it_back():
    graph = import_graph()
    assert {"patcher.checkpoint.check.verify", "patcher.checkpoint.convert.command"} <= set(graph)
    assert cycles(graph) == []


def test_python_dash_m_patcher_is_the_cli():
    p = subprocess.run([sys.executable, "-m", "patcher", "--version"], capture_output=True, text=True,
                       cwd=PATCHER.parent, timeout=120)
    assert (p.returncode, p.stdout.strip()) == (0, f"dsfix {__version__}"), p.stderr
