"""Find and read the code dsfix inserts (templates/save_safetensors.py) without importing it.

The template is read as text and analysed with Python's ``ast``, so the patch path never imports torch
and never needs libcst to parse the template. It ships inside the wheel as ``patcher.templates``; an
editable or source-tree run falls back to the top-level ``templates/`` folder.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from patcher.errors import DsfixError
from patcher.resources import resource_path
from patcher.patch.names import PUBLIC_NAMES, is_dsfix_name

TEMPLATE_FILE = "save_safetensors.py"
LOADER_FILE = "load_safetensors.py"
STRATEGIES = ("clone", "dedupe")
_STRATEGY_LINE = re.compile(r'^_DSFIX_STRATEGY = "[a-z]+"$', re.M)


@dataclass(frozen=True)
class ImportSpec:
    module: str  # "json" for `import json`; "safetensors" for `from safetensors import safe_open`
    name: str | None = None  # None for a plain `import module`

    @property
    def token(self) -> str:
        return self.module if self.name is None else f"{self.module}:{self.name}"

    @classmethod
    def from_token(cls, token: str) -> "ImportSpec":
        module, _, name = token.partition(":")
        return cls(module, name or None)

    def source(self) -> str:
        return f"import {self.module}" if self.name is None else f"from {self.module} import {self.name}"


@dataclass(frozen=True)
class Template:
    version: int
    imports: tuple  # of ImportSpec
    body: str  # the inserted code, as source text with "\n" newlines and 4-space indents
    path: Path
    public: dict = field(default_factory=dict)  # public name -> (start, end) character span in body
    docstrings: dict = field(default_factory=dict)  # public name -> its docstring line, as written

    def text(self, public_text: dict) -> str:
        """The body with each public function replaced by ``public_text[name]`` (where given)."""
        out, at = [], 0
        for name, (start, end) in sorted(self.public.items(), key=lambda kv: kv[1]):
            if name in public_text:
                out += [self.body[at:start], public_text[name]]
                at = end
        return "".join(out) + self.body[at:]


def template_path(name: str = TEMPLATE_FILE) -> Path:
    return resource_path("templates", name)


def dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{dotted(node.value)}.{node.attr.value}"
    raise TypeError(node)


@functools.lru_cache(maxsize=None)
def load_template(strategy: str = "clone") -> Template:
    if strategy not in STRATEGIES:
        raise DsfixError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    path = template_path()
    return parse_template(path.read_text(encoding="utf-8"), strategy, path)


@functools.lru_cache(maxsize=None)
def load_loader() -> Template:
    """The code dsfix inserts into model_utils.py so that step 3 reads safetensors."""
    path = template_path(LOADER_FILE)
    return parse_template(path.read_text(encoding="utf-8"), None, path)


def parse_template(source: str, strategy: str | None = "clone", path: Path = Path(TEMPLATE_FILE)) -> Template:
    """The template's imports, and the text to insert: from the comment lines right above its first
    statement after the imports to the end, the strategy constant (if any) set to ``strategy``."""
    if strategy is not None:
        source, n = _STRATEGY_LINE.subn(f'_DSFIX_STRATEGY = "{strategy}"', source)
        if n != 1:
            raise DsfixError('template has no line `_DSFIX_STRATEGY = "..."`', path=str(path))
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    imports, version, first, public, docs = [], None, None, {}, {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            imports += [ImportSpec(a.name) for a in stmt.names]
            continue
        if isinstance(stmt, ast.ImportFrom):
            imports += [ImportSpec(stmt.module, a.name) for a in stmt.names]
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and first is None:
            continue  # the module docstring stays in dsfix
        name = _ast_name(stmt)
        if name is None or not is_dsfix_name(name):
            raise DsfixError(f"template statement at line {stmt.lineno} defines {name!r}, which is not a dsfix name",
                             path=str(path))
        if name == "_DSFIX_TEMPLATE_VERSION":
            version = stmt.value.value
        if name in PUBLIC_NAMES:
            public[name] = (starts[stmt.lineno - 1], starts[stmt.end_lineno])
            doc = stmt.body[0]
            docs[name] = "".join(lines[doc.lineno - 1:doc.end_lineno]).strip() if isinstance(doc, ast.Expr) else '""'
        if first is None:
            first = stmt
    if version is None or first is None:
        raise DsfixError("template has no _DSFIX_TEMPLATE_VERSION", path=str(path))
    start = first.lineno - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1  # the comment right above the first statement goes in with it
    offset = starts[start]
    public = {name: (a - offset, b - offset) for name, (a, b) in public.items()}
    return Template(version=version, imports=tuple(imports), body=source[offset:], path=path, public=public,
                    docstrings=docs)


def _ast_name(stmt) -> str | None:
    if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
        return stmt.name
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return stmt.target.id
    return None


def defined_name(stmt: cst.CSTNode) -> str | None:
    """The name a top-level statement defines (a function, a class, ``NAME = ...``), else None."""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            target = small.targets[0].target if isinstance(small, cst.Assign) else small.target
            if isinstance(target, cst.Name):
                return target.value
    return None
