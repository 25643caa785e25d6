"""A PEFT LoRA adapter merged into its base model's weights, as ``PeftModel.from_pretrained(base,
adapter).merge_and_unload()`` merges it.

PEFT loads a bf16 or fp16 adapter in fp32 (``autocast_adapter_dtype``, its default), and ``merge`` adds to each
target module's weight, in place in the weight's own dtype, ``(lora_B @ lora_A) * scaling`` computed in the
adapter's dtype (``get_delta_weight``), with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``); a
``modules_to_save`` module's weight becomes the trained copy. :class:`MergedLoRA` is a reader that does exactly
that to its base's reader, one base tensor at a time: memory is the adapter (small) and one base tensor.

What PEFT merges differently, or dsfix has not proven, is refused in one line before anything is read: other
PEFT methods, DoRA, ``fan_in_fan_out`` (GPT-2's Conv1D), per-module ranks or alphas, LoRA biases, LoRA on
embeddings, and LoRA on a weight the base folder does not hold (``lm_head`` tied to the embedding: merging would
untie them).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.names import examples
from patcher.checkpoint.readers.base import Put, Reader
from patcher.errors import DsfixError

PREFIX = "base_model.model."  # what PeftModel puts before the base model's own names
_FACTOR_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def refusal(config: dict) -> Optional[str]:
    """Why an adapter of ``config`` (adapter_config.json) is not merged here, or None."""
    checks = (
        (str(config.get("peft_type", "")).upper() != "LORA", f"a PEFT {config.get('peft_type')} adapter"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D layers)"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")), "per-module ranks or alphas"),
        (bool(config.get("lora_bias")), "LoRA biases (lora_bias)"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r}"),
    )
    return next((why for refused, why in checks if refused), None)


def scaling(config: dict) -> float:
    """PEFT's ``scaling``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    r, alpha = int(config["r"]), config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def plan_merge(adapter: dict, base_names, config: dict) -> tuple[dict, dict]:
    """({base weight: (lora_A, lora_B)}, {base weight: trained copy}) from the adapter's tensors (PEFT's saved
    names); a DsfixError names what cannot be merged."""
    why = refusal(config)
    if why is not None:
        raise DsfixError(f"--merge: {why}, which dsfix does not merge; the adapter itself converts without --merge")
    factors: dict = {}
    replaced, unknown = {}, []
    for name, tensor in adapter.items():
        own = name[len(PREFIX):] if name.startswith(PREFIX) else name
        found = _FACTOR_RE.match(own)
        if found:
            factors.setdefault(f"{found.group('module')}.weight", {})[found.group("which")] = tensor
        elif "lora_" in own:
            unknown.append(name)
        else:  # a modules_to_save copy, under its module's own name
            replaced[own] = tensor
    absent = [n for n in list(factors) + list(replaced) if n not in base_names]
    if unknown or absent:
        what = (f"LoRA tensors of a layer kind dsfix does not merge: {examples(unknown)}" if unknown else
                f"the base folder holds no {examples(absent)} (a weight the config ties to another?)")
        raise DsfixError(f"--merge: {what}; the adapter itself converts without --merge")
    incomplete = [n for n, pair in factors.items() if set(pair) != {"A", "B"}]
    if incomplete:
        raise DsfixError(f"--merge: lora_A or lora_B missing for {examples(incomplete)}")
    return {n: (pair["A"], pair["B"]) for n, pair in factors.items()}, replaced


def merged(weight: Any, lora_a: Any, lora_b: Any, scale: float) -> Any:
    """``weight`` with ``(lora_B @ lora_A) * scale`` added as PEFT's ``merge`` adds it (a new tensor)."""
    import torch

    if lora_b.dtype in (torch.float16, torch.bfloat16):  # PEFT's from_pretrained loads them in fp32
        lora_a, lora_b = lora_a.float(), lora_b.float()
    out = weight.clone()
    out += (lora_b @ lora_a) * scale
    return out


class MergedLoRA(Reader):
    """The base model's weights (``base``, a random-access reader) with the adapter merged in."""

    kind = "peft-merged"

    def __init__(self, base: Any, adapter: dict, config: dict, source: str) -> None:
        super().__init__(base.folder)
        self.base, self.config, self.source = base, config, source
        self.factors, self.replaced = plan_merge(adapter, base.tensors, config)
        self.scale = scaling(config)
        self.tensors, self.aliases = dict(base.tensors), dict(base.aliases)

    def describe(self) -> str:
        return (f"{self.base.describe()}, with {self.source}'s LoRA merged into {len(self.factors)} weights "
                f"(scaling {self.scale:g})" + (f" and {len(self.replaced)} modules_to_save" if self.replaced else ""))

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        for name, held in self.base.tensors.items():
            if name in self.base.aliases:
                continue
            tensor = self.base.slice(name)[:] if held.shape and 0 not in held.shape else self.base.slice(name)
            if name in self.factors:
                lora_a, lora_b = self.factors[name]
                tensor = merged(tensor, lora_a, lora_b, self.scale)
            elif name in self.replaced:
                tensor = self.replaced[name]
            put(name, 0, tensor.reshape(-1))

    def close(self) -> None:
        self.base.close()
