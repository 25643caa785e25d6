"""Pure planning: the bytes of each target file in, the new bytes out, plus what changed and why.

Nothing here reads or writes files; ``patcher.state`` does the I/O. Every new text is re-parsed
(libcst and ``compile``) before it is offered, so apply never writes a file that does not parse.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import libcst as cst

from patcher import transforms
from patcher.diff import split_lines
from patcher.errors import DsfixError
from patcher.template import Template

STEP2_WARNING = (
    "step 2 will save model.safetensors, but step 3's critic loader (create_critic_model with "
    "rlhf_training=True) asserts that pytorch_model.bin exists in the step-2 output: step 3 will not "
    "start from this step-2 output unless you also adapt that loader"
)


@dataclass(frozen=True)
class FileChange:
    rel: str  # path relative to the checkout root, with "/"
    role: str  # "utils" or "step1" / "step2" / "step3"
    old: bytes
    new: bytes
    notes: tuple = ()

    @property
    def changed(self) -> bool:
        return self.old != self.new


@dataclass(frozen=True)
class Plan:
    changes: tuple
    strategy: str
    template_version: int
    warnings: tuple = ()

    @property
    def pending(self) -> list:
        return [c for c in self.changes if c.changed]


def parse(data: bytes, rel: str) -> cst.Module:
    try:
        return cst.parse_module(data)
    except cst.ParserSyntaxError as e:
        raise DsfixError(f"does not parse: {e.message.strip()}", path=rel, line=e.raw_line) from None
    except (UnicodeDecodeError, LookupError, SyntaxError) as e:
        raise DsfixError(f"cannot be decoded: {e}", path=rel) from None


def render(module: cst.Module, rel: str) -> bytes:
    """The module's bytes in its own encoding, compiled by Python to be sure they are valid."""
    try:
        data = module.bytes
    except UnicodeEncodeError as e:
        raise DsfixError(f"the new code cannot be written in this file's encoding ({module.encoding}): {e}", path=rel)
    try:
        compile(data, rel, "exec", dont_inherit=True)
    except SyntaxError as e:  # pragma: no cover - a dsfix bug, caught before anything is written
        raise DsfixError(f"dsfix produced code that does not compile: {e.msg}", path=rel, line=e.lineno)
    return data


def reparse(change: FileChange) -> None:
    """Before writing: the new text must parse again with libcst, so a later dsfix can read it back."""
    try:
        cst.parse_module(change.new)
    except cst.ParserSyntaxError as e:  # pragma: no cover - a dsfix bug, caught before anything is written
        raise DsfixError(f"dsfix produced code it cannot parse back: {e.message.strip()}", path=change.rel,
                         line=e.raw_line) from None


def _outcome(res, old: bytes, rel: str, role: str) -> FileChange:
    new = render(res.module, rel) if res.original is not None else old
    return FileChange(rel, role, old, new, tuple(res.notes) if new != old else ())


def plan_utils(old: bytes, rel: str, tpl: Template, strategy: str) -> tuple:
    """(FileChange, defs): utils.py patched, and the checkout's save functions as read from it."""
    res = transforms.patch_utils(parse(old, rel), tpl, strategy, rel, old)
    return _outcome(res, old, rel, "utils"), res.defs


def plan_main(old: bytes, rel: str, role: str, modules: tuple, defs: dict) -> tuple:
    """(FileChange, warnings) for one script."""
    try:
        res = transforms.patch_main(parse(old, rel), modules, defs)
    except DsfixError as e:
        raise DsfixError(e.message, e.code, path=rel, line=e.line) from None
    return _outcome(res, old, rel, role), [f"{rel}:{w}" for w in res.warnings]


def make_plan(files: dict, roles: dict, tpl: Template, strategy: str, modules: dict) -> Plan:
    """``files``: rel -> bytes; ``roles``: rel -> "utils" | "step1" | "step2" | "step3";
    ``modules``: rel of each script -> the dotted names under which it imports utils.py."""
    changes, warnings = [], []
    utils_rel = next(rel for rel, role in roles.items() if role == "utils")
    try:
        change, defs = plan_utils(files[utils_rel], utils_rel, tpl, strategy)
    except DsfixError as e:
        if e.path is None:
            e.path = utils_rel
        raise
    changes.append(change)
    for rel, role in roles.items():
        if role == "utils":
            continue
        change, found = plan_main(files[rel], rel, role, modules[rel], defs)
        changes.append(change)
        warnings += found
        if role == "step2":
            warnings.append(STEP2_WARNING)
    return Plan(tuple(changes), strategy, tpl.version, tuple(warnings))


# ----------------------------------------------------------------------------- revert


def unpatch(data: bytes, rel: str, role: str, modules: tuple) -> bytes:
    """Undo dsfix's change structurally; the user's other edits stay."""
    module = parse(data, rel)
    try:
        if role == "utils":
            res = transforms.unpatch_utils(module)
        else:
            res = transforms.unpatch_main(module, modules)
    except DsfixError as e:
        raise DsfixError(e.message, e.code, path=rel) from None
    return render(res.module, rel) if res.original is not None else data


def dsfix_block(data: bytes) -> str:
    """dsfix's inserted statements (and the marker), as text, to tell whether a user edited them."""
    module = cst.parse_module(data)
    parts = []
    for stmt in module.body:
        name = transforms._defined_name(stmt)
        if name is not None and transforms.is_dsfix_name(name):
            parts.append(module.code_for_node(stmt))
    return "".join(parts)


def _hunks(a: list, b: list) -> list:
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(i1, i2, b[j1:j2]) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"]


def merge3(base: bytes, ours: bytes, theirs: bytes) -> bytes | None:
    """Apply both ``base -> ours`` and ``base -> theirs``; None when their hunks touch (a conflict)."""
    b = split_lines(base)
    h1, h2 = _hunks(b, split_lines(ours)), _hunks(b, split_lines(theirs))
    for a1, a2, _ in h1:
        for c1, c2, _ in h2:
            if a1 <= c2 and c1 <= a2:
                return None
    out = list(b)
    for i1, i2, repl in sorted(h1 + h2, key=lambda h: h[0], reverse=True):
        out[i1:i2] = repl
    return b"".join(out)


@dataclass
class RevertOutcome:
    rel: str
    new: bytes | None  # None: refused
    how: str  # "restored", "merged", "structural", "unchanged", "refused"
    reason: str = ""
    notes: list = field(default_factory=list)
