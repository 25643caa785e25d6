"""The checks verify and convert share: a model folder's safetensors headers against its config's model.

Everything here but ``finite_check`` reads headers and config.json only; no tensor data. :class:`Header`
is what the headers say (name -> shape, dtype code, file); ``keys_check``, ``shapes_check``,
``nonempty_check`` and ``dtype_check`` each turn it into one :class:`Check` row. ``convert`` builds a Header
from the tensors it is about to write and runs the same checks before writing a byte. ``finite_check``
reads every floating tensor, a block of rows at a time, for NaN and Inf. The safetensors dtype codes are
the save module's ``DTYPES`` (``patcher.templates.dsfix_safetensors``, one table for dsfix), imported when
first needed: it imports torch.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

from patcher.errors import DsfixError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
SHOW = 3  # how many examples a failing detail names


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str


@dataclass
class Header:
    """What the safetensors headers say: name -> (shape, dtype code, file)."""

    entries: dict = field(default_factory=dict)
    files: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def examples(items, n: int = SHOW) -> str:
    """The first ``n`` items, comma-separated, and how many more."""
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(str(i) for i in items[:n]) + more


def shape_text(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


# --------------------------------------------------------------------------- dtypes


@functools.lru_cache(maxsize=None)
def dtype_codes() -> dict:
    """torch dtype name ("bfloat16") -> safetensors header code ("BF16"): the save module's ``DTYPES``."""
    from patcher.templates.dsfix_safetensors import DTYPES

    return {str(dtype).replace("torch.", ""): code for dtype, code in DTYPES.items()}


def dtype_name(code: str) -> str:
    """A safetensors header code's torch dtype name ("BF16" -> "bfloat16"); the code itself when unknown."""
    return _dtype_names().get(code, code)


@functools.lru_cache(maxsize=None)
def _dtype_names() -> dict:
    return {c: n for n, c in dtype_codes().items()}


def dtype_code(name: str) -> str:
    """A torch dtype's safetensors code ("bfloat16", "torch.bfloat16" -> "BF16"); upper-cased when unknown."""
    name = str(name).replace("torch.", "")
    return dtype_codes().get(name, name.upper())


def is_float_code(code: str) -> bool:
    return "float" in dtype_name(code)


# --------------------------------------------------------------------------- reading a folder


def weight_files(folder: Path) -> tuple[list, Optional[dict], list]:
    """(files, weight_map or None, problems). Raises DsfixError when there are no safetensors weights."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [], None, [f"{INDEX_NAME} is unreadable: {e}"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        problems = [f"{INDEX_NAME} names shards that are missing: {examples(missing)}"] if missing else []
        return [f for f in files if f not in missing], weight_map, problems
    if (folder / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None, []
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        return others, None, [f"no {SINGLE_NAME} or {INDEX_NAME}; found {examples(others)}, which from_pretrained ignores"]
    bins = sorted(p.name for p in folder.glob("*.bin"))
    if bins:
        raise DsfixError(f"no safetensors weights, only {examples(bins)} (a pickle save); nothing to verify "
                         "(`dsfix convert` turns it into safetensors)", path=str(folder))
    raise DsfixError(f"no model weights ({SINGLE_NAME} or {INDEX_NAME}) in this folder", path=str(folder))


def read_headers(folder: Path, files: list, weight_map: Optional[dict]) -> Header:
    """The headers of ``files`` (no tensor data), and what disagrees with the index's ``weight_map``."""
    from safetensors import safe_open

    head = Header(files=list(files))
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    if key in head.entries:
                        head.problems.append(f"{key} appears in both {head.entries[key][2]} and {name}")
                    head.entries[key] = (tuple(int(d) for d in sl.get_shape()), sl.get_dtype(), name)
        except Exception as e:  # a truncated or garbled file
            head.problems.append(f"{name} is not a readable safetensors file: {type(e).__name__}: {e}")
    if weight_map is not None:
        wrong = [k for k, f in weight_map.items() if f in files and head.entries.get(k, (None, None, f))[2] != f]
        absent = [k for k, f in weight_map.items() if f in files and k not in head.entries]
        unlisted = [k for k in head.entries if k not in weight_map]
        if absent:
            head.problems.append(f"{INDEX_NAME} lists tensors its shards lack: {examples(absent)}")
        if wrong:
            head.problems.append(f"{INDEX_NAME} maps tensors to the wrong shard: {examples(wrong)}")
        if unlisted:
            head.problems.append(f"shards hold tensors {INDEX_NAME} does not list: {examples(unlisted)}")
    return head


def load_config(folder: Path) -> tuple[Optional[Any], Check, Optional[str]]:
    """(config or None, the check, torch_dtype string from the json or None)."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None, Check("config", False, f"no {CONFIG_NAME}: from_pretrained cannot load this folder"), None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return None, Check("config", False, f"{CONFIG_NAME} is not valid JSON: {e}"), None
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        return None, Check("config", False, f"transformers cannot read {CONFIG_NAME}: {type(e).__name__}: {e}"), None
    cfg_dtype = raw.get("dtype") or raw.get("torch_dtype")
    arch = ",".join(raw.get("architectures") or []) or "?"
    tied = raw.get("tie_word_embeddings", getattr(cfg, "tie_word_embeddings", None))
    detail = f"model_type {raw.get('model_type', '?')}, {arch}, tie_word_embeddings {tied}, dtype {cfg_dtype}"
    return cfg, Check("config", True, detail), cfg_dtype


# --------------------------------------------------------------------------- the checks


def keys_check(head: Header, expected: dict, tie_groups: list) -> Check:
    """The header's keys against the model's (``expected``: key -> shape); a tied alias may be left out."""
    present = set(head.entries)
    partner = {k: g for g in tie_groups for k in g}
    missing = [k for k in expected if k not in present]
    aliases = [k for k in missing if any(o in present for o in partner.get(k, ()) if o != k)]
    really_missing = [k for k in missing if k not in aliases]
    unexpected = [k for k in head.entries if k not in expected]
    if really_missing or unexpected:
        parts = []
        if really_missing:
            parts.append(f"{len(really_missing)} missing: {examples(really_missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {examples(unexpected)}")
        return Check("keys", False, "; ".join(parts))
    detail = f"{len(present)} of {len(expected)} keys"
    if aliases:
        named = [f"{k} (tied to {next(o for o in partner[k] if o in present)})" for k in aliases]
        detail += f"; omitted tied alias {examples(named)}"
    return Check("keys", True, detail)


def shapes_check(head: Header, expected: dict) -> Check:
    wrong = [f"{k} {shape_text(s)} != {shape_text(expected[k])}" for k, (s, _, _) in head.entries.items()
             if k in expected and tuple(s) != expected[k] and 0 not in s]
    empty = sum(1 for k, (s, _, _) in head.entries.items() if k in expected and 0 in s and tuple(s) != expected[k])
    if wrong or empty:
        parts = [f"{len(wrong)} wrong: {examples(wrong)}"] if wrong else []
        if empty:
            parts.append(f"{empty} empty (see non-empty)")
        return Check("shapes", False, "; ".join(parts))
    return Check("shapes", True, "all match the config's model")


def nonempty_check(head: Header) -> Check:
    empty = [f"{k} {shape_text(s)}" for k, (s, _, _) in head.entries.items() if 0 in s]
    if empty:
        hint = ""
        if any(s == (0,) for s, _, _ in head.entries.values()):
            hint = " — shape [0] is a ZeRO-3 partitioned placeholder: gather the parameters before saving"
        return Check("non-empty", False, f"{len(empty)} of {len(head.entries)} tensors are empty: {examples(empty)}{hint}")
    return Check("non-empty", True, f"{len(head.entries)} tensors, none empty")


def dtype_check(head: Header, cfg_dtype: Optional[str]) -> tuple[Check, Optional[str]]:
    """(the check, the one floating dtype's name when the floating tensors agree)."""
    floats: dict = {}
    for k, (_, code, _) in head.entries.items():
        if is_float_code(code):
            floats.setdefault(code, []).append(k)
    if len(floats) > 1:
        mix = "; ".join(f"{len(v)} {dtype_name(c)} (e.g. {v[0]})" for c, v in sorted(floats.items(), key=lambda i: -len(i[1])))
        return Check("dtype", False, f"floating tensors mix dtypes: {mix}"), None
    if not floats:
        return Check("dtype", True, "no floating tensors"), None
    name = dtype_name(next(iter(floats)))
    note = ""
    if cfg_dtype and str(cfg_dtype).replace("torch.", "") != name:
        note = f" (config.json says {cfg_dtype}; from_pretrained(dtype='auto') would cast)"
    return Check("dtype", True, f"all floating tensors {name}{note}"), name


BLOCK_BYTES = 64 * 2**20  # how much of a stored tensor the streamed checks read at a time


def row_blocks(shape, chunk_bytes: int = BLOCK_BYTES):
    """Slices of a stored tensor's rows (its first dimension), each block at most ``chunk_bytes`` (a row
    counted at 8 bytes an element, the widest dtype): reading a tensor this way never holds it whole."""
    row = max(1, math.prod(int(d) for d in shape[1:]) * 8)
    step = max(1, chunk_bytes // row)
    for start in range(0, shape[0], step):
        yield slice(start, start + step)


def finite_check(folder: Path, head: Header) -> Check:
    """No floating tensor holds NaN or Inf. Each is read from its file a block of rows at a time
    (:func:`row_blocks`) and checked by the save module's ``is_finite``: the first such tensor and how many."""
    from safetensors import safe_open

    from patcher.templates.dsfix_safetensors import is_finite

    keys: dict = {}
    for key, (shape, code, file) in head.entries.items():
        if is_float_code(code) and 0 not in shape:
            keys.setdefault(file, []).append(key)
    bad, count = [], sum(len(v) for v in keys.values())
    for file, names in keys.items():
        with safe_open(str(folder / file), framework="pt") as f:
            for key in names:
                shape = head.entries[key][0]
                if not shape:
                    finite = is_finite(f.get_tensor(key))
                else:
                    piece = f.get_slice(key)
                    finite = all(is_finite(piece[rows]) for rows in row_blocks(shape))
                if not finite:
                    bad.append(key)
    if bad:
        return Check("finite", False, f"{len(bad)} of {count} floating tensors hold NaN or Inf, the first {bad[0]}")
    return Check("finite", True, f"no NaN or Inf in {count} floating tensors")
