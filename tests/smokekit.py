"""Helpers shared by test_verify.py, test_smoke.py, test_cli_model.py and test_convert.py (imported by them).

``make_checkout`` writes a tiny DeepSpeed-Chat-shaped checkout: an upstream-like utils.py (written
here, not copied from upstream) followed by the code under test, plus a stub step-1 main.py.

``launch_ranks`` is the one way a test starts ranks (``deepspeed --num_gpus N SCRIPT``); it returns a
:class:`Launch`, whose ``report()`` is what a failing test shows: each rank's last lines.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import pytest

from patcher.checkpoint.smoke.ranks import deepspeed_launcher, free_port, rank_env, run_group

REPO = Path(__file__).resolve().parent.parent
NARROW = REPO / "fixtures" / "models" / "qwen3-narrow" / "config.json"
FULL = REPO / "fixtures" / "models" / "qwen3-0.6b" / "config.json"
BROKEN = REPO / "fixtures" / "broken"
TRAINER = REPO / "fixtures" / "step1_trainer" / "train.py"
LAUNCH_TIMEOUT_S = 240

# Looks like the top of DeepSpeed-Chat's utils.py: deepspeed and transformers at module level, a few
# helpers and the pickle saves that dsfix replaces.
UPSTREAM_LIKE = '''\
import os
import json
import random

import torch
import torch.nn as nn
import deepspeed
from deepspeed.accelerator import get_accelerator
from transformers import AutoTokenizer
{extra_imports}

def print_rank_0(msg, rank=None):
    if rank is None or rank <= 0:
        print(msg)


def set_random_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def save_hf_format(model, tokenizer, args, sub_folder=""):
    inner = model.module if hasattr(model, "module") else model
    out = os.path.join(args.output_dir, sub_folder)
    os.makedirs(out, exist_ok=True)
    weights = {{k: v for k, v in inner.state_dict().items() if "lora" not in k}}
    torch.save(weights, os.path.join(out, "pytorch_model.bin"))
    inner.config.to_json_file(os.path.join(out, "config.json"))
    tokenizer.save_vocabulary(out)


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    inner = model_ema.module if hasattr(model_ema, "module") else model_ema
    os.makedirs(save_dir, exist_ok=True)
    weights = {{}}
    for name, param in inner.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=zero_stage == 3):
            if global_rank == 0 and "lora" not in name:
                weights[name] = param.detach().cpu().clone()
    if global_rank == 0:
        torch.save(weights, os.path.join(save_dir, "pytorch_model.bin"))

'''

SAVES = ("\n\ndef save(model, tokenizer, args):\n    save_hf_format(model, tokenizer, args)\n"
         "    save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)\n")
MAIN_PY = {  # step 1's saves, as upstream's main.py calls them
    "package": "# stub of step-1 main.py for dsfix tests\nfrom dschat.utils.utils import save_hf_format, "
               "save_zero_three_model\n" + SAVES,
    "legacy": (
        "# stub of step-1 main.py for dsfix tests\nimport os\nimport sys\n\n"
        "sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))\n"
        "from utils.utils import save_hf_format, save_zero_three_model\n" + SAVES
    ),
}


def utils_source(body: str = "", extra_imports: str = "") -> str:
    return UPSTREAM_LIKE.format(extra_imports=extra_imports) + "\n" + body


def broken_code(name: str) -> str:
    return (BROKEN / name).read_text(encoding="utf-8")


def make_checkout(root: Path, body: str = "", layout: str = "package", extra_imports: str = "") -> Path:
    """A DeepSpeed-Chat-like folder at ``root`` whose utils.py ends with ``body``."""
    utils = root / ("dschat/utils/utils.py" if layout == "package" else "training/utils/utils.py")
    utils.parent.mkdir(parents=True, exist_ok=True)
    if layout == "package":
        (root / "dschat/__init__.py").write_text("")
        (root / "dschat/utils/__init__.py").write_text("")
    utils.write_text(utils_source(body, extra_imports), encoding="utf-8")
    main = root / "training/step1_supervised_finetuning/main.py"
    main.parent.mkdir(parents=True, exist_ok=True)
    main.write_text(MAIN_PY[layout], encoding="utf-8")
    return root


def patched_checkout(root: Path, layout: str = "package", extra_imports: str = "") -> Path:
    """make_checkout's upstream-like checkout, patched by `dsfix apply` (the save module beside utils.py)."""
    from patcher.patch import flow

    make_checkout(root, layout=layout, extra_imports=extra_imports)
    assert flow.apply(root).exit_code == 0
    return root


def quiet_console():
    """A rich Console writing to a buffer (``console.file.getvalue()``), as the CLI's stderr console would."""
    from rich.console import Console

    return Console(file=io.StringIO(), stderr=True, width=160, color_system=None)


def same_attention(model) -> dict:
    """from_pretrained keywords that reload a folder with the attention ``model`` runs. transformers 4.51
    writes ``_attn_implementation_autoset`` into config.json, after which a plain reload runs eager attention
    where a model built in memory ran sdpa: logits then differ in the last bits (fp32) or more (bf16)."""
    attn = getattr(model.config, "_attn_implementation", None)
    return {"attn_implementation": attn} if attn else {}


def narrow_model(dtype="float32", seed=0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from patcher.checkpoint.check.load import dtype_kwarg

    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(str(NARROW))
    return AutoModelForCausalLM.from_config(cfg, **{dtype_kwarg(): getattr(torch, dtype)})


# --------------------------------------------------------------------------- the step-1-like trainer, launched


def _rank_end():
    path = REPO / "fixtures" / "step1_trainer" / "rank_end.py"
    spec = importlib.util.spec_from_file_location("dsfix_fixture_rank_end", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rank_end = _rank_end()  # fixtures/step1_trainer/rank_end.py: how a rank ends, and reading each rank's log


class LateExit(UserWarning):
    """Every rank of a launch finished its work and tore down, then a process ended non-zero (an abort in its
    interpreter's exit: a dependency's fault, not the test's)."""


@dataclasses.dataclass
class Launch:
    """One launch of ranks: the launcher's exit code (None: killed past LAUNCH_TIMEOUT_S), the launcher's own
    output, and each rank's log ({rank: text}, the launcher's --enable_each_rank_log)."""

    code: Optional[int]
    launcher: str = dataclasses.field(repr=False)
    logs: dict = dataclasses.field(repr=False)
    nprocs: int = 2

    @property
    def output(self) -> str:
        """The launcher's output, then each rank's log in rank order: what tests search for lines."""
        return self.launcher + "".join("\n" + self.logs[r] for r in sorted(self.logs))

    @property
    def finished(self) -> list:
        """The ranks that printed their last line (rank_end.end_rank: all their work done, torn down)."""
        return rank_end.finished(self.logs)

    @property
    def ok(self) -> bool:
        """Every rank did all its work and tore down: each printed its last line, and the launcher exited (0, or
        see late_exit)."""
        return self.code is not None and len(self.finished) == self.nprocs

    @property
    def late_exit(self) -> bool:
        """Every rank printed its last line, then the launcher exited non-zero: a process died in its interpreter's
        exit, after all the work a test judges (a dependency's fault; launch_ranks warns with LateExit)."""
        return self.ok and self.code != 0

    def report(self, lines: int = 40) -> str:
        """Each rank's last lines (and the launcher's): what a failing launch shows."""
        return rank_end.tails(self.code, self.launcher, self.logs, self.nprocs, lines)


def launch_ranks(script, args, nprocs: int = 2, env: dict | None = None,
                 timeout: int = LAUNCH_TIMEOUT_S) -> Launch:
    """deepspeed --num_gpus N SCRIPT ARGS on CPU ranks (``env``: variables to add), each rank's output in a log of
    its own. Skips without the launcher; fails, having killed the group and shown each rank's last lines, when it
    runs past ``timeout`` seconds. With DSFIX_RANK_LOGS=DIR set, each launch's logs are also kept in a new folder
    under DIR."""
    launcher = deepspeed_launcher()
    if launcher is None:
        pytest.skip("the deepspeed launcher is not installed")
    logs = Path(tempfile.mkdtemp(prefix="dsfix-rank-logs-"))
    try:
        cmd = [launcher, "--num_gpus", str(nprocs), "--master_port", str(free_port()), "--enable_each_rank_log",
               str(logs), str(script)] + [str(a) for a in args]
        ranks = rank_env(nproc=nprocs)
        ranks.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        code, output = run_group(cmd, ranks, timeout, cwd=str(REPO))
        launch = Launch(code, output, rank_end.rank_logs(logs), nprocs)
        keep = os.environ.get("DSFIX_RANK_LOGS")
        if keep:
            os.makedirs(keep, exist_ok=True)
            kept = Path(tempfile.mkdtemp(prefix=Path(script).stem + "-", dir=keep))
            (kept / "launcher.log").write_text("%s\nexit %s\n%s" % (" ".join(cmd), code, output), encoding="utf-8")
            for rank, text in launch.logs.items():
                (kept / ("rank%d.log" % rank)).write_text(text, encoding="utf-8")
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    if code is None:
        pytest.fail("deadlock? the launcher ran past %ds:\n%s" % (timeout, launch.report()))
    if launch.late_exit:
        late = LateExit("every rank finished, then the launcher exited %s:\n%s" % (code, launch.report(8)))
        warnings.warn(late, stacklevel=2)
    return launch


def run_trainer(tmp_path, nprocs, zero_stage, *extra, utils) -> Launch:
    """deepspeed --num_gpus N train.py ... with the ``utils.py`` it saves through."""
    return launch_ranks(TRAINER, ["--utils", utils, "--output_dir", tmp_path / "out", "--reference_dir",
                                  tmp_path / "ref", "--zero_stage", zero_stage, *extra], nprocs)
