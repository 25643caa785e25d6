"""What the device check's parts share (``device_check.py`` is the command): where things are, the deadline
every command must end by, one stage's log, and :class:`Check`, what one run of the command knows (its folders,
its Python's environment, its rows)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "device_check.py")  # the command, which its child modes (--child) run again
NARROW_CONFIG = os.path.join(REPO_ROOT, "fixtures", "models", "qwen3-narrow", "config.json")
EXAMPLE_CHECKOUT = os.path.join(REPO_ROOT, "fixtures", "checkouts", "package")
TRAINER = os.path.join(REPO_ROOT, "fixtures", "step1_trainer", "train.py")
UPSTREAM_WRAPPER = os.path.join(HERE, "device_step1.py")
UPSTREAM_COMMIT = "45b4b715"  # DeepSpeedExamples, as docs/steps.md ran it
SEED = 1234
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
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
        code, out = log.run([sys.executable, SCRIPT, "--child", *args], self.env(upstream), timeout,
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

