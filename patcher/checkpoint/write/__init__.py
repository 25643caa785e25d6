"""Writing converted folders: the plan (:mod:`.plan`: ties, dtype, the checks before writing), the one writer
(:mod:`.writer`), staging, the checks after writing and the one commit (:mod:`.stage`), durable files
(:mod:`.files`). :func:`write` runs them for every folder of a conversion: all of them are written, or none."""

from __future__ import annotations

from typing import Any

from patcher.checkpoint.progress import MIN_BYTES as PROGRESS_MIN_BYTES
from patcher.checkpoint.progress import Progress
from patcher.checkpoint.write.stage import Job, Staged, commit, discard, stage_job
from patcher.errors import Written, stop_point

__all__ = ["Job", "Staged", "write", "PROGRESS_MIN_BYTES"]


def write(jobs: list, console: Any = None, min_bytes: int = PROGRESS_MIN_BYTES) -> list:
    """Stage each job in turn, stopping at the first whose checks fail; when all passed, commit them all. Returns
    the staged folders: committed when every one is ``ok``, else nothing was written. Raises DsfixError when a
    folder cannot be written (nothing written)."""
    total = sum(job.plan.nbytes * (2 if job.compare_back else 1) for job in jobs)
    staged: list = []
    try:
        with Progress(console, "dsfix convert", total=total, min_total=min_bytes) as bar:
            for job in jobs:
                bar.phase("converting (write, then compare)" if job.compare_back else "converting (write)")
                staged.append(stage_job(job, bar.advance))
                if not staged[-1].ok:
                    return staged
        stop_point("convert.staged")
        commit(staged)
        Written.mark()  # an interrupt from here on leaves the converted files in place
        stop_point("convert.committed")
        return staged
    finally:
        discard([s.staging for s in staged])
