"""The checks that read tensor data: NaN and Inf, bit-equality, the largest difference. Memory stays bounded:
a stored tensor is read a block of rows at a time (:func:`row_blocks`, 64 MiB of it at most) through a
random-access reader (:meth:`patcher.checkpoint.readers.base.Reader.slice`), never whole."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.progress import MIN_BYTES, Progress
from patcher.checkpoint.readers.safetensors import Header, SafetensorsFolder, dtype_name, is_float_code

BLOCK_BYTES = 64 * 2**20  # how much of a stored tensor the streamed checks read at a time


def row_blocks(shape, chunk_bytes: int = BLOCK_BYTES) -> Iterator[slice]:
    """Slices of a stored tensor's rows (its first dimension), each block at most ``chunk_bytes`` (a row
    counted at 8 bytes an element, the widest dtype): reading a tensor this way never holds it whole."""
    row = max(1, math.prod(int(d) for d in shape[1:]) * 8)
    step = max(1, chunk_bytes // row)
    for start in range(0, shape[0], step):
        yield slice(start, start + step)


def blocks(reader: Any, name: str, shape: tuple) -> Iterator[Any]:
    """The stored tensor ``name`` of a random-access reader, a block of rows at a time (0-d and empty: whole).
    A reader that can memory-map its files (``mapped``) hands out views of the file's pages, not copies."""
    mapped = getattr(reader, "mapped", None)
    held = mapped(name) if mapped is not None else reader.slice(name)  # a 0-d or empty tensor comes whole
    if not shape or 0 in shape:
        yield held
        return
    for rows in row_blocks(shape, BLOCK_BYTES):
        yield held[rows]


def same_bits(a: Any, b: Any) -> bool:
    """True when two tensors have the same dtype, shape and bytes (NaN-safe, unlike torch.equal)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    # compare as integers of the element's width: bit-exact, and wider words compare faster than bytes
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size(), torch.uint8)
    return torch.equal(a.detach().reshape(-1).view(as_int), b.detach().reshape(-1).view(as_int))


def difference(a: Any, b: Any, atol: float, rtol: float) -> tuple[Optional[float], bool]:
    """(the largest |a - b|, None when bit-equal; whether every element is within ``atol + rtol * |b|``)."""
    import torch

    if same_bits(a, b):
        return None, True
    x, y = a.double(), b.double()
    diff = (x - y).abs()
    both_nan = torch.isnan(x) & torch.isnan(y)
    diff = torch.where(both_nan, torch.zeros_like(diff), torch.nan_to_num(diff, nan=float("inf")))
    within = bool((diff <= atol + rtol * y.abs().nan_to_num(nan=0.0)).all())
    return float(diff.max()), within


def stored_difference(reader: Any, name: str, ref_reader: Any, ref: str, shape: tuple, atol: float = 0.0,
                      rtol: float = 0.0, advance: Any = None) -> tuple[Optional[float], bool]:
    """:func:`difference` of two stored tensors of one shape, a block of rows at a time; ``advance(nbytes)``,
    when given, hears of each pair of blocks read."""
    worst, close = None, True
    for a, b in zip(blocks(reader, name, shape), blocks(ref_reader, ref, shape)):
        diff, ok = difference(a, b, atol, rtol)
        if advance is not None:
            advance(a.numel() * a.element_size() + b.numel() * b.element_size())
        if diff is not None:
            worst = diff if worst is None else max(worst, diff)
        close = close and ok
    return worst, close


def stored_equal(reader: Any, head: Header, a: str, b: str) -> bool:
    """Whether two tensors one folder stores are bit-equal (same shape and dtype), a block of rows at a time."""
    (shape, code, _), (shape_b, code_b, _) = head.entries[a], head.entries[b]
    if tuple(shape) != tuple(shape_b) or code != code_b:
        return False
    return stored_difference(reader, a, reader, b, tuple(shape))[0] is None


def finite_names(head: Header) -> list:
    """The tensors the NaN and Inf check reads: every floating one that is not empty."""
    return [k for k, (shape, code, _) in head.entries.items() if is_float_code(code) and 0 not in shape]


def stored_bytes(head: Header, name: str) -> int:
    """A stored tensor's bytes, from its header entry (shape and dtype code); 0 for a dtype torch lacks."""
    import torch

    shape, code, _ = head.entries[name]
    dtype = getattr(torch, dtype_name(code), None)
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 0


def finite_bytes(head: Header) -> int:
    """How many bytes :func:`finite_check` reads: the progress's total."""
    return sum(stored_bytes(head, k) for k in finite_names(head))


def finite_check(reader: Any, head: Header, stop: Any = None, advance: Any = None) -> Check:
    """No floating tensor holds NaN or Inf: each read a block of rows at a time and checked by the save module's
    ``is_finite``; the first such tensor and how many. ``stop`` (a threading.Event), once set, ends the reading
    before the next tensor: :class:`FiniteChecks` uses it when its caller is done or failed. ``advance(nbytes)``,
    when given, hears of each block read."""
    from patcher.templates.dsfix_safetensors import is_finite

    names = finite_names(head)
    bad = []
    for name in names:
        if stop is not None and stop.is_set():
            return Check("finite", False, "stopped before every tensor was read")
        finite = True
        for block in blocks(reader, name, head.entries[name][0]):
            finite = finite and is_finite(block)  # past a failing block the rest is counted, not checked
            if advance is not None:
                advance(block.numel() * block.element_size())
        if not finite:
            bad.append(name)
    if bad:
        return Check("finite", False,
                     f"{len(bad)} of {len(names)} floating tensors hold NaN or Inf, the first {bad[0]}")
    return Check("finite", True, f"no NaN or Inf in {len(names)} floating tensors")


class FiniteChecks:
    """:func:`finite_check` of each folder, one after another, on a thread started at once, while the caller does
    what needs no weights: importing transformers, reading the config, building the model on the meta device.
    On a large folder reading the weights is most of ``dsfix verify``'s time, and those fixed costs then add
    little to it. ``result(folder)`` waits for a folder's check (raising what the check raised); leaving the
    ``with`` stops the thread before its next tensor. torch is imported here, quietly, before the thread
    starts: its quiet import swaps sys.stderr, which only one thread at a time may do.

    With a ``console``, the reading shows its progress (:class:`patcher.checkpoint.progress.Progress`: a bar on a
    terminal, lines with the time left in a log) from :data:`~patcher.checkpoint.progress.MIN_BYTES` on: on a
    70B folder it is minutes of reading."""

    def __init__(self, folders: list, console: Any = None) -> None:
        from patcher.checkpoint.quiet import import_torch_quietly

        import_torch_quietly()
        from patcher.templates.dsfix_safetensors import is_finite  # noqa: F401  (imported here, not on the thread)

        self._progress = Progress(console, "dsfix verify", total=sum(_finite_total(f) for f in folders),
                                  min_total=MIN_BYTES)
        self._progress.__enter__()
        self._progress.phase("reading every tensor (NaN and Inf)")
        self._stop = threading.Event()
        self._ready = threading.Condition()
        self._done: dict = {}
        self._thread = threading.Thread(target=self._run, args=([str(f) for f in folders],), daemon=True,
                                        name="dsfix-finite-checks")
        self._thread.start()

    def _run(self, folders: list) -> None:
        for folder in folders:
            try:
                with SafetensorsFolder(Path(folder)) as reader:
                    outcome: tuple = (finite_check(reader, reader.header, self._stop, self._progress.advance), None)
            except Exception as e:  # handed to the caller, raised where it waits for this folder
                outcome = (None, e)
            with self._ready:
                self._done[folder] = outcome
                self._ready.notify_all()
            if self._stop.is_set():
                return

    def result(self, folder: Any) -> Check:
        with self._ready:
            self._ready.wait_for(lambda: str(folder) in self._done)
        check, error = self._done[str(folder)]
        if error is not None:
            raise error
        return check

    def __enter__(self) -> "FiniteChecks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._progress.__exit__(*exc)


def _finite_total(folder: Any) -> int:
    """The bytes :func:`finite_check` reads in ``folder``; 0 where its headers cannot be read (the check, on the
    thread, then says why)."""
    try:
        with SafetensorsFolder(Path(folder)) as reader:
            return finite_bytes(reader.header)
    except Exception:
        return 0
