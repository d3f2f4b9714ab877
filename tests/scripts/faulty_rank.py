"""A job in which one rank fails in the way named by argv[1]; the others keep reducing.
stella_mpi is imported before torch: MPI_Init then happens right at start-up, so that the
ranks' deadlines (short in these tests) do not also cover a loaded machine's torch imports."""
import os
import signal
import sys
import time

mode = sys.argv[1]
if mode == "late_import" and os.environ.get("PMI_RANK") == "1":
    time.sleep(120)            # never reaches MPI_Init in time
if mode == "stop_at_start" and os.environ.get("PMI_RANK") == "1":
    os.kill(os.getpid(), signal.SIGSTOP)   # frozen before MPI_Init
import stella_mpi as hvd  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

if mode == "late_init" and MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(120)            # MPI is up, but hvd.init() does not come in time
hvd.init()
hvd.allreduce(torch.ones(4), name="warmup")
if mode == "stop_at_exit":
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)   # frozen: the others' MPI_Finalize waits for it
    print("rank %d reached the end" % hvd.rank(), flush=True)
    raise SystemExit(0)


def reduce_tampered(tamper, comp, name):
    """Rank 1 passes what it sends through ``tamper``; every rank reduces 5 times, and must
    never get past it."""
    if hvd.rank() == 1:
        hvd.global_process_set.hierarchy.tamper = tamper
    for step in range(5):
        hvd.allreduce(torch.randn(10000), compression=comp, name=name)
    print("rank %d finished without noticing the failure" % hvd.rank())
    raise SystemExit(0)


if mode == "gil_held":
    # rank 1 waits in mpi4py's pickle-based allreduce (alone: the others never call it), which
    # holds the GIL while it blocks: its collective thread cannot run, so the others' next op
    # never gets through negotiation
    if hvd.rank() == 1:
        MPI.COMM_WORLD.allreduce(1)
    hvd.allreduce(torch.ones(4), name="after_warmup")
    print("rank %d finished without noticing the failure" % hvd.rank())
    raise SystemExit(0)


if mode == "corrupt":
    def flip_index_bytes(payload):
        bad = payload.clone()
        bad[32:40] = 255          # the first indices now point far outside the tensor
        return bad
    reduce_tampered(flip_index_bytes, hvd.Compression.topk(density=0.05), "sparse.grad")
if mode == "oversized":
    def pad(payload):   # rank 1 announces more bytes than any payload for its shard can hold
        return torch.cat([payload, torch.zeros(10 * payload.numel() + 100000, dtype=torch.uint8)])
    reduce_tampered(pad, hvd.Compression.topk(density=0.05), "sparse.grad")
if mode == "corrupt_sparseloco_scale":
    # rank 1's first chunk scale (lo) becomes negative: no magnitude on that grid may reach a sum
    def negative_scale(payload):
        bad = payload.clone()
        at = 32 + int(bad[24:32].numpy().view("<u8")[0])   # past the header and the index section
        bad[at:at + 4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8)   # -1.0f
        return bad
    reduce_tampered(negative_scale, hvd.Compression.sparseloco(density=0.01, chunk=1024, bits=2), "sparseloco.grad")
if mode == "corrupt_thc_scale":
    # rank 1 sends a NaN block maximum in the scale round: no rank may quantize with it
    def nan_scales(agreed):
        bad = agreed.copy()
        bad[:-1] = float("nan")   # the block maxima; the NaN flag (last) stays as it was
        return bad
    reduce_tampered(nan_scales, hvd.Compression.thc(bits=4), "thc.grad")
def at_third_allreduce(act):
    """Run ``act()`` inside this rank's third allreduce, after the ranks agreed to run it."""
    from stella_mpi.core import executors
    real = executors.EXECUTORS["allreduce"]
    calls = [0]

    def wrapped(pset, desc, inputs, joined):
        calls[0] += 1
        if calls[0] == 3:
            act()
        return real.run(pset, desc, inputs, joined)
    executors.EXECUTORS["allreduce"] = executors.Executor(wrapped, real.neutral)


if mode in ("failing_op", "failing_op_all"):
    # the third allreduce fails inside the collective thread (as a broken transport would), on
    # rank 1 alone or on every rank (``failing_op_all``): a caller must get an error, never its
    # un-reduced buffer, and the whole job must end
    if hvd.rank() == 1 or mode == "failing_op_all":
        def fail():
            raise RuntimeError("injected transport failure")
        at_third_allreduce(fail)
    for step in range(50):
        try:
            out = hvd.allreduce(torch.full((1000,), float(hvd.rank())), name="fo.%d" % step)
        except hvd.HorovodInternalError as e:
            print("rank %d: step %d raised HorovodInternalError: %s" % (hvd.rank(), step, e), flush=True)
            time.sleep(60)   # the job must end without this rank's help
            continue
        if (hvd.rank() == 1 or mode == "failing_op_all") and step >= 2:
            print("rank %d got a result after its collective failed: %s" % (hvd.rank(), out[:3].tolist()), flush=True)
    print("rank %d finished without noticing the failure" % hvd.rank())
    raise SystemExit(0)
if mode == "freeze_in_op":
    # rank 3 freezes inside the third allreduce, after the ranks agreed to run it: rank 2, its
    # cluster's other rank, then waits inside gloo for it, and must still answer the others'
    # questions of where it waits (only rank 3 is silent)
    if hvd.rank() == 3:
        at_third_allreduce(lambda: os.kill(os.getpid(), signal.SIGSTOP))
    for step in range(50):
        hvd.allreduce(torch.ones(1000), name="fz.%d" % step)
    print("rank %d finished without noticing the failure" % hvd.rank())
    raise SystemExit(0)
if mode in ("join_in_inner_steps", "stall_in_inner_step", "mispaired_inner_step"):
    # local steps on two clusters of two ranks: at step 3 rank 1 calls hvd.join() (as if out of
    # batches) or stalls, while rank 0, its cluster's other rank, waits for its gradients on the
    # cluster's channel, off the negotiation (optim/cluster_channel.py). H is longer than the
    # run: the other cluster never waits for this one (it trains its steps, then idles)
    model = torch.nn.Linear(8, 4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), local_steps=hvd.LocalSteps(every=100000))
    assert (opt._route.channel is not None) == (hvd.global_process_set.topology.cluster_size > 1)
    if mode == "mispaired_inner_step" and hvd.rank() == 1:
        opt._route.channel.number += 1   # as if its buffers belonged to another optimizer's lane
    for step in range(1000):
        if step == 3 and hvd.rank() == 1:
            if mode == "stall_in_inner_step":
                time.sleep(120)
            hvd.join()
            time.sleep(60)
        opt.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
    if hvd.rank() in (0, 1):
        print("rank %d finished without noticing the failure" % hvd.rank())
    time.sleep(60)
    raise SystemExit(0)
if hvd.rank() == 1:
    if mode == "raise":
        raise RuntimeError("boom on purpose")
    if mode == "exit":
        os._exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    if mode == "stall":
        time.sleep(120)
for step in range(1000):
    hvd.allreduce(torch.ones(1000), name="step.%d" % step)
print("rank %d finished without noticing the failure" % hvd.rank())
