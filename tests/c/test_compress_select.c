/* test_compress_select.c - selection kernels against slow, obviously-correct
 * references (full sorts), on every SIMD path this CPU has: exact top-k,
 * cache-aware blocks, threshold selection, random-k; the error-feedback
 * invariant bit for bit; NaN/Inf; the rare refill and trim paths forced
 * through the carried threshold; argument validation (nothing written on
 * error). */
#include "check.h"
#include "stella_compress.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static uint32_t keyf(float f) { uint32_t u = f2u(f) & 0x7fffffffu; return u > 0x7f800001u ? 0x7f800001u : u; }

static uint64_t g_rng = 0x1234567887654321ull;
static uint64_t rnd(void) { g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17; return g_rng; }
static float gauss(void) { /* sum of uniforms: cheap, good enough */
    double s = 0; for (int i = 0; i < 4; i++) s += (double)(rnd() >> 11) / 9007199254740992.0;
    return (float)(s - 2.0);
}

/* composite order key: larger first, then lower index */
static const uint32_t *g_keys;
static int cmp_rank(const void *a, const void *b) {
    uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
    if (g_keys[i] != g_keys[j]) return g_keys[i] > g_keys[j] ? -1 : 1;
    return i < j ? -1 : i > j ? 1 : 0;
}
static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

/* reference top-m units by key; writes m unit ids ascending */
static void ref_top(const uint32_t *keys, int64_t units, int64_t m, uint32_t *out) {
    uint32_t *ord = malloc((size_t)(units ? units : 1) * 4);
    for (int64_t i = 0; i < units; i++) ord[i] = (uint32_t)i;
    g_keys = keys;
    qsort(ord, (size_t)units, 4, cmp_rank);
    memcpy(out, ord, (size_t)m * 4);
    qsort(out, (size_t)m, 4, cmp_u32);
    free(ord);
}

static uint32_t block_key_ref(const float *acc, int64_t n, int64_t b) {
    float x[16] = {0}, u[8], w[4], y[2];
    for (int j = 0; j < 16 && b * 16 + j < n; j++) x[j] = fabsf(acc[b * 16 + j]);
    for (int i = 0; i < 8; i++) u[i] = x[i] + x[i + 8];
    for (int i = 0; i < 4; i++) w[i] = u[i] + u[i + 4];
    for (int i = 0; i < 2; i++) y[i] = w[i] + w[i + 2];
    return keyf(y[0] + y[1]);
}

static void fill(float *g, float *r, int64_t n, int kind) {
    for (int64_t i = 0; i < n; i++) {
        g[i] = gauss();
        r[i] = gauss() * 0.25f;
        if (kind == 1 && (rnd() % 97) == 0) g[i] = (rnd() & 1) ? INFINITY : -INFINITY;
        if (kind == 1 && (rnd() % 89) == 0) g[i] = NAN;
        if (kind == 2) g[i] = (float)(rnd() % 3); /* many ties */
        if (kind == 2) r[i] = 0.0f;
    }
}

/* Check one selection result: idx/val against the reference set, the
 * residual invariant, and that nothing past out_k was written. */
static void check_result(const char *what, const float *acc, const float *res, int64_t n, const uint32_t *idx,
                         const float *val, int64_t got, const uint32_t *ref_idx, int64_t ref_k, int ef) {
    int bad = 0;
    if (got != ref_k) { fprintf(stderr, "%s: got %lld entries, want %lld\n", what, (long long)got, (long long)ref_k); g_failures++; return; }
    for (int64_t j = 0; j < got && !bad; j++) {
        if (idx[j] != ref_idx[j]) { fprintf(stderr, "%s: idx[%lld] = %u, want %u\n", what, (long long)j, idx[j], ref_idx[j]); bad = 1; }
        else if (f2u(val[j]) != f2u(acc[idx[j]]) && !(isnan(val[j]) && isnan(acc[idx[j]]))) {
            fprintf(stderr, "%s: val[%lld] differs from acc\n", what, (long long)j); bad = 1; }
    }
    if (ef && !bad) {
        int64_t j = 0;
        for (int64_t i = 0; i < n && !bad; i++) {
            int sent = j < got && idx[j] == (uint32_t)i;
            if (sent) { if (f2u(res[i]) != 0u) { fprintf(stderr, "%s: residual[%lld] not +0 after send\n", what, (long long)i); bad = 1; } j++; }
            else if (f2u(res[i]) != f2u(acc[i]) && !(isnan(res[i]) && isnan(acc[i]))) {
                fprintf(stderr, "%s: residual[%lld] != acc\n", what, (long long)i); bad = 1; }
        }
    }
    if (bad) g_failures++;
}

static void test_topk_and_blocks(void) {
    const int64_t sizes[] = {0, 1, 2, 15, 16, 17, 31, 33, 100, 255, 1000, 4097, 65537};
    for (int kind = 0; kind < 3; kind++)
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        int64_t n = sizes[si], N = n ? n : 1;
        float *g = malloc(N * 4), *r0 = malloc(N * 4), *acc = malloc(N * 4), *res = malloc(N * 4), *val = malloc((N + 16) * 4);
        uint32_t *idx = malloc((N + 16) * 4), *ref = malloc((N + 16) * 4), *keys = malloc(N * 4);
        uint32_t *bkeys = malloc(((N + 15) / 16) * 4), *bref = malloc(((N + 15) / 16) * 4);
        fill(g, r0, n, kind);
        const int64_t ks[] = {0, 1, 2, n / 100, n / 10, n / 2, n - 1, n};
        for (int ef = 0; ef < 2; ef++) {
            for (int64_t i = 0; i < n; i++) { acc[i] = ef ? g[i] + r0[i] : g[i]; keys[i] = keyf(acc[i]); }
            int64_t nb = (n + 15) / 16;
            for (int64_t b = 0; b < nb; b++) bkeys[b] = block_key_ref(acc, n, b);
            for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
                int64_t k = ks[ki];
                if (k < 0 || k > n) continue;
                ref_top(keys, n, k, ref);
                int64_t want_b = (k + 15) / 16 > nb ? nb : (k + 15) / 16, rk = 0;
                ref_top(bkeys, nb, want_b, bref);
                uint32_t *eref = malloc((N + 16) * 4);
                for (int64_t b = 0; b < want_b; b++)
                    for (int64_t t = 0; t < 16 && bref[b] * 16 + t < n; t++) eref[rk++] = bref[b] * 16 + (uint32_t)t;
                for (int lvl = 0; lvl <= stella_simd_best(); lvl++) {
                    CHECK_EQ_INT(stella_simd_force(lvl), STELLA_OK);
                    char what[128];
                    int64_t got = -1;
                    memcpy(res, r0, N * 4);
                    snprintf(what, sizeof what, "topk n=%lld k=%lld ef=%d lvl=%d kind=%d", (long long)n, (long long)k, ef, lvl, kind);
                    CHECK_EQ_INT(stella_topk_f32(g, ef ? res : NULL, n, k, idx, val, k, &got, NULL), STELLA_OK);
                    check_result(what, acc, res, n, idx, val, got, ref, k, ef);
                    memcpy(res, r0, N * 4);
                    int64_t nbs, maxe;
                    CHECK_EQ_INT(stella_block_count(n, k, &nbs, &maxe), STELLA_OK);
                    CHECK_EQ_INT(nbs, want_b);
                    snprintf(what, sizeof what, "block n=%lld k=%lld ef=%d lvl=%d kind=%d", (long long)n, (long long)k, ef, lvl, kind);
                    CHECK_EQ_INT(stella_block_topk_f32(g, ef ? res : NULL, n, k, idx, val, maxe, &got, NULL), STELLA_OK);
                    check_result(what, acc, res, n, idx, val, got, eref, rk, ef);
                    /* exact-k threshold selection with a poor hint gives the same set */
                    memcpy(res, r0, N * 4);
                    snprintf(what, sizeof what, "thresh-exact n=%lld k=%lld ef=%d lvl=%d", (long long)n, (long long)k, ef, lvl);
                    CHECK_EQ_INT(stella_threshold_select_f32(g, ef ? res : NULL, n, 0.5f, k, k, idx, val, k, &got, NULL), STELLA_OK);
                    check_result(what, acc, res, n, idx, val, got, ref, k, ef);
                }
                free(eref);
            }
        }
        stella_simd_force(-1);
        free(g); free(r0); free(acc); free(res); free(val); free(idx); free(ref); free(keys); free(bkeys); free(bref);
    }
}

static void test_threshold_semantics(void) {
    enum { N = 5000 };
    static float g[N], val[N];
    static uint32_t idx[N];
    for (int i = 0; i < N; i++) g[i] = gauss();
    g[10] = NAN; g[20] = INFINITY;
    for (int lvl = 0; lvl <= stella_simd_best(); lvl++) {
        stella_simd_force(lvl);
        int64_t got, want = 0;
        float t = 1.0f;
        for (int i = 0; i < N; i++) want += isnan(g[i]) || fabsf(g[i]) > t;
        CHECK_EQ_INT(stella_threshold_select_f32(g, NULL, N, t, 0, N, idx, val, N, &got, NULL), STELLA_OK);
        CHECK_EQ_INT(got, want);
        int64_t j = 0;
        for (int i = 0; i < N; i++) if (isnan(g[i]) || fabsf(g[i]) > t) { CHECK(j < got && idx[j] == (uint32_t)i); j++; }
        /* max_k caps: the max_k largest (NaN first, then Inf) */
        CHECK_EQ_INT(stella_threshold_select_f32(g, NULL, N, t, 0, 2, idx, val, 2, &got, NULL), STELLA_OK);
        CHECK_EQ_INT(got, 2);
        CHECK(idx[0] == 10 && idx[1] == 20);
        /* min_k fills up when the threshold lets too few through */
        CHECK_EQ_INT(stella_threshold_select_f32(g, NULL, N, INFINITY, 5, 5, idx, val, 5, &got, NULL), STELLA_OK);
        CHECK_EQ_INT(got, 5);
        CHECK_EQ_INT(stella_threshold_select_f32(g, NULL, N, INFINITY, 0, 5, idx, val, 5, &got, NULL), STELLA_OK);
        CHECK_EQ_INT(got, 1); /* only the NaN is above +Inf */
        float est;
        CHECK_EQ_INT(stella_estimate_threshold_f32(g, NULL, N, 100, &est), STELLA_OK);
        int64_t above = 0;
        for (int i = 0; i < N; i++) above += fabsf(g[i]) >= est || isnan(g[i]);
        CHECK_EQ_INT(above, 100); /* N <= sample size: exact */
    }
    stella_simd_force(-1);
}

/* The carried threshold only changes speed: forcing it far too high (refill
 * path) or to zero (trim on the fly) gives the same result. */
static void test_forced_paths(void) {
    enum { N = 100003, K = 1000 };
    float *g = malloc(N * 4), *r0 = malloc(N * 4), *r1 = malloc(N * 4), *r2 = malloc(N * 4);
    float *v0 = malloc((N + 16) * 4), *v1 = malloc((N + 16) * 4);
    uint32_t *i0 = malloc((N + 16) * 4), *i1 = malloc((N + 16) * 4);
    fill(g, r0, N, 0);
    stella_sel_state *st;
    CHECK_EQ_INT(stella_sel_state_new(&st), STELLA_OK);
    stella_sel_stats s;
    for (int lvl = 0; lvl <= stella_simd_best(); lvl++) {
        stella_simd_force(lvl);
        for (int blk = 0; blk < 2; blk++) {
            int64_t k0, k1;
            memcpy(r1, r0, N * 4);
            if (blk) CHECK_EQ_INT(stella_block_topk_f32(g, r1, N, K, i0, v0, K + 16, &k0, NULL), STELLA_OK);
            else CHECK_EQ_INT(stella_topk_f32(g, r1, N, K, i0, v0, K, &k0, NULL), STELLA_OK);
            const float forced[2] = {1e30f, 0.0f};
            for (int f = 0; f < 2; f++) {
                memcpy(r2, r0, N * 4);
                CHECK_EQ_INT(stella_sel_state_set_threshold(st, forced[f]), STELLA_OK);
                if (blk) CHECK_EQ_INT(stella_block_topk_f32(g, r2, N, K, i1, v1, K + 16, &k1, st), STELLA_OK);
                else CHECK_EQ_INT(stella_topk_f32(g, r2, N, K, i1, v1, K, &k1, st), STELLA_OK);
                CHECK_EQ_INT(k1, k0);
                CHECK(memcmp(i0, i1, k0 * 4) == 0);
                CHECK(memcmp(v0, v1, k0 * 4) == 0);
                CHECK(memcmp(r1, r2, N * 4) == 0);
                CHECK_EQ_INT(stella_sel_state_stats(st, &s), STELLA_OK);
                if (f == 0) CHECK(s.extra_passes > 0);   /* nothing passed: the refill ran */
                else CHECK(s.compactions > 1);           /* everything passed: trimmed on the fly */
            }
        }
    }
    /* a run of steps with a carried threshold: single pass most of the time */
    stella_simd_force(-1);
    CHECK_EQ_INT(stella_sel_state_reset(st), STELLA_OK);
    memset(r1, 0, N * 4);
    for (int step = 0; step < 20; step++) {
        int64_t k;
        fill(g, r2, N, 0);
        CHECK_EQ_INT(stella_block_topk_f32(g, r1, N, K, i0, v0, K + 16, &k, st), STELLA_OK);
    }
    CHECK_EQ_INT(stella_sel_state_stats(st, &s), STELLA_OK);
    CHECK(s.calls >= 20);
    CHECK(s.threshold_hits >= 15);
    stella_sel_state_free(st);
    free(g); free(r0); free(r1); free(r2); free(v0); free(v1); free(i0); free(i1);
}

static void test_randomk(void) {
    uint64_t k1, k2, k3;
    CHECK_EQ_INT(stella_randomk_key(42, "layer1.weight", 13, 7, &k1), STELLA_OK);
    CHECK_EQ_INT(stella_randomk_key(42, "layer1.weight", 13, 7, &k2), STELLA_OK);
    CHECK_EQ_INT(stella_randomk_key(42, "layer1.weight", 13, 8, &k3), STELLA_OK);
    CHECK(k1 == k2 && k1 != k3);
    const int64_t ns[] = {1, 2, 3, 17, 1000, 65537, 1 << 20};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
        int64_t n = ns[a];
        const int64_t ks[] = {0, 1, n / 100, n / 31, n / 2, n};
        uint32_t *idx = malloc(n * 4), *idx2 = malloc(n * 4);
        uint8_t *seen = calloc(n, 1);
        for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++) {
            int64_t k = ks[b];
            CHECK_EQ_INT(stella_randomk_indices(k1, n, k, idx, k), STELLA_OK);
            CHECK_EQ_INT(stella_randomk_indices(k1, n, k, idx2, k), STELLA_OK);
            CHECK(memcmp(idx, idx2, k * 4) == 0);
            for (int64_t j = 0; j < k; j++) {
                CHECK(idx[j] < n);
                if (j) CHECK(idx[j] > idx[j - 1]);
            }
            if (k > 10 && k < n) {
                CHECK_EQ_INT(stella_randomk_indices(k3, n, k, idx2, k), STELLA_OK);
                CHECK(memcmp(idx, idx2, k * 4) != 0);
            }
        }
        /* every index reachable: the permutation of [0, n) is a bijection */
        if (n <= 65537) {
            CHECK_EQ_INT(stella_randomk_indices(k1, n, n, idx, n), STELLA_OK);
            for (int64_t j = 0; j < n; j++) CHECK(idx[j] == (uint32_t)j);
        }
        free(idx); free(idx2); free(seen);
    }
    /* roughly uniform: each of 64 equal ranges gets about k/64 */
    enum { N = 1 << 20, K = 1 << 14 };
    uint32_t *idx = malloc(K * 4);
    int cnt[64] = {0};
    CHECK_EQ_INT(stella_randomk_indices(k1, N, K, idx, K), STELLA_OK);
    for (int j = 0; j < K; j++) cnt[idx[j] / (N / 64)]++;
    for (int b = 0; b < 64; b++) CHECK(cnt[b] > 256 - 80 && cnt[b] < 256 + 80);
    free(idx);
    /* select with error feedback */
    float g[100], r[100], acc[100], val[10];
    uint32_t ix[10];
    int64_t got;
    for (int i = 0; i < 100; i++) { g[i] = gauss(); r[i] = gauss(); acc[i] = g[i] + r[i]; }
    CHECK_EQ_INT(stella_randomk_select_f32(g, r, 100, 10, k1, ix, val, 10, &got), STELLA_OK);
    CHECK_EQ_INT(got, 10);
    for (int j = 0, i = 0; i < 100; i++) {
        if (j < 10 && ix[j] == (uint32_t)i) { CHECK(f2u(r[i]) == 0 && f2u(val[j]) == f2u(acc[i])); j++; }
        else CHECK(f2u(r[i]) == f2u(acc[i]));
    }
}

static void test_validation(void) {
    float g[32] = {0}, r[32], val[32];
    uint32_t idx[32];
    int64_t got, nb, me;
    for (int i = 0; i < 32; i++) r[i] = (float)i;
    const int64_t BIG = (int64_t)STELLA_SPARSE_MAX_N + 1;
    CHECK_EQ_INT(stella_topk_f32(NULL, r, 32, 1, idx, val, 1, &got, NULL), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_topk_f32(g, r, 32, 1, idx, val, 1, NULL, NULL), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_topk_f32(g, r, -1, 1, idx, val, 1, &got, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_topk_f32(g, r, BIG, 1, idx, val, 1, &got, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_topk_f32(g, r, 32, 33, idx, val, 33, &got, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_topk_f32(g, r, 32, -1, idx, val, 1, &got, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_topk_f32(g, r, 32, 5, idx, val, 4, &got, NULL), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_topk_f32(g, r, 32, 5, NULL, val, 5, &got, NULL), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_block_topk_f32(g, r, 32, 17, idx, val, 31, &got, NULL), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_block_topk_f32(g, r, 30, 17, idx, val, 30, &got, NULL), STELLA_OK); /* 2 blocks, 30 entries */
    CHECK_EQ_INT(got, 30);
    for (int i = 0; i < 32; i++) r[i] = (float)i;
    CHECK_EQ_INT(stella_threshold_select_f32(g, r, 32, -1.0f, 0, 5, idx, val, 5, &got, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_threshold_select_f32(g, r, 32, NAN, 0, 5, idx, val, 5, &got, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_threshold_select_f32(g, r, 32, 1.0f, 6, 5, idx, val, 5, &got, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_randomk_select_f32(g, r, 32, 40, 1, idx, val, 40, &got), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_randomk_key(1, NULL, 3, 0, (uint64_t *)&got), STELLA_ERR_NULL);
    for (int i = 0; i < 32; i++) CHECK(r[i] == (float)i); /* residual untouched by every refusal */
    /* block counts near the index-width limit, without allocating */
    CHECK_EQ_INT(stella_block_count(STELLA_SPARSE_MAX_N, STELLA_SPARSE_MAX_N, &nb, &me), STELLA_OK);
    CHECK_EQ_INT(nb, ((int64_t)STELLA_SPARSE_MAX_N + 15) / 16);
    CHECK_EQ_INT(me, STELLA_SPARSE_MAX_N);
    CHECK_EQ_INT(stella_block_count(BIG, 1, &nb, &me), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_block_count(100, 1, &nb, &me), STELLA_OK);
    CHECK_EQ_INT(nb, 1);
    CHECK_EQ_INT(me, 16);
    CHECK_EQ_INT(stella_sel_state_set_threshold(NULL, 1.0f), STELLA_ERR_NULL);
    stella_sel_state *st;
    CHECK_EQ_INT(stella_sel_state_new(&st), STELLA_OK);
    CHECK_EQ_INT(stella_sel_state_set_threshold(st, -2.0f), STELLA_ERR_ARG);
    stella_sel_state_free(st);
    stella_sel_state_free(NULL);
}

int main(void) {
    printf("simd best level: %d\n", stella_simd_best());
    test_validation();
    test_threshold_semantics();
    test_randomk();
    test_forced_paths();
    test_topk_and_blocks();
    TEST_MAIN_END();
}
