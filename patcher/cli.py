"""The dsfix command line: parse options, call the flow, and one path for every result and every error.

Each command returns a result (see patcher.report): ``_command`` renders it (``_emit``) or turns what went
wrong into one line and an exit code (``_fail``); main() adds what happens outside a command (usage errors,
Ctrl-C while the options are parsed). Exit codes: 0 ok, 1 pending/refused/a check failed, 2 error,
3 locked, 130 interrupted (docs/cli.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from patcher.errors import interrupt_at_startup, stop_point

if sys.argv[:1] and Path(sys.argv[0]).name in ("dsfix", "dsfix.exe"):  # the dsfix program itself, not a test importing this
    interrupt_at_startup()
stop_point("startup")  # the imports below take most of a second: a test stops here (patcher.errors.stop_point)

import contextlib  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from enum import Enum  # noqa: E402
from typing import List, Optional  # noqa: E402

import typer  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from patcher import __version__  # noqa: E402
from patcher.errors import (  # noqa: E402
    ERROR, INTERRUPTED, ON_INTERRUPT, DsfixError, Written, interrupted_line, need_folder, refuse_file,
)
from patcher.report import ErrorResult  # noqa: E402
from patcher.resources import BUNDLED_TENSORS  # noqa: E402

try:  # typer >= 0.22 vendors click
    from typer._click import exceptions as click_exc
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc
    from click import get_current_context

DEBUG = "dsfix.debug"  # in the click context's meta: --debug was given, anywhere on the line


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


class _Stderr:
    """Every message goes to stderr: plain text, with colour only on a terminal (NO_COLOR honoured).
    rich is imported only for a terminal, or for what needs it (tables, progress)."""

    def __init__(self):
        self._console = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False, soft_wrap=True)
        return self._console

    def _color(self) -> bool:
        import os

        return sys.stderr.isatty() and "NO_COLOR" not in os.environ

    def line(self, *parts) -> None:
        """One line from ``parts``: plain strings, or (text, style) pairs styled on a terminal."""
        if self._color():
            from rich.text import Text

            self.console.print(Text.assemble(*parts))
            return
        sys.stderr.write("".join(p if isinstance(p, str) else p[0] for p in parts) + "\n")
        sys.stderr.flush()

    def print(self, obj, markup: bool = False) -> None:
        """A plain line, or (tables and the other renderables of verify, convert and smoke) rich's print,
        whose own markup (a cell's "[green]ok[/]") renders as style, or as nothing off a terminal."""
        if isinstance(obj, str) and not markup:
            self.line(obj)
        elif isinstance(obj, str):
            self.console.print(obj, markup=True)
        else:
            self.console.print(obj)


err = _Stderr()


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


REPO_ARG = typer.Argument(".", help="The DeepSpeed-Chat folder, a DeepSpeedExamples checkout, or any folder inside.")
JSON_OPT = typer.Option(False, "--json", help="Print a machine-readable result on stdout.")
MAIN_OPT = typer.Option(
    None, "--main", help="The step-1 script, where dsfix does not find it by itself (a path in the checkout, "
    "else in the current folder)."
)
SCRIPT_OPT = typer.Option(
    [], "--script", help="A further step-1 entry script to patch too (repeatable), e.g. main_lora.py."
)
STRATEGY_OPT = typer.Option(
    None, help=f"clone: every tied alias saved as its own copy ({BUNDLED_TENSORS} tensors for Qwen3-0.6B); "
    f"dedupe: transformers' layout, the alias dropped ({BUNDLED_TENSORS - 1}). Default: as the last apply "
    "recorded, else clone.",
    show_default=False,
)
STEPS_OPT = typer.Option(
    None, "--steps", metavar="LIST",
    help="The DeepSpeed-Chat steps to patch, comma-separated: 1, 1,2 or 1,2,3. Default: as the last apply "
    "recorded, else 1. Listing 2 or 3 also adapts step 3's critic loader (create_critic_model) to read safetensors.",
)


QUIET_OPT = typer.Option(False, "--quiet", "-q", help="Print nothing (the exit code tells); --json still prints.")
STAT_OPT = typer.Option(False, "--stat", help="Print a per-file summary (as git diff --stat does) instead of the diff.")


# ----------------------------------------------------------------------------- the one error path


class _Run:
    """This process's run: whether the one line for an error or interrupt has been printed, and when Ctrl-C
    was last pressed (a library that catches KeyboardInterrupt must not turn it into another outcome)."""

    reported = False
    interrupted_at: float | None = None


def _interrupt_key(verb: str | None, params: dict) -> str | None:
    """The entry of errors.ON_INTERRUPT for ``verb`` run with ``params``: "convert --output", say."""
    for option in ("output", "keep"):
        key = f"{verb} --{option}"
        if params.get(option) is not None and key in ON_INTERRUPT:
            return key
    return verb


def _describe(exc: BaseException, verb: str | None, debug: bool, params: dict) -> ErrorResult:
    """What went wrong, as the ErrorResult that --json prints (the line on stderr: ``_line``)."""
    if isinstance(exc, (KeyboardInterrupt, typer.Abort)):
        return ErrorResult.interrupted(verb, interrupted_line(_interrupt_key(verb, params), Written.done))
    if isinstance(exc, DsfixError):
        return ErrorResult(verb, exc.code, str(exc), error=exc.message, kind="error",
                           path=str(exc.path) if exc.path else None, line=exc.line, detail=exc.detail)
    if isinstance(exc, click_exc.ClickException):
        return ErrorResult(verb, ERROR, exc.format_message(), error=exc.format_message(), kind="usage")
    bare = f"{type(exc).__name__}: {exc}"  # an unexpected failure: still one line
    hint = "" if debug else " (run with --debug for a traceback)"
    return ErrorResult(verb, ERROR, f"internal error: {bare}{hint}", error=bare, kind="internal")


def _fail(exc: BaseException, verb: str | None, as_json: bool, debug: bool, params: dict | None = None) -> int:
    """Every error and interrupt ends here: one line on stderr (after the traceback, with --debug), with
    --json an ErrorResult object on stdout, and the exit code, which --debug never changes."""
    result = _describe(exc, verb, debug, params or {})
    if debug:
        for entry in result.detail:
            err.line(f"dsfix: detail: {entry}")
        if result.kind in ("error", "internal"):
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
        sys.stdout.flush()
    err.line(f"dsfix: error: {result.message}" if result.kind in ("error", "usage") else f"dsfix: {result.message}")
    _Run.reported = True
    return result.exit_code


def _command(fn):
    """Run a command: its result goes through _emit, anything that goes wrong through _fail."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = get_current_context()
        Written.clear()
        try:
            result = fn(*args, **kwargs)
            if _Run.interrupted_at is not None:  # Ctrl-C, swallowed on the way by a library
                raise KeyboardInterrupt
            _emit(result, kwargs)
        except (typer.Exit, SystemExit):
            raise
        except BaseException as e:  # DsfixError, KeyboardInterrupt, and the unexpected
            if _Run.interrupted_at is not None:  # whatever it became on the way, it began as Ctrl-C
                e = KeyboardInterrupt()
            raise typer.Exit(_fail(e, ctx.info_name, bool(kwargs.get("as_json")), bool(ctx.meta.get(DEBUG)),
                                   kwargs)) from None
        raise typer.Exit(result.exit_code)

    return wrapper


def _version(value: bool):
    if value:
        typer.echo(f"dsfix {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show a traceback on errors (anywhere on the line; the "
                                                      "exit code stays the same)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
):
    pass


# ----------------------------------------------------------------------------- the one rendering path


def _emit(result, opts: dict) -> None:
    """A command's result: the human text on stderr (unless --quiet), the JSON on stdout with --json."""
    as_json, quiet = bool(opts.get("as_json")), bool(opts.get("quiet"))
    if not quiet:
        _RENDER[result.verb](result, opts)
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
        sys.stdout.flush()


def stat_text(rows, width: int = 80) -> str:
    """``git diff --stat``'s summary of [(name, added, removed)]: a line per file, then the totals."""
    rows = [(n, a, r) for n, a, r in rows if a or r]
    if not rows:
        return ""
    name_w = max(len(n) for n, _, _ in rows)
    most = max(a + r for _, a, r in rows)
    count_w = len(str(most))
    bar_w = max(10, width - name_w - count_w - 5)
    lines = []
    for name, a, r in rows:
        if most > bar_w:  # scaled as git does: every non-zero side keeps at least one mark
            plus = max(1, a * bar_w // most) if a else 0
            minus = max(1, r * bar_w // most) if r else 0
        else:
            plus, minus = a, r
        lines.append(f" {name.ljust(name_w)} | {str(a + r).rjust(count_w)} {'+' * plus}{'-' * minus}")
    n, added, removed = len(rows), sum(a for _, a, _ in rows), sum(r for _, _, r in rows)
    total = f" {n} file{'s' if n != 1 else ''} changed"
    if added:
        total += f", {added} insertion{'s' if added != 1 else ''}(+)"
    if removed:
        total += f", {removed} deletion{'s' if removed != 1 else ''}(-)"
    return "\n".join(lines + [total]) + "\n"


def _render_patch(outcome, opts: dict) -> None:
    """check: the diff on stdout (or --stat's summary; nothing with --json); apply: --stat's summary.
    Both: a line per file and the message on stderr."""
    if not opts.get("as_json"):
        if opts.get("stat"):
            sys.stdout.write(stat_text([(f.rel, f.added, f.removed) for f in outcome.files]))
            sys.stdout.flush()
        elif outcome.verb == "check":
            sys.stdout.flush()
            sys.stdout.buffer.write(outcome.diff)
            sys.stdout.buffer.flush()
    where = {None: "as recorded in its state folder", "marked": "found by dsfix's marker lines"}.get(
        outcome.layout, f"{outcome.layout} layout")
    err.print(f"dsfix {outcome.verb}: {outcome.root} ({where})")
    for f in outcome.files:
        status = f.status.value
        style = {"refused": "red", "would change": "yellow", "changed": "green"}.get(status, "none")
        counts = f" (+{f.added} -{f.removed})" if f.added or f.removed else ""
        err.line("  ", (status, style), f": {f.rel}{counts}")
        for n in f.notes:
            err.line(f"      {n}")
    for w in outcome.warnings:
        err.line(("warning:", "yellow"), f" {w}")
    err.print(outcome.message)


def _render_verify(result, opts: dict) -> None:
    from patcher.checkpoint.verify import checks_table

    for report in result.reports:
        err.print(checks_table(report.checks, title=f"dsfix verify {report.path}"))
        err.print(report.summary, markup=False)


def _render_convert(report, opts: dict) -> None:
    from patcher.checkpoint.convert import ConvertStatus
    from patcher.checkpoint.verify import KIND_TEXT, checks_table

    if not hasattr(report, "folders"):  # a DeepSpeed engine checkpoint (patcher.checkpoint.engine)
        err.print(report.describe(), markup=False)
        err.print(checks_table(report.checks, title=f"dsfix convert {report.path}"))
        err.print(report.message, markup=False)
        return
    if report.status is not ConvertStatus.NOTHING:  # else each folder's one line says it is already safetensors
        done = "converted in place" if report.status is ConvertStatus.CONVERTED else "nothing written"
        err.print(f"{report.path}: DeepSpeed-Chat .bin output ({done})", markup=False)
    for result in report.folders:
        if result.checks and (not result.ok or result.status is ConvertStatus.CONVERTED):
            err.print(checks_table(result.checks, title=f"dsfix convert {result.path}"))
        kind = f" [{KIND_TEXT[result.kind]}]" if result.kind else ""
        err.print(result.summary() + kind, markup=False)


def _render_smoke(report, opts: dict) -> None:
    from patcher.checkpoint.smoke import print_report

    print_report(report, err.console)


def _render_demo(result, opts: dict) -> None:
    from patcher.demo import print_demo

    print_demo(result, err.console)


_RENDER = {"check": _render_patch, "apply": _render_patch, "revert": _render_patch, "verify": _render_verify,
           "convert": _render_convert, "smoke": _render_smoke, "demo": _render_demo}


# ----------------------------------------------------------------------------- the commands


def _steps(text: str | None) -> tuple | None:
    """--steps: a comma-separated list of 1, 2 and 3 (step 1 is patched only when it is listed)."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in ("1", "2", "3")]
    if bad or not parts:
        raise DsfixError(f"--steps takes a comma-separated list of 1, 2 and 3 (e.g. 1,2,3), not {text!r}")
    return tuple(sorted({int(p) for p in parts}))


@app.command(help="Print the diff apply would make; write nothing. Exit 0: nothing to do, 1: changes pending, "
                  "2: error.")
@_command
def check(
    repo: Path = REPO_ARG,
    strategy: Optional[Strategy] = STRATEGY_OPT,
    steps: Optional[str] = STEPS_OPT,
    main_script: Optional[Path] = MAIN_OPT,
    script: List[Path] = SCRIPT_OPT,
    as_json: bool = JSON_OPT,
    stat: bool = STAT_OPT,
    quiet: bool = QUIET_OPT,
):
    from patcher.patch import flow

    return flow.check(repo, strategy.value if strategy else None, _steps(steps), main_script, script)


@app.command(help="Patch the checkout: all files or none. Exit 0: applied or already applied, 2: error (nothing "
                  "written), 3: locked (another dsfix run is changing the checkout).")
@_command
def apply(
    repo: Path = REPO_ARG,
    strategy: Optional[Strategy] = STRATEGY_OPT,
    steps: Optional[str] = STEPS_OPT,
    main_script: Optional[Path] = MAIN_OPT,
    script: List[Path] = SCRIPT_OPT,
    as_json: bool = JSON_OPT,
    stat: bool = STAT_OPT,
    quiet: bool = QUIET_OPT,
):
    from patcher.patch import flow

    return flow.apply(repo, strategy.value if strategy else None, _steps(steps), main_script, script)


@app.command(help="Undo apply. Exit 0: restored or nothing to restore, 1: refused because files changed, 2: error "
                  "(also outside a checkout with no dsfix patch), 3: locked (another dsfix run is changing the "
                  "checkout).")
@_command
def revert(
    repo: Path = REPO_ARG,
    force: bool = typer.Option(False, "--force", "-f", help="Restore originals even over later edits (kept beside as *.dsfix-edited)."),
    main_script: Optional[Path] = MAIN_OPT,
    script: List[Path] = typer.Option(
        [], "--script", help="A further step-1 entry script that apply patched (repeatable), e.g. main_lora.py; "
        "needed only where the state folder is gone and dsfix does not find it by itself."),
    as_json: bool = JSON_OPT,
    quiet: bool = QUIET_OPT,
):
    from patcher.patch import flow

    return flow.revert(repo, force=force, main=main_script, scripts=script)


@app.command(short_help="Check a saved folder against its config, or against a reference.",
             help="Check a saved folder against its config (or --against a reference folder). Exit 0: it holds, "
                  "1: a check failed (a difference), 2: bad input.")
@_command
def verify(
    folder: Path = typer.Argument(..., help="A saved model folder (config.json plus safetensors weights), "
                                            "or a step-3 output folder holding actor/, critic/, actor_ema/."),
    expect: Optional[int] = typer.Option(None, help="The number of tensors the file must hold (each folder's)."),
    load: bool = typer.Option(True, help="Also load the folder (from_pretrained; a critic into its module)."),
    against: Optional[Path] = typer.Option(None, "--against", help="Compare with this reference model folder instead "
                                           "(safetensors, or a pytorch_model.bin such as zero_to_fp32's, loaded "
                                           "weights-only): keys, shapes, dtypes, values (bit-equal unless "
                                           "--atol/--rtol), ties."),
    atol: float = typer.Option(0.0, "--atol", min=0.0, help="With --against: the absolute difference allowed."),
    rtol: float = typer.Option(0.0, "--rtol", min=0.0, help="With --against: the difference allowed relative to the reference."),
    as_json: bool = JSON_OPT,
):
    from patcher.prereq import require

    require("verify")
    from patcher.checkpoint.verify import verify_path  # the input is checked before torch is imported

    return verify_path(folder, expect=expect, load=load, against=against, atol=atol, rtol=rtol)


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
@_command
def convert(
    folder: Path = typer.Argument(..., help="A DeepSpeed checkpoint (latest + global_stepN/, or global_stepN/): a "
                                            "Trainer's checkpoint-N/, an accelerate save_state folder, an "
                                            "engine.save_checkpoint folder; a Trainer's output folder (its last "
                                            "checkpoint-N/ is converted); or a DeepSpeed-Chat output folder with "
                                            "pytorch_model.bin (or a sharded .bin index) and config.json, or a step-3 "
                                            "folder holding actor/, critic/, actor_ema/ (converted in place)."),
    strategy: Strategy = typer.Option(
        Strategy.clone, help=f"clone: a tied alias is written as its own copy, restored when the .bin lacks it "
        f"({BUNDLED_TENSORS} tensors for Qwen3-0.6B); dedupe: transformers' layout, the alias left out "
        f"({BUNDLED_TENSORS - 1})."
    ),
    remove_bin: bool = typer.Option(False, "--remove-bin", help="Remove the .bin files once the safetensors are in place."),
    load: bool = typer.Option(True, help="Also load the written folder (from_pretrained; a critic into its module)."),
    config: Optional[Path] = typer.Option(None, "--config", help="DeepSpeed checkpoint: the model folder whose config.json, "
                                          "generation config and tokenizer go with the weights (default: the "
                                          "checkpoint's own folder when it holds config.json, as the Trainer's "
                                          "checkpoint-N does; accelerate's save_state and engine.save_checkpoint "
                                          "need it)."),
    output: Optional[Path] = typer.Option(None, "--output", help="DeepSpeed checkpoint: the folder to write (new or empty)."),
    tag: Optional[str] = typer.Option(None, "--tag", help="DeepSpeed checkpoint: the step folder to read (default: "
                                      "latest's); in a Trainer's output folder, the checkpoint-N to convert "
                                      "(default: the last)."),
    dtype: OutDType = typer.Option(OutDType.auto, help="DeepSpeed checkpoint: the weights' dtype (auto: config.json's)."),
    lora_scaling: Optional[float] = typer.Option(None, "--lora-scaling", help="Engine checkpoint of a DeepSpeed-Chat LoRA "
                                                 "run: the lora_scaling its layers were built with (default: step 1's 1)."),
    keep_lora: bool = typer.Option(False, "--keep-lora", help="Engine checkpoint of a LoRA run: also write the unfused "
                                   "factors to lora.safetensors beside the fused model."),
    as_json: bool = JSON_OPT,
):
    from patcher.prereq import require

    need_folder(folder)
    require("convert")
    from patcher.checkpoint import engine, zero  # no torch yet: every input below is checked before it is imported
    from patcher.checkpoint.convert import BIN_INDEX_NAME, BIN_NAME
    from patcher.checkpoint.verify import model_folders

    bins = any((f / n).is_file() for f in model_folders(folder) for n in (BIN_NAME, BIN_INDEX_NAME))
    if engine.is_engine_checkpoint(folder) or (not bins and zero.run_checkpoints(folder)):
        if remove_bin:
            raise DsfixError("--remove-bin is for .bin output folders; a DeepSpeed checkpoint is left as it is")
        if config is not None:
            need_folder(config)
        return engine.convert_engine(folder, config, output, tag=tag, dtype=dtype.value, strategy=strategy.value,
                                     load=load, console=err.console, lora_scaling=lora_scaling, keep_lora=keep_lora)
    given = [n for n, v in (("--config", config), ("--output", output), ("--tag", tag),
                            ("--lora-scaling", lora_scaling), ("--keep-lora", keep_lora or None)) if v is not None]
    if given or dtype is not OutDType.auto:
        options = given or ["--dtype"]
        what = ("a .bin output folder is converted in place" if bins else
                f"none here, nor .bin weights: found {zero.contents(folder)}")
        raise DsfixError(f"{', '.join(options)} {'is' if len(options) == 1 else 'are'} for DeepSpeed checkpoints "
                         f"(latest, checkpoint-N/); {what}",
                         path=str(folder))
    from patcher.checkpoint.convert import convert as run_convert

    return run_convert(folder, strategy=strategy.value, remove_bin=remove_bin, load=load, console=err.console)


@app.command(help="Run the checkout's save on a real Qwen3 model, then verify it. Exit 0: all checks hold, 1: a "
                  "check failed, 2: error.")
@_command
def smoke(
    repo: Path = REPO_ARG,
    device: Device = typer.Option(Device.auto, help="auto: CUDA when available."),
    dtype: DType = typer.Option(DType.bf16, help="The dtype the model is built, trained and saved in."),
    zero_stage: int = typer.Option(0, "--zero-stage", min=0, max=3, help="0: no DeepSpeed engine; 1-3 wrap the "
                                   "model in a DeepSpeed ZeRO engine of that stage (needs DeepSpeed)."),
    nproc: int = typer.Option(1, min=1, help="Ranks to start (through torch's launcher; 2 or more need DeepSpeed)."),
    expect: Optional[int] = typer.Option(None, help=f"Tensors expected (default: {BUNDLED_TENSORS} for the bundled "
                                                    "Qwen3-0.6B config; none with --model or --config)."),
    keep: Optional[Path] = typer.Option(None, help="Keep the saved folder here (a new or empty folder; removed again "
                                                   "if smoke made it and is interrupted)."),
    model: Optional[Path] = typer.Option(None, help="A model folder with real weights instead of the bundled config."),
    config: Optional[Path] = typer.Option(None, help="A config.json to build a random model from."),
    as_json: bool = JSON_OPT,
):
    from patcher.prereq import require

    refuse_file(repo)
    need_ds = f"--zero-stage {zero_stage}" if zero_stage > 0 else (f"--nproc {nproc}" if nproc > 1 else None)
    require("smoke", deepspeed=need_ds, cuda=device is Device.cuda)  # before anything expensive
    from patcher.patch.locate import find_checkout
    from patcher.checkpoint.smoke import run_smoke  # the input is checked before torch is imported

    if expect is None and model is None and config is None:
        expect = BUNDLED_TENSORS  # the bundled Qwen3-0.6B config
    return run_smoke(find_checkout(repo), device=device.value, dtype=dtype.value, zero_stage=zero_stage,
                     nproc=nproc, expect=expect, keep=keep, model_dir=model, config_path=config, console=err.console)


@app.command(help="Check, apply, smoke and revert on the bundled example checkout. Exit 0: every step passed, "
                  "1: one failed, 2: error (a missing requirement, say).")
@_command
def demo(
    device: Device = typer.Option(Device.auto, help="Device for the smoke save."),
    keep: Optional[Path] = typer.Option(None, help="Keep the demo checkout here instead of a temporary folder."),
    as_json: bool = JSON_OPT,
):
    from patcher.prereq import require

    require("demo", cuda=device is Device.cuda)  # before the patch path and torch are imported
    from patcher.demo import run_demo

    return run_demo(err.console, device=device.value, keep=keep, show_diff=not as_json)


# ----------------------------------------------------------------------------- the entry point


def _on_sigint(signum, frame):
    """Ctrl-C stops the command; a press within a second of the one before is ignored, so that putting files
    back (a commit's rollback, removing temporary folders) is not cut short by a second press."""
    now = time.monotonic()
    if _Run.interrupted_at is not None and now - _Run.interrupted_at < 1.0:
        return
    _Run.interrupted_at = now
    raise KeyboardInterrupt


def _verb_of(args: list) -> str | None:
    return next((a for a in args if a in _RENDER), None)


def main(argv=None) -> None:
    """Console entry point: every outcome is one exit code, every error one line (docs/cli.md)."""
    args = list(sys.argv[1:] if argv is None else argv)
    end = args.index("--") if "--" in args else len(args)
    debug, as_json = "--debug" in args[:end], "--json" in args[:end]
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # pragma: no cover - not the main thread
        pass
    _Run.reported, _Run.interrupted_at = False, None
    try:
        rc = app(args=args, standalone_mode=False)
    except click_exc.NoArgsIsHelpError as e:
        err.print(e.format_message())
        rc = 0
    except (click_exc.ClickException, typer.Abort, KeyboardInterrupt, Exception) as e:
        # outside a command: a usage error, or Ctrl-C while the options were parsed
        rc = _fail(e, _verb_of(args[:end]), as_json, debug)
    if rc == INTERRUPTED and not _Run.reported:  # typer turned a KeyboardInterrupt into exit 130 on its own
        rc = _fail(KeyboardInterrupt(), _verb_of(args[:end]), as_json, debug)
    rc = rc if isinstance(rc, int) else 0
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the outcome is decided and printed: a late Ctrl-C keeps it
    if _Run.interrupted_at is not None:
        # CPython remembers a KeyboardInterrupt that passed through exec() of a string (dataclasses and typing
        # build code that way) and would end the process by SIGINT instead of this exit code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
