"""dsfix's save module (a development stand-in, built from the v3 block)."""
import ctypes
import json
import os
from typing import NamedTuple

import torch
from safetensors import safe_open

# Added by dsfix (for Python 3.9+, torch 2.1+, transformers 4.51+, safetensors 0.4.3+, DeepSpeed 0.15.4+);
# `dsfix revert` removes it. save_hf_format_safetensors and save_zero_three_model_safetensors replace
# save_hf_format and save_zero_three_model: they write config.json, the tokenizer and model.safetensors
# (shards and an index above _DSFIX_MAX_SHARD_SIZE bytes), a tensor that shares storage with another
# (Qwen3's tied lm_head) in full, each at a multiple of its element size where safetensors puts it.
# Under ZeRO-3 every rank gathers whole modules up to _DSFIX_GATHER_BUCKET_MB at a time (0: one parameter
# at a time) and rank 0 writes them. Each file is written under a temporary name, checked, then renamed.
VERSION = 4
_DSFIX_STRATEGY = "clone"
_DSFIX_MAX_SHARD_SIZE = 5 * 1024**3
_DSFIX_GATHER_BUCKET_MB = 256
_DSFIX_TMP_SUFFIX = ".dsfix-tmp"
_DSFIX_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
                 torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3",
                 torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def save_hf_format_safetensors(model, tokenizer, args, sub_folder="", *, max_shard_size=None, strategy=None):
    """Like save_hf_format, with its parameters, but writes config.json, the tokenizer and model.safetensors."""
    output_dir = os.path.join(args.output_dir, sub_folder)
    _dsfix_save_hf_format(model, tokenizer, output_dir, max_shard_size=max_shard_size, strategy=strategy)


def save_zero_three_model_safetensors(model_ema, global_rank, save_dir, zero_stage=0, *, max_shard_size=None, strategy=None):
    """Like save_zero_three_model, with its parameters, but writes model.safetensors; call it on every rank."""
    _dsfix_save_zero_three_model(model_ema, save_dir, global_rank=global_rank, zero_stage=zero_stage, max_shard_size=max_shard_size, strategy=strategy)


class _DsfixTensor(NamedTuple):
    """A tensor to write: ``param``, a ZeRO-3 parameter gathered first, else ``tensor``, from state_dict()."""
    name: str
    tensor: object
    param: object
    shape: tuple  # as the model holds it (ds_shape under ZeRO-3)
    nbytes: int


class _DsfixFile(NamedTuple):
    """A file: the ``header``, then the tensors, each at ``offsets[name]`` after it; ``tmp`` until checked."""
    name: str
    tensors: list
    header: bytes
    offsets: dict
    tmp: str


def _dsfix_save_hf_format(model, tokenizer, output_dir, global_rank=None, max_shard_size=None, strategy=None,
                          gather_bucket_mb=None, drop=None):
    """config.json, the tokenizer and the weights (under ZeRO-3 only if every rank calls it with its ``global_rank``).
    ``drop(name)``: whether to leave a tensor out; None: upstream's rule, every name with "lora" in it."""
    module = _dsfix_unwrap(model)
    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    rank = global_rank or 0
    if rank == 0:
        _dsfix_save_config_and_tokenizer(module, tokenizer, output_dir)
    if partitioned and global_rank is None:
        _dsfix_print("ZeRO-3 parameters are partitioned: wrote config and tokenizer to %s; the weights are "
                     "written by save_zero_three_model_safetensors" % (os.path.normpath(output_dir),))
    elif partitioned or rank == 0:
        _dsfix_save_weights(module, output_dir, rank, partitioned, max_shard_size, strategy, gather_bucket_mb, drop)


def _dsfix_save_zero_three_model(model, save_dir, global_rank=None, zero_stage=3, tokenizer=None,
                                 max_shard_size=None, strategy=None, gather_bucket_mb=None, drop=None,
                                 with_config=False):
    """Every rank calls it: the weights (below stage 3 with no ``drop``, every key, as upstream), the tokenizer."""
    if global_rank is None:  # asks torch
        global_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    module = _dsfix_unwrap(model)
    if global_rank == 0:
        _dsfix_save_config_and_tokenizer(module if with_config else None, tokenizer, save_dir)
    if zero_stage == 3 or global_rank == 0:
        _dsfix_save_weights(module, save_dir, global_rank, zero_stage == 3, max_shard_size, strategy, gather_bucket_mb,
                            drop if drop is not None or zero_stage == 3 else (lambda name: False))


def _dsfix_save_weights(module, out_dir, rank, gather, max_shard_size, strategy, bucket_mb, drop):
    """Every rank walks the buckets, rank 0 writes, checks and renames the files; a failure leaves none."""
    strategy = strategy or _DSFIX_STRATEGY
    limit = _DSFIX_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    if strategy not in ("clone", "dedupe"):
        raise ValueError('dsfix: strategy must be "clone" or "dedupe", not %r' % (strategy,))
    if isinstance(limit, str) or int(limit) <= 0:
        raise ValueError("dsfix: max_shard_size must be a positive number of bytes, not %r" % (limit,))
    tensors, notes = _dsfix_plan(module, strategy, gather, drop)
    buckets = _dsfix_buckets(tensors, bucket_mb)
    files = _dsfix_files(tensors, int(limit), out_dir) if rank == 0 else []  # rank 0 writes them all
    try:
        error = _dsfix_stream(files, buckets)
        if error is not None:
            raise RuntimeError("dsfix: writing the weights to %s failed: %s" % (out_dir, error)) from error
        if rank == 0:
            _dsfix_publish(files, out_dir, tensors, notes)
    except BaseException:
        for f in files:
            if os.path.exists(f.tmp):
                os.remove(f.tmp)
        raise


def _dsfix_plan(module, strategy, gather, drop):
    """([_DsfixTensor], notes) in state_dict order, but a ZeRO-3 alias right after its parameter."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    tensors, notes, seen, spans = [], [], {}, {}
    for name, value in module.state_dict().items():
        dropped = "lora" in name if drop is None else drop(name)
        if dropped:
            continue
        source = params.get(name, buffers.get(name, value))
        partitioned = hasattr(source, "ds_shape")
        if partitioned:  # a ZeRO-3 alias is the same parameter object
            first = seen.setdefault(id(source), name)
            alias, exact = (first, True) if first != name else (None, False)
        else:
            alias, exact = _dsfix_find_alias(name, value, spans)
        if alias is not None and exact and strategy == "dedupe":
            notes.append("%s shares storage with %s: not written (transformers re-ties it on load)" % (name, alias))
            continue
        if alias is not None:
            notes.append("%s shares storage with %s%s: written as its own copy" % (
                name, alias, "" if exact else " (a different view)"))
        real_shape = tuple(int(d) for d in (source.ds_shape if partitioned else source.shape))
        shape = real_shape if gather and partitioned else tuple(int(d) for d in value.shape)
        if shape != real_shape:  # refused before a byte is written
            raise RuntimeError("dsfix: verification failed: %s is empty %s but the model holds %s (a ZeRO-3 "
                               "placeholder saved without gathering?)" % (name, list(shape), list(real_shape)))
        if value.dtype not in _DSFIX_DTYPES:
            raise ValueError("dsfix: safetensors cannot store dtype %s (%s)" % (value.dtype, name))
        param = source if gather and partitioned else None
        at = len(tensors)
        if param is not None and alias is not None:  # right after its parameter: gathered once for both
            at = 1 + max(i for i, t in enumerate(tensors) if t.param is param)
        tensors.insert(at, _DsfixTensor(name, value, param, shape, torch.Size(shape).numel() * value.element_size()))
    return tensors, notes


def _dsfix_find_alias(name, value, spans):
    """(the first earlier tensor ``value`` overlaps in storage, or None; whether it is the same view)."""
    if not value.numel() or value.device.type == "meta":
        return None, False
    storage, start = value.untyped_storage(), value.data_ptr()
    end = start + value.element_size() * (1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride())))
    view = (start, value.dtype, value.shape, value.stride())
    earlier = spans.setdefault((str(value.device), storage.data_ptr(), storage.nbytes()), [])
    alias, exact = None, False
    for other, other_start, other_end, other_view in earlier:
        if start < other_end and other_start < end and (alias is None or (not exact and view == other_view)):
            alias, exact = other, view == other_view
    earlier.append((name, start, end, view))
    return alias, exact


def _dsfix_buckets(tensors, bucket_mb):
    """The gathers: whole modules up to ``bucket_mb`` (a bigger module alone; 0: one parameter at a time)."""
    limit = _DSFIX_GATHER_BUCKET_MB * 1024**2 if bucket_mb is None else bucket_mb * 1024**2
    buckets, size, owner = [], 0, None
    for t in tensors:
        module = t.name.rpartition(".")[0]
        alias = bool(buckets) and t.param is not None and t.param is buckets[-1][-1].param
        full = limit <= 0 or (module != owner and size + t.nbytes > limit)
        if not buckets or (full and not alias):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size, owner = size + t.nbytes, module
    return buckets


def _dsfix_files(tensors, limit, out_dir):
    """Runs of tensors up to ``limit`` bytes, each in _DSFIX_DTYPES' order (safetensors'), then by name."""
    groups, size, files = [], 0, []
    for t in tensors:
        if not groups or size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    for i, group in enumerate(groups or [[]]):
        name = "model-%05d-of-%05d.safetensors" % (i + 1, len(groups)) if len(groups) > 1 else "model.safetensors"
        header, offsets, at = {"__metadata__": {"format": "pt"}}, {}, 0
        for t in sorted(group, key=lambda t: (list(_DSFIX_DTYPES).index(t.tensor.dtype), t.name)):
            header[t.name] = {"dtype": _DSFIX_DTYPES[t.tensor.dtype], "shape": list(t.shape),
                              "data_offsets": [at, at + t.nbytes]}
            offsets[t.name] = at
            at += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # so the data, too, starts at a multiple of 8
        tmp = os.path.join(out_dir, ".%s.%d%s" % (name, os.getpid(), _DSFIX_TMP_SUFFIX))
        files.append(_DsfixFile(name, group, len(text).to_bytes(8, "little") + text, offsets, tmp))
    return files


def _dsfix_stream(files, buckets):
    """Gathers each bucket on every rank and writes the ``files``' tensors in it; returns the first error."""
    home, errors = dict((t.name, f) for f in files for t in f.tensors), []  # each tensor's file; what failed

    def attempt(step, *args):  # after a failure the rest is skipped, but every bucket is still gathered
        try:
            if not errors:
                step(*args)
        except Exception as exc:
            errors.append(exc)

    def start(f):
        with open(f.tmp, "wb") as handle:
            handle.write(f.header)

    def write(bucket):
        for t in bucket:
            if t.name in home:
                attempt(_dsfix_write_tensor, home[t.name], t)

    for f in files:
        attempt(start, f)
    for bucket in buckets:
        _dsfix_gather(bucket, lambda: write(bucket))
    return errors[0] if errors else None


def _dsfix_gather(bucket, then):
    """Under ZeRO-3, gathers the bucket's partitioned parameters on every rank (a collective); then writes."""
    params = dict((id(t.param), t.param) for t in bucket if t.param is not None and
                  t.param.ds_status.name == "NOT_AVAILABLE")  # not those already whole
    if not params:
        return then()
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return then()


def _dsfix_write_tensor(f, entry):
    """Writes the tensor's bytes into its place in file ``f``, from memory (on the CPU; no numpy), checked first."""
    data = (entry.tensor if entry.param is None else entry.param.data).detach()
    if data.dtype != entry.tensor.dtype or tuple(data.shape) != entry.shape or data.device.type == "meta":
        raise RuntimeError("%s is %s %s on %s but the header says %s %s" % (
            entry.name, list(data.shape), data.dtype, data.device, list(entry.shape), entry.tensor.dtype))
    data = data.to("cpu").contiguous()  # held here while its bytes are written
    with open(f.tmp, "r+b") as handle:
        handle.seek(len(f.header) + f.offsets[entry.name])
        handle.write((ctypes.c_ubyte * entry.nbytes).from_address(data.data_ptr()))


def _dsfix_publish(files, out_dir, tensors, notes):
    """Rank 0: checks the files, renames them into place, the index last, and removes stale weight files."""
    for f in files:  # on disk; safetensors checks the file's length; the header must read back as written
        with safe_open(f.tmp, framework="pt"), open(f.tmp, "r+b") as handle:
            os.fsync(handle.fileno())
            if handle.read(len(f.header)) != f.header:
                raise RuntimeError("dsfix: verification failed: %s does not hold the header written" % (f.tmp,))
    for f in files:
        os.replace(f.tmp, os.path.join(out_dir, f.name))
    keep = [f.name for f in files]
    if len(files) > 1:  # written last, under a temporary name too
        keep.append("model.safetensors.index.json")
        tmp = os.path.join(out_dir, ".%s.%d%s" % (keep[-1], os.getpid(), _DSFIX_TMP_SUFFIX))
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                       "weight_map": dict((t.name, f.name) for f in files for t in f.tensors)}, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, os.path.join(out_dir, keep[-1]))
    _dsfix_remove_stale(out_dir, keep)
    for note in notes:
        _dsfix_print(note)
    empty = sum(1 for t in tensors if not t.nbytes)
    shards = " (%d shards)" % len(files) if len(files) > 1 else ""
    _dsfix_print("saved weights to %s%s" % (os.path.join(out_dir, keep[-1]), shards))
    _dsfix_print("verified %d tensors (names, shapes, dtypes; none empty%s)"
                 % (len(tensors), " but the %d the model holds empty" % empty if empty else ""))


def _dsfix_save_config_and_tokenizer(module, tokenizer, out_dir):
    """config.json (when ``module`` has a config) and the tokenizer (when given): no error of theirs stops the
    weights, which the other ZeRO-3 ranks wait for (save_vocabulary, upstream's own call, may still raise)."""
    os.makedirs(out_dir, exist_ok=True)
    try:
        if getattr(module, "config", None) is not None:
            module.config.to_json_file(os.path.join(out_dir, "config.json"))
    except Exception as exc:
        _dsfix_print("could not write config.json (%s: %s); saving the rest" % (type(exc).__name__, exc))
    try:
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    except Exception as exc:  # a tokenizer without save_pretrained, or an old one
        _dsfix_print("tokenizer.save_pretrained failed (%s: %s); using save_vocabulary" % (type(exc).__name__, exc))
        tokenizer.save_vocabulary(out_dir)


def _dsfix_remove_stale(out_dir, keep):
    """Removes the weight files not in ``keep``, and the temporary ones of a killed save, saying so."""
    for name in sorted(os.listdir(out_dir)):
        temporary = name.startswith(".") and name.endswith(_DSFIX_TMP_SUFFIX)
        base = name[1:].rsplit(".", 2)[0] if temporary else name  # a temporary name adds a process id
        single = base in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                          "pytorch_model.bin.index.json")
        shard = "-of-" in base and (base.startswith("model-") and base.endswith(".safetensors") or
                                    base.startswith("pytorch_model-") and base.endswith(".bin"))
        if name not in keep and (single or shard):
            os.remove(os.path.join(out_dir, name))
            _dsfix_print("removed stale %s" % (os.path.join(out_dir, name),))


def _dsfix_unwrap(model):
    """The module under DeepSpeed/DDP (``.module``) and torch.compile (``_orig_mod``) wrappers."""
    inner = getattr(model, "module", getattr(model, "_orig_mod", None))
    return _dsfix_unwrap(inner) if isinstance(inner, torch.nn.Module) else model


def _dsfix_print(message):
    print("[dsfix] " + message, flush=True)


def save_hf_format(model, tokenizer, output_dir, **kwargs):
    return _dsfix_save_hf_format(model, tokenizer, output_dir, **kwargs)


def save_zero_three_model(model, save_dir, **kwargs):
    return _dsfix_save_zero_three_model(model, save_dir, **kwargs)
