"""The dsfix command line: the options of each verb, and one call to the verb's own module.

Each verb returns a result (:mod:`patcher.report`) that renders itself; :mod:`patcher.command` is the one path
every result and every error takes (one line, an exit code, Ctrl-C). Exit codes: 0 ok, 1 pending/refused/a
check failed, 2 error, 3 locked, 130 interrupted (docs/cli.md).
"""

import sys
from pathlib import Path

from patcher.errors import stop_point
from patcher.startup import interrupt_at_startup

if sys.argv[:1] and Path(sys.argv[0]).name in ("dsfix", "dsfix.exe"):  # the program itself, not a test importing it
    interrupt_at_startup()
stop_point("startup")  # the imports below take most of a second: a test stops here (patcher.errors.stop_point)

from enum import Enum  # noqa: E402
from typing import Annotated, List, Optional  # noqa: E402

import typer  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from patcher import __version__  # noqa: E402
from patcher.command import DEBUG, command, run  # noqa: E402
from patcher.console import err  # noqa: E402
from patcher.errors import DsfixError, need_folder, refuse_file  # noqa: E402
from patcher.resources import BUNDLED_TENSORS  # noqa: E402


class _Group(TyperGroup):
    """--debug is taken anywhere on the command line (before or after the subcommand, not after ``--``)."""

    def parse_args(self, ctx, args):
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:end]:
            ctx.meta[DEBUG] = True
            args = [a for a in args[:end] if a != "--debug"] + args[end:]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,
    help="Make DeepSpeed-Chat save tied-weight models (Qwen3 and friends) correctly, as safetensors; convert "
         "DeepSpeed checkpoints (DeepSpeed-Chat's, the Hugging Face Trainer's, accelerate's) into verified, tied "
         "safetensors folders.",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: flags show no value placeholder
)


class Strategy(str, Enum):
    clone = "clone"
    dedupe = "dedupe"


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class DType(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


# ----------------------------------------------------------------------------- the options verbs share

Repo = Annotated[Path, typer.Argument(help="The DeepSpeed-Chat folder, a DeepSpeedExamples checkout, or any folder "
                                           "inside.")]
Json = Annotated[bool, typer.Option("--json", help="Print a machine-readable result on stdout.")]
Main = Annotated[Optional[Path], typer.Option(
    "--main", help="The step-1 script, where dsfix does not find it by itself (a path in the checkout, else in the "
    "current folder).")]
Scripts = Annotated[Optional[List[Path]], typer.Option(
    "--script", help="A further step-1 entry script to patch too (repeatable), e.g. main_lora.py.")]
StrategyOpt = Annotated[Optional[Strategy], typer.Option(
    help=f"clone: every tied alias saved as its own copy ({BUNDLED_TENSORS} tensors for Qwen3-0.6B); dedupe: "
    f"transformers' layout, the alias dropped ({BUNDLED_TENSORS - 1}). Default: as the last apply recorded, else "
    "clone.", show_default=False)]
Steps = Annotated[Optional[str], typer.Option(
    "--steps", metavar="LIST", help="The DeepSpeed-Chat steps to patch, comma-separated: 1, 1,2 or 1,2,3. Default: "
    "as the last apply recorded, else 1. Listing 2 or 3 also adapts step 3's critic loader (create_critic_model) to "
    "read safetensors.")]
Base = Annotated[Optional[Path], typer.Option(
    "--base", help="A PEFT adapter's base model folder (default: adapter_config.json's base_model_name_or_path, "
    "a folder here or a model in the Hugging Face cache).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing (the exit code tells); --json still prints.")]
Stat = Annotated[bool, typer.Option("--stat", help="Print a per-file summary (as git diff --stat does) instead of the "
                                                   "diff.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dsfix {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show a traceback on errors (anywhere on the line; the exit "
                                                        "code stays the same).")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Show the version.")] = False,
) -> None:
    pass


def _steps(text: Optional[str]) -> Optional[tuple]:
    """--steps: a comma-separated list of 1, 2 and 3 (step 1 is patched only when it is listed)."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in ("1", "2", "3")]
    if bad or not parts:
        raise DsfixError(f"--steps takes a comma-separated list of 1, 2 and 3 (e.g. 1,2,3), not {text!r}")
    return tuple(sorted({int(p) for p in parts}))


# ----------------------------------------------------------------------------- the verbs


@app.command(help="Print the diff apply would make; write nothing. Exit 0: nothing to do, 1: changes pending, "
                  "2: error.")
@command
def check(repo: Repo = Path("."), strategy: StrategyOpt = None, steps: Steps = None, main_script: Main = None,
          script: Scripts = None, as_json: Json = False, stat: Stat = False, quiet: Quiet = False):
    from patcher.patch import flow

    return flow.check(repo, strategy.value if strategy else None, _steps(steps), main_script, script or [])


@app.command(help="Patch the checkout: all files or none. Exit 0: applied or already applied, 2: error (nothing "
                  "written), 3: locked (another dsfix run is changing the checkout).")
@command
def apply(repo: Repo = Path("."), strategy: StrategyOpt = None, steps: Steps = None, main_script: Main = None,
          script: Scripts = None, as_json: Json = False, stat: Stat = False, quiet: Quiet = False):
    from patcher.patch import flow

    return flow.apply(repo, strategy.value if strategy else None, _steps(steps), main_script, script or [])


@app.command(help="Undo apply. Exit 0: restored or nothing to restore, 1: refused because files changed, 2: error "
                  "(also outside a checkout with no dsfix patch), 3: locked (another dsfix run is changing the "
                  "checkout).")
@command
def revert(
    repo: Repo = Path("."),
    force: Annotated[bool, typer.Option("--force", "-f", help="Restore originals even over later edits (kept beside "
                                                              "as *.dsfix-edited).")] = False,
    main_script: Main = None,
    script: Annotated[Optional[List[Path]], typer.Option(
        "--script", help="A further step-1 entry script that apply patched (repeatable), e.g. main_lora.py; needed "
        "only where the state folder is gone and dsfix does not find it by itself.")] = None,
    as_json: Json = False,
    quiet: Quiet = False,
):
    from patcher.patch import flow

    return flow.revert(repo, force=force, main=main_script, scripts=script or [])


@app.command(short_help="Check a saved folder against its config, or against a reference.",
             help="Check a saved folder against its config (or --against a reference folder). Exit 0: it holds, "
                  "1: a check failed (a difference), 2: bad input.")
@command
def verify(
    folder: Annotated[Path, typer.Argument(help="A saved model folder (config.json plus safetensors weights), a PEFT "
                                                "adapter folder (adapter_config.json), or a step-3 output folder "
                                                "holding actor/, critic/, actor_ema/.")],
    expect: Annotated[Optional[int], typer.Option(help="The number of tensors the file must hold (each "
                                                       "folder's).")] = None,
    load: Annotated[bool, typer.Option(help="Also load the folder (from_pretrained; a critic into its "
                                            "module).")] = True,
    against: Annotated[Optional[Path], typer.Option(
        "--against", help="Compare with this reference model folder instead (safetensors, or a pytorch_model.bin "
        "such as zero_to_fp32's, loaded weights-only): keys, shapes, dtypes, values (bit-equal unless --atol/--rtol), "
        "ties.")] = None,
    atol: Annotated[float, typer.Option("--atol", min=0.0, help="With --against: the absolute difference "
                                                                "allowed.")] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", min=0.0, help="With --against: the difference allowed relative to "
                                                                "the reference.")] = 0.0,
    base: Base = None,
    as_json: Json = False,
):
    from patcher.prereq import require

    require("verify")
    from patcher.checkpoint.verify import verify_path  # the input is checked before torch is imported

    return verify_path(folder, expect=expect, load=load, against=against, atol=atol, rtol=rtol, base=base,
                       console=err.console)


class OutDType(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


@app.command(short_help="Turn .bin or DeepSpeed checkpoints into verified safetensors.",
             help="Turn .bin weights or a DeepSpeed checkpoint (engine.save_checkpoint, the Hugging Face Trainer's "
                  "checkpoint-N, accelerate's save_state, DeepSpeed-Chat) into a verified safetensors folder. Exit 0: "
                  "converted or nothing to convert, 1: a check failed (nothing written), 2: bad input or a refused "
                  "pickle.")
@command
def convert(
    folder: Annotated[Path, typer.Argument(
        help="A DeepSpeed checkpoint (latest + global_stepN/, or global_stepN/): a Trainer's checkpoint-N/, an "
        "accelerate save_state folder, an engine.save_checkpoint folder; a Trainer's output folder (its last "
        "checkpoint-N/ is converted); or a DeepSpeed-Chat output folder with pytorch_model.bin (or a sharded .bin "
        "index) and config.json, or a step-3 folder holding actor/, critic/, actor_ema/ (converted in place); or "
        "pytorch_model.bin alone (save_16bit_model, zero_to_fp32: with --config and --output). A Hugging Face "
        "model folder has nothing to convert.")],
    strategy: Annotated[Strategy, typer.Option(
        help=f"clone: a tied alias is written as its own copy, restored when the .bin lacks it ({BUNDLED_TENSORS} "
        f"tensors for Qwen3-0.6B); dedupe: transformers' layout, the alias left out ({BUNDLED_TENSORS - 1}).")
    ] = Strategy.clone,
    remove_bin: Annotated[bool, typer.Option("--remove-bin", help="Remove the .bin files once the safetensors are in "
                                                                  "place.")] = False,
    load: Annotated[bool, typer.Option(help="Also load the written folder (from_pretrained; a critic into its "
                                            "module).")] = True,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="DeepSpeed checkpoint: the model folder whose config.json, generation config and tokenizer "
        "go with the weights (default: the checkpoint's own folder when it holds config.json, as the Trainer's "
        "checkpoint-N does; accelerate's save_state, engine.save_checkpoint and save_16bit_model's "
        "pytorch_model.bin need it).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", help="DeepSpeed checkpoint or .bin folder: the folder "
                                                                    "to write (new or empty).")] = None,
    tag: Annotated[Optional[str], typer.Option(
        "--tag", help="DeepSpeed checkpoint: the step folder to read (default: latest's); in a Trainer's output "
        "folder, the checkpoint-N to convert (default: the last).")] = None,
    dtype: Annotated[OutDType, typer.Option(help="DeepSpeed checkpoint: the weights' dtype (auto: "
                                                 "config.json's).")] = OutDType.auto,
    lora_scaling: Annotated[Optional[float], typer.Option(
        "--lora-scaling", help="Engine checkpoint of a DeepSpeed-Chat LoRA run: the lora_scaling its layers were built "
        "with (default: step 1's 1).")] = None,
    keep_lora: Annotated[bool, typer.Option(
        "--keep-lora", help="Engine checkpoint of a LoRA run: also write the unfused factors to lora.safetensors "
        "beside the fused model.")] = False,
    base: Base = None,
    merge: Annotated[bool, typer.Option(
        "--merge", help="A PEFT LoRA run (or adapter folder): write its base model with the adapter merged in, as "
        "PEFT's merge_and_unload() does, instead of the adapter.")] = False,
    as_json: Json = False,
):
    from patcher.prereq import require

    need_folder(folder)
    require("convert")
    from patcher.checkpoint.convert import convert as run_convert  # no torch yet: it checks its input first

    return run_convert(folder, output=output, config=config, tag=tag, dtype=dtype.value, strategy=strategy.value,
                       remove_bin=remove_bin, load=load, lora_scaling=lora_scaling, keep_lora=keep_lora, base=base,
                       merge=merge, console=err.console)


@app.command(help="Run the checkout's save on a real Qwen3 model, then verify it. Exit 0: all checks hold, 1: a "
                  "check failed, 2: error.")
@command
def smoke(
    repo: Repo = Path("."),
    device: Annotated[Device, typer.Option(help="auto: CUDA when available.")] = Device.auto,
    dtype: Annotated[DType, typer.Option(help="The dtype the model is built, trained and saved in.")] = DType.bf16,
    zero_stage: Annotated[int, typer.Option(
        "--zero-stage", min=0, max=3, help="0: no DeepSpeed engine; 1-3 wrap the model in a DeepSpeed ZeRO engine of "
        "that stage (needs DeepSpeed).")] = 0,
    nproc: Annotated[int, typer.Option(min=1, help="Ranks to start (through torch's launcher; 2 or more need "
                                                   "DeepSpeed).")] = 1,
    expect: Annotated[Optional[int], typer.Option(help=f"Tensors expected (default: {BUNDLED_TENSORS} for the bundled "
                                                       "Qwen3-0.6B config; none with --model or --config).")] = None,
    keep: Annotated[Optional[Path], typer.Option(help="Keep the saved folder here (a new or empty folder; removed "
                                                      "again if smoke made it and is interrupted).")] = None,
    model: Annotated[Optional[Path], typer.Option(help="A model folder with real weights instead of the bundled "
                                                       "config.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="A config.json to build a random model from.")] = None,
    as_json: Json = False,
):
    from patcher.prereq import require

    refuse_file(repo)
    need_ds = f"--zero-stage {zero_stage}" if zero_stage > 0 else (f"--nproc {nproc}" if nproc > 1 else None)
    require("smoke", deepspeed=need_ds, cuda=device is Device.cuda)  # before anything expensive
    from patcher.checkpoint.smoke import run_smoke  # the input is checked before torch is imported
    from patcher.patch.locate import find_checkout

    if expect is None and model is None and config is None:
        expect = BUNDLED_TENSORS  # the bundled Qwen3-0.6B config
    return run_smoke(find_checkout(repo), device=device.value, dtype=dtype.value, zero_stage=zero_stage,
                     nproc=nproc, expect=expect, keep=keep, model_dir=model, config_path=config, console=err.console)


@app.command(help="Check, apply, smoke and revert on the bundled example checkout. Exit 0: every step passed, "
                  "1: one failed, 2: error (a missing requirement, say).")
@command
def demo(
    device: Annotated[Device, typer.Option(help="Device for the smoke save.")] = Device.auto,
    keep: Annotated[Optional[Path], typer.Option(help="Keep the demo checkout here instead of a temporary "
                                                      "folder.")] = None,
    as_json: Json = False,
):
    from patcher.prereq import require

    require("demo", cuda=device is Device.cuda)  # before the patch path and torch are imported
    from patcher.demo import run_demo

    return run_demo(err.console, device=device.value, keep=keep, show_diff=not as_json)


# ----------------------------------------------------------------------------- the entry point


def main(argv=None) -> None:
    """The command line, for a caller in its own process: every outcome is one exit code (``SystemExit``), every
    error one line (docs/cli.md)."""
    run(app, argv)


def program() -> None:
    """The dsfix program itself (its console script, ``python -m patcher``): :func:`main`, in a process of its
    own (docs/cli.md, "The process")."""
    run(app, program=True)
