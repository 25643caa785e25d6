"""``dsfix convert`` of a PEFT LoRA run: the adapter recovered from the engine files, or merged into its base.

A Trainer's (or TRL's) ``checkpoint-N`` of a PEFT run holds ``adapter_config.json`` beside the engine files; its
own ``adapter_model.safetensors`` is empty after ZeRO-3. :func:`reader_of` gives what to write: the adapter
(:class:`patcher.checkpoint.readers.peft.PeftRun`), written as PEFT's ``save_pretrained`` would have written it
(``adapter_model.safetensors``, ``adapter_config.json``, the model card and the tokenizer), or with ``--merge``
the base model with the adapter merged in (:class:`patcher.checkpoint.steps.merge.MergedLoRA`), written as a
model folder (the base's config, generation config and tokenizer). An adapter folder (``adapter_config.json``
and a non-empty ``adapter_model.safetensors``) merges the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.names import CONFIG_NAME
from patcher.checkpoint.readers.peft import ADAPTER_CONFIG
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


def peft_run(engine: Any, config: dict, adapter_dir: Path, base: Optional[Path]) -> tuple:
    """(the adapter of a PEFT run's engine files, a :class:`patcher.checkpoint.readers.peft.PeftRun`; the Model it
    must make): the names PEFT saves each parameter under come from PEFT itself, on the base model's config."""
    from patcher.checkpoint.check.adapter import adapter_model, peft_model, saved_names
    from patcher.checkpoint.readers.peft import PeftRun, adapter_name

    model = adapter_model(adapter_dir, base, config)
    if model.cfg is None:
        why = model.base_row.detail if model.base_row is not None else "no base model"
        raise DsfixError(f"the adapter's names come from PEFT on its base model: {why}",
                         path=str(adapter_dir))
    trained = [n for group in engine.meta["param_shapes"] for n in group]
    try:
        adapter = adapter_name(trained, config)
        names = saved_names(peft_model(config, model.cfg, adapter=adapter), adapter)
    except DsfixError as e:
        raise DsfixError(e.message, path=str(engine.folder)) from None
    except Exception as e:  # PEFT refuses the config on this base
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        raise DsfixError(f"PEFT cannot build the model of {ADAPTER_CONFIG} on its base: {why}",
                         path=str(adapter_dir)) from None
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
    from patcher.checkpoint.steps.merge import MergedLoRA, refusal

    if not merge:
        return adapter, model if model is not None else adapter_model(adapter_dir, base, config), adapter_dir
    why = refusal(config)  # before a byte of the adapter is read
    if why is not None:
        raise DsfixError(f"--merge: {why}, which dsfix does not merge; the adapter itself converts without --merge")
    folder = base_weights(config, base)
    tensors = adapter.read(list(adapter.tensors))
    base_reader = SafetensorsFolder(folder)
    return MergedLoRA(base_reader, tensors, config, adapter.name), model_of(folder), folder
