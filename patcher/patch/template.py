"""What dsfix copies and inserts, found and read as text (the patch path never imports torch):

* the save module, ``templates/dsfix_safetensors.py``, copied byte for byte beside utils.py; its version is
  its ``VERSION = N`` line;
* step 3's loader block, ``templates/load_safetensors.py``, inserted into model_utils.py (its imports, then
  its code from the comment above its first statement).

They ship inside the wheel as ``patcher.templates``; an editable or source-tree run falls back to the
top-level ``templates/`` folder.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from patcher.errors import DsfixError
from patcher.patch.imports import ImportSpec
from patcher.patch.names import SAVE_MODULE_FILE, ast_defined_name, is_dsfix_name
from patcher.resources import resource_path

TEMPLATE_FILE = SAVE_MODULE_FILE
LOADER_FILE = "load_safetensors.py"
STRATEGIES = ("clone", "dedupe")
_VERSION_LINE = re.compile(rb"^VERSION = (\d+)\s*(#.*)?$", re.M)


def template_path(name: str = TEMPLATE_FILE) -> Path:
    return resource_path("templates", name)


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise DsfixError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    return strategy


@functools.lru_cache(maxsize=None)
def module_bytes() -> bytes:
    """The save module as dsfix copies it."""
    return template_path().read_bytes()


def version_of(data: bytes) -> int | None:
    """The version of a save module dsfix wrote (its ``VERSION = N`` line); None for another file."""
    if b"dsfix" not in data[:400]:
        return None
    m = _VERSION_LINE.search(data)
    return int(m.group(1)) if m else None


@functools.lru_cache(maxsize=None)
def module_version() -> int:
    version = version_of(module_bytes())
    if version is None:  # pragma: no cover - a broken install
        raise DsfixError("the save module has no `VERSION = N` line; reinstall dsfix", path=str(template_path()))
    return version


@dataclass(frozen=True)
class Template:
    """A block dsfix inserts into a file: the imports it needs and its code."""

    version: int
    imports: tuple  # of ImportSpec
    body: str  # the inserted code, as source text with "\n" newlines and 4-space indents
    path: Path


@functools.lru_cache(maxsize=None)
def load_loader() -> Template:
    """The code dsfix inserts into model_utils.py so that step 3 reads safetensors."""
    path = template_path(LOADER_FILE)
    return parse_template(path.read_text(encoding="utf-8"), path)


def parse_template(source: str, path: Path = Path(LOADER_FILE)) -> Template:
    """A block's imports, and the text to insert: from the comment lines right above its first statement
    after the imports (the module docstring stays in dsfix) to the end."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    imports, version, first = [], None, None
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            imports += [ImportSpec(a.name) for a in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            if stmt.module is None or stmt.level:
                raise DsfixError(f"template line {stmt.lineno}: a relative import", path=str(path))
            imports += [ImportSpec(stmt.module, a.name) for a in stmt.names]
        elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and first is None):
            name = ast_defined_name(stmt)
            if name is None or not is_dsfix_name(name):
                raise DsfixError(f"template statement at line {stmt.lineno} defines {name!r}, which is not a dsfix "
                                 "name", path=str(path))
            value = stmt.value if isinstance(stmt, ast.Assign) else None
            if name == "_DSFIX_TEMPLATE_VERSION" and isinstance(value, ast.Constant) and isinstance(value.value, int):
                version = value.value
            first = first or stmt
    if version is None or first is None:
        raise DsfixError("template has no _DSFIX_TEMPLATE_VERSION", path=str(path))
    start = first.lineno - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1  # the comment right above the first statement goes in with it
    return Template(version=version, imports=tuple(imports), body="".join(lines[start:]), path=path)
