"""What every command returns: a result with a status, an exit code and a JSON-able dict. torch-free.

Each command's result type (check/apply/revert: :class:`patcher.patch.flow.Outcome`; verify, smoke and
convert: their reports in :mod:`patcher.checkpoint`; demo: :class:`patcher.demo.DemoResult`) derives
from :class:`Result`. A result names its verb and its ``status``, a :class:`Status` member: the status
carries the exit code (the one map from status to exit code), and the result gives its ``message`` and its
own keys in ``body()``. ``to_dict()`` puts the keys every result shares first, then the status where there
is one::

    {"verb": "verify", "exit_code": 1, "message": "verification FAILED: ...", "warnings": [],
     "status": "failed", ...its own keys}

An error is an :class:`ErrorResult` of the same shape, so that ``--json`` always prints one object.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, Sequence, TypeVar

from patcher.errors import ERROR, INTERRUPTED, OK, PENDING

COMMON_KEYS = ("verb", "exit_code", "message", "warnings")


class Status(str, enum.Enum):
    """A result's status and the exit code it ends in. A subclass lists ``NAME = ("text", exit code)``;
    the text is the member's value (what the JSON says)."""

    exit_code: int  # each member's, from its ("text", exit code)

    def __new__(cls, text: str, exit_code: int) -> Status:
        member = str.__new__(cls, text)
        member._value_ = text
        member.exit_code = exit_code
        return member


class Verdict(Status):
    """The status of a command that checks something (verify, smoke, demo)."""

    PASSED = ("passed", OK)
    FAILED = ("failed", PENDING)

    @classmethod
    def of(cls, ok: bool) -> "Verdict":
        return cls.PASSED if ok else cls.FAILED


def dumps(data: dict) -> str:
    """The JSON text of every result and report: indented, enums by value, paths and the rest as text."""
    return json.dumps(data, indent=2, default=_plain)


def _plain(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


class Result:
    """The result protocol. A subclass provides ``verb``, ``status`` (a :class:`Status`; or None where it
    overrides ``exit_code`` itself, as the patch verbs' Outcome does, whose code comes from its files),
    ``message`` and ``warnings`` (as fields, class attributes or properties), and its own keys in ``body()``."""

    # What a subclass provides, declared for the type checker alone: a read-only property here stands for a
    # dataclass field, a class attribute or a property there. A value here would become the default of a
    # subclass's dataclass field of the same name (EngineResult's ``status``, Outcome's ``verb`` have none).
    if TYPE_CHECKING:
        @property
        def verb(self) -> str | None: ...  # "check", "verify", ...; None: an error came before the command

        @property
        def status(self) -> Status | None: ...

        @property
        def message(self) -> str: ...

        @property
        def warnings(self) -> Sequence[str]: ...

    @property
    def exit_code(self) -> int:
        """The status's exit code; a result without a status gives its own."""
        if self.status is None:
            raise NotImplementedError(f"{type(self).__name__} has no status: its exit_code is its own")
        return self.status.exit_code

    def body(self) -> dict:
        return {}

    def to_dict(self) -> dict:
        head: dict[str, Any] = {"verb": self.verb, "exit_code": self.exit_code, "message": self.message,
                                "warnings": list(self.warnings)}
        if self.status is not None:
            head["status"] = self.status.value
        return {**head, **{k: v for k, v in self.body().items() if k not in head}}

    def to_json(self) -> str:
        return dumps(self.to_dict())


class NamedCheck(Protocol):
    """One check in a report (the torch side's ``checks.Check``)."""

    @property
    def name(self) -> str: ...

    @property
    def ok(self) -> bool: ...

    @property
    def detail(self) -> str: ...


C = TypeVar("C", bound=NamedCheck)


class Checks(Generic[C]):
    """What the reports of verify, smoke and convert share: a tuple of named checks (each with ``name``,
    ``ok`` and ``detail``; ``Checks[Check]`` names their type), looked up by name, and their JSON (``to_dict``
    is the report's own)."""

    checks: tuple[C, ...]  # a field of each report (declared only: a dataclass field keeps no default)

    def check(self, name: str) -> C | None:
        """The check of that name; None when the report has none (it never got that far)."""
        return next((c for c in self.checks if c.name == name), None)

    @property
    def failed(self) -> tuple[C, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def to_dict(self) -> dict:
        """The report's JSON keys (a :class:`Result`'s is Result's own)."""
        raise NotImplementedError(f"{type(self).__name__} gives no to_dict")

    def to_json(self) -> str:
        return dumps(self.to_dict())


@dataclass(frozen=True)
class ErrorResult(Result):
    """A command that ended in an error (exit 2, 3) or an interrupt (130): what --json prints then. Its exit
    code is a field (the error's own), not a status's; every field has a default so that the dataclass's
    fields stand in for the base's properties."""

    verb: str | None = None
    exit_code: int = ERROR
    message: str = ""
    error: str = ""  # the message without its place
    path: str | None = None
    line: int | None = None
    kind: str = "error"  # "error", "usage", "interrupted", "internal"
    warnings: tuple = ()
    detail: tuple = ()  # the full story behind the one line (every import line considered, say)
    status = None  # no status: the exit code is the error's own (not a field)

    @classmethod
    def interrupted(cls, verb: str | None, text: str) -> "ErrorResult":
        """Ctrl-C: ``text`` is the one line after "dsfix: " (``interrupted: <what the files are like>``)."""
        return cls(verb, INTERRUPTED, text, error=text, kind="interrupted")

    def body(self) -> dict:
        return {"error": {"kind": self.kind, "message": self.error or self.message, "path": self.path,
                          "line": self.line, "detail": list(self.detail)}}
