"""A rank's flat fp32 partitions, read from its optimizer file in blocks, one block ahead of the cast.

The flat groups are nearly all of what a convert reads: 4 bytes a parameter, every rank's file. Read through
the memory-mapped tensors, each page is fetched by a page fault and the cast waits for every one. Here each
group's bytes are read in order with ``pread``, :data:`BLOCK` bytes at a time into three buffers used in
turn, on a thread of its own that stays one block ahead; the cast takes its pieces out of the blocks as they
come (on the benchmark's 2-core machine, 8 GB of masters cast to bf16 and written: 10-13 s this way, 22-29 s
through the map, with a quarter of the CPU time in user space).

Where a group lies in the file is where its mapped tensor's memory comes from, as the kernel lists the
process's mappings (Linux). Before the thread starts, each group's first 4 KiB read from there are compared
with the mapped tensor's; where the kernel does not say (another system), or the bytes differ, the pieces
are cut from the mapped tensors as before. A part is handed on as a tensor over a buffer that the thread may
read into again once the next block is asked for: whoever is handed one writes or copies it before it
returns (:data:`patcher.checkpoint.readers.base.Put`).
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, Generator, NamedTuple, Optional

from patcher.errors import DsfixError

BLOCK = 16 << 20  # bytes read at a time: the disk floor's own
CHECK_BYTES = 4096  # of each group, compared with the mapped tensor before the first block is handed on


def pieces_read(path: Path, groups: list, pieces: list) -> Generator[tuple, None, None]:
    """(piece, its element ``at``, data): ``pieces`` (``zero12.Piece``) of the rank file ``path``'s flat
    ``groups`` (1-D tensors memory-mapped from it), each in one or more parts, ``data`` holding the piece's
    elements from ``at`` on. Close the iterator (or run it out) to stop its thread."""
    if not pieces:
        return
    starts = [mapped_offset(g, path) if g.numel() else 0 for g in groups]  # an empty group is never read
    if not hasattr(os, "preadv") or None in starts or not _same_bytes(path, groups, starts):
        for p in pieces:
            yield p, 0, groups[p.group].narrow(0, p.src, p.length)
        return
    reader = _Ahead(path, groups, starts)
    try:
        block = None
        for p in sorted(pieces, key=lambda p: (p.group, p.src)):
            at = 0
            while at < p.length:
                here = p.src + at
                while block is None or block.group < p.group or block.first + block.data.numel() <= here:
                    block = reader.next()
                if block.group != p.group or here < block.first:  # the layouts' pieces never overlap
                    raise DsfixError(f"{p.name}: its pieces overlap or lie past its flat partitions; nothing "
                                     "written", path=str(path))
                take = min(p.length - at, block.first + block.data.numel() - here)
                yield p, at, block.data.narrow(0, here - block.first, take)
                at += take
    finally:
        reader.stop()


class _Block(NamedTuple):
    """Elements ``first`` on of flat group ``group``, in one of the thread's buffers."""

    group: int
    first: int
    data: Any


def mapped_offset(tensor: Any, path: Path) -> Optional[int]:
    """Where a contiguous tensor memory-mapped from ``path`` begins in it, from the kernel's own list of the
    process's mappings (``/proc/self/maps``: each mapping's addresses, file offset, device and inode); None where
    there is no such list (not Linux) or the tensor is not mapped from that file. The inode decides, not the
    device: on btrfs ``stat`` gives a subvolume's device and the list the filesystem's."""
    if not tensor.is_contiguous() or not tensor.numel():
        return None
    try:
        info = os.stat(path)
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    address = tensor.data_ptr()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or "-" not in fields[0]:
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return int(fields[2], 16) + address - low if int(fields[4]) == info.st_ino else None
    return None


def _same_bytes(path: Path, groups: list, starts: list) -> bool:
    """Whether the first bytes at each of ``starts`` are the mapped group's own."""
    import torch

    try:
        with open(path, "rb", buffering=0) as f:
            for g, start in zip(groups, starts):
                size = min(CHECK_BYTES, g.numel() * g.element_size())
                if size == 0:
                    continue
                head = bytearray(os.pread(f.fileno(), size, start))
                mapped = g.narrow(0, 0, size // g.element_size()).contiguous().view(torch.uint8)
                if len(head) != size or not torch.equal(torch.frombuffer(head, dtype=torch.uint8), mapped):
                    return False
    except OSError as e:
        raise _unreadable(path, e) from e
    return True


class _Ahead:
    """The thread that reads each group's bytes in order into three buffers in turn, one block ahead."""

    def __init__(self, path: Path, groups: list, starts: list) -> None:
        self.path, self.groups, self.starts = path, groups, starts
        self.buffers = [bytearray(BLOCK) for _ in range(3)]
        self.ready: queue.Queue = queue.Queue(maxsize=1)  # with one block in use and one being read: three
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dsfix-read-ahead", daemon=True)
        self.thread.start()

    def next(self) -> _Block:
        item = self.ready.get()
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise DsfixError("its pieces lie past its flat partitions; nothing written", path=str(self.path))
        return item

    def stop(self) -> None:
        self.halt.set()
        while self.thread.is_alive():  # a thread waiting to hand on a block is let go
            try:
                self.ready.get(timeout=0.05)
            except queue.Empty:
                pass
        self.thread.join()

    def _run(self) -> None:
        import torch

        try:
            turn = 0
            with open(self.path, "rb", buffering=0) as f:
                for index, (group, start) in enumerate(zip(self.groups, self.starts)):
                    itemsize, total = group.element_size(), group.numel() * group.element_size()
                    done = 0
                    while done < total and not self.halt.is_set():
                        buffer = self.buffers[turn % len(self.buffers)]
                        turn += 1
                        size = min(BLOCK, total - done)
                        _pread_into(f.fileno(), memoryview(buffer)[:size], start + done, self.path)
                        data = torch.frombuffer(buffer, dtype=group.dtype, count=size // itemsize)
                        self.ready.put(_Block(index, done // itemsize, data))
                        done += size
            self.ready.put(None)
        except OSError as e:  # EIO from a failing disk: the file named, as every error of a convert is
            self.ready.put(_unreadable(self.path, e))
        except BaseException as e:  # handed to the reader's caller, where it is raised
            self.ready.put(e)


def _unreadable(path: Path, e: OSError) -> DsfixError:
    return DsfixError(f"cannot be read: {e.strerror or e}; nothing written", path=str(path))


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise DsfixError("ended before its flat partitions did (truncated?); nothing written", path=str(path))
        got += n
