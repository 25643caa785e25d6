"""Everything that touches the disk: reading targets, the lock, and one all-or-nothing commit.

The state folder ``.dsfix/`` sits at the checkout root and ignores itself (its ``.gitignore`` says ``*``).
This module is the only one that reads or writes it.
It keeps, for each patched file, the original bytes and the bytes dsfix wrote, with their hashes, so
``revert`` can restore originals exactly and tell when a file was edited after ``apply``.

``commit`` writes the target files and the state folder together, or nothing: the new state folder is
built whole under a temporary name, every new file is written to a temporary file beside its target,
then the state folder is swapped in and the files are renamed into place. On any failure (or Ctrl-C)
the renamed files get their old bytes back and the old state folder returns, byte for byte. A kill
leaves each file wholly old or wholly new; the next run puts an orphaned state folder back and clears
temporary files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from patcher.errors import LOCKED, DsfixError, Written, file_not_folder, stop_point
from patcher.patch.plan import Saved, sha256

STATE_DIR = ".dsfix"
STATE_VERSION = 2
TMP_SUFFIX = ".dsfix-tmp"
KEEP = object()  # commit(..., state=KEEP): leave the state folder as it is


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
                ) from None
            raise
        yield
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the state folder


@dataclass(frozen=True)
class Record:
    """What the last apply recorded besides the files: the options a later run without them uses again."""

    root: Path  # the checkout folder that holds the state folder
    main: str | None  # the step-1 script, relative to ``root``
    scripts: tuple  # further step-1 scripts (--script), relative to ``root``
    strategy: str | None
    steps: tuple  # () when not recorded


def find_root(repo: str | os.PathLike = ".") -> Path | None:
    """The folder at or above ``repo`` whose state folder records an earlier apply, if any."""
    start = Path(repo)
    if not start.exists():
        raise DsfixError("no such file or folder; pass a DeepSpeed-Chat checkout or a folder inside it",
                         path=str(repo))
    start = start.resolve()
    if start.is_file():
        raise file_not_folder(repo)
    for d in (start, *start.parents):
        if (d / STATE_DIR / "state.json").is_file() or any(d.glob(f"{STATE_DIR}.old-*")):
            return d
    return None


def _options(data: dict) -> tuple:
    """(strategy, steps) from state.json; a state folder of an older dsfix has them only per file."""
    entries = data.get("files") or {}
    strategy = data.get("strategy") or next(
        (e.get("strategy") for e in entries.values() if isinstance(e, dict) and e.get("role") == "utils"), None)
    steps = data.get("steps")
    if not steps:
        roles = {e.get("role") for e in entries.values() if isinstance(e, dict)}
        steps = [n for n in (1, 2, 3) if f"step{n}" in roles]
    steps = tuple(sorted({int(n) for n in steps if int(n) in (1, 2, 3)}))
    return (strategy if strategy in ("clone", "dedupe") else None), steps


def recorded(repo: str | os.PathLike = ".") -> Record | None:
    """The options the state folder at or above ``repo`` records; None when there is none or it cannot be
    read (``load`` tells what is wrong with it when it matters)."""
    root = find_root(repo)
    return record_at(root) if root is not None else None


def record_at(root: Path) -> Record | None:
    """The options the state folder of the checkout ``root`` records, if it has one that can be read."""
    try:
        data = json.loads((root / STATE_DIR / "state.json").read_text("utf-8"))
        strategy, steps = _options(data)
        return Record(root, data.get("main"), tuple(data.get("scripts", ())), strategy, steps)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _orphans(root: Path, kind: str) -> list:
    return sorted(p for p in root.glob(f"{STATE_DIR}.{kind}-*") if p.is_dir())


def recover(root: Path) -> None:
    """After a killed run: put back a state folder that was moved aside, drop a half-built new one."""
    if not (root / STATE_DIR).exists():
        old = _orphans(root, "old")
        if old:
            os.replace(old[-1], root / STATE_DIR)
    for p in _orphans(root, "new") + _orphans(root, "old") + _orphans(root, "gone"):
        shutil.rmtree(p, ignore_errors=True)


def has_state(root: Path) -> bool:
    """Whether ``root`` holds a state folder, or one a killed run moved aside."""
    return (root / STATE_DIR / "state.json").is_file() or any(root.glob(f"{STATE_DIR}.old-*"))


def recorded_scripts(root: Path) -> tuple | None:
    """(step-1 script, [further scripts]) as the state folder records them, relative to ``root``, read without
    checking the saved copies; None when there is no readable record."""
    try:
        data = json.loads((root / STATE_DIR / "state.json").read_text("utf-8"))
        main, scripts = data["main"], list(data.get("scripts", ()))
        if not all(isinstance(p, str) for p in (main, *scripts)):
            raise TypeError("not a path")
        return main, scripts
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load(root: Path) -> Saved | None:
    """The state folder's content, each copy checked against its hash; None when there is none."""
    folder = root / STATE_DIR
    if folder.is_symlink():
        raise DsfixError("the state folder is a symlink; refusing to use it", path=STATE_DIR + "/")
    if not (folder / "state.json").is_file():
        return None
    try:
        data = json.loads((folder / "state.json").read_text("utf-8"))
        if data.get("state_version", 1) > STATE_VERSION:
            raise DsfixError(f"the state folder was written by a newer dsfix (state version {data['state_version']}); "
                             "revert with that version", path=STATE_DIR + "/")
        entries = data["files"]
        blobs: dict[tuple[str, str], bytes | None] = {}
        for rel, entry in entries.items():
            for kind in ("original", "patched"):
                if entry[f"{kind}_sha256"] is None:  # the file was not there (the save module before apply)
                    blobs[(rel, kind)] = None
                    continue
                blob = (folder / kind / rel).read_bytes()
                if sha256(blob) != entry[f"{kind}_sha256"]:
                    raise ValueError(f"{kind} copy of {rel} does not match its hash")
                blobs[(rel, kind)] = blob
        strategy, steps = _options(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DsfixError(f"the state folder is damaged ({e}); move it away to revert structurally",
                         path=STATE_DIR + "/") from None
    return Saved(entries, blobs, data.get("main"), tuple(data.get("scripts", ())), strategy, steps)


def _build(folder: Path, saved: Saved) -> None:
    folder.mkdir()
    files = {".gitignore": b"# written by dsfix: this folder ignores itself\n*\n"}
    for (rel, kind), data in saved.blobs.items():
        if data is not None:
            files[f"{kind}/{rel}"] = data
    record = {"state_version": STATE_VERSION, "files": saved.entries, "main": saved.main,
              "scripts": list(saved.scripts), "strategy": saved.strategy, "steps": list(saved.steps)}
    files["state.json"] = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
    for name, data in files.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        write_synced(p, data)
    fsync_dir(folder)


# ----------------------------------------------------------------------------- writing


def write_synced(path: Path, data: bytes) -> None:
    """``data`` into ``path`` (created or truncated), flushed and fsynced before it returns."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder, so a rename in it lasts; where the system cannot, nothing."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def clear_temps(targets) -> None:
    """The temporary files a killed earlier run left beside ``targets`` (``.NAME.PID.dsfix-tmp``, nothing else)
    removed; under the lock, no other run is writing them."""
    for target in targets:
        for stale in target.parent.glob(f".{target.name}.*{TMP_SUFFIX}"):
            if stale.name[len(target.name) + 2:-len(TMP_SUFFIX)].isdigit():
                with contextlib.suppress(OSError):
                    stale.unlink()


def _write_temp(target: Path, data: bytes) -> Path:
    """``data`` in a temporary file beside ``target`` (same folder, same mode), fsynced. Temporary files of
    a killed earlier run beside the same target are removed first."""
    clear_temps([target])
    tmp = target.parent / f".{target.name}.{os.getpid()}{TMP_SUFFIX}"
    try:
        write_synced(tmp, data)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, target.stat().st_mode & 0o7777)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def commit(root: Path, writes: list, state=KEEP, rel_of=lambda p: str(p)) -> None:
    """Write ``writes`` ([(path, new bytes, or None to remove the file)], in that order) and replace the state
    folder with ``state`` (a Saved, None to remove it, KEEP to leave it): all of it, or nothing."""
    folder, pid = root / STATE_DIR, os.getpid()
    new_dir, old_dir = root / f"{STATE_DIR}.new-{pid}", root / f"{STATE_DIR}.old-{pid}"
    gone = root / f"{STATE_DIR}.gone-{pid}"
    temps, done, swapped = [], [], False
    try:
        if isinstance(state, Saved):
            _build_or_refuse(new_dir, state)
        for target, data in writes:
            temps.append((target, None if data is None else _temp_or_refuse(target, data, rel_of)))
        stop_point("commit.staged")  # tests: every new byte written aside, nothing swapped yet
        if state is not KEEP:
            swapped = True  # from here, a failure puts the old state folder back
            _swap_state(folder, new_dir if isinstance(state, Saved) else None, old_dir)
        stop_point("commit.swapped")  # tests: the state folder swapped in, no file renamed yet
        for target, tmp in temps:
            old = target.read_bytes() if target.exists() else None
            _put(target, tmp, rel_of)
            done.append((target, old))
            stop_point("commit.renamed")  # tests: commit.renamed#N, after the Nth file is in place
        for target, _tmp in temps:
            fsync_dir(target.parent)
        if old_dir.exists():  # the old state folder is no longer one to put back: a name recover() removes
            _swap_state(old_dir, None, gone)  # failing, it is still one: all is rolled back, as before
    except BaseException:
        _roll_back(done, temps, swapped, folder, new_dir, old_dir, state)
        raise
    Written.mark()  # every file is in place: an interrupt from here on leaves them written
    stop_point("commit.done")  # tests
    shutil.rmtree(gone, ignore_errors=True)
    fsync_dir(root)


def _build_or_refuse(new_dir: Path, state: Saved) -> None:
    try:
        _build(new_dir, state)
    except OSError as e:
        raise DsfixError(f"cannot write the state folder: {e.strerror or e}; nothing was changed",
                         path=STATE_DIR + "/") from None


def _temp_or_refuse(target: Path, data: bytes, rel_of) -> Path:
    try:
        return _write_temp(target, data)
    except OSError as e:
        raise DsfixError(f"cannot be written: {e.strerror or e}", path=rel_of(target)) from None


def _swap_state(folder: Path, new_dir: Path | None, old_dir: Path) -> None:
    """The old state folder moved aside (to ``old_dir``) and the new one (``new_dir``, if any) moved in."""
    try:
        if folder.exists():
            os.replace(folder, old_dir)
        if new_dir is not None:
            os.replace(new_dir, folder)
    except OSError as e:
        raise DsfixError(f"cannot write the state folder: {e.strerror or e}; nothing was changed",
                         path=STATE_DIR + "/") from None


def _put(target: Path, tmp: Path | None, rel_of) -> None:
    """The new file renamed into place, or (``tmp`` None) the file removed."""
    try:
        if tmp is None:
            if target.exists():
                target.unlink()
        else:
            os.replace(tmp, target)
    except OSError as e:
        raise DsfixError(f"cannot be written: {e.strerror or e}", path=rel_of(target)) from None


def _roll_back(done: list, temps: list, swapped: bool, folder: Path, new_dir: Path, old_dir: Path, state) -> None:
    """After a failure (or Ctrl-C) in commit: every file as it was, the old state folder back."""
    for target, old in reversed(done):
        if old is None:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
        else:
            os.replace(_write_temp(target, old), target)
    for _target, tmp in temps:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    if swapped:
        if isinstance(state, Saved) and not new_dir.exists():
            shutil.rmtree(folder, ignore_errors=True)  # the new one was swapped in: take it out
        if old_dir.exists():
            os.replace(old_dir, folder)
    shutil.rmtree(new_dir, ignore_errors=True)
