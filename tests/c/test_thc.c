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

static void test_sum_of_clusters(int bits, int nclusters, int64_t n) {
    int lane;
    int64_t nw;
    CHECK_EQ_INT(stella_thc_lane_bits(bits, nclusters, &lane), STELLA_OK);
    CHECK_EQ_INT(stella_thc_words(n, lane, &nw), STELLA_OK);
    uint64_t *sum = calloc((size_t)(nw ? nw : 1), 8), *w = malloc((size_t)(nw ? nw : 1) * 8);
    float *x = malloc((size_t)(n ? n : 1) * 4), *sent = calloc((size_t)(n ? n : 1), 4);
    float *out = malloc((size_t)(n ? n : 1) * 4);
    const float scale = 3.0f;
    const int L = (1 << (bits - 1)) - 1;
    for (int c = 0; c < nclusters; c++) {
        for (int64_t i = 0; i < n; i++) x[i] = uniform(-scale, scale);
        if (n) x[n - 1] = scale; /* every cluster at the top level: the largest lane sum */
        CHECK_EQ_INT(stella_thc_quantize(x, n, bits, scale, 1, 77u + (uint64_t)c, lane, w, nw), STELLA_OK);
        for (int64_t i = 0; i < n; i++) sent[i] += x[i] * (float)L / scale; /* the level, exactly */
        for (int64_t k = 0; k < nw; k++) sum[k] += w[k];
    }
    CHECK_EQ_INT(stella_thc_unpack_sum(sum, nw, n, bits, nclusters, lane, scale, out), STELLA_OK);
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (fabsf(out[i] * (float)L / scale - sent[i]) > 1e-3f) bad++;
    CHECK_EQ_INT(bad, 0);
    if (n) CHECK(fabsf(out[n - 1] - scale * (float)nclusters) <= 1e-4f * (float)nclusters);
    free(sum); free(w); free(x); free(sent); free(out);
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
    CHECK_EQ_INT(stella_thc_absmax(x, 4, &m, NULL), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, 1.0f, 1, 1u, 5, w, 0), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, 1.0f, 1, 1u, 5, NULL, 1), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, NAN, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, INFINITY, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, -1.0f, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 8, 1.0f, 1, 1u, 5, w, 1), STELLA_ERR_ARG); /* lane < one level */
    x[2] = NAN;
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, 1.0f, 1, 1u, 5, w, 1), STELLA_ERR_ARG);
    CHECK(x[0] == 0.5f); /* nothing written */
    CHECK_EQ_INT(stella_thc_absmax(x, 4, &m, &bad), STELLA_OK);
    CHECK(m == 0.5f);
    CHECK_EQ_INT(bad, 1);
    x[2] = 0.25f;
    CHECK_EQ_INT(stella_thc_quantize(x, 4, 4, 1.0f, 1, 1u, 5, w, 1), STELLA_OK);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 1, 4, 4, 1, 5, 1.0f, out), STELLA_OK);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 2, 4, 4, 1, 5, 1.0f, out), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_thc_unpack_sum(w, 1, 4, 4, 16, 5, 1.0f, out), STELLA_ERR_ARG);
    uint64_t stray = w[0] | (1ull << 63);
    CHECK_EQ_INT(stella_thc_unpack_sum(&stray, 1, 4, 4, 1, 5, 1.0f, out), STELLA_ERR_MALFORMED);
    uint64_t high = (w[0] & ~31ull) | 15ull; /* lane 0 = 15 > 2 L = 14 */
    CHECK_EQ_INT(stella_thc_unpack_sum(&high, 1, 4, 4, 1, 5, 1.0f, out), STELLA_ERR_MALFORMED);
    CHECK_EQ_INT(stella_thc_quantize(NULL, 0, 4, 1.0f, 1, 1u, 5, NULL, 0), STELLA_OK); /* empty */
    CHECK_EQ_INT(stella_thc_unpack_sum(NULL, 0, 0, 4, 1, 5, 1.0f, NULL), STELLA_OK);
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
