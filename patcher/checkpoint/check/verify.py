"""A saved model folder checked against its own config.json, reading headers, not weights (``dsfix verify``).

``verify_folder`` works on any folder: dsfix's own saves (311 tensors for Qwen3-0.6B), a transformers
``save_pretrained`` folder (310: the tied ``lm_head.weight`` dropped), or a broken save. It builds the model
from config.json on the meta device (:mod:`.model`) to learn the expected keys, shapes and tied aliases, and
compares the headers with them (:mod:`.headers`); with ``finite`` it reads every floating tensor for NaN and
Inf, and with ``load`` it loads the folder (:mod:`.load`). A step-3 output folder is verified folder by folder
(``actor``, ``critic``, ``actor_ema``: :mod:`patcher.checkpoint.verify`, the command); ``--against`` compares
with a reference instead (:mod:`.compare`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.check.headers import Check, against_model, dtype_check
from patcher.checkpoint.check.load import critic_load_check, load_check
from patcher.checkpoint.check.model import CAUSAL_LM, CRITIC, KIND_TEXT, expected, folder_kind, load_config
from patcher.checkpoint.check.values import FiniteChecks, finite_check, stored_equal
from patcher.checkpoint.names import examples
from patcher.checkpoint.readers.safetensors import Header, SafetensorsFolder
from patcher.errors import DsfixError, need_folder
from patcher.report import Checks


@dataclass(frozen=True)
class VerifyReport(Checks):
    """One folder's checks (a step-3 folder gives one per model folder; :class:`VerifyResult` holds them)."""

    path: str
    ok: bool
    checks: tuple  # of Check(name, ok, detail)
    tensors: int
    dtype: Optional[str] = None  # the one floating dtype in the files, if they agree
    files: tuple = ()  # the safetensors files read, relative to path
    expected: Optional[int] = None  # keys the config's model has (tied aliases included)
    kind: str = CAUSAL_LM  # CAUSAL_LM, CRITIC (from the file's keys) or ADAPTER
    cure: str = ""  # when it fails for a reason with a known cure: the one line that says both

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "kind": self.kind, "tensors": self.tensors,
                "expected_keys": self.expected, "dtype": self.dtype, "files": list(self.files),
                "checks": [c._asdict() for c in self.checks]}

    @property
    def summary(self) -> str:
        if not self.ok and self.cure:
            return f"verification FAILED: {self.cure}"
        verdict = "all checks hold" if self.ok else "verification FAILED"
        return f"{verdict}: {self.tensors} tensors, {KIND_TEXT[self.kind]}"


def verify_folder(path, expect: Optional[int] = None, load: bool = True, finite: bool = False,
                  started: Optional[FiniteChecks] = None) -> VerifyReport:
    """Check the model saved in ``path``. Raises DsfixError (code 2) on bad input; failing checks give ok=False.
    ``finite``: also read every floating tensor for NaN and Inf (``dsfix verify`` and ``dsfix smoke`` do);
    ``started``: that check already running on a thread of its own, for this folder among others (``dsfix
    verify``), whose result is taken here instead."""
    folder = Path(path)
    need_folder(folder)
    with SafetensorsFolder(folder) as reader:
        head = reader.header
        if not head.entries and not head.problems:
            raise DsfixError("the weight files hold no tensors", path=str(path))
        cfg, cfg_check, cfg_dtype = load_config(folder)
        checks: list = [cfg_check, Check("files", not head.problems,
                                         "; ".join(head.problems) if head.problems else reader.describe())]
        kind = folder_kind(head.entries)
        model, failed = expected(cfg, kind) if cfg is not None else (None, None)
        if failed is not None:
            checks.append(failed)
        if model is not None:
            keys, shapes, nonempty = against_model(head, model.shapes, model.tie_groups)
            if kind == CRITIC:
                keys = keys._replace(detail=f"{keys.detail} (critic: {model.built})")
            checks += [keys, shapes, nonempty]
        else:
            checks.append(against_model(head, {}, [])[2])
        dtype_row, dtype_name = dtype_check(head, cfg_dtype)
        checks.append(dtype_row)
        if finite:
            checks.append(started.result(folder) if started is not None else finite_check(reader, head))
        if model is not None and model.tie_groups:
            checks.append(tied_check(reader, head, model.tie_groups))
        leftovers = leftover_check(folder)
        if leftovers is not None:
            checks.append(leftovers)
        if expect is not None:
            n = len(head.entries)
            checks.append(Check("count", n == expect, f"{n} tensors" + ("" if n == expect else f", expected {expect}")))
        if load and cfg is not None:
            checks.append(critic_load_check(reader) if kind == CRITIC else load_check(folder)[0])
    return VerifyReport(path=str(path), ok=all(c.ok for c in checks), checks=tuple(checks), tensors=len(head.entries),
                        dtype=dtype_name, files=tuple(head.files),
                        expected=len(model.shapes) if model is not None else None, kind=kind)


def tied_check(reader: Any, head: Header, tie_groups: list) -> Check:
    """Every tied alias a folder stores is bit-equal to its partner (from_pretrained keeps only one)."""
    notes: list = []
    bad: list = []
    for group in tie_groups:
        present = [k for k in group if k in head.entries]
        for other in present[1:]:
            (notes if stored_equal(reader, head, present[0], other) else bad).append((other, present[0]))
    if bad:
        differ = examples(f"{a} != {b}" for a, b in bad)
        return Check("tied", False, f"tied aliases differ from their partner: {differ} "
                                    "(from_pretrained re-ties them and silently keeps only one)")
    if not notes:
        return Check("tied", True, "tied aliases not stored (transformers re-ties on load)")
    return Check("tied", True, examples(f"{a} == {b}" for a, b in notes))


# --------------------------------------------------------------------------- what a killed save left


def _holds_dsfix_names(folder: Path) -> bool:
    """Whether ``folder`` or its fallback folder holds a hidden entry of dsfix's naming (a staging folder, a
    temporary file), where a killed save may have left its files: only then is the save module imported to
    read them (it imports torch), so that bad input is still answered before torch."""
    return any(p.name.startswith(".") and "dsfix" in p.name
               for where in (folder, folder / "dsfix-fallback") if where.is_dir() for p in where.iterdir())


def leftover_check(path) -> Optional[Check]:
    """What killed saves of dsfix's save module left in ``path`` (its ``find_leftovers``), or None when there
    is nothing. It fails when a save killed in its final phase left the folder mixing its files and the
    previous save's, and names them: those in place, those missing, those moved aside."""
    if not _holds_dsfix_names(Path(path)):  # nothing a save could have left: no need of torch to say so
        return None
    from patcher.templates.dsfix_safetensors import find_leftovers

    found = find_leftovers(str(path))
    if not found:
        return None
    notes = []
    for left in found:
        where = os.path.relpath(left.path, str(path))
        if not left.moving:
            notes.append(f"{where}: left by a killed save, nothing of it in place (the next save removes it)")
            continue
        parts = [f"{where}: a save killed while moving its files into place"]
        for label, names in (("its files in place", left.moved_in), ("not moved in", left.pending),
                             ("missing", left.missing), (f"the previous save's, moved aside into {where}/.replaced",
                                                         left.aside),
                             ("the previous save's weight files still in place", left.stale)):
            if names:
                parts.append(f"{label}: {', '.join(names)}")
        parts.append("the next save into this folder completes it" if left.mixed else
                     "every file of the new save is in place (the next save removes the rest)")
        notes.append("; ".join(parts))
    return Check("leftovers", not any(left.mixed for left in found), " | ".join(notes))
