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

from patcher.checkpoint.progress import Progress
from patcher.checkpoint.quiet import import_torch_quietly, quiet
from patcher.checkpoint.ranks import free_port, rank_env
from patcher.errors import DsfixError, Written, need_folder, refuse_file, stop_point
from patcher.prereq import require
from patcher.report import Checks, Result, Verdict
from patcher.resources import BUNDLED_CONFIG, BUNDLED_TENSORS, resource_path
from patcher.checkpoint.verify import Check, checks_table, load_check, verify_folder
from patcher.patch.names import SAVE_HF, SAVE_Z3

DTYPES = ("bf16", "fp16", "fp32")
_RANK_CHECKS = ("functions", "setup", "save")  # checks about the ranks themselves; their log tail helps
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds patcher/, for the ranks


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



# --------------------------------------------------------------------------- inputs


def _utils_defines(checkout) -> set:
    """The top-level functions of the checkout's utils.py; a file that does not parse is refused in the one
    form every verb uses: ``FILE:LINE: does not parse: <Python's message>``."""
    rel = checkout.rel(checkout.utils_path)
    try:
        tree = ast.parse(checkout.utils_path.read_bytes(), filename=rel)
    except SyntaxError as e:
        raise DsfixError(f"does not parse: {e.msg}", path=rel, line=e.lineno) from None
    except (OSError, ValueError) as e:
        raise DsfixError(f"cannot be read: {getattr(e, 'strerror', None) or e}", path=rel) from None
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


KEEP_MARKER = ".dsfix-smoke-running"  # in the --keep folder while smoke writes into it: the pid of that smoke


def _killed_smokes(keep: Path) -> bool:
    """Whether ``keep`` is the --keep folder of a smoke that was killed: it holds the marker, naming a process
    that is gone. That smoke began with the folder new or empty, so all it holds is that smoke's."""
    try:
        pid = int((keep / KEEP_MARKER).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # there, another user's
        return False
    return False


def _check_keep(keep) -> None:
    """--keep: a new folder, an empty one, or one a killed smoke left (refused before anything is built)."""
    if keep is None:
        return
    refuse_file(keep)
    if Path(keep).is_dir() and any(Path(keep).iterdir()) and not _killed_smokes(Path(keep)):
        raise DsfixError("--keep folder must be new or empty", path=str(keep))


def _empty(folder: Path) -> None:
    for child in list(folder.iterdir()):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink()


@contextlib.contextmanager
def _out_folder(keep):
    """The folder the save writes to. Without --keep, a temporary folder, always removed. With --keep, the
    folder kept when smoke ends; when it does not end (Ctrl-C, an error), smoke takes back what it made:
    the folder (and the parents it created) or, for an empty folder that was there, what was written in it."""
    if keep is None:
        tmp = Path(tempfile.mkdtemp(prefix="dsfix-smoke-out-"))
        try:
            yield tmp / "output"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    out = Path(keep).absolute()
    made = next((p for p in reversed((out, *out.parents)) if not p.exists()), None)  # the top folder smoke makes
    try:
        out.mkdir(parents=True, exist_ok=True)
        if _killed_smokes(out):  # what a killed smoke left: gone, so this one starts as that one did
            _empty(out)
        (out / KEEP_MARKER).write_text(f"{os.getpid()}\n", encoding="ascii")
    except OSError as e:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise DsfixError(f"--keep: cannot write here: {e.strerror or e}; nothing written", path=str(keep)) from None
    try:
        yield out.resolve()
        with contextlib.suppress(OSError):  # left, it names a process that is gone: the next smoke clears
            (out / KEEP_MARKER).unlink()
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        else:
            _empty(out)
        raise


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
              expect: Optional[int] = BUNDLED_TENSORS, keep=None, model_dir=None, config_path=None, console=None,
              train_steps: int = 1, seed: int = 1234, timeout: float = 1800) -> SmokeReport:
    """Save a model with the checkout's patched functions as step 1 would, and check what was written.

    ``checkout``: a :class:`patcher.patch.locate.Checkout` or a path. ``expect``: the tensors the folder must
    hold (None: no count). ``console``: where progress goes (None: nowhere). Raises DsfixError (code 2) on bad
    input, including a checkout whose utils.py has no ``save_hf_format_safetensors``, all before torch is
    imported; failing checks give ok=False. With ``keep``, the folder is left only when smoke ends.
    """
    from patcher.patch.locate import Checkout, find_checkout

    if not isinstance(checkout, Checkout):
        checkout = find_checkout(checkout)
    model_dir, config_path = _check_inputs(checkout, dtype, zero_stage, nproc, device, model_dir, config_path)
    _check_keep(keep)
    import_torch_quietly()  # the input holds: torch now, with the noise of torch before 2.3 captured
    device = resolve_device(device)
    import_root, module_name = _import_root(checkout)
    spec = {
        "utils_path": str(checkout.utils_path), "import_root": str(import_root), "module_name": module_name,
        "device": device, "dtype": dtype, "zero_stage": zero_stage, "engine": zero_stage > 0 or nproc > 1,
        "seed": seed, "train_steps": train_steps, "dist_timeout": int(min(timeout, 1800)),
        # absolute: the ranks run in the work folder
        "config_path": str(config_path.resolve()) if config_path is not None else None,
        "model_dir": str(model_dir.resolve()) if model_dir is not None else None,
    }
    work = Path(tempfile.mkdtemp(prefix="dsfix-smoke-"))
    try:
        with _out_folder(keep) as out_dir:
            spec.update(out_dir=str(out_dir), work_dir=str(work))
            with _capture_stdout(work / "stdout.log") as captured, quiet():  # nothing of theirs on stdout
                report = _run(spec, nproc=nproc, expect=expect, console=console, timeout=timeout,
                              kept=out_dir if keep is not None else None)
        if not report.ok and not report.log_tail and not spec["engine"]:
            report = dataclasses.replace(report, log_tail=captured.tail())
        if keep is not None:
            Written.mark()  # the saved folder is complete and kept
        stop_point("smoke.done")
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_inputs(checkout, dtype, zero_stage, nproc, device, model_dir, config_path) -> tuple:
    """Refuse bad options, a missing requirement and an unpatched checkout: (model folder, config file)."""
    if dtype not in DTYPES:
        raise DsfixError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise DsfixError(f"--zero-stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    if nproc < 1:
        raise DsfixError(f"--nproc must be at least 1, not {nproc!r}")
    if model_dir is not None and config_path is not None:
        raise DsfixError("give --model or --config, not both")
    need_ds = f"--zero-stage {zero_stage}" if zero_stage > 0 else (f"--nproc {nproc}" if nproc > 1 else None)
    require("smoke", deepspeed=need_ds, cuda=device == "cuda")  # find_spec only
    if model_dir is not None:
        model_dir = Path(model_dir)
        need_folder(model_dir)
        if not (model_dir / "config.json").is_file():
            raise DsfixError("not a model folder (no config.json)", path=str(model_dir))
    else:
        config_path = Path(config_path) if config_path is not None else resource_path("fixtures", BUNDLED_CONFIG)
        if config_path.is_dir():
            raise DsfixError("is a folder; --config names a config.json (--model takes a model folder)",
                             path=str(config_path))
        if not config_path.is_file():
            raise DsfixError("no such config file", path=str(config_path))
    if SAVE_HF not in _utils_defines(checkout):
        raise DsfixError(f"{checkout.rel(checkout.utils_path)} defines no {SAVE_HF}: this checkout was never "
                         "patched: run `dsfix apply` first", path=str(checkout.root))
    return model_dir, config_path


def _run(spec: dict, *, nproc: int, expect, console, timeout: float, kept) -> SmokeReport:
    """Save (in this process or in ranks), then verify the folder and reload it, with progress on ``console``."""
    how = f"{nproc} rank(s), DeepSpeed ZeRO-{spec['zero_stage']}" if spec["engine"] else \
        "in this process, no DeepSpeed engine"
    timings: dict = {}
    with Progress(console, "dsfix smoke") as progress:
        progress.phase(f"building and saving ({how})")

        def on_phase(name):
            progress.phase(f"rank 0: {name} ({how})")
            stop_point(f"smoke.{name}")

        results, rc, log_tail, launcher, checks = _save(spec, nproc, timeout, on_phase, timings)
        r0 = next((r for r in results if r.get("rank") == 0), None)
        vreport = None
        if any(c.name == "save" and c.ok for c in checks) or (r0 is not None and r0.get("phase") == "save"):
            progress.phase("verifying the saved folder")
            stop_point("smoke.verify")
            vreport = _verify_saved(spec, expect, checks, timings)
        if vreport is not None and vreport.check("config") and vreport.check("config").ok:
            progress.phase("reloading with from_pretrained and comparing logits")
            t = time.perf_counter()
            checks.extend(_reload_checks(spec, spec["device"]))
            timings["reload"] = round(time.perf_counter() - t, 3)
    return _report(spec, nproc, results, r0, checks, timings, launcher, log_tail, vreport, kept)


def _save(spec: dict, nproc: int, timeout: float, on_phase, timings: dict) -> tuple:
    """Run the save: (rank results, launcher exit code, log tail, launcher command, checks about the ranks)."""
    checks, launcher, log_tail = [], None, ""
    t = time.perf_counter()
    if spec["engine"]:
        launcher = " ".join(["python"] + launcher_command(nproc, "SPEC.json")[1:])
        try:
            results, log_tail, rc = _launch(spec, nproc, timeout, on_phase)
        except subprocess.TimeoutExpired:
            results, rc = [], None
            log_tail = _tail(Path(spec["work_dir"]) / "ranks.log")
            checks.append(Check("save", False, f"the ranks did not finish within {timeout:.0f}s (killed)"))
        timings["ranks"] = round(time.perf_counter() - t, 3)  # in this process, rank 0's own phases tell
    else:
        import patcher.checkpoint.smoke_worker as worker

        spec["distributed"] = False
        results, rc = [worker.run_rank(spec, on_phase)], 0  # run_smoke has stdout on stderr already
    r0 = next((r for r in results if r.get("rank") == 0), None)
    if r0 is not None:
        timings.update(r0.get("timings", {}))
    if not checks:
        errors = [r for r in results if r.get("error")]
        checks.extend(_rank_checks(results, r0, errors, rc, nproc, int(spec["zero_stage"]), Path(spec["work_dir"])))
    return results, rc, log_tail, launcher, checks


def _verify_saved(spec: dict, expect, checks: list, timings: dict):
    """verify's checks on the saved folder (no load: the reload follows), added to ``checks``."""
    t = time.perf_counter()
    vreport = None
    try:
        if not Path(spec["out_dir"]).is_dir():
            raise DsfixError("the save wrote nothing: no output folder, no model weights")
        vreport = verify_folder(spec["out_dir"], expect=expect, load=False, finite=True)
        checks.extend(vreport.checks)
    except DsfixError as e:
        checks.append(Check("weights", False, e.message))
    timings["verify"] = round(time.perf_counter() - t, 3)
    return vreport


def _report(spec, nproc, results, r0, checks, timings, launcher, log_tail, vreport, kept) -> SmokeReport:
    peak = {"this process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    cuda = None
    for r in results:
        if spec["engine"]:
            peak[f"rank {r['rank']}"] = r.get("peak_rss_mb")
        if r.get("cuda_peak_mb") is not None:
            cuda = cuda or {}
            cuda[f"rank {r['rank']}"] = r["cuda_peak_mb"]
    if cuda is None and spec["device"] == "cuda":
        import torch

        cuda = {"this process": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
    r0 = r0 or {}
    return SmokeReport(
        ok=bool(checks) and all(c.ok for c in checks), checks=tuple(checks), timings=timings,
        device=r0.get("device", spec["device"]), dtype=spec["dtype"], zero_stage=int(spec["zero_stage"]),
        nproc=nproc, load_method=r0.get("load_method"), load_detail=r0.get("load_detail"),
        load_note=r0.get("load_note"), functions=tuple(r0.get("functions", ())), backend=r0.get("backend"),
        launcher=launcher, peak_rss_mb=peak, cuda_peak_mb=cuda,
        tensors=vreport.tensors if vreport is not None else None, save_output=r0.get("save_output", ""),
        output_dir=str(kept) if kept is not None else None,
        log_tail=log_tail if any(c.name in _RANK_CHECKS and not c.ok for c in checks) else "",
    )


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
        if r0["load_method"] == "import":
            how = "by importing utils.py"
        elif r0.get("load_note"):
            how = "from utils.py's source with ast (it does not import here: see the warning below)"
        else:
            how = "from utils.py's source with ast (it imports DeepSpeed, which a save without an engine does not need)"
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
