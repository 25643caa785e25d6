"""The one path every command takes: its result shown, anything that goes wrong one line and an exit code.

:func:`command` wraps each verb of :mod:`patcher.cli`: the result it returns renders itself on stderr (its
``render``) unless ``--quiet``, with ``--json`` its JSON goes to stdout, and it ends in the result's exit code;
anything raised becomes one line (:func:`fail`: a :class:`patcher.errors.DsfixError`'s own, a usage error's, or
"internal error" with ``--debug``'s traceback) and the error's code. :func:`run` is the program around the
verbs: usage errors, Ctrl-C (exit 130, one line saying what the files are like: ``patcher.errors.ON_INTERRUPT``)
and the exit itself. Exit codes: 0 ok, 1 pending/refused/a check failed, 2 error, 3 locked, 130 interrupted
(docs/cli.md). torch-free.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from typing import Any, Callable, Optional

import typer

from patcher.console import err
from patcher.errors import ERROR, INTERRUPTED, ON_INTERRUPT, VERBS, DsfixError, Written, interrupted_line
from patcher.report import ErrorResult

try:  # typer >= 0.22 vendors click
    from typer._click import exceptions as click_exc
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc  # type: ignore[no-redef]  # the same module, from click itself
    from click import get_current_context  # type: ignore[no-redef]  # the same function, from click itself

# click 8.2 raises this for a bare `dsfix` (no_args_is_help); click 8.1 (the last for Python 3.9) prints the
# help and exits 0 by itself
_NO_ARGS_IS_HELP: Any = getattr(click_exc, "NoArgsIsHelpError", ())

DEBUG = "dsfix.debug"  # in the click context's meta: --debug was given, anywhere on the line


class _Run:
    """This process's run: whether the one line for an error or interrupt has been printed, and when Ctrl-C
    was last pressed (a library that catches KeyboardInterrupt must not turn it into another outcome)."""

    reported = False
    interrupted_at: Optional[float] = None


def _interrupt_key(verb: Optional[str], params: dict) -> Optional[str]:
    """The entry of errors.ON_INTERRUPT for ``verb`` run with ``params``: "convert --output", say."""
    for option in ("output", "keep"):
        key = f"{verb} --{option}"
        if params.get(option) is not None and key in ON_INTERRUPT:
            return key
    return verb


def describe(exc: BaseException, verb: Optional[str], debug: bool, params: dict) -> ErrorResult:
    """What went wrong, as the ErrorResult that --json prints."""
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


def fail(exc: BaseException, verb: Optional[str], as_json: bool, debug: bool, params: Optional[dict] = None) -> int:
    """Every error and interrupt ends here: one line on stderr (after the traceback, with --debug), with
    --json an ErrorResult object on stdout, and the exit code, which --debug never changes."""
    result = describe(exc, verb, debug, params or {})
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


def emit(result: Any, opts: dict) -> None:
    """A command's result: its own rendering on stderr (unless --quiet), the JSON on stdout with --json."""
    if not opts.get("quiet"):
        result.render(err, opts)
    if opts.get("as_json"):
        sys.stdout.write(result.to_json() + "\n")
        sys.stdout.flush()


def command(fn: Callable) -> Callable:
    """Run a verb: its result through :func:`emit`, anything that goes wrong through :func:`fail`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        ctx = get_current_context()
        Written.clear()
        try:
            result = fn(*args, **kwargs)
            if _Run.interrupted_at is not None:  # Ctrl-C, swallowed on the way by a library
                raise KeyboardInterrupt
            emit(result, kwargs)
        except (typer.Exit, SystemExit):
            raise
        except BaseException as e:  # DsfixError, KeyboardInterrupt, and the unexpected
            cause: BaseException = e
            if _Run.interrupted_at is not None:  # whatever it became on the way, it began as Ctrl-C
                cause = KeyboardInterrupt()
            raise typer.Exit(fail(cause, ctx.info_name, bool(kwargs.get("as_json")), bool(ctx.meta.get(DEBUG)),
                                  kwargs)) from None
        raise typer.Exit(result.exit_code)

    return wrapper


def _on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C stops the command; a press within a second of the one before is ignored, so that putting files
    back (a commit's rollback, removing temporary folders) is not cut short by a second press."""
    now = time.monotonic()
    if _Run.interrupted_at is not None and now - _Run.interrupted_at < 1.0:
        return
    _Run.interrupted_at = now
    raise KeyboardInterrupt


def run(app: Any, argv: Optional[list] = None, program: bool = False) -> None:
    """The program: every outcome is one exit code, every error one line (docs/cli.md). ``program``: this is the
    dsfix program's own process (its console script, ``python -m patcher``), not a caller's that imports it:
    its settings are dsfix's to make (docs/cli.md, "The process")."""
    args = list(sys.argv[1:] if argv is None else argv)
    if program:
        # torch's CPU allocator backs its buffers of 2 MiB and more with transparent huge pages when asked (Linux;
        # read at torch's first such buffer): a PEFT merge's fp32 deltas and base weight copies are then faulted in
        # 2 MiB at a time, not 4 KiB (PyTorch's CPU tuning guide names the setting). A user's own setting wins.
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    end = args.index("--") if "--" in args else len(args)
    debug, as_json = "--debug" in args[:end], "--json" in args[:end]
    verb = next((a for a in args[:end] if a in VERBS), None)
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # pragma: no cover - not the main thread
        pass
    _Run.reported, _Run.interrupted_at = False, None
    try:
        rc = app(args=args, standalone_mode=False)
    except _NO_ARGS_IS_HELP as e:
        err.print(e.format_message())
        rc = 0
    except (click_exc.ClickException, typer.Abort, KeyboardInterrupt, Exception) as e:
        # outside a command: a usage error, or Ctrl-C while the options were parsed
        rc = fail(e, verb, as_json, debug)
    if rc == INTERRUPTED and not _Run.reported:  # typer turned a KeyboardInterrupt into exit 130 on its own
        rc = fail(KeyboardInterrupt(), verb, as_json, debug)
    rc = rc if isinstance(rc, int) else 0
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the outcome is decided and printed: a late Ctrl-C keeps it
    if _Run.interrupted_at is not None:
        # CPython remembers a KeyboardInterrupt that passed through exec() of a string (dataclasses and typing
        # build code that way) and would end the process by SIGINT instead of this exit code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    if program:
        exit_now(rc)
    sys.exit(rc)


def exit_now(rc: int) -> None:
    """End the program with ``rc`` once its outcome is printed, without the interpreter's teardown: freeing the
    modules of torch and transformers one by one takes 0.4-0.8 s and changes nothing on disk. What an exit
    must still do is done: the exit handlers (``atexit``) run, stdout and stderr are flushed. The ordinary exit
    where a thread that is not a daemon still runs (it waits for the thread), under a profiler, a debugger or
    coverage (``python -m cProfile`` writes its figures once the program's exit has unwound), and where a stream
    cannot be flushed (a full disk, a closed pipe: Python says so and exits 120, the output being incomplete)."""
    import atexit
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if _watched() or any(t.is_alive() and not t.daemon for t in others):
        sys.exit(rc)
    with contextlib.suppress(BaseException):  # Python 3.9 raises again what a handler raised, after printing it;
        atexit._run_exitfuncs()  # the ordinary exit, like 3.10 on, only prints it and keeps the exit code
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None where the descriptor was closed before Python started
                stream.flush()
    except (OSError, ValueError):
        sys.exit(rc)
    os._exit(rc)


def _watched() -> bool:
    """Whether a profiler, debugger or coverage tool watches this process (Python 3.12 on: through
    ``sys.monitoring`` too)."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)
    return monitoring is not None and any(monitoring.get_tool(tool) is not None for tool in range(6))
