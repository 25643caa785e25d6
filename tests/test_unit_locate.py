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


TOP_UTILS = {"utils/__init__.py": "", "utils/utils.py": SAVE}
TOP_CALL = ("import os, sys\nsys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n"
            "from utils.utils import save_hf_format\nsave_hf_format(m, t, a)\n")


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
    # no step1_supervised_finetuning/main.py: the one script that calls the save functions is step 1
    ("the one script that saves, at the top beside utils/", {**TOP_UTILS, "sft_train.py": TOP_CALL}, ".",
     (".", "fork", "utils/utils.py", "sft_train.py", "utils.utils")),
    ("the one script that saves, the save functions in another module; one that saves nothing beside it",
     {"training/utils/__init__.py": "", "training/utils/model/__init__.py": "",
      "training/utils/model/save_utils.py": SAVE, "training/utils/utils.py": "def print_rank_0(m):\n    print(m)\n",
      "training/train_rag.py": "from utils.model.save_utils import save_hf_format\nsave_hf_format(m, t, a)\n",
      "training/evaluate.py": "from utils.utils import print_rank_0\nprint_rank_0(1)\n"}, ".",
     (".", "fork", "training/utils/model/save_utils.py", "training/train_rag.py", "utils.model.save_utils")),
    ("step 2's script is no candidate for step 1",
     {**TOP_UTILS, "run.py": TOP_CALL, "step2_reward_model_finetuning/main.py": TOP_CALL}, ".",
     (".", "fork", "utils/utils.py", "run.py", "utils.utils")),
    ("package layout, step 1 named otherwise: the one script that saves",
     {**{k: v for k, v in PACKAGE.items() if k != STEP1}, "training/step1_supervised_finetuning/sft.py": PKG_MAIN}, ".",
     (".", "package", "dschat/utils/utils.py", "training/step1_supervised_finetuning/sft.py", "dschat.utils.utils")),
    ("of two that save, the one whose name says sft", {**TOP_UTILS, "sft.py": TOP_CALL, "dpo.py": TOP_CALL}, ".",
     (".", "fork", "utils/utils.py", "sft.py", "utils.utils")),
    ("of three that save, the one in a folder whose name says supervised",
     {**TOP_UTILS, "supervised/train.py": TOP_CALL, "rlhf/ppo.py": TOP_CALL, "rlhf/reward.py": TOP_CALL}, ".",
     (".", "fork", "utils/utils.py", "supervised/train.py", "utils.utils")),
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
    ("two scripts that save, neither named for supervised fine-tuning",
     {**TOP_UTILS, "main.py": TOP_CALL, "mainSingle.py": TOP_CALL}, ".",
     "for a script that calls save_hf_format, pass --main main.py or --main mainSingle.py"),
    ("two scripts that save, both named for it", {**TOP_UTILS, "sft_lora.py": TOP_CALL, "sft_full.py": TOP_CALL}, ".",
     "pass --main sft_full.py or --main sft_lora.py"),
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
    write(tmp_path, {"utils/__init__.py": "", "utils/utils.py": SAVE, "run.py": TOP_CALL,
                     "sft_train.py": "from utils.utils import save_hf_format\nsave_hf_format(m, t, a)\n"})
    co = find_checkout(tmp_path)  # the name says supervised fine-tuning
    assert co.rel(co.step_mains[1]) == "sft_train.py"
    assert any(n.startswith("step 1: sft_train.py, of 2 scripts") and "--main run.py picks another" in n
               for n in co.notes), co.notes
    (tmp_path / "sft_train.py").rename(tmp_path / "train.py")
    with pytest.raises(DsfixError) as e:
        find_checkout(tmp_path)
    assert "no DeepSpeed-Chat checkout" in e.value.message and "--main train.py" in e.value.message
    co = find_checkout(tmp_path, main=tmp_path / "train.py")
    assert (co.layout, co.rel(co.utils_path), co.rel(co.step_mains[1])) == ("fork", "utils/utils.py", "train.py")
