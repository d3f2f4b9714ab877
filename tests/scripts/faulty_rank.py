"""A job in which one rank fails in the way named by argv[1]; the others keep reducing."""
import os
import sys
import time

import torch

import stella_mpi as hvd

hvd.init()
mode = sys.argv[1]
hvd.allreduce(torch.ones(4), name="warmup")
if mode == "corrupt":
    def flip_index_bytes(payload):
        bad = payload.clone()
        bad[32:40] = 255          # the first indices now point far outside the tensor
        return bad
    if hvd.rank() == 1:
        hvd.global_process_set.hierarchy.tamper = flip_index_bytes
    comp = hvd.Compression.topk(density=0.05)
    for step in range(5):
        hvd.allreduce(torch.randn(10000), compression=comp, name="sparse.grad")
    print("rank %d finished without noticing the failure" % hvd.rank())
    raise SystemExit(0)
if hvd.rank() == 1:
    if mode == "raise":
        raise RuntimeError("boom on purpose")
    if mode == "exit":
        os._exit(3)
    if mode == "stall":
        time.sleep(120)
for step in range(1000):
    hvd.allreduce(torch.ones(1000), name="step.%d" % step)
print("rank %d finished without noticing the failure" % hvd.rank())
