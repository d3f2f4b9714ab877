/* pool.c - pinned pthread worker pool running batches of optimizer tasks
 * (stella_pool.h). No global state: everything lives in the pool object.
 * Shared counters use GCC __atomic builtins (ThreadSanitizer understands them);
 * everything else is read or written under the pool mutex. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "stella_pool.h"
#include "optim_internal.h"
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int64_t task;
    int64_t c0, c1;     /* coordinates */
    int64_t e0, e1;     /* list entries */
    int32_t first, last;
} chunk;

typedef struct {
    stella_pool *pool;
    pthread_t th;
    int32_t core;
    int32_t tid;
} worker;

struct stella_pool {
    int32_t n;
    worker *w;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv, start_cv, valid_cv;
    int stop;               /* atomic */
    uint64_t gen;           /* batch generation, under mu */
    int32_t started;        /* under mu */
    int32_t active;         /* workers inside a batch, under mu */
    int in_flight;          /* under mu */
    /* the batch (written by submit while no worker is active, read by workers after they claim) */
    stella_pool_task *tasks;
    int64_t ntasks, tasks_cap;
    chunk *chunks;
    int64_t nchunks, chunks_cap;
    int32_t *status;        /* per task, atomic (first error wins) */
    int64_t next;           /* atomic claim counter over [0, 2*nchunks): validate, then apply */
    int64_t finished;       /* atomic */
    int64_t validated;      /* under mu */
    int invalid;            /* atomic */
};

static void set_status(stella_pool *P, int64_t task, int rc) {
    int32_t zero = 0;
    if (rc) __atomic_compare_exchange_n(&P->status[task], &zero, rc, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static int entries_op(int op) { return op == STELLA_TASK_APPLY || op == STELLA_TASK_APPLY_CATCH_UP; }

static void validate_chunk(stella_pool *P, const chunk *ch) {
    const stella_pool_task *t = &P->tasks[ch->task];
    if (!entries_op(t->op)) return;
    int rc = stella_optim_validate_entries(&t->hp, &t->tensor, t->idx, ch->e0, ch->e1, t->step, ch->c0, ch->c1);
    /* the entries just outside the task's range must lie outside it */
    if (!rc && ch->first && ch->e0 > 0 && (int64_t)t->idx[ch->e0 - 1] >= t->lo) rc = STELLA_ERR_MALFORMED;
    if (!rc && ch->last && ch->e1 < t->k && (int64_t)t->idx[ch->e1] < t->hi) rc = STELLA_ERR_MALFORMED;
    if (rc) {
        set_status(P, ch->task, rc);
        __atomic_store_n(&P->invalid, 1, __ATOMIC_RELEASE);
    }
}

static void apply_chunk(stella_pool *P, const chunk *ch) {
    const stella_pool_task *t = &P->tasks[ch->task];
    int rc = STELLA_OK;
    switch (t->op) {
    case STELLA_TASK_APPLY:
        stella_optim_apply_unchecked(&t->hp, &t->tensor, t->idx, t->val, ch->e0, ch->e1, t->step);
        break;
    case STELLA_TASK_APPLY_CATCH_UP:
        stella_optim_apply_unchecked(&t->hp, &t->tensor, t->idx, t->val, ch->e0, ch->e1, t->step);
        rc = stella_optim_catch_up(&t->hp, &t->tensor, ch->c0, ch->c1, t->step);
        break;
    case STELLA_TASK_CATCH_UP:
        rc = stella_optim_catch_up(&t->hp, &t->tensor, ch->c0, ch->c1, t->step);
        break;
    case STELLA_TASK_SLEEP: {
        struct timespec ts = { (time_t)(t->step / 1000000), (long)(t->step % 1000000) * 1000L };
        while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
        break;
    }
    default:
        rc = STELLA_ERR_ARG;
    }
    set_status(P, ch->task, rc);
}

static void run_batch(stella_pool *P) {
    for (;;) {
        if (__atomic_load_n(&P->stop, __ATOMIC_ACQUIRE)) return;
        int64_t x = __atomic_fetch_add(&P->next, 1, __ATOMIC_ACQ_REL);
        int64_t nch = P->nchunks;
        if (x >= 2 * nch) return;
        if (x < nch) {
            validate_chunk(P, &P->chunks[x]);
            pthread_mutex_lock(&P->mu);
            if (++P->validated == nch) pthread_cond_broadcast(&P->valid_cv);
            pthread_mutex_unlock(&P->mu);
        } else {
            pthread_mutex_lock(&P->mu);
            while (P->validated < nch && !__atomic_load_n(&P->stop, __ATOMIC_ACQUIRE))
                pthread_cond_wait(&P->valid_cv, &P->mu);
            pthread_mutex_unlock(&P->mu);
            if (__atomic_load_n(&P->stop, __ATOMIC_ACQUIRE)) return;
            if (!__atomic_load_n(&P->invalid, __ATOMIC_ACQUIRE)) apply_chunk(P, &P->chunks[x - nch]);
        }
        __atomic_fetch_add(&P->finished, 1, __ATOMIC_ACQ_REL);
    }
}

static void *worker_main(void *arg) {
    worker *w = (worker *)arg;
    stella_pool *P = w->pool;
    pthread_mutex_lock(&P->mu);
    w->tid = (int32_t)syscall(SYS_gettid);
    P->started++;
    pthread_cond_broadcast(&P->start_cv);
    uint64_t seen = P->gen;
    for (;;) {
        while (!__atomic_load_n(&P->stop, __ATOMIC_ACQUIRE) && P->gen == seen)
            pthread_cond_wait(&P->work_cv, &P->mu);
        if (__atomic_load_n(&P->stop, __ATOMIC_ACQUIRE)) break;
        seen = P->gen;
        P->active++;
        pthread_mutex_unlock(&P->mu);
        run_batch(P);
        pthread_mutex_lock(&P->mu);
        if (--P->active == 0) pthread_cond_broadcast(&P->done_cv);
    }
    pthread_mutex_unlock(&P->mu);
    return NULL;
}

static void free_pool(stella_pool *P) {
    free(P->w);
    free(P->tasks);
    free(P->chunks);
    free(P->status);
    free(P);
}

int stella_pool_create(const int32_t *cores, int32_t ncores, stella_pool **out) {
    if (!out) return STELLA_ERR_NULL;
    *out = NULL;
    if (!cores) return STELLA_ERR_NULL;
    if (ncores < 1 || ncores > STELLA_POOL_MAX_THREADS) return STELLA_ERR_ARG;
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return STELLA_ERR_SYSTEM;
    for (int32_t i = 0; i < ncores; i++)
        if (cores[i] < 0 || cores[i] >= CPU_SETSIZE || !CPU_ISSET(cores[i], &allowed)) return STELLA_ERR_ARG;

    stella_pool *P = (stella_pool *)calloc(1, sizeof(*P));
    if (!P) return STELLA_ERR_NOMEM;
    P->w = (worker *)calloc((size_t)ncores, sizeof(worker));
    if (!P->w) { free_pool(P); return STELLA_ERR_NOMEM; }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&P->mu, NULL);
    pthread_cond_init(&P->work_cv, NULL);
    pthread_cond_init(&P->done_cv, &ca);
    pthread_cond_init(&P->start_cv, NULL);
    pthread_cond_init(&P->valid_cv, NULL);
    pthread_condattr_destroy(&ca);

    int rc = STELLA_OK;
    int32_t made = 0;
    for (; made < ncores; made++) {
        worker *w = &P->w[made];
        w->pool = P;
        w->core = cores[made];
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cores[made], &one);
        int e = pthread_attr_setaffinity_np(&attr, sizeof(one), &one);
        if (!e) e = pthread_create(&w->th, &attr, worker_main, w);
        pthread_attr_destroy(&attr);
        if (e) { rc = STELLA_ERR_SYSTEM; break; }
    }
    P->n = made;
    pthread_mutex_lock(&P->mu);
    while (P->started < made) pthread_cond_wait(&P->start_cv, &P->mu);
    pthread_mutex_unlock(&P->mu);
    if (rc) {
        stella_pool_destroy(P);
        return rc;
    }
    *out = P;
    return STELLA_OK;
}

int stella_pool_destroy(stella_pool *P) {
    if (!P) return STELLA_OK;
    pthread_mutex_lock(&P->mu);
    __atomic_store_n(&P->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&P->work_cv);
    pthread_cond_broadcast(&P->valid_cv);
    pthread_mutex_unlock(&P->mu);
    for (int32_t i = 0; i < P->n; i++) pthread_join(P->w[i].th, NULL);
    pthread_mutex_destroy(&P->mu);
    pthread_cond_destroy(&P->work_cv);
    pthread_cond_destroy(&P->done_cv);
    pthread_cond_destroy(&P->start_cv);
    pthread_cond_destroy(&P->valid_cv);
    free_pool(P);
    return STELLA_OK;
}

int stella_pool_size(const stella_pool *P, int32_t *nthreads) {
    if (!P || !nthreads) return STELLA_ERR_NULL;
    *nthreads = P->n;
    return STELLA_OK;
}

int stella_pool_threads(const stella_pool *P, int32_t *tids, int32_t *cores, int32_t cap) {
    if (!P) return STELLA_ERR_NULL;
    if (cap < P->n) return STELLA_ERR_SIZE;
    for (int32_t i = 0; i < P->n; i++) {
        if (tids) tids[i] = P->w[i].tid;  /* written before create returned */
        if (cores) cores[i] = P->w[i].core;
    }
    return STELLA_OK;
}

/* ---------------------------------------------------------------- batches */

static int push_chunk(stella_pool *P, chunk c) {
    if (P->nchunks == P->chunks_cap) {
        int64_t cap = P->chunks_cap ? 2 * P->chunks_cap : 64;
        chunk *nc = (chunk *)realloc(P->chunks, (size_t)cap * sizeof(chunk));
        if (!nc) return STELLA_ERR_NOMEM;
        P->chunks = nc;
        P->chunks_cap = cap;
    }
    P->chunks[P->nchunks++] = c;
    return STELLA_OK;
}

static int64_t lb(const uint32_t *idx, int64_t lo, int64_t hi, int64_t coord) {
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if ((int64_t)idx[mid] < coord) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static int check_task(const stella_pool_task *t) {
    if (t->reserved != 0) return STELLA_ERR_ARG;
    if (t->op == STELLA_TASK_SLEEP) return (t->step >= 0 && t->step <= 60000000) ? STELLA_OK : STELLA_ERR_ARG;
    if (t->op < STELLA_TASK_APPLY || t->op > STELLA_TASK_APPLY_CATCH_UP) return STELLA_ERR_ARG;
    int rc = stella_optim_check(&t->hp, &t->tensor);
    if (rc) return rc;
    if (t->lo < 0 || t->hi < t->lo || t->hi > t->tensor.n) return STELLA_ERR_ARG;
    if (t->step < (t->op == STELLA_TASK_CATCH_UP ? 0 : 1) || t->step > STELLA_OPTIM_MAX_STEP) return STELLA_ERR_ARG;
    if (entries_op(t->op)) {
        if (t->k < 0) return STELLA_ERR_ARG;
        if (t->k > 0 && (!t->idx || !t->val)) return STELLA_ERR_NULL;
    }
    return STELLA_OK;
}

/* Split task i into chunks of whole 16-float blocks. */
static int split_task(stella_pool *P, int64_t i, int64_t grain) {
    const stella_pool_task *t = &P->tasks[i];
    chunk c = { i, t->lo, t->hi, 0, 0, 1, 1 };
    if (t->op == STELLA_TASK_SLEEP || t->hi == t->lo) {
        if (t->op != STELLA_TASK_SLEEP && !entries_op(t->op)) return STELLA_OK;
        if (t->op != STELLA_TASK_SLEEP) { /* empty range: still check the list holds nothing in it */
            c.e0 = t->lo == 0 ? 0 : lb(t->idx, 0, t->k, t->lo);
            c.e1 = c.e0;
        }
        return push_chunk(P, c);
    }
    int64_t e_lo = 0, e_hi = 0;
    if (entries_op(t->op)) {
        e_lo = t->lo == 0 ? 0 : lb(t->idx, 0, t->k, t->lo);
        e_hi = t->hi == t->tensor.n ? t->k : lb(t->idx, e_lo, t->k, t->hi);
        if (e_hi < e_lo) e_hi = e_lo;
    }
    int64_t ncoord = t->hi - t->lo, nent = e_hi - e_lo, nch;
    int by_entries = t->op == STELLA_TASK_APPLY;
    if (by_entries) nch = (nent + grain - 1) / grain;
    else nch = (ncoord + grain * 16 - 1) / (grain * 16);
    if (nch > (ncoord + 15) / 16) nch = (ncoord + 15) / 16;
    if (nch < 1) nch = 1;
    int64_t pc = t->lo, pe = e_lo;
    for (int64_t j = 1; j <= nch; j++) {
        int64_t cb, eb;
        if (j == nch) { cb = t->hi; eb = e_hi; }
        else {
            if (by_entries) cb = (int64_t)t->idx[e_lo + nent * j / nch];
            else cb = t->lo + ncoord * j / nch;
            cb &= ~(int64_t)15;
            if (cb < pc) cb = pc;
            if (cb > t->hi) cb = t->hi;
            eb = entries_op(t->op) ? lb(t->idx, pe, e_hi, cb) : 0;
            if (eb < pe) eb = pe;
        }
        if (cb == pc && eb == pe && j != nch) continue;
        chunk ch = { i, pc, cb, pe, eb, pc == t->lo, j == nch };
        int rc = push_chunk(P, ch);
        if (rc) return rc;
        pc = cb;
        pe = eb;
    }
    return STELLA_OK;
}

int stella_pool_submit(stella_pool *P, const stella_pool_task *tasks, int64_t ntasks, int64_t grain) {
    if (!P) return STELLA_ERR_NULL;
    if (ntasks < 0) return STELLA_ERR_ARG;
    if (ntasks > 0 && !tasks) return STELLA_ERR_NULL;
    if (grain <= 0) grain = STELLA_POOL_DEFAULT_GRAIN;
    if (grain > ((int64_t)1 << 40)) return STELLA_ERR_ARG;
    for (int64_t i = 0; i < ntasks; i++) {
        int rc = check_task(&tasks[i]);
        if (rc) return rc;
    }
    pthread_mutex_lock(&P->mu);
    if (P->in_flight) { pthread_mutex_unlock(&P->mu); return STELLA_ERR_BUSY; }
    /* stragglers of the last batch are leaving: they touch no chunk any more */
    while (P->active > 0) pthread_cond_wait(&P->done_cv, &P->mu);
    if (ntasks > P->tasks_cap) {
        stella_pool_task *nt = (stella_pool_task *)malloc((size_t)ntasks * sizeof(*nt));
        int32_t *ns = (int32_t *)malloc((size_t)ntasks * sizeof(int32_t));
        if (!nt || !ns) { free(nt); free(ns); pthread_mutex_unlock(&P->mu); return STELLA_ERR_NOMEM; }
        free(P->tasks); free(P->status);
        P->tasks = nt; P->status = ns; P->tasks_cap = ntasks;
    }
    if (ntasks) {
        memcpy(P->tasks, tasks, (size_t)ntasks * sizeof(*tasks));
        memset(P->status, 0, (size_t)ntasks * sizeof(int32_t));
    }
    P->ntasks = ntasks;
    P->nchunks = 0;
    for (int64_t i = 0; i < ntasks; i++) {
        int rc = split_task(P, i, grain);
        if (rc) { P->nchunks = 0; P->ntasks = 0; pthread_mutex_unlock(&P->mu); return rc; }
    }
    if (P->nchunks == 0) { pthread_mutex_unlock(&P->mu); return STELLA_OK; }
    P->validated = 0;
    __atomic_store_n(&P->invalid, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&P->finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&P->next, 0, __ATOMIC_RELEASE);
    P->in_flight = 1;
    P->gen++;
    pthread_cond_broadcast(&P->work_cv);
    pthread_mutex_unlock(&P->mu);
    return STELLA_OK;
}

static int done_locked(stella_pool *P) {
    return __atomic_load_n(&P->finished, __ATOMIC_ACQUIRE) >= 2 * P->nchunks && P->active == 0;
}

int stella_pool_wait(stella_pool *P, int64_t timeout_ms, int32_t *task_status, int64_t ntasks) {
    if (!P) return STELLA_ERR_NULL;
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    if (timeout_ms >= 0) {
        if (timeout_ms > (int64_t)1 << 40) timeout_ms = (int64_t)1 << 40;
        dl.tv_sec += (time_t)(timeout_ms / 1000);
        dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
    }
    pthread_mutex_lock(&P->mu);
    if (!P->in_flight) { pthread_mutex_unlock(&P->mu); return STELLA_OK; }
    while (!done_locked(P)) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&P->done_cv, &P->mu);
        } else if (pthread_cond_timedwait(&P->done_cv, &P->mu, &dl) == ETIMEDOUT && !done_locked(P)) {
            pthread_mutex_unlock(&P->mu);
            return STELLA_ERR_TIMEOUT;
        }
    }
    P->in_flight = 0;
    int rc = STELLA_OK;
    for (int64_t i = 0; i < P->ntasks; i++) {
        int32_t s = __atomic_load_n(&P->status[i], __ATOMIC_ACQUIRE);
        if (!rc && s) rc = s;
        if (task_status && i < ntasks) task_status[i] = s;
    }
    pthread_mutex_unlock(&P->mu);
    return rc;
}

int stella_pool_run(stella_pool *P, const stella_pool_task *tasks, int64_t ntasks, int64_t grain,
                    int64_t timeout_ms, int32_t *task_status) {
    int rc = stella_pool_submit(P, tasks, ntasks, grain);
    if (rc) return rc;
    rc = stella_pool_wait(P, timeout_ms, task_status, ntasks);
    return rc;
}
