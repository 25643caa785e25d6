"""REPO argument -> Checkout: find the DeepSpeed-Chat folder and its layout, the way git finds .git."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from patcher.errors import DsfixError

STEP_DIRS = {
    1: "training/step1_supervised_finetuning",
    2: "training/step2_reward_model_finetuning",
    3: "training/step3_rlhf_finetuning",
}
STEP_MAIN = {step: f"{d}/main.py" for step, d in STEP_DIRS.items()}

# layout name -> (utils.py relative path, module name main.py imports it as)
LAYOUTS = {
    "package": ("dschat/utils/utils.py", "dschat.utils.utils"),
    "legacy": ("training/utils/utils.py", "utils.utils"),
}
CHAT_SUBDIR = "applications/DeepSpeed-Chat"


@dataclass(frozen=True)
class Checkout:
    root: Path  # the DeepSpeed-Chat folder
    layout: str  # "package" or "legacy"
    utils_path: Path
    step_mains: dict  # step number -> Path of main.py (only the steps that exist)

    @property
    def utils_module(self) -> str:
        return LAYOUTS[self.layout][1]

    @property
    def state_dir(self) -> Path:
        return self.root / ".dsfix"

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()


def _is_chat_root(d: Path) -> bool:
    return (d / STEP_MAIN[1]).is_file() or any((d / u).is_file() for u, _ in LAYOUTS.values())


def _candidates(start: Path):
    for d in (start, *start.parents):
        yield d
        yield d / CHAT_SUBDIR


def find_checkout(repo: str | os.PathLike = ".") -> Checkout:
    """Locate the DeepSpeed-Chat checkout at or above ``repo`` (or under its applications/DeepSpeed-Chat)."""
    start = Path(repo)
    if not start.exists():
        raise DsfixError(f"no such file or folder: {repo}")
    start = start.resolve()
    if start.is_file():
        start = start.parent
    for d in _candidates(start):
        if d.is_dir() and _is_chat_root(d):
            return _checkout_at(d)
    raise DsfixError(
        f"no DeepSpeed-Chat checkout at or above {repo}: looked for {STEP_MAIN[1]} with "
        f"{LAYOUTS['package'][0]} or {LAYOUTS['legacy'][0]}, also under {CHAT_SUBDIR}/"
    )


def _checkout_at(root: Path) -> Checkout:
    layouts = [name for name, (u, _) in LAYOUTS.items() if (root / u).exists() or (root / u).is_symlink()]
    if not layouts:
        raise DsfixError(
            f"unknown DeepSpeed-Chat layout: neither {LAYOUTS['package'][0]} nor {LAYOUTS['legacy'][0]} exists",
            path=str(root),
        )
    # Both present: the package layout is the one upstream's step-1 main.py imports since late 2023.
    layout = layouts[0]
    utils_path = root / LAYOUTS[layout][0]
    mains = {s: root / p for s, p in STEP_MAIN.items() if (root / p).exists() or (root / p).is_symlink()}
    if 1 not in mains:
        raise DsfixError(f"no step-1 {STEP_MAIN[1]} in this DeepSpeed-Chat checkout", path=str(root))
    for p in (utils_path, *mains.values()):
        check_inside(root, p)
    return Checkout(root=root, layout=layout, utils_path=utils_path, step_mains=mains)


def check_inside(root: Path, path: Path) -> None:
    """Refuse a target that is a symlink leading outside the checkout, or that is not a regular file."""
    real = path.resolve()
    if path.is_symlink() and not real.is_relative_to(root.resolve()):
        raise DsfixError(f"refusing to follow a symlink that leads outside the checkout (to {real})", path=str(path))
    if not real.is_file():
        raise DsfixError("is not a regular file", path=str(path))
