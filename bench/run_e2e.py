"""End-to-end comparison against PyTorch DDP over an emulated WAN, in one command:

    .venv/bin/python bench/run_e2e.py --rates 100mbit,500mbit,1gbit --steps 8

For each rate (stellarun --wan RATE, 2 clusters of 2 ranks) it runs bench/e2e_train.py under
DDP (gloo, flat), stella_mpi dense hierarchical, stella_mpi sparse with each compressor, and
the CPU engine (staleness 1), on the communication-heavy workload; it writes
bench/results/e2e.json and prints step time (median after the first step), WAN bytes per step
and the ratio to DDP measured in the same run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["ddp", "dense", "sparse:cacheaware", "sparse:topk", "sparse:threshold", "sparse:randomk", "cpu:cacheaware"]


def run_one(rate, mode, args, tmp):
    out = os.path.join(tmp, "%s_%s.json" % (rate, mode.replace(":", "_")))
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--wan", rate, "--timeout", "900", sys.executable,
           os.path.join(HERE, "e2e_train.py"), "--mode", mode, "--workload", args.workload, "--steps", str(args.steps),
           "--density", str(args.density), "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"mode": mode, "error": (proc.stdout + proc.stderr)[-2000:]}
    with open(out) as f:
        return json.load(f)


def summarize(res):
    recs = res["records"][1:] or res["records"]
    wan = [r["wan_bytes_rank"] for r in recs if r["wan_bytes_rank"] is not None]
    return {"step_s": statistics.median(r["step_s"] for r in recs),
            "wan_mb_per_rank_step": statistics.median(wan) / 1e6 if wan else None,
            "final_loss": res["records"][-1]["loss"], "validation_loss": res["validation_loss"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="100mbit,500mbit,1gbit")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workload", default="comm", choices=["comm", "lm"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--timeout", type=int, default=1800)
    args = p.parse_args()
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates.split(","):
            for mode in args.modes.split(","):
                print("running %s at %s ..." % (mode, rate), flush=True)
                res = run_one(rate, mode, args, tmp)
                table.setdefault(rate, {})[mode] = summarize(res) if "error" not in res else res
    print("\n%-10s %-20s %10s %10s %14s %12s" % ("rate", "mode", "step ms", "vs DDP", "WAN MB/rank", "final loss"))
    for rate, rows in table.items():
        ddp = rows.get("ddp", {}).get("step_s")
        for mode, r in rows.items():
            if "error" in r:
                print("%-10s %-20s failed: %s" % (rate, mode, r["error"][-300:]))
                continue
            print("%-10s %-20s %10.1f %9.2fx %14s %12.4f" % (
                rate, mode, 1000 * r["step_s"], (ddp / r["step_s"]) if ddp else float("nan"),
                "%.3f" % r["wan_mb_per_rank_step"] if r["wan_mb_per_rank_step"] is not None else "-", r["final_loss"]))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "e2e.json"), "w") as f:
        json.dump({"args": vars(args), "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
