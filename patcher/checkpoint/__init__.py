"""dsfix's torch side: smoke, verify, convert (output folders and engine checkpoints) and the rank launcher.

torch before 2.3 was built against numpy 1: beside numpy 2 (what pip picks on Python 3.9) its import prints
numpy's "A module that was compiled using NumPy 1.x cannot be run in NumPy 2" banner with a traceback and
warns "Failed to initialize NumPy". Nothing here uses numpy, so torch is imported once, here, with that
noise captured; an import that fails is left for the caller's own import to report.
"""

import contextlib
import importlib
import io
import os
import sys
import warnings

# dsfix starts subprocesses (ranks, git) after a tokenizer has run: without this, tokenizers prints a
# four-line warning on each fork
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _import_torch_quietly() -> None:
    if "torch" in sys.modules:
        return
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        try:
            importlib.import_module("torch")
        except Exception:
            pass


_import_torch_quietly()
