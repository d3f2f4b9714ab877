"""Check ``stellarun plan`` against measured runs on this machine: one calibration, then for each
configuration (ranks, clusters, link rate, route) the planner's prediction and a real run of
examples/train_horovod.py under ``stellarun --wan`` with the same model, global batch and
optimizer; step time (the steady part: the second half of the run) and time to the target
loss, predicted against measured.

    python bench/plan_validation.py [--quick] [--out bench/results/plan_validation_32.json]

On this machine ranks share two cores, which ranks of GPU kinds never do, so each layout
(ranks, clusters) is calibrated at its own ranks, over loopback (no WAN), as ``stellarun plan``
calibrates clusters of the kind ``here``; the link's goodput over its nominal rate is measured
across the emulated link at 100 Mbit/s for each number of clusters (the probe is an MPI all-reduce
over them, as THC's and dense's exchanges are). What is predicted is the rest: the WAN's bytes,
messages and time at each rate, the route's CPU work, the steps to the target.

Targets (issue 32): step time median absolute error <= 10 %, worst <= 25 %; time to target worst
<= 30 %.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from provenance import provenance  # noqa: E402

MODEL = os.path.join(ROOT, "examples", "plan_model.py")
TRAIN = os.path.join(ROOT, "examples", "train_horovod.py")

# (ranks, clusters, link, route): 2-8 ranks, 1-4 clusters, 20 Mbit/s - 1 Gbit/s, six routes
CONFIGS = [
    (2, 2, "100mbit", "dense"),
    (2, 2, "20mbit", "topk-1%"),
    (2, 2, "1gbit", "local-8-thc4"),
    (4, 1, None, "dense"),
    (4, 2, "1gbit", "dense"),
    (4, 2, "100mbit", "thc-4"),
    (4, 2, "20mbit", "cacheaware-1%"),
    (4, 4, "100mbit", "topk-1%"),
    (4, 4, "20mbit", "local-8-thc4"),
    (3, 3, "20mbit", "thc-4"),
    (6, 3, "100mbit", "fp16"),
    (8, 2, "100mbit", "cacheaware-1%"),
    (8, 4, "1gbit", "thc-4"),
    (8, 4, "20mbit", "local-32-thc4"),
    # issue 31's routes: SparseLoCo's pseudo-gradient (outer sum) and Streaming DiLoCo's fragments
    (2, 2, "20mbit", "local-8-sparseloco1"),
    (4, 2, "100mbit", "local-8-sparseloco1"),
    (4, 2, "100mbit", "local-8-f4-thc4"),
]

TRAIN_ARGS = {
    "dense": ["--compression", "none"],
    "fp16": ["--compression", "fp16"],
    "topk-1%": ["--compression", "topk", "--density", "0.01"],
    "cacheaware-1%": ["--compression", "cacheaware", "--density", "0.01"],
    "thc-4": ["--compression", "thc", "--bits", "4"],
    "local-8-thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "8"],
    "local-32-thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "32"],
    "local-8-sparseloco1": ["--compression", "sparseloco", "--density", "0.01", "--bits", "2", "--feedback-decay", "0.95",
                            "--local-steps", "8", "--outer", "sum"],
    "local-8-f4-thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "8", "--fragments", "4",
                        "--fragment-delay", "1"],
}


def stellarun(args, timeout):
    cmd = [sys.executable, "-m", "stellarun"] + args
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout)
    if proc.returncode:
        raise SystemExit("failed (exit %d): %s" % (proc.returncode, " ".join(cmd)))


def spec_for(ranks, clusters, link, route, base):
    from stella_mpi.plan.wire import layout
    per = layout(ranks, clusters)
    from stellarun.shaping import burst_bytes
    return dict(base, clusters=[{"count": n, "kind": "here", "link": 1e12 if link is None else parse_rate(link)}
                                for n in per], routes=route,
                link_burst_bytes=burst_bytes(parse_rate(link)) if link else 0)   # stellarun's tbf


def parse_rate(text):
    from stellarun.shaping import parse_rate as p
    return p(text)


def steady_step_s(curve):
    """Seconds per step over the second half of the run (past warm-ups)."""
    last = curve[-1]
    mid = min(curve, key=lambda p: abs(p["step"] - last["step"] / 2))
    return (last["seconds"] - mid["seconds"]) / max(last["step"] - mid["step"], 1)


def time_to(curve, target):
    prev = None
    for p in curve:
        if p["validation_loss"] <= target:
            if prev is None:
                return p["seconds"]
            f = (prev["validation_loss"] - target) / (prev["validation_loss"] - p["validation_loss"])
            return prev["seconds"] + f * (p["seconds"] - prev["seconds"])
        prev = p
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=96)
    ap.add_argument("--target-loss", type=float, default=2.6)
    ap.add_argument("--quality-steps", type=int, default=240)
    ap.add_argument("--calibrations", help="a folder of calibrations to reuse (and keep)")
    ap.add_argument("--only", type=int, nargs="*", help="configuration indices to run")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_validation_32.json"))
    args = ap.parse_args()
    from stella_mpi.plan.gpus import load_table
    from stella_mpi.plan.report import plan
    work = tempfile.mkdtemp(prefix="plan-validation-")
    table = load_table()
    base = {"model": {"source": MODEL, "args": {"hidden": str(args.hidden)}}, "global_batch": args.global_batch,
            "target_loss": args.target_loss, "target_steps": None, "budget_hours": None, "commit_every": 100,
            "quality_steps": args.quality_steps, "gpu_table": None, "link_delay_s": 0.0, "cores": None,
            "fusion_threshold_mb": None, "routes": ",".join(sorted({c[3] for c in CONFIGS}))}
    # the link's goodput over its nominal rate, for a transfer and for an MPI all-reduce over all
    # clusters (the automatic route's probe), measured across the emulated link at 100 Mbit/s,
    # one rank per cluster, for each number of clusters the configurations use
    efficiency = {}
    for nclusters in sorted({c[1] for c in CONFIGS if c[2]}):
        link_path = os.path.join(args.calibrations or work, "link_%d.json" % nclusters)
        if not os.path.exists(link_path):
            spec_path = os.path.join(work, "link_spec_%d.json" % nclusters)
            with open(spec_path, "w") as f:
                json.dump(dict(base, routes="dense", quality_steps=2, target_loss=None, provenance=provenance(),
                               clusters=[{"count": 1, "kind": "here", "link": 1e8}] * nclusters), f)
            stellarun(["-np", str(nclusters), "--clusters", str(nclusters), "--quiet", "--wan", "100mbit",
                       sys.executable, "-m", "stella_mpi.plan", "calibrate", "--spec", spec_path, "--out", link_path],
                      timeout=600)
        with open(link_path) as f:
            measured = json.load(f)["link"]
        efficiency[nclusters] = {"link_efficiency": measured["efficiency"],
                                 "allreduce_efficiency": measured["allreduce_efficiency"]}
        print("%d clusters: goodput over nominal %.3f (a transfer), %.3f (an all-reduce over them)"
              % (nclusters, measured["efficiency"], measured["allreduce_efficiency"]), flush=True)
    # on this machine ranks share its two cores, so each layout is calibrated at its own ranks and
    # clusters (stellarun plan does the same for clusters of the kind 'here'), without a WAN
    calibs = {}
    for ranks, clusters in sorted({(c[0], c[1]) for i, c in enumerate(CONFIGS) if not args.only or i in args.only}):
        path = os.path.join(args.calibrations or work, "calibration_%dx%d.json" % (ranks, clusters))
        if not os.path.exists(path):
            spec_path = os.path.join(work, "spec_%dx%d.json" % (ranks, clusters))
            routes = sorted({c[3] for c in CONFIGS if c[:2] == (ranks, clusters)})
            if any(r.startswith("local") for r in routes):
                routes.append("thc-4")   # the pseudo-gradient's CPU work is measured on its synchronous route
            with open(spec_path, "w") as f:
                json.dump(dict(spec_for(ranks, clusters, None, ",".join(sorted(set(routes))), base),
                               provenance=provenance()), f)   # (the calibration records it)
            stellarun(["-np", str(ranks), "--clusters", str(clusters), "--quiet", sys.executable, "-m",
                       "stella_mpi.plan", "calibrate", "--spec", spec_path, "--out", path], timeout=1800)
        with open(path) as f:
            calibs[(ranks, clusters)] = json.load(f)
    rows = []
    for i, (ranks, clusters, link, route) in enumerate(CONFIGS):
        if args.only and i not in args.only:
            continue
        spec = dict(spec_for(ranks, clusters, link, route, base), **efficiency.get(clusters, {}))
        calib = calibs[(ranks, clusters)]
        pred = plan(spec, calib, table)["predictions"][0]
        steps_target = (calib["routes"][route].get("steps_to_target") or args.quality_steps)
        steps = int(math.ceil(steps_target * 1.25)) + 20
        out = os.path.join(work, "run%d.json" % i)
        cmd = ["-np", str(ranks), "--clusters", str(clusters), "--quiet", "--timeout", "300"]
        if link:
            cmd += ["--wan", link]
        if route in ("dense", "fp16"):
            cmd += ["--wan-route", "dense"]   # Horovod's route, not the automatic one
        cmd += [sys.executable, TRAIN, "--hidden", str(args.hidden), "--batch-size", str(args.global_batch // ranks),
                "--optimizer", "sgd", "--lr", "0.05", "--steps", str(steps), "--eval-every", "10", "--log-every",
                "1000", "--json-out", out] + TRAIN_ARGS[route]
        stellarun(cmd, timeout=1800)
        with open(out) as f:
            run = json.load(f)
        measured_step = steady_step_s(run["curve"])
        measured_t = time_to(run["curve"], args.target_loss)
        predicted_t = (pred.get("to_target") or {}).get("seconds")
        row = {"ranks": ranks, "clusters": clusters, "link": link or "none (one cluster)", "route": route,
               "predicted_step_s": pred["step_s"], "measured_step_s": measured_step,
               "step_error": pred["step_s"] / measured_step - 1.0,
               "predicted_time_to_target_s": predicted_t, "measured_time_to_target_s": measured_t,
               "time_error": (predicted_t / measured_t - 1.0) if predicted_t and measured_t else None,
               "predicted_wan_bytes_per_step": pred["wan_bytes_per_step"],
               "measured_wan_bytes_per_step": run["wan_bytes_sent_per_step"], "steps": run["steps"],
               "final_loss": run["validation_loss"]}
        rows.append(row)
        print("%d ranks / %d clusters / %s / %s: step %.1f ms predicted, %.1f measured (%+.0f%%); to target %s" % (
            ranks, clusters, row["link"], route, 1e3 * pred["step_s"], 1e3 * measured_step, 100 * row["step_error"],
            "%.1f s predicted, %.1f measured (%+.0f%%)" % (predicted_t, measured_t, 100 * row["time_error"])
            if row["time_error"] is not None else "predicted %s, measured %s" % (predicted_t, measured_t)),
            flush=True)
    errs = [abs(r["step_error"]) for r in rows]
    terrs = [abs(r["time_error"]) for r in rows if r["time_error"] is not None]
    summary = {"step_median_abs_error": statistics.median(errs) if errs else None,
               "step_worst_abs_error": max(errs) if errs else None,
               "time_to_target_worst_abs_error": max(terrs) if terrs else None,
               "time_to_target_configs": len(terrs), "configs": len(rows)}
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "command": "python bench/plan_validation.py", "summary": summary,
                   "link_efficiency": {str(k): v for k, v in efficiency.items()}, "configs": rows,
                   "calibrations": {"%dx%d" % k: {f: c[f] for f in ("link", "fabric_bps", "optimizer_s", "compute",
                                                                     "global_batch")} for k, c in calibs.items()}},
                  f, indent=1)
    print("written to %s" % args.out)


if __name__ == "__main__":
    main()
