"""benchmarks/bench_scale.py's smallest real form as a test of behaviour (never of time): a synthetic Qwen3-0.6B
ZeRO-3 checkpoint of 8 ranks, written rank by rank, converted by dsfix, verified by dsfix, and converted by
DeepSpeed's zero_to_fp32 with its defaults; dsfix's output bit-equal to zero_to_fp32's cast to bf16. And
``--more`` at the narrow Qwen3's size: verify --against, a step-3 folder and a PEFT merge, each in bounded memory.

One run of the benchmark (100 s on the 2-core machine, zero_to_fp32, the comparison and ``--more`` included)
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
                           "--cases", "3:8:0.6B", "--compare", "0.6B", "--more", "narrow", "--warm", "--tmpdir",
                           str(work), "--json", str(json_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in work.iterdir()) == ["scale.json"]  # every checkpoint and output deleted
    assert str(work) not in json_path.read_text()  # no machine paths: the --tmpdir folder is kept as DIR
    saved = json.loads(json_path.read_text())
    (case,) = saved["cases"]
    return proc.stdout, case, saved["more"]


def test_checkpoint_is_made_rank_by_rank(scale_run):
    _, case, _ = scale_run
    assert (case["stage"], case["world"], case["size"]) == (3, 8, "0.6B")
    assert case["params"] == 596049920 and case["master_bytes"] == 4 * case["params"]
    floor = case["results"]["floor"]
    assert floor["read_bytes"] >= case["master_bytes"]  # the masters, read once (the stub moments add a little)


def test_convert_is_bit_equal_to_zero_to_fp32(scale_run):
    text, case, _ = scale_run
    results = case["results"]
    assert results["convert"]["ok"] and results["convert"]["tensors"] == 311
    assert results["zero_to_fp32"]["ok"]
    assert case["bit_equal"] == {"compared": 311, "differ": [], "only_here": [], "ok": True}
    assert "| ZeRO-3, 8, 0.6B |" in text and "yes (311 tensors)" in text
    # convert streams: far below the fp32 model it reads (2.2 GiB) and below the bf16 model it writes
    assert results["convert"]["anon_peak"] < WHOLE_MODEL_BF16


def test_verify_passes_and_is_judged_by_one_read_of_its_folder(scale_run):
    _, case, _ = scale_run
    assert case["results"]["verify"]["ok"]
    read = case["results"]["read_output"]["read_bytes"]  # every tensor's bytes once, and the files' headers
    assert case["output_bytes"] < read < case["output_bytes"] + 2**20


def test_verify_memory_is_bounded(scale_run):
    """A whole-model load breaks this bound (in fp32: 2.2 GiB; in bf16, with torch imported: about 1.4 GiB)."""
    _, case, _ = scale_run
    bound = 1 * GIB + LARGEST_BF16
    assert bound < WHOLE_MODEL_BF16 + 0.25 * GIB < 4 * 596049920
    assert case["results"]["verify"]["anon_peak"] <= bound, math.ceil(case["results"]["verify"]["anon_peak"] / 2**20)


def test_verify_against_a_step3_folder_and_a_peft_merge_pass_in_bounded_memory(scale_run):
    """--more: two model folders of the same values compared, a step-3 folder (actor, actor_ema, critic)
    verified, a LoRA adapter of PEFT's own naming merged into its base, and the merged folder verified."""
    text, _, more = scale_run
    (found,) = more
    assert found["size"] == "narrow" and found["ok"]
    results = found["results"]
    for key in ("against", "step3", "merge", "verify_merged"):
        assert results[key]["ok"] and results[key]["anon_peak"] <= GIB + found["largest_bytes"], key
    # each judged by reading what it reads: both folders; actor, actor_ema and critic; the merged folder
    assert 2 * found["folder_bytes"] < results["read_pair"]["read_bytes"] < 2 * found["folder_bytes"] + 2**20
    assert results["read_step3"]["read_bytes"] > results["read_pair"]["read_bytes"]
    assert found["folder_bytes"] < results["read_merged"]["read_bytes"] < found["folder_bytes"] + 2**20
    assert "| narrow, dsfix verify A --against B (two folders) |" in text
    assert "narrow, dsfix convert --merge, a LoRA adapter into its base: anon" in text


@pytest.mark.parametrize("later_z2f,floor_for_z2f,bit_equal_from", [
    (False, 10.0, "first"),  # the later run did not run zero_to_fp32: its ratio stays against the first floor
    (True, 5.0, "later"),  # it did: its figures, its floor and its comparison replace the first run's
])
def test_merged_runs_keep_each_ratio_within_one_run(tmp_path, later_z2f, floor_for_z2f, bit_equal_from):
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import bench_scale

    def run(name, floor, z2f=None, bit=None):
        case = {"stage": 3, "world": 8, "size": "0.6B", "results": {
            "floor": {"floor_s": floor}, "convert": {"wall_s": 2 * floor}, "zero_to_fp32": z2f}}
        if bit is not None:
            case["bit_equal"] = bit
        path = tmp_path / (name + ".json")
        path.write_text(json.dumps({"command": name, "machine": {}, "cases": [case]}))
        return str(path)

    first = run("first", 10.0, {"wall_s": 30.0}, {"ok": True, "from": "first"})
    later = run("later", 5.0, *(({"wall_s": 20.0}, {"ok": True, "from": "later"}) if later_z2f else ()))
    case = bench_scale.merged([first, later])["cases"][0]
    results = case["results"]
    assert results["floor"]["floor_s"] == 5.0 and results["convert"]["wall_s"] == 10.0
    assert results.get("floor_before", results["floor"])["floor_s"] == floor_for_z2f
    assert results["zero_to_fp32"]["wall_s"] == (20.0 if later_z2f else 30.0)
    assert case["bit_equal"]["from"] == bit_equal_from
