"""DeepSpeed-Chat LoRA runs: the factors fused into the base weights, as step 1 does before its final save.

With ``--lora_dim R`` DeepSpeed-Chat's step 1 replaces each linear layer under ``--lora_module_name`` by its
``LinearLayer_LoRA``, which keeps the layer's ``weight`` (frozen) and adds ``lora_right_weight`` (in x R) and
``lora_left_weight`` (R x out), with ``lora_scaling = lora_scaling_arg / R``: step 1 passes no argument, so
it is 1 / R. Before saving, step 1 calls ``convert_lora_to_linear_layer``, whose ``fuse_lora_weight`` does
``weight += lora_scaling * (left.T @ right.T)`` on the module's own tensors, in the model's (training) dtype,
and the save leaves out every name holding ``lora``.

An engine checkpoint of such a run holds the frozen base weights in its model_states files (training
dtype) and the factors' fp32 masters in its optimizer files; the scaling is in neither. :func:`find` names
the modules from the checkpoint's names and shapes; :func:`fused` wraps the checkpoint's reader in a
:class:`FusedLoRA`, a reader that holds the fused weights and not the factors. Streaming, its :class:`Fuser`
stands between the checkpoint's reader and the writer: it keeps the factors (small) in memory and the base
weights in a scratch file in the training dtype, then fuses one module at a time exactly as
``fuse_lora_weight`` does, and hands each fused weight on to be written. Memory: the factors plus one weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple, Optional

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.names import examples
from patcher.checkpoint.readers.base import Put, Reader, numel
from patcher.checkpoint.readers.engine import TRAIN_DTYPES, training_precision
from patcher.errors import DsfixError

RIGHT, LEFT = "lora_right_weight", "lora_left_weight"
DEFAULT_SCALING = 1.0  # step 1's: convert_linear_layer_to_lora(model, part, lora_dim) keeps the default 1
FILE = "lora.safetensors"  # --keep-lora: the factors, beside the fused model's files
SCRATCH = ".lora-base-weights"  # in the write's folder, while LoRA layers are fused


class Module(NamedTuple):
    """One LinearLayer_LoRA: the names of its weight and factors, its shapes and rank."""

    weight: str
    right: str
    left: str
    out_features: int
    in_features: int
    rank: int


def find(shapes: dict, where) -> list:
    """The LoRA modules among ``shapes`` (every tensor the checkpoint holds: name -> shape). Raises DsfixError
    for a LoRA name that is not DeepSpeed-Chat's, or factors that do not fit their weight."""
    lora = [n for n in shapes if "lora" in n.lower()]
    foreign = [n for n in lora if not n.endswith((f".{RIGHT}", f".{LEFT}"))]
    if foreign:
        raise DsfixError(f"refused: LoRA tensors that are not DeepSpeed-Chat's LinearLayer_LoRA ({RIGHT}/{LEFT}): "
                         f"{examples(foreign)}; dsfix has not proven this layout; nothing written", path=str(where))
    prefixes = sorted({n.rsplit(".", 1)[0] for n in lora})
    return [_module(p, shapes, where) for p in prefixes]


def _module(prefix: str, shapes: dict, where) -> Module:
    weight, right, left = f"{prefix}.weight", f"{prefix}.{RIGHT}", f"{prefix}.{LEFT}"
    missing = [n for n in (weight, right, left) if n not in shapes]
    if missing:
        raise DsfixError(f"refused: LoRA layer {prefix} lacks {examples(missing)}; nothing written", path=str(where))
    w, r, lt = (tuple(int(d) for d in shapes[n]) for n in (weight, right, left))
    if not (len(w) == len(r) == len(lt) == 2 and r == (w[1], r[1]) and lt == (r[1], w[0]) and r[1] >= 1):
        raise DsfixError(f"refused: LoRA layer {prefix}: weight {list(w)}, {RIGHT} {list(r)}, {LEFT} {list(lt)} are "
                         "not LinearLayer_LoRA's (out x in, in x r, r x out); nothing written", path=str(where))
    return Module(weight, right, left, w[0], w[1], r[1])


def fuse(weight, right, left, scaling: float):
    """``weight += scaling * (left.T @ right.T)``, in place, in the weight's dtype: ``fuse_lora_weight``."""
    import torch

    weight += scaling * torch.matmul(left.to(weight.dtype).t(), right.to(weight.dtype).t())
    return weight


def describe(modules: list, lora_scaling: float, dtype) -> str:
    ranks = sorted({m.rank for m in modules})
    scalings = ", ".join(f"{lora_scaling:g} / {r} = {lora_scaling / r:g}" for r in ranks)
    return (f"fused {len(modules)} LinearLayer_LoRA layer(s) into their weights as convert_lora_to_linear_layer does: "
            f"weight += scaling * (left.T @ right.T) in {str(dtype).replace('torch.', '')}, scaling = lora_scaling "
            f"/ r = {scalings} (lora_scaling {lora_scaling:g}: "
            f"{'step 1' if lora_scaling == DEFAULT_SCALING else 'given'})")


class Fuser:
    """``put`` for the checkpoint reader: factors and base weights are kept, everything else passes on to
    ``out``; ``finish()`` fuses each module and passes the fused weight on. The base weights wait in
    ``scratch``, a file in the staging folder mapped as one flat tensor of the training dtype (``close``
    removes it)."""

    def __init__(self, modules: list, numels: dict, dtype, lora_scaling: float, out, scratch: Path):
        import torch

        self.modules, self.dtype, self.lora_scaling, self.out = modules, dtype, lora_scaling, out
        self.numels = numels
        self.factors = {n: torch.empty(numels[n], dtype=torch.float32) for m in modules for n in (m.right, m.left)}
        self.offsets, at = {}, 0
        for m in modules:
            self.offsets[m.weight] = at
            at += numels[m.weight]
        self.seen = dict.fromkeys(list(self.factors) + list(self.offsets), 0)
        self.scratch = scratch
        self.bases = torch.from_file(str(scratch), shared=True, size=max(at, 1), dtype=dtype)

    def put(self, source: str, dst: int, data) -> None:
        if source in self.factors:
            self.factors[source][dst:dst + data.numel()] = data
        elif source in self.offsets:
            at = self.offsets[source] + dst
            self.bases[at:at + data.numel()] = data  # cast to the training dtype: exact for a frozen weight
        else:
            self.out(source, dst, data)
            return
        self.seen[source] += data.numel()

    def finish(self) -> None:
        """Every element of every factor and weight is in; each module fused and passed on."""
        short = [f"{n} ({self.seen[n]} of {self.numels[n]} elements)" for n in self.seen
                 if self.seen[n] != self.numels[n]]
        if short:
            raise DsfixError(f"the checkpoint does not hold every element of the LoRA layers: {examples(short)}; "
                             "nothing written")
        for m in self.modules:
            at = self.offsets[m.weight]
            weight = self.bases[at:at + self.numels[m.weight]].clone().reshape(m.out_features, m.in_features)
            right = self.factors[m.right].reshape(m.in_features, m.rank)
            left = self.factors[m.left].reshape(m.rank, m.out_features)
            self.out(m.weight, 0, fuse(weight, right, left, self.lora_scaling / m.rank).reshape(-1))

    def close(self) -> None:
        self.bases = None
        if self.scratch.exists():
            self.scratch.unlink()


class FusedLoRA(Reader):
    """An engine checkpoint's reader with DeepSpeed-Chat's LoRA factors fused into their weights: it holds what
    the reader holds but the factors, and streams the fused weights. ``keep``: the factors are also written,
    unfused, to :data:`FILE` beside the model's files."""

    kind = "lora-fused"
    masters = True

    def __init__(self, inner: Any, modules: list, lora_scaling: float, given: bool, keep: bool) -> None:
        super().__init__(inner.folder)
        import torch

        precision = training_precision(inner.meta.get("ds_config"))
        if precision is None:
            raise DsfixError("refused: LoRA layers to fuse, but no saved ds_config says the training dtype they were "
                             "fused in; nothing written", path=str(inner.folder))
        self.inner, self.modules, self.keep = inner, modules, keep
        self.lora_scaling, self.given = lora_scaling, given
        self.train_dtype = getattr(torch, TRAIN_DTYPES[precision])
        factors = {n for m in modules for n in (m.right, m.left)}
        self.tensors = {n: h for n, h in inner.tensors.items() if n not in factors}
        self.aliases = dict(inner.aliases)
        self.factors: dict = {}

    @property
    def name(self) -> str:
        return self.inner.name

    def describe(self) -> str:
        return self.inner.describe()

    def info(self) -> dict:
        """What was fused, for the report."""
        return {"layers": len(self.modules), "ranks": sorted({m.rank for m in self.modules}),
                "lora_scaling": self.lora_scaling, "scaling_given": self.given,
                "dtype": str(self.train_dtype).replace("torch.", ""), "kept": self.keep}

    def checks(self) -> list:
        return [Check("lora", True, describe(self.modules, self.lora_scaling, self.train_dtype))]

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        numels = {n: numel(h.shape) for n, h in self.inner.tensors.items()}
        fuser = Fuser(self.modules, numels, self.train_dtype, self.lora_scaling, put, Path(workdir or ".") / SCRATCH)
        try:
            self.inner.stream(fuser.put)
            fuser.finish()
            self.factors = fuser.factors
        finally:
            fuser.close()

    def extra_files(self, folder: Path, dtype: Any) -> list:
        """--keep-lora: the factors, unfused, in the output dtype, in their own file beside the model's."""
        if not self.keep:
            return []
        from safetensors import safe_open
        from safetensors.torch import save_file

        shapes = {**{m.right: (m.in_features, m.rank) for m in self.modules},
                  **{m.left: (m.rank, m.out_features) for m in self.modules}}
        tensors = {n: self.factors[n].reshape(shapes[n]).to(dtype).contiguous() for n in sorted(shapes)}
        meta = {"format": "pt", "lora_scaling": f"{self.lora_scaling:g}", "layout": "DeepSpeed-Chat LinearLayer_LoRA",
                "fused_into": "the model's weights (weight += lora_scaling / r * left.T @ right.T)"}
        save_file(tensors, str(folder / FILE), metadata=meta)
        with safe_open(str(folder / FILE), framework="pt") as f:
            back = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        if back != shapes:
            return [Check("lora-file", False, f"{FILE} reads back {len(back)} tensors, not the {len(shapes)} written")]
        return [Check("lora-file", True, f"{FILE}: {len(back)} factors of {len(self.modules)} layers, unfused, "
                                         f"{str(dtype).replace('torch.', '')}")]

    def close(self) -> None:
        self.inner.close()


def fused(reader: Any, lora_scaling: Optional[float], keep: bool) -> Any:
    """``reader`` with its DeepSpeed-Chat LoRA layers fused (a :class:`FusedLoRA`), or ``reader`` itself when it
    holds none; --lora-scaling and --keep-lora are refused then."""
    if lora_scaling is not None and not (isinstance(lora_scaling, (int, float)) and math.isfinite(lora_scaling)
                                         and lora_scaling > 0):
        raise DsfixError(f"--lora-scaling must be a positive number, not {lora_scaling}")
    modules = find({n: h.shape for n, h in reader.tensors.items()}, reader.folder)
    if not modules:
        given = [o for o, v in (("--lora-scaling", lora_scaling is not None), ("--keep-lora", keep)) if v]
        if given:
            raise DsfixError(f"{' and '.join(given)}: this checkpoint holds no DeepSpeed-Chat LoRA factors "
                             f"({RIGHT}/{LEFT}); nothing to fuse", path=str(reader.folder))
        return reader
    scaling = DEFAULT_SCALING if lora_scaling is None else float(lora_scaling)
    return FusedLoRA(reader, modules, scaling, lora_scaling is not None, keep)
