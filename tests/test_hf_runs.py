"""dsfix convert on DeepSpeed checkpoints written where most of them come from: the Hugging Face Trainer and
accelerate (extended tier: ``python -m pytest --extended``).

One launch of 2 CPU ranks (gloo) runs, one after another in each rank's process
(fixtures/step1_trainer/hf_ckpt.py), the real ``Trainer`` with DeepSpeed ZeRO-2 in bf16 (checkpoint-2/ and
checkpoint-4/), ZeRO-3 in bf16 and ZeRO-2 in fp32, and a loop under ``accelerate`` ending in ``save_state``,
on the narrow tied Qwen3. Each conversion is compared bit for bit with the run's own consolidated weights,
read in the training process (the Trainer's ``accelerator.get_state_dict``, the ZeRO-3 engine's
``_zero3_consolidated_16bit_state_dict``, accelerate's ``get_state_dict``), or, for fp32, with DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``; each is verified and loads tied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]

torch = pytest.importorskip("torch")

from patcher.checkpoint.convert import convert  # noqa: E402
from patcher.errors import DsfixError  # noqa: E402
from patchkit import cli_completed, width  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def hf_runs(tmp_path_factory, tiny_qwen3_helper):
    """The launch's output: runs/<run>/ (checkpoint-N/ or state/, reference.pt), and model/ (the narrow Qwen3's
    config and tokenizer) for accelerate's --config."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("accelerate")
    from smokekit import launch_ranks

    base = tmp_path_factory.mktemp("hf-runs")
    run = launch_ranks(REPO / "fixtures" / "step1_trainer" / "hf_ckpt.py",
                       ["--output_dir", base / "runs", "--save_model"],
                       env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert run.ok and "[hf_ckpt] saved " in run.output, run.report()
    model_dir = base / "model"
    config = tiny_qwen3_helper.tiny_qwen3_config()
    config.architectures = ["Qwen3ForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(model_dir))
    tiny_qwen3_helper.tiny_qwen3_tokenizer().save_pretrained(str(model_dir))
    return base / "runs", model_dir


def _cli(*args):
    """dsfix's command line in this process (patchkit.cli_completed)."""
    return cli_completed(*args)


def _lines(proc) -> list:
    """What dsfix printed on stderr, line by line: every line within 200 characters."""
    lines = proc.stderr.splitlines()
    assert [line for line in lines if width(line) > 200] == [], proc.stderr
    return lines


def _bits(t):
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bit_equal(out: Path, reference: dict):
    from safetensors.torch import load_file

    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(reference) | {"lm_head.weight"}, set(written) ^ set(reference)
    for key, value in reference.items():
        assert written[key].dtype == value.dtype and torch.equal(_bits(written[key]), _bits(value)), key
    assert torch.equal(_bits(written["lm_head.weight"]), _bits(written["model.embed_tokens.weight"]))


def _assert_verified_and_tied(out: Path, dtype):
    from transformers import AutoModelForCausalLM

    from patcher.checkpoint.check.load import dtype_kwarg
    from patcher.checkpoint.verify import verify_path

    result = verify_path(out)  # dsfix verify: the checks against config.json, NaN and Inf, a reload
    assert result.status.exit_code == 0, [c for r in result.reports for c in r.checks if not c.ok]
    model = AutoModelForCausalLM.from_pretrained(str(out), **{dtype_kwarg(): dtype})
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _reference(run: Path) -> dict:
    return torch.load(str(run / "reference.pt"), weights_only=True)["state_dict"]


def test_a_trainer_run_folder_converts_its_last_checkpoint_with_no_other_flag(hf_runs, tmp_path):
    runs, _ = hf_runs
    run = runs / "trainer_z2_bf16"
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-2", "checkpoint-4"]
    proc = _cli("convert", run, "--output", tmp_path / "out", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _lines(proc)  # what was chosen in the run folder, what it is, where the config came from and goes
    assert lines[:4] == [
        f"{run}: a Trainer run folder",
        "converting checkpoint-4 (the last of checkpoint-2, checkpoint-4, as transformers' get_last_checkpoint picks "
        "it; --tag checkpoint-N picks another)",
        "checkpoint-4: a DeepSpeed engine checkpoint (global_step4, ZeRO-2, 2 rank(s), bf16 optimizer states, saved "
        "by the Hugging Face Trainer)",
        f"config from the checkpoint's own folder; written to {tmp_path / 'out'}"], lines
    assert lines[-1] == f"converted checkpoint-4/global_step4 -> {tmp_path / 'out'}: 311 tensors, bfloat16, clone"
    data = json.loads(proc.stdout)
    assert (data["checkpoint"], data["tag"], data["precision"], data["producer"], data["config_from_checkpoint"]) == (
        str(run / "checkpoint-4"), "global_step4", "bf16", "trainer", True)
    out = tmp_path / "out"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (run / "checkpoint-4" / name).read_bytes(), name
    _assert_bit_equal(out, _reference(run))  # the run's weights after step 4
    _assert_verified_and_tied(out, torch.bfloat16)

    # checkpoint-N named itself, or by --tag: the same files; --tag picks the earlier one
    given = convert(run / "checkpoint-4", config=None, output=tmp_path / "given", load=False)
    assert given.ok and not given.chosen and given.config_own
    assert (tmp_path / "given" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    earlier = convert(run, config=None, output=tmp_path / "earlier", tag="checkpoint-2", load=False)
    assert earlier.ok and earlier.tag == "global_step2" and earlier.chosen.startswith("checkpoint-2 (as --tag names it")
    assert (tmp_path / "earlier" / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()


def test_a_trainer_zero3_checkpoint_is_the_engines_own_gathered_model(hf_runs, tmp_path):
    runs, _ = hf_runs
    checkpoint = runs / "trainer_z3_bf16" / "checkpoint-2"
    assert not (checkpoint / "model.safetensors").exists()  # stage3_gather_16bit_weights_on_model_save: false
    result = convert(checkpoint / "global_step2", config=None, output=tmp_path / "out")  # the step folder itself
    assert result.ok, result.checks
    assert (result.stage, result.precision, result.dtype, result.config) == (3, "bf16", "bfloat16", str(checkpoint))
    _assert_bit_equal(tmp_path / "out", _reference(runs / "trainer_z3_bf16"))
    _assert_verified_and_tied(tmp_path / "out", torch.bfloat16)

    # trainer.save_model() without gathering wrote the engine's files into the output folder itself: the run
    # folder is then that final save (the same weights, after the last step); --tag checkpoint-2 still picks
    final = convert(runs / "trainer_z3_bf16", config=None, output=tmp_path / "final", load=False)
    assert final.ok and not final.chosen and final.config == str(runs / "trainer_z3_bf16")
    written = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == written
    picked = convert(runs / "trainer_z3_bf16", config=None, output=tmp_path / "picked", tag="checkpoint-2", load=False)
    assert picked.ok and picked.chosen.startswith("checkpoint-2 (as --tag names it")


def test_an_fp32_trainer_run_is_called_fp32_and_matches_zero_to_fp32_and_its_bin(hf_runs, tmp_path):
    from deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )

    runs, _ = hf_runs
    checkpoint = runs / "trainer_z2_fp32" / "checkpoint-2"
    assert not any(p.name.startswith("bf16_") for p in (checkpoint / "global_step2").iterdir())
    proc = _cli("convert", checkpoint, "--output", tmp_path / "out", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert (data["precision"], data["dtype"], data["zero_stage"]) == ("fp32", "float32", 2)
    assert "fp32 optimizer states" in _lines(proc)[0] and "fp16" not in proc.stderr
    reference = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    reference.pop("lm_head.weight", None)  # zero_to_fp32's alias of the embedding; checked as the tie below
    _assert_bit_equal(tmp_path / "out", reference)
    own = _reference(runs / "trainer_z2_fp32")  # the Trainer's own fp32 weights agree too
    _assert_bit_equal(tmp_path / "out", {k: v for k, v in own.items() if k != "lm_head.weight"})
    _assert_verified_and_tied(tmp_path / "out", torch.float32)

    # what a zero_to_fp32 user holds as a reference: its pytorch_model.bin, which verify --against now reads
    convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(tmp_path / "z2f"))
    assert (tmp_path / "z2f" / "pytorch_model.bin").is_file()
    proc = _cli("verify", tmp_path / "out", "--against", tmp_path / "z2f", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _lines(proc)
    report = json.loads(proc.stdout)
    keys = next(c for c in report["checks"] if c["name"] == "keys")  # each side's own count
    held = len(torch.load(str(tmp_path / "z2f" / "pytorch_model.bin"), weights_only=True))
    assert keys["detail"] == ("311 tensors on both sides" if held == 311 else
                              f"311 tensors here, {held} in the reference; 311 compared, lm_head.weight through its "
                              "tied partner")
    assert report["message"].startswith(f"matches {tmp_path / 'z2f'}: ") and report["message"].endswith("bit-equal")
    compared = report["folders"][0]["compared"]
    assert len(compared) == 311 and all(row["bit_equal"] for row in compared)


def test_accelerate_save_state_converts_with_config(hf_runs, tmp_path):
    runs, model_dir = hf_runs
    state = runs / "accelerate_z2_bf16" / "state"
    assert (state / "latest").read_text().strip() == "pytorch_model"
    assert sorted(p.name for p in state.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]
    with pytest.raises(DsfixError) as info:  # no config beside accelerate's weights: one line says so
        convert(state, config=None, output=tmp_path / "no-config")
    assert info.value.message == ("no config.json here (accelerate's save_state writes none): convert needs --config "
                                  "MODEL_DIR, the model's folder (ADAPTER_DIR for PEFT)")
    assert not (tmp_path / "no-config").exists()
    result = convert(state, config=model_dir, output=tmp_path / "out")
    assert result.ok, result.checks
    assert (result.tag, result.producer, result.precision, result.config_own) == ("pytorch_model", "accelerate",
                                                                                  "bf16", False)
    assert "saved by accelerate's save_state" in result.describe()
    _assert_bit_equal(tmp_path / "out", _reference(runs / "accelerate_z2_bf16"))
    _assert_verified_and_tied(tmp_path / "out", torch.bfloat16)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o002, 0o775)])
def test_the_converted_folder_follows_the_umask(hf_runs, tmp_path, umask, mode):
    """As any folder the user makes: an --output that existed (empty) at 0755 too."""
    runs, _ = hf_runs
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    os.chmod(out, 0o755)
    old = os.umask(umask)
    try:
        result = convert(runs / "trainer_z2_bf16", config=None, output=out, load=False)
    finally:
        os.umask(old)
    assert result.ok, result.checks
    assert out.stat().st_mode & 0o777 == mode
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o666 & ~umask for p in out.iterdir()}
