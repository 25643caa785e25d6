"""Table tests of patcher.patch.calls.find_calls: which calls in a script reach the checkout's save functions,
under Python's own scoping rules. Each row is a script and the calls found in it, as ``line: callee``."""

from __future__ import annotations

import ast
import textwrap

import pytest

from patcher.patch import calls, reach

MODULES = ("dschat.utils.utils",)
NAMES = ("save_hf_format", "save_zero_three_model")
IMPORT = "from dschat.utils.utils import save_hf_format\n"


def found(src: str) -> list:
    src = textwrap.dedent(src)
    return [f"{c.line}: {c.how}" for c in calls.find_calls(ast.parse(src), src, MODULES, NAMES).calls]


CASES = [
    # (name, script, the calls found)
    ("bare call", IMPORT + "save_hf_format(m, t, a)\n", ["2: save_hf_format"]),
    ("two names, one import", "from dschat.utils.utils import save_hf_format, save_zero_three_model\n"
     "save_hf_format(m, t, a)\nsave_zero_three_model(m, 0, d)\n", ["2: save_hf_format", "3: save_zero_three_model"]),
    ("not imported", "save_hf_format(m, t, a)\n", []),
    ("imported from another module", "from other.utils import save_hf_format\nsave_hf_format(m, t, a)\n", []),
    ("relative import is not the module", "from .utils import save_hf_format\nsave_hf_format(m, t, a)\n", []),
    ("import alias", "from dschat.utils.utils import save_zero_three_model as save_z3\nsave_z3(m, 0, d)\n",
     ["2: save_z3"]),
    ("module alias, attribute call", "import dschat.utils.utils as u\nu.save_hf_format(m, t, a)\n",
     ["2: u.save_hf_format"]),
    ("dotted module, attribute call", "import dschat.utils.utils\ndschat.utils.utils.save_hf_format(m, t, a)\n",
     ["2: dschat.utils.utils.save_hf_format"]),
    ("parent package, attribute chain", "from dschat.utils import utils\nutils.save_hf_format(m, t, a)\n",
     ["2: utils.save_hf_format"]),
    ("attribute of something else", IMPORT + "obj.save_hf_format(m, t, a)\n", []),
    ("call inside a function", IMPORT + "def main():\n    save_hf_format(m, t, a)\n", ["3: save_hf_format"]),
    ("import inside the function", "def main():\n    from dschat.utils.utils import save_hf_format\n"
     "    save_hf_format(m, t, a)\n", ["3: save_hf_format"]),
    ("import in another function", "def a():\n    from dschat.utils.utils import save_hf_format\n"
     "def b():\n    save_hf_format(m, t, a)\n", []),
    ("a parameter shadows it", IMPORT + "def main(save_hf_format):\n    save_hf_format(m, t, a)\n", []),
    ("a local assignment shadows it", IMPORT + "def main():\n    save_hf_format = print\n    save_hf_format(m)\n", []),
    ("a later local assignment shadows it too", IMPORT + "def main():\n    save_hf_format(m)\n"
     "    save_hf_format = print\n", []),
    # a scope's bindings count, not the order they run in: a name that the scope also binds to the import
    # may be the import when the call runs
    ("rebound in the same scope", IMPORT + "save_hf_format = print\nsave_hf_format(m)\n", ["3: save_hf_format"]),
    ("global declaration reaches the import", IMPORT + "def main():\n    global save_hf_format\n"
     "    save_hf_format = save_hf_format\n    save_hf_format(m, t, a)\n", ["5: save_hf_format"]),
    ("global without rebinding", IMPORT + "def main():\n    global save_hf_format\n    save_hf_format(m, t, a)\n",
     ["4: save_hf_format"]),
    ("nonlocal reaches the enclosing import", "def outer():\n    from dschat.utils.utils import save_hf_format\n"
     "    def inner():\n        nonlocal save_hf_format\n        save_hf_format(m, t, a)\n",
     ["5: save_hf_format"]),
    ("enclosing function's local shadows", IMPORT + "def outer():\n    save_hf_format = print\n"
     "    def inner():\n        save_hf_format(m)\n", []),
    ("class body does not shadow its methods", IMPORT + "class C:\n    save_hf_format = print\n"
     "    def run(self):\n        save_hf_format(m, t, a)\n", ["5: save_hf_format"]),
    ("class attribute shadows in the class body", IMPORT + "class C:\n    save_hf_format = print\n"
     "    save_hf_format(m)\n", []),
    ("comprehension", IMPORT + "[save_hf_format(m, t, a) for m in models]\n", ["2: save_hf_format"]),
    ("comprehension variable shadows", IMPORT + "[save_hf_format(m) for save_hf_format in fs]\n", []),
    ("first iterable is evaluated outside", IMPORT + "[1 for x in save_hf_format(m, t, a)]\n",
     ["2: save_hf_format"]),
    ("lambda parameter shadows", IMPORT + "f = lambda save_hf_format: save_hf_format(m)\n", []),
    ("lambda body", IMPORT + "f = lambda m: save_hf_format(m, t, a)\n", ["2: save_hf_format"]),
    ("walrus in a comprehension binds outside", IMPORT + "def main():\n"
     "    [(save_hf_format := g) for g in fs]\n    save_hf_format(m)\n", []),
    ("except name shadows", IMPORT + "def main():\n    try:\n        pass\n"
     "    except Exception as save_hf_format:\n        save_hf_format(m)\n", []),
    ("for target shadows", IMPORT + "def main():\n    for save_hf_format in fs:\n        save_hf_format(m)\n", []),
    ("decorator and default are outside", IMPORT + "@save_hf_format\n"
     "def f(x=save_hf_format(m, t, a)):\n    pass\n", ["3: save_hf_format"]),
    ("nested call in an argument", IMPORT + "print(save_hf_format(m, t, a))\n", ["2: save_hf_format"]),
    ("call under if and with", IMPORT + "if rank == 0:\n    with ctx:\n        save_hf_format(m, t, a)\n",
     ["4: save_hf_format"]),
    ("a star import brings the tracked names", "from dschat.utils.utils import *\nsave_hf_format(m, t, a)\n",
     ["2: save_hf_format"]),
    ("dsfix's name is not upstream's", "from dschat.utils.utils import save_hf_format_safetensors\n"
     "save_hf_format_safetensors(m, t, a)\n", []),
]


@pytest.mark.parametrize("src, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_find_calls(src, expected):
    assert found(src) == expected


ARGS = [
    # (call, the arguments as found: keyword or None, star, text)
    ("save_hf_format(m, t, a)", [(None, "", "m"), (None, "", "t"), (None, "", "a")]),
    ("save_hf_format(m, t, args=a, sub_folder='x')",
     [(None, "", "m"), (None, "", "t"), ("args", "", "a"), ("sub_folder", "", "'x'")]),
    ("save_hf_format(*xs, **kw)", [(None, "*", "xs"), (None, "**", "kw")]),
    ("save_hf_format(m, tokenizer=t, *rest)", [(None, "", "m"), ("tokenizer", "", "t"), (None, "*", "rest")]),
    ("save_hf_format(model.module,\n    tok, args)",
     [(None, "", "model.module"), (None, "", "tok"), (None, "", "args")]),
    ("save_hf_format('é', t, a)", [(None, "", "'é'"), (None, "", "t"), (None, "", "a")]),
]


@pytest.mark.parametrize("call, expected", ARGS, ids=[a[0] for a in ARGS])
def test_arguments_as_written(call, expected):
    src = IMPORT + call + "\n"
    (found_call,) = calls.find_calls(ast.parse(src), src, MODULES, NAMES).calls
    assert [(a.keyword, a.star, a.text) for a in found_call.args] == expected


def test_imported_and_reads_count_module_level_bindings():
    src = IMPORT + "from dschat.utils.utils import save_zero_three_model as z3\nf = save_hf_format\nsave_hf_format(m)\n"
    sc = calls.find_calls(ast.parse(src), src, MODULES, NAMES)
    assert sc.imported == {"save_hf_format": "dschat.utils.utils.save_hf_format",
                           "z3": "dschat.utils.utils.save_zero_three_model"}
    assert sc.reads == {"save_hf_format": 2}


MODULE_READS = [
    # (source, reads of the module-level binding of json)
    ("import json\njson.dumps(1)\n", 1),
    ("import json\ndef f(json):\n    json.dumps(1)\n", 0),
    ("import json\ndef f():\n    return json\nclass C:\n    json = 1\n    x = json\n", 1),
    ("import json\n", 0),
]


@pytest.mark.parametrize("src, n", MODULE_READS)
def test_module_reads(src, n):
    assert reach.module_reads(src, ["json"]) == {"json": n}
