/* A stand-in libcuda.so.1 for CI machines without a GPU, so that laden's
 * CUDA paths (staging, pinned homes, events between streams) run on every
 * CI run.  Device memory is host memory.  What it checks:
 *  - A copy between device memory and pinned host memory is deferred
 *    until something waits for it (a stream or event synchronize, a wait
 *    of another stream on a recorded event, a free): code that reuses a
 *    staging buffer, or frees memory, before its copy ran gets wrong bytes
 *    or an abort here, as it would on a GPU only sometimes.  A copy from
 *    pageable memory reads its source at once, as the driver stages it,
 *    and writes device memory in the stream's order; one into pageable
 *    memory waits for the stream.
 *  - A deferred copy whose memory was freed meanwhile aborts.
 *  - Pinned memory lies 512 bytes past a page, as the real driver gives
 *    it when it packs allocations together (seen on the H200 after a
 *    12-byte one): laden_dev_host_alloc must still hand out 4 KiB.
 *  - Events, streams, device and pinned allocations left at exit make the
 *    process exit with status 3 (a leak).
 *  - Several devices (FAKE_CUDA_DEVICES, default 2), each with its own
 *    primary context and legacy stream, with the driver's rules between
 *    them: allocations, streams and events belong to the context current
 *    when they were made (none current: CUDA_ERROR_INVALID_CONTEXT), an
 *    event recorded on another device's stream or timed against another
 *    device's event is CUDA_ERROR_INVALID_HANDLE, and pinning a range
 *    that is pinned already is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED.
 *    A copy whose device memory is not its stream's device's aborts:
 *    laden copies only on the owning device's streams.
 *  - Kernels: it is NVRTC too (point LADEN_NVRTC at this library), and a
 *    launch of laden's expansion or lossless kernels is queued on its
 *    stream like a deferred copy and runs, when something waits for it,
 *    the kernels' own C build (src/dev/expand_c.h, the code the CPU device
 *    runs): laden's launches, upload buffers and the events between its
 *    copy and decode streams run on every CI run.  A kernel whose memory
 *    is not the stream's device's (or mapped pinned memory), or was freed
 *    before it ran, aborts.
 *  - Streams in no order a device would not take: a wait of a stream for
 *    an event is queued in it, and a host wait runs all queued work, the
 *    newest streams first, or (FAKE_CUDA_OLDEST_FIRST) the oldest first,
 *    or (FAKE_CUDA_WAITED_ONLY) only what it waits for (see run_all).
 * VMM entry points are not emulated (they fail): the tests that use VRAM
 * contexts skip (see the Makefile's test-fake-cuda).
 * Failures on demand, while the variable is set in the environment:
 * FAKE_CUDA_FAIL_D2H (cuMemcpyDtoHAsync), FAKE_CUDA_FAIL_EVENT_SYNC
 * (cuEventSynchronize and cuEventQuery), FAKE_CUDA_NO_KERNELS
 * (cuModuleLoadData: a driver that cannot load laden's kernels). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "expand_c.h" /* src/dev: the kernels' C build */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

#define NOT_SUPPORTED 801
#define FAKE_ERROR 999 /* a failure asked for by the environment */
#define INVALID_HANDLE 400
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define ALREADY_REGISTERED 712
#define NOT_REGISTERED 713
#define MAX_DEVICES 8

enum { DEVICE = 0, PINNED = 1, REGISTERED = 2 };

typedef struct range {
    struct range *next;
    char *p;
    size_t n;
    int kind;
    int dev; /* DEVICE: the device it is on */
} range;

enum { OP_COPY, OP_EXPAND, OP_LOSSLESS, OP_WAIT };

struct stream;

/* Work queued on a stream: a copy, a kernel with its argument, or a wait
 * for another stream's work up to an event. */
typedef struct copy {
    struct copy *next;
    int op;
    struct stream *on;          /* OP_WAIT: the stream waited for, */
    unsigned long long on_id, at; /* its serial and the work to wait for */
    char *dst;
    const char *src;
    size_t n;
    int staged;   /* src is this item's copy of pageable memory */
    unsigned vec; /* OP_EXPAND: the 16-byte-access kernel */
    union {
        ex_params ex;
        ex_ll_params ll;
    } arg;
} copy;

typedef struct stream {
    copy *head, *tail;
    unsigned long long queued, done; /* work items */
    unsigned long long id;           /* serial: never reused */
    int dev;
} stream;

typedef struct event {
    int magic;
    stream *s;
    unsigned long long s_id; /* s's serial: s may be destroyed since */
    unsigned long long at;   /* s->queued when recorded */
    int recorded;
    double t_ms; /* host clock when recorded: its "time" on the device */
    int dev;
} event;

#define EVENT_MAGIC 0x5eed
#define MAX_STREAMS 1024

/* A device's primary context: its handle is its address. */
typedef struct fctx {
    int dev;
    stream legacy; /* stream 0 while this context is current */
} fctx;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static range *ranges;
static fctx ctxs[MAX_DEVICES];
static stream *streams[MAX_STREAMS];
static long live_events, live_streams, live_device, live_pinned;
/* Static TLS (initial-exec), not the dynamic TLS a dlopen'ed library's
 * __thread gets by default: LeakSanitizer's scan of a thread's dynamic
 * TLS read a stale entry and crashed (lossless_in_a_cache_schedule under
 * ASan); glibc keeps room in the static TLS for a small dlopen'ed one. */
static __thread fctx *current_ctx __attribute__((tls_model("initial-exec")));

static int ndevices;
static pthread_once_t devices_once = PTHREAD_ONCE_INIT;

static void count_devices(void)
{
    const char *v = getenv("FAKE_CUDA_DEVICES");
    ndevices = v && *v ? atoi(v) : 2;
    if (ndevices < 1 || ndevices > MAX_DEVICES) {
        fprintf(stderr, "fake_cuda: FAKE_CUDA_DEVICES=%s: give 1 to %d\n", v,
                MAX_DEVICES);
        abort();
    }
    for (int i = 0; i < MAX_DEVICES; i++)
    {
        ctxs[i].dev = ctxs[i].legacy.dev = i;
        ctxs[i].legacy.id = (unsigned long long)i + 1;
    }
}

static int device_count(void)
{
    pthread_once(&devices_once, count_devices);
    return ndevices;
}

static range *find(const void *p, size_t n)
{
    for (range *r = ranges; r; r = r->next)
        if ((const char *)p >= r->p && (const char *)p + n <= r->p + r->n)
            return r;
    return NULL;
}

static void track(void *p, size_t n, int kind)
{
    range *r = calloc(1, sizeof *r);
    r->p = p;
    r->n = n;
    r->kind = kind;
    r->dev = current_ctx ? current_ctx->dev : -1;
    r->next = ranges;
    ranges = r;
}

static void untrack(void *p)
{
    for (range **l = &ranges; *l; l = &(*l)->next)
        if ((*l)->p == p) {
            range *r = *l;
            *l = r->next;
            free(r);
            return;
        }
}

static void run_kernel(const copy *c, int dev);
static void run_until(stream *s, unsigned long long n);
static stream *live_stream(stream *s, unsigned long long id);

static void run_one(stream *s)
{
    static int depth;
    copy *c = s->head;
    s->head = c->next;
    if (!s->head)
        s->tail = NULL;
    if (c->op == OP_WAIT) { /* the other stream's work first */
        stream *on = live_stream(c->on, c->on_id);
        if (on && ++depth > 64) {
            fprintf(stderr, "fake_cuda: streams wait for each other\n");
            abort();
        }
        if (on)
            run_until(on, c->at);
        depth -= on != NULL;
        s->done++;
        free(c);
        return;
    }
    if (c->op != OP_COPY) {
        run_kernel(c, s->dev);
        s->done++;
        free(c);
        return;
    }
    if (!find(c->dst, c->n) || (!c->staged && !find(c->src, c->n))) {
        fprintf(stderr, "fake_cuda: a deferred copy of %zu bytes touches "
                        "memory freed before it ran\n", c->n);
        abort();
    }
    memcpy(c->dst, c->src, c->n);
    if (c->staged)
        free((void *)c->src);
    s->done++;
    free(c);
}

static void run_until(stream *s, unsigned long long n)
{
    while (s->done < n)
        run_one(s);
}

/* Everything queued, the newest streams first (by their serials, the
 * legacy streams the oldest); done whenever the host waits for anything.
 * A device runs its streams side by side, in no order one can count on,
 * so work may run as soon as it is queued and what it waits for has run:
 * here all of it runs at the first wait, so that work one stream does
 * for another's without an event between them runs too early (a copy
 * stream made first would otherwise run before the decode stream made
 * after it, and a host wait for the copies before the decodes hid a
 * decode that did not wait for its copy).  Two more orders, for the
 * waits this one hides: FAKE_CUDA_OLDEST_FIRST (the oldest first: a copy
 * into a buffer a decode still reads, a compute stream that does not
 * wait for the uploads) and FAKE_CUDA_WAITED_ONLY (a host wait runs only
 * what it waits for, and what that waits for: a host that reads memory
 * after waiting for another stream than the one that writes it). */
enum { ORDER_NEWEST, ORDER_OLDEST, ORDER_WAITED };

static int order(void)
{
    static int o = -1;
    if (o < 0)
        o = getenv("FAKE_CUDA_WAITED_ONLY")    ? ORDER_WAITED
            : getenv("FAKE_CUDA_OLDEST_FIRST") ? ORDER_OLDEST
                                               : ORDER_NEWEST;
    return o;
}

static int by_id(const void *a, const void *b)
{
    unsigned long long x = (*(stream *const *)a)->id,
                       y = (*(stream *const *)b)->id;
    return x < y ? -1 : x > y;
}

static void run_all(void)
{
    static stream *all[MAX_STREAMS + MAX_DEVICES];
    int n = 0;
    for (int i = 0; i < MAX_DEVICES; i++)
        all[n++] = &ctxs[i].legacy;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i])
            all[n++] = streams[i];
    qsort(all, (size_t)n, sizeof *all, by_id);
    for (int k = 0; k < n; k++) {
        stream *s = all[order() == ORDER_OLDEST ? k : n - 1 - k];
        run_until(s, s->queued);
    }
}

/* A host wait for stream s's work up to `at`. */
static void host_wait(stream *s, unsigned long long at)
{
    if (order() == ORDER_WAITED)
        run_until(s, at);
    else
        run_all();
}

/* s if it is still a stream with serial id (a wait may outlive the
 * stream it waits for, whose work then ran when it was destroyed). */
static stream *live_stream(stream *s, unsigned long long id)
{
    for (int i = 0; i < MAX_DEVICES; i++)
        if (s == &ctxs[i].legacy)
            return s;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] && streams[i] == s && streams[i]->id == id)
            return s;
    return NULL;
}

/* Stream handle s; 0 is the current context's legacy stream (NULL when
 * no context is current). */
static stream *of(void *s)
{
    return s ? s : current_ctx ? &current_ctx->legacy : NULL;
}

/* Device memory of another device than the copy's stream: laden's bug. */
static void same_device(const void *p, size_t n, const stream *s)
{
    range *r = find(p, n);
    if (r && r->kind == DEVICE && r->dev != s->dev) {
        fprintf(stderr, "fake_cuda: a copy of %zu bytes touches memory of "
                        "cuda:%d on a stream of cuda:%d\n", n, r->dev, s->dev);
        abort();
    }
}

/* A copy on stream s: deferred when the host side is pinned. */
static CUresult enqueue(void *dst, const void *src, size_t n, void *sv,
                        int deferred)
{
    stream *s = of(sv);
    if (!s)
        return INVALID_CONTEXT;
    same_device(dst, n, s);
    same_device(src, n, s);
    range *d = find(dst, n);
    int staged = !deferred && d && d->kind == DEVICE;
    range *from = find(src, n);
    if (!deferred && !d && !(from && from->kind == DEVICE)) {
        /* pageable to pageable: neither side is the device's */
        fprintf(stderr, "fake_cuda: a copy of %zu bytes between two host "
                        "buffers that are no allocation of the driver's\n",
                n);
        abort();
    }
    if (!deferred && !staged) { /* into host memory: the call waits */
        host_wait(s, s->queued);
        memcpy(dst, src, n);
        return 0;
    }
    copy *c = calloc(1, sizeof *c);
    c->dst = dst;
    c->src = src;
    c->n = n;
    if (staged) { /* from pageable memory into the device's: the source
                     is read (staged) now, the device's memory written in
                     the stream's order */
        char *b = malloc(n ? n : 1);
        memcpy(b, src, n);
        c->src = b;
        c->staged = 1;
    }
    if (s->tail)
        s->tail->next = c;
    else
        s->head = c;
    s->tail = c;
    s->queued++;
    return 0;
}

static int pinned(const void *p, size_t n)
{
    range *r = find(p, n);
    return r && r->kind != DEVICE;
}

#define LOCKED(body)                                                       \
    do {                                                                   \
        pthread_mutex_lock(&mu);                                           \
        CUresult r_ = (body);                                              \
        pthread_mutex_unlock(&mu);                                         \
        return r_;                                                         \
    } while (0)

static CUresult cuInit(unsigned f) { (void)f; return 0; }
static CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
static CUresult cuDeviceGetCount(int *n) { *n = device_count(); return 0; }
static CUresult cuDeviceGet(int *d, int i)
{
    if (i < 0 || i >= device_count())
        return INVALID_DEVICE;
    *d = i;
    return 0;
}
static CUresult cuDeviceGetName(char *name, int len, int d)
{
    snprintf(name, (size_t)len, "fake_cuda %d", d);
    return 0;
}
static CUresult cuDeviceTotalMem(size_t *n, int d)
{
    (void)d;
    *n = 16ull << 30;
    return 0;
}
static CUresult cuDeviceGetAttribute(int *v, int attr, int d)
{
    (void)d;
    *v = attr == 75 ? 9 : 0; /* compute capability major: 9 */
    return 0;
}
static CUresult cuDevicePrimaryCtxRetain(void **ctx, int d)
{
    if (d < 0 || d >= device_count())
        return INVALID_DEVICE;
    *ctx = &ctxs[d];
    return 0;
}
static CUresult cuCtxGetCurrent(void **ctx) { *ctx = current_ctx; return 0; }
static CUresult cuCtxSetCurrent(void *ctx)
{
    fctx *c = ctx;
    if (c && (c < ctxs || c >= ctxs + device_count()))
        return INVALID_CONTEXT;
    current_ctx = c;
    return 0;
}
static CUresult cuMemGetInfo(size_t *fr, size_t *total)
{
    if (!current_ctx)
        return INVALID_CONTEXT;
    *fr = 15ull << 30;
    *total = 16ull << 30;
    return 0;
}

static CUresult stream_create(void **out)
{
    static unsigned long long serial = MAX_DEVICES;
    if (!current_ctx)
        return INVALID_CONTEXT;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i]) {
            streams[i] = calloc(1, sizeof **streams);
            streams[i]->dev = current_ctx->dev;
            streams[i]->id = ++serial;
            live_streams++;
            *out = streams[i];
            return 0;
        }
    return 2;
}
static CUresult cuStreamCreate(void **s, unsigned f)
{
    (void)f;
    LOCKED(stream_create(s));
}

static CUresult stream_destroy(stream *s)
{
    run_until(s, s->queued);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i] == s)
            streams[i] = NULL;
    free(s);
    live_streams--;
    return 0;
}
static CUresult cuStreamDestroy(void *s) { LOCKED(stream_destroy(s)); }

static CUresult stream_sync(stream *s)
{
    host_wait(s, s->queued);
    return 0;
}
static CUresult cuStreamSynchronize(void *s)
{
    LOCKED(of(s) ? stream_sync(of(s)) : INVALID_CONTEXT);
}

static CUresult event_wait(event *e)
{
    if (!e || e->magic != EVENT_MAGIC)
        return INVALID_HANDLE;
    stream *s = e->recorded ? live_stream(e->s, e->s_id) : NULL;
    if (s)
        host_wait(s, e->at);
    return 0;
}
/* Stream s waits for e's work where it is now: queued, so that what s
 * queued before the wait may run before that work, as on a device. */
static CUresult stream_wait(stream *s, event *e)
{
    if (!s)
        return INVALID_CONTEXT;
    if (!e || e->magic != EVENT_MAGIC)
        return INVALID_HANDLE;
    if (!e->recorded || e->s == s)
        return 0; /* nothing to wait for, or in order already */
    copy *c = calloc(1, sizeof *c);
    c->op = OP_WAIT;
    c->on = e->s;
    c->on_id = e->s_id;
    c->at = e->at;
    if (s->tail)
        s->tail->next = c;
    else
        s->head = c;
    s->tail = c;
    s->queued++;
    return 0;
}
static CUresult cuStreamWaitEvent(void *s, void *e, unsigned f)
{
    (void)f;
    LOCKED(stream_wait(of(s), e));
}
static CUresult cuEventSynchronize(void *e)
{
    if (getenv("FAKE_CUDA_FAIL_EVENT_SYNC"))
        return FAKE_ERROR;
    LOCKED(event_wait(e));
}
static CUresult cuEventQuery(void *e)
{
    if (getenv("FAKE_CUDA_FAIL_EVENT_SYNC"))
        return FAKE_ERROR;
    LOCKED(event_wait(e));
}

static CUresult event_create(void **out)
{
    if (!current_ctx)
        return INVALID_CONTEXT;
    event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
    e->dev = current_ctx->dev;
    live_events++;
    *out = e;
    return 0;
}
static CUresult cuEventCreate(void **e, unsigned f)
{
    (void)f;
    LOCKED(event_create(e));
}

static CUresult event_destroy(event *e)
{
    if (!e || e->magic != EVENT_MAGIC)
        return INVALID_HANDLE;
    e->magic = 0;
    free(e);
    live_events--;
    return 0;
}
static CUresult cuEventDestroy(void *e) { LOCKED(event_destroy(e)); }

static CUresult event_record(event *e, stream *s)
{
    if (!e || e->magic != EVENT_MAGIC || !s || e->dev != s->dev)
        return INVALID_HANDLE; /* the driver's rule: one device */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    e->s = s;
    e->s_id = s->id;
    e->at = s->queued;
    e->recorded = 1;
    e->t_ms = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
    return 0;
}
static CUresult cuEventRecord(void *e, void *s)
{
    LOCKED(of(s) ? event_record(e, of(s)) : INVALID_CONTEXT);
}
/* The time between the two records on the host clock: work queued in
 * order is timed in order. */
static CUresult event_elapsed(float *ms, event *a, event *b)
{
    if (!a || !b || a->magic != EVENT_MAGIC || b->magic != EVENT_MAGIC ||
        a->dev != b->dev)
        return INVALID_HANDLE;
    if (!a->recorded || !b->recorded)
        return 600; /* CUDA_ERROR_NOT_READY */
    *ms = (float)(b->t_ms - a->t_ms);
    return 0;
}
static CUresult cuEventElapsedTime(float *ms, void *a, void *b)
{
    LOCKED(event_elapsed(ms, a, b));
}

static CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *src, size_t n,
                                  void *s)
{
    LOCKED(enqueue((void *)(uintptr_t)d, src, n, s, pinned(src, n)));
}
static CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n,
                                  void *s)
{
    if (getenv("FAKE_CUDA_FAIL_D2H"))
        return FAKE_ERROR;
    LOCKED(enqueue(dst, (void *)(uintptr_t)src, n, s, pinned(dst, n)));
}
static CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr src, size_t n,
                                  void *s)
{
    LOCKED(enqueue((void *)(uintptr_t)d, (void *)(uintptr_t)src, n, s, 1));
}

/* ---- kernels: NVRTC, modules and launches ------------------------------ */

/* Memory a kernel reads or writes: [a, a + n) inside one allocation, the
 * stream's device's memory (or, where `host` allows, pinned host memory,
 * which the driver maps at the same address); anything else is laden's
 * bug, or memory freed before the kernel ran. */
static void kernel_memory(const char *what, u64 a, u64 n, int dev, int host)
{
    range *r = find((const void *)(uintptr_t)a, n ? n : 1);
    const char *why = !r ? "not inside one allocation (or freed before the "
                           "kernel ran)"
                      : r->kind == DEVICE && r->dev != dev
                          ? "another device's memory"
                      : r->kind != DEVICE && !(host && r->kind == PINNED)
                          ? "host memory"
                          : NULL;
    if (why) {
        fprintf(stderr, "fake_cuda: a kernel's %s (%llu bytes at %#llx) is "
                        "%s\n", what, (unsigned long long)n,
                (unsigned long long)a, why);
        abort();
    }
}

/* The lossless decoder's launch, as the kernel does it (expand.c's
 * laden_ll_decode): the table from the code lengths, then every
 * sub-chunk; any damage sets *err. */
static void run_lossless(const ex_ll_params *p, int dev)
{
    u64 sub = (u64)p->nsub;
    kernel_memory("code lengths", p->lens, 256, dev, 0);
    kernel_memory("raw bytes", p->raw, p->n, dev, 0);
    kernel_memory("sub-chunk offsets", p->offs, 8 * sub, dev, 0);
    kernel_memory("checks", p->sums, 4 * sub, dev, 0);
    kernel_memory("lane offsets", p->lanes, 64 * sub, dev, 0);
    /* whole 64-bit words, and the padding word after them */
    kernel_memory("bitstream", p->bits, 8 * ((p->nbits + 63) / 64 + 1), dev,
                  0);
    if (p->vec && (p->offs % 8 || p->sums % 8 || p->lanes % 8 ||
                   p->bits % 8)) {
        fprintf(stderr, "fake_cuda: a lossless launch for 8-byte loads "
                        "with its tables off 8 bytes\n");
        abort();
    }
    kernel_memory("output", p->dst, 2 * p->n, dev, 0);
    if (p->err)
        kernel_memory("damage word", p->err, 4, dev, 1);
    static u16 lut[EX_LL_LUT];
    ex_ll_canon c;
    for (u32 k = 0; k < 256u; k++)
        ex_ll_canon_len(p, &c, k);
    for (u32 l = 0; l <= (u32)EX_LL_BITS; l++)
        ex_ll_canon_count(&c, l);
    u32 bad = ex_ll_canon_start(&c);
    if (!bad) {
        for (u32 k = 0; k < 256u; k++)
            ex_ll_canon_place(&c, k);
        for (u32 i = 0; i < (u32)EX_LL_LUT; i++)
            lut[i] = (u16)ex_ll_entry(&c, i);
        for (u64 i = 0; i < sub; i++)
            bad |= ex_ll_sub(p, lut, i);
    }
    if (bad && p->err)
        ex_st32(p->err, 1u);
}

static void run_kernel(const copy *c, int dev)
{
    if (c->op == OP_LOSSLESS) {
        run_lossless(&c->arg.ll, dev);
        return;
    }
    const ex_params *p = &c->arg.ex;
    if (c->vec && (p->src % 16 || p->dst % 16)) {
        fprintf(stderr, "fake_cuda: an expansion kernel of 16-byte "
                        "accesses launched on memory off 16 bytes\n");
        abort();
    }
    kernel_memory("source", p->src, 1, dev, 0);
    kernel_memory("output", p->dst, p->n * (p->out == EX_OUT_F32 ? 4 : 2),
                  dev, 0);
    if (p->scale)
        kernel_memory("scale", p->scale, 4, dev, 0);
    ex_loop(p, 0, 1, p->fmt, c->vec);
}

/* NVRTC: any source "compiles" into an image only this driver loads. */
static const char image[] = "fake_cuda: laden's kernels in C";
typedef struct nvrtc_prog { int magic; } nvrtc_prog;
int nvrtcVersion(int *major, int *minor);
int nvrtcVersion(int *major, int *minor)
{
    *major = 12;
    *minor = 4;
    return 0;
}
int nvrtcCreateProgram(nvrtc_prog **prog, const char *src, const char *name,
                       int nh, const char *const *h, const char *const *hn);
int nvrtcCreateProgram(nvrtc_prog **prog, const char *src, const char *name,
                       int nh, const char *const *h, const char *const *hn)
{
    if (!strstr(src, "laden_ll_decode"))
        return 3; /* NVRTC_ERROR_INVALID_INPUT: not laden's kernels */
    *prog = calloc(1, sizeof **prog);
    return *prog ? 0 : 1;
}
int nvrtcCompileProgram(nvrtc_prog *prog, int n, const char *const *opts);
int nvrtcCompileProgram(nvrtc_prog *prog, int n, const char *const *opts)
{
    return 0;
}
int nvrtcGetProgramLogSize(nvrtc_prog *prog, size_t *n);
int nvrtcGetProgramLogSize(nvrtc_prog *prog, size_t *n)
{
    *n = 1;
    return 0;
}
int nvrtcGetProgramLog(nvrtc_prog *prog, char *log);
int nvrtcGetProgramLog(nvrtc_prog *prog, char *log)
{
    *log = 0;
    return 0;
}
int nvrtcGetPTXSize(nvrtc_prog *prog, size_t *n);
int nvrtcGetPTXSize(nvrtc_prog *prog, size_t *n)
{
    *n = sizeof image;
    return 0;
}
int nvrtcGetPTX(nvrtc_prog *prog, char *ptx);
int nvrtcGetPTX(nvrtc_prog *prog, char *ptx)
{
    memcpy(ptx, image, sizeof image);
    return 0;
}
int nvrtcDestroyProgram(nvrtc_prog **prog);
int nvrtcDestroyProgram(nvrtc_prog **prog)
{
    free(*prog);
    *prog = NULL;
    return 0;
}

/* The module: one for every load (laden keeps its modules to the end, as
 * the driver lets it); a function is its kernel's kind. */
static int fmodule;
typedef struct ffunc { int op; unsigned vec; } ffunc;
static const ffunc ll_func = {OP_LOSSLESS, 0};
static const ffunc ex_funcs[2] = {{OP_EXPAND, 0}, {OP_EXPAND, 1}};

static CUresult cuModuleLoadData(void **m, const void *img)
{
    if (!current_ctx)
        return INVALID_CONTEXT;
    if (getenv("FAKE_CUDA_NO_KERNELS"))
        return NOT_SUPPORTED;
    if (strcmp(img, image) != 0)
        return 218; /* CUDA_ERROR_INVALID_PTX */
    *m = &fmodule;
    return 0;
}
static CUresult cuModuleUnload(void *m)
{
    return m == &fmodule ? 0 : INVALID_HANDLE;
}
static CUresult cuModuleGetFunction(const ffunc **f, void *m, const char *name)
{
    size_t n = strlen(name);
    if (m != &fmodule)
        return INVALID_HANDLE;
    if (strcmp(name, "laden_ll_decode") == 0)
        *f = &ll_func;
    else if (strncmp(name, "laden_ex_", 9) == 0 && n > 11 &&
             name[n - 2] == '_' && (name[n - 1] == 'b' || name[n - 1] == 'v'))
        *f = &ex_funcs[name[n - 1] == 'v'];
    else
        return 500; /* CUDA_ERROR_NOT_FOUND */
    return 0;
}
static CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(
    int *blocks, const ffunc *f, int threads, size_t shared)
{
    *blocks = 4;
    return 0;
}
/* Queued on the stream as its next work, the argument copied (the
 * caller's goes when the call returns). */
static CUresult launch(const ffunc *f, stream *s, void **params)
{
    if (!s)
        return INVALID_CONTEXT;
    if (!f || !params || !params[0])
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    copy *c = calloc(1, sizeof *c);
    c->op = f->op;
    c->vec = f->vec;
    if (f->op == OP_LOSSLESS)
        memcpy(&c->arg.ll, params[0], sizeof c->arg.ll);
    else
        memcpy(&c->arg.ex, params[0], sizeof c->arg.ex);
    if (s->tail)
        s->tail->next = c;
    else
        s->head = c;
    s->tail = c;
    s->queued++;
    return 0;
}
static CUresult cuLaunchKernel(const ffunc *f, unsigned gx, unsigned gy,
                               unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, void *s,
                               void **params, void **extra)
{
    if (!gx || !bx)
        return 1; /* CUDA_ERROR_INVALID_VALUE: an empty grid */
    LOCKED(launch(f, of(s), params));
}

enum { PINNED_SKEW = 512 }; /* off a page, as the driver packs them */
static CUresult alloc(void **p, size_t n, size_t align, int kind)
{
    if (!current_ctx)
        return INVALID_CONTEXT;
    if (n > (16ull << 30)) /* more than the device has (cuMemGetInfo): as
                              the driver, refused (not asked of malloc,
                              which ASan aborts for sizes past its own) */
        return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    size_t skew = kind == PINNED ? PINNED_SKEW : 0;
    char *m = aligned_alloc(align, (n + skew + align - 1) / align * align);
    if (!m)
        return 2;
    m += skew;
    memset(m, 0xab, n); /* not what any checkpoint holds */
    track(m, n, kind);
    *(kind == DEVICE ? &live_device : &live_pinned) += 1;
    *p = m;
    return 0;
}
static CUresult release(void *p, int kind)
{
    range *r = find(p, 1);
    if (!r || r->p != p || r->kind != kind)
        return 1; /* CUDA_ERROR_INVALID_VALUE: not such an allocation */
    run_all(); /* a free waits for the work in flight */
    untrack(p);
    free((char *)p - (kind == PINNED ? PINNED_SKEW : 0));
    *(kind == DEVICE ? &live_device : &live_pinned) -= 1;
    return 0;
}
static CUresult cuMemAlloc(CUdeviceptr *p, size_t n)
{
    LOCKED(alloc((void **)p, n, 256, DEVICE));
}
static CUresult cuMemFree(CUdeviceptr p)
{
    LOCKED(release((void *)(uintptr_t)p, DEVICE));
}
static CUresult cuMemHostAlloc(void **p, size_t n, unsigned f)
{
    (void)f;
    LOCKED(alloc(p, n, 4096, PINNED));
}
static CUresult cuMemFreeHost(void *p) { LOCKED(release(p, PINNED)); }

static CUresult host_register(void *p, size_t n)
{
    if (!current_ctx)
        return INVALID_CONTEXT;
    for (range *r = ranges; r; r = r->next)
        if (r->kind != DEVICE && (char *)p < r->p + r->n &&
            r->p < (char *)p + n)
            return ALREADY_REGISTERED; /* pinned for every context */
    track(p, n, REGISTERED);
    return 0;
}
static CUresult cuMemHostRegister(void *p, size_t n, unsigned f)
{
    (void)f;
    LOCKED(host_register(p, n));
}
static CUresult host_unregister(void *p)
{
    range *r = find(p, 1);
    if (!r || r->kind != REGISTERED || r->p != p)
        return NOT_REGISTERED;
    run_all();
    untrack(p);
    return 0;
}
static CUresult cuMemHostUnregister(void *p) { LOCKED(host_unregister(p)); }

/* Which device memory is on (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL), and
 * which context a stream is of: for tests to check where laden put work. */
static CUresult pointer_ordinal(void *out, int attr, CUdeviceptr p)
{
    range *r = find((void *)(uintptr_t)p, 1);
    if (attr != 9)
        return NOT_SUPPORTED;
    if (!r || r->kind != DEVICE)
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    *(int *)out = r->dev;
    return 0;
}
static CUresult cuPointerGetAttribute(void *out, int attr, CUdeviceptr p)
{
    LOCKED(pointer_ordinal(out, attr, p));
}
static CUresult stream_ctx(void *sv, void **ctx)
{
    stream *s = of(sv);
    if (!s)
        return INVALID_CONTEXT;
    *ctx = &ctxs[s->dev];
    return 0;
}
static CUresult cuStreamGetCtx(void *s, void **ctx) { LOCKED(stream_ctx(s, ctx)); }

static CUresult not_supported(void) { return NOT_SUPPORTED; }
static CUresult cuStreamIsCapturing(void *s, int *status)
{
    (void)s;
    *status = 0; /* never capturing: graphs are not emulated */
    return 0;
}
static CUresult cuGetErrorName(CUresult r, const char **s)
{
    *s = r == NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED" : "CUDA_ERROR_FAKE";
    return 0;
}
static CUresult cuGetErrorString(CUresult r, const char **s)
{
    (void)r;
    *s = "not emulated by tests/fake_cuda.c";
    return 0;
}

CUresult cuGetProcAddress_v2(const char *name, void **fn, int version,
                             uint64_t flags, int *status);
CUresult cuGetProcAddress_v2(const char *name, void **fn, int version,
                             uint64_t flags, int *status)
{
    (void)version;
    (void)flags;
    if (status)
        *status = 0;
#define ENTRY(f)                                                           \
    if (strcmp(name, #f) == 0) {                                           \
        *fn = (void *)(uintptr_t)f;                                        \
        return 0;                                                          \
    }
    ENTRY(cuInit) ENTRY(cuDriverGetVersion) ENTRY(cuDeviceGetCount)
    ENTRY(cuDeviceGet) ENTRY(cuDeviceGetName) ENTRY(cuDeviceTotalMem)
    ENTRY(cuDeviceGetAttribute) ENTRY(cuDevicePrimaryCtxRetain)
    ENTRY(cuCtxGetCurrent) ENTRY(cuCtxSetCurrent) ENTRY(cuMemGetInfo)
    ENTRY(cuStreamCreate) ENTRY(cuStreamDestroy) ENTRY(cuStreamSynchronize)
    ENTRY(cuStreamWaitEvent) ENTRY(cuEventCreate) ENTRY(cuEventDestroy)
    ENTRY(cuEventRecord) ENTRY(cuEventSynchronize) ENTRY(cuEventQuery)
    ENTRY(cuEventElapsedTime) ENTRY(cuMemcpyHtoDAsync)
    ENTRY(cuMemcpyDtoHAsync) ENTRY(cuMemcpyDtoDAsync) ENTRY(cuMemAlloc)
    ENTRY(cuMemFree) ENTRY(cuMemHostAlloc) ENTRY(cuMemFreeHost)
    ENTRY(cuMemHostRegister) ENTRY(cuMemHostUnregister)
    ENTRY(cuGetErrorName) ENTRY(cuGetErrorString) ENTRY(cuStreamIsCapturing)
    ENTRY(cuPointerGetAttribute) ENTRY(cuStreamGetCtx)
    ENTRY(cuModuleLoadData) ENTRY(cuModuleUnload) ENTRY(cuModuleGetFunction)
    ENTRY(cuOccupancyMaxActiveBlocksPerMultiprocessor) ENTRY(cuLaunchKernel)
#undef ENTRY
    *fn = (void *)(uintptr_t)not_supported; /* VMM: not emulated */
    return 0;
}

__attribute__((destructor)) static void leaks(void)
{
    if (live_events || live_streams || live_device || live_pinned) {
        fprintf(stderr, "fake_cuda: left at exit: %ld events, %ld streams, "
                        "%ld device and %ld pinned allocations\n",
                live_events, live_streams, live_device, live_pinned);
        _exit(3);
    }
}
