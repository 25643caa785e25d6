"""``dsfix convert PATH``: what PATH holds decides the reader; one pipeline writes every kind.

* a DeepSpeed checkpoint (``latest`` and ``global_stepN/``, a universal checkpoint, a Trainer's ``checkpoint-N``
  or run folder, accelerate's ``save_state``): its step's reader (:func:`patcher.checkpoint.readers.open_step`),
  DeepSpeed-Chat LoRA factors fused (:mod:`patcher.checkpoint.steps.lora`), into a new folder ``--output`` with
  the config, generation config and tokenizer of the checkpoint's own folder or ``--config``;
* a ``.bin`` output folder (``pytorch_model.bin`` or its index beside ``config.json``, or a step-3 folder of
  them): each converted in place, all folders or none, the ``.bin`` kept unless ``--remove-bin``; with
  ``--output``, into that new folder as a checkpoint is;
* ``pytorch_model.bin`` alone (DeepSpeed's ``save_16bit_model``, ``zero_to_fp32``): into ``--output``, with the
  config, generation config and tokenizer of ``--config``; without them, one line says so;
* a Hugging Face model folder already (a Trainer run folder's chosen ``checkpoint-N`` too): nothing to convert,
  whatever the options; ``dsfix verify`` checks it.

Then, for each: the plan against the config's model (:func:`patcher.checkpoint.write.plan.make_plan`; a failed
check writes nothing, exit 1), and :func:`patcher.checkpoint.write.write`: staged, checked as ``dsfix verify``
checks a folder, loaded, and committed. Every argument and the input's shape are checked before torch is
imported; third-party bars and warnings are off meanwhile.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.convert.peft import adapter_beside, given_adapter, is_peft_engine, peft_run
from patcher.checkpoint.convert.peft import reader_of as peft_reader_of
from patcher.checkpoint.convert.report import (
    BIN_ALONE,
    BIN_FOLDER,
    CheckpointResult,
    ConvertReport,
    ConvertStatus,
    EmptyAdapterResult,
    FolderResult,
    ModelFolderResult,
)
from patcher.checkpoint.names import (
    BIN_INDEX_NAME,
    BIN_NAME,
    CONFIG_NAME,
    INDEX_NAME,
    SINGLE_NAME,
    STAGING_PREFIX,
    examples,
)
from patcher.checkpoint.readers.bin import BinFolder, bin_files
from patcher.checkpoint.readers.find import (
    Chosen,
    adapter_configs_beside,
    choose_checkpoint,
    choose_model_folder,
    config_for,
    contents,
    given_config,
    is_engine_checkpoint,
    model_folders,
    producer_of,
    run_checkpoints,
    step_folder,
)
from patcher.checkpoint.write import PROGRESS_MIN_BYTES, Job, write
from patcher.checkpoint.write.files import clear_stale, fsync
from patcher.checkpoint.write.plan import STRATEGIES
from patcher.checkpoint.write.writer import MAX_SHARD_SIZE
from patcher.errors import DsfixError, need_folder


def convert(path, *, output=None, config=None, tag: Optional[str] = None, dtype: str = "auto",
            strategy: str = "clone", remove_bin: bool = False, load: bool = True, lora_scaling: Optional[float] = None,
            keep_lora: bool = False, base=None, merge: bool = False, console: Any = None,
            max_shard_size: int = MAX_SHARD_SIZE, progress_min_bytes: int = PROGRESS_MIN_BYTES) -> Any:
    """Convert what ``path`` holds (see the module docstring). Raises DsfixError (code 2) on bad input, nothing
    written; a failed check gives a result that is not ``ok`` (exit 1), nothing written."""
    need_folder(path)
    if strategy not in STRATEGIES:
        raise DsfixError(f"--strategy must be clone or dedupe, not {strategy}")
    model = model_folder(path, tag)
    if model is not None:
        return model
    for option in (config, base):
        if option is not None:
            need_folder(option)
    into = dict(output=output, tag=tag, dtype=dtype, strategy=strategy, load=load, base=base, merge=merge,
                console=console, max_shard_size=max_shard_size, progress_min_bytes=progress_min_bytes)
    bins = any((f / n).is_file() for f in model_folders(path) for n in (BIN_NAME, BIN_INDEX_NAME))
    if is_engine_checkpoint(path) or (not bins and run_checkpoints(path)):
        if remove_bin:
            raise DsfixError("--remove-bin is for .bin output folders; a DeepSpeed checkpoint is left as it is")
        return convert_checkpoint(path, config, lora_scaling=lora_scaling, keep_lora=keep_lora, **into)
    if is_adapter_folder(path):
        return convert_adapter_folder(path, **into)
    if bins and into_output(path, config, output, remove_bin):
        return convert_bin(path, config, lora_scaling=lora_scaling, keep_lora=keep_lora, **into)
    if bins:
        _in_place_options(path, config=config, output=output, tag=tag, dtype=dtype, lora_scaling=lora_scaling,
                          keep_lora=keep_lora, base=base, merge=merge)
    return convert_in_place(path, strategy=strategy, remove_bin=remove_bin, load=load, console=console,
                            max_shard_size=max_shard_size, progress_min_bytes=progress_min_bytes)


def _no_checkpoint_options(path, tag, lora_scaling, keep_lora, base, merge) -> None:
    """A .bin folder has no steps, no LoRA factors to fuse and no adapter: --tag, --lora-scaling, --keep-lora,
    --base and --merge are refused."""
    given = [n for n, v in (("--tag", tag), ("--lora-scaling", lora_scaling), ("--keep-lora", keep_lora or None),
                            ("--base", base), ("--merge", merge or None)) if v is not None]
    if given:
        raise DsfixError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for DeepSpeed checkpoints "
                         "(latest, checkpoint-N/), not a .bin folder", path=str(path))


def _in_place_options(path, *, config, output, tag, dtype, lora_scaling, keep_lora, base, merge) -> None:
    """A .bin folder converted in place takes none of the options of a conversion into a new folder."""
    _no_checkpoint_options(path, tag, lora_scaling, keep_lora, base, merge)
    given = [n for n, v in (("--config", config), ("--output", output)) if v is not None] + \
        (["--dtype"] if dtype != "auto" else [])
    if not given:
        return
    if model_folders(path) != [Path(path)]:
        raise DsfixError(f"{', '.join(given)}: a step-3 folder's actor/, critic/, actor_ema/ are converted in place, "
                         "without options", path=str(path))
    raise DsfixError(f"{', '.join(given)} goes with --output OUT; without it a .bin folder is converted in place, in "
                     "its own dtype", path=str(path))


# --------------------------------------------------------------------------- a Hugging Face model folder already


def model_folder(path, tag: Optional[str] = None) -> Optional[ModelFolderResult]:
    """Nothing to convert where ``path`` already is a Hugging Face model folder, or is a Trainer run folder whose
    chosen ``checkpoint-N`` is one (``save_only_model``, a run without DeepSpeed): the same answer whatever the
    options, naming ``dsfix verify``. None where there is something to convert. From file names (no torch)."""
    chosen = choose_model_folder(path, tag)
    if chosen is None:
        return None
    weights = tuple(n for n in (SINGLE_NAME, INDEX_NAME) if (chosen.path / n).is_file())
    return ModelFolderResult(str(path), str(chosen.path), weights, chosen.note)


# --------------------------------------------------------------------------- a DeepSpeed checkpoint, into --output


def convert_checkpoint(path, config, *, output=None, tag: Optional[str] = None, dtype: str = "auto",
                       strategy: str = "clone", load: bool = True, lora_scaling: Optional[float] = None,
                       keep_lora: bool = False, base=None, merge: bool = False, console: Any = None,
                       max_shard_size: int = MAX_SHARD_SIZE,
                       progress_min_bytes: int = PROGRESS_MIN_BYTES) -> CheckpointResult:
    """An engine or universal checkpoint (or a Trainer run folder's chosen ``checkpoint-N``) into ``output``: the
    model, or a PEFT run's adapter (merged into its base with ``merge``)."""
    from patcher.checkpoint.quiet import quiet
    from patcher.checkpoint.readers import open_step
    from patcher.checkpoint.readers.peft import read_adapter_config
    from patcher.checkpoint.steps import lora

    chosen = choose_checkpoint(path, tag) or Chosen(Path(path), tag, "")
    output = _check_output(path, output, lora_scaling)
    step, step_tag, _ = step_folder(chosen.path, chosen.tag)
    root = step.parent if step != chosen.path else chosen.path
    peft, config, found = given_adapter(chosen.path, step, config)
    # where no adapter_config.json is beside or near, a missing config or a PEFT option is refused before torch
    late = peft is None and bool(adapter_configs_beside(root))
    _check_peft_options(peft, config, base, merge, lora_scaling, keep_lora, late)
    config, own = config_for(chosen, config) if peft is None and not late else (config, False)
    with quiet():
        source = open_step(step, step_tag)
        if peft is None and is_peft_engine(source):  # accelerate's save_state: adapter_config.json beside, or one line
            peft, found = adapter_beside(source, root, base)
            _check_peft_options(peft, config, base, merge, lora_scaling, keep_lora)
        if peft is not None:
            adapter = read_adapter_config(peft) or {}
            run, model = peft_run(source, adapter, peft, base)
            reader, model, config = peft_reader_of(run, adapter, peft, base, merge, model)
        else:
            if late:
                _check_peft_options(peft, config, base, merge, lora_scaling, keep_lora)
                config, own = config_for(chosen, config)
            model = _config_model(source, config, own)
            reader = lora.fused(source, lora_scaling, keep_lora)
        described = CheckpointResult(
            path=str(path), output=str(output), status=ConvertStatus.FAILED, ok=False, kind=_kind(source, peft, merge),
            tag=source.tag, world=source.world, stage=source.stage, precision=source.precision, strategy=strategy,
            checkpoint=str(chosen.path), chosen=chosen.note, producer=producer_of(root), config=str(config),
            config_own=own, lora=reader.info() if isinstance(reader, lora.FusedLoRA) else None, adapter_from=found)
        return _into_output(reader, model, output, config, dtype, described, load=load, console=console,
                            max_shard_size=max_shard_size, progress_min_bytes=progress_min_bytes)


def _config_model(reader: Any, config: Path, own: bool) -> Any:
    """The Model that ``config`` (the checkpoint's own folder, or ``--config``) says ``reader``'s tensors make (a
    causal LM or a critic, from their names). Raises DsfixError when transformers cannot read the config."""
    from patcher.checkpoint.check.model import folder_kind, model_of

    model = model_of(config, folder_kind(list(reader.tensors) + list(reader.aliases)))
    if model.cfg is None:
        raise DsfixError(f"{'' if own else '--config: '}{model.config_row.detail}", path=str(config))
    return model


def _kind(source: Any, peft: Optional[Path], merge: bool) -> str:
    if peft is not None:
        return "peft-merged" if merge else "peft-adapter"
    return "deepspeed-universal-checkpoint" if source.kind == "universal" else "deepspeed-engine-checkpoint"


def _check_peft_options(peft: Optional[Path], config, base, merge: bool, lora_scaling, keep_lora: bool,
                        later: bool = False) -> None:
    """--base and --merge are a PEFT run's; --config, --lora-scaling and --keep-lora are not (``later``: whether it
    is a PEFT run is not known yet)."""
    if later:
        return
    if peft is None:
        given = [o for o, v in (("--base", base is not None), ("--merge", merge)) if v]
        if given:
            raise DsfixError(f"{' and '.join(given)}: for a PEFT run, whose adapter_config.json is beside the engine "
                             "files or given by --config ADAPTER_DIR; this checkpoint has none")
        return
    given = [o for o, v in (("--config", config is not None), ("--lora-scaling", lora_scaling is not None),
                            ("--keep-lora", keep_lora)) if v]
    if given:
        raise DsfixError(f"{' and '.join(given)}: not for a PEFT run, whose adapter_config.json names its base "
                         "model (--base to give another)", path=str(peft))


def _into_output(reader: Any, model: Any, output: Path, config: Path, dtype: str, described: CheckpointResult, *,
                 load: bool, console: Any, max_shard_size: int, progress_min_bytes: int) -> CheckpointResult:
    """Plan ``reader``'s tensors as ``model`` says, write them into the new folder ``output`` with ``config``'s
    files; ``described``: the result as it reads before anything is written."""
    from patcher.checkpoint.write.plan import make_plan, out_dtype

    written_dtype = out_dtype(dtype, model.dtype, reader)
    plan = make_plan(reader, model, described.strategy, written_dtype)
    plan.checks.extend(reader.checks())
    dtype_name = str(written_dtype or plan.floating_dtype or "").replace("torch.", "")  # a .bin keeps its own
    failed = replace(described, checks=tuple(plan.checks), dtype=dtype_name, note="a check failed before writing")
    if not plan.ok:
        return failed
    done = write([Job(reader, output, False, config, plan, load, max_shard_size)], console, progress_min_bytes)[0]
    if not done.ok:
        return replace(failed, checks=tuple(done.checks), tensors=len(plan.entries),
                       note="a check of the written folder failed")
    return replace(failed, status=ConvertStatus.CONVERTED, ok=True, checks=tuple(done.checks), note="",
                   tensors=len(plan.entries), written=tuple(done.names), bytes_written=done.nbytes)


# --------------------------------------------------------------------------- a PEFT adapter folder


def is_adapter_folder(path) -> bool:
    """A PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``, no engine files)."""
    from patcher.checkpoint.readers.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    return (Path(path) / ADAPTER_CONFIG).is_file() and (Path(path) / ADAPTER_WEIGHTS).is_file()


def convert_adapter_folder(path, *, output=None, tag: Optional[str] = None, dtype: str = "auto",
                           strategy: str = "clone", load: bool = True, base=None, merge: bool = False,
                           console: Any = None, max_shard_size: int = MAX_SHARD_SIZE,
                           progress_min_bytes: int = PROGRESS_MIN_BYTES) -> Any:
    """An adapter folder: nothing to convert (it is what PEFT loads), or with ``merge`` its base model with the
    adapter merged in, into ``output``."""
    from patcher.checkpoint.check.adapter import empty_cause, recovery
    from patcher.checkpoint.quiet import quiet
    from patcher.checkpoint.readers.peft import ADAPTER_WEIGHTS, read_adapter_config
    from patcher.checkpoint.readers.safetensors import SafetensorsFolder

    with SafetensorsFolder(Path(path), single=ADAPTER_WEIGHTS) as held:
        cause = empty_cause(held.header)
    if cause:  # PEFT's save of ZeRO-3's partitions: never called an adapter
        return EmptyAdapterResult(str(path), cause, recovery(Path(path)))
    if not merge:
        note = f"it is a PEFT adapter folder already ({ADAPTER_WEIGHTS}); check it with dsfix verify {path}"
        return ConvertReport(str(path), strategy, (FolderResult(str(path), ConvertStatus.NOTHING, True, note=note,
                                                                strategy=strategy),))
    output = _check_output(path, output, None, "--merge writes the merged model")
    adapter = read_adapter_config(Path(path)) or {}
    with quiet():
        held = SafetensorsFolder(Path(path), single=ADAPTER_WEIGHTS)
        reader, model, config = peft_reader_of(held, adapter, Path(path), base, True)
        described = CheckpointResult(path=str(path), output=str(output), status=ConvertStatus.FAILED, ok=False,
                                     kind="peft-merged", tag=ADAPTER_WEIGHTS, strategy=strategy, checkpoint=str(path),
                                     config=str(config))
        return _into_output(reader, model, output, config, dtype, described, load=load, console=console,
                            max_shard_size=max_shard_size, progress_min_bytes=progress_min_bytes)


# --------------------------------------------------------------------------- a .bin folder, into --output


def into_output(path, config, output, remove_bin: bool) -> bool:
    """Whether the ``.bin`` folder ``path`` is converted into a new folder: it has ``--output`` (and its own
    config.json or ``--config``). ``pytorch_model.bin`` alone (save_16bit_model, zero_to_fp32) needs both, and
    gets one line saying so; a step-3 folder is converted in place. From file names (no torch)."""
    folder = Path(path)
    if model_folders(folder) != [folder]:
        return False
    bin_files(folder)  # a broken index is refused first
    own = (folder / CONFIG_NAME).is_file()
    if not own and (config is None or output is None):
        name = BIN_INDEX_NAME if (folder / BIN_INDEX_NAME).is_file() else BIN_NAME
        raise DsfixError(f"no {CONFIG_NAME} beside {name}, as save_16bit_model writes it: add --config MODEL_DIR "
                         "--output OUT", path=str(path))
    if output is None and config is not None:
        raise DsfixError("--config goes with --output OUT; without it this .bin folder is converted in place, with "
                         f"its own {CONFIG_NAME}", path=str(path))
    if output is not None and remove_bin:
        raise DsfixError("--remove-bin is for a .bin folder converted in place; into --output it is left as it is",
                         path=str(path))
    return output is not None


def convert_bin(path, config, *, output=None, tag: Optional[str] = None, dtype: str = "auto", strategy: str = "clone",
                load: bool = True, lora_scaling: Optional[float] = None, keep_lora: bool = False, base=None,
                merge: bool = False, console: Any = None, max_shard_size: int = MAX_SHARD_SIZE,
                progress_min_bytes: int = PROGRESS_MIN_BYTES) -> CheckpointResult:
    """A ``.bin`` folder into ``output``, with the config, generation config and tokenizer of ``--config`` or its
    own folder: the checkpoint's pipeline (:func:`_into_output`), read by :class:`BinFolder`."""
    from patcher.checkpoint.quiet import quiet

    _no_checkpoint_options(path, tag, lora_scaling, keep_lora, base, merge)
    folder = Path(path)
    kind = BIN_FOLDER if (folder / CONFIG_NAME).is_file() else BIN_ALONE
    output = _check_output(path, output, None)
    config, own = (given_config(config), False) if config is not None else (folder, True)
    with quiet():
        reader = BinFolder(folder)
        model = _config_model(reader, config, own)
        described = CheckpointResult(path=str(path), output=str(output), status=ConvertStatus.FAILED, ok=False,
                                     kind=kind, strategy=strategy, checkpoint=str(path), config=str(config),
                                     config_own=own, sources=tuple(reader.sources))
        return _into_output(reader, model, output, config, dtype, described, load=load, console=console,
                            max_shard_size=max_shard_size, progress_min_bytes=progress_min_bytes)


def _check_output(path, output, lora_scaling, what: str = "a DeepSpeed checkpoint is converted") -> Path:
    import math

    if lora_scaling is not None and not (isinstance(lora_scaling, (int, float)) and math.isfinite(lora_scaling)
                                         and lora_scaling > 0):
        raise DsfixError(f"--lora-scaling must be a positive number, not {lora_scaling}")
    if output is None:
        raise DsfixError(f"{what} into a new folder: convert needs --output OUT_DIR (new or empty)", path=str(path))
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DsfixError("--output exists and is not an empty folder; nothing written", path=str(output))
    if not output.parent.is_dir():
        raise DsfixError("--output: its parent folder does not exist", path=str(output))
    return output


# --------------------------------------------------------------------------- .bin folders, in place


def convert_in_place(path, *, strategy: str = "clone", remove_bin: bool = False, load: bool = True,
                     console: Any = None, max_shard_size: int = MAX_SHARD_SIZE,
                     progress_min_bytes: int = PROGRESS_MIN_BYTES) -> ConvertReport:
    """Every model folder under ``path`` (a step-3 folder's actor/, critic/, actor_ema/): all or none."""
    from patcher.checkpoint.check.model import folder_kind, model_of
    from patcher.checkpoint.quiet import quiet
    from patcher.checkpoint.write.plan import make_plan

    folders = model_folders(path)
    already = {folder: _already(folder) for folder in folders}
    for folder in folders:  # a killed run's staging folder, even where there is nothing left to convert
        clear_stale(folder, STAGING_PREFIX)
    results: dict = {f: FolderResult(str(f), ConvertStatus.NOTHING, True, note=why, strategy=strategy)
                     for f, why in already.items() if why is not None}
    if len(results) == len(folders):
        return ConvertReport(str(path), strategy, tuple(results[f] for f in folders))
    with quiet():
        jobs = []
        for folder in (f for f in folders if already[f] is None):
            reader = BinFolder(folder)
            model = model_of(folder, folder_kind(reader.tensors))
            plan = make_plan(reader, model, strategy, None)
            jobs.append(Job(reader, folder, True, folder, plan, load, max_shard_size))
        staged = write(jobs, console, progress_min_bytes) if all(job.plan.ok for job in jobs) else []
    for job in jobs:
        if not job.plan.ok:
            results[job.target] = _folder_result(job, strategy, ConvertStatus.FAILED, job.plan.checks)
    for done in staged:
        if not done.ok:
            results[done.job.target] = _folder_result(done.job, strategy, ConvertStatus.FAILED, done.checks)
    if any(r.status is ConvertStatus.FAILED for r in results.values()):
        for job in jobs:
            results.setdefault(job.target, _folder_result(job, strategy, ConvertStatus.NOT_WRITTEN))
    else:
        for done in staged:
            removed = _remove_bins(done.job.target, done.job.reader) if remove_bin else ()
            results[done.job.target] = _folder_result(done.job, strategy, ConvertStatus.CONVERTED, done.checks,
                                                      written=done.names, nbytes=done.nbytes, removed=removed)
    return ConvertReport(str(path), strategy, tuple(results[f] for f in folders))


def _already(folder: Path) -> Optional[str]:
    """Why there is nothing to convert in ``folder`` (None: its .bin is to be converted), from file names (no
    torch). Raises DsfixError (code 2) on bad input."""
    st_name = next((n for n in (SINGLE_NAME, INDEX_NAME) if (folder / n).is_file()), None)
    if (folder / BIN_INDEX_NAME).is_file() or (folder / BIN_NAME).is_file():
        source = bin_files(folder)
    elif st_name is not None:
        return f"it is already safetensors ({st_name})"
    else:
        others = sorted(p.name for p in folder.glob("*.bin"))
        found = f"; found only {examples(others)}" if others else f"; found {contents(folder)}"
        raise DsfixError(f"no {BIN_NAME} (also not in actor/, critic/, actor_ema/), no latest, no checkpoint-N/{found}",
                         path=str(folder))
    if st_name is not None:
        return f"{st_name} is already there beside {examples(source)} (remove it to convert again)"
    if not (folder / CONFIG_NAME).is_file():
        raise DsfixError(f"no {CONFIG_NAME}: convert needs the model's config to check the weights", path=str(folder))
    return None


def _folder_result(job: Job, strategy: str, status: ConvertStatus, checks: Optional[list] = None,
                   written: tuple = (), nbytes: int = 0, removed: tuple = ()) -> FolderResult:
    plan, reader = job.plan, job.reader
    assert isinstance(reader, BinFolder)
    result = FolderResult(str(job.target), status, status is ConvertStatus.CONVERTED, tuple(checks or ()),
                          kind=plan.kind, strategy=strategy, source=tuple(reader.sources))
    if status is ConvertStatus.NOT_WRITTEN:
        return replace(result, note="another folder failed a check; nothing written")
    if status is ConvertStatus.FAILED:
        return replace(result, mmap=reader.mmap, tensors=len(plan.entries) or None)
    return replace(result, written=tuple(written), tensors=len(plan.entries), restored=tuple(plan.restored),
                   dropped=tuple(plan.dropped), removed=tuple(removed), bytes_written=nbytes, mmap=reader.mmap)


def _remove_bins(folder: Path, reader: Any) -> tuple:
    names = list(reader.sources) + ([BIN_INDEX_NAME] if reader.sharded else [])
    removed = []
    for name in names:
        try:
            (folder / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise DsfixError(f"converted, but cannot remove {name}: {e.strerror or e}", path=str(folder)) from e
    fsync(folder)
    return tuple(removed)
