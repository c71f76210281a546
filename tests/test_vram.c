/* VBARs on the CPU device (pages of 2 MiB, the emulated granularity):
 * priorities, watermarks, floors, signatures, charges, every allocation
 * failure injected in turn, and several threads at once (run under TSan
 * with `make test-tsan`). */
#include <pthread.h>

#include "test.h"

#include "laden/vram.h"

#define PG (2ull << 20)

static laden_vram_t *ctx(uint64_t budget_pages)
{
    laden_vram_t *c;
    CHECK_OK(laden_vram_create(LADEN_DEVICE_CPU, budget_pages * PG, PG, &c));
    return c;
}

/* Faults page i of v; returns resident, *sig the signature. */
static int fault(laden_vbar_t *v, uint32_t i, uint64_t *sig)
{
    int res;
    uint64_t s;
    CHECK_OK(laden_vbar_fault(v, i * PG, PG, &res, &s));
    if (sig)
        *sig = s;
    return res;
}

static unsigned char *at(laden_vbar_t *v, uint32_t i)
{
    laden_vbar_info_t info;
    CHECK_OK(laden_vbar_info(v, &info));
    return (unsigned char *)(uintptr_t)info.base + i * PG;
}

static uint64_t mapped(laden_vram_t *c)
{
    laden_vram_info_t info;
    CHECK_OK(laden_vram_info(c, &info));
    return info.mapped_bytes;
}

TEST(vram_fault_signature_and_data)
{
    laden_vram_t *c = ctx(4);
    laden_vbar_t *a;
    uint64_t off, s1, s2, s3;
    CHECK_OK(laden_vbar_create(c, 8 * PG, &a));
    CHECK_OK(laden_vbar_alloc(a, PG, &off));
    CHECK_EQ(off, 0);
    CHECK(fault(a, 0, &s1) == 1 && s1 != 0);
    memset(at(a, 0), 0x5a, 4096); /* the caller copies its weight in */
    CHECK_OK(laden_vbar_unpin(a, 0, PG));
    CHECK(fault(a, 0, &s2) == 1 && s2 == s1); /* still the data written */
    CHECK_EQ(at(a, 0)[100], 0x5a);
    CHECK_OK(laden_vbar_unpin(a, 0, PG));
    uint64_t freed;
    CHECK_OK(laden_vram_free_memory(c, PG, &freed));
    CHECK(freed == PG && mapped(c) == 0);
    CHECK_EQ(fault(a, 0, &s3), 0); /* evicted: the watermark is at 0 */
    CHECK_OK(laden_vbar_prioritize(a)); /* the model's next use */
    CHECK(fault(a, 0, &s3) == 1 && s3 != s1); /* replaced: copy again */
    CHECK_EQ(at(a, 0)[100], 0);
    /* A range over two pages: its signature is the newer page's. */
    uint64_t s4;
    int res;
    CHECK_OK(laden_vbar_fault(a, PG / 2, PG, &res, &s4));
    CHECK(res == 1 && s4 > s3);
    CHECK_OK(laden_vbar_unpin(a, PG / 2, PG));
    CHECK_OK(laden_vbar_unpin(a, 0, PG));
    laden_vram_destroy(c);
}

TEST(vram_priority_watermark_floor)
{
    laden_vram_t *c = ctx(4);
    laden_vbar_t *a, *b;
    CHECK_OK(laden_vbar_create(c, 8 * PG, &a)); /* older: lower priority */
    CHECK_OK(laden_vbar_create(c, 8 * PG, &b));
    for (uint32_t i = 0; i < 4; i++) {
        CHECK_EQ(fault(a, i, NULL), 1);
        CHECK_OK(laden_vbar_unpin(a, i * PG, PG));
    }
    /* Lower offsets first within a VBAR: page 4 cannot take 0..3. */
    CHECK_EQ(fault(a, 4, NULL), 0);
    /* The newer VBAR takes the older's highest page, and the older's
     * watermark drops there. */
    CHECK_EQ(fault(b, 0, NULL), 1);
    uint8_t r[8];
    uint32_t n;
    CHECK_OK(laden_vbar_residency(a, r, 8, &n));
    CHECK(n == 8 && r[0] == 1 && r[2] == 1 && r[3] == 0);
    laden_vbar_info_t ia;
    CHECK_OK(laden_vbar_info(a, &ia));
    CHECK_EQ(ia.watermark, 3 * PG);
    /* Above the watermark: fails fast, even with room made. */
    CHECK_OK(laden_vbar_unpin(b, 0, PG));
    CHECK_OK(laden_vram_free_memory(c, PG, NULL)); /* evicts a's page 2 */
    laden_vram_info_t ci;
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK_EQ(ci.mapped_bytes, 3 * PG);
    CHECK_EQ(fault(a, 3, NULL), 0);
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK_EQ(ci.fail_fast, 1);
    CHECK_EQ(fault(a, 0, NULL), 1); /* mapped below: still resident */
    CHECK_OK(laden_vbar_unpin(a, 0, PG));
    /* prioritize: a is the most important again, its watermark reset; it
     * now takes b's pages. */
    CHECK_OK(laden_vbar_prioritize(a));
    CHECK(fault(a, 2, NULL) == 1 && fault(a, 3, NULL) == 1);
    CHECK_OK(laden_vbar_residency(b, r, 8, &n));
    CHECK_EQ(r[0], 0);
    CHECK_OK(laden_vbar_unpin(a, 2 * PG, 2 * PG));
    /* A floor keeps the watermark from dropping below it. */
    CHECK_OK(laden_vbar_set_floor(a, 3 * PG));
    CHECK_OK(laden_vbar_prioritize(b));
    for (uint32_t i = 0; i < 4; i++) {
        CHECK_EQ(fault(b, i, NULL), 1);
        CHECK_OK(laden_vbar_unpin(b, i * PG, PG));
    }
    CHECK_OK(laden_vbar_info(a, &ia));
    CHECK(ia.mapped_bytes == 0 && ia.watermark == 3 * PG);
    CHECK_OK(laden_vbar_deprioritize(b));
    CHECK_EQ(fault(a, 1, NULL), 1); /* below the floor: tries, takes b's */
    CHECK_OK(laden_vbar_unpin(a, PG, PG));
    laden_vram_destroy(c);
}

TEST(vram_pinned_pages_stay_and_charges)
{
    laden_vram_t *c = ctx(4);
    laden_vbar_t *a;
    CHECK_OK(laden_vbar_create(c, 8 * PG, &a));
    for (uint32_t i = 0; i < 4; i++)
        CHECK_EQ(fault(a, i, NULL), 1);
    for (uint32_t i = 1; i < 4; i++)
        CHECK_OK(laden_vbar_unpin(a, i * PG, PG));
    uint64_t freed;
    CHECK_OK(laden_vram_free_memory(c, 100 * PG, &freed));
    CHECK(freed == 3 * PG && mapped(c) == PG); /* page 0 is pinned */
    /* Charges: activations evict unpinned weights first. */
    CHECK_OK(laden_vbar_prioritize(a));
    CHECK(fault(a, 1, NULL) == 1 && fault(a, 2, NULL) == 1);
    CHECK_OK(laden_vbar_unpin(a, PG, 2 * PG));
    CHECK_OK(laden_vram_charge(c, PG + 1));
    CHECK_EQ(mapped(c), 2 * PG); /* the least important page gave way */
    CHECK_STATUS(laden_vram_charge(c, 2 * PG), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "pinned");
    laden_vram_info_t ci;
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK(ci.charged_bytes == PG + 1 && ci.pinned_bytes == PG);
    CHECK_OK(laden_vbar_prioritize(a));
    CHECK_EQ(fault(a, 1, NULL), 1); /* still mapped */
    CHECK_EQ(fault(a, 2, NULL), 0); /* 3 pages + charged: over the budget */
    CHECK_STATUS(laden_vram_uncharge(c, 3 * PG), LADEN_E_STATE);
    CHECK_OK(laden_vram_uncharge(c, PG + 1));
    CHECK_EQ(fault(a, 2, NULL), 1);
    laden_vram_destroy(c); /* pinned or not, everything goes */
}

TEST(vram_bad_arguments)
{
    laden_vram_t *c = ctx(4);
    laden_vbar_t *a;
    int res;
    uint64_t sig, off;
    CHECK_STATUS(laden_vbar_create(c, 0, &a), LADEN_E_INVAL);
    CHECK_OK(laden_vbar_create(c, 3 * PG - 1, &a)); /* rounded up */
    laden_vbar_info_t ia;
    CHECK_OK(laden_vbar_info(a, &ia));
    CHECK_EQ(ia.size_bytes, 3 * PG);
    CHECK_STATUS(laden_vbar_fault(a, 2 * PG, PG + 1, &res, &sig),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "outside the VBAR");
    CHECK_STATUS(laden_vbar_unpin(a, 0, PG), LADEN_E_STATE);
    CHECK_OK(laden_vbar_alloc(a, 2 * PG, &off));
    CHECK_OK(laden_vbar_alloc(a, 10, &off));
    CHECK_EQ(off, 2 * PG);
    CHECK_STATUS(laden_vbar_alloc(a, PG, &off), LADEN_E_BUDGET);
    CHECK_STATUS(laden_vbar_set_floor(a, 4 * PG), LADEN_E_INVAL);
    CHECK_OK(laden_vbar_fault(a, 0, 0, &res, &sig)); /* empty: trivially */
    CHECK_EQ(res, 1);
    laden_vram_t *bad;
    CHECK_STATUS(laden_vram_create(99, 0, 0, &bad), LADEN_E_NODEVICE);
    laden_vbar_destroy(a);
    laden_vram_destroy(c);
}

/* One scenario of creates, faults, evictions, charges and destroys. */
static void scenario(void)
{
    laden_vram_t *c;
    if (laden_vram_create(LADEN_DEVICE_CPU, 4 * PG, PG, &c))
        return;
    laden_vbar_t *v[3] = {0};
    for (int k = 0; k < 3; k++)
        if (laden_vbar_create(c, 6 * PG, &v[k]))
            v[k] = NULL;
    for (int round = 0; round < 3; round++)
        for (int k = 0; k < 3; k++) {
            if (!v[k])
                continue;
            for (uint32_t i = 0; i < 3; i++) {
                int res;
                uint64_t sig;
                laden_status s = laden_vbar_fault(v[k], i * PG, PG, &res,
                                                  &sig);
                CHECK_EQ(s, LADEN_OK); /* no memory is not an error */
                if (res)
                    CHECK_OK(laden_vbar_unpin(v[k], i * PG, PG));
            }
            if (laden_vram_charge(c, PG) == LADEN_OK)
                CHECK_OK(laden_vram_uncharge(c, PG));
            if (round == 1)
                laden_vbar_prioritize(v[k]);
        }
    /* Invariants: the context's mapped bytes are its VBARs' pages. */
    laden_vram_info_t ci;
    CHECK_OK(laden_vram_info(c, &ci));
    uint64_t sum = 0;
    for (int k = 0; k < 3; k++) {
        if (!v[k])
            continue;
        uint8_t r[8];
        uint32_t n;
        laden_vbar_info_t vi;
        CHECK_OK(laden_vbar_residency(v[k], r, 8, &n));
        CHECK_OK(laden_vbar_info(v[k], &vi));
        uint64_t pages = 0;
        for (uint32_t i = 0; i < n; i++)
            pages += r[i] != 0;
        CHECK(vi.mapped_bytes == pages * PG && vi.pinned_bytes == 0);
        sum += vi.mapped_bytes;
    }
    CHECK(ci.mapped_bytes == sum && sum <= 4 * PG);
    laden_vbar_destroy(v[1]);
    laden_vram_destroy(c);
}

TEST(vram_every_failure_injected_no_leak)
{
    uint64_t res0, phys0, res1, phys1;
    laden_dev_cpu_vmm_live(&res0, &phys0);
    laden_dev_cpu_fail_vmm_at(0);
    scenario();
    uint64_t calls = laden_dev_cpu_fail_vmm_at(0); /* of a clean run */
    CHECK(calls > 20);
    for (uint64_t n = 1; n <= calls; n++) {
        laden_dev_cpu_fail_vmm_at(n);
        scenario();
        CHECK(laden_dev_cpu_fail_vmm_at(0) >= n); /* it failed there */
        laden_dev_cpu_vmm_live(&res1, &phys1);
        CHECK(res1 == res0 && phys1 == phys0);
    }
}

typedef struct worker {
    laden_vram_t *c;
    int id;
    int bad;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    laden_vbar_t *v;
    uint64_t sigs[6] = {0};
    if (laden_vbar_create(w->c, 6 * PG, &v)) {
        w->bad = 1;
        return NULL;
    }
    uint64_t x = (uint64_t)w->id * 7919 + 1;
    for (int step = 0; step < 300; step++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t i = (uint32_t)((x >> 33) % 6);
        int res;
        uint64_t sig;
        if (laden_vbar_fault(v, i * PG, PG, &res, &sig)) {
            w->bad = 2;
            break;
        }
        if (!res)
            continue;
        unsigned char *p = at(v, i);
        unsigned char want = (unsigned char)(w->id * 16 + i);
        if (sig == sigs[i]) {
            if (p[0] != want || p[PG - 1] != want)
                w->bad = 3; /* same signature, other data: a bug */
        } else {
            p[0] = p[PG - 1] = want; /* "copy the weight in" */
            sigs[i] = sig;
        }
        laden_vbar_unpin(v, i * PG, PG);
        if (step % 50 == 0)
            laden_vbar_prioritize(v);
    }
    laden_vbar_destroy(v);
    return NULL;
}

TEST(vram_threads)
{
    laden_vram_t *c = ctx(8);
    pthread_t t[4];
    worker w[4];
    for (int k = 0; k < 4; k++) {
        w[k] = (worker){c, k + 1, 0};
        CHECK_EQ(pthread_create(&t[k], NULL, work, &w[k]), 0);
    }
    for (int k = 0; k < 4; k++) {
        pthread_join(t[k], NULL);
        CHECK_EQ(w[k].bad, 0);
    }
    CHECK_EQ(mapped(c), 0);
    laden_vram_destroy(c);
}

/* The elastic allocator on the CPU device: allocations take unpinned
 * weight pages before they fail; freed blocks are reused. */
TEST(vram_elastic_allocator)
{
    laden_vram_t *c = ctx(8);
    laden_vbar_t *w;
    CHECK_OK(laden_vbar_create(c, 8 * PG, &w));
    for (uint32_t i = 0; i < 6; i++)
        CHECK_EQ(fault(w, i, NULL), 1);
    CHECK_OK(laden_vbar_unpin(w, 2 * PG, 4 * PG)); /* pages 0, 1 pinned */
    CHECK_OK(laden_elastic_attach(LADEN_DEVICE_CPU, c));
    laden_vram_t *other = ctx(1);
    CHECK_STATUS(laden_elastic_attach(LADEN_DEVICE_CPU, other), LADEN_E_STATE);
    CHECK_STATUS(laden_elastic_attach(0, other), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "is for device -1");
    CHECK_STATUS(laden_elastic_attach(999, other), LADEN_E_NODEVICE);
    laden_vram_destroy(other);
    /* 3 pages: 6 mapped + 3 > 8, so one weight page gives way. */
    void *a = laden_elastic_malloc((ptrdiff_t)(3 * PG), LADEN_DEVICE_CPU, NULL);
    CHECK(a != NULL);
    memset(a, 1, 3 * PG); /* it is memory */
    laden_elastic_stats_t st;
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    CHECK(st.evicted_bytes == PG && st.in_use_bytes == 3 * PG);
    CHECK_EQ(mapped(c), 5 * PG);
    /* More than the unpinned weights can give: NULL, nothing changed. */
    void *b = laden_elastic_malloc((ptrdiff_t)(5 * PG), LADEN_DEVICE_CPU, NULL);
    CHECK_EQ(b, NULL);
    CHECK_EQ(mapped(c), 5 * PG);
    /* Freed, then reused for a request of at least half its size. */
    laden_elastic_free(a, (ptrdiff_t)(3 * PG), LADEN_DEVICE_CPU, NULL);
    void *a2 = laden_elastic_malloc((ptrdiff_t)(2 * PG), LADEN_DEVICE_CPU, NULL);
    CHECK_EQ(a2, a);
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    CHECK(st.reuses == 1 && st.failures == 1 && st.cached_bytes == 0);
    CHECK_EQ(st.in_use_bytes, 3 * PG);
    /* PyTorch frees with the size it asked for: the block is still 3
     * pages, charged and cached as such (no charge leaks). */
    laden_elastic_free(a2, (ptrdiff_t)(2 * PG), LADEN_DEVICE_CPU, NULL);
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    CHECK(st.cached_bytes == 3 * PG && st.in_use_bytes == 0);
    /* A request the cache cannot serve takes the cached block back first,
     * then evicts weights: 5 mapped (2 pinned) + 6 > 8. */
    void *d = laden_elastic_malloc((ptrdiff_t)(6 * PG), LADEN_DEVICE_CPU, NULL);
    CHECK(d != NULL);
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    CHECK(st.cached_bytes == 0 && mapped(c) == 2 * PG);
    laden_vram_info_t ci;
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK_EQ(ci.charged_bytes, 6 * PG);
    laden_elastic_free(d, (ptrdiff_t)(6 * PG), LADEN_DEVICE_CPU, NULL);
    /* Weights coming back take the allocator's idle cached blocks before
     * anything else. */
    CHECK_OK(laden_vbar_prioritize(w));
    for (uint32_t i = 2; i < 6; i++)
        CHECK_EQ(fault(w, i, NULL), 1);
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK(st.cached_bytes == 0 && ci.charged_bytes == 0);
    CHECK_EQ(ci.mapped_bytes, 6 * PG);
    CHECK_OK(laden_vbar_unpin(w, 2 * PG, 4 * PG));
    CHECK_OK(laden_elastic_trim(LADEN_DEVICE_CPU));
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK_EQ(ci.charged_bytes, 0);
    /* Over budget with a cached block and unpinned weights both there:
     * the cached block gives way, not a weight (6 mapped + 2 cached +
     * 1/2 > 8; the cached block is too large to serve the request). */
    void *e1 = laden_elastic_malloc((ptrdiff_t)(2 * PG), LADEN_DEVICE_CPU, NULL);
    CHECK(e1 != NULL);
    laden_elastic_free(e1, (ptrdiff_t)(2 * PG), LADEN_DEVICE_CPU, NULL);
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    uint64_t evicted = st.evicted_bytes;
    void *e2 = laden_elastic_malloc((ptrdiff_t)(PG / 2), LADEN_DEVICE_CPU, NULL);
    CHECK(e2 != NULL);
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    CHECK(st.cached_bytes == 0 && st.evicted_bytes == evicted);
    CHECK_EQ(mapped(c), 6 * PG);
    laden_elastic_free(e2, (ptrdiff_t)(PG / 2), LADEN_DEVICE_CPU, NULL);
    CHECK_OK(laden_elastic_trim(LADEN_DEVICE_CPU));
    CHECK_OK(laden_elastic_attach(LADEN_DEVICE_CPU, NULL));
    CHECK_EQ(laden_elastic_malloc(-1, LADEN_DEVICE_CPU, NULL), NULL);
    CHECK_EQ(laden_elastic_malloc(16, 999, NULL), NULL);
    laden_vram_destroy(c);
}

/* Many blocks handed out and freed in a scrambled order, some freed with
 * a smaller size than they have: the allocator's table of live blocks
 * keeps every size, so what is charged comes back to zero. */
TEST(vram_elastic_many_blocks)
{
    laden_vram_t *c = ctx(64);
    CHECK_OK(laden_elastic_attach(LADEN_DEVICE_CPU, c));
    enum { N = 2000 };
    static void *p[N];
    static uint64_t asked[N];
    for (int i = 0; i < N; i++) {
        asked[i] = 256u * (uint64_t)(1 + i % 7);
        p[i] = laden_elastic_malloc((ptrdiff_t)asked[i], LADEN_DEVICE_CPU,
                                    NULL);
        CHECK(p[i] != NULL);
        if (i % 3 == 0) { /* freed at once: the next may reuse it */
            laden_elastic_free(p[i], (ptrdiff_t)asked[i], LADEN_DEVICE_CPU,
                               NULL);
            p[i] = NULL;
        }
    }
    for (int k = 0; k < N; k++) {
        int i = (int)(((uint64_t)k * 7919u) % N); /* a permutation */
        if (p[i])
            laden_elastic_free(p[i], (ptrdiff_t)asked[i], LADEN_DEVICE_CPU,
                               NULL);
    }
    laden_elastic_stats_t st;
    CHECK_OK(laden_elastic_stats(LADEN_DEVICE_CPU, &st));
    CHECK_EQ(st.in_use_bytes, 0);
    CHECK_OK(laden_elastic_trim(LADEN_DEVICE_CPU));
    laden_vram_info_t ci;
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK_EQ(ci.charged_bytes, 0);
    CHECK_OK(laden_elastic_attach(LADEN_DEVICE_CPU, NULL));
    laden_vram_destroy(c);
}

/* laden_vram_make_room keeps evicted physical pages as spares for the
 * faults to come; a charge or free_memory takes the spares back before
 * any weight; nothing outlives the context. */
TEST(vram_spare_pages)
{
    uint64_t res0, phys0, res1, phys1;
    laden_dev_cpu_vmm_live(&res0, &phys0);
    laden_vram_t *c = ctx(4);
    laden_vbar_t *a;
    CHECK_OK(laden_vbar_create(c, 4 * PG, &a));
    for (uint32_t i = 0; i < 4; i++)
        CHECK_EQ(fault(a, i, NULL), 1);
    CHECK_OK(laden_vbar_unpin(a, 0, 4 * PG));
    CHECK_OK(laden_vram_make_room(c, 2 * PG));
    laden_vram_info_t ci;
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK(ci.mapped_bytes == 2 * PG && ci.spare_bytes == 2 * PG);
    CHECK_EQ(ci.evictions, 2);
    /* Room there already: nothing more. */
    CHECK_OK(laden_vram_make_room(c, 2 * PG));
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK_EQ(ci.evictions, 2);
    /* A charge takes a spare back, not a weight. */
    CHECK_OK(laden_vram_charge(c, PG));
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK(ci.mapped_bytes == 2 * PG && ci.spare_bytes == PG);
    CHECK(ci.charged_bytes == PG && ci.evictions == 2);
    CHECK_OK(laden_vram_uncharge(c, PG));
    /* A fault maps the spare (no new physical page). */
    laden_dev_cpu_fail_vmm_at(0);
    CHECK_OK(laden_vbar_prioritize(a));
    CHECK_EQ(fault(a, 2, NULL), 1);
    CHECK_EQ(laden_dev_cpu_fail_vmm_at(0), 1); /* one map, no create */
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK(ci.mapped_bytes == 3 * PG && ci.spare_bytes == 0);
    CHECK_OK(laden_vbar_unpin(a, 2 * PG, PG));
    /* free_memory gives spares back first. */
    CHECK_OK(laden_vram_make_room(c, 2 * PG));
    uint64_t freed;
    CHECK_OK(laden_vram_free_memory(c, PG, &freed));
    CHECK_OK(laden_vram_info(c, &ci));
    CHECK(freed == PG && ci.spare_bytes == 0);
    CHECK_STATUS(laden_vram_make_room(NULL, 1), LADEN_E_INVAL);
    laden_vram_destroy(c);
    laden_dev_cpu_vmm_live(&res1, &phys1);
    CHECK(res1 == res0 && phys1 == phys0);
}
