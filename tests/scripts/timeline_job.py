"""A short 2-cluster job with the timeline on (tests/test_timeline_job.py): dense and sparse
optimizer steps with the adjuster, a few plain collectives, CPU-engine steps, and the
automatic route's start (its link probe and route instant)."""
import os
import sys

import torch

import stella_mpi as hvd


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def steps(m, opt, n):
    for step in range(n):
        g = torch.Generator().manual_seed(10 * hvd.rank() + step)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()


hvd.init()
path = sys.argv[1] if len(sys.argv) > 1 else ""
if sys.argv[2:] == ["api"]:
    hvd.start_timeline(path, mark_cycles=True)
hvd.allreduce(torch.ones(1000), name="plain.allreduce")
hvd.broadcast(torch.ones(10), root_rank=0, name="plain.broadcast")
m = model()
os.environ["STELLA_WAN_ROUTE"] = "dense"   # Horovod's dense route across the clusters
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
steps(m, opt, 2)
del os.environ["STELLA_WAN_ROUTE"]
m = model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
steps(m, opt, 2)   # the automatic route
m = model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                               compression=hvd.Compression.cacheaware(density=0.05),
                               adjuster=hvd.Adjuster(min_density=0.01, max_density=0.5, interval=2))
steps(m, opt, 6)
m = model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                               compression=hvd.Compression.topk(density=0.05),
                               engine=hvd.CpuEngine(staleness=1, warmup=0, model=m))
steps(m, opt, 3)
opt.drain()
if sys.argv[2:] == ["api"]:
    hvd.stop_timeline()
hvd.shutdown()
