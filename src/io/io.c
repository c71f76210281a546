/* Reader pool.  See include/laden/io.h.
 *
 * A read is split into chunks that the pool's threads take from one FIFO.
 * A chunk goes straight into the caller's buffer with O_DIRECT when the
 * buffer and the file offset agree modulo the direct-I/O alignment (the
 * unaligned head and tail are read buffered); otherwise it is read with
 * O_DIRECT into the thread's aligned bounce buffer and copied, which costs a
 * memcpy (≈30 GB/s) but keeps the drive's direct rate and spares the page
 * cache.  A file system that refuses O_DIRECT falls back to buffered reads
 * for that file.
 *
 * What of a chunk is in the page cache already is first read from there
 * with preadv2(RWF_NOWAIT), which copies cached pages and stops at the
 * first page that is not (starting no I/O): memory speed, where O_DIRECT
 * would read the drive again.  (mincore cannot tell: for a file the
 * process may not write, Linux reports every page cached.)  The rest goes
 * to the drive as above.  The bytes each way are counted per request and
 * per pool. */
#define _GNU_SOURCE
#include "laden/io.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "../core/internal.h"
#include "../trace/trace_internal.h"

#define IO_ALIGN 4096u
/* Threads: enough requests in flight for a drive (4), and for copies out
 * of the page cache one per two cores up to 16. */
#define MIN_THREADS 4u
#define MAX_DEFAULT_THREADS 16u
#define DEFAULT_CHUNK (16ull << 20)
#define MAX_THREADS 64u

struct laden_io_file {
    int fd;  /* buffered */
    int dfd; /* O_DIRECT, or -1 */
    atomic_int direct_ok;
    uint64_t size;
    struct timespec mtime; /* size and mtime at open: see unchanged() */
    uint64_t dev, ino;
    char *path;
};

typedef struct job {
    struct job *next;
    laden_io_req_t *req;
    laden_io_file_t *file;
    uint64_t off, len;
    char *dst;
} job;

struct laden_io_req {
    size_t pending; /* chunks not yet done; guarded by io->mu */
    laden_io_then_fn then; /* run by a reader once every chunk is in */
    void *then_arg;
    uint64_t cached; /* bytes served from the page cache; guarded by mu */
    laden_status status;
    char err[512];
    job *jobs;
    size_t jobs_cap;
    struct laden_io_req *next_free;
};

typedef struct worker {
    laden_io_t *io;
    pthread_t thread;
    char *bounce;
    size_t bounce_bytes;
} worker;

struct laden_io {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    job *head, *tail;
    laden_io_req_t *free_reqs; /* finished requests kept for reuse, so a
                                  steady stream of reads allocates nothing */
    size_t nfree;
    bool stop;
    uint32_t nthreads;
    uint64_t chunk;
    laden_io_direct direct;
    atomic_int nowait_ok; /* preadv2(RWF_NOWAIT) works here */
    worker *workers;
    laden_io_stats_t st; /* guarded by mu */
};

/* ---- files ------------------------------------------------------------ */

/* Opens path for reading without blocking on what is not a regular file:
 * refused by a stat before any open, and again after an open with
 * O_NONBLOCK (the path may have changed in between; a FIFO would block in
 * open until a writer came).  *sb is its stat; -1 with errno set, EISDIR
 * standing for "not a regular file". */
static int open_regular(const char *path, int flags, struct stat *sb)
{
    if (stat(path, sb) != 0)
        return -1;
    if (!S_ISREG(sb->st_mode)) {
        errno = EISDIR;
        return -1;
    }
    int fd = open(path, flags | O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return -1;
    int e = 0;
    if (fstat(fd, sb) != 0)
        e = errno;
    else if (!S_ISREG(sb->st_mode))
        e = EISDIR;
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        e = errno;
    if (e) {
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

laden_status laden_io_file_open(const char *path, laden_io_file_t **out)
{
    struct stat sb, dsb;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_io_file_open: out is NULL");
    *out = NULL;
    if (!path)
        return laden__fail(LADEN_E_INVAL, "laden_io_file_open: path is NULL");
    laden_io_file_t *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return laden__fail(LADEN_E_NOMEM, "out of memory opening %s", path);
    }
    f->fd = open_regular(path, 0, &sb);
    if (f->fd < 0) {
        int e = errno;
        free(f->path);
        free(f);
        if (e == EISDIR)
            return laden__fail(LADEN_E_INVAL, "%s: not a regular file", path);
        return laden__fail(e == ENOENT ? LADEN_E_NOENT : LADEN_E_IO,
                           "%s: cannot open: %s", path, strerror(e));
    }
    f->size = (uint64_t)sb.st_size;
    f->mtime = sb.st_mtim;
    f->dev = (uint64_t)sb.st_dev;
    f->ino = (uint64_t)sb.st_ino;
    /* The direct descriptor must be the same file: the path may have been
     * replaced between the two opens. */
    f->dfd = open_regular(path, O_DIRECT, &dsb);
    if (f->dfd >= 0 && (dsb.st_dev != sb.st_dev || dsb.st_ino != sb.st_ino)) {
        close(f->dfd);
        f->dfd = -1;
    }
    atomic_init(&f->direct_ok, f->dfd >= 0);
    *out = f;
    return LADEN_OK;
}

void laden_io_file_close(laden_io_file_t *f)
{
    if (!f)
        return;
    close(f->fd);
    if (f->dfd >= 0)
        close(f->dfd);
    free(f->path);
    free(f);
}

uint64_t laden_io_file_size(const laden_io_file_t *f) { return f ? f->size : 0; }
void laden_io_file_identity(const laden_io_file_t *f, uint64_t id[4])
{
    id[0] = f ? f->dev : 0;
    id[1] = f ? f->ino : 0;
    id[2] = f ? f->size : 0;
    id[3] = f ? (uint64_t)f->mtime.tv_sec * 1000000000u +
                    (uint64_t)f->mtime.tv_nsec
              : 0;
}
const char *laden_io_file_path(const laden_io_file_t *f)
{
    return f ? f->path : NULL;
}
int laden_io_file_direct(const laden_io_file_t *f)
{
    return f ? atomic_load(&f->direct_ok) : 0;
}

laden_status laden_io_drop_cache(laden_io_file_t *f)
{
    if (!f)
        return laden__fail(LADEN_E_INVAL, "laden_io_drop_cache: NULL file");
    /* Dirty pages are not dropped: write them out first. */
    if (fdatasync(f->fd) != 0 && errno != EINVAL)
        return laden__fail(LADEN_E_IO, "%s: fdatasync: %s", f->path,
                           strerror(errno));
    int e = posix_fadvise(f->fd, 0, 0, POSIX_FADV_DONTNEED);
    if (e)
        return laden__fail(LADEN_E_IO, "%s: posix_fadvise: %s", f->path,
                           strerror(e));
    return LADEN_OK;
}

/* ---- reading one chunk ------------------------------------------------- */

/* LADEN_E_CHANGED if the file's size or modification time differ from
 * when it was opened: it was rewritten in place (a file replaced by a
 * rename keeps serving the original bytes through the open descriptor).
 * Checked after every chunk, so bytes read from a file that changed are
 * never returned as its data: a writer updates the time before it changes
 * the bytes. */
static laden_status unchanged(laden_io_file_t *f)
{
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        return laden__fail(LADEN_E_IO, "%s: fstat: %s", f->path,
                           strerror(errno));
    if ((uint64_t)sb.st_size == f->size &&
        sb.st_mtim.tv_sec == f->mtime.tv_sec &&
        sb.st_mtim.tv_nsec == f->mtime.tv_nsec)
        return LADEN_OK;
    uint64_t now = (uint64_t)sb.st_size;
    return laden__fail(LADEN_E_CHANGED,
                       "%s: the file changed while in use (%s: %s when "
                       "opened, %s now); load it again",
                       f->path,
                       now < f->size   ? "truncated"
                       : now > f->size ? "grown"
                                       : "rewritten",
                       laden__bytes(f->size).s, laden__bytes(now).s);
}

static laden_status ended_early(laden_io_file_t *f, uint64_t at, uint64_t off,
                                uint64_t len)
{
    return laden__fail(LADEN_E_TRUNCATED,
                       "%s: file ended at byte %llu while reading bytes "
                       "%llu..%llu (was it truncated while in use?)",
                       f->path, (unsigned long long)at,
                       (unsigned long long)off,
                       (unsigned long long)(off + len));
}

static laden_status read_failed(laden_io_file_t *f, uint64_t at, int e)
{
    return laden__fail(e == ENOMEM ? LADEN_E_NOMEM : LADEN_E_IO,
                       "%s: read failed at byte %llu: %s", f->path,
                       (unsigned long long)at, strerror(e));
}

static laden_status read_buffered(laden_io_file_t *f, uint64_t off,
                                  uint64_t len, char *dst)
{
    uint64_t done = 0;
    while (done < len) {
        size_t want = (size_t)(len - done > (1u << 30) ? (1u << 30)
                                                       : len - done);
        ssize_t r = pread(f->fd, dst + done, want, (off_t)(off + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return read_failed(f, off + done, errno);
        if (r == 0)
            return ended_early(f, off + done, off, len);
        done += (uint64_t)r;
    }
    return LADEN_OK;
}

/* O_DIRECT read of [off, off+len) (aligned) into buf (aligned).  Stops at
 * end of file; *got receives the bytes read.  LADEN_E_UNSUPPORTED if the
 * file system refused the alignment (EINVAL). */
static laden_status read_direct(laden_io_file_t *f, uint64_t off, uint64_t len,
                                char *buf, uint64_t *got)
{
    uint64_t done = 0;
    *got = 0;
    while (done < len) {
        size_t want = (size_t)(len - done > (1u << 30) ? (1u << 30)
                                                       : len - done);
        ssize_t r = pread(f->dfd, buf + done, want, (off_t)(off + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EINVAL)
            return LADEN_E_UNSUPPORTED;
        if (r < 0)
            return read_failed(f, off + done, errno);
        done += (uint64_t)r;
        if (r == 0 || r % IO_ALIGN)
            break; /* end of file */
    }
    *got = done;
    return LADEN_OK;
}

/* Reads what of [off, off+len) the page cache holds, from its start,
 * without starting I/O; *got receives the bytes read (0 when the first
 * page is not cached, or preadv2(RWF_NOWAIT) is not available). */
static void read_cached(laden_io_t *io, laden_io_file_t *f, uint64_t off,
                        uint64_t len, char *dst, uint64_t *got)
{
    *got = 0;
    while (*got < len && atomic_load(&io->nowait_ok)) {
        struct iovec v = {dst + *got, (size_t)(len - *got > (1u << 30)
                                                   ? (1u << 30)
                                                   : len - *got)};
        ssize_t r = preadv2(f->fd, &v, 1, (off_t)(off + *got), RWF_NOWAIT);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EOPNOTSUPP || errno == ENOSYS ||
                      errno == EINVAL))
            atomic_store(&io->nowait_ok, 0); /* kernel or file system */
        if (r <= 0)
            return; /* EAGAIN: not cached; an error: the drive will say */
        *got += (uint64_t)r;
    }
}

/* [off, off+len) with O_DIRECT; *buffered receives the bytes read
 * buffered instead (unaligned edges, a file system refusing O_DIRECT, a
 * range too large for the bounce buffer). */
static laden_status read_direct_chunk(worker *w, laden_io_file_t *f,
                                      uint64_t off, uint64_t len, char *dst,
                                      uint64_t *buffered)
{
    laden_status s;
    uint64_t got;
    *buffered = 0;
    if (len < IO_ALIGN) {
        *buffered = len;
        return read_buffered(f, off, len, dst);
    }
    if (((uintptr_t)dst - off) % IO_ALIGN == 0) {
        uint64_t head = (IO_ALIGN - off % IO_ALIGN) % IO_ALIGN;
        uint64_t mid = (len - head) & ~(uint64_t)(IO_ALIGN - 1);
        *buffered = head;
        if (head && (s = read_buffered(f, off, head, dst)))
            return s;
        s = read_direct(f, off + head, mid, dst + head, &got);
        if (s == LADEN_E_UNSUPPORTED) {
            atomic_store(&f->direct_ok, 0);
            *buffered = len;
            return read_buffered(f, off, len, dst);
        }
        if (s)
            return s;
        if (got < mid)
            return ended_early(f, off + head + got, off, len);
        *buffered += len - head - mid;
        if (len > head + mid)
            return read_buffered(f, off + head + mid, len - head - mid,
                                 dst + head + mid);
        return LADEN_OK;
    }
    uint64_t a0 = off & ~(uint64_t)(IO_ALIGN - 1);
    uint64_t a1 = (off + len + IO_ALIGN - 1) & ~(uint64_t)(IO_ALIGN - 1);
    if (a1 - a0 > w->bounce_bytes) {
        *buffered = len;
        return read_buffered(f, off, len, dst);
    }
    s = read_direct(f, a0, a1 - a0, w->bounce, &got);
    if (s == LADEN_E_UNSUPPORTED) {
        atomic_store(&f->direct_ok, 0);
        *buffered = len;
        return read_buffered(f, off, len, dst);
    }
    if (s)
        return s;
    if (got < off + len - a0)
        return ended_early(f, a0 + got, off, len);
    memcpy(dst, w->bounce + (off - a0), len);
    return LADEN_OK;
}

/* Reads one chunk: what the page cache holds from there, the rest with
 * O_DIRECT where the file takes it, else buffered.  Counts the bytes
 * each way in n[0] direct, n[1] from the cache, n[2] buffered. */
static laden_status read_chunk(worker *w, laden_io_file_t *f, uint64_t off,
                               uint64_t len, char *dst, uint64_t n[3])
{
    if (!atomic_load(&f->direct_ok) || w->io->direct == LADEN_IO_DIRECT_OFF ||
        len < IO_ALIGN) {
        n[2] = len;
        return read_buffered(f, off, len, dst);
    }
    read_cached(w->io, f, off, len, dst, &n[1]);
    if (n[1] == len)
        return LADEN_OK;
    laden_status s = read_direct_chunk(w, f, off + n[1], len - n[1],
                                       dst + n[1], &n[2]);
    n[0] = len - n[1] - n[2];
    return s;
}

/* ---- the pool ---------------------------------------------------------- */

static void *worker_main(void *arg)
{
    worker *w = arg;
    laden_io_t *io = w->io;
    pthread_setname_np(pthread_self(), "laden-io");
    pthread_mutex_lock(&io->mu);
    for (;;) {
        while (!io->head && !io->stop)
            pthread_cond_wait(&io->work_cv, &io->mu);
        if (!io->head)
            break;
        job *jb = io->head;
        io->head = jb->next;
        if (!io->head)
            io->tail = NULL;
        laden_io_req_t *req = jb->req;
        bool skip = req->status != LADEN_OK; /* an earlier chunk failed */
        pthread_mutex_unlock(&io->mu);
        laden_status s = LADEN_OK;
        uint64_t n[3] = {0, 0, 0};
        uint64_t t0 = LADEN__TRACING() ? laden__now_ns() : 0;
        if (!skip && !(s = read_chunk(w, jb->file, jb->off, jb->len,
                                      jb->dst, n)))
            s = unchanged(jb->file);
        if (t0 && !skip) {
            uint64_t sess = laden__trace_session(); /* before the name */
            laden__trace_span(LADEN__EV_READ, sess, t0, jb->off, jb->len,
                              n[1], laden__trace_intern(jb->file->path));
        }
        pthread_mutex_lock(&io->mu);
        if (!s) {
            io->st.direct_bytes += n[0];
            io->st.cached_bytes += n[1];
            io->st.buffered_bytes += n[2];
            req->cached += n[1];
        }
        if (s && req->status == LADEN_OK) {
            req->status = s;
            snprintf(req->err, sizeof req->err, "%s", laden_last_error());
        }
        if (req->pending == 1 && req->then && req->status == LADEN_OK) {
            /* The last chunk: its reader runs the request's follow-up
             * (a conversion) before anyone waiting sees it done. */
            pthread_mutex_unlock(&io->mu);
            laden_status t = req->then(req->then_arg);
            pthread_mutex_lock(&io->mu);
            if (t) {
                req->status = t;
                snprintf(req->err, sizeof req->err, "%s", laden_last_error());
            }
        }
        if (--req->pending == 0)
            pthread_cond_broadcast(&io->done_cv);
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

laden_status laden_io_create(const laden_io_config *cfg, laden_io_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_io_create: out is NULL");
    *out = NULL;
    laden_io_config c = cfg ? *cfg : (laden_io_config){0};
    if (c.threads == 0) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        c.threads = ncpu > 2 * MIN_THREADS ? (uint32_t)(ncpu / 2) : MIN_THREADS;
        if (c.threads > MAX_DEFAULT_THREADS)
            c.threads = MAX_DEFAULT_THREADS;
    }
    if (c.threads > MAX_THREADS)
        return laden__fail(LADEN_E_INVAL,
                           "laden_io_create: %u threads, at most %u", c.threads,
                           MAX_THREADS);
    if (c.chunk_bytes == 0)
        c.chunk_bytes = DEFAULT_CHUNK;
    if (c.chunk_bytes > (1ull << 30))
        return laden__fail(LADEN_E_INVAL,
                           "laden_io_create: chunk of %s, at most 1 GiB",
                           laden__bytes(c.chunk_bytes).s);
    c.chunk_bytes = (c.chunk_bytes + (1u << 20) - 1) & ~((1ull << 20) - 1);
    if (c.direct != LADEN_IO_DIRECT_AUTO && c.direct != LADEN_IO_DIRECT_OFF)
        return laden__fail(LADEN_E_INVAL, "laden_io_create: bad direct mode");

    laden_io_t *io = calloc(1, sizeof *io);
    if (!io)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a reader");
    io->nthreads = c.threads;
    io->chunk = c.chunk_bytes;
    io->direct = c.direct;
    atomic_init(&io->nowait_ok, 1);
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->work_cv, NULL);
    pthread_cond_init(&io->done_cv, NULL);
    io->workers = calloc(c.threads, sizeof *io->workers);
    if (!io->workers) {
        laden_io_destroy(io);
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a reader");
    }
    for (uint32_t i = 0; i < c.threads; i++) {
        worker *w = &io->workers[i];
        w->io = io;
        if (c.direct == LADEN_IO_DIRECT_AUTO) {
            w->bounce_bytes = (size_t)c.chunk_bytes + 2 * IO_ALIGN;
            void *p = NULL;
            if (posix_memalign(&p, IO_ALIGN, w->bounce_bytes) != 0) {
                io->nthreads = i;
                laden_io_destroy(io);
                return laden__fail(LADEN_E_NOMEM,
                                   "out of memory for reader bounce buffers");
            }
            w->bounce = p;
        }
        int e = pthread_create(&w->thread, NULL, worker_main, w);
        if (e) {
            free(w->bounce);
            w->bounce = NULL;
            io->nthreads = i;
            laden_io_destroy(io);
            return laden__fail(LADEN_E_NOMEM, "cannot start reader thread: %s",
                               strerror(e));
        }
    }
    *out = io;
    return LADEN_OK;
}

void laden_io_destroy(laden_io_t *io)
{
    if (!io)
        return;
    pthread_mutex_lock(&io->mu);
    io->stop = true;
    pthread_cond_broadcast(&io->work_cv);
    pthread_mutex_unlock(&io->mu);
    for (uint32_t i = 0; i < io->nthreads; i++) {
        pthread_join(io->workers[i].thread, NULL);
        free(io->workers[i].bounce);
    }
    free(io->workers);
    while (io->free_reqs) {
        laden_io_req_t *r = io->free_reqs;
        io->free_reqs = r->next_free;
        free(r->jobs);
        free(r);
    }
    pthread_cond_destroy(&io->work_cv);
    pthread_cond_destroy(&io->done_cv);
    pthread_mutex_destroy(&io->mu);
    free(io);
}

laden_status laden_io_submit(laden_io_t *io, laden_io_file_t *f,
                             uint64_t offset, uint64_t size, void *dst,
                             laden_io_req_t **out)
{
    return laden_io_submit_then(io, f, offset, size, dst, NULL, NULL, out);
}

laden_status laden_io_submit_then(laden_io_t *io, laden_io_file_t *f,
                                  uint64_t offset, uint64_t size, void *dst,
                                  laden_io_then_fn then, void *then_arg,
                                  laden_io_req_t **out)
{
    uint64_t end;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_io_submit: out is NULL");
    *out = NULL;
    if (!io || !f || (!dst && size))
        return laden__fail(LADEN_E_INVAL, "laden_io_submit: NULL argument");
    if (!laden__add_u64(offset, size, &end) || end > f->size)
        return laden__fail(LADEN_E_TRUNCATED,
                           "%s: bytes %llu..%llu asked, but the file holds "
                           "%llu",
                           f->path, (unsigned long long)offset,
                           (unsigned long long)(offset + size),
                           (unsigned long long)f->size);
    size_t n = (size_t)((size + io->chunk - 1) / io->chunk);
    laden_io_req_t *r = NULL;
    pthread_mutex_lock(&io->mu);
    for (laden_io_req_t **l = &io->free_reqs; *l; l = &(*l)->next_free)
        if ((*l)->jobs_cap >= n) {
            r = *l;
            *l = r->next_free;
            io->nfree--;
            break;
        }
    pthread_mutex_unlock(&io->mu);
    if (r) {
        r->status = LADEN_OK;
        r->cached = 0;
        r->then = NULL;
        r->err[0] = '\0';
        r->next_free = NULL;
    } else {
        r = calloc(1, sizeof *r);
        if (!r || !(r->jobs = calloc(n ? n : 1, sizeof *r->jobs))) {
            free(r);
            return laden__fail(LADEN_E_NOMEM, "out of memory queueing a read");
        }
        r->jobs_cap = n ? n : 1;
    }
    for (size_t i = 0; i < n; i++) {
        job *jb = &r->jobs[i];
        jb->req = r;
        jb->file = f;
        jb->off = offset + i * io->chunk;
        jb->len = size - i * io->chunk < io->chunk ? size - i * io->chunk
                                                  : io->chunk;
        jb->dst = (char *)dst + i * io->chunk;
        jb->next = i + 1 < n ? &r->jobs[i + 1] : NULL;
    }
    r->then = then;
    r->then_arg = then_arg;
    if (!n && then && (r->status = then(then_arg)))
        snprintf(r->err, sizeof r->err, "%s", laden_last_error());
    pthread_mutex_lock(&io->mu);
    r->pending = n;
    if (n) {
        if (io->tail)
            io->tail->next = &r->jobs[0];
        else
            io->head = &r->jobs[0];
        io->tail = &r->jobs[n - 1];
        pthread_cond_broadcast(&io->work_cv);
    }
    pthread_mutex_unlock(&io->mu);
    *out = r;
    return LADEN_OK;
}

laden_status laden_io_wait(laden_io_t *io, laden_io_req_t *r)
{
    return laden_io_wait_cached(io, r, NULL);
}

laden_status laden_io_wait_cached(laden_io_t *io, laden_io_req_t *r,
                                  uint64_t *cached_bytes)
{
    if (cached_bytes)
        *cached_bytes = 0;
    if (!io || !r)
        return laden__fail(LADEN_E_INVAL, "laden_io_wait: NULL argument");
    pthread_mutex_lock(&io->mu);
    while (r->pending)
        pthread_cond_wait(&io->done_cv, &io->mu);
    if (cached_bytes)
        *cached_bytes = r->cached;
    pthread_mutex_unlock(&io->mu);
    laden_status s = r->status;
    if (s)
        laden__fail(s, "%s", r->err);
    pthread_mutex_lock(&io->mu);
    if (io->nfree < 256) { /* keep a bounded number for reuse */
        r->next_free = io->free_reqs;
        io->free_reqs = r;
        io->nfree++;
        r = NULL;
    }
    pthread_mutex_unlock(&io->mu);
    if (r) {
        free(r->jobs);
        free(r);
    }
    return s;
}

laden_status laden_io_poll(laden_io_t *io, laden_io_req_t *r, int *done)
{
    if (done)
        *done = 0;
    if (!io || !r || !done)
        return laden__fail(LADEN_E_INVAL, "laden_io_poll: NULL argument");
    pthread_mutex_lock(&io->mu);
    *done = r->pending == 0;
    pthread_mutex_unlock(&io->mu);
    return LADEN_OK;
}

laden_status laden_io_stats(laden_io_t *io, laden_io_stats_t *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!io || !out)
        return laden__fail(LADEN_E_INVAL, "laden_io_stats: NULL argument");
    pthread_mutex_lock(&io->mu);
    *out = io->st;
    out->threads = io->nthreads;
    pthread_mutex_unlock(&io->mu);
    return LADEN_OK;
}

laden_status laden_io_read(laden_io_t *io, laden_io_file_t *f, uint64_t offset,
                           uint64_t size, void *dst)
{
    laden_io_req_t *r;
    laden_status s = laden_io_submit(io, f, offset, size, dst, &r);
    return s ? s : laden_io_wait(io, r);
}

/* ---- mapping ----------------------------------------------------------- */

static char empty_map[1];

laden_status laden_io_map(laden_io_file_t *f, void **out, uint64_t *out_size)
{
    if (out)
        *out = NULL;
    if (out_size)
        *out_size = 0;
    if (!f || !out || !out_size)
        return laden__fail(LADEN_E_INVAL, "laden_io_map: NULL argument");
    if (f->size == 0) {
        *out = empty_map;
        return LADEN_OK;
    }
    void *p = mmap(NULL, (size_t)f->size, PROT_READ | PROT_WRITE, MAP_PRIVATE,
                   f->fd, 0);
    if (p == MAP_FAILED)
        return laden__fail(errno == ENOMEM ? LADEN_E_NOMEM : LADEN_E_IO,
                           "%s: mmap failed: %s", f->path, strerror(errno));
    *out = p;
    *out_size = f->size;
    return LADEN_OK;
}

void laden_io_unmap(void *addr, uint64_t size)
{
    if (addr && addr != empty_map && size)
        munmap(addr, (size_t)size);
}

/* ---- measuring --------------------------------------------------------- */

laden_status laden_io_measure_read(const char *dir, uint64_t size,
                                   double *out_bps)
{
    if (out_bps)
        *out_bps = 0;
    if (!dir || !out_bps || size < (16u << 20))
        return laden__fail(LADEN_E_INVAL,
                           "laden_io_measure_read: need a directory and at "
                           "least 16 MiB");
    const uint64_t window = 256ull << 20;
    char path[4096];
    snprintf(path, sizeof path, "%s/laden-probe-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0)
        return laden__fail(LADEN_E_IO, "%s: cannot create a file: %s", dir,
                           strerror(errno));
    laden_status s = LADEN_OK;
    char *buf = NULL;
    laden_io_t *io = NULL;
    laden_io_file_t *f = NULL;
    if (posix_memalign((void **)&buf, IO_ALIGN, (size_t)window) != 0) {
        buf = NULL;
        s = laden__fail(LADEN_E_NOMEM, "out of memory for the probe buffer");
        goto out;
    }
    for (uint64_t i = 0; i < window / 8; i++)
        ((uint64_t *)buf)[i] = i * 0x9e3779b97f4a7c15ull;
    for (uint64_t at = 0; at < size;) {
        uint64_t n = size - at < window ? size - at : window;
        ssize_t w = pwrite(fd, buf, (size_t)n, (off_t)at);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            s = laden__fail(LADEN_E_IO, "%s: write failed: %s", path,
                            w < 0 ? strerror(errno) : "no space");
            goto out;
        }
        at += (uint64_t)w;
    }
    if (fsync(fd) != 0) {
        s = laden__fail(LADEN_E_IO, "%s: fsync: %s", path, strerror(errno));
        goto out;
    }
    if ((s = laden_io_file_open(path, &f)) || (s = laden_io_drop_cache(f)) ||
        (s = laden_io_create(NULL, &io)))
        goto out;
    uint64_t t0 = laden__now_ns();
    for (uint64_t at = 0; at < size && !s; at += window) {
        uint64_t n = size - at < window ? size - at : window;
        s = laden_io_read(io, f, at, n, buf);
    }
    uint64_t t1 = laden__now_ns();
    if (!s)
        *out_bps = (double)size / ((double)(t1 - t0) * 1e-9);
out:
    laden_io_destroy(io);
    laden_io_file_close(f);
    close(fd);
    unlink(path);
    free(buf);
    return s;
}

laden_status laden_io_measure_file(const char *path, uint64_t max_bytes,
                                   double *out_bps)
{
    if (out_bps)
        *out_bps = 0;
    if (!path || !out_bps || max_bytes == 0)
        return laden__fail(LADEN_E_INVAL, "laden_io_measure_file: bad argument");
    laden_io_file_t *f = NULL;
    laden_io_t *io = NULL;
    char *buf = NULL;
    laden_status s;
    if ((s = laden_io_file_open(path, &f)))
        return s;
    uint64_t n = f->size < max_bytes ? f->size : max_bytes;
    n &= ~(uint64_t)(IO_ALIGN - 1);
    if (n == 0) {
        laden_io_file_close(f);
        return laden__fail(LADEN_E_INVAL, "%s: too small to measure", path);
    }
    if (posix_memalign((void **)&buf, IO_ALIGN, (size_t)n) != 0) {
        laden_io_file_close(f);
        return laden__fail(LADEN_E_NOMEM, "out of memory measuring %s", path);
    }
    if (!(s = laden_io_drop_cache(f)) && !(s = laden_io_create(NULL, &io))) {
        uint64_t t0 = laden__now_ns();
        if (!(s = laden_io_read(io, f, 0, n, buf)))
            *out_bps = (double)n / ((double)(laden__now_ns() - t0) * 1e-9);
    }
    laden_io_destroy(io);
    laden_io_file_close(f);
    free(buf);
    return s;
}
