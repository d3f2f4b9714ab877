/* fuzz_thc.c - libFuzzer target: the checked decoding of THC's summed words
 * (stella_thc_unpack_sum), the bytes a peer controls, against a slow reference. The input picks
 * the bits, the clusters, n, the scale block and the scales, then gives raw words; the decoder
 * must refuse them with STELLA_ERR_MALFORMED exactly when a lane is above 2 L C or a bit past the
 * used lanes is set, and otherwise return each entry's (lane - L C) * scale / L, bit for bit. */
#include "stella_thc.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_N 5000
#define MAX_WORDS MAX_N

static uint64_t word_at(const uint8_t *data, size_t size, size_t *pos) {
    uint64_t w = 0;
    for (int b = 0; b < 8; b++) w |= (uint64_t)(*pos < size ? data[(*pos)++] : 0) << (8 * b);
    return w;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 6) return 0;
    int bits = STELLA_THC_MIN_BITS + data[0] % (STELLA_THC_MAX_BITS - STELLA_THC_MIN_BITS + 1);
    int nclusters = 1 + data[1] % 20;
    if (data[1] >= 250) nclusters = STELLA_THC_MAX_CLUSTERS;       /* the widest lanes */
    int64_t n = 1 + ((int64_t)data[2] | ((int64_t)data[3] << 8)) % MAX_N;
    int scale_log2 = data[4] % 12;
    int lane;
    if (stella_thc_lane_bits(bits, nclusters, &lane) != STELLA_OK) abort();
    lane += data[5] % 3 == 2 && lane < 32;                          /* sometimes a wider lane than needed */
    int64_t nwords, nscales;
    if (stella_thc_words(n, lane, &nwords) != STELLA_OK || nwords > MAX_WORDS) abort();
    if (stella_thc_scale_count(n, scale_log2, &nscales) != STELLA_OK) abort();
    size_t pos = 6;
    static float scales[MAX_N];
    for (int64_t b = 0; b < nscales; b++)
        scales[b] = pos < size ? (float)data[pos++] * 0.25f : 1.0f;
    static uint64_t words[MAX_WORDS];
    const int64_t L = (1 << (bits - 1)) - 1, lanes = 64 / lane;
    const uint64_t top = 2ull * (uint64_t)L * (uint64_t)nclusters, mask = (1ull << lane) - 1;
    for (int64_t w = 0; w < nwords; w++) {
        uint64_t raw = word_at(data, size, &pos);
        if (raw & 1) {          /* raw bits */
            words[w] = raw;
            continue;
        }
        /* else lanes in range (from raw's bytes), so that accepted inputs are common too */
        int64_t m = n - w * lanes < lanes ? n - w * lanes : lanes;
        uint64_t word = 0;
        for (int64_t j = 0; j < m; j++)
            word |= (((raw >> (8 * (j % 8))) & 0xffu) * (uint64_t)(j + 1) % (top + 1)) << (j * lane);
        words[w] = word;
    }
    /* the reference: which input is malformed */
    int valid = 1;
    for (int64_t w = 0; w < nwords && valid; w++) {
        int64_t m = n - w * lanes < lanes ? n - w * lanes : lanes;
        int used = (int)(m * lane);
        if (used < 64 && (words[w] >> used) != 0) valid = 0;
        for (int64_t j = 0; j < m && valid; j++)
            if (((words[w] >> (j * lane)) & mask) > top) valid = 0;
    }
    static float out[MAX_N];
    int rc = stella_thc_unpack_sum(words, nwords, n, bits, nclusters, lane, scales, nscales, scale_log2, out);
    if (!valid) {
        if (rc != STELLA_ERR_MALFORMED) abort();
        return 0;
    }
    if (rc != STELLA_OK) abort();
    for (int64_t i = 0; i < n; i++) {
        int64_t w = i / lanes, j = i % lanes;
        uint64_t lv = (words[w] >> (j * lane)) & mask;
        float want = (float)((int64_t)lv - L * nclusters) * (scales[i >> scale_log2] / (float)L);
        if (memcmp(&want, &out[i], 4) != 0) abort();
    }
    return 0;
}
