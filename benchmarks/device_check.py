#!/usr/bin/env python
"""The device check: dsfix proven on one GPU in one command, the first thing a session with a GPU runs.

    python benchmarks/device_check.py OUT_DIR --device cuda [--wheels DIR] [--upstream CHAT_DIR]
    python benchmarks/device_check.py OUT_DIR --device cpu      # the same stages, small sizes (CI runs it)

Stages, in order; a failed stage does not stop the ones after it:

  setup        installs what this Python lacks: from ``--wheels DIR`` (``benchmarks/device_wheels.sh DIR``
               fetched them beforehand, for a machine without network) or else from the package index, into a
               folder of its own under the work folder; names the versions
  smoke        ``dsfix smoke --device DEV`` on the bundled example checkout, patched: 311 tensors, verify, and
               the reload on DEV reproducing the in-memory logits (cuda: the full-size Qwen3-0.6B; cpu: the
               narrow Qwen3)
  step 1 Z0/Z3 a real step-1 run on DEV, narrow Qwen3, bf16, one rank, at ZeRO-0 and at ZeRO-3, twice at the same
               seed: through a patched checkout (dsfix's save) and an unpatched one (the checkout's own .bin);
               the tensors bit-equal between the two, the patched one's against the engine's own weights, and
               ``dsfix verify`` on the patched folder. The trainer is upstream DeepSpeed-Chat's step-1
               ``main.py`` with ``--upstream CHAT_DIR`` (its FusedAdam, a CUDA op a bare machine cannot build,
               replaced by torch's AdamW: ``device_step1.py``), else dsfix's own step-1-like trainer
               (fixtures/step1_trainer/train.py); the table names which ran
  engine       the DeepSpeed engine checkpoint the ZeRO-3 patched run saved on DEV, through ``dsfix convert``:
               bit-equal to the engine's own weights (convert itself verifies and loads what it wrote)
  bench        ``bench_save.py --device DEV`` (cuda: full-size Qwen3-0.6B, one round of the five methods its
               ratios need; cpu: ``--quick``), its ratios

The parts: device_base.py (paths, logs, what a run knows), device_setup.py (the setup stage), device_stages.py
(the stages after it), device_child.py (the child modes the stages run in their Python); this file is the
command.

OUT_DIR receives one log per stage (setup.log, smoke.log, step1.log, engine.log, bench.log) and the table,
summary.md and summary.json: seven files. Exit status: 0 every row passed, 1 a row failed, 2 bad input (say
``--device cuda`` where there is no CUDA: one line, no row reported as passed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as a script it is there already; a test loads this file by path
    sys.path.insert(0, HERE)

from device_base import DEADLINE, REPO_ROOT, UPSTREAM_COMMIT, BadInput, Check, Log  # noqa: E402
from device_child import child_compare, run_child  # noqa: E402
from device_setup import (  # noqa: E402
    MAIN_REQUIREMENTS,
    PACKAGE_DIRS,
    UPSTREAM_REQUIREMENTS,
    lay_out_dsfix,
    stage_setup,
    unpack_wheels,
)
from device_stages import stage_bench, stage_engine, stage_smoke, stage_step1  # noqa: E402

# what tests/test_device_check.py reaches through this file
__all__ = ["PACKAGE_DIRS", "Log", "child_compare", "lay_out_dsfix", "main", "unpack_wheels"]


# --------------------------------------------------------------------------- the table


def write_summary(check, total_s):
    facts = dict(check.facts)
    facts.pop("device_ok", None)
    facts.pop("device_problem", None)
    lines = ["# dsfix device check: --device %s" % check.args.device, ""]
    lines += ["- %s: %s" % (k, v) for k, v in facts.items() if v is not None]
    lines += ["- wall time: %.0f s" % total_s, "", "| stage | result | figures | seconds |", "|---|---|---|---|"]
    for r in check.rows:
        figures = r["figures"].replace("|", "\\|")
        lines.append("| %s | %s | %s | %.1f |" % (r["stage"], r["result"], figures, r["seconds"]))
    passed = all(r["result"] == "pass" for r in check.rows)
    lines += ["", "all rows pass" if passed else "FAILED: %s" % ", ".join(r["stage"] for r in check.rows
                                                                        if r["result"] != "pass")]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(check.out, "summary.md"), "w") as handle:
        handle.write(text)
    with open(os.path.join(check.out, "summary.json"), "w") as handle:
        json.dump({"device": check.args.device, "facts": facts, "rows": check.rows, "passed": passed,
                   "seconds": round(total_s, 1)}, handle, indent=2)
    return passed, text


# --------------------------------------------------------------------------- the command


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="the folder for the logs and the table (new or empty)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: full sizes; cpu: the same stages with small sizes (CI)")
    parser.add_argument("--wheels", default=None, help="install what is missing from this folder (device_wheels.sh "
                        "DIR wrote its main/ and upstream/ folders) instead of the package index")
    parser.add_argument("--upstream", default=None, help="a DeepSpeed-Chat folder (DeepSpeedExamples %s's "
                        "applications/DeepSpeed-Chat): step 1 runs its main.py instead of dsfix's trainer"
                        % UPSTREAM_COMMIT)
    parser.add_argument("--budget", type=float, default=None, help="seconds all stages may take together (default: "
                        "480 with cuda, for a GPU lent for minutes; none with cpu); a command still running then is "
                        "stopped and its row fails, and the stages after it are reported as not run")
    parser.add_argument("--work", default=None, help="scratch folder (default: a new temporary folder, removed)")
    parser.add_argument("--requirements", choices=("main", "upstream"), default=None,
                        help="print the pinned requirements of that wheel folder and exit (for device_wheels.sh)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def check_input(args):
    """Everything the command line can get wrong, before anything runs: BadInput (exit 2) with one line."""
    if not args.out_dir:
        raise BadInput("give the folder for the logs and the table: device_check.py OUT_DIR --device cuda|cpu")
    out = os.path.abspath(args.out_dir)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise BadInput("%s: must be a new or empty folder" % args.out_dir)
    if args.wheels is not None:
        if not os.path.isdir(args.wheels):
            raise BadInput("--wheels %s: not a folder" % args.wheels)
        if not os.path.isdir(os.path.join(args.wheels, "main")):
            raise BadInput("--wheels %s: has no main/ folder of wheels (benchmarks/device_wheels.sh DIR writes it)"
                           % args.wheels)
        if args.upstream and not os.path.isdir(os.path.join(args.wheels, "upstream")):
            raise BadInput("--wheels %s: has no upstream/ folder, which --upstream needs (device_wheels.sh DIR "
                           "--upstream)" % args.wheels)
    if args.upstream is not None:
        main = os.path.join(args.upstream, "training", "step1_supervised_finetuning", "main.py")
        if not os.path.isfile(main) or not os.path.isdir(os.path.join(args.upstream, "dschat")):
            raise BadInput("--upstream %s: not a DeepSpeed-Chat folder (no dschat/ and "
                           "training/step1_supervised_finetuning/main.py)" % args.upstream)
        args.upstream = os.path.abspath(args.upstream)
    if args.wheels:
        args.wheels = os.path.abspath(args.wheels)
    if args.budget is not None and args.budget <= 0:
        raise BadInput("--budget must be a number of seconds above 0")
    if args.device == "cuda":
        sys.path.insert(0, REPO_ROOT)
        from patcher.prereq import no_gpu_driver

        if no_gpu_driver():
            raise BadInput("--device cuda, but this machine has no GPU driver; use --device cpu")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return run_child(args.child)
    if args.requirements:
        print("\n".join(MAIN_REQUIREMENTS if args.requirements == "main" else UPSTREAM_REQUIREMENTS))
        return 0
    try:
        check_input(args)
    except BadInput as e:
        sys.stderr.write("device_check: error: %s\n" % e)
        return 2
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    started = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    own_work = args.work is None
    args.work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="dsfix-device-check-"))
    os.makedirs(args.work, exist_ok=True)
    check = Check(args)
    budget = args.budget if args.budget is not None else (480.0 if args.device == "cuda" else None)
    if budget is not None:
        DEADLINE[0] = time.monotonic() + budget  # device_base's: every command the stages run ends by then
    try:
        versions = stage_setup(check)
        if args.device == "cuda" and not versions.get("device_ok"):
            problem = versions.get("device_problem") or "the GPU could not be queried (setup.log)"
            with open(os.path.join(check.out, "summary.md"), "w") as handle:
                handle.write("# dsfix device check: not run\n\n%s\n" % problem)
            sys.stderr.write("device_check: error: %s\n" % problem)
            return 2
        result = None
        for name, stage in (("smoke", stage_smoke), ("step1", stage_step1), ("engine", stage_engine),
                            ("bench", stage_bench)):
            if time.monotonic() >= DEADLINE[0]:
                check.row(name, False, "not run: the budget of %.0f s was spent" % budget, time.time())
                continue
            print("[device_check] %s" % name, file=sys.stderr, flush=True)
            try:
                if stage is stage_engine:
                    stage(check, result)
                else:
                    got = stage(check)
                    result = got if stage is stage_step1 else result
            except Exception as e:  # a stage's own bug: its row fails, the next stage runs
                check.row(name, False, "crashed: %s: %s" % (type(e).__name__, e), time.time())
        passed, text = write_summary(check, time.time() - started)
        print(text)
        return 0 if passed else 1
    finally:
        if own_work:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
