/* common.c - status strings and SIMD level detection/forcing. */
#include "simd_internal.h"
#include <stdlib.h>
#include <string.h>

const char *stella_strerror(int code) {
    switch (code) {
    case STELLA_OK: return "ok";
    case STELLA_ERR_NULL: return "a required pointer is NULL";
    case STELLA_ERR_ARG: return "an argument is out of range";
    case STELLA_ERR_SIZE: return "an output buffer is too small";
    case STELLA_ERR_MALFORMED: return "malformed payload";
    case STELLA_ERR_NOMEM: return "out of memory";
    case STELLA_ERR_UNSUPPORTED: return "not supported on this CPU";
    case STELLA_ERR_TIMEOUT: return "timed out (the work is still running)";
    case STELLA_ERR_BUSY: return "busy: a previous batch is still running";
    case STELLA_ERR_SYSTEM: return "an operating-system call failed";
    default: return "unknown error";
    }
}

static int detect_best(void) {
#if STELLA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
        return STELLA_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
        return STELLA_SIMD_AVX2;
#endif
    return STELLA_SIMD_SCALAR;
}

/* -2: not yet decided. Accessed with GCC atomics: kernels run on many threads. */
static int g_best = -2;
static int g_active = -2;

int stella_simd_best(void) {
    int b = __atomic_load_n(&g_best, __ATOMIC_ACQUIRE);
    if (b == -2) {
        b = detect_best();
        __atomic_store_n(&g_best, b, __ATOMIC_RELEASE);
    }
    return b;
}

static int level_from_env(int best) {
    const char *e = getenv("STELLA_SIMD");
    if (!e || !*e || strcmp(e, "auto") == 0) return best;
    int want = best;
    if (strcmp(e, "scalar") == 0) want = STELLA_SIMD_SCALAR;
    else if (strcmp(e, "avx2") == 0) want = STELLA_SIMD_AVX2;
    else if (strcmp(e, "avx512") == 0) want = STELLA_SIMD_AVX512;
    return want < best ? want : best; /* never above what the CPU has */
}

int stella_simd_level_internal(void) {
    int a = __atomic_load_n(&g_active, __ATOMIC_ACQUIRE);
    if (a == -2) {
        a = level_from_env(stella_simd_best());
        __atomic_store_n(&g_active, a, __ATOMIC_RELEASE);
    }
    return a;
}

int stella_simd_active(void) { return stella_simd_level_internal(); }

int stella_simd_force(int level) {
    if (level == -1) {
        __atomic_store_n(&g_active, level_from_env(stella_simd_best()), __ATOMIC_RELEASE);
        return STELLA_OK;
    }
    if (level < STELLA_SIMD_SCALAR || level > STELLA_SIMD_AVX512) return STELLA_ERR_ARG;
    if (level > stella_simd_best()) return STELLA_ERR_UNSUPPORTED;
    __atomic_store_n(&g_active, level, __ATOMIC_RELEASE);
    return STELLA_OK;
}
