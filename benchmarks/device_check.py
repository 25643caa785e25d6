#!/usr/bin/env python
"""The device check: dsfix proven on one GPU in one command, the first thing a session with a GPU runs.

    python benchmarks/device_check.py OUT_DIR --device cuda [--wheels DIR] [--upstream CHAT_DIR]
    python benchmarks/device_check.py OUT_DIR --device cpu      # the same stages, small sizes (CI runs it)

Stages, in order; a failed stage does not stop the ones after it:

  setup        installs what this Python lacks: from ``--wheels DIR`` (``benchmarks/device_wheels.sh DIR``
               fetched them beforehand, for a machine without network) or else from the package index, into a
               folder of its own under the work folder; names the versions
  smoke        ``dsfix smoke --device DEV`` on the bundled example checkout, patched: 311 tensors, verify, and
               the reload on DEV reproducing the in-memory logits (cuda: the full-size Qwen3-0.6B; cpu: the
               narrow Qwen3)
  step 1 Z0/Z3 a real step-1 run on DEV, narrow Qwen3, bf16, one rank, at ZeRO-0 and at ZeRO-3, twice at the same
               seed: through a patched checkout (dsfix's save) and an unpatched one (the checkout's own .bin);
               the tensors bit-equal between the two, the patched one's against the engine's own weights, and
               ``dsfix verify`` on the patched folder. The trainer is upstream DeepSpeed-Chat's step-1
               ``main.py`` with ``--upstream CHAT_DIR`` (its FusedAdam, a CUDA op a bare machine cannot build,
               replaced by torch's AdamW: ``device_step1.py``), else dsfix's own step-1-like trainer
               (fixtures/step1_trainer/train.py); the table names which ran
  engine       the DeepSpeed engine checkpoint the ZeRO-3 patched run saved on DEV, through ``dsfix convert``:
               bit-equal to the engine's own weights (convert itself verifies and loads what it wrote)
  bench        ``bench_save.py --device DEV`` (cuda: full-size Qwen3-0.6B, one round of the five methods its
               ratios need; cpu: ``--quick``), its ratios

OUT_DIR receives one log per stage (setup.log, smoke.log, step1.log, engine.log, bench.log) and the table,
summary.md and summary.json: seven files. Exit status: 0 every row passed, 1 a row failed, 2 bad input (say
``--device cuda`` where there is no CUDA: one line, no row reported as passed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
NARROW_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-narrow", "config.json")
EXAMPLE_CHECKOUT = os.path.join(REPO_ROOT, "fixtures", "checkouts", "package")
TRAINER = os.path.join(REPO_ROOT, "fixtures", "step1_trainer", "train.py")
UPSTREAM_WRAPPER = os.path.join(HERE, "device_step1.py")
UPSTREAM_COMMIT = "45b4b715"  # DeepSpeedExamples, as docs/steps.md ran it
SEED = 1234
TIED = {"lm_head.weight": "model.embed_tokens.weight"}

# What a GPU machine's Python may lack, pinned: the wheels device_wheels.sh fetches (``--requirements main``),
# installed for every stage. DeepSpeed ships only an sdist: device_wheels.sh builds its wheel (DS_BUILD_OPS=0).
MAIN_REQUIREMENTS = (
    "libcst==1.9.0", "deepspeed==0.19.8", "hjson==3.1.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0", "einops==0.8.2",
)
# What upstream's step 1 needs besides (``--requirements upstream``): transformers before 5 with the tokenizers and
# huggingface_hub it takes, and datasets with its own; installed for the upstream runs alone.
UPSTREAM_REQUIREMENTS = (
    "transformers==4.57.6", "tokenizers==0.22.2", "huggingface-hub==0.36.2", "datasets==4.4.1", "dill==0.4.0",
    "multiprocess==0.70.18", "fsspec==2025.10.0", "xxhash==3.6.0", "pandas==2.3.3", "python-dateutil==2.9.0.post0",
    "pytz==2025.2", "tzdata==2025.2", "six==1.17.0", "requests==2.32.5", "urllib3==2.5.0", "idna==3.11",
    "certifi==2025.10.5", "charset-normalizer==3.4.4", "httpx==0.28.1", "httpcore==1.0.9", "h11==0.16.0",
    "anyio==4.11.0", "sniffio==1.3.1",
)
MAIN_MODULES = ("libcst", "typer", "rich", "torch", "safetensors", "transformers", "deepspeed")
UPSTREAM_MODULES = ("transformers", "datasets", "deepspeed")
# What a GPU machine's Python has and datasets needs: installed from the index where it lacks them too.
UPSTREAM_PRESENT = ("pyarrow==21.0.0",)
BENCH_GPU_METHODS = "dsfix_clone,dsfix_dedupe,transformers,article,raw"
STAGE_TIMEOUT_S = {"smoke": 240, "step1": 240, "engine": 180, "bench": 300, "setup": 300}


class BadInput(Exception):
    """Exit 2 with this one line."""


# --------------------------------------------------------------------------- running things, logging them


DEADLINE = [float("inf")]  # time.monotonic() by which every command must have ended (--budget)


class Log:
    """One stage's log file in OUT_DIR: every command, its exit code, its output."""

    def __init__(self, path):
        self.path = path
        with open(path, "w"):
            pass

    def write(self, text):
        with open(self.path, "a") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")

    def run(self, cmd, env, timeout, cwd=None, stdout_only=False):
        """Runs ``cmd`` in a process group of its own (killed past ``timeout``): (exit code, stdout). The exit code
        is None on a timeout; stdout and stderr both go to the log (stdout alone is returned when asked)."""
        self.write("$ " + " ".join(str(c) for c in cmd))
        timeout = max(1.0, min(timeout, DEADLINE[0] - time.monotonic()))
        started = time.time()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE if stdout_only else subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            code = None
        self.write(out or "")
        if err:
            self.write(err)
        ended = "timeout %.0f s" % timeout if code is None else code
        self.write("[exit %s after %.1f s]\n" % (ended, time.time() - started))
        return code, out or ""


def last_json(text):
    """The last line of ``text`` that parses as a JSON object ({} when none)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    try:
        return json.loads(text)
    except ValueError:
        return {}


class Check:
    """What one run of the command knows: its folders, its Python's environment, its rows."""

    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out_dir)
        self.work = args.work
        self.site = os.path.join(self.work, "site")
        self.upstream_site = os.path.join(self.work, "site-upstream")
        self.dsfix_site = os.path.join(self.work, "site-dsfix")  # dsfix's layout, where this Python lacks it
        self.rows = []
        self.facts = {}
        self.cpu = args.device == "cpu"
        self.upstream_ok = bool(args.upstream)  # False once setup finds upstream's packages not importable

    def env(self, upstream=False, ranks=None):
        """This Python's environment with the installed folders and the repository first on its path; ``ranks``:
        a launch of that many CPU ranks (DeepSpeed's CPU accelerator over gloo)."""
        env = dict(os.environ)
        paths = ([self.upstream_site] if upstream else []) + [self.site, self.dsfix_site, REPO_ROOT]
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
        env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", NO_COLOR="1")
        for name in ("FORCE_COLOR", "PY_COLORS"):
            env.pop(name, None)
        if ranks is not None and self.cpu:
            from patcher.checkpoint.smoke.ranks import rank_env

            env = rank_env(env, nproc=ranks)
            env["OMP_NUM_THREADS"] = "1"
        return env

    def dsfix(self, log, *args, timeout=180, upstream=False):
        """``dsfix ARGS --json`` from this checkout (python -m patcher): (exit code, its JSON result)."""
        code, out = log.run([sys.executable, "-m", "patcher", *args, "--json"], self.env(upstream), timeout,
                            cwd=self.work, stdout_only=True)  # not the tree's top: -m puts the current folder first
        return code, last_json(out)

    def child(self, log, *args, upstream=False, timeout=180):
        """This script's own child modes (``--child NAME ...``) in the stages' Python: (exit code, JSON)."""
        code, out = log.run([sys.executable, __file__, "--child", *args], self.env(upstream), timeout,
                            stdout_only=True)
        return code, last_json(out)

    def compare(self, log, *pairs):
        """child_compare on each (folder, state dict file) in one process: (exit code, [result per pair]); a result
        is {} when the child did not get that far."""
        code, out = self.child(log, "compare", *[p for pair in pairs for p in pair])
        results = out.get("results") or []
        return code, (results + [{}] * len(pairs))[:len(pairs)]

    def row(self, stage, ok, figures, started):
        figures = figures.replace(self.work + os.sep, "")  # the scratch folder's paths, relative
        self.rows.append({"stage": stage, "result": "pass" if ok else "FAIL", "figures": figures,
                          "seconds": round(time.time() - started, 1)})


# --------------------------------------------------------------------------- the stages


def has_pip(log):
    code, _ = log.run([sys.executable, "-m", "pip", "--version"], dict(os.environ), 60)
    return code == 0


def unpack_wheels(files, site, log):
    """What ``pip install --no-index --no-deps --target SITE`` does with these wheels, for a Python without pip:
    each unzipped into SITE, its .data/purelib and .data/platlib moved up beside it (scripts are not needed:
    everything runs as ``python -m``). 0, or 1 when a wheel cannot be read."""
    import zipfile

    for path in files:
        try:
            with zipfile.ZipFile(path) as wheel:
                wheel.extractall(site)
        except (OSError, zipfile.BadZipFile) as e:
            log.write("cannot unpack %s: %s" % (path, e))
            return 1
    for name in os.listdir(site):
        if name.endswith(".data"):
            for sub in ("purelib", "platlib"):
                folder = os.path.join(site, name, sub)
                if os.path.isdir(folder):
                    for item in os.listdir(folder):
                        shutil.move(os.path.join(folder, item), os.path.join(site, item))
            shutil.rmtree(os.path.join(site, name))
    log.write("unpacked %d wheels into %s (no pip)" % (len(files), site))
    return 0


# pyproject.toml's [tool.setuptools.package-dir]: where an installed dsfix finds what the tree keeps at its top
PACKAGE_DIRS = {"patcher.templates": "templates", "patcher._fixtures": "fixtures"}


def lay_out_dsfix(site):
    """dsfix from this working tree, laid out in ``site`` as its wheel lays it out (``patcher/``, with
    ``templates/`` as ``patcher/templates`` and ``fixtures/`` as ``patcher/_fixtures``): run from a clone that was
    never installed, ``patcher.templates`` (the save module, which verify, convert and smoke import) is missing."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(REPO_ROOT, "patcher"), os.path.join(site, "patcher"), ignore=ignore)
    for package, folder in PACKAGE_DIRS.items():
        shutil.copytree(os.path.join(REPO_ROOT, folder), os.path.join(site, *package.split(".")), ignore=ignore)


def stage_setup(check):
    """What is missing, installed (from --wheels, else the index) into folders of the work folder that the stages
    put first on their path; then the versions, and whether the device asked for is there."""
    started = time.time()
    log = Log(os.path.join(check.out, "setup.log"))
    ok, notes = True, []
    code, versions = check.child(log, "versions", check.args.device, *MAIN_MODULES)
    plans = [(check.site, "main", MAIN_REQUIREMENTS, [m for m in MAIN_MODULES if not versions.get(m)])]
    if check.args.upstream:
        _, found = check.child(log, "modules", *UPSTREAM_MODULES, "pyarrow", upstream=True)
        lacking = [m for m in UPSTREAM_MODULES if not found.get(m)]
        if (found.get("transformers") or "5").split(".")[0] != "4":
            lacking.append("transformers<5")
        extra = UPSTREAM_PRESENT if not found.get("pyarrow") else ()
        plans.append((check.upstream_site, "upstream", UPSTREAM_REQUIREMENTS + extra, lacking))
    for site, sub, requirements, lacking in plans:
        os.makedirs(site, exist_ok=True)
        if not lacking:
            notes.append("%s: nothing to install" % sub)
            continue
        if check.args.wheels:
            folder = os.path.join(check.args.wheels, sub)
            files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
            cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", site, *files]
        else:
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, *requirements]
        env = dict(os.environ, DS_BUILD_OPS="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
        if check.args.wheels and not has_pip(log):
            pcode = unpack_wheels(files, site, log)
        else:
            pcode, _ = log.run(cmd, env, STAGE_TIMEOUT_S["setup"])
        ok &= pcode == 0
        outcome = "installed" if pcode == 0 else "install failed, exit %s" % pcode
        notes.append("%s: %s from %s (lacked %s)" % (sub, outcome, "the wheels" if check.args.wheels else "the index",
                                                     ", ".join(lacking)))
        if sub == "main":
            code, versions = check.child(log, "versions", check.args.device, *MAIN_MODULES)
    _, found = check.child(log, "modules", "patcher.templates.dsfix_safetensors")
    if not found.get("patcher.templates.dsfix_safetensors"):
        lay_out_dsfix(check.dsfix_site)
        _, found = check.child(log, "modules", "patcher.templates.dsfix_safetensors")
        ok &= bool(found.get("patcher.templates.dsfix_safetensors"))
        notes.append("dsfix: laid out from the working tree (not installed here)%s"
                     % ("" if ok else ", and still not importable"))
    missing = [m for m in MAIN_MODULES if not versions.get(m)]
    if missing:
        ok = False
        notes.append("still not importable: %s" % ", ".join(missing))
    if check.args.upstream:
        _, found = check.child(log, "modules", *UPSTREAM_MODULES, upstream=True)
        check.facts["upstream's transformers"] = found.get("transformers")
        check.facts["datasets"] = found.get("datasets")
        if not all(found.get(m) for m in UPSTREAM_MODULES):
            ok = check.upstream_ok = False
            notes.append("upstream's packages not all importable (%s): step 1 falls back to dsfix's trainer"
                         % ", ".join(m for m in UPSTREAM_MODULES if not found.get(m)))
    if code != 0 or not versions.get("device_ok"):
        ok = False
        notes.append(versions.get("device_problem") or "the versions could not be read (exit %s)" % code)
    check.facts.update((k, v) for k, v in versions.items() if k not in ("typer", "rich"))
    check.row("setup", ok, "; ".join(notes), started)
    return versions


def stage_smoke(check):
    started = time.time()
    log = Log(os.path.join(check.out, "smoke.log"))
    checkout = os.path.join(check.work, "smoke", "DeepSpeed-Chat")
    shutil.copytree(EXAMPLE_CHECKOUT, checkout)
    code, result = check.dsfix(log, "apply", checkout)
    if code != 0:
        return check.row("smoke", False, "dsfix apply failed on the example checkout (exit %s)" % code, started)
    sizes = ["--config", NARROW_CONFIG, "--expect", "311"] if check.cpu else []  # cuda: the bundled Qwen3-0.6B
    code, result = check.dsfix(log, "smoke", checkout, "--device", check.args.device, *sizes,
                               timeout=STAGE_TIMEOUT_S["smoke"])
    checks = {c["name"]: c for c in result.get("checks", [])}
    logits = checks.get("logits", {})
    ok = (code == 0 and result.get("ok") is True and result.get("tensors") == 311
          and result.get("device") == check.args.device and logits.get("ok") is True
          and all(c["ok"] for c in checks.values()))
    failed = [n for n, c in checks.items() if not c["ok"]]
    figures = "%s tensors on %s, %d checks%s; %s" % (
        result.get("tensors"), result.get("device"), len(checks),
        " (failed: %s)" % ", ".join(failed) if failed else " passed", logits.get("detail", "no logits check"))
    if code != 0 and not result:
        figures = "dsfix smoke exit %s, no result (smoke.log)" % code
    check.row("smoke (%s)" % ("narrow Qwen3" if check.cpu else "Qwen3-0.6B"), ok, figures, started)


def _write_upstream_data(chat):
    """DeepSpeed-Chat's local/jsonfile data set: data/train.json and data/eval.json, JSON lines."""
    questions = ["what is tea", "how do you make coffee", "why is the sky blue", "is water hot", "please explain light"]
    os.makedirs(os.path.join(chat, "data"), exist_ok=True)
    for name, n in (("train", 32), ("eval", 8)):
        with open(os.path.join(chat, "data", name + ".json"), "w") as handle:
            for i in range(n):
                handle.write(json.dumps({"prompt": " Human: %s Assistant:" % questions[i % 5],
                                         "chosen": " yes the answer is maybe", "rejected": " no"}) + "\n")


def _launch(check, log, script, script_args, env, cwd):
    """One rank: on a GPU through DeepSpeed's launcher (python -m deepspeed.launcher.runner --num_gpus 1), on the
    CPU started directly with the variables that launcher sets for its one rank (the launcher's own two Python
    processes would double this stage's time on a small CPU). (exit code, output)."""
    from patcher.checkpoint.smoke.ranks import free_port

    port = str(free_port())
    if check.cpu:
        env = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        cmd = [sys.executable, "-u", script, "--local_rank=0", *script_args]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", port, script,
               *script_args]
    return log.run(cmd, env, STAGE_TIMEOUT_S["step1"], cwd=cwd)


def rank_finished(output, rank=0):
    """Whether a rank's output holds its last line (fixtures/step1_trainer/rank_end.py): all its work done and its
    process group torn down, so that a non-zero exit after it is its interpreter's exit, not the run."""
    if HERE not in sys.path:  # benchmarks/: run as a script it is there already; a test loads this file by path
        sys.path.insert(0, HERE)
    import common

    rank_end = common.load_file_module("fixtures", "step1_trainer", "rank_end.py")
    return rank_end.END_LINE.format(rank=rank) in output.splitlines()


def stage_step1(check):
    """Both ZeRO stages, patched and unpatched; returns the ZeRO-3 patched run's folders for the engine stage."""
    log = Log(os.path.join(check.out, "step1.log"))
    base = os.path.join(check.work, "step1")
    upstream = check.args.upstream if check.upstream_ok else None
    trainer = ("upstream DeepSpeed-Chat step-1 main.py (FusedAdam -> torch AdamW)" if upstream
               else "dsfix's step-1-like trainer (fixtures/step1_trainer)")
    if check.args.upstream and not upstream:
        trainer += ", upstream's asked for but its packages are not importable (setup.log)"
    check.facts["step-1 trainer"] = trainer
    checkouts = {}
    top = os.path.abspath(upstream) if upstream else None  # upstream's top folder, one for both copies
    for variant in ("unpatched", "patched"):
        folder = os.path.join(base, variant, "DeepSpeed-Chat")
        if upstream:  # not its .git, nor outputs and data of earlier runs at the top
            shutil.copytree(upstream, folder, ignore=lambda here, names: [n for n in names if n == ".git" or (
                os.path.abspath(here) == top and (n == "data" or n.startswith("output")))])
            _write_upstream_data(folder)
        else:
            shutil.copytree(EXAMPLE_CHECKOUT, folder)
        checkouts[variant] = folder
    code, _ = check.dsfix(log, "apply", checkouts["patched"], upstream=bool(upstream))
    model_dir = os.path.join(base, "model")
    if upstream:  # a local model folder upstream's from_pretrained reads, written by the transformers it runs
        mcode, _ = check.child(log, "model", model_dir, upstream=True)
    ckpt = None
    for stage in (0, 3):
        started = time.time()
        name = "step 1 ZeRO-%d" % stage
        if code != 0:
            check.row(name, False, "dsfix apply failed on the checkout (exit %s; step1.log)" % code, started)
            continue
        if upstream and mcode != 0:
            check.row(name, False, "the narrow model folder could not be written (step1.log)", started)
            continue
        runs, late = {}, []
        for variant in ("unpatched", "patched"):
            out = os.path.join(base, "out-z%d-%s" % (stage, variant))
            ref = os.path.join(base, "ref-z%d-%s" % (stage, variant))
            engine_ckpt = os.path.join(base, "ckpt-z3") if (stage == 3 and variant == "patched") else None
            env = check.env(upstream=bool(upstream), ranks=1)
            if upstream:
                chat = checkouts[variant]
                env["PYTHONPATH"] = chat + os.pathsep + env["PYTHONPATH"]
                env["DSFIX_STEP1_REFERENCE"] = ref
                if engine_ckpt:
                    env["DSFIX_STEP1_ENGINE_CKPT"] = engine_ckpt
                script = os.path.join(chat, "training", "step1_supervised_finetuning", "main.py")
                rc, output = _launch(check, log, UPSTREAM_WRAPPER, [
                    "--script", script, "--data_path", "local/jsonfile", "--data_split", "10,0,0",
                    "--data_output_path", out + ".cache", "--model_name_or_path", model_dir,
                    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_seq_len", "64",
                    "--num_train_epochs", "1", "--learning_rate", "1e-4", "--zero_stage", str(stage),
                    "--dtype", "bf16", "--seed", str(SEED), "--output_dir", out], env, os.path.dirname(script))
            else:
                utils = os.path.join(checkouts[variant], "dschat", "utils", "utils.py")
                extra = ["--engine_ckpt", engine_ckpt] if engine_ckpt else []
                rc, output = _launch(check, log, TRAINER, [
                    "--utils", utils, "--output_dir", out, "--reference_dir", ref, "--zero_stage", str(stage),
                    "--dtype", "bf16", "--steps", "1" if check.cpu else "2", "--seed", str(SEED), "--deterministic",
                    "--save", "dsfix" if variant == "patched" else "original", *extra], env, check.work)
            runs[variant] = (rc, out, ref)
            if rc not in (0, None) and rank_finished(output):  # its work and teardown done: judged by what it wrote
                late.append("%s run exit %s after the rank finished (step1.log)" % (variant, rc))
                runs[variant] = (0, out, ref)
        problems = ["%s run exit %s (step1.log)" % (v, rc) for v, (rc, _, _) in runs.items() if rc != 0]
        figures = list(late)
        prc, out, ref = runs["patched"]
        if prc == 0:  # what the patched run saved, against the other run's .bin when there is one, and its engine
            pairs = [(out, os.path.join(ref, "reference.pt"))]
            if runs["unpatched"][0] == 0:
                pairs.insert(0, (out, os.path.join(runs["unpatched"][1], "pytorch_model.bin")))
            _, results = check.compare(log, *pairs)
            own, same = results[-1], (results[0] if len(results) == 2 else None)
            vcode, verified = check.dsfix(log, "verify", out)
            if same is not None:
                figures.append("%s/%s bit-equal patched vs unpatched" % (same.get("equal"), same.get("total")))
            figures.append("%s/%s bit-equal with the engine's weights" % (own.get("equal"), own.get("total")))
            figures.append("verify: %s" % (verified.get("message") or "exit %s" % vcode))
            for what, result in (("patched vs unpatched", same or {}), ("against the engine", own)):
                if result.get("first"):
                    figures.append("first difference %s: %s" % (what, result["first"]))
            ok = not problems and (same or {}).get("ok") is True and own.get("ok") is True and vcode == 0
            if stage == 3:
                ckpt = (os.path.join(base, "ckpt-z3"), out, ref)
        else:
            ok = False
        check.row(name, ok, "; ".join(problems + figures), started)
    return ckpt


def stage_engine(check, ckpt):
    started = time.time()
    log = Log(os.path.join(check.out, "engine.log"))
    if ckpt is None or not os.path.isdir(ckpt[0]):
        return check.row("engine checkpoint", False, "no engine checkpoint: the ZeRO-3 patched run failed", started)
    folder, saved, ref = ckpt
    converted = os.path.join(check.work, "engine", "converted")
    os.makedirs(os.path.dirname(converted), exist_ok=True)
    code, result = check.dsfix(log, "convert", folder, "--config", saved, "--output", converted, "--dtype", "bf16",
                               timeout=STAGE_TIMEOUT_S["engine"])
    if code != 0:
        return check.row("engine checkpoint", False, "dsfix convert exit %s: %s" % (code, result.get("message")),
                         started)
    _, (own,) = check.compare(log, (converted, os.path.join(ref, "reference.pt")))
    figures = "convert: %s; %s/%s bit-equal with the engine's weights" % (result.get("message"), own.get("equal"),
                                                                         own.get("total"))
    if own.get("first"):
        figures += "; first difference: %s" % own["first"]
    check.row("engine checkpoint (ZeRO-3)", own.get("ok") is True, figures, started)


def stage_bench(check):
    started = time.time()
    log = Log(os.path.join(check.out, "bench.log"))
    results = os.path.join(check.work, "bench.json")
    # cuda: one round of the methods its ratios need (each method a process that builds Qwen3-0.6B on the GPU)
    sizes = ["--quick"] if check.cpu else ["--rounds", "1", "--methods", BENCH_GPU_METHODS]
    code, out = log.run([sys.executable, os.path.join(HERE, "bench_save.py"), "--device", check.args.device, *sizes,
                         "--json", results, "--tmpdir", check.work], check.env(), STAGE_TIMEOUT_S["bench"],
                        cwd=check.work)
    ratios = [line[2:].split(" (goal")[0] for line in out.splitlines() if line.startswith("- ") and " = " in line]
    check.row("bench_save (%s)" % ("--quick" if check.cpu else "Qwen3-0.6B, 1 round, 5 methods"),
              code == 0 and bool(ratios),
              "; ".join(ratios) if ratios else "bench_save exit %s, no ratios (bench.log)" % code, started)


# --------------------------------------------------------------------------- the table


def write_summary(check, total_s):
    facts = dict(check.facts)
    facts.pop("device_ok", None)
    facts.pop("device_problem", None)
    lines = ["# dsfix device check: --device %s" % check.args.device, ""]
    lines += ["- %s: %s" % (k, v) for k, v in facts.items() if v is not None]
    lines += ["- wall time: %.0f s" % total_s, "", "| stage | result | figures | seconds |", "|---|---|---|---|"]
    for r in check.rows:
        figures = r["figures"].replace("|", "\\|")
        lines.append("| %s | %s | %s | %.1f |" % (r["stage"], r["result"], figures, r["seconds"]))
    passed = all(r["result"] == "pass" for r in check.rows)
    lines += ["", "all rows pass" if passed else "FAILED: %s" % ", ".join(r["stage"] for r in check.rows
                                                                        if r["result"] != "pass")]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(check.out, "summary.md"), "w") as handle:
        handle.write(text)
    with open(os.path.join(check.out, "summary.json"), "w") as handle:
        json.dump({"device": check.args.device, "facts": facts, "rows": check.rows, "passed": passed,
                   "seconds": round(total_s, 1)}, handle, indent=2)
    return passed, text


# --------------------------------------------------------------------------- child modes (the stages' Python)


def child_modules(names):
    """{module: its distribution's version, or None when it cannot be imported}."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            module = __import__(name)
            try:
                found[name] = version(name.replace("_", "-"))
            except PackageNotFoundError:
                found[name] = getattr(module, "__version__", "?")
        except Exception:
            found[name] = None
    return found


def child_versions(device, *modules):
    """This Python's version, the modules' versions (None: not importable), and the device's name; device_ok
    False with device_problem when ``device`` is cuda and torch sees none."""
    import platform

    facts = {"python": platform.python_version()}
    facts.update(child_modules(modules))
    facts["device_ok"] = True
    try:
        import torch
    except Exception as e:
        facts.update(device_ok=False, device_problem="torch cannot be imported: %s" % e)
        return facts
    if device == "cuda":
        if not torch.cuda.is_available():
            facts.update(device_ok=False, device_problem="--device cuda, but torch sees no CUDA device")
        else:
            props = torch.cuda.get_device_properties(0)
            facts["device"] = "%s, %.0f GiB, CUDA %s" % (props.name, props.total_memory / 2**30, torch.version.cuda)
    else:
        facts["device"] = "CPU: %s, %d cores" % (platform.processor() or platform.machine(), os.cpu_count() or 0)
    return facts


def child_model(folder):
    """The narrow Qwen3 (fixtures/step1_trainer/tiny_qwen3.py) with its tokenizer, as a local model folder."""
    sys.path.insert(0, os.path.dirname(TRAINER))
    from tiny_qwen3 import tiny_qwen3_model, tiny_qwen3_tokenizer

    model = tiny_qwen3_model(seed=SEED)
    model.save_pretrained(folder)
    tiny_qwen3_tokenizer().save_pretrained(folder)
    return {"folder": folder}


def child_compare(folder, other):
    """Every tensor of the safetensors folder ``folder`` against ``other``: a .bin state dict, or a reference.pt
    holding one (``state_dict``); a tied alias ``other`` lacks is compared with its partner. Bit for bit: the
    same dtype, shape and bytes. {"total", "equal", "first", "ok"}."""
    import glob

    import torch
    from safetensors.torch import load_file

    mine = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        mine.update(load_file(path))
    theirs = torch.load(other, map_location="cpu", weights_only=True)
    theirs = theirs.get("state_dict", theirs)
    equal, first = 0, ""
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key, theirs.get(TIED.get(key, ""), None))
        same = (a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
        equal += same
        if not same and not first:
            first = "%s: %s" % (key, "missing in %s" % ("the save" if a is None else os.path.basename(other))
                                if a is None or b is None else "%s %s vs %s %s" % (a.dtype, list(a.shape), b.dtype,
                                                                                    list(b.shape)))
    total = len(set(mine) | set(theirs))
    return {"total": total, "equal": equal, "first": first, "ok": equal == total and total > 0}


def run_child(argv):
    name, rest = argv[0], argv[1:]
    if name == "modules":
        print(json.dumps(child_modules(rest)))
    elif name == "versions":
        print(json.dumps(child_versions(*rest)))
    elif name == "model":
        print(json.dumps(child_model(rest[0])))
    elif name == "compare":
        results = [child_compare(rest[i], rest[i + 1]) for i in range(0, len(rest), 2)]
        print(json.dumps({"results": results}))
        return 0 if all(r["ok"] for r in results) else 1
    return 0


# --------------------------------------------------------------------------- the command


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="the folder for the logs and the table (new or empty)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: full sizes; cpu: the same stages with small sizes (CI)")
    parser.add_argument("--wheels", default=None, help="install what is missing from this folder (device_wheels.sh "
                        "DIR wrote its main/ and upstream/ folders) instead of the package index")
    parser.add_argument("--upstream", default=None, help="a DeepSpeed-Chat folder (DeepSpeedExamples %s's "
                        "applications/DeepSpeed-Chat): step 1 runs its main.py instead of dsfix's trainer"
                        % UPSTREAM_COMMIT)
    parser.add_argument("--budget", type=float, default=None, help="seconds all stages may take together (default: "
                        "480 with cuda, for a GPU lent for minutes; none with cpu); a command still running then is "
                        "stopped and its row fails, and the stages after it are reported as not run")
    parser.add_argument("--work", default=None, help="scratch folder (default: a new temporary folder, removed)")
    parser.add_argument("--requirements", choices=("main", "upstream"), default=None,
                        help="print the pinned requirements of that wheel folder and exit (for device_wheels.sh)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def check_input(args):
    """Everything the command line can get wrong, before anything runs: BadInput (exit 2) with one line."""
    if not args.out_dir:
        raise BadInput("give the folder for the logs and the table: device_check.py OUT_DIR --device cuda|cpu")
    out = os.path.abspath(args.out_dir)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise BadInput("%s: must be a new or empty folder" % args.out_dir)
    if args.wheels is not None:
        if not os.path.isdir(args.wheels):
            raise BadInput("--wheels %s: not a folder" % args.wheels)
        if not os.path.isdir(os.path.join(args.wheels, "main")):
            raise BadInput("--wheels %s: has no main/ folder of wheels (benchmarks/device_wheels.sh DIR writes it)"
                           % args.wheels)
        if args.upstream and not os.path.isdir(os.path.join(args.wheels, "upstream")):
            raise BadInput("--wheels %s: has no upstream/ folder, which --upstream needs (device_wheels.sh DIR "
                           "--upstream)" % args.wheels)
    if args.upstream is not None:
        main = os.path.join(args.upstream, "training", "step1_supervised_finetuning", "main.py")
        if not os.path.isfile(main) or not os.path.isdir(os.path.join(args.upstream, "dschat")):
            raise BadInput("--upstream %s: not a DeepSpeed-Chat folder (no dschat/ and "
                           "training/step1_supervised_finetuning/main.py)" % args.upstream)
        args.upstream = os.path.abspath(args.upstream)
    if args.wheels:
        args.wheels = os.path.abspath(args.wheels)
    if args.budget is not None and args.budget <= 0:
        raise BadInput("--budget must be a number of seconds above 0")
    if args.device == "cuda":
        sys.path.insert(0, REPO_ROOT)
        from patcher.prereq import no_gpu_driver

        if no_gpu_driver():
            raise BadInput("--device cuda, but this machine has no GPU driver; use --device cpu")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        return run_child(args.child)
    if args.requirements:
        print("\n".join(MAIN_REQUIREMENTS if args.requirements == "main" else UPSTREAM_REQUIREMENTS))
        return 0
    try:
        check_input(args)
    except BadInput as e:
        sys.stderr.write("device_check: error: %s\n" % e)
        return 2
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    started = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    own_work = args.work is None
    args.work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="dsfix-device-check-"))
    os.makedirs(args.work, exist_ok=True)
    check = Check(args)
    budget = args.budget if args.budget is not None else (480.0 if args.device == "cuda" else None)
    if budget is not None:
        DEADLINE[0] = time.monotonic() + budget
    try:
        versions = stage_setup(check)
        if args.device == "cuda" and not versions.get("device_ok"):
            problem = versions.get("device_problem") or "the GPU could not be queried (setup.log)"
            with open(os.path.join(check.out, "summary.md"), "w") as handle:
                handle.write("# dsfix device check: not run\n\n%s\n" % problem)
            sys.stderr.write("device_check: error: %s\n" % problem)
            return 2
        result = None
        for name, stage in (("smoke", stage_smoke), ("step1", stage_step1), ("engine", stage_engine),
                            ("bench", stage_bench)):
            if time.monotonic() >= DEADLINE[0]:
                check.row(name, False, "not run: the budget of %.0f s was spent" % budget, time.time())
                continue
            print("[device_check] %s" % name, file=sys.stderr, flush=True)
            try:
                if stage is stage_engine:
                    stage(check, result)
                else:
                    got = stage(check)
                    result = got if stage is stage_step1 else result
            except Exception as e:  # a stage's own bug: its row fails, the next stage runs
                check.row(name, False, "crashed: %s: %s" % (type(e).__name__, e), time.time())
        passed, text = write_summary(check, time.time() - started)
        print(text)
        return 0 if passed else 1
    finally:
        if own_work:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
