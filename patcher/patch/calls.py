"""Which calls in a script call the checkout's save functions, found with Python's own ``ast``.

A call counts when its function resolves, by Python's scoping rules, to a name imported from one of the
dotted modules that lead to the located utils.py: a bare ``save_hf_format(...)`` bound by
``from dschat.utils.utils import save_hf_format`` (aliases included), or an attribute chain on an
imported module (``u.save_hf_format(...)`` after ``import dschat.utils.utils as u``). A local variable or
parameter of the same name shadows the import, as it does when the script runs.

The analysis is ``ast`` only (C speed); libcst then edits the nodes found here (patcher.patch.transforms),
matched one to one by their place in the source.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field

from patcher.errors import DsfixError

_COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.AsyncFor, ast.While,
             ast.Try, ast.With, ast.AsyncWith) + tuple(getattr(ast, n) for n in ("TryStar", "Match") if hasattr(ast, n))


@dataclass
class Arg:
    """One argument of a call, as written: ``keyword`` (None when positional), ``star`` ("", "*" or "**")."""

    keyword: str | None
    star: str
    text: str
    line: int
    col: int  # in characters, on its line


@dataclass
class SaveCall:
    """A call of a tracked function: ``name`` is the function's name in the utils module."""

    name: str
    line: int
    how: str  # the callee as written: "save_hf_format", "u.save_hf_format", "save_z3"
    args: list = field(default_factory=list)
    paren_col: int = 0  # the column of the opening parenthesis (in characters)
    index: int = 0  # place among the syntactic candidates (ScriptCalls.candidates)
    containers: tuple = ()  # ids of the enclosing function and loop nodes, innermost last (0: the module)


@dataclass(frozen=True)
class Use:
    """A use of a tracked function that is not a call: stored (``saver = save_hf_format``), passed on
    (``helper(save_hf_format)``), in a list or a ``partial``. ``start``/``end``: the span of the name to
    rename in the text (the attribute's name for ``u.save_hf_format``); ``how``: the name as written."""

    name: str
    line: int
    how: str
    start: int
    end: int


@dataclass
class ScriptCalls:
    calls: list  # SaveCall, in source order
    reads: dict  # bound name -> bare reads that resolve to a tracked import (callees of bare calls included)
    imported: dict  # bound name -> qualified name, for module-level imports of tracked names
    candidates: list  # the callee name of every syntactic candidate, in source order (matches libcst's order)
    sites: list  # Site: the statements that hold a candidate call or an import of one of the modules
    uses: list = field(default_factory=list)  # Use, in source order
    unsafe: list = field(default_factory=list)  # (line, why) for each use dsfix cannot rewrite


class _Scope:
    def __init__(self, node, parent):
        self.node = node
        self.parent = parent
        self.is_class = isinstance(node, ast.ClassDef)
        self.bound = {}  # name -> list of qualified names of import bindings (None for other bindings)
        self.other = {}  # name -> line of its first binding that is no import (an assignment, a def, ...)
        self.starred = set()  # names bound by a star import
        self.globals = set()
        self.nonlocals = set()

    def bind(self, name, qualified=None, line=None):
        self.bound.setdefault(name, []).append(qualified)
        if line is not None:
            self.other.setdefault(name, line)

    def resolve(self, name):
        """The scope whose binding ``name`` refers to here (None: a builtin or undefined)."""
        scope = self
        if name in scope.globals:
            return _module_of(scope) if name in _module_of(scope).bound else None
        if name in scope.bound and name not in scope.nonlocals:
            return scope
        scope = scope.parent
        while scope is not None:
            if scope.parent is None:  # the module
                return scope if name in scope.bound else None
            if not scope.is_class and name in scope.bound and name not in scope.globals:
                return scope
            scope = scope.parent
        return None


def _module_of(scope):
    while scope.parent is not None:
        scope = scope.parent
    return scope


def _targets(node):
    """Names bound by an assignment target."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


class _Binder(ast.NodeVisitor):
    """Builds the scope tree and records every binding, with the qualified name of import bindings."""

    def __init__(self, module_node, star_names=()):
        self.scopes = {id(module_node): _Scope(module_node, None)}
        self.stack = [self.scopes[id(module_node)]]
        self.star_names = star_names  # names a star import is taken to bind (the tracked ones)

    @property
    def scope(self):
        return self.stack[-1]

    def _enter(self, node, visit_children):
        s = _Scope(node, self.scope)
        self.scopes[id(node)] = s
        self.stack.append(s)
        visit_children()
        self.stack.pop()

    def _store(self, name, line):
        """Bind a name assigned here, in the scope a global or nonlocal statement sends it to."""
        scope = self.scope
        if name in scope.globals:
            scope = _module_of(scope)
        elif name in scope.nonlocals:
            outer = scope.parent
            while outer is not None and outer.parent is not None and (outer.is_class or name not in outer.bound):
                outer = outer.parent
            scope = outer if outer is not None and outer.parent is not None else scope
        scope.bind(name, None, line)

    def _function(self, node):
        self._store(node.name, node.lineno)
        for d in node.decorator_list:
            self.visit(d)
        self._defaults_and_annotations(node.args)
        if node.returns is not None:
            self.visit(node.returns)

        def inside():
            self._params(node.args)
            for stmt in node.body:
                self.visit(stmt)

        self._enter(node, inside)

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node):
        self._defaults_and_annotations(node.args)

        def inside():
            self._params(node.args)
            self.visit(node.body)

        self._enter(node, inside)

    def _defaults_and_annotations(self, args):
        for d in [*args.defaults, *[d for d in args.kw_defaults if d is not None]]:
            self.visit(d)
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None and a.annotation is not None:
                self.visit(a.annotation)

    def _params(self, args):
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None:
                self.scope.bind(a.arg)

    def visit_ClassDef(self, node):
        self._store(node.name, node.lineno)
        for n in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(n)

        def inside():
            for stmt in node.body:
                self.visit(stmt)

        self._enter(node, inside)

    def _comprehension(self, node):
        gens = node.generators
        self.visit(gens[0].iter)  # evaluated in the enclosing scope

        def inside():
            for i, g in enumerate(gens):
                for name in _targets(g.target):
                    self.scope.bind(name)
                if i:
                    self.visit(g.iter)
                for cond in g.ifs:
                    self.visit(cond)
            for part in ("elt", "key", "value"):
                if hasattr(node, part):
                    self.visit(getattr(node, part))

        self._enter(node, inside)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node):
        for a in node.names:
            if a.asname:
                self.scope.bind(a.asname, a.name)
            else:
                top = a.name.split(".")[0]
                self.scope.bind(top, top)

    def visit_ImportFrom(self, node):
        for a in node.names:
            if a.name == "*":  # binds what the module defines: for dsfix, the tracked names
                if node.module and not node.level:
                    for name in self.star_names:
                        self.scope.bind(name, f"{node.module}.{name}")
                        self.scope.starred.add(name)
                continue
            qualified = f"{node.module}.{a.name}" if node.module and not node.level else None
            self.scope.bind(a.asname or a.name, qualified)

    def visit_Global(self, node):
        self.scope.globals.update(node.names)

    def visit_Nonlocal(self, node):
        self.scope.nonlocals.update(node.names)

    def visit_Name(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self._store(node.id, node.lineno)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        scope = self.scope
        while isinstance(scope.node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            scope = scope.parent
        for name in _targets(node.target):
            scope.bind(name, None, node.lineno)

    def visit_ExceptHandler(self, node):
        if node.name:
            self._store(node.name, node.lineno)
        self.generic_visit(node)

    def visit_MatchAs(self, node):  # pragma: no cover - match statements in a training script are rare
        if node.name:
            self._store(node.name, node.lineno)
        self.generic_visit(node)


def _callee_name(func) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _chain(func):
    """(base Name, [attributes]) for a dotted callee, else (None, None)."""
    attrs = []
    while isinstance(func, ast.Attribute):
        attrs.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        return func, list(reversed(attrs))
    return None, None


class _Uses(ast.NodeVisitor):
    """Walks the tree with the scope stack: counts bare reads of tracked imports, finds the calls and the
    other uses (a value stored or passed on), and what dsfix cannot rewrite (``unsafe``)."""

    def __init__(self, binder, tree, tracked, bare, callee_names, strings=()):
        self.binder = binder
        self.tracked = tracked  # qualified name -> tracked name
        self.bare = bare  # bound names that may refer to a tracked import
        self.callee_names = callee_names
        self.strings = set(strings)  # a string equal to one of these is a use by name (getattr, say)
        self.stack = [binder.scopes[id(tree)]]
        self.containers = [0]  # ids of the enclosing function and loop nodes (0: the module)
        self.calls = []  # (node, tracked name, containers)
        self.candidates = []  # every syntactic candidate call, for matching libcst nodes by order
        self.reads = {}  # bound name -> bare reads that resolve to a tracked import
        self.called = set()  # ids of the callees of the tracked calls
        self.uses = []  # (node, tracked name): uses that are not calls
        self.unsafe = []  # (line, why)
        self.visited = set()  # ids of the nodes visited: each once, in the scope Python evaluates it in

    def _qualified(self, name: str) -> list:
        scope = self.stack[-1].resolve(name)
        return [q for q in scope.bound.get(name, []) if q] if scope is not None else []

    def _tracked(self, name: str, line: int):
        """The tracked name a bare ``name`` refers to here (None: another binding); a name that the same scope
        also binds otherwise (``save_hf_format = wrap(save_hf_format)``) is unsafe: which one runs depends on
        the order the code runs in."""
        scope = self.stack[-1].resolve(name)
        if scope is None:
            return None
        hit = next((self.tracked[q] for q in scope.bound.get(name, []) if q in self.tracked), None)
        if hit is not None and name in scope.other:
            self.unsafe.append((line, f"{name} is imported from the utils module and also assigned (line "
                                      f"{scope.other[name]}), so dsfix cannot tell which one this use reads"))
        return hit

    def generic_visit(self, node):
        scope = self.binder.scopes.get(id(node))
        if scope is None or scope is self.stack[-1]:
            return super().generic_visit(node)
        outer = []  # parts evaluated in the enclosing scope, as Python does
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            outer = [*getattr(node, "decorator_list", []), *a.defaults, *[d for d in a.kw_defaults if d is not None]]
        elif isinstance(node, ast.ClassDef):
            outer = [*node.decorator_list, *node.bases, *node.keywords]
        elif hasattr(node, "generators"):
            outer = [node.generators[0].iter]
        for n in outer:
            self.visit(n)
        skip = {id(n) for n in outer}
        self.stack.append(scope)
        container = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if container:
            self.containers.append(id(node))
        for child in ast.iter_child_nodes(node):
            if id(child) not in skip:
                self.visit(child)
        if container:
            self.containers.pop()
        self.stack.pop()

    def _loop(self, node):
        self.containers.append(id(node))
        super().generic_visit(node)
        self.containers.pop()

    visit_For = visit_AsyncFor = visit_While = _loop

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.bare:
            hit = self._tracked(node.id, node.lineno)
            if hit is not None:
                self.reads[node.id] = self.reads.get(node.id, 0) + 1
                if id(node) not in self.called:
                    self.uses.append((node, hit))

    def _chain_tracked(self, node):
        base, attrs = _chain(node)
        if base is None:
            return None
        for q in self._qualified(base.id):
            full = ".".join([q, *attrs])
            if full in self.tracked:
                return self.tracked[full]
        return None

    def visit_Attribute(self, node):
        if node.attr in self.callee_names:
            hit = self._chain_tracked(node)
            if hit is not None and not isinstance(node.ctx, ast.Load):
                self.unsafe.append((node.lineno, f"assigns or deletes {hit} on the utils module, which dsfix "
                                                 "cannot rewrite"))
            elif hit is not None and id(node) not in self.called:
                self.uses.append((node, hit))
        self.generic_visit(node)

    def visit_Nonlocal(self, node):
        for name in node.names:
            if name in self.bare and self._tracked(name, node.lineno) is not None:
                self.unsafe.append((node.lineno, f"declares {name} nonlocal, which dsfix cannot rewrite"))

    def visit_Constant(self, node):
        if isinstance(node.value, str) and node.value in self.strings:
            self.unsafe.append((node.lineno, f"names {node.value} in a string (for getattr, say), a use dsfix "
                                             "cannot rewrite"))

    def visit(self, node):
        if id(node) in self.visited:  # a default or a first iterable, visited already in the enclosing scope
            return None
        self.visited.add(id(node))
        return super().visit(node)

    def visit_Call(self, node):
        if _callee_name(node.func) in self.callee_names:
            self.candidates.append(node)
            base, attrs = _chain(node.func)
            if base is not None:
                hit = self._tracked(base.id, node.lineno) if not attrs else self._chain_tracked(node.func)
                if hit is not None:
                    self.calls.append((node, hit, tuple(self.containers)))
                    self.called.add(id(node.func))
        self.generic_visit(node)


_NEWLINE = re.compile(r"\r\n|\r|\n")


def statements(tree):
    """Every statement, in source order, nested ones included (expressions are not entered)."""
    for stmt in tree.body:
        yield stmt
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list):
                yield from statements(_Block(block))
        for h in getattr(stmt, "handlers", ()):
            yield from statements(_Block(h.body))
        for case in getattr(stmt, "cases", ()):
            yield from statements(_Block(case.body))


class _Block:
    def __init__(self, body):
        self.body = body


class Source:
    """A text split into lines once, the way Python's tokenizer counts them, for ast's positions (whose
    columns count UTF-8 bytes)."""

    def __init__(self, text: str):
        self.text = text
        self.lines, at = [], 0
        for m in _NEWLINE.finditer(text):
            self.lines.append(text[at:m.end()])
            at = m.end()
        if at < len(text) or not self.lines:
            self.lines.append(text[at:])
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def col(self, line: int, col: int) -> int:
        """ast's column as characters."""
        text = self.lines[line - 1]
        return col if text.isascii() else len(text.encode("utf-8")[:col].decode("utf-8", errors="replace"))

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + self.col(line, col)

    def span(self, node) -> tuple:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node) -> str:
        """The node's source text, as ast.get_source_segment gives it (without re-splitting the text)."""
        start, end = self.span(node)
        return self.text[start:end]


@dataclass(frozen=True)
class Site:
    """A statement to edit: its span in the text, and the candidate calls inside it."""

    start: int
    end: int
    first: int  # index of its first candidate call
    count: int
    compound: bool  # an if/for/def/... (its text is not a module by itself once cut from the file)


def _sites(tree: ast.Module, src: Source, candidates: list, modules) -> list:
    """The innermost statement around each candidate call, and each `from <module> import ...`, outermost
    first where they nest, in source order."""
    stmts = [(src.span(n), n) for n in statements(tree)]
    starts = [src.offset(c.lineno, c.col_offset) for c in candidates]
    chosen = {}
    for at in starts:
        inner = max((s for s in stmts if s[0][0] <= at < s[0][1]), key=lambda s: s[0][0], default=None)
        if inner is not None:
            chosen[inner[0]] = inner[1]
    for span, n in stmts:
        if isinstance(n, ast.ImportFrom) and n.module in modules:
            chosen[span] = n
    out = []
    for (start, end), node in sorted(chosen.items()):
        if out and start < out[-1].end:
            continue  # inside a statement already chosen
        first = sum(1 for a in starts if a < start)
        count = sum(1 for a in starts if start <= a < end)
        out.append(Site(start, end, first, count, isinstance(node, _COMPOUND)))
    return out


def arguments(node: ast.Call, src: "Source") -> list:
    """The call's arguments as Arg, in source order (columns in characters, as libcst counts them)."""
    args = []
    for a in sorted([*node.args, *node.keywords], key=lambda a: (a.lineno, a.col_offset)):
        value = a.value if isinstance(a, (ast.keyword, ast.Starred)) else a
        if isinstance(a, ast.keyword):
            keyword, star = a.arg, "" if a.arg else "**"
        else:
            keyword, star = None, "*" if isinstance(a, ast.Starred) else ""
        args.append(Arg(keyword, star, src.segment(value), a.lineno, src.col(a.lineno, a.col_offset)))
    return args


def find_calls(tree: ast.Module, text: str, modules, names, strings=()) -> ScriptCalls:
    """The calls in ``tree`` (parsed from ``text``) of ``names`` imported from any of the dotted ``modules``,
    and their other uses. A star import of one of the modules binds every name in ``names``. ``strings``:
    names whose appearance as a string makes the script unsafe to rewrite."""
    binder = _Binder(tree, tuple(names))
    binder.visit(tree)
    tracked = {f"{m}.{n}": n for m in modules for n in names}
    bare, aliases = set(), set()
    for scope in binder.scopes.values():
        for bound, quals in scope.bound.items():
            if any(q in tracked for q in quals if q):
                aliases.add(bound)
            if any(q and (q in tracked or any(t.startswith(q + ".") for t in tracked)) for q in quals):
                bare.add(bound)
    uses = _Uses(binder, tree, tracked, bare, set(names) | aliases, strings)
    uses.visit(tree)
    order = sorted(uses.candidates, key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
    index = {id(node): i for i, node in enumerate(order)}
    src = Source(text)
    calls = []
    for node, name, containers in uses.calls:
        args = arguments(node, src)
        how = " ".join(src.segment(node.func).split())
        paren = src.col(node.func.end_lineno, node.func.end_col_offset)
        calls.append(SaveCall(name, node.lineno, how, args, paren, index[id(node)], containers))
    calls.sort(key=lambda c: c.index)
    found = []
    for node, name in uses.uses:
        start, end = src.span(node)
        if isinstance(node, ast.Attribute):
            start = end - len(node.attr)
        found.append(Use(name, node.lineno, " ".join(src.segment(node).split()), start, end))
    found.sort(key=lambda u: u.start)
    module_scope = binder.scopes[id(tree)]
    imported = {bound: q for bound, quals in module_scope.bound.items() for q in quals if q in tracked
                and bound not in module_scope.starred}
    return ScriptCalls(calls, uses.reads, imported, [_callee_name(n.func) for n in order],
                       _sites(tree, src, order, modules), found, sorted(set(uses.unsafe)))


@dataclass(frozen=True)
class Decoded:
    text: str  # without a BOM
    encoding: str  # as detected (PEP 263, "utf-8-sig" with a BOM); ``text.encode(encoding)`` gives the bytes back


def decode(data: bytes) -> Decoded:
    """Raises SyntaxError (a bad encoding declaration), LookupError (an unknown one) or UnicodeDecodeError:
    Python would not run such a file either."""
    import io
    import tokenize

    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return Decoded(data.decode(encoding), encoding)


def parse(data: bytes, rel: str = "<script>") -> tuple:
    """(ast tree, decoded) of a file's bytes, decoded by its own declaration (PEP 263, BOM). Raises
    SyntaxError, or what ``decode`` raises. Cached: locating and planning read the same script; the tree is only read, never changed."""
    return _parse(data)


@functools.lru_cache(maxsize=8)
def _parse(data: bytes) -> tuple:
    decoded = decode(data)
    return ast.parse(decoded.text), decoded


def module_reads(text: str, names) -> dict:
    """name -> how many times the module-level binding of ``name`` is read (a local of the same name
    shadows it, as when the code runs)."""
    tree = ast.parse(text)
    binder = _Binder(tree)
    binder.visit(tree)
    module = binder.scopes[id(tree)]
    counts = {n: 0 for n in names}

    class Reads(_Uses):
        def visit_Name(self, node):
            if isinstance(node.ctx, ast.Load) and node.id in counts and self.stack[-1].resolve(node.id) is module:
                counts[node.id] += 1

    Reads(binder, tree, {}, set(), set()).visit(tree)
    return counts


def parse_script(data: bytes, rel: str) -> tuple:
    """(ast tree, decoded text) of a script; a DsfixError naming the file when Python could not read it."""
    try:
        return parse(data, rel)
    except (UnicodeDecodeError, LookupError) as e:
        raise DsfixError(f"cannot be decoded: {e}", path=rel) from None
    except SyntaxError as e:
        raise DsfixError(f"does not parse: {e.msg}", path=rel, line=e.lineno) from None
