"""Pure planning: what apply and revert do, decided from bytes already read. No I/O here.

``plan_apply`` loops over the targets, asking each one's fixer (patcher.patch.fixers) for its new bytes,
then, once every target is planned, each fixer's guard; it returns the changes in the order to write them
and the state folder to write (the originals to keep, even when a patched file was edited after an earlier
apply). ``plan_revert`` decides, file by file, whether to restore the original, carry the user's later
edits over (a three-way merge, else the fixer's structural undo), or refuse. Nothing here branches on the
kind of file: that is each fixer's business.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field
from typing import Sequence

from patcher.errors import DsfixError
from patcher.patch.diff import split_lines
from patcher.patch.fixers import FIXERS, Context, Patched, Target
from patcher.patch.source import Unreadable, check_compiles, parse_script

__all__ = ["Status", "Target", "Saved", "FileChange", "ApplyPlan", "RevertOutcome", "RevertPlan", "plan_apply",
           "plan_revert", "revert_targets", "left_out", "merge3", "sha256"]


class Status(str, enum.Enum):
    """What happened, or would happen, to one file."""

    WOULD_CHANGE = "would change"
    CHANGED = "changed"
    UNCHANGED = "unchanged"
    RESTORED = "restored"
    MERGED = "merged"
    STRUCTURAL = "structural"
    REFUSED = "refused"
    REMOVED = "removed"  # revert: a file dsfix added (the save module) taken away
    NOT_WRITTEN = "not written"  # revert: decided, but not written, since another file was refused


WRITTEN = (Status.RESTORED, Status.MERGED, Status.STRUCTURAL, Status.REMOVED)  # revert decisions that write


def sha256(data: bytes | None) -> str | None:
    import hashlib  # here: only apply and revert need it

    return None if data is None else hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Saved:
    """The state folder's content: an entry per patched file and the original and patched bytes (an original
    None: the file did not exist before apply, as the save module)."""

    entries: dict  # rel -> {"role", "original_sha256", "patched_sha256", "modules", "strategy"}
    blobs: dict  # (rel, "original" | "patched") -> bytes or None
    main: str | None = None  # the step-1 script and the further ones patched, so that later runs need no
    scripts: tuple = ()  # --main or --script again
    strategy: str | None = None  # the --strategy and --steps of the last apply, likewise remembered
    steps: tuple = ()

    def blob(self, rel: str, kind: str) -> bytes | None:
        return self.blobs[(rel, kind)]

    def patched(self, rel: str) -> bytes:
        """What apply wrote to ``rel``: a file, always (only an original may be missing)."""
        data = self.blobs[(rel, "patched")]
        if data is None:
            raise DsfixError("the state folder keeps no copy of what apply wrote here", path=rel)
        return data

    def target(self, rel: str, data: bytes | None) -> Target:
        entry = self.entries[rel]
        return Target.of_role(rel, entry["role"], data, entry.get("modules") or ())


@dataclass(frozen=True)
class FileChange:
    target: Target
    new: bytes | None
    notes: tuple = ()

    @property
    def rel(self) -> str:
        return self.target.rel

    @property
    def old(self) -> bytes | None:
        return self.target.data

    @property
    def changed(self) -> bool:
        return self.old != self.new


@dataclass(frozen=True)
class ApplyPlan:
    changes: tuple  # FileChange for every target
    warnings: tuple
    state: Saved | None  # the state folder to write (None when nothing changes)

    @property
    def pending(self) -> list:
        """The changes to write, in the order to write them: what other files need first (the save module
        before the utils.py that imports it)."""
        return sorted((c for c in self.changes if c.changed), key=lambda c: FIXERS[c.target.kind].rank)


@dataclass
class RevertOutcome:
    rel: str
    new: bytes | None  # what the file becomes (None: removed) when ``status`` writes it (see WRITTEN)
    status: Status
    reason: str = ""
    notes: list = field(default_factory=list)
    keep_as: str | None = None  # the user's version is kept under this name (--force)
    line: int | None = None  # where the reason points


@dataclass(frozen=True)
class RevertPlan:
    results: tuple
    refused: tuple  # the refused RevertOutcomes (nothing is written when there are any)
    writes: tuple = ()  # (rel, bytes or None to remove) in the order to write: the kept copies, then the rest
    restored: tuple = ()  # the files whose dsfix change is undone: restored, or removed (dsfix added them)


# ----------------------------------------------------------------------------- apply


def _patched(target: Target, ctx: Context) -> Patched:
    fixer = FIXERS[target.kind]
    if target.data is None and not fixer.optional:
        raise DsfixError("no such file", path=target.rel)
    try:
        return fixer.patch(target, ctx)
    except DsfixError as e:
        e.path = e.path or target.rel
        raise


def _guarded(change: FileChange, ctx: Context, verify: bool) -> None:
    """After planning: the fixer's guard, and (apply) Python must compile what will be written."""
    if change.new is None:
        return
    try:
        FIXERS[change.target.kind].guard(change.target, change.new, ctx)
    except DsfixError as e:
        e.path = e.path or change.rel
        raise
    if verify and change.changed:
        check_compiles(change.new, change.rel)


def plan_apply(targets: list, strategy: str, saved: Saved | None = None, verify: bool = False, scripts: tuple = (),
               steps: tuple = (1,), drop: Sequence[Target] = ()) -> ApplyPlan:
    """``targets``: utils.py before the scripts (which bind their calls to what it defines); ``scripts``:
    (step-1 script, further ones) to record, with ``strategy`` and ``steps``. ``drop``: files an earlier apply
    patched for steps that ``steps`` leaves out now (Targets as read), restored from ``saved``. ``verify``:
    compile every new text and parse it back (apply does; check, which writes nothing, shows the diff)."""
    ctx = Context(strategy, modules=tuple(dict.fromkeys(m for t in targets for m in t.modules)))
    changes, warnings = [], []
    for t in targets:
        res = _patched(t, ctx)
        changes.append(FileChange(t, res.new, tuple(res.notes) if res.new != t.data else ()))
        warnings += res.warnings
    for c in changes:  # one guard, once everything is planned
        _guarded(c, ctx, verify)
    changes += _restores(saved, drop, steps)
    record = (scripts[0] if scripts else None, tuple(scripts[1:]), strategy, tuple(steps))
    pending = [c for c in changes if c.changed]
    state = None
    if pending or (saved is not None and (saved.main, tuple(saved.scripts), saved.strategy, tuple(saved.steps))
                   != record):
        state = _state(saved, pending, {t.rel for t in drop}, record)
    return ApplyPlan(tuple(changes), tuple(warnings), state)


def _restores(saved: Saved | None, drop: Sequence[Target], steps: tuple) -> list:
    """The files of steps left out now, restored from the state folder (refused when edited or gone)."""
    if saved is None:  # nothing patched before: nothing to leave out now (``drop`` is empty)
        return []
    listed, out = ",".join(map(str, steps)), []
    for t in drop:
        r = revert_with_state(saved, t)
        words = t.steps_text()
        if r.status == Status.REFUSED:
            how = "edited since apply where dsfix changed it" if t.data is not None else "gone since apply"
            raise DsfixError(f"patched for {words}, which --steps {listed} leaves out, but {how}; run `dsfix revert` "
                             "first, or keep that step in --steps", path=t.rel)
        if r.status in WRITTEN and t.data is not None:
            out.append(FileChange(t, r.new, (f"restores the original: --steps {listed} leaves {words} out",)))
    return out


def _state(saved: Saved | None, pending: list, dropped: set, record: tuple) -> Saved:
    entries = dict(saved.entries) if saved else {}
    blobs = dict(saved.blobs) if saved else {}
    for c in pending:
        if c.rel in dropped:
            del entries[c.rel]
            blobs.pop((c.rel, "original"), None)
            blobs.pop((c.rel, "patched"), None)
            continue
        original = c.old
        if saved is not None and c.rel in saved.entries:
            original = original_under_edits(saved, c.target)
        entries[c.rel] = {"role": c.target.role, "original_sha256": sha256(original), "patched_sha256": sha256(c.new),
                          "strategy": record[2], "modules": list(c.target.modules)}
        blobs[(c.rel, "original")] = original
        blobs[(c.rel, "patched")] = c.new
    return Saved(entries, blobs, *record)


def left_out(saved: Saved | None, steps: tuple) -> list:
    """The files ``saved`` records for steps that ``steps`` leaves out (their rel paths)."""
    if saved is None:
        return []
    return sorted(rel for rel in saved.entries if not saved.target(rel, None).steps & set(steps))


def original_under_edits(saved: Saved, target: Target) -> bytes | None:
    """The original to keep when a file dsfix patched before is patched again (an upgrade, say)."""
    rel, current = target.rel, target.data
    if sha256(current) == saved.entries[rel]["patched_sha256"]:
        return saved.blob(rel, "original")
    original = saved.blob(rel, "original")
    if original is None or current is None:
        return original
    # edited after the last apply: carry the user's edits over to the recorded original
    merged = merge3(saved.patched(rel), current, original)
    if merged is not None:
        return merged
    return FIXERS[target.kind].unpatch(current, saved.target(rel, current))[0]


# ----------------------------------------------------------------------------- revert


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


def _undone_by_merge(target: Target, current: bytes, patched: bytes, original: bytes | None) -> bytes | None:
    """The user's later edits (``current``) carried over to the original by a three-way merge, when that leaves
    nothing of dsfix's change (and parses); else None."""
    if original is None:
        return None
    merged = merge3(patched, current, original)
    if merged is None:
        return None
    try:
        return None if FIXERS[target.kind].is_patched(merged, target) else merged
    except DsfixError:  # the merge does not parse: not a way to undo it
        return None


def revert_with_state(saved: Saved, target: Target) -> RevertOutcome:
    rel, current = target.rel, target.data
    fixer = FIXERS[target.kind]
    original = saved.blob(rel, "original")
    if sha256(current) == saved.entries[rel]["patched_sha256"]:
        return RevertOutcome(rel, original, Status.RESTORED)
    if sha256(current) == saved.entries[rel]["original_sha256"]:
        return RevertOutcome(rel, None, Status.UNCHANGED)
    if current is None:
        return RevertOutcome(rel, None, Status.REFUSED, "the file is gone since apply")
    try:
        parse_script(current, rel)
        patched = saved.patched(rel)
        merged = _undone_by_merge(target, current, patched, original)
        if merged is not None:
            return RevertOutcome(rel, merged, Status.MERGED, notes=["kept your edits made after apply"])
        if fixer.unpatch(patched, target)[0] == original and fixer.own_part(current) == fixer.own_part(patched):
            return RevertOutcome(rel, fixer.unpatch(current, target)[0], Status.STRUCTURAL,
                                 notes=["kept your edits made after apply"])
    except DsfixError as e:
        return RevertOutcome(rel, None, Status.REFUSED, e.message, line=e.line)
    return RevertOutcome(rel, None, Status.REFUSED, "edited after apply where dsfix changed it")


def revert_without_state(target: Target, force: bool, ctx: Context) -> RevertOutcome:
    """A structural undo of what the file itself shows dsfix changed."""
    rel, cur = target.rel, target.data
    fixer = FIXERS[target.kind]
    try:
        if cur is None or not fixer.is_patched(cur, target):
            return RevertOutcome(rel, None, Status.UNCHANGED)
        edited = fixer.edited(cur, target, ctx)
        if edited and not force:
            return RevertOutcome(rel, None, Status.REFUSED, "dsfix's code in it was edited, and there is no state "
                                 "folder to compare with")
        new, notes = fixer.unpatch(cur, target, force)
    except Unreadable:  # without the state folder only parsing tells what dsfix changed; --force cannot either
        raise
    except DsfixError as e:
        return RevertOutcome(rel, None, Status.REFUSED, e.message, line=e.line)
    keep_as = rel + ".dsfix-edited" if edited and new is None else None
    notes = [*notes, "no state folder: undone structurally"]
    if keep_as:
        notes.append(f"--force: your version is kept as {keep_as}")
    return RevertOutcome(rel, new, Status.STRUCTURAL, notes=notes, keep_as=keep_as)


def revert_targets(saved: Saved | None, found: list) -> list:
    """Which files revert reads: [(rel, role, modules)]. With the state folder, the files it records; without
    it, ``found``: the checkout's targets and the files that hold dsfix's marker or call its functions, each
    once, in the order found."""
    if saved is not None:
        return [(rel, e["role"], tuple(e.get("modules") or ())) for rel, e in sorted(saved.entries.items())]
    seen, out = set(), []
    for rel, role, modules in found:
        if rel not in seen:
            seen.add(rel)
            out.append((rel, role, tuple(modules)))
    return out


def _anchored(targets: list) -> bool:
    """Without the state folder: whether dsfix patched this checkout at all, as its utils.py tells (a call of
    save_hf_format_safetensors without dsfix's block in utils.py is someone's hand edit, left alone)."""
    for t in targets:
        if FIXERS[t.kind].anchor:
            try:
                return t.data is not None and FIXERS[t.kind].is_patched(t.data, t)
            except Unreadable:  # nothing tells whether dsfix's code is there, nor --force could remove it
                raise
            except DsfixError:
                return True  # the decision (a refusal) is the fixer's, below
    return False


def plan_revert(targets: list, saved: Saved | None, force: bool) -> RevertPlan:
    """One decision per file, and the writes that carry them out, all or none."""
    if saved is not None:
        results = [revert_with_state(saved, t) for t in targets]
    elif not _anchored(targets):
        results = [RevertOutcome(t.rel, None, Status.UNCHANGED) for t in targets]
    else:
        ctx = Context(modules=tuple(dict.fromkeys(m for t in targets for m in t.modules)))
        results = [revert_without_state(t, force, ctx) for t in targets]
    refused = [r for r in results if r.status == Status.REFUSED]
    current = {t.rel: t.data for t in targets}
    if refused and force and saved is not None:
        for r in refused:
            r.new, r.status = saved.blob(r.rel, "original"), Status.RESTORED
            r.keep_as = r.rel + ".dsfix-edited" if current[r.rel] is not None else None
            r.notes.append(f"--force: restored the original ({r.reason})" + (
                f"; your version is kept as {r.keep_as}" if r.keep_as else ""))
            r.reason, r.line = "", None
        refused = []
    if refused:
        for r in results:
            if r.status in WRITTEN:
                r.status, r.notes = Status.NOT_WRITTEN, ["left as it is: revert writes every file or none"]
        return RevertPlan(tuple(results), tuple(refused))
    for r in results:
        if r.status in WRITTEN and r.new is None and current[r.rel] is not None:
            r.status = Status.REMOVED
    by_rank = {t.rel: FIXERS[t.kind].rank for t in targets}
    kept = [(r.keep_as, current[r.rel]) for r in results if r.keep_as and current[r.rel] is not None]
    restores = sorted(((r.rel, r.new) for r in results if r.status in WRITTEN and r.new != current[r.rel]),
                      key=lambda w: -by_rank[w[0]])  # the scripts first, the save module last
    return RevertPlan(tuple(results), (), tuple(kept + restores), tuple(rel for rel, _ in restores))
