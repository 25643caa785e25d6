"""One rank of tests/test_save_module_faults_ranks.py: the save module's fault sweep (tests/savesweep.py) under
ZeRO-3 on CPU ranks (gloo), in one launch of the ``deepspeed`` launcher.

Both ranks wrap the narrow Qwen3 (2 layers, tied embeddings) in a ZeRO-3 engine, every parameter partitioned,
and save as DeepSpeed-Chat's step 1 does (rank 0 ``save_hf_format``, then ``save_zero_three_model`` on every
rank) into ``WORK/sweep/out``, 4 shards. Rank 0 records its calls (rank 1 makes none in the folder), then:

  fail  for each of rank 0's calls N and each errno of its kind: both ranks save, rank 0's call N fails; the
        outcome is checked on rank 0 (savesweep), and both ranks must end alike (both saved, or both raised)
  kill  inside one gather of the whole model (a collective of both ranks), rank 0 forks a child per call N
        that saves, its two collectives answered as rank 1 answers them (no failure: the child's calls are
        checked equal to the real run's), and is killed right before call N; then the next save, the check

Rank 0 prints ``[faults] {"calls": .., "rank1_calls": .., "cases": .., "kills": .., "problems": [..]}``.
"""
import argparse
import contextlib
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "fixtures", "step1_trainer"))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
from faultkit import Faults  # noqa: E402
from patcher.checkpoint.smoke.ranks import skip_shm_allreduce  # noqa: E402
from patcher.templates import dsfix_safetensors as M  # noqa: E402
from rank_end import end_rank  # noqa: E402
from savesweep import Sweep, _generic, previous_save  # noqa: E402
from tiny_qwen3 import tiny_qwen3_model, tiny_qwen3_tokenizer  # noqa: E402

LAYERS, SHARD = 2, 150_000


def build():
    import deepspeed

    skip_shm_allreduce()
    deepspeed.init_distributed()
    model = tiny_qwen3_model(seed=11, num_hidden_layers=LAYERS)
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": torch.distributed.get_world_size(),
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=config)[0]
    return engine, torch.distributed.get_rank()


def gathered_state(engine):
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        named = dict(module.named_parameters(remove_duplicate=False))
        return {k: (named[k].data if k in named else v).detach().clone() for k, v in module.state_dict().items()}


def save(engine, tokenizer, rank, out):
    """Step 1's two calls, both ranks in step (the barrier: rank 0 has set the folder up)."""
    torch.distributed.barrier()
    if rank == 0:
        M.save_hf_format(engine, tokenizer, out, max_shard_size=SHARD)
    M.save_zero_three_model(engine, out, global_rank=rank, zero_stage=3, max_shard_size=SHARD)


@contextlib.contextmanager
def rank1_answers():
    """Rank 0's save alone: each collective decision answered as rank 1 answers it (rank 1 never fails)."""
    real = M._Ranks.any_failed, M._Ranks.outcome
    M._Ranks.any_failed = lambda self, failed: failed
    M._Ranks.outcome = lambda self, error: None if error is None else (M._disk_failed(error), M._describe(error))
    try:
        yield
    finally:
        M._Ranks.any_failed, M._Ranks.outcome = real


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--kill_every", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine, rank = build()
    tokenizer = tiny_qwen3_tokenizer()
    state = gathered_state(engine)
    outcomes, problems, summary = [], [], {}

    def op(out):
        return save(engine, tokenizer, rank, out)

    if rank == 0:
        previous = tiny_qwen3_model(seed=5, num_hidden_layers=LAYERS)
        sweep = Sweep(os.path.join(args.work, "sweep"), op, lambda f: previous_save(f, previous, tokenizer), state)
        calls = sweep.record()
        cases = sweep.cases(args.every)
        summary.update(calls=len(calls), cases=len(cases), kinds=sorted({c.kind for c in calls}))
        count = [len(cases)]
    else:
        count = [None]
        with Faults(roots=[args.work]) as mine:  # rank 1's part of the recorded run
            op(os.path.join(args.work, "sweep", "out"))
        summary["rank1_calls"] = len(mine.calls)
    torch.distributed.broadcast_object_list(count, src=0)
    for i in range(count[0]):  # (a): both ranks save, rank 0's call fails
        if rank == 0:
            n, error = cases[i]
            problems += sweep.fail(n, error)
            outcomes.append(type(sweep.last).__name__ if sweep.last is not None else None)
        else:
            try:
                op(os.path.join(args.work, "sweep", "out"))
                outcomes.append(None)
            except Exception as exc:
                outcomes.append(type(exc).__name__)
    both = [None, None]
    torch.distributed.all_gather_object(both, outcomes)
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # (b): rank 0 alone, in forks
        if rank == 0:
            problems += agree(cases, *both)
            sweep.op = lambda out: M.save_zero_three_model(engine, out, global_rank=0, zero_stage=3,
                                                           max_shard_size=SHARD, with_config=True,
                                                           tokenizer=tokenizer)
            with rank1_answers():
                sweep.reset()
                with Faults(roots=[sweep.out]) as alone:
                    sweep.op(sweep.out)
                same = [_generic(str(c)) for c in alone.calls] == [_generic(str(c)) for c in calls]
                if not same:
                    problems.append(f"rank 0 alone made other calls than in the real run: {len(alone.calls)}")
                kills = range(0, len(calls), args.kill_every)
                for n in kills:
                    problems += sweep.kill(n)
                summary["kills"] = len(kills)
        torch.distributed.barrier()
    if rank == 0:
        summary["problems"] = problems
        print("[faults] " + json.dumps(summary) + "\n", end="", flush=True)
    else:
        print("[faults] rank 1 " + json.dumps(summary) + "\n", end="", flush=True)
    end_rank()


def agree(cases, mine, theirs):
    """Both ranks ended alike: both saved, or rank 0 raised and rank 1 raised a SaveError."""
    wrong = []
    for (n, error), a, b in zip(cases, mine, theirs):
        if (a is None) != (b is None) or (b is not None and b != "SaveError"):
            wrong.append(f"fail {n} {error}: rank 0 ended with {a}, rank 1 with {b}")
    return wrong


if __name__ == "__main__":
    main()
