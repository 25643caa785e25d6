"""``dsfix demo``: check, apply, smoke and revert on the bundled example checkout, in a temporary folder."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from patcher.patch import flow
from patcher.errors import DsfixError

DEMO_CHECKOUT = "checkouts/package"


def demo_checkout_source() -> Path:
    from patcher.resources import resource_path

    return resource_path("fixtures", f"{DEMO_CHECKOUT}/README.md").parent


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def show_changes(console, co: Path, out) -> None:
    """The scripts' diffs in full (on stdout); for utils.py, a summary of dsfix's insertion."""
    from patcher.patch.diff import insertions, unified_diff
    from patcher.patch.plan import Status

    for f in out.files:
        if f.status != Status.WOULD_CHANGE:
            continue
        old = (co / f.rel).read_bytes()
        new = out.new_bytes[f.rel]
        if "utils" not in f.rel.rsplit("/", 1)[-1]:
            sys.stdout.flush()
            sys.stdout.buffer.write(unified_diff(old, new, f.rel))
            sys.stdout.buffer.flush()
            continue
        console.print(f"[bold]{f.rel}[/]: +{f.added} lines, nothing removed" if not f.removed else
                      f"[bold]{f.rel}[/]: +{f.added} -{f.removed} lines")
        for at, lines in insertions(old, new):
            text = b"".join(lines).decode("utf-8", "replace")
            defs = [ln.split("(")[0][4:] for ln in text.splitlines() if ln.startswith("def ")]
            if defs:
                public = [d for d in defs if not d.startswith("_")]
                console.print(f"  at line {at}: dsfix's block, {len(lines)} lines: {', '.join(public)} and "
                              f"{len(defs) - len(public)} helpers (_dsfix_*), behind a `# dsfix:` marker line",
                              markup=False)
            else:
                console.print(f"  at line {at}: {' / '.join(ln.strip() for ln in text.splitlines())}", markup=False)
        console.print("  the whole diff: `dsfix check` on a checkout (keep this one with `dsfix demo --keep DIR`)",
                      markup=False)


def run_demo(console, device: str = "auto", keep: Path | None = None) -> int:
    from patcher.checkpoint.smoke import run_smoke

    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="dsfix-demo-"))
    co = base / "DeepSpeed-Chat"
    if co.exists():
        raise DsfixError(f"{co} already exists; pick an empty --keep folder")
    shutil.copytree(demo_checkout_source(), co)
    original = _snapshot(co)
    rows = []

    def step(name, ok, detail, t0):
        rows.append((name, ok, detail, time.perf_counter() - t0))
        return ok

    try:
        console.rule("[bold]1/4 dsfix check[/]: what dsfix would change")
        t0 = time.perf_counter()
        out = flow.check(co)
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
        report = run_smoke(co, device=device, dtype="bf16", zero_stage=0, nproc=1, expect=311, console=console,
                           train_steps=0)
        step("smoke", report.ok, f"{report.tensors} tensors on {report.device}", t0)

        console.rule("[bold]4/4 dsfix revert[/]")
        t0 = time.perf_counter()
        out = flow.revert(co)
        exact = _snapshot(co) == original
        step("revert", exact, out.message + ("; every byte as before" if exact else "; FILES DIFFER"), t0)
    finally:
        table = Table(title="dsfix demo", title_justify="left")
        for col in ("step", "result", "detail", "seconds"):
            table.add_column(col)
        for name, ok, detail, secs in rows:
            table.add_row(name, "[green]ok[/]" if ok else "[red]FAIL[/]", detail, f"{secs:.1f}")
        console.print(table)
        if keep:
            console.print(f"the demo checkout is in {co}", markup=False)
        else:
            shutil.rmtree(base, ignore_errors=True)
    ok = len(rows) == 4 and all(r[1] for r in rows)
    console.print("[bold green]demo passed[/]" if ok else "[bold red]demo failed[/]")
    return 0 if ok else 1
