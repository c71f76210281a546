/* The CPU device: the device interface over host memory.  Each stream has a
 * worker thread that runs its queue in order, standing in for a copy
 * engine, so asynchronous copies, events and cross-stream waits behave as
 * on a GPU and every scheduling path runs without one.  Virtual memory is
 * emulated with a PROT_NONE reservation and memfd pages mapped over it. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "dev_internal.h"

#define CPU_GRANULARITY (2ull << 20) /* as CUDA's, so plans match */
#define RING 1024u

enum { OP_COPY, OP_RECORD, OP_WAIT };

typedef struct cpu_event {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t recorded;  /* generation of the last record */
    uint64_t completed; /* generation reached by its stream */
    uint64_t t_ns;      /* time the last record completed */
} cpu_event;

typedef struct cpu_op {
    int kind;
    void *dst;
    const void *src;
    uint64_t n;
    cpu_event *ev;
    uint64_t gen;
} cpu_op;

typedef struct cpu_stream {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, space_cv, idle_cv;
    cpu_op ring[RING];
    uint64_t head, tail; /* ops [head, tail) are queued */
    bool busy, stop;
    pthread_t thread;
} cpu_stream;

static void event_complete(cpu_event *e, uint64_t gen)
{
    pthread_mutex_lock(&e->mu);
    if (gen > e->completed) {
        e->completed = gen;
        e->t_ns = laden__now_ns();
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void event_wait_gen(cpu_event *e, uint64_t gen)
{
    pthread_mutex_lock(&e->mu);
    while (e->completed < gen)
        pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

static void *stream_main(void *arg)
{
    cpu_stream *s = arg;
    pthread_setname_np(pthread_self(), "laden-cpu-stream");
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == s->tail && !s->stop)
            pthread_cond_wait(&s->work_cv, &s->mu);
        if (s->head == s->tail)
            break;
        cpu_op op = s->ring[s->head % RING];
        s->busy = true;
        pthread_mutex_unlock(&s->mu);
        switch (op.kind) {
        case OP_COPY:
            memcpy(op.dst, op.src, op.n);
            break;
        case OP_RECORD:
            event_complete(op.ev, op.gen);
            break;
        case OP_WAIT:
            event_wait_gen(op.ev, op.gen);
            break;
        }
        pthread_mutex_lock(&s->mu);
        s->head++;
        s->busy = false;
        pthread_cond_broadcast(&s->space_cv);
        if (s->head == s->tail)
            pthread_cond_broadcast(&s->idle_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Queues an op; blocks only while the ring is full (RING ops deep). */
static void enqueue(cpu_stream *s, cpu_op op)
{
    pthread_mutex_lock(&s->mu);
    while (s->tail - s->head >= RING)
        pthread_cond_wait(&s->space_cv, &s->mu);
    s->ring[s->tail % RING] = op;
    s->tail++;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
}

static laden_status cpu_info(int32_t dev, laden_dev_info_t *out)
{
    uint64_t fr, total;
    laden_status st = laden__dev_cpu_ops.mem_info(dev, &fr, &total);
    if (st)
        return st;
    out->device = dev;
    out->kind = LADEN_DEV_KIND_CPU;
    snprintf(out->name, sizeof out->name, "cpu");
    out->total_bytes = total;
    out->vmm_supported = 1;
    out->vmm_granularity_bytes = CPU_GRANULARITY;
    return LADEN_OK;
}

static laden_status cpu_mem_info(int32_t dev, uint64_t *fr, uint64_t *total)
{
    (void)dev;
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long v;
    *fr = *total = 0;
    if (f) {
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemTotal: %llu kB", &v) == 1)
                *total = v * 1024;
            else if (sscanf(line, "MemAvailable: %llu kB", &v) == 1)
                *fr = v * 1024;
        }
        fclose(f);
    }
    if (*total == 0) {
        long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
        long psz = sysconf(_SC_PAGESIZE);
        if (pages <= 0 || psz <= 0)
            return laden__fail(LADEN_E_IO, "cannot read the memory size");
        *total = (uint64_t)pages * (uint64_t)psz;
        *fr = avail > 0 ? (uint64_t)avail * (uint64_t)psz : 0;
    }
    return LADEN_OK;
}

static laden_status cpu_stream_create(int32_t dev, void **out)
{
    (void)dev;
    cpu_stream *s = calloc(1, sizeof *s);
    if (!s)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a stream");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->space_cv, NULL);
    pthread_cond_init(&s->idle_cv, NULL);
    int e = pthread_create(&s->thread, NULL, stream_main, s);
    if (e) {
        free(s);
        return laden__fail(LADEN_E_NOMEM, "cannot start a stream thread: %s",
                           strerror(e));
    }
    *out = s;
    return LADEN_OK;
}

static laden_status cpu_stream_wrap(int32_t dev, uintptr_t h, void **out)
{
    (void)dev;
    (void)h;
    (void)out;
    return laden__fail(LADEN_E_UNSUPPORTED,
                       "the CPU device has no external streams to wrap");
}

static void cpu_stream_destroy(int32_t dev, void *impl, bool owned)
{
    (void)dev;
    (void)owned;
    cpu_stream *s = impl;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->work_cv);
    pthread_cond_destroy(&s->space_cv);
    pthread_cond_destroy(&s->idle_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static laden_status cpu_stream_sync(int32_t dev, void *impl)
{
    (void)dev;
    cpu_stream *s = impl;
    pthread_mutex_lock(&s->mu);
    while (s->head != s->tail)
        pthread_cond_wait(&s->idle_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return LADEN_OK;
}

static laden_status cpu_stream_wait_event(int32_t dev, void *si, void *ei)
{
    (void)dev;
    cpu_event *e = ei;
    pthread_mutex_lock(&e->mu);
    uint64_t target = e->recorded;
    bool done = e->completed >= target;
    pthread_mutex_unlock(&e->mu);
    if (!done)
        enqueue(si, (cpu_op){.kind = OP_WAIT, .ev = e, .gen = target});
    return LADEN_OK;
}

static laden_status cpu_event_create(int32_t dev, int timing, void **out)
{
    (void)dev;
    (void)timing;
    cpu_event *e = calloc(1, sizeof *e);
    if (!e)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating an event");
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    *out = e;
    return LADEN_OK;
}

static void cpu_event_destroy(int32_t dev, void *impl)
{
    (void)dev;
    cpu_event *e = impl;
    /* A record still queued on a stream would touch freed memory: wait for
     * it, as cuEventDestroy defers its release until the event completes. */
    event_wait_gen(e, e->recorded);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

static laden_status cpu_event_record(int32_t dev, void *ei, void *si)
{
    (void)dev;
    cpu_event *e = ei;
    pthread_mutex_lock(&e->mu);
    uint64_t gen = ++e->recorded;
    pthread_mutex_unlock(&e->mu);
    enqueue(si, (cpu_op){.kind = OP_RECORD, .ev = e, .gen = gen});
    return LADEN_OK;
}

static laden_status cpu_event_sync(int32_t dev, void *ei)
{
    (void)dev;
    cpu_event *e = ei;
    pthread_mutex_lock(&e->mu);
    uint64_t target = e->recorded;
    pthread_mutex_unlock(&e->mu);
    event_wait_gen(e, target);
    return LADEN_OK;
}

static laden_status cpu_event_query(int32_t dev, void *ei, int *done)
{
    (void)dev;
    cpu_event *e = ei;
    pthread_mutex_lock(&e->mu);
    *done = e->completed >= e->recorded;
    pthread_mutex_unlock(&e->mu);
    return LADEN_OK;
}

uint64_t laden__dev_cpu_event_ns(void *impl)
{
    cpu_event *e = impl;
    pthread_mutex_lock(&e->mu);
    uint64_t t = e->t_ns;
    pthread_mutex_unlock(&e->mu);
    return t;
}

static laden_status cpu_event_elapsed(int32_t dev, void *ai, void *bi,
                                      float *ms)
{
    (void)dev;
    cpu_event *a = ai, *b = bi;
    int da, db;
    cpu_event_query(dev, a, &da);
    cpu_event_query(dev, b, &db);
    if (!a->recorded || !b->recorded || !da || !db)
        return laden__fail(LADEN_E_STATE,
                           "event_elapsed_ms: both events must have been "
                           "recorded and completed");
    pthread_mutex_lock(&a->mu);
    uint64_t ta = a->t_ns;
    pthread_mutex_unlock(&a->mu);
    pthread_mutex_lock(&b->mu);
    uint64_t tb = b->t_ns;
    pthread_mutex_unlock(&b->mu);
    *ms = (float)((double)((int64_t)(tb - ta)) * 1e-6);
    return LADEN_OK;
}

static laden_status cpu_copy(int32_t dev, void *si, void *dst, const void *src,
                             uint64_t n)
{
    (void)dev;
    enqueue(si, (cpu_op){.kind = OP_COPY, .dst = dst, .src = src, .n = n});
    return LADEN_OK;
}

static laden_status cpu_copy_h2d(int32_t dev, void *si, laden_devptr_t dst,
                                 const void *src, uint64_t n)
{
    return cpu_copy(dev, si, (void *)(uintptr_t)dst, src, n);
}

static laden_status cpu_copy_d2h(int32_t dev, void *si, void *dst,
                                 laden_devptr_t src, uint64_t n)
{
    return cpu_copy(dev, si, dst, (const void *)(uintptr_t)src, n);
}

static laden_status cpu_copy_d2d(int32_t dev, void *si, laden_devptr_t dst,
                                 laden_devptr_t src, uint64_t n)
{
    return cpu_copy(dev, si, (void *)(uintptr_t)dst,
                    (const void *)(uintptr_t)src, n);
}

/* "Device" and pinned memory of the CPU device come straight from mmap,
 * with a header page holding the length, so that freeing gives the pages
 * back to the system at once, as a GPU driver does; malloc would keep
 * freed blocks in its heap and a release would not lower RSS. */
#define HDR 4096u

static laden_status cpu_alloc(uint64_t n, void **out, const char *what)
{
    if (n > SIZE_MAX / 2)
        goto fail;
    size_t len = (size_t)n + HDR;
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        goto fail;
    memcpy(p, &len, sizeof len);
    *out = p + HDR;
    return LADEN_OK;
fail:
    return laden__fail(LADEN_E_NOMEM,
                       "cannot allocate %s of %s on the CPU device",
                       laden__bytes(n).s, what);
}

static void cpu_release(void *ptr)
{
    if (!ptr)
        return;
    char *p = (char *)ptr - HDR;
    size_t len;
    memcpy(&len, p, sizeof len);
    munmap(p, len);
}

static laden_status cpu_mem_alloc(int32_t dev, uint64_t n, laden_devptr_t *out)
{
    (void)dev;
    void *p = NULL;
    laden_status st = cpu_alloc(n, &p, "device memory");
    if (!st)
        *out = (laden_devptr_t)(uintptr_t)p;
    return st;
}

static laden_status cpu_mem_free(int32_t dev, laden_devptr_t p)
{
    (void)dev;
    cpu_release((void *)(uintptr_t)p);
    return LADEN_OK;
}

static laden_status cpu_host_alloc(int32_t dev, uint64_t n, void **out)
{
    (void)dev;
    return cpu_alloc(n, out, "host memory");
}

static laden_status cpu_host_free(int32_t dev, void *p)
{
    (void)dev;
    cpu_release(p);
    return LADEN_OK;
}

/* Host memory of the CPU device is as fast to copy from pinned or not. */
static laden_status cpu_host_register(int32_t dev, void *p, uint64_t n)
{
    (void)dev;
    (void)p;
    (void)n;
    return LADEN_OK;
}

static laden_status cpu_host_unregister(int32_t dev, void *p)
{
    (void)dev;
    (void)p;
    return LADEN_OK;
}

/* Reservations, so that releasing or mapping outside one fails as it does
 * with CUDA instead of silently unmapping whatever lies there. */
typedef struct reservation {
    struct reservation *next;
    uintptr_t va;
    uint64_t n;
} reservation;

static pthread_mutex_t res_mu = PTHREAD_MUTEX_INITIALIZER;
static reservation *reservations;

/* Fault injection and leak counts (laden_dev_cpu_fail_vmm_at), under
 * res_mu. */
static uint64_t vmm_calls, vmm_fail_at, live_res, live_phys;

uint64_t laden_dev_cpu_fail_vmm_at(uint64_t n)
{
    pthread_mutex_lock(&res_mu);
    uint64_t calls = vmm_calls;
    vmm_calls = 0;
    vmm_fail_at = n;
    pthread_mutex_unlock(&res_mu);
    return calls;
}

void laden_dev_cpu_vmm_live(uint64_t *reservations_out, uint64_t *phys_out)
{
    pthread_mutex_lock(&res_mu);
    if (reservations_out)
        *reservations_out = live_res;
    if (phys_out)
        *phys_out = live_phys;
    pthread_mutex_unlock(&res_mu);
}

/* Counts an allocation call; fails it if it is the injected one. */
static laden_status injected(const char *call)
{
    pthread_mutex_lock(&res_mu);
    bool fail = ++vmm_calls == vmm_fail_at;
    pthread_mutex_unlock(&res_mu);
    if (fail)
        return laden__fail(LADEN_E_DEVICE_NOMEM,
                           "%s: injected failure (CPU device)", call);
    return LADEN_OK;
}

/* The reservation containing [va, va+n), or NULL.  Call with res_mu held. */
static reservation **find_reservation(uintptr_t va, uint64_t n, bool exact)
{
    for (reservation **r = &reservations; *r; r = &(*r)->next) {
        if (exact ? (*r)->va == va && (*r)->n == n
                  : va >= (*r)->va && va - (*r)->va <= (*r)->n &&
                        n <= (*r)->n - (va - (*r)->va))
            return r;
    }
    return NULL;
}

static laden_status in_reservation(laden_devptr_t va, uint64_t n,
                                   const char *call)
{
    pthread_mutex_lock(&res_mu);
    bool ok = find_reservation((uintptr_t)va, n, false) != NULL;
    pthread_mutex_unlock(&res_mu);
    if (!ok)
        return laden__fail(LADEN_E_INVAL,
                           "%s: [0x%llx, +%llu) is not inside a reserved "
                           "range",
                           call, (unsigned long long)va,
                           (unsigned long long)n);
    return LADEN_OK;
}

static laden_status cpu_va_reserve(int32_t dev, uint64_t n,
                                   laden_devptr_t *out)
{
    (void)dev;
    laden_status st = injected("va_reserve");
    if (st)
        return st;
    /* Over-reserve to hand out a granularity-aligned range, as CUDA does. */
    size_t len = (size_t)n + CPU_GRANULARITY;
    char *p = mmap(NULL, len, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return laden__fail(LADEN_E_DEVICE_NOMEM,
                           "cannot reserve %s of address space: %s",
                           laden__bytes(n).s, strerror(errno));
    uintptr_t a = ((uintptr_t)p + CPU_GRANULARITY - 1) &
                  ~(uintptr_t)(CPU_GRANULARITY - 1);
    if (a > (uintptr_t)p)
        munmap(p, a - (uintptr_t)p);
    uintptr_t end = (uintptr_t)p + len, used = a + (uintptr_t)n;
    if (end > used)
        munmap((void *)used, end - used);
    reservation *r = malloc(sizeof *r);
    if (!r) {
        munmap((void *)a, (size_t)n);
        return laden__fail(LADEN_E_NOMEM, "out of memory reserving a range");
    }
    r->va = a;
    r->n = n;
    pthread_mutex_lock(&res_mu);
    r->next = reservations;
    reservations = r;
    live_res++;
    pthread_mutex_unlock(&res_mu);
    *out = (laden_devptr_t)a;
    return LADEN_OK;
}

static laden_status cpu_va_release(int32_t dev, laden_devptr_t va, uint64_t n)
{
    (void)dev;
    pthread_mutex_lock(&res_mu);
    reservation **r = find_reservation((uintptr_t)va, n, true);
    reservation *gone = r ? *r : NULL;
    if (r) {
        *r = gone->next;
        live_res--;
    }
    pthread_mutex_unlock(&res_mu);
    if (!gone)
        return laden__fail(LADEN_E_INVAL,
                           "va_release: [0x%llx, +%llu) is not a reserved "
                           "range",
                           (unsigned long long)va, (unsigned long long)n);
    free(gone);
    munmap((void *)(uintptr_t)va, (size_t)n);
    return LADEN_OK;
}

static laden_status cpu_phys_create(int32_t dev, uint64_t n, laden_phys_t *out)
{
    (void)dev;
    laden_status st = injected("phys_create");
    if (st)
        return st;
    int fd = memfd_create("laden-phys", MFD_CLOEXEC);
    if (fd < 0)
        return laden__fail(LADEN_E_DEVICE_NOMEM, "memfd_create: %s",
                           strerror(errno));
    if (ftruncate(fd, (off_t)n) != 0) {
        int e = errno;
        close(fd);
        return laden__fail(LADEN_E_DEVICE_NOMEM,
                           "cannot create %s of pages: %s",
                           laden__bytes(n).s, strerror(e));
    }
    *out = (laden_phys_t)fd + 1; /* 0 stays "none" */
    pthread_mutex_lock(&res_mu);
    live_phys++;
    pthread_mutex_unlock(&res_mu);
    return LADEN_OK;
}

static laden_status cpu_phys_release(int32_t dev, laden_phys_t p)
{
    (void)dev;
    if (p == 0 || close((int)(p - 1)) != 0)
        return laden__fail(LADEN_E_INVAL, "phys_release: bad handle");
    pthread_mutex_lock(&res_mu);
    live_phys--;
    pthread_mutex_unlock(&res_mu);
    return LADEN_OK;
}

static laden_status cpu_map(int32_t dev, laden_devptr_t va, uint64_t n,
                            laden_phys_t p)
{
    (void)dev;
    if (p == 0)
        return laden__fail(LADEN_E_INVAL, "map: bad physical handle");
    laden_status st = in_reservation(va, n, "map");
    if (st || (st = injected("map")))
        return st;
    void *r = mmap((void *)(uintptr_t)va, (size_t)n, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, (int)(p - 1), 0);
    if (r == MAP_FAILED)
        return laden__fail(LADEN_E_DEVICE_NOMEM, "map: %s", strerror(errno));
    return LADEN_OK;
}

static laden_status cpu_unmap(int32_t dev, laden_devptr_t va, uint64_t n)
{
    (void)dev;
    laden_status st = in_reservation(va, n, "unmap");
    if (st)
        return st;
    void *r = mmap((void *)(uintptr_t)va, (size_t)n, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
                   0);
    if (r == MAP_FAILED)
        return laden__fail(LADEN_E_INVAL, "unmap: %s", strerror(errno));
    return LADEN_OK;
}

const laden__dev_ops laden__dev_cpu_ops = {
    .info = cpu_info,
    .mem_info = cpu_mem_info,
    .stream_create = cpu_stream_create,
    .stream_wrap = cpu_stream_wrap,
    .stream_destroy = cpu_stream_destroy,
    .stream_sync = cpu_stream_sync,
    .stream_wait_event = cpu_stream_wait_event,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .event_sync = cpu_event_sync,
    .event_query = cpu_event_query,
    .event_elapsed = cpu_event_elapsed,
    .copy_h2d = cpu_copy_h2d,
    .copy_d2h = cpu_copy_d2h,
    .copy_d2d = cpu_copy_d2d,
    .mem_alloc = cpu_mem_alloc,
    .mem_free = cpu_mem_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .host_register = cpu_host_register,
    .host_unregister = cpu_host_unregister,
    .va_reserve = cpu_va_reserve,
    .va_release = cpu_va_release,
    .phys_create = cpu_phys_create,
    .phys_release = cpu_phys_release,
    .map = cpu_map,
    .unmap = cpu_unmap,
};
