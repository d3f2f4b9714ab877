"""A PyTorch DistributedDataParallel training script on stella_mpi: torch.distributed is made from
the MPI job, and DDP's gradient buckets cross clusters through stella's communication hook.

    stellarun -np 4 --clusters 2 python examples/train_ddp.py --compression cacheaware --density 0.01

The same byte-level language model, data and seeds as examples/train_horovod.py (its Horovod
twin), so the two can be compared step for step. The lines that differ from a plain DDP script
are marked "stella".
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stella_mpi as hvd                  # stella
from stella_mpi import ddp as stella_ddp  # stella

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stdlib_text import ByteBatches, ByteMLP, load_corpus  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--time-budget", type=float, default=0.0, help="train this many seconds instead of --steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compression", default="auto",
                        help="auto (the hook's automatic route), none, fp16, bf16, cacheaware, topk, randomk, thc")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--no-hook", action="store_true", help="plain DDP: torch's own allreduce over gloo")
    parser.add_argument("--bucket-cap-mb", type=float, default=64,
                        help="DDP's bucket size; 64, Horovod's fusion threshold: the sparse route selects within each "
                             "bucket, and DDP's default (1 MB first, then 25 MB) cost quality at equal steps; 0: DDP's "
                             "default")
    parser.add_argument("--eval-seconds", type=float, default=0.0, help="held-out loss every this many seconds")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json-out", help="write the final metrics here (rank 0)")
    args = parser.parse_args()

    stella_ddp.init_process_group()      # stella: rank and size from MPI, the rendezvous over MPI
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    context = 32
    corpus = load_corpus()
    data = ByteBatches(corpus, context, args.batch_size, seed=1 + rank + 1000 * args.seed)
    net = ByteMLP(context, hidden=args.hidden).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None,   # rank 0's parameters
                bucket_cap_mb=args.bucket_cap_mb or None)
    state = None
    if not args.no_hook:                 # stella: DDP's buckets through the hierarchy
        if args.compression == "auto":
            compression = None
        elif args.compression in ("none", "fp16", "bf16"):
            compression = getattr(hvd.Compression, args.compression)
        elif args.compression == "thc":
            compression = hvd.Compression.thc(bits=args.bits)
        else:
            compression = getattr(hvd.Compression, args.compression)(density=args.density)
        state = stella_ddp.StellaHookState(net, compression=compression)
        model.register_comm_hook(state, stella_ddp.stella_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if state is not None:
        optimizer = stella_ddp.wrap_optimizer(optimizer, state)   # stella: STELLA_NONFINITE=skip's no-update
    if rank == 0:
        print("train_ddp: %d ranks in %d clusters; route across clusters: %s; model %.2fM parameters"
              % (size, hvd.num_clusters(), "torch's allreduce (no hook)" if state is None else
                 getattr(state.compression, "name", state.compression), sum(p.numel() for p in net.parameters()) / 1e6),
              flush=True)
    vx, vy = (t.to(device) for t in data.validation())

    def held_out_loss():
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(net(vx), vy)
        dist.all_reduce(loss)
        return loss.item() / size

    def agreed_clock(trained, since):
        """Training seconds so far, the slowest rank's (the ranks stop and evaluate together)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # the step's GPU work counts in its time
        t = torch.tensor([trained + time.perf_counter() - since], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    curve = [(0.0, 0, held_out_loss())]
    trained, step, next_eval = 0.0, 0, args.eval_seconds
    t0 = time.perf_counter()
    while True:
        step += 1
        x, y = (t.to(device, non_blocking=True) for t in data.next())
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        check = step % 10 == 0 or step == args.steps
        if not check:
            continue
        trained = agreed_clock(trained, t0)
        last = step >= args.steps if not args.time_budget else trained >= args.time_budget
        if rank == 0 and step % args.log_every == 0:
            print("step %4d  t %6.1f s  loss %.4f  %.1f ms/step" % (step, trained, loss.item(), 1000 * trained / step),
                  flush=True)
        if last or (args.eval_seconds and trained >= next_eval):
            while args.eval_seconds and next_eval <= trained:
                next_eval += args.eval_seconds
            curve.append((trained, step, held_out_loss()))
        t0 = time.perf_counter()   # evaluation and the clock's agreement do not count
        if last:
            break
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    identical = all(torch.equal(everyone[0], e) for e in everyone)
    val = curve[-1][2]
    if rank == 0:
        print("done: %d steps in %.1f s; validation loss %.4f; parameters identical on all %d ranks: %s"
              % (step, trained, val, size, identical), flush=True)
        if state is not None and state.session is not None:
            changes = ["%d: %s" % (s, "thc %d" % d.bits if d.bits else "density %.4g" % d.density)
                       for s, d in state.session.decisions if d.changed]
            print("the adjuster took %d decisions; changes (step: rung): %s; last reason: %s"
                  % (len(state.session.decisions), ", ".join(changes) or "none",
                     state.session.decisions[-1][1].reason if state.session.decisions else "-"), flush=True)
        if args.json_out:
            stats = hvd.stats()
            with open(args.json_out, "w") as f:
                json.dump({"validation_loss": val, "steps": step, "train_seconds": trained,
                           "ms_per_step": 1000 * trained / step, "identical": identical,
                           "skipped_steps": 0 if state is None else state.skipped_steps,
                           "curve": [{"seconds": t, "step": n, "validation_loss": v} for t, n, v in curve],
                           "wan_bytes_sent_per_step": stats["total"]["wan_bytes_sent"] / step}, f)
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("parameters differ between ranks")


if __name__ == "__main__":
    main()
