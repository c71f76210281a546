/* The gradient sink (laden/grads.h): values land converted and added in
 * push order, through a ring smaller than what passes through it, on the
 * CPU device and on CUDA (tests/fake_cuda too); bad arguments name what is
 * wrong. */
#define _GNU_SOURCE /* setenv */
#include <dirent.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"

#include "laden/dev.h"
#include "laden/grads.h"
#include "laden/stream.h"

static const laden_dtype GD[] = {LADEN_DTYPE_F32, LADEN_DTYPE_F16,
                                 LADEN_DTYPE_BF16};

static uint32_t gsize(laden_dtype d)
{
    return d == LADEN_DTYPE_F32 ? 4u : 2u;
}

static uint64_t seed = 0x2545f4914f6cdd1dull;
static float rndf(void)
{
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return (float)((int64_t)(seed >> 40) - (1 << 23)) / (float)(1 << 20);
}

/* n values of dtype d (random, rounded by laden_sched_convert). */
static void *values(laden_dtype d, uint64_t n)
{
    float *f = malloc(4 * n);
    void *out = malloc(4 * n);
    CHECK(f && out);
    for (uint64_t i = 0; i < n; i++)
        f[i] = rndf();
    CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, f, d, out, n));
    free(f);
    return out;
}

static float at(laden_dtype d, const void *p, uint64_t i)
{
    float f;
    CHECK_OK(laden_sched_convert(d, (const char *)p + i * gsize(d),
                                 LADEN_DTYPE_F32, &f, 1));
    return f;
}

/* expected[i] = round_dd(expected[i] + src[i]) or round_dd(src[i]). */
static void expect(laden_dtype sd, const void *src, laden_dtype dd,
                   void *exp, uint64_t n, int acc)
{
    for (uint64_t i = 0; i < n; i++) {
        float v = at(sd, src, i);
        if (acc)
            v = at(dd, exp, i) + v;
        CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, &v, dd,
                                     (char *)exp + i * gsize(dd), 1));
    }
}

/* Device copies of host values, written on `s`. */
static laden_devptr_t on_device(int32_t dev, laden_dev_stream_t *s,
                                const void *host, uint64_t bytes)
{
    laden_devptr_t p = 0;
    CHECK_OK(laden_dev_mem_alloc(dev, bytes, &p));
    CHECK_OK(laden_dev_copy_h2d(s, p, host, bytes));
    return p;
}

static void land_every_dtype(int32_t dev)
{
    const uint64_t n = 5003; /* not a multiple of the landing chunk */
    laden_grads_t *g = NULL;
    CHECK_OK(laden_grads_create(dev, 0, &g));
    laden_dev_stream_t *s = NULL;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    uintptr_t h = laden_dev_stream_handle(s);
    CHECK(dev == LADEN_DEVICE_CPU ? laden_grads_stream(g) == 0
                                  : laden_grads_stream(g) != 0);
    for (size_t a = 0; a < 3; a++)
        for (size_t b = 0; b < 3; b++) {
            laden_dtype sd = GD[a], dd = GD[b];
            void *x = values(sd, n), *y = values(sd, n);
            void *dst = malloc(n * gsize(dd)), *exp = malloc(n * gsize(dd));
            CHECK(dst && exp);
            memset(dst, 0x7f, n * gsize(dd)); /* overwritten, not added */
            laden_devptr_t dx = on_device(dev, s, x, n * gsize(sd));
            laden_devptr_t dy = on_device(dev, s, y, n * gsize(sd));
            if (dev == LADEN_DEVICE_CPU)
                CHECK_OK(laden_dev_stream_synchronize(s));
            CHECK_OK(laden_grads_push(g, dx, sd, n, dst, dd, 0, h));
            CHECK_OK(laden_grads_push(g, dy, sd, n, dst, dd, 1, h));
            CHECK_OK(laden_grads_flush(g));
            expect(sd, x, dd, exp, n, 0);
            expect(sd, y, dd, exp, n, 1);
            CHECK(memcmp(dst, exp, n * gsize(dd)) == 0);
            CHECK_OK(laden_dev_mem_free(dev, dx));
            CHECK_OK(laden_dev_mem_free(dev, dy));
            free(x);
            free(y);
            free(dst);
            free(exp);
        }
    uint64_t bytes = 0, pushes = 0;
    CHECK_OK(laden_grads_stats(g, &bytes, &pushes));
    CHECK_EQ(pushes, 18);
    CHECK_EQ(bytes, (uint64_t)2 * n * (4 + 2 + 2) * 3);
    laden_dev_stream_destroy(s);
    laden_grads_destroy(g);
}

TEST(grads_land_every_dtype)
{
    test_on_every_device(land_every_dtype);
}

/* More passes through the ring than it holds, in parts, to a few
 * destinations added to many times: every value lands, in order. */
static void ring_wraps(int32_t dev)
{
    const uint64_t big = 700000, small = 90001; /* F32: 2.8 MB, 360 kB */
    laden_grads_t *g = NULL;
    CHECK_OK(laden_grads_create(dev, 1, &g)); /* raised to 1 MiB */
    laden_dev_stream_t *s = NULL;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    uintptr_t h = laden_dev_stream_handle(s);
    float *dst[3], *exp[3];
    uint64_t len[3] = {big, small, small};
    for (int k = 0; k < 3; k++) {
        dst[k] = calloc(len[k], 4);
        exp[k] = calloc(len[k], 4);
        CHECK(dst[k] && exp[k]);
    }
    void *src[12];
    laden_devptr_t dsrc[12];
    for (int r = 0; r < 12; r++) {
        int k = r % 3;
        src[r] = values(k == 2 ? LADEN_DTYPE_BF16 : LADEN_DTYPE_F32, len[k]);
        dsrc[r] = on_device(dev, s, src[r],
                            len[k] * (k == 2 ? 2u : 4u));
    }
    if (dev == LADEN_DEVICE_CPU)
        CHECK_OK(laden_dev_stream_synchronize(s));
    for (int r = 0; r < 12; r++) {
        int k = r % 3;
        laden_dtype sd = k == 2 ? LADEN_DTYPE_BF16 : LADEN_DTYPE_F32;
        CHECK_OK(laden_grads_push(g, dsrc[r], sd, len[k], dst[k],
                                  LADEN_DTYPE_F32, r >= 3, h));
        expect(sd, src[r], LADEN_DTYPE_F32, exp[k], len[k], r >= 3);
    }
    CHECK_OK(laden_grads_flush(g));
    for (int k = 0; k < 3; k++)
        CHECK(memcmp(dst[k], exp[k], len[k] * 4) == 0);
    for (int r = 0; r < 12; r++) {
        CHECK_OK(laden_dev_mem_free(dev, dsrc[r]));
        free(src[r]);
    }
    for (int k = 0; k < 3; k++) {
        free(dst[k]);
        free(exp[k]);
    }
    laden_dev_stream_destroy(s);
    laden_grads_destroy(g); /* nothing pending: returns at once */
}

TEST(grads_ring_wraps_in_order)
{
    test_on_every_device(ring_wraps);
}

/* Into page-locked memory: a copy with nothing to add or convert goes
 * straight there (no ring); one that adds, or converts, goes through the
 * ring and lands after the direct copy to the same place; the bytes count
 * both. */
static void direct_into_pinned(int32_t dev)
{
    const uint64_t n = 300001; /* F32: 1.2 MB, more than half the ring */
    laden_grads_t *g = NULL;
    CHECK_OK(laden_grads_create(dev, 0, &g));
    laden_dev_stream_t *s = NULL;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    uintptr_t h = laden_dev_stream_handle(s);
    void *pinned = NULL, *half = NULL;
    CHECK_OK(laden_dev_host_alloc(dev, n * 4, &pinned));
    CHECK_OK(laden_dev_host_alloc(dev, n * 2, &half));
    void *x = values(LADEN_DTYPE_F32, n), *y = values(LADEN_DTYPE_F32, n);
    void *z = values(LADEN_DTYPE_BF16, n);
    laden_devptr_t dx = on_device(dev, s, x, n * 4);
    laden_devptr_t dy = on_device(dev, s, y, n * 4);
    laden_devptr_t dz = on_device(dev, s, z, n * 2);
    if (dev == LADEN_DEVICE_CPU)
        CHECK_OK(laden_dev_stream_synchronize(s));
    float *exp = malloc(n * 4);
    uint16_t *exph = malloc(n * 2);
    CHECK(exp && exph);
    for (int round = 0; round < 2; round++) { /* the buffer reused */
        memset(pinned, 0x7f, n * 4);
        CHECK_OK(laden_grads_push(g, dx, LADEN_DTYPE_F32, n, pinned,
                                  LADEN_DTYPE_F32, LADEN_GRADS_PINNED, h));
        CHECK_OK(laden_grads_push(g, dy, LADEN_DTYPE_F32, n, pinned,
                                  LADEN_DTYPE_F32,
                                  LADEN_GRADS_PINNED | LADEN_GRADS_ADD, h));
        /* F32 into BF16: converted, so through the ring */
        CHECK_OK(laden_grads_push(g, dx, LADEN_DTYPE_F32, n, half,
                                  LADEN_DTYPE_BF16, LADEN_GRADS_PINNED, h));
        CHECK_OK(laden_grads_flush(g));
        expect(LADEN_DTYPE_F32, x, LADEN_DTYPE_F32, exp, n, 0);
        expect(LADEN_DTYPE_F32, y, LADEN_DTYPE_F32, exp, n, 1);
        CHECK(memcmp(pinned, exp, n * 4) == 0);
        expect(LADEN_DTYPE_F32, x, LADEN_DTYPE_BF16, exph, n, 0);
        CHECK(memcmp(half, exph, n * 2) == 0);
    }
    /* Converted into `half` through the ring, then the same place
     * direct: the ring's job is pending, so the second goes through the
     * ring too and lands after it (the last push wins). */
    CHECK_OK(laden_grads_push(g, dx, LADEN_DTYPE_F32, n, half,
                              LADEN_DTYPE_BF16, LADEN_GRADS_PINNED, h));
    CHECK_OK(laden_grads_push(g, dz, LADEN_DTYPE_BF16, n, half,
                              LADEN_DTYPE_BF16, LADEN_GRADS_PINNED, h));
    CHECK_OK(laden_grads_flush(g));
    CHECK(memcmp(half, z, n * 2) == 0);
    /* BF16 into BF16, direct, after the ring's pushes */
    CHECK_OK(laden_grads_push(g, dz, LADEN_DTYPE_BF16, n, half,
                              LADEN_DTYPE_BF16, LADEN_GRADS_PINNED, h));
    CHECK_OK(laden_grads_flush(g));
    CHECK(memcmp(half, z, n * 2) == 0);
    uint64_t bytes = 0, pushes = 0;
    CHECK_OK(laden_grads_stats(g, &bytes, &pushes));
    CHECK_EQ(pushes, 9);
    CHECK_EQ(bytes, 2 * (3 * n * 4) + n * 4 + 2 * n * 2);
    CHECK_OK(laden_dev_mem_free(dev, dx));
    CHECK_OK(laden_dev_mem_free(dev, dy));
    CHECK_OK(laden_dev_mem_free(dev, dz));
    CHECK_OK(laden_dev_host_free(dev, pinned));
    CHECK_OK(laden_dev_host_free(dev, half));
    free(x);
    free(y);
    free(z);
    free(exp);
    free(exph);
    laden_dev_stream_destroy(s);
    laden_grads_destroy(g);
}

TEST(grads_direct_into_pinned)
{
    test_on_every_device(direct_into_pinned);
}

/* An optimizer's state brought up (fetch, on the sink's upload stream;
 * fetched orders the caller's stream after it) and sent home (push);
 * wait orders the sink's copy stream after the caller's. */
static void fetch_and_wait(int32_t dev)
{
    const uint64_t n = 70001;
    laden_grads_t *g = NULL;
    CHECK_OK(laden_grads_create(dev, 0, &g));
    laden_dev_stream_t *s = NULL;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    uintptr_t h = laden_dev_stream_handle(s);
    void *host = NULL, *back = NULL;
    CHECK_OK(laden_dev_host_alloc(dev, n * 4, &host));
    CHECK_OK(laden_dev_host_alloc(dev, n * 4, &back));
    void *x = values(LADEN_DTYPE_F32, n);
    memcpy(host, x, n * 4);
    laden_devptr_t d = 0;
    CHECK_OK(laden_dev_mem_alloc(dev, n * 4, &d));
    CHECK(dev == LADEN_DEVICE_CPU ? laden_grads_upload_stream(g) == 0
                                  : laden_grads_upload_stream(g) != 0);
    CHECK_OK(laden_grads_fetch(g, d, host, n * 4));
    CHECK_OK(laden_grads_fetched(g, h));
    CHECK_OK(laden_grads_wait(g, h));
    CHECK_OK(laden_grads_push(g, d, LADEN_DTYPE_F32, n, back,
                              LADEN_DTYPE_F32, LADEN_GRADS_PINNED, h));
    CHECK_OK(laden_grads_flush(g));
    CHECK(memcmp(back, x, n * 4) == 0);
    /* several fetches, one wait for them all; a second wait, nothing new */
    void *y = values(LADEN_DTYPE_F32, n);
    memcpy(host, y, n * 4);
    CHECK_OK(laden_grads_fetch(g, d, host, n / 2 * 4));
    CHECK_OK(laden_grads_fetch(g, d + n / 2 * 4, (char *)host + n / 2 * 4,
                               (n - n / 2) * 4));
    CHECK_OK(laden_grads_fetched(g, h));
    CHECK_OK(laden_grads_fetched(g, h));
    CHECK_OK(laden_grads_wait(g, h));
    CHECK_OK(laden_grads_push(g, d, LADEN_DTYPE_F32, n, back,
                              LADEN_DTYPE_F32, LADEN_GRADS_PINNED, h));
    CHECK_OK(laden_grads_flush(g));
    CHECK(memcmp(back, y, n * 4) == 0);
    CHECK_OK(laden_grads_fetched(g, h)); /* none since the flush */
    free(y);
    CHECK_OK(laden_grads_fetch(g, d, host, 0)); /* nothing */
    CHECK_STATUS(laden_grads_fetch(g, 0, host, 4), LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_fetch(NULL, d, host, 4), LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_fetched(NULL, h), LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_wait(NULL, h), LADEN_E_INVAL);
    CHECK_OK(laden_dev_mem_free(dev, d));
    CHECK_OK(laden_dev_host_free(dev, host));
    CHECK_OK(laden_dev_host_free(dev, back));
    free(x);
    laden_dev_stream_destroy(s);
    laden_grads_destroy(g);
}

TEST(grads_fetch_and_wait)
{
    test_on_every_device(fetch_and_wait);
}

/* Gradients large enough to land on several threads (each a disjoint
 * range): the same values as one at a time, added and converted. */
TEST(grads_large_land_on_threads)
{
    const uint64_t n = (5u << 21) + 777; /* over the per-thread size */
    laden_grads_t *g = NULL;
    CHECK_OK(laden_grads_create(LADEN_DEVICE_CPU, 0, &g));
    void *x = values(LADEN_DTYPE_BF16, n), *y = values(LADEN_DTYPE_F32, n);
    float *dst = malloc(n * 4), *exp = malloc(n * 4);
    uint16_t *half = malloc(n * 2), *exph = malloc(n * 2);
    CHECK(dst && exp && half && exph);
    CHECK_OK(laden_grads_push(g, (laden_devptr_t)(uintptr_t)x,
                              LADEN_DTYPE_BF16, n, dst, LADEN_DTYPE_F32, 0,
                              0));
    CHECK_OK(laden_grads_push(g, (laden_devptr_t)(uintptr_t)y,
                              LADEN_DTYPE_F32, n, dst, LADEN_DTYPE_F32,
                              LADEN_GRADS_ADD, 0));
    CHECK_OK(laden_grads_push(g, (laden_devptr_t)(uintptr_t)y,
                              LADEN_DTYPE_F32, n, half, LADEN_DTYPE_BF16, 0,
                              0));
    CHECK_OK(laden_grads_push(g, (laden_devptr_t)(uintptr_t)x,
                              LADEN_DTYPE_BF16, n, half, LADEN_DTYPE_BF16,
                              LADEN_GRADS_ADD, 0));
    CHECK_OK(laden_grads_flush(g));
    for (uint64_t i = 0; i < n; i++) {
        float v = at(LADEN_DTYPE_BF16, x, i) + at(LADEN_DTYPE_F32, y, i);
        exp[i] = v;
        float w = at(LADEN_DTYPE_F32, y, i);
        uint16_t hw;
        CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, &w, LADEN_DTYPE_BF16,
                                     &hw, 1));
        w = at(LADEN_DTYPE_BF16, &hw, 0) + at(LADEN_DTYPE_BF16, x, i);
        CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, &w, LADEN_DTYPE_BF16,
                                     &exph[i], 1));
    }
    CHECK(memcmp(dst, exp, n * 4) == 0);
    CHECK(memcmp(half, exph, n * 2) == 0);
    free(x);
    free(y);
    free(dst);
    free(exp);
    free(half);
    free(exph);
    laden_grads_destroy(g);
}

/* Threads of this process now. */
static int tasks(void)
{
    DIR *d = opendir("/proc/self/task");
    CHECK(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* The threads of this process once those joined have left: a joined
 * thread's tid is cleared before the kernel removes its task, so
 * /proc/self/task can list it for a moment after pthread_join. */
static int tasks_settled(int want)
{
    int n = tasks();
    for (int i = 0; i < 200 && n > want; i++) {
        usleep(10 * 1000);
        n = tasks();
    }
    return n;
}

/* Many jobs large enough to land on several threads, every dtype pair,
 * set and added: the values those of the same pushes in pieces small
 * enough to land on one thread; the sink's threads are started once (as
 * many after the last job as after the first) and gone after destroy. */
static void many_jobs_on_the_pool(int32_t dev)
{
    const uint64_t n = (2u << 21) + 4099, piece = 1u << 20;
    const int njobs = 18;
    laden_dev_stream_t *s = NULL;
    CHECK_OK(laden_dev_stream_create(dev, &s));
    uintptr_t h = laden_dev_stream_handle(s);
    void *host[3];
    laden_devptr_t src[3];
    void *pooled[3], *alone[3];
    for (int k = 0; k < 3; k++) {
        host[k] = values(GD[k], n);
        src[k] = on_device(dev, s, host[k], n * gsize(GD[k]));
        pooled[k] = values(GD[k], n);
        alone[k] = malloc(n * gsize(GD[k]));
        CHECK(alone[k]);
        memcpy(alone[k], pooled[k], n * gsize(GD[k]));
    }
    CHECK_OK(laden_dev_stream_synchronize(s));
    int before = tasks(), first = 0;
    laden_grads_t *g = NULL, *one = NULL;
    uint64_t ring = laden_grads_staging_bytes(n * 4); /* a job, one part */
    CHECK_OK(laden_grads_create(dev, ring, &g));
    CHECK_OK(laden_grads_create(dev, ring, &one));
    for (int j = 0; j < njobs; j++) {
        int a = j % 3, b = (j / 3) % 3, acc = j % 2 ? LADEN_GRADS_ADD : 0;
        CHECK_OK(laden_grads_push(g, src[a], GD[a], n, pooled[b], GD[b],
                                  acc, h));
        for (uint64_t i = 0; i < n; i += piece)
            CHECK_OK(laden_grads_push(
                one, src[a] + i * gsize(GD[a]), GD[a],
                n - i < piece ? n - i : piece,
                (char *)alone[b] + i * gsize(GD[b]), GD[b], acc, h));
        if (j == 0) {
            CHECK_OK(laden_grads_flush(g));
            first = tasks();
        }
    }
    CHECK_OK(laden_grads_flush(g));
    CHECK_OK(laden_grads_flush(one));
    CHECK_EQ(tasks(), first);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 1)
        CHECK(first > before); /* it did land on more than one */
    for (int k = 0; k < 3; k++)
        CHECK(memcmp(pooled[k], alone[k], n * gsize(GD[k])) == 0);
    laden_grads_destroy(g);
    laden_grads_destroy(one);
    CHECK_EQ(tasks_settled(before), before);
    for (int k = 0; k < 3; k++) {
        CHECK_OK(laden_dev_mem_free(dev, src[k]));
        free(host[k]);
        free(pooled[k]);
        free(alone[k]);
    }
    laden_dev_stream_destroy(s);
}

TEST(grads_large_many_jobs_on_the_pool)
{
    test_on_every_device(many_jobs_on_the_pool);
}

TEST(grads_bad_arguments)
{
    laden_grads_t *g = NULL;
    CHECK_STATUS(laden_grads_create(LADEN_DEVICE_CPU, 0, NULL), LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_create(99, 0, &g), LADEN_E_NODEVICE);
    CHECK(g == NULL);
    CHECK_OK(laden_grads_create(LADEN_DEVICE_CPU, 0, &g));
    float src[4] = {1, 2, 3, 4}, dst[4] = {0};
    laden_devptr_t p = (laden_devptr_t)(uintptr_t)src;
    CHECK_STATUS(laden_grads_push(g, p, LADEN_DTYPE_F8_E4M3, 4, dst,
                                  LADEN_DTYPE_F32, 0, 0),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "F8_E4M3");
    CHECK_STATUS(laden_grads_push(g, p, LADEN_DTYPE_F32, 4, dst,
                                  LADEN_DTYPE_I32, 0, 0),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "I32");
    CHECK_STATUS(laden_grads_push(g, 0, LADEN_DTYPE_F32, 4, dst,
                                  LADEN_DTYPE_F32, 0, 0),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_push(g, p, LADEN_DTYPE_F32, 4, NULL,
                                  LADEN_DTYPE_F32, 0, 0),
                 LADEN_E_INVAL);
    CHECK_OK(laden_grads_push(g, p, LADEN_DTYPE_F32, 0, NULL,
                              LADEN_DTYPE_F32, 0, 0)); /* nothing */
    CHECK_STATUS(laden_grads_push(NULL, p, LADEN_DTYPE_F32, 4, dst,
                                  LADEN_DTYPE_F32, 0, 0),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_flush(NULL), LADEN_E_INVAL);
    uint64_t b = 0, np = 0;
    CHECK_STATUS(laden_grads_stats(g, NULL, &np), LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_stats(NULL, &b, &np), LADEN_E_INVAL);
    CHECK_STATUS(laden_grads_push(g, p, LADEN_DTYPE_F32, UINT64_MAX / 2,
                                  dst, LADEN_DTYPE_F32, 0, 0),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "elements");
    CHECK_STATUS(laden_grads_push(g, p, LADEN_DTYPE_F32, 4, dst,
                                  LADEN_DTYPE_F32, 4, 0),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "flags");
    CHECK_OK(laden_grads_push(g, p, LADEN_DTYPE_F32, 4, dst, LADEN_DTYPE_F32,
                              1, 0));
    CHECK_OK(laden_grads_flush(g));
    CHECK(dst[3] == 4.0f);
    laden_grads_destroy(g);
    laden_grads_destroy(NULL);
}

/* A copy that cannot be enqueued fails its push (nothing of it is
 * pending); one whose completion fails is the error of the next flush,
 * naming the sink; the sink works again after either.  Under
 * tests/fake_cuda only (it fails on demand). */
TEST(grads_copy_failures_reported)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    laden_dev_info_t info;
    if (n == 0 || laden_dev_info(0, &info) || !strstr(info.name, "fake"))
        SKIP("needs tests/fake_cuda (failures on demand)");
    laden_grads_t *g = NULL;
    CHECK_OK(laden_grads_create(0, 0, &g));
    laden_dev_stream_t *s = NULL;
    CHECK_OK(laden_dev_stream_create(0, &s));
    float src[256], dst[256];
    for (int i = 0; i < 256; i++)
        src[i] = (float)i;
    laden_devptr_t d = on_device(0, s, src, sizeof src);
    uintptr_t h = laden_dev_stream_handle(s);

    setenv("FAKE_CUDA_FAIL_D2H", "1", 1);
    laden_status st = laden_grads_push(g, d, LADEN_DTYPE_F32, 256, dst,
                                       LADEN_DTYPE_F32, 0, h);
    unsetenv("FAKE_CUDA_FAIL_D2H");
    CHECK(st != LADEN_OK);
    CHECK_OK(laden_grads_flush(g)); /* nothing was pending */

    setenv("FAKE_CUDA_FAIL_EVENT_SYNC", "1", 1); /* never seen done */
    CHECK_OK(laden_grads_push(g, d, LADEN_DTYPE_F32, 256, dst,
                              LADEN_DTYPE_F32, 0, h));
    st = laden_grads_flush(g);
    unsetenv("FAKE_CUDA_FAIL_EVENT_SYNC");
    CHECK(st != LADEN_OK);
    CHECK_CONTAINS(laden_last_error(), "laden_grads_flush");

    /* the direct path: a copy that cannot be enqueued fails its push */
    void *pinned = NULL;
    CHECK_OK(laden_dev_host_alloc(0, sizeof src, &pinned));
    setenv("FAKE_CUDA_FAIL_D2H", "1", 1);
    st = laden_grads_push(g, d, LADEN_DTYPE_F32, 256, pinned,
                          LADEN_DTYPE_F32, LADEN_GRADS_PINNED, h);
    unsetenv("FAKE_CUDA_FAIL_D2H");
    CHECK(st != LADEN_OK);
    CHECK_OK(laden_grads_flush(g));
    CHECK_OK(laden_grads_push(g, d, LADEN_DTYPE_F32, 256, pinned,
                              LADEN_DTYPE_F32, LADEN_GRADS_PINNED, h));
    CHECK_OK(laden_grads_flush(g));
    CHECK(memcmp(pinned, src, sizeof src) == 0);
    CHECK_OK(laden_dev_host_free(0, pinned));

    memset(dst, 0, sizeof dst);
    CHECK_OK(laden_grads_push(g, d, LADEN_DTYPE_F32, 256, dst,
                              LADEN_DTYPE_F32, 0, h));
    CHECK_OK(laden_grads_flush(g));
    CHECK(memcmp(dst, src, sizeof src) == 0);
    CHECK_OK(laden_dev_mem_free(0, d));
    laden_dev_stream_destroy(s);
    laden_grads_destroy(g);
}
