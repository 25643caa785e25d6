"""The save module under real DeepSpeed engines on 2 CPU ranks (gloo), through the deepspeed launcher.

tests/module_ranks.py trains the narrow Qwen3 two steps on each rank, then saves as DeepSpeed-Chat's step 1
does, with the module's two functions, once per step named on its command line. Three runs in one launch
(RUNS: the module's fixture starts the runs the selected tests read, each building its own engine, so that
the ranks start and import DeepSpeed once): ZeRO-0 (the save and the fallback), ZeRO-3 in bf16 with dedupe
and shards, and ZeRO-3 (the save, gather sizes, a misuse, the fallback, NaN, a rank that dies: last, since the
launcher then stops every rank). Last, the session's one ZeRO-3 run of a fixture checkout patched by `dsfix
apply` (conftest's zero3_patched_run, shared with other tests).
"""
import hashlib
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # ranks

pytest.importorskip("deepspeed")

from patcher.templates import dsfix_safetensors as M  # noqa: E402
from smokekit import REPO, launch_ranks  # noqa: E402

DRIVER = REPO / "tests" / "module_ranks.py"
QWEN3_KEYS = 311


# Which run of the one launch each test reads, in the order they run: the last one's rank 1 dies on purpose.
RUNS = {
    "test_zero0_save_and_fallback": {"name": "zero0", "zero_stage": 0, "steps": ["save", "fallback"]},
    "test_zero3_bf16_dedupe_in_shards": {"name": "bf16", "zero_stage": 3, "dtype": "bf16", "strategy": "dedupe",
                                         "max_shard_size": 400000, "persistence_threshold": 1e4, "steps": ["save"]},
    "test_zero3_save_gathers_fallback_nan_and_a_rank_that_dies": {
        "name": "zero3", "zero_stage": 3, "steps": ["save", "one", "small", "misused", "fallback", "nan", "killed"]},
}


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """(work folder, smokekit.Launch): one launch of module_ranks.py for the runs the selected tests of this module
    read (the floor environment selects ZeRO-0's alone)."""
    selected = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    work = tmp_path_factory.mktemp("module-ranks")
    runs = [run for test, run in RUNS.items() if test in selected]
    return work, launch_ranks(DRIVER, ["--work", work, "--runs", json.dumps(runs)])


class Part:
    """One run's part of a launch: each rank's lines from its ``[ranks] run NAME`` to the next run's first line."""

    def __init__(self, launch, name):
        self.launch, self.name = launch, name
        self.output = "".join(self.section(launch.logs[rank], name) for rank in sorted(launch.logs))
        self.done = self.output.count(f"[ranks] run {name} done\n") == launch.nprocs

    @staticmethod
    def section(log, name):
        lines, keep = [], False
        for line in log.splitlines(keepends=True):
            if line.startswith("[ranks] run ") and not line.rstrip().endswith(" done"):
                keep = line.rstrip() == f"[ranks] run {name}"
            if keep:
                lines.append(line)
        return "".join(lines)

    def report(self):
        return self.launch.report()


def part(launched, test):
    """(this test's run folder, its Part of the launch)."""
    work, launch = launched
    name = RUNS[test]["name"]
    return work / name, Part(launch, name)


def outcome(run, step, rank):
    found = re.search(rf"^\[ranks\] {step} on rank {rank}: (.*); gathers (\d+)$", run.output, re.M)
    assert found, f"no outcome of {step} on rank {rank}:\n{run.report()}"
    return found.group(1), int(found.group(2))


def reference(work):
    return torch.load(str(work / "ref" / "reference.pt"))


def saved(folder):
    """{name: tensor} of a folder's safetensors (one file or shards)."""
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(folder / name)))
    return tensors


def files(folder):
    """As module_ranks.files: {name: [sha256, inode]} of the files in ``folder``."""
    return {n: [hashlib.sha256((folder / n).read_bytes()).hexdigest(), (folder / n).stat().st_ino]
            for n in sorted(os.listdir(folder)) if (folder / n).is_file()}


def before(run, step):
    """The files of the previous save the step started from, as rank 0 printed them."""
    found = re.search(rf"^\[ranks\] {step} before: (.*)$", run.output, re.M)
    assert found, run.report()
    return json.loads(found.group(1))


def check_folder(folder, ref, keys, dtype):
    """The folder holds the reference's tensors, loads tied, and its logits are the reference's (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from patcher.checkpoint.check.load import dtype_kwarg

    names = set(os.listdir(folder))
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= names, names
    assert not [n for n in names if n.startswith((".", "pytorch_model"))], names
    tensors = saved(folder)
    assert len(tensors) == keys and set(ref["state_dict"]) - set(tensors) <= {"lm_head.weight"}
    for key, value in tensors.items():
        assert value.dtype == dtype and torch.equal(value, ref["state_dict"][key]), key
    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation=ref["attn_implementation"],
                                                 **{dtype_kwarg(): dtype}).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if dtype == torch.float32:
        with torch.no_grad():
            assert torch.equal(model(input_ids=ref["probe"]).logits, ref["logits"])
    assert AutoTokenizer.from_pretrained(str(folder))("what is tea").input_ids


def check_fallback(folder, previous, ref):
    """The previous save untouched; dsfix-fallback/ converts to the reference's tensors."""
    from patcher.checkpoint.convert import convert

    assert files(folder) == previous
    assert sorted(n for n in os.listdir(folder) if n.startswith(".")) == []
    report = convert(folder / M.FALLBACK_FOLDER)
    assert report.exit_code == 0, report.to_dict()
    converted = saved(folder / M.FALLBACK_FOLDER)
    assert set(converted) == set(ref["state_dict"])
    assert all(torch.equal(converted[k], v) for k, v in ref["state_dict"].items())


def test_zero3_save_gathers_fallback_nan_and_a_rank_that_dies(launched):
    tmp_path, run = part(launched, "test_zero3_save_gathers_fallback_nan_and_a_rank_that_dies")
    output = run.output
    launch = launched[1]
    assert launch.code != 0 and not launch.finished and not run.done, \
        "rank 1 dies in the last step: the launcher stops every rank and fails"
    assert "[ranks] ZeRO-3: 310 of 310 parameters partitioned before saving" in output, run.report()
    ref = reference(tmp_path)

    # the save, as step 1 makes it: rank 0's save_hf_format leaves config and tokenizer to the weights save
    assert outcome(run, "save", 0) == ("ok", 1) and outcome(run, "save", 1) == ("ok", 1)
    assert "[dsfix] verified 311 tensors (names, shapes, dtypes; none empty)" in output
    assert f"[dsfix] removed stale pytorch_model.bin from {tmp_path / 'save'}" in output
    check_folder(tmp_path / "save", ref, QWEN3_KEYS, torch.float32)

    # other buckets, the same bytes: one parameter at a time (the tied alias rides along) and 0.3 MB
    first = (tmp_path / "save" / "model.safetensors").read_bytes()
    assert outcome(run, "one", 1) == ("ok", 310)
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == first
    result, gathers = outcome(run, "small", 1)
    assert result == "ok" and 10 <= gathers <= 40
    assert (tmp_path / "small" / "model.safetensors").read_bytes() == first

    # zero_stage=0 under ZeRO-3: rank 0 would write placeholders; refused before a byte is written
    result, gathers = outcome(run, "misused", 0)
    assert "verification failed" in result and "ZeRO-3 placeholder" in result and gathers == 0
    assert not (tmp_path / "misused").exists()

    # rank 0's writer fails: both ranks take the fallback together (a gather each), rank 0 raises its error
    assert outcome(run, "fallback", 0) == ("failed: RuntimeError: injected writer failure on rank 0", 2)
    result, gathers = outcome(run, "fallback", 1)
    assert result.startswith(f"failed: SaveError: dsfix: the save to {tmp_path / 'fallback'} failed on rank 0 "
                             "(RuntimeError: injected writer failure on rank 0)") and gathers == 2
    assert output.count("[dsfix] FALLBACK: ") == 1
    check_fallback(tmp_path / "fallback", before(run, "fallback"), ref)

    # NaN in a weight: one warning on rank 0, the weights saved all the same
    assert outcome(run, "nan", 0)[0] == "ok"
    assert output.count("[dsfix] WARNING: 1 of 311 tensors hold NaN or Inf, the first "
                        "model.layers.5.mlp.up_proj.weight; saved all the same") == 1
    assert torch.isnan(saved(tmp_path / "nan")["model.layers.5.mlp.up_proj.weight"]).sum() == 1

    # rank 1 dies in its fifth gather: the previous save stays, nothing of the new one is in place
    assert "[ranks] rank 1 dies in gather 5" in output
    assert files(tmp_path / "killed") == before(run, "killed")
    M.save_hf_format(torch.nn.Linear(2, 2), None, str(tmp_path / "killed"))  # a later save removes any leftover
    assert sorted(n for n in os.listdir(tmp_path / "killed") if n.startswith(".")) == []


def test_zero3_bf16_dedupe_in_shards(launched):
    """DeepSpeed-Chat's persistence threshold, 1e4: small parameters stay whole, the embedding is gathered."""
    tmp_path, run = part(launched, "test_zero3_bf16_dedupe_in_shards")
    assert run.done, run.report()
    assert "[ranks] ZeRO-3: 1 of 310 parameters partitioned before saving" in run.output, run.report()
    assert "[dsfix] verified 310 tensors" in run.output, run.report()
    check_folder(tmp_path / "save", reference(tmp_path), QWEN3_KEYS - 1, torch.bfloat16)
    assert len([n for n in os.listdir(tmp_path / "save") if n.startswith("model-")]) > 1


def test_zero0_save_and_fallback(launched):
    tmp_path, run = part(launched, "test_zero0_save_and_fallback")
    assert run.done, run.report()
    assert outcome(run, "save", 0) == ("ok", 0)
    assert "ZeRO-3 parameters are partitioned" not in run.output
    ref = reference(tmp_path)
    check_folder(tmp_path / "save", ref, QWEN3_KEYS, torch.float32)
    assert outcome(run, "fallback", 0) == ("failed: RuntimeError: injected writer failure on rank 0", 0)
    assert outcome(run, "fallback", 1) == ("ok", 0)  # at stage 0 rank 1 saves nothing
    check_fallback(tmp_path / "fallback", before(run, "fallback"), ref)


def test_zero3_with_a_checkout_patched_by_dsfix(zero3_patched_run):
    """fixtures/step1_trainer/train.py saves with the functions `dsfix apply` put into a fixture checkout's
    utils.py; in the same run the checkout's own functions save too (upstream's .bin, without the tied
    lm_head.weight): dsfix's tensors equal them and the reference."""
    tmp_path, run = zero3_patched_run
    assert run.ok, run.report()
    output = run.output
    assert "[dsfix] verified 311 tensors (names, shapes, dtypes; none empty)" in output, run.report()
    assert "[train] ZeRO-3: 310 of 310 parameters partitioned before saving" in output
    assert "[train] variant original on rank 0: ok" in output, run.report()
    after, ref = saved(tmp_path / "out"), reference(tmp_path)["state_dict"]
    assert set(after) == set(ref) and all(torch.equal(after[k], v) for k, v in ref.items())
    before = torch.load(str(tmp_path / "original" / "pytorch_model.bin"), weights_only=True)
    assert len(before) == 310 and set(after) == set(before) | {"lm_head.weight"}
    assert all(torch.equal(after[k], v) for k, v in before.items())
