"""Find and read the code dsfix inserts (templates/save_safetensors.py) without importing it.

The template is parsed with libcst only, so the patch path never imports torch.
It ships inside the wheel as ``patcher.templates``; an editable or source-tree run
falls back to the top-level ``templates/`` folder.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from patcher.errors import DsfixError

TEMPLATE_FILE = "save_safetensors.py"
PUBLIC_NAMES = ("save_hf_format_safetensors", "save_zero_three_model_safetensors")
STRATEGIES = ("clone", "dedupe")


def is_dsfix_name(name: str) -> bool:
    """Top-level names that belong to dsfix's inserted block, in any template version."""
    return name in PUBLIC_NAMES or name.startswith("_dsfix_") or name.startswith("_DSFIX_")


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
    body: str  # the top-level definitions, as source text with "\n" newlines and 4-space indents
    path: Path
    statements: tuple = ()  # the same definitions as parsed libcst nodes (4-space indents, "\n")
    public_text: dict = None  # public function name -> its source, as patcher.signature.generate writes it


def template_path() -> Path:
    try:
        from importlib.resources import files

        p = files("patcher.templates").joinpath(TEMPLATE_FILE)
        if p.is_file():
            return Path(str(p))
    except (ModuleNotFoundError, TypeError, FileNotFoundError):
        pass
    p = Path(__file__).resolve().parent.parent / "templates" / TEMPLATE_FILE
    if p.is_file():
        return p
    raise DsfixError(f"dsfix's template {TEMPLATE_FILE} is missing from this installation")


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
    module = cst.parse_module(path.read_bytes())
    imports: list[ImportSpec] = []
    body: list[str] = []
    version = None
    for stmt in module.body:
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
        if isinstance(small, cst.Import):
            imports += [ImportSpec(dotted(a.name)) for a in small.names]
        elif isinstance(small, cst.ImportFrom):
            imports += [ImportSpec(dotted(small.module), a.name.value) for a in small.names]
        elif isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString):
            continue  # the module docstring stays in dsfix
        else:
            name = _defined_name(stmt)
            if name is None or not is_dsfix_name(name):
                raise DsfixError(f"template statement defines {name!r}, which is not a dsfix name", path=str(path))
            if name == "_DSFIX_TEMPLATE_VERSION":
                version = int(small.value.value)
            if name == "_DSFIX_STRATEGY":
                stmt = stmt.with_changes(body=[small.with_changes(value=cst.SimpleString(f'"{strategy}"'))])
            body.append(stmt.with_changes(leading_lines=[]) if not body else stmt)
    if version is None:
        raise DsfixError("template has no _DSFIX_TEMPLATE_VERSION", path=str(path))
    text = module.with_changes(body=body, header=[], footer=[]).code
    public = {_defined_name(s): cst.Module([]).code_for_node(s.with_changes(leading_lines=[]))
              for s in body if _defined_name(s) in PUBLIC_NAMES}
    return Template(version=version, imports=tuple(imports), body=text, path=path, statements=tuple(body),
                    public_text=public)


def _defined_name(stmt: cst.CSTNode) -> str | None:
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            target = small.targets[0].target if isinstance(small, cst.Assign) else small.target
            if isinstance(target, cst.Name):
                return target.value
    return None
