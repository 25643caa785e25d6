#!/usr/bin/env python
"""Benchmark dsfix's safetensors save against the other ways to save a tied-weight Qwen3.

One command compares, on a full-size Qwen3-0.6B (random bf16 weights, real
architecture, ``lm_head.weight`` sharing storage with ``model.embed_tokens.weight``):

  dsfix clone       templates/save_safetensors.py ``save_hf_format_safetensors`` (writes 311 tensors)
  dsfix dedupe      the same with strategy="dedupe" (310 tensors, like transformers)
  transformers      ``model.save_pretrained(dir, safe_serialization=True)``
  save_model        ``safetensors.torch.save_model(model, path)``
  article           the widely copied fix: clone tensors whose data_ptr was seen, ``save_file``,
                    then ``load_file`` the whole file to print a count
  torch.save        upstream DeepSpeed-Chat's ``torch.save(state_dict, "pytorch_model.bin")``
  raw write         the same number of bytes as dsfix clone's file, from a preallocated buffer
                    (the disk's limit)

Each run is its own subprocess (so "peak RSS above model" is per method: ru_maxrss
after building the model vs at the end). Every written file and its folder is
fsynced inside the timed region in every case, so all methods pay the same
durability cost: the page cache absorbs the writes and fsync waits for the disk.
Methods alternate round-robin across repeats; the tables show medians.

Part 2 times verification alone (dsfix's header-only check vs the article's full
reload) and ``python -m patcher check`` as a whole process, and shows whether the
patch path imports torch.

On CUDA (when present) the same table runs with the model on the GPU, with peak
GPU memory per method, plus dsfix's ZeRO-3 gather path on one rank when DeepSpeed
is installed.

    python benchmarks/bench_save.py                 # full Qwen3-0.6B, CPU (+ CUDA if present), 3 repeats
    python benchmarks/bench_save.py --quick         # narrow 28-layer Qwen3, 1 repeat (smoke test)
    python benchmarks/bench_save.py --device cpu --repeats 5 --json results.json
"""
import argparse
import gc
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE_PATH = os.path.join(REPO_ROOT, "templates", "save_safetensors.py")
FULL_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-0.6b", "config.json")
NARROW_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-narrow", "config.json")
CHECKOUT = os.path.join(REPO_ROOT, "fixtures", "checkouts", "package")

MIB = 1024.0 * 1024.0
CHILD_TIMEOUT_S = 1800

# (key, label) in table order.
METHODS = (
    ("dsfix_clone", "dsfix clone"),
    ("dsfix_dedupe", "dsfix dedupe"),
    ("transformers", "transformers save_pretrained"),
    ("save_model", "safetensors save_model"),
    ("article", "article (clone+save_file+load_file)"),
    ("torch_save", "upstream torch.save (.bin)"),
    ("raw", "raw write (disk limit)"),
)
ZERO3 = ("zero3", "dsfix ZeRO-3 gather (1 rank)")
LABELS = dict(METHODS + (ZERO3,))

# Goals: (label, numerator, denominator, goal, aim)
RATIO_GOALS = (
    ("dsfix clone / article", "dsfix_clone", "article", 1.0, None),
    ("dsfix clone / transformers", "dsfix_clone", "transformers", 1.3, None),
    ("dsfix dedupe / transformers", "dsfix_dedupe", "transformers", 1.0, None),
    ("dsfix clone / raw write", "dsfix_clone", "raw", 1.5, 1.15),
)
RSS_GOAL_FACTOR = 1.1
VERIFY_GOAL_MS = 50.0
CHECK_GOAL_S = 0.5


# --------------------------------------------------------------------------------------------
# Child side: one method, one process.
# --------------------------------------------------------------------------------------------

def _maxrss_mib():
    # Linux reports KiB, macOS bytes.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (MIB if sys.platform == "darwin" else 1024.0)


def _vmrss_mib():
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _load_template():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dsfix_bench_template", TEMPLATE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fsync_path(path, directory=False):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if directory:
            return  # e.g. Windows cannot open folders
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _fsync_tree(root):
    """fsync every file under ``root``, then every folder (deepest first)."""
    folders = []
    for here, _, files in os.walk(root):
        folders.append(here)
        for name in files:
            _fsync_path(os.path.join(here, name))
    for here in reversed(folders):
        _fsync_path(here, directory=True)


def build_model(config_path, device, seed=0):
    """Real Qwen3ForCausalLM architecture, bf16, tied embeddings, built fast.

    Constructed on the meta device, materialised with ``to_empty`` (no init),
    re-tied, then filled from one random block (memory-bandwidth bound, not RNG
    bound). The rotary buffers are rebuilt so the module is usable.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model = model.to(torch.bfloat16)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty makes a new Parameter per module: tie them again
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is not None:
        try:
            inner.rotary_emb = type(rotary)(config=config, device=device)
        except TypeError:
            inner.rotary_emb = type(rotary)(config=config).to(device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    block_len, jitter = 1 << 22, 4093
    block = (torch.randn(block_len + jitter, generator=generator) * 0.02).to(torch.bfloat16).to(device)
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):  # the tied one once
            flat = param.data.view(-1)
            start = (i * 7919) % jitter
            for offset in range(0, flat.numel(), block_len):
                n = min(block_len, flat.numel() - offset)
                flat[offset:offset + n].copy_(block[start:start + n])
    del block
    model.eval()
    if getattr(config, "tie_word_embeddings", False):
        tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        if not tied:
            raise RuntimeError("the model is not tied after building it")
    if device != "cpu":
        torch.cuda.synchronize()
    return model


def article_save(model, tokenizer, output_dir):
    """The widely copied fix, as published: clone repeated data_ptrs, save_file, reload to count."""
    from safetensors.torch import load_file, save_file

    os.makedirs(output_dir, exist_ok=True)
    state_dict = model.state_dict()
    seen, to_save = set(), {}
    for name, tensor in state_dict.items():
        if tensor.data_ptr() in seen:
            to_save[name] = tensor.clone()
        else:
            seen.add(tensor.data_ptr())
            to_save[name] = tensor
    path = os.path.join(output_dir, "model.safetensors")
    save_file(to_save, path, metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    loaded = load_file(path)
    print("loaded %d tensors" % len(loaded))
    return len(loaded)


def upstream_save_hf_format(model, tokenizer, output_dir):
    """Upstream DeepSpeed-Chat's save_hf_format: torch.save of the state dict, config.json."""
    import torch

    os.makedirs(output_dir, exist_ok=True)
    model_to_save = model.module if hasattr(model, "module") else model
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))
    if tokenizer is not None:
        tokenizer.save_vocabulary(output_dir)


def _clone_file_bytes(template, model):
    """The size of dsfix clone's model.safetensors (header + data), from its own plan."""
    entries, _ = template._dsfix_plan(template._dsfix_unwrap(model), "clone", False)
    layout = template._dsfix_layout(entries, 1 << 62)
    return sum(len(header) + data for _, header, _, data in layout)


def _warm_page_cache(folder, nbytes):
    """Writes, fsyncs and deletes a scratch file of ``nbytes`` in ``folder`` (not timed).

    On a VM the first large write of a fresh process can pay seconds of
    page-cache allocation (the guest getting memory back from the host) that
    has nothing to do with the method or the disk. Writing the same amount just
    before the timed region leaves the page cache in the steady state every
    method then shares. The source is an 8 MiB buffer, so the RSS baseline
    barely moves.
    """
    chunk = bytes(8 << 20)
    fd, path = tempfile.mkstemp(prefix="warm-", dir=folder)
    try:
        with os.fdopen(fd, "wb", buffering=0) as handle:
            for _ in range(nbytes // len(chunk) + 1):
                handle.write(chunk)
            os.fsync(handle.fileno())
    finally:
        os.remove(path)


def _count_tensors(out_dir):
    """{file name: tensor count} for the weight files in ``out_dir``."""
    counts = {}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                counts[name] = len(list(handle.keys()))
        elif name.endswith(".bin") and name.startswith("pytorch_model"):
            import torch

            counts[name] = len(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return counts


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _zero3_engine(model, device):
    """A one-rank DeepSpeed ZeRO-3 engine around ``model`` (no optimizer: nothing to train)."""
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine


def child_main(args):
    import torch

    result = {"method": args.child, "device": args.device, "config": os.path.basename(os.path.dirname(args.config))}
    cuda = args.device == "cuda"
    template = _load_template()
    started = time.perf_counter()
    model = build_model(args.config, args.device)
    result["build_s"] = time.perf_counter() - started
    tied = model.get_input_embeddings().weight
    result["tied_bytes"] = tied.numel() * tied.element_size()
    result["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out = args.out
    os.makedirs(out, exist_ok=True)

    if args.child == "verify":
        return _child_verify(args, template, model, result)

    buf = None
    target = model
    size = _clone_file_bytes(template, model)
    if args.child == "raw":
        buf = bytearray(size)
        torch.frombuffer(buf, dtype=torch.uint8).fill_(0x5A)  # touch every page before the baseline
    elif args.child == "zero3":
        target = _zero3_engine(model, args.device)
    if args.warmup:
        _warm_page_cache(os.path.dirname(os.path.abspath(out)), size)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_base = torch.cuda.memory_allocated()
    result["rss_build_mib"] = _maxrss_mib()
    result["vmrss_build_mib"] = _vmrss_mib()

    started = time.perf_counter()
    if args.child == "dsfix_clone":
        template.save_hf_format_safetensors(target, None, argparse.Namespace(output_dir=out), strategy="clone")
    elif args.child == "dsfix_dedupe":
        template.save_hf_format_safetensors(target, None, argparse.Namespace(output_dir=out), strategy="dedupe")
    elif args.child == "transformers":
        target.save_pretrained(out, safe_serialization=True)
    elif args.child == "save_model":
        from safetensors.torch import save_model

        save_model(target, os.path.join(out, "model.safetensors"))
    elif args.child == "article":
        article_save(target, None, out)
    elif args.child == "torch_save":
        upstream_save_hf_format(target, None, out)
    elif args.child == "raw":
        view, chunk = memoryview(buf), 64 << 20
        with open(os.path.join(out, "raw.bin"), "wb", buffering=0) as handle:
            for offset in range(0, len(buf), chunk):
                handle.write(view[offset:offset + chunk])
        view.release()
    elif args.child == "zero3":
        template.save_zero_three_model_safetensors(target, 0, out, zero_stage=3)
    else:
        raise SystemExit("unknown method %r" % (args.child,))
    if cuda:
        torch.cuda.synchronize()
    _fsync_tree(out)  # the same durability for every method (files already fsynced cost ~nothing)
    result["wall_s"] = time.perf_counter() - started

    result["rss_end_mib"] = _maxrss_mib()
    result["rss_above_mib"] = max(0.0, result["rss_end_mib"] - result["rss_build_mib"])
    if cuda:
        result["gpu_peak_above_mib"] = (torch.cuda.max_memory_allocated() - gpu_base) / MIB
    files = {}
    for here, _, names in os.walk(out):
        for name in names:
            path = os.path.join(here, name)
            files[os.path.relpath(path, out)] = os.path.getsize(path)
    result["files"] = files
    result["bytes_written"] = sum(files.values())
    result["tensors_by_file"] = _count_tensors(out)
    result["tensors"] = sum(result["tensors_by_file"].values()) if result["tensors_by_file"] else None
    with open(args.result, "w") as handle:
        json.dump(result, handle)
    if args.child == "zero3":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _child_verify(args, template, model, result):
    """Part 2: header-only verification vs the article's full reload, on one saved file."""
    from safetensors.torch import load_file

    out = args.out
    template.save_hf_format_safetensors(model, None, argparse.Namespace(output_dir=out), strategy="clone")
    entries, _ = template._dsfix_plan(template._dsfix_unwrap(model), "clone", False)
    expected = template._dsfix_expected(entries)
    del entries
    path = os.path.join(out, "model.safetensors")
    header_s, reload_s, full_s, counts = [], [], [], set()
    for _ in range(args.verify_runs):  # alternate the two
        started = time.perf_counter()
        counts.add(("header", template._dsfix_verify_dir(out, expected)))
        header_s.append(time.perf_counter() - started)
        gc.collect()
        started = time.perf_counter()
        loaded = load_file(path)
        counts.add(("reload", len(loaded)))
        reload_s.append(time.perf_counter() - started)
        del loaded
        gc.collect()
        started = time.perf_counter()  # safetensors >= 0.8 maps lazily: read every byte too
        loaded = load_file(path)
        copies = [tensor.clone() for tensor in loaded.values()]
        full_s.append(time.perf_counter() - started)
        del loaded, copies
        gc.collect()
    result.update({
        "header_ms": [s * 1000 for s in header_s],
        "reload_ms": [s * 1000 for s in reload_s],
        "materialise_ms": [s * 1000 for s in full_s],
        "counts": sorted(counts),
        "file_bytes": os.path.getsize(path),
    })
    with open(args.result, "w") as handle:
        json.dump(result, handle)
    return 0


def child_probe(args):
    info = {}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = bool(torch.cuda.is_available())
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # pragma: no cover - torch missing or broken
        info["error"] = repr(exc)
    with open(args.result, "w") as handle:
        json.dump(info, handle)
    return 0


# --------------------------------------------------------------------------------------------
# Parent side: orchestration, machine facts, tables.
# --------------------------------------------------------------------------------------------

def _child_env(device):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    for name in ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS"):
        env.pop(name, None)
    return env


def run_child(method, device, config, work, extra=(), verbose=False, warmup=True):
    """Runs one method in a fresh process; returns its result dict (``error`` set on failure)."""
    out = tempfile.mkdtemp(prefix="out-", dir=work)
    fd, result_path = tempfile.mkstemp(prefix="result-", suffix=".json", dir=work)
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--device", device,
           "--config", config, "--out", out, "--result", result_path] + list(extra)
    if not warmup:
        cmd.append("--no-warmup")
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_child_env(device), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=CHILD_TIMEOUT_S)
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = (exc.stdout or "") if isinstance(exc.stdout, str) else "", "timeout"
    result = None
    if rc == 0:
        try:
            with open(result_path) as handle:
                result = json.load(handle)
        except (OSError, ValueError):
            result = None
    if result is None:
        result = {"method": method, "device": device, "error": "exit %s" % (rc,), "output_tail": output[-3000:]}
        _log("  %s on %s FAILED (exit %s):\n%s" % (method, device, rc, output[-3000:]))
    elif verbose:
        _log(output.rstrip())
    shutil.rmtree(out, ignore_errors=True)
    try:
        os.remove(result_path)
    except OSError:
        pass
    return result


def _log(message):
    print(message, file=sys.stderr, flush=True)


def machine_facts(work):
    facts = {"python": platform.python_version(), "platform": platform.platform()}
    cpu = None
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    facts["cpu"] = cpu or platform.processor() or "unknown"
    facts["cores"] = os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        facts["cores_usable"] = len(os.sched_getaffinity(0))
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    facts["ram_gib"] = int(line.split()[1]) / (1024.0 * 1024.0)
    except OSError:
        pass
    usage = shutil.disk_usage(work)
    facts["disk_free_gib"] = usage.free / 1024.0 ** 3
    facts["disk_fs"] = _filesystem_of(work)
    from importlib import metadata

    for dist in ("torch", "transformers", "safetensors", "deepspeed"):
        try:
            facts[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            facts[dist] = None
    return facts


def _filesystem_of(path):
    """(mount point, fs type, device) of the mount holding ``path`` (Linux), else None."""
    try:
        best = None
        real = os.path.realpath(path)
        with open("/proc/mounts") as handle:
            for line in handle:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1]
                if real == mount or real.startswith(mount.rstrip("/") + "/"):
                    if best is None or len(mount) > len(best[0]):
                        best = (mount, parts[2], parts[0])
        return best and "%s on %s" % (best[1], best[2])
    except OSError:
        return None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(results):
    """{method: summary} with medians over the successful runs."""
    by_method = {}
    for res in results:
        by_method.setdefault(res["method"], []).append(res)
    summary = {}
    for method, runs in by_method.items():
        ok = [r for r in runs if "error" not in r]
        item = {"runs": len(runs), "failed": len(runs) - len(ok)}
        if ok:
            item["wall_s"] = _median([r["wall_s"] for r in ok])
            item["best_s"] = min(r["wall_s"] for r in ok)
            item["rss_above_mib"] = _median([r["rss_above_mib"] for r in ok])
            item["written_mib"] = _median([r["bytes_written"] / MIB for r in ok])
            item["throughput_mib_s"] = _median([r["bytes_written"] / MIB / r["wall_s"] for r in ok])
            item["gpu_peak_above_mib"] = _median([r.get("gpu_peak_above_mib") for r in ok])
            item["tensors"] = ok[-1]["tensors"]
            item["tensors_by_file"] = ok[-1]["tensors_by_file"]
            item["tied_mib"] = ok[-1]["tied_bytes"] / MIB
            item["model_mib"] = ok[-1]["model_bytes"] / MIB
            item["build_s"] = _median([r["build_s"] for r in ok])
            item["walls"] = [r["wall_s"] for r in ok]
        summary[method] = item
    return summary


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(summary, methods, cuda):
    cols = ["method", "wall s", "best s", "MiB/s", "written MiB", "peak RSS above model MiB"]
    if cuda:
        cols.append("peak GPU above model MiB")
    cols.append("tensors")
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
    for key in methods:
        item = summary.get(key)
        if item is None:
            continue
        label = LABELS[key]
        if "wall_s" not in item:
            lines.append("| %s | failed |%s" % (label, " |" * (len(cols) - 1)))
            continue
        row = [label, _fmt(item["wall_s"], ".2f"), _fmt(item["best_s"], ".2f"), _fmt(item["throughput_mib_s"], ".0f"),
               _fmt(item["written_mib"], ".1f"), _fmt(item["rss_above_mib"], ".0f")]
        if cuda:
            row.append(_fmt(item["gpu_peak_above_mib"], ".0f"))
        row.append("-" if item["tensors"] is None else str(item["tensors"]))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ratios(summary):
    """[(text, pass?)] for the goals."""
    out = []
    for label, num, den, goal, aim in RATIO_GOALS:
        a, b = summary.get(num, {}).get("wall_s"), summary.get(den, {}).get("wall_s")
        if a is None or b is None or b == 0:
            out.append(("%s: n/a (goal <= %.2f)" % (label, goal), None))
            continue
        value = a / b
        aim_text = ", aim <= %.2f" % aim if aim else ""
        best = summary[num]["best_s"] / summary[den]["best_s"] if summary[den]["best_s"] else float("nan")
        out.append(("%s = %.2f (best-of %.2f; goal <= %.2f%s)" % (label, value, best, goal, aim_text), value <= goal))
    clone = summary.get("dsfix_clone", {})
    if clone.get("rss_above_mib") is not None:
        limit = RSS_GOAL_FACTOR * clone["tied_mib"]
        out.append(("peak RSS above model, dsfix clone = %.0f MiB (goal <= %.1f x tied %.0f MiB = %.0f MiB)" % (
            clone["rss_above_mib"], RSS_GOAL_FACTOR, clone["tied_mib"], limit), clone["rss_above_mib"] <= limit))
    return out


def time_dsfix_check(work, runs):
    """Wall time of ``python -m patcher check DIR`` (a fresh copy of the package fixture) and its imports."""
    checkout = os.path.join(tempfile.mkdtemp(prefix="checkout-", dir=work), "package")
    shutil.copytree(CHECKOUT, checkout)
    env = _child_env("cpu")
    walls, codes = [], set()
    cmd = [sys.executable, "-m", "patcher", "check", checkout]
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        walls.append(time.perf_counter() - started)
        codes.add(proc.returncode)
    probe = (
        "import sys, json\n"
        "from patcher.cli import main\n"
        "try:\n"
        "    main(['check', sys.argv[1]])\n"
        "    code = 0\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "heavy = ('torch', 'transformers', 'safetensors', 'deepspeed', 'numpy')\n"
        "heavy = sorted(m for m in heavy if m in sys.modules)\n"
        "print('DSFIX_BENCH=' + json.dumps({'rc': code, 'torch': 'torch' in sys.modules, 'heavy': heavy,\n"
        "                                   'modules': len(sys.modules)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe, checkout], cwd=REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    imports = None
    for line in proc.stdout.splitlines():
        if line.startswith("DSFIX_BENCH="):
            imports = json.loads(line[len("DSFIX_BENCH="):])
    shutil.rmtree(os.path.dirname(checkout), ignore_errors=True)
    return {"walls_s": walls, "median_s": _median(walls), "exit_codes": sorted(codes), "imports": imports,
            "command": "python -m patcher check DIR"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="narrow 28-layer Qwen3 (fixtures/models/qwen3-narrow), 1 repeat: a smoke test")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the CPU, and CUDA too when present (default)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds over all methods (default 3, --quick 1)")
    parser.add_argument("--config", default=None, help="a Qwen3 config.json (default: Qwen3-0.6B; --quick: narrow)")
    parser.add_argument("--verify-runs", type=int, default=None, help="part 2 timing runs (default 7, --quick 3)")
    parser.add_argument("--check-runs", type=int, default=None, help="dsfix check runs (default 7, --quick 2)")
    parser.add_argument("--zero3", choices=("auto", "on", "off"), default="auto",
                        help="dsfix's ZeRO-3 gather on one rank (auto: on CUDA when deepspeed is installed)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of: " + ",".join(k for k, _ in METHODS))
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the untimed scratch write before each timed run (see _warm_page_cache)")
    parser.add_argument("--tmpdir", default=None, help="where to write (default: the system temp folder)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write every result to this JSON file")
    parser.add_argument("--verbose", action="store_true", help="show each child's output")
    # internal: one method in this process
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.config is None:
        args.config = NARROW_CONFIG if args.quick else FULL_CONFIG
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.verify_runs is None:
        args.verify_runs = 3 if args.quick else 7
    if args.check_runs is None:
        args.check_runs = 2 if args.quick else 7
    return args


def _devices(args, work):
    if args.device == "cpu":
        return ["cpu"], None
    probe = run_child("probe", "cuda", args.config, work)
    has_cuda = bool(probe.get("cuda"))
    if args.device == "cuda":
        if not has_cuda:
            raise SystemExit("bench_save: --device cuda but torch sees no CUDA device")
        return ["cuda"], probe
    return (["cpu", "cuda"] if has_cuda else ["cpu"]), probe


def _deepspeed_installed():
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def main(argv=None):
    args = parse_args(argv)
    if args.child == "probe":
        return child_probe(args)
    if args.child is not None:
        return child_main(args)

    methods = [k for k, _ in METHODS]
    if args.methods:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in LABELS]
        if unknown:
            raise SystemExit("bench_save: unknown method(s): %s" % ", ".join(unknown))
    work = tempfile.mkdtemp(prefix="dsfix-bench-", dir=args.tmpdir)
    report = {"command": " ".join(["python", "benchmarks/bench_save.py"] + (sys.argv[1:] if argv is None else argv)),
              "config": os.path.relpath(args.config, REPO_ROOT) if args.config.startswith(REPO_ROOT) else args.config,
              "repeats": args.repeats, "warmup": args.warmup, "devices": {}}
    try:
        report["machine"] = machine_facts(work)
        devices, probe = _devices(args, work)
        if probe:
            report["machine"]["gpu"] = probe.get("gpu")
        notes = []
        for device in devices:
            device_methods = list(methods)
            want_zero3 = args.zero3 == "on" or (args.zero3 == "auto" and device == "cuda")
            if want_zero3:
                if _deepspeed_installed():
                    device_methods.append(ZERO3[0])
                else:
                    notes.append("ZeRO-3 gather on %s skipped: deepspeed is not installed" % device)
            results = []
            for repeat in range(args.repeats):
                shift = repeat % len(device_methods)
                order = device_methods[shift:] + device_methods[:shift]  # round-robin: rotate each round
                for method in order:
                    _log("[bench] %s, round %d/%d: %s" % (device, repeat + 1, args.repeats, method))
                    results.append(run_child(method, device, args.config, work, verbose=args.verbose,
                                              warmup=args.warmup))
            summary = summarise(results)
            report["devices"][device] = {"results": results, "summary": summary,
                                         "ratios": [[t, ok] for t, ok in ratios(summary)],
                                         "methods": device_methods}
        _log("[bench] part 2: verification and dsfix check")
        verify = run_child("verify", "cpu", args.config, work, extra=["--verify-runs", str(args.verify_runs)],
                           verbose=args.verbose)
        report["verify"] = verify
        report["check"] = time_dsfix_check(work, args.check_runs)
        report["notes"] = notes
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_report(report)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(report, handle, indent=2, sort_keys=True)
    failed = any(r.get("error") for d in report["devices"].values() for r in d["results"])
    failed = failed or bool(report["verify"].get("error"))
    return 1 if failed else 0


def _mark(ok):
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def print_report(report):
    m = report["machine"]
    print("## dsfix save benchmark")
    print()
    print("- command: `%s`" % report["command"])
    print("- model: %s, random bf16 weights, tied embeddings; %d round(s), methods alternated; medians"
          % (report["config"], report["repeats"]))
    print("- machine: %s; %s cores (%s usable); %.1f GiB RAM; disk %s, %.0f GiB free"
          % (m["cpu"], m["cores"], m.get("cores_usable", "?"), m.get("ram_gib", 0.0), m.get("disk_fs") or "?",
             m["disk_free_gib"]))
    print("- software: Python %s, torch %s, transformers %s, safetensors %s, deepspeed %s%s"
          % (m["python"], m["torch"], m["transformers"], m["safetensors"], m["deepspeed"] or "-",
             ("; GPU %s" % m["gpu"]) if m.get("gpu") else ""))
    print("- wall s: median, best s: minimum; MiB/s: written MiB / wall; peak RSS above model: ru_maxrss at the "
          "end minus after building (each method in its own process)")
    print("- every file and folder fsynced inside the timed region for every method: writes land in the page "
          "cache and fsync waits for the disk, the raw write included%s"
          % ("; an untimed scratch write of the same size precedes each run so all meet a warm page cache"
             if report.get("warmup") else ""))
    for device, data in report["devices"].items():
        summary = data["summary"]
        print()
        print("### %s" % ("CUDA (model on the GPU)" if device == "cuda" else "CPU"))
        print()
        any_item = next((s for s in summary.values() if "model_mib" in s), None)
        if any_item:
            print("model %.0f MiB in memory, tied tensor %.1f MiB; build %.1f s (not timed)"
                  % (any_item["model_mib"], any_item["tied_mib"], any_item["build_s"]))
            print()
        print(table(summary, data["methods"], device == "cuda"))
        print()
        for text, ok in data["ratios"]:
            print("- %s" % text if ok is None else "- %s: %s" % (text, _mark(ok)))
        failed = [LABELS[k] for k, s in summary.items() if s.get("failed")]
        if failed:
            print("- FAILED runs: %s (see stderr)" % ", ".join(failed))
    print()
    print("### Verification and the patch path")
    print()
    verify, check = report["verify"], report["check"]
    print("| check | median | goal | |")
    print("|---|---:|---:|---|")
    if "error" in verify:
        print("| verification | failed | | |")
    else:
        header = _median(verify["header_ms"])
        reload_ms = _median(verify["reload_ms"])
        print("| dsfix header-only verify (`_dsfix_verify_dir`, %d runs) | %.1f ms | <= %.0f ms | %s |"
              % (len(verify["header_ms"]), header, VERIFY_GOAL_MS, _mark(header <= VERIFY_GOAL_MS)))
        print("| article full reload (`load_file` + len, %d runs) | %.1f ms | | %.1fx the header check |"
              % (len(verify["reload_ms"]), reload_ms, reload_ms / header if header else float("nan")))
        full = _median(verify["materialise_ms"])
        print("| `load_file` + read every tensor (clone) | %.1f ms | | %.0fx the header check |"
              % (full, full / header if header else float("nan")))
    wall = check["median_s"]
    print("| `%s` whole process (%d runs, exit %s) | %.2f s | <= %.1f s | %s |"
          % (check["command"], len(check["walls_s"]), "/".join(str(c) for c in check["exit_codes"]), wall,
             CHECK_GOAL_S, _mark(wall <= CHECK_GOAL_S and check["exit_codes"] == [1])))
    print()
    imports = check.get("imports")
    if imports is None:
        print("- patch path imports: could not be determined")
    else:
        print("- `dsfix check` imports torch: %s (heavy modules loaded: %s; %d modules in all; exit %s)"
              % ("yes" if imports["torch"] else "no", ", ".join(imports["heavy"]) or "none",
                 imports["modules"], imports["rc"]))
    if "error" not in verify:
        print("- verification reads the file just written (page cache); safetensors %s `load_file` maps the file "
              "lazily, so the count alone reads little; reading the tensors costs the third row, plus a disk "
              "read of %.0f MiB on a cold cache, while the header check reads a few KiB"
              % (report["machine"].get("safetensors"), verify["file_bytes"] / MIB))
    for note in report.get("notes", []):
        print("- note: %s" % note)


if __name__ == "__main__":
    sys.exit(main())
