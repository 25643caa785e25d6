"""Everything that touches the disk: reading targets, the lock, atomic writes and the state folder.

The state folder ``.dsfix/`` sits at the checkout root and ignores itself (its ``.gitignore`` says ``*``).
It keeps, for each patched file, the original bytes and the bytes dsfix wrote, with their hashes,
so ``revert`` can restore originals exactly, and tell when a file was edited after ``apply``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from patcher.errors import LOCKED, DsfixError

STATE_DIR = ".dsfix"
STATE_VERSION = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path, rel: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DsfixError("no such file", path=rel) from None
    except IsADirectoryError:
        raise DsfixError("is a folder, not a file", path=rel) from None
    except OSError as e:
        raise DsfixError(f"cannot be read: {e.strerror or e}", path=rel) from None


# ----------------------------------------------------------------------------- lock


@contextlib.contextmanager
def lock(root: Path):
    """An exclusive, non-blocking lock on the checkout folder itself; released when the process ends."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DsfixError(
                    "another dsfix run is changing this checkout right now; try again when it has finished",
                    code=LOCKED,
                    path=str(root),
                ) from None
            raise
        yield
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- atomic writes


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_temp(target: Path, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``target`` (same folder, same mode), fsynced."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".dsfix-tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, target.stat().st_mode & 0o7777)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def atomic_write(target: Path, data: bytes) -> None:
    tmp = _write_temp(target, data)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def write_all(writes: list, rel_of=lambda p: str(p)) -> None:
    """Replace several files, all or nothing.

    Every new text goes to a temporary file first; only when all of them are on disk are they renamed
    into place, one by one. If any step fails (or is interrupted), the files already replaced get their
    old bytes back and the temporary files are removed. A rename is atomic, so at any moment each file
    is wholly old or wholly new.
    """
    temps, done = [], []
    try:
        for target, new, _old in writes:
            try:
                temps.append((target, _write_temp(target, new)))
            except OSError as e:
                raise DsfixError(f"cannot be written: {e.strerror or e}", path=rel_of(target)) from None
        for (target, tmp), (_t, _new, old) in zip(temps, writes):
            try:
                os.replace(tmp, target)
            except OSError as e:
                raise DsfixError(f"cannot be written: {e.strerror or e}", path=rel_of(target)) from None
            done.append((target, old))
        for target, _tmp in temps:
            _fsync_dir(target.parent)
    except BaseException:
        for target, old in reversed(done):
            atomic_write(target, old)
        for _target, tmp in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- the state folder


class State:
    """``.dsfix/state.json`` plus ``original/`` and ``patched/`` copies of every patched file."""

    def __init__(self, root: Path):
        self.root = root
        self.dir = root / STATE_DIR
        self.data = {"state_version": STATE_VERSION, "files": {}}

    @property
    def exists(self) -> bool:
        return (self.dir / "state.json").is_file()

    @property
    def files(self) -> dict:
        return self.data["files"]

    @classmethod
    def load(cls, root: Path) -> "State":
        st = cls(root)
        if st.dir.is_symlink():
            raise DsfixError("the state folder is a symlink; refusing to use it", path=STATE_DIR)
        if not st.exists:
            return st
        try:
            st.data = json.loads((st.dir / "state.json").read_text("utf-8"))
            for rel, entry in st.files.items():
                for kind in ("original", "patched"):
                    blob = st.blob(rel, kind)
                    if sha256(blob) != entry[f"{kind}_sha256"]:
                        raise ValueError(f"{kind} copy of {rel} does not match its hash")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DsfixError(
                f"the state folder is damaged ({e}); move it away to revert structurally", path=STATE_DIR
            ) from None
        return st

    def blob(self, rel: str, kind: str) -> bytes:
        return (self.dir / kind / rel).read_bytes()

    def record(self, rel: str, role: str, original: bytes, patched: bytes, **info) -> None:
        self.files[rel] = {
            "role": role,
            "original_sha256": sha256(original),
            "patched_sha256": sha256(patched),
            **info,
        }
        self._pending_blobs = getattr(self, "_pending_blobs", []) + [(rel, original, patched)]

    def save(self, **meta) -> None:
        self.data.update(meta)
        self.dir.mkdir(exist_ok=True)
        gi = self.dir / ".gitignore"
        if not gi.exists():
            atomic_write(gi, b"# written by dsfix: this folder ignores itself\n*\n")
        for rel, original, patched in getattr(self, "_pending_blobs", []):
            for kind, data in (("original", original), ("patched", patched)):
                p = self.dir / kind / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(p, data)
        self._pending_blobs = []
        atomic_write(self.dir / "state.json", (json.dumps(self.data, indent=2, sort_keys=True) + "\n").encode())

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
