"""End-to-end comparison against PyTorch DDP over an emulated WAN, in one command:

    .venv/bin/python bench/run_e2e.py                 # both workloads at 100 Mbit/s, 500 Mbit/s, 1 Gbit/s
    .venv/bin/python bench/run_e2e.py --workloads comm --rates 100mbit --steps 8

For each workload and rate (stellarun --wan RATE, 2 clusters of 2 ranks) it runs
bench/e2e_train.py under: compute only (each rank's own training step -- forward, backward,
the optimizer -- with no exchange: the compute time alone), DDP (gloo,
flat), stella_mpi dense hierarchical, stella_mpi sparse with each compressor, and the CPU
engine (staleness 1). Workloads: "comm", a 25M-parameter MLP with a small batch (step time);
"lm", the byte-level language model on the standard library's sources, run until the
training loss reaches --target-loss (time to the target loss).

It prints a table of step time (median after the first step, from one step's end to the next;
"wall": the mean, outliers included), WAN bytes per step, the limit
max(compute time alone, compressed bytes / link rate) and the step time against it, time to
the target loss, and every ratio against DDP measured in the same run; it writes
bench/results/e2e.json and, where matplotlib is installed (pip install -r bench/requirements.txt),
e2e_loss_vs_time.png and e2e_step_time.png next to it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from progress import Progress
from provenance import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
MODES = {"comm": ["compute", "ddp", "dense", "sparse:cacheaware", "sparse:topk", "sparse:threshold",
                  "sparse:randomk", "cpu:cacheaware"],
         "lm": ["compute", "ddp", "dense", "sparse:cacheaware", "sparse:topk", "cpu:cacheaware"]}


def run_one(workload, rate, mode, args, tmp):
    out = os.path.join(tmp, "%s_%s_%s.json" % (workload, rate, mode.replace(":", "_")))
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--wan", rate, "--timeout", "900", sys.executable,
           os.path.join(HERE, "e2e_train.py"), "--mode", mode, "--workload", workload, "--density", str(args.density),
           "--out", out]
    if workload == "comm":
        cmd += ["--steps", str(args.steps)]
    elif mode == "compute":   # unsynchronised replicas: only the step time is used, not the loss
        cmd += ["--steps", "60"]
    else:
        cmd += ["--steps", str(args.lm_max_steps), "--target-loss", str(args.target_loss),
                "--window", str(args.window)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"mode": mode, "error": (proc.stdout + proc.stderr)[-2000:]}
    with open(out) as f:
        return json.load(f)


def summarize(res):
    recs = res["records"][1:] or res["records"]
    wan = [r["wan_bytes_all"] for r in recs if r["wan_bytes_all"] is not None]
    clusters = res.get("clusters") or 2
    reached = res.get("reached")
    curve = res["records"]
    return {"step_s": statistics.median(r["step_s"] for r in recs),
            # mean wall clock per step after the first, outliers included
            "wall_step_s": (curve[-1]["elapsed_s"] - curve[0]["elapsed_s"]) / max(len(curve) - 1, 1),
            "wan_mb_per_cluster_step": statistics.median(wan) / clusters / 1e6 if wan else None,
            "final_loss": res["records"][-1]["loss"], "validation_loss": res["validation_loss"],
            "steps": len(res["records"]), "time_to_target_s": reached["elapsed_s"] if reached else None,
            "steps_to_target": reached["step"] if reached else None,
            "curve": [(r["elapsed_s"], r["loss"]) for r in res["records"]]}


def add_ratios(rows, rate_bps):
    """Ratios against DDP and the limit max(compute alone, bytes per cluster / link rate)."""
    ddp, compute = rows.get("ddp", {}), rows.get("compute", {})
    for mode, r in rows.items():
        if "error" in r:
            continue
        if ddp.get("step_s"):
            r["speedup_vs_ddp"] = ddp["step_s"] / r["step_s"]
        if ddp.get("time_to_target_s") and r.get("time_to_target_s"):
            r["time_to_target_vs_ddp"] = ddp["time_to_target_s"] / r["time_to_target_s"]
        if compute.get("step_s") and r["wan_mb_per_cluster_step"] is not None and mode != "compute":
            link_s = r["wan_mb_per_cluster_step"] * 1e6 * 8 / rate_bps
            r["limit_s"] = max(compute["step_s"], link_s)
            r["step_vs_limit"] = r["step_s"] / r["limit_s"]


def fmt(v, pattern, missing="-"):
    return pattern % v if v is not None else missing


def print_table(table):
    print("\n%-5s %-8s %-18s %9s %9s %8s %10s %9s %8s %9s %8s %10s" % (
        "work", "rate", "mode", "step ms", "wall ms", "vs DDP", "WAN MB/cl", "limit ms", "/limit", "to target", "vs DDP",
        "final loss"))
    for workload, rates in table.items():
        for rate, rows in rates.items():
            for mode, r in rows.items():
                if "error" in r:
                    print("%-5s %-8s %-18s failed: %s" % (workload, rate, mode, r["error"][-300:]))
                    continue
                print("%-5s %-8s %-18s %9.1f %9.1f %8s %10s %9s %8s %9s %8s %10.4f" % (
                    workload, rate, mode, 1000 * r["step_s"], 1000 * r["wall_step_s"], fmt(r.get("speedup_vs_ddp"), "%.2fx"),
                    fmt(r["wan_mb_per_cluster_step"], "%.3f"), fmt(r.get("limit_s") and 1000 * r["limit_s"], "%.1f"),
                    fmt(r.get("step_vs_limit"), "%.2fx"), fmt(r.get("time_to_target_s"), "%.1fs"),
                    fmt(r.get("time_to_target_vs_ddp"), "%.2fx"), r["final_loss"]))


def plot(table, args):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plots: matplotlib is not installed (pip install -r bench/requirements.txt)")
        return []
    written = []
    for workload, rates in table.items():
        fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
        for ax, (rate, rows) in zip(axes[0], rates.items()):
            if workload == "lm":
                for mode, r in rows.items():
                    if "error" not in r and mode != "compute":
                        ax.plot([t for t, _ in r["curve"]], [l for _, l in r["curve"]], label=mode)
                ax.axhline(args.target_loss, color="grey", linestyle=":", label="target")
                ax.set_xscale("log")
                ax.set_xlabel("wall-clock s")
                ax.set_ylabel("training loss")
            else:
                ok = [(m, r) for m, r in rows.items() if "error" not in r]
                ax.bar(range(len(ok)), [1000 * r["step_s"] for _, r in ok])
                ax.set_xticks(range(len(ok)), [m for m, _ in ok], rotation=45, ha="right")
                ax.set_yscale("log")
                ax.set_ylabel("step time ms")
            ax.set_title("%s, %s" % (workload, rate))
            if workload == "lm":
                ax.legend(fontsize=7)
        fig.tight_layout()
        name = os.path.join(RESULTS, "e2e_loss_vs_time.png" if workload == "lm" else "e2e_step_time.png")
        fig.savefig(name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="comm,lm")
    p.add_argument("--rates", default="100mbit,500mbit,1gbit")
    p.add_argument("--modes", help="comma-separated modes for every workload (default: each workload's list)")
    p.add_argument("--steps", type=int, default=8, help="steps of the comm workload")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--target-loss", type=float, default=2.6, help="lm workload: stop at this windowed loss")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--lm-max-steps", type=int, default=600)
    p.add_argument("--timeout", type=int, default=3600)
    args = p.parse_args()
    from stellarun.shaping import parse_rate
    table = {}
    modes_of = {w: (args.modes.split(",") if args.modes else MODES[w]) for w in args.workloads.split(",")}
    progress = Progress(sum(len(m) for m in modes_of.values()) * len(args.rates.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            for rate in args.rates.split(","):
                rows = table.setdefault(workload, {}).setdefault(rate, {})
                for mode in modes_of[workload]:
                    label = "%s %s at %s" % (workload, mode, rate)
                    print("running %s ..." % label, flush=True)
                    progress.start(label)
                    res = run_one(workload, rate, mode, args, tmp)
                    progress.end(label, failed="error" in res)
                    rows[mode] = summarize(res) if "error" not in res else res
                add_ratios(rows, parse_rate(rate))
    print_table(table)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "e2e.json"), "w") as f:
        json.dump({"args": vars(args), "provenance": provenance(), "table": table}, f, indent=1)
    for name in plot(table, args):
        print("wrote", name)


if __name__ == "__main__":
    main()
