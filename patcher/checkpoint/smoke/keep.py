"""``dsfix smoke --keep DIR``: the folder the save writes into, kept; never left half-written by a killed smoke.

While smoke writes into the folder it holds a mark (:data:`KEEP_MARKER`, its pid); a later smoke takes back a
folder whose mark names a process that is gone. A folder smoke made is removed again if it is interrupted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from patcher.errors import DsfixError, refuse_file

KEEP_MARKER = ".dsfix-smoke-running"  # in the --keep folder while smoke writes into it: the pid of that smoke


def killed_smokes(keep: Path) -> bool:
    """Whether ``keep`` is the --keep folder of a smoke that was killed: it holds the marker, naming a process
    that is gone. That smoke began with the folder new or empty, so all it holds is that smoke's."""
    try:
        pid = int((keep / KEEP_MARKER).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # there, another user's
        return False
    return False


def check_keep(keep) -> None:
    """--keep: a new folder, an empty one, or one a killed smoke left (refused before anything is built)."""
    if keep is None:
        return
    refuse_file(keep)
    if Path(keep).is_dir() and any(Path(keep).iterdir()) and not killed_smokes(Path(keep)):
        raise DsfixError("--keep folder must be new or empty", path=str(keep))


def empty(folder: Path) -> None:
    for child in list(folder.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink()


@contextlib.contextmanager
def out_folder(keep):
    """The folder the save writes to. Without --keep, a temporary folder, always removed. With --keep, the
    folder kept when smoke ends; when it does not end (Ctrl-C, an error), smoke takes back what it made:
    the folder (and the parents it created) or, for an empty folder that was there, what was written in it."""
    if keep is None:
        tmp = Path(tempfile.mkdtemp(prefix="dsfix-smoke-out-"))
        try:
            yield tmp / "output"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    out = Path(keep).absolute()
    made = next((p for p in reversed((out, *out.parents)) if not p.exists()), None)  # the top folder smoke makes
    try:
        out.mkdir(parents=True, exist_ok=True)
        if killed_smokes(out):  # what a killed smoke left: gone, so this one starts as that one did
            empty(out)
        (out / KEEP_MARKER).write_text(f"{os.getpid()}\n", encoding="ascii")
    except OSError as e:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise DsfixError(f"--keep: cannot write here: {e.strerror or e}; nothing written", path=str(keep)) from None
    try:
        yield out.resolve()
        with contextlib.suppress(OSError):  # left, it names a process that is gone: the next smoke clears
            (out / KEEP_MARKER).unlink()
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        else:
            empty(out)
        raise
