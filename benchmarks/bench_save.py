#!/usr/bin/env python
"""Time dsfix's save module against the other ways to save a tied-weight Qwen3, in one run.

On a full-size Qwen3-0.6B (bundled config, random bf16 weights, lm_head tied to the embedding), each
method in its own process, methods alternated over the rounds, every file and folder fsynced inside
the timed region:

  dsfix clone / dedupe   the save module's save_hf_format (templates/dsfix_safetensors.py, loaded from its
                         file as a user's utils.py imports it): 311 / 310 tensors, config.json and
                         generation_config.json, staged and moved into place
  NaN/Inf check alone    the module's is_finite over every tensor the clone save writes, by itself
  dsfix clone, no check  the clone save with is_finite replaced by one that says yes: what the check costs
                         inside the save is the difference
  transformers           model.save_pretrained(dir)
  save_model             safetensors.torch.save_model(model, path)
  article                the widely copied fix (fixtures/broken/article_utils.py)
  torch.save             upstream's algorithm: torch.save of the state dict to pytorch_model.bin
  raw write              as many bytes as dsfix clone writes, from one buffer (the disk's limit)

    python benchmarks/bench_save.py            # full model, 3 rounds (docs/benchmarks.md: --rounds 7 and 5)
    python benchmarks/bench_save.py --quick    # the narrow 28-layer model, 1 round (a smoke test)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

METHODS = (("dsfix_clone", "dsfix clone"), ("dsfix_dedupe", "dsfix dedupe"),
           ("finite", "dsfix's NaN/Inf check alone (part of a save)"),
           ("dsfix_clone_nocheck", "dsfix clone without the NaN/Inf check"),
           ("transformers", "transformers save_pretrained"), ("save_model", "safetensors save_model"),
           ("article", "article (clone + save_file + load_file)"), ("torch_save", "upstream torch.save (.bin)"),
           ("raw", "raw write (disk limit)"))
LABELS = dict(METHODS)
GOALS = (("dsfix clone / article", "dsfix_clone", "article", 1.0), ("dsfix clone / transformers", "dsfix_clone",
         "transformers", 1.0), ("dsfix dedupe / transformers", "dsfix_dedupe", "transformers", 1.0),
         ("dsfix clone / raw write", "dsfix_clone", "raw", 1.15))
PEAK_GOAL_MIB = 50  # peak RSS of dsfix clone above the model's


def upstream_save(model, out_dir):
    """Upstream DeepSpeed-Chat's save_hf_format algorithm: the state dict without LoRA keys, torch.save."""
    import torch

    state = {k: v for k, v in model.state_dict().items() if "lora" not in k}
    torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
    model.config.to_json_file(os.path.join(out_dir, "config.json"))


def child(args):
    """The methods named (comma-separated), one after the other in this process; writes their results as a
    JSON list. A measurement runs one method a process; --quick, a smoke test of the harness, runs them all in
    one (each with a model of its own), which saves a torch and transformers import per method."""
    results = []
    os.makedirs(args.out)
    for method in args.child.split(","):
        one = argparse.Namespace(**{**vars(args), "child": method, "out": os.path.join(args.out, method)})
        results.append(child_method(one))
    with open(args.result, "w") as handle:
        json.dump(results, handle)


def child_method(args):
    """One method, in this process: its result."""
    import torch

    started = time.perf_counter()
    model = common.build_model(args.config, args.device)
    result = {"method": args.child, "build_s": time.perf_counter() - started,
              "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "tied_bytes": model.get_input_embeddings().weight.nbytes}
    size = sum(v.numel() * v.element_size() for v in model.state_dict().values())  # dsfix clone's data bytes
    buf = bytearray(size) if args.child == "raw" else None
    if buf is not None:
        torch.frombuffer(buf, dtype=torch.uint8).fill_(0x5A)  # touch every page before the baseline
    save = common.save_module()
    ns = argparse.Namespace(output_dir=args.out)
    common.warm_page_cache(os.path.dirname(args.out), size)
    os.makedirs(args.out)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_base = torch.cuda.memory_allocated()
    rss = common.reset_peak()
    started = time.perf_counter()
    checked = save.is_finite
    if args.child == "dsfix_clone_nocheck":
        save.is_finite = lambda tensor, chunk_elements=None: True
    if args.child in ("dsfix_clone", "dsfix_dedupe", "dsfix_clone_nocheck"):
        save.save_hf_format(model, None, args.out, strategy=args.child.split("_")[1])
        save.is_finite = checked
    elif args.child == "finite":
        result["finite"] = all(save.is_finite(v) for v in model.state_dict().values())
    elif args.child == "transformers":
        model.save_pretrained(args.out)
    elif args.child == "save_model":
        from safetensors.torch import save_model

        save_model(model, os.path.join(args.out, "model.safetensors"))
    elif args.child == "article":
        common.article_save()(model, common.NoTokenizer(), ns)
    elif args.child == "torch_save":
        upstream_save(model, args.out)
    elif args.child == "raw":
        with open(os.path.join(args.out, "raw.bin"), "wb", buffering=0) as handle:
            view = memoryview(buf)
            for offset in range(0, len(buf), 64 << 20):
                handle.write(view[offset:offset + (64 << 20)])
    common.fsync_tree(args.out)
    result["wall_s"] = time.perf_counter() - started
    result["peak_above_bytes"] = common.peak_since(rss)
    if args.device == "cuda":
        result["gpu_peak_above_bytes"] = torch.cuda.max_memory_allocated() - gpu_base
    result["bytes_written"] = sum(common.written(args.out).values())
    result["tensors"] = common.tensor_count(args.out) if args.child not in ("raw", "finite") else None
    shutil.rmtree(args.out, ignore_errors=True)
    return result


def run_child(methods, args, work):
    """[result] of ``methods`` run in one child process."""
    out, result_path = os.path.join(work, "out"), os.path.join(work, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", ",".join(methods), "--device", args.device,
           "--config", args.config, "--out", out, "--result", result_path]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=common.REPO_ROOT)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        print("[bench] %s failed:\n%s" % (", ".join(methods), proc.stdout[-3000:]), file=sys.stderr)
        return [{"method": method, "error": proc.stdout[-3000:]} for method in methods]
    with open(result_path) as handle:
        return json.load(handle)


def summarise(results):
    summary = {}
    for method, _ in METHODS:
        runs = [r for r in results if r["method"] == method and "error" not in r]
        if runs:
            walls = [r["wall_s"] for r in runs]
            summary[method] = {
                "wall_s": common.median(walls), "best_s": min(walls), "runs": len(runs),
                "written_mib": runs[-1]["bytes_written"] / common.MIB, "tensors": runs[-1]["tensors"],
                "peak_above_mib": common.median([r["peak_above_bytes"] / common.MIB for r in runs
                                                 if r["peak_above_bytes"] is not None]),
                "gpu_peak_above_mib": common.median([r.get("gpu_peak_above_bytes", 0) / common.MIB for r in runs]),
                "model_mib": runs[-1]["model_bytes"] / common.MIB, "tied_mib": runs[-1]["tied_bytes"] / common.MIB}
    return summary


def report(args, summary, facts):
    lines = ["- command: `python benchmarks/bench_save.py %s`" % " ".join(args.argv),
             "- model: %s, random bf16 weights, tied embeddings, on %s; %d round(s), methods alternated, %s; medians"
             % (os.path.relpath(args.config, common.REPO_ROOT), args.device, args.rounds,
                "all in one process (--quick: a smoke test, not a measurement)" if args.quick else
                "each in its own process"),
             "- machine: %s" % facts,
             "- every file and folder fsynced inside the timed region; an untimed scratch write of the same size "
             "first, so all meet a warm page cache; peak RSS: the process's peak during the save above its RSS "
             "before it (Linux VmHWM, reset first)", ""]
    any_run = next(iter(summary.values()), {})
    lines.append("model %.0f MiB in memory, tied tensor %.1f MiB" % (any_run.get("model_mib", 0),
                                                                     any_run.get("tied_mib", 0)))
    lines.append("")
    rows = []
    asked = args.methods.split(",")
    for method, label in [(m, label) for m, label in METHODS if m in asked]:
        s = summary.get(method)
        if s is None:
            rows.append([label, "failed", "", "", "", "", ""])
            continue
        rows.append([label, common.fmt(s["wall_s"]), common.fmt(s["best_s"]), "%.0f" % (s["written_mib"] / s["wall_s"]),
                     "%.1f" % s["written_mib"], common.fmt(s["peak_above_mib"], ".0f"), s["tensors"] or "-"]
                    + (["%.0f" % s["gpu_peak_above_mib"]] if args.device == "cuda" else []))
    header = ["method", "wall s", "best s", "MiB/s", "written MiB", "peak RSS above model MiB", "tensors"]
    lines.append(common.table(header + (["GPU peak above MiB"] if args.device == "cuda" else []), rows))
    lines.append("")
    ok = True
    for text, num, den, goal in GOALS:
        if num in summary and den in summary:
            ratio = summary[num]["wall_s"] / summary[den]["wall_s"]
            ok &= ratio <= goal
            lines.append("- %s = %.2f (goal <= %.2f): %s" % (text, ratio, goal, "PASS" if ratio <= goal else "MISS"))
    clone = summary.get("dsfix_clone")
    if clone and clone["peak_above_mib"] is not None:
        lines.append("- peak RSS above model, dsfix clone = %.0f MiB (goal <= %d MiB): %s"
                     % (clone["peak_above_mib"], PEAK_GOAL_MIB, "PASS" if clone["peak_above_mib"] <= PEAK_GOAL_MIB
                        else "MISS"))
    if clone and "finite" in summary:
        lines.append("- the NaN/Inf check alone = %.3f s, %.0f%% of dsfix clone's save"
                     % (summary["finite"]["wall_s"], 100 * summary["finite"]["wall_s"] / clone["wall_s"]))
    if clone and "dsfix_clone_nocheck" in summary:
        lines.append("- dsfix clone / dsfix clone without the check = %.2f"
                     % (clone["wall_s"] / summary["dsfix_clone_nocheck"]["wall_s"]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the narrow 28-layer Qwen3, 1 round: a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over all methods (default 3, --quick 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--config", default=None, help="a Qwen3 config.json (default: the bundled Qwen3-0.6B)")
    parser.add_argument("--methods", default=",".join(k for k, _ in METHODS), help="a comma-separated subset")
    parser.add_argument("--tmpdir", default=None, help="where to write (default: the system's temporary folder)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.child:  # before anything is built: one line naming what to install
        sys.path.insert(0, common.REPO_ROOT)
        from patcher.prereq import require_or_exit

        require_or_exit("bench_save", cuda=args.device == "cuda")
    args.argv = sys.argv[1:] if argv is None else argv
    args.config = args.config or (common.NARROW_CONFIG if args.quick else common.FULL_CONFIG)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.child:
        return child(args)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in LABELS]
    if unknown:
        parser.error("unknown method(s): %s" % ", ".join(unknown))
    work = tempfile.mkdtemp(prefix="dsfix-bench-", dir=args.tmpdir)
    try:
        results = []
        for i in range(args.rounds):
            order = methods[i % len(methods):] + methods[:i % len(methods)]  # rotate each round
            for batch in ([order] if args.quick else [[m] for m in order]):
                print("[bench] round %d/%d: %s" % (i + 1, args.rounds, ", ".join(batch)), file=sys.stderr,
                      flush=True)
                results += run_child(batch, args, work)
        facts = common.machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarise(results)
    print(report(args, summary, facts))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": results, "summary": summary}, handle, indent=2)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
