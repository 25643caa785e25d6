#!/usr/bin/env python
"""Benchmark ``dsfix convert`` of a DeepSpeed engine checkpoint against DeepSpeed's own ``zero_to_fp32``.

Setup (not timed): 2 CPU ranks (gloo) build Qwen3-0.6B from the bundled config (random bf16 weights, tied
embeddings), wrap it in a ZeRO-3 engine and call ``engine.save_checkpoint`` (``--steps`` training steps
first, 0 by default: both tools read only the fp32 master weights, which the engine holds from the start).
``--producer trainer`` makes the checkpoint the way most users get one instead: the Hugging Face ``Trainer``
with DeepSpeed ZeRO-3 in bf16 on the same 2 CPU ranks (fixtures/step1_trainer/hf_ckpt.py, ``--steps`` steps,
1 at least, saved at the end), and converts its ``checkpoint-N/`` as a Trainer user does, with no ``--config``
(the config is the checkpoint's own). ``--checkpoint DIR [--model DIR]`` skips the setup and uses a
checkpoint (and model folder, for ``--config``) that exist.

Methods, each in its own process, every written file fsynced:

  zero_to_fp32 .bin fp32          DeepSpeed's converter as the checkpoint's script runs it
                                  (``convert_zero_checkpoint_to_fp32_state_dict``): pytorch_model.bin, fp32
  zero_to_fp32 safetensors fp32   the same with ``--safe_serialization`` (fails on a tied model: "Some
                                  tensors share memory"; timed until it fails)
  zero_to_fp32 .bin bf16          ``convert_zero_checkpoint_to_state_dict(dtype=bfloat16)``
  dsfix convert fp32              ``dsfix convert CKPT --config MODEL --output OUT --dtype fp32`` (clone, verified,
                                  loaded with from_pretrained)
  dsfix convert fp32 --no-load    the same without the load
  dsfix convert bf16              ``--dtype bf16`` (the config's dtype): what a user runs
  dsfix convert bf16 dedupe       ``--strategy dedupe --no-load``: like with like against the .bin, which stores
                                  the tied lm_head once and is neither verified nor loaded

Like with like: the methods run ``--rounds`` times (3 by default), alternated round by round, and the
table gives each one's median (and range); before the first round every checkpoint file is read once, so
that every method starts with it in the page cache. Peak memory is sampled from /proc/PID/status every
20 ms: VmRSS (all resident memory, mapped files included), RssAnon (the process's own) and RssFile (mapped
file pages); the table gives each method's largest. CPU s is the process's user + system time (its threads
included), which other work on the machine changes less than the wall time. The load average is recorded
with every run.

    python benchmarks/bench_engine.py                     # full Qwen3-0.6B, ZeRO-3, 2 ranks
    python benchmarks/bench_engine.py --producer trainer  # the same model through the Trainer: checkpoint-1/
    python benchmarks/bench_engine.py --checkpoint CKPT --model MODEL_DIR
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
FULL_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-0.6b", "config.json")
MIB = 1024.0 * 1024.0

Z2F = r'''
import os, sys, torch
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
ckpt, out, dtype, safe = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
convert_zero_checkpoint_to_state_dict(ckpt, out, dtype=getattr(torch, dtype), safe_serialization=safe)
for name in os.listdir(out):
    fd = os.open(os.path.join(out, name), os.O_RDONLY); os.fsync(fd); os.close(fd)
print("tensors %d" % len(torch.load(os.path.join(out, "pytorch_model.bin"), mmap=True, weights_only=True)))
'''

METHODS = (  # key, label, argv ({ckpt}, {model}, {out}), output dtype
    ("z2f_fp32", "zero_to_fp32 .bin fp32", ["-c", Z2F, "{ckpt}", "{out}", "float32", "0"], "fp32"),
    ("z2f_safe", "zero_to_fp32 --safe_serialization fp32", ["-c", Z2F, "{ckpt}", "{out}", "float32", "1"], "fp32"),
    ("z2f_bf16", "zero_to_fp32 .bin bf16 (dtype=bfloat16)", ["-c", Z2F, "{ckpt}", "{out}", "bfloat16", "0"], "bf16"),
    ("dsfix_fp32", "dsfix convert --dtype fp32",
     ["-m", "patcher", "convert", "{ckpt}", "--config", "{model}", "--output", "{out}", "--dtype", "fp32", "--json"],
     "fp32"),
    ("dsfix_fp32_noload", "dsfix convert --dtype fp32 --no-load",
     ["-m", "patcher", "convert", "{ckpt}", "--config", "{model}", "--output", "{out}", "--dtype", "fp32", "--no-load",
      "--json"], "fp32"),
    ("dsfix_bf16", "dsfix convert --dtype bf16",
     ["-m", "patcher", "convert", "{ckpt}", "--config", "{model}", "--output", "{out}", "--dtype", "bf16", "--json"],
     "bf16"),
    ("dsfix_bf16_dedupe", "dsfix convert --dtype bf16 --strategy dedupe --no-load",
     ["-m", "patcher", "convert", "{ckpt}", "--config", "{model}", "--output", "{out}", "--dtype", "bf16",
      "--strategy", "dedupe", "--no-load", "--json"], "bf16"),
)
# One conversion (bf16, clone, verified and reloaded: what a user runs) with each part timed where it runs:
# the imports first, then the engine convert's own steps, each wrapped in a timer (no profiler overhead).
PARTS = r'''
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
t2 = time.perf_counter()
from patcher import cli
import importlib
from patcher.checkpoint.readers.engine import EngineReader
parts = {"import torch": t1 - t0, "import transformers (AutoConfig, AutoModelForCausalLM)": t2 - t1}
def timed(owner, name, label):
    inner = getattr(owner, name)
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            parts[label] = parts.get(label, 0.0) + time.perf_counter() - start
    setattr(owner, name, wrapper)
for module, name, label in (
        ("patcher.checkpoint.readers", "open_step", "open the checkpoint (rank 0's files, refusals)"),
        ("patcher.checkpoint.check.model", "load_config", "read config.json"),
        ("patcher.checkpoint.write.plan", "make_plan", "plan: the config's model on meta, keys, shapes, ties"),
        ("patcher.checkpoint.write.stage", "verify_folder", "checks of the written folder (headers, keys, tied bytes)"),
        ("patcher.checkpoint.write.stage", "load_check", "reload: from_pretrained, tied"),
        ("patcher.checkpoint.write.stage", "fsync_folder", "fsync (on a thread, beside the checks)")):
    timed(importlib.import_module(module), name, label)
timed(EngineReader, "stream", "write: read the partitions, cast, pwrite")
argv = sys.argv[1:]
start = time.perf_counter()
try:
    cli.main(argv)
except SystemExit as e:
    code = e.code
parts["convert, all of it (after the imports)"] = time.perf_counter() - start
parts["process, all of it"] = time.perf_counter() - t0
print(json.dumps(parts))
'''

RATIOS = (("dsfix_fp32", "z2f_fp32"), ("dsfix_fp32_noload", "z2f_fp32"), ("dsfix_bf16", "z2f_bf16"),
          ("dsfix_bf16_dedupe", "z2f_bf16"))


def _status_kb(pid, fields):
    out = dict.fromkeys(fields, 0)
    try:
        with open("/proc/%d/status" % pid) as handle:
            for line in handle:
                key = line.split(":")[0]
                if key in out:
                    out[key] = int(line.split()[1])
    except OSError:
        pass
    return out


def run_child(args, cwd):
    """(wall s, CPU s (user + system), {peak VmRSS, RssAnon, RssFile in MiB}, returncode, stdout, stderr tail).
    The output goes to files, not pipes, so that a full pipe never stalls the child between samples."""
    env = dict(os.environ, NO_COLOR="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    fields = ("VmRSS", "RssAnon", "RssFile")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable] + args, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        peak = dict.fromkeys(fields, 0)
        while proc.poll() is None:
            now = _status_kb(proc.pid, fields)
            peak = {k: max(peak[k], now[k]) for k in fields}
            time.sleep(0.02)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, {k: v / 1024.0 for k, v in peak.items()}, proc.returncode, stdout, stderr[-2000:]


def make_checkpoint(work, steps, producer="engine"):
    """2 CPU ranks save a ZeRO-3 checkpoint of full-size Qwen3-0.6B, with engine.save_checkpoint or through the
    Trainer; returns (checkpoint, model folder for --config, or None: the Trainer's checkpoint holds its config)."""
    from patcher.checkpoint.smoke.ranks import deepspeed_launcher, free_port, rank_env, run_group

    launcher = deepspeed_launcher()
    if launcher is None:
        raise SystemExit("the deepspeed launcher is not installed")
    fixtures = os.path.join(REPO_ROOT, "fixtures", "step1_trainer")
    if producer == "trainer":
        steps = max(1, steps)
        script = [os.path.join(fixtures, "hf_ckpt.py"), "--output_dir", work, "--runs", "trainer_z3_bf16",
                  "--config", FULL_CONFIG, "--steps", str(steps), "--no_reference"]
    else:
        script = [os.path.join(fixtures, "engine_ckpt.py"), "--output_dir", work, "--stages", "3", "--config",
                  FULL_CONFIG, "--steps", str(steps), "--freeze", "", "--no_reference"]
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port())] + script
    env = rank_env(nproc=2)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, env.get("PYTHONPATH", "")]))
    code, output = run_group(cmd, env, 3600, cwd=REPO_ROOT)
    if code != 0:
        raise SystemExit("saving the checkpoint failed (%s):\n%s" % (code, output[-3000:]))
    if producer == "trainer":
        return os.path.join(work, "trainer_z3_bf16", "checkpoint-%d" % steps), None
    model = os.path.join(work, "model")
    os.makedirs(model)
    shutil.copyfile(FULL_CONFIG, os.path.join(model, "config.json"))
    return os.path.join(work, "zero3"), model


def du_mib(path):
    return sum(os.path.getsize(os.path.join(h, n)) for h, _, names in os.walk(path) for n in names) / MIB


def warm(path):
    """Reads every file under ``path`` once (not timed): each method then starts with it in the page cache."""
    for here, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(here, name), "rb") as handle:
                while handle.read(64 * 1024 * 1024):
                    pass


def run_method(key, argv, ckpt, model, work):
    """One run of one method: {wall_s, peak_mib, returncode, tensors or error, written_mib, load}."""
    out = os.path.join(work, "out-" + key)
    load = os.getloadavg()[0]
    if model is None:  # the checkpoint's own config (the Trainer's checkpoint-N): no --config, as its user runs it
        at = argv.index("{model}") if "{model}" in argv else None
        argv = argv if at is None else argv[:at - 1] + argv[at + 1:]
    wall, cpu, peak, code, stdout, err = run_child([a.format(ckpt=ckpt, model=model, out=out) for a in argv], REPO_ROOT)
    entry = {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "returncode": code, "load": load}
    if code == 0 and key.startswith("dsfix"):
        entry["tensors"] = json.loads(stdout)["tensors"]
    elif code == 0:
        entry["tensors"] = int(stdout.split()[-1])
    else:
        lines = err.strip().splitlines() or ["?"]
        at = max([i for i, line in enumerate(lines) if "Error" in line or "error:" in line] or [len(lines) - 1])
        entry["error"] = " ".join(line.strip() for line in lines[at:at + 3])[:300]
    entry["written_mib"] = du_mib(out) if os.path.isdir(out) else 0.0
    shutil.rmtree(out, ignore_errors=True)
    return entry


def summarize(label, dtype, runs):
    """The runs of one method: median wall time and its range, the largest peaks, the first failure."""
    walls = sorted(r["wall_s"] for r in runs)
    peaks = {k: max(r["peak_mib"][k] for r in runs) for k in runs[0]["peak_mib"]}
    failed = next((r for r in runs if r["returncode"] != 0), None)
    out = {"label": label, "dtype": dtype, "wall_s": statistics.median(walls), "wall_min_s": walls[0],
           "wall_max_s": walls[-1], "cpu_s": statistics.median(r["cpu_s"] for r in runs), "peak_mib": peak_keys(peaks),
           "returncode": failed["returncode"] if failed else 0,
           "written_mib": runs[-1]["written_mib"], "runs": runs}
    if failed:
        out["error"] = failed.get("error", "?")
    else:
        out["tensors"] = runs[-1]["tensors"]
    return out


def peak_keys(peaks):
    return {k: peaks[k] for k in ("VmRSS", "RssAnon", "RssFile")}


def run_parts(ckpt, model, work):
    """One bf16 conversion with its parts timed (PARTS): {part: seconds}, or None when it failed."""
    out = os.path.join(work, "out-parts")
    argv = ["-c", PARTS, "convert", ckpt] + (["--config", model] if model else []) + [
        "--output", out, "--dtype", "bf16", "--json"]
    wall, cpu, peak, code, stdout, err = run_child(argv, REPO_ROOT)
    shutil.rmtree(out, ignore_errors=True)
    if code != 0:
        print("the timed parts run failed: %s" % err[-500:], file=sys.stderr)
        return None
    return json.loads(stdout.strip().splitlines()[-1])


def print_report(args, results, ckpt, ckpt_mib, setup_s, facts, loads, parts=None):
    print("## dsfix convert of a DeepSpeed engine checkpoint vs zero_to_fp32\n")
    print("- command: `python benchmarks/bench_engine.py%s`" % (
        " --checkpoint CKPT" + (" --model MODEL" if args.model else "") if args.checkpoint
        else (" --producer trainer" if args.producer == "trainer" else "") + " --rounds %d" % args.rounds))
    if args.checkpoint:
        what = ckpt
    elif args.producer == "trainer":
        what = ("Qwen3-0.6B (bundled config, random weights, tied), the Hugging Face Trainer's checkpoint-%d "
                "(DeepSpeed ZeRO-3, bf16, 2 CPU ranks), converted without --config" % max(1, args.steps))
    else:
        what = ("Qwen3-0.6B (bundled config, random bf16 weights, tied), engine.save_checkpoint, ZeRO-3, 2 CPU ranks, "
                "%d training step(s)" % args.steps)
    print("- checkpoint: %s, %.0f MiB (saved in %.0f s, not timed)" % (what, ckpt_mib, setup_s))
    print("- machine: %s; load average %.1f-%.1f while it ran" % (facts, min(loads), max(loads)))
    print("- %d round(s), the methods alternated round by round, each run in its own process (imports included), "
          "the checkpoint in the page cache, every written file fsynced; wall s is the median\n" % args.rounds)
    print("| method | dtype | wall s | range s | CPU s | tensors | written MiB | peak RSS MiB | peak RssAnon MiB "
          "| peak RssFile MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, label, _, _ in METHODS:
        r = results.get(key)
        if r is None:
            continue
        print("| %s | %s | %.1f | %.1f-%.1f | %.1f | %s | %.0f | %.0f | %.0f | %.0f |" % (
            label, r["dtype"], r["wall_s"], r["wall_min_s"], r["wall_max_s"], r["cpu_s"], r.get("tensors", "failed"),
            r["written_mib"], r["peak_mib"]["VmRSS"], r["peak_mib"]["RssAnon"], r["peak_mib"]["RssFile"]))
    print()
    for r in results.values():
        if "error" in r:
            print("- %s failed: %s" % (r["label"], r["error"]))
    for a, b in RATIOS:
        ra, rb = results.get(a), results.get(b)
        if ra and rb and not ra["returncode"] and not rb["returncode"]:
            print("- %s / %s: time %.2fx, CPU time %.2fx, peak RSS %.2fx" % (
                ra["label"], rb["label"], ra["wall_s"] / rb["wall_s"], ra["cpu_s"] / rb["cpu_s"],
                ra["peak_mib"]["VmRSS"] / rb["peak_mib"]["VmRSS"]))
    if parts:
        print("\nWhere one `dsfix convert --dtype bf16` (verified and reloaded) spends its wall time, each part timed "
              "where it runs (the fsync runs on a thread beside the checks and the reload):\n")
        print("| part | wall s |")
        print("|---|---:|")
        for name, seconds in parts.items():
            print("| %s | %.2f |" % (name, seconds))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="an engine checkpoint folder (skips the setup)")
    parser.add_argument("--model", default=None, help="with --checkpoint: the model folder for --config (none: the "
                        "checkpoint's own config.json, as in a Trainer's checkpoint-N)")
    parser.add_argument("--producer", choices=("engine", "trainer"), default="engine", help="setup: a plain "
                        "engine.save_checkpoint, or the Hugging Face Trainer's checkpoint-N (ZeRO-3, bf16)")
    parser.add_argument("--steps", type=int, default=0, help="training steps before the save (setup)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each method, alternated; the median is shown")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--parts", action="store_true", help="after the rounds, one more bf16 conversion with "
                        "each of its parts timed")
    parser.add_argument("--methods", default=None, help="comma-separated keys of the methods to run (default: all): "
                        + ", ".join(m[0] for m in METHODS))
    args = parser.parse_args()
    from patcher.prereq import require_or_exit

    require_or_exit("bench_engine", deepspeed="the engine-checkpoint benchmark")  # before any rank starts
    chosen = [m for m in METHODS if args.methods is None or m[0] in args.methods.split(",")]
    from common import machine_facts

    work = tempfile.mkdtemp(prefix="dsfix-bench-engine-", dir=args.tmpdir)
    runs = {m[0]: [] for m in chosen}
    try:
        t = time.perf_counter()
        ckpt, model = ((args.checkpoint, args.model) if args.checkpoint
                       else make_checkpoint(work, args.steps, args.producer))
        setup_s = time.perf_counter() - t
        ckpt_mib = du_mib(ckpt)
        warm(ckpt)
        for round_ in range(args.rounds):
            for key, label, argv, _ in chosen:
                entry = run_method(key, argv, ckpt, model, work)
                runs[key].append(entry)
                print("round %d: %-52s %7.1f s  CPU %6.1f s  peak RSS %6.0f MiB  load %.1f  %s" % (
                    round_ + 1, label, entry["wall_s"], entry["cpu_s"], entry["peak_mib"]["VmRSS"], entry["load"],
                    entry.get("error", "")),
                    file=sys.stderr, flush=True)
        parts = run_parts(ckpt, model, work) if args.parts else None
    finally:
        facts = machine_facts(work)
        shutil.rmtree(work, ignore_errors=True)
    results = {key: summarize(label, dtype, runs[key]) for key, label, _, dtype in chosen if runs[key]}
    loads = [r["load"] for rs in runs.values() for r in rs] or [0.0]
    print_report(args, results, ckpt, ckpt_mib, setup_s, facts, loads, parts)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": results, "checkpoint_mib": ckpt_mib, "machine": facts, "rounds": args.rounds,
                       "parts": parts},
                      handle, indent=2)
    return 0 if all(r["returncode"] == 0 for k, r in results.items() if k != "z2f_safe") else 1


if __name__ == "__main__":
    sys.exit(main())
