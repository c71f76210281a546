/* Safetensors headers: parse, validate, index.  See include/laden/st.h.
 *
 * File layout: 8-byte little-endian header length N, N bytes of JSON, then
 * the data section.  Every tensor's data_offsets are relative to the data
 * section; together they must tile it exactly (no gaps, no overlap). */
#define _GNU_SOURCE
#include "laden/st.h"
#include "laden/gguf.h"
#include "laden/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/internal.h"
#include "json.h"
#include "../gguf/gguf_internal.h"

typedef struct entry {
    const char *name;
    laden_dtype dtype;
    uint32_t ndim;
    size_t dims_at; /* index into st->dims */
    uint32_t file;
    uint64_t begin, end; /* relative to the file's data section */
} entry;

typedef struct stfile {
    char *path;
    uint64_t size;
    uint64_t data_start;
    char *pool; /* the file's decoded strings */
    /* What the file was when its header was read (see
     * laden_st_file_open); none for a checkpoint in memory. */
    bool known;
    uint64_t dev, ino, mtime_ns, ctime_ns;
    uint64_t head_bytes, head_sum; /* its header: bytes and checksum */
} stfile;

struct laden_st {
    stfile *files;
    size_t nfiles;
    entry *t;
    size_t n, cap;
    uint64_t *dims;
    size_t ndims, dims_cap;
    size_t *by_name; /* indices into t sorted by name */
    const char **meta; /* key, value, key, value ... */
    size_t nmeta, meta_cap;
    uint64_t total_bytes;
    bool gguf; /* opened from a GGUF file */
};

static laden_status nomem(const char *what)
{
    return laden__fail(LADEN_E_NOMEM, "out of memory while %s", what);
}

/* ---- one file's header ---------------------------------------------- */

typedef struct parse_ctx {
    laden_st_t *st;
    uint32_t file;
    const char *path;
    char *pool;
    size_t pool_cap, pool_at;
    uint64_t data_len;
    bool keep_meta;
} parse_ctx;

static laden_status pool_string(parse_ctx *c, laden__json *j, char **out,
                                size_t *len, bool *has_nul)
{
    char *dst = c->pool + c->pool_at;
    size_t n;
    laden_status s = laden__json_string(j, dst, c->pool_cap - c->pool_at, &n,
                                        has_nul);
    if (s)
        return s;
    c->pool_at += n + 1;
    *out = dst;
    if (len)
        *len = n;
    return LADEN_OK;
}

static laden_status parse_metadata(parse_ctx *c, laden__json *j)
{
    laden_st_t *st = c->st;
    laden_status s;
    int more;
    if ((s = laden__json_need_value(j)))
        return s;
    if (laden__json_kind(j) != '{')
        return laden__fail(LADEN_E_SCHEMA,
                           "__metadata__ at byte %zu is not an object",
                           laden__json_pos(j));
    j->p++;
    if (laden__json_peek(j, '}')) {
        j->p++;
        return LADEN_OK;
    }
    do {
        char *k, *v;
        if ((s = pool_string(c, j, &k, NULL, NULL)) ||
            (s = laden__json_expect(j, ':')))
            return s;
        if ((s = laden__json_need_value(j)))
            return s;
        if (laden__json_kind(j) != '"')
            return laden__fail(LADEN_E_SCHEMA,
                               "__metadata__ value of '%.200s' at byte %zu "
                               "is not a string",
                               k, laden__json_pos(j));
        if ((s = pool_string(c, j, &v, NULL, NULL)))
            return s;
        if (c->keep_meta) {
            if (!laden__st_grow((void **)&st->meta, &st->meta_cap,
                                st->nmeta + 2, sizeof *st->meta))
                return nomem("parsing __metadata__");
            st->meta[st->nmeta++] = k;
            st->meta[st->nmeta++] = v;
        }
        if ((s = laden__json_next(j, '}', &more)))
            return s;
    } while (more);
    return LADEN_OK;
}

static laden_status parse_shape(parse_ctx *c, laden__json *j, const char *name,
                                entry *e)
{
    laden_st_t *st = c->st;
    laden_status s;
    int more;
    if ((s = laden__json_need_value(j)))
        return s;
    if (laden__json_kind(j) != '[')
        return laden__fail(LADEN_E_SCHEMA,
                           "shape of tensor '%.200s' is not an array", name);
    j->p++;
    e->dims_at = st->ndims;
    e->ndim = 0;
    if (laden__json_peek(j, ']')) {
        j->p++;
        return LADEN_OK;
    }
    do {
        uint64_t d;
        if (e->ndim >= LADEN_ST_MAX_RANK)
            return laden__fail(LADEN_E_LIMIT,
                               "tensor '%.200s' has more than %u dimensions",
                               name, LADEN_ST_MAX_RANK);
        if ((s = laden__json_uint(j, &d))) {
            laden__error_prefix("shape of tensor '%.200s'", name);
            return s;
        }
        if (!laden__st_grow((void **)&st->dims, &st->dims_cap,
                            st->ndims + 1, sizeof *st->dims))
            return nomem("parsing shapes");
        st->dims[st->ndims++] = d;
        e->ndim++;
        if ((s = laden__json_next(j, ']', &more)))
            return s;
    } while (more);
    return LADEN_OK;
}

static laden_status parse_offsets(laden__json *j, const char *name, entry *e)
{
    laden_status s;
    uint64_t v[2];
    int more = 0;
    if ((s = laden__json_need_value(j)))
        return s;
    if (laden__json_kind(j) != '[')
        return laden__fail(LADEN_E_SCHEMA,
                           "data_offsets of tensor '%.200s' is not an array",
                           name);
    j->p++;
    for (int i = 0; i < 2; i++) {
        if (laden__json_peek(j, ']'))
            return laden__fail(LADEN_E_SCHEMA,
                               "data_offsets of tensor '%.200s' must hold "
                               "two integers",
                               name);
        if ((s = laden__json_uint(j, &v[i]))) {
            laden__error_prefix("data_offsets of tensor '%.200s'", name);
            return s;
        }
        if ((s = laden__json_next(j, ']', &more)))
            return s;
        if (i == 0 && !more)
            return laden__fail(LADEN_E_SCHEMA,
                               "data_offsets of tensor '%.200s' must hold "
                               "two integers",
                               name);
    }
    if (more)
        return laden__fail(LADEN_E_SCHEMA,
                           "data_offsets of tensor '%.200s' must hold two "
                           "integers, found more",
                           name);
    e->begin = v[0];
    e->end = v[1];
    return LADEN_OK;
}

static laden_status check_tensor(parse_ctx *c, entry *e)
{
    const char *name = e->name;
    uint64_t nelem = 1, bits;
    if (e->begin > e->end)
        return laden__fail(LADEN_E_RANGE,
                           "tensor '%.200s': data_offsets [%llu, %llu] end "
                           "before they begin",
                           name, (unsigned long long)e->begin,
                           (unsigned long long)e->end);
    if (e->end > c->data_len)
        return laden__fail(LADEN_E_TRUNCATED,
                           "tensor '%.200s' ends at byte %llu of the data "
                           "section, but the file holds only %llu bytes of "
                           "data",
                           name, (unsigned long long)e->end,
                           (unsigned long long)c->data_len);
    /* Indexed, not st->dims + dims_at: dims is NULL while every shape so
     * far has been [], and NULL + 0 is undefined. */
    for (uint32_t i = 0; i < e->ndim; i++)
        if (!laden__mul_u64(nelem, c->st->dims[e->dims_at + i], &nelem))
            return laden__fail(LADEN_E_SHAPE,
                               "tensor '%.200s': element count of its shape "
                               "overflows 64 bits",
                               name);
    if (!laden__mul_u64(nelem, laden_dtype_bits(e->dtype), &bits))
        return laden__fail(LADEN_E_SHAPE,
                           "tensor '%.200s': byte size of its shape overflows "
                           "64 bits",
                           name);
    if (bits % 8)
        return laden__fail(LADEN_E_SHAPE,
                           "tensor '%.200s': %llu elements of %s are not a "
                           "whole number of bytes",
                           name, (unsigned long long)nelem,
                           laden_dtype_name(e->dtype));
    if (bits / 8 != e->end - e->begin)
        return laden__fail(LADEN_E_SHAPE,
                           "tensor '%.200s': shape and dtype %s give %llu "
                           "bytes, data_offsets give %llu",
                           name, laden_dtype_name(e->dtype),
                           (unsigned long long)(bits / 8),
                           (unsigned long long)(e->end - e->begin));
    return LADEN_OK;
}

static laden_status parse_tensor(parse_ctx *c, laden__json *j, char *name)
{
    laden_st_t *st = c->st;
    laden_status s;
    int more;
    bool seen_dtype = false, seen_shape = false, seen_off = false;
    entry e = {.name = name, .file = c->file};
    if ((s = laden__json_need_value(j)))
        return s;
    if (laden__json_kind(j) != '{')
        return laden__fail(LADEN_E_SCHEMA,
                           "entry of tensor '%.200s' at byte %zu is not an "
                           "object",
                           name, laden__json_pos(j));
    j->p++;
    if (laden__json_peek(j, '}')) {
        j->p++;
        return laden__fail(LADEN_E_SCHEMA,
                           "tensor '%.200s' has no dtype, shape or "
                           "data_offsets",
                           name);
    }
    size_t mark = c->pool_at;
    do {
        char *key;
        if ((s = pool_string(c, j, &key, NULL, NULL)) ||
            (s = laden__json_expect(j, ':')))
            return s;
        c->pool_at = mark; /* field names are not kept */
        bool *seen = NULL;
        if (strcmp(key, "dtype") == 0)
            seen = &seen_dtype;
        else if (strcmp(key, "shape") == 0)
            seen = &seen_shape;
        else if (strcmp(key, "data_offsets") == 0)
            seen = &seen_off;
        if (seen && *seen)
            return laden__fail(LADEN_E_SCHEMA,
                               "tensor '%.200s' has field '%s' twice", name,
                               key);
        if (seen)
            *seen = true;
        if (seen == &seen_dtype) {
            char dt[24];
            if ((s = laden__json_need_value(j)))
                return s;
            if (laden__json_kind(j) != '"')
                return laden__fail(LADEN_E_SCHEMA,
                                   "dtype of tensor '%.200s' is not a string",
                                   name);
            s = laden__json_string(j, dt, sizeof dt, NULL, NULL);
            if (s == LADEN_E_LIMIT || (!s && !laden__dtype_of_name(dt, &e.dtype)))
                return laden__fail(LADEN_E_DTYPE,
                                   "tensor '%.200s' has unknown dtype '%s'",
                                   name, s ? "(too long)" : dt);
            if (s)
                return s;
        } else if (seen == &seen_shape) {
            if ((s = parse_shape(c, j, name, &e)))
                return s;
        } else if (seen == &seen_off) {
            if ((s = parse_offsets(j, name, &e)))
                return s;
        } else if ((s = laden__json_skip(j, LADEN_ST_MAX_DEPTH))) {
            return s;
        }
        if ((s = laden__json_next(j, '}', &more)))
            return s;
    } while (more);
    if (!seen_dtype || !seen_shape || !seen_off)
        return laden__fail(LADEN_E_SCHEMA, "tensor '%.200s' has no %s", name,
                           !seen_dtype   ? "dtype"
                           : !seen_shape ? "shape"
                                         : "data_offsets");
    if ((s = check_tensor(c, &e)))
        return s;
    if (st->n >= LADEN_ST_MAX_TENSORS)
        return laden__fail(LADEN_E_LIMIT, "more than %u tensors",
                           LADEN_ST_MAX_TENSORS);
    if (!laden__st_grow((void **)&st->t, &st->cap, st->n + 1,
                        sizeof *st->t))
        return nomem("parsing tensors");
    st->t[st->n++] = e;
    return LADEN_OK;
}

static int cmp_offset(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Sorts the file's tensors by offset and checks they tile the data section. */
static laden_status check_coverage(parse_ctx *c, size_t first)
{
    size_t n = c->st->n - first;
    uint64_t at = 0;
    if (n == 0) /* st->t may be NULL: no pointer into it */
        return at == c->data_len
                   ? LADEN_OK
                   : laden__fail(LADEN_E_RANGE,
                                 "the %llu bytes of the data section belong "
                                 "to no tensor (the header lists none)",
                                 (unsigned long long)c->data_len);
    entry *t = &c->st->t[first];
    qsort(t, n, sizeof *t, cmp_offset);
    for (size_t i = 0; i < n; i++) {
        if (t[i].begin > at)
            return laden__fail(LADEN_E_RANGE,
                               "bytes %llu..%llu of the data section belong "
                               "to no tensor (gap before '%.200s')",
                               (unsigned long long)at,
                               (unsigned long long)t[i].begin, t[i].name);
        if (t[i].begin < at)
            return laden__fail(LADEN_E_RANGE,
                               "tensor '%.200s' [%llu, %llu] overlaps the "
                               "tensor before it, which ends at %llu",
                               t[i].name, (unsigned long long)t[i].begin,
                               (unsigned long long)t[i].end,
                               (unsigned long long)at);
        at = t[i].end;
    }
    if (at != c->data_len)
        return laden__fail(LADEN_E_RANGE,
                           "the last %llu bytes of the data section belong "
                           "to no tensor",
                           (unsigned long long)(c->data_len - at));
    return LADEN_OK;
}

/* Parses the header JSON of one file (hdr[0..len)), appending its tensors. */
static laden_status parse_header(parse_ctx *c, const char *hdr, size_t len)
{
    laden_status s;
    int more;
    bool seen_meta = false;
    laden__json j;
    size_t first = c->st->n;
    laden__json_init(&j, hdr, len);
    if (len == 0 || hdr[0] != '{')
        return laden__fail(LADEN_E_JSON,
                           "header does not start with '{' (byte 8 of the "
                           "file)");
    j.p++;
    if (laden__json_peek(&j, '}')) {
        j.p++;
        more = 0;
    } else {
        more = 1;
    }
    while (more) {
        char *name;
        size_t nlen;
        bool has_nul;
        if ((s = pool_string(c, &j, &name, &nlen, &has_nul)) ||
            (s = laden__json_expect(&j, ':')))
            return s;
        if (strcmp(name, "__metadata__") == 0 && !has_nul) {
            if (seen_meta)
                return laden__fail(LADEN_E_SCHEMA,
                                   "__metadata__ appears twice");
            seen_meta = true;
            s = parse_metadata(c, &j);
        } else if (has_nul) {
            return laden__fail(LADEN_E_NAME,
                               "tensor name '%.200s...' holds a NUL character",
                               name);
        } else {
            s = parse_tensor(c, &j, name);
        }
        if (s || (s = laden__json_next(&j, '}', &more)))
            return s;
    }
    if (!laden__json_at_end(&j))
        return laden__fail(LADEN_E_JSON,
                           "bytes after the header object at byte %zu",
                           laden__json_pos(&j));
    return check_coverage(c, first);
}

/* Validates the 8-byte length prefix and returns the header length. */
static laden_status check_prefix(const unsigned char *first8, uint64_t fsize,
                                 uint64_t *hlen)
{
    uint64_t n = 0;
    *hlen = 0;
    if (fsize < 8)
        return laden__fail(LADEN_E_HEADER,
                           "file is %llu bytes, too short for the 8-byte "
                           "header length",
                           (unsigned long long)fsize);
    for (int i = 7; i >= 0; i--)
        n = n << 8 | first8[i];
    if (n > LADEN_ST_MAX_HEADER_BYTES)
        return laden__fail(LADEN_E_LIMIT,
                           "header length %llu exceeds the %u-byte limit",
                           (unsigned long long)n, LADEN_ST_MAX_HEADER_BYTES);
    if (n < 2)
        return laden__fail(LADEN_E_HEADER,
                           "header length %llu is too small for a JSON object",
                           (unsigned long long)n);
    if (n > fsize - 8)
        return laden__fail(LADEN_E_HEADER,
                           "header length %llu runs past the end of the "
                           "%llu-byte file",
                           (unsigned long long)n, (unsigned long long)fsize);
    *hlen = n;
    return LADEN_OK;
}

static laden_status add_file(laden_st_t *st, const char *path, uint64_t size,
                             uint64_t hlen, uint32_t *index)
{
    if (st->nfiles >= LADEN_ST_MAX_SHARDS)
        return laden__fail(LADEN_E_LIMIT, "more than %u shards",
                           LADEN_ST_MAX_SHARDS);
    stfile *f = realloc(st->files, (st->nfiles + 1) * sizeof *f);
    if (!f)
        return nomem("opening a checkpoint");
    st->files = f;
    f += st->nfiles;
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    f->pool = malloc(hlen + 1);
    if (!f->path || !f->pool) {
        free(f->path);
        free(f->pool);
        return nomem("opening a checkpoint");
    }
    f->size = size;
    f->data_start = 8 + hlen;
    *index = (uint32_t)st->nfiles++;
    return LADEN_OK;
}

/* Parses one file given its header bytes (already read). */
static laden_status parse_file(laden_st_t *st, const char *path,
                               uint64_t fsize, const char *hdr, uint64_t hlen,
                               bool keep_meta)
{
    uint32_t fi = 0;
    laden_status s = add_file(st, path, fsize, hlen, &fi);
    if (s)
        return s;
    parse_ctx c = {
        .st = st,
        .file = fi,
        .path = path,
        .pool = st->files[fi].pool,
        .pool_cap = hlen + 1,
        .data_len = fsize - 8 - hlen,
        .keep_meta = keep_meta,
    };
    return parse_header(&c, hdr, hlen);
}

static int cmp_name(const void *a, const void *b)
{
    const entry *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* Builds the name index and rejects duplicates. */
static laden_status finish(laden_st_t *st)
{
    entry **tmp = malloc((st->n ? st->n : 1) * sizeof *tmp);
    st->by_name = malloc((st->n ? st->n : 1) * sizeof *st->by_name);
    if (!tmp || !st->by_name) {
        free(tmp);
        return nomem("indexing tensor names");
    }
    for (size_t i = 0; i < st->n; i++)
        tmp[i] = &st->t[i];
    if (st->n)
        qsort(tmp, st->n, sizeof *tmp, cmp_name);
    for (size_t i = 0; i < st->n; i++) {
        if (i && strcmp(tmp[i - 1]->name, tmp[i]->name) == 0) {
            laden_status s = laden__fail(
                LADEN_E_NAME, "tensor name '%.200s' appears twice%s",
                tmp[i]->name,
                tmp[i - 1]->file != tmp[i]->file ? " (in two shards)" : "");
            free(tmp);
            return s;
        }
        st->by_name[i] = (size_t)(tmp[i] - st->t);
    }
    free(tmp);
    st->total_bytes = 0;
    for (size_t i = 0; i < st->n; i++)
        st->total_bytes += st->t[i].end - st->t[i].begin;
    return LADEN_OK;
}

/* ---- public API ------------------------------------------------------- */

void laden_st_close(laden_st_t *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->nfiles; i++) {
        free(st->files[i].path);
        free(st->files[i].pool);
    }
    free(st->files);
    free(st->t);
    free(st->dims);
    free(st->by_name);
    free(st->meta);
    free(st);
}

laden_status laden_st_open_memory(const void *bytes, size_t size,
                                  laden_st_t **out)
{
    laden_status s;
    uint64_t hlen;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_st_open_memory: out is NULL");
    *out = NULL;
    if (!bytes && size)
        return laden__fail(LADEN_E_INVAL, "laden_st_open_memory: bytes NULL");
    if ((s = check_prefix(bytes, size, &hlen)))
        return s;
    laden_st_t *st = calloc(1, sizeof *st);
    if (!st)
        return nomem("opening a checkpoint");
    s = parse_file(st, "<memory>", size, (const char *)bytes + 8, hlen, true);
    if (!s)
        s = finish(st);
    if (s) {
        laden_st_close(st);
        return s;
    }
    *out = st;
    return LADEN_OK;
}

/* Reads exactly n bytes at off, or fails naming the file. */
static laden_status read_exact(int fd, const char *path, void *buf, size_t n,
                               uint64_t off)
{
    size_t done = 0;
    while (done < n) {
        ssize_t r = pread(fd, (char *)buf + done, n - done,
                          (off_t)(off + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return laden__fail(LADEN_E_IO, "%s: read failed at byte %llu: %s",
                               path, (unsigned long long)(off + done),
                               strerror(errno));
        if (r == 0)
            return laden__fail(LADEN_E_TRUNCATED,
                               "%s: file ended at byte %llu while reading "
                               "its header",
                               path, (unsigned long long)(off + done));
        done += (size_t)r;
    }
    return LADEN_OK;
}

static uint64_t ns_of(struct timespec t)
{
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Keeps what file fi was when its header was read (sb: the fstat of the
 * descriptor it was parsed from) and the checksum of its first
 * head_bytes, read again through the reader's file: what
 * laden_st_file_open compares. */
static laden_status know_file(laden_st_t *st, uint32_t fi,
                              const struct stat *sb, uint64_t head_bytes)
{
    stfile *f = &st->files[fi];
    laden_io_file_t *io;
    laden_status s = laden_io_file_open(f->path, &io);
    if (s)
        return s;
    uint64_t id[4], mt, ct;
    laden_io_file_identity(io, id);
    laden_io_file_times(io, &mt, &ct);
    f->dev = (uint64_t)sb->st_dev;
    f->ino = (uint64_t)sb->st_ino;
    f->mtime_ns = ns_of(sb->st_mtim);
    f->ctime_ns = ns_of(sb->st_ctim);
    f->head_bytes = head_bytes;
    if (id[0] != f->dev || id[1] != f->ino || id[2] != f->size ||
        mt != f->mtime_ns || ct != f->ctime_ns)
        s = laden__fail(LADEN_E_CHANGED, "%s: the file changed while its "
                        "header was read; open it again", f->path);
    else
        s = laden_io_file_checksum(io, 0, head_bytes, &f->head_sum);
    laden_io_file_close(io);
    f->known = !s;
    return s;
}

static laden_status open_one(laden_st_t *st, const char *path, bool keep_meta)
{
    int fd;
    uint64_t size, hlen;
    unsigned char first8[8];
    struct stat sb;
    laden_status s = laden__st_open_fd(path, &fd, &size, &sb);
    if (s)
        return s;
    if (size < 8)
        s = check_prefix(first8, size, &hlen);
    else if (!(s = read_exact(fd, path, first8, 8, 0)))
        s = check_prefix(first8, size, &hlen);
    char *hdr = NULL;
    if (!s) {
        hdr = malloc(hlen);
        if (!hdr)
            s = nomem("reading a header");
        else
            s = read_exact(fd, path, hdr, hlen, 8);
    }
    close(fd);
    if (!s && !(s = parse_file(st, path, size, hdr, hlen, keep_meta)))
        s = know_file(st, (uint32_t)st->nfiles - 1, &sb, 8 + hlen);
    free(hdr);
    if (s && strncmp(laden_last_error(), path, strlen(path)) != 0)
        laden__error_prefix("%s", path);
    return s;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* Opens a sharded checkpoint from its index. */
static laden_status open_index(laden_st_t *st, const char *path)
{
    int fd;
    uint64_t size;
    laden__st_index ix = {0};
    char *buf = NULL, *dir = NULL, *joined = NULL;
    laden_status s = laden__st_open_fd(path, &fd, &size, NULL);
    if (s)
        return s;
    if (size > LADEN_ST_MAX_HEADER_BYTES) {
        close(fd);
        return laden__fail(LADEN_E_LIMIT, "%s: index of %llu bytes exceeds "
                           "the %u-byte limit", path,
                           (unsigned long long)size,
                           LADEN_ST_MAX_HEADER_BYTES);
    }
    buf = malloc(size ? size : 1);
    dir = strdup(path);
    if (!buf || !dir) {
        close(fd);
        s = nomem("reading an index");
        goto out;
    }
    s = read_exact(fd, path, buf, size, 0);
    close(fd);
    if (!s)
        s = laden__st_index_parse(buf, size, &ix);
    free(buf); /* ix holds the decoded strings */
    buf = NULL;
    if (s)
        goto out;
    char *slash = strrchr(dir, '/');
    if (slash)
        slash[1] = '\0';
    else
        dir[0] = '\0';
    /* Shard i becomes file i: open_one adds one file per call. */
    for (size_t i = 0; i < ix.nshards; i++) {
        size_t need = strlen(dir) + strlen(ix.shards[i]) + 1;
        char *p = realloc(joined, need);
        if (!p) {
            s = nomem("opening shards");
            goto out;
        }
        joined = p;
        strcpy(joined, dir);
        strcat(joined, ix.shards[i]);
        if ((s = open_one(st, joined, i == 0)))
            goto out;
    }
    if ((s = finish(st)))
        goto out;
    for (size_t i = 0; i < ix.nmap; i++) {
        const laden__st_index_entry *w = &ix.map[i];
        size_t idx;
        if (laden_st_find(st, w->name, &idx) != LADEN_OK) {
            s = laden__fail(LADEN_E_INDEX,
                            "weight_map sends '%.200s' to '%.200s', which "
                            "holds no such tensor",
                            w->name, w->shard);
            goto out;
        }
        if (st->t[idx].file != w->shard_index) {
            s = laden__fail(LADEN_E_INDEX,
                            "weight_map sends '%.200s' to '%.200s', but it "
                            "is in %.200s",
                            w->name, w->shard,
                            st->files[st->t[idx].file].path);
            goto out;
        }
    }
out:
    if (s && strncmp(laden_last_error(), path, strlen(path)) != 0 &&
        !(joined && strncmp(laden_last_error(), joined, strlen(joined)) == 0))
        laden__error_prefix("%s", path);
    laden__st_index_free(&ix);
    free(buf);
    free(dir);
    free(joined);
    return s;
}

/* Picks the checkpoint inside a directory. */
static laden_status pick_in_dir(const char *dir, char **out)
{
    static const char *const preferred[] = {"model.safetensors.index.json",
                                            "model.safetensors"};
    DIR *d;
    struct dirent *de;
    char *found = NULL;
    size_t nfound = 0, nindex = 0;
    bool index_found = false;
    *out = NULL;
    for (size_t i = 0; i < LADEN__ARRAY_LEN(preferred); i++) {
        size_t need = strlen(dir) + strlen(preferred[i]) + 2;
        char *p = malloc(need);
        struct stat sb;
        if (!p)
            return nomem("opening a directory");
        snprintf(p, need, "%s/%s", dir, preferred[i]);
        if (stat(p, &sb) == 0 && S_ISREG(sb.st_mode)) {
            *out = p;
            return LADEN_OK;
        }
        free(p);
    }
    if (!(d = opendir(dir)))
        return laden__fail(LADEN_E_IO, "%s: cannot list: %s", dir,
                           strerror(errno));
    while ((de = readdir(d))) {
        bool is_index = ends_with(de->d_name, ".safetensors.index.json");
        if (!is_index && !ends_with(de->d_name, ".safetensors"))
            continue;
        if (is_index)
            nindex++;
        else
            nfound++;
        /* An index wins over its shards; otherwise one file must remain. */
        if (is_index || (!index_found && !found)) {
            if (is_index && found && !index_found) {
                free(found);
                found = NULL;
            }
            if (!found || is_index) {
                free(found);
                found = strdup(de->d_name);
                if (!found) {
                    closedir(d);
                    return nomem("opening a directory");
                }
            }
            index_found |= is_index;
        }
    }
    closedir(d);
    if (nindex > 1 || (nindex == 0 && nfound != 1)) {
        free(found);
        return laden__fail(LADEN_E_INVAL,
                           "%s: holds %zu .safetensors files and %zu "
                           "indexes; open one file or one index",
                           dir, nfound, nindex);
    }
    size_t need = strlen(dir) + strlen(found) + 2;
    *out = malloc(need);
    if (!*out) {
        free(found);
        return nomem("opening a directory");
    }
    snprintf(*out, need, "%s/%s", dir, found);
    free(found);
    return LADEN_OK;
}

/* ---- GGUF files as checkpoints ----------------------------------------- */

/* A GGUF file's table as a checkpoint's: names, shapes in row-major order
 * (GGUF lists dimensions innermost first), each tensor's ggml type as a
 * laden dtype (block types stay as stored), offsets relative to the data
 * section; scalar and string metadata as strings.  The GGUF reader has
 * validated every field and range. */
static laden_status open_gguf(laden_st_t *st, const char *path)
{
    laden_gguf_t *g = NULL;
    int fd;
    uint64_t fsize;
    struct stat sb;
    laden_status s = laden__st_open_fd(path, &fd, &fsize, &sb);
    if (s)
        return s;
    s = laden__gguf_open_fd(fd, path, &g);
    close(fd);
    if (s)
        return s;
    size_t n = laden_gguf_count(g), nkv = laden_gguf_metadata_count(g);
    size_t pool = 0;
    laden_gguf_tensor_t t;
    laden_gguf_kv_t kv;
    for (size_t i = 0; i < n; i++) {
        laden_gguf_tensor_at(g, i, &t);
        pool += strlen(t.name) + 1;
    }
    for (size_t i = 0; i < nkv; i++) {
        laden_gguf_metadata_at(g, i, &kv);
        pool += strlen(kv.key) + 1 +
                (kv.type == LADEN_GGUF_STRING ? (size_t)kv.count + 1 : 32);
    }
    uint32_t fi = 0;
    if ((s = add_file(st, path, fsize, pool, &fi))) {
        laden_gguf_close(g);
        return s;
    }
    stfile *f = &st->files[fi];
    f->data_start = laden_gguf_data_offset(g);
    if ((s = know_file(st, fi, &sb, f->data_start))) {
        laden_gguf_close(g);
        return s;
    }
    f = &st->files[fi];
    char *at = f->pool;
    if (!laden__st_grow((void **)&st->t, &st->cap, n + 1, sizeof *st->t) ||
        !laden__st_grow((void **)&st->dims, &st->dims_cap,
                        n * LADEN_GGUF_MAX_DIMS + 1, sizeof *st->dims) ||
        !laden__st_grow((void **)&st->meta, &st->meta_cap, 2 * nkv + 1,
                        sizeof *st->meta)) {
        laden_gguf_close(g);
        return nomem("opening a GGUF file");
    }
    for (size_t i = 0; i < n && !s; i++) {
        laden_gguf_tensor_at(g, i, &t);
        entry *e = &st->t[st->n];
        if ((s = laden_dtype_of_ggml(t.type, &e->dtype))) {
            laden__error_prefix("tensor '%.200s'", t.name);
            break;
        }
        size_t len = strlen(t.name) + 1;
        memcpy(at, t.name, len);
        e->name = at;
        at += len;
        e->file = fi;
        e->ndim = t.ndim;
        e->dims_at = st->ndims;
        for (uint32_t d = 0; d < t.ndim; d++)
            st->dims[st->ndims++] = t.dims[t.ndim - 1 - d];
        e->begin = t.offset_bytes - f->data_start;
        e->end = e->begin + t.size_bytes;
        st->n++;
    }
    for (size_t i = 0; i < nkv && !s; i++) {
        laden_gguf_metadata_at(g, i, &kv);
        if (kv.type == LADEN_GGUF_ARRAY)
            continue;
        size_t len = strlen(kv.key) + 1;
        memcpy(at, kv.key, len);
        st->meta[st->nmeta++] = at;
        at += len;
        st->meta[st->nmeta++] = at;
        switch (kv.type) {
        case LADEN_GGUF_STRING:
            memcpy(at, kv.str, (size_t)kv.count + 1);
            at += kv.count + 1;
            continue;
        case LADEN_GGUF_F32:
        case LADEN_GGUF_F64:
            at += snprintf(at, 32, "%.17g", kv.f) + 1;
            continue;
        case LADEN_GGUF_I8:
        case LADEN_GGUF_I16:
        case LADEN_GGUF_I32:
        case LADEN_GGUF_I64:
            at += snprintf(at, 32, "%lld", (long long)kv.i) + 1;
            continue;
        case LADEN_GGUF_BOOL:
            at += snprintf(at, 32, "%s", kv.u ? "true" : "false") + 1;
            continue;
        default:
            at += snprintf(at, 32, "%llu", (unsigned long long)kv.u) + 1;
        }
    }
    laden_gguf_close(g);
    if (!s && st->n)
        qsort(st->t, st->n, sizeof *st->t, cmp_offset);
    return s ? s : finish(st);
}

static bool is_gguf(const char *path)
{
    char magic[4];
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return false;
    bool yes = pread(fd, magic, 4, 0) == 4 && memcmp(magic, "GGUF", 4) == 0;
    close(fd);
    return yes;
}

laden_status laden_st_open(const char *path, laden_st_t **out)
{
    laden_status s;
    struct stat sb;
    char *picked = NULL;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_st_open: out is NULL");
    *out = NULL;
    if (!path || !*path)
        return laden__fail(LADEN_E_INVAL, "laden_st_open: empty path");
    if (stat(path, &sb) != 0) {
        int e = errno;
        return laden__fail(e == ENOENT ? LADEN_E_NOENT : LADEN_E_IO,
                           "%s: %s", path, strerror(e));
    }
    if (S_ISDIR(sb.st_mode)) {
        if ((s = pick_in_dir(path, &picked)))
            return s;
        path = picked;
    }
    laden_st_t *st = calloc(1, sizeof *st);
    if (!st) {
        free(picked);
        return nomem("opening a checkpoint");
    }
    if (ends_with(path, ".json")) {
        s = open_index(st, path);
    } else if (S_ISREG(sb.st_mode) && is_gguf(path)) {
        st->gguf = true;
        s = open_gguf(st, path);
    } else {
        s = open_one(st, path, true);
        if (!s)
            s = finish(st);
    }
    if (s && !strstr(laden_last_error(), path))
        laden__error_prefix("%s", path);
    free(picked);
    if (s) {
        laden_st_close(st);
        return s;
    }
    *out = st;
    return LADEN_OK;
}

size_t laden_st_count(const laden_st_t *st) { return st ? st->n : 0; }

laden_status laden_st_tensor_at(const laden_st_t *st, size_t i,
                                laden_st_tensor_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_st_tensor_at: out is NULL");
    memset(out, 0, sizeof *out);
    if (!st || i >= st->n)
        return laden__fail(LADEN_E_INVAL,
                           "laden_st_tensor_at: index %zu out of range", i);
    const entry *e = &st->t[i];
    out->name = e->name;
    out->dtype = e->dtype;
    out->ndim = e->ndim;
    /* A rank-0 tensor gets a valid pointer to no dimensions: st->dims may
     * be NULL (every shape []), and NULL + 0 is undefined. */
    static const uint64_t no_dims[1];
    out->shape = e->ndim ? &st->dims[e->dims_at] : no_dims;
    out->file_index = e->file;
    out->offset_bytes = st->files[e->file].data_start + e->begin;
    out->size_bytes = e->end - e->begin;
    return LADEN_OK;
}

laden_status laden_st_find(const laden_st_t *st, const char *name,
                           size_t *out_index)
{
    if (out_index)
        *out_index = 0;
    if (!st || !name || !out_index)
        return laden__fail(LADEN_E_INVAL, "laden_st_find: NULL argument");
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->t[st->by_name[mid]].name, name);
        if (c == 0) {
            *out_index = st->by_name[mid];
            return LADEN_OK;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return laden__fail(LADEN_E_NOTFOUND, "no tensor named '%.200s'", name);
}

size_t laden_st_file_count(const laden_st_t *st) { return st ? st->nfiles : 0; }

const char *laden_st_file_path(const laden_st_t *st, size_t i)
{
    return st && i < st->nfiles ? st->files[i].path : NULL;
}

uint64_t laden_st_file_size(const laden_st_t *st, size_t i)
{
    return st && i < st->nfiles ? st->files[i].size : 0;
}

size_t laden_st_metadata_count(const laden_st_t *st)
{
    return st ? st->nmeta / 2 : 0;
}

laden_status laden_st_metadata_at(const laden_st_t *st, size_t i,
                                  const char **key, const char **value)
{
    if (key)
        *key = NULL;
    if (value)
        *value = NULL;
    if (!st || !key || !value || i >= st->nmeta / 2)
        return laden__fail(LADEN_E_INVAL,
                           "laden_st_metadata_at: bad argument");
    *key = st->meta[2 * i];
    *value = st->meta[2 * i + 1];
    return LADEN_OK;
}

/* LADEN_OK if f, just opened, is the file whose header was read as
 * stf: the same device, inode, size and modification time (else
 * LADEN_E_CHANGED: replaced, or rewritten in place), and if only its
 * status change time moved (a chmod moves it too), the same header
 * bytes. */
static laden_status same_file(const stfile *stf, laden_io_file_t *f)
{
    uint64_t then = stf->size, now = laden_io_file_size(f), id[4], mt, ct;
    const char *path = stf->path;
    if (now != then)
        return laden__fail(LADEN_E_CHANGED,
                           "%s: the file changed since its header was read "
                           "(%s then, %s now); open it again",
                           path, laden__bytes(then).s, laden__bytes(now).s);
    if (!stf->known)
        return LADEN_OK;
    laden_io_file_identity(f, id);
    laden_io_file_times(f, &mt, &ct);
    if (id[0] != stf->dev || id[1] != stf->ino)
        return laden__fail(LADEN_E_CHANGED,
                           "%s: the file changed since its header was read "
                           "(another file has its name now); open it again",
                           path);
    if (mt != stf->mtime_ns)
        return laden__fail(LADEN_E_CHANGED,
                           "%s: the file changed since its header was read "
                           "(rewritten in place); open it again", path);
    if (ct == stf->ctime_ns)
        return LADEN_OK;
    uint64_t sum;
    laden_status s = laden_io_file_checksum(f, 0, stf->head_bytes, &sum);
    if (s)
        return s;
    if (sum != stf->head_sum)
        return laden__fail(LADEN_E_CHANGED,
                           "%s: the file changed since its header was read "
                           "(rewritten in place: its header differs, though "
                           "its size and modification time are as they "
                           "were); open it again", path);
    return LADEN_OK;
}

laden_status laden_st_file_open(const laden_st_t *st, size_t i,
                                laden_io_file_t **out)
{
    laden_status s;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_st_file_open: out is NULL");
    *out = NULL;
    if (!st || i >= laden_st_file_count(st))
        return laden__fail(LADEN_E_INVAL, "laden_st_file_open: no file %zu",
                           i);
    const char *path = laden_st_file_path(st, i);
    laden_io_file_t *f;
    if ((s = laden_io_file_open(path, &f)))
        return s;
    if ((s = same_file(&st->files[i], f))) {
        laden_io_file_close(f);
        return s;
    }
    *out = f;
    return LADEN_OK;
}

const char *laden_st_format(const laden_st_t *st)
{
    return !st ? NULL : st->gguf ? "gguf" : "safetensors";
}

uint64_t laden_st_total_bytes(const laden_st_t *st)
{
    return st ? st->total_bytes : 0;
}
