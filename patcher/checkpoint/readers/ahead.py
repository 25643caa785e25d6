"""Reading ahead: the files an engine checkpoint streams from, read into the page cache by a second thread.

The engine readers map each rank's optimizer file and cast its fp32 pieces as they go (:mod:`.engine`). Alone,
that is one thread doing three things in turn: it waits for the disk while a page faults in, then casts, then
writes, and the disk idles while it casts. :class:`ReadAhead` reads the same files, in the order the stream
takes them, with plain ``pread``\\ s into one scratch buffer, so that the pages are in the page cache when the
cast comes to them: the disk streams while the first thread casts and writes.

It stays at most ``window`` bytes ahead of what the stream has used (:meth:`ReadAhead.used`), so the page cache
it fills is bounded whatever the checkpoint's size, and pages are not read so early that the kernel drops them
again before use. It is an optimisation only: a file it cannot open or read, it leaves to the stream, whose own
reads report the error.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Sequence

CHUNK = 8 << 20  # one pread
WINDOW = 1 << 30  # how far ahead of the stream it reads


class ReadAhead:
    """``with ReadAhead(paths) as ahead:`` reads ``paths`` in order in a thread while the body streams them; the
    body says how far it has come with ``ahead.used(index, offset)`` (file ``index``, ``offset`` bytes into it).
    Leaving the block stops the thread."""

    def __init__(self, paths: Sequence[Path], window: int = WINDOW) -> None:
        self.paths = [Path(p) for p in paths]
        self.window = window
        self.starts = [0]
        for p in self.paths:
            self.starts.append(self.starts[-1] + _size(p))
        self.read = 0  # bytes read so far, all files together
        self._used = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dsfix-read-ahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def used(self, index: int, offset: int = 0) -> None:
        """The stream has come ``offset`` bytes into file ``index``."""
        with self._cond:
            self._used = max(self._used, self.starts[index] + offset)
            self._cond.notify_all()

    def _wait_for_room(self, position: int) -> bool:
        """Blocks while ``position`` is a window ahead of the stream; False once the stream has ended."""
        with self._cond:
            while not self._stop and position > self._used + self.window:
                self._cond.wait()
            return not self._stop

    def _run(self) -> None:
        view = memoryview(bytearray(CHUNK))
        for index, path in enumerate(self.paths):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return
            try:
                offset = 0
                while self._wait_for_room(self.starts[index] + offset):
                    n = os.preadv(fd, [view], offset)
                    if n <= 0:
                        break
                    offset += n
                    self.read += n
                else:
                    return
            except OSError:
                return
            finally:
                os.close(fd)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
