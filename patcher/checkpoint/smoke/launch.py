"""Starting smoke's ranks: ``python -m torch.distributed.run`` with :mod:`.worker`, their log, their phases.

On a CPU the ranks get DeepSpeed's CPU accelerator and gloo on the loopback (:func:`.ranks.rank_env`). The
launch runs in a process group of its own, killed whole on a timeout or an interruption; rank 0 writes its
phase to a file that is read twice a second for the progress line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from patcher.checkpoint.smoke.ranks import free_port, rank_env

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder that holds patcher/, for the ranks


def worker_env(device: str, nproc: int) -> dict:
    env = rank_env(nproc=nproc) if device == "cpu" else dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(_PACKAGE_ROOT)] + paths)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def launcher_command(nproc: int, spec_path, port: int | str = "PORT") -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node_rank", "0",
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--nproc_per_node", str(nproc), "-m", "patcher.checkpoint.smoke.worker", str(spec_path)]


def launch(spec: dict, nproc: int, timeout: float, on_phase) -> tuple[list, str, int]:
    """Run the ranks; (their results, the log tail, exit code)."""
    work = Path(spec["work_dir"])
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
    log_path = work / "ranks.log"
    port = free_port()
    cmd = launcher_command(nproc, spec_path, port)
    phase_file = work / "phase-0.txt"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=worker_env(spec["device"], nproc), cwd=str(work), start_new_session=True)
        deadline = time.monotonic() + timeout
        seen = None
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                try:
                    now = phase_file.read_text()
                except OSError:
                    now = None
                if now and now != seen:
                    seen = now
                    on_phase(now)
                time.sleep(0.2)
        except BaseException:
            with _quiet():
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    results = []
    for r in range(nproc):
        p = work / f"result-{r}.json"
        if p.is_file():
            results.append(json.loads(p.read_text(encoding="utf-8")))
    tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-30:])
    return results, tail, proc.returncode


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


class capture_stdout:
    """fd 1 -> a file while the in-process rank runs: what libraries print there (DeepSpeed's logger, which
    binds sys.stdout on import, telling that it set the accelerator to CPU) reaches neither stdout, the
    CLI's machine channel, nor the user's screen; its last lines are shown only when the smoke fails."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        sys.stdout.flush()
        self._file = open(self.path, "w+", encoding="utf-8", errors="replace")
        self._saved: Optional[int] = None
        try:
            self._saved = os.dup(1)
            os.dup2(self._file.fileno(), 1)
        except OSError:
            self._saved = None
        # Loggers created meanwhile bind to the file too.
        self._redirect = contextlib.redirect_stdout(self._file)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)
        sys.stdout.flush()
        self._file.flush()
        if self._saved is not None:
            os.dup2(self._saved, 1)
            os.close(self._saved)
        self._file.close()
        return False

    def tail(self, n: int = 30) -> str:
        return tail(self.path, n)


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return ""
