"""What every command returns: a result with an exit code and a JSON-able dict. torch-free.

Each command's result type (check/apply/revert: :class:`patcher.patch.flow.Outcome`; verify, smoke and
convert: their reports in :mod:`patcher.checkpoint`; demo: :class:`patcher.demo.DemoResult`) derives
from :class:`Result`: it names its verb, derives its ``exit_code`` from its own status in one place, and
gives its own keys in ``body()``. ``to_dict()`` puts the keys every result shares first::

    {"verb": "check", "exit_code": 1, "message": "2 files would change", "warnings": [], ...its own keys}

An error is an :class:`ErrorResult` of the same shape, so that ``--json`` always prints one object.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from patcher.errors import OK, PENDING

COMMON_KEYS = ("verb", "exit_code", "message", "warnings")


class Verdict(str, enum.Enum):
    """The status of a command that checks something (verify, smoke, demo)."""

    PASSED = "passed"
    FAILED = "failed"

    @property
    def exit_code(self) -> int:
        return OK if self is Verdict.PASSED else PENDING

    @classmethod
    def of(cls, ok: bool) -> "Verdict":
        return cls.PASSED if ok else cls.FAILED


class Result:
    """The result protocol. A subclass provides ``verb``, ``exit_code``, ``message`` and ``warnings`` (as
    fields or properties: the base defines none of them, so that a dataclass subclass can make them
    fields) and its own keys in ``body()``."""

    def body(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        head = {"verb": self.verb, "exit_code": self.exit_code, "message": self.message,
                "warnings": list(self.warnings)}
        return {**head, **{k: v for k, v in self.body().items() if k not in head}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_plain)


def _plain(value):
    """JSON for what json does not know: enums by value, paths and the rest as text."""
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


@dataclass(frozen=True)
class ErrorResult(Result):
    """A command that ended in an error (exit 2, 3) or an interrupt (130): what --json prints then."""

    verb: str
    exit_code: int
    message: str
    error: str = ""  # the message without its place
    path: str | None = None
    line: int | None = None
    kind: str = "error"  # "error", "usage", "interrupted", "internal"
    warnings: tuple = ()
    detail: tuple = ()  # the full story behind the one line (every import line considered, say)

    def body(self) -> dict:
        return {"error": {"kind": self.kind, "message": self.error or self.message, "path": self.path,
                          "line": self.line, "detail": list(self.detail)}}
