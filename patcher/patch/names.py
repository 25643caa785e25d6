"""The names dsfix looks for and writes, and the one helper that reads a dotted name from a syntax tree."""

from __future__ import annotations

import ast

import libcst as cst

SAVE_NAMES = ("save_hf_format", "save_zero_three_model")  # the checkout's own save functions
RENAMES = {  # each save function -> dsfix's replacement, which its calls are renamed to
    "save_hf_format": "save_hf_format_safetensors",
    "save_zero_three_model": "save_zero_three_model_safetensors",
}
NEW_NAMES = {new: old for old, new in RENAMES.items()}
PUBLIC_NAMES = tuple(RENAMES.values())
SAVE_HF, SAVE_Z3 = RENAMES["save_hf_format"], RENAMES["save_zero_three_model"]  # what smoke calls

MARKER_PREFIX = "# dsfix:"  # how the line that marks dsfix's edits in a file begins (fixers.base.make_marker)
TEMPLATE_MARK = f"{MARKER_PREFIX} template=".encode()  # in a file's bytes: an earlier apply patched it

SAVE_MODULE = "dsfix_safetensors"  # the writer dsfix copies beside utils.py, as a module of that name
SAVE_MODULE_FILE = SAVE_MODULE + ".py"
MODULE_FUNCTIONS = {  # each save function -> the save module's function that dsfix's wrapper calls
    "save_hf_format": f"{SAVE_MODULE}.save_hf_format",
    "save_zero_three_model": f"{SAVE_MODULE}.save_zero_three_model",
}


def ast_defined_name(stmt: ast.stmt) -> str | None:
    """The name a top-level ``ast`` statement defines (a function, a class, ``NAME = ...``, ``NAME: T = ...``),
    else None; ``fixers.base.defined_name`` reads the same from a libcst statement."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return targets[0].id if len(targets) == 1 and isinstance(targets[0], ast.Name) else None


def is_dsfix_name(name: str) -> bool:
    """Top-level names that belong to what dsfix inserts, in any template version (the wrappers of v4, and
    the inline blocks of v2 and v3 with their ``_dsfix_`` helpers and ``_Dsfix`` classes)."""
    return name in PUBLIC_NAMES or name.startswith(("_dsfix_", "_DSFIX_", "_Dsfix"))


def dotted(node) -> str | None:
    """``a.b.c`` for a name or an attribute chain, of ``ast`` or of libcst; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, (ast.Attribute, cst.Attribute)):
        inner = dotted(node.value)
        attr = node.attr if isinstance(node, ast.Attribute) else node.attr.value
        return f"{inner}.{attr}" if inner is not None else None
    return None


def last_name(node) -> str | None:
    """The called name of a callee: ``f`` for ``f`` and for ``x.y.f``; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None
