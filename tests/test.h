/* The in-house test runner's interface.  Each TEST runs in its own process
 * with a timeout; a test fails by exiting non-zero (CHECK does that), is
 * skipped by SKIP().  The runner's last line is "N passed, N failed". */
#ifndef LADEN_TEST_H
#define LADEN_TEST_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "laden.h"

typedef void (*laden_test_fn)(void);
void test_register(const char *name, laden_test_fn fn);

#define TEST(name)                                                    \
    static void test_##name(void);                                    \
    __attribute__((constructor)) static void register_##name(void)    \
    {                                                                 \
        test_register(#name, test_##name);                            \
    }                                                                 \
    static void test_##name(void)

#define TEST_SKIP_CODE 77

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__,         \
                    __LINE__, #cond);                                      \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

#define CHECK_OK(expr)                                                     \
    do {                                                                   \
        int s_ = (expr);                                                   \
        if (s_ != LADEN_OK) {                                              \
            fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__,       \
                    __LINE__, #expr, laden_status_name(s_),                \
                    laden_last_error());                                   \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

#define CHECK_STATUS(expr, want)                                           \
    do {                                                                   \
        int s_ = (expr);                                                   \
        if (s_ != (want)) {                                                \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n",   \
                    __FILE__, __LINE__, #expr, laden_status_name(s_),      \
                    laden_status_name(want), laden_last_error());          \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

/* a == b for integers (and pointers), printing both values (and their
 * expressions) when they differ.  Floating values are refused at compile
 * time: converted to integers they would compare equal when they are not
 * (use CHECK_FEQ). */
#define TEST_IS_FLOAT(x)                                                   \
    _Generic((x), float: 1, double: 1, long double: 1, default: 0)
#define CHECK_EQ(a, b)                                                     \
    do {                                                                   \
        _Static_assert(!TEST_IS_FLOAT(a) && !TEST_IS_FLOAT(b),             \
                       "CHECK_EQ compares integers: use CHECK_FEQ");       \
        long long a_ = (long long)(a), b_ = (long long)(b);                \
        if (a_ != b_) {                                                    \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs "   \
                    "%lld)\n", __FILE__, __LINE__, #a, #b, a_, b_);        \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

/* a == b, exactly, for floating values, printing both. */
#define CHECK_FEQ(a, b)                                                    \
    do {                                                                   \
        double a_ = (double)(a), b_ = (double)(b);                         \
        if (!(a_ == b_)) {                                                 \
            fprintf(stderr, "%s:%d: CHECK_FEQ failed: %s == %s (%.9g vs "  \
                    "%.9g)\n", __FILE__, __LINE__, #a, #b, a_, b_);        \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

#define CHECK_CONTAINS(hay, needle)                                        \
    do {                                                                   \
        const char *h_ = (hay);                                            \
        if (!h_ || !strstr(h_, (needle))) {                                \
            fprintf(stderr, "%s:%d: '%s' does not contain '%s'\n",         \
                    __FILE__, __LINE__, h_ ? h_ : "(null)", (needle));     \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

#define SKIP(why)                                                          \
    do {                                                                   \
        fprintf(stderr, "skipped: %s\n", (why));                           \
        exit(TEST_SKIP_CODE);                                              \
    } while (0)

/* Helpers shared by the tests (helpers.c). */
const char *test_tmpdir(void); /* a fresh directory for this process */
/* One in /dev/shm (tmpfs, which CUDA can pin), else test_tmpdir();
 * removed when the process exits, as test_tmpdir's is. */
const char *test_shm_dir(void);
/* Runs fn on the CPU device, then on every CUDA device there is (saying so
 * when there is none). */
void test_on_every_device(void (*fn)(int32_t device));
/* Writes a safetensors file: 8-byte length, header text, data. */
/* The CUDA driver's entry point `name` (the real driver's or the
 * stand-in's), for tests that check what laden did with it; the device a
 * device pointer is on; the context a stream handle is of; a device's
 * primary context. */
void *test_cuda_fn(const char *name);
int32_t test_cuda_device_of(uint64_t p);
void *test_cuda_stream_ctx(uintptr_t stream);
void *test_cuda_primary_ctx(int32_t dev);
void test_write_st(const char *path, const char *header, const void *data,
                   size_t data_len);
void test_write_file(const char *path, const void *data, size_t len);
/* tmpdir/name in one of 64 rotating static buffers. */
char *test_path(const char *name);
/* How many lines of the text file at path contain `what`. */
size_t test_lines_containing(const char *path, const char *what);

#endif
