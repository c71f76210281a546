/* Block streaming: the public calls, the top of the layer.  See
 * include/laden/stream.h; the work is in parts.c, build.c, share.c,
 * load.c, run.c, resident.c, grads.c and convert.c, each behind its part
 * header (stream_internal.h lists them), and none calls back up here.
 * Here: the queries, the one-thread guard every other call goes through,
 * and destroy's entry (its work is load.c's laden__sched_destroy; the
 * background loader's thread and its holds are parts.c's). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stream_hold.h"
#include "stream_cache.h"
#include "stream_layout.h"
#include "stream_load.h"
#include "stream_run.h"
#include "stream_share.h"

static laden_status stats(laden_sched_t *sc, laden_sched_stats_t *out)
{
    laden_host_stats_t hs;
    if (!sc || !out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_stats: NULL");
    *out = sc->st;
    out->slot_bytes = sc->layout.slot_bytes;
    out->nslots = sc->run.nslots;
    out->device_bytes += (uint64_t)sc->run.nslots * sc->layout.slot_bytes +
                         sc->run.workspace_bytes;
    out->expert_cache_bytes =
        (uint64_t)sc->run.xc.n * sc->run.xc.entry_bytes;
    out->device_bytes += out->expert_cache_bytes;
    if (laden_host_stats(sc->layout.host, &hs) == LADEN_OK)
        out->pinned_bytes = hs.in_use_bytes + hs.cached_bytes;
    out->pinned_bytes += sc->load.pinned_homes;
    return LADEN_OK;
}

int laden_sched_is_streamed(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->layout.nb &&
           laden__sched_streamed(sc, &sc->layout.b[block]);
}

laden_vbar_t *laden_sched_vbar(laden_sched_t *sc)
{
    return sc ? sc->cache.vbar : NULL;
}

int laden_sched_block_tier(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->layout.nb ? (int)sc->layout.b[block].tier : -2;
}

int laden_sched_is_resident(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->layout.nb && sc->layout.b[block].resident;
}

int laden_sched_is_cache(laden_sched_t *sc)
{
    return sc && sc->cache.on && sc->loaded;
}

int32_t laden_sched_device(laden_sched_t *sc)
{
    return sc ? sc->cfg.device : LADEN_DEVICE_CPU;
}

uint32_t laden_sched_block_count(laden_sched_t *sc)
{
    return sc ? sc->layout.nb : 0;
}

uint64_t laden_sched_block_bytes(laden_sched_t *sc, uint32_t block)
{
    if (!sc || block >= sc->layout.nb)
        return 0;
    return sc->layout.b[block].bytes;
}

uint64_t laden_sched_block_device_bytes(laden_sched_t *sc, uint32_t block)
{
    if (!sc || block >= sc->layout.nb)
        return 0;
    return sc->layout.laid_out ? sc->layout.b[block].dev_bytes
                               : sc->layout.b[block].bytes;
}

uint64_t laden_sched_block_workspace_bytes(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->layout.nb ? sc->layout.b[block].ws_bytes : 0;
}

uint64_t laden_sched_block_upload_bytes(laden_sched_t *sc, uint32_t block)
{
    return laden__sched_block_upload_bytes(sc, block);
}

uint64_t laden_sched_block_ram_bytes(laden_sched_t *sc, uint32_t block)
{
    return laden__sched_block_ram_bytes(sc, block);
}

laden_status laden_sched_block_state(laden_sched_t *sc, uint32_t block,
                                     int32_t *tier, uint64_t *size_bytes,
                                     uint32_t *flags)
{
    if (tier)
        *tier = 0;
    if (size_bytes)
        *size_bytes = 0;
    if (flags)
        *flags = 0;
    if (!sc || block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_block_state: bad schedule or block");
    const blk *b = &sc->layout.b[block];
    if (tier)
        *tier = (int32_t)b->tier;
    if (size_bytes)
        *size_bytes = b->bytes;
    if (flags)
        *flags = (b->offloaded ? LADEN_SCHED_BLOCK_OFFLOADED : 0u) |
                 (laden__sched_streamed(sc, b) ? LADEN_SCHED_BLOCK_STREAMED
                                               : 0u);
    return LADEN_OK;
}

laden_status laden_sched_tensor_layout(laden_sched_t *sc, uint32_t block,
                                       uint32_t i, uint64_t *size_bytes,
                                       uint64_t *scale_offset_bytes,
                                       uint64_t *rows)
{
    if (size_bytes)
        *size_bytes = 0;
    if (scale_offset_bytes)
        *scale_offset_bytes = 0;
    if (rows)
        *rows = 0;
    if (!sc || block >= sc->layout.nb || i >= sc->layout.b[block].nt)
        return laden__fail(LADEN_E_INVAL, "laden_sched_tensor_layout: bad "
                                          "schedule, block or tensor");
    const tref *r = &sc->layout.b[block].t[i];
    if (size_bytes)
        laden__sched_run_of(&sc->layout.b[block], i, size_bytes);
    if (r->rows) { /* tensor_ref (build.c) lays them out so */
        if (scale_offset_bytes)
            *scale_offset_bytes = laden__sched_scale_offset(r->nelem);
        if (rows)
            *rows = r->rows;
    }
    return LADEN_OK;
}

/* ---- the public calls: one thread at a time ------------------------------
 *
 * Every call holds the schedule for its duration, laden_sched_enter holds
 * it until laden_sched_exit and laden_sched_begin until laden_sched_end.
 * A call from another thread meanwhile is refused at once with
 * LADEN_E_STATE: two threads interleaving one schedule's slots, reads and
 * events corrupt both (the slots' request lists overflowed, reads were
 * waited for twice).  Holds of the holding thread nest.  After
 * laden_sched_close every call is refused. */

#define CLOSED UINT64_MAX

static laden_status refused(uint64_t cur, const char *call)
{
    if (cur == CLOSED)
        return laden__fail(LADEN_E_STATE,
                           "%s: the schedule is closed (its model was "
                           "released)",
                           call);
    return laden__fail(LADEN_E_STATE,
                       "%s: the schedule is in use by another thread (a "
                       "schedule is used by one thread at a time)",
                       call);
}

/* The holder is the schedule's background loader: waits for its step to
 * end (one piece of the load), ahead of its next one. */
static laden_status wait_for_loader(laden_sched_t *sc, uint64_t me,
                                    const char *call)
{
    uint64_t cur;
    pthread_mutex_lock(&sc->hold.mu);
    sc->hold.owner_waiting++;
    for (;;) {
        cur = 0;
        if (atomic_compare_exchange_strong(&sc->hold.holder, &cur, me))
            break;
        if (cur != atomic_load(&sc->hold.loader_tid))
            break;
        pthread_cond_wait(&sc->hold.cv, &sc->hold.mu);
    }
    sc->hold.owner_waiting--;
    pthread_mutex_unlock(&sc->hold.mu);
    if (cur && cur != me)
        return refused(cur, call);
    sc->hold.depth = 1;
    return LADEN_OK;
}

static laden_status hold(laden_sched_t *sc, const char *call)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    uint64_t me = laden__thread_id(), cur = 0;
    if (atomic_compare_exchange_strong(&sc->hold.holder, &cur, me)) {
        sc->hold.depth = 1;
        return LADEN_OK;
    }
    if (cur == me) {
        sc->hold.depth++;
        return LADEN_OK;
    }
    if (cur == atomic_load(&sc->hold.loader_tid))
        return wait_for_loader(sc, me, call);
    return refused(cur, call);
}

/* A hold's end wakes the background loader (and a waiting owner). */
static void release_hold(laden_sched_t *sc)
{
    atomic_store(&sc->hold.holder, 0);
    if (atomic_load(&sc->hold.loader_live)) {
        pthread_mutex_lock(&sc->hold.mu);
        pthread_cond_broadcast(&sc->hold.cv);
        pthread_mutex_unlock(&sc->hold.mu);
    }
}

static void unhold(laden_sched_t *sc)
{
    if (--sc->hold.depth == 0)
        release_hold(sc);
}

int laden_sched_is_pinned(laden_sched_t *sc, uint32_t block)
{
    if (!sc || block >= sc->layout.nb || hold(sc, "laden_sched_is_pinned")) {
        laden__error_clear();
        return 0;
    }
    int pinned = sc->layout.b[block].pinned;
    unhold(sc);
    return pinned;
}

static bool holds(laden_sched_t *sc)
{
    return atomic_load(&sc->hold.holder) == laden__thread_id();
}

/* Runs `expr` holding the schedule. */
#define HELD(call, expr)                                                   \
    do {                                                                   \
        laden_status held_ = hold(sc, call);                               \
        if (held_)                                                         \
            return held_;                                                  \
        held_ = (expr);                                                    \
        unhold(sc);                                                        \
        return held_;                                                      \
    } while (0)

laden_status laden_sched_begin(laden_sched_t *sc)
{
    laden_status s = hold(sc, "laden_sched_begin");
    if (!s)
        sc->hold.begun++;
    return s;
}

laden_status laden_sched_end(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_end: NULL schedule");
    if (!holds(sc) || !sc->hold.begun)
        return laden__fail(LADEN_E_STATE, "laden_sched_end: no pass was "
                           "begun on this thread");
    sc->hold.begun--;
    unhold(sc);
    return LADEN_OK;
}

laden_status laden_sched_end_all(laden_sched_t *sc, uint32_t *out_exited)
{
    if (out_exited)
        *out_exited = 0;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_end_all: NULL "
                                          "schedule");
    if (!holds(sc))
        return LADEN_OK;
    if (sc->capture.on)
        return laden__fail(LADEN_E_STATE, "laden_sched_end_all: a CUDA "
                           "graph capture is in progress on this thread; "
                           "end it first (laden_sched_capture_end)");
    laden_status first = LADEN_OK;
    /* Each exit records the slot's free event on the stream the block
     * was entered on, as the exit that did not happen would have. */
    for (uint32_t i = 0; i < sc->layout.nb && sc->hold.entered; i++)
        while (sc->layout.b[i].running && holds(sc)) {
            laden_status s =
                laden_sched_exit(sc, i, sc->layout.b[i].enter_handle);
            if (s && !first)
                first = s;
            if (out_exited)
                ++*out_exited;
        }
    while (sc->hold.begun && holds(sc)) {
        sc->hold.begun--;
        unhold(sc);
    }
    return first;
}

laden_status laden_sched_close(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_close: NULL schedule");
    uint64_t held = atomic_load(&sc->hold.holder);
    if (held == laden__thread_id() || laden__sched_on_loader(sc))
        return laden__fail(LADEN_E_STATE, "laden_sched_close: this thread "
                           "is inside a pass or a block of the schedule");
    if (held && held != CLOSED && held != atomic_load(&sc->hold.loader_tid))
        return laden__fail(LADEN_E_STATE, "laden_sched_close: the schedule "
                           "is in use by another thread");
    laden__sched_join_loader(sc); /* a load in the background stops */
    uint64_t cur = 0;
    if (atomic_compare_exchange_strong(&sc->hold.holder, &cur, CLOSED) ||
        cur == CLOSED)
        return LADEN_OK;
    return laden__fail(LADEN_E_STATE,
                       cur == laden__thread_id()
                           ? "laden_sched_close: this thread is inside a "
                             "pass or a block of the schedule"
                           : "laden_sched_close: the schedule is in use by "
                             "another thread");
}

int laden_sched_is_closed(laden_sched_t *sc)
{
    return sc && atomic_load(&sc->hold.holder) == CLOSED;
}

/* How many bytes of s to keep, at most max, not cutting a UTF-8
 * character. */
static size_t name_len(const char *s, size_t max)
{
    size_t n = 0;
    while (n < max && s[n])
        n++;
    if (s[n]) /* cut: back off to a character's first byte */
        while (n > 0 && ((unsigned char)s[n] & 0xc0) == 0x80)
            n--;
    return n;
}

laden_status laden_sched_set_block_name(laden_sched_t *sc, uint32_t block,
                                        const char *name)
{
    laden_status s = hold(sc, "laden_sched_set_block_name");
    if (s)
        return s;
    if (block >= sc->layout.nb || !name) {
        unhold(sc);
        return laden__fail(LADEN_E_INVAL, "laden_sched_set_block_name: %s",
                           name ? "no such block" : "NULL name");
    }
    size_t n = name_len(name, 127);
    char *copy = malloc(n + 1);
    if (copy) {
        memcpy(copy, name, n);
        copy[n] = '\0';
    }
    if (!copy) {
        unhold(sc);
        return laden__fail(LADEN_E_NOMEM, "out of memory naming a block");
    }
    free(sc->layout.b[block].name);
    sc->layout.b[block].name = copy;
    sc->layout.b[block].trace_name = NULL;
    unhold(sc);
    return LADEN_OK;
}

laden_status laden_sched_set_name(laden_sched_t *sc, const char *name)
{
    laden_status s = hold(sc, "laden_sched_set_name");
    if (s)
        return s;
    size_t n = name ? name_len(name, sizeof sc->name - 1) : 0;
    memcpy(sc->name, name ? name : "", n);
    sc->name[n] = '\0';
    sc->trace_name = NULL;
    unhold(sc);
    return LADEN_OK;
}

/* laden_sched_enter and, `routed`, laden_sched_enter_experts: the hold,
 * the block's counts, the trace. */
static laden_status enter_held(laden_sched_t *sc, uint32_t block,
                               uintptr_t compute_stream, bool routed,
                               const uint32_t *rows, uint32_t n,
                               const char *call)
{
    laden_status s = hold(sc, call);
    if (s)
        return s;
    uint64_t t0 = LADEN__TRACING() ? laden__now_ns() : 0;
    uint64_t sess = t0 ? laden__trace_session() : 0; /* before any name */
    uint64_t misses = sc->st.misses;
    if ((s = routed ? laden__sched_enter_experts(sc, block, rows, n,
                                                 compute_stream)
                    : laden__sched_enter(sc, block, compute_stream))) {
        unhold(sc);
        return s;
    }
    sc->hold.entered++;
    sc->layout.b[block].running++;
    sc->layout.b[block].enter_handle = compute_stream;
    if (t0) {
        laden__trace_rec r = {
            .session = sess, .t = t0, .a = block, .b = (uintptr_t)sc,
            .c = (uint64_t)laden__sched_streamed(sc, &sc->layout.b[block]) |
                 (uint64_t)(sc->st.misses != misses) << 1,
            .s = laden__sched_block_trace_name(&sc->layout.b[block]),
            .s2 = laden__sched_trace_name(sc), .ev = LADEN__EV_ENTER,
            .dev = (int16_t)sc->cfg.device};
        blk *b = &sc->layout.b[block];
        if (!laden__trace_emit(&r))
            return LADEN_OK; /* that trace ended: no E is owed */
        if (b->trace_entered != sess) {
            b->trace_entered = sess;
            b->trace_open = 0;
        }
        b->trace_open++;
    }
    return LADEN_OK;
}

laden_status laden_sched_enter(laden_sched_t *sc, uint32_t block,
                               uintptr_t compute_stream)
{
    return enter_held(sc, block, compute_stream, false, NULL, 0,
                      "laden_sched_enter");
}

laden_status laden_sched_enter_experts(laden_sched_t *sc, uint32_t block,
                                       const uint32_t *experts, uint32_t n,
                                       uintptr_t compute_stream)
{
    return enter_held(sc, block, compute_stream, true, experts, n,
                      "laden_sched_enter_experts");
}

laden_status laden_sched_set_lossless(laden_sched_t *sc, uint32_t block,
                                      uint32_t index)
{
    HELD("laden_sched_set_lossless",
         laden__sched_set_lossless(sc, block, index));
}

laden_status laden_sched_mark_lossless(laden_sched_t *sc, uint32_t *out)
{
    HELD("laden_sched_mark_lossless", laden__sched_mark_lossless(sc, out));
}

laden_status laden_sched_use_lossless_cache(laden_sched_t *sc,
                                            const char *dir)
{
    HELD("laden_sched_use_lossless_cache", laden__sched_use_llc(sc, dir));
}

laden_status laden_sched_lossless_cache_info(laden_sched_t *sc,
                                             uint32_t *found, uint32_t *stale)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_lossless_cache_info: NULL schedule");
    if (found)
        *found = sc->layout.llc_found;
    if (stale)
        *stale = sc->layout.llc_stale;
    return LADEN_OK;
}

int laden_sched_tensor_lossless(laden_sched_t *sc, uint32_t block,
                                uint32_t index)
{
    return laden__sched_tensor_lossless(sc, block, index);
}

laden_status laden_sched_set_expert_cache(laden_sched_t *sc, uint64_t bytes)
{
    HELD("laden_sched_set_expert_cache",
         laden__sched_set_expert_cache(sc, bytes));
}

laden_status laden_sched_set_experts(laden_sched_t *sc, uint32_t block,
                                     uint32_t experts)
{
    HELD("laden_sched_set_experts",
         laden__sched_set_experts(sc, block, experts));
}

laden_status laden_sched_exit(laden_sched_t *sc, uint32_t block,
                              uintptr_t compute_stream)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_exit: NULL schedule");
    if (!holds(sc) || !sc->hold.entered)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_exit: block %u was not entered on "
                           "this thread",
                           block);
    /* Refused before anything changes: the hold, and the blocks that are
     * running, stay as they were. */
    if (block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL, "laden_sched_exit: no block %u "
                           "(%u blocks)", block, sc->layout.nb);
    if (!sc->layout.b[block].running)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_exit: block %u is not running",
                           block);
    laden_status s = laden__sched_exit(sc, block, compute_stream);
    /* The exit of an enter this trace recorded (not of one before it, nor
     * of a block that was not running): the pair stays matched. */
    uint64_t sess = LADEN__TRACING() ? laden__trace_session() : 0;
    if (sess && block < sc->layout.nb &&
        sc->layout.b[block].trace_entered == sess &&
        sc->layout.b[block].trace_open > 0) {
        laden__trace_rec r = {.session = sess,
                              .t = laden__now_ns(),
                              .a = block,
                              .b = (uintptr_t)sc,
                              .ev = LADEN__EV_EXIT,
                              .dev = (int16_t)sc->cfg.device};
        r.s = laden__sched_block_trace_name(&sc->layout.b[block]);
        laden__trace_emit(&r);
        sc->layout.b[block].trace_open--;
    }
    sc->layout.b[block].running--;
    sc->hold.entered--;
    unhold(sc);
    return s;
}

laden_status laden_sched_add_block(laden_sched_t *sc, laden_tier tier,
                                   uint32_t *out_block)
{
    if (out_block)
        *out_block = 0;
    HELD("laden_sched_add_block", laden__sched_add_block(sc, tier, out_block));
}

laden_status laden_sched_add_tensor_part(laden_sched_t *sc, uint32_t block,
                                         const laden_st_t *st,
                                         size_t st_index, laden_dtype dtype,
                                         uint32_t dim, uint64_t start,
                                         uint64_t count, uint32_t *out_index)
{
    if (out_index)
        *out_index = 0;
    HELD("laden_sched_add_tensor_part",
         laden__sched_add_tensor_part(sc, block, st, st_index, dtype, dim,
                                      start, count, out_index));
}

laden_status laden_sched_join_tensor(laden_sched_t *sc, uint32_t block,
                                     uint32_t index)
{
    HELD("laden_sched_join_tensor",
         laden__sched_join_tensor(sc, block, index));
}

laden_status laden_sched_add_tensor(laden_sched_t *sc, uint32_t block,
                                    const laden_st_t *st, size_t st_index,
                                    laden_dtype dtype, uint32_t *out_index)
{
    if (out_index)
        *out_index = 0;
    HELD("laden_sched_add_tensor",
         laden__sched_add_tensor(sc, block, st, st_index, dtype, out_index));
}

laden_status laden_sched_set_expanded(laden_sched_t *sc, uint32_t block,
                                      uint32_t i, laden_dtype compute,
                                      uint64_t cols, uint32_t scale,
                                      laden_scale_kind kind)
{
    HELD("laden_sched_set_expanded",
         laden__sched_set_expanded(sc, block, i, compute, cols, scale, kind));
}

laden_status laden_sched_tensor_value(laden_sched_t *sc, uint32_t block,
                                      uint32_t i, laden_dtype dtype, void *dst,
                                      uint64_t dst_bytes)
{
    HELD("laden_sched_tensor_value",
         laden__sched_tensor_value(sc, block, i, dtype, dst, dst_bytes));
}

laden_status laden_sched_expanded_at(laden_sched_t *sc, uint32_t block,
                                     uint32_t i, laden_devptr_t *ptr,
                                     uint64_t *size_bytes)
{
    if (ptr)
        *ptr = 0;
    if (size_bytes)
        *size_bytes = 0;
    if (!ptr || !size_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_sched_expanded_at: NULL");
    HELD("laden_sched_expanded_at",
         laden__sched_expanded_at(sc, block, i, ptr, size_bytes));
}

laden_status laden_sched_set_rope_rows(laden_sched_t *sc, uint32_t block,
                                       uint32_t index, uint64_t heads)
{
    HELD("laden_sched_set_rope_rows",
         laden__sched_rope_rows(sc, block, index, heads));
}

laden_status laden_sched_add_host_tensor(laden_sched_t *sc, uint32_t block,
                                         const void *src,
                                         laden_dtype src_dtype,
                                         uint64_t n_elems, laden_dtype dtype,
                                         uint32_t *out_index)
{
    if (out_index)
        *out_index = 0;
    HELD("laden_sched_add_host_tensor",
         laden__sched_add_host_tensor(sc, block, src, src_dtype, n_elems,
                                      dtype, out_index));
}

laden_status laden_sched_plan(laden_sched_t *sc,
                              const laden_plan_input *budgets, int32_t *why,
                              laden_plan_result *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    HELD("laden_sched_plan", laden__sched_plan(sc, budgets, why, out));
}

laden_status laden_sched_load(laden_sched_t *sc)
{
    HELD("laden_sched_load", laden__sched_load(sc));
}

laden_status laden_sched_load_prepare(laden_sched_t *sc)
{
    HELD("laden_sched_load_prepare", laden__sched_load_prepare(sc));
}

laden_status laden_sched_load_begin(laden_sched_t *sc)
{
    HELD("laden_sched_load_begin", laden__sched_load_begin(sc));
}

laden_status laden_sched_load_wait(laden_sched_t *sc)
{
    HELD("laden_sched_load_wait", laden__sched_load_wait(sc));
}

laden_status laden_sched_await(laden_sched_t *sc, uint32_t block)
{
    HELD("laden_sched_await", laden__sched_until(sc, block));
}

laden_status laden_sched_await_for(laden_sched_t *sc, int64_t block,
                                   uint32_t timeout_ms, int *out_done)
{
    if (!out_done)
        return laden__fail(LADEN_E_INVAL, "laden_sched_await_for: out_done "
                                          "is NULL");
    *out_done = 0;
    HELD("laden_sched_await_for",
         laden__sched_await_for(sc, block, timeout_ms, out_done));
}

laden_status laden_sched_load_cancel(laden_sched_t *sc)
{
    HELD("laden_sched_load_cancel", laden__sched_load_cancel(sc));
}

int laden_sched_is_loaded(laden_sched_t *sc)
{
    if (!sc || hold(sc, "laden_sched_is_loaded")) {
        laden__error_clear();
        return 0;
    }
    int loaded = sc->loaded;
    unhold(sc);
    return loaded;
}

laden_status laden_sched_load_block(laden_sched_t *sc, uint32_t block)
{
    HELD("laden_sched_load_block", laden__sched_load_block(sc, block));
}

laden_status laden_sched_start(laden_sched_t *sc, uint32_t lookahead)
{
    HELD("laden_sched_start", laden__sched_start(sc, lookahead));
}

laden_status laden_sched_learn_order(laden_sched_t *sc, int on)
{
    HELD("laden_sched_learn_order", laden__sched_learn_order(sc, on));
}

const uint64_t *laden_sched_generation_word(laden_sched_t *sc)
{
    return sc ? &sc->st.generation : NULL;
}

laden_status laden_sched_stop(laden_sched_t *sc)
{
    HELD("laden_sched_stop", laden__sched_stop(sc));
}

laden_status laden_sched_tensor_ptr(laden_sched_t *sc, uint32_t block,
                                    uint32_t i, laden_devptr_t *out)
{
    if (out)
        *out = 0;
    HELD("laden_sched_tensor_ptr", laden__sched_tensor_ptr(sc, block, i, out));
}

laden_status laden_sched_host_ptr(laden_sched_t *sc, uint32_t block,
                                  uint32_t i, void **out)
{
    if (out)
        *out = NULL;
    HELD("laden_sched_host_ptr", laden__sched_host_ptr(sc, block, i, out));
}

static laden_status set_progress(laden_sched_t *sc, laden_sched_progress_fn fn,
                                 void *arg)
{
    sc->load.progress = fn;
    sc->load.progress_arg = arg;
    return LADEN_OK;
}

laden_status laden_sched_set_progress(laden_sched_t *sc,
                                      laden_sched_progress_fn fn, void *arg)
{
    HELD("laden_sched_set_progress", set_progress(sc, fn, arg));
}

laden_status laden_sched_forget_stream(laden_sched_t *sc, uintptr_t handle)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_forget_stream: NULL schedule");
    /* Also once closed (release closes before its trainer goes): no call
     * can hold it then, and destroy would synchronize the stream. */
    if (atomic_load(&sc->hold.holder) == CLOSED) {
        pthread_mutex_lock(&sc->hold.mu);
        laden_status s = laden__sched_forget_stream(sc, handle);
        pthread_mutex_unlock(&sc->hold.mu);
        return s;
    }
    HELD("laden_sched_forget_stream", laden__sched_forget_stream(sc, handle));
}

/* A capture holds the schedule from capture_begin to capture_end, as a
 * pass does: another thread's enter would put its copies in the graph. */
laden_status laden_sched_capture_begin(laden_sched_t *sc,
                                      uintptr_t compute_stream, uint32_t flags)
{
    laden_status s = hold(sc, "laden_sched_capture_begin");
    if (s)
        return s;
    if ((s = laden__sched_capture_begin(sc, compute_stream, flags)))
        unhold(sc);
    return s;
}

laden_status laden_sched_capture_end(laden_sched_t *sc,
                                    uintptr_t compute_stream,
                                    laden_sched_capture_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_capture_end: out is "
                                          "NULL");
    *out = NULL;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_capture_end: NULL "
                                          "schedule");
    if (!holds(sc) || !sc->capture.on)
        return laden__fail(LADEN_E_STATE, "laden_sched_capture_end: no "
                           "capture in progress on this thread");
    laden_status s = laden__sched_capture_end(sc, compute_stream, out);
    unhold(sc); /* capture_begin's */
    return s;
}

laden_status laden_sched_replay_begin(laden_sched_t *sc,
                                     uintptr_t compute_stream,
                                     const laden_sched_capture_t *capture)
{
    HELD("laden_sched_replay_begin",
         laden__sched_replay_begin(sc, compute_stream, capture));
}

laden_status laden_sched_replay_end(laden_sched_t *sc,
                                   uintptr_t compute_stream,
                                   const laden_sched_capture_t *capture)
{
    HELD("laden_sched_replay_end",
         laden__sched_replay_end(sc, compute_stream, capture));
}

laden_status laden_sched_synchronize(laden_sched_t *sc)
{
    HELD("laden_sched_synchronize", laden__sched_synchronize(sc));
}

laden_status laden_sched_slot_fills(laden_sched_t *sc, uint32_t block,
                                    uint64_t *out)
{
    HELD("laden_sched_slot_fills", laden__sched_slot_fills(sc, block, out));
}

laden_status laden_sched_copy_fills(laden_sched_t *sc, uint32_t block,
                                    uint64_t *out)
{
    HELD("laden_sched_copy_fills", laden__sched_copy_fills(sc, block, out));
}

laden_status laden_sched_reupload(laden_sched_t *sc, uint32_t block)
{
    HELD("laden_sched_reupload", laden__sched_reupload(sc, block));
}

laden_status laden_sched_reupload_tensor(laden_sched_t *sc, uint32_t block,
                                         uint32_t i, uintptr_t compute_stream)
{
    HELD("laden_sched_reupload_tensor",
         laden__sched_reupload_tensor(sc, block, i, compute_stream));
}

laden_status laden_sched_own_copy(laden_sched_t *sc, uint32_t block,
                                  int *out_made)
{
    if (!out_made)
        return laden__fail(LADEN_E_INVAL, "laden_sched_own_copy: out_made "
                                          "is NULL");
    *out_made = 0;
    HELD("laden_sched_own_copy", laden__sched_own_copy(sc, block, out_made));
}

laden_status laden_sched_refill(laden_sched_t *sc)
{
    HELD("laden_sched_refill", laden__sched_refill(sc));
}

laden_status laden_sched_share(laden_sched_t *sc, const char *key)
{
    HELD("laden_sched_share", laden__sched_share(sc, key));
}

laden_status laden_sched_share_info(laden_sched_t *sc, char *name,
                                    size_t name_cap, uint64_t *out_bytes,
                                    int32_t *out_state)
{
    HELD("laden_sched_share_info",
         laden__sched_share_info(sc, name, name_cap, out_bytes, out_state));
}

laden_status laden_sched_share_note(laden_sched_t *sc, char *why,
                                    size_t why_cap)
{
    HELD("laden_sched_share_note", laden__sched_share_note(sc, why, why_cap));
}

laden_status laden_sched_reread(laden_sched_t *sc, uint32_t block, uint32_t i)
{
    HELD("laden_sched_reread", laden__sched_reread(sc, block, i));
}

laden_status laden_sched_stats(laden_sched_t *sc, laden_sched_stats_t *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    HELD("laden_sched_stats", stats(sc, out));
}

laden_status laden_sched_set_resident(laden_sched_t *sc, uint32_t block,
                                      int resident)
{
    HELD("laden_sched_set_resident",
         laden__sched_set_resident(sc, block, resident));
}

laden_status laden_sched_take_resident(laden_sched_t *sc, uint32_t block,
                                       laden_devptr_t *out_ptr,
                                       uint64_t *out_bytes)
{
    if (out_ptr)
        *out_ptr = 0;
    if (out_bytes)
        *out_bytes = 0;
    HELD("laden_sched_take_resident",
         laden__sched_take_resident(sc, block, out_ptr, out_bytes));
}

laden_status laden_sched_set_resident_at(laden_sched_t *sc, uint32_t block,
                                         laden_devptr_t ptr, uint64_t bytes)
{
    HELD("laden_sched_set_resident_at",
         laden__sched_set_resident_at(sc, block, ptr, bytes));
}

laden_status laden_sched_use_vram(laden_sched_t *sc, laden_vram_t *vram)
{
    HELD("laden_sched_use_vram", laden__sched_use_vram(sc, vram));
}

laden_status laden_sched_reserve_vram(laden_sched_t *sc, const uint8_t *want,
                                      uint32_t n)
{
    HELD("laden_sched_reserve_vram", laden__sched_reserve_vram(sc, want, n));
}

laden_status laden_sched_pin(laden_sched_t *sc, uint32_t block, int pinned)
{
    HELD("laden_sched_pin", laden__sched_pin(sc, block, pinned));
}

laden_status laden_sched_ready(laden_sched_t *sc, uintptr_t compute_stream)
{
    HELD("laden_sched_ready", laden__sched_ready(sc, compute_stream));
}

laden_status laden_sched_fence(laden_sched_t *sc, uintptr_t compute_stream)
{
    HELD("laden_sched_fence", laden__sched_fence(sc, compute_stream));
}

/* ---- destroy ------------------------------------------------------------ */

/* Here for the loader's thread (its hold part): destroyed on that thread
 * (its progress callback), the thread finishes it on its way out; else
 * load.c's laden__sched_destroy does the work. */
void laden_sched_destroy(laden_sched_t *sc)
{
    if (!sc)
        return;
    if (laden__sched_on_loader(sc)) { /* finished by the loader's thread */
        atomic_store(&sc->load.destroy_asked, true);
        return;
    }
    laden__sched_destroy(sc);
}
