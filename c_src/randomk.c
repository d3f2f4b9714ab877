/* randomk.c - random-k with a seed shared by all ranks.
 *
 * The indices are the first k values of a keyed pseudo-random permutation of
 * [0, n), sorted ascending: a bijection of [0, 2^b) (b = bits of n, at least
 * 2) made of xor-with-round-function and rotate steps, restricted to [0, n)
 * by cycle walking. Integer arithmetic only, so every rank, machine and SIMD
 * level computes the same indices from (key, n, k); the key mixes the seed,
 * the tensor's name and the step.
 */
#include "compress_internal.h"
#include <stdlib.h>

#define ROUNDS 6

#define mix64 stella_mix64

int stella_randomk_key(uint64_t seed, const char *name, int64_t name_len, int64_t step, uint64_t *key) {
    if (!key) return STELLA_ERR_NULL;
    if (name_len < 0) return STELLA_ERR_ARG;
    if (name_len > 0 && !name) return STELLA_ERR_NULL;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a of the name bytes */
    for (int64_t i = 0; i < name_len; i++) {
        h ^= (unsigned char)name[i];
        h *= 0x100000001b3ull;
    }
    uint64_t z = mix64(seed ^ 0x5354454c4c41524bull);
    z = mix64(z ^ h);
    z = mix64(z ^ (uint64_t)name_len);
    z = mix64(z ^ (uint64_t)step);
    *key = z;
    return STELLA_OK;
}

typedef struct {
    int b, lo_bits;
    uint64_t mask, lo_mask;
    uint64_t rk[ROUNDS];
} perm_t;

static void perm_init(perm_t *p, uint64_t key, int64_t n, int64_t k) {
    int b = 2;
    while (b < 40 && ((int64_t)1 << b) < n) b++;
    p->b = b;
    p->lo_bits = b / 2;
    p->mask = ((uint64_t)1 << b) - 1;
    p->lo_mask = ((uint64_t)1 << p->lo_bits) - 1;
    uint64_t z = mix64(key ^ mix64((uint64_t)n) ^ mix64((uint64_t)k * 0xd6e8feb86659fd93ull));
    for (int r = 0; r < ROUNDS; r++) {
        z = mix64(z + (uint64_t)r);
        p->rk[r] = z;
    }
}

/* One bijection of [0, 2^b). */
static inline uint64_t perm_once(const perm_t *p, uint64_t x) {
    const int b = p->b, lb = p->lo_bits;
    for (int r = 0; r < ROUNDS; r++) {
        uint64_t lo = x & p->lo_mask, hi = x >> lb;
        uint64_t f = mix64(lo ^ p->rk[r]);
        hi = (hi ^ f) & (p->mask >> lb);
        x = (hi << lb) | lo;
        x = ((x >> lb) | (x << (b - lb))) & p->mask; /* rotate right by lb */
    }
    return x;
}

static inline uint32_t perm_at(const perm_t *p, uint64_t i, int64_t n) {
    uint64_t x = i;
    do { x = perm_once(p, x); } while (x >= (uint64_t)n);
    return (uint32_t)x;
}

void stella_sort_u32(uint32_t *a, uint32_t *tmp, int64_t n) {
    /* LSD radix, three 11-bit digits */
    uint32_t *src = a, *dst = tmp;
    for (int shift = 0; shift < 33; shift += 11) {
        int64_t cnt[2048 + 1];
        memset(cnt, 0, sizeof cnt);
        for (int64_t i = 0; i < n; i++) cnt[((src[i] >> shift) & 2047u) + 1]++;
        for (int d = 0; d < 2048; d++) cnt[d + 1] += cnt[d];
        for (int64_t i = 0; i < n; i++) dst[cnt[(src[i] >> shift) & 2047u]++] = src[i];
        uint32_t *t = src; src = dst; dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(uint32_t)); /* three passes: result in tmp */
}

int stella_randomk_indices(uint64_t key, int64_t n, int64_t k, uint32_t *idx, int64_t cap) {
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n) return STELLA_ERR_ARG;
    if (cap < k) return STELLA_ERR_SIZE;
    if (k > 0 && !idx) return STELLA_ERR_NULL;
    if (k == 0) return STELLA_OK;
    if (k == n) {
        for (int64_t i = 0; i < n; i++) idx[i] = (uint32_t)i;
        return STELLA_OK;
    }
    perm_t p;
    perm_init(&p, key, n, k);
    if (k * 32 >= n) {
        /* dense enough: a bitmap of n bits gives the sorted order directly */
        int64_t words = (n + 63) / 64;
        uint64_t *bits = (uint64_t *)calloc((size_t)words, sizeof(uint64_t));
        if (!bits) return STELLA_ERR_NOMEM;
        for (int64_t i = 0; i < k; i++) {
            uint32_t v = perm_at(&p, (uint64_t)i, n);
            bits[v >> 6] |= (uint64_t)1 << (v & 63);
        }
        int64_t j = 0;
        for (int64_t w = 0; w < words; w++) {
            uint64_t m = bits[w];
            while (m) {
                idx[j++] = (uint32_t)(w * 64 + __builtin_ctzll(m));
                m &= m - 1;
            }
        }
        free(bits);
    } else {
        uint32_t *tmp = (uint32_t *)malloc((size_t)k * sizeof(uint32_t));
        if (!tmp) return STELLA_ERR_NOMEM;
        for (int64_t i = 0; i < k; i++) idx[i] = perm_at(&p, (uint64_t)i, n);
        stella_sort_u32(idx, tmp, k);
        free(tmp);
    }
    return STELLA_OK;
}

int stella_randomk_select_f32(const float *grad, float *residual, int64_t n, int64_t k, uint64_t key,
                              uint32_t *idx, float *val, int64_t cap, int64_t *out_k) {
    if (!out_k) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n) return STELLA_ERR_ARG;
    if (n > 0 && !grad) return STELLA_ERR_NULL;
    if (cap < k) return STELLA_ERR_SIZE;
    if (k > 0 && (!idx || !val)) return STELLA_ERR_NULL;
    int rc = stella_randomk_indices(key, n, k, idx, cap);
    if (rc) return rc; /* nothing written to the residual yet */
    if (residual) {
        /* one pass: residual = acc, then the k chosen entries move to val */
        for (int64_t i = 0; i < n; i++) residual[i] = grad[i] + residual[i];
        for (int64_t j = 0; j < k; j++) {
            val[j] = residual[idx[j]];
            residual[idx[j]] = 0.0f;
        }
    } else {
        for (int64_t j = 0; j < k; j++) val[j] = grad[idx[j]];
    }
    *out_k = k;
    return STELLA_OK;
}
