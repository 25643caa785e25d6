"""``dsfix convert`` of a PEFT run: the adapter recovered from the engine files, or merged into its base.

A Trainer's (or TRL's) ``checkpoint-N`` of a PEFT run holds ``adapter_config.json`` beside the engine files; its
own ``adapter_model.safetensors`` is empty after ZeRO-3. accelerate's ``save_state`` folder holds none: it comes
from ``--config ADAPTER_DIR``, or from the one folder beside the state folder whose PEFT model saves the engine's
parameters (:func:`adapter_beside`). :func:`reader_of` gives what to write: the adapter
(:class:`patcher.checkpoint.readers.peft.PeftRun`), written as PEFT's ``save_pretrained`` would have written it
(``adapter_model.safetensors``, ``adapter_config.json``, the model card and the tokenizer), or with ``--merge``
the base model with the adapter merged in by PEFT's own layers (:class:`patcher.checkpoint.steps.merge.MergedPeft`),
written as a model folder (the base's config, generation config and tokenizer). An adapter folder
(``adapter_config.json`` and a non-empty ``adapter_model.safetensors``) merges the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.names import CONFIG_NAME, examples
from patcher.checkpoint.readers.peft import ADAPTER_CONFIG, PREFIX
from patcher.errors import DsfixError


def base_weights(config: dict, base: Optional[Path], why: str = "--merge needs") -> Path:
    """The base model's folder to read weights from (:func:`patcher.checkpoint.readers.peft.base_folder`): to merge
    into, or the frozen tensors PEFT's file holds."""
    from patcher.checkpoint.readers.peft import base_folder

    found, _ = base_folder(config, base)
    if found is None:
        named = str(config.get("base_model_name_or_path") or "")
        where = f"base_model_name_or_path {named} is neither a folder here nor in the Hugging Face cache" if named \
            else "adapter_config.json names no base model"
        raise DsfixError(f"{why} the base model's weights: {where}; pass --base BASE_DIR")
    if not (found / CONFIG_NAME).is_file():
        raise DsfixError(f"{why} the base model's weights, but the base model folder has no {CONFIG_NAME}",
                         path=str(found))
    return found


def given_adapter(path: Path, step: Path, config: Any) -> tuple:
    """(the folder of the run's adapter_config.json or None, ``--config`` left for the model, how it was found):
    beside the engine files (the Trainer's checkpoint-N), or ``--config ADAPTER_DIR`` (accelerate's save_state,
    whose state folder holds none)."""
    from patcher.checkpoint.readers.find import adapter_folder

    beside = adapter_folder(path, step)
    if beside is None and config is not None and (Path(config) / ADAPTER_CONFIG).is_file():
        return Path(config), None, f"--config {config}"
    return beside, config, ""


def trained_names(engine: Any) -> list:
    """The names of the parameters the engine trained (DeepSpeed's ``param_shapes``)."""
    return [n for group in (getattr(engine, "meta", None) or {}).get("param_shapes", ()) for n in group]


def is_peft_engine(engine: Any) -> bool:
    """Whether the engine trained a PEFT model's parameters (each under PeftModel's ``base_model.model.``)."""
    trained = trained_names(engine)
    return bool(trained) and all(n.startswith(PREFIX) for n in trained)


def adapter_beside(engine: Any, root: Path, base: Optional[Path]) -> tuple:
    """(the one folder beside the checkpoint ``root`` whose adapter_config.json's PEFT model saves every parameter
    the engine trained, in its shape; how it was found); else one line naming ``--config ADAPTER_DIR``. Folders
    holding the same adapter_config.json (a converted copy) count as one."""
    from patcher.checkpoint.readers.find import adapter_configs_beside
    from patcher.checkpoint.readers.peft import read_adapter_config

    found = []
    for folder in adapter_configs_beside(root):
        try:
            names, _, model = saved_names_of(engine, read_adapter_config(folder) or {}, folder, base)
        except DsfixError:
            continue
        shapes = model.expected.shapes if model.expected is not None else {}
        if all(shapes.get(names.get(n)) == tuple(engine.tensors[n].shape) for n in trained_names(engine)):
            found.append(folder)
    if len({(f / ADAPTER_CONFIG).read_bytes() for f in found}) == 1:  # one config (a converted copy is the same)
        return found[0], (f"{found[0]}: beside the checkpoint, the one whose PEFT model saves its parameters"
                          + (f" (and {len(found) - 1} copy of it elsewhere)" if len(found) == 2 else
                             f" (and {len(found) - 1} copies of it elsewhere)" if len(found) > 2 else ""))
    what = f"{len(found)} beside them match ({examples(found)})" if found else "none beside them matches"
    raise DsfixError(f"engine files of a PEFT model (accelerate's save_state?), no {ADAPTER_CONFIG} here, {what}: "
                     "pass --config ADAPTER_DIR, the folder of the run's save_pretrained", path=str(root))


def saved_names_of(engine: Any, config: dict, adapter_dir: Path, base: Optional[Path]) -> tuple:
    """({PEFT model's key: PEFT's saved name}, the adapter's name, the Model it must make) for the engine files'
    adapter of ``config``, from PEFT itself on the base model's config."""
    from patcher.checkpoint.check.adapter import adapter_model, peft_model, saved_names
    from patcher.checkpoint.readers.peft import adapter_name

    model = adapter_model(adapter_dir, base, config)
    if model.cfg is None:
        why = model.base_row.detail if model.base_row is not None else "no base model"
        raise DsfixError(f"the adapter's names come from PEFT on its base model: {why}", path=str(adapter_dir))
    try:
        adapter = adapter_name(trained_names(engine), config)
        return saved_names(peft_model(config, model.cfg, adapter=adapter), adapter), adapter, model
    except DsfixError as e:
        raise DsfixError(e.message, path=str(engine.folder)) from None
    except Exception as e:  # PEFT refuses the config on this base
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        raise DsfixError(f"PEFT cannot build the model of {ADAPTER_CONFIG} on its base: {why}",
                         path=str(adapter_dir)) from None


def peft_run(engine: Any, config: dict, adapter_dir: Path, base: Optional[Path]) -> tuple:
    """(the adapter of a PEFT run's engine files, a :class:`patcher.checkpoint.readers.peft.PeftRun`; the Model it
    must make): the names PEFT saves each parameter under come from PEFT itself, on the base model's config."""
    from patcher.checkpoint.readers.peft import PeftRun

    names, _, model = saved_names_of(engine, config, adapter_dir, base)
    run = PeftRun(engine, config, adapter_dir, names)
    if run.untrained:
        from patcher.checkpoint.readers.safetensors import SafetensorsFolder

        run.take_frozen(SafetensorsFolder(base_weights(config, base, "this adapter (an embedding LoRA) needs")))
    return run, model


def reader_of(adapter: Any, config: dict, adapter_dir: Path, base: Optional[Path], merge: bool,
              model: Any = None) -> tuple:
    """(the reader to write, the Model the written folder must hold, the folder its config files come from) for the
    adapter held by ``adapter`` (a reader of PEFT's saved names: a run's engine files, or an adapter folder;
    ``model``: the Model it must make, when known)."""
    from patcher.checkpoint.check.adapter import adapter_model
    from patcher.checkpoint.check.model import model_of
    from patcher.checkpoint.readers.safetensors import SafetensorsFolder
    from patcher.checkpoint.steps.merge import MergedPeft

    model = model if model is not None else adapter_model(adapter_dir, base, config)
    if not merge:
        return adapter, model, adapter_dir
    folder = base_weights(config, base)
    if model.cfg is None:
        why = model.base_row.detail if model.base_row is not None else "no base model"
        raise DsfixError(f"--merge: the base model's config: {why}", path=str(folder))
    tensors = adapter.read(list(adapter.tensors))
    tensors.update({alias: tensors[partner] for alias, partner in adapter.aliases.items() if partner in tensors})
    base_reader = SafetensorsFolder(folder)
    try:
        merged = MergedPeft(base_reader, tensors, config, model.cfg, adapter.name)
    except BaseException:
        base_reader.close()
        raise
    return merged, model_of(folder), folder
