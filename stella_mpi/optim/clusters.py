"""This rank's cluster as a process set: the gradient route of local steps, and where the
overlapped outer exchange gathers its mean."""
from ..core import state
from ..core.process_sets import ProcessSet, global_process_set


def cluster_process_set():
    """This rank's cluster as a process set (registered once: every rank registers every
    cluster's set, in cluster order, the first time; later calls find them)."""
    rt = state.current("hvd.LocalSteps")
    topo = global_process_set.topology
    mine = None
    for c, members in enumerate(topo.cluster_members):
        ranks = sorted(global_process_set.ranks[r] for r in members)
        found = [p for p in rt.process_sets.values() if p.ranks == ranks]
        ps = found[0] if found else rt.add_process_set(ProcessSet(ranks))
        if c == topo.cluster_id:
            mine = ps
    return mine
