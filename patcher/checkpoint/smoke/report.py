"""What ``dsfix smoke`` reports, and how it is shown: the checks, then timings and memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from patcher.checkpoint.check.headers import render
from patcher.report import Checks, Result, Verdict


@dataclass(frozen=True)
class SmokeReport(Result, Checks):
    ok: bool
    checks: tuple  # of Check(name, ok, detail)
    timings: dict  # phase -> seconds (rank 0's phases, plus launch/verify/reload here)
    device: str
    dtype: str
    zero_stage: int
    nproc: int
    load_method: Optional[str]  # "import" or "ast" (None when the ranks never got that far)
    load_detail: Optional[str]
    load_note: Optional[str] = None  # why the import failed, when that is worth a warning (not a missing DeepSpeed)
    functions: tuple = ()  # the save functions found in the checkout
    backend: Optional[str] = None  # gloo / nccl when a DeepSpeed engine ran
    launcher: Optional[str] = None  # the command that started the ranks, if any
    peak_rss_mb: dict = field(default_factory=dict)  # {"this process": MB, "rank 0": MB, ...}
    cuda_peak_mb: Optional[dict] = None  # {"rank 0": MB, ...} when on CUDA
    tensors: Optional[int] = None
    save_output: str = ""  # what the save functions printed on rank 0
    output_dir: Optional[str] = None  # the kept folder, or None when it was a temp dir
    log_tail: str = ""  # the ranks' last log lines when something failed
    verb = "smoke"

    @property
    def status(self) -> Verdict:
        return Verdict.of(self.ok)

    @property
    def message(self) -> str:
        if self.ok:
            return f"smoke passed: {self.tensors} tensors saved and verified"
        return f"smoke failed: {', '.join(c.name for c in self.failed)}"

    @property
    def warnings(self) -> list:
        return [self.load_note] if self.load_note else []

    def body(self) -> dict:
        return {
            "ok": self.ok,
            "checks": [c._asdict() for c in self.checks],
            "timings": self.timings,
            "device": self.device,
            "dtype": self.dtype,
            "zero_stage": self.zero_stage,
            "nproc": self.nproc,
            "backend": self.backend,
            "load_method": self.load_method,
            "load_detail": self.load_detail,
            "load_note": self.load_note,
            "functions": list(self.functions),
            "launcher": self.launcher,
            "peak_rss_mb": self.peak_rss_mb,
            "cuda_peak_mb": self.cuda_peak_mb,
            "tensors": self.tensors,
            "save_output": self.save_output,
            "output_dir": self.output_dir,
            "log_tail": self.log_tail,
        }

    def render(self, out: Any, opts: dict) -> None:
        print_report(self, out.console)


def print_report(report: SmokeReport, console) -> None:
    """The human report on ``console`` (stderr): the checks, then timings and memory."""
    from rich.markup import escape

    console.print(render(report.checks, title=f"dsfix smoke: ZeRO-{report.zero_stage}, {report.nproc} rank(s), "
                                                     f"{report.device}, {report.dtype}"))
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    t = ", ".join(f"{k} {v:.1f}s" for k, v in report.timings.items())
    mem = ", ".join(f"{k} {v} MB" for k, v in report.peak_rss_mb.items() if v is not None)
    console.print(f"timings: {escape(t)}")
    cuda = f"; CUDA peak: {report.cuda_peak_mb}" if report.cuda_peak_mb else ""
    console.print(f"peak host RSS: {escape(mem)}{cuda}")
    if report.output_dir:
        console.print(f"kept the saved folder in {escape(report.output_dir)}")
    if not report.ok and report.log_tail:
        console.print("[bold]last lines of the log:[/]")
        console.print(escape(report.log_tail), highlight=False)
    console.print("[bold green]smoke passed[/]" if report.ok else
                  f"[bold red]smoke failed[/]: {escape(', '.join(c.name for c in report.failed))}")
