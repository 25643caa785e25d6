"""Smoke tests of the benchmarks' --quick modes (narrow Qwen3, 1 round, CPU). No timing assertions."""
import json
import os
import subprocess
import sys

import pytest

# the extended tier, with the device check, which runs bench_save too: the save benchmarks' quick runs on
# models, ZeRO-3 ranks included
pytestmark = [pytest.mark.slow, pytest.mark.extended]

pytest.importorskip("transformers")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, tmp_path, *extra):
    json_path = tmp_path / "bench.json"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", script), "--quick",
                           "--tmpdir", str(tmp_path), "--json", str(json_path)] + list(extra),
                          cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # it cleans up after itself
    return proc.stdout, json.loads(json_path.read_text())


def test_bench_save_quick(tmp_path):
    text, report = _run("bench_save.py", tmp_path)
    assert "| method | wall s | best s | MiB/s | written MiB | peak RSS above model MiB | tensors |" in text
    for ratio in ("dsfix clone / article", "dsfix clone / transformers", "dsfix dedupe / transformers",
                  "dsfix clone / raw write", "peak RSS above model, dsfix clone", "the NaN/Inf check alone",
                  "dsfix clone / dsfix clone without the check"):
        assert ratio in text, ratio
    by_method = {r["method"]: r for r in report["results"]}
    assert not [r for r in report["results"] if "error" in r]
    expected = {"dsfix_clone": 311, "dsfix_dedupe": 310, "finite": None, "dsfix_clone_nocheck": 311,
                "transformers": 310, "save_model": 310, "article": 311, "torch_save": 311,
                "raw": None}  # 28 layers x 11 + 3; the tied lm_head dropped: 310
    assert {m: r["tensors"] for m, r in by_method.items()} == expected
    clone_data = by_method["raw"]["bytes_written"]  # the raw write is as long as dsfix clone's tensor data
    assert clone_data < by_method["dsfix_clone"]["bytes_written"] < clone_data + 64 * 1024
    assert by_method["finite"]["finite"] is True and by_method["finite"]["bytes_written"] == 0


def test_bench_zero3_quick(tmp_path):
    pytest.importorskip("deepspeed")
    # its own per-launch limit, below this test's, so that a hung launch is killed with all its ranks
    text, runs = _run("bench_zero3.py", tmp_path, "--timeout", "300")
    assert "#### 2 ranks" in text and "dsfix bucketed / faster of upstream and DeepSpeed" in text
    (run,) = runs
    summary = run["summary"]
    assert run["world"] == 2 and set(summary) == {"one", "bucketed", "dedupe", "upstream", "deepspeed", "plain",
                                                  "gather"}
    for method in ("one", "bucketed", "plain"):
        assert summary[method]["tensors"] == 311, method
    assert summary["upstream"]["tensors"] == summary["dedupe"]["tensors"] == 310  # the tied lm_head dropped
    assert summary["dedupe"]["bytes_written"] < summary["bucketed"]["bytes_written"]
    assert summary["bucketed"]["files"] == 1
    assert summary["bucketed"]["gathers"] <= summary["one"]["gathers"]
    assert summary["gather"]["bytes_written"] == 0
