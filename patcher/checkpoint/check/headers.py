"""The checks of what a model folder's headers say, against its config's model: one :class:`Check` row each.

Each reads a :class:`patcher.checkpoint.readers.safetensors.Header` (name -> shape, dtype code, file), which
``dsfix verify`` reads from the files and ``dsfix convert`` builds from the tensors it is about to write, so
both run the same checks, convert before writing a byte. No tensor data is read here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from patcher.checkpoint.names import examples, shape_text
from patcher.checkpoint.readers.safetensors import Header, dtype_name, is_float_code


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str


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
    if not head.entries:  # nothing holds over no tensor
        return Check("non-empty", False, "the weight files hold no tensor")
    empty = [f"{k} {shape_text(s)}" for k, (s, _, _) in head.entries.items() if 0 in s]
    if empty:
        hint = ""
        if any(s == (0,) for s, _, _ in head.entries.values()):
            hint = " — shape [0] is a ZeRO-3 partitioned placeholder: gather the parameters before saving"
        return Check("non-empty", False,
                     f"{len(empty)} of {len(head.entries)} tensors are empty: {examples(empty)}{hint}")
    return Check("non-empty", True, f"{len(head.entries)} tensors, none empty")


def dtype_check(head: Header, cfg_dtype: Optional[str]) -> tuple[Check, Optional[str]]:
    """(the check, the one floating dtype's name when the floating tensors agree)."""
    floats: dict = {}
    for k, (_, code, _) in head.entries.items():
        if is_float_code(code):
            floats.setdefault(code, []).append(k)
    if len(floats) > 1:
        most_first = sorted(floats.items(), key=lambda i: -len(i[1]))
        mix = "; ".join(f"{len(v)} {dtype_name(c)} (e.g. {v[0]})" for c, v in most_first)
        return Check("dtype", False, f"floating tensors mix dtypes: {mix}"), None
    if not floats:
        return Check("dtype", True, "no floating tensors"), None
    name = dtype_name(next(iter(floats)))
    note = ""
    if cfg_dtype and str(cfg_dtype).replace("torch.", "") != name:
        note = f" (config.json says {cfg_dtype}; from_pretrained(dtype='auto') would cast)"
    return Check("dtype", True, f"all floating tensors {name}{note}"), name


def against_model(head: Header, expected: dict, tie_groups: list) -> list:
    """keys, shapes and non-empty: what a folder must be to load into its config's model."""
    return [keys_check(head, expected, tie_groups), shapes_check(head, expected), nonempty_check(head)]


def render(checks, title: str):
    """A rich Table of (name, ok, detail) rows, for the reports of verify, convert and smoke."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for c in checks:
        table.add_row(c.name, "[green]ok[/]" if c.ok else "[bold red]FAIL[/]", escape(c.detail))
    return table
