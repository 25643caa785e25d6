"""patcher.checkpoint.smoke: run a checkout's own save functions as step 1 does, then verify (CPU, narrow Qwen3).

Multi-rank runs use real DeepSpeed engines on its CPU accelerator with gloo, started through
``python -m torch.distributed.run``.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torch models saved and reloaded, ZeRO-3 ranks

pytest.importorskip("torch")
pytest.importorskip("transformers")

from patcher.checkpoint.smoke import print_report, run_smoke  # noqa: E402
from patcher.checkpoint.smoke.functions import extract_definitions  # noqa: E402
from patcher.checkpoint.smoke.worker import make_tiny_tokenizer  # noqa: E402
from patcher.errors import DsfixError  # noqa: E402
from smokekit import NARROW, broken_code, make_checkout, narrow_model, patched_checkout, quiet_console  # noqa: E402

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


def failed(report) -> dict:
    return {c.name: c.detail for c in report.checks if not c.ok}


@pytest.fixture(scope="module")
def good_checkout(tmp_path_factory):
    return patched_checkout(tmp_path_factory.mktemp("good") / "DeepSpeed-Chat")


def test_passes_in_process_and_keeps_stdout_clean(good_checkout, capfd):
    if importlib.util.find_spec("deepspeed") is None:  # importing it here would print to stdout
        pytest.skip("the checkout's utils.py imports deepspeed; without it smoke takes the ast path")
    console = quiet_console()
    report = run_smoke(good_checkout, config_path=NARROW, dtype="bf16", console=console)
    out, _ = capfd.readouterr()
    assert out == ""  # stdout is the CLI's machine channel
    assert report.ok, report.to_json()
    assert report.load_method == "import" and report.load_detail == "import dschat.utils.utils"
    assert set(report.functions) == {"save_hf_format_safetensors", "save_zero_three_model_safetensors"}
    assert report.tensors == 311 and report.device == "cpu" and report.launcher is None
    assert [c.name for c in report.checks] == ["functions", "save", "config", "files", "keys", "shapes", "non-empty",
                                               "dtype", "finite", "tied", "count", "load", "logits"]
    assert "[dsfix] verified 311 tensors" in report.save_output
    assert report.peak_rss_mb["this process"] > 0 and report.cuda_peak_mb is None
    assert {"load", "build", "train", "reference", "save", "verify", "reload"} <= set(report.timings)
    assert "ranks" not in report.timings, "one rank in this process: no launch to time"
    assert not report.warnings and "failed" not in report.check("functions").detail
    print_report(report, console)
    text = console.file.getvalue()
    assert "smoke passed" in text and "logits" in text and "timings: load " in text
    # the checkout's modules are not left imported, and no bytecode was written into it
    assert "dschat" not in sys.modules and "dschat.utils.utils" not in sys.modules
    assert not list(good_checkout.rglob("__pycache__"))


@needs_deepspeed
def test_passes_under_zero3_with_two_ranks(good_checkout, tmp_path):
    shm = Path("/dev/shm")
    buffers_before = set(shm.glob("deepspeed_allreduce_buffer_*")) if shm.is_dir() else set()
    report = run_smoke(good_checkout, config_path=NARROW, dtype="bf16", zero_stage=3, nproc=2,
                       keep=tmp_path / "out", console=quiet_console(), timeout=300)
    assert report.ok, report.to_json()
    assert report.backend == "gloo" and report.nproc == 2
    assert ("--master_addr 127.0.0.1 --master_port PORT --nproc_per_node 2 -m patcher.checkpoint.smoke.worker"
            in report.launcher)
    save = report.check("save").detail
    assert "310 of 310 parameters partitioned" in save
    assert "save_zero_three_model_safetensors on all 2 ranks" in save
    assert set(report.peak_rss_mb) == {"this process", "rank 0", "rank 1"}
    assert (tmp_path / "out" / "model.safetensors").is_file() and report.output_dir == str(tmp_path / "out")
    if shm.is_dir():  # the ranks use gloo alone: no buffer of DeepSpeed's shared-memory all-reduce
        assert set(shm.glob("deepspeed_allreduce_buffer_*")) <= buffers_before


def test_refuses_an_unpatched_checkout(tmp_path):
    checkout = make_checkout(tmp_path / "DeepSpeed-Chat")
    with pytest.raises(DsfixError) as e:
        run_smoke(checkout, config_path=NARROW, console=quiet_console())
    assert e.value.code == 2
    assert "never patched: run `dsfix apply` first" in str(e.value)


def test_refuses_bad_options(good_checkout, tmp_path):
    for kwargs, words in (({"dtype": "int8"}, "--dtype"), ({"zero_stage": 4}, "--zero-stage"),
                          ({"nproc": 0}, "--nproc"), ({"model_dir": tmp_path}, "not both"),
                          ({"config_path": tmp_path / "none.json"}, "no such config")):
        kwargs.setdefault("config_path", NARROW)
        with pytest.raises(DsfixError) as e:
            run_smoke(good_checkout, console=quiet_console(), **kwargs)
        assert e.value.code == 2 and words in str(e.value)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(DsfixError, match="new or empty"):
        run_smoke(good_checkout, config_path=NARROW, keep=tmp_path / "full", console=quiet_console())


@needs_deepspeed
def test_fails_on_the_article_save_under_zero3(zero3_article_run):
    report, _ = zero3_article_run
    assert not report.ok
    bad = failed(report)
    assert "no config.json" in bad["config"]
    assert "311 of 311 tensors are empty" in bad["non-empty"]
    assert report.check("count").ok  # 311 tensors ...
    assert report.save_output.strip() == "loaded 311 tensors"  # ... and the article's own count agrees
    assert "no save_zero_three_model_safetensors to call under ZeRO-3" in report.check("save").detail


def test_fails_on_a_save_without_config(tmp_path):
    checkout = make_checkout(tmp_path / "DeepSpeed-Chat", broken_code("no_config_utils.py"))
    report = run_smoke(checkout, config_path=NARROW, dtype="fp32", console=quiet_console())
    assert not report.ok
    assert set(failed(report)) == {"config"}
    assert report.check("non-empty").ok and report.check("count").ok
    assert report.check("logits") is None  # nothing to reload without config.json


NAN_SAVE = """
def save_hf_format_safetensors(model, tokenizer, args, sub_folder=""):
    from safetensors.torch import save_file

    inner = model.module if hasattr(model, "module") else model
    out = os.path.join(args.output_dir, sub_folder)
    os.makedirs(out, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in inner.state_dict().items()}
    state["model.norm.weight"][1] = float("nan")
    state["model.layers.7.mlp.down_proj.weight"][0, 0] = float("-inf")
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    inner.config.to_json_file(os.path.join(out, "config.json"))
    tokenizer.save_pretrained(out)
"""


def test_fails_on_weights_that_hold_nan_or_inf(tmp_path):
    report = run_smoke(make_checkout(tmp_path / "DeepSpeed-Chat", NAN_SAVE), config_path=NARROW, dtype="fp32",
                       console=quiet_console())
    assert report.exit_code == 1
    assert failed(report)["finite"] == ("2 of 311 floating tensors hold NaN or Inf, the first "
                                        "model.layers.7.mlp.down_proj.weight")


def test_a_save_that_raises_is_a_failed_check(tmp_path):
    body = "def save_hf_format_safetensors(model, tokenizer, args, sub_folder=''):\n    raise ValueError('boom')\n"
    report = run_smoke(make_checkout(tmp_path / "DeepSpeed-Chat", body), config_path=NARROW, dtype="fp32",
                       console=quiet_console())
    assert not report.ok
    assert "rank 0 failed in save: ValueError: boom" in failed(report)["save"]
    assert "no model weights" in failed(report)["weights"]


def test_ast_fallback_when_the_utils_import_fails(tmp_path):
    checkout = patched_checkout(tmp_path / "DeepSpeed-Chat",
                                extra_imports="import dsfix_test_missing_module  # stands in for a missing deepspeed")
    report = run_smoke(checkout, config_path=NARROW, dtype="fp32", console=quiet_console())
    assert report.ok, report.to_json()
    assert report.load_method == "ast"
    assert "ModuleNotFoundError: No module named 'dsfix_test_missing_module'" in report.load_detail
    assert "skipped imports" in report.load_detail
    # the row passed: it says how the functions were found, and the why is one warning, said once
    functions = report.check("functions")
    assert functions.ok and "with ast" in functions.detail and "ModuleNotFoundError" not in functions.detail
    if importlib.util.find_spec("deepspeed") is None:  # the import stops at DeepSpeed first: expected, no warning
        assert report.warnings == []
    else:
        assert len(report.warnings) == 1 and "dsfix_test_missing_module" in report.warnings[0]
    assert report.to_dict()["warnings"] == report.warnings


def test_ast_extraction_runs_only_imports_and_dsfix_definitions(tmp_path):
    utils = tmp_path / "utils.py"
    utils.write_text(
        "from __future__ import annotations\n"
        "import os\n"
        "import dsfix_test_missing_module\n"
        "raise SystemExit('top-level code must not run')\n"
        "_DSFIX_X = 3\n"
        "OTHER = 4\n"
        "def other():\n    pass\n"
        "def _dsfix_helper(a: NotDefined) -> int:\n    return _DSFIX_X + len(os.sep)\n"
        "def save_hf_format_safetensors(model, tokenizer, args, sub_folder=''):\n    return _dsfix_helper(1)\n"
    )
    ns, skipped = extract_definitions(utils)
    assert ns["save_hf_format_safetensors"](None, None, None) == 4
    assert "OTHER" not in ns and "other" not in ns
    assert len(skipped) == 1 and "dsfix_test_missing_module" in skipped[0]


def test_legacy_layout(tmp_path):
    pytest.importorskip("deepspeed")
    checkout = patched_checkout(tmp_path / "DeepSpeed-Chat", layout="legacy")
    report = run_smoke(checkout, config_path=NARROW, dtype="fp32", console=quiet_console())
    assert report.ok, report.to_json()
    assert report.load_detail == "import utils.utils"


def test_real_weights_from_a_model_dir(good_checkout, tmp_path):
    model_dir = tmp_path / "model"
    narrow_model("float32", seed=3).save_pretrained(str(model_dir))
    make_tiny_tokenizer(tmp_path / "tok-src").save_pretrained(str(model_dir))
    report = run_smoke(good_checkout, model_dir=model_dir, dtype="fp32", console=quiet_console(), train_steps=0)
    assert report.ok, report.to_json()
