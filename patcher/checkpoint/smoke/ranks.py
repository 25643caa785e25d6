"""Starting DeepSpeed ranks on one machine, the same way for ``dsfix smoke``, the tests' step-1 trainer
and the ZeRO-3 benchmark.

- :func:`free_port`, :func:`deepspeed_launcher` and :func:`run_group` (launcher side): a port for the
  rendezvous, the ``deepspeed`` launcher of this Python, and a run in a process group of its own that is
  killed whole on a timeout or an interruption, so that no rank outlives it.
- :func:`rank_env` (launcher side, CPU): DeepSpeed's CPU accelerator told the number of ranks (so no
  ``numactl`` is needed), no CUDA, and gloo on the loopback interface. All ranks run on one machine, so
  gloo need not resolve the host name, which a sandbox or a container may not map to a usable address.
- :func:`skip_shm_allreduce` (rank side, before ``deepspeed.init_distributed``): DeepSpeed's CPU backend
  otherwise compiles a C++ shared-memory all-reduce the first time a process group starts. That takes a
  compiler and about 40 s on a fresh machine, waits forever on the build's lock file if an earlier run was
  killed while compiling, and under the ``deepspeed`` launcher maps a 66 MiB buffer per rank in
  /dev/shm that outlives the run. Only DeepSpeed's inference all-reduce uses it; training and saving
  never do, so the ranks lose nothing by using gloo alone.
- :func:`end_ranks` (rank side, last): the process groups torn down so that no gloo thread is left to abort the
  rank in the interpreter's exit.

No torch here: :mod:`patcher.checkpoint.smoke.run` imports this on the command line's path.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's name for the op (ShareMemCommBuilder.NAME)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_launcher() -> str | None:
    """The ``deepspeed`` launcher beside this Python (its virtual environment's), else on PATH, else None."""
    return shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")


def run_group(cmd: list, env: dict, timeout: float, cwd=None) -> tuple:
    """Runs ``cmd`` (a launcher and the ranks it starts) in a process group of its own: (exit code, output),
    the exit code None when it ran past ``timeout`` seconds. The group is killed then, or when this process
    is interrupted while waiting."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rank_env(base: dict | None = None, nproc: int | None = None) -> dict:
    """A copy of ``base`` (default: this process's environment) for ``nproc`` CPU ranks.

    LOCAL_SIZE is the number of ranks on this machine, which DeepSpeed's CPU accelerator reports as its
    device count. Without it the accelerator counts NUMA nodes with ``numactl --hardware``, and DeepSpeed
    before 0.16 fails in its launcher where numactl is not installed."""
    env = dict(os.environ if base is None else base)
    env["DS_ACCELERATOR"] = "cpu"
    if nproc is not None:
        env["LOCAL_SIZE"] = str(nproc)
    env["CUDA_VISIBLE_DEVICES"] = ""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def skip_shm_allreduce() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op as unavailable in this process, so that its CPU backend
    neither builds nor maps it (see the module comment). Call it before ``deepspeed.init_distributed``."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible[SHM_OP] = False


_KEPT: list = []  # the Work of each rank's last barriers, held to the process's end (end_ranks)


def end_ranks() -> None:
    """The last call of every rank once all its work is done (never after a failure, which may leave the other
    ranks inside a collective): a barrier on each process group this rank belongs to, then
    ``destroy_process_group()``.

    A gloo world left to the interpreter's exit can abort the rank after all its work ("terminate called without
    an active exception", exit -6): the gloo worker thread that drops the last reference to a finished collective
    releases its tensors' Python objects, which takes the GIL, and a thread that waits for the GIL while Python
    finalizes is ended by ``pthread_exit``, whose unwinding meets a noexcept destructor. ``destroy_process_group()``
    alone does not stop gloo's threads while anything (DeepSpeed's parameters, engine, optimizer) still holds the
    process group, nor does a plain barrier help: a gloo barrier keeps (weakly) the works still running or queued
    when it starts and waits for them, which puts off their destruction to its own, by a worker thread. Its Work,
    held here to the process's end, is their last holder instead: this thread releases them, never a worker."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d

    names = getattr(getattr(distributed_c10d, "_world", None), "pg_names", None) or {None: ""}
    groups = sorted(names, key=lambda group: str(names[group]))  # the same order on every rank
    works = [dist.barrier(group=group, async_op=True) for group in groups]
    _KEPT.extend(works)
    for work in works:
        work.wait()
    dist.destroy_process_group()
