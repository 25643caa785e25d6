"""libcst transformations: insert the template into utils.py, rename the save calls and imports in main.py.

Every function here takes a parsed ``libcst.Module`` and returns a new one plus notes; none does I/O.
Each edit has an exact inverse (``unpatch_*``), so a revert without the state folder still restores
the original bytes when the file was not edited afterwards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider, ScopeProvider

from patcher import signature
from patcher.errors import DsfixError
from patcher.signature import RENAMES
from patcher.template import ImportSpec, Template, _defined_name, dotted, is_dsfix_name

NEW_NAMES = {new: old for old, new in RENAMES.items()}
MARKER_PREFIX = "# dsfix:"
MARKER_RE = re.compile(r"^#\s*dsfix:\s*(?P<fields>.*?)\s*(--.*)?$")


@dataclass
class Result:
    """A transformed module and what was done. ``changed`` renders code, so callers holding the original
    bytes compare those instead (one code generation, not two)."""

    module: cst.Module
    notes: list = field(default_factory=list)
    original: cst.Module | None = None  # None: nothing was done
    defs: dict = field(default_factory=dict)  # utils.py: old save name -> signature.SaveDef
    warnings: list = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.original is not None and self.module.code != self.original.code


# ----------------------------------------------------------------------------- the marker line


def make_marker(version: int, strategy: str, added: list, replaced: list) -> str:
    fields = [f"template=v{version}", f"strategy={strategy}"]
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
            if spec.name is not None and isinstance(small, cst.ImportFrom) and not small.relative:
                if small.module is not None and dotted(small.module) == spec.module and not isinstance(
                    small.names, cst.ImportStar
                ):
                    if any(_alias_name(a) == spec.name and a.asname is None for a in small.names):
                        return True
    return False


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
                if (
                    isinstance(small, cst.ImportFrom)
                    and not small.relative
                    and small.module is not None
                    and dotted(small.module) == spec.module
                    and not isinstance(small.names, cst.ImportStar)
                ):
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
        elif (
            spec.name is not None
            and isinstance(small, cst.ImportFrom)
            and small.module is not None
            and not small.relative
            and dotted(small.module) == spec.module
        ):
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


def public_functions(tpl: Template, defs: dict) -> list:
    """The template's statements, its two public functions made to take the checkout's own parameters."""
    out = []
    for stmt in tpl.statements:
        name = _defined_name(stmt)
        old = NEW_NAMES.get(name)
        if old is not None and isinstance(stmt, cst.FunctionDef):
            doc = signature.code(stmt.body.body[0]).strip()
            text = signature.generate(defs[old], doc)
            if text != tpl.public_text.get(name):
                stmt = cst.parse_statement(text).with_changes(leading_lines=stmt.leading_lines)
        out.append(stmt)
    return out


def _block_statements(module: cst.Module, tpl: Template, marker: str, defs: dict) -> list:
    """The template's statements, in the target file's own indentation and newline style."""
    lead = [cst.EmptyLine(), cst.EmptyLine(), cst.EmptyLine(comment=cst.Comment(marker))]
    stmts = public_functions(tpl, defs)
    if module.default_indent == "    " and module.default_newline == "\n" and stmts:
        stmts[0] = stmts[0].with_changes(leading_lines=lead)  # the nodes render in the target's style: no re-parse
        return stmts
    text = cst.Module(body=stmts).code if any(a is not b for a, b in zip(stmts, tpl.statements)) else tpl.body
    indent = module.default_indent
    if indent != "    ":
        lines = []
        for line in text.split("\n"):
            stripped = line.lstrip(" ")
            n = len(line) - len(stripped)
            lines.append(indent * (n // 4) + " " * (n % 4) + stripped)
        text = "\n".join(lines)
    text = text.replace("\n", module.default_newline)
    block = cst.parse_module(text, config=module.config_for_parsing)
    stmts = list(block.body)
    stmts[0] = stmts[0].with_changes(leading_lines=lead)
    return stmts


def patch_utils(module: cst.Module, tpl: Template, strategy: str, rel: str = "", data: bytes = b"") -> Result:
    """Insert (or upgrade) dsfix's block right after save_hf_format, plus the imports it needs.

    A hand-written function of the same name (the widely copied fix) is replaced in place, and the
    imports only it used are dropped, so pyflakes finds nothing new.
    """
    notes = []
    info = find_marker(module)
    base = unpatch_utils(module, keep_replaced=True).module if info else module
    if not any(isinstance(s, cst.FunctionDef) and s.name.value == "save_hf_format" for s in base.body):
        raise DsfixError("has no top-level function save_hf_format to add the safetensors save beside")
    defs = signature.find_defs(base, rel, data)
    for d in defs.values():
        notes += list(d.notes)
    replaced, kept, slot = [], [], None
    after = _block_predecessor(module) if info else None
    for stmt in base.body:
        name = _defined_name(stmt)
        if name is not None and is_dsfix_name(name):
            replaced.append(name)
            slot = len(kept) if slot is None else slot
        else:
            kept.append(stmt)
            if stmt is after:  # dsfix's block stays where it stands (say, at the end where a hand edit was)
                slot = len(kept)
    if slot is None:
        slot = next(i for i, s in enumerate(kept) if isinstance(s, cst.FunctionDef) and s.name.value == "save_hf_format") + 1
    placeholder = cst.SimpleStatementLine([cst.Pass()])
    kept.insert(slot, placeholder)
    new = base.with_changes(body=kept)
    if replaced:
        new, dropped = _drop_orphaned_imports(base, new)
        notes += [f"replaced a hand-written {n} with dsfix's (the original is kept for `dsfix revert`)" for n in replaced]
        notes += [f"dropped the import of {d}, which only the replaced code used" for d in dropped]
    if info and info.get("replaced"):
        replaced = info["replaced"].split(",") + [r for r in replaced if r not in info["replaced"].split(",")]
    new, added = _add_imports(new, tpl.imports)
    if added:
        notes.append("added imports: " + ", ".join(s.source() for s in added))
    if info and info.get("added-imports"):
        before = [ImportSpec.from_token(t) for t in info["added-imports"].split(",")]
        added = before + [a for a in added if a not in before]
    body = list(new.body)
    at = next(i for i, s in enumerate(body) if s is placeholder)
    body[at : at + 1] = _block_statements(new, tpl, make_marker(tpl.version, strategy, added, replaced), defs)
    new = new.with_changes(body=body)
    if info and (info.get("template") != f"v{tpl.version}" or info.get("strategy") != strategy):
        notes.insert(0, f"upgraded dsfix's block from template {info.get('template')} strategy "
                        f"{info.get('strategy')} to v{tpl.version} strategy {strategy}")
    return Result(new, notes, original=module, defs=defs)


def _block_predecessor(module: cst.Module):
    """The statement right before dsfix's block (unpatch_utils keeps it as the same node)."""
    prev = None
    for stmt in module.body:
        name = _defined_name(stmt)
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
    used_before, used_after = _name_uses(before, bound), _name_uses(after, bound)
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


def unpatch_utils(module: cst.Module, keep_replaced: bool = False) -> Result:
    """Remove dsfix's block and the imports it added (as recorded in its marker line)."""
    info = find_marker(module)
    if info is None:
        return Result(module, [])
    if info.get("replaced") and not keep_replaced:
        raise DsfixError(
            f"dsfix replaced a hand-written {info['replaced']} here; its text is kept only in the state folder, "
            "which is gone, so it cannot be restored structurally",
            code=1,
        )
    body = [s for s in module.body if not ((n := _defined_name(s)) is not None and is_dsfix_name(n))]
    for tok in (info.get("added-imports") or "").split(","):
        if tok:
            body = _remove_import(body, ImportSpec.from_token(tok))
    new = module.with_changes(body=body)
    return Result(new, ["removed dsfix's save_hf_format_safetensors block"], original=module)


# ----------------------------------------------------------------------------- main.py


def _realign(original: cst.Call, call: cst.Call, position, delta: int) -> cst.Call:
    """Keep arguments that were aligned under the opening parenthesis aligned after a rename."""
    paren_col = position(original.func).end.column

    def shift(ws, next_node):
        if (
            isinstance(ws, cst.ParenthesizedWhitespace)
            and next_node is not None
            and position(next_node).start.column == paren_col + 1
            and len(ws.last_line.value) + delta >= 0
        ):
            return ws.with_changes(last_line=cst.SimpleWhitespace(" " * (len(ws.last_line.value) + delta)))
        return ws

    args = []
    for i, arg in enumerate(call.args):
        nxt = original.args[i + 1] if i + 1 < len(original.args) else None
        if isinstance(arg.comma, cst.Comma):
            arg = arg.with_changes(comma=arg.comma.with_changes(whitespace_after=shift(arg.comma.whitespace_after, nxt)))
        args.append(arg)
    first = original.args[0] if original.args else None
    return call.with_changes(args=args, whitespace_before_args=shift(call.whitespace_before_args, first))


class _Renamer(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (QualifiedNameProvider, ScopeProvider, PositionProvider)

    def __init__(self, mapping: dict, modules: tuple, observe: dict = None):
        super().__init__()
        self.mapping = mapping
        self.qualified = {f"{m}.{old}": old for m in modules for old in mapping}
        self.observed = {f"{m}.{name}": name for m in modules for name in (observe or {})}
        self.renamed_calls = []  # (old, how) for notes
        self.calls = []  # (name called, call node, line): every call renamed, and every call of an observed name

    def _match(self, node, table) -> str | None:
        for q in self.get_metadata(QualifiedNameProvider, node, set()):
            if q.name in table:
                return table[q.name]
        return None

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        old = self._match(original.func, self.qualified)
        if old is None:
            seen = self._match(original.func, self.observed) if self.observed else None
            if seen is not None:
                self.calls.append((seen, original, self.get_metadata(PositionProvider, original).start.line))
            return updated
        self.calls.append((old, original, self.get_metadata(PositionProvider, original).start.line))
        func = updated.func
        if isinstance(func, cst.Name):
            if func.value != old:  # called through an alias: the import is renamed instead
                self.renamed_calls.append((old, func.value))
                return updated
            self.renamed_calls.append((old, old))
            new = updated.with_changes(func=func.with_changes(value=self.mapping[old]))
        elif isinstance(func, cst.Attribute) and func.attr.value == old:
            self.renamed_calls.append((old, dotted(func) if _is_dotted(func) else old))
            new = updated.with_changes(func=func.with_changes(attr=cst.Name(self.mapping[old])))
        else:
            return updated
        position = lambda node: self.get_metadata(PositionProvider, node)  # noqa: E731
        return _realign(original, new, position, len(self.mapping[old]) - len(old))


def _is_dotted(node) -> bool:
    try:
        dotted(node)
        return True
    except TypeError:
        return False


class _ImportEditor(cst.CSTTransformer):
    """Rename (or add beside, or drop) the imported names after the calls were rewritten."""

    def __init__(self, mapping, modules, touched: set, still_used: set, needed: set, imported: set):
        super().__init__()
        self.mapping = mapping
        self.modules = modules
        self.touched = touched  # old names some call was rewritten for
        self.still_used = still_used  # old names still referenced after the call rewrite
        self.needed = needed  # new names now referenced bare (so they must be imported)
        self.imported = imported  # names already imported from the utils module
        self.notes = []

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom):
        if updated.relative or updated.module is None or isinstance(updated.names, cst.ImportStar):
            return updated
        if dotted(updated.module) not in self.modules:
            return updated
        names = list(updated.names)
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
        return updated.with_changes(names=names)


def _imported_from(module: cst.Module, modules) -> set:
    found = set()

    class V(cst.CSTVisitor):
        def visit_ImportFrom(self, node):
            if node.module is not None and not node.relative and not isinstance(node.names, cst.ImportStar):
                if dotted(node.module) in modules:
                    found.update(_alias_name(a) for a in node.names if a.asname is None)

    module.visit(V())
    return found


def _name_uses(module: cst.Module, names) -> dict:
    """How many times each name is read in the module (outside import statements)."""
    return _count_uses(MetadataWrapper(module, unsafe_skip_copy=True).resolve(ScopeProvider), names)


def _count_uses(scopes, names) -> dict:
    counts = {n: 0 for n in names}
    for scope in set(scopes.values()):
        if scope is None:
            continue
        for access in scope.accesses:
            if isinstance(access.node, cst.Name) and access.node.value in counts:
                counts[access.node.value] += 1
    return counts


def rename_calls(module: cst.Module, mapping: dict, modules: tuple, observe: dict = None) -> tuple:
    """(Result, calls): the module with the calls renamed and its imports edited, and every call renamed or
    of an ``observe``d name as (name, call node, line)."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    renamer = _Renamer(mapping, modules, observe)
    renamed = wrapper.visit(renamer)
    if not renamer.renamed_calls:
        return Result(module, []), renamer.calls
    # name reads after the rewrite, from the scope analysis the rewrite already ran: each bare call renamed
    # moves one read from the old name to the new one
    uses = _count_uses(wrapper.resolve(ScopeProvider), list(mapping) + list(mapping.values()))
    for old, how in renamer.renamed_calls:
        if how == old:
            uses[old] -= 1
            uses[mapping[old]] += 1
    still_used = {old for old in mapping if uses[old] > 0}
    needed = {new for new in mapping.values() if uses[new] > 0}
    touched = {old for old, _how in renamer.renamed_calls}
    editor = _ImportEditor(mapping, modules, touched, still_used, needed, _imported_from(renamed, modules))
    new = renamed.visit(editor)
    notes = [_call_note(old, how, mapping[old]) for old, how in renamer.renamed_calls]
    return Result(new, _dedupe(notes) + editor.notes, original=module), renamer.calls


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


def patch_main(module: cst.Module, modules: tuple, defs: dict) -> Result:
    """Rename the save calls, after checking that each one binds to dsfix's function as it bound to the
    checkout's own (``defs``: old name -> signature.SaveDef, from patch_utils)."""
    res, calls = rename_calls(module, RENAMES, modules, observe=NEW_NAMES)
    if not calls:
        raise DsfixError("has no call of save_hf_format imported from the checkout's utils.py to rewrite")
    for name, call, line in calls:
        old = NEW_NAMES.get(name, name)
        check_binding(defs[old], call, line)
    res.warnings = unconfigured_saves(module, calls)
    return res


def unconfigured_saves(module: cst.Module, calls: list) -> list:
    """Warnings for ZeRO-3 save calls with no save_hf_format call in the same function or loop body: that
    output gets weights but no config.json or tokenizer."""
    z3 = {id(c): line for name, c, line in calls if NEW_NAMES.get(name, name) == "save_zero_three_model"}
    hf = {id(c) for name, c, _ in calls if NEW_NAMES.get(name, name) == "save_hf_format"}
    if not z3:
        return []
    inner, with_hf = {}, set()

    class V(cst.CSTVisitor):
        def __init__(self):
            self.stack = [module]

        def _push(self, node):
            self.stack.append(node)

        def _pop(self, node):
            self.stack.pop()

        visit_FunctionDef = visit_For = visit_While = _push
        leave_FunctionDef = leave_For = leave_While = _pop

        def visit_Call(self, node):
            if id(node) in z3:
                inner[id(node)] = id(self.stack[-1])
            if id(node) in hf:
                with_hf.update(id(r) for r in self.stack)

    module.visit(V())
    return [f"{line}: this save_zero_three_model call has no save_hf_format call beside it (same function or loop), "
            "so that output gets no config.json or tokenizer" for key, line in sorted(z3.items(), key=lambda kv: kv[1])
            if inner.get(key) not in with_hf]


def check_binding(sd, call: cst.Call, line: int) -> None:
    """The call must bind to dsfix's function, each argument to the parameter of the same name (and so the
    same meaning) that it reaches in the checkout's own function."""
    new = RENAMES[sd.name]
    ours = signature.params_of(sd.header(new) + "\n    pass\n")
    shown = signature.code(call.func)
    try:
        before = signature.bind(sd.params, call)
    except ValueError as e:
        raise DsfixError(f"{shown}(...) does not bind to the checkout's own {sd.name}: it {e}; it would raise "
                         "TypeError already, and dsfix will not rewrite it", line=line) from None
    try:
        after = signature.bind(ours, call)
    except ValueError as e:  # pragma: no cover - the parameters are copied, so this is a dsfix bug
        raise DsfixError(f"{shown}(...) would not bind to {new}: it {e}", line=line) from None
    if before != after:  # pragma: no cover - likewise
        raise DsfixError(f"{shown}(...) would pass its arguments to other parameters of {new}", line=line)


def unpatch_main(module: cst.Module, modules: tuple) -> Result:
    return rename_calls(module, NEW_NAMES, modules)[0]


def main_is_patched(module: cst.Module, modules: tuple) -> bool:
    return bool(rename_calls(module, {}, modules, observe=NEW_NAMES)[1])
