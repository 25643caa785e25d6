"""check / apply / revert: locate, read, plan, write. Each returns an Outcome; the CLI only prints it."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from patcher import plan as planner
from patcher import state as st
from patcher import transforms
from patcher.diff import stat, unified_diff
from patcher.errors import OK, PENDING, DsfixError
from patcher.locate import Checkout, find_checkout
from patcher.template import load_template


@dataclass
class FileReport:
    rel: str
    status: str  # "would change" / "changed" / "unchanged" / "restored" / "merged" / "structural" / "refused"
    notes: list = field(default_factory=list)
    added: int = 0
    removed: int = 0


@dataclass
class Outcome:
    """One object owns the counters, the wording and the exit code (like black's Report)."""

    verb: str
    checkout: Checkout | None = None
    files: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    diff: bytes = b""
    message: str = ""
    exit_code: int = OK

    def to_json(self) -> dict:
        return {
            "verb": self.verb,
            "checkout": str(self.checkout.root) if self.checkout else None,
            "layout": self.checkout.layout if self.checkout else None,
            "exit_code": self.exit_code,
            "message": self.message,
            "files": [vars(f) for f in self.files],
            "warnings": self.warnings,
        }


def _read(co: Checkout, roles: dict) -> dict:
    return {rel: st.read_bytes(co.root / rel, rel) for rel in roles}


def _display_path(co: Checkout, rel: str) -> str:
    """The path relative to the current folder, as check's diff shows it (falls back to the checkout root)."""
    full = co.root / rel
    try:
        shown = os.path.relpath(full, Path.cwd())
    except ValueError:
        return rel
    return rel if shown.startswith("..") else Path(shown).as_posix()


def compute_plan(co: Checkout, strategy: str = "clone", steps=(1,)):
    roles = co.targets(steps)
    files = _read(co, roles)
    tpl = load_template(strategy)
    return planner.make_plan(files, roles, tpl, strategy, co.modules)


def check(repo=".", strategy: str = "clone", steps=(1,), main=None, scripts=()) -> Outcome:
    co = find_checkout(repo, main, scripts)
    plan = compute_plan(co, strategy, steps)
    out = Outcome("check", co, warnings=[*co.notes, *plan.warnings])
    diffs = []
    for c in plan.changes:
        added, removed = stat(c.old, c.new)
        out.files.append(FileReport(c.rel, "would change" if c.changed else "unchanged", list(c.notes), added, removed))
        if c.changed:
            diffs.append(unified_diff(c.old, c.new, _display_path(co, c.rel)))
    out.diff = b"".join(diffs)
    n = len(plan.pending)
    out.exit_code = PENDING if n else OK
    out.message = f"{n} file{'s' if n != 1 else ''} would change" if n else "nothing to do: already patched"
    return out


def apply(repo=".", strategy: str = "clone", steps=(1,), main=None, scripts=()) -> Outcome:
    co = find_checkout(repo, main, scripts)
    with st.lock(co.root):
        plan = compute_plan(co, strategy, steps)
        out = Outcome("apply", co, warnings=[*co.notes, *plan.warnings])
        pending = plan.pending
        for c in plan.changes:
            added, removed = stat(c.old, c.new)
            out.files.append(FileReport(c.rel, "changed" if c.changed else "unchanged", list(c.notes), added, removed))
        if not pending:
            out.message = "nothing to do: already patched"
            return out
        for c in pending:
            planner.reparse(c)
        state = st.State.load(co.root)
        previous = dict(state.data)
        for c in pending:
            entry = state.files.get(c.rel)
            original = c.old
            if entry is not None:
                original = _original_under_edits(state, c.rel, c.old, entry, co) or original
            state.record(c.rel, c.role, original, c.new, template=plan.template_version, strategy=strategy,
                         modules=list(co.modules.get(c.rel, ())))
        existed = state.exists
        try:
            state.save(status="applying", template=plan.template_version, strategy=strategy)
            st.write_all([(co.root / c.rel, c.new, c.old) for c in pending], rel_of=lambda p: co.rel(p))
            state.save(status="applied")
        except BaseException as e:
            if existed:
                state.data = previous
                with contextlib.suppress(OSError):
                    state.save()
            else:
                state.remove()
            if isinstance(e, OSError):
                raise DsfixError(f"cannot write the state folder: {e.strerror or e}; nothing was changed",
                                 path=st.STATE_DIR) from None
            raise
        n = len(pending)
        out.message = f"{n} file{'s' if n != 1 else ''} changed; undo with `dsfix revert`"
        return out


def _original_under_edits(state, rel, current, entry, co) -> bytes | None:
    """The original to keep when a file dsfix patched before is patched again (an upgrade, say)."""
    if st.sha256(current) == entry["patched_sha256"]:
        return state.blob(rel, "original")
    # edited after the last apply: carry the user's edits over to the recorded original
    merged = planner.merge3(state.blob(rel, "patched"), current, state.blob(rel, "original"))
    if merged is not None:
        return merged
    return planner.unpatch(current, rel, entry["role"], _modules(co, rel, entry))


# ----------------------------------------------------------------------------- revert


def _modules(co: Checkout, rel: str, entry=None) -> tuple:
    """The dotted names under which a script imports utils.py: as recorded at apply, else as resolved now."""
    if entry is not None and entry.get("modules"):
        return tuple(entry["modules"])
    return tuple(co.modules.get(rel, ()))


def _residue(data: bytes, rel: str, role: str, co: Checkout, entry=None) -> bool:
    module = planner.parse(data, rel)
    if role == "utils":
        return transforms.find_marker(module) is not None
    return transforms.main_is_patched(module, _modules(co, rel, entry))


def _revert_with_state(co, state, rel, entry) -> planner.RevertOutcome:
    role = entry["role"]
    path = co.root / rel
    if not path.exists():
        return planner.RevertOutcome(rel, None, "refused", "the file is gone; restore it or use --force")
    cur = st.read_bytes(path, rel)
    original, patched = state.blob(rel, "original"), state.blob(rel, "patched")
    if st.sha256(cur) == entry["patched_sha256"]:
        return planner.RevertOutcome(rel, original, "restored")
    if st.sha256(cur) == entry["original_sha256"]:
        return planner.RevertOutcome(rel, None, "unchanged")
    merged = planner.merge3(patched, cur, original)
    if merged is not None and not _residue(merged, rel, role, co, entry):
        return planner.RevertOutcome(rel, merged, "merged", notes=["kept your edits made after apply"])
    modules = _modules(co, rel, entry)
    structural_ok = planner.unpatch(patched, rel, role, modules) == original
    if role == "utils":
        structural_ok = structural_ok and planner.dsfix_block(cur) == planner.dsfix_block(patched)
    if structural_ok:
        try:
            new = planner.unpatch(cur, rel, role, modules)
        except DsfixError:
            new = None
        if new is not None:
            return planner.RevertOutcome(rel, new, "structural", notes=["kept your edits made after apply"])
    return planner.RevertOutcome(
        rel, None, "refused", "edited after apply in a way that overlaps dsfix's change (use --force to restore the original and keep your version beside it)"
    )


def _revert_without_state(co, rel, role, force) -> planner.RevertOutcome:
    path = co.root / rel
    cur = st.read_bytes(path, rel)
    if not _residue(cur, rel, role, co):
        return planner.RevertOutcome(rel, None, "unchanged")
    module = planner.parse(cur, rel)
    if role == "utils":
        info = transforms.find_marker(module)
        tpl = load_template(info.get("strategy", "clone") if info.get("strategy") in ("clone", "dedupe") else "clone")
        if f"v{tpl.version}" == info.get("template") and not force:
            base = planner.unpatch(cur, rel, role, ())
            redo = transforms.patch_utils(planner.parse(base, rel), tpl, info.get("strategy", "clone"), rel, base).module
            if planner.dsfix_block(redo.bytes) != planner.dsfix_block(cur):
                return planner.RevertOutcome(
                    rel, None, "refused", "dsfix's inserted code was edited, and there is no state folder to compare with (use --force to remove it anyway)"
                )
        if info.get("replaced") and force:
            new = planner.render(transforms.unpatch_utils(module, keep_replaced=True).module, rel)
            return planner.RevertOutcome(rel, new, "structural", notes=["the hand-written function dsfix replaced could not be restored"])
    try:
        new = planner.unpatch(cur, rel, role, _modules(co, rel))
    except DsfixError as e:
        return planner.RevertOutcome(rel, None, "refused", e.message)
    return planner.RevertOutcome(rel, new, "structural", notes=["no state folder: undone structurally"])


def revert(repo=".", force: bool = False, steps=(1, 2, 3), main=None, scripts=()) -> Outcome:
    co = find_checkout(repo, main, scripts)
    out = Outcome("revert", co)
    with st.lock(co.root):
        state = st.State.load(co.root)
        if state.exists:
            results = [_revert_with_state(co, state, rel, e) for rel, e in sorted(state.files.items())]
        else:
            roles = co.targets([s for s in co.step_mains if s in steps])
            results = [_revert_without_state(co, rel, role, force) for rel, role in roles.items()]
        refused = [r for r in results if r.how == "refused"]
        if refused and force and state.exists:
            for r in refused:
                path = co.root / r.rel
                if path.exists():
                    st.atomic_write(path.with_name(path.name + ".dsfix-edited"), path.read_bytes())
                r.new, r.how = state.blob(r.rel, "original"), "restored"
                r.notes.append(f"--force: your version is kept as {r.rel}.dsfix-edited")
            refused = []
        for r in results:
            out.files.append(FileReport(r.rel, r.how, r.notes + ([r.reason] if r.reason else [])))
        if refused:
            out.exit_code = PENDING
            names = ", ".join(r.rel for r in refused)
            out.message = f"refused, nothing written: {names} changed since apply; " + refused[0].reason
            return out
        writes = []
        for r in results:
            if r.new is not None:
                path = co.root / r.rel
                old = path.read_bytes() if path.exists() else b""
                if r.new != old:
                    writes.append((path, r.new, old))
        st.write_all(writes, rel_of=lambda p: co.rel(p))
        if state.exists:
            state.remove()
        n = len(writes)
        if n:
            out.message = f"{n} file{'s' if n != 1 else ''} restored"
        else:
            out.message = "nothing to revert: no dsfix patch found"
        return out


__all__ = ["check", "apply", "revert", "Outcome"]
