"""The one writer of converted weights: headers first, then each piece of each tensor at its place.

The files are laid out by the save module's own ``layout_files`` (runs up to the shard size, each file's
tensors by dtype then name, every offset aligned, as safetensors' ``save_file`` puts them: the same bytes), so
a file's header is known before any data. Each file is created at its full size with its header written;
then the reader hands over one piece of one tensor at a time (:meth:`Writer.put`), which is cast to the
dtype written and put at its offset with ``pwrite``, for the tensor and for every alias written from it.
Memory is one piece (a rank's partition, a tensor of a ``.bin``), never the whole model. Every element of
every tensor is counted (:meth:`Writer.finish`): a file is never left with a hole. The index of a sharded
folder is written last.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from patcher.checkpoint.names import INDEX_NAME, examples
from patcher.errors import DsfixError

MAX_SHARD_SIZE = 5 * 1024**3  # transformers' and the save module's


class _Out(NamedTuple):
    fd: int
    start: int  # absolute file offset of the tensor's data
    dtype: Any
    itemsize: int


def _bytes_of(tensor: Any) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy and without numpy."""
    n = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


class Writer:
    """Writes ``entries`` (``plan.Entry``: name, shape, dtype, source) into ``folder``: ``open()`` lays the files out,
    ``put(source, first, data)`` writes a piece wherever it goes, ``finish()`` checks that every element came and
    writes the index; ``close()`` closes what is open. The files: ``model.safetensors``, or shards
    ``model-0000i-of-0000n.safetensors`` above ``limit`` bytes, or one file named ``single`` (a PEFT adapter's);
    ``where``: the source, which the refusals name; ``advance(nbytes)``: progress."""

    def __init__(self, folder: Path, entries: list, where: Path, limit: int = MAX_SHARD_SIZE,
                 advance: Callable[[int], None] = lambda n: None, single: Optional[str] = None) -> None:
        self.folder, self.entries, self.limit, self.advance = Path(folder), list(entries), int(limit), advance
        self.where, self.single = where, single
        self.files: list = []
        self.names: list = []
        self.nbytes = 0
        self._fds: list = []
        self._by_source: dict = {}
        self._covered = {e.name: 0 for e in self.entries}

    def open(self) -> None:
        import torch

        from patcher.templates.dsfix_safetensors import PlannedTensor, layout_files

        planned = [PlannedTensor(e.name, e.dtype, tuple(int(d) for d in e.shape)) for e in self.entries]
        if self.single is None:
            self.files = layout_files(planned, self.limit)
        else:  # one file of its own name, however large (a PEFT adapter's)
            self.files = [f._replace(name=self.single) for f in layout_files(planned, sum(t.nbytes for t in planned))]
        home = {}
        for f in self.files:
            fd = os.open(str(self.folder / f.name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
            self._fds.append(fd)
            _pwrite_all(fd, f.header, 0)
            os.ftruncate(fd, f.size)
            for t in f.tensors:
                home[t.name] = (fd, f.offsets[t.name])
                self.nbytes += t.nbytes
        for e in self.entries:
            fd, start = home[e.name]
            itemsize = torch.empty((), dtype=e.dtype).element_size()
            self._by_source.setdefault(e.source, []).append((e, _Out(fd, start, e.dtype, itemsize)))
        self.names = [f.name for f in self.files]

    def put(self, source: str, first: int, data: Any) -> None:
        """``data`` (flat) holds the elements of the reader's tensor ``source`` from element ``first`` on."""
        cast: dict = {}
        for entry, out in self._by_source.get(source, ()):
            if out.dtype not in cast:
                cast[out.dtype] = data.to(out.dtype).contiguous() if data.dtype != out.dtype else data.contiguous()
            chunk = cast[out.dtype]
            if first + chunk.numel() > entry.numel:
                raise DsfixError(f"{source}: elements {first}-{first + chunk.numel()} lie past its shape "
                                 f"{list(entry.shape)}; the checkpoint is inconsistent", path=str(self.where))
            buf = _bytes_of(chunk)
            _pwrite_all(out.fd, buf, out.start + first * out.itemsize)
            self._covered[entry.name] += chunk.numel()
            self.advance(len(buf))

    def finish(self) -> list:
        """Every element written (else DsfixError, nothing written); the files closed, the index written.
        Returns the file names (shards first, the index last)."""
        short = [f"{e.name} ({self._covered[e.name]} of {e.numel} elements)" for e in self.entries
                 if self._covered[e.name] != e.numel]
        if short:
            raise DsfixError(f"the checkpoint does not hold every element: {examples(short)}; nothing written",
                             path=str(self.where))
        self.close()
        if len(self.files) > 1:
            weight_map = {t.name: f.name for f in self.files for t in f.tensors}
            index = {"metadata": {"total_size": self.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            self.names.append(INDEX_NAME)
        return list(self.names)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
