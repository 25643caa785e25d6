"""One rank of ``dsfix smoke``: load the checkout's save functions, build a model, save it as step 1 does.

``patcher.checkpoint.smoke.run`` runs :func:`run_rank` in its own process for a plain one-rank save, or launches
``python -m torch.distributed.run --standalone --nproc_per_node N -m patcher.checkpoint.smoke.worker SPEC.json``
for DeepSpeed engines (ZeRO 1-3) and several ranks. Each rank writes ``result-<rank>.json`` into
the spec's work folder; rank 0 also writes the reference logits the reloaded folder must reproduce.
Nothing here prints to stdout: the save functions' own prints are captured into the result.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import time
import traceback
from argparse import Namespace
from pathlib import Path

from patcher.checkpoint.smoke.functions import load_save_functions
from patcher.checkpoint.smoke.ranks import end_ranks, skip_shm_allreduce
from patcher.patch.names import SAVE_HF, SAVE_Z3

REF_FILE = "reference.safetensors"
PROMPT = "human: what is the sky blue why light scatter answer assistant"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")


# --------------------------------------------------------------------------- model and tokenizer


def make_tiny_tokenizer(folder):
    """The project's one tiny tokenizer (fixtures/step1_trainer/tiny_qwen3.py, bundled): a Qwen2TokenizerFast
    over a ~300-token byte-level BPE, its vocabulary kept in ``folder`` (so save_pretrained works)."""
    import importlib.util

    from patcher.resources import resource_path

    spec = importlib.util.spec_from_file_location("dsfix_tiny_qwen3", resource_path("fixtures",
                                                                                   "step1_trainer/tiny_qwen3.py"))
    if spec is None or spec.loader is None:
        raise ImportError("the bundled tiny_qwen3.py cannot be loaded")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper.tiny_qwen3_tokenizer(folder)


def build_model(spec: dict, torch_dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from patcher.checkpoint.check.load import dtype_kwarg

    kw = {dtype_kwarg(): torch_dtype}
    if spec.get("model_dir"):
        return AutoModelForCausalLM.from_pretrained(spec["model_dir"], **kw)
    cfg = AutoConfig.from_pretrained(spec["config_path"])
    return AutoModelForCausalLM.from_config(cfg, **kw)


def build_tokenizer(spec: dict):
    model_dir = spec.get("model_dir")
    if model_dir and any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir), "from model_dir"
    return make_tiny_tokenizer(Path(spec["work_dir"]) / f"tokenizer-src-{_rank()}"), "tiny BPE (Qwen2TokenizerFast)"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _ds_config(zero_stage: int, dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Threshold 0: partition every parameter, so a narrow test model is as partitioned under ZeRO-3 as a
        # real one (by default parameters under 1e5 elements stay whole on every rank after a forward).
        "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0},
        # one plain SGD step (no optimizer state, so the full Qwen3-0.6B fits on a CPU with several ranks)
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "gradient_clipping": 1.0,
    }


class _Phases:
    """Times each phase and tells the parent which one is running: rank 0 through a small file (the parent
    polls it), and, in the parent's own process, through ``on_phase`` too."""

    def __init__(self, work_dir: Path, rank: int, on_phase=None):
        self.timings: dict = {}
        self.current = "start"
        self._file = work_dir / f"phase-{rank}.txt" if rank == 0 else None
        self._on_phase = on_phase

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.current = name
        if self._file is not None:
            self._file.write_text(name)
        if self._on_phase is not None:
            self._on_phase(name)
        t = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = round(time.perf_counter() - t, 3)


def run_rank(spec: dict, on_phase=None) -> dict:
    """Build, (train,) save and record one rank. Never raises (but Ctrl-C): errors land in result["error"].
    ``on_phase(name)``: called as each phase starts, when the rank runs in the caller's process."""
    distributed = bool(spec.get("distributed"))
    rank = _rank() if distributed else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if distributed else 0
    world = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
    phase = _Phases(Path(spec["work_dir"]), rank, on_phase)
    result: dict = {"rank": rank, "world_size": world, "error": None, "phase": None, "save_output": ""}
    captured = io.StringIO()
    try:
        with phase("load"):
            funcs = _load_phase(spec, result)
        with phase("build"):
            model, tokenizer, ids, device = _build_phase(spec, result, local_rank)
        engine, runner, opt = None, model, None
        if spec["engine"]:
            with phase("engine"):
                engine, opt = _engine_phase(spec, model, result)
                runner, device = engine, engine.device
        else:
            import torch

            model.to(device)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ids = ids.to(device)
        if int(spec["train_steps"]) > 0:
            with phase("train"):
                _train_phase(spec, runner, engine, opt, ids, result)
        with phase("reference"):
            _reference_phase(spec, runner, engine, model, ids, rank, result)
        with phase("save"):
            _save_phase(spec, funcs, runner, tokenizer, rank, local_rank, captured, result)
        if engine is not None:
            end_ranks()  # a barrier, then the process groups torn down, not left to the interpreter's exit
    except BaseException as e:  # noqa: BLE001 - reported, and the process exits non-zero
        result["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
        result["traceback"] = traceback.format_exc()
        result["phase"] = phase.current
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        _finish(spec, result, captured, phase, local_rank)
    return result


def _load_phase(spec: dict, result: dict) -> dict:
    funcs, method, how, note = load_save_functions(spec["utils_path"], spec["import_root"], spec["module_name"])
    result.update(load_method=method, load_detail=how, load_note=note, functions=sorted(funcs))
    if SAVE_HF not in funcs:
        raise RuntimeError(f"{spec['utils_path']} defines no {SAVE_HF}")
    return funcs


def _build_phase(spec: dict, result: dict, local_rank: int) -> tuple:
    """(model, tokenizer, input ids, device): the model in the spec's dtype, on the CPU or this rank's GPU."""
    import torch

    torch_dtype = getattr(torch, DTYPES[spec["dtype"]])
    if spec["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        device = torch.device("cpu")
    result["device"] = str(device)
    torch.manual_seed(int(spec["seed"]))
    tokenizer, result["tokenizer"] = build_tokenizer(spec)
    model = build_model(spec, torch_dtype)
    vocab = int(model.config.vocab_size)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"][:, :16] % vocab
    if ids.numel() < 4:  # a tokenizer that knows none of the prompt: fixed ids will do
        ids = (torch.arange(16, dtype=torch.long) * 7919 % vocab).unsqueeze(0)
    result["state_dict_keys"] = len(model.state_dict())
    return model, tokenizer, ids, device


def _engine_phase(spec: dict, model, result: dict) -> tuple:
    """(engine, optimizer): the model wrapped by deepspeed.initialize, as step 1 wraps it."""
    from datetime import timedelta

    import deepspeed
    import torch

    backend = "nccl" if spec["device"] == "cuda" else "gloo"
    if spec["device"] == "cpu":
        skip_shm_allreduce()
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=int(spec["dist_timeout"])))
    result["backend"] = backend
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # no optimizer state: low memory
    config = _ds_config(int(spec["zero_stage"]), spec["dtype"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, opt


def _train_phase(spec: dict, runner, engine, opt, ids, result: dict) -> None:
    runner.train()
    for _ in range(int(spec["train_steps"])):
        loss = runner(input_ids=ids, labels=ids).loss
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    result["loss"] = float(loss.detach().float().cpu())


def _reference_phase(spec: dict, runner, engine, model, ids, rank: int, result: dict) -> None:
    """Rank 0 keeps the logits the reloaded folder must reproduce; under ZeRO-3 the parameters are partitioned
    again afterwards, so the save sees what it sees after training: [0]-shaped placeholders."""
    import torch

    runner.eval()
    with torch.no_grad():
        logits = runner(input_ids=ids).logits
    if rank == 0:
        from safetensors.torch import save_file

        # The attention the logits came from: the reload must run the same one (transformers 4.51 writes
        # _attn_implementation_autoset into config.json, and a plain reload then runs eager).
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        save_file({"input_ids": ids.cpu().contiguous(), "logits": logits.detach().cpu().contiguous()},
                  str(Path(spec["work_dir"]) / REF_FILE), metadata={"attn_implementation": str(attn)} if attn else None)
    if engine is not None and int(spec["zero_stage"]) == 3:
        # A no-grad forward leaves ZeRO-3 parameters gathered until the next step.
        engine.empty_partition_cache()
        params = list(engine.module.parameters())
        result["partitioned"] = [sum(1 for p in params if hasattr(p, "ds_id") and p.numel() == 0), len(params)]


def _save_phase(spec: dict, funcs: dict, runner, tokenizer, rank: int, local_rank: int, captured, result: dict) -> None:
    """As step-1 main.py does it, with ``runner`` being what deepspeed.initialize returned."""
    zero = int(spec["zero_stage"])
    args = Namespace(output_dir=spec["out_dir"], global_rank=rank, local_rank=local_rank, zero_stage=zero,
                     dtype=spec["dtype"], seed=int(spec["seed"]))
    with contextlib.redirect_stdout(captured):
        if rank == 0:
            funcs[SAVE_HF](runner, tokenizer, args)
        if zero == 3 and SAVE_Z3 in funcs:
            funcs[SAVE_Z3](runner, rank, args.output_dir, zero_stage=zero)
    result["called_z3"] = zero == 3 and SAVE_Z3 in funcs


def _finish(spec: dict, result: dict, captured, phase: _Phases, local_rank: int) -> None:
    result["save_output"] = captured.getvalue()
    result["timings"] = phase.timings
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if spec.get("device") == "cuda":
        try:
            import torch

            result["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(local_rank) / 2**20, 1)
        except Exception:
            result["cuda_peak_mb"] = None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m torch.distributed.run ... -m patcher.checkpoint.smoke.worker SPEC.json",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    spec["distributed"] = True
    # Keep stdout for nothing: the launcher's stdout goes to the smoke log anyway, but be explicit.
    with contextlib.redirect_stdout(sys.stderr):
        result = run_rank(spec)
    out = Path(spec["work_dir"]) / f"result-{result['rank']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2), encoding="utf-8")
    os.replace(tmp, out)
    if result["error"]:
        print(f"[dsfix smoke] rank {result['rank']} failed in {result['phase']}: {result['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
