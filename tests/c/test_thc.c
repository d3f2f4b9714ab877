/* test_thc.c - the THC kernels under the sanitizers: quantize, add the words of up to 16
 * clusters as integers and unpack; the decoded sum equals the sum of what each cluster sent
 * (exactly, level by level); rotation round trips; sizes around the lane and block edges;
 * every argument check, with buffers sized exactly so that an overrun is caught. */
#include "check.h"
#include "stella_thc.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint32_t g_rng = 12345u;
static float uniform(float lo, float hi) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(g_rng >> 8) / 16777216.0f;
}

/* Scale blocks of 2^5 entries with scales 3, 6, 9, 3, ... (the last block shorter): each
 * cluster's entries lie within their block's scale, the last entry of every block at it. */
enum { SUM_SCALE_LOG2 = 5 };
static float block_scale(int64_t b) { return 3.0f * (float)(1 + b % 3); }

static void test_sum_of_clusters(int bits, int nclusters, int64_t n) {
    int lane;
    int64_t nw, ns;
    CHECK_EQ_INT(stella_thc_lane_bits(bits, nclusters, &lane), STELLA_OK);
    CHECK_EQ_INT(stella_thc_words(n, lane, &nw), STELLA_OK);
    CHECK_EQ_INT(stella_thc_scale_count(n, SUM_SCALE_LOG2, &ns), STELLA_OK);
    uint64_t *sum = calloc((size_t)(nw ? nw : 1), 8), *w = malloc((size_t)(nw ? nw : 1) * 8);
    float *x = malloc((size_t)(n ? n : 1) * 4), *sent = calloc((size_t)(n ? n : 1), 4);
    float *out = malloc((size_t)(n ? n : 1) * 4), *scales = malloc((size_t)(ns ? ns : 1) * 4);
    float *maxes = malloc((size_t)(ns ? ns : 1) * 4);
    for (int64_t b = 0; b < ns; b++) scales[b] = block_scale(b);
    const int L = (1 << (bits - 1)) - 1;
    for (int c = 0; c < nclusters; c++) {
        for (int64_t i = 0; i < n; i++) {
            float sc = block_scale(i >> SUM_SCALE_LOG2);
            /* every cluster at the top level at each block's last entry: the largest lane sum */
            x[i] = ((i + 1) % 32 == 0 || i == n - 1) ? sc : uniform(-sc, sc);
        }
        int64_t nonfinite = -1;
        CHECK_EQ_INT(stella_thc_absmax(x, n, SUM_SCALE_LOG2, maxes, ns, &nonfinite), STELLA_OK);
        CHECK_EQ_INT((int)nonfinite, 0);
        for (int64_t b = 0; b < ns; b++) CHECK(maxes[b] == scales[b]);
        CHECK_EQ_INT(stella_thc_quantize(x, n, bits, scales, ns, SUM_SCALE_LOG2, 1, 77u + (uint64_t)c, lane, w, nw),
                     STELLA_OK);
        for (int64_t i = 0; i < n; i++) /* the level, exactly */
            sent[i] += x[i] * (float)L / block_scale(i >> SUM_SCALE_LOG2);
        for (int64_t k = 0; k < nw; k++) sum[k] += w[k];
    }
    CHECK_EQ_INT(stella_thc_unpack_sum(sum, nw, n, bits, nclusters, lane, scales, ns, SUM_SCALE_LOG2, out), STELLA_OK);
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (fabsf(out[i] * (float)L / block_scale(i >> SUM_SCALE_LOG2) - sent[i]) > 1e-3f) bad++;
    CHECK_EQ_INT(bad, 0);
    if (n) {
        float sc = block_scale((n - 1) >> SUM_SCALE_LOG2);
        CHECK(fabsf(out[n - 1] - sc * (float)nclusters) <= 1e-4f * sc * (float)nclusters);
    }
    free(sum); free(w); free(x); free(sent); free(out); free(scales); free(maxes);
}

static void test_rotation_round_trip(void) {
    const int64_t sizes[] = {0, 1, 2, 63, 64, 65, 1024, 1025, 5000};
    for (int m = 1; m <= 12; m++)
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
            int64_t n = sizes[s];
            float *x = malloc((size_t)(n ? n : 1) * 4), *y = malloc((size_t)(n ? n : 1) * 4);
            for (int64_t i = 0; i < n; i++) x[i] = y[i] = uniform(-1.0f, 1.0f);
            CHECK_EQ_INT(stella_thc_rotate(y, n, m, 0xfeedu, 0), STELLA_OK);
            CHECK_EQ_INT(stella_thc_rotate(y, n, m, 0xfeedu, 1), STELLA_OK);
            int bad = 0;
            for (int64_t i = 0; i < n; i++)
                if (fabsf(x[i] - y[i]) > 1e-5f) bad++;
            CHECK_EQ_INT(bad, 0);
            free(x); free(y);
        }
}

static void test_argument_checks(void) {
    float x[4] = {0.5f, -0.5f, 0.25f, 0.0f}, out[4];
    uint64_t w[1];
    int lane;
    int64_t nw;
    float m;
    int64_t bad;
    CHECK_EQ_INT(stella_thc_lane_bits(4, 2, NULL), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_thc_lane_bits(1, 2, &lane), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_lane_bits(4, STELLA_THC_MAX_CLUSTERS + 1, &lane), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_words(-1, 5, &nw), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_rotate(x, 4, 0, 1u, 0), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_rotate(x, 4, STELLA_THC_MAX_BLOCK_LOG2 + 1, 1u, 0), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_rotate(NULL, 4, 2, 1u, 0), STELLA_ERR_NULL);
    const int one = STELLA_THC_ONE_SCALE;
    const float s1 = 1.0f, snan = NAN, sinf = INFINITY, sneg = -1.0f;
    CHECK_EQ_INT(stella_thc_scale_count(4, -1, &nw), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_scale_count(4, STELLA_THC_ONE_SCALE + 1, &nw), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_scale_count(5, 1, &nw), STELLA_OK);
    CHECK_EQ_INT((int)nw, 3);
    CHECK_EQ_INT(stella_thc_scale_count(0, 1, &nw), STELLA_OK);
    CHECK_EQ_INT((int)nw, 0);
    CHECK_EQ_INT(stella_thc_absmax(x, 4, one, &m, 1, NULL), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_thc_absmax(x, 4, one, &m, 2, &bad), STELLA_ERR_SIZE); /* count must match */
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &s1, 1, one, 1, 1u, 5, w, 0), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &s1, 1, one, 1, 1u, 5, NULL, 1), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &snan, 1, one, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &sinf, 1, one, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &sneg, 1, one, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &s1, 2, one, 1, 1u, 5, w, 1), STELLA_ERR_SIZE); /* scale count */
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, NULL, 1, one, 1, 1u, 5, w, 1), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 8, &s1, 1, one, 1, 1u, 5, w, 1), STELLA_ERR_ARG); /* lane < one level */
    const float two_bad[2] = {1.0f, NAN}; /* a bad scale in the second block of 2 */
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, two_bad, 2, 1, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK(x[0] == 0.5f); /* nothing written */
    x[2] = NAN;
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &s1, 1, one, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK(x[0] == 0.5f); /* nothing written */
    CHECK_EQ_INT(stella_thc_absmax(x, 4, one, &m, 1, &bad), STELLA_OK);
    CHECK(m == 0.5f);
    CHECK_EQ_INT(bad, 1);
    float pair[2];
    CHECK_EQ_INT(stella_thc_absmax(x, 4, 1, pair, 2, &bad), STELLA_OK); /* blocks {0.5, -0.5}, {NaN, 0} */
    CHECK(pair[0] == 0.5f && pair[1] == 0.0f);
    CHECK_EQ_INT(bad, 1);
    x[2] = 0.25f;
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, &s1, 1, one, 1, 1u, 5, w, 1), STELLA_OK);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 1, 4, 4, 1, 5, &s1, 1, one, out), STELLA_OK);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 2, 4, 4, 1, 5, &s1, 1, one, out), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 1, 4, 4, 1, 5, &s1, 2, one, out), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 1, 4, 4, 1, 5, &snan, 1, one, out), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 1, 4, 4, 16, 5, &s1, 1, one, out), STELLA_ERR_ARG);
    uint64_t stray = w[0] | (1ull << 63);
    CHECK_EQ_INT(stella_thc_unpack_sum(&stray, 1, 4, 4, 1, 5, &s1, 1, one, out), STELLA_ERR_MALFORMED);
    uint64_t high = (w[0] & ~31ull) | 15ull; /* lane 0 = 15 > 2 L = 14 */
    CHECK_EQ_INT(stella_thc_unpack_sum(&high, 1, 4, 4, 1, 5, &s1, 1, one, out), STELLA_ERR_MALFORMED);
    CHECK_EQ_INT(stella_thc_quantize(NULL, 0, 4, NULL, 0, one, 1, 1u, 5, NULL, 0), STELLA_OK); /* empty */
    CHECK_EQ_INT(stella_thc_unpack_sum(NULL, 0, 0, 4, 1, 5, NULL, 0, one, NULL), STELLA_OK);
    CHECK_EQ_INT(stella_thc_absmax(NULL, 0, one, NULL, 0, &bad), STELLA_OK);
}

int main(void) {
    const int bits[] = {2, 4, 8};
    const int64_t sizes[] = {0, 1, 2, 11, 12, 13, 21, 64, 1000, 32768, 65537};
    for (int b = 0; b < 3; b++)
        for (int c = 1; c <= 16; c++)
            for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
                if (sizes[s] < 10000 || c == 2 || c == 16) test_sum_of_clusters(bits[b], c, sizes[s]);
    test_rotation_round_trip();
    test_argument_checks();
    TEST_MAIN_END();
}
