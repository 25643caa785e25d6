"""Smoke test of benchmarks/bench_convert.py: --quick (narrow Qwen3, 1 round). No timing assertions."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # runs the convert benchmark on a model

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "bench_convert.py")


@pytest.mark.extended  # 20 s of a benchmark's harness: kept from rotting in the extended tier
def test_quick_run_prints_the_table_and_converts(tmp_path):
    json_path = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS")}
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--tmpdir", str(tmp_path), "--json", str(json_path)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| method | wall s | tensors | peak RssAnon MiB | anon above imports MiB | peak RssFile MiB |" in proc.stdout
    for ratio in ("dsfix convert --no-load / plain script", "dsfix convert / file copy", "anon memory above imports"):
        assert ratio in proc.stdout
    results = json.loads(json_path.read_text())["results"]
    tensors = {key: [r.get("tensors") for r in runs] for key, runs in results.items()}
    assert tensors == {"convert": [311], "convert_noload": [311], "convert_dedupe": [310], "plain": [311],
                       "copy": [None]}
    assert all(r["returncode"] == 0 for runs in results.values() for r in runs)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # the benchmark cleans up after itself
