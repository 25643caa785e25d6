"""Property-based tests: generated import, call and formatting forms, and corrupted inputs.

For every generated file: the patch parses, a second patch changes nothing, pyflakes finds nothing
new, and the structural revert gives back the exact original bytes. Corrupted inputs are either
patched the same way or refused with a DsfixError, never a crash.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patcher.errors import DsfixError
from patcher.patch import plan as planner
from patcher.patch.plan import Target
from patchkit import FIXTURES, pyflakes_messages
from unitkit import fix, undo

pytestmark = pytest.mark.slow  # hundreds of generated files patched and reverted

MOD = "dschat.utils.utils"
# DSFIX_FUZZ_SCALE=10 runs ten times as many examples (the CI default keeps the suite quick).
SCALE = float(os.environ.get("DSFIX_FUZZ_SCALE", "1"))
SETTINGS = settings(max_examples=int(200 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def main_sources(draw):
    indent = draw(st.sampled_from(["    ", "  ", "\t"]))
    nl = draw(st.sampled_from(["\n", "\r\n"]))
    others = draw(st.lists(st.sampled_from(["print_rank_0", "to_device", "set_random_seed", "load_hf_tokenizer"]),
                           unique=True, max_size=4))
    with_z3 = draw(st.booleans())
    style = draw(st.sampled_from(["line", "paren", "paren-trailing", "alias", "module-as", "from-utils", "two-lines"]))
    names = others + ["save_hf_format"] + (["save_zero_three_model"] if with_z3 else [])
    order = draw(st.permutations(names))
    lines = ["import torch", "import deepspeed"] if draw(st.booleans()) else ["import os"]
    if draw(st.booleans()):
        lines.insert(0, "# " + draw(st.sampled_from(["step 1", "SFT entry", "fork: tweaks"])))
    hf, z3 = "save_hf_format", "save_zero_three_model"
    mod_prefix = ""
    if style == "line":
        lines.append(f"from {MOD} import " + ", ".join(order))
    elif style in ("paren", "paren-trailing"):
        body = f",{nl}".join(indent + n for n in order)
        trail = "," if style == "paren-trailing" else ""
        lines.append(f"from {MOD} import ({nl}{body}{trail}{nl})")
    elif style == "alias":
        hf = "shf"
        lines.append(f"from {MOD} import " + ", ".join(n + (" as shf" if n == "save_hf_format" else "") for n in order))
        z3 = "save_zero_three_model"
    elif style == "module-as":
        lines.append(f"import {MOD} as u")
        mod_prefix = "u."
    elif style == "from-utils":
        lines.append("from dschat.utils import utils")
        mod_prefix = "utils."
    else:
        rest = [n for n in order if n != "save_hf_format"]
        if rest:
            lines.append(f"from {MOD} import " + ", ".join(rest))
        lines.append(f"from {MOD} import save_hf_format")
    call_args = draw(st.sampled_from(["(model, tokenizer, args)", "(model=model, tokenizer=tokenizer, args=args)",
                                      "(model, tokenizer, args, sub_folder='best')", "(model, tokenizer, args, 'x')"]))
    n_calls = draw(st.integers(1, 3))
    body = ["def main(model, tokenizer, args):"]
    if others and not mod_prefix:
        body.append(f"{indent}{others[0]}")
    for _ in range(n_calls):
        body.append(f"{indent}if args.global_rank == 0:")
        body.append(f"{indent}{indent}{mod_prefix}{hf}{call_args}")
    if with_z3 or mod_prefix:
        if draw(st.booleans()):
            body.append(f"{indent}if args.zero_stage == 3:")
            args_ = ["model", "args.global_rank", "args.output_dir", "zero_stage=args.zero_stage"]
            head = f"{indent}{indent}{mod_prefix}{z3}("
            body.append(head + f",{nl}{' ' * len(head.replace(chr(9), ' ' * 8))}".join(args_) + ")")
        elif with_z3 and not mod_prefix:
            body.append(f"{indent}return {z3}")
    if draw(st.booleans()) and not mod_prefix and style != "alias":
        body.append(f"{indent}hooks = [save_hf_format]")
    text = nl.join(lines) + nl * 3 + nl.join(body)
    if draw(st.booleans()):
        text += nl
    return text.encode()


def _roundtrip_main(src: bytes):
    modules = (MOD, "utils.utils")
    new = fix("script", src, modules).new
    compile(new, "main.py", "exec")
    assert fix("script", new, modules).new == new, "a second patch changes nothing"
    assert b"save_hf_format_safetensors" in new
    assert pyflakes_messages(new) <= pyflakes_messages(src), (pyflakes_messages(new) - pyflakes_messages(src))
    assert undo("script", new, modules) == src
    return new


@SETTINGS
@given(main_sources())
def test_generated_main_py_forms(src):
    _roundtrip_main(src)


UTILS_BASE = (FIXTURES / "package" / "dschat/utils/utils.py").read_bytes()


@st.composite
def utils_sources(draw):
    text = UTILS_BASE.decode()
    extra_imports = draw(st.lists(st.sampled_from([
        "from safetensors import safe_open", "from safetensors.torch import load_file", "import sys",
        "import json", "try:\n    import sys\nexcept ImportError:\n    sys = None",
    ]), unique=True, max_size=3))
    for k, imp in enumerate(extra_imports):
        text = text.replace("import deepspeed\n", f"import deepspeed\n{imp}\n", 1)
        name = imp.split()[-1]
        if "sys = None" in imp:
            name = "sys"
        text += f"\n\ndef _uses_{k}():\n    return {name}\n"
    if draw(st.booleans()):
        text = text.replace("\n\ndef set_random_seed", "\n\n# a comment between functions\ndef set_random_seed", 1)
    if draw(st.booleans()):  # save_hf_format as the last function
        start = text.index("def save_hf_format(")
        end = text.index("\n\n\ndef ", start)
        fn = text[start:end]
        text = text[:start] + text[end + 3:] + "\n\n" + fn + "\n"
    if draw(st.booleans()):
        text = text.replace("    ", "\t")
    nl = draw(st.sampled_from(["\n", "\r\n"]))
    text = text.replace("\n", nl)
    if draw(st.booleans()):
        text = text.rstrip(nl)
    return text.encode()


@SETTINGS
@given(utils_sources(), st.sampled_from(["clone", "dedupe"]))
def test_generated_utils_py_forms(src, strategy):
    new = fix("utils", src, strategy=strategy).new
    compile(new, "utils.py", "exec")
    assert new.count(b"def save_hf_format_safetensors(") == 1
    assert fix("utils", new, strategy=strategy).new == new, "a second patch changes nothing"
    assert pyflakes_messages(new) <= pyflakes_messages(src), pyflakes_messages(new) - pyflakes_messages(src)
    assert undo("utils", new) == src


MAIN_BASE = (FIXTURES / "package" / "training/step1_supervised_finetuning/main.py").read_bytes()


@st.composite
def corrupted(draw):
    base = draw(st.sampled_from([("utils", UTILS_BASE), ("main", MAIN_BASE)]))
    role, data = base
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
    i = draw(st.integers(0, len(data)))
    if kind == "truncate":
        data = data[:i]
    elif kind == "flip":
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    elif kind == "insert":
        data = data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
    else:
        data = data[:i] + data[i + draw(st.integers(1, 40)):]
    return role, data


def _targets(role: str, data: bytes) -> list:
    if role == "utils":
        return [Target("f.py", "utils", data)]
    return [Target("utils.py", "utils", UTILS_BASE), Target("f.py", "script", data, 1, (MOD,))]


@settings(max_examples=int(400 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corrupted())
def test_corrupted_inputs_are_patched_validly_or_refused_cleanly(case):
    role, data = case
    try:
        plan = planner.plan_apply(_targets(role, data), "clone", verify=True)
    except DsfixError as e:
        assert e.path == "f.py" and e.code == 2 and str(e)
        return
    change = next(c for c in plan.changes if c.rel == "f.py")
    if not change.changed:
        return
    compile(change.new, "f.py", "exec")
    again = planner.plan_apply(_targets(role, change.new), "clone")
    assert not next(c for c in again.changes if c.rel == "f.py").changed
    assert undo("utils" if role == "utils" else "script", change.new) == data
