#!/usr/bin/env python
"""Benchmark ``dsfix convert`` on a full-size Qwen3-0.6B .bin folder against the script a user would write.

Setup (not timed): Qwen3-0.6B from the bundled config (random bf16 weights, tied embeddings) saved the way
upstream DeepSpeed-Chat's ZeRO-3 save does (``named_parameters()``: 310 tensors, ``lm_head.weight``
dropped) as ``pytorch_model.bin`` plus config.json.

Methods, each in its own process, alternated round-robin, every written file fsynced:

  dsfix convert            ``python -m patcher convert DIR`` (clone: 311 tensors; verify, load and compare)
  dsfix convert --no-load  the same without the from_pretrained load
  dsfix convert dedupe     ``--strategy dedupe`` (310 tensors)
  plain script             ``torch.load(weights_only=True)``, ``lm_head.weight = embed.clone()``,
                           ``save_file``, fsync, ``load_file`` to count: no checks against the config
  file copy (disk limit)   ``shutil.copyfile`` of the .bin plus fsync: read and write the same bytes once

Peak memory is sampled from /proc/PID/status every 20 ms: RssAnon (the process's own memory) and
RssFile (pages of mapped files, which the kernel can drop). "anon above imports" subtracts the RssAnon
of a process that only imports torch, transformers and safetensors.

    python benchmarks/bench_convert.py               # full Qwen3-0.6B, 3 rounds
    python benchmarks/bench_convert.py --quick       # narrow Qwen3, 1 round (a smoke run)
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-0.6b", "config.json")
NARROW_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-narrow", "config.json")
MIB = 1024.0 * 1024.0

PLAIN = r'''
import os, sys, torch
from safetensors.torch import save_file, load_file
folder = sys.argv[1]
sd = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
path = os.path.join(folder, "model.safetensors")
save_file(sd, path, metadata={"format": "pt"})
fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
print("loaded %d tensors" % len(load_file(path)))
'''

COPY = r'''
import os, shutil, sys
src = os.path.join(sys.argv[1], "pytorch_model.bin")
dst = os.path.join(sys.argv[1], "copy.bin")
shutil.copyfile(src, dst)
fd = os.open(dst, os.O_RDONLY); os.fsync(fd); os.close(fd)
'''

IMPORTS = "import torch, transformers, safetensors.torch, patcher.checkpoint.convert, patcher.checkpoint.verify"

METHODS = (
    ("convert", "dsfix convert", ["-m", "patcher", "convert", "{dir}", "--json"]),
    ("convert_noload", "dsfix convert --no-load", ["-m", "patcher", "convert", "{dir}", "--no-load", "--json"]),
    ("convert_dedupe", "dsfix convert --strategy dedupe",
     ["-m", "patcher", "convert", "{dir}", "--strategy", "dedupe", "--json"]),
    ("plain", "plain script (load, clone, save_file, load_file)", ["-c", PLAIN, "{dir}"]),
    ("copy", "file copy of the .bin (disk limit)", ["-c", COPY, "{dir}"]),
)


def _status_kb(pid, field):
    try:
        with open("/proc/%d/status" % pid) as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def run_child(args, cwd):
    """(wall s, peak RssAnon MiB, peak RssFile MiB, returncode, stdout, stderr tail)."""
    env = dict(os.environ, NO_COLOR="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable] + args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    anon = rfile = 0
    while proc.poll() is None:
        a, f = _status_kb(proc.pid, "RssAnon"), _status_kb(proc.pid, "RssFile")
        anon, rfile = max(anon, a or 0), max(rfile, f or 0)
        time.sleep(0.02)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    return wall, anon / 1024.0, rfile / 1024.0, proc.returncode, out, err[-2000:]


def make_folder(config_path, folder):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, REPO_ROOT)
    from patcher.checkpoint.check.load import dtype_kwarg

    cfg = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, **{dtype_kwarg(): torch.bfloat16})
    os.makedirs(folder)
    model.config.to_json_file(os.path.join(folder, "config.json"))
    state = {k: p.detach().clone() for k, p in model.named_parameters()}  # upstream's ZeRO-3 save: 310
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    tied = model.model.embed_tokens.weight
    return (len(state), tied.numel() * tied.element_size() / MIB,
            os.path.getsize(os.path.join(folder, "pytorch_model.bin")) / MIB)


def clean(folder):
    for name in os.listdir(folder):
        if name not in ("config.json", "pytorch_model.bin"):
            path = os.path.join(folder, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="narrow Qwen3, 1 round")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    sys.path.insert(0, REPO_ROOT)
    from patcher.prereq import require_or_exit

    require_or_exit("bench_convert")  # before anything is built: one line naming what to install
    repeats = args.repeats or (1 if args.quick else 3)
    config = NARROW_CONFIG if args.quick else FULL_CONFIG
    run = measure(config, repeats, args.tmpdir)
    report(run, config, repeats, args.quick)
    errors = [(k, r["error"]) for k in run["results"] for r in run["results"][k] if "error" in r]
    for key, err in errors:
        print("error in %s: %s" % (key, err), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": run["results"], "imports": run["base"][:3], "tied_mib": run["tied_mib"],
                       "bin_mib": run["bin_mib"]}, handle, indent=2)
    return 1 if errors else 0


def measure(config, repeats, tmpdir):
    """The folder made once, then every method run ``repeats`` times in turn, each in a fresh process."""
    work = tempfile.mkdtemp(prefix="dsfix-bench-convert-", dir=tmpdir)
    try:
        folder = os.path.join(work, "z3")
        t = time.perf_counter()
        n_bin, tied_mib, bin_mib = make_folder(config, folder)
        build_s = time.perf_counter() - t
        base = run_child(["-c", IMPORTS], REPO_ROOT)
        results = {key: [] for key, _, _ in METHODS}
        for _ in range(repeats):
            for key, _, argv in METHODS:
                clean(folder)
                results[key].append(_entry(key, run_child([a.replace("{dir}", folder) for a in argv], REPO_ROOT)))
        clean(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"results": results, "base": base, "n_bin": n_bin, "tied_mib": tied_mib, "bin_mib": bin_mib,
            "build_s": build_s}


def _entry(key, child):
    """One method's run as the report reads it: its time and memory, and what it wrote or why it failed."""
    wall, anon, rfile, code, out, err = child
    entry = {"wall_s": wall, "anon_mib": anon, "file_mib": rfile, "returncode": code}
    if code != 0 and (key.startswith("convert") or key == "plain"):
        entry["error"] = err
    if key.startswith("convert") and code == 0:
        (f,) = json.loads(out)["folders"]
        entry["tensors"] = f["tensors"]
        entry["written_mib"] = f["bytes_written"] / MIB
    elif key == "plain":
        entry["tensors"] = int(out.split()[1]) if code == 0 else None
    return entry


def report(run, config, repeats, quick):
    import safetensors
    import torch
    import transformers

    results, base, tied_mib = run["results"], run["base"], run["tied_mib"]

    def med(key, field):
        vals = [r[field] for r in results[key] if field in r and r[field] is not None]
        return statistics.median(vals) if vals else float("nan")

    print("## dsfix convert benchmark\n")
    print("- command: `python benchmarks/bench_convert.py%s`" % (" --quick" if quick else ""))
    print("- model: %s, random bf16 weights, tied embeddings; .bin as upstream's ZeRO-3 save writes it (%d tensors, "
          "%.1f MiB; tied tensor %.1f MiB); built and saved in %.1f s (not timed)"
          % (os.path.relpath(config, REPO_ROOT), run["n_bin"], run["bin_mib"], tied_mib, run["build_s"]))
    print("- machine: %s; %d cores; Python %s, torch %s, transformers %s, safetensors %s"
          % (platform.processor() or platform.machine(), os.cpu_count(), platform.python_version(),
             torch.__version__, transformers.__version__, safetensors.__version__))
    print("- %d round(s), methods alternated, medians; each a fresh process (imports included: %.1f s, "
          "RssAnon %.0f MiB for imports alone)\n" % (repeats, base[0], base[1]))
    print("| method | wall s | tensors | peak RssAnon MiB | anon above imports MiB | peak RssFile MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, label, _ in METHODS:
        tensors = {r.get("tensors") for r in results[key]}
        print("| %s | %.2f | %s | %.0f | %.0f | %.0f |" % (
            label, med(key, "wall_s"), "-" if tensors == {None} else "/".join(str(t) for t in sorted(tensors, key=str)),
            med(key, "anon_mib"), med(key, "anon_mib") - base[1], med(key, "file_mib")))
    print()
    conv, noload, plain, copy = (med(k, "wall_s") for k in ("convert", "convert_noload", "plain", "copy"))
    extra = med("convert", "anon_mib") - base[1]
    print("- dsfix convert --no-load / plain script = %.2f (the plain script checks nothing against the config)"
          % (noload / plain))
    print("- dsfix convert / plain script = %.2f" % (conv / plain))
    print("- dsfix convert / file copy = %.2f" % (conv / copy))
    print("- anon memory above imports, dsfix convert = %.0f MiB (the tied tensor, %.0f MiB, is written twice from "
          "the mapped .bin, never copied in memory; plain script: %.0f MiB)"
          % (extra, tied_mib, med("plain", "anon_mib") - base[1]))


if __name__ == "__main__":
    sys.exit(main())
