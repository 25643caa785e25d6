"""Table tests of the fixers (patcher.patch.fixers), in the style of a codemod's ``(before, after)``: the step
scripts' calls and imports renamed, the wrappers and the save module's import inserted into utils.py and
taken out again, the save module written whole, the marker line. Each row is undone too: the inverse must give
the ``before`` bytes back. Pure bytes in, bytes out (milliseconds)."""

from __future__ import annotations

import re

import pytest

from patcher.errors import DsfixError
from patcher.patch.fixers.base import make_marker, parse_marker
from patcher.patch.template import module_bytes, module_version
from unitkit import ABOUT, END, MOD, UPSTREAM_SAVE, WRAPPERS, fix, is_patched, undo

MODULES = (MOD,)
V = module_version()

# ----------------------------------------------------------------------------- step scripts

RENAMES = [
    # (name, main.py before, after)
    ("bare call and its import",
     "from dschat.utils.utils import save_hf_format\nsave_hf_format(m, t, a)\n",
     "from dschat.utils.utils import save_hf_format_safetensors\nsave_hf_format_safetensors(m, t, a)\n"),
    ("one name among others in the import",
     "from dschat.utils.utils import print_rank_0, save_hf_format, to_device\nsave_hf_format(m, t, a)\n",
     "from dschat.utils.utils import print_rank_0, save_hf_format_safetensors, to_device\n"
     "save_hf_format_safetensors(m, t, a)\n"),
    ("parenthesised import with a comment, both saves",
     "from dschat.utils.utils import (\n    print_rank_0,\n    save_hf_format,  # the save\n"
     "    save_zero_three_model,\n)\n"
     "save_hf_format(m, t, a)\nsave_zero_three_model(m, r, d, zero_stage=3)\n",
     "from dschat.utils.utils import (\n    print_rank_0,\n    save_hf_format_safetensors,  # the save\n"
     "    save_zero_three_model_safetensors,\n)\n"
     "save_hf_format_safetensors(m, t, a)\nsave_zero_three_model_safetensors(m, r, d, zero_stage=3)\n"),
    ("the old name stored elsewhere is renamed too",
     "from dschat.utils.utils import save_hf_format\nf = save_hf_format\nsave_hf_format(m, t, a)\n",
     "from dschat.utils.utils import save_hf_format_safetensors\nf = save_hf_format_safetensors\n"
     "save_hf_format_safetensors(m, t, a)\n"),
    ("an import alias: the import is renamed, the call is not",
     "from dschat.utils.utils import save_hf_format, save_zero_three_model as save_z3\n"
     "save_z3(m, r, d)\nsave_hf_format(m, t, a)\n",
     "from dschat.utils.utils import save_hf_format_safetensors, save_zero_three_model_safetensors as save_z3\n"
     "save_z3(m, r, d)\nsave_hf_format_safetensors(m, t, a)\n"),
    ("a module alias: the attribute is renamed",
     "import dschat.utils.utils as u\nu.save_hf_format(m, t, a)\n",
     "import dschat.utils.utils as u\nu.save_hf_format_safetensors(m, t, a)\n"),
    ("the parent package imported",
     "from dschat.utils import utils\nutils.save_hf_format(m, t, a)\n",
     "from dschat.utils import utils\nutils.save_hf_format_safetensors(m, t, a)\n"),
    ("a call over several lines keeps its layout",
     "from dschat.utils.utils import save_hf_format\nsave_hf_format(\n    m,  # model\n    t, args)\n",
     "from dschat.utils.utils import save_hf_format_safetensors\n"
     "save_hf_format_safetensors(\n    m,  # model\n    t, args)\n"),
    ("nested in a loop and an if",
     "from dschat.utils.utils import save_hf_format\nfor i in range(2):\n    if i:\n"
     "        save_hf_format(m, t, a, sub_folder=str(i))\n",
     "from dschat.utils.utils import save_hf_format_safetensors\nfor i in range(2):\n    if i:\n"
     "        save_hf_format_safetensors(m, t, a, sub_folder=str(i))\n"),
    ("CRLF newlines stay",
     "from dschat.utils.utils import save_hf_format\r\nsave_hf_format(m, t, a)\r\n",
     "from dschat.utils.utils import save_hf_format_safetensors\r\nsave_hf_format_safetensors(m, t, a)\r\n"),
    ("a call in a default value",
     "from dschat.utils.utils import save_hf_format\ndef f(x=save_hf_format(m, t, a)):\n    pass\n",
     "from dschat.utils.utils import save_hf_format_safetensors\n"
     "def f(x=save_hf_format_safetensors(m, t, a)):\n    pass\n"),
    ("a shadowed name is left alone",
     "from dschat.utils.utils import save_hf_format\ndef g(save_hf_format):\n    save_hf_format(1)\n"
     "save_hf_format(m, t, a)\n",
     "from dschat.utils.utils import save_hf_format_safetensors\ndef g(save_hf_format):\n    save_hf_format(1)\n"
     "save_hf_format_safetensors(m, t, a)\n"),
    ("a latin-1 file stays latin-1",
     ("# -*- coding: latin-1 -*-\nfrom dschat.utils.utils import save_hf_format\n"
      "save_hf_format(m, 'é', a)\n").encode("latin-1"),
     "# -*- coding: latin-1 -*-\nfrom dschat.utils.utils import save_hf_format_safetensors\n"
     "save_hf_format_safetensors(m, 'é', a)\n".encode("latin-1")),
]




def _bytes(text) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


@pytest.mark.parametrize("before, after", [r[1:] for r in RENAMES], ids=[r[0] for r in RENAMES])
def test_rename_calls_and_imports(before, after):
    res = fix("script", _bytes(before))
    assert res.new == _bytes(after)
    assert undo("script", res.new) == _bytes(before)
    assert is_patched("script", res.new) and not is_patched("script", _bytes(before))
    assert fix("script", res.new).new == res.new, "a second patch changes nothing"


REFUSED_SCRIPTS = [
    # (main.py, what the refusal says, its line)
    ("import os\nprint(1)\n", "has no call of save_hf_format imported from the checkout's utils.py", None),
    ("from dschat.utils.utils import save_hf_format\nsave_hf_format(m)\n",
     "save_hf_format(...) does not bind to the checkout's own save_hf_format: it parameter tokenizer gets no value", 2),
    ("from dschat.utils.utils import save_hf_format\n\nsave_hf_format(m, t, a, bogus=1)\n",
     "it has no parameter bogus (passed by keyword)", 3),
]


@pytest.mark.parametrize("src, message, line", REFUSED_SCRIPTS, ids=[r[1][:40] for r in REFUSED_SCRIPTS])
def test_rename_refuses(src, message, line):
    with pytest.raises(DsfixError) as e:
        fix("script", src.encode())
    assert message in e.value.message and e.value.line == line


ROUTES = [
    # (main.py, what the refusal says, its line): after the renames, the script can still reach an original
    # save function by a route no rename covers, so dsfix refuses instead of leaving it (issue: a module
    # object passed on)
    ("import dschat.utils.utils as dsu\ndef finish(mod):\n    mod.save_hf_format(m, t, a)\n"
     "dsu.save_hf_format(m, t, a)\nfinish(dsu)\n", "uses the module dsu as a value", 5),
    ("import dschat.utils.utils as dsu\nSAVERS = {'u': dsu}\ndsu.save_hf_format(m, t, a)\n",
     "uses the module dsu as a value", 2),
    ("from dschat.utils import utils\nfrom dschat.utils.utils import save_hf_format\n"
     "save_hf_format(m, t, a)\nf = getattr(utils, name)\n", "uses the module utils as a value", 4),
    ("import dschat.utils.utils\ndschat.utils.utils.save_hf_format(m, t, a)\nkeep = dschat.utils\n",
     "uses the module dschat.utils as a value", 3),
    ("import importlib\nfrom dschat.utils.utils import save_hf_format\nsave_hf_format(m, t, a)\n"
     "u = importlib.import_module('dschat.utils.utils')\n", "names the module dschat.utils.utils in a string", 4),
]


@pytest.mark.parametrize("src, message, line", ROUTES, ids=[r[1][:30] + str(r[2]) for r in ROUTES])
def test_a_route_left_to_an_original_save_is_refused(src, message, line):
    with pytest.raises(DsfixError) as e:
        fix("script", src.encode())
    assert message in e.value.message and e.value.line == line and len(str(e.value)) <= 300


SAFE_ROUTES = [
    # the module used for its other names, a local of the same name, a package never holding the save
    "import dschat.utils.utils as u\nu.save_hf_format(m, t, a)\nu.print_rank_0('x')\n",
    "from dschat.utils.utils import save_hf_format\nsave_hf_format(m, t, a)\ndef f(utils):\n    return utils\n",
    "import dschat.data as d\nfrom dschat.utils.utils import save_hf_format\nsave_hf_format(m, t, a)\ng(d)\n",
    "import dschat.utils.utils as u\nu.VERBOSE = True\nu.save_hf_format(m, t, a)\n",
]


@pytest.mark.parametrize("src", SAFE_ROUTES)
def test_other_uses_of_the_module_are_fine(src):
    assert b"_safetensors(" in fix("script", src.encode()).new


WARNINGS = [
    # (main.py, warnings): a ZeRO-3 save with no save_hf_format beside it gives an output without config.json
    ("from dschat.utils.utils import save_zero_three_model\nsave_zero_three_model(m, r, d)\n",
     ["main.py:2: this save_zero_three_model call has no save_hf_format call beside it (same function or loop), "
      "so that output gets no config.json or tokenizer"]),
    ("from dschat.utils.utils import save_hf_format, save_zero_three_model\n"
     "def main():\n    save_hf_format(m, t, a)\n    save_zero_three_model(m, r, d)\n", []),
    ("from dschat.utils.utils import save_hf_format, save_zero_three_model\n"
     "def main():\n    save_hf_format(m, t, a)\n    for x in y:\n        save_zero_three_model(m, r, d)\n",
     ["main.py:5: this save_zero_three_model call has no save_hf_format call beside it (same function or loop), "
      "so that output gets no config.json or tokenizer"]),
]


@pytest.mark.parametrize("src, warnings", WARNINGS)
def test_zero3_save_without_a_config_save_warns(src, warnings):
    assert fix("script", src.encode()).warnings == warnings


# ----------------------------------------------------------------------------- utils.py

def _halved(text: str) -> str:
    """Every indentation halved: the file's own two-space indents."""
    return re.sub(r"(?m)^( +)", lambda m: " " * (len(m.group(1)) // 2), text)


MARK = f"# dsfix: template=v{V} strategy=clone {END}\n" + ABOUT
MARK_OS = f"# dsfix: template=v{V} strategy=clone added-imports=os {END}\n" + ABOUT
BLOCKS = [
    # (name, utils.py before, after): the save module's import after the file's last top-level import, the
    # wrappers right after save_hf_format, and the marker line recording what to take out again
    ("upstream",
     "import os\nimport torch\n\n\n" + UPSTREAM_SAVE + "\n\ndef other():\n    return 1\n",
     "import os\nimport torch\nfrom . import dsfix_safetensors\n\n\n" + UPSTREAM_SAVE + "\n\n" + MARK + WRAPPERS
     + "\n\ndef other():\n    return 1\n"),
    ("save_hf_format last",
     "import os\nimport torch\n\n\n" + UPSTREAM_SAVE,
     "import os\nimport torch\nfrom . import dsfix_safetensors\n\n\n" + UPSTREAM_SAVE + "\n\n" + MARK + WRAPPERS),
    ("a docstring and a __future__ import come first; os is added",
     '"""Utils."""\nfrom __future__ import annotations\n\n\n' + UPSTREAM_SAVE,
     '"""Utils."""\nfrom __future__ import annotations\nimport os\nfrom . import dsfix_safetensors\n\n\n'
     + UPSTREAM_SAVE + "\n\n" + MARK_OS + WRAPPERS),
    ("two-space indents and CRLF newlines",
     _halved("import os\n\n\n" + UPSTREAM_SAVE).replace("\n", "\r\n"),
     _halved("import os\nfrom . import dsfix_safetensors\n\n\n" + UPSTREAM_SAVE + "\n\n" + MARK + WRAPPERS)
     .replace("\n", "\r\n")),
    ("a file that ends without a newline",
     "import os\n\n\n" + UPSTREAM_SAVE.rstrip("\n"),
     "import os\nfrom . import dsfix_safetensors\n\n\n" + UPSTREAM_SAVE + "\n\n" + MARK + WRAPPERS.rstrip("\n")),
]


@pytest.mark.parametrize("before, after", [r[1:] for r in BLOCKS], ids=[r[0] for r in BLOCKS])
def test_insert_and_remove_the_wrappers(before, after):
    res = fix("utils", before.encode())
    assert res.new.decode() == after
    assert fix("utils", res.new).new == res.new  # applying again changes nothing
    assert undo("utils", res.new).decode() == before


IMPORT_FORMS = [
    # (the dotted names the scripts import utils.py under, the import of the save module)
    ((MOD,), "from . import dsfix_safetensors\n"),
    (("utils.utils", "training.utils.utils"), "from . import dsfix_safetensors\n"),
    (("utils",), "import dsfix_safetensors\n"),
    (("utils", "utils.utils"), "try:\n    from . import dsfix_safetensors\nexcept ImportError:  # utils.py imported "
                               "as a top-level module\n    import dsfix_safetensors\n"),
]


@pytest.mark.parametrize("modules, statement", IMPORT_FORMS)
def test_the_save_module_is_imported_as_utils_py_is(modules, statement):
    before = "import os\n\n\n" + UPSTREAM_SAVE
    new = fix("utils", before.encode(), modules).new.decode()
    assert new.startswith("import os\n" + statement + "\n\n")
    assert undo("utils", new.encode(), modules).decode() == before


def test_a_hand_written_fix_is_replaced_in_place_and_its_lone_import_dropped():
    hand = "def save_hf_format_safetensors(model, tokenizer, args):\n    json.dump(1)\n"
    before = "import json\nimport os\nimport torch\n\n\n" + UPSTREAM_SAVE + "\n\ndef other():\n    pass\n\n\n" + hand
    res = fix("utils", before.encode())
    assert res.new.decode() == (
        "import os\nimport torch\nfrom . import dsfix_safetensors\n\n\n" + UPSTREAM_SAVE + "\n\ndef other():\n"
        "    pass\n\n\n"
        f"# dsfix: template=v{V} strategy=clone replaced=save_hf_format_safetensors {END}\n" + ABOUT + WRAPPERS)
    assert "dropped the import of json, which only the replaced code used" in res.notes
    with pytest.raises(DsfixError) as e:  # without the state folder the hand-written text is gone
        undo("utils", res.new)
    assert e.value.code == 1 and "cannot be restored structurally" in e.value.message


def test_switching_strategy_rewrites_the_wrappers_where_they_stand():
    before = ("import os\nimport torch\n\n\n" + UPSTREAM_SAVE).encode()
    clone = fix("utils", before).new
    dedupe = fix("utils", clone, strategy="dedupe")
    assert dedupe.new == clone.replace(b'"clone"', b'"dedupe"').replace(b"strategy=clone", b"strategy=dedupe")
    assert dedupe.notes[0] == "updates dsfix's block: strategy clone -> dedupe"
    assert undo("utils", dedupe.new) == before


def test_no_save_hf_format_is_refused():
    with pytest.raises(DsfixError) as e:
        fix("utils", b"import os\n\n\ndef other():\n    pass\n")
    assert e.value.message == "has no top-level function save_hf_format to add the safetensors save beside"


# ----------------------------------------------------------------------------- the save module

OTHER = b"def helper():\n    pass\n"
OLD = b'"""dsfix\'s save module."""\nVERSION = 1\n'
NEWER = f'"""dsfix\'s save module."""\nVERSION = {V + 1}\n'.encode()
EDITED = module_bytes().replace(b"import os\n", b"import os  # mine\n", 1)
MODULE_CASES = [
    # (the file beside utils.py before apply, what apply makes of it: the module's bytes, or a refusal)
    (None, "new"),
    (module_bytes(), "unchanged"),
    (OLD, "upgraded"),
    (OTHER, "is not dsfix's save module"),
    (NEWER, "written by a newer dsfix"),
    (EDITED, "edited since apply"),
]


@pytest.mark.parametrize("before, outcome", MODULE_CASES, ids=[c[1][:20] for c in MODULE_CASES])
def test_the_save_module_is_written_whole(before, outcome):
    if outcome in ("new", "unchanged", "upgraded"):
        res = fix("module", before)
        assert res.new == module_bytes()
        assert bool(res.notes) is (outcome != "unchanged")
        assert undo("module", res.new) is None, "revert removes the file"
        return
    with pytest.raises(DsfixError) as e:
        fix("module", before)
    assert outcome in e.value.message


# ----------------------------------------------------------------------------- the marker line

MARKERS = [
    # (marker line, what it records)
    (f"# dsfix: template=v2 strategy=clone {END}", {"template": "v2", "strategy": "clone"}),
    (f"# dsfix: template=v2 strategy=dedupe added-imports=json,safetensors:safe_open {END}",
     {"template": "v2", "strategy": "dedupe", "added-imports": "json,safetensors:safe_open"}),
    ("#dsfix: template=v1 kind=loader", {"template": "v1", "kind": "loader"}),
    ("# dsfix: strategy=clone", None),  # no template version: not dsfix's
    ("# a comment", None),
]


@pytest.mark.parametrize("line, fields", MARKERS)
def test_parse_marker(line, fields):
    assert parse_marker(line) == fields


def test_make_marker_is_read_back():
    line = make_marker(4, {"strategy": "clone", "added-imports": "json,safetensors:safe_open", "replaced": ""})
    assert parse_marker(line) == {"template": "v4", "strategy": "clone", "added-imports": "json,safetensors:safe_open"}


# Every released save module, by its VERSION line: a change to templates/dsfix_safetensors.py must bump
# VERSION (so that `dsfix check` shows the upgrade on patched checkouts) and add its hash here.
RELEASED = {
    4: "db866332492e344d5cec2077d7191acebfb2509651851768eba7e82e43e37658",
    5: "d6979c1b9668ba3cfa583e82a1423c445ed983f1078d27ca647a0f804ec61e3b",
    6: "b46be8cf0c57f453e66212b9d4b253a6837e4b0896a9a8fad487eb74b901855a",
}


def test_the_save_modules_bytes_change_only_with_its_version():
    import hashlib

    digest = hashlib.sha256(module_bytes()).hexdigest()
    assert V in RELEASED, f"VERSION = {V} is not recorded in RELEASED"
    assert RELEASED[V] == digest, (f"templates/dsfix_safetensors.py changed under VERSION = {V}: bump VERSION and "
                                   f"record {digest}")
