"""Ctrl-C before the command line is ready: one line and exit 130, nothing written yet.

Until the CLI's ``main()`` runs (its imports take most of a second), a SIGINT would end Python with a
traceback; the dsfix program installs :func:`interrupt_at_startup` first thing instead (``patcher/cli.py``,
``patcher/__main__.py``). It imports nothing heavy: :mod:`patcher.report` only, for the ``--json`` line.
"""

from __future__ import annotations

import os
import signal
import sys

from patcher.errors import INTERRUPTED, VERBS, interrupted_line


class _Startup:
    ready = False  # patcher.report is imported: the handler can print the JSON
    pending = False  # Ctrl-C came before that


def interrupt_at_startup() -> None:
    """Until the CLI's main() runs (imports take most of a second), Ctrl-C ends the program at once with
    one line and exit 130: nothing has been written yet. Installed only by the dsfix program itself."""
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        signal.signal(signal.SIGINT, _startup_handler)
    except ValueError:  # pragma: no cover - not the main thread
        return
    import importlib

    importlib.import_module("patcher.report")  # what the handler prints; a press meanwhile waits for it

    _Startup.ready = True
    if _Startup.pending:
        _startup_handler(signal.SIGINT, None)


def _startup_handler(signum, frame):  # pragma: no cover - runs in a real process (tests/test_cli_interrupt.py)
    if not _Startup.ready:
        _Startup.pending = True
        return
    from patcher.report import ErrorResult

    text = interrupted_line()
    if "--json" in sys.argv[1:]:
        verb = next((a for a in sys.argv[1:] if a in VERBS), None)
        os.write(1, (ErrorResult.interrupted(verb, text).to_json() + "\n").encode())
    os.write(2, f"dsfix: {text}\n".encode())
    os._exit(INTERRUPTED)
