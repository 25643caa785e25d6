"""The save module swept over every filesystem call it makes (tests/savesweep.py, tests/faultkit.py): each call
failed once with each errno of its kind, and the save killed (SIGKILL) right before it, for save_hf_format at
ZeRO-0 and for the fallback; ZeRO-3 on 2 CPU ranks: tests/test_save_module_faults_ranks.py.

The model is the narrow Qwen3 of the other tests (tied embeddings) with 2 of its 28 layers and 4 shards: the
layers repeat one loop of calls, and the sweep reaches every distinct call (each kind of file, shards and the
index, the final phase's moves, the removal of what older saves left) in 98 calls instead of 880. Built once
per module; a failure runs in this process, a kill in a fork of it. The main suite runs every seventh call;
the extended tier (`pytest --extended`) runs them all.
"""
import json
import os
import re

import pytest
import torch

from patcher.templates import dsfix_safetensors as M
from savesweep import Sweep, previous_save

pytestmark = pytest.mark.slow

LAYERS = 2
SHARD = 150_000  # bytes: 4 shards and an index


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, tiny_qwen3_helper, tiny_qwen3_tokenizer):
    """{"zero0": the save of a 2-layer narrow Qwen3 in 4 shards, "fallback": the same model holding a complex
    buffer, which safetensors cannot store: every call is the fallback's}, each recorded once."""
    torch.set_num_threads(1)  # forks of this process run torch: no thread pool to inherit half-way
    helper, tokenizer = tiny_qwen3_helper, tiny_qwen3_tokenizer
    previous = helper.tiny_qwen3_model(seed=5, num_hidden_layers=LAYERS)
    model = helper.tiny_qwen3_model(seed=11, num_hidden_layers=LAYERS)
    odd = helper.tiny_qwen3_model(seed=12, num_hidden_layers=LAYERS)
    odd.register_buffer("phase", torch.ones(3, dtype=torch.complex64))
    found = {}
    for name, saved in (("zero0", model), ("fallback", odd)):
        sweep = Sweep(tmp_path_factory.mktemp(name), lambda out, m=saved: M.save_hf_format(
            m, tokenizer, out, max_shard_size=SHARD), lambda folder: previous_save(folder, previous, tokenizer),
            saved.state_dict())
        sweep.record()
        found[name] = sweep
    return found


def documented_calls():
    """{operation: calls} from the table in docs/save-module.md, and the transformers version it was counted with."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "save-module.md"), encoding="utf-8").read()
    operations = r"`save_hf_format`, ZeRO-0|`save_zero_three_model`, ZeRO-3|the fallback"
    rows = dict(re.findall(rf"^\| ({operations})[^|]* \| (\d+) \|", text, re.M))
    return {k: int(v) for k, v in rows.items()}, re.search(r"The counts are with transformers (\S+) ", text).group(1)


def test_the_recorded_runs_make_the_calls_the_table_in_the_docs_gives(sweeps):
    import transformers

    zero0, fallback = sweeps["zero0"], sweeps["fallback"]
    assert zero0.baseline is None and sorted(os.listdir(zero0.out))[:2] == ["config.json", "generation_config.json"]
    assert fallback.baseline[0] == "ValueError" and "FALLBACK:" in fallback.expected_printed
    kinds = {call.kind for call in zero0.calls}
    assert kinds == {"mkdir", "open", "write", "fsync", "rename", "rmtree", "unlink"}, kinds
    rows, version = documented_calls()
    assert set(rows) == {"`save_hf_format`, ZeRO-0", "`save_zero_three_model`, ZeRO-3", "the fallback"}
    if transformers.__version__.startswith(version):  # the tokenizer's own calls vary with the version
        assert len(zero0.calls) == rows["`save_hf_format`, ZeRO-0"]
        assert len(fallback.calls) == rows["the fallback"]


def _sweep(sweep, every, kills=True):
    problems = []
    for n, error in sweep.cases(every):
        problems += sweep.fail(n, error)
    if kills:
        for n in range(0, len(sweep.calls), every):
            problems += sweep.kill(n)
    return problems


@pytest.mark.parametrize("name", ["zero0", "fallback"])
def test_every_seventh_call_failed_and_killed(sweeps, name):
    """The main suite's share of the sweep: calls 0, 7, 14, ... of each operation."""
    problems = _sweep(sweeps[name], 7)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.extended
@pytest.mark.parametrize("name", ["zero0", "fallback"])
def test_every_call_failed_with_each_errno_and_killed(sweeps, name):
    problems = _sweep(sweeps[name], 1)
    assert not problems, "\n".join(problems[:20])


def test_verify_names_what_a_save_killed_in_its_final_phase_left(sweeps):
    """Killed right before config.json goes into place: the weights in place are the new save's, the rest the
    previous save's; `dsfix verify` fails and names them, and the next save completes the folder."""
    from patchkit import cli

    sweep = sweeps["zero0"]
    at = next(n for n, call in enumerate(sweep.calls)
              if call.kind == "rename" and call.path == os.path.join(sweep.out, "config.json"))
    sweep.reset()
    assert os.WTERMSIG(sweep._fork_killed(at)) == 9
    code, out, err = cli("verify", sweep.out, "--json", "--no-load")
    report = json.loads(out)
    assert code == 1 and not report["ok"], report
    check = next(c for c in report["checks"] if c["name"] == "leftovers")
    assert not check["ok"]
    assert "its files in place: model-00001-of-00004.safetensors" in check["detail"]
    assert "not moved in: config.json, generation_config.json" in check["detail"]
    assert "the previous save's, moved aside" in check["detail"] and "model.safetensors" in check["detail"]
    assert "the next save into this folder completes it" in check["detail"]
    assert sweep.check_killed("the next save") == []


def test_verify_names_the_weights_a_killed_save_had_moved_aside(sweeps, tiny_qwen3_helper, tiny_qwen3_tokenizer):
    """Killed between moving the previous model.safetensors aside and its successor in: no weights in place,
    and the error says where both are."""
    from patchkit import cli

    sweep = sweeps["zero0"]
    folder = sweep.out
    sweep.reset()
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=13, num_hidden_layers=LAYERS)
    os.remove(os.path.join(folder, "pytorch_model.bin"))
    from faultkit import Faults

    with Faults(roots=[folder]) as rec:
        M.save_hf_format(model, tiny_qwen3_tokenizer, folder)
    at = [n for n, call in enumerate(rec.calls) if call.kind == "rename"
          and call.path.endswith(os.path.join(M._ASIDE, "model.safetensors"))][0] + 1
    sweep.reset()
    os.remove(os.path.join(folder, "pytorch_model.bin"))
    pid = os.fork()
    if pid == 0:
        try:
            with open(os.devnull, "w") as quiet:
                os.dup2(quiet.fileno(), 1)
                with Faults(roots=[folder], kill_at=at):
                    M.save_hf_format(model, tiny_qwen3_tokenizer, folder)
        finally:
            os._exit(0)
    assert os.WTERMSIG(os.waitpid(pid, 0)[1]) == 9
    code, out, err = cli("verify", folder)
    assert code == 2 and err.count("\n") == 1, err
    assert "no model weights" in err and "missing: model.safetensors" in err and ".replaced" in err, err
