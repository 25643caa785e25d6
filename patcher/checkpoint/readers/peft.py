"""A PEFT LoRA run: its adapter, read from the engine files of the checkpoint when PEFT's own file is empty.

The Hugging Face Trainer (and TRL's, and accelerate's loops) save a PEFT model's ``checkpoint-N/`` with
``adapter_config.json``, ``adapter_model.safetensors`` and the engine's files (``global_stepN/``). Under
DeepSpeed ZeRO-3 PEFT reads the partitioned parameters without gathering them, so its
``adapter_model.safetensors`` holds **0 tensors** (40 bytes); the trained adapter survives only in the engine
files, which the Trainer writes with ``exclude_frozen_parameters=True``: ``param_shapes`` holds the adapter's
parameters alone (``...q_proj.lora_A.default.weight``), their fp32 masters are in the optimizer files, and the
model_states' ``module`` keeps each one's dtype (the full tensor below ZeRO-3, an empty placeholder at ZeRO-3).

:class:`PeftRun` wraps that checkpoint's engine reader: it holds the trained parameters under the names PEFT's
``get_peft_model_state_dict`` gives them (:func:`saved_name`: the adapter's name dropped, and a
``modules_to_save`` copy under its module's own name), in the dtype the module held them, and streams the masters
(cast to that dtype by the writer: the bits PEFT would have saved). A ``modules_to_save`` copy that the model ties
to another (``ensure_weight_tying``; DeepSpeed records it in ``shared_params``) is an alias, written from its
partner as PEFT writes both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.names import examples
from patcher.checkpoint.readers.base import Held, Put, Reader
from patcher.errors import DsfixError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
ADAPTER_FILES = (ADAPTER_CONFIG, "README.md")  # what PEFT's save_pretrained writes beside the weights
_ADAPTER_RE = re.compile(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.([^.]+)(?:\.|$)")


def read_adapter_config(folder: Path) -> Optional[dict]:
    """``folder``'s ``adapter_config.json`` (None when there is none). Raises DsfixError when it is unreadable."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise DsfixError(f"{ADAPTER_CONFIG} is unreadable: {e}", path=str(folder)) from e
    return config


def base_folder(config: dict, base: Optional[Path] = None) -> tuple[Optional[Path], str]:
    """(the base model's folder, how it was found) for the adapter of ``config`` (adapter_config.json): ``base``
    (``--base``) when given, else ``base_model_name_or_path`` when it is a folder here or a model in the Hugging
    Face cache (nothing is downloaded); (None, "") when it is neither."""
    named = str(config.get("base_model_name_or_path") or "")
    if base is not None:
        return Path(base), str(base)
    if named and Path(named).is_dir():
        return Path(named), named
    if named:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(named, local_files_only=True)), f"{named} (the Hugging Face cache)"
        except Exception:  # not in the cache (or not a model id)
            pass
    return None, ""


def saved_name(name: str, adapter: str) -> str:
    """The name PEFT's ``get_peft_model_state_dict`` saves a parameter under: a ``modules_to_save`` copy under its
    module's own name, every other name without the adapter's (``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``)."""
    return name.replace(f".modules_to_save.{adapter}", "").replace(f".{adapter}", "")


def adapter_name(names) -> str:
    """The one adapter the parameters belong to (``default``, unless the run named it)."""
    found = sorted({m.group(1) for n in names if (m := _ADAPTER_RE.search(n))})
    if len(found) != 1:
        what = f"adapters {examples(found)}" if found else "no LoRA parameter (lora_A, lora_B)"
        raise DsfixError(f"refused: the engine files hold {what}; dsfix reads the one LoRA adapter of a PEFT run; "
                         "nothing written")
    return found[0]


class PeftRun(Reader):
    """The adapter of a PEFT run, from its checkpoint's engine files (``engine``, an opened engine reader)."""

    kind = "peft"

    def __init__(self, engine: Any, config: dict, checkpoint: Path) -> None:
        super().__init__(engine.folder)
        self.engine, self.config, self.checkpoint = engine, config, Path(checkpoint)
        if str(config.get("peft_type", "")).upper() != "LORA":
            raise DsfixError(f"refused: a PEFT {config.get('peft_type')} adapter; dsfix reads LoRA adapters; nothing "
                             "written", path=str(checkpoint))
        trained = [n for group in engine.meta["param_shapes"] for n in group]
        try:
            self.adapter = adapter_name(trained)
        except DsfixError as e:
            raise DsfixError(e.message, path=str(engine.folder)) from None
        module = engine.meta.get("module") or {}
        self.names = {n: saved_name(n, self.adapter) for n in trained}
        for name, saved in self.names.items():
            dtype = module[name].dtype if name in module else engine.tensors[name].dtype
            self.tensors[saved] = Held(saved, engine.tensors[name].shape, dtype)
        self.aliases = {saved_name(alias, self.adapter): self.names[partner]
                        for alias, partner in engine.aliases.items() if partner in self.names}

    @property
    def name(self) -> str:
        return self.engine.name

    def describe(self) -> str:
        config = self.config
        return (f"{self.engine.tag}: a PEFT LoRA adapter (r {config.get('r')}, lora_alpha {config.get('lora_alpha')}, "
                f"{len(self.tensors)} tensors) in the engine files: ZeRO-{self.engine.stage}, {self.engine.world} "
                f"rank(s), {self.engine.precision} optimizer states; read weights-only")

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        def rename(name: str, first: int, data: Any) -> None:
            if name in self.names:
                put(self.names[name], first, data)

        self.engine.stream(rename, workdir)

    def close(self) -> None:
        self.engine.close()
