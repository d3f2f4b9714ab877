"""Starting and stopping, process sets, the counters, and Horovod's timeline calls."""
from ..core import state
from ..core.state import init, is_initialized, shutdown  # noqa: F401  (the public names live here)


def add_process_set(process_set):
    return state.current("hvd.add_process_set()").add_process_set(process_set)


def remove_process_set(process_set):
    return state.current("hvd.remove_process_set()").remove_process_set(process_set)


def stats(end_step=False):
    """Counters of the cross-cluster traffic: the last finished step and the totals.

    ``last_step`` holds wan_bytes_sent/received, seconds in select/encode/exchange/decode/merge,
    an estimate of the seconds in the reductions inside the cluster (intra_s: the reduce-scatter
    or reduce that starts each one, waits for the cluster's ranks included, stands for the whole;
    the all-gather or broadcast that ends it also waits for the exchange across clusters), the
    density used and the residual's norm relative to the gradient's. DistributedOptimizer
    closes a step at each synchronize(); ``end_step=True`` closes one by hand."""
    rt = state.current("hvd.stats()")
    if end_step:
        rt.wan_stats.end_step()
    return rt.wan_stats.snapshot()


def start_timeline(file_path, mark_cycles=False):
    """Start writing Horovod's timeline, a Chrome trace, to ``file_path`` (rank 0 writes it; a
    ``{rank}`` in the path makes every rank write its own). See stella_mpi/base/timeline.py."""
    state.current("hvd.start_timeline()").start_timeline(file_path, mark_cycles)


def stop_timeline():
    """Stop writing the timeline and close the file."""
    state.current("hvd.stop_timeline()").stop_timeline()
