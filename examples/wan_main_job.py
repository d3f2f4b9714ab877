"""The main job: two clusters of two ranks on this machine, joined by an emulated WAN link,
training the byte-level language model twice with the same seed and steps -- first with
stella_mpi's sparse cross-cluster exchange (1 % density, cache-aware selection, error
feedback), then with dense gradients over the same link -- and a side-by-side summary.

    python examples/wan_main_job.py [--wan 100mbit] [--steps 100]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(label, extra, args, out):
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--wan", args.wan, "--timeout", "300", sys.executable,
           os.path.join(HERE, "train_horovod.py"), "--steps", str(args.steps), "--log-every", str(args.log_every),
           "--hidden", str(args.hidden), "--optimizer", "sgd", "--lr", "0.05", "--json-out", out] + extra
    print("\n=== %s ===\n%s" % (label, " ".join(cmd[1:])), flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise SystemExit("%s run failed (exit %d)" % (label, proc.returncode))
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wan", default="100mbit")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--density", type=float, default=0.01)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sparse = run("stella_mpi sparse: cacheaware, %g %% density, error feedback" % (100 * args.density),
                     ["--compression", "cacheaware", "--density", str(args.density)], args,
                     os.path.join(tmp, "sparse.json"))
        dense = run("dense hierarchical allreduce (what Horovod sends)", ["--compression", "none"], args,
                    os.path.join(tmp, "dense.json"))
    print("\n=== %d steps, 4 ranks in 2 clusters, %.1fM parameters, WAN %s ===" % (
        args.steps, sparse["parameters"] / 1e6, args.wan))
    print("%-34s %12s %16s %16s" % ("", "ms/step", "WAN MB/step", "validation loss"))
    for label, r in (("sparse (stella_mpi, %g %%)" % (100 * args.density), sparse), ("dense", dense)):
        print("%-34s %12.1f %16.3f %16.4f" % (label, r["ms_per_step"], r["wan_bytes_sent_per_step"] / 1e6,
                                              r["validation_loss"]))
    print("sparse steps %.1fx faster and sends %.0fx fewer bytes across the WAN; loss after the same steps "
          "%+.1f %% vs dense" % (dense["ms_per_step"] / sparse["ms_per_step"],
                                 dense["wan_bytes_sent_per_step"] / max(sparse["wan_bytes_sent_per_step"], 1),
                                 100 * (sparse["validation_loss"] / dense["validation_loss"] - 1)))


if __name__ == "__main__":
    main()
