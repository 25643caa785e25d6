"""The plan of a conversion: which tensors to write, from which of the reader's tensors, in which dtype; and the
checks run on it before a byte is written.

The plan is made from the reader's list of tensors (names, shapes, dtypes; no data) and the config's model built
on the meta device. One rule for tied weights, whatever the source:

* an alias the source records as one tensor with its partner (DeepSpeed's ``shared_params``; a ``.bin`` key
  whose tensor is the same memory as another's) is written from its partner's data under ``clone``, and left
  out under ``dedupe`` when the config ties them (transformers re-ties only what the config ties);
* an alias the config ties but the source lacks (upstream's ZeRO-3 save keeps ``named_parameters()`` only, so
  ``lm_head.weight`` is missing) is restored from its partner under ``clone`` when the shapes match;
* tied names the source holds as separate tensors are read and compared bit for bit before anything is
  written: equal, ``dedupe`` leaves the alias out and ``clone`` writes both; different, nothing is written.

The dtype: ``--dtype`` when given; else a run's fp32 master weights (an engine checkpoint's) become the
config's ``torch_dtype``, and weights already saved (a ``.bin`` folder's) keep their own.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from patcher.checkpoint.check.headers import Check, against_model, dtype_check
from patcher.checkpoint.check.model import CRITIC, Expected, Model
from patcher.checkpoint.check.values import same_bits
from patcher.checkpoint.names import CONFIG_NAME, examples
from patcher.checkpoint.readers.base import Held, Reader, numel
from patcher.checkpoint.readers.safetensors import header_of
from patcher.errors import DsfixError

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
STRATEGIES = ("clone", "dedupe")


class Entry(NamedTuple):
    """A tensor to write: its name, shape and dtype, and the reader's tensor whose data it holds (itself, or the
    partner a tied alias is written from)."""

    name: str
    shape: tuple
    dtype: Any
    source: str

    @property
    def numel(self) -> int:
        return numel(self.shape)


class Plan(NamedTuple):
    entries: list  # of Entry: the config model's keys in its order, then whatever else the source holds
    checks: list  # the checks run before writing
    ties: list  # what was done with tied aliases, for the reports ("restored X <- Y", "dropped X (dedupe)", ...)
    restored: list  # "ALIAS <- PARTNER": aliases the source lacked, written from their partner
    dropped: list  # aliases left out under dedupe
    model: Model  # what the written folder must hold

    @property
    def kind(self) -> str:
        return self.model.kind

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def floating_dtype(self) -> Any:
        """The dtype the floating tensors are written in (None: there are none)."""
        return next((e.dtype for e in self.entries if e.dtype.is_floating_point), None)

    @property
    def nbytes(self) -> int:
        import torch

        return sum(e.numel * torch.empty((), dtype=e.dtype).element_size() for e in self.entries)


def out_dtype(requested: str, cfg_dtype: Optional[str], reader: Reader) -> Any:
    """The dtype floating tensors are written in: ``--dtype``; else the config's for a run's fp32 masters; else
    None (each tensor keeps its own)."""
    import torch

    if requested not in ("auto", *DTYPES):
        raise DsfixError(f"--dtype must be auto, bf16, fp16 or fp32, not {requested}")
    if requested != "auto":
        return getattr(torch, DTYPES[requested])
    if not reader.masters:
        return None
    name = str(cfg_dtype or "float32").replace("torch.", "")
    if name not in DTYPES.values():
        raise DsfixError(f"--dtype auto: config.json's torch_dtype {cfg_dtype!r} is not bf16, fp16 or fp32; "
                         "pass --dtype")
    return getattr(torch, name)


def make_plan(reader: Reader, model: Model, strategy: str, dtype: Any) -> Plan:
    """The plan for writing ``reader``'s tensors as ``model`` says the folder must hold them (a config's model, or
    a PEFT adapter on its base), with the checks before writing."""
    if strategy not in STRATEGIES:
        raise DsfixError(f"--strategy must be clone or dedupe, not {strategy}")
    checks = [Check("source", True, reader.describe()), model.config_row]
    checks += [model.base_row] if model.base_row is not None else []
    if model.expected is None:
        return Plan([], checks + [model.failed] if model.failed is not None else checks, [], [], [], model)
    expected = model.expected
    ties = _Ties(reader, expected, strategy)
    entries = [Entry(n, held.shape, _dtype(held, dtype), source) for n, (held, source) in ties.written.items()]
    head = header_of({e.name: Held(e.name, e.shape, e.dtype) for e in entries}, "(planned)")
    keys, shapes, nonempty = against_model(head, expected.shapes, expected.tie_groups)
    if model.kind == CRITIC:
        keys = keys._replace(detail=f"{keys.detail} (critic: {expected.built})")
    checks += [keys, shapes, nonempty, dtype_check(head, model.dtype)[0]]
    checks += [c for c in (_vocab_check(model.cfg, expected, reader),) if c is not None]
    checks.append(ties.check(expected))
    return Plan(entries, checks, ties.actions, ties.restored, ties.dropped, model)


def _dtype(held: Held, dtype: Any) -> Any:
    return dtype if dtype is not None and held.dtype.is_floating_point else held.dtype


class _Ties:
    """The tie rule (this module's docstring) applied: ``written`` maps each name to write to (the held tensor
    whose shape and dtype it has, the reader's name whose data it holds)."""

    def __init__(self, reader: Reader, model: Expected, strategy: str) -> None:
        self.actions: list = []
        self.restored: list = []
        self.dropped: list = []
        self.unknown: list = []
        self.differ: list = []
        self.written: dict = {}
        held, aliases = reader.tensors, reader.aliases
        tied = {k: g for g in model.tie_groups for k in g}
        twice = self._held_twice(reader, model.tie_groups)
        for name in list(model.shapes) + [n for n in list(held) + list(aliases) if n not in model.shapes]:
            partner = self._partner(name, held, aliases, tied, twice)
            if partner is None:
                continue  # missing: the keys check names it
            present = name in held or name in aliases
            if partner != name and strategy == "dedupe" and partner in tied.get(name, ()):
                if present:  # an alias the source lacks is simply not restored
                    self.dropped.append(name)
                    self.actions.append(f"dropped {name} (dedupe)")
                continue
            if name in twice:
                self.actions.append(f"{name} == {partner}")
                partner = name
            elif not present:
                if held[partner].shape != model.shapes.get(name):
                    continue
                self.restored.append(f"{name} <- {partner}")
                self.actions.append(f"restored {name} <- {partner}")
            elif partner != name:
                self.actions.append(f"{name} written from {partner}")
            self.written[name] = (held[partner], partner)

    def _held_twice(self, reader: Reader, groups: list) -> dict:
        """alias -> partner, for tied names the source holds as separate tensors that are bit-equal (compared
        here; a difference goes to ``differ``, and both are then written as held)."""
        pairs = []
        for group in groups:
            present = [k for k in group if k in reader.tensors and k not in reader.aliases]
            pairs += [(other, present[0]) for other in present[1:]]
        if not pairs:
            return {}
        values = reader.read({n for pair in pairs for n in pair})
        equal = {}
        for alias, partner in pairs:
            if same_bits(values[alias], values[partner]):
                equal[alias] = partner
            else:
                self.differ.append(f"{alias} != {partner}")
        return equal

    def _partner(self, name: str, held: dict, aliases: dict, tied: dict, twice: dict) -> Optional[str]:
        """The reader's tensor whose data ``name`` is (or would be) written from; None when there is none."""
        if name in aliases:
            if aliases[name] in held and aliases[name] not in aliases:
                return aliases[name]
            self.unknown.append(f"{name} -> {aliases[name]}")
            return None
        if name in twice:
            return twice[name]
        if name in held:
            return name
        present = [k for k in tied.get(name, ()) if k in held and k not in aliases]
        return present[0] if present else None

    def check(self, model: Expected) -> Check:
        if self.unknown:
            return Check("tied", False, f"recorded aliases name tensors the source lacks: {examples(self.unknown)}")
        if self.differ:
            return Check("tied", False, f"tied aliases held as separate tensors differ: {examples(self.differ)}; "
                                        "refusing to pick one")
        if self.actions:
            return Check("tied", True, examples(self.actions))
        if model.tie_groups:
            return Check("tied", True, "nothing to restore or drop")
        return Check("tied", True, f"{model.built} ties no tensors: nothing to restore")


def _vocab_check(cfg: Any, model: Expected, reader: Reader) -> Optional[Check]:
    """The embedding's rows against config.json's vocab_size: a wrong --config, said as such."""
    if model.embedding is None or model.embedding not in reader.tensors:
        return None
    rows = reader.tensors[model.embedding].shape[0]
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and rows != vocab:
        return Check("vocab", False, f"the checkpoint's {model.embedding} has {rows} rows but {CONFIG_NAME}'s "
                                     f"vocab_size is {vocab}: the config does not describe these weights (pass the "
                                     "config it was trained with)")
    return Check("vocab", True, f"{model.embedding}: {rows} rows = {CONFIG_NAME}'s vocab_size")
