"""Helpers for the patch-path tests: fixture copies, both ways of running the CLI, git apply, pyflakes."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from patcher.cli import app

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures" / "checkouts"
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "GITHUB_ACTIONS", "PY_COLORS")}
CLEAN_ENV["NO_COLOR"] = "1"


def copy_fixture(name: str, dest: Path) -> Path:
    target = dest / name
    shutil.copytree(FIXTURES / name, target)
    return target


def snapshot(root: Path) -> dict:
    """Every file under root (relative path -> bytes), the state folder included."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def cli(*args, cwd: Path | None = None):
    """Run through typer's CliRunner in-process. Returns (exit_code, stdout_bytes, stderr_text)."""
    try:  # click before 8.2 (the last for Python 3.9) mixes stderr into stdout unless told not to
        runner = CliRunner(mix_stderr=False)
    except TypeError:  # click 8.2+ keeps them apart and has no such argument
        runner = CliRunner()
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        r = runner.invoke(app, list(map(str, args)), env={"NO_COLOR": "1"})
    finally:
        os.chdir(old)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    stderr = r.stderr if hasattr(r, "stderr") else ""
    return r.exit_code, r.stdout_bytes, stderr


def cli_completed(*args) -> subprocess.CompletedProcess:
    """``cli``'s run as the CompletedProcess (text) that ``run`` would give, for the tests of what a command prints
    that need no process of their own: torch and transformers are imported once for the test file, not once a
    command."""
    code, stdout, stderr = cli(*args)
    return subprocess.CompletedProcess(["dsfix", *map(str, args)], code, stdout.decode(), stderr)


def run(*args, cwd: Path | None = None, env: dict | None = None, timeout: int = 120):
    """Run `python -m patcher ...` as a real subprocess. Returns CompletedProcess (bytes)."""
    return subprocess.run(
        [sys.executable, "-m", "patcher", *map(str, args)],
        cwd=cwd,
        env={**CLEAN_ENV, **(env or {})},
        capture_output=True,
        timeout=timeout,
    )


def git_apply(diff: bytes, cwd: Path) -> None:
    subprocess.run(["git", "apply", "--check", "-"], input=diff, cwd=cwd, check=True, capture_output=True)
    subprocess.run(["git", "apply", "-"], input=diff, cwd=cwd, check=True, capture_output=True)


def pyflakes_messages(data: bytes, name: str = "x.py") -> set:
    """pyflakes' messages for a source, without line numbers (so an insertion does not shift them)."""
    from pyflakes import api, reporter

    out, err = io.StringIO(), io.StringIO()
    api.check(data.decode("latin-1") if b"latin-1" in data[:200] else data.decode("utf-8-sig"), name,
              reporter.Reporter(out, err))
    msgs = set()
    for line in out.getvalue().splitlines() + err.getvalue().splitlines():
        parts = line.split(":", 3)
        msgs.add(parts[-1].strip() if len(parts) >= 3 else line)
    return msgs


def width(line: str) -> int:
    """A printed line's length as it reads outside pytest-xdist: its worker's folder (``popen-gwN/``) left out of
    the temporary paths the line names."""
    return len(re.sub(r"/popen-gw\d+/", "/", line))
