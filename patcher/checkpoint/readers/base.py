"""What every reader of a checkpoint layout offers: the tensors it holds, the aliases it records, and a stream.

A reader is one layout of weights on disk (a ``.bin`` folder, a safetensors folder, a ZeRO-1/2 or ZeRO-3 engine
checkpoint, a universal checkpoint, a PEFT run's adapter). It says, from file names alone and without torch,
whether a folder is its kind (:meth:`Reader.is_kind`); opened, it lists what it holds (:attr:`Reader.tensors`:
name, shape and dtype, in the order the model holds them) and the names it records as another tensor
(:attr:`Reader.aliases`: a tied ``lm_head.weight`` and the embedding it is), and hands its data to the writer
(:meth:`Reader.stream`): ``put(name, first element, flat data)``, one piece of one tensor at a time, so that a
reader of partitions never holds a whole model. A step (:mod:`patcher.checkpoint.steps`) is a reader too: it
wraps another and changes what it holds (LoRA factors fused into their weights).

Readers that keep every tensor at hand (``random_access``) also give a whole tensor or a block of its rows
(:meth:`Reader.slice`): verify and compare read them that way, and the converted files are compared back
with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, NamedTuple, Optional, TypeVar

# put(tensor name, its first element here, flat data): the data is the caller's again once put returns (a
# buffer read into again), so put writes or copies it, never keeps it
Put = Callable[[str, int, Any], None]
R = TypeVar("R", bound="Reader")


class Held(NamedTuple):
    """A tensor a reader holds: its name, shape and dtype (a torch dtype), as they are on disk."""

    name: str
    shape: tuple
    dtype: Any


def numel(shape: Iterable) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count


class Reader:
    """One layout of weights on disk. A subclass sets ``kind``, implements ``is_kind`` and ``stream``, and fills
    ``tensors`` (and ``aliases``) when it is opened; ``describe`` is the one line the reports show."""

    kind: ClassVar[str] = ""
    masters: ClassVar[bool] = False  # it holds a run's fp32 master weights: written in the config's dtype
    random_access: ClassVar[bool] = False  # slice() is cheap: every tensor is at hand (memory-mapped)

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.tensors: dict[str, Held] = {}
        self.aliases: dict[str, str] = {}  # name -> the name it is recorded as (the source holds one tensor)

    @classmethod
    def is_kind(cls, folder: Path) -> bool:
        """Whether ``folder`` holds this layout, from its file names (no torch)."""
        raise NotImplementedError

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        """Hands every element of every tensor in :attr:`tensors` to ``put``, piece by piece. ``workdir``: a folder
        of the write under way where a reader may keep scratch files (it removes them itself)."""
        raise NotImplementedError

    def checks(self) -> list:
        """What a step did, as rows for the reports (a reader has none)."""
        return []

    def extra_files(self, folder: Path, dtype: Any) -> list:
        """Files of the reader's own written into ``folder`` beside the weights, after the stream: their checks."""
        return []

    @property
    def name(self) -> str:
        """What is read, in a few words (a file's name, a step's tag)."""
        return self.folder.name

    def describe(self) -> str:
        return f"{self.kind}: {len(self.tensors)} tensors"

    def slice(self, name: str) -> Any:
        """A random-access reader's tensor ``name``, as something indexed by rows (``[a:b]``) or read whole."""
        raise NotImplementedError(f"{self.kind} reads its tensors in a stream only")

    def read(self, names: Iterable[str]) -> dict:
        """The whole tensors ``names`` (in the dtype held): sliced where the reader allows it, else gathered from
        one pass of :meth:`stream`, keeping only those names."""
        import torch

        wanted = {n: self.tensors[n] for n in names}
        if self.random_access:
            return {n: self.slice(n)[:] if self.tensors[n].shape else self.slice(n) for n in wanted}
        out = {n: torch.empty(numel(h.shape), dtype=h.dtype) for n, h in wanted.items()}

        def keep(name: str, first: int, data) -> None:
            if name in out:
                out[name][first:first + data.numel()] = data

        self.stream(keep)
        return {n: t.reshape(wanted[n].shape) for n, t in out.items()}

    def close(self) -> None:
        """Lets go of what the reader holds open (memory-mapped files)."""

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
