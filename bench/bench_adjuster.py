"""The adjuster against fixed densities and DDP over one WAN schedule, in one command:

    .venv/bin/python bench/bench_adjuster.py          # 2 ranks (one per cluster and core), 300 steps
    .venv/bin/python bench/bench_adjuster.py --np 4   # 2 clusters of 2 ranks (4 ranks share 2 cores here)

Each mode runs bench/e2e_train.py (the byte LM, 2 clusters of --np/2 ranks, stellarun --wan 500mbit
--wan-schedule SCHEDULE): "adapt:cacheaware" (hvd.Adjuster between --min-density and
--max-density), "sparse:cacheaware" at each fixed density of --fixed, and "ddp". Reported per
mode: time to the target loss (the loss every mode reaches, unless --target-loss), median step
time in each phase of the schedule, and the step time over compute time; the adaptive run also
reports, after each rate change, how many steps until step time is back within --target
(default 1.3) times its compute time (for fixed densities a reference only). Writes
bench/results/adjuster.json and, if matplotlib is importable, bench/results/adjuster.png.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from provenance import provenance

HERE = os.path.dirname(os.path.abspath(__file__))


def run_mode(mode, density, args, tmp, trace_out=None):
    out = os.path.join(tmp, "%s_%s.json" % (mode.replace(":", "_"), density))
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", str(args.np), "--clusters", "2", "--wan", args.start_rate, "--wan-schedule", args.schedule,
           "--timeout", "900", sys.executable, os.path.join(HERE, "e2e_train.py"), "--mode", mode,
           "--workload", "lm", "--hidden", str(args.hidden), "--steps", str(args.steps), "--density", str(density),
           "--min-density", str(args.min_density), "--max-density", str(args.max_density),
           "--target", str(args.target), "--out", out]
    if trace_out:
        cmd += ["--decisions-out", out + ".decisions"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    with open(out) as f:
        res = json.load(f)
    # the launcher prints the schedule's changes; map them onto the run's clock
    res["launcher_output"] = [line for line in proc.stdout.splitlines() if "WAN rate now" in line]
    # the step during which each rate change happened (the launcher prints the change's unix time)
    changes = [float(m.group(1)) for m in re.finditer(r"unix time ([0-9.]+)", proc.stdout)]
    res["rate_change_steps"] = [next((r["step"] for r in res["records"] if res["t0_unix"] + r["elapsed_s"] >= c),
                                     None) for c in changes]
    if trace_out:
        write_trace(out + ".decisions.rank0", cmd, trace_out)
    return res


def write_trace(decisions_file, cmd, path):
    """The adaptive run's gathered telemetry and decisions, in the form tests/unit/test_adjuster.py
    replays (tests/data/adjuster_trace.json)."""
    with open(decisions_file) as f:
        d = json.load(f)
    with open(path, "w") as f:
        json.dump({"source": " ".join(["stellarun"] + cmd[1:]) + " (rank 0)",
                   "provenance": d.get("provenance") or provenance(), "settings": d["settings"],
                   "overlap": d["overlap"], "start_density": d["start_density"], "windows": d["trace"]}, f)


def smoothed(records, k=5):
    losses = [r["loss"] for r in records]
    return [statistics.mean(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]


def time_to(records, target):
    for r, s in zip(records, smoothed(records)):
        if s <= target:
            return r["elapsed_s"]
    return None


def recovery_steps(records, change_steps, ratio):
    """Steps after each change until step time is within ``ratio`` of compute time."""
    out = []
    for c in change_steps:
        n = None
        for r in records:
            if r["step"] > c and r["step_s"] <= ratio * r["compute_s"]:
                n = r["step"] - c
                break
        out.append(n)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="ranks, in 2 clusters")
    p.add_argument("--start-rate", default="500mbit")
    p.add_argument("--schedule", default="10:100mbit,25:500mbit", help="SECONDS:RATE after launch")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--fixed", default="0.001,0.01,0.1", help="fixed densities to compare")
    p.add_argument("--min-density", type=float, default=1e-3)
    p.add_argument("--max-density", type=float, default=0.1)
    p.add_argument("--target", type=float, default=1.3, help="adjuster target (step time / compute time)")
    p.add_argument("--record-trace", help="write the adaptive run's telemetry and decisions here "
                                          "(the form of tests/data/adjuster_trace.json)")
    p.add_argument("--target-loss", type=float)
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--timeout", type=int, default=1200)
    args = p.parse_args()
    runs = [("adapt:cacheaware", args.max_density)] + [("sparse:cacheaware", float(d)) for d in args.fixed.split(",")]
    if not args.no_ddp:
        runs.append(("ddp", 0.0))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, d in runs:
            label = mode if mode != "sparse:cacheaware" else "fixed %g" % d
            print("running %s ..." % label, flush=True)
            results[label] = run_mode(mode, d, args, tmp, args.record_trace if mode.startswith("adapt") else None)
    ok = {}
    for label, res in results.items():
        if "error" in res:
            print("%s failed: %s" % (label, res["error"][-500:]))
        else:
            ok[label] = res
    target = args.target_loss or max(min(smoothed(v["records"])) for v in ok.values())
    summary = {}
    for label, res in ok.items():
        recs = res["records"][1:]
        summary[label] = {
            "time_to_target_s": time_to(res["records"], target),
            "median_step_s": statistics.median(r["step_s"] for r in recs),
            "median_step_over_compute": statistics.median(r["step_s"] / r["compute_s"] for r in recs),
            "final_loss": res["records"][-1]["loss"], "validation_loss": res["validation_loss"],
        }
        if label.startswith("adapt"):
            dens = [r["density"] for r in res["records"]]
            changes = [r["step"] for prev, r in zip(res["records"], res["records"][1:])
                       if r["density"] != prev["density"]]
            summary[label]["density_changes_at_steps"] = changes
            summary[label]["recovery_steps_after_density_changes"] = recovery_steps(res["records"], changes, args.target)
            summary[label]["densities"] = sorted(set(dens))
        cuts = [c for c in res["rate_change_steps"] if c is not None]
        summary[label]["rate_change_steps"] = res["rate_change_steps"]
        summary[label]["median_step_by_phase_s"] = [
            statistics.median(r["step_s"] for r in recs if lo < r["step"] <= hi) if any(
                lo < r["step"] <= hi for r in recs) else None
            for lo, hi in zip([0] + cuts, cuts + [len(res["records"])])]
        summary[label]["recovery_steps_after_rate_changes"] = recovery_steps(res["records"], cuts, args.target)
    print("\ntarget loss %.4f (5-step mean)" % target)
    print("%-18s %12s %12s %14s %10s" % ("mode", "to target s", "step ms", "step/compute", "val loss"))
    for label, s in summary.items():
        tt = "%.1f" % s["time_to_target_s"] if s["time_to_target_s"] is not None else "-"
        print("%-18s %12s %12.1f %14.2f %10.4f" % (label, tt, 1000 * s["median_step_s"],
                                                  s["median_step_over_compute"], s["validation_loss"]))
    for label, s in summary.items():
        print("%s: WAN rate changed during steps %s; median step by phase %s ms; steps until step <= %gx compute "
              "after each: %s" % (label, s["rate_change_steps"],
                                  [round(1000 * m) if m is not None else None for m in s["median_step_by_phase_s"]],
                                  args.target, s["recovery_steps_after_rate_changes"]))
        if "density_changes_at_steps" in s:
            print("%s: density changes at steps %s; steps until step <= target x compute after each: %s"
                  % (label, s["density_changes_at_steps"], s["recovery_steps_after_density_changes"]))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "adjuster.json"), "w") as f:
        json.dump({"args": vars(args), "provenance": provenance(), "target_loss": target, "summary": summary,
                   "runs": {k: v.get("records", v) for k, v in results.items()},
                   "wan_changes": {k: v.get("launcher_output") for k, v in ok.items()}}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (bench/results/adjuster.json has the data)")
        return
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for label, res in ok.items():
        t = [r["elapsed_s"] for r in res["records"]]
        axes[0].plot(t, [r["step_s"] for r in res["records"]], label=label)
        axes[1].plot(t, smoothed(res["records"]), label=label)
        if label.startswith("adapt"):
            axes[2].plot(t, [r["density"] for r in res["records"]], label=label)
    axes[0].set_ylabel("step time (s)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("loss (5-step mean)")
    axes[1].axhline(target, color="grey", linestyle=":")
    axes[2].set_ylabel("density")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds since training start")
    axes[0].legend()
    fig.savefig(os.path.join(HERE, "results", "adjuster.png"), dpi=100)
    print("plot: bench/results/adjuster.png")


if __name__ == "__main__":
    main()
