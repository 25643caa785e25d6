"""Table tests of patcher.patch.locate.find_checkout: from a folder given on the command line to the step-1
script and the utils.py it really imports. Each row is a small file tree (a few lines a file), where dsfix
starts, and what it finds. The trees are written to a temporary folder; nothing else runs (milliseconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from patcher.errors import DsfixError
from patcher.patch.locate import find_checkout

STEP1 = "training/step1_supervised_finetuning/main.py"
SAVE = "import os\n\n\ndef save_hf_format(model, tokenizer, args):\n    os.makedirs(args.output_dir)\n"
PKG_MAIN = "from dschat.utils.utils import save_hf_format\nsave_hf_format(m, t, a)\n"
LEGACY_MAIN = ("import os, sys\n"
               "sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))\n"
               "from utils.utils import save_hf_format\nsave_hf_format(m, t, a)\n")
PACKAGE = {"dschat/__init__.py": "", "dschat/utils/__init__.py": "", "dschat/utils/utils.py": SAVE, STEP1: PKG_MAIN}
LEGACY = {"training/utils/__init__.py": "", "training/utils/utils.py": SAVE, STEP1: LEGACY_MAIN}


def under(prefix: str, files: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in files.items()}


FOUND = [
    # (name, files, where dsfix starts, (root, layout, utils.py, step-1 script, the module step 1 imports))
    ("package layout, from the root", PACKAGE, ".",
     (".", "package", "dschat/utils/utils.py", STEP1, "dschat.utils.utils")),
    ("package layout, from the step-1 folder", PACKAGE, "training/step1_supervised_finetuning",
     (".", "package", "dschat/utils/utils.py", STEP1, "dschat.utils.utils")),
    ("legacy layout (training/utils)", LEGACY, ".",
     (".", "legacy", "training/utils/utils.py", STEP1, "utils.utils")),
    ("a DeepSpeedExamples clone: applications/DeepSpeed-Chat", under("applications/DeepSpeed-Chat", PACKAGE), ".",
     ("applications/DeepSpeed-Chat", "package", "dschat/utils/utils.py", STEP1, "dschat.utils.utils")),
    ("one DeepSpeed-Chat folder a few levels down", under("src/chat", PACKAGE), ".",
     ("src/chat", "package", "dschat/utils/utils.py", STEP1, "dschat.utils.utils")),
    ("step 1 imports a utils.py of its own, which shadows dschat's",
     {**PACKAGE, "training/step1_supervised_finetuning/dschat/__init__.py": "",
      "training/step1_supervised_finetuning/dschat/utils/__init__.py": "",
      "training/step1_supervised_finetuning/dschat/utils/utils.py": SAVE}, ".",
     (".", "fork", "training/step1_supervised_finetuning/dschat/utils/utils.py", STEP1, "dschat.utils.utils")),
    ("a module alias of the utils module",
     {**PACKAGE, STEP1: "import dschat.utils.utils as u\nu.save_hf_format(m, t, a)\n"}, ".",
     (".", "package", "dschat/utils/utils.py", STEP1, "dschat.utils.utils")),
]


def write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files, start, expected", [r[1:] for r in FOUND], ids=[r[0] for r in FOUND])
def test_find_checkout(tmp_path, files, start, expected):
    write(tmp_path, files)
    co = find_checkout(tmp_path / start)
    root = co.root.relative_to(tmp_path.resolve()).as_posix() or "."
    assert (root, co.layout, co.rel(co.utils_path), co.rel(co.step_mains[1]), co.utils_module) == expected


REFUSED = [
    # (name, files, where dsfix starts, what the error says)
    ("no checkout at all", {"README.md": "hello\n"}, ".", "no DeepSpeed-Chat checkout here or above"),
    ("utils.py but no step-1 main.py", {k: v for k, v in PACKAGE.items() if k != STEP1}, ".",
     "no training/step1_supervised_finetuning/main.py and no other step1_supervised_finetuning/main.py that "
     "calls the save functions"),
    ("several DeepSpeed-Chat folders below", {**under("a", PACKAGE), **under("b", PACKAGE)}, ".",
     "2 DeepSpeed-Chat folders below this one (a, b); run dsfix on one of them"),
    ("step 1 imports no save function", {**PACKAGE, STEP1: "import os\nprint(os.sep)\n"}, ".",
     "imports neither save_hf_format nor a module that defines it"),
    ("step 1 imports a module that is not there", {**PACKAGE, STEP1: "from nowhere.utils import save_hf_format\n"},
     ".", "main.py:1: no import resolves to a utils.py that defines save_hf_format: nowhere.utils"),
    ("step 1 does not parse", {**PACKAGE, STEP1: "def (:\n"}, ".", "main.py:1: does not parse: invalid syntax"),
    ("a file where a folder goes", PACKAGE, STEP1, "main.py: is a file, not a folder; pass the folder that holds it"),
]


@pytest.mark.parametrize("files, start, message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_find_checkout_refuses(tmp_path, files, start, message):
    write(tmp_path, files)
    with pytest.raises(DsfixError) as e:
        find_checkout(tmp_path / start)
    assert message in str(e.value)


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(DsfixError) as e:
        find_checkout(tmp_path / "nope")
    assert e.value.message.startswith("no such file or folder") and str(tmp_path / "nope") in str(e.value)


def test_main_names_the_step1_script_of_a_layout_without_one(tmp_path):
    write(tmp_path, {"utils/__init__.py": "", "utils/utils.py": SAVE,
                     "sft_train.py": "from utils.utils import save_hf_format\nsave_hf_format(m, t, a)\n"})
    with pytest.raises(DsfixError) as e:
        find_checkout(tmp_path)
    assert "no DeepSpeed-Chat checkout" in e.value.message and "sft_train.py" in e.value.message
    co = find_checkout(tmp_path, main=tmp_path / "sft_train.py")
    assert (co.layout, co.rel(co.utils_path), co.rel(co.step_mains[1])) == ("fork", "utils/utils.py", "sft_train.py")
