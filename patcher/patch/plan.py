"""Pure planning: what apply and revert do, decided from bytes already read. No I/O here.

``plan_apply`` takes every target file and the state folder as read, and returns the new bytes of each
file, the notes and warnings, and the state folder to write (the originals to keep, even when a patched
file was edited after an earlier apply). ``plan_revert`` decides, file by file, whether to restore the
original, carry the user's later edits over (a three-way merge, else a structural undo), or refuse.
The pipeline reads once, calls one of these, and writes once.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field

import libcst as cst

from patcher.patch import calls, transforms
from patcher.patch.diff import split_lines
from patcher.errors import DsfixError
from patcher.patch.names import is_dsfix_name
from patcher.patch.template import Template, defined_name, load_loader

STEP2_WARNING = (
    "step 2 will save model.safetensors, but dsfix found no model_utils.py defining create_critic_model, step 3's "
    "critic loader, to adapt: upstream's asserts that pytorch_model.bin exists in the step-2 output, so step 3 will "
    "not start from this step-2 output unless you adapt the loader that your checkout uses"
)


class Status(str, enum.Enum):
    """What happened, or would happen, to one file."""

    WOULD_CHANGE = "would change"
    CHANGED = "changed"
    UNCHANGED = "unchanged"
    RESTORED = "restored"
    MERGED = "merged"
    STRUCTURAL = "structural"
    REFUSED = "refused"


def sha256(data: bytes) -> str:
    import hashlib  # here: only apply and revert need it

    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Target:
    """One file as read: ``data`` None when it is missing."""

    rel: str  # path relative to the checkout root, with "/"
    role: str  # "utils", "step1" / "step2" / "step3", or "loader" (the model_utils.py step 3 reads with)
    data: bytes | None
    modules: tuple = ()  # scripts: the dotted names under which they import utils.py


@dataclass(frozen=True)
class Saved:
    """The state folder's content: an entry per patched file and the original and patched bytes."""

    entries: dict  # rel -> {"role", "original_sha256", "patched_sha256", "modules", "template", "strategy"}
    blobs: dict  # (rel, "original" | "patched") -> bytes
    main: str | None = None  # the step-1 script and the further ones patched, so that later runs need no
    scripts: tuple = ()  # --main or --script again
    strategy: str | None = None  # the --strategy and --steps of the last apply, likewise remembered
    steps: tuple = ()

    def blob(self, rel: str, kind: str) -> bytes:
        return self.blobs[(rel, kind)]


@dataclass(frozen=True)
class FileChange:
    rel: str
    role: str
    old: bytes
    new: bytes
    notes: tuple = ()

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
        return [c for c in self.changes if c.changed]


@dataclass
class RevertOutcome:
    rel: str
    new: bytes | None  # None: leave the file as it is
    status: Status
    reason: str = ""
    notes: list = field(default_factory=list)
    keep_as: str | None = None  # --force: the user's version is kept under this name


@dataclass(frozen=True)
class RevertPlan:
    results: tuple
    refused: tuple  # the refused RevertOutcomes (nothing is written when there are any)
    writes: tuple = ()  # (rel, bytes) in the order to write: the users' versions kept beside first, then restores
    restored: tuple = ()  # the files whose dsfix change is undone (what "N files restored" counts)


# ----------------------------------------------------------------------------- parsing and rendering


def parse(data: bytes, rel: str) -> cst.Module:
    try:
        return cst.parse_module(data)
    except cst.ParserSyntaxError as e:
        raise DsfixError(f"does not parse: {e.message.strip()}", path=rel, line=e.raw_line) from None
    except (UnicodeDecodeError, LookupError, SyntaxError) as e:
        raise DsfixError(f"cannot be decoded: {e}", path=rel) from None


def render(module: cst.Module, rel: str) -> bytes:
    """The module's bytes in its own encoding."""
    try:
        return module.bytes
    except UnicodeEncodeError as e:
        raise DsfixError(f"the new code cannot be written in this file's encoding ({module.encoding}): {e}", path=rel)


def check_compiles(data: bytes, rel: str) -> None:
    """Python must compile the new text, so apply never writes a file that does not run."""
    try:
        compile(data, rel, "exec", dont_inherit=True)
    except SyntaxError as e:  # pragma: no cover - a dsfix bug, caught before anything is written
        raise DsfixError(f"dsfix produced code that does not compile: {e.msg}", path=rel, line=e.lineno) from None


def reparse(change: FileChange) -> None:
    """Before writing: the new text must parse again with libcst, so a later dsfix can read it back."""
    try:
        cst.parse_module(change.new)
    except cst.ParserSyntaxError as e:  # pragma: no cover - a dsfix bug, caught before anything is written
        raise DsfixError(f"dsfix produced code it cannot parse back: {e.message.strip()}", path=change.rel,
                         line=e.raw_line) from None


# ----------------------------------------------------------------------------- apply


def patch_file(target: Target, tpl: Template, strategy: str, defs: dict | None = None) -> tuple:
    """(new bytes, notes, warnings, defs) for one target."""
    rel, data = target.rel, target.data
    try:
        if target.role == "utils":
            calls.parse_script(data, rel)  # Python itself must read it (a NUL byte, say, it would not)
            res = transforms.patch_utils(data, parse(data, rel), tpl, strategy, rel)
            return res.new, res.notes, [], res.defs
        if target.role == "loader":
            res = transforms.patch_loader(data, parse(data, rel), load_loader(), rel)
            return res.new, res.notes, [], defs
        res = transforms.patch_main(data, target.modules, defs, rel)
    except DsfixError as e:
        if e.path is None:
            e.path = rel
        raise
    new = res.new if res.new is not None else data
    return new, res.notes if new != data else [], [f"{rel}:{w}" for w in res.warnings], defs


def plan_apply(targets: list, tpl: Template, strategy: str, saved: Saved | None = None,
               verify: bool = False, scripts: tuple = (), steps: tuple = (1,), drop: tuple = ()) -> ApplyPlan:
    """``targets``: utils.py first, then the scripts; ``scripts``: (step-1 script, further ones) to record,
    with ``strategy`` and ``steps``. ``drop``: files an earlier apply patched for steps that ``steps`` leaves
    out now (Targets as read), restored from ``saved``. ``verify``: compile every new text and parse it back
    with libcst (apply does; check, which writes nothing, shows the diff without)."""
    changes, warnings, defs = [], [], None
    for t in targets:
        if t.data is None:
            raise DsfixError("no such file", path=t.rel)
        new, notes, found, defs = patch_file(t, tpl, strategy, defs)
        change = FileChange(t.rel, t.role, t.data, new, tuple(notes))
        if change.changed and verify:  # before apply writes: Python compiles it, libcst parses it back
            check_compiles(new, t.rel)
            reparse(change)
        changes.append(change)
        warnings += found
        if t.role == "step2" and not any(x.role == "loader" for x in targets):
            warnings.append(STEP2_WARNING)
    listed = ",".join(map(str, steps))
    for t in drop:
        r = revert_with_state(saved, t.rel, t.data)
        if r.status == Status.REFUSED:
            how = "edited since apply where dsfix changed it" if t.data is not None else "gone since apply"
            raise DsfixError(f"patched for {_step_words(t.role)}, which --steps {listed} leaves out, but {how}; "
                             "run `dsfix revert` first, or keep that step in --steps", path=t.rel)
        if r.new is not None and t.data is not None:
            changes.append(FileChange(t.rel, t.role, t.data, r.new,
                                      (f"restores the original: --steps {listed} leaves {_step_words(t.role)} out",)))
    pending = [c for c in changes if c.changed]
    record = (scripts[0] if scripts else None, tuple(scripts[1:]), strategy, tuple(steps))
    state = None
    if pending or (saved is not None and (saved.main, tuple(saved.scripts), saved.strategy, tuple(saved.steps))
                   != record):
        entries = dict(saved.entries) if saved else {}
        blobs = dict(saved.blobs) if saved else {}
        by_rel = {t.rel: t for t in targets}
        dropped = {t.rel for t in drop}
        for c in pending:
            if c.rel in dropped:
                del entries[c.rel]
                blobs.pop((c.rel, "original"), None)
                blobs.pop((c.rel, "patched"), None)
                continue
            original = c.old
            if saved is not None and c.rel in saved.entries:
                original = original_under_edits(saved, c.rel, c.old, by_rel[c.rel].modules)
            entries[c.rel] = {"role": c.role, "original_sha256": sha256(original), "patched_sha256": sha256(c.new),
                              "template": tpl.version, "strategy": strategy, "modules": list(by_rel[c.rel].modules)}
            blobs[(c.rel, "original")] = original
            blobs[(c.rel, "patched")] = c.new
        state = Saved(entries, blobs, *record)
    return ApplyPlan(tuple(changes), tuple(warnings), state)


def _step_words(role: str) -> str:
    return "steps 2 and 3 (step 3's critic loader)" if role == "loader" else role.replace("step", "step ")


def left_out(saved: Saved | None, steps: tuple) -> list:
    """The files ``saved`` records for steps that ``steps`` leaves out (their rel paths)."""
    if saved is None:
        return []
    keep = {f"step{n}" for n in steps} | ({"loader"} if {2, 3} & set(steps) else set())
    return sorted(rel for rel, e in saved.entries.items()
                  if e.get("role") in ("step1", "step2", "step3", "loader") and e.get("role") not in keep)


def original_under_edits(saved: Saved, rel: str, current: bytes, modules: tuple) -> bytes:
    """The original to keep when a file dsfix patched before is patched again (an upgrade, say)."""
    entry = saved.entries[rel]
    if sha256(current) == entry["patched_sha256"]:
        return saved.blob(rel, "original")
    # edited after the last apply: carry the user's edits over to the recorded original
    merged = merge3(saved.blob(rel, "patched"), current, saved.blob(rel, "original"))
    if merged is not None:
        return merged
    return unpatch(current, rel, entry["role"], tuple(entry.get("modules") or modules))


# ----------------------------------------------------------------------------- revert


def unpatch(data: bytes, rel: str, role: str, modules: tuple) -> bytes:
    """Undo dsfix's change structurally; the user's other edits stay."""
    try:
        if role in ("utils", "loader"):
            module = parse(data, rel)
            new = transforms.unpatch_utils(module) if role == "utils" else transforms.unpatch_loader(module)
            out = render(new, rel) if new is not module else data
        else:
            out = transforms.unpatch_main(data, modules, rel).new or data
    except DsfixError as e:
        raise DsfixError(e.message, e.code, path=rel) from None
    if out != data:
        check_compiles(out, rel)
    return out


def dsfix_block(data: bytes) -> str:
    """dsfix's inserted statements (and the marker), as text, to tell whether a user edited them."""
    module = cst.parse_module(data)
    return "".join(module.code_for_node(s) for s in module.body
                   if (n := defined_name(s)) is not None and is_dsfix_name(n))


def has_residue(data: bytes, rel: str, role: str, modules: tuple) -> bool:
    if role in ("utils", "loader"):
        return transforms.find_marker(parse(data, rel)) is not None
    return transforms.main_is_patched(data, modules, rel)


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


_OVERLAP = ("edited after apply in a way that overlaps dsfix's change (use --force to restore the original and "
            "keep your version beside it)")


def revert_with_state(saved: Saved, rel: str, current: bytes | None) -> RevertOutcome:
    entry = saved.entries[rel]
    role, modules = entry["role"], tuple(entry.get("modules") or ())
    if current is None:
        return RevertOutcome(rel, None, Status.REFUSED, "the file is gone; restore it or use --force")
    original, patched = saved.blob(rel, "original"), saved.blob(rel, "patched")
    if sha256(current) == entry["patched_sha256"]:
        return RevertOutcome(rel, original, Status.RESTORED)
    if sha256(current) == entry["original_sha256"]:
        return RevertOutcome(rel, None, Status.UNCHANGED)
    merged = merge3(patched, current, original)
    if merged is not None and not has_residue(merged, rel, role, modules):
        return RevertOutcome(rel, merged, Status.MERGED, notes=["kept your edits made after apply"])
    structural_ok = unpatch(patched, rel, role, modules) == original
    if role in ("utils", "loader"):
        structural_ok = structural_ok and dsfix_block(current) == dsfix_block(patched)
    if structural_ok:
        try:
            return RevertOutcome(rel, unpatch(current, rel, role, modules), Status.STRUCTURAL,
                                 notes=["kept your edits made after apply"])
        except DsfixError:
            pass
    return RevertOutcome(rel, None, Status.REFUSED, _OVERLAP)


def revert_without_state(target: Target, tpl_for, force: bool) -> RevertOutcome:
    """``tpl_for(strategy)``: the template, to tell whether dsfix's block was edited."""
    rel, role, cur = target.rel, target.role, target.data
    if not has_residue(cur, rel, role, target.modules):
        return RevertOutcome(rel, None, Status.UNCHANGED)
    if role in ("utils", "loader"):
        module = parse(cur, rel)
        info = transforms.find_marker(module)
        strategy = info.get("strategy") if info.get("strategy") in ("clone", "dedupe") else "clone"
        tpl = tpl_for(strategy) if role == "utils" else load_loader()
        if f"v{tpl.version}" == info.get("template") and not force:
            base = unpatch(cur, rel, role, ())
            if role == "utils":
                redo = transforms.patch_utils(base, parse(base, rel), tpl, strategy, rel).new
            else:
                redo = transforms.patch_loader(base, parse(base, rel), tpl, rel).new
            if dsfix_block(redo) != dsfix_block(cur):
                return RevertOutcome(rel, None, Status.REFUSED, "dsfix's inserted code was edited, and there is no "
                                     "state folder to compare with (use --force to remove it anyway)")
        if info.get("replaced") and force:
            new = render(transforms.unpatch_utils(module, keep_replaced=True), rel)
            return RevertOutcome(rel, new, Status.STRUCTURAL,
                                 notes=["the hand-written function dsfix replaced could not be restored"])
    try:
        new = unpatch(cur, rel, role, target.modules)
    except DsfixError as e:
        return RevertOutcome(rel, None, Status.REFUSED, e.message)
    return RevertOutcome(rel, new, Status.STRUCTURAL, notes=["no state folder: undone structurally"])


def revert_targets(saved: Saved | None, found: list) -> list:
    """Which files revert reads, in which order: [(rel, role, modules)].

    With the state folder, the files it records (by path). Without it, ``found``: the checkout's targets
    and the files that hold dsfix's marker or call its functions, each once, utils.py first."""
    if saved is not None:
        return [(rel, e["role"], tuple(e.get("modules") or ())) for rel, e in sorted(saved.entries.items())]
    seen, out = set(), []
    for rel, role, modules in found:
        if rel not in seen:
            seen.add(rel)
            out.append((rel, role, tuple(modules)))
    return sorted(out, key=lambda t: t[1] != "utils")  # stable: otherwise in the order found


def plan_revert(targets: list, saved: Saved | None, force: bool, tpl_for) -> RevertPlan:
    """One decision per file, and the writes that carry them out. With the state folder, ``targets`` are
    the files it records; without it, utils.py first: when it holds no dsfix block, dsfix never patched
    this checkout and the scripts' calls of save_hf_format_safetensors are someone's hand edit, left alone."""
    if saved is not None:
        results = [revert_with_state(saved, t.rel, t.data) for t in targets]
    elif not targets or not has_residue(targets[0].data, targets[0].rel, "utils", ()):
        results = [RevertOutcome(t.rel, None, Status.UNCHANGED) for t in targets]
    else:
        results = [revert_without_state(t, tpl_for, force) for t in targets]
    refused = [r for r in results if r.status == Status.REFUSED]
    if refused and force and saved is not None:
        for r in refused:
            r.new, r.status = saved.blob(r.rel, "original"), Status.RESTORED
            r.keep_as = r.rel + ".dsfix-edited"
            r.notes.append(f"--force: your version is kept as {r.keep_as}")
        refused = []
    if refused:
        return RevertPlan(tuple(results), tuple(refused))
    current = {t.rel: t.data for t in targets}
    kept = [(r.keep_as, current[r.rel]) for r in results if r.keep_as and current[r.rel] is not None]
    restores = [(r.rel, r.new) for r in results if r.new is not None and r.new != current[r.rel]]
    return RevertPlan(tuple(results), (), tuple(kept + restores), tuple(rel for rel, _ in restores))
