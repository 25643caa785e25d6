"""What every DeepSpeed rank that dsfix starts on a CPU needs: the same setup for ``dsfix smoke``, the
tests' step-1 trainer and the ZeRO-3 benchmark.

- :func:`rank_env` (launcher side): DeepSpeed's CPU accelerator, no CUDA, and gloo on the loopback
  interface. All ranks run on one machine, so gloo need not resolve the host name, which a sandbox or a
  container may not map to a usable address.
- :func:`skip_shm_allreduce` (rank side, before ``deepspeed.init_distributed``): DeepSpeed's CPU backend
  otherwise compiles a C++ shared-memory all-reduce the first time a process group starts. That takes a
  compiler and about 40 s on a fresh machine, waits forever on the build's lock file if an earlier run was
  killed while compiling, and under the ``deepspeed`` launcher maps a 66 MiB buffer per rank in
  /dev/shm that outlives the run. Only DeepSpeed's inference all-reduce uses it; training and saving
  never do, so the ranks lose nothing by using gloo alone.

No torch here: :mod:`patcher.smoke` imports this on the command line's path.
"""

from __future__ import annotations

import os
import sys

SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's name for the op (ShareMemCommBuilder.NAME)


def rank_env(base: dict | None = None, *, threads: int | None = None) -> dict:
    """A copy of ``base`` (default: this process's environment) for CPU ranks."""
    env = dict(os.environ if base is None else base)
    env["DS_ACCELERATOR"] = "cpu"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
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
