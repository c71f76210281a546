/* Lossless cache files (laden/lossless.h says the format): a checkpoint
 * file's BF16/F16 tensors encoded once, by laden_lossless_cache_write
 * (through compress.c's pool), for the loads that take them
 * (laden_sched_use_lossless_cache): those read the blobs, 0.67 of the
 * bytes for BF16 weights, and encode nothing.  A cache file is laden's
 * own, but a user may keep it anywhere and for long: it names the version
 * of the checkpoint file it was made from (size, modification time, a
 * checksum of the first MiB) and is not used for another; its header and
 * index are checked field by field before anything is read by them (the
 * fuzz target fuzz/fuzz_llcache.c feeds them anything), and each blob is
 * checked as it is read (compress.c).  Calls compress.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "laden/st.h"
#include "stream_internal.h"
#include "stream_layout.h"
#include "stream_lossless.h"

#define MAGIC "LDLCACHE"
#define VERSION 1u
#define SUM_HEAD (1ull << 20) /* the checkpoint file's bytes summed */
/* Encoded a batch of tensors at a time, each blob written as soon as the
 * ones before it are (in_order): the blobs of at most this many raw bytes
 * are held at once. */
#define BATCH_BYTES (2ull << 30)
#define BATCH_JOBS 512u

static laden_status corrupt(const char *what)
{
    return laden__fail(LADEN_E_CORRUPT, "not a lossless cache file laden "
                                        "can read: %s",
                       what);
}

laden_status laden__llc_parse_head(const uint8_t *head, uint64_t file_size,
                                   llc_head *out)
{
    memset(out, 0, sizeof *out);
    if (file_size < LADEN_LLC_HEAD)
        return corrupt("shorter than its header");
    if (memcmp(head, MAGIC, 8) != 0)
        return corrupt("its magic is not \"" MAGIC "\"");
    if (laden__get32(head + 8) != VERSION)
        return corrupt("its version is not 1");
    llc_head h = {.count = laden__get32(head + 12),
                  .index_off = laden__get64(head + 16),
                  .index_bytes = laden__get64(head + 24),
                  .src_size = laden__get64(head + 32),
                  .src_mtime_ns = laden__get64(head + 40),
                  .src_sum = laden__get64(head + 48),
                  .index_sum = laden__get64(head + 56)};
    if (h.count > LADEN_LLC_MAX)
        return corrupt("its count is over 2^24");
    if (h.index_bytes != (uint64_t)h.count * LADEN_LLC_ENTRY)
        return corrupt("its index is not 40 bytes per entry");
    if (h.index_off < LADEN_LLC_ALIGN || h.index_off % LADEN_LLC_ALIGN ||
        h.index_off > file_size || file_size - h.index_off < h.index_bytes)
        return corrupt("its index is not within the file");
    *out = h;
    return LADEN_OK;
}

laden_status laden__llc_parse_index(const llc_head *h, const uint8_t *bytes,
                                    llc_entry **out)
{
    *out = NULL;
    if (laden_io_checksum(bytes, h->index_bytes) != h->index_sum)
        return corrupt("its index's checksum differs");
    llc_entry *e = calloc(h->count ? h->count : 1, sizeof *e);
    if (!e)
        return laden__fail(LADEN_E_NOMEM, "out of memory reading a lossless "
                                          "cache file");
    uint64_t blob_end = LADEN_LLC_ALIGN; /* past the last blob */
    for (uint32_t k = 0; k < h->count; k++) {
        const uint8_t *p = bytes + (uint64_t)k * LADEN_LLC_ENTRY;
        llc_entry x = {.src_off = laden__get64(p),
                       .nelem = laden__get64(p + 8),
                       .dtype = (laden_dtype)laden__get32(p + 16),
                       .kept_raw = laden__get32(p + 20),
                       .blob_off = laden__get64(p + 24),
                       .blob_bytes = laden__get64(p + 32)};
        const char *bad = NULL;
        uint64_t raw = 2 * x.nelem;
        if (k && x.src_off <= e[k - 1].src_off)
            bad = "its entries are not in the checkpoint's order";
        else if (x.dtype != LADEN_DTYPE_BF16 && x.dtype != LADEN_DTYPE_F16)
            bad = "an entry's dtype is not BF16 or F16";
        else if (!x.nelem || x.nelem > (UINT64_MAX >> 2) ||
                 x.src_off > h->src_size || h->src_size - x.src_off < raw)
            bad = "an entry's tensor is not within the checkpoint file";
        else if (x.kept_raw > 1 ||
                 (x.kept_raw && (x.blob_off || x.blob_bytes)))
            bad = "an entry kept raw has a blob";
        else if (!x.kept_raw &&
                 (x.blob_off < blob_end || x.blob_off % LADEN_LLC_ALIGN ||
                  x.blob_bytes < LADEN_LOSSLESS_HEADER_BYTES ||
                  !laden__ll_worth(x.blob_bytes, raw) ||
                  x.blob_off > h->index_off ||
                  h->index_off - x.blob_off < x.blob_bytes))
            bad = "an entry's blob is not in its place";
        if (bad) {
            free(e);
            return corrupt(bad);
        }
        if (!x.kept_raw)
            blob_end = x.blob_off + x.blob_bytes;
        e[k] = x;
    }
    *out = e;
    return LADEN_OK;
}

const llc_entry *laden__llc_find(const laden_llc *c, uint64_t src_off,
                                 uint64_t nelem, laden_dtype dtype)
{
    uint32_t lo = 0, hi = c->n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (c->e[mid].src_off < src_off)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < c->n && c->e[lo].src_off == src_off &&
        c->e[lo].nelem == nelem && c->e[lo].dtype == dtype)
        return &c->e[lo];
    return NULL;
}

void laden__llc_close(laden_llc *c)
{
    if (!c)
        return;
    laden_io_file_close(c->file);
    free(c->e);
    free(c);
}

/* ---- where, and of which version -------------------------------------- */

laden_status laden_lossless_cache_path(const char *file, const char *dir,
                                       char *out, size_t cap)
{
    if (!file || !dir || !out || !cap)
        return laden__fail(LADEN_E_INVAL, "laden_lossless_cache_path: NULL");
    out[0] = 0;
    char *abs = realpath(file, NULL);
    if (!abs)
        return laden__fail(errno == ENOENT ? LADEN_E_NOENT : LADEN_E_IO,
                           "%.300s: %s", file, strerror(errno));
    const char *base = strrchr(abs, '/');
    base = base ? base + 1 : abs;
    uint64_t sum = laden_io_checksum(abs, strlen(abs));
    int n = snprintf(out, cap, "%s%s%s.%016llx.ldlc", dir,
                     dir[0] && dir[strlen(dir) - 1] != '/' ? "/" : "", base,
                     (unsigned long long)sum);
    free(abs);
    if (n < 0 || (size_t)n >= cap) {
        out[0] = 0;
        return laden__fail(LADEN_E_LIMIT, "laden_lossless_cache_path: the "
                                          "path does not fit %zu bytes",
                           cap);
    }
    return LADEN_OK;
}

/* What names the version of checkpoint file f: its size, modification
 * time and the checksum of its first MiB. */
static laden_status identity(laden_io_file_t *f, uint64_t id[3])
{
    id[0] = laden_io_file_size(f);
    laden_io_file_times(f, &id[1], NULL);
    return laden_io_file_checksum(f, 0, id[0] < SUM_HEAD ? id[0] : SUM_HEAD,
                                  &id[2]);
}

/* The cache file of checkpoint file f in dir: *out NULL when there is
 * none, or it is stale (*stale set). */
static laden_status open_llc(laden_io_t *io, laden_io_file_t *f,
                             const char *dir, laden_llc **out, bool *stale)
{
    *out = NULL;
    *stale = false;
    char path[PATH_MAX + 64];
    laden_status s = laden_lossless_cache_path(laden_io_file_path(f), dir,
                                               path, sizeof path);
    if (s)
        return s;
    laden_llc *c = calloc(1, sizeof *c);
    uint8_t head[LADEN_LLC_HEAD], *index = NULL;
    llc_head h;
    uint64_t id[3];
    if (!c)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    if ((s = laden_io_file_open(path, &c->file)) == LADEN_E_NOENT) {
        laden__error_clear(); /* none there */
        free(c);
        return LADEN_OK;
    }
    if (!s &&
        !(s = laden_io_read(io, c->file, 0,
                            laden_io_file_size(c->file) < LADEN_LLC_HEAD
                                ? 0
                                : LADEN_LLC_HEAD,
                            head)) &&
        !(s = laden__llc_parse_head(head, laden_io_file_size(c->file), &h)) &&
        !(s = identity(f, id))) {
        if (h.src_size != id[0] || h.src_mtime_ns != id[1] ||
            h.src_sum != id[2]) {
            *stale = true;
            laden__llc_close(c);
            return LADEN_OK;
        }
        if (!(index = malloc(h.index_bytes ? h.index_bytes : 1)))
            s = laden__fail(LADEN_E_NOMEM, "out of memory");
        if (!s && !(s = laden_io_read(io, c->file, h.index_off,
                                      h.index_bytes, index)))
            s = laden__llc_parse_index(&h, index, &c->e);
        c->n = h.count;
        free(index);
    }
    if (s) {
        laden__error_prefix("the lossless cache file %.300s", path);
        laden__llc_close(c);
        return s;
    }
    *out = c;
    return LADEN_OK;
}

laden_status laden_lossless_cache_entries(const char *file, const char *dir,
                                          laden_lossless_cache_entry *out,
                                          uint32_t cap, uint32_t *count,
                                          int *stale)
{
    if (count)
        *count = 0;
    if (stale)
        *stale = 0;
    if (!file || !dir || !count || !stale || (!out && cap))
        return laden__fail(LADEN_E_INVAL,
                           "laden_lossless_cache_entries: NULL");
    laden_io_t *io = NULL;
    laden_io_file_t *f = NULL;
    laden_llc *c = NULL;
    bool st = false;
    laden_status s = laden_io_create(NULL, &io);
    if (!s)
        s = laden_io_file_open(file, &f);
    if (!s)
        s = open_llc(io, f, dir, &c, &st);
    if (!s && !c && !st) {
        char path[PATH_MAX + 64];
        laden_lossless_cache_path(file, dir, path, sizeof path);
        s = laden__fail(LADEN_E_NOENT, "no lossless cache file %.300s",
                        path);
    }
    if (!s && c) {
        *count = c->n;
        for (uint32_t i = 0; i < c->n && i < cap; i++)
            out[i] = (laden_lossless_cache_entry){
                .src_offset = c->e[i].src_off,
                .n_elems = c->e[i].nelem,
                .dtype = (int32_t)c->e[i].dtype,
                .kept_raw = c->e[i].kept_raw,
                .blob_bytes = c->e[i].blob_bytes};
    }
    *stale = st;
    laden__llc_close(c);
    laden_io_file_close(f);
    if (io)
        laden_io_destroy(io);
    return s;
}

laden_status laden__sched_use_llc(laden_sched_t *sc, const char *dir)
{
    if (!sc || !dir)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_use_lossless_cache: NULL");
    bool marked = false; /* sized from samples already */
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        for (uint32_t k = 0; k < sc->layout.b[i].nt; k++)
            marked |= sc->layout.b[i].t[k].ll_asked;
    if (sc->loaded || sc->layout.laid_out || sc->load.ld || sc->layout.llc ||
        marked)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_use_lossless_cache: %s",
                           sc->layout.llc ? "called already"
                           : marked       ? "after the mark (its sizes are "
                                            "the cache's: call it first)"
                                          : "after load");
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return laden__fail(errno == ENOENT ? LADEN_E_NOENT : LADEN_E_IO,
                           "the lossless cache directory %.300s: %s", dir,
                           strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return laden__fail(LADEN_E_IO, "the lossless cache directory "
                                       "%.300s: not a directory", dir);
    uint32_t nf = sc->layout.nfiles;
    laden_llc **all = calloc(nf ? nf : 1, sizeof *all);
    if (!all)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    uint32_t found = 0, stale_n = 0;
    laden_status s = LADEN_OK;
    for (uint32_t i = 0; i < nf && !s; i++) {
        bool stale;
        s = open_llc(sc->layout.io, sc->layout.files[i], dir, &all[i],
                     &stale);
        found += all[i] != NULL;
        stale_n += stale;
    }
    if (s) {
        for (uint32_t i = 0; i < nf; i++)
            laden__llc_close(all[i]);
        free(all);
        return s;
    }
    sc->layout.llc = all;
    sc->layout.llc_found = found;
    sc->layout.llc_stale = stale_n;
    return LADEN_OK;
}

void laden__sched_llc_free(laden_sched_t *sc)
{
    for (uint32_t i = 0; sc->layout.llc && i < sc->layout.nfiles; i++)
        laden__llc_close(sc->layout.llc[i]);
    free(sc->layout.llc);
    sc->layout.llc = NULL;
}

/* ---- writing ------------------------------------------------------------ */

static laden_status write_all(int fd, const char *path, const void *p,
                              uint64_t n, uint64_t at)
{
    const char *c = p;
    while (n) {
        ssize_t w = pwrite(fd, c, n > (1u << 30) ? (1u << 30) : (size_t)n,
                           (off_t)at);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return laden__fail(LADEN_E_IO, "writing %.300s: %s", path,
                               w < 0 ? strerror(errno) : "nothing written");
        c += w;
        n -= (uint64_t)w;
        at += (uint64_t)w;
    }
    return LADEN_OK;
}

typedef struct writer {
    laden_io_t *io;
    laden_lossless_progress_fn progress;
    void *arg;
    uint64_t done, total; /* over every file */
    laden_lossless_cache_stats st;
} writer;

/* A batch's blobs written into the file in job order as the pool ends
 * them (ll_settle, each job a group of its own), by whichever worker
 * ends the job the file waits for, while the others read and encode.
 * Written after the whole batch was encoded, the writes waited for the
 * encoders and the next batch's reads for the writes. */
typedef struct in_order {
    pthread_mutex_t mu; /* guards ended, next, writing, s */
    ll_job *jobs;       /* the batch's */
    uint8_t *ended;     /* job k ended (and succeeded) */
    uint32_t n, next;   /* the job written next */
    bool writing;       /* a worker writes */
    laden_status s;     /* a write failed: nothing more is written */
    /* The writer's own (one at a time): */
    writer *w;
    int fd;
    const char *path;
    uint8_t *index; /* the batch's first entry */
    uint64_t at;    /* where the next blob goes */
} in_order;

/* Job k's index entry, and its blob written at o->at and freed. */
static laden_status put_job(in_order *o, uint32_t k)
{
    ll_job *j = &o->jobs[k];
    uint8_t *e = o->index + (uint64_t)k * LADEN_LLC_ENTRY;
    laden_status s = LADEN_OK;
    laden__put64(e, j->off);
    laden__put64(e + 8, j->nelem);
    laden__put32(e + 16, (uint32_t)j->dtype);
    laden__put32(e + 20, j->blob ? 0 : 1);
    o->w->st.tensors++;
    o->w->st.raw_bytes += 2 * j->nelem;
    if (j->blob) {
        laden__put64(e + 24, o->at);
        laden__put64(e + 32, j->size);
        s = write_all(o->fd, o->path, j->blob, j->size, o->at);
        o->at = laden__llc_aligned(o->at + j->size);
        o->w->st.coded++;
        o->w->st.coded_raw_bytes += 2 * j->nelem;
        o->w->st.coded_bytes += j->size;
    }
    free(j->blob);
    j->blob = NULL;
    return s;
}

static laden_status write_in_order(void *arg, ll_job *job, uint32_t n,
                                   const atomic_bool *stop)
{
    in_order *o = arg;
    (void)n; /* 1: a group a job */
    pthread_mutex_lock(&o->mu);
    o->ended[job - o->jobs] = 1;
    if (o->writing || o->s) { /* the writer takes it, or none will */
        pthread_mutex_unlock(&o->mu);
        return LADEN_OK;
    }
    o->writing = true;
    laden_status s = LADEN_OK;
    /* A stopped run (a cancel) writes no more: the file is removed. */
    while (!s && !atomic_load(stop) && o->next < o->n &&
           o->ended[o->next]) {
        uint32_t k = o->next;
        pthread_mutex_unlock(&o->mu);
        s = put_job(o, k);
        pthread_mutex_lock(&o->mu);
        o->next++;
    }
    o->s = s;
    o->writing = false;
    pthread_mutex_unlock(&o->mu);
    return s;
}

/* Reads, encodes and writes jobs[0..n) (a batch) in order; o's writer
 * fields set.  The blobs not written (a failure) are freed here. */
static laden_status run_batch(in_order *o, ll_job *jobs, uint32_t n,
                              uint64_t raw)
{
    writer *w = o->w;
    o->jobs = jobs;
    o->n = n;
    o->next = 0;
    o->writing = false;
    o->s = LADEN_OK;
    if (!(o->ended = calloc(n ? n : 1, 1)))
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    pthread_mutex_init(&o->mu, NULL);
    for (uint32_t k = 0; k < n; k++)
        jobs[k].group = k;
    ll_settle settle = {.fn = write_in_order, .arg = o};
    laden_status s = laden__ll_run(w->io, jobs, n, &settle, w->progress,
                                   w->arg, w->done, w->total,
                                   "laden_lossless_cache_write");
    w->done += raw;
    if (!s && o->next != n) /* every job ended: the last writer wrote all */
        s = laden__fail(LADEN_E_STATE, "the lossless cache writer left %u "
                                       "of %u blobs unwritten",
                        n - o->next, n);
    for (uint32_t k = 0; k < n; k++) {
        free(jobs[k].blob);
        jobs[k].blob = NULL;
    }
    pthread_mutex_destroy(&o->mu);
    free(o->ended);
    o->ended = NULL;
    return s;
}

/* Encodes the BF16/F16 tensors of file `fi` of st and writes them to
 * fd, the file at `path` (a file of its own), which it closes. */
static laden_status write_file(writer *w, const laden_st_t *st, size_t fi,
                               int fd, const char *path)
{
    laden_io_file_t *f = NULL;
    size_t nt = laden_st_count(st);
    uint32_t n = 0;
    laden_status s = laden_st_file_open(st, fi, &f);
    ll_job *jobs = s ? NULL : calloc(nt ? nt : 1, sizeof *jobs);
    uint8_t *index = NULL;
    uint64_t id[3];
    if (!s && !jobs)
        s = laden__fail(LADEN_E_NOMEM, "out of memory");
    for (size_t i = 0; !s && i < nt; i++) {
        laden_st_tensor_t t;
        if ((s = laden_st_tensor_at(st, i, &t)))
            break;
        if (t.file_index != fi || !t.size_bytes ||
            (t.dtype != LADEN_DTYPE_BF16 && t.dtype != LADEN_DTYPE_F16))
            continue;
        jobs[n++] = (ll_job){.file = f, .off = t.offset_bytes,
                             .nelem = t.size_bytes / 2, .dtype = t.dtype,
                             .name = t.name};
    }
    if (!s && !(index = calloc(n ? n : 1, LADEN_LLC_ENTRY)))
        s = laden__fail(LADEN_E_NOMEM, "out of memory");
    uint64_t at = LADEN_LLC_ALIGN, file_bytes = 0;
    in_order o = {.w = w, .fd = fd, .path = path};
    for (uint32_t b0 = 0, b1; !s && b0 < n; b0 = b1) {
        uint64_t raw = 0;
        for (b1 = b0; b1 < n && b1 - b0 < BATCH_JOBS &&
                      (b1 == b0 || raw + 2 * jobs[b1].nelem <= BATCH_BYTES);
             b1++)
            raw += 2 * jobs[b1].nelem;
        o.index = index + (uint64_t)b0 * LADEN_LLC_ENTRY;
        o.at = at;
        s = run_batch(&o, jobs + b0, b1 - b0, raw);
        at = o.at;
    }
    uint8_t head[LADEN_LLC_HEAD] = {0};
    if (!s && !(s = identity(f, id))) {
        memcpy(head, MAGIC, 8);
        laden__put32(head + 8, VERSION);
        laden__put32(head + 12, n);
        laden__put64(head + 16, at);
        laden__put64(head + 24, (uint64_t)n * LADEN_LLC_ENTRY);
        laden__put64(head + 32, id[0]);
        laden__put64(head + 40, id[1]);
        laden__put64(head + 48, id[2]);
        laden__put64(head + 56,
              laden_io_checksum(index, (uint64_t)n * LADEN_LLC_ENTRY));
        file_bytes = at + (uint64_t)n * LADEN_LLC_ENTRY;
        /* Its length set, not left to the last write: a file without a
         * BF16/F16 tensor has an empty index at `at`. */
        if (!(s = write_all(fd, path, index, (uint64_t)n * LADEN_LLC_ENTRY,
                            at)) &&
            !(s = write_all(fd, path, head, sizeof head, 0)) &&
            (ftruncate(fd, (off_t)file_bytes) != 0 || fsync(fd) != 0))
            s = laden__fail(LADEN_E_IO, "writing %.300s: %s", path,
                            strerror(errno));
        /* Written and synced: its pages need not stay in the page cache
         * beside the loads' own copies (a hint). */
        if (!s)
            (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    if (close(fd) != 0 && !s)
        s = laden__fail(LADEN_E_IO, "writing %.300s: %s", path,
                        strerror(errno));
    if (!s) {
        w->st.files++;
        w->st.file_bytes += file_bytes;
    }
    free(index);
    free(jobs);
    laden_io_file_close(f);
    return s;
}

laden_status laden_lossless_cache_write(
    const char *checkpoint, const char *dir,
    laden_lossless_progress_fn progress, void *arg,
    laden_lossless_cache_stats *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!checkpoint || !dir || !dir[0])
        return laden__fail(LADEN_E_INVAL, "laden_lossless_cache_write: NULL "
                                          "or empty path");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return laden__fail(errno == ENOENT ? LADEN_E_NOENT : LADEN_E_IO,
                           "cannot make the lossless cache directory "
                           "%.300s: %s",
                           dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return laden__fail(LADEN_E_IO, "the lossless cache directory %.300s "
                                       "is not a directory",
                           dir);
    laden_st_t *st = NULL;
    writer w = {.progress = progress, .arg = arg};
    laden_status s = laden_st_open(checkpoint, &st);
    if (!s)
        s = laden_io_create(NULL, &w.io);
    for (size_t i = 0, nt = st ? laden_st_count(st) : 0; !s && i < nt; i++) {
        laden_st_tensor_t t;
        if (!(s = laden_st_tensor_at(st, i, &t)) &&
            (t.dtype == LADEN_DTYPE_BF16 || t.dtype == LADEN_DTYPE_F16))
            w.total += t.size_bytes;
    }
    /* Each file written under a name of its own (mkstemp: no other writer,
     * thread or host, shares it), and all renamed into place only once
     * every one is whole: a failure or a cancel leaves nothing behind. */
    size_t nf = st ? laden_st_file_count(st) : 0;
    char(*tmp)[PATH_MAX + 96] = s ? NULL : calloc(nf ? nf : 1, sizeof *tmp);
    if (!s && !tmp)
        s = laden__fail(LADEN_E_NOMEM, "out of memory");
    for (size_t fi = 0; !s && fi < nf; fi++) {
        char path[PATH_MAX + 64];
        if ((s = laden_lossless_cache_path(laden_st_file_path(st, fi), dir,
                                           path, sizeof path)))
            break;
        snprintf(tmp[fi], sizeof tmp[fi], "%s.XXXXXX", path);
        int fd = mkostemp(tmp[fi], O_CLOEXEC);
        if (fd < 0 || fchmod(fd, 0644) != 0) {
            s = laden__fail(LADEN_E_IO, "cannot write in %.300s: %s", dir,
                            strerror(errno));
            if (fd < 0)
                tmp[fi][0] = 0;
            else
                close(fd);
        } else {
            s = write_file(&w, st, fi, fd, tmp[fi]); /* closes fd */
        }
    }
    for (size_t fi = 0; !s && fi < nf; fi++) {
        char path[PATH_MAX + 64]; /* tmp[fi] without mkstemp's suffix */
        size_t n = strlen(tmp[fi]) - strlen(".XXXXXX");
        memcpy(path, tmp[fi], n);
        path[n] = 0;
        if (rename(tmp[fi], path) != 0)
            s = laden__fail(LADEN_E_IO, "cannot rename %.300s to %.300s: %s",
                            tmp[fi], path, strerror(errno));
        if (!s)
            tmp[fi][0] = 0; /* in place */
    }
    for (size_t fi = 0; tmp && fi < nf; fi++)
        if (tmp[fi][0])
            unlink(tmp[fi]);
    free(tmp);
    if (w.io)
        laden_io_destroy(w.io);
    laden_st_close(st);
    if (out && !s)
        *out = w.st;
    return s;
}
