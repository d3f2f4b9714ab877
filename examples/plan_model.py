"""The model ``stellarun plan`` calibrates on, as a script with the planner's entry point: the
byte-level language model of examples/train_horovod.py on Python's standard-library sources,
with the same optimizer (SGD, lr 0.05, momentum 0.9 as the main job runs it) and held-out set,
so a plan can be checked against runs of that script.

    stellarun plan --model examples/plan_model.py --model-arg hidden=1024 \\
        --cluster 2xhere --cluster 2xhere --link 100mbit --global-batch 128 --target-loss 2.6

The contract (stella_mpi/plan/workload.py): ``stella_plan(batch_size, rank, **args)`` returns a
dict with the model, ``next_batch``, and optionally ``loss``, ``optimizer``, ``evaluate``,
``global_batch``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stdlib_text import ByteBatches, ByteMLP, load_corpus  # noqa: E402

CONTEXT = 32
_CORPUS = []


def stella_plan(batch_size, rank, hidden="1024", seed="0"):
    if not _CORPUS:
        _CORPUS.append(load_corpus())
    torch.manual_seed(int(seed))
    # the data of examples/train_horovod.py's rank ``rank`` (its seed is 1 + rank + 1000 * seed)
    data = ByteBatches(_CORPUS[0], CONTEXT, batch_size, seed=1 + rank + 1000 * int(seed))
    model = ByteMLP(CONTEXT, hidden=int(hidden))
    vx, vy = data.validation()

    def evaluate(m):
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(m(vx), vy))
    return {"model": model, "next_batch": data.next, "evaluate": evaluate, "global_batch": 128,
            "optimizer": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)}
