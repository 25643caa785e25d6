"""Table tests of patcher.patch.safe: which fork saves already keep tied weights in safetensors (dsfix then
has nothing to change), one row a function or a module: source in, what dsfix says (or None) out."""

from __future__ import annotations

import ast

import pytest

from patcher.patch.names import SAVE_NAMES
from patcher.patch.safe import already_safe, safe_save

GATHERED = "    sd = {k: v for k, v in model.state_dict().items() if 'lora' not in k}\n"

FUNCTIONS = [
    # (name, the function's body, what safe_save says: the call, or None)
    ("save_pretrained with the state dict", GATHERED + "    model.save_pretrained(out, state_dict=sd)\n",
     "model.save_pretrained(..., state_dict=...)"),
    ("save_pretrained with safe_serialization=True", "    model.save_pretrained(out, safe_serialization=True)\n",
     "model.save_pretrained(..., safe_serialization=True)"),
    ("both", "    m.save_pretrained(out, state_dict=sd, safe_serialization=True)\n",
     "m.save_pretrained(..., safe_serialization=True)"),
    ("the tokenizer and config saved beside it",
     "    model.save_pretrained(out, state_dict=sd)\n    tokenizer.save_pretrained(out)\n"
     "    model.config.to_json_file(cfg)\n", "model.save_pretrained(..., state_dict=...)"),
    ("only on rank 0, after a gather", "    if rank == 0:\n        model.save_pretrained(out, state_dict=sd)\n",
     "model.save_pretrained(..., state_dict=...)"),
    ("safe_serialization=False", "    model.save_pretrained(out, state_dict=sd, safe_serialization=False)\n", None),
    ("safe_serialization from a variable", "    model.save_pretrained(out, state_dict=sd, safe_serialization=s)\n",
     None),
    ("save_pretrained of the model alone (ZeRO-3 would save its partitions)", "    model.save_pretrained(out)\n",
     None),
    ("torch.save", GATHERED + "    torch.save(sd, path)\n", None),
    ("torch.save in one branch, save_pretrained in the other",
     "    if z3:\n        torch.save(sd, path)\n    else:\n        model.save_pretrained(out, state_dict=sd)\n", None),
    ("safetensors' save_file (shared tensors fail)", "    save_file(sd, path)\n", None),
    ("an engine checkpoint", "    model.save_checkpoint(out)\n", None),
    ("a function save_pretrained, not a model's", "    save_pretrained(out, state_dict=sd)\n", None),
    ("no weights at all", "    tokenizer.save_pretrained(out)\n", None),
    ("torch.save of the options only, then save_pretrained",
     "    torch.save(args, path)\n    model.save_pretrained(out, state_dict=sd)\n",
     "model.save_pretrained(..., state_dict=...)"),
]


@pytest.mark.parametrize("body, expected", [r[1:] for r in FUNCTIONS], ids=[r[0] for r in FUNCTIONS])
def test_safe_save(body, expected):
    fn = ast.parse(f"def save_hf_format(model, tokenizer, args):\n{body}").body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert safe_save(fn) == expected


SAFE_HF = "def save_hf_format(model, tokenizer, args):\n    model.save_pretrained(args.output_dir, state_dict=sd)\n"
SAFE_Z3 = "def save_zero_three_model(model, rank, out):\n    model.save_pretrained(out, safe_serialization=True)\n"
BIN_Z3 = "def save_zero_three_model(model, rank, out):\n    torch.save(sd, out)\n"

MODULES = [
    # (name, utils.py, the start of what dsfix says, or None)
    ("both safe", SAFE_HF + SAFE_Z3,
     "save_hf_format and save_zero_three_model already write safetensors: model.save_pretrained(..., "
     "state_dict=...); model.save_pretrained(..., safe_serialization=True), which writes model.safetensors"),
    ("save_hf_format alone, safe", SAFE_HF, "save_hf_format already writes safetensors: "),
    ("one of them still torch.save", SAFE_HF + BIN_Z3, None),
    ("no save_hf_format", SAFE_Z3, None),
    ("nested, not top level", "def outer():\n" + "".join("    " + ln + "\n" for ln in SAFE_HF.splitlines()), None),
]


@pytest.mark.parametrize("text, expected", [r[1:] for r in MODULES], ids=[r[0] for r in MODULES])
def test_already_safe(text, expected):
    said = already_safe(ast.parse(text), SAVE_NAMES)
    if expected is None:
        assert said is None
    else:
        assert said is not None and said.startswith(expected), said
        assert said.endswith("handles tied weights itself, so there is nothing for dsfix to change")
