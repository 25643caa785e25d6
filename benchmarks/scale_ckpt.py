"""Synthetic DeepSpeed engine checkpoints of real Qwen3 shapes, written rank by rank (bench_scale.py's input).

Every parameter's fp32 master values are a function of its name and position: a window of one seeded random
pool (64 MiB), starting where the name's CRC says. So a rank's partition is computed on its own, with no whole
model in memory, and ZeRO-2 and ZeRO-3 checkpoints of one size hold the same weights. The layout is DeepSpeed
0.19.8's, as tests/ckptkit.py writes it (bf16 training, one parameter group, ``shared_params`` for the tie). The
Adam moments are stubs (empty tensors) unless ``moments=True``: nothing that converts a checkpoint reads them,
and full ones triple the disk each size needs. Full ones lie where DeepSpeed writes them, before the masters in
each optimizer file, so that a reader which reads more than the masters pays for it here too.
"""
import json
import math
import os
import zlib
from collections import OrderedDict

import common

POOL_LEN = 1 << 24
JITTER = 1 << 20
# Qwen3's published configs, as changes to the bundled 0.6B one (head_dim 128 and vocab 151936 at every size)
SIZES = OrderedDict([
    ("0.6B", {}),
    ("1.7B", {"hidden_size": 2048, "intermediate_size": 6144}),
    ("4B", {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "max_window_layers": 36,
            "num_attention_heads": 32}),
    ("8B", {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "max_window_layers": 36,
            "num_attention_heads": 32, "tie_word_embeddings": False}),
])
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
_POOL = []


def config_of(size):
    """The size's config.json as a dict (``narrow``: the bundled narrow Qwen3, for --quick)."""
    with open(common.NARROW_CONFIG if size == "narrow" else common.FULL_CONFIG) as handle:
        config = json.load(handle)
    config.update(SIZES.get(size, {}))
    return config


def shapes_of(config):
    """(trained parameters in named_parameters order as [(name, shape)], tied aliases): from the config's model
    built on the meta device, so no weights exist."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**kwargs))
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # the tied alias once, as DeepSpeed sees it
    return params, dict(TIED) if config.get("tie_word_embeddings", True) else {}


def pool():
    import torch

    if not _POOL:
        generator = torch.Generator().manual_seed(0)
        _POOL.append(torch.randn(POOL_LEN + JITTER, generator=generator) * 0.02)
    return _POOL[0]


def fill(out, name, first):
    """``out`` (1-D fp32) := the master values of ``name`` from element ``first`` on."""
    source, at, pos = pool(), 0, (zlib.crc32(name.encode()) % JITTER + first) % POOL_LEN
    while at < out.numel():
        take = min(out.numel() - at, POOL_LEN - pos)
        out[at:at + take].copy_(source[pos:pos + take])
        at, pos = at + take, 0
    return out


def seeded(name, shape, dtype):
    """The whole of ``name``'s master values, shaped and cast to ``dtype``: what every rank's slice is part of."""
    import torch

    return fill(torch.empty(math.prod(shape)), name, 0).to(dtype).view(shape)


def _common(params, shared, world, stage):
    import torch

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
    return {"buffer_names": [], "optimizer": None,
            "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in params)], "frozen_param_shapes": None,
            "shared_params": shared, "dp_world_size": world, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": ds, "ds_version": "0.19.8"}


def _adam_state(flat, full):
    """The base optimizer's state of the one flat group: Adam's step and moments, full-size or as stubs."""
    import torch

    if not full:
        return {"step": torch.tensor(1.0), "exp_avg": torch.zeros(0), "exp_avg_sq": torch.zeros(0)}
    return {"step": torch.tensor(1.0), "exp_avg": flat * 0.1, "exp_avg_sq": flat.square()}


def _optim_path(folder, rank):
    return os.path.join(folder, "bf16_zero_pp_rank_%d_mp_rank_00_optim_states.pt" % rank)


def _zero3_rank(params, world, rank):
    """Rank ``rank``'s flat fp32 partition: each parameter's ceil(numel / world) slice, the last rank's padded."""
    import torch

    flat = torch.zeros(sum(math.ceil(math.prod(s) / world) for _, s in params))
    at = 0
    for name, shape in params:
        n = math.prod(shape)
        part = math.ceil(n / world)
        count = max(0, min(part, n - rank * part))
        if count:
            fill(flat[at:at + count], name, rank * part)
        at += part
    return flat


def _zero2_rank(params, world, rank):
    """Rank ``rank``'s equal share of the parameters flattened in order, padded to a multiple of 2 x world."""
    import torch

    total = sum(math.prod(s) for _, s in params)
    part = math.ceil(total / (2 * world)) * 2
    flat, lo, at = torch.zeros(part), rank * part, 0
    for name, shape in params:
        n = math.prod(shape)
        a, b = max(lo, at), min(lo + part, at + n)
        if a < b:
            fill(flat[a - lo:b - lo], name, a - at)
        at += n
    return flat


def _bf16_module(params, shared):
    """ZeRO-1/2's model_states ``module``: the whole bf16 model, as the engine saves it (one tensor at a time)."""
    import torch

    module = OrderedDict()
    for name, shape in params:
        module[name] = fill(torch.empty(math.prod(shape)), name, 0).to(torch.bfloat16).reshape(shape)
    for alias, partner in shared.items():
        module[alias] = module[partner]
    return module


def write_checkpoint(root, config, stage, world, progress=None, moments=False):
    """``root``: config.json, ``latest`` and ``global_step1/`` of a ZeRO-``stage`` run on ``world`` ranks; rank by
    rank (a rank's partition in memory at a time, with its moments where ``moments``; ZeRO-2's model_states also
    holds the bf16 model, as DeepSpeed's does). Returns (parameters, fp32 master bytes)."""
    import torch

    params, shared = shapes_of(config)
    folder = os.path.join(root, "global_step1")
    os.makedirs(folder)
    with open(os.path.join(root, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    with open(os.path.join(root, "latest"), "w") as handle:
        handle.write("global_step1")
    head = _common(params, shared, world, stage)
    if stage == 2:
        torch.save(dict(head, module=_bf16_module(params, shared), frozen_param_fragments=None),
                   os.path.join(folder, "mp_rank_00_model_states.pt"))
    else:
        holders = OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n, _ in params)
        holders.update((a, holders[p]) for a, p in shared.items())
        for rank in range(world):
            torch.save(dict(head, module=holders, frozen_param_fragments=None),
                       os.path.join(folder, "zero_pp_rank_%d_mp_rank_00_model_states.pt" % rank))
    for rank in range(world):
        flat = (_zero3_rank if stage == 3 else _zero2_rank)(params, world, rank)
        # in DeepSpeed's order: the base optimizer's state (the moments) is written before the fp32 masters
        adam = {"state": {0: _adam_state(flat, moments)}, "param_groups": [{"lr": 0.01, "params": [0]}]}
        if stage == 3:
            osd = {"zero_stage": 3, "partition_count": world, "optimizer_state_dict": adam, "fp32_flat_groups": [flat]}
        else:
            osd = {"base_optimizer_state": adam, "single_partition_of_fp32_groups": [flat], "zero_stage": stage,
                   "partition_count": [world]}
        torch.save({"optimizer_state_dict": osd}, _optim_path(folder, rank))
        del flat, osd, adam
        if progress:
            progress(rank)
    count = sum(math.prod(s) for _, s in params)
    return count, count * 4


def output_bytes(config, dtype_bytes=2):
    """The bytes of the converted weights (the tied alias written as its own copy, as convert's clone does)."""
    params, shared = shapes_of(config)
    sizes = dict(params)
    return (sum(math.prod(s) for _, s in params) + sum(math.prod(sizes[p]) for p in shared.values())) * dtype_bytes


def tensor_bytes(config, dtype_bytes=2):
    """Each trained parameter's bytes in the output's dtype."""
    params, _ = shapes_of(config)
    return [math.prod(s) * dtype_bytes for _, s in params]
