"""dsfix's final save for DeepSpeed-Chat: Hugging Face folders as safetensors, tied weights included.

`dsfix apply` copied this file, byte for byte, beside your DeepSpeed-Chat `utils.py`, and added two short
functions to that `utils.py`, `save_hf_format_safetensors` and `save_zero_three_model_safetensors`, that
call `save_hf_format` and `save_zero_three_model` below with the options chosen at apply time.
`dsfix revert` removes this file and those two functions. The file imports torch and safetensors (and
DeepSpeed under ZeRO-3), never numpy, transformers or dsfix. Tested with Python 3.9+, torch 2.1+,
transformers 4.51+, safetensors 0.4.3+, DeepSpeed 0.15.4+ (the oldest versions dsfix supports).

What it writes into the output folder
- `model.safetensors`, or shards `model-00001-of-0000N.safetensors` and `model.safetensors.index.json`
  above `max_shard_size` bytes (5 GiB by default). Every key of `state_dict()` but those with "lora" in
  the name, as upstream's save (a fork's own rule comes as `drop`). A weight that shares memory with
  another (Qwen3's `lm_head.weight` is its `embed_tokens.weight`) is written in full as its own copy under
  strategy "clone" (Qwen3-0.6B: 311 tensors), or left out under "dedupe" (310, as transformers'
  `save_pretrained`; transformers ties it again on load). Each file's header and offsets are the ones
  safetensors' own `save_file` writes for the same tensors, so every reader loads them.
- `config.json`, `generation_config.json` when the model has a generation config, and the tokenizer
  (`save_pretrained`, else `save_vocabulary`, upstream's own call).

ZeRO-3
- Gathering partitioned parameters is a collective: every rank must call `save_zero_three_model`, and
  DeepSpeed-Chat's step 1 does. The parameters are gathered in buckets (whole modules, up to 256 MiB;
  `gather_bucket_mb=0` gathers one at a time), so no rank holds more of the model than one bucket; rank 0
  writes each gathered tensor into its place in the file and alone touches the disk.
- Step 1 calls `save_hf_format` on rank 0 first. With the parameters partitioned that call writes
  nothing: it leaves the config and the tokenizer to the weights save that follows, so that they are put
  in place after the weights, together.
- After each bucket the ranks agree whether rank 0's writing failed, so all stop together and none is
  left waiting in a gather.

Why each step is safe
- Nothing is written into the output folder until everything is ready: rank 0 puts the whole new save
  together in a hidden folder inside it (`.dsfix-save-<pid>`): the weights, written, fsynced and checked
  (safetensors opens each file, its header reads back as written, every tensor was written), then
  `config.json`, the generation config and the tokenizer.
- Then one short final phase moves the new files into place, weights first, and moves the previous
  save's weight files that the new save does not replace (an old `pytorch_model.bin`, old shards) aside.
  Ctrl-C and SIGTERM wait until it ends. If a move fails, the moves already made are undone. Then the
  hidden folder goes, and the old files with it.
- So a failure at any point (a full disk, Ctrl-C, an exception in the tokenizer, a rank that dies under
  ZeRO-3) leaves the previous save's files exactly as they were and nothing of the new one in place, and
  the error names the cause and the folder. Only a process killed outright (SIGKILL, power loss) during
  the final phase, a few renames long, can leave part of the new files in place; the previous ones are
  then in the hidden folder's `.replaced`, and the list of what the phase moves is written into the hidden
  folder first, so that `dsfix verify` names what is in place. The next save completes the folder and
  removes what a killed save left behind; that removal is best-effort: it never fails a save in place.
- Weights holding NaN or Inf are saved all the same (a diverged run's weights are still evidence), with
  one warning line naming the first such tensor.
- If the save fails for any reason but the disk (no space, quota, read-only, file too large, permission
  denied), the weights are saved the way upstream saves them, `torch.save` of the same tensors to
  `pytorch_model.bin` with `config.json`, in the subfolder `dsfix-fallback` of the output folder (put
  together in a hidden folder and moved into place the same way, so it is whole or not there). One line
  says so, and why, and that `dsfix convert OUTPUT/dsfix-fallback` turns it into safetensors; then the
  original error is raised.

Every line it prints starts with `[dsfix] ` (rank 0 only); every error of its own starts with `dsfix: `.
"""
import atexit
import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from safetensors import safe_open

VERSION = 6

__all__ = [
    "VERSION", "DTYPES", "DEFAULT_MAX_SHARD_SIZE", "DEFAULT_GATHER_BUCKET_MB", "FALLBACK_FOLDER", "INDEX_NAME",
    "SaveError", "save_hf_format", "save_zero_three_model", "find_overlap", "is_finite", "PlannedTensor",
    "WeightFile", "layout_files", "WeightWriter", "Leftover", "find_leftovers",
]

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
DEFAULT_GATHER_BUCKET_MB = 256
FALLBACK_FOLDER = "dsfix-fallback"
INDEX_NAME = "model.safetensors.index.json"

# torch dtype -> safetensors' code, in the order safetensors puts tensors in a file: larger elements first,
# so each tensor starts at a multiple of its element size
DTYPES = {
    torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16",
    torch.float16: "F16", torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}

_ORDER = {dtype: i for i, dtype in enumerate(DTYPES)}
# the folder cannot take the save: no space, quota, read-only, file too large, not allowed (the fallback, in a
# folder inside it, could not either)
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM,
                getattr(errno, "EDQUOT", errno.ENOSPC)}
_STAGING_PREFIX = ".dsfix-save-"
_OLD_TMP_SUFFIX = ".dsfix-tmp"  # the temporary files of dsfix's earlier inline save, and of v4's fallback
_JOURNAL = ".moving.json"  # in the staging folder: what its final phase moves (read by find_leftovers)
_ASIDE = ".replaced"  # in the staging folder: the previous save's files, moved aside in the final phase
_CONFIG_FILES = ("config.json", "generation_config.json")
_CHECK_ELEMENTS = 1 << 24  # elements per step of the NaN/Inf check
_HOST_CHUNK_BYTES = 64 * 1024**2  # how much of a tensor on a GPU is copied to the host at a time
_PENDING = {}  # output folder -> (module, tokenizer) that save_hf_format left to save_zero_three_model
_REPORT_AT_EXIT = []  # whether _report_unsaved is registered (once)


class SaveError(RuntimeError):
    """A save that wrote nothing into ``folder``; ``cause`` is what failed (None on the ranks other than 0)."""

    def __init__(self, message, folder, cause=None):
        super().__init__(message)
        self.folder = folder
        self.cause = cause


# --------------------------------------------------------------------------- the two save functions


def save_hf_format(model, tokenizer, output_dir, *, global_rank=None, strategy="clone", drop=None,
                   max_shard_size=None, gather_bucket_mb=None):
    """What DeepSpeed-Chat's `save_hf_format` saves, as safetensors: the weights, `config.json`, the
    generation config and the tokenizer, into `output_dir`.

    Call it on rank 0, as step 1 does, or on every rank with its `global_rank`. Under ZeRO-3, a call on
    rank 0 alone cannot gather: it hands the config and the tokenizer to `save_zero_three_model`, which
    every rank calls next into the same folder. `drop(name)` tells whether to leave a tensor out; None is
    upstream's rule, every name with "lora" in it."""
    module = _unwrap(model)
    partitioned = any(hasattr(p, "ds_id") for p in module.parameters())
    if partitioned and global_rank is None:
        _leave_to_weights_save(module, tokenizer, output_dir)
        return
    rank = global_rank or 0
    if partitioned or rank == 0:
        _save(module, output_dir, rank, partitioned, module, tokenizer,
              _Options(strategy, drop, max_shard_size, gather_bucket_mb))


def save_zero_three_model(model, save_dir, *, global_rank=None, zero_stage=3, tokenizer=None, with_config=False,
                          strategy="clone", drop=None, max_shard_size=None, gather_bucket_mb=None):
    """What DeepSpeed-Chat's `save_zero_three_model` saves, as safetensors; every rank calls it.

    At stage 3 every rank gathers and rank 0 writes; below it rank 0 writes and, with no `drop`, every key
    (upstream leaves "lora" names out at stage 3 only). The config (`with_config`, or when `save_hf_format`
    left it here) and the `tokenizer` are written after the weights."""
    if global_rank is None:
        ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        global_rank = torch.distributed.get_rank() if ready else 0
    gather = zero_stage == 3
    if not gather and global_rank != 0:
        return
    if drop is None and not gather:
        drop = _keep_every_key
    module = _unwrap(model)
    left = _PENDING.pop(_folder_key(save_dir), None)
    config = module if with_config or left is not None else None
    if tokenizer is None and left is not None:
        tokenizer = left[1]
    _save(module, save_dir, global_rank, gather, config, tokenizer,
          _Options(strategy, drop, max_shard_size, gather_bucket_mb))


def _keep_every_key(name):
    return False


def _leave_to_weights_save(module, tokenizer, folder):
    """Rank 0's save_hf_format under ZeRO-3: the config and tokenizer wait for the weights save."""
    if not _REPORT_AT_EXIT:
        atexit.register(_report_unsaved)
        _REPORT_AT_EXIT.append(True)
    _PENDING[_folder_key(folder)] = (module, tokenizer)
    _print(f"ZeRO-3 parameters are partitioned: config.json and the tokenizer go to {os.path.normpath(folder)} "
           "with the weights, which save_zero_three_model_safetensors writes on every rank")


def _report_unsaved():
    for folder in _PENDING:
        _print(f"config.json and the tokenizer for {folder} were not written: no weights save followed")


def _folder_key(folder):
    return os.path.normpath(os.path.abspath(folder))


class _Options(NamedTuple):
    strategy: object
    drop: object
    max_shard_size: object
    gather_bucket_mb: object

    def checked(self):
        """(strategy, shard limit in bytes, bucket in bytes); a ValueError for a value that cannot be."""
        strategy = "clone" if self.strategy is None else self.strategy
        if strategy not in ("clone", "dedupe"):
            raise ValueError(f'dsfix: strategy must be "clone" or "dedupe", not {strategy!r}')
        limit = DEFAULT_MAX_SHARD_SIZE if self.max_shard_size is None else self.max_shard_size
        if isinstance(limit, (str, bytes, bool)) or int(limit) <= 0:
            raise ValueError(f"dsfix: max_shard_size must be a positive number of bytes, not {limit!r}")
        bucket_mb = DEFAULT_GATHER_BUCKET_MB if self.gather_bucket_mb is None else self.gather_bucket_mb
        return strategy, int(limit), bucket_mb * 1024**2


# --------------------------------------------------------------------------- one save, from plan to publish


def _save(module, out_dir, rank, gather, config, tokenizer, options):
    """Every rank walks the same buckets; rank 0 stages, checks and publishes; all learn rank 0's outcome."""
    strategy, limit, bucket_bytes = options.checked()
    tensors, notes, refusal = _plan(module, strategy, gather, options.drop, out_dir)
    buckets = _buckets(tensors, bucket_bytes)
    ranks = _Ranks(gather)
    staging = _Staging(out_dir, gather) if rank == 0 else None
    error = refusal
    try:
        if staging is not None and error is None:
            error = staging.start(tensors, limit)
        for bucket in buckets:
            if ranks.any_failed(error is not None):
                break
            with _gathered(bucket):
                if staging is not None and error is None:
                    error = staging.write(bucket)
        if staging is not None and error is None:
            error = staging.finish(config, tokenizer)
        outcome = ranks.outcome(error)
    except BaseException:  # Ctrl-C, or a collective that failed (a rank died): no fallback, nothing in place
        if staging is not None:
            staging.discard()
        raise
    if staging is not None and error is not None:
        staging.discard()
    if outcome is None:
        if staging is not None:
            _report(staging, tensors, notes)
        return
    _fail(module, tensors, buckets, out_dir, rank, tokenizer, error, outcome)


def _fail(module, tensors, buckets, out_dir, rank, tokenizer, error, outcome):
    """Raises the failure on every rank, after the fallback save unless the disk failed."""
    disk, text = outcome
    folder = os.path.normpath(out_dir)
    if disk:
        message = f"dsfix: could not save to {folder}: {text}; the folder is as it was before this save"
        raise SaveError(message, folder, error) from error
    fallback = _fallback(module, tensors, buckets, out_dir, rank, tokenizer, text)
    if error is not None:
        raise error
    raise SaveError(f"dsfix: the save to {folder} failed on rank 0 ({text}); the weights went to {fallback} "
                    "as pytorch_model.bin", folder)


def _report(staging, tensors, notes):
    for note in notes:
        _print(note)
    finite = staging.finite
    if finite.bad:
        _print(f"WARNING: {len(finite.bad)} of {len(tensors)} tensors hold NaN or Inf, the first "
               f"{finite.bad[0]}; saved all the same (a diverged run's weights are still evidence)")
    names = staging.weight_names
    shards = f" ({len(names) - 1} shards)" if len(names) > 1 else ""
    _print(f"saved weights to {os.path.join(staging.out, names[-1])}{shards}")
    empty = sum(1 for t in tensors if not t.nbytes)
    held = f" but the {empty} the model holds empty" if empty else ""
    _print(f"verified {len(tensors)} tensors (names, shapes, dtypes; none empty{held})")
    configs = [n for n in staging.other_names if n in _CONFIG_FILES]
    others = len(staging.other_names) - len(configs)
    if staging.other_names:
        files = configs + ([f"{others} tokenizer file{'s' if others > 1 else ''}"] if others else [])
        listed = ", ".join(files[:-1]) + " and " + files[-1] if len(files) > 1 else files[0]
        _print(f"wrote {listed} to {staging.out}, after the weights")
    if staging.removed:
        more = f" (+{len(staging.removed) - 3} more)" if len(staging.removed) > 3 else ""
        _print(f"removed stale {', '.join(staging.removed[:3])}{more} from {staging.out}")


# --------------------------------------------------------------------------- what to write


class PlannedTensor(NamedTuple):
    """A tensor to write: its `name`, `dtype` and `shape` as the model holds it (`ds_shape` under ZeRO-3);
    `tensor`, the value from `state_dict()`; `param`, the ZeRO-3 parameter to gather first, or None."""
    name: str
    dtype: object
    shape: tuple
    tensor: object = None
    param: object = None

    @property
    def nbytes(self):
        count = 1
        for size in self.shape:
            count *= int(size)
        return count * _itemsize(self.dtype)


@functools.lru_cache(maxsize=None)
def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _plan(module, strategy, gather, drop, out_dir):
    """([PlannedTensor] in state_dict order, a ZeRO-3 alias right after its parameter; notes; a refusal):
    the refusal is a ValueError for a dtype safetensors cannot store (the fallback saves it), else None."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    tensors, notes, refused, seen, spans = [], [], [], {}, {}
    for name, value in module.state_dict().items():
        if ("lora" in name) if drop is None else drop(name):
            continue
        source = params.get(name, buffers.get(name, value))
        partitioned = hasattr(source, "ds_shape")
        if partitioned:  # a ZeRO-3 alias is the very same parameter object
            first = seen.setdefault(id(source), name)
            alias, exact = (first, True) if first != name else (None, False)
        else:
            alias, exact = find_overlap(name, value, spans)
        if alias is not None and exact and strategy == "dedupe":
            notes.append(f"{name} shares storage with {alias}: not written (transformers re-ties it on load)")
            continue
        if alias is not None:
            view = "" if exact else " (a different view)"
            notes.append(f"{name} shares storage with {alias}{view}: written as its own copy")
        shape = tuple(int(d) for d in (source.ds_shape if partitioned else source.shape))
        if tuple(value.shape) != shape and not (gather and partitioned):  # refused before a byte is written
            raise SaveError(f"dsfix: verification failed: {name} is empty {list(value.shape)} but the model holds "
                            f"{list(shape)} (a ZeRO-3 placeholder saved without gathering?); nothing was written "
                            f"to {os.path.normpath(out_dir)}", os.path.normpath(out_dir))
        if value.dtype not in DTYPES:
            refused.append(f"{name} ({value.dtype})")
        param = source if gather and partitioned else None
        at = len(tensors)
        if param is not None and alias is not None:  # right after its parameter: gathered once for both
            at = 1 + max(i for i, t in enumerate(tensors) if t.param is param)
        tensors.insert(at, PlannedTensor(name, value.dtype, shape, value, param))
    refusal = ValueError(f"dsfix: safetensors cannot store {', '.join(refused)}") if refused else None
    return tensors, notes, refusal


def find_overlap(name, tensor, seen):
    """(the first tensor recorded in `seen` whose memory `tensor` overlaps, or None; whether it is the same
    view: same start, dtype, shape and strides). Records `tensor` under `name` in `seen`, a dict the caller
    keeps across calls. Empty tensors and tensors on the meta device overlap nothing."""
    if not tensor.numel() or tensor.device.type == "meta":
        return None, False
    storage, start = tensor.untyped_storage(), tensor.data_ptr()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    end = start + tensor.element_size() * (1 + last)
    view = (start, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    earlier = seen.setdefault((str(tensor.device), storage.data_ptr(), storage.nbytes()), [])
    alias, exact = None, False
    for other, other_start, other_end, other_view in earlier:
        overlaps = start < other_end and other_start < end
        if overlaps and (alias is None or (not exact and view == other_view)):
            alias, exact = other, view == other_view
    earlier.append((name, start, end, view))
    return alias, exact


def _buckets(tensors, limit_bytes):
    """The gathers: whole modules up to `limit_bytes` (a bigger module alone; 0: one parameter at a time),
    a tied alias always in its parameter's bucket."""
    buckets, size, owner = [], 0, None
    for t in tensors:
        module = t.name.rpartition(".")[0]
        alias = bool(buckets) and t.param is not None and t.param is buckets[-1][-1].param
        full = limit_bytes <= 0 or (module != owner and size + t.nbytes > limit_bytes)
        if not buckets or (full and not alias):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size, owner = size + t.nbytes, module
    return buckets


# --------------------------------------------------------------------------- the files


class WeightFile(NamedTuple):
    """One safetensors file: `header` (its 8-byte length, then the JSON padded with spaces to a multiple of
    8), then the tensors, each at `offsets[name]` from the start of the file; `size` in bytes."""
    name: str
    tensors: list
    header: bytes
    offsets: dict
    size: int


def layout_files(tensors, max_shard_size=DEFAULT_MAX_SHARD_SIZE):
    """The files for `tensors` (anything with name, dtype, shape and nbytes, e.g. PlannedTensor): runs in the
    given order of at most `max_shard_size` bytes (a bigger tensor alone), one file `model.safetensors` or
    shards `model-0000i-of-0000n.safetensors`. Inside a file the tensors go by dtype (DTYPES' order) then
    name, as safetensors' save_file puts them: the same header and offsets as save_file's."""
    groups, size = [], 0
    for t in tensors:
        if not groups or size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    groups = groups or [[]]
    files = []
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        files.append(_layout_one(name, group))
    return files


def _layout_one(name, group):
    header, positions, at = {"__metadata__": {"format": "pt"}}, {}, 0
    for t in sorted(group, key=lambda t: (_ORDER[t.dtype], t.name)):
        header[t.name] = {"dtype": DTYPES[t.dtype], "shape": [int(d) for d in t.shape],
                          "data_offsets": [at, at + t.nbytes]}
        positions[t.name] = at
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # so the data, too, starts at a multiple of 8
    head = len(text).to_bytes(8, "little") + text
    offsets = {k: len(head) + v for k, v in positions.items()}
    return WeightFile(name, list(group), head, offsets, len(head) + at)


class WeightWriter:
    """Writes laid-out files into `folder`: `open()` creates each file with its header, `write(name, data)`
    puts one tensor's bytes at its offset (from memory, no numpy), `finish()` fsyncs and checks every file
    and writes the index when there are shards; `close()` closes what is open. Returns names in order."""

    def __init__(self, folder, files):
        self.folder = folder
        self.files = list(files)
        self._home = {t.name: (f, t) for f in self.files for t in f.tensors}
        self._fds = {}
        self._written = set()

    def open(self):
        for f in self.files:
            fd = os.open(os.path.join(self.folder, f.name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            self._fds[f.name] = fd
            _pwrite_all(fd, f.header, 0)
            os.ftruncate(fd, f.size)

    def write(self, name, data):
        """`data`: the tensor's values, on any device; its dtype and shape must be the header's. From a GPU
        it comes to the host _HOST_CHUNK_BYTES at a time, so the host holds no more than that of it."""
        f, planned = self._home[name]
        if data.dtype != planned.dtype or tuple(data.shape) != tuple(planned.shape) or data.device.type == "meta":
            raise RuntimeError(f"dsfix: {name} is {list(data.shape)} {data.dtype} on {data.device} but the header "
                               f"says {list(planned.shape)} {planned.dtype}")
        flat = data.detach().reshape(-1)  # a copy only for a view that is not contiguous
        step = _HOST_CHUNK_BYTES // flat.element_size() if flat.device.type != "cpu" else max(1, flat.numel())
        for start in range(0, flat.numel(), step):
            part = flat[start:start + step].to("cpu")  # held here while its bytes are written
            view = (ctypes.c_ubyte * (part.numel() * part.element_size())).from_address(part.data_ptr())
            _pwrite_all(self._fds[f.name], memoryview(view).cast("B"), f.offsets[name] + start * part.element_size())
            del part, view  # before the next piece comes
        self._written.add(name)

    def finish(self):
        """fsyncs each file and checks it: every tensor written, safetensors opens it (its length agrees
        with its header), and its header reads back as written. Then the index, when there are shards."""
        missing = [name for name in self._home if name not in self._written]
        if missing:
            raise RuntimeError(f"dsfix: verification failed: {len(missing)} tensors were not written, "
                               f"the first {missing[0]}")
        for f in self.files:
            os.fsync(self._fds[f.name])
        self.close()
        for f in self.files:
            path = os.path.join(self.folder, f.name)
            with safe_open(path, framework="pt"), open(path, "rb") as handle:
                if handle.read(len(f.header)) != f.header:
                    raise RuntimeError(f"dsfix: verification failed: {path} does not hold the header written")
        names = [f.name for f in self.files]
        if len(self.files) > 1:
            weight_map = {t.name: f.name for f in self.files for t in f.tensors}
            index = {"metadata": {"total_size": sum(t.nbytes for f in self.files for t in f.tensors)},
                     "weight_map": dict(sorted(weight_map.items()))}
            _write_text(os.path.join(self.folder, INDEX_NAME), json.dumps(index, indent=2) + "\n")
            names.append(INDEX_NAME)
        return names

    def close(self):
        while self._fds:
            os.close(self._fds.popitem()[1])


def _pwrite_all(fd, data, offset):
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_text(path, text):
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


# --------------------------------------------------------------------------- NaN and Inf


def is_finite(tensor, chunk_elements=_CHECK_ELEMENTS):
    """Whether `tensor` holds no NaN and no Inf (integers always hold none). Checked `chunk_elements` at a
    time through each chunk's minimum and maximum, which are NaN or infinite when any element is: no copy
    of the tensor, but a chunk widened to float32 where this torch has no min/max for its dtype (float8;
    float16 on the CPU before torch 2.2)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return True
    flat = tensor.detach().reshape(-1)
    widen = not _has_aminmax(flat.device.type, flat.dtype)
    for start in range(0, flat.numel(), chunk_elements):
        part = flat[start:start + chunk_elements]
        low, high = torch.aminmax(part.float() if widen else part)
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _has_aminmax(device_type, dtype):
    try:
        torch.aminmax(torch.zeros(2, dtype=dtype, device=device_type))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


class _FiniteCount:
    """The tensors written that hold NaN or Inf, in write order; a tied alias's memory checked once. Called
    from one checking thread at a time, in order."""

    def __init__(self):
        self.bad = []
        self._seen = {}

    def new_bucket(self):
        self._seen.clear()  # a gathered bucket's memory is freed after it: its addresses mean nothing later

    def check(self, name, data):
        key = (data.data_ptr(), data.dtype, tuple(data.shape), tuple(data.stride()))
        ok = self._seen.get(key)
        if ok is None:
            ok = self._seen[key] = is_finite(data)
        if not ok:
            self.bad.append(name)


# --------------------------------------------------------------------------- rank 0: staging and publishing


class _Staging:
    """Rank 0's new save, put together in a hidden folder inside the output folder, then moved into place.
    `start`, `write` and `finish` return the first error instead of raising it (the ranks decide together)."""

    def __init__(self, out_dir, gather):
        self.out = os.path.normpath(out_dir)
        self.path = os.path.join(self.out, f"{_STAGING_PREFIX}{os.getpid()}")
        self.gather = gather  # whether each bucket's memory is let go after it (ZeRO-3 gathers)
        self.writer = None
        self.weight_names, self.other_names, self.removed = [], [], []
        self.finite = _FiniteCount()
        self.checker, self.checks = None, []  # the thread that checks for NaN and Inf, and its work

    def start(self, tensors, limit):
        try:
            os.makedirs(self.out, exist_ok=True)
            if os.path.lexists(self.path):  # left by a killed save of a process with this id
                shutil.rmtree(self.path)
            os.mkdir(self.path)
            self.writer = WeightWriter(self.path, layout_files(tensors, limit))
            self.writer.open()
            self.checker = ThreadPoolExecutor(max_workers=1)
        except Exception as exc:
            return exc
        return None

    def write(self, bucket):
        """Writes the bucket's tensors, each checked for NaN and Inf meanwhile in a second thread (torch's
        kernels and the file writes both let the other thread run): the check takes time the writes and the
        fsyncs leave idle. A gathered bucket's checks end before its memory is let go; else they run on
        while the files are fsynced."""
        try:
            for t in bucket:
                data = (t.tensor if t.param is None else t.param.data).detach()
                self.checks.append(self.checker.submit(self.finite.check, t.name, data))
                self.writer.write(t.name, data)
            if self.gather:
                self._end_checks()
                self.finite.new_bucket()
        except Exception as exc:
            return exc
        return None

    def _end_checks(self):
        while self.checks:
            self.checks.pop(0).result()  # raises what the check raised

    def finish(self, config_module, tokenizer):
        """The weights checked, then the config and tokenizer staged, then everything moved into place."""
        try:
            self.weight_names = self.writer.finish()
            self._end_checks()
            self.checker.shutdown()
            _stage_config(config_module, self.path)
            _stage_tokenizer(tokenizer, self.path)
            staged = sorted(os.listdir(self.path))
            configs = [n for n in _CONFIG_FILES if n in staged]
            self.other_names = configs + [n for n in staged if n not in configs and n not in self.weight_names]
            for name in self.other_names:
                _fsync_path(os.path.join(self.path, name))
            self._publish()
        except Exception as exc:
            return exc
        return None

    def _publish(self):
        """The final phase (`_put_in_place`), then the staging folder goes, with the old files, and so do
        what killed saves left."""
        stale = _stale_weight_files(self.out, self.weight_names)
        _put_in_place(self.path, self.out, self.weight_names + self.other_names, stale)
        self.removed = stale
        self.discard()
        _remove_leftovers(self.out)

    def discard(self):
        if self.checker is not None:
            self.checker.shutdown(wait=True, cancel_futures=True)
        if self.writer is not None:
            self.writer.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _put_in_place(staging, folder, names, stale):
    """Moves each of `names` from `staging` into `folder` in order (the file it replaces kept aside in
    `staging`/.replaced), then the `stale` files aside, then fsyncs `folder`; all undone if one fails.
    Ctrl-C and SIGTERM wait for it. What it moves is written down first, for find_leftovers."""
    aside = os.path.join(staging, _ASIDE)
    moves = []
    with _signals_held():
        try:
            _write_text(os.path.join(staging, _JOURNAL), json.dumps({"in": names, "aside": stale}) + "\n")
            os.mkdir(aside)
            for name in names:
                target = os.path.join(folder, name)
                if os.path.lexists(target):
                    _move(target, os.path.join(aside, name), moves)
                _move(os.path.join(staging, name), target, moves)
            for name in stale:
                _move(os.path.join(folder, name), os.path.join(aside, name), moves)
            _fsync_path(folder)
        except BaseException:
            _undo(moves)
            raise


def _move(source, target, moves):
    os.rename(source, target)
    moves.append((source, target))


def _undo(moves):
    for source, target in reversed(moves):
        try:
            os.rename(target, source)
        except OSError:
            pass


def _stage_config(module, folder):
    """config.json as upstream writes it (`to_json_file`), and generation_config.json when the model has one."""
    config = getattr(module, "config", None) if module is not None else None
    if config is None:
        return
    config.to_json_file(os.path.join(folder, "config.json"))
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and (can_generate is None or can_generate()):
        generation.to_json_file(os.path.join(folder, "generation_config.json"))


def _stage_tokenizer(tokenizer, folder):
    """The tokenizer's files, saved into a folder of their own inside `folder`, then moved up beside the
    weights (a name already there, such as config.json, keeps the model's file)."""
    if tokenizer is None:
        return
    own = os.path.join(folder, ".tokenizer")
    os.mkdir(own)
    try:
        tokenizer.save_pretrained(own)
    except Exception as exc:  # a tokenizer without save_pretrained, or an old one: upstream's own call
        if isinstance(exc, OSError) and exc.errno is not None:  # the disk failed, not the tokenizer
            raise
        _print(f"tokenizer.save_pretrained failed ({type(exc).__name__}: {exc}); using save_vocabulary")
        shutil.rmtree(own)
        os.mkdir(own)
        tokenizer.save_vocabulary(own)
    for name in sorted(os.listdir(own)):
        if not os.path.lexists(os.path.join(folder, name)):
            os.rename(os.path.join(own, name), os.path.join(folder, name))
    shutil.rmtree(own)


def _stale_weight_files(folder, keep):
    """The weight files in `folder` that a save of `keep` leaves out: an old pytorch_model.bin, old shards,
    a single file replaced by shards (and the other way round)."""
    return [name for name in sorted(os.listdir(folder))
            if name not in keep and _is_weight_file(name) and os.path.isfile(os.path.join(folder, name))]


def _is_weight_file(name):
    single = name in ("model.safetensors", INDEX_NAME, "pytorch_model.bin", "pytorch_model.bin.index.json")
    shard = "-of-" in name and ((name.startswith("model-") and name.endswith(".safetensors")) or
                                (name.startswith("pytorch_model-") and name.endswith(".bin")))
    return single or shard


class Leftover(NamedTuple):
    """What a killed save left (`find_leftovers`): `path`, its staging folder or temporary file; `moving`,
    whether it was killed in its final phase. Then, of the files that phase moves: `moved_in`, the killed
    save's files now in place; `pending`, its files not yet moved in (in `path`), of which `missing` have no
    file in place (the previous one is in `path`/.replaced); `aside`, the previous save's files moved into
    `path`/.replaced; `stale`, the previous save's weight files it had yet to move aside. The folder mixes the
    two saves when something was moved and something was not (`mixed`)."""
    path: str
    moving: bool = False
    moved_in: tuple = ()
    pending: tuple = ()
    missing: tuple = ()
    aside: tuple = ()
    stale: tuple = ()

    @property
    def mixed(self):
        return bool((self.moved_in or self.aside) and (self.pending or self.stale))


def find_leftovers(folder):
    """[Leftover] in `folder` and in its FALLBACK_FOLDER: staging folders of killed saves, and temporary
    weight files (".NAME.PID.dsfix-tmp", of the fallback and of dsfix's earlier inline save)."""
    found = []
    for where in (folder, os.path.join(folder, FALLBACK_FOLDER)):
        try:
            names = sorted(os.listdir(where))
        except OSError:
            continue
        for name in names:
            path = os.path.join(where, name)
            if name.startswith(_STAGING_PREFIX) and os.path.isdir(path):
                found.append(_staging_leftover(where, path))
            elif name.startswith(".") and name.endswith(_OLD_TMP_SUFFIX) and \
                    _is_weight_file(name[1:].rsplit(".", 2)[0]) and not os.path.isdir(path):
                found.append(Leftover(path))
    return found


def _staging_leftover(folder, path):
    try:
        with open(os.path.join(path, _JOURNAL), encoding="utf-8") as handle:
            plan = json.load(handle)
        moving, stale = [str(n) for n in plan["in"]], [str(n) for n in plan["aside"]]
    except (OSError, ValueError, KeyError, TypeError):  # killed before its final phase: nothing of it in place
        return Leftover(path)
    try:
        aside = tuple(sorted(os.listdir(os.path.join(path, _ASIDE))))
    except OSError:
        aside = ()
    pending = tuple(n for n in moving if os.path.lexists(os.path.join(path, n)))
    return Leftover(path, True, tuple(n for n in moving if n not in pending), pending,
                    tuple(n for n in pending if not os.path.lexists(os.path.join(folder, n))), aside,
                    tuple(n for n in stale if n not in aside and os.path.lexists(os.path.join(folder, n))))


def _remove_leftovers(folder):
    """What killed saves left (find_leftovers). Best-effort: the new save is in place already, and what
    cannot go (a folder of such a name, another user's file in a shared folder) stays."""
    for leftover in find_leftovers(folder):
        if os.path.basename(leftover.path).startswith(_STAGING_PREFIX):
            shutil.rmtree(leftover.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(leftover.path)


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM wait until the block ends, then take effect (the main thread only: Python runs
    signal handlers nowhere else)."""
    held = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    if threading.current_thread() is not threading.main_thread():
        held = []
    caught = []
    previous = {s: signal.signal(s, lambda number, frame: caught.append(number)) for s in held}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if caught:
            signal.raise_signal(caught[0])


# --------------------------------------------------------------------------- ZeRO-3: gathers and decisions


@contextlib.contextmanager
def _gathered(bucket):
    """Under ZeRO-3, the bucket's partitioned parameters gathered on every rank (a collective)."""
    params = {id(t.param): t.param for t in bucket
              if t.param is not None and t.param.ds_status.name == "NOT_AVAILABLE"}  # not those already whole
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params.values())):
        yield
    _trim_heap()


def _trim_heap():
    """Hands the heap memory that a bucket's gathers freed back to the system, where the C library is glibc.
    Without it glibc keeps what the gathers free in pieces too scattered to reuse, and rank 0 grows bucket by
    bucket: with Qwen3-4B on CPU ranks, 2,484 MiB above the partitioned model, against 1,484 MiB for the
    gather of the largest tensor alone; with it, 1,491 (docs/benchmarks.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS), or no C library by that name
        return None


class _Ranks:
    """What the ranks of a ZeRO-3 save agree on: whether rank 0's writing failed, and how. With one rank,
    or no gathers, each answer is rank 0's own."""

    def __init__(self, gather):
        dist = torch.distributed
        self.on = gather and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.device = None
        if self.on:
            from deepspeed.accelerator import get_accelerator

            self.device = torch.device(get_accelerator().current_device_name())

    def any_failed(self, failed):
        if not self.on:
            return failed
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def outcome(self, error):
        """None when rank 0 saved, else (whether the disk failed, what failed), the same on every rank."""
        mine = None if error is None else (_disk_failed(error), _describe(error))
        if not self.on:
            return mine
        shared = [mine]
        torch.distributed.broadcast_object_list(shared, src=0)
        return shared[0]


def _disk_failed(error):
    return isinstance(error, OSError) and error.errno in _DISK_ERRNOS


def _describe(error):
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{where}"
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- the fallback


def _fallback(module, tensors, buckets, out_dir, rank, tokenizer, why):
    """Every rank walks the gathers again; rank 0 saves the tensors as upstream does (torch.save to
    pytorch_model.bin, the model's config.json beside it, for `dsfix convert`) in FALLBACK_FOLDER inside
    `out_dir`. Returns that folder."""
    folder = os.path.join(os.path.normpath(out_dir), FALLBACK_FOLDER)
    state, copies, problem = {}, {}, None
    for bucket in buckets:
        with _gathered(bucket):
            if rank != 0 or problem is not None:
                continue
            try:
                for t in bucket:
                    if t.param is None:
                        state[t.name] = t.tensor.detach().to("cpu")  # no copy of a tensor on the CPU
                        continue
                    if id(t.param) not in copies:  # gathered memory is let go after the bucket: one host copy
                        copies[id(t.param)] = t.param.data.detach().to("cpu", copy=True)
                    state[t.name] = copies[id(t.param)]  # a tied alias takes its parameter's copy
            except Exception as exc:
                problem = exc
    if rank != 0:
        return folder
    try:
        if problem is not None:
            raise problem
        beside, missed = _write_fallback(folder, state, module, tokenizer)
    except Exception as exc:
        _print(f"FALLBACK FAILED: the save to {os.path.normpath(out_dir)} failed ({why}) and so did saving the "
               f"weights as pytorch_model.bin in {folder} ({_describe(exc)})")
        return folder
    with_what = f"with {' and '.join(beside)}" if "config.json" in beside else \
        "without config.json (copy the model's config.json there)"
    if missed:
        with_what += f"; not written: {', '.join(missed)}"
    _print(f"FALLBACK: the safetensors save to {os.path.normpath(out_dir)} failed ({why}); the weights are saved "
           f"as upstream saves them, {os.path.join(folder, 'pytorch_model.bin')}, {with_what}: "
           f"`dsfix convert {folder}` turns them into safetensors")
    return folder


def _write_fallback(folder, state, module, tokenizer):
    """pytorch_model.bin, and what can be written beside it (config.json, the tokenizer: a failure there keeps
    the weights), staged in a hidden folder inside `folder`, then put in place as the save's final phase
    does, so a failure leaves `folder` as it was. Returns (what is beside the weights, what is not and why)."""
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    staging = os.path.join(folder, f"{_STAGING_PREFIX}{os.getpid()}")
    try:
        if os.path.lexists(staging):  # left by a killed save of a process with this id
            shutil.rmtree(staging)
        os.mkdir(staging)
        torch.save(state, os.path.join(staging, "pytorch_model.bin"))
        names, beside, missed = ["pytorch_model.bin"], [], []
        for what, write in (("config.json", lambda: _fallback_config(getattr(module, "config", None), staging)),
                            ("the tokenizer", lambda: _fallback_tokenizer(tokenizer, staging))):
            try:
                written = write()
            except Exception as exc:  # the weights are what matters here
                missed.append(f"{what} ({_describe(exc)})")
                continue
            names += written
            beside += [what] if written else []
        for name in names:
            _fsync_path(os.path.join(staging, name))
        _put_in_place(staging, folder, names, [])
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    _remove_leftovers(folder)
    return beside, missed


def _fallback_tokenizer(tokenizer, staging):
    """The tokenizer's files (`save_pretrained`) in a folder of their own, then moved up into `staging`;
    their names. A failure removes those already moved up, then raises."""
    if tokenizer is None:
        return []
    own, moved = os.path.join(staging, ".tokenizer"), []
    try:
        os.mkdir(own)
        tokenizer.save_pretrained(own)
        for name in sorted(os.listdir(own)):
            if name != "pytorch_model.bin" and not os.path.lexists(os.path.join(staging, name)):
                os.rename(os.path.join(own, name), os.path.join(staging, name))
                moved.append(name)
    except BaseException:
        for name in moved:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(staging, name))
        raise
    finally:
        shutil.rmtree(own, ignore_errors=True)
    return moved


def _fallback_config(config, staging):
    """config.json as upstream writes it, else (a config whose to_json_file fails, not the disk) its dictionary
    as JSON; its name, or none without a config."""
    if config is None:
        return []
    path = os.path.join(staging, "config.json")
    try:
        config.to_json_file(path)
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise
        _write_text(path, json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str) + "\n")
    return ["config.json"]


# --------------------------------------------------------------------------- small helpers


def _unwrap(model):
    """The module under DeepSpeed/DDP (`.module`) and torch.compile (`_orig_mod`) wrappers."""
    inner = getattr(model, "module", getattr(model, "_orig_mod", None))
    return _unwrap(inner) if isinstance(inner, torch.nn.Module) else model


def _print(message):
    print(f"[dsfix] {message}\n", end="", flush=True)  # one write: lines of other ranks cannot cut into it
