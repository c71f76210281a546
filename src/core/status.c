/* Status names and messages from the one list; the thread-local detail. */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define LADEN__ERR_BYTES 1024

static _Thread_local char err_buf[LADEN__ERR_BYTES];

const char *laden_version(void)
{
#define STR2(x) #x
#define STR(x) STR2(x)
    return STR(LADEN_VERSION_MAJOR) "." STR(LADEN_VERSION_MINOR) "." STR(
        LADEN_VERSION_PATCH);
#undef STR
#undef STR2
}

const char *laden_status_name(int status)
{
    switch (status) {
#define NAME_CASE(name, value, msg) \
    case value:                     \
        return #name;
        LADEN_STATUS_LIST(NAME_CASE)
#undef NAME_CASE
    }
    return "UNKNOWN";
}

const char *laden_status_message(int status)
{
    switch (status) {
#define MSG_CASE(name, value, msg) \
    case value:                    \
        return msg;
        LADEN_STATUS_LIST(MSG_CASE)
#undef MSG_CASE
    }
    return "unknown status";
}

const char *laden_last_error(void) { return err_buf; }

laden_status laden__vfail(laden_status status, const char *fmt, va_list ap)
{
    vsnprintf(err_buf, sizeof err_buf, fmt, ap);
    return status;
}

laden_status laden__fail(laden_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    laden__vfail(status, fmt, ap);
    va_end(ap);
    return status;
}

void laden__error_prefix(const char *fmt, ...)
{
    char prefix[LADEN__ERR_BYTES];
    char old[LADEN__ERR_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err_buf, sizeof old);
    size_t n = strlen(prefix);
    if (n > sizeof err_buf - 3)
        n = sizeof err_buf - 3;
    memcpy(err_buf, prefix, n);
    memcpy(err_buf + n, ": ", 2);
    size_t rest = sizeof err_buf - n - 3;
    size_t m = strnlen(old, rest);
    memcpy(err_buf + n + 2, old, m);
    err_buf[n + 2 + m] = '\0';
}

void laden__error_clear(void) { err_buf[0] = '\0'; }

uint64_t laden__thread_id(void)
{
    static _Atomic uint64_t next = 1;
    static _Thread_local uint64_t id;
    if (!id)
        id = atomic_fetch_add(&next, 1);
    return id;
}

uint64_t laden__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

laden__bytes_text laden__bytes(uint64_t n)
{
    laden__bytes_text t;
    static const char *const unit[] = {"kB", "MB", "GB", "TB", "PB", "EB"};
    if (n < 1000) {
        snprintf(t.s, sizeof t.s, "%llu B", (unsigned long long)n);
        return t;
    }
    double v = (double)n / 1000.0;
    int u = 0;
    while (v >= 1000.0 && u < 5) {
        v /= 1000.0;
        u++;
    }
    snprintf(t.s, sizeof t.s, v >= 100 ? "%.0f %s" : v >= 10 ? "%.1f %s"
                                                             : "%.2f %s",
             v, unit[u]);
    return t;
}

/* Length of the valid UTF-8 sequence at p (1..4), or 0 if invalid:
 * overlong forms, surrogates and code points above U+10FFFF are invalid. */
size_t laden__utf8_len(const unsigned char *p, const unsigned char *end)
{
    unsigned char c = p[0];
    size_t n;
    uint32_t cp, min;
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        n = 2;
        cp = c & 0x1f;
        min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        cp = c & 0x0f;
        min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        cp = c & 0x07;
        min = 0x10000;
    } else {
        return 0;
    }
    if ((size_t)(end - p) < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        cp = cp << 6 | (p[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return n;
}

/* The offset of the first byte of s[0, n) that is not valid UTF-8, or n
 * if all of it is. */
size_t laden__utf8_check(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s, *end = p + n;
    while (p < end) {
        size_t k = laden__utf8_len(p, end);
        if (!k)
            return (size_t)(p - (const unsigned char *)s);
        p += k;
    }
    return n;
}
