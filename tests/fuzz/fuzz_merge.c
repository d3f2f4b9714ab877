/* fuzz_merge.c - libFuzzer target: the k-way merge against a slow dense
 * reference. The input describes up to 8 lists (index gaps, sometimes zero
 * to make a list invalid, and raw value bits); the merge must either reject
 * an invalid list with STELLA_ERR_MALFORMED or return exactly the union with
 * values summed in list order. */
#include "stella_sparse.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_N 70000
#define MAX_W 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 4) return 0;
    int w = data[0] % (MAX_W + 1);
    int64_t n = 1 + ((int64_t)data[1] | ((int64_t)data[2] << 8) | ((int64_t)(data[3] & 1) << 16)) % MAX_N;
    size_t pos = 4;
    static uint32_t li[MAX_W][512];
    static float lv[MAX_W][512];
    int64_t lens[MAX_W] = {0};
    const uint32_t *ip[MAX_W];
    const float *vp[MAX_W];
    int valid = 1;
    for (int j = 0; j < w; j++) {
        int64_t len = pos < size ? data[pos++] % 200 : 0, cur = -1;
        for (int64_t t = 0; t < len && pos + 3 <= size; t++) {
            int64_t gap = data[pos] | (data[pos + 1] << 8);
            int64_t v = gap == 0 ? cur : cur + 1 + gap % 2048;   /* gap 0: a duplicate */
            if (v < 0) v = 0;
            li[j][t] = (uint32_t)v;
            uint32_t bits = (uint32_t)data[pos + 2] * 0x01010101u;
            memcpy(&lv[j][t], &bits, 4);
            if (v <= cur || v >= n) valid = 0;
            cur = v;
            lens[j] = t + 1;
            pos += 3;
        }
        ip[j] = li[j];
        vp[j] = lv[j];
    }
    static uint32_t oi[MAX_W * 512];
    static float ov[MAX_W * 512];
    int64_t got = -1;
    int rc = stella_merge_f32(w, ip, vp, lens, n, oi, ov, MAX_W * 512, &got);
    if (!valid) { if (rc != STELLA_ERR_MALFORMED) abort(); return 0; }
    if (rc != STELLA_OK) abort();
    static float dense[MAX_N];
    static uint8_t present[MAX_N];
    memset(present, 0, (size_t)n);
    for (int j = 0; j < w; j++)
        for (int64_t t = 0; t < lens[j]; t++) {
            uint32_t i = li[j][t];
            dense[i] = present[i] ? dense[i] + lv[j][t] : lv[j][t];
            present[i] = 1;
        }
    int64_t r = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!present[i]) continue;
        if (r >= got || oi[r] != (uint32_t)i) abort();
        uint32_t a, b;
        memcpy(&a, &ov[r], 4); memcpy(&b, &dense[i], 4);
        if (a != b && !(isnan(ov[r]) && isnan(dense[i]))) abort();
        r++;
    }
    if (r != got) abort();
    /* too small an output buffer is refused, never overrun */
    if (got > 0 && stella_merge_f32(w, ip, vp, lens, n, oi, ov, got - 1, &r) != STELLA_ERR_SIZE) abort();
    return 0;
}
