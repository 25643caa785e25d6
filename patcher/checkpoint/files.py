"""Writing files that last, on the torch side (convert, engine convert): one fsync for files and folders.

The patch side has its own in ``patcher.patch.state``, and the inserted template its own (it stands alone).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """fsync a written file (an error raises), or a folder so a rename in it lasts (where the system allows)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def fsync_folder(folder: Path) -> None:
    """fsync every file in ``folder``, then the folder itself."""
    for path in sorted(folder.iterdir()):
        if path.is_file():
            fsync(path)
    fsync(folder)
