"""``dsfix convert CKPT --config MODEL --output OUT``: a DeepSpeed engine checkpoint to a verified Hugging Face folder.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/global_stepN/``:

* ZeRO-1/2: ``mp_rank_00_model_states.pt`` (names, shapes, frozen parameters whole, buffers) and one
  ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank. Each parameter group's fp32
  master weights are flattened in ``param_shapes`` order (``param_alignment_paddings`` after each
  parameter, where recorded) and cut into equal partitions, rank R holding the R-th
  (``single_partition_of_fp32_groups``); a parameter may straddle two ranks.
* ZeRO-3: one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank and the same optimizer files. Every
  parameter is cut on its own into ``ceil(numel / world)`` elements a rank (the last padded), and rank R's
  slices of all parameters lie one after another in its ``fp32_flat_groups`` (groups concatenated). Frozen
  parameters are cut the same way into each rank's ``frozen_param_fragments``.

The reader maps each rank's flat partition to (parameter, offset) pieces (:func:`zero12_pieces`,
:func:`zero3_pieces`), then streams: one rank's optimizer file at a time (memory-mapped), each piece cast to
the output dtype and written at its place in the output files, whose headers (names, shapes, dtypes,
offsets) are laid out first by the inserted save's own layout function. Memory is one rank's partition plus
one piece, never the whole model. A tied alias recorded in ``shared_params`` is written from the same
pieces (``clone``) or left out (``dedupe``). Every element of every tensor is accounted for before the
folder is verified (``dsfix verify``'s checks, and a ``from_pretrained`` load in the files' dtype) and
renamed into place; a failure leaves nothing behind.

Every ``.pt`` is read with ``torch.load(weights_only=True)`` and an allow-list of the few non-torch types
DeepSpeed pickles (:data:`ALLOWED`), each bound to a plain stand-in class here, so no DeepSpeed or other
code runs on load and DeepSpeed need not be installed. Anything else is refused, naming the type.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

from patcher.checkpoint.checks import (
    CONFIG_NAME, INDEX_NAME, Check, Header, examples, keys_check, load_config, nonempty_check, shapes_check,
)
from patcher.checkpoint.convert import ConvertStatus
from patcher.checkpoint.files import fsync
from patcher.checkpoint.verify import Checks, expected_of, load_check, meta_model, verify_folder
from patcher.errors import DsfixError, Written
from patcher.report import Result

LATEST = "latest"
STAGING_PREFIX = ".dsfix-convert-"
MAX_SHARD_SIZE = 5 * 1024**3
PROGRESS_MIN_BYTES = 64 * 2**20
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
STRATEGIES = ("clone", "dedupe")
# what --config contributes besides config.json (the weights come from the checkpoint)
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
          "chat_template.json")

_OPTIM_RE = re.compile(r"^(?:(?P<prec>bf16|fp16|fp32)_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_MODEL3_RE = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
_MODEL12 = "mp_rank_00_model_states.pt"


# --------------------------------------------------------------------------- loading without running code


class LossScalerRecord:
    """Stands in for deepspeed.runtime.fp16.loss_scaler.LossScaler: its attributes, no behaviour."""


class DynamicLossScalerRecord:
    """Stands in for deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler (fp16 training)."""


class FragmentAddress:
    """Stands in for deepspeed.utils.tensor_fragment.fragment_address (ZeRO-1/2's param_slice_mappings)."""


def zero_stage_enum(value):
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


def _torch_version() -> tuple:
    import torch

    return tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])


@contextmanager
def _allowed_globals():
    """The allow-list, for one load. torch 2.6+ binds each name to a stand-in; torch 2.4-2.5 only admits a
    class under its own name, so there DeepSpeed's classes are imported (never called: weights_only only
    creates an object and sets its attributes); older torch cannot admit any, and is refused."""
    import torch

    ser = torch.serialization
    if not hasattr(ser, "add_safe_globals"):
        raise DsfixError(f"reading DeepSpeed optimizer files without running code needs torch >= 2.4 "
                         f"(weights_only allow-lists); this is torch {torch.__version__}")
    if _torch_version() >= (2, 6):
        entries = [(obj, name) for name, obj in ALLOWED.items()]
    else:
        try:
            from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
            from deepspeed.runtime.zero.config import ZeroStageEnum
            from deepspeed.utils.tensor_fragment import fragment_address
        except ImportError as e:
            raise DsfixError(f"with torch {torch.__version__} reading DeepSpeed optimizer files needs deepspeed "
                             f"importable ({e}); torch >= 2.6 needs no deepspeed")
        entries = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    if hasattr(ser, "safe_globals"):
        with ser.safe_globals(entries):
            yield
    else:  # torch 2.4: process-wide, which is all a CLI run needs
        ser.add_safe_globals(entries)
        yield


def load_pt(path: Path) -> dict:
    """A DeepSpeed ``.pt`` file, weights-only with :data:`ALLOWED`, memory-mapped. Raises DsfixError (code 2)."""
    import pickle

    import torch

    if not path.is_file():
        raise DsfixError("is missing", path=str(path))
    if not zipfile.is_zipfile(path):
        raise DsfixError("is truncated or not a torch.save file (no zip directory at its end); nothing written",
                         path=str(path))
    try:
        with _allowed_globals():
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"function (\S+)", str(e))
        what = found.group(1) if found else " ".join(str(e).split())[:120]
        raise DsfixError(f"refused: this file needs {what} to load, which is not one of the types DeepSpeed "
                         "checkpoints hold; nothing run, nothing written", path=str(path))
    except DsfixError:
        raise
    except MemoryError:
        raise
    except Exception as e:
        msg = " ".join(str(e).split())
        raise DsfixError(f"not a readable torch.save file (truncated?): {type(e).__name__}: {msg[:160]}; "
                         "nothing written", path=str(path))
    if not isinstance(obj, dict):
        raise DsfixError(f"holds a {type(obj).__name__}, not a DeepSpeed checkpoint's dict", path=str(path))
    return obj


# --------------------------------------------------------------------------- finding the checkpoint


class Layout(NamedTuple):
    """What a ``global_stepN`` folder holds, from its file names."""

    folder: Path
    tag: str
    stage3: bool  # one model_states file per rank
    model_files: tuple  # rank order (one file for ZeRO-1/2)
    optim_files: tuple  # rank order
    precision: str  # "bf16", "fp16" or "fp32": the optimizer files' prefix


def is_engine_checkpoint(path) -> bool:
    """True when ``path`` is what ``engine.save_checkpoint`` wrote: a folder with ``latest`` or step folders
    holding ``*_model_states.pt``, or such a ``global_stepN`` folder itself."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    return (folder / LATEST).is_file() or any(folder.glob("*_model_states.pt")) or any(folder.glob("*/*_model_states.pt"))


def find_layout(path, tag: Optional[str] = None) -> Layout:
    """The step folder to read: ``path/TAG`` (``tag``, else the one ``latest`` names), or ``path`` itself."""
    root = Path(path)
    if tag is not None:
        folder = root / tag
        if not folder.is_dir():
            if root.name == tag and any(root.glob("*_model_states.pt")):
                folder = root
            else:
                steps = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_model_states.pt")))
                raise DsfixError(f"no folder {tag} here; the steps saved are {examples(steps) or 'none'}",
                                 path=str(root))
    elif (root / LATEST).is_file():
        try:
            tag = (root / LATEST).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise DsfixError(f"{LATEST} is unreadable: {e}", path=str(root))
        folder = root / tag
        if not tag or Path(tag).name != tag or not folder.is_dir():
            steps = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_model_states.pt")))
            raise DsfixError(f"{LATEST} names {tag!r}, which is not a folder here (saved: {examples(steps) or 'none'}; "
                             "pick one with --tag)", path=str(root))
    else:
        folder, tag = root, root.name
    return _layout_of(folder, tag)


def _layout_of(folder: Path, tag: str) -> Layout:
    optim, precisions = {}, set()
    for p in folder.glob("*_optim_states.pt"):
        m = _OPTIM_RE.match(p.name)
        if m is None:
            continue
        if int(m.group("mp")) != 0:
            raise DsfixError(f"{p.name}: model-parallel checkpoints (mp_rank > 0) are not supported", path=str(folder))
        optim[int(m.group("rank"))] = p
        precisions.add(m.group("prec") or "fp16")
    model3 = {}
    for p in folder.glob("zero_pp_rank_*_model_states.pt"):
        m = _MODEL3_RE.match(p.name)
        if m is not None and int(m.group("mp")) == 0:
            model3[int(m.group("rank"))] = p
    stage3 = bool(model3)
    if not stage3 and not (folder / _MODEL12).is_file():
        raise DsfixError(f"no {_MODEL12} or zero_pp_rank_R_mp_rank_00_model_states.pt: not a DeepSpeed engine "
                         "checkpoint folder", path=str(folder))
    if not optim:
        raise DsfixError("no *_optim_states.pt: the fp32 master weights of a ZeRO checkpoint are in them "
                         "(a checkpoint saved without ZeRO, or its optimizer files were removed)", path=str(folder))
    if len(precisions) > 1:
        raise DsfixError(f"optimizer files of several precisions ({examples(sorted(precisions))}): two saves in one "
                         "folder?", path=str(folder))
    prec = precisions.pop()
    world = max(optim) + 1
    _check_ranks(folder, prec, optim, world)
    if stage3:
        gone = [r for r in range(world) if r not in model3]
        if gone:
            raise DsfixError(f"rank {gone[0]}'s file zero_pp_rank_{gone[0]}_mp_rank_00_model_states.pt is missing; "
                             "every rank's file is needed", path=str(folder))
        model_files = tuple(model3[r] for r in range(world))
    else:
        model_files = (folder / _MODEL12,)
    return Layout(folder, tag, stage3, model_files, tuple(optim[r] for r in range(world)), prec)


def optim_name(precision: str, rank: int) -> str:
    return f"{'' if precision == 'fp16' else precision + '_'}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _check_ranks(folder: Path, precision: str, present, world: int) -> None:
    missing = [r for r in range(world) if r not in present]
    if missing:
        raise DsfixError(f"rank {missing[0]}'s file {optim_name(precision, missing[0])} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + f"; all {world} ranks' files are needed", path=str(folder))


# --------------------------------------------------------------------------- where each element lives


class Piece(NamedTuple):
    """``count`` elements of parameter ``name`` from element ``dst`` on, found in rank ``rank``'s flat group
    ``group`` from element ``src`` on."""

    rank: int
    group: int
    src: int
    name: str
    dst: int
    count: int


def zero12_pieces(groups: list, partition: list, world: int, paddings: Optional[list] = None) -> list:
    """ZeRO-1/2. ``groups``: per parameter group, [(name, numel)] in ``param_shapes`` order; ``partition``:
    each group's per-rank partition size; ``paddings``: per group, the padding after each parameter (or None).
    Returns the pieces, rank by rank. Raises ValueError when the parameters do not fit the partitions."""
    out = []
    for g, params in enumerate(groups):
        size = partition[g]
        pads = paddings[g] if paddings is not None else [0] * len(params)
        if len(pads) != len(params):
            raise ValueError(f"group {g} records {len(pads)} paddings for {len(params)} parameters")
        offset, spans = 0, []
        for (name, numel), pad in zip(params, pads):
            spans.append((name, offset, numel))
            offset += numel + pad
        if offset > size * world:
            raise ValueError(f"group {g}'s parameters need {offset} elements but its {world} partitions hold "
                             f"{size * world}")
        align = 2 * world  # DeepSpeed pads a group's end to a multiple of 2 x world (and to the partitions)
        if math.ceil(offset / align) * align != math.ceil(size * world / align) * align:
            raise ValueError(f"group {g}'s partitions hold {size * world} elements but its parameters "
                             f"take {offset}: not the layout these files record")
        for name, start, numel in spans:
            end = start + numel
            for r in range(start // size if size else 0, world):
                lo, hi = max(start, r * size), min(end, (r + 1) * size)
                if lo >= hi:
                    break
                out.append(Piece(r, g, lo - r * size, name, lo - start, hi - lo))
    out.sort(key=lambda p: p.rank)
    return out


def zero3_pieces(params: list, world: int, group_sizes: list) -> list:
    """ZeRO-3. ``params``: [(name, numel)] over all groups in ``param_shapes`` order; ``group_sizes``: the
    elements of each of a rank's flat groups. Returns the pieces, rank by rank; raises ValueError when the
    groups do not hold exactly the parameters' partitions."""
    local = sum(math.ceil(n / world) for _, n in params)
    if local != sum(group_sizes):
        raise ValueError(f"each rank's flat groups hold {sum(group_sizes)} elements but the parameters' "
                         f"partitions take {local}")
    bounds = [0]
    for s in group_sizes:
        bounds.append(bounds[-1] + s)
    out = []
    for r in range(world):
        at = 0
        for name, numel in params:
            part = math.ceil(numel / world)
            first = r * part
            count = min(part, numel - first)
            src = at
            while count > 0:  # a slice may cross from one flat group into the next
                g = next(i for i in range(len(group_sizes)) if bounds[i] <= src < bounds[i + 1])
                take = min(count, bounds[g + 1] - src)
                out.append(Piece(r, g, src - bounds[g], name, first, take))
                src, first, count = src + take, first + take, count - take
            at += part
    return out


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class EngineResult(Result, Checks):
    """``dsfix convert``'s result for an engine checkpoint (the .bin case's is convert.ConvertReport)."""

    path: str  # the checkpoint folder given
    output: str
    status: ConvertStatus  # CONVERTED, or FAILED (a check failed: nothing written)
    ok: bool
    checks: tuple = ()
    tag: str = ""
    stage: Optional[int] = None
    world: Optional[int] = None
    precision: str = ""
    dtype: str = ""
    strategy: str = "clone"
    tensors: Optional[int] = None
    written: tuple = ()
    bytes_written: int = 0
    note: str = ""
    verb = "convert"
    warnings = ()

    @property
    def exit_code(self) -> int:
        return self.status.exit_code

    @property
    def message(self) -> str:
        if not self.ok:
            return f"not converted {self.path}: {self.note or 'a check failed'}; nothing written"
        return (f"converted {self.path} ({self.tag}) -> {self.output}: {self.tensors} tensors, {self.dtype}, "
                f"{self.strategy}; {examples(self.written)}")

    def describe(self) -> str:
        stage = f"ZeRO-{self.stage}" if self.stage is not None else "ZeRO"
        return (f"{self.path}: a DeepSpeed engine checkpoint ({self.tag}, {stage}, {self.world} rank(s), "
                f"{self.precision} optimizer states), written to {self.output}")

    def body(self) -> dict:
        return {"path": self.path, "kind": "deepspeed-engine-checkpoint", "output": self.output, "status": self.status.value,
                "ok": self.ok, "tag": self.tag, "zero_stage": self.stage, "world_size": self.world,
                "precision": self.precision, "dtype": self.dtype, "strategy": self.strategy, "tensors": self.tensors,
                "written": list(self.written), "bytes_written": self.bytes_written, "note": self.note,
                "checks": [c._asdict() for c in self.checks]}


# --------------------------------------------------------------------------- the plan


class Entry(NamedTuple):
    name: str
    shape: tuple
    dtype: object  # torch dtype written
    source: str  # the checkpoint name whose data it holds (itself, or the tied parameter it aliases)
    kind: str  # "trained", "frozen", "buffer"


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def _out_dtype(requested: str, cfg_dtype: Optional[str]):
    import torch

    if requested == "auto":
        name = str(cfg_dtype or "float32").replace("torch.", "")
        if name not in DTYPES.values():
            raise DsfixError(f"--dtype auto: config.json's torch_dtype {cfg_dtype!r} is not bf16, fp16 or fp32; "
                             "pass --dtype")
        return getattr(torch, name)
    if requested not in DTYPES:
        raise DsfixError(f"--dtype must be auto, bf16, fp16 or fp32, not {requested}")
    return getattr(torch, DTYPES[requested])


def _plan(meta: dict, cfg, strategy: str, dtype, checks: list) -> tuple[list, list]:
    """(entries in the config model's state_dict order, tie groups). Appends the pre-write checks."""
    import torch

    trained = {n: tuple(int(d) for d in s) for group in meta["param_shapes"] for n, s in group.items()}
    frozen = {n: tuple(int(d) for d in s) for n, s in (meta.get("frozen_param_shapes") or {}).items()}
    module = meta.get("module") or {}
    buffers = {n: module[n] for n in (meta.get("buffer_names") or []) if n in module}
    shared = dict(meta.get("shared_params") or {})
    sources = {**{n: (s, "trained") for n, s in trained.items()}, **{n: (s, "frozen") for n, s in frozen.items()},
               **{n: (tuple(t.shape), "buffer") for n, t in buffers.items()}}

    model = meta_model(cfg)
    expected, tie_groups = expected_of(model)
    embed_name = next((k for k, v in model.state_dict(keep_vars=True).items()
                       if v is model.get_input_embeddings().weight), None)
    del model
    tied_in_config = {k: g for g in tie_groups for k in g}

    entries, dropped, unknown_alias = [], [], []
    names = list(expected) + [n for n in list(sources) + list(shared) if n not in expected]
    for name in names:
        if name in sources:
            shape, kind = sources[name]
            source = name
        elif name in shared and shared[name] in sources:
            shape, kind = sources[shared[name]]
            source = shared[name]
            if strategy == "dedupe" and shared[name] in tied_in_config.get(name, ()):
                dropped.append(name)
                continue
        elif name in shared:
            unknown_alias.append(f"{name} -> {shared[name]}")
            continue
        else:
            continue  # missing: the keys check names it
        floating = kind != "buffer" or buffers[name].is_floating_point()
        out = dtype if floating else buffers[name].dtype
        entries.append(Entry(name, shape, out, source, kind))

    head = Header(files=["(planned)"])
    code = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}
    for e in entries:
        head.entries[e.name] = (e.shape, code.get(e.dtype, str(e.dtype)), "(planned)")
    checks.append(keys_check(head, expected, tie_groups))
    checks.append(shapes_check(head, expected))
    checks.append(nonempty_check(head))
    if embed_name is not None and embed_name in sources:
        rows = sources[embed_name][0][0]
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is not None and rows != vocab:
            checks.append(Check("vocab", False, f"the checkpoint's {embed_name} has {rows} rows but config.json's "
                                                f"vocab_size is {vocab}: --config does not describe this checkpoint "
                                                "(pass the config it was trained with)"))
        else:
            checks.append(Check("vocab", True, f"{embed_name}: {rows} rows = config.json's vocab_size"))
    bad_ties = [g for g in tie_groups if sum(1 for k in g if k in sources) > 1]
    if unknown_alias:
        checks.append(Check("tied", False, f"shared_params names parameters the checkpoint lacks: {examples(unknown_alias)}"))
    elif bad_ties:
        pairs = [" and ".join(g) for g in bad_ties]
        checks.append(Check("tied", False, f"config.json ties {examples(pairs)} but the checkpoint trained them as "
                                           "separate parameters; refusing to pick one"))
    elif shared:
        how = [f"dropped {n} (dedupe)" for n in dropped] or [f"{n} written from {s}" for n, s in shared.items()]
        checks.append(Check("tied", True, f"recorded shared_params: {examples(how)}"))
    else:
        checks.append(Check("tied", True, "the checkpoint records no shared parameters"))
    return entries, tie_groups


# --------------------------------------------------------------------------- the entry point


def convert_engine(path, config, output, *, tag: Optional[str] = None, dtype: str = "auto", strategy: str = "clone",
                   load: bool = True, console=None, max_shard_size: int = MAX_SHARD_SIZE,
                   progress_min_bytes: int = PROGRESS_MIN_BYTES) -> EngineResult:
    """Convert the engine checkpoint at ``path`` into ``output``. Raises DsfixError (code 2) on bad input (nothing
    written); a failed check gives ``ok=False`` (nothing written)."""
    if strategy not in STRATEGIES:
        raise DsfixError(f"--strategy must be clone or dedupe, not {strategy}")
    if config is None or output is None:
        raise DsfixError("a DeepSpeed engine checkpoint holds no config or tokenizer: convert needs "
                         "--config MODEL_DIR (the model's config.json and tokenizer) and --output OUT_DIR", path=str(path))
    config, output = Path(config), Path(output)
    if not (config / CONFIG_NAME).is_file():
        raise DsfixError(f"--config: no {CONFIG_NAME} in this folder", path=str(config))
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DsfixError("--output exists and is not an empty folder; nothing written", path=str(output))
    if not output.parent.is_dir():
        raise DsfixError("--output: its parent folder does not exist", path=str(output))

    layout = find_layout(path, tag)
    meta = load_pt(layout.model_files[0])
    for key in ("param_shapes", "shared_params"):
        if key not in meta:
            raise DsfixError(f"no {key}: not a model_states file of a ZeRO checkpoint", path=str(layout.model_files[0]))
    world = int(meta.get("dp_world_size") or len(layout.optim_files))
    _check_ranks(layout.folder, layout.precision, range(len(layout.optim_files)), world)
    if world != len(layout.optim_files):
        raise DsfixError(f"dp_world_size is {world} but there are {len(layout.optim_files)} optimizer files: "
                         "files left from another save?", path=str(layout.folder))
    cfg, cfg_check, cfg_dtype = load_config(config)
    if cfg is None:
        raise DsfixError(f"--config: {cfg_check.detail}", path=str(config))
    out_dtype = _out_dtype(dtype, cfg_dtype)
    dname = str(out_dtype).replace("torch.", "")
    stage_guess = 3 if layout.stage3 else 2
    base = dict(path=str(path), output=str(output), tag=layout.tag, world=world, precision=layout.precision,
                dtype=dname, strategy=strategy)

    checks = [cfg_check]
    try:
        entries, _ = _plan(meta, cfg, strategy, out_dtype, checks)
    except Exception as e:
        checks.append(Check("keys", False, f"cannot build the model of {CONFIG_NAME} on meta: {type(e).__name__}: {e}"))
        entries = []
    n_trained = sum(len(g) for g in meta["param_shapes"])
    n_frozen = len(meta.get("frozen_param_shapes") or {})
    source = Check("source", True, f"{layout.tag}: ZeRO-{'3' if layout.stage3 else '1/2'}, {world} rank(s), "
                                   f"{layout.precision} optimizer states, DeepSpeed {meta.get('ds_version', '?')}; "
                                   f"{n_trained} trained + {n_frozen} frozen parameters, "
                                   f"{len(meta.get('buffer_names') or [])} buffers, "
                                   f"{len(meta.get('shared_params') or {})} shared; read weights-only")
    checks.insert(0, source)
    if not all(c.ok for c in checks):
        return EngineResult(status=ConvertStatus.FAILED, ok=False, checks=tuple(checks), stage=stage_guess,
                            note="a check failed before writing", **base)

    try:
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=str(output.parent)))
    except OSError as e:
        raise DsfixError(f"cannot write here: {e.strerror or e}; nothing written", path=str(output.parent))
    try:
        files, stage = _write(layout, meta, entries, staging, world, max_shard_size, console, progress_min_bytes)
        del meta
        for name in (CONFIG_NAME,) + COPIED:
            if (config / name).is_file():
                shutil.copyfile(config / name, staging / name)
        fsync(staging)
        checks = [source._replace(detail=source.detail.replace("ZeRO-1/2", f"ZeRO-{stage}"))] + \
            _verify(staging, len(entries), load, cfg, out_dtype, checks)
        nbytes = sum((staging / f).stat().st_size for f in files)
        if not all(c.ok for c in checks):
            return EngineResult(status=ConvertStatus.FAILED, ok=False, checks=tuple(checks), stage=stage, tensors=len(entries),
                                note="a check of the written folder failed", **base)
        try:
            os.rename(staging, output)  # onto a missing or empty folder: atomic
            Written.mark()  # an interrupt from here on leaves the converted folder in place
        except OSError as e:
            raise DsfixError(f"cannot move the converted folder into place: {e.strerror or e}; nothing written",
                             path=str(output))
        fsync(output.parent)
        written = tuple(sorted(p.name for p in output.iterdir()))
        return EngineResult(status=ConvertStatus.CONVERTED, ok=True, checks=tuple(checks), stage=stage, tensors=len(entries),
                            written=written, bytes_written=nbytes, **base)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _verify(folder: Path, count: int, load: bool, cfg, dtype, pre: list) -> list:
    """verify's checks on the written folder, then a from_pretrained load in the files' dtype (tied too)."""
    report = verify_folder(folder, expect=count, load=False)
    checks = list(report.checks) + [c for c in pre if c.name == "vocab"]
    tied = report.check("tied")
    pre_tied = next((c for c in pre if c.name == "tied"), None)
    if tied is not None and pre_tied is not None:
        checks[checks.index(tied)] = tied._replace(detail=f"{tied.detail}; {pre_tied.detail}")
    if load and report.check("config") is not None and report.check("config").ok:
        check, model = load_check(folder, dtype=dtype, keep_model=True)
        if model is not None and check.ok and getattr(cfg, "tie_word_embeddings", False):
            out_emb = model.get_output_embeddings()
            if out_emb is not None and out_emb.weight is not model.get_input_embeddings().weight:
                check = Check("load", False, "from_pretrained loaded the output embedding untied from the input "
                                             "embedding though config.json ties them")
            else:
                check = check._replace(detail=check.detail + "; output embedding tied to the input embedding")
        del model
        checks.append(check)
    return checks


# --------------------------------------------------------------------------- writing


class _Out(NamedTuple):
    fd: int
    start: int  # absolute file offset of the tensor's data
    dtype: object
    itemsize: int


def _layout_files(entries: list, limit: int) -> list:
    """[(file name, header bytes, {name: (absolute data offset, nbytes)})], laid out by the save module's own
    ``layout_files`` (runs up to ``limit`` bytes, each file's tensors by dtype then name, every offset
    aligned, as safetensors' save_file), so both write the same format."""
    from patcher.templates.dsfix_safetensors import PlannedTensor, layout_files

    planned = [PlannedTensor(e.name, e.dtype, tuple(int(d) for d in e.shape)) for e in entries]
    return [(f.name, f.header, {t.name: (f.offsets[t.name], t.nbytes) for t in f.tensors})
            for f in layout_files(planned, int(limit))]


def _bytes_of(tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy and without numpy."""
    import ctypes

    n = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


def _write(layout: Layout, meta: dict, entries: list, staging: Path, world: int, limit: int, console,
           min_bytes: int) -> tuple[list, int]:
    """Streams the tensors into ``staging``, one rank's files at a time. Returns (file names, ZeRO stage)."""
    import gc

    import torch

    files = _layout_files(entries, limit)
    by_source: dict = {}
    outs: dict = {}
    fds = []
    total = 0
    try:
        for fname, header, offsets in files:
            fd = os.open(str(staging / fname), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            os.write(fd, header)
            os.ftruncate(fd, len(header) + sum(n for _, n in offsets.values()))
            for name, (start, n) in offsets.items():
                outs[name] = (fd, start)
                total += n
        for e in entries:
            fd, start = outs[e.name]
            by_source.setdefault(e.source, []).append(
                (e, _Out(fd, start, e.dtype, torch.empty((), dtype=e.dtype).element_size())))
        covered = {e.name: 0 for e in entries}

        with _progress(console, total, min_bytes) as advance:
            def put(source: str, dst: int, data) -> None:
                """Elements ``dst``.. of checkpoint tensor ``source`` are ``data`` (flat): write them wherever
                they go (the tensor, and a tied alias cloned from it)."""
                cast = {}
                for entry, out in by_source.get(source, ()):
                    if out.dtype not in cast:
                        cast[out.dtype] = data.to(out.dtype).contiguous() if data.dtype != out.dtype else data.contiguous()
                    chunk = cast[out.dtype]
                    if dst + chunk.numel() > _numel(entry.shape):
                        raise DsfixError(f"{source}: elements {dst}-{dst + chunk.numel()} lie past its shape "
                                         f"{list(entry.shape)}; the checkpoint is inconsistent", path=str(layout.folder))
                    buf = _bytes_of(chunk)
                    at, done = out.start + dst * out.itemsize, 0
                    while done < len(buf):
                        done += os.pwrite(out.fd, buf[done:], at + done)
                    covered[entry.name] += chunk.numel()
                    advance(len(buf))

            stage = _stream(layout, meta, world, put)
        short = [f"{e.name} ({covered[e.name]} of {_numel(e.shape)} elements)" for e in entries
                 if covered[e.name] != _numel(e.shape)]
        if short:
            raise DsfixError(f"the checkpoint does not hold every element: {examples(short)}; nothing written",
                             path=str(layout.folder))
        for fd in fds:
            os.fsync(fd)
    except OSError as e:
        raise DsfixError(f"cannot write the converted files: {e.strerror or e}; nothing written", path=str(staging.parent))
    finally:
        for fd in fds:
            os.close(fd)
        gc.collect()
    names = [f[0] for f in files]
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted((k, f[0]) for f in files for k in f[2]))}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        fsync(staging / INDEX_NAME)
        names.append(INDEX_NAME)
    return names, stage


def _stream(layout: Layout, meta: dict, world: int, put) -> int:
    """Reads the ranks' files one at a time and hands each piece to ``put``; returns the ZeRO stage."""
    import torch

    buffers = {n: meta["module"][n] for n in (meta.get("buffer_names") or []) if n in meta.get("module", {})}
    frozen_shapes = meta.get("frozen_param_shapes") or {}
    stage, pieces = None, None
    for rank, path in enumerate(layout.optim_files):
        osd = load_pt(path).get("optimizer_state_dict")
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise DsfixError("no optimizer_state_dict with zero_stage: not a ZeRO optimizer file", path=str(path))
        this = int(osd["zero_stage"])
        if stage is None:
            stage = this
            if (stage == 3) != layout.stage3:
                raise DsfixError(f"zero_stage {stage} but the model_states files are laid out for "
                                 f"ZeRO-{'3' if layout.stage3 else '1/2'}", path=str(path))
        elif this != stage:
            raise DsfixError(f"zero_stage {this}, but rank 0's file says {stage}: files of two saves?", path=str(path))
        counts = osd.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(int(c) != world for c in counts if c is not None):
            raise DsfixError(f"partition_count {counts} but {world} ranks saved this checkpoint", path=str(path))
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        flat = osd.get(key)
        if not isinstance(flat, list) or not all(isinstance(t, torch.Tensor) for t in flat):
            raise DsfixError(f"no {key}: the fp32 master weights are not in this file", path=str(path))
        flat = [t.reshape(-1) for t in flat]
        sizes = [t.numel() for t in flat]
        if pieces is None:
            try:
                if stage == 3:
                    params = [(n, _numel(s)) for g in meta["param_shapes"] for n, s in g.items()]
                    pieces = zero3_pieces(params, world, sizes)
                else:
                    groups = [[(n, _numel(s)) for n, s in g.items()] for g in meta["param_shapes"]]
                    if len(groups) != len(sizes):
                        raise ValueError(f"{len(groups)} parameter groups but {len(sizes)} flat partitions")
                    pieces = zero12_pieces(groups, sizes, world, osd.get("param_alignment_paddings"))
            except ValueError as e:
                raise DsfixError(f"{e}", path=str(path))
            sizes0 = sizes
        elif sizes != sizes0:
            raise DsfixError(f"its flat partitions hold {sizes} elements, rank 0's {sizes0}: files of two saves?",
                             path=str(path))
        for p in (p for p in pieces if p.rank == rank):
            put(p.name, p.dst, flat[p.group].narrow(0, p.src, p.count))
        del osd, flat

        if stage == 3 and frozen_shapes:  # each rank's slice of every frozen parameter
            frags = (meta if rank == 0 else load_pt(layout.model_files[rank])).get("frozen_param_fragments") or {}
            for name, shape in frozen_shapes.items():
                if name not in frags:
                    raise DsfixError(f"no fragment of frozen {name}", path=str(layout.model_files[rank]))
                numel = _numel(shape)
                part = math.ceil(numel / world)
                count = min(part, numel - rank * part)
                if count > 0:
                    put(name, rank * part, frags[name].reshape(-1).narrow(0, 0, count))
            del frags
        if rank == 0:
            if stage != 3:
                frags = meta.get("frozen_param_fragments") or {}
                for name in frozen_shapes:
                    if name not in frags:
                        raise DsfixError(f"no frozen_param_fragments entry for {name}", path=str(layout.model_files[0]))
                    put(name, 0, frags[name].reshape(-1))
            for name, tensor in buffers.items():
                put(name, 0, tensor.reshape(-1))
    return stage


@contextmanager
def _progress(console, total: int, min_bytes: int):
    """advance(nbytes): a rich progress bar on ``console`` when it is a terminal and the data is large."""
    if console is None or not getattr(console, "is_terminal", False) or total < min_bytes:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("converting (rank by rank)"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("convert", total=total)
        yield lambda n: bar.advance(task, n)
