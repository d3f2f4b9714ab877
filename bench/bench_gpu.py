"""The GPU path, measured (scripts/run_gpu.sh runs it on a machine with CUDA):

    python3 bench/bench_gpu.py --out bench/results/gpu.json          # on a GPU machine
    .venv/bin/python bench/bench_gpu.py --device cpu --small          # smoke run of the same code

In one run:

1. selection throughput on the device: the route's cache-aware blocks and exact top-k
   (compression/device_select.py, with error feedback) against ``torch.topk`` of the magnitudes
   on the same tensor, 1 % density, 1M to 64M elements (one process);
2. per-step time of a ~25M- and a ~100M-parameter model with CUDA tensors, 2 clusters of one
   rank sharing the GPU, the cross-cluster link paced in user space at --rate (100 Mbit/s):
   stella sparse (cache-aware 1 %), stella dense and DDP (gloo on the CUDA tensors, its buckets
   paced at the same rate by a comm hook, since all its bytes cross the link) -- median of the
   timed steps, ratios to DDP;
3. the CPU engine with the model on the GPU, staleness 0 against 1: mean wall time per step and GPU
   idle time per step (that wall time minus the time forward and backward alone take, measured
   on the same model and batch without collectives);
4. the pseudo-gradient compressors' select (SparseLoCo 1 % at 2 bits, DeMo's DCT 1/32 at 4 bits,
   with error feedback) of a CUDA tensor, its selection copied to the host as the exchange
   does, on the device route against the host route the same
   compressor takes with ``selects_on_device`` off (the copy to the host, the transform and the
   C kernels), on the same tensor, 1M to 64M elements.

``--parts`` picks among them (default: all; "selection" is 1 and 4).

Parts 2 and 3 run under ``mpirun -np 2`` launched by this script (``--worker``).
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


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps):
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def selection_throughput(device, sizes, density=0.01, reps=5):
    from stella_mpi.compression import device_select
    rows = []
    for n in sizes:
        g = torch.randn(n, device=device)
        res = torch.zeros(n, device=device)
        k = max(1, int(density * n))
        t_ref = _timed(lambda: torch.topk(g.abs(), k, sorted=False), device, reps)
        t_blk = _timed(lambda: device_select.block_topk(g, k, res), device, reps)
        t_top = _timed(lambda: device_select.topk(g, k, res), device, reps)
        rows.append({"n": n, "k": k, "torch_topk_s": t_ref, "cacheaware_s": t_blk, "exact_topk_s": t_top,
                     "cacheaware_vs_torch_topk": t_blk / t_ref, "exact_topk_vs_torch_topk": t_top / t_ref,
                     "cacheaware_gelem_per_s": n / t_blk / 1e9})
        print("select n=%-9d torch.topk %.2f ms  cache-aware %.2f ms (x%.2f)  exact top-k %.2f ms (x%.2f)"
              % (n, 1e3 * t_ref, 1e3 * t_blk, t_blk / t_ref, 1e3 * t_top, t_top / t_ref), flush=True)
    return rows


def pseudo_selection(device, sizes, reps=3):
    """Part 4: the compressor's select on the device route against the host route, per size
    (on the CPU the device route is its torch-op code under STELLA_DEVICE_PATH=torch: a smoke run,
    not a device's figure)."""
    from stella_mpi.comm.sparse_exchange import _to_host
    from stella_mpi.compression import Memory, TensorContext
    from stella_mpi.compression.dct import DCTCompressor
    from stella_mpi.compression.sparseloco import SparseLoCoCompressor
    settings = {"sparseloco": lambda: SparseLoCoCompressor(density=0.01, chunk=4096, bits=2),
                "dct": lambda: DCTCompressor(density=1.0 / 32, chunk=64, bits=4)}
    rows = []
    for n in sizes:
        g = torch.randn(n, device=device)
        for name, make in settings.items():
            timed = {}
            for route in ("device", "host"):
                comp, memory = make(), Memory()
                comp.selects_on_device = route == "device"
                ctx = TensorContext("bench.%s" % name, 0, (n,))
                was = os.environ.get("STELLA_DEVICE_PATH")
                if device.type == "cpu":
                    os.environ["STELLA_DEVICE_PATH"] = "torch" if route == "device" else ""
                try:   # (the selection copied to the host, as the exchange does, on both routes)
                    timed[route] = _timed(lambda: _to_host(comp.select(g, ctx, memory)), device, reps)
                finally:
                    if was is None:
                        os.environ.pop("STELLA_DEVICE_PATH", None)
                    else:
                        os.environ["STELLA_DEVICE_PATH"] = was
            rows.append({"n": n, "compressor": name, "device_route_s": timed["device"], "host_route_s": timed["host"],
                         "device_vs_host": timed["device"] / timed["host"]})
            print("pseudo-gradient select %-10s n=%-9d device route %.2f ms  host route %.2f ms (x%.3f)"
                  % (name, n, 1e3 * timed["device"], 1e3 * timed["host"], timed["device"] / timed["host"]), flush=True)
    return rows


def mlp(width_in, hidden, depth, out=10):
    layers, d = [], width_in
    for _ in range(depth):
        layers += [torch.nn.Linear(d, hidden), torch.nn.ReLU()]
        d = hidden
    layers.append(torch.nn.Linear(d, out))
    return torch.nn.Sequential(*layers)


MODELS = {   # name: (input width, hidden, depth) -> parameters
    "25M": (2048, 4096, 2),     # 2048*4096 + 4096*4096 + heads: 25.2M
    "100M": (4096, 8192, 2),    # 4096*8192 + 8192*8192 + heads: 100.7M
    "400M": (8192, 16384, 2),   # 8192*16384 + 16384*16384 + heads: 402.8M (only a GPU holds it here)
    "small": (256, 512, 2),     # smoke runs
}


def paced_allreduce_hook(bps):
    """DDP comm hook: gloo's allreduce of the bucket, then held until the bucket's bytes would
    have crossed a link of ``bps`` shared by all buckets (one link: a bucket's bytes start after
    the previous bucket's, as stella's Pacer serialises its cross-cluster sends)."""
    import threading
    import torch.distributed as dist
    link = {"free": 0.0}
    lock = threading.Lock()

    def hook(state, bucket):
        buf = bucket.buffer()
        with lock:
            start = max(time.monotonic(), link["free"])
            link["free"] = done_at = start + buf.numel() * buf.element_size() * 8 / bps
        fut = dist.all_reduce(buf.div_(dist.get_world_size()), async_op=True).get_future()

        def paced(f):
            left = done_at - time.monotonic()
            if left > 0:
                time.sleep(left)
            return f.value()[0]
        return fut.then(paced)
    return hook


PARTS = ("select_s", "encode_s", "exchange_s", "decode_s", "merge_s", "engine_s")


def worker(args):
    import stella_mpi as hvd
    from bench.baseline_dist import init_gloo_world
    hvd.init()
    dev = torch.device(args.device if args.device == "cpu" else "cuda:%d" % (hvd.local_rank() % torch.cuda.device_count()))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    results = {"steps": {}, "cpu_engine": {}}
    batch = args.batch

    def data(width, step):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        x = torch.randn(batch, width, generator=g)
        return x.to(dev), torch.randint(0, 10, (batch,), generator=g).to(dev)

    def run_steps(model, opt, width, steps, finish=None):
        """Per-step wall times of ``steps`` steps after one untimed step. One barrier before the
        timed steps, none between them: a barrier queues behind the pipeline's work and would
        hide what a pipelined step (CPU engine, staleness 1) still waits for. ``finish`` (the
        CPU engine's wait_updates) runs inside the last step's time, so the last update counts."""
        times, sent, parts = [], [], []
        for step in range(steps + 1):
            x, y = data(width, step)
            if step <= 1:
                if finish is not None:
                    finish()
                _sync(dev)
                hvd.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if step == steps and finish is not None:
                finish()
            _sync(dev)
            if step:
                times.append(time.perf_counter() - t0)
                last = hvd.stats()["last_step"]
                sent.append(last["wan_bytes_sent"])
                parts.append({k: last.get(k, 0.0) for k in PARTS})
        run_steps.wire_bytes = statistics.median(sent)
        # where a step's backend time went (the collective thread's counters, median per part)
        run_steps.parts = {k: statistics.median(p[k] for p in parts) for k in PARTS} if parts else {}
        return times

    def compute_only(width, hidden, depth, reps=5):
        """Seconds of one step's forward and backward alone (no collective, no optimizer): the
        GPU's busy time per step, against which a step's idle time is measured. (CUDA events
        around forward and backward would count a forward pre-hook's wait for an update as busy.)"""
        model = mlp(width, hidden, depth).to(dev)
        x, y = data(width, 0)
        times = []
        for _ in range(reps + 1):
            _sync(dev)
            t0 = time.perf_counter()
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    for name in args.models:
        width, hidden, depth = MODELS[name]
        row = {"parameters": sum(p.numel() for p in mlp(width, hidden, depth).parameters())}
        if dev.type == "cuda":
            row["compute_s"] = compute_only(width, hidden, depth)
        for mode in args.modes:
            if mode == "thc" and name not in args.thc_models:
                continue
            torch.manual_seed(0)
            model = mlp(width, hidden, depth).to(dev)
            # "dense": Horovod's allreduce across clusters (the automatic route would choose instead)
            os.environ["STELLA_WAN_ROUTE"] = "dense" if mode == "dense" else "auto"
            if mode == "ddp":
                if not torch.distributed.is_initialized():
                    init_gloo_world()
                ddp = torch.nn.parallel.DistributedDataParallel(model)
                ddp.register_comm_hook(None, paced_allreduce_hook(args.rate))
                opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
                times = run_steps(ddp, opt, width, args.steps)
                wire = row["parameters"] * 4
            else:
                comp = {"dense": hvd.Compression.none, "thc": hvd.Compression.thc(bits=4),
                        "sparse": hvd.Compression.cacheaware(density=args.density, warmup=0)}[mode]
                opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                               named_parameters=model.named_parameters(), compression=comp)
                times = run_steps(model, opt, width, args.steps)
                wire = run_steps.wire_bytes
            worst = hvd.allreduce(torch.tensor(statistics.median(times)), op=hvd.Max, name="bench.%s.%s" % (name, mode))
            row[mode + "_step_s"] = float(worst)
            row[mode + "_wire_s"] = wire * 8 / args.rate
            if mode != "ddp":
                row[mode + "_parts_s"] = run_steps.parts
            if "compute_s" in row:
                row[mode + "_vs_max_compute_wire"] = float(worst) / max(row["compute_s"], row[mode + "_wire_s"])
            if hvd.rank() == 0:
                print("%s %-6s step %.3f s  wire %.3f s  compute %s  %s" % (
                    name, mode, float(worst), row[mode + "_wire_s"],
                    "%.4f s" % row["compute_s"] if "compute_s" in row else "n/a",
                    " ".join("%s %.1f ms" % (k[:-2], 1e3 * v) for k, v in row.get(mode + "_parts_s", {}).items())),
                      flush=True)
            del opt, model
        for a, b in (("sparse", "ddp"), ("dense", "ddp"), ("sparse", "dense"), ("thc", "sparse")):
            if a + "_step_s" in row and b + "_step_s" in row:
                row["%s_vs_%s" % (a, b)] = row[a + "_step_s"] / row[b + "_step_s"]
        results["steps"][name] = row

    def cpu_engine(name):
        """The CPU engine, staleness 0 against 1, on model ``name`` (warm-up off), and against the
        synchronous sparse route's step measured above."""
        width, hidden, depth = MODELS[name]
        busy = compute_only(width, hidden, depth) if dev.type == "cuda" else None
        out = results["cpu_engine"].setdefault(name, {"compute_s": busy})
        for staleness in (0, 1):
            torch.manual_seed(0)
            os.environ["STELLA_WAN_ROUTE"] = "auto"
            model = mlp(width, hidden, depth).to(dev)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                           named_parameters=model.named_parameters(),
                                           engine=hvd.CpuEngine(staleness=staleness, warmup=0, model=model),
                                           compression=hvd.Compression.cacheaware(density=args.density, warmup=0))
            times = run_steps(model, opt, width, args.steps, finish=opt.wait_updates)
            opt.drain()
            # means, not medians: with staleness 1 the waits fall on some steps only
            wall = float(hvd.allreduce(torch.tensor(statistics.mean(times)), op=hvd.Max,
                                       name="bench.engine.%s.%d" % (name, staleness)))
            idle = max(0.0, wall - busy) if busy is not None else None
            out["staleness%d" % staleness] = {"step_s": wall, "gpu_idle_s": idle, "parts_s": run_steps.parts,
                                              "engine_times": opt.engine_times()}
            if hvd.rank() == 0:
                print("%s cpu engine staleness %d: step %.3f s, GPU idle %s" % (
                    name, staleness, wall, "%.3f s" % idle if idle is not None else "n/a (CPU)"), flush=True)
            del opt, model
        out["step_s1_vs_s0"] = out["staleness1"]["step_s"] / out["staleness0"]["step_s"]
        sparse = results["steps"].get(name, {}).get("sparse_step_s")
        if sparse:
            out["step_s1_vs_sync_sparse"] = out["staleness1"]["step_s"] / sparse

    for name in args.engine_models:
        cpu_engine(name)
    if hvd.rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--rate", type=float, default=100e6, help="emulated cross-cluster link, bit/s")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    p.add_argument("--modes", nargs="+", default=["ddp", "dense", "sparse"], choices=["ddp", "dense", "sparse", "thc"],
                   help="per-step modes (ddp and dense send every byte: 32 s a step for 100M at 100 Mbit/s)")
    p.add_argument("--thc-models", nargs="+", default=None, help="models THC runs on (default: all)")
    p.add_argument("--engine-models", nargs="+", default=None, help="models the CPU engine runs on (default: the first)")
    p.add_argument("--parts", nargs="+", default=["selection", "train"], choices=["selection", "train"],
                   help="selection: parts 1 and 4 (one process); train: parts 2 and 3 (two ranks)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpu.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.models is None:
        args.models = ["small"] if args.small else ["25M", "100M"]
    args.thc_models = args.thc_models or args.models
    args.engine_models = args.engine_models or args.models[:1]
    if args.worker:
        return worker(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA here; run it on a GPU machine (scripts/run_gpu.sh) or use --device cpu --small")
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    sizes = [1 << 16, 1 << 20] if args.small else [1 << 20, 1 << 24, 1 << 26]
    from bench.provenance import provenance
    out = {"command": " ".join(sys.argv), "provenance": provenance(), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "rate_bps": args.rate, "density": args.density}
    if "selection" in args.parts:
        out["selection"] = selection_throughput(device, sizes)
        out["pseudo_selection"] = pseudo_selection(device, sizes)
    if "train" in args.parts:
        from bench.two_clusters import run_two_clusters
        out.update(run_two_clusters(__file__, [
            "--device", args.device, "--rate", args.rate, "--density", args.density, "--steps", args.steps,
            "--batch", args.batch, "--models", *args.models, "--modes", *args.modes, "--thc-models", *args.thc_models,
            "--engine-models", *args.engine_models], args.rate, threads=2, timeout=3000))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
