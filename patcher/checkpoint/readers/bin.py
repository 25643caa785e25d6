"""A ``.bin`` folder: ``pytorch_model.bin``, or transformers' ``pytorch_model.bin.index.json`` and its shards.

DeepSpeed-Chat's unpatched saves write ``pytorch_model.bin`` (``torch.save`` of ``state_dict()``, a tied
``lm_head.weight`` sharing the embedding's storage, or missing where the ZeRO-3 save kept
``named_parameters()`` only); ``save_pretrained(safe_serialization=False)`` writes shards and an index;
DeepSpeed's ``engine.save_16bit_model(DIR)`` and ``zero_to_fp32`` write ``pytorch_model.bin`` alone. Every file
is loaded weights-only and memory-mapped (:mod:`patcher.checkpoint.readers.load`), so the tensors are at hand
without being read: a tied alias is the key whose tensor is the very same view of its partner's memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.names import BIN_INDEX_NAME, BIN_NAME, examples
from patcher.checkpoint.readers.base import Held, Put, Reader
from patcher.checkpoint.readers.load import load_state_dict
from patcher.checkpoint.readers.safetensors import Header, dtype_code
from patcher.errors import DsfixError


def bin_files(folder: Path) -> list:
    """The ``.bin`` files of ``folder``: the index's shards, else ``pytorch_model.bin``. Raises DsfixError."""
    if not (folder / BIN_INDEX_NAME).is_file():
        return [BIN_NAME]
    try:
        weight_map = json.loads((folder / BIN_INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is not a non-empty object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DsfixError(f"{BIN_INDEX_NAME} is unreadable: {e}", path=str(folder)) from e
    shards = sorted(set(weight_map.values()))
    bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s]
    if bad:
        raise DsfixError(f"{BIN_INDEX_NAME} names shards outside the folder: {examples(bad)}", path=str(folder))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise DsfixError(f"{BIN_INDEX_NAME} names shards that are missing: {examples(missing)}", path=str(folder))
    return shards


class BinFolder(Reader):
    """The tensors of a ``.bin`` folder's files, loaded weights-only and memory-mapped."""

    kind = "bin"
    random_access = True

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.sources = bin_files(self.folder)
        self.sharded = (self.folder / BIN_INDEX_NAME).is_file()
        self.state: dict = {}
        self.origin: dict = {}  # name -> the file that holds it
        self.mmap = True
        for name in self.sources:
            state, mapped = load_state_dict(self.folder / name)
            self.mmap = self.mmap and mapped
            for key, tensor in state.items():
                if key in self.state:
                    raise DsfixError(f"{key} is in both {self.origin[key]} and {name}", path=str(self.folder))
                self.state[key], self.origin[key] = tensor, name
        if not self.state:
            raise DsfixError(f"{examples(self.sources)} holds no tensors", path=str(self.folder))
        self._record()

    @classmethod
    def is_kind(cls, folder: Path) -> bool:
        return (folder / BIN_INDEX_NAME).is_file() or (folder / BIN_NAME).is_file()

    def _record(self) -> None:
        """Every key as held; a key whose tensor is exactly the view of an earlier one's memory is its alias (the
        save module's own rule, ``find_overlap``). A partial overlap is a tensor of its own."""
        from patcher.templates.dsfix_safetensors import find_overlap

        spans: dict = {}
        for key, t in self.state.items():
            self.tensors[key] = Held(key, tuple(int(d) for d in t.shape), t.dtype)
            partner, exact = find_overlap(key, t, spans)
            if partner is not None and exact:
                self.aliases[key] = partner

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        for key, t in self.state.items():
            if key not in self.aliases and t.numel():
                put(key, 0, t.reshape(-1))

    def slice(self, name: str) -> Any:
        return self.state[name]

    @property
    def name(self) -> str:
        return examples(self.sources)

    @property
    def header(self) -> Header:
        """What the files hold, as a safetensors header says it (name -> shape, dtype code, file)."""
        return Header(files=list(self.sources), entries={
            k: (h.shape, dtype_code(h.dtype), self.origin[k]) for k, h in self.tensors.items()})

    def describe(self) -> str:
        how = "memory-mapped" if self.mmap else "read (not zip format, so not memory-mapped)"
        return f"{examples(self.sources)}: {len(self.state)} tensors, loaded weights-only, {how}"

    def close(self) -> None:
        self.state = {}
