"""A Horovod PyTorch training script; the only change for stella_mpi is the import line.

    mpirun -np 4 -env STELLA_CLUSTERS 2 python examples/train_horovod.py

trains a byte-level language model on Python's own standard-library sources, each rank on
its own batches, and checks at the end that every rank holds identical parameters.
"""
import argparse
import os
import sys
import time

import torch

import stella_mpi as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stdlib_text import ByteBatches, ByteMLP, load_corpus  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--log-every", type=int, default=20,
                        help="steps between logged lines (--pace time: exchanges)")
    parser.add_argument("--compression", default="none",
                        help="none, fp16, bf16, a sparse WAN compressor (topk, cacheaware, threshold, randomk, "
                             "sparseloco, dct: --bits, --chunk), or thc (homomorphic quantization, --bits)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction sent across clusters (sparse)")
    parser.add_argument("--bits", type=int, default=4, help="thc: bits per entry across clusters (2 to 8); sparseloco "
                        "and dct: bits per value (2, 4, 8; dct 0: float32 values)")
    parser.add_argument("--chunk", type=int, default=None, help="sparseloco and dct: entries per chunk")
    parser.add_argument("--feedback-decay", type=float, default=1.0,
                        help="sparseloco and dct: the residual's weight before the next exchange (SparseLoCo: 0.95)")
    parser.add_argument("--no-error-feedback", action="store_true", help="drop what a sparse compressor leaves")
    parser.add_argument("--singles", type=float, default=None,
                        help="cacheaware: share of the bytes spent on single entries beside the blocks (default: the "
                             "compressor's, 0.7)")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--hidden", type=int, default=256, help="width of the model's hidden layers")
    parser.add_argument("--engine", choices=["torch", "cpu"], default="torch",
                        help="cpu: stella_mpi's C optimizer on pinned cores with a CPU master copy")
    parser.add_argument("--staleness", type=int, default=1, help="CPU engine: 0 synchronous, 1 overlapped")
    parser.add_argument("--staleness-warmup", type=int, default=None,
                        help="CPU engine: run the first N steps synchronously before staleness 1 (default: the "
                             "engine's)")
    parser.add_argument("--no-stale-prediction", action="store_true",
                        help="CPU engine, staleness 1: give the forward the master weights, not the prediction")
    parser.add_argument("--json-out", help="write the final metrics here (rank 0)")
    parser.add_argument("--density-warmup", type=int, default=None,
                        help="steps over which the sparse density falls from 25 %% to --density (default: the "
                             "compressor's, 50)")
    parser.add_argument("--dense-below", type=int, default=0,
                        help="(deprecated, no gain measured) tensors of fewer elements go dense")
    parser.add_argument("--momentum-correction", choices=["auto", "off", "on", "masking"], default="auto",
                        help="DGC's momentum correction on the sparse route (auto: on for SGD with momentum; "
                             "masking is deprecated)")
    parser.add_argument("--local-steps", type=int, default=0,
                        help="H > 0: hvd.LocalSteps(every=H): clusters exchange the pseudo-gradient every H steps "
                             "(through --compression)")
    parser.add_argument("--outer", choices=["average", "nesterov", "sum", "sgd"], default="average",
                        help="--local-steps: model averaging, DiLoCo's outer Nesterov, the clusters' sum (SGD at lr C), "
                             "or plain SGD at --outer-lr")
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="--local-steps: the outer learning rate of --outer nesterov (0.7) or sgd (1.0: averaging)")
    parser.add_argument("--fragments", type=int, default=1,
                        help="--local-steps: Streaming DiLoCo's fragments, exchanged in turn (H a multiple of it)")
    parser.add_argument("--fragment-delay", type=int, default=0,
                        help="--local-steps: inner steps a fragment's exchange is in flight before it is applied")
    parser.add_argument("--inner", choices=["cluster", "rank"], default="cluster",
                        help="--local-steps: the replicas: each cluster (inner steps averaged in it) or each rank "
                             "(hvd.LocalSteps(inner='rank'): nothing reduced at inner steps)")
    parser.add_argument("--pace", choices=["steps", "time"], default="steps",
                        help="--local-steps: 'time': each cluster takes the steps that fit in the fastest cluster's "
                             "period of H steps (hvd.LocalSteps(pace='time'))")
    parser.add_argument("--slow-cluster-ms", type=float, default=0.0,
                        help="the last cluster's ranks sleep this long after every step (a slower GPU there; with "
                             "--pace time the fast cluster trains on meanwhile)")
    parser.add_argument("--local-clip", type=float, default=None,
                        help="(deprecated, no gain measured) DGC's local gradient clipping to norm C / sqrt(size)")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="train for this many seconds of wall-clock instead of --steps (evaluations not counted)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="steps between held-out evaluations recorded in the curve (0: by time or at the end)")
    parser.add_argument("--eval-seconds", type=float, default=0.0,
                        help="training seconds between held-out evaluations (0: by steps or at the end)")
    parser.add_argument("--check-seconds", type=float, default=0.5,
                        help="training seconds between the ranks' agreements on the clock (--time-budget)")
    parser.add_argument("--save-state", metavar="PATH",
                        help="at the end (every rank on the agreed parameters), write each rank's model, inner "
                             "optimizer state and data position to PATH.rank<R>.pt")
    parser.add_argument("--load-state", metavar="PATH",
                        help="start from what --save-state wrote (the same ranks and model), with a fresh outer "
                             "sync: training from a point mid-run, under any route")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model and batches live (cuda: this rank's GPU, local rank modulo the count)")
    args = parser.parse_args()
    if args.pace == "time" and not (args.local_steps and args.time_budget):
        parser.error("--pace time needs --local-steps and --time-budget (clusters take different numbers of steps)")

    hvd.init()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU here")
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    context = 32
    corpus = load_corpus()
    data = ByteBatches(corpus, context, args.batch_size, seed=1 + hvd.rank() + 1000 * args.seed)
    model = ByteMLP(context, hidden=args.hidden).to(device)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size() ** 0.5)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.compression in ("none", "fp16", "bf16"):
        compression = getattr(hvd.Compression, args.compression)
    elif args.compression == "thc":
        compression = hvd.Compression.thc(bits=args.bits, error_feedback=not args.no_error_feedback)
    else:   # the sparse route's options are the compressor's
        extra = {"singles": args.singles} if args.singles is not None else {}
        if args.density_warmup is not None:
            extra["warmup"] = args.density_warmup
        if args.momentum_correction in ("on", "off"):
            extra["momentum_correction"] = args.momentum_correction == "on"
        if args.compression in ("sparseloco", "dct"):
            extra.update(bits=args.bits or None, feedback_decay=args.feedback_decay)
            if args.chunk:
                extra["chunk"] = args.chunk
        compression = getattr(hvd.Compression, args.compression)(
            density=args.density, error_feedback=not args.no_error_feedback, **extra)
    deprecated = {k: v for k, v in (("dense_below", args.dense_below), ("local_clip", args.local_clip),
                                    ("momentum_correction", "masking" if args.momentum_correction == "masking"
                                     else None)) if v}

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if args.engine == "cpu":
        engine = hvd.CpuEngine(staleness=args.staleness, warmup=args.staleness_warmup, model=model,
                               prediction=False if args.no_stale_prediction else None)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression, engine=engine, **deprecated)
    elif args.local_steps:
        outer, outer_lr = args.outer, {} if args.outer_lr is None else {"outer_lr": args.outer_lr}
        if args.outer == "sgd":   # a callable: one plain SGD per fragment, at the outer learning rate
            lr = 1.0 if args.outer_lr is None else args.outer_lr
            outer, outer_lr = (lambda params: torch.optim.SGD(params, lr=lr)), {}
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression,
                                             local_steps=hvd.LocalSteps(every=args.local_steps, outer=outer, **outer_lr,
                                                                        fragments=args.fragments,
                                                                        delay=args.fragment_delay, pace=args.pace,
                                                                        inner=args.inner))
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression, **deprecated)

    if args.load_state:
        load_state(args.load_state, model, optimizer, data, device, average=not args.local_steps)
    if hvd.rank() == 0:
        nparams = sum(p.numel() for p in model.parameters())
        print("stella_mpi: %d ranks in %d clusters (this rank: cluster %d of size %d); model %.2fM parameters; "
              "%.1f MB of stdlib text" % (hvd.size(), hvd.num_clusters(), hvd.cluster_id(), hvd.cluster_size(),
                                          nparams / 1e6, len(corpus) / 1e6), flush=True)
    vx, vy = (t.to(device) for t in data.validation())

    def held_out_loss():
        with torch.no_grad():
            return hvd.allreduce(torch.nn.functional.cross_entropy(model(vx), vy), name="val_loss").item()

    train_s = 0.0           # wall-clock of training alone (evaluations excluded), the same on every rank
    curve = []              # (training seconds, step, mean training loss or None, held-out loss or None)
    t_last = time.perf_counter()
    t_mark, s_mark = t_last, 0.0
    step, next_check, next_eval = 0, 1, args.eval_seconds
    slow = args.slow_cluster_ms / 1000.0 if hvd.cluster_id() == hvd.num_clusters() - 1 else 0.0
    paced, exchanges_seen, step_logged = args.pace == "time" and bool(args.local_steps), 0, 0
    curve.append((0.0, 0, None, held_out_loss()))   # where both runs start
    while True:
        step += 1
        x, y = (t.to(device, non_blocking=True) for t in data.next())
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if slow:
            time.sleep(slow)
        last_step = step >= args.steps if not args.time_budget else False
        log_now = step % args.log_every == 0
        eval_steps = bool(args.eval_every) and step % args.eval_every == 0
        if paced:   # the clusters' step counts differ: collectives across them only right after an exchange
            landed = optimizer.local_steps_exchanges
            if landed == exchanges_seen:
                continue
            exchanges_seen, log_now, eval_steps, next_check = landed, landed % args.log_every == 0, False, step
        if not (log_now or eval_steps or last_step or step == next_check):
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # the step's GPU work counts in its time
        # the ranks agree on the clock (the slowest rank's), so they stop and evaluate at the same steps;
        # the next check comes after about --check-seconds of training (every step when steps are slower)
        elapsed = hvd.allreduce(torch.tensor(time.perf_counter() - t_mark + s_mark), op=hvd.Max,
                                name="train_clock").item()
        next_check = step + max(1, min(args.log_every, int(args.check_seconds * step / max(elapsed, 1e-9))))
        if args.time_budget and elapsed >= args.time_budget:
            last_step = True
        eval_now = eval_steps or (bool(args.eval_seconds) and elapsed >= next_eval) or last_step
        avg = hvd.allreduce(loss.detach(), name="train_loss").item() if (log_now or eval_now) else None
        now = time.perf_counter()
        if log_now and hvd.rank() == 0:
            last = hvd.stats()["last_step"]
            density = last["density"]
            print("step %4d  t %6.1f s  loss %.4f  %.1f ms/step  WAN %.3f MB/step  density %s  route %s"
                  % (step, elapsed, avg, 1000 * (now - t_last) / max(1, step - step_logged), last["wan_bytes_sent"] / 1e6,
                     "%.4f" % density if density is not None else "-", optimizer.route), flush=True)
        if log_now:
            t_last, step_logged = now, step
        train_s = elapsed
        if eval_now:
            while args.eval_seconds and next_eval <= elapsed:
                next_eval += args.eval_seconds
            if args.engine == "cpu":
                optimizer.drain()   # the updates in flight into the model before evaluating
            if last_step:   # one model on every rank before the final evaluation (local steps; otherwise a no-op)
                optimizer.sync_clusters()
            curve.append((elapsed, step, avg, held_out_loss()))
            t_mark, s_mark = time.perf_counter(), elapsed   # evaluation time does not count
            t_last += t_mark - now
        if last_step:
            break
    args.steps = step
    val = curve[-1][3]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="final_parameters")
    identical = all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    if hvd.rank() == 0:
        print("done: %d steps in %.1f s; validation loss %.4f (%.2f bits/byte); parameters identical on all %d "
              "ranks: %s" % (args.steps, train_s, val, val / 0.6931, hvd.size(), identical),
              flush=True)
    if hvd.rank() == 0 and args.json_out:
        import json
        total = hvd.stats()["total"]
        with open(args.json_out, "w") as f:
            json.dump({"validation_loss": val, "ms_per_step": 1000 * train_s / args.steps, "train_seconds": train_s,
                       "curve": [{"seconds": t, "step": n, "train_loss": tl, "validation_loss": v}
                                 for t, n, tl, v in curve],
                       "parameters": sum(p.numel() for p in model.parameters()), "steps": args.steps, "compression": args.compression,
                       "density": args.density, "error_feedback": not args.no_error_feedback,
                       "seconds": train_s, "identical": identical,
                       "route_changes": [list(c) for c in optimizer.route_changes],
                       "wan_bytes_sent_per_step": total["wan_bytes_sent"] / max(1, hvd.stats()["steps"])}, f)
    if not identical:
        raise SystemExit("parameters differ between ranks")
    if args.save_state:
        torch.save({"size": hvd.size(), "model": model.state_dict(),
                    "inner": torch.optim.Optimizer.state_dict(optimizer), "data": data.gen.get_state()},
                   "%s.rank%d.pt" % (args.save_state, hvd.rank()))


def load_state(path, model, optimizer, data, device, average):
    """This rank's part of what --save-state wrote: the model, the inner optimizer's own state
    (torch's, not the DistributedOptimizer's: its outer sync starts fresh) and the data position.
    ``average``: the inner state averaged over the ranks (a synchronous route needs it equal
    everywhere, as the mode switch makes it going back to sync); else each rank keeps its own."""
    mine = "%s.rank%d.pt" % (path, hvd.rank())
    try:
        saved = torch.load(mine, map_location=device)
    except FileNotFoundError:
        raise SystemExit("--load-state: %s is missing (run with --save-state %s on %d ranks first)"
                         % (mine, path, hvd.size()))
    if saved.get("size") != hvd.size():
        raise SystemExit("--load-state: %s was written by %s ranks, this run has %d" % (mine, saved.get("size"),
                                                                                        hvd.size()))
    model.load_state_dict(saved["model"])
    if average:
        for key, st in sorted(saved["inner"]["state"].items()):
            for name, t in sorted(st.items()):
                if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0:
                    st[name] = hvd.allreduce(t, name="load_state.%s.%s" % (key, name))
    torch.optim.Optimizer.load_state_dict(optimizer, saved["inner"])
    data.gen.set_state(saved["data"])


if __name__ == "__main__":
    main()
