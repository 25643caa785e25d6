"""bench_scale.py --more SIZE: verify's bounds beyond one folder, at one size.

Model folders are written here directly, as a conversion writes them (bf16 safetensors shards, an index,
config.json), with the checkpoint generator's seeded values (scale_ckpt.fill), one shard at a time; no
checkpoint is needed. Then, each method in its own process from a cold page cache, under the memory guard
(scale_measure.cold):

  verify --against   ``dsfix verify A --against B``, two folders of the size with the same values, judged by one
                     read of both folders
  step 3             ``dsfix verify S``, a step-3 output folder: ``actor/`` (A's files, hard links),
                     ``actor_ema/`` (B's) and ``critic/`` (DeepSpeed-Chat's critic layout, ``rwtransformer.*`` and
                     ``v_head.weight``, of Qwen3-0.6B shapes: a large actor beside a small critic, as DeepSpeed-Chat's
                     examples pair them), judged by one read of the three
  PEFT merge         ``dsfix convert P --merge --base A --output M``, P a LoRA adapter of A (PEFT's own names and
                     adapter_config.json, every linear layer of every block, r 16), judged by the disk floor of
                     the same bytes: A read once, then M's bytes written once and fsynced
  verify of M        ``dsfix verify M``, judged by one read of M

The bounds are the issue's for verify: peak anonymous memory <= 1 GiB + the largest tensor, time <= 1.5x the
read (for the merge, a conversion: 1.5x its floor as well; its memory bound the same).
"""
import json
import math
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import scale_ckpt  # noqa: E402
import scale_measure as measure  # noqa: E402

SHARD_BYTES = 2 << 30
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CRITIC_SIZE = {"narrow": "narrow"}  # the critic's shapes by the actor's size: Qwen3-0.6B's but for --more narrow


def _shards(named):
    """[(name, shape)] grouped into shards of about SHARD_BYTES (bf16), in order."""
    shards, current, size = [], [], 0
    for name, shape in named:
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    return shards + ([current] if current else [])


def write_folder(folder, config, named):
    """A bf16 safetensors model folder of ``named`` [(key, shape)], values by the key's name, with config.json."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder)
    shards = _shards(named)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        tensors = {name: scale_ckpt.seeded(name, shape, torch.bfloat16) for name, shape in shard}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update((name, file) for name in tensors)
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(dict(config, torch_dtype="bfloat16"), handle, indent=2)
    common.fsync_tree(folder)
    return total


def model_keys(config):
    """[(key, shape)] of the config's causal LM, as a save writes it (a tied alias not stored)."""
    params, tied = scale_ckpt.shapes_of(config)
    return [(n, s) for n, s in params if n not in tied]


def critic_keys(config):
    """DeepSpeed-Chat's critic of the config's base: the base transformer under ``rwtransformer.``, no language
    model head, and a one-output ``v_head``."""
    keys = [("rwtransformer." + n[len("model."):], s) for n, s in model_keys(config) if n.startswith("model.")]
    return keys + [("v_head.weight", (1, config["hidden_size"]))]


def write_adapter(folder, config, base):
    """A LoRA adapter of ``config``'s model as PEFT saves it: its names from PEFT's own state dict of a PEFT model
    built on the meta device, seeded values (fp32), adapter_config.json by PEFT, naming ``base``."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**kwargs))
    model.config.name_or_path = base  # what PEFT writes as base_model_name_or_path
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS)
    peft_model = get_peft_model(model, lora)
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    os.makedirs(folder)
    tensors = {k: scale_ckpt.seeded(k, s, torch.float32) for k, s in shapes.items()}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    lora.save_pretrained(folder)
    common.fsync_tree(folder)
    return sum(t.numel() * 4 for t in tensors.values())


def _link_folder(src, dst):
    """``dst`` holding hard links to ``src``'s files: the same bytes on disk, no copy."""
    os.makedirs(dst)
    for name in os.listdir(src):
        os.link(os.path.join(src, name), os.path.join(dst, name))


def run_size(size, args, work):
    """Every measure above at ``size``; the folders deleted at the end."""
    config = scale_ckpt.config_of(size)
    keys = model_keys(config)
    root = os.path.join(work, "more")
    a, b, step3, adapter, merged = (os.path.join(root, n) for n in ("a", "b", "step3", "adapter", "merged"))
    found = {"size": size, "largest_bytes": max(scale_ckpt.tensor_bytes(config))}
    results = found["results"] = {}
    try:
        print("[scale] more, %s: writing two model folders" % size, file=sys.stderr, flush=True)
        begin = time.perf_counter()
        found["folder_bytes"] = write_folder(a, config, keys)
        write_folder(b, config, keys)
        found["make_s"] = time.perf_counter() - begin
        results["read_pair"] = measure.read_once([a, b], args, "one read of both folders")
        results["against"] = measure.dsfix(["verify", a, "--against", b], args, "dsfix verify --against")

        critic_config = scale_ckpt.config_of(CRITIC_SIZE.get(size, "0.6B"))
        _link_folder(a, os.path.join(step3, "actor"))
        _link_folder(b, os.path.join(step3, "actor_ema"))
        write_folder(os.path.join(step3, "critic"), critic_config, critic_keys(critic_config))
        results["read_step3"] = measure.read_once([step3], args, "one read of the step-3 folder")
        results["step3"] = measure.dsfix(["verify", step3], args, "dsfix verify (step 3)")
        shutil.rmtree(step3)
        shutil.rmtree(b)

        found["adapter_bytes"] = write_adapter(adapter, config, a)
        results["read_base"] = measure.read_once([a], args, "one read of the base")
        floor = measure.python("-c", measure.WRITE, os.path.join(root, "floor.bin"), str(found["folder_bytes"]))
        results["write_floor"] = measure.cold(floor, args, "the output's bytes written once")
        results["write_floor"]["write_s"] = float(results["write_floor"]["stdout"])
        results["merge"] = measure.dsfix(["convert", adapter, "--merge", "--base", a, "--output", merged], args,
                                         "dsfix convert --merge")
        if results["merge"]["ok"]:
            results["read_merged"] = measure.read_once([merged], args, "one read of the merged folder")
            results["verify_merged"] = measure.dsfix(["verify", merged], args, "dsfix verify (merged)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for res in results.values():
        res.pop("stdout", None)
        res["stderr"] = res.get("stderr", "").replace(work, "WORK")
    found["ok"] = all(results.get(key, {}).get("ok") for _, key, _, _ in ROWS)
    return found


ROWS = (  # (label, the method's result, what it is judged by, how that is named)
    ("dsfix verify A --against B (two folders)", "against", ("read_pair",), "one read of both"),
    ("dsfix verify, a step-3 folder (actor, actor_ema, a small critic)", "step3", ("read_step3",),
     "one read of the three"),
    ("dsfix convert --merge, a LoRA adapter into its base", "merge", ("read_base", "write_floor"),
     "the base read + the output written"),
    ("dsfix verify of the merged folder", "verify_merged", ("read_merged",), "one read of it"),
)


def _seconds(res):
    return res.get("read_s", res.get("write_s"))


def report(more):
    """The table and the bounds, size by size."""
    rows, lines = [], []
    for found in more:
        results, bound = found["results"], measure.GIB + found["largest_bytes"]
        for label, key, judges, judged_by in ROWS:
            res = results.get(key)
            if res is None:
                continue
            name = "%s, %s" % (found["size"], label)
            if not res.get("ok") or res.get("killed_at"):
                rows.append([name] + ["-"] * 6 + ["FAILED"])
                lines.append("- %s: FAILED: %s" % (name, (res.get("stderr") or "").strip().splitlines()[-1:]))
                continue
            floor = sum(_seconds(results[j]) for j in judges)
            timed = floor >= 0.5  # a read too short to time (the narrow model) has no rate to judge by
            ratio = res["wall_s"] / floor if timed else None
            fits = res["anon_peak"] <= bound
            rows.append([name, "%.1f" % res["wall_s"], "%.1f" % res["cpu_s"], "%.0f" % (res["anon_peak"] / common.MIB),
                         "%.1f (%s)" % (floor, judged_by), "%.2f" % ratio if timed else "-",
                         "%.0f" % (bound / common.MIB), "PASS" if fits and (not timed or ratio <= 1.5) else "MISS"])
            line = "- %s: anon %.2f GiB (<= 1 + the largest tensor, %.2f: %s)" % (
                name, res["anon_peak"] / measure.GIB, bound / measure.GIB, "PASS" if fits else "MISS")
            if timed:
                line += ", %.2fx %s (%.1f s; <= 1.5: %s)" % (ratio, judged_by, floor,
                                                             "PASS" if ratio <= 1.5 else "MISS")
            lines.append(line)
    header = ["size, what", "wall s", "CPU s", "anon MiB", "judged by s", "ratio", "memory bound MiB", "bounds"]
    return common.table(header, rows) + "\n\n" + "\n".join(lines)
