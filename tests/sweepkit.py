"""The fault sweep's driver (tests/test_fault_sweep.py): for one operation, record every filesystem call it
makes on a real run, then run it again once per call N, (a) with that call failing with each errno of
``faultkit.ERRNOS[kind]`` and (b) killed with SIGKILL right before it, and check what each run leaves.

An operation is an ``Op``: ``make(folder)`` builds its input inside ``folder`` (a checkout, a ``.bin`` folder),
``run(folder)`` runs it through the command line in this process (typer's CliRunner, ``--json``) and returns
(exit code, the JSON result, stderr). Every trial runs on its own copy of the input, made by copying a
pristine one, so the calls and their order are those of the recording.

(a) A failed call: the run either fails, with the documented exit code, one line ``dsfix: error: ...`` that
names the cause (the errno's text) and a path, and every file byte for byte (and mode) as before; or it
succeeds, and then its folder is the complete new state (a call dsfix can do without: an fsync of a folder, the
removal of its own leftovers, which the next run removes by itself).

(b) A kill: every file the operation touches is wholly old or wholly new, anything else is a leftover of
dsfix's own that the next run removes; the same operation run again ends in the complete new state, and
``undo`` (revert after apply, say), where given, in the previous one.

A kill runs in a child forked from this process after every import (the real process state, killed by a real
SIGKILL), which is far cheaper than a new interpreter a trial.
"""
from __future__ import annotations

import errno as errno_codes
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from faultkit import ERRNOS, Call, Faults, snapshot


@dataclass
class Op:
    name: str
    make: Callable[[Path], Path]  # builds the input inside the given folder; returns the folder to watch
    run: Callable[[Path], tuple]  # (exit code, JSON result, stderr)
    error_code: int = 2  # the documented exit code of a failed write
    undo: Optional[Callable[[Path], tuple]] = None  # after a kill: back to the previous state
    leftover: str = r"$^"  # a regular expression for the names of dsfix's own leftovers (relative paths)
    also: list = field(default_factory=list)  # faultkit's ``also``: functions that write from C
    watch: Callable[[Path], list] = lambda root: [root]  # the roots faults count in


@dataclass
class Outcome:
    calls: list
    failed: int = 0  # trials (a) that ended in a failure
    survived: int = 0  # trials (a) that succeeded all the same (the call was one dsfix can do without)
    killed: int = 0  # trials (b)
    problems: list = field(default_factory=list)


def _after_fork() -> None:
    """In a forked child: torch's OpenMP pool is the parent's, whose threads the child lacks (GNU OpenMP waits
    for them forever); one thread, as DataLoader's workers do. Only the child's compute changes."""
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    else:  # imported later, in this child: one thread from the start, so that its own children can fork too
        os.environ["OMP_NUM_THREADS"] = "1"


class _OneThread:
    """torch on one thread while a sweep records or fails calls in this process, as in its forked children
    (``_after_fork``): the calls of a save that writes from a pool of threads are then the same everywhere."""

    def __enter__(self):
        import sys

        self.torch = sys.modules.get("torch")
        if self.torch is not None:
            self.before = self.torch.get_num_threads()
            self.torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.torch is not None:
            self.torch.set_num_threads(self.before)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _strip(snap: dict, leftover: str) -> dict:
    return {rel: v for rel, v in snap.items() if not re.search(leftover, rel)}


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    return lines[-1] if lines else ""


class Sweep:
    """One operation's sweep, in ``base`` (a fresh temporary folder)."""

    def __init__(self, op: Op, base: Path):
        self.op, self.base = op, base
        self.pristine = base / "pristine"
        self.pristine.mkdir()
        self.root_rel = op.make(self.pristine).relative_to(self.pristine)
        self.before = snapshot(self.pristine)
        self._n = 0
        work = self._fresh("record")
        with _OneThread(), Faults(roots=self.op.watch(work / self.root_rel), also=op.also) as rec:
            code, result, err = op.run(work / self.root_rel)
        assert code == 0, (op.name, code, err)
        self.calls = rec.calls
        self.after = snapshot(work)
        self.after_root = work

    def _fresh(self, tag: str) -> Path:
        self._n += 1
        return _copy(self.pristine, self.base / f"{tag}-{self._n}")

    # -- (a) ------------------------------------------------------------------------------------------------
    def fail(self, n: int, error: str, out: Outcome) -> None:
        op, work = self.op, self._fresh(f"fail{n}-{error}")
        root = work / self.root_rel
        with _OneThread(), Faults(roots=op.watch(root), fail_at=n, error=error, also=op.also) as f:
            code, result, err = op.run(root)
        where = f"{op.name}: call {n} ({self.calls[n]}) failing with {error}"
        assert f.failed is not None, f"{where}: never reached (the calls differ from the recording's)"
        now = snapshot(work)
        if code == 0:
            out.survived += 1
            if _strip(now, op.leftover) != _strip(self.after, op.leftover):
                out.problems.append(f"{where}: exit 0, but the folder is not the complete new state")
                return
            if set(now) - set(self.after):  # dsfix's own leftovers: the next run must remove them
                code2, _, err2 = op.run(root)
                if code2 != 0 or snapshot(work) != self.after:
                    out.problems.append(f"{where}: exit 0 left {sorted(set(now) - set(self.after))}, which the "
                                        f"next run did not clear (exit {code2}: {err2.strip()[-300:]})")
            return
        out.failed += 1
        line = one_line(err)
        text = os.strerror(getattr(errno_codes, error))
        problems = []
        if code != op.error_code:
            problems.append(f"exit {code}, not {op.error_code}")
        if now != self.before:
            changed = sorted(k for k in set(now) | set(self.before) if now.get(k) != self.before.get(k))
            problems.append(f"files changed: {changed[:6]}")
        if not line.startswith("dsfix: error: ") or "internal error" in line:
            problems.append(f"not one dsfix error line: {line!r}")
        if text not in line:
            problems.append(f"the line does not name the cause ({text}): {line!r}")
        error_obj = (result or {}).get("error") or {}
        if not error_obj.get("path") and not re.search(r"(^|\s)[^\s:]*/[^\s:]*:", line):
            problems.append(f"the line names no path: {line!r}")
        if problems:
            out.problems.append(f"{where}: " + "; ".join(problems))

    # -- (b) ------------------------------------------------------------------------------------------------
    def kill(self, n: int, out: Outcome, undo: bool = True) -> None:
        op, work = self.op, self._fresh(f"kill{n}")
        root = work / self.root_rel
        where = f"{op.name}: killed before call {n} ({self.calls[n]})"
        pid = os.fork()
        if pid == 0:  # the child: the faults, the operation, and never back into pytest
            try:
                _after_fork()
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                with Faults(roots=op.watch(root), kill_at=n, also=op.also):
                    op.run(root)
            finally:
                os._exit(99)
        _, status = os.waitpid(pid, 0)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9):
            out.problems.append(f"{where}: the child was not killed (status {status})")
            return
        out.killed += 1
        now = snapshot(work)
        torn = [rel for rel in set(now) | set(self.before) | set(self.after)
                if not re.search(op.leftover, rel) and now.get(rel) not in (self.before.get(rel), self.after.get(rel))]
        if torn:
            out.problems.append(f"{where}: neither old nor new: {sorted(torn)[:6]}")
        if op.undo is not None and undo:
            twin = _copy(work, self.base / f"undo{n}")
            code, _, err = op.undo(twin / self.root_rel)
            if code != 0 or snapshot(twin) != self.before:
                out.problems.append(f"{where}: undo (exit {code}) did not give the previous state back: "
                                    f"{one_line(err)!r}")
            shutil.rmtree(twin)
        if now == self.after:  # the kill came after the last call that mattered: already the new state
            return
        code, _, err = op.run(root)
        if code != 0 or snapshot(work) != self.after:
            left = sorted(set(snapshot(work)) ^ set(self.after))
            out.problems.append(f"{where}: running it again (exit {code}) did not end in the new state "
                                f"(differing: {left[:6]}): {one_line(err)!r}")

    def run(self, points: Optional[list] = None, errors: Optional[Callable] = None, kill: bool = True,
            undo_at: Optional[set] = None) -> Outcome:
        """Every call (or ``points``), each errno of its kind (or ``errors(kind)``), and a kill before each;
        after a kill, ``undo`` too where the operation has one (at the calls ``undo_at`` only, when given)."""
        out = Outcome(self.calls)
        for n in (range(len(self.calls)) if points is None else points):
            for error in (ERRNOS[self.calls[n].kind] if errors is None else errors(self.calls[n].kind)):
                self.fail(n, error, out)
            if kill:
                self.kill(n, out, undo=undo_at is None or n in undo_at)
            for p in self.base.glob(f"*{n}*"):  # keep the disk small: a trial's copy is done with
                if p.name.startswith(("fail", "kill")) and p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
        return out


def cli_json(*args) -> tuple:
    """Run dsfix through the command line in this process with ``--json``: (exit code, result, stderr)."""
    from patchkit import cli

    code, stdout, stderr = cli(*args, "--json")
    try:
        result = json.loads(stdout.decode() or "null")
    except ValueError:
        result = None
    return code, result, stderr


def call_sites(calls) -> list:
    """The first and the last call of each function (kind, function): where a long run of the same call
    (engine convert's hundreds of pwrites, one a tensor piece) goes through the same line of dsfix's code, the
    first and the last of them stand for the rest; every call of a kind that puts things in place or takes them
    away (rename, unlink, rmtree, mkdir) is kept."""
    first, last, keep = {}, {}, set()
    for n, call in enumerate(calls):
        key = (call.kind, call.func)
        first.setdefault(key, n)
        last[key] = n
        if call.kind in ("rename", "unlink", "rmtree", "mkdir"):
            keep.add(n)
    return sorted(set(first.values()) | set(last.values()) | keep)


def fork_at(module, point: str, roots: list, trials: Callable, run: Callable[[], tuple], between: Callable[[], None],
            check: Callable) -> list:
    """The sweep of an operation whose start is expensive (smoke: a model built and trained once): a child of
    this process runs it, counting calls, up to the named stop point ``point`` (patcher.errors.stop_point, as
    ``module`` calls it) and there forks one grandchild per trial, which goes on with its fault armed. The
    first grandchild runs without one (the recording); ``trials(calls, before)`` then gives the trials from its
    calls (``before``: how many came before the point): (N, errno name) fails call N, (N, None) kills before it.
    ``between()`` puts the folders back as they were at the point before each trial (its calls not counted);
    ``check(trial, status, outcome)`` runs in the child after each (outcome: the grandchild's (exit code,
    JSON, stderr, whether the fault fired, its calls), None when killed) and returns problems.
    Returns [the recorded calls, problems...]."""
    import pickle
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".sweep")
    os.close(fd)
    pid = os.fork()
    if pid == 0:  # the child: it never returns into pytest
        _after_fork()
        problems, state = [None], {"trial": None, "faults": None}
        real = module.stop_point
        try:
            def stop_point(name):
                real(name)
                if name != point or state["trial"] is not None:
                    return
                faults = state["faults"]
                queue, recording, before = [("record", None)], None, len(faults.calls)
                while queue:
                    trial = queue.pop(0)
                    roots, faults.roots = faults.roots, []  # between() is the test's: not counted
                    between()
                    faults.roots = roots
                    del faults.calls[before:]
                    out_path = f"{path}.{trial[0]}-{trial[1]}"
                    grandchild = os.fork()
                    if grandchild == 0:
                        state["trial"], state["out"] = trial, out_path
                        n, error = trial
                        if n != "record" and error is None:
                            faults.kill_at = n
                        elif n != "record":
                            faults.fail_at, faults.error = n, getattr(errno_codes, error)
                        return  # on with the operation, in the grandchild
                    _, status = os.waitpid(grandchild, 0)
                    outcome = None
                    if os.path.exists(out_path):
                        with open(out_path, "rb") as handle:
                            outcome = pickle.load(handle)
                        os.unlink(out_path)
                    if recording is None:
                        recording = [Call(*c) for c in outcome[4]] if outcome else []
                        problems[0] = recording
                        queue = list(trials(recording, before))
                    problems.extend(check(trial, status, outcome))
                with open(path, "wb") as handle:
                    pickle.dump(problems, handle)
                os._exit(0)

            module.stop_point = stop_point
            with Faults(roots=roots) as faults:
                state["faults"] = faults
                outcome = run()
            if state["trial"] is not None:  # a grandchild whose operation ended
                outcome = (*outcome, faults.failed is not None, [tuple(c) for c in faults.calls])
                with open(state["out"], "wb") as handle:
                    pickle.dump(outcome, handle)
                os._exit(0)
            problems.append(f"{point} was never reached: {outcome}")
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            if state["trial"] is not None:
                os._exit(98)
            problems.append(f"the sweep's child failed: {type(e).__name__}: {e}")
        finally:
            if state["trial"] is None:
                with open(path, "wb") as handle:
                    pickle.dump(problems, handle)
            os._exit(0)
    os.waitpid(pid, 0)
    with open(path, "rb") as handle:
        problems = pickle.load(handle)
    os.unlink(path)
    return problems
