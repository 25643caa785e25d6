"""bench_scale.py's figure: time and peak memory against parameters, drawn from its own results (matplotlib,
imported only here: the benchmark measures without it)."""
import os

GIB = 1024.0 ** 3


def size_axis(case):
    """The cases the lines are drawn (and bench_scale's extrapolation fitted) through: ZeRO-3 on 8 ranks, the
    benchmark's stub moments."""
    return (case["stage"], case["world"]) == (3, 8) and not case.get("moments")


STYLE = (("floor", "disk floor (read masters once + write output once)", "#555555", "s", "--"),
         ("convert", "dsfix convert (every check + load check)", "#1f77b4", "o", "-"),
         ("verify", "dsfix verify of the output", "#2ca02c", "^", "-"),
         ("zero_to_fp32", "DeepSpeed zero_to_fp32 (defaults)", "#d62728", "D", "-"))


def _points(cases, method, field):
    """(params in billions, value, killed) of the ZeRO-3 8-rank cases, in size order."""
    out = []
    for case in sorted((c for c in cases if size_axis(c)), key=lambda c: c["params"]):
        res = case["results"].get(method)
        if res is None:
            continue
        killed = bool(res.get("killed_at"))
        if field == "time":
            value = res["floor_s"] if method == "floor" else (None if killed else res["wall_s"])
        else:
            value = (res["killed_at"] if killed else res["anon_peak"]) / GIB
        if value is not None:
            out.append((case["params"] / 1e9, value, killed))
    return out


def _others(cases):
    """Convert's time and memory at the cases off the main line (64 ranks, ZeRO-2, full Adam moments)."""
    return [(c["params"] / 1e9, c["results"]["convert"]["wall_s"], c["results"]["convert"]["anon_peak"] / GIB,
             "ZeRO-%d, %d ranks%s" % (c["stage"], c["world"], ", full Adam moments" if c.get("moments") else ""))
            for c in cases
            if not size_axis(c) and c["results"]["convert"].get("ok")]


def _panel(ax, cases, field):
    for method, label, color, marker, line in STYLE:
        pts = _points(cases, method, field)
        if not pts or (field == "memory" and method == "floor"):
            continue
        if any(method in c.get("earlier", []) for c in cases if size_axis(c)):
            label += ", an earlier run"
        xs, ys = [p[0] for p in pts if not p[2]], [p[1] for p in pts if not p[2]]
        ax.plot(xs, ys, line, color=color, marker=marker, label=label, linewidth=2, markersize=7)
        for x, y, killed in pts:
            if killed:
                ax.plot([x], [y], "x", color=color, markersize=14, markeredgewidth=3)
                ax.annotate("killed at %.1f GiB (the limit)" % y, (x, y), textcoords="offset points", xytext=(-12, -4),
                            ha="right", va="top", color=color, fontsize=9)
    shown = set()
    for x, t, mem, what in _others(cases):
        marker = "s" if what.startswith("ZeRO-2") else ("h" if "moments" in what else "o")
        ax.plot([x], [t if field == "time" else mem], marker, mfc="none", color="#1f77b4", markersize=11,
                markeredgewidth=1.5, label=None if what in shown else "dsfix convert, " + what)
        shown.add(what)
    ax.set_xlabel("parameters (billions; Qwen3 0.6B, 1.7B, 4B, 8B shapes)")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)


def draw(cases, path, guess=None):
    """Writes the PNG; returns one line saying where (or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    _panel(left, cases, "time")
    left.set_ylabel("seconds")
    left.set_title("Wall time, cold page cache, one method at a time")
    _panel(right, cases, "memory")
    right.axhline(1.0, color="#1f77b4", linestyle=":", linewidth=1)
    right.annotate("1 GiB", (0.1, 1.0), textcoords="offset points", xytext=(0, 3), fontsize=8, color="#1f77b4")
    right.set_ylabel("peak anonymous memory of the process tree (GiB)")
    right.set_title("Peak anonymous memory: convert and verify stay under 1 GiB")
    left.legend(loc="upper left", fontsize=9)
    note = ("lines: ZeRO-3, 8 ranks, synthetic bf16 checkpoints (fp32 masters); one method at a time; "
            "x: killed by the benchmark's memory limit; the floor's memory is ~0")
    runs = {r for c in cases for r in c.get("runs", [])}
    if runs:
        note += ("\nwhere a case was measured again, its later run's methods are shown; one marked as an earlier run "
                 "was not measured again (docs/benchmarks.md)")
    if guess:
        note += ("\nextrapolated from these lines, not measured: converting 70B needs about %.1f GiB and %.1fx the "
                 "disk floor's time" % (guess["anon_gib"], guess["ratio"]))
    fig.text(0.5, 0.01, note, ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "plot: %s" % path
