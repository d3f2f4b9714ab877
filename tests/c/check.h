/* check.h - a tiny assertion helper for the C tests run by ctest. */
#ifndef STELLA_TEST_CHECK_H
#define STELLA_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>

static int g_failures = 0;
#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); g_failures++; } } while (0)
#define CHECK_EQ_INT(a, b) do { long long a_ = (long long)(a), b_ = (long long)(b); if (a_ != b_) { \
    fprintf(stderr, "%s:%d: %s == %lld, expected %lld\n", __FILE__, __LINE__, #a, a_, b_); g_failures++; } } while (0)
#define TEST_MAIN_END() do { \
    if (g_failures) { fprintf(stderr, "%d check(s) failed\n", g_failures); return 1; } \
    printf("all checks passed\n"); return 0; } while (0)
#endif
