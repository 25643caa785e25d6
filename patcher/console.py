"""Where dsfix's messages go: stderr, plain text, with colour only on a terminal (``NO_COLOR`` honoured).

stdout carries only a command's diff or its ``--json``; everything said to a person goes through :data:`err`.
rich is imported only for a terminal, or for what needs it (tables, progress). torch-free.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class Stderr:
    """Every message goes to stderr: plain text, with colour only on a terminal (NO_COLOR honoured)."""

    def __init__(self) -> None:
        self._console: Any = None

    @property
    def console(self) -> Any:
        """rich's Console on stderr, for tables and progress bars."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False, soft_wrap=True)
        return self._console

    def _color(self) -> bool:
        return sys.stderr.isatty() and "NO_COLOR" not in os.environ

    def line(self, *parts: Any) -> None:
        """One line from ``parts``: plain strings, or (text, style) pairs styled on a terminal."""
        if self._color():
            from rich.text import Text

            self.console.print(Text.assemble(*parts))
            return
        sys.stderr.write("".join(p if isinstance(p, str) else p[0] for p in parts) + "\n")
        sys.stderr.flush()

    def print(self, obj: Any, markup: bool = False) -> None:
        """A plain line, or (tables and the other renderables of verify, convert and smoke) rich's print,
        whose own markup (a cell's "[green]ok[/]") renders as style, or as nothing off a terminal."""
        if isinstance(obj, str) and not markup:
            self.line(obj)
        elif isinstance(obj, str):
            self.console.print(obj, markup=True)
        else:
            self.console.print(obj)


err = Stderr()
