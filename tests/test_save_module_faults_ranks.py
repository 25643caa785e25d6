"""The save module's fault sweep under ZeRO-3 on 2 CPU ranks (gloo): tests/faults_ranks.py, one launch of the
deepspeed launcher. Every call rank 0 makes in the output folder fails once with each errno of its kind
while both ranks save; then, inside one gather of the whole model, rank 0 forks a save per call that is
killed right before it (savesweep.Sweep checks every outcome). The extended tier: one launch takes about
as long as the main suite's budget for the whole sweep."""
import json
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]

pytest.importorskip("deepspeed")

from smokekit import REPO, launch_ranks  # noqa: E402
from test_save_module_faults import documented_calls  # noqa: E402

DRIVER = REPO / "tests" / "faults_ranks.py"


def test_zero3_every_rank0_call_failed_with_each_errno_and_killed(tmp_path):
    run = launch_ranks(DRIVER, ["--work", tmp_path])
    found = re.search(r"^\[faults\] (\{.*\})$", run.output, re.M)
    assert run.ok and found, run.report()
    summary = json.loads(found.group(1))
    rank1 = json.loads(re.search(r"^\[faults\] rank 1 (\{.*\})$", run.output, re.M).group(1))
    assert rank1["rank1_calls"] == 0, "rank 1 never touches the folder"
    assert summary["kills"] == summary["calls"] and summary["cases"] > 2 * summary["calls"]
    rows, version = documented_calls()
    import transformers

    if transformers.__version__.startswith(version):
        assert summary["calls"] == rows["`save_zero_three_model`, ZeRO-3"]
    assert summary["problems"] == [], "\n".join(summary["problems"][:20])
