/* select.c - the selection engine behind exact top-k, cache-aware block
 * selection and threshold selection, with error feedback fused in.
 *
 * One pass over the data computes acc = grad + residual, writes the residual
 * (acc, or +0.0 where the unit is taken) and appends every unit (element or
 * 16-float block) whose magnitude key exceeds a threshold T to a candidate
 * list, saving acc of the candidate while it is in cache. When the list fills
 * up, it is trimmed on the fly to the kmax best (by key, then lower index),
 * the dropped units' residual is restored from the saved values, and T rises
 * to the key of the last one kept. After the pass:
 *   - more than kmax candidates: trim to kmax (exact top-kmax: every unit not
 *     in the list has key <= T <= the keys kept);
 *   - fewer than kmin (T was too high, rare): restore the candidates and find
 *     the exact top-kmin with a two-level radix select over all units (three
 *     more passes);
 *   - otherwise the candidates are the answer.
 * So the result is always the exact top-m for the order (key desc, index asc);
 * T only decides the speed. T comes from the threshold carried in the state
 * (cache-aware, top-k), from a sample of the data (first call), or from the
 * caller (threshold selection). Each element is read once in the common case.
 */
#include "compress_internal.h"
#include <math.h>
#include <stdlib.h>
#if STELLA_X86
#include <immintrin.h>
#endif

enum { MODE_NONE = 0, MODE_TOPK = 1, MODE_BLOCK = 2, MODE_THRESH = 3 };
#define HIST_HI 32768
#define HIST_LO 65536
#define SAMPLE_RUN 64
#define SAMPLE_MAX 65536
#define BLOCK_SAMPLE_RUN 4
#define BLOCK_SAMPLE_MAX 4096

struct stella_sel_state {
    uint32_t *pos, *key;
    float *val;
    uint64_t *comp;
    int64_t cand_cap;      /* units pos/key/comp can hold */
    int64_t val_cap;       /* floats val can hold */
    uint32_t *hist;        /* HIST_HI + HIST_LO counters, or NULL */
    uint32_t *scores;      /* block keys for the rare refill */
    int64_t scores_cap;
    uint64_t *sample;      /* SAMPLE_MAX composite keys, or NULL */
    /* carried threshold */
    int mode;
    int64_t n;
    int has_thr;
    uint32_t thr_key;
    int forced;
    uint32_t forced_key;
    float margin;
    stella_sel_stats stats;
};

/* ---------------------------------------------------------------- state */

static void state_init(stella_sel_state *st) {
    memset(st, 0, sizeof *st);
    st->margin = 0.85f;
    st->stats.threshold_used = -1.0f;
    st->stats.threshold_next = -1.0f;
}

static void state_release(stella_sel_state *st) {
    free(st->pos); free(st->key); free(st->val); free(st->comp);
    free(st->hist); free(st->scores); free(st->sample);
}

int stella_sel_state_new(stella_sel_state **out) {
    if (!out) return STELLA_ERR_NULL;
    stella_sel_state *st = (stella_sel_state *)malloc(sizeof *st);
    if (!st) return STELLA_ERR_NOMEM;
    state_init(st);
    *out = st;
    return STELLA_OK;
}

void stella_sel_state_free(stella_sel_state *st) {
    if (!st) return;
    state_release(st);
    free(st);
}

int stella_sel_state_reset(stella_sel_state *st) {
    if (!st) return STELLA_ERR_NULL;
    st->has_thr = 0;
    st->forced = 0;
    st->mode = MODE_NONE;
    st->margin = 0.85f;
    return STELLA_OK;
}

int stella_sel_state_stats(const stella_sel_state *st, stella_sel_stats *out) {
    if (!st || !out) return STELLA_ERR_NULL;
    *out = st->stats;
    return STELLA_OK;
}

int stella_sel_state_set_threshold(stella_sel_state *st, float threshold) {
    if (!st) return STELLA_ERR_NULL;
    if (!(threshold >= 0.0f)) return STELLA_ERR_ARG; /* also refuses NaN */
    st->forced = 1;
    st->forced_key = stella_mag_key(threshold);
    return STELLA_OK;
}

static int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap && *p) return STELLA_OK;
    free(*p);
    *p = NULL;
    *cap = 0;
    if (need < 1) need = 1;
    void *q = malloc((size_t)need * elem);
    if (!q) return STELLA_ERR_NOMEM;
    *p = q;
    *cap = need;
    return STELLA_OK;
}

/* Candidate buffers for up to cand units of `unit` floats each (+16 slack for
 * the vector stores), the histogram and the sample buffer. */
static int state_reserve(stella_sel_state *st, int64_t cand, int unit) {
    int64_t c = cand + 16, cp = st->cand_cap, cpk = st->cand_cap, cc = st->cand_cap;
    int rc;
    if (cp < c || !st->pos || !st->key || !st->comp) {
        if ((rc = grow((void **)&st->pos, &cp, c, 4))) return rc;
        if ((rc = grow((void **)&st->key, &cpk, c, 4))) return rc;
        if ((rc = grow((void **)&st->comp, &cc, c, 8))) return rc;
        st->cand_cap = c;
    }
    if ((rc = grow((void **)&st->val, &st->val_cap, c * unit, 4))) return rc;
    if (!st->hist) {
        st->hist = (uint32_t *)malloc((HIST_HI + HIST_LO) * sizeof(uint32_t));
        if (!st->hist) return STELLA_ERR_NOMEM;
    }
    if (!st->sample) {
        st->sample = (uint64_t *)malloc(SAMPLE_MAX * sizeof(uint64_t));
        if (!st->sample) return STELLA_ERR_NOMEM;
    }
    return STELLA_OK;
}

/* --------------------------------------------------------- quickselect */

static int cmp_desc_u64(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? 1 : a > b ? -1 : 0;
}

uint64_t stella_select_desc_u64(uint64_t *a, int64_t n, int64_t m) {
    int64_t lo = 0, hi = n - 1, t = m - 1;
    uint64_t rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    /* each round keeps about half on average; 4 log2(n) + 16 rounds is far in
     * the tail, and only then does the sort fallback (n log n) run */
    int budget = 16;
    for (int64_t x = n; x; x >>= 1) budget += 4;
    while (hi > lo) {
        if (budget-- <= 0) { /* pathological pivots: finish with a sort */
            qsort(a + lo, (size_t)(hi - lo + 1), sizeof(uint64_t), cmp_desc_u64);
            return a[t];
        }
        int64_t len = hi - lo + 1, i0, i1, i2;
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        i0 = lo + (int64_t)(rng % (uint64_t)len);
        i1 = lo + (int64_t)((rng >> 21) % (uint64_t)len);
        i2 = lo + (int64_t)((rng >> 42) % (uint64_t)len);
        uint64_t p0 = a[i0], p1 = a[i1], p2 = a[i2], p;
        if ((p0 <= p1 && p1 <= p2) || (p2 <= p1 && p1 <= p0)) p = p1;
        else if ((p1 <= p0 && p0 <= p2) || (p2 <= p0 && p0 <= p1)) p = p0;
        else p = p2;
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) { uint64_t tmp = a[i]; a[i] = a[j]; a[j] = tmp; i++; j--; }
        }
        if (t <= j) hi = j;
        else if (t >= i) lo = i;
        else return a[t];
    }
    return a[t];
}

/* --------------------------------------------------------------- engine */

typedef struct {
    const float *g;
    float *r;              /* residual or NULL */
    int64_t n, nunits;
    int unit;              /* 1 or 16 */
    int64_t kmin, kmax;
    int32_t T;             /* a unit is a candidate iff key > T */
    uint32_t *pos, *key;
    float *val;
    uint64_t *comp;
    int64_t count, cap;
    int64_t passed, compactions;
} eng_t;

static inline int64_t unit_len(const eng_t *e, int64_t u) {
    int64_t base = u * e->unit, len = e->n - base;
    return len < e->unit ? len : e->unit;
}

static void restore_cand(eng_t *e, int64_t i) {
    if (!e->r) return;
    int64_t u = e->pos[i];
    if (e->unit == 1) e->r[u] = e->val[i];
    else memcpy(e->r + u * 16, e->val + i * 16, (size_t)unit_len(e, u) * sizeof(float));
}

static inline uint64_t composite(uint32_t key, uint32_t pos) {
    return ((uint64_t)key << 32) | (uint64_t)(0xffffffffu - pos);
}

/* Keep the m best candidates (in list order), restore the others, raise T. */
static void compact(eng_t *e, int64_t m) {
    if (e->count <= m) return;
    e->compactions++;
    int64_t c = e->count;
    if (m == 0) {
        for (int64_t i = 0; i < c; i++) restore_cand(e, i);
        e->count = 0;
        e->T = STELLA_T_NONE;
        return;
    }
    for (int64_t i = 0; i < c; i++) e->comp[i] = composite(e->key[i], e->pos[i]);
    uint64_t cut = stella_select_desc_u64(e->comp, c, m);
    int64_t j = 0;
    for (int64_t i = 0; i < c; i++) {
        if (composite(e->key[i], e->pos[i]) >= cut) {
            if (j != i) {
                e->pos[j] = e->pos[i];
                e->key[j] = e->key[i];
                if (e->unit == 1) e->val[j] = e->val[i];
                else memcpy(e->val + j * 16, e->val + i * 16, 16 * sizeof(float));
            }
            j++;
        } else {
            restore_cand(e, i);
        }
    }
    e->count = j;
    e->T = (int32_t)(cut >> 32);
}

/* ---- element passes ---- */

static void pass_elem_scalar_from(eng_t *e, int64_t i) {
    const float *g = e->g;
    float *r = e->r;
    for (; i < e->n; i++) {
        float a = r ? g[i] + r[i] : g[i];
        uint32_t k = stella_mag_key(a);
        if ((int32_t)k > e->T) {
            if (e->count >= e->cap - 16) {
                compact(e, e->kmax);
                if (!((int32_t)k > e->T)) { if (r) r[i] = a; continue; }
            }
            e->pos[e->count] = (uint32_t)i;
            e->key[e->count] = k;
            e->val[e->count] = a;
            e->count++;
            e->passed++;
            if (r) r[i] = 0.0f;
        } else if (r) {
            r[i] = a;
        }
    }
}

static void pass_elem_scalar(eng_t *e) { pass_elem_scalar_from(e, 0); }

/* ---- block scores and passes ---- */

/* Load block u of acc (zero-padded to 16) into a. */
static inline void load_block_scalar(const eng_t *e, int64_t u, float *a) {
    int64_t base = u * 16, len = unit_len(e, u);
    for (int64_t j = 0; j < 16; j++) a[j] = 0.0f;
    for (int64_t j = 0; j < len; j++) a[j] = e->r ? e->g[base + j] + e->r[base + j] : e->g[base + j];
}

/* Handle block u whose acc is a[16] and key k: candidate or not, residual written. */
static inline void take_block(eng_t *e, int64_t u, uint32_t k, const float *a) {
    int64_t base = u * 16, len = unit_len(e, u);
    if ((int32_t)k > e->T) {
        if (e->count >= e->cap - 16) compact(e, e->kmax);
        if ((int32_t)k > e->T) {
            e->pos[e->count] = (uint32_t)u;
            e->key[e->count] = k;
            memcpy(e->val + e->count * 16, a, 16 * sizeof(float));
            e->count++;
            e->passed++;
            if (e->r) memset(e->r + base, 0, (size_t)len * sizeof(float));
            return;
        }
    }
    if (e->r) memcpy(e->r + base, a, (size_t)len * sizeof(float));
}

static void pass_block_scalar_from(eng_t *e, int64_t u) {
    float a[16];
    for (; u < e->nunits; u++) {
        load_block_scalar(e, u, a);
        take_block(e, u, stella_key_bits(stella_f2u(stella_block_score16(a))), a);
    }
}

static void pass_block_scalar(eng_t *e) { pass_block_scalar_from(e, 0); }

/* Keys of every block of acc (acc read from the residual when there is one). */
static void block_keys(const float *acc, int64_t n, int64_t nunits, uint32_t *out) {
    float a[16];
    for (int64_t u = 0; u < nunits; u++) {
        int64_t base = u * 16, len = n - base < 16 ? n - base : 16;
        if (len == 16) memcpy(a, acc + base, sizeof a);
        else { memset(a, 0, sizeof a); memcpy(a, acc + base, (size_t)len * sizeof(float)); }
        out[u] = stella_key_bits(stella_f2u(stella_block_score16(a)));
    }
}

#if STELLA_X86
STELLA_TARGET_AVX512 static inline __mmask16 tmask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

STELLA_TARGET_AVX512 static inline void pass_elem_avx512_impl(eng_t *e, const int ef) {
    const float *g = e->g;
    float *r = e->r;
    const int64_t n = e->n;
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), kn = _mm512_set1_epi32((int)STELLA_KEY_NAN);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i T = _mm512_set1_epi32(e->T);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 tm = tmask16(n - i);
        __m512 a = _mm512_maskz_loadu_ps(tm, g + i);
        if (ef) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(tm, r + i));
        __m512i k = _mm512_min_epu32(_mm512_and_si512(_mm512_castps_si512(a), absm), kn);
        __mmask16 m = _mm512_mask_cmpgt_epi32_mask(tm, k, T);
        if (m) {
            if (e->count > e->cap - 16) {
                compact(e, e->kmax);
                T = _mm512_set1_epi32(e->T);
                m = _mm512_mask_cmpgt_epi32_mask(tm, k, T);
            }
            int64_t c = e->count;
            __m512i p = _mm512_add_epi32(lane, _mm512_set1_epi32((int)i));
            /* compress in registers, then full stores: the buffers keep 16 lanes of slack */
            _mm512_storeu_si512((void *)(e->pos + c), _mm512_maskz_compress_epi32(m, p));
            _mm512_storeu_si512((void *)(e->key + c), _mm512_maskz_compress_epi32(m, k));
            _mm512_storeu_ps(e->val + c, _mm512_maskz_compress_ps(m, a));
            int pc = __builtin_popcount((unsigned)m);
            e->count += pc;
            e->passed += pc;
        }
        if (ef) _mm512_mask_storeu_ps(r + i, tm, _mm512_maskz_mov_ps((__mmask16)~m, a));
    }
}
STELLA_TARGET_AVX512 static void pass_elem_avx512(eng_t *e) {
    if (e->r) pass_elem_avx512_impl(e, 1);
    else pass_elem_avx512_impl(e, 0);
}

STELLA_TARGET_AVX512 static inline uint32_t score_key512(__m512 a) {
    __m512 x = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
    __m256 u = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    __m128 w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    __m128 y = _mm_add_ps(w, _mm_movehl_ps(w, w));
    __m128 s = _mm_add_ss(y, _mm_movehdup_ps(y));
    return stella_key_bits((uint32_t)_mm_cvtsi128_si32(_mm_castps_si128(s)));
}

STELLA_TARGET_AVX512 static inline void pass_block_avx512_impl(eng_t *e, const int ef) {
    const float *g = e->g;
    float *r = e->r;
    const int64_t n = e->n, nb = e->nunits;
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t u = 0; u < nb; u++) {
        int64_t base = u * 16;
        __mmask16 tm = tmask16(n - base);
        __m512 a = _mm512_maskz_loadu_ps(tm, g + base);
        if (ef) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(tm, r + base));
        uint32_t k = score_key512(a);
        if ((int32_t)k > e->T) {
            if (e->count >= e->cap - 16) compact(e, e->kmax);
            if ((int32_t)k > e->T) {
                int64_t c = e->count;
                e->pos[c] = (uint32_t)u;
                e->key[c] = k;
                _mm512_storeu_ps(e->val + c * 16, a);
                e->count = c + 1;
                e->passed++;
                if (ef) _mm512_mask_storeu_ps(r + base, tm, zero);
                continue;
            }
        }
        if (ef) _mm512_mask_storeu_ps(r + base, tm, a);
    }
}
STELLA_TARGET_AVX512 static void pass_block_avx512(eng_t *e) {
    if (e->r) pass_block_avx512_impl(e, 1);
    else pass_block_avx512_impl(e, 0);
}

STELLA_TARGET_AVX2 static inline void pass_elem_avx2_impl(eng_t *e, const int ef) {
    const float *g = e->g;
    float *r = e->r;
    const int64_t n = e->n;
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), kn = _mm256_set1_epi32((int)STELLA_KEY_NAN);
    __m256i T = _mm256_set1_epi32(e->T);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(g + i);
        if (ef) a = _mm256_add_ps(a, _mm256_loadu_ps(r + i));
        __m256i k = _mm256_min_epu32(_mm256_and_si256(_mm256_castps_si256(a), absm), kn);
        __m256i c = _mm256_cmpgt_epi32(k, T);
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(c));
        if (m) {
            if (e->count > e->cap - 16) {
                compact(e, e->kmax);
                T = _mm256_set1_epi32(e->T);
                c = _mm256_cmpgt_epi32(k, T);
                m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(c));
            }
            uint32_t kk[8];
            float aa[8];
            _mm256_storeu_si256((__m256i *)kk, k);
            _mm256_storeu_ps(aa, a);
            while (m) {
                int j = __builtin_ctz(m);
                m &= m - 1;
                e->pos[e->count] = (uint32_t)(i + j);
                e->key[e->count] = kk[j];
                e->val[e->count] = aa[j];
                e->count++;
                e->passed++;
            }
        }
        if (ef) _mm256_storeu_ps(r + i, _mm256_andnot_ps(_mm256_castsi256_ps(c), a));
    }
    pass_elem_scalar_from(e, i);
}
STELLA_TARGET_AVX2 static void pass_elem_avx2(eng_t *e) {
    if (e->r) pass_elem_avx2_impl(e, 1);
    else pass_elem_avx2_impl(e, 0);
}

STELLA_TARGET_AVX2 static inline uint32_t score_key256(__m256 lo, __m256 hi) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 u = _mm256_add_ps(_mm256_and_ps(lo, absm), _mm256_and_ps(hi, absm));
    __m128 w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    __m128 y = _mm_add_ps(w, _mm_movehl_ps(w, w));
    __m128 s = _mm_add_ss(y, _mm_movehdup_ps(y));
    return stella_key_bits((uint32_t)_mm_cvtsi128_si32(_mm_castps_si128(s)));
}

STELLA_TARGET_AVX2 static inline void pass_block_avx2_impl(eng_t *e, const int ef) {
    const float *g = e->g;
    float *r = e->r;
    const int64_t full = e->n / 16;
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t u = 0; u < full; u++) {
        int64_t base = u * 16;
        __m256 lo = _mm256_loadu_ps(g + base), hi = _mm256_loadu_ps(g + base + 8);
        if (ef) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(r + base));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(r + base + 8));
        }
        uint32_t k = score_key256(lo, hi);
        if ((int32_t)k > e->T) {
            if (e->count >= e->cap - 16) compact(e, e->kmax);
            if ((int32_t)k > e->T) {
                int64_t c = e->count;
                e->pos[c] = (uint32_t)u;
                e->key[c] = k;
                _mm256_storeu_ps(e->val + c * 16, lo);
                _mm256_storeu_ps(e->val + c * 16 + 8, hi);
                e->count = c + 1;
                e->passed++;
                if (ef) { _mm256_storeu_ps(r + base, zero); _mm256_storeu_ps(r + base + 8, zero); }
                continue;
            }
        }
        if (ef) { _mm256_storeu_ps(r + base, lo); _mm256_storeu_ps(r + base + 8, hi); }
    }
    pass_block_scalar_from(e, full); /* the short tail block, if any */
}
STELLA_TARGET_AVX2 static void pass_block_avx2(eng_t *e) {
    if (e->r) pass_block_avx2_impl(e, 1);
    else pass_block_avx2_impl(e, 0);
}
#endif /* STELLA_X86 */

static void run_pass(eng_t *e) {
    int lvl = stella_simd_level_internal();
    (void)lvl;
#if STELLA_X86
    if (lvl >= STELLA_SIMD_AVX512) { if (e->unit == 1) pass_elem_avx512(e); else pass_block_avx512(e); return; }
    if (lvl >= STELLA_SIMD_AVX2) { if (e->unit == 1) pass_elem_avx2(e); else pass_block_avx2(e); return; }
#endif
    if (e->unit == 1) pass_elem_scalar(e);
    else pass_block_scalar(e);
}

/* ------------------------------------------------------ radix selection */

/* Exact top-m (1 <= m <= cnt) of the keys of raw[0..cnt): every unit with key
 * > *kstar, plus the first *q (by index) with key == *kstar. */
static void radix_topm(const uint32_t *raw, int64_t cnt, int64_t m, uint32_t *hist, uint32_t *kstar, int64_t *q) {
    uint32_t *h1 = hist, *h2 = hist + HIST_HI;
    memset(h1, 0, HIST_HI * sizeof(uint32_t));
    for (int64_t i = 0; i < cnt; i++) h1[stella_key_bits(raw[i]) >> 16]++;
    int64_t above = 0;
    uint32_t B = HIST_HI - 1;
    for (; B > 0; B--) {
        if (above + h1[B] >= m) break;
        above += h1[B];
    }
    memset(h2, 0, HIST_LO * sizeof(uint32_t));
    for (int64_t i = 0; i < cnt; i++) {
        uint32_t k = stella_key_bits(raw[i]);
        if ((k >> 16) == B) h2[k & 0xffffu]++;
    }
    uint32_t L = HIST_LO - 1;
    for (; L > 0; L--) {
        if (above + h2[L] >= m) break;
        above += h2[L];
    }
    *kstar = (B << 16) | L;
    *q = m - above;
}

/* ------------------------------------------------------------ sampling */

/* Composite keys of a fixed sample of units (all when there are few). */
static int64_t sample_keys(const float *g, const float *r, int64_t n, int unit, uint64_t *out) {
    int64_t nunits = unit == 1 ? n : (n + 15) / 16;
    int64_t run = unit == 1 ? SAMPLE_RUN : BLOCK_SAMPLE_RUN;
    int64_t maxs = unit == 1 ? SAMPLE_MAX : BLOCK_SAMPLE_MAX;
    int64_t s = 0, nruns, step_units;
    if (nunits <= maxs) { nruns = 1; run = nunits; step_units = 0; }
    else { nruns = maxs / run; step_units = 1; }
    float a[16];
    for (int64_t j = 0; j < nruns; j++) {
        int64_t start = step_units ? j * (nunits - run) / (nruns - 1) : 0;
        for (int64_t u = start; u < start + run; u++) {
            uint32_t k;
            if (unit == 1) {
                k = stella_mag_key(r ? g[u] + r[u] : g[u]);
            } else {
                int64_t base = u * 16, len = n - base < 16 ? n - base : 16;
                memset(a, 0, sizeof a);
                for (int64_t t = 0; t < len; t++) a[t] = r ? g[base + t] + r[base + t] : g[base + t];
                k = stella_key_bits(stella_f2u(stella_block_score16(a)));
            }
            out[s] = composite(k, (uint32_t)s);
            s++;
        }
    }
    return s;
}

/* A threshold below the m-th largest key with high probability (-1: pass all). */
static int32_t sample_threshold(const float *g, const float *r, int64_t n, int unit, int64_t m, uint64_t *buf) {
    int64_t nunits = unit == 1 ? n : (n + 15) / 16;
    if (m <= 0) return STELLA_T_NONE;
    int64_t s = sample_keys(g, r, n, unit, buf);
    if (s == 0) return -1;
    double rs = ceil((double)m * (double)s / (double)nunits);
    double rr = s == nunits ? rs + 1.0 : rs + 3.0 * sqrt(rs) + 2.0;
    if (rr >= (double)s) return -1;
    uint64_t c = stella_select_desc_u64(buf, s, (int64_t)rr);
    int32_t k = (int32_t)(c >> 32);
    return k > 0 ? k - 1 : 0;
}

int stella_estimate_threshold_f32(const float *grad, const float *residual, int64_t n, int64_t k, float *out) {
    if (!out) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n) return STELLA_ERR_ARG;
    if (n > 0 && !grad) return STELLA_ERR_NULL;
    if (k == 0) { *out = INFINITY; return STELLA_OK; }
    uint64_t *buf = (uint64_t *)malloc(SAMPLE_MAX * sizeof(uint64_t));
    if (!buf) return STELLA_ERR_NOMEM;
    int64_t s = sample_keys(grad, residual, n, 1, buf);
    int64_t r = (int64_t)ceil((double)k * (double)s / (double)n);
    if (r < 1) r = 1;
    if (r > s) r = s;
    uint32_t key = (uint32_t)(stella_select_desc_u64(buf, s, r) >> 32);
    free(buf);
    *out = key >= STELLA_KEY_NAN ? NAN : stella_u2f(key);
    return STELLA_OK;
}

/* ------------------------------------------------------------- driver */

static int check_common(const float *grad, int64_t n, uint32_t *idx, float *val, int64_t *out_k) {
    if (!out_k) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N) return STELLA_ERR_ARG;
    if (n > 0 && !grad) return STELLA_ERR_NULL;
    (void)idx; (void)val;
    return STELLA_OK;
}

/* Everything selected: idx = 0..n-1, val = acc, residual = 0. */
static void select_all(const float *g, float *r, int64_t n, uint32_t *idx, float *val) {
    for (int64_t i = 0; i < n; i++) {
        float a = r ? g[i] + r[i] : g[i];
        idx[i] = (uint32_t)i;
        val[i] = a;
        if (r) r[i] = 0.0f;
    }
}

static void emit_candidates(const eng_t *e, uint32_t *idx, float *val, int64_t *out_k) {
    int64_t j = 0;
    if (e->unit == 1) {
        if (e->count) {
            memcpy(idx, e->pos, (size_t)e->count * sizeof(uint32_t));
            memcpy(val, e->val, (size_t)e->count * sizeof(float));
        }
        j = e->count;
    } else {
        for (int64_t i = 0; i < e->count; i++) {
            int64_t u = e->pos[i], len = unit_len(e, u);
            for (int64_t t = 0; t < len; t++) {
                idx[j + t] = (uint32_t)(u * 16 + t);
                val[j + t] = e->val[i * 16 + t];
            }
            j += len;
        }
    }
    *out_k = j;
}

/* The rare path: fewer than kmin candidates. Restore them, then radix-select
 * the exact top-kmin over all units. Returns the smallest selected key. */
static int refill(eng_t *e, stella_sel_state *st, uint32_t *idx, float *val, int64_t *out_k, uint32_t *kmin_key,
                  int64_t *extra) {
    for (int64_t i = 0; i < e->count; i++) restore_cand(e, i);
    e->count = 0;
    const float *acc = e->r ? e->r : e->g;
    uint32_t kstar;
    int64_t q, j = 0;
    if (e->unit == 1) {
        radix_topm((const uint32_t *)acc, e->n, e->kmin, st->hist, &kstar, &q);
        for (int64_t i = 0; i < e->n; i++) {
            uint32_t k = stella_mag_key(acc[i]);
            if (k > kstar || (k == kstar && q > 0)) {
                if (k == kstar) q--;
                idx[j] = (uint32_t)i;
                val[j] = acc[i];
                j++;
                if (e->r) e->r[i] = 0.0f;
            }
        }
        *extra = 3;
    } else {
        int rc = grow((void **)&st->scores, &st->scores_cap, e->nunits, sizeof(uint32_t));
        if (rc) { *out_k = 0; return rc; } /* residual == acc: nothing sent, invariant holds */
        block_keys(acc, e->n, e->nunits, st->scores);
        radix_topm(st->scores, e->nunits, e->kmin, st->hist, &kstar, &q);
        for (int64_t u = 0; u < e->nunits; u++) {
            uint32_t k = st->scores[u];
            if (k > kstar || (k == kstar && q > 0)) {
                if (k == kstar) q--;
                int64_t base = u * 16, len = unit_len(e, u);
                for (int64_t t = 0; t < len; t++) {
                    idx[j + t] = (uint32_t)(base + t);
                    val[j + t] = acc[base + t];
                }
                if (e->r) memset(e->r + base, 0, (size_t)len * sizeof(float));
                j += len;
            }
        }
        *extra = 2;
    }
    *kmin_key = kstar;
    *out_k = j;
    return STELLA_OK;
}

/* Run one selection: units of `unit` floats, between kmin and kmax of them. */
static int select_units(const float *grad, float *residual, int64_t n, int unit, int64_t kmin, int64_t kmax,
                        int mode, int have_T, int32_t T_given, uint32_t *idx, float *val, int64_t *out_k,
                        stella_sel_state *user_st) {
    stella_sel_state local, *st = user_st;
    if (!st) { state_init(&local); st = &local; }
    int64_t nunits = unit == 1 ? n : (n + 15) / 16;
    int rc = STELLA_OK;
    eng_t e;
    memset(&e, 0, sizeof e);
    e.g = grad; e.r = residual; e.n = n; e.nunits = nunits; e.unit = unit; e.kmin = kmin; e.kmax = kmax;

    if (kmin == nunits && nunits > 0) { /* everything: one pass, no candidates */
        select_all(grad, residual, n, idx, val);
        *out_k = n;
        st->stats.calls++;
        st->stats.units = nunits; st->stats.wanted = kmin; st->stats.candidates = nunits;
        st->stats.compactions = 0; st->stats.extra_passes = 0; st->stats.selected = nunits;
        st->stats.threshold_used = -1.0f; st->stats.threshold_next = -1.0f;
        st->has_thr = 0;
        goto done;
    }
    int64_t room = kmax + (kmax > 4096 ? kmax : 4096);
    if (room > nunits) room = nunits;
    if ((rc = state_reserve(st, room, unit))) goto done;
    e.pos = st->pos; e.key = st->key; e.val = st->val; e.comp = st->comp;
    e.cap = room + 16;

    /* the starting threshold */
    int carried = 0;
    if (kmax == 0) e.T = STELLA_T_NONE;
    else if (have_T) e.T = T_given;   /* the caller's threshold wins; a forced one waits for top-k/block */
    else if (st->forced) { e.T = (int32_t)st->forced_key; st->forced = 0; carried = 1; }
    else if (st->has_thr && st->mode == mode && st->n == n) { e.T = (int32_t)st->thr_key; carried = 1; }
    else e.T = sample_threshold(grad, residual, n, unit, kmin, st->sample);
    int32_t T_used = e.T;

    run_pass(&e);
    if (e.count > kmax) compact(&e, kmax);

    int64_t extra = 0;
    uint32_t kmin_key = 0;
    if (e.count < kmin) {
        rc = refill(&e, st, idx, val, out_k, &kmin_key, &extra);
        if (rc) goto done;
    } else {
        emit_candidates(&e, idx, val, out_k);
        kmin_key = STELLA_KEY_NAN;
        for (int64_t i = 0; i < e.count; i++) if (e.key[i] < kmin_key) kmin_key = e.key[i];
    }

    /* carry the threshold to the next call, corrected by how this one went */
    if (mode == MODE_TOPK || mode == MODE_BLOCK) {
        /* Too few passing costs passes over the data, too many only a trim of
         * the candidates: aim for kmin..2*kmin, correcting down fast, up slowly. */
        if (extra) st->margin *= 0.8f;
        else if (e.passed > 2 * kmin + 64) st->margin *= 1.05f;
        if (st->margin < 1.0f / 64) st->margin = 1.0f / 64;
        if (st->margin > 64.0f) st->margin = 64.0f;
        if (kmin > 0 && kmin_key < 0x7f800000u) {
            float t = stella_u2f(kmin_key) * st->margin;
            st->thr_key = stella_mag_key(t);
            if (st->thr_key >= 0x7f800000u) st->thr_key = 0x7f7fffffu;
            st->has_thr = 1;
            st->mode = mode;
            st->n = n;
        } else {
            st->has_thr = 0;
        }
    }
    st->stats.calls++;
    st->stats.units = nunits;
    st->stats.wanted = kmin;
    st->stats.candidates = e.passed;
    st->stats.compactions = e.compactions;
    st->stats.extra_passes = extra;
    st->stats.selected = unit == 1 ? *out_k : (extra ? (*out_k + 15) / 16 : e.count);
    if (carried && !extra) st->stats.threshold_hits++;
    st->stats.threshold_used = T_used < 0 ? -1.0f : (T_used >= (int32_t)STELLA_KEY_NAN ? INFINITY : stella_u2f((uint32_t)T_used));
    st->stats.threshold_next = st->has_thr ? stella_u2f(st->thr_key) : -1.0f;
done:
    if (st == &local) state_release(&local);
    return rc;
}

/* ------------------------------------------------------- entry points */

int stella_topk_f32(const float *grad, float *residual, int64_t n, int64_t k,
                    uint32_t *idx, float *val, int64_t cap, int64_t *out_k, stella_sel_state *state) {
    int rc = check_common(grad, n, idx, val, out_k);
    if (rc) return rc;
    if (k < 0 || k > n) return STELLA_ERR_ARG;
    if (cap < k) return STELLA_ERR_SIZE;
    if (k > 0 && (!idx || !val)) return STELLA_ERR_NULL;
    *out_k = 0;
    return select_units(grad, residual, n, 1, k, k, MODE_TOPK, 0, 0, idx, val, out_k, state);
}

int stella_block_count(int64_t n, int64_t k, int64_t *nblocks, int64_t *max_entries) {
    if (!nblocks || !max_entries) return STELLA_ERR_NULL;
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0 || k > n) return STELLA_ERR_ARG;
    int64_t total = (n + 15) / 16, b = (k + 15) / 16;
    if (b > total) b = total;
    int64_t e = b * 16;
    *nblocks = b;
    *max_entries = e < n ? e : n;
    return STELLA_OK;
}

int stella_block_topk_f32(const float *grad, float *residual, int64_t n, int64_t k,
                          uint32_t *idx, float *val, int64_t cap, int64_t *out_k, stella_sel_state *state) {
    int rc = check_common(grad, n, idx, val, out_k);
    if (rc) return rc;
    int64_t nb, maxe;
    if ((rc = stella_block_count(n, k, &nb, &maxe))) return rc;
    if (cap < maxe) return STELLA_ERR_SIZE;
    if (maxe > 0 && (!idx || !val)) return STELLA_ERR_NULL;
    *out_k = 0;
    return select_units(grad, residual, n, 16, nb, nb, MODE_BLOCK, 0, 0, idx, val, out_k, state);
}

int stella_threshold_select_f32(const float *grad, float *residual, int64_t n, float threshold,
                                int64_t min_k, int64_t max_k, uint32_t *idx, float *val,
                                int64_t cap, int64_t *out_k, stella_sel_state *state) {
    int rc = check_common(grad, n, idx, val, out_k);
    if (rc) return rc;
    if (!(threshold >= 0.0f)) return STELLA_ERR_ARG; /* negative or NaN */
    if (min_k < 0 || min_k > max_k || max_k > n) return STELLA_ERR_ARG;
    if (cap < max_k) return STELLA_ERR_SIZE;
    if (max_k > 0 && (!idx || !val)) return STELLA_ERR_NULL;
    *out_k = 0;
    uint32_t tk = stella_mag_key(threshold); /* +Inf -> 0x7f800000: only NaN passes */
    return select_units(grad, residual, n, 1, min_k, max_k, MODE_THRESH, 1, (int32_t)tk, idx, val, out_k, state);
}
