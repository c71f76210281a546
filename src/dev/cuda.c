/* The CUDA device.  libcuda.so.1 is opened at run time; cuGetProcAddress
 * resolves every entry point for the driver API version we were written
 * against, so the right _v2 variants come back without naming them.  Work
 * runs in each device's primary context, shared with PyTorch. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_api.h"
#include "dev_internal.h"

#define LADEN_CUDA_API_VERSION 12000
#define MAX_DEVICES 64

static struct {
#define FIELD(name, args) CUresult (*name) args;
    LADEN_CUDA_FUNCS(FIELD)
#undef FIELD
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
} cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int32_t device_count;
char laden__cuda_error[512];
laden__cuda_kernel_fns laden__cuk;
char laden__cuda_kernel_error[256] = "the CUDA driver is not loaded";

static struct cuda_dev {
    atomic_int ready;
    CUdevice dev;
    CUcontext ctx;
    CUresult err;
    size_t granularity;
    int vmm;
} devs[MAX_DEVICES];

static void load(void)
{
    const char *off = getenv("LADEN_DISABLE_CUDA");
    if (off && *off && strcmp(off, "0") != 0) {
        snprintf(laden__cuda_error, sizeof laden__cuda_error,
                 "disabled by LADEN_DISABLE_CUDA");
        return;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(laden__cuda_error, sizeof laden__cuda_error,
                 "cannot load libcuda.so.1 (no NVIDIA driver?): %s",
                 dlerror());
        return;
    }
    typedef CUresult (*gpa_v2_t)(const char *, void **, int, uint64_t, int *);
    typedef CUresult (*gpa_t)(const char *, void **, int, uint64_t);
    gpa_v2_t gpa2 = (gpa_v2_t)(uintptr_t)dlsym(lib, "cuGetProcAddress_v2");
    gpa_t gpa1 = (gpa_t)(uintptr_t)dlsym(lib, "cuGetProcAddress");
    if (!gpa2 && !gpa1) {
        snprintf(laden__cuda_error, sizeof laden__cuda_error,
                 "libcuda.so.1 has no cuGetProcAddress (driver too old; "
                 "CUDA 12 or newer is needed)");
        return;
    }
#define PROC(name, fn, r)                                                   \
    do {                                                                    \
        int qs = 0;                                                         \
        r = gpa2 ? gpa2(name, &fn, LADEN_CUDA_API_VERSION, 0, &qs)          \
                 : gpa1(name, &fn, LADEN_CUDA_API_VERSION, 0);              \
    } while (0)
#define RESOLVE_ONE(name, ptr)                                              \
    do {                                                                    \
        void *fn = NULL;                                                    \
        CUresult r;                                                         \
        PROC(#name, fn, r);                                                 \
        if (r != CUDA_SUCCESS || !fn) {                                     \
            snprintf(laden__cuda_error, sizeof laden__cuda_error,           \
                     "the CUDA driver lacks %s (error %d)", #name, r);      \
            return;                                                         \
        }                                                                   \
        memcpy(&(ptr), &fn, sizeof fn);                                     \
    } while (0)
#define RESOLVE_FIELD(name, args) RESOLVE_ONE(name, cu.name);
    LADEN_CUDA_FUNCS(RESOLVE_FIELD)
#undef RESOLVE_FIELD
    RESOLVE_ONE(cuGetErrorName, cu.cuGetErrorName);
    RESOLVE_ONE(cuGetErrorString, cu.cuGetErrorString);
#undef RESOLVE_ONE
    /* Optional: the first one missing is the reason expansion cannot run. */
    laden__cuda_kernel_error[0] = 0;
#define RESOLVE_KERNEL(name, args)                                          \
    if (!laden__cuda_kernel_error[0]) {                                     \
        void *fn = NULL;                                                    \
        CUresult r;                                                         \
        PROC(#name, fn, r);                                                 \
        if (r != CUDA_SUCCESS || !fn)                                       \
            snprintf(laden__cuda_kernel_error,                              \
                     sizeof laden__cuda_kernel_error,                       \
                     "the CUDA driver lacks %s (error %d), which device "   \
                     "expansion needs", #name, r);                          \
        else                                                                \
            memcpy(&laden__cuk.name, &fn, sizeof fn);                       \
    }
    LADEN_CUDA_KERNEL_FUNCS(RESOLVE_KERNEL)
#undef RESOLVE_KERNEL
#undef PROC
    CUresult r = cu.cuInit(0);
    int n = 0;
    if (r == CUDA_SUCCESS)
        r = cu.cuDeviceGetCount(&n);
    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        cu.cuGetErrorName(r, &name);
        snprintf(laden__cuda_error, sizeof laden__cuda_error,
                 "cuInit failed: %s", name);
        return;
    }
    if (n == 0)
        snprintf(laden__cuda_error, sizeof laden__cuda_error,
                 "the CUDA driver sees no device");
    device_count = n > MAX_DEVICES ? MAX_DEVICES : n;
}

int32_t laden__cuda_load(void)
{
    pthread_once(&load_once, load);
    return device_count;
}

static laden_status check(CUresult r, int32_t dev, const char *call)
{
    if (r == CUDA_SUCCESS)
        return LADEN_OK;
    const char *name = "CUDA_ERROR_UNKNOWN", *msg = "";
    cu.cuGetErrorName(r, &name);
    cu.cuGetErrorString(r, &msg);
    laden_status st = r == CUDA_ERROR_OUT_OF_MEMORY   ? LADEN_E_DEVICE_NOMEM
                      : r == CUDA_ERROR_INVALID_VALUE ? LADEN_E_INVAL
                                                      : LADEN_E_DEVICE;
    return laden__fail(st, "cuda:%d: %s failed: %s (%s)", dev, call, name,
                       msg);
}

/* Per-device state, set up on first use of the device. */
static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;

static void init_dev(int32_t index)
{
    struct cuda_dev *d = &devs[index];
    CUresult r = cu.cuDeviceGet(&d->dev, index);
    if (r == CUDA_SUCCESS)
        r = cu.cuDevicePrimaryCtxRetain(&d->ctx, d->dev);
    d->err = r;
    if (r != CUDA_SUCCESS)
        return;
    cu.cuDeviceGetAttribute(
        &d->vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        d->dev);
    if (d->vmm) {
        CUmemAllocationProp prop = {0};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = d->dev;
        if (cu.cuMemGetAllocationGranularity(&d->granularity, &prop,
                                             CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
                CUDA_SUCCESS ||
            d->granularity == 0)
            d->vmm = 0;
    }
}

/* Makes the device's primary context current on this thread for one call,
 * remembering the caller's.  The caller's context is put back when the
 * call returns (laden__cuda_leave, or the scope ENTER declares): the CUDA
 * runtime reads its current device from the driver's current context, so
 * a context left switched would move PyTorch's current device, and with
 * it every allocation on "cuda" without an index, to laden's device.  On
 * one GPU the contexts agree and nothing is switched. */
laden_status laden__cuda_enter(int32_t dev, laden__cuda_scope *sc)
{
    struct cuda_dev *d = &devs[dev];
    sc->prev = NULL;
    sc->switched = 0;
    if (!atomic_load_explicit(&d->ready, memory_order_acquire)) {
        pthread_mutex_lock(&init_mu);
        if (!atomic_load_explicit(&d->ready, memory_order_relaxed)) {
            init_dev(dev);
            atomic_store_explicit(&d->ready, 1, memory_order_release);
        }
        pthread_mutex_unlock(&init_mu);
    }
    if (d->err != CUDA_SUCCESS)
        return check(d->err, dev, "cuDevicePrimaryCtxRetain");
    CUcontext cur = NULL;
    CUresult r = cu.cuCtxGetCurrent(&cur);
    if (r != CUDA_SUCCESS)
        return check(r, dev, "cuCtxGetCurrent");
    if (cur == d->ctx)
        return LADEN_OK;
    if ((r = cu.cuCtxSetCurrent(d->ctx)) != CUDA_SUCCESS)
        return check(r, dev, "cuCtxSetCurrent");
    sc->prev = cur;
    sc->switched = 1;
    return LADEN_OK;
}

void laden__cuda_leave(laden__cuda_scope *sc)
{
    if (sc->switched)
        cu.cuCtxSetCurrent(sc->prev);
    sc->switched = 0;
}

/* The device's context for the rest of the enclosing function: the
 * caller's is put back on every return. */
#define SCOPE                                                                  __attribute__((cleanup(laden__cuda_leave))) laden__cuda_scope scope_ =         {NULL, 0}
#define ENTER(dev)                                                             SCOPE;                                                                     do {                                                                           laden_status es = laden__cuda_enter(dev, &scope_);                         if (es)                                                                        return es;                                                         } while (0)
/* For the calls that return nothing: false when the device is unusable. */
#define ENTERED(dev) (laden__cuda_enter(dev, &scope_) == LADEN_OK)

static laden_status cuda_info(int32_t dev, laden_dev_info_t *out)
{
    ENTER(dev);
    struct cuda_dev *d = &devs[dev];
    size_t total = 0;
    out->device = dev;
    out->kind = LADEN_DEV_KIND_CUDA;
    laden_status st = check(cu.cuDeviceGetName(out->name, sizeof out->name,
                                               d->dev),
                            dev, "cuDeviceGetName");
    if (!st)
        st = check(cu.cuDeviceTotalMem(&total, d->dev), dev,
                   "cuDeviceTotalMem");
    if (st)
        return st;
    out->total_bytes = total;
    cu.cuDeviceGetAttribute(&out->cc_major,
                            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                            d->dev);
    cu.cuDeviceGetAttribute(&out->cc_minor,
                            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                            d->dev);
    out->vmm_supported = d->vmm;
    out->vmm_granularity_bytes = d->granularity;
    return LADEN_OK;
}

static laden_status cuda_mem_info(int32_t dev, uint64_t *fr, uint64_t *total)
{
    size_t f = 0, t = 0;
    ENTER(dev);
    laden_status st = check(cu.cuMemGetInfo(&f, &t), dev, "cuMemGetInfo");
    *fr = f;
    *total = t;
    return st;
}

static laden_status cuda_stream_create(int32_t dev, void **out)
{
    CUstream s = NULL;
    ENTER(dev);
    laden_status st = check(cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), dev,
                            "cuStreamCreate");
    *out = s;
    return st;
}

static laden_status cuda_stream_wrap(int32_t dev, uintptr_t h, void **out)
{
    ENTER(dev);
    *out = (void *)h; /* 0 is the legacy default stream, which is valid */
    return LADEN_OK;
}

static void cuda_stream_destroy(int32_t dev, void *s, bool owned)
{
    SCOPE;
    if (!owned || !ENTERED(dev))
        return;
    cu.cuStreamSynchronize(s);
    cu.cuStreamDestroy(s);
}

static laden_status cuda_stream_sync(int32_t dev, void *s)
{
    ENTER(dev);
    return check(cu.cuStreamSynchronize(s), dev, "cuStreamSynchronize");
}

static laden_status cuda_stream_wait_event(int32_t dev, void *s, void *e)
{
    ENTER(dev);
    return check(cu.cuStreamWaitEvent(s, e, 0), dev, "cuStreamWaitEvent");
}

static laden_status cuda_stream_capturing(int32_t dev, void *s, int *out)
{
    int st = CU_STREAM_CAPTURE_STATUS_NONE;
    ENTER(dev);
    laden_status r = check(cu.cuStreamIsCapturing(s, &st), dev,
                           "cuStreamIsCapturing");
    *out = st != CU_STREAM_CAPTURE_STATUS_NONE;
    return r;
}

/* Thread-local mode: other threads' calls (the reader pool, the gradient
 * sink's workers) are not part of the capture and are not refused. */
static laden_status cuda_capture_begin(int32_t dev, void *s)
{
    ENTER(dev);
    return check(cu.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                 dev, "cuStreamBeginCapture");
}

/* The graph of a capture, instantiated: *out is its executable. */
static laden_status cuda_capture_end(int32_t dev, void *s, void **out)
{
    CUgraph g = NULL;
    CUgraphExec e = NULL;
    ENTER(dev);
    laden_status r = check(cu.cuStreamEndCapture(s, &g), dev,
                           "cuStreamEndCapture");
    if (!r)
        r = check(cu.cuGraphInstantiateWithFlags(&e, g, 0), dev,
                  "cuGraphInstantiateWithFlags");
    if (g)
        cu.cuGraphDestroy(g); /* the executable keeps what it needs */
    *out = r ? NULL : e;
    return r;
}

static laden_status cuda_graph_launch(int32_t dev, void *g, void *s)
{
    ENTER(dev);
    return check(cu.cuGraphLaunch(g, s), dev, "cuGraphLaunch");
}

static void cuda_graph_destroy(int32_t dev, void *g)
{
    SCOPE;
    if (ENTERED(dev))
        cu.cuGraphExecDestroy(g);
}

static laden_status cuda_event_create(int32_t dev, int timing, void **out)
{
    CUevent e = NULL;
    ENTER(dev);
    laden_status st = check(
        cu.cuEventCreate(&e, timing ? CU_EVENT_DEFAULT
                                    : CU_EVENT_DISABLE_TIMING),
        dev, "cuEventCreate");
    *out = e;
    return st;
}

static void cuda_event_destroy(int32_t dev, void *e)
{
    SCOPE;
    if (ENTERED(dev))
        cu.cuEventDestroy(e);
}

static laden_status cuda_event_record(int32_t dev, void *e, void *s)
{
    ENTER(dev);
    return check(cu.cuEventRecord(e, s), dev, "cuEventRecord");
}

static laden_status cuda_event_sync(int32_t dev, void *e)
{
    ENTER(dev);
    return check(cu.cuEventSynchronize(e), dev, "cuEventSynchronize");
}

static laden_status cuda_event_query(int32_t dev, void *e, int *done)
{
    ENTER(dev);
    CUresult r = cu.cuEventQuery(e);
    if (r == CUDA_ERROR_NOT_READY) {
        *done = 0;
        return LADEN_OK;
    }
    *done = r == CUDA_SUCCESS;
    return check(r, dev, "cuEventQuery");
}

static laden_status cuda_event_elapsed(int32_t dev, void *a, void *b,
                                       float *ms)
{
    ENTER(dev);
    return check(cu.cuEventElapsedTime(ms, a, b), dev, "cuEventElapsedTime");
}

static laden_status cuda_copy_h2d(int32_t dev, void *s, laden_devptr_t dst,
                                  const void *src, uint64_t n)
{
    ENTER(dev);
    return check(cu.cuMemcpyHtoDAsync(dst, src, (size_t)n, s), dev,
                 "cuMemcpyHtoDAsync");
}

static laden_status cuda_copy_d2h(int32_t dev, void *s, void *dst,
                                  laden_devptr_t src, uint64_t n)
{
    ENTER(dev);
    return check(cu.cuMemcpyDtoHAsync(dst, src, (size_t)n, s), dev,
                 "cuMemcpyDtoHAsync");
}

static laden_status cuda_copy_d2d(int32_t dev, void *s, laden_devptr_t dst,
                                  laden_devptr_t src, uint64_t n)
{
    ENTER(dev);
    return check(cu.cuMemcpyDtoDAsync(dst, src, (size_t)n, s), dev,
                 "cuMemcpyDtoDAsync");
}

static laden_status cuda_mem_alloc(int32_t dev, uint64_t n,
                                   laden_devptr_t *out)
{
    CUdeviceptr p = 0;
    ENTER(dev);
    laden_status st = check(cu.cuMemAlloc(&p, (size_t)n), dev, "cuMemAlloc");
    if (st)
        laden__error_prefix("allocating %s", laden__bytes(n).s);
    *out = p;
    return st;
}

static laden_status cuda_mem_free(int32_t dev, laden_devptr_t p)
{
    ENTER(dev);
    return check(cu.cuMemFree(p), dev, "cuMemFree");
}

/* laden_dev_host_alloc hands out whole 4 KiB pages: reads with O_DIRECT
 * land in place only at them (the host arena's staging buffers and
 * homes).  The driver does not promise it: it packs allocations together,
 * and on the H200 a 128 KiB one came 512 bytes past a page after a
 * 12-byte one.  Such an allocation is made again a page larger and handed
 * out from its first page boundary; the list maps that address back to
 * the driver's for the free. */
typedef struct skewed_pin {
    void *at, *base;
    struct skewed_pin *next;
} skewed_pin;
static pthread_mutex_t skewed_mu = PTHREAD_MUTEX_INITIALIZER;
static skewed_pin *skewed;

enum { HOST_PAGE = 4096 };

static laden_status cuda_host_alloc(int32_t dev, uint64_t n, void **out)
{
    void *p = NULL;
    ENTER(dev);
    uint64_t len = (n + HOST_PAGE - 1) & ~(uint64_t)(HOST_PAGE - 1);
    skewed_pin *sk = NULL;
    CUresult r = len < n || len > SIZE_MAX - HOST_PAGE
                     ? CUDA_ERROR_OUT_OF_MEMORY
                     : cu.cuMemHostAlloc(&p, (size_t)len,
                                         CU_MEMHOSTALLOC_PORTABLE);
    if (r == CUDA_SUCCESS && (uintptr_t)p % HOST_PAGE) {
        cu.cuMemFreeHost(p);
        p = NULL;
        if (!(sk = malloc(sizeof *sk)))
            return laden__fail(LADEN_E_NOMEM, "out of memory pinning %s",
                               laden__bytes(n).s);
        r = cu.cuMemHostAlloc(&p, (size_t)len + HOST_PAGE,
                              CU_MEMHOSTALLOC_PORTABLE);
    }
    if (r != CUDA_SUCCESS) {
        free(sk);
        check(r, dev, "cuMemHostAlloc");
        laden__error_prefix("cannot pin %s of host memory",
                            laden__bytes(n).s);
        return LADEN_E_NOMEM;
    }
    if (sk) {
        sk->base = p;
        sk->at = (void *)(((uintptr_t)p + HOST_PAGE - 1) &
                          ~(uintptr_t)(HOST_PAGE - 1));
        p = sk->at;
        pthread_mutex_lock(&skewed_mu);
        sk->next = skewed;
        skewed = sk;
        pthread_mutex_unlock(&skewed_mu);
    }
    *out = p;
    return LADEN_OK;
}

static laden_status cuda_host_free(int32_t dev, void *p)
{
    ENTER(dev);
    skewed_pin *sk = NULL;
    pthread_mutex_lock(&skewed_mu);
    for (skewed_pin **at = &skewed; *at; at = &(*at)->next)
        if ((*at)->at == p) {
            sk = *at;
            *at = sk->next;
            break;
        }
    pthread_mutex_unlock(&skewed_mu);
    void *base = sk ? sk->base : p;
    free(sk);
    return check(cu.cuMemFreeHost(base), dev, "cuMemFreeHost");
}

static laden_status cuda_host_register(int32_t dev, void *p, uint64_t n)
{
    ENTER(dev);
    CUresult r = cu.cuMemHostRegister(p, (size_t)n, CU_MEMHOSTREGISTER_PORTABLE);
    if (r != CUDA_SUCCESS) {
        check(r, dev, "cuMemHostRegister");
        laden__error_prefix("cannot pin %s of host memory in place",
                            laden__bytes(n).s);
        return LADEN_E_NOMEM;
    }
    return LADEN_OK;
}

static laden_status cuda_host_unregister(int32_t dev, void *p)
{
    ENTER(dev);
    return check(cu.cuMemHostUnregister(p), dev, "cuMemHostUnregister");
}

static laden_status cuda_va_reserve(int32_t dev, uint64_t n,
                                    laden_devptr_t *out)
{
    CUdeviceptr p = 0;
    ENTER(dev);
    laden_status st = check(
        cu.cuMemAddressReserve(&p, (size_t)n, devs[dev].granularity, 0, 0),
        dev, "cuMemAddressReserve");
    *out = p;
    return st;
}

static laden_status cuda_va_release(int32_t dev, laden_devptr_t va, uint64_t n)
{
    ENTER(dev);
    return check(cu.cuMemAddressFree(va, (size_t)n), dev, "cuMemAddressFree");
}

static laden_status cuda_phys_create(int32_t dev, uint64_t n, laden_phys_t *out)
{
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp prop = {0};
    ENTER(dev);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = devs[dev].dev;
    laden_status st = check(cu.cuMemCreate(&h, (size_t)n, &prop, 0), dev,
                            "cuMemCreate");
    *out = h;
    return st;
}

static laden_status cuda_phys_release(int32_t dev, laden_phys_t p)
{
    ENTER(dev);
    return check(cu.cuMemRelease(p), dev, "cuMemRelease");
}

static laden_status cuda_map(int32_t dev, laden_devptr_t va, uint64_t n,
                             laden_phys_t p)
{
    ENTER(dev);
    laden_status st = check(cu.cuMemMap(va, (size_t)n, 0, p, 0), dev,
                            "cuMemMap");
    if (st)
        return st;
    CUmemAccessDesc desc = {
        .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = devs[dev].dev},
        .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    st = check(cu.cuMemSetAccess(va, (size_t)n, &desc, 1), dev,
               "cuMemSetAccess");
    if (st)
        cu.cuMemUnmap(va, (size_t)n);
    return st;
}

static laden_status cuda_unmap(int32_t dev, laden_devptr_t va, uint64_t n)
{
    ENTER(dev);
    return check(cu.cuMemUnmap(va, (size_t)n), dev, "cuMemUnmap");
}

const laden__dev_ops laden__dev_cuda_ops = {
    .info = cuda_info,
    .mem_info = cuda_mem_info,
    .stream_create = cuda_stream_create,
    .stream_wrap = cuda_stream_wrap,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .stream_wait_event = cuda_stream_wait_event,
    .stream_capturing = cuda_stream_capturing,
    .capture_begin = cuda_capture_begin,
    .capture_end = cuda_capture_end,
    .graph_launch = cuda_graph_launch,
    .graph_destroy = cuda_graph_destroy,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_sync = cuda_event_sync,
    .event_query = cuda_event_query,
    .event_elapsed = cuda_event_elapsed,
    .copy_h2d = cuda_copy_h2d,
    .copy_d2h = cuda_copy_d2h,
    .copy_d2d = cuda_copy_d2d,
    .mem_alloc = cuda_mem_alloc,
    .mem_free = cuda_mem_free,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .va_reserve = cuda_va_reserve,
    .va_release = cuda_va_release,
    .phys_create = cuda_phys_create,
    .phys_release = cuda_phys_release,
    .map = cuda_map,
    .unmap = cuda_unmap,
};
