"""The checkout's save functions, as ``dsfix smoke`` calls them: imported the normal way, or, where that import
fails (a checkout that needs DeepSpeed, a relative import), its top-level imports and dsfix's own definitions
extracted from ``utils.py`` with ``ast`` and run alone, the save module loaded from its file beside it."""

from __future__ import annotations

import ast
import builtins
import sys
from pathlib import Path
from typing import Optional

from patcher.patch.names import SAVE_HF, SAVE_Z3, is_dsfix_name


def _import_isolated(import_root: str, module_name: str):
    """Import ``module_name`` with ``import_root`` first on sys.path, leaving sys.path and sys.modules as found."""
    import importlib

    top = module_name.split(".")[0]
    mine = lambda k: k == top or k.startswith(top + ".")  # noqa: E731
    saved_mods = {k: v for k, v in sys.modules.items() if mine(k)}
    for k in saved_mods:
        del sys.modules[k]
    saved_path, saved_bytecode = list(sys.path), sys.dont_write_bytecode
    sys.path.insert(0, import_root)
    sys.dont_write_bytecode = True  # leave no __pycache__ in the user's checkout
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path[:] = saved_path
        sys.dont_write_bytecode = saved_bytecode
        for k in [k for k in sys.modules if mine(k)]:
            del sys.modules[k]
        sys.modules.update(saved_mods)


SAVE_MODULE = "dsfix_safetensors"  # the save module apply copies beside utils.py; utils.py imports it
NOTE_LIMIT = 159  # a note the user reads stays under 160 characters


def extract_definitions(utils_path) -> tuple[dict, list]:
    """Exec only the top-level imports and the dsfix definitions of ``utils_path``; (namespace, skipped imports).

    Imports that fail (deepspeed missing, a relative import) are skipped and listed; the inserted code needs
    only os, json, torch and safetensors at module level. dsfix's save module beside utils.py (imported as
    ``from . import dsfix_safetensors`` or ``import dsfix_safetensors``, which fail here) is loaded from its
    file, so the thin wrappers in utils.py find it.
    """
    import __future__

    path = str(utils_path)
    tree = ast.parse(Path(path).read_bytes(), filename=path)
    flags = 0
    imports: list = []
    defs: list = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, ast.Try) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body):
            imports.append(node)
        elif _is_dsfix_definition(node):
            defs.append(node)
    ns: dict = {"__name__": "dsfix_smoke_extracted", "__file__": path, "__builtins__": builtins}

    def run(node):
        exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec", flags=flags, dont_inherit=True), ns)

    skipped = []
    for node in imports:
        try:
            run(node)
        except Exception as e:
            if not _binds_save_module(node):
                skipped.append(f"line {node.lineno}: {type(e).__name__}: {e}")
    for name in _save_module_names(imports):
        if name not in ns:
            ns[name] = _load_save_module(Path(path).parent / f"{SAVE_MODULE}.py")
    for node in defs:
        run(node)
    return ns, skipped


def _is_dsfix_definition(node) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return is_dsfix_name(node.name)
    if isinstance(node, ast.Assign):
        return all(isinstance(t, ast.Name) and is_dsfix_name(t.id) for t in node.targets)
    return isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_dsfix_name(node.target.id)


def _save_module_names(imports: list) -> set:
    """The names the save module is bound to by these import statements (a try's branches included)."""
    names: set = set()
    for node in imports:
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                names.update(a.asname or a.name for a in sub.names if a.name == SAVE_MODULE)
    return names


def _binds_save_module(node) -> bool:
    return bool(_save_module_names([node]))


def _load_save_module(path: Path):
    """The save module, from its file beside utils.py, under a name of its own (registered while it runs)."""
    import importlib.util

    if not path.is_file():
        raise ImportError(f"utils.py imports {SAVE_MODULE}, but there is no {path.name} beside it")
    name = f"dsfix_smoke_extracted_{SAVE_MODULE}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get(name)
    sys.modules[name] = module  # dataclasses and typing look a module up by name while it runs
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
    return module


def _missing_deepspeed(exc: BaseException) -> bool:
    """An import that failed only because DeepSpeed is not installed: expected wherever smoke runs without an
    engine (README's first command installs no DeepSpeed), so not worth a warning."""
    return isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "deepspeed"


def _note(why: str) -> str:
    """The one warning smoke shows when it reads the save functions with ast for a reason the user may fix."""
    text = f"utils.py read with ast: {why}"
    return text if len(text) <= NOTE_LIMIT else text[:NOTE_LIMIT - 3] + "..."


def load_save_functions(utils_path, import_root, module_name) -> tuple[dict, str, str, str | None]:
    """({name: function}, "import" or "ast", a sentence on how, a note worth a warning or None). Import the
    normal way, else extract with ast."""
    utils_path = Path(utils_path).resolve()
    note: Optional[str]
    try:
        mod = _import_isolated(str(import_root), module_name)
        where = Path(getattr(mod, "__file__", "") or "").resolve()
        if where != utils_path:
            raise ImportError(f"{module_name} resolved to {where}, not the checkout's file")
        funcs = {n: getattr(mod, n) for n in (SAVE_HF, SAVE_Z3) if callable(getattr(mod, n, None))}
        if SAVE_HF in funcs:
            return funcs, "import", f"import {module_name}", None
        why = f"import {module_name} worked but it has no {SAVE_HF}"
        note = _note(why)
    except Exception as e:  # ImportError, ModuleNotFoundError, anything the module's top level raises
        why = f"import {module_name} failed ({type(e).__name__}: {e})"
        note = None if _missing_deepspeed(e) else _note(f"import failed ({type(e).__name__}: {e})")
    ns, skipped = extract_definitions(utils_path)
    funcs = {n: ns[n] for n in (SAVE_HF, SAVE_Z3) if callable(ns.get(n))}
    detail = f"{why}; exec'd its top-level imports and dsfix definitions extracted with ast"
    if skipped:
        detail += f" (skipped imports: {'; '.join(skipped)})"
    return funcs, "ast", detail, note
