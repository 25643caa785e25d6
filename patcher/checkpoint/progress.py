"""Progress for smoke, convert and engine convert: rich's bars on a terminal, plain lines anywhere else.

A cluster job's log is never a terminal, and rich's live display prints nothing useful there. Off a
terminal, :class:`Progress` prints a plain line when a phase starts, and while one lasts a line every
``interval`` seconds when there is news (bytes done) or every ``heartbeat`` seconds when there is none,
never more than one line in ``interval`` seconds (the way pip and huggingface_hub log off a terminal)::

    dsfix smoke: rank 0: build (in this process, no DeepSpeed engine) [2s]
    dsfix convert: converting (write, then compare): 1.2 GB of 4.8 GB, 25% [40s, ~2m00s left at this rate]

The time left is the bytes left at the rate of the last ``RATE_WINDOW`` seconds, not the average since the
start: a large output's first gigabytes go to the page cache far faster than the disk then takes the rest
(4B, cold: 4.2 GB in the first 10 s, 4.2 GB more in the next 35). The checks after the last byte are not in
it. On a terminal, rich's bar shows its own estimate.

torch-free; rich is imported only for a terminal.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Optional

INTERVAL = 5.0  # seconds: at most one line this often
HEARTBEAT = 30.0  # seconds: a line this often while nothing changes
RATE_WINDOW = 10.0  # seconds: the time left is reckoned at the rate of the bytes done in this last stretch
MIN_BYTES = 64 * 2**20  # convert and verify show their bytes' progress from this much data on


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds}s" if seconds < 60 else f"{seconds // 60}m{seconds % 60:02d}s"


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


class Lines:
    """The plain lines off a terminal. ``write`` gets each line; ``tick`` (called about twice a second)
    writes what is due. Times come from ``clock``, so a table test can drive it."""

    def __init__(self, write, title: str, total: int | None = None, interval: float = INTERVAL,
                 heartbeat: float = HEARTBEAT, clock=time.monotonic):
        self.write, self.title, self.total = write, title, total
        self.interval, self.heartbeat, self.clock = interval, heartbeat, clock
        self.start = clock()
        self.text, self.done = "", 0
        self.samples: deque = deque()  # (when, bytes done) at each advance of the last RATE_WINDOW, and one before
        self.news = False  # something changed since the last line
        self.last: float | None = None  # when the last line was written
        self._lock = threading.Lock()

    def phase(self, text: str) -> None:
        with self._lock:
            self.text, self.news = text, True
            self._due()

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = self.clock()
            self.samples.append((now, self.done))
            self._forget(now)
            self.news = True
            self._due()

    def tick(self) -> None:
        with self._lock:
            self._due()

    def _due(self) -> None:
        now = self.clock()
        if not self.text:
            return
        wait = self.interval if self.news else self.heartbeat
        if self.last is not None and now - self.last < wait:
            return
        self.last, self.news = now, False
        amount = ""
        if self.total:
            amount = f": {_size(self.done)} of {_size(self.total)}, {100 * self.done // self.total}%"
        self.write(f"{self.title}: {self.text}{amount} [{_elapsed(now - self.start)}{self._left(now)}]")

    def _forget(self, now: float) -> None:
        """Keep the samples of the last RATE_WINDOW and the newest one before it."""
        while len(self.samples) > 1 and self.samples[1][0] <= now - RATE_WINDOW:
            self.samples.popleft()

    def _left(self, now: float) -> str:
        """", ~Ns left at this rate": the bytes left at the rate since the newest advance at least RATE_WINDOW
        old; nothing without a total, before bytes have moved that long, or when every byte is done."""
        if not self.total or not self.samples or self.done >= self.total:
            return ""
        self._forget(now)
        since, done_then = self.samples[0]
        if now - since < RATE_WINDOW or self.done <= done_then:
            return ""
        rate = (self.done - done_then) / (now - since)
        return f", ~{_elapsed((self.total - self.done) / rate)} left at this rate"


class Progress:
    """``with Progress(console, "dsfix smoke") as p: p.phase("build"); p.advance(nbytes)``.

    ``console``: rich's Console (stderr), or None for no progress at all. ``total``: bytes, for a bar;
    below ``min_total`` nothing is shown (a small job ends before a bar would help)."""

    def __init__(self, console, title: str, *, total: int | None = None, min_total: int = 0):
        self.console, self.title, self.total = console, title, total
        self.shown = console is not None and (total is None or total >= min_total)
        self._bar: Any = None
        self._task: Any = None
        self._lines: Optional[Lines] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def __enter__(self) -> "Progress":
        if not self.shown:
            return self
        if getattr(self.console, "is_terminal", False):
            self._open_bar()
        else:
            self._lines = Lines(self._print, self.title, self.total)
            thread = threading.Thread(target=self._ticks, name="dsfix-progress", daemon=True)
            thread.start()
            self._thread = thread
        return self

    def _open_bar(self) -> None:
        from rich import progress as rp

        columns: tuple
        if self.total is None:
            columns = (rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.TimeElapsedColumn())
        else:
            columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn(),
                       rp.TimeRemainingColumn())
        self._bar = rp.Progress(*columns, console=self.console, transient=True)
        self._bar.__enter__()
        self._task = self._bar.add_task(self.title, total=self.total)  # until the first phase names itself

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _ticks(self) -> None:
        while not self._stop.wait(0.5):
            if self._lines is not None:
                self._lines.tick()

    def phase(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        elif self._lines is not None:
            self._lines.phase(text)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)
        elif self._lines is not None:
            self._lines.advance(n)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
        if self._bar is not None:
            self._bar.__exit__(*exc)
