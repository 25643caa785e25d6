"""The files of a DeepSpeed ZeRO engine checkpoint: reading them without running code, finding the step
folder, and where each element of the ranks' flat fp32 partitions belongs.

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

:func:`stream` maps each rank's flat partition to (parameter, offset) pieces (:func:`zero12_pieces`,
:func:`zero3_pieces`) and hands them on, one rank's optimizer file at a time (memory-mapped), then the
frozen parameters and buffers (:func:`stream_frozen`, which a universal checkpoint shares).

Where checkpoints come from: the Hugging Face Trainer saves ``OUTPUT/checkpoint-N/`` (``latest``,
``global_stepN/``, ``config.json``, the tokenizer, ``trainer_state.json``), accelerate's ``save_state`` a folder
with ``latest`` naming ``pytorch_model/`` beside ``random_states_R.pkl``, and ``engine.save_checkpoint`` the
bare ``latest`` and ``global_stepN/``. :func:`choose_checkpoint` picks a run folder's last ``checkpoint-N`` as
transformers' ``get_last_checkpoint`` does, :func:`config_folder` finds the checkpoint's own ``config.json``,
:func:`producer_of` says who wrote it, and :func:`precision_of` names the run's precision (the file names
say bf16; fp16 and fp32 runs write the same names, and the saved DeepSpeed config tells them apart).

Every ``.pt`` is read with ``torch.load(weights_only=True)`` and an allow-list of the few non-torch types
DeepSpeed pickles (:data:`ALLOWED`), each bound to a plain stand-in class here, so no DeepSpeed or other
code runs on load and DeepSpeed need not be installed. Anything else is refused, naming the type.
"""

from __future__ import annotations

import math
import re
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional

from patcher.checkpoint.checks import CONFIG_NAME, examples
from patcher.errors import DsfixError

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"

_OPTIM_RE = re.compile(r"^(?:(?P<prec>bf16|fp16|fp32)_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
# transformers' Trainer saves into OUTPUT/checkpoint-N/ (trainer_utils.PREFIX_CHECKPOINT_DIR, _re_checkpoint)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"  # what marks a folder as the Trainer's checkpoint-N
ACCELERATE_STATE_RE = re.compile(r"^random_states_\d+\.pkl$")  # what accelerate's save_state writes beside the model
MODEL3_RE = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
MODEL12 = "mp_rank_00_model_states.pt"


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


def load_pt(path: Path, tensor_ok: bool = False):
    """A DeepSpeed ``.pt`` file, weights-only with :data:`ALLOWED`, memory-mapped: a dict (or, with
    ``tensor_ok``, a bare tensor, as a universal checkpoint's ZeRO-3 parameter file). Raises DsfixError (code 2)."""
    import pickle

    from patcher.checkpoint.quiet import import_torch_quietly

    import_torch_quietly()  # the first torch import of an engine convert, after its input was checked
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
    if not isinstance(obj, dict) and not (tensor_ok and isinstance(obj, torch.Tensor)):
        raise DsfixError(f"holds a {type(obj).__name__}, not a DeepSpeed checkpoint's dict", path=str(path))
    return obj


# --------------------------------------------------------------------------- finding the checkpoint


class Layout(NamedTuple):
    """What a step folder holds, from its file names: an engine checkpoint's (``global_stepN``) or a universal
    checkpoint's (``global_stepN_universal``, :mod:`patcher.checkpoint.universal`)."""

    folder: Path
    tag: str
    stage3: bool  # one model_states file per rank
    model_files: tuple  # rank order (one file for ZeRO-1/2)
    optim_files: tuple  # rank order (none in a universal checkpoint)
    prefix: str  # the optimizer files' name prefix: "bf16" (DeepSpeed's bf16_), or "" (fp16 and fp32 runs alike)
    universal: bool = False


def is_engine_checkpoint(path) -> bool:
    """True when ``path`` is what ``engine.save_checkpoint`` (or ``ds_to_universal``) wrote: a folder with
    ``latest``, ``latest_universal`` or step folders holding ``*_model_states.pt``, or such a step folder itself."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    return ((folder / LATEST).is_file() or (folder / LATEST_UNIVERSAL).is_file()
            or any(folder.glob("*_model_states.pt")) or any(folder.glob("*/*_model_states.pt")))


def step_folder(path, tag: Optional[str] = None) -> tuple[Path, str, str]:
    """(the step folder to read, its tag, what named it): ``path/TAG`` with ``tag``; else the folder ``latest``
    names, else the one ``latest_universal`` names (``ds_to_universal`` writes it); else ``path`` itself."""
    root = Path(path)
    if tag is not None:
        folder = root / tag
        if folder.is_dir():
            return folder, tag, "--tag"
        if root.name == tag and any(root.glob("*_model_states.pt")):
            return root, tag, "--tag"
        raise DsfixError(f"no folder {tag} here; the steps saved are {examples(_steps(root)) or 'none'}",
                         path=str(root))
    for pointer in (LATEST, LATEST_UNIVERSAL):
        if (root / pointer).is_file():
            try:
                tag = (root / pointer).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise DsfixError(f"{pointer} is unreadable: {e}", path=str(root))
            if not tag or Path(tag).name != tag or not (root / tag).is_dir():
                raise DsfixError(f"{pointer} names {tag!r}, which is not a folder here (saved: "
                                 f"{examples(_steps(root)) or 'none'}; pick one with --tag)", path=str(root))
            return root / tag, tag, pointer
    return root, root.name, ""


def _steps(root: Path) -> list:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*_model_states.pt")))


def layout_of(folder: Path, tag: str) -> Layout:
    """An engine checkpoint's step folder: its model and optimizer files, rank by rank."""
    from patcher.checkpoint import refuse

    refuse.files(folder)
    optim, precisions = {}, set()
    for p in folder.glob("*_optim_states.pt"):
        m = _OPTIM_RE.match(p.name)
        if m is not None:
            optim[int(m.group("rank"))] = p
            precisions.add(m.group("prec") or "")
    model3 = {int(m.group("rank")): p for p in folder.glob("zero_pp_rank_*_model_states.pt")
              if (m := MODEL3_RE.match(p.name)) is not None}
    stage3 = bool(model3)
    if not stage3 and not (folder / MODEL12).is_file():
        raise DsfixError(f"no {MODEL12} or zero_pp_rank_R_mp_rank_00_model_states.pt: not a DeepSpeed engine "
                         "checkpoint folder", path=str(folder))
    if not optim:
        raise DsfixError("no *_optim_states.pt: the fp32 master weights of a ZeRO checkpoint are in them "
                         "(a checkpoint saved without ZeRO, or its optimizer files were removed)", path=str(folder))
    if len(precisions) > 1:
        found = examples(sorted(p or "no prefix" for p in precisions))
        raise DsfixError(f"optimizer files of several precisions ({found}): two saves in one "
                         "folder?", path=str(folder))
    prec = precisions.pop()
    world = max(optim) + 1
    check_ranks(folder, prec, optim, world)
    model_files = rank_files(folder, model3, world) if stage3 else (folder / MODEL12,)
    return Layout(folder, tag, stage3, model_files, tuple(optim[r] for r in range(world)), prec)


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


def training_precision(ds_config) -> Optional[str]:
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


def precision_of(layout: Layout, ds_config) -> str:
    """The optimizer states' precision as the run trained: the ``bf16_`` prefix says bf16; files without one are
    written by fp16 and fp32 runs alike, so the saved ``ds_config`` decides ("fp16 or fp32" without one)."""
    if layout.prefix in ("bf16", "fp16", "fp32"):
        return layout.prefix
    return training_precision(ds_config) or ("fp16 or fp32" if not layout.universal else "unknown")


# --------------------------------------------------------------------------- which producer, which checkpoint


def producer_of(root: Path) -> str:
    """Who wrote the checkpoint folder ``root`` (the one holding ``latest``), from the files beside it: "trainer"
    (transformers' Trainer: checkpoint-N/ with trainer_state.json), "accelerate" (``Accelerator.save_state``:
    random_states_R.pkl), else "" (a plain ``engine.save_checkpoint``, DeepSpeed-Chat among them)."""
    root = Path(root)
    if (root / TRAINER_STATE).is_file():
        return "trainer"
    if root.is_dir() and any(ACCELERATE_STATE_RE.match(p.name) for p in root.iterdir()):
        return "accelerate"
    return ""


def run_checkpoints(path) -> list:
    """The ``checkpoint-N`` folders of a Trainer's output folder, by N (transformers' own pattern)."""
    root = Path(path)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda t: t[0])]


class Chosen(NamedTuple):
    """The checkpoint folder to convert: ``path`` itself, or one ``checkpoint-N`` of a Trainer run folder."""

    path: Path  # the checkpoint folder (holding latest, or a step folder)
    tag: Optional[str]  # --tag left for the step folder (None: latest's)
    note: str  # how it was chosen ("" when ``path`` was given itself)


def choose_checkpoint(path, tag: Optional[str] = None) -> Optional[Chosen]:
    """``path`` when it is a DeepSpeed checkpoint; in a Trainer run folder (``checkpoint-N/`` folders), the one
    ``--tag`` names, else the last one, as transformers' ``get_last_checkpoint`` picks it (the largest N); None
    when ``path`` is neither. A run folder that is also a checkpoint itself (the Trainer's ``save_model()`` at
    ZeRO-3 without gathering writes ``latest`` into its output folder) is that checkpoint, its final save,
    unless ``--tag checkpoint-N`` names one of its checkpoints. Raises DsfixError when the chosen
    ``checkpoint-N`` holds no DeepSpeed checkpoint."""
    root = Path(path)
    runs = run_checkpoints(root)
    if is_engine_checkpoint(root) and not (tag is not None and runs and CHECKPOINT_RE.match(tag)):
        return Chosen(root, tag, "")
    if not runs:
        return None
    names = [p.name for p in runs]
    listed = ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]} ({len(names)} in all)"
    if tag is not None:
        if not CHECKPOINT_RE.match(tag):
            raise DsfixError(f"--tag {tag}: here --tag names a checkpoint-N ({listed}); for a step, give that "
                             "checkpoint-N",
                             path=str(root))
        if tag not in names:
            raise DsfixError(f"--tag {tag}: no such checkpoint here; the run saved {listed}", path=str(root))
        chosen, note = root / tag, f"{tag} (as --tag names it, of {listed})"
    else:
        chosen = runs[-1]
        note = (f"{chosen.name} (the last of {listed}, as transformers' get_last_checkpoint picks it"
                + ("; --tag checkpoint-N picks another)" if len(runs) > 1 else ")"))
    if not is_engine_checkpoint(chosen):
        bins = sorted(p.name for p in chosen.glob("pytorch_model*.bin"))
        hint = f"; a .bin folder is converted in place: dsfix convert {chosen}" if bins else ""
        raise DsfixError(f"{chosen.name} holds no DeepSpeed checkpoint (no latest): found {contents(chosen)}{hint}",
                         path=str(root))
    return Chosen(chosen, None, note)


def config_folder(path, step: Path) -> Optional[Path]:
    """The checkpoint's own folder holding ``config.json`` (the Trainer writes it into checkpoint-N/ with the
    generation config and the tokenizer): ``path`` itself, or, when ``path`` is the step folder, the folder
    holding it with its ``latest``. None when neither holds one."""
    root = Path(path)
    candidates = [root]
    if Path(step) == root and ((root.parent / LATEST).is_file() or (root.parent / LATEST_UNIVERSAL).is_file()):
        candidates.append(root.parent)
    return next((c for c in candidates if (c / CONFIG_NAME).is_file()), None)


def contents(folder) -> str:
    """What a folder holds, in a few names (folders with a slash), for a one-line refusal."""
    try:
        items = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(folder).iterdir())
    except OSError as e:
        return f"nothing readable ({e.strerror or e})"
    return examples(items) if items else "an empty folder"


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



# --------------------------------------------------------------------------- reading the ranks' files


def numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def stream(layout: Layout, meta: dict, world: int, put) -> int:
    """Reads the ranks' optimizer files one at a time and hands each piece to ``put(name, first element, flat
    data)``, then the frozen parameters and buffers (:func:`stream_frozen`). Returns the ZeRO stage."""
    from patcher.checkpoint import refuse

    stage, pieces, sizes0 = None, None, None
    for rank, path in enumerate(layout.optim_files):
        osd = load_pt(path).get("optimizer_state_dict")
        stage = _stage_of(osd, path, stage, layout)
        refuse.optimizer_states(osd, path)
        flat = _flat_groups(osd, stage, world, path)
        sizes = [t.numel() for t in flat]
        if pieces is None:
            pieces, sizes0 = _pieces(meta, stage, world, sizes, osd, path), sizes
        elif sizes != sizes0:
            raise DsfixError(f"its flat partitions hold {sizes} elements, rank 0's {sizes0}: files of two saves?",
                             path=str(path))
        for p in (p for p in pieces if p.rank == rank):
            put(p.name, p.dst, flat[p.group].narrow(0, p.src, p.count))
        del osd, flat
        stream_frozen(meta, layout.model_files, stage == 3, world, rank, put)
    return stage


def _stage_of(osd, path: Path, stage: Optional[int], layout: Layout) -> int:
    """This file's ZeRO stage, checked against the layout's and rank 0's."""
    if not isinstance(osd, dict) or "zero_stage" not in osd:
        raise DsfixError("no optimizer_state_dict with zero_stage: not a ZeRO optimizer file", path=str(path))
    this = int(osd["zero_stage"])
    if stage is None and (this == 3) != layout.stage3:
        raise DsfixError(f"zero_stage {this} but the model_states files are laid out for "
                         f"ZeRO-{'3' if layout.stage3 else '1/2'}", path=str(path))
    if stage is not None and this != stage:
        raise DsfixError(f"zero_stage {this}, but rank 0's file says {stage}: files of two saves?", path=str(path))
    return this


def _flat_groups(osd: dict, stage: int, world: int, path: Path) -> list:
    """The rank's flat fp32 partitions, one 1-D tensor a parameter group."""
    import torch

    counts = osd.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if any(int(c) != world for c in counts if c is not None):
        raise DsfixError(f"partition_count {counts} but {world} ranks saved this checkpoint", path=str(path))
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat = osd.get(key)
    if not isinstance(flat, list) or not all(isinstance(t, torch.Tensor) for t in flat):
        raise DsfixError(f"no {key}: the fp32 master weights are not in this file", path=str(path))
    return [t.reshape(-1) for t in flat]


def _pieces(meta: dict, stage: int, world: int, sizes: list, osd: dict, path: Path) -> list:
    try:
        if stage == 3:
            params = [(n, numel(s)) for g in meta["param_shapes"] for n, s in g.items()]
            return zero3_pieces(params, world, sizes)
        groups = [[(n, numel(s)) for n, s in g.items()] for g in meta["param_shapes"]]
        if len(groups) != len(sizes):
            raise ValueError(f"{len(groups)} parameter groups but {len(sizes)} flat partitions")
        return zero12_pieces(groups, sizes, world, osd.get("param_alignment_paddings"))
    except ValueError as e:
        raise DsfixError(f"{e}", path=str(path))


def stream_frozen(meta: dict, model_files: tuple, stage3: bool, world: int, rank: int, put) -> None:
    """Rank ``rank``'s share of the frozen parameters (ZeRO-3: its slice of each, from its model_states file;
    ZeRO-1/2: all of them whole, from rank 0's) and, on rank 0, the buffers."""
    frozen_shapes = meta.get("frozen_param_shapes") or {}
    if stage3 and frozen_shapes:
        frags = (meta if rank == 0 else load_pt(model_files[rank])).get("frozen_param_fragments") or {}
        for name, shape in frozen_shapes.items():
            if name not in frags:
                raise DsfixError(f"no fragment of frozen {name}", path=str(model_files[rank]))
            part = math.ceil(numel(shape) / world)
            count = min(part, numel(shape) - rank * part)
            if count > 0:
                put(name, rank * part, frags[name].reshape(-1).narrow(0, 0, count))
        del frags
    if rank != 0:
        return
    if not stage3:
        frags = meta.get("frozen_param_fragments") or {}
        for name in frozen_shapes:
            if name not in frags:
                raise DsfixError(f"no frozen_param_fragments entry for {name}", path=str(model_files[0]))
            put(name, 0, frags[name].reshape(-1))
    module = meta.get("module") or {}
    for name in meta.get("buffer_names") or []:
        if name in module:
            put(name, 0, module[name].reshape(-1))
