"""Python's scoping rules on ``ast``: the scope tree of a module (module, functions, classes, comprehensions),
every name each scope binds, the qualified name an import binds it to, and where a read of a name resolves
(``global``, ``nonlocal``, class scopes skipped by the functions inside them). patcher.patch.calls walks a
script with it to find the save functions' calls; patcher.patch.reach to find what a script can still reach."""

from __future__ import annotations

import ast

from patcher.patch import imports


class Scope:
    """One scope: what it binds (import bindings with their qualified names), its globals and nonlocals."""

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


class Binder(ast.NodeVisitor):
    """Builds the scope tree and records every binding, with the qualified name of import bindings."""

    def __init__(self, module_node, star_names=()):
        self.scopes = {id(module_node): Scope(module_node, None)}
        self.stack = [self.scopes[id(module_node)]]
        self.star_names = star_names  # names a star import is taken to bind (the tracked ones)

    @property
    def scope(self):
        return self.stack[-1]

    def _enter(self, node, visit_children):
        s = Scope(node, self.scope)
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
        for bound, qualified in imports.bindings(node):
            self.scope.bind(bound, qualified)

    def visit_ImportFrom(self, node):
        for bound, qualified in imports.bindings(node):
            self.scope.bind(bound, qualified)
        if any(a.name == "*" for a in node.names) and node.module and not node.level:
            for name in self.star_names:  # a star import binds what the module defines: the tracked names
                self.scope.bind(name, f"{node.module}.{name}")
                self.scope.starred.add(name)

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


def chain(func):  # (used by patcher.patch.calls and patcher.patch.reach)
    """(base Name, [attributes]) for a dotted callee, else (None, None)."""
    attrs = []
    while isinstance(func, ast.Attribute):
        attrs.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        return func, list(reversed(attrs))
    return None, None
