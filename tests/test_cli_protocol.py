"""The result protocol and the CLI's edges: one shape for every verb's JSON, exit codes per status, one error
path (JSON too), --debug anywhere, check --stat/--quiet, revert outside a checkout, pre-checks. No torch here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.check.verify import VerifyReport
from patcher.checkpoint.convert import CheckpointResult, ConvertReport, ConvertStatus, FolderResult
from patcher.checkpoint.smoke import SmokeReport
from patcher.checkpoint.verify import VerifyResult
from patcher.demo import STEPS, DemoResult, DemoRow
from patcher.errors import ERROR, INTERRUPTED, LOCKED, OK, PENDING
from patcher.patch.flow import FileReport, Outcome, stat_text
from patcher.patch.plan import Status
from patcher.prereq import no_gpu_driver
from patcher.report import COMMON_KEYS, ErrorResult, Verdict
from patcher.report import Status as ResultStatus
from patchkit import CLEAN_ENV, REPO, cli, copy_fixture, run, snapshot

# ----------------------------------------------------------------------------- the protocol, one row a case


def _outcome(verb, *statuses):
    return Outcome(verb, Path("/co"), "package", [FileReport(f"f{i}.py", s) for i, s in enumerate(statuses)],
                   message="m")


def _verify(*oks):
    return VerifyResult("/out", tuple(VerifyReport(f"/out/{i}", ok, (Check("keys", ok, "d"),), 311)
                                      for i, ok in enumerate(oks)))


def _smoke(ok):
    return SmokeReport(ok=ok, checks=(Check("save", ok, "d"),), timings={}, device="cpu", dtype="bf16",
                       zero_stage=0, nproc=1, load_method="import", load_detail="import x", tensors=311)


def _convert(*statuses):
    return ConvertReport("/out", "clone", tuple(FolderResult(f"/out/{i}", s, s.exit_code == OK)
                                                for i, s in enumerate(statuses)))


def _demo(*oks):
    return DemoResult(tuple(DemoRow(step, ok, "d", 0.1) for step, ok in zip(STEPS, oks)))


RESULTS = [  # (id, result, exit code)
    ("check pending", _outcome("check", Status.WOULD_CHANGE, Status.UNCHANGED), PENDING),
    ("check nothing to do", _outcome("check", Status.UNCHANGED), OK),
    ("apply changed", _outcome("apply", Status.CHANGED), OK),
    ("revert restored", _outcome("revert", Status.RESTORED, Status.MERGED), OK),
    ("revert refused", _outcome("revert", Status.RESTORED, Status.REFUSED), PENDING),
    ("verify holds", _verify(True), OK),
    ("verify failed", _verify(False), PENDING),
    ("verify step 3, one failed", _verify(True, False, True), PENDING),
    ("smoke passed", _smoke(True), OK),
    ("smoke failed", _smoke(False), PENDING),
    ("convert converted", _convert(ConvertStatus.CONVERTED, ConvertStatus.NOTHING), OK),
    ("convert nothing", _convert(ConvertStatus.NOTHING), OK),
    ("convert failed", _convert(ConvertStatus.NOT_WRITTEN, ConvertStatus.FAILED), PENDING),
    ("convert engine checkpoint", CheckpointResult("/ckpt", "/out", ConvertStatus.CONVERTED, True,
                                                   (Check("keys", True, "d"),), tag="global_step1", stage=3, world=2,
                                                   tensors=311), OK),
    ("convert engine checkpoint failed", CheckpointResult("/ckpt", "/out", ConvertStatus.FAILED, False,
                                                      (Check("vocab", False, "d"),)), PENDING),
    ("demo passed", _demo(True, True, True, True), OK),
    ("demo failed", _demo(True, True, False, True), PENDING),
    ("demo cut short", _demo(True, True), PENDING),
    ("error", ErrorResult("check", ERROR, "no such folder", path="x/utils.py", line=3), ERROR),
    ("locked", ErrorResult("apply", LOCKED, "another dsfix run"), LOCKED),
    ("interrupted", ErrorResult("revert", INTERRUPTED, "interrupted: nothing was written", kind="interrupted"),
     INTERRUPTED),
]


@pytest.mark.parametrize("result,code", [r[1:] for r in RESULTS], ids=[r[0] for r in RESULTS])
def test_every_result_has_the_common_keys_and_its_exit_code(result, code):
    assert result.exit_code == code
    data = json.loads(result.to_json())
    assert tuple(data)[:4] == COMMON_KEYS
    assert data["exit_code"] == code and data["verb"] == result.verb and isinstance(data["message"], str)
    assert isinstance(data["warnings"], list)
    assert data == json.loads(json.dumps(result.to_dict(), default=str)), "to_dict is JSON as it is"
    status = getattr(result, "status", None)
    assert status is None or isinstance(status, ResultStatus), "a status is a report.Status: it carries the exit code"
    if status is not None:
        assert (tuple(data)[4], data["status"], status.exit_code) == ("status", status.value, code)


def test_every_verb_has_a_row():
    assert {r[1].verb for r in RESULTS} == {"check", "apply", "revert", "verify", "smoke", "convert", "demo"}


@pytest.mark.parametrize("status,code", [(ConvertStatus.CONVERTED, OK), (ConvertStatus.NOTHING, OK),
                                         (ConvertStatus.FAILED, PENDING), (ConvertStatus.NOT_WRITTEN, PENDING),
                                         (Verdict.PASSED, OK), (Verdict.FAILED, PENDING)])
def test_each_status_carries_its_exit_code(status, code):
    assert status.exit_code == code and json.dumps(status) == json.dumps(status.value)


def test_verify_of_one_folder_keeps_its_keys_at_the_top():
    data = _verify(True).to_dict()
    assert data["ok"] is True and data["tensors"] == 311 and data["checks"][0]["name"] == "keys"
    assert len(data["folders"]) == 1
    assert "tensors" not in _verify(True, True).to_dict(), "several folders: each in folders"


# ----------------------------------------------------------------------------- --stat


STATS = [  # (rows, expected)
    ([], ""),
    ([("a.py", 0, 0)], ""),
    ([("a.py", 3, 1)], " a.py | 4 +++-\n 1 file changed, 3 insertions(+), 1 deletion(-)\n"),
    ([("utils.py", 1, 0), ("training/main.py", 2, 2)],
     " utils.py         | 1 +\n training/main.py | 4 ++--\n 2 files changed, 3 insertions(+), 2 deletions(-)\n"),
    ([("u.py", 0, 2)], " u.py | 2 --\n 1 file changed, 2 deletions(-)\n"),
]


@pytest.mark.parametrize("rows,expected", STATS)
def test_stat_text(rows, expected):
    assert stat_text(rows) == expected


def test_stat_text_scales_long_bars_to_the_width():
    text = stat_text([("utils.py", 400, 0), ("main.py", 6, 6)], width=60)
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert lines[0].endswith("| 400 " + "+" * 44) and lines[1].endswith(" +-"), "a small change keeps one mark a side"


# ----------------------------------------------------------------------------- check --stat / --quiet


@pytest.mark.slow
def test_check_stat_and_quiet_keep_the_exit_codes(tmp_path):
    co = copy_fixture("package", tmp_path)
    code, out, err = cli("check", co, "--stat")
    assert code == 1 and b"diff --git" not in out
    assert b"dschat/utils/utils.py " in out and b" 3 files changed, " in out and b"insertions(+)" in out
    assert "3 files would change" in err
    assert cli("check", co, "--quiet") == (1, b"", "")
    assert cli("apply", co, "-q") == (0, b"", "")
    assert cli("check", co, "-q") == (0, b"", "")
    code, out, _ = cli("check", co, "--stat")
    assert code == 0 and out == b""
    code, out, err = cli("revert", co, "--quiet", "--json")
    assert code == 0 and err == "" and json.loads(out)["message"] == "2 files restored, 1 removed"


# ----------------------------------------------------------------------------- one error path


def test_json_error_names_the_file_and_line(tmp_path):
    co = copy_fixture("package", tmp_path)
    utils = co / "dschat/utils/utils.py"
    utils.write_bytes(utils.read_bytes() + b"\ndef broken(:\n")
    before = snapshot(co)
    code, out, err = cli("apply", co, "--json")
    data = json.loads(out)
    assert code == ERROR and data["exit_code"] == ERROR and data["verb"] == "apply"
    assert data["error"]["path"] == "dschat/utils/utils.py" and isinstance(data["error"]["line"], int)
    assert data["error"]["kind"] == "error" and err.startswith("dsfix: error: dschat/utils/utils.py:")
    assert snapshot(co) == before


@pytest.mark.parametrize("args", [("--debug", "check", "MISSING"), ("check", "MISSING", "--debug"),
                                  ("check", "--debug", "MISSING", "--json")])
def test_debug_anywhere_shows_a_traceback_and_keeps_the_exit_code(tmp_path, args):
    args = [str(tmp_path / "nope") if a == "MISSING" else a for a in args]
    code, out, err = cli(*args)
    assert code == ERROR and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("dsfix: error: ")
    if "--json" in args:
        assert json.loads(out)["exit_code"] == ERROR


def test_revert_outside_a_checkout_is_an_error(tmp_path):
    (tmp_path / "notes.py").write_text("print('not a checkout')\n")
    before = snapshot(tmp_path)
    code, out, err = cli("revert", tmp_path, "--json")
    assert code == ERROR and json.loads(out)["exit_code"] == ERROR and "no DeepSpeed-Chat checkout" in err
    assert snapshot(tmp_path) == before
    co = copy_fixture("package", tmp_path)
    assert cli("revert", co)[0] == OK, "a checkout dsfix never patched: nothing to revert"


# ----------------------------------------------------------------------------- pre-checks, before anything


@pytest.mark.parametrize("missing,args,needle", [
    ("safetensors", ("verify", "FOLDER"), "lacks: pip install 'safetensors>=0.4.3' (dsfix's [smoke] extra)"),
    ("torch", ("convert", "FOLDER"), "lacks: pip install 'torch>=2.1' (dsfix's [smoke] extra)"),
    ("transformers", ("smoke", "CO"), "lacks: pip install 'transformers>=4.51' (dsfix's [smoke] extra)"),
    ("transformers", ("demo",), "lacks: pip install 'transformers>=4.51' (dsfix's [smoke] extra)"),
    ("accelerate", ("verify", "FOLDER"), "lacks: pip install 'accelerate>=0.26' (dsfix's [smoke] extra)"),
    ("deepspeed", ("smoke", "CO", "--zero-stage", "3"), "DS_BUILD_OPS=0 pip install deepspeed"),
    ("deepspeed", ("smoke", "CO", "--nproc", "2"), "--nproc 2 needs DeepSpeed"),
])
def test_a_missing_package_is_one_line_naming_what_to_install(tmp_path, monkeypatch, missing, args, needle):
    co = copy_fixture("package", tmp_path / "c")
    monkeypatch.setitem(sys.modules, missing, None)  # find_spec answers None, as for a package not installed
    args = [str(tmp_path) if a == "FOLDER" else str(co) if a == "CO" else a for a in args]
    code, out, err = cli(*args)
    assert code == ERROR and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not no_gpu_driver(), reason="this machine has a GPU driver")
@pytest.mark.parametrize("args", [("smoke", "CO", "--device", "cuda"), ("demo", "--device", "cuda")])
def test_cuda_asked_for_without_a_gpu_is_an_error_before_anything_runs(tmp_path, args):
    co = copy_fixture("package", tmp_path / "c")
    before = snapshot(co)
    code, _, err = cli(*[str(co) if a == "CO" else a for a in args])
    assert code == ERROR and "--device cuda" in err and "use --device cpu" in err
    assert snapshot(co) == before


# ----------------------------------------------------------------------------- a real process


@pytest.mark.slow
def test_json_on_stdout_for_every_error_in_a_real_process(tmp_path):
    p = run("check", tmp_path / "nope", "--json")
    assert p.returncode == ERROR and json.loads(p.stdout)["error"]["kind"] == "error"
    assert p.stderr.decode().startswith("dsfix: error: ") and b"Traceback" not in p.stderr
    p = run("check", "--no-such-option", "--json")
    assert p.returncode == ERROR and json.loads(p.stdout)["error"]["kind"] == "usage"
    p = run("check", tmp_path / "nope", "--json", "--debug")
    assert p.returncode == ERROR and json.loads(p.stdout)["verb"] == "check" and b"Traceback" in p.stderr


# The program ends without the interpreter's teardown (patcher.command.exit_now); what an exit must do still
# happens. One process, run() as the dsfix program calls it: an exit handler that writes, output left in the
# buffer (PYTHONUNBUFFERED unset), an object whose finalizer shows whether the teardown ran, and a thread that
# is no daemon and outlives the verb, or a profiler that writes its figures after the exit. The program also
# asks torch for huge pages, unless its user said otherwise.
_PROGRAM = r"""
import atexit, os, sys, threading, time
import typer
from patcher.command import run
out = sys.argv[1]
atexit.register(lambda: (open(out + ".atexit", "w").write("ran"), sys.stdout.write(", bye")))


class Torn:  # freed by the interpreter's teardown, when there is one
    def __del__(self, open=open):
        open(out + ".torn", "wb").write(b"torn down")


torn = Torn()
app = typer.Typer()

@app.command()
def verb(late: bool = False, silent: bool = False, fail: bool = False):
    if not silent:
        sys.stdout.write("unflushed, THP_MEM_ALLOC_ENABLE=" + os.environ.get("THP_MEM_ALLOC_ENABLE", ""))
    if fail:  # an exit handler that raises (run first: handlers run last in, first out)
        atexit.register(lambda: 1 / 0)
    if late:  # a thread still writing when the verb is done: the exit waits for it
        threading.Thread(target=lambda: (time.sleep(0.5), open(out + ".thread", "w").write("done"))).start()
    raise typer.Exit(4)

sys.argv[1:] = sys.argv[2:]
run(app, program=True)
"""


def _program(tmp_path, *options, python=(), thp=None, **kwargs):
    script = tmp_path / "program.py"
    script.write_text(_PROGRAM)
    env = {k: v for k, v in CLEAN_ENV.items() if k not in ("THP_MEM_ALLOC_ENABLE", "PYTHONUNBUFFERED")}
    env.update(PYTHONPATH=str(REPO), **({"THP_MEM_ALLOC_ENABLE": thp} if thp else {}))
    kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, *python, str(script), str(tmp_path / "mark"), *options],
                          stderr=subprocess.PIPE, cwd=REPO, env=env, timeout=60, **kwargs)


@pytest.mark.parametrize("how", ["plain", "late thread", "profiled", "huge pages off"])
def test_the_program_process_its_huge_pages_and_its_exit(tmp_path, how):
    p = _program(tmp_path, *(["--late"] if how == "late thread" else []), thp="0" if how == "huge pages off" else None,
                 python=["-m", "cProfile", "-o", str(tmp_path / "figures")] if how == "profiled" else [])
    assert p.returncode == (0 if how == "profiled" else 4), p.stderr  # cProfile ends 0 whatever the program's
    assert p.stdout == b"unflushed, THP_MEM_ALLOC_ENABLE=" + (b"0" if how == "huge pages off" else b"1") + b", bye"
    assert (tmp_path / "mark.atexit").read_text() == "ran"
    assert (tmp_path / "mark.thread").exists() == (how == "late thread")
    assert (tmp_path / "figures").exists() == (how == "profiled")
    if how != "profiled":  # under cProfile the script's globals go when its run returns, teardown or not
        assert (tmp_path / "mark.torn").exists() == (how == "late thread"), "the teardown ran or was skipped"


@pytest.mark.parametrize("how", ["stdout full", "stdout closed", "a handler raises"])
def test_the_program_ends_as_the_ordinary_exit_where_the_exit_goes_wrong(tmp_path, how):
    """Each case run twice: through exit_now, and through the ordinary exit (a late thread forces it). The exit
    code and what stderr says are the same: 120 where stdout cannot take the output (Python's own), else the
    verb's 4 (Python 3.9's exit handlers raise again what one raised; the ordinary exit only prints it)."""
    if how == "stdout full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    ends = []
    for late in ([], ["--late"]):
        options = ["--silent", *late] + (["--fail"] if how == "a handler raises" else [])
        if how == "stdout full":
            with open("/dev/full", "wb") as full:
                p = _program(tmp_path, *options, stdout=full)
        elif how == "stdout closed":
            p = _program(tmp_path, *options, stdout=None, preexec_fn=lambda: os.close(1))
        else:
            p = _program(tmp_path, *options)
        said = [w for w in (b"No space left on device", b"ZeroDivisionError") if w in p.stderr]
        ends.append((p.returncode, said, p.stderr.count(b"Traceback")))
    assert ends[0] == ends[1], ends
    assert ends[0][0] == (120 if how == "stdout full" else 4), ends


@pytest.mark.parametrize("script,args,hidden,needle", [
    ("bench_zero3.py", ["--quick"], "deepspeed", "DS_BUILD_OPS=0 pip install deepspeed"),
    ("bench_engine.py", [], "deepspeed", "DS_BUILD_OPS=0 pip install deepspeed"),
    ("bench_convert.py", ["--quick"], "safetensors", "pip install 'safetensors>=0.4.3'"),
    ("bench_save.py", ["--quick"], "torch", "pip install 'torch>=2.1'"),
])
def test_benchmarks_check_what_they_need_first(script, args, hidden, needle):
    code = (f"import runpy, sys; sys.modules[{hidden!r}] = None; sys.argv = {[script, *args]!r}; "
            f"runpy.run_path({str(REPO / 'benchmarks' / script)!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], env=CLEAN_ENV, capture_output=True, timeout=60)
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == ERROR and len(lines) == 1 and needle in lines[0], p.stderr.decode()[-2000:]


# ----------------------------------------------------------------------------- help


def _help(*args) -> str:
    from typer.testing import CliRunner

    from patcher.cli import app

    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # the words, whatever the wrapping


@pytest.mark.parametrize("args, says", [
    ((), ["convert Turn .bin or DeepSpeed checkpoints into verified safetensors. smoke"]),  # the line not cut short
    (("smoke",), ["--dtype <bf16|fp16|fp32> The dtype the model is built, trained and saved in.",
                  "1-3 wrap the model in a DeepSpeed ZeRO engine of that stage (needs DeepSpeed)",
                  "2 or more need DeepSpeed"]),
    (("revert",), ["--script <path> A further step-1 entry script that apply patched", "3: locked"]),
    (("apply",), ["3: locked (another dsfix run is changing the checkout)"]),
])
def test_help_says(args, says):
    text = _help(*args)
    for phrase in says:
        assert phrase in text, text
    assert "..." not in text.partition("Commands:")[2], "no command's line cut short"
    assert "to patch too" not in text or args != ("revert",)


# ----------------------------------------------------------------------------- the stop points tests use


def test_a_stop_point_does_nothing_unless_it_is_named(monkeypatch):
    from patcher import errors

    monkeypatch.setattr(errors, "_reached", {})
    monkeypatch.setattr(errors, "_STOP_AT", None)  # always, outside tests: not even counted
    errors.stop_point("commit.renamed")
    assert errors._reached == {}
    monkeypatch.setattr(errors, "_STOP_AT", "commit.renamed#2")
    errors.stop_point("commit.renamed")
    errors.stop_point("commit.staged")
    with pytest.raises(KeyboardInterrupt):  # the second time: a real SIGINT, Python's own handler
        errors.stop_point("commit.renamed")
    assert errors._reached == {"commit.renamed": 2, "commit.staged": 1}
