/* The elastic allocator.  See include/laden/vram.h.
 *
 * PyTorch's caching allocator sits above it and keeps its own blocks, so
 * these calls are for whole segments: few, large, and off the hot path.
 * Plain arrays, one lock per device. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "../trace/trace_internal.h"
#include "laden/vram.h"
#include "vram_internal.h"

#define MAX_DEVICES 64
#define MAX_CACHED 256

typedef struct cached {
    laden_devptr_t ptr;
    uint64_t size;
    uintptr_t stream;      /* the stream that freed it */
    laden_event_t *done;   /* recorded there at the free */
} cached;

/* A block handed out: PyTorch frees with the size it asked for, which is
 * less than the block's when a larger cached block served it. */
typedef struct live {
    laden_devptr_t ptr; /* 0: empty */
    uint64_t size;
} live;

typedef struct elastic {
    pthread_mutex_t mu;
    laden_vram_t *ctx;
    cached c[MAX_CACHED];
    uint32_t n;
    live *lv;       /* open addressing, linear probing; a power of two */
    uint32_t lcap, ln;
    /* A free is one event record: events are recycled, and the stream of
     * the last free stays wrapped (PyTorch frees on few streams). */
    laden_event_t *spare[MAX_CACHED];
    uint32_t nspare;
    laden_dev_stream_t *ws;
    uintptr_t ws_handle;
    laden_elastic_stats_t st;
    uint64_t gauged; /* in_use_bytes as the trace's gauge has it */
} elastic;

/* The trace's gauge follows in_use_bytes (e->mu held). */
static void gauge(elastic *e, int32_t device)
{
    if (e->st.in_use_bytes != e->gauged) {
        laden__gauge_add(LADEN__GAUGE_ELASTIC, device,
                         (int64_t)(e->st.in_use_bytes - e->gauged));
        e->gauged = e->st.in_use_bytes;
    }
}

static elastic dev_state[MAX_DEVICES + 1]; /* [0]: the CPU device */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init_locks(void)
{
    for (int i = 0; i <= MAX_DEVICES; i++)
        pthread_mutex_init(&dev_state[i].mu, NULL);
}

static elastic *state(int device)
{
    if (device < LADEN_DEVICE_CPU || device >= MAX_DEVICES)
        return NULL;
    pthread_once(&once, init_locks);
    return &dev_state[device + 1];
}

static void retire_event(elastic *e, laden_event_t *ev)
{
    if (!ev)
        return;
    if (e->nspare < MAX_CACHED)
        e->spare[e->nspare++] = ev;
    else
        laden_dev_event_destroy(ev);
}

/* Records the point of a free on `handle`: an event, recycled. */
static laden_status record_free(elastic *e, int32_t device, uintptr_t handle,
                                laden_event_t **out)
{
    laden_status s;
    *out = NULL;
    if (!e->ws || e->ws_handle != handle) {
        laden_dev_stream_destroy(e->ws);
        e->ws = NULL;
        if ((s = laden_dev_stream_wrap(device, handle, &e->ws)))
            return s;
        e->ws_handle = handle;
    }
    laden_event_t *ev = e->nspare ? e->spare[--e->nspare] : NULL;
    if (!ev && (s = laden_dev_event_create(device, 0, &ev)))
        return s;
    if ((s = laden_dev_event_record(ev, e->ws))) {
        retire_event(e, ev);
        return s;
    }
    *out = ev;
    return LADEN_OK;
}

/* Frees cached block k (its last use has finished or must be waited
 * for); uncharged unless the context does it (reclaim). */
static void drop_cached(elastic *e, int32_t device, uint32_t k, bool wait,
                        bool uncharge)
{
    cached *b = &e->c[k];
    if (wait && b->done)
        laden_dev_event_synchronize(b->done);
    retire_event(e, b->done);
    laden_dev_mem_free(device, b->ptr);
    if (e->ctx && uncharge)
        laden_vram_uncharge(e->ctx, b->size);
    e->st.cached_bytes -= b->size;
    e->c[k] = e->c[--e->n];
}

static bool finished(cached *b)
{
    int done = 1;
    if (b->done && laden_dev_event_query(b->done, &done) != LADEN_OK)
        done = 0;
    return done != 0;
}

/* Frees cached blocks until `need` bytes are given back (all: UINT64_MAX);
 * finished ones first, then waits for the others. */
static uint64_t trim_as(elastic *e, int32_t device, uint64_t need,
                        bool uncharge)
{
    uint64_t freed = 0;
    for (int pass = 0; pass < 2 && freed < need; pass++)
        for (uint32_t k = e->n; k-- > 0 && freed < need;) {
            if (pass == 0 && !finished(&e->c[k]))
                continue;
            freed += e->c[k].size;
            drop_cached(e, device, k, true, uncharge);
        }
    return freed;
}

static uint64_t trim(elastic *e, int32_t device, uint64_t need)
{
    return trim_as(e, device, need, true);
}

/* The context's reclaim hook: cached blocks before weights.  Skipped if
 * the allocator is busy (it takes its lock before the context's). */
static uint64_t reclaim(void *arg, uint64_t need)
{
    elastic *e = arg;
    if (pthread_mutex_trylock(&e->mu) != 0)
        return 0;
    int32_t device = (int32_t)(e - dev_state) - 1;
    uint64_t got = trim_as(e, device, need, false);
    pthread_mutex_unlock(&e->mu);
    return got;
}

/* ---- blocks handed out ---------------------------------------------------- */

static uint32_t live_home(const elastic *e, laden_devptr_t p)
{
    return (uint32_t)(((p >> 8) * 0x9e3779b97f4a7c15ull) >> 32) & (e->lcap - 1);
}

static bool live_grow(elastic *e)
{
    uint32_t cap = e->lcap ? e->lcap * 2 : 256;
    live *old = e->lv;
    uint32_t ocap = e->lcap;
    live *nv = calloc(cap, sizeof *nv);
    if (!nv)
        return false;
    e->lv = nv;
    e->lcap = cap;
    for (uint32_t i = 0; i < ocap; i++) {
        if (!old[i].ptr)
            continue;
        uint32_t k = live_home(e, old[i].ptr);
        while (e->lv[k].ptr)
            k = (k + 1) & (cap - 1);
        e->lv[k] = old[i];
    }
    free(old);
    return true;
}

static bool live_put(elastic *e, laden_devptr_t p, uint64_t size)
{
    if ((e->ln + 1) * 2 > e->lcap && !live_grow(e))
        return false;
    uint32_t k = live_home(e, p);
    while (e->lv[k].ptr)
        k = (k + 1) & (e->lcap - 1);
    e->lv[k].ptr = p;
    e->lv[k].size = size;
    e->ln++;
    return true;
}

/* Removes p; its size, or 0 if it was not handed out here. */
static uint64_t live_take(elastic *e, laden_devptr_t p)
{
    if (!e->lcap)
        return 0;
    uint32_t mask = e->lcap - 1, k = live_home(e, p);
    while (e->lv[k].ptr && e->lv[k].ptr != p)
        k = (k + 1) & mask;
    if (!e->lv[k].ptr)
        return 0;
    uint64_t size = e->lv[k].size;
    /* Backward-shift deletion: no tombstones. */
    uint32_t hole = k;
    for (uint32_t j = (k + 1) & mask; e->lv[j].ptr; j = (j + 1) & mask) {
        uint32_t h = live_home(e, e->lv[j].ptr);
        /* Move j into the hole unless its home lies cyclically in
         * (hole, j]. */
        bool stays = hole <= j ? (h > hole && h <= j) : (h > hole || h <= j);
        if (!stays) {
            e->lv[hole] = e->lv[j];
            hole = j;
        }
    }
    e->lv[hole].ptr = 0;
    e->ln--;
    return size;
}

laden_status laden_elastic_attach(int32_t device, laden_vram_t *ctx)
{
    elastic *e = state(device);
    if (!e)
        return laden__fail(LADEN_E_NODEVICE, "elastic: no device %d", device);
    if (ctx) {
        laden_vram_info_t info;
        laden_status s = laden_vram_info(ctx, &info);
        if (s)
            return s;
        if (info.device != device)
            return laden__fail(LADEN_E_INVAL,
                               "elastic: the context is for device %d, not "
                               "%d",
                               info.device, device);
    }
    pthread_mutex_lock(&e->mu);
    laden_status s = LADEN_OK;
    if (ctx && e->ctx && e->ctx != ctx)
        s = laden__fail(LADEN_E_STATE,
                        "elastic: device %d serves another context; detach "
                        "it first",
                        device);
    else {
        trim(e, device, UINT64_MAX);
        if (e->ctx && e->ctx != ctx)
            laden__vram_set_reclaim(e->ctx, NULL, NULL);
        e->ctx = ctx;
    }
    pthread_mutex_unlock(&e->mu);
    if (!s && ctx)
        laden__vram_set_reclaim(ctx, reclaim, e);
    return s;
}

void *laden_elastic_malloc(ptrdiff_t size, int device, void *stream)
{
    elastic *e = state(device);
    if (!e || size < 0)
        return NULL;
    uint64_t n = (uint64_t)(size ? size : 1);
    pthread_mutex_lock(&e->mu);
    void *out = NULL;
    /* A cached block: on the stream that freed it at once (stream order),
     * on another once its event has passed; no more than twice the size. */
    int best = -1;
    for (uint32_t k = 0; k < e->n; k++) {
        cached *b = &e->c[k];
        if (b->size < n || b->size > 2 * n)
            continue;
        if (b->stream != (uintptr_t)stream && !finished(b))
            continue;
        if (best < 0 || b->size < e->c[best].size)
            best = (int)k;
    }
    if (best >= 0 && live_put(e, e->c[best].ptr, e->c[best].size)) {
        cached b = e->c[best];
        retire_event(e, b.done);
        e->c[best] = e->c[--e->n];
        e->st.cached_bytes -= b.size;
        e->st.in_use_bytes += b.size;
        e->st.reuses++;
        e->st.allocs++;
        out = (void *)(uintptr_t)b.ptr;
        goto done;
    }
    laden_vram_t *ctx = e->ctx;
    if (ctx) {
        /* Charged without this lock held, so that the context's reclaim
         * hook can take the cached blocks back before it evicts any
         * weight (it only trylocks this lock). */
        laden_vram_info_t before, after;
        pthread_mutex_unlock(&e->mu);
        laden_vram_info(ctx, &before);
        laden_status s = laden_vram_charge(ctx, n);
        laden_vram_info(ctx, &after);
        pthread_mutex_lock(&e->mu);
        e->st.evicted_bytes += after.evicted_bytes - before.evicted_bytes;
        /* The hook found the lock taken by another thread: trim here. */
        if (s == LADEN_E_BUDGET && trim(e, device, n) > 0)
            s = laden_vram_charge(ctx, n);
        if (s) {
            laden__error_clear();
            e->st.failures++;
            goto done;
        }
    }
    laden_devptr_t p = 0;
    laden_status s = laden_dev_mem_alloc(device, n, &p);
    if (s == LADEN_E_DEVICE_NOMEM) {
        /* The device is fuller than the budget says: give back cached
         * blocks and unpinned weights, once. */
        uint64_t freed = trim(e, device, n);
        if (ctx && freed < n) {
            uint64_t ev = 0;
            laden_vram_free_memory(ctx, n - freed, &ev);
            e->st.evicted_bytes += ev;
        }
        s = laden_dev_mem_alloc(device, n, &p);
    }
    if (s || !live_put(e, p, n)) {
        if (!s)
            laden_dev_mem_free(device, p);
        laden__error_clear();
        if (ctx)
            laden_vram_uncharge(ctx, n);
        e->st.failures++;
        goto done;
    }
    e->st.allocs++;
    e->st.in_use_bytes += n;
    out = (void *)(uintptr_t)p;
done:
    if (e->st.in_use_bytes + e->st.cached_bytes > e->st.peak_bytes)
        e->st.peak_bytes = e->st.in_use_bytes + e->st.cached_bytes;
    gauge(e, device);
    pthread_mutex_unlock(&e->mu);
    return out;
}

void laden_elastic_free(void *ptr, ptrdiff_t size, int device, void *stream)
{
    elastic *e = state(device);
    if (!e || !ptr || size < 0)
        return;
    uint64_t n = (uint64_t)(size ? size : 1);
    pthread_mutex_lock(&e->mu);
    uint64_t real = live_take(e, (laden_devptr_t)(uintptr_t)ptr);
    if (real)
        n = real; /* what was charged, and what the block can serve */
    e->st.frees++;
    e->st.in_use_bytes -= n < e->st.in_use_bytes ? n : e->st.in_use_bytes;
    if (e->n == MAX_CACHED)
        trim(e, device, 1); /* make a place */
    cached b = {(laden_devptr_t)(uintptr_t)ptr, n, (uintptr_t)stream, NULL};
    /* The CPU's work has finished when it frees: no event there. */
    if (device != LADEN_DEVICE_CPU &&
        record_free(e, device, (uintptr_t)stream, &b.done)) {
        /* Cannot order it: wait and free now. */
        laden__error_clear();
        if (e->ws)
            laden_dev_stream_synchronize(e->ws);
        laden_dev_mem_free(device, b.ptr);
        if (e->ctx)
            laden_vram_uncharge(e->ctx, n);
    } else {
        e->c[e->n++] = b;
        e->st.cached_bytes += n;
    }
    gauge(e, device);
    pthread_mutex_unlock(&e->mu);
}

laden_status laden_elastic_trim(int32_t device)
{
    elastic *e = state(device);
    if (!e)
        return laden__fail(LADEN_E_NODEVICE, "elastic: no device %d", device);
    pthread_mutex_lock(&e->mu);
    trim(e, device, UINT64_MAX);
    pthread_mutex_unlock(&e->mu);
    return LADEN_OK;
}

laden_status laden_elastic_stats(int32_t device, laden_elastic_stats_t *out)
{
    elastic *e = state(device);
    if (!e || !out)
        return laden__fail(LADEN_E_INVAL, "laden_elastic_stats: %s",
                           e ? "NULL" : "no such device");
    pthread_mutex_lock(&e->mu);
    *out = e->st;
    pthread_mutex_unlock(&e->mu);
    return LADEN_OK;
}
