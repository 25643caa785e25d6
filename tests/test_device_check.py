"""benchmarks/device_check.py, the device check: its bad input ends in one line and exit 2 before anything runs
(``--device cuda`` on a machine without CUDA among them), its comparison finds what differs, and (extended tier)
the whole command passes on the CPU with small sizes, so that it is ready whenever a GPU is lent."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "device_check.py"
WHEELS_SCRIPT = REPO / "benchmarks" / "device_wheels.sh"
ENV = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS")}
LOGS = {"setup.log", "smoke.log", "step1.log", "engine.log", "bench.log", "summary.md", "summary.json"}


def run(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], env=dict(ENV, **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(p, needle):
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("device_check: error: "), p.stderr[-2000:]
    assert needle in lines[0] and "Traceback" not in p.stderr and p.stdout == ""


def test_cuda_without_a_gpu_is_one_line_exit_2_and_no_row(tmp_path):
    sys.path.insert(0, str(REPO))
    from patcher.prereq import no_gpu_driver

    if not no_gpu_driver():
        pytest.skip("this machine has a GPU driver")
    out = tmp_path / "out"
    # refused before torch is imported: here an import of torch fails, and the refusal is the same one line
    hide = tmp_path / "no-torch"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # an import of torch fails\n")
    p = run(out, "--device", "cuda", env={"PYTHONPATH": str(hide)})
    one_line_error(p, "--device cuda, but this machine has no GPU driver")
    assert not out.exists()  # no table, so no row that could read as passed


def test_cuda_is_the_default_device(tmp_path):
    sys.path.insert(0, str(REPO))
    from patcher.prereq import no_gpu_driver

    if not no_gpu_driver():
        pytest.skip("this machine has a GPU driver")
    one_line_error(run(tmp_path / "out"), "--device cuda")


@pytest.mark.parametrize("setup,args,needle", [
    (None, [], "give the folder for the logs and the table"),
    ("full", ["{out}", "--device", "cpu"], "must be a new or empty folder"),
    ("file", ["{out}", "--device", "cpu"], "must be a new or empty folder"),
    (None, ["{out}", "--device", "cpu", "--wheels", "{tmp}/none"], "not a folder"),
    (None, ["{out}", "--device", "cpu", "--budget", "0"], "--budget must be a number of seconds above 0"),
    ("wheels", ["{out}", "--device", "cpu", "--wheels", "{tmp}/wheels"], "has no main/ folder"),
    ("chat", ["{out}", "--device", "cpu", "--upstream", "{tmp}/chat"], "not a DeepSpeed-Chat folder"),
])
def test_bad_input_is_one_line_exit_2_before_anything_runs(tmp_path, setup, args, needle):
    out = tmp_path / "out"
    if setup == "full":
        out.mkdir()
        (out / "old.log").write_text("x")
    elif setup == "file":
        out.write_text("x")
    elif setup == "wheels":
        (tmp_path / "wheels").mkdir()
    elif setup == "chat":
        (tmp_path / "chat" / "dschat").mkdir(parents=True)
    p = run(*[a.format(out=out, tmp=tmp_path) for a in args])
    one_line_error(p, needle)
    assert not (tmp_path / "out" / "summary.md").exists()


def test_wheels_script_refuses_a_missing_folder_and_unknown_options(tmp_path):
    for args in ([], ["--upstream"], [str(tmp_path / "w"), "--offline"]):
        p = subprocess.run(["bash", str(WHEELS_SCRIPT), *args], env=ENV, capture_output=True, text=True, timeout=30)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "w").exists()


def test_the_pins_name_what_the_gpu_machine_lacks():
    p = run("--requirements", "main")
    pins = dict(line.split("==") for line in p.stdout.split())
    assert p.returncode == 0 and {"libcst", "deepspeed", "hjson", "pydantic", "pydantic-core"} <= set(pins)
    p = run("--requirements", "upstream")
    pins = dict(line.split("==") for line in p.stdout.split())
    assert p.returncode == 0 and pins["transformers"].startswith("4.") and "datasets" in pins


@pytest.mark.slow
@pytest.mark.extended
def test_a_spent_budget_fails_the_rows_not_run_and_exits_1(tmp_path):
    """A GPU lent for minutes: past --budget, what still runs is stopped and every stage after it is a failed row
    ("not run"), never a pass; the table is written and the exit is 1."""
    out = tmp_path / "out"
    p = run(out, "--device", "cpu", "--budget", "0.5", "--work", tmp_path / "work")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["stage"]: r for r in summary["rows"]}
    assert not summary["passed"] and list(rows)[1:] == ["smoke", "step1", "engine", "bench"]
    not_run = list(rows.values())[1:]
    assert all(r["result"] == "FAIL" and r["figures"].startswith("not run: the budget") for r in not_run)
    assert "FAILED: " in (out / "summary.md").read_text()


# --------------------------------------------------------------------------- the comparison the rows rest on


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheels_unpack_without_pip_as_pip_would_place_them(tmp_path):
    """A GPU machine whose Python has no pip still gets the wheels: unzipped, .data/purelib and platlib moved up."""
    import zipfile

    check = _device_check()
    good = tmp_path / "pkg_b-1.0-py3-none-any.whl"
    with zipfile.ZipFile(good, "w") as wheel:
        wheel.writestr("pkg_a/__init__.py", "A = 1\n")
        wheel.writestr("pkg_b-1.0.data/purelib/pkg_b/__init__.py", "B = 2\n")
        wheel.writestr("pkg_b-1.0.data/scripts/pkg-b", "#!python\n")
        wheel.writestr("pkg_b-1.0.dist-info/METADATA", "Name: pkg_b\n")
    site = tmp_path / "site"
    site.mkdir()
    log = check.Log(str(tmp_path / "setup.log"))
    assert check.unpack_wheels([str(good)], str(site), log) == 0
    p = subprocess.run([sys.executable, "-c", "import pkg_a, pkg_b; print(pkg_a.A + pkg_b.B)"], capture_output=True,
                       text=True, env=dict(ENV, PYTHONPATH=str(site)), timeout=30)
    assert p.stdout.strip() == "3", p.stderr
    assert not any(n.endswith(".data") for n in os.listdir(site))
    bad = tmp_path / "bad-1.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    assert check.unpack_wheels([str(bad)], str(site), log) == 1
    assert "cannot unpack" in (tmp_path / "setup.log").read_text()


@pytest.mark.slow
def test_compare_is_bit_for_bit_through_the_tie_and_names_the_first_difference(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    compare = _device_check().child_compare
    emb = torch.randn(8, 4).to(torch.bfloat16)
    norm = torch.ones(4, dtype=torch.bfloat16)
    saved = {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone(), "model.norm.weight": norm}
    save_file(saved, str(tmp_path / "model.safetensors"))
    # upstream's ZeRO-3 .bin lacks the tied lm_head.weight: compared through its partner
    torch.save({"model.embed_tokens.weight": emb.clone(), "model.norm.weight": norm.clone()}, tmp_path / "a.bin")
    assert compare(str(tmp_path), str(tmp_path / "a.bin")) == {"total": 3, "equal": 3, "first": "", "ok": True}
    # one bit of one element flipped
    flipped = emb.clone()
    flipped.view(torch.int16)[3, 2] ^= 1
    torch.save({"state_dict": {"model.embed_tokens.weight": flipped, "model.norm.weight": norm.clone()}},
               tmp_path / "reference.pt")
    result = compare(str(tmp_path), str(tmp_path / "reference.pt"))
    assert result["equal"] == 1 and not result["ok"] and result["first"].startswith("lm_head.weight")
    # the same values in another dtype are not bit-equal; a key the save lacks is counted
    torch.save({"model.embed_tokens.weight": emb.float(), "model.norm.weight": norm, "extra": norm}, tmp_path / "b.bin")
    result = compare(str(tmp_path), str(tmp_path / "b.bin"))
    assert (result["total"], result["equal"], result["ok"]) == (4, 1, False)
    assert result["first"] == "extra: missing in the save"


# --------------------------------------------------------------------------- the whole command, on the CPU


def stage_tails(out, lines=30):
    """Each stage log's last lines (its runs are one rank each): what a failing device check shows."""
    tails = []
    for name in ("setup.log", "smoke.log", "step1.log", "engine.log", "bench.log"):
        path = out / name
        text = path.read_text(errors="replace").splitlines() if path.is_file() else ["(none)"]
        tails.append("\n-- %s (last %d of %d lines):\n%s" % (name, min(lines, len(text)), len(text),
                                                             "\n".join(text[-lines:])))
    return "".join(tails)


@pytest.mark.slow
@pytest.mark.extended
def test_device_check_passes_on_the_cpu(tmp_path):
    """The command a session with a GPU runs first, with --device cpu: every stage, every row passing, the
    figures the GPU run must show (311 tensors, every tensor bit-equal), seven files in OUT_DIR."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    p = run(out, "--device", "cpu", "--work", tmp_path / "work", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:] + stage_tails(out)
    assert {f.name for f in out.iterdir()} == LOGS
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["stage"]: r for r in summary["rows"]}
    assert list(rows) == ["setup", "smoke (narrow Qwen3)", "step 1 ZeRO-0", "step 1 ZeRO-3",
                          "engine checkpoint (ZeRO-3)", "bench_save (--quick)"]
    assert summary["passed"] and all(r["result"] == "pass" for r in rows.values())
    assert "311 tensors on cpu" in rows["smoke (narrow Qwen3)"]["figures"]
    assert "reproduces the in-memory logits" in rows["smoke (narrow Qwen3)"]["figures"]
    for stage in (0, 3):
        figures = rows["step 1 ZeRO-%d" % stage]["figures"]
        assert "311/311 bit-equal patched vs unpatched" in figures and "311/311 bit-equal with the engine's" in figures
        assert "verify: all checks hold: 311 tensors" in figures
    engine = rows["engine checkpoint (ZeRO-3)"]["figures"]
    assert "311/311 bit-equal with the engine's weights" in engine and "311 tensors, bfloat16" in engine
    assert "dsfix clone / transformers = " in rows["bench_save (--quick)"]["figures"]
    assert summary["facts"]["step-1 trainer"].startswith("dsfix's step-1-like trainer")
    table = (out / "summary.md").read_text()
    assert "| step 1 ZeRO-3 | pass |" in table and table.rstrip().endswith("all rows pass")


def test_dsfix_laid_out_as_its_wheel_where_it_is_not_installed(tmp_path):
    """A GPU machine runs dsfix from the working tree, never installed: the device check lays it out as the wheel
    does (pyproject.toml's package-dir), and a Python that sees nothing else imports the save module from there."""
    tomllib = pytest.importorskip("tomllib")
    check = _device_check()
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert check.PACKAGE_DIRS == setuptools["package-dir"]
    assert set(setuptools["packages"]) <= {"patcher", *check.PACKAGE_DIRS} | {
        p for p in setuptools["packages"] if p.startswith("patcher.") and (REPO / p.replace(".", "/")).is_dir()}
    site = tmp_path / "site"
    check.lay_out_dsfix(str(site))
    probe = ("import sys; sys.path[:0] = [%r]; import patcher.templates, patcher._fixtures; from patcher.resources "
             "import resource_path; print(resource_path('templates', 'dsfix_safetensors.py')); "
             "print(resource_path('fixtures', 'models/qwen3-narrow/config.json'))" % str(site))
    p = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=30, env=ENV,
                       cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(site / "patcher" / "templates" / "dsfix_safetensors.py"),
                                str(site / "patcher" / "_fixtures" / "models" / "qwen3-narrow" / "config.json")]
