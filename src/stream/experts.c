/* The expert cache: experts of streamed expert blocks
 * (laden_sched_set_experts) kept in device memory between their enters.
 *
 * A streamed expert block's slot holds the rows of the experts its last
 * enter was routed to; once the slot goes to another block, those rows
 * are gone, and a token routed to the same experts one layer-pass later
 * would copy them across the link again.  The cache keeps each expert
 * that crossed (its rows in every tensor of the block, end to end) in an
 * entry of device memory; an enter routed to a cached expert copies it
 * from there into the slot, device to device, at the device's memory
 * speed instead of the link's.  The slot stays the one place a kernel
 * reads, so the fused tensors keep their addresses and every expert its
 * place in them.
 *
 * Entries are all the size of the largest expert.  Which experts stay is
 * decided by how often they are routed to, not by how recently: a miss
 * takes a free entry, else it is kept only if it was routed to more often
 * than the entry it would replace (the least often routed, the least
 * recently used of equals; never one the same enter uses).  Recency alone
 * thrashes: a decode token routes every layer's experts in turn, and once
 * they outnumber the entries each is evicted before its layer comes
 * round again (measured on the H200: 0 % hits with ~100 entries and 128
 * routed experts a token).  Counts are halved every `window` counted
 * routings (16 per entry, at least 1024), so a changed routing is learned
 * again.  With more than SCAN entries the victim is the least of SAMPLE
 * entries drawn at random, so a miss costs the same at any cache size.
 * All copies into and out of entries are on the copy stream, in
 * issue order, so an entry overwritten after a copy out of it was queued
 * is overwritten after that copy.  The size: the bytes given by
 * laden_sched_set_expert_cache, else on CUDA what the plan left free of
 * the device memory it had (none on the CPU device, whose "device" copy
 * would be one more host copy).  Part of the run part (stream_run.h),
 * made with the slots and freed with them (parts.c frees them); calls
 * only build.c's laden__sched_run_of (a block streams when it has a
 * position, b->pos, which parts.c's relayout gives). */
#include <stdlib.h>
#include <string.h>

#include "stream_layout.h"
#include "stream_run.h"

enum { SCAN = 64, SAMPLE = 32, WINDOW_PER_ENTRY = 16, WINDOW_MIN = 1024 };

/* The bytes of one expert of expert block b: a row of each run. */
static uint64_t expert_bytes(const blk *b)
{
    uint64_t sum = 0;
    for (uint32_t k = 0; k < b->nt;) {
        uint64_t bytes;
        uint32_t run = laden__sched_run_of(b, k, &bytes);
        sum += bytes / b->experts;
        k += run;
    }
    return sum;
}

laden_status laden__sched_set_expert_cache(laden_sched_t *sc, uint64_t bytes)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_set_expert_cache: NULL schedule");
    if (sc->cache.on)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "laden_sched_set_expert_cache: a cache schedule "
                           "streams no expert rows");
    if (sc->run.started)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_set_expert_cache: the schedule is "
                           "started; set it before laden_sched_start");
    sc->run.xc.set = bytes != LADEN_EXPERT_CACHE_AUTO;
    sc->run.xc.ask = sc->run.xc.set ? bytes : 0;
    return LADEN_OK;
}

void laden__sched_experts_free(laden_sched_t *sc)
{
    expert_cache *xc = &sc->run.xc;
    if (xc->base)
        laden_dev_mem_free(sc->cfg.device, xc->base);
    if (xc->charged && sc->cache.vram)
        laden_vram_uncharge(sc->cache.vram, xc->charged);
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        if (xc->where)
            free(xc->where[i]);
        if (xc->count)
            free(xc->count[i]);
    }
    free(xc->where);
    free(xc->count);
    free(xc->e);
    bool set = xc->set;
    uint64_t ask = xc->ask;
    memset(xc, 0, sizeof *xc);
    xc->set = set;
    xc->ask = ask;
}

laden_status laden__sched_experts_make(laden_sched_t *sc)
{
    expert_cache *xc = &sc->run.xc;
    uint64_t entry = 0, experts = 0;
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        const blk *b = &sc->layout.b[i];
        if (!b->experts || b->pos < 0) /* not streamed */
            continue;
        uint64_t e = expert_bytes(b);
        entry = e > entry ? e : entry;
        experts += b->experts;
    }
    uint64_t want = xc->set ? xc->ask : sc->cuda ? sc->layout.vram_spare : 0;
    uint64_t n = entry ? want / entry : 0;
    if (n > experts) /* more would hold every streamed expert twice */
        n = experts;
    if (n > UINT32_MAX)
        n = UINT32_MAX;
    if (!n)
        return LADEN_OK;
    uint64_t bytes = n * entry;
    laden_status s = LADEN_OK;
    if (sc->cache.vram && (s = laden_vram_charge(sc->cache.vram, bytes)))
        goto fail;
    xc->charged = sc->cache.vram ? bytes : 0;
    if ((s = laden_dev_mem_alloc(sc->cfg.device, bytes, &xc->base))) {
        xc->base = 0;
        goto fail;
    }
    xc->e = calloc(n, sizeof *xc->e);
    xc->where = calloc(sc->layout.nb, sizeof *xc->where);
    xc->count = calloc(sc->layout.nb, sizeof *xc->count);
    if (!xc->e || !xc->where || !xc->count) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory");
        goto fail;
    }
    for (uint32_t k = 0; k < n; k++)
        xc->e[k].block = -1;
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        const blk *b = &sc->layout.b[i];
        if (!b->experts || b->pos < 0) /* not streamed */
            continue;
        if (!(xc->where[i] = malloc(b->experts * sizeof **xc->where)) ||
            !(xc->count[i] = calloc(b->experts, sizeof **xc->count))) {
            s = laden__fail(LADEN_E_NOMEM, "out of memory");
            goto fail;
        }
        for (uint32_t e = 0; e < b->experts; e++)
            xc->where[i][e] = -1;
    }
    xc->n = (uint32_t)n;
    xc->entry_bytes = entry;
    xc->window = n * WINDOW_PER_ENTRY > WINDOW_MIN ? n * WINDOW_PER_ENTRY
                                                   : WINDOW_MIN;
    xc->rng = 0x9e3779b97f4a7c15ull;
    return LADEN_OK;
fail:
    laden__sched_experts_free(sc);
    if (!xc->set) /* a cache of the size the plan left is a bonus */
        return LADEN_OK;
    laden__error_prefix("the expert cache (%llu entries of %s)",
                        (unsigned long long)n, laden__bytes(entry).s);
    return s;
}

void laden__sched_experts_begin(laden_sched_t *sc)
{
    sc->run.xc.tick++;
}

int64_t laden__sched_expert_find(laden_sched_t *sc, uint32_t bi, uint32_t e)
{
    expert_cache *xc = &sc->run.xc;
    if (!xc->n || !xc->where[bi])
        return -1;
    int32_t k = xc->where[bi][e];
    if (k >= 0)
        xc->e[k].used = xc->tick;
    return k;
}

void laden__sched_expert_count(laden_sched_t *sc, uint32_t bi, uint32_t e)
{
    expert_cache *xc = &sc->run.xc;
    if (!xc->n || !xc->count[bi])
        return;
    if (xc->count[bi][e] < UINT32_MAX)
        xc->count[bi][e]++;
    if (++xc->counted < xc->window)
        return;
    xc->counted = 0;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (xc->count[i])
            for (uint32_t k = 0; k < sc->layout.b[i].experts; k++)
                xc->count[i][k] >>= 1;
}

/* How often entry k's expert was routed to (-1: a free entry). */
static int64_t entry_count(const expert_cache *xc, uint32_t k)
{
    const expert_entry *en = &xc->e[k];
    return en->block < 0 ? -1 : (int64_t)xc->count[en->block][en->expert];
}

/* Whether entry k makes a better victim than entry best (UINT32_MAX:
 * none yet): not used by this fill, then the least often routed, then
 * the least recently used. */
static bool better_victim(const expert_cache *xc, uint32_t k, uint32_t best)
{
    if (xc->e[k].used == xc->tick)
        return false;
    if (best == UINT32_MAX)
        return true;
    int64_t ck = entry_count(xc, k), cb = entry_count(xc, best);
    return ck != cb ? ck < cb : xc->e[k].used < xc->e[best].used;
}

int64_t laden__sched_expert_claim(laden_sched_t *sc, uint32_t bi, uint32_t e)
{
    expert_cache *xc = &sc->run.xc;
    if (!xc->n || !xc->where[bi])
        return -1;
    uint32_t best = UINT32_MAX;
    if (xc->n > SCAN)
        for (int i = 0; i < SAMPLE; i++) { /* xorshift64* */
            xc->rng ^= xc->rng >> 12;
            xc->rng ^= xc->rng << 25;
            xc->rng ^= xc->rng >> 27;
            uint32_t k = (uint32_t)(((xc->rng * 0x2545f4914f6cdd1dull) >>
                                     32) % xc->n);
            if (better_victim(xc, k, best))
                best = k;
        }
    if (best == UINT32_MAX) /* a small cache, or no sample could go */
        for (uint32_t k = 0; k < xc->n; k++)
            if (better_victim(xc, k, best))
                best = k;
    if (best == UINT32_MAX)
        return -1; /* every entry holds an expert this enter uses */
    expert_entry *en = &xc->e[best];
    if (en->block >= 0) {
        if (xc->count[bi][e] <= xc->count[en->block][en->expert])
            return -1; /* not routed to more often than what it replaces */
        xc->where[en->block][en->expert] = -1;
    }
    en->block = bi;
    en->expert = e;
    en->used = xc->tick;
    xc->where[bi][e] = (int32_t)best;
    return best;
}

laden_status laden__sched_expert_copy(laden_sched_t *sc, uint32_t bi,
                                      uint32_t e, int64_t entry,
                                      laden_devptr_t at, bool to_slot)
{
    expert_cache *xc = &sc->run.xc;
    const blk *b = &sc->layout.b[bi];
    laden_devptr_t in = xc->base + (uint64_t)entry * xc->entry_bytes;
    laden_status s = LADEN_OK;
    for (uint32_t k = 0; k < b->nt && !s;) {
        uint64_t bytes;
        uint32_t run = laden__sched_run_of(b, k, &bytes);
        uint64_t row = bytes / b->experts;
        laden_devptr_t there = at + b->t[k].dst_off + e * row;
        laden_devptr_t dst = to_slot ? there : in, src = to_slot ? in : there;
        if (sc->run.copy)
            s = laden_dev_copy_d2d(sc->run.copy, dst, src, row);
        else /* the CPU device: host memory, and no copy in flight */
            memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, row);
        in += row;
        k += run;
    }
    expert_entry *en = &xc->e[entry];
    if (s && !to_slot) { /* the entry holds no whole expert: forgotten */
        xc->where[en->block][en->expert] = -1;
        en->block = -1;
        en->used = 0;
    }
    return s;
}
