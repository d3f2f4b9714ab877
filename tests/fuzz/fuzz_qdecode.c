/* fuzz_qdecode.c - libFuzzer target: the decoder of SparseLoCo's quantised payloads
 * (stella_qpayload_decode) on untrusted bytes. The first bytes pick n, the chunk and the bits.
 * Even fifth byte: the rest is a payload as is. Odd: a valid payload is built from the input
 * (values, k per chunk) and then corrupted at a few input-chosen places, to reach the checks
 * past the header. Whatever happens, the decoder must not crash or touch memory outside its
 * buffers, must answer OK or MALFORMED, and what it accepts must hold ascending indices < n,
 * valid scales (finite and >= 0, or the NaN marker), values on their chunk's grid, and must
 * re-encode and decode to the same indices, values and scales. */
#include "stella_chunked.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_N 20000

static void check_accepted(const uint8_t *p, int64_t len, int64_t n, int64_t chunk, int bits) {
    int64_t k = -1, ns = 2 * ((n + chunk - 1) / chunk);
    if (stella_qpayload_decode_info(p, len, n, chunk, bits, &k) != STELLA_OK) return;
    if (k < 0 || k > n) abort();
    uint32_t *idx = malloc((size_t)(k ? k : 1) * 4), *idx2 = malloc((size_t)(k ? k : 1) * 4);
    float *val = malloc((size_t)(k ? k : 1) * 4), *val2 = malloc((size_t)(k ? k : 1) * 4);
    float *sc = malloc((size_t)ns * 4), *sc2 = malloc((size_t)ns * 4);
    int64_t got = -1, got2 = -1;
    int rc = stella_qpayload_decode(p, len, n, chunk, bits, idx, val, k, sc, ns, &got);
    if (rc == STELLA_OK) {
        if (got != k) abort();
        for (int64_t i = 0; i < k; i++) {
            if ((int64_t)idx[i] >= n || (i && idx[i] <= idx[i - 1])) abort();
            float lo = sc[2 * (idx[i] / chunk)], step = sc[2 * (idx[i] / chunk) + 1];
            if (isnan(lo) ? !(step == 0.0f && isnan(val[i])) : !(lo >= 0.0f && step >= 0.0f && isfinite(val[i])))
                abort();
        }
        int64_t bound, sz;
        if (stella_qpayload_bound(n, chunk, k, bits, &bound) != STELLA_OK) abort();
        uint8_t *buf = malloc((size_t)bound);
        if (stella_qpayload_encode(idx, val, k, n, chunk, bits, sc, ns, buf, bound, &sz) != STELLA_OK) abort();
        if (stella_qpayload_decode(buf, sz, n, chunk, bits, idx2, val2, k, sc2, ns, &got2) != STELLA_OK || got2 != k)
            abort();
        if (k && (memcmp(idx, idx2, (size_t)k * 4) || memcmp(val, val2, (size_t)k * 4))) abort();
        if (memcmp(sc, sc2, (size_t)ns * 4)) abort();
        free(buf);
    } else if (rc != STELLA_ERR_MALFORMED) {
        abort();
    }
    free(idx); free(idx2); free(val); free(val2); free(sc); free(sc2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 6) return 0;
    int64_t n = 1 + (((int64_t)data[0] | ((int64_t)data[1] << 8)) % MAX_N);
    int64_t chunk = (int64_t)16 << (data[2] % 8);          /* 16 .. 2048 */
    int bits = 2 << (data[3] % 3);                          /* 2, 4, 8 */
    if (!(data[4] & 1)) {
        check_accepted(data + 5, (int64_t)size - 5, n, chunk, bits);
        return 0;
    }
    /* structured: values from the input, k per chunk, then mutations */
    int64_t k = 1 + data[4] / 2 % chunk, total;
    if (stella_chunk_topk_count(n, chunk, k, &total) != STELLA_OK) abort();
    float *g = malloc((size_t)n * 4), *val = malloc((size_t)total * 4);
    uint32_t *idx = malloc((size_t)total * 4);
    size_t pos = 5;
    for (int64_t i = 0; i < n; i++) {
        uint8_t b = pos < size ? data[pos++] : (uint8_t)i;
        g[i] = b == 255 ? NAN : b == 254 ? INFINITY : ((float)b - 128.0f) * (b & 1 ? 1e-3f : 1.0f);
        if (pos >= size) pos = 5;
    }
    int64_t ns = 2 * ((n + chunk - 1) / chunk), got, bound, len;
    float *sc = malloc((size_t)ns * 4);
    if (stella_chunk_topk_f32(g, NULL, n, chunk, k, idx, val, total, &got) != STELLA_OK) abort();
    if (stella_chunk_quantize_f32(idx, val, got, n, chunk, bits, sc, ns, NULL) != STELLA_OK) abort();
    if (stella_qpayload_bound(n, chunk, got, bits, &bound) != STELLA_OK) abort();
    uint8_t *buf = malloc((size_t)bound);
    if (stella_qpayload_encode(idx, val, got, n, chunk, bits, sc, ns, buf, bound, &len) != STELLA_OK) abort();
    check_accepted(buf, len, n, chunk, bits);   /* what the encoder writes is accepted as it is */
    for (size_t m = size - 1; m + 3 >= size && m >= 5 && len > 0; m--) {
        buf[(data[m] * 2654435761u) % (uint64_t)len] ^= (uint8_t)(1u << (data[m] % 8));
        check_accepted(buf, len, n, chunk, bits);
    }
    if (len > 1) check_accepted(buf, len - 1 - (int64_t)(data[size - 1] % (len - 1)), n, chunk, bits);
    free(g); free(val); free(idx); free(sc); free(buf);
    return 0;
}
