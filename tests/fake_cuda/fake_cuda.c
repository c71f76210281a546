/* A stand-in libcuda.so.1 for CI machines without a GPU, so that laden's
 * CUDA paths (staging, pinned homes, events between streams) run on every
 * CI run.  Device memory is host memory.  What it checks:
 *  - A copy between device memory and pinned host memory is deferred
 *    until something waits for it (a stream or event synchronize, a wait
 *    of another stream on a recorded event, a free): code that reuses a
 *    staging buffer, or frees memory, before its copy ran gets wrong bytes
 *    or an abort here, as it would on a GPU only sometimes.  Copies from
 *    pageable memory run at once, as the driver stages them.
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
 * VMM entry points are not emulated (they fail): run only the tests that
 * do not use VRAM contexts (see the Makefile's test-fake-cuda).
 * Failures on demand, while the variable is set in the environment:
 * FAKE_CUDA_FAIL_D2H (cuMemcpyDtoHAsync), FAKE_CUDA_FAIL_EVENT_SYNC
 * (cuEventSynchronize and cuEventQuery). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

typedef struct copy {
    struct copy *next;
    char *dst;
    const char *src;
    size_t n;
} copy;

typedef struct stream {
    copy *head, *tail;
    unsigned long long queued, done; /* copies */
    int dev;
} stream;

typedef struct event {
    int magic;
    stream *s;
    unsigned long long at; /* s->queued when recorded */
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
        ctxs[i].dev = ctxs[i].legacy.dev = i;
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

static void run_one(stream *s)
{
    copy *c = s->head;
    s->head = c->next;
    if (!s->head)
        s->tail = NULL;
    if (!find(c->dst, c->n) || !find(c->src, c->n)) {
        fprintf(stderr, "fake_cuda: a deferred copy of %zu bytes touches "
                        "memory freed before it ran\n", c->n);
        abort();
    }
    memcpy(c->dst, c->src, c->n);
    s->done++;
    free(c);
}

static void run_until(stream *s, unsigned long long n)
{
    while (s->done < n)
        run_one(s);
}

static void run_all(void)
{
    for (int i = 0; i < MAX_DEVICES; i++)
        run_until(&ctxs[i].legacy, ctxs[i].legacy.queued);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i])
            run_until(streams[i], streams[i]->queued);
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
    if (!deferred) {
        run_until(s, s->queued);
        memcpy(dst, src, n);
        return 0;
    }
    copy *c = calloc(1, sizeof *c);
    c->dst = dst;
    c->src = src;
    c->n = n;
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
    if (!current_ctx)
        return INVALID_CONTEXT;
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i]) {
            streams[i] = calloc(1, sizeof **streams);
            streams[i]->dev = current_ctx->dev;
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
    run_until(s, s->queued);
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
    if (e->recorded)
        run_until(e->s, e->at);
    return 0;
}
static CUresult cuStreamWaitEvent(void *s, void *e, unsigned f)
{
    (void)s;
    (void)f;
    LOCKED(event_wait(e));
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

enum { PINNED_SKEW = 512 }; /* off a page, as the driver packs them */
static CUresult alloc(void **p, size_t n, size_t align, int kind)
{
    if (!current_ctx)
        return INVALID_CONTEXT;
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
