"""``dsfix smoke``: run a checkout's own save functions the way step-1 main.py calls them, then verify.

A plain one-rank save (ZeRO 0, nproc 1) runs in this process. DeepSpeed engines (ZeRO 1-3) and
several ranks run in ranks started by ``python -m torch.distributed.run --standalone`` (module
``patcher.checkpoint.smoke_worker``): on a CPU with DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) and
gloo, on CUDA with nccl. The folder the save wrote is checked by :func:`patcher.checkpoint.verify.verify_folder`,
reloaded with ``from_pretrained``, and must reproduce the in-memory model's logits.
torch, transformers and deepspeed are imported only inside functions.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from patcher.checkpoint.quiet import quiet
from patcher.checkpoint.ranks import free_port, rank_env
from patcher.errors import DsfixError
from patcher.prereq import require
from patcher.report import Result, Verdict
from patcher.resources import resource_path
from patcher.checkpoint.verify import Check, Checks, checks_table, load_check, verify_folder
from patcher.patch.names import SAVE_HF, SAVE_Z3

DTYPES = ("bf16", "fp16", "fp32")
DEFAULT_CONFIG = "models/qwen3-0.6b/config.json"
_RANK_CHECKS = ("functions", "setup", "save")  # checks about the ranks themselves; their log tail helps
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds patcher/, for the ranks


@dataclass(frozen=True)
class SmokeReport(Checks, Result):
    ok: bool
    checks: tuple  # of Check(name, ok, detail)
    timings: dict  # phase -> seconds (rank 0's phases, plus launch/verify/reload here)
    device: str
    dtype: str
    zero_stage: int
    nproc: int
    load_method: Optional[str]  # "import" or "ast" (None when the ranks never got that far)
    load_detail: Optional[str]
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
    def exit_code(self) -> int:
        return self.status.exit_code

    @property
    def message(self) -> str:
        if self.ok:
            return f"smoke passed: {self.tensors} tensors saved and verified"
        return f"smoke failed: {', '.join(c.name for c in self.failed)}"

    @property
    def warnings(self) -> list:
        if self.load_method == "ast":
            return [f"the save functions were read from utils.py with ast: {self.load_detail}"]
        return []

    def body(self) -> dict:
        return {
            "ok": self.ok,
            "status": self.status.value,
            "checks": [c._asdict() for c in self.checks],
            "timings": self.timings,
            "device": self.device,
            "dtype": self.dtype,
            "zero_stage": self.zero_stage,
            "nproc": self.nproc,
            "backend": self.backend,
            "load_method": self.load_method,
            "load_detail": self.load_detail,
            "functions": list(self.functions),
            "launcher": self.launcher,
            "peak_rss_mb": self.peak_rss_mb,
            "cuda_peak_mb": self.cuda_peak_mb,
            "tensors": self.tensors,
            "save_output": self.save_output,
            "output_dir": self.output_dir,
            "log_tail": self.log_tail,
        }



# --------------------------------------------------------------------------- inputs


def _utils_defines(utils_path: Path) -> set:
    try:
        tree = ast.parse(utils_path.read_bytes(), filename=str(utils_path))
    except (OSError, SyntaxError, ValueError) as e:
        raise DsfixError(f"cannot parse: {e}", path=str(utils_path)) from None
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _import_root(checkout) -> tuple[Path, str]:
    if checkout.layout == "legacy":
        return checkout.root / "training", checkout.utils_module
    return checkout.root, checkout.utils_module


def resolve_device(device: str) -> str:
    """auto, cpu or cuda to the device to use; cuda must be there when asked for."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise DsfixError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DsfixError("--device cuda, but torch sees no CUDA device")
    return device


def _prepare_out(keep) -> tuple[Path, Optional[Path]]:
    """(folder the save writes to, temp dir to remove afterwards or None)."""
    if keep is None:
        tmp = Path(tempfile.mkdtemp(prefix="dsfix-smoke-out-"))
        return tmp / "output", tmp
    out = Path(keep)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DsfixError("--keep folder must be new or empty", path=str(out))
    out.mkdir(parents=True, exist_ok=True)
    return out.resolve(), None


# --------------------------------------------------------------------------- running the ranks


def _worker_env(device: str, nproc: int) -> dict:
    env = rank_env(nproc=nproc) if device == "cpu" else dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def launcher_command(nproc: int, spec_path, port: int | str = "PORT") -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node_rank", "0",
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--nproc_per_node", str(nproc), "-m", "patcher.checkpoint.smoke_worker", str(spec_path)]


def _launch(spec: dict, nproc: int, timeout: float, on_phase) -> tuple[list, str, int]:
    """Run the ranks; (their results, the log tail, exit code)."""
    work = Path(spec["work_dir"])
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2), encoding="utf-8")
    log_path = work / "ranks.log"
    port = free_port()
    cmd = launcher_command(nproc, spec_path, port)
    phase_file = work / "phase-0.txt"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=_worker_env(spec["device"], nproc), cwd=str(work), start_new_session=True)
        deadline = time.monotonic() + timeout
        seen = None
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                try:
                    now = phase_file.read_text()
                except OSError:
                    now = None
                if now and now != seen:
                    seen = now
                    on_phase(now)
                time.sleep(0.2)
        except BaseException:
            with _quiet():
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with _quiet():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    results = []
    for r in range(nproc):
        p = work / f"result-{r}.json"
        if p.is_file():
            results.append(json.loads(p.read_text(encoding="utf-8")))
    tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-30:])
    return results, tail, proc.returncode


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


class _capture_stdout:
    """fd 1 -> a file while the in-process rank runs: what libraries print there (DeepSpeed's logger, which
    binds sys.stdout on import, telling that it set the accelerator to CPU) reaches neither stdout, the
    CLI's machine channel, nor the user's screen; its last lines are shown only when the smoke fails."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        sys.stdout.flush()
        self._file = open(self.path, "w+", encoding="utf-8", errors="replace")
        try:
            self._saved = os.dup(1)
            os.dup2(self._file.fileno(), 1)
        except OSError:
            self._saved = None
        # Loggers created meanwhile bind to the file too.
        self._redirect = contextlib.redirect_stdout(self._file)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)
        sys.stdout.flush()
        self._file.flush()
        if self._saved is not None:
            os.dup2(self._saved, 1)
            os.close(self._saved)
        self._file.close()
        return False

    def tail(self, n: int = 30) -> str:
        return _tail(self.path, n)


# --------------------------------------------------------------------------- the smoke test


def run_smoke(checkout, *, device: str = "auto", dtype: str = "bf16", zero_stage: int = 0, nproc: int = 1,
              expect: Optional[int] = 311, keep=None, model_dir=None, config_path=None, console=None,
              train_steps: int = 1, seed: int = 1234, timeout: float = 1800) -> SmokeReport:
    """Save a model with the checkout's patched functions as step 1 would, and check what was written.

    ``checkout``: a :class:`patcher.patch.locate.Checkout` or a path. Raises DsfixError (code 2) on bad input,
    including a checkout whose utils.py has no ``save_hf_format_safetensors``; failing checks give ok=False.
    """
    from patcher.patch.locate import Checkout, find_checkout

    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    if not isinstance(checkout, Checkout):
        checkout = find_checkout(checkout)
    if dtype not in DTYPES:
        raise DsfixError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise DsfixError(f"--zero-stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    if nproc < 1:
        raise DsfixError(f"--nproc must be at least 1, not {nproc!r}")
    if model_dir is not None and config_path is not None:
        raise DsfixError("give --model or --config, not both")
    need_ds = f"--zero-stage {zero_stage}" if zero_stage > 0 else (f"--nproc {nproc}" if nproc > 1 else None)
    require("smoke", deepspeed=need_ds, cuda=device == "cuda")  # before anything expensive: find_spec only
    if model_dir is not None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise DsfixError("not a model folder (no config.json)", path=str(model_dir))
    else:
        config_path = Path(config_path) if config_path is not None else resource_path("fixtures", DEFAULT_CONFIG)
        if not config_path.is_file():
            raise DsfixError("no such config file", path=str(config_path))
    defined = _utils_defines(checkout.utils_path)
    if SAVE_HF not in defined:
        raise DsfixError(f"{checkout.rel(checkout.utils_path)} defines no {SAVE_HF}: this checkout was never "
                         "patched: run `dsfix apply` first", path=str(checkout.root))
    device = resolve_device(device)
    use_engine = zero_stage > 0 or nproc > 1
    out_dir, out_tmp = _prepare_out(keep)
    work = Path(tempfile.mkdtemp(prefix="dsfix-smoke-"))
    import_root, module_name = _import_root(checkout)
    spec = {
        "utils_path": str(checkout.utils_path), "import_root": str(import_root), "module_name": module_name,
        "out_dir": str(out_dir), "work_dir": str(work), "device": device, "dtype": dtype,
        "zero_stage": zero_stage, "engine": use_engine, "seed": seed, "train_steps": train_steps,
        # absolute: the ranks run in the work folder
        "config_path": str(config_path.resolve()) if config_path is not None else None,
        "model_dir": str(model_dir.resolve()) if model_dir is not None else None,
        "dist_timeout": int(min(timeout, 1800)),
    }
    try:
        with _capture_stdout(work / "stdout.log") as captured, quiet():  # nothing of theirs on stdout
            report = _run(spec, nproc=nproc, expect=expect, console=console, timeout=timeout,
                          kept=out_dir if keep is not None else None)
        if not report.ok and not report.log_tail and not spec["engine"]:
            report = dataclasses.replace(report, log_tail=captured.tail())
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if out_tmp is not None:
            shutil.rmtree(out_tmp, ignore_errors=True)


def _run(spec: dict, *, nproc: int, expect, console, timeout: float, kept) -> SmokeReport:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    zero, device = int(spec["zero_stage"]), spec["device"]
    checks: list = []
    timings: dict = {}
    launcher = None
    log_tail = ""
    how = f"{nproc} rank(s), DeepSpeed ZeRO-{zero}" if spec["engine"] else "in this process, no DeepSpeed engine"
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"building and saving ({how})")

        def on_phase(name):
            progress.update(task, description=f"rank 0: {name} ({how})")

        t = time.perf_counter()
        if spec["engine"]:
            launcher = " ".join(["python"] + launcher_command(nproc, "SPEC.json")[1:])
            try:
                results, log_tail, rc = _launch(spec, nproc, timeout, on_phase)
            except subprocess.TimeoutExpired:
                results, rc = [], None
                log_tail = _tail(Path(spec["work_dir"]) / "ranks.log")
                checks.append(Check("save", False, f"the ranks did not finish within {timeout:.0f}s (killed)"))
        else:
            import patcher.checkpoint.smoke_worker as worker

            spec["distributed"] = False
            results, rc = [worker.run_rank(spec)], 0  # run_smoke has stdout on stderr already
        if spec["engine"]:  # in this process, rank 0's own phases below say where the time went
            timings["ranks"] = round(time.perf_counter() - t, 3)
        r0 = next((r for r in results if r.get("rank") == 0), None)
        if r0 is not None:
            timings.update({k: v for k, v in r0.get("timings", {}).items()})
        errors = [r for r in results if r.get("error")]
        if not checks:
            checks.extend(_rank_checks(results, r0, errors, rc, nproc, zero, Path(spec["work_dir"])))

        weights_written = any(c.name == "save" and c.ok for c in checks)
        vreport = None
        if weights_written or (r0 is not None and r0.get("phase") == "save"):
            progress.update(task, description="verifying the saved folder")
            t = time.perf_counter()
            try:
                if not Path(spec["out_dir"]).is_dir():
                    raise DsfixError("the save wrote nothing: no output folder, no model weights")
                vreport = verify_folder(spec["out_dir"], expect=expect, load=False, finite=True)
                checks.extend(vreport.checks)
            except DsfixError as e:
                checks.append(Check("weights", False, e.message))
            timings["verify"] = round(time.perf_counter() - t, 3)
        if vreport is not None and vreport.check("config") and vreport.check("config").ok:
            progress.update(task, description="reloading with from_pretrained and comparing logits")
            t = time.perf_counter()
            checks.extend(_reload_checks(spec, device))
            timings["reload"] = round(time.perf_counter() - t, 3)

    ok = bool(checks) and all(c.ok for c in checks)
    peak = {"this process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    cuda = None
    for r in results:
        if spec["engine"]:
            peak[f"rank {r['rank']}"] = r.get("peak_rss_mb")
        if r.get("cuda_peak_mb") is not None:
            cuda = cuda or {}
            cuda[f"rank {r['rank']}"] = r["cuda_peak_mb"]
    if cuda is None and device == "cuda":
        import torch

        cuda = {"this process": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
    report = SmokeReport(
        ok=ok, checks=tuple(checks), timings=timings,
        device=(r0 or {}).get("device", device), dtype=spec["dtype"], zero_stage=zero, nproc=nproc,
        load_method=(r0 or {}).get("load_method"), load_detail=(r0 or {}).get("load_detail"),
        functions=tuple((r0 or {}).get("functions", ())), backend=(r0 or {}).get("backend"),
        launcher=launcher, peak_rss_mb=peak, cuda_peak_mb=cuda,
        tensors=vreport.tensors if vreport is not None else None,
        save_output=(r0 or {}).get("save_output", ""), output_dir=str(kept) if kept is not None else None,
        log_tail=log_tail if any(c.name in _RANK_CHECKS and not c.ok for c in checks) else "",
    )
    return report


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _no_result_reason(rc, work_dir: Optional[Path]) -> str:
    """Why rank 0 left no result: its last phase, and whether it was killed (most often: out of host memory)."""
    phase, log = None, ""
    if work_dir is not None:
        with contextlib.suppress(OSError):
            phase = (work_dir / "phase-0.txt").read_text().strip() or None
        with contextlib.suppress(OSError):
            log = (work_dir / "ranks.log").read_text(errors="replace")
    where = f" during {phase}" if phase else ""
    if "exitcode : -9" in log or "SIGKILL" in log or rc in (-9, 137):
        return (f"rank 0 was killed{where} (SIGKILL: most often the machine ran out of host memory); "
                "try fewer ranks (--nproc), the narrow --config, or a GPU")
    return f"rank 0 left no result{where} (launcher exit {rc}); see the log lines below"


def _rank_checks(results: list, r0: Optional[dict], errors: list, rc, nproc: int, zero: int,
                 work_dir: Optional[Path] = None) -> list:
    checks = []
    if r0 is None:
        return [Check("save", False, _no_result_reason(rc, work_dir))]
    if r0.get("load_method"):
        fns = ", ".join(r0.get("functions", [])) or "none"
        how = ("by importing utils.py" if r0["load_method"] == "import" else
               "from utils.py's source with ast (it does not import here: see the warning below)")
        checks.append(Check("functions", True, f"{fns}, {how}"))
    if errors:
        first = min(errors, key=lambda r: r["rank"])
        where = first.get("phase")
        name = "functions" if where == "load" else ("save" if where == "save" else "setup")
        checks.append(Check(name, False, f"rank {first['rank']} failed in {where}: {first['error']}"))
        return checks
    if len(results) < nproc or rc not in (0, None):
        checks.append(Check("save", False, f"{len(results)} of {nproc} ranks reported; launcher exit {rc}"))
        return checks
    calls = f"{SAVE_HF} on rank 0"
    if r0.get("partitioned"):
        calls = f"{r0['partitioned'][0]} of {r0['partitioned'][1]} parameters partitioned; " + calls
    if zero == 3:
        if r0.get("called_z3"):
            calls += f", {SAVE_Z3} on {'all ' + str(nproc) + ' ranks' if nproc > 1 else 'rank 0'}"
        else:
            calls += f"; no {SAVE_Z3} to call under ZeRO-3"
    printed = [line for line in r0.get("save_output", "").splitlines() if line.strip()]
    if printed:
        calls += f"; it printed {printed[-1].strip()!r}"
    checks.append(Check("save", True, calls))
    return checks


def _reload_checks(spec: dict, device: str) -> list:
    import torch
    from safetensors.torch import load_file

    ref_path = Path(spec["work_dir"]) / "reference.safetensors"
    tdtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[spec["dtype"]])
    attn = None
    if ref_path.is_file():
        from safetensors import safe_open

        with safe_open(str(ref_path), framework="pt") as handle:
            attn = (handle.metadata() or {}).get("attn_implementation")
    check, model = load_check(spec["out_dir"], dtype=tdtype, keep_model=True, attn_implementation=attn)
    out = [check]
    if model is None or not check.ok:  # the load row says why; a logits row would not apply
        return out
    if not ref_path.is_file():
        out.append(Check("logits", False, "no reference logits from the saving rank"))
        return out
    ref = load_file(str(ref_path))
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model.to(dev).eval()
    with torch.no_grad():
        got = model(input_ids=ref["input_ids"].to(dev)).logits.cpu()
    want = ref["logits"]
    if got.shape != want.shape:
        out.append(Check("logits", False, f"shape {list(got.shape)} != in-memory {list(want.shape)}"))
        return out
    diff = (got.float() - want.float()).abs().max().item()
    try:
        torch.testing.assert_close(got, want.to(got.dtype))
    except AssertionError:
        out.append(Check("logits", False, f"reloaded logits differ from the in-memory model's: max |diff| {diff:.3g} "
                                          f"over {want.numel()} values ({got.dtype})"))
        return out
    out.append(Check("logits", True, f"reloaded model reproduces the in-memory logits (max |diff| {diff:.3g}, {got.dtype})"))
    return out


def print_report(report: SmokeReport, console) -> None:
    """The human report on ``console`` (stderr): the checks, then timings and memory."""
    from rich.markup import escape

    console.print(checks_table(report.checks, title=f"dsfix smoke: ZeRO-{report.zero_stage}, {report.nproc} rank(s), "
                                                     f"{report.device}, {report.dtype}"))
    for w in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    t = ", ".join(f"{k} {v:.1f}s" for k, v in report.timings.items())
    mem = ", ".join(f"{k} {v} MB" for k, v in report.peak_rss_mb.items() if v is not None)
    console.print(f"timings: {escape(t)}")
    console.print(f"peak host RSS: {escape(mem)}" + (f"; CUDA peak: {report.cuda_peak_mb}" if report.cuda_peak_mb else ""))
    if report.output_dir:
        console.print(f"kept the saved folder in {escape(report.output_dir)}")
    if not report.ok and report.log_tail:
        console.print("[bold]last lines of the log:[/]")
        console.print(escape(report.log_tail), highlight=False)
    console.print("[bold green]smoke passed[/]" if report.ok else
                  f"[bold red]smoke failed[/]: {escape(', '.join(c.name for c in report.failed))}")
