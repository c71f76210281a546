/* Device tests.  Each runs on the CPU device and on every CUDA device the
 * machine has, so the same binary is the GPU test suite on a GPU machine. */
#include <pthread.h>

#include "test.h"

#include "laden/dev.h"


static void fill(unsigned char *p, uint64_t n, unsigned seed)
{
    for (uint64_t i = 0; i < n; i++)
        p[i] = (unsigned char)((i * 131 + seed) ^ (i >> 9));
}

static void copies(int32_t dev)
{
    static const uint64_t sizes[] = {1, 4095, 1u << 20, (16u << 20) + 3};
    laden_dev_stream_t *s;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        uint64_t n = sizes[i];
        laden_devptr_t d, d2;
        unsigned char *src, *dst;
        CHECK_OK(laden_dev_mem_alloc(dev, n, &d));
        CHECK_OK(laden_dev_mem_alloc(dev, n, &d2));
        CHECK_OK(laden_dev_host_alloc(dev, n, (void **)&src));
        dst = malloc(n); /* pageable on the way back */
        fill(src, n, (unsigned)i);
        memset(dst, 0, n);
        CHECK_OK(laden_dev_copy_h2d(s, d, src, n));
        CHECK_OK(laden_dev_copy_d2d(s, d2, d, n));
        CHECK_OK(laden_dev_copy_d2h(s, dst, d2, n));
        CHECK_OK(laden_dev_stream_synchronize(s));
        CHECK_EQ(memcmp(src, dst, n), 0);
        CHECK_OK(laden_dev_mem_free(dev, d));
        CHECK_OK(laden_dev_mem_free(dev, d2));
        CHECK_OK(laden_dev_host_free(dev, src));
        free(dst);
    }
    CHECK_OK(laden_dev_copy_h2d(s, 0, NULL, 0)); /* zero bytes: nothing */
    laden_dev_stream_destroy(s);
}

TEST(dev_copies_round_trip) { test_on_every_device(copies); }

/* Pinned host memory starts at a 4 KiB page, however small the
 * allocations before it (the CUDA driver packs them: on the H200 a
 * 128 KiB one came 512 bytes past a page after a 12-byte one, and the
 * reads into it went through the reader's bounce buffer); every byte of
 * it is usable, copied to the device and back, and freed by its own
 * address. */
static void host_pages(int32_t dev)
{
    static const uint64_t sizes[] = {12, 1, 4096, 131072, 4097, 12, 1u << 20};
    enum { N = sizeof sizes / sizeof sizes[0] };
    unsigned char *h[N], *back = malloc(1u << 20);
    laden_dev_stream_t *s;
    laden_devptr_t d;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    CHECK_OK(laden_dev_mem_alloc(dev, 1u << 20, &d));
    for (size_t i = 0; i < N; i++) {
        CHECK_OK(laden_dev_host_alloc(dev, sizes[i], (void **)&h[i]));
        CHECK_EQ((uintptr_t)h[i] % 4096, 0);
        fill(h[i], sizes[i], (unsigned)i + 7);
    }
    for (size_t i = 0; i < N; i++) { /* each whole, after all were made */
        CHECK_OK(laden_dev_copy_h2d(s, d, h[i], sizes[i]));
        CHECK_OK(laden_dev_copy_d2h(s, back, d, sizes[i]));
        CHECK_OK(laden_dev_stream_synchronize(s));
        unsigned char *want = malloc(sizes[i]);
        fill(want, sizes[i], (unsigned)i + 7);
        CHECK_EQ(memcmp(back, want, sizes[i]), 0);
        CHECK_EQ(memcmp(h[i], want, sizes[i]), 0);
        free(want);
    }
    for (size_t i = N; i--;)
        CHECK_OK(laden_dev_host_free(dev, h[i]));
    /* A size whose pages overflow is refused, nothing handed out. */
    void *none = (void *)1;
    CHECK_STATUS(laden_dev_host_alloc(dev, UINT64_MAX - 10, &none),
                 LADEN_E_NOMEM);
    CHECK_CONTAINS(laden_last_error(), "host memory");
    CHECK_EQ(none, NULL);
    CHECK_OK(laden_dev_mem_free(dev, d));
    laden_dev_stream_destroy(s);
    free(back);
}

TEST(dev_host_memory_starts_at_a_page) { test_on_every_device(host_pages); }

/* Stream B reads what stream A wrote, ordered only by an event: if the wait
 * were ignored, B would read the buffer before A's large copy finished. */
static void cross_stream_wait(int32_t dev)
{
    const uint64_t n = 64u << 20;
    laden_dev_stream_t *a, *b;
    laden_event_t *ev, *never;
    laden_devptr_t d;
    unsigned char *src, *dst;
    CHECK_OK(laden_dev_stream_create(dev, &a));
    CHECK_OK(laden_dev_stream_create(dev, &b));
    CHECK_OK(laden_dev_event_create(dev, 0, &ev));
    CHECK_OK(laden_dev_event_create(dev, 0, &never));
    CHECK_OK(laden_dev_mem_alloc(dev, n, &d));
    CHECK_OK(laden_dev_host_alloc(dev, n, (void **)&src));
    CHECK_OK(laden_dev_host_alloc(dev, n, (void **)&dst));
    int done = 0;
    CHECK_OK(laden_dev_event_query(never, &done));
    CHECK_EQ(done, 1); /* never recorded: complete */
    CHECK_OK(laden_dev_event_synchronize(never));
    for (unsigned round = 0; round < 4; round++) {
        fill(src, n, round + 1);
        memset(dst, 0, n);
        CHECK_OK(laden_dev_copy_h2d(a, d, src, n));
        CHECK_OK(laden_dev_event_record(ev, a));
        CHECK_OK(laden_dev_stream_wait_event(b, ev));
        CHECK_OK(laden_dev_copy_d2h(b, dst, d, n));
        CHECK_OK(laden_dev_stream_wait_event(b, never)); /* no-op */
        CHECK_OK(laden_dev_stream_synchronize(b));
        CHECK_OK(laden_dev_event_query(ev, &done));
        CHECK_EQ(done, 1);
        CHECK_EQ(memcmp(src, dst, n), 0);
    }
    CHECK_OK(laden_dev_event_synchronize(ev));
    laden_dev_event_destroy(ev);
    laden_dev_event_destroy(never);
    laden_dev_stream_destroy(a);
    laden_dev_stream_destroy(b);
    CHECK_OK(laden_dev_mem_free(dev, d));
    CHECK_OK(laden_dev_host_free(dev, src));
    CHECK_OK(laden_dev_host_free(dev, dst));
}

TEST(dev_cross_stream_event_wait) { test_on_every_device(cross_stream_wait); }

static void timing(int32_t dev)
{
    laden_dev_stream_t *s;
    laden_event_t *e0, *e1;
    float ms = -1;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    CHECK_OK(laden_dev_event_create(dev, 1, &e0));
    CHECK_OK(laden_dev_event_create(dev, 1, &e1));
    CHECK_OK(laden_dev_event_record(e0, s));
    CHECK_OK(laden_dev_event_record(e1, s));
    CHECK_OK(laden_dev_event_synchronize(e1));
    CHECK_OK(laden_dev_event_elapsed_ms(e0, e1, &ms));
    CHECK(ms >= 0 && ms < 10000);
    laden_dev_event_destroy(e0);
    laden_dev_event_destroy(e1);
    laden_dev_stream_destroy(s);
    double bps = 0;
    CHECK_OK(laden_dev_measure_copy(dev, LADEN_COPY_H2D_PINNED, 8u << 20, 3,
                                    &bps));
    CHECK(bps > 0);
    CHECK_OK(laden_dev_measure_copy(dev, LADEN_COPY_H2D_PAGEABLE, 8u << 20, 2,
                                    &bps));
    CHECK(bps > 0);
    CHECK_OK(laden_dev_measure_copy(dev, LADEN_COPY_D2H_PINNED, 8u << 20, 2,
                                    &bps));
    CHECK(bps > 0);
    CHECK_STATUS(laden_dev_measure_copy(dev, LADEN_COPY_H2D_PINNED, 0, 1, &bps),
                 LADEN_E_INVAL);
}

TEST(dev_event_timing_and_measure) { test_on_every_device(timing); }

/* Pages mapped into a reserved range hold their data across unmap and
 * remap at another address, as VBARs will rely on. */
static void vmm(int32_t dev)
{
    laden_dev_info_t info;
    CHECK_OK(laden_dev_info(dev, &info));
    if (!info.vmm_supported) {
        fprintf(stderr, "device %d has no VMM\n", dev);
        return;
    }
    uint64_t g = info.vmm_granularity_bytes;
    CHECK(g >= 4096 && (g & (g - 1)) == 0);
    laden_devptr_t va;
    laden_phys_t p0, p1;
    CHECK_OK(laden_dev_va_reserve(dev, 4 * g, &va));
    CHECK_EQ(va % g, 0);
    CHECK_OK(laden_dev_phys_create(dev, g, &p0));
    CHECK_OK(laden_dev_phys_create(dev, 2 * g, &p1));
    CHECK_OK(laden_dev_map(dev, va, g, p0));
    CHECK_OK(laden_dev_map(dev, va + 2 * g, 2 * g, p1));
    laden_dev_stream_t *s;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    unsigned char *h, *back;
    CHECK_OK(laden_dev_host_alloc(dev, 2 * g, (void **)&h));
    CHECK_OK(laden_dev_host_alloc(dev, 2 * g, (void **)&back));
    fill(h, 2 * g, 7);
    CHECK_OK(laden_dev_copy_h2d(s, va + 2 * g, h, 2 * g));
    CHECK_OK(laden_dev_copy_h2d(s, va, h + 5, g));
    CHECK_OK(laden_dev_stream_synchronize(s));
    /* Move p1 to the start of the range: its bytes come along. */
    CHECK_OK(laden_dev_unmap(dev, va + 2 * g, 2 * g));
    CHECK_OK(laden_dev_unmap(dev, va, g));
    CHECK_OK(laden_dev_map(dev, va, 2 * g, p1));
    memset(back, 0, 2 * g);
    CHECK_OK(laden_dev_copy_d2h(s, back, va, 2 * g));
    CHECK_OK(laden_dev_stream_synchronize(s));
    CHECK_EQ(memcmp(back, h, 2 * g), 0);
    CHECK_OK(laden_dev_unmap(dev, va, 2 * g));
    CHECK_STATUS(laden_dev_map(dev, va + 1, g, p0), LADEN_E_INVAL);
    laden_devptr_t bad = 1;
    CHECK_STATUS(laden_dev_va_reserve(dev, g + 1, &bad), LADEN_E_INVAL);
    CHECK_EQ(bad, 0);
    CHECK_STATUS(laden_dev_va_release(dev, va + g, 2 * g), LADEN_E_INVAL);
    CHECK_OK(laden_dev_phys_release(dev, p0));
    CHECK_OK(laden_dev_phys_release(dev, p1));
    CHECK_OK(laden_dev_va_release(dev, va, 4 * g));
    CHECK_OK(laden_dev_host_free(dev, h));
    CHECK_OK(laden_dev_host_free(dev, back));
    laden_dev_stream_destroy(s);
}

TEST(dev_virtual_memory) { test_on_every_device(vmm); }

static void info_and_errors(int32_t dev)
{
    laden_dev_info_t info;
    uint64_t fr, total;
    CHECK_OK(laden_dev_info(dev, &info));
    CHECK(info.device == dev && info.total_bytes > 0 && info.name[0]);
    CHECK(info.kind ==
          (dev == LADEN_DEVICE_CPU ? LADEN_DEV_KIND_CPU : LADEN_DEV_KIND_CUDA));
    CHECK_OK(laden_dev_mem_info(dev, &fr, &total));
    CHECK(total > 0 && fr <= total);
    laden_dev_stream_t *s = (laden_dev_stream_t *)1;
    if (dev == LADEN_DEVICE_CPU) {
        CHECK_STATUS(laden_dev_stream_wrap(dev, 0, &s), LADEN_E_UNSUPPORTED);
        CHECK_EQ(s, NULL);
    } else {
        /* The legacy default stream (handle 0), as PyTorch may hand it. */
        laden_devptr_t d;
        unsigned char x = 42, y = 0;
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &s));
        CHECK_OK(laden_dev_mem_alloc(dev, 1, &d));
        CHECK_OK(laden_dev_copy_h2d(s, d, &x, 1));
        CHECK_OK(laden_dev_copy_d2h(s, &y, d, 1));
        CHECK_OK(laden_dev_stream_synchronize(s));
        CHECK_EQ(y, 42);
        laden_dev_stream_destroy(s); /* not owned: not destroyed */
        CHECK_OK(laden_dev_mem_free(dev, d));
        /* Too much device memory is a clear error, not a crash. */
        CHECK_STATUS(laden_dev_mem_alloc(dev, 1ull << 50, &d),
                     LADEN_E_DEVICE_NOMEM);
        CHECK_CONTAINS(laden_last_error(), "cuMemAlloc");
        CHECK_EQ(d, 0);
    }
    laden_devptr_t d = 1;
    CHECK_STATUS(laden_dev_mem_alloc(dev, 0, &d), LADEN_E_INVAL);
    CHECK_EQ(d, 0);
}

TEST(dev_info_and_errors)
{
    test_on_every_device(info_and_errors);
    laden_dev_info_t info;
    CHECK_STATUS(laden_dev_info(999, &info), LADEN_E_NODEVICE);
    CHECK_CONTAINS(laden_last_error(), "999");
    CHECK_STATUS(laden_dev_info(-2, &info), LADEN_E_NODEVICE);
    CHECK_STATUS(laden_dev_info(0, NULL), LADEN_E_INVAL);
    CHECK_STATUS(laden_dev_stream_synchronize(NULL), LADEN_E_INVAL);
    laden_dev_stream_destroy(NULL);
    laden_dev_event_destroy(NULL);
}

typedef struct {
    int32_t dev;
    unsigned seed;
} worker_arg;

static void *worker(void *p)
{
    worker_arg *w = p;
    const uint64_t n = 1u << 20;
    laden_dev_stream_t *s;
    laden_devptr_t d;
    unsigned char *a = malloc(n), *b = malloc(n);
    CHECK_OK(laden_dev_stream_create(w->dev, &s));
    CHECK_OK(laden_dev_mem_alloc(w->dev, n, &d));
    for (int r = 0; r < 20; r++) {
        fill(a, n, w->seed + (unsigned)r);
        CHECK_OK(laden_dev_copy_h2d(s, d, a, n));
        CHECK_OK(laden_dev_copy_d2h(s, b, d, n));
        CHECK_OK(laden_dev_stream_synchronize(s));
        CHECK_EQ(memcmp(a, b, n), 0);
    }
    CHECK_OK(laden_dev_mem_free(w->dev, d));
    laden_dev_stream_destroy(s);
    free(a);
    free(b);
    return NULL;
}

static void threads(int32_t dev)
{
    pthread_t t[6];
    worker_arg args[6];
    for (int i = 0; i < 6; i++) {
        args[i] = (worker_arg){dev, (unsigned)i * 17};
        CHECK_EQ(pthread_create(&t[i], NULL, worker, &args[i]), 0);
    }
    for (int i = 0; i < 6; i++)
        pthread_join(t[i], NULL);
}

TEST(dev_many_threads) { test_on_every_device(threads); }

/* Threads on every CUDA device at once, each its own device's copies. */
TEST(dev_threads_on_several_devices)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    if (n < 2)
        SKIP("needs two CUDA devices (the stand-in driver has two)");
    pthread_t t[8];
    worker_arg args[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (worker_arg){i % n, (unsigned)i * 29};
        CHECK_EQ(pthread_create(&t[i], NULL, worker, &args[i]), 0);
    }
    for (int i = 0; i < 8; i++)
        pthread_join(t[i], NULL);
}

typedef int (*ctx_get_fn)(void **);
typedef int (*ctx_set_fn)(void *);

static void *current(void)
{
    static ctx_get_fn get;
    if (!get)
        get = (ctx_get_fn)(uintptr_t)test_cuda_fn("cuCtxGetCurrent");
    void *c = (void *)1;
    CHECK_EQ(get(&c), 0);
    return c;
}

/* Every call on device `dev` with `other` current (another device's
 * primary context, or none) leaves `other` current, when it succeeds and
 * when it fails: the runtime takes its current device from the driver's
 * current context, so a switch left behind would move PyTorch's. */
static void keeps_context(int32_t dev, void *other)
{
    ctx_set_fn set = (ctx_set_fn)(uintptr_t)test_cuda_fn("cuCtxSetCurrent");
    CHECK_EQ(set(other), 0);
#define KEPT(call)                                                         \
    do {                                                                   \
        call;                                                              \
        if (current() != other) {                                          \
            fprintf(stderr, "%s:%d: cuda:%d: %s left another context "     \
                    "current\n", __FILE__, __LINE__, dev, #call);          \
            exit(1);                                                       \
        }                                                                  \
    } while (0)
    const uint64_t n = 1u << 20;
    laden_dev_info_t info;
    uint64_t fr = 0, total = 0;
    laden_dev_stream_t *s = NULL, *w = NULL;
    laden_event_t *a = NULL, *b = NULL;
    laden_devptr_t d = 0, big = 0;
    unsigned char *pin = NULL, *page = aligned_alloc(4096, 2 * n), *back = malloc(n);
    int done = 0, capturing = 1;
    float ms = -1;
    fill(page, n, 7);
    KEPT(CHECK_OK(laden_dev_info(dev, &info)));
    KEPT(CHECK_OK(laden_dev_mem_info(dev, &fr, &total)));
    KEPT(CHECK_OK(laden_dev_stream_create(dev, &s)));
    KEPT(CHECK_OK(laden_dev_stream_wrap(dev, 0, &w)));
    KEPT(CHECK_OK(laden_dev_event_create(dev, 1, &a)));
    KEPT(CHECK_OK(laden_dev_event_create(dev, 1, &b)));
    KEPT(CHECK_OK(laden_dev_mem_alloc(dev, n, &d)));
    /* ... and did its work on `dev`. */
    CHECK_EQ(test_cuda_device_of(d), dev);
    CHECK(test_cuda_stream_ctx(laden_dev_stream_handle(s)) ==
          test_cuda_primary_ctx(dev));
    KEPT(CHECK_OK(laden_dev_host_alloc(dev, n, (void **)&pin)));
    memcpy(pin, page, n);
    KEPT(CHECK_OK(laden_dev_host_register(dev, page + n, n)));
    KEPT(CHECK_OK(laden_dev_event_record(a, s)));
    KEPT(CHECK_OK(laden_dev_copy_h2d(s, d, pin, n)));
    KEPT(CHECK_OK(laden_dev_copy_d2h(s, back, d, n)));
    KEPT(CHECK_OK(laden_dev_event_record(b, s)));
    KEPT(CHECK_OK(laden_dev_stream_wait_event(w, b)));
    KEPT(CHECK_OK(laden_dev_event_synchronize(b)));
    KEPT(CHECK_OK(laden_dev_event_query(b, &done)));
    CHECK(done);
    KEPT(CHECK_OK(laden_dev_event_elapsed_ms(a, b, &ms)));
    CHECK(ms >= 0);
    KEPT(CHECK_OK(laden_dev_stream_capturing(s, &capturing)));
    CHECK(!capturing);
    KEPT(CHECK_OK(laden_dev_stream_synchronize(s)));
    CHECK_EQ(memcmp(back, page, n), 0);
    /* A call the driver refuses. */
    KEPT(CHECK_STATUS(laden_dev_mem_alloc(dev, 1ull << 50, &big),
                      LADEN_E_DEVICE_NOMEM));
    KEPT(CHECK_OK(laden_dev_host_unregister(dev, page + n)));
    KEPT(CHECK_OK(laden_dev_host_free(dev, pin)));
    KEPT(CHECK_OK(laden_dev_mem_free(dev, d)));
    KEPT(laden_dev_event_destroy(a));
    KEPT(laden_dev_event_destroy(b));
    KEPT(laden_dev_stream_destroy(w));
    KEPT(laden_dev_stream_destroy(s));
#undef KEPT
    CHECK_EQ(set(NULL), 0);
    free(page);
    free(back);
}

TEST(dev_keeps_the_callers_context)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    if (n == 0)
        SKIP("no CUDA device");
    for (int32_t dev = 0; dev < n; dev++) {
        keeps_context(dev, NULL); /* a thread with no context */
        if (n > 1) /* a thread where another device is current */
            keeps_context(dev, test_cuda_primary_ctx((dev + 1) % n));
    }
}
