/* The streaming engine on every device: bytes in the slot are the block's
 * bytes whatever the call order, prefetch hides the copies in order, errors
 * from the file come back at enter, and nothing leaks. */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

#include "laden/dev.h"
#include "laden/host.h"
#include "laden/stream.h"
#include "laden/trace.h"
#include "stream/stream_internal.h" /* load.stage_bytes, to stage in pieces */
#include "stream/stream_share.h"    /* laden__share_prepared_wait_ms */
#include "io/cold.h" /* laden__io_misplaced_bytes */

#define NB 7

/* Block i has tensors "blocks.i.a" (U8, 1000+137*i bytes) and "blocks.i.b"
 * (U8, 4096*(i+1) bytes); "embed" is outside the blocks.  Byte j of a
 * tensor t is a hash of (t, j). */
static unsigned char val(int t, uint64_t j)
{
    uint64_t x = (j + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t)(t + 1) * 77;
    return (unsigned char)(x >> 29);
}

static uint64_t sz(int t) /* t = 2*i (a) or 2*i+1 (b); 2*NB: embed */
{
    if (t == 2 * NB)
        return 3000;
    return t % 2 ? 4096u * (uint64_t)(t / 2 + 1) : 1000u + 137u * (uint64_t)(t / 2);
}

static char *write_model(void)
{
    char hdr[8192] = "{";
    uint64_t off = 0;
    for (int t = 0; t <= 2 * NB; t++) {
        char e[256];
        char name[64];
        if (t == 2 * NB)
            snprintf(name, sizeof name, "embed");
        else
            snprintf(name, sizeof name, "blocks.%d.%c", t / 2, t % 2 ? 'b' : 'a');
        snprintf(e, sizeof e,
                 "%s\"%s\":{\"dtype\":\"U8\",\"shape\":[%llu],"
                 "\"data_offsets\":[%llu,%llu]}",
                 t ? "," : "", name, (unsigned long long)sz(t),
                 (unsigned long long)off, (unsigned long long)(off + sz(t)));
        strcat(hdr, e);
        off += sz(t);
    }
    strcat(hdr, "}");
    unsigned char *data = malloc(off);
    uint64_t at = 0;
    for (int t = 0; t <= 2 * NB; t++)
        for (uint64_t j = 0; j < sz(t); j++)
            data[at++] = val(t, j);
    char *p = test_path("model.safetensors");
    test_write_st(p, hdr, data, off);
    free(data);
    return p;
}

typedef struct {
    laden_sched_t *sc;
    laden_st_t *st;
    int32_t dev;
    uint32_t block_of[NB + 1]; /* block index of model block i; NB: embed */
    laden_dev_stream_t *rd;    /* reads back on the compute stream */
    unsigned char *buf;
} model;

static void build_from(model *m, const char *path, int32_t dev,
                       const laden_tier tiers[NB], uint64_t ram_budget)
{
    memset(m, 0, sizeof *m);
    m->dev = dev;
    CHECK_OK(laden_st_open(path, &m->st));
    laden_sched_config cfg = {.device = dev, .lookahead = 2,
                              .ram_budget_bytes = ram_budget};
    CHECK_OK(laden_sched_create(&cfg, m->st, &m->sc));
    for (int i = 0; i <= NB; i++) {
        laden_tier tier = i == NB ? LADEN_TIER_GPU : tiers[i];
        CHECK_OK(laden_sched_add_block(m->sc, tier, &m->block_of[i]));
        for (int k = 0; k < (i == NB ? 1 : 2); k++) {
            size_t idx;
            uint32_t ti;
            char name[64];
            if (i == NB)
                snprintf(name, sizeof name, "embed");
            else
                snprintf(name, sizeof name, "blocks.%d.%c", i, k ? 'b' : 'a');
            CHECK_OK(laden_st_find(m->st, name, &idx));
            CHECK_OK(laden_sched_add_tensor(m->sc, m->block_of[i], m->st, idx,
                                            LADEN_DTYPE_U8, &ti));
            CHECK_EQ(ti, (uint32_t)k);
        }
    }
    if (dev != LADEN_DEVICE_CPU)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &m->rd));
    m->buf = malloc(1 << 20);
}

static void build(model *m, int32_t dev, const laden_tier tiers[NB],
                  uint64_t ram_budget)
{
    build_from(m, write_model(), dev, tiers, ram_budget);
}

static void destroy(model *m)
{
    laden_sched_destroy(m->sc);
    laden_dev_stream_destroy(m->rd);
    laden_st_close(m->st);
    free(m->buf);
}

/* Runs model block i as a kernel would: enter, read its bytes where the
 * schedule says they are, check them, exit (on stream exit_on). */
static void run_block_exit_on(model *m, int i, uintptr_t exit_on)
{
    uint32_t b = m->block_of[i];
    CHECK_OK(laden_sched_enter(m->sc, b, 0));
    for (int k = 0; k < (i == NB ? 1 : 2); k++) {
        int t = i == NB ? 2 * NB : 2 * i + k;
        laden_devptr_t p;
        CHECK_OK(laden_sched_tensor_ptr(m->sc, b, (uint32_t)k, &p));
        CHECK_EQ(p % 256, 0);
        if (m->rd) {
            CHECK_EQ(test_cuda_device_of(p), m->dev); /* on its device */
            CHECK_OK(laden_dev_copy_d2h(m->rd, m->buf, p, sz(t)));
            CHECK_OK(laden_dev_stream_synchronize(m->rd));
        } else {
            memcpy(m->buf, (void *)(uintptr_t)p, sz(t));
        }
        for (uint64_t j = 0; j < sz(t); j++)
            if (m->buf[j] != val(t, j)) {
                fprintf(stderr, "device %d block %d tensor %d byte %llu wrong\n",
                        m->dev, i, k, (unsigned long long)j);
                exit(1);
            }
    }
    CHECK_OK(laden_sched_exit(m->sc, b, exit_on));
}

static void run_block(model *m, int i)
{
    run_block_exit_on(m, i, 0);
}


static const laden_tier MIXED[NB] = {LADEN_TIER_RAM,  LADEN_TIER_DISK,
                                     LADEN_TIER_GPU,  LADEN_TIER_DISK,
                                     LADEN_TIER_RAM,  LADEN_TIER_DISK,
                                     LADEN_TIER_RAM};

static void orders(int32_t dev)
{
    static const laden_tier ALL[3][NB] = {
        {LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM,
         LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM},
        {LADEN_TIER_DISK, LADEN_TIER_DISK, LADEN_TIER_DISK, LADEN_TIER_DISK,
         LADEN_TIER_DISK, LADEN_TIER_DISK, LADEN_TIER_DISK},
        {0}};
    for (int variant = 0; variant < 3; variant++) {
        model m;
        build(&m, dev, variant == 2 ? MIXED : ALL[variant], 0);
        CHECK_OK(laden_sched_load(m.sc));
        CHECK_OK(laden_sched_start(m.sc, 0));
        laden_sched_stats_t st;
        uint64_t misses_turn = 0;
        /* In order, several passes: every block prefetched in time. */
        for (int pass = 0; pass < 3; pass++) {
            run_block(&m, NB);
            for (int i = 0; i < NB; i++)
                run_block(&m, i);
        }
        CHECK_OK(laden_sched_stats(m.sc, &st));
        CHECK_EQ(st.misses, 0);
        /* In reverse (a backward's recomputation), several passes: the
         * prefetches turn with the order; only the turn itself may miss. */
        for (int pass = 0; pass < 3; pass++) {
            for (int i = NB - 1; i >= 0; i--)
                run_block(&m, i);
            run_block(&m, NB);
            CHECK_OK(laden_sched_stats(m.sc, &st));
            if (pass == 0)
                CHECK(st.misses <= 1);
            else
                CHECK_EQ(st.misses, misses_turn);
            misses_turn = st.misses;
        }
        /* And forward again. */
        for (int pass = 0; pass < 2; pass++) {
            run_block(&m, NB);
            for (int i = 0; i < NB; i++)
                run_block(&m, i);
        }
        CHECK_OK(laden_sched_stats(m.sc, &st));
        CHECK(st.misses <= misses_turn + 1);
        uint64_t misses_before = st.misses;
        /* Reversed, repeated, skipping, random: correct, only slower. */
        for (int i = NB - 1; i >= 0; i--)
            run_block(&m, i);
        run_block(&m, 3);
        run_block(&m, 3);
        run_block(&m, 0);
        run_block(&m, 6);
        unsigned seed = 12345;
        for (int r = 0; r < 40; r++) {
            seed = seed * 1103515245u + 12345u;
            run_block(&m, (int)((seed >> 16) % (NB + 1)));
        }
        CHECK_OK(laden_sched_stats(m.sc, &st));
        if (st.enters) { /* on the CPU device the RAM tier runs in place */
            if (variant < 2) /* more streamed blocks than slots */
                CHECK(st.misses > misses_before);
            CHECK_EQ(st.nslots, 3);
            CHECK(variant == 2 || st.slot_bytes >= 4096u * NB);
        }
        CHECK_OK(laden_sched_synchronize(m.sc));
        destroy(&m);
    }
}

TEST(stream_any_call_order) { test_on_every_device(orders); }

/* Streamed bytes of one pass over every block (each once). */
static uint64_t streamed_bytes(model *m)
{
    uint64_t n = 0;
    for (int i = 0; i < NB; i++)
        if (laden_sched_is_streamed(m->sc, m->block_of[i]))
            n += laden_sched_block_bytes(m->sc, m->block_of[i]);
    return n;
}

/* One pass in `order` (n blocks); *misses and *moved get what it missed
 * and copied (read from disk on the CPU device, into slots on CUDA). */
static void pass_in(model *m, const int *order, int n, uint64_t *misses,
                    uint64_t *moved)
{
    laden_sched_stats_t a, b;
    CHECK_OK(laden_sched_stats(m->sc, &a));
    for (int k = 0; k < n; k++)
        run_block(m, order[k]);
    /* The next pass's first blocks, prefetched, counted in this one: in
     * the steady state a pass then moves each streamed block once. */
    CHECK_OK(laden_sched_synchronize(m->sc));
    CHECK_OK(laden_sched_stats(m->sc, &b));
    *misses = b.misses - a.misses;
    *moved = m->dev == LADEN_DEVICE_CPU ? b.read_bytes - a.read_bytes
                                        : b.h2d_bytes - a.h2d_bytes;
}

/* Blocks called in another order than they were added (a UNet's resnets
 * and attentions): from the pass after the first, the positions are the
 * call order, so nothing misses and each streamed block moves once per
 * pass; its reverse (a backward) keeps them; a new order is learned again;
 * a pass that repeats a block, or a schedule told not to learn, keeps
 * them too. */
static void learns_order(int32_t dev)
{
    static const laden_tier DISK[NB] = {
        LADEN_TIER_DISK, LADEN_TIER_DISK, LADEN_TIER_DISK, LADEN_TIER_DISK,
        LADEN_TIER_DISK, LADEN_TIER_DISK, LADEN_TIER_DISK};
    static const int CALLED[NB + 1] = {NB, 1, 0, 3, 2, 5, 4, 6};
    static const int REVERSE[NB + 1] = {6, 4, 5, 2, 3, 0, 1, NB};
    static const int ADDED[NB + 1] = {NB, 0, 1, 2, 3, 4, 5, 6};
    static const int REPEATS[NB + 2] = {NB, 0, 1, 2, 2, 3, 4, 5, 6};
    model m;
    build(&m, dev, DISK, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 2));
    uint64_t all = streamed_bytes(&m), misses, moved;
    laden_sched_stats_t st;
    CHECK(all > 0);
    pass_in(&m, CALLED, NB + 1, &misses, &moved);
    CHECK(misses > 0); /* prefetched in the order blocks were added */
    for (int pass = 0; pass < 4; pass++) { /* from the second pass on */
        pass_in(&m, CALLED, NB + 1, &misses, &moved);
        CHECK_EQ(misses, 0);
        CHECK_EQ(moved, all);
    }
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 1);
    uint64_t gen = st.generation;
    CHECK_EQ(*laden_sched_generation_word(m.sc), gen);
    /* Backward: the reverse keeps the positions; it turns once. */
    for (int pass = 0; pass < 3; pass++)
        pass_in(&m, REVERSE, NB + 1, &misses, &moved);
    CHECK_EQ(misses, 0);
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 1);
    CHECK_EQ(st.generation, gen);
    /* Another order: learned again, in one pass. */
    pass_in(&m, ADDED, NB + 1, &misses, &moved);
    for (int pass = 0; pass < 3; pass++) {
        pass_in(&m, ADDED, NB + 1, &misses, &moved);
        CHECK_EQ(misses, 0);
        CHECK_EQ(moved, all);
    }
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 2);
    CHECK(st.generation > gen);
    /* A block called twice in a pass: no pass is whole; nothing moves. */
    for (int pass = 0; pass < 3; pass++)
        pass_in(&m, REPEATS, NB + 2, &misses, &moved);
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 2);
    /* Told not to learn: the positions stay. */
    CHECK_OK(laden_sched_learn_order(m.sc, 0));
    for (int pass = 0; pass < 3; pass++)
        pass_in(&m, CALLED, NB + 1, &misses, &moved);
    CHECK(misses > 0);
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 2);
    CHECK_OK(laden_sched_learn_order(m.sc, 1));
    pass_in(&m, CALLED, NB + 1, &misses, &moved);
    pass_in(&m, CALLED, NB + 1, &misses, &moved);
    CHECK_EQ(misses, 0);
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 3);
    /* Not while a block runs: its slot would move under it.  (With a
     * slot per block, so that one can stay entered.) */
    CHECK_OK(laden_sched_stop(m.sc));
    CHECK_OK(laden_sched_start(m.sc, NB));
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.nslots, NB);
    for (int k = 0; k < NB - 1; k++)
        run_block(&m, ADDED[k]);
    CHECK_OK(laden_sched_enter(m.sc, m.block_of[5], 0));
    run_block(&m, 6); /* every block entered, block 5 still running */
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 3);
    CHECK_OK(laden_sched_exit(m.sc, m.block_of[5], 0));
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.reorders, 4); /* at the exit that leaves none running */
    CHECK_STATUS(laden_sched_learn_order(NULL, 1), LADEN_E_INVAL);
    CHECK(laden_sched_generation_word(NULL) == NULL);
    CHECK_OK(laden_sched_synchronize(m.sc));
    destroy(&m);
}

TEST(stream_learns_the_call_order) { test_on_every_device(learns_order); }

/* A pass captured into a CUDA graph (laden_sched_capture_begin/_end) and
 * replayed, with eager passes between: each replay copies every block in
 * (nothing at capture), the bytes are the blocks' own, the copies move
 * each block once (no wrapped prefetch), a capture laden did not begin is
 * refused at enter, and a graph over replaced slots is refused.  The CPU
 * device and disk-tier blocks: refused. */
static uint64_t total_block_bytes(void)
{
    uint64_t n = 0;
    for (int t = 0; t < 2 * NB; t++)
        n += sz(t);
    return n;
}

static void check_pass_out(unsigned char *got)
{
    uint64_t at = 0;
    for (int t = 0; t < 2 * NB; t++)
        for (uint64_t j = 0; j < sz(t); j++, at++)
            if (got[at] != val(t, j)) {
                fprintf(stderr, "replay: tensor %d byte %llu wrong\n", t,
                        (unsigned long long)j);
                exit(1);
            }
}

/* One captured pass over a started RAM-tier model (flags: standalone or
 * not): the replays' bytes, eager passes between them, the bytes one
 * replay copies.  Returns that count. */
static uint64_t capture_and_replay(model *m, laden_dev_stream_t *cs,
                                   uint32_t flags)
{
    int32_t dev = m->dev;
    uintptr_t h = laden_dev_stream_handle(cs);
    uint64_t total = total_block_bytes();
    laden_devptr_t out;
    CHECK_OK(laden_dev_mem_alloc(dev, total, &out));
    unsigned char *zero = calloc(1, total), *got = malloc(total);
    CHECK_OK(laden_dev_copy_h2d(cs, out, zero, total));
    CHECK_OK(laden_dev_stream_synchronize(cs));
    /* An eager pass first: the slots hold blocks when the capture begins
     * (the first ones again, prefetched for the next pass). */
    for (int i = 0; i < NB; i++)
        run_block(m, i);
    CHECK_OK(laden_sched_synchronize(m->sc));
    laden_sched_stats_t st0, st1;
    CHECK_OK(laden_sched_stats(m->sc, &st0));
    laden_dev_graph_t *g = NULL;
    /* Only on the capturing stream: a capture with a refused enter is not
     * kept. */
    CHECK_OK(laden_dev_graph_capture_begin(cs));
    CHECK_OK(laden_sched_capture_begin(m->sc, h, flags));
    CHECK_STATUS(laden_sched_enter(m->sc, m->block_of[0], 0), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "another stream"));
    laden_sched_capture_t *bad = NULL;
    CHECK_STATUS(laden_sched_capture_end(m->sc, h, &bad), LADEN_E_STATE);
    CHECK(!bad);
    CHECK_OK(laden_dev_graph_capture_end(cs, &g));
    laden_dev_graph_destroy(g);
    g = NULL;
    CHECK_OK(laden_dev_graph_capture_begin(cs));
    CHECK_OK(laden_sched_capture_begin(m->sc, h, flags));
    CHECK_STATUS(laden_sched_stop(m->sc), LADEN_E_STATE); /* not now */
    uint64_t at = 0;
    for (int i = 0; i < NB; i++) {
        uint32_t b = m->block_of[i];
        CHECK_OK(laden_sched_enter(m->sc, b, h));
        for (uint32_t k = 0; k < 2; k++) {
            laden_devptr_t p;
            CHECK_OK(laden_sched_tensor_ptr(m->sc, b, k, &p));
            CHECK_OK(laden_dev_copy_d2d(cs, out + at, p, sz(2 * i + (int)k)));
            at += sz(2 * i + (int)k);
        }
        CHECK_OK(laden_sched_exit(m->sc, b, h));
    }
    laden_sched_capture_t *cap = NULL;
    CHECK_OK(laden_sched_capture_end(m->sc, h, &cap));
    CHECK_OK(laden_dev_graph_capture_end(cs, &g));
    CHECK_OK(laden_sched_stats(m->sc, &st1));
    uint64_t bytes = laden_sched_capture_bytes(cap);
    /* Nothing copied at capture, not even by the refused one; the
     * replays count what they copy. */
    CHECK_EQ(st1.h2d_bytes, st0.h2d_bytes);
    CHECK(bytes > 0);
    CHECK_OK(laden_dev_copy_d2h(cs, got, out, total));
    CHECK_OK(laden_dev_stream_synchronize(cs));
    CHECK_EQ(memcmp(got, zero, total), 0); /* nothing ran at capture */
    for (int round = 0; round < 4; round++) {
        CHECK_OK(laden_dev_copy_h2d(cs, out, zero, total));
        laden_sched_stats_t r0, r1;
        CHECK_OK(laden_sched_stats(m->sc, &r0));
        CHECK_OK(laden_sched_replay_begin(m->sc, h, cap));
        CHECK_OK(laden_dev_graph_launch(g, cs));
        CHECK_OK(laden_sched_replay_end(m->sc, h, cap));
        CHECK_OK(laden_sched_stats(m->sc, &r1));
        /* After a replay, or from a standalone graph (which fills its
         * slots itself): nothing to restore first. */
        if (round == 1 || (flags & LADEN_CAPTURE_STANDALONE))
            CHECK_EQ(r1.h2d_bytes - r0.h2d_bytes, bytes);
        CHECK_OK(laden_dev_copy_d2h(cs, got, out, total));
        CHECK_OK(laden_dev_stream_synchronize(cs));
        check_pass_out(got);
        /* Eager passes between some replays, partial ones too: right
         * bytes there, and the next replay restores what it expects. */
        if (round != 0) {
            for (int i = round; i < NB; i++)
                run_block(m, i);
            run_block(m, 0);
        }
    }
    /* A capture laden did not begin: refused at enter, nothing enqueued. */
    CHECK_OK(laden_dev_graph_capture_begin(cs));
    CHECK_STATUS(laden_sched_enter(m->sc, m->block_of[0], h), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "capturing"));
    laden_dev_graph_t *g2 = NULL;
    CHECK_OK(laden_dev_graph_capture_end(cs, &g2));
    laden_dev_graph_destroy(g2);
    run_block(m, 1);
    /* Slots replaced: the old graph is refused. */
    CHECK_OK(laden_sched_stop(m->sc));
    CHECK_OK(laden_sched_start(m->sc, 0));
    CHECK_STATUS(laden_sched_replay_begin(m->sc, h, cap), LADEN_E_STATE);
    laden_sched_capture_t *none = NULL;
    CHECK_STATUS(laden_sched_capture_end(m->sc, h, &none), LADEN_E_STATE);
    CHECK(!none);
    laden_sched_capture_free(cap);
    laden_dev_graph_destroy(g);
    CHECK_OK(laden_dev_mem_free(dev, out));
    free(zero);
    free(got);
    return bytes;
}

static void captured(int32_t dev)
{
    static const laden_tier RAM[NB] = {LADEN_TIER_RAM, LADEN_TIER_RAM,
                                       LADEN_TIER_RAM, LADEN_TIER_RAM,
                                       LADEN_TIER_RAM, LADEN_TIER_RAM,
                                       LADEN_TIER_RAM};
    model m;
    build(&m, dev, dev == LADEN_DEVICE_CPU ? RAM : MIXED, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    if (dev == LADEN_DEVICE_CPU) {
        CHECK_STATUS(laden_sched_capture_begin(m.sc, 0, 0),
                     LADEN_E_UNSUPPORTED);
        laden_dev_stream_t *c;
        CHECK_OK(laden_dev_stream_create(dev, &c));
        CHECK_STATUS(laden_dev_graph_capture_begin(c), LADEN_E_UNSUPPORTED);
        laden_dev_stream_destroy(c);
        destroy(&m);
        return;
    }
    /* Disk-tier blocks cannot be captured. */
    laden_dev_stream_t *cs;
    CHECK_OK(laden_dev_stream_create(dev, &cs));
    uintptr_t h = laden_dev_stream_handle(cs);
    laden_status began = laden_dev_graph_capture_begin(cs);
    if (began && strstr(laden_last_error(), "not emulated")) {
        fprintf(stderr, "(CUDA graphs: %s)\n", laden_last_error());
        laden_dev_stream_destroy(cs);
        destroy(&m);
        return; /* tests/fake_cuda */
    }
    CHECK_OK(began);
    CHECK_STATUS(laden_sched_capture_begin(m.sc, h, 0), LADEN_E_UNSUPPORTED);
    laden_dev_graph_t *g = NULL;
    CHECK_OK(laden_dev_graph_capture_end(cs, &g));
    laden_dev_graph_destroy(g);
    destroy(&m);

    build(&m, dev, RAM, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    /* Not capturing, or unknown flags: refused. */
    CHECK_STATUS(laden_sched_capture_begin(m.sc, h, 0), LADEN_E_STATE);
    CHECK_OK(laden_dev_graph_capture_begin(cs));
    CHECK_STATUS(laden_sched_capture_begin(m.sc, h, 8), LADEN_E_INVAL);
    CHECK_OK(laden_dev_graph_capture_end(cs, &g));
    laden_dev_graph_destroy(g);
    /* Each replay moves every block once in either mode (more blocks than
     * slots): standalone copies them all itself, the default leaves the
     * first ones for the next replay as an eager pass does. */
    uint64_t block_bytes = 0;
    for (int i = 0; i < NB; i++)
        block_bytes += laden_sched_block_bytes(m.sc, m.block_of[i]);
    CHECK_EQ(capture_and_replay(&m, cs, LADEN_CAPTURE_STANDALONE),
             block_bytes);
    CHECK_EQ(capture_and_replay(&m, cs, 0), block_bytes);
    /* Captured: the positions stay; learning cannot be turned on again. */
    CHECK_STATUS(laden_sched_learn_order(m.sc, 1), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "CUDA graph was captured");
    CHECK_OK(laden_sched_learn_order(m.sc, 0));
    CHECK_OK(laden_sched_forget_stream(m.sc, h));
    laden_dev_stream_destroy(cs);
    destroy(&m);
}

TEST(stream_capture_replay) { test_on_every_device(captured); }

/* Blocks exited on another stream than they were entered on (a training
 * step exits on the gradient sink's stream), forward and in reverse: the
 * bytes are right; the schedule lets that stream go when told, and works
 * on after it is destroyed. */
static void exit_elsewhere(int32_t dev)
{
    static const laden_tier ALL[NB] = {
        LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM,
        LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM};
    model m;
    build(&m, dev, ALL, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 1));
    laden_dev_stream_t *other = NULL;
    CHECK_OK(laden_dev_stream_create(dev, &other));
    uintptr_t h = laden_dev_stream_handle(other);
    for (int pass = 0; pass < 3; pass++) {
        for (int i = 0; i < NB; i++)
            run_block_exit_on(&m, i, h);
        for (int i = NB - 1; i >= 0; i--)
            run_block_exit_on(&m, i, i % 2 ? h : 0);
    }
    CHECK_OK(laden_sched_forget_stream(m.sc, h));
    CHECK_OK(laden_sched_forget_stream(m.sc, h)); /* not held: no-op */
    laden_dev_stream_destroy(other);
    for (int i = 0; i < NB; i++)
        run_block(&m, i);
    CHECK_OK(laden_sched_synchronize(m.sc));
    CHECK_STATUS(laden_sched_forget_stream(NULL, 0), LADEN_E_INVAL);
    /* Closed (a model's release) before the stream goes: forget still
     * lets it go, so destroy does not touch a destroyed stream. */
    CHECK_OK(laden_dev_stream_create(dev, &other));
    h = laden_dev_stream_handle(other);
    run_block_exit_on(&m, 0, h);
    CHECK_OK(laden_sched_close(m.sc));
    CHECK_OK(laden_sched_forget_stream(m.sc, h));
    laden_dev_stream_destroy(other);
    destroy(&m);
}

TEST(stream_exit_on_another_stream) { test_on_every_device(exit_elsewhere); }

static void misuse(int32_t dev)
{
    model m;
    build(&m, dev, MIXED, 0);
    uint32_t b = m.block_of[1];
    laden_devptr_t p;
    CHECK_STATUS(laden_sched_enter(m.sc, b, 0), LADEN_E_STATE); /* not loaded */
    CHECK_STATUS(laden_sched_tensor_ptr(m.sc, b, 0, &p), LADEN_E_STATE);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_STATUS(laden_sched_load(m.sc), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_enter(m.sc, b, 0), LADEN_E_STATE); /* not started */
    CHECK_STATUS(laden_sched_tensor_ptr(m.sc, b, 0, &p), LADEN_E_STATE);
    CHECK_OK(laden_sched_start(m.sc, 0));
    CHECK_STATUS(laden_sched_start(m.sc, 0), LADEN_E_STATE);
    uint32_t nb;
    CHECK_STATUS(laden_sched_add_block(m.sc, LADEN_TIER_RAM, &nb),
                 LADEN_E_STATE);
    CHECK_STATUS(laden_sched_enter(m.sc, 999, 0), LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_exit(m.sc, b, 0), LADEN_E_STATE);
    CHECK_OK(laden_sched_enter(m.sc, b, 0));
    CHECK_STATUS(laden_sched_enter(m.sc, b, 0), LADEN_E_STATE);
    /* Exits of blocks that are not running (resident, RAM tier, none)
     * are refused and change nothing: b still exits, once. */
    CHECK_STATUS(laden_sched_exit(m.sc, m.block_of[2], 0), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "not running"));
    CHECK_STATUS(laden_sched_exit(m.sc, m.block_of[0], 0), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_exit(m.sc, m.block_of[NB], 0), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_exit(m.sc, 999, 0), LADEN_E_INVAL);
    CHECK_OK(laden_sched_exit(m.sc, b, 0));
    CHECK_STATUS(laden_sched_exit(m.sc, b, 0), LADEN_E_STATE);
    /* A resident block runs while a streamed one does; each exits once. */
    CHECK_OK(laden_sched_enter(m.sc, m.block_of[2], 0));
    CHECK_OK(laden_sched_enter(m.sc, b, 0));
    CHECK_OK(laden_sched_exit(m.sc, m.block_of[2], 0));
    CHECK_STATUS(laden_sched_exit(m.sc, m.block_of[2], 0), LADEN_E_STATE);
    CHECK_OK(laden_sched_exit(m.sc, b, 0));
    destroy(&m);
}

TEST(stream_misuse_is_an_error) { test_on_every_device(misuse); }

static const laden_tier MOSTLY_DISK[NB] = {
    LADEN_TIER_DISK, LADEN_TIER_DISK, LADEN_TIER_GPU, LADEN_TIER_DISK,
    LADEN_TIER_RAM,  LADEN_TIER_DISK, LADEN_TIER_DISK};

static void file_trouble(int32_t dev)
{
    model m;
    build(&m, dev, MOSTLY_DISK, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    run_block(&m, 0);
    /* The checkpoint is cut short while the model runs: disk blocks fail
     * at enter with the file's name; RAM and GPU blocks keep working. */
    CHECK(truncate(test_path("model.safetensors"), 200) == 0);
    int failures = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < NB; i++) {
            if (MOSTLY_DISK[i] != LADEN_TIER_DISK) {
                run_block(&m, i);
                continue;
            }
            int s = laden_sched_enter(m.sc, m.block_of[i], 0);
            if (s == LADEN_OK) { /* read before the cut */
                CHECK_OK(laden_sched_exit(m.sc, m.block_of[i], 0));
                continue;
            }
            /* Cut short below the read, or bytes read from a file that
             * is no longer the one opened. */
            CHECK(s == LADEN_E_TRUNCATED || s == LADEN_E_CHANGED);
            CHECK_CONTAINS(laden_last_error(), "model.safetensors");
            failures++;
        }
    CHECK(failures >= 3);
    run_block(&m, NB);
    destroy(&m);
}

TEST(stream_file_truncated_while_running) { test_on_every_device(file_trouble); }

/* Rewritten in place with another model's bytes (same size) while the
 * model runs: disk blocks refuse the new bytes, naming the file. */
static void file_rewritten(int32_t dev)
{
    model m;
    build(&m, dev, MOSTLY_DISK, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    for (int i = 0; i <= NB; i++)
        run_block(&m, i);
    char *p = test_path("model.safetensors");
    FILE *f = fopen(p, "r+b");
    CHECK(f != NULL);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    unsigned char *junk = malloc((size_t)n);
    fseek(f, 0, SEEK_SET);
    CHECK_EQ(fread(junk, 1, (size_t)n, f), (size_t)n);
    for (long j = 0; j < n; j++)
        junk[j] ^= 0x3c;
    fseek(f, 0, SEEK_SET);
    CHECK_EQ(fwrite(junk, 1, (size_t)n, f), (size_t)n);
    CHECK_EQ(fclose(f), 0);
    free(junk);
    /* The clock may not have ticked since the file was written. */
    struct timespec t[2] = {{0, UTIME_OMIT}, {0, UTIME_NOW}};
    struct stat sb;
    CHECK_EQ(stat(p, &sb), 0);
    t[1].tv_sec = sb.st_mtim.tv_sec + 1;
    t[1].tv_nsec = 0;
    CHECK_EQ(utimensat(AT_FDCWD, p, t, 0), 0);
    int refused = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < NB; i++) {
            if (MOSTLY_DISK[i] != LADEN_TIER_DISK) {
                run_block(&m, i); /* in memory: unaffected */
                continue;
            }
            int s = laden_sched_enter(m.sc, m.block_of[i], 0);
            if (s == LADEN_OK) { /* prefetched before the rewrite */
                CHECK_OK(laden_sched_exit(m.sc, m.block_of[i], 0));
                continue;
            }
            CHECK_STATUS(s, LADEN_E_CHANGED);
            CHECK_CONTAINS(laden_last_error(), "model.safetensors");
            refused++;
        }
    CHECK(refused >= 4);
    destroy(&m);
}

TEST(stream_file_rewritten_while_running)
{
    test_on_every_device(file_rewritten);
}

/* Replaced between reading the header and creating the schedule: the
 * offsets of the header read would point anywhere in the new file. */
TEST(stream_file_replaced_before_create)
{
    laden_st_t *st;
    CHECK_OK(laden_st_open(write_model(), &st));
    char *p = test_path("model.safetensors");
    char *q = test_path("other.safetensors");
    test_write_st(q, "{\"x\":{\"dtype\":\"U8\",\"shape\":[3],"
                     "\"data_offsets\":[0,3]}}",
                  "abc", 3);
    CHECK_EQ(rename(q, p), 0);
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc = (laden_sched_t *)1;
    CHECK_STATUS(laden_sched_create(&cfg, st, &sc), LADEN_E_CHANGED);
    CHECK_EQ(sc, NULL);
    CHECK_CONTAINS(laden_last_error(), "model.safetensors");
    laden_st_close(st);
}

/* ---- one thread at a time ------------------------------------------------ */

typedef struct {
    model *m;
    int want;          /* the status the calls must return */
    int entered_block; /* a block the other thread entered, or -1 */
} other_args;

static void *other_thread(void *arg)
{
    other_args *a = arg;
    model *m = a->m;
    laden_sched_stats_t st;
    laden_devptr_t p;
    uint32_t b = m->block_of[4];
    int s = laden_sched_enter(m->sc, b, 0);
    CHECK_STATUS(s, a->want);
    if (s == LADEN_OK) {
        CHECK_OK(laden_sched_exit(m->sc, b, 0));
    } else {
        CHECK_CONTAINS(laden_last_error(), a->want == LADEN_E_STATE
                                               ? "laden_sched_enter"
                                               : "");
    }
    CHECK_STATUS(laden_sched_stats(m->sc, &st), a->want);
    CHECK_STATUS(laden_sched_tensor_ptr(m->sc, m->block_of[NB], 0, &p),
                 a->want);
    CHECK_STATUS(laden_sched_begin(m->sc), a->want);
    if (a->want == LADEN_OK)
        CHECK_OK(laden_sched_end(m->sc));
    if (a->entered_block >= 0) {
        /* Not this thread's block to exit, nor its pass to end. */
        CHECK_STATUS(laden_sched_exit(m->sc, m->block_of[a->entered_block],
                                      0),
                     LADEN_E_STATE);
        CHECK_STATUS(laden_sched_end(m->sc), LADEN_E_STATE);
        CHECK_STATUS(laden_sched_close(m->sc), LADEN_E_STATE);
        CHECK_CONTAINS(laden_last_error(), "another thread");
    }
    return NULL;
}

static void on_other_thread(model *m, int want, int entered_block)
{
    other_args a = {m, want, entered_block};
    pthread_t t;
    CHECK_EQ(pthread_create(&t, NULL, other_thread, &a), 0);
    CHECK_EQ(pthread_join(t, NULL), 0);
}

static void guard_rules(int32_t dev)
{
    model m;
    build(&m, dev, MIXED, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    /* Inside a block: every call of another thread is refused at once. */
    uint32_t b = m.block_of[1];
    CHECK_OK(laden_sched_enter(m.sc, b, 0));
    on_other_thread(&m, LADEN_E_STATE, 1);
    CHECK_OK(laden_sched_exit(m.sc, b, 0));
    /* Between blocks another thread may use it. */
    on_other_thread(&m, LADEN_OK, -1);
    /* A pass holds it from begin to end, blocks nest inside. */
    CHECK_OK(laden_sched_begin(m.sc));
    run_block(&m, 0);
    on_other_thread(&m, LADEN_E_STATE, -1);
    CHECK_OK(laden_sched_begin(m.sc)); /* nests */
    CHECK_OK(laden_sched_end(m.sc));
    on_other_thread(&m, LADEN_E_STATE, -1);
    CHECK_STATUS(laden_sched_close(m.sc), LADEN_E_STATE); /* own pass */
    CHECK_OK(laden_sched_end(m.sc));
    CHECK_STATUS(laden_sched_end(m.sc), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_exit(m.sc, b, 0), LADEN_E_STATE);
    on_other_thread(&m, LADEN_OK, -1);
    /* A failed enter holds nothing. */
    CHECK_STATUS(laden_sched_enter(m.sc, 999, 0), LADEN_E_INVAL);
    on_other_thread(&m, LADEN_OK, -1);
    /* Closed: everything is refused, from any thread; the memory stays
     * until destroy. */
    CHECK(!laden_sched_is_closed(m.sc));
    CHECK_OK(laden_sched_close(m.sc));
    CHECK(laden_sched_is_closed(m.sc));
    CHECK_OK(laden_sched_close(m.sc));
    laden_sched_stats_t st;
    CHECK_STATUS(laden_sched_stats(m.sc, &st), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "closed");
    CHECK_STATUS(laden_sched_enter(m.sc, b, 0), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_begin(m.sc), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_stop(m.sc), LADEN_E_STATE);
    on_other_thread(&m, LADEN_E_STATE, -1);
    CHECK_STATUS(laden_sched_close(NULL), LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_begin(NULL), LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_end(NULL), LADEN_E_INVAL);
    destroy(&m);
}

TEST(stream_guard_rules) { test_on_every_device(guard_rules); }

/* Threads racing over one schedule, as two Python threads calling one
 * model: every call either works, with the right bytes in the slot, or is
 * refused with LADEN_E_STATE; nothing crashes, hangs or reads twice. */
typedef struct {
    model *m;
    laden_dev_stream_t *rd;
    unsigned char *buf;
    int ok, refused, held;
} racer;

static void *race(void *arg)
{
    racer *r = arg;
    model *m = r->m;
    for (int pass = 0; pass < 60; pass++) {
        int s = laden_sched_begin(m->sc);
        bool pass_held = s == LADEN_OK;
        if (s)
            CHECK_STATUS(s, LADEN_E_STATE);
        r->held += pass_held;
        for (int i = 0; i <= NB; i++) {
            uint32_t b = m->block_of[i];
            s = laden_sched_enter(m->sc, b, 0);
            if (s) {
                CHECK_STATUS(s, LADEN_E_STATE);
                r->refused++;
                continue;
            }
            for (int k = 0; k < (i == NB ? 1 : 2); k++) {
                int t = i == NB ? 2 * NB : 2 * i + k;
                laden_devptr_t p;
                CHECK_OK(laden_sched_tensor_ptr(m->sc, b, (uint32_t)k, &p));
                if (r->rd) {
                    CHECK_OK(laden_dev_copy_d2h(r->rd, r->buf, p, sz(t)));
                    CHECK_OK(laden_dev_stream_synchronize(r->rd));
                } else {
                    memcpy(r->buf, (void *)(uintptr_t)p, sz(t));
                }
                for (uint64_t j = 0; j < sz(t); j++)
                    CHECK(r->buf[j] == val(t, j));
            }
            CHECK_OK(laden_sched_exit(m->sc, b, 0));
            r->ok++;
        }
        if (pass_held)
            CHECK_OK(laden_sched_end(m->sc));
    }
    return NULL;
}

static void guard_race(int32_t dev)
{
    static const laden_tier DISKY[NB] = {
        LADEN_TIER_DISK, LADEN_TIER_RAM,  LADEN_TIER_DISK, LADEN_TIER_DISK,
        LADEN_TIER_GPU,  LADEN_TIER_DISK, LADEN_TIER_RAM};
    model m;
    build(&m, dev, DISKY, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    racer r[3];
    pthread_t t[3];
    for (int i = 0; i < 3; i++) {
        r[i] = (racer){&m, NULL, malloc(1 << 20), 0, 0, 0};
        /* Reads on the compute stream (the legacy one, handle 0), after
         * what enter made it wait for. */
        if (dev != LADEN_DEVICE_CPU)
            CHECK_OK(laden_dev_stream_wrap(dev, 0, &r[i].rd));
        CHECK_EQ(pthread_create(&t[i], NULL, race, &r[i]), 0);
    }
    int ok = 0, held = 0;
    for (int i = 0; i < 3; i++) {
        CHECK_EQ(pthread_join(t[i], NULL), 0);
        ok += r[i].ok;
        held += r[i].held;
        laden_dev_stream_destroy(r[i].rd);
        free(r[i].buf);
    }
    /* A pass that held the schedule ran whole (how many held depends on
     * the scheduler: at least one, the first). */
    CHECK(held >= 1);
    CHECK(ok >= held * (NB + 1));
    /* Nothing is left held. */
    CHECK_OK(laden_sched_close(m.sc));
    destroy(&m);
}

TEST(stream_guard_threads_race) { test_on_every_device(guard_race); }

static void budget(int32_t dev)
{
    model m;
    static const laden_tier RAM[NB] = {LADEN_TIER_RAM, LADEN_TIER_RAM,
                                       LADEN_TIER_RAM, LADEN_TIER_RAM,
                                       LADEN_TIER_RAM, LADEN_TIER_RAM,
                                       LADEN_TIER_RAM};
    build(&m, dev, RAM, 64u << 10); /* 64 KiB: the RAM tier needs more */
    CHECK_STATUS(laden_sched_load(m.sc), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "budget");
    laden_sched_stats_t st;
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.pinned_bytes, 0); /* everything given back */
    CHECK_STATUS(laden_sched_load(m.sc), LADEN_E_STATE);
    destroy(&m);
}

TEST(stream_budget_exceeded_frees_everything) { test_on_every_device(budget); }

TEST(stream_convert)
{
    const float in[] = {0.0f, -0.0f, 1.0f, -2.5f, 3.14159265f, 65504.0f,
                        1e-7f, 6.1e-5f, 70000.0f, 1e30f};
    /* Expected values from torch's own conversions. */
    const uint16_t want_bf16[] = {0x0000, 0x8000, 0x3f80, 0xc020, 0x4049,
                                  0x4780, 0x33d7, 0x3880, 0x4789, 0x714a};
    const uint16_t want_f16[] = {0x0000, 0x8000, 0x3c00, 0xc100, 0x4248,
                                 0x7bff, 0x0002, 0x03ff, 0x7c00, 0x7c00};
    uint16_t out[10];
    float back[10];
    CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, in, LADEN_DTYPE_BF16, out, 10));
    for (int i = 0; i < 10; i++)
        if (out[i] != want_bf16[i]) {
            fprintf(stderr, "bf16[%d] = %04x, want %04x\n", i, out[i],
                    want_bf16[i]);
            exit(1);
        }
    CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, in, LADEN_DTYPE_F16, out, 10));
    for (int i = 0; i < 10; i++)
        if (out[i] != want_f16[i]) {
            fprintf(stderr, "f16[%d] = %04x, want %04x\n", i, out[i],
                    want_f16[i]);
            exit(1);
        }
    CHECK_OK(laden_sched_convert(LADEN_DTYPE_F16, out, LADEN_DTYPE_F32, back, 8));
    CHECK(back[2] == 1.0f && back[3] == -2.5f && back[5] == 65504.0f);
    CHECK(back[6] > 1.1e-7f && back[6] < 1.3e-7f); /* subnormal 2 * 2^-24 */
    CHECK_STATUS(laden_sched_convert(LADEN_DTYPE_I32, in, LADEN_DTYPE_F32,
                                     back, 1),
                 LADEN_E_UNSUPPORTED);
}

/* Every float and fp8 source to every float destination, over several of
 * the converter's runs and at odd addresses: each element as core's
 * scalar conversion gives it (the converter picks the loop once per call,
 * so this checks each loop against the rule it must keep). */
TEST(stream_convert_each_pair_as_the_scalar_rule)
{
    enum { N = 2600 }; /* more than two runs of the converter's buffer */
    const laden_dtype from[] = {LADEN_DTYPE_F32, LADEN_DTYPE_F16,
                                LADEN_DTYPE_BF16, LADEN_DTYPE_F8_E4M3,
                                LADEN_DTYPE_F8_E5M2};
    const laden_dtype to[] = {LADEN_DTYPE_F32, LADEN_DTYPE_F16,
                              LADEN_DTYPE_BF16};
    static uint8_t src[4 * N + 1], dst[4 * N + 2];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof src; i++) {
        x = x * 1103515245u + 12345u;
        src[i] = (uint8_t)(x >> 16);
    }
    for (size_t a = 0; a < sizeof from / sizeof from[0]; a++) {
        /* F32 sources finite, so that no NaN's payload is compared */
        if (from[a] == LADEN_DTYPE_F32)
            for (uint32_t i = 0; i < N; i++) {
                float f = (float)((int32_t)(i * 2654435761u) >> 8) * 1e-3f;
                memcpy(src + 1 + 4 * i, &f, 4);
            }
        uint32_t ss = laden_dtype_bits(from[a]) / 8;
        for (size_t b = 0; b < sizeof to / sizeof to[0]; b++) {
            if (from[a] == to[b])
                continue;
            uint32_t ds = laden_dtype_bits(to[b]) / 8;
            memset(dst, 0xee, sizeof dst);
            CHECK_OK(laden_sched_convert(from[a], src + 1, to[b], dst + 1, N));
            for (uint32_t i = 0; i < N; i++) {
                const uint8_t *s = src + 1 + (size_t)i * ss;
                uint16_t h;
                float f;
                switch (from[a]) {
                case LADEN_DTYPE_F32:
                    memcpy(&f, s, 4);
                    break;
                case LADEN_DTYPE_F16:
                    memcpy(&h, s, 2);
                    f = laden__f32_of_f16(h);
                    break;
                case LADEN_DTYPE_BF16:
                    memcpy(&h, s, 2);
                    f = laden__f32_of_bf16(h);
                    break;
                case LADEN_DTYPE_F8_E4M3:
                    f = laden__f32_of_e4m3(*s);
                    break;
                default:
                    f = laden__f32_of_e5m2(*s);
                    break;
                }
                uint8_t want[4];
                if (to[b] == LADEN_DTYPE_F32) {
                    memcpy(want, &f, 4);
                } else {
                    h = to[b] == LADEN_DTYPE_F16 ? laden__f16_of_f32(f)
                                                 : laden__bf16_of_f32(f);
                    memcpy(want, &h, 2);
                }
                const uint8_t *got = dst + 1 + (size_t)i * ds;
                if (memcmp(got, want, ds)) {
                    fprintf(stderr, "%s -> %s [%u] differs\n",
                            laden_dtype_name(from[a]),
                            laden_dtype_name(to[b]), i);
                    exit(1);
                }
            }
            CHECK(dst[0] == 0xee && dst[1 + (size_t)N * ds] == 0xee);
        }
    }
}

/* Stop frees the slots and keeps the tiers; start again with another
 * lookahead; tensors from host memory load like checkpoint tensors. */
static void restart_and_host(int32_t dev)
{
    model m;
    build(&m, dev, MIXED, 0);
    unsigned char host[5000];
    for (int j = 0; j < 5000; j++)
        host[j] = (unsigned char)(j * 7);
    uint32_t hb, hi;
    CHECK_OK(laden_sched_add_block(m.sc, LADEN_TIER_RAM, &hb));
    CHECK_OK(laden_sched_add_host_tensor(m.sc, hb, host, LADEN_DTYPE_U8, 5000,
                                         LADEN_DTYPE_U8, &hi));
    uint32_t db;
    CHECK_OK(laden_sched_add_block(m.sc, LADEN_TIER_DISK, &db));
    CHECK_STATUS(laden_sched_add_host_tensor(m.sc, db, host, LADEN_DTYPE_U8,
                                             5000, LADEN_DTYPE_U8, &hi),
                 LADEN_E_INVAL);
    CHECK_OK(laden_sched_load(m.sc));
    void *hp;
    CHECK_OK(laden_sched_host_ptr(m.sc, hb, 0, &hp));
    CHECK(hp != NULL && memcmp(hp, host, 5000) == 0);
    CHECK_OK(laden_sched_host_ptr(m.sc, m.block_of[NB], 0, &hp));
    CHECK_EQ(hp, NULL); /* GPU tier: not in host memory */
    laden_sched_stats_t st0, st1;
    CHECK_OK(laden_sched_stats(m.sc, &st0));
    for (uint32_t la = 1; la <= 4; la++) {
        CHECK_OK(laden_sched_start(m.sc, la));
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i <= NB; i++)
                run_block(&m, i);
        CHECK_OK(laden_sched_stop(m.sc));
        CHECK_OK(laden_sched_stop(m.sc)); /* twice: no-op */
        CHECK_OK(laden_sched_stats(m.sc, &st1));
        CHECK_EQ(st1.device_bytes, st0.device_bytes);
    }
    destroy(&m);
}

TEST(stream_restart_and_host_tensors) { test_on_every_device(restart_and_host); }

/* A schedule released and made again in one process, with a pinned pool:
 * its RAM-tier homes come back pinned, nothing pinned anew, the bytes
 * are the new load's; without one (the default) release gives all back. */
static void pinned_pool(int32_t dev)
{
    if (dev == LADEN_DEVICE_CPU)
        return; /* the CPU device pins nothing */
    static const laden_tier RAM[NB] = {
        LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM,
        LADEN_TIER_RAM, LADEN_TIER_RAM, LADEN_TIER_RAM};
    laden_pinned_pool_stats_t ps;
    CHECK_OK(laden_pinned_pool_set(dev, 0));
    CHECK_OK(laden_pinned_pool_stats(dev, &ps));
    uint64_t kept0 = ps.kept_bytes, reused0 = ps.reused_bytes;
    model m;
    char *path = write_model();
    build_from(&m, path, dev, RAM, 0);
    CHECK_OK(laden_sched_load(m.sc));
    laden_sched_stats_t st;
    CHECK_OK(laden_sched_stats(m.sc, &st));
    uint64_t homes = st.pinned_bytes;
    CHECK(homes > 0);
    destroy(&m); /* no pool: everything unpinned */
    CHECK_OK(laden_pinned_pool_stats(dev, &ps));
    CHECK_EQ(ps.kept_bytes, kept0);
    CHECK_EQ(ps.held_bytes, 0);
    CHECK_OK(laden_pinned_pool_set(dev, 1ull << 30));
    build_from(&m, path, dev, RAM, 0);
    CHECK_OK(laden_sched_load(m.sc));
    destroy(&m); /* into the pool */
    CHECK_OK(laden_pinned_pool_stats(dev, &ps));
    uint64_t held = ps.held_bytes;
    CHECK(held > 0 && held <= homes);
    CHECK_EQ(ps.kept_bytes - kept0, held);
    build_from(&m, path, dev, RAM, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_pinned_pool_stats(dev, &ps));
    CHECK_EQ(ps.reused_bytes - reused0, held); /* every home taken back */
    CHECK_EQ(ps.held_bytes, 0);
    CHECK_OK(laden_sched_start(m.sc, 0));
    for (int pass = 0; pass < 2; pass++) /* the new load's bytes */
        for (int i = 0; i <= NB; i++)
            run_block(&m, i);
    CHECK_OK(laden_sched_synchronize(m.sc));
    destroy(&m);
    /* Lowered: unpinned at once; a budget below a home keeps nothing. */
    CHECK_OK(laden_pinned_pool_set(dev, 0));
    CHECK_OK(laden_pinned_pool_stats(dev, &ps));
    CHECK_EQ(ps.held_bytes, 0);
    CHECK(ps.freed_bytes >= held);
    CHECK_OK(laden_pinned_pool_set(dev, 4096));
    build_from(&m, path, dev, RAM, 0);
    CHECK_OK(laden_sched_load(m.sc));
    destroy(&m);
    CHECK_OK(laden_pinned_pool_stats(dev, &ps));
    CHECK(ps.held_bytes <= 4096);
    CHECK_OK(laden_pinned_pool_set(dev, 0));
    CHECK_STATUS(laden_pinned_pool_set(LADEN_DEVICE_CPU, 1), LADEN_E_INVAL);
    CHECK_STATUS(laden_pinned_pool_stats(dev, NULL), LADEN_E_INVAL);
}

TEST(stream_pinned_pool_same_process_reload)
{
    test_on_every_device(pinned_pool);
}

TEST(stream_fp8_decode_all_codes)
{
    uint8_t codes[256];
    float out[256];
    for (int i = 0; i < 256; i++)
        codes[i] = (uint8_t)i;
    /* Sums of |value| over the finite codes, from torch's own decoding. */
    CHECK_OK(laden_sched_convert(LADEN_DTYPE_F8_E4M3, codes, LADEN_DTYPE_F32,
                                 out, 256));
    double sum = 0;
    int nans = 0;
    for (int i = 0; i < 256; i++) {
        if (out[i] != out[i])
            nans++;
        else
            sum += out[i] < 0 ? -out[i] : out[i];
    }
    CHECK(nans == 2 && sum == 10815.75);
    CHECK_OK(laden_sched_convert(LADEN_DTYPE_F8_E5M2, codes, LADEN_DTYPE_F32,
                                 out, 256));
    sum = 0;
    for (int i = 0; i < 256; i++)
        if (out[i] == out[i] && out[i] - out[i] == 0)
            sum += out[i] < 0 ? -out[i] : out[i];
    CHECK(sum > 720895.99 && sum < 720896.01); /* torch summed in float32 */
}

/* A float tensor stored as F8_E4M3: e4m3 codes rounded as torch rounds
 * them, then one float32 scale per row (amax / 448). */
TEST(stream_fp8_quantize_rows)
{
    const float row0[11] = {0.0f, 0.1f, 1.0f, 448.0f, -3.3f, 0.001f,
                            0.0009765625f, 0.015f, 300.0f, -0.0625f, 17.0f};
    const uint8_t want0[11] = {0x0, 0x1d, 0x38, 0x7e, 0xc5, 0x1,
                               0x0, 0x8,  0x79, 0x98, 0x58};
    float data[22];
    for (int i = 0; i < 11; i++) {
        data[i] = row0[i];
        data[11 + i] = row0[i] * 0.5f; /* second row: scale 0.5 */
    }
    char hdr[256];
    snprintf(hdr, sizeof hdr,
             "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,11],"
             "\"data_offsets\":[0,88]}}");
    char *p = test_path("f.safetensors");
    test_write_st(p, hdr, data, sizeof data);
    laden_st_t *st;
    CHECK_OK(laden_st_open(p, &st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc;
    uint32_t b, i;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
    CHECK_OK(laden_sched_add_tensor(sc, b, st, 0, LADEN_DTYPE_F8_E4M3, &i));
    CHECK_OK(laden_sched_load(sc));
    void *hp;
    CHECK_OK(laden_sched_host_ptr(sc, b, i, &hp));
    const uint8_t *q = hp;
    float scales[2];
    memcpy(scales, q + 32, sizeof scales); /* 22 bytes, aligned to 16 */
    CHECK(scales[0] == 1.0f && scales[1] == 0.5f);
    for (int k = 0; k < 11; k++) {
        CHECK_EQ(q[k], want0[k]);
        CHECK_EQ(q[11 + k], want0[k]); /* same codes after its scale */
    }
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* ---- a streaming schedule in a VRAM context ------------------------------ */

#include "laden/vram.h"

#define VMB (1ull << 20)
/* Host blocks of the VRAM test: "rest" (GPU tier, 1 MiB), four VRAM-tier
 * blocks of 1.5 MiB, one RAM-tier block of 1 MiB; then the checkpoint's
 * model block 6 on the disk tier.  Laid out in the VBAR: the rest in page
 * 0, the VRAM blocks at 1, 2.5, 4 and 5.5 MiB (2 MiB pages). */
#define NH 6
static const uint64_t HSIZE[NH] = {VMB, 3 * VMB / 2, 3 * VMB / 2,
                                   3 * VMB / 2, 3 * VMB / 2, VMB};
static const laden_tier HTIER[NH] = {LADEN_TIER_GPU,  LADEN_TIER_VRAM,
                                     LADEN_TIER_VRAM, LADEN_TIER_VRAM,
                                     LADEN_TIER_VRAM, LADEN_TIER_RAM};

typedef struct {
    model m;
    unsigned char *host[NH];
    uint32_t hb[NH], disk;
} vmodel;

static void vbuild(vmodel *v, int32_t dev, laden_vram_t *vram)
{
    memset(v, 0, sizeof *v);
    static const laden_tier NONE[NB] = {0};
    (void)NONE;
    model *m = &v->m;
    m->dev = dev;
    CHECK_OK(laden_st_open(write_model(), &m->st));
    laden_sched_config cfg = {.device = dev, .lookahead = 2};
    CHECK_OK(laden_sched_create(&cfg, m->st, &m->sc));
    if (vram)
        CHECK_OK(laden_sched_use_vram(m->sc, vram));
    for (int i = 0; i < NH; i++) {
        uint32_t ti;
        v->host[i] = malloc(HSIZE[i]);
        for (uint64_t j = 0; j < HSIZE[i]; j++)
            v->host[i][j] = val(100 + i, j);
        CHECK_OK(laden_sched_add_block(m->sc, HTIER[i], &v->hb[i]));
        CHECK_OK(laden_sched_add_host_tensor(m->sc, v->hb[i], v->host[i],
                                             LADEN_DTYPE_U8, HSIZE[i],
                                             LADEN_DTYPE_U8, &ti));
    }
    CHECK_OK(laden_sched_add_block(m->sc, LADEN_TIER_DISK, &v->disk));
    for (int k = 0; k < 2; k++) {
        size_t idx;
        uint32_t ti;
        CHECK_OK(laden_st_find(m->st, k ? "blocks.6.b" : "blocks.6.a", &idx));
        CHECK_OK(laden_sched_add_tensor(m->sc, v->disk, m->st, idx,
                                        LADEN_DTYPE_U8, &ti));
    }
    m->block_of[6] = v->disk;
    if (dev != LADEN_DEVICE_CPU)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &m->rd));
    m->buf = malloc(2 * VMB);
}

static void vrun(vmodel *v)
{
    model *m = &v->m;
    for (int i = 0; i < NH; i++) {
        laden_devptr_t p;
        CHECK_OK(laden_sched_enter(m->sc, v->hb[i], 0));
        CHECK_OK(laden_sched_tensor_ptr(m->sc, v->hb[i], 0, &p));
        if (m->rd) {
            CHECK_OK(laden_dev_copy_d2h(m->rd, m->buf, p, HSIZE[i]));
            CHECK_OK(laden_dev_stream_synchronize(m->rd));
        } else {
            memcpy(m->buf, (void *)(uintptr_t)p, HSIZE[i]);
        }
        CHECK_EQ(memcmp(m->buf, v->host[i], HSIZE[i]), 0);
        CHECK_OK(laden_sched_exit(m->sc, v->hb[i], 0));
    }
    run_block(m, 6);
}

static void vdestroy(vmodel *v)
{
    destroy(&v->m);
    for (int i = 0; i < NH; i++)
        free(v->host[i]);
}

static void vram_info(laden_vram_t *vram, laden_vram_info_t *vi)
{
    CHECK_OK(laden_vram_info(vram, vi));
}

/* The GPU tier and the VRAM tier take ranges of a VBAR; the slots' room is
 * charged first; a VRAM-tier block the context has no room for streams
 * from RAM; start and stop charge and give back the slots; a GPU-tier
 * block or slots that do not fit fail load with nothing kept. */
static void in_vram(int32_t dev)
{
    laden_vram_t *vram;
    if (laden_vram_create(dev, 0, 2 * VMB, &vram) == LADEN_E_UNSUPPORTED)
        return;
    bool cuda = dev != LADEN_DEVICE_CPU;
    /* Blocks that may stream: on CUDA the VRAM and RAM tiers and the disk
     * block (3 slots of 1.5 MiB); on the CPU device only the disk block. */
    const uint64_t disk_bytes = 2048 + 4096 * 7; /* model block 6, aligned */
    uint64_t R = cuda ? 3 * (3 * VMB / 2) : disk_bytes;
    laden_vram_info_t vi;
    vmodel v;

    /* Room for pages 0-2 and the slots: the last VRAM block (page 3)
     * streams. */
    CHECK_OK(laden_vram_set_budget(vram, 6 * VMB + VMB + R));
    vbuild(&v, dev, vram);
    CHECK_OK(laden_sched_load(v.m.sc));
    for (int i = 0; i < 4; i++)
        CHECK_EQ(laden_sched_block_tier(v.m.sc, v.hb[i]), LADEN_TIER_GPU);
    CHECK_EQ(laden_sched_block_tier(v.m.sc, v.hb[4]), LADEN_TIER_RAM);
    CHECK_EQ(laden_sched_block_tier(v.m.sc, v.hb[5]), LADEN_TIER_RAM);
    CHECK_EQ(laden_sched_is_streamed(v.m.sc, v.hb[4]), (cuda ? 1 : 0));
    /* What the load decided, in one call: only the VRAM-tier block
     * without room is marked offloaded (the RAM-tier block was asked). */
    for (int i = 0; i < NH; i++) {
        int32_t tier;
        uint64_t bytes;
        uint32_t flags;
        CHECK_OK(laden_sched_block_state(v.m.sc, v.hb[i], &tier, &bytes,
                                         &flags));
        CHECK_EQ(tier, laden_sched_block_tier(v.m.sc, v.hb[i]));
        CHECK_EQ(bytes, laden_sched_block_bytes(v.m.sc, v.hb[i]));
        CHECK_EQ(!!(flags & LADEN_SCHED_BLOCK_OFFLOADED), i == 4);
        CHECK_EQ(!!(flags & LADEN_SCHED_BLOCK_STREAMED),
                 laden_sched_is_streamed(v.m.sc, v.hb[i]));
    }
    laden_sched_stats_t st;
    CHECK_OK(laden_sched_stats(v.m.sc, &st));
    CHECK_EQ(st.offloaded_bytes, 3 * VMB / 2);
    CHECK_EQ(st.gpu_bytes, VMB + 3 * (3 * VMB / 2));
    vram_info(vram, &vi);
    CHECK(vi.pinned_bytes == 6 * VMB && vi.mapped_bytes == 6 * VMB);
    CHECK(vi.charged_bytes == R && vi.vbars == 1);
    CHECK_OK(laden_sched_start(v.m.sc, 2));
    CHECK_OK(laden_sched_stats(v.m.sc, &st));
    vram_info(vram, &vi);
    CHECK_EQ(vi.charged_bytes, (uint64_t)st.nslots * st.slot_bytes);
    for (int pass = 0; pass < 2; pass++)
        vrun(&v);
    CHECK_OK(laden_sched_stop(v.m.sc));
    vram_info(vram, &vi);
    CHECK_EQ(vi.charged_bytes, 0);
    /* Someone else takes the room meanwhile: start says so, changes
     * nothing, and works once the room is back. */
    uint64_t rest = 6 * VMB + VMB + R - 6 * VMB;
    CHECK_OK(laden_vram_charge(vram, rest));
    CHECK_STATUS(laden_sched_start(v.m.sc, 2), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "slots of");
    CHECK_OK(laden_vram_uncharge(vram, rest));
    CHECK_OK(laden_sched_start(v.m.sc, 2));
    vrun(&v);
    vdestroy(&v);
    vram_info(vram, &vi);
    CHECK(vi.vbars == 0 && vi.mapped_bytes == 0 && vi.charged_bytes == 0);

    /* No room for the GPU tier (less than a page after the slots). */
    CHECK_OK(laden_vram_set_budget(vram, R + VMB));
    vbuild(&v, dev, vram);
    CHECK_STATUS(laden_sched_load(v.m.sc), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "must be on the device");
    vram_info(vram, &vi);
    CHECK(vi.vbars == 0 && vi.mapped_bytes == 0 && vi.charged_bytes == 0);
    CHECK_OK(laden_sched_stats(v.m.sc, &st));
    CHECK_EQ(st.pinned_bytes, 0);
    vdestroy(&v);

    /* No room for the slots. */
    CHECK_OK(laden_vram_set_budget(vram, R - 1));
    vbuild(&v, dev, vram);
    CHECK_STATUS(laden_sched_load(v.m.sc), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "slots of");
    vram_info(vram, &vi);
    CHECK(vi.vbars == 0 && vi.charged_bytes == 0);
    vdestroy(&v);

    /* A context is taken before load only, and on the schedule's device. */
    vbuild(&v, dev, NULL);
    CHECK_OK(laden_sched_load(v.m.sc));
    CHECK_STATUS(laden_sched_use_vram(v.m.sc, vram), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "before load");
    /* Without a context the VRAM tier is allocated like the GPU tier. */
    for (int i = 0; i < 5; i++)
        CHECK_EQ(laden_sched_block_tier(v.m.sc, v.hb[i]), LADEN_TIER_GPU);
    CHECK_OK(laden_sched_start(v.m.sc, 2));
    vrun(&v);
    vdestroy(&v);
    laden_vram_destroy(vram);
}

TEST(stream_in_vram_context) { test_on_every_device(in_vram); }

/* One load in a VRAM context with every VMM allocation call failing in
 * turn: load either succeeds (the blocks whose pages could not be mapped
 * stream, the bytes are right everywhere) or fails with nothing kept; no
 * reservation or physical page outlives the schedule. */
static uint64_t injected_load(laden_vram_t *vram)
{
    vmodel v;
    vbuild(&v, LADEN_DEVICE_CPU, vram);
    laden_status s = laden_sched_load(v.m.sc);
    laden_vram_info_t vi;
    if (s == LADEN_OK) {
        laden_sched_stats_t st;
        CHECK_OK(laden_sched_stats(v.m.sc, &st));
        uint64_t moved = 0;
        for (int i = 1; i < 5; i++)
            if (laden_sched_block_tier(v.m.sc, v.hb[i]) == LADEN_TIER_RAM)
                moved += HSIZE[i];
        CHECK_EQ(st.offloaded_bytes, moved);
        CHECK_OK(laden_sched_start(v.m.sc, 2));
        vrun(&v);
    } else {
        /* Only the GPU tier (or the reservation) failing is an error. */
        CHECK(s == LADEN_E_BUDGET || s == LADEN_E_DEVICE_NOMEM);
        vram_info(vram, &vi);
        CHECK(vi.vbars == 0 && vi.charged_bytes == 0);
    }
    vdestroy(&v);
    vram_info(vram, &vi);
    CHECK(vi.vbars == 0 && vi.mapped_bytes == 0 && vi.charged_bytes == 0);
    return laden_dev_cpu_fail_vmm_at(0);
}

TEST(stream_in_vram_every_failure_injected)
{
    laden_vram_t *vram;
    CHECK_OK(laden_vram_create(LADEN_DEVICE_CPU, 0, 2 * VMB, &vram));
    uint64_t res0, phys0, res1, phys1;
    laden_dev_cpu_vmm_live(&res0, &phys0);
    laden_dev_cpu_fail_vmm_at(0);
    uint64_t calls = injected_load(vram); /* a clean run */
    CHECK(calls >= 5);                    /* a reservation, 4 pages */
    for (uint64_t n = 1; n <= calls; n++) {
        laden_dev_cpu_fail_vmm_at(n);
        CHECK(injected_load(vram) >= n); /* it failed there */
        laden_dev_cpu_vmm_live(&res1, &phys1);
        CHECK(res1 == res0 && phys1 == phys0);
    }
    laden_vram_destroy(vram);
}

/* A cache schedule of three 2 MiB blocks from host memory. */
static laden_sched_t *cache_sched(unsigned char *host[3], int seed)
{
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU,
                              .flags = LADEN_SCHED_CACHE};
    laden_sched_t *sc;
    CHECK_OK(laden_sched_create(&cfg, NULL, &sc));
    for (int i = 0; i < 3; i++) {
        uint32_t b, t;
        host[i] = malloc(2 * VMB);
        for (uint64_t j = 0; j < 2 * VMB; j++)
            host[i][j] = val(200 + seed * 3 + i, j);
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
        CHECK_OK(laden_sched_add_host_tensor(sc, b, host[i], LADEN_DTYPE_U8,
                                             2 * VMB, LADEN_DTYPE_U8, &t));
    }
    CHECK_OK(laden_sched_load(sc));
    return sc;
}

/* Reserving room for a cache schedule's uploads evicts another VBAR's
 * unpinned pages in one batch; the faults that follow only map. */
TEST(stream_reserve_vram_batches_evictions)
{
    laden_vram_t *vram;
    CHECK_OK(laden_vram_create(LADEN_DEVICE_CPU, 8 * VMB, 2 * VMB, &vram));
    unsigned char *ha[3], *hb[3];
    laden_sched_t *a = cache_sched(ha, 0), *b = cache_sched(hb, 1);
    CHECK_OK(laden_sched_use_vram(a, vram));
    CHECK_OK(laden_sched_use_vram(b, vram));
    for (uint32_t i = 0; i < 3; i++)
        CHECK_OK(laden_sched_set_resident(a, i, 1));
    CHECK_OK(laden_sched_ready(a, 0));
    for (uint32_t i = 0; i < 3; i++)
        CHECK_OK(laden_sched_set_resident(a, i, 0)); /* unpinned, mapped */
    laden_vram_info_t vi;
    vram_info(vram, &vi);
    CHECK(vi.mapped_bytes == 6 * VMB && vi.evictions == 0);
    const uint8_t all[3] = {1, 1, 1};
    CHECK_STATUS(laden_sched_reserve_vram(b, all, 2), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "2 flags for 3 blocks");
    /* A cache schedule takes its context once loaded. */
    laden_sched_config ccfg = {.device = LADEN_DEVICE_CPU,
                               .flags = LADEN_SCHED_CACHE};
    laden_sched_t *unloaded;
    CHECK_OK(laden_sched_create(&ccfg, NULL, &unloaded));
    CHECK_STATUS(laden_sched_use_vram(unloaded, vram), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "once loaded");
    laden_sched_destroy(unloaded);
    CHECK_OK(laden_vbar_prioritize(laden_sched_vbar(b)));
    CHECK_OK(laden_sched_reserve_vram(b, all, 3));
    vram_info(vram, &vi);
    CHECK(vi.evictions == 2 && vi.mapped_bytes == 2 * VMB);
    CHECK_EQ(vi.spare_bytes, 4 * VMB); /* kept for b's faults */
    laden_dev_cpu_fail_vmm_at(0);     /* counts the VMM calls from here */
    for (uint32_t i = 0; i < 3; i++)
        CHECK_OK(laden_sched_set_resident(b, i, 1));
    CHECK_OK(laden_sched_ready(b, 0));
    /* Three maps, one new physical page: the spares were mapped again. */
    CHECK_EQ(laden_dev_cpu_fail_vmm_at(0), 4);
    vram_info(vram, &vi);
    CHECK(vi.evictions == 2 && vi.mapped_bytes == 8 * VMB);
    CHECK_EQ(vi.spare_bytes, 0);
    for (uint32_t i = 0; i < 3; i++) {
        laden_devptr_t p;
        CHECK_OK(laden_sched_tensor_ptr(b, i, 0, &p));
        CHECK_EQ(memcmp((void *)(uintptr_t)p, hb[i], 2 * VMB), 0);
    }
    /* Room there already: nothing evicted. */
    CHECK_OK(laden_sched_reserve_vram(b, all, 3));
    vram_info(vram, &vi);
    CHECK_EQ(vi.evictions, 2);
    laden_sched_destroy(a);
    laden_sched_destroy(b);
    for (int i = 0; i < 3; i++) {
        free(ha[i]);
        free(hb[i]);
    }
    laden_vram_destroy(vram);
}

/* ---- planning a described schedule ---------------------------------------- */

#include "laden/plan.h"

static const laden_tier ALL_AUTO[NB] = {
    LADEN_TIER_AUTO, LADEN_TIER_AUTO, LADEN_TIER_AUTO, LADEN_TIER_AUTO,
    LADEN_TIER_AUTO, LADEN_TIER_AUTO, LADEN_TIER_AUTO};

/* Budgets of a plan on the CPU device: RAM only (no VRAM field). */
static laden_plan_input cpu_budgets(uint64_t ram_budget)
{
    laden_plan_input in = {0};
    in.ram_total_bytes = in.ram_free_bytes = 1ull << 40;
    in.ram_budget_bytes = ram_budget;
    in.min_free_ram_bytes = 0;
    in.resident_blocks = -1;
    return in;
}

/* The planner places every AUTO block; sizes are known before load and
 * are those of the load; the planned tiers are the loaded ones. */
TEST(stream_plan_described_cpu)
{
    model m;
    build(&m, LADEN_DEVICE_CPU, ALL_AUTO, 0);
    uint32_t n = laden_sched_block_count(m.sc);
    uint64_t bytes[NB + 1], sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        bytes[i] = laden_sched_block_bytes(m.sc, i);
        CHECK(bytes[i] > 0);
        sum += bytes[i];
    }
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[0]), LADEN_TIER_AUTO);
    CHECK_EQ(laden_sched_block_tier(m.sc, n), -2);
    CHECK_EQ(laden_sched_block_bytes(m.sc, n), 0);
    /* Block a of model block 0 is 1000 bytes, padded to 1024; b 4096. */
    CHECK_EQ(bytes[m.block_of[0]], 1024 + 4096);
    /* A RAM tier for a third of the blocks: the others stream from disk
     * (the rest and the slots take free RAM outside the budget). */
    uint64_t rest = bytes[m.block_of[NB]];
    laden_plan_input in = cpu_budgets((sum - rest) / 3);
    int32_t why[NB + 1];
    laden_plan_result res;
    CHECK_OK(laden_sched_plan(m.sc, &in, why, &res));
    CHECK(res.disk_bytes > 0 && res.ram_bytes > 0);
    int tier[NB + 1];
    for (uint32_t i = 0; i < n; i++) {
        tier[i] = laden_sched_block_tier(m.sc, i);
        CHECK(laden_plan_why_text(why[i]) != NULL);
        if (i == m.block_of[NB])
            CHECK_EQ(tier[i], LADEN_TIER_GPU); /* asked */
        else
            CHECK(tier[i] >= LADEN_TIER_GPU && tier[i] <= LADEN_TIER_DISK);
    }
    CHECK_OK(laden_sched_load(m.sc));
    laden_sched_stats_t st;
    CHECK_OK(laden_sched_stats(m.sc, &st));
    CHECK_EQ(st.ram_bytes, res.ram_bytes);
    CHECK_EQ(st.disk_bytes, res.disk_bytes);
    CHECK_EQ(st.gpu_bytes, res.gpu_bytes);
    for (uint32_t i = 0; i < n; i++) {
        CHECK_EQ(laden_sched_block_bytes(m.sc, i), bytes[i]);
        CHECK_EQ(laden_sched_block_tier(m.sc, i), tier[i]);
    }
    CHECK_OK(laden_sched_start(m.sc, 0));
    for (int i = 0; i <= NB; i++)
        run_block(&m, i);
    CHECK_OK(laden_sched_stop(m.sc));
    destroy(&m);
}

/* A budget that cannot be met changes nothing. */
TEST(stream_plan_over_budget_keeps_tiers)
{
    model m;
    build(&m, LADEN_DEVICE_CPU, ALL_AUTO, 0);
    laden_plan_input in = cpu_budgets(1ull << 30);
    CHECK_OK(laden_sched_plan(m.sc, &in, NULL, NULL));
    int before[NB + 1];
    for (int i = 0; i <= NB; i++) {
        before[i] = laden_sched_block_tier(m.sc, m.block_of[i]);
        CHECK(before[i] != LADEN_TIER_AUTO);
    }
    in = cpu_budgets(LADEN_PLAN_AUTO);
    in.ram_free_bytes = 1000; /* not even the rest and the slots fit */
    int32_t why[NB + 1] = {-7};
    CHECK_STATUS(laden_sched_plan(m.sc, &in, why, NULL), LADEN_E_BUDGET);
    CHECK_EQ(why[0], -7);
    for (int i = 0; i <= NB; i++)
        CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[i]), before[i]);
    CHECK_OK(laden_sched_load(m.sc)); /* as first planned */
    destroy(&m);
}

/* Load refuses blocks the planner has not placed; adding to a planned
 * schedule makes its AUTO blocks the planner's again; a loaded schedule
 * is not planned again. */
TEST(stream_load_refuses_unplanned)
{
    model m;
    build(&m, LADEN_DEVICE_CPU, ALL_AUTO, 0);
    CHECK_STATUS(laden_sched_load(m.sc), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "plan it first");
    laden_plan_input in = cpu_budgets(1ull << 30);
    CHECK_OK(laden_sched_plan(m.sc, &in, NULL, NULL));
    uint32_t extra, ti;
    size_t idx;
    CHECK_OK(laden_sched_add_block(m.sc, LADEN_TIER_RAM, &extra));
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[0]), LADEN_TIER_AUTO);
    CHECK_OK(laden_st_find(m.st, "embed", &idx));
    CHECK_OK(laden_sched_add_tensor(m.sc, extra, m.st, idx, LADEN_DTYPE_U8,
                                     &ti));
    CHECK_STATUS(laden_sched_load(m.sc), LADEN_E_STATE);
    CHECK_OK(laden_sched_plan(m.sc, &in, NULL, NULL));
    CHECK_OK(laden_sched_load(m.sc)); /* the refusals broke nothing */
    CHECK_STATUS(laden_sched_plan(m.sc, &in, NULL, NULL), LADEN_E_STATE);
    CHECK_OK(laden_sched_start(m.sc, 0));
    for (int i = 0; i <= NB; i++)
        run_block(&m, i);
    destroy(&m);
}

/* A cache decides its schedules' residency: they are not planned. */
TEST(stream_plan_refuses_cache_schedules)
{
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU,
                              .flags = LADEN_SCHED_CACHE};
    laden_sched_t *sc;
    uint32_t b, t;
    unsigned char host[64] = {0};
    CHECK_OK(laden_sched_create(&cfg, NULL, &sc));
    CHECK_STATUS(laden_sched_add_block(sc, LADEN_TIER_AUTO, &b),
                 LADEN_E_INVAL);
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
    CHECK_OK(laden_sched_add_host_tensor(sc, b, host, LADEN_DTYPE_U8, 64,
                                         LADEN_DTYPE_U8, &t));
    laden_plan_input in = cpu_budgets(0);
    CHECK_STATUS(laden_sched_plan(sc, &in, NULL, NULL), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "cache");
    CHECK_EQ(laden_sched_block_tier(sc, b), LADEN_TIER_RAM);
    CHECK_OK(laden_sched_load(sc));
    laden_sched_destroy(sc);
}

/* F32 tensors "w0".."w{n-1}", n_elems each, values i * 0.37 + k. */
static laden_st_t *write_f32(const char *file, int n, uint64_t n_elems)
{
    char hdr[4096] = "{";
    float *data = malloc((size_t)n * n_elems * 4);
    for (int k = 0; k < n; k++) {
        char e[160];
        snprintf(e, sizeof e,
                 "%s\"w%d\":{\"dtype\":\"F32\",\"shape\":[%llu],"
                 "\"data_offsets\":[%llu,%llu]}",
                 k ? "," : "", k, (unsigned long long)n_elems,
                 (unsigned long long)(k * n_elems * 4),
                 (unsigned long long)((k + 1) * n_elems * 4));
        strcat(hdr, e);
        for (uint64_t i = 0; i < n_elems; i++)
            data[k * n_elems + i] = (float)i * 0.37f + (float)k;
    }
    strcat(hdr, "}");
    char *p = test_path(file);
    test_write_st(p, hdr, data, (size_t)n * n_elems * 4);
    free(data);
    laden_st_t *st;
    CHECK_OK(laden_st_open(p, &st));
    return st;
}

/* A block whose tensor is converted on load (F32 stored as BF16) cannot
 * stream from disk: the planner keeps it in RAM even when RAM is short,
 * or fails. */
TEST(stream_plan_converted_block_never_on_disk)
{
    laden_st_t *st = write_f32("conv.safetensors", 4, 1024);
    for (uint64_t budget = 2048; budget <= 4 * 4096 + 2048; budget += 2048) {
        laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
        laden_sched_t *sc;
        uint32_t b[4], t;
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        for (uint32_t k = 0; k < 4; k++) {
            CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_AUTO, &b[k]));
            CHECK_OK(laden_sched_add_tensor(sc, b[k], st, k,
                                            k == 2 ? LADEN_DTYPE_BF16
                                                   : LADEN_DTYPE_F32,
                                            &t));
        }
        CHECK_EQ(laden_sched_block_bytes(sc, b[2]), 2048);
        laden_plan_input in = cpu_budgets(budget);
        laden_status s = laden_sched_plan(sc, &in, NULL, NULL);
        if (s == LADEN_OK) {
            CHECK(laden_sched_block_tier(sc, b[2]) != LADEN_TIER_DISK);
            CHECK_OK(laden_sched_load(sc));
            CHECK(laden_sched_block_tier(sc, b[2]) != LADEN_TIER_DISK);
        } else {
            CHECK_STATUS(s, LADEN_E_BUDGET);
            CHECK_EQ(laden_sched_block_tier(sc, b[2]), LADEN_TIER_AUTO);
        }
        laden_sched_destroy(sc);
    }
    /* Asked for the disk tier, the conversion is refused at once. */
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc;
    uint32_t b, t;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &b));
    CHECK_STATUS(laden_sched_add_tensor(sc, b, st, 0, LADEN_DTYPE_BF16, &t),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "'w0'");
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* A planned device block of a schedule in a VRAM context takes the VRAM
 * tier: on the device if the context has room at load. */
TEST(stream_plan_in_vram_context)
{
    model m;
    laden_vram_t *vram;
    CHECK_OK(laden_vram_create(LADEN_DEVICE_CPU, 0, 2 * VMB, &vram));
    build(&m, LADEN_DEVICE_CPU, ALL_AUTO, 0);
    laden_plan_input in = cpu_budgets(1ull << 30);
    in.resident_blocks = 2;
    CHECK_OK(laden_sched_plan(m.sc, &in, NULL, NULL));
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[0]), LADEN_TIER_GPU);
    /* The context is an input of the plan: plan again. */
    CHECK_OK(laden_sched_use_vram(m.sc, vram));
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[0]), LADEN_TIER_AUTO);
    CHECK_OK(laden_sched_plan(m.sc, &in, NULL, NULL));
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[0]), LADEN_TIER_VRAM);
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[1]), LADEN_TIER_VRAM);
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[2]), LADEN_TIER_RAM);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_EQ(laden_sched_block_tier(m.sc, m.block_of[0]), LADEN_TIER_GPU);
    CHECK_OK(laden_sched_start(m.sc, 0));
    for (int i = 0; i <= NB; i++)
        run_block(&m, i);
    destroy(&m);
    laden_vram_destroy(vram);
}

/* ---- a property: whatever the planner decides loads and runs ------------ */

#define PB_MAX 8 /* blocks */
#define PT_MAX 4 /* tensors per block */

typedef struct ptensor {
    laden_dtype ck, as; /* in the checkpoint, stored */
    uint64_t n, off;    /* elements; offset in the data (checkpoint) */
    void *host;         /* from host memory instead (a copy of ck bytes) */
    uint32_t index;     /* in its block */
} ptensor;

typedef struct pmodel {
    uint32_t nb, nt[PB_MAX];
    laden_tier asked[PB_MAX];
    bool no_disk[PB_MAX];
    ptensor t[PB_MAX][PT_MAX];
    unsigned char *data;
    uint64_t data_bytes;
} pmodel;

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static laden_dtype float_dtype(uint64_t r)
{
    static const laden_dtype d[3] = {LADEN_DTYPE_F32, LADEN_DTYPE_F16,
                                     LADEN_DTYPE_BF16};
    return d[r % 3];
}

/* Random blocks of random float tensors, some converted, some from host
 * memory, a few blocks asked a tier; the checkpoint written as "p.st". */
static laden_st_t *random_model(pmodel *pm, uint64_t *rs)
{
    char *hdr = malloc(16384);
    strcpy(hdr, "{");
    memset(pm, 0, sizeof *pm);
    pm->nb = 1 + (uint32_t)(next_rand(rs) % PB_MAX);
    pm->data = malloc(PB_MAX * PT_MAX * 600 * 4);
    for (uint32_t b = 0; b < pm->nb; b++) {
        pm->nt[b] = 1 + (uint32_t)(next_rand(rs) % PT_MAX);
        for (uint32_t k = 0; k < pm->nt[b]; k++) {
            ptensor *t = &pm->t[b][k];
            t->ck = float_dtype(next_rand(rs));
            t->as = next_rand(rs) % 4 ? t->ck : float_dtype(next_rand(rs));
            t->n = 1 + next_rand(rs) % 600;
            float *f = malloc(t->n * 4);
            for (uint64_t i = 0; i < t->n; i++)
                f[i] = (float)((int)(next_rand(rs) % 2001) - 1000) / 64.0f;
            t->off = pm->data_bytes;
            CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, f, t->ck,
                                         pm->data + t->off, t->n));
            free(f);
            pm->data_bytes += t->n * laden_dtype_bits(t->ck) / 8;
            if (next_rand(rs) % 8 == 0) {
                t->host = malloc(t->n * 4);
                memcpy(t->host, pm->data + t->off,
                       t->n * laden_dtype_bits(t->ck) / 8);
            }
            pm->no_disk[b] |= t->as != t->ck || t->host;
            char e[200];
            snprintf(e, sizeof e,
                     "%s\"b%u.t%u\":{\"dtype\":\"%s\",\"shape\":[%llu],"
                     "\"data_offsets\":[%llu,%llu]}",
                     b + k ? "," : "", b, k, laden_dtype_name(t->ck),
                     (unsigned long long)t->n, (unsigned long long)t->off,
                     (unsigned long long)pm->data_bytes);
            strcat(hdr, e);
        }
        uint64_t r = next_rand(rs) % 16;
        pm->asked[b] = LADEN_TIER_AUTO;
        if (r == 0)
            pm->asked[b] = LADEN_TIER_RAM;
        else if (r == 1)
            pm->asked[b] = LADEN_TIER_GPU;
        else if (r == 2 && !pm->no_disk[b])
            pm->asked[b] = LADEN_TIER_DISK;
    }
    strcat(hdr, "}");
    char *p = test_path("p.safetensors");
    test_write_st(p, hdr, pm->data, pm->data_bytes);
    free(hdr);
    laden_st_t *st;
    CHECK_OK(laden_st_open(p, &st));
    return st;
}

static void describe(laden_sched_t *sc, laden_st_t *st, pmodel *pm)
{
    for (uint32_t b = 0; b < pm->nb; b++) {
        uint32_t bi;
        CHECK_OK(laden_sched_add_block(sc, pm->asked[b], &bi));
        CHECK_EQ(bi, b);
        for (uint32_t k = 0; k < pm->nt[b]; k++) {
            ptensor *t = &pm->t[b][k];
            char name[32];
            size_t idx;
            snprintf(name, sizeof name, "b%u.t%u", b, k);
            CHECK_OK(laden_st_find(st, name, &idx));
            if (t->host)
                CHECK_OK(laden_sched_add_host_tensor(sc, b, t->host, t->ck,
                                                     t->n, t->as,
                                                     &t->index));
            else
                CHECK_OK(laden_sched_add_tensor(sc, b, st, idx, t->as,
                                                 &t->index));
            CHECK_EQ(t->index, k);
        }
    }
}

/* Runs every block and compares each tensor with its checkpoint bytes,
 * converted as stored. */
static void check_values(laden_sched_t *sc, const pmodel *pm)
{
    unsigned char want[600 * 4];
    CHECK_OK(laden_sched_start(sc, 0));
    for (uint32_t b = 0; b < pm->nb; b++) {
        CHECK_OK(laden_sched_enter(sc, b, 0));
        for (uint32_t k = 0; k < pm->nt[b]; k++) {
            const ptensor *t = &pm->t[b][k];
            laden_devptr_t p;
            CHECK_OK(laden_sched_tensor_ptr(sc, b, k, &p));
            CHECK_OK(laden_sched_convert(t->ck, pm->data + t->off, t->as,
                                         want, t->n));
            if (memcmp((void *)(uintptr_t)p, want,
                       t->n * laden_dtype_bits(t->as) / 8)) {
                fprintf(stderr, "block %u tensor %u (tier %d) differs\n", b,
                        k, laden_sched_block_tier(sc, b));
                exit(1);
            }
        }
        CHECK_OK(laden_sched_exit(sc, b, 0));
    }
    CHECK_OK(laden_sched_stop(sc));
}

static void free_pmodel(pmodel *pm)
{
    for (uint32_t b = 0; b < pm->nb; b++)
        for (uint32_t k = 0; k < pm->nt[b]; k++)
            free(pm->t[b][k].host);
    free(pm->data);
}

/* Random budgets for pm's blocks (sum bytes): RAM from none to all. */
static laden_plan_input random_budgets(uint64_t sum, uint64_t *rs)
{
    laden_plan_input in = cpu_budgets(sum / 4 + next_rand(rs) % (4 * sum));
    in.resident_blocks = (int32_t)(next_rand(rs) % 4) - 1;
    in.lookahead = next_rand(rs) % 2 ? 1 + (uint32_t)(next_rand(rs) % 4) : 0;
    return in;
}

typedef struct pcount {
    int ok, budget, disk, ram_converted;
} pcount;

/* One random model, planned with random budgets.  If the plan succeeds,
 * load succeeds with the planned tiers and the bytes read are the
 * checkpoint's; if not, nothing changed. */
static void plan_one(uint64_t *rs, laden_io_t *io, pcount *c)
{
    pmodel pm;
    laden_st_t *st = random_model(&pm, rs);
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU,
                              .lookahead = 1 + (uint32_t)(next_rand(rs) % 4),
                              .io = io};
    laden_sched_t *sc;
    uint64_t bytes[PB_MAX], sum = 0;
    int32_t why[PB_MAX];
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    describe(sc, st, &pm);
    for (uint32_t b = 0; b < pm.nb; b++)
        sum += bytes[b] = laden_sched_block_bytes(sc, b);
    laden_plan_input in = random_budgets(sum, rs);
    laden_plan_result res;
    laden_status s = laden_sched_plan(sc, &in, why, &res);
    if (s) {
        CHECK_STATUS(s, LADEN_E_BUDGET);
        for (uint32_t b = 0; b < pm.nb; b++)
            CHECK_EQ(laden_sched_block_tier(sc, b), pm.asked[b]);
        c->budget++;
    } else {
        int tier[PB_MAX];
        for (uint32_t b = 0; b < pm.nb; b++) {
            tier[b] = laden_sched_block_tier(sc, b);
            CHECK(laden_plan_why_text(why[b]) != NULL);
            if (pm.asked[b] != LADEN_TIER_AUTO)
                CHECK_EQ(tier[b], pm.asked[b]);
            CHECK(tier[b] >= LADEN_TIER_GPU && tier[b] <= LADEN_TIER_DISK);
            if (pm.no_disk[b])
                CHECK(tier[b] != LADEN_TIER_DISK);
            c->disk += tier[b] == LADEN_TIER_DISK;
            c->ram_converted += tier[b] == LADEN_TIER_RAM && pm.no_disk[b];
        }
        /* Again, with the plan's RAM limit as the schedule's pinned
         * budget.  Its arena rounds each block up to 64 KiB; the planner
         * counts exact bytes. */
        laden_sched_destroy(sc);
        cfg.ram_budget_bytes = res.ram_limit_bytes + pm.nb * (64u << 10);
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        describe(sc, st, &pm);
        CHECK_OK(laden_sched_plan(sc, &in, NULL, NULL));
        CHECK_OK(laden_sched_load(sc));
        for (uint32_t b = 0; b < pm.nb; b++) {
            CHECK_EQ(laden_sched_block_tier(sc, b), tier[b]);
            CHECK_EQ(laden_sched_block_bytes(sc, b), bytes[b]);
        }
        check_values(sc, &pm);
        c->ok++;
    }
    laden_sched_destroy(sc);
    laden_st_close(st);
    free_pmodel(&pm);
}

TEST(stream_plan_property_loads_as_planned)
{
    uint64_t rs = 0x1234abcd5678ef01ull;
    laden_io_t *io;
    pcount c = {0};
    CHECK_OK(laden_io_create(NULL, &io));
    for (int it = 0; it < 200; it++)
        plan_one(&rs, io, &c);
    laden_io_destroy(io);
    fprintf(stderr, "%d planned (%d disk blocks, %d converted in RAM), "
            "%d over budget\n", c.ok, c.disk, c.ram_converted, c.budget);
    CHECK(c.ok >= 50 && c.budget >= 10);
    CHECK(c.disk > 0 && c.ram_converted > 0);
}

/* ---- loading: many blocks in flight, progress, page cache ------------------ */

typedef struct prog {
    uint64_t calls, last, total, stop_after;
    bool monotonic;
} prog;

static int on_progress(void *arg, uint64_t done, uint64_t total)
{
    prog *p = arg;
    p->monotonic &= done > p->last && done <= total;
    p->calls++;
    p->last = done;
    p->total = total;
    return p->stop_after && p->calls >= p->stop_after;
}

/* 100 blocks (more than the 64 a load keeps in flight), some converted:
 * every block loaded right, the progress callback called once per block
 * with growing bytes up to the total, the bytes read counted, and read
 * from the page cache (the file was just written) where O_DIRECT works. */
static void many_blocks(int32_t dev)
{
    enum { N = 100, E = 3000 };
    char *hdr = malloc(N * 128 + 16);
    float *data = malloc(sizeof(float) * N * E);
    strcpy(hdr, "{");
    for (int i = 0; i < N; i++) {
        char e[128];
        snprintf(e, sizeof e,
                 "%s\"b%d\":{\"dtype\":\"F32\",\"shape\":[%d],"
                 "\"data_offsets\":[%d,%d]}", i ? "," : "", i, E,
                 i * E * 4, (i + 1) * E * 4);
        strcat(hdr, e);
        for (int j = 0; j < E; j++)
            data[i * E + j] = (float)((i * 7 + j) % 200); /* bf16-exact */
    }
    strcat(hdr, "}");
    char *path = test_path("many.safetensors");
    test_write_st(path, hdr, data, sizeof(float) * N * E);
    laden_st_t *st;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = dev};
    laden_sched_t *sc;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    for (int i = 0; i < N; i++) {
        uint32_t b, t;
        size_t idx;
        char name[16];
        snprintf(name, sizeof name, "b%d", i);
        CHECK_OK(laden_st_find(st, name, &idx));
        /* GPU-tier blocks in runs of three: on CUDA they take turns in
         * the two staging buffers. */
        CHECK_OK(laden_sched_add_block(sc, i % 4 ? LADEN_TIER_GPU
                                                 : LADEN_TIER_RAM, &b));
        CHECK_OK(laden_sched_add_tensor(sc, b, st, idx,
                                        i % 3 ? LADEN_DTYPE_F32
                                              : LADEN_DTYPE_BF16, &t));
    }
    prog p = {.monotonic = true};
    CHECK_OK(laden_sched_set_progress(sc, on_progress, &p));
    CHECK_OK(laden_sched_load(sc));
    CHECK_EQ(p.calls, N);
    CHECK(p.monotonic);
    CHECK_EQ(p.last, p.total);
    laden_sched_stats_t s;
    CHECK_OK(laden_sched_stats(sc, &s));
    CHECK_EQ(s.load_read_bytes, sizeof(float) * N * E);
    CHECK(s.load_cached_bytes <= s.load_read_bytes);
    laden_dev_stream_t *rd = NULL;
    if (dev != LADEN_DEVICE_CPU)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    for (int i = 0; i < N; i++) {
        char raw[8];
        if (i % 4 == 0) { /* RAM tier: its home */
            void *h;
            CHECK_OK(laden_sched_host_ptr(sc, (uint32_t)i, 0, &h));
            memcpy(raw, h, sizeof raw);
        } else {
            laden_devptr_t ptr;
            CHECK_OK(laden_sched_tensor_ptr(sc, (uint32_t)i, 0, &ptr));
            if (rd) {
                CHECK_OK(laden_dev_copy_d2h(rd, raw, ptr, sizeof raw));
                CHECK_OK(laden_dev_stream_synchronize(rd));
            } else {
                memcpy(raw, (void *)(uintptr_t)ptr, sizeof raw);
            }
        }
        float got[2];
        if (i % 3) {
            memcpy(got, raw, sizeof got);
        } else {
            uint16_t h[2];
            memcpy(h, raw, sizeof h);
            CHECK_OK(laden_sched_convert(LADEN_DTYPE_BF16, h,
                                         LADEN_DTYPE_F32, got, 2));
        }
        CHECK_FEQ(got[0], (float)((i * 7) % 200));
        CHECK_FEQ(got[1], (float)((i * 7 + 1) % 200));
    }
    laden_dev_stream_destroy(rd);
    laden_sched_destroy(sc);
    /* A callback that asks to stop cancels the load: it fails, naming
     * why, after the reads in flight ended; the schedule is freed whole
     * (ASan checks). */
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    for (int i = 0; i < N; i++) {
        uint32_t b, t;
        size_t idx;
        char name[16];
        snprintf(name, sizeof name, "b%d", i);
        CHECK_OK(laden_st_find(st, name, &idx));
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
        CHECK_OK(laden_sched_add_tensor(sc, b, st, idx, LADEN_DTYPE_BF16,
                                        &t));
    }
    prog q = {.monotonic = true, .stop_after = 10};
    CHECK_OK(laden_sched_set_progress(sc, on_progress, &q));
    CHECK_STATUS(laden_sched_load(sc), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "cancelled");
    CHECK_EQ(q.calls, 10);
    laden_sched_destroy(sc);
    laden_st_close(st);
    free(hdr);
    free(data);
}

TEST(stream_load_many_blocks_with_progress)
{
    test_on_every_device(many_blocks);
}

/* CUDA: GPU-tier blocks are copied to the device through staging pieces
 * (of 256 MiB; here of one tensor each, so every block takes several);
 * each tensor arrives whole at its place. */
static void staged_pieces(int32_t dev)
{
    if (dev == LADEN_DEVICE_CPU)
        return; /* nothing is staged on the CPU device */
    static const laden_tier ALL_GPU[NB] = {
        LADEN_TIER_GPU, LADEN_TIER_GPU, LADEN_TIER_GPU, LADEN_TIER_GPU,
        LADEN_TIER_GPU, LADEN_TIER_GPU, LADEN_TIER_GPU};
    model m;
    build(&m, dev, ALL_GPU, 0);
    m.sc->load.stage_bytes = 1;
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    for (int i = 0; i <= NB; i++)
        run_block(&m, i);
    CHECK_OK(laden_sched_stop(m.sc));
    destroy(&m);
}

TEST(stream_gpu_tier_staged_in_pieces) { test_on_every_device(staged_pieces); }

/* ---- loading in the background (laden_sched_load_begin) ---------------- */

/* A progress callback that slows the loader down (so that the owner's
 * calls meet it mid-load) and may stop it. */
typedef struct {
    _Atomic int calls;
    int stop_after; /* 0: never */
    useconds_t nap;
} slow;

static int on_slow(void *arg, uint64_t done, uint64_t total)
{
    slow *w = arg;
    (void)done;
    (void)total;
    int n = ++w->calls;
    if (w->nap)
        usleep(w->nap);
    return w->stop_after && n >= w->stop_after;
}

/* Runs block i as a forward pass does while the model loads: a resident
 * block is awaited first; a streamed one is entered straight away (enter
 * waits for it). */
static void run_loading(model *m, int i)
{
    uint32_t b = m->block_of[i];
    if (!laden_sched_is_streamed(m->sc, b))
        CHECK_OK(laden_sched_await(m->sc, b));
    run_block(m, i);
}

/* A pass runs while the blocks load, in order and out of order, on every
 * tier, with staged pieces on CUDA; every byte is right; the load then
 * ends as a laden_sched_load would. */
static void background(int32_t dev)
{
    static const laden_tier ALL_GPU[NB] = {
        LADEN_TIER_GPU, LADEN_TIER_GPU, LADEN_TIER_GPU, LADEN_TIER_GPU,
        LADEN_TIER_GPU, LADEN_TIER_GPU, LADEN_TIER_GPU};
    for (int variant = 0; variant < 3; variant++) {
        model m;
        slow w = {.nap = 2000};
        build(&m, dev, variant == 1 ? ALL_GPU : MIXED, 0);
        if (variant == 1)
            m.sc->load.stage_bytes = 1;
        CHECK_OK(laden_sched_set_progress(m.sc, on_slow, &w));
        CHECK_OK(laden_sched_load_begin(m.sc));
        CHECK_STATUS(laden_sched_load(m.sc), LADEN_E_STATE);
        CHECK_STATUS(laden_sched_load_begin(m.sc), LADEN_E_STATE);
        CHECK_OK(laden_sched_start(m.sc, 0));
        if (variant == 2) { /* the last block first, then the rest */
            run_loading(&m, NB - 1);
            run_loading(&m, 2);
        }
        run_loading(&m, NB);
        for (int i = 0; i < NB; i++)
            run_loading(&m, i);
        CHECK_STATUS(laden_sched_await(m.sc, 99), LADEN_E_INVAL);
        CHECK_OK(laden_sched_load_wait(m.sc));
        CHECK_EQ(laden_sched_is_loaded(m.sc), 1);
        CHECK_OK(laden_sched_load_wait(m.sc)); /* once loaded: at once */
        for (int i = 0; i <= NB; i++)
            run_block(&m, i);
        laden_sched_stats_t st;
        CHECK_OK(laden_sched_stats(m.sc, &st));
        CHECK(st.load_read_bytes > 0);
        CHECK_OK(laden_sched_stop(m.sc));
        destroy(&m);
    }
}

TEST(stream_background_load_runs_as_blocks_arrive)
{
    test_on_every_device(background);
}

/* Destroyed, or closed, while loading: the load stops (its reads in
 * flight end first), nothing leaks (ASan), nothing hangs; a cancel from
 * the progress callback is the next await's error and load_wait's. */
static void background_stopped(int32_t dev)
{
    for (int variant = 0; variant < 3; variant++) {
        model m;
        slow w = {.nap = 3000, .stop_after = variant == 2 ? 3 : 0};
        build(&m, dev, MIXED, 0);
        CHECK_OK(laden_sched_set_progress(m.sc, on_slow, &w));
        CHECK_OK(laden_sched_load_begin(m.sc));
        if (variant == 0) {
            destroy(&m); /* mid-load */
            continue;
        }
        if (variant == 1) {
            CHECK_OK(laden_sched_close(m.sc));
            CHECK_EQ(laden_sched_is_loaded(m.sc), 0);
            CHECK_STATUS(laden_sched_await(m.sc, m.block_of[0]),
                         LADEN_E_STATE);
            CHECK_CONTAINS(laden_last_error(), "closed");
            destroy(&m);
            continue;
        }
        laden_status s = LADEN_OK;
        for (int i = 0; i < NB && !s; i++)
            s = laden_sched_await(m.sc, m.block_of[i]);
        CHECK_STATUS(s, LADEN_E_STATE);
        CHECK_CONTAINS(laden_last_error(), "cancelled");
        CHECK_STATUS(laden_sched_load_wait(m.sc), LADEN_E_STATE);
        CHECK_CONTAINS(laden_last_error(), "cancelled");
        CHECK_STATUS(laden_sched_load_wait(m.sc), LADEN_E_STATE);
        CHECK_EQ(laden_sched_is_loaded(m.sc), 0);
        /* A block read before the failure is refused too. */
        CHECK_STATUS(laden_sched_await(m.sc, m.block_of[0]), LADEN_E_STATE);
        CHECK_STATUS(laden_sched_start(m.sc, 0), LADEN_E_STATE);
        destroy(&m);
    }
}

TEST(stream_background_load_stopped_or_failed)
{
    test_on_every_device(background_stopped);
}

/* A forward interrupted between a call into C and the Python that would
 * end it (Ctrl-C) leaves a pass begun and blocks entered: end_all ends
 * them all, with each slot's free event recorded, so that the next pass
 * runs every block and the schedule closes; with nothing held it is a
 * no-op, and another thread's hold is not its to end. */
static void *end_all_elsewhere(void *arg)
{
    model *m = arg;
    laden_status s = laden_sched_end_all(m->sc, NULL);
    return (void *)(intptr_t)(s ? 1 : 0);
}

static void end_all(int32_t dev)
{
    model m;
    build(&m, dev, MIXED, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 1));
    uint32_t exited = 9;
    CHECK_OK(laden_sched_end_all(m.sc, &exited)); /* nothing held */
    CHECK_EQ(exited, 0);
    for (int round = 0; round < 3; round++) {
        CHECK_OK(laden_sched_begin(m.sc));
        for (int i = 0; i < NB; i++)
            run_block(&m, i);
        /* Interrupted: blocks 1 and 3 (disk) entered, never exited;
         * a nested pass begun (an interrupt right after begin). */
        CHECK_OK(laden_sched_enter(m.sc, m.block_of[1], 0));
        if (round > 0)
            CHECK_OK(laden_sched_enter(m.sc, m.block_of[3], 0));
        if (round == 2)
            CHECK_OK(laden_sched_begin(m.sc));
        /* Another thread cannot end this thread's pass: it holds nothing. */
        pthread_t t;
        void *got = NULL;
        pthread_create(&t, NULL, end_all_elsewhere, &m);
        pthread_join(t, &got);
        CHECK_EQ((intptr_t)got, 0);
        CHECK_STATUS(laden_sched_close(m.sc), LADEN_E_STATE); /* held */
        CHECK_OK(laden_sched_end_all(m.sc, &exited));
        CHECK_EQ(exited, round > 0 ? 2 : 1);
        CHECK_STATUS(laden_sched_end(m.sc), LADEN_E_STATE); /* ended */
        CHECK_STATUS(laden_sched_exit(m.sc, m.block_of[1], 0),
                     LADEN_E_STATE);
        /* The next pass runs every block, with the right bytes. */
        CHECK_OK(laden_sched_begin(m.sc));
        for (int i = NB; i >= 0; i--)
            run_block(&m, i);
        CHECK_OK(laden_sched_end_all(m.sc, &exited));
        CHECK_EQ(exited, 0);
    }
    CHECK_OK(laden_sched_close(m.sc));
    CHECK_STATUS(laden_sched_end_all(NULL, NULL), LADEN_E_INVAL);
    destroy(&m);
}

TEST(stream_end_all_mends_an_interrupted_pass)
{
    test_on_every_device(end_all);
}

/* await_for gives up within its time and comes back, so that a long wait
 * is a loop of short calls; it gets there in the end, for a block and for
 * the whole load.  load_cancel stops a background load for good: every
 * later await says it was cancelled, and the schedule still closes. */
static void await_for(int32_t dev)
{
    for (int variant = 0; variant < 2; variant++) {
        model m;
        slow w = {.nap = 20000}; /* 20 ms a piece */
        build(&m, dev, MIXED, 0);
        CHECK_OK(laden_sched_set_progress(m.sc, on_slow, &w));
        int done = 7;
        CHECK_STATUS(laden_sched_await_for(m.sc, -1, 0, NULL), LADEN_E_INVAL);
        CHECK_STATUS(laden_sched_await_for(m.sc, -1, 1, &done),
                     LADEN_E_STATE); /* no load begun */
        CHECK_EQ(done, 0);
        CHECK_OK(laden_sched_load_begin(m.sc));
        CHECK_STATUS(laden_sched_await_for(m.sc, 99, 1, &done),
                     LADEN_E_INVAL);
        uint64_t t0 = laden__now_ns();
        CHECK_OK(laden_sched_await_for(m.sc, -1, 1, &done));
        uint64_t took_ms = (laden__now_ns() - t0) / 1000000u;
        if (!done) /* back after about one piece, not the whole load */
            CHECK(took_ms < 2000);
        if (variant == 0) {
            int calls = 0;
            do {
                CHECK_OK(laden_sched_await_for(m.sc, m.block_of[NB - 1], 5,
                                               &done));
                calls++;
            } while (!done);
            do
                CHECK_OK(laden_sched_await_for(m.sc, -1, 5, &done));
            while (!done);
            CHECK_EQ(laden_sched_is_loaded(m.sc), 1);
            CHECK_OK(laden_sched_await_for(m.sc, -1, 0, &done));
            CHECK_EQ(done, 1);
            CHECK_OK(laden_sched_load_cancel(m.sc)); /* nothing to stop */
            CHECK_OK(laden_sched_start(m.sc, 0));
            for (int i = 0; i <= NB; i++)
                run_block(&m, i);
            CHECK_OK(laden_sched_stop(m.sc));
        } else {
            CHECK_OK(laden_sched_load_cancel(m.sc));
            CHECK_STATUS(laden_sched_await_for(m.sc, -1, 5, &done),
                         LADEN_E_STATE);
            CHECK_CONTAINS(laden_last_error(), "cancelled");
            CHECK_STATUS(laden_sched_load_wait(m.sc), LADEN_E_STATE);
            CHECK_CONTAINS(laden_last_error(), "cancelled");
            CHECK_EQ(laden_sched_is_loaded(m.sc), 0);
            CHECK_OK(laden_sched_close(m.sc));
        }
        destroy(&m);
    }
}

TEST(stream_await_for_and_load_cancel)
{
    test_on_every_device(await_for);
}

/* Another thread's call while the loader holds the schedule waits for the
 * step instead of being refused; while the owner is inside a pass the
 * other thread is refused as before. */
typedef struct {
    model *m;
    laden_status got;
} other;

static void *await_last(void *arg)
{
    other *o = arg;
    o->got = laden_sched_await(o->m->sc, o->m->block_of[NB - 1]);
    return NULL;
}

static void background_threads(int32_t dev)
{
    model m;
    slow w = {.nap = 2000};
    build(&m, dev, MIXED, 0);
    CHECK_OK(laden_sched_set_progress(m.sc, on_slow, &w));
    CHECK_OK(laden_sched_load_begin(m.sc));
    other o = {.m = &m};
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, await_last, &o), 0);
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_OK(o.got);
    CHECK_OK(laden_sched_begin(m.sc));
    CHECK_EQ(pthread_create(&th, NULL, await_last, &o), 0);
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_STATUS(o.got, LADEN_E_STATE);
    CHECK_OK(laden_sched_end(m.sc));
    CHECK_OK(laden_sched_load_wait(m.sc));
    destroy(&m);
}

TEST(stream_background_load_threads)
{
    test_on_every_device(background_threads);
}

/* Found in review.  A close refused (the owner is inside a pass) leaves
 * the background load running; a close racing the owner's load_wait is
 * either refused or wins, never both half-way (TSan checks the claims of
 * the loader's thread); cache schedules do not load in the background. */
typedef struct {
    model *m;
    laden_status got;
} closer;

static void *close_other(void *arg)
{
    closer *c = arg;
    c->got = laden_sched_close(c->m->sc);
    return NULL;
}

static void background_close(int32_t dev)
{
    model m;
    slow w = {.nap = 3000};
    build(&m, dev, MIXED, 0);
    CHECK_OK(laden_sched_set_progress(m.sc, on_slow, &w));
    CHECK_OK(laden_sched_load_begin(m.sc));
    CHECK_OK(laden_sched_begin(m.sc));
    closer c = {.m = &m};
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, close_other, &c), 0);
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_STATUS(c.got, LADEN_E_STATE);
    CHECK_OK(laden_sched_end(m.sc));
    for (int i = 0; i < 5000 && !laden_sched_is_loaded(m.sc); i++)
        usleep(1000); /* the loader's thread ends the load on its own */
    CHECK_EQ(laden_sched_is_loaded(m.sc), 1);
    CHECK_OK(laden_sched_load_wait(m.sc));
    destroy(&m);
    for (int it = 0; it < 5; it++) {
        slow q = {.nap = 1000};
        build(&m, dev, MIXED, 0);
        CHECK_OK(laden_sched_set_progress(m.sc, on_slow, &q));
        CHECK_OK(laden_sched_load_begin(m.sc));
        c.m = &m;
        CHECK_EQ(pthread_create(&th, NULL, close_other, &c), 0);
        laden_status s = laden_sched_load_wait(m.sc);
        CHECK_EQ(pthread_join(th, NULL), 0);
        CHECK(s == LADEN_OK || s == LADEN_E_STATE);
        CHECK(c.got == LADEN_OK || c.got == LADEN_E_STATE);
        destroy(&m);
    }
    /* Cache schedules load whole (laden_sched_load, _load_block). */
    laden_sched_config cfg = {.device = dev, .flags = LADEN_SCHED_CACHE};
    laden_sched_t *sc;
    laden_st_t *st;
    CHECK_OK(laden_st_open(write_model(), &st));
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t b, t;
    size_t idx;
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
    CHECK_OK(laden_st_find(st, "embed", &idx));
    CHECK_OK(laden_sched_add_tensor(sc, b, st, idx, LADEN_DTYPE_U8, &t));
    CHECK_STATUS(laden_sched_load_begin(sc), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "cache schedule");
    CHECK_OK(laden_sched_load(sc));
    laden_sched_destroy(sc);
    laden_st_close(st);
}

TEST(stream_background_load_close)
{
    test_on_every_device(background_close);
}

/* Begin, a few awaits or blocks run, then close, wait or nothing, then
 * destroy: in any mix, no leak, race or hang. */
static void background_stress(int32_t dev)
{
    uint64_t rs = 12345;
    for (int it = 0; it < 24; it++) {
        model m;
        slow w = {.nap = (useconds_t)(it % 3) * 500};
        build(&m, dev, MIXED, 0);
        CHECK_OK(laden_sched_set_progress(m.sc, on_slow, &w));
        if (it % 4 == 3) { /* prepared first: pointers before the thread */
            CHECK_OK(laden_sched_load_prepare(m.sc));
            void *h;
            CHECK_OK(laden_sched_host_ptr(m.sc, m.block_of[0], 0, &h));
        }
        CHECK_OK(laden_sched_load_begin(m.sc));
        rs = rs * 6364136223846793005ull + 1442695040888963407ull;
        int ops = (int)((rs >> 33) % 6);
        if (ops > 2)
            CHECK_OK(laden_sched_start(m.sc, 0));
        for (int k = 0; k < ops; k++) {
            int i = (int)((rs >> (10 + k * 3)) % (NB + 1));
            if (ops > 2)
                run_loading(&m, i);
            else
                CHECK_OK(laden_sched_await(m.sc, m.block_of[i]));
            (void)laden_sched_is_pinned(m.sc, m.block_of[i]);
        }
        switch ((rs >> 40) % 3) {
        case 0: break;
        case 1: CHECK_OK(laden_sched_close(m.sc)); break;
        case 2: CHECK_OK(laden_sched_load_wait(m.sc)); break;
        }
        destroy(&m);
    }
}

TEST(stream_background_load_stress)
{
    test_on_every_device(background_stress);
}

/* Bytes changed in place (an adapter merged into a slot or a resident
 * block) are undone: a slot's fill count says when it was filled again,
 * laden_sched_refill makes every idle slot fill again on its next enter,
 * laden_sched_reread reads a resident tensor from the checkpoint again. */
static void scribble(model *m, laden_devptr_t p, uint64_t n)
{
    memset(m->buf, 0xAB, n);
    if (m->rd) {
        CHECK_OK(laden_dev_copy_h2d(m->rd, p, m->buf, n));
        CHECK_OK(laden_dev_stream_synchronize(m->rd));
    } else {
        memcpy((void *)(uintptr_t)p, m->buf, n);
    }
}

static void changed_in_place(int32_t dev)
{
    model m;
    build(&m, dev, MIXED, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    for (int i = 0; i < NB; i++) {
        uint32_t b = m.block_of[i];
        laden_devptr_t p;
        uint64_t fills = 0, again = 0;
        run_block(&m, i);
        if (!laden_sched_is_streamed(m.sc, b)) {
            CHECK_STATUS(laden_sched_slot_fills(m.sc, b, &fills),
                         LADEN_E_STATE);
            CHECK_OK(laden_sched_tensor_ptr(m.sc, b, 1, &p));
            scribble(&m, p, sz(2 * i + 1));
            CHECK_OK(laden_sched_reread(m.sc, b, 1));
            run_block(&m, i); /* the checkpoint's bytes again */
            continue;
        }
        CHECK_STATUS(laden_sched_reread(m.sc, b, 0), LADEN_E_STATE);
        CHECK_CONTAINS(laden_last_error(), "streamed");
        CHECK_OK(laden_sched_slot_fills(m.sc, b, &fills));
        CHECK(fills > 0);
        CHECK_OK(laden_sched_enter(m.sc, b, 0));
        CHECK_OK(laden_sched_tensor_ptr(m.sc, b, 0, &p));
        scribble(&m, p, sz(2 * i));
        CHECK_OK(laden_sched_exit(m.sc, b, 0));
        CHECK_OK(laden_sched_slot_fills(m.sc, b, &again));
        CHECK_EQ(again, fills); /* still the scribbled bytes */
        CHECK_OK(laden_sched_refill(m.sc));
        run_block(&m, i); /* filled again: the original bytes */
        CHECK_OK(laden_sched_slot_fills(m.sc, b, &again));
        CHECK(again > fills);
    }
    CHECK_STATUS(laden_sched_reread(m.sc, 99, 0), LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_slot_fills(m.sc, m.block_of[0], NULL),
                 LADEN_E_INVAL);
    CHECK_OK(laden_sched_stop(m.sc));
    destroy(&m);
}

TEST(stream_changed_in_place_undone) { test_on_every_device(changed_in_place); }

/* The test model as a loaded cache schedule, every block on the RAM
 * tier, with a stream to read the device back (m->rd, on a GPU). */
static void load_cache_model(model *m, int32_t dev)
{
    memset(m, 0, sizeof *m);
    m->dev = dev;
    CHECK_OK(laden_st_open(write_model(), &m->st));
    laden_sched_config cfg = {.device = dev, .flags = LADEN_SCHED_CACHE};
    CHECK_OK(laden_sched_create(&cfg, m->st, &m->sc));
    for (int i = 0; i < NB; i++) {
        CHECK_OK(laden_sched_add_block(m->sc, LADEN_TIER_RAM,
                                       &m->block_of[i]));
        for (int k = 0; k < 2; k++) {
            size_t idx;
            uint32_t ti;
            char name[64];
            snprintf(name, sizeof name, "blocks.%d.%c", i, k ? 'b' : 'a');
            CHECK_OK(laden_st_find(m->st, name, &idx));
            CHECK_OK(laden_sched_add_tensor(m->sc, m->block_of[i], m->st, idx,
                                            LADEN_DTYPE_U8, &ti));
        }
    }
    if (dev != LADEN_DEVICE_CPU)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &m->rd));
    m->buf = malloc(1 << 20);
    CHECK_OK(laden_sched_load(m->sc));
}

/* Cache schedules: a device copy changed in place (an adapter merged) is
 * written again from the host copy by laden_sched_reupload, and its
 * upload count says when it was written. */
static void copy_rewritten(int32_t dev)
{
    model m;
    load_cache_model(&m, dev);
    uint32_t b = m.block_of[3];
    uint64_t fills = 99;
    CHECK_OK(laden_sched_copy_fills(m.sc, b, &fills));
    CHECK_EQ(fills, 0); /* no device copy yet */
    CHECK_STATUS(laden_sched_reupload(m.sc, b), LADEN_E_STATE);
    CHECK_OK(laden_sched_set_resident(m.sc, b, 1));
    CHECK_OK(laden_sched_copy_fills(m.sc, b, &fills));
    CHECK_EQ(fills, 1);
    laden_devptr_t p, host_p;
    CHECK_OK(laden_sched_tensor_ptr(m.sc, b, 1, &host_p));
    /* A writer asks for a copy of its own first: on the CPU device the
     * block ran from its host copy, which must never change. */
    int made = 7;
    CHECK_STATUS(laden_sched_own_copy(m.sc, b, NULL), LADEN_E_INVAL);
    CHECK_OK(laden_sched_own_copy(m.sc, b, &made));
    CHECK_EQ(made, dev == LADEN_DEVICE_CPU);
    CHECK_OK(laden_sched_own_copy(m.sc, b, &made)); /* once */
    CHECK_EQ(made, 0);
    CHECK_OK(laden_sched_tensor_ptr(m.sc, b, 1, &p));
    CHECK(dev == LADEN_DEVICE_CPU ? p != host_p : p == host_p);
    CHECK_OK(laden_sched_copy_fills(m.sc, b, &fills));
    CHECK_EQ(fills, dev == LADEN_DEVICE_CPU ? 2u : 1u);
    uint64_t before = fills;
    scribble(&m, p, sz(7));
    if (dev == LADEN_DEVICE_CPU) /* the host copy is untouched */
        for (uint64_t j = 0; j < sz(7); j++)
            CHECK_EQ(((uint8_t *)(uintptr_t)host_p)[j], val(7, j));
    CHECK_OK(laden_sched_reupload(m.sc, b));
    CHECK_OK(laden_sched_copy_fills(m.sc, b, &fills));
    CHECK_EQ(fills, before + 1);
    if (m.rd) {
        CHECK_OK(laden_dev_copy_d2h(m.rd, m.buf, p, sz(7)));
        CHECK_OK(laden_dev_stream_synchronize(m.rd));
    } else {
        memcpy(m.buf, (void *)(uintptr_t)p, sz(7));
    }
    for (uint64_t j = 0; j < sz(7); j++)
        CHECK_EQ(m.buf[j], val(7, j));
    CHECK_STATUS(laden_sched_copy_fills(m.sc, 99, &fills), LADEN_E_INVAL);
    destroy(&m);
}

TEST(stream_cache_copy_rewritten) { test_on_every_device(copy_rewritten); }

/* Reads n bytes at device address p into m->buf. */
static void fetch_back(model *m, laden_devptr_t p, uint64_t n)
{
    if (m->rd) {
        CHECK_OK(laden_dev_copy_d2h(m->rd, m->buf, p, n));
        CHECK_OK(laden_dev_stream_synchronize(m->rd));
    } else {
        memcpy(m->buf, (void *)(uintptr_t)p, n);
    }
}

/* Cache schedules: a host copy an optimizer changed (a trainable model)
 * reaches the device copy one tensor at a time (laden_sched_reupload_tensor),
 * ordered on the compute stream; the block's other tensors stay as they
 * are.  On the CPU device a block running from its host copy in place has
 * nothing to write. */
static void tensor_rewritten(int32_t dev)
{
    model m;
    load_cache_model(&m, dev);
    uint32_t b = m.block_of[2];
    CHECK_STATUS(laden_sched_reupload_tensor(m.sc, b, 1, 0), LADEN_E_STATE);
    CHECK_OK(laden_sched_set_resident(m.sc, b, 1));
    CHECK_OK(laden_sched_ready(m.sc, 0));
    CHECK_STATUS(laden_sched_reupload_tensor(m.sc, b, 2, 0), LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_reupload_tensor(m.sc, 99, 0, 0), LADEN_E_INVAL);
    void *h0, *h1;
    CHECK_OK(laden_sched_host_ptr(m.sc, b, 0, &h0));
    CHECK_OK(laden_sched_host_ptr(m.sc, b, 1, &h1));
    laden_devptr_t d0, d1;
    if (dev == LADEN_DEVICE_CPU) {
        /* In place: the host copy is what runs; nothing to write. */
        CHECK_OK(laden_sched_tensor_ptr(m.sc, b, 1, &d1));
        CHECK_EQ(d1, (laden_devptr_t)(uintptr_t)h1);
        CHECK_OK(laden_sched_reupload_tensor(m.sc, b, 1, 0));
        int made;
        CHECK_OK(laden_sched_own_copy(m.sc, b, &made)); /* a copy of its own */
        CHECK_EQ(made, 1);
    }
    CHECK_OK(laden_sched_tensor_ptr(m.sc, b, 0, &d0));
    CHECK_OK(laden_sched_tensor_ptr(m.sc, b, 1, &d1));
    CHECK(d1 != (laden_devptr_t)(uintptr_t)h1);
    /* Tensor 0's device copy is marked, tensor 1's host copy stepped. */
    scribble(&m, d0, sz(4));
    for (uint64_t j = 0; j < sz(5); j++)
        ((uint8_t *)h1)[j] = (uint8_t)(val(5, j) ^ 0x5A);
    laden_sched_stats_t before, after;
    CHECK_OK(laden_sched_stats(m.sc, &before));
    CHECK_OK(laden_sched_reupload_tensor(m.sc, b, 1, 0));
    CHECK_OK(laden_sched_synchronize(m.sc));
    if (m.rd)
        CHECK_OK(laden_dev_stream_synchronize(m.rd));
    CHECK_OK(laden_sched_stats(m.sc, &after));
    CHECK_EQ(after.upload_bytes - before.upload_bytes, sz(5));
    fetch_back(&m, d1, sz(5));
    for (uint64_t j = 0; j < sz(5); j++)
        CHECK_EQ(m.buf[j], (uint8_t)(val(5, j) ^ 0x5A));
    fetch_back(&m, d0, sz(4)); /* untouched: only tensor 1 was written */
    for (uint64_t j = 0; j < sz(4); j++)
        CHECK_EQ(m.buf[j], 0xAB);
    for (uint64_t j = 0; j < sz(4); j++) /* nor its host copy */
        CHECK_EQ(((uint8_t *)h0)[j], val(4, j));
    destroy(&m);
}

TEST(stream_cache_tensor_rewritten)
{
    test_on_every_device(tensor_rewritten);
}

/* ---- one host copy shared between schedules and processes ------------- */

/* The segments' directory: in /dev/shm (tmpfs, which CUDA can pin; a
 * regular file system's pages it cannot), else the test's own. */
static const char *shm_test_dir(void)
{
    const char *dir = test_shm_dir();
    (void)mkdir(dir, 0700); /* again after a variant removed it */
    setenv("LADEN_SHM_DIR", dir, 1);
    return dir;
}

/* Segments in the test's shm directory. */
static int segments(void)
{
    DIR *d = opendir(shm_test_dir());
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += strncmp(e->d_name, "laden-", 6) == 0;
    if (d)
        closedir(d);
    return n;
}

static void share_state(model *m, int32_t want, uint64_t *bytes)
{
    char name[64];
    int32_t state = -1;
    CHECK_OK(laden_sched_share_info(m->sc, name, sizeof name, bytes, &state));
    CHECK_EQ(state, want);
    CHECK(want == 0 || strlen(name) == 33);
}

static void run_all(model *m)
{
    CHECK_OK(laden_sched_start(m->sc, 0));
    for (int pass = 0; pass < 2; pass++) {
        run_block(m, NB);
        for (int i = 0; i < NB; i++)
            run_block(m, i);
    }
    CHECK_OK(laden_sched_synchronize(m->sc));
    CHECK_OK(laden_sched_stop(m->sc));
}

/* Two schedules of one process (two devices would be the same): the
 * second attaches to the first's segment and reads nothing of what is
 * there; both run right; another key or a rewritten file is another
 * segment; the last to go removes it; share after a load and a reread
 * there are refused. */
static void shared_copy(int32_t dev)
{
    CHECK_EQ(segments(), 0);
    char *path = strdup(write_model());
    model a, b, c;
    build_from(&a, path, dev, MIXED, 0);
    build_from(&b, path, dev, MIXED, 0);
    build_from(&c, path, dev, MIXED, 0);
    CHECK_OK(laden_sched_share(a.sc, "test"));
    CHECK_OK(laden_sched_share(b.sc, "test"));
    CHECK_OK(laden_sched_share(c.sc, "other"));
    share_state(&a, 0, NULL);
    CHECK_OK(laden_sched_load(a.sc));
    uint64_t bytes = 0, bytes_b = 0;
    share_state(&a, 1, &bytes);
    /* RAM tier (blocks 0, 4, 6); on the CPU device the GPU tier too
     * (block 2 and embed), which runs there in place. */
    uint64_t want = 0;
    for (int i = 0; i <= NB; i++) {
        laden_tier t = i == NB ? LADEN_TIER_GPU : MIXED[i];
        if (t == LADEN_TIER_RAM ||
            (t == LADEN_TIER_GPU && dev == LADEN_DEVICE_CPU))
            want += (laden_sched_block_bytes(a.sc, a.block_of[i]) + 4095) &
                    ~4095ull;
    }
    CHECK_EQ(bytes, want);
    CHECK_EQ(segments(), 1);
    laden_sched_stats_t sa, sb;
    CHECK_OK(laden_sched_load(b.sc));
    share_state(&b, 2, &bytes_b);
    CHECK_EQ(bytes_b, bytes);
    CHECK_OK(laden_sched_stats(a.sc, &sa));
    CHECK_OK(laden_sched_stats(b.sc, &sb));
    /* b read only what is not in the segment. */
    uint64_t in_seg = 0;
    for (int i = 0; i <= NB; i++) {
        laden_tier t = i == NB ? LADEN_TIER_GPU : MIXED[i];
        if (t == LADEN_TIER_RAM ||
            (t == LADEN_TIER_GPU && dev == LADEN_DEVICE_CPU))
            in_seg += i == NB ? sz(2 * NB) : sz(2 * i) + sz(2 * i + 1);
    }
    CHECK_EQ(sa.load_read_bytes - sb.load_read_bytes, in_seg);
    /* Where the host copy is, both see the same bytes (two mappings). */
    void *ha = NULL, *hb = NULL;
    CHECK_OK(laden_sched_host_ptr(a.sc, a.block_of[0], 0, &ha));
    CHECK_OK(laden_sched_host_ptr(b.sc, b.block_of[0], 0, &hb));
    CHECK(ha != hb);
    CHECK_EQ(memcmp(ha, hb, sz(0)), 0);
    if (dev != LADEN_DEVICE_CPU) {
        /* Attaching counts the pinned copy in this schedule's RAM budget. */
        model small;
        build_from(&small, path, dev, MIXED, 4096);
        CHECK_OK(laden_sched_share(small.sc, "test"));
        CHECK_STATUS(laden_sched_load(small.sc), LADEN_E_BUDGET);
        CHECK(strstr(laden_last_error(), "RAM budget"));
        destroy(&small);
    }
    CHECK_OK(laden_sched_load(c.sc));
    share_state(&c, 1, NULL); /* another key: its own */
    CHECK_EQ(segments(), 2);
    run_all(&a);
    run_all(&b);
    run_all(&c);
    CHECK_STATUS(laden_sched_share(a.sc, "late"), LADEN_E_STATE);
    if (dev == LADEN_DEVICE_CPU) /* block 2: GPU tier, in the segment */
        CHECK_STATUS(laden_sched_reread(a.sc, a.block_of[2], 0),
                     LADEN_E_STATE);
    destroy(&c);
    CHECK_EQ(segments(), 1);
    destroy(&a); /* the maker goes first: b keeps it */
    run_all(&b);
    CHECK_EQ(segments(), 1);
    destroy(&b);
    CHECK_EQ(segments(), 0);
    /* The file rewritten (same bytes, new mtime): another segment. */
    build_from(&a, path, dev, MIXED, 0);
    CHECK_OK(laden_sched_share(a.sc, "test"));
    CHECK_OK(laden_sched_load(a.sc));
    char n1[64], n2[64];
    CHECK_OK(laden_sched_share_info(a.sc, n1, sizeof n1, NULL, NULL));
    struct timespec ts[2] = {{0, UTIME_NOW}, {1, 0}};
    CHECK_EQ(utimensat(AT_FDCWD, path, ts, 0), 0);
    build_from(&b, path, dev, MIXED, 0);
    CHECK_OK(laden_sched_share(b.sc, "test"));
    CHECK_OK(laden_sched_load(b.sc));
    share_state(&b, 1, NULL);
    CHECK_OK(laden_sched_share_info(b.sc, n2, sizeof n2, NULL, NULL));
    CHECK(strcmp(n1, n2) != 0);
    destroy(&a);
    destroy(&b);
    CHECK_EQ(segments(), 0);
    /* CUDA cannot pin a segment on a regular file system: said at load. */
    struct statfs sf;
    if (dev != LADEN_DEVICE_CPU && statfs(test_tmpdir(), &sf) == 0 &&
        sf.f_type != 0x01021994 /* tmpfs */) {
        setenv("LADEN_SHM_DIR", test_tmpdir(), 1);
        build_from(&a, path, dev, MIXED, 0);
        CHECK_OK(laden_sched_share(a.sc, "test"));
        CHECK_STATUS(laden_sched_load(a.sc), LADEN_E_INVAL);
        CHECK(strstr(laden_last_error(), "LADEN_SHM_DIR"));
        destroy(&a);
        shm_test_dir();
    }
    CHECK_EQ(segments(), 0);
    rmdir(shm_test_dir());
    free(path);
}

TEST(stream_shared_copy) { test_on_every_device(shared_copy); }

/* A load that would attach to a segment this process is making, with
 * nothing filling it (its load prepared and left, on this thread): refused
 * at once, not waited for forever; once the maker's load has run, the
 * same load attaches. */
static void shared_self_wait(int32_t dev)
{
    char *path = strdup(write_model());
    model a, b;
    build_from(&a, path, dev, MIXED, 0);
    build_from(&b, path, dev, MIXED, 0);
    CHECK_OK(laden_sched_share(a.sc, "self"));
    CHECK_OK(laden_sched_share(b.sc, "self"));
    uint64_t held = 1;
    CHECK_OK(laden_sched_shared_bytes(a.st, &held));
    CHECK_EQ(held, 0);
    CHECK_OK(laden_sched_load_prepare(a.sc)); /* made, not filled */
    /* What a planning process credits: this checkpoint's segments, not
     * another's (a file of its own, written after). */
    uint64_t seg = 0;
    CHECK_OK(laden_sched_share_info(a.sc, NULL, 0, &seg, NULL));
    CHECK_OK(laden_sched_shared_bytes(a.st, &held));
    CHECK(seg > 0 && held >= seg && held <= seg + 65536);
    char *copy = test_path("copy.safetensors");
    {
        FILE *in = fopen(path, "rb"), *out = fopen(copy, "wb");
        CHECK(in && out);
        char buf[65536];
        for (size_t n; (n = fread(buf, 1, sizeof buf, in)) > 0;)
            CHECK(fwrite(buf, 1, n, out) == n);
        fclose(in);
        CHECK(fclose(out) == 0);
    }
    model elsewhere;
    build_from(&elsewhere, copy, dev, MIXED, 0);
    CHECK_OK(laden_sched_shared_bytes(elsewhere.st, &held));
    CHECK_EQ(held, 0);
    destroy(&elsewhere);
    CHECK_STATUS(laden_sched_shared_bytes(NULL, &held), LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_load(b.sc), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "never end"));
    CHECK_OK(laden_sched_load_wait(a.sc)); /* this thread fills it */
    destroy(&b);
    build_from(&b, path, dev, MIXED, 0);
    CHECK_OK(laden_sched_share(b.sc, "self"));
    CHECK_OK(laden_sched_load(b.sc));
    run_all(&a);
    run_all(&b);
    destroy(&a);
    destroy(&b);
    CHECK_EQ(segments(), 0);
    free(path);
}

TEST(stream_shared_copy_never_waits_for_itself)
{
    test_on_every_device(shared_self_wait);
}

/* The RAM budget counts a shared block as the segment holds it (4 KiB
 * pages) for the maker and the attacher alike, also for a block of 2 MiB
 * and up, which a private home would round to huge pages. */
static void shared_budget(int32_t dev)
{
    if (dev == LADEN_DEVICE_CPU)
        return; /* the CPU device pins nothing: no RAM-tier budget */
    enum { BIG = (2 << 20) + 8192, SMALL = 4096 };
    char hdr[256];
    snprintf(hdr, sizeof hdr,
             "{\"big\":{\"dtype\":\"U8\",\"shape\":[%d],"
             "\"data_offsets\":[0,%d]},"
             "\"small\":{\"dtype\":\"U8\",\"shape\":[%d],"
             "\"data_offsets\":[%d,%d]}}",
             BIG, BIG, SMALL, BIG, BIG + SMALL);
    unsigned char *data = malloc(BIG + SMALL);
    for (int i = 0; i < BIG + SMALL; i++)
        data[i] = (unsigned char)(i * 7 + 1);
    char *path = test_path("budget.safetensors");
    test_write_st(path, hdr, data, BIG + SMALL);
    laden_sched_t *sc[3];
    laden_st_t *st[3];
    for (int k = 0; k < 3; k++) {
        CHECK_OK(laden_st_open(path, &st[k]));
        /* k 0 and 1 within the segment's bytes exactly; k 2 a page short */
        laden_sched_config cfg = {.device = dev, .lookahead = 1,
                                  .ram_budget_bytes = BIG + SMALL -
                                                      (k == 2 ? 4096 : 0)};
        CHECK_OK(laden_sched_create(&cfg, st[k], &sc[k]));
        const char *names[] = {"big", "small"};
        for (int i = 0; i < 2; i++) {
            uint32_t b, ti;
            size_t idx;
            CHECK_OK(laden_sched_add_block(sc[k], LADEN_TIER_RAM, &b));
            CHECK_OK(laden_st_find(st[k], names[i], &idx));
            CHECK_OK(laden_sched_add_tensor(sc[k], b, st[k], idx,
                                            LADEN_DTYPE_U8, &ti));
        }
        CHECK_OK(laden_sched_share(sc[k], "budget"));
    }
    CHECK_OK(laden_sched_load(sc[0])); /* the maker */
    uint64_t seg = 0;
    CHECK_OK(laden_sched_share_info(sc[0], NULL, 0, &seg, NULL));
    CHECK_EQ(seg, (uint64_t)BIG + SMALL);
    CHECK_OK(laden_sched_load(sc[1])); /* an attacher */
    CHECK_STATUS(laden_sched_load(sc[2]), LADEN_E_BUDGET);
    for (int k = 0; k < 3; k++) {
        laden_sched_destroy(sc[k]);
        laden_st_close(st[k]);
    }
    CHECK_EQ(segments(), 0);
    free(data);
}

TEST(stream_shared_copy_budget) { test_on_every_device(shared_budget); }

/* A load on another thread than the maker's, while the maker's load is
 * prepared and not begun (Python binds the model's tensors in between):
 * it waits for the begin and attaches; a maker never begun is refused
 * after the wait; a maker destroyed meanwhile is the waiter's failure. */
typedef struct {
    model *m;
    laden_status s;
    char msg[512];
    atomic_int done;
} side_load;

static void *side_load_run(void *p)
{
    side_load *l = p;
    l->s = laden_sched_load(l->m->sc);
    snprintf(l->msg, sizeof l->msg, "%s", laden_last_error());
    atomic_store(&l->done, 1);
    return NULL;
}

static void nap_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&t, NULL);
}

static void shared_prepared_elsewhere(int32_t dev)
{
    char *path = strdup(write_model());
    uint32_t keep = laden__share_prepared_wait_ms;
    for (int round = 0; round < 3; round++) {
        model a, b;
        build_from(&a, path, dev, MIXED, 0);
        build_from(&b, path, dev, MIXED, 0);
        CHECK_OK(laden_sched_share(a.sc, "prep"));
        CHECK_OK(laden_sched_share(b.sc, "prep"));
        laden__share_prepared_wait_ms = round == 1 ? 50 : keep;
        CHECK_OK(laden_sched_load_prepare(a.sc));
        side_load l = {.m = &b};
        pthread_t t;
        CHECK_EQ(pthread_create(&t, NULL, side_load_run, &l), 0);
        if (round == 0) { /* begun a moment later: b waited, attached */
            nap_ms(100);
            CHECK(!atomic_load(&l.done));
            CHECK_OK(laden_sched_load_begin(a.sc));
            pthread_join(t, NULL);
            CHECK_OK(l.s);
            share_state(&b, 2, NULL);
            CHECK_OK(laden_sched_load_wait(a.sc));
            run_all(&a);
            run_all(&b);
        } else if (round == 1) { /* never begun: refused after the wait */
            pthread_join(t, NULL);
            CHECK_STATUS(l.s, LADEN_E_STATE);
            CHECK(strstr(l.msg, "not begun after 50 ms"));
        } else { /* destroyed while b waits: the maker's failure */
            nap_ms(50);
            CHECK(!atomic_load(&l.done));
            destroy(&a);
            pthread_join(t, NULL);
            CHECK_STATUS(l.s, LADEN_E_STATE);
            CHECK(strstr(l.msg, "could not fill it"));
        }
        if (round != 2)
            destroy(&a);
        destroy(&b);
        CHECK_EQ(segments(), 0);
    }
    laden__share_prepared_wait_ms = keep;
    free(path);
}

TEST(stream_shared_copy_waits_for_a_prepared_maker)
{
    test_on_every_device(shared_prepared_elsewhere);
}

/* Processes (the CPU device: a forked child cannot use its parent's CUDA
 * context): children attach to the parent's copy and run on it; one
 * whose load of the copy fails sees the maker's failure; the parent's
 * segment goes when the last user does. */
TEST(stream_shared_copy_processes)
{
    shm_test_dir();
    char *path = strdup(write_model());
    model a;
    build_from(&a, path, LADEN_DEVICE_CPU, MIXED, 0);
    CHECK_OK(laden_sched_share(a.sc, NULL));
    CHECK_OK(laden_sched_load(a.sc));
    pid_t kids[3];
    for (int k = 0; k < 3; k++) {
        kids[k] = fork();
        if (kids[k] == 0) {
            model m;
            build_from(&m, path, LADEN_DEVICE_CPU, MIXED, 0);
            int32_t state = 0;
            if (laden_sched_share(m.sc, NULL) || laden_sched_load(m.sc) ||
                laden_sched_share_info(m.sc, NULL, 0, NULL, &state) ||
                state != 2)
                _exit(2);
            run_all(&m); /* exits 1 on a wrong byte */
            destroy(&m);
            _exit(0);
        }
    }
    for (int k = 0; k < 3; k++) {
        int st = -1;
        CHECK_EQ(waitpid(kids[k], &st, 0), kids[k]);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    CHECK_EQ(segments(), 1);
    destroy(&a);
    CHECK_EQ(segments(), 0);
    rmdir(shm_test_dir());
    free(path);
}

/* ---- traces of a streamed pass (laden_trace_*) -------------------------- */

static const laden_tier RAM[NB] = {LADEN_TIER_RAM, LADEN_TIER_RAM,
                                   LADEN_TIER_RAM, LADEN_TIER_RAM,
                                   LADEN_TIER_RAM, LADEN_TIER_RAM,
                                   LADEN_TIER_RAM};

typedef struct tline {
    char cat[16], ph[4];
    double ts, dur;
    long long block, bytes;
} tline;

/* The events of a trace file, one per line as laden writes them. */
static tline *read_trace(const char *path, size_t *n)
{
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    size_t cap = 1024;
    tline *v = calloc(cap, sizeof *v);
    char line[4096];
    *n = 0;
    bool opened = false, closed = false;
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "\"traceEvents\":["))
            opened = true;
        if (!strcmp(line, "]}\n"))
            closed = true;
        char *c = strstr(line, "\"cat\":\"");
        char *p = strstr(line, "\"ph\":\"");
        if (!c || !p)
            continue;
        if (*n == cap)
            v = realloc(v, (cap *= 2) * sizeof *v);
        tline *t = &v[(*n)++];
        memset(t, 0, sizeof *t);
        t->block = t->bytes = -1;
        sscanf(c + 7, "%15[^\"]", t->cat);
        sscanf(p + 6, "%3[^\"]", t->ph);
        char *q;
        if ((q = strstr(line, "\"ts\":")))
            t->ts = strtod(q + 5, NULL);
        if ((q = strstr(line, "\"dur\":")))
            t->dur = strtod(q + 6, NULL);
        if ((q = strstr(line, "\"block\":")))
            t->block = strtoll(q + 8, NULL, 10);
        if ((q = strstr(line, "\"bytes\":")))
            t->bytes = strtoll(q + 8, NULL, 10);
    }
    fclose(f);
    CHECK(opened && closed); /* the whole document was written */
    return v;
}

static size_t count_cat(const tline *v, size_t n, const char *cat,
                        const char *ph)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += !strcmp(v[i].cat, cat) && (!ph || !strcmp(v[i].ph, ph));
    return k;
}

/* Enter and exit without reading back (a read-back would synchronize). */
static void pass_plain(model *m)
{
    CHECK_OK(laden_sched_enter(m->sc, m->block_of[NB], 0));
    CHECK_OK(laden_sched_exit(m->sc, m->block_of[NB], 0));
    for (int i = 0; i < NB; i++) {
        CHECK_OK(laden_sched_enter(m->sc, m->block_of[i], 0));
        CHECK_OK(laden_sched_exit(m->sc, m->block_of[i], 0));
    }
}

/* A traced steady-state pass: one enter/exit pair per block call, on a
 * CUDA-like device exactly one copy per streamed block call, each before
 * its block's compute on the stream, the bytes as the stats count them,
 * and no host synchronization; tracing changes no counter. */
static void traced_pass(int32_t dev)
{
    model m;
    build(&m, dev, RAM, 0);
    CHECK_OK(laden_sched_set_name(m.sc, "traced \"model\""));
    CHECK_OK(laden_sched_set_block_name(m.sc, m.block_of[2], "layers.two"));
    CHECK_STATUS(laden_sched_set_block_name(m.sc, 99, "x"), LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_set_block_name(m.sc, 0, NULL), LADEN_E_INVAL);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    laden_sched_stats_t a, b, c;
    for (int pass = 0; pass < 2; pass++)
        pass_plain(&m); /* the steady state */
    CHECK_OK(laden_sched_synchronize(m.sc));
    CHECK_OK(laden_sched_stats(m.sc, &a));
    const int passes = 3;
    for (int pass = 0; pass < passes; pass++)
        pass_plain(&m); /* untraced, for the counters */
    CHECK_OK(laden_sched_synchronize(m.sc));
    CHECK_OK(laden_sched_stats(m.sc, &b));
    char *path = test_path("trace.json");
    CHECK_OK(laden_trace_start(0));
    for (int pass = 0; pass < passes; pass++)
        pass_plain(&m);
    laden_trace_result_t res;
    CHECK_OK(laden_trace_stop(path, &res));
    CHECK_OK(laden_sched_synchronize(m.sc));
    CHECK_OK(laden_sched_stats(m.sc, &c));
    /* Tracing changed no counter. */
    CHECK_EQ(c.enters - b.enters, b.enters - a.enters);
    CHECK_EQ(c.misses - b.misses, b.misses - a.misses);
    CHECK_EQ(c.h2d_bytes - b.h2d_bytes, b.h2d_bytes - a.h2d_bytes);
    CHECK_EQ(res.dropped, 0);
    CHECK_EQ(res.unresolved, 0);
    size_t n;
    tline *v = read_trace(path, &n);
    CHECK_EQ(count_cat(v, n, "block", "B"), passes * (NB + 1));
    CHECK_EQ(count_cat(v, n, "block", "E"), passes * (NB + 1));
    if (dev != LADEN_DEVICE_CPU) {
        /* Seven streamed blocks through three slots: every streamed call
         * is one copy, no more. */
        CHECK_EQ(count_cat(v, n, "h2d", "X"), passes * NB);
        CHECK_EQ(count_cat(v, n, "compute", "X"), passes * NB);
        CHECK_EQ(count_cat(v, n, "sync", NULL), 0);
        long long bytes = 0;
        for (size_t i = 0; i < n; i++)
            if (!strcmp(v[i].cat, "h2d"))
                bytes += v[i].bytes;
        CHECK_EQ(bytes, c.h2d_bytes - b.h2d_bytes);
        /* Each compute span starts after the latest copy of its block
         * ended (the first blocks' copies may precede the trace). */
        size_t checked = 0;
        for (size_t i = 0; i < n; i++) {
            if (strcmp(v[i].cat, "compute"))
                continue;
            const tline *last = NULL;
            for (size_t k = 0; k < n; k++)
                if (!strcmp(v[k].cat, "h2d") && v[k].block == v[i].block &&
                    v[k].ts <= v[i].ts && (!last || v[k].ts > last->ts))
                    last = &v[k];
            if (!last)
                continue;
            CHECK(last->ts + last->dur <= v[i].ts + 1.0);
            checked++;
        }
        CHECK(checked >= (size_t)(passes - 1) * NB);
    } else {
        CHECK_EQ(count_cat(v, n, "h2d", NULL), 0); /* RAM runs in place */
    }
    free(v);
    /* Named in every event of its own; the model's name escaped. */
    CHECK_EQ(test_lines_containing(path, "\"name\":\"layers.two\",\"cat\":"
                                         "\"block\",\"ph\":\"B\""),
             passes);
    CHECK_EQ(test_lines_containing(path,
                                   "\"model\":\"traced \\\"model\\\"\""),
             passes * (NB + 1));
    if (dev != LADEN_DEVICE_CPU)
        CHECK_EQ(test_lines_containing(path, "\"name\":\"h2d layers.two\""),
                 passes);
    /* Off again: nothing is recorded. */
    CHECK(!laden_trace_active());
    pass_plain(&m);
    CHECK_OK(laden_sched_synchronize(m.sc));
    destroy(&m);
}

TEST(stream_trace_pass) { test_on_every_device(traced_pass); }

/* A block entered in one trace and exited in the next: the second has
 * neither half of the pair nor the block's compute span (whose start
 * mark the first trace's stop freed), and nothing touches freed marks. */
static void across_traces(int32_t dev)
{
    model m;
    build(&m, dev, RAM, 0);
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    pass_plain(&m);
    char *a = test_path("first.json"), *b = test_path("second.json");
    CHECK_OK(laden_trace_start(0));
    CHECK_OK(laden_sched_enter(m.sc, m.block_of[1], 0));
    CHECK_OK(laden_trace_stop(a, NULL));
    CHECK_OK(laden_trace_start(0));
    CHECK_OK(laden_sched_exit(m.sc, m.block_of[1], 0));
    laden_trace_result_t r;
    CHECK_OK(laden_trace_stop(b, &r));
    CHECK_EQ(r.unresolved, 0);
    size_t n;
    tline *v = read_trace(a, &n);
    CHECK_EQ(count_cat(v, n, "block", "B"), 1);
    CHECK_EQ(count_cat(v, n, "block", "E"), 0);
    free(v);
    v = read_trace(b, &n);
    CHECK_EQ(count_cat(v, n, "block", NULL), 0);
    CHECK_EQ(count_cat(v, n, "compute", NULL), 0);
    free(v);
    CHECK_OK(laden_sched_synchronize(m.sc));
    destroy(&m);
}

TEST(stream_trace_enter_and_exit_in_two_traces)
{
    test_on_every_device(across_traces);
}

static atomic_int toggling;

/* 60 traces, of 50..230 us each, while the other thread runs passes. */
static void *toggle_traces(void *arg)
{
    const char *path = arg;
    void *ret = NULL;
    for (int i = 0; i < 60 && !ret; i++) {
        if (laden_trace_start(0) != LADEN_OK)
            ret = (void *)1;
        usleep(50 + (unsigned)(i % 7) * 30);
        if (laden_trace_stop(i % 3 ? NULL : path, NULL) != LADEN_OK)
            ret = (void *)1;
    }
    atomic_store(&toggling, 0);
    return ret;
}

/* Traces started and stopped by another thread while passes run: every
 * record made in a trace that ended is dropped, not written with the
 * marks and names its stop freed (ASan and the stand-in driver's leak
 * check see to that), and every file written is whole. */
static void traces_from_elsewhere(int32_t dev)
{
    model m;
    build(&m, dev, RAM, 0);
    CHECK_OK(laden_sched_set_block_name(m.sc, m.block_of[3], "named"));
    CHECK_OK(laden_sched_load(m.sc));
    CHECK_OK(laden_sched_start(m.sc, 0));
    char *path = test_path("toggled.json");
    pthread_t t;
    atomic_store(&toggling, 1);
    CHECK(pthread_create(&t, NULL, toggle_traces, path) == 0);
    while (atomic_load(&toggling))
        pass_plain(&m);
    void *ret;
    pthread_join(t, &ret);
    CHECK(ret == NULL);
    CHECK(!laden_trace_active());
    size_t n;
    free(read_trace(path, &n)); /* whole: it opens and closes */
    CHECK_OK(laden_sched_synchronize(m.sc));
    destroy(&m);
}

TEST(stream_trace_stopped_by_another_thread)
{
    test_on_every_device(traces_from_elsewhere);
}

/* ---- several devices in one process -------------------------------------- */

static int32_t cuda_devices_or_skip(int32_t want)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    if (n < want)
        SKIP("needs two CUDA devices (the stand-in driver has two)");
    return n;
}

static void *run_three_times(void *p)
{
    model *m = p;
    for (int i = 0; i < 3; i++)
        run_all(m);
    return NULL;
}

/* Models on two devices streamed at once from two threads, each from its
 * own host copy or both from one shared copy: every block's bytes are
 * right on its device, and each device's copies move its own model's
 * streamed blocks (the stand-in driver aborts a copy whose device memory
 * is another device's than its stream's). */
static void two_devices(int shared)
{
    cuda_devices_or_skip(2);
    if (shared)
        CHECK_EQ(segments(), 0);
    char *path = strdup(write_model());
    model m[2];
    for (int d = 0; d < 2; d++) {
        build_from(&m[d], path, d, MIXED, 0);
        if (shared)
            CHECK_OK(laden_sched_share(m[d].sc, "two-devices"));
        CHECK_OK(laden_sched_load(m[d].sc));
    }
    if (shared) { /* cuda:0 made it, cuda:1 attached and read only the rest */
        uint64_t b0 = 0, b1 = 0;
        share_state(&m[0], 1, &b0);
        share_state(&m[1], 2, &b1);
        CHECK(b0 > 0 && b0 == b1);
        CHECK_EQ(segments(), 1);
        laden_sched_stats_t s0, s1;
        CHECK_OK(laden_sched_stats(m[0].sc, &s0));
        CHECK_OK(laden_sched_stats(m[1].sc, &s1));
        uint64_t ram = 0;
        for (int i = 0; i < NB; i++)
            if (MIXED[i] == LADEN_TIER_RAM)
                ram += sz(2 * i) + sz(2 * i + 1);
        CHECK_EQ(s0.load_read_bytes - s1.load_read_bytes, ram);
        void *h0 = NULL, *h1 = NULL;
        CHECK_OK(laden_sched_host_ptr(m[0].sc, m[0].block_of[0], 0, &h0));
        CHECK_OK(laden_sched_host_ptr(m[1].sc, m[1].block_of[0], 0, &h1));
        CHECK(h0 && h1 && h0 != h1); /* one segment, a mapping each */
    }
    pthread_t t[2];
    for (int d = 0; d < 2; d++)
        CHECK_EQ(pthread_create(&t[d], NULL, run_three_times, &m[d]), 0);
    for (int d = 0; d < 2; d++)
        pthread_join(t[d], NULL);
    laden_sched_stats_t st[2];
    for (int d = 0; d < 2; d++)
        CHECK_OK(laden_sched_stats(m[d].sc, &st[d]));
    CHECK(st[0].h2d_bytes > 0);
    CHECK_EQ(st[0].h2d_bytes, st[1].h2d_bytes);
    destroy(&m[0]); /* the maker first: the other keeps the copy */
    run_all(&m[1]);
    destroy(&m[1]);
    if (shared)
        CHECK_EQ(segments(), 0);
    free(path);
}

TEST(stream_two_devices_at_once) { two_devices(0); }
TEST(stream_shared_copy_two_devices) { two_devices(1); }

/* A CUDA RAM-tier block's home, and a CUDA disk-tier block's staging
 * buffer, start so that its tensors lie at addresses congruent to their
 * file offsets modulo 4 KiB (their O_DIRECT reads land in place, not
 * through the bounce buffer): checked for a checkpoint whose data starts
 * 8 bytes past a 16-byte multiple, as safetensors' headers often leave
 * it, every value as stored, no read asked into a misplaced buffer. */
/* Writes BF16 tensors "t0".."t<nt-1>" of n values each, v's, at `file`;
 * with `past8` their data starts 8 bytes past a multiple of 16. */
static char *write_bf16s(const char *file, int nt, int n, const uint16_t *v,
                         int past8)
{
    char hdr[512];
    int at = snprintf(hdr, sizeof hdr, "{");
    for (int t = 0; t < nt; t++)
        at += snprintf(hdr + at, sizeof hdr - (size_t)at,
                       "%s\"t%d\":{\"dtype\":\"BF16\",\"shape\":[%d],"
                       "\"data_offsets\":[%d,%d]}", t ? "," : "", t, n,
                       2 * n * t, 2 * n * (t + 1));
    at += snprintf(hdr + at, sizeof hdr - (size_t)at, "}");
    while (past8 && (8 + at) % 16 != 8)
        hdr[at++] = ' ';
    hdr[at] = 0;
    char *path = test_path(file);
    test_write_st(path, hdr, v, 2u * (size_t)n * (size_t)nt);
    return path;
}

static void reads_in_place(int32_t dev, laden_tier tier)
{
    enum { NT = 3, N = 65536 }; /* 128 KiB each */
    static uint16_t v[NT * N];
    for (uint32_t i = 0; i < NT * N; i++)
        v[i] = (uint16_t)(i * 2654435761u >> 7);
    char *path = write_bf16s("homes.safetensors", NT, N, v, 1);
    laden_st_t *st;
    laden_sched_t *sc;
    laden_io_t *io;
    CHECK_OK(laden_io_create(NULL, &io));
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = dev, .io = io};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t b0, k;
    CHECK_OK(laden_sched_add_block(sc, tier, &b0));
    for (size_t t = 0; t < NT; t++)
        CHECK_OK(laden_sched_add_tensor(sc, b0, st, t, LADEN_DTYPE_BF16,
                                        &k));
    CHECK_OK(laden_sched_load(sc));
    static uint16_t got[N];
    laden_dev_stream_t *rd = NULL;
    if (dev >= 0) /* the compute stream, which enter orders */
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    if (tier == LADEN_TIER_DISK) {
        CHECK_OK(laden_sched_start(sc, 1));
        CHECK_OK(laden_sched_enter(sc, b0, 0));
    }
    for (uint32_t t = 0; t < NT; t++) {
        laden_st_tensor_t info;
        CHECK_OK(laden_st_tensor_at(st, t, &info));
        if (tier == LADEN_TIER_RAM) {
            void *p;
            CHECK_OK(laden_sched_host_ptr(sc, b0, t, &p));
            CHECK(p != NULL);
            memcpy(got, p, sizeof got);
            if (dev >= 0) /* a home of its own (the CPU runs in place) */
                CHECK_EQ(((uintptr_t)p - info.offset_bytes) % 4096u, 0);
        } else {
            laden_devptr_t p;
            CHECK_OK(laden_sched_tensor_ptr(sc, b0, t, &p));
            if (rd) {
                CHECK_OK(laden_dev_copy_d2h(rd, got, p, sizeof got));
                CHECK_OK(laden_dev_stream_synchronize(rd));
            } else {
                memcpy(got, (void *)(uintptr_t)p, sizeof got);
            }
        }
        CHECK(memcmp(got, v + (size_t)t * N, sizeof got) == 0);
    }
    if (tier == LADEN_TIER_DISK)
        CHECK_OK(laden_sched_exit(sc, b0, 0));
    if (dev >= 0) /* the CPU device reads into the slot it runs in */
        CHECK_EQ(laden__io_misplaced_bytes(io), 0);
    laden_dev_stream_destroy(rd);
    laden_sched_destroy(sc);
    laden_st_close(st);
    laden_io_destroy(io);
}

static void homes_in_place(int32_t dev) { reads_in_place(dev, LADEN_TIER_RAM); }
static void staging_in_place(int32_t dev)
{
    reads_in_place(dev, LADEN_TIER_DISK);
}

TEST(stream_disk_staging_read_in_place)
{
    test_on_every_device(staging_in_place);
}

/* A RAM budget that holds the slots' staging buffers exactly, as the plan
 * counts them: the start still succeeds (the buffers then have no room
 * for the shift, every one of them), every value as stored. */
static void staging_exact_budget(int32_t dev)
{
    enum { NT = 3, N = 65536 }; /* 128 KiB each: a block each */
    static uint16_t v[NT * N];
    for (uint32_t i = 0; i < NT * N; i++)
        v[i] = (uint16_t)(i * 2246822519u >> 9);
    char *path = write_bf16s("exact.safetensors", NT, N, v, 0);
    laden_st_t *st;
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = dev,
                              .ram_budget_bytes = 2 * 2 * (uint64_t)N};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    for (size_t t = 0; t < NT; t++) {
        uint32_t b, k;
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &b));
        CHECK_OK(laden_sched_add_tensor(sc, b, st, t, LADEN_DTYPE_BF16, &k));
    }
    CHECK_OK(laden_sched_load(sc));
    CHECK_OK(laden_sched_start(sc, 1)); /* two slots */
    laden_dev_stream_t *rd = NULL;
    if (dev >= 0)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    static uint16_t got[N];
    for (uint32_t b = 0; b < NT; b++) {
        laden_devptr_t p;
        CHECK_OK(laden_sched_enter(sc, b, 0));
        CHECK_OK(laden_sched_tensor_ptr(sc, b, 0, &p));
        if (rd) {
            CHECK_OK(laden_dev_copy_d2h(rd, got, p, sizeof got));
            CHECK_OK(laden_dev_stream_synchronize(rd));
        } else {
            memcpy(got, (const void *)(uintptr_t)p, sizeof got);
        }
        CHECK(memcmp(got, v + (size_t)b * N, sizeof got) == 0);
        CHECK_OK(laden_sched_exit(sc, b, 0));
    }
    laden_dev_stream_destroy(rd);
    laden_sched_destroy(sc);
    laden_st_close(st);
}

TEST(stream_disk_staging_fits_an_exact_budget)
{
    test_on_every_device(staging_exact_budget);
}
TEST(stream_ram_homes_read_in_place) { test_on_every_device(homes_in_place); }
