/* merge.c - k-way merge of sorted sparse lists, and scatter-add.
 *
 * The merge walks the index space in ascending windows of WIN indices. For
 * each window it takes, list after list (list 0 first), the run of entries
 * that fall in the window and adds them into a window-sized accumulator
 * (direct addressing: offset = index - window start; no hashing), then emits
 * the marked offsets in ascending order and resets them. The next window
 * starts at the smallest head of the remaining lists, so empty stretches of
 * the index space cost nothing. Every list is read once, front to back; the
 * output is ascending; a value present in several lists is summed in list
 * order ((-0.0 + v0) + v1 + ..., and -0.0 + v == v for every v), the same
 * bits on every rank that merges the same lists in the same order.
 */
#include "compress_internal.h"
#include <stdlib.h>

#define WIN 4096 /* 64 mark words: one summary word covers the window */
#define MAX_LISTS 65536

static int list_ok(const uint32_t *I, int64_t L, int64_t n) {
    if (L == 0) return 1;
    if (L > n) return 0;
    unsigned bad = 0;
    for (int64_t i = 1; i < L; i++) bad |= (unsigned)(I[i] <= I[i - 1]);
    return !bad && (int64_t)I[L - 1] < n;
}

int stella_merge_f32(int64_t w, const uint32_t *const *idx, const float *const *val, const int64_t *lens,
                     int64_t n, uint32_t *out_idx, float *out_val, int64_t cap, int64_t *out_len) {
    if (!out_len) return STELLA_ERR_NULL;
    if (w < 0 || w > MAX_LISTS || n < 0 || n > STELLA_SPARSE_MAX_N || cap < 0) return STELLA_ERR_ARG;
    if (w > 0 && (!idx || !val || !lens)) return STELLA_ERR_NULL;
    int64_t total = 0;
    for (int64_t j = 0; j < w; j++) {
        if (lens[j] < 0) return STELLA_ERR_ARG;
        if (lens[j] > 0 && (!idx[j] || !val[j])) return STELLA_ERR_NULL;
        total += lens[j] < n ? lens[j] : n; /* capped: a longer list is rejected below */
    }
    if (total > 0 && cap > 0 && (!out_idx || !out_val)) return STELLA_ERR_NULL;
    for (int64_t j = 0; j < w; j++)
        if (!list_ok(idx[j], lens[j], n)) return STELLA_ERR_MALFORMED;
    *out_len = 0;
    if (total == 0) return STELLA_OK;
    if (w == 1) {
        if (cap < lens[0]) return STELLA_ERR_SIZE;
        memcpy(out_idx, idx[0], (size_t)lens[0] * sizeof(uint32_t));
        memcpy(out_val, val[0], (size_t)lens[0] * sizeof(float));
        *out_len = lens[0];
        return STELLA_OK;
    }
    int64_t *pos = (int64_t *)calloc((size_t)w, sizeof(int64_t));
    float *acc = (float *)malloc(WIN * sizeof(float));
    uint64_t *mark = (uint64_t *)calloc(WIN / 64, sizeof(uint64_t));
    if (!pos || !acc || !mark) { free(pos); free(acc); free(mark); return STELLA_ERR_NOMEM; }
    for (int i = 0; i < WIN; i++) acc[i] = -0.0f;
    int64_t o = 0;
    int rc = STELLA_OK;
    for (;;) {
        int64_t mn = INT64_MAX;
        for (int64_t j = 0; j < w; j++)
            if (pos[j] < lens[j] && (int64_t)idx[j][pos[j]] < mn) mn = idx[j][pos[j]];
        if (mn == INT64_MAX) break;
        const uint32_t base = (uint32_t)(mn & ~(int64_t)(WIN - 1));
        const uint32_t span = WIN; /* offsets [0, WIN) */
        uint64_t summary = 0; /* bit t: mark word t is not empty */
        for (int64_t j = 0; j < w; j++) {
            const uint32_t *I = idx[j];
            const float *V = val[j];
            int64_t p = pos[j], L = lens[j];
            while (p < L && I[p] - base < span) { /* I[p] >= base: every head is >= mn >= base */
                uint32_t l = I[p] - base;
                acc[l] += V[p];
                mark[l >> 6] |= (uint64_t)1 << (l & 63);
                summary |= (uint64_t)1 << (l >> 6);
                p++;
            }
            pos[j] = p;
        }
        while (summary) {
            uint32_t wd = (uint32_t)__builtin_ctzll(summary);
            summary &= summary - 1;
            uint64_t m = mark[wd];
            mark[wd] = 0;
            while (m) {
                uint32_t l = (uint32_t)(64 * wd + __builtin_ctzll(m));
                m &= m - 1;
                if (o >= cap) { rc = STELLA_ERR_SIZE; goto out; }
                out_idx[o] = base + l;
                out_val[o] = acc[l];
                acc[l] = -0.0f;
                o++;
            }
        }
    }
out:
    free(pos); free(acc); free(mark);
    *out_len = rc ? 0 : o;
    return rc;
}

int stella_scatter_add_f32(float *dense, int64_t n, const uint32_t *idx, const float *val, int64_t k,
                           float scale) {
    if (n < 0 || n > STELLA_SPARSE_MAX_N || k < 0) return STELLA_ERR_ARG;
    if (k > 0 && (!idx || !val || !dense)) return STELLA_ERR_NULL;
    uint32_t mx = 0;
    for (int64_t i = 0; i < k; i++) mx = idx[i] > mx ? idx[i] : mx;
    if (k > 0 && (int64_t)mx >= n) return STELLA_ERR_ARG;
    for (int64_t i = 0; i < k; i++) {
        uint32_t j = idx[i];          /* read once and re-checked: the bound holds even if idx changes */
        if ((int64_t)j >= n) return STELLA_ERR_ARG;
        dense[j] += val[i] * scale;
    }
    return STELLA_OK;
}
