"""The time-to-loss table of scripts/gpu_train.sh's runs (the byte-level LM with CUDA tensors,
2 clusters sharing one GPU, the cross-cluster link paced): per mode the steps, step time, WAN
bytes, final held-out loss and the training seconds to reach the target (dense's final loss
unless --target), with dense's time over each mode's.

    python bench/gpu_time_to_loss.py DIR [DIR ...] [--target LOSS] [--out table.json]
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from wan_main_job import time_to  # noqa: E402  (one definition of "time to a loss")
from provenance import provenance  # noqa: E402


def table(folder, target=None):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            r = json.load(f)
        if "curve" in r:
            runs[os.path.splitext(os.path.basename(path))[0]] = r
    if target is None:
        if "dense" not in runs:
            raise SystemExit("%s: no dense.json to take the target from; give --target" % folder)
        target = runs["dense"]["validation_loss"]
    t_dense = time_to(runs["dense"]["curve"], target) if "dense" in runs else None
    rows = {}
    for mode, r in runs.items():
        t = time_to(r["curve"], target)
        rows[mode] = {"steps": r["steps"], "ms_per_step": r["ms_per_step"], "final_loss": r["validation_loss"],
                      "wan_mb_per_step": r["wan_bytes_sent_per_step"] / 1e6, "seconds": r["seconds"],
                      "time_to_target_s": t, "dense_over_this": (t_dense / t) if (t and t_dense) else None}
    return {"folder": folder, "target_loss": target, "modes": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+")
    p.add_argument("--target", type=float, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = [table(d, args.target) for d in args.folders]
    for t in out:
        print("\n%s: target held-out loss %.4f" % (t["folder"], t["target_loss"]))
        print("%-11s %6s %8s %10s %10s %12s %10s" % ("mode", "steps", "ms/step", "WAN MB/st", "final loss",
                                                    "to target", "dense/this"))
        for mode, r in t["modes"].items():
            tt = r["time_to_target_s"]
            print("%-11s %6d %8.1f %10.3f %10.4f %12s %10s" % (
                mode, r["steps"], r["ms_per_step"], r["wan_mb_per_step"], r["final_loss"],
                "%.1f s" % tt if tt is not None else "not reached",
                "%.1fx" % r["dense_over_this"] if r["dense_over_this"] else "-"))
    if args.out:
        with open(args.out, "w") as f:
            # provenance: the machine and versions that made this table (each run's own JSON names its GPU)
            json.dump({"command": " ".join(sys.argv), "provenance": provenance(), "tables": out}, f, indent=1)


if __name__ == "__main__":
    main()
