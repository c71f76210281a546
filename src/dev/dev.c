/* Device table and dispatch.  Validates arguments once here, so the two
 * implementations only see well-formed calls. */
#include <stdlib.h>
#include <string.h>

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
    return s->ops->stream_sync(s->device, s->impl);
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
    return e->ops->event_sync(e->device, e->impl);
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
    return ops->mem_alloc(dev, n, out);
}

laden_status laden_dev_mem_free(int32_t dev, laden_devptr_t p)
{
    if (!p)
        return LADEN_OK;
    RESOLVE(dev);
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
    return ops->host_alloc(dev, n, out);
}

laden_status laden_dev_host_free(int32_t dev, void *p)
{
    if (!p)
        return LADEN_OK;
    RESOLVE(dev);
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
    return ops->host_register(dev, p, n);
}

laden_status laden_dev_host_unregister(int32_t dev, void *p)
{
    if (!p)
        return laden__fail(LADEN_E_INVAL, "host_unregister: NULL");
    RESOLVE(dev);
    return ops->host_unregister(dev, p);
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
    return st ? st : ops->map(dev, va, n, p);
}

laden_status laden_dev_unmap(int32_t dev, laden_devptr_t va, uint64_t n)
{
    RESOLVE(dev);
    laden_status st = check_gran(dev, ops, va, n, "unmap");
    return st ? st : ops->unmap(dev, va, n);
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
