"""One fixer per kind of file dsfix changes (``FIXERS``: kind -> fixer), each a class with the same
methods (patcher.patch.fixers.base.Fixer): the save module beside utils.py, utils.py, step 3's loader, and
the step scripts. To add a kind of file, write a fixer and list it here; plan.py's loop does not change."""

from patcher.patch.fixers.base import Context, Fixer, Patched, Target
from patcher.patch.fixers.loader import LoaderFixer
from patcher.patch.fixers.module import ModuleFixer
from patcher.patch.fixers.script import ScriptFixer
from patcher.patch.fixers.utils import UtilsFixer

FIXERS = {f.kind: f for f in (ModuleFixer(), UtilsFixer(), LoaderFixer(), ScriptFixer())}

__all__ = ["FIXERS", "Context", "Fixer", "Patched", "Target"]
