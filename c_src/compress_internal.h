/* compress_internal.h - not public: helpers shared by the selection, random-k,
 * codec and merge sources (magnitude keys, selection of the m-th largest). */
#ifndef STELLA_COMPRESS_INTERNAL_H
#define STELLA_COMPRESS_INTERNAL_H
#include "stella_compress.h"
#include "stella_sparse.h"
#include "simd_internal.h"
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the sparse wire format and kernels assume a little-endian host"
#endif

/* Every NaN maps to this key: just above +Inf (0x7f800000). */
#define STELLA_KEY_NAN 0x7f800001u
/* A threshold no key exceeds. */
#define STELLA_T_NONE 0x7fffffff

static inline uint32_t stella_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float stella_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Magnitude key: the bits of |x| (monotone in |x| for non-NaN), NaN -> KEY_NAN. */
static inline uint32_t stella_key_bits(uint32_t u) {
    u &= 0x7fffffffu;
    return u > STELLA_KEY_NAN ? STELLA_KEY_NAN : u;
}
static inline uint32_t stella_mag_key(float f) { return stella_key_bits(stella_f2u(f)); }
static inline float stella_absf(float f) { return stella_u2f(stella_f2u(f) & 0x7fffffffu); }

/* splitmix64's finalizer: the keyed hashes of random-k and THC (integer arithmetic only, so
 * every rank and machine draws the same values). */
static inline uint64_t stella_mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The m-th largest (1 <= m <= n) of n distinct 64-bit values; reorders a. */
uint64_t stella_select_desc_u64(uint64_t *a, int64_t n, int64_t m);

/* Sort n uint32 ascending (LSD radix); tmp has room for n. */
void stella_sort_u32(uint32_t *a, uint32_t *tmp, int64_t n);

/* Pairwise block score (the fixed tree of stella_block_topk_f32) of 16 values. */
static inline float stella_block_score16(const float *x) {
    float u[8], w[4], y[2];
    for (int i = 0; i < 8; i++) u[i] = stella_absf(x[i]) + stella_absf(x[i + 8]);
    for (int i = 0; i < 4; i++) w[i] = u[i] + u[i + 4];
    for (int i = 0; i < 2; i++) y[i] = w[i] + w[i + 2];
    return y[0] + y[1];
}

#endif
