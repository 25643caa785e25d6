"""A DeepSpeed universal checkpoint: what ``ds_to_universal`` writes from an engine checkpoint.

``python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/global_stepN --output_folder
CKPT/global_stepN_universal`` writes ``latest_universal`` (naming the folder) beside the output folder, and in it:

* ``zero/<name>/fp32.pt`` for every trained parameter: its whole fp32 master weight, the ranks' slices
  joined (with ``exp_avg.pt``, ``exp_avg_sq.pt`` and ``step.pt`` beside it, which dsfix does not read). From a
  ZeRO-3 checkpoint the file holds the bare flat tensor; from ZeRO-1/2 it holds ``{"param": tensor in its
  shape, "cat_dim": 0}``. ZeRO-1/2 adds folders for parameters no optimizer partition holds (frozen ones,
  the tied alias), made from the module's training-dtype weights;
* the engine's ``*_model_states.pt`` files, copied: names, shapes, frozen parameters (ZeRO-3: each rank's
  slices), buffers and the recorded tied parameters (``shared_params``).

:func:`stream` reads one parameter file at a time (memory-mapped, weights-only with the engine reader's
allow-list), in ``param_shapes`` order, then the frozen parameters and buffers from the model_states files
as the engine reader does. A tied alias is written from its recorded partner, never from its own folder.
Files recording tensor- or expert-parallel merges are refused (:mod:`patcher.checkpoint.refuse`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from patcher.checkpoint import refuse
from patcher.checkpoint.zero import MODEL3_RE, MODEL12, Layout, load_pt, numel, rank_files, stream_frozen
from patcher.errors import DsfixError

PARAMS = "zero"  # the folder of per-parameter folders
WEIGHT_FILE = "fp32.pt"


def is_universal(folder: Path) -> bool:
    """A universal checkpoint's step folder: per-parameter folders under ``zero/``, no optimizer files."""
    return (folder / PARAMS).is_dir() and not any(folder.glob("*_optim_states.pt"))


def layout_of(folder: Path, tag: str) -> Layout:
    refuse.files(folder)
    model3 = {int(m.group("rank")): p for p in folder.glob("zero_pp_rank_*_model_states.pt")
              if (m := MODEL3_RE.match(p.name)) is not None}
    if model3:
        model_files = rank_files(folder, model3, max(model3) + 1)
    elif (folder / MODEL12).is_file():
        model_files = (folder / MODEL12,)
    else:
        raise DsfixError(f"a universal checkpoint folder ({PARAMS}/) without {MODEL12} or "
                         "zero_pp_rank_R_mp_rank_00_model_states.pt: ds_to_universal copies them in", path=str(folder))
    return Layout(folder, tag, bool(model3), model_files, (), "", universal=True)


def stage_of(meta: dict) -> Optional[int]:
    """The ZeRO stage the checkpoint was trained with, as its saved config says (None when it does not)."""
    config = meta.get("ds_config") if isinstance(meta.get("ds_config"), dict) else {}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = zero.get("stage")
    return int(stage) if isinstance(stage, int) else None


def stream(layout: Layout, meta: dict, world: int, put) -> Optional[int]:
    """Hands every trained parameter's fp32 master to ``put(name, 0, flat data)``, one file at a time, then the
    frozen parameters and buffers. Returns the ZeRO stage its saved config names."""
    stage = stage_of(meta)
    if stage is not None and (stage == 3) != layout.stage3:
        raise DsfixError(f"the saved config says ZeRO stage {stage} but the model_states files are laid out for "
                         f"ZeRO-{'3' if layout.stage3 else '1/2'}", path=str(layout.model_files[0]))
    for group in meta["param_shapes"]:
        for name, shape in group.items():
            put(name, 0, _read_param(layout.folder, name, tuple(int(d) for d in shape)))
    for rank in range(world if layout.stage3 else 1):
        stream_frozen(meta, layout.model_files, layout.stage3, world, rank, put)
    return stage if stage is not None else (3 if layout.stage3 else None)


def _read_param(folder: Path, name: str, shape: tuple):
    """``zero/<name>/fp32.pt``'s tensor, flat, checked against the parameter's recorded shape."""
    import torch

    path = folder / PARAMS / name / WEIGHT_FILE
    if not path.is_file():
        raise DsfixError(f"no {PARAMS}/{name}/{WEIGHT_FILE}: the universal checkpoint lacks a trained parameter "
                         "(an interrupted ds_to_universal?)", path=str(folder))
    obj = load_pt(path, tensor_ok=True)
    refuse.universal_param(obj, name, path)
    tensor = obj if isinstance(obj, torch.Tensor) else obj.get("param")
    if not isinstance(tensor, torch.Tensor):
        raise DsfixError("holds no tensor under 'param'", path=str(path))
    if tensor.numel() != numel(shape) or (tensor.dim() > 1 and tuple(tensor.shape) != shape):
        raise DsfixError(f"holds a tensor of shape {list(tensor.shape)}, but {name} is {list(shape)} in the "
                         "model_states file: not this checkpoint's parameter", path=str(path))
    return tensor.reshape(-1)
