"""The dtypes collectives take, by the names their descriptions carry."""
import torch

DTYPES = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype):
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError("stella_mpi does not support tensors of dtype %s; supported: %s"
                        % (dtype, ", ".join(DTYPES))) from None


def identity(op, dtype):
    """The neutral element of ``op`` in ``dtype`` (what a joined rank contributes)."""
    if op in ("sum", "average", "adasum"):   # a zero vector leaves an Adasum unchanged
        return 0
    if op == "product":
        return 1
    if dtype.is_floating_point:
        return float("inf") if op == "min" else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if op == "min" else info.min
