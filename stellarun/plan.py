"""``stellarun plan``: what each cross-cluster route will give on clusters you have not rented
yet -- step time, compute utilisation, WAN bytes per step, time and cost to a target loss,
work lost to revocations -- and which route and batch split to take.

    stellarun plan --model examples/plan_model.py --cluster 4xrtx4090 --cluster 8xa100-80gb,price=1.9 \\
        --link 100mbit --global-batch 256 --target-loss 2.0

The launcher only reads the command line and refuses what contradicts itself; the work is
done by three jobs it starts (this package never imports torch, MPI or stella_mpi):

1. ``python -m stella_mpi.plan check``: the GPU kinds are known and the model script loads;
2. the calibration, under stellarun (two ranks in two clusters on this machine, optionally
   across an emulated link): the model's compute per sample, the optimizer, the kernels' costs,
   the link's latency, and each route's quality at equal steps (``stella_mpi/plan/calibrate.py``);
3. ``python -m stella_mpi.plan report``: the prediction per route from the adjuster's cost
   model, the table, the JSON and the PNG (``stella_mpi/plan/report.py``).

A cluster is ``COUNTxKIND`` with optional ``,price=USD_PER_GPU_HOUR``, ``,revocations=PER_GPU_HOUR``,
``,link=RATE`` (its uplink, default ``--link``) and ``,host=NAME`` (clusters on one host share
its cores: the kind ``here``, this machine's CPU, is for checking the planner against runs here).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from .progress import say
from .shaping import parse_delay, parse_rate

CLUSTER_FIELDS = ("price", "revocations", "link", "host")
DEFAULT_OUT = "plan.json"


class PlanError(Exception):
    """A command line the planner refuses; the message names the field."""


def parse_cluster(text, index):
    """'4xrtx4090,price=0.7,link=100mbit' -> {"count": 4, "kind": "rtx4090", "price": 0.7, ...}."""
    what = "--cluster %r (cluster %d)" % (text, index)
    head, *fields = [part.strip() for part in str(text).split(",")]
    m = re.fullmatch(r"([0-9]+)\s*[xX]\s*([A-Za-z0-9._-]+)", head)
    if not m:
        raise PlanError("%s: start with COUNTxKIND, e.g. 4xrtx4090 or 2xhere" % what)
    out = {"count": int(m.group(1)), "kind": m.group(2).lower()}
    if out["count"] < 1:
        raise PlanError("%s: count %d: a cluster has at least one GPU" % (what, out["count"]))
    for field in fields:
        key, sep, value = field.partition("=")
        key = key.strip().lower()
        if not sep or key not in CLUSTER_FIELDS:
            raise PlanError("%s: field %r: use %s, e.g. price=1.9" % (what, field, ", ".join(
                "%s=..." % f for f in CLUSTER_FIELDS)))
        if key in out:
            raise PlanError("%s: field %r is given twice" % (what, key))
        if key in ("price", "revocations"):
            try:
                number = float(value)
            except ValueError:
                raise PlanError("%s: %s=%r is not a number" % (what, key, value)) from None
            if not number >= 0:
                raise PlanError("%s: %s=%r must be >= 0" % (what, key, value))
            out[key] = number
        elif key == "link":
            try:
                out[key] = parse_rate(value)
            except ValueError as e:
                raise PlanError("%s: link: %s" % (what, e)) from None
        else:
            out[key] = value.strip()
    return out


def build_spec(args):
    """The planner's inputs as one dict (written as JSON for the jobs), every contradiction
    refused with the field named."""
    if not args.cluster:
        raise PlanError("--cluster: give each cluster, e.g. --cluster 4xrtx4090 --cluster 8xa100-80gb")
    clusters = [parse_cluster(c, i) for i, c in enumerate(args.cluster)]
    try:
        link = parse_rate(args.link)
    except ValueError as e:
        raise PlanError("--link: %s" % e) from None
    for c in clusters:
        c.setdefault("link", link)
    gpus = sum(c["count"] for c in clusters)
    if args.global_batch is not None and args.global_batch < gpus:
        raise PlanError("--global-batch %d is smaller than the %d GPUs of the clusters: each needs at least one "
                        "sample per step" % (args.global_batch, gpus))
    if args.target_loss is not None and args.target_steps is not None:
        raise PlanError("--target-loss and --target-steps contradict each other: give the loss to reach (its steps are "
                        "measured) or the dense steps it takes, not both")
    priced = [c for c in clusters if "price" in c]
    if priced and len(priced) != len(clusters):
        raise PlanError("--cluster price=: given for clusters %s but not for %s: give every cluster a price (0 for "
                        "one you own) or none" % ([clusters.index(c) for c in priced],
                                                   [i for i, c in enumerate(clusters) if "price" not in c]))
    if args.commit_every < 1:
        raise PlanError("--commit-every %d: commit at least every step (>= 1)" % args.commit_every)
    if args.budget_hours is not None and not args.budget_hours > 0:
        raise PlanError("--budget-hours %r must be positive" % args.budget_hours)
    if args.link_efficiency is not None and not 0 < args.link_efficiency <= 1:
        raise PlanError("--link-efficiency %r: a share of the nominal rate, in (0, 1]" % args.link_efficiency)
    delay = 0.0
    if args.link_delay:
        try:
            delay = parse_delay(args.link_delay)
        except ValueError as e:
            raise PlanError("--link-delay: %s" % e) from None
    model = {"source": args.model}
    for item in args.model_arg or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PlanError("--model-arg %r: use KEY=VALUE (passed to the model's entry point)" % item)
        model.setdefault("args", {})[key] = value
    return {"model": model, "clusters": clusters, "link_bps": link, "link_delay_s": delay,
            "global_batch": args.global_batch, "target_loss": args.target_loss, "target_steps": args.target_steps,
            "budget_hours": args.budget_hours, "commit_every": args.commit_every,
            "quality_steps": args.quality_steps, "gpu_table": args.gpu_table, "out": args.out,
            "plot": args.plot, "routes": args.routes, "fusion_threshold_mb": args.fusion_threshold_mb,
            "cores": args.cores, "link_efficiency": args.link_efficiency, "allreduce_efficiency": None, "link_burst_bytes": args.link_burst}


def calibration_layout(spec):
    """(ranks, clusters) of the calibration job: two clusters of one rank; when every cluster is
    of the kind ``here`` (this machine: ranks share its cores, which GPU ranks never do), the
    layout asked for itself, so what it measures holds that sharing."""
    clusters = spec["clusters"]
    if all(c["kind"] == "here" for c in clusters) and len({c.get("host") for c in clusters}) == 1:
        return sum(c["count"] for c in clusters), len(clusters)
    return 2, 2


def parse(argv):
    p = argparse.ArgumentParser(prog="stellarun plan", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Model: a script with a stella_plan(...) entry point (examples/plan_model.py "
                                       "shows the contract), or a named size (100m, 1b, 7b, 70b: a decoder-only "
                                       "transformer, no calibration of quality).")
    p.add_argument("--model", required=True, help="a script (PATH[:FUNCTION], default function stella_plan) or a "
                                                  "named size: 100m, 1b, 7b, 70b")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="passed to the script's entry point")
    p.add_argument("--cluster", action="append", metavar="COUNTxKIND[,price=..][,revocations=..][,link=..]",
                   help="one cluster (repeat for each)")
    p.add_argument("--link", default="100mbit", help="each cluster's uplink unless its own link= says otherwise")
    p.add_argument("--link-delay", help="one-way delay between clusters (e.g. 20ms)")
    p.add_argument("--link-burst", type=int, default=0, metavar="BYTES",
                   help="a token-bucket shaper's burst on each uplink (tc tbf; 0: none)")
    p.add_argument("--link-efficiency", type=float, help="goodput over nominal rate of the links (default: the "
                                                           "calibration's, measured with --calibration-wan; else 1)")
    p.add_argument("--global-batch", type=int, help="samples per step over all GPUs (default: the model's)")
    p.add_argument("--target-loss", type=float, help="held-out loss to reach (its steps are measured per route)")
    p.add_argument("--target-steps", type=int, help="dense steps to the target, when the loss cannot be measured here")
    p.add_argument("--budget-hours", type=float, help="say which routes cannot reach the target within this")
    p.add_argument("--commit-every", type=int, default=100, help="steps between elastic commits (work lost per "
                                                                   "revocation)")
    p.add_argument("--quality-steps", type=int, default=300, help="calibration: steps of each route's quality run")
    p.add_argument("--routes", help="comma-separated route names to predict (default: all)")
    p.add_argument("--fusion-threshold-mb", type=float, help="bucket size in MiB (HOROVOD_FUSION_THRESHOLD)")
    p.add_argument("--cores", type=int, help="cores of each host of kind 'here' (default: this machine's)")
    p.add_argument("--gpu-table", help="JSON file of extra GPU kinds (see stella_mpi/plan/gpus.py)")
    p.add_argument("--calibration", help="reuse this calibration JSON instead of measuring again")
    p.add_argument("--calibration-out", help="keep the calibration JSON here")
    p.add_argument("--calibration-wan", help="run the calibration across an emulated link of this rate")
    p.add_argument("--out", default=DEFAULT_OUT, help="the plan as JSON (default plan.json)")
    p.add_argument("--plot", help="the plan as a PNG (default: beside --out)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the calibration may take")
    return p.parse_args(argv)


def _run(cmd, what, timeout=None):
    say("%s: %s" % (what, " ".join(cmd)))
    try:
        proc = subprocess.run(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PlanError("%s took more than %.0f s (--timeout)" % (what, timeout)) from None
    if proc.returncode != 0:
        raise PlanError("%s failed (exit %d); its own message is above" % (what, proc.returncode))


def main(argv):
    try:
        args = parse(argv)
        spec = build_spec(args)
        if args.plot is None:
            spec["plot"] = os.path.splitext(args.out)[0] + ".png"
        work = tempfile.mkdtemp(prefix="stella-plan-")
        spec_path = os.path.join(work, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f, indent=1)
        py = sys.executable
        _run([py, "-m", "stella_mpi.plan", "check", "--spec", spec_path], "checking the inputs")
        calibration = args.calibration
        if calibration is None:
            calibration = args.calibration_out or os.path.join(work, "calibration.json")
            np_, nclusters = calibration_layout(spec)
            cmd = [py, "-m", "stellarun", "-np", str(np_), "--clusters", str(nclusters), "--quiet", "--timeout", "300"]
            if args.calibration_wan:
                cmd += ["--wan", args.calibration_wan]
            cmd += [py, "-m", "stella_mpi.plan", "calibrate", "--spec", spec_path, "--out", calibration]
            _run(cmd, "calibrating on this machine", args.timeout)
        elif not os.path.exists(calibration):
            raise PlanError("--calibration %s: no such file" % calibration)
        _run([py, "-m", "stella_mpi.plan", "report", "--spec", spec_path, "--calibration", calibration],
             "predicting")
        return 0
    except PlanError as e:
        sys.stderr.write("stellarun plan: %s\n" % e)
        return 2
