"""patcher.checkpoint.verify: checks a saved folder against its config, reading headers (CPU, narrow Qwen3)."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # torch models written and reloaded

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from patcher.checkpoint.check.load import tie_on_load_check  # noqa: E402
from patcher.checkpoint.check.verify import VerifyReport, verify_folder  # noqa: E402
from patcher.errors import DsfixError  # noqa: E402
from smokekit import FULL, NARROW, narrow_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return narrow_model("float32", seed=0)


def write_folder(path, model, tensors=None, config=True):
    """config.json (unless config=False) and model.safetensors holding ``tensors`` (default: every state-dict key)."""
    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config:
        model.config.to_json_file(str(path / "config.json"))
    return path


def state(model):
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def failed(report: VerifyReport) -> dict:
    return {c.name: c.detail for c in report.checks if not c.ok}


def test_accepts_a_correct_folder_with_311_tensors(tmp_path, model):
    report = verify_folder(write_folder(tmp_path / "good", model), expect=311)
    assert report.ok, failed(report)
    assert report.tensors == 311 and report.expected == 311
    assert report.dtype == "float32"
    assert [c.name for c in report.checks] == ["config", "files", "keys", "shapes", "non-empty", "dtype", "tied",
                                               "count", "load"]
    assert "lm_head.weight == model.embed_tokens.weight" in report.check("tied").detail
    data = json.loads(report.to_json())
    assert data["ok"] is True and data["tensors"] == 311 and len(data["checks"]) == 9


@pytest.mark.slow
@pytest.mark.parametrize("config_tied,loaded_tied,fails", [
    (True, True, False),    # 4.x and 5.4+ re-tie a clone output, and every version ties a dedupe output
    (True, False, True),    # transformers 5.0-5.3 on a clone output: "we will NOT tie them"
    (False, False, False),  # a model saved untied on purpose
])
def test_a_config_that_says_tied_must_load_tied(tmp_path, config_tied, loaded_tied, fails):
    folder = write_folder(tmp_path / "f", narrow_model("float32", seed=0))
    if not config_tied:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    from patcher.checkpoint.check.load import load_check

    check, loaded = load_check(folder, keep_model=True)
    assert check.ok, check.detail
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == config_tied
    if config_tied and not loaded_tied:  # what those releases hand back: equal values, two matrices
        loaded.lm_head.weight = torch.nn.Parameter(loaded.lm_head.weight.detach().clone())
    result = tie_on_load_check(loaded)
    assert (result is not None) == fails
    if fails:
        assert not result.ok and result.name == "load"
        assert "tie_word_embeddings" in result.detail and "--strategy dedupe" in result.detail
        assert ">= 5.4" in result.detail and len(result.detail) <= 300


def test_accepts_save_pretrained_without_the_tied_alias(tmp_path, model):
    model.save_pretrained(str(tmp_path / "hf"))
    report = verify_folder(tmp_path / "hf", expect=310)
    assert report.ok, failed(report)
    assert report.tensors == 310
    assert "omitted tied alias lm_head.weight (tied to model.embed_tokens.weight)" in report.check("keys").detail
    assert "not stored" in report.check("tied").detail


def test_accepts_shards_with_an_index(tmp_path, model):
    sd = state(model)
    keys = list(sd)
    folder = tmp_path / "sharded"
    folder.mkdir()
    halves = {"model-00001-of-00002.safetensors": keys[:150], "model-00002-of-00002.safetensors": keys[150:]}
    for name, ks in halves.items():
        save_file({k: sd[k] for k in ks}, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, ks in halves.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model.config.to_json_file(str(folder / "config.json"))
    report = verify_folder(folder, expect=311)
    assert report.ok, failed(report)
    assert report.files == tuple(sorted(halves))

    os.remove(folder / "model-00002-of-00002.safetensors")
    report = verify_folder(folder, load=False)
    assert not report.ok
    assert "missing" in failed(report)["files"] and "model-00002-of-00002.safetensors" in failed(report)["files"]


@pytest.fixture(scope="module")
def zero3_article_folder(zero3_article_run):
    """The article's save run on real 2-rank DeepSpeed ZeRO-3 engines: [0]-shaped placeholders, no config."""
    report, folder = zero3_article_run
    assert report.check("save").ok, report.to_json()
    assert report.save_output.strip() == "loaded 311 tensors"  # the article's own count says all is well
    return folder


def test_fails_on_zero3_placeholders(tmp_path, zero3_article_folder):
    report = verify_folder(zero3_article_folder, expect=311)
    bad = failed(report)
    assert "no config.json" in bad["config"]
    assert "311 of 311 tensors are empty" in bad["non-empty"] and "ZeRO-3" in bad["non-empty"]
    assert report.check("count").ok  # 311 tensors, and still broken: a count is not a check

    # With a config.json added, the empty tensors alone still fail it, now also by shape and on load.
    folder = tmp_path / "with-config"
    shutil.copytree(zero3_article_folder, folder)
    shutil.copy(NARROW, folder / "config.json")
    report = verify_folder(folder)
    bad = failed(report)
    assert report.check("config").ok and report.check("keys").ok
    assert set(bad) == {"shapes", "non-empty", "load"}, bad
    assert "311 empty" in bad["shapes"]
    assert "lm_head.weight [0]" in bad["non-empty"]


def test_fails_without_config(tmp_path, model):
    report = verify_folder(write_folder(tmp_path / "nocfg", model, config=False), expect=311)
    assert set(failed(report)) == {"config"}
    assert "no config.json" in failed(report)["config"]
    assert report.check("load") is None  # not attempted without a config
    assert report.check("non-empty").ok and report.check("count").ok


def test_fails_on_a_wrong_shape(tmp_path, model):
    sd = state(model)
    sd["model.layers.3.mlp.up_proj.weight"] = sd["model.layers.3.mlp.up_proj.weight"][:100].clone()
    report = verify_folder(write_folder(tmp_path / "shape", model, sd))
    bad = failed(report)
    assert "shapes" in bad and "model.layers.3.mlp.up_proj.weight [100, 64] != [128, 64]" in bad["shapes"]
    assert "load" in bad
    assert report.check("non-empty").ok


def test_fails_when_the_tied_alias_differs(tmp_path, model):
    sd = state(model)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    report = verify_folder(write_folder(tmp_path / "tied", model, sd), load=False)
    assert set(failed(report)) == {"tied"}
    assert "lm_head.weight != model.embed_tokens.weight" in failed(report)["tied"]


def test_fails_on_a_missing_key_that_is_not_a_tied_alias(tmp_path, model):
    sd = state(model)
    del sd["model.norm.weight"]
    report = verify_folder(write_folder(tmp_path / "missing", model, sd), load=False)
    assert "1 missing: model.norm.weight" in failed(report)["keys"]


def test_fails_on_nan_or_inf_naming_the_first_and_how_many(tmp_path, model):
    """dsfix verify reads every floating tensor (in blocks of rows) for NaN and Inf; exit 1."""
    from patcher.checkpoint.verify import verify_path
    from patchkit import run

    sd = state(model)
    sd["model.layers.2.self_attn.q_proj.weight"][5, 1] = float("inf")
    sd["model.layers.20.mlp.up_proj.weight"][0, 3] = float("nan")
    folder = write_folder(tmp_path / "diverged", model, sd)
    assert verify_folder(folder).ok  # without finite=True, as convert checks the folders it writes
    result = verify_path(folder)
    assert result.exit_code == 1
    expected = "2 of 311 floating tensors hold NaN or Inf, the first model.layers.2.self_attn.q_proj.weight"
    assert failed(result.reports[0]) == {"finite": expected}
    p = run("verify", folder, env={"COLUMNS": "300"}, timeout=300)  # wide enough that the table keeps the line
    assert p.returncode == 1 and expected in p.stderr.decode(), p.stderr.decode()[-2000:]


def test_finite_checks_on_a_thread_give_the_same_answers_and_stop_when_left(tmp_path, model):
    """dsfix verify reads for NaN and Inf on a thread started before transformers is imported (FiniteChecks):
    each folder's answer is the one finite_check gives in line, an error on the thread is raised where its
    folder's answer is asked for, and leaving the block stops the thread before its next tensor."""
    from patcher.checkpoint.check.values import FiniteChecks, finite_check
    from patcher.checkpoint.readers.safetensors import SafetensorsFolder

    sd = state(model)
    sd["model.layers.3.mlp.down_proj.weight"][1, 1] = float("nan")
    folders = [write_folder(tmp_path / "good", model), write_folder(tmp_path / "nan", model, sd)]
    with FiniteChecks(folders) as started:
        answers = [started.result(f) for f in reversed(folders)]
    for folder, answer in zip(reversed(folders), answers):
        with SafetensorsFolder(folder) as reader:
            assert answer == finite_check(reader, reader.header)
    assert [a.ok for a in answers] == [False, True] and "model.layers.3.mlp.down_proj.weight" in answers[0].detail

    missing = tmp_path / "gone"
    shutil.copytree(folders[0], missing)
    (missing / "model.safetensors").unlink()
    with FiniteChecks([missing]) as started:
        with pytest.raises(DsfixError):
            started.result(missing)

    started = FiniteChecks([folders[0]] * 50)  # far more reading than the test waits for
    with started:
        pass
    assert not started._thread.is_alive() and len(started._done) < 50


def test_the_nan_pass_counts_every_byte_for_its_progress(tmp_path, model, monkeypatch):
    """verify's progress: finite_check hands each block's bytes to ``advance``, and they add up to finite_bytes
    (the progress's total), in a clean folder and in one whose NaN ends a tensor's checking after its first
    block; with a console off a terminal, FiniteChecks prints the plain line."""
    from rich.console import Console

    from patcher.checkpoint.check import values
    from patcher.checkpoint.readers.safetensors import SafetensorsFolder

    monkeypatch.setattr(values, "BLOCK_BYTES", 4096)  # several blocks a tensor
    sd = state(model)
    sd["model.layers.3.mlp.down_proj.weight"][0, 0] = float("nan")
    folders = [write_folder(tmp_path / "good", model), write_folder(tmp_path / "nan", model, sd)]
    for folder, ok in zip(folders, (True, False)):
        counted: list = []
        with SafetensorsFolder(folder) as reader:
            assert values.finite_check(reader, reader.header, advance=counted.append).ok is ok
            assert sum(counted) == values.finite_bytes(reader.header) > 0 and len(counted) > len(reader.header.entries)

    monkeypatch.setattr(values, "MIN_BYTES", 0)
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    with values.FiniteChecks(folders, console) as started:
        assert [started.result(f).ok for f in folders] == [True, False]
    assert console.file.getvalue().startswith("dsfix verify: reading every tensor (NaN and Inf): 0 MB of ")


def test_fails_on_mixed_dtypes(tmp_path, model):
    sd = state(model)
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.bfloat16)
    report = verify_folder(write_folder(tmp_path / "mixed", model, sd), load=False)
    assert "mix dtypes" in failed(report)["dtype"] and "bfloat16" in failed(report)["dtype"]


def test_expect_counts_tensors(tmp_path, model):
    folder = write_folder(tmp_path / "count", model)
    report = verify_folder(folder, expect=310, load=False)
    assert set(failed(report)) == {"count"}
    assert failed(report)["count"] == "311 tensors, expected 310"
    assert verify_folder(folder, expect=311, load=False).ok


def test_bad_input_raises_code_2(tmp_path, model):
    with pytest.raises(DsfixError) as e:
        verify_folder(tmp_path / "nope")
    assert e.value.code == 2
    (tmp_path / "file").write_text("x")
    with pytest.raises(DsfixError) as e:
        verify_folder(tmp_path / "file")
    assert e.value.code == 2 and "not a folder" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DsfixError) as e:
        verify_folder(tmp_path / "empty")
    assert e.value.code == 2 and "no model weights" in str(e.value)
    (tmp_path / "pickle").mkdir()
    torch.save({}, tmp_path / "pickle" / "pytorch_model.bin")
    with pytest.raises(DsfixError) as e:
        verify_folder(tmp_path / "pickle")
    assert e.value.code == 2 and "pytorch_model.bin" in str(e.value)


def test_fixture_configs_have_311_keys():
    from transformers import AutoConfig, AutoModelForCausalLM

    for path, params in ((NARROW, None), (FULL, 596049920)):
        cfg = AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg)
        sd = m.state_dict(keep_vars=True)
        assert len(sd) == 311 and sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
        if params:
            assert sum(p.numel() for p in m.parameters()) == params
            assert (cfg.vocab_size, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (151936, 1024, 8, 128)


def test_import_does_not_load_torch():
    code = ("import sys, patcher.checkpoint.verify, patcher.checkpoint.smoke; "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_cli_shows_no_third_party_progress_bar(tmp_path, model):
    """from_pretrained on a sharded folder draws transformers' "Loading checkpoint shards" bar (5.x: "Loading
    weights" on every load); dsfix verify's table is the output, nothing of theirs."""
    from patchkit import run

    sd = state(model)
    keys = list(sd)
    folder = tmp_path / "sharded"
    folder.mkdir()
    halves = {"model-00001-of-00002.safetensors": keys[:150], "model-00002-of-00002.safetensors": keys[150:]}
    for name, ks in halves.items():
        save_file({k: sd[k] for k in ks}, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, ks in halves.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model.config.to_json_file(str(folder / "config.json"))
    p = run("verify", folder, "--expect", "311", timeout=300)
    err = p.stderr.decode()
    assert p.returncode == 0, err[-2000:]
    assert "%|" not in err and "Loading" not in err and "Warning" not in err, err
    assert err.rstrip().endswith("all checks hold: 311 tensors, causal LM (a Trainer's or accelerate's model, "
                                 "DeepSpeed-Chat's step-1 model or step-3 actor/EMA)")


def test_a_fork_that_saves_safely_writes_a_folder_that_verifies(tmp_path, model, tiny_qwen3_tokenizer):
    """fixtures/checkouts/fork-saves-safely, which check and apply leave alone: its own save_hf_format (a
    state dict passed to save_pretrained), run on the tied narrow Qwen3, writes safetensors that verify holds,
    with the tied weights loaded tied, as patcher.patch.safe says."""
    import importlib.util
    from argparse import Namespace

    from smokekit import REPO

    pytest.importorskip("deepspeed")  # the fixture's utils.py imports it, as DeepSpeed-Chat's does

    path = REPO / "fixtures" / "checkouts" / "fork-saves-safely" / "dschat" / "utils" / "utils.py"
    spec = importlib.util.spec_from_file_location("dsfix_fixture_saves_safely", path)
    assert spec is not None and spec.loader is not None
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    utils.save_hf_format(model, tiny_qwen3_tokenizer, Namespace(output_dir=str(tmp_path)), sub_folder="final")
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert not list((tmp_path / "final").glob("*.bin"))
    report = verify_folder(tmp_path / "final")
    assert report.ok, failed(report)


def _peak_anon_mib(args) -> tuple:
    """(exit code, the peak anonymous memory in MiB) of ``python -m patcher ARGS``, read from
    /proc/PID/status (RssAnon) every few milliseconds while it runs."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "patcher", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                anon = [int(line.split()[1]) for line in f if line.startswith("RssAnon:")]
            peak = max([peak] + anon)
        except OSError:
            pass
        time.sleep(0.005)
    return proc.returncode, peak / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/PID/status")
def test_verify_does_not_hold_the_model(tmp_path):
    """dsfix verify of a 210 MiB bf16 folder (421 MiB in fp32, as a plain from_pretrained loads it) holds no
    more anonymous memory than for a 2 MiB folder of the narrow layers, give or take a quarter of the files: a
    whole-model load needs all 421 MiB more. The files' memory-mapped pages are the kernel's (file-backed) and
    not counted."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(NARROW))
    small = narrow_model("float32", seed=0)
    write_folder(tmp_path / "small", small)
    cfg.update({"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 64, "torch_dtype": "bfloat16"})
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in type(small)(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()
               if k != "lm_head.weight"}
    big = tmp_path / "big"
    big.mkdir()
    save_file(tensors, str(big / "model.safetensors"), metadata={"format": "pt"})
    cfg.to_json_file(str(big / "config.json"))
    files_mib = sum(t.numel() * 2 for t in tensors.values()) / 2**20
    del tensors
    assert 200 < files_mib < 220
    (rc_small, base), (rc_big, peak) = _peak_anon_mib(["verify", tmp_path / "small"]), _peak_anon_mib(["verify", big])
    assert rc_small == 0 and rc_big == 0
    assert peak - base < files_mib / 4, f"{peak:.0f} MiB against {base:.0f} MiB for {files_mib:.0f} MiB of files"
