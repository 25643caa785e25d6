"""The fixer of utils.py: one import of the save module beside it, and two thin wrappers right after
``save_hf_format``, ``save_hf_format_safetensors`` and ``save_zero_three_model_safetensors``. Each takes the
fork's own parameters, computes the folder as the fork's own function does, and calls the save module with
the options chosen at apply (the strategy, the fork's key filter).

What an earlier dsfix inserted (the v2 and v3 inline blocks, about 320 lines) is taken out first, so an
apply upgrades it in place; a hand-written ``save_hf_format_safetensors`` (the widely copied fix) is
replaced where it stands, and the imports only it used are dropped.
"""

from __future__ import annotations

import re

import libcst as cst

from patcher.errors import DsfixError
from patcher.patch import calls, imports, signature
from patcher.patch.fixers.base import (Context, Fixer, Patched, Target, defined_name, dsfix_text, find_marker,
                                       in_style, is_dsfix_statement, make_marker, placeholder, with_block)
from patcher.patch.imports import ImportSpec
from patcher.patch.names import SAVE_MODULE, SAVE_MODULE_FILE, SAVE_NAMES
from patcher.patch.source import encode, parse_cst, render
from patcher.patch.template import module_version

DOCSTRINGS = {  # what the two wrappers say of themselves
    "save_hf_format": '"""save_hf_format, as safetensors: weights (tied ones too), config.json, tokenizer."""',
    "save_zero_three_model": '"""save_zero_three_model, as safetensors: every rank calls it under ZeRO-3."""',
}
TAIL = "added by dsfix; undo with `dsfix revert`"
ABOUT = f"# The two saves below write safetensors through {SAVE_MODULE_FILE}, beside this file (read it first)."
# How utils.py imports the module beside it: relative where the scripts import utils.py from a package
# (dschat.utils.utils, utils.utils), absolute where they import it as a top-level module, both when both.
MODULE_IMPORTS = {
    "relative": f"from . import {SAVE_MODULE}",
    "absolute": f"import {SAVE_MODULE}",
    "both": f"try:\n    from . import {SAVE_MODULE}\nexcept ImportError:  # utils.py imported as a top-level module\n"
            f"    import {SAVE_MODULE}",
}
_FORMS = {" ".join(text.split()): form for form, text in MODULE_IMPORTS.items()}


def import_form(ctx: Context, module: cst.Module) -> str:
    """Which import of the save module utils.py needs: from the dotted names the scripts import utils.py
    under, else the one the context names (a revert without the state folder), else the one the file holds."""
    dotted = any("." in m for m in ctx.modules)
    top = any("." not in m for m in ctx.modules)
    if dotted or top:
        return "both" if dotted and top else "relative" if dotted else "absolute"
    return ctx.module_import or held_form(module) or "relative"


def held_form(module: cst.Module) -> str | None:
    """The form of the save module's import that the file holds, if any."""
    return next((f for f in (_module_import(module, s) for s in module.body) if f is not None), None)


def _module_import(module: cst.Module, stmt) -> str | None:
    return _FORMS.get(" ".join(module.code_for_node(stmt).split()))


def wrappers(defs: dict, strategy: str) -> str:
    return "\n\n".join(signature.generate(defs[name], DOCSTRINGS[name], strategy) for name in SAVE_NAMES)


def take_out(module: cst.Module, keep_replaced: bool = False) -> cst.Module:
    """The module without what dsfix inserted (any version): its statements, the save module's import and the
    imports its marker line records as added."""
    info = find_marker(module)
    if info is None:
        return module
    if info.get("replaced") and not keep_replaced:
        raise DsfixError(f"dsfix replaced a hand-written {info['replaced']} here; its text is kept only in the "
                         "state folder, which is gone, so it cannot be restored structurally", code=1)
    body = [s for s in module.body if not is_dsfix_statement(s) and _module_import(module, s) is None]
    for token in filter(None, (info.get("added-imports") or "").split(",")):
        body = imports.remove(body, ImportSpec.from_token(token))
    return module.with_changes(body=body)


def _slot(base: cst.Module, module: cst.Module, patched: bool) -> tuple:
    """(base's statements without dsfix-named ones, the names taken out, where the wrappers go): where dsfix's
    block stands now (after the statement before it), or where a hand-written copy stood, else right after
    save_hf_format."""
    after = None
    if patched:
        prev = None
        for stmt in module.body:
            if is_dsfix_statement(stmt):
                after = prev
                break
            prev = stmt
    kept, replaced, slot = [], [], None
    for stmt in base.body:
        if is_dsfix_statement(stmt):
            replaced.append(defined_name(stmt))
            slot = len(kept) if slot is None else slot
            continue
        kept.append(stmt)
        if after is not None and stmt is after:
            slot = len(kept)
    if slot is None:
        slot = 1 + next(i for i, s in enumerate(kept) if isinstance(s, cst.FunctionDef) and s.name.value == "save_hf_format")
    return kept, replaced, slot


class UtilsFixer(Fixer):
    """utils.py: the save module's import, and the two wrappers after save_hf_format."""

    kind = "utils"
    rank = 1
    anchor = True

    def patch(self, target: Target, ctx: Context) -> Patched:
        data, rel = target.data, target.rel
        module = parse_cst(data, rel)
        info = find_marker(module)
        base = take_out(module, keep_replaced=True) if info else module
        if not any(isinstance(s, cst.FunctionDef) and s.name.value == "save_hf_format" for s in base.body):
            raise DsfixError("has no top-level function save_hf_format to add the safetensors save beside")
        ctx.defs = signature.find_defs(base, rel, data)
        notes = [n for d in ctx.defs.values() for n in d.notes] if info is None else []
        kept, replaced, slot = _slot(base, module, info is not None)
        kept.insert(slot, placeholder())
        new = base.with_changes(body=kept)
        if replaced:
            new, dropped = imports.drop_orphaned(base, new, calls.module_reads)
            notes += [f"replaced a hand-written {n} with dsfix's (the original is kept for `dsfix revert`)"
                      for n in replaced]
            notes += [f"dropped the import of {d}, which only the replaced code used" for d in dropped]
        if info and info.get("replaced"):
            replaced = [*info["replaced"].split(","), *(r for r in replaced if r not in info["replaced"].split(","))]
        code, added = self._assemble(new, module, ctx, replaced)
        out = encode(code, module.encoding, rel)
        if not info:
            notes.append(f"adds `{MODULE_IMPORTS[import_form(ctx, module)].splitlines()[0]}`"
                         + (", " + ", ".join(f"`{s.source()}`" for s in added) if added else ""))
        else:
            notes[:0] = _update_notes(info, ctx.strategy)
        return Patched(out, notes if out != data else [])

    def _assemble(self, new: cst.Module, module: cst.Module, ctx: Context, replaced: list) -> tuple:
        """(the file's text with the imports and the marked wrappers in place, the imports added)."""
        text = wrappers(ctx.defs, ctx.strategy)
        needed = [ImportSpec("os")] if re.search(r"\bos\.", text) else []
        new, added = imports.add(new, needed)
        form = import_form(ctx, module)
        statement = cst.parse_statement(MODULE_IMPORTS[form] + "\n", config=new.config_for_parsing)
        body = list(new.body)
        body.insert(imports.insert_index(body), statement)
        new = new.with_changes(body=body)
        marker = make_marker(module_version(), {"strategy": ctx.strategy,
                                                "added-imports": ",".join(s.token for s in added),
                                                "replaced": ",".join(replaced)}, TAIL)
        return with_block(new, in_style(f"\n\n{marker}\n{ABOUT}\n{text}", new)), added

    def unpatch(self, data: bytes, target: Target, force: bool = False) -> tuple:
        module = parse_cst(data, target.rel)
        info = find_marker(module) or {}
        new = take_out(module, keep_replaced=force)
        notes = ["the hand-written function dsfix replaced could not be restored"] if force and info.get("replaced") else []
        return (render(new, target.rel) if new is not module else data), notes

    def is_patched(self, data: bytes, target: Target) -> bool:
        return find_marker(parse_cst(data, target.rel)) is not None

    def own_part(self, data: bytes | None) -> str:
        if data is None:
            return ""
        module = cst.parse_module(data)
        imports_text = "".join(module.code_for_node(s) for s in module.body if _module_import(module, s))
        return imports_text + dsfix_text(module)

    def edited(self, data: bytes, target: Target, ctx: Context) -> bool:
        module = parse_cst(data, target.rel)
        info = find_marker(module) or {}
        if info.get("template") != f"v{module_version()}":
            return False  # an older dsfix's block: nothing to compare it with
        base, _ = self.unpatch(data, target)
        strategy = info.get("strategy") if info.get("strategy") in ("clone", "dedupe") else "clone"
        redo = self.patch(Target(target.rel, "utils", base), Context(strategy, ctx.modules, module_import=held_form(module)))
        return self.own_part(redo.new) != self.own_part(data)


def _update_notes(info: dict, strategy: str) -> list:
    what = [f"template {info.get('template')} -> v{module_version()}"] if info.get("template") != f"v{module_version()}" else []
    what += [f"strategy {info.get('strategy')} -> {strategy}"] if info.get("strategy") != strategy else []
    return ["updates dsfix's block: " + ", ".join(what)] if what else []
