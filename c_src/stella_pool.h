/* stella_pool.h - a pthread worker pool pinned to given cores, running batches
 * of sparse-optimizer tasks (stella_optim.h).
 *
 * Each worker thread is created pinned to one core of the list given to
 * stella_pool_create (every core must be in the calling thread's allowed set,
 * sched_getaffinity; a core may be listed twice). A batch is an array of tasks;
 * the pool splits every task's coordinate range into chunks of whole 16-float
 * blocks (about `grain` list entries per chunk for APPLY, `grain` * 16
 * coordinates for the catch-up ops) and the workers take chunks from all tasks
 * of the batch in order, so work is split inside a tensor and across tensors.
 *
 * A batch runs in two phases: every chunk's list entries are validated first
 * (ascending, in range, EXACT last[] < step), and only if the whole batch is
 * valid is anything written: a malformed list changes no tensor of the batch.
 * Tasks of one batch must not overlap (two tasks writing one coordinate).
 *
 * stella_pool_submit returns at once; the caller's hyper-parameters, tensors
 * and lists must stay alive and untouched until stella_pool_wait returns
 * something other than STELLA_ERR_TIMEOUT (the task array itself is copied).
 * One batch at a time: submit while one is in flight is STELLA_ERR_BUSY.
 * The pool holds no global state; one pool must be driven by one thread at a
 * time (submit/wait/destroy are not meant to race each other).
 */
#ifndef STELLA_POOL_H
#define STELLA_POOL_H
#include "stella_common.h"
#include "stella_optim.h"

typedef struct stella_pool stella_pool;

enum stella_task_op {
    STELLA_TASK_APPLY = 0,          /* stella_optim_apply on the entries whose index is in [lo, hi) */
    STELLA_TASK_CATCH_UP = 1,       /* stella_optim_catch_up on [lo, hi) */
    STELLA_TASK_APPLY_CATCH_UP = 2, /* both: for EXACT every coordinate of [lo, hi) is at `step` after */
    STELLA_TASK_SLEEP = 3           /* test aid: each chunk sleeps `step` microseconds (lo/hi as for catch-up) */
};

enum stella_pool_limits {
    STELLA_POOL_MAX_THREADS = 1024,
    STELLA_POOL_DEFAULT_GRAIN = 16384
};

typedef struct {
    int32_t op;                 /* enum stella_task_op */
    int32_t reserved;           /* 0 */
    stella_optim_hparams hp;
    stella_optim_tensor tensor;
    const uint32_t *idx;        /* the step's sorted list (APPLY ops), k entries */
    const float *val;
    int64_t k;
    int64_t lo, hi;             /* coordinate range, 0 <= lo <= hi <= tensor.n */
    int64_t step;               /* optimizer step (1-based); SLEEP: microseconds */
} stella_pool_task;

/* Start one worker per entry of cores[0..ncores), each pinned to its core.
 * STELLA_ERR_ARG if a core is not in the allowed set or ncores is out of
 * [1, STELLA_POOL_MAX_THREADS]; STELLA_ERR_SYSTEM if a thread cannot start. */
int stella_pool_create(const int32_t *cores, int32_t ncores, stella_pool **out);
/* Stop and join the workers (chunks not yet started of a running batch are
 * dropped; chunks running finish first). NULL is accepted. */
int stella_pool_destroy(stella_pool *pool);
int stella_pool_size(const stella_pool *pool, int32_t *nthreads);
/* Kernel thread ids (gettid) and cores of the workers, cap >= nthreads. */
int stella_pool_threads(const stella_pool *pool, int32_t *tids, int32_t *cores, int32_t cap);

/* Queue a batch. grain <= 0 picks STELLA_POOL_DEFAULT_GRAIN. Arguments are
 * checked here (nothing is queued on error). */
int stella_pool_submit(stella_pool *pool, const stella_pool_task *tasks, int64_t ntasks, int64_t grain);
/* Wait up to timeout_ms (< 0: no deadline) for the batch. STELLA_ERR_TIMEOUT if
 * it is still running (call again later); otherwise the batch is over and the
 * result is returned: STELLA_OK, or the error of the first failing task, whose
 * per-task codes go to task_status[0..ntasks) when it is not NULL. Waiting
 * with no batch returns STELLA_OK. */
int stella_pool_wait(stella_pool *pool, int64_t timeout_ms, int32_t *task_status, int64_t ntasks);
/* submit + wait. */
int stella_pool_run(stella_pool *pool, const stella_pool_task *tasks, int64_t ntasks, int64_t grain,
                    int64_t timeout_ms, int32_t *task_status);

#endif
