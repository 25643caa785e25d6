"""Smoke test of benchmarks/bench_save.py: --quick (narrow Qwen3, 1 round, CPU). No timing assertions."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "bench_save.py")

# Qwen3 with 28 layers and tied embeddings: 311 state-dict keys; dropping the tied lm_head gives 310.
EXPECTED_TENSORS = {
    "dsfix_clone": 311,
    "dsfix_dedupe": 310,
    "transformers": 310,
    "save_model": 310,
    "article": 311,
    "torch_save": 311,
    "raw": None,
}
LABELS = ("dsfix clone", "dsfix dedupe", "transformers save_pretrained", "safetensors save_model",
          "article (clone+save_file+load_file)", "upstream torch.save (.bin)", "raw write (disk limit)")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path = out / "bench.json"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for name in ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--device", "cpu", "--check-runs", "1", "--verify-runs", "1",
         "--tmpdir", str(out), "--json", str(json_path)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(json_path) as handle:
        report = json.load(handle)
    return proc, report, out


def test_prints_the_table_and_ratios(quick_run):
    proc, _, _ = quick_run
    text = proc.stdout
    assert "| method | wall s | best s | MiB/s | written MiB | peak RSS above model MiB | tensors |" in text
    for label in LABELS:
        assert "| %s | " % label in text, label
    for ratio in ("dsfix clone / article", "dsfix clone / transformers", "dsfix dedupe / transformers",
                  "dsfix clone / raw write", "peak RSS above model, dsfix clone"):
        assert ratio in text, ratio
    assert "dsfix header-only verify" in text
    assert "python -m patcher check DIR" in text
    assert "machine: " in text


def test_every_method_wrote_its_files(quick_run):
    _, report, _ = quick_run
    cpu = report["devices"]["cpu"]
    assert [r for r in cpu["results"] if "error" in r] == []
    by_method = {r["method"]: r for r in cpu["results"]}
    assert set(by_method) == set(EXPECTED_TENSORS)
    for method, expected in EXPECTED_TENSORS.items():
        result = by_method[method]
        assert result["bytes_written"] > 0, method
        assert result["tensors"] == expected, (method, result["tensors_by_file"])
    assert "model.safetensors" in by_method["dsfix_clone"]["files"]
    assert "config.json" in by_method["dsfix_clone"]["files"]
    assert "pytorch_model.bin" in by_method["torch_save"]["files"]
    # the raw write matches dsfix clone's file byte for byte in size
    assert by_method["raw"]["bytes_written"] == by_method["dsfix_clone"]["files"]["model.safetensors"]


def test_verification_and_check_part(quick_run):
    _, report, out = quick_run
    verify = report["verify"]
    assert "error" not in verify, verify.get("output_tail")
    assert sorted(tuple(c) for c in verify["counts"]) == [("header", 311), ("reload", 311)]
    check = report["check"]
    assert check["exit_codes"] == [1]
    assert check["imports"]["torch"] is False
    # the benchmark cleans up after itself
    assert [p.name for p in out.iterdir()] == ["bench.json"]
