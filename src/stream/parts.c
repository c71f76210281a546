/* The bottom of the layer: the few operations of a part that files below
 * its owner need, so that every file calls only files below it (the
 * order is in stream_internal.h).  Calls no file of the layer.  Here:
 * the streamed blocks' positions, the slots' charge and the trace's names
 * (layout part, stream_layout.h; build.c owns it), freeing the slots (run
 * part, stream_run.h; run.c, and load.c's free_all), pinning a block's
 * host copy in place (load part, stream_load.h; load.c and share.c), and
 * the background loader's thread and holds (hold part, stream_hold.h;
 * load.c drives the load on that thread, stream.c owns the guard). */
#include <stdatomic.h>
#include <stdlib.h>

#include "stream_hold.h"
#include "stream_layout.h"
#include "stream_load.h"
#include "stream_run.h"

/* ---- streamed blocks' positions ----------------------------------------- */

bool laden__sched_streamed(const laden_sched_t *sc, const blk *b)
{
    if (b->resident)
        return false;
    return b->tier == LADEN_TIER_DISK ||
           (b->tier == LADEN_TIER_RAM && (sc->cuda || sc->cache.on));
}

/* Positions and slot size after the set of streamed blocks changed. */
void laden__sched_relayout(laden_sched_t *sc)
{
    sc->layout.nstreamed = 0;
    sc->layout.slot_bytes = 0;
    sc->layout.any_disk = false;
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        b->pos = -1;
        if (!laden__sched_streamed(sc, b))
            continue;
        sc->layout.order[sc->layout.nstreamed++] = i;
        if (b->bytes > sc->layout.slot_bytes)
            sc->layout.slot_bytes = b->bytes;
        sc->layout.any_disk |= b->tier == LADEN_TIER_DISK;
    }
    /* In call order where it is known (insertion: stable, and the order
     * is mostly sorted already). */
    const uint32_t *rank = sc->layout.call_rank;
    uint32_t *o = sc->layout.order;
    for (uint32_t k = 1; rank && k < sc->layout.nstreamed; k++) {
        uint32_t bi = o[k], j = k;
        for (; j > 0 && rank[o[j - 1]] > rank[bi]; j--)
            o[j] = o[j - 1];
        o[j] = bi;
    }
    for (uint32_t p = 0; p < sc->layout.nstreamed; p++)
        sc->layout.b[o[p]].pos = (int32_t)p;
    sc->layout.nrec_streamed = 0; /* the watch's count (run.c) */
    for (uint32_t i = 0; i < sc->layout.nrec; i++)
        sc->layout.nrec_streamed += sc->layout.b[sc->layout.rec[i]].pos >= 0;
    sc->st.generation++;
}

/* Bytes charged to the VRAM context for the slots become `want`.
 * LADEN_E_BUDGET, with the charge as it was, if the context has no room. */
laden_status laden__sched_charge_slots(laden_sched_t *sc, uint64_t want)
{
    laden_status s;
    if (!sc->cache.vram || want == sc->layout.slot_charge)
        return LADEN_OK;
    if (want < sc->layout.slot_charge) {
        laden_vram_uncharge(sc->cache.vram, sc->layout.slot_charge - want);
        sc->layout.slot_charge = want;
        return LADEN_OK;
    }
    if ((s = laden_vram_charge(sc->cache.vram,
                               want - sc->layout.slot_charge))) {
        laden__error_prefix("slots of %s", laden__bytes(want).s);
        return s;
    }
    sc->layout.slot_charge = want;
    return LADEN_OK;
}

/* ---- names for the trace ------------------------------------------------ */

const char *laden__sched_trace_name(laden_sched_t *sc)
{
    uint64_t sess = laden__trace_session();
    if (!sc->trace_name || sc->trace_session != sess) {
        sc->trace_name = laden__trace_intern(sc->name);
        sc->trace_session = sess;
    }
    return sc->trace_name;
}

const char *laden__sched_block_trace_name(blk *b)
{
    if (!b->name)
        return NULL;
    uint64_t sess = laden__trace_session();
    if (!b->trace_name || b->trace_session != sess) {
        b->trace_name = laden__trace_intern(b->name);
        b->trace_session = sess;
    }
    return b->trace_name;
}

/* ---- the slots (run.c's part) ------------------------------------------ */

/* Frees the slots and staging, after their copies and reads. */
void laden__sched_free_slots(laden_sched_t *sc)
{
    if (sc->run.copy)
        laden_dev_stream_synchronize(sc->run.copy);
    if (!sc->run.slots)
        sc->run.nslots = 0;
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        for (uint32_t k = 0; k < sl->nreqs; k++)
            laden_io_wait(sc->layout.io, sl->reqs[k]);
        sl->nreqs = 0;
        free(sl->reqs);
        free(sl->rows_ok);
        sl->rows_ok = NULL;
        laden_dev_event_destroy(sl->ready);
        laden_dev_event_destroy(sl->free);
        laden_dev_event_destroy(sl->staging_free);
        laden_dev_mem_free(sc->cfg.device, sl->ptr);
        sl->ready = sl->free = sl->staging_free = NULL;
        if (sl->staging)
            laden_host_free(sc->layout.host, sl->staging);
    }
    free(sc->run.slots);
    sc->run.slots = NULL;
    laden__sched_experts_free(sc); /* after the copy stream's copies */
    sc->run.nslots = 0;
    if (sc->run.workspace) {
        laden_dev_mem_free(sc->cfg.device, sc->run.workspace);
        sc->run.workspace = 0;
        if (sc->cache.vram)
            laden_vram_uncharge(sc->cache.vram, sc->run.workspace_bytes);
        sc->run.workspace_bytes = 0;
    }
    laden__gauge_add(LADEN__GAUGE_SLOTS, sc->cfg.device,
                     -(int64_t)sc->run.slot_gauge);
    sc->run.slot_gauge = 0;
    laden_dev_event_destroy(sc->capture.fork);
    sc->capture.fork = NULL;
    sc->capture.on = sc->capture.events = false;
    laden__sched_charge_slots(sc, 0);
    laden_dev_stream_destroy(sc->run.compute);
    laden_dev_stream_destroy(sc->run.compute_alt);
    sc->run.compute = sc->run.compute_alt = NULL;
    if (sc->run.started)
        sc->st.generation++;
    sc->run.started = false;
    laden_host_trim(sc->layout.host);
}

/* ---- a block's host copy pinned in place (load.c's part) ---------------- */

/* A RAM-tier block of a CUDA streaming schedule, read: its pages were
 * made by the reads (in the reader threads, in parallel); pinning them in
 * place now costs a fraction of allocating pinned memory up front. */
laden_status laden__sched_pin_home(laden_sched_t *sc, blk *b)
{
    /* Pinned already when it came from the process's pinned pool. */
    laden_status s = b->pinned ? LADEN_OK
                               : laden_dev_host_register(
                                     sc->cfg.device,
                                     laden__sched_home_base(b), b->ram_len);
    if (s)
        return s;
    b->pinned = true;
    sc->load.pinned_homes += b->ram_len;
    /* The arena (slots' staging, later) gets what the homes leave of the
     * RAM budget. */
    uint64_t budget = sc->cfg.ram_budget_bytes;
    if (budget)
        laden_host_set_budget(sc->layout.host, budget > sc->load.pinned_homes
                                            ? budget - sc->load.pinned_homes
                                            : 1);
    return LADEN_OK;
}

/* ---- the background loader's thread (load.c drives the load) ------------ */

bool laden__sched_hold_loader(laden_sched_t *sc)
{
    uint64_t me = atomic_load(&sc->hold.loader_tid);
    bool got = false;
    pthread_mutex_lock(&sc->hold.mu);
    while (!atomic_load(&sc->hold.loader_stop)) {
        uint64_t cur = 0;
        if (!sc->hold.owner_waiting &&
            atomic_compare_exchange_strong(&sc->hold.holder, &cur, me)) {
            sc->hold.depth = 1; /* a nested hold (its progress callback) */
            got = true;
            break;
        }
        pthread_cond_wait(&sc->hold.cv, &sc->hold.mu);
    }
    pthread_mutex_unlock(&sc->hold.mu);
    return got;
}

void laden__sched_unhold_loader(laden_sched_t *sc)
{
    atomic_store(&sc->hold.holder, 0);
    pthread_mutex_lock(&sc->hold.mu);
    pthread_cond_broadcast(&sc->hold.cv);
    pthread_mutex_unlock(&sc->hold.mu);
}

typedef struct loader_start {
    laden_sched_t *sc;
    void *(*fn)(void *);
} loader_start;

static void *loader_main(void *arg)
{
    loader_start st = *(loader_start *)arg;
    free(arg);
    atomic_store(&st.sc->hold.loader_tid, laden__thread_id());
    pthread_mutex_lock(&st.sc->hold.mu); /* the starter waits for the id */
    pthread_cond_broadcast(&st.sc->hold.cv);
    pthread_mutex_unlock(&st.sc->hold.mu);
    return st.fn(st.sc);
}

laden_status laden__sched_start_loader(laden_sched_t *sc, void *(*fn)(void *))
{
    loader_start *st = malloc(sizeof *st);
    if (!st)
        return laden__fail(LADEN_E_NOMEM, "out of memory starting a load");
    *st = (loader_start){sc, fn};
    atomic_store(&sc->hold.loader_stop, 0);
    /* Its id is known before this returns: a hold that finds the loader
     * holding must recognise it (else it would refuse the owner). */
    pthread_mutex_lock(&sc->hold.mu);
    int e = pthread_create(&sc->hold.loader_thread, NULL, loader_main, st);
    if (e) {
        pthread_mutex_unlock(&sc->hold.mu);
        free(st);
        return laden__fail(LADEN_E_IO, "cannot start the loading thread "
                           "(error %d)", e);
    }
    atomic_store(&sc->hold.loader_live, true);
    sc->load.loader_started = true;
    while (!atomic_load(&sc->hold.loader_tid))
        pthread_cond_wait(&sc->hold.cv, &sc->hold.mu);
    pthread_mutex_unlock(&sc->hold.mu);
    return LADEN_OK;
}

/* Stops the background loader (its step in progress ends first) and
 * joins it; what it left of the load is the caller's.  Whichever thread
 * claims the thread (under mu) joins it, once. */
void laden__sched_join_loader(laden_sched_t *sc)
{
    pthread_mutex_lock(&sc->hold.mu);
    bool live = atomic_exchange(&sc->hold.loader_live, false);
    pthread_t t = sc->hold.loader_thread;
    atomic_store(&sc->hold.loader_stop, 1);
    pthread_cond_broadcast(&sc->hold.cv);
    pthread_mutex_unlock(&sc->hold.mu);
    if (live)
        pthread_join(t, NULL);
}

bool laden__sched_on_loader(laden_sched_t *sc)
{
    uint64_t t = atomic_load(&sc->hold.loader_tid);
    return t && t == laden__thread_id();
}
