"""The fixer of step 3's critic loader (``model_utils.py``, which defines ``create_critic_model``): dsfix's
two loader functions (templates/load_safetensors.py) go right before it, and its ``os.path.exists`` and
``torch.load`` calls of the step-2 ``pytorch_model.bin`` are renamed to them, so step 3 reads a step-2
output saved as safetensors (or the .bin, with ``weights_only=True``).
"""

from __future__ import annotations

import libcst as cst
from libcst.helpers import ensure_type

from patcher.errors import DsfixError
from patcher.patch import imports
from patcher.patch.fixers.base import (
    Context,
    Fixer,
    Patched,
    Target,
    dsfix_text,
    find_marker,
    in_style,
    is_dsfix_statement,
    make_marker,
    placeholder,
    with_block,
)
from patcher.patch.imports import ImportSpec
from patcher.patch.names import dotted
from patcher.patch.source import encode, parse_cst, render
from patcher.patch.template import load_loader

LOADER_FUNCTION = "create_critic_model"
LOADER_CALLS = {"exists": "_dsfix_checkpoint_exists", "load": "_dsfix_load_checkpoint"}  # callee's last name -> new


class _LoaderCalls(cst.CSTTransformer):
    """In create_critic_model: ``torch.load(X, ...)`` and ``os.path.exists(X)`` -> dsfix's loader functions
    (``renamed``: new name -> callee as written), or back (``back``: new name -> callee to restore)."""

    def __init__(self, back: dict | None = None):
        super().__init__()
        self.back = back
        self.renamed: dict[str, str] = {}

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        if self.back is not None:
            if isinstance(func, cst.Name) and func.value in self.back:
                return updated.with_changes(func=cst.parse_expression(self.back[func.value]))
            return updated
        name = dotted(func)
        if name is None:
            return updated
        last = name.rsplit(".", 1)[-1]
        if last == "load" and name.split(".")[0] == "torch" or last == "exists" and "path" in name:
            new = LOADER_CALLS[last]
            self.renamed[new] = name
            return updated.with_changes(func=cst.Name(new))
        return updated


def _is_loader(stmt) -> bool:
    return isinstance(stmt, cst.FunctionDef) and stmt.name.value == LOADER_FUNCTION


def take_out_loader(module: cst.Module) -> cst.Module:
    """The module without dsfix's loader block and its imports, create_critic_model's calls given back."""
    info = find_marker(module)
    if info is None:
        return module
    back = dict(pair.split(":", 1) for pair in (info.get("calls") or "").split(",") if ":" in pair)
    body = [s.visit(_LoaderCalls(back)) if _is_loader(s) else s for s in module.body if not is_dsfix_statement(s)]
    for token in filter(None, (info.get("added-imports") or "").split(",")):
        body = imports.remove(body, ImportSpec.from_token(token))
    return module.with_changes(body=body)


class LoaderFixer(Fixer):
    """model_utils.py: step 3 reads the step-2 output as safetensors."""

    kind = "loader"
    rank = 2

    def patch(self, target: Target, ctx: Context) -> Patched:
        tpl = load_loader()
        module = parse_cst(target.content, target.rel)
        info = find_marker(module)
        base = take_out_loader(module) if info else module
        at = next((i for i, s in enumerate(base.body) if _is_loader(s)), None)
        if at is None:
            raise DsfixError(f"has no top-level function {LOADER_FUNCTION} (step 3's critic loader) to adapt")
        editor = _LoaderCalls()
        fn = ensure_type(base.body[at].visit(editor), cst.FunctionDef)  # the transformer edits only calls
        if "_dsfix_load_checkpoint" not in editor.renamed:
            raise DsfixError(f"{LOADER_FUNCTION} loads no checkpoint with torch.load; dsfix does not know how it "
                             "reads the step-2 output")
        body = list(base.body)
        body[at:at + 1] = [placeholder(), fn]
        new, added = imports.add(base.with_changes(body=body), tpl.imports)
        notes = [f"{LOADER_FUNCTION}: {old}(...) -> {new_name}(...)" for new_name, old in editor.renamed.items()]
        if added:
            notes.append("added imports: " + ", ".join(s.source() for s in added))
        if info and info.get("added-imports"):
            before = [ImportSpec.from_token(t) for t in info["added-imports"].split(",")]
            added = before + [a for a in added if a not in before]
        marker = make_marker(tpl.version, {"kind": "loader",
                                           "calls": ",".join(f"{n}:{o}" for n, o in editor.renamed.items()),
                                           "added-imports": ",".join(s.token for s in added)})
        code = with_block(new, in_style("\n\n" + marker + "\n" + tpl.body, new.default_indent, new.default_newline))
        out = encode(code, module.encoding, target.rel)
        return Patched(out, notes if out != target.data else [])

    def unpatch(self, data: bytes, target: Target, force: bool = False) -> tuple:
        module = parse_cst(data, target.rel)
        new = take_out_loader(module)
        return (render(new, target.rel) if new is not module else data), []

    def is_patched(self, data: bytes, target: Target) -> bool:
        return find_marker(parse_cst(data, target.rel)) is not None

    def own_part(self, data: bytes | None) -> str:
        return "" if data is None else dsfix_text(cst.parse_module(data))

    def edited(self, data: bytes, target: Target, ctx: Context) -> bool:
        info = find_marker(parse_cst(data, target.rel)) or {}
        if info.get("template") != f"v{load_loader().version}":
            return False
        base, _ = self.unpatch(data, target)
        return self.own_part(self.patch(Target(target.rel, "loader", base), ctx).new) != self.own_part(data)
