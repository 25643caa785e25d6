"""Bad input, faults and byte-exactness on the patch path: one line, a documented exit code, nothing lost."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from patchkit import FIXTURES, cli, copy_fixture, git_apply, pyflakes_messages, run, snapshot

UTILS = "dschat/utils/utils.py"
MAIN = "training/step1_supervised_finetuning/main.py"


def _one_line_error(p, code):
    assert p.returncode == code, (p.returncode, p.stderr)
    text = p.stderr.decode()
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dsfix: error: "), text
    return lines[0]


# ----------------------------------------------------------------------------- bytes survive


def _to_tabs(data: bytes) -> bytes:
    return re.sub(rb"(?m)^((?:    )+)", lambda m: b"\t" * (len(m.group(1)) // 4), data)


VARIANTS = {
    "crlf": lambda d, rel: d.replace(b"\n", b"\r\n"),
    "tabs": lambda d, rel: _to_tabs(d),
    "no-final-newline": lambda d, rel: d.rstrip(b"\n"),
    "bom": lambda d, rel: b"\xef\xbb\xbf" + d,
    "latin-1": lambda d, rel: b"# -*- coding: latin-1 -*-\n# r\xe9sum\xe9 des \xe9tapes\n" + d,
    "all-at-once": lambda d, rel: (b"# -*- coding: latin-1 -*-\r\n# \xe9\r\n"
                                   + _to_tabs(d).replace(b"\n", b"\r\n")).rstrip(b"\r\n"),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_encodings_line_endings_and_indents_survive(tmp_path, variant):
    co = copy_fixture("package", tmp_path / "a")
    for rel in (UTILS, MAIN):
        (co / rel).write_bytes(VARIANTS[variant]((co / rel).read_bytes(), rel))
    twin = tmp_path / "b"
    shutil.copytree(co, twin)
    before = snapshot(co)

    code, diff, _ = cli("check", co, cwd=co)
    assert code == 1
    subprocess.run(["git", "init", "-q"], cwd=twin, check=True)
    git_apply(diff, twin)
    assert cli("apply", co)[0] == 0
    after = snapshot(co)
    for rel in (UTILS, MAIN):
        assert after[rel] == (twin / rel).read_bytes(), rel
        compile(after[rel], rel, "exec")
        if variant in ("crlf", "all-at-once"):
            assert after[rel].count(b"\n") == after[rel].count(b"\r\n"), "every new line uses CRLF too"
        if variant in ("tabs", "all-at-once"):
            assert not re.search(rb"(?m)^    ", after[rel]), "inserted code is indented with tabs too"
        if variant == "no-final-newline":
            assert not after[rel].endswith(b"\n")
        assert pyflakes_messages(after[rel]) <= pyflakes_messages(before[rel])
    assert cli("check", co)[0] == 0
    assert cli("revert", co)[0] == 0
    assert snapshot(co) == before


# ----------------------------------------------------------------------------- bad input


def test_missing_path(tmp_path):
    line = _one_line_error(run("check", tmp_path / "nope"), 2)
    assert "no such file or folder" in line


@pytest.mark.slow
def test_not_a_checkout(tmp_path):
    line = _one_line_error(run("apply", tmp_path), 2)
    assert "no DeepSpeed-Chat checkout" in line and "step1_supervised_finetuning/main.py" in line


@pytest.mark.slow
def test_unknown_layout(tmp_path):
    (tmp_path / "training/step1_supervised_finetuning").mkdir(parents=True)
    (tmp_path / MAIN).write_text("print('hi')\n")
    line = _one_line_error(run("check", tmp_path), 2)
    assert "main.py: imports neither save_hf_format nor a module that defines it" in line


@pytest.mark.slow
def test_target_that_does_not_parse_names_file_and_line(tmp_path):
    co = copy_fixture("package", tmp_path)
    data = (co / UTILS).read_bytes().replace(b"def is_rank_0():", b"def is_rank_0(:")
    (co / UTILS).write_bytes(data)
    before = snapshot(co)
    line = _one_line_error(run("apply", co), 2)
    assert UTILS in line and "does not parse" in line and re.search(r"utils\.py:\d+:", line)
    assert snapshot(co) == before


@pytest.mark.parametrize("target, edit", [
    (UTILS, lambda data: data.replace(b"def save_hf_format(", b"def save_other(")),  # nothing to put dsfix beside
    (MAIN, lambda data: b"import torch\n\nprint('no saving here')\n"),  # no call to rewrite
])
def test_nothing_to_patch_names_the_file(tmp_path, target, edit):
    co = copy_fixture("package", tmp_path)
    (co / target).write_bytes(edit((co / target).read_bytes()))
    before = snapshot(co)
    line = _one_line_error(run("apply", co), 2)
    assert target in line and "save_hf_format" in line
    assert snapshot(co) == before


def test_unreadable_target(tmp_path):
    co = copy_fixture("package", tmp_path)
    (co / MAIN).unlink()
    (co / MAIN).mkdir()
    line = _one_line_error(run("check", co), 2)
    assert MAIN.split("/")[-1] in line and "regular file" in line


@pytest.mark.parametrize("args", [["apply", "--strategy", "fast"], ["check", "--step", "7"],
                                  ["smoke", "--zero-stage", "5"], ["revert", "--bogus"]])
def test_bad_option_values(tmp_path, args):
    co = copy_fixture("package", tmp_path)
    _one_line_error(run(*args, co), 2)


def test_symlink_leading_outside_is_refused(tmp_path):
    co = copy_fixture("package", tmp_path / "co")
    outside = tmp_path / "elsewhere.py"
    outside.write_bytes((co / UTILS).read_bytes())
    (co / UTILS).unlink()
    (co / UTILS).symlink_to(outside)
    before = outside.read_bytes()
    line = _one_line_error(run("apply", co), 2)
    assert "symlink" in line and "outside the checkout" in line
    assert outside.read_bytes() == before


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_a_traceback_and_keeps_the_exit_code(tmp_path, where):
    args = ["check", tmp_path / "nope"]
    p = run(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert p.returncode == 2 and b"Traceback" in p.stderr
    assert p.stderr.decode().rstrip().splitlines()[-1].endswith("nope: no such file or folder; pass a DeepSpeed-Chat "
                                                                 "checkout or a folder inside it")


# ----------------------------------------------------------------------------- faults while writing


def test_failure_writing_the_second_file_leaves_everything_as_it_was(tmp_path, monkeypatch):
    from patcher.patch import state

    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if str(dst).endswith("main.py") and "/.dsfix/" not in str(dst):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(state.os, "replace", flaky)
    code, _, _ = cli("apply", co)
    assert code == 2
    assert any(str(c).endswith("utils.py") for c in calls), "utils.py was written first, then rolled back"
    assert snapshot(co) == before, "no file changed, no temp file, no state folder"


def test_state_folder_that_cannot_be_written(tmp_path, monkeypatch):
    from patcher.patch import state

    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    real = os.replace

    def full(src, dst):
        if os.fspath(dst).endswith(".dsfix"):  # swapping the new state folder in
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(state.os, "replace", full)
    code, _, err = cli("apply", co)
    assert code == 2
    assert snapshot(co) == before


def test_a_failed_upgrade_leaves_the_state_folder_byte_for_byte(tmp_path, monkeypatch):
    """apply --strategy dedupe, then an apply --strategy clone whose write of utils.py fails: nothing changes, the
    state folder included, and revert still restores the original."""
    from patcher.patch import state

    co = copy_fixture("package", tmp_path)
    original = snapshot(co)
    assert cli("apply", co, "--strategy", "dedupe")[0] == 0
    before = snapshot(co)
    real = os.replace

    def failing(src, dst):
        if os.fspath(dst).endswith("utils.py") and "/.dsfix" not in os.fspath(dst):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(state.os, "replace", failing)
    code, _, err = cli("apply", co, "--strategy", "clone")
    assert code == 2 and "No space left on device" in err
    assert snapshot(co) == before, "targets and state folder as they were"
    monkeypatch.setattr(state.os, "replace", real)
    code, _, err = cli("revert", co)
    assert code == 0, err
    assert snapshot(co) == original


@pytest.mark.parametrize("point", ["commit.staged", "commit.swapped", "commit.renamed#1", "commit.renamed#2"])
def test_interrupt_mid_apply_rolls_back(tmp_path, monkeypatch, point):
    """A real SIGINT at each named step of the commit (patcher.errors.stop_point), in this process: the
    KeyboardInterrupt goes through the commit's rollback (tests/test_cli_interrupt.py: through the CLI)."""
    from patcher import errors
    from patcher.patch import flow

    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    monkeypatch.setattr(errors, "_STOP_AT", point)
    monkeypatch.setattr(errors, "_reached", {})
    with pytest.raises(KeyboardInterrupt):
        flow.apply(co)
    monkeypatch.setattr(errors, "_STOP_AT", None)
    assert snapshot(co) == before


KILLER = textwrap.dedent(
    """
    import os, signal
    _real = os.replace
    def _replace(src, dst, *a, **k):
        if str(dst).endswith(os.environ["DSFIX_TEST_KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(src, dst, *a, **k)
    os.replace = _replace
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["utils.py", "main.py", ".dsfix"])
def test_killed_mid_apply_each_file_is_wholly_old_or_new_and_apply_recovers(tmp_path, kill_at):
    co = copy_fixture("package", tmp_path / "co")
    ref = copy_fixture("package", tmp_path / "ref")
    assert cli("apply", ref)[0] == 0
    original, patched = snapshot(FIXTURES / "package"), snapshot(ref)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILLER)
    p = run("apply", co, env={"PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                              "DSFIX_TEST_KILL_AT": kill_at})
    assert p.returncode == -9
    for rel in (UTILS, MAIN):
        assert (co / rel).read_bytes() in (original[rel], patched[rel]), rel
    # no torn target: every file is as the fixture has it or as apply writes it; a killed run may leave only
    # its own temporary files (".NAME.PID.dsfix-tmp") and a state folder aside, which the next run clears
    now = snapshot(co)
    leftovers = {rel for rel in now if rel not in original and rel not in patched and not rel.startswith(".dsfix")}
    assert all(re.fullmatch(r"(.*/)?\.[^/]+\.\d+\.dsfix-tmp", rel) for rel in leftovers), leftovers
    for rel in set(now) & set(patched) - set(original):  # a new file (the save module) is whole, or not there
        assert now[rel] == patched[rel], rel
    for rel in original:
        assert now[rel] in (original[rel], patched[rel]), rel
    assert run("apply", co).returncode == 0
    assert not [rel for rel in snapshot(co) if rel.endswith(".dsfix-tmp") or rel.startswith(".dsfix.")]
    for rel in (UTILS, MAIN):
        assert (co / rel).read_bytes() == patched[rel]
    assert run("revert", co).returncode == 0
    for rel in (UTILS, MAIN):
        assert (co / rel).read_bytes() == original[rel]


# ----------------------------------------------------------------------------- the lock


@pytest.mark.slow
def test_a_held_lock_makes_the_second_run_fail_cleanly(tmp_path):
    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    fd = os.open(co, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        line = _one_line_error(run("apply", co), 3)
        assert "another dsfix run" in line
        _one_line_error(run("revert", co), 3)
        assert run("check", co).returncode == 1, "check takes no lock and writes nothing"
    finally:
        os.close(fd)
    assert snapshot(co) == before


@pytest.mark.slow
def test_concurrent_applies_never_duplicate_or_break(tmp_path):
    co = copy_fixture("package", tmp_path / "co")
    ref = copy_fixture("package", tmp_path / "ref")
    assert cli("apply", ref)[0] == 0
    env = {**os.environ, "NO_COLOR": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "patcher", "apply", str(co)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(6)]
    codes = [p.wait(timeout=120) for p in procs]
    assert set(codes) <= {0, 3} and 0 in codes
    for rel in (UTILS, MAIN):
        assert (co / rel).read_bytes() == (ref / rel).read_bytes()
    assert (co / UTILS).read_bytes().count(b"def save_hf_format_safetensors(") == 1


# ----------------------------------------------------------------------------- revert safety


def test_revert_keeps_an_edit_made_after_apply(tmp_path):
    co = copy_fixture("package", tmp_path)
    original = snapshot(co)
    assert cli("apply", co)[0] == 0
    extra = b"\n\ndef my_new_helper():\n    return 42\n"
    (co / UTILS).write_bytes((co / UTILS).read_bytes() + extra)
    main = (co / MAIN).read_bytes().replace(b"import math\n", b"import math  # the user's note\n")
    (co / MAIN).write_bytes(main)
    p = run("revert", co)
    assert p.returncode == 0, p.stderr
    assert (co / UTILS).read_bytes() == original[UTILS] + extra
    assert (co / MAIN).read_bytes() == original[MAIN].replace(b"import math\n", b"import math  # the user's note\n")
    assert not (co / ".dsfix").exists()


@pytest.mark.slow
def test_revert_keeps_an_edit_on_a_line_dsfix_changed(tmp_path):
    co = copy_fixture("package", tmp_path)
    original = snapshot(co)
    assert cli("apply", co)[0] == 0
    main = (co / MAIN).read_bytes().replace(
        b"save_hf_format_safetensors(model, tokenizer, args)",
        b"save_hf_format_safetensors(model, tokenizer, args, sub_folder='final')"
    )
    (co / MAIN).write_bytes(main)
    p = run("revert", co)
    assert p.returncode == 0, p.stderr
    assert (co / MAIN).read_bytes() == original[MAIN].replace(
        b"save_hf_format(model, tokenizer, args)", b"save_hf_format(model, tokenizer, args, sub_folder='final')"
    )


@pytest.mark.slow
def test_revert_refuses_when_dsfix_code_was_edited_and_force_keeps_a_copy(tmp_path):
    co = copy_fixture("package", tmp_path)
    original = snapshot(co)
    assert cli("apply", co)[0] == 0
    edited = (co / UTILS).read_bytes().replace(b'"""save_hf_format, as safetensors',
                                               b'"""Mine: save_hf_format, as safetensors')
    (co / UTILS).write_bytes(edited)
    before = snapshot(co)
    p = run("revert", co)
    assert p.returncode == 1 and UTILS.encode() in p.stderr and b"--force" in p.stderr
    assert snapshot(co) == before, "a refused revert writes nothing"
    p = run("revert", "--force", co)
    assert p.returncode == 0
    assert (co / UTILS).read_bytes() == original[UTILS]
    assert (co / (UTILS + ".dsfix-edited")).read_bytes() == edited


def test_revert_with_nothing_on_record_changes_nothing(tmp_path):
    co = copy_fixture("legacy", tmp_path)
    before = snapshot(co)
    p = run("revert", co)
    assert p.returncode == 0 and b"nothing to revert" in p.stderr
    assert snapshot(co) == before


@pytest.mark.slow
@pytest.mark.parametrize("name", ["package", "legacy", "fork-forms"])
def test_revert_without_state_folder_is_structural_and_exact(tmp_path, name):
    co = copy_fixture(name, tmp_path)
    before = snapshot(co)
    assert cli("apply", co)[0] == 0
    shutil.rmtree(co / ".dsfix")
    p = run("revert", co)
    assert p.returncode == 0, p.stderr
    assert snapshot(co) == before


@pytest.mark.slow
def test_revert_without_state_keeps_user_edits(tmp_path):
    co = copy_fixture("package", tmp_path)
    before = snapshot(co)
    assert cli("apply", co)[0] == 0
    shutil.rmtree(co / ".dsfix")
    (co / UTILS).write_bytes((co / UTILS).read_bytes() + b"\n\nMINE = 1\n")
    assert run("revert", co).returncode == 0
    assert (co / UTILS).read_bytes() == before[UTILS] + b"\n\nMINE = 1\n"


def _edit_dsfix_code(co):
    (co / UTILS).write_bytes((co / UTILS).read_bytes().replace(b'strategy="clone", max', b'strategy="x", max', 1))


@pytest.mark.slow
@pytest.mark.parametrize("fixture, edit, reason", [
    ("package", _edit_dsfix_code, b"edited"),  # dsfix's own code edited: nothing to compare it with
    ("article", None, b"hand-written"),  # the hand edit dsfix replaced lived only in the state folder
])
def test_revert_without_state_refuses_what_it_cannot_undo_safely(tmp_path, fixture, edit, reason):
    co = copy_fixture(fixture, tmp_path)
    assert cli("apply", co)[0] == 0
    shutil.rmtree(co / ".dsfix")
    if edit is not None:
        edit(co)
    before = snapshot(co)
    p = run("revert", co)
    assert p.returncode == 1 and reason in p.stderr
    assert snapshot(co) == before


@pytest.mark.slow
def test_damaged_state_folder_is_reported(tmp_path):
    co = copy_fixture("package", tmp_path)
    assert cli("apply", co)[0] == 0
    (co / ".dsfix" / "state.json").write_text("{not json")
    line = _one_line_error(run("revert", co), 2)
    assert "state folder is damaged" in line


@pytest.mark.slow
def test_patch_path_never_imports_torch(tmp_path):
    co = copy_fixture("package", tmp_path)
    code = (
        "import sys; from patcher import cli; from patcher.patch import flow; "
        "flow.check(sys.argv[1]); flow.apply(sys.argv[1]); "
        "flow.revert(sys.argv[1]); "
        "bad = [m for m in ('torch', 'transformers', 'deepspeed', 'safetensors') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code, str(co)], check=True)


# ----------------------------------------------------------------------------- revert tells only what it wrote

MODULE = "dschat/utils/dsfix_safetensors.py"


@pytest.mark.slow
def test_a_refused_revert_reports_only_what_it_wrote(tmp_path):
    co = copy_fixture("package", tmp_path)
    assert cli("apply", co)[0] == 0
    (co / UTILS).write_bytes((co / UTILS).read_bytes().replace(b'"""save_hf_format, as',
                                                               b'"""Mine: save_hf_format, as'))
    before = snapshot(co)
    p = run("revert", co)
    assert p.returncode == 1 and snapshot(co) == before
    text = p.stderr.decode()
    assert "restored" not in text.replace("restores the original", ""), text
    assert f"not written: {MAIN}" in text and f"refused: {UTILS}" in text
    assert text.splitlines()[-1].startswith(f"refused, nothing written: {UTILS}: edited after apply where dsfix")
    result = json.loads(run("revert", "--json", co).stdout)
    assert {f["rel"]: f["status"] for f in result["files"]} == {UTILS: "refused", MAIN: "not written",
                                                                 MODULE: "not written"}
    assert result["layout"] == "package"
    p = run("revert", "--force", co)
    assert p.returncode == 0 and b"--force restores" not in p.stderr and b"2 files restored, 1 removed" in p.stderr


@pytest.mark.slow
def test_revert_force_restores_a_utils_py_that_no_longer_parses(tmp_path):
    co = copy_fixture("package", tmp_path)
    original = snapshot(co)
    assert cli("apply", co)[0] == 0
    lines = (co / UTILS).read_bytes().split(b"\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(b"def set_random_seed"))
    lines[at] = b"def set_random_seed(seed"  # '(' never closed, at Python's line at + 1
    broken = b"\n".join(lines)
    (co / UTILS).write_bytes(broken)
    want = f"{UTILS}:{at + 1}: does not parse: '(' was never closed"
    for verb in ("check", "apply"):
        assert want in _one_line_error(run(verb, co), 2)
    p = run("revert", co)
    assert p.returncode == 1 and want.encode() in p.stderr and b"--force restores" in p.stderr
    p = run("revert", "--force", co)
    assert p.returncode == 0, p.stderr
    assert (co / UTILS).read_bytes() == original[UTILS] and (co / MAIN).read_bytes() == original[MAIN]
    assert (co / (UTILS + ".dsfix-edited")).read_bytes() == broken
    assert not (co / MODULE).exists() and not (co / ".dsfix").exists()


@pytest.mark.slow
@pytest.mark.parametrize("state", [True, False])
def test_an_edited_save_module_is_refused_and_kept_aside_by_force(tmp_path, state):
    co = copy_fixture("package", tmp_path)
    original = snapshot(co)
    assert cli("apply", co)[0] == 0
    if not state:
        shutil.rmtree(co / ".dsfix")
    mine = (co / MODULE).read_bytes() + b"\n# my tweak\n"
    (co / MODULE).write_bytes(mine)
    before = snapshot(co)
    p = run("revert", co)
    assert p.returncode == 1 and snapshot(co) == before and MODULE.encode() in p.stderr
    assert cli("check", co)[0] == 2, "check refuses to overwrite an edited save module"
    p = run("revert", "--force", co)
    assert p.returncode == 0, p.stderr
    assert (co / (MODULE + ".dsfix-edited")).read_bytes() == mine and not (co / MODULE).exists()
    assert {k: v for k, v in snapshot(co).items() if not k.endswith(".dsfix-edited")} == original


@pytest.mark.slow
def test_revert_above_two_checkouts_refuses_as_check_does(tmp_path):
    """From a folder holding two checkouts, revert does not pick one by its marker lines (it used to undo one
    of them structurally, leaving its main.py calling functions its utils.py no longer had)."""
    a = copy_fixture("package", tmp_path / "a")
    copy_fixture("package", tmp_path / "b")
    assert cli("apply", a)[0] == 0
    before = snapshot(tmp_path)
    line = _one_line_error(run("revert", tmp_path), 2)
    assert "2 DeepSpeed-Chat folders below this one" in line
    assert snapshot(tmp_path) == before
    assert run("revert", a).returncode == 0


def test_revert_where_dsfix_never_was_lists_nothing(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.py").write_text("save_hf_format_safetensors(m, t, a)\n")
    p = run("revert", tmp_path)
    assert p.returncode in (0, 2) and b"unchanged:" not in p.stderr


def _break(co, rel):
    """Make ``rel`` unreadable to Python ('(' never closed); returns the one line every verb prints for it."""
    lines = (co / rel).read_bytes().split(b"\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(b"def "))
    lines[at] = lines[at].replace(b"(", b"((", 1)
    (co / rel).write_bytes(b"\n".join(lines))
    try:
        compile((co / rel).read_bytes(), rel, "exec")
    except SyntaxError as e:
        return f"{rel}:{e.lineno}: does not parse: {e.msg}"
    raise AssertionError("still parses")


@pytest.mark.parametrize("patched, broken", [(False, UTILS), (True, UTILS), (True, MAIN)])
@pytest.mark.parametrize("force", [False, True])
def test_revert_without_state_on_a_file_that_does_not_parse_is_an_error(tmp_path, patched, broken, force):
    """No state folder: only parsing tells what dsfix changed, so a file that does not parse is the one
    parse-error line with exit 2, as check and apply print it, not a refusal (exit 1) advising a --force that
    cannot help (and, on an unpatched checkout, would remove "dsfix's code" where there is none)."""
    co = copy_fixture("package", tmp_path)
    if patched:
        assert cli("apply", co)[0] == 0
        shutil.rmtree(co / ".dsfix")
    want = _break(co, broken)
    before = snapshot(co)
    for verb in (["check"], ["apply"], ["revert", "--force"] if force else ["revert"]):
        line = _one_line_error(run(*verb, co), 2)
        assert line.endswith(want) and line.startswith(("dsfix: error: " + want, f"dsfix: error: {co}/")), (verb, line)
    assert snapshot(co) == before
    result = json.loads(run("revert", "--json", co).stdout)
    assert result["exit_code"] == 2 and result["error"]["path"] == broken and "--force" not in result["message"]
