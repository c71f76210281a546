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
#include "cold.h"

#define IO_ALIGN 4096u
/* Threads: enough requests in flight for a drive (4), and for copies out
 * of the page cache one per two cores up to 16. */
#define MIN_THREADS 4u
#define MAX_DEFAULT_THREADS 16u
#define DEFAULT_CHUNK (16ull << 20)
#define MAX_THREADS 64u
/* Pages a pool brought into the page cache are dropped once this many
 * bytes of a request wait for it, and at the request's end: one
 * posix_fadvise(DONTNEED) per chunk costs more than the reading (it
 * drains every CPU's page lists). */
#define DROP_BATCH (256ull << 20)
/* Cold runs of one chunk noted for dropping; past this, dropped at once. */
#define CHUNK_DROPS 8u

/* What a file's bytes read so far hash to: see check_chunk(). */
typedef struct sum_entry {
    uint64_t off;
    uint32_t len; /* 0: an empty slot (reads of 0 bytes are not kept) */
    uint32_t gen; /* the file's generation when last found equal */
    uint64_t sum;
} sum_entry;

struct laden_io_file {
    int fd;  /* buffered, without readahead (see open) */
    int dfd; /* O_DIRECT, or -1 */
    bool may_map;   /* mincore may be asked (cold.h) */
    atomic_int direct_ok;
    uint64_t size;
    struct timespec mtime, ctime0; /* at open: see check_chunk() */
    uint64_t dev, ino;
    char *path;
    pthread_mutex_t mu;     /* guards what follows */
    struct timespec ctime;  /* the status change time last seen */
    uint32_t gen;           /* how many times it was seen to move */
    uint32_t sampled_gen;   /* the generation check_sample() passed */
    sum_entry *sums;        /* open addressing on (off, len) */
    size_t sums_cap, nsums; /* cap: 0 or a power of two */
    bool changed;           /* refused for good; why says why */
    char why[400];
};

/* A range of a file the pool read into the page cache itself. */
typedef struct drop_range {
    laden_io_file_t *file;
    uint64_t off, len;
} drop_range;

/* The cold runs of one chunk read buffered, to be dropped. */
typedef struct chunk_drops {
    drop_range r[CHUNK_DROPS];
    unsigned n;
} chunk_drops;

typedef struct job {
    struct job *next;
    laden_io_req_t *req;
    laden_io_file_t *file; /* NULL: a copy from src (laden_io_submit_copy) */
    const char *src;
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
    drop_range *drops; /* waiting to be dropped; guarded by io->mu */
    size_t ndrops, drops_cap;
    uint64_t drop_bytes;
    struct laden_io_req *next_free;
};

typedef struct worker {
    laden_io_t *io;
    pthread_t thread;
    char *bounce;
    size_t bounce_bytes;
    unsigned char *vec; /* a chunk's page residency (cold.h) */
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
    uint64_t misplaced;  /* guarded by mu: laden__io_misplaced_bytes */
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
    f->ctime0 = f->ctime = sb.st_ctim;
    f->dev = (uint64_t)sb.st_dev;
    f->ino = (uint64_t)sb.st_ino;
    pthread_mutex_init(&f->mu, NULL);
    /* The direct descriptor must be the same file: the path may have been
     * replaced between the two opens. */
    f->dfd = open_regular(path, O_DIRECT, &dsb);
    if (f->dfd >= 0 && (dsb.st_dev != sb.st_dev || dsb.st_ino != sb.st_ino)) {
        close(f->dfd);
        f->dfd = -1;
    }
    atomic_init(&f->direct_ok, f->dfd >= 0);
    /* No readahead on the buffered descriptor: cold buffered reads ask
     * for their whole range (WILLNEED) and no more, and a read of a few
     * pages (a header, an unaligned edge, a cached run) brings no window
     * with it.  Readahead past a range leaves pages nobody drops, and
     * marks pages whose later reads start more of it. */
    posix_fadvise(f->fd, 0, 0, POSIX_FADV_RANDOM);
    f->may_map = laden__may_map(f->fd, (uint64_t)sb.st_uid);
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
    pthread_mutex_destroy(&f->mu);
    free(f->sums);
    free(f->path);
    free(f);
}

uint64_t laden_io_file_size(const laden_io_file_t *f) { return f ? f->size : 0; }

static uint64_t ns_of(struct timespec t)
{
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* The modification and status change times at open in one word: the
 * modification time, plus the status change time moved by a bijective
 * mix (so that neither can be traded for the other).  A file rewritten
 * in place with its modification time put back (touch -r, os.utime)
 * still has a new status change time, so its identity is new. */
static uint64_t times_word(const laden_io_file_t *f)
{
    uint64_t c = ns_of(f->ctime0);
    c ^= c >> 31;
    c *= 0xd6e8feb86659fd93ull;
    c ^= c >> 32;
    return ns_of(f->mtime) + c;
}
void laden_io_file_identity(const laden_io_file_t *f, uint64_t id[4])
{
    id[0] = f ? f->dev : 0;
    id[1] = f ? f->ino : 0;
    id[2] = f ? f->size : 0;
    id[3] = f ? times_word(f) : 0;
}
const char *laden_io_file_path(const laden_io_file_t *f)
{
    return f ? f->path : NULL;
}
void laden_io_file_times(const laden_io_file_t *f, uint64_t *mtime_ns,
                         uint64_t *ctime_ns)
{
    if (mtime_ns)
        *mtime_ns = f ? ns_of(f->mtime) : 0;
    if (ctime_ns)
        *ctime_ns = f ? ns_of(f->ctime0) : 0;
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

/* ---- what was measured of the ways (cold.c measures) ------------------ */

_Static_assert((int)LADEN__MODE_AUTO == (int)LADEN_IO_DIRECT_AUTO &&
                   (int)LADEN__MODE_OFF == (int)LADEN_IO_DIRECT_OFF &&
                   (int)LADEN__MODE_ON == (int)LADEN_IO_DIRECT_ON,
               "cold.h numbers the modes as laden_io_direct does");

static void ways_public(const laden__ways *w, laden_io_ways *out)
{
    out->chosen = w->chosen < 0                       ? LADEN_IO_WAY_UNKNOWN
                  : w->chosen == LADEN__WAY_DIRECT ? LADEN_IO_WAY_DIRECT
                                                   : LADEN_IO_WAY_BUFFERED;
    out->samples = w->samples;
    out->direct_bps = w->direct_bps;
    out->buffered_bps = w->buffered_bps;
}

laden_status laden_io_file_ways(const laden_io_file_t *f, laden_io_ways *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!f || !out)
        return laden__fail(LADEN_E_INVAL, "laden_io_file_ways: NULL "
                           "argument");
    laden__ways w;
    laden__ways_of(f->dev, &w);
    ways_public(&w, out);
    return LADEN_OK;
}

laden_status laden_io_forget_ways(const laden_io_file_t *f)
{
    if (!f)
        return laden__fail(LADEN_E_INVAL, "laden_io_forget_ways: NULL file");
    laden__ways_forget(f->dev);
    return LADEN_OK;
}

/* ---- the checksum (see "knowing a file changed" below) ------------- */

/* The checksum's unit: hashed as soon as it is read, while it is still
 * in the CPU's cache (a quarter of an L2). */
#define SUM_PIECE (256ull << 10)
#define SUM_MAX_ENTRIES (1u << 20) /* 48 MiB of table at most (half full) */
#define SAMPLE_BYTES (64ull << 20)
#define SAMPLE_MAX 32u
#define K1 0x9e3779b97f4a7c15ull
#define K2 0xbf58476d1ce4e5b9ull
#define K3 0x94d049bb133111ebull

static inline uint64_t rotl64(uint64_t x, int r)
{
    return x << r | x >> (64 - r);
}

static inline uint64_t word_at(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t avalanche(uint64_t x)
{
    x ^= x >> 30;
    x *= K2;
    x ^= x >> 27;
    x *= K3;
    return x ^ x >> 31;
}

/* One piece (at most SUM_PIECE bytes) hashed: eight independent lanes,
 * each word folded in by xor, multiply by an odd constant and rotate
 * (each step a bijection, so changing any one word changes its lane),
 * which keeps the multiplier busy and the loop at memory speed. */
#define LANE(a, w) ((a) = rotl64(((a) ^ (w)) * K1, 29))

static uint64_t piece_hash(const unsigned char *p, uint64_t n)
{
    /* Eight named lanes, not an array: kept in registers (gcc -O2 keeps
     * an array of them in memory, at a third of the speed). */
    uint64_t a0 = K1, a1 = K2, a2 = K3, a3 = K1 ^ K2, a4 = K2 ^ K3,
             a5 = K1 ^ K3, a6 = ~K1, a7 = ~K2;
    uint64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const unsigned char *q = p + i;
        LANE(a0, word_at(q));
        LANE(a1, word_at(q + 8));
        LANE(a2, word_at(q + 16));
        LANE(a3, word_at(q + 24));
        LANE(a4, word_at(q + 32));
        LANE(a5, word_at(q + 40));
        LANE(a6, word_at(q + 48));
        LANE(a7, word_at(q + 56));
    }
    uint64_t l[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int k = 0; i + 8 <= n; i += 8, k++)
        LANE(l[k], word_at(p + i));
    uint64_t tail = 0;
    memcpy(&tail, p + i, (size_t)(n - i));
    uint64_t h = avalanche(tail ^ n << 56 ^ n);
    for (int k = 0; k < 8; k++)
        h = (h ^ avalanche(l[k] + (uint64_t)k)) * K3;
    return h;
}

/* The checksum of n bytes: its pieces of SUM_PIECE bytes folded in
 * order, so that it can be computed a piece at a time (check_sample
 * reads a piece at a time). */
typedef struct sum_state {
    uint64_t acc, n;
} sum_state;

static void sum_begin(sum_state *st, uint64_t n)
{
    st->acc = avalanche(n ^ K2);
    st->n = n;
}

static void sum_piece(sum_state *st, const unsigned char *p, uint64_t len)
{
    st->acc = avalanche(st->acc ^ piece_hash(p, len)) + K1;
}

/* A chunk's checksum computed as it is read: pieces [0, done) hashed. */
typedef struct hasher {
    sum_state st;
    uint64_t done;
} hasher;

/* Hashes the whole pieces of [h->done, got) of the chunk at dst (len
 * bytes), and the last piece once got reaches len. */
static void hash_upto(hasher *h, const char *dst, uint64_t got, uint64_t len)
{
    while (h->done < got) {
        uint64_t n = len - h->done < SUM_PIECE ? len - h->done : SUM_PIECE;
        if (h->done + n > got)
            return;
        sum_piece(&h->st, (const unsigned char *)dst + h->done, n);
        h->done += n;
    }
}

uint64_t laden_io_checksum(const void *data, uint64_t n)
{
    const unsigned char *p = data;
    sum_state st;
    sum_begin(&st, n);
    for (uint64_t at = 0; at < n; at += SUM_PIECE)
        sum_piece(&st, p + at, n - at < SUM_PIECE ? n - at : SUM_PIECE);
    return st.acc;
}

/* ---- reading one chunk ------------------------------------------------- */

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

static laden_status read_fd(laden_io_file_t *f, int fd, uint64_t off,
                            uint64_t len, char *dst)
{
    uint64_t done = 0;
    while (done < len) {
        size_t want = (size_t)(len - done > (1u << 30) ? (1u << 30)
                                                       : len - done);
        ssize_t r = pread(fd, dst + done, want, (off_t)(off + done));
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

static laden_status read_buffered(laden_io_file_t *f, uint64_t off,
                                  uint64_t len, char *dst)
{
    return read_fd(f, f->fd, off, len, dst);
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
 * page is not cached, or preadv2(RWF_NOWAIT) is not available).  With a
 * hasher, a piece at a time, each hashed while it is in the cache. */
static void read_cached(laden_io_t *io, laden_io_file_t *f, uint64_t off,
                        uint64_t len, char *dst, uint64_t *got, hasher *h)
{
    *got = 0;
    while (*got < len && atomic_load(&io->nowait_ok)) {
        uint64_t want = len - *got > (1u << 30) ? (1u << 30) : len - *got;
        if (h && h->done == *got && want > SUM_PIECE)
            want = SUM_PIECE;
        struct iovec v = {dst + *got, (size_t)want};
        ssize_t r = preadv2(f->fd, &v, 1, (off_t)(off + *got), RWF_NOWAIT);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EOPNOTSUPP || errno == ENOSYS ||
                      errno == EINVAL))
            atomic_store(&io->nowait_ok, 0); /* kernel or file system */
        if (r <= 0)
            return; /* EAGAIN: not cached; an error: the drive will say */
        *got += (uint64_t)r;
        if (h)
            hash_upto(h, dst, *got, len);
    }
}

/* [off, off+len) of fd, part of the chunk that starts at file offset
 * c_off in c_dst and holds c_len bytes: with a hasher, a piece at a time,
 * each hashed while it is in the CPU's cache. */
static laden_status read_pieces(laden_io_file_t *f, int fd, uint64_t off,
                                uint64_t len, char *c_dst, uint64_t c_off,
                                uint64_t c_len, hasher *h)
{
    char *dst = c_dst + (off - c_off);
    if (!h)
        return read_fd(f, fd, off, len, dst);
    for (uint64_t at = 0; at < len; at += SUM_PIECE) {
        uint64_t n = len - at < SUM_PIECE ? len - at : SUM_PIECE;
        laden_status s = read_fd(f, fd, off + at, n, dst + at);
        if (s)
            return s;
        hash_upto(h, c_dst, off + at + n - c_off, c_len);
    }
    return LADEN_OK;
}

/* Drops [off, off+len) of f from the page cache, the pages it touches
 * whole: a cold run starts and ends in pages that were not cached when
 * it was read (a tensor's first page may hold its neighbour's last bytes:
 * dropping it costs that neighbour, if still reading, a page read
 * again). */
static void drop_pages(laden_io_file_t *f, uint64_t off, uint64_t len)
{
    uint64_t a = off & ~(uint64_t)(IO_ALIGN - 1);
    uint64_t b = (off + len + IO_ALIGN - 1) & ~(uint64_t)(IO_ALIGN - 1);
    posix_fadvise(f->fd, (off_t)a, (off_t)(b - a), POSIX_FADV_DONTNEED);
}

/* Notes a cold range read buffered for dropping once copied; a chunk
 * with more such runs than fit drops the rest at once. */
static void note_drop(chunk_drops *d, laden_io_file_t *f, uint64_t off,
                      uint64_t len)
{
    if (d->n < CHUNK_DROPS)
        d->r[d->n++] = (drop_range){f, off, len};
    else
        drop_pages(f, off, len);
}

/* Reads [off, off+len) of f buffered, a cold range: noted in d for
 * dropping once copied (d NULL: nothing is dropped). */
static laden_status read_buffered_cold(laden_io_file_t *f, uint64_t off,
                                       uint64_t len, char *dst,
                                       chunk_drops *d)
{
    laden_status s = read_buffered(f, off, len, dst);
    if (!s && d && len)
        note_drop(d, f, off, len);
    return s;
}

/* [off, off+len) with O_DIRECT; *buffered receives the bytes read
 * buffered instead (unaligned edges, a file system refusing O_DIRECT, a
 * range too large for the bounce buffer), noted in d for dropping: they
 * were not cached before either. */
static laden_status read_direct_chunk(worker *w, laden_io_file_t *f,
                                      uint64_t off, uint64_t len, char *dst,
                                      uint64_t *buffered, chunk_drops *d)
{
    laden_status s;
    uint64_t got;
    *buffered = 0;
    if (len < IO_ALIGN) {
        *buffered = len;
        return read_buffered_cold(f, off, len, dst, d);
    }
    if (((uintptr_t)dst - off) % IO_ALIGN == 0) {
        uint64_t head = (IO_ALIGN - off % IO_ALIGN) % IO_ALIGN;
        uint64_t mid = (len - head) & ~(uint64_t)(IO_ALIGN - 1);
        *buffered = head;
        if (head && (s = read_buffered_cold(f, off, head, dst, d)))
            return s;
        s = read_direct(f, off + head, mid, dst + head, &got);
        if (s == LADEN_E_UNSUPPORTED) {
            atomic_store(&f->direct_ok, 0);
            *buffered = len;
            return read_buffered_cold(f, off, len, dst, d);
        }
        if (s)
            return s;
        if (got < mid)
            return ended_early(f, off + head + got, off, len);
        *buffered += len - head - mid;
        if (len > head + mid)
            return read_buffered_cold(f, off + head + mid, len - head - mid,
                                      dst + head + mid, d);
        return LADEN_OK;
    }
    uint64_t a0 = off & ~(uint64_t)(IO_ALIGN - 1);
    uint64_t a1 = (off + len + IO_ALIGN - 1) & ~(uint64_t)(IO_ALIGN - 1);
    if (a1 - a0 > w->bounce_bytes) {
        *buffered = len;
        return read_buffered_cold(f, off, len, dst, d);
    }
    s = read_direct(f, a0, a1 - a0, w->bounce, &got);
    if (s == LADEN_E_UNSUPPORTED) {
        atomic_store(&f->direct_ok, 0);
        *buffered = len;
        return read_buffered_cold(f, off, len, dst, d);
    }
    if (s)
        return s;
    if (got < off + len - a0)
        return ended_early(f, a0 + got, off, len);
    memcpy(dst, w->bounce + (off - a0), len);
    return LADEN_OK;
}

/* A run of a chunk (chunk: c_dst, c_off, c_len) that the page cache does
 * not hold, read the way its file system reads faster (cold.c); counted
 * in n[] as read_chunk counts.  Buffered runs are noted in d for
 * dropping where the pool knows they were not cached before (d NULL:
 * it cannot tell, and drops nothing). */
static laden_status read_cold(worker *w, laden_io_file_t *f, uint64_t off,
                              uint64_t len, char *c_dst, uint64_t c_off,
                              uint64_t c_len, uint64_t n[3], chunk_drops *d)
{
    uint64_t trial, buffered;
    int way = laden__way_for(w->io->direct, f->dev,
                             atomic_load(&f->direct_ok) && len >= IO_ALIGN,
                             len, (uint64_t)w->io->nthreads * w->io->chunk,
                             &trial);
    laden_status s;
    if (way == LADEN__WAY_DIRECT) {
        s = read_direct_chunk(w, f, off, len, c_dst + (off - c_off),
                              &buffered, d);
        if (!s) {
            n[0] += len - buffered;
            n[2] += buffered;
        }
    } else {
        /* The whole run asked for at once: the drive sees every page of
         * it in flight, as O_DIRECT's one large read would; read in one
         * call too, and hashed after (as O_DIRECT's bytes are). */
        posix_fadvise(f->fd, (off_t)off, (off_t)len, POSIX_FADV_WILLNEED);
        s = read_pieces(f, f->fd, off, len, c_dst, c_off, c_len, NULL);
        if (!s) {
            n[2] += len;
            if (d)
                note_drop(d, f, off, len);
        }
    }
    laden__way_done(f->dev, trial, s ? 0 : len);
    return s;
}

/* Reads one chunk: what the page cache holds is copied from there, the
 * rest read from the drive (read_cold).  Counts the bytes each way in
 * n[0] direct, n[1] from the cache, n[2] buffered from the drive.  With a
 * hasher (a first read: see check_chunk), its checksum too: what came
 * from the page cache or buffered is hashed a piece at a time as it
 * arrives, the rest (written by the drive, never in the cache) after.
 * Where the kernel tells which pages it caches (cachestat, or mincore:
 * neither reads), every cached run is taken; elsewhere what
 * preadv2(RWF_NOWAIT) finds from the chunk's start (which may start
 * readahead of the rest, so the pool cannot tell what it brought in and
 * drops nothing). */
static laden_status read_chunk(worker *w, laden_io_file_t *f, uint64_t off,
                               uint64_t len, char *dst, uint64_t n[3],
                               hasher *h, chunk_drops *d)
{
    laden_status s = LADEN_OK;
    uint64_t end = off + len;
    if (len && laden__resident(f->fd, f->may_map, off, len, w->vec)) {
        uint64_t first = off / IO_ALIGN;
        for (uint64_t at = off; at < end && !s;) {
            int in = w->vec[at / IO_ALIGN - first] & 1;
            uint64_t to = (at / IO_ALIGN + 1) * IO_ALIGN;
            while (to < end && (w->vec[to / IO_ALIGN - first] & 1) == in)
                to += IO_ALIGN;
            if (to > end)
                to = end;
            if (in) {
                s = read_pieces(f, f->fd, at, to - at, dst, off, len, h);
                if (!s)
                    n[1] += to - at;
            } else {
                s = read_cold(w, f, at, to - at, dst, off, len, n, d);
            }
            at = to;
        }
    } else {
        read_cached(w->io, f, off, len, dst, &n[1], h);
        if (n[1] < len)
            s = read_cold(w, f, off + n[1], len - n[1], dst, off, len, n,
                          NULL);
    }
    if (!s && h)
        hash_upto(h, dst, len, len);
    return s;
}

/* ---- knowing a file changed --------------------------------------------
 *
 * A file rewritten in place moves its size or its modification time, and
 * is refused (E_CHANGED).  One rewritten with its modification time put
 * back (touch -r, os.utime) still moves its status change time (ctime),
 * but so does a chmod, a chown or a new hard link, which change no byte.
 * So a moved ctime alone is settled by the bytes: the first read of each
 * chunk hashes what it read (laden_io_checksum, by the reader thread,
 * with the bytes just read), and a later read of the same chunk after the
 * ctime moved hashes its bytes again and compares.  Equal: the chunk is
 * taken as it is until the ctime moves again; different: the file is
 * refused for good.  While the ctime stays, a chunk read again costs a
 * table lookup, not a hash.  A chunk read for the first time after the
 * ctime moved has nothing to be compared with: then some of what was read
 * before is read again and compared (check_sample), once per move. */

static size_t slot_of(uint64_t off, uint32_t len, size_t cap)
{
    return (size_t)(avalanche(off ^ (uint64_t)len << 40) & (cap - 1));
}

/* The entry of chunk (off, len), or NULL.  f->mu held. */
static sum_entry *find_sum(laden_io_file_t *f, uint64_t off, uint32_t len)
{
    if (!f->sums_cap)
        return NULL;
    for (size_t i = slot_of(off, len, f->sums_cap);;
         i = (i + 1) & (f->sums_cap - 1)) {
        sum_entry *e = &f->sums[i];
        if (!e->len)
            return NULL;
        if (e->off == off && e->len == len)
            return e;
    }
}

/* Keeps the checksum of chunk (off, len).  f->mu held.  Without memory,
 * or past SUM_MAX_ENTRIES, the chunk is not kept: a read of it after the
 * ctime moved is then checked as a first read is (check_sample). */
static void keep_sum(laden_io_file_t *f, uint64_t off, uint32_t len,
                     uint64_t sum, uint32_t gen)
{
    if (find_sum(f, off, len) || f->nsums >= SUM_MAX_ENTRIES)
        return;
    if (2 * (f->nsums + 1) > f->sums_cap) { /* at most half full */
        size_t cap = f->sums_cap ? 2 * f->sums_cap : 64;
        sum_entry *t = calloc(cap, sizeof *t);
        if (!t)
            return;
        for (size_t i = 0; i < f->sums_cap; i++) {
            sum_entry *e = &f->sums[i];
            if (!e->len)
                continue;
            size_t j = slot_of(e->off, e->len, cap);
            while (t[j].len)
                j = (j + 1) & (cap - 1);
            t[j] = *e;
        }
        free(f->sums);
        f->sums = t;
        f->sums_cap = cap;
    }
    size_t j = slot_of(off, len, f->sums_cap);
    while (f->sums[j].len)
        j = (j + 1) & (f->sums_cap - 1);
    f->sums[j] = (sum_entry){.off = off, .len = len, .gen = gen, .sum = sum};
    f->nsums++;
}

/* Refuses f from now on, with why.  f->mu held. */
static laden_status refuse(laden_io_file_t *f)
{
    f->changed = true;
    return laden__fail(LADEN_E_CHANGED, "%s", f->why);
}

/* The bytes of [off, off+len) no longer hash to what they did when laden
 * first read them.  f->mu held. */
static laden_status bytes_differ(laden_io_file_t *f, uint64_t off,
                                 uint64_t len)
{
    snprintf(f->why, sizeof f->why,
             "%s: the file changed while in use (rewritten in place: bytes "
             "%llu..%llu differ from when laden first read them, though its "
             "size and modification time are as they were); load it again",
             f->path, (unsigned long long)off,
             (unsigned long long)(off + len));
    return refuse(f);
}

laden_status laden_io_file_checksum(laden_io_file_t *f, uint64_t off,
                                   uint64_t len, uint64_t *out_sum)
{
    uint64_t end;
    if (out_sum)
        *out_sum = 0;
    if (!f || !out_sum)
        return laden__fail(LADEN_E_INVAL, "laden_io_file_checksum: NULL");
    if (!laden__add_u64(off, len, &end) || end > f->size)
        return laden__fail(LADEN_E_TRUNCATED,
                           "%s: bytes %llu..%llu asked, but the file holds "
                           "%llu", f->path, (unsigned long long)off,
                           (unsigned long long)(off + len),
                           (unsigned long long)f->size);
    char *buf = malloc(len < SUM_PIECE ? (len ? len : 1) : SUM_PIECE);
    if (!buf)
        return laden__fail(LADEN_E_NOMEM, "%s: out of memory checking the "
                           "file", f->path);
    sum_state st;
    laden_status s = LADEN_OK;
    sum_begin(&st, len);
    for (uint64_t at = 0; at < len && !s; at += SUM_PIECE) {
        uint64_t n = len - at < SUM_PIECE ? len - at : SUM_PIECE;
        if (!(s = read_buffered(f, off + at, n, buf)))
            sum_piece(&st, (unsigned char *)buf, n);
    }
    free(buf);
    if (!s)
        *out_sum = st.acc;
    return s;
}

/* Reads [off, off+len) again and compares it with its checksum. */
static laden_status reread_equal(laden_io_file_t *f, uint64_t off,
                                 uint64_t len, uint64_t sum, bool *equal)
{
    uint64_t now;
    laden_status s = laden_io_file_checksum(f, off, len, &now);
    *equal = !s && now == sum;
    return s;
}

/* A first read after the ctime moved to generation gen: what was read
 * before is read again, up to SAMPLE_BYTES (and at least one chunk), and
 * compared; the chunks found equal are taken at gen.  Then the
 * generation counts as sampled.  Reads of chunks laden never read are
 * accepted only after it: a file rewritten before they were first read
 * shows in the chunks read before. */
static laden_status check_sample(laden_io_file_t *f, uint32_t gen)
{
    sum_entry pick[SAMPLE_MAX];
    uint32_t n = 0;
    uint64_t bytes = 0;
    pthread_mutex_lock(&f->mu);
    for (size_t i = 0; i < f->sums_cap && n < SAMPLE_MAX; i++) {
        sum_entry *e = &f->sums[i];
        if (!e->len || e->gen == gen || (n && bytes + e->len > SAMPLE_BYTES))
            continue;
        pick[n++] = *e;
        bytes += e->len;
    }
    pthread_mutex_unlock(&f->mu);
    laden_status s = LADEN_OK;
    uint32_t k = 0;
    bool equal = true;
    for (; k < n && !s && equal; k++)
        s = reread_equal(f, pick[k].off, pick[k].len, pick[k].sum, &equal);
    if (s)
        return s;
    pthread_mutex_lock(&f->mu);
    if (!equal) {
        s = bytes_differ(f, pick[k - 1].off, pick[k - 1].len);
    } else {
        for (k = 0; k < n; k++) {
            sum_entry *e = find_sum(f, pick[k].off, pick[k].len);
            if (e && e->gen < gen)
                e->gen = gen;
        }
        if (f->sampled_gen < gen)
            f->sampled_gen = gen;
    }
    pthread_mutex_unlock(&f->mu);
    return s;
}

/* Whether chunk (off, len) is read for the first time: then it is hashed
 * as it is read. */
static bool first_read(laden_io_file_t *f, uint64_t off, uint64_t len)
{
    if (!len || len > UINT32_MAX)
        return false;
    pthread_mutex_lock(&f->mu);
    bool first = !f->changed && !find_sum(f, off, (uint32_t)len);
    pthread_mutex_unlock(&f->mu);
    return first;
}

/* After a chunk [off, off+len) was read into dst (h: its checksum, if
 * computed as it was read): LADEN_E_CHANGED if the
 * file is not the one opened (the fstat after every chunk: a writer
 * updates the times before it changes the bytes, so a read that saw new
 * bytes sees the new times), or if it changed the bytes with its
 * modification time put back (the checksums above).  A file refused once
 * is refused from then on. */
static laden_status check_chunk(laden_io_file_t *f, uint64_t off,
                                uint64_t len, const char *dst,
                                const hasher *h)
{
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        return laden__fail(LADEN_E_IO, "%s: fstat: %s", f->path,
                           strerror(errno));
    laden_status s = LADEN_OK;
    pthread_mutex_lock(&f->mu);
    if (f->changed) {
        s = laden__fail(LADEN_E_CHANGED, "%s", f->why);
        pthread_mutex_unlock(&f->mu);
        return s;
    }
    uint64_t now = (uint64_t)sb.st_size;
    if (now != f->size || (uint64_t)sb.st_dev != f->dev ||
        (uint64_t)sb.st_ino != f->ino ||
        sb.st_mtim.tv_sec != f->mtime.tv_sec ||
        sb.st_mtim.tv_nsec != f->mtime.tv_nsec) {
        snprintf(f->why, sizeof f->why,
                 "%s: the file changed while in use (%s: %s when opened, %s "
                 "now); load it again",
                 f->path,
                 now < f->size   ? "truncated"
                 : now > f->size ? "grown"
                                 : "rewritten",
                 laden__bytes(f->size).s, laden__bytes(now).s);
        s = refuse(f);
        pthread_mutex_unlock(&f->mu);
        return s;
    }
    if (sb.st_ctim.tv_sec != f->ctime.tv_sec ||
        sb.st_ctim.tv_nsec != f->ctime.tv_nsec) {
        f->ctime = sb.st_ctim; /* every chunk is compared once again */
        f->gen++;
    }
    uint32_t gen = f->gen;
    sum_entry *e = len ? find_sum(f, off, (uint32_t)len) : NULL;
    bool known = e != NULL, same = e && e->gen == gen;
    uint64_t want = e ? e->sum : 0;
    bool sample = !known && gen && f->sampled_gen != gen && f->nsums;
    pthread_mutex_unlock(&f->mu);
    if (!len || same)
        return LADEN_OK; /* the hot path: read before, ctime as then */
    if (sample && (s = check_sample(f, gen)))
        return s;
    uint64_t sum = h && h->done == len ? h->st.acc
                                       : laden_io_checksum(dst, len);
    pthread_mutex_lock(&f->mu);
    if (!known) {
        keep_sum(f, off, (uint32_t)len, sum, gen);
    } else if (sum != want) {
        s = bytes_differ(f, off, len);
    } else if ((e = find_sum(f, off, (uint32_t)len)) && e->gen < gen) {
        e->gen = gen;
    }
    pthread_mutex_unlock(&f->mu);
    return s;
}

/* ---- the pool ---------------------------------------------------------- */

/* Drops ranges the pool read into the page cache, adjacent ones of a file
 * in one call; returns the bytes.  No lock held: the files stay open
 * while their request is not finished. */
static uint64_t drop_ranges(drop_range *r, size_t n)
{
    uint64_t bytes = 0;
    for (size_t i = 0; i < n;) {
        drop_range a = r[i++];
        for (bool grew = true; grew;) {
            grew = false;
            for (size_t j = i; j < n; j++)
                if (r[j].file == a.file && r[j].len &&
                    (r[j].off == a.off + a.len || r[j].off + r[j].len == a.off)) {
                    if (r[j].off < a.off)
                        a.off = r[j].off;
                    a.len += r[j].len;
                    r[j].len = 0;
                    grew = true;
                }
        }
        if (a.len) {
            drop_pages(a.file, a.off, a.len);
            bytes += a.len;
        }
    }
    return bytes;
}

/* Adds a chunk's cold runs to its request's ranges.  io->mu held. */
static void queue_drops(laden_io_req_t *r, const chunk_drops *d)
{
    for (unsigned i = 0; i < d->n; i++) {
        if (r->ndrops == r->drops_cap) {
            size_t cap = r->drops_cap ? 2 * r->drops_cap : 16;
            drop_range *t = realloc(r->drops, cap * sizeof *t);
            if (!t) { /* out of memory: dropped now, unbatched */
                drop_pages(d->r[i].file, d->r[i].off, d->r[i].len);
                continue;
            }
            r->drops = t;
            r->drops_cap = cap;
        }
        r->drops[r->ndrops++] = d->r[i];
        r->drop_bytes += d->r[i].len;
    }
}

/* Takes the request's ranges to drop (*take: the caller frees them);
 * the next chunk's start a new list.  io->mu held. */
static size_t take_drops(laden_io_req_t *r, drop_range **take)
{
    size_t n = r->ndrops;
    *take = r->drops;
    r->drops = NULL;
    r->ndrops = r->drops_cap = 0;
    r->drop_bytes = 0;
    return n;
}

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
        chunk_drops drops = {.n = 0};
        uint64_t t0 = LADEN__TRACING() ? laden__now_ns() : 0;
        hasher h, *hp = NULL;
        if (!jb->file) { /* a copy: memory to memory */
            if (!skip)
                memcpy(jb->dst, jb->src, (size_t)jb->len);
        } else if (!skip && first_read(jb->file, jb->off, jb->len)) {
            sum_begin(&h.st, jb->len);
            h.done = 0;
            hp = &h;
        }
        if (jb->file && !skip &&
            !(s = read_chunk(w, jb->file, jb->off, jb->len, jb->dst, n, hp,
                             &drops)))
            s = check_chunk(jb->file, jb->off, jb->len, jb->dst, hp);
        if (t0 && !skip && jb->file) {
            uint64_t sess = laden__trace_session(); /* before the name */
            laden__trace_span(LADEN__EV_READ, sess, t0, jb->off, jb->len,
                              n[1], laden__trace_intern(jb->file->path));
        }
        pthread_mutex_lock(&io->mu);
        queue_drops(req, &drops);
        /* A batch is dropped by whoever fills it, the rest by the last
         * chunk's reader (pending 1 is checked and decremented in one
         * hold of the lock), before anyone waiting sees the request
         * done: its files stay open until then. */
        for (drop_range *take; req->ndrops &&
                               (req->pending == 1 ||
                                req->drop_bytes >= DROP_BATCH);) {
            size_t ntake = take_drops(req, &take);
            pthread_mutex_unlock(&io->mu);
            uint64_t dropped = drop_ranges(take, ntake);
            free(take);
            pthread_mutex_lock(&io->mu);
            io->st.dropped_bytes += dropped;
        }
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
    if (c.direct != LADEN_IO_DIRECT_AUTO && c.direct != LADEN_IO_DIRECT_OFF &&
        c.direct != LADEN_IO_DIRECT_ON)
        return laden__fail(LADEN_E_INVAL, "laden_io_create: bad direct mode "
                           "%d", (int)c.direct);
    int mode;
    laden_status es = laden__way_env((int)c.direct, &mode);
    if (es)
        return es;
    c.direct = (laden_io_direct)mode;

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
        w->vec = malloc((size_t)(c.chunk_bytes / IO_ALIGN) + 2);
        if (!w->vec) {
            io->nthreads = i;
            laden_io_destroy(io);
            return laden__fail(LADEN_E_NOMEM,
                               "out of memory for reader page maps");
        }
        if (c.direct != LADEN_IO_DIRECT_OFF) {
            w->bounce_bytes = (size_t)c.chunk_bytes + 2 * IO_ALIGN;
            void *p = NULL;
            if (posix_memalign(&p, IO_ALIGN, w->bounce_bytes) != 0) {
                free(w->vec);
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
            free(w->vec);
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
        free(io->workers[i].vec);
    }
    free(io->workers);
    while (io->free_reqs) {
        laden_io_req_t *r = io->free_reqs;
        io->free_reqs = r->next_free;
        free(r->jobs);
        free(r->drops);
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

/* Queues the chunks of a read of f (or, f NULL, a copy from src). */
static laden_status submit(laden_io_t *io, laden_io_file_t *f,
                           const char *src, uint64_t offset, uint64_t size,
                           void *dst, laden_io_then_fn then, void *then_arg,
                           laden_io_req_t **out)
{
    uint64_t end;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_io_submit: out is NULL");
    *out = NULL;
    if (!io || (!f && !src && size) || (!dst && size))
        return laden__fail(LADEN_E_INVAL, "laden_io_submit: NULL argument");
    if (f && (!laden__add_u64(offset, size, &end) || end > f->size))
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
        r->ndrops = 0;
        r->drop_bytes = 0;
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
        jb->src = src ? src + i * io->chunk : NULL;
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
    if (f && size >= IO_ALIGN && ((uintptr_t)dst - offset) % IO_ALIGN)
        io->misplaced += size;
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

laden_status laden_io_submit_then(laden_io_t *io, laden_io_file_t *f,
                                  uint64_t offset, uint64_t size, void *dst,
                                  laden_io_then_fn then, void *then_arg,
                                  laden_io_req_t **out)
{
    if (!f) {
        if (out)
            *out = NULL;
        return laden__fail(LADEN_E_INVAL, "laden_io_submit: NULL file");
    }
    return submit(io, f, NULL, offset, size, dst, then, then_arg, out);
}

laden_status laden_io_submit_copy(laden_io_t *io, const void *src,
                                  uint64_t size, void *dst,
                                  laden_io_req_t **out)
{
    if (!src && size) {
        if (out)
            *out = NULL;
        return laden__fail(LADEN_E_INVAL, "laden_io_submit_copy: NULL src");
    }
    return submit(io, NULL, src, 0, size, dst, NULL, NULL, out);
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
        free(r->drops);
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

/* compress.c: the bytes the pool reads at once (its threads' chunks). */
uint64_t laden__io_depth_bytes(laden_io_t *io);
uint64_t laden__io_depth_bytes(laden_io_t *io)
{
    return io ? (uint64_t)io->nthreads * io->chunk : 0; /* set at create */
}

uint64_t laden__io_misplaced_bytes(laden_io_t *io)
{
    pthread_mutex_lock(&io->mu);
    uint64_t n = io->misplaced;
    pthread_mutex_unlock(&io->mu);
    return n;
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

#define PROBE_WINDOW (256ull << 20)

/* Writes a temporary file of size bytes in dir, synced to the drive, into
 * *path (cap bytes) and *buf (a PROBE_WINDOW buffer, aligned, the
 * caller frees); the caller unlinks it. */
static laden_status probe_file(const char *dir, uint64_t size, char *path,
                               size_t cap, char **buf)
{
    *buf = NULL;
    snprintf(path, cap, "%s/laden-probe-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0) {
        laden_status s = laden__fail(LADEN_E_IO, "%s: cannot create a file: "
                                     "%s", dir, strerror(errno));
        path[0] = '\0';
        return s;
    }
    laden_status s = LADEN_OK;
    if (posix_memalign((void **)buf, IO_ALIGN, (size_t)PROBE_WINDOW) != 0) {
        *buf = NULL;
        close(fd);
        return laden__fail(LADEN_E_NOMEM, "out of memory for the probe "
                           "buffer");
    }
    for (uint64_t i = 0; i < PROBE_WINDOW / 8; i++)
        ((uint64_t *)*buf)[i] = i * 0x9e3779b97f4a7c15ull;
    for (uint64_t at = 0; at < size && !s;) {
        uint64_t n = size - at < PROBE_WINDOW ? size - at : PROBE_WINDOW;
        ssize_t w = pwrite(fd, *buf, (size_t)n, (off_t)at);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            s = laden__fail(LADEN_E_IO, "%s: write failed: %s", path,
                            w < 0 ? strerror(errno) : "no space");
        else
            at += (uint64_t)w;
    }
    if (!s && fsync(fd) != 0)
        s = laden__fail(LADEN_E_IO, "%s: fsync: %s", path, strerror(errno));
    close(fd);
    return s;
}

/* Reads [off, off+len) of f from a dropped page cache through a pool of
 * the given mode, PROBE_WINDOW at a time into buf; *bps gets the rate. */
static laden_status probe_pass(laden_io_file_t *f, laden_io_direct mode,
                               uint64_t off, uint64_t len, char *buf,
                               double *bps)
{
    laden_io_t *io = NULL;
    laden_io_config c = {.direct = mode};
    laden_status s;
    *bps = 0;
    if ((s = laden_io_drop_cache(f)))
        return s;
    /* laden_io_create reads LADEN_IO_DIRECT for AUTO only. */
    if ((s = laden_io_create(&c, &io)))
        return s;
    uint64_t t0 = laden__now_ns();
    for (uint64_t at = 0; at < len && !s; at += PROBE_WINDOW) {
        uint64_t n = len - at < PROBE_WINDOW ? len - at : PROBE_WINDOW;
        s = laden_io_read(io, f, off + at, n, buf);
    }
    uint64_t t1 = laden__now_ns();
    laden_io_destroy(io);
    if (!s)
        *bps = (double)len / ((double)(t1 - t0) * 1e-9);
    return s;
}

laden_status laden_io_measure_read(const char *dir, uint64_t size,
                                   double *out_bps)
{
    if (out_bps)
        *out_bps = 0;
    if (!dir || !out_bps || size < (16u << 20))
        return laden__fail(LADEN_E_INVAL,
                           "laden_io_measure_read: need a directory and at "
                           "least 16 MiB");
    char path[4096];
    char *buf = NULL;
    laden_io_file_t *f = NULL;
    laden_status s = probe_file(dir, size, path, sizeof path, &buf);
    if (!s && !(s = laden_io_file_open(path, &f)))
        s = probe_pass(f, LADEN_IO_DIRECT_AUTO, 0, size, buf, out_bps);
    laden_io_file_close(f);
    if (path[0])
        unlink(path);
    free(buf);
    return s;
}

laden_status laden_io_measure_ways(const char *dir, uint64_t size,
                                   laden_io_ways *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!dir || !out || size < (32u << 20))
        return laden__fail(LADEN_E_INVAL,
                           "laden_io_measure_ways: need a directory and at "
                           "least 32 MiB");
    char path[4096];
    char *buf = NULL;
    laden_io_file_t *f = NULL;
    double d = 0, b = 0;
    laden__ways w = {.chosen = -1};
    uint64_t half = (size / 2) & ~(uint64_t)(IO_ALIGN - 1);
    laden_status s = probe_file(dir, size, path, sizeof path, &buf);
    if (!s && !(s = laden_io_file_open(path, &f)) &&
        (!laden_io_file_direct(f) ||
         !(s = probe_pass(f, LADEN_IO_DIRECT_ON, 0, half, buf, &d))) &&
        !(s = probe_pass(f, LADEN_IO_DIRECT_OFF, half, half, buf, &b)))
        laden__way_measured(f->dev, laden_io_file_direct(f) ? d : 0, b,
                            &w);
    ways_public(&w, out);
    laden_io_file_close(f);
    if (path[0])
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
