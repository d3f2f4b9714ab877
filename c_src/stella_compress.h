/* stella_compress.h - selection kernels of the sparse (WAN) path: exact top-k,
 * cache-aware block selection, threshold selection and random-k, each with
 * error feedback fused into the pass over the data.
 *
 * Common rules of every selection kernel:
 *   - grad: n float32 (read only). residual: n float32 or NULL.
 *     With a residual (error feedback): acc = grad + residual (one IEEE add per
 *     element), entries are selected from acc, and on return residual = acc
 *     with the sent entries set to +0.0. Bit-exact invariant: for every i,
 *     sent[i] + residual[i] == acc[i], where sent[i] is the value returned for
 *     index i (and 0 if i was not sent). Without a residual acc = grad.
 *   - Magnitude order: |x| compared as the bit pattern of |x|; every NaN ranks
 *     above +Inf (so NaNs are sent and never hide in the residual); ties are
 *     broken by the lower index. Results are identical on every SIMD path.
 *   - Output: idx (uint32, strictly ascending, each < n) and val (float32),
 *     room for cap entries; *out_k receives the number written.
 *   - n <= STELLA_SPARSE_MAX_N, so every index is also a valid int32.
 *   - Arguments are checked before anything is written; on an error return the
 *     residual is untouched (STELLA_ERR_NOMEM during a rare refill leaves
 *     residual = acc and nothing selected, which still satisfies the invariant).
 *   - state (may be NULL) keeps scratch memory and the carried threshold of one
 *     tensor between calls. A state must not be used by two threads at once.
 */
#ifndef STELLA_COMPRESS_H
#define STELLA_COMPRESS_H
#include "stella_common.h"

enum stella_sparse_limits {
    STELLA_BLOCK = 16,                 /* floats per block: one 64-byte cache line */
    STELLA_SPARSE_MAX_N = 2147483647   /* largest tensor the sparse kernels accept */
};

typedef struct stella_sel_state stella_sel_state;

/* What the last call that used a state did (for tests, telemetry and tuning). */
typedef struct {
    int64_t calls;            /* calls made with this state */
    int64_t units;            /* units (elements or blocks) of the last call */
    int64_t wanted;           /* units the last call had to select (minimum) */
    int64_t candidates;       /* units that passed the initial threshold */
    int64_t compactions;      /* on-the-fly trims when too many passed */
    int64_t extra_passes;     /* passes over the data beyond the first (0 in the common case) */
    int64_t selected;         /* units selected */
    int64_t threshold_hits;   /* calls whose carried threshold gave a single pass */
    float threshold_used;     /* threshold the last call started from (-1: none) */
    float threshold_next;     /* threshold carried to the next call (-1: none) */
} stella_sel_stats;

int stella_sel_state_new(stella_sel_state **out);
void stella_sel_state_free(stella_sel_state *st);
/* Forget the carried threshold (scratch memory is kept). */
int stella_sel_state_reset(stella_sel_state *st);
int stella_sel_state_stats(const stella_sel_state *st, stella_sel_stats *out);
/* Override the carried threshold (block score for cache-aware, |x| for top-k);
 * used by tests to force the undershoot and overshoot paths. */
int stella_sel_state_set_threshold(stella_sel_state *st, float threshold);

/* Exact top-k by magnitude: exactly k entries (0 <= k <= n), cap >= k. */
int stella_topk_f32(const float *grad, float *residual, int64_t n, int64_t k,
                    uint32_t *idx, float *val, int64_t cap, int64_t *out_k, stella_sel_state *state);

/* Number of blocks and of entries the cache-aware selection of k entries
 * yields: nblocks = min(ceil(k / 16), ceil(n / 16)); entries = the elements of
 * the nblocks blocks, at most min(n, 16 * nblocks) (less when the short tail
 * block is one of them). *max_entries gets that bound: the cap to provide. */
int stella_block_count(int64_t n, int64_t k, int64_t *nblocks, int64_t *max_entries);

/* Cache-aware block selection (StellaTrain): blocks of 16 consecutive floats
 * (the last one shorter when n % 16 != 0, missing lanes count as 0); a block's
 * score is the sum of |acc| of its entries, added in a fixed pairwise order
 * (lane i + lane i+8, then i + i+4, i + i+2, i + i+1). Selects exactly the
 * ceil(k/16) blocks of highest score (ties: lower block id), all their entries.
 * The threshold carried in state makes this one pass over the data in the
 * common case; it is corrected after every call from the scores seen.
 * cap >= max_entries of stella_block_count. */
int stella_block_topk_f32(const float *grad, float *residual, int64_t n, int64_t k,
                          uint32_t *idx, float *val, int64_t cap, int64_t *out_k, stella_sel_state *state);

/* Threshold selection: the entries with |acc| > threshold (threshold >= 0 or
 * +Inf; NaN entries always pass). If fewer than min_k pass, the largest others
 * are added up to min_k; if more than max_k pass, the max_k largest are kept.
 * min_k == max_k == k gives exactly k (the exact top-k, with the threshold as
 * a hint). 0 <= min_k <= max_k <= n, cap >= max_k. */
int stella_threshold_select_f32(const float *grad, float *residual, int64_t n, float threshold,
                                int64_t min_k, int64_t max_k, uint32_t *idx, float *val,
                                int64_t cap, int64_t *out_k, stella_sel_state *state);

/* Estimate of the k-th largest |grad + residual| from a fixed sample of about
 * 64K entries taken in runs of 64 (residual may be NULL; nothing is written).
 * Exact when n <= the sample size. */
int stella_estimate_threshold_f32(const float *grad, const float *residual, int64_t n, int64_t k,
                                  float *out);

/* Random-k. The key mixes the shared seed, the tensor name (bytes) and the
 * step; the indices are a pure function of (key, n, k): a keyed pseudo-random
 * permutation of [0, n) (integer arithmetic only: identical on every machine),
 * its first k values sorted ascending. */
int stella_randomk_key(uint64_t seed, const char *name, int64_t name_len, int64_t step, uint64_t *key);
int stella_randomk_indices(uint64_t key, int64_t n, int64_t k, uint32_t *idx, int64_t cap);
int stella_randomk_select_f32(const float *grad, float *residual, int64_t n, int64_t k, uint64_t key,
                              uint32_t *idx, float *val, int64_t cap, int64_t *out_k);

#endif
