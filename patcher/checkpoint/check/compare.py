"""Two Hugging Face model folders compared, tensor by tensor (``dsfix verify DIR --against REF_DIR``).

What a converted folder is checked against here is another folder (a reference conversion, the run's own
save), not its config: the keys, each tensor's shape and dtype, its values (bit for bit, or the largest
difference within ``--atol``/``--rtol``: ``|a - b| <= atol + rtol * |b|``, b the reference's), and the ties.
A tied alias (``lm_head.weight`` when config.json ties it) may be stored on one side and not the other: the
side lacking it is compared through its partner, and wherever a folder stores both they must be bit-equal.

Both sides are read through random-access readers: a safetensors folder, or for the reference a
``pytorch_model.bin`` folder (what ``zero_to_fp32`` writes, or a sharded ``.bin`` index), loaded weights-only
and memory-mapped, so a pickle that needs code to load is refused and nothing of it runs. Memory stays bounded:
one pair of tensors at a time, a block of rows at a time. The report names the first difference: the first
failing check (keys, shapes, dtypes, values, tied) and its first tensor in name order; exit 1 when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.check.model import expected, folder_kind, load_config
from patcher.checkpoint.check.values import stored_bytes, stored_difference, stored_equal
from patcher.checkpoint.check.verify import VerifyReport
from patcher.checkpoint.names import examples, shape_text
from patcher.checkpoint.progress import MIN_BYTES, Progress
from patcher.checkpoint.readers.bin import BinFolder
from patcher.checkpoint.readers.safetensors import Header, SafetensorsFolder
from patcher.errors import DsfixError, refuse_file


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


def is_bin_reference(folder: Path) -> bool:
    """A reference folder of ``.bin`` weights only (``pytorch_model.bin`` or its index), no safetensors."""
    return not SafetensorsFolder.is_kind(folder) and not any(folder.glob("*.safetensors")) and BinFolder.is_kind(folder)


def _open(path, what: str) -> Any:
    """The folder's reader: safetensors, or (the reference only) a ``.bin`` folder; its header, checked."""
    folder = Path(path)
    if not folder.exists():
        raise DsfixError(f"{what}: no such folder", path=str(path))
    refuse_file(folder)
    if what == "--against" and is_bin_reference(folder):
        reader: Any = BinFolder(folder)
        return reader, reader.header
    reader = SafetensorsFolder(folder)
    if reader.problems:
        reader.close()
        raise DsfixError(f"cannot compare: {reader.problems[0]}", path=str(folder))
    if not reader.header.entries:
        reader.close()
        raise DsfixError("the weight files hold no tensors", path=str(folder))
    return reader, reader.header


def compare_folders(path, against, atol: float = 0.0, rtol: float = 0.0, console: Any = None) -> CompareReport:
    """Compare the model folder ``path`` with ``against`` (safetensors, or a ``.bin`` reference). Raises
    DsfixError (code 2) on bad input. ``console``: where the reading's progress goes (None: nowhere)."""
    reader, head = _open(path, "the folder")
    try:
        ref_reader, ref_head = _open(against, "--against")
    except BaseException:
        reader.close()
        raise
    with reader, ref_reader:
        groups = _tie_groups(Path(path), Path(against), head)
        partner = {k: [o for o in g if o != k] for g in groups for k in g}
        pairs, keys = _pairs(head, ref_head, partner)
        files = (f"{len(head.entries)} tensors in {examples(head.files)}; {len(ref_head.entries)} in {against}'s "
                 f"{examples(ref_head.files)}")
        checks = [Check("files", True, files), keys]
        total = sum(stored_bytes(head, n) + stored_bytes(ref_head, r) for n, r in _read_pairs(head, ref_head, pairs))
        with Progress(console, "dsfix verify", total=total, min_total=MIN_BYTES) as bar:
            bar.phase("comparing every tensor with the reference")
            rows = [_row(reader, head, ref_reader, ref_head, name, ref, atol, rtol, bar.advance) for name, ref in pairs]
        for name, what in (("shapes", "shape"), ("dtypes", "dtype"), ("values", "values")):
            bad = [r for r in rows if r.kind == what]
            more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
            detail = f"{bad[0].name}: {bad[0].problem}{more}" if bad else _good(name, rows, atol, rtol)
            checks.append(Check(name, not bad, detail))
        checks.append(_ties_check([(reader, head, "folder"), (ref_reader, ref_head, "reference")], groups))
    first = next((f"{c.name}: {c.detail}" for c in checks if not c.ok), "")
    return CompareReport(path=str(path), ok=not first, checks=tuple(checks), tensors=len(head.entries),
                         files=tuple(head.files), kind=folder_kind(head.entries), against=str(against), atol=atol,
                         rtol=rtol, rows=tuple(rows), first=first)


def _tie_groups(folder: Path, ref: Path, head: Header) -> list:
    """The tied keys of the folder's config's model (else the reference's); none when neither config builds."""
    for where in (folder, ref):
        cfg, _, _ = load_config(where)
        if cfg is None:
            continue
        model, _ = expected(cfg, folder_kind(head.entries))
        if model is not None:
            return model.tie_groups
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
    return pairs, Check("keys", True, _counts(len(head.entries), len(ref_head.entries), pairs,
                                              [n for n in ref_head.entries if n not in head.entries]))


def _read_pairs(head: Header, ref_head: Header, pairs: list) -> list:
    """The pairs whose values are read: one shape and one dtype on both sides."""
    return [(n, r) for n, r in pairs if tuple(head.entries[n][0]) == tuple(ref_head.entries[r][0])
            and head.entries[n][1] == ref_head.entries[r][1]]


def _counts(here: int, there: int, pairs: list, ref_only: list) -> str:
    """The keys row: each side's count and how many were compared, naming the tied aliases stored on one side
    only (the folder's compared through their partner in the reference; the reference's checked as ties)."""
    aliased = [a for a, b in pairs if a != b]
    if here == there == len(pairs) and not aliased:
        return f"{here} tensors on both sides"
    text = f"{here} tensors here, {there} in the reference; {len(pairs)} compared"
    if aliased:
        text += f", {examples(aliased)} through {'its' if len(aliased) == 1 else 'their'} tied partner"
    if ref_only:
        text += f"; the reference's {examples(ref_only)} checked as {'a tie' if len(ref_only) == 1 else 'ties'}"
    return text


def _row(reader: Any, head: Header, ref_reader: Any, ref_head: Header, name: str, ref: str, atol: float,
         rtol: float, advance: Any = None) -> Row:
    (shape, code, _), (ref_shape, ref_code, _) = head.entries[name], ref_head.entries[ref]
    if tuple(shape) != tuple(ref_shape):
        return Row(name, ref, tuple(shape), code, None, "shape",
                   f"{shape_text(shape)} here, {shape_text(ref_shape)} in the reference")
    if code != ref_code:
        return Row(name, ref, tuple(shape), code, None, "dtype", f"{code} here, {ref_code} in the reference")
    diff, close = stored_difference(reader, name, ref_reader, ref, tuple(shape), atol, rtol, advance)
    problem = "" if close else f"max |diff| {diff:.6g} > atol {atol:g} + rtol {rtol:g} x |reference|"
    return Row(name, ref, tuple(shape), code, diff, "" if close else "values", problem)


def _good(name: str, rows: list, atol: float, rtol: float) -> str:
    if name != "values":
        return f"all {len(rows)} agree"
    equal = sum(1 for r in rows if r.max_diff is None)
    if equal == len(rows):
        return f"all {len(rows)} bit-equal"
    worst = max((r for r in rows if r.max_diff is not None), key=lambda r: r.max_diff)
    return (f"{equal} of {len(rows)} bit-equal, the rest within atol {atol:g} / rtol {rtol:g} "
            f"(largest |diff| {worst.max_diff:.6g}, {worst.name})")


def _ties_check(sides: list, groups: list) -> Check:
    """Wherever one folder stores several keys of a tie group, they are bit-equal."""
    notes: list = []
    bad: list = []
    for reader, head, label in sides:
        for group in groups:
            present = [k for k in group if k in head.entries]
            for other in present[1:]:
                pair = f"{other} ~ {present[0]} ({label})"
                (notes if stored_equal(reader, head, present[0], other) else bad).append(pair)
    if bad:
        return Check("tied", False, f"tied aliases differ from their partner: {examples(bad)}")
    if not groups:
        return Check("tied", True, "no tied keys in the config (or no config to build)")
    return Check("tied", True, examples(notes) + " bit-equal" if notes else "tied aliases stored on neither side")
