"""CPU costs of the cross-cluster kernels, measured on the machine at hand and fitted per element
or per entry, so the planner (and bench/scale_study.py) can price a step at any scale.

Everything is timed on the real code paths: the compressors' ``select``/``encode``/``decode``
(:mod:`stella_mpi.compression`, the C kernels of ``c_src/``), the k-way merge
(:func:`stella_mpi.compression.merge_selections`), the tree's re-selection (the same calls
``comm/sparse_exchange.tree_reduce`` makes), THC's ``begin``/``quantize``/``finish`` and the
dense float32 sum (``_native/dense.accumulate``, what a cluster's leader adds as payloads
arrive). The merge is timed with C = 2..64 *virtual participants*: C real selections made by
the real compressor from C random shards, encoded, decoded and merged as the all-gather does,
so its growth with C is measured, not assumed. The merge kernel walks the index space in
windows of 4096 and visits every list in each window, so it is fitted as::

    merge_s = merge_s_per_entry * entries_in + merge_s_per_list_window * lists * windows

(``windows`` = the 4096-index windows that hold an entry: min(shard / 4096, entries_in)).

Each timing is the best of a few repeats (the machine may be shared). Costs scale with the CPU:
``cpu_factor`` in the pricing functions divides them (2.0: a host CPU twice as fast per core).
"""
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

__all__ = ["KernelCosts", "measure", "merged_entries", "WINDOW", "SPARSE_COMPRESSORS"]

WINDOW = 4096   # c_src/merge.c's window of indices
# measured at density 1 % and each compressor's defaults (sparseloco: chunks of 4096, 2 bits)
SPARSE_COMPRESSORS = ("topk", "cacheaware", "sparseloco")


def merged_entries(shard_elements, entries, lists):
    """Expected size of the union of ``lists`` independent selections of ``entries`` out of
    ``shard_elements`` (uncorrelated gradients: the largest union, an upper bound)."""
    if shard_elements <= 0:
        return 0.0
    d = min(1.0, entries / shard_elements)
    return shard_elements * (1.0 - (1.0 - d) ** lists)


def _windows(shard_elements, entries_in):
    return min(math.ceil(shard_elements / WINDOW), entries_in)


@dataclass(frozen=True)
class KernelCosts:
    """Seconds per element or per entry on the CPU they were measured on (one core: the
    collective thread runs them one after the other). "Element": one float32 of the shard the
    rank owns; "entry": one (index, value) of a selection."""
    # selection with error feedback (acc = shard + residual, pick, residual update): per shard element
    select_s_per_element: dict = field(default_factory=dict)   # compressor -> s
    # payload encode (auto index scheme) of this rank's selection: per entry
    encode_s_per_entry: dict = field(default_factory=dict)     # compressor -> s
    # validated decode of a peer's payload: per entry
    decode_s_per_entry: dict = field(default_factory=dict)     # compressor -> s
    # payload bytes per entry the real encoder wrote at 1 % (header included, averaged)
    payload_bytes_per_entry: dict = field(default_factory=dict)  # compressor -> bytes
    # k-way merge: per entry merged in, and per list per 4096-index window visited
    merge_s_per_entry: float = 0.0
    merge_s_per_list_window: float = 0.0
    # the tree's re-selection of k out of a round's merge of 2 lists (top-k over the merged
    # values, the keep mask, the dropped entries into the residual): per merged entry
    reselect_s_per_entry: float = 0.0
    # zero the shard and scatter-add the merged selection into it: per element, per entry
    zero_s_per_element: float = 0.0
    scatter_s_per_entry: float = 0.0
    # THC at ``thc_bits`` bits: begin (residual add, rotation, block maxima), quantize (with
    # lanes for 2 clusters; quantize_64 for 64), finish (unpack the summed lanes, rotate back,
    # residual): per element
    thc_bits: int = 4
    thc_begin_s_per_element: float = 0.0
    thc_quantize_s_per_element: float = 0.0
    thc_quantize64_s_per_element: float = 0.0
    thc_finish_s_per_element: float = 0.0
    thc_finish64_s_per_element: float = 0.0
    # the float32 sum of an arriving vector into the accumulator (MPI's reduction, the 2-cluster
    # exchange, the 16-bit all-gather's sums): per element added
    dense_sum_s_per_element: float = 0.0
    # what the fit came from
    sizes: dict = field(default_factory=dict)
    machine: str = ""

    # ------------------------------------------------------------ pricing

    def sparse_parts(self, compressor, shard_elements, entries, nclusters, algorithm, cpu_factor=1.0):
        """{part: seconds} of one rank's sparse step on one shard: select, encode, decode,
        merge, reselect (tree), scatter."""
        if compressor not in self.select_s_per_element:
            raise ValueError("no measured costs for compressor %r; measured: %s (kernel_costs.measure covers %s: "
                             "calibrate again to measure a compressor an older calibration lacks)"
                             % (compressor, ", ".join(sorted(self.select_s_per_element)),
                                ", ".join(SPARSE_COMPRESSORS)))
        if algorithm not in ("allgather", "tree"):
            raise ValueError("algorithm must be 'allgather' or 'tree', got %r" % (algorithm,))
        n, k, c = float(shard_elements), float(entries), int(nclusters)
        enc, dec = self.encode_s_per_entry[compressor], self.decode_s_per_entry[compressor]
        parts = {"select": self.select_s_per_element[compressor] * n}
        if algorithm == "allgather" or c < 2:
            entries_in = c * k
            merged = merged_entries(n, k, c)
            parts["encode"] = enc * k
            parts["decode"] = dec * k * (c - 1)
            parts["merge"] = (self.merge_s_per_entry * entries_in
                              + self.merge_s_per_list_window * c * _windows(n, entries_in)) if c > 1 else 0.0
            parts["reselect"] = 0.0
        else:
            rounds = max(1, math.ceil(math.log2(c)))
            merged2 = merged_entries(n, k, 2)
            parts["encode"] = enc * k * rounds
            parts["decode"] = dec * k * rounds
            parts["merge"] = rounds * (self.merge_s_per_entry * 2 * k
                                       + self.merge_s_per_list_window * 2 * _windows(n, 2 * k))
            parts["reselect"] = rounds * self.reselect_s_per_entry * merged2
            merged = k
        parts["scatter"] = self.zero_s_per_element * n + self.scatter_s_per_entry * merged
        return {p: v / cpu_factor for p, v in parts.items()}

    def sparse_cpu_s(self, compressor, shard_elements, entries, nclusters, algorithm, cpu_factor=1.0):
        """Seconds of select + encode + decode + merge (+ the tree's re-selection) + scatter per
        step on one rank owning ``shard_elements`` and sending ``entries``."""
        return sum(self.sparse_parts(compressor, shard_elements, entries, nclusters, algorithm, cpu_factor).values())

    def thc_parts(self, elements, bits, nclusters, cpu_factor=1.0):
        """{part: seconds} of THC on ``elements``: begin, quantize, sum (MPI adds the words that
        arrive: (C-1)/C of them, ring), finish. Quantize and finish interpolate in log2(C)
        between their measurements at 2 and 64 clusters (the lanes widen with C)."""
        from .._native import thc as thc_kernels
        c = max(2, int(nclusters))
        t = min(1.0, max(0.0, (math.log2(c) - 1.0) / 5.0))
        q = self.thc_quantize_s_per_element * (1 - t) + self.thc_quantize64_s_per_element * t
        f = self.thc_finish_s_per_element * (1 - t) + self.thc_finish64_s_per_element * t
        words = thc_kernels.words_for(int(elements), thc_kernels.lane_bits(int(bits), c))
        parts = {"begin": self.thc_begin_s_per_element * elements, "quantize": q * elements,
                 "sum": self.dense_sum_s_per_element * words * 2 * (c - 1) / c,   # 64-bit words: 2 floats' worth
                 "finish": f * elements}
        return {p: v / cpu_factor for p, v in parts.items()}

    def thc_cpu_s(self, elements, bits, nclusters, cpu_factor=1.0):
        """Seconds of THC's three calls and the words' sum per step on ``elements`` (one rank)."""
        return sum(self.thc_parts(elements, bits, nclusters, cpu_factor).values())

    def dense_cpu_s(self, elements, nclusters, cpu_factor=1.0):
        """Seconds of summing what arrives in a dense cross-cluster allreduce of ``elements``
        float32 (reduce-scatter: (C-1)/C of them per rank)."""
        c = max(1, int(nclusters))
        return self.dense_sum_s_per_element * elements * (c - 1) / c / cpu_factor

    # ------------------------------------------------------------ (de)serialisation

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, d):
        names = set(cls.__dataclass_fields__)
        unknown = set(d) - names
        if unknown:
            raise ValueError("KernelCosts.from_dict: unknown fields %s (known: %s)" % (sorted(unknown), sorted(names)))
        return cls(**d)


# ---------------------------------------------------------------- measurement

def _best(fn, repeats):
    """Least seconds of ``repeats`` calls of fn (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _fit(xs, ys):
    """Non-negative least squares of ys on the columns of xs. One column: the median of the
    points' ratios (a point slowed by another process on a shared machine moves it least)."""
    a = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    if a.shape[1] == 1:
        return [float(np.median(y / np.maximum(a[:, 0], 1e-30)))]
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if (coef < 0).any():
        coef = np.zeros(a.shape[1])
        j = int(np.argmax([np.linalg.lstsq(a[:, [i]], y, rcond=None)[0][0] for i in range(a.shape[1])]))
        coef[j] = max(0.0, np.linalg.lstsq(a[:, [j]], y, rcond=None)[0][0])
    return [float(c) for c in coef]


def _compressor(name, density):
    from ..compression import get_compressor
    return get_compressor(name, density=density)


def _ctx(name, n, step=0):
    from ..compression import TensorContext
    return TensorContext(name=name, step=step, shape=(n,), seed=7)


def participants(comp, n, c, seed=0):
    """C real selections (and their payloads) of the compressor on C random shards of n elements,
    each with its own error-feedback memory (second step: carried thresholds in use)."""
    from ..compression.memory import Memory
    gen = torch.Generator().manual_seed(seed)
    sels, payloads = [], []
    for i in range(c):
        mem = Memory()
        ctx = _ctx("p%d" % i, n)
        shard = torch.randn(n, generator=gen)
        comp.select(shard, ctx, memory=mem)
        shard = torch.randn(n, generator=gen)
        sel = comp.select(shard, _ctx("p%d" % i, n, 1), memory=mem)
        sels.append(sel)
        payloads.append(comp.encode(sel, ctx))
    return sels, payloads


def time_allgather_merge(comp, n, c, repeats=2, seed=0):
    """(decode seconds of C-1 payloads, merge seconds of C selections, entries in, merged) with C
    virtual participants: the all-gather's decode and merge as sparse_exchange runs them."""
    from ..compression import merge_selections
    sels, payloads = participants(comp, n, c, seed)
    ctx = _ctx("p0", n)
    decode = _best(lambda: [comp.decode(p, ctx, n) for p in payloads[1:]], repeats)
    merged = merge_selections(sels)
    merge = _best(lambda: merge_selections(sels), repeats)
    return decode, merge, sum(len(s) for s in sels), len(merged)


def time_tree_round(comp, n, repeats=2, seed=0):
    """(merge seconds, re-selection seconds, merged entries) of one round of the tree: merge two
    selections, keep the k largest, the dropped ones into the residual (tree_reduce's calls)."""
    from .._native import compress as kernels
    from ..compression import merge_selections
    sels, _ = participants(comp, n, 2, seed)
    k = max(comp.k_for(n), 1)
    res = torch.zeros(n)
    merged = merge_selections(sels)

    def reselect():
        pos, _ = kernels.topk(merged.values, k)
        keep = torch.zeros(len(merged), dtype=torch.bool)
        keep[pos.long()] = True
        res.index_add_(0, merged.indices[~keep].long(), merged.values[~keep])
        return merged.indices[keep].contiguous(), merged.values[keep].contiguous()
    return _best(lambda: merge_selections(sels), repeats), _best(reselect, repeats), len(merged)


def measure(quick=True, density=0.01):
    """Measure the kernels here and fit the costs (a few seconds with ``quick``)."""
    from .._native import dense as dense_kernels
    from ..compression import scatter_add
    from ..compression.memory import Memory
    from ..compression.thc import THCCompressor
    torch.manual_seed(0)
    repeats = 3 if quick else 5
    sizes = [1 << 17, 1 << 19] if quick else [1 << 18, 1 << 20, 1 << 22]
    merge_cs = [2, 8, 32, 64] if quick else [2, 4, 8, 16, 32, 64]
    merge_n = 1 << 17 if quick else 1 << 19
    out = {"select_s_per_element": {}, "encode_s_per_entry": {}, "decode_s_per_entry": {},
           "payload_bytes_per_entry": {}}
    # selection and encoding, per compressor, at each size
    for name in SPARSE_COMPRESSORS:
        comp = _compressor(name, density)
        sel_x, sel_y, enc_x, enc_y, dec_x, dec_y, nbytes, nent = [], [], [], [], [], [], 0, 0
        for n in sizes:
            mem = Memory()
            shard = torch.randn(n)
            comp.select(shard, _ctx("s", n), memory=mem)   # warm state (thresholds), as at step 1+
            sel_y.append(_best(lambda: comp.select(shard, _ctx("s", n, 1), memory=mem), repeats))
            sel_x.append([n])
            sel = comp.select(shard, _ctx("s", n, 2), memory=mem)
            payload = comp.encode(sel, _ctx("s", n))
            nbytes, nent = nbytes + payload.numel(), nent + len(sel)
            enc_y.append(_best(lambda: comp.encode(sel, _ctx("s", n)), repeats))
            enc_x.append([len(sel)])
            dec_y.append(_best(lambda: comp.decode(payload, _ctx("s", n), n), repeats))
            dec_x.append([len(sel)])
        out["select_s_per_element"][name] = _fit(sel_x, sel_y)[0]
        out["encode_s_per_entry"][name] = _fit(enc_x, enc_y)[0]
        out["decode_s_per_entry"][name] = _fit(dec_x, dec_y)[0]
        out["payload_bytes_per_entry"][name] = nbytes / max(nent, 1)
    # the merge with C virtual participants (top-k selections: ascending, randomly spread)
    comp = _compressor("topk", density)
    mx, my, dec_x, dec_y = [], [], [], []
    for c in merge_cs:
        d, m, entries_in, _ = time_allgather_merge(comp, merge_n, c, repeats)
        mx.append([entries_in, c * _windows(merge_n, entries_in)])
        my.append(m)
        dec_x.append([entries_in * (c - 1) / c])
        dec_y.append(d)
    out["merge_s_per_entry"], out["merge_s_per_list_window"] = _fit(mx, my)
    # the tree's round
    rx, ry = [], []
    for n in sizes:
        _, r, merged = time_tree_round(comp, n, repeats)
        rx.append([merged])
        ry.append(r)
    out["reselect_s_per_entry"] = _fit(rx, ry)[0]
    # zero + scatter
    n = sizes[-1]
    piece = torch.zeros(n)
    sels, _ = participants(comp, n, 1)
    out["zero_s_per_element"] = _best(lambda: piece.zero_(), repeats) / n
    out["scatter_s_per_entry"] = _best(lambda: scatter_add(piece, sels[0]), repeats) / max(len(sels[0]), 1)
    # THC at 4 bits, lanes for 2 and for 64 clusters
    thc = THCCompressor(bits=4)
    n = sizes[-1]
    mem = Memory()
    flat = torch.randn(n)
    scratch = torch.empty(n)
    ctx = _ctx("t", n)

    # (each call repeats the same work in place: begin adds the residual again, quantize
    # re-quantizes what it sent, finish rotates back and unpacks again; no copies to subtract)
    work = thc.begin(flat, ctx, mem, scratch)
    out["thc_begin_s_per_element"] = _best(lambda: thc.begin(flat, ctx, mem, scratch), repeats) / n
    scales = np.ascontiguousarray(work.absmax)
    for c, qk, fk in ((2, "thc_quantize_s_per_element", "thc_finish_s_per_element"),
                      (64, "thc_quantize64_s_per_element", "thc_finish64_s_per_element")):
        work = thc.begin(flat, ctx, mem, scratch)
        out[qk] = _best(lambda: thc.quantize(work, scales, c, 0), repeats) / n
        words = thc.quantize(work, scales, c, 0)
        out[fk] = _best(lambda: thc.finish(work, words, c, scales, mem), repeats) / n
    # the dense float32 sum
    acc, src = torch.zeros(n), torch.randn(n)
    out["dense_sum_s_per_element"] = _best(lambda: dense_kernels.accumulate(acc, src, "sum"), repeats) / n
    import platform
    out["sizes"] = {"shards": sizes, "merge_shard": merge_n, "merge_clusters": merge_cs, "density": density,
                    "repeats": repeats}
    out["machine"] = "%s, %s" % (platform.processor() or platform.machine(), _cpu_model())
    return KernelCosts(**out)


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
