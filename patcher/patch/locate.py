"""REPO argument -> Checkout: find the DeepSpeed-Chat folder, its step-1 script and the utils.py that script
really imports (resolved by file, see patcher.patch.resolve), the way git finds .git."""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from patcher.errors import DsfixError, file_not_folder, shown
from patcher.patch import state
from patcher.patch.names import PUBLIC_NAMES, SAVE_MODULE_FILE, SAVE_NAMES
from patcher.patch.resolve import resolve_script
from patcher.patch.scan import (
    CHAT_SUBDIR,
    LAYOUTS,
    STEP1_DIR,
    STEP_DIRS,
    STEP_MAIN,
    callers,
    chat_roots_below,
    defines_save,
    is_chat_root,
    later_step,
    step1_candidates,
)


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
        out = [(self.rel(self.utils_path), "utils", ()), (self.rel(self.module_path), "module", ())]
        for step in sorted(set(steps)):
            if step == 1:
                out.append((self.rel(self.step_mains[1]), "step1", self.modules[self.rel(self.step_mains[1])]))
                out += [(self.rel(s), "step1", self.modules[self.rel(s)]) for s in self.scripts]
                continue
            path = self.step_mains.get(step)
            if path is None:
                if strict:
                    raise DsfixError(f"--steps names step {step}, but there is no step-{step} script at "
                                     f"{step_script(self.root, self.step_mains[1], step)}; leave {step} out of --steps")
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
                                     f"step 1 does; patch step {step} in a separate run", path=self.rel(path))
                continue
            out.append((self.rel(path), f"step{step}", res.modules))
        if any(s in (2, 3) for s in steps):
            loader = self.loader_path()
            if loader is not None:  # (without it, plan_apply warns that step 3 cannot read step 2's output)
                out.append((self.rel(loader), "loader", ()))
        return out

    @property
    def module_path(self) -> Path:
        """Where dsfix's save module goes: beside utils.py, which imports it."""
        return self.utils_path.parent / SAVE_MODULE_FILE

    def loader_path(self) -> Path | None:
        """The file that defines create_critic_model: model/model_utils.py beside utils.py in both layouts."""
        p = self.utils_path.parent / "model" / "model_utils.py"
        try:
            defines = b"def create_critic_model(" in p.read_bytes()
        except OSError:
            return None
        if defines:
            check_inside(self.root, p)
        return p if defines else None


def layout_of(saved, co: "Checkout | None") -> str:
    """The layout revert reports: the one of the utils.py the state folder records, else the checkout's, else
    "marked" (found by dsfix's marker lines alone)."""
    if saved is not None:
        rel = next((rel for rel, e in saved.entries.items() if e.get("role") == "utils"), None)
        return next((name for name, u in LAYOUTS.items() if u == rel), "fork")
    return co.layout if co is not None else "marked"


def _candidates(start: Path):
    for d in (start, *start.parents):
        yield d
        yield d / CHAT_SUBDIR


def _chat_root(start: Path) -> Path | None:
    for d in _candidates(start):
        if d.is_dir() and is_chat_root(d):
            return d
    return None


def find_checkout(repo: str | os.PathLike = ".", main: str | os.PathLike | None = None, scripts=()) -> Checkout:
    """Locate the checkout at or above ``repo`` (or under its applications/DeepSpeed-Chat).

    ``main``: the step-1 script, for layouts without training/step1_supervised_finetuning/main.py;
    ``scripts``: further step-1 entry scripts to patch as well. Both are looked up in the checkout first,
    then in the current folder. Without ``main``: the one an earlier apply recorded, else
    training/step1_supervised_finetuning/main.py, else the one step1_supervised_finetuning/main.py at any
    depth that calls the save functions.
    """
    start = Path(repo)
    if not start.exists():
        raise DsfixError("no such file or folder; pass a DeepSpeed-Chat checkout or a folder inside it",
                         path=str(repo))
    start = start.resolve()
    if start.is_file():
        raise file_not_folder(_shown_arg(repo))
    root = _chat_root(start)
    home = root or _step1_base(start)  # what --main and --script are relative to first
    notes: list[str] = []
    main_path = _given(main, "--main", home, notes) if main is not None else None
    script_paths = [_given(s, "--script", home, notes) for s in scripts]
    if main_path is None:
        rec = state.recorded(root or start)  # the checkout below, when dsfix runs from the repository's top
        remembered = _remembered(rec)
        if remembered is not None:  # an earlier apply named the scripts: use them again
            root, main_path, recorded_scripts = remembered
            co = _checkout_at(root, main_path, script_paths or recorded_scripts)
            return dataclasses.replace(co, notes=(*notes, *co.notes)) if notes else co
    if main_path is not None and (root is None or not main_path.is_relative_to(root)):
        root = home if main_path.is_relative_to(home) else main_path.parent
    if root is None:
        root = _one_chat_root_below(start, repo, notes)
    if main_path is None and (root is None or not _exists(root / STEP_MAIN[1])):
        root, main_path = _step1_anywhere(root, home, notes)
        if main_path is None:
            main_path = one_saving_script(root or home, home, notes)
            if main_path is not None and root is None:
                root = home
    if root is None:
        raise _no_checkout(start, repo)
    co = _checkout_at(root, main_path, script_paths, home)
    return dataclasses.replace(co, notes=(*notes, *co.notes)) if notes else co


def _one_chat_root_below(start: Path, repo, notes: list) -> Path | None:
    """The one DeepSpeed-Chat folder below ``start`` (a repository that keeps its copy a few folders down);
    several are refused, naming them."""
    below = chat_roots_below(start)
    if len(below) > 1:
        shown_below = shown([Path(os.path.relpath(p, start)).as_posix() for p in below])
        raise DsfixError(f"{len(below)} DeepSpeed-Chat folders below this one ({shown_below}); run dsfix on "
                         "one of them", path=_shown_arg(repo),
                         detail=[Path(os.path.relpath(p, start)).as_posix() for p in below])
    if below:
        notes.append(f"found the DeepSpeed-Chat folder at {os.path.relpath(below[0], start)}")
        return below[0]
    return None


def _step1_anywhere(root: Path | None, home: Path, notes: list) -> tuple:
    """(root, step-1 script): the one step1_supervised_finetuning/main.py that saves, at any depth, where the
    usual one is missing; several are refused, naming a --main for each; (root, None) when there is none."""
    base = root or home
    found = step1_candidates(base)
    if len(found) > 1:
        rels = [Path(os.path.relpath(p, home)).as_posix() for p in found]  # as --main takes them
        raise DsfixError(f"{len(found)} step-1 scripts named {STEP1_DIR}/main.py and none at {STEP_MAIN[1]}; "
                         "pass the one to patch: " + shown([_opt("--main", r) for r in rels], sep=" or "),
                         detail=[_opt("--main", r) for r in rels])
    if not found:
        return root, None
    notes.append(f"no {STEP_MAIN[1]}: using {_rel(base, found[0])}, the one {STEP1_DIR}/main.py "
                 "that calls the save functions (--main picks another)")
    return base, found[0]


STEP1_WORDS = ("sft", "step1", "supervised")


def one_saving_script(base: Path, home: Path, notes: list) -> Path | None:
    """The script to take as step 1 where no step1_supervised_finetuning/main.py saves: the one script under
    ``base`` that calls the save functions (outside the files that define them, and outside step 2's and 3's
    folders); of several, the one whose path alone says supervised fine-tuning (STEP1_WORDS), others named
    with the --main that picks them. None where that does not decide (the refusal then names each)."""
    found = [p for p in callers(base, names=(*SAVE_NAMES, *PUBLIC_NAMES)) if not later_step(base, p)]
    rels = [Path(os.path.relpath(p, home)).as_posix() for p in found]
    if len(found) == 1:
        notes.append(f"step 1: {rels[0]}, the one script that calls {_called(found[0])} (--main picks another)")
        return found[0]
    sft = [i for i, r in enumerate(rels) if any(w in r.lower() for w in STEP1_WORDS)]
    if len(found) > 1 and len(sft) == 1:
        others = shown([_opt("--main", r) for i, r in enumerate(rels) if i != sft[0]], sep=" or ")
        notes.append(f"step 1: {rels[sft[0]]}, of {len(found)} scripts that call {_called(found[sft[0]])} the one "
                     f"whose name says supervised fine-tuning ({others} picks another)")
        return found[sft[0]]
    return None


def _called(path: Path) -> str:
    """The first save function a script calls, by name (for the line that says why it is step 1)."""
    try:
        data = path.read_bytes()
    except OSError:
        return SAVE_NAMES[0]
    return next((n for n in (*SAVE_NAMES, *PUBLIC_NAMES) if f"{n}(".encode() in data), SAVE_NAMES[0])


def _no_checkout(start: Path, repo) -> DsfixError:
    found = callers(start, depth=3)
    rels = [Path(os.path.relpath(p, start)).as_posix() for p in found]
    hint = ("; for a script that calls save_hf_format, pass " + shown([_opt("--main", r) for r in rels], sep=" or ")
            if found else "; run dsfix in one, or name the step-1 script with --main")
    return DsfixError(f"no DeepSpeed-Chat checkout here or above (no {STEP1_DIR}/main.py that saves){hint}",
                      path=_shown_arg(repo),
                      detail=[f"looked for {STEP_MAIN[1]}, a {STEP1_DIR}/main.py that calls the save functions, "
                              f"{LAYOUTS['package']} or {LAYOUTS['legacy']}, here, above and under {CHAT_SUBDIR}/",
                              *(_opt("--main", r) for r in rels)])


def _opt(option: str, rel: str) -> str:
    """An option and its path as the user would type it (quoted where a shell needs it)."""
    return f"{option} {shlex.quote(rel)}"


def _shown_arg(repo) -> str:
    """The REPO argument as the user wrote it (a path relative to where they are)."""
    return Path(repo).as_posix()


def _exists(p: Path) -> bool:
    return p.exists() or p.is_symlink()


def _step1_base(start: Path) -> Path:
    """``start``, or, inside a step1_supervised_finetuning folder, the folder that holds it."""
    for d in (start, *start.parents):
        if d.name == STEP1_DIR:
            return d.parent
    return start


def _remembered(rec):
    """(root, step-1 script, further scripts) as an earlier apply recorded them (``rec``, a state.Record),
    when that script still exists and is not the one dsfix would find anyway; else None."""
    if rec is None or not rec.main:
        return None
    root = rec.root
    main = root / rec.main
    scripts = [root / s for s in rec.scripts if (root / s).is_file()]
    if not main.is_file() or (main == root / STEP_MAIN[1] and not scripts):
        return None
    return root, main, scripts


def _given(p, option, home: Path, notes: list) -> Path:
    """An option's path: relative to the checkout (``home``) first, then to the current folder."""
    path = Path(p)
    tried = [path] if path.is_absolute() else [home / path, Path.cwd() / path]
    if not any(c.is_file() for c in tried) and any(c.is_dir() for c in tried):
        raise DsfixError(f"{option}: is a folder; {option} names a script (the step-1 main.py, say)",
                         path=path.as_posix())
    for i, cand in enumerate(tried):
        if cand.is_file():
            cand = Path(os.path.abspath(cand))
            if not path.is_absolute():
                where = "the checkout" if i == 0 else "the current folder"
                other = tried[1 - i]
                also = (f", not {path.as_posix()} in the current folder" if i == 0 and other.is_file()
                        and os.path.abspath(other) != str(cand) else "")
                rel = _rel(home, cand)
                used = "" if rel == path.as_posix() else f" is {rel},"
                notes.append(f"{option} {path.as_posix()}:{used} found relative to {where}{also}")
            return cand
    if path.is_absolute():
        raise DsfixError(f"{option}: no such file", path=str(p))
    raise DsfixError(f"{option}: no such file in the checkout or the current folder; pass a path relative to "
                     "either", path=path.as_posix())


def _checkout_at(root: Path, main_path: Path | None, scripts: list, home: Path | None = None) -> Checkout:
    """``home``: the folder --main paths are relative to first (for the paths a refusal suggests)."""
    if main_path is None:
        main_path = root / STEP_MAIN[1]
        if not _exists(main_path):
            found = [Path(os.path.relpath(p, home or root)).as_posix() for p in callers(root)
                     if not later_step(root, p)]
            hint = ("; pass the script that saves: " + shown([_opt("--main", r) for r in found], sep=" or ")
                    if found else "")
            raise DsfixError(f"no {STEP_MAIN[1]} and no other {STEP1_DIR}/main.py that calls the save functions"
                             f"{hint}", detail=[_opt("--main", r) for r in found])
    mains = {1: main_path, **_later_steps(root, main_path)}
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
            raise DsfixError(f"imports its save functions from {_rel(root, other.utils)}, but the step-1 script "
                             f"{_rel(root, main_path)} from {_rel(root, utils_path)}; patch them in separate runs",
                             path=_rel(root, s))
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


def _later_steps(root: Path, main_path: Path) -> dict:
    """Steps 2 and 3 beside step 1: siblings of its step1_supervised_finetuning folder wherever that is, else
    under training/."""
    parent = main_path.parent.parent if main_path.parent.name == STEP1_DIR else root / "training"
    out = {}
    for step in (2, 3):
        p = parent / Path(STEP_DIRS[step]).name / "main.py"
        if _exists(p):
            out[step] = p
    return out


def step_script(root: Path, main_path: Path, step: int) -> str:
    """Where step ``step``'s main.py is looked for, relative to ``root`` (for messages)."""
    parent = main_path.parent.parent if main_path.parent.name == STEP1_DIR else root / "training"
    return _rel(root, parent / Path(STEP_DIRS[step]).name / "main.py")


def _rel(root: Path, p: Path) -> str:
    try:
        return Path(os.path.abspath(p)).relative_to(root).as_posix()
    except ValueError:
        return str(p)


def _resolve(root: Path, script: Path):
    try:
        data = script.read_bytes()
    except OSError as e:
        raise DsfixError(f"cannot be read: {e.strerror or e}", path=_rel(root, script)) from None
    res = resolve_script(script, data, root)
    if res.utils is None:
        message, line, detail = res.describe_failure()
        raise DsfixError(message, path=_rel(root, script), line=line, detail=detail)
    if not res.utils.is_relative_to(root):
        raise DsfixError(f"imports its save functions from {Path(os.path.relpath(res.utils, root)).as_posix()}, "
                         "outside the checkout; run dsfix on a folder that holds both", path=_rel(root, script))
    return res


def _shadowed(root: Path, utils_path: Path) -> list:
    out = []
    for rel in LAYOUTS.values():
        other = root / rel
        if other.is_file() and other.resolve() != utils_path.resolve() and defines_save(other):
            out.append(f"step 1 imports {_rel(root, utils_path)}, which shadows {rel}: the copy step 1 really "
                       f"imports is the one patched, and {rel} is left alone")
    return out


def _left_alone(root: Path, main_path: Path, scripts) -> list:
    others = [p for p in callers(main_path.parent, depth=1) if p != main_path and p not in scripts]
    return [f"{_rel(root, p)} also calls the save functions and is not patched (add {_opt('--script', _rel(root, p))})"
            for p in others]


def check_inside(root: Path, path: Path) -> None:
    """Refuse a target that is a symlink leading outside the checkout, or that is not a regular file."""
    real = path.resolve()
    if path.is_symlink() and not real.is_relative_to(root.resolve()):
        raise DsfixError(f"refusing to follow a symlink that leads outside the checkout (to {real}); replace it "
                         "with the file or run dsfix on a folder that holds both", path=_rel(root, path))
    if not real.is_file():
        raise DsfixError("is not a regular file", path=_rel(root, path))
