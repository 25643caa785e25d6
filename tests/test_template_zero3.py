"""The template under real DeepSpeed: ZeRO-3 on 2 CPU ranks (gloo) and ZeRO-0 on 1, via the launcher.

fixtures/step1_trainer/train.py trains the narrow Qwen3 a few steps and saves the way
DeepSpeed-Chat's step 1 does, with the two functions loaded from templates/save_safetensors.py.
"""
import json
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # ZeRO-3 ranks

pytest.importorskip("deepspeed")

from patcher.checkpoint.verify import dtype_kwarg  # noqa: E402
from smokekit import run_trainer  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_KEYS = 311


def _saved_tensors(out):
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.load(open(index))["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors, headers = {}, {}
    for name in files:
        tensors.update(load_file(str(out / name)))
        with safe_open(str(out / name), framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                headers[key] = (piece.get_shape(), piece.get_dtype())
    return tensors, headers, files


def _check_against_reference(tmp_path, expected_keys, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    names = set(os.listdir(out))
    assert "config.json" in names and "tokenizer_config.json" in names
    assert not any(n.startswith("pytorch_model") for n in names), names
    assert not any(n.endswith(".dsfix-tmp") for n in names), names
    tensors, headers, files = _saved_tensors(out)
    ref = torch.load(str(tmp_path / "ref" / "reference.pt"))
    reference = ref["state_dict"]
    assert len(reference) == QWEN3_KEYS
    assert len(tensors) == expected_keys
    for key, value in tensors.items():
        assert value.numel() > 0, key
        assert value.dtype == dtype, key
        assert torch.equal(value, reference[key]), key
    assert set(reference) - set(tensors) <= {"lm_head.weight"}

    model = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation=ref["attn_implementation"],
                                                 **{dtype_kwarg(): dtype}).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for key, value in model.state_dict().items():
        assert torch.equal(value, reference[key]), key
    if dtype == torch.float32:
        with torch.no_grad():
            logits = model(input_ids=ref["probe"]).logits
        assert torch.equal(logits, ref["logits"])
    assert AutoTokenizer.from_pretrained(str(out))("what is tea").input_ids
    return files


def _variants(**named):
    """--variants for the trainer: folder -> (module constants, fail_rank[, misuse_zero_stage]); each saves
    again into that folder."""
    return json.dumps([{"dir": str(path), "constants": how[0], "fail_rank": how[1],
                        "misuse_zero_stage": how[2] if len(how) > 2 else None} for path, how in named.items()])


def test_zero3_two_cpu_ranks_clone(tmp_path):
    """The save, then again gathering one at a time and in 0.3 MB buckets, then with a write failure on rank 0
    and once misused (below)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "pytorch_model.bin").write_text("stale")
    one, mid, misused = tmp_path / "one_at_a_time", tmp_path / "bucket_300k", tmp_path / "misused"
    failed = tmp_path / "failed"
    code, output = run_trainer(tmp_path, 2, 3, "--variants", _variants(**{
        str(one): ({"_DSFIX_GATHER_BUCKET_MB": 0}, None), str(mid): ({"_DSFIX_GATHER_BUCKET_MB": 0.3}, None),
        str(failed): ({}, 0), str(misused): ({}, None, 0)}))
    assert code == 0, output[-6000:]
    assert '"world_size": 2' in output and '"zero_stage": 3' in output
    assert "[dsfix] lm_head.weight shares storage with model.embed_tokens.weight: written as its own copy" in output
    assert "[dsfix] verified 311 tensors (names, shapes, dtypes; none empty)" in output
    assert "written by save_zero_three_model_safetensors" in output
    assert "[train] ZeRO-3: 310 of 310 parameters partitioned before saving" in output  # all gathered
    assert output.count("[dsfix] saved weights") == 3  # rank 0 only, once per save that succeeded
    files = _check_against_reference(tmp_path, QWEN3_KEYS, torch.float32)
    assert files == ["model.safetensors"]
    # Bucketed gathers (the default, and 0.3 MB) write the very bytes the one-at-a-time gather writes.
    gathers = int(re.search(r"\[train\] gathers during the save: (\d+)", output).group(1))
    assert 1 <= gathers <= 40
    assert "[train] variant one_at_a_time on rank 1: ok; gathers 310" in output  # the tied alias rides along
    found = re.search(r"\[train\] variant bucket_300k on rank 1: ok; gathers (\d+)", output)
    assert found and 10 <= int(found.group(1)) <= 40, output[-3000:]
    first = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert (one / "model.safetensors").read_bytes() == first
    assert (mid / "model.safetensors").read_bytes() == first

    # The only writer fails to open its file: it still walks every gather with the other rank, then raises;
    # no weight file is left, and the other rank, which wrote nothing, is not left waiting.
    assert re.search(r"\[train\] variant failed on rank 0: failed: dsfix: writing the weights to \S+ failed: "
                     r"injected write failure on rank 0; gathers \d+", output), output[-6000:]
    assert re.search(r"\[train\] variant failed on rank 1: ok; gathers \d+", output), output[-6000:]
    left = sorted(os.listdir(failed))
    assert "config.json" in left and not [n for n in left if n.startswith(("model", ".")) or n.endswith(".bin")], left

    # Passing zero_stage=0 under ZeRO-3 makes rank 0 write without gathering: the empty placeholders must
    # fail verification before a byte is written, not be reported as 311 saved tensors.
    refused = re.search(r"\[train\] variant misused on rank 0: failed: (.*); gathers 0", output)
    assert refused and "verification failed" in refused.group(1) and "ZeRO-3 placeholder" in refused.group(1)
    assert output.count("[dsfix] verified") == 3  # the three saves above, not this one
    assert not [n for n in os.listdir(misused) if n.startswith(("model", ".")) or n.endswith(".bin")]


def test_zero3_two_cpu_ranks_bf16_dedupe_sharded(tmp_path):
    # DeepSpeed-Chat's threshold 1e4: small parameters stay whole, the embedding is gathered.
    code, output = run_trainer(tmp_path, 2, 3, "--dtype", "bf16", "--strategy", "dedupe",
                               "--max_shard_size", "400000", "--persistence_threshold", "1e4")
    assert code == 0, output[-6000:]
    assert "[train] ZeRO-3: 1 of 310 parameters partitioned before saving" in output
    assert "verified 310 tensors" in output
    files = _check_against_reference(tmp_path, QWEN3_KEYS - 1, torch.bfloat16)
    assert len(files) > 1


def test_zero0_one_rank(tmp_path):
    code, output = run_trainer(tmp_path, 1, 0)
    assert code == 0, output[-6000:]
    assert "verified 311 tensors" in output
    assert "written by save_zero_three_model_safetensors" not in output
    _check_against_reference(tmp_path, QWEN3_KEYS, torch.float32)


def test_zero3_two_cpu_ranks_with_a_checkout_patched_by_dsfix(zero3_patched_run):
    """The same save sequence, with the functions dsfix apply inserted into a fixture checkout's utils.py; in
    the same run the checkout's own functions save too (upstream's .bin): dsfix's tensors equal them."""
    tmp_path, code, output = zero3_patched_run
    assert code == 0, output[-6000:]
    assert "[dsfix] verified 311 tensors (names, shapes, dtypes; none empty)" in output
    assert "[train] ZeRO-3: 310 of 310 parameters partitioned before saving" in output
    _check_against_reference(tmp_path, QWEN3_KEYS, torch.float32)
    assert "[train] variant original on rank 0: ok" in output
    before = torch.load(str(tmp_path / "original" / "pytorch_model.bin"), weights_only=True)
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert len(before) == 310 and set(after) == set(before) | {"lm_head.weight"}
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert torch.equal(after["lm_head.weight"], before["model.embed_tokens.weight"])
