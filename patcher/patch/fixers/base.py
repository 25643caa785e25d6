"""What every fixer shares: the target it fixes, what a patch returns, the context one plan shares between
fixers, the fixer protocol, and the ``# dsfix:`` marker line and block splicing that the fixers of utils.py
and of step 3's loader both use.

A fixer owns one kind of file, in the manner of a LibCST codemod command: how to patch it, how to undo that
(structurally, keeping the user's other edits), whether a file holds its change, and which part of the file
is its own (to tell whether the user edited it). ``patcher.patch.plan`` loops over the targets and asks each
one's fixer; it never branches on the kind of file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from patcher.errors import DsfixError
from patcher.patch.names import MARKER_PREFIX, is_dsfix_name

MARKER_RE = re.compile(r"^#\s*dsfix:\s*(?P<fields>.*?)\s*(--.*)?$")
PLACEHOLDER = "_DSFIX_BLOCK_GOES_HERE"


@dataclass(frozen=True)
class Target:
    """One file as read (``data`` None: it is not there), and the fixer that owns it."""

    rel: str  # path relative to the checkout root, with "/"
    kind: str  # its fixer: "utils", "module" (the save module beside utils.py), "script", "loader"
    data: bytes | None
    step: int | None = None  # scripts: the DeepSpeed-Chat step they run (1, 2, 3)
    modules: tuple = ()  # scripts: the dotted names under which they import utils.py

    @property
    def content(self) -> bytes:
        """``data``, of a file that must be there: every fixer's but the save module's (``optional``), whose
        missing files plan_apply refuses before it asks them."""
        if self.data is None:
            raise DsfixError("no such file", path=self.rel)
        return self.data

    @property
    def role(self) -> str:
        """How the state folder records it: the kind, or ``step1``/``step2``/``step3`` for a script."""
        return f"step{self.step}" if self.kind == "script" else self.kind

    @property
    def steps(self) -> frozenset:
        """The DeepSpeed-Chat steps the file is patched for: a script's own step; step 3's loader for steps 2
        and 3 (step 3 reads what step 2 saves); utils.py and the save module for every step."""
        if self.kind == "script":
            return frozenset({self.step})
        return frozenset({2, 3}) if self.kind == "loader" else frozenset({1, 2, 3})

    def steps_text(self) -> str:
        """How a message names those steps: "step 2", "steps 2 and 3 (step 3's critic loader)"."""
        if self.kind == "loader":
            return "steps 2 and 3 (step 3's critic loader)"
        return f"step {self.step}" if self.kind == "script" else "every step"

    @classmethod
    def of_role(cls, rel: str, role: str, data: bytes | None, modules=()) -> "Target":
        """A target from the role the state folder (or locating) records; a script of an older dsfix is a
        step-1 script (``script``)."""
        if role.startswith("step") or role == "script":
            step = int(role[4:]) if role[4:].isdigit() else 1
            return cls(rel, "script", data, step, tuple(modules))
        return cls(rel, role, data, None, tuple(modules))


@dataclass
class Patched:
    """A fixer's answer: the new bytes (None: the file is not there), what was done, what to look at."""

    new: bytes | None
    notes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)


@dataclass
class Context:
    """What the fixers of one plan share (LibCST's CodemodContext): the options, and what one fixer learns
    that another needs (the utils fixer reads the fork's save functions; the script fixer binds calls to them)."""

    strategy: str = "clone"
    modules: tuple = ()  # every dotted name under which the scripts patched import utils.py
    defs: dict | None = None  # old save name -> signature.SaveDef, once the utils fixer has read them
    module_import: str | None = None  # how utils.py imports the save module, where no script tells

    def saves(self) -> dict:
        """``defs``: utils.py is planned before the scripts, so its fixer has read them when a script needs them."""
        if self.defs is None:
            raise RuntimeError("the save functions are read from utils.py before any script is planned")
        return self.defs


class Fixer:
    """The protocol. ``kind`` names the files it owns; ``optional``: the file may not exist before apply."""

    kind = ""
    optional = False
    rank = 0  # the order apply writes files in (revert writes in reverse): what others need goes first
    anchor = False  # its marker tells, without the state folder, whether dsfix patched the checkout at all

    def patch(self, target: Target, ctx: Context) -> Patched:
        """The target's new bytes with dsfix's change (an earlier version's upgraded); raises DsfixError to
        refuse, naming the line."""
        raise NotImplementedError

    def guard(self, target: Target, new: bytes, ctx: Context) -> None:
        """After every target is planned: refuse what the patched file (``new``) could still do wrong."""

    def unpatch(self, data: bytes, target: Target, force: bool = False) -> tuple:
        """(the file without dsfix's change, notes): structural, the user's other edits kept; None when the
        file is dsfix's alone."""
        raise NotImplementedError

    def is_patched(self, data: bytes, target: Target) -> bool:
        """Whether the file still holds dsfix's change."""
        raise NotImplementedError

    def own_part(self, data: bytes | None) -> str:
        """dsfix's own part of the file as text, to tell whether the user edited it ("" when it has none)."""
        return ""

    def edited(self, data: bytes, target: Target, ctx: Context) -> bool:
        """Without the state folder: whether dsfix's own part differs from what dsfix would write now."""
        return False


# ----------------------------------------------------------------------------- the marker line


def make_marker(version: int, fields: dict, tail: str = "inserted by dsfix; undo with `dsfix revert`") -> str:
    """``# dsfix: template=v4 strategy=clone added-imports=os -- inserted by dsfix; ...``"""
    text = " ".join([f"template=v{version}"] + [f"{k}={v}" for k, v in fields.items() if v])
    return f"{MARKER_PREFIX} {text} -- {tail}"


def parse_marker(text: str) -> dict[str, str] | None:
    m = MARKER_RE.match(text)
    if not m:
        return None
    out: dict[str, str] = {}
    for tok in m.group("fields").split():
        key, _, value = tok.partition("=")
        out[key] = value
    return out if "template" in out else None


def find_marker(module: cst.Module) -> dict[str, str] | None:
    for stmt in module.body:
        for line in getattr(stmt, "leading_lines", ()):
            if line.comment is not None:
                info = parse_marker(line.comment.value)
                if info is not None:
                    return info
    return None


# ----------------------------------------------------------------------------- blocks of dsfix's code


def defined_name(stmt: cst.CSTNode) -> str | None:
    """The name a top-level statement defines (a function, a class, ``NAME = ...``), else None."""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return stmt.name.value
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            target = small.targets[0].target if isinstance(small, cst.Assign) else small.target
            if isinstance(target, cst.Name):
                return target.value
    return None


def is_dsfix_statement(stmt) -> bool:
    name = defined_name(stmt)
    return name is not None and is_dsfix_name(name)


def dsfix_text(module: cst.Module) -> str:
    """dsfix's statements of a module (and the marker above them), as text."""
    return "".join(module.code_for_node(s) for s in module.body if is_dsfix_statement(s))


def placeholder() -> cst.SimpleStatementLine:
    """A statement that marks where a block goes (see ``with_block``)."""
    return cst.SimpleStatementLine([cst.Expr(cst.Name(PLACEHOLDER))])


def with_block(module: cst.Module, block: str) -> str:
    """The module's code with its placeholder statement replaced by ``block``."""
    return put_block(module.code, module.default_newline, block)


def put_block(code: str, newline: str, block: str) -> str:
    """``code`` with its placeholder line replaced by ``block`` (which ends with a newline, unless the
    placeholder ended the file without one)."""
    at = code.index(PLACEHOLDER)
    end = at + len(PLACEHOLDER)
    if code.startswith(newline, end):
        return code[:at] + block + code[end + len(newline):]
    return code[:at] + block[: -len(newline)] + code[end:]  # the file ended without a newline


def in_style(text: str, indent: str, newline: str) -> str:
    """Code written with 4-space indents and "\\n" newlines, in a file's own indentation and newlines."""
    if indent != "    ":
        lines = []
        for line in text.split("\n"):
            stripped = line.lstrip(" ")
            n = len(line) - len(stripped)
            lines.append(indent * (n // 4) + " " * (n % 4) + stripped)
        text = "\n".join(lines)
    return text.replace("\n", newline)
