"""Reading Python source: bytes decoded as Python decodes them, parsed with ``ast`` and with libcst, and one
message for a file that does not parse, in every verb: ``FILE:LINE: does not parse: <Python's message>``.

Python compiles a file before libcst reads it, so the line and the message are always Python's own (libcst's
are token lists, and its line can be another).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from dataclasses import dataclass

import libcst as cst

from patcher.errors import DsfixError

_NEWLINE = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Decoded:
    text: str  # without a BOM
    encoding: str  # as detected (PEP 263, "utf-8-sig" with a BOM); ``text.encode(encoding)`` gives the bytes back


def decode(data: bytes) -> Decoded:
    """Raises SyntaxError (a bad encoding declaration), LookupError (an unknown one) or UnicodeDecodeError:
    Python would not run such a file either."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return Decoded(data.decode(encoding), encoding)


@functools.lru_cache(maxsize=8)
def parse(data: bytes) -> tuple:
    """(ast tree, Decoded) of a file's bytes, decoded by its own declaration (PEP 263, BOM). Raises SyntaxError,
    or what ``decode`` raises. Cached: locating and planning read the same script; the tree is only read."""
    decoded = decode(data)
    return ast.parse(decoded.text), decoded


class Unreadable(DsfixError):
    """Python cannot read the file (it does not parse, or cannot be decoded): no verb can tell from it what dsfix
    changed, so none can decide anything about it (exit 2, the one line below)."""


def parse_script(data: bytes, rel: str) -> tuple:
    """(ast tree, Decoded) of a file; ``Unreadable`` naming the file and Python's own line when Python cannot
    read it."""
    try:
        return parse(data)
    except (UnicodeDecodeError, LookupError) as e:
        raise Unreadable(f"cannot be decoded: {e}", path=rel) from None
    except SyntaxError as e:  # ValueError too: a NUL byte, which ast reports as SyntaxError since 3.12
        raise Unreadable(f"does not parse: {e.msg}", path=rel, line=e.lineno) from None
    except ValueError as e:  # Python before 3.12, on a NUL byte
        raise Unreadable(f"does not parse: {e}", path=rel) from None


def parse_cst(data: bytes, rel: str) -> cst.Module:
    """The libcst module of a file that Python reads (Python's message and line when it does not)."""
    parse_script(data, rel)
    try:
        return cst.parse_module(data)
    except cst.ParserSyntaxError as e:  # pragma: no cover - Python read it; a libcst limitation
        raise DsfixError(f"dsfix cannot read it (libcst: {e.message.strip()})", path=rel, line=e.raw_line) from None


def render(module: cst.Module, rel: str) -> bytes:
    """The module's bytes in its own encoding."""
    return encode(module.code, module.encoding, rel)


def encode(text: str, encoding: str, rel: str) -> bytes:
    try:
        return text.encode(encoding)
    except UnicodeEncodeError as e:
        raise DsfixError(f"the new code cannot be written in this file's encoding ({encoding}): {e}",
                         path=rel) from None


def check_compiles(data: bytes, rel: str) -> None:
    """Before apply writes: Python must compile the new text, and libcst parse it back (so a later dsfix can
    read it), or nothing is written."""
    try:
        compile(data, rel, "exec", dont_inherit=True)
        cst.parse_module(data)
    except SyntaxError as e:  # pragma: no cover - a dsfix bug, caught before anything is written
        raise DsfixError(f"dsfix produced code that does not compile: {e.msg}", path=rel, line=e.lineno) from None
    except cst.ParserSyntaxError as e:  # pragma: no cover - likewise
        raise DsfixError(f"dsfix produced code it cannot parse back: {e.message.strip()}", path=rel,
                         line=e.raw_line) from None


def newline_of(text: str) -> str:
    """The file's first newline ("\\n" when it has none)."""
    m = _NEWLINE.search(text)
    return m.group(0) if m else "\n"


def statements(tree):
    """Every statement of an ast tree, in source order, nested ones included (expressions are not entered)."""
    for stmt in tree.body:
        yield stmt
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list):
                yield from statements(_Block(block))
        for h in getattr(stmt, "handlers", ()):
            yield from statements(_Block(h.body))
        for case in getattr(stmt, "cases", ()):
            yield from statements(_Block(case.body))


class _Block:
    def __init__(self, body):
        self.body = body


class Source:
    """A text split into lines once, the way Python's tokenizer counts them, for ast's positions (whose
    columns count UTF-8 bytes)."""

    def __init__(self, text: str):
        self.text = text
        self.lines, at = [], 0
        for m in _NEWLINE.finditer(text):
            self.lines.append(text[at:m.end()])
            at = m.end()
        if at < len(text) or not self.lines:
            self.lines.append(text[at:])
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def col(self, line: int, col: int) -> int:
        """ast's column as characters."""
        text = self.lines[line - 1]
        return col if text.isascii() else len(text.encode("utf-8")[:col].decode("utf-8", errors="replace"))

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + self.col(line, col)

    def span(self, node) -> tuple:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node) -> str:
        """The node's source text, as ast.get_source_segment gives it (without re-splitting the text)."""
        start, end = self.span(node)
        return self.text[start:end]
