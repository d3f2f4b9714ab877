/* thc.c - homomorphic quantization of the cross-cluster sum (see stella_thc.h). */
#if defined(__GNUC__) && !defined(__clang__)
/* Without it GCC keeps the float comparisons of the quantizer's clamp as branches (a comparison
 * may raise an FP exception flag) and the loop stays scalar; nothing here reads those flags,
 * and the results are the same bits (IEEE operations are rounded alike either way). */
#pragma GCC optimize("no-trapping-math")
#endif
#include "stella_thc.h"
#include "compress_internal.h"
#include <math.h>

#define THC_DRAW_MUL 0xd1342543de82ef95ull

static int levels_of(int bits) { return (1 << (bits - 1)) - 1; }

static int bits_ok(int bits) { return bits >= STELLA_THC_MIN_BITS && bits <= STELLA_THC_MAX_BITS; }

int stella_thc_lane_bits(int bits, int nclusters, int *lane_bits) {
    if (!lane_bits) return STELLA_ERR_NULL;
    if (!bits_ok(bits) || nclusters < 1 || nclusters > STELLA_THC_MAX_CLUSTERS) return STELLA_ERR_ARG;
    uint64_t top = 2ull * (uint64_t)levels_of(bits) * (uint64_t)nclusters;
    int w = 0;
    while (top >> w) w++;
    *lane_bits = w;
    return STELLA_OK;
}

int stella_thc_words(int64_t n, int lane_bits, int64_t *words) {
    if (!words) return STELLA_ERR_NULL;
    if (n < 0 || lane_bits < 1 || lane_bits > 32) return STELLA_ERR_ARG;
    int64_t lanes = 64 / lane_bits;
    *words = n / lanes + (n % lanes != 0);
    return STELLA_OK;
}

/* SIGN_MASKS[b][k]: bit 31 set where bit k of byte b is: the sign masks of 8 entries. */
#define SM(n, k) ((((uint32_t)(n) >> (k)) & 1u) << 31)
#define SB(n) {SM(n, 0), SM(n, 1), SM(n, 2), SM(n, 3), SM(n, 4), SM(n, 5), SM(n, 6), SM(n, 7)}
#define SB4(n) SB(n), SB((n) + 1), SB((n) + 2), SB((n) + 3)
#define SB16(n) SB4(n), SB4((n) + 4), SB4((n) + 8), SB4((n) + 12)
#define SB64(n) SB16(n), SB16((n) + 16), SB16((n) + 32), SB16((n) + 48)
static const uint32_t SIGN_MASKS[256][8] = {SB64(0), SB64(64), SB64(128), SB64(192)};

/* x holds the entries start .. start + len - 1 of the vector: negate those whose sign bit is
 * set (bit (i % 64) of mix64(key ^ (i / 64)) for entry i): an XOR of the sign bit, 8 entries at
 * a time from the table above for a whole group of 64, one at a time at the edges. */
static void apply_signs(float *x, int64_t start, int64_t len, uint64_t key) {
    int64_t g = start;
    const int64_t end = start + len;
    while (g < end) {
        uint64_t bits = stella_mix64(key ^ (uint64_t)(g >> 6));
        int64_t stop = (g | 63) + 1 < end ? (g | 63) + 1 : end;
        uint32_t *u = (uint32_t *)(void *)(x + (g - start));
        if ((g & 63) == 0 && stop - g == 64) {
            for (int b = 0; b < 8; b++) {
                const uint32_t *m = SIGN_MASKS[(bits >> (8 * b)) & 0xffu];
                for (int k = 0; k < 8; k++) u[8 * b + k] ^= m[k];
            }
        } else {
            for (int64_t j = 0; j < stop - g; j++) u[j] ^= (uint32_t)((bits >> ((g + j) & 63)) & 1u) << 31;
        }
        g = stop;
    }
}

/* The first three levels of the transform on 8 consecutive entries, in registers, each input
 * times norm as it is read (the products the separate normalizing pass would store). */
static inline void fwht8(float *x, float norm) {
    float x0 = x[0] * norm, x1 = x[1] * norm, x2 = x[2] * norm, x3 = x[3] * norm;
    float x4 = x[4] * norm, x5 = x[5] * norm, x6 = x[6] * norm, x7 = x[7] * norm;
    float a0 = x0 + x1, a1 = x0 - x1, a2 = x2 + x3, a3 = x2 - x3;
    float a4 = x4 + x5, a5 = x4 - x5, a6 = x6 + x7, a7 = x6 - x7;
    float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
    float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
    x[0] = b0 + b4; x[4] = b0 - b4; x[1] = b1 + b5; x[5] = b1 - b5;
    x[2] = b2 + b6; x[6] = b2 - b6; x[3] = b3 + b7; x[7] = b3 - b7;
}

/* Two levels (h and 2h) in one pass over the block: the same butterflies, in the same order
 * for every entry, with half the loads and stores. */
static void radix4(float *restrict x, int64_t len, int64_t h) {
    for (int64_t i = 0; i < len; i += 4 * h) {
        float *restrict p0 = x + i, *restrict p1 = x + i + h, *restrict p2 = x + i + 2 * h, *restrict p3 = x + i + 3 * h;
        for (int64_t j = 0; j < h; j++) {
            float a = p0[j], b = p1[j], c = p2[j], d = p3[j];
            float s0 = a + b, d0 = a - b, s1 = c + d, d1 = c - d;
            p0[j] = s0 + s1;
            p2[j] = s0 - s1;
            p1[j] = d0 + d1;
            p3[j] = d0 - d1;
        }
    }
}

/* Walsh-Hadamard transform of len = 2^k entries (natural order), times norm. The butterflies
 * of each level are the textbook ones (a + b, a - b); the first three levels run on 8 entries
 * at a time, the later ones two levels per pass on contiguous runs the compiler vectorizes. */
static void fwht(float *restrict x, int64_t len, float norm) {
    /* normalized first: a sum of 2^k entries then stays within sqrt(len) times the largest
     * input, so a result that fits in float32 is not lost to an overflow on the way (with len a
     * power of four the norm is a power of two and the bits are those of normalizing last) */
    int64_t h = 1;
    if (len >= 8) {
        for (int64_t i = 0; i < len; i += 8) fwht8(x + i, norm);
        h = 8;
    } else {
        for (int64_t j = 0; j < len; j++) x[j] *= norm;
    }
    for (; 4 * h <= len; h <<= 2) radix4(x, len, h);
    for (; h < len; h <<= 1)
        for (int64_t i = 0; i < len; i += 2 * h) {
            float *restrict lo = x + i, *restrict hi = x + i + h;
            for (int64_t j = 0; j < h; j++) {
                float a = lo[j], b = hi[j];
                lo[j] = a + b;
                hi[j] = a - b;
            }
        }
}

int stella_thc_rotate(float *x, int64_t n, int block_log2, uint64_t key, int inverse) {
    if (n < 0 || block_log2 < 1 || block_log2 > STELLA_THC_MAX_BLOCK_LOG2) return STELLA_ERR_ARG;
    if (n > 0 && !x) return STELLA_ERR_NULL;
    const int64_t len = (int64_t)1 << block_log2;
    const float norm = 1.0f / sqrtf((float)len);
    for (int64_t start = 0; start + len <= n; start += len) {
        if (!inverse) {
            apply_signs(x + start, start, len, key);
            fwht(x + start, len, norm);
        } else {
            fwht(x + start, len, norm);
            apply_signs(x + start, start, len, key);
        }
    }
    return STELLA_OK;
}

int stella_thc_scale_count(int64_t n, int scale_log2, int64_t *count) {
    if (!count) return STELLA_ERR_NULL;
    if (n < 0 || scale_log2 < 0 || scale_log2 > STELLA_THC_ONE_SCALE) return STELLA_ERR_ARG;
    *count = n == 0 ? 0 : ((n - 1) >> scale_log2) + 1;
    return STELLA_OK;
}

/* The scales (count of them for n entries in blocks of 2^scale_log2) are well formed: the
 * count matches and each is >= 0 and finite. */
static int scales_ok(const float *scales, int64_t count, int64_t n, int scale_log2) {
    int64_t need;
    int rc = stella_thc_scale_count(n, scale_log2, &need);
    if (rc != STELLA_OK) return rc;
    if (count != need) return STELLA_ERR_SIZE;
    if (count > 0 && !scales) return STELLA_ERR_NULL;
    for (int64_t b = 0; b < count; b++)
        if (!(scales[b] >= 0.0f) || isinf(scales[b])) return STELLA_ERR_ARG;
    return STELLA_OK;
}

int stella_thc_absmax(const float *x, int64_t n, int scale_log2, float *absmax, int64_t count,
                      int64_t *nonfinite) {
    if (!nonfinite) return STELLA_ERR_NULL;
    int64_t need;
    int rc = stella_thc_scale_count(n, scale_log2, &need);
    if (rc != STELLA_OK) return rc;
    if (count != need) return STELLA_ERR_SIZE;
    if (n > 0 && (!x || !absmax)) return STELLA_ERR_NULL;
    int64_t bad = 0;
    const int64_t len = (int64_t)1 << scale_log2;
    for (int64_t b = 0; b < count; b++) {
        uint32_t best = 0;
        const int64_t start = b * len, end = n - start < len ? n : start + len;
        for (int64_t i = start; i < end; i++) {
            uint32_t u = stella_f2u(x[i]) & 0x7fffffffu;
            if (u >= 0x7f800000u) bad++;
            else if (u > best) best = u;
        }
        absmax[b] = stella_u2f(best);
    }
    *nonfinite = bad;
    return STELLA_OK;
}

static inline float draw(uint64_t key, int64_t i) {
    uint64_t h = stella_mix64(key + (uint64_t)(i >> 1) * THC_DRAW_MUL);
    uint32_t r = (i & 1) ? (uint32_t)((h >> 16) & 0xffffffu) : (uint32_t)(h >> 40);
    return (float)r * 0x1p-24f;
}

/* L / s and s / L of one scale block; a scale so small that L / s overflows gives 0 (every
 * level of the block zero: all stays in the residual). */
static inline void block_factors(float scale, int L, float *inv, float *step) {
    float i = scale > 0.0f ? (float)L / scale : 0.0f;
    *inv = isinf(i) ? 0.0f : i;
    *step = scale / (float)L;
}

#define THC_CHUNK 4096

/* End of the scale block holding entry i, capped at end. */
static inline int64_t block_end(int64_t i, int scale_log2, int64_t end) {
    if (scale_log2 >= 62) return end;
    int64_t b = ((i >> scale_log2) + 1) << scale_log2;
    return b < end ? b : end;
}

/* Entries first .. last - 1 of x: quantized to their levels, x written as level * step, and
 * level + L stored in lv[i - first]. */
static void quantize_run(float *x, int64_t first, int64_t last, const float *scales, int scale_log2, int L,
                         int stochastic, uint64_t key, uint8_t *lv) {
    const float hi = (float)(L + 1), lo = (float)(-L - 1);
    for (int64_t i = first; i < last;) {
        int64_t stop = block_end(i, scale_log2, last);
        float inv, step;
        block_factors(scales[i >> scale_log2], L, &inv, &step);
        for (; i < stop; i++) {   /* (GCC unswitches the loop on stochastic: nearest vectorizes) */
            float t = x[i] * inv;
            t = t + (stochastic ? draw(key, i) : 0.5f);
            t = t > hi ? hi : (t < lo ? lo : t);   /* clamp first, so the cast below is defined */
            int q = (int)t;                          /* floor(t): truncation and a correction */
            q -= (float)q > t;
            q = q > L ? L : (q < -L ? -L : q);
            x[i] = (float)q * step;
            lv[i - first] = (uint8_t)(q + L);
        }
    }
}

int stella_thc_quantize(float *x, int64_t n, int bits, const float *scales, int64_t count, int scale_log2,
                        int stochastic, uint64_t key, int lane_bits, uint64_t *words, int64_t cap) {
    if (n < 0 || !bits_ok(bits) || lane_bits < 1 || lane_bits > 32) return STELLA_ERR_ARG;
    int rc = scales_ok(scales, count, n, scale_log2);
    if (rc != STELLA_OK) return rc;
    int own;
    stella_thc_lane_bits(bits, 1, &own);
    if (lane_bits < own) return STELLA_ERR_ARG;
    int64_t need;
    stella_thc_words(n, lane_bits, &need);
    if (need > 0 && !words) return STELLA_ERR_NULL;
    if (n > 0 && !x) return STELLA_ERR_NULL;
    if (cap < need) return STELLA_ERR_SIZE;
    for (int64_t i = 0; i < n; i++)
        if ((stella_f2u(x[i]) & 0x7fffffffu) >= 0x7f800000u) return STELLA_ERR_ARG;
    const int L = levels_of(bits);
    const int64_t lanes = 64 / lane_bits;
    /* chunks of whole words: the levels of a chunk first (a loop per scale block that the
     * compiler vectorizes), then the words packed from them */
    const int64_t chunk_words = THC_CHUNK / lanes;
    uint8_t lv[THC_CHUNK];
    for (int64_t w0 = 0; w0 < need; w0 += chunk_words) {
        int64_t w1 = w0 + chunk_words < need ? w0 + chunk_words : need;
        int64_t first = w0 * lanes, last = w1 * lanes < n ? w1 * lanes : n;
        quantize_run(x, first, last, scales, scale_log2, L, stochastic, key, lv);
        for (int64_t w = w0; w < w1; w++) {
            int64_t a = w * lanes, m = n - a < lanes ? n - a : lanes;
            const uint8_t *v = lv + (a - first);
            uint64_t word = 0;
            for (int64_t j = m - 1; j >= 0; j--) word = (word << lane_bits) | v[j];
            words[w] = word;
        }
    }
    return STELLA_OK;
}

int stella_thc_unpack_sum(const uint64_t *words, int64_t nwords, int64_t n, int bits, int nclusters,
                          int lane_bits, const float *scales, int64_t count, int scale_log2, float *out) {
    if (n < 0 || !bits_ok(bits) || nclusters < 1 || nclusters > STELLA_THC_MAX_CLUSTERS) return STELLA_ERR_ARG;
    if (lane_bits < 1 || lane_bits > 32) return STELLA_ERR_ARG;
    int rc = scales_ok(scales, count, n, scale_log2);
    if (rc != STELLA_OK) return rc;
    int need_bits;
    stella_thc_lane_bits(bits, nclusters, &need_bits);
    if (lane_bits < need_bits) return STELLA_ERR_ARG;
    int64_t need;
    stella_thc_words(n, lane_bits, &need);
    if (nwords != need) return STELLA_ERR_SIZE;
    if (need > 0 && !words) return STELLA_ERR_NULL;
    if (n > 0 && !out) return STELLA_ERR_NULL;
    const int64_t L = levels_of(bits);
    const uint64_t top = 2ull * (uint64_t)L * (uint64_t)nclusters;
    const int32_t zero = (int32_t)(L * (int64_t)nclusters);
    const int64_t lanes = 64 / lane_bits;
    const uint64_t mask = lane_bits == 64 ? ~0ull : ((1ull << lane_bits) - 1);
    const int64_t chunk_words = THC_CHUNK / lanes;
    int32_t lv[THC_CHUNK];
    for (int64_t w0 = 0; w0 < need; w0 += chunk_words) {
        int64_t w1 = w0 + chunk_words < need ? w0 + chunk_words : need;
        int64_t first = w0 * lanes, last = w1 * lanes < n ? w1 * lanes : n;
        uint64_t over = 0;
        for (int64_t w = w0; w < w1; w++) {
            uint64_t word = words[w];
            int64_t a = w * lanes, m = n - a < lanes ? n - a : lanes;
            /* lanes past n, and bits past the last whole lane, must be zero */
            int used = (int)(m * lane_bits);
            if (used < 64 && (word >> used) != 0) return STELLA_ERR_MALFORMED;
            int32_t *v = lv + (a - first);
            for (int64_t j = 0; j < m; j++) {
                uint64_t lane = (word >> (j * lane_bits)) & mask;
                over |= (uint64_t)(lane > top);
                v[j] = (int32_t)lane;
            }
        }
        if (over) return STELLA_ERR_MALFORMED;
        for (int64_t i = first; i < last;) {
            int64_t stop = block_end(i, scale_log2, last);
            const float step = scales[i >> scale_log2] / (float)L;
            for (; i < stop; i++) out[i] = (float)(lv[i - first] - zero) * step;
        }
    }
    return STELLA_OK;
}
