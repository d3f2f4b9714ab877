/* chunked.c - SparseLoCo's compression (see stella_chunked.h): top-k per chunk with
 * error feedback, per-chunk quantisation of the selected values, and the payload. */
#include "stella_chunked.h"
#include "compress_internal.h"
#include <math.h>
#include <stdlib.h>

static const uint8_t QMAGIC[4] = {'S', 'T', 'Q', 'Z'};
#define QVERSION 1

static inline void wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void wr64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static int chunk_ok(int64_t chunk) {
    return chunk >= STELLA_CHUNK_MIN && chunk <= STELLA_CHUNK_MAX && !(chunk & (chunk - 1));
}
static int bits_ok(int bits) { return bits == 2 || bits == 4 || bits == 8; }
static inline int64_t nchunks_of(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }
static inline int64_t code_bytes(int64_t k, int bits) { return (k * bits + 7) / 8; }

int stella_chunk_k(int64_t k, int64_t chunk, int64_t len, int64_t *out) {
    if (!out) return STELLA_ERR_NULL;
    if (!chunk_ok(chunk) || k < 0 || k > chunk || len < 0 || len > chunk) return STELLA_ERR_ARG;
    if (len == chunk) { *out = k; return STELLA_OK; }
    if (len == 0 || k == 0) { *out = 0; return STELLA_OK; }
    int64_t c = (k * len + chunk / 2) / chunk;   /* round(k * len / chunk); no overflow: both <= 2^16 */
    if (c < 1) c = 1;
    *out = c < len ? c : len;
    return STELLA_OK;
}

int stella_chunk_topk_count(int64_t n, int64_t chunk, int64_t k, int64_t *total) {
    if (!total) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || !chunk_ok(chunk) || k < 0 || k > chunk) return STELLA_ERR_ARG;
    int64_t tail = n % chunk, tk = 0;
    int rc = stella_chunk_k(k, chunk, tail, &tk);
    if (rc) return rc;
    *total = (n / chunk) * k + tk;
    return STELLA_OK;
}

/* The m-th largest (1 <= m <= len) of len keys by 8-bit radix digits; *ties gets how many keys
 * equal to it are among the m largest. ``top`` is the histogram of the keys' top byte (the
 * caller builds it in its own pass over them). The keys with the chosen top byte are copied to
 * ``scratch`` (len entries) and the three lower digits are read from that copy alone: on
 * gradients it holds a few percent of the chunk, so the chunk is read twice instead of four
 * times. */
static uint32_t kth_largest(const uint32_t *key, int64_t len, int64_t m, const int64_t top[256],
                            uint32_t *scratch, int64_t *ties) {
    int64_t need = m;
    int d = 255;
    while (top[d] < need) { need -= top[d]; d--; }   /* d >= 0: m keys in all */
    uint32_t prefix = (uint32_t)d << 24, mask = 0xff000000u;
    int64_t count = 0;
    for (int64_t i = 0; i < len; i++)
        if ((key[i] & mask) == prefix) scratch[count++] = key[i];
    for (int shift = 16; shift >= 0; shift -= 8) {
        int64_t hist[256] = {0};
        for (int64_t i = 0; i < count; i++)
            if ((scratch[i] & mask) == prefix) hist[(scratch[i] >> shift) & 255]++;
        d = 255;
        while (hist[d] < need) { need -= hist[d]; d--; }   /* d >= 0: need keys match the prefix */
        prefix |= (uint32_t)d << shift;
        mask |= 0xffu << shift;
    }
    *ties = need;
    return prefix;
}

int stella_chunk_topk_f32(const float *grad, float *residual, int64_t n, int64_t chunk, int64_t k,
                          uint32_t *idx, float *val, int64_t cap, int64_t *out_k) {
    if (!out_k) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || !chunk_ok(chunk) || k < 1 || k > chunk || cap < 0) return STELLA_ERR_ARG;
    int64_t total;
    int rc = stella_chunk_topk_count(n, chunk, k, &total);
    if (rc) return rc;
    if (cap < total) return STELLA_ERR_SIZE;
    if (n > 0 && (!grad || !idx || !val)) return STELLA_ERR_NULL;
    *out_k = 0;
    if (n == 0) return STELLA_OK;
    int64_t width = n < chunk ? n : chunk;
    float *acc = malloc((size_t)width * sizeof(float));
    uint32_t *key = malloc((size_t)width * sizeof(uint32_t));
    uint32_t *scratch = malloc((size_t)width * sizeof(uint32_t));
    if (!acc || !key || !scratch) { free(acc); free(key); free(scratch); return STELLA_ERR_NOMEM; }
    int64_t o = 0;
    for (int64_t s = 0; s < n; s += chunk) {
        int64_t len = n - s < chunk ? n - s : chunk, kc = 0;
        int64_t top[256] = {0};
        stella_chunk_k(k, chunk, len, &kc);
        for (int64_t i = 0; i < len; i++) {
            acc[i] = residual ? grad[s + i] + residual[s + i] : grad[s + i];
            key[i] = stella_mag_key(acc[i]);
            top[key[i] >> 24]++;
        }
        int64_t ties = 0;
        uint32_t t = kc < len ? kth_largest(key, len, kc, top, scratch, &ties) : 0;
        int all = kc == len;
        for (int64_t i = 0; i < len; i++) {
            int take = all || key[i] > t || (key[i] == t && ties > 0 && ties--);
            if (take) { idx[o] = (uint32_t)(s + i); val[o] = acc[i]; o++; }
            if (residual) residual[s + i] = take ? 0.0f : acc[i];
        }
    }
    free(acc);
    free(key);
    free(scratch);
    *out_k = o;
    return STELLA_OK;
}

/* The largest step <= (hi - lo) / (M - 1) whose top level lo + step * (M - 1) is finite. */
static float grid_step(float lo, float hi, int levels) {
    if (levels < 2 || hi <= lo) return 0.0f;
    float step = (hi - lo) / (float)(levels - 1);
    while (step > 0.0f && !isfinite(lo + step * (float)(levels - 1))) step = nextafterf(step, 0.0f);
    return step;
}

static inline int level_of(float mag, float lo, float step, int levels) {
    if (step <= 0.0f) return 0;
    float q = floorf((mag - lo) / step + 0.5f);
    if (!(q > 0.0f)) return 0;
    return q >= (float)(levels - 1) ? levels - 1 : (int)q;
}

static inline float level_value(float lo, float step, int j) { return lo + step * (float)j; }

/* check the common arguments of the quantiser and encoder: idx ascending < n */
static int check_selection(const uint32_t *idx, const float *val, int64_t k, int64_t n, int64_t chunk, int bits,
                           const float *scales, int64_t nscales) {
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n || !chunk_ok(chunk) || !bits_ok(bits)) return STELLA_ERR_ARG;
    if (nscales != 2 * nchunks_of(n, chunk)) return STELLA_ERR_ARG;
    if ((k > 0 && (!idx || !val)) || (nscales > 0 && !scales)) return STELLA_ERR_NULL;
    for (int64_t i = 0; i < k; i++)
        if ((int64_t)idx[i] >= n || (i && idx[i] <= idx[i - 1])) return STELLA_ERR_ARG;
    return STELLA_OK;
}

int stella_chunk_quantize_f32(const uint32_t *idx, float *val, int64_t k, int64_t n, int64_t chunk, int bits,
                              float *scales, int64_t nscales, float *residual) {
    int rc = check_selection(idx, val, k, n, chunk, bits, scales, nscales);
    if (rc) return rc;
    int levels = 1 << (bits - 1);
    for (int64_t c = 0; c < nscales; c++) scales[c] = 0.0f;
    for (int64_t a = 0; a < k;) {
        int64_t c = idx[a] / chunk, b = a;
        int finite = 1;
        float lo = INFINITY, hi = 0.0f;
        for (; b < k && idx[b] / chunk == c; b++) {
            if (!isfinite(val[b])) { finite = 0; continue; }
            float m = stella_absf(val[b]);
            lo = m < lo ? m : lo;
            hi = m > hi ? m : hi;
        }
        if (!finite) {
            scales[2 * c] = NAN;
            for (int64_t i = a; i < b; i++) val[i] = NAN;
        } else {
            float step = grid_step(lo, hi, levels);
            scales[2 * c] = lo;
            scales[2 * c + 1] = step;
            for (int64_t i = a; i < b; i++) {
                float v = val[i], m = level_value(lo, step, level_of(stella_absf(v), lo, step, levels));
                float q = signbit(v) ? -m : m;
                if (residual) residual[idx[i]] += v - q;
                val[i] = q;
            }
        }
        a = b;
    }
    return STELLA_OK;
}

static int index_bound(int64_t n, int64_t k, int64_t *nbytes) {
    return stella_payload_bound(n, k, STELLA_VAL_NONE, nbytes);
}

int stella_qpayload_bound(int64_t n, int64_t chunk, int64_t k, int bits, int64_t *nbytes) {
    if (!nbytes) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n || !chunk_ok(chunk) || !bits_ok(bits)) return STELLA_ERR_ARG;
    int64_t ib;
    int rc = index_bound(n, k, &ib);
    if (rc) return rc;
    *nbytes = STELLA_QPAYLOAD_HEADER + ib + 8 * nchunks_of(n, chunk) + code_bytes(k, bits);
    return STELLA_OK;
}

int stella_qpayload_encode(const uint32_t *idx, const float *val, int64_t k, int64_t n, int64_t chunk, int bits,
                           const float *scales, int64_t nscales, uint8_t *out, int64_t cap, int64_t *written) {
    if (!written) return STELLA_ERR_NULL;
    int rc = check_selection(idx, val, k, n, chunk, bits, scales, nscales);
    if (rc) return rc;
    if (!out) return STELLA_ERR_NULL;
    if (cap < STELLA_QPAYLOAD_HEADER) return STELLA_ERR_SIZE;
    int levels = 1 << (bits - 1);
    /* every value on its chunk's grid, every chunk's scales as the quantiser leaves them */
    for (int64_t a = 0, c = 0; c < nscales / 2; c++) {
        float lo = scales[2 * c], step = scales[2 * c + 1];
        int64_t b = a;
        while (b < k && idx[b] / chunk == c) b++;
        if (b == a) {
            if (stella_f2u(lo) != 0 || stella_f2u(step) != 0) return STELLA_ERR_ARG;
        } else if (isnan(lo)) {
            if (step != 0.0f) return STELLA_ERR_ARG;
        } else {
            if (!isfinite(lo) || lo < 0.0f || !isfinite(step) || step < 0.0f ||
                !isfinite(level_value(lo, step, levels - 1))) return STELLA_ERR_ARG;
            for (int64_t i = a; i < b; i++) {
                float m = stella_absf(val[i]);
                if (!(level_value(lo, step, level_of(m, lo, step, levels)) == m)) return STELLA_ERR_ARG;
            }
        }
        a = b;
    }
    int64_t ilen;
    rc = stella_sparse_encode(idx, val, k, n, STELLA_IDX_AUTO, STELLA_VAL_NONE, out + STELLA_QPAYLOAD_HEADER,
                              cap - STELLA_QPAYLOAD_HEADER, &ilen);
    if (rc) return rc;
    int64_t cb = code_bytes(k, bits), size = STELLA_QPAYLOAD_HEADER + ilen + 4 * nscales + cb;
    if (cap < size) return STELLA_ERR_SIZE;
    memcpy(out, QMAGIC, 4);
    out[4] = QVERSION;
    out[5] = (uint8_t)bits;
    out[6] = out[7] = 0;
    wr64(out + 8, (uint64_t)n);
    wr32(out + 16, (uint32_t)chunk);
    wr32(out + 20, 0);
    wr64(out + 24, (uint64_t)ilen);
    uint8_t *p = out + STELLA_QPAYLOAD_HEADER + ilen;
    if (nscales) memcpy(p, scales, (size_t)nscales * 4);
    p += 4 * nscales;
    memset(p, 0, (size_t)cb);
    for (int64_t i = 0; i < k; i++) {
        int64_t c = idx[i] / chunk;
        float lo = scales[2 * c], step = scales[2 * c + 1];
        uint32_t code = 0;
        if (!isnan(lo))
            code = (uint32_t)level_of(stella_absf(val[i]), lo, step, levels) | (signbit(val[i]) ? (uint32_t)levels : 0u);
        int64_t bit = i * bits;
        p[bit >> 3] |= (uint8_t)(code << (bit & 7));   /* bits divides 8: a code never straddles bytes */
    }
    *written = size;
    return STELLA_OK;
}

/* The header and lengths: *ilen the index section's length, *k its entries. */
static int read_qheader(const uint8_t *buf, int64_t len, int64_t n, int64_t chunk, int bits, int64_t *ilen,
                        int64_t *k) {
    if (len < STELLA_QPAYLOAD_HEADER) return STELLA_ERR_MALFORMED;
    if (memcmp(buf, QMAGIC, 4) != 0 || buf[4] != QVERSION || buf[5] != (uint8_t)bits || buf[6] || buf[7] ||
        rd64(buf + 8) != (uint64_t)n || rd32(buf + 16) != (uint32_t)chunk || rd32(buf + 20) != 0)
        return STELLA_ERR_MALFORMED;
    uint64_t il = rd64(buf + 24);
    if (il > (uint64_t)(len - STELLA_QPAYLOAD_HEADER)) return STELLA_ERR_MALFORMED;
    stella_payload_info info;
    if (stella_sparse_decode_info(buf + STELLA_QPAYLOAD_HEADER, (int64_t)il, n, &info) != STELLA_OK ||
        info.value_dtype != STELLA_VAL_NONE || info.scheme == STELLA_IDX_IMPLICIT)
        return STELLA_ERR_MALFORMED;
    int64_t size = STELLA_QPAYLOAD_HEADER + (int64_t)il + 8 * nchunks_of(n, chunk) + code_bytes(info.entries, bits);
    if (size != len) return STELLA_ERR_MALFORMED;
    *ilen = (int64_t)il;
    *k = info.entries;
    return STELLA_OK;
}

int stella_qpayload_decode_info(const uint8_t *buf, int64_t len, int64_t n, int64_t chunk, int bits,
                                int64_t *entries) {
    if (!entries) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || len < 0 || !chunk_ok(chunk) || !bits_ok(bits)) return STELLA_ERR_ARG;
    if (len > 0 && !buf) return STELLA_ERR_NULL;
    int64_t ilen;
    return read_qheader(buf, len, n, chunk, bits, &ilen, entries);
}

int stella_qpayload_decode(const uint8_t *buf, int64_t len, int64_t n, int64_t chunk, int bits,
                           uint32_t *idx, float *val, int64_t cap, float *scales, int64_t nscales, int64_t *out_k) {
    if (!out_k) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || len < 0 || !chunk_ok(chunk) || !bits_ok(bits)) return STELLA_ERR_ARG;
    if (len > 0 && !buf) return STELLA_ERR_NULL;
    if (nscales != 2 * nchunks_of(n, chunk)) return STELLA_ERR_ARG;
    if (nscales > 0 && !scales) return STELLA_ERR_NULL;
    int64_t ilen, k;
    int rc = read_qheader(buf, len, n, chunk, bits, &ilen, &k);
    if (rc) return rc;
    if (cap < k) return STELLA_ERR_SIZE;
    if (k > 0 && (!idx || !val)) return STELLA_ERR_NULL;
    *out_k = 0;
    int64_t got;
    rc = stella_sparse_decode(buf + STELLA_QPAYLOAD_HEADER, ilen, n, 0, idx, val, cap, &got);
    if (rc) return rc == STELLA_ERR_MALFORMED ? rc : STELLA_ERR_MALFORMED;
    const uint8_t *sp = buf + STELLA_QPAYLOAD_HEADER + ilen, *cp = sp + 4 * nscales;
    if (nscales) memcpy(scales, sp, (size_t)nscales * 4);
    int levels = 1 << (bits - 1);
    uint32_t cmask = (1u << bits) - 1;
    for (int64_t a = 0, c = 0; c < nscales / 2; c++) {
        float lo = scales[2 * c], step = scales[2 * c + 1];
        int64_t b = a;
        while (b < k && idx[b] / chunk == c) b++;
        int marker = isnan(lo) && step == 0.0f;
        if (b == a) {
            if (stella_f2u(lo) != 0 || stella_f2u(step) != 0) return STELLA_ERR_MALFORMED;
        } else if (!marker && (!isfinite(lo) || lo < 0.0f || !isfinite(step) || step < 0.0f ||
                               !isfinite(level_value(lo, step, levels - 1)))) {
            return STELLA_ERR_MALFORMED;
        }
        for (int64_t i = a; i < b; i++) {
            int64_t bit = i * bits;
            uint32_t code = (cp[bit >> 3] >> (bit & 7)) & cmask;
            uint32_t j = code & (uint32_t)(levels - 1);
            if (marker) {
                if (code) return STELLA_ERR_MALFORMED;
                val[i] = NAN;
                continue;
            }
            if (step == 0.0f && j) return STELLA_ERR_MALFORMED;
            float m = level_value(lo, step, (int)j);
            val[i] = code & (uint32_t)levels ? -m : m;
        }
        a = b;
    }
    int64_t used = k * bits;
    if (used & 7) {
        uint8_t last = cp[used >> 3];
        if (last >> (used & 7)) return STELLA_ERR_MALFORMED;   /* the padding bits must be 0 */
    }
    *out_k = k;
    return STELLA_OK;
}
