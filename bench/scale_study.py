"""Scale study by simulation (issue 32): real kernels and measured costs on this machine, virtual
participants for the rest (PrismLLM's idea at our scale).

    PYTHONPATH=. .venv/bin/python bench/scale_study.py            # ~15 s: measure, simulate, plot
    PYTHONPATH=. .venv/bin/python bench/scale_study.py --tag before --no-plots

Grid: clusters {2..64} x GPUs per cluster {1,2,4,8} x models {100M, 1B, 7B, 70B} (LLaMA-style
layer shapes: the buckets and shards are the runtime's own, stella_mpi/plan/wire.bucket_members) x
links {20M, 100M, 1G, 10G} bit/s x routes (dense fp32, fp16, sparse top-k and cache-aware 1 %
by all-gather and by tree, THC 4-bit, local steps H=32 with a THC 4-bit pseudo-gradient).

Per rank and step, summed over the buckets of the model:

* WAN bytes and messages: stella_mpi/plan/wire.py's step_traffic (the runtime's own counting,
  matched exactly against the real runtime at 16 ranks in 8 clusters:
  bench/plan_ground_truth.py); cache-aware payloads at the bytes per entry the real encoder
  wrote (KernelCosts), the others' exact sizes. A cluster's g ranks share its WAN link: wire
  time = 8 * max(sent, received by the cluster) / link.
* latency: each counted message costs rounds (:func:`rounds_per_message`: an allreduce
  2 ceil(log2 C), an all-gather ceil(log2 C), a tree swap one) at ``--latency`` seconds (one
  way, 25 ms by default); the buckets run one after the other on the collective thread, so
  their latencies add up.
* CPU: KernelCosts measured here (select, encode, decode, merge with 2..64 virtual
  participants, the tree's re-selection, THC, the dense sum), on one core, ``--cpu-factor`` 1.
* intra-cluster: a ring reduce-scatter + all-gather of the gradient, 2 (g-1)/g of its bytes at
  the GPU kind's intra_gbps (NVLink or PCIe; stella_mpi/plan/gpus.py).
* compute: gpus.compute_s_per_sample x samples per GPU per step.
* step = compute + fixed (CPU + intra) + messages x latency + 8 bytes / bandwidth: the
  adjuster's cost model (Controller.predict), through :func:`step_time` (the one place to swap
  for stella_mpi/plan/predict.py). Utilisation = compute / step.

Writes bench/results/scale_study_32.json (with provenance) and scale_*.png.
"""
import argparse
import collections
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from provenance import provenance  # noqa: E402

from stella_mpi.base.config import Config  # noqa: E402
from stella_mpi.comm.buffers import split_counts  # noqa: E402
from stella_mpi.comm import sparse_exchange  # noqa: E402
from stella_mpi._native import compress as ckernels  # noqa: E402
from stella_mpi.plan import gpus, kernel_costs, memory, wire  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CLUSTERS = [2, 4, 8, 16, 32, 64]
GPUS_PER_CLUSTER = [1, 2, 4, 8]
LINKS = {"20M": 20e6, "100M": 100e6, "1G": 1e9, "10G": 10e9}
VOCAB = 32000
# (name, d_model, layers, ffn, kv_dim, ffn matrices): GPT-2 small-like, a 1B LLaMA-like, LLaMA-7B, LLaMA-2-70B (GQA)
MODELS = [("100M", 768, 12, 3072, 768, 2), ("1B", 2048, 16, 5632, 2048, 3), ("7B", 4096, 32, 11008, 4096, 3),
          ("70B", 8192, 80, 28672, 1024, 3)]
ROUTES = [  # (name, kind, compressor, algorithm)
    ("dense", "dense", None, None), ("fp16", "fp16", None, None),
    ("topk-ag", "sparse", "topk", "allgather"), ("topk-tree", "sparse", "topk", "tree"),
    ("cacheaware-ag", "sparse", "cacheaware", "allgather"), ("cacheaware-tree", "sparse", "cacheaware", "tree"),
    ("thc4", "thc", None, None), ("local32-thc4", "local", None, None)]
DENSITY = 0.01
H = 32


def param_numels(d, layers, ffn, kv, mats):
    """Parameters of a decoder-only transformer in registration order (embedding, per layer:
    norm, q, k, v, o, norm, the MLP's matrices; final norm, untied output head)."""
    out = [VOCAB * d]
    for _ in range(layers):
        out += [d, d * d, d * kv, d * kv, d * d, d] + [d * ffn] * mats
    return out + [d, VOCAB * d]


def _rounds(c):
    return max(1, math.ceil(math.log2(c)))


def rounds_per_message(kind, algorithm, c):
    """Latency rounds of one counted message over c clusters: an allreduce (dense, THC's two
    rounds) 2 ceil(log2 C), fp16's all-gather ceil(log2 C) (a swap between two), the sparse
    all-gather's sizes and payloads ceil(log2 C) each, a tree message one swap."""
    if kind in ("dense", "thc"):
        return 2 * _rounds(c)
    if kind == "fp16":
        return _rounds(c) if c > 2 else 1
    return 1 if algorithm == "tree" else _rounds(c)


def wire_route(kind, compressor, algorithm):
    """The wire model's Route of a study route (stella_mpi/plan/wire.py: the runtime's own
    counting, checked against the real runtime at 16 ranks in 8 clusters)."""
    if kind == "local":
        return wire.Route("local", every=H, pseudo=wire.Route("thc", bits=4))
    if kind == "sparse":
        return wire.Route("sparse", compressor=compressor, density=DENSITY, algorithm=algorithm)
    return wire.Route(kind, bits=4)


def payload_fn(costs, compressor):
    """A virtual participant's payload: the compressor's k entries at the bytes per entry the real
    encoder wrote (KernelCosts), for compressors whose payload depends on the data; None (the
    wire model's exact sizes) for the others."""
    if compressor is None or getattr(wire.Route("sparse", compressor=compressor, density=DENSITY).make_compressor(),
                                     "payload_from_sizes", False):
        return None
    bpe = costs.payload_bytes_per_entry[compressor]

    def payload(q):
        k = q.compressor.k_for(q.n)
        return wire.Payload(int(ckernels.HEADER_BYTES + round(bpe * k)), k)
    return payload


_TRAFFIC = {}


def traffic(costs, route, numels, c, g, fusion, pseudo_bucket, model):
    """Cluster 0's WAN traffic per step from wire.step_traffic: (bytes its g ranks send, bytes
    they receive, the most messages a rank counts), local steps' averaged over the period."""
    name, kind, compressor, algorithm = route
    key = (model, name, c, g, fusion, pseudo_bucket)
    if key not in _TRAFFIC:
        r = wire_route(kind, compressor, algorithm)
        every, step, fb = (H, H, fusion if pseudo_bucket is None else (pseudo_bucket or 1 << 62)) \
            if kind == "local" else (1, 100000, fusion)
        rows = wire.step_traffic(r, [g] * c, numels, fusion_bytes=fb, step=step, payload=payload_fn(costs, compressor))
        mine = rows[:g]
        _TRAFFIC[key] = (sum(x["wan_bytes_sent"] for x in mine) / every,
                         sum(x["wan_bytes_received"] for x in mine) / every,
                         max(x["wan_messages"] for x in rows) / every)
    return _TRAFFIC[key]


def step_time(compute_s, fixed_s, messages, latency_s, wire_bytes, bandwidth_bps):
    """The adjuster's cost model, Controller.predict (sync: P * compute + fixed + wire), P = 1."""
    from stella_mpi.adjust.controller import Controller, Estimate
    from stella_mpi.adjust.settings import AdjusterSettings
    est = Estimate(compute_s=compute_s, fixed_s=fixed_s, latency_s=latency_s, messages=messages,
                   bytes_per_density=wire_bytes, bandwidth_bps=bandwidth_bps, wan_bandwidth_bps=bandwidth_bps,
                   step_s=0.0)
    return _controller(Controller, AdjusterSettings).predict(est, 1, 1.0)


_CTRL = []


def _controller(Controller, AdjusterSettings):
    if not _CTRL:
        _CTRL.append(Controller(AdjusterSettings()))
    return _CTRL[0]


def shard_counts(numels, g, fusion_bytes, pseudo=False):
    """Counter {rank 0's shard of a bucket: buckets} (the runtime's buckets and split; with
    ``pseudo``, local steps' pseudo-gradient buckets)."""
    return collections.Counter(split_counts(b, g)[0] for b in (wire.pseudo_buckets if pseudo else wire.buckets)(
        numels, fusion_bytes))


def simulate(costs, model, numels, c, g, link, route, gpu, args, shards=None):
    name, kind, compressor, algorithm = route
    total = sum(numels)
    compute = gpu.compute_s_per_sample(total, args.tokens) * args.samples
    intra = 2.0 * (g - 1) / g * 4 * total / (gpu.intra_gbps * 1e9) if g > 1 else 0.0
    sent, recv, msgs = traffic(costs, route, numels, c, g, args.fusion, args.pseudo_bucket, model)
    every, cpu_kind = (H, "thc") if kind == "local" else (1, kind)
    if kind == "local":   # the pseudo-gradient's buckets (one fused buffer with --pseudo-bucket 0)
        shards = collections.Counter({split_counts(total, g)[0]: 1}) if args.pseudo_bucket == 0 else \
            shard_counts(numels, g, args.fusion if args.pseudo_bucket is None else args.pseudo_bucket, pseudo=True)
    shards = shards if shards is not None else shard_counts(numels, g, args.fusion)
    cpu = 0.0
    for n, count in shards.items():
        k = max(1, int(round(DENSITY * n)))
        if cpu_kind == "sparse":
            cpu += count * costs.sparse_cpu_s(compressor, n, k, c, algorithm, args.cpu_factor)
        elif cpu_kind == "thc":
            cpu += count * costs.thc_cpu_s(n, 4, c, args.cpu_factor)
        else:
            cpu += count * costs.dense_cpu_s(n, c, args.cpu_factor)
    cpu /= every
    rounds = msgs * rounds_per_message(cpu_kind, algorithm, c)
    wire_bytes = max(sent, recv)   # the cluster's g ranks share its link
    step = step_time(compute, cpu + intra, rounds, args.latency, wire_bytes, link)
    return {"model": model, "params": total, "clusters": c, "gpus": g, "link_bps": link, "route": name,
            "step_s": step, "compute_s": compute, "cpu_s": cpu, "intra_s": intra, "latency_s": rounds * args.latency,
            "wire_s": 8.0 * wire_bytes / link, "wan_bytes_sent": sent / g, "wan_bytes_received": recv / g,
            "wan_messages": msgs, "latency_rounds": rounds, "utilisation": compute / step}


def crossover(costs, args):
    """All-gather against tree for one bucket shard: clusters x payload, at each link, with 1 and
    8 GPUs per cluster (the cluster's ranks share its link; each runs its own CPU work)."""
    out = []
    for link_name, g in (("100M", 1), ("100M", 8), ("1G", 1), ("1G", 8), ("10G", 8)):
        link = LINKS[link_name]
        for c in (4, 8, 16, 32, 64):
            for kib in (4, 16, 64, 256, 1024, 4096, 16384):
                payload = kib * 1024
                for comp in ("topk", "cacheaware"):
                    bpe = costs.payload_bytes_per_entry[comp]
                    k = max(1, int(payload / bpe))
                    n = int(k / DENSITY)
                    row = {"link": link_name, "gpus": g, "clusters": c, "payload_bytes": payload, "compressor": comp,
                           "shard": n, "entries": k}
                    for algo in ("allgather", "tree"):
                        # one shard channel (wire.step_traffic of one bucket over c clusters of one
                        # rank, at a payload of the measured bytes per entry); the cluster's g channels share its link
                        rows = wire.step_traffic(wire.Route("sparse", compressor=comp, density=DENSITY, algorithm=algo),
                                                 [1] * c, [n], fusion_bytes=8 * n, step=100000,
                                                 payload=lambda q, bpe=bpe: wire.Payload(
                                                     int(ckernels.HEADER_BYTES + round(bpe * q.compressor.k_for(q.n))),
                                                     q.compressor.k_for(q.n)))
                        s_, r_ = rows[0]["wan_bytes_sent"], rows[0]["wan_bytes_received"]
                        lr = rows[0]["wan_messages"] * rounds_per_message("sparse", algo, c)
                        cpu = costs.sparse_cpu_s(comp, n, k, c, algo, args.cpu_factor)
                        row[algo + "_s"] = cpu + lr * args.latency + 8.0 * g * max(s_, r_) / link
                        row[algo + "_cpu_s"] = cpu
                    row["best"] = "tree" if row["tree_s"] < row["allgather_s"] else "allgather"
                    row["runtime"] = sparse_exchange.choose_algorithm("auto", c, 8 * k)
                    out.append(row)
    return out


def merge_measured(costs, args):
    """Measured decode and merge with C virtual participants (real selections), against the fit."""
    comp = kernel_costs._compressor("topk", DENSITY)
    n = args.merge_shard
    rows = []
    for c in (2, 4, 8, 16, 32, 64):
        dec, mer, entries_in, merged = kernel_costs.time_allgather_merge(comp, n, c, repeats=2, seed=c)
        parts = costs.sparse_parts("topk", n, comp.k_for(n), c, "allgather")
        rows.append({"clusters": c, "shard": n, "entries_in": entries_in, "merged": merged, "decode_s": dec,
                     "merge_s": mer, "fit_decode_s": parts["decode"], "fit_merge_s": parts["merge"],
                     "merge_ns_per_entry": 1e9 * mer / entries_in})
    return rows


def memory_70b(costs, args):
    numels = param_numels(*MODELS[-1][1:])
    out = {}
    for c, g in ((8, 8), (64, 8)):
        for name, kind, comp, _ in ROUTES:
            if name.endswith("-tree") or name.startswith("cacheaware"):
                continue
            route = {"kind": kind, "compressor": comp, "density": DENSITY, "bits": 4,
                     "pseudo": {"kind": "thc", "bits": 4}}
            mem = memory.route_memory(route, [g] * c, numels, fusion_bytes=args.fusion, device="gpu",
                                      momentum_correction=kind == "sparse",
                                      pseudo_bucket_bytes=args.pseudo_bucket,
                                      bytes_per_entry=costs.payload_bytes_per_entry.get(comp or "topk", 8.0))
            out["%dx%d/%s" % (c, g, name)] = mem
    return out


def plots(data, prefix):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grid = data["grid"]
    files = []

    def save(fig, name):
        f = "%s_%s.png" % (prefix, name)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f), dpi=90)
        plt.close(fig)
        files.append(f)

    def sel(**kw):
        return [r for r in grid if all(r[k] == v for k, v in kw.items())]
    for model, link, g in (("1B", 100e6, 8), ("70B", 1e9, 8)):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, *_ in ROUTES:
            rows = sorted(sel(model=model, link_bps=link, gpus=g, route=name), key=lambda r: r["clusters"])
            cs = [r["clusters"] for r in rows]
            axes[0].plot(cs, [r["step_s"] for r in rows], marker="o", label=name)
            axes[1].plot(cs, [r["utilisation"] for r in rows], marker="o", label=name)
        for ax, yl in zip(axes, ("step time (s)", "utilisation")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("clusters")
            ax.set_ylabel(yl)
            ax.grid(alpha=.3)
        axes[0].set_yscale("log")
        axes[1].legend(fontsize=7)
        fig.suptitle("%s, %d GPUs per cluster, %s bit/s" % (model, g, "%g" % link))
        save(fig, "clusters_%s" % model)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, *_ in ROUTES:
        rows = [sel(model=m[0], link_bps=1e9, gpus=8, clusters=8, route=name)[0] for m in MODELS]
        ax.plot([r["params"] for r in rows], [r["utilisation"] for r in rows], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("utilisation (8 clusters x 8 GPUs, 1 Gbit/s)")
    ax.grid(alpha=.3)
    ax.legend(fontsize=7)
    save(fig, "model_size")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (link, g) in zip(axes, (("100M", 8), ("1G", 8), ("1G", 1))):
        rows = [r for r in data["crossover"] if r["link"] == link and r["gpus"] == g and r["compressor"] == "topk"]
        for r in rows:
            x, y = r["clusters"], r["payload_bytes"] / 1024
            ax.scatter([x], [y], s=120, c="tab:green" if r["best"] == "tree" else "tab:blue", marker="s")
            ax.scatter([x], [y], s=25, c="white" if r["runtime"] == "tree" else "black", marker="o")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("clusters")
        ax.set_ylabel("payload per rank (KiB)")
        ax.set_title("%s bit/s, %d GPUs/cluster: square = faster (green tree, blue all-gather);\n"
                     "dot = runtime's choice (white tree, black all-gather)" % (link, g), fontsize=8)
    save(fig, "crossover")
    fig, ax = plt.subplots(figsize=(6, 4))
    m = data["merge"]
    cs = [r["clusters"] for r in m]
    ax.plot(cs, [1e3 * r["merge_s"] for r in m], "o-", label="merge (measured)")
    ax.plot(cs, [1e3 * r["fit_merge_s"] for r in m], "--", label="merge (fit)")
    ax.plot(cs, [1e3 * r["decode_s"] for r in m], "s-", label="decode C-1 payloads (measured)")
    ax.plot(cs, [1e3 * r["fit_decode_s"] for r in m], ":", label="decode (fit)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("clusters (virtual participants)")
    ax.set_ylabel("ms per shard of %d elements, 1 %%" % m[0]["shard"])
    ax.grid(alpha=.3)
    ax.legend(fontsize=7)
    save(fig, "merge")
    fig, ax = plt.subplots(figsize=(8, 4))
    mem = {k: v for k, v in data["memory_70b"].items() if k.startswith("64x8/")}
    names = list(mem)
    parts = sorted({p for v in mem.values() for p in v})
    bottom = [0.0] * len(names)
    for p in parts:
        vals = [mem[n].get(p, 0) / 2**30 for n in names]
        ax.bar(range(len(names)), vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.split("/")[1] for n in names], rotation=20, fontsize=8)
    ax.set_ylabel("GiB per rank beyond model + optimizer")
    ax.set_title("70B, 64 clusters x 8 GPUs")
    ax.legend(fontsize=6)
    save(fig, "memory_70b")
    return files


def compact(x):
    """Floats to 5 significant digits (the JSON stays small; the model is not that precise)."""
    if isinstance(x, float):
        return float("%.5g" % x)
    if isinstance(x, dict):
        return {k: compact(v) for k, v in x.items()}
    if isinstance(x, list):
        return [compact(v) for v in x]
    return x


def table(data):
    """The grid as {"columns": [...], "rows": [[...], ...]} (rows of dicts repeat every key)."""
    cols = list(data["grid"][0])
    return dict(data, grid={"columns": cols, "rows": [[r[c] for c in cols] for r in data["grid"]]})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="a100-80gb", help="GPU kind (stella_mpi/plan/gpus.py)")
    ap.add_argument("--gpu-table", default=None, help="JSON file of extra GPU kinds")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--samples", type=int, default=8, help="samples per GPU per step")
    ap.add_argument("--latency", type=float, default=0.025, help="one-way WAN latency per round, s")
    ap.add_argument("--fusion", type=int, default=Config.from_env().fusion_threshold,
                    help="bucket bytes (default: the runtime's STELLA_FUSION_THRESHOLD)")
    ap.add_argument("--pseudo-bucket", type=int, default=None,
                    help="bucket bytes of the local-steps pseudo-gradient exchange (default: --fusion, the "
                         "runtime's rule; 0: one fused buffer of the whole model, the rule before issue 32)")
    ap.add_argument("--cpu-factor", type=float, default=1.0, help="host CPU speed over this machine's, per core")
    ap.add_argument("--merge-shard", type=int, default=1 << 19, help="shard of the merge measurement")
    ap.add_argument("--costs", default=None, help="KernelCosts JSON to reuse instead of measuring")
    ap.add_argument("--full", action="store_true", help="measure the kernels at larger sizes (slower)")
    ap.add_argument("--tag", default="", help="suffix of the output files (e.g. before)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    gpu = gpus.get_gpu(args.gpu, gpus.load_table(args.gpu_table))
    t0 = time.time()
    if args.costs:
        with open(args.costs) as f:
            costs = kernel_costs.KernelCosts.from_dict(json.load(f)["kernel_costs"])
    else:
        costs = kernel_costs.measure(quick=not args.full)
    t_measure = time.time() - t0
    grid = []
    for model, *shape in MODELS:
        numels = param_numels(*shape)
        for g in GPUS_PER_CLUSTER:
            shards = shard_counts(numels, g, args.fusion)
            for c in CLUSTERS:
                for link in LINKS.values():
                    for route in ROUTES:
                        grid.append(simulate(costs, model, numels, c, g, link, route, gpu, args,
                                             None if route[1] == "local" else shards))
    data = {"command": " ".join(["bench/scale_study.py"] + (argv if argv is not None else sys.argv[1:])),
            "provenance": provenance(),
            "settings": {"gpu": gpu.to_dict(), "tokens": args.tokens, "samples": args.samples,
                         "latency_s": args.latency, "fusion_bytes": args.fusion, "pseudo_bucket_bytes": args.pseudo_bucket,
                         "cpu_factor": args.cpu_factor, "density": DENSITY, "local_every": H,
                         "models": {m[0]: sum(param_numels(*m[1:])) for m in MODELS},
                         "buckets": {m[0]: len(wire.buckets(param_numels(*m[1:]), args.fusion)) for m in MODELS},
                         "tree_min_payload": sparse_exchange.TREE_MIN_PAYLOAD},
            "kernel_costs": costs.to_dict(), "measure_s": t_measure,
            "grid": grid, "crossover": crossover(costs, args), "merge": merge_measured(costs, args),
            "memory_70b": memory_70b(costs, args)}
    os.makedirs(RESULTS, exist_ok=True)
    tag = "_" + args.tag if args.tag else ""
    path = os.path.join(RESULTS, "scale_study_32%s.json" % tag)
    if not args.no_plots:
        data["plots"] = plots(data, "scale" + tag)
    with open(path, "w") as f:
        json.dump(dict(compact(table(data)), provenance=data["provenance"]), f, separators=(",", ":"))
    print("wrote %s (%d rows, kernels measured in %.1f s, total %.1f s)" % (path, len(grid), t_measure,
                                                                           time.time() - t0))


if __name__ == "__main__":
    main()
