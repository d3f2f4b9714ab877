"""An elastic Horovod training script (only the import differs from Horovod's): a small model on
generated data, sparse cross-cluster exchange, a commit every --commit-every steps. Rank 0 prints
one ``progress`` line per step (step, world size, time) for tests/test_elastic.py and
bench/bench_elastic.py, and at the end every rank checks that all hold identical parameters."""
import argparse
import json
import time

import torch

import stella_mpi as hvd

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--commit-every", type=int, default=5)
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
p.add_argument("--width", type=int, default=256)
p.add_argument("--raise-at", type=int, default=0, help="raise ValueError on rank 0 at this step (a script bug)")
p.add_argument("--engine", choices=["sync", "cpu"], default="sync",
               help="the synchronous optimizer, or the CPU engine (engine='cpu', staleness 1)")
p.add_argument("--out")
args = p.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 8))
base = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                               compression=hvd.Compression.topk(density=0.05),
                               engine=hvd.CpuEngine(staleness=1, warmup=0, model=model) if args.engine == "cpu" else None)
target = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
state = hvd.elastic.TorchState(model, opt, step=0)


def on_reset():
    for group in opt.param_groups:   # the linear scaling rule for the new number of ranks
        group["lr"] = 0.05 * hvd.size()


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
        x = torch.randn(32, 64, generator=g)
        y = (x @ target).argmax(1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        state.step += 1
        if state.step == args.raise_at and hvd.rank() == 0:
            raise ValueError("a bug in the training script")
        if hvd.rank() == 0:
            print("progress step=%d size=%d t=%.3f loss=%.4f" % (state.step, hvd.size(), time.time(), loss.item()),
                  flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if state.step % args.commit_every == 0:
            t0 = time.perf_counter()
            state.commit()
            if hvd.rank() == 0:
                print("commit step=%d seconds=%.4f" % (state.step, time.perf_counter() - t0), flush=True)


train(state)
if args.engine == "cpu":
    opt.drain()   # the exact master weights into the model (collective)
flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0), name="final")
identical = all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
if hvd.rank() == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump({"steps": state.step, "size": hvd.size(), "identical": identical,
                   "checksum": float(flat.double().sum())}, f)
hvd.shutdown()
if not identical:
    raise SystemExit("parameters differ between ranks")
