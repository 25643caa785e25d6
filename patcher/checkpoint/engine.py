"""``dsfix convert CKPT [--config MODEL] --output OUT``: a DeepSpeed checkpoint to a verified Hugging Face folder.

Which checkpoint (a Trainer run folder's last ``checkpoint-N``), whose config (the checkpoint's own
``config.json``, as the Trainer writes it, else ``--config``) and who wrote it: :mod:`patcher.checkpoint.zero`.

What it reads, each in its own module:

* an engine checkpoint (``engine.save_checkpoint``, ZeRO-1/2/3): :mod:`patcher.checkpoint.zero`;
* a universal checkpoint (``ds_to_universal``): :mod:`patcher.checkpoint.universal`;
* in either, DeepSpeed-Chat LoRA factors, fused into their weights: :mod:`patcher.checkpoint.lora`;
* what it refuses (tensor, expert or pipeline parallelism, non-Adam optimizer states):
  :mod:`patcher.checkpoint.refuse`.

This module plans the output from the model_states file and the config's model (names, shapes, dtypes,
the tied aliases recorded in ``shared_params``), lays out the output files' headers first with the
inserted save's own layout function, then streams: the reader hands over one piece of one tensor at a
time, which is cast to the output dtype and written at its place. Memory is one rank's partition (one
parameter's file, for a universal checkpoint) plus one piece, never the whole model. A tied alias recorded
in ``shared_params`` is written from the same pieces (``clone``) or left out (``dedupe``). Every element of
every tensor is accounted for before the folder is verified (``dsfix verify``'s checks, and a
``from_pretrained`` load in the files' dtype; a thread fsyncs the files meanwhile) and renamed into place,
once every file is on disk; a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

from patcher.checkpoint import lora, refuse, universal, zero
from patcher.checkpoint.checks import (
    CONFIG_NAME, INDEX_NAME, Check, Header, examples, keys_check, load_config, nonempty_check, shapes_check,
)
from patcher.checkpoint.convert import ConvertStatus
from patcher.checkpoint.files import clear_stale, fsync, fsync_folder, make_staging, release
from patcher.checkpoint.progress import Progress
from patcher.checkpoint.verify import expected_of, load_check, meta_model, verify_folder
from patcher.checkpoint.zero import Layout, load_pt
from patcher.errors import DsfixError, Written, stop_point
from patcher.report import Checks, Result

STAGING_PREFIX = ".dsfix-convert-"
MAX_SHARD_SIZE = 5 * 1024**3
PROGRESS_MIN_BYTES = 64 * 2**20
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
STRATEGIES = ("clone", "dedupe")
# what --config contributes besides config.json (the weights come from the checkpoint)
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
          "chat_template.json")
SCRATCH = ".lora-base-weights"  # in the staging folder, while LoRA layers are fused
PRODUCERS = {"trainer": "the Hugging Face Trainer", "accelerate": "accelerate's save_state"}  # zero.producer_of


# --------------------------------------------------------------------------- finding the checkpoint


def is_engine_checkpoint(path) -> bool:
    """What this module converts: an engine or universal checkpoint (``zero.is_engine_checkpoint``)."""
    return zero.is_engine_checkpoint(path)


def find_source(path, tag: Optional[str] = None) -> Layout:
    """The step folder to read (``--tag``, ``latest``, ``latest_universal``, or ``path`` itself) and its files."""
    folder, tag, _ = zero.step_folder(path, tag)
    if universal.is_universal(folder):
        return universal.layout_of(folder, tag)
    return zero.layout_of(folder, tag)


def open_checkpoint(path, tag: Optional[str]) -> tuple[Layout, dict, int]:
    """(layout, rank 0's model_states, the data-parallel world size), refusing what dsfix has not proven."""
    layout = find_source(path, tag)
    meta = load_pt(layout.model_files[0])
    for key in ("param_shapes", "shared_params"):
        if key not in meta:
            raise DsfixError(f"no {key}: not a model_states file of a ZeRO checkpoint", path=str(layout.model_files[0]))
    refuse.model_states(meta, layout.model_files[0])
    if not layout.universal:  # rank 0's optimizer states, before any planning (every rank's again as it is read)
        refuse.optimizer_states(load_pt(layout.optim_files[0]).get("optimizer_state_dict"), layout.optim_files[0])
    files = layout.model_files if layout.universal else layout.optim_files
    world = int(meta.get("dp_world_size") or len(files))
    if layout.universal and not layout.stage3:
        return layout, meta, world
    if not layout.universal:
        zero.check_ranks(layout.folder, layout.prefix, range(len(files)), world)
    if world != len(files):
        what = "model_states" if layout.universal else "optimizer"
        raise DsfixError(f"dp_world_size is {world} but there are {len(files)} {what} files: "
                         "files left from another save?", path=str(layout.folder))
    return layout, meta, world


# --------------------------------------------------------------------------- the result


@dataclass(frozen=True)
class EngineResult(Result, Checks):
    """``dsfix convert``'s result for an engine or universal checkpoint (the .bin case's is convert.ConvertReport)."""

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
    universal: bool = False  # a ds_to_universal folder, not the engine's own files
    checkpoint: str = ""  # the checkpoint folder read: ``path`` itself, or the checkpoint-N chosen in a Trainer run
    chosen: str = ""  # how that checkpoint-N was chosen ("" when ``path`` is the checkpoint)
    producer: str = ""  # "trainer", "accelerate" or "" (engine.save_checkpoint), from the files beside it
    config: str = ""  # the folder config.json (generation config, tokenizer) came from
    config_own: bool = False  # that folder is the checkpoint's own (the Trainer's), not --config
    lora: Optional[dict] = None  # DeepSpeed-Chat LoRA layers fused: layers, ranks, lora_scaling, dtype, kept
    verb = "convert"
    warnings = ()

    @property
    def message(self) -> str:
        if not self.ok:
            return f"not converted {self.path}: {self.note or 'a check failed'}; nothing written"
        fused = ""
        if self.lora:
            given = "as given" if self.lora["scaling_given"] else "step 1's default; --lora-scaling to change"
            fused = (f", LoRA fused into {self.lora['layers']} layers with lora_scaling {self.lora['lora_scaling']:g} "
                     f"({given}; scaling = lora_scaling / r, r = {', '.join(map(str, self.lora['ranks']))})"
                     + (f", factors kept in {lora.FILE}" if self.lora["kept"] else ""))
        tag = f"{Path(self.checkpoint).name}/{self.tag}" if self.chosen else self.tag
        return (f"converted {self.path} ({tag}) -> {self.output}: {self.tensors} tensors, {self.dtype}, "
                f"{self.strategy}{fused}; {examples(self.written)}")

    def describe(self) -> str:
        stage = f"ZeRO-{self.stage}" if self.stage is not None else "ZeRO"
        run = f"a Trainer run folder; converting {self.chosen}: " if self.chosen else ""
        by = PRODUCERS.get(self.producer, "")
        by = f", saved by {by}" if by else ""
        config = ("; config from the checkpoint's own folder" if self.config_own
                  else f"; config from --config {self.config}" if self.config else "")
        if self.universal:
            return (f"{self.path}: {run}a DeepSpeed universal checkpoint ({self.tag}, made by ds_to_universal from a "
                    f"{stage} run on {self.world} rank(s); one fp32 file a parameter){config}, "
                    f"written to {self.output}")
        return (f"{self.path}: {run}a DeepSpeed engine checkpoint ({self.tag}, {stage}, {self.world} rank(s), "
                f"{self.precision} optimizer states{by}){config}, written to {self.output}")

    def body(self) -> dict:
        kind = "deepspeed-universal-checkpoint" if self.universal else "deepspeed-engine-checkpoint"
        return {"path": self.path, "kind": kind, "output": self.output, "status": self.status.value,
                "ok": self.ok, "tag": self.tag, "zero_stage": self.stage, "world_size": self.world,
                "precision": self.precision, "dtype": self.dtype, "strategy": self.strategy, "tensors": self.tensors,
                "lora": self.lora, "checkpoint": self.checkpoint, "chosen": self.chosen or None,
                "producer": self.producer or None, "config": self.config, "config_from_checkpoint": self.config_own,
                "written": list(self.written), "bytes_written": self.bytes_written,
                "note": self.note, "checks": [c._asdict() for c in self.checks]}


# --------------------------------------------------------------------------- the plan


class Entry(NamedTuple):
    name: str
    shape: tuple
    dtype: object  # torch dtype written
    source: str  # the checkpoint name whose data it holds (itself, or the tied parameter it aliases)
    kind: str  # "trained", "frozen", "buffer"


class Plan(NamedTuple):
    entries: list  # in the config model's state_dict order
    lora: list  # lora.Module, fused into their weights (the factors are not entries)
    numels: dict  # every checkpoint tensor's element count


_numel = zero.numel


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


def _sources(meta: dict) -> tuple[dict, dict]:
    """(name -> (shape, kind) of every tensor the checkpoint holds, the buffers' tensors)."""
    trained = {n: tuple(int(d) for d in s) for group in meta["param_shapes"] for n, s in group.items()}
    frozen = {n: tuple(int(d) for d in s) for n, s in (meta.get("frozen_param_shapes") or {}).items()}
    module = meta.get("module") or {}
    buffers = {n: module[n] for n in (meta.get("buffer_names") or []) if n in module}
    return ({**{n: (s, "trained") for n, s in trained.items()}, **{n: (s, "frozen") for n, s in frozen.items()},
             **{n: (tuple(t.shape), "buffer") for n, t in buffers.items()}}, buffers)


def _plan(meta: dict, cfg, strategy: str, dtype, checks: list, where) -> Plan:
    """The tensors to write and the LoRA layers to fuse. Appends the pre-write checks."""
    sources, buffers = _sources(meta)
    modules = lora.find({n: s for n, (s, _) in sources.items()}, where)
    factors = {n for m in modules for n in (m.right, m.left)}
    numels = {n: _numel(s) for n, (s, _) in sources.items()}
    sources = {n: v for n, v in sources.items() if n not in factors}
    shared = dict(meta.get("shared_params") or {})

    try:
        model = meta_model(cfg)
        expected, tie_groups = expected_of(model)
        embed_name = next((k for k, v in model.state_dict(keep_vars=True).items()
                           if v is model.get_input_embeddings().weight), None)
        del model
    except Exception as e:  # a config transformers reads but cannot build: the keys check says so
        checks.append(Check("keys", False, f"cannot build the model of {CONFIG_NAME} on meta: {type(e).__name__}: {e}"))
        return Plan([], modules, numels)
    tied_in_config = {k: g for g in tie_groups for k in g}

    entries, dropped, unknown_alias = [], [], []
    for name in list(expected) + [n for n in list(sources) + list(shared) if n not in expected]:
        if name in sources:
            (shape, kind), source = sources[name], name
        elif name in shared and shared[name] in sources:
            (shape, kind), source = sources[shared[name]], shared[name]
            if strategy == "dedupe" and shared[name] in tied_in_config.get(name, ()):
                dropped.append(name)
                continue
        else:
            if name in shared:
                unknown_alias.append(f"{name} -> {shared[name]}")
            continue  # missing: the keys check names it
        floating = kind != "buffer" or buffers[name].is_floating_point()
        entries.append(Entry(name, shape, dtype if floating else buffers[name].dtype, source, kind))
    checks.extend(_plan_checks(entries, expected, tie_groups))
    checks.extend(c for c in [_vocab_check(cfg, embed_name, sources)] if c is not None)
    checks.append(_tied_check(tie_groups, sources, shared, dropped, unknown_alias))
    return Plan(entries, modules, numels)


def _plan_checks(entries: list, expected: dict, tie_groups: list) -> list:
    """keys, shapes and non-empty on the planned tensors, as verify runs them on written headers."""
    import torch

    head = Header(files=["(planned)"])
    code = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}
    for e in entries:
        head.entries[e.name] = (e.shape, code.get(e.dtype, str(e.dtype)), "(planned)")
    return [keys_check(head, expected, tie_groups), shapes_check(head, expected), nonempty_check(head)]


def _vocab_check(cfg, embed_name: Optional[str], sources: dict) -> Optional[Check]:
    if embed_name is None or embed_name not in sources:
        return None
    rows = sources[embed_name][0][0]
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and rows != vocab:
        return Check("vocab", False, f"the checkpoint's {embed_name} has {rows} rows but config.json's vocab_size is "
                                     f"{vocab}: --config does not describe this checkpoint (pass the config it was "
                                     "trained with)")
    return Check("vocab", True, f"{embed_name}: {rows} rows = config.json's vocab_size")


def _tied_check(tie_groups: list, sources: dict, shared: dict, dropped: list, unknown_alias: list) -> Check:
    bad_ties = [g for g in tie_groups if sum(1 for k in g if k in sources) > 1]
    if unknown_alias:
        return Check("tied", False, f"shared_params names parameters the checkpoint lacks: {examples(unknown_alias)}")
    if bad_ties:
        pairs = [" and ".join(g) for g in bad_ties]
        return Check("tied", False, f"config.json ties {examples(pairs)} but the checkpoint trained them as "
                                    "separate parameters; refusing to pick one")
    if shared:
        how = [f"dropped {n} (dedupe)" for n in dropped] or [f"{n} written from {s}" for n, s in shared.items()]
        return Check("tied", True, f"recorded shared_params: {examples(how)}")
    return Check("tied", True, "the checkpoint records no shared parameters")


def _train_dtype(meta: dict, where):
    """The dtype the model trained in (its module's tensors), from the saved DeepSpeed config."""
    import torch

    precision = zero.training_precision(meta.get("ds_config"))
    if precision is None:
        raise DsfixError("refused: LoRA layers to fuse, but no saved ds_config says the training dtype they were "
                         "fused in; nothing written", path=str(where))
    return getattr(torch, DTYPES[precision])


# --------------------------------------------------------------------------- the entry point


def convert_engine(path, config, output, *, tag: Optional[str] = None, dtype: str = "auto", strategy: str = "clone",
                   load: bool = True, console=None, max_shard_size: int = MAX_SHARD_SIZE,
                   progress_min_bytes: int = PROGRESS_MIN_BYTES, lora_scaling: Optional[float] = None,
                   keep_lora: bool = False) -> EngineResult:
    """Convert the engine or universal checkpoint at ``path`` into ``output``. ``lora_scaling``: DeepSpeed-Chat's
    LoRA scaling argument (default: step 1's 1), ``keep_lora``: also write the factors (:data:`lora.FILE`).
    Raises DsfixError (code 2) on bad input (nothing written); a failed check gives ``ok=False`` (nothing written)."""
    chosen = zero.choose_checkpoint(path, tag) or zero.Chosen(Path(path), tag, "")
    output = _check_args(path, output, strategy, lora_scaling)
    config, own = _config_folder(chosen, config)
    layout, meta, world = open_checkpoint(chosen.path, chosen.tag)
    cfg, cfg_check, cfg_dtype = load_config(config)
    if cfg is None:
        raise DsfixError(f"{'' if own else '--config: '}{cfg_check.detail}", path=str(config))
    out_dtype = _out_dtype(dtype, cfg_dtype)
    root = layout.folder.parent if layout.folder != chosen.path else chosen.path
    base = dict(path=str(path), output=str(output), tag=layout.tag, world=world,
                precision=zero.precision_of(layout, meta.get("ds_config")), dtype=str(out_dtype).replace("torch.", ""),
                strategy=strategy, universal=layout.universal, checkpoint=str(chosen.path), chosen=chosen.note,
                producer=zero.producer_of(root), config=str(config), config_own=own)
    checks = [cfg_check]
    plan = _plan(meta, cfg, strategy, out_dtype, checks, layout.folder)
    fusing = _lora_options(plan, meta, lora_scaling, keep_lora, layout.folder)
    if fusing is not None:
        base["lora"] = fusing
        checks.append(Check("lora", True, lora.describe(plan.lora, fusing["lora_scaling"], fusing["dtype"])))
    checks.insert(0, _source_check(layout, meta, world))
    if not all(c.ok for c in checks):
        return EngineResult(status=ConvertStatus.FAILED, ok=False, checks=tuple(checks),
                            note="a check failed before writing", stage=3 if layout.stage3 else 2, **base)
    job = _Job(layout, meta, world, plan, out_dtype, fusing, max_shard_size, console, progress_min_bytes)
    return _convert(job, config, output, load, cfg, checks, base)


def _check_args(path, output, strategy: str, lora_scaling) -> Path:
    if strategy not in STRATEGIES:
        raise DsfixError(f"--strategy must be clone or dedupe, not {strategy}")
    if lora_scaling is not None and not (isinstance(lora_scaling, (int, float)) and math.isfinite(lora_scaling)
                                         and lora_scaling > 0):
        raise DsfixError(f"--lora-scaling must be a positive number, not {lora_scaling}")
    if output is None:
        raise DsfixError("a DeepSpeed checkpoint is converted into a new folder: convert needs --output OUT_DIR "
                         "(new or empty)", path=str(path))
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DsfixError("--output exists and is not an empty folder; nothing written", path=str(output))
    if not output.parent.is_dir():
        raise DsfixError("--output: its parent folder does not exist", path=str(output))
    return output


def _config_folder(chosen, config) -> tuple[Path, bool]:
    """(the folder whose config.json, generation config and tokenizer go with the weights, whether it is the
    checkpoint's own): ``--config`` when given, else the checkpoint's folder when it holds config.json (the
    Trainer's checkpoint-N/ does); else one line saying that --config is needed, and why."""
    if config is not None:
        config = Path(config)
        if not (config / CONFIG_NAME).is_file():
            raise DsfixError(f"--config: no {CONFIG_NAME} in this folder", path=str(config))
        return config, False
    step, _, _ = zero.step_folder(chosen.path, chosen.tag)
    own = zero.config_folder(chosen.path, step)
    if own is not None:
        return own, True
    root = step.parent if step != chosen.path else chosen.path
    who = {"accelerate": "accelerate's save_state writes none", "trainer": "this checkpoint-N has none"}.get(
        zero.producer_of(root), "engine.save_checkpoint writes none")
    raise DsfixError(f"no {CONFIG_NAME} here ({who}): convert needs --config MODEL_DIR, the model's folder",
                     path=str(chosen.path))


def _lora_options(plan: Plan, meta: dict, lora_scaling, keep_lora: bool, where) -> Optional[dict]:
    """What is fused (None: no LoRA layers); --lora-scaling and --keep-lora are refused without LoRA layers."""
    if not plan.lora:
        given = [o for o, v in (("--lora-scaling", lora_scaling is not None), ("--keep-lora", keep_lora)) if v]
        if given:
            raise DsfixError(f"{' and '.join(given)}: this checkpoint holds no DeepSpeed-Chat LoRA factors "
                             f"({lora.RIGHT}/{lora.LEFT}); nothing to fuse", path=str(where))
        return None
    scaling = lora.DEFAULT_SCALING if lora_scaling is None else float(lora_scaling)
    return {"layers": len(plan.lora), "ranks": sorted({m.rank for m in plan.lora}), "lora_scaling": scaling,
            "scaling_given": lora_scaling is not None, "dtype": str(_train_dtype(meta, where)).replace("torch.", ""),
            "kept": bool(keep_lora)}


def _source_check(layout: Layout, meta: dict, world: int) -> Check:
    n_trained = sum(len(g) for g in meta["param_shapes"])
    n_frozen = len(meta.get("frozen_param_shapes") or {})
    stage = "ZeRO-3" if layout.stage3 else "ZeRO-1/2"
    if layout.universal:
        what = f"universal checkpoint of a {stage} run on {world} rank(s), one fp32 file a trained parameter"
    else:
        what = f"{stage}, {world} rank(s), {zero.precision_of(layout, meta.get('ds_config'))} optimizer states"
    return Check("source", True, f"{layout.tag}: {what}, DeepSpeed {meta.get('ds_version', '?')}; "
                                 f"{n_trained} trained + {n_frozen} frozen parameters, "
                                 f"{len(meta.get('buffer_names') or [])} buffers, "
                                 f"{len(meta.get('shared_params') or {})} shared; read weights-only")


class _Job(NamedTuple):
    """What the writing needs: the source, the plan, the output dtype and file size, the progress bar."""

    layout: Layout
    meta: dict
    world: int
    plan: Plan
    dtype: object
    lora: Optional[dict]
    limit: int
    console: object
    min_bytes: int


def _convert(job: _Job, config: Path, output: Path, load: bool, cfg, checks: list, base: dict) -> EngineResult:
    """Writes into a staging folder beside ``output``, verifies it, renames it into place; nothing left on failure.
    The staged files go to the disk (fsync) on a thread while they are checked; the rename waits for it."""
    clear_stale(output.parent, STAGING_PREFIX)  # a killed run's
    try:
        staging = make_staging(output.parent, STAGING_PREFIX)  # held until renamed or removed
    except OSError as e:
        raise DsfixError(f"cannot write here: {e.strerror or e}; nothing written", path=str(output.parent))
    try:
        with ThreadPoolExecutor(max_workers=1) as disk:
            files, stage, kept = _write(job, staging)
            _copy_config(config, staging, output)
            synced = disk.submit(fsync_folder, staging)
            source = checks[0]._replace(detail=checks[0].detail.replace("ZeRO-1/2", f"ZeRO-{stage or '1/2'}"))
            checks = [source] + _verify(staging, len(job.plan.entries), load, cfg, job.dtype, checks) + kept
            _wait_durable(synced, output)
        nbytes = sum((staging / f).stat().st_size for f in files)
        if not all(c.ok for c in checks):
            return EngineResult(status=ConvertStatus.FAILED, ok=False, checks=tuple(checks), stage=stage,
                                tensors=len(job.plan.entries), note="a check of the written folder failed", **base)
        try:
            stop_point("engine.staged")
            os.rename(staging, output)  # onto a missing or empty folder: atomic
            Written.mark()  # an interrupt from here on leaves the converted folder in place
            stop_point("engine.renamed")
        except OSError as e:
            raise DsfixError(f"cannot move the converted folder into place: {e.strerror or e}; nothing written",
                             path=str(output))
        fsync(output.parent)
        written = tuple(sorted(p.name for p in output.iterdir()))
        return EngineResult(status=ConvertStatus.CONVERTED, ok=True, checks=tuple(checks), stage=stage,
                            tensors=len(job.plan.entries), written=written, bytes_written=nbytes, **base)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        release(staging)


def _copy_config(config: Path, staging: Path, output: Path) -> None:
    """config.json, the generation config and the tokenizer from ``--config``, beside the weights."""
    for name in (CONFIG_NAME,) + COPIED:
        if (config / name).is_file():
            try:
                shutil.copyfile(config / name, staging / name)
            except OSError as e:
                raise DsfixError(f"cannot write the converted files ({name}): {e.strerror or e}; nothing written",
                                 path=str(output.parent)) from None


def _wait_durable(synced, output: Path) -> None:
    """Waits for the staged files' fsync; a failed one (EIO, ENOSPC on write-back) fails the convert."""
    try:
        synced.result()
    except OSError as e:
        raise DsfixError(f"cannot write the converted files: {e.strerror or e}; nothing written",
                         path=str(output.parent))


def _verify(folder: Path, count: int, load: bool, cfg, dtype, pre: list) -> list:
    """verify's checks on the written folder, then a from_pretrained load in the files' dtype (tied too)."""
    report = verify_folder(folder, expect=count, load=False)
    checks = list(report.checks) + [c for c in pre if c.name in ("vocab", "lora")]
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


def _write(job: _Job, staging: Path) -> tuple[list, Optional[int], list]:
    """Streams the tensors into ``staging`` (not fsynced: ``_convert`` does that while it checks them).
    Returns (file names, ZeRO stage, the --keep-lora file's check)."""
    files = _layout_files(job.plan.entries, job.limit)
    fds: list = []
    try:
        outs, total = _open_outputs(files, staging, fds)
        with _progress(job.console, total, job.min_bytes) as advance:
            sink = _Sink(job.plan.entries, outs, job.layout.folder, advance)
            stage, kept = _feed(job, staging, sink.put)
        sink.check_complete()
    except OSError as e:
        raise DsfixError(f"cannot write the converted files: {e.strerror or e}; nothing written", path=str(staging.parent))
    finally:
        for fd in fds:
            os.close(fd)
    names = [f[0] for f in files]
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted((k, f[0]) for f in files for k in f[2]))}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        names.append(INDEX_NAME)
    return names, stage, kept


def _open_outputs(files: list, staging: Path, fds: list) -> tuple[dict, int]:
    """Creates each file at its full size with its header written: ({tensor: (fd, data offset)}, data bytes)."""
    outs, total = {}, 0
    for fname, header, offsets in files:
        fd = os.open(str(staging / fname), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
        fds.append(fd)
        os.write(fd, header)
        os.ftruncate(fd, len(header) + sum(n for _, n in offsets.values()))
        for name, (start, n) in offsets.items():
            outs[name] = (fd, start)
            total += n
    return outs, total


class _Sink:
    """``put(source, first element, flat data)``: writes the data wherever it goes (the tensor, and a tied alias
    cloned from it), cast to each one's dtype, and counts every element written."""

    def __init__(self, entries: list, outs: dict, where: Path, advance):
        import torch

        self.by_source: dict = {}
        for e in entries:
            fd, start = outs[e.name]
            self.by_source.setdefault(e.source, []).append(
                (e, _Out(fd, start, e.dtype, torch.empty((), dtype=e.dtype).element_size())))
        self.entries, self.where, self.advance = entries, where, advance
        self.covered = {e.name: 0 for e in entries}

    def put(self, source: str, dst: int, data) -> None:
        cast = {}
        for entry, out in self.by_source.get(source, ()):
            if out.dtype not in cast:
                cast[out.dtype] = data.to(out.dtype).contiguous() if data.dtype != out.dtype else data.contiguous()
            chunk = cast[out.dtype]
            if dst + chunk.numel() > _numel(entry.shape):
                raise DsfixError(f"{source}: elements {dst}-{dst + chunk.numel()} lie past its shape "
                                 f"{list(entry.shape)}; the checkpoint is inconsistent", path=str(self.where))
            buf = _bytes_of(chunk)
            at, done = out.start + dst * out.itemsize, 0
            while done < len(buf):
                done += os.pwrite(out.fd, buf[done:], at + done)
            self.covered[entry.name] += chunk.numel()
            self.advance(len(buf))

    def check_complete(self) -> None:
        short = [f"{e.name} ({self.covered[e.name]} of {_numel(e.shape)} elements)" for e in self.entries
                 if self.covered[e.name] != _numel(e.shape)]
        if short:
            raise DsfixError(f"the checkpoint does not hold every element: {examples(short)}; nothing written",
                             path=str(self.where))


def _feed(job: _Job, staging: Path, put) -> tuple[Optional[int], list]:
    """Runs the checkpoint's reader into ``put``, through the LoRA fuser when there are layers to fuse.
    Returns (the ZeRO stage, the --keep-lora file's check or nothing)."""
    import torch

    read = universal.stream if job.layout.universal else zero.stream
    if not job.lora:
        return read(job.layout, job.meta, job.world, put), []
    fuser = lora.Fuser(job.plan.lora, job.plan.numels, getattr(torch, job.lora["dtype"]), job.lora["lora_scaling"],
                       put, staging / SCRATCH)
    try:
        stage = read(job.layout, job.meta, job.world, fuser.put)
        fuser.finish()
        return stage, ([_keep_factors(fuser, job, staging)] if job.lora["kept"] else [])
    finally:
        fuser.close()


def _keep_factors(fuser, job: _Job, staging: Path) -> Check:
    """--keep-lora: the factors, unfused, in the output dtype, in their own file beside the model's."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shapes = {**{m.right: (m.in_features, m.rank) for m in job.plan.lora},
              **{m.left: (m.rank, m.out_features) for m in job.plan.lora}}
    tensors = {n: fuser.factors[n].reshape(shapes[n]).to(job.dtype).contiguous() for n in sorted(shapes)}
    meta = {"format": "pt", "lora_scaling": f"{job.lora['lora_scaling']:g}",
            "layout": "DeepSpeed-Chat LinearLayer_LoRA",
            "fused_into": "the model's weights (weight += lora_scaling / r * left.T @ right.T)"}
    save_file(tensors, str(staging / lora.FILE), metadata=meta)
    with safe_open(str(staging / lora.FILE), framework="pt") as f:
        back = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if back != shapes:
        return Check("lora-file", False, f"{lora.FILE} reads back {len(back)} tensors, not the {len(shapes)} written")
    return Check("lora-file", True, f"{lora.FILE}: {len(back)} factors of {len(job.plan.lora)} layers, unfused, "
                                    f"{str(job.dtype).replace('torch.', '')}")


@contextmanager
def _progress(console, total: int, min_bytes: int):
    """advance(nbytes): progress on ``console`` (a bar on a terminal, else plain lines) when the data is large."""
    with Progress(console, "dsfix convert", total=total, min_total=min_bytes) as bar:
        bar.phase("converting (rank by rank)")
        yield bar.advance
