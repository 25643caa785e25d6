#!/usr/bin/env python
"""Runs upstream DeepSpeed-Chat's step-1 ``main.py`` as it is, for the device check (``device_check.py --upstream``).

Written for dsfix; no upstream code is here. Launched by DeepSpeed's launcher in place of ``main.py``:

    python -m deepspeed.launcher.runner --num_gpus 1 device_step1.py --script CHAT/training/.../main.py ARGS

with CHAT on PYTHONPATH. Before ``main.py`` runs (``runpy``, as ``__main__``, with ``ARGS``):

- torch's deterministic algorithms and the math attention are switched on, so that two runs at the same seed
  (one through a patched checkout, one through an unpatched one) train the same weights on a GPU too;
- ``deepspeed.ops.adam.FusedAdam``, which ``main.py`` picks without ``--offload``, becomes torch's AdamW with the
  same arguments: DeepSpeed's FusedAdam is a CUDA op compiled on first use, which takes nvcc and minutes that a
  bare machine does not have (with ``--offload``, DeepSpeedCPUAdam is a C++ op compiled the same way);
- ``convert_lora_to_linear_layer``, which ``main.py`` calls on the engine after training and before saving,
  first writes what the device check compares the save with: ``$DSFIX_STEP1_REFERENCE/reference.pt`` (the
  engine's own weights, gathered under ZeRO-3) and, when ``$DSFIX_STEP1_ENGINE_CKPT`` is set, a DeepSpeed
  engine checkpoint there (``engine.save_checkpoint``).

After ``main.py`` returns, the rank ends as dsfix's own rank scripts end (``fixtures/step1_trainer/rank_end.py``):
its process group torn down, which upstream's ``main.py`` leaves to the interpreter's exit, then its last line.
"""
import os
import runpy
import sys


def script_from_argv():
    """``--script PATH`` taken out of sys.argv (the launcher puts --local_rank=N first or last)."""
    argv = sys.argv[1:]
    i = argv.index("--script")
    script = argv[i + 1]
    sys.argv = [script] + argv[:i] + argv[i + 2:]
    return script


def adamw(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **_):
    import torch

    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def save_reference(engine, folder, ckpt):
    import deepspeed
    import torch

    if ckpt:
        engine.save_checkpoint(ckpt)
    module = engine.module
    params = list(module.parameters())
    zero3 = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, enabled=zero3):
        named = dict(module.named_parameters(remove_duplicate=False))
        state = {k: (named[k].data if k in named else v).detach().cpu().clone() for k, v in module.state_dict().items()}
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        torch.save({"state_dict": state}, os.path.join(folder, "reference.pt"))
    torch.distributed.barrier()


def main():
    script = script_from_argv()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):  # their backward varies
        switch = getattr(torch.backends.cuda, name, None)
        if switch is not None:
            switch(False)
    import deepspeed.ops.adam

    deepspeed.ops.adam.FusedAdam = adamw
    from dschat.utils.module import lora

    convert = lora.convert_lora_to_linear_layer
    reference, ckpt = os.environ.get("DSFIX_STEP1_REFERENCE"), os.environ.get("DSFIX_STEP1_ENGINE_CKPT")

    def convert_after_saving_reference(model):
        if reference:
            save_reference(model, reference, ckpt)
        return convert(model)

    lora.convert_lora_to_linear_layer = convert_after_saving_reference
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    end_rank()


def end_rank():
    import common  # benchmarks/, this script's folder

    common.load_file_module("fixtures", "step1_trainer", "rank_end.py").end_rank()


if __name__ == "__main__":
    main()
