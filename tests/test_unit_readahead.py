"""patcher/checkpoint/readers/readahead.py: which files are read ahead, and when (no torch)."""
import os
import threading
import time

import pytest

from patcher.checkpoint.readers.readahead import ReadAhead


class Recorded(ReadAhead):
    """ReadAhead whose hints are recorded (with the index in use when each was given) after the real one."""

    def __init__(self, paths, ahead=1):
        super().__init__(paths, ahead)
        self.advised = []
        self.event = threading.Event()

    def advise(self, path):
        super().advise(path)
        self.advised.append((self.paths.index(path), self._using))
        self.event.set()


def _files(tmp_path, n, size=3 * 2**20):
    paths = []
    for i in range(n):
        path = tmp_path / f"rank{i}.pt"
        path.write_bytes(os.urandom(1024) * (size // 1024))
        paths.append(path)
    return paths


def _settle(ahead, count):
    deadline = time.monotonic() + 10
    while len(ahead.advised) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # nothing more may come


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise: Linux and other POSIX systems")
@pytest.mark.parametrize("ahead, using, expected", [
    (1, [0], [0, 1]),  # the file in use and the next
    (1, [0, 1, 2], [0, 1, 2, 3]),
    (2, [0], [0, 1, 2]),
    (0, [0, 1], [0, 1]),  # never beyond the file in use
    (1, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),  # to the last file, no further
])
def test_reads_ahead_at_most_ahead_files(tmp_path, ahead, using, expected):
    paths = _files(tmp_path, 6, size=64 * 1024)
    with Recorded(paths, ahead) as reader:
        for index in using:
            reader.using(index)
            _settle(reader, min(index + ahead + 1, len(paths)))
        seen = list(reader.advised)
    assert [i for i, _ in seen] == expected
    assert all(i <= at + ahead for i, at in seen)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise: Linux and other POSIX systems")
def test_leaving_stops_the_thread(tmp_path):
    paths = _files(tmp_path, 3, size=64 * 1024)
    reader = Recorded(paths, ahead=1)
    with reader:
        reader.event.wait(10)
    assert reader._thread is not None and not reader._thread.is_alive()
    assert [i for i, _ in reader.advised] in ([0], [0, 1])


def test_a_missing_file_is_only_a_missed_hint(tmp_path):
    paths = _files(tmp_path, 1, size=64 * 1024) + [tmp_path / "gone.pt"]
    with ReadAhead(paths) as reader:
        reader.using(1)
    assert reader._thread is None or not reader._thread.is_alive()


def test_nothing_to_read(tmp_path):
    with ReadAhead([]) as reader:
        reader.using(0)
    assert reader._thread is None
