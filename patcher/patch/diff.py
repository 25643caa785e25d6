"""A git-compatible unified diff of bytes: a/ and b/ paths, CRLF kept, "\\ No newline at end of file"."""

from __future__ import annotations

import difflib
import functools
from typing import Iterator, NamedTuple, Sequence

NO_EOL = b"\\ No newline at end of file\n"

Opcode = tuple[str, int, int, int, int]  # difflib's: (tag, i1, i2, j1, j2), "equal", "replace", "delete" or "insert"


class Compared(NamedTuple):
    """Two files' lines and the opcodes from the old to the new; shared through a cache, so immutable."""

    old: tuple[bytes, ...]
    new: tuple[bytes, ...]
    ops: tuple[Opcode, ...]


def _range(start: int, length: int) -> str:
    if length == 1:
        return f"{start + 1}"
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def unified_diff(old: bytes | None, new: bytes | None, path: str, context: int = 3) -> bytes:
    """The diff from ``old`` to ``new`` for ``path`` (relative, "/"-separated); b"" when they are equal. None:
    the file is not there (a new file, or a removed one, as git writes them)."""
    if old == new:
        return b""
    a, b, ops = _compare(old or b"", new or b"")
    if old is None:
        head = f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
    elif new is None:
        head = f"diff --git a/{path} b/{path}\ndeleted file mode 100644\n--- a/{path}\n+++ /dev/null\n"
    else:
        head = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
    out = [head.encode()]
    for group in _hunks(ops, context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{_range(i1, i2 - i1)} +{_range(j1, j2 - j1)} @@\n".encode())
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [_line(b" ", x) for x in a[a1:a2]]
                continue
            out += [_line(b"-", x) for x in a[a1:a2]]
            out += [_line(b"+", x) for x in b[b1:b2]]
    return b"".join(out)


def _hunks(ops: Sequence[Opcode], context: int) -> Iterator[list[Opcode]]:
    """The opcodes in hunks, each change with up to ``context`` equal lines around it: what difflib's
    ``SequenceMatcher.get_grouped_opcodes`` makes of its own opcodes, here of those ``_compare`` computed once.
    ``ops`` is left as it is (it is the cache's)."""
    codes = list(ops)
    if codes[0][0] == "equal":  # the first and last runs of equal lines keep only the context next to a change
        tag, i1, i2, j1, j2 = codes[0]
        codes[0] = tag, max(i1, i2 - context), i2, max(j1, j2 - context), j2
    if codes[-1][0] == "equal":
        tag, i1, i2, j1, j2 = codes[-1]
        codes[-1] = tag, i1, min(i2, i1 + context), j1, min(j2, j1 + context)
    group: list[Opcode] = []
    for tag, i1, i2, j1, j2 in codes:
        if tag == "equal" and i2 - i1 > 2 * context:  # a long equal run ends one hunk and starts the next
            group.append((tag, i1, min(i2, i1 + context), j1, min(j2, j1 + context)))
            yield group
            group = []
            i1, j1 = max(i1, i2 - context), max(j1, j2 - context)
        group.append((tag, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        yield group


def split_lines(data: bytes) -> list:
    """Lines as git sees them: split on LF only, each keeping its ending (CRLF stays intact)."""
    parts = data.split(b"\n")
    lines = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _line(prefix: bytes, line: bytes) -> bytes:
    if line.endswith(b"\n"):
        return prefix + line
    return prefix + line + b"\n" + NO_EOL


@functools.lru_cache(maxsize=16)
def _compare(old: bytes, new: bytes) -> Compared:
    """The lines and difflib's opcodes, matching only the lines between the common head and tail (an insertion
    into a long file costs the size of the insertion, not of the file)."""
    a, b = tuple(split_lines(old)), tuple(split_lines(new))
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    sm = difflib.SequenceMatcher(None, a[head:len(a) - tail], b[head:len(b) - tail], autojunk=False)
    ops = [(tag, i1 + head, i2 + head, j1 + head, j2 + head) for tag, i1, i2, j1, j2 in sm.get_opcodes()]
    if head:
        ops.insert(0, ("equal", 0, head, 0, head))
    if tail:
        ops.append(("equal", len(a) - tail, len(a), len(b) - tail, len(b)))
    merged: list[Opcode] = []
    for op in ops:  # adjacent equal runs become one, as difflib gives them
        if merged and op[0] == merged[-1][0] == "equal":
            merged[-1] = ("equal", merged[-1][1], op[2], merged[-1][3], op[4])
        elif op[1] != op[2] or op[3] != op[4]:
            merged.append(op)
    return Compared(a, b, tuple(merged) or (("equal", 0, 0, 0, 0),))


def stat(old: bytes, new: bytes) -> tuple:
    """(lines added, lines removed)."""
    added = removed = 0
    for tag, i1, i2, j1, j2 in _compare(old, new).ops:
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return added, removed


def insertions(old: bytes, new: bytes) -> list:
    """[(first new line number, inserted lines)] for each run of lines ``new`` adds."""
    a, b, ops = _compare(old, new)
    return [(j1 + 1, list(b[j1:j2])) for tag, i1, i2, j1, j2 in ops if tag in ("insert", "replace")]
