"""Walking a checkout's folders: where DeepSpeed-Chat's scripts and utils.py are expected, which Python files
call the save functions, the DeepSpeed-Chat folders below a folder, and what an earlier apply changed, read from
the files alone. Folders are walked in a stable order, skipping virtual environments, caches and hidden ones;
files are read only as far as a few bytes tell. What the findings mean (which script is step 1, which checkout)
is patcher.patch.locate's."""

from __future__ import annotations

import os
from pathlib import Path

from patcher.errors import DsfixError
from patcher.patch.names import PUBLIC_NAMES, SAVE_MODULE_FILE, SAVE_NAMES, TEMPLATE_MARK
from patcher.patch.resolve import resolve_script

STEP_DIRS = {
    1: "training/step1_supervised_finetuning",
    2: "training/step2_reward_model_finetuning",
    3: "training/step3_rlhf_finetuning",
}
STEP_MAIN = {step: f"{d}/main.py" for step, d in STEP_DIRS.items()}
STEP1_DIR = "step1_supervised_finetuning"
LAYOUTS = {  # layout name -> utils.py relative path
    "package": "dschat/utils/utils.py",
    "legacy": "training/utils/utils.py",
}
CHAT_SUBDIR = "applications/DeepSpeed-Chat"
SKIP_DIRS = {".git", ".dsfix", ".venv", "venv", "env", "node_modules", "__pycache__", "site-packages", "build", "dist"}


def is_chat_root(d: Path) -> bool:
    """A DeepSpeed-Chat folder: its step-1 script or one of the two utils.py layouts is there."""
    return (d / STEP_MAIN[1]).is_file() or any((d / u).is_file() for u in LAYOUTS.values())


def later_step(base: Path, p: Path) -> bool:
    """Whether ``p`` lies in a step-2 or step-3 folder below ``base`` (no candidate for step 1)."""
    rel = Path(os.path.relpath(p, base)).as_posix()
    return "step2" in rel or "step3" in rel


def step1_candidates(base: Path, depth: int = 8, limit: int = 20000) -> list:
    """Every step1_supervised_finetuning/main.py under ``base`` (``depth`` folders down at most) that calls
    the save functions (or dsfix's, once patched), in a stable order. Folders are walked, files read only
    where the name fits; ``limit`` folders at most."""
    found, base_depth, seen = [], len(base.parts), 0
    for d, dirs, files in os.walk(base):
        seen += 1
        if seen > limit:
            break
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        path = Path(d)
        if len(path.parts) - base_depth >= depth:
            dirs[:] = []
        if path.name != STEP1_DIR or "main.py" not in files:
            continue
        try:
            data = (path / "main.py").read_bytes()
        except OSError:
            continue
        if calls_save(data, (*SAVE_NAMES, *PUBLIC_NAMES)):
            found.append(path / "main.py")
    return found


def calls_save(data: bytes, names) -> bool:
    return any(f"{n}(".encode() in data for n in names) and b"def save_hf_format" not in data


def chat_roots_below(start: Path, depth: int = 4) -> list:
    """DeepSpeed-Chat folders under ``start`` (a repository that keeps its copy a few folders down)."""
    found, base = [], len(start.parts)
    for d, dirs, _files in os.walk(start):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        path = Path(d)
        if path != start and is_chat_root(path) and (path / STEP_MAIN[1]).is_file():
            found.append(path)
            dirs[:] = []
        if len(path.parts) - base >= depth:
            dirs[:] = []
    return found


def find_patched(root: Path, depth: int = 5, limit: int = 3000) -> list:
    """[(path, role, modules)] of what an earlier apply changed under ``root``, read from the files alone (for a
    revert without the state folder): utils.py and model_utils.py with dsfix's marker line, and every script
    that calls dsfix's functions imported from that utils.py, wherever it is (--main and --script ones too)."""
    marked, scripts = [], []
    for path, data in python_files(root, depth, limit):
        if TEMPLATE_MARK in data:
            marked.append((path, "loader" if b"kind=loader" in data else "utils"))
        elif any(f"{n}(".encode() in data for n in PUBLIC_NAMES):
            scripts.append(path)
    utils = [p for p, role in marked if role == "utils"]
    out = [(p, "utils", ()) for p in utils[:1]] + [(p, role, ()) for p, role in marked if role == "loader"]
    out += [(p.parent / SAVE_MODULE_FILE, "module", ()) for p in utils[:1] if (p.parent / SAVE_MODULE_FILE).is_file()]
    for script in scripts:
        try:
            res = resolve_script(script, script.read_bytes(), root)
        except (DsfixError, OSError):
            continue
        if utils and res.utils is not None and res.utils.resolve() == utils[0].resolve():
            out.append((script, "script", res.modules))
    return out


def python_files(folder: Path, depth: int = 4, limit: int = 2000):
    """(path, bytes) of the .py files under ``folder``, ``depth`` folders down at most, in a stable order,
    skipping virtual environments, caches and hidden folders; ``limit`` files at most."""
    base, seen = len(folder.parts), 0
    for d, dirs, files in os.walk(folder):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        if len(Path(d).parts) - base >= depth:
            dirs[:] = []
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            seen += 1
            if seen > limit:
                return
            try:
                yield Path(d) / f, (Path(d) / f).read_bytes()
            except OSError:
                continue


def callers(folder: Path, depth: int = 4, limit: int = 2000, names=SAVE_NAMES) -> list:
    """Python files under ``folder`` that call a save function (of ``names``) without defining save_hf_format."""
    return [path for path, data in python_files(folder, depth, limit) if calls_save(data, names)]


def defines_save(path: Path) -> bool:
    """Whether a file defines save_hf_format (a copy of the save functions), as its bytes say."""
    try:
        return b"def save_hf_format" in path.read_bytes()
    except OSError:
        return False
