"""Ctrl-C at a named point: one line saying what state the files are in, exit 130, no traceback, and the files
as that line says. A real process stops itself with a real SIGINT where DSFIX_STOP_AT names a point
(patcher.errors.stop_point), so the handlers that run are the real ones and no test races a timer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from patcher.errors import AS_THEY_WERE, NOTHING_WRITTEN, ON_INTERRUPT
from patcher.report import ErrorResult
from patchkit import CLEAN_ENV, FIXTURES, REPO, copy_fixture, run, snapshot

pytestmark = pytest.mark.slow  # real processes: about a second each, smoke and convert a few more

UTILS = "dschat/utils/utils.py"
MAIN = "training/step1_supervised_finetuning/main.py"
NARROW = REPO / "fixtures" / "models" / "qwen3-narrow" / "config.json"


def _stop(point: str, *args, tmp=None, expect_rc=130):
    """Run dsfix, stopped at ``point``; (the one stderr line, stdout)."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DSFIX_STOP_AT": point}
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    p = run(*args, env=env, timeout=600)
    text = p.stderr.decode()
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("dsfix: ")]  # progress lines are "dsfix smoke: "
    assert p.returncode == expect_rc and len(lines) == 1, (p.returncode, text[-3000:])
    return lines[0], p.stdout


def _line(key, done=False):
    before, after = ON_INTERRUPT[key]
    return f"dsfix: interrupted: {after if done else before}"


def test_during_the_start_up_imports_the_json_is_the_error_result():
    line, out = _stop("startup", "check", ".", "--json")
    assert line == f"dsfix: interrupted: {NOTHING_WRITTEN}"
    assert json.loads(out) == ErrorResult.interrupted("check", f"interrupted: {NOTHING_WRITTEN}").to_dict()


def _apply(co):
    p = run("apply", co)
    assert p.returncode == 0, p.stderr
    return co


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """The fixture checkout's files as apply leaves them (the state folder left out)."""
    co = _apply(copy_fixture("package", tmp_path_factory.mktemp("applied")))
    return {rel: data for rel, data in snapshot(co).items() if not rel.startswith(".dsfix")}


APPLY_POINTS = [  # (point, done): the commit's steps, in order
    ("commit.staged", False),  # every new byte written aside, the state folder not swapped in
    ("commit.swapped", False),  # the new state folder in place, no target renamed
    ("commit.renamed#1", False),  # the save module in place (a new file), utils.py and main.py not
    ("commit.renamed#2", False),  # the save module and utils.py in place, main.py not
    ("commit.renamed#3", False),  # all three in place, the commit not finished
    ("commit.done", True),
]


@pytest.mark.parametrize("point,done", APPLY_POINTS)
def test_apply_stopped_at_each_step_of_its_commit(tmp_path, patched, point, done):
    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    line, _ = _stop(point, "apply", co)
    assert line == _line("apply", done) and (done or line == f"dsfix: interrupted: {AS_THEY_WERE}")
    now = snapshot(co)
    if done:
        assert {rel: now[rel] for rel in patched} == patched and (co / ".dsfix" / "state.json").is_file()
    else:
        assert now == before, "rolled back: every file as it was, no state folder, no temporary file"
        assert sorted(os.listdir(co)) == sorted(os.listdir(FIXTURES / "package"))


@pytest.mark.parametrize("point,done", [("commit.renamed#1", False), ("commit.done", True)])
def test_revert_stopped_in_its_commit(tmp_path, patched, point, done):
    co = copy_fixture("package", tmp_path)
    original = snapshot(co)
    applied = snapshot(_apply(co))
    line, _ = _stop(point, "revert", co)
    assert line == _line("revert", done)
    if not done:
        assert snapshot(co) == applied
        return
    now = snapshot(co)
    assert {rel: now[rel] for rel in original} == original
    # the old state folder may still be there under a name the next run removes (.dsfix.gone-PID: the commit
    # had not deleted it yet); that run finds nothing to revert
    assert [rel for rel in now if rel not in original] == [rel for rel in now if rel.startswith(".dsfix.gone-")]
    assert subprocess.run([sys.executable, "-m", "patcher", "revert", str(co)], env=CLEAN_ENV).returncode == 0
    assert snapshot(co) == original


@pytest.fixture(scope="module")
def patched_checkout(tmp_path_factory):
    return _apply(copy_fixture("package", tmp_path_factory.mktemp("smoke")))


def test_smoke_stopped_after_the_save_removes_the_keep_folder_it_made(tmp_path, patched_checkout):
    """The save has written the --keep folder, verify has not started: smoke takes back the folder it made
    (and the parent it made for it), its temporary folders too, and the checkout is untouched."""
    before = snapshot(patched_checkout)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    keep = tmp_path / "new" / "out"
    line, out = _stop("smoke.verify", "smoke", patched_checkout, "--device", "cpu", "--config", NARROW,
                      "--keep", keep, "--json", tmp=tmp)
    assert line == f"dsfix: interrupted: {NOTHING_WRITTEN}" and json.loads(out)["exit_code"] == 130
    assert not (tmp_path / "new").exists() and not [n for n in os.listdir(tmp) if n.startswith("dsfix")]
    assert snapshot(patched_checkout) == before


def test_smoke_stopped_once_done_keeps_the_folder_and_says_so(tmp_path, patched_checkout):
    keep = tmp_path / "empty"
    keep.mkdir()
    line, _ = _stop("smoke.done", "smoke", patched_checkout, "--device", "cpu", "--config", NARROW, "--keep", keep)
    assert line == _line("smoke --keep", done=True)
    assert (keep / "model.safetensors").is_file() and (keep / "config.json").is_file()


def test_smoke_stopped_before_the_save_empties_a_keep_folder_that_was_there(tmp_path, patched_checkout):
    keep = tmp_path / "empty"
    keep.mkdir()
    line, _ = _stop("smoke.save", "smoke", patched_checkout, "--device", "cpu", "--config", NARROW, "--keep", keep)
    assert line == f"dsfix: interrupted: {NOTHING_WRITTEN}"
    assert keep.is_dir() and os.listdir(keep) == []


@pytest.fixture(scope="module")
def bin_folder(tmp_path_factory):
    """A step-1 .bin output of the narrow Qwen3, as upstream's save_hf_format writes it."""
    import torch

    from smokekit import narrow_model

    out = tmp_path_factory.mktemp("bin") / "step1"
    out.mkdir()
    model = narrow_model("float32")
    torch.save(model.state_dict(), str(out / "pytorch_model.bin"))
    model.config.to_json_file(str(out / "config.json"))
    return out


@pytest.mark.parametrize("point,done", [("convert.staged", False), ("convert.committed", True)])
def test_convert_stopped_before_and_after_its_commit(tmp_path, bin_folder, point, done):
    import shutil

    folder = shutil.copytree(bin_folder, tmp_path / "step1")
    before = snapshot(folder)
    line, _ = _stop(point, "convert", folder, "--no-load")
    assert line == _line("convert", done)
    now = snapshot(folder)
    if done:
        assert "model.safetensors" in now and {k: now[k] for k in before} == before, ".bin kept, safetensors in place"
    else:
        assert now == before, "every folder as it was, no staging folder"
