"""Table tests of patcher.patch.signature: binding a call to a fork's save function, as Python would, and
the parameter list dsfix's replacement takes. One row per case; no files, no CLI (milliseconds)."""

from __future__ import annotations

import ast

import libcst as cst
import pytest

from patcher.errors import DsfixError
from patcher.patch import calls, signature

UPSTREAM = "def save_hf_format(model, tokenizer, args, sub_folder=''):"
Z3 = "def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):"


def params(header: str) -> tuple:
    return signature.params_of(header + "\n    pass\n")


def args_of(call: str) -> list:
    """The arguments of ``call`` (source text) as patcher.patch.calls finds them."""
    return calls.arguments(ast.parse(call, mode="eval").body, calls.Source(call))


BINDS = [
    # (def header, call, param -> argument text)
    (UPSTREAM, "f(m, t, a)", {"model": "m", "tokenizer": "t", "args": "a"}),
    (UPSTREAM, "f(m, t, a, 'actor')", {"model": "m", "tokenizer": "t", "args": "a", "sub_folder": "'actor'"}),
    (UPSTREAM, "f(m, tokenizer=t, args=a, sub_folder=s)",
     {"model": "m", "tokenizer": "t", "args": "a", "sub_folder": "s"}),
    (UPSTREAM, "f(args=a, model=m, tokenizer=t)", {"model": "m", "tokenizer": "t", "args": "a"}),
    (UPSTREAM, "f(model.module, tok, args)", {"model": "model.module", "tokenizer": "tok", "args": "args"}),
    (Z3, "f(m, args.global_rank, args.output_dir, zero_stage=args.zero_stage)",
     {"model_ema": "m", "global_rank": "args.global_rank", "save_dir": "args.output_dir",
      "zero_stage": "args.zero_stage"}),
    (Z3, "f(m, 0, d, 3)", {"model_ema": "m", "global_rank": "0", "save_dir": "d", "zero_stage": "3"}),
    ("def f(model, /, tokenizer, args):", "f(m, t, args=a)", {"model": "m", "tokenizer": "t", "args": "a"}),
    ("def f(model, tokenizer, args, *, sub_folder=''):", "f(m, t, a, sub_folder='x')",
     {"model": "m", "tokenizer": "t", "args": "a", "sub_folder": "'x'"}),
    ("def f(model, *rest):", "f(m, 1, 2)", {"model": "m", "rest": ["1", "2"]}),
    ("def f(model, **opts):", "f(m, a=1, b=2)", {"model": "m", "opts": {"a": "1", "b": "2"}}),
    ("def f(model, /, **opts):", "f(m, model=2)", {"model": "m", "opts": {"model": "2"}}),  # posonly: model= goes to **
    ("def f(model, *rest, where, **opts):", "f(m, 1, where=w, x=2)",
     {"model": "m", "rest": ["1"], "where": "w", "opts": {"x": "2"}}),
    # an unpacked argument: nothing to check, the call binds as it did (the parameters are the same)
    (UPSTREAM, "f(*xs)", None),
    (UPSTREAM, "f(m, t, **kw)", None),
]


@pytest.mark.parametrize("header, call, expected", BINDS, ids=[r[1] for r in BINDS])
def test_bind(header, call, expected):
    assert signature.bind(params(header), args_of(call)) == expected


BAD_CALLS = [
    # (def header, call, what the error says): each would raise TypeError when it runs
    (UPSTREAM, "f(m, t)", "parameter args gets no value"),
    (UPSTREAM, "f()", "parameter model gets no value"),
    (UPSTREAM, "f(m, t, a, s, extra)",
     "takes 4 positional arguments but the call passes 5 (argument 5, `extra`, has no parameter)"),
    ("def f(model):", "f(m, t)",
     "takes 1 positional argument but the call passes 2 (argument 2, `t`, has no parameter)"),
    (UPSTREAM, "f(m, t, a, model=m2)", "parameter model gets two values (by position and by keyword)"),
    (UPSTREAM, "f(m, t, a, bogus=1)", "has no parameter bogus (passed by keyword)"),
    ("def f(model, /, tokenizer):", "f(model=m, tokenizer=t)", "has no parameter model (passed by keyword)"),
    ("def f(model, *, where):", "f(m)", "parameter where gets no value"),
    ("def f(model, *, where):", "f(m, w)",
     "takes 1 positional argument but the call passes 2 (argument 2, `w`, has no parameter)"),
]


@pytest.mark.parametrize("header, call, message", BAD_CALLS, ids=[f"{r[0][6:20]} {r[1]}" for r in BAD_CALLS])
def test_bind_refuses_a_call_that_cannot_bind(header, call, message):
    with pytest.raises(ValueError) as e:
        signature.bind(params(header), args_of(call))
    assert str(e.value) == message


HEADERS = [
    # (the checkout's def, the header of dsfix's replacement): the same parameters, plus dsfix's keyword-only
    # options where the checkout's do not already take them
    (UPSTREAM, "def new(model, tokenizer, args, sub_folder='', *, strategy=None, max_shard_size=None):"),
    (Z3, "def new(model_ema, global_rank, save_dir, zero_stage=0, *, strategy=None, max_shard_size=None):"),
    ("def save_hf_format(model, /, tokenizer, args):",
     "def new(model, /, tokenizer, args, *, strategy=None, max_shard_size=None):"),
    ("def save_hf_format(model, tokenizer, *, args, sub_folder=''):",
     "def new(model, tokenizer, *, args, sub_folder='', strategy=None, max_shard_size=None):"),
    ("def save_hf_format(model, *extra, args):",
     "def new(model, *extra, args, strategy=None, max_shard_size=None):"),
    ("def save_hf_format(model, tokenizer, args, **kwargs):",
     "def new(model, tokenizer, args, *, strategy=None, max_shard_size=None, **kwargs):"),
    ("def save_hf_format(model, tokenizer, args, *, strategy='x'):",
     "def new(model, tokenizer, args, *, strategy='x', max_shard_size=None):"),
]


@pytest.mark.parametrize("header, expected", HEADERS, ids=[r[0] for r in HEADERS])
def test_header_keeps_the_checkouts_parameters(header, expected):
    sd = signature.SaveDef("save_hf_format", params(header), 1)
    assert sd.header("new") == expected
    params(expected)  # it parses


def read(source: str) -> signature.SaveDef:
    return signature.read_def(cst.parse_statement(source), "utils.py", 1)


READS = [
    # (the checkout's function, where dsfix saves, (core keyword, argument) pairs it passes on)
    ("def save_hf_format(model, tokenizer, args, sub_folder=''):\n"
     "    output_dir = os.path.join(args.output_dir, sub_folder)\n"
     "    os.makedirs(output_dir, exist_ok=True)\n"
     "    torch.save(model.state_dict(), os.path.join(output_dir, 'pytorch_model.bin'))\n"
     "    tokenizer.save_vocabulary(output_dir)\n",
     ("output_dir = os.path.join(args.output_dir, sub_folder)",), "output_dir", (("tokenizer", "tokenizer"),)),
    ("def save_hf_format(model, tokenizer, out):\n"
     "    torch.save(model.state_dict(), os.path.join(out, 'pytorch_model.bin'))\n",
     (), "out", ()),
    ("def save_hf_format(model, tokenizer, args, global_rank=0):\n"
     "    if global_rank == 0:\n"
     "        model.save_pretrained(args.output_dir)\n"
     "        tokenizer.save_pretrained(args.output_dir)\n",
     (), "args.output_dir", (("tokenizer", "tokenizer"), ("global_rank", "global_rank"))),
    ("def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):\n"
     "    os.makedirs(save_dir, exist_ok=True)\n"
     "    if global_rank == 0:\n"
     "        torch.save({}, os.path.join(save_dir, 'pytorch_model.bin'))\n",
     (), "save_dir", (("global_rank", "global_rank"),)),
]


@pytest.mark.parametrize("source, where, folder, passed", READS, ids=[r[0].split(":")[0] for r in READS])
def test_read_def_finds_the_folder_and_the_parameters(source, where, folder, passed):
    sd = read(source)
    assert (sd.where, sd.folder, sd.passed) == (where, folder, passed)


REFUSED = [
    # (the checkout's function, what the refusal says)
    ("def save_hf_format():\n    torch.save({}, 'x.bin')\n", "takes no positional model parameter"),
    ("def save_hf_format(model, tokenizer, args):\n    print(args)\n", "cannot tell which folder"),
    ("def save_hf_format(model, tokenizer, args):\n    tokenizer.save_pretrained(args.output_dir)\n",
     "saves no weights"),
    ("def save_hf_format(model, tokenizer, args, half=False):\n"
     "    sd = model.half().state_dict() if half else model.state_dict()\n"
     "    torch.save(sd, os.path.join(args.output_dir, 'pytorch_model.bin'))\n",
     "parameter half changes what the original does"),
    ("def save_zero_three_model(model_ema, save_dir):\n"
     "    torch.save({}, os.path.join(save_dir, 'pytorch_model.bin'))\n",
     "takes no global_rank (or rank) parameter"),
]


@pytest.mark.parametrize("source, message", REFUSED, ids=[r[1] for r in REFUSED])
def test_read_def_refuses_what_it_cannot_carry_over(source, message):
    with pytest.raises(DsfixError) as e:
        read(source)
    assert message in e.value.message
    assert e.value.path == "utils.py"
