"""Steps 2 and 3: their saves and step 3's critic loader (create_critic_model), patched with --steps.

The loader is run for real: a reward model saved by the patched step-2 save (safetensors) is read back by
the patched create_critic_model(rlhf_training=True) of the fixture checkout, tensor for tensor; an old
step-2 output (pytorch_model.bin) still loads, with weights_only=True; a pickle that runs code does not.
"""

from __future__ import annotations

import importlib
import os
import pickle
import shutil
import sys
import types

import pytest

from patchkit import cli, copy_fixture, git_apply, pyflakes_messages, snapshot

LOADER = {"package": "dschat/utils/model/model_utils.py", "legacy": "training/utils/model/model_utils.py"}
STEPS = {"package": "1,2,3", "legacy": "1,2"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["package", "legacy"])
def test_steps_full_cycle_with_the_loader(tmp_path, name):
    co, twin = copy_fixture(name, tmp_path / "a"), copy_fixture(name, tmp_path / "b")
    before = snapshot(co)
    code, diff, err = cli("check", co, "--steps", STEPS[name])
    assert code == 1, err
    assert f"+++ b/{LOADER[name]}".encode() in diff
    assert b"step2_reward_model_finetuning/main.py" in diff
    assert "_dsfix_load_checkpoint" in err and "pytorch_model.bin exists" not in err, \
        "the loader is patched: no warning"
    git_apply(diff, twin)
    assert cli("apply", co, "--steps", STEPS[name])[0] == 0
    after = snapshot(co)
    assert {k: v for k, v in after.items() if not k.startswith(".dsfix")} == snapshot(twin)
    for rel in before:
        if rel.endswith(".py") and before[rel] != after[rel]:
            assert pyflakes_messages(after[rel]) <= pyflakes_messages(before[rel]), rel
    assert cli("check", co, "--steps", STEPS[name])[0] == 0
    assert cli("apply", co, "--steps", STEPS[name])[0] == 0 and snapshot(co) == after
    assert cli("revert", co)[0] == 0 and snapshot(co) == before
    assert cli("apply", co, "--steps", STEPS[name])[0] == 0
    shutil.rmtree(co / ".dsfix")
    code, _, err = cli("revert", co)
    assert code == 0, err
    assert snapshot(co) == before, "structural revert of the loader too"


@pytest.mark.slow
def test_step3_saves_with_keywords_and_per_model_stages(tmp_path):
    co = copy_fixture("package", tmp_path)
    assert cli("apply", co, "--steps", "1,2,3")[0] == 0
    main = (co / "training/step3_rlhf_finetuning/main.py").read_text()
    assert main.count("save_hf_format_safetensors(rlhf_engine.") == 3
    assert main.count("save_zero_three_model_safetensors(rlhf_engine.") == 2
    assert "global_rank=args.global_rank," in main and "zero_stage=args.critic_zero_stage)" in main


def test_a_checkout_without_the_loader_keeps_the_warning(tmp_path):
    co = copy_fixture("package", tmp_path)
    (co / LOADER["package"]).unlink()
    code, diff, err = cli("check", co, "--steps", "1,2")
    assert code == 1 and b"step2_reward_model_finetuning/main.py" in diff
    assert "warning:" in err and "create_critic_model" in err and "pytorch_model.bin exists" in err


# ----------------------------------------------------------------------------- the loader, run for real


@pytest.fixture
def patched(tmp_path):
    co = copy_fixture("package", tmp_path / "co")
    assert cli("apply", co, "--steps", "1,2,3")[0] == 0
    sys.path.insert(0, str(co))
    importlib.invalidate_caches()
    try:
        yield (co, importlib.import_module("dschat.utils.utils"),
               importlib.import_module("dschat.utils.model.model_utils"))
    finally:
        sys.path.remove(str(co))
        for mod in [m for m in sys.modules if m == "dschat" or m.startswith("dschat.")]:
            del sys.modules[mod]


@pytest.fixture
def base_model(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer):
    folder = tmp_path / "base"
    tiny_qwen3_helper.tiny_qwen3_model(seed=1).save_pretrained(str(folder))
    tiny_qwen3_tokenizer.save_pretrained(str(folder))
    return folder


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_step2_save_is_read_by_the_patched_step3_loader(patched, base_model, tmp_path, tiny_qwen3_tokenizer):
    import torch

    co, utils, model_utils = patched
    torch.manual_seed(5)
    critic = model_utils.create_critic_model(str(base_model), tiny_qwen3_tokenizer, None)
    torch.nn.init.normal_(critic.v_head.weight)
    out = tmp_path / "step2"
    utils.save_hf_format_safetensors(critic, tiny_qwen3_tokenizer, types.SimpleNamespace(output_dir=str(out)))
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()

    loaded = model_utils.create_critic_model(str(out), tiny_qwen3_tokenizer, None, rlhf_training=True)
    want, got = _state(critic), _state(loaded)
    assert set(got) == set(want) and any(k.startswith("rwtransformer.") for k in got) and "v_head.weight" in got
    for key, value in want.items():
        assert torch.equal(got[key], value), key

    ids = torch.tensor([[3, 5, 7, 9]])
    assert torch.equal(loaded(ids), critic(ids))


@pytest.mark.slow
def test_an_old_bin_step2_output_still_loads_without_running_code(patched, base_model, tmp_path,
                                                                  tiny_qwen3_tokenizer):
    import torch

    co, utils, model_utils = patched
    critic = model_utils.create_critic_model(str(base_model), tiny_qwen3_tokenizer, None)
    old = tmp_path / "old"
    old.mkdir()
    critic.config.to_json_file(str(old / "config.json"))
    torch.save(critic.state_dict(), old / "pytorch_model.bin")
    loaded = model_utils.create_critic_model(str(old), tiny_qwen3_tokenizer, None, rlhf_training=True)
    for key, value in _state(critic).items():
        assert torch.equal(_state(loaded)[key], value), key

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    evil = tmp_path / "evil"
    shutil.copytree(old, evil)
    with open(evil / "pytorch_model.bin", "wb") as f:
        pickle.dump({"v_head.weight": RunsCode()}, f)
    with pytest.raises(pickle.UnpicklingError):
        model_utils.create_critic_model(str(evil), tiny_qwen3_tokenizer, None, rlhf_training=True)
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_the_unpatched_loader_is_what_made_step2_safetensors_a_trap(tmp_path, base_model, tiny_qwen3_tokenizer):
    """Before dsfix: upstream-shaped create_critic_model asserts that pytorch_model.bin exists."""
    co = copy_fixture("package", tmp_path / "plain")
    sys.path.insert(0, str(co))
    importlib.invalidate_caches()
    try:
        model_utils = importlib.import_module("dschat.utils.model.model_utils")
        folder = tmp_path / "st"
        shutil.copytree(base_model, folder)  # config and model.safetensors, no pytorch_model.bin
        with pytest.raises(AssertionError, match="Cannot find model checkpoint"):
            model_utils.create_critic_model(str(folder), tiny_qwen3_tokenizer, None, rlhf_training=True)
    finally:
        sys.path.remove(str(co))
        for mod in [m for m in sys.modules if m == "dschat" or m.startswith("dschat.")]:
            del sys.modules[mod]
