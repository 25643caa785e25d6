"""The backward slice of a fork's save function for its folder: which statements compute the names the folder
reads (through if/elif/else, conditional expressions, ``os.path`` chains and f-strings), and whether each is
pure enough to carry into dsfix's function (only parameters, constants, locals computed from them and pure
path helpers; nothing changed in place). What cannot be carried is ``Refused``, naming its node. Also the
libcst name reading both need: what a node reads, what a statement binds. patcher.patch.folder finds the call
that names the folder and runs the slice from it."""

from __future__ import annotations

import libcst as cst

from patcher.errors import Refused
from patcher.patch.names import dotted

PURE_CALLS = frozenset({
    "os.path.join", "os.path.normpath", "os.path.abspath", "os.path.realpath", "os.path.expanduser",
    "os.path.basename", "os.path.dirname", "os.path.relpath", "os.fspath", "os.path.isabs",
    "pathlib.Path", "pathlib.PurePath", "pathlib.PurePosixPath",
})
PURE_BUILTINS = frozenset({"str", "int", "len", "bool", "repr", "format", "isinstance", "hasattr", "getattr",
                           "min", "max"})
PURE_METHODS = frozenset({"format", "join", "replace", "strip", "rstrip", "lstrip", "lower", "upper",
                          "joinpath", "as_posix", "startswith", "endswith", "removeprefix", "removesuffix"})
PURE_MODULES = frozenset({"os", "os.path", "pathlib"})
PURE_ATTRIBUTES = frozenset({"os.sep", "os.path.sep", "os.curdir", "os.pardir"})
EXCEPTIONS = frozenset({"ValueError", "TypeError", "RuntimeError", "AssertionError", "FileNotFoundError",
                        "NotImplementedError", "KeyError", "OSError", "Exception"})
MUTATORS = frozenset({"append", "extend", "insert", "update", "pop", "remove", "clear", "setdefault", "add",
                      "discard", "sort", "reverse", "popitem", "__setitem__", "__delitem__"})
_BINDING: dict[type, str] = {  # node type -> the field holding what it binds
    cst.AssignTarget: "target", cst.AugAssign: "target", cst.AnnAssign: "target", cst.For: "target",
    cst.AsName: "name", cst.NamedExpr: "target"}


class OwnBody(cst.CSTVisitor):
    """Visits a function's own code: nested functions, lambdas and classes are other scopes, left out."""

    def visit_FunctionDef(self, node):
        return False

    def visit_ClassDef(self, node):
        return False


class _Reads(OwnBody):
    """Names read in a node (attribute names and keyword names left out)."""

    def __init__(self):
        self.names = set()

    def visit_Name(self, node):
        self.names.add(node.value)

    def visit_Attribute(self, node):
        node.value.visit(self)
        return False

    def visit_Arg(self, node):
        node.value.visit(self)
        return False


class _ReadsSkipping(_Reads):
    """``skip``: ids of nodes not to enter (carried statements), and of carried ifs whose tests are left out."""

    def __init__(self, skip):
        super().__init__()
        self.skip = skip

    def on_visit(self, node):
        if id(node) in self.skip:
            if isinstance(node, cst.If):
                for part in (node.body, node.orelse):
                    if part is not None:
                        part.visit(self)
            return False
        return super().on_visit(node)


def reads(node, skip=frozenset()) -> set:
    """Names read in ``node``, but for the nodes in ``skip`` (see _ReadsSkipping)."""
    if skip and isinstance(node, cst.SimpleStatementLine):
        return set().union(set(), *(reads(small) for small in node.body if id(small) not in skip))
    v = _ReadsSkipping(skip) if skip and not isinstance(node, cst.SimpleStatementLine) else _Reads()
    node.visit(v)
    return v.names


def assigned(stmt) -> set:
    """Names a statement binds (targets of any kind, in any of its branches)."""
    out = set()

    class V(cst.CSTVisitor):
        def on_visit(self, node):
            if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
                out.add(node.name.value)
                return False
            field = _BINDING.get(type(node))
            if field is not None:
                out.update(_target_names(getattr(node, field)))
            return True

    stmt.visit(V())
    return out


def _target_names(node) -> set:
    if isinstance(node, cst.Name):
        return {node.value}
    if isinstance(node, (cst.Tuple, cst.List)):
        return set().union(*(_target_names(e.value) for e in node.elements)) if node.elements else set()
    if isinstance(node, cst.StarredElement):
        return _target_names(node.value)
    return set()  # attributes and subscripts bind no name


class Slicer:
    """Backward slice of a block for the names ``needed`` after it (see read_folder)."""

    def __init__(self, aliases: dict):
        self.aliases = aliases
        self.carried: set[int] = set()  # ids of the nodes carried
        self.read_at: dict[str, cst.CSTNode] = {}  # name -> the node that first needed it (for messages)

    # --- expressions

    def qualified(self, node) -> str:
        name = dotted(node)
        if not name:
            return ""
        first, _, rest = name.partition(".")
        if first in self.aliases:
            return self.aliases[first] + ("." + rest if rest else "")
        if first in PURE_BUILTINS and not rest:
            return "builtins." + first
        return ""

    def pure(self, node, at) -> None:
        """Refuse (naming ``at``) an expression that may do more than compute a value from its inputs."""
        if isinstance(node, (cst.Name, cst.SimpleString, cst.Integer, cst.Float, cst.Ellipsis)):
            return
        if isinstance(node, cst.Call):
            return self.pure_call(node, at)
        operands = _operands(node)
        if operands is None:
            kind = type(node).__name__
            raise Refused(f"computes its folder with {_article(kind)} {kind} expression, which dsfix does not "
                          "carry", node=at)
        for operand in operands:
            self.pure(operand, at)

    def pure_call(self, node: cst.Call, at) -> None:
        """A call of a pure path helper or builtin, or of a string's or a path's method, on pure arguments."""
        func = node.func
        q = self.qualified(func)
        if q:  # a module's function or a builtin: only the pure path helpers
            ok = q in PURE_CALLS or q.startswith("builtins.")
        elif isinstance(func, cst.Attribute):  # a method: of a string or a path, when its name says so
            ok = func.attr.value in PURE_METHODS
            if ok:
                self.pure(func.value, at)
        else:
            ok = False
        if not ok:
            what = dotted(func) or "an expression"
            raise Refused(f"computes its folder with a call of {what}, which may do more than join paths", node=at)
        for a in node.args:
            self.pure(a.value, at)

    # --- statements

    def block(self, stmts: list, needed: set, inside: bool) -> tuple:
        """(the statements kept, in order; the names needed before the block)."""
        out = []
        if stmts and _ends(stmts[-1]):  # what follows is never reached from here
            needed = set()
        for stmt in reversed(stmts):
            if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                kept = []
                for small in reversed(stmt.body):
                    keep, needed = self.small(small, needed, inside)
                    if keep:
                        kept.append(small)
                if kept:
                    kept.reverse()
                    kept[-1] = kept[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
                    out.append(stmt.with_changes(body=kept))
            elif isinstance(stmt, cst.If):
                new, needed = self.if_(stmt, needed)
                if new is not None:
                    out.append(new)
            else:
                hit = assigned(stmt) & needed
                if hit:
                    kind = {"For": "loop", "While": "loop", "Try": "try statement", "With": "with statement",
                            "FunctionDef": "nested function", "ClassDef": "class"}.get(type(stmt).__name__,
                                                                                        "compound statement")
                    raise Refused(f"computes its folder ({_names(hit)}) in a {kind}, which dsfix does not carry",
                                  node=stmt)
                self.mutations(stmt, needed)
        out.reverse()
        return out, needed

    def need(self, names: set, node, needed: set) -> set:
        for n in names:
            self.read_at.setdefault(n, node)
        return needed | names

    def small(self, small, needed: set, inside: bool) -> tuple:
        hit = assigned(small) & needed
        if hit:
            if isinstance(small, cst.Assign) and all(_target_names(t.target) and _only_names(t.target)
                                                     for t in small.targets):
                self.pure(small.value, small)
                bound = set().union(*(_target_names(t.target) for t in small.targets))
                needed = self.need(reads(small.value), small, needed - bound)
            elif isinstance(small, cst.AnnAssign) and small.value is not None and isinstance(small.target, cst.Name):
                self.pure(small.value, small)
                needed = self.need(reads(small.value), small, needed - {small.target.value})
            elif isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name):
                self.pure(small.value, small)
                needed = self.need(reads(small.value), small, needed)
            else:
                raise Refused(f"computes its folder ({_names(hit)}) in a statement dsfix does not carry "
                              "(only assignments and if/elif/else)", node=small)
            self.carried.add(id(small))
            return True, needed
        if inside and isinstance(small, cst.Raise):  # a branch that ends the function, carried as it is
            exc = small.exc
            if isinstance(exc, cst.Call) and dotted(exc.func) in EXCEPTIONS:
                for a in exc.args:
                    self.pure(a.value, small)
            elif exc is not None and dotted(exc) not in EXCEPTIONS or small.cause is not None:
                raise Refused("ends a branch of its folder computation with a raise dsfix does not carry", node=small)
            if exc is not None:
                needed = self.need(reads(exc) - EXCEPTIONS, small, needed)
            self.carried.add(id(small))
            return True, needed
        if inside and isinstance(small, cst.Return):
            if small.value is not None:
                self.pure(small.value, small)
                needed = self.need(reads(small.value), small, needed)
            self.carried.add(id(small))
            return True, needed
        self.mutations(small, needed)
        return False, needed

    def if_(self, node: cst.If, needed: set) -> tuple:
        if not assigned(node) & needed:
            self.mutations(node, needed)
            return None, needed
        chain: list[cst.If] = []
        cur: cst.If | cst.Else | None = node
        while isinstance(cur, cst.If):
            chain.append(cur)
            cur = cur.orelse
        last = cur if isinstance(cur, cst.Else) else None  # the final else
        final = last.body if last is not None else None
        before = set()
        bodies = []
        for block in [c.body for c in chain] + ([final] if final is not None else []):
            stmts, n = self.block(_statements(block), set(needed), inside=True)
            bodies.append(_rebuild(block, stmts))
            before |= n
        if final is None:
            before |= needed
        for c in chain:
            self.pure(c.test, c)
            before = self.need(reads(c.test), c, before)
            self.carried.add(id(c))
        orelse: cst.If | cst.Else | None = None  # the chain rebuilt from its end
        if last is not None and not _is_pass(bodies[-1]):
            orelse = last.with_changes(body=bodies[-1])
        for c, body in reversed(list(zip(chain, bodies))):
            orelse = c.with_changes(body=body, orelse=orelse)
        return orelse, before

    def mutations(self, node, needed: set) -> None:
        """Refuse a statement left out that changes, in place, a value the folder is computed from."""
        hit = []

        class V(OwnBody):
            def _base(self, target):
                while isinstance(target, (cst.Attribute, cst.Subscript)):
                    target = target.value
                return target.value if isinstance(target, cst.Name) else None

            def visit_AssignTarget(self, n):
                for t in _flat_targets(n.target):
                    if isinstance(t, (cst.Attribute, cst.Subscript)) and self._base(t) in needed:
                        hit.append(self._base(t))

            def visit_AugAssign(self, n):
                if isinstance(n.target, (cst.Attribute, cst.Subscript)) and self._base(n.target) in needed:
                    hit.append(self._base(n.target))

            def visit_Del(self, n):
                for t in _flat_targets(n.target):
                    if isinstance(t, (cst.Attribute, cst.Subscript)) and self._base(t) in needed:
                        hit.append(self._base(t))

            def visit_Call(self, n):
                f = n.func
                if isinstance(f, cst.Attribute) and f.attr.value in MUTATORS and self._base(f.value) in needed:
                    hit.append(self._base(f.value))
                if isinstance(f, cst.Name) and f.value == "setattr" and n.args and \
                        self._base(n.args[0].value) in needed:
                    hit.append(self._base(n.args[0].value))

        node.visit(V())
        if hit:
            raise Refused(f"changes {hit[0]} in place, and its folder is computed from {hit[0]}", node=node)


def _operands(node) -> list | None:
    """The sub-expressions of an expression that computes its value from them alone (strings, f-strings,
    attributes, subscripts, operators, comparisons, conditional expressions, tuples, lists); None for any
    other kind of expression."""
    if isinstance(node, (cst.ConcatenatedString, cst.BinaryOperation, cst.BooleanOperation)):
        return [node.left, node.right]
    if isinstance(node, cst.FormattedString):
        parts = [p for p in node.parts if isinstance(p, cst.FormattedStringExpression)]
        specs = [s for p in parts for s in (p.format_spec or ()) if isinstance(s, cst.FormattedStringExpression)]
        return [p.expression for p in parts + specs]
    if isinstance(node, cst.Attribute):
        return [node.value]
    if isinstance(node, cst.Subscript):
        bounds: list[cst.BaseExpression | None] = []
        for el in node.slice:
            if isinstance(el.slice, cst.Index):
                bounds.append(el.slice.value)
            elif isinstance(el.slice, cst.Slice):
                bounds += [el.slice.lower, el.slice.upper, el.slice.step]
        return [node.value, *(b for b in bounds if b is not None)]
    if isinstance(node, cst.UnaryOperation):
        return [node.expression]
    if isinstance(node, cst.Comparison):
        return [node.left, *(c.comparator for c in node.comparisons)]
    if isinstance(node, cst.IfExp):
        return [node.test, node.body, node.orelse]
    if isinstance(node, (cst.Tuple, cst.List)):
        return [e.value for e in node.elements]
    return None


def _ends(stmt) -> bool:
    """A statement line that ends in a raise or a return."""
    return isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) and \
        isinstance(stmt.body[-1], (cst.Raise, cst.Return))


def _only_names(target) -> bool:
    if isinstance(target, cst.Name):
        return True
    if isinstance(target, (cst.Tuple, cst.List)):
        return all(_only_names(e.value) for e in target.elements)
    if isinstance(target, cst.StarredElement):
        return _only_names(target.value)
    return False


def _flat_targets(target):
    if isinstance(target, (cst.Tuple, cst.List)):
        for e in target.elements:
            yield from _flat_targets(e.value)
    elif isinstance(target, cst.StarredElement):
        yield from _flat_targets(target.value)
    else:
        yield target


def _statements(block) -> list:
    if isinstance(block, cst.IndentedBlock):
        return list(block.body)
    return [block]  # a SimpleStatementSuite: `if x: a = 1`


def _rebuild(block, stmts: list):
    if isinstance(block, cst.IndentedBlock):
        return block.with_changes(body=stmts or [cst.SimpleStatementLine([cst.Pass()])])
    return stmts[0] if stmts else block.with_changes(body=[cst.Pass()])


def _is_pass(block) -> bool:
    stmts = _statements(block)
    return len(stmts) == 1 and all(isinstance(s, cst.Pass) for s in getattr(stmts[0], "body", [None]))


def _names(names) -> str:
    return ", ".join(sorted(names))


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def allowed_global(name: str, aliases: dict) -> bool:
    q = aliases.get(name)
    if q is not None:
        return q in PURE_MODULES or q in PURE_CALLS or q in PURE_ATTRIBUTES
    return name in PURE_BUILTINS or name in ("None", "True", "False")
