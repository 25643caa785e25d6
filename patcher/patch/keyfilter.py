"""Which state-dict keys a fork's save leaves out, read from its own tests on the key name.

Upstream's saves drop every key with "lora" in it. A fork may drop others too (``"svd" in k or "sigma" in k``),
or none. The tests are found where a save function builds or prunes the dict it saves:

* a dict comprehension over the keys, ``{k: v for k, v in sd.items() if <keep>}``;
* a loop over the keys that stores ``out[k] = ...`` under its tests (the tests say what is kept; an earlier
  ``if <test>: continue`` counts), or that deletes ``del sd[k]`` / ``sd.pop(k)`` under them (what is dropped).

Tests on the key name (``in``, ``==``, ``startswith``/``endswith``, ``any(s in k for s in (...))``, with
and/or/not) are carried; tests on nothing but the rank or the stage (``global_rank == 0``) are the save's
own business and left out; a test on anything else that decides what is kept is refused, naming its line.
The result is one expression over the key, for dsfix's ``drop=`` (None: upstream's rule).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from patcher.errors import Refused

KEY_METHODS = frozenset({"startswith", "endswith", "lower", "upper", "strip", "split", "rsplit", "count", "find",
                         "replace"})
KEY_BUILTINS = frozenset({"any", "all", "len", "str"})
_FLIP = {ast.In: "not in", ast.NotIn: "in", ast.Eq: "!=", ast.NotEq: "==", ast.Is: "is not", ast.IsNot: "is"}
_OPS = {ast.In: "in", ast.NotIn: "not in", ast.Eq: "==", ast.NotEq: "!="}


@dataclass(frozen=True)
class KeyFilter:
    """``drop``: the expression over ``var`` that is true for a key the fork leaves out; None for upstream's
    rule (``"lora" in name``); "False" when the fork keeps every key."""

    drop: str | None
    var: str = "name"
    params: frozenset = frozenset()  # the function's parameters the test reads

    def argument(self) -> str | None:
        """dsfix's ``drop=`` value, or None to keep the core's default (upstream's rule)."""
        return None if self.drop is None else f"lambda {self.var}: {self.drop}"


UPSTREAM = KeyFilter(None)

# A formula: ("leaf", node, var, negated) | ("and", [f]) | ("or", [f]) | ("not", f) | ("true",) | ("false",)
Formula = tuple
TRUE: Formula = ("true",)
FALSE: Formula = ("false",)


def _formula(test, var: str):
    if isinstance(test, ast.BoolOp):
        return ("and" if isinstance(test.op, ast.And) else "or", [_formula(v, var) for v in test.values])
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return ("not", _formula(test.operand, var))
    return ("leaf", test, var, False)


def _all(fs):
    return fs[0] if len(fs) == 1 else ("and", list(fs))


def _any(fs):
    return fs[0] if len(fs) == 1 else ("or", list(fs))


def _nnf(f, neg: bool = False):
    """Negations pushed down to the leaves."""
    kind = f[0]
    if kind == "leaf":
        return ("leaf", f[1], f[2], f[3] ^ neg)
    if kind == "not":
        return _nnf(f[1], not neg)
    if kind in ("and", "or"):
        op = kind if not neg else ("or" if kind == "and" else "and")
        return (op, [_nnf(c, neg) for c in f[1]])
    return f if not neg else (FALSE if f == TRUE else TRUE)


def _simplify(f, keyfree):
    """``keyfree(leaf)`` -> the value to give a leaf that does not test the key (None: keep it)."""
    kind = f[0]
    if kind == "leaf":
        v = keyfree(f)
        return f if v is None else v
    if kind in ("and", "or"):
        unit, zero = (TRUE, FALSE) if kind == "and" else (FALSE, TRUE)
        out: list[Formula] = []
        for c in f[1]:
            c = _simplify(c, keyfree)
            if c == zero:
                return zero
            if c != unit:
                out += [d for d in (c[1] if c[0] == kind else [c]) if _canonical(d) not in map(_canonical, out)]
        return unit if not out else out[0] if len(out) == 1 else (kind, out)
    return f


def _canonical(f):
    """A form of a formula in which the same test written twice (two loops over the keys, each with its own
    variable) is equal: a leaf's test dumped with its variable renamed."""
    if f[0] == "leaf":
        renamed = ast.dump(f[1]).replace(f"id='{f[2]}'", "id='<key>'")
        return ("leaf", renamed, f[3])
    if f[0] in ("and", "or"):
        return (f[0], tuple(_canonical(c) for c in f[1]))
    return f


class _Names(ast.NodeVisitor):
    """Free names of an expression (names bound by a comprehension inside it left out)."""

    def __init__(self):
        self.names = []
        self.bound = set()

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id not in self.bound:
            self.names.append(node)

    def _comp(self, node):
        for g in node.generators:
            self.visit(g.iter)
            for t in ast.walk(g.target):
                if isinstance(t, ast.Name):
                    self.bound.add(t.id)
            for c in g.ifs:
                self.visit(c)
        for part in ("elt", "key", "value"):
            if hasattr(node, part):
                self.visit(getattr(node, part))

    visit_GeneratorExp = visit_ListComp = visit_SetComp = visit_DictComp = _comp


def free_names(node) -> list:
    v = _Names()
    v.visit(node)
    return v.names


class Reader:
    def __init__(self, fn: ast.FunctionDef, source, params: set):
        self.fn = fn
        self.source = source  # patcher.patch.source.Source of the file
        self.params = params
        self.nodes = list(_own_nodes(fn))
        self.assigned = {n.id for n in self.nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        self.loop_bound: set[str] = set()  # names bound by the loop or comprehension being read (the value, say)
        self.used_params: set[str] = set()
        self.statey: set[str] = set()  # names of dicts taken from the model's state (sd = model.state_dict())
        for node in self.nodes:
            if isinstance(node, ast.Assign) and self.is_state(node.value):
                self.statey |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def is_state(self, node) -> bool:
        """An expression over the model's state dict (or its parameters)."""
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and n.attr in ("state_dict", "named_parameters", "named_buffers"):
                return True
            if isinstance(n, ast.Name) and (n.id in self.statey or "state_dict" in n.id or n.id in ("sd", "state")):
                return True
        return False

    # --- the sites

    def sites(self) -> list:
        """(node, keep formula, key variable, other names bound there) for every place the function builds or
        prunes the dict it saves."""
        out: list[tuple[ast.AST, Formula, str, set]] = []
        for node in self.nodes:
            if isinstance(node, ast.DictComp) and len(node.generators) == 1:
                g = node.generators[0]
                var, others = _key_target(g.target)
                if var is not None and g.ifs and self.is_state(g.iter):
                    out.append((node, _all([_formula(c, var) for c in g.ifs]), var, others))
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                var, others = _key_target(node.target)
                if var is None or not self.is_state(node.iter):
                    continue
                pre = []
                it = node.iter
                if isinstance(it, (ast.ListComp, ast.GeneratorExp)) and len(it.generators) == 1 \
                        and isinstance(it.elt, ast.Name) and isinstance(it.generators[0].target, ast.Name) \
                        and it.elt.id == it.generators[0].target.id:
                    pre = [_formula(c, it.elt.id) for c in it.generators[0].ifs]
                keep: list[list[Formula]] = []  # the tests on each path that keeps a key
                drop: list[list[Formula]] = []  # or that drops one
                self._walk(node.body, pre, var, keep, drop)
                inner = {n.id for s in node.body for n in ast.walk(s) if isinstance(n, ast.Name)
                         and isinstance(n.ctx, ast.Store)}
                if keep:
                    out.append((node, _any([_all(p) if p else TRUE for p in keep]), var, others | inner))
                elif drop:
                    out.append((node, ("not", _any([_all(p) if p else TRUE for p in drop])), var, others | inner))
        return out

    def _walk(self, stmts, path, var, keep, drop):
        path = list(path)
        for s in stmts:
            if isinstance(s, ast.If):
                cond = _formula(s.test, var)
                self._walk(s.body, path + [cond], var, keep, drop)
                self._walk(s.orelse, path + [("not", cond)], var, keep, drop)
                if s.body and isinstance(s.body[-1], ast.Continue) and not s.orelse:
                    path.append(("not", cond))
            elif isinstance(s, ast.Continue):
                return
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                self._walk(s.body, path, var, keep, drop)
            elif isinstance(s, ast.Try):
                self._walk(s.body, path, var, keep, drop)
            elif isinstance(s, ast.Delete):
                if any(_keyed(t, var) for t in s.targets):
                    drop.append(path)
            elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
                f = s.value.func
                if isinstance(f, ast.Attribute) and f.attr == "pop" and s.value.args \
                        and _is_var(s.value.args[0], var):
                    drop.append(path)
            elif isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                if any(_keyed(t, var) for t in targets):
                    keep.append(path)
                value = getattr(s, "value", None)
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                        and value.func.attr == "pop" and value.args and _is_var(value.args[0], var):
                    drop.append(path)

    # --- the leaves

    def keyfree(self, leaf, others: set):
        """True for a leaf that does not test the key (left out: the save's own business), refusing one that
        tests something else the loop binds (the value, say)."""
        node, var = leaf[1], leaf[2]
        names = {n.id for n in free_names(node)}
        if var in names:
            self.check(node, var)
            return None
        if names & others:
            raise Refused(line=node.lineno,
                          message="chooses which tensors to save by a test on something other than the key name")
        return TRUE

    def check(self, node, var) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                f = sub.func
                ok = (isinstance(f, ast.Attribute) and f.attr in KEY_METHODS) or \
                     (isinstance(f, ast.Name) and f.id in KEY_BUILTINS)
                if not ok:
                    what = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "a call"
                    raise Refused(line=node.lineno,
                                  message=f"tests the key name with a call of {what}, which dsfix cannot carry into "
                                          "its own save")
            elif isinstance(sub, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
                raise Refused(line=node.lineno,
                              message=f"tests the key name with {type(sub).__name__}, which dsfix cannot carry")
        for n in free_names(node):
            if n.id == var or n.id in KEY_BUILTINS:
                continue
            if n.id in self.params and n.id not in self.assigned:
                self.used_params.add(n.id)
                continue
            raise Refused(line=node.lineno,
                          message=f"tests the key name against {n.id}, which is not one of its parameters")

    # --- rendering

    def text(self, node, var: str, param: str) -> str:
        start, end = self.source.span(node)
        out, at = [], start
        for n in sorted(free_names(node), key=lambda n: (n.lineno, n.col_offset)):
            if n.id != var:
                continue
            s, e = self.source.span(n)
            out += [self.source.text[at:s], param]
            at = e
        out.append(self.source.text[at:end])
        return " ".join("".join(out).split()) if "\n" in "".join(out) else "".join(out)

    def render(self, f, param: str, top: bool = True) -> str:
        kind = f[0]
        if kind == "true":
            return "True"
        if kind == "false":
            return "False"
        if kind in ("and", "or"):
            parts = []
            for c in f[1]:
                t = self.render(c, param, False)
                parts.append(f"({t})" if kind == "and" and c[0] == "or" else t)
            return f" {kind} ".join(parts)
        node, var, neg = f[1], f[2], f[3]
        if not neg:
            t = self.text(node, var, param)
            return f"({t})" if isinstance(node, (ast.IfExp, ast.Lambda, ast.NamedExpr)) else t
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            return (f"{self.text(node.left, var, param)} {_FLIP[type(node.ops[0])]} "
                    f"{self.text(node.comparators[0], var, param)}")
        t = self.text(node, var, param)
        return f"not ({t})" if isinstance(node, (ast.IfExp, ast.Lambda, ast.NamedExpr, ast.BoolOp)) else f"not {t}"


def _own_nodes(fn):
    """Every node of a function's own body (nested functions and classes left out)."""
    stack = list(fn.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _key_target(target):
    """(the key's name, the other names bound) for ``k`` or ``k, v`` (or ``(k, v)``), else (None, set())."""
    if isinstance(target, ast.Name):
        return target.id, set()
    if isinstance(target, (ast.Tuple, ast.List)) and target.elts and isinstance(target.elts[0], ast.Name):
        return target.elts[0].id, {n.id for e in target.elts[1:] for n in ast.walk(e) if isinstance(n, ast.Name)}
    return None, set()


def _is_var(node, var) -> bool:
    return isinstance(node, ast.Name) and node.id == var


def _keyed(target, var) -> bool:
    return isinstance(target, ast.Subscript) and _is_var(target.slice, var)


def _is_upstream(f) -> bool:
    """``"lora" in name`` (or ``not "lora" not in name``)."""
    if f[0] != "leaf":
        return False
    node, var, neg = f[1], f[2], f[3]
    return (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.left, ast.Constant)
            and node.left.value == "lora" and _is_var(node.comparators[0], var)
            and isinstance(node.ops[0], ast.NotIn if neg else ast.In))


def read_filter(fn: ast.FunctionDef, source, params: set) -> KeyFilter:
    """The keys ``fn`` leaves out, as a KeyFilter; raises Refused (with a line) for a test dsfix cannot carry."""
    r = Reader(fn, source, params)
    keeps = []
    for _node, keep, _var, others in r.sites():
        keeps.append(_simplify(_nnf(keep), lambda leaf, o=others: r.keyfree(leaf, o)))
    if not keeps and any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "lora" in n.value.lower()
                         for n in r.nodes):
        return UPSTREAM  # a test dsfix does not read, on "lora": upstream's rule, as before
    keep = _simplify(_all(keeps), lambda leaf: None) if keeps else TRUE
    drop = _simplify(_nnf(keep, True), lambda leaf: None)
    if drop == FALSE:
        return KeyFilter("False")
    if _is_upstream(drop):
        return UPSTREAM
    taken = {n.id for f, leaf in _leaves(drop) for n in free_names(leaf) if n.id != f[2]}
    var = next(v for v in ("name", "key", "key_name", "k_") if v not in taken)
    return KeyFilter(r.render(drop, var), var, frozenset(r.used_params))


def _leaves(f):
    if f[0] == "leaf":
        yield f, f[1]
    elif f[0] in ("and", "or"):
        for c in f[1]:
            yield from _leaves(c)
    elif f[0] == "not":
        yield from _leaves(f[1])
