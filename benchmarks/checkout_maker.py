"""Write a DeepSpeed-Chat-shaped checkout of real size for the patch-path benchmark.

The files are generated here, in the shape of upstream's (a long argparse block, data and optimizer set-up,
a training loop with evaluation, the final saves) but with their own text: nothing is copied from
DeepSpeed-Chat. ``main_lines`` sets the length of step-1 main.py; utils.py is about 310 lines.
"""
from __future__ import annotations

import os

UTILS_HEAD = '''# Utilities for the step scripts (written for dsfix's benchmark in the shape of DeepSpeed-Chat's).
import os
import json
import random

import numpy as np
import torch
import torch.nn as nn
import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import set_seed, AutoTokenizer


def print_rank_0(msg, rank=None):
    if rank is not None and rank <= 0:
        print(msg)
    elif is_rank_0():
        print(msg)


def is_rank_0():
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def to_device(batch, device):
    output = {}
    for k, v in batch.items():
        try:
            output[k] = v.to(device)
        except AttributeError:
            output[k] = v
    return output


def save_hf_format(model, tokenizer, args, sub_folder=""):
    model_to_save = model.module if hasattr(model, "module") else model
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    output_model_file = os.path.join(output_dir, "pytorch_model.bin")
    output_config_file = os.path.join(output_dir, "config.json")
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, output_model_file)
    model_to_save.config.to_json_file(output_config_file)
    tokenizer.save_vocabulary(output_dir)


def set_random_seed(seed):
    if seed is not None:
        set_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    tensor = tensor / torch.distributed.get_world_size()
    return tensor


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters([v], enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict
'''

HELPER = '''

def helper_{i}(values, scale=1.0, name="helper_{i}"):
    """A helper of the kind utils.py collects ({i})."""
    total = 0.0
    for v in values:
        if v is None:
            continue
        total += float(v) * scale
    if total > {i}:
        print_rank_0(f"{{name}}: {{total}}")
    return {{"name": name, "total": total, "count": len(values)}}
'''

MAIN_HEAD = '''#!/usr/bin/env python
# Step-1 supervised fine-tuning (written for dsfix's benchmark in the shape of DeepSpeed-Chat's).
import argparse
import math
import sys

import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, SchedulerType, get_scheduler
import deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed import get_accelerator

from dschat.utils.data.data_utils import create_prompt_dataset
from dschat.utils.utils import print_rank_0, to_device, save_hf_format, set_random_seed, get_all_reduce_mean, save_zero_three_model, load_hf_tokenizer
from dschat.utils.ds_utils import get_train_ds_config
from dschat.utils.module.lora import convert_linear_layer_to_lora, convert_lora_to_linear_layer, only_optimize_lora_parameters
from dschat.utils.model.model_utils import create_hf_model


def parse_args():
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a causal language modeling task")
'''

ARG = '''    parser.add_argument("--option_{i}",
                        type=int,
                        default={i},
                        help="Option number {i} of the training run.")
'''

MAIN_MID = '''    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    return args


def evaluation(model, eval_dataloader, device):
    model.eval()
    losses = 0
    for step, batch in enumerate(eval_dataloader):
        batch = to_device(batch, device)
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses += loss.float()
    losses = losses / (step + 1)
    try:
        losses = get_all_reduce_mean(losses)
    except Exception:
        pass
    try:
        perplexity = torch.exp(losses).item()
    except OverflowError:
        perplexity = float("inf")
    return perplexity, losses.item()


def main():
    args = parse_args()
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    set_random_seed(args.seed)
    torch.distributed.barrier()
    tokenizer = load_hf_tokenizer(args.model_name_or_path, fast_tokenizer=True)
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config)
    train_dataset, eval_dataset = create_prompt_dataset(args.local_rank, args.data_path, args.data_split,
                                                        args.data_output_path, 0, args.seed, tokenizer,
                                                        args.max_seq_len)
    train_sampler = DistributedSampler(train_dataset)
    eval_sampler = DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(train_dataset, sampler=train_sampler, batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, sampler=eval_sampler, batch_size=args.per_device_eval_batch_size)
    optimizer = FusedAdam(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * num_update_steps_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    perplexity, eval_loss = evaluation(model, eval_dataloader, device)
    print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            model.backward(loss)
            model.step()
'''

STEP = '''            if step % args.option_{i} == 0:
                stats_{i} = {{"epoch": epoch, "step": step, "loss": loss.item(), "lr": lr_scheduler.get_last_lr()[0]}}
                print_rank_0(f"stats {i}: {{stats_{i}}}", args.global_rank)
'''

MAIN_TAIL = '''        perplexity, eval_loss = evaluation(model, eval_dataloader, device)
        print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
        model.tput_timer.update_epoch_count()

    if args.output_dir is not None:
        print_rank_0("saving the final model ...", args.global_rank)
        model = convert_lora_to_linear_layer(model)

        if args.global_rank == 0:
            save_hf_format(model, tokenizer, args)

        if args.zero_stage == 3:
            # For zero stage 3, each gpu only has a part of the model, so we need a special save function
            save_zero_three_model(model,
                                  args.global_rank,
                                  args.output_dir,
                                  zero_stage=args.zero_stage)


if __name__ == "__main__":
    main()
'''


def _main_py(lines: int) -> str:
    fixed = sum(t.count("\n") for t in (MAIN_HEAD, MAIN_MID, MAIN_TAIL))
    budget = max(0, lines - fixed)
    n_args = budget * 2 // 3 // ARG.count("\n")
    n_steps = (budget - n_args * ARG.count("\n")) // STEP.count("\n")
    return (MAIN_HEAD + "".join(ARG.format(i=i) for i in range(n_args)) + MAIN_MID
            + "".join(STEP.format(i=i + 1) for i in range(n_steps)) + MAIN_TAIL)


def _utils_py(lines: int = 310) -> str:
    n = max(0, (lines - UTILS_HEAD.count("\n")) // HELPER.count("\n"))
    return UTILS_HEAD + "".join(HELPER.format(i=i) for i in range(n))


def write_checkout(root: str, main_lines: int = 400, utils_lines: int = 310) -> str:
    files = {
        "dschat/__init__.py": "",
        "dschat/utils/__init__.py": "",
        "dschat/utils/utils.py": _utils_py(utils_lines),
        "training/step1_supervised_finetuning/main.py": _main_py(main_lines),
    }
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return root
