"""Finding step 1 by itself, --main and --script relative to the checkout first, and the options a later run
takes from the state folder: table tests on small checkouts written here (no subprocess, no libcst)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from patcher.errors import DsfixError
from patcher.patch import flow, plan, state
from patcher.patch.locate import find_checkout

UTILS = 'def save_hf_format(model, tokenizer, args, sub_folder=""):\n    pass\n'
PKG = {"dschat/__init__.py": "", "dschat/utils/__init__.py": "", "dschat/utils/utils.py": UTILS}
TOP_UTILS = {"utils/__init__.py": "", "utils/utils.py": UTILS}
FROM_PKG = "from dschat.utils.utils import save_hf_format\n\nsave_hf_format(None, None, None)\n"
FROM_PARENT = ("import os\nimport sys\n\nsys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), "
               "os.path.pardir)))\nfrom utils.utils import save_hf_format\n\nsave_hf_format(None, None, None)\n")
NO_SAVE = "print('a step-1 script that saves nothing')\n"
S1 = "step1_supervised_finetuning/main.py"


def write(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


# (id, files, folder dsfix runs on, --main, the checkout found (relative to tmp), step 1 found, a note's words)
FOUND = [
    ("upstream", {**PKG, f"training/{S1}": FROM_PKG}, "co", None, "co", f"training/{S1}", None),
    ("at the root", {**TOP_UTILS, S1: FROM_PARENT}, "co", None, "co", S1, f"using {S1}, the one"),
    ("under training_model", {**PKG, f"training_model/{S1}": FROM_PKG}, "co", None, "co", f"training_model/{S1}",
     f"using training_model/{S1}"),
    ("its own utils beside it", {"tm/utils/__init__.py": "", "tm/utils/utils.py": UTILS, f"tm/{S1}": FROM_PARENT},
     "co", None, "co", f"tm/{S1}", f"using tm/{S1}"),
    ("deep", {**PKG, f"a/b/c/d/{S1}": FROM_PKG}, "co", None, "co", f"a/b/c/d/{S1}", "using a/b/c/d/"),
    ("one saves, one does not", {**PKG, f"x/{S1}": FROM_PKG, f"y/{S1}": NO_SAVE}, "co", None, "co", f"x/{S1}",
     f"using x/{S1}"),
    ("run from inside step 1", {**TOP_UTILS, S1: FROM_PARENT}, "co/step1_supervised_finetuning", None, "co", S1,
     "using"),
    ("--main relative to the checkout", {**PKG, f"x/{S1}": FROM_PKG, f"y/{S1}": FROM_PKG}, "co", f"y/{S1}", "co",
     f"y/{S1}", f"--main y/{S1}: found relative to the checkout"),
    ("--main beats the search", {**PKG, f"x/{S1}": FROM_PKG, "sft.py": FROM_PKG}, "co", "sft.py", "co", "sft.py",
     "--main sft.py: found relative to the checkout"),
    ("a script at the top", {**TOP_UTILS, "sft.py": FROM_PKG.replace("dschat.", "")}, "co", "sft.py", "co", "sft.py",
     "--main sft.py: found relative to the checkout"),
]


@pytest.mark.parametrize("name, files, at, main, root, step1, note", FOUND, ids=[r[0] for r in FOUND])
def test_step1_is_found(tmp_path, monkeypatch, name, files, at, main, root, step1, note):
    write(tmp_path / "co", files)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # --main is taken relative to the checkout first
    co = find_checkout(tmp_path / at, main)
    assert co.root == tmp_path / root
    assert co.rel(co.step_mains[1]) == step1
    notes = " | ".join(co.notes)
    if note is None:
        assert "using" not in notes and "found relative" not in notes, notes
    else:
        assert note in notes, notes
    assert all(len(n) <= 300 for n in co.notes), co.notes


def _mains(n: int) -> dict:
    return {f"v{i}/{S1}": FROM_PKG for i in range(n)}


# (id, files, --main, words the one line must hold)
REFUSED = [
    ("two step-1 scripts", {**PKG, **_mains(2)}, None,
     [f"2 step-1 scripts named {S1} and none at training/{S1}", f"--main v0/{S1} or --main v1/{S1}"]),
    ("five: the list is cut", {**PKG, **_mains(5)}, None, [f"--main v2/{S1} and 2 more"]),
    ("a folder with a space", {**PKG, f"my runs/{S1}": FROM_PKG, f"v/{S1}": FROM_PKG}, None,
     [f"--main 'my runs/{S1}' or --main v/{S1}"]),
    ("two other names need --main", {**PKG, "training/step1_supervised_finetuning/sft.py": FROM_PKG,
                                     "training/step1_supervised_finetuning/sft_lora.py": FROM_PKG}, None,
     ["no training/step1_supervised_finetuning/main.py", "--main training/step1_supervised_finetuning/sft.py or "
      "--main training/step1_supervised_finetuning/sft_lora.py"]),
    ("no checkout, two scripts", {"a.py": FROM_PKG, "b.py": FROM_PKG}, None,
     ["no DeepSpeed-Chat checkout here or above", "--main a.py or --main b.py"]),
    ("no checkout, no script", {"a.py": NO_SAVE}, None,
     ["no DeepSpeed-Chat checkout", "name the step-1 script with --main"]),
    ("--main that is nowhere", {**PKG, f"training/{S1}": FROM_PKG}, "nowhere.py",
     ["--main: no such file in the checkout or the current folder"]),
    ("several folders below", {f"c{i}/training/{S1}": FROM_PKG for i in range(5)} | {
        f"c{i}/dschat/utils/utils.py": UTILS for i in range(5)}, None,
     ["5 DeepSpeed-Chat folders below this one (c0, c1, c2 and 2 more)"]),
]


@pytest.mark.parametrize("name, files, main, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_refusal_is_one_short_line(tmp_path, monkeypatch, name, files, main, words):
    write(tmp_path / "co", files)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DsfixError) as e:
        find_checkout("co", main)
    line = str(e.value)
    assert "\n" not in line and len(line) <= 300, line
    assert str(tmp_path) not in line, "paths relative to the checkout or to where dsfix runs"
    for w in words:
        assert w in line, (w, line)


def test_every_candidate_is_in_the_detail(tmp_path):
    write(tmp_path, {**PKG, **_mains(7)})
    with pytest.raises(DsfixError) as e:
        find_checkout(tmp_path)
    assert "and 4 more" in e.value.message
    assert list(e.value.detail) == [f"--main v{i}/{S1}" for i in range(7)]


def test_main_relative_to_the_current_folder_when_not_in_the_checkout(tmp_path, monkeypatch):
    write(tmp_path / "co", {**PKG, f"training/{S1}": FROM_PKG, "training/step1_supervised_finetuning/sft.py": FROM_PKG})
    monkeypatch.chdir(tmp_path / "co" / "training")
    co = find_checkout(tmp_path / "co", "step1_supervised_finetuning/sft.py")
    assert co.rel(co.step_mains[1]) == "training/step1_supervised_finetuning/sft.py"
    assert ("--main step1_supervised_finetuning/sft.py: is training/step1_supervised_finetuning/sft.py, found "
            "relative to the current folder") in co.notes
    write(tmp_path / "co", {"step1_supervised_finetuning/sft.py": FROM_PKG})  # now the checkout has one too
    co = find_checkout(tmp_path / "co", "step1_supervised_finetuning/sft.py")
    assert co.rel(co.step_mains[1]) == "step1_supervised_finetuning/sft.py", "the checkout's wins"
    assert ("--main step1_supervised_finetuning/sft.py: found relative to the checkout, not "
            "step1_supervised_finetuning/sft.py in the current folder") in co.notes


def test_script_relative_to_the_checkout(tmp_path, monkeypatch):
    write(tmp_path / "co",
          {**PKG, f"training/{S1}": FROM_PKG, "training/step1_supervised_finetuning/lora.py": FROM_PKG})
    monkeypatch.chdir(tmp_path)
    co = find_checkout("co", scripts=["training/step1_supervised_finetuning/lora.py"])
    assert [co.rel(s) for s in co.scripts] == ["training/step1_supervised_finetuning/lora.py"]


# ----------------------------------------------------------------------------- the options a run uses

ENTRY = {"original_sha256": "0", "patched_sha256": "1", "modules": []}


def _state(root: Path, record: dict) -> None:
    (root / ".dsfix").mkdir(parents=True)
    (root / ".dsfix" / "state.json").write_text(json.dumps({"state_version": 2, **record}))


# (id, state.json beyond its version (None: no state folder), marker in utils.py, --strategy, --steps,
#  the strategy and steps the run uses)
OPTIONS = [
    ("nothing recorded", None, "", None, None, "clone", (1,)),
    ("recorded", {"strategy": "dedupe", "steps": [1, 2], "files": {}}, "", None, None, "dedupe", (1, 2)),
    ("given beats recorded", {"strategy": "dedupe", "steps": [1, 2, 3], "files": {}}, "", "clone", (1,),
     "clone", (1,)),
    ("steps given, strategy recorded", {"strategy": "dedupe", "steps": [1], "files": {}}, "", None, (1, 2),
     "dedupe", (1, 2)),
    ("an older state folder: per file", {"files": {"dschat/utils/utils.py": {**ENTRY, "role": "utils",
                                                                             "strategy": "dedupe"},
                                                   "a/main.py": {**ENTRY, "role": "step1"},
                                                   "b/main.py": {**ENTRY, "role": "step3"}}},
     "", None, None, "dedupe", (1, 3)),
    ("no state folder: the marker line", None, "# dsfix: template=v2 strategy=dedupe -- inserted by dsfix\n",
     None, None, "dedupe", (1,)),
    ("the state folder beats the marker", {"strategy": "clone", "steps": [1], "files": {}},
     "# dsfix: template=v2 strategy=dedupe -- inserted by dsfix\n", None, None, "clone", (1,)),
    ("a state folder it cannot read", "{not json", "", None, None, "clone", (1,)),
]


@pytest.mark.parametrize("name, record, marker, strategy, steps, want_strategy, want_steps", OPTIONS,
                         ids=[r[0] for r in OPTIONS])
def test_options_come_from_the_state_folder(tmp_path, name, record, marker, strategy, steps, want_strategy,
                                            want_steps):
    write(tmp_path, {**PKG, "dschat/utils/utils.py": marker + UTILS, f"training/{S1}": FROM_PKG})
    if isinstance(record, dict):
        _state(tmp_path, record)
    elif isinstance(record, str):
        (tmp_path / ".dsfix").mkdir()
        (tmp_path / ".dsfix" / "state.json").write_text(record)
    co = find_checkout(tmp_path)
    opts = flow.options(co, strategy, steps)
    assert (opts.strategy, opts.steps) == (want_strategy, want_steps)


def test_the_state_folder_round_trips_the_options(tmp_path):
    saved = plan.Saved({}, {}, "a/main.py", ("a/lora.py",), "dedupe", (1, 2))
    state.commit(tmp_path, [], saved)
    rec = state.record_at(tmp_path)
    assert (rec.main, rec.scripts, rec.strategy, rec.steps) == ("a/main.py", ("a/lora.py",), "dedupe", (1, 2))
    loaded = state.load(tmp_path)
    assert (loaded.main, loaded.scripts, loaded.strategy, loaded.steps) == ("a/main.py", ("a/lora.py",), "dedupe",
                                                                            (1, 2))
    assert state.recorded(tmp_path / ".dsfix").root == tmp_path, "found from a folder inside"


# (id, roles recorded, --steps, the files restored)
LEFT_OUT = [
    ("same steps", {"u": "utils", "s1": "step1", "s2": "step2", "l": "loader"}, (1, 2), []),
    ("step 2 left out", {"u": "utils", "s1": "step1", "s2": "step2", "l": "loader"}, (1,), ["l", "s2"]),
    ("step 3 left out, 2 kept", {"u": "utils", "s1": "step1", "s2": "step2", "s3": "step3", "l": "loader"}, (1, 2),
     ["s3"]),
    ("step 1 left out", {"u": "utils", "s1": "step1", "x": "step1", "s2": "step2"}, (2,), ["s1", "x"]),
    ("utils.py always stays", {"u": "utils"}, (2,), []),
]


@pytest.mark.parametrize("name, roles, steps, want", LEFT_OUT, ids=[r[0] for r in LEFT_OUT])
def test_files_of_steps_left_out(name, roles, steps, want):
    saved = plan.Saved({rel: {**ENTRY, "role": role} for rel, role in roles.items()}, {})
    assert plan.left_out(saved, steps) == want
    assert plan.left_out(None, steps) == []


def test_nothing_outside_state_py_reads_the_state_folder():
    import patcher

    pkg = Path(patcher.__file__).parent
    words = ("state.json", '/ ".dsfix"', '".dsfix" /', ".dsfix.old", "STATE_DIR")
    readers = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")
               if p.name != "state.py"
               and any(w in p.read_text().replace("trainer_state.json", "") for w in words)]  # the Trainer's file
    assert readers == [], readers
    assert os.path.basename(state.__file__) == "state.py"
