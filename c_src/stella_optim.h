/* stella_optim.h - sparse optimizer kernels: SGD and Adam/AdamW applied to a
 * sorted sparse gradient (uint32 index strictly ascending, float32 value) on a
 * dense float32 parameter and its dense float32 state.
 *
 * The update rules are those of torch.optim.SGD / Adam / AdamW (single-tensor
 * path), operation for operation in float32, with the per-step scalars
 * (bias corrections) computed in double like torch does.
 *
 * Step numbers are 1-based: applying "step t" is the t-th optimizer step of
 * the tensor. Two semantics (stella_optim_hparams.mode):
 *
 * LAZY  (like TensorFlow's LazyAdam): at step t every coordinate in the list
 *       takes one step of the rule with its gradient; every other coordinate
 *       is left exactly as it is (no momentum decay, no weight decay, no moment
 *       decay). Adam's bias corrections use the global step t; SGD's momentum
 *       buffer is initialised to the gradient at t == 1 (like torch's first
 *       step) and updated with dampening afterwards. `last` is not used.
 *
 * EXACT the result equals the dense torch optimizer fed, at every step, the
 *       dense gradient that is the list's value at listed coordinates and 0
 *       elsewhere. `last[i]` (int32) is the step coordinate i is current at:
 *       param and state of i equal the dense optimizer's after step last[i].
 *       Applying step t to a listed coordinate first replays steps
 *       last[i]+1 .. t-1 with gradient 0 (catch-up), then step t with its
 *       value, and sets last[i] = t. Unlisted coordinates are not touched:
 *       they lag until stella_optim_catch_up brings them to a step. So a caller
 *       must catch a range up before reading its parameters (or use the pool's
 *       APPLY_CATCH_UP, which leaves every coordinate of the range current).
 *       Catch-up assumes the hyper-parameters were the same for every replayed
 *       step: catch everything up before changing lr (or anything else).
 *       Fresh state is all zeros with last[] = 0.
 *
 * Catch-up of k zero-gradient steps (s = last[i], k = t - s; torch's rule with
 * grad 0; "first" is global step 1, where torch sets buf = grad):
 *   SGD, momentum 0:           p *= (1 - lr*wd)^k                    (closed form)
 *   SGD, momentum mu, wd 0:    buf_j = mu^j buf, p -= lr*G*buf with
 *                              G = sum_{j=1..k} mu^j (nesterov: mu*G)   (closed form)
 *   SGD, momentum and wd:      (p, buf) follows a linear 2x2 recurrence;
 *                              M^k by repeated squaring in double      (closed form, O(log k))
 *   Adam/AdamW, m == 0, eps>0, no coupled wd: m stays 0, v *= beta2^k,
 *                              AdamW p *= (1 - lr*wd)^k                (closed form)
 *   Adam/AdamW otherwise:      no closed form (eps inside the denominator,
 *                              and coupled weight decay feeds p back into m, v):
 *                              a per-step loop of exactly k iterations. amsgrad's
 *                              max is carried through the loop (v only decays,
 *                              so it never exceeds the max, but it is kept exact).
 *   Short gaps (k <= 16) always use the per-step loop, which repeats torch's
 *   float operations exactly; closed forms are computed in double.
 *
 * Errors (nothing is written when an apply is refused): STELLA_ERR_MALFORMED
 * for an index >= n or a list that is not strictly ascending; STELLA_ERR_ARG
 * for bad hyper-parameters, steps, ranges, or (EXACT) a listed coordinate whose
 * last[] is not in [0, t-1].
 */
#ifndef STELLA_OPTIM_H
#define STELLA_OPTIM_H
#include "stella_common.h"

enum stella_optim_kind {
    STELLA_OPTIM_SGD = 0,
    STELLA_OPTIM_ADAM = 1,      /* weight decay added to the gradient (torch.optim.Adam) */
    STELLA_OPTIM_ADAMW = 2      /* decoupled weight decay p *= 1 - lr*wd (torch.optim.AdamW) */
};

enum stella_optim_mode {
    STELLA_OPTIM_LAZY = 0,
    STELLA_OPTIM_EXACT = 1
};

enum stella_optim_flags {
    STELLA_OPTIM_NESTEROV = 1,  /* SGD: needs momentum > 0 and dampening == 0 */
    STELLA_OPTIM_MAXIMIZE = 2,
    STELLA_OPTIM_AMSGRAD = 4    /* Adam/AdamW: needs buf3 */
};

enum stella_optim_limits {
    STELLA_OPTIM_MAX_STEP = 2147483647
};

typedef struct {
    int32_t kind;           /* enum stella_optim_kind */
    int32_t mode;           /* enum stella_optim_mode */
    int32_t flags;          /* enum stella_optim_flags, or-ed */
    int32_t reserved;       /* 0 */
    double lr;              /* >= 0 */
    double weight_decay;    /* >= 0 */
    double momentum;        /* SGD: >= 0 */
    double dampening;       /* SGD: in [0, 1] */
    double beta1;           /* Adam: in [0, 1) */
    double beta2;           /* Adam: in [0, 1) */
    double eps;             /* Adam: >= 0 */
} stella_optim_hparams;

/* One dense parameter of n float32 and its state, all of n elements.
 * SGD: buf1 = momentum buffer (needed when momentum != 0), buf2/buf3 unused.
 * Adam/AdamW: buf1 = exp_avg, buf2 = exp_avg_sq, buf3 = max_exp_avg_sq (amsgrad).
 * last: EXACT only (NULL allowed for LAZY). */
typedef struct {
    float *param;
    float *buf1;
    float *buf2;
    float *buf3;
    int32_t *last;
    int64_t n;
} stella_optim_tensor;

/* Validate hyper-parameters and that the tensor has the buffers they need. */
int stella_optim_check(const stella_optim_hparams *hp, const stella_optim_tensor *t);

/* Step `step` on entries idx[lo..hi) / val[lo..hi) of a list of k entries
 * (0 <= lo <= hi <= k). The entries are validated (ascending, < n, EXACT:
 * 0 <= last[idx] < step) before anything is written. val may hold NaN/Inf:
 * they propagate as in torch. */
int stella_optim_apply(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                       const uint32_t *idx, const float *val, int64_t k, int64_t lo, int64_t hi,
                       int64_t step);

/* The checks stella_optim_apply makes on a whole list of k entries, without
 * writing anything (to refuse a multi-tensor step before any tensor changes). */
int stella_optim_validate(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                          const uint32_t *idx, int64_t k, int64_t step);

/* EXACT: bring every coordinate c in [c0, c1) with last[c] < step to step
 * (zero-gradient steps), last[c] = step. Coordinates already at step are left
 * alone; one with last[c] > step (or < 0) is left alone too and makes the call
 * return STELLA_ERR_ARG after the others are done (each coordinate's state is
 * valid on its own). LAZY: does nothing and returns STELLA_OK. */
int stella_optim_catch_up(const stella_optim_hparams *hp, const stella_optim_tensor *t,
                          int64_t c0, int64_t c1, int64_t step);

/* First position in idx[0..k) whose value is >= coord (idx ascending): the
 * entry range of a coordinate range is [lower_bound(c0), lower_bound(c1)). */
int stella_optim_lower_bound(const uint32_t *idx, int64_t k, int64_t coord, int64_t *pos);

#endif
