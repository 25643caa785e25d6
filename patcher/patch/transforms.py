"""libcst transformations: insert the template into utils.py, rename the save calls and imports in main.py.

Every function here takes a parsed ``libcst.Module`` and returns a new one plus notes; none does I/O.
Each edit has an exact inverse (``unpatch_*``), so a revert without the state folder still restores
the original bytes when the file was not edited afterwards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from patcher.patch import calls, signature
from patcher.errors import DsfixError
from patcher.patch.names import NEW_NAMES, PUBLIC_NAMES, RENAMES, is_dsfix_name
from patcher.patch.template import ImportSpec, Template, defined_name, dotted

MARKER_PREFIX = "# dsfix:"
MARKER_RE = re.compile(r"^#\s*dsfix:\s*(?P<fields>.*?)\s*(--.*)?$")


@dataclass
class Result:
    """A script's new bytes (None: nothing to do) and what was done."""

    new: bytes | None
    notes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)


# ----------------------------------------------------------------------------- the marker line


def make_marker(version: int, strategy: str | None, added: list, replaced: list, calls: dict = None) -> str:
    fields = [f"template=v{version}", f"strategy={strategy}" if strategy else "kind=loader"]
    if calls:
        fields.append("calls=" + ",".join(f"{new}:{old}" for new, old in calls.items()))
    if added:
        fields.append("added-imports=" + ",".join(s.token for s in added))
    if replaced:
        fields.append("replaced=" + ",".join(replaced))
    return f"{MARKER_PREFIX} {' '.join(fields)} -- inserted by dsfix; undo with `dsfix revert`"


def parse_marker(text: str) -> dict | None:
    m = MARKER_RE.match(text)
    if not m:
        return None
    out = {}
    for tok in m.group("fields").split():
        key, _, value = tok.partition("=")
        out[key] = value
    return out if "template" in out else None


def find_marker(module: cst.Module) -> dict | None:
    for stmt in module.body:
        for line in getattr(stmt, "leading_lines", ()):
            if line.comment is not None:
                info = parse_marker(line.comment.value)
                if info is not None:
                    return info
    return None


# ----------------------------------------------------------------------------- import lists


def _comma(after: str = " ") -> cst.Comma:
    return cst.Comma(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(after))


def insert_alias_after(names: list, pos: int, new: cst.ImportAlias) -> list:
    """Insert ``new`` after ``names[pos]``, in the list's own comma style (exact inverse: remove_alias)."""
    names = list(names)
    if pos < len(names) - 1:
        return names[: pos + 1] + [new.with_changes(comma=names[pos].comma)] + names[pos + 1 :]
    last = names[-1]
    if isinstance(last.comma, cst.Comma):  # a trailing comma, as in a parenthesised list over several lines
        sep = names[-2].comma if len(names) > 1 else _comma()
        return names[:-1] + [last.with_changes(comma=sep), new.with_changes(comma=last.comma)]
    return names[:-1] + [last.with_changes(comma=_comma()), new.with_changes(comma=cst.MaybeSentinel.DEFAULT)]


def remove_alias(names: list, k: int) -> list:
    names = list(names)
    if k == len(names) - 1 and k > 0:
        return names[: k - 1] + [names[k - 1].with_changes(comma=names[k].comma)]
    return names[:k] + names[k + 1 :]


def _alias_name(alias: cst.ImportAlias) -> str:
    return dotted(alias.name)


def _bound_name(alias: cst.ImportAlias) -> str:
    if alias.asname is not None:
        return alias.asname.name.value
    return _alias_name(alias).split(".")[0]


# ----------------------------------------------------------------------------- utils.py


def _module_scope_statements(body):
    """Top-level statements, descending into if/try/with blocks but never into defs or classes."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (cst.If, cst.Try, cst.With, cst.For, cst.While)) or type(stmt).__name__ == "TryStar":
            blocks = [stmt.body]
            blocks += [getattr(stmt, "orelse", None), getattr(stmt, "finalbody", None)]
            blocks += [h.body for h in getattr(stmt, "handlers", ())]
            for b in blocks:
                while b is not None and not isinstance(b, (cst.IndentedBlock, cst.SimpleStatementSuite)):
                    b = getattr(b, "body", None)  # Else / Finally / elif (If) wrappers
                if b is not None:
                    yield from _module_scope_statements(b.body)
            if isinstance(stmt, cst.If) and isinstance(stmt.orelse, cst.If):
                yield from _module_scope_statements([stmt.orelse])


def _imports_present(module: cst.Module, spec: ImportSpec) -> bool:
    for stmt in _module_scope_statements(module.body):
        if not isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            continue
        for small in stmt.body:
            if spec.name is None and isinstance(small, cst.Import):
                if any(_alias_name(a) == spec.module and a.asname is None for a in small.names):
                    return True
            if spec.name is not None and _from_import(small) == spec.module:
                if any(_alias_name(a) == spec.name and a.asname is None for a in small.names):
                    return True
    return False


def _from_import(small) -> str | None:
    """M for an absolute `from M import names` (not a star import), else None."""
    if isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None \
            and not isinstance(small.names, cst.ImportStar):
        return dotted(small.module)
    return None


def _top_import(stmt) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, (cst.Import, cst.ImportFrom)):
            return small
    return None


def _import_insert_index(body) -> int:
    """After the last top-level import that comes before the first def or class (or after a docstring)."""
    idx = 0
    for i, stmt in enumerate(body):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if _top_import(stmt) is not None:
            idx = i + 1
        elif i == 0 and isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr):
            idx = max(idx, 1)
    return idx


def _add_imports(module: cst.Module, specs) -> tuple:
    """Add the imports that are missing, merged into an existing `from M import ...` when there is one."""
    body = list(module.body)
    added = []
    for spec in specs:
        if _imports_present(module.with_changes(body=body), spec):
            continue
        merged = False
        if spec.name is not None:
            for i, stmt in enumerate(body):
                small = _top_import(stmt)
                if _from_import(small) == spec.module:
                    names = insert_alias_after(small.names, len(small.names) - 1, cst.ImportAlias(cst.Name(spec.name)))
                    body[i] = stmt.with_changes(body=[small.with_changes(names=names)])
                    merged = True
                    break
        if not merged:
            new = cst.parse_statement(spec.source() + module.default_newline, config=module.config_for_parsing)
            body.insert(_import_insert_index(body), new)
        added.append(spec)
    return module.with_changes(body=body), added


def _remove_import(body: list, spec: ImportSpec) -> list:
    for i, stmt in enumerate(body):
        small = _top_import(stmt)
        if small is None or isinstance(small.names, cst.ImportStar):
            continue
        if spec.name is None and isinstance(small, cst.Import):
            want = spec.module
        elif spec.name is not None and _from_import(small) == spec.module:
            want = spec.name
        else:
            continue
        for k, alias in enumerate(small.names):
            if _alias_name(alias) == want and alias.asname is None:
                if len(small.names) == 1:
                    return body[:i] + body[i + 1 :]
                body = list(body)
                body[i] = stmt.with_changes(body=[small.with_changes(names=remove_alias(small.names, k))])
                return body
    return body


def block_text(tpl: Template, defs: dict, marker: str, indent: str = "    ", newline: str = "\n") -> str:
    """dsfix's block as inserted: two blank lines, the marker, then the template's code with its public
    functions made to take the checkout's own parameters, in the file's indentation and newlines."""
    public = {}
    for name in PUBLIC_NAMES:
        text = signature.generate(defs[NEW_NAMES[name]], tpl.docstrings[name])
        if text != tpl.body[slice(*tpl.public[name])]:
            public[name] = text
    return _in_style("\n\n" + marker + "\n" + tpl.text(public), indent, newline)


def _in_style(text: str, indent: str, newline: str) -> str:
    """Code written with 4-space indents and "\n" newlines, in a file's own indentation and newlines."""
    if indent != "    ":
        lines = []
        for line in text.split("\n"):
            stripped = line.lstrip(" ")
            n = len(line) - len(stripped)
            lines.append(indent * (n // 4) + " " * (n % 4) + stripped)
        text = "\n".join(lines)
    return text.replace("\n", newline)


_PLACEHOLDER = "_DSFIX_BLOCK_GOES_HERE"


def _with_block(module: cst.Module, block: str) -> str:
    """The module's code with its placeholder statement replaced by ``block``."""
    code = module.code
    at = code.index(_PLACEHOLDER)
    end = at + len(_PLACEHOLDER)
    if code.startswith(module.default_newline, end):
        return code[:at] + block + code[end + len(module.default_newline):]
    return code[:at] + block[: -len(module.default_newline)] + code[end:]  # the file ended without a newline


@dataclass
class UtilsResult:
    new: bytes
    notes: list
    defs: dict  # old save name -> signature.SaveDef


def patch_utils(data: bytes, module: cst.Module, tpl: Template, strategy: str, rel: str = "") -> UtilsResult:
    """Insert (or upgrade) dsfix's block right after save_hf_format, plus the imports it needs.

    A hand-written function of the same name (the widely copied fix) is replaced in place, and the
    imports only it used are dropped, so pyflakes finds nothing new.
    """
    notes = []
    info = find_marker(module)
    base = unpatch_utils(module, keep_replaced=True) if info else module
    if not any(isinstance(s, cst.FunctionDef) and s.name.value == "save_hf_format" for s in base.body):
        raise DsfixError("has no top-level function save_hf_format to add the safetensors save beside")
    defs = signature.find_defs(base, rel, data)
    for d in defs.values():
        notes += list(d.notes) if info is None else []  # told when the block went in; an update only changes it
    replaced, kept, slot = [], [], None
    after = _block_predecessor(module) if info else None
    for stmt in base.body:
        name = defined_name(stmt)
        if name is not None and is_dsfix_name(name):
            replaced.append(name)
            slot = len(kept) if slot is None else slot
        else:
            kept.append(stmt)
            if stmt is after:  # dsfix's block stays where it stands (say, at the end where a hand edit was)
                slot = len(kept)
    if slot is None:
        slot = next(i for i, s in enumerate(kept) if isinstance(s, cst.FunctionDef) and s.name.value == "save_hf_format") + 1
    kept.insert(slot, cst.SimpleStatementLine([cst.Expr(cst.Name(_PLACEHOLDER))]))
    new = base.with_changes(body=kept)
    if replaced:
        new, dropped = _drop_orphaned_imports(base, new)
        notes += [f"replaced a hand-written {n} with dsfix's (the original is kept for `dsfix revert`)" for n in replaced]
        notes += [f"dropped the import of {d}, which only the replaced code used" for d in dropped]
    if info and info.get("replaced"):
        replaced = info["replaced"].split(",") + [r for r in replaced if r not in info["replaced"].split(",")]
    new, added = _add_imports(new, tpl.imports)
    before = [ImportSpec.from_token(t) for t in info["added-imports"].split(",")] if info and info.get(
        "added-imports") else []
    fresh = [a for a in added if a not in before]  # the imports an earlier apply added are in the file already
    if fresh:
        notes.append("added imports: " + ", ".join(s.source() for s in fresh))
    added = before + fresh
    marker = make_marker(tpl.version, strategy, added, replaced)
    code = _with_block(new, block_text(tpl, defs, marker, new.default_indent, new.default_newline))
    try:
        out = code.encode(module.encoding)
    except UnicodeEncodeError as e:
        raise DsfixError(f"the new code cannot be written in this file's encoding ({module.encoding}): {e}", path=rel)
    if info:
        what = [f"template {info.get('template')} -> v{tpl.version}"] if info.get("template") != f"v{tpl.version}" else []
        what += [f"strategy {info.get('strategy')} -> {strategy}"] if info.get("strategy") != strategy else []
        if what:
            notes.insert(0, "updates dsfix's block: " + ", ".join(what))
    return UtilsResult(out, notes if out != data else [], defs)


def _block_predecessor(module: cst.Module):
    """The statement right before dsfix's block (unpatch_utils keeps it as the same node)."""
    prev = None
    for stmt in module.body:
        name = defined_name(stmt)
        if name is not None and is_dsfix_name(name):
            return prev
        prev = stmt
    return None


def _drop_orphaned_imports(before: cst.Module, after: cst.Module) -> tuple:
    """Remove top-level imported names that ``before`` used and ``after`` no longer uses."""
    bound = {}
    for stmt in after.body:
        small = _top_import(stmt)
        if small is not None and not isinstance(small.names, cst.ImportStar):
            for alias in small.names:
                bound[_bound_name(alias)] = alias
    used_before, used_after = calls.module_reads(before.code, bound), calls.module_reads(after.code, bound)
    orphans = {n for n in bound if used_before[n] > 0 and used_after[n] == 0}
    if not orphans:
        return after, []
    body, dropped, removed_stmts = list(after.body), [], 0
    for i in range(len(body)):
        small = _top_import(body[i - removed_stmts])
        if small is None or isinstance(small.names, cst.ImportStar):
            continue
        j = i - removed_stmts
        names = list(small.names)
        for k in reversed(range(len(names))):
            if _bound_name(names[k]) in orphans:
                dropped.append(_bound_name(names[k]))
                names = remove_alias(names, k) if len(names) > 1 else []
        if not names:
            del body[j]
            removed_stmts += 1
        elif len(names) != len(small.names):
            body[j] = body[j].with_changes(body=[small.with_changes(names=names)])
    return after.with_changes(body=body), sorted(dropped)


def unpatch_utils(module: cst.Module, keep_replaced: bool = False) -> cst.Module:
    """Remove dsfix's block and the imports it added (as recorded in its marker line)."""
    info = find_marker(module)
    if info is None:
        return module
    if info.get("replaced") and not keep_replaced:
        raise DsfixError(
            f"dsfix replaced a hand-written {info['replaced']} here; its text is kept only in the state folder, "
            "which is gone, so it cannot be restored structurally",
            code=1,
        )
    body = [s for s in module.body if not ((n := defined_name(s)) is not None and is_dsfix_name(n))]
    for tok in (info.get("added-imports") or "").split(","):
        if tok:
            body = _remove_import(body, ImportSpec.from_token(tok))
    return module.with_changes(body=body)


# ----------------------------------------------------------------------------- model_utils.py (step 3's loader)

LOADER_FUNCTION = "create_critic_model"
LOADER_CALLS = {"exists": "_dsfix_checkpoint_exists", "load": "_dsfix_load_checkpoint"}  # callee's last name -> new


class _LoaderCalls(cst.CSTTransformer):
    """In create_critic_model: ``torch.load(X, ...)`` and ``os.path.exists(X)`` -> dsfix's loader functions
    (``renames``: new name -> callee as written), or back (``back``: new name -> callee to restore)."""

    def __init__(self, back: dict = None):
        super().__init__()
        self.back = back
        self.renamed = {}  # new name -> callee as written

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        if self.back is not None:
            if isinstance(func, cst.Name) and func.value in self.back:
                return updated.with_changes(func=cst.parse_expression(self.back[func.value]))
            return updated
        try:
            name = dotted(func)
        except TypeError:
            return updated
        last = name.rsplit(".", 1)[-1]
        if last == "load" and name.split(".")[0] == "torch" or last == "exists" and "path" in name:
            new = LOADER_CALLS[last]
            self.renamed[new] = name
            return updated.with_changes(func=cst.Name(new))
        return updated


def patch_loader(data: bytes, module: cst.Module, tpl: Template, rel: str = "") -> UtilsResult:
    """Insert dsfix's loader right before create_critic_model, and make that function read the step-2
    folder through it: safetensors first, else the .bin with weights_only=True."""
    info = find_marker(module)
    base = unpatch_loader(module) if info else module
    at = next((i for i, s in enumerate(base.body) if isinstance(s, cst.FunctionDef)
               and s.name.value == LOADER_FUNCTION), None)
    if at is None:
        raise DsfixError(f"has no top-level function {LOADER_FUNCTION} (step 3's critic loader) to adapt")
    editor = _LoaderCalls()
    fn = base.body[at].visit(editor)
    if "_dsfix_load_checkpoint" not in editor.renamed:
        raise DsfixError(f"{LOADER_FUNCTION} loads no checkpoint with torch.load; dsfix does not know how it reads "
                         "the step-2 output")
    body = list(base.body)
    body[at:at + 1] = [cst.SimpleStatementLine([cst.Expr(cst.Name(_PLACEHOLDER))]), fn]
    new, added = _add_imports(base.with_changes(body=body), tpl.imports)
    notes = [f"{LOADER_FUNCTION}: {old}(...) -> {new_name}(...)" for new_name, old in editor.renamed.items()]
    if added:
        notes.append("added imports: " + ", ".join(s.source() for s in added))
    if info and info.get("added-imports"):
        before = [ImportSpec.from_token(t) for t in info["added-imports"].split(",")]
        added = before + [a for a in added if a not in before]
    marker = make_marker(tpl.version, None, added, [], editor.renamed)
    code = _with_block(new, _in_style("\n\n" + marker + "\n" + tpl.text({}), new.default_indent, new.default_newline))
    try:
        out = code.encode(module.encoding)
    except UnicodeEncodeError as e:
        raise DsfixError(f"the new code cannot be written in this file's encoding ({module.encoding}): {e}", path=rel)
    return UtilsResult(out, notes if out != data else [], {})


def unpatch_loader(module: cst.Module) -> cst.Module:
    """Remove dsfix's loader block and its imports, and give create_critic_model its calls back."""
    info = find_marker(module)
    if info is None:
        return module
    back = dict(pair.split(":", 1) for pair in (info.get("calls") or "").split(",") if ":" in pair)
    new = unpatch_utils(module)
    body = [s.visit(_LoaderCalls(back)) if isinstance(s, cst.FunctionDef) and s.name.value == LOADER_FUNCTION else s
            for s in new.body]
    return new.with_changes(body=body)


# ----------------------------------------------------------------------------- main.py


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
            arg = arg.with_changes(comma=arg.comma.with_changes(whitespace_after=shift(arg.comma.whitespace_after, nxt)))
        args.append(arg)
    first = found.args[0] if found.args else None
    return call.with_changes(args=args, whitespace_before_args=shift(call.whitespace_before_args, first))


def _callee(func) -> str | None:
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return None


class _MainEditor(cst.CSTTransformer):
    """A libcst pass over main.py, or over one statement of it: rename the calls found by patcher.patch.calls
    (matched to libcst's nodes by their place among the candidate calls, in source order, from ``first``),
    and edit the import lists."""

    def __init__(self, found: calls.ScriptCalls, renames: dict, imports: "_ImportEditor", first: int = 0):
        super().__init__()
        self.callees = set(found.candidates)
        self.renames = renames  # candidate index -> (SaveCall, new name)
        self.imports = imports
        self.first = first
        self.index = {}  # id(original Call) -> candidate index
        self.seen = []

    def visit_Call(self, node: cst.Call) -> None:
        callee = _callee(node.func)
        if callee in self.callees:
            self.index[id(node)] = self.first + len(self.seen)
            self.seen.append(callee)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        at = self.index.get(id(original))
        if at is None or at not in self.renames:
            return updated
        found, new = self.renames[at]
        func = updated.func
        old = _callee(func)
        if isinstance(func, cst.Name):
            updated = updated.with_changes(func=func.with_changes(value=new))
        else:
            updated = updated.with_changes(func=func.with_changes(attr=cst.Name(new)))
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
        self.notes = []

    def edit(self, node: cst.ImportFrom) -> cst.ImportFrom:
        if _from_import(node) not in self.modules:
            return node
        names = list(node.names)
        k = 0
        while k < len(names):
            alias = names[k]
            old = _alias_name(alias)
            if old not in self.mapping or old not in self.touched:
                k += 1
                continue
            new = self.mapping[old]
            if alias.asname is None and new not in self.needed:
                k += 1  # only called through the module (u.save_hf_format): this import stays as it is
                continue
            if alias.asname is not None:
                names[k] = alias.with_changes(name=cst.Name(new))
                self.notes.append(f"import {old} as {_bound_name(alias)} -> import {new} as {_bound_name(alias)}")
            elif old in self.still_used:
                if new not in self.imported:
                    names = insert_alias_after(names, k, cst.ImportAlias(cst.Name(new)))
                    self.imported.add(new)
                    self.notes.append(f"import {new} beside {old} (still used elsewhere)")
                    k += 1
            elif new in self.imported:
                names = remove_alias(names, k)
                self.notes.append(f"dropped the now unused import {old}")
                continue
            else:
                names[k] = alias.with_changes(name=cst.Name(new))
                self.imported.add(new)
                self.notes.append(f"import {old} -> import {new}")
            k += 1
        return node.with_changes(names=names)


TRACKED = tuple(RENAMES) + tuple(NEW_NAMES)


def find_save_calls(data: bytes, modules: tuple, rel: str = "main.py") -> tuple:
    """(decoded text, calls.ScriptCalls) for a script."""
    tree, decoded = calls.parse_script(data, rel)
    return decoded, calls.find_calls(tree, decoded.text, modules, TRACKED, strings=tuple(RENAMES))


def _spliced(text: str, base: int, splices: list) -> str:
    """``text`` (found at offset ``base`` of the whole script) with the splices that fall inside it made."""
    out, at = [], 0
    for start, end, new in splices:
        if base <= start and end <= base + len(text):
            out += [text[at:start - base], new]
            at = end - base
    return "".join(out) + text[at:]


def _edit(text: str, found: calls.ScriptCalls, renames: dict, imports: "_ImportEditor", newline: str,
          splices: list = ()) -> str:
    """Run the editor over each statement to edit, each parsed by libcst on its own, and splice the results
    back into ``text``: every other character stays as it was. A statement whose text is not a module by
    itself (an if/for/def holding a call in its header) makes libcst parse the whole file instead.
    ``splices``: (start, end, new text) renames of uses that are not calls, made in the text first."""
    if any(site.compound for site in found.sites):
        editor = _MainEditor(found, renames, imports)
        module = cst.parse_module(_spliced(text, 0, splices), config=cst.PartialParserConfig(default_newline=newline))
        new = module.visit(editor).code
        _check_matched(editor.seen, found.candidates)
        return new
    out, at = [], 0
    config = cst.PartialParserConfig(default_newline=newline)
    for site in found.sites:
        editor = _MainEditor(found, renames, imports, first=site.first)
        snippet = cst.parse_module(_spliced(text[site.start:site.end], site.start, splices), config=config)
        out += [_spliced(text[at:site.start], at, splices), snippet.visit(editor).code]
        at = site.end
        _check_matched(editor.seen, found.candidates[site.first:site.first + site.count])
    return "".join(out) + _spliced(text[at:], at, splices)


def _check_matched(seen: list, expected: list) -> None:
    if seen != expected:  # pragma: no cover - ast and libcst disagree: a dsfix bug, caught before writing
        raise DsfixError("dsfix could not match the calls it found with ast to libcst's nodes")


def _newline(text: str) -> str:
    m = re.search(r"\r\n|\r|\n", text)
    return m.group(0) if m else "\n"


def rename_calls(decoded: calls.Decoded, found: calls.ScriptCalls, mapping: dict, modules: tuple) -> Result:
    """The script's bytes with every call and every other use of a ``mapping`` key renamed, and its imports
    edited to match."""
    mine = [c for c in found.calls if c.name in mapping]
    values = [u for u in found.uses if u.name in mapping]
    renames = {c.index: (c, mapping[c.name]) for c in mine if not _aliased(c)}  # aliased: the import is renamed
    if not mine and not values:
        return Result(None, [])
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
    imports = _ImportEditor(mapping, modules, touched, still_used, needed, imported)
    splices = [(u.start, u.end, mapping[u.name]) for u in values if u.how == u.name or "." in u.how]
    text = _edit(decoded.text, found, renames, imports, _newline(decoded.text), splices)
    notes = [_call_note(c.name, c.how, mapping[c.name]) for c in mine]
    notes += [_use_note(u, mapping[u.name]) for u in values]
    return Result(text.encode(decoded.encoding), _dedupe(notes) + imports.notes)


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


def _dedupe(items):
    seen, out = {}, []
    for it in items:
        seen[it] = seen.get(it, 0) + 1
    for it, n in seen.items():
        out.append(it if n == 1 else f"{it} ({n} calls)")
    return out


def _aliased(c: calls.SaveCall) -> bool:
    """Called through an import alias (``save_z3(...)``): the import is renamed, not the call."""
    return "." not in c.how and c.how != c.name


def patch_main(data: bytes, modules: tuple, defs: dict, rel: str = "main.py") -> Result:
    """Rename the save calls and every other use of the save functions, after checking that each call binds
    to dsfix's function as it bound to the checkout's own (``defs``: old name -> signature.SaveDef, from
    patch_utils), and that each other use may refer to dsfix's function instead."""
    decoded, found = find_save_calls(data, modules, rel)
    old = [c for c in found.calls if c.name in RENAMES]
    values = [u for u in found.uses if u.name in RENAMES]
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
        check_binding(defs[NEW_NAMES.get(c.name, c.name)], c)
    for u in values:
        check_passable(defs[u.name], u)
    res = rename_calls(decoded, found, RENAMES, modules)
    res.warnings = unconfigured_saves(found.calls) if old or not values else []
    return res


def check_passable(sd, use: calls.Use) -> None:
    """A use that is not a call (the function stored or passed on) is called later with arguments dsfix
    cannot see: it may refer to dsfix's function only when that takes exactly the fork's parameters."""
    names = {p.name for p in sd.params}
    if any(p.kind == "varkw" for p in sd.params) and not all(e in names for e in signature.EXTRAS):
        raise DsfixError(f"{use.how} is used as a value (stored or passed on), and dsfix's {RENAMES[sd.name]} "
                         f"takes keywords ({', '.join(signature.EXTRAS)}) that the fork's **{sd.params[-1].name} "
                         "would have taken; call it directly instead", line=use.line)


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


def check_binding(sd, call: calls.SaveCall) -> None:
    """The call must bind to dsfix's function, each argument to the parameter of the same name (and so the
    same meaning) that it reaches in the checkout's own function."""
    new = RENAMES[sd.name]
    ours = signature.params_of(sd.header(new) + "\n    pass\n")
    try:
        before = signature.bind(sd.params, call.args)
    except ValueError as e:
        raise DsfixError(f"{call.how}(...) does not bind to the checkout's own {sd.name}: it {e}; it would raise "
                         "TypeError already, and dsfix will not rewrite it", line=call.line) from None
    try:
        after = signature.bind(ours, call.args)
    except ValueError as e:  # pragma: no cover - the parameters are copied, so this is a dsfix bug
        raise DsfixError(f"{call.how}(...) would not bind to {new}: it {e}", line=call.line) from None
    if before != after:  # pragma: no cover - likewise
        raise DsfixError(f"{call.how}(...) would pass its arguments to other parameters of {new}", line=call.line)


def unpatch_main(data: bytes, modules: tuple, rel: str = "main.py") -> Result:
    return rename_calls(*find_save_calls(data, modules, rel), NEW_NAMES, modules)


def main_is_patched(data: bytes, modules: tuple, rel: str = "main.py") -> bool:
    found = find_save_calls(data, modules, rel)[1]
    return any(c.name in NEW_NAMES for c in [*found.calls, *found.uses])
