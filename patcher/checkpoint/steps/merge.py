"""A PEFT adapter merged into its base model's weights by PEFT's own layer code, as
``PeftModel.from_pretrained(base, adapter).merge_and_unload()`` merges it.

The PEFT model of ``adapter_config.json`` is built on the base model's config on the meta device, in the base
weights' dtype, as ``from_pretrained`` builds it (``get_peft_model``: the adapter's layers moved to the base's dtype,
then fp32 where the base is bf16 or fp16, PEFT's ``autocast_adapter_dtype``). Then, one module at a time, in the
base folder's order: the module PEFT wrapped (a LoRA, DoRA, IA3, ... layer) gets its base layer's real tensors from
the base folder and its adapter parameters on the CPU, loaded from the adapter's tensors as
``set_peft_model_state_dict`` loads them (``copy_``, cast to the parameter's dtype); PEFT's own ``merge()`` merges
them; the base layer's tensors are what ``merge_and_unload`` leaves. The module goes back to the meta device before
the next one: memory is the adapter (small) and one module's base tensors. A ``modules_to_save`` copy is loaded the
same way and replaces its module's tensors. DoRA, rsLoRA, ``rank_pattern``/``alpha_pattern``, ``fan_in_fan_out``,
LoRA biases and embedding LoRA need no code of dsfix's: they are PEFT's.

What is refused, in one line, before a base tensor is read: an adapter tensor the PEFT model does not have, a
parameter of the model the adapter lacks, and a wrapped layer on a weight the base folder does not hold as a tensor
of its own (``lm_head`` tied to the embedding: merging into it changes both). What PEFT's ``merge()`` refuses is
said in one line as PEFT says it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.names import examples
from patcher.checkpoint.readers.base import Put, Reader
from patcher.checkpoint.readers.peft import PREFIX, base_name
from patcher.errors import DsfixError


def base_dtype(base: Any) -> Any:
    """The dtype most of the base folder's floating tensors have (the dtype the base model loads in)."""
    counts: dict = {}
    for held in base.tensors.values():
        if held.dtype.is_floating_point:
            counts[held.dtype] = counts.get(held.dtype, 0) + 1
    return max(counts, key=lambda d: counts[d]) if counts else None


def _own(path: str) -> str:
    return path[len(PREFIX):] if path.startswith(PREFIX) else path


def merge_units(model: Any, adapter: str) -> dict:
    """{a PEFT model's module path: (its merged module's path, whether PEFT merges it)}: each layer PEFT wrapped
    (merged into its base layer) and each ``modules_to_save`` wrapper (its trained copy replaces the module)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    units = {}
    for path, module in model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            units[path] = (f"{path}.modules_to_save.{adapter}", False)
        elif isinstance(module, BaseTunerLayer) and not any(path.startswith(f"{p}.") for p in units):
            base_path = next(n for n, m in module.named_modules(prefix=path) if m is module.get_base_layer())
            units[path] = (base_path, True)
    return units


class MergedPeft(Reader):
    """The base model's weights (``base``, a random-access reader) with the adapter (``adapter``: PEFT's saved
    names -> tensors) merged in by PEFT's own layers, on ``cfg``, the base model's config."""

    kind = "peft-merged"

    def __init__(self, base: Any, adapter: dict, config: dict, cfg: Any, source: str) -> None:
        from patcher.checkpoint.check.adapter import peft_model, saved_names

        super().__init__(base.folder)
        self.base, self.config, self.source = base, config, source
        self.model = peft_model(config, cfg, dtype=base_dtype(base))
        names = saved_names(self.model)
        self.keys = {saved: key for key, saved in names.items()}
        self._check_adapter(adapter, names)
        self.adapter = adapter
        self.units = merge_units(self.model, "default")
        self.owner: dict = {}  # a base tensor's name -> the module path whose merge gives it
        self.redirect: dict = {}  # a tied weight the base leaves out -> the base tensor it is
        for path, (out, _) in self.units.items():
            for name, _ in self.model.get_submodule(out).named_parameters():
                self.owner[f"{_own(path)}.{name}"] = path
        self._check_ties(names)
        # a trained base tensor outside every wrapped module (bias="all"): loaded into the base as PEFT loads it
        scopes = tuple(f"{p if m else out}." for p, (out, m) in self.units.items())
        self.loose = {base_name(k): s for k, s in names.items() if not k.startswith(scopes)}
        absent = [n for n in self.loose if n not in base.tensors or n in base.aliases]
        if absent:
            raise DsfixError(f"--merge: the adapter changes {examples(absent)}, which the base folder does not hold as "
                             "a tensor of its own; not merged")
        self.tensors, self.aliases = dict(base.tensors), dict(base.aliases)

    def _check_ties(self, names: dict) -> None:
        """A base tensor the adapter changes must be one the base folder holds as its own; a tied alias only where
        it is a modules_to_save copy equal to its partner's (PEFT's ``ensure_weight_tying``), written from it."""
        def copy(name: str) -> Any:
            path = self.owner.get(name)
            if path is None or self.units[path][1]:
                return None
            return self.adapter[names[f"{self.units[path][0]}.{name[len(_own(path)) + 1:]}"]]

        held = [n for n in self.owner if n in self.base.tensors and n not in self.base.aliases]
        tied = []
        for name in [n for n in self.owner if n not in held]:
            path = self.owner[name]
            partner = self.tied_partner(name) if self.units[path][1] else None
            mine = copy(name)  # the tied alias the base leaves out: written from a partner that holds the same copy
            del self.owner[name]
            if partner is not None and partner not in self.owner:  # PEFT merges into the one tensor both share
                self.owner[partner], self.redirect[name] = path, partner
            elif mine is None or not any((c := copy(n)) is not None and mine.equal(c) for n in held):
                tied.append(name)
        if tied:
            raise DsfixError(f"--merge: the adapter changes {examples(tied)}, which the base folder does not hold as a "
                             "tensor of its own (tied to another: a merge would change both); not merged")

    def tied_partner(self, name: str) -> Optional[str]:
        """The base tensor a wrapped base layer's weight ``name`` is, tied in the model (``lm_head.weight`` is
        ``model.embed_tokens.weight``), where the base folder holds it; else None."""
        param = self.model.get_parameter(self._key(name))
        for key, other in self.model.named_parameters(remove_duplicate=False):
            own = base_name(key)
            if other is param and own != name and own in self.base.tensors and own not in self.base.aliases:
                return own
        return None

    def _key(self, name: str) -> str:
        """The PEFT model's key of a base tensor its merge gives."""
        path = self.owner.get(name) or next(p for p in self.units if name.startswith(f"{_own(p)}."))
        return f"{self.units[path][0]}.{name[len(_own(path)) + 1:]}"

    def _check_adapter(self, adapter: dict, names: dict) -> None:
        unknown = [n for n in adapter if n not in self.keys]
        missing = [s for s in names.values() if s not in adapter]
        if unknown or missing:
            what = (f"holds {examples(unknown)}, which its PEFT model has not" if unknown else
                    f"lacks {examples(missing)}, which its PEFT model has")
            raise DsfixError(f"--merge: the adapter {what}; not merged")

    def describe(self) -> str:
        merged = sum(1 for _, m in self.units.values() if m)
        copies = len(self.units) - merged
        return (f"{self.base.describe()}, with {self.source}'s adapter merged into {merged} modules by PEFT's own "
                "merge()" + (f" and {copies} modules_to_save copies" if copies else ""))

    def _read(self, name: str) -> Any:
        """A base tensor, read whole (one at a time)."""
        return self.base.read([name])[name]

    def _loaded(self, name: str) -> Any:
        """A base tensor that the adapter holds trained, as PEFT's load copies it into the base's parameter."""
        import torch

        held = self.base.tensors[name]
        return torch.empty(tuple(held.shape), dtype=held.dtype).copy_(self.adapter[self.loose[name]])

    def merged(self, path: str) -> dict:
        """{base tensor name: tensor} of the module at ``path`` once PEFT has merged it (or its modules_to_save copy
        loaded): that module alone on the CPU, back on the meta device after."""
        import torch

        from patcher.templates.dsfix_safetensors import _trim_heap

        out_path, merges = self.units[path]
        scope_path = path if merges else out_path
        scope = self.model.get_submodule(scope_path)
        for sub_name, sub in scope.named_modules(prefix=scope_path):
            for name, param in list(sub.named_parameters(recurse=False)):
                full = f"{sub_name}.{name}"
                if merges and full.startswith(f"{out_path}."):  # the base layer's own: from the base folder
                    own = f"{_own(path)}.{full[len(out_path) + 1:]}"
                    # a copy of its own, freed once written: merge() writes into it, and the tensor read is a
                    # view of the file's private map, where written pages would stay until the map is closed
                    tensor = self._read(self.redirect.get(own, own)).clone()
                else:  # the adapter's: filled below, as PEFT loads it
                    tensor = torch.empty_like(param, device="cpu")
                sub._parameters[name] = torch.nn.Parameter(tensor, requires_grad=param.requires_grad)
        with torch.no_grad():
            for saved, key in self.keys.items():
                if key.startswith(f"{scope_path}."):
                    self.model.get_parameter(key).copy_(self.adapter[saved])
            if merges:
                try:
                    scope.merge(adapter_names=["default"])
                except Exception as e:
                    raise DsfixError(f"--merge: PEFT's merge() of {_own(path)} refused: {type(e).__name__}: "
                                     f"{' '.join(str(e).split())[:120]}") from None
        out = self.model.get_submodule(out_path)
        result = {(own := f"{_own(path)}.{name}") and self.redirect.get(own, own): p.detach()
                  for name, p in out.named_parameters()}
        scope.to_empty(device="meta")
        getattr(scope, "_caches", {}).clear()
        # the save module's own cure for the same trouble: glibc keeps the heap that a merge's fp32 deltas freed
        # in pieces too scattered to reuse, and without it a 4B merge grew to 1,982 MiB (607 with it)
        _trim_heap()
        return result

    def stream(self, put: Put, workdir: Optional[Path] = None) -> None:
        done: dict = {}
        for name in self.base.tensors:
            if name in self.base.aliases:
                continue
            if name in self.owner:
                if name not in done:
                    done.update(self.merged(self.owner[name]))
                tensor = done.pop(name)
            elif name in self.loose:
                tensor = self._loaded(name)
            else:
                tensor = self._read(name)
            put(name, 0, tensor.reshape(-1))
            del tensor  # before the next is read: one base tensor held at a time (an 8B's embedding is 1.2 GiB)

    def close(self) -> None:
        self.base.close()
