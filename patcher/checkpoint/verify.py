"""``dsfix verify PATH``: every model folder under PATH checked against its config, or ``--against`` a reference.

A step-3 output folder is checked folder by folder (``actor``, ``critic``, ``actor_ema``); each folder by
:func:`patcher.checkpoint.check.verify.verify_folder`, or compared by
:func:`patcher.checkpoint.check.compare.compare_folders`. Bad input (no such folder, a file, no weights) is
refused before torch is imported; third-party output is off while the checks run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from patcher.checkpoint.check.compare import compare_folders, is_bin_reference
from patcher.checkpoint.check.headers import render
from patcher.checkpoint.check.values import FiniteChecks
from patcher.checkpoint.check.verify import leftover_check, verify_folder
from patcher.checkpoint.readers.find import model_folders
from patcher.checkpoint.readers.peft import read_adapter_config
from patcher.checkpoint.readers.safetensors import weight_files
from patcher.errors import DsfixError, need_folder
from patcher.report import Result, Verdict


@dataclass(frozen=True)
class VerifyResult(Result):
    """``dsfix verify``'s result: one report per model folder. With one folder, that folder's keys are also
    at the top level of the JSON (``ok``, ``tensors``, ``checks``, ...)."""

    path: str
    reports: tuple  # of VerifyReport
    verb = "verify"
    warnings = ()

    @property
    def status(self) -> Verdict:
        return Verdict.of(all(r.ok for r in self.reports))

    @property
    def message(self) -> str:
        if len(self.reports) == 1:
            return self.reports[0].summary
        bad = [Path(r.path).name for r in self.reports if not r.ok]
        return (f"verification FAILED in {', '.join(bad)}" if bad else
                f"all checks hold in {len(self.reports)} folders")

    def body(self) -> dict:
        head = self.reports[0].to_dict() if len(self.reports) == 1 else {}
        return {**head, "path": self.path, "ok": self.status is Verdict.PASSED,
                "folders": [r.to_dict() for r in self.reports]}

    def render(self, out: Any, opts: dict) -> None:
        for report in self.reports:
            out.print(render(report.checks, title=f"dsfix verify {report.path}"))
            out.print(report.summary, markup=False)


def verify_path(path, expect: Optional[int] = None, load: bool = True, against=None, atol: float = 0.0,
                rtol: float = 0.0, base=None, console: Any = None) -> VerifyResult:
    """``dsfix verify PATH``: every model folder under ``path`` (see ``model_folders``), or with ``against`` each
    compared with the reference folder of the same name instead; a PEFT adapter folder against its
    adapter_config.json and its base model's config (``base``: the base's folder, when adapter_config.json's is
    not here). ``console``: where the reading's progress goes (None: nowhere)."""
    from patcher.checkpoint.quiet import quiet

    need_folder(path)
    if read_adapter_config(Path(path)) is not None and against is None:
        if expect is not None:
            raise DsfixError("--expect checks a model folder; a PEFT adapter is checked against its "
                             "adapter_config.json")
        with quiet():
            from patcher.checkpoint.check.adapter import verify_adapter

            return VerifyResult(str(path), (verify_adapter(Path(path), base, load=load),))
    if base is not None:
        raise DsfixError("--base is for a PEFT adapter folder (adapter_config.json); this folder has none",
                         path=str(path))
    folders = model_folders(path)
    for folder in folders:
        need_folder(folder)
        try:
            weight_files(folder)
        except DsfixError as e:  # a save killed between moving a file aside and its successor in
            killed = leftover_check(folder)
            if killed is None or killed.ok:
                raise
            raise DsfixError(f"{e.message}; {killed.detail}", path=e.path) from None
    if against is not None:
        check_reference(against)
        with quiet():
            return compare_path(path, against, expect=expect, atol=atol, rtol=rtol, console=console)
    # the NaN and Inf checks read every weight: started first, on a thread, they read while transformers is
    # imported and each folder's config and meta model are built
    with FiniteChecks(folders, console) as started, quiet():
        return VerifyResult(str(path), tuple(verify_folder(p, expect=expect, load=load, finite=True, started=started)
                                             for p in folders))


def check_reference(against) -> None:
    """Bad input on the reference side, answered before torch: a missing folder, a file, no weights."""
    for folder in model_folders(against):
        need_folder(folder)
        if not is_bin_reference(folder):  # a pytorch_model.bin reference (zero_to_fp32's) is read as it is
            weight_files(folder)


def compare_path(path, against, expect: Optional[int] = None, atol: float = 0.0, rtol: float = 0.0,
                 console: Any = None) -> VerifyResult:
    """``dsfix verify PATH --against REF``: each model folder under ``path`` compared with the same one under
    ``against``; a step-3 folder's actor/critic/actor_ema pair by name."""
    if expect is not None:
        raise DsfixError("--expect checks a folder against its config; with --against the reference sets the keys")
    folders, refs = model_folders(path), model_folders(against)
    if len(folders) > 1 or len(refs) > 1:
        names, ref_names = [p.name for p in folders], [p.name for p in refs]
        if names != ref_names:
            raise DsfixError(f"holds {', '.join(names)} but --against holds {', '.join(ref_names)}: "
                             "compare model folders one by one", path=str(path))
    return VerifyResult(str(path), tuple(compare_folders(p, r, atol=atol, rtol=rtol, console=console)
                                         for p, r in zip(folders, refs)))


