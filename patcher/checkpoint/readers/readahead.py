"""A reader's next files read ahead into the page cache while it works on the current one.

A memory-mapped file is read from the disk one page fault at a time: each fault reads the kernel's
read-around window (128 KiB by default) and waits for it. A reader that casts and writes as it goes thus reads
its files at a fraction of the disk's sequential speed, and the disk idles while it computes (8B, 8 ranks,
cold cache: 32 GB of fp32 masters read in 25 s by read(), convert 2.3x that). :class:`ReadAhead` asks the
kernel to read whole files (``posix_fadvise`` WILLNEED, 64 MiB at a time, from a thread), at most ``ahead``
files beyond the one in use, so that the disk streams while the reader computes. The pages are the kernel's
cache, which it drops under memory pressure, not this process's memory. Where ``posix_fadvise`` does not exist
(macOS, Windows) it does nothing: the reads are then the faults', as before.
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Sequence

STEP = 64 * 2**20  # what one hint asks for: the thread checks whether to stop between hints


class ReadAhead:
    """``with ReadAhead(paths) as ahead:`` then ``ahead.using(i)`` when the reader starts on ``paths[i]``."""

    def __init__(self, paths: Sequence, ahead: int = 1) -> None:
        self.paths, self.ahead = list(paths), ahead
        self._using = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "ReadAhead":
        if hasattr(os, "posix_fadvise") and self.paths:
            self._thread = threading.Thread(target=self._run, name="dsfix-readahead", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def using(self, index: int) -> None:
        with self._cond:
            self._using = index
            self._cond.notify_all()

    def _run(self) -> None:
        for i, path in enumerate(self.paths):
            with self._cond:
                while not self._stop and i > self._using + self.ahead:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                self.advise(path)
            except OSError:  # a hint only: the reader's own reads say what is wrong with the file
                return

    def advise(self, path: object) -> None:
        """Asks the kernel to read ``path`` into the page cache; returns once the reads are queued."""
        fd = os.open(str(path), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, STEP):
                if self._stop:
                    return
                os.posix_fadvise(fd, offset, min(STEP, size - offset), os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
