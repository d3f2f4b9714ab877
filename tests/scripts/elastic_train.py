"""An elastic Horovod training script (only the import differs from Horovod's): a small model on
generated data, sparse cross-cluster exchange (or the route named by --route), a commit every
--commit-every steps. Rank 0 prints one ``progress`` line per step (step, world size, time) for
tests/test_elastic.py, bench/bench_elastic.py and tests/chaos_soak.py, and at the end every rank
checks that all hold identical parameters.

The chaos soak's in-process faults (first incarnation only): ``--nan-at RANK:STEP`` makes that
rank's gradient all NaN at that step; ``--garbage-at RANK:STEP`` makes that rank send garbage
from that step on (sparse payloads with indices out of range, THC scales that are NaN).
``--check`` allreduces a known value every step: a rank that gets a wrong result prints WRONG
RESULT."""
import argparse
import json
import os
import time

p0 = argparse.ArgumentParser(add_help=False)
p0.add_argument("--route", default="sparse")
if p0.parse_known_args()[0].route == "dense":
    os.environ["STELLA_WAN_ROUTE"] = "dense"   # Horovod's dense numerics across clusters

import torch  # noqa: E402

import stella_mpi as hvd  # noqa: E402

ROUTES = ("dense", "sparse", "thc", "cpu", "local", "local-overlap", "fragments", "switch", "auto")

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--commit-every", type=int, default=5)
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
p.add_argument("--width", type=int, default=256)
p.add_argument("--raise-at", type=int, default=0, help="raise ValueError on rank 0 at this step (a script bug)")
p.add_argument("--engine", choices=["sync", "cpu"], default="sync",
               help="the synchronous optimizer, or the CPU engine (engine='cpu', staleness 1)")
p.add_argument("--route", choices=ROUTES, default="sparse")
p.add_argument("--nan-at", metavar="RANK:STEP")
p.add_argument("--garbage-at", metavar="RANK:STEP")
p.add_argument("--check", action="store_true")
p.add_argument("--out")
args = p.parse_args()
if args.engine == "cpu":
    args.route = "cpu"

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 8))
base = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
ROUTE_ARGS = {
    "dense": {},
    "sparse": {"compression": hvd.Compression.topk(density=0.05)},
    "thc": {"compression": hvd.Compression.thc(bits=4)},
    "cpu": {"compression": hvd.Compression.topk(density=0.05),
            "engine": hvd.CpuEngine(staleness=1, warmup=0, model=model)},
    "local": {"local_steps": hvd.LocalSteps(every=4, compression=hvd.Compression.thc(bits=4))},
    "local-overlap": {"local_steps": hvd.LocalSteps(every=4, overlap=True)},
    # Streaming DiLoCo's fragments, each in flight for a step, through SparseLoCo's compressor
    "fragments": {"local_steps": hvd.LocalSteps(every=4, fragments=2, delay=1, outer="sum", compression=hvd.Compression.sparseloco(
        density=0.05, chunk=64, bits=2, feedback_decay=0.95))},
    "switch": {"compression": hvd.Compression.cacheaware(density=0.05), "adjuster": hvd.Adjuster(modes=("sync", "local")),
               "local_steps": hvd.LocalSteps(every=4, compression=hvd.Compression.thc(bits=4))},
    "auto": {},
}
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **ROUTE_ARGS[args.route])
first_incarnation = int(os.environ.get("STELLA_ELASTIC_RESETS", "0")) == 0


def _at(spec):
    if not spec or not first_incarnation:
        return None, None
    r, s = spec.split(":")
    return int(r), int(s)


nan_rank, nan_step = _at(args.nan_at)
garbage_rank, garbage_step = _at(args.garbage_at)


def garbage(sent):
    """What a broken peer sends: indices far out of range, or NaN scales."""
    bad = sent.clone() if torch.is_tensor(sent) else sent.copy()
    if torch.is_tensor(bad):
        bad[32:40] = 255
    else:
        bad[:-1] = float("nan")
    return bad
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
        hook = None
        if state.step == nan_step and hvd.rank() == nan_rank:
            hook = model[0].weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        if state.step == garbage_step and hvd.rank() == garbage_rank:
            hvd.global_process_set.hierarchy.tamper = garbage
        loss.backward()
        opt.step()
        if hook is not None:
            hook.remove()
        if args.check:
            want = float(sum(range(1, hvd.size() + 1)))
            got = hvd.allreduce(torch.full((8,), float(hvd.rank() + 1)), op=hvd.Sum, name="check")
            if not torch.equal(got, torch.full((8,), want)):
                print("rank %d: WRONG RESULT at step %d: %s" % (hvd.rank(), state.step, got.tolist()), flush=True)
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
if args.route == "cpu":
    opt.drain()   # the exact master weights into the model (collective)
opt.sync_clusters()   # local steps: one model everywhere (otherwise nothing to do)
flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0), name="final")
identical = all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
if hvd.rank() == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump({"steps": state.step, "size": hvd.size(), "identical": identical,
                   "finite": bool(torch.isfinite(flat).all()), "checksum": float(flat.double().sum())}, f)
hvd.shutdown()
if not identical:
    raise SystemExit("parameters differ between ranks")
