"""check -> git apply == apply -> check 0 -> apply no-op -> revert byte-exact, on every fixture checkout."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from patcher.patch.template import load_template
from patchkit import FIXTURES, cli, copy_fixture, git_apply, pyflakes_messages, run, snapshot

CHECKOUTS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and not (p / "FIXTURE.json").exists())


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKOUTS)
def test_full_cycle_in_process(tmp_path, name):
    co = copy_fixture(name, tmp_path / "a")
    twin = copy_fixture(name, tmp_path / "b")
    before = snapshot(co)

    code, diff, _ = cli("check", ".", cwd=co)
    assert code == 1 and diff.startswith(b"diff --git a/")
    assert snapshot(co) == before, "check must write nothing"

    git_apply(diff, twin)  # the diff check prints applies with git apply ...
    code, _, _ = cli("apply", co)
    assert code == 0
    after = snapshot(co)
    for rel, data in snapshot(twin).items():  # ... and gives byte for byte what apply writes
        assert after[rel] == data, rel
    assert (co / ".dsfix" / ".gitignore").read_bytes().endswith(b"*\n")

    for rel in before:
        if rel.endswith(".py") and before[rel] != after[rel]:
            assert pyflakes_messages(after[rel]) <= pyflakes_messages(before[rel]), rel

    assert cli("check", co)[0] == 0
    assert cli("apply", co)[0] == 0
    assert {k: v for k, v in snapshot(co).items() if not k.startswith(".dsfix")} == {
        k: v for k, v in after.items() if not k.startswith(".dsfix")
    }
    code, _, _ = cli("revert", co)
    assert code == 0
    assert snapshot(co) == before, "revert restores every byte and removes the state folder"
    assert cli("revert", co)[0] == 0  # nothing to revert


@pytest.mark.slow
def test_full_cycle_subprocess_from_inside_a_subfolder(tmp_path):
    """A real process, run from a folder deep inside a DeepSpeedExamples-shaped checkout."""
    def make(top):
        chat = top / "DeepSpeedExamples" / "applications" / "DeepSpeed-Chat"
        chat.parent.mkdir(parents=True)
        shutil.copytree(FIXTURES / "package", chat)
        return top / "DeepSpeedExamples", chat / "training" / "step1_supervised_finetuning"

    root, inner = make(tmp_path / "a")
    twin, _ = make(tmp_path / "b")
    before = snapshot(root)

    p = run("check", cwd=inner)
    assert p.returncode == 1, p.stderr
    assert b"--- a/main.py" in p.stdout  # paths relative to the current folder
    p = run("check", cwd=root)
    assert b"--- a/applications/DeepSpeed-Chat/dschat/utils/utils.py" in p.stdout
    git_apply(p.stdout, twin)

    p = run("apply", "--json", cwd=inner)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["layout"] == "package" and {f["status"] for f in result["files"]} == {"changed"}
    got = {k: v for k, v in snapshot(root).items() if "/.dsfix/" not in k}
    assert got == snapshot(twin)
    assert run("check", cwd=root).returncode == 0
    p = run("revert", root)
    assert p.returncode == 0, p.stderr
    assert snapshot(root) == before


@pytest.mark.slow
def test_stdout_carries_only_the_diff_and_stderr_the_messages(tmp_path):
    co = copy_fixture("package", tmp_path)
    p = run("check", co, cwd=tmp_path)
    assert p.stdout.startswith(b"diff --git ") and b"would change" not in p.stdout
    assert b"2 files would change" in p.stderr
    assert b"\x1b[" not in p.stderr  # no colour off a TTY
    p = run("check", "--json", co)
    data = json.loads(p.stdout)
    assert data["exit_code"] == 1 and data["verb"] == "check"


@pytest.mark.slow
def test_module_and_console_script_are_the_same_program(tmp_path):
    exe = shutil.which("dsfix")
    if exe is None:
        pytest.skip("dsfix console script not installed")
    co = copy_fixture("legacy", tmp_path)
    p = subprocess.run([exe, "check", str(co)], capture_output=True)
    assert p.returncode == 1 and p.stdout == run("check", co).stdout


@pytest.mark.slow
def test_strategy_dedupe_and_switching_strategy_upgrades_in_place(tmp_path):
    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    assert cli("apply", co, "--strategy", "dedupe")[0] == 0
    utils = (co / "dschat/utils/utils.py").read_bytes()
    assert b'_DSFIX_STRATEGY = "dedupe"' in utils and b"strategy=dedupe" in utils
    assert cli("check", co)[0] == 0, "a plain check keeps the recorded strategy"
    code, diff, err = cli("check", co, "--strategy", "clone")  # one block, changed in place
    assert code == 1 and b'-_DSFIX_STRATEGY = "dedupe"' in diff and b'+_DSFIX_STRATEGY = "clone"' in diff
    assert "strategy dedupe -> clone" in err and "added imports" not in err, err
    assert cli("apply", co, "--strategy", "clone")[0] == 0
    assert cli("check", co)[0] == 0, "the new strategy is recorded"
    utils = (co / "dschat/utils/utils.py").read_bytes()
    assert utils.count(b"def save_hf_format_safetensors(") == 1
    assert utils.count(b"from safetensors import safe_open") == 1
    assert cli("revert", co)[0] == 0
    assert snapshot(co) == before


@pytest.mark.slow
def test_older_template_block_is_upgraded_and_revert_still_restores_the_original(tmp_path):
    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    assert cli("apply", co)[0] == 0
    utils = co / "dschat/utils/utils.py"
    v = load_template("clone").version
    old = utils.read_bytes().replace(b"template=v%d" % v, b"template=v0").replace(
        b"_DSFIX_TEMPLATE_VERSION = %d" % v, b"_DSFIX_TEMPLATE_VERSION = 0")
    shutil.rmtree(co / ".dsfix")
    utils.write_bytes(old)
    code, diff, err = cli("check", co)
    assert code == 1 and b"-_DSFIX_TEMPLATE_VERSION = 0" in diff
    assert cli("apply", co)[0] == 0
    assert utils.read_bytes().count(b"def save_hf_format_safetensors(") == 1
    assert cli("revert", co)[0] == 0  # the state folder now holds the v0 file as the original
    assert utils.read_bytes() == old
    shutil.rmtree(co / ".dsfix", ignore_errors=True)
    assert cli("revert", co)[0] == 0  # structural, from the marker alone
    assert snapshot(co) == before


@pytest.mark.slow
def test_the_block_inserted_into_upstreams_utils_is_at_most_320_lines(tmp_path):
    """Whoever opens their utils.py reads dsfix's block: its opening comment, imports and code included."""
    import difflib

    co = copy_fixture("package", tmp_path)
    utils = co / "dschat" / "utils" / "utils.py"
    before = utils.read_text().splitlines()
    assert cli("apply", co)[0] == 0
    after = utils.read_text().splitlines()
    added = [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
             if line.startswith("+") and not line.startswith("+++")]
    assert not [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
                if line.startswith("-") and not line.startswith("---")]
    assert 250 < len(added) <= 320, len(added)


V2_TEMPLATE = FIXTURES.parent / "old_templates" / "save_safetensors_v2.py"  # the template as released before v3


@pytest.mark.slow
@pytest.mark.parametrize("name, state", [("package", True), ("package", False), ("fork-keeps-lora", True)])
def test_a_block_of_template_v2_is_upgraded_to_the_current_one(tmp_path, monkeypatch, name, state):
    """A checkout patched by the previous release (template v2: numpy writes, keep_lora=True for a fork that
    keeps LoRA) gets the current block from apply, with or without its state folder; revert still works."""
    from patcher.patch import flow, signature
    from patcher.patch.template import parse_template

    co = copy_fixture(name, tmp_path)
    before = snapshot(co)
    text, generate = V2_TEMPLATE.read_text(encoding="utf-8"), signature.generate
    with monkeypatch.context() as patch:  # what the previous release wrote: its template, its calls
        patch.setattr(flow, "load_template", lambda strategy="clone": parse_template(text, strategy, V2_TEMPLATE))
        patch.setattr(signature, "generate", lambda *a, **k: generate(*a, **k).replace(
            "drop=lambda name: False", "keep_lora=True"))
        assert cli("apply", co)[0] == 0
    utils = co / "dschat" / "utils" / "utils.py"
    old = utils.read_bytes()
    assert b"template=v2" in old and b"_DSFIX_TEMPLATE_VERSION = 2\n" in old and b".numpy()" in old
    assert (b"keep_lora=True" in old) is (name == "fork-keeps-lora")
    if not state:
        shutil.rmtree(co / ".dsfix")
    code, diff, _ = cli("check", co)
    assert code == 1 and b"-_DSFIX_TEMPLATE_VERSION = 2\n" in diff and b"+_DSFIX_TEMPLATE_VERSION = 3\n" in diff
    code, out, err = cli("apply", co)
    assert code == 0 and "dsfix's block: template v2 -> v3" in (out.decode() + err)
    new = utils.read_bytes()
    assert b"template=v3" in new and new.count(b"def save_hf_format_safetensors(") == 1
    assert b".numpy()" not in new and b"keep_lora" not in new and b"class _DsfixTensor(NamedTuple):" in new
    assert b"import ctypes\n" in new and b"from typing import NamedTuple\n" in new
    assert (b"drop=lambda name: False" in new) is (name == "fork-keeps-lora")
    compile(new, str(utils), "exec")
    assert cli("check", co)[0] == 0
    assert cli("revert", co)[0] == 0
    if state:  # the state folder of the first apply still holds the file as it was before dsfix
        assert snapshot(co) == before
    else:  # the v2 file was taken as the original
        assert utils.read_bytes() == old


@pytest.mark.slow
def test_step2_needs_asking_and_brings_step3s_loader(tmp_path):
    co = copy_fixture("package", tmp_path)
    code, diff, _ = cli("check", co)
    assert b"step2_reward_model_finetuning" not in diff
    p = run("check", co, "--steps", "1,2")
    assert p.returncode == 1 and b"step2_reward_model_finetuning/main.py" in p.stdout
    assert b"step1_supervised_finetuning/main.py" in p.stdout
    assert b"dschat/utils/model/model_utils.py" in p.stdout, "step 3's loader is patched with step 2"
    assert b"warning" not in p.stderr
    p = run("check", co, "--steps", "2")  # step 1 is patched only when listed
    assert b"step2_reward_model_finetuning/main.py" in p.stdout and b"step1_supervised" not in p.stdout
    p = run("apply", co, "--steps", "1,2")
    assert p.returncode == 0
    p = run("revert", co)
    assert p.returncode == 0
    assert snapshot(co) == snapshot(FIXTURES / "package")
    for bad in ("4", "1,x", ""):
        p = run("check", co, "--steps", bad)
        assert p.returncode == 2 and p.stderr.count(b"\n") == 1 and b"--steps" in p.stderr


def test_main_py_forms_seen_in_forks(tmp_path):
    co = copy_fixture("fork-forms", tmp_path)
    assert cli("apply", co)[0] == 0
    main = (co / "training/step1_supervised_finetuning/main.py").read_text()
    assert "save_hf_format_safetensors(model=model, tokenizer=tokenizer, args=args)" in main
    assert 'save_hf_format_safetensors(model, tokenizer, args, sub_folder="final")' in main
    assert 'u.save_hf_format_safetensors(model, tokenizer, args, "best")' in main
    assert "save_zero_three_model_safetensors as save_z3,  # gathers under ZeRO-3" in main
    assert "save_z3(model, args.global_rank" in main
    assert "    save_hf_format_safetensors,\n" in main and "    save_hf_format,\n" not in main
    assert '{"save": save_hf_format_safetensors}' in main  # a use as a value is rewritten too


@pytest.mark.slow
def test_article_hand_edit_is_replaced_and_restored(tmp_path):
    co = copy_fixture("article", tmp_path)
    before = snapshot(co)
    code, _, err = cli("check", co)
    p = run("apply", co)
    assert p.returncode == 0 and b"replaced a hand-written save_hf_format_safetensors" in p.stderr
    utils = (co / "dschat/utils/utils.py").read_bytes()
    assert utils.count(b"def save_hf_format_safetensors(") == 1 and b"data_ptr() in seen" not in utils
    assert b"save_file, load_file" not in utils  # only the replaced code used them
    assert cli("revert", co)[0] == 0
    assert snapshot(co) == before


def test_readme_test_command_is_what_ci_runs():
    from patchkit import REPO

    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    lines = [l for l in readme.splitlines() if l.startswith("python3 -m venv")]
    assert len(lines) == 2 and lines[0].endswith("dsfix demo") and lines[1].endswith("python -m pytest -q")
    for part in ("'torch==2.13.0'", "DS_BUILD_OPS=0", "-e '.[test]'", "python -m pytest -q"):
        assert part in lines[1] and part in ci, part
