"""What a script can still reach once its save calls are renamed, and how often a module-level name is read:
the scope walk of patcher.patch.calls (``calls.Uses``) put to other questions. A route that renaming calls does
not cover (the utils module itself passed on, an attribute that names an original, the module's name in a
string) makes the script unsafe to patch; the read counts tell an import left unused by an edit."""

from __future__ import annotations

import ast

from patcher.patch import imports
from patcher.patch.calls import Uses
from patcher.patch.scopes import Binder, chain
from patcher.patch.source import statements


def module_reads(text: str, names) -> dict:
    """name -> how many times the module-level binding of ``name`` is read (a local of the same name
    shadows it, as when the code runs)."""
    tree = ast.parse(text)
    binder = Binder(tree)
    binder.visit(tree)
    module = binder.scopes[id(tree)]
    counts = {n: 0 for n in names}

    class Reads(Uses):
        def visit_Name(self, node):
            if isinstance(node.ctx, ast.Load) and node.id in counts and self.stack[-1].resolve(node.id) is module:
                counts[node.id] += 1

    Reads(binder, tree, {}, set(), set()).visit(tree)
    return counts


def module_routes(tree: ast.Module, text: str, modules, names) -> list:
    """[(line, why)]: where a script can still reach the functions ``names`` of the utils module (dotted
    ``modules``) by a route that renaming calls does not cover: the module object itself (or a package above
    it) used as a value (passed on, stored, returned, given to getattr), an attribute ``names`` of it, or the
    module's name in a string (``importlib.import_module``, ``sys.modules``)."""
    if not may_reach(tree, text, modules):
        return []
    above = _above(modules)
    binder = Binder(tree)
    binder.visit(tree)
    routes = _Routes(binder, tree, tuple(modules), tuple(names), above)
    routes.visit(tree)
    return sorted(set(routes.found))


def _above(modules) -> set:
    """The modules and every package above them: ``dschat``, ``dschat.utils``, ``dschat.utils.utils``."""
    return {".".join(m.split(".")[:i]) for m in modules for i in range(1, len(m.split(".")) + 1)}


def may_reach(tree: ast.Module, text: str, modules) -> bool:
    """Whether a script could hold a route to the module object at all: an import binds the module (or a
    package above it), or a string names it. Renaming calls changes neither."""
    above = _above(modules)
    if any(q in above for node in statements(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
           for _bound, q in imports.bindings(node)):
        return True
    return any(f"{q}{m}{q}" in text for m in modules for q in "'\"")


class _Routes(Uses):
    """Walks the tree with the scope stack (see Uses) and records each route to the module's originals."""

    def __init__(self, binder, tree, modules, names, above):
        super().__init__(binder, tree, {}, set(), set())
        self.modules, self.names, self.above, self.found = modules, names, above, []

    def _reach(self, base: ast.Name, attrs: list, line: int) -> None:
        for q in self._qualified(base.id):
            if q not in self.above:
                continue
            full, shown = ".".join([q, *attrs]), ".".join([base.id, *attrs])
            if full in self.above:
                self.found.append((line, f"uses the module {shown} as a value (passed on or stored), so its "
                                         "original save functions stay reachable"))
            elif any(full == f"{m}.{n}" for m in self.modules for n in self.names):
                self.found.append((line, f"{shown} still refers to the original save function"))

    def visit_Attribute(self, node):
        base, attrs = chain(node)
        if base is None:
            return self.generic_visit(node)
        if isinstance(node.ctx, ast.Load):  # the whole chain at once: its inner names are not values
            self._reach(base, attrs, node.lineno)
        # setting or deleting an attribute of the module passes nothing on (an original's name: calls' refusal)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self._reach(node, [], node.lineno)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and node.value in self.modules:
            self.found.append((node.lineno, f"names the module {node.value} in a string (an import by name), "
                                            "so its original save functions stay reachable"))
