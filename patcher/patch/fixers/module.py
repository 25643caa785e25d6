"""The fixer of the save module: ``dsfix_safetensors.py`` beside utils.py, a byte-for-byte copy of dsfix's
``templates/dsfix_safetensors.py``. It is new at apply (the diff shows a new file) and removed at revert; an
older dsfix's copy is upgraded; a file of that name that is not dsfix's, or dsfix's edited, is refused.
"""

from __future__ import annotations

from patcher.errors import DsfixError
from patcher.patch.fixers.base import Context, Fixer, Patched, Target
from patcher.patch.names import SAVE_MODULE_FILE
from patcher.patch.template import module_bytes, module_version, version_of


class ModuleFixer(Fixer):
    """dsfix_safetensors.py beside utils.py: written whole, removed whole."""

    kind = "module"
    optional = True
    rank = 0  # before utils.py, which imports it

    def patch(self, target: Target, ctx: Context) -> Patched:
        ours, version = module_bytes(), module_version()
        if target.data is None:
            return Patched(ours, [f"adds dsfix's save module (v{version}), which the wrappers in utils.py call: a new "
                                  "file (git lists it as untracked); its docstring says what it writes"])
        if target.data == ours:
            return Patched(ours)
        found = version_of(target.data)
        if found is None:
            raise DsfixError(f"is not dsfix's save module, and dsfix writes its own as {SAVE_MODULE_FILE} here; "
                             "rename that file and run dsfix again")
        if found > version:
            raise DsfixError(f"was written by a newer dsfix (save module v{found}, this dsfix writes v{version}); "
                             "use that dsfix")
        if found == version:
            raise DsfixError(f"differs from dsfix's save module v{version} (edited since apply?); move your version "
                             "away, or run `dsfix revert`, then apply again")
        return Patched(ours, [f"updates dsfix's save module v{found} -> v{version}"])

    def unpatch(self, data: bytes, target: Target, force: bool = False) -> tuple:
        return None, []

    def is_patched(self, data: bytes, target: Target) -> bool:
        return version_of(data) is not None

    def own_part(self, data: bytes | None) -> str:
        return "" if data is None else data.decode("utf-8", errors="replace")

    def edited(self, data: bytes, target: Target, ctx: Context) -> bool:
        return version_of(data) == module_version() and data != module_bytes()
