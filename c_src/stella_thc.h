/* stella_thc.h - homomorphic quantization of the cross-cluster sum (the idea of THC:
 * every cluster quantizes with the same scales, so the integer levels of all clusters can be
 * summed as they travel, with no decode and re-encode at each hop).
 *
 * One step, for a float32 vector x of n entries held by each of C clusters:
 *   1. optional rotation (stella_thc_rotate): a randomized Hadamard transform of each full
 *      block of 2^block_log2 entries, the same on every rank (key), which spreads outliers so
 *      that the shared scale fits most entries well; the tail of n % 2^block_log2 entries is
 *      left as it is. Orthonormal: the inverse undoes it up to float rounding.
 *   2. scales: one per scale block of 2^scale_log2 consecutive entries (the last block may be
 *      shorter; stella_thc_scale_count gives how many): the largest |x| of that block over
 *      every cluster (stella_thc_absmax per block, then one small MAX collective, done by the
 *      caller). scale_log2 = STELLA_THC_ONE_SCALE gives one scale for the whole vector. One
 *      scale per block matters: a vector that fuses tensors of very different magnitudes
 *      (embeddings, weights, biases in one bucket) under one scale rounds the small ones to
 *      zero step after step.
 *   3. quantize (stella_thc_quantize): with L = 2^(bits-1) - 1 levels each side and s the
 *      scale of entry i's block,
 *        q = clamp(floor(x * (L / s) + u), -L, L), u in [0, 1) drawn from (key, index)
 *      (stochastic rounding: E[q] = x * L / s), stored as the unsigned level q + L in a
 *      lane of lane_bits bits; 64 / lane_bits lanes per 64-bit word, entry i in word
 *      i / lanes at bit (i % lanes) * lane_bits, unused lanes zero. x is overwritten with
 *      q * (s / L), what this rank sent (for error feedback).
 *   4. the words of every cluster are added as 64-bit integers (MPI's SUM on MPI_UINT64_T,
 *      along whatever reduce-scatter/all-gather or ring the MPI library uses). A lane of
 *      stella_thc_lane_bits(bits, C) bits holds the sum of C levels (at most 2 L C), so no
 *      carry crosses into the next lane: integer addition of the words sums every lane.
 *   5. stella_thc_unpack_sum: sum_i = (lane_i - C L) * (s / L), after checking every lane
 *      is at most 2 L C and every unused lane and bit is zero (a peer's words are untrusted).
 *
 * Float arithmetic is the exact sequence written above (single precision, no fused
 * multiply-add), so a numpy reference reproduces steps 3 and 5 bit for bit. The random
 * draws are integer hashes: the same on every machine.
 */
#ifndef STELLA_THC_H
#define STELLA_THC_H
#include "stella_common.h"

enum stella_thc_limits {
    STELLA_THC_MIN_BITS = 2,
    STELLA_THC_MAX_BITS = 8,
    STELLA_THC_MAX_CLUSTERS = 65536,
    STELLA_THC_MAX_BLOCK_LOG2 = 16,
    STELLA_THC_ONE_SCALE = 62 /* scale_log2 giving one scale block for any vector */
};

/* Bits of a lane that holds the sum of nclusters levels of `bits` bits: the bit length of
 * 2 L nclusters (bits in [2, 8], nclusters in [1, STELLA_THC_MAX_CLUSTERS]). */
int stella_thc_lane_bits(int bits, int nclusters, int *lane_bits);

/* 64-bit words that hold n lanes of lane_bits bits (lane_bits in [1, 32], n >= 0). */
int stella_thc_words(int64_t n, int lane_bits, int64_t *words);

/* Randomized Hadamard rotation in place: each full block of 2^block_log2 entries (block_log2
 * in [1, STELLA_THC_MAX_BLOCK_LOG2]) becomes H (D x) / sqrt(2^block_log2), D the diagonal of
 * signs s_i = bit (i % 64) of mix64(key ^ (i / 64)) (1: negative), i the index in x.
 * inverse != 0 applies D H x / sqrt(2^block_log2), which undoes it. */
int stella_thc_rotate(float *x, int64_t n, int block_log2, uint64_t key, int inverse);

/* The number of scale blocks of 2^scale_log2 entries (the last one may be shorter) in n
 * entries: ceil(n / 2^scale_log2), 0 for n = 0. scale_log2 in [0, STELLA_THC_ONE_SCALE]. */
int stella_thc_scale_count(int64_t n, int scale_log2, int64_t *count);

/* absmax[b] = the largest |x_i| over the finite entries of scale block b (0 when none), for
 * each of the count = stella_thc_scale_count(n, scale_log2) blocks (STELLA_ERR_SIZE when
 * count differs), and the number of entries that are NaN or +-Inf. */
int stella_thc_absmax(const float *x, int64_t n, int scale_log2, float *absmax, int64_t count,
                      int64_t *nonfinite);

/* Step 3 above. scales: count = stella_thc_scale_count(n, scale_log2) of them (STELLA_ERR_SIZE
 * otherwise), each >= 0 and finite; every x_i finite (STELLA_ERR_ARG otherwise, checked
 * before anything is written); a scale of 0, or one so small that L / s overflows, gives
 * level L (zero) in its whole block; |x| beyond its block's scale is clamped to the extreme
 * level. stochastic = 0 rounds to the nearest level instead (u = 0.5, ties up; key unused).
 * The draw of entry i: h = mix64(key + (i / 2) * 0xd1342543de82ef95), u = (h >> 40) * 2^-24
 * for even i and ((h >> 16) & 0xffffff) * 2^-24 for odd i. words has room for cap words, at
 * least stella_thc_words(n, lane_bits); lane_bits >= stella_thc_lane_bits(bits, 1). */
int stella_thc_quantize(float *x, int64_t n, int bits, const float *scales, int64_t count, int scale_log2,
                        int stochastic, uint64_t key, int lane_bits, uint64_t *words, int64_t cap);

/* Step 5 above: words (nwords of them, exactly stella_thc_words(n, lane_bits)) hold the sum
 * of nclusters quantized vectors quantized with the same scales (count of them, as for
 * stella_thc_quantize); out gets n floats. STELLA_ERR_MALFORMED when a lane exceeds
 * 2 L nclusters or an unused lane or bit is not zero (out is then unspecified). */
int stella_thc_unpack_sum(const uint64_t *words, int64_t nwords, int64_t n, int bits, int nclusters,
                          int lane_bits, const float *scales, int64_t count, int scale_log2, float *out);

#endif
