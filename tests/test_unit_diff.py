"""patcher.patch.diff: the unified diff `check` prints, as difflib and git write it. Bytes in, bytes out."""

from __future__ import annotations

import difflib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patcher.patch.diff import NO_EOL, stat, unified_diff


def numbered(n: int, changed: dict | None = None) -> bytes:
    return b"".join((changed or {}).get(i, b"line %d\n" % i) for i in range(n))


CASES = [
    # (name, old, new): every line ends in a newline, so difflib's own unified diff is the expected one
    ("one line changed in the middle", numbered(20), numbered(20, {10: b"ten\n"})),
    ("two changes far apart: two hunks", numbered(30), numbered(30, {3: b"three\n", 25: b"twenty-five\n"})),
    ("two changes close: one hunk", numbered(30), numbered(30, {10: b"ten\n", 14: b"fourteen\n"})),
    ("an insertion at the top", numbered(10), b"new\n" + numbered(10)),
    ("a deletion at the end", numbered(10), numbered(9)),
    ("everything replaced", numbered(3), b"a\nb\n"),
]


@pytest.mark.parametrize("name,old,new", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("context", [0, 1, 3, 5])
def test_hunks_are_difflibs(name, old, new, context):
    expected = "".join(difflib.unified_diff(old.decode().splitlines(True), new.decode().splitlines(True),
                                            "a/f.py", "b/f.py", n=context, lineterm="\n"))
    got = unified_diff(old, new, "f.py", context=context).decode()
    assert got == "diff --git a/f.py b/f.py\n" + expected.replace("--- a/f.py\t\n", "--- a/f.py\n")


def test_a_diff_does_not_depend_on_the_diffs_made_before_it():
    """The opcodes are computed once and cached: making the hunks of one diff must leave them as they were for
    the next (difflib's get_grouped_opcodes trims the first and last runs of the list it is given)."""
    old, new = numbered(20), numbered(20, {10: b"ten\n"})
    first = unified_diff(old, new, "f.py", context=3)
    assert unified_diff(old, new, "f.py", context=1) != first
    assert unified_diff(old, new, "f.py", context=3) == first
    assert stat(old, new) == (1, 1)


def test_new_removed_and_unterminated_files():
    assert unified_diff(b"same\n", b"same\n", "f.py") == b""
    assert unified_diff(None, b"a\n", "f.py") == (b"diff --git a/f.py b/f.py\nnew file mode 100644\n--- /dev/null\n"
                                                  b"+++ b/f.py\n@@ -0,0 +1 @@\n+a\n")
    assert unified_diff(b"a\n", None, "f.py").endswith(b"--- a/f.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-a\n")
    assert unified_diff(b"a\nb", b"a\nc", "f.py").endswith(b"@@ -1,2 +1,2 @@\n a\n-b\n" + NO_EOL + b"+c\n" + NO_EOL)


def _patched(old: bytes, diff: bytes) -> bytes:
    """``old`` with the diff's hunks applied, each hunk's context and removed lines checked against it."""
    lines = old.split(b"\n")
    lines = [x + b"\n" for x in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    out, at = [], 0
    for hunk in re.split(rb"(?<=\n)@@ ", diff)[1:]:  # before the first: the file's header
        head, _, rest = hunk.partition(b"\n")
        start, length = re.match(rb"-(\d+)(?:,(\d+))? ", head).groups()
        start = int(start) if length == b"0" else int(start) - 1  # "-N,0": an insertion after line N
        out += lines[at:start]
        at = start
        entries = rest.split(b"\n")[:-1]
        for k, entry in enumerate(entries):
            if entry + b"\n" == NO_EOL:
                continue
            text = entry[1:] + (b"" if k + 1 < len(entries) and entries[k + 1] + b"\n" == NO_EOL else b"\n")
            if entry[:1] in (b" ", b"-"):
                assert lines[at] == text, (at, lines[at], text)
                at += 1
            if entry[:1] in (b" ", b"+"):
                out.append(text)
    return b"".join(out + lines[at:])


LINES = st.lists(st.sampled_from([b"a\n", b"b\n", b"c\n", b"a\r\n", b"d"]), max_size=25).map(b"".join)


@settings(max_examples=200, deadline=None)
@given(old=LINES, new=LINES, context=st.integers(0, 4))
def test_the_diff_turns_old_into_new(old, new, context):
    diff = unified_diff(old, new, "f.py", context=context)
    assert (diff == b"") == (old == new)
    assert _patched(old, diff) == new
    assert unified_diff(old, new, "f.py", context=context) == diff
