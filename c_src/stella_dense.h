/* stella_dense.h - kernels of the dense path: fused scale-and-cast between
 * float32 and the 16-bit formats, fixed-order accumulation, and a checksum.
 * Lengths are element counts; n == 0 is valid and does nothing.
 */
#ifndef STELLA_DENSE_H
#define STELLA_DENSE_H
#include "stella_common.h"

enum stella_reduce_op {
    STELLA_OP_SUM = 0,
    STELLA_OP_MIN = 1,
    STELLA_OP_MAX = 2,
    STELLA_OP_PROD = 3
};

/* dst[i] = half(src[i] * scale), round to nearest even; NaN stays NaN (quiet), Inf stays Inf. */
int stella_f32_to_f16(const float *src, uint16_t *dst, int64_t n, float scale);
int stella_f32_to_bf16(const float *src, uint16_t *dst, int64_t n, float scale);
/* dst[i] = float(src[i]) * scale. */
int stella_f16_to_f32(const uint16_t *src, float *dst, int64_t n, float scale);
int stella_bf16_to_f32(const uint16_t *src, float *dst, int64_t n, float scale);
/* x[i] *= scale. */
int stella_scale_f32(float *x, int64_t n, float scale);

/* acc[i] = acc[i] OP src[i]. MIN/MAX propagate NaN (like torch.minimum).
 * Summing buffers one after the other in a fixed order gives results that are
 * bit-identical on every rank and every SIMD path. */
int stella_accumulate_f32(float *acc, const float *src, int64_t n, int op);
int stella_accumulate_f16(float *acc, const uint16_t *src, int64_t n, int op);
int stella_accumulate_bf16(float *acc, const uint16_t *src, int64_t n, int op);

/* 64-bit checksum of a byte buffer (not cryptographic); used to compare
 * parameters across ranks without moving them. */
int stella_checksum64(const void *data, int64_t nbytes, uint64_t *out);

#endif
