"""dsfix: let DeepSpeed-Chat's step 3 read a step-2 output saved as safetensors.

dsfix inserts this code into ``model_utils.py`` (the file that defines ``create_critic_model``) and
renames two calls there: ``os.path.exists(model_ckpt_path)`` and ``torch.load(model_ckpt_path, ...)``,
where ``model_ckpt_path`` is the step-2 folder's ``pytorch_model.bin``.
"""
import json
import os

import torch
from safetensors.torch import load_file

_DSFIX_TEMPLATE_VERSION = 1


# Step 3 reads the step-2 critic from model.safetensors (or its shards) when the folder has them,
# else from pytorch_model.bin with torch.load(weights_only=True), which runs no code from the file.
def _dsfix_checkpoint_exists(path):
    """Whether the folder of ``path`` (a pytorch_model.bin path) holds weights in any form dsfix reads."""
    folder = os.path.dirname(path) or "."
    names = ("model.safetensors", "model.safetensors.index.json")
    return os.path.exists(path) or any(os.path.exists(os.path.join(folder, n)) for n in names)


def _dsfix_load_checkpoint(path, map_location="cpu", **kwargs):
    """The state dict saved beside ``path``: safetensors first, then the .bin itself, without pickled code."""
    folder = os.path.dirname(path) or "."
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
    if os.path.exists(single):
        return load_file(single, device=device)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(os.path.join(folder, shard), device=device))
        return state
    kwargs["weights_only"] = True
    return torch.load(path, map_location=map_location, **kwargs)
