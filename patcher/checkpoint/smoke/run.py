"""``dsfix smoke``: run a checkout's own save functions the way step-1 main.py calls them, then verify.

A plain one-rank save (ZeRO 0, nproc 1) runs in this process. DeepSpeed engines (ZeRO 1-3) and
several ranks run in ranks started by ``python -m torch.distributed.run --standalone`` (module
``patcher.checkpoint.smoke.worker``): on a CPU with DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) and
gloo, on CUDA with nccl. The folder the save wrote is checked by :func:`patcher.checkpoint.check.verify.verify_folder`,
reloaded with ``from_pretrained``, and must reproduce the in-memory model's logits.
torch, transformers and deepspeed are imported only inside functions.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from patcher.checkpoint.check.headers import Check
from patcher.checkpoint.check.load import load_check
from patcher.checkpoint.check.verify import verify_folder
from patcher.checkpoint.progress import Progress
from patcher.checkpoint.quiet import import_torch_quietly, quiet
from patcher.checkpoint.smoke.keep import check_keep, out_folder
from patcher.checkpoint.smoke.launch import capture_stdout, launch, launcher_command, tail
from patcher.checkpoint.smoke.report import SmokeReport
from patcher.errors import DsfixError, Written, need_folder, stop_point
from patcher.patch.names import SAVE_HF, SAVE_Z3
from patcher.prereq import require
from patcher.resources import BUNDLED_CONFIG, BUNDLED_TENSORS, resource_path

DTYPES = ("bf16", "fp16", "fp32")
_RANK_CHECKS = ("functions", "setup", "save")  # checks about the ranks themselves; their log tail helps


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
    check_keep(keep)
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
        with out_folder(keep) as out_dir:
            spec.update(out_dir=str(out_dir), work_dir=str(work))
            with capture_stdout(work / "stdout.log") as captured, quiet():  # nothing of theirs on stdout
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
            results, log_tail, rc = launch(spec, nproc, timeout, on_phase)
        except subprocess.TimeoutExpired:
            results, rc = [], None
            log_tail = tail(Path(spec["work_dir"]) / "ranks.log")
            checks.append(Check("save", False, f"the ranks did not finish within {timeout:.0f}s (killed)"))
        timings["ranks"] = round(time.perf_counter() - t, 3)  # in this process, rank 0's own phases tell
    else:
        import patcher.checkpoint.smoke.worker as worker

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
    out.append(Check("logits", True,
                     f"reloaded model reproduces the in-memory logits (max |diff| {diff:.3g}, {got.dtype})"))
    return out
