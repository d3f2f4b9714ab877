"""Horovod's reduction op constants and their names in collective descriptions."""
import warnings

import torch

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "average", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max", Product: "product"}


def handle_average_backwards_compatibility(op, average):
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed", DeprecationWarning)
        return Average if average else Sum
    return Average


def op_name(op, dtype):
    """The description's name of ``op`` for tensors of ``dtype`` (a clear error if it has none)."""
    try:
        name = OP_NAMES[op]
    except KeyError:
        raise ValueError("unknown reduction op %r; use hvd.Average, Sum, Adasum, Min, Max or Product" % (op,)) from None
    if name == "adasum" and not dtype.is_floating_point:
        raise TypeError("op Adasum takes floating-point tensors, not %s" % dtype)
    if dtype == torch.bool and name in ("average", "sum", "product"):
        raise TypeError("op %s is not defined for bool tensors; use hvd.Min (and) or hvd.Max (or)" % name)
    return name
