"""The one exception type dsfix raises on purpose, its exit codes, and what an interrupt leaves on disk."""

from __future__ import annotations

import os
import signal

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
    commit, convert's commit, smoke's kept folder) mark it once every file is there, so that the one line
    an interrupt prints tells the truth about the files. The CLI clears it when a command starts."""

    done = False

    @classmethod
    def mark(cls) -> None:
        cls.done = True

    @classmethod
    def clear(cls) -> None:
        cls.done = False


# ----------------------------------------------------------------------------- what Ctrl-C leaves on disk

NOTHING_WRITTEN = "nothing was written"
AS_THEY_WERE = "files are as they were; the state folder is unchanged"
# What the files are like after Ctrl-C, for each verb (and the option that changes it): (before the verb's
# files were all in place, after: Written). A verb not listed wrote nothing either way. The start-up handler
# and the CLI both read it (``interrupted_line``).
ON_INTERRUPT = {
    "apply": (AS_THEY_WERE, "apply had finished: the files are patched (undo with `dsfix revert`)"),
    "revert": (AS_THEY_WERE, "revert had finished: the files are restored"),
    "convert": ("every folder is as it was",
                "the safetensors files are in place; .bin files not yet removed may remain"),
    "convert --output": (NOTHING_WRITTEN, "the converted folder is in place"),
    "smoke --keep": (NOTHING_WRITTEN, "smoke had finished: the saved folder is in the --keep folder"),
    "demo --keep": ("nothing outside the --keep folder was written; its demo checkout may be left patched",) * 2,
}


def interrupted_line(key: str | None = None, done: bool = False) -> str:
    """The line (after "dsfix: ") for Ctrl-C during ``key`` (a verb, or "verb --option" as ON_INTERRUPT
    lists them), before or after its files were all in place (``done``)."""
    before, after = ON_INTERRUPT.get(key or "", (NOTHING_WRITTEN, NOTHING_WRITTEN))
    return f"interrupted: {after if done else before}"


# ----------------------------------------------------------------------------- stopping at a named point

_STOP_AT = os.environ.get("DSFIX_STOP_AT")  # for tests: NAME, or NAME#N (the Nth time the point is reached)
_reached: dict = {}


def stop_point(name: str) -> None:
    """A named point where a test stops dsfix as Ctrl-C would: when DSFIX_STOP_AT names it, the process
    sends itself SIGINT, so the real handlers run and the test sees what that point leaves on disk. Unset
    (always, outside tests), it returns at once."""
    if _STOP_AT is None:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _STOP_AT in (name, f"{name}#{_reached[name]}"):
        os.kill(os.getpid(), signal.SIGINT)


def file_not_folder(path) -> DsfixError:
    """The one refusal of a path to a file where a verb takes a folder (exit 2)."""
    return DsfixError("is a file, not a folder; pass the folder that holds it", path=str(path))


def refuse_file(path) -> None:
    """Raise ``file_not_folder`` when ``path`` is there but is not a folder."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise file_not_folder(path)


def need_folder(path, what: str = "folder") -> None:
    """A folder argument: "no such folder" when ``path`` is not there, ``file_not_folder`` for a file."""
    if not os.path.exists(path):
        raise DsfixError(f"no such {what}", path=str(path))
    refuse_file(path)


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
