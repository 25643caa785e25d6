"""benchmarks/bench_scale.py's smallest real form as a test of behaviour (never of time): a synthetic Qwen3-0.6B
ZeRO-3 checkpoint of 8 ranks, written rank by rank, converted by dsfix, verified by dsfix, and converted by
DeepSpeed's zero_to_fp32 with its defaults; dsfix's output bit-equal to zero_to_fp32's cast to bf16.

One run of the benchmark (55 s on the 2-core machine at load 3, zero_to_fp32 and the comparison included)
serves every test here; the extended tier runs it with --warm: the page cache kept, not dropped before each
method, which would slow every other test running beside it.
"""
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.extended

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024.0 ** 3
LARGEST_BF16 = 151936 * 1024 * 2  # Qwen3-0.6B's embedding, the largest tensor
WHOLE_MODEL_BF16 = 596049920 * 2  # its 0.6B parameters in bf16 (the tied embedding once)


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("scale")
    json_path = work / "scale.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", "bench_scale.py"),
                           "--cases", "3:8:0.6B", "--compare", "0.6B", "--warm", "--tmpdir", str(work), "--json",
                           str(json_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in work.iterdir()) == ["scale.json"]  # every checkpoint and output deleted
    (case,) = json.loads(json_path.read_text())["cases"]
    return proc.stdout, case


def test_checkpoint_is_made_rank_by_rank(scale_run):
    _, case = scale_run
    assert (case["stage"], case["world"], case["size"]) == (3, 8, "0.6B")
    assert case["params"] == 596049920 and case["master_bytes"] == 4 * case["params"]
    floor = case["results"]["floor"]
    assert floor["read_bytes"] >= case["master_bytes"]  # the masters, read once (the stub moments add a little)


def test_convert_is_bit_equal_to_zero_to_fp32(scale_run):
    text, case = scale_run
    results = case["results"]
    assert results["convert"]["ok"] and results["convert"]["tensors"] == 311
    assert results["zero_to_fp32"]["ok"]
    assert case["bit_equal"] == {"compared": 311, "differ": [], "only_here": [], "ok": True}
    assert "| ZeRO-3, 8, 0.6B |" in text and "yes (311 tensors)" in text
    # convert streams: far below the fp32 model it reads (2.2 GiB) and below the bf16 model it writes
    assert results["convert"]["anon_peak"] < WHOLE_MODEL_BF16


def test_verify_passes_and_is_judged_by_one_read_of_its_folder(scale_run):
    _, case = scale_run
    assert case["results"]["verify"]["ok"]
    read = case["results"]["read_output"]["read_bytes"]  # every tensor's bytes once, and the files' headers
    assert case["output_bytes"] < read < case["output_bytes"] + 2**20


def test_verify_memory_is_bounded(scale_run):
    """A whole-model load breaks this bound (in fp32: 2.2 GiB; in bf16, with torch imported: about 1.4 GiB)."""
    _, case = scale_run
    bound = 1 * GIB + LARGEST_BF16
    assert bound < WHOLE_MODEL_BF16 + 0.25 * GIB < 4 * 596049920
    assert case["results"]["verify"]["anon_peak"] <= bound, math.ceil(case["results"]["verify"]["anon_peak"] / 2**20)
