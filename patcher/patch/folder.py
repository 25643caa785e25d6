"""Where a fork's save function writes: the statements that compute its folder, read as Python runs them.

The folder is the first ``os.makedirs`` argument (else the folder joined with a file name, else the one given
to ``save_pretrained``). The statements before it that compute the names it reads are sliced backwards,
through if/elif/else, conditional expressions, ``os.path`` chains and f-strings, and carried into dsfix's
function as the fork's own statements (statements that compute nothing the folder reads, a log line in a
branch say, are left out). What is carried may read only the function's parameters, constants and locals
computed from them, and call only pure path helpers; anything else is refused, naming its line.

Here: finding the call that names the folder, and the Folder carried; the slice itself and what counts as
pure: patcher.patch.slicer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import libcst as cst

from patcher.errors import DsfixError, Refused
from patcher.patch.names import dotted
from patcher.patch.slicer import OwnBody, Slicer, allowed_global, assigned, reads

if TYPE_CHECKING:
    from libcst.metadata import CodeRange


@dataclass(frozen=True)
class Folder:
    statements: tuple  # the source text of each statement carried, in order
    expression: str  # the folder, after those statements
    carried: frozenset  # ids of the original nodes carried (statements; ifs whose tests are carried)
    reads: frozenset  # names the carried code and the folder read


class Lines:
    """Line numbers of a function's nodes, in its file, computed only when a message needs one."""

    def __init__(self, fn: cst.FunctionDef, def_line: int | None):
        self.fn = fn
        self.def_line = def_line
        self._pos: Mapping[cst.CSTNode, CodeRange] | None = None

    def __call__(self, node) -> int | None:
        if self.def_line is None:
            return None
        if self._pos is None:
            from libcst.metadata import MetadataWrapper, PositionProvider  # here: only a refusal needs it

            self._pos = MetadataWrapper(cst.Module([self.fn]), unsafe_skip_copy=True).resolve(PositionProvider)
        try:
            return self.def_line + self._pos[node].start.line - self._pos[self.fn.name].start.line
        except KeyError:
            return self.def_line


_FILE_NAME = re.compile(r"(?i)(weights?|config|model|safetensors|bin|json|file)")


def folder_call(stmts: list):
    """(statement index, folder expression) of the first call that says where the function writes."""

    class Calls(OwnBody):
        def __init__(self):
            self.calls = []

        def visit_Call(self, node):
            self.calls.append(node)

        def visit_Lambda(self, node):
            return False

    found = {}

    def calls_in(i):  # each statement visited once, and only as far as the first rule needs
        if i not in found:
            v = Calls()
            stmts[i].visit(v)
            found[i] = v.calls
        return found[i]

    for rule in ("makedirs", "join", "save_pretrained"):
        for i in range(len(stmts)):
            for call in calls_in(i):
                name = dotted(call.func) or ""
                pos = [a for a in call.args if a.keyword is None and not a.star]
                if rule == "makedirs" and name.split(".")[-1] in ("makedirs", "mkdir") and pos:
                    return i, pos[0].value
                if rule == "join" and name in ("os.path.join", "path.join", "join") and len(pos) >= 2:
                    last = pos[-1].value
                    named = isinstance(last, cst.Name) and _FILE_NAME.search(last.value)
                    literal = isinstance(last, cst.SimpleString) and "." in last.value
                    if (named or literal) and len(pos) == 2:
                        return i, pos[0].value
                    if named or literal:
                        head = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) if j == len(pos) - 2 else a
                                for j, a in enumerate(pos[:-1])]
                        return i, call.with_changes(args=head)
                if rule == "save_pretrained" and name.endswith(".save_pretrained") and pos:
                    return i, pos[0].value
    return None, None


_EMPTY = cst.Module([])


def read_folder(fn: cst.FunctionDef, body: list, params: set, aliases: dict, lines: Lines, rel: str) -> Folder:
    """The statements that compute where ``fn`` writes, to carry into dsfix's function; a DsfixError naming
    the line of what cannot be carried."""
    name = fn.name.value
    at, folder = folder_call(body)
    if folder is None:
        raise DsfixError(f"cannot tell which folder {name} writes to (no os.makedirs, no folder joined with a "
                         "file name, no save_pretrained); dsfix will not guess", path=rel, line=lines.def_line)
    aliases = {"os": "os", **aliases}  # the module dsfix's own block imports, when the fork's does not
    slicer = Slicer(aliases)
    try:
        slicer.pure(folder, body[at])
        needed = slicer.need(reads(folder), body[at], set())
        upto = at + 1 if assigned(body[at]) & needed else at
        kept, needed = slicer.block(body[:upto], needed, inside=False)
        for n in sorted(needed):
            if n in params or allowed_global(n, aliases):
                continue
            where = slicer.read_at.get(n, body[at])
            if any(n in assigned(s) for s in body):
                raise Refused(f"reads {n} for its folder, but not every path assigns {n} before", node=where)
            raise Refused(f"computes its folder from {n}, which is not one of its parameters", node=where)
    except Refused as e:
        raise DsfixError(f"{name} {e.message}; dsfix carries only a folder computed from the function's own "
                         "parameters (os.path, f-strings, if/else): compute it in the caller and pass it in",
                         path=rel, line=e.line or lines(e.node)) from None
    statements = tuple(_EMPTY.code_for_node(s.with_changes(leading_lines=[])).strip("\n") for s in kept)
    carried = frozenset(slicer.carried)
    where_reads = set().union(*(reads(s) for s in kept)) if kept else set()
    return Folder(statements, _EMPTY.code_for_node(folder), carried, frozenset(where_reads | reads(folder)))


