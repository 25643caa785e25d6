"""PEFT LoRA: the names PEFT saves, adapter_config.json, what the merge refuses and how it scales, one row a case
(fast tier); then the reader of a PEFT run's engine files and the merge against PEFT's own, on small tensors."""
from __future__ import annotations

import json

import pytest

from patcher.checkpoint.readers.peft import adapter_name, adapter_text, read_adapter_config
from patcher.errors import DsfixError

Q = "base_model.model.model.layers.0.self_attn.q_proj"

LAYER = "base_model.model.model.layers.0"
LORA_Q = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
SAVED_NAMES = [  # (adapter_config.json, a parameter of the PEFT model, the name PEFT's get_peft_model_state_dict saves)
    (LORA_Q, f"{Q}.lora_A.default.weight", f"{Q}.lora_A.weight"),
    ({**LORA_Q, "use_dora": True}, f"{Q}.lora_magnitude_vector.default.weight", f"{Q}.lora_magnitude_vector"),
    ({**LORA_Q, "lora_bias": True}, f"{Q}.lora_B.default.bias", f"{Q}.lora_B.bias"),
    ({**LORA_Q, "rank_pattern": {"q_proj": 8}, "alpha_pattern": {"q_proj": 4}}, f"{Q}.lora_B.default.weight",
     f"{Q}.lora_B.weight"),
    ({**LORA_Q, "target_modules": ["embed_tokens"]}, "base_model.model.model.embed_tokens.lora_embedding_A.default",
     "base_model.model.model.embed_tokens.lora_embedding_A"),
    ({**LORA_Q, "modules_to_save": ["lm_head"], "ensure_weight_tying": True},
     "base_model.model.model.embed_tokens.modules_to_save.default.weight",
     "base_model.model.model.embed_tokens.weight"),
    ({**LORA_Q, "modules_to_save": ["lm_head"], "ensure_weight_tying": True},
     "base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.lm_head.weight"),
    ({"peft_type": "IA3", "target_modules": ["q_proj"], "feedforward_modules": []}, f"{Q}.ia3_l.default",
     f"{Q}.ia3_l"),
    ({"peft_type": "LOHA", "target_modules": ["q_proj"]}, f"{Q}.hada_w1_a.default", f"{Q}.hada_w1_a"),
]


@pytest.fixture(scope="module")
def tiny_config(tiny_qwen3_helper):
    """The narrow Qwen3's config with one layer: PEFT models of it are built on the meta device."""
    return tiny_qwen3_helper.tiny_qwen3_config(num_hidden_layers=1)


@pytest.mark.parametrize("config, name, saved", SAVED_NAMES)
def test_the_name_peft_saves_comes_from_peft(tiny_config, config, name, saved):
    """Each trained parameter of the PEFT model, by name, to the name PEFT's own state dict gives it; every trained
    parameter has one."""
    pytest.importorskip("peft")
    from patcher.checkpoint.check.adapter import peft_model, saved_names

    model = peft_model(config, tiny_config)
    names = saved_names(model)
    assert names[name] == saved
    assert {n for n, p in model.named_parameters() if p.requires_grad} <= set(names)


@pytest.mark.parametrize("config, words", [
    ({"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 4, "task_type": "CAUSAL_LM"},
     "refused: a PEFT PREFIX_TUNING adapter (prompt learning)"),
    ({"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 4, "task_type": "CAUSAL_LM"},
     "refused: a PEFT PROMPT_TUNING adapter (prompt learning)"),
    ({"peft_type": "NOT_A_METHOD"}, "peft_type 'NOT_A_METHOD' is not one this PEFT knows"),
])
def test_a_peft_type_without_renamed_parameters_is_refused_in_one_line(tiny_config, config, words):
    pytest.importorskip("peft")
    from patcher.checkpoint.check.adapter import peft_model, saved_names

    with pytest.raises(DsfixError) as info:
        saved_names(peft_model(config, tiny_config))
    assert words in info.value.message and "\n" not in info.value.message and len(info.value.message) <= 200


@pytest.mark.parametrize("config, text", [
    (LORA_Q, "PEFT LoRA, r 4, lora_alpha 8"),
    ({**LORA_Q, "use_dora": True, "use_rslora": True}, "PEFT LoRA (DoRA, rsLoRA), r 4, lora_alpha 8"),
    ({**LORA_Q, "rank_pattern": {"q_proj": 8}, "alpha_pattern": {"v_proj": 2}},
     "PEFT LoRA, r 4, lora_alpha 8, rank_pattern q_proj: 8, alpha_pattern v_proj: 2"),
    ({**LORA_Q, "lora_bias": True, "bias": "all"}, "PEFT LoRA, r 4, lora_alpha 8, lora_bias, bias all"),
    ({"peft_type": "IA3"}, "PEFT IA3"),
])
def test_the_adapter_is_described_with_its_options(config, text):
    assert adapter_text(config) == text


@pytest.mark.parametrize("names, expected", [
    ([f"{Q}.lora_A.default.weight", f"{Q}.lora_B.default.weight"], "default"),
    ([f"{Q}.lora_A.sft.weight", "base_model.model.model.norm.weight"], "sft"),
    ([f"{Q}.lora_A.a.weight", f"{Q}.lora_A.b.weight"], "adapters a, b"),
    (["base_model.model.model.norm.weight"], "no LoRA parameter"),
])
def test_the_one_adapter_of_the_run(names, expected):
    if " " not in expected:
        assert adapter_name(names, LORA) == expected
        return
    with pytest.raises(DsfixError) as info:
        adapter_name(names, LORA)
    assert expected in info.value.message and info.value.message.startswith("refused:")


@pytest.mark.parametrize("content, expected", [
    (None, None),
    ('{"peft_type": "LORA", "r": 4}', {"peft_type": "LORA", "r": 4}),
    ("[1, 2]", "adapter_config.json is unreadable: not a JSON object"),
    ("{not json", "adapter_config.json is unreadable"),
])
def test_reading_adapter_config(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "adapter_config.json").write_text(content)
    if isinstance(expected, str):
        with pytest.raises(DsfixError, match=expected):
            read_adapter_config(tmp_path)
    else:
        assert read_adapter_config(tmp_path) == expected


LORA = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none"}


# ----------------------------------------------------------------------------- on tensors (torch, PEFT)


@pytest.mark.slow
def test_a_peft_runs_engine_files_read_as_the_adapter_peft_saves(tmp_path, tiny_config):
    """The trained parameters under PEFT's saved names (from PEFT: DoRA's magnitude without .weight), in the dtype
    the module held them (a ZeRO-3 placeholder's), the tied modules_to_save copy an alias of its partner, the base
    model's own tie left out."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from collections import OrderedDict

    import ckptkit
    from patcher.checkpoint.check.adapter import peft_model, saved_names
    from patcher.checkpoint.readers import open_step
    from patcher.checkpoint.readers.peft import PeftRun

    emb = "base_model.model.model.embed_tokens"
    trained = OrderedDict([(f"{Q}.lora_A.default.weight", ckptkit.value("a", (4, 64))),
                           (f"{Q}.lora_B.default.weight", ckptkit.value("b", (64, 4))),
                           (f"{Q}.lora_magnitude_vector.default.weight", ckptkit.value("m", (64,))),
                           (f"{emb}.modules_to_save.default.weight", ckptkit.value("e", (512, 64)))])
    shared = {"base_model.model.lm_head.modules_to_save.default.weight": f"{emb}.modules_to_save.default.weight",
              "base_model.model.lm_head.weight": f"{emb}.weight"}  # the base's own tie: not the adapter's
    root = ckptkit.write_engine(tmp_path / "ckpt", trained, stage=3, shared=shared, precision="bf16")
    config = {**LORA_Q, "use_dora": True, "modules_to_save": ["lm_head"], "ensure_weight_tying": True}
    names = saved_names(peft_model(config, tiny_config))
    with PeftRun(open_step(root / "global_step1"), config, root, names) as reader:
        assert list(reader.tensors) == [f"{Q}.lora_A.weight", f"{Q}.lora_B.weight", f"{Q}.lora_magnitude_vector",
                                        f"{emb}.weight"]
        assert {h.dtype for h in reader.tensors.values()} == {torch.bfloat16}
        assert reader.aliases == {"base_model.model.lm_head.weight": f"{emb}.weight"}
        assert "a PEFT LoRA (DoRA), r 4, lora_alpha 8 adapter (4 tensors)" in reader.describe()
        got = reader.read(reader.tensors)
    assert all(torch.equal(got[names[n]], t.to(torch.bfloat16)) for n, t in trained.items())


# ----------------------------------------------------------------------------- --merge: PEFT's own merge, each kind

MERGES = [  # (the kind, the LoraConfig's arguments, the base model: qwen3 (tied, no biases), qwen3-bias, gpt2)
    ("LoRA", {}, "qwen3"),
    ("rsLoRA", {"use_rslora": True}, "qwen3"),
    ("DoRA", {"use_dora": True}, "qwen3"),
    ("rank_pattern, alpha_pattern", {"rank_pattern": {"q_proj": 8}, "alpha_pattern": {"v_proj": 2}}, "qwen3"),
    ("LoRA biases", {"lora_bias": True}, "qwen3-bias"),
    ("bias=all", {"bias": "all"}, "qwen3-bias"),
    ("embedding LoRA", {"target_modules": ["embed_tokens", "q_proj"]}, "qwen3-untied"),
    ("modules_to_save, tied", {"modules_to_save": ["lm_head"], "ensure_weight_tying": True}, "qwen3"),
    ("LoRA on the tied lm_head", {"target_modules": ["lm_head", "q_proj"]}, "qwen3"),
    ("fan_in_fan_out (Conv1D)", {"target_modules": ["c_attn"], "fan_in_fan_out": True}, "gpt2"),
    ("IA3", {"peft_type": "IA3", "target_modules": ["q_proj", "down_proj"], "feedforward_modules": ["down_proj"]},
     "qwen3"),
]


def _base_model(kind, helper):
    """A seeded tiny base model in bf16: GPT-2 (Conv1D layers), or the narrow Qwen3 with 2 layers (tied, untied,
    or with attention biases)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3ForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128,
                                          n_positions=64)).to(torch.bfloat16)
    config = helper.tiny_qwen3_config(num_hidden_layers=2, tie_word_embeddings=kind != "qwen3-untied")
    config.attention_bias = kind == "qwen3-bias"
    return Qwen3ForCausalLM(config).to(torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("kind, options, base_kind", MERGES, ids=[m[0] for m in MERGES])
def test_merge_is_peft_merge_and_unload_bit_for_bit(tmp_path, tiny_qwen3_helper, kind, options, base_kind):
    """An adapter PEFT saved (every trained tensor made non-zero), merged by dsfix convert --merge and by
    PeftModel.from_pretrained(base, adapter).merge_and_unload() on the same bf16 base: bit-equal, every tensor."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from patcher.checkpoint.convert import convert

    base = _base_model(base_kind, tiny_qwen3_helper)
    base.save_pretrained(tmp_path / "base")
    targets = ["q_proj", "v_proj"] if base_kind.startswith("qwen3") else ["c_attn"]
    if options.get("peft_type") == "IA3":
        lora = peft.IA3Config(**{k: v for k, v in options.items() if k != "peft_type"})
    else:
        lora = peft.LoraConfig(r=4, lora_alpha=8, **{"target_modules": targets, **options})
    model = peft.get_peft_model(_base_model(base_kind, tiny_qwen3_helper), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))

    result = convert(tmp_path / "adapter", output=tmp_path / "merged", merge=True)
    assert result.ok, result.message
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16)
    expected = peft.PeftModel.from_pretrained(loaded, tmp_path / "adapter").merge_and_unload().state_dict()
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert set(written) <= set(expected)
    for name, tensor in expected.items():
        got = written.get(name)
        if got is None:  # a tied alias the base folder leaves out
            assert base_kind == "qwen3" and name == "lm_head.weight"
            continue
        assert got.dtype == tensor.dtype and torch.equal(got.view(-1).view(torch.int16),
                                                         tensor.reshape(-1).view(torch.int16)), name


def _base(model, events):
    """A base folder's random-access reader over a model's state dict (its tied alias left out, as save_pretrained
    leaves it), recording each read, and whether a tensor it gave before is still held by then."""
    import weakref

    from patcher.checkpoint.readers.base import Held, Reader

    class Base(Reader):
        random_access = True

        def __init__(self):
            super().__init__(".")
            self.state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
            self.tensors = {k: Held(k, tuple(v.shape), v.dtype) for k, v in self.state.items()}
            self.events = events
            self.given: list = []

        def slice(self, name):
            held = [n for n, given in self.given if given() is not None]
            self.events.append(f"read {name}" + (f" while {', '.join(held)} held" if held else ""))
            tensor = self.state[name].clone()
            self.given.append((name, weakref.ref(tensor)))
            return tensor

        def describe(self):
            return "base"

    return Base()


def _adapter(model, config):
    """PEFT's saved adapter of ``config`` on ``model``, every trained tensor non-zero."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict

    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


@pytest.mark.slow
def test_the_merge_reads_one_base_tensor_at_a_time(tiny_qwen3_helper):
    """Memory stays bounded: each base tensor is read, merged and handed on, and let go, before the next is read."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from patcher.checkpoint.steps.merge import MergedPeft

    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"], "use_dora": True}
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=0, dtype=torch.bfloat16, num_hidden_layers=2)
    adapter = _adapter(tiny_qwen3_helper.tiny_qwen3_model(seed=0, dtype=torch.bfloat16, num_hidden_layers=2),
                       peft.LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"}))
    events = []
    merged = MergedPeft(_base(model, events), adapter, config, model.config, "run")
    merged.stream(lambda name, first, data: events.append(f"put {name}"))
    names = [k for k in model.state_dict() if k != "lm_head.weight"]
    assert events == [f"{what} {n}" for n in names for what in ("read", "put")]


@pytest.mark.slow
def test_the_merge_writes_into_copies_never_into_the_base_folders_map(tmp_path, tiny_qwen3_helper):
    """PEFT's merge() adds into its base layer's weight in place. A safetensors base folder's tensors are views of
    a private (copy-on-write) map of its files, whose written pages would stay in memory until the map is closed
    (an 8B merge held 16.8 GiB so): each weight merged is a copy of its own, freed once written."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file

    from patcher.checkpoint.readers.safetensors import SafetensorsFolder
    from patcher.checkpoint.steps.merge import MergedPeft

    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"]}
    model = tiny_qwen3_helper.tiny_qwen3_model(seed=0, dtype=torch.bfloat16, num_hidden_layers=2)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    adapter = _adapter(tiny_qwen3_helper.tiny_qwen3_model(seed=0, dtype=torch.bfloat16, num_hidden_layers=2),
                       peft.LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"}))
    spans, handed = [], []
    with SafetensorsFolder(tmp_path) as base:
        read = base.read

        def recorded(names):  # where each tensor the base reader gives lies
            got = read(names)
            for tensor in got.values():
                storage = tensor.untyped_storage()
                spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
            return got

        base.read = recorded
        merged = MergedPeft(base, adapter, config, model.config, "run")

        def put(name, first, data):
            if name in merged.owner:
                handed.append(name)
                assert not any(a <= data.data_ptr() < b for a, b in spans), f"{name} merged in the base's memory"

        merged.stream(put)
    assert len(handed) == 4  # q_proj and down_proj of both layers


@pytest.mark.parametrize("config, change, words", [
    ({"target_modules": ["q_proj"]}, lambda a: a.update(x=a.popitem()[1]), "the adapter holds x, which its PEFT model"),
    ({"target_modules": ["q_proj"]}, lambda a: a.popitem(), "the adapter lacks base_model.model.model.layers.0.self_"),
    ({"target_modules": ["embed_tokens", "lm_head"]}, None, "changes lm_head.weight, which the base folder does not "
                                                            "hold as a tensor"),
    ({"target_modules": ["q_proj"], "lora_bias": True}, None, "PEFT's merge() of model.layers.0.self_attn.q_proj "
                                                              "refused"),
], ids=["a tensor PEFT's model has not", "a tensor missing", "LoRA on both tied ends", "lora_bias, no base bias"])
def test_what_the_merge_refuses_in_one_line(tiny_qwen3_helper, config, change, words):
    """Each refusal is one PEFT itself makes (its merge() refuses), or a tensor the merge has no place for."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from patcher.checkpoint.steps.merge import MergedPeft

    model = tiny_qwen3_helper.tiny_qwen3_model(seed=0, dtype=torch.bfloat16, num_hidden_layers=1)
    adapter = _adapter(tiny_qwen3_helper.tiny_qwen3_model(seed=0, dtype=torch.bfloat16, num_hidden_layers=1),
                       peft.LoraConfig(r=2, lora_alpha=4, **config))
    if change is not None:
        change(adapter)
    with pytest.raises(DsfixError) as info:
        MergedPeft(_base(model, []), adapter, {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}, model.config,
                   "run").stream(lambda name, first, data: None)
    assert words in info.value.message and "\n" not in info.value.message and len(info.value.message) <= 200


# ----------------------------------------------------------------------------- the lines an adapter fails with

def _check(name, ok, detail="d"):
    from patcher.checkpoint.check.headers import Check

    return Check(name, ok, detail)


@pytest.mark.parametrize("checks, line", [
    ([("config", True), ("keys", True)], ""),
    ([("config", True), ("keys", False, "4 missing: a.lora_magnitude_vector"), ("load", False)],
     "keys: 4 missing: a.lora_magnitude_vector; next: pass --base, the model it was trained on; else convert the "
     "run's engine files again"),
    ([("base", False, "base_model_name_or_path: x is neither a folder here nor in the Hugging Face cache; pass --base "
                      "BASE_DIR")],
     "base: base_model_name_or_path: x is neither a folder here nor in the Hugging Face cache; pass --base BASE_DIR"),
    ([("finite", False, "NaN in 2 tensors")], "finite: NaN in 2 tensors; next: the training diverged: convert an "
                                              "earlier checkpoint-N"),
    ([("shapes", False, "x" * 300)], f"shapes: {'x' * 97}...; next: pass --base, the model it was trained on; else "
                                     "convert the run's engine files again"),
    ([("dtype", False, "mixed")], "dtype: mixed; next: see the table above"),
])
def test_a_failed_adapter_s_last_line_names_its_first_failed_check_and_the_next_step(checks, line):
    from patcher.checkpoint.check.adapter import failed_line

    got = failed_line([_check(*c) for c in checks])
    assert got == line and len(got) <= 200


@pytest.mark.parametrize("layout, start, engines, adapters", [
    # (folders: name -> files, the folder looked from, engine checkpoints found, adapter_config.json folders found)
    ({"state": ["latest"], "adapter": ["adapter_config.json"]}, "state", [], ["adapter"]),
    ({"state": ["latest"], "adapter": ["adapter_config.json"]}, "adapter", ["state"], []),
    ({"state": ["latest"], "a": ["adapter_config.json"], "b": ["adapter_config.json"]}, "state", [], ["a", "b"]),
    ({"adapter": ["adapter_config.json"], "adapter/state": ["latest"]}, "adapter", ["adapter/state"], []),
    ({".": ["adapter_config.json"], "state": ["latest"]}, "state", [], ["."]),
    ({"state": ["latest"], "other": ["notes.txt"]}, "state", [], []),
])
def test_what_is_found_beside_a_state_folder_or_an_adapter_folder(tmp_path, layout, start, engines, adapters):
    from patcher.checkpoint.readers.find import adapter_configs_beside, engine_files_beside

    root = tmp_path / "run"
    for folder, files in layout.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name in files:
            (root / folder / name).write_text("global_step1" if name == "latest" else "{}")
    names = lambda found: [str(p.relative_to(root.resolve())) for p in found]  # noqa: E731
    assert names(engine_files_beside(root / start)) == engines
    assert names(adapter_configs_beside(root / start)) == adapters
