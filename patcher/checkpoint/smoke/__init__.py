"""``dsfix smoke``: a checkout's own save functions run on a real Qwen3, then the folder verified and reloaded.

:mod:`.run` builds the spec and starts the ranks (:mod:`.ranks`: DeepSpeed's launcher on CPU ranks over gloo, or
CUDA); each rank runs :mod:`.worker` (the checkout's save functions, extracted without running its module);
:mod:`.report` holds the result and how it is shown.
"""

from patcher.checkpoint.smoke.report import SmokeReport, print_report
from patcher.checkpoint.smoke.run import resolve_device, run_smoke

__all__ = ["SmokeReport", "print_report", "resolve_device", "run_smoke"]
