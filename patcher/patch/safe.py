"""Whether a fork's save functions already write safetensors that keep tied weights, read with ast.

Such a fork does not have the bug dsfix fixes: every weight it writes goes through transformers'
``save_pretrained`` with the state dict passed in (a gathered one, under ZeRO-3), or with
``safe_serialization=True``. Since transformers 4.35 ``save_pretrained`` writes ``model.safetensors`` by default
and handles tied weights itself (dsfix's torch side needs 4.51 or later). A save that writes weights any other
way (``torch.save``, safetensors' ``save_file`` on tensors that may share storage, an engine checkpoint), or
``save_pretrained`` without a state dict or with ``safe_serialization`` not ``True``, is not safe here: dsfix
patches or refuses it as before.
"""

from __future__ import annotations

import ast

SAVING = frozenset({"save", "save_file", "save_model", "save_checkpoint", "save_pretrained", "to_json_file",
                    "save_vocabulary"})  # the calls that write something to disk


def written(call: ast.Call) -> frozenset:
    """What a call writes: a subset of {"weights", "config", "tokenizer"} (empty: not a save)."""
    func = call.func
    method = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if method not in SAVING:
        return frozenset()
    receiver = ast.unparse(func.value).lower() if isinstance(func, ast.Attribute) else ""
    first = ast.unparse(call.args[0]) if call.args else ""
    out = set()
    if method in ("save", "save_file", "save_model", "save_checkpoint") and "args" not in first or (
            method == "save_pretrained" and "tokenizer" not in receiver and "config" not in receiver):
        out.add("weights")  # (torch.save(vars(args), ...) saves the options, not weights)
    if method == "to_json_file" or (method == "save_pretrained" and "tokenizer" not in receiver):
        out.add("config")
    if "tokenizer" in receiver and method in ("save_vocabulary", "save_pretrained"):
        out.add("tokenizer")
    return frozenset(out)


def _safe_call(call: ast.Call) -> str | None:
    """How one weight-writing call keeps tied weights in safetensors, as source text; None if it may not."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "save_pretrained"):
        return None
    keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
    flag = keywords.get("safe_serialization")
    if flag is not None:
        return f"{ast.unparse(func)}(..., safe_serialization=True)" if (
            isinstance(flag, ast.Constant) and flag.value is True) else None
    if "state_dict" in keywords:
        return f"{ast.unparse(func)}(..., state_dict=...)"
    return None


def safe_save(fn: ast.FunctionDef) -> str | None:
    """How ``fn`` writes its weights, where every write already keeps tied weights in safetensors (the first
    such call, as source text); None where it writes weights any other way, or none."""
    ways = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and "weights" in written(node):
            way = _safe_call(node)
            if way is None:
                return None
            ways.append(way)
    return ways[0] if ways else None


def already_safe(tree: ast.Module, save_names: tuple) -> str | None:
    """What a utils module's save functions already do, where that needs no change: the first of
    ``save_names`` must be defined at top level, and every one defined must be safe (see safe_save). None
    otherwise, and where dsfix's marker shows an earlier patch."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in save_names}
    if save_names[0] not in defs:
        return None
    ways = []
    for fn in defs.values():
        way = safe_save(fn)
        if way is None:
            return None
        ways.append(way)
    names = " and ".join(name for name in save_names if name in defs)
    calls = "; ".join(dict.fromkeys(ways))
    return (f"{names} already write{'s' if len(defs) == 1 else ''} safetensors: {calls}, which writes "
            "model.safetensors by default since transformers 4.35 and handles tied weights itself, so there is "
            "nothing for dsfix to change")


__all__ = ["SAVING", "written", "safe_save", "already_safe"]
