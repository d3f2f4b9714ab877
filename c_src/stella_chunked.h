/* stella_chunked.h - SparseLoCo's compression: top-k per chunk of the tensor, the
 * selected values quantised to a few bits with one scale pair per chunk, and the
 * payload that carries both.
 *
 * Chunks: a tensor of n float32 is cut into chunks of `chunk` entries (a power of
 * two in [STELLA_CHUNK_MIN, STELLA_CHUNK_MAX]), the last one shorter when
 * n % chunk != 0. A full chunk selects k entries; a short tail chunk of len entries
 * selects stella_chunk_k(k, chunk, len) = min(len, max(1, round(k * len / chunk)))
 * (0 when len == 0). Magnitude order, ties, NaN and error feedback follow the
 * selection kernels' rules (stella_compress.h): acc = grad + residual, the top
 * entries of each chunk are sent, residual = acc with the sent entries at +0.0.
 *
 * Quantisation (bits in {2, 4, 8}): a code is a sign bit (the top bit) and a level
 * j of bits-1 bits, M = 2^(bits-1) levels. For each chunk holding selected
 * entries, lo = min |v| and hi = max |v| over them, step = (hi - lo) / (M - 1)
 * (made smaller by ulps until lo + step * (M - 1) is finite);
 * j = round((|v| - lo) / step) (0 when step == 0), and the value becomes
 * sign * (lo + step * j), computed in float32 exactly so by sender and receiver.
 * scales[2c] = lo, scales[2c + 1] = step; a chunk without entries has 0, 0. A
 * chunk holding a NaN or Inf gets the marker lo = NaN, step = 0: all its values
 * become NaN and their codes 0 (the sum over clusters is then not finite and every
 * rank refuses it, as the other routes do).
 *
 * Payload (little-endian):
 *   bytes 0..3   magic "STQZ"
 *   byte  4      version (1)
 *   byte  5      bits (2, 4 or 8)
 *   bytes 6..7   reserved, 0
 *   bytes 8..15  n
 *   bytes 16..19 chunk
 *   bytes 20..23 reserved, 0
 *   bytes 24..31 L: length of the index section
 *   index section: a sparse payload (stella_sparse.h) with value dtype NONE
 *   scales: ceil(n / chunk) x 2 float32 (lo, step)
 *   codes: ceil(k * bits / 8) bytes, entry i's code in bits [i*bits, (i+1)*bits)
 *          (least significant first), the unused bits of the last byte 0.
 * Decoding treats the payload as untrusted: the header, the exact length, the
 * index section (as stella_sparse_decode does), every scale (finite, >= 0, the
 * top level finite; 0, 0 for a chunk without entries; the NaN marker only with
 * codes 0), levels 0 where step == 0, and the padding bits are all checked.
 */
#ifndef STELLA_CHUNKED_H
#define STELLA_CHUNKED_H
#include "stella_common.h"

enum stella_chunked_consts {
    STELLA_CHUNK_MIN = 16,
    STELLA_CHUNK_MAX = 65536,
    STELLA_QPAYLOAD_HEADER = 32
};

/* Entries a chunk of len entries selects when a full chunk selects k (0 <= k <= chunk). */
int stella_chunk_k(int64_t k, int64_t chunk, int64_t len, int64_t *out);
/* Entries the chunked top-k selects from n entries in all (the cap to provide). */
int stella_chunk_topk_count(int64_t n, int64_t chunk, int64_t k, int64_t *total);
/* Top-k per chunk (1 <= k <= chunk), with error feedback when residual is not NULL.
 * idx ascending, room for cap >= stella_chunk_topk_count entries. */
int stella_chunk_topk_f32(const float *grad, float *residual, int64_t n, int64_t chunk, int64_t k,
                          uint32_t *idx, float *val, int64_t cap, int64_t *out_k);

/* Quantise the k selected entries (idx strictly ascending < n) in place: val becomes
 * the values the receiver decodes, scales (nscales == 2 * ceil(n / chunk)) the chunks'
 * (lo, step). With residual (n floats) the rounding error val - new is added at each
 * finite entry's index (error feedback). */
int stella_chunk_quantize_f32(const uint32_t *idx, float *val, int64_t k, int64_t n, int64_t chunk, int bits,
                              float *scales, int64_t nscales, float *residual);

/* Upper bound of the payload of k entries (the capacity to give the encoder). */
int stella_qpayload_bound(int64_t n, int64_t chunk, int64_t k, int bits, int64_t *nbytes);
/* Encode k quantised entries (val exactly on the grid of their chunk's scales, as
 * stella_chunk_quantize_f32 leaves them; STELLA_ERR_ARG otherwise). */
int stella_qpayload_encode(const uint32_t *idx, const float *val, int64_t k, int64_t n, int64_t chunk, int bits,
                           const float *scales, int64_t nscales, uint8_t *out, int64_t cap, int64_t *written);
/* Validate the header, the length and the index section's header of an untrusted
 * payload for a tensor of n entries sent with (chunk, bits); *entries gets k. */
int stella_qpayload_decode_info(const uint8_t *buf, int64_t len, int64_t n, int64_t chunk, int bits,
                                int64_t *entries);
/* Fully validate and decode: idx, val (room for cap entries), scales (nscales). */
int stella_qpayload_decode(const uint8_t *buf, int64_t len, int64_t n, int64_t chunk, int bits,
                           uint32_t *idx, float *val, int64_t cap, float *scales, int64_t nscales, int64_t *out_k);

#endif
