/* stella_sparse.h - wire codec of sparse selections, the k-way merge of sorted
 * sparse lists and the scatter-add into a dense buffer.
 *
 * Payload (little-endian, no padding):
 *   bytes 0..3   magic "STSP"
 *   byte  4      version (1)
 *   byte  5      index scheme (enum stella_index_scheme, never AUTO)
 *   byte  6      value dtype (enum stella_value_dtype)
 *   byte  7      reserved, 0
 *   bytes 8..15  n: numel of the dense tensor
 *   bytes 16..23 count: entries (U32, SEG16, DENSE, IMPLICIT) or blocks (BLOCK16, BLOCK32, MIXED)
 *   bytes 24..31 key: the random-k key for IMPLICIT, the number of single entries for MIXED,
 *                0 otherwise
 *   index section:
 *     U32      count x uint32 index
 *     SEG16    ceil(n / 65536) x uint32 entries per 64K segment, then count x uint16
 *              offset inside its segment
 *     BLOCK16  count x uint16 block id (needs ceil(n/16) <= 65536)
 *     BLOCK32  count x uint32 block id
 *     DENSE    none (count == n, every index in order)
 *     IMPLICIT none (random-k: indices regenerated from key, n and count)
 *     MIXED    whole blocks and single entries: count block ids (uint16 when
 *              ceil(n/16) <= 65536, else uint32), then the singles as in SEG16
 *              (ceil(n / 65536) x uint32 singles per segment, then one uint16
 *              offset each); no single lies in a listed block
 *   value section: one value per entry, float32, float16 or bfloat16 (none for
 *   value dtype NONE), in ascending index order (for MIXED: of the union of blocks and singles).
 * Decoding treats the payload as untrusted: every header field, the exact
 * length, strict ascending order and the range of every index are checked.
 */
#ifndef STELLA_SPARSE_H
#define STELLA_SPARSE_H
#include "stella_common.h"

enum stella_index_scheme {
    STELLA_IDX_AUTO = -1,     /* encoder picks the smallest valid scheme (never IMPLICIT) */
    STELLA_IDX_U32 = 0,
    STELLA_IDX_SEG16 = 1,
    STELLA_IDX_BLOCK16 = 2,
    STELLA_IDX_BLOCK32 = 3,
    STELLA_IDX_DENSE = 4,
    STELLA_IDX_IMPLICIT = 5,
    STELLA_IDX_MIXED = 6      /* AUTO picks it for whole blocks plus single entries */
};

enum stella_value_dtype {
    STELLA_VAL_F32 = 0,
    STELLA_VAL_F16 = 1,       /* round to nearest even; NaN/Inf kept; |x| > 65504 -> Inf */
    STELLA_VAL_BF16 = 2,      /* round to nearest even; NaN/Inf kept */
    STELLA_VAL_NONE = 3       /* no value section: indices only (decoded values are 0); the
                               * index section of a quantised payload (stella_chunked.h) */
};

enum stella_payload_consts {
    STELLA_PAYLOAD_HEADER = 32,
    STELLA_SEGMENT = 65536
};

typedef struct {
    int64_t n;          /* numel in the header */
    int64_t count;      /* header count (entries, or blocks for BLOCK16/32 and MIXED) */
    int64_t entries;    /* (index, value) pairs the payload decodes to */
    int64_t nbytes;     /* exact payload length */
    int32_t scheme;
    int32_t value_dtype;
    uint64_t key;       /* the random-k key (IMPLICIT), the number of singles (MIXED), else 0 */
} stella_payload_info;

/* Exact payload size for a scheme (AUTO and MIXED not allowed: a MIXED size
 * depends on the indices, see stella_encoded_size): entries pairs, of which
 * nblocks blocks for the BLOCK schemes (ignored otherwise). Overflow-checked. */
int stella_payload_size(int64_t n, int64_t entries, int64_t nblocks, int scheme, int value_dtype,
                        int64_t *nbytes);
/* Upper bound of the payload of any explicit-index encoding of k entries (the
 * capacity to allocate for stella_sparse_encode with AUTO). */
int stella_payload_bound(int64_t n, int64_t k, int value_dtype, int64_t *nbytes);
/* The smallest of the schemes whose size depends on counts only (U32, SEG16,
 * BLOCK16/32, DENSE) for k ascending indices < n; whole_blocks is the number of
 * blocks when the indices are exactly whole blocks, else -1. AUTO may still
 * pick MIXED, whose size depends on the indices: stella_encoded_size says. */
int stella_choose_scheme(int64_t n, int64_t k, int64_t whole_blocks, int *scheme);
/* Exact size of the payload stella_sparse_encode writes for k ascending indices
 * < n with this scheme (AUTO: the one it picks, returned in *chosen, which may
 * be NULL). STELLA_ERR_ARG where the scheme cannot carry these indices. */
int stella_encoded_size(const uint32_t *idx, int64_t k, int64_t n, int scheme, int value_dtype,
                        int64_t *nbytes, int *chosen);
/* Number of blocks if idx[0..k) is exactly a set of whole blocks (the short
 * tail block counts when complete up to n), else -1. idx must be ascending < n. */
int stella_whole_blocks(const uint32_t *idx, int64_t k, int64_t n, int64_t *nblocks);

/* Encode k entries (idx strictly ascending, each < n). scheme: AUTO or an
 * explicit one the indices allow (DENSE needs k == n and idx = 0..n-1, BLOCK*
 * needs whole blocks, MIXED at least one whole block; IMPLICIT is refused here:
 * use stella_randomk_encode). AUTO picks the smallest payload, MIXED included
 * (whole aligned blocks among the indices go as block ids, the rest as singles).
 * out has cap bytes; *written gets the payload length. */
int stella_sparse_encode(const uint32_t *idx, const float *val, int64_t k, int64_t n,
                         int scheme, int value_dtype, uint8_t *out, int64_t cap, int64_t *written);
/* Random-k payload: values only, the receiver regenerates the indices from key. */
int stella_randomk_encode(uint64_t key, const float *val, int64_t k, int64_t n, int value_dtype,
                          uint8_t *out, int64_t cap, int64_t *written);

/* Validate the header and the length of an untrusted payload for a tensor of
 * n elements (STELLA_ERR_MALFORMED if anything is wrong). */
int stella_sparse_decode_info(const uint8_t *buf, int64_t len, int64_t n, stella_payload_info *info);
/* Fully validate and decode into idx/val (room for cap entries). For IMPLICIT
 * payloads the header key must equal expected_key. */
int stella_sparse_decode(const uint8_t *buf, int64_t len, int64_t n, uint64_t expected_key,
                         uint32_t *idx, float *val, int64_t cap, int64_t *out_k);

/* k-way merge of w sparse lists, each strictly ascending with indices < n:
 * union of indices, ascending; a value present in several lists is summed in
 * list order (list 0 first), so every rank merging the same lists in the same
 * order gets identical bits. cap >= size of the union (sum of lens always
 * suffices). STELLA_ERR_MALFORMED if a list is unordered or out of range. */
int stella_merge_f32(int64_t w, const uint32_t *const *idx, const float *const *val, const int64_t *lens,
                     int64_t n, uint32_t *out_idx, float *out_val, int64_t cap, int64_t *out_len);

/* dense[idx[i]] += val[i] * scale for i in order (duplicates allowed). Every
 * index is checked (< n) before anything is written. */
int stella_scatter_add_f32(float *dense, int64_t n, const uint32_t *idx, const float *val, int64_t k,
                           float scale);

#endif
