/* The cache engine on every device: models as LADEN_SCHED_CACHE schedules
 * of host tensors, activated in rotation under device and pinned budgets.
 * Every activation checks the bytes each block runs from, and that the
 * accounting equals what the schedules hold. */
#include "test.h"

#include "laden/cache.h"
#include "laden/dev.h"
#include "laden/stream.h"

#define MAXB 16

typedef struct cmodel {
    laden_sched_t *sc;
    uint32_t id;
    uint32_t nb;  /* blocks, the first `fixed` without hooks */
    uint32_t fixed;
    uint64_t size[MAXB];
    int seed;
    int32_t dev;
} cmodel;

static unsigned char val(int seed, uint32_t b, uint64_t j)
{
    return (unsigned char)(seed * 31 + b * 7 + j * 13 + (j >> 8));
}

static void build(laden_cache_t *c, cmodel *m, const char *key, int32_t dev,
                  uint32_t nb, uint32_t fixed, const uint64_t *size, int seed)
{
    memset(m, 0, sizeof *m);
    m->nb = nb;
    m->fixed = fixed;
    m->seed = seed;
    m->dev = dev;
    laden_sched_config cfg = {dev, 0, 0, NULL, LADEN_SCHED_CACHE};
    CHECK_OK(laden_sched_create(&cfg, NULL, &m->sc));
    unsigned char *src[MAXB];
    for (uint32_t b = 0; b < nb; b++) {
        uint32_t bi, ti;
        m->size[b] = size[b];
        src[b] = malloc(size[b]);
        CHECK(src[b]);
        for (uint64_t j = 0; j < size[b]; j++)
            src[b][j] = val(seed, b, j);
        CHECK_OK(laden_sched_add_block(m->sc, LADEN_TIER_RAM, &bi));
        CHECK_EQ(bi, b);
        CHECK_OK(laden_sched_add_host_tensor(m->sc, bi, src[b],
                                             LADEN_DTYPE_U8, size[b],
                                             LADEN_DTYPE_U8, &ti));
    }
    CHECK_OK(laden_sched_load(m->sc));
    for (uint32_t b = 0; b < nb; b++)
        free(src[b]);
    CHECK_OK(laden_cache_add(c, key, 0, &m->id));
    CHECK_OK(laden_cache_bind(c, m->id, m->sc, fixed));
}

static void check_bytes(cmodel *m, uint32_t b, laden_devptr_t p)
{
    unsigned char *buf = malloc(m->size[b] ? m->size[b] : 1);
    CHECK(buf);
    if (m->dev >= 0) {
        CHECK_EQ(test_cuda_device_of(p), m->dev); /* on its device */
        /* The block is there once the compute stream (the legacy one,
         * handle 0) has done what enter made it wait for: laden's
         * streams, this one too, do not wait for the legacy stream. */
        laden_dev_stream_t *rd, *compute;
        CHECK_OK(laden_dev_stream_wrap(m->dev, 0, &compute));
        CHECK_OK(laden_dev_stream_synchronize(compute));
        laden_dev_stream_destroy(compute);
        CHECK_OK(laden_dev_stream_create(m->dev, &rd));
        CHECK_OK(laden_dev_copy_d2h(rd, buf, p, m->size[b]));
        CHECK_OK(laden_dev_stream_synchronize(rd));
        laden_dev_stream_destroy(rd);
    } else {
        memcpy(buf, (void *)(uintptr_t)p, m->size[b]);
    }
    for (uint64_t j = 0; j < m->size[b]; j++)
        if (buf[j] != val(m->seed, b, j)) {
            fprintf(stderr, "model %d block %u byte %llu wrong\n", m->seed, b,
                    (unsigned long long)j);
            exit(1);
        }
    free(buf);
}

/* A forward as the Python side runs it: fixed blocks are where they run
 * without any call; the others are entered and exited. */
static void run(cmodel *m)
{
    for (uint32_t b = 0; b < m->nb; b++) {
        laden_devptr_t p;
        if (b < m->fixed) {
            CHECK(laden_sched_is_resident(m->sc, b));
            CHECK_OK(laden_sched_tensor_ptr(m->sc, b, 0, &p));
            check_bytes(m, b, p);
            continue;
        }
        CHECK_OK(laden_sched_enter(m->sc, b, 0));
        CHECK_OK(laden_sched_tensor_ptr(m->sc, b, 0, &p));
        check_bytes(m, b, p);
        CHECK_OK(laden_sched_exit(m->sc, b, 0));
    }
}

static uint64_t held(cmodel *m)
{
    laden_sched_stats_t st;
    CHECK_OK(laden_sched_stats(m->sc, &st));
    return st.device_bytes;
}

/* The accounting equals what the schedules hold, within the budgets. */
static void check_accounts(laden_cache_t *c, cmodel *ms, int k)
{
    laden_cache_stats_t cs;
    CHECK_OK(laden_cache_stats(c, &cs));
    uint64_t vram = 0, pinned = 0;
    for (int i = 0; i < k; i++) {
        laden_cache_info_t info;
        laden_sched_stats_t st;
        CHECK_OK(laden_cache_info(c, ms[i].id, &info));
        CHECK_OK(laden_sched_stats(ms[i].sc, &st));
        CHECK_EQ(info.vram_bytes, st.device_bytes);
        CHECK_EQ(info.pinned_bytes, st.registered_bytes);
        vram += st.device_bytes;
        pinned += st.registered_bytes;
    }
    CHECK(cs.vram_bytes == vram && cs.pinned_bytes == pinned);
    CHECK(!cs.vram_budget_bytes || vram <= cs.vram_budget_bytes);
    CHECK(!cs.pinned_budget_bytes || pinned <= cs.pinned_budget_bytes);
}

static void use(laden_cache_t *c, cmodel *m, laden_cache_mode mode,
                laden_cache_activation_t *act)
{
    laden_cache_evict_t ev[8];
    uint32_t n;
    CHECK_OK(laden_cache_activate(c, m->id, mode, 2, 0, ev, 8, &n, act));
    run(m);
    CHECK_OK(laden_cache_deactivate(c, m->id, 0));
}

static void destroy_all(laden_cache_t *c, cmodel *ms, int k)
{
    for (int i = 0; i < k; i++) {
        CHECK_OK(laden_cache_unbind(c, ms[i].id));
        CHECK_EQ(held(&ms[i]), 0);
        CHECK_OK(laden_cache_remove(c, ms[i].id));
        laden_sched_destroy(ms[i].sc);
    }
    laden_cache_destroy(c);
}


/* Bytes an upload copies: none on the CPU device, where a resident
 * block runs from its host copy in place. */
#define UP(dev, n) ((dev) == LADEN_DEVICE_CPU ? 0 : (n))

static const uint64_t FOUR[4] = {1000, 1000, 1000, 1000};

/* Three models of 4000 bytes, room for two: in rotation each activation
 * evicts the least recently used idle model and uploads the whole model;
 * re-using the model just used copies nothing. */
static void rotation(int32_t dev)
{
    laden_cache_t *c;
    cmodel m[3];
    CHECK_OK(laden_cache_create(8000, 0, &c));
    const char *keys[] = {"text-encoder", "unet", "vae"};
    for (int i = 0; i < 3; i++)
        build(c, &m[i], keys[i], dev, 4, 1, FOUR, i + 1);
    uint64_t uploaded = 0;
    for (int round = 0; round < 12; round++) {
        laden_cache_activation_t act;
        cmodel *x = &m[round % 3];
        use(c, x, LADEN_CACHE_AUTO, &act);
        CHECK_EQ(act.mode, LADEN_CACHE_RESIDENT);
        CHECK(act.upload_bytes == UP(dev, 4000) && act.kept_bytes == 0);
        CHECK_EQ(act.evicted_models, (round < 2 ? 0u : 1u));
        /* The evicted model's regions are the new model's: same sizes
         * (on the CPU device blocks run from their host copies: no
         * regions to hand over, nothing copied). */
        CHECK_EQ(act.reused_bytes, (round < 2 ? 0u : UP(dev, 4000u)));
        if (round >= 2) /* the model used two activations ago gave way */
            CHECK_EQ(held(&m[(round + 1) % 3]), 0);
        CHECK_EQ(held(&m[(round + 2) % 3]), (round ? 4000u : 0u));
        uploaded += act.upload_bytes;
        use(c, x, LADEN_CACHE_AUTO, &act); /* again: nothing moves */
        CHECK(act.upload_bytes == 0 && act.kept_bytes == 4000 &&
              act.evicted_models == 0);
        check_accounts(c, m, 3);
    }
    laden_cache_stats_t cs;
    CHECK_OK(laden_cache_stats(c, &cs));
    CHECK(cs.upload_bytes == uploaded && cs.hits == 12);
    destroy_all(c, m, 3);
}

TEST(engine_rotation_lru_and_reuse) { test_on_every_device(rotation); }

/* A cache per device in one process, as ModelCache keeps them: models
 * used in turn on two devices never evict each other (each cache has its
 * own budget), every block runs from its own device's memory, and a new
 * model goes to the cache with the most room. */
TEST(engine_a_cache_per_device)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    if (n < 2)
        SKIP("needs two CUDA devices (the stand-in driver has two)");
    laden_cache_t *c[2];
    cmodel m[2][2];
    const char *keys[2][2] = {{"te-0", "unet-0"}, {"te-1", "unet-1"}};
    for (int d = 0; d < 2; d++) {
        CHECK_OK(laden_cache_create(8000, 0, &c[d]));
        for (int i = 0; i < 2; i++)
            build(c[d], &m[d][i], keys[d][i], d, 4, 1, FOUR, 10 * d + i + 1);
    }
    for (int round = 0; round < 8; round++) {
        laden_cache_activation_t act;
        int d = round % 2, i = (round / 2) % 2;
        use(c[d], &m[d][i], LADEN_CACHE_AUTO, &act);
        CHECK_EQ(act.mode, LADEN_CACHE_RESIDENT);
        CHECK_EQ(act.evicted_models, 0u);
        CHECK_EQ(act.upload_bytes, round < 4 ? 4000u : 0u);
        for (int k = 0; k < 2; k++)
            check_accounts(c[k], m[k], 2);
    }
    uint32_t at = 99;
    CHECK_OK(laden_cache_roomiest(c, 2, &at));
    CHECK_EQ(at, 0); /* both full: the first */
    CHECK_OK(laden_cache_unbind(c[1], m[1][1].id)); /* its device copy gone */
    CHECK_EQ(held(&m[1][1]), 0);
    CHECK_OK(laden_cache_roomiest(c, 2, &at));
    CHECK_EQ(at, 1); /* cuda:1 has 4000 free */
    CHECK_OK(laden_cache_remove(c[1], m[1][1].id));
    laden_sched_destroy(m[1][1].sc);
    destroy_all(c[0], m[0], 2);
    destroy_all(c[1], m[1], 1);
}

/* A model that gave up part of its blocks keeps the first ones and uploads
 * only the missing ones on its next use. */
static void partial(int32_t dev)
{
    laden_cache_t *c;
    cmodel m[2];
    static const uint64_t SEVEN[7] = {1000, 1000, 1000, 1000,
                                      1000, 1000, 1000};
    CHECK_OK(laden_cache_create(10000, 0, &c));
    build(c, &m[0], "a", dev, 4, 1, FOUR, 11);
    build(c, &m[1], "b", dev, 7, 1, SEVEN, 12);
    laden_cache_activation_t act;
    use(c, &m[0], LADEN_CACHE_AUTO, &act);
    use(c, &m[1], LADEN_CACHE_AUTO, &act);
    CHECK(act.evicted_models == 1 && act.evicted_bytes == 1000);
    CHECK_EQ(held(&m[0]), 3000);
    CHECK(laden_sched_is_resident(m[0].sc, 0) &&
          laden_sched_is_resident(m[0].sc, 2) &&
          !laden_sched_is_resident(m[0].sc, 3));
    use(c, &m[0], LADEN_CACHE_AUTO, &act);
    CHECK(act.upload_bytes == UP(dev, 1000) && act.kept_bytes == 3000);
    CHECK_EQ(held(&m[1]), 6000);
    check_accounts(c, m, 2);
    /* free_vram and drop */
    laden_cache_evict_t ev[4];
    uint32_t n;
    CHECK_OK(laden_cache_free_vram(c, 2500, ev, 4, &n));
    CHECK(n == 1 && ev[0].model == m[1].id && held(&m[1]) == 3000);
    uint64_t freed;
    CHECK_OK(laden_cache_drop(c, m[0].id, UINT64_MAX, 1, &freed));
    CHECK(freed == 4000 && held(&m[0]) == 0);
    check_accounts(c, m, 2);
    use(c, &m[0], LADEN_CACHE_AUTO, &act);
    CHECK_EQ(act.upload_bytes, UP(dev, 4000));
    destroy_all(c, m, 2);
}

TEST(engine_partial_eviction_uploads_only_missing) { test_on_every_device(partial); }

/* Too big for the budget: streamed with what fits resident; forced modes. */
static void streaming(int32_t dev)
{
    laden_cache_t *c;
    cmodel m[2];
    static const uint64_t NINE[9] = {500,  1000, 1000, 1000, 1000,
                                     1000, 1000, 1000, 1000};
    CHECK_OK(laden_cache_create(5000, 0, &c));
    build(c, &m[0], "big", dev, 9, 1, NINE, 21);
    build(c, &m[1], "small", dev, 4, 1, FOUR, 22);
    laden_cache_activation_t act;
    for (int pass = 0; pass < 3; pass++) {
        use(c, &m[0], LADEN_CACHE_AUTO, &act);
        CHECK_EQ(act.mode, LADEN_CACHE_STREAMING);
        CHECK(act.resident_blocks == 2 && act.streamed_blocks == 7);
        CHECK_EQ(act.slot_bytes, 3000);
        CHECK_EQ(held(&m[0]), 500 + 1000 + 3000);
        run(&m[0]); /* idle: still runs from where it was */
        use(c, &m[1], LADEN_CACHE_AUTO, &act);
        CHECK_EQ(act.mode, LADEN_CACHE_RESIDENT);
        check_accounts(c, m, 2);
    }
    /* Forced streaming streams every block; forced resident over the
     * budget is refused, with the model left idle. */
    use(c, &m[1], LADEN_CACHE_STREAMING, &act);
    CHECK(act.mode == LADEN_CACHE_STREAMING && act.resident_blocks == 1);
    laden_cache_evict_t ev[4];
    uint32_t n;
    CHECK_STATUS(laden_cache_activate(c, m[0].id, LADEN_CACHE_RESIDENT, 2, 0,
                                      ev, 4, &n, &act),
                 LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "big");
    laden_cache_info_t info;
    CHECK_OK(laden_cache_info(c, m[0].id, &info));
    CHECK(!info.in_use);
    check_accounts(c, m, 2);
    destroy_all(c, m, 2);
}

TEST(engine_streams_what_does_not_fit) { test_on_every_device(streaming); }

static void misuse(int32_t dev)
{
    laden_cache_t *c;
    cmodel m[2];
    laden_cache_evict_t ev[4];
    uint32_t n;
    CHECK_OK(laden_cache_create(6000, 0, &c));
    build(c, &m[0], "a", dev, 4, 1, FOUR, 31);
    build(c, &m[1], "b", dev, 4, 1, FOUR, 32);
    CHECK_OK(laden_cache_activate(c, m[0].id, 0, 2, 0, ev, 4, &n, NULL));
    CHECK_STATUS(laden_cache_activate(c, m[0].id, 0, 2, 0, ev, 4, &n, NULL),
                 LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "in use");
    CHECK_STATUS(laden_cache_drop(c, m[0].id, UINT64_MAX, 1, NULL),
                 LADEN_E_STATE);
    CHECK_STATUS(laden_cache_unbind(c, m[0].id), LADEN_E_STATE);
    /* The other model cannot take what the one in use holds. */
    CHECK_STATUS(laden_cache_activate(c, m[1].id, LADEN_CACHE_RESIDENT, 2, 0,
                                      ev, 4, &n, NULL),
                 LADEN_E_BUDGET);
    CHECK(held(&m[0]) == 4000 && held(&m[1]) == 0);
    run(&m[0]);
    CHECK_OK(laden_cache_deactivate(c, m[0].id, 0));
    CHECK_STATUS(laden_cache_deactivate(c, m[0].id, 0), LADEN_E_STATE);
    CHECK_STATUS(laden_cache_bind(c, m[0].id, m[0].sc, 1), LADEN_E_STATE);
    CHECK_STATUS(laden_cache_activate(c, m[1].id, 7, 2, 0, ev, 4, &n, NULL),
                 LADEN_E_INVAL);
    /* Residency of a started schedule, pinning of a plain one. */
    CHECK_OK(laden_cache_activate(c, m[1].id, LADEN_CACHE_STREAMING, 1, 0,
                                  ev, 4, &n, NULL));
    CHECK_STATUS(laden_sched_set_resident(m[1].sc, 3, 1), LADEN_E_STATE);
    CHECK_OK(laden_cache_deactivate(c, m[1].id, 0));
    /* Handing a region over: exact sizes only. */
    laden_devptr_t r;
    uint64_t rn;
    CHECK_OK(laden_cache_drop(c, m[1].id, UINT64_MAX, 0, NULL));
    CHECK(!laden_sched_is_resident(m[0].sc, 3)); /* gave way to m[1] */
    CHECK_OK(laden_sched_take_resident(m[0].sc, 3, &r, &rn));
    CHECK(r == 0 && rn == 0); /* not resident: nothing handed over */
    CHECK_OK(laden_sched_take_resident(m[0].sc, 2, &r, &rn));
    if (dev == LADEN_DEVICE_CPU) {
        /* Its host copy was its device copy: nothing to hand over; a
         * region the caller allocated is handed instead. */
        CHECK(!r && !laden_sched_is_resident(m[0].sc, 2));
        CHECK_OK(laden_dev_mem_alloc(dev, rn, &r));
    }
    CHECK(r && rn == 1000 && !laden_sched_is_resident(m[0].sc, 2));
    CHECK_STATUS(laden_sched_set_resident_at(m[1].sc, 1, r, rn - 1),
                 LADEN_E_INVAL);
    CHECK_OK(laden_sched_set_resident_at(m[1].sc, 1, r, rn));
    CHECK_STATUS(laden_sched_set_resident_at(m[1].sc, 1, r, rn),
                 LADEN_E_STATE);
    CHECK_OK(laden_sched_ready(m[1].sc, 0));
    laden_devptr_t p;
    CHECK_OK(laden_sched_tensor_ptr(m[1].sc, 1, 0, &p));
    if (dev != LADEN_DEVICE_CPU) /* the CPU device: its host copy */
        CHECK_EQ(p, r);
    check_bytes(&m[1], 1, p); /* m[1]'s bytes, in m[0]'s old region */
    laden_cache_info_t info;
    CHECK_OK(laden_cache_info(c, m[0].id, &info)); /* before accounting */
    CHECK_OK(laden_cache_drop(c, m[1].id, UINT64_MAX, 0, NULL));
    laden_sched_config plain = {dev, 0, 0, NULL, 0};
    laden_sched_t *ps;
    CHECK_OK(laden_sched_create(&plain, NULL, &ps));
    uint32_t b;
    CHECK_OK(laden_sched_add_block(ps, LADEN_TIER_RAM, &b));
    CHECK_OK(laden_sched_load(ps));
    CHECK_STATUS(laden_sched_set_resident(ps, 0, 1), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_pin(ps, 0, 1), LADEN_E_STATE);
    uint32_t id;
    CHECK_OK(laden_cache_add(c, "plain", 0, &id));
    CHECK_STATUS(laden_cache_bind(c, id, ps, 0), LADEN_E_STATE);
    laden_sched_destroy(ps);
    laden_sched_t *cs;
    laden_sched_config cc = {dev, 0, 0, NULL, LADEN_SCHED_CACHE};
    CHECK_OK(laden_sched_create(&cc, NULL, &cs));
    CHECK_STATUS(laden_sched_add_block(cs, LADEN_TIER_GPU, &b),
                 LADEN_E_INVAL);
    laden_sched_destroy(cs);
    laden_sched_config bad = {dev, 0, 0, NULL, 0x80};
    CHECK_STATUS(laden_sched_create(&bad, NULL, &cs), LADEN_E_INVAL);
    CHECK_OK(laden_cache_remove(c, id));
    destroy_all(c, m, 2);
}

TEST(engine_misuse_is_an_error) { test_on_every_device(misuse); }

/* Pinned copies within their budget: the least recently used idle model
 * is unpinned first, from its last block. */
static void pinning(int32_t dev)
{
    laden_cache_t *c;
    cmodel m[3];
    CHECK_OK(laden_cache_create(0, 6000, &c));
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof key, "p%d", i);
        build(c, &m[i], key, dev, 4, 1, FOUR, 41 + i);
    }
    laden_cache_activation_t act;
    use(c, &m[0], LADEN_CACHE_AUTO, &act);
    CHECK(act.pinned_bytes == 4000 && act.unpinned_bytes == 0);
    use(c, &m[1], LADEN_CACHE_AUTO, &act);
    CHECK(act.pinned_bytes == 4000 && act.unpinned_bytes == 2000);
    CHECK(laden_sched_is_pinned(m[0].sc, 1) &&
          !laden_sched_is_pinned(m[0].sc, 2));
    check_accounts(c, m, 3);
    /* With one model in use holding 4000, the next pins what is left. */
    laden_cache_evict_t ev[4];
    uint32_t n;
    CHECK_OK(laden_cache_activate(c, m[1].id, 0, 2, 0, ev, 4, &n, &act));
    CHECK_OK(laden_cache_activate(c, m[2].id, 0, 2, 0, ev, 4, &n, &act));
    CHECK_EQ(act.pinned_bytes, 2000); /* m[0] gave up its remaining 2000 */
    run(&m[2]);
    check_accounts(c, m, 3);
    CHECK_OK(laden_cache_deactivate(c, m[2].id, 0));
    CHECK_OK(laden_cache_deactivate(c, m[1].id, 0));
    destroy_all(c, m, 3);
}

TEST(engine_pinned_budget) { test_on_every_device(pinning); }

static uint64_t rnd(uint64_t *x)
{
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return *x >> 33;
}

/* Random models, budgets and uses: data always right, accounting always
 * equal to what the schedules hold and within the budgets. */
static void randomized(int32_t dev)
{
    uint64_t x = 777;
    int big_uses = 0;
    bool vmm = true; /* VRAM contexts can be made on this device */
#define RND() rnd(&x)
    for (int run_i = 0; run_i < 12; run_i++) {
        laden_cache_t *c;
        cmodel m[4];
        uint64_t vb = 3000 + RND() % 9000, pb = RND() % 3 ? 2000 + RND() % 8000
                                                          : 0;
        bool big = run_i % 2 == 1;
        if (big) { /* budgets for blocks of megabytes */
            vb *= 1600;
            pb *= 1600;
        }
        CHECK_OK(laden_cache_create(vb, pb, &c));
        int k = 2 + (int)(RND() % 3);
        /* Every other run keeps the device copies in VBARs of a context
         * with room for 1 to 3 of the models' pages (blocks of up to 1.4
         * MiB, pages of 2 MiB): offloaded blocks stream. */
        laden_vram_t *vram = NULL;
        if (big) { /* a device without VMM (the stand-in driver) keeps
                      them outside VBARs: the same uses, no context */
            laden_status vs = laden_vram_create(
                dev, (2 + RND() % 5) << 20, 2 << 20, &vram);
            if (vs == LADEN_E_UNSUPPORTED) {
                vram = NULL;
                vmm = false;
            } else
                CHECK_OK(vs);
        }
        for (int i = 0; i < k; i++) {
            uint64_t sz[MAXB];
            uint32_t nb = 2 + (uint32_t)(RND() % (big ? 3 : 8));
            for (uint32_t b = 0; b < nb; b++)
                sz[b] = 1 + RND() % (big ? 1400000 : 900);
            char key[16];
            snprintf(key, sizeof key, "r%d", i);
            build(c, &m[i], key, dev, nb, 1 + (uint32_t)(RND() % 2), sz,
                  100 + run_i * 10 + i);
            if (vram)
                CHECK_OK(laden_sched_use_vram(m[i].sc, vram));
        }
        bool busy[4] = {0};
        for (int step = 0; step < 40; step++) {
            int i = (int)(RND() % (uint64_t)k);
            laden_cache_evict_t ev[8];
            uint32_t n;
            if (busy[i]) {
                run(&m[i]);
                CHECK_OK(laden_cache_deactivate(c, m[i].id, 0));
                busy[i] = false;
            } else if (RND() % 5 == 0) {
                uint64_t drop = RND() % 3000;
                int unpin = (int)(RND() % 2);
                CHECK_OK(laden_cache_drop(c, m[i].id, drop, unpin, NULL));
            } else {
                laden_cache_mode mode = (laden_cache_mode)(RND() % 3);
                int s = laden_cache_activate(c, m[i].id, mode,
                                             1 + (uint32_t)(RND() % 3), 0, ev,
                                             8, &n, NULL);
                if (s == LADEN_E_BUDGET) {
                    laden_cache_info_t info;
                    CHECK_OK(laden_cache_info(c, m[i].id, &info));
                    CHECK(!info.in_use);
                } else {
                    CHECK_OK(s);
                    for (uint32_t e = 0; e < n; e++)
                        CHECK(!busy[ev[e].model]);
                    run(&m[i]);
                    busy[i] = true;
                    big_uses += vram != NULL;
                }
            }
            check_accounts(c, m, k);
        }
        for (int i = 0; i < k; i++)
            if (busy[i])
                CHECK_OK(laden_cache_deactivate(c, m[i].id, 0));
        destroy_all(c, m, k);
        laden_vram_destroy(vram);
    }
    CHECK(!vmm || big_uses > 20); /* the VBAR runs did activate models */
#undef RND
}

TEST(engine_random_invariants) { test_on_every_device(randomized); }

/* Host copies within a RAM budget: whole idle models, LRU first. */
TEST(engine_plan_host)
{
    laden_cache_t *c;
    cmodel m[3];
    laden_cache_evict_t ev[4];
    laden_cache_host_evict_t hv[4];
    uint32_t n;
    CHECK_OK(laden_cache_create(0, 0, &c));
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof key, "h%d", i);
        build(c, &m[i], key, LADEN_DEVICE_CPU, 4, 1, FOUR, 51 + i);
    }
    laden_cache_activation_t act;
    use(c, &m[1], 0, &act);
    use(c, &m[0], 0, &act);
    use(c, &m[2], 0, &act);
    /* 12000 held; 3000 more within 13000: the LRU idle model goes. */
    CHECK_OK(laden_cache_plan_host_group(c, UINT32_MAX, 13000, 3000, hv, 4, &n));
    CHECK(n == 1 && hv[0].cache == c && hv[0].model == m[1].id &&
          hv[0].drop_bytes == 4000);
    CHECK_OK(laden_cache_plan_host_group(c, m[1].id, 13000, 3000, hv, 4, &n));
    CHECK(n == 1 && hv[0].model == m[0].id);
    CHECK_OK(laden_cache_plan_host_group(c, UINT32_MAX, 20000, 3000, hv, 4, &n));
    CHECK_EQ(n, 0);
    /* A model whose host copy is the only copy of its weights (trained)
     * is never chosen: the next least recently used goes instead, and
     * where only it could make room the budget is refused, naming it. */
    CHECK_STATUS(laden_cache_keep_host(c, 99, 1), LADEN_E_INVAL);
    CHECK_OK(laden_cache_keep_host(c, m[1].id, 1));
    CHECK_OK(laden_cache_plan_host_group(c, UINT32_MAX, 13000, 3000, hv, 4, &n));
    CHECK(n == 1 && hv[0].model == m[0].id);
    CHECK_OK(laden_cache_plan_host_group(c, UINT32_MAX, 9000, 3000, hv, 4, &n));
    CHECK(n == 2 && hv[0].model == m[0].id && hv[1].model == m[2].id);
    CHECK_STATUS(laden_cache_plan_host_group(c, UINT32_MAX, 5000, 3000, hv, 4,
                                             &n), LADEN_E_BUDGET);
    CHECK(strstr(laden_last_error(), "trainable") != NULL);
    CHECK_EQ(n, 0);
    CHECK_OK(laden_cache_keep_host(c, m[1].id, 0));
    CHECK_OK(laden_cache_plan_host_group(c, UINT32_MAX, 13000, 3000, hv, 4, &n));
    CHECK(n == 1 && hv[0].model == m[1].id);
    CHECK_OK(laden_cache_activate(c, m[2].id, 0, 2, 0, ev, 4, &n, NULL));
    CHECK_STATUS(laden_cache_plan_host_group(c, UINT32_MAX, 5000, 3000, hv, 4, &n),
                 LADEN_E_BUDGET);
    CHECK_OK(laden_cache_deactivate(c, m[2].id, 0));
    destroy_all(c, m, 3);
}

/* One host policy over models and host entries (adapters as read) under
 * a RAM budget: idle entries give way first, least recently used first,
 * down to what the budget leaves after the models, the need and the kept
 * entries; then whole idle models for what is still over.  Entries
 * registered through a cache of no models that the models' cache joined,
 * as a ModelCache does. */
TEST(engine_plan_host_entries_before_models)
{
    laden_cache_t *h, *c;
    cmodel m[3];
    laden_cache_evict_t ev[4];
    laden_cache_host_evict_t hv[4];
    uint32_t e0, e1, drop[4], nd, n;
    CHECK_OK(laden_cache_create(0, 0, &h));
    CHECK_OK(laden_cache_create(0, 0, &c));
    CHECK_OK(laden_cache_join(c, h));
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof key, "h%d", i);
        build(c, &m[i], key, LADEN_DEVICE_CPU, 4, 1, FOUR, 71 + i);
    }
    laden_cache_activation_t act;
    use(c, &m[1], 0, &act);
    use(c, &m[0], 0, &act);
    use(c, &m[2], 0, &act); /* m[1] is the least recently used */
    CHECK_OK(laden_cache_host_add(h, 1000, &e0));
    CHECK_OK(laden_cache_host_add(h, 2000, &e1));
    CHECK_OK(laden_cache_host_touch(h, e0)); /* e1 the least recent */
    /* 12000 of models and 3000 of entries fit 16000. */
    CHECK_OK(laden_cache_plan_host(h, UINT32_MAX, 16000, 0, NULL, 0, drop, 4,
                                   &nd, hv, 4, &n));
    CHECK(nd == 0 && n == 0);
    /* 14000: entries get 2000; e1 goes, e0 is left; the models fit. */
    CHECK_OK(laden_cache_plan_host(h, UINT32_MAX, 14000, 0, NULL, 0, drop, 4,
                                   &nd, hv, 4, &n));
    CHECK(nd == 1 && drop[0] == e1 && n == 0);
    /* e1 kept: e0 goes instead, and 12000 + 2000 fit. */
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, 14000, 0, &e1, 1, drop, 4,
                                   &nd, hv, 4, &n));
    CHECK(nd == 1 && drop[0] == e0 && n == 0);
    /* 1000 more within 13000 with e1 kept: e0 goes, then the least
     * recently used idle model for the 2000 still over. */
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, 13000, 1000, &e1, 1, drop,
                                   4, &nd, hv, 4, &n));
    CHECK(nd == 1 && drop[0] == e0);
    CHECK(n == 1 && hv[0].cache == c && hv[0].model == m[1].id &&
          hv[0].drop_bytes == 4000);
    CHECK_OK(laden_cache_plan_host(c, m[1].id, 13000, 1000, &e1, 1, drop, 4,
                                   &nd, hv, 4, &n));
    CHECK(n == 1 && hv[0].model == m[0].id);
    /* No budget: entries within their idle limit, no model chosen. */
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, LADEN_CACHE_RAM_UNLIMITED,
                                   1ull << 40, NULL, 0, drop, 4, &nd, hv, 4,
                                   &n));
    CHECK(nd == 0 && n == 0);
    /* Even every idle model would not make room: the entries' decision
     * stands, no model is chosen. */
    CHECK_OK(laden_cache_activate(c, m[2].id, 0, 2, 0, ev, 4, &n, NULL));
    CHECK_STATUS(laden_cache_plan_host(c, UINT32_MAX, 5000, 0, &e1, 1, drop,
                                       4, &nd, hv, 4, &n),
                 LADEN_E_BUDGET);
    CHECK(nd == 1 && drop[0] == e0 && n == 0);
    CHECK_CONTAINS(laden_last_error(), "do not fit the RAM budget");
    /* Room for fewer model decisions than needed: nothing decided. */
    CHECK_STATUS(laden_cache_plan_host(c, UINT32_MAX, 9000, 0, &e1, 1, drop,
                                       4, &nd, hv, 1, &n),
                 LADEN_E_INVAL);
    CHECK(nd == 0 && n == 0);
    CHECK_OK(laden_cache_deactivate(c, m[2].id, 0));
    laden_cache_destroy(h);
    destroy_all(c, m, 3);
}

/* Whether an activation may take device memory from idle models: only
 * when the model is not whole on the device and the budget's free room is
 * less than what it lacks; never without a budget or in a VRAM context
 * (engine_models_in_vbars). */
static void may_evict(int32_t dev)
{
    laden_cache_t *c, *open;
    cmodel m[3], x;
    int32_t may = -1;
    CHECK_OK(laden_cache_create(8000, 0, &c));
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof key, "e%d", i);
        build(c, &m[i], key, dev, 4, 1, FOUR, 81 + i);
    }
    CHECK_OK(laden_cache_may_evict(c, m[0].id, &may));
    CHECK_EQ(may, 0); /* 8000 free for 4000 */
    laden_cache_activation_t act;
    use(c, &m[0], LADEN_CACHE_AUTO, &act);
    use(c, &m[1], LADEN_CACHE_AUTO, &act);
    CHECK_OK(laden_cache_may_evict(c, m[0].id, &may));
    CHECK_EQ(may, 0); /* whole on the device */
    CHECK_OK(laden_cache_may_evict(c, m[2].id, &may));
    CHECK_EQ(may, 1); /* lacks 4000, none free */
    uint64_t freed;
    CHECK_OK(laden_cache_drop(c, m[1].id, 1000, 0, &freed));
    CHECK_OK(laden_cache_may_evict(c, m[1].id, &may));
    CHECK_EQ(may, 0); /* lacks 1000, 1000 free */
    CHECK_OK(laden_cache_may_evict(c, m[2].id, &may));
    CHECK_EQ(may, 1);
    uint32_t unbound;
    CHECK_OK(laden_cache_add(c, "unbound", 0, &unbound));
    CHECK_STATUS(laden_cache_may_evict(c, unbound, &may), LADEN_E_STATE);
    CHECK_EQ(may, 0);
    CHECK_STATUS(laden_cache_may_evict(c, m[0].id, NULL), LADEN_E_INVAL);
    CHECK_OK(laden_cache_remove(c, unbound));
    destroy_all(c, m, 3);
    CHECK_OK(laden_cache_create(0, 0, &open)); /* no budget */
    build(open, &x, "x", dev, 4, 1, FOUR, 85);
    CHECK_OK(laden_cache_may_evict(open, x.id, &may));
    CHECK_EQ(may, 0);
    destroy_all(open, &x, 1);
}

TEST(engine_may_evict) { test_on_every_device(may_evict); }

/* The caches of a host's devices as one group: the pinned budget is the
 * group's (a model pinned on one device unpins idle models of another),
 * recency compares across the caches, and the RAM budget's decisions take
 * the least recently used idle model of any cache.  On every device; the
 * second cache is on another device where there is one. */
static void group(int32_t dev)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    int32_t other = dev >= 0 && n >= 2 ? (dev + 1) % n : dev;
    laden_cache_t *c[2], *lone;
    cmodel a, b;
    CHECK_OK(laden_cache_create(0, 6000, &c[0]));
    CHECK_OK(laden_cache_create(0, 6000, &c[1]));
    CHECK_OK(laden_cache_create(0, 5000, &lone));
    CHECK_STATUS(laden_cache_join(c[1], c[1]), LADEN_E_INVAL);
    CHECK_STATUS(laden_cache_join(NULL, c[0]), LADEN_E_INVAL);
    CHECK_STATUS(laden_cache_join(c[1], NULL), LADEN_E_INVAL);
    CHECK_STATUS(laden_cache_join(lone, c[0]), LADEN_E_INVAL); /* budgets */
    CHECK_CONTAINS(laden_last_error(), "pinned budgets differ");
    CHECK_OK(laden_cache_join(c[1], c[0]));
    CHECK_STATUS(laden_cache_join(c[1], c[0]), LADEN_E_STATE);
    build(c[0], &a, "a", dev, 4, 1, FOUR, 61);
    build(c[1], &b, "b", other, 4, 1, FOUR, 62);
    if (other != dev) { /* a cache is one device's */
        cmodel x;
        laden_cache_t *solo;
        CHECK_OK(laden_cache_create(0, 6000, &solo));
        build(solo, &x, "x", dev, 4, 1, FOUR, 63);
        laden_sched_config cfg = {other, 0, 0, NULL, LADEN_SCHED_CACHE};
        laden_sched_t *sc;
        uint32_t bi, ti, xid;
        unsigned char bytes[64] = {0};
        CHECK_OK(laden_sched_create(&cfg, NULL, &sc));
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &bi));
        CHECK_OK(laden_sched_add_host_tensor(sc, bi, bytes, LADEN_DTYPE_U8,
                                             64, LADEN_DTYPE_U8, &ti));
        CHECK_OK(laden_sched_load(sc));
        CHECK_OK(laden_cache_add(solo, "elsewhere", 0, &xid));
        CHECK_STATUS(laden_cache_bind(solo, xid, sc, 0), LADEN_E_INVAL);
        CHECK_CONTAINS(laden_last_error(), "a cache is one device's");
        /* Still its device's once its models are gone. */
        CHECK_OK(laden_cache_unbind(solo, x.id));
        CHECK_OK(laden_cache_remove(solo, x.id));
        laden_sched_destroy(x.sc);
        CHECK_STATUS(laden_cache_bind(solo, xid, sc, 0), LADEN_E_INVAL);
        CHECK_OK(laden_cache_remove(solo, xid));
        laden_sched_destroy(sc);
        laden_cache_destroy(solo);
    }
    uint32_t id;
    CHECK_OK(laden_cache_add(lone, "late", 0, &id));
    laden_cache_t *third;
    CHECK_OK(laden_cache_create(0, 6000, &third));
    CHECK_STATUS(laden_cache_join(lone, third), LADEN_E_STATE); /* models */
    laden_cache_activation_t act;
    use(c[0], &a, LADEN_CACHE_AUTO, &act);
    CHECK(act.pinned_bytes == 4000 && act.unpinned_bytes == 0);
    use(c[1], &b, LADEN_CACHE_AUTO, &act); /* a, idle on the other cache */
    CHECK(act.pinned_bytes == 4000 && act.unpinned_bytes == 2000);
    laden_cache_stats_t s0, s1;
    CHECK_OK(laden_cache_stats(c[0], &s0));
    CHECK_OK(laden_cache_stats(c[1], &s1));
    CHECK_EQ(s0.pinned_bytes, 2000);
    CHECK_EQ(s1.pinned_bytes, 4000);
    CHECK_EQ(s1.pinned_budget_bytes, 6000);
    check_accounts(c[0], &a, 1);
    check_accounts(c[1], &b, 1);
    /* b was used last: a, on the other cache, is the one to go. */
    laden_cache_host_evict_t hv[2];
    uint32_t k;
    CHECK_OK(laden_cache_plan_host_group(c[1], UINT32_MAX, 9000, 2000, hv, 2, &k));
    CHECK(k == 1 && hv[0].cache == c[0] && hv[0].model == a.id);
    CHECK_OK(laden_cache_plan_host_group(c[0], a.id, 9000, 2000, hv, 2, &k));
    CHECK(k == 1 && hv[0].cache == c[1] && hv[0].model == b.id);
    CHECK_OK(laden_cache_plan_host_group(c[0], UINT32_MAX, 9000, 1000, hv, 2, &k));
    CHECK_EQ(k, 0); /* 8000 held of both caches, 1000 more fit */
    /* Room for fewer decisions than needed: refused, nothing decided. */
    CHECK_STATUS(laden_cache_plan_host_group(c[0], UINT32_MAX, 4000, 4000,
                                             hv, 1, &k),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "more than 1 evictions");
    CHECK_EQ(k, 0);
    CHECK_STATUS(laden_cache_plan_host_group(c[0], UINT32_MAX, 4000, 9000,
                                             hv, 2, &k),
                 LADEN_E_BUDGET); /* even both would not make room */
    CHECK_CONTAINS(laden_last_error(), "do not fit the RAM budget");
    laden_cache_destroy(third);
    CHECK_OK(laden_cache_remove(lone, id));
    laden_cache_destroy(lone);
    destroy_all(c[1], &b, 1); /* leaves the group; c[0] goes on alone */
    use(c[0], &a, LADEN_CACHE_AUTO, &act);
    CHECK_EQ(act.pinned_bytes, 2000);
    destroy_all(c[0], &a, 1);
}

TEST(engine_caches_of_a_host_share_its_memory) { test_on_every_device(group); }

/* Block by block: each host copy usable as soon as it is loaded, so the
 * caller can release its sources block by block. */
TEST(engine_load_block_by_block)
{
    laden_sched_config cfg = {LADEN_DEVICE_CPU, 0, 0, NULL, LADEN_SCHED_CACHE};
    laden_sched_t *sc;
    unsigned char src[3][700];
    CHECK_OK(laden_sched_create(&cfg, NULL, &sc));
    for (uint32_t b = 0; b < 3; b++) {
        uint32_t bi, ti;
        for (int j = 0; j < 700; j++)
            src[b][j] = val(7, b, (uint64_t)j);
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &bi));
        CHECK_OK(laden_sched_add_host_tensor(sc, bi, src[b], LADEN_DTYPE_U8,
                                             700, LADEN_DTYPE_U8, &ti));
    }
    CHECK_STATUS(laden_sched_load_block(sc, 3), LADEN_E_INVAL);
    CHECK_OK(laden_sched_load_block(sc, 2));
    memset(src[2], 0, sizeof src[2]); /* the source may go now */
    void *hp;
    CHECK_OK(laden_sched_host_ptr(sc, 2, 0, &hp));
    CHECK(hp && ((unsigned char *)hp)[5] == val(7, 2, 5));
    CHECK_STATUS(laden_sched_host_ptr(sc, 0, 0, &hp), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_load_block(sc, 2), LADEN_E_STATE);
    uint32_t extra;
    CHECK_STATUS(laden_sched_add_block(sc, LADEN_TIER_RAM, &extra),
                 LADEN_E_STATE);
    CHECK_STATUS(laden_sched_set_resident(sc, 2, 1), LADEN_E_STATE);
    CHECK_OK(laden_sched_load_block(sc, 0));
    CHECK_OK(laden_sched_load(sc)); /* the rest */
    CHECK_STATUS(laden_sched_load(sc), LADEN_E_STATE);
    for (uint32_t b = 0; b < 2; b++) {
        CHECK_OK(laden_sched_host_ptr(sc, b, 0, &hp));
        CHECK_EQ(memcmp(hp, src[b], 700), 0);
    }
    laden_sched_destroy(sc);
    laden_sched_config plain = {LADEN_DEVICE_CPU, 0, 0, NULL, 0};
    CHECK_OK(laden_sched_create(&plain, NULL, &sc));
    CHECK_STATUS(laden_sched_load_block(sc, 0), LADEN_E_STATE);
    laden_sched_destroy(sc);
}

/* Cache models whose device copies live in VBARs of one VRAM context:
 * a model the cache evicted keeps its pages while the budget has room,
 * and its next use copies nothing; under pressure the VBAR of the least
 * recently used model gives way; a block the budget has no room for
 * streams. */
static void in_vbars(int32_t dev)
{
    const uint64_t MB = 1ull << 20;
    laden_vram_t *vram;
    if (laden_vram_create(dev, 6 * MB, 2 * MB, &vram) == LADEN_E_UNSUPPORTED)
        return;
    laden_cache_t *c;
    cmodel m[3];
    const uint64_t TWO[2] = {MB, MB}; /* one 2 MiB page per model */
    CHECK_OK(laden_cache_create(4 * MB, 0, &c)); /* the cache holds two */
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof key, "v%d", i);
        build(c, &m[i], key, dev, 2, 1, TWO, 61 + i);
        CHECK_OK(laden_sched_use_vram(m[i].sc, vram));
    }
    laden_cache_activation_t act;
    for (int i = 0; i < 3; i++) { /* the third evicts (unpins) the first */
        use(c, &m[i], LADEN_CACHE_AUTO, &act);
        CHECK_EQ(act.upload_bytes, 2 * MB);
    }
    CHECK_EQ(held(&m[0]), 0);
    /* Its pages are the context's to take, not the cache's. */
    int32_t may = -1;
    CHECK_OK(laden_cache_may_evict(c, m[0].id, &may));
    CHECK_EQ(may, 0);
    /* The budget of the VRAM context (3 pages) kept m[0]'s page: using it
     * again copies nothing. */
    use(c, &m[0], LADEN_CACHE_AUTO, &act);
    CHECK(act.upload_bytes == 0 && act.kept_bytes == 2 * MB);
    check_accounts(c, m, 3);
    /* Pressure from elsewhere: unpinned pages go, least recently
     * prioritized VBAR first (m[1]'s), and that model copies again. */
    uint64_t freed;
    CHECK_OK(laden_vram_free_memory(vram, 2 * MB, &freed));
    CHECK_EQ(freed, 2 * MB);
    use(c, &m[1], LADEN_CACHE_AUTO, &act);
    CHECK(act.upload_bytes == 2 * MB && act.kept_bytes == 0);
    check_accounts(c, m, 3);
    /* A budget below one page: a model whose parts outside its blocks
     * cannot be faulted in cannot run; the error says so. */
    CHECK_OK(laden_vram_set_budget(vram, MB));
    CHECK_OK(laden_vram_free_memory(vram, UINT64_MAX, NULL));
    laden_cache_evict_t ev[4];
    uint32_t n;
    CHECK_STATUS(laden_cache_activate(c, m[2].id, 0, 2, 0, ev, 4, &n, &act),
                 LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "outside its blocks");
    laden_cache_info_t info;
    CHECK_OK(laden_cache_info(c, m[2].id, &info));
    CHECK(!info.in_use);
    check_accounts(c, m, 3);
    for (int i = 0; i < 3; i++) {
        CHECK_OK(laden_cache_unbind(c, m[i].id));
        CHECK_OK(laden_cache_remove(c, m[i].id));
        laden_sched_destroy(m[i].sc);
    }
    laden_cache_destroy(c);
    laden_vram_info_t vi;
    CHECK_OK(laden_vram_info(vram, &vi));
    CHECK(vi.vbars == 0 && vi.mapped_bytes == 0);
    laden_vram_destroy(vram);
}

TEST(engine_models_in_vbars) { test_on_every_device(in_vbars); }

/* A block the VRAM budget has no room for streams through a slot. */
static void offloaded_streams(int32_t dev)
{
    const uint64_t MB = 1ull << 20;
    laden_vram_t *vram;
    /* Room for two pages and two slots of 1.5 MiB (one more than the
     * last page). */
    if (laden_vram_create(dev, 5 * MB, 2 * MB, &vram) == LADEN_E_UNSUPPORTED)
        return;
    laden_cache_t *c;
    cmodel m;
    /* Blocks of 1.5 MiB: the first in page 0, the second across pages 0
     * and 1, the third in pages 1 and 2.  The second gets its pages, the
     * third does not; then the slots do not fit, so the second streams
     * too and its page makes room for them. */
    const uint64_t SIZES[3] = {3 * MB / 2, 3 * MB / 2, 3 * MB / 2};
    CHECK_OK(laden_cache_create(0, 0, &c));
    build(c, &m, "big", dev, 3, 1, SIZES, 71);
    CHECK_OK(laden_sched_use_vram(m.sc, vram));
    laden_cache_activation_t act;
    for (int pass = 0; pass < 3; pass++) {
        use(c, &m, LADEN_CACHE_RESIDENT, &act); /* run() checks the bytes */
        CHECK_EQ(act.offloaded_blocks, 2);
        CHECK(laden_sched_is_resident(m.sc, 0) &&
              !laden_sched_is_resident(m.sc, 1));
    }
    CHECK_OK(laden_cache_unbind(c, m.id));
    laden_sched_destroy(m.sc);
    laden_cache_destroy(c);
    laden_vram_destroy(vram);
}

TEST(engine_offloaded_block_streams) { test_on_every_device(offloaded_streams); }

/* laden_sched_use_vram refuses what it cannot do, naming why. */
TEST(engine_use_vram_errors)
{
    const uint64_t MB = 1ull << 20;
    laden_vram_t *vram;
    CHECK_OK(laden_vram_create(LADEN_DEVICE_CPU, 8 * MB, 2 * MB, &vram));
    laden_cache_t *c;
    cmodel m;
    CHECK_OK(laden_cache_create(0, 0, &c));
    build(c, &m, "u", LADEN_DEVICE_CPU, 2, 1, FOUR, 81);
    CHECK_STATUS(laden_sched_use_vram(NULL, vram), LADEN_E_INVAL);
    laden_cache_activation_t act;
    use(c, &m, LADEN_CACHE_AUTO, &act); /* now it holds device memory */
    CHECK_STATUS(laden_sched_use_vram(m.sc, vram), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "holds device memory");
    CHECK_OK(laden_cache_drop(c, m.id, UINT64_MAX, 0, NULL));
    CHECK_OK(laden_sched_use_vram(m.sc, vram));
    CHECK(laden_sched_vbar(m.sc) != NULL);
    /* In a VBAR, device regions are not handed over. */
    CHECK_STATUS(laden_sched_set_resident_at(m.sc, 1, 4096, 1000),
                 LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "VBAR");
    CHECK_OK(laden_sched_use_vram(m.sc, NULL)); /* back to allocations */
    CHECK_EQ(laden_sched_vbar(m.sc), NULL);
    laden_sched_config plain = {LADEN_DEVICE_CPU, 0, 0, NULL, 0};
    laden_sched_t *ps;
    uint32_t b;
    CHECK_OK(laden_sched_create(&plain, NULL, &ps));
    CHECK_OK(laden_sched_add_block(ps, LADEN_TIER_RAM, &b));
    CHECK_OK(laden_sched_load(ps));
    CHECK_STATUS(laden_sched_use_vram(ps, vram), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "before load");
    laden_sched_destroy(ps);
    CHECK_OK(laden_cache_unbind(c, m.id));
    laden_sched_destroy(m.sc);
    laden_cache_destroy(c);
    laden_vram_destroy(vram);
}
