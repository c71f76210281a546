/* Gradients leaving the device (laden/grads.h).
 *
 * A pinned staging ring on the host, filled by device-to-host copies on
 * the sink's copy stream; a FIFO of jobs (where in the ring, where to, how
 * to convert), each with the event recorded after its copy.  A job lands
 * (its values converted and written or added to the destination) when the
 * ring needs its space, when its copy is seen done at a later push, or at
 * flush: jobs land in the order they were pushed, so two pushes to one
 * destination add up in that order.
 *
 * A push into page-locked memory with nothing to add or convert is no
 * job: its copy goes straight to the destination on the same copy stream
 * (so after any earlier push's copy, and before any later one's: a later
 * job adding to that destination lands after it), and flush waits for the
 * stream.
 *
 * The ring: jobs occupy [head_off, tail) or, wrapped, [head_off, end) and
 * [0, tail).  A new part goes at tail, or at 0 when it does not fit before
 * the end; never up to head_off exactly (tail == head_off would be both
 * full and empty).
 *
 * A large job lands on the sink's own threads (land_pool), started at the
 * first job large enough to split and joined at destroy: a job's ranges
 * were once landed on threads started and joined for that job alone. */
#define _GNU_SOURCE /* sched_getaffinity */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "laden/grads.h"
#include "../core/internal.h"
#include "laden/stream.h"

#define MIN_STAGING (1u << 20)
#define LAND_CHUNK 2048 /* elements added through stack buffers */
#define LAND_PER_THREAD (1u << 21) /* elements: fewer, one thread */
#define LAND_THREADS 8

typedef struct gjob {
    uint64_t off, bytes; /* in the ring */
    char *dst;
    uint64_t n;
    laden_dtype sd, dd;
    int acc;
    laden_event_t *ev;
} gjob;

typedef struct land_part {
    const char *src;
    char *dst;
    laden_dtype sd, dd;
    uint64_t n;
    int acc;
} land_part;

/* The sink's landing threads: started when a job first needs them (and
 * again, up to what a job needs, after one could not be started), fed one
 * batch of disjoint ranges at a time, joined at destroy.  Worker i takes
 * part[i + 1]; the caller takes part[0] and the parts of workers not
 * started.  Only land_values feeds it, under the sink's mutex, so one
 * batch is in flight at a time; workers take the pool's mutex only, never
 * the sink's (the caller holds that one while it waits for them). */
typedef struct land_worker {
    struct land_pool *pool;
    uint32_t idx;
    uint64_t seen; /* the last batch looked at */
} land_worker;

typedef struct land_pool {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_t th[LAND_THREADS - 1];
    land_worker w[LAND_THREADS - 1];
    uint32_t nth;     /* started: th[0..nth) */
    uint64_t batch;   /* bumped per batch */
    uint32_t nparts;  /* of this batch */
    uint32_t running; /* workers not done with this batch */
    bool quit;
    land_part part[LAND_THREADS];
} land_pool;

struct laden_grads {
    int32_t device;
    pthread_mutex_t mu;
    char *staging;
    uint64_t size, tail;
    laden_dev_stream_t *copy;
    laden_event_t *after; /* recorded on the caller's stream per push */
    laden_dev_stream_t *caller; /* that stream, wrapped once per handle */
    uintptr_t caller_handle;
    gjob *jobs;
    uint32_t head, njobs, cap;
    laden_event_t **spare; /* events of landed jobs */
    uint32_t nspare, spare_cap;
    laden_status err; /* the first since the last flush */
    char msg[256];
    uint64_t bytes, pushes;
    bool direct; /* copies outside the ring since the last flush */
    laden_dev_stream_t *up; /* fetches */
    laden_event_t *fetched; /* recorded by laden_grads_fetched */
    bool fetching;          /* fetches since the last flush */
    bool unrecorded;        /* fetches since `fetched` was recorded */
    land_pool pool;
};

static uint32_t esize(laden_dtype d)
{
    return laden_dtype_bits(d) / 8;
}

static bool grad_dtype(laden_dtype d)
{
    return d == LADEN_DTYPE_F32 || d == LADEN_DTYPE_F16 ||
           d == LADEN_DTYPE_BF16;
}

static inline float f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* dst += src for F32 and BF16 (the dtypes of training) in one pass over
 * the elements; false for other pairs.  The converter's path below takes
 * three (src and dst to float32, the sum back) and, even with the
 * converter picking its loop once per call, landed BF16 += BF16 at about
 * 0.6 of this one's rate on one core (0.13 against 0.22 G elements/s), so
 * this stays.  The same values as that path, but for which NaN's payload a
 * NaN + NaN keeps (the compiler may order the operands). */
static bool add_plain(const char *src, laden_dtype sd, char *dst,
                      laden_dtype dd, uint64_t n)
{
    bool sb = sd == LADEN_DTYPE_BF16, db = dd == LADEN_DTYPE_BF16;
    if ((!sb && sd != LADEN_DTYPE_F32) || (!db && dd != LADEN_DTYPE_F32))
        return false;
    for (uint64_t i = 0; i < n; i++) {
        float a, b;
        if (sb) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            a = f32_of((uint32_t)h << 16);
        } else {
            memcpy(&a, src + 4 * i, 4);
        }
        if (db) {
            uint16_t h;
            memcpy(&h, dst + 2 * i, 2);
            b = f32_of((uint32_t)h << 16);
            h = laden__bf16_of_f32(b + a);
            memcpy(dst + 2 * i, &h, 2);
        } else {
            memcpy(&b, dst + 4 * i, 4);
            b = b + a;
            memcpy(dst + 4 * i, &b, 4);
        }
    }
    return true;
}

/* dst = src or dst + src, n elements, in fp32 with the converter's
 * rounding (laden_sched_convert: these dtype pairs cannot fail). */
static void land_range(const char *src, laden_dtype sd, char *dst,
                       laden_dtype dd, uint64_t n, int acc)
{
    if (!acc) {
        if (sd == dd)
            memcpy(dst, src, n * esize(sd));
        else
            laden_sched_convert(sd, src, dd, dst, n);
        return;
    }
    if (add_plain(src, sd, dst, dd, n))
        return;
    float a[LAND_CHUNK], b[LAND_CHUNK];
    uint32_t ss = esize(sd), ds = esize(dd);
    for (uint64_t i = 0; i < n; i += LAND_CHUNK) {
        uint32_t k = (uint32_t)(n - i < LAND_CHUNK ? n - i : LAND_CHUNK);
        laden_sched_convert(sd, src + i * ss, LADEN_DTYPE_F32, a, k);
        laden_sched_convert(dd, dst + i * ds, LADEN_DTYPE_F32, b, k);
        for (uint32_t j = 0; j < k; j++)
            a[j] = b[j] + a[j];
        laden_sched_convert(LADEN_DTYPE_F32, a, dd, dst + i * ds, k);
    }
}

static void land_part_run(const land_part *p)
{
    land_range(p->src, p->sd, p->dst, p->dd, p->n, p->acc);
}

static void *land_worker_run(void *arg)
{
    land_worker *w = arg;
    land_pool *p = w->pool;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->quit && p->batch == w->seen)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->quit)
            break;
        w->seen = p->batch;
        if (w->idx + 1 >= p->nparts || !p->part[w->idx + 1].n)
            continue; /* not in this batch */
        land_part part = p->part[w->idx + 1];
        pthread_mutex_unlock(&p->mu);
        land_part_run(&part);
        pthread_mutex_lock(&p->mu);
        if (--p->running == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_init(land_pool *p)
{
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
}

/* Joins the workers (no batch is in flight: the caller holds the sink's
 * mutex, or the sink is being destroyed). */
static void pool_destroy(land_pool *p)
{
    pthread_mutex_lock(&p->mu);
    p->quit = true;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 0; i < p->nth; i++)
        pthread_join(p->th[i], NULL);
    p->nth = 0;
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->go);
    pthread_mutex_destroy(&p->mu);
}

/* Workers up to `want` (fewer when one cannot be started: the caller
 * then lands that range itself). */
static void pool_start(land_pool *p, uint32_t want)
{
    pthread_mutex_lock(&p->mu);
    uint64_t batch = p->batch;
    pthread_mutex_unlock(&p->mu);
    while (p->nth < want) {
        land_worker *w = &p->w[p->nth];
        *w = (land_worker){p, p->nth, batch};
        if (pthread_create(&p->th[p->nth], NULL, land_worker_run, w))
            break;
        p->nth++;
    }
}

/* Threads for landing n elements: one per LAND_PER_THREAD, at most the
 * CPUs and LAND_THREADS (landing is memory-bound: a few threads take the
 * host's bandwidth, one does not). */
static uint32_t land_threads(uint64_t n)
{
    static atomic_long ncpu; /* the CPUs this process may run on */
    long c = atomic_load_explicit(&ncpu, memory_order_relaxed);
    if (!c) {
        cpu_set_t set;
        c = sched_getaffinity(0, sizeof set, &set) == 0
                ? CPU_COUNT(&set)
                : sysconf(_SC_NPROCESSORS_ONLN);
        if (c < 1)
            c = 1;
        atomic_store_explicit(&ncpu, c, memory_order_relaxed);
    }
    uint64_t t = n / LAND_PER_THREAD;
    if (t > (uint64_t)c)
        t = (uint64_t)c;
    if (t > LAND_THREADS)
        t = LAND_THREADS;
    return t ? (uint32_t)t : 1;
}

/* land_range over n elements, split in disjoint ranges over the pool's
 * workers and the caller (the same values: each element is computed
 * alone).  The caller holds the sink's mutex; a worker that cannot be
 * started has its range done here. */
static void land_values(land_pool *p, const char *src, laden_dtype sd,
                        char *dst, laden_dtype dd, uint64_t n, int acc)
{
    uint32_t nt = land_threads(n);
    if (nt <= 1) {
        land_range(src, sd, dst, dd, n, acc);
        return;
    }
    if (p->nth < nt - 1)
        pool_start(p, nt - 1);
    land_part part[LAND_THREADS];
    uint64_t per = (n / nt + LAND_CHUNK - 1) / LAND_CHUNK * LAND_CHUNK;
    uint32_t ss = esize(sd), ds = esize(dd), busy = 0;
    for (uint32_t i = 0; i < nt; i++) {
        uint64_t a = (uint64_t)i * per, e = i + 1 == nt ? n : a + per;
        if (a > n)
            a = n;
        if (e > n)
            e = n;
        part[i] = (land_part){src + a * ss, dst + a * ds, sd, dd, e - a, acc};
        if (i > 0 && i <= p->nth && part[i].n)
            busy++;
    }
    if (busy) {
        pthread_mutex_lock(&p->mu);
        memcpy(p->part, part, sizeof part[0] * nt);
        p->nparts = nt;
        p->running = busy;
        p->batch++;
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
    }
    land_part_run(&part[0]);
    for (uint32_t i = p->nth + 1; i < nt; i++)
        if (part[i].n)
            land_part_run(&part[i]);
    if (busy) {
        pthread_mutex_lock(&p->mu);
        while (p->running)
            pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

static void note_error(laden_grads_t *g, laden_status st)
{
    if (st && !g->err) {
        g->err = st;
        snprintf(g->msg, sizeof g->msg, "%s", laden_last_error());
    }
}

/* The oldest job: waits for its copy, lands it, frees its space. */
static void land_one(laden_grads_t *g)
{
    gjob *j = &g->jobs[g->head];
    laden_status st = laden_dev_event_synchronize(j->ev);
    if (st)
        note_error(g, st);
    else
        land_values(&g->pool, g->staging + j->off, j->sd, j->dst, j->dd,
                    j->n, j->acc);
    g->spare[g->nspare++] = j->ev; /* room: spare_cap >= cap */
    g->head = (g->head + 1) % g->cap;
    g->njobs--;
}

/* Jobs whose copies are done, from the oldest, without waiting. */
static void land_done(laden_grads_t *g)
{
    while (g->njobs) {
        int done = 0;
        if (laden_dev_event_query(g->jobs[g->head].ev, &done) || !done)
            return;
        land_one(g);
    }
}

/* Where a part of `bytes` goes in the ring (landing old jobs for room). */
static uint64_t reserve(laden_grads_t *g, uint64_t bytes)
{
    for (;;) {
        if (!g->njobs) {
            g->tail = 0;
            break;
        }
        uint64_t h = g->jobs[g->head].off;
        if (g->tail > h) {
            if (g->size - g->tail >= bytes)
                break;
            if (h > bytes) {
                g->tail = 0;
                break;
            }
        } else if (h - g->tail > bytes) {
            break;
        }
        land_one(g);
    }
    uint64_t off = g->tail;
    g->tail += bytes;
    return off;
}

static laden_status grow_jobs(laden_grads_t *g)
{
    if (g->njobs < g->cap)
        return LADEN_OK;
    uint32_t cap = g->cap ? 2 * g->cap : 64;
    gjob *jobs = malloc(sizeof *jobs * cap);
    laden_event_t **spare = realloc(g->spare, sizeof *spare * cap);
    if (!jobs || !spare) {
        free(jobs);
        if (spare)
            g->spare = spare;
        return laden__fail(LADEN_E_NOMEM, "laden_grads_push: out of memory");
    }
    g->spare = spare;
    g->spare_cap = cap;
    for (uint32_t i = 0; i < g->njobs; i++)
        jobs[i] = g->jobs[(g->head + i) % g->cap];
    free(g->jobs);
    g->jobs = jobs;
    g->head = 0;
    g->cap = cap;
    return LADEN_OK;
}

/* The ring holds two of the largest gradients so that one lands while the
 * next is copied off, bounded so that a model with a huge embedding does
 * not pin its size twice (a larger gradient moves in parts). */
#define MAX_STAGING (256ull << 20)

uint64_t laden_grads_staging_bytes(uint64_t largest_bytes)
{
    uint64_t two = largest_bytes > MAX_STAGING / 2 ? MAX_STAGING
                                                   : 2 * largest_bytes;
    return two < MIN_STAGING ? MIN_STAGING : two;
}

laden_status laden_grads_create(int32_t device, uint64_t staging_bytes,
                                laden_grads_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_grads_create: NULL out");
    *out = NULL;
    laden_grads_t *g = calloc(1, sizeof *g);
    if (!g)
        return laden__fail(LADEN_E_NOMEM, "laden_grads_create: out of memory");
    g->device = device;
    pthread_mutex_init(&g->mu, NULL);
    pool_init(&g->pool);
    laden_status st = LADEN_OK;
    if (device != LADEN_DEVICE_CPU) {
        if (staging_bytes < MIN_STAGING)
            staging_bytes = MIN_STAGING;
        g->size = (staging_bytes + 15) & ~(uint64_t)15;
        void *p = NULL;
        if (!(st = laden_dev_host_alloc(device, g->size, &p)))
            g->staging = p;
        if (!st)
            st = laden_dev_stream_create(device, &g->copy);
        if (!st)
            st = laden_dev_event_create(device, 0, &g->after);
        if (!st)
            st = laden_dev_stream_create(device, &g->up);
        if (!st)
            st = laden_dev_event_create(device, 0, &g->fetched);
    } else {
        /* Validates the device as the others do. */
        laden_dev_info_t info;
        st = laden_dev_info(device, &info);
    }
    if (st) {
        laden_grads_destroy(g);
        return st;
    }
    *out = g;
    return LADEN_OK;
}

void laden_grads_destroy(laden_grads_t *g)
{
    if (!g)
        return;
    pthread_mutex_lock(&g->mu);
    while (g->njobs)
        land_one(g);
    if (g->direct)
        (void)laden_dev_stream_synchronize(g->copy);
    if (g->fetching)
        (void)laden_dev_stream_synchronize(g->up);
    pthread_mutex_unlock(&g->mu);
    pool_destroy(&g->pool);
    for (uint32_t i = 0; i < g->nspare; i++)
        laden_dev_event_destroy(g->spare[i]);
    laden_dev_event_destroy(g->after);
    laden_dev_event_destroy(g->fetched);
    laden_dev_stream_destroy(g->up);
    laden_dev_stream_destroy(g->caller);
    laden_dev_stream_destroy(g->copy);
    if (g->staging)
        laden_dev_host_free(g->device, g->staging);
    free(g->jobs);
    free(g->spare);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

/* A job not landed yet writes into [dst, dst + bytes): a direct copy
 * there would land before it, so that push goes through the ring too. */
static bool pending_into(const laden_grads_t *g, const char *dst,
                         uint64_t bytes)
{
    for (uint32_t i = 0; i < g->njobs; i++) {
        const gjob *j = &g->jobs[(g->head + i) % g->cap];
        const char *b = j->dst;
        uint64_t len = j->n * esize(j->dd);
        if (b < dst + bytes && dst < b + len)
            return true;
    }
    return false;
}

/* The caller's stream, wrapped once per handle. */
static laden_status wrap_caller(laden_grads_t *g, uintptr_t stream)
{
    if (g->caller && g->caller_handle == stream)
        return LADEN_OK;
    laden_dev_stream_destroy(g->caller);
    g->caller = NULL;
    laden_status st = laden_dev_stream_wrap(g->device, stream, &g->caller);
    if (!st)
        g->caller_handle = stream;
    return st;
}

/* The copy stream waits for the caller's work so far. */
static laden_status copy_waits(laden_grads_t *g, uintptr_t stream)
{
    laden_status st = wrap_caller(g, stream);
    if (!st)
        st = laden_dev_event_record(g->after, g->caller);
    if (!st)
        st = laden_dev_stream_wait_event(g->copy, g->after);
    return st;
}

static laden_status push_cuda(laden_grads_t *g, laden_devptr_t src,
                              laden_dtype sd, uint64_t n, char *dst,
                              laden_dtype dd, int flags, uintptr_t stream)
{
    int acc = (flags & LADEN_GRADS_ADD) != 0;
    laden_status st = copy_waits(g, stream);
    if (st)
        return st;
    uint64_t es = esize(sd), total = n * es, done = 0;
    if ((flags & LADEN_GRADS_PINNED) && !acc && sd == dd &&
        !pending_into(g, dst, n * esize(dd))) {
        if ((st = laden_dev_copy_d2h(g->copy, dst, src, total)))
            return st;
        g->direct = true;
        g->bytes += total;
        land_done(g);
        return LADEN_OK;
    }
    uint64_t part_max = (g->size / 2) / es * es; /* two parts in flight */
    while (done < total) {
        uint64_t bytes = total - done < part_max ? total - done : part_max;
        if ((st = grow_jobs(g)))
            return st;
        uint64_t off = reserve(g, bytes);
        laden_event_t *ev = NULL;
        if (g->nspare)
            ev = g->spare[--g->nspare];
        else if ((st = laden_dev_event_create(g->device, 0, &ev)))
            return st;
        st = laden_dev_copy_d2h(g->copy, g->staging + off, src + done, bytes);
        if (!st)
            st = laden_dev_event_record(ev, g->copy);
        if (st) {
            g->spare[g->nspare++] = ev;
            g->tail = off; /* the part is not there */
            return st;
        }
        gjob *j = &g->jobs[(g->head + g->njobs) % g->cap];
        *j = (gjob){off, bytes, dst + done / es * esize(dd), bytes / es,
                    sd, dd, acc, ev};
        g->njobs++;
        done += bytes;
        g->bytes += bytes;
    }
    land_done(g);
    return LADEN_OK;
}

laden_status laden_grads_push(laden_grads_t *g, laden_devptr_t src,
                              laden_dtype src_dtype, uint64_t n, void *dst,
                              laden_dtype dst_dtype, int flags,
                              uintptr_t compute_stream)
{
    if (!g)
        return laden__fail(LADEN_E_INVAL, "laden_grads_push: NULL sink");
    if (!grad_dtype(src_dtype) || !grad_dtype(dst_dtype))
        return laden__fail(LADEN_E_INVAL,
                           "laden_grads_push: gradients are F32, F16 or "
                           "BF16; got %s to %s",
                           laden_dtype_name(src_dtype),
                           laden_dtype_name(dst_dtype));
    if (flags & ~(LADEN_GRADS_ADD | LADEN_GRADS_PINNED))
        return laden__fail(LADEN_E_INVAL,
                           "laden_grads_push: unknown flags 0x%x", flags);
    if (!n)
        return LADEN_OK;
    if (!src || !dst)
        return laden__fail(LADEN_E_INVAL,
                           "laden_grads_push: NULL source or destination");
    if (n > UINT64_MAX / 4)
        return laden__fail(LADEN_E_INVAL, "laden_grads_push: %llu elements",
                           (unsigned long long)n);
    pthread_mutex_lock(&g->mu);
    laden_status st = LADEN_OK;
    g->pushes++;
    if (g->device == LADEN_DEVICE_CPU) {
        land_values(&g->pool, (const char *)(uintptr_t)src, src_dtype, dst,
                    dst_dtype, n, (flags & LADEN_GRADS_ADD) != 0);
        g->bytes += n * esize(src_dtype);
    } else {
        st = push_cuda(g, src, src_dtype, n, dst, dst_dtype, flags,
                       compute_stream);
    }
    pthread_mutex_unlock(&g->mu);
    return st;
}

laden_status laden_grads_flush(laden_grads_t *g)
{
    if (!g)
        return laden__fail(LADEN_E_INVAL, "laden_grads_flush: NULL sink");
    pthread_mutex_lock(&g->mu);
    while (g->njobs)
        land_one(g);
    if (g->direct) {
        g->direct = false;
        note_error(g, laden_dev_stream_synchronize(g->copy));
    }
    if (g->fetching) {
        g->fetching = g->unrecorded = false;
        note_error(g, laden_dev_stream_synchronize(g->up));
    }
    laden_status st = g->err;
    char msg[sizeof g->msg];
    memcpy(msg, g->msg, sizeof msg);
    g->err = LADEN_OK;
    pthread_mutex_unlock(&g->mu);
    if (st)
        return laden__fail(st, "laden_grads_flush: a gradient's copy failed: "
                           "%s", msg);
    return LADEN_OK;
}

uintptr_t laden_grads_stream(laden_grads_t *g)
{
    return g ? laden_dev_stream_handle(g->copy) : 0;
}

laden_status laden_grads_stats(laden_grads_t *g, uint64_t *out_bytes,
                               uint64_t *out_pushes)
{
    if (!g || !out_bytes || !out_pushes)
        return laden__fail(LADEN_E_INVAL, "laden_grads_stats: NULL argument");
    pthread_mutex_lock(&g->mu);
    *out_bytes = g->bytes;
    *out_pushes = g->pushes;
    pthread_mutex_unlock(&g->mu);
    return LADEN_OK;
}

laden_status laden_grads_wait(laden_grads_t *g, uintptr_t compute_stream)
{
    if (!g)
        return laden__fail(LADEN_E_INVAL, "laden_grads_wait: NULL sink");
    if (g->device == LADEN_DEVICE_CPU)
        return LADEN_OK;
    pthread_mutex_lock(&g->mu);
    laden_status st = copy_waits(g, compute_stream);
    pthread_mutex_unlock(&g->mu);
    return st;
}

laden_status laden_grads_fetch(laden_grads_t *g, laden_devptr_t dst,
                               const void *src, uint64_t bytes)
{
    if (!g)
        return laden__fail(LADEN_E_INVAL, "laden_grads_fetch: NULL sink");
    if (!bytes)
        return LADEN_OK;
    if (!dst || !src)
        return laden__fail(LADEN_E_INVAL,
                           "laden_grads_fetch: NULL source or destination");
    if (g->device == LADEN_DEVICE_CPU) {
        memmove((void *)(uintptr_t)dst, src, bytes);
        return LADEN_OK;
    }
    pthread_mutex_lock(&g->mu);
    laden_status st = laden_dev_copy_h2d(g->up, dst, src, bytes);
    if (!st)
        g->fetching = g->unrecorded = true;
    pthread_mutex_unlock(&g->mu);
    return st;
}

laden_status laden_grads_fetched(laden_grads_t *g, uintptr_t compute_stream)
{
    if (!g)
        return laden__fail(LADEN_E_INVAL, "laden_grads_fetched: NULL sink");
    if (g->device == LADEN_DEVICE_CPU)
        return LADEN_OK;
    pthread_mutex_lock(&g->mu);
    laden_status st = LADEN_OK;
    /* One record for the fetches since the last one (they are all on the
     * upload stream); none new, the last record still follows them all. */
    if (g->unrecorded) {
        st = laden_dev_event_record(g->fetched, g->up);
        if (!st)
            g->unrecorded = false;
    }
    if (g->fetching && !st) {
        st = wrap_caller(g, compute_stream);
        if (!st)
            st = laden_dev_stream_wait_event(g->caller, g->fetched);
    }
    pthread_mutex_unlock(&g->mu);
    return st;
}

uintptr_t laden_grads_upload_stream(laden_grads_t *g)
{
    return g ? laden_dev_stream_handle(g->up) : 0;
}
