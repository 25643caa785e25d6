"""REPO argument -> Checkout: find the DeepSpeed-Chat folder, its step-1 script and the utils.py that script
really imports (resolved by file, see patcher.patch.resolve), the way git finds .git."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from patcher.errors import DsfixError
from patcher.patch.names import PUBLIC_NAMES, SAVE_NAMES
from patcher.patch.resolve import resolve_script

STEP_DIRS = {
    1: "training/step1_supervised_finetuning",
    2: "training/step2_reward_model_finetuning",
    3: "training/step3_rlhf_finetuning",
}
STEP_MAIN = {step: f"{d}/main.py" for step, d in STEP_DIRS.items()}

# layout name -> utils.py relative path
LAYOUTS = {
    "package": "dschat/utils/utils.py",
    "legacy": "training/utils/utils.py",
}
CHAT_SUBDIR = "applications/DeepSpeed-Chat"
_SKIP_DIRS = {".git", ".dsfix", ".venv", "venv", "env", "node_modules", "__pycache__", "site-packages", "build", "dist"}


@dataclass(frozen=True)
class Checkout:
    root: Path  # the DeepSpeed-Chat folder (or the folder given with --main)
    layout: str  # "package", "legacy", or "fork" for a utils.py elsewhere
    utils_path: Path
    step_mains: dict  # step number -> Path of main.py (only the steps that exist)
    scripts: tuple = ()  # further step-1 entry scripts patched with --script
    modules: dict = field(default_factory=dict)  # rel of each script -> dotted names that resolve to utils_path
    utils_module: str = ""  # the dotted name step-1 main.py imports utils_path as
    import_root: Path | None = None  # the folder that name resolves from
    notes: tuple = ()  # what locating found worth telling (a shadowed copy, scripts left alone)

    def rel(self, path: Path) -> str:
        return Path(os.path.abspath(path)).relative_to(self.root).as_posix()

    def targets(self, steps=(1,), strict: bool = True) -> list:
        """[(rel, role, modules)] for utils.py and the scripts of ``steps`` (step 1 includes --script ones).

        Steps 2 and 3 are resolved here, when asked for: ``strict`` makes a step that is missing or imports
        another utils.py an error; otherwise it is skipped."""
        out = [(self.rel(self.utils_path), "utils", ())]
        for step in sorted(set(steps)):
            if step == 1:
                out.append((self.rel(self.step_mains[1]), "step1", self.modules[self.rel(self.step_mains[1])]))
                out += [(self.rel(s), "step1", self.modules[self.rel(s)]) for s in self.scripts]
                continue
            path = self.step_mains.get(step)
            if path is None:
                if strict:
                    raise DsfixError(f"this checkout has no step-{step} main.py", path=str(self.root))
                continue
            try:
                res = _resolve(self.root, path)
            except DsfixError:
                if strict:
                    raise
                continue
            if res.utils != self.utils_path:
                if strict:
                    raise DsfixError(f"imports {_rel(self.root, res.utils)}, not {self.rel(self.utils_path)} as "
                                     "step 1 does; patch it in a separate run", path=self.rel(path))
                continue
            out.append((self.rel(path), f"step{step}", res.modules))
        if any(s in (2, 3) for s in steps):
            loader = self.loader_path()
            if loader is not None:  # (without it, plan_apply warns that step 3 cannot read step 2's output)
                out.append((self.rel(loader), "loader", ()))
        return out

    def loader_path(self) -> Path | None:
        """The file that defines create_critic_model: model/model_utils.py beside utils.py in both layouts."""
        for p in (self.utils_path.parent / "model" / "model_utils.py",):
            try:
                if b"def create_critic_model(" in p.read_bytes():
                    check_inside(self.root, p)
                    return p
            except OSError:
                continue
        return None


def _is_chat_root(d: Path) -> bool:
    return (d / STEP_MAIN[1]).is_file() or any((d / u).is_file() for u in LAYOUTS.values())


def _candidates(start: Path):
    for d in (start, *start.parents):
        yield d
        yield d / CHAT_SUBDIR


def _chat_root(start: Path) -> Path | None:
    for d in _candidates(start):
        if d.is_dir() and _is_chat_root(d):
            return d
    return None


def find_checkout(repo: str | os.PathLike = ".", main: str | os.PathLike | None = None, scripts=()) -> Checkout:
    """Locate the checkout at or above ``repo`` (or under its applications/DeepSpeed-Chat).

    ``main``: the step-1 script, for layouts without training/step1_supervised_finetuning/main.py;
    ``scripts``: further step-1 entry scripts to patch as well.
    """
    start = Path(repo)
    if not start.exists():
        raise DsfixError(f"no such file or folder: {repo}")
    start = start.resolve()
    if start.is_file():
        start = start.parent
    main_path = _given(main, "--main") if main is not None else None
    script_paths = [_given(s, "--script") for s in scripts]
    notes = []
    if main_path is None:
        remembered = _remembered(start)
        if remembered is not None:  # an earlier apply named the scripts: use them again
            root, main_path, recorded = remembered
            return _checkout_at(root, main_path, script_paths or recorded)
    root = _chat_root(start)
    if main_path is not None and (root is None or not main_path.is_relative_to(root)):
        root = start if main_path.is_relative_to(start) else main_path.parent
    if root is None:
        below = _chat_roots_below(start)
        if len(below) == 1:
            root = below[0]
            notes.append(f"found the DeepSpeed-Chat folder at {os.path.relpath(root, start)}")
        elif below:
            shown = ", ".join(os.path.relpath(p, start) for p in below[:6])
            raise DsfixError(f"several DeepSpeed-Chat folders below {repo} ({shown}); run dsfix on one of them")
    if root is None:
        raise DsfixError(
            f"no DeepSpeed-Chat checkout at or above {repo}: looked for {STEP_MAIN[1]} with "
            f"{LAYOUTS['package']} or {LAYOUTS['legacy']}, also under {CHAT_SUBDIR}/"
            + _suggest(start)
        )
    co = _checkout_at(root, main_path, script_paths)
    return dataclasses.replace(co, notes=(*notes, *co.notes)) if notes else co


def _remembered(start: Path):
    """(root, step-1 script, further scripts) as an earlier apply recorded them in a state folder at or above
    ``start``, when that script still exists; else None."""
    root = find_state_root(start)
    if root is None:
        return None
    from patcher.patch import state

    recorded = state.recorded_scripts(root)
    if recorded is None:
        return None
    main, scripts = root / recorded[0], [root / s for s in recorded[1]]
    scripts = [s for s in scripts if s.is_file()]
    if not main.is_file() or (main == root / STEP_MAIN[1] and not scripts):
        return None
    return root, main, scripts


def _chat_roots_below(start: Path, depth: int = 4) -> list:
    """DeepSpeed-Chat folders under ``start`` (a repository that keeps its copy a few folders down)."""
    found, base = [], len(start.parts)
    for d, dirs, _files in os.walk(start):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
        path = Path(d)
        if path != start and _is_chat_root(path) and (path / STEP_MAIN[1]).is_file():
            found.append(path)
            dirs[:] = []
        if len(path.parts) - base >= depth:
            dirs[:] = []
    return found


def find_state_root(repo: str | os.PathLike = ".") -> Path | None:
    """The folder at or above ``repo`` whose state folder records an earlier apply, if any."""
    from patcher.patch import state

    start = Path(repo)
    if not start.exists():
        raise DsfixError(f"no such file or folder: {repo}")
    start = start.resolve()
    for d in (start, *start.parents):
        if state.has_state(d):
            return d
    return None


def find_patched(root: Path, depth: int = 5, limit: int = 3000) -> list:
    """[(path, role, modules)] of what an earlier apply changed under ``root``, read from the files alone (for a
    revert without the state folder): utils.py and model_utils.py with dsfix's marker line, and every script
    that calls dsfix's functions imported from that utils.py, wherever it is (--main and --script ones too)."""
    marked, scripts = [], []
    for path, data in python_files(root, depth, limit):
        if b"# dsfix: template=" in data:
            marked.append((path, "loader" if b"kind=loader" in data else "utils"))
        elif any(f"{n}(".encode() in data for n in PUBLIC_NAMES):
            scripts.append(path)
    utils = [p for p, role in marked if role == "utils"]
    out = [(p, "utils", ()) for p in utils[:1]] + [(p, role, ()) for p, role in marked if role == "loader"]
    for script in scripts:
        try:
            res = resolve_script(script, script.read_bytes(), root)
        except (DsfixError, OSError):
            continue
        if utils and res.utils is not None and res.utils.resolve() == utils[0].resolve():
            out.append((script, "script", res.modules))
    return out


def _given(p, option) -> Path:
    path = Path(p)
    if not path.is_file():
        raise DsfixError(f"{option}: no such file", path=str(p))
    return Path(os.path.abspath(path))


def python_files(folder: Path, depth: int = 4, limit: int = 2000):
    """(path, bytes) of the .py files under ``folder``, ``depth`` folders down at most, in a stable order,
    skipping virtual environments, caches and hidden folders; ``limit`` files at most."""
    base, seen = len(folder.parts), 0
    for d, dirs, files in os.walk(folder):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
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


def callers(folder: Path, depth: int = 4, limit: int = 2000) -> list:
    """Python files under ``folder`` that call a save function without defining save_hf_format."""
    return [path for path, data in python_files(folder, depth, limit)
            if any(f"{n}(".encode() in data for n in SAVE_NAMES) and b"def save_hf_format" not in data]


def _suggest(start: Path) -> str:
    found = callers(start, depth=3)
    if not found:
        return ""
    shown = ", ".join(os.path.relpath(p, start) for p in found[:5])
    return f"; scripts that call save_hf_format here: {shown} (pass --main PATH)"


def _checkout_at(root: Path, main_path: Path | None, scripts: list) -> Checkout:
    if main_path is None:
        main_path = root / STEP_MAIN[1]
        if not (main_path.exists() or main_path.is_symlink()):
            found = [p for p in callers(root) if "step2" not in str(p) and "step3" not in str(p)]
            hint = ""
            if found:
                hint = "; scripts that call save_hf_format: " + ", ".join(
                    Path(os.path.relpath(p, root)).as_posix() for p in found[:6]) + " (pass one with --main PATH)"
            raise DsfixError(f"no step-1 {STEP_MAIN[1]} in this DeepSpeed-Chat checkout{hint}", path=str(root))
    mains = {1: main_path}
    mains.update({s: root / p for s, p in STEP_MAIN.items() if s > 1 and ((root / p).exists() or (root / p).is_symlink())})
    for p in (*mains.values(), *scripts):
        check_inside(root, p)
    scripts = [s for s in dict.fromkeys(scripts) if s != main_path]
    res = _resolve(root, main_path)
    utils_path = res.utils
    check_inside(root, utils_path)
    modules = {_rel(root, main_path): res.modules}
    notes = list(res.notes)
    for s in scripts:
        other = _resolve(root, s)
        if other.utils != utils_path:
            raise DsfixError(f"imports its save functions from {_rel(root, other.utils)}, but step-1 main.py "
                             f"from {_rel(root, utils_path)}; patch them in separate runs", path=str(s))
        modules[_rel(root, s)] = other.modules
        notes += other.notes
    notes += _shadowed(root, utils_path)
    notes += _left_alone(root, main_path, scripts)
    rel_utils = _rel(root, utils_path)
    layout = next((name for name, u in LAYOUTS.items() if u == rel_utils), "fork")
    first = res.modules[0]
    import_root = utils_path.parent
    for _ in first.split(".")[1:]:
        import_root = import_root.parent
    return Checkout(root=root, layout=layout, utils_path=utils_path, step_mains=mains, scripts=tuple(scripts),
                    modules=modules, utils_module=first, import_root=import_root, notes=tuple(notes))


def _rel(root: Path, p: Path) -> str:
    try:
        return Path(os.path.abspath(p)).relative_to(root).as_posix()
    except ValueError:
        return str(p)


def _resolve(root: Path, script: Path):
    try:
        data = script.read_bytes()
    except OSError as e:
        raise DsfixError(f"cannot read: {e.strerror or e}", path=str(script)) from None
    res = resolve_script(script, data, root)
    if res.utils is None:
        raise DsfixError(res.describe_failure(), path=_rel(root, script))
    if not res.utils.is_relative_to(root):
        raise DsfixError(f"imports its save functions from {res.utils}, outside the checkout {root}; "
                         "run dsfix on the folder that holds both", path=_rel(root, script))
    return res


def _shadowed(root: Path, utils_path: Path) -> list:
    out = []
    for name, rel in LAYOUTS.items():
        other = root / rel
        if other.is_file() and other.resolve() != utils_path.resolve():
            out.append(f"step 1 imports {_rel(root, utils_path)}, which shadows {rel}: the copy step 1 really "
                       f"imports is the one patched, and {rel} is left alone")
    return out


def _left_alone(root: Path, main_path: Path, scripts) -> list:
    others = [p for p in callers(main_path.parent, depth=1) if p != main_path and p not in scripts]
    return [f"{_rel(root, p)} also calls the save functions and is not patched (add --script {_rel(root, p)})"
            for p in others]


def check_inside(root: Path, path: Path) -> None:
    """Refuse a target that is a symlink leading outside the checkout, or that is not a regular file."""
    real = path.resolve()
    if path.is_symlink() and not real.is_relative_to(root.resolve()):
        raise DsfixError(f"refusing to follow a symlink that leads outside the checkout (to {real})", path=str(path))
    if not real.is_file():
        raise DsfixError("is not a regular file", path=str(path))
