/* test_compress_codec.c - the sparse wire codec (round trips of every scheme
 * and value type at the segment and block boundaries, the scheme choice and
 * size arithmetic up to the 2^31 index limit, rejection of malformed
 * payloads), the k-way merge against a slow reference, and scatter-add. */
#include "check.h"
#include "stella_compress.h"
#include "stella_dense.h"
#include "stella_sparse.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17; return g_rng; }

/* k sorted distinct indices < n, drawn with probability k/n each (approx) */
static int64_t random_indices(uint32_t *idx, int64_t n, double p) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) if ((double)(rnd() >> 11) / 9007199254740992.0 < p) idx[k++] = (uint32_t)i;
    return k;
}

static void roundtrip(const uint32_t *idx, const float *val, int64_t k, int64_t n, int scheme, int vd, int want_scheme) {
    int64_t bound, size, got;
    CHECK_EQ_INT(stella_payload_bound(n, k, vd, &bound), STELLA_OK); /* covers AUTO */
    if (scheme == STELLA_IDX_SEG16) CHECK_EQ_INT(stella_payload_size(n, k, 0, scheme, vd, &bound), STELLA_OK);
    if (scheme == STELLA_IDX_MIXED) CHECK_EQ_INT(stella_encoded_size(idx, k, n, scheme, vd, &bound, NULL), STELLA_OK);
    uint8_t *buf = malloc(bound + 8);
    uint32_t *di = malloc((k + 1) * 4);
    float *dv = malloc((k + 1) * 4);
    int rc = stella_sparse_encode(idx, val, k, n, scheme, vd, buf, bound, &size);
    CHECK_EQ_INT(rc, STELLA_OK);
    if (rc) goto out;
    stella_payload_info info;
    CHECK_EQ_INT(stella_sparse_decode_info(buf, size, n, &info), STELLA_OK);
    if (want_scheme >= 0) CHECK_EQ_INT(info.scheme, want_scheme);
    int64_t planned;
    int chosen;
    CHECK_EQ_INT(stella_encoded_size(idx, k, n, scheme, vd, &planned, &chosen), STELLA_OK);
    CHECK_EQ_INT(planned, size);
    CHECK_EQ_INT(chosen, info.scheme);
    CHECK_EQ_INT(info.entries, k);
    CHECK_EQ_INT(info.nbytes, size);
    CHECK_EQ_INT(stella_sparse_decode(buf, size, n, 0, di, dv, k, &got), STELLA_OK);
    CHECK_EQ_INT(got, k);
    CHECK(k == 0 || memcmp(di, idx, k * 4) == 0);
    for (int64_t j = 0; j < k; j++) {
        float want = val[j];
        if (vd != STELLA_VAL_F32) {
            uint16_t h; float back;
            if (vd == STELLA_VAL_F16) { stella_f32_to_f16(&val[j], &h, 1, 1.0f); stella_f16_to_f32(&h, &back, 1, 1.0f); }
            else { stella_f32_to_bf16(&val[j], &h, 1, 1.0f); stella_bf16_to_f32(&h, &back, 1, 1.0f); }
            want = back;
        }
        if (!(f2u(dv[j]) == f2u(want) || (isnan(dv[j]) && isnan(want)))) { g_failures++; fprintf(stderr, "value %lld differs\n", (long long)j); break; }
    }
    /* every truncation and one extra byte are rejected */
    for (int64_t cut = 0; cut < size; cut += (size > 200 ? size / 50 + 1 : 1))
        CHECK_EQ_INT(stella_sparse_decode_info(buf, cut, n, &info), STELLA_ERR_MALFORMED);
    buf[size] = 0;
    CHECK_EQ_INT(stella_sparse_decode_info(buf, size + 1, n, &info), STELLA_ERR_MALFORMED);
    /* a payload for another size is rejected */
    if (n > 0) CHECK_EQ_INT(stella_sparse_decode_info(buf, size, n - 1, &info), STELLA_ERR_MALFORMED);
    if (k > 0) CHECK_EQ_INT(stella_sparse_decode(buf, size, n, 0, di, dv, k - 1, &got), STELLA_ERR_SIZE);
out:
    free(buf); free(di); free(dv);
}

static void test_roundtrips(void) {
    const int64_t sizes[] = {0, 1, 15, 16, 17, 255, 65535, 65536, 65537, 131073, (1 << 20), (1 << 20) + 1};
    for (size_t a = 0; a < sizeof sizes / sizeof sizes[0]; a++) {
        int64_t n = sizes[a], N = n ? n : 1;
        uint32_t *idx = malloc(N * 4);
        float *val = malloc(N * 4);
        for (int64_t i = 0; i < N; i++) {
            uint32_t u = (uint32_t)rnd();
            memcpy(&val[i], &u, 4); /* every bit pattern: NaN, Inf, subnormals */
        }
        const double ps[] = {0.0, 0.001, 0.05, 0.6, 1.0};
        for (size_t b = 0; b < sizeof ps / sizeof ps[0]; b++) {
            int64_t k = random_indices(idx, n, ps[b]);
            for (int vd = 0; vd < 3; vd++) {
                roundtrip(idx, val, k, n, STELLA_IDX_AUTO, vd, k == n ? STELLA_IDX_DENSE : -1);
                roundtrip(idx, val, k, n, STELLA_IDX_U32, vd, STELLA_IDX_U32);
                roundtrip(idx, val, k, n, STELLA_IDX_SEG16, vd, STELLA_IDX_SEG16);
            }
        }
        /* whole blocks, with and without the short tail block */
        int64_t nb = (n + 15) / 16;
        for (int tail = 0; tail < 2; tail++) {
            int64_t k = 0, blocks = 0;
            for (int64_t b = 0; b < nb; b++) {
                int take = (b % 7 == 3) || (tail && b == nb - 1);
                if (!take) continue;
                blocks++;
                for (int64_t t = 0; t < 16 && b * 16 + t < n; t++) idx[k++] = (uint32_t)(b * 16 + t);
            }
            int64_t wb;
            CHECK_EQ_INT(stella_whole_blocks(idx, k, n, &wb), STELLA_OK);
            CHECK_EQ_INT(wb, blocks);
            int want = k == n && n > 0 ? STELLA_IDX_DENSE : (nb <= 65536 ? STELLA_IDX_BLOCK16 : STELLA_IDX_BLOCK32);
            if (k == 0) want = -1;
            for (int vd = 0; vd < 3; vd++) {
                roundtrip(idx, val, k, n, STELLA_IDX_AUTO, vd, want);
                roundtrip(idx, val, k, n, STELLA_IDX_BLOCK32, vd, STELLA_IDX_BLOCK32);
                if (nb <= 65536) roundtrip(idx, val, k, n, STELLA_IDX_BLOCK16, vd, STELLA_IDX_BLOCK16);
            }
            if (k > 1) { /* drop the first entry: no longer whole blocks */
                CHECK_EQ_INT(stella_whole_blocks(idx + 1, k - 1, n, &wb), STELLA_OK);
                CHECK_EQ_INT(wb, -1);
            }
        }
        free(idx); free(val);
    }
}

/* Whole blocks (every 5th) and single entries (drawn with probability p outside them); the
 * numpy-free reference is the index list itself: decode must give it back. */
static int64_t mixed_indices(uint32_t *idx, int64_t n, double p, int64_t *nblocks, int64_t *nsingles) {
    int64_t k = 0, nb = (n + 15) / 16;
    *nblocks = *nsingles = 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t len = n - b * 16 < 16 ? n - b * 16 : 16;
        if (b == 0 || b % 5 == 2 || (b == nb - 1 && nb % 2)) {
            for (int64_t t = 0; t < len; t++) idx[k++] = (uint32_t)(b * 16 + t);
            (*nblocks)++;
            continue;
        }
        int64_t before = k;
        for (int64_t t = 0; t < len; t++)
            if ((double)(rnd() >> 11) / 9007199254740992.0 < p) idx[k++] = (uint32_t)(b * 16 + t);
        if (k - before == len && len > 0) { (*nblocks)++; continue; }   /* drawn whole: a block */
        *nsingles += k - before;
    }
    return k;
}

static void test_mixed(void) {
    const int64_t sizes[] = {17, 33, 255, 65535, 65536, 65537, 131073, (1 << 20), (1 << 20) + 1, (1 << 20) + 33};
    for (size_t a = 0; a < sizeof sizes / sizeof sizes[0]; a++) {
        int64_t n = sizes[a];
        uint32_t *idx = malloc(n * 4);
        float *val = malloc(n * 4);
        for (int64_t i = 0; i < n; i++) { uint32_t u = (uint32_t)rnd(); memcpy(&val[i], &u, 4); }
        const double ps[] = {0.001, 0.05, 0.5};
        for (size_t b = 0; b < sizeof ps / sizeof ps[0]; b++) {
            int64_t nb, ns, k = mixed_indices(idx, n, ps[b], &nb, &ns);
            int64_t seg, mixed, u32;
            CHECK_EQ_INT(stella_payload_size(n, k, 0, STELLA_IDX_SEG16, STELLA_VAL_F32, &seg), STELLA_OK);
            CHECK_EQ_INT(stella_payload_size(n, k, 0, STELLA_IDX_U32, STELLA_VAL_F32, &u32), STELLA_OK);
            CHECK_EQ_INT(stella_encoded_size(idx, k, n, STELLA_IDX_MIXED, STELLA_VAL_F32, &mixed, NULL), STELLA_OK);
            int64_t nseg = (n + 65535) / 65536, in_blocks = k - ns, w = (n + 15) / 16 <= 65536 ? 2 : 4;
            CHECK_EQ_INT(mixed, 32 + w * nb + 4 * nseg + 2 * ns + 4 * k);   /* the layout's own arithmetic */
            CHECK(in_blocks > 0);
            if (w == 2) CHECK(mixed <= seg);   /* 16-bit block ids: never larger (equal for a one-entry tail block) */
            for (int vd = 0; vd < 3; vd++) {
                roundtrip(idx, val, k, n, STELLA_IDX_AUTO, vd, ns > 0 && mixed < u32 && mixed < seg ? STELLA_IDX_MIXED : -1);
                roundtrip(idx, val, k, n, STELLA_IDX_MIXED, vd, STELLA_IDX_MIXED);
            }
            /* malformed: a single moved into a listed block; singles out of order; a count off by one */
            if (ns > 0) {
                int64_t bound, size, got;
                stella_encoded_size(idx, k, n, STELLA_IDX_MIXED, STELLA_VAL_F32, &bound, NULL);
                uint8_t *buf = malloc(bound);
                uint32_t *di = malloc(k * 4);
                float *dv = malloc(k * 4);
                CHECK_EQ_INT(stella_sparse_encode(idx, val, k, n, STELLA_IDX_MIXED, STELLA_VAL_F32, buf, bound, &size),
                             STELLA_OK);
                uint8_t *offs = buf + 32 + w * nb + 4 * nseg;
                uint32_t first_block;
                if (w == 2) { uint16_t v; memcpy(&v, buf + 32, 2); first_block = v; }
                else memcpy(&first_block, buf + 32, 4);
                uint16_t inside = (uint16_t)(first_block * 16 + 3 < (uint32_t)n ? first_block * 16 + 3 : first_block * 16);
                uint16_t save;
                uint32_t in_seg0;
                memcpy(&in_seg0, buf + 32 + w * nb, 4);
                if (first_block * 16 < 65536 && in_seg0 > 0) {   /* the first single and the first block share segment 0 */
                    memcpy(&save, offs, 2);
                    memcpy(offs, &inside, 2);   /* inside the block, or out of order with the next single */
                    CHECK_EQ_INT(stella_sparse_decode(buf, size, n, 0, di, dv, k, &got), STELLA_ERR_MALFORMED);
                    memcpy(offs, &save, 2);
                }
                if (ns > 1) {
                    uint16_t a0, a1;
                    memcpy(&a0, offs, 2); memcpy(&a1, offs + 2, 2);
                    memcpy(offs, &a1, 2); memcpy(offs + 2, &a0, 2);
                    CHECK_EQ_INT(stella_sparse_decode(buf, size, n, 0, di, dv, k, &got), STELLA_ERR_MALFORMED);
                    memcpy(offs, &a0, 2); memcpy(offs + 2, &a1, 2);
                }
                uint32_t c0;
                memcpy(&c0, buf + 32 + w * nb, 4);
                uint32_t c1 = c0 + 1;
                memcpy(buf + 32 + w * nb, &c1, 4);
                CHECK_EQ_INT(stella_sparse_decode(buf, size, n, 0, di, dv, k, &got), STELLA_ERR_MALFORMED);
                memcpy(buf + 32 + w * nb, &c0, 4);
                CHECK_EQ_INT(stella_sparse_decode(buf, size, n, 0, di, dv, k, &got), STELLA_OK);
                free(buf); free(di); free(dv);
            }
        }
        /* MIXED needs a whole block; single entries only are refused */
        int64_t sz;
        uint32_t one[2] = {1, 5};
        CHECK_EQ_INT(stella_encoded_size(one, 2, n, STELLA_IDX_MIXED, STELLA_VAL_F32, &sz, NULL), STELLA_ERR_ARG);
        CHECK_EQ_INT(stella_payload_size(n, 2, 0, STELLA_IDX_MIXED, STELLA_VAL_F32, &sz), STELLA_ERR_ARG);
        free(idx); free(val);
    }
}

static void test_sizes_near_limit(void) {
    const int64_t M = STELLA_SPARSE_MAX_N; /* 2^31 - 1 */
    int64_t sz;
    int s;
    CHECK_EQ_INT(stella_payload_size(M, M, 0, STELLA_IDX_U32, STELLA_VAL_F32, &sz), STELLA_OK);
    CHECK_EQ_INT(sz, 32 + 8 * M);
    CHECK_EQ_INT(stella_payload_size(M + 1, 1, 0, STELLA_IDX_U32, STELLA_VAL_F32, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_payload_size(M, M + 1, 0, STELLA_IDX_U32, STELLA_VAL_F32, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_payload_size(-1, 0, 0, STELLA_IDX_U32, STELLA_VAL_F32, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_payload_size(M, 1000, 0, STELLA_IDX_SEG16, STELLA_VAL_F16, &sz), STELLA_OK);
    CHECK_EQ_INT(sz, 32 + 4 * 32768 + 2 * 1000 + 2 * 1000);
    CHECK_EQ_INT(stella_payload_size(1 << 20, 16, 1, STELLA_IDX_BLOCK16, STELLA_VAL_F32, &sz), STELLA_OK);
    CHECK_EQ_INT(stella_payload_size((1 << 20) + 1, 16, 1, STELLA_IDX_BLOCK16, STELLA_VAL_F32, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_payload_size(M, 16, 1, STELLA_IDX_BLOCK32, STELLA_VAL_F32, &sz), STELLA_OK);
    CHECK_EQ_INT(stella_payload_size(100, 17, 1, STELLA_IDX_BLOCK32, STELLA_VAL_F32, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_payload_size(100, 5, 0, STELLA_IDX_DENSE, STELLA_VAL_F32, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_payload_size(100, 5, 0, STELLA_IDX_U32, 7, &sz), STELLA_ERR_ARG);
    /* 16-bit offsets win when the segment table is small next to the entries */
    CHECK_EQ_INT(stella_choose_scheme(M, 1000000, -1, &s), STELLA_OK);
    CHECK_EQ_INT(s, STELLA_IDX_SEG16);
    CHECK_EQ_INT(stella_choose_scheme(M, 1000, -1, &s), STELLA_OK);      /* 128 KB table vs 2 KB saved */
    CHECK_EQ_INT(s, STELLA_IDX_U32);
    CHECK_EQ_INT(stella_choose_scheme(65536, 1, -1, &s), STELLA_OK);    /* one segment: 4 + 2 < 4? no */
    CHECK_EQ_INT(s, STELLA_IDX_U32);
    CHECK_EQ_INT(stella_choose_scheme(65536, 3, -1, &s), STELLA_OK);    /* 4 + 6 < 12 */
    CHECK_EQ_INT(s, STELLA_IDX_SEG16);
    CHECK_EQ_INT(stella_choose_scheme(M, M, -1, &s), STELLA_OK);
    CHECK_EQ_INT(s, STELLA_IDX_DENSE);
    CHECK_EQ_INT(stella_choose_scheme(M, 160, 10, &s), STELLA_OK);
    CHECK_EQ_INT(s, STELLA_IDX_BLOCK32);
    CHECK_EQ_INT(stella_choose_scheme(1 << 20, 160, 10, &s), STELLA_OK);
    CHECK_EQ_INT(s, STELLA_IDX_BLOCK16);
    CHECK_EQ_INT(stella_choose_scheme(M + 1, 1, -1, &s), STELLA_ERR_ARG);
    /* a header claiming a huge count is rejected before any size arithmetic */
    uint8_t hdr[40] = {'S', 'T', 'S', 'P', 1, STELLA_IDX_U32, STELLA_VAL_F32, 0};
    uint64_t n = 1000, cnt = (uint64_t)1 << 62;
    memcpy(hdr + 8, &n, 8); memcpy(hdr + 16, &cnt, 8);
    stella_payload_info info;
    CHECK_EQ_INT(stella_sparse_decode_info(hdr, 40, 1000, &info), STELLA_ERR_MALFORMED);
    cnt = 2; /* 32 + 8 + 8 = 48 bytes expected, 40 given */
    memcpy(hdr + 16, &cnt, 8);
    CHECK_EQ_INT(stella_sparse_decode_info(hdr, 40, 1000, &info), STELLA_ERR_MALFORMED);
    cnt = 1;
    memcpy(hdr + 16, &cnt, 8);
    CHECK_EQ_INT(stella_sparse_decode_info(hdr, 40, 1000, &info), STELLA_OK);
    CHECK_EQ_INT(stella_sparse_decode_info(hdr, 40, M + 1, &info), STELLA_ERR_ARG);
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

static void test_malformed(void) {
    enum { N = 1000 };
    uint32_t idx[4] = {3, 70, 500, 999};
    float val[4] = {1, 2, 3, 4}, dv[16];
    uint32_t di[16];
    uint8_t buf[256];
    int64_t sz, got;
    stella_payload_info info;
    CHECK_EQ_INT(stella_sparse_encode(idx, val, 4, N, STELLA_IDX_U32, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_OK);
    CHECK_EQ_INT(sz, 32 + 16 + 16);
    uint8_t bad[256];
    /* header fields */
    const int fields[] = {0, 3, 4, 5, 6, 7, 8, 16, 24};
    for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) {
        memcpy(bad, buf, sz);
        bad[fields[f]] ^= 0x40;
        CHECK_EQ_INT(stella_sparse_decode(bad, sz, N, 0, di, dv, 16, &got), STELLA_ERR_MALFORMED);
    }
    /* order and range of indices */
    memcpy(bad, buf, sz); put32(bad + 32 + 4, 3);     /* duplicate */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, N, 0, di, dv, 16, &got), STELLA_ERR_MALFORMED);
    memcpy(bad, buf, sz); put32(bad + 32 + 4, 2);     /* descending */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, N, 0, di, dv, 16, &got), STELLA_ERR_MALFORMED);
    memcpy(bad, buf, sz); put32(bad + 32 + 12, N);    /* out of range */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, N, 0, di, dv, 16, &got), STELLA_ERR_MALFORMED);
    /* SEG16: counts that do not add up, offsets out of order or range */
    CHECK_EQ_INT(stella_sparse_encode(idx, val, 4, 70000, STELLA_IDX_SEG16, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_OK);
    memcpy(bad, buf, sz); put32(bad + 32, 5);
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, 70000, 0, di, dv, 16, &got), STELLA_ERR_MALFORMED);
    memcpy(bad, buf, sz); put32(bad + 32, 3); put32(bad + 36, 1); /* moves 999 into segment 1: still valid */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, 70000, 0, di, dv, 16, &got), STELLA_OK);
    CHECK_EQ_INT(di[3], 65536 + 999);
    memcpy(bad, buf, sz); bad[32 + 8 + 2] = 0;  bad[32 + 8 + 3] = 0; /* second offset 0 < 3 */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, 70000, 0, di, dv, 16, &got), STELLA_ERR_MALFORMED);
    memcpy(bad, buf, sz); put32(bad + 32, 0); put32(bad + 36, 4); bad[32 + 8 + 6] = 0xff; bad[32 + 8 + 7] = 0xff;
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, 70000, 0, di, dv, 16, &got), STELLA_ERR_MALFORMED); /* 65536+65535 >= n */
    /* BLOCK: ids out of order or range */
    uint32_t bidx[32];
    for (int i = 0; i < 32; i++) bidx[i] = (uint32_t)(i < 16 ? 16 + i : 48 + i - 16);
    float bval[32] = {0};
    CHECK_EQ_INT(stella_sparse_encode(bidx, bval, 32, N, STELLA_IDX_AUTO, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_OK);
    CHECK_EQ_INT(stella_sparse_decode_info(buf, sz, N, &info), STELLA_OK);
    CHECK_EQ_INT(info.scheme, STELLA_IDX_BLOCK16);
    CHECK_EQ_INT(sz, 32 + 4 + 128);
    memcpy(bad, buf, sz); bad[34] = 1; bad[35] = 0;   /* second id 1 < 1? equal to first */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, N, 0, di, dv, 32, &got), STELLA_ERR_MALFORMED);
    memcpy(bad, buf, sz); bad[34] = 62; bad[35] = 0;  /* id 62 is the 8-entry tail block of 1000: length no longer matches */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, N, 0, di, dv, 32, &got), STELLA_ERR_MALFORMED);
    memcpy(bad, buf, sz); bad[34] = 63; bad[35] = 0;  /* beyond the last block */
    CHECK_EQ_INT(stella_sparse_decode(bad, sz, N, 0, di, dv, 32, &got), STELLA_ERR_MALFORMED);
    /* IMPLICIT: the key must match */
    uint64_t key;
    CHECK_EQ_INT(stella_randomk_key(7, "w", 1, 3, &key), STELLA_OK);
    CHECK_EQ_INT(stella_randomk_encode(key, val, 4, N, STELLA_VAL_BF16, buf, sizeof buf, &sz), STELLA_OK);
    CHECK_EQ_INT(sz, 32 + 8);
    CHECK_EQ_INT(stella_sparse_decode(buf, sz, N, key, di, dv, 16, &got), STELLA_OK);
    uint32_t ri[4];
    CHECK_EQ_INT(stella_randomk_indices(key, N, 4, ri, 4), STELLA_OK);
    CHECK(memcmp(ri, di, 16) == 0);
    CHECK_EQ_INT(stella_sparse_decode(buf, sz, N, key + 1, di, dv, 16, &got), STELLA_ERR_MALFORMED);
    /* encoder refusals */
    uint32_t unsorted[3] = {5, 4, 9};
    CHECK_EQ_INT(stella_sparse_encode(unsorted, val, 3, N, STELLA_IDX_AUTO, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_sparse_encode(idx, val, 4, 999, STELLA_IDX_AUTO, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_sparse_encode(idx, val, 4, N, STELLA_IDX_BLOCK32, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_sparse_encode(idx, val, 4, N, STELLA_IDX_DENSE, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_sparse_encode(idx, val, 4, N, STELLA_IDX_IMPLICIT, STELLA_VAL_F32, buf, sizeof buf, &sz), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_sparse_encode(idx, val, 4, N, STELLA_IDX_U32, STELLA_VAL_F32, buf, 63, &sz), STELLA_ERR_SIZE);
    CHECK_EQ_INT(stella_sparse_encode(idx, NULL, 4, N, STELLA_IDX_U32, STELLA_VAL_F32, buf, 64, &sz), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_sparse_decode(NULL, 10, N, 0, di, dv, 16, &got), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_sparse_decode(buf, -1, N, 0, di, dv, 16, &got), STELLA_ERR_ARG);
}

/* slow reference merge: per index, sum in list order */
static void test_merge(void) {
    enum { N = 200000, W = 9 };
    static uint32_t li[W][N / 4], oi[N], ri[N];
    static float lv[W][N / 4], ov[N], rv[N];
    static int64_t lens[W];
    static float dense_sum[N];
    static uint8_t present[N];
    const uint32_t *ip[W];
    const float *vp[W];
    for (int w = 0; w <= W; w++) {
        memset(present, 0, sizeof present);
        for (int j = 0; j < w; j++) {
            double p = j == 0 ? 0.2 : (j % 3 == 0 ? 0.001 : 0.05);
            int64_t k = 0;
            for (int64_t i = 0; i < N && k < N / 4; i++)
                if ((double)(rnd() >> 11) / 9007199254740992.0 < p) {
                    li[j][k] = (uint32_t)i;
                    uint32_t u = (uint32_t)rnd() & 0xbfffffffu; /* finite mostly, varied exponents */
                    memcpy(&lv[j][k], &u, 4);
                    if (rnd() % 50 == 0) lv[j][k] = -0.0f;
                    k++;
                }
            lens[j] = k; ip[j] = li[j]; vp[j] = lv[j];
        }
        int64_t rk = 0;
        for (int j = 0; j < w; j++)
            for (int64_t t = 0; t < lens[j]; t++) {
                uint32_t i = li[j][t];
                if (!present[i]) { present[i] = 1; dense_sum[i] = lv[j][t]; }
                else dense_sum[i] = dense_sum[i] + lv[j][t];
            }
        for (int64_t i = 0; i < N; i++) if (present[i]) { ri[rk] = (uint32_t)i; rv[rk] = dense_sum[i]; rk++; }
        int64_t got = -1;
        CHECK_EQ_INT(stella_merge_f32(w, ip, vp, lens, N, oi, ov, N, &got), STELLA_OK);
        CHECK_EQ_INT(got, rk);
        CHECK(rk == 0 || memcmp(oi, ri, rk * 4) == 0);
        int bad = 0;
        for (int64_t t = 0; t < rk; t++) if (f2u(ov[t]) != f2u(rv[t]) && !(isnan(ov[t]) && isnan(rv[t]))) bad = 1;
        CHECK(!bad);
        if (rk > 0) CHECK_EQ_INT(stella_merge_f32(w, ip, vp, lens, N, oi, ov, rk - 1, &got), STELLA_ERR_SIZE);
        if (w >= 2 && lens[1] >= 2) {
            uint32_t save = li[1][1];
            li[1][1] = li[1][0];   /* a duplicate inside one list */
            CHECK_EQ_INT(stella_merge_f32(w, ip, vp, lens, N, oi, ov, N, &got), STELLA_ERR_MALFORMED);
            li[1][1] = save;
            CHECK_EQ_INT(stella_merge_f32(w, ip, vp, lens, li[1][lens[1] - 1], oi, ov, N, &got), STELLA_ERR_MALFORMED);
        }
    }
    /* identical lists: values double, signed zeros follow IEEE */
    uint32_t a[3] = {0, 5, 4095}, b[3] = {4095, 4096, 9000};
    float va[3] = {-0.0f, 1.0f, 2.0f}, vb[3] = {-0.0f, 3.0f, 4.0f};
    const uint32_t *p2[2] = {a, b};
    const float *q2[2] = {va, vb};
    int64_t l2[2] = {3, 3}, got;
    CHECK_EQ_INT(stella_merge_f32(2, p2, q2, l2, 10000, oi, ov, 6, &got), STELLA_OK);
    CHECK_EQ_INT(got, 5);
    CHECK(oi[0] == 0 && f2u(ov[0]) == 0x80000000u);
    CHECK(oi[2] == 4095 && ov[2] == 2.0f + -0.0f);
    CHECK(oi[3] == 4096 && ov[3] == 3.0f && oi[4] == 9000);
    l2[1] = -1;
    CHECK_EQ_INT(stella_merge_f32(2, p2, q2, l2, 10000, oi, ov, 6, &got), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_merge_f32(0, NULL, NULL, NULL, 10, oi, ov, 0, &got), STELLA_OK);
    CHECK_EQ_INT(got, 0);
    CHECK_EQ_INT(stella_merge_f32(2, NULL, q2, l2, 10, oi, ov, 6, &got), STELLA_ERR_NULL);
}

static void test_scatter(void) {
    float d[10] = {0}, v[3] = {1.0f, 2.0f, 3.0f};
    uint32_t i[3] = {2, 2, 9}, bad[3] = {2, 10, 1};
    CHECK_EQ_INT(stella_scatter_add_f32(d, 10, i, v, 3, 0.5f), STELLA_OK);
    CHECK(d[2] == 1.5f && d[9] == 1.5f && d[0] == 0.0f);
    CHECK_EQ_INT(stella_scatter_add_f32(d, 10, bad, v, 3, 1.0f), STELLA_ERR_ARG);
    CHECK(d[2] == 1.5f && d[1] == 0.0f); /* nothing written */
    CHECK_EQ_INT(stella_scatter_add_f32(NULL, 10, i, v, 3, 1.0f), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_scatter_add_f32(d, -1, i, v, 0, 1.0f), STELLA_ERR_ARG);
}

int main(void) {
    test_sizes_near_limit();
    test_malformed();
    test_scatter();
    test_merge();
    test_roundtrips();
    test_mixed();
    TEST_MAIN_END();
}
