"""check -> git apply == apply -> check 0 -> apply no-op -> revert byte-exact, on every fixture checkout."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from patcher.patch.template import module_bytes, module_version
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
    assert b"3 files would change" in p.stderr
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
    assert b'strategy="dedupe"' in utils and b"strategy=dedupe" in utils
    assert cli("check", co)[0] == 0, "a plain check keeps the recorded strategy"
    code, diff, err = cli("check", co, "--strategy", "clone")  # the wrappers, changed in place
    assert code == 1 and b'strategy="dedupe"' in diff and b'strategy="clone"' in diff
    assert b"+++ b/dschat/utils/dsfix_safetensors.py" not in diff, "the save module is the same for both strategies"
    assert "strategy dedupe -> clone" in err and "adds" not in err, err
    assert cli("apply", co, "--strategy", "clone")[0] == 0
    assert cli("check", co)[0] == 0, "the new strategy is recorded"
    utils = (co / "dschat/utils/utils.py").read_bytes()
    assert utils.count(b"def save_hf_format_safetensors(") == 1
    assert utils.count(b"from . import dsfix_safetensors") == 1
    assert cli("revert", co)[0] == 0
    assert snapshot(co) == before


OLD_PATCHES = FIXTURES.parent / "old_patches"


@pytest.mark.slow
@pytest.mark.parametrize("name, state", [("v3-package", True), ("v3-package", False), ("v3-fork-keeps-lora", True),
                                         ("v2-package", False), ("v2-fork-keeps-lora", True)])
def test_an_inline_block_of_an_earlier_release_is_upgraded(tmp_path, name, state):
    """A checkout patched by an earlier release (the v2 or v3 inline block of about 320 lines in utils.py) gets
    the save module and the two wrappers from apply, with or without its state folder; revert still works."""
    co = tmp_path / "co"
    shutil.copytree(OLD_PATCHES / name / "checkout", co)
    if state:
        shutil.copytree(OLD_PATCHES / name / "state", co / ".dsfix")
    utils = co / "dschat" / "utils" / "utils.py"
    old = utils.read_bytes()
    assert old.count(b"_dsfix_") > 20
    code, diff, err = cli("check", co)
    assert code == 1 and b"+++ b/dschat/utils/dsfix_safetensors.py" in diff and b"-_DSFIX_TEMPLATE_VERSION = " in diff
    assert f"template {name[:2]} -> v{module_version()}" in err
    assert cli("apply", co)[0] == 0
    new = utils.read_bytes()
    assert b"_dsfix_" not in new and b"_DSFIX" not in new and new.count(b"def save_hf_format_safetensors(") == 1
    assert b"import ctypes" not in new and b"from typing import NamedTuple" not in new and b"numpy" not in new
    assert (b"drop=lambda name: False" in new) is ("keeps-lora" in name)
    assert (co / "dschat/utils/dsfix_safetensors.py").read_bytes() == module_bytes()
    compile(new, str(utils), "exec")
    assert cli("check", co)[0] == 0
    assert cli("revert", co)[0] == 0
    assert not (co / "dschat/utils/dsfix_safetensors.py").exists()
    original = OLD_PATCHES / name / "state" / "original" / "dschat" / "utils" / "utils.py"
    if state:  # the state folder of the first apply still holds the file as it was before dsfix
        assert utils.read_bytes() == original.read_bytes()
        assert not (co / ".dsfix").exists()
    else:  # the inline block was taken as the original
        assert utils.read_bytes() == old


@pytest.mark.slow
@pytest.mark.parametrize("name, state", [("v4-package", True), ("v4-package", False), ("v4-fork-keeps-lora", True)])
def test_the_save_module_of_an_earlier_release_is_upgraded(tmp_path, name, state):
    """A checkout patched by the release with save module v4 gets the new module file and the wrappers' new
    marker from apply, with or without its state folder; revert gives back what was there before."""
    co = tmp_path / "co"
    shutil.copytree(OLD_PATCHES / name / "checkout", co)
    if state:
        shutil.copytree(OLD_PATCHES / name / "state", co / ".dsfix")
    module = co / "dschat" / "utils" / "dsfix_safetensors.py"
    assert b"\nVERSION = 4\n" in module.read_bytes()
    patched = snapshot(co)
    code, diff, err = cli("check", co)
    assert code == 1 and b"-VERSION = 4" in diff and f"+VERSION = {module_version()}".encode() in diff
    assert f"save module v4 -> v{module_version()}" in err and f"template v4 -> v{module_version()}" in err
    assert cli("apply", co)[0] == 0
    assert module.read_bytes() == module_bytes()
    utils = (co / "dschat" / "utils" / "utils.py").read_bytes()
    assert utils.count(b"def save_hf_format_safetensors(") == 1 and f"template=v{module_version()}".encode() in utils
    assert (b"drop=lambda name: False" in utils) is ("keeps-lora" in name)
    assert cli("check", co)[0] == 0
    assert cli("revert", co)[0] == 0
    if state:  # back to the checkout as it was before the first apply
        assert snapshot(co) == snapshot(FIXTURES / name[3:])
    else:  # the v4 patch was taken as the original
        assert snapshot(co) == patched


@pytest.mark.slow
def test_upstreams_utils_gets_at_most_30_lines_and_one_new_file(tmp_path):
    """Whoever opens their utils.py reads dsfix's change: the import, the marker and the two wrappers; the
    writer is a file of its own beside it."""
    co = copy_fixture("package", tmp_path)
    code, out, _ = cli("check", co, "--stat")
    rows = dict(line.split("|") for line in out.decode().splitlines() if "|" in line)
    rows = {k.strip(): int(v.split()[0]) for k, v in rows.items()}
    assert set(rows) == {"dschat/utils/utils.py", "dschat/utils/dsfix_safetensors.py",
                         "training/step1_supervised_finetuning/main.py"}
    assert rows["dschat/utils/utils.py"] <= 30
    assert list(rows) == sorted(rows), "--stat is sorted by path, as git's"


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
    lines = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    command = "python -m pytest -q -n 2 --dist loadfile"
    assert len(lines) == 2 and lines[0].endswith("dsfix demo") and lines[1].endswith(command)
    for part in ("'torch==2.13.0'", "DS_BUILD_OPS=0", "-e '.[test]'", command + "\n"):
        assert part in lines[1] + "\n" and part in ci, part


@pytest.mark.slow
def test_options_recorded_in_a_checkout_below_are_used_from_the_repositorys_top(tmp_path):
    """dsfix run from the top of a DeepSpeedExamples clone finds applications/DeepSpeed-Chat and the options
    its last apply recorded there (a plain apply kept forgetting --script, found in the fork survey)."""
    chat = tmp_path / "DeepSpeedExamples" / "applications" / "DeepSpeed-Chat"
    shutil.copytree(FIXTURES / "package", chat)
    step1 = chat / "training" / "step1_supervised_finetuning"
    (step1 / "main_lora.py").write_bytes((step1 / "main.py").read_bytes())
    top = tmp_path / "DeepSpeedExamples"
    assert cli("apply", "--script", "training/step1_supervised_finetuning/main_lora.py", cwd=top)[0] == 0
    recorded = json.loads((chat / ".dsfix" / "state.json").read_text())
    assert recorded["scripts"] == ["training/step1_supervised_finetuning/main_lora.py"]
    assert cli("check", cwd=top)[0] == 0 and cli("apply", cwd=top)[0] == 0
    assert json.loads((chat / ".dsfix" / "state.json").read_text())["scripts"] == recorded["scripts"]
    assert cli("revert", cwd=top)[0] == 0
    assert b"save_hf_format_safetensors" not in (step1 / "main_lora.py").read_bytes()
