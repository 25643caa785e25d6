"""Which calls in a script call the checkout's save functions, found with Python's own ``ast``.

A call counts when its function resolves, by Python's scoping rules, to a name imported from one of the
dotted modules that lead to the located utils.py: a bare ``save_hf_format(...)`` bound by
``from dschat.utils.utils import save_hf_format`` (aliases included), or an attribute chain on an
imported module (``u.save_hf_format(...)`` after ``import dschat.utils.utils as u``). A local variable or
parameter of the same name shadows the import, as it does when the script runs (the scopes:
patcher.patch.scopes; what else the script can reach: patcher.patch.reach).

The analysis is ``ast`` only (C speed); libcst then edits the nodes found here (patcher.patch.fixers.script),
matched one to one by their place in the source.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from patcher.patch.names import last_name
from patcher.patch.scopes import Binder, chain
from patcher.patch.source import Source, statements

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


class Uses(ast.NodeVisitor):
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
        base, attrs = chain(node)
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
        if last_name(node.func) in self.callee_names:
            self.candidates.append(node)
            base, attrs = chain(node.func)
            if base is not None:
                hit = self._tracked(base.id, node.lineno) if not attrs else self._chain_tracked(node.func)
                if hit is not None:
                    self.calls.append((node, hit, tuple(self.containers)))
                    self.called.add(id(node.func))
        self.generic_visit(node)


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
    out: list[Site] = []
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
    given: list[ast.expr | ast.keyword] = [*node.args, *node.keywords]
    for a in sorted(given, key=lambda a: (a.lineno, a.col_offset)):
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
    binder = Binder(tree, tuple(names))
    binder.visit(tree)
    tracked = {f"{m}.{n}": n for m in modules for n in names}
    bare, aliases = set(), set()
    for scope in binder.scopes.values():
        for bound, quals in scope.bound.items():
            if any(q in tracked for q in quals if q):
                aliases.add(bound)
            if any(q and (q in tracked or any(t.startswith(q + ".") for t in tracked)) for q in quals):
                bare.add(bound)
    uses = Uses(binder, tree, tracked, bare, set(names) | aliases, strings)
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
    return ScriptCalls(calls, uses.reads, imported, [last_name(n.func) for n in order],
                       _sites(tree, src, order, modules), found, sorted(set(uses.unsafe)))


