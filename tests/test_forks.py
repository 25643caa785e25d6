"""Fork shapes (fixtures/checkouts/fork-*, fixtures/refused/*): the whole cycle, the calls run for real, refusals.

Each fork fixture carries a FIXTURE.json: where to run dsfix from (``path``), the options it needs
(``args``), the notes check must print, and for refused ones the one-line message.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import shutil
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from patchkit import FIXTURES, REPO, cli, git_apply, pyflakes_messages, snapshot

FORKS = sorted(p.name for p in FIXTURES.iterdir() if (p / "FIXTURE.json").is_file()
               and json.loads((p / "FIXTURE.json").read_text())["expect"] == "patched")
SAFE = sorted(p.name for p in FIXTURES.iterdir() if (p / "FIXTURE.json").is_file()
              and json.loads((p / "FIXTURE.json").read_text())["expect"] == "safe")
REFUSED_DIR = REPO / "fixtures" / "refused"
REFUSED = sorted(p.name for p in REFUSED_DIR.iterdir() if p.is_dir())
SAVE_NAMES = ("save_hf_format", "save_zero_three_model", "save_hf_format_safetensors",
              "save_zero_three_model_safetensors")


def _meta(src: Path) -> dict:
    return json.loads((src / "FIXTURE.json").read_text())


def _copy(src: Path, dest: Path) -> tuple:
    shutil.copytree(src, dest)
    meta = _meta(src)
    return dest, dest / meta["path"], meta


def _without_state(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if not k.startswith(".dsfix") and "/.dsfix/" not in k}


def test_every_fork_fixture_is_listed():
    assert len(FORKS) >= 7 and len(REFUSED) >= 3 and len(SAFE) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", FORKS)
def test_fork_full_cycle(tmp_path, name):
    top, cwd, meta = _copy(FIXTURES / name, tmp_path / "a")
    _, twin_cwd, _ = _copy(FIXTURES / name, tmp_path / "b")
    args = meta["args"]
    before = snapshot(top)

    code, diff, err = cli("check", ".", *args, cwd=cwd)
    assert code == 1, err
    for note in meta["notes"]:
        assert note in err, (note, err)
    assert snapshot(top) == before, "check writes nothing"
    git_apply(diff, twin_cwd)

    code, _, err = cli("apply", ".", *args, cwd=cwd)
    assert code == 0, err
    after = snapshot(top)
    assert _without_state(after) == snapshot(tmp_path / "b"), "git apply of check's diff == apply"
    if "patched" in meta:
        assert after[meta["patched"]] != before[meta["patched"]]
    for rel in before:
        if rel.endswith(".py") and before[rel] != after[rel]:
            assert _as_before(pyflakes_messages(after[rel])) <= pyflakes_messages(before[rel]), rel

    assert cli("check", ".", *args, cwd=cwd)[0] == 0, "check exits 0 once applied"
    assert cli("apply", ".", *args, cwd=cwd)[0] == 0
    assert snapshot(top) == after, "a second apply changes nothing"
    code, _, err = cli("revert", ".", cwd=cwd)  # the state folder tells which files: no --main/--script
    assert code == 0, err
    assert snapshot(top) == before, "revert restores every byte"
    assert cli("check", ".", *args, cwd=cwd)[0] == 1

    # without the state folder: a structural revert, exact when nothing was edited, found from the files
    # themselves (dsfix's marker line, the scripts that call its functions), again without --main/--script
    assert cli("apply", ".", *args, cwd=cwd)[0] == 0
    assert cli("check", ".", cwd=cwd)[0] == 0, "check remembers --main/--script"
    shutil.rmtree(top / meta["path"] / ".dsfix")
    code, _, err = cli("revert", ".", cwd=cwd)
    if "replaced a hand-written save_hf_format_safetensors" in " ".join(meta["notes"]):
        assert code == 1 and "cannot be restored structurally" in err  # its text lived only in the state folder
    else:
        assert code == 0, err
        assert snapshot(top) == before


def _as_before(messages: set) -> set:
    """pyflakes' messages with dsfix's names read as the ones they replace (a star import's names are
    reported by name: "may be undefined, or defined from star imports")."""
    return {m.replace("save_hf_format_safetensors", "save_hf_format").replace(
        "save_zero_three_model_safetensors", "save_zero_three_model") for m in messages}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_fork_names_file_line_and_reason(tmp_path, name):
    top, cwd, meta = _copy(REFUSED_DIR / name, tmp_path / "a")
    before = snapshot(top)
    for verb in ("check", "apply"):
        code, out, err = cli(verb, ".", *meta["args"], cwd=cwd)
        assert code == 2, err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("dsfix: error: "), err
        assert len(lines[0]) <= 300 and str(top) not in lines[0], lines[0]
        assert meta["message"] in lines[0], lines[0]
        assert out == b""
        assert snapshot(top) == before, f"{verb} wrote nothing"


def test_the_script_found_is_remembered_when_another_appears(tmp_path):
    """fork-one-saver: apply takes its one saving script and records it; a second saving script added later
    would make the folder ambiguous, but check, a second apply and revert use the recorded one."""
    top, cwd, _ = _copy(FIXTURES / "fork-one-saver", tmp_path / "a")
    before = snapshot(top)
    code, _, err = cli("apply", ".", cwd=cwd)
    assert code == 0 and "step 1: training/train_info.py, the one script" in err, err
    other = top / "training" / "train_other.py"
    other.write_bytes((top / "training" / "train_info.py").read_bytes())  # unpatched: it calls the originals
    patched = snapshot(top)
    code, diff, err = cli("check", ".", cwd=cwd)
    assert (code, diff) == (0, b""), err
    assert cli("apply", ".", cwd=cwd)[0] == 0
    assert snapshot(top) == patched
    code, _, err = cli("revert", ".", cwd=cwd)
    assert code == 0, err
    other.unlink()
    assert snapshot(top) == before


@pytest.mark.parametrize("name", SAFE)
def test_a_fork_that_saves_safely_is_told_so(tmp_path, name):
    """Its saves already keep tied weights in safetensors: check and apply exit 0, say why in one line, write
    nothing (no state folder either), and a revert finds nothing of dsfix's."""
    top, cwd, meta = _copy(FIXTURES / name, tmp_path / "a")
    before = snapshot(top)
    for verb in ("check", "apply"):
        code, out, err = cli(verb, ".", *meta["args"], cwd=cwd)
        assert code == 0 and out == b"", err
        lines = [ln for ln in err.splitlines() if ln.startswith("nothing to do:")]
        assert len(lines) == 1 and lines[0].startswith(meta["message"]), err
        assert "transformers 4.35" in lines[0] and "tied weights" in lines[0]
        assert snapshot(top) == before, f"{verb} wrote nothing"
    code, _, err = cli("revert", ".", cwd=cwd)
    assert code == 0 and "nothing to revert" in err, err
    assert snapshot(top) == before


def test_other_entry_scripts_are_listed_and_patched_with_script(tmp_path):
    top, cwd, meta = _copy(FIXTURES / "fork-shadow", tmp_path / "a")
    code, diff, err = cli("check", ".", cwd=cwd)
    assert code == 1
    assert "main_lora.py also calls the save functions and is not patched (add --script " in err
    assert b"main_lora.py" not in diff
    code, diff, err = cli("check", ".", *meta["args"], cwd=cwd)
    assert b"+++ b/training/step1_supervised_finetuning/main_lora.py" in diff
    assert b"+++ b/dschat/utils/utils.py" not in diff, "the shadowed copy is left alone"


def test_the_one_script_that_saves_is_step1_without_main(tmp_path):
    """fork-root-script's FIXTURE.json passes --main sft_train.py; without it, the one script that calls the
    save functions is taken, said in one line, and the diff is the same."""
    top, cwd, meta = _copy(FIXTURES / "fork-root-script", tmp_path / "a")
    code, given, _ = cli("check", ".", *meta["args"], cwd=cwd)
    assert code == 1
    code, found, err = cli("check", ".", cwd=cwd)
    assert code == 1, err
    assert found == given
    lines = [ln for ln in err.splitlines() if "step 1:" in ln]
    assert lines == ["warning: step 1: sft_train.py, the one script that calls save_hf_format (--main picks another)"]


def test_the_main_a_refusal_names_works_pasted_from_another_folder(tmp_path):
    """Two step1_supervised_finetuning/main.py: refused, naming a --main for each; each one, pasted as it is
    and run from another folder, is taken relative to the checkout."""
    top = tmp_path / "co"
    shutil.copytree(REFUSED_DIR / "two-step1", top)
    (tmp_path / "elsewhere").mkdir()
    code, _, err = cli("check", top, cwd=tmp_path / "elsewhere")
    assert code == 2
    mains = [m.split(" or ")[0] for m in err.strip().split("--main ")[1:]]
    assert mains == ["experiments/old/step1_supervised_finetuning/main.py",
                     "training_model/step1_supervised_finetuning/main.py"], err
    for m in mains:
        code, diff, err = cli("check", top, "--main", m, cwd=tmp_path / "elsewhere")
        assert code == 1, err
        assert f"+++ b/{m}\n" in diff.decode(), diff[:300]
        assert f"--main {m}: found relative to the checkout" in err, err


@pytest.mark.slow
def test_recorded_steps_and_strategy_change_only_when_given(tmp_path):
    """fork-step1-nested patched with --strategy dedupe --steps 1,2: plain runs keep both; an explicit
    --steps 1 is a change check shows (step 2 and its loader restored) and apply makes; then revert."""
    top, cwd, meta = _copy(FIXTURES / "fork-step1-nested", tmp_path / "a")
    before = snapshot(top)
    assert cli("apply", ".", *meta["args"], cwd=cwd)[0] == 0
    patched = snapshot(top)
    step2 = "training_model/step2_reward_model_finetuning/main.py"
    assert patched[step2] != before[step2]
    assert b'strategy="dedupe"' in patched["dschat/utils/utils.py"]
    assert cli("check", ".", cwd=cwd)[0] == 0 and cli("apply", ".", cwd=cwd)[0] == 0
    assert snapshot(top) == patched

    code, diff, err = cli("check", ".", "--steps", "1", cwd=cwd)
    assert code == 1, err
    assert f"+++ b/{step2}".encode() in diff and b"+++ b/dschat/utils/model/model_utils.py" in diff
    assert b"utils/utils.py" not in diff.replace(b"model/model_utils.py", b"")
    assert "restores the original: --steps 1 leaves step 2 out" in err, err
    assert snapshot(top) == patched
    assert cli("apply", ".", "--steps", "1", cwd=cwd)[0] == 0
    now = snapshot(top)
    assert now[step2] == before[step2]
    assert now["dschat/utils/model/model_utils.py"] == before["dschat/utils/model/model_utils.py"]
    assert now["dschat/utils/utils.py"] == patched["dschat/utils/utils.py"], "the strategy stays dedupe"
    assert cli("check", ".", cwd=cwd)[0] == 0, "--steps 1 is recorded"

    code, diff, err = cli("check", ".", "--strategy", "clone", cwd=cwd)
    assert code == 1 and "strategy dedupe -> clone" in err and "added imports" not in err, err
    assert set(diff.decode().split("+++ b/")[1:]) and all(
        d.startswith("dschat/utils/utils.py") for d in diff.decode().split("+++ b/")[1:]), "only utils.py changes"
    assert cli("revert", ".", cwd=cwd)[0] == 0
    assert snapshot(top) == before


def test_unresolved_import_names_the_lines_and_why(tmp_path):
    top, cwd, _ = _copy(FIXTURES / "fork-z3-subfolder", tmp_path / "a")
    main = top / "training/step1_supervised_finetuning/main.py"
    text = main.read_text().replace("from dschat.utils.utils import", "from dschat_old.utils.utils import")
    main.write_text(text)
    code, _, err = cli("check", ".", cwd=cwd)
    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith("dsfix: error: training/step1_supervised_finetuning/main.py:6: no import resolves to a "
                           "utils.py that defines save_hf_format: dschat_old.utils.utils: no dschat_old/ or "
                           "dschat_old.py on the script's path"), line
    assert len(line) <= 300, line
    code, out, err = cli("check", ".", "--json", cwd=cwd)
    data = json.loads(out)
    error = data["error"]
    assert code == 2 and data["exit_code"] == 2 and error["line"] == 6
    assert error["path"] == "training/step1_supervised_finetuning/main.py"
    assert any(d.startswith("line 6 `from dschat_old.utils.utils import") for d in error["detail"]), data


def test_zero3_save_without_a_config_save_warns(tmp_path):
    top, cwd, _ = _copy(FIXTURES / "fork-z3-subfolder", tmp_path / "a")
    main = top / "training/step1_supervised_finetuning/main.py"
    text = main.read_text()
    main.write_text(text.replace('        if args.global_rank == 0:\n'
                                 '            save_hf_format(model, tokenizer, args, sub_folder=f"epoch_{epoch}")\n',
                                 ""))
    code, _, err = cli("check", ".", cwd=cwd)
    assert code == 1
    assert "main.py:17: this save_zero_three_model call has no save_hf_format call beside it" in err
    assert "main.py:27" not in err, "the final save has save_hf_format beside it"


# ----------------------------------------------------------------------------- the calls, run for real


def _save_calls(script: Path) -> list:
    """The source text of every save call in a script, in order."""
    source = script.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in SAVE_NAMES or name == "save_z3":
                out.append((node.lineno, ast.get_source_segment(source, node)))
    return [src for _, src in sorted(out)]


def _run_calls(script: Path, root: Path, out_dir: Path, model, tokenizer) -> None:
    """Run the script's imports (and sys.path lines) as Python would, then each save call in it."""
    _run_calls_text(script, root, out_dir, model, tokenizer, _save_calls(script))


def _run_calls_text(script: Path, root: Path, out_dir: Path, model, tokenizer, calls: list) -> None:
    """Run the script's imports (and sys.path lines) as Python would, then each call in ``calls``."""
    tree = ast.parse(script.read_text())
    head = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
            or (isinstance(n, ast.Expr) and "sys.path" in ast.unparse(n))]
    ns = {"__file__": str(script), "__name__": "dsfix_fixture_script"}
    saved_path = list(sys.path)
    sys.path[:0] = [str(script.parent)]
    sys.path[len(sys.path):] = [str(root), str(root.parent), str(root.parent.parent)]
    importlib.invalidate_caches()
    try:
        exec(compile(ast.Module(body=head, type_ignores=[]), str(script), "exec"), ns)
        args = Namespace(output_dir=str(out_dir), global_rank=0, zero_stage=0, num_train_epochs=1, save_steps=1)
        ns.update(model=model, tokenizer=tokenizer, args=args, epoch=0, step=0, os=os)
        for call in calls:
            eval(call, ns)
    finally:
        sys.path[:] = saved_path
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if f and Path(f).resolve().is_relative_to(root.resolve().parent):
                del sys.modules[name]


def _weights(out: Path, name: str) -> dict:
    return {p.parent.relative_to(out).as_posix(): p for p in sorted(out.rglob(name))}


@pytest.mark.slow
@pytest.mark.parametrize("name", FORKS)
def test_patched_calls_save_what_and_where_the_original_did(tmp_path, name, tiny_qwen3, tiny_qwen3_tokenizer):
    """Every save call of the fork, as written in its scripts, run before and after apply: the same folders
    get weights (and a config where the original wrote one), with the same tensors (with --strategy dedupe,
    a tied alias is left out: the tensor it shares is there)."""
    import torch
    from safetensors.torch import load_file

    top, cwd, meta = _copy(FIXTURES / name, tmp_path / "co")
    args = meta["args"]
    scripts = [cwd / meta.get("main", "training/step1_supervised_finetuning/main.py")]
    if "--main" in args:
        scripts = [cwd / args[args.index("--main") + 1]]
    scripts += [cwd / args[i + 1] for i, a in enumerate(args) if a == "--script"]
    for s in scripts:
        _run_calls(s, cwd, tmp_path / "before", tiny_qwen3, tiny_qwen3_tokenizer)
    assert cli("apply", ".", *args, cwd=cwd)[0] == 0
    for s in scripts:
        _run_calls(s, cwd, tmp_path / "after", tiny_qwen3, tiny_qwen3_tokenizer)

    bins = _weights(tmp_path / "before", "pytorch_model.bin")
    safes = _weights(tmp_path / "after", "model.safetensors")
    assert bins and set(safes) == set(bins), (sorted(bins), sorted(safes))
    assert not _weights(tmp_path / "after", "pytorch_model.bin")
    assert set(_weights(tmp_path / "before", "config.json")) <= set(_weights(tmp_path / "after", "config.json"))
    dedupe = "dedupe" in args
    for folder, path in bins.items():
        old = torch.load(path, weights_only=True)
        new = load_file(safes[folder])
        for key, value in old.items():
            if dedupe and key not in new:
                assert any(torch.equal(v, value) for v in new.values()), (folder, key)
                continue
            assert torch.equal(new[key], value), (folder, key)
        assert not dedupe or len(new) < len(old), "dedupe leaves the tied alias out"


@pytest.mark.slow
@pytest.mark.parametrize("name, keeps", [("fork-keeps-lora", True), ("package", False)])
def test_lora_weights_are_kept_exactly_where_the_fork_keeps_them(tmp_path, name, keeps, tiny_qwen3,
                                                                 tiny_qwen3_tokenizer):
    """Upstream's saves drop every key with "lora" in it; a fork whose saves keep its adapters gets
    dsfix's saves keeping them too (read from the fork's own function)."""
    import torch
    from safetensors.torch import load_file

    tiny_qwen3.model.layers[0].self_attn.q_proj.register_parameter(
        "lora_right_weight", torch.nn.Parameter(torch.randn(8, 2)))
    key = "model.layers.0.self_attn.q_proj.lora_right_weight"
    cwd = tmp_path / "co"
    shutil.copytree(FIXTURES / name, cwd)
    script = cwd / "training/step1_supervised_finetuning/main.py"
    calls = [c for c in _save_calls(script) if c.startswith("save_hf_format(")]
    assert calls
    _run_calls_text(script, cwd, tmp_path / "before", tiny_qwen3, tiny_qwen3_tokenizer, calls)
    assert cli("apply", ".", cwd=cwd)[0] == 0
    calls = [c.replace("save_hf_format(", "save_hf_format_safetensors(") for c in calls]
    _run_calls_text(script, cwd, tmp_path / "after", tiny_qwen3, tiny_qwen3_tokenizer, calls)
    old = torch.load(tmp_path / "before" / "pytorch_model.bin", weights_only=True)
    new = load_file(tmp_path / "after" / "model.safetensors")
    assert (key in old) is keeps and (key in new) is keeps
    assert set(new) == set(old)


@pytest.mark.slow
def test_a_zero3_save_that_writes_config_gets_dsfixs_writing_it_too(tmp_path, tiny_qwen3, tiny_qwen3_tokenizer):
    """fork-legacy-tokenizer's save_zero_three_model writes config.json and the tokenizer itself (the fork
    calls it instead of save_hf_format under ZeRO-3); dsfix's replacement must write both as well."""
    cwd = tmp_path / "co"
    shutil.copytree(FIXTURES / "fork-legacy-tokenizer", cwd)
    assert cli("apply", ".", cwd=cwd)[0] == 0
    utils = (cwd / "training/utils/utils.py").read_text()
    z3 = utils[utils.index("def save_zero_three_model_safetensors("):]
    assert "with_config=True" in z3.split("\n\n")[0] and "tokenizer=tokenizer" in z3.split("\n\n")[0]
    script = cwd / "training/step1_supervised_finetuning/main.py"
    calls = [c for c in _save_calls(script) if c.startswith("save_zero_three_model_safetensors(")]
    _run_calls_text(script, cwd, tmp_path / "out", tiny_qwen3, tiny_qwen3_tokenizer, calls)
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "config.json" in written and "model.safetensors" in written and "vocab.json" in written, written


@pytest.mark.slow
def test_keys_the_fork_leaves_out_are_left_out_by_dsfixs_save_too(tmp_path, tiny_qwen3, tiny_qwen3_tokenizer):
    """fork-svd-filter's saves drop "lora", "svd" and "sigma" keys (its ZeRO-3 save also "v_head" ones):
    on a model that holds such keys, dsfix's saves write exactly the tensors the fork's own did."""
    import torch
    from safetensors.torch import load_file

    layer = tiny_qwen3.model.layers[0].self_attn.q_proj
    for extra in ("lora_right_weight", "svd_u", "sigma"):
        layer.register_parameter(extra, torch.nn.Parameter(torch.randn(4, 2)))
    tiny_qwen3.register_parameter("v_head_weight", torch.nn.Parameter(torch.randn(2)))
    before_keys = set(tiny_qwen3.state_dict())
    cwd = tmp_path / "co"
    shutil.copytree(FIXTURES / "fork-svd-filter", cwd)
    script = cwd / "training/step1_supervised_finetuning/main.py"
    calls = [c.replace("args.output_dir", "os.path.join(args.output_dir, 'z3')") for c in _save_calls(script)]
    _run_calls_text(script, cwd, tmp_path / "before", tiny_qwen3, tiny_qwen3_tokenizer, calls)
    assert cli("apply", ".", cwd=cwd)[0] == 0
    calls = [c.replace("save_hf_format(", "save_hf_format_safetensors(").replace(
        "save_zero_three_model(", "save_zero_three_model_safetensors(") for c in calls]
    _run_calls_text(script, cwd, tmp_path / "after", tiny_qwen3, tiny_qwen3_tokenizer, calls)
    for folder in ("", "z3"):
        old = torch.load(tmp_path / "before" / folder / "pytorch_model.bin", weights_only=True)
        new = load_file(tmp_path / "after" / folder / "model.safetensors")
        left_out = before_keys - set(old)
        assert {"model.layers.0.self_attn.q_proj." + k for k in ("lora_right_weight", "svd_u", "sigma")} <= left_out
        assert ("v_head_weight" in left_out) is (folder == "z3")
        tied = {"lm_head.weight"} if folder == "z3" else set()  # the fork's ZeRO-3 save lost it; dsfix's has it
        assert set(new) == set(old) | tied and len(new) == len(old) + len(tied), folder


@pytest.mark.slow
def test_stored_and_passed_on_save_functions_run_dsfixs_save(tmp_path, tiny_qwen3, tiny_qwen3_tokenizer):
    """fork-stored-save hands its save functions around (a variable, a table, a helper's argument, hooks
    through the module, a partial): its main(), run for real after apply, writes safetensors into every
    folder the original wrote a .bin into, and no .bin anywhere."""
    cwd = tmp_path / "co"
    shutil.copytree(FIXTURES / "fork-stored-save", cwd)
    script = cwd / "training/step1_supervised_finetuning/main.py"
    _run_main(script, cwd, tmp_path / "before", tiny_qwen3, tiny_qwen3_tokenizer)
    assert cli("apply", ".", cwd=cwd)[0] == 0
    _run_main(script, cwd, tmp_path / "after", tiny_qwen3, tiny_qwen3_tokenizer)
    bins = _weights(tmp_path / "before", "pytorch_model.bin")
    assert sorted(bins) == [".", "module", "passed", "stored", "table", "z3"]
    assert sorted(_weights(tmp_path / "after", "model.safetensors")) == sorted(bins)
    assert not _weights(tmp_path / "after", "pytorch_model.bin")


def _run_main(script: Path, root: Path, out_dir: Path, model, tokenizer) -> None:
    """Import the script as Python would (its folder first on the path) and call its main()."""
    spec = importlib.util.spec_from_file_location("dsfix_fixture_main", script)
    saved_path = list(sys.path)
    sys.path[:0] = [str(script.parent), str(root)]
    importlib.invalidate_caches()
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(model, tokenizer, Namespace(output_dir=str(out_dir), global_rank=0, zero_stage=0))
    finally:
        sys.path[:] = saved_path
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if f and Path(f).resolve().is_relative_to(root.resolve().parent):
                del sys.modules[name]
