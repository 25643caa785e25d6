#!/usr/bin/env python
"""Time the final ZeRO-3 save on several CPU ranks with a real DeepSpeed engine, side by side, in one run.

For each rank count (2 and 4 by default) one launcher run builds a full-size Qwen3-0.6B (bundled config,
random bf16 weights, tied embeddings) on every rank, wraps it in a DeepSpeed ZeRO-3 engine (gloo, plain
SGD, every parameter partitioned: the most gathers), then saves it over and over, methods alternated:

  dsfix one at a time       the save module's save_zero_three_model, gather_bucket_mb=0
  dsfix bucketed            the same with the default bucket (the default since bucketing exists)
  ... dedupe                the same with strategy="dedupe": the tied lm_head left out, as upstream does
  upstream torch.save       upstream's algorithm: gather each parameter, rank 0 copies it, torch.save
  DeepSpeed save_16bit      engine.save_16bit_model (stage3_gather_16bit_weights_on_model_save)
  dsfix plain, 1 rank       the save module's save of an ordinary copy of the model on rank 0, no ZeRO

Reported per method: wall time of the slowest rank (every file fsynced inside it), peak RSS during the save
above the RSS before it on rank 0 and on the other ranks (Linux VmHWM, reset first), bytes written,
gathers (GatheredParameters contexts entered) and tensors.

    python benchmarks/bench_zero3.py            # full model, 2 and 4 ranks, 3 rounds
    python benchmarks/bench_zero3.py --quick    # narrow model, 2 ranks, 1 round (a smoke test)
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, common.REPO_ROOT)
from patcher.checkpoint.smoke.ranks import deepspeed_launcher, free_port, rank_env, run_group, skip_shm_allreduce  # noqa: E402

METHODS = (("one", "dsfix one at a time"), ("bucketed", "dsfix bucketed (default)"),
           ("dedupe", "dsfix bucketed, dedupe (upstream's bytes)"),
           ("upstream", "upstream torch.save (rank 0)"), ("deepspeed", "DeepSpeed save_16bit_model"),
           ("plain", "dsfix plain save, 1 rank, no ZeRO"), ("gather", "the gathers alone, bucketed, no write"))
LABELS = dict(METHODS)
RANK_END = common.load_file_module("fixtures", "step1_trainer", "rank_end.py")


# ------------------------------------------------------------------------------------------ one rank


def upstream_save(engine, rank, out_dir):
    """Upstream save_zero_three_model's algorithm: each parameter gathered on all ranks, copied by rank 0."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    state = {}
    for name, param in engine.module.named_parameters():
        fetch = [param] if getattr(param, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE else []
        with deepspeed.zero.GatheredParameters(fetch, enabled=bool(fetch)):
            if rank == 0 and "lora" not in name:
                state[name] = param.data.detach().cpu().clone()
    if rank == 0:
        torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))


def gather_alone(engine, bucket_bytes):
    """The floor under every ZeRO-3 save: each partitioned parameter gathered once, module by module, packed
    into buckets of ``bucket_bytes`` as dsfix packs them, and nothing written."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    group, size, seen = [], 0, set()
    for module in list(engine.module.modules()) + [None]:
        params = [] if module is None else [p for p in module.parameters(recurse=False) if id(p) not in seen
                                            and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        seen.update(id(p) for p in params)
        nbytes = sum(p.ds_numel * p.element_size() for p in params)
        if group and (module is None or size + nbytes > bucket_bytes):
            with deepspeed.zero.GatheredParameters(group):
                group, size = [], 0
        group, size = group + params, size + nbytes


def worker(args):
    import deepspeed
    import torch.distributed as dist

    skip_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    engine = _engine(args)
    plain = common.build_model(args.config) if rank == 0 and "plain" in args.methods else None
    build_s = time.perf_counter() - started
    largest = max(p.ds_numel * p.element_size() for p in engine.module.parameters())
    model_bytes = sum(p.ds_numel * p.element_size() for p in engine.module.parameters())
    gathers = common.load_file_module("fixtures", "step1_trainer", "train.py").count_gathers(deepspeed)
    if rank == 0:
        common.warm_page_cache(args.work, model_bytes + largest)
    methods = [m for m, _ in METHODS if m in args.methods.split(",")]
    results = []
    for round_ in range(args.rounds):
        for method in methods[round_ % len(methods):] + methods[:round_ % len(methods)]:
            result = _run_method(method, engine, plain, gathers, args)
            if result is not None:
                results.append(dict(result, round=round_))
    if rank == 0:
        with open(args.result, "w") as handle:
            json.dump({"world": world, "results": results, "build_s": build_s, "largest_bytes": largest,
                       "model_bytes": model_bytes, "bucket_bytes": args.bucket_mb * common.MIB}, handle)
    RANK_END.end_rank()  # the process group torn down before the interpreter's exit


def _engine(args):
    """The model under ZeRO-3 on this rank, with a plain SGD optimizer (no state of its own): save_16bit_model
    needs an optimizer to save."""
    import deepspeed
    import torch

    model = common.build_model(args.config)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": 1 << 30,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True,
                                    # buffers small enough for 4 ranks of the full model on a 24 GB machine
                                    "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7,
                                    "sub_group_size": 1e8, "stage3_max_live_parameters": 1e8}}
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)[0]


def _run_method(method, engine, plain, gathers, args):
    """One save by ``method`` on every rank, timed between barriers; rank 0 returns what it wrote and the
    slowest rank's time, the others None."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    save = common.save_module()
    out = os.path.join(args.work, "%d-ranks-%s" % (world, method))
    bucket_mb = 0 if method == "one" else args.bucket_mb
    dist.barrier()
    rss, gathers[0] = common.reset_peak(), 0
    dist.barrier()
    begin = time.perf_counter()
    if method in ("one", "bucketed", "dedupe"):
        save.save_zero_three_model(engine, out, global_rank=rank, zero_stage=3, gather_bucket_mb=bucket_mb,
                                   strategy="dedupe" if method == "dedupe" else "clone")
    elif method == "upstream":
        os.makedirs(out, exist_ok=True)
        upstream_save(engine, rank, out)
    elif method == "deepspeed":
        engine.save_16bit_model(out, "pytorch_model.bin")
    elif method == "plain" and rank == 0:
        save.save_zero_three_model(plain, out, global_rank=0, zero_stage=0)
    elif method == "gather":
        gather_alone(engine, args.bucket_mb * common.MIB)
    if rank == 0:
        common.fsync_tree(out)
    wall, peak = time.perf_counter() - begin, common.peak_since(rss)
    every = [None] * world
    dist.all_gather_object(every, (wall, peak))
    result = None
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        files = common.written(out)
        result = {"method": method, "wall_s": max(w for w, _ in every), "rank0_peak": every[0][1],
                  "other_peak": max([p for _, p in every[1:] if p is not None], default=None),
                  "bytes_written": sum(files.values()), "files": len(files), "gathers": gathers[0],
                  "tensors": common.tensor_count(out) if files else None}
        shutil.rmtree(out)
    dist.barrier()
    return result


# ------------------------------------------------------------------------------------------ the run


def launch(world, args, work):
    """deepspeed --num_gpus WORLD this file --worker ...; returns the result, or None (each rank's last lines on
    stderr). A launch whose every rank wrote its result and finished (torn down) counts even if a process then
    died in its interpreter's exit; that is said on stderr."""
    result = os.path.join(work, "result-%d.json" % world)
    logs = os.path.join(work, "logs-%d" % world)  # one log per rank
    cmd = [deepspeed_launcher() or "deepspeed", "--num_gpus", str(world), "--master_port", str(free_port()),
           "--enable_each_rank_log", logs, os.path.abspath(__file__), "--worker",
           "--config", args.config, "--rounds", str(args.rounds), "--methods", args.methods,
           "--bucket-mb", str(args.bucket_mb),
           "--work", work, "--result", result]
    env = dict(rank_env(nproc=world), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=common.REPO_ROOT)
    code, output = run_group(cmd, env, args.timeout)  # killed whole past the limit: the launcher and its ranks
    ranks = RANK_END.rank_logs(logs)
    finished = len(RANK_END.finished(ranks)) == world
    if code is None or not finished or not os.path.exists(result):
        print("[bench] %d ranks failed:\n%s" % (world, RANK_END.tails(code, output, ranks, world)), file=sys.stderr)
        return None
    if code != 0:
        print("[bench] %d ranks: every rank finished, then the launcher exited %s (a process died in its exit):\n%s"
              % (world, code, RANK_END.tails(code, output, ranks, world, lines=8)), file=sys.stderr)
    with open(result) as handle:
        return json.load(handle)


def summarise(run):
    summary = {}
    for method, _ in METHODS:
        runs = [r for r in run["results"] if r["method"] == method]
        if runs:
            summary[method] = dict((k, common.median([r[k] for r in runs])) for k in (
                "wall_s", "rank0_peak", "other_peak", "bytes_written", "files", "gathers", "tensors"))
            summary[method]["best_s"] = min(r["wall_s"] for r in runs)
    return summary


def _mib(nbytes):
    return common.fmt(None if nbytes is None else nbytes / common.MIB, ".0f")


def report(run, summary):
    world, mib = run["world"], common.MIB
    lines = ["#### %d ranks" % world, "",
             "model %.0f MiB in bf16, largest tensor %.0f MiB, gather bucket %.0f MiB; build %.0f s (not timed)"
             % (run["model_bytes"] / mib, run["largest_bytes"] / mib, run["bucket_bytes"] / mib, run["build_s"]), ""]
    rows = [[LABELS[m], common.fmt(s["wall_s"]), common.fmt(s["best_s"]), _mib(s["rank0_peak"]),
             _mib(s["other_peak"]) if world > 1 else "-", "%.0f" % (s["bytes_written"] / mib),
             "%d" % s["files"], "%d" % s["gathers"], common.fmt(s["tensors"], "d")] for m, s in summary.items()]
    lines.append(common.table(["method", "wall s", "best s", "rank-0 peak above MiB", "other ranks' peak above MiB",
                               "written MiB", "files", "gathers", "tensors"], rows))
    lines.append("")
    bucketed = summary.get("bucketed")
    anchors = [summary[m]["wall_s"] for m in ("upstream", "deepspeed") if m in summary]
    if bucketed and anchors:
        ratio = bucketed["wall_s"] / min(anchors)
        lines.append("- dsfix bucketed / faster of upstream and DeepSpeed = %.2f (goal <= 1.0): %s"
                     % (ratio, "PASS" if ratio <= 1.0 else "MISS"))
    if bucketed and "plain" in summary:
        ratio = bucketed["wall_s"] / summary["plain"]["wall_s"]
        lines.append("- dsfix bucketed / dsfix plain save on 1 rank = %.2f (goal <= 1.2): %s"
                     % (ratio, "PASS" if ratio <= 1.2 else "MISS"))
    if bucketed and bucketed["rank0_peak"] is not None:  # None: this kernel cannot reset a peak (no clear_refs)
        limit = run["bucket_bytes"] + run["largest_bytes"]
        lines.append("- dsfix bucketed, rank-0 peak above the engine = %.0f MiB (goal <= bucket + largest tensor = "
                     "%.0f MiB): %s" % (bucketed["rank0_peak"] / mib, limit / mib,
                                        "PASS" if bucketed["rank0_peak"] <= limit else "MISS"))
    for one, many in (("one", "bucketed"),):
        if one in summary and many in summary:
            lines.append("- %s / %s = %.2f" % (LABELS[many], LABELS[one],
                                                 summary[many]["wall_s"] / summary[one]["wall_s"]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the narrow model, 2 ranks, 1 round: a smoke test")
    parser.add_argument("--ranks", default=None, help="comma-separated rank counts (default 2,4; --quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over all methods (default 3, --quick 1)")
    parser.add_argument("--config", default=None, help="a Qwen3 config.json (default: the bundled Qwen3-0.6B)")
    parser.add_argument("--methods", default=",".join(m for m, _ in METHODS), help="a comma-separated subset")
    parser.add_argument("--bucket-mb", type=float, default=None, help="the gather bucket (default: the module's)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per launcher run")
    parser.add_argument("--tmpdir", default=None, help="where to write (default: the system's temporary folder)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:  # before any rank starts: one line naming what to install
        from patcher.prereq import require_or_exit

        require_or_exit("bench_zero3", deepspeed="a ZeRO-3 benchmark")
    args.config = args.config or (common.NARROW_CONFIG if args.quick else common.FULL_CONFIG)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.bucket_mb = common.save_module().DEFAULT_GATHER_BUCKET_MB if args.bucket_mb is None else args.bucket_mb
    if args.worker:
        return worker(args)
    work = tempfile.mkdtemp(prefix="dsfix-bench-z3-", dir=args.tmpdir)
    runs = []
    try:
        for world in [int(n) for n in (args.ranks or ("2" if args.quick else "2,4")).split(",")]:
            print("[bench] %d ranks" % world, file=sys.stderr, flush=True)
            run = launch(world, args, work)
            if run is not None:
                runs.append(dict(run, summary=summarise(run)))
        facts = common.machine_facts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("- command: `python benchmarks/bench_zero3.py %s`" % " ".join(sys.argv[1:] if argv is None else argv))
    print("- model: %s, random bf16 weights, tied embeddings; DeepSpeed ZeRO-3 engine over gloo on CPU ranks "
          "(OMP_NUM_THREADS=1); %d round(s), methods alternated; medians" % (
              os.path.relpath(args.config, common.REPO_ROOT), args.rounds))
    print("- machine: %s" % facts)
    for run in runs:
        print()
        print(report(run, run["summary"]))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(runs, handle, indent=2)
    return 0 if len(runs) == len((args.ranks or ("2" if args.quick else "2,4")).split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
