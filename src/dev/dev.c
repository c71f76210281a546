/* Device table and dispatch.  Validates arguments once here, so the two
 * implementations only see well-formed calls. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../trace/trace_internal.h"
#include "dev_internal.h"

struct laden_dev_stream {
    int32_t device;
    const laden__dev_ops *ops;
    void *impl;
    bool owned;
};

struct laden_event {
    int32_t device;
    const laden__dev_ops *ops;
    void *impl;
};

laden_status laden__dev_resolve(int32_t dev, const laden__dev_ops **ops)
{
    *ops = NULL;
    if (dev == LADEN_DEVICE_CPU) {
        *ops = &laden__dev_cpu_ops;
        return LADEN_OK;
    }
    int32_t n = laden__cuda_load();
    if (dev >= 0 && dev < n) {
        *ops = &laden__dev_cuda_ops;
        return LADEN_OK;
    }
    if (dev >= 0 && n == 0)
        return laden__fail(LADEN_E_NODEVICE,
                           "CUDA device %d asked for, but CUDA is "
                           "unavailable: %s",
                           dev, laden__cuda_error);
    return laden__fail(LADEN_E_NODEVICE,
                       "device %d does not exist (%d CUDA device%s; the CPU "
                       "device is %d)",
                       dev, n, n == 1 ? "" : "s", LADEN_DEVICE_CPU);
}

#define RESOLVE(dev)                        \
    const laden__dev_ops *ops;              \
    do {                                    \
        laden_status rs = laden__dev_resolve(dev, &ops); \
        if (rs)                             \
            return rs;                      \
    } while (0)

/* ---- memory held, for the trace's counters -------------------------------
 * Frees do not say their size: a small open-addressed table maps each live
 * allocation (device memory, pinned host memory) to its size and gauge.
 * Allocations are rare (never on the hot path), so one lock serves. */
typedef struct held {
    uintptr_t key; /* 0 empty, 1 deleted */
    uint64_t n;
    int32_t dev;
    uint8_t gauge;
} held;
static pthread_mutex_t held_mu = PTHREAD_MUTEX_INITIALIZER;
static held *held_tab;
static size_t held_cap, held_used;

static size_t held_hash(uintptr_t k, size_t cap)
{
    uint64_t h = (uint64_t)k * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static bool held_grow(void)
{
    size_t cap = held_cap ? held_cap * 2 : 1024;
    held *t = calloc(cap, sizeof *t);
    if (!t)
        return false;
    for (size_t i = 0; i < held_cap; i++) {
        if (held_tab[i].key <= 1)
            continue;
        size_t j = held_hash(held_tab[i].key, cap);
        while (t[j].key)
            j = (j + 1) & (cap - 1);
        t[j] = held_tab[i];
    }
    free(held_tab);
    held_tab = t;
    held_cap = cap;
    size_t live = 0;
    for (size_t i = 0; i < cap; i++)
        live += t[i].key > 1;
    held_used = live;
    return true;
}

static void held_add(uintptr_t key, uint64_t n, laden__gauge g, int32_t dev)
{
    if (key <= 1)
        return;
    pthread_mutex_lock(&held_mu);
    if ((held_used + 1) * 2 > held_cap && !held_grow()) {
        pthread_mutex_unlock(&held_mu); /* uncounted, never wrong */
        return;
    }
    size_t j = held_hash(key, held_cap);
    while (held_tab[j].key > 1)
        j = (j + 1) & (held_cap - 1);
    held_used += held_tab[j].key == 0;
    held_tab[j] = (held){key, n, dev, (uint8_t)g};
    pthread_mutex_unlock(&held_mu);
    laden__gauge_add(g, dev, (int64_t)n);
}

static void held_drop(uintptr_t key)
{
    held h = {0};
    pthread_mutex_lock(&held_mu);
    if (held_cap) {
        size_t j = held_hash(key, held_cap);
        while (held_tab[j].key && held_tab[j].key != key)
            j = (j + 1) & (held_cap - 1);
        if (held_tab[j].key == key) {
            h = held_tab[j];
            held_tab[j].key = 1;
        }
    }
    pthread_mutex_unlock(&held_mu);
    if (h.key)
        laden__gauge_add((laden__gauge)h.gauge, h.dev, -(int64_t)h.n);
}

static void traced_sync(uint64_t t0, int32_t dev, const char *what)
{
    uint64_t t1 = laden__now_ns();
    laden__trace_rec r = {.t = t0, .dur = t1 - t0, .s = what,
                          .ev = LADEN__EV_SYNC, .dev = (int16_t)dev};
    laden__trace_emit(&r);
}

laden_status laden_dev_count(int32_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_dev_count: out is NULL");
    *out = laden__cuda_load();
    return LADEN_OK;
}

const char *laden_dev_cuda_error(void)
{
    laden__cuda_load();
    return laden__cuda_error;
}

laden_status laden_dev_info(int32_t dev, laden_dev_info_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_dev_info: out is NULL");
    memset(out, 0, sizeof *out);
    RESOLVE(dev);
    return ops->info(dev, out);
}

laden_status laden_dev_mem_info(int32_t dev, uint64_t *free_b, uint64_t *total)
{
    if (free_b)
        *free_b = 0;
    if (total)
        *total = 0;
    if (!free_b || !total)
        return laden__fail(LADEN_E_INVAL, "laden_dev_mem_info: NULL out");
    RESOLVE(dev);
    return ops->mem_info(dev, free_b, total);
}

static laden_status make_stream(int32_t dev, bool wrap, uintptr_t handle,
                                laden_dev_stream_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "stream: out is NULL");
    *out = NULL;
    RESOLVE(dev);
    laden_dev_stream_t *s = calloc(1, sizeof *s);
    if (!s)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a stream");
    laden_status st = wrap ? ops->stream_wrap(dev, handle, &s->impl)
                           : ops->stream_create(dev, &s->impl);
    if (st) {
        free(s);
        return st;
    }
    s->device = dev;
    s->ops = ops;
    s->owned = !wrap;
    *out = s;
    return LADEN_OK;
}

laden_status laden_dev_stream_create(int32_t dev, laden_dev_stream_t **out)
{
    return make_stream(dev, false, 0, out);
}

laden_status laden_dev_stream_wrap(int32_t dev, uintptr_t handle,
                                   laden_dev_stream_t **out)
{
    return make_stream(dev, true, handle, out);
}

void laden_dev_stream_destroy(laden_dev_stream_t *s)
{
    if (!s)
        return;
    s->ops->stream_destroy(s->device, s->impl, s->owned);
    free(s);
}

uintptr_t laden_dev_stream_handle(laden_dev_stream_t *s)
{
    if (!s || s->device == LADEN_DEVICE_CPU)
        return 0;
    return (uintptr_t)s->impl;
}

laden_status laden_dev_stream_synchronize(laden_dev_stream_t *s)
{
    if (!s)
        return laden__fail(LADEN_E_INVAL, "stream_synchronize: NULL stream");
    if (!LADEN__TRACING())
        return s->ops->stream_sync(s->device, s->impl);
    uint64_t t0 = laden__now_ns();
    laden_status st = s->ops->stream_sync(s->device, s->impl);
    traced_sync(t0, s->device, "stream");
    return st;
}

static laden_status same_device(laden_dev_stream_t *s, laden_event_t *e,
                                const char *call)
{
    if (!s || !e)
        return laden__fail(LADEN_E_INVAL, "%s: NULL stream or event", call);
    if (s->device != e->device)
        return laden__fail(LADEN_E_INVAL,
                           "%s: stream is on device %d, event on device %d",
                           call, s->device, e->device);
    return LADEN_OK;
}

laden_status laden_dev_stream_wait_event(laden_dev_stream_t *s, laden_event_t *e)
{
    laden_status st = same_device(s, e, "stream_wait_event");
    return st ? st : s->ops->stream_wait_event(s->device, s->impl, e->impl);
}

/* ---- CUDA graphs ------------------------------------------------------- */

struct laden_dev_graph {
    int32_t device;
    const laden__dev_ops *ops;
    void *impl;
};

laden_status laden_dev_stream_capturing(laden_dev_stream_t *s, int *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "stream_capturing: out is NULL");
    *out = 0;
    if (!s)
        return laden__fail(LADEN_E_INVAL, "stream_capturing: NULL stream");
    if (!s->ops->stream_capturing)
        return LADEN_OK; /* the CPU device captures nothing */
    return s->ops->stream_capturing(s->device, s->impl, out);
}

static laden_status graphs_of(laden_dev_stream_t *s, const char *call)
{
    if (!s)
        return laden__fail(LADEN_E_INVAL, "%s: NULL stream", call);
    if (!s->ops->capture_begin)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "%s: CUDA graphs need a CUDA device", call);
    return LADEN_OK;
}

laden_status laden_dev_graph_capture_begin(laden_dev_stream_t *s)
{
    laden_status st = graphs_of(s, "graph_capture_begin");
    return st ? st : s->ops->capture_begin(s->device, s->impl);
}

laden_status laden_dev_graph_capture_end(laden_dev_stream_t *s,
                                         laden_dev_graph_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "graph_capture_end: out is NULL");
    *out = NULL;
    laden_status st = graphs_of(s, "graph_capture_end");
    if (st)
        return st;
    void *impl = NULL;
    if ((st = s->ops->capture_end(s->device, s->impl, &impl)))
        return st;
    laden_dev_graph_t *g = calloc(1, sizeof *g);
    if (!g) {
        s->ops->graph_destroy(s->device, impl);
        return laden__fail(LADEN_E_NOMEM, "out of memory ending a capture");
    }
    g->device = s->device;
    g->ops = s->ops;
    g->impl = impl;
    *out = g;
    return LADEN_OK;
}

laden_status laden_dev_graph_launch(laden_dev_graph_t *g,
                                    laden_dev_stream_t *s)
{
    if (!g || !s)
        return laden__fail(LADEN_E_INVAL, "graph_launch: NULL graph or "
                                          "stream");
    if (g->device != s->device)
        return laden__fail(LADEN_E_INVAL,
                           "graph_launch: graph is on device %d, stream on "
                           "device %d", g->device, s->device);
    return g->ops->graph_launch(g->device, g->impl, s->impl);
}

void laden_dev_graph_destroy(laden_dev_graph_t *g)
{
    if (!g)
        return;
    g->ops->graph_destroy(g->device, g->impl);
    free(g);
}

laden_status laden_dev_event_create(int32_t dev, int timing,
                                    laden_event_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "event_create: out is NULL");
    *out = NULL;
    RESOLVE(dev);
    laden_event_t *e = calloc(1, sizeof *e);
    if (!e)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating an event");
    laden_status st = ops->event_create(dev, timing, &e->impl);
    if (st) {
        free(e);
        return st;
    }
    e->device = dev;
    e->ops = ops;
    *out = e;
    return LADEN_OK;
}

void laden_dev_event_destroy(laden_event_t *e)
{
    if (!e)
        return;
    e->ops->event_destroy(e->device, e->impl);
    free(e);
}

laden_status laden_dev_event_record(laden_event_t *e, laden_dev_stream_t *s)
{
    laden_status st = same_device(s, e, "event_record");
    return st ? st : e->ops->event_record(e->device, e->impl, s->impl);
}

laden_status laden_dev_event_synchronize(laden_event_t *e)
{
    if (!e)
        return laden__fail(LADEN_E_INVAL, "event_synchronize: NULL event");
    if (!LADEN__TRACING())
        return e->ops->event_sync(e->device, e->impl);
    uint64_t t0 = laden__now_ns();
    laden_status st = e->ops->event_sync(e->device, e->impl);
    traced_sync(t0, e->device, "event");
    return st;
}

laden_status laden_dev_event_query(laden_event_t *e, int *done)
{
    if (done)
        *done = 0;
    if (!e || !done)
        return laden__fail(LADEN_E_INVAL, "event_query: NULL argument");
    return e->ops->event_query(e->device, e->impl, done);
}

laden_status laden_dev_event_elapsed_ms(laden_event_t *a, laden_event_t *b,
                                        float *ms)
{
    if (ms)
        *ms = 0;
    if (!a || !b || !ms || a->device != b->device)
        return laden__fail(LADEN_E_INVAL,
                           "event_elapsed_ms: need two events of one device");
    return a->ops->event_elapsed(a->device, a->impl, b->impl, ms);
}

laden_status laden_dev_copy_h2d(laden_dev_stream_t *s, laden_devptr_t dst,
                                const void *src, uint64_t n)
{
    if (!s || (n && (!dst || !src)))
        return laden__fail(LADEN_E_INVAL, "copy_h2d: NULL argument");
    return n ? s->ops->copy_h2d(s->device, s->impl, dst, src, n) : LADEN_OK;
}

laden_status laden_dev_copy_d2h(laden_dev_stream_t *s, void *dst,
                                laden_devptr_t src, uint64_t n)
{
    if (!s || (n && (!dst || !src)))
        return laden__fail(LADEN_E_INVAL, "copy_d2h: NULL argument");
    return n ? s->ops->copy_d2h(s->device, s->impl, dst, src, n) : LADEN_OK;
}

laden_status laden_dev_copy_d2d(laden_dev_stream_t *s, laden_devptr_t dst,
                                laden_devptr_t src, uint64_t n)
{
    if (!s || (n && (!dst || !src)))
        return laden__fail(LADEN_E_INVAL, "copy_d2d: NULL argument");
    return n ? s->ops->copy_d2d(s->device, s->impl, dst, src, n) : LADEN_OK;
}

laden_status laden_dev_mem_alloc(int32_t dev, uint64_t n, laden_devptr_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "mem_alloc: out is NULL");
    *out = 0;
    if (n == 0)
        return laden__fail(LADEN_E_INVAL, "mem_alloc: zero bytes");
    RESOLVE(dev);
    laden_status st = ops->mem_alloc(dev, n, out);
    if (!st)
        held_add(*out, n, LADEN__GAUGE_DEVICE, dev);
    return st;
}

laden_status laden_dev_mem_free(int32_t dev, laden_devptr_t p)
{
    if (!p)
        return LADEN_OK;
    RESOLVE(dev);
    held_drop(p); /* first: once freed, the address may be handed out */
    return ops->mem_free(dev, p);
}

laden_status laden_dev_host_alloc(int32_t dev, uint64_t n, void **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "host_alloc: out is NULL");
    *out = NULL;
    if (n == 0)
        return laden__fail(LADEN_E_INVAL, "host_alloc: zero bytes");
    RESOLVE(dev);
    laden_status st = ops->host_alloc(dev, n, out);
    if (!st)
        held_add((uintptr_t)*out, n, LADEN__GAUGE_PINNED, dev);
    return st;
}

laden_status laden_dev_host_free(int32_t dev, void *p)
{
    if (!p)
        return LADEN_OK;
    RESOLVE(dev);
    held_drop((uintptr_t)p); /* first: once freed, it may be handed out */
    return ops->host_free(dev, p);
}

laden_status laden_dev_host_register(int32_t dev, void *p, uint64_t n)
{
    uint64_t page = 4096;
    if (!p || n == 0 || (uintptr_t)p % page || n % page)
        return laden__fail(LADEN_E_INVAL,
                           "host_register: %p, %llu bytes: give a non-empty "
                           "page-aligned range",
                           p, (unsigned long long)n);
    RESOLVE(dev);
    laden_status st = ops->host_register(dev, p, n);
    if (!st)
        held_add((uintptr_t)p, n, LADEN__GAUGE_PINNED, dev);
    return st;
}

laden_status laden_dev_host_unregister(int32_t dev, void *p)
{
    if (!p)
        return laden__fail(LADEN_E_INVAL, "host_unregister: NULL");
    RESOLVE(dev);
    laden_status st = ops->host_unregister(dev, p);
    if (!st)
        held_drop((uintptr_t)p);
    return st;
}

static laden_status check_gran(int32_t dev, const laden__dev_ops *ops,
                               uint64_t a, uint64_t b, const char *call)
{
    laden_dev_info_t info;
    laden_status st = ops->info(dev, &info);
    if (st)
        return st;
    if (!info.vmm_supported)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "%s: device %d does not support virtual memory "
                           "management",
                           call, dev);
    uint64_t g = info.vmm_granularity_bytes;
    if (a % g || b % g || b == 0)
        return laden__fail(LADEN_E_INVAL,
                           "%s: address and size must be non-zero multiples "
                           "of %llu bytes",
                           call, (unsigned long long)g);
    return LADEN_OK;
}

laden_status laden_dev_va_reserve(int32_t dev, uint64_t n, laden_devptr_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "va_reserve: out is NULL");
    *out = 0;
    RESOLVE(dev);
    laden_status st = check_gran(dev, ops, 0, n, "va_reserve");
    return st ? st : ops->va_reserve(dev, n, out);
}

laden_status laden_dev_va_release(int32_t dev, laden_devptr_t va, uint64_t n)
{
    RESOLVE(dev);
    laden_status st = check_gran(dev, ops, va, n, "va_release");
    return st ? st : ops->va_release(dev, va, n);
}

laden_status laden_dev_phys_create(int32_t dev, uint64_t n, laden_phys_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "phys_create: out is NULL");
    *out = 0;
    RESOLVE(dev);
    laden_status st = check_gran(dev, ops, 0, n, "phys_create");
    return st ? st : ops->phys_create(dev, n, out);
}

laden_status laden_dev_phys_release(int32_t dev, laden_phys_t p)
{
    RESOLVE(dev);
    return ops->phys_release(dev, p);
}

laden_status laden_dev_map(int32_t dev, laden_devptr_t va, uint64_t n,
                           laden_phys_t p)
{
    RESOLVE(dev);
    laden_status st = check_gran(dev, ops, va, n, "map");
    if (!st && !(st = ops->map(dev, va, n, p)))
        laden__gauge_add(LADEN__GAUGE_VBAR, dev, (int64_t)n);
    return st;
}

laden_status laden_dev_unmap(int32_t dev, laden_devptr_t va, uint64_t n)
{
    RESOLVE(dev);
    laden_status st = check_gran(dev, ops, va, n, "unmap");
    if (!st && !(st = ops->unmap(dev, va, n)))
        laden__gauge_add(LADEN__GAUGE_VBAR, dev, -(int64_t)n);
    return st;
}

laden_status laden_dev_measure_copy(int32_t dev, laden_copy_kind kind,
                                    uint64_t n, uint32_t repeats, double *bps)
{
    if (bps)
        *bps = 0;
    if (!bps || n == 0 || repeats == 0 || kind > LADEN_COPY_D2H_PINNED)
        return laden__fail(LADEN_E_INVAL, "measure_copy: bad argument");
    laden_status st;
    laden_devptr_t d = 0;
    void *h = NULL;
    bool pinned = kind != LADEN_COPY_H2D_PAGEABLE;
    laden_dev_stream_t *s = NULL;
    laden_event_t *e0 = NULL, *e1 = NULL;
    float ms = 0;
    if ((st = laden_dev_mem_alloc(dev, n, &d)))
        return st;
    if (pinned)
        st = laden_dev_host_alloc(dev, n, &h);
    else if (!(h = malloc(n)))
        st = laden__fail(LADEN_E_NOMEM, "measure_copy: out of host memory");
    if (st)
        goto out;
    memset(h, 0x5a, n); /* fault the pages in before timing */
    if ((st = laden_dev_stream_create(dev, &s)) ||
        (st = laden_dev_event_create(dev, 1, &e0)) ||
        (st = laden_dev_event_create(dev, 1, &e1)))
        goto out;
    for (uint32_t i = 0; i <= repeats && !st; i++) {
        if (i == 1)
            st = laden_dev_event_record(e0, s);
        if (!st)
            st = kind == LADEN_COPY_D2H_PINNED ? laden_dev_copy_d2h(s, h, d, n)
                                                : laden_dev_copy_h2d(s, d, h, n);
        if (!st && i == 0)
            st = laden_dev_stream_synchronize(s);
    }
    if (!st && !(st = laden_dev_event_record(e1, s)) &&
        !(st = laden_dev_event_synchronize(e1)) &&
        !(st = laden_dev_event_elapsed_ms(e0, e1, &ms)))
        *bps = (double)n * repeats / ((ms > 0 ? ms : 1e-3f) * 1e-3);
out:
    laden_dev_event_destroy(e0);
    laden_dev_event_destroy(e1);
    laden_dev_stream_destroy(s);
    if (pinned)
        laden_dev_host_free(dev, h);
    else
        free(h);
    laden_dev_mem_free(dev, d);
    return st;
}

/* ---- stream marks for the trace ----------------------------------------
 * A mark is a timing event recorded on a stream.  Its time on the host
 * clock is read when the trace is written: the elapsed time from the
 * device's reference event, itself recorded on an empty stream and waited
 * for once per trace (the first mark on the device), so nothing the
 * caller queued is waited for. */
typedef struct tmark {
    struct tmark *next;
    const laden__dev_ops *ops;
    void *ev;
    int32_t dev;
    uint64_t track;
} tmark;

static pthread_mutex_t tm_mu = PTHREAD_MUTEX_INITIALIZER;
static tmark *tm_all;
static struct {
    uint64_t session;
    const laden__dev_ops *ops;
    void *ev;
    uint64_t t_ns;
} tm_ref[LADEN__GAUGE_DEVICES + 1];

static bool tm_resolve(void *p, uint64_t *t_ns, uint64_t *track)
{
    tmark *m = p;
    int k = m->dev + 1;
    float ms = 0;
    if (!tm_ref[k].ev || m->ops->event_sync(m->dev, m->ev) ||
        m->ops->event_elapsed(m->dev, tm_ref[k].ev, m->ev, &ms))
        return false;
    double t = (double)tm_ref[k].t_ns + (double)ms * 1e6;
    *t_ns = t > 0 ? (uint64_t)t : 0;
    *track = m->track;
    return true;
}

static bool tm_between(void *pa, void *pb, uint64_t *ns)
{
    tmark *a = pa, *b = pb;
    float ms = 0;
    if (a->dev != b->dev || a->ops->event_sync(a->dev, a->ev) ||
        b->ops->event_sync(b->dev, b->ev) ||
        a->ops->event_elapsed(a->dev, a->ev, b->ev, &ms) || ms < 0)
        return false;
    *ns = (uint64_t)((double)ms * 1e6);
    return true;
}

static void tm_release_all(void)
{
    pthread_mutex_lock(&tm_mu);
    for (tmark *m = tm_all, *nx; m; m = nx) {
        nx = m->next;
        m->ops->event_destroy(m->dev, m->ev);
        free(m);
    }
    tm_all = NULL;
    for (size_t k = 0; k < LADEN__ARRAY_LEN(tm_ref); k++) {
        if (tm_ref[k].ev)
            tm_ref[k].ops->event_destroy((int32_t)k - 1, tm_ref[k].ev);
        tm_ref[k].ev = NULL;
        tm_ref[k].session = 0;
    }
    pthread_mutex_unlock(&tm_mu);
}

/* The device's reference for this trace (tm_mu held). */
static bool tm_reference(int32_t dev, const laden__dev_ops *ops)
{
    int k = dev + 1;
    uint64_t sess = laden__trace_session();
    if (tm_ref[k].session == sess && tm_ref[k].ev)
        return true;
    if (tm_ref[k].ev) { /* a straggler's, from a trace that ended */
        tm_ref[k].ops->event_destroy(dev, tm_ref[k].ev);
        tm_ref[k].ev = NULL;
    }
    void *st = NULL, *ev = NULL;
    if (ops->stream_create(dev, &st))
        return false;
    bool ok = false;
    if (!ops->event_create(dev, 1, &ev)) {
        uint64_t a = laden__now_ns();
        if (!ops->event_record(dev, ev, st) && !ops->event_sync(dev, ev)) {
            uint64_t b = laden__now_ns();
            /* The CPU device's events carry their host time; a GPU's is
             * between the record and the end of the wait. */
            tm_ref[k].t_ns = dev == LADEN_DEVICE_CPU
                                 ? laden__dev_cpu_event_ns(ev)
                                 : a + (b - a) / 2;
            tm_ref[k].ev = ev;
            tm_ref[k].ops = ops;
            tm_ref[k].session = sess;
            ok = true;
        } else {
            ops->event_destroy(dev, ev);
        }
    }
    ops->stream_destroy(dev, st, true);
    return ok;
}

static void tm_register(void)
{
    laden__trace_marks m = {tm_resolve, tm_between, tm_release_all};
    laden__trace_set_marks(&m);
}

void *laden__dev_trace_mark(laden_dev_stream_t *s)
{
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    if (!s || !LADEN__TRACING() || !laden__trace_room() ||
        s->device < -1 || s->device >= LADEN__GAUGE_DEVICES)
        return NULL;
    pthread_once(&registered, tm_register); /* before any mark exists */
    tmark *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    m->ops = s->ops;
    m->dev = s->device;
    m->track = (uint64_t)(uintptr_t)s->impl;
    pthread_mutex_lock(&tm_mu);
    bool ok = LADEN__TRACING() && tm_reference(s->device, s->ops);
    pthread_mutex_unlock(&tm_mu);
    if (!ok || s->ops->event_create(s->device, 1, &m->ev)) {
        free(m);
        return NULL;
    }
    if (s->ops->event_record(s->device, m->ev, s->impl)) {
        s->ops->event_destroy(s->device, m->ev);
        free(m);
        return NULL;
    }
    /* Kept only while the trace is on: its stop releases every kept
     * mark (under tm_mu, after turning tracing off), so a mark made by a
     * thread that passed the check above as the trace stopped is not
     * left behind. */
    pthread_mutex_lock(&tm_mu);
    bool on = LADEN__TRACING();
    if (on) {
        m->next = tm_all;
        tm_all = m;
    }
    pthread_mutex_unlock(&tm_mu);
    if (!on) {
        s->ops->event_destroy(s->device, m->ev);
        free(m);
        return NULL;
    }
    return m;
}
