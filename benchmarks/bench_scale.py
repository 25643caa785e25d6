#!/usr/bin/env python
"""How converting and verifying a DeepSpeed checkpoint grows with the model: Qwen3 shapes from 0.6B to 8B.

For each case (a ZeRO stage, a rank count, a size) it writes a synthetic checkpoint rank by rank
(scale_ckpt.py: seeded random fp32 masters, Adam moments as stubs unless the case says ``:moments``, no whole
model in memory), then runs each
method in its own process from a cold page cache (sync and drop_caches before each), one at a time:

  disk floor       every fp32 master read once (their byte ranges only), then the output's bytes written once
                   and fsynced
  dsfix convert    ``dsfix convert CKPT --output OUT`` (every check, the load check too)
  dsfix verify     ``dsfix verify OUT`` (its checks and its load check)
  zero_to_fp32     ``python -m deepspeed.utils.zero_to_fp32 CKPT DIR`` with its defaults, then its files fsynced

and reports wall time, CPU time, peak anonymous and peak file-backed memory of each process tree, and the
ratios; where ``--compare`` names the size, dsfix's output is compared tensor by tensor with zero_to_fp32's
cast to the same dtype, bit for bit. A method past ``--limit-gib`` of anonymous memory is killed and reported
so ("killed at N GiB"). One checkpoint at a time lives on disk; everything is deleted at the end.

    python benchmarks/bench_scale.py --plot docs/scale.png          # the grid below, about 30 min
    python benchmarks/bench_scale.py --quick                        # narrow Qwen3, 8 ranks (a smoke test)
    python benchmarks/bench_scale.py --from-json scale.json --plot docs/scale.png   # redraw only
    python benchmarks/bench_scale.py --cases '' --more 8B          # verify --against, step 3, a PEFT merge
    python benchmarks/bench_scale.py --cases '' --save 4B,8B --save-spill --limit-gib 22.5    # the ZeRO-3 save
"""
import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

sys.path.insert(0, common.REPO_ROOT)
import scale_ckpt  # noqa: E402
import scale_measure as measure  # noqa: E402
import scale_plot  # noqa: E402  (matplotlib is imported only when it draws)

CASES = "3:8:0.6B,3:8:8B,3:8:4B,3:8:1.7B,3:64:1.7B,2:8:0.6B,2:8:1.7B"
METHODS = (("floor", "disk floor"), ("convert", "dsfix convert"), ("verify", "dsfix verify"),
           ("zero_to_fp32", "zero_to_fp32"))
Z2F = r'''
import os, runpy, sys
sys.argv = ["zero_to_fp32"] + sys.argv[1:]
runpy.run_module("deepspeed.utils.zero_to_fp32", run_name="__main__")
for here, _, names in os.walk(sys.argv[2], topdown=False):
    for path in [os.path.join(here, n) for n in names] + [here]:
        fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)
'''


def _floor(case, work, args):
    scratch = os.path.join(work, "floor.bin")
    res = measure.cold(measure.python("-c", measure.FLOOR, os.path.join(case["root"], "global_step1"), scratch,
                                 str(case["output_bytes"])), args, "disk floor")
    if os.path.exists(scratch):  # a floor killed mid-write: its file (16 GB at 8B) not left for the next cases
        os.remove(scratch)
    read, t_read, t_write = res["stdout"].split()
    res.update(read_bytes=int(read), read_s=float(t_read), write_s=float(t_write))
    res["floor_s"] = res["read_s"] + res["write_s"]
    return res


def _zero_to_fp32(case, z2f, args):
    res = measure.cold(measure.python("-c", Z2F, case["root"], z2f), args, "zero_to_fp32")
    res.update(ok=res["returncode"] == 0 and not res["killed_at"])
    return res


def _compare(out, z2f, args):
    res = measure.run_tree(measure.python("-c", measure.COMPARE, out, z2f), limit=args.limit_gib * measure.GIB,
                           timeout=args.timeout)
    found = measure.json_of(res)
    return dict(found, ok=not found["differ"] and not found["only_here"]) if found else {"ok": False,
                                                                                       "error": res["stderr"]}


def label(case, ranks="ranks"):
    """"ZeRO-3, 8 ranks, 4B", and ", full Adam moments" where the case wrote them."""
    return "ZeRO-%d, %d%s, %s%s" % (case["stage"], case["world"], " " + ranks if ranks else "", case["size"],
                                    ", full Adam moments" if case.get("moments") else "")


def run_case(stage, world, size, args, work, moments=False):
    """One checkpoint made, measured by every method, compared where asked, deleted."""
    config = scale_ckpt.config_of(size)
    case = {"stage": stage, "world": world, "size": size, "moments": moments, "root": os.path.join(work, "ckpt")}
    print("[scale] %s: writing the checkpoint" % label(case), file=sys.stderr, flush=True)
    begin = time.perf_counter()
    case["params"], case["master_bytes"] = scale_ckpt.write_checkpoint(case["root"], config, stage, world,
                                                                       moments=moments)
    case["make_s"] = time.perf_counter() - begin
    case["output_bytes"] = scale_ckpt.output_bytes(config)
    case["largest_bytes"] = max(n for n in scale_ckpt.tensor_bytes(config))
    out, z2f = os.path.join(work, "out"), os.path.join(work, "z2f")
    wanted = args.methods.split(",")
    results = {"floor": _floor(case, work, args), "convert": measure.dsfix(
        ["convert", case["root"], "--output", out], args, "dsfix convert", keep=("tensors", "bytes_written"))}
    verified = results["convert"]["ok"] and "verify" in wanted
    # the output folder read once, cold, as verify's measure (verify reads every tensor once)
    results["read_output"] = measure.read_once([out], args, "one read of the output") if verified else None
    results["verify"] = measure.dsfix(["verify", out], args, "dsfix verify") if verified else None
    compare = (size in args.compare.split(",") or args.quick) and "zero_to_fp32" in wanted
    if not compare:
        shutil.rmtree(out, ignore_errors=True)
    results["zero_to_fp32"] = _zero_to_fp32(case, z2f, args) if "zero_to_fp32" in wanted else None
    if compare and results["convert"]["ok"] and results["zero_to_fp32"]["ok"]:
        case["bit_equal"] = _compare(out, z2f, args)
    for path in (out, z2f, case["root"]):
        shutil.rmtree(path, ignore_errors=True)
    for res in results.values():
        if res is not None:
            res.pop("stdout", None)
            res["stderr"] = res.get("stderr", "").replace(work, "WORK")  # what the saved figures keep: no paths
    case.pop("root")
    return dict(case, results=results)


def _gib(nbytes):
    return "-" if nbytes is None else "%.2f" % (nbytes / measure.GIB)


def _cell(res, field):
    if res is None:
        return "-"
    if res.get("killed_at"):
        return "killed at %.1f GiB" % (res["killed_at"] / measure.GIB) if field == "anon_peak" else "(killed)"
    if field in ("wall_s", "cpu_s"):
        return "%.1f" % res[field]
    return "%.0f" % (res[field] / common.MIB)


def report(cases):
    rows = []
    for case in sorted(cases, key=lambda c: (-c["stage"], c["world"], c["params"])):
        r = case["results"]
        floor = r["floor"]["floor_s"]
        floors = {"convert": floor, "zero_to_fp32": r.get("floor_before", r["floor"])["floor_s"]}
        ratio = [("%.2f" % (r[m]["wall_s"] / floors[m]) if r.get(m) and not r[m].get("killed_at") else "-")
                 for m in ("convert", "zero_to_fp32")]
        bit = case.get("bit_equal")
        one_read = _one_read_s(case)
        rows.append([label(case, ranks=""), "%.2f" % (case["params"] / 1e9),
                     "%.1f (%.1f + %.1f)" % (floor, r["floor"]["read_s"], r["floor"]["write_s"])]
                    + [_cell(r["convert"], f) for f in ("wall_s", "cpu_s", "anon_peak", "file_peak")] + [ratio[0]]
                    + [_cell(r.get("verify"), f) for f in ("wall_s", "anon_peak")]
                    + ["-" if one_read is None or not r.get("verify") or r["verify"].get("killed_at")
                       else "%.2f" % (r["verify"]["wall_s"] / one_read)]
                    + [_cell(r.get("zero_to_fp32"), f) for f in ("wall_s", "anon_peak")] + [ratio[1]]
                    + ["-" if bit is None else ("yes (%d tensors)" % bit["compared"] if bit["ok"] else "NO")])
    header = ["stage, ranks, model", "params (B)", "disk floor s (read + write)", "convert s", "convert CPU s",
              "convert anon MiB", "convert file MiB", "convert / floor", "verify s", "verify anon MiB",
              "verify / one read",
              "zero_to_fp32 s", "zero_to_fp32 anon MiB", "zero_to_fp32 / floor", "bit-equal to zero_to_fp32"]
    return common.table(header, rows)


def _one_read_s(case):
    """Reading the output folder once, cold: measured (``read_output``), or in runs before that was measured,
    its bytes at the rate the same run's floor read the masters."""
    if case["results"].get("read_output"):
        return case["results"]["read_output"]["read_s"]
    floor = case["results"]["floor"]
    if not floor.get("read_s"):
        return None
    return case["output_bytes"] / (floor["read_bytes"] / floor["read_s"])


def goals(cases):
    """The issue's bounds, case by case: convert's anon <= 1 GiB and time <= 1.25x the floor; verify's anon
    <= 1 GiB + the largest tensor and time <= 1.5x reading the output once."""
    lines = []
    for case in cases:
        conv, floor = case["results"]["convert"], case["results"]["floor"]["floor_s"]
        name = label(case)
        if not conv.get("ok"):
            lines.append("- %s: dsfix convert FAILED: %s" % (name, conv["stderr"].strip().splitlines()[-1:]))
            continue
        mem, ratio = conv["anon_peak"] / measure.GIB, conv["wall_s"] / floor
        line = ("- %s: convert anon %.2f GiB (<= 1: %s), convert / floor %.2f (<= 1.25: %s)"
                % (name, mem, _met(mem <= 1), ratio, _met(ratio <= 1.25)))
        ver, one_read = case["results"].get("verify"), _one_read_s(case)
        if ver and not ver.get("ok"):
            line += "; dsfix verify FAILED"
        elif ver:
            bound = measure.GIB + case["largest_bytes"]
            line += "; verify anon %.2f GiB (<= 1 + the largest tensor, %.2f: %s)" % (
                ver["anon_peak"] / measure.GIB, bound / measure.GIB, _met(ver["anon_peak"] <= bound))
            if one_read:  # a read too short to time (the narrow model) has no rate to judge by
                line += ", verify / one read %.2f (%.1f s; <= 1.5: %s)" % (
                    ver["wall_s"] / one_read, one_read, _met(ver["wall_s"] <= 1.5 * one_read))
        lines.append(line)
    return "\n".join(lines)


def _met(ok):
    return "PASS" if ok else "MISS"


def _fit(xs, ys, at):
    """The least-squares line through (xs, ys), read at ``at``."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    return my + slope * (at - mx)


def extrapolate(cases, params=70e9):
    """Convert's peak anonymous memory, its time and the disk floor's at ``params``: straight lines fitted to
    the ZeRO-3 8-rank cases (memory grows with the largest tensor's slice, time with the bytes); labelled as
    extrapolated wherever shown."""
    ok = [c for c in cases if scale_plot.size_axis(c) and c["results"]["convert"].get("ok")]
    if len(ok) < 2:
        return None
    xs = [c["params"] for c in ok]
    conv = [c["results"]["convert"] for c in ok]
    floor_s = _fit(xs, [c["results"]["floor"]["floor_s"] for c in ok], params)
    convert_s = _fit(xs, [r["wall_s"] for r in conv], params)
    return {"params": params, "anon_gib": _fit(xs, [r["anon_peak"] for r in conv], params) / measure.GIB,
            "floor_s": floor_s, "convert_s": convert_s, "ratio": convert_s / floor_s,
            "cpu_s": _fit(xs, [r["cpu_s"] for r in conv], params)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the narrow Qwen3, ZeRO-3 on 8 ranks: a smoke test")
    parser.add_argument("--cases", default=None,
                        help="STAGE:RANKS:SIZE[:moments],... (default: %s); ':moments' writes full Adam moments "
                             "before the masters, as DeepSpeed does (three times the disk: 48 GB at 4B)" % CASES)
    parser.add_argument("--compare", default="0.6B,4B", help="sizes compared bit for bit with zero_to_fp32's output")
    parser.add_argument("--methods", default="floor,convert,verify,zero_to_fp32",
                        help="the disk floor and convert always; verify and zero_to_fp32 where named")
    parser.add_argument("--limit-gib", type=float, default=19.0, help="kill a method past this anonymous memory")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a method may take")
    parser.add_argument("--warm", action="store_true",
                        help="keep the page cache: for a test of behaviour, where dropping it would slow everything "
                             "else on the machine (its times are then not the cold ones the docs give)")
    parser.add_argument("--tmpdir", default=None, help="where the checkpoints go (default: the system's)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--from-json", default=None,
                        help="report (and plot) these results, A[,B...]: a later run's methods replace an earlier's "
                             "in the same case; measure nothing")
    parser.add_argument("--save", default=None, help="also the ZeRO-3 save on 2 ranks at these sizes (e.g. 4B,8B)")
    parser.add_argument("--save-spill", action="store_true",
                        help="in the save, rank 1's partitions in a file mapped into it, not its heap: for a machine "
                             "whose memory cannot hold both ranks' (8B on 24 GiB); rank 0, the one measured, is as "
                             "before")
    parser.add_argument("--more", default=None,
                        help="also verify --against, a step-3 folder and a PEFT merge at these sizes (e.g. 8B): "
                             "model folders written directly, no checkpoint")
    parser.add_argument("--plot", default=None, help="draw time and memory against parameters here (matplotlib)")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = merged(args.from_json.split(","))
    else:
        saved = measure_all(args)
    print_report(saved, args)
    if saved.get("more"):
        import scale_more

        print("\n### Verify beyond one folder, and a PEFT merge\n")
        print(scale_more.report(saved["more"]))
    if saved.get("saves"):
        import scale_save

        print("\n### The ZeRO-3 save on 2 CPU ranks\n")
        print(scale_save.report(saved["saves"]))
    if args.json and not args.from_json:
        with open(args.json, "w") as handle:
            json.dump(saved, handle, indent=2)
    if args.plot:
        print(scale_plot.draw(saved["cases"], args.plot, extrapolate(saved["cases"])))
    failed = [c for c in saved["cases"] if not c["results"]["convert"].get("ok")
              or (c.get("bit_equal") is not None and not c["bit_equal"]["ok"])]
    failed += [m for m in saved.get("more", []) if not m["ok"]]
    return 1 if failed else 0


def merged(paths):
    """Saved runs as one: a case (stage, ranks, size) a later run measured takes that run's methods (its floor
    with them, so each ratio stays within one run); the later run's saves likewise."""
    saved = None
    for path in paths:
        with open(path) as handle:
            run = json.load(handle)
        if saved is None:
            saved = run
            continue
        known = {_key(c): c for c in saved["cases"]}
        for case in run["cases"]:
            old = known.get(_key(case))
            if old is None:
                saved["cases"].append(case)
                continue
            if case["results"].get("zero_to_fp32") is not None:  # measured again with its own floor
                old["results"].pop("floor_before", None)
                old.pop("bit_equal", None)
            elif case["results"].get("floor") is not None:  # the earlier floor stays the earlier methods' measure
                old["results"].setdefault("floor_before", old["results"]["floor"])
            if case.get("bit_equal") is not None:
                old["bit_equal"] = case["bit_equal"]
            remeasured = {m for m, r in case["results"].items() if r is not None}
            old["results"].update((m, case["results"][m]) for m in remeasured)
            old["earlier"] = sorted(m for m, r in old["results"].items()
                                    if r is not None and m not in remeasured and m != "floor_before")
            old.setdefault("runs", []).append(run["command"])
        saved["command"] += " + " + run["command"]
        saved.update({k: run[k] for k in ("saves", "more") if run.get(k)})
    return saved


def _key(case):
    return case["stage"], case["world"], case["size"], bool(case.get("moments"))


def _case(text):
    """"3:8:4B" or "3:8:4B:moments" -> (stage, ranks, size, full moments); anything else ends the run in one line."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "moments") or not all(
            p.isdigit() for p in parts[:2]):
        raise SystemExit("bench_scale: a case is STAGE:RANKS:SIZE or STAGE:RANKS:SIZE:moments, not %r" % text)
    return int(parts[0]), int(parts[1]), parts[2], len(parts) == 4


def measure_all(args):
    from patcher.prereq import require_or_exit

    require_or_exit("bench_scale", deepspeed="zero_to_fp32")
    chosen = "3:8:narrow" if args.quick else (CASES if args.cases is None else args.cases)
    cases = [_case(c) for c in chosen.split(",") if c]
    work = tempfile.mkdtemp(prefix="dsfix-bench-scale-", dir=args.tmpdir)
    done = []
    try:
        facts = common.machine_facts(work)
        saved = {"machine": facts, "command": saved_command(sys.argv[1:], args), "cases": done}
        for stage, world, size, moments in cases:
            done.append(run_case(stage, world, size, args, work, moments))
            _keep(saved, args)  # case by case: a long run interrupted keeps what it measured
        if args.more:
            import scale_more

            saved["more"] = []
            for size in args.more.split(","):
                saved["more"].append(scale_more.run_size(size, args, work))
                _keep(saved, args)
        if args.save:
            import scale_save

            saved["saves"] = scale_save.run_sizes(args.save.split(","), args, work)
            _keep(saved, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return saved


def saved_command(argv, args):
    """The command line as the results keep it, with no machine paths: the --json file by its name alone, the
    --tmpdir folder as DIR."""
    def kept(arg):
        if args.json and arg == args.json:
            return os.path.basename(arg)
        return arg.replace(args.tmpdir, "DIR") if args.tmpdir else arg
    return " ".join(shlex.quote(kept(a)) for a in argv)


def _keep(saved, args):
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(saved, handle, indent=2)


def print_report(saved, args):
    cases = saved["cases"]
    if not cases:
        return
    loads = [r["load"] for c in cases for r in c["results"].values() if r]
    cold = all(r["cold"] for c in cases for r in c["results"].values() if r)
    print("## Scale: convert, verify and zero_to_fp32 from 0.6B to 8B\n")
    print("- command: `python benchmarks/bench_scale.py %s`" % saved["command"])
    print("- machine: %s" % saved["machine"])
    print("- page cache: %s before each method; load average (1 min) at the methods' starts: %.1f to %.1f"
          % ("dropped (sync; drop_caches 3)" if cold else
             "NOT dropped (%s): warm reads" % ("--warm" if args.warm else "not allowed here"),
             min(loads), max(loads)))
    print("- memory: RssAnon and RssFile summed over each method's process tree, sampled every 20 ms; a method "
          "past %.0f GiB of anonymous memory is killed" % args.limit_gib)
    earlier = sorted({m for c in cases for m in c.get("earlier", [])})
    if earlier:
        print("- runs merged: where a later run measured a case again, its methods replace the earlier run's; "
              "%s kept the earlier run's figures, each ratio against that run's own floor" % ", ".join(earlier))
    print()
    print(report(cases))
    print()
    print(goals(cases))
    guess = extrapolate(cases)
    if guess:
        print("- extrapolated, not measured (lines fitted to ZeRO-3, 8 ranks, 0.6B to 8B): at 70B (280 GB of fp32 "
              "masters) convert needs about %.1f GiB of anonymous memory and about %.1fx the disk floor's time "
              "(%.0f min against %.0f min here; %.0f min of CPU)" % (guess["anon_gib"], guess["ratio"],
                                                                     guess["convert_s"] / 60, guess["floor_s"] / 60,
                                                                     guess["cpu_s"] / 60))


if __name__ == "__main__":
    sys.exit(main())
