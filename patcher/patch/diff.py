"""A git-compatible unified diff of bytes: a/ and b/ paths, CRLF kept, "\\ No newline at end of file"."""

from __future__ import annotations

import difflib
import functools

NO_EOL = b"\\ No newline at end of file\n"


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
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    sm.opcodes = ops  # computed once in _compare (get_grouped_opcodes reads them from here)
    for group in sm.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{_range(i1, i2 - i1)} +{_range(j1, j2 - j1)} @@\n".encode())
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [_line(b" ", x) for x in a[a1:a2]]
                continue
            out += [_line(b"-", x) for x in a[a1:a2]]
            out += [_line(b"+", x) for x in b[b1:b2]]
    return b"".join(out)


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
def _compare(old: bytes, new: bytes) -> tuple:
    """(old lines, new lines, difflib opcodes), matching only the lines between the common head and tail
    (an insertion into a long file costs the size of the insertion, not of the file)."""
    a, b = split_lines(old), split_lines(new)
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
    merged = []
    for op in ops:  # adjacent equal runs become one, as difflib gives them
        if merged and op[0] == merged[-1][0] == "equal":
            merged[-1] = ("equal", merged[-1][1], op[2], merged[-1][3], op[4])
        elif op[1] != op[2] or op[3] != op[4]:
            merged.append(op)
    return a, b, merged or [("equal", 0, 0, 0, 0)]


def stat(old: bytes, new: bytes) -> tuple:
    """(lines added, lines removed)."""
    added = removed = 0
    for tag, i1, i2, j1, j2 in _compare(old, new)[2]:
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return added, removed


def insertions(old: bytes, new: bytes) -> list:
    """[(first new line number, inserted lines)] for each run of lines ``new`` adds."""
    a, b, ops = _compare(old, new)
    return [(j1 + 1, b[j1:j2]) for tag, i1, i2, j1, j2 in ops if tag in ("insert", "replace")]
