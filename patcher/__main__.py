from patcher.startup import interrupt_at_startup

interrupt_at_startup()  # before the imports that take most of a second: Ctrl-C there is one line, exit 130

from patcher.cli import program  # noqa: E402

program()
