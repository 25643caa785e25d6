"""The save module (templates/dsfix_safetensors.py), imported as dsfix's torch side imports it, on the CPU:
real torch, safetensors and transformers. Under real DeepSpeed ranks: test_save_module_ranks.py."""
import ast
import errno
import hashlib
import inspect
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from patcher.templates import dsfix_safetensors as M
from smokekit import REPO, same_attention

pytestmark = pytest.mark.slow  # torch models saved and reloaded

MODULE_PATH = os.path.abspath(M.__file__)
QWEN3_KEYS = 311
TIED = ("lm_head.weight", "model.embed_tokens.weight")
FUZZ = int(40 * float(os.environ.get("DSFIX_FUZZ_SCALE", "1")))


def _header(path):
    with open(path, "rb") as handle:
        return json.loads(handle.read(int.from_bytes(handle.read(8), "little")))


def _keys(path):
    with safe_open(str(path), framework="pt") as handle:
        return list(handle.keys())


def _probe():
    return torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(3))


def _load(folder, like=None, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), **(same_attention(like) if like is not None else {}),
                                                **kwargs).eval()


def _files(folder):
    """Every file in ``folder``: name -> (sha256, inode). Equal before and after: the files are the very same."""
    out = {}
    for here, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(here, name)
            out[os.path.relpath(path, folder)] = (hashlib.sha256(open(path, "rb").read()).hexdigest(),
                                                  os.stat(path).st_ino)
    return out


def _tokenizer_files(tokenizer, scratch):
    """The files this transformers' save_pretrained writes for ``tokenizer``, sorted."""
    tokenizer.save_pretrained(str(scratch))
    return sorted(os.listdir(scratch))


def _same(tensors, model):
    """``tensors`` holds exactly the model's state dict, equal."""
    state = model.state_dict()
    return set(tensors) == set(state) and all(torch.equal(tensors[k], v) for k, v in state.items())


def _hidden(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


class _Holder(torch.nn.Module):
    """A module whose state dict is the given tensors, in order, as buffers (views stay views)."""

    def __init__(self, tensors):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


# --------------------------------------------------------------------------- the module itself

ALLOWED_IMPORTS = {"atexit", "contextlib", "ctypes", "errno", "functools", "json", "os", "shutil", "signal",
                   "threading", "concurrent.futures.ThreadPoolExecutor", "typing.NamedTuple", "torch",
                   "safetensors.safe_open"}


def test_the_module_is_plain_python_3_9_with_its_public_api():
    source = open(MODULE_PATH, encoding="utf-8").read()
    tree = ast.parse(source, feature_version=(3, 9))  # runs where the user trains: Python 3.9 and later
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{a.name}" for a in node.names}
    assert imported == ALLOWED_IMPORTS  # no numpy, transformers or dsfix; deepspeed only inside the ZeRO-3 code
    inner = {node.module if isinstance(node, ast.ImportFrom) else alias.name
             for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in tree.body
             for alias in node.names}
    assert inner == {"deepspeed", "deepspeed.accelerator"}, inner
    assert re.findall(r"^VERSION = (\d+)$", source, re.M) == ["6"] and M.VERSION == 6
    assert "numpy" not in source.replace("never numpy", "").replace("no numpy", "")
    assert all(hasattr(M, name) for name in M.__all__)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            assert node.end_lineno - node.lineno < 60, f"{node.name} is {node.end_lineno - node.lineno + 1} lines"


SIGNATURES = [
    (M.save_hf_format, ["model", "tokenizer", "output_dir"],
     {"global_rank": None, "strategy": "clone", "drop": None, "max_shard_size": None, "gather_bucket_mb": None}),
    (M.save_zero_three_model, ["model", "save_dir"],
     {"global_rank": None, "zero_stage": 3, "tokenizer": None, "with_config": False, "strategy": "clone",
      "drop": None, "max_shard_size": None, "gather_bucket_mb": None}),
]


@pytest.mark.parametrize("function, positional, keywords", SIGNATURES, ids=[s[0].__name__ for s in SIGNATURES])
def test_the_save_functions_take_the_keywords_the_wrappers_pass(function, positional, keywords):
    params = inspect.signature(function).parameters.values()
    assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY} == keywords


def test_saves_where_numpy_deepspeed_and_transformers_cannot_be_imported(tmp_path):
    """As `dsfix apply` puts it beside a user's utils.py: imported by its own name from that folder. torch
    wheels before 2.3 cannot use numpy 2 (".numpy()" raises "Numpy is not available"); here numpy cannot be
    imported at all, so torch runs without it the same way."""
    shutil.copyfile(MODULE_PATH, tmp_path / "dsfix_safetensors.py")
    script = textwrap.dedent("""
        import sys
        sys.modules["numpy"] = sys.modules["deepspeed"] = None  # importing them raises ImportError
        import torch
        try:
            torch.zeros(1).numpy()
            raise SystemExit("numpy is still usable")
        except (RuntimeError, ImportError, TypeError):
            pass
        sys.path.insert(0, sys.argv[1])
        import dsfix_safetensors
        gen = torch.Generator().manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Embedding(10, 3), torch.nn.Linear(3, 10, bias=False)).to(torch.bfloat16)
        net[1].weight = net[0].weight
        net.register_buffer("ids", torch.arange(7))
        net.register_buffer("scale", torch.randn(3, generator=gen).double())
        net.register_buffer("mask", torch.rand(5, generator=gen) > 0.5)
        net.register_buffer("fp16_t", torch.randn(2, 3, generator=gen).half().t())  # not contiguous
        for name in ("float8_e4m3fn", "float8_e5m2"):
            net.register_buffer(name, torch.randn(4, generator=gen).to(getattr(torch, name)))
        dsfix_safetensors.save_zero_three_model(net, sys.argv[2], global_rank=0, zero_stage=0)
        dsfix_safetensors.save_hf_format(net, None, sys.argv[2] + "/hf")
        # as bytes: torch 2.1 cannot pickle float8 tensors
        torch.save({k: (str(v.dtype), tuple(v.shape), v.contiguous().reshape(-1).view(torch.uint8))
                    for k, v in net.state_dict().items()}, sys.argv[2] + "/expected.pt")
        assert sys.modules["numpy"] is None and sys.modules["deepspeed"] is None
        assert "transformers" not in sys.modules
        print("OK")
    """)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(out)], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("[dsfix] verified 8 tensors") == 2, proc.stdout
    expected = torch.load(str(out / "expected.pt"))
    for folder in (out, out / "hf"):
        loaded = load_file(str(folder / "model.safetensors"))
        assert set(loaded) == set(expected)
        for name, (dtype, shape, data) in expected.items():
            got = loaded[name]
            assert str(got.dtype) == dtype and tuple(got.shape) == shape, name
            assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), data), name


# --------------------------------------------------------------------------- Qwen3 round trips


def test_clone_round_trip_reproduces_logits_and_ties(tmp_path, tiny_qwen3, tiny_qwen3_tokenizer, capsys):
    out = tmp_path / "sft"
    count = len(_tokenizer_files(tiny_qwen3_tokenizer, tmp_path / "scratch"))
    M.save_hf_format(tiny_qwen3, tiny_qwen3_tokenizer, str(out))
    assert capsys.readouterr().out.splitlines() == [
        "[dsfix] lm_head.weight shares storage with model.embed_tokens.weight: written as its own copy",
        f"[dsfix] saved weights to {out / 'model.safetensors'}",
        "[dsfix] verified 311 tensors (names, shapes, dtypes; none empty)",
        f"[dsfix] wrote config.json, generation_config.json and {count} tokenizer files to {out}, after the weights",
    ]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"} <= \
        set(os.listdir(out))
    assert _hidden(out) == []
    loaded = load_file(str(out / "model.safetensors"))
    assert len(loaded) == QWEN3_KEYS and set(loaded) == set(tiny_qwen3.state_dict())
    assert loaded[TIED[0]].untyped_storage().data_ptr() != loaded[TIED[1]].untyped_storage().data_ptr()
    assert all(torch.equal(loaded[k], v) for k, v in tiny_qwen3.state_dict().items())
    reloaded = _load(out, like=tiny_qwen3)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(reloaded(_probe()).logits, tiny_qwen3(_probe()).logits)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("what is tea").input_ids == tiny_qwen3_tokenizer("what is tea").input_ids


def test_dedupe_writes_310_like_save_pretrained(tmp_path, tiny_qwen3, capsys):
    M.save_hf_format(tiny_qwen3, None, str(tmp_path), strategy="dedupe")
    assert "lm_head.weight shares storage with model.embed_tokens.weight: not written" in capsys.readouterr().out
    keys = _keys(tmp_path / "model.safetensors")
    tiny_qwen3.save_pretrained(str(tmp_path / "ref"))
    assert len(keys) == QWEN3_KEYS - 1 and set(keys) == set(_keys(tmp_path / "ref" / "model.safetensors"))
    reloaded = _load(tmp_path, like=tiny_qwen3)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(reloaded(_probe()).logits, tiny_qwen3(_probe()).logits)


@pytest.mark.parametrize("dtype,code", [(torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32")])
def test_dtypes_round_trip(tmp_path, tiny_qwen3_helper, dtype, code):
    from patcher.checkpoint.check.load import dtype_kwarg

    model = tiny_qwen3_helper.tiny_qwen3_model(seed=1, dtype=dtype)
    M.save_hf_format(model, None, str(tmp_path))
    assert {v["dtype"] for k, v in _header(tmp_path / "model.safetensors").items() if k != "__metadata__"} == {code}
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(loaded[k].dtype == dtype and torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert _load(tmp_path, **{dtype_kwarg(): dtype}).lm_head.weight.dtype == dtype


def test_wrappers_are_unwrapped(tmp_path, tiny_qwen3):
    engine_like = types.SimpleNamespace(module=torch.compile(tiny_qwen3))  # DeepSpeedEngine.module, compiled
    M.save_hf_format(engine_like, None, str(tmp_path))
    keys = _keys(tmp_path / "model.safetensors")
    assert len(keys) == QWEN3_KEYS and not any("_orig_mod" in k or k.startswith("module.") for k in keys)
    assert json.load(open(tmp_path / "config.json"))["model_type"] == "qwen3"


def test_sharded_output_loads(tmp_path, tiny_qwen3, capsys):
    M.save_hf_format(tiny_qwen3, None, str(tmp_path), max_shard_size=200_000)
    out = capsys.readouterr().out
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert f"({len(shards)} shards)" in out and "verified 311 tensors" in out
    assert not (tmp_path / "model.safetensors").exists() and set(index["weight_map"]) == set(tiny_qwen3.state_dict())
    sizes = []
    for shard in shards:
        header = _header(tmp_path / shard)
        assert all(index["weight_map"][k] == shard for k in header if k != "__metadata__")
        sizes.append(sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"))
        assert sizes[-1] <= 200_000 or len(header) == 2
    assert index["metadata"]["total_size"] == sum(sizes)
    reloaded = _load(tmp_path, like=tiny_qwen3)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(reloaded(_probe()).logits, tiny_qwen3(_probe()).logits)


def test_the_default_shard_size_keeps_full_qwen3_in_one_file():
    from transformers import AutoConfig

    from patcher.checkpoint.check.model import meta_model
    from smokekit import FULL

    model = meta_model(AutoConfig.from_pretrained(str(FULL)))
    planned = [M.PlannedTensor(k, torch.bfloat16, tuple(v.shape)) for k, v in model.state_dict().items()]
    files = M.layout_files(planned)
    assert len(planned) == QWEN3_KEYS and [f.name for f in files] == ["model.safetensors"]
    assert 1.4e9 < files[0].size < 1.6e9  # ~1.5 GB with the cloned lm_head


def test_layout_runs_in_order_and_each_file_by_dtype_then_name(tiny_qwen3):
    planned = [M.PlannedTensor(k, v.dtype, tuple(v.shape)) for k, v in tiny_qwen3.state_dict().items()]
    files = M.layout_files(planned, 200_000)
    assert [t.name for f in files for t in f.tensors] == [t.name for t in planned]  # runs, in order
    assert all(sum(t.nbytes for t in f.tensors) <= 200_000 or len(f.tensors) == 1 for f in files)
    assert [f.name for f in files] == [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for f in files:
        ordered = sorted(f.offsets, key=f.offsets.get)
        assert ordered == sorted(ordered) and f.offsets[ordered[0]] == len(f.header) and len(f.header) % 8 == 0
        assert f.size == len(f.header) + sum(t.nbytes for t in f.tensors)


def _lora_model(model):
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.lora_right_weight = torch.nn.Parameter(torch.zeros(64, 8))
    q_proj.lora_left_weight = torch.nn.Parameter(torch.zeros(8, 64))
    model.model.layers[3].mlp.register_buffer("lora_scaling", torch.ones(1))
    assert len(model.state_dict()) == QWEN3_KEYS + 3
    return model


@pytest.mark.parametrize("call, expected", [
    ("hf", QWEN3_KEYS),  # upstream's rule: every name with "lora" in it is left out
    ("zero3 at stage 3", QWEN3_KEYS),
    ("zero3 at stage 0", QWEN3_KEYS + 3),  # upstream's save_zero_three_model filters at stage 3 only
    ("zero3 at stage 2", QWEN3_KEYS + 3),
])
def test_lora_names_are_left_out_as_upstream_leaves_them(tmp_path, tiny_qwen3, call, expected):
    model = _lora_model(tiny_qwen3)
    if call == "hf":
        M.save_hf_format(model, None, str(tmp_path))
    else:
        M.save_zero_three_model(model, str(tmp_path), global_rank=0, zero_stage=int(call[-1]))
    assert len(_keys(tmp_path / "model.safetensors")) == expected


@pytest.mark.parametrize("drop, kept", [
    (None, ["c.svd_u"]),  # upstream's rule
    (lambda name: False, ["a.lora_right_weight", "b.lora_scaling", "c.svd_u"]),  # a fork that keeps LoRA
    (lambda name: "svd" in name, ["a.lora_right_weight", "b.lora_scaling"]),  # a fork's own filter
    (lambda name: "lora" in name or name.startswith("c."), []),
])
def test_drop_decides_which_names_are_left_out(tmp_path, drop, kept):
    module = torch.nn.Module()
    module.base = torch.nn.Linear(2, 2)
    for name, buffers in {"a": {"lora_right_weight": torch.ones(2, 2)}, "b": {"lora_scaling": torch.ones(1)},
                          "c": {"svd_u": torch.zeros(3)}}.items():
        module.add_module(name, _Holder(buffers))
    M.save_hf_format(module, None, str(tmp_path), drop=drop)
    assert sorted(_keys(tmp_path / "model.safetensors")) == sorted(["base.weight", "base.bias"] + kept)


# --------------------------------------------------------------------------- what shares memory


def test_views_at_an_offset_are_found(tmp_path, capsys):
    base = torch.arange(40, dtype=torch.float32)
    tensors = {
        "a": base[0:10],                  # the first of its storage
        "b": base[5:15],                  # overlaps a at an offset: data_ptr differs
        "c": base[0:5],                   # same data_ptr as a, another shape: a partial overlap
        "d": base[5:15].view(10),         # a new view object, exactly b
        "e": base[30:40],                 # same storage, no overlap: not shared
        "f": base[20:30].view(2, 5).t(),  # not contiguous, alone
        "g": torch.arange(3.0),
    }
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({k: v.contiguous() if k == "f" else v for k, v in tensors.items()}, str(tmp_path / "x"))
    M.save_zero_three_model(_Holder(tensors), str(tmp_path / "clone"), global_rank=0, zero_stage=0)
    assert [line for line in capsys.readouterr().out.splitlines() if "storage" in line] == [
        "[dsfix] b shares storage with a (a different view): written as its own copy",
        "[dsfix] c shares storage with a (a different view): written as its own copy",
        "[dsfix] d shares storage with b: written as its own copy",
    ]
    loaded = load_file(str(tmp_path / "clone" / "model.safetensors"))
    assert sorted(loaded) == sorted(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    M.save_zero_three_model(_Holder(tensors), str(tmp_path / "dedupe"), global_rank=0, zero_stage=0, strategy="dedupe")
    loaded = load_file(str(tmp_path / "dedupe" / "model.safetensors"))
    assert sorted(loaded) == ["a", "b", "c", "e", "f", "g"]  # only the exact alias d is left out
    assert all(torch.equal(loaded[k], tensors[k]) for k in loaded)


def test_empty_tensors_are_never_shared(tmp_path, capsys):
    base = torch.arange(8.0)
    tensors = {"e1": torch.empty(0), "e2": torch.empty(0), "e3": base[3:3], "e4": base[3:3], "full": base,
               "e5": torch.zeros(2, 0)}
    M.save_zero_three_model(_Holder(tensors), str(tmp_path), global_rank=0, zero_stage=0, strategy="dedupe")
    out = capsys.readouterr().out
    assert "storage" not in out
    assert "verified 6 tensors (names, shapes, dtypes; none empty but the 5 the model holds empty)" in out
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert {k: list(v.shape) for k, v in loaded.items()} == {k: list(v.shape) for k, v in tensors.items()}


def _overlaps(x, y):
    if x.numel() == 0 or y.numel() == 0 or x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False

    def span(t):
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(x), span(y)
    return a0 < b1 and b0 < a1


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(views=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12), st.integers(0, 8)), min_size=1, max_size=8),
       strategy=st.sampled_from(["clone", "dedupe"]))
def test_find_overlap_against_brute_force_and_the_saved_files(tmp_path_factory, views, strategy):
    bases = [torch.randn(20), torch.randn(20), torch.randn(20)]
    tensors = {f"t{i}": bases[b][s:s + n] for i, (b, s, n) in enumerate(views)}
    seen, names = {}, list(tensors)

    def view(t):
        return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()

    for i, name in enumerate(names):
        earlier = [m for m in names[:i] if _overlaps(tensors[m], tensors[name])]
        same = [m for m in earlier if view(tensors[m]) == view(tensors[name])]
        expected = (same[0], True) if same else (earlier[0], False) if earlier else (None, False)
        assert M.find_overlap(name, tensors[name], seen) == expected, (name, earlier)
    out = tmp_path_factory.mktemp("prop")
    M.save_zero_three_model(_Holder(tensors), str(out), global_rank=0, zero_stage=0, strategy=strategy)
    loaded = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(loaded[k], tensors[k]) for k in loaded)
    assert set(loaded) == set(tensors) if strategy == "clone" else set(loaded) <= set(tensors)


# --------------------------------------------------------------------------- the file format

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8, torch.int32,
           torch.float64, torch.int8, torch.int16]


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.dictionaries(
    st.text("abxyz_é\"\\/\tк", min_size=1, max_size=6).map(lambda s: "k" + s),
    st.tuples(st.sampled_from(range(len(_DTYPES))), st.lists(st.integers(0, 4), max_size=3)),
    min_size=1, max_size=8))
def test_the_file_is_the_one_save_file_writes(tmp_path_factory, specs):
    """Any names (quotes, backslashes, tabs, non-ASCII), dtypes and shapes: byte for byte save_file's file."""
    out = tmp_path_factory.mktemp("bytes")
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(shape, generator=gen) * 50).to(_DTYPES[i]) for name, (i, shape) in specs.items()}
    M.save_zero_three_model(_Holder(tensors), str(out), global_rank=0, zero_stage=0)
    save_file(tensors, str(out / "ref.safetensors"), metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == (out / "ref.safetensors").read_bytes()


def _mixed_module(specs):
    """A module holding ``specs`` [(dotted name, dtype, shape)] as seeded buffers; (module, {name: tensor})."""
    gen = torch.Generator().manual_seed(len(specs))
    root, tensors = torch.nn.Module(), {}
    for name, dtype, shape in specs:
        values = torch.randn(shape, generator=gen) * 8
        tensors[name] = values > 0 if dtype == torch.bool else values.to(dtype)
        owner, *path = [root] + name.split(".")
        for part in path[:-1]:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_buffer(path[-1], tensors[name])
    return root, tensors


ALIGNMENT = {  # name: [(tensor name, dtype, shape)] in the module's state_dict order
    "6-byte bf16 weight first": [("w", torch.bfloat16, (3,)), ("f32", torch.float32, (3,)), ("i64", torch.int64, (7,)),
                                 ("f16", torch.float16, (2,)), ("f64", torch.float64, (5,))],
    "one byte first": [("a.u8", torch.uint8, (3,)), ("b.f64", torch.float64, (2, 3)), ("c.bool", torch.bool, (5,)),
                       ("d.i32", torch.int32, (3,))],
    "bf16 model, fp32 norm, int64 ids": [("layer.weight", torch.bfloat16, (5, 3)), ("norm.weight", torch.float32, (3,)),
                                         ("position_ids", torch.int64, (1, 9)), ("layer.bias", torch.bfloat16, (5,))],
    "same sizes, other dtypes": [("z.f16", torch.float16, (3,)), ("a.bf16", torch.bfloat16, (3,)),
                                 ("m.i64", torch.int64, (1,)), ("b.f64", torch.float64, (1,)),
                                 ("k.f32", torch.float32, (1,)), ("c.i32", torch.int32, (3,))],
    "empty tensors between": [("e.f64", torch.float64, (0,)), ("x.bf16", torch.bfloat16, (1,)),
                              ("y.i64", torch.int64, (2,)), ("e2.f32", torch.float32, (0, 4))],
    "every dtype": [(f"t{i:02d}", d, (2 * i + 1,)) for i, d in enumerate(
        [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
         torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2])],
}


@pytest.mark.parametrize("case", list(ALIGNMENT))
def test_mixed_dtypes_are_aligned_with_the_header_save_file_writes(tmp_path, case):
    module, tensors = _mixed_module(ALIGNMENT[case])
    M.save_zero_three_model(module, str(tmp_path), global_rank=0, zero_stage=0)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    path = tmp_path / "model.safetensors"
    length = int.from_bytes(path.read_bytes()[:8], "little")
    assert path.read_bytes()[:8 + length] == (tmp_path / "ref.safetensors").read_bytes()[:8 + length]
    assert path.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    ours = _header(path)
    with open(path, "r+b") as handle:  # every tensor viewed in place from a memory map, without a copy
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        for name, tensor in tensors.items():
            assert ours[name]["data_offsets"][0] % tensor.element_size() == 0, (name, ours[name])
            if tensor.numel():
                view = torch.frombuffer(mapped, dtype=tensor.dtype, count=tensor.numel(),
                                        offset=8 + length + ours[name]["data_offsets"][0]).view(tensor.shape)
                assert torch.equal(view.view(torch.uint8), tensor.view(torch.uint8)), name
                del view
        mapped.close()


def test_dtype_codes_and_the_table_dsfix_reads():
    from patcher.checkpoint.readers.safetensors import dtype_codes

    assert [M.DTYPES[d] for d in (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool,
                                  torch.float8_e4m3fn)] == ["BF16", "F16", "F32", "I64", "BOOL", "F8_E4M3"]
    assert dtype_codes() == {str(d).replace("torch.", ""): c for d, c in M.DTYPES.items()}


def test_no_copy_of_the_model_in_memory(tmp_path):
    """96 MiB of weights, 64 MiB of them tied: saving with clone must not grow the peak RSS by a copy."""
    script = textwrap.dedent("""
        import resource, sys, torch
        from patcher.templates import dsfix_safetensors as M
        net = torch.nn.Module()
        net.embed = torch.nn.Parameter(torch.empty(16 * 1024 * 1024).fill_(1.5))
        net.other = torch.nn.Parameter(torch.empty(8 * 1024 * 1024).fill_(2.5))
        net.head = net.embed
        M.save_zero_three_model(net, sys.argv[1], global_rank=0, zero_stage=0)  # warm up (imports, page cache)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        M.save_zero_three_model(net, sys.argv[1], global_rank=0, zero_stage=0)
        print("GROWTH_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert int(proc.stdout.split("GROWTH_KIB")[1]) < 16 * 1024  # a clone in RAM would add 64 MiB
    assert os.path.getsize(tmp_path / "model.safetensors") > 160 * 1024 * 1024


@pytest.mark.parametrize("options, message", [
    ({"max_shard_size": 0}, "max_shard_size must be a positive number of bytes, not 0"),
    ({"max_shard_size": -5}, "max_shard_size must be a positive number of bytes, not -5"),
    ({"max_shard_size": "5GB"}, "max_shard_size must be a positive number of bytes, not '5GB'"),
    ({"strategy": "copy"}, 'strategy must be "clone" or "dedupe", not \'copy\''),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, tiny_qwen3, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        M.save_zero_three_model(tiny_qwen3, str(tmp_path / "out"), global_rank=0, **options)
    assert not (tmp_path / "out").exists()


def test_the_shard_size_is_a_number_of_bytes(tmp_path, tiny_qwen3):
    M.save_zero_three_model(tiny_qwen3, str(tmp_path / "a"), global_rank=0, max_shard_size=1234)
    assert len(json.load(open(tmp_path / "a" / "model.safetensors.index.json"))["weight_map"]) == QWEN3_KEYS
    M.save_zero_three_model(tiny_qwen3, str(tmp_path / "b"), global_rank=0, zero_stage=0)
    assert os.listdir(tmp_path / "b") == ["model.safetensors"]


# --------------------------------------------------------------------------- a failure leaves the previous save


def _previous_save(folder, helper, tokenizer):
    """A good save (seed 5) in ``folder``, with an old pytorch_model.bin beside it; its files, as _files."""
    M.save_hf_format(helper.tiny_qwen3_model(seed=5), tokenizer, str(folder))
    (folder / "pytorch_model.bin").write_text("an old save the next one removes")
    return _files(folder)


def _fail_nth(monkeypatch, owner, name, n, error):
    """``owner.name`` raises ``error`` (or, when it is a signal number, that signal arrives) at its n-th call."""
    real, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            if isinstance(error, int):
                signal.raise_signal(error)
            else:
                raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def _config_breaks(monkeypatch):
    from transformers import PretrainedConfig

    def to_json_file(self, path, *args, **kwargs):
        raise TypeError("config broke")

    monkeypatch.setattr(PretrainedConfig, "to_json_file", to_json_file)


def _fail_moving_in(monkeypatch, name, error):
    """os.rename raises ``error`` the first time it would move a file called ``name`` into the output folder."""
    real, failed = os.rename, []

    def rename(source, target):
        if os.path.basename(target) == name and M.FALLBACK_FOLDER not in str(target) and not failed and \
                not os.path.basename(os.path.dirname(target)).startswith("."):
            failed.append(target)
            raise error
        return real(source, target)

    monkeypatch.setattr(os, "rename", rename)


class _BrokenTokenizer:
    def save_pretrained(self, folder):
        open(os.path.join(folder, "tokenizer_config.json"), "w").write("{half")
        raise ValueError("save_pretrained broke")

    def save_vocabulary(self, folder):
        raise ValueError("save_vocabulary broke too")


FAILURES = [
    # (name, how it fails, the error raised, whether the weights go to the fallback folder)
    ("a tensor's write", lambda mp: _fail_nth(mp, M.WeightWriter, "write", 120, RuntimeError("injected")),
     RuntimeError, "injected", True),
    ("the second shard's write", lambda mp: _fail_nth(mp, M.WeightWriter, "write", 290, RuntimeError("injected")),
     RuntimeError, "injected", True),
    ("fsync of a weight file", lambda mp: _fail_nth(mp, os, "fsync", 1, OSError(errno.EIO, "Input/output error")),
     OSError, "Input/output error", True),
    ("the tokenizer", lambda mp: None, ValueError, "save_vocabulary broke too", True),
    ("config.json", lambda mp: _config_breaks(mp), TypeError, "config broke", True),
    ("a move in the final phase, config.json already replaced",  # the moves made are undone
     lambda mp: _fail_moving_in(mp, "tokenizer.json", OSError(errno.EIO, "Input/output error")),
     OSError, "Input/output error", True),
    ("a read-only disk in the final phase",
     lambda mp: _fail_moving_in(mp, "config.json", OSError(errno.EROFS, "Read-only file system")),
     M.SaveError, "could not save to .*: Read-only file system; the folder is as it was before this save", False),
    ("Ctrl-C while writing", lambda mp: _fail_nth(mp, M.WeightWriter, "write", 100, signal.SIGINT),
     KeyboardInterrupt, "", False),
]


@pytest.mark.parametrize("inject, error, message, fallback", [f[1:] for f in FAILURES], ids=[f[0] for f in FAILURES])
def test_a_failure_leaves_the_previous_save_as_it_was(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer, monkeypatch,
                                                      inject, error, message, fallback):
    before = _previous_save(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer)
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=6)
    tokenizer = _BrokenTokenizer() if "broke too" in message else tiny_qwen3_tokenizer
    inject(monkeypatch)
    with pytest.raises(error, match=message or None):
        M.save_hf_format(model, tokenizer, str(tmp_path), max_shard_size=300_000)
    monkeypatch.undo()
    after = _files(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith(M.FALLBACK_FOLDER)} == before  # same bytes, same files
    assert _hidden(tmp_path) == []
    if fallback:
        assert {"config.json", "pytorch_model.bin"} <= set(os.listdir(tmp_path / M.FALLBACK_FOLDER))
        saved = torch.load(str(tmp_path / M.FALLBACK_FOLDER / "pytorch_model.bin"), weights_only=True)
        assert _same(saved, model)
    else:
        assert M.FALLBACK_FOLDER not in os.listdir(tmp_path)


def test_ctrl_c_in_the_final_phase_waits_until_the_new_save_is_in_place(tmp_path, tiny_qwen3_helper,
                                                                        tiny_qwen3_tokenizer, monkeypatch):
    before = _previous_save(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer)
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=6)
    real_rename = os.rename

    def rename(source, target):  # the signal arrives as the first new file goes into place
        if str(target) == str(tmp_path / "model.safetensors"):
            signal.raise_signal(signal.SIGINT)
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        M.save_hf_format(model, tiny_qwen3_tokenizer, str(tmp_path))
    monkeypatch.undo()
    after = _files(tmp_path)
    assert "pytorch_model.bin" not in after and _hidden(tmp_path) == []
    assert set(after) == set(before) - {"pytorch_model.bin"}
    assert all(after[name][1] != before[name][1] for name in after)  # every file is the new save's
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_weights_go_in_first_then_config_and_tokenizer_then_stale_files_aside(tmp_path, tiny_qwen3,
                                                                           tiny_qwen3_tokenizer, monkeypatch):
    (tmp_path / "pytorch_model.bin").write_text("stale")
    real_rename, placed = os.rename, []

    def rename(source, target):
        if os.path.dirname(str(target)) == str(tmp_path):
            placed.append(os.path.basename(target))
        elif os.path.dirname(str(source)) == str(tmp_path):
            placed.append("aside " + os.path.basename(source))
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename)
    M.save_hf_format(tiny_qwen3, tiny_qwen3_tokenizer, str(tmp_path), max_shard_size=2_000_000)
    shards = sorted(n for n in os.listdir(tmp_path) if n.startswith("model-"))
    assert len(shards) == 3
    assert placed == shards + ["model.safetensors.index.json", "config.json", "generation_config.json"] + \
        _tokenizer_files(tiny_qwen3_tokenizer, tmp_path / "scratch") + ["aside pytorch_model.bin"]


# --------------------------------------------------------------------------- a full disk


DISK_FULL_CHILD = textwrap.dedent("""
    import json, os, resource, signal, subprocess, sys
    how, folder, fixtures = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path.insert(0, fixtures)
    import torch
    from tiny_qwen3 import tiny_qwen3_model, tiny_qwen3_tokenizer
    from patcher.templates import dsfix_safetensors as M
    os.makedirs(folder, exist_ok=True)
    if how == "mount":  # 8 MiB: the first save (4.5 MB) fits, the second (6.5 MB) does not beside it
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", folder], check=True)
    elif how == "fsize":  # no file over 5 MB: the first save's weights fit, the second's do not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (5 * 10**6, 5 * 10**6))
    try:
        tokenizer = tiny_qwen3_tokenizer()
        M.save_hf_format(tiny_qwen3_model(seed=1), tokenizer, folder)
        def state():
            return {n: (open(os.path.join(folder, n), "rb").read().hex()[:64], os.path.getsize(os.path.join(folder, n)),
                        os.stat(os.path.join(folder, n)).st_ino) for n in sorted(os.listdir(folder))}
        before = state()
        bigger = tiny_qwen3_model(seed=2)
        bigger.register_buffer("extra", torch.ones(500_000))  # 2 MB more
        try:
            M.save_hf_format(bigger, tokenizer, folder)
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        print("RESULT " + json.dumps({"before": before, "after": state(), "error": error}))
    finally:
        if how == "mount":
            subprocess.run(["umount", folder])
""")


def _disk_full_runs(folder):
    """How this machine can fill a disk on purpose: a tmpfs mounted in a mount namespace of the child's own
    (unshare, as root or not), else mounted by root here, else a file size limit (RLIMIT_FSIZE: "File too
    large"). Never none: the test runs everywhere."""
    python = [sys.executable, "-c", DISK_FULL_CHILD]
    runs = []
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode == 0:
        runs.append(([unshare, "-rm"] + python + ["mount"], errno.ENOSPC))
    elif os.geteuid() == 0 and shutil.which("mount"):
        runs.append((python + ["mount"], errno.ENOSPC))
    runs.append((python + ["fsize"], errno.EFBIG))
    return runs


def test_a_full_disk_leaves_the_previous_save_and_names_the_cause(tmp_path):
    for i, (command, code) in enumerate(_disk_full_runs(tmp_path)):
        folder = tmp_path / f"run{i}"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.run(command + [str(folder), str(REPO / "fixtures" / "step1_trainer")], capture_output=True,
                              text=True, timeout=300, env=env, cwd=str(tmp_path))
        found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
        assert proc.returncode == 0 and found, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads(found.group(1))
        assert result["after"] == result["before"]  # no file changed, none added, no temporary one left
        assert not [n for n in result["after"] if n.startswith(".") or n == M.FALLBACK_FOLDER]
        expected = f"SaveError: dsfix: could not save to {folder}: {os.strerror(code)}"
        assert result["error"].startswith(expected) and result["error"].endswith(
            "; the folder is as it was before this save"), result["error"]


# --------------------------------------------------------------------------- NaN and Inf


@pytest.mark.parametrize("dtype, values, expected", [
    (torch.float32, [1.0, 2.0, -3.0, 0.0, 5.0], True),
    (torch.float32, [1.0, 2.0, 3.0, 4.0, float("nan")], False),  # in the last chunk
    (torch.bfloat16, [float("inf"), 1.0, 2.0, 3.0, 4.0], False),  # in the first
    (torch.float16, [1.0, 2.0, float("-inf"), 3.0, 4.0], False),
    (torch.float64, [1e308, -1e308, 0.0, 1.0, 2.0], True),
    (torch.float8_e4m3fn, [1.0, float("nan"), 2.0, 3.0, 4.0], False),  # no min/max kernel for float8: widened
    (torch.float8_e5m2, [1.0, 2.0, 3.0, float("inf"), 4.0], False),
    (torch.float8_e5m2, [1.0, 2.0, 3.0, 4.0, 5.0], True),
    (torch.int64, [1, 2, 3, 4, 5], True),
    (torch.bool, [True, False, True, True, False], True),
])
def test_is_finite_in_chunks(dtype, values, expected):
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert M.is_finite(tensor, chunk_elements=2) is expected
    assert M.is_finite(tensor) is expected
    assert M.is_finite(tensor.repeat(3, 1).t(), chunk_elements=4) is expected  # not contiguous


def test_is_finite_of_empty_and_zero_dim_tensors():
    assert M.is_finite(torch.empty(0)) and M.is_finite(torch.zeros(3, 0))
    assert M.is_finite(torch.tensor(1.5)) and not M.is_finite(torch.tensor(float("nan")))


def test_non_finite_weights_are_saved_with_one_warning_and_fail_verify(tmp_path, tiny_qwen3, capsys):
    from patcher.checkpoint.verify import verify_path

    with torch.no_grad():
        tiny_qwen3.model.layers[3].mlp.up_proj.weight[1, 2] = float("nan")
        tiny_qwen3.model.norm.weight[0] = float("inf")
    M.save_hf_format(tiny_qwen3, None, str(tmp_path))
    warnings = [line for line in capsys.readouterr().out.splitlines() if "NaN" in line]
    assert warnings == ["[dsfix] WARNING: 2 of 311 tensors hold NaN or Inf, the first "
                        "model.layers.3.mlp.up_proj.weight; saved all the same (a diverged run's weights are still "
                        "evidence)"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert torch.isnan(loaded["model.layers.3.mlp.up_proj.weight"][1, 2])
    result = verify_path(tmp_path)
    assert result.exit_code == 1
    finite = result.reports[0].check("finite")
    assert not finite.ok and finite.detail == ("2 of 311 floating tensors hold NaN or Inf, the first "
                                               "model.layers.3.mlp.up_proj.weight")


# --------------------------------------------------------------------------- the fallback


def test_the_fallback_folder_converts_to_the_same_tensors(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer,
                                                          monkeypatch, capsys):
    from patcher.checkpoint.convert import convert

    before = _previous_save(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer)
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=7)
    _fail_nth(monkeypatch, M.WeightWriter, "write", 10, RuntimeError("injected writer failure"))
    with pytest.raises(RuntimeError, match="^injected writer failure$"):
        M.save_hf_format(model, tiny_qwen3_tokenizer, str(tmp_path))
    monkeypatch.undo()
    fallback = tmp_path / M.FALLBACK_FOLDER
    lines = [line for line in capsys.readouterr().out.splitlines() if "FALLBACK" in line]
    assert lines == [f"[dsfix] FALLBACK: the safetensors save to {tmp_path} failed (RuntimeError: injected writer "
                     f"failure); the weights are saved as upstream saves them, {fallback / 'pytorch_model.bin'}, with "
                     f"config.json and the tokenizer: `dsfix convert {fallback}` turns them into safetensors"]
    assert {k: v for k, v in _files(tmp_path).items() if not k.startswith(M.FALLBACK_FOLDER)} == before
    report = convert(fallback)
    assert report.exit_code == 0, report.to_dict()
    loaded = load_file(str(fallback / "model.safetensors"))
    assert _same(loaded, model)


class _Copies:
    """Counts the copies torch makes (clone, _to_copy, copy_) while entered, through a dispatch mode: every
    tensor copy, on any device, goes through one of them."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        copies, ops = [], (torch.ops.aten.clone, torch.ops.aten._to_copy, torch.ops.aten.copy_)

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in ops:
                    copies.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self.copies, self._mode = copies, Counting()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_the_fallback_copies_each_gathered_parameter_once_and_a_tied_alias_never(tmp_path, device):
    """A ZeRO-3 parameter's gathered memory is let go after its bucket, so the fallback keeps one host copy
    of it, which a tied alias shares (no copy made and thrown away); from a GPU that copy is the one that
    brings it to the host. A tensor that is not gathered is copied only when it is not on the host."""
    weight = torch.randn(6, 4, device=device)
    param = types.SimpleNamespace(data=weight, ds_status=types.SimpleNamespace(name="AVAILABLE"))
    norm = torch.randn(4, device=device)
    tensors = [M.PlannedTensor("embed.weight", weight.dtype, (6, 4), torch.empty(0), param),
               M.PlannedTensor("lm_head.weight", weight.dtype, (6, 4), torch.empty(0), param),
               M.PlannedTensor("norm.weight", norm.dtype, (4,), norm)]
    with _Copies() as counted:
        M._fallback(torch.nn.Module(), tensors, [tensors], str(tmp_path), 0, None, "why")
    assert len(counted.copies) == 1 + (device != "cpu"), counted.copies
    saved = torch.load(str(tmp_path / M.FALLBACK_FOLDER / "pytorch_model.bin"), weights_only=True)
    assert torch.equal(saved["embed.weight"], weight.cpu()) and torch.equal(saved["norm.weight"], norm.cpu())
    assert saved["lm_head.weight"].data_ptr() == saved["embed.weight"].data_ptr()  # one copy, saved once


def _eio(path):
    return OSError(errno.EIO, "Input/output error", path)


def test_an_io_error_in_the_tokenizers_save_fails_the_save(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer,
                                                           monkeypatch, capsys):
    """The disk failing under save_pretrained is not a tokenizer without save_pretrained: no save_vocabulary
    in its place (a save reported whole with part of its tokenizer), the previous save stays."""
    before = _previous_save(tmp_path, tiny_qwen3_helper, tiny_qwen3_tokenizer)
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=6)

    def save_pretrained(self, folder, *args, **kwargs):
        raise _eio(os.path.join(folder, "tokenizer_config.json"))

    monkeypatch.setattr(type(tiny_qwen3_tokenizer), "save_pretrained", save_pretrained)
    with pytest.raises(OSError, match="Input/output error"):
        M.save_hf_format(model, tiny_qwen3_tokenizer, str(tmp_path))
    monkeypatch.undo()
    assert {k: v for k, v in _files(tmp_path).items() if not k.startswith(M.FALLBACK_FOLDER)} == before
    out = capsys.readouterr().out
    assert "using save_vocabulary" not in out
    assert "with config.json; not written: the tokenizer (Input/output error (" in out
    assert sorted(os.listdir(tmp_path / M.FALLBACK_FOLDER)) == ["config.json", "pytorch_model.bin"]


def test_a_fallback_that_fails_leaves_no_folder_nor_file_of_its_own(tmp_path, tiny_qwen3, monkeypatch, capsys):
    tiny_qwen3.register_buffer("phase", torch.ones(3, dtype=torch.complex64))

    def save(obj, path, *args, **kwargs):
        with open(path, "wb") as handle:
            handle.write(b"half")
        raise _eio(path)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(ValueError, match="cannot store phase"):
        M.save_hf_format(tiny_qwen3, None, str(tmp_path))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    assert "FALLBACK FAILED" in capsys.readouterr().out


def test_a_config_the_disk_cannot_take_is_left_out_of_the_fallback_not_half_written(tmp_path, tiny_qwen3,
                                                                                    monkeypatch, capsys):
    from transformers import PretrainedConfig

    tiny_qwen3.register_buffer("phase", torch.ones(3, dtype=torch.complex64))

    def to_json_file(self, path, *args, **kwargs):
        with open(path, "w") as handle:
            handle.write("{half")
        raise _eio(path)

    monkeypatch.setattr(PretrainedConfig, "to_json_file", to_json_file)
    with pytest.raises(ValueError, match="cannot store phase"):
        M.save_hf_format(tiny_qwen3, None, str(tmp_path))
    monkeypatch.undo()
    assert os.listdir(tmp_path / M.FALLBACK_FOLDER) == ["pytorch_model.bin"]
    out = capsys.readouterr().out
    assert "without config.json (copy the model's config.json there); not written: config.json (Input/output " \
           "error (" in out, out


def test_a_dtype_safetensors_cannot_store_goes_to_the_fallback(tmp_path, tiny_qwen3):
    tiny_qwen3.register_buffer("phase", torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^dsfix: safetensors cannot store phase \(torch.complex64\)$"):
        M.save_hf_format(tiny_qwen3, None, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [M.FALLBACK_FOLDER]
    saved = torch.load(str(tmp_path / M.FALLBACK_FOLDER / "pytorch_model.bin"), weights_only=True)
    assert torch.equal(saved["phase"], torch.ones(3, dtype=torch.complex64)) and len(saved) == QWEN3_KEYS + 1


# --------------------------------------------------------------------------- the two calls of ZeRO-3, and ranks


def _fake_partitioned(model, empty):
    """ZeRO-3's marks on ordinary parameters (ds_id, ds_shape, ds_status); ``empty``: placeholders of shape [0]
    as the state dict holds them before a gather; else whole, so that nothing needs gathering."""
    for i, param in enumerate(model.parameters()):
        param.ds_id, param.ds_shape = i, param.shape
        param.ds_status = types.SimpleNamespace(name="NOT_AVAILABLE" if empty else "AVAILABLE")
        if empty:
            param.data = torch.empty(0, dtype=param.dtype)
    return model


def test_under_zero3_the_rank0_call_leaves_config_and_tokenizer_to_the_weights_save(tmp_path, tiny_qwen3,
                                                                                   tiny_qwen3_tokenizer, capsys):
    model = _fake_partitioned(tiny_qwen3, empty=False)
    M.save_hf_format(model, tiny_qwen3_tokenizer, str(tmp_path) + "/")
    assert capsys.readouterr().out.splitlines() == [
        f"[dsfix] ZeRO-3 parameters are partitioned: config.json and the tokenizer go to {tmp_path} with the weights, "
        "which save_zero_three_model_safetensors writes on every rank"]
    assert os.listdir(tmp_path) == []
    M.save_zero_three_model(model, str(tmp_path), global_rank=0, zero_stage=3)
    names = set(os.listdir(tmp_path))
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json"} <= names
    assert "wrote config.json, generation_config.json and " in capsys.readouterr().out
    M.save_zero_three_model(model, str(tmp_path / "alone"), global_rank=0, zero_stage=3)  # nothing was left for it
    assert os.listdir(tmp_path / "alone") == ["model.safetensors"]


def test_placeholders_saved_without_gathering_are_refused(tmp_path, tiny_qwen3):
    """The widely copied fix writes ZeRO-3's empty placeholders and still reports 311; here nothing is written."""
    with pytest.raises(M.SaveError, match=r"empty \[0\] but the model holds \[512, 64\].*ZeRO-3 placeholder"):
        M.save_zero_three_model(_fake_partitioned(tiny_qwen3, empty=True), str(tmp_path), global_rank=0, zero_stage=0)
    assert os.listdir(tmp_path) == []


def test_other_ranks_write_nothing(tmp_path, tiny_qwen3):
    M.save_zero_three_model(tiny_qwen3, str(tmp_path / "r1"), global_rank=1, zero_stage=0)
    M.save_zero_three_model(tiny_qwen3, str(tmp_path / "r1z3"), global_rank=1, zero_stage=3)
    M.save_hf_format(tiny_qwen3, None, str(tmp_path / "hf1"), global_rank=1)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- tokenizers, leftovers, stale files


class _VocabularyOnly:
    def save_vocabulary(self, folder):
        open(os.path.join(folder, "vocab.json"), "w").write("{}")
        return (os.path.join(folder, "vocab.json"),)


class _SavePretrainedFails(_VocabularyOnly):
    def save_pretrained(self, folder):
        open(os.path.join(folder, "tokenizer_config.json"), "w").write("{half")
        raise ValueError("this tokenizer cannot be saved with save_pretrained")


@pytest.mark.parametrize("tokenizer", [_VocabularyOnly(), _SavePretrainedFails()],
                         ids=["no save_pretrained", "it fails"])
def test_a_tokenizer_falls_back_to_save_vocabulary(tmp_path, tiny_qwen3, tokenizer, capsys):
    """Upstream's own call, made instead; what a failed save_pretrained wrote is not kept."""
    M.save_hf_format(tiny_qwen3, tokenizer, str(tmp_path))
    assert "using save_vocabulary" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors", "vocab.json"]


def test_what_killed_saves_left_is_removed(tmp_path, tiny_qwen3):
    (tmp_path / ".dsfix-save-4242").mkdir()
    (tmp_path / ".dsfix-save-4242" / "model.safetensors").write_bytes(b"torn")
    leftovers = [".model.safetensors.4242.dsfix-tmp", ".model-00001-of-00003.safetensors.77.dsfix-tmp"]
    for name in leftovers + [".mine.dsfix-tmp"]:
        (tmp_path / name).write_bytes(b"torn")
    M.save_hf_format(tiny_qwen3, None, str(tmp_path))
    assert _hidden(tmp_path) == [".mine.dsfix-tmp"]  # not a weight file's: not dsfix's to remove


def _remove_refused(monkeypatch, name):
    """os.remove of ``name`` fails as in a sticky shared folder whose file another user owns."""
    real = os.remove

    def remove(path, *args, **kwargs):
        if os.path.basename(path) == name:
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", remove)


@pytest.mark.parametrize("how", ["a folder of that name", "EPERM"])
def test_a_leftover_that_cannot_be_removed_leaves_the_save_a_success(tmp_path, tiny_qwen3_helper, monkeypatch,
                                                                     capsys, how):
    """The leftovers of an older dsfix go after the new save is in place: removing them is best-effort, and a
    save that succeeded is never reported as failed (nor does it write the fallback)."""
    name = ".model.safetensors.4242.dsfix-tmp"
    if how == "EPERM":
        (tmp_path / name).write_bytes(b"torn")
        _remove_refused(monkeypatch, name)
    else:
        (tmp_path / name).mkdir()
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=8)
    M.save_hf_format(model, None, str(tmp_path))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [name, "config.json", "generation_config.json", "model.safetensors"]
    assert _same(load_file(str(tmp_path / "model.safetensors")), model)
    out = capsys.readouterr().out
    assert "FALLBACK" not in out and f"saved weights to {tmp_path / 'model.safetensors'}" in out


def test_stale_weight_files_are_removed(tmp_path, tiny_qwen3, capsys):
    for name in ("pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
                 "model-00001-of-00009.safetensors", "model.safetensors.index.json", "training_args.bin", "notes.txt"):
        (tmp_path / name).write_text("old")
    M.save_hf_format(tiny_qwen3, None, str(tmp_path))
    assert (f"[dsfix] removed stale model-00001-of-00009.safetensors, model.safetensors.index.json, "
            f"pytorch_model-00001-of-00002.bin (+2 more) from {tmp_path}") in capsys.readouterr().out
    common = ["config.json", "generation_config.json", "notes.txt", "training_args.bin"]
    assert sorted(os.listdir(tmp_path)) == sorted(common + ["model.safetensors"])
    M.save_hf_format(tiny_qwen3, None, str(tmp_path), max_shard_size=400_000)
    shards = set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values())
    assert set(os.listdir(tmp_path)) == set(common) | {"model.safetensors.index.json"} | shards
    M.save_hf_format(tiny_qwen3, None, str(tmp_path), max_shard_size=1_000_000)
    fewer = set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values())
    assert len(fewer) < len(shards) and {n for n in os.listdir(tmp_path) if n.startswith("model-")} == fewer
    M.save_hf_format(tiny_qwen3, None, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(common + ["model.safetensors"])


# --------------------------------------------------------------------------- the file writer's checks


def _written(model, folder, limit):
    planned = [M.PlannedTensor(k, v.dtype, tuple(v.shape), v) for k, v in model.state_dict().items()]
    writer = M.WeightWriter(str(folder), M.layout_files(planned, limit))
    writer.open()
    for t in planned:
        writer.write(t.name, t.tensor)
    return writer


@pytest.mark.parametrize("damage, error, message", [
    ("shape", SafetensorError, ""),  # safetensors refuses a file whose header does not fit its length
    ("truncated", SafetensorError, ""),
    ("dtype", RuntimeError, "does not hold the header written"),  # safetensors opens it: the header is read back
    ("name", RuntimeError, "does not hold the header written"),
    ("a tensor not written", RuntimeError, "1 tensors were not written, the first model.norm.weight"),
])
def test_the_writer_checks_every_file(tmp_path, tiny_qwen3, damage, error, message):
    if damage == "a tensor not written":
        planned = [M.PlannedTensor(k, v.dtype, tuple(v.shape), v) for k, v in tiny_qwen3.state_dict().items()]
        writer = M.WeightWriter(str(tmp_path), M.layout_files(planned, 400_000))
        writer.open()
        for t in planned:
            if t.name != "model.norm.weight":
                writer.write(t.name, t.tensor)
    else:
        writer = _written(tiny_qwen3, tmp_path, 400_000)
        victim = tmp_path / writer.files[-1].name
        data, end = victim.read_bytes(), len(writer.files[-1].header)
        if damage == "truncated":
            data = data[:-8]
        else:
            old, new = {"shape": (b'"shape":[64]', b'"shape":[32]'), "dtype": (b'"F32"', b'"I32"'),
                        "name": (b'"model.', b'"modex.')}[damage]
            data = data[:end].replace(old, new, 1) + data[end:]
        victim.write_bytes(data)
    with pytest.raises(error, match=message or None):
        writer.finish()
    writer.close()


def test_the_writer_refuses_a_tensor_that_is_not_the_headers(tmp_path):
    planned = [M.PlannedTensor("w", torch.float32, (2, 3))]
    writer = M.WeightWriter(str(tmp_path), M.layout_files(planned))
    writer.open()
    with pytest.raises(RuntimeError, match=r"w is \[3, 2\] torch.float32 on cpu but the header says \[2, 3\]"):
        writer.write("w", torch.zeros(3, 2))
    writer.write("w", torch.ones(2, 3))
    assert writer.finish() == ["model.safetensors"]
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["w"], torch.ones(2, 3))


def test_a_folder_of_the_v2_inline_save_verifies_and_a_save_over_it_too(tmp_path, tiny_qwen3, tiny_qwen3_tokenizer):
    """Folders written by the inline save of an earlier release (not aligned on mixed dtypes) still verify;
    the module's save over one replaces it whole."""
    import importlib.util

    from patcher.checkpoint.check.verify import verify_folder

    try:
        torch.zeros(1).numpy()
    except RuntimeError:  # torch before 2.3 with numpy 2: the v2 save wrote through .numpy()
        pytest.skip("the v2 save cannot run where torch cannot use numpy")
    path = REPO / "fixtures" / "old_templates" / "save_safetensors_v2.py"
    spec = importlib.util.spec_from_file_location("dsfix_v2", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    old.save_hf_format_safetensors(tiny_qwen3, tiny_qwen3_tokenizer, types.SimpleNamespace(output_dir=str(tmp_path)))
    assert verify_folder(tmp_path, expect=QWEN3_KEYS).ok
    M.save_hf_format(tiny_qwen3, tiny_qwen3_tokenizer, str(tmp_path))
    assert verify_folder(tmp_path, expect=QWEN3_KEYS, finite=True).ok


# --------------------------------------------------------------------------- on a GPU (skipped without one)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_model_on_the_gpu_saves_the_files_of_the_same_model_on_the_cpu(tmp_path, tiny_qwen3_helper,
                                                                         tiny_qwen3_tokenizer, monkeypatch, capsys):
    """Tensors on the GPU: checked there, copied to the host one at a time, written byte for byte as from the
    CPU; NaN seen there; the fallback saves them to the host."""
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=3, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    M.save_hf_format(model, tiny_qwen3_tokenizer, str(tmp_path / "cpu"), max_shard_size=300_000)
    gpu = model.cuda()
    assert gpu.lm_head.weight.device.type == "cuda"
    M.save_hf_format(gpu, tiny_qwen3_tokenizer, str(tmp_path / "gpu"), max_shard_size=300_000)
    assert _files(tmp_path / "cpu").keys() == _files(tmp_path / "gpu").keys()
    assert all((tmp_path / "cpu" / n).read_bytes() == (tmp_path / "gpu" / n).read_bytes()
               for n in _files(tmp_path / "cpu"))
    assert capsys.readouterr().out.count("[dsfix] WARNING: 1 of 311 tensors hold NaN or Inf") == 2
    for values, expected in (([1.0, 2.0], True), ([1.0, float("inf")], False), ([float("nan")] * 3, False)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2):
            assert M.is_finite(torch.tensor(values).to(dtype).cuda(), chunk_elements=1) is expected
    _fail_nth(monkeypatch, M.WeightWriter, "write", 30, RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        M.save_hf_format(gpu, None, str(tmp_path / "fallback"))
    saved = torch.load(str(tmp_path / "fallback" / M.FALLBACK_FOLDER / "pytorch_model.bin"), weights_only=True)
    state = gpu.state_dict()
    assert {v.device.type for v in saved.values()} == {"cpu"}
    assert all(torch.equal(saved[k].reshape(-1).view(torch.uint8), v.cpu().reshape(-1).view(torch.uint8))
               for k, v in state.items())  # bit for bit: NaN is not equal to itself
