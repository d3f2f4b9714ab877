"""Checkpoints of stella_mpi 0.1.0 (commit 0c4bf4f), saved by its own code for the load test of
the next release (tests/mpi/test_optimizer.py::test_checkpoints_of_the_previous_release_load).
How they were made, in a checkout of 0c4bf4f (this script speaks 0.1.0's API):

    cp tests/data/checkpoints_0.1.0/make.py . && mpirun -np 2 -env STELLA_CLUSTERS 2 \
        .venv/bin/python make.py tests/data/checkpoints_0.1.0
"""
import sys, torch
sys.path.insert(0, "tests/mpi")
import stella_mpi as hvd
from reference import rank_batch, small_model
hvd.init()
out = sys.argv[1]

def sgd(m): return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)

def train(model, opt, steps):
    for step in range(steps):
        opt.zero_grad(); x, y = rank_batch(hvd.rank(), step)
        torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()

def save(name, model, opt):
    sd = opt.state_dict()
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": sd}, "%s/%s.pt" % (out, name))

m = small_model()
o = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(),
                             local_steps=hvd.LocalSteps(every=3, outer="nesterov"))
train(m, o, 4); save("local_steps_nesterov", m, o)

m = small_model()
o = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(), compression=hvd.Compression.topk(0.3),
                             momentum_correction=True)
train(m, o, 3); save("sparse_momentum_correction", m, o)

m = small_model()
o = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(), compression=hvd.Compression.topk(0.1),
                             local_steps=hvd.LocalSteps(every=4, compression=hvd.Compression.fp16),
                             adjuster=hvd.Adjuster(modes=("sync", "local"), interval=1, window=1, min_density=0.1,
                                                   max_density=0.1, local_steps=(4,)))
o._mode_rule.sync_score = lambda est: float("inf")
train(m, o, 8); assert o.mode == "local"; save("mode_switch_local", m, o)

m = small_model()
o = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(), compression=hvd.Compression.topk(0.5),
                             engine="cpu", staleness=1, model=m, momentum_correction=True)
train(m, o, 3); save("cpu_engine", m, o)
hvd.shutdown()
