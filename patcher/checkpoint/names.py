"""The file names the torch side reads and writes, and how it names a list in one line. No torch here.

Every module of :mod:`patcher.checkpoint` takes its names from here, so that a reader, the writer and the checks
agree on what a folder holds.
"""

from __future__ import annotations

from typing import Iterable

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
# what a converted folder takes from the model folder besides config.json (the weights come from the checkpoint)
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
          "chat_template.json")
STEP3_SUBFOLDERS = ("actor", "critic", "actor_ema")  # what DeepSpeed-Chat's step 3 saves under its output folder
STAGING_PREFIX = ".dsfix-convert-"  # a convert's temporary folder, beside or inside the folder it writes
SHOW = 3  # how many examples a failing detail names


def examples(items: Iterable, n: int = SHOW) -> str:
    """The first ``n`` items, comma-separated, and how many more."""
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(str(i) for i in items[:n]) + more


def shape_text(shape: Iterable) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"
