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
from patcher.errors import DsfixError


def base_weights(config: dict, base: Optional[Path]) -> Path:
    """The base model's folder to merge into (:func:`patcher.checkpoint.readers.peft.base_folder`)."""
    from patcher.checkpoint.readers.peft import base_folder

    found, _ = base_folder(config, base)
    if found is None:
        named = str(config.get("base_model_name_or_path") or "")
        where = f"base_model_name_or_path {named} is neither a folder here nor in the Hugging Face cache" if named \
            else "adapter_config.json names no base model"
        raise DsfixError(f"--merge needs the base model's weights: {where}; pass --base BASE_DIR")
    if not (found / CONFIG_NAME).is_file():
        raise DsfixError(f"--merge: the base model folder has no {CONFIG_NAME}", path=str(found))
    return found


def reader_of(adapter: Any, config: dict, adapter_dir: Path, base: Optional[Path], merge: bool) -> tuple:
    """(the reader to write, the Model the written folder must hold, the folder its config files come from) for the
    adapter held by ``adapter`` (a reader of PEFT's saved names: a run's engine files, or an adapter folder)."""
    from patcher.checkpoint.check.adapter import adapter_model
    from patcher.checkpoint.check.model import model_of
    from patcher.checkpoint.readers.safetensors import SafetensorsFolder
    from patcher.checkpoint.steps.merge import MergedLoRA, refusal

    if not merge:
        return adapter, adapter_model(adapter_dir, base, config), adapter_dir
    why = refusal(config)  # before a byte of the adapter is read
    if why is not None:
        raise DsfixError(f"--merge: {why}, which dsfix does not merge; the adapter itself converts without --merge")
    folder = base_weights(config, base)
    tensors = adapter.read(list(adapter.tensors))
    base_reader = SafetensorsFolder(folder)
    return MergedLoRA(base_reader, tensors, config, adapter.name), model_of(folder), folder
