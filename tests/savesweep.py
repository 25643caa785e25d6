"""The save module's fault sweep, as SQLite's I/O-error and crash tests: record every filesystem call a real
save makes in its output folder (tests/faultkit.py), then run it again once per call N with that call failing
(each errno of faultkit.ERRNOS[kind]) and once killed (SIGKILL) right before it, and check the outcome.

Shared by tests/test_save_module_faults.py (ZeRO-0 and the fallback, in this process) and tests/faults_ranks.py
(ZeRO-3 on 2 CPU ranks). A ``Sweep`` holds one operation, ``op(out)``, and the folder it starts from (a
previous save, a stale pytorch_model.bin, what an older dsfix and a killed save left); each check returns
the problems it found as lines, an empty list when the outcome is the promised one:

  fail(n, error)  the save raises one line naming the cause and the path, and the folder is byte for byte as
                  before (the fallback folder aside: when the fallback was written, it is complete); or the
                  save succeeded, and the folder is the complete new save (what could not be removed of an
                  older save's leftovers aside). No temporary file is left.
  kill(n)         the killed save changed nothing but files it can name (``find_leftovers``, and ``dsfix
                  verify`` through it); every file of the previous save is in place or in the killed save's
                  .replaced; the next save completes and leaves the folder exactly as a clean save does.
"""
import contextlib
import errno
import io
import os
import re
import shutil
import signal
import time

from faultkit import ERRNOS, Faults, snapshot
from patcher.templates import dsfix_safetensors as M

FALLBACK = M.FALLBACK_FOLDER


def _also():
    """C-level writers counted as one call each: torch.save (the fallback's pytorch_model.bin)."""
    import torch

    return [(torch, "save", "write")]


def previous_save(folder, model, tokenizer):
    """The folder a sweep starts from: ``model``'s save as one file, a stale pytorch_model.bin, a temporary
    weight file of dsfix's earlier inline save, and the staging folder of a save killed before its final phase."""
    M.save_hf_format(model, tokenizer, str(folder))
    with open(os.path.join(folder, "pytorch_model.bin"), "wb") as handle:
        handle.write(b"an old save the next one removes")
    with open(os.path.join(folder, ".model.safetensors.7.dsfix-tmp"), "wb") as handle:
        handle.write(b"torn")
    os.mkdir(os.path.join(folder, ".dsfix-save-7"))
    with open(os.path.join(folder, ".dsfix-save-7", "model.safetensors"), "wb") as handle:
        handle.write(b"torn")


def _plain(snap):
    """The entries that are no leftover of dsfix's (hidden names) and not in the fallback folder."""
    return {k: v for k, v in snap.items() if not k.startswith(".") and not k.startswith(FALLBACK)}


def _fallback_part(snap):
    return {k: v for k, v in snap.items() if k == FALLBACK or k.startswith(FALLBACK + "/")}


def _generic(path):
    """A call's path without the process id (a child's staging folder is named by its own)."""
    return re.sub(r"\.(dsfix-save-|pytorch_model\.bin\.)\d+", r".\1PID", path)


class Sweep:
    """One operation, ``op(out)``, swept over every filesystem call it makes in ``work/out``. ``prepare(folder)``
    writes the folder it starts from; ``state``: the tensors the fallback must hold when it writes one."""

    def __init__(self, work, op, prepare, state):
        self.work = os.path.realpath(str(work))
        self.out = os.path.join(self.work, "out")
        self.pristine = os.path.join(self.work, "pristine")
        os.makedirs(self.pristine)
        prepare(self.pristine)
        self.op, self.state = op, state
        self.before = snapshot(self.pristine)
        self.calls, self.expected, self.baseline = None, None, None

    # -- runs -----------------------------------------------------------------------------------------------
    def reset(self):
        if os.path.lexists(self.out):
            shutil.rmtree(self.out)
        shutil.copytree(self.pristine, self.out, symlinks=True)

    def _run(self, faults):
        """(the exception raised or None, what the save printed)."""
        printed, self.last = io.StringIO(), None
        with contextlib.redirect_stdout(printed):
            try:
                with faults:
                    self.op(self.out)
            except BaseException as exc:  # noqa: B036 - Ctrl-C included: the sweep reports it
                self.last = exc
                return exc, printed.getvalue()
        return None, printed.getvalue()

    def record(self):
        """The calls of a real run, and the folder it leaves (what every later outcome is compared with)."""
        self.reset()
        faults = Faults(roots=[self.out], also=_also())
        exc, printed = self._run(faults)
        self.calls = list(faults.calls)
        self.baseline = _outcome(exc)
        self.expected = snapshot(self.out)
        self.expected_printed = printed
        return self.calls

    def cases(self, every=1):
        """(n, errno name) for each call and each errno of its kind; ``every``: every so many calls only."""
        return [(n, e) for n, call in enumerate(self.calls) if n % every == 0 for e in ERRNOS[call.kind]]

    # -- (a) one call fails ---------------------------------------------------------------------------------
    def fail(self, n, error):
        self.reset()
        faults = Faults(roots=[self.out], fail_at=n, error=error, also=_also())
        exc, printed = self._run(faults)
        return self.check_failed(n, error, faults.failed, exc, printed)

    def check_failed(self, n, error, failed, exc, printed):
        where = f"fail {n} {error} ({self.calls[n]})"
        if failed is None or _generic(failed.path) != _generic(self.calls[n].path) or failed.kind != self.calls[n].kind:
            return [f"{where}: the run made other calls than the recorded one ({failed})"]
        after = snapshot(self.out)
        line = _line(printed, "FALLBACK")
        broken = line is not None and "FALLBACK FAILED" in line
        degraded = line is not None and line != _line(self.expected_printed, "FALLBACK")  # config or tokenizer
        if _outcome(exc) == self.baseline and not broken and not degraded:  # it succeeded, as the recorded run
            return self._succeeded_despite(where, failed, after)
        problems = []
        text = line if _outcome(exc) == self.baseline or broken else str(exc)
        if "\n" in text.strip() or os.strerror(getattr(errno, error)) not in text or failed.path not in text:
            problems.append(f"{where}: the error is not one line naming the cause and the path: {text!r}")
        if _plain(after) != _plain(self.before) or {k: v for k, v in after.items() if k.startswith(".")} != \
                {k: v for k, v in self.before.items() if k.startswith(".")}:
            problems.append(f"{where}: the folder is not as before: {_diff(self.before, after)}")
        problems += self._fallback_ok(where, after, printed)
        return problems

    def _succeeded_despite(self, where, failed, after):
        """A failed call the save may pass over: removing an older save's leftover once the new one is in."""
        if after == self.expected:  # the failed call did not matter (os.makedirs of a folder that is there)
            return []
        lost = os.path.relpath(failed.path, self.out)
        keep = {k: v for k, v in after.items() if k != lost and not k.startswith(lost + "/")}
        if keep != {k: v for k, v in self.expected.items() if k != lost} or failed.kind not in ("unlink", "rmtree"):
            return [f"{where}: the save reported success, but the folder is not the new save: "
                    f"{_diff(self.expected, after)}"]
        return []

    def _fallback_ok(self, where, after, printed):
        if "FALLBACK:" not in printed:
            if _fallback_part(after) != _fallback_part(self.before):
                return [f"{where}: no fallback was written, yet {FALLBACK}/ changed: {_diff(self.before, after)}"]
            return []
        problems = []
        for key, entry in _fallback_part(after).items():
            name = key.partition("/")[2]
            reference = self.expected.get(key, self.expected.get(name))
            if name.startswith("."):
                problems.append(f"{where}: a temporary file in the fallback: {name}")
            elif name and name != "pytorch_model.bin" and entry != reference:
                problems.append(f"{where}: the fallback's {name} is not the complete file")
        bin_path = os.path.join(self.out, FALLBACK, "pytorch_model.bin")
        import torch

        saved = torch.load(bin_path, weights_only=True)
        if set(saved) != set(self.state) or not all(torch.equal(saved[k], v) for k, v in self.state.items()):
            problems.append(f"{where}: the fallback's pytorch_model.bin does not hold the model's tensors")
        return problems

    # -- (b) killed right before a call ---------------------------------------------------------------------
    def kill(self, n, run_killed=None):
        """Killed (SIGKILL) right before call n, in a child process (``run_killed(n)``: how to start it,
        returning its wait status; by default a fork of this process); then checked, and the next save run."""
        self.reset()
        status = (run_killed or self._fork_killed)(n)
        where = f"kill {n} ({self.calls[n]})"
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            return [f"{where}: the save was not killed there (wait status {status})"]
        return self.check_killed(where)

    def _fork_killed(self, n):
        pid = os.fork()
        if pid == 0:  # the child: the save, killed before call n (faultkit sends the SIGKILL)
            try:
                with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                    with Faults(roots=[self.out], kill_at=n, also=_also()):
                        self.op(self.out)
            finally:
                os._exit(0)
        return _wait(pid)

    def check_killed(self, where):
        problems = []
        killed = snapshot(self.out)
        leftovers = M.find_leftovers(self.out)
        named = set()
        for left in leftovers:
            named |= set(left.moved_in) | set(left.missing) | set(left.aside)
        changed = {k for k in set(_plain(killed)) | set(_plain(self.before)) if killed.get(k) != self.before.get(k)}
        complete = _plain(killed) == _plain(self.expected)  # killed once the new save was all in place
        if changed - named and not complete:
            problems.append(f"{where}: the killed save changed files no leftover names: {sorted(changed - named)}")
        from patcher.checkpoint.check.verify import leftover_check

        check = leftover_check(self.out)
        if changed and not complete and (check is None or check.ok or not all(n in check.detail for n in changed)):
            problems.append(f"{where}: verify does not name what the killed save left in place: {check}")
        for name, entry in _plain(self.before).items():  # a user's byte is never lost
            homes = [killed.get(name)] + [killed.get(os.path.relpath(os.path.join(left.path, M._ASIDE, name), self.out))
                                          for left in leftovers]
            if entry not in homes and not complete:
                problems.append(f"{where}: the previous save's {name} is neither in place nor kept aside")
        exc, printed = self._run(contextlib.nullcontext())
        if _outcome(exc) != self.baseline:
            problems.append(f"{where}: the next save did not complete: {exc!r}")
        after = snapshot(self.out)
        if after != self.expected:
            problems.append(f"{where}: the next save left the folder other than a clean save: "
                            f"{_diff(self.expected, after)}")
        return problems


def _line(printed, word):
    return next((line for line in printed.splitlines() if word in line), None)


def _outcome(exc):
    return None if exc is None else (type(exc).__name__, str(exc))


def _wait(pid, timeout=120):
    """The child's wait status; a child still running after ``timeout`` seconds is killed and reported."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1
        time.sleep(0.002)


def _diff(a, b):
    gone = sorted(set(a) - set(b))
    new = sorted(set(b) - set(a))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return f"gone {gone[:6]}, new {new[:6]}, changed {changed[:6]}"
