/* stella_common.h - status codes and SIMD dispatch control shared by every kernel.
 *
 * Public headers in c_src/ are read by the cffi builder after stripping
 * preprocessor lines, so they hold only enums, typedefs and prototypes.
 */
#ifndef STELLA_COMMON_H
#define STELLA_COMMON_H
#include <stdint.h>
#include <stddef.h>

/* Every entry point returns one of these; none aborts. */
enum stella_status {
    STELLA_OK = 0,
    STELLA_ERR_NULL = 1,        /* a required pointer was NULL */
    STELLA_ERR_ARG = 2,         /* an argument is out of its domain */
    STELLA_ERR_SIZE = 3,        /* an output buffer is too small */
    STELLA_ERR_MALFORMED = 4,   /* an input payload failed validation */
    STELLA_ERR_NOMEM = 5,       /* allocation failed */
    STELLA_ERR_UNSUPPORTED = 6, /* the CPU lacks the requested feature */
    STELLA_ERR_TIMEOUT = 7,     /* a wait reached its deadline; the work is still in flight */
    STELLA_ERR_BUSY = 8,        /* the object is in use (e.g. a pool batch is still running) */
    STELLA_ERR_SYSTEM = 9       /* an OS call failed (thread creation, affinity) */
};

enum stella_simd {
    STELLA_SIMD_SCALAR = 0,
    STELLA_SIMD_AVX2 = 1,
    STELLA_SIMD_AVX512 = 2
};

const char *stella_strerror(int code);

/* Best level this CPU supports. */
int stella_simd_best(void);
/* Level the kernels use now (the best one unless forced). */
int stella_simd_active(void);
/* Force a level (for tests and benchmarks); -1 returns to automatic.
 * Returns STELLA_ERR_UNSUPPORTED when the CPU lacks the level. */
int stella_simd_force(int level);

#endif
