"""The one exception type dsfix raises on purpose, its exit codes, and what an interrupt leaves on disk."""

from __future__ import annotations

import os
import signal
import sys

# Exit codes, documented in docs/cli.md.
OK = 0
PENDING = 1  # check: changes pending; revert: refused because files changed; verify/smoke/convert: a check failed
ERROR = 2  # bad input, a missing requirement, or an operation that failed with nothing written
LOCKED = 3  # another dsfix run holds the checkout's lock
INTERRUPTED = 130  # Ctrl-C

VERBS = ("check", "apply", "revert", "smoke", "verify", "convert", "demo")


class DsfixError(Exception):
    """A user-facing failure: one line of text and an exit code. Never a traceback.

    The line gives the reason first, then where (``path``, relative to the checkout, and ``line``), then what
    to do; about 300 characters at most, long lists cut with "and N more" (see ``shown``)."""

    def __init__(self, message: str, code: int = ERROR, path: str | None = None, line: int | None = None,
                 detail=()):
        super().__init__(message)
        self.message = message
        self.code = code
        self.path = path
        self.line = line
        self.detail = tuple(detail)  # the full story (every import line considered, say): --json and --debug only

    def __str__(self) -> str:
        where = ""
        if self.path:
            where = f"{self.path}:{self.line}: " if self.line else f"{self.path}: "
        return where + self.message


class Written:
    """Whether the operation under way has put all its files in place: the writers (the patch path's
    commit, convert's commit) mark it once every file is there, so that the one line an interrupt prints
    tells the truth about the files. The CLI clears it when a command starts."""

    done = False

    @classmethod
    def mark(cls) -> None:
        cls.done = True

    @classmethod
    def clear(cls) -> None:
        cls.done = False


def interrupt_at_startup() -> None:
    """Until the CLI's main() runs (imports take most of a second), Ctrl-C ends the program at once with
    one line and exit 130: nothing has been written yet. Installed only by the dsfix program itself."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _startup_handler)
    except ValueError:  # pragma: no cover - not the main thread
        pass


def _startup_handler(signum, frame):  # pragma: no cover - runs in a real process (tests/test_cli_interrupt.py)
    args = sys.argv[1:]
    if "--json" in args:
        verb = next((a for a in args if a in VERBS), None)
        shown = f'"{verb}"' if verb else "null"
        os.write(1, (f'{{"verb": {shown}, "exit_code": {INTERRUPTED}, "message": "interrupted: nothing was '
                     f'written", "warnings": [], "error": {{"kind": "interrupted", "message": "interrupted: '
                     f'nothing was written", "path": null, "line": null}}}}\n').encode())
    os.write(2, b"dsfix: interrupted: nothing was written\n")
    os._exit(INTERRUPTED)


def shown(items, limit: int = 3, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` joined, and "and N more" for the rest: a list fit for one line."""
    items = list(items)
    text = sep.join(items[:limit])
    return f"{text} and {len(items) - limit} more" if len(items) > limit else text


class Refused(DsfixError):
    """A shape in a fork's code that dsfix will not rewrite, found while reading it: why, and where (a line,
    or the syntax node it is at, which the reader that knows the file turns into a line)."""

    def __init__(self, message: str, line: int | None = None, node=None):
        super().__init__(message, line=line)
        self.node = node
