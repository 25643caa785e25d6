"""What ``dsfix check`` says on every fixture checkout, pinned byte for byte: the exit code, stderr and the diff
on stdout, one golden file per fixture (tests/golden/patch/NAME.txt), for fixtures/checkouts/* and
fixtures/refused/*, each run as its FIXTURE.json says (no FIXTURE.json: from the top, no options).

A refactor of the patch side leaves every one of them as it is; a deliberate change of output rewrites them
with ``DSFIX_GOLDEN=write python -m pytest tests/test_golden_patch.py`` and is named in its commit.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from patchkit import FIXTURES, REPO, cli

GOLDEN = Path(__file__).resolve().parent / "golden" / "patch"
WRITE = os.environ.get("DSFIX_GOLDEN") == "write"
REFUSED = REPO / "fixtures" / "refused"
CASES = sorted([(p.name, p) for p in FIXTURES.iterdir() if p.is_dir()]
               + [(f"refused-{p.name}", p) for p in REFUSED.iterdir() if p.is_dir()])


def _meta(src: Path) -> dict:
    f = src / "FIXTURE.json"
    return json.loads(f.read_text()) if f.is_file() else {"path": ".", "args": []}


def _short(diff: str) -> str:
    """The diff, with the save module's new file (a copy of templates/dsfix_safetensors.py, pinned by
    tests/test_save_module.py) as one line: its hunk's hash."""
    parts = re.split(r"(?m)^(?=diff --git )", diff)
    out = []
    for part in parts:
        head, sep, body = part.partition("\n@@ ")
        if sep and head.endswith("dsfix_safetensors.py") and "--- /dev/null" in head:
            part = f"{head}\n<the save module: sha256 {hashlib.sha256(body.encode()).hexdigest()[:16]}>\n"
        out.append(part)
    return "".join(out)


def test_every_fixture_has_a_golden():
    names = {name for name, _ in CASES}
    assert len(names) >= 25
    if not WRITE:
        assert {p.stem for p in GOLDEN.glob("*.txt")} == names


@pytest.mark.parametrize("name,src", CASES, ids=[n for n, _ in CASES])
def test_check_output_is_as_pinned(tmp_path, name, src):
    top = tmp_path / "c"
    shutil.copytree(src, top)
    meta = _meta(src)
    code, out, err = cli("check", ".", *meta["args"], cwd=top / meta["path"])
    err = err.replace(str(tmp_path), "<tmp>")
    actual = f"exit {code}\n--- stderr\n{err}--- stdout\n{_short(out.decode())}"
    path = GOLDEN / f"{name}.txt"
    if WRITE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        return
    assert path.is_file(), f"no golden {name}: run with DSFIX_GOLDEN=write once"
    assert actual == path.read_text()
