"""A PEFT run: its adapter, read from the engine files of the checkpoint when PEFT's own file is empty.

The Hugging Face Trainer (and TRL's, and accelerate's loops) save a PEFT model's ``checkpoint-N/`` with
``adapter_config.json``, ``adapter_model.safetensors`` and the engine's files (``global_stepN/``). Under
DeepSpeed ZeRO-3 PEFT reads the partitioned parameters without gathering them, so its
``adapter_model.safetensors`` holds **0 tensors** (40 bytes); the trained adapter survives only in the engine
files, which the Trainer writes with ``exclude_frozen_parameters=True``: ``param_shapes`` holds the adapter's
parameters alone (``...q_proj.lora_A.default.weight``), their fp32 masters are in the optimizer files, and the
model_states' ``module`` keeps each one's dtype (the full tensor below ZeRO-3, an empty placeholder at ZeRO-3).

:class:`PeftRun` wraps that checkpoint's engine reader: it holds the trained parameters under the names PEFT's
``get_peft_model_state_dict`` gives them (read from PEFT itself: the PEFT model of ``adapter_config.json`` built on
its base's config on the meta device, then followed through PEFT's own renames; DoRA's magnitude has no ``.weight``,
a ``modules_to_save`` copy goes under its module's own name), in the dtype the module held them, and streams the masters
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
PREFIX = "base_model.model."  # what PeftModel puts before the base model's own names
ADAPTER_FILES = (ADAPTER_CONFIG, "README.md")  # what PEFT's save_pretrained writes beside the weights
_ADAPTER_RE = re.compile(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.([^.]+)(?:\.|$)")  # LoRA's


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


def base_name(key: str) -> str:
    """The base model's own name of a PEFT model's parameter (``base_model.model.X.base_layer.weight`` ->
    ``X.weight``)."""
    return key.removeprefix(PREFIX).replace(".base_layer.", ".")


def adapter_text(config: dict) -> str:
    """The adapter of ``config`` (adapter_config.json) in a few words: its PEFT type, and for LoRA its options
    (DoRA, rsLoRA), rank, alpha, per-module ranks and alphas and biases, where used."""
    kind = str(config.get("peft_type", "")).upper()
    if kind != "LORA":
        return f"PEFT {config.get('peft_type')}"
    options = [n for n, key in (("DoRA", "use_dora"), ("rsLoRA", "use_rslora")) if config.get(key)]
    parts = ["PEFT LoRA" + (f" ({', '.join(options)})" if options else ""), f"r {config.get('r')}",
             f"lora_alpha {config.get('lora_alpha')}"]
    for key in ("rank_pattern", "alpha_pattern"):
        if isinstance(config.get(key), dict) and config[key]:
            parts.append(f"{key} {examples(f'{k}: {v}' for k, v in config[key].items())}")
    if config.get("lora_bias"):
        parts.append("lora_bias")
    if config.get("bias", "none") not in ("none", None):
        parts.append(f"bias {config['bias']}")
    return ", ".join(parts)


def adapter_name(names, config: dict) -> str:
    """The one adapter the parameters belong to (``default``, unless the run named it; ``default`` for PEFT types
    other than LoRA)."""
    found = sorted({m.group(1) for n in names if (m := _ADAPTER_RE.search(n))})
    if str(config.get("peft_type", "")).upper() != "LORA" and not found:
        return "default"
    if len(found) != 1:
        what = f"adapters {examples(found)}" if found else "no LoRA parameter (lora_A, lora_B)"
        raise DsfixError(f"refused: the engine files hold {what}; dsfix reads the one LoRA adapter of a PEFT run; "
                         "nothing written")
    return found[0]


class PeftRun(Reader):
    """The adapter of a PEFT run, from its checkpoint's engine files (``engine``, an opened engine reader):
    ``names`` maps each parameter of the PEFT model to the name PEFT saves it under
    (:func:`patcher.checkpoint.check.adapter.saved_names`); the trained ones are what the engine holds."""

    kind = "peft"

    def __init__(self, engine: Any, config: dict, checkpoint: Path, names: dict) -> None:
        super().__init__(engine.folder)
        self.engine, self.config, self.checkpoint = engine, config, Path(checkpoint)
        trained = [n for group in engine.meta["param_shapes"] for n in group]
        unknown = [n for n in trained if n not in names]
        if unknown:
            raise DsfixError(f"refused: the engine files train {examples(unknown)}, which the PEFT model of "
                             f"{ADAPTER_CONFIG} does not save (another adapter or base?); nothing written",
                             path=str(engine.folder))
        module = engine.meta.get("module") or {}
        self.names = {n: names[n] for n in trained}
        for name, saved in self.names.items():
            dtype = module[name].dtype if name in module else engine.tensors[name].dtype
            self.tensors[saved] = Held(saved, engine.tensors[name].shape, dtype)
        self.aliases = {names[alias]: self.names[partner] for alias, partner in engine.aliases.items()
                        if partner in self.names and alias in names}
        # what PEFT's file holds that training did not change (an embedding LoRA's base embedding, as PEFT's
        # save_embedding_layers saves it): the base model's own tensor, from its folder (:meth:`take_frozen`)
        self.untrained = {v: k for k, v in names.items() if k not in self.names and v not in self.aliases}
        self.frozen: dict = {}
        self.base: Any = None

    def take_frozen(self, base: Any) -> None:
        """The untrained tensors PEFT's file holds, from ``base`` (a reader of the base model's folder)."""
        wanted = {saved: base_name(key) for saved, key in self.untrained.items()}
        absent = [n for n in wanted.values() if n not in base.tensors or n in base.aliases]
        if absent:
            raise DsfixError(f"refused: PEFT's file also holds the base model's {examples(absent)}, which the base "
                             "folder does not hold as a tensor of its own; nothing written", path=str(base.folder))
        self.base, self.frozen = base, wanted
        for saved, name in wanted.items():
            self.tensors[saved] = Held(saved, base.tensors[name].shape, base.tensors[name].dtype)

    @property
    def name(self) -> str:
        return self.engine.name

    def describe(self) -> str:
        return (f"{self.engine.tag}: a {adapter_text(self.config)} adapter ({len(self.tensors)} tensors) in the "
                f"engine files: ZeRO-{self.engine.stage}, {self.engine.world} rank(s), {self.engine.precision} "
                "optimizer states; read weights-only")

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        def rename(name: str, first: int, data: Any) -> None:
            if name in self.names:
                put(self.names[name], first, data)

        self.engine.stream(rename, workdir)
        for saved, name in self.frozen.items():
            put(saved, 0, self.base.slice(name)[:].reshape(-1))

    def close(self) -> None:
        self.engine.close()
        if self.base is not None:
            self.base.close()
