/* codec.c - the wire format of sparse selections (see stella_sparse.h).
 * Encoding picks the smallest scheme the indices allow; decoding treats the
 * payload as untrusted and checks every field, the exact length, strict order
 * and the range of every index before an index is handed out. */
#include "compress_internal.h"
#include "stella_dense.h"
#include <stdlib.h>

static const uint8_t MAGIC[4] = {'S', 'T', 'S', 'P'};
#define VERSION 1
#define CONV_CHUNK 1024

static inline void wr16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void wr64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static int value_size(int vd) {
    switch (vd) {
    case STELLA_VAL_F32: return 4;
    case STELLA_VAL_F16: return 2;
    case STELLA_VAL_BF16: return 2;
    case STELLA_VAL_NONE: return 0;
    default: return -1;
    }
}

static inline int64_t nblocks_of(int64_t n) { return (n + 15) / 16; }
static inline int64_t nseg_of(int64_t n) { return (n + STELLA_SEGMENT - 1) / STELLA_SEGMENT; }
static inline int64_t block_len(int64_t n, int64_t b) { int64_t l = n - b * 16; return l < 16 ? l : 16; }
static inline int block_id_width(int64_t n) { return nblocks_of(n) <= 65536 ? 2 : 4; }

/* Is idx[i] the first of a whole block of idx[0..k) (ascending, < n)? Its length if so, else 0. */
static inline int64_t whole_block_at(const uint32_t *idx, int64_t i, int64_t k, int64_t n) {
    int64_t first = idx[i];
    if (first % 16) return 0;
    int64_t len = block_len(n, first / 16);
    /* ascending distinct values: the block is complete iff its last one is first+len-1 */
    return i + len <= k && (int64_t)idx[i + len - 1] == first + len - 1 ? len : 0;
}

/* The MIXED layout of idx[0..k): the whole blocks among the indices (*nb of them, holding
 * *in_blocks entries); the other k - *in_blocks entries are singles. */
static void mixed_layout(const uint32_t *idx, int64_t k, int64_t n, int64_t *nb, int64_t *in_blocks) {
    int64_t i = 0, b = 0, e = 0;
    while (i < k) {
        int64_t len = whole_block_at(idx, i, k, n);
        if (len) { b++; e += len; i += len; } else i++;
    }
    *nb = b;
    *in_blocks = e;
}

/* n < 2^31 bounds every term: no int64 overflow is possible */
static int64_t mixed_size(int64_t n, int64_t nb, int64_t in_blocks, int64_t singles, int vs) {
    return STELLA_PAYLOAD_HEADER + block_id_width(n) * nb + 4 * nseg_of(n) + 2 * singles
           + (int64_t)vs * (in_blocks + singles);
}

int stella_payload_size(int64_t n, int64_t entries, int64_t nblocks, int scheme, int value_dtype, int64_t *nbytes) {
    if (!nbytes) return STELLA_ERR_NULL;
    int vs = value_size(value_dtype);
    if (vs < 0) return STELLA_ERR_ARG;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || entries < 0 || entries > n) return STELLA_ERR_ARG;
    int64_t ib;
    switch (scheme) {
    case STELLA_IDX_U32: ib = 4 * entries; break;
    case STELLA_IDX_SEG16: ib = 4 * nseg_of(n) + 2 * entries; break;
    case STELLA_IDX_BLOCK16:
    case STELLA_IDX_BLOCK32:
        if (nblocks < 0 || nblocks > nblocks_of(n) || entries > 16 * nblocks) return STELLA_ERR_ARG;
        if (nblocks > 0 && entries <= 16 * (nblocks - 1)) return STELLA_ERR_ARG;
        if (scheme == STELLA_IDX_BLOCK16 && nblocks_of(n) > 65536) return STELLA_ERR_ARG;
        ib = (scheme == STELLA_IDX_BLOCK16 ? 2 : 4) * nblocks;
        break;
    case STELLA_IDX_DENSE:
        if (entries != n) return STELLA_ERR_ARG;
        ib = 0;
        break;
    case STELLA_IDX_IMPLICIT: ib = 0; break;
    default: return STELLA_ERR_ARG;
    }
    /* n < 2^31 bounds every term: no int64 overflow is possible */
    *nbytes = STELLA_PAYLOAD_HEADER + ib + (int64_t)vs * entries;
    return STELLA_OK;
}

int stella_payload_bound(int64_t n, int64_t k, int value_dtype, int64_t *nbytes) {
    /* AUTO never picks a scheme larger than U32 */
    return stella_payload_size(n, k, 0, STELLA_IDX_U32, value_dtype, nbytes);
}

int stella_choose_scheme(int64_t n, int64_t k, int64_t whole_blocks, int *scheme) {
    if (!scheme) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n) return STELLA_ERR_ARG;
    if (whole_blocks < -1 || whole_blocks > nblocks_of(n)) return STELLA_ERR_ARG;
    const int order[5] = {STELLA_IDX_DENSE, STELLA_IDX_BLOCK16, STELLA_IDX_BLOCK32, STELLA_IDX_SEG16, STELLA_IDX_U32};
    int best = STELLA_IDX_U32;
    int64_t best_size = -1;
    for (int i = 0; i < 5; i++) {
        int s = order[i];
        if ((s == STELLA_IDX_BLOCK16 || s == STELLA_IDX_BLOCK32) && whole_blocks < 0) continue;
        int64_t sz;
        if (stella_payload_size(n, k, whole_blocks, s, STELLA_VAL_F32, &sz) != STELLA_OK) continue;
        if (best_size < 0 || sz < best_size) { best = s; best_size = sz; }
    }
    *scheme = best;
    return STELLA_OK;
}

/* Strictly ascending and < n? */
static int check_sorted(const uint32_t *idx, int64_t k, int64_t n) {
    int64_t prev = -1;
    for (int64_t i = 0; i < k; i++) {
        int64_t v = idx[i];
        if (v <= prev || v >= n) return 0;
        prev = v;
    }
    return 1;
}

/* Blocks if idx (ascending, < n) is exactly whole blocks, else -1. */
static int64_t count_whole_blocks(const uint32_t *idx, int64_t k, int64_t n) {
    int64_t nb, in_blocks;
    mixed_layout(idx, k, n, &nb, &in_blocks);
    return in_blocks == k ? nb : -1;
}

/* What stella_sparse_encode writes for idx[0..k) (checked: ascending, < n) with scheme:
 * the scheme AUTO resolves to, the exact size, and the MIXED layout. */
typedef struct { int scheme; int64_t size, nb, in_blocks; } payload_plan;

static int plan_payload(const uint32_t *idx, int64_t k, int64_t n, int scheme, int vd, payload_plan *pl) {
    int vs = value_size(vd);
    int64_t nb = 0, in_blocks = 0, whole = -1;
    if (vs < 0 || scheme < STELLA_IDX_AUTO || scheme > STELLA_IDX_MIXED || scheme == STELLA_IDX_IMPLICIT)
        return STELLA_ERR_ARG;
    if (scheme != STELLA_IDX_U32 && scheme != STELLA_IDX_SEG16 && scheme != STELLA_IDX_DENSE) {
        mixed_layout(idx, k, n, &nb, &in_blocks);
        if (in_blocks == k) whole = nb;
    }
    int automatic = scheme == STELLA_IDX_AUTO;
    if (automatic) stella_choose_scheme(n, k, whole, &scheme);
    int64_t size = -1;
    if (scheme == STELLA_IDX_MIXED) {
        if (nb == 0) return STELLA_ERR_ARG;
        size = mixed_size(n, nb, in_blocks, k - in_blocks, vs);
    } else {
        if ((scheme == STELLA_IDX_BLOCK16 || scheme == STELLA_IDX_BLOCK32) && whole < 0) return STELLA_ERR_ARG;
        int rc = stella_payload_size(n, k, whole, scheme, vd, &size);
        if (rc) return rc; /* e.g. DENSE with k != n, BLOCK16 on a large tensor */
        if (automatic && nb > 0 && in_blocks < k) {
            int64_t m = mixed_size(n, nb, in_blocks, k - in_blocks, vs);
            if (m < size) { scheme = STELLA_IDX_MIXED; size = m; }
        }
    }
    pl->scheme = scheme;
    pl->size = size;
    pl->nb = nb;
    pl->in_blocks = in_blocks;
    return STELLA_OK;
}

int stella_encoded_size(const uint32_t *idx, int64_t k, int64_t n, int scheme, int value_dtype,
                        int64_t *nbytes, int *chosen) {
    if (!nbytes) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n) return STELLA_ERR_ARG;
    if (k > 0 && !idx) return STELLA_ERR_NULL;
    if (!check_sorted(idx, k, n)) return STELLA_ERR_ARG;
    payload_plan pl;
    int rc = plan_payload(idx, k, n, scheme, value_dtype, &pl);
    if (rc) return rc;
    *nbytes = pl.size;
    if (chosen) *chosen = pl.scheme;
    return STELLA_OK;
}

int stella_whole_blocks(const uint32_t *idx, int64_t k, int64_t n, int64_t *nblocks) {
    if (!nblocks) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n) return STELLA_ERR_ARG;
    if (k > 0 && !idx) return STELLA_ERR_NULL;
    if (!check_sorted(idx, k, n)) return STELLA_ERR_ARG;
    *nblocks = count_whole_blocks(idx, k, n);
    return STELLA_OK;
}

static void write_header(uint8_t *out, int scheme, int vd, int64_t n, int64_t count, uint64_t key) {
    memcpy(out, MAGIC, 4);
    out[4] = VERSION;
    out[5] = (uint8_t)scheme;
    out[6] = (uint8_t)vd;
    out[7] = 0;
    wr64(out + 8, (uint64_t)n);
    wr64(out + 16, (uint64_t)count);
    wr64(out + 24, key);
}

static void write_values(uint8_t *out, const float *val, int64_t k, int vd) {
    if (vd == STELLA_VAL_NONE) return;
    if (vd == STELLA_VAL_F32) { if (k) memcpy(out, val, (size_t)k * 4); return; }
    uint16_t tmp[CONV_CHUNK];
    for (int64_t i = 0; i < k; i += CONV_CHUNK) {
        int64_t c = k - i < CONV_CHUNK ? k - i : CONV_CHUNK;
        if (vd == STELLA_VAL_F16) stella_f32_to_f16(val + i, tmp, c, 1.0f);
        else stella_f32_to_bf16(val + i, tmp, c, 1.0f);
        memcpy(out + 2 * i, tmp, (size_t)c * 2);
    }
}

static void read_values(const uint8_t *in, float *val, int64_t k, int vd) {
    if (vd == STELLA_VAL_NONE) { for (int64_t i = 0; i < k; i++) val[i] = 0.0f; return; }
    if (vd == STELLA_VAL_F32) { if (k) memcpy(val, in, (size_t)k * 4); return; }
    uint16_t tmp[CONV_CHUNK];
    for (int64_t i = 0; i < k; i += CONV_CHUNK) {
        int64_t c = k - i < CONV_CHUNK ? k - i : CONV_CHUNK;
        memcpy(tmp, in + 2 * i, (size_t)c * 2);
        if (vd == STELLA_VAL_F16) stella_f16_to_f32(tmp, val + i, c, 1.0f);
        else stella_bf16_to_f32(tmp, val + i, c, 1.0f);
    }
}

int stella_sparse_encode(const uint32_t *idx, const float *val, int64_t k, int64_t n,
                         int scheme, int value_dtype, uint8_t *out, int64_t cap, int64_t *written) {
    if (!written) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n || cap < 0) return STELLA_ERR_ARG;
    if (value_size(value_dtype) < 0) return STELLA_ERR_ARG;
    if (scheme < STELLA_IDX_AUTO || scheme > STELLA_IDX_MIXED || scheme == STELLA_IDX_IMPLICIT) return STELLA_ERR_ARG;
    if (k > 0 && (!idx || !val)) return STELLA_ERR_NULL;
    if (!out) return STELLA_ERR_NULL;
    if (!check_sorted(idx, k, n)) return STELLA_ERR_ARG;
    payload_plan pl;
    int rc = plan_payload(idx, k, n, scheme, value_dtype, &pl);
    if (rc) return rc;
    scheme = pl.scheme;
    int64_t size = pl.size, nb = pl.nb;
    if (cap < size) return STELLA_ERR_SIZE;
    uint8_t *p = out + STELLA_PAYLOAD_HEADER;
    int64_t count = k;
    uint64_t key = 0;
    switch (scheme) {
    case STELLA_IDX_U32:
        if (k) memcpy(p, idx, (size_t)k * 4);
        p += 4 * k;
        break;
    case STELLA_IDX_SEG16: {
        int64_t nseg = nseg_of(n), i = 0;
        for (int64_t s = 0; s < nseg; s++) {
            int64_t end = (s + 1) * STELLA_SEGMENT, c = 0;
            while (i < k && (int64_t)idx[i] < end) { i++; c++; }
            wr32(p + 4 * s, (uint32_t)c);
        }
        p += 4 * nseg;
        for (int64_t j = 0; j < k; j++) wr16(p + 2 * j, (uint16_t)(idx[j] & 0xffffu));
        p += 2 * k;
        break;
    }
    case STELLA_IDX_BLOCK16:
    case STELLA_IDX_BLOCK32: {
        int w = scheme == STELLA_IDX_BLOCK16 ? 2 : 4;
        int64_t i = 0, b = 0;
        while (i < k) {
            uint32_t id = idx[i] / 16;
            if (w == 2) wr16(p + 2 * b, (uint16_t)id); else wr32(p + 4 * b, id);
            i += block_len(n, id);
            b++;
        }
        p += w * nb;
        count = nb;
        break;
    }
    case STELLA_IDX_MIXED: {
        int w = block_id_width(n);
        int64_t nseg = nseg_of(n), singles = k - pl.in_blocks, i = 0, b = 0, j = 0;
        uint8_t *seg = p + w * nb, *offs = seg + 4 * nseg;
        memset(seg, 0, (size_t)(4 * nseg));
        while (i < k) {
            int64_t len = whole_block_at(idx, i, k, n);
            if (len) {
                uint32_t id = idx[i] / 16;
                if (w == 2) wr16(p + 2 * b, (uint16_t)id); else wr32(p + 4 * b, id);
                b++;
                i += len;
            } else {
                uint8_t *c = seg + 4 * (idx[i] / STELLA_SEGMENT);
                wr32(c, rd32(c) + 1);
                wr16(offs + 2 * j, (uint16_t)(idx[i] & 0xffffu));
                j++;
                i++;
            }
        }
        p = offs + 2 * singles;
        count = nb;
        key = (uint64_t)singles;
        break;
    }
    case STELLA_IDX_DENSE:
        break;
    default:
        return STELLA_ERR_ARG;
    }
    write_header(out, scheme, value_dtype, n, count, key);
    write_values(p, val, k, value_dtype);
    *written = size;
    return STELLA_OK;
}

int stella_randomk_encode(uint64_t key, const float *val, int64_t k, int64_t n, int value_dtype,
                          uint8_t *out, int64_t cap, int64_t *written) {
    if (!written) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n || cap < 0) return STELLA_ERR_ARG;
    if (value_size(value_dtype) < 0) return STELLA_ERR_ARG;
    if ((k > 0 && !val) || !out) return STELLA_ERR_NULL;
    int64_t size;
    int rc = stella_payload_size(n, k, 0, STELLA_IDX_IMPLICIT, value_dtype, &size);
    if (rc) return rc;
    if (cap < size) return STELLA_ERR_SIZE;
    write_header(out, STELLA_IDX_IMPLICIT, value_dtype, n, k, key);
    write_values(out + STELLA_PAYLOAD_HEADER, val, k, value_dtype);
    *written = size;
    return STELLA_OK;
}

int stella_sparse_decode_info(const uint8_t *buf, int64_t len, int64_t n, stella_payload_info *info) {
    if (!info) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || len < 0) return STELLA_ERR_ARG;
    if (len > 0 && !buf) return STELLA_ERR_NULL;
    if (len < STELLA_PAYLOAD_HEADER) return STELLA_ERR_MALFORMED;
    if (memcmp(buf, MAGIC, 4) != 0 || buf[4] != VERSION || buf[7] != 0) return STELLA_ERR_MALFORMED;
    int scheme = buf[5], vd = buf[6];
    if (scheme > STELLA_IDX_MIXED || value_size(vd) < 0) return STELLA_ERR_MALFORMED;
    uint64_t hn = rd64(buf + 8), count = rd64(buf + 16), key = rd64(buf + 24);
    if (hn != (uint64_t)n) return STELLA_ERR_MALFORMED;
    if (scheme != STELLA_IDX_IMPLICIT && scheme != STELLA_IDX_MIXED && key != 0) return STELLA_ERR_MALFORMED;
    int64_t entries, nblocks = 0, size = -1;
    if (scheme == STELLA_IDX_MIXED) {
        int64_t nbt = nblocks_of(n);
        int w = block_id_width(n);
        if (count > (uint64_t)nbt || key > (uint64_t)n) return STELLA_ERR_MALFORMED;
        nblocks = (int64_t)count;
        if (len < STELLA_PAYLOAD_HEADER + w * nblocks) return STELLA_ERR_MALFORMED;
        int64_t in_blocks = 16 * nblocks;
        if (nblocks > 0) {
            const uint8_t *last = buf + STELLA_PAYLOAD_HEADER + w * (nblocks - 1);
            int64_t lid = w == 2 ? rd16(last) : rd32(last);
            if (lid >= nbt) return STELLA_ERR_MALFORMED;
            in_blocks -= 16 - block_len(n, lid);
        }
        entries = in_blocks + (int64_t)key;
        if (entries > n) return STELLA_ERR_MALFORMED;
        size = mixed_size(n, nblocks, in_blocks, (int64_t)key, value_size(vd));
    } else if (scheme == STELLA_IDX_BLOCK16 || scheme == STELLA_IDX_BLOCK32) {
        int64_t nbt = nblocks_of(n);
        if (count > (uint64_t)nbt) return STELLA_ERR_MALFORMED;
        if (scheme == STELLA_IDX_BLOCK16 && nbt > 65536) return STELLA_ERR_MALFORMED;
        nblocks = (int64_t)count;
        int w = scheme == STELLA_IDX_BLOCK16 ? 2 : 4;
        if (len < STELLA_PAYLOAD_HEADER + w * nblocks) return STELLA_ERR_MALFORMED;
        entries = 16 * nblocks;
        if (nblocks > 0) {
            const uint8_t *last = buf + STELLA_PAYLOAD_HEADER + w * (nblocks - 1);
            int64_t lid = w == 2 ? rd16(last) : rd32(last);
            if (lid >= nbt) return STELLA_ERR_MALFORMED;
            entries -= 16 - block_len(n, lid);
        }
    } else {
        if (count > (uint64_t)n) return STELLA_ERR_MALFORMED;
        entries = (int64_t)count;
        if (scheme == STELLA_IDX_DENSE && entries != n) return STELLA_ERR_MALFORMED;
    }
    if (scheme != STELLA_IDX_MIXED && stella_payload_size(n, entries, nblocks, scheme, vd, &size) != STELLA_OK)
        return STELLA_ERR_MALFORMED;
    if (size != len) return STELLA_ERR_MALFORMED;
    info->n = n;
    info->count = (int64_t)count;
    info->entries = entries;
    info->nbytes = size;
    info->scheme = scheme;
    info->value_dtype = vd;
    info->key = key;
    return STELLA_OK;
}

/* The SEG16 index section at p (ceil(n/64K) uint32 counts, then k uint16 offsets) into
 * out[0..k): 1 if valid (counts summing to k, offsets ascending in each segment, indices < n).
 * One pass: each count is read once and bounded before any write, so the output stays inside
 * out[0..k) even if the buffer changes while we read it. */
static int decode_seg16(const uint8_t *p, int64_t n, int64_t k, uint32_t *out) {
    int64_t nseg = nseg_of(n), j = 0;
    const uint8_t *offs = p + 4 * nseg;
    for (int64_t s = 0; s < nseg; s++) {
        int64_t c = rd32(p + 4 * s), base = s * STELLA_SEGMENT, prev = -1;
        int64_t seg_len = n - base;
        if (seg_len > STELLA_SEGMENT) seg_len = STELLA_SEGMENT;
        if (c > seg_len || c > k - j) return 0;
        for (int64_t t = 0; t < c; t++, j++) {
            int64_t off = rd16(offs + 2 * j);
            if (off <= prev || base + off >= n) return 0;
            out[j] = (uint32_t)(base + off);
            prev = off;
        }
    }
    return j == k;
}

int stella_sparse_decode(const uint8_t *buf, int64_t len, int64_t n, uint64_t expected_key,
                         uint32_t *idx, float *val, int64_t cap, int64_t *out_k) {
    if (!out_k) return STELLA_ERR_NULL;
    stella_payload_info info;
    int rc = stella_sparse_decode_info(buf, len, n, &info);
    if (rc) return rc;
    if (cap < info.entries) return STELLA_ERR_SIZE;
    if (info.entries > 0 && (!idx || !val)) return STELLA_ERR_NULL;
    *out_k = 0;
    const uint8_t *p = buf + STELLA_PAYLOAD_HEADER;
    int64_t k = info.entries;
    switch (info.scheme) {
    case STELLA_IDX_U32: {
        int64_t prev = -1;
        for (int64_t i = 0; i < k; i++) {
            int64_t v = rd32(p + 4 * i);
            if (v <= prev || v >= n) return STELLA_ERR_MALFORMED;
            idx[i] = (uint32_t)v;
            prev = v;
        }
        p += 4 * k;
        break;
    }
    case STELLA_IDX_SEG16:
        if (!decode_seg16(p, n, k, idx)) return STELLA_ERR_MALFORMED;
        p += 4 * nseg_of(n) + 2 * k;
        break;
    case STELLA_IDX_BLOCK16:
    case STELLA_IDX_BLOCK32: {
        int w = info.scheme == STELLA_IDX_BLOCK16 ? 2 : 4;
        int64_t nbt = nblocks_of(n), prev = -1, j = 0;
        for (int64_t b = 0; b < info.count; b++) {
            int64_t id = w == 2 ? rd16(p + 2 * b) : rd32(p + 4 * b);
            if (id <= prev || id >= nbt) return STELLA_ERR_MALFORMED;
            int64_t bl = block_len(n, id);
            if (j + bl > k) return STELLA_ERR_MALFORMED; /* cannot happen once ordered; kept as a guard */
            for (int64_t t = 0; t < bl; t++) idx[j + t] = (uint32_t)(id * 16 + t);
            j += bl;
            prev = id;
        }
        if (j != k) return STELLA_ERR_MALFORMED;
        p += w * info.count;
        break;
    }
    case STELLA_IDX_MIXED: {
        int w = block_id_width(n);
        int64_t nbt = nblocks_of(n), nseg = nseg_of(n), nb = info.count, m = (int64_t)info.key;
        const uint8_t *seg = p + w * nb, *offs = seg + 4 * nseg;
        /* the singles first, validated as SEG16, into the end of idx ... */
        uint32_t *singles = m ? idx + (k - m) : idx;   /* (no arithmetic on a NULL idx when k == 0) */
        if (!decode_seg16(seg, n, m, singles)) return STELLA_ERR_MALFORMED;
        /* ... then the blocks merged in front of them, in place: the entries written never
         * reach the next single still to be read (o <= k - m + t) */
        int64_t o = 0, t = 0, prev = -1;
        for (int64_t b = 0; b < nb; b++) {
            int64_t id = w == 2 ? rd16(p + 2 * b) : rd32(p + 4 * b);
            if (id <= prev || id >= nbt) return STELLA_ERR_MALFORMED;
            int64_t start = id * 16, bl = block_len(n, id);
            while (t < m && (int64_t)singles[t] < start) idx[o++] = singles[t++];
            if (t < m && (int64_t)singles[t] < start + bl) return STELLA_ERR_MALFORMED; /* a single in a block */
            if (o + bl > k - m + t) return STELLA_ERR_MALFORMED; /* cannot happen once ordered; kept as a guard */
            for (int64_t q = 0; q < bl; q++) idx[o + q] = (uint32_t)(start + q);
            o += bl;
            prev = id;
        }
        while (t < m) idx[o++] = singles[t++];
        if (o != k) return STELLA_ERR_MALFORMED;
        p = offs + 2 * m;
        break;
    }
    case STELLA_IDX_DENSE:
        for (int64_t i = 0; i < k; i++) idx[i] = (uint32_t)i;
        break;
    case STELLA_IDX_IMPLICIT:
        if (info.key != expected_key) return STELLA_ERR_MALFORMED;
        rc = stella_randomk_indices(info.key, n, k, idx, cap);
        if (rc) return rc;
        break;
    default:
        return STELLA_ERR_MALFORMED;
    }
    read_values(p, val, k, info.value_dtype);
    *out_k = k;
    return STELLA_OK;
}
