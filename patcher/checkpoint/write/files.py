"""Writing files that last, on the torch side: one fsync for files and folders, and the staging folders.

The patch side has its own in ``patcher.patch.state``, and the inserted template its own (it stands alone).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """fsync a written file (an error raises), or a folder so a rename in it lasts (where the system allows)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


_claimed: dict = {}  # staging folder -> the descriptor that holds its lock (make_staging)


def release(staging: Path) -> None:
    """After ``staging`` was removed or renamed into place."""
    fd = _claimed.pop(str(staging), None)
    if fd is not None:
        os.close(fd)


def clear_stale(parent: Path, prefix: str) -> None:
    """Remove the staging folders (``parent/PREFIX…``) of runs that were killed: those no live run holds
    (``make_staging``). A run killed before it renamed its staging folder into place leaves it behind; this is the
    next run's "removes it by itself"."""
    import fcntl
    import shutil

    for path in Path(parent).glob(f"{prefix}*"):
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            fd = os.open(str(path), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live run's
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


def fsync_folder(folder: Path) -> None:
    """fsync every file in ``folder``, then the folder itself."""
    for path in sorted(folder.iterdir()):
        if path.is_file():
            fsync(path)
    fsync(folder)


def make_staging(parent: Path, prefix: str) -> Path:
    """A new folder ``parent/PREFIX…``, held by this run until ``release``: an exclusive lock on it, which
    the system also drops when the process ends, however it ends, so that ``clear_stale`` takes only killed
    runs' folders. It is created as any folder the user makes: its mode follows the umask (0755 under 022,
    0775 under 002), so the folder renamed into place from it is readable where the user's folders are
    (``tempfile.mkdtemp`` would leave it 0700)."""
    import fcntl
    import secrets

    for _ in range(100):
        path = Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        try:
            fd = os.open(str(path), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.rmdir(path)
            raise
        _claimed[str(path)] = fd
        return path
    raise FileExistsError(f"no free name for a staging folder in {parent}")
