"""One training run for the end-to-end comparisons (bench/run_e2e.py, bench/bench_time_to_loss.py):
the same model, data, seed and steps under PyTorch DDP (gloo, flat over all ranks: the baseline
users have today; "powersgd" and "postlocal:H" add torch's PowerSGD hook and post-local SGD) or
under stella_mpi (dense hierarchical, sparse with a compressor, the CPU engine, a sparse
compressor whose density the adjuster re-tunes: "adapt:<compressor>", "cpuadapt:<compressor>",
or local steps: "local:H[:<compressor>]", "diloco:H[:<compressor>]", "sum:H[:<compressor>]" (outer
"sum"), "localadapt[:<compressor>]" (H chosen by the adjuster, step-time objective with --target);
<compressor> "thc" takes --bits; "auto:thc" is the automatic route with THC 4 bits as its only
pseudo-gradient rung).

Launched by stellarun (usually with --wan RATE); rank 0 writes the per-step records to --out.
Mode "compute" trains each rank on its own with no exchange at all: the compute time alone,
measured under the same launch and the same CPU contention as the other modes.

With --target-loss the run stops at the first step where the mean training loss (over ranks,
then over the last --window steps) is at or below the target, and records the wall-clock time
and step it got there: time to a target loss is measured, not extrapolated.

Workloads: "comm" -- a ~25M-parameter MLP on random data with a small batch (communication
dominates); "lm" -- the byte-level language model on Python's standard-library sources
(examples/stdlib_text.py), for time to a target loss.
"""
import argparse
import collections
import json
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from stdlib_text import ByteBatches, ByteMLP, load_corpus  # noqa: E402
from baseline_dist import init_gloo_world  # noqa: E402
from provenance import provenance  # noqa: E402


def comm_heavy_model():
    """25.2M parameters: 2048 -> 4096 -> 4096 -> 1024 -> 10."""
    return torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                               torch.nn.ReLU(), torch.nn.Linear(4096, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


class RandomTask:
    def __init__(self, rank, batch):
        self.g = torch.Generator().manual_seed(100 + rank)
        self.w = torch.randn(2048, 10, generator=torch.Generator().manual_seed(7))
        self.batch = batch

    def next(self):
        x = torch.randn(self.batch, 2048, generator=self.g)
        return x, (x @ self.w).argmax(1)

    def validation(self):
        g = torch.Generator().manual_seed(99)
        x = torch.randn(512, 2048, generator=g)
        return x, (x @ self.w).argmax(1)


def timed_optimizer_steps(model, opt, batch, steps):
    """Seconds of each of ``steps`` DistributedOptimizer steps (forward, backward, reduction,
    update), the ranks meeting at a barrier before each; one more step first, untimed (it builds
    buffers)."""
    import stella_mpi as hvd
    times = []
    for step in range(steps + 1):
        x, y = batch()
        hvd.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step:
            times.append(time.perf_counter() - t0)
    return times


def ddp_setup(model):
    init_gloo_world()
    return torch.nn.parallel.DistributedDataParallel(model)


def cluster_ranks():
    """The ranks of each cluster (stellarun's STELLA_CLUSTER labels, else one cluster), in the
    order of their lowest rank: the layout the torch peers' subgroups follow."""
    labels = MPI.COMM_WORLD.allgather(os.environ.get("STELLA_CLUSTER", "one"))
    order = []
    for label in labels:
        if label not in order:
            order.append(label)
    return [[r for r, lab in enumerate(labels) if lab == label] for label in order]


def torch_peer_setup(model, opt, mode):
    """The torch peers of issue 14's benchmark, as a DDP user would set them up:
    "powersgd" (DDP with torch's PowerSGD comm hook, rank 1, error feedback, 10 dense warm-up
    steps) and "postlocal:H" (torch's post-local SGD: gradients averaged inside each cluster by the
    PostLocalSGDState hook's subgroup, models averaged over all ranks every H steps by
    PostLocalSGDOptimizer with a PeriodicModelAverager)."""
    import torch.distributed as dist
    init_gloo_world()
    net = torch.nn.parallel.DistributedDataParallel(model)
    if mode == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return net, opt
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    period = int(mode.split(":")[1])
    subgroup, _ = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=cluster_ranks())
    # local steps from the first step, as stella's LocalSteps (a warm-up of global allreduces would
    # spend the first steps on the WAN: at 20 Mbit/s a whole 40 s run)
    state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=0)
    net.register_comm_hook(state, post_localSGD_hook)
    return net, PostLocalSGDOptimizer(optim=opt, averager=PeriodicModelAverager(period=period, warmup_steps=0))


def postlocal_averaged(opt):
    """Whether post-local SGD's last ``opt.step()`` averaged the models (PeriodicModelAverager's
    rule: at its calls warmup, warmup + period, ...)."""
    averager = opt.averager
    s = averager.step - 1
    return s >= averager.warmup_steps and (s - averager.warmup_steps) % averager.period == 0


def record_agreed(records, own, agreed, size, hvd, args):
    """Append the agreed steps' records (this rank's own figures in ``own``, by step, popped);
    returns whether the time budget is over as of the last of them."""
    for step, loss_sum, wan_all, compute_max, elapsed in agreed:
        mine = own.pop(step)
        records.append({"step": step, "loss": loss_sum / size, "step_s": mine["step_s"], "elapsed_s": elapsed,
                        "compute_s": compute_max, "wan_bytes_rank": mine["wan_bytes_rank"],
                        "wan_bytes_all": wan_all if hvd else None,
                        **{k: v for k, v in mine.items() if k not in ("step_s", "wan_bytes_rank")}})
    return bool(args.time_budget) and bool(records) and records[-1]["elapsed_s"] >= args.time_budget


def target_reached(records, args, since=0):
    """The first step where the mean training loss over the last --window steps is at or below
    --target-loss: {"step", "elapsed_s"}, or None (windows ending before record ``since`` are
    not checked again)."""
    for i in range(max(args.window - 1, since), len(records)):
        window = records[i - args.window + 1:i + 1]
        if sum(r["loss"] for r in window) / args.window <= args.target_loss:
            return {"step": records[i]["step"], "elapsed_s": records[i]["elapsed_s"]}
    return None


def sum_over_ranks(values):
    """``values`` (floats) reduced over COMM_WORLD, through mpi4py's buffer call: its pickle-based
    ``comm.allreduce`` holds Python's GIL while it waits for the other ranks, so stella_mpi's
    collective thread cannot run on this rank meanwhile, and a rank whose step still waits on
    that thread never comes (an intermittent deadlock: docs/guides/failures.md)."""
    buf = np.array(values, dtype=np.float64)
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return buf


class StepLedger:
    """The per-step bookkeeping of a run, which must not wait on the WAN at every step.

    Each step's mean loss and WAN bytes (sums over the ranks) and its slowest rank's compute time
    and clock (maxima) travel in two non-blocking allreduces started at the step's end and read
    ``lag`` steps later. Every rank reads the same values at the same step, so they stop at the
    time budget and at a target loss alike; what they act on is ``lag`` steps old. (Two blocking
    allreduces a step put two round trips of the link into every step: with --wan-delay 25ms about
    100 ms, more than a step's compute on this model, and as much on every peer.)"""

    def __init__(self, comm, lag=4):
        self.comm = comm
        self.lag = lag
        self.flight = collections.deque()   # (step, sums, maxima, sum request, max request)

    def add(self, step, loss, wan, compute, clock):
        """This rank's figures of ``step``; returns the steps now agreed, each (step, loss sum,
        WAN bytes sum, compute max, clock max), oldest first (one, or none in the first ``lag``)."""
        sums, maxima = np.array([loss, wan], dtype=np.float64), np.array([compute, clock], dtype=np.float64)
        self.flight.append((step, sums, maxima, self.comm.Iallreduce(MPI.IN_PLACE, sums, op=MPI.SUM),
                            self.comm.Iallreduce(MPI.IN_PLACE, maxima, op=MPI.MAX)))
        return self._take(len(self.flight) - self.lag)

    def slowest(self, clock):
        """The largest of the ranks' ``clock`` (blocking: every rank calls it at the same step;
        an evaluation's own time, taken out of the training clocks)."""
        buf = np.array([clock], dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        return float(buf[0])

    def finish(self):
        """The steps still in flight (every rank calls it after the same step)."""
        return self._take(len(self.flight))

    def _take(self, n):
        out = []
        for _ in range(max(0, n)):
            step, sums, maxima, a, b = self.flight.popleft()
            MPI.Request.Waitall([a, b])
            out.append((step, float(sums[0]), float(sums[1]), float(maxima[0]), float(maxima[1])))
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, help="compute, ddp, powersgd, postlocal:H, auto (the untouched Horovod "
                                                 "script: the automatic route), dense, sparse:<compressor>, "
                                                 "cpu:<compressor>, adapt:<compressor>, cpuadapt:<compressor>, "
                                                 "local:H[:<compressor>], diloco:H[:<compressor>], "
                                                 "switch:<compressor> (sparse route or local steps with THC "
                                                 "--bits pseudo-gradients, the adjuster choosing)")
    p.add_argument("--workload", choices=["comm", "lm"], default="comm")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--overlap", action="store_true", help="local:H / diloco:H / localadapt: LocalSteps(overlap=True)")
    p.add_argument("--fragments", type=int, default=1, help="local:H / diloco:H: Streaming DiLoCo's fragments")
    p.add_argument("--fragment-delay", type=int, default=0, help="local:H / diloco:H: LocalSteps(delay=...)")
    p.add_argument("--inner", choices=("cluster", "rank"), default="cluster",
                   help="local:H / diloco:H: LocalSteps(inner=...): each cluster a replica, or each rank")
    p.add_argument("--bits", type=int, default=4, help="the thc compressor's bits (sparse:thc, local:H:thc)")
    p.add_argument("--singles", type=float, default=None,
                   help="the cacheaware compressor's share of bytes for single entries beside its blocks (default: "
                        "the compressor's)")
    p.add_argument("--thc-bits", type=int, nargs="*", default=[],
                   help="adapt modes: THC rungs the adjuster may choose besides the densities (hvd.Adjuster(thc_bits=))")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                   help="the inner optimizer: SGD with momentum 0.9 (the benches' usual), or Adam (give --lr 2e-3)")
    p.add_argument("--auto-outer", choices=["chosen", "nesterov"], default="chosen",
                   help="auto: the outer step of its THC rung as the route chooses it by the inner optimizer, or "
                        "DiLoCo's Nesterov whatever the inner optimizer (the previous release's choice; an ablation)")
    p.add_argument("--outer-lr", type=float, help="diloco:H: LocalSteps(outer_lr=...) (default: its own, 0.7)")
    p.add_argument("--outer-momentum", type=float, help="diloco:H: LocalSteps(outer_momentum=...) (default: 0.9)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the lm workload's model")
    p.add_argument("--target-loss", type=float, help="stop once the windowed training loss reaches this")
    p.add_argument("--window", type=int, default=10, help="steps averaged for --target-loss")
    p.add_argument("--min-density", type=float, default=1e-3)
    p.add_argument("--max-density", type=float, default=0.1)
    p.add_argument("--target", type=float, default=1.2, help="adjuster: step time / compute time allowed")
    p.add_argument("--objective", choices=["time_to_loss", "step_time"], default="time_to_loss",
                   help="adapt modes: the adjuster's objective")
    p.add_argument("--decisions-out", help="adapt modes: every rank writes its decisions and telemetry "
                                           "to this path + '.rank<N>'")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="train for this many seconds (the slowest rank's clock; evaluations not counted), "
                        "at most --steps steps")
    p.add_argument("--eval-seconds", type=float, default=0.0,
                   help="training seconds between held-out evaluations recorded in 'curve' (0: at the end only)")
    p.add_argument("--plain-sparse", action="store_true",
                   help="stella sparse modes without momentum correction and warm-up (the previous release's defaults)")
    p.add_argument("--chunk", type=int, default=None,
                   help="the sparseloco and dct compressors' chunk (entries; their default when not given)")
    p.add_argument("--feedback-decay", type=float, default=1.0,
                   help="the sparseloco and dct compressors' feedback_decay (SparseLoCo: 0.95 with outer 'average')")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order (0: the benches' usual run)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if args.workload == "comm":
        model, task = comm_heavy_model(), RandomTask(rank, 8)
    else:
        model, task = ByteMLP(32, hidden=args.hidden), ByteBatches(load_corpus(), 32, 64, seed=1 + rank + 1000 * args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9) if args.optimizer == "sgd" \
        else torch.optim.Adam(model.parameters(), lr=args.lr)
    hvd = None
    if args.mode == "compute":
        net = model
    elif args.mode == "ddp":
        net = ddp_setup(model)
    elif args.mode == "powersgd" or args.mode.startswith("postlocal:"):
        net, opt = torch_peer_setup(model, opt, args.mode)
    else:
        if args.mode == "dense":   # Horovod's exact dense numerics across clusters (not the automatic route)
            os.environ["STELLA_WAN_ROUTE"] = "dense"
        import stella_mpi as hvd
        if args.auto_outer == "nesterov":   # the ablation: the previous release's THC outer step for every inner
            from stella_mpi.optim import tuning
            tuning.AUTO_OUTER_ADAPTIVE = tuning.AUTO_OUTER
        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        kind, _, comp_name = args.mode.partition(":")
        local_steps = None
        if kind in ("local", "diloco", "sum"):   # local:H[:compressor]: model averaging, DiLoCo's outer
            # Nesterov, or the clusters' sum (SparseLoCo's sparse pseudo-gradients)
            every, _, comp_name = comp_name.partition(":")
            local_steps = hvd.LocalSteps(every=int(every), outer={"local": "average"}.get(kind, "nesterov" if kind ==
                                                                                          "diloco" else "sum"),
                                         overlap=args.overlap, fragments=args.fragments, delay=args.fragment_delay,
                                         inner=args.inner, **{k: v for k, v in (("outer_lr", args.outer_lr),
                                                                                ("outer_momentum", args.outer_momentum))
                                                              if v is not None})
        adjuster = None
        if kind == "localadapt":   # localadapt[:compressor]: model averaging, H chosen by the adjuster
            local_steps = hvd.LocalSteps(every=1, overlap=args.overlap)
            adjuster = hvd.Adjuster(objective="step_time", target=args.target)
        if kind == "auto" and comp_name == "thc":   # auto:thc: the automatic route with the previous release's
            # pseudo-gradient, THC 4 bits alone (the adjuster chooses H and the mode, not the rung)
            adjuster, comp_name = hvd.Adjuster(pseudo_rungs=(hvd.Compression.thc(bits=4),)), ""
        if kind == "switch":   # switch:<compressor>: the adjuster moves between the sparse route and local steps
            local_steps = hvd.LocalSteps(every=1, compression=hvd.Compression.thc(bits=args.bits))
            adjuster = hvd.Adjuster(modes=("sync", "local"), min_density=args.min_density,
                                    max_density=args.max_density, target=args.target)
        if comp_name == "thc":
            comp = hvd.Compression.thc(bits=args.bits)
        else:   # the sparse compressors with their defaults (momentum correction, warm-up, singles), or as told
            extra = {"singles": args.singles} if args.singles is not None and comp_name == "cacheaware" else {}
            if args.plain_sparse:
                extra.update(momentum_correction=False, warmup=0)
            if comp_name in ("sparseloco", "dct"):   # chunked top-k, values on --bits (dct: 0 for float32)
                extra.update(bits=args.bits or None, feedback_decay=args.feedback_decay,
                             **({"chunk": args.chunk} if args.chunk else {}))
            comp = getattr(hvd.Compression, comp_name)(density=args.density, **extra) if comp_name \
                else hvd.Compression.none
        if kind in ("adapt", "cpuadapt"):
            adjuster = hvd.Adjuster(min_density=args.min_density, max_density=args.max_density, target=args.target,
                                    thc_bits=tuple(args.thc_bits), objective=args.objective)
        if kind in ("cpu", "cpuadapt"):
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp,
                                           engine=hvd.CpuEngine(staleness=1, model=model), adjuster=adjuster)
        elif local_steps is not None:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp,
                                           local_steps=local_steps, adjuster=adjuster)
        else:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp,
                                           adjuster=adjuster)
        net = model
    vx, vy = task.validation()

    # post-local SGD: the model the ranks last averaged (the initial one before), evaluated as
    # stella's local steps are, on their last agreed model
    postlocal = {"agreed": {n: p.detach().clone() for n, p in model.named_parameters()}} \
        if args.mode.startswith("postlocal") else None

    def agreed_parameters():
        if postlocal is not None:
            return postlocal["agreed"]
        if hvd and hasattr(opt, "consensus_parameters"):
            return opt.consensus_parameters() or None
        return None

    def held_out_loss():
        if hvd and args.mode.startswith("cpu"):
            opt.drain()   # the updates in flight into the model first
        with torch.no_grad():
            agreed = agreed_parameters()
            if agreed:
                # local steps (stella's, or torch's post-local SGD): the model the clusters last
                # agreed on (one model, the same everywhere), swapped in for the evaluation only
                mine = {n: p.detach().clone() for n, p in model.named_parameters()}
                for n, p in model.named_parameters():
                    p.copy_(agreed[n])
                loss = torch.nn.functional.cross_entropy(model(vx), vy).item()
                for n, p in model.named_parameters():
                    p.copy_(mine[n])
            else:
                loss = torch.nn.functional.cross_entropy(model(vx), vy).item()
            return sum_over_ranks([loss])[0] / size

    records, reached, curve = [], None, []
    ledger, own = StepLedger(MPI.COMM_WORLD), {}
    MPI.COMM_WORLD.Barrier()
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
        loss.backward()
        compute = time.perf_counter() - c0
        opt.step()
        if postlocal is not None and postlocal_averaged(opt):
            postlocal["agreed"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        now = time.perf_counter()
        st = hvd.stats()["last_step"] if hvd else {}
        wan = st.get("wan_bytes_sent", 0)
        own[step] = {"step_s": now - last, "wan_bytes_rank": wan if hvd else None,
                       "density": st.get("adjust_density", st.get("density")),
                       "sent_density": st.get("density"),   # measured: entries sent / elements
                       "residual_norm_ratio": st.get("residual_norm_ratio"),
                       "wan_bandwidth_bps": st.get("wan_bandwidth_bps"),
                       "local_steps_every": getattr(opt, "local_steps_every", None),
                       "route": getattr(opt, "mode", None), "route_desc": getattr(opt, "route", None)}
        agreed = ledger.add(step, loss.item(), wan, compute, now - t0 - paused)
        before = len(records)
        over = record_agreed(records, own, agreed, size, hvd, args) if agreed else False
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
            dt = time.perf_counter() - e0
            paused += dt
            if hasattr(opt, "exclude_time"):
                opt.exclude_time(dt)   # nor in the adjuster's timing of the next step or period
            now = time.perf_counter()
        if over:
            break
        last = now
    before = len(records)
    record_agreed(records, own, ledger.finish(), size, hvd, args)
    if args.target_loss is not None and reached is None:
        reached = target_reached(records, args, before)
    if hvd and args.mode.startswith("cpu"):
        opt.drain()
    # the adjuster's session (the switching optimizer keeps it while local steps run)
    session = getattr(getattr(opt, "_tuner", None), "session", None) or getattr(opt, "_session", None)
    if hvd and args.decisions_out and session is not None:
        with open("%s.rank%d" % (args.decisions_out, rank), "w") as f:
            json.dump({"provenance": provenance(),
                       "decisions": [(s, d.density, d.passes, d.reason) for s, d in opt.adjust_decisions],
                       "trace": list(session.trace), "settings": vars(session.settings),
                       "overlap": session.controller.overlap, "start_density": session.start_density,
                       "mode_switches": [(s, m) for s, m, _ in getattr(opt, "mode_switches", [])],
                       "mode_votes": list(getattr(getattr(opt, "_tuner", None), "votes", []))}, f)
    val = curve[-1]["validation_loss"] if curve and curve[-1]["step"] == len(records) else held_out_loss()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "mode": args.mode, "workload": args.workload, "records": records,
                       "validation_loss": val, "curve": curve,
                       "target_loss": args.target_loss, "window": args.window, "reached": reached,
                       "clusters": hvd.num_clusters() if hvd else None,
                       "mode_switches": getattr(opt, "mode_switches", None),
                       "route_changes": getattr(opt, "route_changes", None),
                       "parameters": sum(q.numel() for q in model.parameters()),
                       "wan_rate_bps": float(os.environ.get("STELLA_WAN_RATE_BPS", "0") or 0),
                       "wan_mode": os.environ.get("STELLA_WAN_MODE", "none"), "t0_unix": t0_unix}, f)
    if hvd:
        hvd.shutdown()


if __name__ == "__main__":
    main()
