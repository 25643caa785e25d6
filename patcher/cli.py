"""The dsfix command line: parse options, call the pipeline, print, map results to exit codes."""

from __future__ import annotations

import functools
import json
import sys
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

from patcher import __version__
from patcher.errors import ERROR, DsfixError

try:  # typer >= 0.22 vendors click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Make DeepSpeed-Chat save tied-weight models (Qwen3 and friends) correctly, as safetensors.",
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
_debug = {"on": False}


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
    None, "--main", help="The step-1 script, where it is not training/step1_supervised_finetuning/main.py."
)
SCRIPT_OPT = typer.Option(
    [], "--script", help="A further step-1 entry script to patch too (repeatable), e.g. main_lora.py."
)
STRATEGY_OPT = typer.Option(
    Strategy.clone, help="clone: every tied alias saved as its own copy (311 tensors for Qwen3-0.6B); "
    "dedupe: transformers' layout, the alias dropped (310)."
)
STEPS_OPT = typer.Option(
    "1", "--steps", metavar="LIST",
    help="The DeepSpeed-Chat steps to patch, comma-separated: 1 (the default), 1,2 or 1,2,3. See README.",
)


def _guard(fn):
    """Turn a DsfixError into one line on stderr and its exit code (a traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DsfixError as e:
            if _debug["on"]:
                raise
            err.print(f"dsfix: error: {e}")
            raise typer.Exit(e.code)

    return wrapper


def _version(value: bool):
    if value:
        typer.echo(f"dsfix {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show a traceback on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
):
    _debug["on"] = debug


def _print_files(outcome) -> None:
    for f in outcome.files:
        status = f.status.value
        style = {"refused": "red", "would change": "yellow", "changed": "green"}.get(status, "none")
        counts = f" (+{f.added} -{f.removed})" if f.added or f.removed else ""
        err.line("  ", (status, style), f": {f.rel}{counts}")
        for n in f.notes:
            err.line(f"      {n}")
    for w in outcome.warnings:
        err.line(("warning:", "yellow"), f" {w}")


def _finish(outcome, as_json: bool) -> None:
    """The human summary on stderr, the JSON result on stdout if asked, then the outcome's exit code."""
    where = {None: "as recorded in its state folder", "marked": "found by dsfix's marker lines"}.get(
        outcome.layout, f"{outcome.layout} layout")
    err.print(f"dsfix {outcome.verb}: {outcome.root} ({where})")
    _print_files(outcome)
    err.print(outcome.message)
    if as_json:
        sys.stdout.write(json.dumps(outcome.to_json(), indent=2) + "\n")
    raise typer.Exit(outcome.exit_code)


def _patch_command(verb: str, doc: str):
    """check and apply take the same options; check also prints the diff (stdout) unless --json."""

    @app.command(verb, help=doc)
    @_guard
    def command(
        repo: Path = REPO_ARG,
        strategy: Strategy = STRATEGY_OPT,
        steps: str = STEPS_OPT,
        main_script: Optional[Path] = MAIN_OPT,
        script: List[Path] = SCRIPT_OPT,
        as_json: bool = JSON_OPT,
    ):
        from patcher.patch import flow

        outcome = getattr(flow, verb)(repo, strategy.value, _steps(steps), main_script, script)
        if verb == "check" and not as_json:
            sys.stdout.flush()
            sys.stdout.buffer.write(outcome.diff)
            sys.stdout.buffer.flush()
        _finish(outcome, as_json)

    return command


check = _patch_command("check", "Print the diff apply would make; write nothing. Exit 0: nothing to do, "
                                "1: changes pending, 2: error.")
apply = _patch_command("apply", "Patch the checkout: all files or none. Exit 0: applied or already applied, "
                                "2: error (nothing written).")


@app.command()
@_guard
def revert(
    repo: Path = REPO_ARG,
    force: bool = typer.Option(False, "--force", "-f", help="Restore originals even over later edits (kept beside as *.dsfix-edited)."),
    main_script: Optional[Path] = MAIN_OPT,
    script: List[Path] = SCRIPT_OPT,
    as_json: bool = JSON_OPT,
):
    """Undo apply. Exit 0: restored or nothing to restore, 1: refused because files changed, 2: error."""
    from patcher.patch import flow

    outcome = flow.revert(repo, force=force, main=main_script, scripts=script)
    _finish(outcome, as_json)


def _steps(text: str) -> tuple:
    """--steps: a comma-separated list of 1, 2 and 3 (step 1 is patched only when it is listed)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in ("1", "2", "3")]
    if bad or not parts:
        raise DsfixError(f"--steps takes a comma-separated list of 1, 2 and 3 (e.g. 1,2,3), not {text!r}")
    return tuple(sorted({int(p) for p in parts}))


@app.command()
@_guard
def verify(
    folder: Path = typer.Argument(..., help="A saved model folder (config.json plus safetensors weights), "
                                            "or a step-3 output folder holding actor/, critic/, actor_ema/."),
    expect: Optional[int] = typer.Option(None, help="The number of tensors the file must hold (each folder's)."),
    load: bool = typer.Option(True, help="Also load the folder (from_pretrained; a critic into its module)."),
    as_json: bool = JSON_OPT,
):
    """Check a saved folder against its config. Exit 0: it holds, 1: a check failed, 2: bad input."""
    from patcher.checkpoint.verify import KIND_TEXT, checks_table, model_folders, verify_folder

    folders = model_folders(folder)
    reports = []
    for path in folders:
        report = verify_folder(path, expect=expect, load=load)
        reports.append(report)
        err.print(checks_table(report.checks, title=f"dsfix verify {path}"))
        verdict = "all checks hold" if report.ok else "verification FAILED"
        err.print(f"{verdict}: {report.tensors} tensors, {KIND_TEXT[report.kind]}", markup=False)
    ok = all(r.ok for r in reports)
    if as_json:
        if folders == [folder]:
            sys.stdout.write(reports[0].to_json() + "\n")
        else:
            data = {"path": str(folder), "ok": ok, "folders": [r.to_dict() for r in reports]}
            sys.stdout.write(json.dumps(data, indent=2) + "\n")
    raise typer.Exit(0 if ok else 1)


class OutDType(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


@app.command()
@_guard
def convert(
    folder: Path = typer.Argument(..., help="A DeepSpeed-Chat output folder with pytorch_model.bin (or a sharded .bin "
                                            "index) and config.json, a step-3 folder holding actor/, critic/, actor_ema/, "
                                            "or a DeepSpeed engine checkpoint (latest + global_stepN/, or global_stepN/)."),
    strategy: Strategy = typer.Option(
        Strategy.clone, help="clone: a tied alias is written as its own copy, restored when the .bin lacks it "
        "(311 tensors for Qwen3-0.6B); dedupe: transformers' layout, the alias left out (310)."
    ),
    remove_bin: bool = typer.Option(False, "--remove-bin", help="Remove the .bin files once the safetensors are in place."),
    load: bool = typer.Option(True, help="Also load the written folder (from_pretrained; a critic into its module)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Engine checkpoint: the model folder whose config.json, "
                                          "generation config and tokenizer go with the weights."),
    output: Optional[Path] = typer.Option(None, "--output", help="Engine checkpoint: the folder to write (new or empty)."),
    tag: Optional[str] = typer.Option(None, "--tag", help="Engine checkpoint: the step folder to read (default: latest)."),
    dtype: OutDType = typer.Option(OutDType.auto, help="Engine checkpoint: the weights' dtype (auto: config.json's)."),
    as_json: bool = JSON_OPT,
):
    """Turn .bin weights or a DeepSpeed engine checkpoint into a verified safetensors folder. Exit 0: converted or nothing to convert, 1: a check failed (nothing written), 2: bad input or a refused pickle."""
    from patcher.checkpoint import engine
    from patcher.checkpoint.verify import KIND_TEXT, checks_table

    if engine.is_engine_checkpoint(folder):
        if remove_bin:
            raise DsfixError("--remove-bin is for .bin output folders; a DeepSpeed engine checkpoint is left as it is")
        result = engine.convert_engine(folder, config, output, tag=tag, dtype=dtype.value, strategy=strategy.value,
                                       load=load, console=err.console)
        err.print(result.describe(), markup=False)
        err.print(checks_table(result.checks, title=f"dsfix convert {folder}"))
        err.print(result.summary(), markup=False)
        if as_json:
            sys.stdout.write(result.to_json() + "\n")
        raise typer.Exit(result.exit_code)
    given = [n for n, v in (("--config", config), ("--output", output), ("--tag", tag)) if v is not None]
    if given or dtype is not OutDType.auto:
        raise DsfixError(f"{', '.join(given) or '--dtype'} is for DeepSpeed engine checkpoints (latest + global_stepN/); "
                         "this is not one: a .bin folder is converted in place", path=str(folder))
    from patcher.checkpoint.convert import convert as run_convert

    err.print(f"{folder}: a .bin output folder (converted in place)", markup=False)
    report = run_convert(folder, strategy=strategy.value, remove_bin=remove_bin, load=load, console=err.console)
    for result in report.folders:
        if result.checks and (not result.ok or result.status == "converted"):
            err.print(checks_table(result.checks, title=f"dsfix convert {result.path}"))
        kind = f" [{KIND_TEXT[result.kind]}]" if result.kind else ""
        err.print(result.summary() + kind, markup=False)
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
    raise typer.Exit(report.exit_code)


@app.command()
@_guard
def smoke(
    repo: Path = REPO_ARG,
    device: Device = typer.Option(Device.auto, help="auto: CUDA when available."),
    dtype: DType = typer.Option(DType.bf16),
    zero_stage: int = typer.Option(0, "--zero-stage", min=0, max=3, help="1-3 wrap the model in a DeepSpeed engine."),
    nproc: int = typer.Option(1, min=1, help="Ranks to start (through torch's launcher)."),
    expect: Optional[int] = typer.Option(None, help="Tensors expected (default: 311 for the bundled Qwen3-0.6B config)."),
    keep: Optional[Path] = typer.Option(None, help="Keep the saved folder here."),
    model: Optional[Path] = typer.Option(None, help="A model folder with real weights instead of the bundled config."),
    config: Optional[Path] = typer.Option(None, help="A config.json to build a random model from."),
    as_json: bool = JSON_OPT,
):
    """Run the checkout's save on a real Qwen3 model, then verify it. Exit 0: all checks hold, 1: a check failed, 2: error."""
    from patcher.patch.locate import find_checkout
    from patcher.checkpoint.smoke import run_smoke

    checkout = find_checkout(repo)
    if expect is None and model is None and config is None:
        expect = 311  # the bundled Qwen3-0.6B config: 28 layers x 11 + 3
    report = run_smoke(checkout, device=device.value, dtype=dtype.value, zero_stage=zero_stage, nproc=nproc,
                       expect=expect, keep=keep, model_dir=model, config_path=config, console=err.console)
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
    raise typer.Exit(0 if report.ok else 1)


@app.command()
@_guard
def demo(
    device: Device = typer.Option(Device.auto, help="Device for the smoke save."),
    keep: Optional[Path] = typer.Option(None, help="Keep the demo checkout here instead of a temporary folder."),
):
    """Check, apply, smoke and revert on the bundled example checkout."""
    from patcher.demo import run_demo

    raise typer.Exit(run_demo(err.console, device=device.value, keep=keep))


def main(argv=None) -> None:
    """Console entry point: one line on stderr and a documented exit code for every error."""
    try:
        rc = app(args=argv, standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except click_exc.ClickException as e:
        if _debug["on"]:
            raise
        if type(e).__name__ == "NoArgsIsHelpError":
            err.print(e.format_message())
            sys.exit(0)
        err.print(f"dsfix: error: {e.format_message()}")
        sys.exit(ERROR)
    except typer.Abort:
        err.print("dsfix: interrupted")
        sys.exit(130)
    except DsfixError as e:
        if _debug["on"]:
            raise
        err.print(f"dsfix: error: {e}")
        sys.exit(e.code)
    except KeyboardInterrupt:
        err.print("dsfix: interrupted; every file is as it was or wholly patched")
        sys.exit(130)
    except Exception as e:  # an unexpected failure: still one line, unless --debug
        if _debug["on"] or "--debug" in (argv or sys.argv):
            raise
        err.print(f"dsfix: internal error: {type(e).__name__}: {e} (run with --debug for a traceback)")
        sys.exit(ERROR)
