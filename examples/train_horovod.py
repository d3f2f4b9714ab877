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
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--compression", default="none",
                        help="none, fp16, bf16, or a sparse WAN compressor: topk, cacheaware, threshold, randomk")
    parser.add_argument("--density", type=float, default=0.01, help="fraction sent across clusters (sparse)")
    parser.add_argument("--no-error-feedback", action="store_true", help="drop what a sparse compressor leaves")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--hidden", type=int, default=256, help="width of the model's hidden layers")
    parser.add_argument("--engine", choices=["torch", "cpu"], default="torch",
                        help="cpu: stella_mpi's C optimizer on pinned cores with a CPU master copy")
    parser.add_argument("--staleness", type=int, default=1, help="CPU engine: 0 synchronous, 1 overlapped")
    parser.add_argument("--staleness-warmup", type=int, default=0,
                        help="CPU engine: run the first N steps synchronously before staleness 1")
    parser.add_argument("--no-stale-prediction", action="store_true",
                        help="CPU engine, staleness 1: give the forward the master weights, not the prediction")
    parser.add_argument("--json-out", help="write the final metrics here (rank 0)")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    context = 32
    corpus = load_corpus()
    data = ByteBatches(corpus, context, args.batch_size, seed=1 + hvd.rank() + 1000 * args.seed)
    model = ByteMLP(context, hidden=args.hidden)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size() ** 0.5)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.compression in ("none", "fp16", "bf16"):
        compression = getattr(hvd.Compression, args.compression)
    else:
        compression = getattr(hvd.Compression, args.compression)(
            density=args.density, error_feedback=not args.no_error_feedback)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if args.engine == "cpu":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression, engine="cpu", staleness=args.staleness,
                                             staleness_warmup=args.staleness_warmup,
                                             stale_prediction=False if args.no_stale_prediction else None,
                                             model=model)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)

    if hvd.rank() == 0:
        nparams = sum(p.numel() for p in model.parameters())
        print("stella_mpi: %d ranks in %d clusters (this rank: cluster %d of size %d); model %.2fM parameters; "
              "%.1f MB of stdlib text" % (hvd.size(), hvd.num_clusters(), hvd.cluster_id(), hvd.cluster_size(),
                                          nparams / 1e6, len(corpus) / 1e6), flush=True)
    vx, vy = data.validation()
    t_start = time.perf_counter()
    t_last = t_start
    for step in range(1, args.steps + 1):
        x, y = data.next()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            avg = hvd.allreduce(loss.detach(), name="train_loss").item()
            now = time.perf_counter()
            last = hvd.stats()["last_step"]
            if hvd.rank() == 0:
                density = last["density"]
                print("step %4d  loss %.4f  %.1f ms/step  WAN %.3f MB/step  density %s"
                      % (step, avg, 1000 * (now - t_last) / args.log_every, last["wan_bytes_sent"] / 1e6,
                         "%.4f" % density if density is not None else "-"), flush=True)
            t_last = now
    if args.engine == "cpu":
        optimizer.drain()  # the last updates into the model before evaluating
    with torch.no_grad():
        val = hvd.allreduce(torch.nn.functional.cross_entropy(model(vx), vy), name="val_loss").item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="final_parameters")
    identical = all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    if hvd.rank() == 0:
        print("done: %d steps in %.1f s; validation loss %.4f (%.2f bits/byte); parameters identical on all %d "
              "ranks: %s" % (args.steps, time.perf_counter() - t_start, val, val / 0.6931, hvd.size(), identical),
              flush=True)
    if hvd.rank() == 0 and args.json_out:
        import json
        total = hvd.stats()["total"]
        with open(args.json_out, "w") as f:
            json.dump({"validation_loss": val, "ms_per_step": 1000 * (time.perf_counter() - t_start) / args.steps,
                       "parameters": sum(p.numel() for p in model.parameters()), "steps": args.steps, "compression": args.compression,
                       "density": args.density, "error_feedback": not args.no_error_feedback,
                       "seconds": time.perf_counter() - t_start, "identical": identical,
                       "wan_bytes_sent_per_step": total["wan_bytes_sent"] / max(1, hvd.stats()["steps"])}, f)
    if not identical:
        raise SystemExit("parameters differ between ranks")


if __name__ == "__main__":
    main()
