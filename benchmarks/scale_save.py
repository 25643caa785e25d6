"""bench_scale.py --save: the ZeRO-3 save dsfix inserts, at Qwen3-4B and 8B shapes, on 2 CPU ranks.

Each rank builds the model under ``deepspeed.zero.Init`` (bf16, every parameter partitioned, no optimizer: the
save needs none), without torch's initialisation, and fills its partitions with the checkpoint generator's seeded
values (scale_ckpt.fill). Two launches per size, each under the memory guard (scale_measure.run_tree):

* ``dsfix``: in one run, on rank 0 the peak above the partitioned model of DeepSpeed's own gather of the largest
  tensor alone; the gathers alone (every parameter, in dsfix's buckets, nothing written); the save module's
  ``save_zero_three_model``; the disk's write floor for the same bytes (one file, fsynced); then a few tensors
  gathered again and compared bit for bit with the files.
* ``deepspeed``: ``engine._zero3_consolidated_16bit_state_dict()`` then ``torch.save`` on rank 0, fsynced, as
  ``save_16bit_model`` does: the whole model on rank 0. Killed by the guard where it cannot fit.
"""
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import scale_ckpt  # noqa: E402
import scale_measure as measure  # noqa: E402

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": 1 << 30,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                   "stage3_gather_16bit_weights_on_model_save": True}}


def build(size, rank, world, spill=None):
    """The partitioned model on this rank, its partitions filled with seeded values; the DeepSpeed engine.

    With ``spill`` (a file's path), this rank's partitions are written to that file and mapped from it instead of
    held in its heap: the page cache keeps them while memory allows, and the kernel reads them back when it does
    not. The values are the same; only where they live changes.
    """
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    config = scale_ckpt.config_of(size)
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, dtype=torch.bfloat16):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**kwargs), torch_dtype=torch.bfloat16)
    buf = torch.empty(0)
    spilled = open(spill, "wb") if spill else None
    with torch.no_grad():
        for name, param in model.named_parameters():
            part = param.ds_tensor.numel()
            count = max(0, min(part, param.ds_numel - rank * part))
            if buf.numel() < part:
                buf = torch.empty(part)
            buf[:part].zero_()
            scale_ckpt.fill(buf[:count], name, rank * part)
            if spilled:
                spilled.write(buf[:part].to(torch.bfloat16).view(torch.uint8).numpy().data)
            else:
                param.ds_tensor.view(-1).copy_(buf[:part])
    del buf
    if spilled:
        _map_partitions(model, spilled)
    engine = deepspeed.initialize(model=model, config=DS_CONFIG)[0]
    return engine


def _map_partitions(model, spilled):
    """Each parameter's partition becomes its window of the spill file, mapped copy-on-write (nothing writes it)."""
    import torch

    spilled.flush()
    os.fsync(spilled.fileno())
    spilled.close()
    total = os.path.getsize(spilled.name) // 2
    mapped = torch.from_file(spilled.name, shared=False, size=total, dtype=torch.bfloat16)
    first = 0
    for param in model.parameters():
        part = param.ds_tensor.numel()
        param.ds_tensor.data = mapped[first:first + part].view(param.ds_tensor.shape)
        first += part
    assert first == total, (first, total)


def _timed(dist, fn):
    """(slowest rank's seconds, rank 0's peak above its memory before) of ``fn`` run on every rank."""
    dist.barrier()
    rss = common.reset_peak()
    begin = time.perf_counter()
    fn()
    wall, peak = time.perf_counter() - begin, common.peak_since(rss)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, wall)
    return max(every), peak


def _check_bits(engine, out, rank):
    """Three tensors gathered again (the largest, one layer's, the last) and compared with the saved files, and
    with the seeded values the ranks were filled with (so a partition that went wrong on its way, to a spill file
    or elsewhere, is seen too)."""
    import deepspeed
    import torch
    from safetensors import safe_open

    params = dict(engine.module.named_parameters())
    largest = max(params, key=lambda n: params[n].ds_numel)
    names = [largest, "model.layers.0.self_attn.q_proj.weight", list(params)[-1]]
    handles = {}
    if rank == 0:
        for f in (f for f in os.listdir(out) if f.endswith(".safetensors")):
            h = safe_open(os.path.join(out, f), framework="pt")
            handles.update((k, h) for k in h.keys())
    equal = {}
    for name in names:
        with deepspeed.zero.GatheredParameters([params[name]]):
            if rank == 0:
                gathered = params[name].data
                seeded = scale_ckpt.seeded(name, tuple(gathered.shape), gathered.dtype)
                equal[name] = bool(torch.equal(handles[name].get_tensor(name), gathered)
                                   and torch.equal(gathered, seeded))
                del gathered, seeded
    return equal


def dsfix_run(engine, args, rank, dist):
    import deepspeed

    bench_zero3 = common.load_file_module("benchmarks", "bench_zero3.py")
    save = common.save_module()
    params = list(engine.module.parameters())
    largest = max(params, key=lambda p: p.ds_numel)
    out = os.path.join(args.work, "saved")
    result = {}

    def gather_largest():
        with deepspeed.zero.GatheredParameters([largest]):
            pass

    result["largest_gather_s"], result["largest_gather_peak"] = _timed(dist, gather_largest)
    bucket = save.DEFAULT_GATHER_BUCKET_MB * common.MIB
    result["gathers_s"], result["gathers_peak"] = _timed(dist, lambda: bench_zero3.gather_alone(engine, bucket))
    result["save_s"], result["save_peak"] = _timed(dist, lambda: save.save_zero_three_model(
        engine.module, out, global_rank=rank, zero_stage=3))
    files = common.written(out) if rank == 0 else {}
    result["bytes_written"], result["files"] = sum(files.values()), len(files)
    nbytes = [result["bytes_written"]]
    dist.broadcast_object_list(nbytes, src=0)
    result["write_floor_s"], _ = _timed(dist, lambda: rank == 0 and measure.write_once(out + ".floor", nbytes[0]))
    result["bit_equal"] = _check_bits(engine, out, rank)
    return result


def deepspeed_run(engine, args, rank, dist):
    import torch

    out = os.path.join(args.work, "ds-saved")

    def consolidated():
        state = engine._zero3_consolidated_16bit_state_dict()
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            torch.save(state, os.path.join(out, "pytorch_model.bin"))
            common.fsync_tree(out)

    wall, peak = _timed(dist, consolidated)
    return {"save_s": wall, "save_peak": peak}


def worker(args):
    import deepspeed
    import torch.distributed as dist

    from patcher.checkpoint.smoke.ranks import skip_shm_allreduce

    skip_shm_allreduce()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    begin = time.perf_counter()
    spill = os.path.join(args.work, "rank%d.partitions" % rank) if args.spill and rank > 0 else None
    engine = build(args.size, rank, world, spill)
    build_s = time.perf_counter() - begin
    model_bytes = sum(p.ds_numel * p.element_size() for p in engine.module.parameters())
    largest = max(p.ds_numel * p.element_size() for p in engine.module.parameters())
    result = (dsfix_run if args.method == "dsfix" else deepspeed_run)(engine, args, rank, dist)
    if rank == 0:
        with open(args.result, "w") as handle:
            json.dump(dict(result, build_s=build_s, model_bytes=model_bytes, largest_bytes=largest,
                           partitioned_rss=common._status("VmRSS")), handle)
    common.load_file_module("fixtures", "step1_trainer", "rank_end.py").end_rank()


def launch(size, method, args, work):
    """One launch of 2 ranks under the guard: the result of rank 0, or what the guard saw."""
    from patcher.checkpoint.smoke.ranks import free_port, rank_env

    result = os.path.join(work, "save-%s-%s.json" % (size, method))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.abspath(__file__), "--worker", "--size", size, "--method", method, "--work", work,
           "--result", result] + (["--spill"] if args.save_spill else [])
    env = rank_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=common.REPO_ROOT), nproc=2)
    print("[scale] ZeRO-3 save, %s, %s: 2 ranks" % (size, method), file=sys.stderr, flush=True)
    res = measure.run_tree(cmd, limit=args.limit_gib * measure.GIB, env=env, timeout=args.timeout)
    found = {}
    if os.path.exists(result) and res["returncode"] == 0:
        with open(result) as handle:
            found = json.load(handle)
        os.remove(result)
    for name in ("saved", "saved.floor", "ds-saved"):
        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    for name in (n for n in os.listdir(work) if n.endswith(".partitions")):
        os.remove(os.path.join(work, name))
    return dict(found, spill=args.save_spill, tree_anon_peak=res["anon_peak"], killed_at=res["killed_at"],
                wall_s=res["wall_s"], returncode=res["returncode"],
                error=None if found else res["stderr"][-1500:] + res["stdout"][-1500:])


def run_sizes(sizes, args, work):
    """{size: {"dsfix": result, "deepspeed": result}}, the launches one after another."""
    return {size: {method: launch(size, method, args, work) for method in ("dsfix", "deepspeed")} for size in sizes}


def _mib(nbytes):
    return "-" if nbytes is None else "%.0f" % (nbytes / common.MIB)


def report(saves):
    """The table and the issue's bounds, size by size."""
    rows, lines = [], []
    for size, runs in saves.items():
        mine, theirs = runs["dsfix"], runs["deepspeed"]
        if "save_s" not in mine:
            lines.append("- %s: the dsfix launch did not finish: %s" % (size, _deepspeed_cell(mine)))
            continue
        equal = mine["bit_equal"]
        rows.append([size, "%.0f" % (mine["model_bytes"] / common.MIB), "%.0f" % (mine["largest_bytes"] / common.MIB),
                     "%.1f" % mine["largest_gather_s"], _mib(mine["largest_gather_peak"]), "%.1f" % mine["gathers_s"],
                     _mib(mine["gathers_peak"]),
                     "%.1f" % mine["write_floor_s"], "%.1f" % mine["save_s"], _mib(mine["save_peak"]),
                     "%d of %d" % (sum(equal.values()), len(equal)), _deepspeed_cell(theirs)])
        bound = mine["largest_gather_peak"] + 256 * common.MIB
        floor = mine["gathers_s"] + mine["write_floor_s"]
        lines.append("- %s: rank-0 peak above the partitioned model %s MiB (<= DeepSpeed's gather of the largest "
                     "tensor + 256 = %s MiB: %s); time %.1f s (<= 1.5 x (gathers %.1f + write floor %.1f) = %.1f s: "
                     "%s)" % (size, _mib(mine["save_peak"]), _mib(bound), "PASS" if mine["save_peak"] <= bound
                              else "MISS", mine["save_s"], mine["gathers_s"], mine["write_floor_s"], 1.5 * floor,
                              "PASS" if mine["save_s"] <= 1.5 * floor else "MISS"))
    header = ["model", "model MiB (bf16)", "largest tensor MiB", "gather of the largest s",
              "its rank-0 peak above MiB", "gathers alone s", "their rank-0 peak above MiB", "write floor s",
              "dsfix save s",
              "dsfix rank-0 peak above MiB", "tensors bit-equal to a gather and the seeded values",
              "DeepSpeed consolidated + torch.save"]
    return common.table(header, rows) + "\n\n" + "\n".join(lines)


def _deepspeed_cell(res):
    if res.get("killed_at"):
        return "killed at %.1f GiB (both ranks, by the guard), after %.0f s" % (res["killed_at"] / measure.GIB,
                                                                              res["wall_s"])
    if "save_s" not in res:
        return "failed: %s" % (res.get("error") or "").strip().splitlines()[-1:]
    return "%.1f s, rank-0 peak above %s MiB" % (res["save_s"], _mib(res["save_peak"]))


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--size")
    parser.add_argument("--method")
    parser.add_argument("--work")
    parser.add_argument("--result")
    parser.add_argument("--spill", action="store_true")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args(argv)
    sys.path.insert(0, common.REPO_ROOT)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
