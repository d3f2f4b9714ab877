"""The API on one process (no mpirun): errors before init, init/shutdown (which drops the run's
state), size-1 collectives."""
import subprocess
import sys

from mpi_launch import ROOT

SCRIPT = r'''
import torch, stella_mpi as hvd
from stella_mpi.base.errors import HorovodInternalError
try:
    hvd.size()
except ValueError as e:
    assert "hvd.init()" in str(e), e
else:
    raise SystemExit("size() before init did not raise")
try:
    hvd.allreduce(torch.ones(2))
except HorovodInternalError as e:
    assert "hvd.init()" in str(e)
else:
    raise SystemExit("allreduce before init did not raise")
assert not hvd.is_initialized()
hvd.init(); hvd.init()  # idempotent
assert hvd.is_initialized() and hvd.size() == 1 and hvd.rank() == 0
assert hvd.num_clusters() == 1 and hvd.cluster_size() == 1 and hvd.local_size() == 1
assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_enabled()
assert hvd.ddl_built() is False and hvd.ccl_built() is False
assert isinstance(hvd.nccl_built(), int) and isinstance(hvd.cuda_built(), bool)
x = torch.randn(5)
assert torch.equal(hvd.allreduce(x), x)
from stella_mpi.core import state
run = state.current()
hvd.allreduce(x, compression=hvd.Compression.topk(density=0.5), name="g")
assert run.auto_name("allreduce") == "allreduce.noname.1" and run.sparse_steps == {"g": 1}
assert torch.equal(hvd.allgather(x.view(5, 1)), x.view(5, 1))
assert hvd.broadcast_object({"a": 1}) == {"a": 1}
assert hvd.join() == 0
hvd.shutdown(); hvd.shutdown()
assert not hvd.is_initialized()
hvd.init()
# shutdown() dropped everything the first run accumulated: names count from 0 again
assert state.current() is not run and state.current().sparse_steps == {}
assert state.current().auto_name("allreduce") == "allreduce.noname.0"
assert torch.equal(hvd.allreduce(x, op=hvd.Sum), x)
hvd.shutdown()
# Horovod's init(process_sets="dynamic"); anything else that is not a list is refused before
# anything is built, and a later init works
try:
    hvd.init(process_sets="static")
except ValueError as e:
    assert "takes a list of process sets" in str(e), e
else:
    raise SystemExit("init(process_sets='static') did not raise")
assert not hvd.is_initialized()
hvd.init(process_sets="dynamic")
assert hvd.is_initialized()
# a handle kept across shutdown() and init() does not name the new run's op
old = hvd.allreduce_async(x, name="kept")
hvd.synchronize(old)
hvd.shutdown()
hvd.init()
new = hvd.allreduce_async(2 * x, name="kept")
assert hvd.synchronize(old) is None   # unknown here (None, as Horovod), not the new op's result
assert torch.equal(hvd.synchronize(new), 2 * x)
hvd.shutdown()
print("single-process checks passed")
'''


def test_single_process_lifecycle():
    # a child process: MPI is initialized once per process, and the test runner must stay free
    # of MPI so that it can launch mpirun jobs
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "single-process checks passed" in proc.stdout


ALONE = r'''
import torch, stella_mpi as hvd
from stella_mpi.base.errors import NonFiniteGradientError
from stella_mpi.optim.routes.sync import reduce_alone
hvd.init()
torch.manual_seed(0)
# the same bits as the collective thread's grouped allreduce over one rank, scaling included
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    for pre, post in ((1.0, 1.0), (1 / 3.0, 3.0), (0.1, 7.0)):
        xs = [torch.randn(n).to(dtype) for n in (0, 1, 1000, 4097)]
        want = hvd.grouped_allreduce([x.clone() for x in xs], op=hvd.Average, prescale_factor=pre,
                                     postscale_factor=post)
        mine = [x.clone() for x in xs]
        got = hvd.synchronize(reduce_alone(mine, "g", pre, post))
        assert got is mine
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (dtype, pre, post)
# NaN or Inf anywhere: refused, naming the rank and the op
for bad in (float("nan"), float("inf")):
    xs = [torch.ones(3), torch.tensor([1.0, bad])]
    try:
        hvd.synchronize(reduce_alone(xs, "DistributedOptimizer.bucket.0", 1.0, 1.0))
    except NonFiniteGradientError as e:
        assert "rank 0" in str(e) and "DistributedOptimizer.bucket.0" in str(e), e
    else:
        raise SystemExit("a non-finite gradient was not refused")
hvd.shutdown()
print("reduce_alone checks passed")
'''


def test_a_reduction_over_one_rank_is_the_collectives_without_it():
    """``reduce_alone`` (the gradient routes on a process set of one rank, e.g. local steps on
    clusters of one rank) gives the bits of the collective thread's grouped allreduce over one
    rank, in every float dtype with Horovod's pre- and postscale, and refuses NaN/Inf."""
    proc = subprocess.run([sys.executable, "-c", ALONE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reduce_alone checks passed" in proc.stdout
