"""The fixer of utils.py: one import of the save module beside it, and two thin wrappers right after
``save_hf_format``, ``save_hf_format_safetensors`` and ``save_zero_three_model_safetensors``. Each takes the
fork's own parameters, computes the folder as the fork's own function does, and calls the save module with
the options chosen at apply (the strategy, the fork's key filter).

What an earlier dsfix inserted (the v2 and v3 inline blocks, about 320 lines) is taken out first, so an
apply upgrades it in place; a hand-written ``save_hf_format_safetensors`` (the widely copied fix) is
replaced where it stands, and the imports only it used are dropped.

The file is edited as text at the places Python's ``ast`` gives (libcst parses only a statement it edits):
every other character stays as it was. A top-level statement owns the lines from the end of the statement
before it to its own last line (its leading blank lines and comments), and a function also owns the
indented comments right after its body, as libcst counts them.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

import libcst as cst

from patcher.errors import DsfixError
from patcher.patch import imports, reach, signature
from patcher.patch.fixers.base import (
    PLACEHOLDER,
    Context,
    Fixer,
    Patched,
    Target,
    in_style,
    make_marker,
    parse_marker,
    put_block,
)
from patcher.patch.imports import ImportSpec
from patcher.patch.names import PUBLIC_NAMES, SAVE_MODULE, SAVE_MODULE_FILE, SAVE_NAMES, ast_defined_name, is_dsfix_name
from patcher.patch.source import Source, encode, newline_of, parse_script
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
_MARKER = re.compile(r"^#\s*dsfix:.*$", re.M)


class _File:
    """A utils.py as text, with the places of its top-level statements."""

    def __init__(self, data: bytes, rel: str):
        self.rel = rel
        self.tree, decoded = parse_script(data, rel)
        self.body, self.encoding = self.tree.body, decoded.encoding
        self.src = Source(decoded.text)
        self.text = decoded.text
        self.newline = newline_of(self.text)
        m = _MARKER.search(self.text)
        self.marker = parse_marker(m.group(0)) if m else None

    def again(self, text: str) -> "_File":
        """The same file with new text (read anew)."""
        return _File(encode(text, self.encoding, self.rel), self.rel)

    def start(self, i: int) -> int:
        """Where statement ``i``'s own lines begin (its first decorator)."""
        stmt = self.body[i]
        first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", ()))])
        return self.src.starts[first - 1]

    def end(self, i: int) -> int:
        """Where statement ``i`` ends: after its last line, and, for a function or class, after the indented
        comments that follow its body."""
        stmt, last = self.body[i], self.body[i].end_lineno
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            indent = self._indent(stmt.body[0].lineno)
            at = last
            while at < len(self.src.lines) and (not self.src.lines[at].strip() or (
                    self.src.lines[at].lstrip().startswith("#") and self._indent(at + 1).startswith(indent))):
                at += 1
                if self.src.lines[at - 1].strip():
                    last = at
        return self.src.starts[last]

    def extent(self, i: int) -> tuple:
        """(start, end) of statement ``i`` with the lines it owns above it (from the end of the one before)."""
        return (self.end(i - 1) if i else self.start(i)), self.end(i)

    def _indent(self, lineno: int) -> str:
        line = self.src.lines[lineno - 1]
        return line[:len(line) - len(line.lstrip(" \t"))]

    def segment(self, i: int) -> str:
        return self.text[self.start(i):self.end(i)]

    def module_import(self, i: int) -> str | None:
        """The form of the save module's import statement ``i`` is, if it is one."""
        return _FORMS.get(" ".join(self.segment(i).split()))

    def dsfix_statements(self) -> list:
        return [i for i, s in enumerate(self.body) if is_dsfix_name(ast_defined_name(s) or "")]

    def default_indent(self) -> str:
        """The file's indentation, as libcst infers it: its first indented block's."""
        try:
            for tok in tokenize.generate_tokens(io.StringIO(self.text).readline):
                if tok.type == tokenize.INDENT:
                    return tok.string
        except (tokenize.TokenError, SyntaxError):  # pragma: no cover - the file parsed already
            pass
        return "    "


def _spliced(text: str, edits: list) -> str:
    """``text`` with each (start, end, new text) made; the edits do not overlap."""
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        text = text[:start] + new + text[end:]
    return text


def import_form(ctx: Context, held: str | None) -> str:
    """Which import of the save module utils.py needs: from the dotted names the scripts import utils.py
    under, else the one the context names (a revert without the state folder), else the one the file holds."""
    dotted = any("." in m for m in ctx.modules)
    top = any("." not in m for m in ctx.modules)
    if dotted or top:
        return "both" if dotted and top else "relative" if dotted else "absolute"
    return ctx.module_import or held or "relative"


def wrappers(defs: dict, strategy: str) -> str:
    return "\n\n".join(signature.generate(defs[name], DOCSTRINGS[name], strategy) for name in SAVE_NAMES)


# ----------------------------------------------------------------------------- taking dsfix's code out


def _import_edit(f: _File, i: int, names: set) -> tuple:
    """(start, end, new text) removing the imported ``names`` (bound names) from import statement ``i``: the
    whole statement with the lines it owns, or, where it imports other names too, those names only."""
    node = f.body[i]
    bound = [b for b, _q in imports.bindings(node)]
    if all(b in names for b in bound):
        return (*f.extent(i), "")
    stmt = cst.parse_statement(f.segment(i))
    small = imports.top_import(stmt)
    if small is None or isinstance(small.names, cst.ImportStar):  # not a list of names: left as it is
        return f.start(i), f.end(i), f.segment(i)
    kept = list(small.names)
    for k in reversed(range(len(kept))):
        if imports.bound_name(kept[k]) in names:
            kept = imports.remove_alias(kept, k)
    new = cst.Module([stmt.with_changes(body=[small.with_changes(names=kept)])]).code
    return f.start(i), f.end(i), new


def _recorded_import(f: _File, spec: ImportSpec) -> tuple[int, str] | None:
    """(statement index, bound name) of the import the marker records as added by dsfix, if still there."""
    for i, node in enumerate(f.body):
        if spec.name is None and isinstance(node, ast.Import):
            hit = any(a.name == spec.module and a.asname is None for a in node.names)
        elif spec.name is not None and isinstance(node, ast.ImportFrom) and not node.level:
            hit = node.module == spec.module and any(a.name == spec.name and a.asname is None for a in node.names)
        else:
            hit = False
        if hit:
            return i, (spec.module.split(".")[0] if spec.name is None else spec.name)
    return None


def take_out(f: _File, keep_replaced: bool = False, mark: bool = False) -> str:
    """The file's text without what dsfix inserted (any version): its statements with the lines they own
    (the marker line among them), the save module's import, and the imports the marker records as added.
    ``mark``: a placeholder line where dsfix's statements stood (see ``put_block``)."""
    info = f.marker or {}
    if info.get("replaced") and not keep_replaced:
        raise DsfixError(f"dsfix replaced a hand-written {info['replaced']} here; its text is kept only in the "
                         "state folder, which is gone, so it cannot be restored structurally", code=1)
    edits = _cut(f, f.dsfix_statements(), mark)
    edits += _cut(f, [i for i in range(len(f.body)) if f.module_import(i)], False)
    by_statement: dict[int, set[str]] = {}
    for token in filter(None, (info.get("added-imports") or "").split(",")):
        found = _recorded_import(f, ImportSpec.from_token(token))
        if found is not None:
            by_statement.setdefault(found[0], set()).add(found[1])
    edits += [_import_edit(f, i, names) for i, names in by_statement.items()]
    return _spliced(f.text, edits)


def _cut(f: _File, indexes: list, mark: bool) -> list:
    """Edits that take statements ``indexes`` out with the lines they own; ``mark``: the first becomes the
    placeholder line."""
    edits = [(*f.extent(i), "") for i in indexes]
    if not edits:
        return edits
    start, end, _ = edits[0]
    last = max(e for _s, e, _n in edits) == len(f.text) and not f.text.endswith(("\n", "\r"))
    if mark:  # where the file ends without a newline, so does the placeholder
        edits[0] = (start, end, PLACEHOLDER + ("" if last else f.newline))
    elif last:  # the statement before them is the file's last now: it ends without a newline, as the file did
        nl = 2 if f.text[:start].endswith("\r\n") else 1 if f.text[:start].endswith(("\n", "\r")) else 0
        edits[0] = (start - nl, end, "")
    return edits


def _orphans(before: _File, after: _File) -> tuple:
    """(``after``'s text without the top-level imports that the code ``before`` had and ``after`` lacks alone
    read, the names dropped)."""
    bound = {b: i for i, node in enumerate(after.body) if isinstance(node, (ast.Import, ast.ImportFrom))
             and not any(a.name == "*" for a in node.names) for b, _q in imports.bindings(node)}
    used_before, used_after = reach.module_reads(before.text, bound), reach.module_reads(after.text, bound)
    dropped = sorted(b for b in bound if used_before[b] > 0 and used_after[b] == 0)
    by_statement: dict[int, set[str]] = {}
    for b in dropped:
        by_statement.setdefault(bound[b], set()).add(b)
    return _spliced(after.text, [_import_edit(after, i, names) for i, names in by_statement.items()]), dropped


def _imports_at(f: _File) -> int:
    """Where a new top-level import goes: after the last one before the first def or class (or after a
    docstring), else before the first statement."""
    idx = 0
    for i, stmt in enumerate(f.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            idx = i + 1
        elif i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            idx = max(idx, 1)
    return f.end(idx - 1) if idx else f.start(0)


def _after_save_hf_format(f: _File) -> int:
    return f.end(next(i for i, s in enumerate(f.body) if isinstance(s, ast.FunctionDef) and s.name == "save_hf_format"))


class UtilsFixer(Fixer):
    """utils.py: the save module's import, and the two wrappers after save_hf_format."""

    kind = "utils"
    rank = 1
    anchor = True

    def patch(self, target: Target, ctx: Context) -> Patched:
        data, rel = target.content, target.rel
        patched = _File(data, rel)
        info = patched.marker or {}
        f = patched.again(take_out(patched, keep_replaced=True, mark=True)) if patched.marker else patched
        if not any(isinstance(s, ast.FunctionDef) and s.name == "save_hf_format" for s in f.body):
            raise DsfixError("has no top-level function save_hf_format to add the safetensors save beside")
        ctx.defs = defs = signature.find_defs(data, rel)
        notes = [n for d in defs.values() for n in d.notes] if not patched.marker else []
        hand = [ast_defined_name(f.body[i]) for i in f.dsfix_statements()]
        if hand:  # a hand-written copy (the widely copied fix): the wrappers take its place; imports it alone read go
            marked = PLACEHOLDER in f.text
            cut = f.again(_spliced(f.text, _cut(f, f.dsfix_statements(), not marked)))
            text, dropped = _orphans(f, cut)
            f = f.again(text)
            notes += [f"replaced a hand-written {n} with dsfix's (the original is kept for `dsfix revert`)"
                      for n in hand]
            notes += [f"dropped the import of {d}, which only the replaced code used" for d in dropped]
        replaced = [r for r in [*info.get("replaced", "").split(","), *hand] if r]
        held = next((form for i in range(len(patched.body)) if (form := patched.module_import(i))), None)
        text, added = self._assemble(f, defs, ctx.strategy, import_form(ctx, held), list(dict.fromkeys(replaced)))
        out = encode(text, f.encoding, rel)
        if not patched.marker:
            imported = [MODULE_IMPORTS[import_form(ctx, held)].splitlines()[0], *(s.source() for s in added)]
            notes.append(f"adds `{'`, `'.join(imported)}`, and after save_hf_format its two wrappers, "
                         f"{', '.join(PUBLIC_NAMES)}")
        else:
            notes[:0] = _update_notes(info, ctx.strategy)
        return Patched(out, notes if out != data else [])

    def _assemble(self, f: _File, defs: dict, strategy: str, form: str, replaced: list) -> tuple:
        """(the text with the imports added and the marked wrappers where the placeholder stands, else right
        after save_hf_format, the imports added)."""
        body = wrappers(defs, strategy)
        needed = [ImportSpec("os")] if re.search(r"\bos\.", body) and not imports.present_in(
            f.tree, ImportSpec("os")) else []
        marker = make_marker(module_version(), {"strategy": strategy,
                                                "added-imports": ",".join(s.token for s in needed),
                                                "replaced": ",".join(replaced)}, TAIL)
        heads = "".join(s.source() + "\n" for s in needed) + MODULE_IMPORTS[form] + "\n"
        edits = [(_imports_at(f), _imports_at(f), in_style(heads, "    ", f.newline))]
        block = in_style(f"\n\n{marker}\n{ABOUT}\n{body}", f.default_indent(), f.newline)
        if PLACEHOLDER in f.text:
            return put_block(_spliced(f.text, edits), f.newline, block), needed
        at = _after_save_hf_format(f)
        if at == len(f.text) and not f.text.endswith(("\n", "\r")):  # the file's last line, without a newline
            block = f.newline + block[:-len(f.newline)]
        return _spliced(f.text, edits + [(at, at, block)]), needed

    def unpatch(self, data: bytes, target: Target, force: bool = False) -> tuple:
        f = _File(data, target.rel)
        if f.marker is None:
            return data, []
        notes = ["the hand-written function dsfix replaced could not be restored"] if force and f.marker.get(
            "replaced") else []
        return encode(take_out(f, keep_replaced=force), f.encoding, target.rel), notes

    def is_patched(self, data: bytes, target: Target) -> bool:
        return _File(data, target.rel).marker is not None

    def own_part(self, data: bytes | None) -> str:
        if data is None:
            return ""
        f = _File(data, "utils.py")
        ours = set(f.dsfix_statements())
        return "".join(f.text[slice(*f.extent(i))] for i in range(len(f.body)) if f.module_import(i) or i in ours)

    def edited(self, data: bytes, target: Target, ctx: Context) -> bool:
        f = _File(data, target.rel)
        info = f.marker or {}
        if info.get("template") != f"v{module_version()}":
            return False  # an older dsfix's block: nothing to compare it with
        base, _ = self.unpatch(data, target)
        strategy = info.get("strategy") or "clone"
        if strategy not in ("clone", "dedupe"):
            strategy = "clone"
        held = next((form for i in range(len(f.body)) if (form := f.module_import(i))), None)
        redo = self.patch(Target(target.rel, "utils", base), Context(strategy, ctx.modules, module_import=held))
        return self.own_part(redo.new) != self.own_part(data)


def _update_notes(info: dict, strategy: str) -> list:
    current = f"v{module_version()}"
    what = [f"template {info.get('template')} -> {current}"] if info.get("template") != current else []
    what += [f"strategy {info.get('strategy')} -> {strategy}"] if info.get("strategy") != strategy else []
    return ["updates dsfix's block: " + ", ".join(what)] if what else []
