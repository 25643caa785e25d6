"""The fault sweep (issue 33; docs/faults.md): every filesystem call of apply, revert, revert --force, convert
of a .bin folder, engine convert and smoke --keep, failed once with each errno and killed once, with nothing
lost (tests/sweepkit.py says what each trial checks).

The main suite runs a fast subset (a few calls of each kind, EIO, and a kill through a real ``python -m
patcher`` process); the full sweep is in the extended tier (``python -m pytest -q --extended``).
"""
from __future__ import annotations

import os
import shutil

import pytest

from faultkit import KINDS, hook_env, read_record, snapshot
from patchkit import FIXTURES, cli, run
from sweepkit import Op, Sweep, call_sites, cli_json, engine_op

UTILS = "dschat/utils/utils.py"
MAIN = "training/step1_supervised_finetuning/main.py"
# the patch side's own leftovers, which its next run removes: temporary files beside a target, state folders
# moved aside or half-built (patch/state.py: recover, _write_temp)
PATCH_LEFTOVERS = r"(^|/)\.[^/]+\.\d+\.dsfix-tmp$|(^|/)\.dsfix\.(new|old|gone)-\d+(/|$)"


def _checkout(folder, applied=False, edited=False):
    co = folder / "package"
    shutil.copytree(FIXTURES / "package", co)
    if applied:
        assert cli("apply", co)[0] == 0
    if edited:  # an edit after apply where dsfix changed the file: revert refuses, --force keeps it aside
        data = (co / UTILS).read_bytes()
        (co / UTILS).write_bytes(data.replace(b'strategy="clone", max', b'strategy="clone",  max', 1))
    return co


PATCH_OPS = {
    "apply": Op("apply", lambda d: _checkout(d), lambda co: cli_json("apply", co),
                undo=lambda co: cli_json("revert", co), leftover=PATCH_LEFTOVERS),
    "revert": Op("revert", lambda d: _checkout(d, applied=True), lambda co: cli_json("revert", co),
                 leftover=PATCH_LEFTOVERS),
    "revert --force": Op("revert --force", lambda d: _checkout(d, applied=True, edited=True),
                         lambda co: cli_json("revert", "--force", co), leftover=PATCH_LEFTOVERS),
}


def _commit_points(calls):
    """The fast subset: the first call, every rename (where a commit puts things in place, and where the bugs
    the full sweep found were) and the last call."""
    return sorted({0, len(calls) - 1} | {n for n, c in enumerate(calls) if c.kind == "rename"})


def _report(out):
    assert not out.problems, "\n".join(out.problems[:20]) + f"\n({len(out.problems)} problems)"


# ----------------------------------------------------------------------------- the patch side


@pytest.mark.parametrize("name", sorted(PATCH_OPS))
def test_patch_verbs_fast_subset(tmp_path, name):
    """The first call, every rename and the last call, failing with EIO, and a kill before each."""
    sweep = Sweep(PATCH_OPS[name], tmp_path)
    out = sweep.run(_commit_points(sweep.calls), errors=lambda kind: ("EIO",))
    _report(out)
    assert out.failed and out.killed


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(PATCH_OPS))
def test_patch_verbs_every_call(tmp_path, name):
    sweep = Sweep(PATCH_OPS[name], tmp_path)
    out = sweep.run()
    _report(out)
    print(f"{name}: {len(sweep.calls)} calls, {out.failed} failed, {out.survived} survived, {out.killed} killed")


@pytest.mark.slow
def test_a_kill_in_a_real_dsfix_process_and_apply_again(tmp_path):
    """The same kill through the start-up hook, in a real ``python -m patcher apply`` (not a fork): before the
    rename of utils.py into place, then a second apply finishes and revert gives every byte back."""
    co = _checkout(tmp_path)
    before = snapshot(co)
    record = tmp_path / "calls.jsonl"
    assert run("apply", co, env=hook_env([co], record=record)).returncode == 0
    calls = read_record(record)
    assert {c.kind for c in calls} <= set(KINDS)
    after = snapshot(co)
    assert cli("revert", co)[0] == 0 and snapshot(co) == before
    at = next(n for n, c in enumerate(calls) if c.kind == "rename" and c.path.endswith("utils.py"))
    p = run("apply", co, env=hook_env([co], kill_at=at))
    assert p.returncode == -9, p.stderr
    assert snapshot(co)[UTILS] == before[UTILS] and os.path.exists(co / "dschat/utils/dsfix_safetensors.py")
    assert run("apply", co).returncode == 0 and snapshot(co) == after
    assert run("revert", co).returncode == 0 and snapshot(co) == before


# ----------------------------------------------------------------------------- the torch side


def _bin_folder(folder, zero3=False):
    """A step-1 output of the narrow Qwen3 as upstream's unpatched save writes it: pytorch_model.bin (the state
    dict; ``zero3``: named_parameters(), the tied lm_head left out) and config.json."""
    import torch

    from smokekit import narrow_model

    out = folder / "step1"
    out.mkdir()
    model = narrow_model("float32", seed=0)
    state = {k: p.detach().clone() for k, p in model.named_parameters()} if zero3 else model.state_dict()
    torch.save(state, str(out / "pytorch_model.bin"))
    model.config.to_json_file(str(out / "config.json"))
    return out


def _save_file_as_a_write():
    """safetensors' save_file writes from Rust: faultkit counts it as one write call (``also``)."""
    import safetensors.torch

    return [(safetensors.torch, "save_file", "write")]


def convert_op(load=True):
    args = () if load else ("--no-load",)
    return Op("convert", _bin_folder, lambda folder: cli_json("convert", folder, *args),
              leftover=r"(^|/)\.dsfix-convert-", also=_save_file_as_a_write())


@pytest.mark.slow
def test_convert_fast_subset(tmp_path):
    """convert runs with --no-load here and in the full sweep: the load is a read of the staged folder between
    the writes, which makes no call and costs a model build a trial."""
    sweep = Sweep(convert_op(load=False), tmp_path)
    out = sweep.run(_commit_points(sweep.calls), errors=lambda kind: ("EIO",))
    _report(out)


@pytest.mark.extended
def test_convert_every_call(tmp_path):
    sweep = Sweep(convert_op(load=False), tmp_path)
    out = sweep.run()
    _report(out)
    print(f"convert: {len(sweep.calls)} calls, {out.failed} failed, {out.survived} survived, {out.killed} killed")


@pytest.fixture(scope="module")
def engine_checkpoint(request, tmp_path_factory):
    """The ZeRO-3 engine checkpoint of the narrow Qwen3 that the main suite's test_engine.py made and kept in
    pytest's cache (tests/sweepkit.py: keep_checkpoint); where this session runs without that (the extended
    tier alone, on a fresh clone), one launch of 2 CPU ranks makes it, ZeRO-3 only."""
    pytest.importorskip("deepspeed")
    from sweepkit import keep_checkpoint, kept_checkpoint

    kept = kept_checkpoint(request.config.cache)
    if kept is not None:
        return kept
    from smokekit import REPO, launch_ranks

    base = tmp_path_factory.mktemp("engine-ckpt")
    code, output = launch_ranks(REPO / "fixtures" / "step1_trainer" / "engine_ckpt.py",
                                ["--output_dir", base / "ckpt", "--stages", "3", "--no_reference"],
                                env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert code == 0, output[-4000:]
    from transformers import GenerationConfig

    helper = request.getfixturevalue("tiny_qwen3_helper")
    model_dir = base / "model"
    config = helper.tiny_qwen3_config()
    config.architectures = ["Qwen3ForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(model_dir))
    GenerationConfig(max_new_tokens=8).save_pretrained(str(model_dir))
    helper.tiny_qwen3_tokenizer().save_pretrained(str(model_dir))
    keep_checkpoint(request.config.cache, base / "ckpt" / "zero3", model_dir)
    return base / "ckpt" / "zero3", model_dir


@pytest.mark.extended
def test_engine_convert_every_call_site(engine_checkpoint, tmp_path):
    """Every call site (tests/sweepkit.py: call_sites; of 658 calls, 622 are pwrites of tensor pieces through one
    line), each errno, and a kill before each; DSFIX_SWEEP_EVERY_CALL=1 runs every call instead."""
    sweep = Sweep(engine_op(*engine_checkpoint), tmp_path)
    points = None if os.environ.get("DSFIX_SWEEP_EVERY_CALL") else call_sites(sweep.calls)
    out = sweep.run(points)
    _report(out)
    print(f"engine convert: {len(sweep.calls)} calls, {len(points or sweep.calls)} swept, {out.failed} failed, "
          f"{out.survived} survived, {out.killed} killed")
