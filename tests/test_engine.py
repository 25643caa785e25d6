"""dsfix convert of DeepSpeed engine checkpoints (patcher/checkpoint/readers, patcher/checkpoint/convert).

Fast tier: the flat-partition maps against partitions built here the way DeepSpeed lays them out, the
weights-only loader and its allow-list, finding the step folder. Slow tier: one launch of 2 CPU ranks
(gloo) saves real engine checkpoints of the narrow tied Qwen3 at ZeRO-2 and ZeRO-3 after a training step,
with one frozen module; each is converted and compared with DeepSpeed's own zero_to_fp32 reconstruction
and with the engine's own gathered model.
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.checkpoint.convert import convert
from patcher.checkpoint.names import STAGING_PREFIX
from patcher.checkpoint.readers import find, flat, load, open_step, refuse, step_reader, zero3, zero12
from patcher.checkpoint.steps import lora
from patcher.errors import DsfixError

torch = pytest.importorskip("torch")


# --------------------------------------------------------------------------- the maps, against DeepSpeed's layout


def _zero12_flatten(groups, world, paddings):
    """Per rank, each group's partition: the parameters flattened with their paddings, padded to a multiple
    of 2 x world, cut into ``world`` equal parts (as DeepSpeed's ZeRO-1/2 optimizer keeps them)."""
    parts = [[] for _ in range(world)]
    values = {}
    for g, params in enumerate(groups):
        chunks = []
        for (name, numel), pad in zip(params, paddings[g] if paddings else [0] * len(params)):
            values[name] = torch.arange(numel, dtype=torch.float32) + 1000 * len(values)
            chunks += [values[name], torch.full((pad,), -1.0)]
        flat = torch.cat(chunks) if chunks else torch.empty(0)
        flat = torch.cat([flat, torch.full((-flat.numel() % (2 * world),), -2.0)])
        for r, part in enumerate(flat.chunk(world)):
            parts[r].append(part.clone())
    return parts, values


def _zero3_flatten(params, world, split_at):
    """Per rank, its slice of every parameter (ceil(numel/world), the last padded) one after another, cut
    into flat groups at the element counts ``split_at`` (as DeepSpeed's ZeRO-3 optimizer keeps them)."""
    locals_, values = [[] for _ in range(world)], {}
    for i, (name, numel) in enumerate(params):
        values[name] = torch.arange(numel, dtype=torch.float32) + 1000 * i
        part = math.ceil(numel / world)
        padded = torch.cat([values[name], torch.full((part * world - numel,), -1.0)])
        for r in range(world):
            locals_[r].append(padded[r * part:(r + 1) * part])
    parts = []
    for r in range(world):
        flat = torch.cat(locals_[r])
        bounds = [0] + [b for b in split_at if 0 < b < flat.numel()] + [flat.numel()]
        parts.append([flat[a:b].clone() for a, b in zip(bounds, bounds[1:])])
    return parts, values


def _rebuild(pieces, parts, sizes):
    out = {name: torch.full((numel,), float("nan")) for name, numel in sizes.items()}
    seen = {name: 0 for name in sizes}
    for p in pieces:
        out[p.name][p.dst:p.dst + p.length] = parts[p.rank][p.group][p.src:p.src + p.length]
        seen[p.name] += p.length
    return out, seen


ZERO12_CASES = [  # (groups of (name, numel), world, paddings)
    ([[("a", 10), ("b", 7), ("c", 1)]], 1, None),
    ([[("a", 10), ("b", 7), ("c", 1)]], 2, None),
    ([[("a", 10), ("b", 7), ("c", 1)]], 3, None),
    ([[("a", 5), ("b", 5)], [("c", 9), ("d", 2)]], 4, None),  # two groups
    ([[("a", 6), ("b", 3), ("c", 4)]], 2, [[2, 0, 1]]),  # alignment paddings after parameters
    ([[("big", 101)], [("x", 1), ("y", 1)]], 3, [[0], [3, 0]]),
    ([[("only", 1)]], 4, None),  # fewer elements than ranks
]


@pytest.mark.parametrize("groups,world,paddings", ZERO12_CASES)
def test_zero12_pieces_rebuild_every_parameter(groups, world, paddings):
    parts, values = _zero12_flatten(groups, world, paddings)
    sizes = [parts[0][g].numel() for g in range(len(groups))]
    pieces = zero12.pieces(groups, sizes, world, paddings)
    assert [p.rank for p in pieces] == sorted(p.rank for p in pieces)  # rank by rank: one file at a time
    out, seen = _rebuild(pieces, parts, {n: v.numel() for n, v in values.items()})
    assert seen == {n: v.numel() for n, v in values.items()}
    for name, value in values.items():
        assert torch.equal(out[name], value), name


ZERO3_CASES = [  # (params, world, where the flat groups split each rank's slices)
    ([("a", 10), ("b", 7), ("c", 1)], 1, []),
    ([("a", 10), ("b", 7), ("c", 1)], 2, []),
    ([("a", 10), ("b", 7), ("c", 1)], 3, [4]),  # a slice crosses from group 0 into group 1
    ([("a", 9), ("b", 9), ("c", 2), ("d", 33)], 4, [3, 5]),
    ([("one", 1), ("two", 2)], 4, []),  # ranks holding padding only
]


@pytest.mark.parametrize("params,world,split_at", ZERO3_CASES)
def test_zero3_pieces_rebuild_every_parameter(params, world, split_at):
    parts, values = _zero3_flatten(params, world, split_at)
    sizes = [t.numel() for t in parts[0]]
    pieces = zero3.pieces(params, world, sizes)
    out, seen = _rebuild(pieces, parts, dict(params))
    assert seen == dict(params)
    for name, value in values.items():
        assert torch.equal(out[name], value), name


@pytest.mark.parametrize("call,message", [
    (lambda: zero12.pieces([[("a", 10)]], [4], 2), "need 10 elements"),
    (lambda: zero12.pieces([[("a", 2)]], [8], 2), "not the layout"),
    (lambda: zero12.pieces([[("a", 2), ("b", 2)]], [2], 2, [[0]]), "paddings for 2 parameters"),
    (lambda: zero3.pieces([("a", 10)], 2, [4]), "hold 4 elements"),
])
def test_maps_refuse_partitions_that_do_not_fit(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------- reading a rank's flat partitions


def _rank_file(tmp_path, sizes, mapped=True):
    """A ZeRO-3 rank's optimizer file as torch.save lays it out (Adam's moments, then the flat groups), the
    groups' values with NaN, infinities and -0.0 among them; (path, the groups as loaded: memory-mapped, or
    read into memory)."""
    groups = [torch.arange(n, dtype=torch.float32) * (g + 1) for g, n in enumerate(sizes)]
    for g in groups:
        g[1::7] = float("nan")
        g[2::11] = -0.0
        g[3::13] = float("inf")
    path = tmp_path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    osd = {"zero_stage": 3, "fp32_flat_groups": groups,
           "optimizer_state_dict": {"state": {i: {"exp_avg": torch.ones(n), "exp_avg_sq": torch.ones(n)}
                                              for i, n in enumerate(sizes)}}}
    torch.save({"optimizer_state_dict": osd}, path)
    loaded = load.load_deepspeed(path) if mapped else torch.load(path, weights_only=True)
    return path, loaded["optimizer_state_dict"]["fp32_flat_groups"]


needs_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                                reason="the kernel's list of mappings is Linux's")


@needs_maps
def test_mapped_offset_is_where_the_tensor_lies_in_its_file(tmp_path):
    path, groups = _rank_file(tmp_path, [100, 3000])
    data = path.read_bytes()
    for g in groups:
        at = flat.mapped_offset(g, path)
        assert data[at:at + g.numel() * 4] == bytes(g.view(torch.uint8).tolist())
    other = tmp_path / "other.pt"
    shutil.copy(path, other)
    assert flat.mapped_offset(groups[0], other) is None  # the same bytes, another file
    assert flat.mapped_offset(groups[0].clone(), path) is None  # not mapped at all
    assert flat.mapped_offset(groups[1][::2], path) is None  # not contiguous


def _read_pieces(path, groups, pieces):
    """Each piece rebuilt from its parts, and whether every part came from the given tensors."""
    out, given = {}, True
    for p, at, data in flat.pieces_read(path, groups, pieces):
        g = groups[p.group]
        low, high = g.data_ptr(), g.data_ptr() + g.numel() * g.element_size()
        given = given and low <= data.data_ptr() < high
        out.setdefault(p, torch.full((p.length,), 7.0))[at:at + data.numel()] = data  # copied: the buffer is reused
    return out, given


P = zero12.Piece


@pytest.mark.parametrize("sizes,pieces,block,where,from_given", [
    # one group in order, pieces crossing 64-byte blocks
    ([100], [P(0, 0, 0, "a", 0, 40), P(0, 0, 40, "b", 0, 60)], 64, "mapped", False),
    # two groups, pieces out of order, padding left out, a piece of one element
    ([50, 30], [P(0, 1, 10, "c", 5, 20), P(0, 0, 0, "a", 0, 17), P(0, 0, 49, "b", 0, 1)], 64, "mapped", False),
    # a block larger than every group
    ([50, 30], [P(0, 0, 3, "a", 0, 40), P(0, 1, 0, "b", 0, 30)], 16 << 20, "mapped", False),
    # an empty group before the one read
    ([0, 50], [P(0, 1, 0, "a", 0, 50)], 64, "mapped", False),
    # the groups read into memory, not mapped: cut from them
    ([100], [P(0, 0, 0, "a", 0, 100)], 64, "in memory", True),
    # the offset found is not the group's (4 bytes off): cut from the mapped tensors
    ([100], [P(0, 0, 0, "a", 0, 100)], 64, "shifted", True),
])
@needs_maps
def test_flat_pieces_are_the_tensors_bit_for_bit(tmp_path, monkeypatch, sizes, pieces, block, where, from_given):
    monkeypatch.setattr(flat, "BLOCK", block)
    path, groups = _rank_file(tmp_path, sizes, mapped=where != "in memory")
    if where == "shifted":
        found = flat.mapped_offset
        monkeypatch.setattr(flat, "mapped_offset", lambda t, p: found(t, p) + 4)
    out, given = _read_pieces(path, groups, pieces)
    assert given is from_given
    for p in pieces:
        want = groups[p.group].narrow(0, p.src, p.length)
        assert torch.equal(out[p].view(torch.int32), want.view(torch.int32)), p


@needs_maps
def test_flat_reading_stops_its_thread_and_says_a_short_or_failing_file_in_one_line(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(flat, "BLOCK", 4096)
    path, groups = _rank_file(tmp_path, [8192])
    whole = [P(0, 0, 0, "a", 0, 8192)]
    parts = flat.pieces_read(path, groups, whole)
    next(parts)
    parts.close()  # the caller stops after the first part (its put raised): the thread ends too
    assert not [t for t in threading.enumerate() if t.name == "dsfix-read-ahead"]
    overlapping = [P(0, 0, 0, "a", 0, 2000), P(0, 0, 10, "b", 0, 10)]  # no layout makes these: refused, not misread
    with pytest.raises(DsfixError, match="b: its pieces overlap"):
        list(flat.pieces_read(path, groups, overlapping))
    assert not [t for t in threading.enumerate() if t.name == "dsfix-read-ahead"]
    with open(path, "r+b") as f:  # the file cut in the middle of the group after it was opened
        f.truncate(flat.mapped_offset(groups[0], path) + 16384)
    with pytest.raises(DsfixError) as info:
        list(flat.pieces_read(path, groups, whole))
    assert "truncated" in str(info.value) and path.name in str(info.value) and "\n" not in str(info.value)
    assert not [t for t in threading.enumerate() if t.name == "dsfix-read-ahead"]

    def failing(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    for call in ("preadv", "pread"):  # the disk fails under the thread's reads, then under the first check
        monkeypatch.setattr(os, call, failing)
        with pytest.raises(DsfixError, match=r"cannot be read: Input/output error; nothing written") as info:
            list(flat.pieces_read(path, groups, [P(0, 0, 0, "a", 0, 1000)]))
        assert info.value.code == 2 and path.name in str(info.value)


# --------------------------------------------------------------------------- loading without running code


@pytest.mark.slow
def test_loader_admits_deepspeed_types_as_plain_records(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    path = tmp_path / "optim.pt"
    torch.save({"optimizer_state_dict": {
        "loss_scaler": LossScaler(1.0), "dynamic": DynamicLossScaler(2.0**16, 1000, 1, 2, False),
        "zero_stage": ZeroStageEnum.gradients, "slices": {"w": fragment_address(numel=4, start=8)},
        "flat": [torch.arange(6, dtype=torch.float32)]}}, path)
    osd = load.load_deepspeed(path)["optimizer_state_dict"]
    assert type(osd["loss_scaler"]) is load.LossScalerRecord and osd["loss_scaler"].cur_scale == 1.0
    assert type(osd["dynamic"]) is load.DynamicLossScalerRecord and osd["dynamic"].dtype is torch.float16
    assert osd["zero_stage"] == 2 and type(osd["zero_stage"]) is int
    assert (osd["slices"]["w"].numel, osd["slices"]["w"].start) == (4, 8)
    assert torch.equal(osd["flat"][0], torch.arange(6, dtype=torch.float32))


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _NotDeepSpeed:
    pass


@pytest.mark.parametrize("payload,named", [
    (lambda marker: {"optimizer_state_dict": _RunsCode(marker)}, "system"),
    (lambda marker: {"x": _NotDeepSpeed()}, "_NotDeepSpeed"),
    (lambda marker: {"args": __import__("argparse").Namespace(lr=1.0)}, "argparse.Namespace"),
])
def test_loader_refuses_any_other_type_naming_it_and_runs_nothing(tmp_path, payload, named):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save(payload(marker), path)
    with pytest.raises(DsfixError) as info:
        load.load_deepspeed(path)
    assert info.value.code == 2 and "refused" in str(info.value) and named in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    assert not marker.exists()


@pytest.mark.parametrize("content,message", [
    (None, "is missing"),
    (b"not a zip", "truncated or not a torch.save file"),
])
def test_loader_refuses_unreadable_files(tmp_path, content, message):
    path = tmp_path / "x.pt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DsfixError, match=message):
        load.load_deepspeed(path)


# --------------------------------------------------------------------------- finding the step folder


def _fake_step(folder, stage3=True, ranks=(0, 1), prefix="bf16_"):
    folder.mkdir(parents=True)
    for r in ranks:
        (folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt").touch()
        if stage3:
            (folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").touch()
    if not stage3:
        (folder / "mp_rank_00_model_states.pt").touch()
    return folder


@pytest.mark.parametrize("setup,tag,expect", [
    # (files to make under root, --tag, the step folder read or the error's words)
    (lambda root: (_fake_step(root / "global_step3"), (root / "latest").write_text("global_step3\n")), None,
     "global_step3"),
    (lambda root: (_fake_step(root / "global_step3"), _fake_step(root / "global_step6"),
                   (root / "latest").write_text("global_step6")), "global_step3", "global_step3"),
    (lambda root: _fake_step(root, stage3=False, prefix=""), None, "root"),  # a step folder itself, fp16
    (lambda root: (_fake_step(root / "global_step3"), (root / "latest").write_text("global_step9")), None,
     "latest names 'global_step9', which is not a folder here"),
    (lambda root: _fake_step(root / "global_step3"), "global_step4", "no folder global_step4 here"),
    (lambda root: _fake_step(root, ranks=(0, 2)), None,
     "rank 1's file bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"),
    (lambda root: (_fake_step(root, ranks=(0, 1)), (root / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()),
     None, "rank 1's file zero_pp_rank_1_mp_rank_00_model_states.pt is missing"),
    (lambda root: (root.mkdir(), (root / "mp_rank_00_model_states.pt").touch()), None, "no *_optim_states.pt"),
    # ds_to_universal's output: latest_universal beside it names it; latest (the engine's own) comes first
    (lambda root: (_fake_universal(root / "global_step3_universal"),
                   (root / "latest_universal").write_text("global_step3_universal")),
     None, "global_step3_universal"),
    (lambda root: (_fake_step(root / "global_step3"), _fake_universal(root / "global_step3_universal"),
                   (root / "latest").write_text("global_step3"),
                   (root / "latest_universal").write_text("global_step3_universal")),
     None, "global_step3"),
    (lambda root: (_fake_step(root / "global_step3"), _fake_universal(root / "global_step3_universal"),
                   (root / "latest").write_text("global_step3")), "global_step3_universal", "global_step3_universal"),
    (lambda root: _fake_universal(root, stage3=False), None, "root"),  # the universal folder itself, ZeRO-1/2
    (lambda root: (_fake_universal(root / "u"), (root / "latest_universal").write_text("gone")), None,
     "latest_universal names 'gone', which is not a folder here"),
    (lambda root: (_fake_universal(root), (root / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()), None,
     "rank 0's file zero_pp_rank_0_mp_rank_00_model_states.pt is missing"),
])
def test_find_source(tmp_path, setup, tag, expect):
    root = tmp_path / "root"
    setup(root)
    assert find.is_engine_checkpoint(root)
    def files():
        folder, _, _ = find.step_folder(root, tag)
        reader = step_reader(folder)
        return folder, reader, reader.files(folder)

    if expect.startswith(("global_step", "root")):
        folder, reader, (model_files, optim_files, _) = files()
        assert folder.name == expect and len(optim_files or model_files) in (1, 2)
        universal = reader.kind == "universal"
        assert universal == expect.endswith("_universal") or (expect == "root" and universal)
    else:
        with pytest.raises(DsfixError) as info:
            files()
        assert expect in str(info.value) and "\n" not in str(info.value)


def _fake_universal(folder, stage3=True, ranks=(0, 1)):
    """ds_to_universal's output, names only: zero/<name>/fp32.pt and the copied model_states files."""
    (folder / "zero" / "w").mkdir(parents=True)
    (folder / "zero" / "w" / "fp32.pt").touch()
    for r in ranks if stage3 else ():
        (folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").touch()
    if not stage3:
        (folder / "mp_rank_00_model_states.pt").touch()
    return folder


def test_a_bin_folder_is_not_an_engine_checkpoint(tmp_path):
    (tmp_path / "pytorch_model.bin").touch()
    (tmp_path / "config.json").write_text("{}")
    assert not find.is_engine_checkpoint(tmp_path)


# --------------------------------------------------------------------------- refusals, over small real-shaped files
# DeepSpeed 0.19.8's own file names and keys (engine.save_checkpoint, ds_to_universal) around a two-parameter
# model. Muon and AutoTP also run for real in the launch below (test_real_muon_and_autotp_checkpoints_are_refused);
# AutoEP cannot here (its presets expect transformers 5's fused expert weights; the tests run 4.57), nor can
# DeepSpeed MoE, pipeline parallelism (a PipelineModule, not a Hugging Face model) or universal files merged
# from tensor-parallel slices of such runs.

NARROW_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "models",
                             "qwen3-narrow")


def _tiny_zero2(folder, meta=None, tweak=None, files=()):
    """A ZeRO-2 step folder of a two-parameter model on 2 ranks as DeepSpeed writes it (model_states, one bf16
    optimizer file a rank). ``meta``: model_states entries set; ``tweak(osd)``: changes each optimizer state
    dict; ``files``: further files (empty)."""
    from collections import OrderedDict

    folder.mkdir(parents=True)
    shapes = OrderedDict([("w", torch.Size([4, 2])), ("b", torch.Size([4]))])
    states = {"module": OrderedDict((n, torch.zeros(s, dtype=torch.bfloat16)) for n, s in shapes.items()),
              "buffer_names": [], "optimizer": None, "param_shapes": [shapes], "frozen_param_shapes": OrderedDict(),
              "shared_params": {}, "frozen_param_fragments": OrderedDict(), "dp_world_size": 2, "mp_world_size": 1,
              "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
              "ds_config": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, "ds_version": "0.19.8"}
    states.update(meta or {})
    torch.save(states, folder / "mp_rank_00_model_states.pt")
    for r in range(2):
        osd = {"zero_stage": 2, "partition_count": [2], "group_paddings": [0], "param_alignment_paddings": [[0, 0]],
               "single_partition_of_fp32_groups": [torch.arange(6, dtype=torch.float32) + 6 * r],
               "base_optimizer_state": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(6),
                                                      "exp_avg_sq": torch.zeros(6)}},
                                        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]}}
        if tweak:
            tweak(osd)
        torch.save({"optimizer_state_dict": osd}, folder / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    for name in files:
        (folder / name).touch()
    return folder


def _state(osd):
    return osd["base_optimizer_state"]["state"][0]


REFUSALS = [  # (model_states set, optimizer states changed, files added, the words of the refusal)
    ({}, None, ("mp_rank_01_model_states.pt",), "tensor-parallel files (mp_rank_01_model_states.pt"),
    ({}, None, ("bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",), "model-parallel rank 1"),
    ({"mp_world_size": 2}, None, (), "tensor parallelism (mp_world_size 2)"),
    ({"checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 2}}, None, (),
     "tensor parallelism (tp_degree 2)"),
    ({"ds_config": {"tensor_parallel": {"autotp_size": 2}}}, None, (),
     "AutoTP tensor parallelism (tensor_parallel autotp_size=2"),
    ({"ds_autoep_layers": [{"expert_key_prefix": "model.layers.0.mlp.experts", "num_experts": 4, "ep_size": 2}]},
     None, (), "AutoEP expert parallelism (ds_autoep_layers recorded)"),
    ({"ds_config": {"expert_parallel": {"enabled": True, "autoep_size": 2}}}, None, (),
     "AutoEP expert parallelism (expert_parallel"),
    ({}, None, ("expp_rank_0_mp_rank_00_optim_states.pt",),
     "expert-parallel files (expp_rank_0_mp_rank_00_optim_states.pt"),
    ({}, None, ("layer_0_expert_3_mp_rank_00_model_states.pt",), "expert-parallel files (layer_0_expert_3"),
    ({"checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 1}}, None, (),
     "pipeline parallelism (pp_degree 2)"),
    ({}, None, ("layer_01-model_00-model_states.pt",), "pipeline-parallel layer files"),
    ({"ds_config": {"optimizer": {"type": "Muon", "params": {"lr": 0.02}}}}, None, (), "a Muon optimizer"),
    ({}, lambda o: _state(o).update(momentum_buffer=torch.zeros(6)), (), "optimizer states momentum_buffer"),
    ({}, lambda o: o["base_optimizer_state"]["param_groups"][0].update(use_muon=True), (), "Muon parameter groups"),
    ({}, lambda o: o["base_optimizer_state"]["state"].clear(), (), None),  # no states yet (no step taken): read
    ({}, None, (), None),  # the same files without a marker are read
]


@pytest.mark.parametrize("meta,tweak,files,words", REFUSALS)
def test_unproven_layouts_are_refused_in_one_line_with_nothing_written(tmp_path, meta, tweak, files, words):
    ckpt = _tiny_zero2(tmp_path / "ckpt" / "global_step1", meta, tweak, files)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    if words is None:
        reader = open_step(*find.step_folder(tmp_path / "ckpt")[:2])
        assert (reader.folder, reader.world, [len(g) for g in reader.meta["param_shapes"]]) == (ckpt, 2, [2])
        return
    with pytest.raises(DsfixError) as info:
        convert(tmp_path / "ckpt", config=NARROW_CONFIG, output=tmp_path / "out")
    message = str(info.value)
    assert info.value.code == 2 and words in message and message.count("refused") == 1, message
    assert "\n" not in message and "nothing written" in message and len(message) < 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _tiny_universal(folder, param):
    """A universal checkpoint's folder from ZeRO-1/2: the copied model_states and zero/w/fp32.pt = ``param``."""
    _tiny_zero2(folder, files=())
    for f in folder.glob("*_optim_states.pt"):
        f.unlink()
    (folder / "zero" / "w").mkdir(parents=True)
    torch.save(param, folder / "zero" / "w" / "fp32.pt")
    return folder


@pytest.mark.parametrize("param,words", [
    ({"param": torch.ones(4, 2), "cat_dim": 1}, "merged from tensor-parallel slices along dimension 1"),
    ({"param": torch.ones(4, 2), "cat_dim": 0, "vocab_tensor": True}, "records vocab_tensor (tensor parallelism)"),
    ({"param": torch.ones(4, 2), "is_expert_param": True, "ep_num_experts": 4}, "(expert parallelism)"),
    ({"param": torch.ones(3, 2), "cat_dim": 0}, "holds a tensor of shape [3, 2], but w is [4, 2]"),
    (torch.ones(7), "holds a tensor of shape [7], but w is [4, 2]"),
    ({"weights": torch.ones(4, 2)}, "records weights"),
])
def test_universal_parameter_files_that_are_not_plain_data_parallel_are_refused(tmp_path, param, words):
    folder = _tiny_universal(tmp_path / "global_step1_universal", param)
    reader = open_step(folder)
    with pytest.raises(DsfixError) as info:
        reader.stream(lambda name, dst, data: None)
    assert info.value.code == 2 and words in str(info.value), str(info.value)


def test_universal_reads_each_parameter_file_in_its_shape(tmp_path):
    folder = _tiny_universal(tmp_path / "global_step1_universal",
                             {"param": torch.arange(8.0).reshape(4, 2), "cat_dim": 0})
    (folder / "zero" / "b").mkdir()
    torch.save(torch.arange(4.0) + 100, folder / "zero" / "b" / "fp32.pt")  # ZeRO-3's form: the bare flat tensor
    reader = open_step(folder)
    got = {}
    reader.stream(lambda n, dst, data: got.setdefault(n, (dst, data)))
    assert reader.kind == "universal" and not reader.stage3 and list(got) == ["w", "b"]
    assert got["w"][0] == 0 and torch.equal(got["w"][1], torch.arange(8.0))
    assert torch.equal(got["b"][1], torch.arange(4.0) + 100)


# --------------------------------------------------------------------------- LoRA: finding the layers, fusing them


@pytest.mark.parametrize("shapes,expect", [
    ({"l.weight": (6, 4), "l.lora_right_weight": (4, 2), "l.lora_left_weight": (2, 6), "n.weight": (6,)},
     [("l.weight", "l.lora_right_weight", "l.lora_left_weight", 6, 4, 2)]),
    ({"a.weight": (3, 3)}, []),
    ({"l.weight": (6, 4), "l.lora_right_weight": (4, 2)}, "lacks l.lora_left_weight"),
    ({"l.weight": (6, 4), "l.lora_right_weight": (6, 2), "l.lora_left_weight": (2, 4)}, "are not LinearLayer_LoRA's"),
    ({"l.weight": (6, 4), "l.lora_right_weight": (4, 2), "l.lora_left_weight": (3, 6)}, "are not LinearLayer_LoRA's"),
    ({"l.base_layer.weight": (6, 4), "l.lora_A.default.weight": (2, 4), "l.lora_B.default.weight": (6, 2)},
     "not DeepSpeed-Chat's LinearLayer_LoRA"),  # PEFT's names: not proven, refused
])
def test_lora_layers_found_from_names_and_shapes(shapes, expect):
    if isinstance(expect, str):
        with pytest.raises(DsfixError) as info:
            lora.find(shapes, "ckpt")
        assert expect in str(info.value) and info.value.code == 2
    else:
        assert [tuple(m) for m in lora.find(shapes, "ckpt")] == expect


@pytest.mark.parametrize("dtype,dim,scaling", [(torch.bfloat16, 4, 1), (torch.bfloat16, 8, 2.0), (torch.float32, 3, 1),
                                               (torch.float16, 2, 0.5)])
def test_fuse_is_step1s_fusion_bit_for_bit(tiny_lora_helper, dtype, dim, scaling):
    torch.manual_seed(dim)
    layer = tiny_lora_helper.TinyLoRALinear(torch.nn.Linear(12, 10, bias=False).to(dtype), dim, scaling)
    with torch.no_grad():
        layer.lora_left_weight.normal_()
    masters = {n: getattr(layer, n).detach().float() for n in ("lora_right_weight", "lora_left_weight")}
    base = layer.weight.detach().clone()
    layer.fuse()
    fused = lora.fuse(base.clone(), masters["lora_right_weight"], masters["lora_left_weight"], scaling / dim)
    assert fused.dtype == dtype and not torch.equal(fused, base)
    assert torch.equal(_bits(fused), _bits(layer.weight.detach()))


@pytest.mark.parametrize("drop", [None, "l.lora_left_weight", "l.weight"])
def test_fuser_fuses_what_it_was_handed_and_refuses_what_it_lacks(tmp_path, drop):
    """Pieces arrive in any order, cut anywhere (as ranks hand them over); other tensors pass straight on."""
    torch.manual_seed(3)
    weight, right, left = torch.randn(6, 4).to(torch.bfloat16), torch.randn(4, 2), torch.randn(2, 6)
    shapes = {"l.weight": (6, 4), "l.lora_right_weight": (4, 2), "l.lora_left_weight": (2, 6), "n.weight": (6,)}
    modules = lora.find(shapes, "ckpt")
    out = {}
    fuser = lora.Fuser(modules, {n: math.prod(s) for n, s in shapes.items()}, torch.bfloat16, 2.0,
                       lambda n, dst, data: out.setdefault(n, []).append((dst, data.clone())), tmp_path / "scratch")
    pieces = [("l.lora_left_weight", left.reshape(-1), 7), ("n.weight", torch.ones(6), 6),
              ("l.weight", weight.reshape(-1), 10), ("l.lora_right_weight", right.reshape(-1), 3)]
    for name, values, cut in pieces:
        if name != drop:
            fuser.put(name, cut, values[cut:])
            fuser.put(name, 0, values[:cut])
    try:
        if drop:
            with pytest.raises(DsfixError, match=f"does not hold every element of the LoRA layers: {drop}"):
                fuser.finish()
            return
        fuser.finish()
    finally:
        fuser.close()
    assert not (tmp_path / "scratch").exists() and [d for d, _ in out["n.weight"]] == [6, 0]
    (dst, fused), = out["l.weight"]
    expected = lora.fuse(weight.clone(), right, left, 2.0 / 2)
    assert dst == 0 and torch.equal(_bits(fused), _bits(expected.reshape(-1)))


# --------------------------------------------------------------------------- real engines on 2 CPU ranks


# The LoRA runs of the one launch: ZeRO-2 as step 1 runs by default (base weights frozen by the LoRA layers,
# the rest trained, lora_scaling 1); ZeRO-3 with --only_optimize_lora and a lora_scaling of 2.
LORA_RUNS = [{"stage": 2, "dim": 4}, {"stage": 3, "dim": 8, "scaling": 2, "only_optimize_lora": True}]


@pytest.fixture(scope="session")
def engine_checkpoints(tmp_path_factory, tiny_qwen3_helper):
    """One launch of 2 CPU ranks (gloo): engine checkpoints of the narrow tied Qwen3 at ZeRO-2 and ZeRO-3, each
    after one bf16 training step with model.layers.1.mlp frozen, plus each engine's gathered model and logits
    (reference.pt), and a model folder (config, generation config, tokenizer) for --config. In the same launch,
    the LoRA runs (LORA_RUNS): ckpt/loraS and, in ckpt/loraS/hf, what step 1's patched save writes after fusing;
    then two layouts dsfix refuses: ckpt/muon (DeepSpeed's Muon optimizer, ZeRO-2) and ckpt/autotp (AutoTP, 2-way)."""
    pytest.importorskip("deepspeed")
    from smokekit import REPO, launch_ranks, patched_checkout

    base = tmp_path_factory.mktemp("engine-ckpt")
    utils = patched_checkout(base / "DeepSpeed-Chat") / "dschat" / "utils" / "utils.py"  # step 1's patched save
    # TORCH_COMPILE_DISABLE: Muon's kernels run eagerly instead of being compiled first (minutes on a CPU);
    # the files saved are the same
    run = launch_ranks(
        REPO / "fixtures" / "step1_trainer" / "engine_ckpt.py",
        ["--output_dir", base / "ckpt", "--stages", "2,3", "--utils", utils, "--lora_runs", json.dumps(LORA_RUNS),
         "--unproven", "muon,autotp"],
        env={"TORCH_COMPILE_DISABLE": "1",
             "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert run.ok and "[engine_ckpt] saved stages 2,3" in run.output, run.report()

    from transformers import GenerationConfig

    model_dir = base / "model"
    config = tiny_qwen3_helper.tiny_qwen3_config()
    config.architectures = ["Qwen3ForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(model_dir))
    GenerationConfig(max_new_tokens=8).save_pretrained(str(model_dir))
    tiny_qwen3_helper.tiny_qwen3_tokenizer().save_pretrained(str(model_dir))
    return base / "ckpt", model_dir


@pytest.fixture(scope="session")
def universal_checkpoints(engine_checkpoints, tmp_path_factory):
    """DeepSpeed's own ds_to_universal on the ZeRO-2 and ZeRO-3 checkpoints, as its users run it: zeroS/ holds
    global_step1_universal/ and the latest_universal naming it (one process, about 5 s alone on 2 cores)."""
    ckpt, _ = engine_checkpoints
    base = tmp_path_factory.mktemp("universal")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "GITHUB_ACTIONS", "PY_COLORS")}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    runs = [["--input_folder", str(ckpt / f"zero{s}" / "global_step1"), "--output_folder",
             str(base / f"zero{s}" / "global_step1_universal"),
             "--num_extract_workers", "1", "--num_merge_workers", "1"]
            for s in (2, 3)]
    # `python -m deepspeed.checkpoint.ds_to_universal ARGS` twice, in one process: DeepSpeed imported once
    script = ("import runpy, sys\nfor argv in %r:\n    sys.argv = ['ds_to_universal'] + argv\n"
              "    runpy.run_module('deepspeed.checkpoint.ds_to_universal', run_name='__main__', alter_sys=True)\n"
              % runs)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return base


def _zero_to_fp32(ckpt):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def _read(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _bits(t):
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(scope="session")
def tiny_lora_helper():
    """fixtures/step1_trainer/tiny_lora.py: a LoRA layer shaped like DeepSpeed-Chat's, written for these tests."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "step1_trainer",
                        "tiny_lora.py")
    spec = importlib.util.spec_from_file_location("dsfix_fixture_tiny_lora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_is_bit_equal_to_zero_to_fp32(engine_checkpoints, tmp_path, stage):
    ckpt, model_dir = engine_checkpoints
    out = tmp_path / "out"
    result = convert(ckpt / f"zero{stage}", config=model_dir, output=out, dtype="fp32", strategy="clone")
    assert result.ok, result.checks
    assert (result.stage, result.world, result.tensors, result.tag) == (stage, 2, 311, "global_step1")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes()
    written = _read(out)
    reference = _zero_to_fp32(ckpt / f"zero{stage}")
    assert set(written) == set(reference) | {"lm_head.weight"}
    frozen = [k for k in reference if k.startswith("model.layers.1.mlp.")]
    assert len(frozen) == 3 and all(reference[k].dtype == torch.bfloat16 for k in frozen)  # kept as trained
    for key, value in reference.items():
        # zero_to_fp32 keeps frozen parameters in their training dtype; widening bf16 to fp32 is exact
        assert torch.equal(_bits(written[key]), _bits(value.to(torch.float32))), key
    assert torch.equal(_bits(written["lm_head.weight"]), _bits(written["model.embed_tokens.weight"]))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]


@pytest.mark.slow
@pytest.mark.parametrize("stage,strategy", [(2, "dedupe"), (3, "clone")])
def test_bf16_equals_the_engine_model_and_loads_tied(engine_checkpoints, tmp_path, stage, strategy):
    from transformers import AutoModelForCausalLM

    from patcher.checkpoint.check.load import dtype_kwarg

    ckpt, model_dir = engine_checkpoints
    out = tmp_path / "out"
    given = ckpt / f"zero{stage}" / ("global_step1" if stage == 2 else "")  # the step folder itself, or its parent
    result = convert(given, config=model_dir, output=out, dtype="auto", strategy=strategy)
    assert result.ok, result.checks
    assert result.dtype == "bfloat16" and result.tensors == (310 if strategy == "dedupe" else 311)
    assert result.tag == "global_step1"
    ref = torch.load(str(ckpt / f"zero{stage}" / "reference.pt"), weights_only=True)
    written = _read(out)
    assert ("lm_head.weight" in written) == (strategy == "clone")
    for key, value in written.items():
        assert torch.equal(_bits(value), _bits(ref["state_dict"][key])), key  # the engine's bf16 weights

    kwargs = {dtype_kwarg(): torch.bfloat16}
    if ref.get("attn_implementation"):
        kwargs["attn_implementation"] = ref["attn_implementation"]
    model = AutoModelForCausalLM.from_pretrained(str(out), **kwargs).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        logits = model(input_ids=ref["probe"]).logits.float()
    assert torch.equal(logits, ref["logits"])


@pytest.mark.slow
@pytest.mark.parametrize("stage,given", [(2, "root"), (3, "step")])
def test_universal_fp32_is_bit_equal_to_zero_to_fp32(engine_checkpoints, universal_checkpoints, tmp_path, stage, given):
    """ds_to_universal's folder, found through latest_universal (ZeRO-2) or given itself (ZeRO-3), gives the
    engine checkpoint's own fp32 master weights; the tie comes from the recorded shared_params."""
    ckpt, model_dir = engine_checkpoints
    source = universal_checkpoints / f"zero{stage}"
    assert (source / "latest_universal").read_text() == "global_step1_universal"
    out = tmp_path / "out"
    result = convert(source if given == "root" else source / "global_step1_universal", config=model_dir, output=out,
                                   dtype="fp32")
    assert result.ok, result.checks
    assert (result.kind, result.stage, result.world, result.tensors, result.tag) == \
        ("deepspeed-universal-checkpoint", stage, 2, 311, "global_step1_universal")
    assert result.to_dict()["kind"] == "deepspeed-universal-checkpoint" and "universal checkpoint" in result.describe()
    written, reference = _read(out), _zero_to_fp32(ckpt / f"zero{stage}")
    assert set(written) == set(reference) | {"lm_head.weight"}
    for key, value in reference.items():
        assert torch.equal(_bits(written[key]), _bits(value.to(torch.float32))), key
    assert torch.equal(_bits(written["lm_head.weight"]), _bits(written["model.embed_tokens.weight"]))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]


@pytest.mark.slow
def test_universal_bf16_equals_the_engine_model(engine_checkpoints, universal_checkpoints, tmp_path):
    ckpt, model_dir = engine_checkpoints
    result = convert(universal_checkpoints / "zero3", config=model_dir, output=tmp_path / "out", strategy="dedupe")
    assert result.ok and result.dtype == "bfloat16" and result.tensors == 310, result.checks
    assert result.check("load").ok and "tied to the input embedding" in result.check("load").detail
    ref = torch.load(str(ckpt / "zero3" / "reference.pt"), weights_only=True)["state_dict"]
    for key, value in _read(tmp_path / "out").items():
        assert torch.equal(_bits(value), _bits(ref[key])), key


@pytest.mark.slow
@pytest.mark.parametrize("run", LORA_RUNS, ids=lambda r: f"zero{r['stage']}")
def test_lora_run_fused_equals_what_step1_saves(engine_checkpoints, tmp_path, run):
    """The LoRA run's engine checkpoint converted: bit for bit what the run's own patched step-1 save wrote after
    fusing (convert_lora_to_linear_layer's arithmetic), no LoRA names; --keep-lora adds the factors' file."""
    from safetensors import safe_open

    ckpt, model_dir = engine_checkpoints
    source, keep = ckpt / f"lora{run['stage']}", run["stage"] == 3
    result = convert(source, config=model_dir, output=tmp_path / "out", lora_scaling=run.get("scaling"), keep_lora=keep)
    assert result.ok, result.checks
    assert result.lora == {"layers": 196, "ranks": [run["dim"]], "lora_scaling": float(run.get("scaling", 1)),
                           "scaling_given": "scaling" in run, "dtype": "bfloat16", "kept": keep}
    assert f"lora_scaling {run.get('scaling', 1):g}" in result.message and "lora" in [c.name for c in result.checks]
    written, saved = _read(tmp_path / "out"), _read(source / "hf")
    assert len(written) == 311 and set(written) == set(saved) and not [k for k in written if "lora" in k]
    for key in saved:
        assert torch.equal(_bits(written[key]), _bits(saved[key])), key
    base = load.load_deepspeed(next((source / "global_step1").glob("*model_states.pt")))["frozen_param_fragments"]
    name = "model.layers.0.self_attn.q_proj.weight"
    if run["stage"] == 2:  # the fusion changed the frozen base weight (ZeRO-3 keeps only a slice a rank)
        assert not torch.equal(written[name], base[name])
    assert ("lora.safetensors" in result.written) == keep
    if keep:
        with safe_open(str(tmp_path / "out" / "lora.safetensors"), framework="pt") as f:
            assert len(list(f.keys())) == 392 and f.metadata()["lora_scaling"] == "2"
            assert list(f.get_slice(name.replace("weight", "lora_right_weight")).get_shape()) == [64, 8]


@pytest.mark.slow
def test_lora_scaling_is_refused_without_lora_and_changes_the_fusion(engine_checkpoints, tmp_path):
    ckpt, model_dir = engine_checkpoints
    with pytest.raises(DsfixError) as info:
        convert(ckpt / "zero2", config=model_dir, output=tmp_path / "a", lora_scaling=2.0, keep_lora=True)
    assert "--lora-scaling and --keep-lora: this checkpoint holds no DeepSpeed-Chat LoRA factors" in str(info.value)
    result = convert(ckpt / "lora2", config=model_dir, output=tmp_path / "b", lora_scaling=3.0, load=False)
    saved, written = _read(ckpt / "lora2" / "hf"), _read(tmp_path / "b")
    assert result.ok and result.lora["lora_scaling"] == 3.0
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(written[q_proj], saved[q_proj])
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
@pytest.mark.parametrize("run,words", [
    ("muon", "refused: a Muon optimizer (the saved config's optimizer type), whose states are not Adam's"),
    ("autotp", "refused: tensor-parallel files (bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"),
])
def test_real_muon_and_autotp_checkpoints_are_refused(engine_checkpoints, tmp_path, run, words):
    """Checkpoints DeepSpeed wrote itself with its Muon optimizer and with AutoTP: one line, exit 2, nothing written;
    the Muon run's files also hold Muon's states and parameter groups, which are refused on their own."""
    ckpt, model_dir = engine_checkpoints
    with pytest.raises(DsfixError) as info:
        convert(ckpt / run, config=model_dir, output=tmp_path / "out")
    assert info.value.code == 2 and words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    if run == "muon":
        osd = load.load_deepspeed(ckpt / "muon" / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
        with pytest.raises(DsfixError, match="refused: (Muon parameter groups|optimizer states momentum_buffer)"):
            refuse.optimizer_states(osd["optimizer_state_dict"], "muon")


@pytest.mark.slow
def test_bad_checkpoints_get_one_line_and_nothing_written(engine_checkpoints, tmp_path):
    ckpt, model_dir = engine_checkpoints
    cases = {}
    for name in ("missing", "truncated", "latest", "vocab", "tp", "muon"):
        shutil.copytree(ckpt / "zero2", tmp_path / name)
        cases[name] = tmp_path / name
    step = "global_step1"
    (cases["missing"] / step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    victim = cases["truncated"] / step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(victim, victim.stat().st_size // 2)
    (cases["latest"] / "latest").write_text("global_step7")
    os.rename(cases["tp"] / step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",  # a second tensor-parallel rank
              cases["tp"] / step / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt")
    victim = cases["muon"] / step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"  # Muon's state on one rank
    states = torch.load(str(victim), weights_only=False)
    states["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["momentum_buffer"] = torch.zeros(4)
    torch.save(states, str(victim))
    expect = {"missing": "rank 1's file bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is missing",
              "truncated": "truncated", "latest": "latest names 'global_step7'",
              "tp": "refused: tensor-parallel files (bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
              "muon": "refused: optimizer states momentum_buffer"}
    for name, words in expect.items():
        with pytest.raises(DsfixError) as info:
            convert(cases[name], config=model_dir, output=tmp_path / f"out-{name}")
        assert words in str(info.value) and "\n" not in str(info.value) and info.value.code == 2
        assert not (tmp_path / f"out-{name}").exists()

    wrong = tmp_path / "wrong-vocab"  # a config that does not describe the checkpoint: reported, not guessed
    shutil.copytree(model_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["vocab_size"] = 640
    (wrong / "config.json").write_text(json.dumps(cfg))
    result = convert(cases["vocab"], config=wrong, output=tmp_path / "out-vocab")
    assert not result.ok and result.exit_code == 1
    assert "512 rows but config.json's vocab_size is 640" in result.check("vocab").detail
    assert not (tmp_path / "out-vocab").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]



@pytest.mark.slow
def test_every_file_is_on_disk_before_the_rename_and_a_failed_fsync_writes_nothing(engine_checkpoints, tmp_path,
                                                                                  monkeypatch):
    """The staged files are fsynced on a thread while they are checked: the rename still comes after every one."""
    ckpt, model_dir = engine_checkpoints
    synced, renamed = set(), []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        real_fsync(fd)
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))

    def rename(src, dst):
        renamed.append({p.name for p in Path(src).iterdir() if os.path.realpath(p) not in synced})
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    result = convert(ckpt / "zero3", config=model_dir, output=tmp_path / "out")
    assert result.ok and "config.json" in result.written
    assert renamed == [set()]  # not one file unsynced when the folder was renamed into place

    def eio(folder):
        raise OSError(errno.EIO, "Input/output error")

    from patcher.checkpoint.write import stage

    monkeypatch.setattr(stage, "fsync_folder", eio)
    with pytest.raises(DsfixError) as info:
        convert(ckpt / "zero3", config=model_dir, output=tmp_path / "out-eio")
    assert "cannot write the converted files: Input/output error; nothing written" in str(info.value)
    assert not (tmp_path / "out-eio").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]

def _cli(*args):
    """``dsfix convert ARGS`` through the command line in this process (patchkit.cli_completed)."""
    from patchkit import cli_completed

    return cli_completed("convert", *args)


@pytest.mark.slow
def test_cli_converts_with_json_and_refuses_a_tampered_checkpoint(engine_checkpoints, tmp_path):
    ckpt, model_dir = engine_checkpoints
    proc = _cli(ckpt / "zero3", "--config", model_dir, "--output", tmp_path / "out", "--dtype", "bf16",
                "--strategy", "dedupe", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["status"], data["zero_stage"], data["tensors"], data["dtype"]) == ("converted", 3, 310, "bfloat16")
    assert "a DeepSpeed engine checkpoint (global_step1, ZeRO-3, 2 rank(s)" in proc.stderr

    tampered = tmp_path / "tampered"
    shutil.copytree(ckpt / "zero2", tampered)
    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": _RunsCode(marker)},
               tampered / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    proc = _cli(tampered, "--config", model_dir, "--output", tmp_path / "out2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused" in lines[0] and "system" in lines[0], proc.stderr
    assert not marker.exists() and not (tmp_path / "out2").exists()

    proc = _cli(ckpt / "zero2", "--output", tmp_path / "out3")  # no --config
    assert proc.returncode == 2 and "needs --config" in proc.stderr

    # a LoRA run: the output says which lora_scaling it fused with; verify --against its own step-1 save
    proc = _cli(ckpt / "lora2", "--config", model_dir, "--output", tmp_path / "lora", "--no-load", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["lora"]["lora_scaling"] == 1.0
    assert ("LoRA fused into 196 layers with lora_scaling 1 (step 1's default; --lora-scaling to change; "
            "scaling = lora_scaling / r, r = 4)") in proc.stderr.splitlines()[-1]
    from patchkit import cli

    code, out, _ = cli("verify", tmp_path / "lora", "--against", ckpt / "lora2" / "hf", "--json")
    assert code == 0
    assert json.loads(out)["message"] == f"matches {ckpt / 'lora2' / 'hf'}: 311 tensors compared, 311 bit-equal"
    code, out, _ = cli("verify", tmp_path / "out", "--against", ckpt / "lora2" / "hf", "--json")  # dedupe, another run
    report = json.loads(out)
    assert code == 1 and report["message"].startswith(f"differs from {ckpt / 'lora2' / 'hf'}: values: ")
    assert report["folders"][0]["first_difference"].startswith("values: ")


@pytest.mark.slow
def test_benchmark_runs_on_a_checkpoint_and_prints_the_ratios(engine_checkpoints, tmp_path):
    """benchmarks/bench_engine.py on the small checkpoint (no timing asserted): the table, the ratio, the
    zero_to_fp32 --safe_serialization failure on a tied model, and nothing left behind."""
    ckpt, model_dir = engine_checkpoints
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_engine.py")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "GITHUB_ACTIONS", "PY_COLORS")}
    proc = subprocess.run([sys.executable, script, "--checkpoint", str(ckpt / "zero3"), "--model", str(model_dir),
                           "--methods", "z2f_safe,z2f_bf16,dsfix_bf16", "--rounds", "1", "--tmpdir", str(tmp_path),
                           "--json", str(tmp_path / "bench.json")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| method | dtype | wall s | range s | CPU s | tensors |" in proc.stdout
    assert "dsfix convert --dtype bf16 / zero_to_fp32 .bin bf16 (dtype=bfloat16): time" in proc.stdout
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert results["z2f_safe"]["returncode"] != 0 and "share memory" in results["z2f_safe"]["error"]
    assert (results["dsfix_bf16"]["tensors"], results["z2f_bf16"]["tensors"]) == (311, 311)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


@pytest.mark.slow
def test_shards_and_index_above_the_shard_size(engine_checkpoints, tmp_path):
    from safetensors import safe_open

    ckpt, model_dir = engine_checkpoints
    out = tmp_path / "out"
    result = convert(ckpt / "zero3", config=model_dir, output=out, dtype="bf16", max_shard_size=400_000)
    assert result.ok, result.checks
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and set(shards) <= set(result.written)
    assert len(index["weight_map"]) == 311
    assert result.check("load").ok and result.check("files").ok
    for shard in shards:  # every tensor at a multiple of its element size, as safetensors' own writer puts it
        with open(out / shard, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        assert all(v["data_offsets"][0] % 2 == 0 for k, v in header.items() if k != "__metadata__")
        with safe_open(str(out / shard), framework="pt") as f:
            assert set(f.keys()) == {k for k, s in index["weight_map"].items() if s == shard}


@pytest.mark.slow
@pytest.mark.parametrize("point, done", [("convert.staged", False), ("convert.committed", True)])
def test_cli_stopped_before_and_after_the_rename(engine_checkpoints, tmp_path, point, done):
    """Ctrl-C (a real SIGINT at a named point, patcher.errors.stop_point) just before the converted folder is
    renamed into place leaves nothing; just after, the folder is whole, and the line says which."""
    from smokekit import REPO

    ckpt, model_dir = engine_checkpoints
    env = {**os.environ, "DSFIX_STOP_AT": point, "NO_COLOR": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "patcher", "convert", str(ckpt / "zero2"), "--config", str(model_dir),
                           "--output", str(tmp_path / "out"), "--no-load"], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dsfix: ")]
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = "the converted folder is in place" if done else "nothing was written"
    assert lines == [f"dsfix: interrupted: {said}"]
    assert (tmp_path / "out" / "model.safetensors").is_file() is done
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]
