/* simd_internal.h - not part of the public API: target attributes and the
 * run-time dispatch helpers used inside c_src/. Builds never pass -march, so
 * one binary runs on every x86-64 CPU; wider paths are compiled per function. */
#ifndef STELLA_SIMD_INTERNAL_H
#define STELLA_SIMD_INTERNAL_H
#include "stella_common.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define STELLA_X86 1
#define STELLA_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
#define STELLA_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,popcnt")))
#else
#define STELLA_X86 0
#endif

/* Level kernels should use now. Cheap: one relaxed atomic load after the first call. */
int stella_simd_level_internal(void);

#endif
