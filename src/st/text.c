/* Small files read whole and checked: the JSON and text files beside a
 * checkpoint (config.json, adapter_config.json, a tokenizer's files) and
 * laden's own trace files (laden_st_read_text).  One reader for every
 * caller, so that each refuses what is not a regular file, what is too
 * large, what is not UTF-8 and what is not JSON in the same words, and
 * Python parses only text this layer's strict parser accepted.  Also the
 * opening of a regular file without blocking that st.c uses. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "laden/st.h"

static const char *file_kind(mode_t m)
{
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
                         : "not a file";
}

laden_status laden__st_open_fd(const char *path, int *fd, uint64_t *size,
                               struct stat *out_sb)
{
    struct stat sb;
    int flags;
    *size = 0;
    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (*fd < 0) {
        int e = errno;
        return laden__fail(e == ENOENT ? LADEN_E_NOENT : LADEN_E_IO,
                           "%s: cannot open: %s", path, strerror(e));
    }
    const char *why = NULL;
    int e = 0;
    if (fstat(*fd, &sb) != 0)
        why = "cannot stat", e = errno;
    else if (!S_ISREG(sb.st_mode)) {
        close(*fd);
        *fd = -1;
        return laden__fail(LADEN_E_INVAL, "%s: not a regular file (%s)", path,
                           file_kind(sb.st_mode));
    } else if ((flags = fcntl(*fd, F_GETFL)) < 0 ||
               fcntl(*fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
        why = "cannot clear O_NONBLOCK", e = errno;
    if (why) {
        close(*fd);
        *fd = -1;
        return laden__fail(LADEN_E_IO, "%s: %s: %s", path, why, strerror(e));
    }
    *size = (uint64_t)sb.st_size;
    if (out_sb)
        *out_sb = sb;
    return LADEN_OK;
}

/* Reads fd to its end into a new buffer (NUL-terminated); more than max
 * bytes is LADEN_E_LIMIT.  A file's stated size is a hint only. */
static laden_status read_all(const char *path, int fd, uint64_t hint,
                             uint64_t max, char **out, uint64_t *len)
{
    uint64_t cap = (hint < max ? hint : max) + 1, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf)
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory reading it",
                           path);
    for (;;) {
        if (n == cap) {
            if (cap > max) {
                free(buf);
                return laden__fail(LADEN_E_LIMIT,
                                   "%s: larger than %llu bytes: not a file "
                                   "laden reads here",
                                   path, (unsigned long long)max);
            }
            uint64_t more = cap * 2 > max + 1 ? max + 1 : cap * 2;
            char *p = realloc(buf, more + 1);
            if (!p) {
                free(buf);
                return laden__fail(LADEN_E_NOMEM,
                                   "%s: out of memory reading it", path);
            }
            buf = p;
            cap = more;
        }
        ssize_t got = read(fd, buf + n, cap - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            int e = errno;
            free(buf);
            return laden__fail(LADEN_E_IO, "%s: cannot read it: %s", path,
                               strerror(e));
        }
        if (got == 0)
            break;
        n += (uint64_t)got;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return LADEN_OK;
}

/* The JSON error the parser left, said again with the line and column of
 * byte `at` and the text found there. */
static laden_status where(laden_status s, const char *path, const char *text,
                          size_t n, size_t at)
{
    size_t line = 1, col = 1;
    for (size_t k = 0; k < at && k < n; k++) {
        if (text[k] == '\n')
            line++, col = 1;
        else
            col++;
    }
    char near[16];
    size_t k = 0;
    for (; k < sizeof near - 1 && at + k < n; k++) {
        unsigned char c = (unsigned char)text[at + k];
        near[k] = c >= 0x20 && c < 0x7f ? (char)c : '?';
    }
    near[k] = '\0';
    char msg[256];
    snprintf(msg, sizeof msg, "%s", laden_last_error());
    return laden__fail(s, "%s: not JSON laden reads: %s, at line %zu column "
                       "%zu (near '%s')",
                       path, msg, line, col, near);
}

laden_status laden_st_read_text(const char *path, uint64_t max_bytes,
                                uint32_t flags, void **out, uint64_t *len)
{
    if (out)
        *out = NULL;
    if (len)
        *len = 0;
    if (!path || !out || !len)
        return laden__fail(LADEN_E_INVAL, "laden_st_read_text: NULL");
    int fd;
    uint64_t size;
    char *text = NULL;
    laden_status s = laden__st_open_fd(path, &fd, &size, NULL);
    if (s)
        return s;
    if (max_bytes > ((uint64_t)SIZE_MAX >> 1))
        max_bytes = (uint64_t)SIZE_MAX >> 1; /* cap + 1 cannot wrap */
    if (size > max_bytes) {
        close(fd);
        return laden__fail(LADEN_E_LIMIT, "%s: larger than %llu bytes: not "
                           "a file laden reads here",
                           path, (unsigned long long)max_bytes);
    }
    s = read_all(path, fd, size, max_bytes, &text, len);
    close(fd);
    if (s)
        return s;
    size_t bad = laden__utf8_check(text, (size_t)*len);
    if (bad < *len) {
        free(text);
        *len = 0;
        return laden__fail(LADEN_E_JSON, "%s: not UTF-8 text (byte %zu)",
                           path, bad);
    }
    if (flags & LADEN_ST_TEXT_JSON) {
        laden__json j;
        laden__json_init(&j, text, (size_t)*len);
        s = laden__json_skip(&j, LADEN__JSON_NUM_DEPTH);
        if (!s && !laden__json_at_end(&j))
            s = laden__fail(LADEN_E_JSON, "more after the value");
        if (s) {
            s = where(s, path, text, (size_t)*len, laden__json_pos(&j));
            free(text);
            *len = 0;
            return s;
        }
    }
    *out = text;
    return LADEN_OK;
}

void laden_st_text_free(void *text)
{
    free(text);
}
