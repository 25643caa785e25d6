"""What the table tests share: a small stand-in for the template, short enough to write out in a test."""

from __future__ import annotations

from patcher.patch import template

# A small stand-in for templates/save_safetensors.py: the same shape (imports, a comment, the version and
# strategy constants, the two public functions, dsfix's own functions), short enough to write out below.
TEMPLATE = '''"""dsfix's save (a stand-in for the tests)."""
import os

import torch
from safetensors import safe_open

# Added by dsfix.
_DSFIX_TEMPLATE_VERSION = 7
_DSFIX_STRATEGY = "clone"


def save_hf_format_safetensors(model, tokenizer, args, sub_folder="", *, max_shard_size=None, strategy=None):
    """Like save_hf_format."""
    output_dir = os.path.join(args.output_dir, sub_folder)
    _dsfix_save_hf_format(model, tokenizer, output_dir, max_shard_size=max_shard_size, strategy=strategy)


def save_zero_three_model_safetensors(model_ema, global_rank, save_dir, zero_stage=0, *, max_shard_size=None, strategy=None):
    """Like save_zero_three_model."""
    _dsfix_save_zero_three_model(model_ema, save_dir, global_rank=global_rank, zero_stage=zero_stage, max_shard_size=max_shard_size, strategy=strategy)


def _dsfix_save(model, output_dir):
    torch.save(model, output_dir)
'''
BLOCK = TEMPLATE[TEMPLATE.index("# Added by dsfix."):]
END = "-- inserted by dsfix; undo with `dsfix revert`"
UPSTREAM_SAVE = '''def save_hf_format(model, tokenizer, args, sub_folder=""):
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if "lora" not in k}
    torch.save(sd, os.path.join(output_dir, "pytorch_model.bin"))
    model.config.to_json_file(os.path.join(output_dir, "config.json"))
    tokenizer.save_vocabulary(output_dir)
'''


def stand_in(strategy: str = "clone") -> template.Template:
    """The stand-in, parsed as dsfix parses the real template."""
    return template.parse_template(TEMPLATE, strategy)
