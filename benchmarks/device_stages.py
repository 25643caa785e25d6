"""The device check's stages after setup (``device_check.py`` runs them in order): smoke, step 1 at ZeRO-0 and
ZeRO-3 (patched and unpatched), the engine checkpoint through ``dsfix convert``, and bench_save. Each appends
its row to the run's :class:`device_base.Check`; a failed stage does not stop the ones after it."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

from device_base import EXAMPLE_CHECKOUT, HERE, NARROW_CONFIG, SEED, STAGE_TIMEOUT_S, TRAINER, UPSTREAM_WRAPPER, Log

BENCH_GPU_METHODS = "dsfix_clone,dsfix_dedupe,transformers,article,raw"


def stage_smoke(check):
    started = time.time()
    log = Log(os.path.join(check.out, "smoke.log"))
    checkout = os.path.join(check.work, "smoke", "DeepSpeed-Chat")
    shutil.copytree(EXAMPLE_CHECKOUT, checkout)
    code, result = check.dsfix(log, "apply", checkout)
    if code != 0:
        return check.row("smoke", False, "dsfix apply failed on the example checkout (exit %s)" % code, started)
    sizes = ["--config", NARROW_CONFIG, "--expect", "311"] if check.cpu else []  # cuda: the bundled Qwen3-0.6B
    code, result = check.dsfix(log, "smoke", checkout, "--device", check.args.device, *sizes,
                               timeout=STAGE_TIMEOUT_S["smoke"])
    checks = {c["name"]: c for c in result.get("checks", [])}
    logits = checks.get("logits", {})
    ok = (code == 0 and result.get("ok") is True and result.get("tensors") == 311
          and result.get("device") == check.args.device and logits.get("ok") is True
          and all(c["ok"] for c in checks.values()))
    failed = [n for n, c in checks.items() if not c["ok"]]
    figures = "%s tensors on %s, %d checks%s; %s" % (
        result.get("tensors"), result.get("device"), len(checks),
        " (failed: %s)" % ", ".join(failed) if failed else " passed", logits.get("detail", "no logits check"))
    if code != 0 and not result:
        figures = "dsfix smoke exit %s, no result (smoke.log)" % code
    check.row("smoke (%s)" % ("narrow Qwen3" if check.cpu else "Qwen3-0.6B"), ok, figures, started)


def _write_upstream_data(chat):
    """DeepSpeed-Chat's local/jsonfile data set: data/train.json and data/eval.json, JSON lines."""
    questions = ["what is tea", "how do you make coffee", "why is the sky blue", "is water hot", "please explain light"]
    os.makedirs(os.path.join(chat, "data"), exist_ok=True)
    for name, n in (("train", 32), ("eval", 8)):
        with open(os.path.join(chat, "data", name + ".json"), "w") as handle:
            for i in range(n):
                handle.write(json.dumps({"prompt": " Human: %s Assistant:" % questions[i % 5],
                                         "chosen": " yes the answer is maybe", "rejected": " no"}) + "\n")


def _launch(check, log, script, script_args, env, cwd):
    """One rank: on a GPU through DeepSpeed's launcher (python -m deepspeed.launcher.runner --num_gpus 1), on the
    CPU started directly with the variables that launcher sets for its one rank (the launcher's own two Python
    processes would double this stage's time on a small CPU). (exit code, output)."""
    from patcher.checkpoint.smoke.ranks import free_port

    port = str(free_port())
    if check.cpu:
        env = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        cmd = [sys.executable, "-u", script, "--local_rank=0", *script_args]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", port, script,
               *script_args]
    return log.run(cmd, env, STAGE_TIMEOUT_S["step1"], cwd=cwd)


def rank_finished(output, rank=0):
    """Whether a rank's output holds its last line (fixtures/step1_trainer/rank_end.py): all its work done and its
    process group torn down, so that a non-zero exit after it is its interpreter's exit, not the run."""
    if HERE not in sys.path:  # benchmarks/: run as a script it is there already; a test loads this file by path
        sys.path.insert(0, HERE)
    import common

    rank_end = common.load_file_module("fixtures", "step1_trainer", "rank_end.py")
    return rank_end.END_LINE.format(rank=rank) in output.splitlines()


def stage_step1(check):
    """Both ZeRO stages, patched and unpatched; returns the ZeRO-3 patched run's folders for the engine stage."""
    log = Log(os.path.join(check.out, "step1.log"))
    base = os.path.join(check.work, "step1")
    upstream = check.args.upstream if check.upstream_ok else None
    checkouts = _step1_checkouts(check, base, upstream)
    code, _ = check.dsfix(log, "apply", checkouts["patched"], upstream=bool(upstream))
    model_dir = os.path.join(base, "model")
    mcode = 0
    if upstream:  # a local model folder upstream's from_pretrained reads, written by the transformers it runs
        mcode, _ = check.child(log, "model", model_dir, upstream=True)
    ckpt = None
    for stage in (0, 3):
        started = time.time()
        name = "step 1 ZeRO-%d" % stage
        if code != 0:
            check.row(name, False, "dsfix apply failed on the checkout (exit %s; step1.log)" % code, started)
            continue
        if upstream and mcode != 0:
            check.row(name, False, "the narrow model folder could not be written (step1.log)", started)
            continue
        runs, late = {}, []
        for variant in ("unpatched", "patched"):
            runs[variant] = _step1_run(check, log, base, stage, variant, checkouts[variant], upstream, model_dir)
            if runs[variant][0] not in (0, None) and rank_finished(runs[variant][3]):
                # its work and teardown done: judged by what it wrote
                late.append("%s run exit %s after the rank finished (step1.log)" % (variant, runs[variant][0]))
                runs[variant] = (0,) + runs[variant][1:]
        ok, figures = _step1_judge(check, log, runs, late)
        if stage == 3 and runs["patched"][0] == 0:
            ckpt = (os.path.join(base, "ckpt-z3"), runs["patched"][1], runs["patched"][2])
        check.row(name, ok, figures, started)
    return ckpt


def _step1_checkouts(check, base, upstream):
    """{"unpatched", "patched": a copy of the checkout step 1 runs}: upstream's DeepSpeed-Chat with its data set
    written, else the bundled example checkout; the facts name the trainer."""
    trainer = ("upstream DeepSpeed-Chat step-1 main.py (FusedAdam -> torch AdamW)" if upstream
               else "dsfix's step-1-like trainer (fixtures/step1_trainer)")
    if check.args.upstream and not upstream:
        trainer += ", upstream's asked for but its packages are not importable (setup.log)"
    check.facts["step-1 trainer"] = trainer
    checkouts = {}
    top = os.path.abspath(upstream) if upstream else None  # upstream's top folder, one for both copies
    for variant in ("unpatched", "patched"):
        folder = os.path.join(base, variant, "DeepSpeed-Chat")
        if upstream:  # not its .git, nor outputs and data of earlier runs at the top
            shutil.copytree(upstream, folder, ignore=lambda here, names: [n for n in names if n == ".git" or (
                os.path.abspath(here) == top and (n == "data" or n.startswith("output")))])
            _write_upstream_data(folder)
        else:
            shutil.copytree(EXAMPLE_CHECKOUT, folder)
        checkouts[variant] = folder
    return checkouts


def _step1_run(check, log, base, stage, variant, chat, upstream, model_dir):
    """One step-1 run of the checkout ``chat`` at ZeRO ``stage``: (exit code, its output folder, its reference
    folder, its output). The ZeRO-3 patched run also saves the engine's checkpoint, for the engine stage."""
    out = os.path.join(base, "out-z%d-%s" % (stage, variant))
    ref = os.path.join(base, "ref-z%d-%s" % (stage, variant))
    engine_ckpt = os.path.join(base, "ckpt-z3") if (stage == 3 and variant == "patched") else None
    env = check.env(upstream=bool(upstream), ranks=1)
    if upstream:
        env["PYTHONPATH"] = chat + os.pathsep + env["PYTHONPATH"]
        env["DSFIX_STEP1_REFERENCE"] = ref
        if engine_ckpt:
            env["DSFIX_STEP1_ENGINE_CKPT"] = engine_ckpt
        script = os.path.join(chat, "training", "step1_supervised_finetuning", "main.py")
        rc, output = _launch(check, log, UPSTREAM_WRAPPER, [
            "--script", script, "--data_path", "local/jsonfile", "--data_split", "10,0,0",
            "--data_output_path", out + ".cache", "--model_name_or_path", model_dir,
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_seq_len", "64",
            "--num_train_epochs", "1", "--learning_rate", "1e-4", "--zero_stage", str(stage),
            "--dtype", "bf16", "--seed", str(SEED), "--output_dir", out], env, os.path.dirname(script))
    else:
        utils = os.path.join(chat, "dschat", "utils", "utils.py")
        extra = ["--engine_ckpt", engine_ckpt] if engine_ckpt else []
        rc, output = _launch(check, log, TRAINER, [
            "--utils", utils, "--output_dir", out, "--reference_dir", ref, "--zero_stage", str(stage),
            "--dtype", "bf16", "--steps", "1" if check.cpu else "2", "--seed", str(SEED), "--deterministic",
            "--save", "dsfix" if variant == "patched" else "original", *extra], env, check.work)
    return rc, out, ref, output


def _step1_judge(check, log, runs, late):
    """(ok, figures) of one ZeRO stage's two runs: what the patched run saved, bit for bit against the unpatched
    run's .bin (when there is one) and against its engine's own weights, and ``dsfix verify`` on it."""
    problems = ["%s run exit %s (step1.log)" % (v, run[0]) for v, run in runs.items() if run[0] != 0]
    figures = list(late)
    prc, out, ref = runs["patched"][:3]
    if prc != 0:
        return False, "; ".join(problems + figures)
    pairs = [(out, os.path.join(ref, "reference.pt"))]
    if runs["unpatched"][0] == 0:
        pairs.insert(0, (out, os.path.join(runs["unpatched"][1], "pytorch_model.bin")))
    _, results = check.compare(log, *pairs)
    own, same = results[-1], (results[0] if len(results) == 2 else None)
    vcode, verified = check.dsfix(log, "verify", out)
    if same is not None:
        figures.append("%s/%s bit-equal patched vs unpatched" % (same.get("equal"), same.get("total")))
    figures.append("%s/%s bit-equal with the engine's weights" % (own.get("equal"), own.get("total")))
    figures.append("verify: %s" % (verified.get("message") or "exit %s" % vcode))
    for what, result in (("patched vs unpatched", same or {}), ("against the engine", own)):
        if result.get("first"):
            figures.append("first difference %s: %s" % (what, result["first"]))
    ok = not problems and (same or {}).get("ok") is True and own.get("ok") is True and vcode == 0
    return ok, "; ".join(problems + figures)


def stage_engine(check, ckpt):
    started = time.time()
    log = Log(os.path.join(check.out, "engine.log"))
    if ckpt is None or not os.path.isdir(ckpt[0]):
        return check.row("engine checkpoint", False, "no engine checkpoint: the ZeRO-3 patched run failed", started)
    folder, saved, ref = ckpt
    converted = os.path.join(check.work, "engine", "converted")
    os.makedirs(os.path.dirname(converted), exist_ok=True)
    code, result = check.dsfix(log, "convert", folder, "--config", saved, "--output", converted, "--dtype", "bf16",
                               timeout=STAGE_TIMEOUT_S["engine"])
    if code != 0:
        return check.row("engine checkpoint", False, "dsfix convert exit %s: %s" % (code, result.get("message")),
                         started)
    _, (own,) = check.compare(log, (converted, os.path.join(ref, "reference.pt")))
    figures = "convert: %s; %s/%s bit-equal with the engine's weights" % (result.get("message"), own.get("equal"),
                                                                         own.get("total"))
    if own.get("first"):
        figures += "; first difference: %s" % own["first"]
    check.row("engine checkpoint (ZeRO-3)", own.get("ok") is True, figures, started)


def stage_bench(check):
    started = time.time()
    log = Log(os.path.join(check.out, "bench.log"))
    results = os.path.join(check.work, "bench.json")
    # cuda: one round of the methods its ratios need (each method a process that builds Qwen3-0.6B on the GPU)
    sizes = ["--quick"] if check.cpu else ["--rounds", "1", "--methods", BENCH_GPU_METHODS]
    code, out = log.run([sys.executable, os.path.join(HERE, "bench_save.py"), "--device", check.args.device, *sizes,
                         "--json", results, "--tmpdir", check.work], check.env(), STAGE_TIMEOUT_S["bench"],
                        cwd=check.work)
    ratios = [line[2:].split(" (goal")[0] for line in out.splitlines() if line.startswith("- ") and " = " in line]
    check.row("bench_save (%s)" % ("--quick" if check.cpu else "Qwen3-0.6B, 1 round, 5 methods"),
              code == 0 and bool(ratios),
              "; ".join(ratios) if ratios else "bench_save exit %s, no ratios (bench.log)" % code, started)
