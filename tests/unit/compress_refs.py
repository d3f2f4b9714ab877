"""numpy references for the compression kernels (slow, obviously correct)."""
import numpy as np

KEY_NAN = np.uint32(0x7F800001)


def keys(x):
    """Magnitude keys: bits of |x|, every NaN just above +Inf."""
    k = x.astype(np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    return np.minimum(k, KEY_NAN)


def top_units(k, m):
    """Indices (ascending) of the m largest keys, ties to the lower index."""
    n = k.size
    if m == 0:
        return np.empty(0, np.int64)
    if m == n:
        return np.arange(n)
    kstar = np.partition(k, n - m)[n - m]
    gt = np.flatnonzero(k > kstar)
    eq = np.flatnonzero(k == kstar)[: m - gt.size]
    return np.sort(np.concatenate([gt, eq]))


def block_keys(acc):
    n = acc.size
    nb = (n + 15) // 16
    x = np.zeros(nb * 16, np.float32)
    x[:n] = np.abs(acc)
    x = x.reshape(nb, 16)
    u = x[:, :8] + x[:, 8:]
    w = u[:, :4] + u[:, 4:]
    y = w[:, :2] + w[:, 2:]
    return keys(y[:, 0] + y[:, 1])


def ref_topk(acc, k):
    return top_units(keys(acc), k)


def ref_blocks(acc, k):
    n = acc.size
    nb = (n + 15) // 16
    want = min(nb, -(-k // 16))
    b = top_units(block_keys(acc), want)
    e = (b[:, None] * 16 + np.arange(16)).ravel()
    return e[e < n]


def ref_blocks_and_singles(acc, nblocks, singles):
    """Cache-aware with singles: the ``nblocks`` best blocks, then the ``singles`` largest
    entries outside them, those of magnitude 0 left out; ascending."""
    b = ref_blocks(acc, 16 * nblocks)
    rest = np.array(acc, np.float32)
    rest[b] = 0.0
    s = top_units(keys(rest), min(singles, acc.size))
    s = s[keys(rest[s]) != 0]
    return np.sort(np.concatenate([b, s]))


def same_bits(a, b):
    """Bitwise equal float32 arrays, any NaN equal to any NaN."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a) & np.isnan(b)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | nan))


def check_ef(acc, idx, val, residual_after):
    """sent + residual == acc bit for bit: sent entries carry acc, residual +0.0 there, acc elsewhere."""
    idx = np.asarray(idx, np.int64)
    assert same_bits(val, acc[idx]), "sent values differ from acc"
    mask = np.zeros(acc.size, bool)
    mask[idx] = True
    r = np.asarray(residual_after)
    assert np.all(r[mask].view(np.uint32) == 0), "residual not +0.0 where sent"
    assert same_bits(r[~mask], acc[~mask]), "residual differs from acc where not sent"


def ref_merge(lists):
    """Union ascending; values summed in list order."""
    acc = {}
    for idx, val in lists:
        for i, v in zip(np.asarray(idx).tolist(), np.asarray(val, np.float32).tolist()):
            acc[i] = np.float32(acc[i] + np.float32(v)) if i in acc else np.float32(v)
    ks = sorted(acc)
    return np.array(ks, np.int64), np.array([acc[i] for i in ks], np.float32)
