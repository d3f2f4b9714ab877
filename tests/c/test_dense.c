/* test_dense.c - the dense kernels on every SIMD path this CPU has:
 * exhaustive half->float, a sweep of float->half/bf16 over bit patterns
 * (NaN, Inf, subnormals, rounding ties), all lengths around the vector width,
 * identical bits on every path, and argument validation. */
#include "check.h"
#include "stella_dense.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Slow, obviously-correct reference: round-to-nearest-even via double arithmetic. */
static uint16_t ref_f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if (isnan(f)) return (uint16_t)((u >> 16) | 0x40);
    uint32_t lo = u & 0xffff, hi = u >> 16;
    if (lo > 0x8000 || (lo == 0x8000 && (hi & 1))) hi++;
    return (uint16_t)hi;
}

static void test_bf16_against_reference(void) {
    enum { N = 4099 };
    static float src[N];
    static uint16_t out[N];
    uint32_t pattern = 0x12345678u;
    for (int lvl = 0; lvl <= stella_simd_best(); lvl++) {
        CHECK_EQ_INT(stella_simd_force(lvl), STELLA_OK);
        for (uint64_t base = 0; base < (1ull << 32); base += 0x10000ull * 97ull) {
            for (int i = 0; i < N; i++) {
                pattern = pattern * 1664525u + 1013904223u;
                src[i] = u2f((uint32_t)base + (pattern & 0x1ffffu));
            }
            src[0] = INFINITY; src[1] = -INFINITY; src[2] = NAN; src[3] = u2f(0x7f7fffffu);
            src[4] = u2f(0x3f808000u); src[5] = u2f(0x3f818000u); /* ties to even, both directions */
            CHECK_EQ_INT(stella_f32_to_bf16(src, out, N, 1.0f), STELLA_OK);
            for (int i = 0; i < N; i++)
                if (out[i] != ref_f32_to_bf16(src[i])) {
                    fprintf(stderr, "bf16 lvl %d: %08x -> %04x, want %04x\n", lvl, f2u(src[i]), out[i], ref_f32_to_bf16(src[i]));
                    g_failures++;
                    break;
                }
        }
    }
    stella_simd_force(-1);
}

static void test_f16_paths_identical(void) {
    /* Every half value converts exactly to float, and back to the same half
     * (NaNs come back quiet with their payload). */
    static uint16_t h[65536], back[65536];
    static float f[65536];
    for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    for (int lvl = 0; lvl <= stella_simd_best(); lvl++) {
        CHECK_EQ_INT(stella_simd_force(lvl), STELLA_OK);
        CHECK_EQ_INT(stella_f16_to_f32(h, f, 65536, 1.0f), STELLA_OK);
        CHECK_EQ_INT(stella_f32_to_f16(f, back, 65536, 1.0f), STELLA_OK);
        for (int i = 0; i < 65536; i++) {
            int e = (i >> 10) & 0x1f, m = i & 0x3ff;
            uint16_t want = (e == 31 && m) ? (uint16_t)(i | 0x200) : (uint16_t)i;
            if (back[i] != want) { fprintf(stderr, "lvl %d: half %04x round trip %04x\n", lvl, i, back[i]); g_failures++; break; }
        }
    }
    /* float -> half on a sweep of float bit patterns: all paths agree bit for bit */
    enum { N = 1 << 16 };
    static float src[N];
    static uint16_t ref[N], got[N];
    for (uint64_t base = 0; base < (1ull << 32); base += (1ull << 32) / 61) {
        for (int i = 0; i < N; i++) src[i] = u2f((uint32_t)(base + (uint64_t)i * 977u));
        CHECK_EQ_INT(stella_simd_force(STELLA_SIMD_SCALAR), STELLA_OK);
        stella_f32_to_f16(src, ref, N, 1.0f);
        for (int lvl = 1; lvl <= stella_simd_best(); lvl++) {
            stella_simd_force(lvl);
            stella_f32_to_f16(src, got, N, 1.0f);
            if (memcmp(ref, got, sizeof ref) != 0) { fprintf(stderr, "f32->f16 differs on level %d near %llx\n", lvl, (unsigned long long)base); g_failures++; }
        }
    }
    stella_simd_force(-1);
}

static void test_accumulate_all_lengths(void) {
    float a[70], b[70], r0[70], r1[70];
    uint16_t hb[70];
    for (int op = STELLA_OP_SUM; op <= STELLA_OP_PROD; op++) {
        for (int n = 0; n <= 70; n++) {
            for (int i = 0; i < 70; i++) {
                a[i] = (float)((i * 37) % 11) - 5.0f; b[i] = (float)((i * 13) % 7) - 3.0f;
            }
            a[3] = NAN; b[5] = NAN; b[7] = INFINITY;
            stella_f32_to_f16(b, hb, 70, 1.0f);
            memcpy(r0, a, sizeof a);
            stella_simd_force(STELLA_SIMD_SCALAR);
            CHECK_EQ_INT(stella_accumulate_f32(r0, b, n, op), STELLA_OK);
            for (int i = n; i < 70; i++) CHECK(f2u(r0[i]) == f2u(a[i])); /* nothing written past n */
            for (int i = 0; i < n; i++) {
                float want = op == STELLA_OP_SUM ? a[i] + b[i] : op == STELLA_OP_PROD ? a[i] * b[i]
                           : op == STELLA_OP_MIN ? (isnan(a[i]) || isnan(b[i]) ? NAN : fminf(a[i], b[i]))
                                                 : (isnan(a[i]) || isnan(b[i]) ? NAN : fmaxf(a[i], b[i]));
                CHECK(isnan(want) ? isnan(r0[i]) : r0[i] == want);
            }
            for (int lvl = 1; lvl <= stella_simd_best(); lvl++) {
                stella_simd_force(lvl);
                memcpy(r1, a, sizeof a);
                stella_accumulate_f32(r1, b, n, op);
                CHECK(memcmp(r0, r1, sizeof r0) == 0);
                float h0[70], h1[70];
                memcpy(h0, a, sizeof a); memcpy(h1, a, sizeof a);
                stella_simd_force(STELLA_SIMD_SCALAR);
                stella_accumulate_f16(h0, hb, n, op);
                stella_simd_force(lvl);
                stella_accumulate_f16(h1, hb, n, op);
                CHECK(memcmp(h0, h1, sizeof h0) == 0);
            }
        }
    }
    stella_simd_force(-1);
}

static void test_validation(void) {
    float x[4] = {0};
    uint16_t h[4];
    uint64_t c;
    CHECK_EQ_INT(stella_f32_to_f16(NULL, h, 4, 1.0f), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_f32_to_f16(x, h, -1, 1.0f), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_f32_to_f16(NULL, NULL, 0, 1.0f), STELLA_OK); /* empty is fine */
    CHECK_EQ_INT(stella_accumulate_f32(x, x, 4, 9), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_checksum64(x, 16, NULL), STELLA_ERR_NULL);
    CHECK_EQ_INT(stella_simd_force(7), STELLA_ERR_ARG);
    CHECK_EQ_INT(stella_checksum64(x, 16, &c), STELLA_OK);
    uint64_t c2;
    x[2] = 1.0f;
    stella_checksum64(x, 16, &c2);
    CHECK(c != c2);
    CHECK(strlen(stella_strerror(STELLA_ERR_MALFORMED)) > 0);
}

int main(void) {
    printf("simd best level: %d\n", stella_simd_best());
    test_validation();
    test_accumulate_all_lengths();
    test_f16_paths_identical();
    test_bf16_against_reference();
    TEST_MAIN_END();
}
