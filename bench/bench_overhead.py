"""The time stella adds to a step beyond compute, per route, with compute replaced by
precomputed gradients (so only the backend is timed: selection, encoding, exchange, merge,
decoding and the optimizer's apply).

    .venv/bin/python bench/bench_overhead.py                      # this machine: 25M and 100M, CPU
    .venv/bin/python bench/bench_overhead.py --sizes 25M 100M 400M
    python3 bench/bench_overhead.py --device cuda                 # a GPU machine (scripts/run_gpu.sh)

Two clusters of one rank (``mpirun -np 2``, launched by this script), the cross-cluster link
paced in user space at --rate (default 1 Gbit/s). Parameters are 4M-entry matrices (and a bias
each) adding up to each size. Every step: the precomputed gradient (kept in bfloat16, half the
memory) is copied into ``p.grad`` outside the timed span, then ``opt.step()`` (plain SGD) runs
and the device is synchronized; the median of the timed steps is reported, the slower rank's.

Reported per route and size, against two floors measured in the same run:

* ``wire_s``: the bytes the route sent across the link in that step (hvd.stats) at --rate;
* ``memcpy_s``: one copy of the gradient's bytes on its device (``dst.copy_(src)``, float32).

``vs_floor`` = step / max(wire, 3 memcpys): the issue's targets on this machine are sparse 1 %
<= 1.5 and THC <= 2. Routes: ``dense`` (Horovod's allreduce across clusters,
``STELLA_WAN_ROUTE=dense``), ``cacheaware`` and ``topk`` at --density, ``thc`` (4 bits), and on
CUDA ``thc-host`` (the previous route, kept here for comparison only: the shard crosses to the
host for the C kernels and back), ``cpu-engine`` (staleness 1, cache-aware, CpuEngine's C
optimizer on the host; wait_updates() inside the last step's time).
``BENCH_OVERHEAD_DEBUG=1`` prints rank 0's ``hvd.stats()["last_step"]`` after every timed step
(select, encode, exchange, decode, merge and engine seconds).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SIZES = {"25M": 25_000_000, "100M": 100_000_000, "400M": 400_000_000, "small": 2_000_000}
ROUTES = ("dense", "cacheaware", "topk", "thc", "thc-host", "cpu-engine")
MATRIX = 1 << 22   # entries per weight matrix (2048 x 2048)


def parameters(total, device):
    """Matrices of 2048 x 2048 and a bias of 2048 each, about ``total`` entries in all."""
    count = max(1, round(total / (MATRIX + 2048)))
    params = []
    for i in range(count):
        params.append(("layer%d.weight" % i, torch.nn.Parameter(torch.zeros(2048, 2048, device=device))))
        params.append(("layer%d.bias" % i, torch.nn.Parameter(torch.zeros(2048, device=device))))
    return params


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memcpy_s(numel, device, reps=5):
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    out = {"memcpy_s": statistics.median(times[1:])}
    if device.type == "cuda":
        host = torch.empty(numel, pin_memory=True)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            host.copy_(src)
            times.append(time.perf_counter() - t0)
        out["d2h_s"] = statistics.median(times[1:])
    del src, dst
    return out


def host_thc_cross_step():
    """The THC cross step as it was before THC ran on the device: a CUDA shard crosses to the
    host for the C kernels and comes back (for comparison in this bench only)."""
    from stella_mpi.base.devices import route_for
    from stella_mpi.comm.sparse_exchange import residual_key
    from stella_mpi.comm.thc_exchange import thc_reduce

    def step(hier, comp, memory, name, step_no, seed, scale):
        def cross(piece, comm, kind):
            key = residual_key(name, kind, hier.topo)
            route = route_for(piece.device)
            host = route.to_host(piece, "bench.thc")
            thc_reduce(hier, host, comp, memory, key, step_no, seed, comm, kind)
            route.to_device(host, out=piece)
            route.finish()
            if scale != 1.0:
                piece.mul_(scale)
        return cross
    return step


def worker(args):
    import stella_mpi as hvd
    from stella_mpi.core.executors import sparse as sparse_executor
    hvd.init()
    dev = torch.device(args.device if args.device == "cpu" else "cuda:%d" % (hvd.local_rank() % torch.cuda.device_count()))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    original_thc = sparse_executor.thc_cross_step
    rows = []
    for size in args.sizes:
        named = parameters(SIZES[size], dev)
        numel = sum(p.numel() for _, p in named)
        g = torch.Generator(device=dev).manual_seed(hvd.rank() + 1)
        grads = [torch.randn(p.shape, generator=g, device=dev).to(torch.bfloat16) for _, p in named]
        floors = memcpy_s(numel, dev)
        for route in args.routes:
            if route == "thc-host" and dev.type != "cuda":
                continue
            for _, p in named:
                p.data.zero_()
            os.environ["STELLA_WAN_ROUTE"] = "dense" if route == "dense" else "auto"
            sparse_executor.thc_cross_step = host_thc_cross_step() if route == "thc-host" else original_thc
            sgd = torch.optim.SGD([p for _, p in named], lr=1e-6)
            engine, finish = None, None
            if route == "dense":
                comp = hvd.Compression.none
            elif route in ("thc", "thc-host"):
                comp = hvd.Compression.thc(bits=4)
            elif route == "topk":
                comp = hvd.Compression.topk(density=args.density, warmup=0)
            else:
                comp = hvd.Compression.cacheaware(density=args.density, warmup=0)
            if route == "cpu-engine":
                module = torch.nn.Module()
                for i, (name, p) in enumerate(named):
                    module.register_parameter("p%d" % i, p)
                engine = hvd.CpuEngine(staleness=1, warmup=0, model=module)
            opt = hvd.DistributedOptimizer(sgd, named_parameters=named, compression=comp, engine=engine)
            if engine is not None:
                finish = opt.wait_updates
            times, wire = [], []
            for step in range(args.steps + 2):
                for (_, p), gr in zip(named, grads):
                    if p.grad is None:
                        p.grad = torch.empty_like(p)
                    p.grad.copy_(gr)
                _sync(dev)
                if step <= 1:
                    hvd.barrier()
                t0 = time.perf_counter()
                opt.step()
                if step == args.steps + 1 and finish is not None:
                    finish()
                _sync(dev)
                elapsed = time.perf_counter() - t0
                if step >= 2:
                    times.append(elapsed)
                    last = hvd.stats()["last_step"]
                    wire.append(last["wan_bytes_sent"])
                    if os.environ.get("BENCH_OVERHEAD_DEBUG") and hvd.rank() == 0:
                        print(route, {k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()})
            if engine is not None:
                opt.drain()
            step_s = float(hvd.allreduce(torch.tensor(statistics.median(times)), op=hvd.Max,
                                         name="overhead.%s.%s" % (size, route)))
            sent = statistics.median(wire)
            wire_s = sent * 8 / args.rate
            floor = max(wire_s, 3 * floors["memcpy_s"])
            row = {"size": size, "parameters": numel, "route": route, "step_s": step_s,
                   "ms_per_mparam": 1e3 * step_s / (numel / 1e6), "wan_bytes_per_step": sent, "wire_s": wire_s,
                   "vs_wire": step_s / wire_s if wire_s else None, "vs_memcpy": step_s / floors["memcpy_s"],
                   "vs_floor": step_s / floor, **floors}
            rows.append(row)
            if hvd.rank() == 0:
                print("%-5s %-10s step %8.1f ms  %6.2f ms/Mparam  wire %8.1f ms  memcpy %6.1f ms  step/max(wire,3 memcpy) %5.2f"
                      % (size, route, 1e3 * step_s, row["ms_per_mparam"], 1e3 * wire_s, 1e3 * floors["memcpy_s"],
                         row["vs_floor"]), flush=True)
            del opt, sgd
        del named, grads
    sparse_executor.thc_cross_step = original_thc
    if hvd.rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    hvd.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", nargs="+", default=["25M", "100M"], choices=sorted(SIZES))
    p.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    p.add_argument("--rate", type=float, default=1e9, help="emulated cross-cluster link, bit/s")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 untimed)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / 2)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "overhead.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_overhead: no CUDA here; use --device cpu, or run it on a GPU machine")
    from bench.provenance import provenance
    from bench.two_clusters import run_two_clusters
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)
    rows = run_two_clusters(__file__, ["--device", args.device, "--rate", args.rate, "--density", args.density,
                                       "--steps", args.steps, "--sizes", *args.sizes, "--routes", *args.routes],
                            args.rate, threads, timeout=3600)
    out = {"command": " ".join(["bench/bench_overhead.py"] + sys.argv[1:]), "provenance": provenance(),
           "rate_bps": args.rate, "density": args.density, "threads_per_rank": threads, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
