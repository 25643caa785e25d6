"""Table tests of patcher.patch.plan: the three-way merge that carries a user's edits over, and revert's
decision for each file (restore, merge, undo structurally, leave, or refuse). Bytes in, decisions out."""

from __future__ import annotations

import pytest

from patcher.patch import plan
from patcher.patch.plan import Saved, Status, Target
from unitkit import UPSTREAM_SAVE, fix


def lines(*items) -> bytes:
    return "".join(f"{i}\n" for i in items).encode()


MERGES = [
    # (name, base, ours, theirs, merged or None for a conflict)
    ("nothing changed", lines("a", "b", "c"), lines("a", "b", "c"), lines("a", "b", "c"), lines("a", "b", "c")),
    ("only ours", lines("a", "b", "c"), lines("a", "B", "c"), lines("a", "b", "c"), lines("a", "B", "c")),
    ("only theirs", lines("a", "b", "c"), lines("a", "b", "c"), lines("a", "b", "C"), lines("a", "b", "C")),
    ("apart", lines("a", "b", "c", "d", "e"), lines("A", "b", "c", "d", "e"), lines("a", "b", "c", "d", "E"),
     lines("A", "b", "c", "d", "E")),
    ("both insert apart", lines("a", "b", "c", "d"), lines("x", "a", "b", "c", "d"), lines("a", "b", "c", "d", "y"),
     lines("x", "a", "b", "c", "d", "y")),
    ("ours deletes, theirs edits elsewhere", lines("a", "b", "c", "d", "e"), lines("a", "c", "d", "e"),
     lines("a", "b", "c", "d", "E"), lines("a", "c", "d", "E")),
    ("the same line", lines("a", "b", "c"), lines("a", "B", "c"), lines("a", "b2", "c"), None),
    ("adjacent lines touch", lines("a", "b", "c", "d"), lines("a", "B", "c", "d"), lines("a", "b", "C", "d"), None),
    ("insertions at the same place", lines("a", "b"), lines("a", "x", "b"), lines("a", "y", "b"), None),
    ("CRLF lines", b"a\r\nb\r\nc\r\nd\r\ne\r\n", b"A\r\nb\r\nc\r\nd\r\ne\r\n", b"a\r\nb\r\nc\r\nd\r\nE\r\n",
     b"A\r\nb\r\nc\r\nd\r\nE\r\n"),
    ("no newline at the end", b"a\nb\nc\nd\ne", b"A\nb\nc\nd\ne", b"a\nb\nc\nd\nE", b"A\nb\nc\nd\nE"),
]


@pytest.mark.parametrize("base, ours, theirs, merged", [m[1:] for m in MERGES], ids=[m[0] for m in MERGES])
def test_merge3(base, ours, theirs, merged):
    assert plan.merge3(base, ours, theirs) == merged
    if merged is not None:  # symmetric
        assert plan.merge3(base, theirs, ours) == merged


# ----------------------------------------------------------------------------- revert's decisions

MODULES = ("dschat.utils.utils",)
MAIN = lines("import os", "", "from dschat.utils.utils import save_hf_format", "", "", "def main():", "    x = 1",
             "    y = 2", "    save_hf_format(m, t, a)", "    return x")
MAIN_PATCHED = MAIN.replace(b"save_hf_format", b"save_hf_format_safetensors")
UTILS = ("import os\nimport torch\n\n\n" + UPSTREAM_SAVE + "\n\ndef other():\n    return 1\n").encode()


@pytest.fixture(scope="module")
def utils_patched() -> bytes:
    return fix("utils", UTILS).new


def saved_for(rel: str, role: str, original: bytes, patched: bytes) -> Saved:
    entry = {"role": role, "original_sha256": plan.sha256(original), "patched_sha256": plan.sha256(patched),
             "strategy": "clone", "modules": list(MODULES) if role != "utils" else []}
    return Saved({rel: entry}, {(rel, "original"): original, (rel, "patched"): patched}, "main.py")


def edit_line(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1
    return data.replace(old, new)


def edit_block(data: bytes) -> bytes:
    """An edit inside dsfix's block: a line added after save_hf_format_safetensors' docstring."""
    at = data.index(b"\ndef save_hf_format_safetensors(")
    at = data.index(b'"""\n', at) + 4
    return data[:at] + b"    edited = True\n" + data[at:]


SCRIPT_REVERTS = [
    # (name, main.py now, status, the bytes revert writes (None: leaves the file))
    ("as dsfix left it", MAIN_PATCHED, Status.RESTORED, MAIN),
    ("already the original", MAIN, Status.UNCHANGED, None),
    ("the file is gone", None, Status.REFUSED, None),
    ("edited elsewhere: merged", edit_line(MAIN_PATCHED, b"x = 1", b"x = 2"), Status.MERGED,
     edit_line(MAIN, b"x = 1", b"x = 2")),
    ("edited on dsfix's line: undone structurally",
     edit_line(MAIN_PATCHED, b"(m, t, a)", b"(m, t, a, 'actor')"), Status.STRUCTURAL,
     edit_line(MAIN, b"(m, t, a)", b"(m, t, a, 'actor')")),
]


@pytest.mark.parametrize("current, status, new", [r[1:] for r in SCRIPT_REVERTS], ids=[r[0] for r in SCRIPT_REVERTS])
def test_revert_a_script_with_the_state_folder(current, status, new):
    saved = saved_for("main.py", "step1", MAIN, MAIN_PATCHED)
    decided = plan.plan_revert([Target("main.py", "script", current, 1, MODULES)], saved, False)
    (result,) = decided.results
    assert (result.status, result.new) == (status, new)
    assert decided.refused == ((result,) if status == Status.REFUSED else ())


def test_revert_utils_restores_merges_or_refuses(utils_patched):
    saved = saved_for("utils.py", "utils", UTILS, utils_patched)

    def decide(current, force=False):
        return plan.plan_revert([Target("utils.py", "utils", current)], saved, force)

    (r,) = decide(utils_patched).results
    assert (r.status, r.new) == (Status.RESTORED, UTILS)
    edited = edit_line(utils_patched, b"    return 1\n", b"    return 2\n")
    (r,) = decide(edited).results
    assert (r.status, r.new) == (Status.MERGED, edit_line(UTILS, b"    return 1\n", b"    return 2\n"))
    inside = edit_block(utils_patched)
    decided = decide(inside)
    assert [(r.status, r.new) for r in decided.results] == [(Status.REFUSED, None)]
    assert decided.results[0].reason == "edited after apply where dsfix changed it"
    assert decided.refused == decided.results
    forced = decide(inside, force=True)  # --force: the original back, the user's version kept beside it
    (r,) = forced.results
    assert (r.status, r.new, r.keep_as, forced.refused) == (Status.RESTORED, UTILS, "utils.py.dsfix-edited", ())


def test_revert_without_the_state_folder(utils_patched):
    def decide(utils, main, force=False):
        targets = [Target("utils.py", "utils", utils), Target("main.py", "script", main, 1, MODULES)]
        return [(r.status, r.new) for r in plan.plan_revert(targets, None, force).results]

    assert decide(utils_patched, MAIN_PATCHED) == [(Status.STRUCTURAL, UTILS), (Status.STRUCTURAL, MAIN)]
    # no dsfix block in utils.py: the scripts' calls of dsfix's names are someone's hand edit, left alone
    assert decide(UTILS, MAIN_PATCHED) == [(Status.UNCHANGED, None), (Status.UNCHANGED, None)]
    inside = edit_block(utils_patched)
    assert decide(inside, MAIN_PATCHED)[0] == (Status.REFUSED, None)
    assert decide(inside, MAIN_PATCHED, force=True)[0] == (Status.STRUCTURAL, UTILS)


def test_apply_over_an_edited_patch_keeps_the_users_edits_in_the_original():
    saved = saved_for("main.py", "step1", MAIN, MAIN_PATCHED)
    edited = edit_line(MAIN_PATCHED, b"x = 1", b"x = 2")
    assert plan.original_under_edits(saved, saved.target("main.py", edited)) == edit_line(MAIN, b"x = 1", b"x = 2")
    assert plan.original_under_edits(saved, saved.target("main.py", MAIN_PATCHED)) == MAIN
