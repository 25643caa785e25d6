"""What the table tests share: one fixer run on bytes, as plan.py runs it (patch, then the guard), and the
pieces of an upstream-shaped utils.py."""

from __future__ import annotations

from patcher.patch import signature
from patcher.patch.fixers import FIXERS, Context, Target
from patcher.patch.names import SAVE_NAMES

MOD = "dschat.utils.utils"
UPSTREAM = {n: signature.default_def(n) for n in SAVE_NAMES}  # upstream's save functions, as dsfix reads them
END = "-- added by dsfix; undo with `dsfix revert`"
ABOUT = "# The two saves below write safetensors through dsfix_safetensors.py, beside this file (read it first).\n"
UPSTREAM_SAVE = '''def save_hf_format(model, tokenizer, args, sub_folder=""):
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if "lora" not in k}
    torch.save(sd, os.path.join(output_dir, "pytorch_model.bin"))
    model.config.to_json_file(os.path.join(output_dir, "config.json"))
    tokenizer.save_vocabulary(output_dir)
'''
# What dsfix inserts after upstream's save_hf_format (strategy clone), after the marker line.
WRAPPERS = '''def save_hf_format_safetensors(
        model, tokenizer, args, sub_folder="", *, strategy="clone", max_shard_size=None):
    """save_hf_format, as safetensors: weights (tied ones too), config.json, tokenizer."""
    output_dir = os.path.join(args.output_dir, sub_folder)
    dsfix_safetensors.save_hf_format(
        model, tokenizer, output_dir, strategy=strategy, max_shard_size=max_shard_size)


def save_zero_three_model_safetensors(
        model_ema, global_rank, save_dir, zero_stage=0, *, strategy="clone", max_shard_size=None):
    """save_zero_three_model, as safetensors: every rank calls it under ZeRO-3."""
    dsfix_safetensors.save_zero_three_model(
        model_ema, save_dir, global_rank=global_rank, zero_stage=zero_stage, strategy=strategy,
        max_shard_size=max_shard_size)
'''


def target(kind: str, data: bytes | None, modules=(MOD,), rel: str | None = None) -> Target:
    rel = rel or {"script": "main.py", "utils": "utils.py", "module": "dsfix_safetensors.py",
                  "loader": "model_utils.py"}[kind]
    return Target(rel, kind, data, 1 if kind == "script" else None, tuple(modules) if kind == "script" else ())


def fix(kind: str, data: bytes | None, modules=(MOD,), defs=None, strategy: str = "clone"):
    """The fixer's Patched for ``data``, its guard run after (as plan.py does); ``defs``: the fork's save
    functions for a script (upstream's when not given)."""
    t = target(kind, data, modules)
    ctx = Context(strategy, tuple(modules), UPSTREAM if defs is None else defs)
    res = FIXERS[kind].patch(t, ctx)
    FIXERS[kind].guard(t, res.new, ctx)
    return res


def undo(kind: str, data: bytes, modules=(MOD,), force: bool = False) -> bytes | None:
    """The fixer's structural undo."""
    return FIXERS[kind].unpatch(data, target(kind, data, modules), force)[0]


def is_patched(kind: str, data: bytes, modules=(MOD,)) -> bool:
    return FIXERS[kind].is_patched(data, target(kind, data, modules))
