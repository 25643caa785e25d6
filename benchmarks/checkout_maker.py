"""Write a DeepSpeed-Chat-shaped checkout of real size for the patch-path benchmark.

It grows the bundled fixture checkout (fixtures/checkouts/package, written for dsfix's tests in
upstream's shape) to real size: more argparse options and training-loop statements in step-1 main.py,
more helpers in utils.py. Nothing is copied from DeepSpeed-Chat. ``main_lines`` sets the length of
step-1 main.py; utils.py is about ``utils_lines`` long.
"""
from __future__ import annotations

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(os.path.dirname(HERE), "fixtures", "checkouts", "package")
UTILS = "dschat/utils/utils.py"
MAIN = "training/step1_supervised_finetuning/main.py"

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

ARG = '''    parser.add_argument("--option_{i}",
                        type=int,
                        default={i},
                        help="Option number {i} of the training run.")
'''

STEP = '''    for step_{i} in range(args.option_{i} if hasattr(args, "option_{i}") else 1):
        stats_{i} = {{"step": step_{i}, "loss": loss.item(), "ppl": math.exp(loss.item())}}
        print_rank_0(f"stats {i}: {{stats_{i}}}", args.global_rank)
'''


def _grow(text: str, at: str, block: str, lines: int) -> str:
    """``text`` with copies of ``block`` (numbered) inserted before ``at`` until it has about ``lines`` lines."""
    n = max(0, (lines - text.count("\n")) // block.count("\n"))
    return text.replace(at, "".join(block.format(i=i) for i in range(n)) + at, 1)


def write_checkout(root: str, main_lines: int = 400, utils_lines: int = 310) -> str:
    shutil.copytree(FIXTURE, root)
    with open(os.path.join(root, UTILS), encoding="utf-8") as f:
        utils = f.read()
    with open(os.path.join(root, UTILS), "w", encoding="utf-8") as f:
        f.write(utils + "".join(HELPER.format(i=i) for i in range(max(0, (utils_lines - utils.count("\n"))
                                                                     // HELPER.count("\n")))))
    with open(os.path.join(root, MAIN), encoding="utf-8") as f:
        main = f.read()
    main = _grow(main, "    parser = deepspeed.add_config_arguments(parser)\n", ARG,
                 (main_lines + main.count("\n")) // 2)
    main = _grow(main, "\n    if args.output_dir is not None:\n", STEP, main_lines)
    with open(os.path.join(root, MAIN), "w", encoding="utf-8") as f:
        f.write(main)
    return root
