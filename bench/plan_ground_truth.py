"""Ground truth of the wire model (stella_mpi/plan/wire.py): the real runtime's counters against
its predictions, every rank, every step, exactly.

    python bench/plan_ground_truth.py                     # 16 ranks in 8 clusters, then 3,3,2,2,2,2,1,1
    python bench/plan_ground_truth.py --np 4 --clusters 2 --no-unequal --out /tmp/x.json

Each launch runs every route of :data:`ROUTES` in turn (a fresh model and
``hvd.DistributedOptimizer`` each, ``STELLA_FUSION_THRESHOLD`` = :data:`FUSION`); each rank
records ``hvd.stats()["last_step"]`` after every ``optimizer.step()`` and rank 0 writes them.
This process (no MPI) then compares them with ``wire.step_traffic`` and writes
``bench/results/plan_ground_truth_32.json`` (with ``provenance()``): per route and layout the
predicted and measured counters of every rank and step, and ``match``.

The model (:func:`build_model`) is chosen so that buckets, shards and the tree's 64 KiB
threshold all matter: float32 parameters of 589824, 2304, 589824, 256, 8192 and 32 elements
make 4 buckets at 1 MiB (one of three parameters); at 16 ranks in 8 clusters the large shards
cross by the tree during the density warm-up (25 % -> k*8 bytes >= 64 KiB) and by the
all-gather at 1 %, and one bucket's shard is below 16/density (selected by the exact top-k,
random-k included). Every element count is a multiple of 32, and a gradient hook zeroes one
entry in 16 (index % 16 == 15) of every gradient (and so, under plain SGD, of every
pseudo-gradient): no aligned 16-block of any shard is ever wholly selected, so the codec never
sends block ids (the one data-dependent part of a top-k or SparseLoCo payload's size, see
wire.py). fp16's bucket pairs exceed the threshold even at 16 bits: the collective thread never
fuses two of them (which would depend on timing).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FUSION = 1 << 20
LAYERS = ((256, 2304), (2304, 256), (256, 32))
UNEQUAL_16 = (3, 3, 2, 2, 2, 2, 1, 1)


def routes():
    """[(name, wire.Route, steps)] run in every launch, in order."""
    from stella_mpi.plan.wire import Route
    return [
        ("dense", Route("dense"), 2),
        ("fp16", Route("fp16"), 2),
        ("topk-1%-allgather", Route("sparse", "topk", 0.01, warmup=0, algorithm="allgather"), 2),
        ("topk-1%-warmup-auto", Route("sparse", "topk", 0.01), 2),
        ("topk-1%-tree", Route("sparse", "topk", 0.01, warmup=0, algorithm="tree"), 2),
        ("randomk-1%-warmup", Route("sparse", "randomk", 0.01), 2),
        ("thc-4bit", Route("thc", bits=4), 2),
        ("local-H2-thc4", Route("local", every=2, pseudo=Route("thc", bits=4)), 4),
        ("local-H2-dense", Route("local", every=2), 4),
        # each rank a replica: the exchange reduces the pseudo-gradient inside the cluster first,
        # and crosses the WAN as the cluster's replica does (the same counters)
        ("local-H2-thc4-rank", Route("local", every=2, inner="rank", pseudo=Route("thc", bits=4)), 4),
        ("local-H2-sparseloco1", Route("local", every=2, pseudo=Route("sparse", "sparseloco", 0.01, chunk=4096, bits=2,
                                                                       feedback_decay=0.95)), 4),
        # fragments 1, 0, 1 exchanged after steps 2, 4, 6 (blocking: with a delay, the record of the
        # step after or the next one holds it, as the clusters' timing has it; wire.py)
        ("local-H4-f2-thc4", Route("local", every=4, fragments=2, pseudo=Route("thc", bits=4)), 8),
    ]


def param_numels():
    out = []
    for i, o in LAYERS:
        out += [i * o, o]
    return out


def build_model():
    import torch
    torch.manual_seed(0)
    layers = []
    for j, (i, o) in enumerate(LAYERS):
        layers.append(torch.nn.Linear(i, o))
        if j < len(LAYERS) - 1:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers)
    for p in model.parameters():
        mask = torch.ones(p.numel())
        mask[15::16] = 0.0
        mask = mask.view_as(p)
        p.register_hook(lambda g, m=mask: g * m)
    return model


def _optimizer(hvd, model, route):
    import torch
    kw = {}
    if route.kind == "fp16":
        kw["compression"] = hvd.Compression.fp16
    elif route.kind in ("sparse", "thc"):
        comp = route.make_compressor()
        kw["compression"] = comp
    elif route.kind == "local":
        pseudo = route.pseudo.make_compressor() if route.pseudo is not None else None
        kw["local_steps"] = hvd.LocalSteps(every=route.every, overlap=route.overlap, fragments=route.fragments,
                                           delay=route.delay, inner=route.inner,
                                           compression=pseudo if pseudo is not None else hvd.Compression.none)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)


def worker(out):
    """One rank: every route, every step's last_step; rank 0 writes the records to ``out``."""
    import torch
    import stella_mpi as hvd
    from mpi4py import MPI
    from stella_mpi.plan.wire import COUNTED
    hvd.init()
    torch.set_num_threads(1)
    topo = hvd.global_process_set.topology
    sizes = [len(m) for m in topo.cluster_members]
    flat = [r for m in topo.cluster_members for r in m]
    assert flat == list(range(hvd.size())), "ranks are not laid out cluster by cluster: %s" % (topo.cluster_members,)
    hier = hvd.global_process_set.hierarchy
    records = {}
    for name, route, steps in routes():
        hier.sparse_algorithm = route.algorithm   # what STELLA_SPARSE_ALGO sets at init
        model = build_model()
        opt = _optimizer(hvd, model, route)
        hvd.stats(end_step=True)   # whatever came before starts no step of this route
        rows = []
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * hvd.rank() + s)
            x = torch.randn(8, LAYERS[0][0], generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            last = hvd.stats()["last_step"]
            rows.append({k: int(last[k]) for k in COUNTED})
        records[name] = rows
        del opt
    gathered = MPI.COMM_WORLD.allgather(records)   # (not gather: that one holds the GIL while it waits)
    if hvd.rank() == 0:
        by_route = {name: [[gathered[r][name][s] for r in range(hvd.size())] for s in range(steps)]
                    for name, _, steps in routes()}
        with open(out, "w") as f:
            json.dump({"cluster_sizes": sizes, "fusion": FUSION, "measured": by_route}, f)
    hvd.shutdown()


def compare(measured):
    """{route name: {"route", "predicted", "measured", "match"}} of one launch's records."""
    from dataclasses import asdict
    from stella_mpi.plan import wire
    sizes = measured["cluster_sizes"]
    out = {}
    for name, route, steps in routes():
        got = measured["measured"][name]
        want = [wire.step_traffic(route, sizes, param_numels(), fusion_bytes=measured["fusion"], step=s)
                for s in range(steps)]
        out[name] = {"route": asdict(route), "predicted": want, "measured": got, "match": want == got}
    return out


def job_env():
    env = dict(os.environ)
    env.pop("STELLA_CLUSTER", None)
    env.pop("STELLA_CLUSTERS", None)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "STELLA_TIMEOUT": "300",
                "STELLA_FUSION_THRESHOLD": str(FUSION), "STELLA_WAN_ROUTE": "dense",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def mpirun():
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else "mpirun"


def launch_command(out, np_=None, clusters=None, sizes=None):
    """The mpirun command of one launch: ``np_`` ranks in ``clusters`` clusters
    (``STELLA_CLUSTERS``), or clusters of ``sizes`` ranks (a ``STELLA_CLUSTER`` label each)."""
    me = [sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "--worker", out]
    if sizes is None:
        return [mpirun(), "-np", str(np_), "-env", "STELLA_CLUSTERS", str(clusters)] + me
    cmd = [mpirun()]
    for c, n in enumerate(sizes):
        cmd += ([":"] if c else []) + ["-n", str(n), "-env", "STELLA_CLUSTER", "site%d" % c] + me
    return cmd


def run_launch(out, timeout, **layout):
    """Run one launch and return its compared records (raises with the job's output on failure)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from mpi_launch import run_job
    proc = run_job(launch_command(out, **layout), timeout, env=job_env(), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError("launch %s failed (exit %d):\n%s\n%s" % (layout, proc.returncode, proc.stdout[-4000:],
                                                                   proc.stderr[-4000:]))
    with open(out) as f:
        return compare(json.load(f))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--np", type=int, default=16)
    ap.add_argument("--clusters", type=int, default=8)
    ap.add_argument("--no-unequal", action="store_true", help="skip the unequal layout (3,3,2,2,2,2,1,1)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_ground_truth_32.json"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from provenance import provenance
    import tempfile
    result = {"provenance": provenance(), "fusion_bytes": FUSION, "param_numels": param_numels(), "layouts": []}
    layouts = [{"np_": args.np, "clusters": args.clusters}]
    if not args.no_unequal:
        layouts.append({"sizes": UNEQUAL_16})
    ok = True
    for lay in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            routes_out = run_launch(os.path.join(tmp, "records.json"), args.timeout, **lay)
            took = time.time() - t0
        sizes = list(lay["sizes"]) if "sizes" in lay else [int(x) for x in _layout(lay)]
        result["layouts"].append({"cluster_sizes": sizes, "seconds": round(took, 1), "routes": routes_out})
        for name, r in routes_out.items():
            ok &= r["match"]
            print("%-24s %-22s match=%s" % (sizes, name, r["match"]))
    result["match"] = ok
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote %s (all match: %s)" % (args.out, ok))
    sys.exit(0 if ok else 1)


def _layout(lay):
    from stella_mpi.plan.wire import layout
    return layout(lay["np_"], lay["clusters"])


if __name__ == "__main__":
    main()
