/* Private helpers shared by every layer: error reporting and checked
 * arithmetic.  Not installed. */
#ifndef LADEN_CORE_INTERNAL_H
#define LADEN_CORE_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <string.h>

#include "laden.h"

#define LADEN__FMT(a, b) __attribute__((format(printf, a, b)))

/* Records a printf-style detail for laden_last_error() on this thread and
 * returns status, so callers write `return laden__fail(LADEN_E_X, ...)`. */
laden_status laden__fail(laden_status status, const char *fmt, ...)
    LADEN__FMT(2, 3);
laden_status laden__vfail(laden_status status, const char *fmt, va_list ap);

/* Prefixes the current detail with more context ("reading x: <detail>"). */
void laden__error_prefix(const char *fmt, ...) LADEN__FMT(1, 2);

/* Clears the detail (successful calls do not clear it; callers that retry
 * after a failure do). */
void laden__error_clear(void);

/* Overflow-checked arithmetic; false on overflow. */
static inline bool laden__add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}
static inline bool laden__mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* Little-endian integers in bytes (laden's own formats: lossless blobs
 * and cache files). */
static inline void laden__put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static inline void laden__put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint64_t laden__get64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}
static inline uint32_t laden__get32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}

/* Bytes for messages: "512 B", "68.6 kB", "1.50 GB" (decimal units) in
 * buf, which it returns. */
typedef struct laden__bytes_text {
    char s[24];
} laden__bytes_text;
laden__bytes_text laden__bytes(uint64_t n);

/* UTF-8 (core/status.c): the length of the valid sequence at p (1..4; 0
 * if invalid: overlong forms, surrogates, code points above U+10FFFF),
 * and the offset of the first invalid byte of s[0, n) (n if none). */
size_t laden__utf8_len(const unsigned char *p, const unsigned char *end);
size_t laden__utf8_check(const char *s, size_t n);

/* A number for the calling thread, never 0, never reused in the process:
 * the owner of an object that one thread at a time may use. */
uint64_t laden__thread_id(void);

/* Monotonic clock in nanoseconds. */
uint64_t laden__now_ns(void);

/* Dtype facts and the scalar float conversions (src/core/dtype.c). */
#include "dtype_internal.h"

#define LADEN__ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif
