"""GPU kinds for the planner: peak dense tensor throughput, memory, a default model-FLOPs
utilisation and the intra-node GPU-to-GPU bandwidth.

Compute time of one training sample (forward + backward of a dense transformer, the usual
6 N T rule: 2 N T FLOPs forward, 4 N T backward, N parameters, T tokens per sample)::

    seconds per sample = 6 * params * tokens_per_sample / (tflops * 1e12 * mfu)

``tflops`` is the vendor's peak *dense* (no 2:4 sparsity) 16-bit tensor-core throughput
(bf16 where the GPU has it, else fp16 with fp32 accumulation), from NVIDIA's datasheets and
architecture whitepapers: A100 (312), H100 SXM5 (989), H200 SXM (989, the H100's compute with
141 GB of HBM3e), V100 SXM2 (125 fp16), T4 (65 fp16 mixed), L4 (121 bf16), A10G (70: the
figure AWS and NVIDIA give for the G5 instances' A10G, lower clocks than the A10's 125), and the
Ampere/Ada GeForce whitepapers for RTX 3090 (71 with fp32 accumulate) and RTX 4090 (165.2 with
fp32 accumulate). ``mfu`` is the share of that peak a training step reaches: 0.40 for the
data-centre parts (Megatron-LM and PaLM report 40-55 % on large models; smaller models and
single nodes reach less), 0.30 for the consumer and inference cards (no NVLink, lower
sustained clocks). ``intra_gbps`` is the bandwidth one GPU can send to its peers inside a node,
GB/s one way: NVLink (V100 150, A100 300, H100/H200 450) or PCIe (gen4 x16 about 25, gen3 x16
about 12) for the cards without it; the planner's intra-cluster ring uses it.

A user adds or overrides kinds with a JSON file (``load_table(path)`` or the
``STELLA_GPU_TABLE`` environment variable)::

    {"b200": {"tflops": 2250, "memory_gib": 180, "mfu": 0.4, "intra_gbps": 900,
              "source": "NVIDIA B200 datasheet, dense bf16"}}

Every field but ``source`` is required for a new kind; for a known kind any subset overrides it.
"""
import json
import os
from dataclasses import asdict, dataclass

__all__ = ["GPU", "BUILT_IN", "ENV", "load_table", "get_gpu", "known_kinds", "compute_s_per_sample"]

ENV = "STELLA_GPU_TABLE"
FIELDS = ("tflops", "memory_gib", "mfu", "intra_gbps")


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float       # peak dense 16-bit tensor TFLOPS (no sparsity)
    memory_gib: float   # device memory as the datasheet gives it (GB or GiB, as sold)
    mfu: float          # default model-FLOPs utilisation of a training step, in (0, 1]
    intra_gbps: float   # GB/s one GPU sends to its node peers (NVLink or PCIe), one way
    source: str = ""

    def compute_s_per_sample(self, params, tokens_per_sample, mfu=None):
        """Seconds of forward + backward for one sample: 6 * params * tokens / (tflops * mfu)."""
        return compute_s_per_sample(self, params, tokens_per_sample, mfu)

    def to_dict(self):
        return asdict(self)


_DC = 0.40
_CONSUMER = 0.30
BUILT_IN = {g.name: g for g in (
    GPU("rtx3090", 71.0, 24, _CONSUMER, 25.0, "NVIDIA Ampere GA102 whitepaper: 71 TFLOPS fp16/bf16, fp32 accumulate"),
    GPU("rtx4090", 165.2, 24, _CONSUMER, 25.0, "NVIDIA Ada AD102 whitepaper: 165.2 TFLOPS bf16, fp32 accumulate"),
    GPU("a10g", 70.0, 24, _CONSUMER, 25.0, "AWS G5 / NVIDIA A10G: 70 TFLOPS bf16 dense"),
    GPU("l4", 121.0, 24, _CONSUMER, 25.0, "NVIDIA L4 datasheet: 242 TFLOPS bf16 with sparsity, 121 dense"),
    GPU("t4", 65.0, 16, _CONSUMER, 12.0, "NVIDIA T4 datasheet: 65 TFLOPS fp16 mixed precision"),
    GPU("v100", 125.0, 32, _DC, 150.0, "NVIDIA V100 SXM2 datasheet: 125 TFLOPS tensor; NVLink 300 GB/s"),
    GPU("a100-40gb", 312.0, 40, _DC, 300.0, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense; NVLink 600 GB/s"),
    GPU("a100-80gb", 312.0, 80, _DC, 300.0, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense; NVLink 600 GB/s"),
    GPU("h100", 989.0, 80, _DC, 450.0, "NVIDIA H100 SXM5 datasheet: 1979 TFLOPS bf16 with sparsity, 989 dense; "
                                        "NVLink 900 GB/s"),
    GPU("h200", 989.0, 141, _DC, 450.0, "NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 141 GB HBM3e; "
                                         "NVLink 900 GB/s"),
)}

_FORMAT = ('{"<kind>": {"tflops": <peak dense bf16 TFLOPS>, "memory_gib": <GiB>, "mfu": <0..1>, '
           '"intra_gbps": <GB/s to node peers>, "source": "<where the numbers come from>"}}')


def _check_fields(name, entry, where, partial):
    if not isinstance(entry, dict):
        raise ValueError("%s: the entry of GPU kind %r must be an object with %s; got %r. Format: %s"
                         % (where, name, ", ".join(FIELDS), entry, _FORMAT))
    unknown = set(entry) - set(FIELDS) - {"source", "name"}
    if unknown:
        raise ValueError("%s: GPU kind %r has unknown fields %s (known: %s, source)"
                         % (where, name, sorted(unknown), ", ".join(FIELDS)))
    missing = [f for f in FIELDS if f not in entry]
    if missing and not partial:
        raise ValueError("%s: the new GPU kind %r lacks %s. Format: %s" % (where, name, ", ".join(missing), _FORMAT))
    for f in FIELDS:
        if f in entry:
            v = entry[f]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or (f == "mfu" and v > 1):
                raise ValueError("%s: GPU kind %r: %s must be a number > 0%s, got %r"
                                 % (where, name, f, " and <= 1" if f == "mfu" else "", v))


def load_table(path=None):
    """{kind: GPU}: the built-in kinds, extended or overridden by the JSON file at ``path`` (else
    the one ``STELLA_GPU_TABLE`` names, if set). ValueError naming the file and the bad entry."""
    table = dict(BUILT_IN)
    path = path if path is not None else os.environ.get(ENV) or None
    if path is None:
        return table
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError("GPU table %r cannot be read (%s); pass a JSON file of the form %s" % (path, e, _FORMAT)) \
            from None
    except json.JSONDecodeError as e:
        raise ValueError("GPU table %r is not valid JSON (%s); the format is %s" % (path, e, _FORMAT)) from None
    if not isinstance(data, dict):
        raise ValueError("GPU table %r must hold a JSON object of kinds; the format is %s" % (path, _FORMAT))
    for name, entry in data.items():
        key = str(name).lower()
        old = table.get(key)
        _check_fields(name, entry, "GPU table %r" % path, partial=old is not None)
        merged = dict(asdict(old)) if old is not None else {"source": ""}
        merged.update({k: v for k, v in entry.items() if k != "name"})
        merged["name"] = key
        merged["source"] = str(merged.get("source") or "GPU table %s" % path)
        table[key] = GPU(**{k: (float(v) if k in FIELDS else v) for k, v in merged.items()})
    return table


def known_kinds(table=None):
    return sorted(table if table is not None else load_table())


def get_gpu(kind, table=None):
    """The GPU of ``kind`` (case-insensitive). An unknown kind: ValueError listing the known ones
    and how to add one."""
    table = table if table is not None else load_table()
    key = str(kind).strip().lower()
    if key in table:
        return table[key]
    raise ValueError("unknown GPU kind %r; known kinds: %s. To add one, write a JSON file %s and pass it with "
                     "--gpu-table <file> or %s=<file>" % (kind, ", ".join(sorted(table)), _FORMAT, ENV))


def compute_s_per_sample(gpu, params, tokens_per_sample, mfu=None):
    """6 * params * tokens_per_sample / (gpu.tflops * 1e12 * mfu), mfu defaulting to the kind's."""
    if isinstance(gpu, str):
        gpu = get_gpu(gpu)
    mfu = gpu.mfu if mfu is None else float(mfu)
    if not 0 < mfu <= 1:
        raise ValueError("mfu must be in (0, 1], got %r" % mfu)
    if params <= 0 or tokens_per_sample <= 0:
        raise ValueError("params and tokens_per_sample must be > 0, got %r and %r" % (params, tokens_per_sample))
    return 6.0 * params * tokens_per_sample / (gpu.tflops * 1e12 * mfu)
