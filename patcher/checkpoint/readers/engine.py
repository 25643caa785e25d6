"""What the readers of DeepSpeed's engine checkpoints share: the model_states file, the ranks, the precision.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/global_stepN/``, whose model_states
file records every parameter's name and shape (``param_shapes``, one dict per optimizer group), the frozen
parameters (``frozen_param_shapes``, their data in ``frozen_param_fragments``), the buffers (``buffer_names``,
their data in ``module``) and the tied aliases (``shared_params``: ``{"lm_head.weight":
"model.embed_tokens.weight"}``); the trained parameters' fp32 master weights are in one optimizer file a rank,
laid out as its ZeRO stage does (:mod:`.zero12`, :mod:`.zero3`), or, after ``ds_to_universal``, in one file a
parameter (:mod:`.universal`). :class:`EngineReader` opens rank 0's files, refuses what dsfix has not proven
(:mod:`.refuse`), lists the tensors (trained ones as fp32 masters, frozen ones and buffers as trained) and
streams them: a layout supplies where each element of a rank's files belongs.
"""

from __future__ import annotations

import math
import re
from contextlib import closing
from pathlib import Path
from typing import Any, ClassVar, Optional

import patcher.checkpoint.readers.refuse as refuse
from patcher.checkpoint.readers.base import Held, Put, Reader, numel
from patcher.checkpoint.readers.flat import pieces_read
from patcher.checkpoint.readers.load import load_deepspeed
from patcher.errors import DsfixError

OPTIM_RE = re.compile(r"^(?:(?P<prec>bf16|fp16|fp32)_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)"
                      r"_optim_states\.pt$")
MODEL3_RE = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
MODEL12 = "mp_rank_00_model_states.pt"
TRAIN_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def model3_files(folder: Path) -> dict:
    """rank -> ZeRO-3's per-rank model_states file."""
    return {int(m.group("rank")): p for p in folder.glob("zero_pp_rank_*_model_states.pt")
            if (m := MODEL3_RE.match(p.name)) is not None}


def rank_files(folder: Path, model3: dict, world: int) -> tuple:
    """ZeRO-3's model_states files in rank order; every rank's is needed."""
    gone = [r for r in range(world) if r not in model3]
    if gone:
        raise DsfixError(f"rank {gone[0]}'s file zero_pp_rank_{gone[0]}_mp_rank_00_model_states.pt is missing; "
                         "every rank's file is needed", path=str(folder))
    return tuple(model3[r] for r in range(world))


def optim_name(prefix: str, rank: int) -> str:
    return f"{prefix + '_' if prefix else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def check_ranks(folder: Path, prefix: str, present, world: int) -> None:
    missing = [r for r in range(world) if r not in present]
    if missing:
        raise DsfixError(f"rank {missing[0]}'s file {optim_name(prefix, missing[0])} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + f"; all {world} ranks' files are needed", path=str(folder))


def training_precision(ds_config: Any) -> Optional[str]:
    """"bf16", "fp16" or "fp32": what the saved DeepSpeed config (model_states' ``ds_config``) trained in; None
    when there is no config to tell (DeepSpeed accepts ``bf16`` or ``bfloat16`` for the bf16 section)."""
    if not isinstance(ds_config, dict):
        return None
    found = None
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = ds_config.get(key)
        enabled = section.get("enabled", False) if isinstance(section, dict) else False
        if enabled not in (True, False):  # "auto" left unresolved: the config does not say
            return None
        if enabled is True:
            found = found or name
    return found or "fp32"


def step_files(folder: Path, stage3: bool) -> tuple[tuple, tuple, str]:
    """An engine checkpoint's step folder, from its file names: (model_states files in rank order, optimizer files
    in rank order, the optimizer files' prefix: "bf16", or "" for fp16 and fp32 runs alike)."""
    optim, precisions = {}, set()
    for p in folder.glob("*_optim_states.pt"):
        m = OPTIM_RE.match(p.name)
        if m is not None:
            optim[int(m.group("rank"))] = p
            precisions.add(m.group("prec") or "")
    if not optim:
        raise DsfixError("no *_optim_states.pt: the fp32 master weights of a ZeRO checkpoint are in them "
                         "(a checkpoint saved without ZeRO, or its optimizer files were removed)", path=str(folder))
    if len(precisions) > 1:
        found = ", ".join(sorted(p or "no prefix" for p in precisions))
        raise DsfixError(f"optimizer files of several precisions ({found}): two saves in one folder?", path=str(folder))
    prefix = precisions.pop()
    world = max(optim) + 1
    check_ranks(folder, prefix, optim, world)
    model = rank_files(folder, model3_files(folder), world) if stage3 else (folder / MODEL12,)
    return model, tuple(optim[r] for r in range(world)), prefix


def precision_of(prefix: str, ds_config: Any) -> str:
    """The optimizer states' precision as the run trained: the ``bf16_`` prefix says bf16; files without one are
    written by fp16 and fp32 runs alike, so the saved ``ds_config`` decides ("fp16 or fp32" without one)."""
    if prefix in ("bf16", "fp16", "fp32"):
        return prefix
    return training_precision(ds_config) or "fp16 or fp32"


class EngineReader(Reader):
    """A step folder of an engine checkpoint (``global_stepN``): one subclass a ZeRO layout."""

    masters = True
    stage3: bool = False  # one model_states file a rank

    def __init__(self, folder: Path, tag: str = "") -> None:
        super().__init__(folder)
        self.tag = tag or self.folder.name
        self.model_files, self.optim_files, self.prefix = self.files(self.folder)
        self.meta = load_deepspeed(self.model_files[0])
        for key in ("param_shapes", "shared_params"):
            if key not in self.meta:
                raise DsfixError(f"no {key}: not a model_states file of a ZeRO checkpoint",
                                 path=str(self.model_files[0]))
        refuse.model_states(self.meta, self.model_files[0])
        self.stage = self._first_stage()
        self.world = self._world()
        self._list_tensors()

    # ------------------------------------------------------------------ opening

    @classmethod
    def files(cls, folder: Path) -> tuple[tuple, tuple, str]:
        """(model_states files, optimizer files, their prefix), from file names (no torch)."""
        return step_files(folder, cls.stage3)

    def _first_stage(self) -> Optional[int]:
        """Rank 0's optimizer states, refused when not Adam's; the ZeRO stage they record."""
        osd = load_deepspeed(self.optim_files[0]).get("optimizer_state_dict")
        refuse.optimizer_states(osd, self.optim_files[0])
        return self._stage_of(osd, self.optim_files[0], None)

    def _world(self) -> int:
        """The data-parallel world size the model_states record, checked against the optimizer files."""
        world = int(self.meta.get("dp_world_size") or len(self.optim_files))
        check_ranks(self.folder, self.prefix, range(len(self.optim_files)), world)
        if world != len(self.optim_files):
            raise DsfixError(f"dp_world_size is {world} but there are {len(self.optim_files)} optimizer files: "
                             "files left from another save?", path=str(self.folder))
        return world

    def _list_tensors(self) -> None:
        """Trained parameters (fp32 masters), frozen ones and buffers (as trained), the recorded aliases."""
        import torch

        meta = self.meta
        train = getattr(torch, TRAIN_DTYPES.get(self.precision, "float32"))
        for group in meta["param_shapes"]:
            for name, shape in group.items():
                self.tensors[name] = Held(name, tuple(int(d) for d in shape), torch.float32)
        fragments = meta.get("frozen_param_fragments") or {}
        for name, shape in (meta.get("frozen_param_shapes") or {}).items():
            dtype = fragments[name].dtype if name in fragments else train
            self.tensors[name] = Held(name, tuple(int(d) for d in shape), dtype)
        module = meta.get("module") or {}
        for name in meta.get("buffer_names") or []:
            if name in module:
                self.tensors[name] = Held(name, tuple(module[name].shape), module[name].dtype)
        self.aliases = dict(meta.get("shared_params") or {})

    def _stage_of(self, osd: Any, path: Path, stage: Optional[int]) -> int:
        """This file's ZeRO stage, checked against the layout's and rank 0's."""
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise DsfixError("no optimizer_state_dict with zero_stage: not a ZeRO optimizer file", path=str(path))
        this = int(osd["zero_stage"])
        if stage is None and (this == 3) != self.stage3:
            raise DsfixError(f"zero_stage {this} but the model_states files are laid out for "
                             f"ZeRO-{'3' if self.stage3 else '1/2'}", path=str(path))
        if stage is not None and this != stage:
            raise DsfixError(f"zero_stage {this}, but rank 0's file says {stage}: files of two saves?", path=str(path))
        return this

    # ------------------------------------------------------------------ what it is

    @property
    def precision(self) -> str:
        return precision_of(self.prefix, self.meta.get("ds_config"))

    @property
    def name(self) -> str:
        return self.tag

    def counts(self) -> str:
        meta = self.meta
        return (f"{sum(len(g) for g in meta['param_shapes'])} trained + {len(meta.get('frozen_param_shapes') or {})} "
                f"frozen parameters, {len(meta.get('buffer_names') or [])} buffers, "
                f"{len(meta.get('shared_params') or {})} shared; read weights-only")

    def describe(self) -> str:
        what = f"ZeRO-{self.stage}, {self.world} rank(s), {self.precision} optimizer states"
        return f"{self.tag}: {what}, DeepSpeed {self.meta.get('ds_version', '?')}; {self.counts()}"

    # ------------------------------------------------------------------ streaming

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        """Each rank's optimizer file, one at a time: its flat partitions, piece by piece, then its share of the
        frozen parameters and, on rank 0, the buffers."""
        import torch

        threads = torch.get_num_threads()
        # One thread: each piece is cast on its own, and with more threads every cast is a parallel region whose
        # threads wait for each other, and on a busy machine for the scheduler (0.6B on 64 ranks, 2 shared
        # cores: 58 s and 23 s of CPU with 2 threads, 17 s and 6 s with 1).
        torch.set_num_threads(1)
        try:
            self._stream_ranks(put)
        finally:
            torch.set_num_threads(threads)

    def _stream_ranks(self, put: Put) -> None:
        pieces, sizes0 = None, None
        for rank, path in enumerate(self.optim_files):
            osd = load_deepspeed(path).get("optimizer_state_dict")
            self._stage_of(osd, path, self.stage)
            refuse.optimizer_states(osd, path)
            flat = self._flat_groups(osd, path)
            sizes = [t.numel() for t in flat]
            if pieces is None:
                pieces, sizes0 = self._pieces(sizes, osd, path), sizes
            elif sizes != sizes0:
                raise DsfixError(f"its flat partitions hold {sizes} elements, rank 0's {sizes0}: files of two saves?",
                                 path=str(path))
            with closing(pieces_read(path, flat, [p for p in pieces if p.rank == rank])) as parts:
                for p, at, data in parts:
                    put(p.name, p.dst + at, data)
            del osd, flat
            self.stream_frozen(rank, put)

    def _flat_groups(self, osd: dict, path: Path) -> list:
        """The rank's flat fp32 partitions, one 1-D tensor a parameter group."""
        import torch

        counts = osd.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(int(c) != self.world for c in counts if c is not None):
            raise DsfixError(f"partition_count {counts} but {self.world} ranks saved this checkpoint", path=str(path))
        key = self.flat_key
        flat = osd.get(key)
        if not isinstance(flat, list) or not all(isinstance(t, torch.Tensor) for t in flat):
            raise DsfixError(f"no {key}: the fp32 master weights are not in this file", path=str(path))
        return [t.reshape(-1) for t in flat]

    flat_key: ClassVar[str] = ""

    def _pieces(self, sizes: list, osd: dict, path: Path) -> list:
        """Where each element of a rank's flat groups belongs: pieces, rank by rank (the layout's map)."""
        raise NotImplementedError

    def stream_frozen(self, rank: int, put: Put) -> None:
        """Rank ``rank``'s share of the frozen parameters (:meth:`frozen`) and, on rank 0, the buffers."""
        self.frozen(rank, put)
        if rank == 0:
            module = self.meta.get("module") or {}
            for name in self.meta.get("buffer_names") or []:
                if name in module:
                    put(name, 0, module[name].reshape(-1))

    def frozen(self, rank: int, put: Put) -> None:
        """The layout's way of keeping frozen parameters: whole on rank 0, or a slice a rank."""
        raise NotImplementedError

    def frozen_whole(self, rank: int, put: Put) -> None:
        """ZeRO-1/2: every frozen parameter whole, from rank 0's model_states file."""
        if rank != 0:
            return
        frags = self.meta.get("frozen_param_fragments") or {}
        for name in self.meta.get("frozen_param_shapes") or {}:
            if name not in frags:
                raise DsfixError(f"no frozen_param_fragments entry for {name}", path=str(self.model_files[0]))
            put(name, 0, frags[name].reshape(-1))

    def frozen_slices(self, rank: int, put: Put) -> None:
        """ZeRO-3: rank ``rank``'s slice of each frozen parameter, from its own model_states file."""
        shapes = self.meta.get("frozen_param_shapes") or {}
        if not shapes:
            return
        frags = (self.meta if rank == 0 else load_deepspeed(self.model_files[rank])).get("frozen_param_fragments") or {}
        for name, shape in shapes.items():
            if name not in frags:
                raise DsfixError(f"no fragment of frozen {name}", path=str(self.model_files[rank]))
            part = math.ceil(numel(shape) / self.world)
            count = min(part, numel(shape) - rank * part)
            if count > 0:
                put(name, rank * part, frags[name].reshape(-1).narrow(0, 0, count))
