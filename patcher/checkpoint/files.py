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


def make_staging(parent: Path, prefix: str) -> Path:
    """A new folder ``parent/PREFIX…`` created as any folder the user makes: its mode follows the umask (0755
    under 022, 0775 under 002), so the folder renamed into place from it is readable where the user's folders
    are (``tempfile.mkdtemp`` would leave it 0700)."""
    import secrets

    for _ in range(100):
        path = Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name for a staging folder in {parent}")
