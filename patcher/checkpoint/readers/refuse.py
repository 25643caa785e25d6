"""What ``dsfix convert`` refuses to read: checkpoint layouts it has not proven, told by what the files say.

dsfix reads DeepSpeed ZeRO-1/2/3 checkpoints of data-parallel training, and universal checkpoints made from
them, with Adam-shaped optimizer states (or none yet). Anything else is refused before a byte is written,
in one line naming what was found (exit 2); no layout is guessed:

* tensor parallelism (Megatron-style or DeepSpeed's AutoTP): files of ``mp_rank_01`` and above,
  ``mp_world_size`` or ``tp_degree`` above 1, ``tensor_parallel.autotp_size`` above 1 in the saved config, a
  universal parameter file merged from tensor-parallel slices;
* expert parallelism (DeepSpeed MoE, AutoEP): expert files (``expp_rank_*``, ``layer_*_expert_*``), AutoEP
  layer records, ``expert_parallel`` enabled in the saved config, universal expert parameters;
* pipeline parallelism: ``pp_degree`` above 1, per-layer files (``layer_NN-model_…``);
* optimizer states that are not Adam's (``exp_avg``, ``exp_avg_sq``, ``step``), e.g. Muon's
  ``momentum_buffer``, or Muon recorded in the config or the parameter groups.

Each function raises :class:`patcher.errors.DsfixError` (exit 2) or returns None. No torch here: the values
are read from what the engine readers loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

from patcher.errors import DsfixError

ADAM_STATE = frozenset({"exp_avg", "exp_avg_sq", "step", "max_exp_avg_sq"})
# the keys a universal parameter file of plain data-parallel training holds (ds_to_universal's ZeRO-1/2 merge);
# its ZeRO-3 merge saves the bare tensor
UNIVERSAL_KEYS = frozenset({"param", "cat_dim"})

_MP_RE = re.compile(r"mp_rank_(\d+)")
_EXPERT_RE = re.compile(r"^(expp_rank_\d+_.*_optim_states\.pt|layer_\d+_expert_\d+_.*model_states\.pt)$")
_PIPE_RE = re.compile(r"^layer_\d+-model_.*\.pt$")


def refused(what: str, path, why: str = "") -> DsfixError:
    """The one line: what was found, that dsfix has not proven that layout, and that nothing was written."""
    tail = f" {why}" if why else ""
    return DsfixError(f"refused: {what}; dsfix reads data-parallel ZeRO checkpoints only and has not proven this "
                      f"layout{tail}; nothing written", path=str(path))


def files(folder: Path) -> None:
    """The step folder's file names: tensor-parallel ranks, expert files, pipeline layer files."""
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".pt"))
    for name in names:
        if _EXPERT_RE.match(name):
            raise refused(f"expert-parallel files ({name}: DeepSpeed MoE or AutoEP)", folder)
        if _PIPE_RE.match(name):
            raise refused(f"pipeline-parallel layer files ({name})", folder)
        found = _MP_RE.search(name)
        if found and int(found.group(1)) != 0:
            raise refused(f"tensor-parallel files ({name}: model-parallel rank {int(found.group(1))}, "
                          "as AutoTP or Megatron write)", folder)


def model_states(meta: dict, path) -> None:
    """A model_states file's records of tensor, pipeline or expert parallelism and of its optimizer."""
    dims = meta.get("checkpoint_parallel_dimensions") or {}
    for key, what in (("mp_world_size", "mp_world_size"), ("tp_degree", "tp_degree")):
        value = meta.get(key) if key == "mp_world_size" else dims.get(key)
        if _above_one(value):
            raise refused(f"tensor parallelism ({what} {value})", path)
    if _above_one(dims.get("pp_degree")):
        raise refused(f"pipeline parallelism (pp_degree {dims['pp_degree']})", path)
    config = section(meta, "ds_config")
    tp = section(config, "tensor_parallel")
    if _above_one(tp.get("autotp_size")) or _above_one(tp.get("tp_size")):
        raise refused(f"AutoTP tensor parallelism (tensor_parallel {_short(tp)} in the saved config)", path)
    for key in ("ds_autoep_layers", "autoep_layers"):
        if meta.get(key):
            raise refused(f"AutoEP expert parallelism ({key} recorded)", path)
    ep = section(config, "expert_parallel")
    if ep.get("enabled"):
        raise refused(f"AutoEP expert parallelism (expert_parallel {_short(ep)} in the saved config)", path)
    info = section(meta, "universal_checkpoint_info")
    if info.get("ds_autoep_layers"):
        raise refused("AutoEP expert parallelism (universal_checkpoint_info records expert layers)", path)
    optimizer = section(config, "optimizer")
    kind = str(optimizer.get("type", ""))
    if "muon" in kind.lower():
        raise refused(f"a {kind} optimizer (the saved config's optimizer type), whose states are not Adam's", path)


def optimizer_states(osd, path) -> None:
    """A rank's optimizer states (ZeRO-3: ``optimizer_state_dict``, ZeRO-1/2: ``base_optimizer_state``): Adam's
    keys only (or none yet), no Muon parameter group."""
    if not isinstance(osd, dict):
        return
    inner = osd.get("optimizer_state_dict", osd.get("base_optimizer_state"))
    states, groups = _states_and_groups(inner)
    if any(isinstance(g, dict) and g.get("use_muon") for g in groups):
        raise refused("Muon parameter groups (use_muon in the optimizer's param_groups), whose states are not "
                      "Adam's", path)
    other = sorted({str(k) for s in states if isinstance(s, dict) for k in s} - ADAM_STATE)
    if other:
        raise refused(f"optimizer states {', '.join(other[:3])} (not Adam's exp_avg/exp_avg_sq: Muon, SGD with "
                      "momentum or another optimizer)", path)


def universal_param(obj, name: str, path) -> None:
    """A universal checkpoint's ``fp32.pt``: the bare tensor (ZeRO-3) or ``{param, cat_dim: 0}`` (ZeRO-1/2)."""
    if not isinstance(obj, dict):
        return
    extra = sorted(str(k) for k in obj if k not in UNIVERSAL_KEYS)
    if extra:
        what = "expert parallelism" if any("expert" in k for k in extra) else "tensor parallelism"
        raise refused(f"{name}'s universal file records {', '.join(extra[:3])} ({what})", path)
    if obj.get("cat_dim", 0) != 0:
        raise refused(f"{name}'s universal file was merged from tensor-parallel slices along dimension "
                      f"{obj['cat_dim']} (tensor parallelism)", path)


def _states_and_groups(inner) -> tuple[list, list]:
    """(per-parameter state dicts, param_groups) of a torch optimizer's state_dict, or ZeRO's list of states."""
    if isinstance(inner, list):  # ZeRO-1/2 with elastic checkpoints: one lean state dict a group
        return [s for s in inner if isinstance(s, dict)], []
    if not isinstance(inner, dict):
        return [], []
    state = inner.get("state")
    states = list(state.values()) if isinstance(state, dict) else []
    groups = inner.get("param_groups")
    return states, groups if isinstance(groups, list) else []


def section(mapping: dict, key: str) -> dict:
    """``mapping[key]`` when it is a dict (a saved config's section), else an empty one."""
    value = mapping.get(key)
    return value if isinstance(value, dict) else {}


def _above_one(value) -> bool:
    try:
        return value is not None and int(value) > 1
    except (TypeError, ValueError):
        return False


def _short(mapping: dict, limit: int = 80) -> str:
    text = ", ".join(f"{k}={v}" for k, v in mapping.items())
    return text if len(text) <= limit else text[:limit - 3] + "..."
