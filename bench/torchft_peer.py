"""torchft's DiLoCo and Streaming DiLoCo as peers of the end-to-end comparisons: the same training
run as bench/e2e_train.py (same model, data, seed, initial weights, inner SGD with momentum,
evaluation schedule and JSON records), its communication done by torchft
(https://github.com/pytorch/torchft, ``pip install torchft``), which this script only calls.

Launched as e2e_train.py is, e.g.

    stellarun -np 4 --clusters 2 --wan 100mbit .venv/bin/python bench/torchft_peer.py \\
        --workload lm --mode torchft-diloco:8 --time-budget 40 --eval-seconds 2 --out run.json

Modes: "torchft-diloco:H" (torchft.local_sgd.DiLoCo with the whole model as one fragment: the
replicas average their pseudo-gradients every H inner steps, then the outer optimizer steps) and
"torchft-streaming:H[:F]" (Streaming DiLoCo: the same class with the model cut into F fragments,
default 2, one fragment synchronized every H/F steps, each every H steps; --fragment-sync-delay
steps of overlap, the paper's tau).

Layout: each cluster of the job is one torchft replica group (stellarun's STELLA_CLUSTER labels
under --wan, as e2e_train's cluster_ranks(); without --wan, STELLA_CLUSTERS=N split into
contiguous runs of ranks). Inside it the ranks average gradients every step (torch DDP over a
gloo group of the cluster's ranks, as stella's LocalSteps averages inside a cluster; --intra fsdp:
FSDP2 instead, torchft's HSDP); across clusters torchft's Manager (a torchft ProcessGroupGloo
joining the ranks of equal rank in their groups, quorum through a lighthouse) carries DiLoCo's
outer synchronization. Rank 0 runs the lighthouse (torchft._torchft.LighthouseServer) in its
process; each cluster's first rank runs the cluster's TCPStore (the Manager's store, and the
intra-cluster group's). Addresses: each cluster's STELLA_WAN_ADDR under ``stellarun --wan``
(network namespaces; gloo binds wan0 there through stellarun's GLOO_SOCKET_IFNAME), loopback
otherwise.

The held-out loss is that of the model the replicas last agreed on (torchft's global copy of
each fragment: DiLoCo's backup of the parameters, the initial weights before the first sync), as
e2e_train evaluates stella's local steps and torch's post-local SGD.

torchft's ``should_quantize`` (fp8 row-wise, not 4-bit) needs triton (GPU kernels); without it
torchft silently sends full precision, so --quantize is refused on a machine without triton.

Records: e2e_train's fields (wan_bytes_rank None, as its torch peers), plus "outer_step" (torchft's
committed syncs) and "ft_sync_bytes_rank" (bytes this rank handed torchft's allreduce in the sync
completed at that step: counted, not measured); the JSON adds "torchft" (settings) and, under
namespaces, "wan_tx_bytes_clusters" (measured: each cluster's wan0 tx bytes over the run, which
include the MPI bookkeeping and evaluations every mode has).
"""
import argparse
import itertools
import json
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
from mpi4py import MPI

# torchft's Rust side logs every quorum and commit at INFO on stderr; RUST_LOG=info brings them back
os.environ.setdefault("RUST_LOG", "warn")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# e2e_train puts examples/ on the path and brings the workloads and the cluster layout
from e2e_train import (RandomTask, StepLedger, cluster_ranks, comm_heavy_model, record_agreed,  # noqa: E402
                       target_reached)
from stdlib_text import ByteBatches, ByteMLP, load_corpus  # noqa: E402
from provenance import provenance  # noqa: E402


def parse_mode(mode):
    """("diloco" | "streaming", H, F) from "torchft-diloco:H" / "torchft-streaming:H[:F]"."""
    parts = mode.split(":")
    if parts[0] == "torchft-diloco" and len(parts) == 2:
        return "diloco", int(parts[1]), 1
    if parts[0] == "torchft-streaming" and len(parts) in (2, 3):
        return "streaming", int(parts[1]), int(parts[2]) if len(parts) == 3 else 2
    raise SystemExit("torchft_peer.py: --mode must be torchft-diloco:H or torchft-streaming:H[:F], not %r" % mode)


def fragments_of(model, count):
    """The model's parameterized leaf modules cut into ``count`` contiguous fragments (in module
    order) with the smallest largest fragment: torch.nn.ModuleLists sharing the model's modules."""
    leaves = [m for m in model.modules() if not list(m.children()) and list(m.parameters())]
    if count > len(leaves):
        raise SystemExit("torchft_peer.py: %d fragments asked, the model has %d parameterized modules"
                         % (count, len(leaves)))
    sizes = [sum(p.numel() for p in m.parameters()) for m in leaves]
    best = None
    for cuts in itertools.combinations(range(1, len(leaves)), count - 1):
        bounds = (0,) + cuts + (len(leaves),)
        worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or worst < best[0]:
            best = (worst, bounds)
    bounds = best[1]
    return [torch.nn.ModuleList(leaves[a:b]) for a, b in zip(bounds, bounds[1:])]


def replica_groups():
    """The ranks of each replica group: stellarun's STELLA_CLUSTER labels (--wan) as e2e_train's
    cluster_ranks() reads them; without labels, STELLA_CLUSTERS=N (stellarun --clusters N without
    --wan) split into contiguous runs, the first ones larger by one (stellarun's and stella_mpi's
    split); else one group."""
    comm = MPI.COMM_WORLD
    labelled = np.array([int("STELLA_CLUSTER" in os.environ)])
    comm.Allreduce(MPI.IN_PLACE, labelled, op=MPI.MIN)
    if labelled[0]:
        return cluster_ranks()
    n = int(os.environ.get("STELLA_CLUSTERS", "1") or 1)
    q, r = divmod(comm.Get_size(), n)
    sizes = [q + (1 if i < r else 0) for i in range(n)]
    starts = np.cumsum([0] + sizes)
    return [list(range(starts[i], starts[i + 1])) for i in range(n)]


def local(p):
    """A parameter's tensor on this rank: its shard under FSDP (a DTensor), else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def start_torchft(args, model, every, nfrag):
    """The replica groups, lighthouse, Manager, inner optimizer and DiLoCo; returns
    (net, inner optimizer, diloco, manager, keep, info): keep holds the servers this process runs
    (alive until the end) and the fragments."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    clusters = replica_groups()
    replica = next(i for i, ranks in enumerate(clusters) if rank in ranks)
    group = clusters[replica]
    group_rank, group_size = group.index(rank), len(group)
    if len({len(c) for c in clusters}) != 1:
        # torchft pairs rank r of every replica group: the groups must be the same size
        raise SystemExit("torchft_peer.py: clusters of unequal sizes %s" % [len(c) for c in clusters])
    addr = os.environ.get("STELLA_WAN_ADDR", "127.0.0.1")          # this cluster's address
    master = os.environ.get("STELLA_WAN_MASTER_ADDR", "127.0.0.1")   # rank 0's cluster's
    timeout = timedelta(seconds=args.ft_timeout)
    keep = {}

    # the lighthouse (rank 0) and every cluster's TCPStore (its first rank), then their ports
    lighthouse_port = None
    if rank == 0:
        keep["lighthouse"] = LighthouseServer(bind="[::]:0", min_replicas=len(clusters),
                                              join_timeout_ms=int(args.ft_timeout * 1000), quorum_tick_ms=10)
        lighthouse_port = int(keep["lighthouse"].address().rsplit(":", 1)[1])
    lighthouse_port = comm.bcast(lighthouse_port, root=0)
    store_port = None
    if group_rank == 0:
        keep["store"] = TCPStore(host_name=addr, port=0, is_master=True, wait_for_workers=False, timeout=timeout)
        store_port = keep["store"].port
    store_port = comm.allgather(store_port)[group[0]]

    # inside the replica group (the default torch.distributed group: the cluster's ranks, gloo),
    # gradients averaged every step: DDP, or FSDP2 (torchft's HSDP: each rank holds, and sends
    # across replicas, a shard of the model)
    intra = PrefixStore("intra", TCPStore(host_name=addr, port=store_port, is_master=False,
                                          wait_for_workers=False, timeout=timeout))
    dist.init_process_group("gloo", store=intra, rank=group_rank, world_size=group_size, timeout=timeout)
    if args.intra == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # one FSDP unit, kept unsharded from forward to backward: one all-gather and one
        # reduce-scatter a step (per-layer units with resharding cost 2x DDP's step on this CPU)
        fully_shard(model, mesh=init_device_mesh("cpu", (group_size,)), reshard_after_forward=False)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum) if args.optimizer == "sgd" else \
        torch.optim.Adam(model.parameters(), lr=args.lr)

    # across replica groups: torchft
    def state_dict():
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=len(clusters), use_async_quorum=False, timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout, rank=group_rank, world_size=group_size,
                      store_addr=addr, store_port=store_port,
                      lighthouse_addr="http://%s:%d" % (master, lighthouse_port),
                      replica_id="stella_replica_%d" % replica, hostname=addr,
                      init_sync=False)   # every rank starts from the same seeded weights
    fragments = [model] if nfrag == 1 else fragments_of(model, nfrag)
    outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                             nesterov=args.nesterov) for f in fragments]
    extra = {}
    if args.bucket_cap_mb:
        extra = {"use_bucketization": True, "bucket_cap_mb": args.bucket_cap_mb}
    diloco = DiLoCo(manager, fragments, inner, outer if nfrag > 1 else outer[0], sync_every=every,
                    backup_device=torch.device("cpu"), pin_memory=False, should_quantize=args.quantize,
                    fragment_sync_delay=args.fragment_sync_delay,
                    fragment_update_alpha=args.fragment_update_alpha, **extra)
    keep["fragments"] = fragments
    # what this rank hands torchft's allreduce at each sync of a fragment (its shard under FSDP)
    keep["fragment_bytes"] = [sum(local(q).numel() * local(q).element_size() for q in f.parameters())
                              for f in fragments]
    info = {"replica": replica, "group_rank": group_rank, "group_size": group_size, "replicas": len(clusters),
            "intra": args.intra, "lighthouse": "http://%s:%d" % (master, lighthouse_port),
            "store": "%s:%d" % (addr, store_port),
            "fragment_parameters": [sum(q.numel() for q in f.parameters()) for f in fragments],
            "fragment_bytes_rank": keep["fragment_bytes"]}
    return net, inner, diloco, manager, keep, info


def wan_tx_bytes():
    """Bytes this cluster's namespace sent on its WAN link (wan0) so far; None outside namespaces."""
    try:
        with open("/sys/class/net/wan0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def agreed_parameters(model, diloco, fragments):
    """The model the replicas last agreed on: torchft's global copy of each fragment (DiLoCo's
    backup, which it restores before every outer step and refreshes after it), by model name."""
    names = {id(p): n for n, p in model.named_parameters()}
    agreed = {}
    for frag, state in zip(fragments, diloco._fragments):
        for fname, p in frag.named_parameters():
            agreed[names[id(p)]] = state.original_parameters[fname]   # local shard under FSDP
    return agreed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", required=True, help="torchft-diloco:H or torchft-streaming:H[:F]")
    p.add_argument("--workload", choices=["comm", "lm"], default="lm")
    p.add_argument("--steps", type=int, default=1000000)
    p.add_argument("--time-budget", "--seconds", dest="time_budget", type=float, default=0.0,
                   help="train for this many seconds (the slowest rank's clock; evaluations not counted), "
                        "at most --steps steps")
    p.add_argument("--eval-seconds", type=float, default=0.0,
                   help="training seconds between held-out evaluations recorded in 'curve' (0: at the end only)")
    p.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="inner SGD momentum (e2e_train: 0.9)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                   help="the inner optimizer, as e2e_train's: SGD with --momentum, or Adam (give --lr 2e-3)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the lm workload's model")
    p.add_argument("--seed", type=int, default=0, help="initial weights' seed (e2e_train: 0); data seeds "
                                                      "1 + rank + seed")
    p.add_argument("--target-loss", type=float, help="stop once the windowed training loss reaches this")
    p.add_argument("--window", type=int, default=10, help="steps averaged for --target-loss")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD learning rate (DiLoCo: 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer SGD momentum (DiLoCo: 0.9)")
    p.add_argument("--no-nesterov", dest="nesterov", action="store_false", help="outer SGD without Nesterov")
    p.add_argument("--fragment-sync-delay", type=int, default=0,
                   help="inner steps a fragment's allreduce may overlap before it is waited for (Streaming "
                        "DiLoCo's tau; < H/F)")
    p.add_argument("--overlap", action="store_true", help="shorthand for --fragment-sync-delay 1")
    p.add_argument("--fragment-update-alpha", type=float, default=0.0,
                   help="mix of local into global parameters after a fragment's outer step (0: global only)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.0,
                   help="torchft's bucketized allreduce with buckets of this many MB (0: one allreduce per tensor)")
    p.add_argument("--quantize", action="store_true", help="torchft's should_quantize (needs triton)")
    p.add_argument("--intra", choices=["ddp", "fsdp"], default="ddp",
                   help="gradient averaging inside a replica group: DDP (as e2e_train's torch peers; every rank "
                        "of a group allreduces the whole pseudo-gradient across replicas, so a cluster sends "
                        "the model once per rank) or FSDP2 (torchft's HSDP: each rank holds and sends a shard, "
                        "a cluster sends the model once, as stella's LocalSteps; slower inner steps on CPU)")
    p.add_argument("--ft-timeout", type=float, default=120.0, help="torchft's timeouts (collectives, quorum)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    kind, every, nfrag = parse_mode(args.mode)
    if args.overlap and not args.fragment_sync_delay:
        args.fragment_sync_delay = 1
    # torchft's own rules (DiLoCo.__init__), checked before any server starts
    if every < 1 or nfrag < 1 or every % nfrag:
        raise SystemExit("torchft_peer.py: H=%d must be a positive multiple of the %d fragments" % (every, nfrag))
    if not 0 <= args.fragment_sync_delay < every // nfrag:
        raise SystemExit("torchft_peer.py: --fragment-sync-delay %d must be below H/F = %d"
                         % (args.fragment_sync_delay, every // nfrag))
    if args.quantize:
        try:
            import triton  # noqa: F401
        except ImportError:
            raise SystemExit("torchft_peer.py: --quantize: torchft's quantized allreduce needs triton (GPU kernels), "
                             "absent here; without it torchft would send full precision")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.workload == "comm":
        model, task = comm_heavy_model(), RandomTask(rank, 8)
    else:
        model, task = ByteMLP(32, hidden=args.hidden), ByteBatches(load_corpus(), 32, 64, seed=1 + rank + args.seed)
    net, opt, diloco, manager, keep, info = start_torchft(args, model, every, nfrag)
    diloco.__enter__()   # its hooks on the inner optimizer: the outer syncs happen inside opt.step()
    vx, vy = task.validation()

    def held_out_loss():
        with torch.no_grad():
            agreed = agreed_parameters(model, diloco, keep["fragments"])
            mine = {n: local(q).detach().clone() for n, q in model.named_parameters()}
            for n, q in model.named_parameters():
                local(q).copy_(agreed[n])
            loss = torch.nn.functional.cross_entropy(model(vx), vy).item()
            if hasattr(model, "reshard"):
                model.reshard()   # FSDP: a forward without backward leaves the evaluated model gathered
            for n, q in model.named_parameters():
                local(q).copy_(mine[n])
            buf = np.array([loss])
            comm.Allreduce(MPI.IN_PLACE, buf)   # (not comm.allreduce: that one holds the GIL while it waits)
            return float(buf[0]) / size

    records, reached, curve = [], None, []
    ledger, own = StepLedger(comm), {}
    comm.Barrier()
    tx0 = wan_tx_bytes()
    t0, t0_unix = time.perf_counter(), time.time()
    last = t0
    paused = 0.0        # seconds spent evaluating, taken out of every clock below
    next_eval = args.eval_seconds
    if args.eval_seconds:
        curve.append({"seconds": 0.0, "step": 0, "validation_loss": held_out_loss()})
        paused = time.perf_counter() - t0
        last = t0 + paused
    for step in range(1, args.steps + 1):
        x, y = task.next()
        opt.zero_grad()
        c0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()     # DDP (FSDP): the gradients averaged inside the cluster
        compute = time.perf_counter() - c0
        before = manager.current_step()   # a sync completed in this step carries fragment before % F
        opt.step()          # the inner step; every H/F steps torchft's outer sync of a fragment
        synced = keep["fragment_bytes"][before % nfrag] if manager.current_step() != before else 0
        now = time.perf_counter()
        # as e2e_train: the mean loss and the slowest rank's clocks, agreed a few steps later
        own[step] = {"step_s": now - last, "wan_bytes_rank": None,
                       "density": None, "sent_density": None, "residual_norm_ratio": None,
                       "wan_bandwidth_bps": None, "local_steps_every": every, "route": None,
                       "outer_step": manager.current_step(),   # torchft's count of committed syncs
                       # bytes this rank allreduced through torchft in the sync this step completed
                       # (counted, not measured on the wire; none for uncommitted syncs)
                       "ft_sync_bytes_rank": synced}
        agreed = ledger.add(step, loss.item(), 0.0, compute, now - t0 - paused)
        before = len(records)
        over = record_agreed(records, own, agreed, size, None, args) if agreed else False
        if args.target_loss is not None and reached is None:
            reached = target_reached(records, args, before)
            if reached is not None:
                break
        if args.eval_seconds and (over or (records and records[-1]["elapsed_s"] >= next_eval)):
            e0 = time.perf_counter()
            elapsed = ledger.slowest(time.perf_counter() - t0 - paused)
            curve.append({"seconds": elapsed, "step": step, "validation_loss": held_out_loss()})
            while next_eval <= elapsed:
                next_eval += args.eval_seconds
            paused += time.perf_counter() - e0
            now = time.perf_counter()
        if over:
            break
        last = now
    before = len(records)
    record_agreed(records, own, ledger.finish(), size, None, args)
    if args.target_loss is not None and reached is None:
        reached = target_reached(records, args, before)
    val = curve[-1]["validation_loss"] if curve and curve[-1]["step"] == len(records) else held_out_loss()
    diloco.__exit__(None, None, None)
    # measured: what each cluster's namespace sent on its WAN link during the run (torchft's
    # syncs and quorums, and the per-step MPI bookkeeping and evaluations e2e_train also does)
    tx = wan_tx_bytes()
    tx = comm.allgather(tx - tx0 if tx is not None and tx0 is not None and info["group_rank"] == 0 else None)
    from importlib.metadata import version
    settings = {"version": version("torchft"), "kind": kind, "sync_every": every,
                "fragments": nfrag, "fragment_sync_delay": args.fragment_sync_delay,
                "fragment_update_alpha": args.fragment_update_alpha, "outer_lr": args.outer_lr,
                "outer_momentum": args.outer_momentum, "nesterov": args.nesterov, "inner_optimizer": args.optimizer,
                "inner_lr": args.lr, "inner_momentum": args.momentum, "bucket_cap_mb": args.bucket_cap_mb or None,
                "should_quantize": args.quantize, "outer_steps": manager.current_step(),
                "batches_committed": manager.batches_committed(), **info}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "mode": args.mode, "workload": args.workload, "records": records,
                       "validation_loss": val,
                       "curve": curve, "target_loss": args.target_loss, "window": args.window, "reached": reached,
                       "clusters": info["replicas"], "mode_switches": None,
                       "parameters": sum(q.numel() for q in model.parameters()),
                       "wan_rate_bps": float(os.environ.get("STELLA_WAN_RATE_BPS", "0") or 0),
                       "wan_mode": os.environ.get("STELLA_WAN_MODE", "none"), "t0_unix": t0_unix,
                       "wan_tx_bytes_clusters": [b for b in tx if b is not None] or None,
                       "torchft": settings}, f)
    # every replica done with torchft before its servers go: managers, then the lighthouse and stores
    comm.Barrier()
    manager.shutdown(wait=False)
    comm.Barrier()
    if "lighthouse" in keep:
        keep["lighthouse"].shutdown()
    import torch.distributed as dist
    dist.destroy_process_group()
    comm.Barrier()


if __name__ == "__main__":
    main()
