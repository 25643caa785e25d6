"""Checkpoint folders written here, from tensors the test chooses, laid out as their producers write them.

Real runs (tests/test_engine.py, tests/test_hf_runs.py) prove dsfix against DeepSpeed's own files; these are
for what a real run cannot pin: outputs that must stay byte for byte the same on any machine (training on
another CPU rounds differently), and rows of a table. Every value is a function of the tensor's name and
position (:func:`value`), computed in float64 and cast, so it is the same everywhere.

* :func:`write_bin`: a DeepSpeed-Chat ``.bin`` output folder (``torch.save`` of a state dict; tied keys share
  storage, as ``state_dict()`` leaves them), single or sharded with transformers' index;
* :func:`write_engine`: ``engine.save_checkpoint``'s ``latest`` and ``global_stepN/`` at ZeRO-1/2 (one
  model_states file, the fp32 masters flattened per group and cut into equal partitions) or ZeRO-3 (one
  model_states file a rank, every parameter cut on its own), with frozen parameters, buffers and the tied
  alias recorded in ``shared_params``, as DeepSpeed 0.19.8 lays them out (see patcher's ZeRO reader);
* :func:`write_universal`: ``ds_to_universal``'s folder made from such a checkpoint.
"""
from __future__ import annotations

import json
import math
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
NARROW_CONFIG = REPO / "fixtures" / "models" / "qwen3-narrow" / "config.json"
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def value(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """Values in [-0.5, 0.5) that depend on the name and the position only (exact float64 arithmetic)."""
    n = math.prod(int(d) for d in shape)
    offset = (zlib.crc32(name.encode()) % 9973) / 9973
    flat = (torch.arange(n, dtype=torch.float64) * 0.6180339887498949 + offset).frac() - 0.5
    return flat.reshape(tuple(int(d) for d in shape)).to(dtype)


def narrow_names() -> "OrderedDict[str, tuple]":
    """The narrow Qwen3's state-dict keys and shapes (311, ``lm_head.weight`` included), from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in json.loads(NARROW_CONFIG.read_text()).items()
                                     if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return OrderedDict((k, tuple(v.shape)) for k, v in model.state_dict().items())


def narrow_state(dtype=torch.float32, tied: bool = True) -> "OrderedDict[str, torch.Tensor]":
    """The narrow Qwen3's weights from :func:`value`; ``tied``: ``lm_head.weight`` is the embedding's tensor."""
    state = OrderedDict((k, value(k, s, dtype)) for k, s in narrow_names().items())
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def write_config(folder: Path, dtype: str = "bfloat16", **changes) -> Path:
    """The narrow Qwen3's config.json (its bytes fixed here, not by transformers' version)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads(NARROW_CONFIG.read_text())
    config.update(torch_dtype=dtype, **changes)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def write_bin(folder: Path, state: dict, shards: int = 1) -> Path:
    """``pytorch_model.bin``, or ``shards`` files and ``pytorch_model.bin.index.json`` as transformers names them."""
    folder.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        torch.save(dict(state), folder / "pytorch_model.bin")
        return folder
    keys = list(state)
    per = math.ceil(len(keys) / shards)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i * per:(i + 1) * per]}
        torch.save(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    return folder


def _ds_config(stage: int, precision: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"}}


def _adam(numel: int) -> dict:
    return {"step": torch.tensor(1.0), "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}


def write_engine(root: Path, trained: "OrderedDict[str, torch.Tensor]", *, stage: int, world: int = 2,
                 frozen: dict | None = None, buffers: dict | None = None, shared: dict | None = None,
                 groups: int = 1, precision: str = "bf16", tag: str = "global_step1") -> Path:
    """An engine checkpoint in ``root`` (``latest`` and ``root/tag/``). ``trained``: the fp32 master weights, in
    parameter order, split into ``groups`` optimizer groups; ``frozen``: frozen parameters (training dtype);
    ``buffers``: persistent buffers; ``shared``: tied alias -> the parameter it is (DeepSpeed's shared_params);
    ``precision``: bf16 (``bf16_`` optimizer files), fp16 or fp32 (no prefix)."""
    frozen, buffers, shared = dict(frozen or {}), dict(buffers or {}), dict(shared or {})
    train_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    folder = root / tag
    folder.mkdir(parents=True)
    (root / "latest").write_text(tag)
    names = list(trained)
    per = math.ceil(len(names) / groups)
    group_names = [names[g * per:(g + 1) * per] for g in range(groups)]
    param_shapes = [OrderedDict((n, torch.Size(trained[n].shape)) for n in g) for g in group_names]
    module = OrderedDict((n, t.to(train_dtype)) for n, t in trained.items())
    module.update((n, t) for n, t in frozen.items())
    module.update(buffers)
    for alias, partner in shared.items():
        if partner in module:  # a frozen base tensor excluded from the save (PEFT runs) is not in it
            module[alias] = module[partner]
    common = {"buffer_names": list(buffers), "optimizer": None, "param_shapes": param_shapes,
              "frozen_param_shapes": OrderedDict((n, torch.Size(t.shape)) for n, t in frozen.items()) or None,
              "shared_params": shared, "dp_world_size": world, "mp_world_size": 1,
              "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
              "ds_config": _ds_config(stage, precision), "ds_version": "0.19.8"}
    prefix = "bf16_" if precision == "bf16" else ""
    if stage == 3:
        _write_zero3(folder, trained, group_names, module, frozen, common, world, prefix)
    else:
        _write_zero12(folder, trained, group_names, module, frozen, common, world, prefix, stage)
    return root


def _write_zero12(folder, trained, group_names, module, frozen, common, world, prefix, stage):
    torch.save({**common, "module": module, "frozen_param_fragments": OrderedDict(frozen) or None},
               folder / "mp_rank_00_model_states.pt")
    parts = [[] for _ in range(world)]
    for names in group_names:
        flat = torch.cat([trained[n].reshape(-1).float() for n in names])
        flat = torch.cat([flat, torch.zeros(-flat.numel() % (2 * world))])
        for r, part in enumerate(flat.chunk(world)):
            parts[r].append(part.clone())
    for r in range(world):
        osd = {"zero_stage": stage, "partition_count": [world] * len(group_names),
               "single_partition_of_fp32_groups": parts[r],
               "base_optimizer_state": {"state": {g: _adam(p.numel()) for g, p in enumerate(parts[r])},
                                        "param_groups": [{"lr": 0.01, "params": [g]} for g in range(len(parts[r]))]}}
        torch.save({"optimizer_state_dict": osd}, folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def _slice(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO-3 partition of ``tensor``: ceil(numel / world) elements, the last rank's padded."""
    part = math.ceil(tensor.numel() / world)
    flat = torch.cat([tensor.reshape(-1), torch.zeros(part * world - tensor.numel(), dtype=tensor.dtype)])
    return flat[rank * part:(rank + 1) * part].clone()


def _write_zero3(folder, trained, group_names, module, frozen, common, world, prefix):
    placeholders = OrderedDict((n, torch.empty(0, dtype=t.dtype)) for n, t in module.items())
    for r in range(world):
        fragments = OrderedDict((n, _slice(t, r, world)) for n, t in frozen.items()) or None
        torch.save({**common, "module": placeholders, "frozen_param_fragments": fragments},
                   folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        flat = [torch.cat([_slice(trained[n].float(), r, world) for n in names]) for names in group_names]
        osd = {"zero_stage": 3, "partition_count": world, "fp32_flat_groups": flat,
               "optimizer_state_dict": {"state": {g: _adam(t.numel()) for g, t in enumerate(flat)},
                                        "param_groups": [{"lr": 0.01, "params": [g]} for g in range(len(flat))]}}
        torch.save({"optimizer_state_dict": osd}, folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def write_universal(root: Path, engine_root: Path, trained: dict, tag: str = "global_step1") -> Path:
    """``ds_to_universal``'s output for the engine checkpoint ``engine_root/tag``: ``root/latest_universal`` and
    ``root/TAG_universal/`` holding ``zero/<name>/fp32.pt`` (ZeRO-3: the bare flat tensor; ZeRO-1/2:
    ``{"param", "cat_dim"}``) and the copied model_states files."""
    source = engine_root / tag
    folder = root / f"{tag}_universal"
    folder.mkdir(parents=True)
    (root / "latest_universal").write_text(folder.name)
    stage3 = any(source.glob("zero_pp_rank_*_model_states.pt"))
    for name, tensor in trained.items():
        (folder / "zero" / name).mkdir(parents=True)
        data = tensor.float().reshape(-1).clone() if stage3 else {"param": tensor.float().clone(), "cat_dim": 0}
        torch.save(data, folder / "zero" / name / "fp32.pt")
    for path in source.glob("*_model_states.pt"):
        (folder / path.name).write_bytes(path.read_bytes())
    return root
