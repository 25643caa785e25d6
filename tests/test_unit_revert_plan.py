"""Table tests of what plan_revert decides besides each file's status: which files revert reads and in what
order (revert_targets), what it writes and in what order, and what counts as restored. Bytes in, plan out."""

from __future__ import annotations

import pytest

from patcher.patch import plan
from patcher.patch.plan import Saved, Status, Target

A, A2, B, B2 = b"a = 1\n", b"a = 2\n", b"b = 1\n", b"b = 2\n"


def saved(**files) -> Saved:
    """files: rel (with "_" for "/") -> (role, original, patched)."""
    entries, blobs = {}, {}
    for key, (role, original, patched) in files.items():
        rel = key.replace("_", "/") + ".py"
        entries[rel] = {"role": role, "original_sha256": plan.sha256(original), "patched_sha256": plan.sha256(patched),
                        "strategy": "clone", "modules": ["m"] if role != "utils" else []}
        blobs[(rel, "original")], blobs[(rel, "patched")] = original, patched
    return Saved(entries, blobs)


TARGETS = [  # (name, state folder, found in the checkout, expected [(rel, role, modules)])
    ("the state folder decides, by path", saved(z_main=("step1", A, A2), utils=("utils", B, B2)),
     [("other.py", "step1", ("x",))], [("utils.py", "utils", ()), ("z/main.py", "step1", ("m",))]),
    ("without it: as found", None,
     [("main.py", "step1", ["m"]), ("lib/utils.py", "utils", ()), ("loader.py", "loader", ())],
     [("main.py", "step1", ("m",)), ("lib/utils.py", "utils", ()), ("loader.py", "loader", ())]),
    ("a file found twice is read once", None,
     [("u.py", "utils", ()), ("main.py", "step1", ("m",)), ("main.py", "step1", ("m",))],
     [("u.py", "utils", ()), ("main.py", "step1", ("m",))]),
    ("nothing found", None, [], []),
]


@pytest.mark.parametrize("state, found, expected", [t[1:] for t in TARGETS], ids=[t[0] for t in TARGETS])
def test_revert_targets(state, found, expected):
    assert plan.revert_targets(state, found) == expected


WRITES = [  # (name, main.py now, utils.py now, force, writes, restored)
    ("both as dsfix left them", A2, B2, False, [("main.py", A), ("utils.py", B)], ["main.py", "utils.py"]),
    ("one already original: not written, not counted", A, B2, False, [("utils.py", B)], ["utils.py"]),
    ("nothing to do", A, B, False, [], []),
    ("a file gone: refused, nothing written", None, B2, False, [], []),
    ("--force over a changed file: the user's copy kept first", b"a = 3\n", B2, True,
     [("main.py.dsfix-edited", b"a = 3\n"), ("main.py", A), ("utils.py", B)], ["main.py", "utils.py"]),
]


@pytest.mark.parametrize("main, utils, force, writes, restored", [w[1:] for w in WRITES], ids=[w[0] for w in WRITES])
def test_plan_revert_writes_and_restored(main, utils, force, writes, restored):
    state = saved(main=("step1", A, A2), utils=("utils", B, B2))
    targets = [Target("main.py", "script", main, 1, ("m",)), Target("utils.py", "utils", utils)]
    decided = plan.plan_revert(targets, state, force)
    assert list(decided.writes) == writes and list(decided.restored) == restored
    if decided.refused:
        assert decided.writes == () and decided.refused[0].status == Status.REFUSED
