"""The job of the randomized fault run (tests/fault_soak.py): trains a small model on the path
named by argv[1] (dense, sparse or cpu) for argv[2] steps, and checks every step that a
collective's result is exactly right: a rank that ever gets a wrong result prints WRONG RESULT."""
import sys

import torch

import stella_mpi as hvd

path, steps = sys.argv[1], int(sys.argv[2])
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
kwargs = {"dense": {}, "sparse": {"compression": hvd.Compression.cacheaware(density=0.05)},
          "cpu": {"engine": "cpu", "staleness": 1, "model": model}}[path]
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), **kwargs)
g = torch.Generator().manual_seed(hvd.rank())
want = float(sum(range(1, hvd.size() + 1)))
for step in range(steps):
    x = torch.randn(32, 64, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    got = hvd.allreduce(torch.full((8,), float(hvd.rank() + 1)), op=hvd.Sum, name="check.%d" % step)
    if not torch.equal(got, torch.full((8,), want)):
        print("rank %d: WRONG RESULT at step %d: %s" % (hvd.rank(), step, got.tolist()), flush=True)
    if step % 10 == 0:
        print("rank %d step %d" % (hvd.rank(), step), flush=True)
print("rank %d done" % hvd.rank(), flush=True)
