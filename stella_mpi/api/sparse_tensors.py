"""``hvd.sparse_allreduce_async``: Horovod's allreduce of torch sparse COO tensors (an
``nn.Embedding(sparse=True)`` gradient, for example).

Each rank's indices and values are gathered from every rank of the process set, and the
result is the sparse tensor of all of them: entries that several ranks hold appear several
times and add up when the tensor is coalesced or made dense, exactly as in Horovod. The
call returns a function; calling it (or ``hvd.synchronize`` on it) waits and returns the
result. stella_mpi's own compressed allreduce of dense gradients is
:func:`stella_mpi.api.allreduce.compressed_allreduce_async`.
"""
import torch

from ..core.process_sets import global_process_set
from .allgather import allgather_async
from .handles import auto_name, synchronize
from .reduce_ops import Average, Sum
from .validation import checked_process_set


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Gather the sparse ``tensor`` of every rank of ``process_set``; ``op``: ``hvd.Average``
    (values divided by the set's size) or ``hvd.Sum``. Returns a function that waits for the
    result, a sparse tensor of ``tensor``'s size."""
    what = "hvd.sparse_allreduce_async"
    pset = checked_process_set(process_set, what)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError("%s takes a torch sparse COO tensor (tensor.to_sparse()), not %s"
                        % (what, type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.layout))
    if op not in (Average, Sum):
        raise ValueError("%s: op must be hvd.Average or hvd.Sum" % what)
    name = name or auto_name("sparse_allreduce", pset)
    t = tensor
    indices = t._indices().transpose(0, 1).contiguous()   # rows: one entry each, so dim 0 concatenates
    values = t._values().contiguous()
    indices_handle = allgather_async(indices, name="%s.indices" % name, process_set=pset)
    values_handle = allgather_async(values, name="%s.values" % name, process_set=pset)

    def wait():
        gathered_values = synchronize(values_handle)
        gathered_indices = synchronize(indices_handle)
        if op == Average:
            gathered_values = gathered_values / pset.nranks
        if gathered_indices.dim() == 0 or gathered_values.dim() == 0:
            return t.new().resize_as_(t)
        # the indices come from the peers: checked against the size before anyone indexes with them
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, t.size(),
                                       dtype=t.dtype, device=t.device, check_invariants=True)

    return wait
