"""The main job: two clusters of two ranks on this machine, joined by an emulated WAN link,
running the same Horovod training script (examples/train_horovod.py, only its import changed)
twice for the same wall-clock time and from the same seed -- first as it is, on stella_mpi's
automatic cross-cluster route (the adjuster chooses dense, a sparse density, THC bits or local
steps, and says so), then with ``stellarun --wan-route dense``: the dense gradients Horovod sends
-- and the comparison a user cares about: the route the automatic run took, the held-out loss
each reaches in the same time, the time each needs to reach a target loss, and a plot of loss
against wall-clock.

    python examples/wan_main_job.py [--wan 100mbit] [--seconds 60] [--plot PATH]

The target loss is the held-out loss dense reaches at the end of its time (or --target).
The plot (PNG, needs matplotlib: ``pip install stella_mpi[plot]``; without it a CSV is written)
goes to bench/results/main_job.png unless --plot says otherwise.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(label, extra, args, out, route="auto"):
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--wan", args.wan, "--wan-route", route, "--timeout", "300",
           sys.executable,
           os.path.join(HERE, "train_horovod.py"), "--time-budget", str(args.seconds), "--log-every",
           str(args.log_every), "--eval-seconds", str(args.eval_seconds), "--hidden", str(args.hidden), "--optimizer",
           "sgd", "--lr", "0.05", "--json-out", out] + extra
    print("\n=== %s ===\n%s" % (label, " ".join(cmd[1:])), flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise SystemExit("%s run failed (exit %d)" % (label, proc.returncode))
    with open(out) as f:
        return json.load(f)


def time_to(curve, target):
    """Training seconds at the first held-out evaluation at or below ``target`` (None: never)."""
    for point in curve:
        if point["validation_loss"] is not None and point["validation_loss"] <= target:
            return point["seconds"]
    return None


def plot(runs, path, title):
    """Held-out loss against training seconds, one line per run: a PNG (matplotlib), else a CSV."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = os.path.splitext(path)[0] + ".csv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["run", "seconds", "step", "train_loss", "validation_loss"])
            for label, r in runs:
                for p in r["curve"]:
                    w.writerow([label, p["seconds"], p["step"], p["train_loss"], p["validation_loss"]])
        return path, "matplotlib is not installed (pip install matplotlib): wrote the curves as CSV"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for label, r in runs:
        pts = [(p["seconds"], p["validation_loss"]) for p in r["curve"] if p["validation_loss"] is not None]
        ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=label)
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path, None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wan", default="100mbit")
    p.add_argument("--seconds", type=float, default=60.0, help="training wall-clock of each run")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-seconds", type=float, default=3.0, help="training seconds between held-out evaluations")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--target", type=float, default=None, help="target held-out loss (default: dense's final)")
    p.add_argument("--plot", default=os.path.join(ROOT, "bench", "results", "main_job.png"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        auto = run("the Horovod script as it is: stella_mpi's automatic route", ["--compression", "none"], args,
                   os.path.join(tmp, "auto.json"))
        dense = run("the same script with --wan-route dense (what Horovod sends)", ["--compression", "none"], args,
                    os.path.join(tmp, "dense.json"), route="dense")
    target = args.target if args.target is not None else dense["validation_loss"]
    seconds = args.seconds
    labels = ("automatic route", "dense")
    print("\n=== %.0f s of training each, 4 ranks in 2 clusters, %.1fM parameters, WAN %s ===" % (
        args.seconds, auto["parameters"] / 1e6, args.wan))
    print("the automatic route took:")
    for step, route, why in auto.get("route_changes") or []:
        print("  from step %d: %s (%s)" % (step, route, why))
    # each run stops at the first agreed clock reading past the budget (within about a step)
    print("%-28s %7s %9s %12s %16s %22s" % ("", "steps", "ms/step", "WAN MB/step", "held-out loss",
                                             "time to loss %.4f" % target))
    reached = {}
    for label, r in zip(labels, (auto, dense)):
        reached[label] = time_to(r["curve"], target)
        print("%-28s %7d %9.1f %12.3f %16.4f %22s" % (
            label, r["steps"], r["ms_per_step"], r["wan_bytes_sent_per_step"] / 1e6, r["validation_loss"],
            "%.1f s" % reached[label] if reached[label] is not None else "not reached"))
    at_a, at_d = auto["validation_loss"], dense["validation_loss"]
    print("after %.0f s of training: held-out loss %.4f automatic vs %.4f dense (%+.1f %%); the automatic route sends "
          "%.0fx fewer bytes per step" % (seconds, at_a, at_d, 100 * (at_a / at_d - 1),
             dense["wan_bytes_sent_per_step"] / max(auto["wan_bytes_sent_per_step"], 1)))
    ta, td = reached[labels[0]], reached[labels[1]]
    if ta is not None and td is not None:
        print("time to held-out loss %.4f: automatic %.1f s, dense %.1f s (%.1fx sooner)" % (target, ta, td, td / ta))
    path, note = plot(list(zip(labels, (auto, dense))), args.plot,
                      "byte-level LM, 2 clusters x 2 ranks, WAN %s" % args.wan)
    if note:
        print(note)
    print("loss against wall-clock: %s" % path)


if __name__ == "__main__":
    main()
