/* test_optim.c - sparse optimizer kernels: EXACT with sparse lists (long gaps,
 * so every closed-form catch-up is used) equals EXACT fed the full list with
 * zeros (the per-step rule, checked against torch in the Python golden tests);
 * LAZY leaves unlisted coordinates alone; argument validation; nothing is
 * written when a list is refused. */
#include "check.h"
#include "stella_optim.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1000, STEPS = 80 };

typedef struct {
    float p[N], b1[N], b2[N], b3[N];
    int32_t last[N];
    stella_optim_tensor t;
} state;

static void state_init(state *s, uint32_t seed) {
    for (int i = 0; i < N; i++) {
        seed = seed * 1664525u + 1013904223u;
        s->p[i] = ((float)(seed >> 8) / 16777216.0f - 0.5f) * 2.0f;
    }
    memset(s->b1, 0, sizeof s->b1); memset(s->b2, 0, sizeof s->b2); memset(s->b3, 0, sizeof s->b3);
    memset(s->last, 0, sizeof s->last);
    stella_optim_tensor t = { s->p, s->b1, s->b2, s->b3, s->last, N };
    s->t = t;
}

static double rel_err(const float *a, const float *b, int n) {
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / (1e-3 + fabs((double)b[i]));
        if (!(d <= worst)) worst = d;  /* NaN counts as worst */
    }
    return worst;
}

static stella_optim_hparams sgd(double lr, double mu, double damp, double wd, int flags) {
    stella_optim_hparams h = { STELLA_OPTIM_SGD, STELLA_OPTIM_EXACT, flags, 0, lr, wd, mu, damp, 0, 0, 0 };
    return h;
}
static stella_optim_hparams adam(int kind, double lr, double b1, double b2, double eps, double wd, int flags) {
    stella_optim_hparams h = { kind, STELLA_OPTIM_EXACT, flags, 0, lr, wd, 0, 0, b1, b2, eps };
    return h;
}

/* EXACT sparse (density ~2%: gaps of ~50 steps) vs EXACT with every index listed. */
static void exact_vs_full(stella_optim_hparams h, const char *name) {
    static state sp, full;
    static uint32_t idx[N], all[N];
    static float val[N], dense[N];
    state_init(&sp, 7); state_init(&full, 7);
    for (int i = 0; i < N; i++) all[i] = (uint32_t)i;
    uint32_t seed = 12345;
    for (int step = 1; step <= STEPS; step++) {
        int k = 0;
        memset(dense, 0, sizeof dense);
        for (int i = 0; i < N; i++) {
            seed = seed * 1664525u + 1013904223u;
            int pick = (seed >> 16) % 1000 < 20 && i >= 10;   /* coordinates 0..9 never get a gradient */
            if (step == 3 && i == 500) pick = 1;
            if (pick) {
                seed = seed * 1664525u + 1013904223u;
                float g = ((float)(seed >> 8) / 16777216.0f - 0.5f);
                idx[k] = (uint32_t)i; val[k] = g; dense[i] = g; k++;
            }
        }
        CHECK_EQ_INT(stella_optim_apply(&h, &sp.t, idx, val, k, 0, k, step), STELLA_OK);
        CHECK_EQ_INT(stella_optim_apply(&h, &full.t, all, dense, N, 0, N, step), STELLA_OK);
        if (step == STEPS / 2) /* a partial catch-up in the middle changes nothing in the result */
            CHECK_EQ_INT(stella_optim_catch_up(&h, &sp.t, 100, 300, step), STELLA_OK);
    }
    CHECK_EQ_INT(stella_optim_catch_up(&h, &sp.t, 0, N, STEPS), STELLA_OK);
    for (int i = 0; i < N; i++) CHECK_EQ_INT(sp.last[i], STEPS);
    double e = rel_err(sp.p, full.p, N);
    double eb = rel_err(sp.b1, full.b1, N);
    if (!(e < 2e-4 && eb < 2e-4)) {
        fprintf(stderr, "%s: param rel err %g, buf1 rel err %g\n", name, e, eb);
        g_failures++;
    }
}

static void test_exact_catch_up(void) {
    exact_vs_full(sgd(0.1, 0, 0, 0, 0), "sgd plain");
    exact_vs_full(sgd(0.1, 0, 0, 0.01, 0), "sgd wd");
    exact_vs_full(sgd(0.1, 0.9, 0, 0, 0), "sgd momentum");
    exact_vs_full(sgd(0.1, 0.9, 0.3, 0, STELLA_OPTIM_MAXIMIZE), "sgd momentum dampening maximize");
    exact_vs_full(sgd(0.05, 0.9, 0, 0, STELLA_OPTIM_NESTEROV), "sgd nesterov");
    exact_vs_full(sgd(0.1, 0.9, 0.1, 0.02, 0), "sgd momentum+wd");
    exact_vs_full(sgd(0.05, 0.8, 0, 0.05, STELLA_OPTIM_NESTEROV), "sgd nesterov+wd");
    exact_vs_full(sgd(0.1, 1.0, 0, 0, 0), "sgd momentum 1");
    exact_vs_full(adam(STELLA_OPTIM_ADAM, 0.01, 0.9, 0.999, 1e-8, 0, 0), "adam");
    exact_vs_full(adam(STELLA_OPTIM_ADAM, 0.01, 0.8, 0.99, 1e-6, 0.1, 0), "adam wd");
    exact_vs_full(adam(STELLA_OPTIM_ADAMW, 0.01, 0.9, 0.999, 1e-8, 0.1, 0), "adamw");
    exact_vs_full(adam(STELLA_OPTIM_ADAMW, 0.01, 0.9, 0.999, 1e-8, 0.1, STELLA_OPTIM_AMSGRAD), "adamw amsgrad");
    exact_vs_full(adam(STELLA_OPTIM_ADAM, 0.01, 0.5, 0.9, 1e-3, 0.01, STELLA_OPTIM_AMSGRAD | STELLA_OPTIM_MAXIMIZE),
                  "adam amsgrad maximize wd");
}

static void test_lazy(void) {
    static state s;
    state_init(&s, 3);
    float before[N];
    memcpy(before, s.p, sizeof before);
    stella_optim_hparams h = adam(STELLA_OPTIM_ADAMW, 0.01, 0.9, 0.999, 1e-8, 0.1, 0);
    h.mode = STELLA_OPTIM_LAZY;
    s.t.last = NULL;
    uint32_t idx[3] = { 5, 17, 999 };
    float val[3] = { 1, -1, 0.5f };
    for (int step = 1; step <= 5; step++) CHECK_EQ_INT(stella_optim_apply(&h, &s.t, idx, val, 3, 0, 3, step), STELLA_OK);
    for (int i = 0; i < N; i++) {
        int listed = i == 5 || i == 17 || i == 999;
        if (listed) CHECK(s.p[i] != before[i]);
        else CHECK(s.p[i] == before[i] && s.b1[i] == 0 && s.b2[i] == 0);
    }
    /* LAZY catch-up does nothing */
    CHECK_EQ_INT(stella_optim_catch_up(&h, &s.t, 0, N, 9), STELLA_OK);
    CHECK(s.p[0] == before[0]);
    /* one Adam step from zero state with g: p -= lr * sign(g) (approximately) after decoupled decay */
    static state one;
    state_init(&one, 3);
    one.t.last = NULL;
    CHECK_EQ_INT(stella_optim_apply(&h, &one.t, idx, val, 1, 0, 1, 1), STELLA_OK);
    CHECK(fabsf(one.p[5] - (before[5] * (1.0f - 0.001f) - 0.01f)) < 1e-6f);
}

static void test_validation(void) {
    static state s;
    state_init(&s, 9);
    float keep[N];
    memcpy(keep, s.p, sizeof keep);
    stella_optim_hparams h = sgd(0.1, 0.9, 0, 0, 0);
    uint32_t unsorted[3] = { 5, 3, 7 }, dup[3] = { 3, 3, 7 }, oob[2] = { 3, N }, ok[2] = { 1, 2 };
    float val[3] = { 1, 1, 1 };
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, unsorted, val, 3, 0, 3, 1), STELLA_ERR_MALFORMED);
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, dup, val, 3, 0, 3, 1), STELLA_ERR_MALFORMED);
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, oob, val, 2, 0, 2, 1), STELLA_ERR_MALFORMED);
    CHECK(memcmp(keep, s.p, sizeof keep) == 0);
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, unsorted, val, 3, 1, 2, 1), STELLA_OK); /* sub-range [3] is fine */
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, ok, val, 2, 0, 3, 1), STELLA_ERR_ARG);     /* hi > k */
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, ok, val, 2, 0, 2, 0), STELLA_ERR_ARG);     /* step 0 */
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, ok, val, 2, 0, 2, 1), STELLA_OK);
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, ok, val, 2, 0, 2, 1), STELLA_ERR_ARG);     /* already at step 1 */
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, ok, val, 0, 0, 0, 2), STELLA_OK);          /* empty list */
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, NULL, NULL, 0, 0, 0, 2), STELLA_OK);
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, NULL, val, 2, 0, 2, 2), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_optim_apply(NULL, &s.t, ok, val, 2, 0, 2, 2), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_optim_catch_up(&h, &s.t, 0, N, 0), STELLA_ERR_ARG);  /* some coordinates are at 1 > 0 */
    CHECK_EQ_INT(stella_optim_catch_up(&h, &s.t, 0, N + 1, 3), STELLA_ERR_ARG);
    stella_optim_hparams bad = h; bad.lr = -1;
    CHECK_EQ_INT(stella_optim_check(&bad, &s.t), STELLA_ERR_ARG);
    bad = h; bad.lr = NAN;
    CHECK_EQ_INT(stella_optim_check(&bad, &s.t), STELLA_ERR_ARG);
    bad = h; bad.flags = STELLA_OPTIM_NESTEROV; bad.dampening = 0.5;
    CHECK_EQ_INT(stella_optim_check(&bad, &s.t), STELLA_ERR_ARG);
    bad = h; bad.mode = 7;
    CHECK_EQ_INT(stella_optim_check(&bad, &s.t), STELLA_ERR_ARG);
    stella_optim_hparams a = adam(STELLA_OPTIM_ADAM, 0.1, 1.0, 0.999, 1e-8, 0, 0);
    CHECK_EQ_INT(stella_optim_check(&a, &s.t), STELLA_ERR_ARG);
    a.beta1 = 0.9; a.flags = STELLA_OPTIM_AMSGRAD;
    stella_optim_tensor t3 = s.t; t3.buf3 = NULL;
    CHECK_EQ_INT(stella_optim_check(&a, &t3), STELLA_ERR_NULL);
    stella_optim_tensor tl = s.t; tl.last = NULL;
    CHECK_EQ_INT(stella_optim_check(&h, &tl), STELLA_ERR_NULL);  /* EXACT needs last */
    int64_t pos;
    uint32_t sorted[5] = { 1, 4, 4 + 16, 40, 41 };
    CHECK_EQ_INT(stella_optim_lower_bound(sorted, 5, 4, &pos), STELLA_OK); CHECK_EQ_INT(pos, 1);
    CHECK_EQ_INT(stella_optim_lower_bound(sorted, 5, 41, &pos), STELLA_OK); CHECK_EQ_INT(pos, 4);
    CHECK_EQ_INT(stella_optim_lower_bound(sorted, 5, 42, &pos), STELLA_OK); CHECK_EQ_INT(pos, 5);
    CHECK_EQ_INT(stella_optim_lower_bound(sorted, 5, 0, &pos), STELLA_OK); CHECK_EQ_INT(pos, 0);
}

static void test_nan_inf(void) {
    static state s;
    state_init(&s, 11);
    stella_optim_hparams h = adam(STELLA_OPTIM_ADAM, 0.01, 0.9, 0.999, 1e-8, 0, 0);
    uint32_t idx[3] = { 1, 2, 3 };
    float val[3] = { NAN, INFINITY, 1.0f };
    CHECK_EQ_INT(stella_optim_apply(&h, &s.t, idx, val, 3, 0, 3, 1), STELLA_OK);
    CHECK(isnan(s.p[1]));
    CHECK(isnan(s.p[2]));  /* inf / inf, like torch */
    CHECK(isfinite(s.p[3]));
    CHECK_EQ_INT(stella_optim_catch_up(&h, &s.t, 0, N, 40), STELLA_OK);
    CHECK(isnan(s.p[1]) && isfinite(s.p[3]) && isfinite(s.p[4]));
}

/* Catch-up after every step (whole blocks one step behind take the vector path):
 * identical bits on every SIMD level. */
static void run_flush(stella_optim_hparams h, int lvl, state *s) {
    static uint32_t idx[N];
    static float val[N];
    CHECK_EQ_INT(stella_simd_force(lvl), STELLA_OK);
    state_init(s, 21);
    uint32_t seed = 99;
    for (int step = 1; step <= 30; step++) {
        int k = 0;
        for (int i = 0; i < N; i++) {
            seed = seed * 1664525u + 1013904223u;
            if ((seed >> 16) % 100 < 3) { idx[k] = (uint32_t)i; val[k++] = (float)((seed >> 4) & 255) / 128.0f - 1.0f; }
        }
        CHECK_EQ_INT(stella_optim_apply(&h, &s->t, idx, val, k, 0, k, step), STELLA_OK);
        if (step % 5 != 2) CHECK_EQ_INT(stella_optim_catch_up(&h, &s->t, 3, N, step), STELLA_OK);
    }
    CHECK_EQ_INT(stella_optim_catch_up(&h, &s->t, 0, N, 30), STELLA_OK);
    stella_simd_force(-1);
}

static void test_simd_paths_identical(void) {
    stella_optim_hparams hs[] = {
        sgd(0.1, 0.9, 0.2, 0.01, STELLA_OPTIM_MAXIMIZE), sgd(0.1, 0.9, 0, 0.01, STELLA_OPTIM_NESTEROV),
        sgd(0.1, 0, 0, 0.01, 0), sgd(0.1, 0.9, 0, 0, 0),
        adam(STELLA_OPTIM_ADAM, 0.01, 0.9, 0.999, 1e-8, 0, 0), adam(STELLA_OPTIM_ADAMW, 0.01, 0.3, 0.99, 1e-6, 0.1, STELLA_OPTIM_MAXIMIZE),
        adam(STELLA_OPTIM_ADAM, 0.01, 0.9, 0.999, 1e-8, 0.1, STELLA_OPTIM_AMSGRAD),
    };
    static state ref, got;
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++) {
        run_flush(hs[i], STELLA_SIMD_SCALAR, &ref);
        for (int lvl = 1; lvl <= stella_simd_best(); lvl++) {
            run_flush(hs[i], lvl, &got);
            if (memcmp(ref.p, got.p, sizeof ref.p) || memcmp(ref.b1, got.b1, sizeof ref.b1) ||
                memcmp(ref.b2, got.b2, sizeof ref.b2)) {
                fprintf(stderr, "config %zu: SIMD level %d differs from scalar\n", i, lvl);
                g_failures++;
            }
        }
    }
}

int main(void) {
    test_simd_paths_identical();
    test_exact_catch_up();
    test_lazy();
    test_validation();
    test_nan_inf();
    TEST_MAIN_END();
}
