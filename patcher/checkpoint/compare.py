"""``dsfix verify DIR --against REF_DIR``: two Hugging Face model folders compared, tensor by tensor.

What a converted folder is checked against here is another folder (a reference conversion, the run's own
save), not its config: the keys, each tensor's shape and dtype, its values (bit for bit, or the largest
difference within ``--atol``/``--rtol``: ``|a - b| <= atol + rtol * |b|``, b the reference's), and the ties.
A tied alias (``lm_head.weight`` when config.json ties it) may be stored on one side and not the other: the
side lacking it is compared through its partner, and wherever a folder stores both they must be bit-equal.

Memory stays bounded: the headers are read first, then one pair of tensors at a time, a block of rows at a
time (64 MiB of each side at most), from memory-mapped safetensors files. The reference may also be a
``pytorch_model.bin`` folder (what ``zero_to_fp32`` writes, or a sharded ``.bin`` index): it is loaded
weights-only and memory-mapped by ``dsfix convert``'s own loader (:func:`patcher.checkpoint.convert.load_bin`),
so a pickle that needs code to load is refused and nothing of it runs. The report names the first
difference: the first failing check (keys, shapes, dtypes, values, tied) and its first tensor in name
order; exit 1 when there is one.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

from patcher.checkpoint.checks import (
    BLOCK_BYTES, INDEX_NAME, Check, Header, dtype_code, examples, load_config, read_headers, row_blocks, shape_text,
    weight_files,
)
from patcher.checkpoint.verify import VerifyReport, expected_of, folder_kind, meta_model, same_bits
from patcher.errors import DsfixError, refuse_file

CHUNK_BYTES = BLOCK_BYTES


class Row(NamedTuple):
    """One tensor compared: ``name`` in the folder, ``ref`` in the reference (its tied partner when the reference
    stores only that), and what differs (empty: nothing)."""

    name: str
    ref: str
    shape: tuple
    dtype: str
    max_diff: Optional[float]  # None: bit-equal
    kind: str  # what differs: "shape", "dtype", "values", or "" (nothing)
    problem: str

    def to_dict(self) -> dict:
        return {"name": self.name, "ref": self.ref, "shape": list(self.shape), "dtype": self.dtype,
                "bit_equal": self.max_diff is None and not self.kind, "max_diff": self.max_diff,
                "differs": self.kind or None, "problem": self.problem or None}


@dataclass(frozen=True)
class CompareReport(VerifyReport):
    """One folder compared with a reference: verify's report, its checks the comparison's."""

    against: str = ""
    atol: float = 0.0
    rtol: float = 0.0
    rows: tuple = ()  # of Row, in name order
    first: str = ""  # the first difference, one line ("" when none)

    @property
    def summary(self) -> str:
        if self.ok:
            equal = sum(1 for r in self.rows if r.max_diff is None)
            close = len(self.rows) - equal
            return (f"matches {self.against}: {len(self.rows)} tensors compared, {equal} bit-equal"
                    + (f", {close} within atol {self.atol:g} / rtol {self.rtol:g}" if close else ""))
        return f"differs from {self.against}: {self.first}"

    def to_dict(self) -> dict:
        return {**super().to_dict(), "against": self.against, "atol": self.atol, "rtol": self.rtol,
                "first_difference": self.first or None, "compared": [r.to_dict() for r in self.rows]}


def compare_folders(path, against, atol: float = 0.0, rtol: float = 0.0) -> CompareReport:
    """Compare the model folder ``path`` with ``against`` (safetensors, or a ``.bin`` reference). Raises
    DsfixError (code 2) on bad input."""
    folder, ref = _folder(path, "the folder"), _folder(against, "--against")
    loaded: dict = {}  # (folder, .bin file) -> its state dict, for a .bin reference
    head, ref_head = _headers(folder), _headers(ref, loaded)
    groups = _tie_groups(folder, ref, head)
    partner = {k: [o for o in g if o != k] for g in groups for k in g}
    pairs, keys = _pairs(head, ref_head, partner)
    checks = [Check("files", True, f"{len(head.entries)} tensors in {examples(head.files)}; {len(ref_head.entries)} "
                                   f"in {ref}'s {examples(ref_head.files)}"), keys]
    rows = _compare_values(folder, ref, head, ref_head, pairs, atol, rtol, loaded)
    for name, what in (("shapes", "shape"), ("dtypes", "dtype"), ("values", "values")):
        bad = [r for r in rows if r.kind == what]
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        detail = f"{bad[0].name}: {bad[0].problem}{more}" if bad else _good(name, rows, atol, rtol)
        checks.append(Check(name, not bad, detail))
    checks.append(_ties_check(folder, head, ref, ref_head, groups, loaded))
    first = next((f"{c.name}: {c.detail}" for c in checks if not c.ok), "")
    return CompareReport(path=str(path), ok=not first, checks=tuple(checks), tensors=len(head.entries),
                         files=tuple(head.files), kind=folder_kind(head.entries), against=str(against), atol=atol,
                         rtol=rtol, rows=tuple(rows), first=first)


def _folder(path, what: str) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise DsfixError(f"{what}: no such folder", path=str(path))
    refuse_file(folder)
    return folder


def is_bin_reference(folder: Path) -> bool:
    """A reference folder of ``.bin`` weights only (``pytorch_model.bin`` or its index), no safetensors."""
    from patcher.checkpoint.convert import BIN_INDEX_NAME, BIN_NAME

    return (not any(folder.glob("*.safetensors")) and not (folder / INDEX_NAME).is_file()
            and any((folder / n).is_file() for n in (BIN_NAME, BIN_INDEX_NAME)))


def _bin_headers(folder: Path, loaded: dict) -> Header:
    """A ``.bin`` reference's "headers": each file loaded weights-only (memory-mapped), its tensors listed."""
    from patcher.checkpoint.convert import BIN_INDEX_NAME, BIN_NAME, bin_shards, load_bin

    files = bin_shards(folder) if (folder / BIN_INDEX_NAME).is_file() else [BIN_NAME]
    head = Header(files=list(files))
    for name in files:
        state, _ = load_bin(folder / name)
        loaded[(folder, name)] = state
        for key, tensor in state.items():
            if key in head.entries:
                head.problems.append(f"{key} appears in both {head.entries[key][2]} and {name}")
            head.entries[key] = (tuple(int(d) for d in tensor.shape), dtype_code(tensor.dtype), name)
    return head


def _headers(folder: Path, loaded: Optional[dict] = None) -> Header:
    if loaded is not None and is_bin_reference(folder):
        head = _bin_headers(folder, loaded)
        if not head.entries:
            raise DsfixError("the .bin weights hold no tensors", path=str(folder))
        if head.problems:
            raise DsfixError(f"cannot compare: {head.problems[0]}", path=str(folder))
        return head
    files, weight_map, problems = weight_files(folder)
    head = read_headers(folder, files, weight_map)
    problems = problems + head.problems
    if problems:
        raise DsfixError(f"cannot compare: {problems[0]}", path=str(folder))
    if not head.entries:
        raise DsfixError("the weight files hold no tensors", path=str(folder))
    return head


def _tie_groups(folder: Path, ref: Path, head: Header) -> list:
    """The tied keys of the folder's config's model (else the reference's); none when neither config builds."""
    for where in (folder, ref):
        cfg, _, _ = load_config(where)
        if cfg is None:
            continue
        try:
            return expected_of(meta_model(cfg, folder_kind(head.entries)))[1]
        except Exception:  # a config transformers cannot build: compare without ties
            continue
    return []


def _pairs(head: Header, ref_head: Header, partner: dict) -> tuple[list, Check]:
    """[(name in the folder, name in the reference)] and the keys check: a key one side lacks is compared through
    a tied partner the other side stores, else it is a difference."""
    pairs, missing, extra = [], [], []
    for name in sorted(set(head.entries) | set(ref_head.entries)):
        if name in head.entries and name in ref_head.entries:
            pairs.append((name, name))
        elif name in head.entries:
            other = next((o for o in partner.get(name, ()) if o in ref_head.entries), None)
            if other is None:
                extra.append(name)
            else:
                pairs.append((name, other))
        else:
            other = next((o for o in partner.get(name, ()) if o in head.entries), None)
            if other is None:
                missing.append(name)
    if missing or extra:
        parts = ([f"{len(missing)} only in the reference: {examples(missing)}"] if missing else []) + \
                ([f"{len(extra)} not in the reference: {examples(extra)}"] if extra else [])
        return pairs, Check("keys", False, "; ".join(parts))
    aliased = [f"{a} ~ {b}" for a, b in pairs if a != b]
    return pairs, Check("keys", True, f"{len(pairs)} tensors on both sides" +
                        (f"; tied aliases compared through their partner: {examples(aliased)}" if aliased else ""))


class _Loaded:
    """A loaded ``.bin`` state dict, read as ``safe_open``'s handle is (``get_tensor``, ``get_slice``)."""

    def __init__(self, state: dict):
        self.state = state

    def get_tensor(self, name: str):
        return self.state[name]

    get_slice = get_tensor  # a tensor slices by rows as safetensors' slice does


def _opener(stack: ExitStack, loaded: dict):
    """handle(folder, file): each weight file opened once (safetensors memory-mapped; a loaded .bin as is)."""
    opened: dict = {}

    def handle(where: Path, file: str):
        from safetensors import safe_open

        if (where, file) not in opened:
            opened[(where, file)] = (_Loaded(loaded[(where, file)]) if (where, file) in loaded
                                     else stack.enter_context(safe_open(str(where / file), framework="pt")))
        return opened[(where, file)]

    return handle


def _compare_values(folder: Path, ref: Path, head: Header, ref_head: Header, pairs: list, atol: float,
                    rtol: float, loaded: dict) -> list:
    with ExitStack() as stack:
        handle = _opener(stack, loaded)

        rows = []
        for name, ref_name in pairs:
            (shape, code, file), (ref_shape, ref_code, ref_file) = head.entries[name], ref_head.entries[ref_name]
            if tuple(shape) != tuple(ref_shape):
                rows.append(Row(name, ref_name, tuple(shape), code, None, "shape",
                                f"{shape_text(shape)} here, {shape_text(ref_shape)} in the reference"))
            elif code != ref_code:
                rows.append(Row(name, ref_name, tuple(shape), code, None, "dtype",
                                f"{code} here, {ref_code} in the reference"))
            else:
                diff, close = _values(handle(folder, file), name, handle(ref, ref_file), ref_name, tuple(shape),
                                      atol, rtol)
                problem = "" if close else f"max |diff| {diff:.6g} > atol {atol:g} + rtol {rtol:g} x |reference|"
                rows.append(Row(name, ref_name, tuple(shape), code, diff, "" if close else "values", problem))
        return rows


def _values(fa, a: str, fb, b: str, shape: tuple, atol: float, rtol: float) -> tuple[Optional[float], bool]:
    """(the largest |difference|, None when bit-equal; whether every element is within the tolerance), a block
    of rows at a time."""
    if not shape or 0 in shape:
        return _block(fa.get_tensor(a), fb.get_tensor(b), atol, rtol)
    sa, sb = fa.get_slice(a), fb.get_slice(b)
    worst, close = None, True
    for rows in row_blocks(shape, CHUNK_BYTES):
        diff, ok = _block(sa[rows], sb[rows], atol, rtol)
        if diff is not None:
            worst = diff if worst is None else max(worst, diff)
        close = close and ok
    return worst, close


def _block(a, b, atol: float, rtol: float) -> tuple[Optional[float], bool]:
    import torch

    if same_bits(a, b):
        return None, True
    x, y = a.double(), b.double()
    diff = (x - y).abs()
    both_nan = torch.isnan(x) & torch.isnan(y)
    diff = torch.where(both_nan, torch.zeros_like(diff), torch.nan_to_num(diff, nan=float("inf")))
    within = bool((diff <= atol + rtol * y.abs().nan_to_num(nan=0.0)).all())
    return float(diff.max()), within


def _good(name: str, rows: list, atol: float, rtol: float) -> str:
    if name != "values":
        return f"all {len(rows)} agree"
    equal = sum(1 for r in rows if r.max_diff is None)
    if equal == len(rows):
        return f"all {len(rows)} bit-equal"
    worst = max((r for r in rows if r.max_diff is not None), key=lambda r: r.max_diff)
    return (f"{equal} of {len(rows)} bit-equal, the rest within atol {atol:g} / rtol {rtol:g} "
            f"(largest |diff| {worst.max_diff:.6g}, {worst.name})")


def _ties_check(folder: Path, head: Header, ref: Path, ref_head: Header, groups: list, loaded: dict) -> Check:
    """Wherever one folder stores several keys of a tie group, they are bit-equal."""
    notes, bad = [], []
    with ExitStack() as stack:
        handle = _opener(stack, loaded)
        for where, h, label in ((folder, head, "folder"), (ref, ref_head, "reference")):
            for group in groups:
                present = [k for k in group if k in h.entries]
                for other in present[1:]:
                    pair = f"{other} ~ {present[0]} ({label})"
                    (notes if _bit_equal(where, h, present[0], other, handle) else bad).append(pair)
    if bad:
        return Check("tied", False, f"tied aliases differ from their partner: {examples(bad)}")
    if not groups:
        return Check("tied", True, "no tied keys in the config (or no config to build)")
    return Check("tied", True, examples(notes) + " bit-equal" if notes else "tied aliases stored on neither side")


def _bit_equal(where: Path, head: Header, a: str, b: str, handle) -> bool:
    (shape, code, file_a), (shape_b, code_b, file_b) = head.entries[a], head.entries[b]
    if tuple(shape) != tuple(shape_b) or code != code_b:
        return False
    return _values(handle(where, file_a), a, handle(where, file_b), b, tuple(shape), 0.0, 0.0)[0] is None
