"""check / apply / revert: locate, read everything once, plan (pure), write once. Each returns an Outcome;
the CLI only prints it."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from patcher.errors import OK, PENDING, DsfixError
from patcher.patch import plan as planner
from patcher.patch import safe
from patcher.patch import state as st
from patcher.patch.diff import stat, unified_diff
from patcher.patch.locate import Checkout, find_checkout, layout_of
from patcher.patch.names import SAVE_NAMES, TEMPLATE_MARK
from patcher.patch.plan import Status, Target
from patcher.patch.scan import chat_roots_below, find_patched
from patcher.patch.source import Unreadable, parse_script
from patcher.patch.template import check_strategy
from patcher.report import Result

STEP2_WARNING = (
    "step 2 will save model.safetensors, but dsfix found no model_utils.py defining create_critic_model, step 3's "
    "critic loader, to adapt: upstream's asserts that pytorch_model.bin exists in the step-2 output, so step 3 will "
    "not start from this step-2 output unless you adapt the loader that your checkout uses"
)


@dataclass
class FileReport:
    rel: str
    status: Status
    notes: list = field(default_factory=list)
    added: int = 0
    removed: int = 0


def exit_code(verb: str, files: list) -> int:
    """The one place the patch verbs' exit codes come from: check 1 when a file would change, revert 1 when
    one is refused."""
    if verb == "check" and any(f.status == Status.WOULD_CHANGE for f in files):
        return PENDING
    if verb == "revert" and any(f.status == Status.REFUSED for f in files):
        return PENDING
    return OK


def stat_text(rows, width: int = 80) -> str:
    """``git diff --stat``'s summary of [(name, added, removed)]: a line per file, then the totals."""
    rows = [(n, a, r) for n, a, r in rows if a or r]
    if not rows:
        return ""
    name_w = max(len(n) for n, _, _ in rows)
    most = max(a + r for _, a, r in rows)
    count_w = len(str(most))
    bar_w = max(10, width - name_w - count_w - 5)
    lines = []
    for name, a, r in rows:
        if most > bar_w:  # scaled as git does: every non-zero side keeps at least one mark
            plus = max(1, a * bar_w // most) if a else 0
            minus = max(1, r * bar_w // most) if r else 0
        else:
            plus, minus = a, r
        lines.append(f" {name.ljust(name_w)} | {str(a + r).rjust(count_w)} {'+' * plus}{'-' * minus}")
    n, added, removed = len(rows), sum(a for _, a, _ in rows), sum(r for _, _, r in rows)
    total = f" {n} file{'s' if n != 1 else ''} changed"
    if added:
        total += f", {added} insertion{'s' if added != 1 else ''}(+)"
    if removed:
        total += f", {removed} deletion{'s' if removed != 1 else ''}(-)"
    return "\n".join(lines + [total]) + "\n"


@dataclass
class Outcome(Result):
    """One object owns the file reports, the wording and the exit code (like black's Report)."""

    verb: str
    root: Path
    layout: str | None  # None: revert worked from the state folder alone
    files: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    diff: bytes = b""
    message: str = ""
    new_bytes: dict = field(default_factory=dict)  # check: rel -> the bytes apply would write
    status = None  # no status of its own (each file has one): the exit code comes from the files (not a field)

    @property
    def exit_code(self) -> int:
        return exit_code(self.verb, self.files)

    def body(self) -> dict:
        return {
            "checkout": str(self.root),
            "layout": self.layout,
            "files": [{**vars(f), "status": f.status.value} for f in self.files],
        }

    def render(self, out, opts: dict) -> None:
        """check: the diff on stdout (or --stat's summary; nothing with --json); apply: --stat's summary.
        Both: a line per file and the message on stderr (``out``: :data:`patcher.console.err`)."""
        if not opts.get("as_json"):
            if opts.get("stat"):
                sys.stdout.write(stat_text([(f.rel, f.added, f.removed) for f in self.files]))
                sys.stdout.flush()
            elif self.verb == "check":
                sys.stdout.flush()
                sys.stdout.buffer.write(self.diff)
                sys.stdout.buffer.flush()
        where = {None: "as recorded in its state folder", "marked": "found by dsfix's marker lines"}.get(
            self.layout, f"{self.layout} layout")
        out.print(f"dsfix {self.verb}: {self.root} ({where})")
        for f in self.files:
            status = f.status.value
            style = {"refused": "red", "would change": "yellow", "changed": "green"}.get(status, "none")
            counts = f" (+{f.added} -{f.removed})" if f.added or f.removed else ""
            out.line("  ", (status, style), f": {f.rel}{counts}")
            for n in f.notes:
                out.line(f"      {n}")
        for w in self.warnings:
            out.line(("warning:", "yellow"), f" {w}")
        out.print(self.message)


def _plural(n: int, what: str = "file") -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _targets(co: Checkout, steps, strict: bool = True) -> list:
    """Every target, read once (None: not there yet): utils.py and the save module first, then the scripts."""
    return [Target.of_role(rel, role, _maybe_read(co.root / rel, rel), modules)
            for rel, role, modules in co.targets(steps, strict)]


def _warnings(targets: list) -> list:
    """Step 2 saves safetensors, but no loader was found for step 3 to read them with."""
    if any(t.step == 2 for t in targets) and not any(t.kind == "loader" for t in targets):
        return [STEP2_WARNING]
    return []


def _display_path(root: Path, rel: str) -> str:
    """The path check's diff shows. In a git repository, relative to its top, as `git diff` writes them, so
    `git apply` takes the diff from any folder of the repository; else relative to the current folder,
    falling back to the checkout root."""
    top = next((d for d in (root, *root.parents) if (d / ".git").exists()), None)
    try:
        shown = os.path.relpath(root / rel, top if top is not None else Path.cwd())
    except ValueError:
        return rel
    return rel if shown.startswith("..") else Path(shown).as_posix()


def _report(verb: str, co: Checkout, plan: planner.ApplyPlan, status: Status, targets: list) -> Outcome:
    out = Outcome(verb, co.root, co.layout, warnings=[*co.notes, *plan.warnings, *_warnings(targets)])
    for c in sorted(plan.changes, key=lambda c: c.rel):
        added, removed = stat(c.old or b"", c.new or b"")
        out.files.append(FileReport(c.rel, status if c.changed else Status.UNCHANGED, list(c.notes), added, removed))
    return out


_MARKER_STRATEGY = re.compile(rb"# dsfix: template=v\d+ strategy=(clone|dedupe)\b")


@dataclass(frozen=True)
class Options:
    strategy: str
    steps: tuple
    record: st.Record | None  # what the state folder records, if anything


def options(co: Checkout, strategy: str | None, steps) -> Options:
    """The options a run uses: those given, else those the last apply recorded in the state folder, else the
    strategy dsfix's marker line in utils.py names, else clone and step 1."""
    rec = st.record_at(co.root)
    if strategy is None:
        strategy = rec.strategy if rec is not None else None
    if strategy is None:
        try:
            m = _MARKER_STRATEGY.search(co.utils_path.read_bytes())
        except OSError:
            m = None
        strategy = m.group(1).decode() if m else "clone"
    if not steps:
        steps = rec.steps if rec is not None and rec.steps else (1,)
    return Options(check_strategy(strategy), tuple(sorted(set(steps))), rec)


def _drops(co: Checkout, opts: Options, saved) -> list:
    """The files an earlier apply patched for steps that the steps asked for now leave out, as read."""
    return [saved.target(rel, _maybe_read(co.root / rel, rel)) for rel in planner.left_out(saved, opts.steps)]


def saves_safely(co: Checkout) -> str | None:
    """What the checkout's own saves already do, where they keep tied weights in safetensors as they are (see
    patcher.patch.safe); None where dsfix has work to do, or has patched this checkout before."""
    if st.record_at(co.root) is not None:
        return None
    data = _maybe_read(co.utils_path, co.rel(co.utils_path))
    if data is None or TEMPLATE_MARK in data:
        return None
    return safe.already_safe(parse_script(data, co.rel(co.utils_path))[0], SAVE_NAMES)


def _already_safe(verb: str, co: Checkout, what: str) -> Outcome:
    """check and apply on a checkout whose saves need no change: no file, one line, exit 0."""
    return Outcome(verb, co.root, co.layout, warnings=list(co.notes), message=f"nothing to do: {what}")


def check(repo=".", strategy: str | None = None, steps=None, main=None, scripts=()) -> Outcome:
    """``strategy`` and ``steps`` None: as the last apply recorded them (see ``options``)."""
    co = find_checkout(repo, main, scripts)
    done = saves_safely(co)
    if done is not None:
        return _already_safe("check", co, done)
    opts = options(co, strategy, steps)
    saved, drop = None, []
    if opts.record is not None and set(opts.record.steps) - set(opts.steps):  # steps left out: shown restored
        saved = st.load(co.root)
        drop = _drops(co, opts, saved)
    targets = _targets(co, opts.steps)
    plan = planner.plan_apply(targets, opts.strategy, saved, steps=opts.steps, drop=drop)
    out = _report("check", co, plan, Status.WOULD_CHANGE, targets)
    out.diff = b"".join(unified_diff(c.old, c.new, _display_path(co.root, c.rel))
                        for c in sorted(plan.pending, key=lambda c: c.rel))
    out.new_bytes = {c.rel: c.new for c in plan.pending}
    n = len(plan.pending)
    out.message = f"{_plural(n)} would change" if n else "nothing to do: already patched"
    return out


def apply(repo=".", strategy: str | None = None, steps=None, main=None, scripts=()) -> Outcome:
    """``strategy`` and ``steps`` None: as the last apply recorded them; what this apply used is recorded."""
    co = find_checkout(repo, main, scripts)
    done = saves_safely(co)
    if done is not None:
        return _already_safe("apply", co, done)
    with st.lock(co.root):
        st.recover(co.root)
        opts = options(co, strategy, steps)
        saved = st.load(co.root)
        scripts = tuple(co.rel(p) for p in (co.step_mains[1], *co.scripts))
        targets = _targets(co, opts.steps)
        plan = planner.plan_apply(targets, opts.strategy, saved, verify=True, scripts=scripts, steps=opts.steps,
                                  drop=_drops(co, opts, saved))
        out = _report("apply", co, plan, Status.CHANGED, targets)
        if not plan.pending:
            if plan.state is not None:  # the same files, other options to remember
                st.commit(co.root, [], plan.state, rel_of=co.rel)
            out.message = "nothing to do: already patched"
            return out
        st.commit(co.root, [(co.root / c.rel, c.new) for c in plan.pending], plan.state, rel_of=co.rel)
        out.message = f"{_plural(len(plan.pending))} changed; undo with `dsfix revert`"
        return out


def revert(repo=".", force: bool = False, main=None, scripts=()) -> Outcome:
    """With the state folder (found at or above ``repo``), the files it records; without, a structural undo
    of what dsfix changed, found in the files themselves (see scan.find_patched). What to do with each
    file, in which order, and what counts as restored is plan_revert's; here: read, then write once."""
    root = st.find_root(repo)
    co, not_a_checkout = None, None
    if root is None:
        try:
            co = find_checkout(repo, main, scripts)
            root = co.root
        except Unreadable:  # a step script that does not parse: what it calls is unknown, nothing to decide
            raise
        except DsfixError as e:  # a layout only --main could name, say: the files still tell what dsfix changed
            not_a_checkout = e
            root = Path(repo).resolve()
            if len(chat_roots_below(root)) > 1:  # which checkout? as check, revert does not guess
                raise
    with st.lock(root):
        st.recover(root)
        saved = st.load(root)
        found = []
        if saved is None:
            found = list(co.targets(list(co.step_mains), False)) if co is not None else []
            found += [(Path(os.path.relpath(path, root)).as_posix(), role, modules)
                      for path, role, modules in find_patched(root)]
            if not found and not_a_checkout is not None:  # no state folder, no checkout, no marker
                raise not_a_checkout
        order = planner.revert_targets(saved, found)
        targets = [Target.of_role(rel, role, _maybe_read(root / rel, rel), modules) for rel, role, modules in order]
        st.clear_temps(root / t.rel for t in targets)  # a killed apply's, which nothing else would remove
        plan = planner.plan_revert(targets, saved, force)
        layout = layout_of(saved, co)
        out = Outcome("revert", root, layout)
        for r in sorted(plan.results, key=lambda r: r.rel):
            out.files.append(FileReport(r.rel, r.status, r.notes + ([r.reason] if r.reason else [])))
        if plan.refused:
            out.message = _refusal(plan.refused, force, saved is not None)
            return out
        st.commit(root, [(root / rel, data) for rel, data in plan.writes], None if saved is not None else st.KEEP,
                  rel_of=lambda p: Path(os.path.relpath(p, root)).as_posix())
        out.message = _reverted(plan)
        if saved is None and not plan.restored:  # nothing of dsfix's here: no list of the files looked at
            out.files = []
        return out


def _reverted(plan: planner.RevertPlan) -> str:
    removed = sum(1 for r in plan.results if r.status == Status.REMOVED)
    restored = len(plan.restored) - removed
    if not plan.restored:
        return "nothing to revert: no dsfix patch found"
    return ", ".join(part for part in (f"{_plural(restored)} restored" if restored else "",
                                       f"{removed} removed" if removed else "") if part)


def _refusal(refused: tuple, force: bool, with_state: bool) -> str:
    """One line: what was refused, why (where), and, unless --force was given, what --force would do."""
    first = refused[0]
    where = f"{first.rel}:{first.line}: " if first.line else f"{first.rel}: "
    others = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    hint = ""
    if not force:
        hint = ("; --force restores the original and keeps your version beside it" if with_state else
                "; --force removes dsfix's code anyway")
    return f"refused, nothing written: {where}{first.reason}{others}{hint}"


def _maybe_read(path: Path, rel: str) -> bytes | None:
    return st.read_bytes(path, rel) if path.exists() else None


__all__ = ["check", "apply", "revert", "Outcome", "FileReport", "exit_code"]
