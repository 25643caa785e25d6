"""What both benchmarks share: the model, the save functions under test, fsync, peak memory, machine facts."""
import importlib.util
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-0.6b", "config.json")
NARROW_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-narrow", "config.json")
MIB = 1024.0 * 1024.0


def load_file_module(*parts):
    """A module loaded from a file under the repository (the save module, a fixture), as a user's utils.py
    imports the save module `dsfix apply` puts beside it: from its file, not as part of dsfix."""
    path = os.path.join(REPO_ROOT, *parts)
    spec = importlib.util.spec_from_file_location("bench_" + os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_module():
    return load_file_module("templates", "dsfix_safetensors.py")


def article_save():
    """The widely copied fix (fixtures/broken/article_utils.py): save_hf_format_safetensors(model, tokenizer, args)."""
    return load_file_module("fixtures", "broken", "article_utils.py").save_hf_format_safetensors


class NoTokenizer:
    """Stands in for a tokenizer: the article's function always saves one; here nothing is written."""

    def save_pretrained(self, out_dir):
        return ()


def build_model(config_path, device="cpu", seed=0):
    """Qwen3ForCausalLM from ``config_path`` in bf16 with tied embeddings and random weights, built fast:
    on the meta device, materialised without init, re-tied, then filled from one seeded random block."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if REPO_ROOT not in sys.path:  # run as a script: dsfix from this checkout
        sys.path.insert(0, REPO_ROOT)
    from patcher.checkpoint.check.load import dtype_kwarg

    config = AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **{dtype_kwarg(): torch.bfloat16})
    model = model.to(torch.bfloat16).to_empty(device=device)
    model.tie_weights()  # to_empty makes a new Parameter per module
    inner = getattr(model, "model", None)
    if getattr(inner, "rotary_emb", None) is not None:  # its buffers were left empty
        try:
            inner.rotary_emb = type(inner.rotary_emb)(config=config, device=device)
        except TypeError:  # transformers 5.2x: no device parameter; built on the CPU, then moved
            inner.rotary_emb = type(inner.rotary_emb)(config=config).to(device)
    generator = torch.Generator().manual_seed(seed)
    block_len, jitter = 1 << 22, 4093
    block = (torch.randn(block_len + jitter, generator=generator) * 0.02).to(torch.bfloat16).to(device)
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):  # the tied one once
            flat, start = param.data.view(-1), (i * 7919) % jitter
            for offset in range(0, flat.numel(), block_len):
                n = min(block_len, flat.numel() - offset)
                flat[offset:offset + n].copy_(block[start:start + n])
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("the model is not tied after building it")
    return model.eval()


def fsync_tree(root):
    """fsyncs every file under ``root``, then every folder: the same durability for every method."""
    for here, _, names in os.walk(root, topdown=False):
        for path in [os.path.join(here, n) for n in names] + [here]:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def written(root):
    """{relative path: bytes} under ``root``."""
    return {os.path.relpath(os.path.join(h, n), root): os.path.getsize(os.path.join(h, n))
            for h, _, names in os.walk(root) for n in names}


def tensor_count(root):
    """Tensors in the weight files under ``root`` (safetensors headers, or torch.load of .bin files)."""
    import torch
    from safetensors import safe_open

    count = 0
    for name in written(root):
        path = os.path.join(root, name)
        if name.endswith(".safetensors"):
            with safe_open(path, framework="pt") as handle:
                count += len(list(handle.keys()))
        elif name.endswith(".bin"):
            count += len(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return count


def warm_page_cache(folder, nbytes):
    """Writes, fsyncs and deletes ``nbytes`` of scratch (untimed), so every method meets a warm page cache."""
    chunk = bytes(8 << 20)
    fd, path = tempfile.mkstemp(prefix="warm-", dir=folder)
    try:
        with os.fdopen(fd, "wb", buffering=0) as handle:
            for _ in range(nbytes // len(chunk) + 1):
                handle.write(chunk)
            os.fsync(handle.fileno())
    finally:
        os.remove(path)


def _status(field):
    with open("/proc/self/status") as handle:
        return int(re.search(r"^%s:\s+(\d+) kB" % field, handle.read(), re.M).group(1)) * 1024


def reset_peak():
    """Returns freed heap memory to the system (so that what an earlier method freed cannot hide what the next
    one allocates), resets this process's peak RSS (Linux clear_refs 5) and returns the RSS now; None where
    the peak cannot be reset (a sandboxed kernel without clear_refs): no peak is reported then."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return None
    return _status("VmRSS")


def peak_since(rss_before):
    """Peak RSS since reset_peak(), above what it returned, in bytes; None when reset_peak could not reset it."""
    return None if rss_before is None else max(0, _status("VmHWM") - rss_before)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def machine_facts(work):
    from importlib import metadata

    cpu = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        found = re.search(r"^model name\s*:\s*(.+)$", open("/proc/cpuinfo").read(), re.M)
        cpu = found.group(1).strip() if found else cpu
    ram = (re.search(r"^MemTotal:\s+(\d+)", open("/proc/meminfo").read(), re.M) if os.path.exists("/proc/meminfo")
           else None)
    versions = {}
    for dist in ("torch", "transformers", "safetensors", "deepspeed"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "-"
    return ("%s; %s cores (%d usable); %.1f GiB RAM; %.0f GiB free where it writes; Python %s, %s"
            % (cpu, os.cpu_count(), len(os.sched_getaffinity(0)), int(ram.group(1)) / 1024.0**2 if ram else 0,
               shutil.disk_usage(work).free / 1024.0**3, platform.python_version(),
               ", ".join("%s %s" % kv for kv in versions.items())))


def table(header, rows):
    """A markdown table; numbers right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)
