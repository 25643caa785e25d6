"""dsfix convert: DeepSpeed-Chat .bin folders (saved here the way upstream saves them) to verified safetensors.

The .bin folders are made in the tests from the narrow Qwen3 (28 layers, 311 state-dict keys):
- step 1 on rank 0: ``torch.save`` of ``state_dict()`` without LoRA keys (311 keys, lm_head sharing the
  embedding's storage);
- the ZeRO-3 save: ``named_parameters()``, which drops the tied lm_head (310 keys); once simulated in
  this process and once for real, DeepSpeed ZeRO-3 on 2 CPU ranks;
- transformers' sharded ``.bin`` with ``pytorch_model.bin.index.json``;
- step 2's reward model: a base ``AutoModel`` under ``rwtransformer.`` plus ``v_head`` (the test's own
  module, written like DeepSpeed-Chat's RewardModel but not taken from it);
- step 3: ``actor/``, ``critic/`` and ``actor_ema/`` under one output folder.
"""
from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # torch models, .bin loads and reloads

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch import nn  # noqa: E402

from patcher.checkpoint.check.verify import verify_folder  # noqa: E402
from patcher.checkpoint.convert import convert  # noqa: E402
from patcher.errors import DsfixError  # noqa: E402
from patchkit import CLEAN_ENV, cli, run, snapshot  # noqa: E402
from smokekit import NARROW, narrow_model, same_attention  # noqa: E402

PROBE = torch.tensor([[5, 17, 3, 99, 250, 7, 42, 1, 300]])


class RewardLike(nn.Module):
    """The shape of DeepSpeed-Chat's reward/critic model: base transformer + a bias-free 1-output head."""

    def __init__(self, base):
        super().__init__()
        self.config = base.config
        self.rwtransformer = base
        self.v_head = nn.Linear(base.config.hidden_size, 1, bias=False)

    def forward(self, input_ids):
        return self.v_head(self.rwtransformer(input_ids=input_ids)[0]).squeeze(-1)


def make_critic(seed=1):
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(seed)
    return RewardLike(AutoModel.from_config(AutoConfig.from_pretrained(str(NARROW)))).float().eval()


@pytest.fixture(scope="module")
def model():
    return narrow_model("float32", seed=0).eval()


@pytest.fixture(scope="module")
def critic():
    return make_critic()


def save_rank0(module, out):
    """Step 1/2's save_hf_format on rank 0: the state dict without LoRA keys, as one pickle, plus config.json."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v for k, v in module.state_dict().items() if "lora" not in k}, str(out / "pytorch_model.bin"))
    module.config.to_json_file(str(out / "config.json"))
    return out


def save_zero3_like(module, out):
    """save_zero_three_model's output: one tensor per named_parameters() entry (tied ones once)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: p.detach().cpu().clone() for k, p in module.named_parameters() if "lora" not in k},
               str(out / "pytorch_model.bin"))
    module.config.to_json_file(str(out / "config.json"))
    return out


def safetensors_state(folder):
    index = folder / "model.safetensors.index.json"
    names = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    state = {}
    for name in names:
        state.update(load_file(str(folder / name)))
    return state


def reload_logits(folder, like):
    """The logits of the reloaded folder, run with the attention ``like`` runs."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), **same_attention(like)).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        return loaded(input_ids=PROBE).logits


def logits(module):
    with torch.no_grad():
        return module(input_ids=PROBE).logits


def staging_left(root):
    return [p for p in root.rglob(".dsfix-convert-*")]


# --------------------------------------------------------------------------- actor folders


def test_step1_save_converts_to_311_tensors_that_reload_with_equal_logits(tmp_path, model):
    folder = save_rank0(model, tmp_path / "step1")
    bin_state = torch.load(str(folder / "pytorch_model.bin"), weights_only=True)
    assert len(bin_state) == 311
    assert bin_state["lm_head.weight"].data_ptr() == bin_state["model.embed_tokens.weight"].data_ptr()
    before = (folder / "pytorch_model.bin").read_bytes()

    code, out, _ = cli("convert", folder, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["status"] == "converted" and report["ok"]
    (result,) = report["folders"]
    assert result["kind"] == "causal-lm" and result["tensors"] == 311 and result["mmap"] is True
    assert result["written"] == ["model.safetensors"] and result["restored"] == [] and result["removed"] == []
    assert {c["name"] for c in result["checks"]} >= {"source", "keys", "shapes", "tied", "load", "equal"}
    assert (folder / "pytorch_model.bin").read_bytes() == before  # kept, untouched
    mode = oct((folder / "pytorch_model.bin").stat().st_mode & 0o777)
    assert oct((folder / "model.safetensors").stat().st_mode & 0o777) == mode
    assert not staging_left(tmp_path)

    state = safetensors_state(folder)
    assert set(state) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    assert verify_folder(folder, expect=311).ok
    assert torch.equal(reload_logits(folder, model), logits(model))


def test_zero3_save_gets_its_tied_lm_head_back(tmp_path, model):
    step1 = save_rank0(model, tmp_path / "step1")
    z3 = save_zero3_like(model, tmp_path / "z3")
    assert "lm_head.weight" not in torch.load(str(z3 / "pytorch_model.bin"), weights_only=True)

    report = convert(z3)
    (result,) = report.folders
    assert report.ok and result.tensors == 311
    assert result.restored == ("lm_head.weight <- model.embed_tokens.weight",)
    assert "restored lm_head.weight" in result.check("tied").detail
    assert convert(step1).ok
    # the restored alias makes the file byte-identical to the conversion of the 311-key rank-0 save
    assert (z3 / "model.safetensors").read_bytes() == (step1 / "model.safetensors").read_bytes()
    assert torch.equal(reload_logits(z3, model), logits(model))


def test_dedupe_writes_transformers_layout_from_either_save(tmp_path, model):
    for save in (save_rank0, save_zero3_like):
        folder = save(model, tmp_path / save.__name__)
        code, out, _ = cli("convert", folder, "--strategy", "dedupe", "--json")
        assert code == 0
        (result,) = json.loads(out)["folders"]
        assert result["tensors"] == 310
        assert result["dropped"] == (["lm_head.weight"] if save is save_rank0 else [])
        assert "lm_head.weight" not in safetensors_state(folder)
        report = verify_folder(folder, expect=310)
        assert report.ok and "omitted tied alias lm_head.weight" in report.check("keys").detail
        assert torch.equal(reload_logits(folder, model), logits(model))


def save_sharded_zero3_like(module, out, shards=3):
    """named_parameters() (310 keys) split over shards, with transformers' pytorch_model.bin.index.json."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: p.detach().cpu().clone() for k, p in module.named_parameters()}
    keys = list(state)
    size = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = keys[i * size:(i + 1) * size]
        torch.save({k: state[k] for k in part}, str(out / name))
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}))
    module.config.to_json_file(str(out / "config.json"))
    return out, sorted(set(weight_map.values()))


def test_sharded_bin_becomes_safetensors_in_the_5_gib_layout(tmp_path, model):
    """One rule for every convert: the output's files follow the 5 GiB layout (transformers' and the save
    module's), whatever the input's shards were: a small model is one file, a shard size splits it."""
    folder, shards = save_sharded_zero3_like(model, tmp_path / "sharded")
    code, out, _ = cli("convert", folder, "--remove-bin", "--json")
    assert code == 0
    (result,) = json.loads(out)["folders"]
    assert result["source"] == shards and result["tensors"] == 311 and result["written"] == ["model.safetensors"]
    assert result["restored"] == ["lm_head.weight <- model.embed_tokens.weight"]
    assert sorted(result["removed"]) == sorted(shards + ["pytorch_model.bin.index.json"])
    assert not list(folder.glob("*.bin")) and not (folder / "pytorch_model.bin.index.json").exists()
    assert verify_folder(folder, expect=311).ok
    assert torch.equal(reload_logits(folder, model), logits(model))

    folder, shards = save_sharded_zero3_like(model, tmp_path / "sharded-small")
    (result,) = convert(folder, max_shard_size=600_000, load=False).folders
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert result.ok and result.written == tuple(files + ["model.safetensors.index.json"]) and len(files) > 1
    state = safetensors_state(folder)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    report = verify_folder(folder, expect=311)
    assert report.ok and report.files == tuple(files)
    assert torch.equal(reload_logits(folder, model), logits(model))

    folder, shards = save_sharded_zero3_like(model, tmp_path / "sharded-dedupe")
    (result,) = convert(folder, strategy="dedupe", load=False).folders
    assert result.ok and result.tensors == 310 and result.written == ("model.safetensors",)
    assert verify_folder(folder, expect=310).ok


def test_transformers_sharded_bin_converts(tmp_path, model):
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers 5 writes no .bin (safe_serialization=False is gone); the layout comes from 4.x")
    folder = tmp_path / "hf-sharded"
    model.save_pretrained(str(folder), safe_serialization=False, max_shard_size="600KB")
    shards = sorted(p.name for p in folder.glob("pytorch_model-*.bin"))
    assert len(shards) > 1 and (folder / "pytorch_model.bin.index.json").is_file()
    (result,) = convert(folder).folders
    assert result.ok and result.tensors == 311 and result.written == ("model.safetensors",)
    assert verify_folder(folder, expect=311).ok
    assert torch.equal(reload_logits(folder, model), logits(model))


def test_a_zip_less_legacy_pickle_converts_without_mmap(tmp_path, model):
    folder = tmp_path / "legacy"
    folder.mkdir()
    torch.save(model.state_dict(), str(folder / "pytorch_model.bin"), _use_new_zipfile_serialization=False)
    model.config.to_json_file(str(folder / "config.json"))
    (result,) = convert(folder, load=False).folders
    assert result.ok and result.mmap is False and "not memory-mapped" in result.check("source").detail
    assert verify_folder(folder, expect=311, load=False).ok


def test_zero3_on_two_cpu_ranks_then_convert(zero3_patched_run, tmp_path):
    """Upstream-like save_hf_format + save_zero_three_model under a real DeepSpeed ZeRO-3 engine (2 ranks,
    gloo; the session's run, whose original/ folder they wrote): the .bin lacks lm_head.weight; convert
    restores it and the model reloads with equal logits."""
    folder, launch = zero3_patched_run
    assert launch.ok, launch.report()
    out = tmp_path / "out"
    shutil.copytree(folder / "original", out)
    saved = torch.load(str(out / "pytorch_model.bin"), weights_only=True)
    assert len(saved) == 310 and "lm_head.weight" not in saved and all(v.numel() for v in saved.values())

    code, stdout, stderr = cli("convert", out, "--json")
    assert code == 0, stderr[-3000:]
    (result,) = json.loads(stdout)["folders"]
    assert result["tensors"] == 311 and result["restored"] == ["lm_head.weight <- model.embed_tokens.weight"]
    ref = torch.load(str(folder / "ref" / "reference.pt"), weights_only=True)
    state = safetensors_state(out)
    assert set(state) == set(ref["state_dict"])
    for key, value in ref["state_dict"].items():
        assert torch.equal(state[key], value), key
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out), attn_implementation=ref["attn_implementation"]).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ref["probe"]).logits, ref["logits"])


# --------------------------------------------------------------------------- critic and step-3 folders


def test_critic_folder_converts_without_tie_restoration(tmp_path, critic):
    assert critic.config.tie_word_embeddings  # the base config ties, yet AutoModel has no lm_head to tie
    for strategy, save in (("clone", save_rank0), ("dedupe", save_zero3_like)):
        folder = save(critic, tmp_path / strategy)
        code, out, _ = cli("convert", folder, "--strategy", strategy, "--json")
        assert code == 0
        (result,) = json.loads(out)["folders"]
        assert result["kind"] == "critic" and result["tensors"] == 311  # 310 base keys + v_head.weight
        assert result["restored"] == [] and result["dropped"] == []
        checks = {c["name"]: c for c in result["checks"]}
        assert "Qwen3Model under rwtransformer. + v_head" in checks["keys"]["detail"]
        assert checks["load"]["ok"] and "strict" in checks["load"]["detail"]

        state = safetensors_state(folder)
        assert "v_head.weight" in state and not any(k.startswith("lm_head") for k in state)
        fresh = make_critic(seed=99)
        fresh.load_state_dict(state, strict=True)
        with torch.no_grad():
            assert torch.equal(fresh(PROBE), critic(PROBE))
        report = verify_folder(folder, expect=311)
        assert report.ok and report.kind == "critic"


def test_verify_catches_a_critic_whose_value_head_is_wrong(tmp_path, critic):
    from safetensors.torch import save_file

    folder = tmp_path / "bad-critic"
    folder.mkdir()
    state = {k: v.detach().clone() for k, v in critic.state_dict().items()}
    state["v_head.weight"] = torch.zeros(2, critic.config.hidden_size)
    save_file(state, str(folder / "model.safetensors"))
    critic.config.to_json_file(str(folder / "config.json"))
    report = verify_folder(folder)
    bad = {c.name: c.detail for c in report.checks if not c.ok}
    assert report.kind == "critic" and set(bad) == {"shapes", "load"}
    assert "v_head.weight [2, 64] != [1, 64]" in bad["shapes"]
    assert "size mismatch for v_head.weight" in bad["load"]


def make_step3(root, model, critic):
    save_zero3_like(model, root / "actor")
    save_zero3_like(critic, root / "critic")
    save_rank0(model, root / "actor_ema")
    return root


def test_step3_output_folder_converts_and_verifies_each_model(tmp_path, model, critic):
    out = make_step3(tmp_path / "step3", model, critic)
    (out / "training_args.bin").write_bytes(b"not weights")  # other .bin files neither hide the subfolders nor change
    code, stdout, _ = cli("convert", out, "--json")
    assert code == 0
    assert (out / "training_args.bin").read_bytes() == b"not weights"
    report = json.loads(stdout)
    assert [(os.path.basename(f["path"]), f["kind"], f["tensors"]) for f in report["folders"]] == [
        ("actor", "causal-lm", 311), ("critic", "critic", 311), ("actor_ema", "causal-lm", 311)]

    code, stdout, stderr = cli("verify", out, "--expect", "311", "--json")
    assert code == 0, stderr[-3000:]
    verified = json.loads(stdout)
    assert verified["ok"] and [f["kind"] for f in verified["folders"]] == ["causal-lm", "critic", "causal-lm"]
    assert "reward/critic model" in stderr
    for name in ("actor", "actor_ema"):
        assert torch.equal(reload_logits(out / name, model), logits(model))

    # a second run has nothing to do
    code, stdout, _ = cli("convert", out, "--json")
    assert code == 0 and json.loads(stdout)["status"] == "nothing to convert"


def test_one_failing_step3_model_leaves_every_folder_as_it_was(tmp_path, model, critic):
    out = make_step3(tmp_path / "step3", model, critic)
    cfg = json.loads((out / "critic" / "config.json").read_text())
    cfg["hidden_size"] = 32  # the critic's weights no longer fit its config
    (out / "critic" / "config.json").write_text(json.dumps(cfg))
    before = snapshot(out)
    code, stdout, _ = cli("convert", out, "--json")
    assert code == 1
    report = json.loads(stdout)
    assert [f["status"] for f in report["folders"]] == ["not written", "failed", "not written"]
    assert snapshot(out) == before and not staging_left(out)


# --------------------------------------------------------------------------- refusals and failures


class Payload:
    """Unpickling this would run a shell command: the shape of a malicious checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class TrainingState:
    """A custom class in a pickle: weights_only has no way to build it without running its module."""

    def __init__(self):
        self.step = 3


@pytest.mark.parametrize("payload", ["code", "class"])
def test_a_pickle_that_needs_code_is_refused(tmp_path, model, payload):
    folder = save_rank0(model, tmp_path / "evil")
    marker = tmp_path / "PWNED"
    state = dict(model.state_dict())
    state["extra"] = Payload(marker) if payload == "code" else TrainingState()
    torch.save(state, str(folder / "pytorch_model.bin"))
    before = snapshot(folder)

    p = run("convert", folder, "--json")
    stderr = p.stderr.decode()
    assert p.returncode == 2 and json.loads(p.stdout)["exit_code"] == 2  # --json: the error as JSON too
    assert stderr.startswith("dsfix: error: ") and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert "Warning" not in stderr  # torch's own warning is not shown before dsfix's line
    assert "refused: this pickle needs code to load" in stderr
    assert ("posix.system" if payload == "code" else "TrainingState") in stderr
    assert not marker.exists()  # nothing ran
    assert snapshot(folder) == before


def test_shapes_that_do_not_match_the_config_fail_with_nothing_written(tmp_path, model):
    folder = save_rank0(model, tmp_path / "shapes")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    before = snapshot(folder)
    code, stdout, stderr = cli("convert", folder, "--json")
    assert code == 1 and "a check failed; nothing written" in stderr
    (result,) = json.loads(stdout)["folders"]
    failed = {c["name"]: c["detail"] for c in result["checks"] if not c["ok"]}
    assert result["status"] == "failed" and set(failed) == {"shapes"}
    assert "model.layers.0.mlp.gate_proj.weight [128, 64] != [96, 64]" in failed["shapes"]
    assert snapshot(folder) == before and not staging_left(folder)


def test_tied_aliases_that_differ_are_refused(tmp_path, model):
    folder = tmp_path / "untied"
    folder.mkdir()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] += 1
    torch.save(state, str(folder / "pytorch_model.bin"))
    model.config.to_json_file(str(folder / "config.json"))
    before = snapshot(folder)
    (result,) = convert(folder).folders
    assert result.status == "failed" and "lm_head.weight != model.embed_tokens.weight" in result.check("tied").detail
    assert snapshot(folder) == before


def test_zero3_placeholders_fail(tmp_path, model):
    folder = tmp_path / "placeholders"
    folder.mkdir()
    torch.save({k: torch.empty(0) for k in model.state_dict()}, str(folder / "pytorch_model.bin"))
    model.config.to_json_file(str(folder / "config.json"))
    (result,) = convert(folder).folders
    assert not result.ok and "ZeRO-3 partitioned placeholder" in result.check("non-empty").detail
    assert not (folder / "model.safetensors").exists()


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))


def test_a_write_that_fails_leaves_the_folder_as_it_was(tmp_path, model):
    folder = save_rank0(model, tmp_path / "full")
    before = snapshot(folder)
    p = subprocess.run([sys.executable, "-m", "patcher", "convert", str(folder)], env=CLEAN_ENV,
                       capture_output=True, timeout=300, preexec_fn=_limit_file_size)
    assert p.returncode == 2, p.stderr.decode()[-2000:]
    assert b"cannot write the converted files: File too large" in p.stderr and b"nothing written" in p.stderr
    assert snapshot(folder) == before and not staging_left(folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_folder_is_left_as_it_was(tmp_path, model):
    folder = save_rank0(model, tmp_path / "ro")
    before = snapshot(folder)
    folder.chmod(0o555)
    try:
        code, _, _ = cli("convert", folder)
    finally:
        folder.chmod(0o755)
    assert code == 2 and snapshot(folder) == before


def test_bad_input_exits_2(tmp_path, model):
    assert cli("convert", tmp_path / "missing")[0] == 2
    (tmp_path / "empty").mkdir()
    p = run("convert", tmp_path / "empty")
    assert p.returncode == 2 and b"no pytorch_model.bin" in p.stderr
    noconfig = save_rank0(model, tmp_path / "noconfig")
    (noconfig / "config.json").unlink()
    p = run("convert", noconfig)
    assert p.returncode == 2 and b"no config.json" in p.stderr
    truncated = save_rank0(model, tmp_path / "truncated")
    data = (truncated / "pytorch_model.bin").read_bytes()
    (truncated / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    p = run("convert", truncated)
    assert p.returncode == 2 and b"not a readable torch.save file" in p.stderr
    nested = save_rank0(model, tmp_path / "nested")
    torch.save({"module": model.state_dict(), "step": torch.tensor(3)}, str(nested / "pytorch_model.bin"))
    with pytest.raises(DsfixError) as e:
        convert(nested)
    assert e.value.code == 2 and "'module' holds an object of type OrderedDict" in str(e.value)
    assert cli("convert", tmp_path / "empty", "--strategy", "other")[0] == 2


def test_already_converted_is_nothing_to_convert(tmp_path, model):
    folder = save_rank0(model, tmp_path / "twice")
    assert convert(folder, load=False).status == "converted"
    before = snapshot(folder)
    code, out, _ = cli("convert", folder, "--remove-bin", "--json")
    assert code == 0 and json.loads(out)["status"] == "nothing to convert"
    assert snapshot(folder) == before


def test_progress_a_bar_on_a_terminal_and_plain_lines_elsewhere(tmp_path, model):
    from rich.console import Console

    seen = {}
    for terminal in (True, False):
        folder = save_rank0(model, tmp_path / f"tty-{terminal}")
        console = Console(file=io.StringIO(), force_terminal=terminal, width=100)
        assert convert(folder, load=False, console=console, progress_min_bytes=0).ok
        seen[terminal] = console.file.getvalue()
    assert "converting" in seen[True] and "\x1b[" in seen[True], "rich's bar"
    first = seen[False].splitlines()[0]
    assert first.startswith("dsfix convert: converting (write, then compare): 0 MB of ") and "\x1b" not in seen[False]


def test_import_keeps_torch_out():
    code = ("import sys, patcher.cli, patcher.checkpoint.convert, patcher.checkpoint.verify; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
