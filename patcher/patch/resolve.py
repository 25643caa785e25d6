"""Which utils.py does a script really import? Resolved by file, the way Python's import system would.

A script's search path is its own folder first (Python puts it there), then the folders it adds with
``sys.path.append``/``insert`` (evaluated statically), then the DeepSpeed-Chat folder and the folders
above it up to the repository root (where ``pip install -e .`` or ``PYTHONPATH`` make packages such as
``dschat`` or ``pkg.chat.training.utils`` importable). A dotted module is found on that path with the
import system's own precedence: a regular package beats a module file, which beats a namespace portion.

Only the standard library's ``ast`` is used, so this costs a fraction of a libcst parse.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

from patcher.errors import DsfixError
from patcher.patch.imports import module_candidates
from patcher.patch.names import SAVE_NAMES
from patcher.patch.names import dotted as dotted_name
from patcher.patch.source import Source, parse_script, statements

_ANCESTORS = 4  # folders above the DeepSpeed-Chat folder searched when no .git marks the repository root


@dataclass(frozen=True)
class ImportLine:
    line: int
    text: str  # the statement as written, on one line
    modules: tuple  # dotted module names this statement can make available as a module object
    reason: str = ""  # why it does not lead to the utils file ("" when it does)


@dataclass
class Resolution:
    """What one script imports the save functions from."""

    script: Path
    utils: Path | None
    modules: tuple  # dotted names, as the script writes them, that resolve to ``utils``
    search_path: tuple
    lines: list = field(default_factory=list)  # ImportLine for every import that could bring in a save name
    notes: list = field(default_factory=list)

    def describe_failure(self) -> tuple:
        """(one line, the line number it names, every import considered) for a script whose save functions
        come from no utils.py: the line leads with the import most likely meant (one that names a save
        function), and counts the others, which the detail lists."""
        if not self.lines:
            return ("imports neither save_hf_format nor a module that defines it; if another script saves, pass "
                    "it with --main", None, ())
        detail = tuple(f"line {i.line} `{i.text}`: {i.reason}" for i in self.lines)
        lead = min(self.lines, key=lambda i: (not any(n in i.text for n in SAVE_NAMES), i.line))
        reason = lead.reason if len(lead.reason) <= 140 else lead.reason[:137] + "..."
        more = len(self.lines) - 1
        rest = f"; {more} more import{'s' if more != 1 else ''} considered (--json lists them)" if more else ""
        return (f"no import resolves to a utils.py that defines save_hf_format: {reason}{rest}", lead.line, detail)


def _short(node: ast.AST, source) -> str:
    text = source.segment(node)
    text = " ".join(text.replace("\\\n", " ").split())
    return text if len(text) <= 100 else text[:97] + "..."


# ----------------------------------------------------------------------------- sys.path, statically


class _Unknown(Exception):
    pass


class _PathEval:
    """Evaluates the expressions scripts pass to sys.path.append/insert: strings, __file__, os.path.*,
    pathlib's Path with parent/parents/resolve and "/", and module-level names bound to such values.
    The current folder is taken to be the script's own (where DeepSpeed-Chat's scripts are run)."""

    def __init__(self, script: Path):
        self.script = script
        self.env: dict = {}

    def __call__(self, node):
        return self.eval(node)

    def eval(self, n):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            return n.value
        if isinstance(n, ast.Name):
            if n.id == "__file__":
                return str(self.script)
            if n.id in self.env:
                return self.env[n.id]
            raise _Unknown(n.id)
        if isinstance(n, ast.JoinedStr):
            return "".join(str(self.eval(v.value if isinstance(v, ast.FormattedValue) else v)) for v in n.values)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            return str(self.eval(n.left)) + str(self.eval(n.right))
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            return Path(self.eval(n.left)) / str(self.eval(n.right))
        if isinstance(n, ast.Attribute):
            dotted = dotted_name(n)
            if dotted in ("os.path.pardir", "os.pardir"):
                return ".."
            if dotted in ("os.path.curdir", "os.curdir"):
                return "."
            base = self.eval(n.value)
            if isinstance(base, Path) and n.attr == "parent":
                return self._abs(base).parent
            if isinstance(base, Path) and n.attr == "parents":
                return list(self._abs(base).parents)
            raise _Unknown(dotted or type(n).__name__)
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
            seq = self.eval(n.value)
            if isinstance(seq, list) and isinstance(n.slice.value, int):
                return seq[n.slice.value]
            raise _Unknown("subscript")
        if isinstance(n, ast.Call):
            return self._call(n)
        raise _Unknown(type(n).__name__)

    def _abs(self, p) -> Path:
        p = Path(p)
        return p if p.is_absolute() else self.script.parent / p

    def _call(self, n: ast.Call):
        args = [self.eval(a) for a in n.args]
        if isinstance(n.func, ast.Attribute):
            method = n.func.attr
            dotted = dotted_name(n.func)
            if dotted in ("os.path.join",):
                return str(Path(*map(str, args)))
            if dotted in ("os.path.dirname",):
                return str(self._abs(args[0]).parent) if str(args[0]) not in ("", ".") else ""
            if dotted in ("os.path.abspath", "os.path.realpath", "os.path.normpath"):
                return str(_norm(self._abs(args[0])))
            if dotted in ("os.path.expanduser",):
                return str(args[0])
            if dotted in ("os.getcwd",):
                return str(self.script.parent)
            if method in ("resolve", "absolute") and not args:
                return _norm(self._abs(self.eval(n.func.value)))
            if method == "joinpath":
                return Path(self.eval(n.func.value), *map(str, args))
            raise _Unknown(dotted or method)
        if isinstance(n.func, ast.Name):
            if n.func.id in ("Path", "PurePath") and len(args) <= 1:
                return Path(*(map(str, args) if args else ["."]))
            if n.func.id == "str" and len(args) == 1:
                return str(args[0])
            if n.func.id in ("abspath", "realpath", "normpath"):
                return str(_norm(self._abs(args[0])))
            if n.func.id == "dirname":
                return str(self._abs(args[0]).parent)
            if n.func.id == "join":
                return str(Path(*map(str, args)))
        raise _Unknown("call")


def _norm(p: Path) -> Path:
    parts: list[str] = []
    for part in p.parts:
        if part == "..":
            if len(parts) > 1:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return Path(*parts) if parts else p


def sys_path_changes(tree: ast.Module, script: Path, source: Source) -> tuple:
    """(folders prepended, folders appended, notes) from the script's sys.path.append/insert calls."""
    ev = _PathEval(script)
    front: list[Path] = []
    back: list[Path] = []
    notes: list[str] = []
    if "sys.path" not in source.text:
        return (), (), []
    for stmt in statements(tree):
        if isinstance(stmt, ast.Expr):
            stmt = stmt.value
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:
                ev.env[stmt.targets[0].id] = ev.eval(stmt.value)
            except (_Unknown, IndexError, TypeError, ValueError):
                pass
            continue
        if not (isinstance(stmt, ast.Call) and isinstance(stmt.func, ast.Attribute)):
            continue
        if dotted_name(stmt.func.value) != "sys.path" or stmt.func.attr not in ("append", "insert", "extend"):
            continue
        try:
            if stmt.func.attr == "insert":
                where = ev.eval(stmt.args[0]) if not isinstance(stmt.args[0], ast.Constant) else stmt.args[0].value
                value = [ev.eval(stmt.args[1])]
                target = front if where == 0 else back
            elif stmt.func.attr == "extend":
                if not isinstance(stmt.args[0], (ast.List, ast.Tuple)):
                    raise _Unknown("extend")
                value, target = [ev.eval(e) for e in stmt.args[0].elts], back
            else:
                value, target = [ev.eval(stmt.args[0])], back
            target.extend(_norm(ev._abs(v)) for v in value)
        except (_Unknown, IndexError, TypeError, ValueError):
            notes.append(f"line {stmt.lineno}: cannot evaluate `{_short(stmt, source)}`; that folder is not searched")
    return tuple(front), tuple(back), notes


# ----------------------------------------------------------------------------- finding a module by file


def _find_in(dirs, name: str):
    """(kind, paths) for ``name`` in the folders ``dirs``: ("package", [dir]), ("module", [file]),
    ("namespace", portions) or None, with the import system's precedence within each folder."""
    portions = []
    for d in dirs:
        pkg = d / name
        if (pkg / "__init__.py").is_file():
            return "package", [pkg]
        if (d / f"{name}.py").is_file():
            return "module", [d / f"{name}.py"]
        if pkg.is_dir():
            portions.append(pkg)
    return ("namespace", portions) if portions else None


def find_module(dotted: str, search_path) -> tuple:
    """(file or None, reason): the .py file ``dotted`` names on ``search_path``."""
    dirs = list(search_path)
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        found = _find_in(dirs, part)
        where = ".".join(parts[: i + 1])
        if found is None:
            if i == 0:
                return None, f"no {part}/ or {part}.py on the script's path"
            return None, f"{where} does not exist"
        kind, paths = found
        last = i == len(parts) - 1
        if kind == "module":
            return (paths[0], "") if last else (None, f"{where} is a module, not a package")
        if last:
            init = paths[0] / "__init__.py"
            return (init, "") if kind == "package" else (None, f"{where} is a folder, not a module")
        dirs = paths
    return None, "empty module name"  # pragma: no cover


def _declares_all(path: Path) -> bool:
    """Whether a module sets ``__all__`` at its top level (a star import then brings only what it lists)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return True
    return any(isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
        for n in tree.body)


def defines_save(path: Path) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return b"def save_hf_format(" in data or b"def save_hf_format (" in data


# ----------------------------------------------------------------------------- one script


def search_path(script: Path, tree: ast.Module, source: Source, chat_root: Path) -> tuple:
    """((the script's own path, the installed-package stand-ins), notes). The first is what Python
    searches when the script runs; the second (the DeepSpeed-Chat folder and the folders above it) is
    tried only for a module the first does not find."""
    front, back, notes = sys_path_changes(tree, script, source)
    real = _unique([*front, script.parent, *back])
    roots = [chat_root]
    top = chat_root
    for _ in range(_ANCESTORS + 8):
        if (top / ".git").exists() or top.parent == top:
            break
        top = top.parent
    d, n = chat_root, 0
    while d != top and d.parent != d and n < _ANCESTORS + 8:
        d = d.parent
        roots.append(d)
        n += 1
    return (real, tuple(r for r in _unique(roots) if r not in real)), notes


def _unique(paths) -> tuple:
    out = []
    for p in paths:
        p = Path(p)
        if p not in out:
            out.append(p)
    return tuple(out)


def locate_module(dotted: str, paths) -> tuple:
    """find_module on the script's own path, then on the installed-package stand-ins."""
    real, installed = paths
    found, why = find_module(dotted, real)
    if found is None and installed:
        other, _ = find_module(dotted, installed)
        if other is not None:
            return other, ""
    return found, why


def _rel_to(path: Path, root: Path) -> str:
    try:
        return Path(os.path.abspath(path)).relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _may_bring_save(node) -> bool:
    """An import worth explaining when nothing resolves: it names a save function or a utils module."""
    if isinstance(node, ast.ImportFrom):
        if any(a.name in SAVE_NAMES or a.name == "*" for a in node.names):
            return True
        mod = node.module or ""
        return any(a.name == "utils" for a in node.names) or mod.endswith("utils")
    return any(a.name.endswith("utils") for a in node.names)


def resolve_script(script: Path, data: bytes, chat_root: Path) -> Resolution:
    """Which file the script's save_hf_format comes from, and under which dotted names."""
    shown = os.path.relpath(script, chat_root)  # errors name files relative to the checkout, as every verb does
    tree, decoded = parse_script(data, Path(shown).as_posix() if not shown.startswith("..") else str(script))
    source = Source(decoded.text)
    roots, notes = search_path(script, tree, source, chat_root)
    res = Resolution(script, None, (), roots, notes=notes)
    by_file: dict = {}
    for node in statements(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        relevant = _may_bring_save(node)
        if isinstance(node, ast.ImportFrom) and node.level:
            if relevant:
                res.lines.append(ImportLine(node.lineno, _short(node, source), (), "a relative import in a script"))
            continue
        hits: list[tuple[str, Path]] = []
        reasons: list[str] = []
        for dotted in module_candidates(node):
            path, why = locate_module(dotted, roots)
            if path is not None and defines_save(path):
                hits.append((dotted, Path(os.path.abspath(path))))
            elif relevant:
                why = why or f"{_rel_to(path, chat_root)} does not define save_hf_format"
                if all(not r.endswith(f": {why}") for r in reasons):  # M.a is missing because M is: said once
                    reasons.append(f"{dotted}: {why}")
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) and hits:
            hits = hits[:1]  # the module itself
            if _declares_all(hits[0][1]):
                raise DsfixError("imports the save functions with a star import, and the utils module's __all__ "
                                 "would not bring in dsfix's functions; import save_hf_format by name instead",
                                 path=_rel_to(script, chat_root), line=node.lineno)
        for dotted, path in hits:
            by_file.setdefault(path, []).append(dotted)
        if hits:
            res.lines.append(ImportLine(node.lineno, _short(node, source), tuple(d for d, _ in hits)))
        elif relevant:
            res.lines.append(ImportLine(node.lineno, _short(node, source), (), "; ".join(reasons[:2]) or "no module"))
    if len(by_file) > 1:
        names = [_rel_to(p, chat_root) for p in by_file]
        raise DsfixError(f"imports save functions from {len(names)} files ({', '.join(names[:2])}"
                         f"{f' and {len(names) - 2} more' if len(names) > 2 else ''}); dsfix patches one utils.py: "
                         "import them from one", path=_rel_to(script, chat_root), detail=names)
    if by_file:
        (utils, modules), = by_file.items()
        res.utils = utils
        res.modules = tuple(dict.fromkeys(modules))
    return res
