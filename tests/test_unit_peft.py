"""PEFT LoRA: the names PEFT saves, adapter_config.json, what the merge refuses and how it scales, one row a case
(fast tier); then the reader of a PEFT run's engine files and the merge against PEFT's own, on small tensors."""
from __future__ import annotations

import json
import math

import pytest

from patcher.checkpoint.readers.peft import adapter_name, adapter_text, read_adapter_config
from patcher.checkpoint.steps.merge import refusal, scaling
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


@pytest.mark.parametrize("changes, refused", [
    ({}, None),
    ({"peft_type": "IA3"}, "a PEFT IA3 adapter"),
    ({"use_dora": True}, "DoRA"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"rank_pattern": {"q_proj": 16}}, "per-module ranks or alphas"),
    ({"alpha_pattern": {"q_proj": 32}}, "per-module ranks or alphas"),
    ({"lora_bias": True}, "LoRA biases"),
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["model.embed_tokens"], "use_rslora": True}, None),
])
def test_what_the_merge_refuses(changes, refused):
    why = refusal({**LORA, **changes})
    assert why == refused if refused is None else refused in why


@pytest.mark.parametrize("r, alpha, rslora, expected", [
    (8, 16, False, 2.0), (4, 8, False, 2.0), (16, 16, True, 4.0), (3, 1, False, 1 / 3), (2, 8, True, 8 / math.sqrt(2)),
])
def test_the_merge_scales_as_peft_does(r, alpha, rslora, expected):
    assert scaling({"r": r, "lora_alpha": alpha, "use_rslora": rslora}) == expected


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


@pytest.mark.slow
@pytest.mark.parametrize("adapter_dtype", ["bfloat16", "float32"])
def test_the_merge_is_merge_and_unloads_bit_for_bit(adapter_dtype):
    """A bf16 base and its adapter (bf16, as TRL saves it at ZeRO-3, or fp32, as PEFT's default trains it) merged by
    dsfix and by PEFT's own PeftModel.from_pretrained(...).merge_and_unload(), on one Linear of a tiny model."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import ckptkit
    from patcher.checkpoint.steps.merge import merged

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(48, 32, bias=False, dtype=torch.bfloat16)

    base = Tiny()
    base.proj.weight.data = ckptkit.value("w", (32, 48), torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"])
    dtype = getattr(torch, adapter_dtype)
    lora_a, lora_b = ckptkit.value("A", (4, 48), dtype) * 0.1, ckptkit.value("B", (32, 4), dtype) * 0.1
    model = peft.get_peft_model(Tiny(), config)  # what from_pretrained builds: the adapter loaded into it
    model.base_model.model.proj.base_layer.weight.data = base.proj.weight.data.clone()
    layer = model.base_model.model.proj
    layer.lora_A["default"].weight.data = lora_a.to(layer.lora_A["default"].weight.dtype)
    layer.lora_B["default"].weight.data = lora_b.to(layer.lora_B["default"].weight.dtype)
    expected = model.merge_and_unload().proj.weight
    got = merged(base.proj.weight.data, lora_a, lora_b, scaling({"r": 4, "lora_alpha": 8}))
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.slow
def test_the_merge_reads_one_base_tensor_at_a_time():
    """Memory stays bounded: each base tensor is read, merged and handed on before the next is read."""
    pytest.importorskip("torch")
    import ckptkit
    from patcher.checkpoint.readers.base import Held, Reader
    from patcher.checkpoint.steps.merge import MergedLoRA

    weights = {f"layers.{i}.proj.weight": ckptkit.value(str(i), (8, 6)) for i in range(3)}

    class Base(Reader):
        kind, random_access = "base", True

        def __init__(self):
            super().__init__(__import__("pathlib").Path("."))
            self.tensors = {n: Held(n, tuple(t.shape), t.dtype) for n, t in weights.items()}

        def slice(self, name):
            events.append(f"read {name}")
            return weights[name]

    adapter = {f"base_model.model.layers.{i}.proj.lora_{w}.weight": ckptkit.value(w, s)
               for i in range(3) for w, s in (("A", (2, 6)), ("B", (8, 2)))}
    events = []
    MergedLoRA(Base(), adapter, {"peft_type": "LORA", "r": 2, "lora_alpha": 2}, "run").stream(
        lambda name, first, data: events.append(f"put {name}"))
    assert events == [f"{what} {n}" for n in weights for what in ("read", "put")]


@pytest.mark.parametrize("adapter, words", [
    ({"base_model.model.lm_head.lora_A.weight": 1, "base_model.model.lm_head.lora_B.weight": 1},
     "the base folder holds no lm_head.weight"),
    ({"base_model.model.embed.lora_embedding_A": 1}, "a layer kind dsfix does not merge"),
    ({"base_model.model.layers.0.proj.lora_A.weight": 1}, "lora_A or lora_B missing for layers.0.proj.weight"),
])
def test_what_the_merge_cannot_place_is_refused_in_one_line(adapter, words):
    from patcher.checkpoint.steps.merge import plan_merge

    with pytest.raises(DsfixError) as info:
        plan_merge(adapter, {"layers.0.proj.weight", "embed.weight"}, LORA)
    assert words in info.value.message and "\n" not in info.value.message
    json.dumps(info.value.message)
