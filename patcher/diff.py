"""A git-compatible unified diff of bytes: a/ and b/ paths, CRLF kept, "\\ No newline at end of file"."""

from __future__ import annotations

import difflib

NO_EOL = b"\\ No newline at end of file\n"


def _range(start: int, length: int) -> str:
    if length == 1:
        return f"{start + 1}"
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def unified_diff(old: bytes, new: bytes, path: str, context: int = 3) -> bytes:
    """The diff from ``old`` to ``new`` for ``path`` (relative, "/"-separated); b"" when they are equal."""
    if old == new:
        return b""
    a, b = split_lines(old), split_lines(new)
    out = [f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n".encode()]
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
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


def stat(old: bytes, new: bytes) -> tuple:
    """(lines added, lines removed)."""
    a, b = split_lines(old), split_lines(new)
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return added, removed
