"""dsfix: save DeepSpeed-Chat models as safetensors, tied weights included.

dsfix inserts this code into DeepSpeed-Chat's ``dschat/utils/utils.py``. It is
self-contained: it uses no other function of that file, imports DeepSpeed only
inside the ZeRO-3 path, and never imports transformers.

* ``save_hf_format_safetensors`` replaces ``save_hf_format`` (rank 0 only):
  config.json, the tokenizer and the weights as ``model.safetensors``.
* ``save_zero_three_model_safetensors`` replaces ``save_zero_three_model``
  (every rank): under ZeRO-3 it gathers one parameter at a time and rank 0
  streams it into the file.

Tensors that share storage (Qwen3's ``lm_head.weight`` is
``model.embed_tokens.weight``) are found by overlapping byte ranges of one
storage, as safetensors does. Strategy "clone" writes every alias as its own
copy (straight from the same memory, so no copy is made in RAM); "dedupe"
drops exact aliases like transformers' ``save_pretrained``, which re-ties them
on load. Files are written under a temporary name, verified from their header,
fsynced and then renamed, so a failure never leaves a truncated file behind.
"""
import json
import os
import sys

import torch
from safetensors import safe_open

_DSFIX_TEMPLATE_VERSION = 2
_DSFIX_STRATEGY = "clone"
_DSFIX_MAX_SHARD_SIZE = 5 * 1024**3

_DSFIX_WEIGHTS_NAME = "model.safetensors"
_DSFIX_INDEX_NAME = "model.safetensors.index.json"
_DSFIX_CONFIG_NAME = "config.json"
_DSFIX_TMP_SUFFIX = ".dsfix-tmp"

# torch dtype name -> safetensors dtype name.
_DSFIX_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}

# safetensors' Dtype enum in declaration order. safetensors writes tensors
# sorted by this rank (descending), then by name; we do the same so that the
# file is byte-identical to safetensors.torch.save_file(..., metadata=
# {"format": "pt"}) for a state dict without shared tensors.
_DSFIX_DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3",
    "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)


def _dsfix_print(message):
    print("[dsfix] " + message, flush=True)


def _dsfix_unwrap(model):
    """The module under a DeepSpeed/DDP wrapper (``.module``) and torch.compile (``_orig_mod``)."""
    module = model
    for _ in range(8):
        inner = getattr(module, "module", None)
        if isinstance(inner, torch.nn.Module):
            module = inner
            continue
        inner = getattr(module, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            module = inner
            continue
        break
    return module


def _dsfix_resolve_strategy(strategy):
    if strategy is None:
        strategy = _DSFIX_STRATEGY
    if strategy not in ("clone", "dedupe"):
        raise ValueError('dsfix: strategy must be "clone" or "dedupe", not %r' % (strategy,))
    return strategy


def _dsfix_parse_size(size):
    """Bytes from an int or a string such as "5GB" (10**9) or "5GiB" (2**30)."""
    if size is None:
        size = _DSFIX_MAX_SHARD_SIZE
    if isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        units = (("KIB", 1024), ("MIB", 1024**2), ("GIB", 1024**3), ("TIB", 1024**4),
                 ("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12), ("B", 1))
        factor = 1
        for suffix, mult in units:
            if text.endswith(suffix):
                text, factor = text[: -len(suffix)], mult
                break
        size = int(float(text) * factor)
    size = int(size)
    if size <= 0:
        raise ValueError("dsfix: max_shard_size must be positive, not %r" % (size,))
    return size


def _dsfix_st_dtype(dtype):
    name = str(dtype).split(".")[-1]
    if name not in _DSFIX_DTYPES:
        raise ValueError("dsfix: safetensors cannot store dtype %s" % (dtype,))
    return _DSFIX_DTYPES[name]


def _dsfix_numel(shape):
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _dsfix_is_partitioned(module):
    """True when a parameter is a ZeRO-3 parameter (has ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _dsfix_span(tensor):
    """(storage key, first byte, end byte, view signature), or None for tensors that never share."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        storage_ptr, storage_bytes = storage.data_ptr(), storage.nbytes()
    except Exception:
        return None
    if storage_ptr == 0 or storage_bytes == 0:
        return None
    last = 0
    for size, stride in zip(tensor.shape, tensor.stride()):
        last += (int(size) - 1) * int(stride)
    start = tensor.data_ptr()
    end = start + (last + 1) * tensor.element_size()
    signature = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    return (str(tensor.device), storage_ptr, storage_bytes), start, end, signature


def _dsfix_plan(module, strategy, gather):
    """The tensors to write, in state_dict order, and the notes to print.

    Each entry is a dict: name; param (a ZeRO-3 parameter to gather) or tensor
    (the tensor to write); shape (in the header); real_shape (what the model
    holds: ``ds_shape`` for ZeRO-3 parameters); dtype; st_dtype; nbytes.
    """
    state = module.state_dict()
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    entries, notes = [], []
    seen_params = {}  # id(ZeRO-3 parameter) -> first name
    groups = {}  # storage key -> [(name, start, end, signature)]
    for name, value in state.items():
        if "lora" in name:
            continue
        source = params.get(name)
        if source is None:
            source = buffers.get(name)
        if source is None:
            source = value
        if not isinstance(source, torch.Tensor):
            raise RuntimeError("dsfix: state_dict entry %s is not a tensor" % (name,))
        partitioned = hasattr(source, "ds_shape")
        real_shape = tuple(int(d) for d in (source.ds_shape if partitioned else source.shape))
        alias_of, exact = None, False
        if partitioned:
            first = seen_params.setdefault(id(source), name)
            if first != name:
                alias_of, exact = first, True
        else:
            span = _dsfix_span(value)
            if span is not None:
                key, start, end, signature = span
                earlier = groups.setdefault(key, [])
                for other, o_start, o_end, o_signature in earlier:
                    if start < o_end and o_start < end:
                        same = start == o_start and signature == o_signature
                        if alias_of is None or (same and not exact):
                            alias_of, exact = other, same
                        if exact:
                            break
                earlier.append((name, start, end, signature))
        if alias_of is not None:
            if strategy == "dedupe" and exact:
                notes.append("%s shares storage with %s: not written (the same tensor; "
                             "transformers re-ties it on load)" % (name, alias_of))
                continue
            if exact:
                notes.append("%s shares storage with %s: written as its own copy" % (name, alias_of))
            else:
                notes.append("%s overlaps %s in storage (a different view): written as its own copy"
                             % (name, alias_of))
        write_param = source if (gather and partitioned) else None
        shape = real_shape if write_param is not None else tuple(int(d) for d in value.shape)
        dtype = source.dtype if write_param is not None else value.dtype
        entries.append({
            "name": name,
            "param": write_param,
            "tensor": None if write_param is not None else value,
            "shape": shape,
            "real_shape": real_shape,
            "dtype": dtype,
            "st_dtype": _dsfix_st_dtype(dtype),
            "nbytes": _dsfix_numel(shape) * torch.empty((), dtype=dtype).element_size(),
        })
    return entries, notes


def _dsfix_header(entries):
    """Orders ``entries`` like safetensors, sets their offsets; returns the header bytes."""
    rank = dict((name, i) for i, name in enumerate(_DSFIX_DTYPE_ORDER))
    entries.sort(key=lambda e: (-rank.get(e["st_dtype"], -1), e["name"]))
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        entry["offset"] = offset
        header[entry["name"]] = {
            "dtype": entry["st_dtype"],
            "shape": list(entry["shape"]),
            "data_offsets": [offset, offset + entry["nbytes"]],
        }
        offset += entry["nbytes"]
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _dsfix_layout(entries, max_shard_size):
    """[(file name, header bytes, entries in file order, data bytes)], split greedily in state_dict order."""
    shards, size = [[]], 0
    for entry in entries:
        if shards[-1] and size + entry["nbytes"] > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry["nbytes"]
    layout = []
    for i, shard in enumerate(shards):
        if len(shards) == 1:
            name = _DSFIX_WEIGHTS_NAME
        else:
            name = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        header = _dsfix_header(shard)
        layout.append((name, header, shard, sum(e["nbytes"] for e in shard)))
    return layout


def _dsfix_write_tensor(handle, tensor, entry):
    """Writes the raw bytes of one tensor (moved to the CPU, contiguous), no other copy."""
    data = tensor.detach()
    if data.device.type == "meta":
        raise RuntimeError("dsfix: %s is on the meta device; it has no data to save" % (entry["name"],))
    if data.dtype != entry["dtype"] or tuple(data.shape) != tuple(entry["shape"]):
        raise RuntimeError("dsfix: %s is %s %s but the header says %s %s" % (
            entry["name"], list(data.shape), data.dtype, list(entry["shape"]), entry["dtype"]))
    if entry["nbytes"] == 0:
        return 0
    if data.device.type != "cpu":
        data = data.to("cpu")
    data = data.contiguous().reshape(-1).view(torch.uint8)
    handle.write(memoryview(data.numpy()))
    return entry["nbytes"]


def _dsfix_remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _dsfix_fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: directories cannot be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _dsfix_remove_leftovers(out_dir):
    """Removes temporary weight files that a killed earlier save left behind in ``out_dir``."""
    for name in os.listdir(out_dir):
        if name.startswith(".") and name.endswith(_DSFIX_TMP_SUFFIX) and _dsfix_is_weight_file(
                name[1:].rsplit(".", 2)[0]):
            _dsfix_remove_quietly(os.path.join(out_dir, name))


def _dsfix_write_files(out_dir, layout, visit, is_writer, collective):
    """Streams every shard to a temporary file; returns [(temporary path, final name)].

    Every rank calls this and ``visit(entry, consume)`` for every entry in the
    same order (under ZeRO-3 ``visit`` gathers, a collective); only the writer
    touches the disk. In collective mode a write error on the writer is kept
    until all entries are visited, so the other ranks never wait forever.
    """
    state = {"handle": None, "error": None, "written": 0}
    temps = []

    def consume(tensor, entry):
        if state["handle"] is None or state["error"] is not None:
            return
        try:
            if state["written"] != entry["offset"]:
                raise RuntimeError("dsfix: %s would start at byte %d, not %d" % (
                    entry["name"], state["written"], entry["offset"]))
            state["written"] += _dsfix_write_tensor(state["handle"], tensor, entry)
        except Exception as exc:
            if not collective:
                raise
            state["error"] = exc

    if is_writer:
        _dsfix_remove_leftovers(out_dir)
    try:
        for name, header, entries, data_bytes in layout:
            if is_writer and state["error"] is None:
                tmp = os.path.join(out_dir, ".%s.%d%s" % (name, os.getpid(), _DSFIX_TMP_SUFFIX))
                try:
                    _dsfix_remove_quietly(tmp)
                    temps.append((tmp, name))
                    state["handle"] = open(tmp, "wb")
                    state["handle"].write(header)
                    state["written"] = 0
                except Exception as exc:
                    if not collective:
                        raise
                    state["error"] = exc
            for entry in entries:
                visit(entry, lambda tensor, entry=entry: consume(tensor, entry))
            handle, state["handle"] = state["handle"], None
            if handle is not None:
                try:
                    if state["error"] is None and state["written"] != data_bytes:
                        raise RuntimeError("dsfix: wrote %d bytes of tensor data to %s, expected %d" % (
                            state["written"], name, data_bytes))
                    handle.flush()
                    os.fsync(handle.fileno())
                except Exception as exc:
                    if not collective:
                        raise
                    if state["error"] is None:
                        state["error"] = exc
                finally:
                    handle.close()
        error = state["error"]
        if error is not None:
            raise RuntimeError("dsfix: writing the weights to %s failed: %s" % (out_dir, error)) from error
    except BaseException:
        if state["handle"] is not None:
            state["handle"].close()
        for tmp, _ in temps:
            _dsfix_remove_quietly(tmp)
        raise
    return temps


def _dsfix_read_header(path):
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        return json.loads(handle.read(length).decode("utf-8"))


def _dsfix_verify_files(files, expected):
    """Checks safetensors headers against ``expected`` {name: (shape, safetensors dtype)}.

    ``files``: [(path to read, name to show)]. Reads headers only (safe_open also
    checks that each file is as long as its header says). Returns the tensor
    count; raises RuntimeError listing the mismatches.
    """
    found, problems = {}, []
    for path, shown in files:
        header = None
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                shape = tuple(int(d) for d in piece.get_shape())
                if hasattr(piece, "get_dtype"):
                    dtype = piece.get_dtype()
                else:
                    header = header or _dsfix_read_header(path)
                    dtype = header[key]["dtype"]
                if key in found:
                    problems.append("%s is in both %s and %s" % (key, found[key][2], shown))
                found[key] = (shape, dtype, shown)
    missing = [k for k in expected if k not in found]
    extra = [k for k in found if k not in expected]
    if missing:
        problems.append("missing %d tensor(s): %s" % (len(missing), ", ".join(missing[:10])))
    if extra:
        problems.append("unexpected %d tensor(s): %s" % (len(extra), ", ".join(extra[:10])))
    for key, (shape, dtype, shown) in found.items():
        if key not in expected:
            continue
        want_shape, want_dtype = expected[key]
        want_shape = tuple(int(d) for d in want_shape)
        if _dsfix_numel(shape) == 0 and _dsfix_numel(want_shape) != 0:
            problems.append("%s is empty %s in %s but the model holds %s (a ZeRO-3 placeholder "
                            "saved without gathering?)" % (key, list(shape), shown, list(want_shape)))
        elif shape != want_shape:
            problems.append("%s has shape %s in %s but the model holds %s" % (
                key, list(shape), shown, list(want_shape)))
        if dtype != want_dtype:
            problems.append("%s is %s in %s but the model holds %s" % (key, dtype, shown, want_dtype))
    if problems:
        listed = "\n  - ".join(problems[:20])
        more = "\n  ... and %d more" % (len(problems) - 20) if len(problems) > 20 else ""
        raise RuntimeError("[dsfix] verification failed: %d problem(s):\n  - %s%s" % (
            len(problems), listed, more))
    return len(found)


def _dsfix_expected(entries):
    return dict((e["name"], (e["real_shape"], e["st_dtype"])) for e in entries)


def _dsfix_verify_dir(out_dir, expected):
    """Verifies the weights saved in ``out_dir`` (one file or an index with shards)."""
    index_path = os.path.join(out_dir, _DSFIX_INDEX_NAME)
    single = os.path.join(out_dir, _DSFIX_WEIGHTS_NAME)
    if os.path.exists(single) or not os.path.exists(index_path):
        return _dsfix_verify_files([(single, _DSFIX_WEIGHTS_NAME)], expected)
    with open(index_path, "r", encoding="utf-8") as handle:
        weight_map = json.load(handle)["weight_map"]
    names = sorted(set(weight_map.values()))
    count = _dsfix_verify_files([(os.path.join(out_dir, n), n) for n in names], expected)
    for name in names:
        for key in _dsfix_read_header(os.path.join(out_dir, name)):
            if key != "__metadata__" and weight_map.get(key) != name:
                raise RuntimeError("[dsfix] verification failed: %s is in %s but %s maps it to %s" % (
                    key, name, _DSFIX_INDEX_NAME, weight_map.get(key)))
    return count


def _dsfix_is_weight_file(name):
    return (name in ("pytorch_model.bin", "pytorch_model.bin.index.json", _DSFIX_WEIGHTS_NAME, _DSFIX_INDEX_NAME)
            or (name.startswith("pytorch_model-") and name.endswith(".bin"))
            or (name.startswith("model-") and "-of-" in name and name.endswith(".safetensors")))


def _dsfix_remove_stale(out_dir, keep):
    """Removes weight files that the new save does not own; returns their names."""
    removed = []
    for name in sorted(os.listdir(out_dir)):
        if name not in keep and _dsfix_is_weight_file(name):
            path = os.path.join(out_dir, name)
            if os.path.isfile(path):
                os.remove(path)
                removed.append(name)
    if removed:
        _dsfix_fsync_dir(out_dir)
    return removed


def _dsfix_write_json_atomic(path, obj):
    tmp = "%s.%d%s" % (path, os.getpid(), _DSFIX_TMP_SUFFIX)
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        _dsfix_remove_quietly(tmp)
        raise


def _dsfix_save_weights(module, out_dir, max_shard_size, strategy, gather, is_writer):
    """Plans, streams, verifies and renames the weight files (see _dsfix_write_files)."""
    entries, notes = _dsfix_plan(module, strategy, gather)
    expected = _dsfix_expected(entries)
    layout = _dsfix_layout(entries, max_shard_size)
    if is_writer:
        for note in notes:
            _dsfix_print(note)
    collective = any(e["param"] is not None for e in entries)
    if collective:
        import deepspeed
        try:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
            not_available = ZeroParamStatus.NOT_AVAILABLE
        except ImportError:
            not_available = None

        def visit(entry, consume):
            param = entry["param"]
            if param is None:
                consume(entry["tensor"])
            elif getattr(param, "ds_status", None) == not_available:
                with deepspeed.zero.GatheredParameters([param]):
                    consume(param.data)
            else:
                consume(param.data)
    else:
        def visit(entry, consume):
            consume(entry["tensor"])

    temps = _dsfix_write_files(out_dir, layout, visit, is_writer, collective)
    if not is_writer:
        return None
    try:
        count = _dsfix_verify_files(temps, expected)
        for tmp, name in temps:
            os.replace(tmp, os.path.join(out_dir, name))
        if len(layout) > 1:
            weight_map = {}
            for name, _, shard, _ in layout:
                for entry in shard:
                    weight_map[entry["name"]] = name
            total = sum(item[3] for item in layout)
            _dsfix_write_json_atomic(os.path.join(out_dir, _DSFIX_INDEX_NAME),
                                     {"metadata": {"total_size": total}, "weight_map": weight_map})
        _dsfix_fsync_dir(out_dir)
    except BaseException:
        for tmp, _ in temps:
            _dsfix_remove_quietly(tmp)
        raise
    keep = set(name for name, _, _, _ in layout)
    if len(layout) > 1:
        keep.add(_DSFIX_INDEX_NAME)
        saved = "%s (%d shards)" % (os.path.join(out_dir, _DSFIX_INDEX_NAME), len(layout))
    else:
        saved = os.path.join(out_dir, _DSFIX_WEIGHTS_NAME)
    for name in _dsfix_remove_stale(out_dir, keep):
        _dsfix_print("removed stale %s" % (os.path.join(out_dir, name),))
    _dsfix_print("saved weights to %s" % (saved,))
    empty = sum(1 for shape, _ in expected.values() if _dsfix_numel(shape) == 0)
    if empty:
        _dsfix_print("verified %d tensors (names, shapes, dtypes; none empty but the %d the model holds empty)"
                     % (count, empty))
    else:
        _dsfix_print("verified %d tensors (names, shapes, dtypes; none empty)" % (count,))
    return count


def _dsfix_save_config(module, out_dir):
    config = getattr(module, "config", None)
    if config is None:
        _dsfix_print("%s has no config; config.json not written" % (type(module).__name__,))
        return
    path = os.path.join(out_dir, _DSFIX_CONFIG_NAME)
    if hasattr(config, "to_json_file"):
        tmp = "%s.%d%s" % (path, os.getpid(), _DSFIX_TMP_SUFFIX)
        try:
            config.to_json_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            _dsfix_remove_quietly(tmp)
            raise
    else:
        config.save_pretrained(out_dir)


def _dsfix_save_tokenizer(tokenizer, out_dir):
    if tokenizer is None:
        return
    try:
        tokenizer.save_pretrained(out_dir)
        return
    except Exception as exc:
        if not hasattr(tokenizer, "save_vocabulary"):
            raise
        _dsfix_print("tokenizer.save_pretrained failed (%s); using save_vocabulary" % (exc,))
    tokenizer.save_vocabulary(out_dir)


def save_hf_format_safetensors(model, tokenizer, args, sub_folder="", *, max_shard_size=None, strategy=None):
    """Like save_hf_format, with its parameters, but writes config.json, the tokenizer and model.safetensors."""
    output_dir = os.path.join(args.output_dir, sub_folder)
    _dsfix_save_hf_format(model, tokenizer, output_dir, max_shard_size=max_shard_size, strategy=strategy)


def save_zero_three_model_safetensors(model_ema, global_rank, save_dir, zero_stage=0, *, max_shard_size=None, strategy=None):
    """Like save_zero_three_model, with its parameters, but writes model.safetensors; call it on every rank."""
    _dsfix_save_zero_three_model(model_ema, save_dir, global_rank=global_rank, zero_stage=zero_stage, max_shard_size=max_shard_size, strategy=strategy)


def _dsfix_save_hf_format(model, tokenizer, output_dir, global_rank=None, max_shard_size=None, strategy=None):
    """Writes config.json, the tokenizer and the weights (shards and an index above ``max_shard_size``).

    ``global_rank`` None: called on rank 0 only, like upstream's save_hf_format; under ZeRO-3 it then
    writes no weights, since gathering is a collective: save_zero_three_model_safetensors, called on
    every rank, writes them. With a rank (a fork whose save_hf_format runs on every rank): every rank
    gathers under ZeRO-3 and rank 0 writes.
    """
    if sys.byteorder != "little":
        raise RuntimeError("dsfix: safetensors files are little-endian; this machine is not")
    module = _dsfix_unwrap(model)
    strategy = _dsfix_resolve_strategy(strategy)
    limit = _dsfix_parse_size(max_shard_size)
    is_writer = global_rank is None or global_rank == 0
    partitioned = _dsfix_is_partitioned(module)
    if is_writer:
        os.makedirs(output_dir, exist_ok=True)
        _dsfix_save_config(module, output_dir)
        _dsfix_save_tokenizer(tokenizer, output_dir)
    if partitioned and global_rank is None:
        _dsfix_print("ZeRO-3 parameters are partitioned: wrote config and tokenizer to %s; the weights are "
                     "written by save_zero_three_model_safetensors" % (os.path.normpath(output_dir),))
        return
    if partitioned or is_writer:
        _dsfix_save_weights(module, output_dir, limit, strategy, gather=partitioned, is_writer=is_writer)


def _dsfix_save_zero_three_model(model, save_dir, global_rank=None, zero_stage=3, tokenizer=None,
                                 max_shard_size=None, strategy=None):
    """Writes the weights; every rank calls it.

    Under ZeRO-3 every rank gathers the parameters one at a time in the same order and rank 0 streams
    each into the file, so host memory holds about one tensor, not the model. Otherwise rank 0 writes.
    ``global_rank`` None: taken from torch.distributed.
    """
    if sys.byteorder != "little":
        raise RuntimeError("dsfix: safetensors files are little-endian; this machine is not")
    module = _dsfix_unwrap(model)
    strategy = _dsfix_resolve_strategy(strategy)
    limit = _dsfix_parse_size(max_shard_size)
    if global_rank is None:
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        global_rank = torch.distributed.get_rank() if initialized else 0
    is_writer = global_rank == 0
    if is_writer:
        os.makedirs(save_dir, exist_ok=True)
        _dsfix_save_tokenizer(tokenizer, save_dir)
    if zero_stage != 3:
        if is_writer:
            _dsfix_save_weights(module, save_dir, limit, strategy, gather=False, is_writer=True)
        return
    _dsfix_save_weights(module, save_dir, limit, strategy, gather=True, is_writer=is_writer)
