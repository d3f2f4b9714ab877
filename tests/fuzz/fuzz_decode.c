/* fuzz_decode.c - libFuzzer target: the sparse payload decoder on untrusted
 * bytes. Even first byte: the input is a payload as is. Odd first byte: a
 * valid payload is built from the input (size, indices: singles, whole blocks or
 * both, scheme, value type)
 * and then corrupted at a few input-chosen places, to reach the deep checks.
 * Whatever happens, the decoder must not crash or read/write out of bounds,
 * and everything it accepts must be ascending, in range and re-encodable. */
#include "stella_sparse.h"
#include "stella_compress.h"
#include <stdlib.h>
#include <string.h>

#define MAX_N (1 << 18)

static void check_decoded(const uint8_t *p, int64_t len, int64_t n) {
    stella_payload_info info;
    if (stella_sparse_decode_info(p, len, n, &info) != STELLA_OK) return;
    if (info.entries < 0 || info.entries > n) abort();
    int64_t k = info.entries, got = -1;
    uint32_t *idx = malloc((size_t)(k ? k : 1) * 4);
    float *val = malloc((size_t)(k ? k : 1) * 4);
    int rc = stella_sparse_decode(p, len, n, info.key, idx, val, k, &got);
    if (rc == STELLA_OK) {
        if (got != k) abort();
        for (int64_t i = 0; i < k; i++) {
            if ((int64_t)idx[i] >= n) abort();
            if (i && idx[i] <= idx[i - 1]) abort();
        }
        if (info.scheme != STELLA_IDX_IMPLICIT) {
            int64_t bound, sz, got2;
            stella_payload_bound(n, k, info.value_dtype, &bound);
            uint8_t *buf = malloc((size_t)bound);
            if (stella_sparse_encode(idx, val, k, n, STELLA_IDX_AUTO, info.value_dtype, buf, bound, &sz) != STELLA_OK) abort();
            uint32_t *idx2 = malloc((size_t)(k ? k : 1) * 4);
            float *val2 = malloc((size_t)(k ? k : 1) * 4);
            if (stella_sparse_decode(buf, sz, n, 0, idx2, val2, k, &got2) != STELLA_OK || got2 != k) abort();
            if (k && memcmp(idx, idx2, (size_t)k * 4) != 0) abort();
            free(buf); free(idx2); free(val2);
        }
    } else if (rc != STELLA_ERR_MALFORMED) {
        abort();
    }
    free(idx); free(val);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 8) return 0;
    uint32_t sel;
    memcpy(&sel, data, 4);
    if (!(data[0] & 1)) {
        const uint8_t *p = data + 4;
        int64_t len = (int64_t)size - 4, n = sel % MAX_N;
        if (len >= 16 && (sel & 2)) { uint64_t hn; memcpy(&hn, p + 8, 8); if (hn <= MAX_N) n = (int64_t)hn; }
        check_decoded(p, len, n);
        return 0;
    }
    /* structured: n, scheme, dtype, then index gaps, then mutations */
    /* now and then past 2^20 entries, where block ids take 32 bits */
    int64_t n = 1 + (sel >> 8) % ((sel & 0x80) && (sel >> 8) % 7 == 0 ? 3 * MAX_N * 4 : MAX_N);
    int scheme = (int)(data[4] % 8) - 1;              /* AUTO .. MIXED (IMPLICIT is refused) */
    int vd = data[5] % 3;
    size_t nmut = data[6] % 5, pos = 7;
    uint32_t *idx = malloc((size_t)n * 4);
    float *val = malloc((size_t)n * 4);
    int64_t k = 0, cur = -1;
    int mode = data[7] % 3;                          /* singles, whole blocks, or both */
    size_t limit = size > nmut * 3 ? size - nmut * 3 : 0;
    while (pos + 2 <= limit && k < n) {
        uint16_t gap; memcpy(&gap, data + pos, 2); pos += 2;
        int64_t next = cur + 1 + (gap % 4096);
        int blocks = mode == 1 || (mode == 2 && (gap & 0x8000));
        if (blocks) next = (next + 15) / 16 * 16;
        if (next >= n) break;
        int64_t len = blocks ? (n - next < 16 ? n - next : 16) : 1;
        for (int64_t t = 0; t < len && k < n; t++) { idx[k] = (uint32_t)(next + t); val[k] = (float)gap - 100.0f; k++; }
        cur = next + len - 1;
    }
    int64_t bound, sz;
    /* the exact size of the scheme asked for (MIXED can exceed U32 and SEG16); else the bound */
    if (stella_encoded_size(idx, k, n, scheme, vd, &bound, NULL) != STELLA_OK) stella_payload_bound(n, k, vd, &bound);
    uint8_t *buf = malloc((size_t)bound + 1);
    if (stella_sparse_encode(idx, val, k, n, scheme, vd, buf, bound, &sz) == STELLA_OK) {
        for (size_t m = 0; m < nmut && pos + 3 <= size; m++, pos += 3) {
            uint16_t at; memcpy(&at, data + pos, 2);
            buf[at % sz] ^= data[pos + 2];
        }
        check_decoded(buf, sz, n);
        if (sz > 0) check_decoded(buf, sz - 1, n);
    }
    free(buf); free(idx); free(val);
    return 0;
}
