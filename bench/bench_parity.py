"""Sparse training against dense at equal steps (issue 13's yardstick): the held-out loss of the
byte-level LM after the same steps, 4 ranks in 2 clusters, for dense (Horovod's numerics:
stellarun --wan-route dense) and each variant (the sparse compressors with this release's
defaults and without them, each option alone: momentum correction, masking, density warm-up,
singles beside cache-aware blocks, dense small tensors, local gradient clipping; THC at 2, 4
and 8 bits; local steps every 8; the CPU engine with its defaults and without; the automatic
route of the untouched script), in one run, with each loss's ratio to dense's.

    .venv/bin/python bench/bench_parity.py                                 # the convergence test's setting
    .venv/bin/python bench/bench_parity.py --hidden 1024 --lr 0.1 --steps 300   # issue 13's setting
    .venv/bin/python bench/bench_parity.py --variants dense topk topk+mc       # a subset

Losses do not depend on timing, so no WAN emulation is needed. Writes bench/results/parity.json
(``python bench/report.py`` draws it).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from progress import Progress
from provenance import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PLAIN = ["--momentum-correction", "off", "--density-warmup", "0"]   # the sparse route without this release's defaults


def slc(density, every, *more, bits="2", decay="0.95"):
    """Local steps every ``every`` with SparseLoCo's pseudo-gradient (outer average unless ``more``
    says otherwise)."""
    return ["--compression", "sparseloco", "--density", density, "--bits", bits, "--feedback-decay", decay,
            "--local-steps", str(every)] + list(more)


VARIANTS = {   # name: train_horovod.py options ("dense" runs with stellarun --wan-route dense: Horovod's numerics)
    "dense": ["--compression", "none"],
    "auto": ["--compression", "none"],    # the untouched script: the automatic route (it depends on the link)
    # the sparse compressors with their defaults: momentum correction (SGD), warm-up 50, cache-aware singles 0.7
    "topk": ["--compression", "topk"],
    "cacheaware": ["--compression", "cacheaware"],
    # the previous release's defaults, and each option alone
    "topk:plain": ["--compression", "topk"] + PLAIN,
    "cacheaware:blocks": ["--compression", "cacheaware", "--singles", "0"] + PLAIN,
    "topk+mc": ["--compression", "topk", "--momentum-correction", "on", "--density-warmup", "0"],
    "topk+mc+warmup50": ["--compression", "topk", "--momentum-correction", "on", "--density-warmup", "50"],
    "cacheaware+mc": ["--compression", "cacheaware", "--singles", "0", "--momentum-correction", "on",
                      "--density-warmup", "0"],
    "cacheaware+mc+masking": ["--compression", "cacheaware", "--singles", "0", "--momentum-correction", "masking",
                              "--density-warmup", "0"],
    "cacheaware+warmup50": ["--compression", "cacheaware", "--singles", "0", "--momentum-correction", "off",
                            "--density-warmup", "50"],
    "cacheaware+mc+warmup50": ["--compression", "cacheaware", "--singles", "0", "--momentum-correction", "on",
                               "--density-warmup", "50"],
    "cacheaware+mc+dense_below1600": ["--compression", "cacheaware", "--singles", "0", "--momentum-correction", "on",
                                      "--density-warmup", "0", "--dense-below", "1600"],
    "cacheaware+mc+singles50": ["--compression", "cacheaware", "--momentum-correction", "on", "--singles", "0.5",
                                "--density-warmup", "0"],
    "cacheaware+mc+singles70": ["--compression", "cacheaware", "--momentum-correction", "on", "--singles", "0.7",
                                "--density-warmup", "0"],
    "cacheaware+mc+singles85": ["--compression", "cacheaware", "--momentum-correction", "on", "--singles", "0.85",
                                "--density-warmup", "0"],
    "topk+clip": ["--compression", "topk", "--local-clip", "CLIP"] + PLAIN,
    "topk+mc+clip": ["--compression", "topk", "--momentum-correction", "on", "--density-warmup", "0",
                     "--local-clip", "CLIP"],
    "thc2": ["--compression", "thc", "--bits", "2"],
    "thc4": ["--compression", "thc", "--bits", "4"],
    "thc8": ["--compression", "thc", "--bits", "8"],
    "local8": ["--compression", "none", "--local-steps", "8"],
    "diloco8": ["--compression", "none", "--local-steps", "8", "--outer", "nesterov"],
    "local8+topk": ["--compression", "topk", "--local-steps", "8"],
    "local8+thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "8"],
    "local8+thc2": ["--compression", "thc", "--bits", "2", "--local-steps", "8"],
    "local8+thc8": ["--compression", "thc", "--bits", "8", "--local-steps", "8"],
    "local16+thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "16"],
    # issue 31: the pseudo-gradient compressed SparseLoCo's way (chunked top-k, 2 bits) and DeMo's (DCT)
    "diloco8+thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "8", "--outer", "nesterov"],
    # the outer Nesterov's period H with THC 4-bit pseudo-gradients, and Streaming DiLoCo's schedule
    # (the adjuster's H rule: adjust/local_steps_rule.py)
    **{"diloco%d+thc4" % h: ["--compression", "thc", "--bits", "4", "--local-steps", str(h), "--outer", "nesterov"]
       for h in (2, 4, 16, 32, 64)},
    "diloco32+f4+delay3+thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "32", "--outer", "nesterov",
                                "--fragments", "4", "--fragment-delay", "3"],
    "diloco16+f4+delay3+thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "16", "--outer", "nesterov",
                                "--fragments", "4", "--fragment-delay", "3"],
    "diloco8+sparseloco1": ["--compression", "sparseloco", "--density", "0.01", "--bits", "2", "--local-steps", "8",
                            "--outer", "nesterov"],
    "local8+sparseloco1:ef95": ["--compression", "sparseloco", "--density", "0.01", "--bits", "2",
                                "--feedback-decay", "0.95", "--local-steps", "8"],
    "diloco8+sparseloco3": ["--compression", "sparseloco", "--density", "0.03", "--bits", "2", "--local-steps", "8",
                            "--outer", "nesterov"],
    # SparseLoCo's outer step, H, density, bits and chunk (issue 31): slc(density, H, *more)
    "local8+sparseloco1:ef95:olr1.5": slc("0.01", 8, "--outer", "sgd", "--outer-lr", "1.5"),
    "local8+sparseloco1:ef95:olr2": slc("0.01", 8, "--outer", "sgd", "--outer-lr", "2"),
    "local8+sparseloco1:ef95:olr2.5": slc("0.01", 8, "--outer", "sgd", "--outer-lr", "2.5"),
    "local8+sparseloco1:ef95:olr3": slc("0.01", 8, "--outer", "sgd", "--outer-lr", "3"),
    "local8+sparseloco1:olr2": slc("0.01", 8, "--outer", "sgd", "--outer-lr", "2", decay="1.0"),
    "diloco8+sparseloco1:ef95": slc("0.01", 8, "--outer", "nesterov"),
    "local8+thc4:sum": ["--compression", "thc", "--bits", "4", "--local-steps", "8", "--outer", "sum"],
    "local8+sparseloco3:ef95:sum": slc("0.03", 8, "--outer", "sum"),
    "local8+sparseloco1:ef95:sum": slc("0.01", 8, "--outer", "sum"),
    "local2+sparseloco1:ef95:sum": slc("0.01", 2, "--outer", "sum"),
    "local32+thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "32"],
    "local64+thc4": ["--compression", "thc", "--bits", "4", "--local-steps", "64"],
    "local32+sparseloco1:ef95:sum": slc("0.01", 32, "--outer", "sum"),
    "local64+sparseloco1:ef95:sum": slc("0.01", 64, "--outer", "sum"),
    "local32+sparseloco3:ef95:sum": slc("0.03", 32, "--outer", "sum"),
    # with local2/8/32 above: the sparse rungs' period cost (optim/tuning.py's SPARSE_SUM_PERIOD)
    "local16+sparseloco1:ef95:sum": slc("0.01", 16, "--outer", "sum"),
    "local2+sparseloco3:ef95:sum": slc("0.03", 2, "--outer", "sum"),
    "local16+sparseloco3:ef95:sum": slc("0.03", 16, "--outer", "sum"),
    "local64+sparseloco3:ef95:sum": slc("0.03", 64, "--outer", "sum"),
    "local8+sparseloco1:ef95:c16k": slc("0.01", 8, "--chunk", "16384"),
    "local8+sparseloco1:ef95:b4": slc("0.01", 8, bits="4"),
    "local8+f4": ["--compression", "none", "--local-steps", "8", "--fragments", "4"],
    "local8+f4+delay1": ["--compression", "none", "--local-steps", "8", "--fragments", "4", "--fragment-delay", "1"],
    "local8+f4+delay1+sparseloco1:ef95": ["--compression", "sparseloco", "--density", "0.01", "--bits", "2",
                                          "--feedback-decay", "0.95", "--local-steps", "8", "--fragments", "4",
                                          "--fragment-delay", "1"],
    "diloco8+dct1": ["--compression", "dct", "--density", "0.01", "--chunk", "1024", "--bits", "2", "--local-steps",
                     "8", "--outer", "nesterov"],
    # the CPU engine: its defaults (staleness 1, 150 synchronous steps first, stale prediction) with
    # each compressor's defaults; then the previous release's settings
    "cpu1": ["--compression", "cacheaware", "--engine", "cpu", "--staleness", "1"],
    "cpu1:topk": ["--compression", "topk", "--engine", "cpu", "--staleness", "1"],
    "cpu1:nodw": ["--compression", "cacheaware", "--engine", "cpu", "--staleness", "1", "--density-warmup", "0"],
    "cpu1:topk:nodw": ["--compression", "topk", "--engine", "cpu", "--staleness", "1", "--density-warmup", "0"],
    "cpu1:sw250": ["--compression", "cacheaware", "--engine", "cpu", "--staleness", "1", "--staleness-warmup", "250"],
    "cpu0:topk:plain": ["--compression", "topk", "--engine", "cpu", "--staleness", "0"] + PLAIN,
    "cpu1:topk:plain": ["--compression", "topk", "--engine", "cpu", "--staleness", "1", "--staleness-warmup", "0"]
    + PLAIN,
    "cpu1:topk+mc": ["--compression", "topk", "--engine", "cpu", "--staleness", "1", "--momentum-correction", "on",
                     "--staleness-warmup", "0"],
    "cpu1:cacheaware:nowarmup": ["--compression", "cacheaware", "--engine", "cpu", "--staleness", "1",
                                 "--staleness-warmup", "0"],
}


def run(name, args, tmp):
    out = os.path.join(tmp, name.replace(":", "_").replace("+", "_") + ".json")
    stellarun = os.path.join(os.path.dirname(sys.executable), "stellarun")
    route = ["--wan-route", "dense"] if name == "dense" else []
    cmd = [stellarun, "-np", "4", "--clusters", "2", "--timeout", "300"] + route + [sys.executable,
           os.path.join(ROOT, "examples", "train_horovod.py"), "--steps", str(args.steps), "--log-every",
           str(args.steps), "--hidden", str(args.hidden), "--optimizer", "sgd", "--lr", str(args.lr), "--density",
           str(args.density), "--seed", str(args.seed), "--json-out", out] + [
               str(args.local_clip) if a == "CLIP" else a for a in VARIANTS[name]]
    if args.load_state:
        cmd += ["--load-state", args.load_state]
    if args.save_state:
        cmd += ["--save-state", args.save_state]
    if args.eval_every:
        cmd += ["--eval-every", str(args.eval_every)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("%s failed:\n%s" % (name, (proc.stdout + proc.stderr)[-3000:]))
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-clip", type=float, default=0.5, help="the +clip variants' global max norm (local_clip)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--load-state", metavar="PATH",
                   help="every variant starts from this point mid-run (train_horovod.py --save-state's PATH): the "
                        "cost of a route from there, not from scratch")
    p.add_argument("--save-state", metavar="PATH", help="train_horovod.py --save-state (one variant)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps too (the curve)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "parity.json"))
    args = p.parse_args()
    if args.save_state and len(args.variants) != 1:
        p.error("--save-state: give one variant (each would write the same files)")
    # (dense first, the reference of each ratio; not where the one variant saves its state)
    names = list(args.variants) if args.save_state else ["dense"] + [v for v in args.variants if v != "dense"]
    rows = []
    progress = Progress(len(names))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            progress.start(name)
            try:
                r = run(name, args, tmp)
            except SystemExit:
                progress.end(name, failed=True)
                raise
            progress.end(name, "held-out loss %.4f" % r["validation_loss"])
            rows.append({"variant": name, "validation_loss": r["validation_loss"],
                         "wan_bytes_per_step": r["wan_bytes_sent_per_step"]})
            if args.eval_every:
                rows[-1]["curve"] = [[c["step"], c["validation_loss"]] for c in r["curve"]]
            dense = rows[0]["validation_loss"]
            rows[-1]["loss_vs_dense"] = r["validation_loss"] / dense
            print("%-32s held-out loss %.4f  (%+.1f %% vs dense)  WAN %.3f MB/step" % (
                name, r["validation_loss"], 100 * (rows[-1]["loss_vs_dense"] - 1), r["wan_bytes_sent_per_step"] / 1e6),
                flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "settings": vars(args), "provenance": provenance(), "results": rows},
                  f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
