"""How dsfix reads a fork, one table per reader (fast, in process, no fixtures on disk):

* binding a call to the fork's own parameters, as ``inspect.Signature.bind`` would;
* the folder computation carried into dsfix's function (or refused, naming the line);
* the keys the fork's save leaves out, for dsfix's ``drop=``;
* every use of the save functions in a script, under Python's scoping rules.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from patcher.errors import DsfixError
from patcher.patch import calls, signature
from patcher.patch.source import Source
from unitkit import fix, undo

MOD = "dschat.utils.utils"
UPSTREAM = {n: signature.default_def(n) for n in signature.RENAMES}


# ----------------------------------------------------------------------------- binding a call


def _args(call_src: str) -> list:
    text = f"f({call_src})"
    node = ast.parse(text, mode="eval").body
    src = Source(text)
    out = []
    for a in sorted([*node.args, *node.keywords], key=lambda a: (a.lineno, a.col_offset)):
        value = a.value if isinstance(a, (ast.keyword, ast.Starred)) else a
        if isinstance(a, ast.keyword):
            out.append(calls.Arg(a.arg, "" if a.arg else "**", src.segment(value), 1, a.col_offset))
        else:
            out.append(calls.Arg(None, "*" if isinstance(a, ast.Starred) else "", src.segment(value), 1, a.col_offset))
    return out


BIND = [  # (parameters, call arguments, expected binding or a word of the error)
    ("model, tokenizer, args, sub_folder=''", "m, t, a", {"model": "m", "tokenizer": "t", "args": "a"}),
    ("model, tokenizer, args, sub_folder=''", "m, t, a, 'x'", {"model": "m", "tokenizer": "t", "args": "a",
                                                               "sub_folder": "'x'"}),
    ("model, tokenizer, args=None, sub_folder='', save_dir=None", "m, t, save_dir=d",
     {"model": "m", "tokenizer": "t", "save_dir": "d"}),
    ("model, tokenizer, args, sub_folder=''", "model=m, tokenizer=t, args=a",
     {"model": "m", "tokenizer": "t", "args": "a"}),
    ("model, tokenizer, args, *rest, **kw", "m, t, a, 1, 2, x=3", {"model": "m", "tokenizer": "t", "args": "a",
                                                                   "rest": ["1", "2"], "kw": {"x": "3"}}),
    ("model, /, tokenizer, args", "m, t, args=a", {"model": "m", "tokenizer": "t", "args": "a"}),
    ("model, tokenizer, *, args", "m, t, args=a", {"model": "m", "tokenizer": "t", "args": "a"}),
    ("model, tokenizer, args", "m, *xs", None),  # unpacked: binds as it did, the parameters being the same
    ("model, tokenizer, args", "m, **kw", None),
    ("model, tokenizer, args", "m, t", "parameter args gets no value"),
    ("model, tokenizer, args", "m, t, a, b", "takes 3 positional arguments but the call passes 4"),
    ("model, tokenizer, args", "m, t, a, sub_folder='x'", "has no parameter sub_folder"),
    ("model, tokenizer, args", "m, t, a, tokenizer=t", "parameter tokenizer gets two values"),
    ("model, /, tokenizer, args", "model=m, tokenizer=t, args=a", "has no parameter model"),
    ("model, tokenizer, *, args", "m, t, a", "takes 2 positional arguments"),
]


@pytest.mark.parametrize("params, call, expected", BIND)
def test_bind_a_call_to_the_forks_parameters(params, call, expected):
    ps = signature.params_of(f"def f({params}):\n    pass\n")
    fn = {}
    exec(f"def f({params}):\n    pass\n", fn)
    values = {"m": 1, "t": 2, "a": 3, "b": 4, "d": 5, "xs": (2, 3), "kw": {"tokenizer": 2, "args": 3}}
    try:
        a, k = eval(f"(lambda *a, **k: (a, k))({call})", values)
        inspect.signature(fn["f"]).bind(*a, **k)
        python_binds = True
    except TypeError:
        python_binds = False
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            signature.bind(ps, _args(call))
        assert not python_binds
    else:
        assert signature.bind(ps, _args(call)) == expected
        assert python_binds


# ----------------------------------------------------------------------------- the folder computation

HEAD = "import os\nimport os.path as osp\nfrom os.path import join\nimport torch\nROOT = '/data'\n\n\n"
TAIL = ("    os.makedirs(output_dir, exist_ok=True)\n"
        "    torch.save(model.state_dict(), os.path.join(output_dir, 'pytorch_model.bin'))\n")


def _read(body: str, params: str = "model, tokenizer, args=None, sub_folder='', save_dir=None", tail: str = TAIL):
    src = HEAD + f"def save_hf_format({params}):\n" + textwrap.indent(textwrap.dedent(body), "    ") + tail
    return signature.find_defs(src.encode(), "utils.py")["save_hf_format"]


FOLDERS = [  # (the function's body before its makedirs, the statements carried or the refusal's words)
    ("output_dir = os.path.join(args.output_dir, sub_folder)\n",
     ["output_dir = os.path.join(args.output_dir, sub_folder)"]),
    ("""\
     model_to_save = model.module if hasattr(model, "module") else model
     if save_dir is not None:
         output_dir = save_dir
     else:
         output_dir = os.path.join(args.output_dir, sub_folder)
     """, ["if save_dir is not None:\n    output_dir = save_dir\nelse:\n"
           "    output_dir = os.path.join(args.output_dir, sub_folder)"]),
    ("""\
     if save_dir:
         output_dir = save_dir
     elif sub_folder:
         print("saving", sub_folder)
         output_dir = join(args.output_dir, f"{sub_folder}_hf")
     else:
         raise ValueError("no folder")
     """, ['if save_dir:\n    output_dir = save_dir\nelif sub_folder:\n'
           '    output_dir = join(args.output_dir, f"{sub_folder}_hf")\nelse:\n    raise ValueError("no folder")']),
    ("output_dir = save_dir if save_dir else osp.join(args.output_dir, sub_folder.strip('/'))\n",
     ["output_dir = save_dir if save_dir else osp.join(args.output_dir, sub_folder.strip('/'))"]),
    ("""\
     base = args.output_dir
     if sub_folder:
         base = os.path.join(base, sub_folder)
     output_dir = os.path.normpath(base)
     """, ["base = args.output_dir", "if sub_folder:\n    base = os.path.join(base, sub_folder)",
           "output_dir = os.path.normpath(base)"]),
    ("output_dir = ROOT\n", "computes its folder from ROOT, which is not one of its parameters"),
    ("output_dir = make_dir(args)\n", "with a call of make_dir"),
    ("args.output_dir = 'x'\noutput_dir = os.path.join(args.output_dir, sub_folder)\n", "changes args in place"),
    ("output_dir = os.path.join(args.output_dir, sub_folder)\nargs.output_dir = 'x'\n",  # after: no matter
     ["output_dir = os.path.join(args.output_dir, sub_folder)"]),
    ("parts = [args.output_dir]\nparts.append(sub_folder)\noutput_dir = os.path.join(*parts)\n",
     "changes parts in place"),
    ("for d in (save_dir, args.output_dir):\n    output_dir = d\n", "in a loop"),
    ("if save_dir:\n    output_dir = save_dir\n", "not every path assigns output_dir"),
    ("output_dir = [d for d in (save_dir,)][0]\n", "ListComp"),
]


@pytest.mark.parametrize("body, expected", FOLDERS)
def test_folder_computation_is_carried_or_refused_by_line(body, expected):
    if isinstance(expected, str):
        with pytest.raises(DsfixError) as e:
            _read(body)
        assert expected in e.value.message
        assert "\n" not in str(e.value) and len(str(e.value)) <= 300
        assert e.value.line is not None and e.value.line > HEAD.count("\n")
        assert "`" not in e.value.message, "names the line, never quotes the code"
    else:
        d = _read(body)
        assert list(d.where) == expected
        assert d.folder == "output_dir"


def test_a_refusal_names_the_line_of_the_statement():
    with pytest.raises(DsfixError) as e:
        _read("x = 1\ny = 2\noutput_dir = os.path.join(ROOT, sub_folder)\n")
    assert e.value.line == HEAD.count("\n") + 4  # the def, x, y, then the statement


def test_the_carried_statements_run_for_every_call():
    """dsfix's function computes the folder each call's arguments decide, as the fork's own did."""
    d = _read("if save_dir is not None:\n    output_dir = save_dir\nelse:\n"
              "    output_dir = os.path.join(args.output_dir, sub_folder)\n")
    text = signature.generate(d, '"""doc"""', "clone").replace("dsfix_safetensors.save_hf_format(", "return _core(")
    ns = {"os": __import__("os"), "_core": lambda *a, **k: a}
    exec(text, ns)
    fn = ns["save_hf_format_safetensors"]

    class A:
        output_dir = "/out"

    assert fn("m", "t", A())[2] == "/out/"
    assert fn("m", "t", A(), "best")[2] == "/out/best"
    assert fn("m", "t", save_dir="/elsewhere")[2] == "/elsewhere"


# ----------------------------------------------------------------------------- the keys left out


def _drop(loop: str, params: str = "model, tokenizer, args, sub_folder=''"):
    body = "output_dir = os.path.join(args.output_dir, sub_folder)\nos.makedirs(output_dir)\n" \
           "save_dict = model.state_dict()\n" + textwrap.dedent(loop) + \
           "torch.save(save_dict, os.path.join(output_dir, 'pytorch_model.bin'))\n"
    return _read(body, params, tail="").drop


FILTERS = [  # (how the save drops keys, dsfix's drop= or the refusal's words); None: upstream's rule
    ("for key in list(save_dict.keys()):\n    if 'lora' in key:\n        del save_dict[key]\n", None),
    ("save_dict = {k: v for k, v in save_dict.items() if 'lora' not in k}\n", None),
    # upstream's test written twice, once for the parameters and once for the buffers (a ChatGLM port)
    ("out = {}\nfor k, v in model.named_parameters():\n    if 'lora' not in k:\n        out[k] = v\n"
     "for name, b in model.named_buffers():\n    if 'lora' not in name:\n        out[name] = b\n", None),
    ("", "lambda name: False"),
    ("for key in list(save_dict.keys()):\n    if 'svd' in key or 'sigma' in key:\n        del save_dict[key]\n",
     "lambda name: 'svd' in name or 'sigma' in name"),
    ("save_dict = {k: v for k, v in save_dict.items() if 'lora' not in k and not k.startswith('v_head')}\n",
     "lambda name: 'lora' in name or name.startswith('v_head')"),
    ("for key in list(save_dict):\n    if key.endswith(('.svd_u', '.svd_v')):\n        save_dict.pop(key)\n",
     "lambda name: name.endswith(('.svd_u', '.svd_v'))"),
    ("out = {}\nfor k, v in model.named_parameters():\n    if k.startswith('v_head'):\n        continue\n"
     "    if args.global_rank == 0 and not any(s in k for s in ('lora', 'svd')):\n        out[k] = v\n",
     "lambda name: name.startswith('v_head') or any(s in name for s in ('lora', 'svd'))"),
    ("for key in [k for k in save_dict if k == 'lm_head.weight']:\n    del save_dict[key]\n",
     "lambda name: name == 'lm_head.weight'"),
    ("for name in list(save_dict):\n    if args.prefix in name:\n        del save_dict[name]\n",
     "lambda name: args.prefix in name"),
    ("save_dict = {k: v for k, v in save_dict.items() if not is_adapter(k)}\n", "with a call of is_adapter"),
    ("skip = ('lora',)\nsave_dict = {k: v for k, v in save_dict.items() if k not in skip}\n",
     "against skip, which is not one of its parameters"),
    ("save_dict = {k: v for k, v in save_dict.items() if v.requires_grad}\n", "other than the key name"),
    ("save_dict = {k: v for k, v in save_dict.items() if (lambda s: 'x' in s)(k)}\n", "cannot carry"),
]


@pytest.mark.parametrize("loop, expected", FILTERS)
def test_keys_the_fork_leaves_out(loop, expected):
    if expected is not None and not expected.startswith("lambda"):
        with pytest.raises(DsfixError) as e:
            _drop(loop)
        assert expected in e.value.message and "\n" not in str(e.value) and len(str(e.value)) <= 300
        assert e.value.line is not None
        return
    drop = _drop(loop)
    assert drop == expected
    if drop is not None:  # and it means what the fork's own test means, key by key
        fn = eval(drop, {"args": type("A", (), {"prefix": "x.svd"})})
        for key in ("model.lora_right_weight", "a.svd_u", "sigma", "v_head.weight", "lm_head.weight", "x.svd.y",
                    "model.embed_tokens.weight"):
            fork = _fork_drops(loop, key)
            assert fn(key) == fork, (key, fork)


def _fork_drops(loop: str, key: str) -> bool:
    """Run the fork's own loop on a one-key state dict: whether it leaves the key out."""
    class M:
        def state_dict(self):
            return {key: 1}

        def named_parameters(self):
            return [(key, 1)]

    args = type("A", (), {"global_rank": 0, "prefix": "x.svd"})
    ns = {"model": M(), "args": args, "save_dict": {key: 1}}
    exec(textwrap.dedent(loop), ns)
    kept = ns.get("out", ns["save_dict"])
    return key not in kept


# ----------------------------------------------------------------------------- every use in a script


USES = [  # (script, what the patched script holds, or the refusal's words)
    # a call and a stored value
    (f"from {MOD} import save_hf_format\nsaver = save_hf_format\nsaver(m, t, a)\n",
     f"from {MOD} import save_hf_format_safetensors\nsaver = save_hf_format_safetensors\nsaver(m, t, a)\n"),
    # passed on, in a partial, in a lambda
    (f"import functools\nfrom {MOD} import save_hf_format\nhelper(save_hf_format)\n"
     "f = functools.partial(save_hf_format, m)\ng = lambda: save_hf_format(m, t, a)\n",
     f"import functools\nfrom {MOD} import save_hf_format_safetensors\nhelper(save_hf_format_safetensors)\n"
     "f = functools.partial(save_hf_format_safetensors, m)\ng = lambda: save_hf_format_safetensors(m, t, a)\n"),
    # an attribute of the module, called and stored
    (f"import {MOD} as u\nu.save_hf_format(m, t, a)\nhooks = [u.save_hf_format]\n",
     f"import {MOD} as u\nu.save_hf_format_safetensors(m, t, a)\nhooks = [u.save_hf_format_safetensors]\n"),
    # an alias: the import is renamed, the uses stay
    (f"from {MOD} import save_hf_format as shf\nhooks = [shf]\n",
     f"from {MOD} import save_hf_format_safetensors as shf\nhooks = [shf]\n"),
    # a star import: the names it brings in include dsfix's
    (f"from {MOD} import *\nsave_hf_format(m, t, a)\ncb = save_zero_three_model\n",
     f"from {MOD} import *\nsave_hf_format_safetensors(m, t, a)\ncb = save_zero_three_model_safetensors\n"),
    # shadowing: a parameter, a local, a comprehension variable are other names
    (f"from {MOD} import save_hf_format\nsave_hf_format(m, t, a)\n"
     "def f(save_hf_format):\n    return save_hf_format\n"
     "def g():\n    save_hf_format = 1\n    return save_hf_format\n"
     "x = [save_hf_format for save_hf_format in range(3)]\n",
     f"from {MOD} import save_hf_format_safetensors\nsave_hf_format_safetensors(m, t, a)\n"
     "def f(save_hf_format):\n    return save_hf_format\n"
     "def g():\n    save_hf_format = 1\n    return save_hf_format\n"
     "x = [save_hf_format for save_hf_format in range(3)]\n"),
    # a comprehension reads the import of the scope around it
    (f"from {MOD} import save_hf_format\nsavers = [save_hf_format for _ in range(2)]\n",
     f"from {MOD} import save_hf_format_safetensors\nsavers = [save_hf_format_safetensors for _ in range(2)]\n"),
    # an inner function reads the outer one's import; global names the module's
    (f"def outer():\n    from {MOD} import save_hf_format\n    def inner():\n"
     "        return save_hf_format\n    return inner\n",
     f"def outer():\n    from {MOD} import save_hf_format_safetensors\n    def inner():\n"
     "        return save_hf_format_safetensors\n    return inner\n"),
    (f"from {MOD} import save_hf_format\ndef f():\n    global save_hf_format\n    save_hf_format(m, t, a)\n",
     f"from {MOD} import save_hf_format_safetensors\ndef f():\n    global save_hf_format\n"
     "    save_hf_format_safetensors(m, t, a)\n"),
    # refused: nonlocal would name what is no longer bound
    (f"def outer():\n    from {MOD} import save_hf_format\n    def inner():\n        nonlocal save_hf_format\n"
     "        return save_hf_format\n    return inner\n", "nonlocal"),
    # a local import in a function; the module-level name elsewhere is another thing
    (f"def f():\n    from {MOD} import save_hf_format\n    return save_hf_format\nsave_hf_format = None\n",
     f"def f():\n    from {MOD} import save_hf_format_safetensors\n    return save_hf_format_safetensors\n"
     "save_hf_format = None\n"),
    # refused: the imported name rebound in the same scope
    (f"from {MOD} import save_hf_format\nsave_hf_format = wrap(save_hf_format)\nsave_hf_format(m, t, a)\n",
     "also assigned (line 2)"),
    # refused: global in a function rebinds the module's name
    (f"from {MOD} import save_hf_format\ndef f():\n    global save_hf_format\n    save_hf_format = None\n"
     "save_hf_format(m, t, a)\n", "also assigned (line 4)"),
    # refused: by name in a string, or replaced on the module
    (f"import {MOD} as u\nf = getattr(u, 'save_hf_format')\n", "in a string"),
    (f"import {MOD} as u\nu.save_hf_format = print\nu.save_hf_format(m, t, a)\n", "assigns or deletes"),
]


@pytest.mark.parametrize("src, expected", USES)
def test_every_use_of_the_save_functions_is_rewritten_or_refused(src, expected):
    if "\n" not in expected:
        with pytest.raises(DsfixError) as e:
            fix("script", src.encode())
        assert expected in e.value.message and e.value.line is not None and len(str(e.value)) <= 300
        return
    res = fix("script", src.encode())
    assert res.new.decode() == expected
    assert undo("script", res.new) == src.encode(), "revert gives every byte back"
    assert fix("script", res.new).new == res.new, "a second patch changes nothing"


def test_a_stored_save_refused_when_dsfix_would_take_keywords_the_fork_passed_on():
    src = HEAD + ("def save_hf_format(model, tokenizer, args, **kw):\n"
                  + TAIL.replace("output_dir, exist_ok", "args.x, exist_ok")
                        .replace("os.path.join(output_dir", "os.path.join(args.x"))
    defs = signature.find_defs(src.encode(), "utils.py")
    script = f"from {MOD} import save_hf_format\nhelper(save_hf_format)\n".encode()
    with pytest.raises(DsfixError, match="used as a value"):
        fix("script", script, defs=defs)
