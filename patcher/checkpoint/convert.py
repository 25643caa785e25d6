"""``dsfix convert DIR``: turn a DeepSpeed-Chat ``.bin`` output folder into a verified safetensors folder.

DeepSpeed-Chat's unpatched saves write ``pytorch_model.bin`` (a pickle) beside ``config.json``; transformers'
``save_pretrained(safe_serialization=False)`` writes ``pytorch_model.bin.index.json`` and shards. convert:

1. finds the folders: ``DIR`` itself, or a step-3 output folder's ``actor``, ``critic`` and ``actor_ema``;
2. loads every ``.bin`` with ``torch.load(weights_only=True, map_location="cpu", mmap=True)`` (``mmap``
   only for zip-format files) and refuses, before anything is written, a pickle that needs code to load;
3. plans the tensors against the config's model built on the meta device (the causal LM, or the critic
   as ``create_critic_model`` builds it, see :mod:`patcher.checkpoint.critic`): a tied alias that the save dropped
   (upstream's ZeRO-3 save keeps ``named_parameters()`` only, so ``lm_head.weight`` is missing) is
   restored from its partner under ``clone``; an alias present is dropped under ``dedupe``. Keys, shapes,
   dtypes and non-emptiness are checked here, before writing: a failure writes nothing (exit 1);
4. writes the safetensors files with ``safetensors.torch.save_file`` into a temporary folder inside
   ``DIR``, fsyncs them, runs :func:`patcher.checkpoint.verify.verify_folder` on that folder (load included), and
   compares every written tensor bit for bit with the ``.bin``'s;
5. only when every folder passed, renames the files into place (shards first, the index last), fsyncs
   the folder, and removes the ``.bin`` files if asked. Any failure before that leaves every folder as
   it was; the temporary folder is always removed.

No extra copy of the weights is made: the ``.bin`` is memory-mapped, ``save_file`` (safetensors 0.6+)
writes from the tensors' memory, and the only tensor copied is a tied alias that shares storage with its
partner (``save_file`` refuses shared storage), under ``clone``, where it must be its own tensor anyway.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from patcher.checkpoint import checks as ck
from patcher.checkpoint.checks import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, Check, Header, examples
from patcher.checkpoint.files import clear_stale, fsync, make_staging, release
from patcher.checkpoint.verify import model_folders
from patcher.checkpoint.progress import Progress
from patcher.errors import OK, PENDING, DsfixError, Written, need_folder, stop_point
from patcher.report import Checks, Result, Status

BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
STAGING_PREFIX = ".dsfix-convert-"
PROGRESS_MIN_BYTES = 64 * 2**20  # show a progress bar (on a terminal) from this much data on
STRATEGIES = ("clone", "dedupe")

# --------------------------------------------------------------------------- results


class ConvertStatus(Status):
    """What happened to one folder, and to the whole run (the worst of its folders)."""

    CONVERTED = ("converted", OK)
    NOTHING = ("nothing to convert", OK)
    FAILED = ("failed", PENDING)  # a check failed: nothing written
    NOT_WRITTEN = ("not written", PENDING)  # this folder passed, another failed: nothing written


@dataclass(frozen=True)
class FolderResult(Checks):
    path: str
    status: ConvertStatus
    ok: bool
    checks: tuple = ()
    kind: Optional[str] = None
    strategy: str = "clone"
    source: tuple = ()  # the .bin files read (names in the folder)
    written: tuple = ()  # the files written (names in the folder)
    tensors: Optional[int] = None
    restored: tuple = ()  # "ALIAS <- PARTNER": tied aliases written as their own copy though the .bin lacked them
    dropped: tuple = ()  # tied aliases the .bin held but dedupe left out
    removed: tuple = ()  # .bin files removed (--remove-bin)
    bytes_written: int = 0
    mmap: Optional[bool] = None  # whether the .bin was memory-mapped
    note: str = ""

    def to_dict(self) -> dict:
        return {
            "path": self.path, "status": self.status.value, "ok": self.ok, "kind": self.kind,
            "strategy": self.strategy, "source": list(self.source), "written": list(self.written),
            "tensors": self.tensors, "restored": list(self.restored), "dropped": list(self.dropped),
            "removed": list(self.removed), "bytes_written": self.bytes_written, "mmap": self.mmap,
            "note": self.note, "checks": [c._asdict() for c in self.checks],
        }

    def summary(self) -> str:
        if self.status is ConvertStatus.NOTHING:
            return f"nothing to convert in {self.path}: {self.note}"
        if self.status is ConvertStatus.NOT_WRITTEN:
            return f"not converted {self.path}: {self.note}"
        if self.status is ConvertStatus.FAILED:
            return f"not converted {self.path}: a check failed; nothing written"
        how = self.strategy
        if self.restored:
            how += f"; restored {examples(self.restored)}"
        if self.dropped:
            how += f"; dropped tied alias {examples(self.dropped)}"
        tail = (f"removed {examples(self.removed)}" if self.removed
                else f"{examples(self.source)} kept (--remove-bin removes it)")
        return (f"converted {self.path}: {examples(self.source)} -> {examples(self.written)}, "
                f"{self.tensors} tensors ({how}); {tail}")


@dataclass(frozen=True)
class ConvertReport(Result):
    path: str
    strategy: str
    folders: tuple  # of FolderResult
    verb = "convert"
    warnings = ()

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.folders)

    @property
    def status(self) -> ConvertStatus:
        if not self.ok:
            return ConvertStatus.FAILED
        done = any(f.status is ConvertStatus.CONVERTED for f in self.folders)
        return ConvertStatus.CONVERTED if done else ConvertStatus.NOTHING

    @property
    def message(self) -> str:
        return "; ".join(f.summary() for f in self.folders)

    def body(self) -> dict:
        return {"path": self.path, "ok": self.ok, "strategy": self.strategy,
                "folders": [f.to_dict() for f in self.folders]}


@dataclass
class _Plan:
    """One folder to convert: what was read, what will be written."""

    folder: Path
    source: list  # .bin names
    sharded: bool
    state: dict = field(default_factory=dict)  # key -> tensor (memory-mapped)
    origin: dict = field(default_factory=dict)  # key -> index of its .bin in source
    mmap: bool = True
    already: Optional[str] = None  # why there is nothing to convert
    # filled by _plan_tensors
    kind: Optional[str] = None
    out: dict = field(default_factory=dict)  # file name -> {key: tensor}
    partner: dict = field(default_factory=dict)  # key written -> the .bin key whose data it holds
    restored: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    checks: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for files in self.out.values() for t in files.values())


# --------------------------------------------------------------------------- entry point


def convert(path, *, strategy: str = "clone", remove_bin: bool = False, load: bool = True, console=None,
            progress_min_bytes: int = PROGRESS_MIN_BYTES) -> ConvertReport:
    """Convert ``path`` (a model folder, or a step-3 folder of them). Raises DsfixError (code 2) on bad input;
    a failed check gives ``ok=False``. Either every folder is converted or none is touched. The input is
    checked (and a folder that is already safetensors answered) before torch is imported; then third-party
    warnings and bars are off (a refused pickle is one line of dsfix's, not torch's warning)."""
    from patcher.checkpoint.quiet import quiet

    if strategy not in STRATEGIES:
        raise DsfixError(f"--strategy must be clone or dedupe, not {strategy}")
    need_folder(path)
    plans = [_survey(folder) for folder in model_folders(path)]
    for plan in plans:  # a killed run's staging folder, even where there is nothing left to convert
        clear_stale(plan.folder, STAGING_PREFIX)
    if all(plan.already is not None for plan in plans):
        return ConvertReport(str(path), strategy, tuple(_nothing(plan, strategy) for plan in plans))
    with quiet():
        return _convert(Path(path), plans, strategy, remove_bin, load, console, progress_min_bytes)


def _nothing(plan: _Plan, strategy: str) -> FolderResult:
    return FolderResult(str(plan.folder), ConvertStatus.NOTHING, True, note=plan.already, strategy=strategy)


def _convert(root: Path, plans: list, strategy: str, remove_bin: bool, load: bool, console,
             progress_min_bytes: int) -> ConvertReport:
    results: dict = {}
    todo = []
    for plan in plans:
        if plan.already is not None:
            results[plan.folder] = _nothing(plan, strategy)
            continue
        _load(plan)
        _plan_tensors(plan, strategy)
        if any(not c.ok for c in plan.checks):
            results[plan.folder] = _failed(plan, strategy)
        else:
            todo.append(plan)
    staged: list = []  # (plan, staging folder, written names, checks)
    try:
        if not any(r.status is ConvertStatus.FAILED for r in results.values()):
            _stage_all(todo, staged, results, strategy, load, console, progress_min_bytes)
        if any(r.status is ConvertStatus.FAILED for r in results.values()):
            for plan in todo:
                results.setdefault(plan.folder, FolderResult(
                    str(plan.folder), ConvertStatus.NOT_WRITTEN, False, kind=plan.kind, strategy=strategy,
                    source=tuple(plan.source), note="another folder failed a check; nothing written"))
        else:
            stop_point("convert.staged")
            _commit(staged)
            Written.mark()  # an interrupt from here on leaves the safetensors files in place
            stop_point("convert.committed")
            for plan, _, written, checks in staged:
                results[plan.folder] = _converted(plan, strategy, written, checks, remove_bin)
    finally:
        for _, staging, _, _ in staged:
            shutil.rmtree(staging, ignore_errors=True)
            release(staging)
    return ConvertReport(str(root), strategy, tuple(results[p.folder] for p in plans))


def _stage_all(todo: list, staged: list, results: dict, strategy: str, load: bool, console, min_bytes: int) -> None:
    """Write and check every folder's files in its staging folder; stop at the first that fails a check."""
    total = 2 * sum(p.nbytes for p in todo)
    with Progress(console, "dsfix convert", total=total, min_total=min_bytes) as bar:
        bar.phase("converting (write, then compare)")
        for plan in todo:
            staging, written, checks = _stage(plan, load, bar.advance)
            staged.append((plan, staging, written, checks))
            if not all(c.ok for c in checks):
                results[plan.folder] = _failed(plan, strategy, checks)
                break


def _converted(plan: _Plan, strategy: str, written: list, checks: list, remove_bin: bool) -> FolderResult:
    removed = _remove_bins(plan) if remove_bin else []
    return FolderResult(
        str(plan.folder), ConvertStatus.CONVERTED, True, tuple(checks), kind=plan.kind, strategy=strategy,
        source=tuple(plan.source), written=tuple(written), tensors=sum(len(v) for v in plan.out.values()),
        restored=tuple(plan.restored), dropped=tuple(plan.dropped), removed=tuple(removed),
        bytes_written=plan.nbytes, mmap=plan.mmap)


def _failed(plan: _Plan, strategy: str, checks=None) -> FolderResult:
    return FolderResult(str(plan.folder), ConvertStatus.FAILED, False, tuple(checks if checks is not None else plan.checks),
                        kind=plan.kind, strategy=strategy, source=tuple(plan.source), mmap=plan.mmap,
                        tensors=sum(len(v) for v in plan.out.values()) or None)


# --------------------------------------------------------------------------- reading


def _survey(folder: Path) -> _Plan:
    """What the folder holds, from its file names (no torch): the .bin files to convert, or why there is
    nothing to convert (``folder``: ``convert``'s checked folder, or one of its model folders). Raises
    DsfixError (code 2) on bad input."""
    st_name = next((n for n in (SINGLE_NAME, INDEX_NAME) if (folder / n).is_file()), None)
    if (folder / BIN_INDEX_NAME).is_file():
        source, sharded = bin_shards(folder), True
    elif (folder / BIN_NAME).is_file():
        source, sharded = [BIN_NAME], False
    elif st_name is not None:
        return _Plan(folder, [], False, already=f"it is already safetensors ({st_name})")
    else:
        others = sorted(p.name for p in folder.glob("*.bin"))
        found = f"; found only {examples(others)}" if others else ""
        from patcher.checkpoint.zero import contents

        found = found or f"; found {contents(folder)}"
        raise DsfixError(f"no {BIN_NAME} (also not in actor/, critic/, actor_ema/), no latest, no checkpoint-N/{found}",
                         path=str(folder))
    if st_name is not None:
        return _Plan(folder, source, sharded, already=f"{st_name} is already there beside {examples(source)} "
                                                      f"(remove {st_name} to convert again)")
    if not (folder / CONFIG_NAME).is_file():
        raise DsfixError(f"no {CONFIG_NAME}: convert needs the model's config to check the weights", path=str(folder))
    return _Plan(folder, source, sharded)


def _load(plan: _Plan) -> None:
    """Load the folder's .bin files, weights-only (torch)."""
    for i, name in enumerate(plan.source):
        state, mapped = load_bin(plan.folder / name)
        plan.mmap = plan.mmap and mapped
        for key, tensor in state.items():
            if key in plan.state:
                raise DsfixError(f"{key} is in both {plan.source[plan.origin[key]]} and {name}", path=str(plan.folder))
            plan.state[key] = tensor
            plan.origin[key] = i
    if not plan.state:
        raise DsfixError(f"{examples(plan.source)} holds no tensors", path=str(plan.folder))


def bin_shards(folder: Path) -> list:
    index = folder / BIN_INDEX_NAME
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is not a non-empty object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DsfixError(f"{BIN_INDEX_NAME} is unreadable: {e}", path=str(folder))
    shards = sorted(set(weight_map.values()))
    bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s]
    if bad:
        raise DsfixError(f"{BIN_INDEX_NAME} names shards outside the folder: {examples(bad)}", path=str(folder))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise DsfixError(f"{BIN_INDEX_NAME} names shards that are missing: {examples(missing)}", path=str(folder))
    return shards


def load_bin(path: Path) -> tuple[dict, bool]:
    """(state dict, memory-mapped?) of a ``torch.save`` file, loaded weights-only on the CPU.

    A pickle that needs code to load (a custom class, a function call) is refused with DsfixError (code 2).
    """
    import pickle

    import torch

    mapped = zipfile.is_zipfile(path)  # mmap needs the zip format (torch.save's default since 1.6)
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise DsfixError(f"refused: this pickle needs code to load{what}, which a weights-only load does not run; "
                         "nothing written", path=str(path))
    except MemoryError:
        raise
    except Exception as e:
        msg = " ".join(str(e).split())
        raise DsfixError(f"not a readable torch.save file: {type(e).__name__}: {msg[:200]}", path=str(path))
    if not isinstance(obj, dict):
        raise DsfixError(f"holds an object of type {type(obj).__name__}, not a state dict of tensors", path=str(path))
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        k = bad[0]
        hint = " (a training checkpoint? convert wants the saved model's weights)" if isinstance(obj[k], dict) else ""
        raise DsfixError(f"not a state dict of tensors: {k!r} holds an object of type {type(obj[k]).__name__}{hint}", path=str(path))
    sparse = [k for k, v in obj.items() if v.layout != torch.strided]
    if sparse:
        raise DsfixError(f"sparse tensors cannot be saved as safetensors: {examples(sparse)}", path=str(path))
    return obj, mapped


# --------------------------------------------------------------------------- planning and pre-checks


def _plan_tensors(plan: _Plan, strategy: str) -> None:
    """Decide the output files and tensors, and check them against the config's meta model (no writing)."""
    from patcher.checkpoint import verify as v

    cfg, cfg_check, cfg_dtype = ck.load_config(plan.folder)
    plan.kind = v.folder_kind(plan.state)
    plan.checks.append(Check("source", True, _source_detail(plan)))
    plan.checks.append(cfg_check)
    if cfg is None:
        return
    try:
        meta = v.meta_model(cfg, plan.kind)
        built = v.model_name(meta, plan.kind)
        expected, tie_groups = v.expected_of(meta)
        del meta
    except Exception as e:
        plan.checks.append(Check("keys", False, f"cannot build the model of {CONFIG_NAME} on meta: {type(e).__name__}: {e}"))
        return
    keep, tied_bad = _tie_aliases(plan, strategy, expected, tie_groups)
    plan.out = _out_files(plan, keep)
    head = Header(files=list(plan.out))
    for name, tensors in plan.out.items():
        for key, t in tensors.items():
            head.entries[key] = (tuple(int(d) for d in t.shape), ck.dtype_code(str(t.dtype)), name)
    keys = ck.keys_check(head, expected, tie_groups)
    if plan.kind == v.CRITIC:
        keys = keys._replace(detail=f"{keys.detail} (critic: {built})")
    plan.checks.append(keys)
    plan.checks.append(ck.shapes_check(head, expected))
    plan.checks.append(ck.nonempty_check(head))
    plan.checks.append(ck.dtype_check(head, cfg_dtype)[0])
    if tied_bad:
        plan.checks.append(Check("tied", False, f"tied aliases in the .bin differ from their partner: "
                                                f"{examples(tied_bad)}; refusing to pick one"))
    elif tie_groups:
        done = [f"restored {r}" for r in plan.restored] + [f"dropped {d} (dedupe)" for d in plan.dropped]
        plan.checks.append(Check("tied", True, examples(done) if done else "nothing to restore or drop"))
    else:
        plan.checks.append(Check("tied", True, f"{built} ties no tensors: nothing to restore"))


def _tie_aliases(plan: _Plan, strategy: str, expected: dict, tie_groups: list) -> tuple[dict, list]:
    """(key -> tensor to write, in the .bin's order; tied aliases that differ from their partner). clone
    restores an alias the .bin lacks from its partner; dedupe drops one it holds. Fills plan.partner,
    plan.restored and plan.dropped."""
    keep = dict(plan.state)
    partner = {k: k for k in keep}
    tied_bad = []
    for group in tie_groups:
        present = [k for k in group if k in plan.state]
        if not present:
            continue
        first = present[0]
        for other in present[1:]:
            if not _equal(plan.state[other], plan.state[first]):
                tied_bad.append(f"{other} != {first}")
            elif strategy == "dedupe":
                del keep[other], partner[other]
                plan.dropped.append(other)
        if strategy == "clone":
            for missing in (k for k in group if k not in plan.state):
                if tuple(plan.state[first].shape) == expected[missing]:
                    keep[missing] = plan.state[first]
                    partner[missing] = first
                    plan.restored.append(f"{missing} <- {first}")
    plan.partner = partner
    return keep, tied_bad


def _out_files(plan: _Plan, keep: dict) -> dict:
    """file name -> {key: tensor}: one file, or one shard per input shard (a restored alias beside its partner)."""
    if not plan.sharded:
        return {SINGLE_NAME: keep}
    groups: dict = {}
    for key in keep:
        groups.setdefault(plan.origin[plan.partner[key]], {})[key] = keep[key]
    filled = [groups[i] for i in sorted(groups)]
    n = len(filled)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(filled)}


def _source_detail(plan: _Plan) -> str:
    how = "memory-mapped" if plan.mmap else "read (not zip format, so not memory-mapped)"
    return f"{examples(plan.source)}: {len(plan.state)} tensors, loaded weights-only, {how}"


def _equal(a, b) -> bool:
    """Bit-equal; cheap when both are the same memory."""
    from patcher.checkpoint.verify import same_bits

    if (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr() and a.device == b.device):
        return True
    return same_bits(a, b)


# --------------------------------------------------------------------------- writing


def _unshare(tensors: dict) -> tuple[dict, list]:
    """The tensors, each its own contiguous memory as save_file wants; copies only what overlaps or is strided.
    What overlaps is the save module's own rule (``find_overlap``), so both agree."""
    from patcher.templates.dsfix_safetensors import find_overlap

    out, spans, copied = {}, {}, []
    for key, t in tensors.items():
        if not t.is_contiguous():
            t = t.contiguous()
        elif find_overlap(key, t, spans)[0] is not None:
            t = t.clone()
            copied.append(key)
        out[key] = t
    return out, copied


def _stage(plan: _Plan, load: bool, advance) -> tuple[Path, list, list]:
    """Write the folder's safetensors into a temporary folder inside it, verify and compare them there.

    Returns (staging folder, names to move into place, checks); the caller removes the staging folder.
    Raises DsfixError (code 2) when the folder cannot be written, with the staging folder removed.
    """
    try:
        staging = make_staging(plan.folder, STAGING_PREFIX)  # held until removed: never taken for a killed run's
    except OSError as e:
        raise DsfixError(f"cannot write here: {e.strerror or e}; nothing written", path=str(plan.folder))
    try:
        written, checks = _write_and_check(plan, staging, load, advance)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        release(staging)
        raise
    return staging, written, checks


def _write_and_check(plan: _Plan, staging: Path, load: bool, advance) -> tuple[list, list]:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from patcher.checkpoint.verify import CRITIC, critic_load_check, load_check, same_bits, verify_folder

    written = []
    try:
        for name, tensors in plan.out.items():
            ready, _ = _unshare(tensors)
            save_file(ready, str(staging / name), metadata={"format": "pt"})
            del ready
            fsync(staging / name)
            written.append(name)
            advance(sum(t.numel() * t.element_size() for t in tensors.values()))
        if plan.sharded:
            index = {"metadata": {"total_size": plan.nbytes},
                     "weight_map": {k: name for name, ts in plan.out.items() for k in sorted(ts)}}
            index["weight_map"] = dict(sorted(index["weight_map"].items()))
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            fsync(staging / INDEX_NAME)
            written.append(INDEX_NAME)
        mode = stat.S_IMODE(os.stat(plan.folder / plan.source[0]).st_mode)
        for name in written:  # save_file creates 0600 files; give them the .bin's permissions
            os.chmod(staging / name, mode)
        shutil.copyfile(plan.folder / CONFIG_NAME, staging / CONFIG_NAME)  # for the checks; not moved
        fsync(staging)
    except Exception as e:  # OSError, or safetensors' own error on a full disk
        reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise DsfixError(f"cannot write here: {reason}; nothing written", path=str(plan.folder))

    count = sum(len(v) for v in plan.out.values())
    report = verify_folder(staging, expect=count, load=False)
    checks = [plan.checks[0]] + list(report.checks)
    if load and report.check("config") is not None and report.check("config").ok:
        if report.kind == CRITIC:
            checks.append(critic_load_check(staging))
        else:  # in the files' own dtype, so a bf16 model is not loaded at twice its size
            import torch

            dtype = getattr(torch, report.dtype) if report.dtype else None
            checks.append(load_check(staging, dtype=dtype)[0])
    if plan.restored or plan.dropped:
        tied = report.check("tied")
        if tied is not None and tied.ok:
            done = [f"restored {r}" for r in plan.restored] + [f"dropped {d} (dedupe)" for d in plan.dropped]
            checks[checks.index(tied)] = tied._replace(detail=f"{tied.detail}; {examples(done)}")

    differ, compared = [], 0
    for name, tensors in plan.out.items():
        with safe_open(str(staging / name), framework="pt") as f:
            for key, source in tensors.items():
                if not same_bits(f.get_tensor(key), source):
                    differ.append(key)
                compared += 1
                advance(source.numel() * source.element_size())
    src = examples(plan.source)
    checks.append(Check("equal", not differ, f"{len(differ)} of {compared} tensors differ from {src}: {examples(differ)}"
                        if differ else f"{compared} tensors equal, bit for bit, to {src}'s"))
    return written, checks


def _commit(staged: list) -> None:
    """Move every staged file into place: all folders or none (a failure moves back what it moved)."""
    for plan, staging, written, _ in staged:
        clash = [n for n in written if (plan.folder / n).exists()]
        if clash:
            raise DsfixError(f"{examples(clash)} appeared while converting; nothing written", path=str(plan.folder))
    moved = []
    try:
        for plan, staging, written, _ in staged:
            for name in written:  # shards first, the index last
                os.replace(staging / name, plan.folder / name)
                moved.append((staging / name, plan.folder / name))
            fsync(plan.folder)
    except BaseException as e:
        for back, there in reversed(moved):
            try:
                os.replace(there, back)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise DsfixError(f"cannot move the converted files into place: {e.strerror or e}; nothing written",
                             path=str(getattr(e, "filename", "") or staged[0][0].folder))
        raise


def _remove_bins(plan: _Plan) -> list:
    names = list(plan.source) + ([BIN_INDEX_NAME] if plan.sharded else [])
    removed = []
    for name in names:
        try:
            (plan.folder / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise DsfixError(f"converted, but cannot remove {name}: {e.strerror or e}", path=str(plan.folder))
    fsync(plan.folder)
    return removed
