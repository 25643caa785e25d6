"""One rank of tests/test_save_module_ranks.py: the save module under real DeepSpeed engines, runs in order.

Launched by the ``deepspeed`` launcher on CPU ranks (gloo). ``--runs`` is a JSON list of runs, each done in
turn in this one process (one launch for all of them): it builds the narrow Qwen3 (tied embeddings), wraps it
in an engine at its ``zero_stage``, trains two steps, writes the reference (the whole state dict, gathered, and
the logits of a fixed batch) to ``WORK/NAME/ref/reference.pt``, then runs its ``steps`` in order, each into
``WORK/NAME/<step>``, the way DeepSpeed-Chat's step 1 saves::

    if rank == 0: save_hf_format(model, tokenizer, folder)          # under ZeRO-3 this writes nothing
    if zero_stage == 3: save_zero_three_model(model, folder, global_rank=rank, zero_stage=3)

Each rank prints ``[ranks] run NAME`` as a run begins and ``[ranks] run NAME done`` once every rank has done all
its steps (the tests read each run's part of a rank's log between the two).

Steps (each prints ``[ranks] STEP on rank R: ok|failed: ERROR; gathers N``; fallback and killed first print
the files of the previous save they start from, ``[ranks] STEP before: {name: [sha256, inode]}``):
  save        the save, into a folder holding a stale pytorch_model.bin
  one, small  the same with gather_bucket_mb=0 and 0.3
  misused     zero_stage=0 passed under ZeRO-3: rank 0 writes without gathering
  fallback    WeightWriter.write fails on rank 0 (injected) in a folder holding a copy of save/
  nan         one weight set to NaN (on every rank), then the save
  killed      rank 1 dies in its fifth gather (0.3 MB buckets), in a folder holding a copy of save/ (the last step of
              the last run: the launcher then stops every rank)
"""
import argparse
import gc
import hashlib
import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "fixtures", "step1_trainer"))
sys.path.insert(0, REPO)
from patcher.checkpoint.smoke.ranks import skip_shm_allreduce  # noqa: E402
from patcher.templates import dsfix_safetensors as M  # noqa: E402
from rank_end import end_rank  # noqa: E402
from tiny_qwen3 import tiny_qwen3_model, tiny_qwen3_tokenizer  # noqa: E402


def say(line):
    print(line + "\n", end="", flush=True)  # one write: the other rank's lines cannot cut into it


# a run's settings, where its JSON leaves them out
RUN_DEFAULTS = {"zero_stage": 3, "dtype": "fp32", "strategy": "clone", "max_shard_size": None,
                "persistence_threshold": 0, "steps": ["save"]}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--runs", required=True, help='JSON: [{"name": ..., "zero_stage": ..., "steps": [...]}, ...]')
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def runs(args):
    """Each run's settings as a namespace (``work``: its own folder under ``--work``)."""
    for run in json.loads(args.runs):
        settings = dict(RUN_DEFAULTS, **run)
        yield argparse.Namespace(work=os.path.join(args.work, run["name"]), **settings)


class Gathers:
    """Counts the GatheredParameters contexts entered with something to gather (DeepSpeed's own class does
    the work); with ``die_at`` set, this rank exits at that entry, as a rank that crashes mid-save."""

    def __init__(self, deepspeed):
        self.count, self.die_at = 0, None
        counter = self

        class Counting(deepspeed.zero.GatheredParameters):
            def __enter__(self):
                if self.enabled:
                    counter.count += 1
                    if counter.die_at == counter.count:
                        say(f"[ranks] rank {torch.distributed.get_rank()} dies in gather {counter.count}")
                        os._exit(3)
                return super().__enter__()

        deepspeed.zero.GatheredParameters = Counting

    def take(self):
        value, self.count = self.count, 0
        return value


def build(args):
    import deepspeed

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_qwen3_model(seed=1234).train()
    config = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.zero_stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1000}
    if args.zero_stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = args.persistence_threshold
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=config)[0]
    generator = torch.Generator().manual_seed(1234 + rank)
    for _ in range(2):
        batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    return engine, rank


def write_reference(engine, rank, folder):
    """The whole state dict gathered the plain way, and the logits of a fixed batch (a collective)."""
    import deepspeed

    module = engine.module.eval()
    params = list(module.parameters())
    if engine.zero_optimization_stage() == 3 and rank == 0:  # before the forward pass gathers any
        partitioned = sum(1 for p in params if p.data.numel() == 0)
        say(f"[ranks] ZeRO-3: {partitioned} of {len(params)} parameters partitioned before saving")
    probe = torch.randint(0, module.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = module(input_ids=probe).logits.float()
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        named = dict(module.named_parameters(remove_duplicate=False))
        state = {k: (named[k].data if k in named else v).detach().clone() for k, v in module.state_dict().items()}
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        attn = getattr(module.config, "_attn_implementation", None)
        torch.save({"state_dict": state, "probe": probe, "logits": logits, "attn_implementation": attn},
                   os.path.join(folder, "reference.pt"))


def save(engine, tokenizer, rank, args, folder, **kwargs):
    """DeepSpeed-Chat step 1's two calls, with the module's functions (as the wrappers call them)."""
    options = {"strategy": args.strategy, "max_shard_size": args.max_shard_size}
    options.update(kwargs)
    stage = options.pop("zero_stage", args.zero_stage)
    if rank == 0:
        M.save_hf_format(engine, tokenizer, folder, **options)
    if args.zero_stage == 3:
        M.save_zero_three_model(engine, folder, global_rank=rank, zero_stage=stage, **options)


def set_nan(engine, rank):
    import deepspeed

    weight = engine.module.model.layers[5].mlp.up_proj.weight
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0, enabled=engine.zero_optimization_stage() == 3):
        if rank == 0 or engine.zero_optimization_stage() != 3:
            with torch.no_grad():
                weight.data.view(-1)[3] = float("nan")


def failing_write(rank):
    """WeightWriter.write that fails at its 5th call on rank 0."""
    real, calls = M.WeightWriter.write, [0]

    def write(self, name, data):
        calls[0] += 1
        if rank == 0 and calls[0] == 5:
            raise RuntimeError(f"injected writer failure on rank {rank}")
        return real(self, name, data)

    return write


def files(folder):
    """{name: [sha256, inode]} of the files in ``folder``: equal later, they are the very same files."""
    return {n: [hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest(),
                os.stat(os.path.join(folder, n)).st_ino] for n in sorted(os.listdir(folder))}


def run_step(step, engine, tokenizer, rank, args, gathers):
    folder = os.path.join(args.work, step)
    previous = os.path.join(args.work, "save")
    if rank == 0 and step in ("fallback", "killed"):
        shutil.copytree(previous, folder)
        say(f"[ranks] {step} before: {json.dumps(files(folder))}")
    if rank == 0 and step == "save":
        os.makedirs(folder)
        with open(os.path.join(folder, "pytorch_model.bin"), "w") as handle:
            handle.write("stale")
    torch.distributed.barrier()
    kwargs, real_write = {}, M.WeightWriter.write
    if step in ("one", "small"):
        kwargs["gather_bucket_mb"] = 0 if step == "one" else 0.3
    elif step == "misused":
        kwargs["zero_stage"] = 0
    elif step == "fallback":
        M.WeightWriter.write = failing_write(rank)
    elif step == "nan":
        set_nan(engine, rank)
    elif step == "killed":  # in 0.3 MB buckets: rank 0 has written a few of them when rank 1 dies
        kwargs["gather_bucket_mb"] = 0.3
        gathers.die_at = 5 if rank == 1 else None
    gathers.take()
    try:
        save(engine, tokenizer, rank, args, folder, **kwargs)
        outcome = "ok"
    except Exception as exc:
        outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        M.WeightWriter.write = real_write
    say(f"[ranks] {step} on rank {rank}: {outcome}; gathers {gathers.take()}")


def main():
    args = parse_args()
    import deepspeed

    skip_shm_allreduce()
    deepspeed.init_distributed()
    gathers = Gathers(deepspeed)
    tokenizer = tiny_qwen3_tokenizer()
    for run in runs(args):
        say(f"[ranks] run {run.name}")
        engine, rank = build(run)
        write_reference(engine, rank, os.path.join(run.work, "ref"))
        for step in run.steps:
            run_step(step, engine, tokenizer, rank, run, gathers)
        torch.distributed.barrier()
        if rank == 0:
            world = torch.distributed.get_world_size()
            say("[ranks] " + json.dumps({"world_size": world, "zero_stage": run.zero_stage}))
        say(f"[ranks] run {run.name} done")
        if hasattr(engine, "destroy"):  # its hooks and partitions go before the next run builds another
            engine.destroy()
        del engine
        gc.collect()
    end_rank()


if __name__ == "__main__":
    main()
