"""dsfix's save, inserted (all but this docstring) into DeepSpeed-Chat's utils.py after save_hf_format."""
import json
import os
import sys

import torch
from safetensors import safe_open

# Added by dsfix; `dsfix revert` removes it. save_hf_format_safetensors and
# save_zero_three_model_safetensors replace save_hf_format and save_zero_three_model: they write
# config.json, the tokenizer and model.safetensors (shards and an index above the shard size),
# with every tensor that shares storage with another (Qwen3's tied lm_head) written in full.
# Under ZeRO-3 all ranks gather the parameters bucket by bucket (DSFIX_GATHER_BUCKET_MB, default
# 256; 0 gathers one at a time) and rank 0 writes; with DSFIX_PARALLEL_WRITE=1 and several shards,
# every rank writes its own (the folder must be shared). Each file is written under a temporary
# name, fsynced, checked from its header and only then renamed.
_DSFIX_TEMPLATE_VERSION = 2
_DSFIX_STRATEGY = "clone"
_DSFIX_MAX_SHARD_SIZE = 5 * 1024**3
_DSFIX_GATHER_BUCKET_MB = 256
_DSFIX_TMP_SUFFIX = ".dsfix-tmp"
_DSFIX_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                 "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                 "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def save_hf_format_safetensors(model, tokenizer, args, sub_folder="", *, max_shard_size=None, strategy=None):
    """Like save_hf_format, with its parameters, but writes config.json, the tokenizer and model.safetensors."""
    output_dir = os.path.join(args.output_dir, sub_folder)
    _dsfix_save_hf_format(model, tokenizer, output_dir, max_shard_size=max_shard_size, strategy=strategy)


def save_zero_three_model_safetensors(model_ema, global_rank, save_dir, zero_stage=0, *, max_shard_size=None, strategy=None):
    """Like save_zero_three_model, with its parameters, but writes model.safetensors; call it on every rank."""
    _dsfix_save_zero_three_model(model_ema, save_dir, global_rank=global_rank, zero_stage=zero_stage, max_shard_size=max_shard_size, strategy=strategy)


def _dsfix_save_hf_format(model, tokenizer, output_dir, global_rank=None, max_shard_size=None, strategy=None,
                          gather_bucket_mb=None, parallel_write=None, keep_lora=False):
    """config.json, the tokenizer and the weights. ``global_rank`` None: rank 0 alone calls it (upstream's
    way), so under ZeRO-3, where gathering needs every rank, the ZeRO-3 function writes the weights.
    ``keep_lora``: also save LoRA weights (for a fork whose own save keeps them)."""
    module = _dsfix_unwrap(model)
    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    rank = global_rank or 0
    if rank == 0:
        _dsfix_save_config_and_tokenizer(module, tokenizer, output_dir)
    if partitioned and global_rank is None:
        _dsfix_print("ZeRO-3 parameters are partitioned: wrote config and tokenizer to %s; the weights are "
                     "written by save_zero_three_model_safetensors" % (os.path.normpath(output_dir),))
    elif partitioned or rank == 0:
        _dsfix_save_weights(module, output_dir, rank, partitioned, max_shard_size, strategy, gather_bucket_mb,
                            parallel_write, keep_lora)


def _dsfix_save_zero_three_model(model, save_dir, global_rank=None, zero_stage=3, tokenizer=None,
                                 max_shard_size=None, strategy=None, gather_bucket_mb=None, parallel_write=None,
                                 keep_lora=False, with_config=False):
    """The weights (and the tokenizer, when given; config.json with ``with_config``, for a fork whose own
    ZeRO-3 save writes it); every rank calls it. ``global_rank`` None: asks torch."""
    if global_rank is None:
        ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        global_rank = torch.distributed.get_rank() if ready else 0
    module = _dsfix_unwrap(model)
    if global_rank == 0:
        _dsfix_save_config_and_tokenizer(module if with_config else None, tokenizer, save_dir)
    if zero_stage == 3 or global_rank == 0:
        _dsfix_save_weights(module, save_dir, global_rank, zero_stage == 3, max_shard_size, strategy,
                            gather_bucket_mb, parallel_write, keep_lora)


def _dsfix_save_weights(module, out_dir, rank, gather, max_shard_size, strategy, bucket_mb, parallel, keep_lora=False):
    """Plans the files; every rank streams its tensors (all gathering under ZeRO-3); rank 0 checks the
    files, renames them into place and writes the index. A failure leaves no new weight file behind."""
    strategy = strategy or _DSFIX_STRATEGY
    limit = _DSFIX_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    if strategy not in ("clone", "dedupe"):
        raise ValueError('dsfix: strategy must be "clone" or "dedupe", not %r' % (strategy,))
    if isinstance(limit, str) or int(limit) <= 0:
        raise ValueError("dsfix: max_shard_size must be a positive number of bytes, not %r" % (limit,))
    if sys.byteorder != "little":
        raise RuntimeError("dsfix: safetensors files are little-endian; this machine is not")
    entries, notes = _dsfix_plan(module, strategy, gather, keep_lora)
    collective = any(e["param"] is not None for e in entries)  # ZeRO-3: every rank is here
    world = torch.distributed.get_world_size() if collective and torch.distributed.is_initialized() else 1
    bucket_mb = os.environ.get("DSFIX_GATHER_BUCKET_MB", _DSFIX_GATHER_BUCKET_MB) if bucket_mb is None else bucket_mb
    if parallel is None:
        parallel = os.environ.get("DSFIX_PARALLEL_WRITE", "0").lower() in ("1", "true", "yes")
    settings = [int(float(bucket_mb) * 1024**2), bool(parallel), os.getpid()]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        _dsfix_remove_weight_files(out_dir, None)  # temporary files of a killed earlier save
        for note in notes:
            _dsfix_print(note)
    if world > 1:  # rank 0's settings for all: every rank must make the same gathers and files
        torch.distributed.broadcast_object_list(settings, src=0)
    buckets, files = _dsfix_layout(entries, settings[0], int(limit), world if settings[1] else 1)
    parallel = any(f["rank"] for f in files)
    for f in files:
        f["tmp"] = os.path.join(out_dir, ".%s.%d%s" % (f["name"], settings[2], _DSFIX_TMP_SUFFIX))
    try:
        error = _dsfix_stream(files, buckets, rank, _dsfix_gather if collective else None)
        if parallel:  # every rank learns of every rank's write error, and all raise it
            errors = [None] * world
            torch.distributed.all_gather_object(errors, error and "rank %d: %s" % (rank, error))
            error = "; ".join(e for e in errors if e)
        if error:
            raise RuntimeError("dsfix: writing the weights to %s failed: %s" % (out_dir, error))
        if rank != 0:
            return None
        expected = dict((e["name"], (e["real_shape"], e["st_dtype"])) for e in entries)
        count = _dsfix_verify([(f["tmp"], f["name"]) for f in files], expected)
        for f in files:
            os.replace(f["tmp"], os.path.join(out_dir, f["name"]))
        index = os.path.join(out_dir, "model.safetensors.index.json")
        if len(files) > 1:  # written last: the shards are all in place when it appears
            data = {"metadata": {"total_size": sum(f["size"] for f in files)},
                    "weight_map": dict((e["name"], f["name"]) for f in files for e in f["entries"])}
            _dsfix_write_atomic(index, text=json.dumps(data, indent=2) + "\n")
        _dsfix_fsync(out_dir)
    except BaseException:
        for f in files:
            if f["rank"] == rank or rank == 0:
                _dsfix_remove(f["tmp"])
        raise
    for name in _dsfix_remove_weight_files(out_dir, [f["name"] for f in files] + [os.path.basename(index)] * (
            len(files) > 1)):
        _dsfix_print("removed stale %s" % (os.path.join(out_dir, name),))
    _dsfix_print("saved weights to %s" % (os.path.join(out_dir, files[0]["name"]) if len(files) == 1 else
                 "%s (%d shards%s)" % (index, len(files), ", written by %d ranks" % world if parallel else "")))
    empty = sum(1 for shape, _ in expected.values() if not torch.Size(shape).numel())
    _dsfix_print("verified %d tensors (names, shapes, dtypes; none empty%s)"
                 % (count, " but the %d the model holds empty" % empty if empty else ""))
    return count


def _dsfix_plan(module, strategy, gather, keep_lora=False):
    """([entry], notes): the tensors to write, in state_dict order but for a ZeRO-3 parameter's alias, which
    follows it; LoRA keys are dropped as upstream does (unless ``keep_lora``). Sharing is found by overlapping byte ranges of one
    storage, as safetensors does; ``dedupe`` leaves out exact aliases. An entry: name, param (a ZeRO-3
    parameter to gather) or tensor, shape, real_shape (``ds_shape`` under ZeRO-3), dtype, st_dtype, nbytes."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    entries, notes, seen, spans = [], [], {}, {}
    for name, value in module.state_dict().items():
        if "lora" in name and not keep_lora:
            continue
        source = params.get(name, buffers.get(name, value))
        partitioned = hasattr(source, "ds_shape")
        real_shape = tuple(int(d) for d in (source.ds_shape if partitioned else source.shape))
        alias, exact = None, False
        if partitioned and seen.setdefault(id(source), name) != name:
            alias, exact = seen[id(source)], True
        elif not partitioned and value.numel() and value.device.type != "meta":
            storage, start = value.untyped_storage(), value.data_ptr()
            end = start + value.element_size() * (1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride())))
            view = (start, value.dtype, value.shape, value.stride())
            earlier = spans.setdefault((str(value.device), storage.data_ptr(), storage.nbytes()), [])
            for other, o_start, o_end, o_view in earlier:
                if start < o_end and o_start < end and (alias is None or (not exact and view == o_view)):
                    alias, exact = other, view == o_view
            earlier.append((name, start, end, view))
        if alias is not None and strategy == "dedupe" and exact:
            notes.append("%s shares storage with %s: not written (the same tensor; transformers re-ties it "
                         "on load)" % (name, alias))
            continue
        if alias is not None:
            notes.append(("%s shares storage with %s" if exact else "%s overlaps %s in storage (a different "
                          "view)") % (name, alias) + ": written as its own copy")
        param = source if gather and partitioned else None
        shape = real_shape if param is not None else tuple(int(d) for d in value.shape)
        if shape != real_shape:  # ZeRO-3's empty placeholders, caught before a byte is written
            raise RuntimeError("[dsfix] verification failed: %s is empty %s but the model holds %s (a ZeRO-3 "
                               "placeholder saved without gathering?); nothing written" % (
                                   name, list(shape), list(real_shape)))
        if str(source.dtype).split(".")[-1] not in _DSFIX_DTYPES:
            raise ValueError("dsfix: safetensors cannot store dtype %s (%s)" % (source.dtype, name))
        at = len(entries)
        if param is not None and alias is not None:  # right after the parameter it aliases: one gather for both
            at = 1 + max(i for i, e in enumerate(entries) if e["param"] is param)
        entries.insert(at, {"name": name, "param": param, "tensor": value, "shape": shape, "real_shape": real_shape,
                            "dtype": source.dtype, "st_dtype": _DSFIX_DTYPES[str(source.dtype).split(".")[-1]],
                            "nbytes": torch.Size(shape).numel() * torch.empty((), dtype=source.dtype).element_size()})
    return entries, notes


def _dsfix_layout(entries, bucket_bytes, limit, writers):
    """(buckets, files). A bucket, gathered at once: whole modules packed up to ``bucket_bytes`` (a bigger
    module alone; 0: one parameter each). A file: rank, name, entries, header, size. One writer: runs in
    state_dict order up to ``limit`` bytes. Several, when one file would not do: each entry goes to the
    rank with the fewest bytes in its bucket (then in all), so each bucket's writes are spread."""
    buckets, size, owner = [], 0, None
    for entry in entries:
        module = entry["name"].rpartition(".")[0]
        if buckets and entry["param"] is not None and entry["param"] is buckets[-1][-1]["param"]:
            pass  # an alias stays with its parameter
        elif not buckets or bucket_bytes <= 0 or (module != owner and size + entry["nbytes"] > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(entry)
        size, owner = size + entry["nbytes"], module
    writers = writers if sum(e["nbytes"] for e in entries) > limit and len(entries) > 1 else 1
    total, runs = [0] * writers, [[] for _ in range(writers)]
    for bucket in buckets:
        here = [0] * writers
        for entry in bucket:
            rank = min(range(writers), key=lambda r: (here[r], total[r]))
            runs[rank].append(entry)
            here[rank], total[rank] = here[rank] + entry["nbytes"], total[rank] + entry["nbytes"]
    files = [] if entries else [{"rank": 0, "entries": [], "size": 0}]
    for rank, run in enumerate(runs):
        for entry in run:
            if not files or files[-1]["rank"] != rank or files[-1]["size"] + entry["nbytes"] > limit:
                files.append({"rank": rank, "entries": [], "size": 0})
            files[-1]["entries"].append(entry)
            files[-1]["size"] += entry["nbytes"]
    for i, f in enumerate(files):
        f["name"] = "model.safetensors" if len(files) == 1 else "model-%05d-of-%05d.safetensors" % (i + 1, len(files))
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for entry in f["entries"]:
            entry["file"] = i
            header[entry["name"]] = {"dtype": entry["st_dtype"], "shape": list(entry["shape"]),
                                     "data_offsets": [offset, offset + entry["nbytes"]]}
            offset += entry["nbytes"]
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        f["header"] = len(text).to_bytes(8, "little") + text
    return buckets, files


def _dsfix_stream(files, buckets, rank, gather):
    """Every rank walks the buckets in the same order and writes the entries of its own files, straight
    from the tensors' memory. With ``gather`` (ZeRO-3) each bucket is a collective: an error is then kept
    and returned once every bucket has been gathered, so no rank waits forever; otherwise it is raised."""
    mine, handles, errors = [f for f in files if f["rank"] == rank], {}, []

    def attempt(step, *args):
        try:
            if not errors:
                step(*args)
        except Exception as exc:
            if gather is None:
                raise
            errors.append(exc)

    def start(f):
        handles[f["name"]] = open(f["tmp"], "wb")
        handles[f["name"]].write(f["header"])

    def write(entry):
        data = entry["tensor"] if entry["param"] is None else entry["param"].data
        _dsfix_write_tensor(handles[files[entry["file"]]["name"]], data, entry)

    def finish(f):
        handle, size = handles[f["name"]], len(f["header"]) + f["size"]
        if handle.tell() != size:
            raise RuntimeError("%s is %d bytes long, not %d" % (f["name"], handle.tell(), size))
        handle.flush()
        os.fsync(handle.fileno())

    try:
        for f in mine:
            attempt(start, f)
        for bucket in buckets:
            own = [e for e in bucket if files[e["file"]]["rank"] == rank]
            if gather is None:
                for entry in own:
                    attempt(write, entry)
            else:
                gather(bucket, lambda: [attempt(write, entry) for entry in own])
        for f in mine:
            attempt(finish, f)
    finally:
        for handle in handles.values():
            handle.close()
    return errors[0] if errors else None


def _dsfix_gather(bucket, then):
    """ZeRO-3: gathers the bucket's partitioned parameters on every rank (a collective), then writes."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = dict((id(e["param"]), e["param"]) for e in bucket if e["param"] is not None and
                  e["param"].ds_status == ZeroParamStatus.NOT_AVAILABLE)  # not those already whole
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=bool(params)):
        return then()


def _dsfix_write_tensor(handle, tensor, entry):
    """Writes one tensor's raw bytes (moved to the CPU, contiguous), after checking its shape and dtype."""
    data = tensor.detach()
    if data.dtype != entry["dtype"] or tuple(data.shape) != entry["shape"] or data.device.type == "meta":
        raise RuntimeError("%s is %s %s on %s but the header says %s %s" % (
            entry["name"], list(data.shape), data.dtype, data.device, list(entry["shape"]), entry["dtype"]))
    if entry["nbytes"]:
        handle.write(memoryview(data.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))


def _dsfix_verify(files, expected):
    """Checks the headers of ``files`` [(path, name shown)] against ``expected`` {name: (shape, dtype)}
    (safe_open checks that each file is as long as its header says); returns the tensor count."""
    found, problems = {}, []
    for path, shown in files:
        with safe_open(path, framework="pt"), open(path, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        found.update((k, (tuple(v["shape"]), v["dtype"], shown)) for k, v in header.items() if k != "__metadata__")
    for what, keys in (("missing", [k for k in expected if k not in found]),
                       ("unexpected", [k for k in found if k not in expected])):
        problems += ["%s %d tensor(s): %s" % (what, len(keys), ", ".join(keys[:10]))] if keys else []
    for key, (shape, dtype, shown) in found.items():
        want_shape, want_dtype = expected.get(key, (shape, dtype))
        if shape != tuple(want_shape):
            problems.append("%s has shape %s in %s but the model holds %s" % (key, list(shape), shown, list(want_shape)))
        if dtype != want_dtype:
            problems.append("%s is %s in %s but the model holds %s" % (key, dtype, shown, want_dtype))
    if problems:
        raise RuntimeError("[dsfix] verification failed: %d problem(s):\n  - %s" % (len(problems),
                                                                                 "\n  - ".join(problems[:20])))
    return len(found)


def _dsfix_save_config_and_tokenizer(module, tokenizer, out_dir):
    """config.json (when ``module`` is given) and the tokenizer (when given) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    if module is not None and getattr(module, "config", None) is None:
        _dsfix_print("%s has no config; config.json not written" % (type(module).__name__,))
    elif module is not None:
        try:
            _dsfix_write_atomic(os.path.join(out_dir, "config.json"), module.config.to_json_file)
        except Exception as exc:  # the weights matter more, at the end of a training run
            _dsfix_print("could not write config.json (%s: %s); saving the rest" % (type(exc).__name__, exc))
    try:
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    except Exception as exc:
        if not hasattr(tokenizer, "save_vocabulary"):
            raise
        _dsfix_print("tokenizer.save_pretrained failed (%s); using save_vocabulary" % (exc,))
        tokenizer.save_vocabulary(out_dir)


def _dsfix_write_atomic(path, write=None, text=None):
    """``write(temporary path)`` (or ``text`` into it), fsync, rename onto ``path``; nothing left on failure."""
    tmp = os.path.join(os.path.dirname(path), ".%s.%d%s" % (os.path.basename(path), os.getpid(), _DSFIX_TMP_SUFFIX))
    try:
        if text is None:
            write(tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
        _dsfix_fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        _dsfix_remove(tmp)
        raise


def _dsfix_remove_weight_files(out_dir, keep):
    """Removes the weight files not in ``keep``, or (``keep`` None) dsfix's temporary ones; returns names."""
    removed = []
    for name in sorted(os.listdir(out_dir)):
        temporary = name.startswith(".") and name.endswith(_DSFIX_TMP_SUFFIX)
        base = name[1:].rsplit(".", 2)[0] if temporary else name
        if (keep is None) == temporary and name not in (keep or ()) and (
                base in ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.safetensors.index.json",
                         "model.safetensors") or (base.startswith("pytorch_model-") and base.endswith(".bin"))
                or (base.startswith("model-") and "-of-" in base and base.endswith(".safetensors"))):
            _dsfix_remove(os.path.join(out_dir, name))
            removed.append(name)
    return removed


def _dsfix_fsync(path):
    """fsync a file, or a folder where the system allows it (Windows cannot open one)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not os.path.isdir(path):
            raise


def _dsfix_remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _dsfix_unwrap(model):
    """The module under DeepSpeed/DDP (``.module``) and torch.compile (``_orig_mod``) wrappers."""
    for _ in range(8):
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, torch.nn.Module) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


def _dsfix_print(message):
    print("[dsfix] " + message, flush=True)
