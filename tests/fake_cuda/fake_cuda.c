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
 *  - Events, streams, device and pinned allocations left at exit make the
 *    process exit with status 3 (a leak).
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

enum { DEVICE = 0, PINNED = 1 };

typedef struct range {
    struct range *next;
    char *p;
    size_t n;
    int kind;
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
} stream;

typedef struct event {
    int magic;
    stream *s;
    unsigned long long at; /* s->queued when recorded */
    int recorded;
    double t_ms; /* host clock when recorded: its "time" on the device */
} event;

#define EVENT_MAGIC 0x5eed
#define MAX_STREAMS 1024

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static range *ranges;
static stream legacy; /* stream 0 */
static stream *streams[MAX_STREAMS];
static long live_events, live_streams, live_device, live_pinned;
static __thread void *current_ctx;

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
    run_until(&legacy, legacy.queued);
    for (int i = 0; i < MAX_STREAMS; i++)
        if (streams[i])
            run_until(streams[i], streams[i]->queued);
}

static stream *of(void *s) { return s ? s : &legacy; }

/* A copy on stream s: deferred when the host side is pinned. */
static CUresult enqueue(void *dst, const void *src, size_t n, void *sv,
                        int deferred)
{
    stream *s = of(sv);
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
    return r && r->kind == PINNED;
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
static CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
static CUresult cuDeviceGet(int *d, int i) { *d = i; return 0; }
static CUresult cuDeviceGetName(char *name, int len, int d)
{
    (void)d;
    snprintf(name, (size_t)len, "fake_cuda");
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
    (void)d;
    *ctx = (void *)0x1;
    return 0;
}
static CUresult cuCtxGetCurrent(void **ctx) { *ctx = current_ctx; return 0; }
static CUresult cuCtxSetCurrent(void *ctx) { current_ctx = ctx; return 0; }
static CUresult cuMemGetInfo(size_t *fr, size_t *total)
{
    *fr = 15ull << 30;
    *total = 16ull << 30;
    return 0;
}

static CUresult stream_create(void **out)
{
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!streams[i]) {
            streams[i] = calloc(1, sizeof **streams);
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
static CUresult cuStreamSynchronize(void *s) { LOCKED(stream_sync(of(s))); }

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
    event *e = calloc(1, sizeof *e);
    e->magic = EVENT_MAGIC;
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
    if (!e || e->magic != EVENT_MAGIC)
        return INVALID_HANDLE;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    e->s = s;
    e->at = s->queued;
    e->recorded = 1;
    e->t_ms = (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
    return 0;
}
static CUresult cuEventRecord(void *e, void *s) { LOCKED(event_record(e, of(s))); }
/* The time between the two records on the host clock: work queued in
 * order is timed in order. */
static CUresult event_elapsed(float *ms, event *a, event *b)
{
    if (!a || !b || a->magic != EVENT_MAGIC || b->magic != EVENT_MAGIC)
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

static CUresult alloc(void **p, size_t n, size_t align, int kind)
{
    void *m = aligned_alloc(align, (n + align - 1) / align * align);
    if (!m)
        return 2;
    memset(m, 0xab, n); /* not what any checkpoint holds */
    track(m, n, kind);
    *(kind == DEVICE ? &live_device : &live_pinned) += 1;
    *p = m;
    return 0;
}
static CUresult release(void *p, int kind)
{
    run_all(); /* a free waits for the work in flight */
    untrack(p);
    free(p);
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
    track(p, n, PINNED);
    return 0;
}
static CUresult cuMemHostRegister(void *p, size_t n, unsigned f)
{
    (void)f;
    LOCKED(host_register(p, n));
}
static CUresult host_unregister(void *p)
{
    run_all();
    untrack(p);
    return 0;
}
static CUresult cuMemHostUnregister(void *p) { LOCKED(host_unregister(p)); }

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
