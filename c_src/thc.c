/* thc.c - homomorphic quantization of the cross-cluster sum (see stella_thc.h). */
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

/* x holds the entries start .. start + len - 1 of the vector: negate those whose sign bit is
 * set (bit (i % 64) of mix64(key ^ (i / 64)) for entry i). */
static void apply_signs(float *x, int64_t start, int64_t len, uint64_t key) {
    int64_t g = start;
    const int64_t end = start + len;
    while (g < end) {
        uint64_t bits = stella_mix64(key ^ (uint64_t)(g >> 6));
        int64_t stop = (g | 63) + 1 < end ? (g | 63) + 1 : end;
        for (; g < stop; g++) /* branch-free: the draw's bit flips the sign bit */
            x[g - start] = stella_u2f(stella_f2u(x[g - start]) ^ ((uint32_t)((bits >> (g & 63)) & 1u) << 31));
    }
}

/* The first three levels of the transform on 8 consecutive entries, in registers. */
static inline void fwht8(float *x) {
    float a0 = x[0] + x[1], a1 = x[0] - x[1], a2 = x[2] + x[3], a3 = x[2] - x[3];
    float a4 = x[4] + x[5], a5 = x[4] - x[5], a6 = x[6] + x[7], a7 = x[6] - x[7];
    float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
    float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
    x[0] = b0 + b4; x[4] = b0 - b4; x[1] = b1 + b5; x[5] = b1 - b5;
    x[2] = b2 + b6; x[6] = b2 - b6; x[3] = b3 + b7; x[7] = b3 - b7;
}

/* Walsh-Hadamard transform of len = 2^k entries (natural order), times norm. The butterflies
 * of each level are the textbook ones (a + b, a - b); the first three levels run on 8 entries
 * at a time, the later ones on contiguous runs the compiler vectorizes. */
static void fwht(float *restrict x, int64_t len, float norm) {
    /* normalized first: a sum of 2^k entries then stays within sqrt(len) times the largest
     * input, so a result that fits in float32 is not lost to an overflow on the way (with len a
     * power of four the norm is a power of two and the bits are those of normalizing last) */
    for (int64_t j = 0; j < len; j++) x[j] *= norm;
    int64_t h = 1;
    if (len >= 8) {
        for (int64_t i = 0; i < len; i += 8) fwht8(x + i);
        h = 8;
    }
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
    int64_t block = -1;
    float inv = 0.0f, step = 0.0f;
    for (int64_t w = 0; w < need; w++) {
        uint64_t word = 0;
        int64_t first = w * lanes;
        int64_t m = n - first < lanes ? n - first : lanes;
        for (int64_t j = 0; j < m; j++) {
            int64_t i = first + j;
            if ((i >> scale_log2) != block) {
                block = i >> scale_log2;
                block_factors(scales[block], L, &inv, &step);
            }
            float t = x[i] * inv;
            t = t + (stochastic ? draw(key, i) : 0.5f);
            /* |x| beyond the scale: clamp first, so the cast below is defined */
            t = t > (float)(L + 1) ? (float)(L + 1) : (t < (float)(-L - 1) ? (float)(-L - 1) : t);
            /* floor(t) by truncation and a correction (no libm call) */
            int q = (int)t;
            q -= (float)q > t;
            q = q > L ? L : (q < -L ? -L : q);
            x[i] = (float)q * step;
            word |= (uint64_t)(q + L) << (j * lane_bits);
        }
        words[w] = word;
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
    const int64_t zero = L * (int64_t)nclusters;
    const int64_t lanes = 64 / lane_bits;
    const uint64_t mask = lane_bits == 64 ? ~0ull : ((1ull << lane_bits) - 1);
    int64_t block = -1;
    float step = 0.0f;
    for (int64_t w = 0; w < need; w++) {
        uint64_t word = words[w];
        int64_t first = w * lanes;
        int64_t m = n - first < lanes ? n - first : lanes;
        /* lanes past n, and bits past the last whole lane, must be zero */
        int used = (int)(m * lane_bits);
        if (used < 64 && (word >> used) != 0) return STELLA_ERR_MALFORMED;
        for (int64_t j = 0; j < m; j++) {
            int64_t i = first + j;
            if ((i >> scale_log2) != block) {
                block = i >> scale_log2;
                step = scales[block] / (float)L;
            }
            uint64_t lane = (word >> (j * lane_bits)) & mask;
            if (lane > top) return STELLA_ERR_MALFORMED;
            out[i] = (float)((int64_t)lane - zero) * step;
        }
    }
    return STELLA_OK;
}
