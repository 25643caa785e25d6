"""What the torch side needs, checked before anything expensive: nothing here imports torch.

``require`` looks the packages up with ``importlib.util.find_spec`` (no import: a few milliseconds) and ends
a missing one in one line naming what to install (exit 2). It imports nothing: each command checks its own
input next, and imports torch only then (``patcher.checkpoint.quiet``), so a bad argument answers at once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

from patcher.errors import DsfixError

SMOKE_EXTRA = ("torch", "transformers", "safetensors", "accelerate")
INSTALL_DEEPSPEED = "DS_BUILD_OPS=0 pip install deepspeed"
_NVIDIA = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd")  # kfd: ROCm


def install_line(names) -> str:
    """The pip command that installs ``names`` at the floors dsfix's [smoke] extra declares (read from dsfix's
    own installed metadata, so the pins live in pyproject.toml alone). dsfix is not on PyPI yet, so the line
    names the packages themselves, not ``dsfix[smoke]``."""
    from importlib import metadata

    try:
        declared = metadata.requires("dsfix") or ()
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        declared = ()
    floors = {}
    for req in declared:
        spec, _, marker = req.partition(";")
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", spec)
        if m and "smoke" in marker:
            floors[m.group(1).lower()] = m.group(2).strip()
    return "pip install " + " ".join(f"'{n}{floors[n]}'" if floors.get(n) else n for n in names)


def missing(*modules: str) -> list:
    """The top-level packages of ``modules`` that cannot be found."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def no_gpu_driver() -> bool:
    """True when this machine plainly has no GPU driver (Linux: no NVIDIA or ROCm device node); elsewhere
    False, and torch decides."""
    return sys.platform.startswith("linux") and not any(os.path.exists(p) for p in _NVIDIA)


def require(verb: str, *, deepspeed: str | None = None, cuda: bool = False) -> None:
    """Raise DsfixError (exit 2) naming what to install when ``verb`` cannot run here. Imports nothing.

    ``deepspeed``: why DeepSpeed is needed (e.g. "--zero-stage 3"), or None when it is not.
    ``cuda``: --device cuda was asked for."""
    gone = missing(*SMOKE_EXTRA)
    if gone:
        raise DsfixError(f"dsfix {verb} needs {', '.join(gone)}, which this Python lacks: {install_line(gone)} "
                         "(dsfix's [smoke] extra)", detail=[f"this Python: {sys.executable}"])
    if deepspeed and missing("deepspeed"):
        drop = f" (or leave out {deepspeed})" if deepspeed.startswith("--") else ""
        raise DsfixError(f"{deepspeed} needs DeepSpeed, which this Python lacks: {INSTALL_DEEPSPEED}{drop}")
    if cuda and no_gpu_driver():
        raise DsfixError("--device cuda, but this machine has no GPU driver; use --device cpu")


PEFT_FLOOR = "peft>=0.13"  # set_peft_model_state_dict(low_cpu_mem_usage=...), what the adapter checks run


def require_peft(what: str) -> None:
    """Raise DsfixError (exit 2) when PEFT, which ``what`` (a PEFT adapter's checks, a merge) needs, is missing."""
    if missing("peft"):
        raise DsfixError(f"{what} needs PEFT, which this Python lacks: pip install '{PEFT_FLOOR}'")


def require_or_exit(verb: str, **kwargs) -> None:
    """For the benchmark scripts: ``require``, ending in its one line and exit 2 instead of a traceback; then
    torch is imported, with the noise of torch before 2.3 beside numpy 2 captured."""
    try:
        require(verb, **kwargs)
    except DsfixError as e:
        sys.stderr.write(f"{verb}: error: {e}\n")
        raise SystemExit(e.code) from None
    from patcher.checkpoint.quiet import import_torch_quietly

    import_torch_quietly()
