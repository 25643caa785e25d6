#!/usr/bin/env python
"""How long `dsfix check` takes as a whole process, beside the floor `python -c "import libcst, typer, rich"`.

The checkouts are written here, in the shape and size of real ones (nothing is copied from DeepSpeed-Chat):

  upstream-sized  a step-1 main.py of about 400 lines and a utils.py of about 310 lines, as upstream's
  fork-1000       the same utils.py and a 1,000-line main.py (a fork that grew its own training loop)

Runs alternate (floor, each checkout, floor, ...) so that a busy machine slows all of them alike; the
table gives medians of wall time and of CPU time (user + system, which load on other cores disturbs less)
and each checkout's ratio to the floor. Goals: upstream-sized at most 1.6x the floor, the 1,000-line fork
at most 2x the floor (wall time, medians).

    python benchmarks/bench_check.py [--runs 15] [--json out.json]
"""
import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from checkout_maker import write_checkout  # noqa: E402

# An installed dsfix has its byte code compiled (pip does it); so do the floor's packages. Let Python write
# the caches for an editable checkout too, or every run would compile dsfix from source.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(cmd, cwd=None) -> tuple:
    """(wall s, CPU s) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.decode()[-2000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}; {os.cpu_count()} cores; Python {platform.python_version()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="dsfix-bench-check-") as tmp:
        cases = {
            "upstream-sized": write_checkout(os.path.join(tmp, "upstream"), main_lines=400),
            "fork-1000": write_checkout(os.path.join(tmp, "fork"), main_lines=1000),
        }
        cmds = {"floor": [py, "-c", "import libcst, typer, rich"]}
        cmds.update({name: [py, "-m", "patcher", "check", path] for name, path in cases.items()})
        for cmd in cmds.values():  # warm the file cache and the byte-code caches
            timed(cmd)
        times = {name: [] for name in cmds}
        cpu = {name: [] for name in cmds}
        for _ in range(a.runs):
            for name, cmd in cmds.items():
                wall, used = timed(cmd)
                times[name].append(wall)
                cpu[name].append(used)
    med = {name: statistics.median(v) for name, v in times.items()}
    cpu_med = {name: statistics.median(v) for name, v in cpu.items()}
    floor = med["floor"]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{a.runs} alternating runs, medians\n")
    print("| process | wall s | best s | x floor | CPU s | CPU x floor | goal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    goals = {"upstream-sized": ("<= 1.6x", lambda m: m <= 1.6 * floor),
             "fork-1000": ("<= 2x", lambda m: m <= 2 * floor)}
    verdicts = {}
    for name, v in times.items():
        goal, ok = goals.get(name, ("", None))
        verdict = "" if ok is None else ("PASS" if ok(med[name]) else "MISS")
        verdicts[name] = verdict
        print(f"| {name} | {med[name]:.3f} | {min(v):.3f} | {med[name] / floor:.2f} | {cpu_med[name]:.3f} | "
              f"{cpu_med[name] / cpu_med['floor']:.2f} | {goal} {verdict} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "runs": a.runs, "times": times, "cpu": cpu, "medians": med,
                       "cpu_medians": cpu_med}, f, indent=2)
    return 0 if all(v != "MISS" for v in verdicts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
