"""The one exception type dsfix raises on purpose, and its exit codes."""

from __future__ import annotations

# Exit codes, documented in README.md ("Exit codes").
OK = 0
PENDING = 1  # check: changes pending; revert: refused because files changed; verify/smoke: a check failed
ERROR = 2  # bad input or an operation that failed with nothing written
LOCKED = 3  # another dsfix run holds the checkout's lock


class DsfixError(Exception):
    """A user-facing failure: one line of text and an exit code. Never a traceback."""

    def __init__(self, message: str, code: int = ERROR, path: str | None = None, line: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.path = path
        self.line = line

    def __str__(self) -> str:
        where = ""
        if self.path:
            where = f"{self.path}:{self.line}: " if self.line else f"{self.path}: "
        return where + self.message
