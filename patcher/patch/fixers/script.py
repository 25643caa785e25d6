"""The fixer of step scripts (step-1 ``main.py``, further entry scripts, steps 2 and 3): every call and every
other use of the save functions renamed to dsfix's, and the imports edited to match, each statement edited
by libcst on its own and spliced back so every other character stays as it was.

Which calls count is patcher.patch.calls' (Python's scoping rules, on ``ast``); whether each call binds to
dsfix's function as it bound to the fork's own is patcher.patch.signature's. After planning, ``guard``
refuses a patched script that could still reach an original save function by a route no rename covers.
"""

from __future__ import annotations

from typing import Sequence

import libcst as cst

from patcher.errors import DsfixError
from patcher.patch import calls, imports, reach, signature
from patcher.patch.fixers.base import Context, Fixer, Patched, Target
from patcher.patch.imports import alias_name, bound_name, from_module, from_names
from patcher.patch.names import NEW_NAMES, RENAMES, SAVE_NAMES, last_name
from patcher.patch.source import Decoded, newline_of, parse_script


def _realign(call: cst.Call, found, delta: int) -> cst.Call:
    """Keep arguments that were aligned under the opening parenthesis aligned after a rename."""

    def shift(ws, nxt):
        if (
            isinstance(ws, cst.ParenthesizedWhitespace)
            and nxt is not None
            and nxt.col == found.paren_col + 1
            and len(ws.last_line.value) + delta >= 0
        ):
            return ws.with_changes(last_line=cst.SimpleWhitespace(" " * (len(ws.last_line.value) + delta)))
        return ws

    args = []
    for i, arg in enumerate(call.args):
        nxt = found.args[i + 1] if i + 1 < len(found.args) else None
        if isinstance(arg.comma, cst.Comma):
            comma = arg.comma.with_changes(whitespace_after=shift(arg.comma.whitespace_after, nxt))
            arg = arg.with_changes(comma=comma)
        args.append(arg)
    first = found.args[0] if found.args else None
    return call.with_changes(args=args, whitespace_before_args=shift(call.whitespace_before_args, first))


class _MainEditor(cst.CSTTransformer):
    """A libcst pass over main.py, or over one statement of it: rename the calls found by patcher.patch.calls
    (matched to libcst's nodes by their place among the candidate calls, in source order, from ``first``),
    and edit the import lists."""

    def __init__(self, found: calls.ScriptCalls, renames: dict, editor: "_ImportEditor", first: int = 0):
        super().__init__()
        self.callees = set(found.candidates)
        self.renames = renames  # candidate index -> (SaveCall, new name)
        self.imports = editor
        self.first = first
        self.index: dict[int, int] = {}  # id(original Call) -> candidate index
        self.seen: list[str] = []

    def visit_Call(self, node: cst.Call) -> None:
        callee = last_name(node.func)
        if callee is not None and callee in self.callees:
            self.index[id(node)] = self.first + len(self.seen)
            self.seen.append(callee)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        at = self.index.get(id(original))
        if at is None or at not in self.renames:
            return updated
        found, new = self.renames[at]
        func = updated.func
        if isinstance(func, cst.Name):
            old, updated = func.value, updated.with_changes(func=func.with_changes(value=new))
        elif isinstance(func, cst.Attribute):
            old, updated = func.attr.value, updated.with_changes(func=func.with_changes(attr=cst.Name(new)))
        else:  # pragma: no cover - a candidate is a call of a name (last_name above)
            return updated
        return _realign(updated, found, len(new) - len(old))

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom):
        return self.imports.edit(updated)


class _ImportEditor:
    """Rename (or add beside, or drop) the imported names after the calls were rewritten."""

    def __init__(self, mapping, modules, touched: set, still_used: set, needed: set, imported: set):
        self.mapping = mapping
        self.modules = modules
        self.touched = touched  # old names some call was rewritten for
        self.still_used = still_used  # old names still read after the call rewrite
        self.needed = needed  # new names read bare after the rewrite (so they must be imported)
        self.imported = imported  # names already imported (without an alias) from the utils module
        self.notes: list[str] = []

    def edit(self, node: cst.ImportFrom) -> cst.ImportFrom:
        if from_module(node) not in self.modules:
            return node
        names = list(from_names(node))
        k = 0
        while k < len(names):
            alias = names[k]
            old = alias_name(alias)
            if old not in self.mapping or old not in self.touched:
                k += 1
                continue
            new = self.mapping[old]
            if alias.asname is None and new not in self.needed:
                k += 1  # only called through the module (u.save_hf_format): this import stays as it is
                continue
            if alias.asname is not None:
                names[k] = alias.with_changes(name=cst.Name(new))
                self.notes.append(f"import {old} as {bound_name(alias)} -> import {new} as {bound_name(alias)}")
            elif old in self.still_used:
                if new not in self.imported:
                    names = imports.insert_alias_after(names, k, cst.ImportAlias(cst.Name(new)))
                    self.imported.add(new)
                    self.notes.append(f"import {new} beside {old} (still used elsewhere)")
                    k += 1
            elif new in self.imported:
                names = imports.remove_alias(names, k)
                self.notes.append(f"dropped the now unused import {old}")
                continue
            else:
                names[k] = alias.with_changes(name=cst.Name(new))
                self.imported.add(new)
                self.notes.append(f"import {old} -> import {new}")
            k += 1
        return node.with_changes(names=names)


TRACKED = tuple(RENAMES) + tuple(NEW_NAMES)


def find_save_calls(data: bytes, modules: tuple, rel: str = "main.py") -> tuple[Decoded, calls.ScriptCalls]:
    """(decoded text, calls.ScriptCalls) for a script."""
    tree, decoded = parse_script(data, rel)
    return decoded, calls.find_calls(tree, decoded.text, modules, TRACKED, strings=tuple(RENAMES))


def _spliced(text: str, base: int, splices: Sequence[tuple[int, int, str]]) -> str:
    """``text`` (found at offset ``base`` of the whole script) with the splices that fall inside it made."""
    out, at = [], 0
    for start, end, new in splices:
        if base <= start and end <= base + len(text):
            out += [text[at:start - base], new]
            at = end - base
    return "".join(out) + text[at:]


def _edit(text: str, found: calls.ScriptCalls, renames: dict, import_editor: "_ImportEditor", newline: str,
          splices: Sequence[tuple[int, int, str]] = ()) -> str:
    """Run the editor over each statement to edit, each parsed by libcst on its own, and splice the results
    back into ``text``: every other character stays as it was. A statement whose text is not a module by
    itself (an if/for/def holding a call in its header) makes libcst parse the whole file instead.
    ``splices``: (start, end, new text) renames of uses that are not calls, made in the text first."""
    if any(site.compound for site in found.sites):
        editor = _MainEditor(found, renames, import_editor)
        module = cst.parse_module(_spliced(text, 0, splices), config=cst.PartialParserConfig(default_newline=newline))
        new = module.visit(editor).code
        _check_matched(editor.seen, found.candidates)
        return new
    out, at = [], 0
    config = cst.PartialParserConfig(default_newline=newline)
    for site in found.sites:
        editor = _MainEditor(found, renames, import_editor, first=site.first)
        snippet = cst.parse_module(_spliced(text[site.start:site.end], site.start, splices), config=config)
        out += [_spliced(text[at:site.start], at, splices), snippet.visit(editor).code]
        at = site.end
        _check_matched(editor.seen, found.candidates[site.first:site.first + site.count])
    return "".join(out) + _spliced(text[at:], at, splices)


def _check_matched(seen: list, expected: list) -> None:
    if seen != expected:  # pragma: no cover - ast and libcst disagree: a dsfix bug, caught before writing
        raise DsfixError("dsfix could not match the calls it found with ast to libcst's nodes")


def rename_calls(decoded: Decoded, found: calls.ScriptCalls, mapping: dict, modules: tuple) -> Patched:
    """The script's bytes with every call and every other use of a ``mapping`` key renamed, and its imports
    edited to match."""
    mine = [c for c in found.calls if c.name in mapping]
    values = [u for u in found.uses if u.name in mapping]
    renames = {c.index: (c, mapping[c.name]) for c in mine if not _aliased(c)}  # aliased: the import is renamed
    if not mine and not values:
        return Patched(None, [])
    uses = dict(found.reads)
    moved = [c.name for c, _new in renames.values() if c.how == c.name]  # a bare call renamed
    moved += [u.name for u in values if u.how == u.name]  # a bare use renamed
    for old in moved:  # one read moves from the old name to the new one
        uses[old] = uses.get(old, 0) - 1
        uses[mapping[old]] = uses.get(mapping[old], 0) + 1
    still_used = {old for old in mapping if uses.get(old, 0) > 0}
    needed = {new for new in mapping.values() if uses.get(new, 0) > 0}
    touched = {c.name for c in mine} | {u.name for u in values}
    imported = {bound for bound, q in found.imported.items() if q.rsplit(".", 1)[1] == bound}
    editor = _ImportEditor(mapping, modules, touched, still_used, needed, imported)
    splices = [(u.start, u.end, mapping[u.name]) for u in values if u.how == u.name or "." in u.how]
    text = _edit(decoded.text, found, renames, editor, newline_of(decoded.text), splices)
    notes = [_call_note(c.name, c.how, mapping[c.name]) for c in mine]
    notes += [_use_note(u, mapping[u.name]) for u in values]
    return Patched(text.encode(decoded.encoding), _dedupe(notes) + editor.notes)


def _use_note(u: calls.Use, new: str) -> str:
    if u.how == u.name:
        return f"{u.name} as a value (line {u.line}) -> {new}"
    if u.how.endswith("." + u.name):
        return f"{u.how} as a value (line {u.line}) -> {u.how[: -len(u.name)]}{new}"
    return f"{u.how} as a value (line {u.line}) now refers to {new} (its import is renamed)"


def _call_note(old: str, how: str, new: str) -> str:
    if how == old:
        return f"{old}(...) -> {new}(...)"
    if how.endswith("." + old):
        return f"{how}(...) -> {how[: -len(old)]}{new}(...)"
    return f"{how}(...) now calls {new} (its import is renamed)"


def _dedupe(items: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for it in items:
        seen[it] = seen.get(it, 0) + 1
    for it, n in seen.items():
        out.append(it if n == 1 else f"{it} ({n} calls)")
    return out


def _aliased(c: calls.SaveCall) -> bool:
    """Called through an import alias (``save_z3(...)``): the import is renamed, not the call."""
    return "." not in c.how and c.how != c.name


def unconfigured_saves(found: list) -> list:
    """Warnings for ZeRO-3 save calls with no save_hf_format call in the same function or loop body: that
    output gets weights but no config.json or tokenizer."""
    with_hf = set()
    for c in found:
        if NEW_NAMES.get(c.name, c.name) == "save_hf_format":
            with_hf.update(c.containers)
    return [f"{c.line}: this save_zero_three_model call has no save_hf_format call beside it (same function or loop), "
            "so that output gets no config.json or tokenizer" for c in found
            if NEW_NAMES.get(c.name, c.name) == "save_zero_three_model" and c.containers[-1] not in with_hf]


def _check_uses(found: calls.ScriptCalls, defs: dict) -> None:
    """Refuse, naming the line, what dsfix cannot rewrite: an unsafe use, a script with nothing to rewrite,
    a use of a function utils.py does not define, a call that does not bind, a value that may not be passed."""
    if found.unsafe:
        line, why = found.unsafe[0]
        more = f" (and {len(found.unsafe) - 1} more)" if len(found.unsafe) > 1 else ""
        raise DsfixError(f"{why}{more}; rename or remove that use and run dsfix again", line=line)
    if not found.calls and not found.uses:
        raise DsfixError("has no call of save_hf_format imported from the checkout's utils.py to rewrite")
    absent = sorted((u.line, u.name) for u in [*found.calls, *found.uses] if u.name in RENAMES and defs[u.name].missing)
    if absent:
        line, name = absent[0]
        raise DsfixError(f"uses {name}, which the checkout's utils.py does not define, so the script fails there "
                         "today; fix that use (or define it) and run dsfix again", line=line)
    for c in found.calls:
        signature.check_binding(defs[NEW_NAMES.get(c.name, c.name)], c)
    for u in found.uses:
        if u.name in RENAMES:
            signature.check_passable(defs[u.name], u)


class ScriptFixer(Fixer):
    """Step scripts: the save calls and their imports renamed to dsfix's functions."""

    kind = "script"
    rank = 3

    def patch(self, target: Target, ctx: Context) -> Patched:
        decoded, found = find_save_calls(target.content, target.modules, target.rel)
        _check_uses(found, ctx.saves())
        old = [c for c in found.calls if c.name in RENAMES]
        values = [u for u in found.uses if u.name in RENAMES]
        res = rename_calls(decoded, found, RENAMES, target.modules)
        if res.new is None:
            return Patched(target.data)
        res.warnings = [f"{target.rel}:{w}" for w in unconfigured_saves(found.calls)] if old or not values else []
        return res

    def guard(self, target: Target, new: bytes, ctx: Context) -> None:
        tree, decoded = parse_script(target.content, target.rel)  # the imports, which the rename leaves as they bind
        if not reach.may_reach(tree, decoded.text, target.modules):
            return
        tree, decoded = parse_script(new, target.rel)
        routes = reach.module_routes(tree, decoded.text, target.modules, SAVE_NAMES)
        if routes:
            line, why = routes[0]
            more = f" (and {len(routes) - 1} more)" if len(routes) > 1 else ""
            raise DsfixError(f"{why}{more}: call them directly and run dsfix again", line=line)

    def unpatch(self, data: bytes, target: Target, force: bool = False) -> tuple:
        new = rename_calls(*find_save_calls(data, target.modules, target.rel), NEW_NAMES, target.modules).new
        return (new if new is not None else data), []

    def is_patched(self, data: bytes, target: Target) -> bool:
        found = find_save_calls(data, target.modules, target.rel)[1]
        return any(c.name in NEW_NAMES for c in [*found.calls, *found.uses])
