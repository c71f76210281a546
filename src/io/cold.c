/* What the page cache holds of a file, and the faster way to read what it
 * does not, per file system.
 *
 * Bytes the page cache holds are copied from there.  The rest come from
 * the drive one of two ways: O_DIRECT (no copy through the page cache,
 * nothing to drop after) or buffered reads with the whole range asked for
 * at once (posix_fadvise WILLNEED), the pages dropped behind once copied.
 * Which is faster depends on the drive and its driver: a local NVMe drive
 * usually serves O_DIRECT faster, while virtual disks have measured 1.5-2x
 * faster buffered (ANCHORS.md, BENCHMARK.md).  So in AUTO mode the pool
 * measures: the first cold reads on a file system go in windows of bytes,
 * each window one way, the ways alternating, and a window's rate is its
 * bytes over the time its reads were in flight, from the first's start to
 * the last's end (the whole pool reading that way: what a way gives is
 * its throughput with every thread on it, not a read's share while the
 * other way's reads compete), less any time none of its reads was (a
 * load that ended inside the window).  Once each way has TRIAL_WINDOWS windows the faster
 * is kept for that file system for the process's life (`laden probe`
 * measures both on a file of its own and sets the choice the same way).
 * The reads measured are the load's own: nothing is read twice. */
#define _GNU_SOURCE
#include "cold.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../core/internal.h"

#define PAGE 4096u
#define FS_MAX 16u
#define TRIAL_WINDOWS 3u
#define MIN_WINDOW (8ull << 20)
#define RING 4u /* windows being read at once, at most */
/* Buffered is kept only when clearly faster: O_DIRECT costs no CPU for
 * a copy through the page cache and nothing to drop. */
#define BUFFERED_MARGIN 1.10

/* Whether this process locks its future mappings (mlockall MCL_FUTURE
 * shows as locked memory): a mapping made to ask mincore would then be
 * read and locked whole. */
static bool locks_memory(void)
{
    FILE *f = fopen("/proc/self/status", "re");
    if (!f)
        return true; /* cannot tell: do not map */
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmLck: %llu", &kb) == 1)
            break;
    fclose(f);
    return kb > 0;
}

static bool residency_known(int fd, uint64_t uid)
{
    if (geteuid() == 0 || (uint64_t)geteuid() == uid)
        return true;
    /* Writable by this process: faccessat on the descriptor's path. */
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    return faccessat(AT_FDCWD, p, W_OK, AT_EACCESS) == 0;
}

/* cachestat(2) (Linux 6.5): how many pages of a range the page cache
 * holds, without a mapping.  Ours, since libc may not wrap it. */
struct cs_range {
    uint64_t off, len;
};
struct cs_stat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted,
        nr_recently_evicted;
};
#if defined(SYS_cachestat)
#define CACHESTAT SYS_cachestat
#elif defined(__x86_64__) || defined(__aarch64__) || defined(__riscv)
#define CACHESTAT 451
#endif

static atomic_int cachestat_ok = 1; /* 0 once the kernel lacks it */

/* Pages [a, b) (page indices; vec[0] is page `first`): marked whole where
 * all or none are cached, halved where mixed, down to 16 pages, where a
 * mixed piece counts as cached (read buffered, never dropped).  0, or
 * the errno of the call. */
static int stat_pages(int fd, uint64_t a, uint64_t b, uint64_t first,
                      unsigned char *vec)
{
#ifdef CACHESTAT
    struct cs_range r = {a * PAGE, (b - a) * PAGE};
    struct cs_stat st;
    if (syscall(CACHESTAT, fd, &r, &st, 0) != 0)
        return errno ? errno : EIO;
    /* It counts the kernel's pages, which may be larger than 4 KiB. */
    uint64_t ps = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t all = ps > PAGE ? (b * PAGE + ps - 1) / ps - a * PAGE / ps
                             : b - a;
    if (st.nr_cache == 0 || st.nr_cache >= all || b - a <= 16) {
        memset(vec + (a - first), st.nr_cache ? 1 : 0, (size_t)(b - a));
        return 0;
    }
    uint64_t mid = a + (b - a) / 2;
    int e = stat_pages(fd, a, mid, first, vec);
    return e ? e : stat_pages(fd, mid, b, first, vec);
#else
    (void)fd, (void)a, (void)b, (void)first, (void)vec;
    return ENOSYS;
#endif
}

bool laden__resident(int fd, bool may_map, uint64_t off, uint64_t len,
                     unsigned char *vec)
{
    if (!len)
        return true;
    uint64_t a = off / PAGE, b = (off + len + PAGE - 1) / PAGE;
    if (atomic_load(&cachestat_ok)) {
        int e = stat_pages(fd, a, b, a, vec);
        if (!e)
            return true;
        /* EPERM for a file we may not write, or for every file where a
         * seccomp filter refuses the call (then mincore, where it may). */
        if (e != ENOSYS && !(e == EPERM && may_map))
            return false;
        atomic_store(&cachestat_ok, 0);
    }
    if (!may_map)
        return false;
    uint64_t span = (b - a) * PAGE;
    void *m = mmap(NULL, (size_t)span, PROT_READ, MAP_SHARED, fd,
                   (off_t)(a * PAGE));
    if (m == MAP_FAILED)
        return false;
    bool ok = mincore(m, (size_t)span, vec) == 0;
    munmap(m, (size_t)span);
    return ok;
}

void laden__io_cachestat(bool on)
{
    atomic_store(&cachestat_ok, on);
}

bool laden__may_map(int fd, uint64_t uid)
{
    /* One byte of mincore's vector is one of the kernel's pages: the
     * reader's map is of 4 KiB pages. */
    return sysconf(_SC_PAGESIZE) == PAGE && residency_known(fd, uid) &&
           !locks_memory();
}

/* ---- the choice per file system ------------------------------------- */

typedef struct window {
    uint64_t number; /* which window of the trial; 0: the slot is free */
    uint64_t t0;      /* when its reads last went from none to some */
    uint64_t busy_ns; /* time with reads of it in flight, so far */
    uint64_t bytes;
    uint32_t pending; /* reads started, not yet done */
} window;

typedef struct fs_way {
    uint64_t dev;
    bool used;
    int chosen; /* -1: not yet */
    uint32_t n[2];         /* windows measured each way */
    uint64_t bytes[2], ns[2];
    uint64_t window_bytes; /* set by the trial's first read */
    uint64_t started;      /* trial bytes whose reads started */
    window ring[RING];
} fs_way;

static pthread_mutex_t fs_mu = PTHREAD_MUTEX_INITIALIZER;
static fs_way fs_ways[FS_MAX];
static unsigned fs_next;

/* The entry of dev, made if absent (the oldest made way for it).  fs_mu
 * held. */
static fs_way *fs_entry(uint64_t dev)
{
    for (unsigned i = 0; i < FS_MAX; i++)
        if (fs_ways[i].used && fs_ways[i].dev == dev)
            return &fs_ways[i];
    fs_way *e = &fs_ways[fs_next];
    fs_next = (fs_next + 1) % FS_MAX;
    *e = (fs_way){.dev = dev, .used = true, .chosen = -1};
    return e;
}

static double rate_of(const fs_way *e, int way)
{
    return e->ns[way] ? (double)e->bytes[way] / ((double)e->ns[way] * 1e-9)
                      : 0.0;
}

/* fs_mu held. */
static void choose(fs_way *e)
{
    double d = rate_of(e, LADEN__WAY_DIRECT);
    double b = rate_of(e, LADEN__WAY_BUFFERED);
    e->chosen = b > BUFFERED_MARGIN * d ? LADEN__WAY_BUFFERED
                                        : LADEN__WAY_DIRECT;
}

int laden__way_for(int mode, uint64_t dev, bool direct_ok,
                   uint64_t len, uint64_t window_bytes, uint64_t *trial)
{
    *trial = 0;
    if (!direct_ok || mode == LADEN__MODE_OFF)
        return LADEN__WAY_BUFFERED;
    if (mode == LADEN__MODE_ON)
        return LADEN__WAY_DIRECT;
    pthread_mutex_lock(&fs_mu);
    fs_way *e = fs_entry(dev);
    int way = e->chosen;
    if (way < 0) {
        if (!e->window_bytes)
            e->window_bytes = window_bytes > MIN_WINDOW ? window_bytes
                                                        : MIN_WINDOW;
        uint64_t number = e->started / e->window_bytes + 1;
        window *w = &e->ring[number % RING];
        if (w->number != number) {
            /* A window RING back that never finished (its reads failed,
             * or were abandoned) is not measured. */
            *w = (window){.number = number};
        }
        /* Only time with its reads in flight counts: a load that ends
         * inside a window leaves it idle until the next one reads. */
        if (w->pending++ == 0)
            w->t0 = laden__now_ns();
        e->started += len;
        way = (int)(number % 2 ? LADEN__WAY_DIRECT : LADEN__WAY_BUFFERED);
        *trial = number;
    }
    pthread_mutex_unlock(&fs_mu);
    return way;
}

void laden__way_done(uint64_t dev, uint64_t trial, uint64_t bytes)
{
    if (!trial)
        return;
    uint64_t now = laden__now_ns();
    pthread_mutex_lock(&fs_mu);
    fs_way *e = fs_entry(dev);
    window *w = &e->ring[trial % RING];
    if (e->chosen < 0 && w->number == trial && w->pending) {
        w->bytes += bytes;
        if (--w->pending == 0)
            w->busy_ns += now - w->t0;
        /* Measured once every read of it ended and none will start. */
        if (!w->pending && e->started >= trial * e->window_bytes &&
            w->busy_ns) {
            int way = (int)(trial % 2 ? LADEN__WAY_DIRECT
                                      : LADEN__WAY_BUFFERED);
            e->n[way]++;
            e->bytes[way] += w->bytes;
            e->ns[way] += w->busy_ns;
            w->number = 0;
            if (e->n[0] >= TRIAL_WINDOWS && e->n[1] >= TRIAL_WINDOWS)
                choose(e);
        }
    }
    pthread_mutex_unlock(&fs_mu);
}

laden_status laden__way_env(int mode, int *out)
{
    *out = mode;
    const char *v = getenv("LADEN_IO_DIRECT");
    if (mode != LADEN__MODE_AUTO || !v || !*v)
        return LADEN_OK;
    if (!strcmp(v, "auto"))
        *out = LADEN__MODE_AUTO;
    else if (!strcmp(v, "on"))
        *out = LADEN__MODE_ON;
    else if (!strcmp(v, "off"))
        *out = LADEN__MODE_OFF;
    else
        return laden__fail(LADEN_E_INVAL,
                           "LADEN_IO_DIRECT=%.64s: give auto (measure which "
                           "way reads faster on each file system), on "
                           "(O_DIRECT) or off (buffered)", v);
    return LADEN_OK;
}

static void ways_of(const fs_way *e, laden__ways *out)
{
    out->chosen = e->chosen;
    out->samples = e->n[0] < e->n[1] ? e->n[0] : e->n[1];
    out->direct_bps = rate_of(e, LADEN__WAY_DIRECT);
    out->buffered_bps = rate_of(e, LADEN__WAY_BUFFERED);
}

void laden__ways_of(uint64_t dev, laden__ways *out)
{
    *out = (laden__ways){.chosen = -1};
    pthread_mutex_lock(&fs_mu);
    for (unsigned i = 0; i < FS_MAX; i++)
        if (fs_ways[i].used && fs_ways[i].dev == dev)
            ways_of(&fs_ways[i], out);
    pthread_mutex_unlock(&fs_mu);
}

void laden__ways_forget(uint64_t dev)
{
    pthread_mutex_lock(&fs_mu);
    for (unsigned i = 0; i < FS_MAX; i++)
        if (fs_ways[i].used && fs_ways[i].dev == dev)
            fs_ways[i].used = false;
    pthread_mutex_unlock(&fs_mu);
}

/* Sets dev's choice from two whole measurements (laden_io_measure_ways),
 * in place of what trials found. */
void laden__way_measured(uint64_t dev, double direct_bps, double buffered_bps,
                         laden__ways *out)
{
    pthread_mutex_lock(&fs_mu);
    fs_way *e = fs_entry(dev);
    *e = (fs_way){.dev = dev, .used = true, .chosen = -1};
    double r[2] = {direct_bps, buffered_bps};
    for (int w = 0; w < 2; w++)
        if (r[w] > 0) {
            e->n[w] = TRIAL_WINDOWS;
            e->ns[w] = 1000000000ull;
            e->bytes[w] = (uint64_t)r[w];
        }
    if (direct_bps <= 0)
        e->chosen = LADEN__WAY_BUFFERED;
    else
        choose(e);
    ways_of(e, out);
    pthread_mutex_unlock(&fs_mu);
}
