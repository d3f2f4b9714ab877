"""Rank 0 submits 'lonely' at once; the last rank only after SLEEP seconds (argv[1])."""
import sys
import time

import stella_mpi as hvd
import torch

hvd.init()
if hvd.rank() == hvd.size() - 1:
    time.sleep(float(sys.argv[1]))
out = hvd.allreduce(torch.ones(3), name="lonely", op=hvd.Sum)
assert torch.equal(out, torch.ones(3) * hvd.size())
print("rank %d done" % hvd.rank())
