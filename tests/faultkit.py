"""Fault injection over the filesystem calls an operation makes, as SQLite's I/O-error and crash tests do:
record every call on a real run, then run it again once per call N, with that call failing (an OSError) or
the process killed (SIGKILL) right before it.

    with Faults(roots=[folder]) as rec:            # record: rec.calls, a list of Call(kind, func, path)
        op()
    with Faults(roots=[folder], fail_at=n, error=errno.EIO):   # the nth counted call (0-based) raises
        op()
    with Faults(roots=[folder], kill_at=n):        # SIGKILL of this process right before the nth call
        op()                                       # (so run it in a child: os.fork after the imports)

A call is counted when its path lies inside one of ``roots``. The kinds (``KINDS``):

    open    builtins.open in a writing mode, os.open with writing or creating flags
    write   a write on such a file object, os.write, os.pwrite, os.sendfile, os.ftruncate
    fsync   os.fsync, os.fdatasync
    rename  os.rename, os.replace
    unlink  os.unlink, os.remove, os.rmdir
    rmtree  shutil.rmtree (one call: the calls it makes itself are not counted)
    mkdir   os.mkdir (os.makedirs and tempfile.mkdtemp call it)
    chmod   os.chmod

A call on a descriptor is placed by the path the kernel gives for it (/proc/self/fd). Code that writes from
C (torch.save, safetensors' save_file) makes no call that can be seen here beyond the ones it makes through
Python; ``also`` wraps such a function as one call of a kind: ``also=[(torch, "save", "write")]``.

A process started with the variables of ``hook_env(...)`` (a ``python -m patcher`` run, or every rank of a
``deepspeed`` launch) installs the same faults at start-up, through ``faulthook/sitecustomize.py`` on its
``PYTHONPATH``, and in record mode appends the calls it made to a file, read back with ``read_record``.
"""
from __future__ import annotations

import builtins
import errno as errno_codes
import json
import os
import shutil
import signal
import stat
import threading
from pathlib import Path
from typing import NamedTuple, Optional

KINDS = ("open", "write", "fsync", "rename", "unlink", "rmtree", "mkdir", "chmod")

# The errors each kind is failed with: EIO for every call; ENOSPC where the call writes or creates, EACCES
# where it creates, replaces, removes or changes a name or a mode.
ERRNOS = {
    "open": ("EIO", "ENOSPC", "EACCES"),
    "write": ("EIO", "ENOSPC"),
    "fsync": ("EIO", "ENOSPC"),
    "rename": ("EIO", "ENOSPC", "EACCES"),
    "unlink": ("EIO", "EACCES"),
    "rmtree": ("EIO", "EACCES"),
    "mkdir": ("EIO", "ENOSPC", "EACCES"),
    "chmod": ("EIO", "EACCES"),
}

HOOK_DIR = Path(__file__).resolve().parent / "faulthook"
ENV_VAR = "DSFIX_TEST_FAULTS"

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Call(NamedTuple):
    kind: str
    func: str
    path: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.func}) {self.path}"


def _errno(error) -> int:
    return getattr(errno_codes, error) if isinstance(error, str) else int(error)


def _fd_path(fd) -> Optional[str]:
    try:
        return os.readlink(f"/proc/self/fd/{int(fd)}")
    except (OSError, TypeError, ValueError):
        return None


def _path(value, dir_fd=None) -> Optional[str]:
    if isinstance(value, int):
        return _fd_path(value)
    try:
        path = os.fsdecode(os.fspath(value))
    except TypeError:
        return None
    if dir_fd is not None and not os.path.isabs(path):
        base = _fd_path(dir_fd)
        return os.path.join(base, path) if base else None
    return os.path.realpath(path)


class _WriteFile:
    """A file object opened for writing inside a root: its writes are counted, everything else is the file's."""

    def __init__(self, faults: "Faults", handle, path: str):
        self._faults, self._handle, self._path = faults, handle, path

    def write(self, data):
        self._faults._call("write", "file.write", self._path)
        return self._handle.write(data)

    def writelines(self, lines):
        self._faults._call("write", "file.writelines", self._path)
        return self._handle.writelines(lines)

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def __iter__(self):
        return iter(self._handle)

    def __getattr__(self, name):
        return getattr(self._handle, name)


class Faults:
    """Counts the filesystem calls made inside ``roots`` while it is entered (in every thread), and fails or
    kills at the ``fail_at``/``kill_at``-th one (0-based). Not reentrant: one at a time in a process."""

    def __init__(self, roots, *, fail_at: Optional[int] = None, error="EIO", kill_at: Optional[int] = None,
                 also=()):
        self.roots = [os.path.realpath(os.fspath(r)) for r in roots]
        self.fail_at, self.error, self.kill_at = fail_at, _errno(error), kill_at
        self.also = list(also)
        self.calls: list[Call] = []
        self.failed: Optional[Call] = None  # the call that was failed, once it was
        self._lock = threading.Lock()
        self._inside = threading.local()  # depth inside a call counted as one (rmtree, an `also` function)
        self._saved: list = []

    # -- the count ----------------------------------------------------------------------------------------
    def _within(self, path: Optional[str]) -> bool:
        return path is not None and any(path == r or path.startswith(r + os.sep) for r in self.roots)

    def _call(self, kind: str, func: str, path: Optional[str]) -> None:
        if getattr(self._inside, "depth", 0) or not self._within(path):
            return
        with self._lock:
            n = len(self.calls)
            call = Call(kind, func, path)
            self.calls.append(call)
        if n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if n == self.fail_at:
            self.failed = call
            raise OSError(self.error, os.strerror(self.error), path)

    def _as_one(self, kind: str, func: str, real, path_of, quiet_of=lambda a, k: False):
        def wrapped(*args, **kwargs):
            try:
                self._call(kind, func, path_of(args, kwargs))
            except OSError:
                if quiet_of(args, kwargs):  # shutil.rmtree(ignore_errors=True) swallows its own failures
                    return None
                raise
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return real(*args, **kwargs)
            finally:
                self._inside.depth -= 1
        return wrapped

    # -- the wrappers -------------------------------------------------------------------------------------
    def _wrap_all(self) -> None:
        real_open, call = builtins.open, self._call

        def open_(file, mode="r", *args, **kwargs):
            path = _path(file)
            writing = any(c in mode for c in "wax+")
            if writing:
                call("open", "open", path)
            handle = real_open(file, mode, *args, **kwargs)
            if writing and self._within(path) and not getattr(self._inside, "depth", 0):
                return _WriteFile(self, handle, path)
            return handle

        def os_open(path, flags, *args, dir_fd=None, **kwargs):
            if flags & _WRITE_FLAGS:
                call("open", "os.open", _path(path, dir_fd))
            return real["os.open"](path, flags, *args, dir_fd=dir_fd, **kwargs)

        def on_fd(kind, name):
            def wrapped(fd, *args, **kwargs):
                call(kind, name, _fd_path(fd))
                return real[name](fd, *args, **kwargs)
            return wrapped

        def on_path(kind, name):
            def wrapped(path, *args, dir_fd=None, **kwargs):
                call(kind, name, _path(path, dir_fd))
                if dir_fd is not None:
                    kwargs["dir_fd"] = dir_fd
                return real[name](path, *args, **kwargs)
            return wrapped

        def renamer(name):
            def wrapped(src, dst, *args, src_dir_fd=None, dst_dir_fd=None, **kwargs):
                source, target = _path(src, src_dir_fd), _path(dst, dst_dir_fd)
                call("rename", name, target if self._within(target) else source)
                return real[name](src, dst, *args, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, **kwargs)
            return wrapped

        def sendfile(out_fd, in_fd, *args, **kwargs):
            call("write", "os.sendfile", _fd_path(out_fd))
            return real["os.sendfile"](out_fd, in_fd, *args, **kwargs)

        real = {f"os.{n}": getattr(os, n) for n in (
            "open", "write", "pwrite", "ftruncate", "fsync", "fdatasync", "rename", "replace", "unlink",
            "remove", "rmdir", "mkdir", "chmod", "sendfile")}
        replacements = {
            (builtins, "open"): open_,
            (os, "open"): os_open,
            (os, "write"): on_fd("write", "os.write"),
            (os, "pwrite"): on_fd("write", "os.pwrite"),
            (os, "ftruncate"): on_fd("write", "os.ftruncate"),
            (os, "sendfile"): sendfile,
            (os, "fsync"): on_fd("fsync", "os.fsync"),
            (os, "fdatasync"): on_fd("fsync", "os.fdatasync"),
            (os, "rename"): renamer("os.rename"),
            (os, "replace"): renamer("os.replace"),
            (os, "unlink"): on_path("unlink", "os.unlink"),
            (os, "remove"): on_path("unlink", "os.remove"),
            (os, "rmdir"): on_path("unlink", "os.rmdir"),
            (os, "mkdir"): on_path("mkdir", "os.mkdir"),
            (os, "chmod"): on_path("chmod", "os.chmod"),
            (shutil, "rmtree"): self._as_one("rmtree", "shutil.rmtree", shutil.rmtree,
                                             lambda a, k: _path(a[0] if a else k.get("path")),
                                             lambda a, k: bool(a[1] if len(a) > 1 else k.get("ignore_errors"))),
        }
        for module, attr, kind in self.also:
            name = f"{getattr(module, '__name__', module)}.{attr}"
            replacements[(module, attr)] = self._as_one(kind, name, getattr(module, attr),
                                                        lambda a, k: _path(a[1] if len(a) > 1 else k.get("f")))
        for (module, attr), new in replacements.items():
            self._saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, new)

    def __enter__(self) -> "Faults":
        self._wrap_all()
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            module, attr, old = self._saved.pop()
            setattr(module, attr, old)


# -- processes started by a test ------------------------------------------------------------------------

def hook_env(roots, *, record=None, fail_at: Optional[int] = None, error="EIO", kill_at: Optional[int] = None,
             rank: Optional[int] = None) -> dict:
    """The variables that make a Python process (and those it starts) install ``Faults`` at start-up: add
    them to its environment. ``rank``: only the process whose RANK variable is that. ``record``: a file the
    calls are appended to (JSON lines) when the process exits, however it ends but by a kill."""
    spec = {"roots": [os.path.realpath(os.fspath(r)) for r in roots], "fail_at": fail_at, "error": error,
            "kill_at": kill_at, "rank": rank, "record": os.fspath(record) if record else None}
    path = os.environ.get("PYTHONPATH", "")
    return {ENV_VAR: json.dumps(spec), "PYTHONPATH": os.pathsep.join(p for p in (str(HOOK_DIR), path) if p)}


def install_from_env() -> Optional[Faults]:
    """Called by faulthook/sitecustomize.py at the start of every process that has the variables."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    spec = json.loads(raw)
    if spec["rank"] is not None and os.environ.get("RANK", "0") != str(spec["rank"]):
        return None
    faults = Faults(spec["roots"], fail_at=spec["fail_at"], error=spec["error"], kill_at=spec["kill_at"])
    faults.__enter__()
    if spec["record"]:
        import atexit

        def write_record(record=spec["record"], faults=faults):
            faults.__exit__(None, None, None)
            with open(record, "a", encoding="utf-8") as handle:
                for call in faults.calls:
                    handle.write(json.dumps(list(call)) + "\n")

        atexit.register(write_record)
    return faults


def read_record(path) -> list:
    """The calls that processes started with ``hook_env(record=path)`` made, in the order they wrote them."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [Call(*json.loads(line)) for line in text.splitlines() if line.strip()]


def snapshot(folder) -> dict:
    """Every file and folder under ``folder``: relative path -> (mode, bytes), None for a folder's bytes."""
    folder = Path(folder)
    found = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        data = None if stat.S_ISDIR(info.st_mode) else path.read_bytes()
        found[path.relative_to(folder).as_posix()] = (stat.S_IMODE(info.st_mode), data)
    return found
