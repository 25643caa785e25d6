"""Every import question in one place: which names an import binds (on ``ast`` and on libcst), whether a file
already imports something, adding an import in the file's own style, removing one, and dropping the imports
an edit left unused.

Models: libcst's ``AddImportsVisitor`` / ``RemoveImportsVisitor`` gather what exists before adding, and remove
an import only when nothing reads it any more.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Sequence, Union

import libcst as cst

from patcher.patch.names import dotted


@dataclass(frozen=True)
class ImportSpec:
    """An absolute import: ``import module`` (``name`` None) or ``from module import name``."""

    module: str
    name: str | None = None

    @property
    def token(self) -> str:
        """How dsfix's marker line records it: ``json``, ``safetensors:safe_open``."""
        return self.module if self.name is None else f"{self.module}:{self.name}"

    @classmethod
    def from_token(cls, token: str) -> "ImportSpec":
        module, _, name = token.partition(":")
        return cls(module, name or None)

    def source(self) -> str:
        return f"import {self.module}" if self.name is None else f"from {self.module} import {self.name}"


# ----------------------------------------------------------------------------- what an import binds (ast)


def bindings(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """[(bound name, qualified name or None)] for an ``ast.Import``/``ast.ImportFrom``: ``import a.b`` binds
    ``a`` as ``a``, ``import a.b as c`` binds ``c`` as ``a.b``, ``from a import b as c`` binds ``c`` as
    ``a.b``; a relative import's names are not qualified. A star import binds nothing here (the caller
    decides what it brings)."""
    out: list[tuple[str, str | None]] = []
    if isinstance(node, ast.Import):
        for a in node.names:
            top = a.name.split(".")[0]
            out.append((a.asname, a.name) if a.asname else (top, top))
        return out
    for a in node.names:
        if a.name != "*":
            qualified = f"{node.module}.{a.name}" if node.module and not node.level else None
            out.append((a.asname or a.name, qualified))
    return out


def module_candidates(node) -> tuple:
    """Dotted module names an import statement makes available as modules (a from-import: the module, and
    each imported name, which may be a submodule)."""
    if isinstance(node, ast.Import):
        return tuple(a.name for a in node.names)
    if node.level or node.module is None:
        return ()
    return (node.module, *(f"{node.module}.{a.name}" for a in node.names if a.name != "*"))


# ----------------------------------------------------------------------------- what a module imports (libcst)


def alias_name(alias: cst.ImportAlias) -> str:
    """The name imported: ``a.b`` for ``import a.b as c``."""
    return alias.evaluated_name


def bound_name(alias: cst.ImportAlias) -> str:
    """The name an import binds: ``c`` for ``import a.b as c``, ``a`` for ``import a.b``."""
    return alias.evaluated_alias or alias.evaluated_name.split(".")[0]


def from_module(small: cst.CSTNode | None) -> str | None:
    """M for an absolute ``from M import names`` (not a star import), else None."""
    if isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None \
            and not isinstance(small.names, cst.ImportStar):
        return dotted(small.module)
    return None


def from_names(small: cst.CSTNode) -> Sequence[cst.ImportAlias]:
    """The names a ``from M import names`` lists; none for a star import or another statement."""
    if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
        return small.names
    return ()


Import = Union[cst.Import, cst.ImportFrom]


def top_import(stmt: cst.CSTNode) -> Import | None:
    """The import a top-level statement is, when it is a single import on its line."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, (cst.Import, cst.ImportFrom)):
            return small
    return None


def module_aliases(tree: ast.Module) -> dict:
    """bound name -> qualified name for a module's top-level absolute imports (``osp`` -> ``os.path``)."""
    return {bound: q for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            for bound, q in bindings(node) if q is not None}


def binds(tree: ast.Module, name: str, segment) -> bool:
    """Whether a module binds ``name`` at its top level in some other way than a def: an import (a star import
    may bring it), an assignment, a class, or anything under an if or a try that mentions it (dsfix cannot
    tell, so it does not refuse). ``segment(node)``: a statement's source text."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(b == name for b, _q in bindings(node)):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, (ast.If, ast.Try)) and name in segment(node):
            return True
    return False


def present_in(tree: ast.Module, spec: ImportSpec) -> bool:
    """``present`` on ``ast``: whether the module imports ``spec`` (without an alias) at module level, in any
    if/try/with/loop block."""
    blocks = [tree.body]
    while blocks:
        for node in blocks.pop():
            if isinstance(node, ast.Import) and spec.name is None:
                if any(a.name == spec.module and a.asname is None for a in node.names):
                    return True
            if isinstance(node, ast.ImportFrom) and spec.name is not None and not node.level:
                if node.module == spec.module and any(a.name == spec.name and a.asname is None for a in node.names):
                    return True
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                blocks += [getattr(node, f) for f in ("body", "orelse", "finalbody")
                           if isinstance(getattr(node, f, None), list)]
                blocks += [h.body for h in getattr(node, "handlers", ())]
    return False


def _module_scope_statements(body):
    """Top-level statements, descending into if/try/with/loop blocks but never into defs or classes."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (cst.If, cst.Try, cst.With, cst.For, cst.While)) or type(stmt).__name__ == "TryStar":
            blocks = [stmt.body, getattr(stmt, "orelse", None), getattr(stmt, "finalbody", None)]
            blocks += [h.body for h in getattr(stmt, "handlers", ())]
            for b in blocks:
                while b is not None and not isinstance(b, (cst.IndentedBlock, cst.SimpleStatementSuite)):
                    b = getattr(b, "body", None)  # Else / Finally / elif (If) wrappers
                if b is not None:
                    yield from _module_scope_statements(b.body)
            if isinstance(stmt, cst.If) and isinstance(stmt.orelse, cst.If):
                yield from _module_scope_statements([stmt.orelse])


def present(module: cst.Module, spec: ImportSpec) -> bool:
    """Whether the module already imports ``spec`` (without an alias), at module level, under any block."""
    for stmt in _module_scope_statements(module.body):
        if not isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            continue
        for small in stmt.body:
            if spec.name is None and isinstance(small, cst.Import):
                if any(alias_name(a) == spec.module and a.asname is None for a in small.names):
                    return True
            if spec.name is not None and from_module(small) == spec.module:
                if any(alias_name(a) == spec.name and a.asname is None for a in from_names(small)):
                    return True
    return False


# ----------------------------------------------------------------------------- adding and removing (libcst)


def _comma(after: str = " ") -> cst.Comma:
    return cst.Comma(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(after))


def insert_alias_after(names: Sequence[cst.ImportAlias], pos: int, new: cst.ImportAlias) -> list[cst.ImportAlias]:
    """Insert ``new`` after ``names[pos]``, in the list's own comma style (exact inverse: remove_alias)."""
    names = list(names)
    if pos < len(names) - 1:
        return names[: pos + 1] + [new.with_changes(comma=names[pos].comma)] + names[pos + 1:]
    last = names[-1]
    if isinstance(last.comma, cst.Comma):  # a trailing comma, as in a parenthesised list over several lines
        sep = names[-2].comma if len(names) > 1 else _comma()
        return names[:-1] + [last.with_changes(comma=sep), new.with_changes(comma=last.comma)]
    return names[:-1] + [last.with_changes(comma=_comma()), new.with_changes(comma=cst.MaybeSentinel.DEFAULT)]


def remove_alias(names: Sequence[cst.ImportAlias], k: int) -> list[cst.ImportAlias]:
    names = list(names)
    if k == len(names) - 1 and k > 0:
        return names[: k - 1] + [names[k - 1].with_changes(comma=names[k].comma)]
    return names[:k] + names[k + 1:]


def insert_index(body) -> int:
    """Where a new top-level import goes: after the last top-level import that comes before the first def or
    class (or after a docstring)."""
    idx = 0
    for i, stmt in enumerate(body):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if top_import(stmt) is not None:
            idx = i + 1
        elif i == 0 and isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr):
            idx = max(idx, 1)
    return idx


def add(module: cst.Module, specs) -> tuple:
    """(module, the specs added): the imports that are missing, merged into an existing ``from M import ...``
    when there is one, else on a line of their own after the file's imports."""
    body, added = list(module.body), []
    for spec in specs:
        if present(module.with_changes(body=body), spec):
            continue
        merged = False
        if spec.name is not None:
            for i, stmt in enumerate(body):
                small = top_import(stmt)
                if small is not None and from_module(small) == spec.module:
                    listed = from_names(small)
                    names = insert_alias_after(listed, len(listed) - 1, cst.ImportAlias(cst.Name(spec.name)))
                    body[i] = stmt.with_changes(body=[small.with_changes(names=names)])
                    merged = True
                    break
        if not merged:
            new = cst.parse_statement(spec.source() + module.default_newline, config=module.config_for_parsing)
            body.insert(insert_index(body), new)
        added.append(spec)
    return module.with_changes(body=body), added


def remove(body: list, spec: ImportSpec) -> list:
    """``body`` without the import of ``spec`` (its line, or its name from a list)."""
    for i, stmt in enumerate(body):
        small = top_import(stmt)
        if small is None or isinstance(small.names, cst.ImportStar):
            continue
        if spec.name is None and isinstance(small, cst.Import):
            want = spec.module
        elif spec.name is not None and from_module(small) == spec.module:
            want = spec.name
        else:
            continue
        for k, alias in enumerate(small.names):
            if alias_name(alias) == want and alias.asname is None:
                if len(small.names) == 1:
                    return body[:i] + body[i + 1:]
                body = list(body)
                body[i] = stmt.with_changes(body=[small.with_changes(names=remove_alias(small.names, k))])
                return body
    return body
