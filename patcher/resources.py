"""Files that ship with dsfix: the templates it inserts and the fixtures the demo and smoke use.

One lookup for both: the source tree's top-level folder first (a clone or an editable install), then the
installed wheel's package data (``patcher.templates``, ``patcher._fixtures``).
"""

from __future__ import annotations

from pathlib import Path

from patcher.errors import DsfixError

_SRC_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = {"templates": "patcher.templates", "fixtures": "patcher._fixtures"}

# The model smoke and the demo build by default (random weights), and the tensors dsfix's clone save writes
# for it: 28 layers x 11 + 3 (lm_head.weight, the tied alias, included; transformers' own save writes one less).
BUNDLED_CONFIG = "models/qwen3-0.6b/config.json"
BUNDLED_TENSORS = 311


def resource_path(folder: str, rel: str) -> Path:
    """The path of ``rel`` under ``folder`` ("templates" or "fixtures"); a one-line error when it is missing."""
    src = _SRC_ROOT / folder / rel
    if src.is_file():
        return src
    try:
        from importlib.resources import files

        res = files(_PACKAGES[folder]).joinpath(rel)
        if res.is_file():
            return Path(str(res))
    except (ModuleNotFoundError, TypeError, FileNotFoundError):
        pass
    raise DsfixError(f"{folder}/{rel} is missing from this dsfix installation; reinstall dsfix")
