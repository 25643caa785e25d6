"""dsfix's torch side: smoke, verify, convert (output folders and engine checkpoints) and the rank launcher.

Its modules import torch, transformers, safetensors and DeepSpeed inside the functions that need them;
``quiet.quiet()`` imports torch first, with the noise of torch before 2.3 beside numpy 2 captured.
"""

import os

# dsfix starts subprocesses (ranks, git) after a tokenizer has run: without this, tokenizers prints a
# four-line warning on each fork
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
