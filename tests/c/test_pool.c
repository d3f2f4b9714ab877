/* test_pool.c - the pinned worker pool: each worker's affinity read back from
 * the kernel, batches over several tensors with tiny chunks give the same bits
 * as the single-threaded kernels, a malformed list changes nothing, timeouts,
 * BUSY, bad cores, destroy while running, and many back-to-back batches (run
 * under -DSTELLA_TSAN=ON too). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "check.h"
#include "stella_pool.h"
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int allowed_cores(int32_t *out, int cap) {
    cpu_set_t s;
    CPU_ZERO(&s);
    if (sched_getaffinity(0, sizeof s, &s)) return 0;
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE && n < cap; c++)
        if (CPU_ISSET(c, &s)) out[n++] = c;
    return n;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

enum { NT = 3 };
static const int64_t SIZES[NT] = { 100003, 4096, 77 };

typedef struct {
    float *p, *b1, *b2, *b3;
    int32_t *last;
    uint32_t *idx;
    float *val;
    int64_t k;
    stella_optim_tensor t;
} tens;

static void tens_init(tens *x, int64_t n, uint32_t seed, int density_permille) {
    x->p = malloc(n * 4); x->b1 = calloc(n, 4); x->b2 = calloc(n, 4); x->b3 = calloc(n, 4);
    x->last = calloc(n, 4); x->idx = malloc(n * 4); x->val = malloc(n * 4);
    for (int64_t i = 0; i < n; i++) { seed = seed * 1664525u + 1013904223u; x->p[i] = (float)(seed >> 9) / 8388608.0f - 0.5f; }
    stella_optim_tensor t = { x->p, x->b1, x->b2, x->b3, x->last, n };
    x->t = t;
    x->k = 0;
    (void)density_permille;
}

static void tens_list(tens *x, uint32_t seed, int permille) {
    x->k = 0;
    for (int64_t i = 0; i < x->t.n; i++) {
        seed = seed * 1664525u + 1013904223u;
        if ((seed >> 12) % 1000 < (uint32_t)permille) {
            x->idx[x->k] = (uint32_t)i;
            x->val[x->k++] = (float)((seed >> 3) & 1023) / 512.0f - 1.0f;
        }
    }
}

static void tens_free(tens *x) { free(x->p); free(x->b1); free(x->b2); free(x->b3); free(x->last); free(x->idx); free(x->val); }

static void test_affinity(stella_pool *pool, const int32_t *cores, int n) {
    int32_t tids[64], got[64];
    CHECK_EQ_INT(stella_pool_threads(pool, tids, got, 64), STELLA_OK);
    for (int i = 0; i < n; i++) {
        CHECK_EQ_INT(got[i], cores[i]);
        cpu_set_t s;
        CPU_ZERO(&s);
        CHECK_EQ_INT(sched_getaffinity(tids[i], sizeof s, &s), 0);
        CHECK_EQ_INT(CPU_COUNT(&s), 1);
        CHECK(CPU_ISSET(cores[i], &s));
    }
    CHECK_EQ_INT(stella_pool_threads(pool, tids, got, n - 1), STELLA_ERR_SIZE);
}

static void test_equal_single_thread(stella_pool *pool, int op_catch) {
    stella_optim_hparams hps[2] = {
        { STELLA_OPTIM_ADAM, STELLA_OPTIM_EXACT, STELLA_OPTIM_AMSGRAD, 0, 0.01, 0.01, 0, 0, 0.9, 0.999, 1e-8, },
        { STELLA_OPTIM_SGD, STELLA_OPTIM_EXACT, STELLA_OPTIM_NESTEROV, 0, 0.1, 0.001, 0.9, 0, 0, 0, 0 },
    };
    for (int h = 0; h < 2; h++) {
        tens a[NT], b[NT];
        for (int i = 0; i < NT; i++) { tens_init(&a[i], SIZES[i], 5 + i, 0); tens_init(&b[i], SIZES[i], 5 + i, 0); }
        for (int step = 1; step <= 12; step++) {
            stella_pool_task tasks[NT + 1];
            int nt = 0;
            for (int i = 0; i < NT; i++) {
                tens_list(&a[i], step * 31 + i, i == 2 ? 500 : 30);
                tens_list(&b[i], step * 31 + i, i == 2 ? 500 : 30);
                CHECK_EQ_INT(stella_optim_apply(&hps[h], &b[i].t, b[i].idx, b[i].val, b[i].k, 0, b[i].k, step), STELLA_OK);
                if (op_catch) CHECK_EQ_INT(stella_optim_catch_up(&hps[h], &b[i].t, 0, b[i].t.n, step), STELLA_OK);
                stella_pool_task t;
                memset(&t, 0, sizeof t);
                t.op = op_catch ? STELLA_TASK_APPLY_CATCH_UP : STELLA_TASK_APPLY;
                t.hp = hps[h]; t.tensor = a[i].t; t.idx = a[i].idx; t.val = a[i].val; t.k = a[i].k;
                t.step = step;
                if (i == 0) { /* one tensor given as two tasks, split at an odd coordinate */
                    t.lo = 0; t.hi = 50001; tasks[nt++] = t;
                    t.lo = 50001; t.hi = a[i].t.n; tasks[nt++] = t;
                } else {
                    t.lo = 0; t.hi = a[i].t.n; tasks[nt++] = t;
                }
            }
            int32_t st[NT + 1];
            CHECK_EQ_INT(stella_pool_run(pool, tasks, nt, 64, 10000, st), STELLA_OK);
        }
        for (int i = 0; i < NT; i++) {
            if (!op_catch) {
                stella_pool_task t;
                memset(&t, 0, sizeof t);
                t.op = STELLA_TASK_CATCH_UP; t.hp = hps[h]; t.tensor = a[i].t; t.lo = 0; t.hi = a[i].t.n; t.step = 12;
                CHECK_EQ_INT(stella_pool_run(pool, &t, 1, 16, 10000, NULL), STELLA_OK);
                CHECK_EQ_INT(stella_optim_catch_up(&hps[h], &b[i].t, 0, b[i].t.n, 12), STELLA_OK);
            }
            CHECK(memcmp(a[i].p, b[i].p, SIZES[i] * 4) == 0);
            CHECK(memcmp(a[i].b1, b[i].b1, SIZES[i] * 4) == 0);
            CHECK(memcmp(a[i].last, b[i].last, SIZES[i] * 4) == 0);
            tens_free(&a[i]); tens_free(&b[i]);
        }
    }
}

static void test_malformed_changes_nothing(stella_pool *pool) {
    stella_optim_hparams hp = { STELLA_OPTIM_SGD, STELLA_OPTIM_EXACT, 0, 0, 0.1, 0, 0.9, 0, 0, 0, 0 };
    tens a, b;
    tens_init(&a, 100000, 1, 0);
    tens_init(&b, 100000, 2, 0);
    tens_list(&a, 3, 50);
    tens_list(&b, 4, 50);
    float *copy_a = malloc(100000 * 4), *copy_b = malloc(100000 * 4);
    memcpy(copy_a, a.p, 100000 * 4); memcpy(copy_b, b.p, 100000 * 4);
    uint32_t save = b.idx[b.k - 10];
    b.idx[b.k - 10] = b.idx[b.k - 12];  /* unsorted near the end */
    stella_pool_task t[2];
    memset(t, 0, sizeof t);
    t[0].op = t[1].op = STELLA_TASK_APPLY;
    t[0].hp = t[1].hp = hp;
    t[0].tensor = a.t; t[0].idx = a.idx; t[0].val = a.val; t[0].k = a.k; t[0].hi = a.t.n; t[0].step = 1;
    t[1].tensor = b.t; t[1].idx = b.idx; t[1].val = b.val; t[1].k = b.k; t[1].hi = b.t.n; t[1].step = 1;
    int32_t st[2] = { -1, -1 };
    CHECK_EQ_INT(stella_pool_run(pool, t, 2, 32, 10000, st), STELLA_ERR_MALFORMED);
    CHECK_EQ_INT(st[0], STELLA_OK);
    CHECK_EQ_INT(st[1], STELLA_ERR_MALFORMED);
    CHECK(memcmp(copy_a, a.p, 100000 * 4) == 0);
    CHECK(memcmp(copy_b, b.p, 100000 * 4) == 0);
    b.idx[b.k - 10] = save;
    b.idx[b.k - 1] = 100000;  /* out of range, last entry: caught by the last chunk */
    CHECK_EQ_INT(stella_pool_run(pool, t, 2, 32, 10000, st), STELLA_ERR_MALFORMED);
    CHECK(memcmp(copy_b, b.p, 100000 * 4) == 0);
    b.idx[b.k - 1] = 99999;
    b.idx[0] = 99999;  /* first entry too large */
    CHECK_EQ_INT(stella_pool_run(pool, t, 2, 1000000, 10000, st), STELLA_ERR_MALFORMED);
    CHECK(memcmp(copy_a, a.p, 100000 * 4) == 0);
    /* bad task arguments are refused at submit */
    t[1].hi = b.t.n + 1;
    CHECK_EQ_INT(stella_pool_submit(pool, t, 2, 0), STELLA_ERR_ARG);
    t[1].hi = b.t.n; t[1].op = 99;
    CHECK_EQ_INT(stella_pool_submit(pool, t, 2, 0), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_pool_wait(pool, 0, NULL, 0), STELLA_OK);  /* nothing in flight */
    CHECK_EQ_INT(stella_pool_run(pool, t, 0, 0, 100, NULL), STELLA_OK);  /* empty batch */
    free(copy_a); free(copy_b); tens_free(&a); tens_free(&b);
}

static void test_timeout_busy(stella_pool *pool) {
    stella_pool_task t;
    memset(&t, 0, sizeof t);
    t.op = STELLA_TASK_SLEEP;
    t.step = 300000;  /* 300 ms */
    double t0 = now_ms();
    CHECK_EQ_INT(stella_pool_submit(pool, &t, 1, 0), STELLA_OK);
    CHECK_EQ_INT(stella_pool_submit(pool, &t, 1, 0), STELLA_ERR_BUSY);
    CHECK_EQ_INT(stella_pool_wait(pool, 20, NULL, 0), STELLA_ERR_TIMEOUT);
    double waited = now_ms() - t0;
    CHECK(waited >= 15 && waited < 250);
    CHECK_EQ_INT(stella_pool_wait(pool, 0, NULL, 0), STELLA_ERR_TIMEOUT);
    CHECK_EQ_INT(stella_pool_wait(pool, -1, NULL, 0), STELLA_OK);
    CHECK(now_ms() - t0 >= 290);
}

static void test_many_batches(stella_pool *pool) {
    stella_optim_hparams hp = { STELLA_OPTIM_ADAM, STELLA_OPTIM_LAZY, 0, 0, 0.01, 0, 0, 0, 0.9, 0.999, 1e-8 };
    tens a;
    tens_init(&a, 20000, 9, 0);
    tens_list(&a, 5, 100);
    for (int step = 1; step <= 300; step++) {
        stella_pool_task t;
        memset(&t, 0, sizeof t);
        t.op = STELLA_TASK_APPLY; t.hp = hp; t.tensor = a.t; t.idx = a.idx; t.val = a.val; t.k = a.k;
        t.hi = a.t.n; t.step = step;
        CHECK_EQ_INT(stella_pool_run(pool, &t, 1, 50, 10000, NULL), STELLA_OK);
    }
    tens_free(&a);
}

int main(void) {
    int32_t cores[64];
    int n = allowed_cores(cores, 64);
    CHECK(n >= 1);
    int32_t bad = -1;
    stella_pool *pool = NULL;
    CHECK_EQ_INT(stella_pool_create(&bad, 1, &pool), STELLA_ERR_ARG);
    CHECK(pool == NULL);
    bad = CPU_SETSIZE + 5;
    CHECK_EQ_INT(stella_pool_create(&bad, 1, &pool), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_pool_create(cores, 0, &pool), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_pool_create(NULL, 1, &pool), STELLA_ERR_NULL);

    /* up to 4 workers over the allowed cores (repeating a core when there are fewer) */
    int32_t use[4];
    int nw = n >= 4 ? 4 : (n == 1 ? 2 : n);
    for (int i = 0; i < nw; i++) use[i] = cores[i % n];
    CHECK_EQ_INT(stella_pool_create(use, nw, &pool), STELLA_OK);
    int32_t size = 0;
    CHECK_EQ_INT(stella_pool_size(pool, &size), STELLA_OK);
    CHECK_EQ_INT(size, nw);
    test_affinity(pool, use, nw);
    test_equal_single_thread(pool, 0);
    test_equal_single_thread(pool, 1);
    test_malformed_changes_nothing(pool);
    test_timeout_busy(pool);
    test_many_batches(pool);
    CHECK_EQ_INT(stella_pool_destroy(pool), STELLA_OK);

    /* destroy while a batch runs: returns after the running chunk */
    CHECK_EQ_INT(stella_pool_create(use, 1, &pool), STELLA_OK);
    stella_pool_task t;
    memset(&t, 0, sizeof t);
    t.op = STELLA_TASK_SLEEP; t.step = 50000;
    stella_pool_task two[3] = { t, t, t };
    CHECK_EQ_INT(stella_pool_submit(pool, two, 3, 0), STELLA_OK);
    double t0 = now_ms();
    CHECK_EQ_INT(stella_pool_destroy(pool), STELLA_OK);
    CHECK(now_ms() - t0 < 140);
    CHECK_EQ_INT(stella_pool_destroy(NULL), STELLA_OK);
    TEST_MAIN_END();
}
