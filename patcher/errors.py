"""The one exception type dsfix raises on purpose, and its exit codes."""

from __future__ import annotations

# Exit codes, documented in README.md ("Exit codes").
OK = 0
PENDING = 1  # check: changes pending; revert: refused because files changed; verify/smoke: a check failed
ERROR = 2  # bad input or an operation that failed with nothing written
LOCKED = 3  # another dsfix run holds the checkout's lock


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

    def to_json(self) -> dict:
        return {"error": self.message, "path": self.path, "line": self.line, "exit_code": self.code,
                "detail": list(self.detail)}

    def __str__(self) -> str:
        where = ""
        if self.path:
            where = f"{self.path}:{self.line}: " if self.line else f"{self.path}: "
        return where + self.message


def shown(items, limit: int = 3, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` joined, and "and N more" for the rest: a list fit for one line."""
    items = list(items)
    text = sep.join(items[:limit])
    return f"{text} and {len(items) - limit} more" if len(items) > limit else text
