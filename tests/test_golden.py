"""What users get from ``dsfix convert`` and ``dsfix verify``, pinned byte for byte: the hash of every file a
conversion writes, the ``--json`` reports, and the writer's bytes for every kind of tensor.

Inputs are written by tests/ckptkit.py from values that depend on names and positions only, so the outputs
are the same on every machine: a ``.bin`` folder (tied, an alias missing, sharded, bf16 and fp32) converted in
place; engine checkpoints (ZeRO-2 and ZeRO-3, bf16 and fp32, frozen parameters, the tied alias recorded,
DeepSpeed-Chat LoRA factors) and universal checkpoints converted into ``--output``, each with clone or dedupe,
single file or sharded. The expected values live in tests/golden/; a deliberate change of output rewrites them
with ``DSFIX_GOLDEN=write python -m pytest tests/test_golden.py`` and is named in its commit.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torch, transformers, about 30 conversions of the narrow Qwen3

torch = pytest.importorskip("torch")

import ckptkit  # noqa: E402
from patchkit import cli  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
WRITE = os.environ.get("DSFIX_GOLDEN") == "write"


def _expected(name: str, actual):
    """Compare ``actual`` with tests/golden/NAME (JSON), or write it there under DSFIX_GOLDEN=write."""
    path = GOLDEN / name
    if WRITE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(actual, indent=2, sort_keys=True) + "\n")
        return
    assert path.is_file(), f"no golden {name}: run with DSFIX_GOLDEN=write once"
    assert json.loads(json.dumps(actual)) == json.loads(path.read_text())


def _hashes(folder: Path) -> dict:
    """Every file under ``folder``: relative name -> the start of its sha256."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- inputs

LORA_LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj")


def _engine_inputs(dtype_name: str, lora_rank: int = 0):
    """(trained fp32 masters without the tied alias, frozen parameters in the training dtype) of the narrow
    Qwen3, model.layers.1.mlp frozen; with ``lora_rank``, LoRA_LAYERS as DeepSpeed-Chat's LinearLayer_LoRA
    (weight frozen, factors trained)."""
    train = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    state = ckptkit.narrow_state(torch.float32, tied=False)
    del state["lm_head.weight"]
    frozen = {k: state.pop(k).to(train) for k in list(state) if k.startswith("model.layers.1.mlp.")}
    for layer in LORA_LAYERS if lora_rank else ():
        out_f, in_f = state[f"{layer}.weight"].shape
        frozen[f"{layer}.weight"] = state.pop(f"{layer}.weight").to(train)
        state[f"{layer}.lora_right_weight"] = ckptkit.value(f"{layer}.r", (in_f, lora_rank)) * 0.1
        state[f"{layer}.lora_left_weight"] = ckptkit.value(f"{layer}.l", (lora_rank, out_f)) * 0.1
    return state, frozen


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> (checkpoint folder, model folder for --config or None)."""
    base = tmp_path_factory.mktemp("golden-inputs")
    model = ckptkit.write_config(base / "model")
    out = {}
    bf16 = ckptkit.narrow_state(torch.bfloat16)
    fp32 = ckptkit.narrow_state(torch.float32)
    bins = {
        "bin-bf16-tied": (bf16, 1, "bfloat16"),
        "bin-fp32-alias-missing": ({k: v for k, v in fp32.items() if k != "lm_head.weight"}, 1, "float32"),
        "bin-bf16-sharded": (bf16, 3, "bfloat16"),
        "bin-bf16-alias-cloned": ({**bf16, "lm_head.weight": bf16["lm_head.weight"].clone()}, 1, "bfloat16"),
    }
    for name, (state, shards, dtype) in bins.items():
        folder = ckptkit.write_bin(base / name, state, shards)
        ckptkit.write_config(folder, dtype)
        out[name] = (folder, None)
    for stage in (2, 3):
        for precision in ("bf16", "fp32"):
            trained, frozen = _engine_inputs(precision)
            root = ckptkit.write_engine(base / f"z{stage}-{precision}", trained, stage=stage, frozen=frozen,
                                        shared=ckptkit.TIED, groups=2, precision=precision)
            out[f"z{stage}-{precision}"] = (root, model)
        ckptkit.write_universal(base / f"universal-z{stage}", base / f"z{stage}-bf16", _engine_inputs("bf16")[0])
        out[f"universal-z{stage}"] = (base / f"universal-z{stage}", model)
    trained, frozen = _engine_inputs("bf16", lora_rank=4)
    out["lora-z2"] = (ckptkit.write_engine(base / "lora-z2", trained, stage=2, frozen=frozen, shared=ckptkit.TIED,
                                           precision="bf16"), model)
    return out


# --------------------------------------------------------------------------- conversions

BIN_CASES = [("bin-bf16-tied", "clone"), ("bin-bf16-tied", "dedupe"), ("bin-fp32-alias-missing", "clone"),
             ("bin-bf16-sharded", "clone"), ("bin-bf16-alias-cloned", "dedupe")]

ENGINE_CASES = [  # (source, --dtype, --strategy, max shard bytes or None)
    ("z2-bf16", "auto", "clone", None), ("z2-bf16", "fp32", "dedupe", None), ("z2-fp32", "auto", "clone", None),
    ("z3-bf16", "auto", "clone", None), ("z3-bf16", "bf16", "dedupe", 200_000), ("z3-fp32", "fp32", "clone", None),
    ("universal-z2", "auto", "clone", None), ("universal-z3", "fp32", "dedupe", None),
    ("lora-z2", "auto", "clone", None),
]


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _convert_bin(folder: Path, strategy: str):
    from patcher.checkpoint.convert import convert

    return convert(folder, strategy=strategy, load=False)


def _convert_engine(ckpt: Path, model: Path, out: Path, dtype: str, strategy: str, shard):
    from patcher.checkpoint.convert import convert

    kwargs = {"max_shard_size": shard} if shard else {}
    return convert(ckpt, config=model, output=out, dtype=dtype, strategy=strategy, load=False, **kwargs)


def test_converted_files(sources, tmp_path):
    """Every file every conversion writes, by hash (one test: the table is read as a whole)."""
    found = {}
    for name, strategy in BIN_CASES:
        folder = _copy(sources[name][0], tmp_path / f"{name}-{strategy}")
        before = set(_hashes(folder))
        report = _convert_bin(folder, strategy)
        assert report.ok, report.to_json()
        found[f"{name} {strategy}"] = {k: v for k, v in _hashes(folder).items() if k not in before}
    for name, dtype, strategy, shard in ENGINE_CASES:
        ckpt, model = sources[name]
        out = tmp_path / f"{name}-{dtype}-{strategy}-{shard}"
        result = _convert_engine(ckpt, model, out, dtype, strategy, shard)
        assert result.ok, result.to_json()
        found[f"{name} --dtype {dtype} {strategy}" + (f" shards of {shard}" if shard else "")] = _hashes(out)
    _expected("converted-files.json", found)


def _normal(text: str, tmp: Path) -> object:
    """A --json report with this run's temporary folders as <TMP> (the test's) and <BASE> (pytest's, with
    pytest-xdist's worker folder popen-gwN)."""
    text = text.replace(str(tmp), "<TMP>")
    return json.loads(re.sub(r'/[^"\s]*/pytest-\d+/(popen-gw\d+/)?', "<BASE>/", text))


def _json(tmp: Path, *args):
    code, out, _ = cli(*args, "--json")
    return code, _normal(out.decode(), tmp)


def test_json_reports(sources, tmp_path):
    """The --json of convert (a .bin folder, an engine checkpoint, a failed check) and verify (a converted
    folder, --against a reference, a folder that fails)."""
    found = {}
    folder = _copy(sources["bin-bf16-tied"][0], tmp_path / "bin")
    found["convert .bin"] = _json(tmp_path, "convert", folder, "--no-load")
    ckpt, model = sources["z3-bf16"]
    found["convert engine"] = _json(tmp_path, "convert", ckpt, "--config", model, "--output", tmp_path / "z3",
                                    "--no-load")
    found["verify"] = _json(tmp_path, "verify", tmp_path / "z3", "--no-load")
    found["verify --against"] = _json(tmp_path, "verify", tmp_path / "z3", "--against", folder)
    wrong = ckptkit.write_config(tmp_path / "wrong", "bfloat16", hidden_size=32, head_dim=8)
    found["convert engine, a check fails"] = _json(tmp_path, "convert", ckpt, "--config", wrong, "--output",
                                                   tmp_path / "z3-wrong", "--no-load")
    found["verify, a check fails"] = _json(tmp_path, "verify", tmp_path / "bin", "--expect", "7", "--no-load")
    _expected("json-reports.json", found)


# --------------------------------------------------------------------------- the writer

KINDS = {  # every kind of tensor a checkpoint may hold
    "bf16": ckptkit.value("bf16", (3, 5), torch.bfloat16),
    "fp16": ckptkit.value("fp16", (4,), torch.float16),
    "fp32": ckptkit.value("fp32", (2, 3), torch.float32),
    "fp64": ckptkit.value("fp64", (2,), torch.float64),
    "int64": torch.arange(-3, 4, dtype=torch.int64),
    "int32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "uint8": torch.tensor([0, 255], dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(1.5, dtype=torch.float32),
    "empty": torch.empty(0, 4, dtype=torch.bfloat16),
}


def _write_with_dsfix(folder: Path, tensors: dict, limit: int) -> list:
    """dsfix's writer: the tensors laid out and streamed into ``folder``; the file names."""
    from patcher.checkpoint.write.plan import Entry
    from patcher.checkpoint.write.writer import Writer

    writer = Writer(folder, [Entry(n, tuple(t.shape), t.dtype, n) for n, t in tensors.items()], folder, limit)
    try:
        writer.open()
        for name, t in tensors.items():
            if t.numel():
                writer.put(name, 0, t.reshape(-1))
        return writer.finish()
    finally:
        writer.close()


def test_the_writer_writes_save_files_bytes_for_every_kind(tmp_path):
    from safetensors.torch import load_file, save_file

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    assert _write_with_dsfix(ours, KINDS, 5 * 2**30) == ["model.safetensors"]
    save_file(KINDS, str(theirs / "model.safetensors"), metadata={"format": "pt"})
    assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
    back = load_file(str(ours / "model.safetensors"))
    assert all(back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t)
               for k, t in KINDS.items())
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = _write_with_dsfix(sharded, KINDS, 40)
    assert names[-1] == "model.safetensors.index.json"
    assert len(names) > 2 and all(load_file(str(sharded / n)) for n in names[:-1])
    shards = {k: v for k, v in _hashes(sharded).items() if k.endswith(".safetensors")}
    _expected("writer.json", {"single": _hashes(ours), "shards of 40 bytes": shards})
