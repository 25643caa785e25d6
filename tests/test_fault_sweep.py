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

from faultkit import ERRNOS, KINDS, hook_env, read_record, snapshot
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
    out = sweep.run(undo_at=set(_commit_points(sweep.calls)))  # every kill is run again; reverted at commit points
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

    kept = kept_checkpoint(getattr(request.config, "cache", None))
    if kept is not None:
        return kept
    from smokekit import REPO, launch_ranks

    base = tmp_path_factory.mktemp("engine-ckpt")
    run = launch_ranks(REPO / "fixtures" / "step1_trainer" / "engine_ckpt.py",
                       ["--output_dir", base / "ckpt", "--stages", "3", "--no_reference"],
                       env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert run.ok and "[engine_ckpt] saved stages 3" in run.output, run.report()
    from transformers import GenerationConfig

    helper = request.getfixturevalue("tiny_qwen3_helper")
    model_dir = base / "model"
    config = helper.tiny_qwen3_config()
    config.architectures = ["Qwen3ForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(model_dir))
    GenerationConfig(max_new_tokens=8).save_pretrained(str(model_dir))
    helper.tiny_qwen3_tokenizer().save_pretrained(str(model_dir))
    keep_checkpoint(getattr(request.config, "cache", None), base / "ckpt" / "zero3", model_dir)
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


SMOKE_CONFIG = FIXTURES.parent.parent / "fixtures" / "models" / "qwen3-narrow" / "config.json"
SAVE_LEFTOVERS = r"(^|/)\.dsfix-save-\d+(/|$)|(^|/)\.dsfix-smoke-running$"  # the next save, the next smoke clear them


def _smoke_sweep(tmp_path, choose, errors, full_reruns=1):
    """smoke --keep runs/kept on the patched package checkout, the narrow Qwen3: one child builds and trains the
    model once and forks a trial at the save (sweepkit.fork_at). Returns the problems."""
    import re

    import patcher.checkpoint.smoke as smoke
    from sweepkit import fork_at, one_line

    co = _checkout(tmp_path / "co")
    assert cli("apply", co)[0] == 0
    runs, tmp = tmp_path / "runs", tmp_path / "tmp"
    runs.mkdir()
    tmp.mkdir()
    (runs / "notes.txt").write_text("a file of the user's beside the kept folder\n")
    before = snapshot(runs)
    killed = tmp_path / "killed"
    killed.mkdir()
    seen = {}

    def between():  # the folders as they were at the save: the kept folder smoke made, its work folder
        for live, kept in ((runs, tmp_path / "runs-at-save"), (tmp, tmp_path / "tmp-at-save")):
            if not kept.exists():
                shutil.copytree(live, kept, symlinks=True)
            shutil.rmtree(live)
            shutil.copytree(kept, live, symlinks=True)

    def trials(calls, first):
        seen["calls"] = calls
        points = [n for n in choose(calls) if n >= first]
        return [(n, e) for n in points for e in errors(calls[n][0])] + [(n, None) for n in points]

    def check(trial, status, outcome):
        now = snapshot(runs)
        n, error = trial
        if n == "record":
            seen["after"] = now
            with open(tmp_path / "after.pickle", "wb") as handle:
                pickle.dump(now, handle)
            return [] if outcome and outcome[0] == 0 else [f"the recording failed: {outcome and outcome[2][-500:]}"]
        after, call = seen["after"], seen["calls"][n]
        where = f"smoke --keep: call {n} ({call[0]} {call[1]} {call[2].split('/runs/')[-1]})"
        whole = [rel for rel in now if not re.search(SAVE_LEFTOVERS, rel) and not rel.startswith("kept/dsfix-fallback")
                 and now[rel] != after.get(rel, now[rel] if rel in before else None)]
        if error is None:
            shutil.copytree(runs, killed / str(n), symlinks=True)
            bad = [] if os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9 else [f"not killed ({status})"]
            return [f"{where} killed: " + "; ".join(bad + [f"torn: {whole}"] * bool(whole))] if bad or whole else []
        where += f" failing with {error}"
        if outcome is None:
            return [f"{where}: the trial ended without an outcome (status {status})"]
        code, result, err, failed, _ = outcome
        problems = [] if failed else ["the call was never reached"]
        if code == 0:  # a marker left (its unlink failed) is one the next smoke clears by itself
            same = {k: v for k, v in now.items() if not re.search(SAVE_LEFTOVERS, k)} == after
            problems += [] if same else ["exit 0 but not the complete saved folder"]
        elif code == 1:
            save = next((c for c in (result or {}).get("checks", ()) if c["name"] == "save"), None)
            text = os.strerror(getattr(errno_codes, error))
            if save is None or save["ok"] or text not in save["detail"] or "/" not in save["detail"]:
                problems.append(f"the save check does not name the cause and the path: {save}")
            left = [rel for rel in now if re.search(SAVE_LEFTOVERS, rel)]
            problems += [f"left {left}"] * bool(left) + [f"torn or changed: {whole}"] * bool(whole)
        else:
            problems.append(f"exit {code}: {one_line(err)!r}")
        return [f"{where}: " + "; ".join(problems)] if problems else [f"OUTCOME exit {code}"]

    import errno as errno_codes
    import pickle
    import tempfile

    real_tempdir, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        out = fork_at(smoke, "smoke.save", [runs], trials, lambda: cli_json(
            "smoke", co, "--config", SMOKE_CONFIG, "--keep", runs / "kept"), between, check)
    finally:
        tempfile.tempdir = real_tempdir
    if not (tmp_path / "after.pickle").exists():
        return out[0] or [], [f"the recording did not end: {out[1:]}"]
    with open(tmp_path / "after.pickle", "rb") as handle:
        after = pickle.load(handle)
    outcomes = [p for p in out[1:] if p and p.startswith("OUTCOME ")]
    problems = [p for p in out[1:] if p and not p.startswith("OUTCOME ")]
    print(f"smoke --keep (a): {outcomes.count('OUTCOME exit 1')} failed, {outcomes.count('OUTCOME exit 0')} succeeded")
    problems += _after_kills(killed, co, before, after, full_reruns)
    return out[0] or [], problems


def _after_kills(killed, co, before, after, full_reruns):
    """What the next smoke does with the folder a killed one left (its process is gone now): it takes it for
    a killed smoke's, starts from it empty, and (``full_reruns`` of them, the latest kills) ends complete."""
    import patcher.checkpoint.smoke as smoke

    problems = []
    for i, copy in enumerate(sorted(killed.iterdir(), key=lambda p: -int(p.name))):
        kept = copy / "kept"
        if i < full_reruns:
            code, _, err = cli_json("smoke", co, "--config", SMOKE_CONFIG, "--keep", kept)
            if code != 0 or snapshot(copy) != after:
                problems.append(f"smoke --keep: killed before call {copy.name}: a new smoke (exit {code}) did not end "
                                f"complete: {err.strip()[-300:]}")
            continue
        try:
            smoke._check_keep(kept)
            with smoke._out_folder(kept):
                pass
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"smoke --keep: killed before call {copy.name}: the next smoke refuses it: {e}")
            continue
        if snapshot(copy) != {**before, "kept": after["kept"]}:
            problems.append(f"smoke --keep: killed before call {copy.name}: the next smoke does not start from an "
                            f"empty folder: {sorted(set(snapshot(copy)) - set(before))}")
    return problems


@pytest.mark.extended
def test_smoke_keep_every_call_site(tmp_path):
    """smoke --keep on the narrow Qwen3, one model build: every call site of the save (sweepkit.call_sites),
    each errno, and a kill before each; the two latest kills run again to the end, the others to the start of
    the next smoke (which takes the killed one's folder back)."""
    calls, problems = _smoke_sweep(tmp_path, call_sites, lambda kind: ERRNOS[kind], full_reruns=2)
    assert not problems, "\n".join(problems[:30]) + f"\n({len(problems)} problems)"
    print(f"smoke --keep: {len(calls)} calls, {len(call_sites(calls))} swept")


def test_smoke_keep_takes_back_a_killed_smokes_folder_and_only_that(tmp_path):
    """smoke --keep marks the folder while it writes into it (its pid); a smoke killed there leaves the mark,
    and the next smoke --keep takes that folder back (it held nothing but the killed smoke's files) instead of
    refusing it as not empty; a folder marked by a live smoke, or not marked, is still refused."""
    import subprocess
    import sys

    import patcher.checkpoint.smoke as smoke
    from patcher.errors import DsfixError

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    kept = tmp_path / "kept"
    (kept / ".dsfix-save-123").mkdir(parents=True)
    (kept / "model.safetensors").write_bytes(b"half")
    (kept / smoke.KEEP_MARKER).write_text(f"{gone.pid}\n")
    smoke._check_keep(kept)
    with smoke._out_folder(kept) as out:
        assert sorted(os.listdir(out)) == [smoke.KEEP_MARKER]
    assert os.listdir(kept) == []
    for mark in (f"{os.getpid()}\n", None):  # a live smoke's, or a folder of someone's
        (kept / "model.safetensors").write_bytes(b"mine")
        if mark:
            (kept / smoke.KEEP_MARKER).write_text(mark)
        with pytest.raises(DsfixError, match="must be new or empty"):
            smoke._check_keep(kept)
        shutil.rmtree(kept)
        kept.mkdir()
