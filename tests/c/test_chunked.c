/* test_chunked.c - SparseLoCo's kernels under the sanitizers: top-k per chunk with error
 * feedback (sent + residual == acc, bit for bit; exactly k per full chunk), quantisation on
 * each chunk's grid (the error fed back, at most half a step), the payload round trip bit for
 * bit, a truncated or altered payload refused, and every argument check; buffers sized exactly
 * so that an overrun is caught. */
#include "check.h"
#include "stella_chunked.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint32_t g_rng = 777u;
static float uniform(float lo, float hi) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(g_rng >> 8) / 16777216.0f;
}

static void round_trip(int64_t n, int64_t chunk, int64_t k, int bits, int with_nan) {
    int64_t total;
    CHECK_EQ_INT(stella_chunk_topk_count(n, chunk, k, &total), STELLA_OK);
    float *g = malloc((size_t)(n ? n : 1) * 4), *res = malloc((size_t)(n ? n : 1) * 4);
    float *acc = malloc((size_t)(n ? n : 1) * 4);
    for (int64_t i = 0; i < n; i++) {
        g[i] = uniform(-1, 1);
        res[i] = uniform(-0.1f, 0.1f);
        acc[i] = g[i] + res[i];
    }
    if (with_nan && n > 3) g[n / 2] = NAN, acc[n / 2] = NAN;
    uint32_t *idx = malloc((size_t)(total ? total : 1) * 4), *idx2 = malloc((size_t)(total ? total : 1) * 4);
    float *val = malloc((size_t)(total ? total : 1) * 4), *val2 = malloc((size_t)(total ? total : 1) * 4);
    int64_t got = -1, ns = 2 * ((n + chunk - 1) / chunk);
    float *scales = malloc((size_t)(ns ? ns : 1) * 4), *scales2 = malloc((size_t)(ns ? ns : 1) * 4);
    CHECK_EQ_INT(stella_chunk_topk_f32(g, res, n, chunk, k, idx, val, total, &got), STELLA_OK);
    CHECK_EQ_INT(got, total);
    for (int64_t i = 0, j = 0; i < n; i++) {   /* sent + residual == acc */
        int sent = j < got && idx[j] == (uint32_t)i;
        float s = sent ? val[j++] : 0.0f;
        if (!isnan(acc[i])) CHECK(s + res[i] == acc[i]);
        if (sent) CHECK(res[i] == 0.0f);
    }
    float *before = malloc((size_t)(total ? total : 1) * 4);
    if (got) memcpy(before, val, (size_t)got * 4);
    CHECK_EQ_INT(stella_chunk_quantize_f32(idx, val, got, n, chunk, bits, scales, ns, res), STELLA_OK);
    for (int64_t i = 0; i < got; i++) {
        float step = scales[2 * (idx[i] / chunk) + 1];
        if (!isnan(scales[2 * (idx[i] / chunk)])) CHECK(fabsf(before[i] - val[i]) <= step * 0.5f * 1.0001f + 1e-30f);
    }
    int64_t bound, len;
    CHECK_EQ_INT(stella_qpayload_bound(n, chunk, got, bits, &bound), STELLA_OK);
    uint8_t *buf = malloc((size_t)bound);
    CHECK_EQ_INT(stella_qpayload_encode(idx, val, got, n, chunk, bits, scales, ns, buf, bound, &len), STELLA_OK);
    CHECK(len <= bound);
    int64_t k2 = -1;
    CHECK_EQ_INT(stella_qpayload_decode(buf, len, n, chunk, bits, idx2, val2, total, scales2, ns, &k2), STELLA_OK);
    CHECK_EQ_INT(k2, got);
    if (got) {
        CHECK(memcmp(idx, idx2, (size_t)got * 4) == 0);
        for (int64_t i = 0; i < got; i++) CHECK(isnan(val[i]) ? isnan(val2[i]) : memcmp(val + i, val2 + i, 4) == 0);
    }
    if (len > 0) {   /* one byte short, and one byte more, are refused */
        CHECK_EQ_INT(stella_qpayload_decode(buf, len - 1, n, chunk, bits, idx2, val2, total, scales2, ns, &k2),
                     STELLA_ERR_MALFORMED);
        uint8_t *more = malloc((size_t)len + 1);
        memcpy(more, buf, (size_t)len);
        more[len] = 0;
        CHECK_EQ_INT(stella_qpayload_decode(more, len + 1, n, chunk, bits, idx2, val2, total, scales2, ns, &k2),
                     STELLA_ERR_MALFORMED);
        free(more);
    }
    free(g); free(res); free(acc); free(idx); free(idx2); free(val); free(val2); free(scales); free(scales2);
    free(before); free(buf);
}

static void argument_checks(void) {
    float g[32] = {0}, r[32] = {0}, v[32], s[4];
    uint32_t idx[32];
    int64_t got, out;
    CHECK_EQ_INT(stella_chunk_topk_f32(g, r, 32, 24, 1, idx, v, 32, &got), STELLA_ERR_ARG);   /* not a power of two */
    CHECK_EQ_INT(stella_chunk_topk_f32(g, r, 32, 8, 1, idx, v, 32, &got), STELLA_ERR_ARG);    /* below the minimum */
    CHECK_EQ_INT(stella_chunk_topk_f32(g, r, 32, 16, 0, idx, v, 32, &got), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_chunk_topk_f32(g, r, 32, 16, 17, idx, v, 32, &got), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_chunk_topk_f32(g, r, 32, 16, 2, idx, v, 3, &got), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_chunk_topk_f32(NULL, r, 32, 16, 2, idx, v, 4, &got), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_chunk_topk_count((int64_t)1 << 31, 4096, 1, &out), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_chunk_topk_f32(g, r, 32, 16, 2, idx, v, 4, &got), STELLA_OK);
    CHECK_EQ_INT(stella_chunk_quantize_f32(idx, v, got, 32, 16, 3, s, 4, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_chunk_quantize_f32(idx, v, got, 32, 16, 2, s, 2, NULL), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_chunk_quantize_f32(idx, v, got, 17, 16, 2, s, 4, NULL), STELLA_ERR_ARG);   /* 17 >= n */
    uint32_t bad[2] = {5, 5};
    CHECK_EQ_INT(stella_chunk_quantize_f32(bad, v, 2, 32, 16, 2, s, 4, NULL), STELLA_ERR_ARG);
    uint8_t buf[8] = {0};
    CHECK_EQ_INT(stella_qpayload_decode(buf, 8, 32, 16, 2, idx, v, 32, s, 4, &got), STELLA_ERR_MALFORMED);
    CHECK_EQ_INT(stella_qpayload_decode(buf, 0, 32, 16, 2, idx, v, 32, s, 4, &got), STELLA_ERR_MALFORMED);
}

int main(void) {
    const int64_t sizes[] = {0, 1, 15, 16, 17, 4095, 4096, 4097, 32767, 32769, 65535, 65537, 200003};
    const int64_t settings[][2] = {{16, 1}, {16, 16}, {64, 3}, {4096, 41}, {65536, 655}};
    const int bits[] = {2, 4, 8};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        for (size_t s = 0; s < sizeof settings / sizeof *settings; s++)
            for (size_t b = 0; b < 3; b++)
                round_trip(sizes[i], settings[s][0], settings[s][1], bits[b], (i + s + b) % 2);
    argument_checks();
    TEST_MAIN_END();
}
