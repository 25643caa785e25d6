"""The device check's child modes (``device_check.py --child NAME ...``), run in the stages' Python (its
installed folders first on the path): the modules' versions, the device, a narrow model folder, and the
bit-for-bit comparison the step-1 and engine rows rest on. Each prints one JSON line."""
from __future__ import annotations

import json
import os
import sys

from device_base import SEED, TIED, TRAINER


def child_modules(names):
    """{module: its distribution's version, or None when it cannot be imported}."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            module = __import__(name)
            try:
                found[name] = version(name.replace("_", "-"))
            except PackageNotFoundError:
                found[name] = getattr(module, "__version__", "?")
        except Exception:
            found[name] = None
    return found


def child_versions(device, *modules):
    """This Python's version, the modules' versions (None: not importable), and the device's name; device_ok
    False with device_problem when ``device`` is cuda and torch sees none."""
    import platform

    facts = {"python": platform.python_version()}
    facts.update(child_modules(modules))
    facts["device_ok"] = True
    try:
        import torch
    except Exception as e:
        facts.update(device_ok=False, device_problem="torch cannot be imported: %s" % e)
        return facts
    if device == "cuda":
        if not torch.cuda.is_available():
            facts.update(device_ok=False, device_problem="--device cuda, but torch sees no CUDA device")
        else:
            props = torch.cuda.get_device_properties(0)
            facts["device"] = "%s, %.0f GiB, CUDA %s" % (props.name, props.total_memory / 2**30, torch.version.cuda)
    else:
        facts["device"] = "CPU: %s, %d cores" % (platform.processor() or platform.machine(), os.cpu_count() or 0)
    return facts


def child_model(folder):
    """The narrow Qwen3 (fixtures/step1_trainer/tiny_qwen3.py) with its tokenizer, as a local model folder."""
    sys.path.insert(0, os.path.dirname(TRAINER))
    from tiny_qwen3 import tiny_qwen3_model, tiny_qwen3_tokenizer

    model = tiny_qwen3_model(seed=SEED)
    model.save_pretrained(folder)
    tiny_qwen3_tokenizer().save_pretrained(folder)
    return {"folder": folder}


def child_compare(folder, other):
    """Every tensor of the safetensors folder ``folder`` against ``other``: a .bin state dict, or a reference.pt
    holding one (``state_dict``); a tied alias ``other`` lacks is compared with its partner. Bit for bit: the
    same dtype, shape and bytes. {"total", "equal", "first", "ok"}."""
    import glob

    import torch
    from safetensors.torch import load_file

    mine = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        mine.update(load_file(path))
    theirs = torch.load(other, map_location="cpu", weights_only=True)
    theirs = theirs.get("state_dict", theirs)
    equal, first = 0, ""
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key, theirs.get(TIED.get(key, ""), None))
        same = (a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
        equal += same
        if not same and not first:
            first = "%s: %s" % (key, "missing in %s" % ("the save" if a is None else os.path.basename(other))
                                if a is None or b is None else "%s %s vs %s %s" % (a.dtype, list(a.shape), b.dtype,
                                                                                    list(b.shape)))
    total = len(set(mine) | set(theirs))
    return {"total": total, "equal": equal, "first": first, "ok": equal == total and total > 0}


def run_child(argv):
    name, rest = argv[0], argv[1:]
    if name == "modules":
        print(json.dumps(child_modules(rest)))
    elif name == "versions":
        print(json.dumps(child_versions(*rest)))
    elif name == "model":
        print(json.dumps(child_model(rest[0])))
    elif name == "compare":
        results = [child_compare(rest[i], rest[i + 1]) for i in range(0, len(rest), 2)]
        print(json.dumps({"results": results}))
        return 0 if all(r["ok"] for r in results) else 1
    return 0
