"""Table tests of patcher.patch.transforms, in the style of a codemod's ``(before, after)``: renaming the save
calls and imports in a script, inserting and removing dsfix's block in utils.py, and the marker line. Each
row is undone too: the inverse must give the ``before`` bytes back. Pure text in, text out (milliseconds)."""

from __future__ import annotations

import pytest

from patcher.errors import DsfixError
from patcher.patch import plan, signature, template, transforms
from unitkit import BLOCK, END, UPSTREAM_SAVE, stand_in

MODULES = ("dschat.utils.utils",)
DEFS = {n: signature.default_def(n) for n in ("save_hf_format", "save_zero_three_model")}  # upstream's

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
     "from dschat.utils.utils import (\n    print_rank_0,\n    save_hf_format,  # the save\n    save_zero_three_model,\n)\n"
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
     "from dschat.utils.utils import save_hf_format_safetensors\nsave_hf_format_safetensors(\n    m,  # model\n    t, args)\n"),
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
     "from dschat.utils.utils import save_hf_format_safetensors\ndef f(x=save_hf_format_safetensors(m, t, a)):\n    pass\n"),
    ("a shadowed name is left alone",
     "from dschat.utils.utils import save_hf_format\ndef g(save_hf_format):\n    save_hf_format(1)\n"
     "save_hf_format(m, t, a)\n",
     "from dschat.utils.utils import save_hf_format_safetensors\ndef g(save_hf_format):\n    save_hf_format(1)\n"
     "save_hf_format_safetensors(m, t, a)\n"),
    ("a latin-1 file stays latin-1",
     "# -*- coding: latin-1 -*-\nfrom dschat.utils.utils import save_hf_format\nsave_hf_format(m, 'é', a)\n".encode("latin-1"),
     "# -*- coding: latin-1 -*-\nfrom dschat.utils.utils import save_hf_format_safetensors\n"
     "save_hf_format_safetensors(m, 'é', a)\n".encode("latin-1")),
]


def _bytes(text) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


@pytest.mark.parametrize("before, after", [r[1:] for r in RENAMES], ids=[r[0] for r in RENAMES])
def test_rename_calls_and_imports(before, after):
    res = transforms.patch_main(_bytes(before), MODULES, DEFS)
    assert res.new == _bytes(after)
    assert transforms.unpatch_main(res.new, MODULES).new == _bytes(before)
    assert transforms.main_is_patched(res.new, MODULES) and not transforms.main_is_patched(_bytes(before), MODULES)


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
        transforms.patch_main(src.encode(), MODULES, DEFS)
    assert message in e.value.message and e.value.line == line


WARNINGS = [
    # (main.py, warnings): a ZeRO-3 save with no save_hf_format beside it gives an output without config.json
    ("from dschat.utils.utils import save_zero_three_model\nsave_zero_three_model(m, r, d)\n",
     ["2: this save_zero_three_model call has no save_hf_format call beside it (same function or loop), "
      "so that output gets no config.json or tokenizer"]),
    ("from dschat.utils.utils import save_hf_format, save_zero_three_model\n"
     "def main():\n    save_hf_format(m, t, a)\n    save_zero_three_model(m, r, d)\n", []),
    ("from dschat.utils.utils import save_hf_format, save_zero_three_model\n"
     "def main():\n    save_hf_format(m, t, a)\n    for x in y:\n        save_zero_three_model(m, r, d)\n",
     ["5: this save_zero_three_model call has no save_hf_format call beside it (same function or loop), "
      "so that output gets no config.json or tokenizer"]),
]


@pytest.mark.parametrize("src, warnings", WARNINGS)
def test_zero3_save_without_a_config_save_warns(src, warnings):
    assert transforms.patch_main(src.encode(), MODULES, DEFS).warnings == warnings


# ----------------------------------------------------------------------------- inserting and removing the block

BLOCKS = [
    # (name, utils.py before, after): the block goes right after save_hf_format, the template's imports that
    # the file lacks after its last top-level import, and the marker line records what to take out again
    ("upstream",
     "import os\nimport torch\n\n\n" + UPSTREAM_SAVE + "\n\ndef other():\n    return 1\n",
     "import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE + "\n\n"
     f"# dsfix: template=v7 strategy=clone added-imports=safetensors:safe_open {END}\n" + BLOCK
     + "\n\ndef other():\n    return 1\n"),
    ("every import already there, save_hf_format last",
     "import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE,
     "import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE + "\n\n"
     f"# dsfix: template=v7 strategy=clone {END}\n" + BLOCK),
    ("a docstring and a __future__ import come first",
     '"""Utils."""\nfrom __future__ import annotations\n\n\n' + UPSTREAM_SAVE,
     '"""Utils."""\nfrom __future__ import annotations\nimport os\nimport torch\nfrom safetensors import safe_open\n'
     "\n\n" + UPSTREAM_SAVE + "\n\n"
     f"# dsfix: template=v7 strategy=clone added-imports=os,torch,safetensors:safe_open {END}\n" + BLOCK),
    ("two-space indents and CRLF newlines",
     ("import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE).replace("\n    ", "\n  ")
     .replace("\n", "\r\n"),
     ("import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE + "\n\n"
      f"# dsfix: template=v7 strategy=clone {END}\n" + BLOCK).replace("\n    ", "\n  ").replace("\n", "\r\n")),
    ("a file that ends without a newline",
     "import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE.rstrip("\n"),
     "import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE + "\n\n"
     f"# dsfix: template=v7 strategy=clone {END}\n" + BLOCK.rstrip("\n")),
]


def patched(before: bytes, strategy: str = "clone") -> transforms.UtilsResult:
    return transforms.patch_utils(before, plan.parse(before, "utils.py"), stand_in(strategy), strategy, "utils.py")


@pytest.mark.parametrize("before, after", [r[1:] for r in BLOCKS], ids=[r[0] for r in BLOCKS])
def test_insert_and_remove_the_block(before, after):
    res = patched(before.encode())
    assert res.new.decode() == after
    assert patched(res.new).new == res.new  # applying again changes nothing
    assert transforms.unpatch_utils(plan.parse(res.new, "utils.py")).code == before


def test_a_hand_written_fix_is_replaced_in_place_and_its_lone_import_dropped():
    hand = "def save_hf_format_safetensors(model, tokenizer, args):\n    json.dump(1)\n"
    before = "import json\nimport os\nimport torch\n\n\n" + UPSTREAM_SAVE + "\n\ndef other():\n    pass\n\n\n" + hand
    res = patched(before.encode())
    assert res.new.decode() == (
        "import os\nimport torch\nfrom safetensors import safe_open\n\n\n" + UPSTREAM_SAVE + "\n\ndef other():\n"
        "    pass\n\n\n"
        f"# dsfix: template=v7 strategy=clone added-imports=safetensors:safe_open replaced=save_hf_format_safetensors {END}\n"
        + BLOCK)
    assert "dropped the import of json, which only the replaced code used" in res.notes
    with pytest.raises(DsfixError) as e:  # without the state folder the hand-written text is gone
        transforms.unpatch_utils(plan.parse(res.new, "utils.py"))
    assert e.value.code == 1 and "cannot be restored structurally" in e.value.message


def test_switching_strategy_rewrites_the_block_where_it_stands():
    before = ("import os\nimport torch\n\n\n" + UPSTREAM_SAVE).encode()
    clone = patched(before).new
    dedupe = patched(clone, "dedupe")
    assert dedupe.new == clone.replace(b'"clone"', b'"dedupe"').replace(b"strategy=clone", b"strategy=dedupe")
    assert dedupe.notes[0] == "updates dsfix's block: strategy clone -> dedupe"
    assert transforms.unpatch_utils(plan.parse(dedupe.new, "utils.py")).code.encode() == before


def test_no_save_hf_format_is_refused():
    with pytest.raises(DsfixError) as e:
        patched(b"import os\n\n\ndef other():\n    pass\n")
    assert e.value.message == "has no top-level function save_hf_format to add the safetensors save beside"


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
    assert transforms.parse_marker(line) == fields


def test_make_marker_is_read_back():
    line = transforms.make_marker(3, "clone", [template.ImportSpec("json"), template.ImportSpec("safetensors", "safe_open")],
                                  ["save_hf_format_safetensors"])
    assert transforms.parse_marker(line) == {"template": "v3", "strategy": "clone",
                                             "added-imports": "json,safetensors:safe_open",
                                             "replaced": "save_hf_format_safetensors"}
