"""Staging, checking and committing converted folders: all of them or none, whatever fails.

A conversion writes into a staging folder (``.dsfix-convert-XXXX``, held by this run: :mod:`.files`) on the
file system of its target: inside the target when the target is a ``.bin`` folder converted in place, beside
it when the target is a new folder (``--output``). There the weights are written (:mod:`.writer`), the config,
generation config and tokenizer copied, and the folder checked as ``dsfix verify`` checks a folder (and loaded)
while a thread makes the files durable (fsync). Only when every target passed are they committed: an in-place
target gets its files moved in one by one (weights first, the index last) and any failure moves them back; a
new target is the staging folder renamed into place, in one step. The staging folders are always removed.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple

from patcher.checkpoint.check.adapter import adapter_checks
from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.check.load import critic_load_check, load_check
from patcher.checkpoint.check.model import ADAPTER, CRITIC
from patcher.checkpoint.check.values import same_bits
from patcher.checkpoint.check.verify import verify_folder
from patcher.checkpoint.names import CONFIG_NAME, COPIED, STAGING_PREFIX, examples
from patcher.checkpoint.readers.base import Reader
from patcher.checkpoint.readers.peft import ADAPTER_FILES, ADAPTER_WEIGHTS
from patcher.checkpoint.readers.safetensors import SafetensorsFolder
from patcher.checkpoint.write.files import clear_stale, fsync, fsync_folder, make_staging, release
from patcher.checkpoint.write.plan import Plan
from patcher.checkpoint.write.writer import MAX_SHARD_SIZE, Writer
from patcher.errors import DsfixError


class Job(NamedTuple):
    """One folder to write: the reader (steps applied), where the files go, the config's folder, the plan."""

    reader: Reader
    target: Path
    in_place: bool  # the target is the source's own folder: its other files stay, the new ones are moved in
    config: Path  # the folder whose config.json (and, into a new folder, generation config and tokenizer) go along
    plan: Plan
    load: bool = True
    limit: int = MAX_SHARD_SIZE

    @property
    def compare_back(self) -> bool:
        """Whether the written tensors are read back and compared with the source's (it holds them at hand)."""
        return self.reader.random_access


class Staged(NamedTuple):
    job: Job
    staging: Path
    names: list  # what goes into place, in order
    checks: list  # the checks of the written folder
    nbytes: int  # the weight files' bytes

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def stage_job(job: Job, advance: Callable[[int], None]) -> Staged:
    """Write ``job``'s folder into a new staging folder and check it there. Raises DsfixError when it cannot be
    written (the staging folder removed); a failed check is in the result's checks."""
    parent = job.target if job.in_place else job.target.parent
    clear_stale(parent, STAGING_PREFIX)  # a killed run's
    try:
        staging = make_staging(parent, STAGING_PREFIX)  # held until renamed or removed
    except OSError as e:
        raise DsfixError(f"cannot write here: {e.strerror or e}; nothing written", path=str(parent)) from e
    try:
        return _write_and_check(job, staging, advance)
    except BaseException:
        discard([staging])
        raise


def _write_and_check(job: Job, staging: Path, advance: Callable[[int], None]) -> Staged:
    single = ADAPTER_WEIGHTS if job.plan.kind == ADAPTER else None
    writer = Writer(staging, job.plan.entries, job.reader.folder, job.limit, advance, single)
    try:
        with ThreadPoolExecutor(max_workers=1) as disk:
            writer.open()
            job.reader.stream(writer.put, staging)
            names = writer.finish()
            kept = job.reader.extra_files(staging, job.plan.floating_dtype)
            _copy_config(job, staging)
            synced = disk.submit(fsync_folder, staging)
            checks = _checks(job, staging, names, advance) + kept
            synced.result()  # a failed fsync (EIO, ENOSPC on write-back) fails the convert
    except OSError as e:
        raise DsfixError(f"cannot write the converted files: {e.strerror or e}; nothing written",
                         path=str(staging.parent)) from e
    finally:
        writer.close()
    moved = names if job.in_place else sorted(p.name for p in staging.iterdir())
    return Staged(job, staging, moved, checks, sum((staging / n).stat().st_size for n in names))


def _copy_config(job: Job, staging: Path) -> None:
    """config.json (for the checks; into a new folder also the generation config and the tokenizer); a PEFT
    adapter's adapter_config.json and model card, and the tokenizer."""
    names: tuple
    if job.plan.kind == ADAPTER:
        names = ADAPTER_FILES + COPIED
    else:
        names = (CONFIG_NAME,) + (COPIED if not job.in_place else ())
    for name in names:
        if (job.config / name).is_file():
            shutil.copyfile(job.config / name, staging / name)


def _checks(job: Job, staging: Path, names: list, advance: Callable[[int], None]) -> list:
    """The written folder checked as ``dsfix verify`` does, what the plan checked that the folder cannot say
    (the source, the vocabulary, the LoRA fusion), a load, and the tensors read back (where the source allows)."""
    plan = job.plan
    if plan.kind == ADAPTER:
        with SafetensorsFolder(staging, single=ADAPTER_WEIGHTS) as written:
            return [plan.checks[0]] + adapter_checks(written, plan.model, written.header, job.load)
    report = verify_folder(staging, expect=len(plan.entries), load=False)
    checks = [plan.checks[0]] + list(report.checks)
    tied = report.check("tied")
    if tied is not None and tied.ok and plan.ties:
        checks[checks.index(tied)] = tied._replace(detail=f"{tied.detail}; {examples(plan.ties)}")
    checks += [c for c in plan.checks if c.name in ("vocab", "lora")]
    config = report.check("config")
    if job.load and config is not None and config.ok:
        if plan.kind == CRITIC:
            with SafetensorsFolder(staging) as written:
                checks.append(critic_load_check(written))
        else:  # in the files' own dtype, so a bf16 model is not loaded at twice its size
            checks.append(load_check(staging, dtype=plan.floating_dtype)[0])
    if job.compare_back:
        checks.append(_equal_check(job, staging, advance))
    return checks


def _equal_check(job: Job, staging: Path, advance: Callable[[int], None]) -> Check:
    """Every written tensor read back, bit-equal to the source's."""
    differ = []
    with SafetensorsFolder(staging) as written:
        for e in job.plan.entries:
            back = written.read([e.name])[e.name]
            source = job.reader.slice(e.source)
            if not same_bits(back, source.to(e.dtype)):
                differ.append(e.name)
            advance(back.numel() * back.element_size())
    src, n = job.reader.name, len(job.plan.entries)
    if differ:
        return Check("equal", False, f"{len(differ)} of {n} tensors differ from {src}: {examples(differ)}")
    return Check("equal", True, f"{n} tensors equal, bit for bit, to {src}'s")


def commit(staged: list) -> None:
    """Put every staged folder in place: all of them or none (a failure moves back what it moved)."""
    for s in staged:
        clash = [n for n in s.names if (s.job.target / n).exists()] if s.job.in_place else []
        if clash:
            raise DsfixError(f"{examples(clash)} appeared while converting; nothing written", path=str(s.job.target))
    moved: list = []
    try:
        for s in staged:
            if s.job.in_place:
                for name in s.names:  # shards first, the index last
                    os.replace(s.staging / name, s.job.target / name)
                    moved.append((s.staging / name, s.job.target / name))
                fsync(s.job.target)
            else:
                os.rename(s.staging, s.job.target)  # onto a missing or empty folder: atomic
                moved.append((s.staging, s.job.target))
                fsync(s.job.target.parent)
    except BaseException as e:
        for back, there in reversed(moved):
            try:
                os.replace(there, back)
            except OSError:
                pass
        if isinstance(e, OSError):
            where = getattr(e, "filename", "") or staged[0].job.target
            raise DsfixError(f"cannot move the converted files into place: {e.strerror or e}; nothing written",
                             path=str(where)) from e
        raise


def discard(folders: list) -> None:
    """Remove staging folders (whatever of them is left) and let go of their locks."""
    for staging in folders:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        release(staging)
