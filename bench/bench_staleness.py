"""End to end, the CPU engine's staleness: does staleness 1 hide communication behind compute?

    .venv/bin/stellarun -np 4 --clusters 2 --wan 100mbit .venv/bin/python bench/bench_staleness.py
    .venv/bin/stellarun -np 2 --clusters 2 --wan 100mbit .venv/bin/python bench/bench_staleness.py

In ONE run, on the same model (an MLP on random data; --hidden/--batch/--density set the balance
of compute and communication), in interleaved rounds so that load from other processes hits
every phase alike, it measures per step:

* compute: forward + backward alone, no exchange;
* comm: the CPU engine's whole update alone -- reduce-scatter, sparse selection, WAN exchange,
  merge, C optimizer, all-gather, copy into the model -- on fixed gradients, with no compute
  (``step()`` of a staleness-0 engine without a backward pass);
* s0: training steps with ``engine=hvd.CpuEngine(staleness=0)``;
* s1: training steps with ``engine=hvd.CpuEngine(staleness=1, warmup=0)``.

It prints s1 against max(compute, comm) and s0 against compute + comm, the ratio s0/s1, and
where the CPU engine's time went (collective thread: exchange, optimizer, all-gather; training
thread: blocked waiting for an update, copying it in). Step times are a phase's wall time
per step, drain of the updates still in flight included, on the slowest rank; median over
rounds (a per-step median would hide staleness 1's lumpy waits). --json-out writes everything
(rank 0).
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import stella_mpi as hvd
from provenance import provenance


def make_model(width, depth, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--compressor", default="cacheaware", help="a sparse compressor, or 'none' (dense exchange)")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (compute, comm, s0, s1)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per phase and round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training thread")
    p.add_argument("--no-prediction", action="store_true", help="staleness 1 without stale prediction")
    p.add_argument("--json-out")
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    rank = hvd.rank()
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)

    def compression():
        if args.compressor == "none":
            return hvd.Compression.none
        return getattr(hvd.Compression, args.compressor)(density=args.density)

    def engine(staleness):
        model = make_model(args.width, args.depth)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression(),
                                       engine=hvd.CpuEngine(staleness=staleness, warmup=0, model=model,
                                                            prediction=False if args.no_prediction else None))
        return model, opt

    plain = make_model(args.width, args.depth)
    m0, o0 = engine(0)
    m1, o1 = engine(1)
    fixed = [torch.randn(q.shape, generator=gen) * 1e-2 for q in m0.parameters()]

    def train_step(model, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def compute_step():
        plain.zero_grad()
        torch.nn.functional.cross_entropy(plain(x), y).backward()

    def comm_step():
        for q, g in zip(m0.parameters(), fixed):
            q.grad = g.clone()
        o0.step()

    phases = {"compute": compute_step, "comm": comm_step,
              "s0": lambda: train_step(m0, o0), "s1": lambda: train_step(m1, o1)}
    times = {k: [] for k in phases}
    engine_before = {"s0": o0.engine_times(), "s1": o1.engine_times()}
    engine_spent = {"s0": dict.fromkeys(engine_before["s0"], 0.0), "s1": dict.fromkeys(engine_before["s1"], 0.0)}
    for rnd in range(args.rounds):
        for name, fn in phases.items():
            fn()  # two untimed steps: the pipeline fills (s1), caches warm
            fn()
            comm.Barrier()
            o = {"s0": o0, "s1": o1}.get(name)
            if o is not None:
                before = o.engine_times()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            if o is not None:
                o.wait_updates()   # the updates still in flight belong to this phase's steps
            took = np.array([time.perf_counter() - t0])
            comm.Allreduce(MPI.IN_PLACE, took, op=MPI.MAX)   # (comm.allreduce holds the GIL while it waits)
            times[name].append(float(took[0]) / args.steps)
            if o is not None:
                o.drain()   # master weights back in the model (prediction): not a per-step cost
                after = o.engine_times()
                for k in after:
                    engine_spent[name][k] += after[k] - before[k]
            comm.Barrier()

    med = {k: statistics.median(v) for k, v in times.items()}
    n = args.rounds * args.steps
    per_step = {ph: {k: v / n for k, v in d.items()} for ph, d in engine_spent.items()}
    st = hvd.stats()
    wan_per_step = st["total"]["wan_bytes_sent"] / max(1, st["steps"])
    nparams = sum(q.numel() for q in plain.parameters())
    if rank == 0:
        c, m = med["compute"], med["comm"]
        print("%d ranks in %d clusters, WAN %s; MLP %dx%d (%.1fM parameters), batch %d, %s density %s; "
              "torch threads %d; %d rounds x %d steps"
              % (hvd.size(), hvd.num_clusters(), _rate(), args.width, args.depth, nparams / 1e6, args.batch,
                 args.compressor, args.density, args.threads, args.rounds, args.steps))
        print("  compute alone          %7.1f ms" % (1e3 * c))
        print("  comm alone             %7.1f ms   (WAN bytes sent per rank and step: %d)"
              % (1e3 * m, wan_per_step))
        print("  staleness 0            %7.1f ms   vs compute + comm  %7.1f ms  (x%.2f)"
              % (1e3 * med["s0"], 1e3 * (c + m), med["s0"] / (c + m)))
        print("  staleness 1            %7.1f ms   vs max(compute, comm) %5.1f ms  (x%.2f)"
              % (1e3 * med["s1"], 1e3 * max(c, m), med["s1"] / max(c, m)))
        print("  s0 / s1                %7.2f      (ideal (compute + comm) / max = %.2f)"
              % (med["s0"] / med["s1"], (c + m) / max(c, m)))
        for ph in ("s0", "s1"):
            print("  %s, ms per step: " % ph + ", ".join("%s %.1f" % (k[:-2], 1e3 * v) for k, v in per_step[ph].items()))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"args": vars(args), "provenance": provenance(), "ranks": hvd.size(),
                           "clusters": hvd.num_clusters(), "wan": _rate(),
                           "parameters": nparams, "wan_bytes_per_rank_step": wan_per_step, "median_s": med, "all_s": times, "engine_per_step_s": per_step},
                          f, indent=1)
    hvd.shutdown()


def _rate():
    import os
    bps = float(os.environ.get("STELLA_WAN_RATE_BPS", "0") or 0)
    return "%s (%s)" % ("%.0f Mbit/s" % (bps / 1e6) if bps else "none", os.environ.get("STELLA_WAN_MODE", "-"))


if __name__ == "__main__":
    main()
