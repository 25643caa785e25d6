"""A safetensors model folder: ``model.safetensors``, or ``model.safetensors.index.json`` and its shards.

What every safetensors writer leaves (dsfix's save module, transformers' ``save_pretrained``, ``dsfix convert``).
Opening one reads the headers only (:class:`Header`: name -> shape, dtype code, file), and what disagrees with
the index (a shard missing, a tensor in two files) is recorded in ``problems`` for verify to report; the data is
memory-mapped and read a block of rows at a time (:meth:`SafetensorsFolder.slice`). The safetensors dtype codes
are the save module's ``DTYPES`` (``patcher.templates.dsfix_safetensors``, one table for dsfix), imported when
first needed: it imports torch.
"""

from __future__ import annotations

import functools
import json
import mmap
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.names import INDEX_NAME, SINGLE_NAME, examples
from patcher.checkpoint.readers.base import Held, Put, Reader
from patcher.errors import DsfixError


@dataclass
class Header:
    """What the safetensors headers say: name -> (shape, dtype code, file)."""

    entries: dict = field(default_factory=dict)
    files: list = field(default_factory=list)
    problems: list = field(default_factory=list)


# --------------------------------------------------------------------------- dtype codes


@functools.lru_cache(maxsize=None)
def dtype_codes() -> dict:
    """torch dtype name ("bfloat16") -> safetensors header code ("BF16"): the save module's ``DTYPES``."""
    from patcher.templates.dsfix_safetensors import DTYPES

    return {str(dtype).replace("torch.", ""): code for dtype, code in DTYPES.items()}


def dtype_name(code: str) -> str:
    """A safetensors header code's torch dtype name ("BF16" -> "bfloat16"); the code itself when unknown."""
    return _dtype_names().get(code, code)


@functools.lru_cache(maxsize=None)
def _dtype_names() -> dict:
    return {c: n for n, c in dtype_codes().items()}


def dtype_code(name: Any) -> str:
    """A torch dtype's safetensors code (torch.bfloat16, "bfloat16", "torch.bfloat16" -> "BF16"); upper-cased
    when unknown."""
    name = str(name).replace("torch.", "")
    return dtype_codes().get(name, name.upper())


def is_float_code(code: str) -> bool:
    return "float" in dtype_name(code)


def header_of(tensors: dict, file: str) -> Header:
    """A :class:`Header` of ``Held`` tensors (a reader's, or a plan's), as if they were written to ``file``."""
    head = Header(files=[file])
    for name, held in tensors.items():
        head.entries[name] = (tuple(int(d) for d in held.shape), dtype_code(held.dtype), file)
    return head


# --------------------------------------------------------------------------- reading the headers


def weight_files(folder: Path, single: str = SINGLE_NAME) -> tuple[list, Optional[dict], list]:
    """(files, weight_map or None, problems). Raises DsfixError when there are no safetensors weights. ``single``:
    the one file's name (``adapter_model.safetensors`` for a PEFT adapter, never sharded)."""
    if single != SINGLE_NAME:
        if not (folder / single).is_file():
            raise DsfixError(f"no {single} in this folder", path=str(folder))
        return [single], None, []
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [], None, [f"{INDEX_NAME} is unreadable: {e}"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        problems = [f"{INDEX_NAME} names shards that are missing: {examples(missing)}"] if missing else []
        return [f for f in files if f not in missing], weight_map, problems
    if (folder / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None, []
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        ignored = f"no {SINGLE_NAME} or {INDEX_NAME}; found {examples(others)}, which from_pretrained ignores"
        return others, None, [ignored]
    bins = sorted(p.name for p in folder.glob("*.bin"))
    if bins:
        raise DsfixError(f"no safetensors weights, only {examples(bins)} (a pickle save); nothing to verify "
                         "(`dsfix convert` turns it into safetensors)", path=str(folder))
    raise DsfixError(f"no model weights ({SINGLE_NAME} or {INDEX_NAME}) in this folder", path=str(folder))


def read_headers(folder: Path, files: list, weight_map: Optional[dict]) -> Header:
    """The headers of ``files`` (no tensor data), and what disagrees with the index's ``weight_map``."""
    from safetensors import safe_open

    head = Header(files=list(files))
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    if key in head.entries:
                        head.problems.append(f"{key} appears in both {head.entries[key][2]} and {name}")
                    head.entries[key] = (tuple(int(d) for d in sl.get_shape()), sl.get_dtype(), name)
        except Exception as e:  # a truncated or garbled file
            head.problems.append(f"{name} is not a readable safetensors file: {type(e).__name__}: {e}")
    if weight_map is not None:
        wrong = [k for k, f in weight_map.items() if f in files and head.entries.get(k, (None, None, f))[2] != f]
        absent = [k for k, f in weight_map.items() if f in files and k not in head.entries]
        unlisted = [k for k in head.entries if k not in weight_map]
        if absent:
            head.problems.append(f"{INDEX_NAME} lists tensors its shards lack: {examples(absent)}")
        if wrong:
            head.problems.append(f"{INDEX_NAME} maps tensors to the wrong shard: {examples(wrong)}")
        if unlisted:
            head.problems.append(f"shards hold tensors {INDEX_NAME} does not list: {examples(unlisted)}")
    return head


def _data_offsets(f: Any) -> dict:
    """name -> (first byte, end) of each tensor's data in an open safetensors file, from its header."""
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    return {k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


class SafetensorsFolder(Reader):
    """A safetensors folder's tensors, from its headers; the data memory-mapped, read a block of rows at a time.
    Raises DsfixError when the folder holds no safetensors weights; other problems are in ``header.problems``."""

    kind = "safetensors"
    random_access = True

    def __init__(self, folder: Path, single: str = SINGLE_NAME) -> None:
        super().__init__(folder)
        files, weight_map, problems = weight_files(self.folder, single)
        self.header = read_headers(self.folder, files, weight_map)
        self.header.problems[:0] = problems
        self.indexed = weight_map is not None
        self._stack = ExitStack()
        self._open: dict = {}
        self._maps: dict = {}  # file -> (its private memory map, name -> where its data lies in the file)
        import torch

        for key, (shape, code, _) in self.header.entries.items():
            self.tensors[key] = Held(key, shape, getattr(torch, dtype_name(code), None))

    @classmethod
    def is_kind(cls, folder: Path) -> bool:
        return (folder / SINGLE_NAME).is_file() or (folder / INDEX_NAME).is_file()

    @property
    def files(self) -> list:
        return self.header.files

    @property
    def problems(self) -> list:
        return self.header.problems

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(str(self.folder / file), framework="pt"))
        return self._open[file]

    def slice(self, name: str) -> Any:
        shape, _, file = self.header.entries[name]
        handle = self._handle(file)
        return handle.get_slice(name) if shape and 0 not in shape else handle.get_tensor(name)

    def mapped(self, name: str) -> Any:
        """The stored tensor ``name`` over the file's own pages (a private memory map, nothing copied): its
        bytes are read when used, and count as file-backed memory, which the kernel can drop, not as the
        process's own. Writing to it changes a private copy, never the file."""
        import torch

        shape, _, file = self.header.entries[name]
        dtype = self.tensors[name].dtype
        if dtype is None:  # a dtype this torch does not know: safetensors' own reading says what it can
            return self.slice(name)
        if 0 in shape:
            return torch.empty(shape, dtype=dtype)
        if file not in self._maps:
            with open(self.folder / file, "rb") as f:
                self._maps[file] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), _data_offsets(f))
        buffer, offsets = self._maps[file]
        start, end = offsets[name]
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(shape)

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        for name in self.tensors:
            tensor = self._handle(self.header.entries[name][2]).get_tensor(name)
            if tensor.numel():
                put(name, 0, tensor.reshape(-1))

    def describe(self) -> str:
        what = f"{len(self.files)} shard(s) via {INDEX_NAME}" if self.indexed else examples(self.files)
        return f"{what}, {len(self.header.entries)} tensors"

    def close(self) -> None:
        self._stack.close()
        self._open = {}
        self._maps = {}  # a map stays open while a tensor over it lives
