"""A model folder's config, and its model built on the meta device: the keys, shapes and ties to expect.

Two kinds of model folder, told apart by their keys (:func:`folder_kind`):

* ``causal-lm``: any causal LM (a Trainer's or accelerate's model, a converted checkpoint, DeepSpeed-Chat's
  step-1 model and step-3 ``actor``/``actor_ema``), built with ``AutoModelForCausalLM.from_config``;
* ``critic``: step 2's reward model and step 3's ``critic`` (``rwtransformer.*`` plus ``v_head.weight``, with
  the base model's config), built as DeepSpeed-Chat's ``create_critic_model`` builds it (:mod:`.critic`).

Building on the meta device allocates nothing, so a 0.6B model's expectations cost a fraction of a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Optional

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.names import CONFIG_NAME

CAUSAL_LM = "causal-lm"
CRITIC = "critic"
ADAPTER = "peft-adapter"
KIND_TEXT = {
    CAUSAL_LM: "causal LM (a Trainer's or accelerate's model, DeepSpeed-Chat's step-1 model or step-3 actor/EMA)",
    CRITIC: "reward/critic model (rwtransformer.* + v_head.weight, as create_critic_model builds it)",
    ADAPTER: "PEFT LoRA adapter (adapter_model.safetensors + adapter_config.json, on its base model)",
}


def load_config(folder: Path) -> tuple[Optional[Any], Check, Optional[str]]:
    """(config or None, the check, torch_dtype string from the json or None)."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None, Check("config", False, f"no {CONFIG_NAME}: from_pretrained cannot load this folder"), None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return None, Check("config", False, f"{CONFIG_NAME} is not valid JSON: {e}"), None
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        return None, Check("config", False, f"transformers cannot read {CONFIG_NAME}: {type(e).__name__}: {e}"), None
    cfg_dtype = raw.get("dtype") or raw.get("torch_dtype")
    arch = ",".join(raw.get("architectures") or []) or "?"
    tied = raw.get("tie_word_embeddings", getattr(cfg, "tie_word_embeddings", None))
    detail = f"model_type {raw.get('model_type', '?')}, {arch}, tie_word_embeddings {tied}, dtype {cfg_dtype}"
    return cfg, Check("config", True, detail), cfg_dtype


def folder_kind(keys) -> str:
    """CRITIC when the keys are a reward/critic model's (``v_head.weight``, ``rwtransformer.*``), else CAUSAL_LM."""
    return CRITIC if any(k == "v_head.weight" or k.startswith("rwtransformer.") for k in keys) else CAUSAL_LM


def meta_model(cfg: Any, kind: str = CAUSAL_LM) -> Any:
    """The config's model on the meta device: a causal LM, or the critic as create_critic_model builds it."""
    import torch

    if kind == CRITIC:
        from patcher.checkpoint.check.critic import build_critic

        return build_critic(cfg)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def model_name(model: Any, kind: str = CAUSAL_LM) -> str:
    if kind == CRITIC:
        return f"{type(model.rwtransformer).__name__} under rwtransformer. + v_head"
    return type(model).__name__


def expected_of(model: Any) -> tuple[dict, list]:
    """(key -> shape, tie groups) of a (meta) model's state dict; tied keys are one tensor object."""
    sd = model.state_dict(keep_vars=True)
    shapes = {k: tuple(int(d) for d in v.shape) for k, v in sd.items()}
    groups: dict = {}
    for k, v in sd.items():
        groups.setdefault(id(v), []).append(k)
    return shapes, [g for g in groups.values() if len(g) > 1]


class Expected(NamedTuple):
    """What the config's model holds: key -> shape, the tie groups, the class built, the input embedding's key."""

    shapes: dict
    tie_groups: list
    built: str
    embedding: Optional[str]


def expected(cfg: Any, kind: str = CAUSAL_LM) -> tuple[Optional[Expected], Optional[Check]]:
    """(the config's model's expectations, None), or (None, a failing "keys" row) when transformers reads the
    config but cannot build its model."""
    try:
        model = meta_model(cfg, kind)
        shapes, tie_groups = expected_of(model)
        embedding = None
        if kind == CAUSAL_LM:
            weight = model.get_input_embeddings().weight
            embedding = next((k for k, v in model.state_dict(keep_vars=True).items() if v is weight), None)
        return Expected(shapes, tie_groups, model_name(model, kind), embedding), None
    except Exception as e:
        what = "the critic (AutoModel + v_head)" if kind == CRITIC else "a causal-LM"
        return None, Check("keys", False, f"cannot build {what} from {CONFIG_NAME} on meta: {type(e).__name__}: {e}")


class Model(NamedTuple):
    """What a folder must hold, as its config says: the config and its row, the expected keys (or why they are not
    known), the kind; for a PEFT adapter, its adapter_config.json and where its base's config came from."""

    cfg: Any
    config_row: Check
    dtype: Optional[str]  # the config's torch_dtype
    expected: Optional[Expected]
    failed: Optional[Check]  # a config transformers reads but cannot build a model from
    kind: str
    adapter: Optional[dict] = None
    base_row: Optional[Check] = None


def model_of(folder: Path, kind: str = CAUSAL_LM) -> Model:
    """``folder``'s config.json and the keys its model (``kind``: a causal LM or a critic) holds."""
    cfg, check, cfg_dtype = load_config(folder)
    found, failed = expected(cfg, kind) if cfg is not None else (None, None)
    return Model(cfg, check, cfg_dtype, found, failed, kind)
