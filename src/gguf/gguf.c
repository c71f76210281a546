/* GGUF headers: parse, validate, index.  See include/laden/gguf.h.
 *
 * The header is read from a file with pread (never mapped: a page of a
 * mapping that is not read yet raises SIGBUS once the file is truncated)
 * or from memory, through one cursor that checks every read against the
 * end.  Strings are copied into one pool per file. */
#define _GNU_SOURCE
#include "laden/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/internal.h"
#include "gguf_internal.h"

/* Limits: far above any real file, low enough that a corrupt count cannot
 * make laden allocate without bound before the end of the file stops it. */
#define MAX_TENSORS (1u << 20)
#define MAX_KV (1u << 20)
#define MAX_KEY 65535u
#define MAX_STRING (256u << 20)
#define MAX_NAME 4096u
#define DEFAULT_ALIGNMENT 32u

/* ggml's types are dtype facts: their table is core's (src/core/dtype.c). */

const char *laden_gguf_type_name(uint32_t type)
{
    const char *name = NULL;
    laden__ggml_type(type, &name, NULL, NULL);
    return name;
}

laden_status laden_gguf_type_block(uint32_t type, uint32_t *block_elems,
                                   uint32_t *block_bytes)
{
    uint32_t elems, bytes;
    if (!block_elems || !block_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_type_block: NULL");
    if (!laden__ggml_type(type, NULL, &elems, &bytes))
        return laden__fail(LADEN_E_DTYPE, "unknown ggml type %u", type);
    *block_elems = elems;
    *block_bytes = bytes;
    return LADEN_OK;
}

/* ---- the cursor --------------------------------------------------------- */

/* A file's header is read through a window of WINDOW bytes: its fields
 * are a few bytes each (a tokenizer's strings: hundreds of thousands), and
 * one pread per field cost 175 ms for a 500k-string vocabulary. */
#define WINDOW (1u << 20)

typedef struct cursor {
    const uint8_t *mem; /* or NULL: the file */
    int fd;
    uint64_t size, pos;
    const char *what; /* the file's name, for messages */
    uint8_t *win;     /* the file's bytes [win_at, win_at + win_len) */
    uint64_t win_at, win_len;
} cursor;

/* n bytes of the file at offset `at`. */
static laden_status read_at(cursor *c, void *out, uint64_t at, uint64_t n)
{
    uint64_t done = 0;
    while (done < n) {
        ssize_t r = pread(c->fd, (char *)out + done, (size_t)(n - done),
                          (off_t)(at + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return laden__fail(LADEN_E_IO, "%s: reading the header: %s",
                               c->what, strerror(errno));
        if (r == 0)
            return laden__fail(LADEN_E_TRUNCATED, "%s: the file became "
                               "shorter while its header was read",
                               c->what);
        done += (uint64_t)r;
    }
    return LADEN_OK;
}

static laden_status take(cursor *c, void *out, uint64_t n, const char *field)
{
    uint64_t end;
    laden_status s;
    if (!laden__add_u64(c->pos, n, &end) || end > c->size)
        return laden__fail(LADEN_E_TRUNCATED, "%s: the header ends inside "
                           "%s (at byte %llu of %llu)",
                           c->what, field, (unsigned long long)c->pos,
                           (unsigned long long)c->size);
    if (c->mem) {
        memcpy(out, c->mem + c->pos, (size_t)n);
    } else if (n > WINDOW) {
        if ((s = read_at(c, out, c->pos, n)))
            return s;
    } else {
        if (c->pos < c->win_at || end > c->win_at + c->win_len) {
            uint64_t len = c->size - c->pos < WINDOW ? c->size - c->pos
                                                     : WINDOW;
            c->win_len = 0;
            if ((s = read_at(c, c->win, c->pos, len)))
                return s;
            c->win_at = c->pos;
            c->win_len = len;
        }
        memcpy(out, c->win + (c->pos - c->win_at), (size_t)n);
    }
    c->pos = end;
    return LADEN_OK;
}

static laden_status skip(cursor *c, uint64_t n, const char *field)
{
    uint64_t end;
    if (!laden__add_u64(c->pos, n, &end) || end > c->size)
        return laden__fail(LADEN_E_TRUNCATED, "%s: the header ends inside "
                           "%s", c->what, field);
    c->pos = end;
    return LADEN_OK;
}

static laden_status u32(cursor *c, uint32_t *v, const char *f)
{
    uint8_t b[4] = {0}; /* gcc -O2 cannot see take() fill it */
    laden_status s = take(c, b, 4, f);
    if (!s)
        *v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
             (uint32_t)b[3] << 24;
    return s;
}

static laden_status u64(cursor *c, uint64_t *v, const char *f)
{
    uint8_t b[8] = {0}; /* as in u32 */
    laden_status s = take(c, b, 8, f);
    if (!s) {
        *v = 0;
        for (int i = 7; i >= 0; i--)
            *v = *v << 8 | b[i];
    }
    return s;
}

/* ---- the parsed file ---------------------------------------------------- */

typedef struct tensor {
    char *name;
    uint32_t type, ndim;
    uint64_t dims[LADEN_GGUF_MAX_DIMS];
    uint64_t offset, size; /* offset relative to the data */
} tensor;

struct laden_gguf {
    uint32_t version, alignment;
    uint64_t data_offset, file_size;
    tensor *t;
    size_t n;
    size_t *by_name;
    laden_gguf_kv_t *kv;
    size_t nkv;
    char **strings; /* every string allocated, freed at close */
    size_t nstrings, strings_cap;
};

static char *keep_string(laden_gguf_t *g, char *s)
{
    if (g->nstrings == g->strings_cap) {
        size_t cap = g->strings_cap ? g->strings_cap * 2 : 64;
        char **p = realloc(g->strings, cap * sizeof *p);
        if (!p) {
            free(s);
            return NULL;
        }
        g->strings = p;
        g->strings_cap = cap;
    }
    g->strings[g->nstrings++] = s;
    return s;
}

/* What a string is, for messages: "tensor 3's name", "metadata key 2",
 * "metadata 'general.name' (entry 5)". */
typedef struct str_of {
    const char *kind; /* "name", "key" or "value" */
    uint64_t index;   /* the tensor's or the entry's */
    const char *key;  /* a value's key */
} str_of;

static laden_status not_utf8(const cursor *c, const str_of *of, uint64_t at,
                             size_t bad, unsigned char byte)
{
    char whose[300];
    if (!strcmp(of->kind, "name"))
        snprintf(whose, sizeof whose, "tensor %llu's name",
                 (unsigned long long)of->index);
    else if (!strcmp(of->kind, "key"))
        snprintf(whose, sizeof whose, "metadata key %llu",
                 (unsigned long long)of->index);
    else
        snprintf(whose, sizeof whose, "the string of metadata '%.200s' "
                 "(entry %llu)", of->key, (unsigned long long)of->index);
    return laden__fail(LADEN_E_SCHEMA, "%s: %s is not valid UTF-8 (byte %zu "
                       "of it, at offset %llu of the file, is 0x%02x)",
                       c->what, whose, bad, (unsigned long long)(at + bad),
                       byte);
}

/* A GGUF string (u64 length, bytes), NUL-terminated, at most `max` bytes;
 * kept (out) or skipped (out NULL).  No NUL inside; a kept one is valid
 * UTF-8 (of says what it is, for the message).  The strings of arrays
 * are skipped unread: laden gives none of them. */
static laden_status string(laden_gguf_t *g, cursor *c, uint64_t max,
                           const char *field, const str_of *of, char **out,
                           uint64_t *len)
{
    uint64_t n;
    laden_status s = u64(c, &n, field);
    if (s)
        return s;
    if (n > max)
        return laden__fail(LADEN_E_LIMIT, "%s: %s is %llu bytes long "
                           "(at most %llu)",
                           c->what, field, (unsigned long long)n,
                           (unsigned long long)max);
    if (n > c->size - c->pos)
        return laden__fail(LADEN_E_TRUNCATED, "%s: the header ends inside "
                           "%s", c->what, field);
    if (len)
        *len = n;
    if (!out)
        return skip(c, n, field);
    uint64_t at = c->pos;
    char *p = malloc((size_t)n + 1);
    if (!p)
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory reading %s",
                           c->what, field);
    if ((s = take(c, p, n, field))) {
        free(p);
        return s;
    }
    p[n] = 0;
    if (memchr(p, 0, (size_t)n)) {
        free(p);
        return laden__fail(LADEN_E_SCHEMA, "%s: %s holds a NUL byte",
                           c->what, field);
    }
    size_t bad = laden__utf8_check(p, (size_t)n);
    if (bad < n) {
        unsigned char byte = (unsigned char)p[bad];
        free(p);
        return not_utf8(c, of, at, bad, byte);
    }
    if (!(*out = keep_string(g, p)))
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory", c->what);
    return LADEN_OK;
}

static uint32_t scalar_bytes(uint32_t type)
{
    switch (type) {
    case LADEN_GGUF_U8: case LADEN_GGUF_I8: case LADEN_GGUF_BOOL: return 1;
    case LADEN_GGUF_U16: case LADEN_GGUF_I16: return 2;
    case LADEN_GGUF_U32: case LADEN_GGUF_I32: case LADEN_GGUF_F32: return 4;
    case LADEN_GGUF_U64: case LADEN_GGUF_I64: case LADEN_GGUF_F64: return 8;
    default: return 0;
    }
}

static laden_status scalar(cursor *c, uint32_t type, laden_gguf_kv_t *kv,
                           const char *field)
{
    uint8_t b[8] = {0};
    uint32_t n = scalar_bytes(type);
    laden_status s = take(c, b, n, field);
    if (s)
        return s;
    uint64_t v = 0;
    for (int i = (int)n - 1; i >= 0; i--)
        v = v << 8 | b[i];
    switch (type) {
    case LADEN_GGUF_I8: kv->i = (int8_t)v; break;
    case LADEN_GGUF_I16: kv->i = (int16_t)v; break;
    case LADEN_GGUF_I32: kv->i = (int32_t)v; break;
    case LADEN_GGUF_I64: memcpy(&kv->i, &v, 8); break;
    case LADEN_GGUF_F32: {
        uint32_t w = (uint32_t)v;
        float f;
        memcpy(&f, &w, 4);
        kv->f = f;
        break;
    }
    case LADEN_GGUF_F64: memcpy(&kv->f, &v, 8); break;
    case LADEN_GGUF_BOOL:
        if (v > 1)
            return laden__fail(LADEN_E_SCHEMA, "%s: %s is a bool of value "
                               "%llu", c->what, field, (unsigned long long)v);
        /* fall through */
    default: kv->u = v; break;
    }
    return LADEN_OK;
}

static laden_status read_kv(laden_gguf_t *g, cursor *c, laden_gguf_kv_t *kv,
                            uint64_t index)
{
    char *key = NULL;
    uint32_t type;
    str_of of = {"key", index, NULL};
    laden_status s = string(g, c, MAX_KEY, "a metadata key", &of, &key, NULL);
    if (s || (s = u32(c, &type, "a metadata value type")))
        return s;
    if (!*key)
        return laden__fail(LADEN_E_SCHEMA, "%s: an empty metadata key",
                           c->what);
    kv->key = key;
    kv->type = (laden_gguf_value_type)type;
    if (type == LADEN_GGUF_STRING) {
        char *v = NULL;
        str_of vof = {"value", index, key};
        s = string(g, c, MAX_STRING, key, &vof, &v, &kv->count);
        kv->str = v;
        return s;
    }
    if (type == LADEN_GGUF_ARRAY) {
        uint32_t et;
        uint64_t n;
        if ((s = u32(c, &et, key)) || (s = u64(c, &n, key)))
            return s;
        kv->elem_type = (laden_gguf_value_type)et;
        kv->count = n;
        if (et == LADEN_GGUF_STRING) {
            for (uint64_t k = 0; k < n; k++) /* each at least 8 bytes */
                if ((s = string(g, c, MAX_STRING, key, NULL, NULL, NULL)))
                    return s;
            return LADEN_OK;
        }
        uint32_t eb = scalar_bytes(et);
        uint64_t bytes;
        if (!eb)
            return laden__fail(LADEN_E_SCHEMA, "%s: metadata '%.200s' is an "
                               "array of value type %u (arrays hold scalars "
                               "or strings)", c->what, key, et);
        if (!laden__mul_u64(n, eb, &bytes))
            return laden__fail(LADEN_E_LIMIT, "%s: metadata '%.200s' has "
                               "%llu elements", c->what, key,
                               (unsigned long long)n);
        return skip(c, bytes, key);
    }
    if (!scalar_bytes(type))
        return laden__fail(LADEN_E_SCHEMA, "%s: metadata '%.200s' has value "
                           "type %u (known: 0 to 12)", c->what, key, type);
    kv->count = 1;
    return scalar(c, type, kv, key);
}

static laden_status read_tensor(laden_gguf_t *g, cursor *c, tensor *t,
                                uint64_t index)
{
    str_of of = {"name", index, NULL};
    laden_status s = string(g, c, MAX_NAME, "a tensor name", &of, &t->name,
                            NULL);
    if (s || (s = u32(c, &t->ndim, t->name)))
        return s;
    if (!*t->name)
        return laden__fail(LADEN_E_NAME, "%s: a tensor without a name",
                           c->what);
    if (t->ndim < 1 || t->ndim > LADEN_GGUF_MAX_DIMS)
        return laden__fail(LADEN_E_SHAPE, "%s: tensor '%.200s' has %u "
                           "dimensions (1 to %u)", c->what, t->name, t->ndim,
                           LADEN_GGUF_MAX_DIMS);
    for (uint32_t d = 0; d < t->ndim; d++)
        if ((s = u64(c, &t->dims[d], t->name)))
            return s;
    for (uint32_t d = t->ndim; d < LADEN_GGUF_MAX_DIMS; d++)
        t->dims[d] = 1;
    if ((s = u32(c, &t->type, t->name)) || (s = u64(c, &t->offset, t->name)))
        return s;
    const char *tname;
    uint32_t telems, tbytes;
    if (!laden__ggml_type(t->type, &tname, &telems, &tbytes))
        return laden__fail(LADEN_E_DTYPE, "%s: tensor '%.200s' has ggml type "
                           "%u, which laden does not know", c->what, t->name,
                           t->type);
    uint64_t elems = 1;
    for (uint32_t d = 0; d < t->ndim; d++)
        if (!t->dims[d] || !laden__mul_u64(elems, t->dims[d], &elems))
            return laden__fail(LADEN_E_SHAPE, "%s: tensor '%.200s' has a "
                               "dimension of %llu", c->what, t->name,
                               (unsigned long long)t->dims[d]);
    if (t->dims[0] % telems)
        return laden__fail(LADEN_E_SHAPE, "%s: tensor '%.200s' (%s) has rows "
                           "of %llu elements, not a multiple of its blocks of "
                           "%u", c->what, t->name, tname,
                           (unsigned long long)t->dims[0], telems);
    if (!laden__mul_u64(elems / telems, tbytes, &t->size))
        return laden__fail(LADEN_E_SHAPE, "%s: tensor '%.200s' is too large",
                           c->what, t->name);
    return LADEN_OK;
}

static int by_name_cmp(const void *a, const void *b, void *arg)
{
    const laden_gguf_t *g = arg;
    return strcmp(g->t[*(const size_t *)a].name, g->t[*(const size_t *)b].name);
}

static int by_offset_cmp(const void *a, const void *b, void *arg)
{
    const laden_gguf_t *g = arg;
    uint64_t x = g->t[*(const size_t *)a].offset,
             y = g->t[*(const size_t *)b].offset;
    return x < y ? -1 : x > y;
}

static int by_key_cmp(const void *a, const void *b, void *arg)
{
    const laden_gguf_t *g = arg;
    return strcmp(g->kv[*(const size_t *)a].key, g->kv[*(const size_t *)b].key);
}

/* Names unique; ranges aligned, inside the data and apart. */
static laden_status check_table(laden_gguf_t *g, const char *what)
{
    size_t *ord = malloc((g->n ? g->n : 1) * sizeof *ord);
    if (!ord)
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory", what);
    g->by_name = malloc((g->n ? g->n : 1) * sizeof *g->by_name);
    if (!g->by_name) {
        free(ord);
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory", what);
    }
    for (size_t i = 0; i < g->n; i++)
        ord[i] = g->by_name[i] = i;
    qsort_r(g->by_name, g->n, sizeof *g->by_name, by_name_cmp, g);
    qsort_r(ord, g->n, sizeof *ord, by_offset_cmp, g);
    laden_status s = LADEN_OK;
    uint64_t data = g->file_size - g->data_offset, end = 0;
    for (size_t k = 0; k < g->n && !s; k++) {
        const tensor *t = &g->t[g->by_name[k]];
        if (k && !strcmp(t->name, g->t[g->by_name[k - 1]].name))
            s = laden__fail(LADEN_E_NAME, "%s: two tensors are named "
                            "'%.200s'", what, t->name);
    }
    for (size_t k = 0; k < g->n && !s; k++) {
        const tensor *t = &g->t[ord[k]];
        uint64_t stop;
        if (t->offset % g->alignment)
            s = laden__fail(LADEN_E_RANGE, "%s: tensor '%.200s' starts at "
                            "%llu, not a multiple of the alignment %u", what,
                            t->name, (unsigned long long)t->offset,
                            g->alignment);
        else if (!laden__add_u64(t->offset, t->size, &stop) || stop > data)
            s = laden__fail(data < stop ? LADEN_E_TRUNCATED : LADEN_E_RANGE,
                            "%s: tensor '%.200s' (%s) ends at byte %llu of "
                            "the data, which has %llu", what, t->name,
                            laden__bytes(t->size).s,
                            (unsigned long long)stop,
                            (unsigned long long)data);
        else if (k && t->offset < end)
            s = laden__fail(LADEN_E_RANGE, "%s: tensor '%.200s' overlaps the "
                            "one before it in the data", what, t->name);
        else
            end = stop;
    }
    free(ord);
    return s;
}

static laden_status unique_keys(laden_gguf_t *g, const char *what)
{
    size_t *ord = malloc((g->nkv ? g->nkv : 1) * sizeof *ord);
    laden_status s = LADEN_OK;
    if (!ord)
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory", what);
    for (size_t i = 0; i < g->nkv; i++)
        ord[i] = i;
    qsort_r(ord, g->nkv, sizeof *ord, by_key_cmp, g);
    for (size_t k = 1; k < g->nkv && !s; k++)
        if (!strcmp(g->kv[ord[k]].key, g->kv[ord[k - 1]].key))
            s = laden__fail(LADEN_E_SCHEMA, "%s: metadata '%.200s' appears "
                            "twice", what, g->kv[ord[k]].key);
    free(ord);
    return s;
}

static laden_status parse(laden_gguf_t *g, cursor *c)
{
    uint8_t magic[4];
    uint64_t nt, nkv;
    laden_status s = take(c, magic, 4, "the magic number");
    if (s)
        return s;
    if (memcmp(magic, "GGUF", 4))
        return laden__fail(LADEN_E_HEADER, "%s: not a GGUF file (it does not "
                           "begin with \"GGUF\")", c->what);
    if ((s = u32(c, &g->version, "the version")))
        return s;
    if (g->version != 2 && g->version != 3)
        return laden__fail(LADEN_E_HEADER, "%s: GGUF version %u (laden reads "
                           "versions 2 and 3, little-endian)", c->what,
                           g->version);
    if ((s = u64(c, &nt, "the tensor count")) ||
        (s = u64(c, &nkv, "the metadata count")))
        return s;
    if (nt > MAX_TENSORS || nkv > MAX_KV)
        return laden__fail(LADEN_E_LIMIT, "%s: %llu tensors and %llu metadata "
                           "entries (at most %u of each)", c->what,
                           (unsigned long long)nt, (unsigned long long)nkv,
                           MAX_TENSORS);
    /* Each entry takes at least 12 bytes: no count beyond what the file
     * could hold is allocated. */
    if (nkv > c->size / 12 || nt > c->size / 12)
        return laden__fail(LADEN_E_TRUNCATED, "%s: %llu metadata entries and "
                           "%llu tensors cannot fit in %llu bytes", c->what,
                           (unsigned long long)nkv, (unsigned long long)nt,
                           (unsigned long long)c->size);
    g->kv = calloc(nkv ? (size_t)nkv : 1, sizeof *g->kv);
    g->t = calloc(nt ? (size_t)nt : 1, sizeof *g->t);
    if (!g->kv || !g->t)
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory", c->what);
    g->alignment = DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < nkv; i++, g->nkv++) {
        laden_gguf_kv_t *kv = &g->kv[i];
        if ((s = read_kv(g, c, kv, i)))
            return s;
        if (!strcmp(kv->key, "general.alignment")) {
            if (kv->type != LADEN_GGUF_U32 || !kv->u ||
                (kv->u & (kv->u - 1)))
                return laden__fail(LADEN_E_SCHEMA, "%s: general.alignment "
                                   "must be a uint32 power of two", c->what);
            g->alignment = (uint32_t)kv->u;
        }
    }
    if ((s = unique_keys(g, c->what)))
        return s;
    for (uint64_t i = 0; i < nt; i++, g->n++)
        if ((s = read_tensor(g, c, &g->t[i], i)))
            return s;
    uint64_t a = g->alignment, off = c->pos;
    g->data_offset = (off + a - 1) / a * a;
    if (g->data_offset > c->size)
        g->data_offset = c->size; /* no data: tensors of 0 bytes only */
    return check_table(g, c->what);
}

static laden_status finish(laden_gguf_t *g, cursor *c, laden_gguf_t **out)
{
    g->file_size = c->size;
    laden_status s = parse(g, c);
    if (s) {
        laden_gguf_close(g);
        return s;
    }
    *out = g;
    return LADEN_OK;
}

laden_status laden_gguf_open_memory(const void *bytes, size_t size,
                                    laden_gguf_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_open_memory: out is "
                           "NULL");
    *out = NULL;
    if (!bytes && size)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_open_memory: NULL");
    laden_gguf_t *g = calloc(1, sizeof *g);
    if (!g)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    cursor c = {.mem = bytes ? bytes : (const uint8_t *)"", .fd = -1,
                .size = size, .what = "GGUF in memory"};
    return finish(g, &c, out);
}

laden_status laden__gguf_open_fd(int fd, const char *path,
                                 laden_gguf_t **out)
{
    struct stat sb;
    *out = NULL;
    if (fstat(fd, &sb) || !S_ISREG(sb.st_mode))
        return laden__fail(LADEN_E_IO, "%s: not a regular file", path);
    laden_gguf_t *g = calloc(1, sizeof *g);
    if (!g)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    cursor c = {.fd = fd, .size = (uint64_t)sb.st_size, .what = path,
                .win = malloc(WINDOW)};
    laden_status s = c.win ? finish(g, &c, out)
                           : laden__fail(LADEN_E_NOMEM, "out of memory");
    if (!c.win)
        free(g);
    free(c.win);
    return s;
}

laden_status laden_gguf_open(const char *path, laden_gguf_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_open: out is NULL");
    *out = NULL;
    if (!path)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_open: NULL path");
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return laden__fail(errno == ENOENT ? LADEN_E_NOENT : LADEN_E_IO,
                           "%s: %s", path, strerror(errno));
    laden_status s = laden__gguf_open_fd(fd, path, out);
    close(fd);
    return s;
}

void laden_gguf_close(laden_gguf_t *g)
{
    if (!g)
        return;
    for (size_t i = 0; i < g->nstrings; i++)
        free(g->strings[i]);
    free(g->strings);
    free(g->t);
    free(g->kv);
    free(g->by_name);
    free(g);
}

uint32_t laden_gguf_version(const laden_gguf_t *g) { return g ? g->version : 0; }
uint32_t laden_gguf_alignment(const laden_gguf_t *g)
{
    return g ? g->alignment : 0;
}
uint64_t laden_gguf_data_offset(const laden_gguf_t *g)
{
    return g ? g->data_offset : 0;
}
size_t laden_gguf_count(const laden_gguf_t *g) { return g ? g->n : 0; }
size_t laden_gguf_metadata_count(const laden_gguf_t *g)
{
    return g ? g->nkv : 0;
}

laden_status laden_gguf_tensor_at(const laden_gguf_t *g, size_t i,
                                  laden_gguf_tensor_t *out)
{
    if (!g || !out || i >= g->n)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_tensor_at: no tensor "
                           "%zu", i);
    const tensor *t = &g->t[i];
    out->name = t->name;
    out->type = t->type;
    out->ndim = t->ndim;
    memcpy(out->dims, t->dims, sizeof out->dims);
    out->offset_bytes = g->data_offset + t->offset;
    out->size_bytes = t->size;
    return LADEN_OK;
}

laden_status laden_gguf_find(const laden_gguf_t *g, const char *name,
                             size_t *out)
{
    if (!g || !name || !out)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_find: NULL");
    size_t lo = 0, hi = g->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(g->t[g->by_name[mid]].name, name);
        if (!c) {
            *out = g->by_name[mid];
            return LADEN_OK;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return laden__fail(LADEN_E_NOTFOUND, "no tensor '%.200s'", name);
}

laden_status laden_gguf_metadata_at(const laden_gguf_t *g, size_t i,
                                    laden_gguf_kv_t *out)
{
    if (!g || !out || i >= g->nkv)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_metadata_at: no entry "
                           "%zu", i);
    *out = g->kv[i];
    return LADEN_OK;
}

laden_status laden_gguf_metadata_find(const laden_gguf_t *g, const char *key,
                                      laden_gguf_kv_t *out)
{
    if (!g || !key || !out)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_metadata_find: NULL");
    for (size_t i = 0; i < g->nkv; i++)
        if (!strcmp(g->kv[i].key, key)) {
            *out = g->kv[i];
            return LADEN_OK;
        }
    return laden__fail(LADEN_E_NOTFOUND, "no metadata '%.200s'", key);
}
