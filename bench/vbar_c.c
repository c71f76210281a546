/* VBAR costs from C: fault + unpin of a resident range (the hot path),
 * with and without recording the unpin on a stream, and the cost of
 * mapping a fresh page and of evicting it, per page size.  Prints a
 * table; asserts nothing.
 *
 *   build/laden_bench_vbar [device]     (default: 0 if CUDA, else CPU) */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "laden.h"
#include "laden/dev.h"
#include "laden/vram.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int fail(const char *what)
{
    fprintf(stderr, "%s: %s\n", what, laden_last_error());
    return 1;
}

int main(int argc, char **argv)
{
    int32_t n = 0, dev;
    laden_dev_count(&n);
    dev = argc > 1 ? atoi(argv[1]) : (n > 0 ? 0 : LADEN_DEVICE_CPU);
    laden_dev_info_t info;
    if (laden_dev_info(dev, &info))
        return fail("device");
    printf("device %d (%s)\n\n", dev, info.name);
    /* The hot path. */
    laden_vram_t *c;
    laden_vbar_t *v;
    if (laden_vram_create(dev, 0, 0, &c) || laden_vbar_create(c, 1ull << 30, &v))
        return fail("create");
    laden_dev_stream_t *s = NULL;
    uintptr_t handle = 0;
    if (dev >= 0) {
        if (laden_dev_stream_create(dev, &s))
            return fail("stream");
    }
    int res;
    uint64_t sig;
    if (laden_vbar_fault(v, 0, 1 << 20, &res, &sig) || !res ||
        laden_vbar_unpin(v, 0, 1 << 20))
        return fail("first fault");
    const int iters = 1000000;
    double t0 = now();
    for (int i = 0; i < iters; i++) {
        laden_vbar_fault(v, 0, 1 << 20, &res, &sig);
        laden_vbar_unpin(v, 0, 1 << 20);
    }
    double hot = (now() - t0) / iters;
    printf("%-44s %10s\n", "call", "ns");
    printf("%-44s %10.0f\n", "fault + unpin, resident 1 MiB range", hot * 1e9);
    if (dev >= 0) {
        /* A stream handle for unpin_after: wrap ours by its raw handle is
         * not exposed, so use the legacy default stream (handle 1). */
        handle = 1; /* CU_STREAM_LEGACY */
        t0 = now();
        for (int i = 0; i < iters / 10; i++) {
            laden_vbar_fault(v, 0, 1 << 20, &res, &sig);
            laden_vbar_unpin_after(v, 0, 1 << 20, handle);
        }
        printf("%-44s %10.0f\n", "fault + unpin_after(stream), resident",
               (now() - t0) / (iters / 10) * 1e9);
    }
    laden_vbar_destroy(v);
    laden_vram_destroy(c);
    laden_dev_stream_destroy(s);
    /* Mapping and evicting pages. */
    printf("\n%-10s %14s %14s %14s\n", "page MiB", "map us/page",
           "evict us/page", "map GB/s");
    uint64_t sizes[] = {2, 8, 32, 128};
    for (unsigned k = 0; k < 4; k++) {
        uint64_t pg = sizes[k] << 20;
        int pages = (int)((1024ull << 20) / pg);
        if (laden_vram_create(dev, 0, pg, &c) ||
            laden_vbar_create(c, (uint64_t)pages * pg, &v))
            return fail("create");
        double tm = 0, te = 0;
        for (int rep = 0; rep < 3; rep++) {
            t0 = now();
            for (int i = 0; i < pages; i++) {
                if (laden_vbar_fault(v, (uint64_t)i * pg, pg, &res, &sig) ||
                    !res)
                    return fail("fault");
                laden_vbar_unpin(v, (uint64_t)i * pg, pg);
            }
            tm += now() - t0;
            t0 = now();
            uint64_t freed;
            laden_vram_free_memory(c, (uint64_t)pages * pg, &freed);
            te += now() - t0;
            laden_vbar_prioritize(v);
        }
        printf("%-10llu %14.1f %14.1f %14.1f\n", (unsigned long long)sizes[k],
               tm / (3.0 * pages) * 1e6, te / (3.0 * pages) * 1e6,
               (double)pg * pages * 3 / tm / 1e9);
        laden_vbar_destroy(v);
        laden_vram_destroy(c);
    }
    return 0;
}
