/* dense.c - dense-path kernels: fused scale-and-cast, fixed-order accumulate,
 * checksum. Each kernel has a scalar path and, on x86-64, AVX2 and AVX-512
 * paths picked at run time; all paths give bit-identical results because they
 * do the same IEEE operations element by element (no FMA contraction, the
 * scalar conversions reproduce F16C's rounding and NaN quieting). */
#include "stella_dense.h"
#include "simd_internal.h"
#include <string.h>
#if STELLA_X86
#include <immintrin.h>
#endif

/* ---------- scalar element conversions (the reference every path matches) ---------- */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_f16_one(float f) {
    uint32_t u = f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x47800000u) {                 /* >= 2^16: Inf or NaN, or overflow */
        if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
        return (uint16_t)(sign | 0x7c00u);
    }
    if (a < 0x38800000u) {                  /* below 2^-14: subnormal half or zero */
        /* adding 0.5 aligns the mantissa so the FPU's round-to-nearest-even does the work */
        float x = u2f(a) + 0.5f;
        return (uint16_t)(sign | (f2u(x) - 0x3f000000u));
    }
    uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd;                 /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (a >> 13));
}

static inline float f16_to_f32_one(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        if (m == 0) return u2f(sign);
        /* subnormal: value = m * 2^-24, exact in float */
        float v = (float)m * 5.9604644775390625e-08f;
        return u2f(sign | f2u(v));
    }
    if (e == 31) return u2f(sign | 0x7f800000u | (m ? (0x400000u | (m << 13)) : 0u));
    return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t f32_to_bf16_one(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32_one(uint16_t h) { return u2f((uint32_t)h << 16); }

static inline float op_one(float a, float b, int op) {
    float r;
    switch (op) {
    case STELLA_OP_SUM: return a + b;
    case STELLA_OP_PROD: return a * b;
    case STELLA_OP_MIN: r = (a < b) ? a : b; return (a != a) ? a : r;
    default:            r = (a > b) ? a : b; return (a != a) ? a : r;
    }
}

/* ---------- scalar loops ---------- */

static void f32_to_f16_scalar(const float *s, uint16_t *d, int64_t i, int64_t n, float k) {
    for (; i < n; i++) d[i] = f32_to_f16_one(s[i] * k);
}
static void f16_to_f32_scalar(const uint16_t *s, float *d, int64_t i, int64_t n, float k) {
    for (; i < n; i++) d[i] = f16_to_f32_one(s[i]) * k;
}
static void f32_to_bf16_scalar(const float *s, uint16_t *d, int64_t i, int64_t n, float k) {
    for (; i < n; i++) d[i] = f32_to_bf16_one(s[i] * k);
}
static void bf16_to_f32_scalar(const uint16_t *s, float *d, int64_t i, int64_t n, float k) {
    for (; i < n; i++) d[i] = bf16_to_f32_one(s[i]) * k;
}
static void scale_scalar(float *x, int64_t i, int64_t n, float k) {
    for (; i < n; i++) x[i] *= k;
}
static void acc_f32_scalar(float *acc, const float *s, int64_t i, int64_t n, int op) {
    for (; i < n; i++) acc[i] = op_one(acc[i], s[i], op);
}
static void acc_f16_scalar(float *acc, const uint16_t *s, int64_t i, int64_t n, int op) {
    for (; i < n; i++) acc[i] = op_one(acc[i], f16_to_f32_one(s[i]), op);
}
static void acc_bf16_scalar(float *acc, const uint16_t *s, int64_t i, int64_t n, int op) {
    for (; i < n; i++) acc[i] = op_one(acc[i], bf16_to_f32_one(s[i]), op);
}

#if STELLA_X86
/* ---------- AVX2 (8 lanes); tails go to the scalar loops ---------- */

STELLA_TARGET_AVX2 static __m256 op8(__m256 a, __m256 b, int op) {
    switch (op) {
    case STELLA_OP_SUM: return _mm256_add_ps(a, b);
    case STELLA_OP_PROD: return _mm256_mul_ps(a, b);
    case STELLA_OP_MIN: {
        __m256 r = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
        return _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    default: {
        __m256 r = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
        return _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    }
}

STELLA_TARGET_AVX2 static __m256i bf16_round8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, nanv, isnan); /* 32-bit lanes holding 16-bit results */
}

STELLA_TARGET_AVX2 static __m128i pack8_u32_to_u16(__m256i r) {
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi);
}

STELLA_TARGET_AVX2 static void f32_to_f16_avx2(const float *s, uint16_t *d, int64_t n, float k) {
    __m256 kk = _mm256_set1_ps(k);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(s + i), kk), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
    f32_to_f16_scalar(s, d, i, n, k);
}
STELLA_TARGET_AVX2 static void f16_to_f32_avx2(const uint16_t *s, float *d, int64_t n, float k) {
    __m256 kk = _mm256_set1_ps(k);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))), kk));
    f16_to_f32_scalar(s, d, i, n, k);
}
STELLA_TARGET_AVX2 static void f32_to_bf16_avx2(const float *s, uint16_t *d, int64_t n, float k) {
    __m256 kk = _mm256_set1_ps(k);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i r = bf16_round8(_mm256_mul_ps(_mm256_loadu_ps(s + i), kk));
        _mm_storeu_si128((__m128i *)(d + i), pack8_u32_to_u16(r));
    }
    f32_to_bf16_scalar(s, d, i, n, k);
}
STELLA_TARGET_AVX2 static void bf16_to_f32_avx2(const uint16_t *s, float *d, int64_t n, float k) {
    __m256 kk = _mm256_set1_ps(k);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), kk));
    }
    bf16_to_f32_scalar(s, d, i, n, k);
}
STELLA_TARGET_AVX2 static void scale_avx2(float *x, int64_t n, float k) {
    __m256 kk = _mm256_set1_ps(k);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), kk));
    scale_scalar(x, i, n, k);
}
STELLA_TARGET_AVX2 static void acc_f32_avx2(float *acc, const float *s, int64_t n, int op) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, op8(_mm256_loadu_ps(acc + i), _mm256_loadu_ps(s + i), op));
    acc_f32_scalar(acc, s, i, n, op);
}
STELLA_TARGET_AVX2 static void acc_f16_avx2(float *acc, const uint16_t *s, int64_t n, int op) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_ps(acc + i, op8(_mm256_loadu_ps(acc + i), b, op));
    }
    acc_f16_scalar(acc, s, i, n, op);
}
STELLA_TARGET_AVX2 static void acc_bf16_avx2(float *acc, const uint16_t *s, int64_t n, int op) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        _mm256_storeu_ps(acc + i, op8(_mm256_loadu_ps(acc + i), b, op));
    }
    acc_bf16_scalar(acc, s, i, n, op);
}

/* ---------- AVX-512 (16 lanes, masked tails: no scalar tail) ---------- */

STELLA_TARGET_AVX512 static __m512 op16(__m512 a, __m512 b, int op) {
    switch (op) {
    case STELLA_OP_SUM: return _mm512_add_ps(a, b);
    case STELLA_OP_PROD: return _mm512_mul_ps(a, b);
    case STELLA_OP_MIN: {
        __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), b, a);
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, a);
    }
    default: {
        __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), b, a);
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, a);
    }
    }
}
STELLA_TARGET_AVX512 static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}
STELLA_TARGET_AVX512 static void f32_to_f16_avx512(const float *s, uint16_t *d, int64_t n, float k) {
    __m512 kk = _mm512_set1_ps(k);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i), kk);
        _mm256_mask_storeu_epi16(d + i, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}
STELLA_TARGET_AVX512 static void f16_to_f32_avx512(const uint16_t *s, float *d, int64_t n, float k) {
    __m512 kk = _mm512_set1_ps(k);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s + i));
        _mm512_mask_storeu_ps(d + i, m, _mm512_mul_ps(v, kk));
    }
}
STELLA_TARGET_AVX512 static void f32_to_bf16_avx512(const float *s, uint16_t *d, int64_t n, float k) {
    __m512 kk = _mm512_set1_ps(k);
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), q = _mm512_set1_epi32(0x40);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i), kk);
        __m512i u = _mm512_castps_si512(v);
        __m512i hi = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(hi, one), bias)), 16);
        r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_or_si512(hi, q));
        _mm256_mask_storeu_epi16(d + i, m, _mm512_cvtepi32_epi16(r));
    }
}
STELLA_TARGET_AVX512 static void bf16_to_f32_avx512(const uint16_t *s, float *d, int64_t n, float k) {
    __m512 kk = _mm512_set1_ps(k);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + i));
        _mm512_mask_storeu_ps(d + i, m, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), kk));
    }
}
STELLA_TARGET_AVX512 static void scale_avx512(float *x, int64_t n, float k) {
    __m512 kk = _mm512_set1_ps(k);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), kk));
    }
}
STELLA_TARGET_AVX512 static void acc_f32_avx512(float *acc, const float *s, int64_t n, int op) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 r = op16(_mm512_maskz_loadu_ps(m, acc + i), _mm512_maskz_loadu_ps(m, s + i), op);
        _mm512_mask_storeu_ps(acc + i, m, r);
    }
}
STELLA_TARGET_AVX512 static void acc_f16_avx512(float *acc, const uint16_t *s, int64_t n, int op) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s + i));
        _mm512_mask_storeu_ps(acc + i, m, op16(_mm512_maskz_loadu_ps(m, acc + i), b, op));
    }
}
STELLA_TARGET_AVX512 static void acc_bf16_avx512(float *acc, const uint16_t *s, int64_t n, int op) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s + i));
        __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        _mm512_mask_storeu_ps(acc + i, m, op16(_mm512_maskz_loadu_ps(m, acc + i), b, op));
    }
}
#endif /* STELLA_X86 */

/* ---------- public entry points: validate, then dispatch ---------- */

#define CHECK_BUF(p, n) do { if ((n) < 0) return STELLA_ERR_ARG; if ((n) > 0 && !(p)) return STELLA_ERR_NULL; } while (0)
#define CHECK_OP(op) do { if ((op) < STELLA_OP_SUM || (op) > STELLA_OP_PROD) return STELLA_ERR_ARG; } while (0)

#if STELLA_X86
#define DISPATCH(name, ...) do {                                   \
        int lvl_ = stella_simd_level_internal();                   \
        if (lvl_ >= STELLA_SIMD_AVX512) name##_avx512(__VA_ARGS__); \
        else if (lvl_ >= STELLA_SIMD_AVX2) name##_avx2(__VA_ARGS__); \
        else name##_scalar_all(__VA_ARGS__);                       \
    } while (0)
#else
#define DISPATCH(name, ...) name##_scalar_all(__VA_ARGS__)
#endif

static void f32_to_f16_scalar_all(const float *s, uint16_t *d, int64_t n, float k) { f32_to_f16_scalar(s, d, 0, n, k); }
static void f16_to_f32_scalar_all(const uint16_t *s, float *d, int64_t n, float k) { f16_to_f32_scalar(s, d, 0, n, k); }
static void f32_to_bf16_scalar_all(const float *s, uint16_t *d, int64_t n, float k) { f32_to_bf16_scalar(s, d, 0, n, k); }
static void bf16_to_f32_scalar_all(const uint16_t *s, float *d, int64_t n, float k) { bf16_to_f32_scalar(s, d, 0, n, k); }
static void scale_scalar_all(float *x, int64_t n, float k) { scale_scalar(x, 0, n, k); }
static void acc_f32_scalar_all(float *a, const float *s, int64_t n, int op) { acc_f32_scalar(a, s, 0, n, op); }
static void acc_f16_scalar_all(float *a, const uint16_t *s, int64_t n, int op) { acc_f16_scalar(a, s, 0, n, op); }
static void acc_bf16_scalar_all(float *a, const uint16_t *s, int64_t n, int op) { acc_bf16_scalar(a, s, 0, n, op); }

int stella_f32_to_f16(const float *src, uint16_t *dst, int64_t n, float scale) {
    CHECK_BUF(src, n); CHECK_BUF(dst, n);
    DISPATCH(f32_to_f16, src, dst, n, scale);
    return STELLA_OK;
}
int stella_f32_to_bf16(const float *src, uint16_t *dst, int64_t n, float scale) {
    CHECK_BUF(src, n); CHECK_BUF(dst, n);
    DISPATCH(f32_to_bf16, src, dst, n, scale);
    return STELLA_OK;
}
int stella_f16_to_f32(const uint16_t *src, float *dst, int64_t n, float scale) {
    CHECK_BUF(src, n); CHECK_BUF(dst, n);
    DISPATCH(f16_to_f32, src, dst, n, scale);
    return STELLA_OK;
}
int stella_bf16_to_f32(const uint16_t *src, float *dst, int64_t n, float scale) {
    CHECK_BUF(src, n); CHECK_BUF(dst, n);
    DISPATCH(bf16_to_f32, src, dst, n, scale);
    return STELLA_OK;
}
int stella_scale_f32(float *x, int64_t n, float scale) {
    CHECK_BUF(x, n);
    DISPATCH(scale, x, n, scale);
    return STELLA_OK;
}
int stella_accumulate_f32(float *acc, const float *src, int64_t n, int op) {
    CHECK_BUF(acc, n); CHECK_BUF(src, n); CHECK_OP(op);
    DISPATCH(acc_f32, acc, src, n, op);
    return STELLA_OK;
}
int stella_accumulate_f16(float *acc, const uint16_t *src, int64_t n, int op) {
    CHECK_BUF(acc, n); CHECK_BUF(src, n); CHECK_OP(op);
    DISPATCH(acc_f16, acc, src, n, op);
    return STELLA_OK;
}
int stella_accumulate_bf16(float *acc, const uint16_t *src, int64_t n, int op) {
    CHECK_BUF(acc, n); CHECK_BUF(src, n); CHECK_OP(op);
    DISPATCH(acc_bf16, acc, src, n, op);
    return STELLA_OK;
}

int stella_checksum64(const void *data, int64_t nbytes, uint64_t *out) {
    if (!out) return STELLA_ERR_NULL;
    CHECK_BUF(data, nbytes);
    const unsigned char *p = (const unsigned char *)data;
    /* four independent multiply-xorshift lanes over 8-byte words, folded at the end */
    uint64_t h[4] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull, 0x27d4eb2f165667c5ull};
    const uint64_t M = 0xff51afd7ed558ccdull;
    int64_t i = 0;
    for (; i + 32 <= nbytes; i += 32) {
        for (int l = 0; l < 4; l++) {
            uint64_t w; memcpy(&w, p + i + 8 * l, 8);
            h[l] = (h[l] ^ w) * M;
            h[l] ^= h[l] >> 29;
        }
    }
    uint64_t r = (uint64_t)nbytes * 0x9e3779b97f4a7c15ull;
    for (int l = 0; l < 4; l++) { r ^= h[l]; r *= M; r ^= r >> 31; }
    for (; i < nbytes; i++) { r ^= p[i]; r *= 0x100000001b3ull; }
    r ^= r >> 33; r *= M; r ^= r >> 33;
    *out = r;
    return STELLA_OK;
}
