"""The one way the torch side opens a ``torch.save`` file: weights-only, memory-mapped, nothing of it run.

``torch.load(weights_only=True)`` builds tensors, containers and a few plain types, and refuses any other global
a pickle names, so no code of the file runs. DeepSpeed's checkpoint files also pickle a few of DeepSpeed's own
types (:data:`ALLOWED`): each is bound to a plain stand-in class here, so DeepSpeed need not be installed and
none of its code runs on load. A zip-format file (``torch.save``'s default since torch 1.6) is memory-mapped:
a tensor's data is read from the disk when it is used, not when the file is opened.

:func:`load_state_dict` reads a model's weights (``pytorch_model.bin`` and its shards); :func:`load_deepspeed` a
DeepSpeed checkpoint file (model states, optimizer states, a universal checkpoint's parameter file). Both
raise :class:`patcher.errors.DsfixError` (exit 2) in one line naming the file.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from patcher.checkpoint.names import examples
from patcher.errors import DsfixError


class LossScalerRecord:
    """Stands in for deepspeed.runtime.fp16.loss_scaler.LossScaler: its attributes, no behaviour."""


class DynamicLossScalerRecord:
    """Stands in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (fp16 training)."""


class FragmentAddress:
    """Stands in for deepspeed.utils.tensor_fragment.fragment_address (ZeRO-1/2's param_slice_mappings)."""


def zero_stage_enum(value: object) -> int:
    """Stands in for deepspeed.runtime.zero.config.ZeroStageEnum(value): the stage as an int."""
    if type(value) is not int or not 0 <= value <= 3:
        raise ValueError(f"not a ZeRO stage: {value!r}")
    return value


# The non-torch globals DeepSpeed's checkpoint files pickle (torch's own tensors, storages, dtypes, Size and
# OrderedDict are allowed by weights_only already). Found by listing the GLOBAL opcodes of real ZeRO-2 and
# ZeRO-3 files (bf16 and fp16); nothing else is admitted.
ALLOWED = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerRecord,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScalerRecord,
    "deepspeed.runtime.zero.config.ZeroStageEnum": zero_stage_enum,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}


def load_state_dict(path: Path) -> tuple[dict, bool]:
    """(state dict, memory-mapped?) of a model's ``torch.save`` file: string keys, strided tensors."""
    import torch

    mapped = zipfile.is_zipfile(path)  # mmap needs the zip format; an older pickle is read whole
    obj = _load(path, mapped, deepspeed=False)
    if not isinstance(obj, dict):
        raise DsfixError(f"holds an object of type {type(obj).__name__}, not a state dict of tensors", path=str(path))
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        k = bad[0]
        hint = " (a training checkpoint? convert wants the saved model's weights)" if isinstance(obj[k], dict) else ""
        raise DsfixError(f"not a state dict of tensors: {k!r} holds an object of type {type(obj[k]).__name__}{hint}",
                         path=str(path))
    sparse = [k for k, v in obj.items() if v.layout != torch.strided]
    if sparse:
        raise DsfixError(f"sparse tensors cannot be saved as safetensors: {examples(sparse)}", path=str(path))
    return obj, mapped


def load_deepspeed(path: Path, tensor_ok: bool = False) -> Any:
    """A DeepSpeed ``.pt`` file, with :data:`ALLOWED`: a dict (or, with ``tensor_ok``, a bare tensor, as a
    universal checkpoint's ZeRO-3 parameter file)."""
    from patcher.checkpoint.quiet import import_torch_quietly

    import_torch_quietly()  # the first torch import of an engine convert, after its input was checked
    import torch

    if not path.is_file():
        raise DsfixError("is missing", path=str(path))
    if not zipfile.is_zipfile(path):
        raise DsfixError("is truncated or not a torch.save file (no zip directory at its end); nothing written",
                         path=str(path))
    obj = _load(path, True, deepspeed=True)
    if not isinstance(obj, dict) and not (tensor_ok and isinstance(obj, torch.Tensor)):
        raise DsfixError(f"holds a {type(obj).__name__}, not a DeepSpeed checkpoint's dict", path=str(path))
    return obj


def _load(path: Path, mapped: bool, deepspeed: bool) -> Any:
    """``torch.load`` weights-only on the CPU; a refused global or an unreadable file as one line."""
    import torch

    try:
        with _allowed_globals() if deepspeed else _nothing():
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as e:  # a global weights_only does not admit: the one refusal
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"function (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise DsfixError(f"refused: this pickle needs code to load{what}; nothing run, nothing written",
                         path=str(path)) from None
    except (DsfixError, MemoryError):
        raise
    except Exception as e:
        msg = " ".join(str(e).split())
        said = msg.split(". ")[0]  # torch's first sentence (what went wrong, not its advice), or its first clause
        said = said if len(said) <= 60 else said.split(": ")[0][:60]
        raise DsfixError(f"not a readable torch.save file (truncated?): {type(e).__name__}: {said}; nothing written",
                         path=str(path)) from e


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _torch_version() -> tuple:
    import torch

    return tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])


@contextmanager
def _allowed_globals() -> Iterator[None]:
    """The allow-list, for one load. torch 2.6+ binds each name to a stand-in; torch 2.4-2.5 only admits a
    class under its own name, so there DeepSpeed's classes are imported (never called: weights_only only
    creates an object and sets its attributes); older torch cannot admit any, and is refused."""
    import torch

    ser = torch.serialization
    if not hasattr(ser, "add_safe_globals"):
        raise DsfixError(f"reading DeepSpeed optimizer files without running code needs torch >= 2.4 "
                         f"(weights_only allow-lists); this is torch {torch.__version__}")
    entries: list
    if _torch_version() >= (2, 6):
        entries = [(obj, name) for name, obj in ALLOWED.items()]
    else:
        try:
            from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
            from deepspeed.runtime.zero.config import ZeroStageEnum
            from deepspeed.utils.tensor_fragment import fragment_address
        except ImportError as e:
            raise DsfixError(f"with torch {torch.__version__} reading DeepSpeed optimizer files needs deepspeed "
                             f"importable ({e}); torch >= 2.6 needs no deepspeed") from e
        entries = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    if hasattr(ser, "safe_globals"):
        with ser.safe_globals(entries):
            yield
    else:  # torch 2.4: process-wide, which is all a CLI run needs
        ser.add_safe_globals(entries)
        yield
