"""``dsfix demo``: check, apply, smoke and revert on the bundled example checkout, in a temporary folder."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from patcher.errors import DsfixError, refuse_file
from patcher.patch import flow
from patcher.report import Result, Verdict

DEMO_CHECKOUT = "checkouts/package"
STEPS = ("check", "apply", "smoke", "revert")
NEXT_STEPS = """\
next, on your own checkout (in the environment you train with; CHECKOUT is its DeepSpeed-Chat folder):
  dsfix check CHECKOUT          the diff dsfix would make; nothing written
  dsfix apply CHECKOUT          patch it (all files or none)
  dsfix smoke CHECKOUT          run its save on a random Qwen3 and verify the folder
  dsfix verify OUTPUT_DIR       after training: check the saved model folder
  dsfix revert CHECKOUT         undo, byte for byte"""


@dataclass(frozen=True)
class DemoRow:
    step: str
    ok: bool
    detail: str
    seconds: float


@dataclass(frozen=True)
class DemoResult(Result):
    rows: tuple  # of DemoRow, in the order run
    checkout: str | None = None  # the kept demo checkout (--keep), else None
    verb = "demo"
    warnings = ()

    @property
    def status(self) -> Verdict:
        return Verdict.of([r.step for r in self.rows] == list(STEPS) and all(r.ok for r in self.rows))

    @property
    def message(self) -> str:
        if self.status is Verdict.PASSED:
            return "demo passed"
        failed = [r.step for r in self.rows if not r.ok] or [s for s in STEPS if s not in {r.step for r in self.rows}]
        return f"demo failed: {', '.join(failed)}"

    def body(self) -> dict:
        return {"checkout": self.checkout,
                "steps": [{"step": r.step, "ok": r.ok, "detail": r.detail, "seconds": round(r.seconds, 3)}
                          for r in self.rows]}

    def render(self, out, opts: dict) -> None:
        print_demo(self, out.console)


def print_demo(result: DemoResult, console) -> None:
    """The steps' table, the verdict and what to run next, on ``console`` (stderr)."""
    from rich.table import Table

    table = Table(title="dsfix demo", title_justify="left")
    for col in ("step", "result", "detail", "seconds"):
        table.add_column(col)
    for r in result.rows:
        table.add_row(r.step, "[green]ok[/]" if r.ok else "[red]FAIL[/]", r.detail, f"{r.seconds:.1f}")
    console.print(table)
    if result.checkout:
        console.print(f"the demo checkout is in {result.checkout}", markup=False)
    passed = result.status is Verdict.PASSED
    console.print("[bold green]demo passed[/]" if passed else f"[bold red]{result.message}[/]")
    if passed:
        console.print(NEXT_STEPS, markup=False, highlight=False)


def demo_checkout_source() -> Path:
    from patcher.resources import resource_path

    return resource_path("fixtures", f"{DEMO_CHECKOUT}/README.md").parent


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def show_changes(console, co: Path, out) -> None:
    """Every changed file's diff in full (on stdout), but for the new save module: its size and what it is."""
    from patcher.patch.diff import unified_diff
    from patcher.patch.names import SAVE_MODULE_FILE
    from patcher.patch.plan import Status

    for f in out.files:
        if f.status != Status.WOULD_CHANGE:
            continue
        path = co / f.rel
        old = path.read_bytes() if path.exists() else None
        if old is None and f.rel.endswith("/" + SAVE_MODULE_FILE):
            console.print(f"{f.rel}: a new file of {f.added} lines, dsfix's writer, which the two functions added "
                          "to utils.py call; its docstring says what it writes and how", markup=False)
            continue
        sys.stdout.flush()
        sys.stdout.buffer.write(unified_diff(old, out.new_bytes[f.rel], f.rel))
        sys.stdout.buffer.flush()


def run_demo(console, device: str = "auto", keep: Path | None = None, show_diff: bool = True) -> DemoResult:
    """check, apply, smoke and revert on a copy of the bundled checkout; what it needs is checked first
    (the [smoke] extra, CUDA for device "cuda", a usable --keep folder), before torch is imported and before
    anything is copied or patched."""
    from patcher.prereq import require

    require("demo", cuda=device == "cuda")
    if keep is not None:
        refuse_file(keep)
        if (Path(keep) / "DeepSpeed-Chat").exists():
            raise DsfixError(f"{Path(keep) / 'DeepSpeed-Chat'} already exists; pick an empty --keep folder")
    from patcher.checkpoint.quiet import import_torch_quietly
    from patcher.checkpoint.smoke import resolve_device

    import_torch_quietly()
    device = resolve_device(device)  # a second or two, but before check and apply
    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dsfix-demo-"))
    co = base / "DeepSpeed-Chat"
    rows: list = []
    try:
        shutil.copytree(demo_checkout_source(), co)
        _run_steps(console, co, device, show_diff, rows)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return DemoResult(tuple(rows), str(co) if keep else None)


def _run_steps(console, co: Path, device: str, show_diff: bool, rows: list) -> None:
    """The four steps on the demo checkout ``co``, each a DemoRow in ``rows``."""
    from patcher.checkpoint.smoke import print_report, run_smoke

    def step(name, ok, detail, t0):
        rows.append(DemoRow(name, ok, detail, time.perf_counter() - t0))

    original = _snapshot(co)
    console.rule("[bold]1/4 dsfix check[/]: what dsfix would change")
    t0 = time.perf_counter()
    out = flow.check(co)
    if show_diff:
        show_changes(console, co, out)
    step("check", out.exit_code == 1, out.message, t0)

    console.rule("[bold]2/4 dsfix apply[/]")
    t0 = time.perf_counter()
    out = flow.apply(co)
    for f in out.files:
        console.print(f"  {f.status.value}: {f.rel}", markup=False)
    again = flow.check(co)
    step("apply", again.exit_code == 0, f"{out.message}; check afterwards: {again.message}", t0)

    console.rule("[bold]3/4 dsfix smoke[/]: the inserted save on a random Qwen3-0.6B")
    t0 = time.perf_counter()
    report = run_smoke(co, device=device, dtype="bf16", zero_stage=0, nproc=1, console=console, train_steps=0)
    print_report(report, console)
    step("smoke", report.ok, f"{report.tensors} tensors on {report.device}", t0)

    console.rule("[bold]4/4 dsfix revert[/]")
    t0 = time.perf_counter()
    out = flow.revert(co)
    exact = _snapshot(co) == original
    step("revert", exact, out.message + ("; every byte as before" if exact else "; FILES DIFFER"), t0)
