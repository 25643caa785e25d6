"""Ctrl-C at any moment: one line saying what state the files are in, exit 130, no traceback. A real
process gets a real SIGINT: during the start-up imports, and at several moments of apply, revert and smoke."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from patchkit import CLEAN_ENV, REPO, copy_fixture, snapshot

pytestmark = pytest.mark.slow

ENV = {**CLEAN_ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _start(*args, importtime=False):
    cmd = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-m", "patcher", *map(str, args)]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lines(stderr: bytes) -> list:
    """stderr's own lines (-X importtime's are left out)."""
    return [l for l in stderr.decode().splitlines() if l.strip() and not l.startswith("import time:")]


def _interrupt_after(proc, seconds: float):
    time.sleep(seconds)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_interrupt_during_the_start_up_imports():
    """Wait for -X importtime to report a first module of typer's (imported after the handler is installed,
    which follows patcher.errors), then SIGINT while the rest of typer is still being imported."""
    proc = _start("check", ".", "--json", importtime=True)
    seen = b""
    while not seen.rstrip().endswith(b"typer._click._compat"):
        chunk = proc.stderr.readline()
        assert chunk, "the process ended before importing typer"
        seen += chunk
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    lines = _lines(seen + err)
    assert proc.returncode == 130, lines
    assert lines == ["dsfix: interrupted: nothing was written"], lines
    assert json.loads(out)["exit_code"] == 130


@pytest.mark.parametrize("delay", [0.3, 0.8, 1.5, 3.0])
def test_interrupt_during_apply_and_revert_says_what_the_files_are(tmp_path, delay):
    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    rc, _, err = _interrupt_after(_start("apply", co), delay)
    lines = _lines(err)
    assert "Traceback" not in err.decode()
    if rc == 0:  # it finished first
        return
    assert rc == 130 and len(lines) == 1 and lines[0].startswith("dsfix: interrupted: "), lines
    if "apply had finished" in lines[0]:
        assert snapshot(co) != before
    else:
        assert lines[0] in ("dsfix: interrupted: nothing was written",
                            "dsfix: interrupted: files are as they were; the state folder is unchanged")
        assert snapshot(co) == before, "an interrupted apply leaves every file as it was"

    assert subprocess.run([sys.executable, "-m", "patcher", "apply", co], env=ENV, capture_output=True).returncode == 0
    patched = snapshot(co)
    rc, _, err = _interrupt_after(_start("revert", co), delay)
    lines = _lines(err)
    assert "Traceback" not in err.decode()
    if rc == 130:
        assert len(lines) == 1 and lines[0].startswith("dsfix: interrupted: "), lines
        assert snapshot(co) == (before if "revert had finished" in lines[0] else patched)


def test_interrupt_during_smoke_leaves_the_checkout_and_no_traceback(tmp_path):
    co = copy_fixture("package", tmp_path)
    assert subprocess.run([sys.executable, "-m", "patcher", "apply", co], env=ENV, capture_output=True).returncode == 0
    before = snapshot(co)
    rc, _, err = _interrupt_after(_start("smoke", co, "--device", "cpu", "--json"), 4.0)
    lines = _lines(err)
    assert rc == 130 and "Traceback" not in err.decode(), err.decode()[-2000:]
    assert lines[-1] == "dsfix: interrupted: nothing was written", lines
    assert snapshot(co) == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith("dsfix-smoke")]
