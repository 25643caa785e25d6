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

:class:`UniversalReader` reads one parameter file at a time (memory-mapped, weights-only), in ``param_shapes``
order, then the frozen parameters and buffers from the model_states files as the engine readers do. A tied
alias is written from its recorded partner, never from its own folder. Files recording tensor- or
expert-parallel merges are refused (:mod:`.refuse`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import patcher.checkpoint.readers.refuse as refuse
from patcher.checkpoint.readers.base import Put, numel
from patcher.checkpoint.readers.engine import MODEL12, EngineReader, model3_files, rank_files, training_precision
from patcher.checkpoint.readers.load import load_deepspeed
from patcher.errors import DsfixError

PARAMS = "zero"  # the folder of per-parameter folders
WEIGHT_FILE = "fp32.pt"


def stage_of(meta: dict) -> Optional[int]:
    """The ZeRO stage the checkpoint was trained with, as its saved config says (None when it does not)."""
    stage = refuse.section(refuse.section(meta, "ds_config"), "zero_optimization").get("stage")
    return int(stage) if isinstance(stage, int) else None


class UniversalReader(EngineReader):
    kind = "universal"

    @classmethod
    def is_kind(cls, folder: Path) -> bool:
        return (folder / PARAMS).is_dir() and not any(folder.glob("*_optim_states.pt"))

    def __init__(self, folder: Path, tag: str = "") -> None:
        self.stage3 = bool(model3_files(Path(folder)))  # a universal checkpoint of a ZeRO-3 run keeps its files
        super().__init__(folder, tag)

    @classmethod
    def files(cls, folder: Path) -> tuple[tuple, tuple, str]:
        model3 = model3_files(folder)
        if model3:
            return rank_files(folder, model3, max(model3) + 1), (), ""
        if (folder / MODEL12).is_file():
            return (folder / MODEL12,), (), ""
        raise DsfixError(f"a universal checkpoint folder ({PARAMS}/) without {MODEL12} or "
                         "zero_pp_rank_R_mp_rank_00_model_states.pt: ds_to_universal copies them in", path=str(folder))

    def _first_stage(self) -> Optional[int]:
        stage = stage_of(self.meta)
        if stage is not None and (stage == 3) != self.stage3:
            raise DsfixError(f"the saved config says ZeRO stage {stage} but the model_states files are laid out for "
                             f"ZeRO-{'3' if self.stage3 else '1/2'}", path=str(self.model_files[0]))
        return stage if stage is not None else (3 if self.stage3 else None)

    def _world(self) -> int:
        world = int(self.meta.get("dp_world_size") or len(self.model_files))
        if self.stage3 and world != len(self.model_files):
            raise DsfixError(f"dp_world_size is {world} but there are {len(self.model_files)} model_states files: "
                             "files left from another save?", path=str(self.folder))
        return world

    @property
    def precision(self) -> str:
        return training_precision(self.meta.get("ds_config")) or "unknown"

    def describe(self) -> str:
        stage = "ZeRO-3" if self.stage3 else "ZeRO-1/2" if self.stage is None else f"ZeRO-{self.stage}"
        return (f"{self.tag}: universal checkpoint of a {stage} run on {self.world} rank(s), one fp32 file a trained "
                f"parameter, DeepSpeed {self.meta.get('ds_version', '?')}; {self.counts()}")

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        """Every trained parameter's fp32 master, one file at a time, then the frozen parameters and buffers."""
        for group in self.meta["param_shapes"]:
            for name, shape in group.items():
                put(name, 0, self._read_param(name, tuple(int(d) for d in shape)))
        for rank in range(self.world if self.stage3 else 1):
            self.stream_frozen(rank, put)

    def frozen(self, rank: int, put: Put) -> None:
        if self.stage3:
            self.frozen_slices(rank, put)
        else:
            self.frozen_whole(rank, put)

    def _read_param(self, name: str, shape: tuple) -> Any:
        """``zero/<name>/fp32.pt``'s tensor, flat, checked against the parameter's recorded shape."""
        import torch

        path = self.folder / PARAMS / name / WEIGHT_FILE
        if not path.is_file():
            raise DsfixError(f"no {PARAMS}/{name}/{WEIGHT_FILE}: the universal checkpoint lacks a trained parameter "
                             "(an interrupted ds_to_universal?)", path=str(self.folder))
        obj = load_deepspeed(path, tensor_ok=True)
        refuse.universal_param(obj, name, path)
        tensor = obj if isinstance(obj, torch.Tensor) else obj.get("param")
        if not isinstance(tensor, torch.Tensor):
            raise DsfixError("holds no tensor under 'param'", path=str(path))
        if tensor.numel() != numel(shape) or (tensor.dim() > 1 and tuple(tensor.shape) != shape):
            raise DsfixError(f"holds a tensor of shape {list(tensor.shape)}, but {name} is {list(shape)} in the "
                             "model_states file: not this checkpoint's parameter", path=str(path))
        return tensor.reshape(-1)
