"""dsfix convert of DeepSpeed engine checkpoints (patcher/checkpoint/engine.py).

Fast tier: the flat-partition maps against partitions built here the way DeepSpeed lays them out, the
weights-only loader and its allow-list, finding the step folder. Slow tier: one launch of 2 CPU ranks
(gloo) saves real engine checkpoints of the narrow tied Qwen3 at ZeRO-2 and ZeRO-3 after a training step,
with one frozen module; each is converted and compared with DeepSpeed's own zero_to_fp32 reconstruction
and with the engine's own gathered model.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from patcher.checkpoint import engine
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
        out[p.name][p.dst:p.dst + p.count] = parts[p.rank][p.group][p.src:p.src + p.count]
        seen[p.name] += p.count
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
    pieces = engine.zero12_pieces(groups, sizes, world, paddings)
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
    pieces = engine.zero3_pieces(params, world, sizes)
    out, seen = _rebuild(pieces, parts, dict(params))
    assert seen == dict(params)
    for name, value in values.items():
        assert torch.equal(out[name], value), name


@pytest.mark.parametrize("call,message", [
    (lambda: engine.zero12_pieces([[("a", 10)]], [4], 2), "need 10 elements"),
    (lambda: engine.zero12_pieces([[("a", 2)]], [8], 2), "not the layout"),
    (lambda: engine.zero12_pieces([[("a", 2), ("b", 2)]], [2], 2, [[0]]), "paddings for 2 parameters"),
    (lambda: engine.zero3_pieces([("a", 10)], 2, [4]), "hold 4 elements"),
])
def test_maps_refuse_partitions_that_do_not_fit(call, message):
    with pytest.raises(ValueError, match=message):
        call()


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
    osd = engine.load_pt(path)["optimizer_state_dict"]
    assert type(osd["loss_scaler"]) is engine.LossScalerRecord and osd["loss_scaler"].cur_scale == 1.0
    assert type(osd["dynamic"]) is engine.DynamicLossScalerRecord and osd["dynamic"].dtype is torch.float16
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
        engine.load_pt(path)
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
        engine.load_pt(path)


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
    (lambda root: _fake_step(root, ranks=(0, 2)), None, "rank 1's file bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"),
    (lambda root: (_fake_step(root, ranks=(0, 1)), (root / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()),
     None, "rank 1's file zero_pp_rank_1_mp_rank_00_model_states.pt is missing"),
    (lambda root: (root.mkdir(), (root / "mp_rank_00_model_states.pt").touch()), None, "no *_optim_states.pt"),
])
def test_find_layout(tmp_path, setup, tag, expect):
    root = tmp_path / "root"
    setup(root)
    assert engine.is_engine_checkpoint(root)
    if expect.startswith(("global_step", "root")):
        layout = engine.find_layout(root, tag)
        assert layout.folder.name == expect and len(layout.optim_files) == 2
    else:
        with pytest.raises(DsfixError) as info:
            engine.find_layout(root, tag)
        assert expect in str(info.value) and "\n" not in str(info.value)


def test_a_bin_folder_is_not_an_engine_checkpoint(tmp_path):
    (tmp_path / "pytorch_model.bin").touch()
    (tmp_path / "config.json").write_text("{}")
    assert not engine.is_engine_checkpoint(tmp_path)


# --------------------------------------------------------------------------- real engines on 2 CPU ranks


@pytest.fixture(scope="session")
def engine_checkpoints(tmp_path_factory, tiny_qwen3_helper):
    """One launch of 2 CPU ranks (gloo): engine checkpoints of the narrow tied Qwen3 at ZeRO-2 and ZeRO-3, each
    after one bf16 training step with model.layers.1.mlp frozen, plus each engine's gathered model and logits
    (reference.pt), and a model folder (config, generation config, tokenizer) for --config."""
    pytest.importorskip("deepspeed")
    from patcher.checkpoint.ranks import deepspeed_launcher, free_port, rank_env, run_group
    from smokekit import LAUNCH_TIMEOUT_S, REPO

    launcher = deepspeed_launcher()
    if launcher is None:
        pytest.skip("the deepspeed launcher is not installed")
    base = tmp_path_factory.mktemp("engine-ckpt")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "fixtures" / "step1_trainer" / "engine_ckpt.py"), "--output_dir", str(base / "ckpt"),
           "--stages", "2,3"]
    env = rank_env(nproc=2)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    code, output = run_group(cmd, env, LAUNCH_TIMEOUT_S, cwd=str(REPO))
    if code is None:
        pytest.fail("the ranks ran past %ds:\n%s" % (LAUNCH_TIMEOUT_S, output[-4000:]))
    assert code == 0, output[-4000:]

    from transformers import GenerationConfig

    model_dir = base / "model"
    config = tiny_qwen3_helper.tiny_qwen3_config()
    config.architectures = ["Qwen3ForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(model_dir))
    GenerationConfig(max_new_tokens=8).save_pretrained(str(model_dir))
    tiny_qwen3_helper.tiny_qwen3_tokenizer().save_pretrained(str(model_dir))
    return base / "ckpt", model_dir


def _zero_to_fp32(ckpt):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def _read(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _bits(t):
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_is_bit_equal_to_zero_to_fp32(engine_checkpoints, tmp_path, stage):
    ckpt, model_dir = engine_checkpoints
    out = tmp_path / "out"
    result = engine.convert_engine(ckpt / f"zero{stage}", model_dir, out, dtype="fp32", strategy="clone")
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
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(engine.STAGING_PREFIX)]


@pytest.mark.slow
@pytest.mark.parametrize("stage,strategy", [(2, "dedupe"), (3, "clone")])
def test_bf16_equals_the_engine_model_and_loads_tied(engine_checkpoints, tmp_path, stage, strategy):
    from transformers import AutoModelForCausalLM

    from patcher.checkpoint.verify import dtype_kwarg

    ckpt, model_dir = engine_checkpoints
    out = tmp_path / "out"
    result = engine.convert_engine(ckpt / f"zero{stage}", model_dir, out, dtype="auto", strategy=strategy)
    assert result.ok, result.checks
    assert result.dtype == "bfloat16" and result.tensors == (310 if strategy == "dedupe" else 311)
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
def test_bad_checkpoints_get_one_line_and_nothing_written(engine_checkpoints, tmp_path):
    ckpt, model_dir = engine_checkpoints
    cases = {}
    for name in ("missing", "truncated", "latest", "vocab"):
        shutil.copytree(ckpt / "zero2", tmp_path / name)
        cases[name] = tmp_path / name
    step = "global_step1"
    (cases["missing"] / step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    victim = cases["truncated"] / step / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(victim, victim.stat().st_size // 2)
    (cases["latest"] / "latest").write_text("global_step7")
    expect = {"missing": "rank 1's file bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is missing",
              "truncated": "truncated", "latest": "latest names 'global_step7'"}
    for name, words in expect.items():
        with pytest.raises(DsfixError) as info:
            engine.convert_engine(cases[name], model_dir, tmp_path / f"out-{name}")
        assert words in str(info.value) and "\n" not in str(info.value) and info.value.code == 2
        assert not (tmp_path / f"out-{name}").exists()

    wrong = tmp_path / "wrong-vocab"  # a config that does not describe the checkpoint: reported, not guessed
    shutil.copytree(model_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["vocab_size"] = 640
    (wrong / "config.json").write_text(json.dumps(cfg))
    result = engine.convert_engine(cases["vocab"], wrong, tmp_path / "out-vocab")
    assert not result.ok and result.exit_code == 1
    assert "512 rows but config.json's vocab_size is 640" in result.check("vocab").detail
    assert not (tmp_path / "out-vocab").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(engine.STAGING_PREFIX)]


def _cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "GITHUB_ACTIONS", "PY_COLORS")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "patcher", "convert", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


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


@pytest.mark.slow
def test_benchmark_runs_on_a_checkpoint_and_prints_the_ratios(engine_checkpoints, tmp_path):
    """benchmarks/bench_engine.py on the small checkpoint (no timing asserted): the table, the ratio, the
    zero_to_fp32 --safe_serialization failure on a tied model, and nothing left behind."""
    ckpt, model_dir = engine_checkpoints
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_engine.py")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "GITHUB_ACTIONS", "PY_COLORS")}
    proc = subprocess.run([sys.executable, script, "--checkpoint", str(ckpt / "zero3"), "--model", str(model_dir),
                           "--methods", "z2f_safe,z2f_bf16,dsfix_bf16", "--tmpdir", str(tmp_path),
                           "--json", str(tmp_path / "bench.json")], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| method | dtype | wall s | tensors |" in proc.stdout
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
    result = engine.convert_engine(ckpt / "zero3", model_dir, out, dtype="bf16", max_shard_size=400_000)
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
@pytest.mark.parametrize("point, done", [("engine.staged", False), ("engine.renamed", True)])
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
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(engine.STAGING_PREFIX)]
