"""What PEFT training with TRL, the Hugging Face Trainer or a plain accelerate loop under DeepSpeed writes, and two
more producers' folders: the facts a conversion of them rests on (extended tier: ``python -m pytest --extended``).

One launch of 2 CPU ranks (gloo) runs, one after another in each rank's process
(fixtures/step1_trainer/peft_ckpt.py), on the narrow tied Qwen3 in bf16: TRL's ``SFTTrainer`` with a LoRA
adapter at ZeRO-2 and ZeRO-3, the plain ``Trainer`` on a PEFT model (with ``modules_to_save`` at ZeRO-2, without
at ZeRO-3), DoRA with the plain ``Trainer`` at ZeRO-2 (with rsLoRA and per-module ranks and alphas) and ZeRO-3, an
accelerate loop's ``save_state`` at ZeRO-3 (persistence threshold 0) with its ``save_pretrained`` folder, a full
fine-tune saved with ``save_only_model`` and a plain engine's ``save_16bit_model``. Most tests read what the runs
wrote and the run's own adapter read in the training process (``reference_*.safetensors``), checking no dsfix code;
the others run ``dsfix convert`` (the adapter, and ``--merge`` against PEFT's ``merge_and_unload()``) and ``dsfix
verify`` on them, through the command line in this process (every line they print within 200 characters, the
user's paths aside).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]

torch = pytest.importorskip("torch")

from patchkit import cli, width  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LORA_KEYS = 28 * 4 * 2  # 28 layers, q/k/v/o_proj, lora_A and lora_B
TIE = {"base_model.model.lm_head.weight": "base_model.model.model.embed_tokens.weight"}


@pytest.fixture(scope="session")
def peft_runs(tmp_path_factory):
    """The launch's output folder: base/ and one folder per run."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    from smokekit import LAUNCH_TIMEOUT_S, launch_ranks

    out = tmp_path_factory.mktemp("peft-runs") / "runs"
    # nine runs in one launch: six took 85 s on an idle 2-core machine, 194 s on a loaded one; the three DoRA and
    # accelerate runs add about a third (213 s for them alone, start-up included, at load 6); three times the limit
    run = launch_ranks(REPO / "fixtures" / "step1_trainer" / "peft_ckpt.py", ["--output_dir", out],
                       env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
                       timeout=3 * LAUNCH_TIMEOUT_S)
    assert run.ok and "[peft_ckpt] saved " in run.output, run.report()
    return out


def _bits(t):
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _engine_name(peft_key: str) -> str:
    """PEFT's saved name of a LoRA factor -> the engine's parameter name (the adapter name, ``default``, put back)."""
    for part in (".lora_A.", ".lora_B."):
        if part in peft_key:
            return peft_key.replace(part, part + "default.")
    raise AssertionError(peft_key)


def _model_states(step: Path) -> dict:
    files = sorted(step.glob("*model_states.pt"))
    return torch.load(str(files[0]), weights_only=True)


def _optim_states(step: Path) -> list:
    """Each rank's optimizer_state_dict, by weights-only loads that admit DeepSpeed's three types in them."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    files = sorted(step.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return [torch.load(str(f), weights_only=True)["optimizer_state_dict"] for f in files]


def _fp32_masters(step: Path, stage: int) -> dict:
    """The fp32 master of every parameter in param_shapes, from the flat groups of the optimizer files: at ZeRO-2
    the ranks' partitions joined are the parameters one after another; at ZeRO-3 each parameter is split over the
    ranks on its own (padded to a multiple of the world size)."""
    shapes = _model_states(step)["param_shapes"]
    ranks = _optim_states(step)
    masters = {}
    for group, names in enumerate(shapes):
        if stage == 2:
            flats = [torch.cat([r["single_partition_of_fp32_groups"][group] for r in ranks])]
        else:
            flats = [r["fp32_flat_groups"][group] for r in ranks]
        offset = 0
        for name, shape in names.items():
            numel = shape.numel()
            if stage == 2:
                masters[name] = flats[0][offset:offset + numel].view(shape)
                offset += numel
            else:
                part = -(-numel // len(ranks))
                masters[name] = torch.cat([f[offset:offset + part] for f in flats])[:numel].view(shape)
                offset += part
    return masters


def test_the_base_folder_is_the_model_before_training_and_every_adapter_names_it(peft_runs):
    base = peft_runs / "base"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (base / name).is_file(), name
    weights = _tensors(base / "model.safetensors")
    assert len(weights) == 310 and "lm_head.weight" not in weights  # save_pretrained drops the tied alias
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    config = json.loads((base / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    for run in ("trl_z2", "trl_z3", "peft_trainer_z2", "peft_trainer_z3"):
        adapter = json.loads((peft_runs / run / "checkpoint-2" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(base), run
        assert (adapter["peft_type"], adapter["r"], adapter["lora_alpha"]) == ("LORA", 4, 8), run
        assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"], run


@pytest.mark.parametrize("run,stage,dtype", [("trl_z2", 2, "bfloat16"), ("trl_z3", 3, "bfloat16"),
                                             ("peft_trainer_z3", 3, "float32")])
def test_a_lora_checkpoint(peft_runs, run, stage, dtype):
    """PEFT's own file is the adapter at ZeRO-2 and empty at ZeRO-3; the engine's files hold the LoRA factors
    alone (the Trainer passes exclude_frozen_parameters), as fp32 masters whose cast to the adapter's dtype is the
    run's adapter. That dtype is the LoRA parameters' own: bf16, or fp32 where PEFT's autocast kept them so at
    ZeRO-3 (the plain Trainer's run; TRL turns it off), in a bf16 run either way."""
    checkpoint = peft_runs / run / "checkpoint-2"
    assert not (checkpoint / "config.json").exists()
    assert (checkpoint / "latest").read_text().strip() == "global_step2"
    reference = _tensors(peft_runs / run / "reference_adapter.safetensors")
    assert len(reference) == LORA_KEYS and {t.dtype for t in reference.values()} == {getattr(torch, dtype)}
    assert all(k.startswith("base_model.model.model.layers.") and ".default." not in k for k in reference)
    assert any(t.abs().sum() > 0 for k, t in reference.items() if ".lora_B." in k)  # trained: B starts at zero
    saved = _tensors(checkpoint / "adapter_model.safetensors")
    if stage == 2:
        assert set(saved) == set(reference) and all(_equal(saved[k], reference[k]) for k in reference)
    else:
        assert saved == {}  # get_peft_model_state_dict saw the partitioned parameters, not gathered

    engine_named = _tensors(peft_runs / run / "reference_engine.safetensors")
    assert set(engine_named) == {_engine_name(k) for k in reference}
    assert all(_equal(engine_named[_engine_name(k)], v) for k, v in reference.items())

    step = checkpoint / "global_step2"
    states = _model_states(step)
    names = [n for group in states["param_shapes"] for n in group]
    assert sorted(names) == sorted(engine_named)  # only the LoRA factors are parameters of the checkpoint
    assert states["frozen_param_shapes"] is None and states["frozen_param_fragments"] is None
    assert states["shared_params"] == TIE and states["buffer_names"] == []
    module = states["module"]
    # the module's state also holds the tied lm_head alias: named_parameters() leaves it out, so the filter of
    # frozen parameters does not see it; below ZeRO-3 it is the base's embedding, at ZeRO-3 a placeholder
    assert set(module) == set(names) | set(TIE)
    base = _tensors(peft_runs / "base" / "model.safetensors")
    if stage == 2:
        assert _equal(module["base_model.model.lm_head.weight"], base["model.embed_tokens.weight"])
    else:  # placeholders, in each parameter's own dtype
        assert all(t.numel() == 0 for t in module.values())
        assert {str(module[n].dtype) for n in names} == {"torch." + dtype}
    zero = states["ds_config"]["zero_optimization"]
    assert zero["stage"] == stage and states["ds_config"]["bf16"] == {"enabled": True}

    masters = _fp32_masters(step, stage)
    assert {m.dtype for m in masters.values()} == {torch.float32}
    assert all(_equal(masters[_engine_name(k)].to(v.dtype), v) for k, v in reference.items())


def test_modules_to_save_on_the_tied_model_at_zero2(peft_runs):
    """ensure_weight_tying=True: PEFT wraps both ends, trains one copy, names it model.embed_tokens in its config
    and saves it under both names; the engine holds one parameter and records both ties."""
    run = peft_runs / "peft_trainer_z2"
    checkpoint = run / "checkpoint-2"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert (config["modules_to_save"], config["ensure_weight_tying"]) == (["model.embed_tokens"], True)
    saved = _tensors(checkpoint / "adapter_model.safetensors")
    reference = _tensors(run / "reference_adapter.safetensors")
    whole = ["base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"]
    assert sorted(k for k in saved if ".lora_" not in k) == whole and len(saved) == LORA_KEYS + 2
    assert set(saved) == set(reference) and all(_equal(saved[k], reference[k]) for k in reference)
    assert _equal(saved[whole[0]], saved[whole[1]])
    base = _tensors(peft_runs / "base" / "model.safetensors")
    assert not _equal(saved[whole[1]], base["model.embed_tokens.weight"])  # trained

    states = _model_states(checkpoint / "global_step2")
    copy = "base_model.model.model.embed_tokens.modules_to_save.default.weight"
    names = [n for group in states["param_shapes"] for n in group]
    assert [n for n in names if ".lora_" not in n] == [copy] and len(names) == LORA_KEYS + 1
    assert states["shared_params"] == {
        "base_model.model.lm_head.original_module.weight": "base_model.model.model.embed_tokens.original_module.weight",
        "base_model.model.lm_head.modules_to_save.default.weight": copy}
    masters = _fp32_masters(checkpoint / "global_step2", 2)
    assert all(_equal(masters[copy].to(torch.bfloat16), saved[k]) for k in whole)


def test_modules_to_save_fails_the_trainers_zero3_save(tiny_qwen3_helper):
    """Why peft_trainer_z3 has no modules_to_save: without the 16-bit gather the Trainer saves the PEFT model with
    state_dict={}, and PEFT then fails on a wrapped module (the LoRA factors alone give an empty dict)."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    plain = get_peft_model(tiny_qwen3_helper.tiny_qwen3_model(seed=0, num_hidden_layers=1),
                           LoraConfig(r=4, target_modules=["q_proj"]))
    assert get_peft_model_state_dict(plain, state_dict={}) == {}
    wrapped = get_peft_model(tiny_qwen3_helper.tiny_qwen3_model(seed=0, num_hidden_layers=1),
                             LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                        ensure_weight_tying=True))
    with pytest.raises(KeyError, match="modules_to_save.default.weight"):
        get_peft_model_state_dict(wrapped, state_dict={})


def test_save_only_model_writes_a_model_folder_and_no_engine_files(peft_runs):
    run = peft_runs / "save_only_model_z2"
    checkpoint = run / "checkpoint-2"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.startswith("global_step") or n in ("latest", "zero_to_fp32.py") for n in names), names
    saved = _tensors(checkpoint / "model.safetensors")
    reference = torch.load(str(run / "reference.pt"), weights_only=True)["state_dict"]
    # the Trainer passes accelerate's state dict (clones): the tied lm_head is written too, equal to the embedding
    assert len(saved) == 311 and set(saved) == set(reference)
    assert all(_equal(saved[k], reference[k]) for k in saved)
    assert _equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])


def test_save_16bit_model_writes_a_bin_alone(peft_runs):
    run = peft_runs / "save16_z3"
    assert [p.name for p in (run / "model").iterdir()] == ["pytorch_model.bin"]
    saved = torch.load(str(run / "model" / "pytorch_model.bin"), weights_only=True)
    reference = torch.load(str(run / "reference.pt"), weights_only=True)
    assert reference["saved"] is True
    assert len(saved) == 311 and set(saved) == set(reference["state_dict"])
    assert all(_equal(saved[k], reference["state_dict"][k]) for k in saved)
    # the pickle keeps the tie: both names, one storage
    assert saved["lm_head.weight"].untyped_storage().data_ptr() == \
        saved["model.embed_tokens.weight"].untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- dsfix on these runs


def _cli(*args):
    """dsfix's command line in this process (typer's CliRunner, as the fault sweep runs it): torch, transformers and
    PEFT are imported once for the file, not once a command, which saves minutes here. (exit code, stdout, stderr)"""
    code, stdout, stderr = cli(*args)
    return code, stdout.decode(), stderr


def _peft_load(base: Path, adapter: Path):
    """PeftModel.from_pretrained(base, adapter) as a user runs it; and the adapter's keys PEFT found missing or
    unexpected, loading it once more into that model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base_model, str(adapter))
    result = model.load_adapter(str(adapter), adapter_name="again")
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    return model, missing, list(result.unexpected_keys)


DORA_KEYS = 28 * 2 * 3  # 28 layers, q/v_proj, lora_A, lora_B and DoRA's lora_magnitude_vector
KEYS = {"peft_trainer_z2": LORA_KEYS + 2, "dora_z2": DORA_KEYS, "dora_z3": DORA_KEYS}


@pytest.mark.parametrize("run", ["trl_z2", "trl_z3", "peft_trainer_z2", "peft_trainer_z3", "dora_z2", "dora_z3"])
def test_a_peft_run_converts_with_no_flag_to_the_adapter_it_trained(peft_runs, tmp_path, run):
    """The run folder alone: its last checkpoint's engine files give the adapter PEFT would have saved, bit for
    bit the run's own (gathered in training at ZeRO-3; at ZeRO-2 PEFT's own file, byte for byte), with
    adapter_config.json and the tokenizer; it loads into its base with no key missing or unexpected."""
    out = tmp_path / "adapter"
    code, stdout, stderr = _cli("convert", peft_runs / run, "--output", out, "--json")
    assert code == 0, stderr[-3000:]
    report = json.loads(stdout)
    assert (report["kind"], report["tensors"]) == ("peft-adapter", KEYS.get(run, LORA_KEYS))
    assert max(width(line) for line in stderr.splitlines()) <= 200
    assert stderr.strip().splitlines()[-1] == (f"converted checkpoint-2/global_step2 -> {out}: {report['tensors']} "
                                               f"tensors, {report['dtype']}, the LoRA adapter")
    # the adapter's dtype in training: PEFT keeps it fp32 on the bf16 base that zero.Init made at ZeRO-3
    assert report["dtype"] == ("float32" if run in ("peft_trainer_z3", "dora_z3") else "bfloat16")
    reference = _tensors(peft_runs / run / "reference_adapter.safetensors")
    written = _tensors(out / "adapter_model.safetensors")
    assert written.keys() == reference.keys() and all(_equal(written[k], reference[k]) for k in reference)
    saved = peft_runs / run / "checkpoint-2" / "adapter_model.safetensors"
    if run.endswith("z2"):
        assert (out / "adapter_model.safetensors").read_bytes() == saved.read_bytes()
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (saved.parent / "adapter_config.json").read_text())
    assert (out / "tokenizer.json").is_file() and not (out / "config.json").exists()
    _, missing, unexpected = _peft_load(peft_runs / "base", out)
    assert (missing, unexpected) == ([], [])
    code, _, stderr = _cli("verify", out)
    assert code == 0 and "all checks hold: " in stderr


def test_verify_fails_the_empty_zero3_adapter_with_its_cure(peft_runs):
    checkpoint = peft_runs / "trl_z3" / "checkpoint-2"
    code, stdout, stderr = _cli("verify", checkpoint, "--json")
    last = stderr.strip().splitlines()[-1]
    assert code == 1 and last == (f"verification FAILED: adapter_model.safetensors holds 0 tensors (PEFT's save under "
                                  f"ZeRO-3 without the gather); the adapter is in the engine files: dsfix convert "
                                  f"{checkpoint} --output ADAPTER_DIR")
    report = json.loads(stdout)
    assert not any(c["ok"] and "0 " in c["detail"] for c in report["checks"])  # no check says ok over 0 tensors
    code, _, stderr = _cli("verify", peft_runs / "trl_z2" / "checkpoint-2")  # PEFT's own file at ZeRO-2
    assert code == 0, stderr[-2000:]


def test_the_empty_dora_adapters_cure_converts_it(peft_runs, tmp_path):
    """verify names the convert that recovers the Trainer's empty ZeRO-3 DoRA adapter, and that convert does: the
    adapter described as DoRA (with rsLoRA and the per-module ranks and alphas where the run used them)."""
    checkpoint = peft_runs / "dora_z3" / "checkpoint-2"
    code, _, stderr = _cli("verify", checkpoint)
    cure = _lines(stderr)[-1].split(": ", 1)[1].rsplit("the engine files: ", 1)[1]
    assert code == 1 and cure == f"dsfix convert {checkpoint} --output ADAPTER_DIR"
    for run, out, words in ((checkpoint, "a", "a PEFT LoRA (DoRA), r 4, lora_alpha 8 adapter (168 tensors)"),
                            (peft_runs / "dora_z2", "b", "a PEFT LoRA (DoRA, rsLoRA), r 4, lora_alpha 8, rank_pattern "
                                                         "q_proj: 8, alpha_pattern v_proj: 4 adapter (168 tensors)")):
        code, stdout, stderr = _cli("convert", run, "--output", tmp_path / out, "--json")
        assert code == 0, stderr[-3000:]
        source = next(c for c in json.loads(stdout)["checks"] if c["name"] == "source")
        assert words in source["detail"], source


@pytest.mark.parametrize("run", ["trl_z3", "peft_trainer_z2", "peft_trainer_z3", "dora_z2", "dora_z3",
                                 "accelerate_peft_z3/state"])
def test_merge_is_merge_and_unload_bit_for_bit_and_loads_tied(peft_runs, tmp_path, run):
    """--merge: the base (named by adapter_config.json) with the adapter merged in by PEFT's own layers, as PEFT's
    merge_and_unload() merges the adapter convert recovered (bf16 LoRA, modules_to_save on the tied embedding, fp32
    LoRA, DoRA with rsLoRA and per-module ranks and alphas, DoRA, accelerate's save_state)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    code, stdout, stderr = _cli("convert", peft_runs / run, "--merge", "--output", tmp_path / "merged", "--json")
    assert code == 0, stderr[-3000:]
    assert json.loads(stdout)["kind"] == "peft-merged"
    _lines(stderr)
    assert _cli("convert", peft_runs / run, "--output", tmp_path / "adapter")[0] == 0
    model, _, _ = _peft_load(peft_runs / "base", tmp_path / "adapter")
    model.delete_adapter("again")
    expected = model.merge_and_unload().state_dict()
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert written.keys() == expected.keys() and all(_equal(written[k], expected[k]) for k in expected)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # the base's config, generation config and tokenizer beside the merged weights
    names = sorted(p.name for p in (tmp_path / "merged").iterdir())
    assert names == sorted(p.name for p in (peft_runs / "base").iterdir())


# ----------------------------------------------------------------------------- accelerate's save_state of a PEFT model


def test_accelerates_save_state_converts_with_its_save_pretrained_folder(peft_runs, tmp_path):
    """A plain accelerate loop at ZeRO-3 (persistence threshold 0): the state folder holds no adapter_config.json;
    save_pretrained's folder holds it and [0] tensors. That folder is never called fine (convert and verify exit
    1 naming the convert that recovers it); the state folder converts with --config ADAPTER_DIR, or alone where
    that folder is the one beside it, bit-equal to the adapter gathered in training, and loads into PEFT."""
    run = peft_runs / "accelerate_peft_z3"
    state, adapter = run / "state", run / "adapter"
    reference = _tensors(run / "reference_adapter.safetensors")
    n = len(reference)
    assert n == LORA_KEYS and not (state / "adapter_config.json").exists()
    cure = f"dsfix convert {state} --config {adapter} --output OUT"
    code, _, stderr = _cli("convert", adapter)
    assert code == 1 and _lines(stderr) == [
        f"not converted {adapter}: adapter_model.safetensors holds {n} of {n} tensors empty (ZeRO-3 partitions, "
        "not gathered); nothing written", f"it is in the engine files beside it: {cure}"]
    code, _, stderr = _cli("verify", adapter)
    assert code == 1 and _lines(stderr)[-1].endswith(f"beside it: {cure}")

    for args, said in (([], f"{adapter}: beside the checkpoint, the one whose PEFT model saves its parameters"),
                       (["--config", adapter], f"--config {adapter}")):
        out = tmp_path / f"out{len(args)}"
        code, stdout, stderr = _cli("convert", state, *args, "--output", out, "--json")
        assert code == 0, stderr[-3000:]
        lines = _lines(stderr)
        assert lines[1] == f"adapter_config.json from {said}" and lines[-1].endswith(f"{n} tensors, float32, the "
                                                                                      "LoRA adapter")
        written = _tensors(out / "adapter_model.safetensors")
        assert written.keys() == reference.keys() and all(_equal(written[k], reference[k]) for k in reference)
        assert _peft_load(peft_runs / "base", out)[1:] == ([], [])


def test_accelerates_state_with_two_adapter_configs_beside_is_refused_in_one_line(peft_runs, tmp_path):
    """Beside a copy of the state folder: the run's adapter_config.json, one of another rank (not its shapes: not a
    match) and one of another alpha (a match too): one line naming --config ADAPTER_DIR; without the last, the one
    match is used."""
    import shutil

    run = peft_runs / "accelerate_peft_z3"
    state = tmp_path / "run" / "state"
    shutil.copytree(run / "state", state)
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    for name, change in (("mine", {}), ("other_rank", {"r": 8}), ("other_alpha", {"lora_alpha": 32})):
        (tmp_path / "run" / name).mkdir()
        (tmp_path / "run" / name / "adapter_config.json").write_text(json.dumps({**config, **change}))
    code, _, stderr = _cli("convert", state, "--output", tmp_path / "out")
    line = f"dsfix: error: {state}: engine files of a PEFT model (accelerate's save_state?), no adapter_config.json "
    assert code == 2 and _lines(stderr) == [
        line + f"here, 2 beside them match ({tmp_path / 'run' / 'mine'}, {tmp_path / 'run' / 'other_alpha'}): pass "
        "--config ADAPTER_DIR, the folder of the run's save_pretrained"]
    shutil.rmtree(tmp_path / "run" / "other_alpha")
    code, _, stderr = _cli("convert", state, "--output", tmp_path / "out")
    assert code == 0 and f"adapter_config.json from {tmp_path / 'run' / 'mine'}: beside" in stderr, stderr[-3000:]


# ----------------------------------------------------------------------------- dsfix on the other producers' folders


def _lines(stderr: str) -> list:
    """What dsfix printed on stderr, line by line: every line within 200 characters, the user's own paths aside
    (each counted as one character)."""
    lines = stderr.splitlines()
    assert [line for line in lines if len(re.sub(r"/[^\s:,()]+", "/", line)) > 200] == [], stderr
    return lines


def test_convert_says_a_save_only_model_checkpoint_is_a_model_folder_and_verify_passes(peft_runs, tmp_path):
    """Nothing to convert, with or without --output, given the checkpoint-N or the run folder; dsfix verify named."""
    run = peft_runs / "save_only_model_z2"
    checkpoint = run / "checkpoint-2"
    answer = [f"nothing to convert in {checkpoint}: a Hugging Face model folder already (model.safetensors, "
              "config.json)", f"check it with: dsfix verify {checkpoint}"]
    chose = [f"{run}: a Trainer run folder",
             "chose checkpoint-2 (the last of checkpoint-2, as transformers' get_last_checkpoint picks it)"]
    for args, lines in (([checkpoint], answer), ([checkpoint, "--output", tmp_path / "out"], answer),
                        ([run], chose + answer), ([run, "--output", tmp_path / "out"], chose + answer)):
        code, stdout, stderr = _cli("convert", *args, "--json")
        assert code == 0 and _lines(stderr) == lines, stderr
        data = json.loads(stdout)
        assert (data["status"], data["kind"], data["folder"], data["next"]) == (
            "nothing to convert", "hugging-face-model-folder", str(checkpoint), f"dsfix verify {checkpoint}")
    assert not (tmp_path / "out").exists()

    code, _, stderr = _cli("verify", checkpoint, "--json")
    assert code == 0, stderr[-3000:]
    assert _lines(stderr)[-1].startswith("all checks hold: 311 tensors, causal LM")
    # against the base model (310 tensors, the tied alias left out): each side's own count in the keys row; the
    # values differ, as training changed them (or first the dtypes, if the Trainer saved another than the base's)
    code, stdout, stderr = _cli("verify", checkpoint, "--against", peft_runs / "base", "--json")
    assert code == 1, stderr[-3000:]
    _lines(stderr)
    report = json.loads(stdout)
    keys = next(c for c in report["checks"] if c["name"] == "keys")
    assert keys == {"name": "keys", "ok": True, "detail": "311 tensors here, 310 in the reference; 311 compared, "
                                                          "lm_head.weight through its tied partner"}
    dtypes = {t.dtype for t in _tensors(checkpoint / "model.safetensors").values()}
    assert report["first_difference"].startswith("values: " if dtypes == {torch.bfloat16} else "dtypes: ")


def test_save_16bit_model_converts_with_config_and_output(peft_runs, tmp_path):
    """pytorch_model.bin alone: one line names the cure; with --config BASE --output OUT it is converted through
    the one pipeline, bit-equal to the engine's own parameters, verified, and loads tied."""
    from transformers import AutoModelForCausalLM

    from patcher.checkpoint.check.load import dtype_kwarg

    run, base, out = peft_runs / "save16_z3", peft_runs / "base", tmp_path / "out"
    model = run / "model"
    cure = (f"dsfix: error: {model}: no config.json beside pytorch_model.bin, as save_16bit_model writes it: add "
            "--config MODEL_DIR --output OUT")
    for args in ([], ["--output", out], ["--config", base]):
        code, _, stderr = _cli("convert", model, *args)
        assert code == 2 and _lines(stderr) == [cure], stderr
    assert not out.exists()

    code, stdout, stderr = _cli("convert", model, "--config", base, "--output", out, "--json")
    assert code == 0, stderr[-3000:]
    lines = _lines(stderr)
    assert lines[:2] == [f"{model}: pytorch_model.bin alone, no config.json (as DeepSpeed's save_16bit_model and "
                         "zero_to_fp32 write it)", f"config from --config {base}; written to {out}"], lines
    assert lines[-1] == f"converted model/pytorch_model.bin -> {out}: 311 tensors, bfloat16, clone"
    data = json.loads(stdout)
    assert (data["kind"], data["config"], data["config_from_checkpoint"], data["dtype"], data["tensors"]) == (
        "bin-without-config", str(base), False, "bfloat16", 311)
    assert {c["name"] for c in data["checks"]} >= {"source", "keys", "tied", "load", "equal"}
    assert all(c["ok"] for c in data["checks"])
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name

    written = _tensors(out / "model.safetensors")
    reference = torch.load(str(run / "reference.pt"), weights_only=True)["state_dict"]
    assert set(written) == set(reference) and all(_equal(written[k], reference[k]) for k in reference)
    code, _, stderr = _cli("verify", out)
    assert code == 0, stderr[-3000:]
    _lines(stderr)
    code, stdout, stderr = _cli("verify", out, "--against", model, "--json")  # the .bin itself as the reference
    assert code == 0, stderr[-3000:]
    _lines(stderr)
    assert json.loads(stdout)["message"] == f"matches {model}: 311 tensors compared, 311 bit-equal"
    loaded = AutoModelForCausalLM.from_pretrained(str(out), **{dtype_kwarg(): torch.bfloat16})
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
