"""Third-party output off while smoke, verify and convert run: their own report is the output.

transformers 5 draws a ``Loading weights: 100%|...`` bar on every ``from_pretrained`` (and 4.x one for
sharded folders), huggingface_hub has bars of its own, torch warns (``UserWarning``) on some loads that
dsfix then refuses in one line of its own. Inside :func:`quiet` the bars are off, transformers logs
errors only, and Python warnings are not shown; everything is restored on the way out.

torch before 2.3 was built against numpy 1: beside numpy 2 (what pip picks on Python 3.9) its import prints
numpy's "A module that was compiled using NumPy 1.x cannot be run in NumPy 2" banner with a traceback and
warns "Failed to initialize NumPy". Nothing here uses numpy, so :func:`quiet` imports torch first with that
noise captured; an import that fails is left for the caller's own import to report.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys
import warnings


@contextlib.contextmanager
def quiet():
    import_torch_quietly()
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        if importlib.util.find_spec("transformers") is not None:
            stack.enter_context(_transformers_quiet())
        if importlib.util.find_spec("huggingface_hub") is not None:
            stack.enter_context(_hub_quiet())
        yield


def import_torch_quietly() -> None:
    if "torch" in sys.modules or importlib.util.find_spec("torch") is None:
        return
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        try:
            importlib.import_module("torch")
        except Exception:
            pass


@contextlib.contextmanager
def _transformers_quiet():
    import logging

    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _hub_quiet():
    from huggingface_hub import utils as hub_utils

    was_off = hub_utils.are_progress_bars_disabled()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            hub_utils.enable_progress_bars()
