/* Running a schedule: the slots its streamed blocks run from, the
 * prefetch ahead of the block running, start and stop.  Freeing the slots
 * (laden__sched_free_slots) is parts.c's, for load.c's free_all below.
 * Calls parts.c and load.c; resident.c and stream.c are above it.
 *
 * Slots: streamed block at schedule position p always runs from slot
 * p % nslots.  A slot remembers which block's bytes it holds (or is
 * receiving); a prefetch for the block already there costs nothing, so
 * repeated forwards over a model that fits in the slots copy nothing.
 *
 * Ordering on CUDA, never a host synchronize in the steady state:
 *   copy stream:    wait(slot.free) -> H2D into slot -> record(slot.ready)
 *   compute stream: wait(slot.ready) -> block's kernels -> record(slot.free)
 * Disk blocks are first read by the reader pool into the slot's pinned
 * staging buffer; the H2D is enqueued once the reads have finished, which
 * enter/exit notice by polling (or, for the block about to run, by waiting).
 * Before a staging buffer is refilled the host waits for the event recorded
 * after its last H2D, which finished a lookahead ago in the steady state. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stream_run.h"
#include "stream_layout.h"
#include "stream_load.h"

#include "laden/expand.h"

/* Checks a (block, tensor) argument of a loaded schedule. */
static laden_status tensor_arg(laden_sched_t *sc, uint32_t block, uint32_t i,
                               bool have_out, const char *call)
{
    if (!sc || !have_out || block >= sc->layout.nb ||
        i >= sc->layout.b[block].nt)
        return laden__fail(LADEN_E_INVAL, "%s: bad block or tensor", call);
    if (!laden__sched_usable(sc) &&
        !(sc->cache.on && sc->layout.b[block].filled))
        return laden__fail(LADEN_E_STATE, "%s: the schedule is not loaded",
                           call);
    return LADEN_OK;
}

/* Where block b runs from: its slot when streamed (the schedule started),
 * else its own region. */
static laden_devptr_t run_base(const laden_sched_t *sc, const blk *b)
{
    return laden__sched_streamed(sc, b)
               ? sc->run.slots[(uint32_t)b->pos % sc->run.nslots].ptr
               : b->region;
}

/* Where tensor r of block b lies where the block runs.  A cache
 * schedule's device copy holds its lossless tensors decoded, so there
 * the tensors lie at their device-copy offsets (dev_off), not the host
 * copy's and the slot's (dst_off). */
static laden_devptr_t run_at(const laden_sched_t *sc, const blk *b,
                             const tref *r)
{
    return run_base(sc, b) +
           (laden__sched_decoded_copy(sc, b) ? r->dev_off : r->dst_off);
}

laden_status laden__sched_tensor_ptr(laden_sched_t *sc, uint32_t block,
                                     uint32_t i, laden_devptr_t *out)
{
    if (out)
        *out = 0;
    laden_status s = tensor_arg(sc, block, i, out != NULL,
                                "laden_sched_tensor_ptr");
    if (s)
        return s;
    blk *b = &sc->layout.b[block];
    if (laden__sched_streamed(sc, b) && !sc->run.started)
        return laden__fail(LADEN_E_STATE,
                           "block %u is streamed: its slot exists once the "
                           "schedule is started",
                           block);
    *out = run_at(sc, b, &b->t[i]);
    return LADEN_OK;
}

laden_status laden__sched_host_ptr(laden_sched_t *sc, uint32_t block,
                                   uint32_t i, void **out)
{
    if (out)
        *out = NULL;
    laden_status s = tensor_arg(sc, block, i, out != NULL,
                                "laden_sched_host_ptr");
    if (s)
        return s;
    blk *b = &sc->layout.b[block];
    if (b->ram)
        *out = (char *)b->ram + b->t[i].dst_off;
    return LADEN_OK;
}

/* ---- the hot path ------------------------------------------------------- */

/* Whether block b's enter expands tensors into the workspace: its compact
 * tensors, but not a cache schedule's lossless ones while the block has a
 * device copy (decoded there at the upload, resident.c). */
static bool expands_at_enter(const laden_sched_t *sc, const blk *b)
{
    return b->ws_bytes &&
           (!laden__sched_decoded_copy(sc, b) || b->has_compact);
}

static const char *bname(laden_sched_t *sc, int64_t block);

/* Block's compact tensors expanded into the workspace (workspace.c laid
 * it out) on `handle`, from where the block runs; *decoded set if
 * lossless ones were among them. */
static laden_status expand_tensors(laden_sched_t *sc, uint32_t block,
                                   uintptr_t handle, bool *decoded)
{
    blk *b = &sc->layout.b[block];
    int32_t dev = sc->cfg.device;
    laden_devptr_t ws = sc->run.workspace;
    /* A cache schedule's device copy holds its lossless tensors decoded
     * (resident.c): only a streamed block's are decoded here. */
    bool coded = !laden__sched_decoded_copy(sc, b);
    laden_status s;
    for (uint32_t k = 0; k < b->nt; k++) {
        const tref *r = &b->t[k];
        if (!r->expands || !r->nelem || (r->ll && !coded))
            continue; /* nothing to expand; decoded in its device copy */
        laden_devptr_t src = run_at(sc, b, r), scale = 0;
        laden_scale_kind kind = r->scale_kind;
        if (r->rows) {
            scale = src + laden__sched_scale_offset(r->nelem);
            kind = LADEN_SCALE_ROW;
        } else if (r->scale != LADEN_SCHED_NO_SCALE) {
            const tref *sr = &b->t[r->scale];
            scale = run_at(sc, b, sr);
            if (sr->dst != LADEN_DTYPE_F32) {
                if ((s = laden_expand(dev, handle, sr->dst, scale,
                                      laden__sched_code_bytes(sr), sr->nelem, 0, 0,
                                      LADEN_SCALE_NONE, LADEN_DTYPE_F32,
                                      ws + r->sws_off))) {
                    laden__error_prefix("the scale of tensor '%.200s'",
                                        r->name ? r->name : "?");
                    return s;
                }
                scale = ws + r->sws_off;
            }
        }
        if (r->ll) { /* lossless (compress.c): decoded in its dtype; on
                        CUDA wrong codes set the block's word (the
                        host's pointer is the device's: unified
                        addressing) */
            laden_devptr_t bad =
                sc->run.ll_bad ? (laden_devptr_t)(uintptr_t)&sc->run
                                     .ll_bad[block]
                               : 0;
            if ((s = laden_lossless_decode(dev, handle, r->ll, src,
                                           ws + r->ws_off, 2 * r->nelem,
                                           bad))) {
                laden__error_prefix("tensor '%.200s'",
                                    r->name ? r->name : "?");
                return s;
            }
            *decoded = true;
            continue;
        }
        if ((s = laden_expand(dev, handle, r->dst, src, laden__sched_code_bytes(r),
                              r->nelem, r->cols, scale, kind, r->expanded,
                              ws + r->ws_off))) {
            laden__error_prefix("tensor '%.200s'", r->name ? r->name : "?");
            return s;
        }
    }
    return LADEN_OK;
}

/* expand_tensors, traced as a span on the compute stream (the CPU device:
 * on the calling thread) when a trace is on: enter's last step. */
laden_status laden__sched_expand_block(laden_sched_t *sc, uint32_t block,
                                       uintptr_t handle)
{
    blk *b = &sc->layout.b[block];
    if (!expands_at_enter(sc, b))
        return LADEN_OK;
    if (!sc->run.workspace)
        return laden__fail(LADEN_E_STATE, "block %u has compact tensors: "
                           "they expand once the schedule is started", block);
    bool decode = false;
    if (!LADEN__TRACING() || sc->capture.on)
        return expand_tensors(sc, block, handle, &decode);
    uint64_t sess = laden__trace_session(); /* before the marks */
    laden_status s;
    void *m0 = NULL;
    if (sc->cuda) {
        if ((s = laden__sched_compute_stream(sc, handle)))
            return s;
        m0 = laden__dev_trace_mark(sc->run.compute);
    }
    uint64_t t0 = laden__now_ns();
    s = expand_tensors(sc, block, handle, &decode);
    laden__trace_rec r = {.session = sess, .t = t0, .a = block,
                          .b = b->ws_bytes, .c = (uintptr_t)sc,
                          .s = bname(sc, block),
                          .s2 = decode ? "decode" : "expand",
                          .ev = LADEN__EV_EXPAND, .dev = -1};
    if (sc->cuda) { /* its time from the marks */
        r.m0 = m0;
        r.m1 = m0 ? laden__dev_trace_mark(sc->run.compute) : NULL;
        r.dev = (int16_t)sc->cfg.device;
        if (r.m1)
            laden__trace_emit(&r);
    } else {
        r.dur = laden__now_ns() - t0;
        laden__trace_emit(&r);
    }
    return s;
}


/* Tracing: block's name (NULL if it has none). */
static const char *bname(laden_sched_t *sc, int64_t block)
{
    return block >= 0 && (uint64_t)block < sc->layout.nb
               ? laden__sched_block_trace_name(&sc->layout.b[block])
               : NULL;
}

/* Tracing: the host waited from t0 for block's reads, copy or staging
 * buffer (recorded when it was long enough to matter). */
static void host_stall(laden_sched_t *sc, uint64_t t0, int64_t block,
                       laden__stall why)
{
    if (laden__now_ns() - t0 >= 2000) {
        uint64_t sess = laden__trace_session(); /* before the name */
        laden__trace_span(LADEN__EV_STALL, sess, t0, (uint64_t)block, why,
                          (uintptr_t)sc, bname(sc, block));
    }
}

/* The copy into a slot on the copy stream; while tracing (and not
 * capturing) between two marks, m[0] and m[1], recorded before the slot's
 * ready event so that the copy's end is timed, not the wake of whoever
 * waits for it.  *sess: the trace they were made in. */
static laden_status traced_copy(laden_sched_t *sc, laden_devptr_t dst,
                                const void *src, uint64_t n, void *m[2],
                                uint64_t *sess)
{
    bool traced = LADEN__TRACING() && !sc->capture.on;
    if (traced) {
        *sess = laden__trace_session(); /* before the marks */
        m[0] = laden__dev_trace_mark(sc->run.copy);
    }
    laden_status s = laden_dev_copy_h2d(sc->run.copy, dst, src, n);
    if (!s && m[0])
        m[1] = laden__dev_trace_mark(sc->run.copy);
    return s;
}

/* Where block b's bytes go in slot sl's staging buffer (CUDA's disk
 * tier): its read shift past the start when the buffer has the room, so
 * that the reads land in place. */
static char *staging_for(const slot *sl, const blk *b)
{
    uint64_t shift = b->bytes + b->read_shift <= sl->staging_bytes
                         ? b->read_shift
                         : 0;
    return (char *)sl->staging + shift;
}

/* Waits for the slot's reads; on success enqueues staging -> slot. */
static laden_status finish_reads(laden_sched_t *sc, slot *sl, bool discard)
{
    laden_status s = LADEN_OK, w;
    uint64_t t0 = LADEN__TRACING() ? laden__now_ns() : 0;
    for (uint32_t k = 0; k < sl->nreqs; k++)
        if ((w = laden_io_wait(sc->layout.io, sl->reqs[k])) && !s) {
            s = w;
            snprintf(sl->errmsg, sizeof sl->errmsg, "%s", laden_last_error());
        }
    if (t0)
        host_stall(sc, t0, sl->block, LADEN__STALL_READS);
    sl->nreqs = 0;
    sl->reads_pending = false;
    if (discard || sl->err)
        return LADEN_OK; /* a submit failed: the error is reported at enter */
    if (s) {
        sl->err = s;
        return LADEN_OK;
    }
    blk *b = &sc->layout.b[sl->block];
    sc->st.read_bytes += b->bytes;
    const char *got = sc->cuda ? staging_for(sl, b)
                               : (const char *)(uintptr_t)sl->ptr;
    if ((s = laden__sched_check_blobs(sc, b, got))) { /* before it runs */
        sl->err = s;
        snprintf(sl->errmsg, sizeof sl->errmsg, "%s", laden_last_error());
        return LADEN_OK;
    }
    if (!sc->cuda)
        return LADEN_OK; /* read straight into the slot */
    void *m[2] = {NULL, NULL};
    uint64_t sess = 0;
    if ((s = laden_dev_stream_wait_event(sc->run.copy, sl->free)) ||
        (s = traced_copy(sc, sl->ptr, staging_for(sl, b),
                         b->bytes, m, &sess)) ||
        (s = laden_dev_event_record(sl->ready, sc->run.copy)) ||
        (s = laden_dev_event_record(sl->staging_free, sc->run.copy))) {
        sl->block = -1; /* not there: filled again at its next enter */
        return s;
    }
    laden__trace_stream(LADEN__EV_H2D, sess, sc->cfg.device, m[0], m[1],
                        sl->block, b->bytes, (uintptr_t)sc,
                        m[0] ? bname(sc, sl->block) : NULL);
    sc->st.h2d_bytes += b->bytes;
    return LADEN_OK;
}

/* Starts putting block bi's bytes into slot sl. */
static laden_status issue_load(laden_sched_t *sc, slot *sl, uint32_t bi)
{
    laden_status s;
    blk *b = &sc->layout.b[bi];
    if (sl->reads_pending)
        finish_reads(sc, sl, true);
    sl->block = bi;
    sl->rows_block = -1; /* whole, or another block: rows taken again */
    sl->err = LADEN_OK;
    sl->fills = ++sc->run.fill_seq; /* never repeats, across stop and start */
    if (b->tier == LADEN_TIER_RAM) {
        /* In a capture the slot's last use before it is ordered by the
         * fork (laden_sched_capture_begin); a record from outside the
         * capture cannot be waited for inside it. */
        bool wait = !sc->capture.on || sl->free_captured;
        void *m[2] = {NULL, NULL};
        uint64_t sess = 0;
        if ((wait &&
             (s = laden_dev_stream_wait_event(sc->run.copy, sl->free))) ||
            (s = traced_copy(sc, sl->ptr, b->ram, b->bytes, m, &sess)) ||
            (s = laden_dev_event_record(sl->ready, sc->run.copy))) {
            sl->block = -1;
            return s;
        }
        laden__trace_stream(LADEN__EV_H2D, sess, sc->cfg.device, m[0], m[1],
                            bi, b->bytes, (uintptr_t)sc,
                            m[0] ? bname(sc, bi) : NULL);
        /* A captured copy runs at each replay, which counts it. */
        if (sc->capture.on) {
            sc->capture.h2d += b->bytes;
            sl->ready_captured = true;
        } else {
            sc->st.h2d_bytes += b->bytes;
        }
        return LADEN_OK;
    }
    char *dst = sc->cuda ? staging_for(sl, b) : (char *)(uintptr_t)sl->ptr;
    uint64_t t0 = LADEN__TRACING() ? laden__now_ns() : 0;
    if (sc->cuda && (s = laden_dev_event_synchronize(sl->staging_free))) {
        sl->block = -1;
        return s;
    }
    if (t0 && sc->cuda)
        host_stall(sc, t0, bi, LADEN__STALL_STAGING);
    for (uint32_t k = 0; k < b->nt; k++) {
        tref *r = &b->t[k];
        s = laden_io_submit(sc->layout.io, laden__sched_file(sc, r), r->off,
                            r->src_bytes, dst + r->dst_off,
                            &sl->reqs[sl->nreqs]);
        if (s) {
            sl->err = s;
            snprintf(sl->errmsg, sizeof sl->errmsg, "%s", laden_last_error());
            break;
        }
        sl->nreqs++;
    }
    sl->reads_pending = true;
    return LADEN_OK;
}

/* Enqueues the copies of disk blocks whose reads have finished. */
static laden_status poll_reads(laden_sched_t *sc)
{
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if (!sl->reads_pending)
            continue;
        bool all = true;
        for (uint32_t k = 0; k < sl->nreqs && all; k++) {
            int done = 0;
            laden_io_poll(sc->layout.io, sl->reqs[k], &done);
            all = done != 0;
        }
        if (all) {
            laden_status s = finish_reads(sc, sl, false);
            if (s)
                return s;
        }
    }
    return LADEN_OK;
}

/* The position `k` steps from `pos` in the direction blocks are entered
 * in (cyclically). */
static uint32_t step_pos(const laden_sched_t *sc, uint32_t pos, uint32_t k)
{
    uint32_t n = sc->layout.nstreamed;
    return sc->run.dir < 0 ? (pos + n - k % n) % n : (pos + k) % n;
}

/* Loads the blocks at positions pos, pos+1, ..., count of them (pos-1, ...
 * when blocks are entered in reverse; cyclically) into their slots.  A
 * slot wanted by a nearer block of the window is left to it: at the wrap
 * of the schedule two blocks of one window can share a slot. */
static laden_status prefetch_from(laden_sched_t *sc, uint32_t pos,
                                  uint32_t count)
{
    uint64_t claimed = 0;
    for (uint32_t k = 0; k < count && k < sc->layout.nstreamed; k++) {
        uint32_t p = step_pos(sc, pos, k);
        uint32_t bi = sc->layout.order[p];
        uint32_t si = p % sc->run.nslots;
        slot *sl = &sc->run.slots[si];
        if (claimed & (1ull << si))
            break; /* the rest of the window must wait for this slot */
        if (!sc->loaded && !sc->layout.b[bi].ready)
            break; /* still loading: enter waits for it (and the rest) */
        claimed |= 1ull << si;
        if (sl->in_use || sl->block == (int64_t)bi ||
            sc->layout.b[bi].experts)
            continue; /* an expert block is filled at its enter, routed */
        laden_status s = issue_load(sc, sl, bi);
        if (s)
            return s;
    }
    return poll_reads(sc);
}

/* The prefetch after the block at `pos` entered or exited: the lookahead
 * window past it.  A standalone captured pass stops at the schedule's
 * end: a prefetch wrapped to the first blocks would copy them at the end
 * of every replay, and the next replay copies them again. */
static laden_status prefetch_after(laden_sched_t *sc, uint32_t pos)
{
    uint32_t count = sc->cfg.lookahead;
    if (sc->capture.on && sc->capture.alone) {
        uint32_t left = sc->run.dir < 0 ? pos : sc->layout.nstreamed - 1 - pos;
        if (count > left)
            count = left;
    }
    return prefetch_from(sc, step_pos(sc, pos, 1), count);
}

/* Events last recorded inside a capture are graph nodes, not events a
 * stream outside it can wait for: after a capture they are recorded
 * again on the copy stream (which then is no longer capturing) before
 * anything waits for them. */
static laden_status settle(laden_sched_t *sc)
{
    if (!sc->capture.events)
        return LADEN_OK;
    laden_status s;
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if ((s = laden_dev_event_record(sl->free, sc->run.copy)) ||
            (s = laden_dev_event_record(sl->ready, sc->run.copy)))
            return s;
    }
    if ((s = laden_dev_event_record(sc->capture.fork, sc->run.copy)))
        return s;
    sc->capture.events = false;
    return LADEN_OK;
}

/* The expansion workspace (workspace.c), charged to the VRAM context
 * apart from the slots (their charge follows the streamed blocks).  A
 * cache schedule's resident blocks hold their lossless tensors decoded:
 * it needs one only while a block streams. */
static laden_status make_workspace(laden_sched_t *sc)
{
    uint64_t n = 0; /* the blocks that expand this time */
    laden_status s;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (expands_at_enter(sc, &sc->layout.b[i]) &&
            sc->layout.b[i].ws_bytes > n)
            n = sc->layout.b[i].ws_bytes;
    if (!n)
        return LADEN_OK;
    if ((s = laden__sched_can_expand(sc)))
        return s;
    if (sc->cache.vram && (s = laden_vram_charge(sc->cache.vram, n))) {
        laden__error_prefix("the expansion workspace (%s)",
                            laden__bytes(n).s);
        return s;
    }
    if ((s = laden_dev_mem_alloc(sc->cfg.device, n, &sc->run.workspace))) {
        sc->run.workspace = 0;
        if (sc->cache.vram)
            laden_vram_uncharge(sc->cache.vram, n);
        laden__error_prefix("the expansion workspace (%s)",
                            laden__bytes(n).s);
        return s;
    }
    sc->run.workspace_bytes = n;
    return LADEN_OK;
}

laden_status laden__sched_ll_damage(laden_sched_t *sc)
{
    for (uint32_t j = 0; sc->run.ll_bad && j < sc->run.n_ll_blocks; j++) {
        uint32_t i = sc->run.ll_blocks[j];
        if (!__atomic_load_n(&sc->run.ll_bad[i], __ATOMIC_RELAXED))
            continue;
        const blk *b = &sc->layout.b[i];
        const tref *r = NULL;
        for (uint32_t k = 0; k < b->nt && !r; k++)
            r = b->t[k].ll ? &b->t[k] : NULL;
        const char *from = r && r->cfile ? laden_io_file_path(r->cfile)
                                          : NULL;
        return laden__fail(
            LADEN_E_CORRUPT,
            "block %u: the device decoded a lossless blob whose codes are "
            "wrong (tensor '%.200s'%s%.300s), so outputs computed since "
            "its use are wrong; %s",
            i, r && r->name ? r->name : "?", from ? ", from " : "",
            from ? from : "",
            from ? "its cache file was damaged: write it again (laden "
                   "compress) and load again"
                 : "the host memory holding it was damaged: load again");
    }
    return LADEN_OK;
}

/* The slots' staging buffers (CUDA's disk tier): the largest block and 4
 * KiB of room for staging_for's shift each, or, when the pinned budget
 * cannot give every slot the room (the plan counts the slots' bytes
 * alone), all of them without it (the reads then go through the reader's
 * bounce buffer).  Decided for all at once: a budget that fits the plain
 * buffers always fits them.  (The arena rounds each to 64 KiB, which the
 * plan does not count: a budget it fits exactly can still be short.) */
static laden_status alloc_staging(laden_sched_t *sc)
{
    laden_status s = LADEN_OK;
    for (uint64_t room = 4096;; room = 0) {
        uint64_t n = sc->layout.slot_bytes + room;
        uint32_t i = 0;
        for (; i < sc->run.nslots; i++) {
            slot *sl = &sc->run.slots[i];
            if ((s = laden_host_alloc(sc->layout.host, n, &sl->staging)))
                break;
            /* the arena's rounding may leave the room all the same */
            sl->staging_bytes =
                laden_host_block_size(sc->layout.host, sl->staging);
        }
        if (!s || s != LADEN_E_BUDGET || !room)
            return s;
        while (i--) { /* again, without the room */
            slot *sl = &sc->run.slots[i];
            laden_host_free(sc->layout.host, sl->staging);
            sl->staging = NULL;
            sl->staging_bytes = 0;
        }
        laden_host_trim(sc->layout.host); /* else reused, whole, below */
    }
}

laden_status laden__sched_start(laden_sched_t *sc, uint32_t lookahead)
{
    laden_status s = LADEN_OK;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_start: NULL schedule");
    if (sc->load.err)
        return laden__sched_load_failure(sc);
    if (!laden__sched_usable(sc))
        return laden__fail(LADEN_E_STATE, "the schedule is not loaded");
    if (sc->run.started)
        return laden__fail(LADEN_E_STATE, "the schedule is already started");
    if (lookahead > LADEN_LOOKAHEAD_MAX)
        return laden__fail(LADEN_E_INVAL, "lookahead %u: at most %u",
                           lookahead, LADEN_LOOKAHEAD_MAX);
    if (lookahead)
        sc->cfg.lookahead = lookahead;
    /* A cache schedule's upload buffers go before its slots are charged
     * (the uploads are waited for: laden_sched_ready would anyway). */
    if (sc->cache.on)
        laden__sched_free_scratch(sc);
    int32_t dev = sc->cfg.device;
    sc->run.nslots = laden_slot_count(sc->layout.nstreamed, sc->cfg.lookahead);
    sc->run.slots =
        calloc(sc->run.nslots ? sc->run.nslots : 1, sizeof *sc->run.slots);
    if (!sc->run.slots) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory creating slots");
        goto fail;
    }
    if ((s = laden__sched_charge_slots(sc, (uint64_t)sc->run.nslots *
                                       sc->layout.slot_bytes)))
        goto fail;
    /* Also with no streamed block: a pass of resident blocks is captured
     * through it too. */
    if (sc->cuda && (s = laden_dev_event_create(dev, 0, &sc->capture.fork)))
        goto fail;
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        sl->block = -1;
        sl->rows_block = -1;
        sl->reqs = calloc(sc->layout.max_nt ? sc->layout.max_nt : 1,
                          sizeof *sl->reqs);
        if (!sl->reqs) {
            s = laden__fail(LADEN_E_NOMEM, "out of memory creating slots");
            goto fail;
        }
        if ((s = laden_dev_mem_alloc(
                 dev, sc->layout.slot_bytes ? sc->layout.slot_bytes : 1,
                 &sl->ptr)))
            goto fail;
        if ((sc->cuda || sc->cache.on) &&
            ((s = laden_dev_event_create(dev, 0, &sl->ready)) ||
             (s = laden_dev_event_create(dev, 0, &sl->free)) ||
             (s = laden_dev_event_create(dev, 0, &sl->staging_free))))
            goto fail;
    }
    if (sc->cuda && sc->layout.any_disk && (s = alloc_staging(sc)))
        goto fail;
    if ((s = make_workspace(sc)) || (s = laden__sched_experts_make(sc)))
        goto fail;
    sc->run.started = true;
    sc->run.slot_gauge = (uint64_t)sc->run.nslots * sc->layout.slot_bytes +
                         (uint64_t)sc->run.xc.n * sc->run.xc.entry_bytes;
    laden__gauge_add(LADEN__GAUGE_SLOTS, dev, (int64_t)sc->run.slot_gauge);
    sc->st.generation++; /* the slots' addresses */
    sc->run.dir = 1;
    sc->run.last_pos = -1;
    return prefetch_from(sc, 0, sc->run.nslots);
fail:
    laden__sched_free_slots(sc);
    return s;
}

laden_status laden__sched_stop(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_stop: NULL schedule");
    if (!sc->run.started) {
        /* The upload buffers a failed activation may have left (started,
         * they went at the start). */
        if (sc->cache.on)
            laden__sched_free_scratch(sc);
        return LADEN_OK;
    }
    if (sc->capture.on)
        return laden__fail(LADEN_E_STATE, "laden_sched_stop: a capture is "
                           "in progress (end it first)");
    if (sc->cache.fenced) {
        laden_status s = laden_dev_event_synchronize(sc->cache.last_use);
        if (s)
            return s;
    }
    laden__sched_free_slots(sc);
    return LADEN_OK;
}

laden_status laden__sched_compute_stream(laden_sched_t *sc, uintptr_t handle)
{
    if (sc->run.compute && sc->run.compute_handle == handle)
        return LADEN_OK;
    laden_dev_stream_t *t = sc->run.compute;
    uintptr_t th = sc->run.compute_handle;
    if (sc->run.compute_alt && sc->run.compute_alt_handle == handle) {
        sc->run.compute = sc->run.compute_alt; /* swapped, not wrapped again */
        sc->run.compute_handle = handle;
        sc->run.compute_alt = t;
        sc->run.compute_alt_handle = th;
        return LADEN_OK;
    }
    laden_dev_stream_destroy(sc->run.compute_alt);
    sc->run.compute_alt = t;
    sc->run.compute_alt_handle = th;
    sc->run.compute = NULL;
    laden_status s =
        laden_dev_stream_wrap(sc->cfg.device, handle, &sc->run.compute);
    if (!s)
        sc->run.compute_handle = handle;
    return s;
}

/* The slot a streamed block runs from; *out NULL for a resident block. */
static laden_status block_slot(laden_sched_t *sc, uint32_t block,
                               const char *call, slot **out)
{
    *out = NULL;
    laden_status s = laden__sched_check_block(sc, block, call);
    if (s)
        return s;
    blk *b = &sc->layout.b[block];
    if (!laden__sched_streamed(sc, b))
        return LADEN_OK;
    if (!sc->run.started)
        return laden__fail(LADEN_E_STATE, "%s: the schedule is not started",
                           call);
    *out = &sc->run.slots[(uint32_t)b->pos % sc->run.nslots];
    return LADEN_OK;
}

/* A block at `pos` entered: the direction is reverse when it is the
 * position before the last one entered, forward when after (with two
 * streamed blocks both are; the direction stays). */
static void note_direction(laden_sched_t *sc, uint32_t pos)
{
    uint32_t n = sc->layout.nstreamed;
    if (sc->run.last_pos >= 0 && n > 2) {
        uint32_t last = (uint32_t)sc->run.last_pos;
        if (pos == (last + n - 1) % n)
            sc->run.dir = -1;
        else if (pos == (last + 1) % n)
            sc->run.dir = 1;
    }
    sc->run.last_pos = pos;
}

/* ---- learning the call order ------------------------------------------
 *
 * Streamed positions start in the order blocks were added, which is the
 * order modules are registered, not always the order they are called: a
 * UNet lists a level's attentions before its resnets and calls them
 * interleaved, so a prefetch by position fetches the wrong blocks and
 * most enters miss.  So enter and exit watch the order blocks come in: a
 * pass is watched from a block entered until one is entered again (then
 * the watch starts over from it).  Once the pass watched has entered
 * every streamed block, at the exit that leaves no block running: if its
 * order is neither the positions' nor their reverse (a backward pass),
 * both taken cyclically (where a watch starts depends on the calls), the
 * positions become that order, a new generation (blocks run from other
 * slots), before that exit's prefetch, which then wraps to the next
 * pass's first blocks in the order they will come.  So a model whose
 * order is fixed is relaid once, at the end of its first pass, and misses
 * nothing from its second on; one whose order changes is relaid at each
 * change.  Not while a block is running (its slot would move under it),
 * nor once a CUDA graph was captured (its replays copy into the slots the
 * capture saw). */

/* Whether the streamed blocks of the pass watched came in position order
 * (dir 1) or its reverse (dir -1), cyclically; false if one was missing
 * or twice. */
static bool pass_in_positions(const laden_sched_t *sc, int dir)
{
    uint32_t n = sc->layout.nstreamed, k = 0, at = 0;
    for (uint32_t i = 0; i < sc->layout.nrec; i++) {
        const blk *b = &sc->layout.b[sc->layout.rec[i]];
        if (b->pos < 0)
            continue;
        if (k == 0)
            at = (uint32_t)b->pos;
        uint32_t want = dir > 0 ? (at + k) % n : (at + n - k % n) % n;
        if (k >= n || (uint32_t)b->pos != want)
            return false;
        k++;
    }
    return k == n;
}

static void watch_again(sched_layout *l)
{
    for (uint32_t i = 0; i < l->nrec; i++)
        l->seen[l->rec[i]] = 0;
    l->nrec = 0;
    l->nrec_streamed = 0;
}

static bool learning(const laden_sched_t *sc)
{
    return !sc->layout.learn_off && !sc->capture.on && sc->layout.seen;
}

/* Block entered: watched (a block seen already starts the watch over). */
static void watch_enter(laden_sched_t *sc, uint32_t block)
{
    sched_layout *l = &sc->layout;
    if (!learning(sc) || block >= l->nb)
        return;
    if (l->seen[block])
        watch_again(l);
    l->seen[block] = 1;
    l->rec[l->nrec++] = block;
    l->nrec_streamed += l->b[block].pos >= 0;
}

/* A block exited: once the pass watched entered every streamed block and
 * none runs, its order is taken (see above) and the watch starts over. */
static bool watch_exit(laden_sched_t *sc)
{
    sched_layout *l = &sc->layout;
    bool relaid = false;
    if (!learning(sc) || l->nstreamed < 3 || l->nrec_streamed < l->nstreamed)
        return false;
    for (uint32_t i = 0; i < sc->run.nslots; i++)
        if (sc->run.slots[i].in_use)
            return false; /* at the exit that leaves none */
    if (l->nrec_streamed == l->nstreamed && !pass_in_positions(sc, 1) &&
        !pass_in_positions(sc, -1)) {
        for (uint32_t i = 0; i < l->nrec; i++)
            l->call_rank[l->rec[i]] = i;
        laden__sched_relayout(sc);
        sc->run.last_pos = -1;
        sc->run.dir = 1;
        sc->st.reorders++;
        relaid = true;
    }
    watch_again(l);
    return relaid;
}

laden_status laden__sched_learn_order(laden_sched_t *sc, int on)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_learn_order: NULL");
    if (on && sc->capture.made)
        return laden__fail(LADEN_E_STATE, "laden_sched_learn_order: a CUDA "
                           "graph was captured from this schedule: its "
                           "replays copy into the slots it saw, so the "
                           "blocks' positions stay as they are");
    sc->layout.learn_off = !on;
    if (!on && sc->layout.seen) /* a pass half watched is dropped */
        watch_again(&sc->layout);
    return LADEN_OK;
}

/* ---- expert blocks (laden_sched_set_experts) ---------------------------
 *
 * A mixture-of-experts layer's experts: each tensor is one row per expert.
 * A prefetch leaves their slot alone (the router has not picked yet); the
 * enter copies the rows of the experts picked, at their places in the
 * slot, on the copy stream after the slot's last use, or on the disk tier
 * reads them (every range in flight) and copies them from the staging
 * buffer.  Rows of consecutive experts go in one copy. */

static bool bit(const uint64_t *m, uint32_t e)
{
    return m[e / 64] >> (e % 64) & 1;
}

/* Calls fn(sc, arg, off, len) for every byte range [off, off+len) of block
 * b (offsets in the block) that the experts whose bits are set in `move`
 * occupy, consecutive experts merged; returns the first failure. */
typedef laden_status (*row_fn)(laden_sched_t *sc, void *arg, uint64_t off,
                               uint64_t len);

static laden_status each_row_range(laden_sched_t *sc, const blk *b,
                                   const uint64_t *move, row_fn fn,
                                   void *arg)
{
    laden_status s = LADEN_OK;
    for (uint32_t k = 0; k < b->nt && !s;) {
        uint64_t bytes;
        uint32_t run = laden__sched_run_of(b, k, &bytes);
        uint64_t row = bytes / b->experts, base = b->t[k].dst_off;
        for (uint32_t e = 0; e < b->experts && !s;) {
            if (!bit(move, e)) {
                e++;
                continue;
            }
            uint32_t j = e + 1;
            while (j < b->experts && bit(move, j))
                j++;
            s = fn(sc, arg, base + e * row, (uint64_t)(j - e) * row);
            e = j;
        }
        k += run;
    }
    return s;
}

typedef struct rows_io {
    const blk *b;
    slot *sl;
    char *dst;              /* the disk tier's: staging or the slot */
    laden_io_req_t **reqs;  /* reads in flight */
    uint32_t nreqs, cap;
    uint64_t bytes;
} rows_io;

/* RAM tier: host copy -> slot, the range. */
static laden_status copy_rows(laden_sched_t *sc, void *arg, uint64_t off,
                              uint64_t len)
{
    rows_io *x = arg;
    x->bytes += len;
    return laden_dev_copy_h2d(sc->run.copy, x->sl->ptr + off,
                              (const char *)x->b->ram + off, len);
}

/* Disk tier: the range read from the checkpoint tensors laid there (as
 * stored: a byte of the file for a byte of the block). */
static laden_status read_rows(laden_sched_t *sc, void *arg, uint64_t off,
                              uint64_t len)
{
    rows_io *x = arg;
    const blk *b = x->b;
    laden_status s = LADEN_OK;
    x->bytes += len;
    for (uint32_t k = 0; k < b->nt && !s; k++) {
        const tref *r = &b->t[k];
        if (r->dst_off >= off + len)
            break; /* tensors lie in the block in order */
        uint64_t a = off > r->dst_off ? off : r->dst_off;
        uint64_t e = off + len < r->dst_off + r->dst_bytes
                         ? off + len
                         : r->dst_off + r->dst_bytes;
        if (a >= e)
            continue;
        if (x->nreqs == x->cap) {
            uint32_t c = x->cap ? 2 * x->cap : 16;
            laden_io_req_t **q = realloc(x->reqs, c * sizeof *q);
            if (!q)
                return laden__fail(LADEN_E_NOMEM, "out of memory reading "
                                   "experts");
            x->reqs = q;
            x->cap = c;
        }
        s = laden_io_submit(sc->layout.io, laden__sched_file(sc, r),
                            r->off + (a - r->dst_off), e - a, x->dst + a,
                            &x->reqs[x->nreqs]);
        if (!s)
            x->nreqs++;
    }
    return s;
}

/* Disk tier on CUDA: staging -> slot, the range. */
static laden_status stage_rows(laden_sched_t *sc, void *arg, uint64_t off,
                               uint64_t len)
{
    rows_io *x = arg;
    return laden_dev_copy_h2d(sc->run.copy, x->sl->ptr + off, x->dst + off,
                              len);
}

/* The expert cache's side of a fill (experts.c): copies the experts in
 * `hit` (cached) from their entries into slot sl, or, !in, keeps those
 * in `move` (just copied or read into the slot) in entries, as far as
 * entries not used by this fill go. */
static laden_status cache_rows(laden_sched_t *sc, slot *sl, uint32_t bi,
                               const uint64_t *m, bool in)
{
    const blk *b = &sc->layout.b[bi];
    laden_status s = LADEN_OK;
    for (uint32_t e = 0; e < b->experts && !s; e++) {
        if (!bit(m, e))
            continue;
        int64_t k = in ? laden__sched_expert_find(sc, bi, e)
                       : laden__sched_expert_claim(sc, bi, e);
        if (k < 0) /* !in: not kept */
            continue;
        s = laden__sched_expert_copy(sc, bi, e, k, sl->ptr, in);
    }
    return s;
}

/* Puts the rows of experts rows[0..n) (any order, repeats allowed) of
 * expert block bi into slot sl: those the slot does not hold already (it
 * held bi and nothing filled it since), so an expert picked again while
 * its block is still in its slot crosses once; of those, the ones the
 * expert cache holds come from there.  sl->rows_ok holds a bit per expert
 * of the rows in the slot, then twice as many words of scratch: the rows
 * to move across the link and the rows the cache gives. */
static laden_status fill_rows(laden_sched_t *sc, slot *sl, uint32_t bi,
                              const uint32_t *rows, uint32_t n)
{
    blk *b = &sc->layout.b[bi];
    laden_status s = LADEN_OK, w;
    if (sl->reads_pending)
        finish_reads(sc, sl, true);
    uint32_t words = (b->experts + 63) / 64;
    if (sl->rows_words < words) {
        uint64_t *r = realloc(sl->rows_ok, 3 * words * sizeof *r);
        if (!r)
            return laden__fail(LADEN_E_NOMEM, "out of memory entering "
                               "block %u", bi);
        sl->rows_ok = r;
        sl->rows_words = words;
        sl->rows_block = -1;
    }
    uint64_t *ok = sl->rows_ok, *move = ok + words, *hit = move + words;
    if (sl->block != (int64_t)bi || sl->rows_block != (int64_t)bi)
        memset(ok, 0, words * sizeof *ok);
    memset(move, 0, 2 * words * sizeof *move);
    for (uint32_t i = 0; i < n; i++)
        move[rows[i] / 64] |= (uint64_t)1 << (rows[i] % 64);
    laden__sched_experts_begin(sc);
    uint64_t asked = 0, moved = 0, cached = 0;
    for (uint32_t k = 0; k < words; k++) {
        asked += (uint64_t)__builtin_popcountll(move[k]);
        for (uint64_t m = move[k]; m; m &= m - 1)
            laden__sched_expert_count(sc, bi,
                                      64 * k + (uint32_t)__builtin_ctzll(m));
        move[k] &= ~ok[k];
        for (uint64_t m = move[k]; m; m &= m - 1) {
            uint32_t e = 64 * k + (uint32_t)__builtin_ctzll(m);
            if (laden__sched_expert_find(sc, bi, e) >= 0)
                hit[k] |= (uint64_t)1 << (e % 64);
        }
        move[k] &= ~hit[k];
        moved += (uint64_t)__builtin_popcountll(move[k]);
        cached += (uint64_t)__builtin_popcountll(hit[k]);
    }
    sl->block = -1; /* until its rows are in */
    sl->rows_block = -1;
    sl->err = LADEN_OK;
    sl->fills = ++sc->run.fill_seq;
    rows_io x = {.b = b, .sl = sl};
    /* Traced (expert blocks are never captured): a miss when any routed
     * expert's rows must come across the link, and their copies as one
     * span on the copy stream, between marks taken before the slot's
     * ready event. */
    bool traced = moved && LADEN__TRACING();
    uint64_t sess = traced ? laden__trace_session() : 0; /* before marks */
    void *m[2] = {NULL, NULL};
    if (traced)
        laden__trace_point(LADEN__EV_MISS, sess, bi, 0, (uintptr_t)sc,
                           bname(sc, bi));
    if (b->tier == LADEN_TIER_RAM) {
        if ((s = laden_dev_stream_wait_event(sc->run.copy, sl->free)) ||
            (s = cache_rows(sc, sl, bi, hit, true)))
            return s;
        if (traced && sc->cuda)
            m[0] = laden__dev_trace_mark(sc->run.copy);
        if ((s = each_row_range(sc, b, move, copy_rows, &x)))
            return s;
        if (m[0])
            m[1] = laden__dev_trace_mark(sc->run.copy);
        if ((s = cache_rows(sc, sl, bi, move, false)) ||
            (s = laden_dev_event_record(sl->ready, sc->run.copy)))
            return s;
        sc->st.h2d_bytes += x.bytes;
    } else {
        x.dst = sc->cuda ? staging_for(sl, b) : (char *)(uintptr_t)sl->ptr;
        if (sc->cuda && (s = laden_dev_event_synchronize(sl->staging_free)))
            return s;
        s = each_row_range(sc, b, move, read_rows, &x);
        for (uint32_t k = 0; k < x.nreqs; k++) /* every read ends first */
            if ((w = laden_io_wait(sc->layout.io, x.reqs[k])) && !s)
                s = w;
        free(x.reqs);
        if (s)
            return s;
        sc->st.read_bytes += x.bytes;
        if (sc->cuda) {
            if ((s = laden_dev_stream_wait_event(sc->run.copy, sl->free)) ||
                (s = cache_rows(sc, sl, bi, hit, true)))
                return s;
            if (traced)
                m[0] = laden__dev_trace_mark(sc->run.copy);
            if ((s = each_row_range(sc, b, move, stage_rows, &x)))
                return s;
            if (m[0])
                m[1] = laden__dev_trace_mark(sc->run.copy);
            if ((s = cache_rows(sc, sl, bi, move, false)) ||
                (s = laden_dev_event_record(sl->ready, sc->run.copy)) ||
                (s = laden_dev_event_record(sl->staging_free, sc->run.copy)))
                return s;
            sc->st.h2d_bytes += x.bytes;
        } else if ((s = cache_rows(sc, sl, bi, hit, true)) ||
                   (s = cache_rows(sc, sl, bi, move, false))) {
            return s; /* the CPU device: read into the slot itself */
        }
    }
    laden__trace_stream(LADEN__EV_H2D, sess, sc->cfg.device, m[0], m[1], bi,
                        x.bytes, (uintptr_t)sc, m[0] ? bname(sc, bi) : NULL);
    for (uint32_t k = 0; k < words; k++)
        ok[k] |= move[k] | hit[k];
    sl->block = bi;
    sl->rows_block = bi;
    sc->st.expert_rows += asked;
    sc->st.expert_rows_moved += moved;
    sc->st.expert_rows_cached += cached;
    return LADEN_OK;
}

/* laden_sched_enter's work; `rows` (n of them, any order) for an expert
 * block, whose slot receives those experts' rows alone. */
static laden_status enter_block(laden_sched_t *sc, uint32_t block,
                                uintptr_t handle, const uint32_t *rows,
                                uint32_t n)
{
    slot *sl;
    if (sc && sc->run.started)
        watch_enter(sc, block);
    laden_status s = block_slot(sc, block, "laden_sched_enter", &sl);
    if (s || (s = laden__sched_ll_damage(sc)))
        return s; /* a damaged blob decoded before: every enter refused */
    if (sl && sc->layout.b[block].experts && !rows)
        return laden__fail(LADEN_E_STATE,
                           "block %u holds experts whose rows stream as the "
                           "router picks them: enter it with "
                           "laden_sched_enter_experts", block);
    if (!sl && !expands_at_enter(sc, &sc->layout.b[block]))
        return LADEN_OK;
    if (sc->capture.on && handle != sc->capture.handle) {
        sc->capture.broken = true;
        return laden__fail(LADEN_E_STATE,
                           "block %u entered on another stream than the "
                           "capture in progress", block);
    }
    if (!sl) /* resident: its compact tensors expand from its region, once
                its bytes are in (a background load may still write it) */
        return (s = laden__sched_until(sc, block))
                   ? s
                   : laden__sched_expand_block(sc, block, handle);
    if (!sc->capture.on && (s = settle(sc)))
        return s;
    blk *b = &sc->layout.b[block];
    if (sl->in_use)
        return laden__fail(LADEN_E_STATE,
                           "block %u entered while block %lld, which shares "
                           "its slot, is still running",
                           block, (long long)sl->block);
    sc->st.enters++;
    if (rows) {
        if ((s = laden__sched_until(sc, block)) ||
            (s = fill_rows(sc, sl, block, rows, n)))
            return s;
    } else if (sl->block != (int64_t)block) {
        sc->st.misses++;
        if (LADEN__TRACING()) {
            uint64_t sess = laden__trace_session(); /* before the name */
            laden__trace_point(LADEN__EV_MISS, sess, block, 0, (uintptr_t)sc,
                               bname(sc, block));
        }
        if ((s = laden__sched_until(sc, block)) ||
            (s = issue_load(sc, sl, block)))
            return s;
    }
    if (sl->reads_pending && (s = finish_reads(sc, sl, false)))
        return s;
    if (sl->err) {
        s = sl->err;
        sl->err = LADEN_OK;
        sl->block = -1; /* the next enter reads again */
        return laden__fail(s, "%s", sl->errmsg);
    }
    if (sc->cuda && (s = laden__sched_compute_stream(sc, handle)))
        return s;
    if (sc->cuda && !sc->capture.on) {
        int cap = 0;
        if ((s = laden_dev_stream_capturing(sc->run.compute, &cap)))
            return s;
        if (cap)
            return laden__fail(
                LADEN_E_STATE,
                "block %u entered on a stream that is capturing a CUDA "
                "graph that laden did not begin: the graph would not hold "
                "the copies into its slot (capture through "
                "laden_sched_capture_begin: OffloadHandle.capture)",
                block);
    }
    /* In a capture, a block already in its slot when it began was put
     * there before it: ordered by the fork (replay_begin at replays). */
    bool traced = LADEN__TRACING() && !sc->capture.on;
    uint64_t sess = traced ? laden__trace_session() : 0; /* before marks */
    void *m0 =
        traced && sc->cuda ? laden__dev_trace_mark(sc->run.compute) : NULL;
    if (sc->cuda && (!sc->capture.on || sl->ready_captured) &&
        (s = laden_dev_stream_wait_event(sc->run.compute, sl->ready)))
        return s;
    sl->trace_mark = NULL;
    if (m0) {
        sl->trace_mark = laden__dev_trace_mark(sc->run.compute);
        sl->trace_mark_session = sess;
        laden__trace_stream(LADEN__EV_STALL, sess, sc->cfg.device, m0,
                            sl->trace_mark, block, LADEN__STALL_COPY,
                            (uintptr_t)sc, bname(sc, block));
    }
    uint64_t t0 = traced ? laden__now_ns() : 0;
    if (!sc->cuda && b->tier == LADEN_TIER_RAM &&
        (s = laden_dev_event_synchronize(sl->ready)))
        return s; /* the CPU device's copy worker */
    if (t0 && !sc->cuda && b->tier == LADEN_TIER_RAM)
        host_stall(sc, t0, block, LADEN__STALL_COPY);
    if ((s = laden__sched_expand_block(sc, block, handle)))
        return s;
    sl->in_use = true;
    note_direction(sc, (uint32_t)b->pos);
    if ((s = prefetch_after(sc, (uint32_t)b->pos)))
        sl->in_use = false; /* not entered: its caller does not run it */
    return s;
}

laden_status laden__sched_enter(laden_sched_t *sc, uint32_t block,
                                uintptr_t handle)
{
    return enter_block(sc, block, handle, NULL, 0);
}

laden_status laden__sched_enter_experts(laden_sched_t *sc, uint32_t block,
                                        const uint32_t *experts, uint32_t n,
                                        uintptr_t handle)
{
    if (!sc || block >= sc->layout.nb || (n && !experts))
        return laden__fail(LADEN_E_INVAL, "laden_sched_enter_experts: bad "
                                          "schedule, block or experts");
    const blk *b = &sc->layout.b[block];
    if (!b->experts)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_enter_experts: block %u holds no "
                           "experts (laden_sched_set_experts)", block);
    for (uint32_t i = 0; i < n; i++)
        if (experts[i] >= b->experts)
            return laden__fail(LADEN_E_INVAL,
                               "laden_sched_enter_experts: expert %u of "
                               "block %u, which has %u", experts[i], block,
                               b->experts);
    static const uint32_t none = 0;
    return enter_block(sc, block, handle, n ? experts : &none, n);
}

laden_status laden__sched_exit(laden_sched_t *sc, uint32_t block,
                               uintptr_t handle)
{
    slot *sl;
    laden_status s = block_slot(sc, block, "laden_sched_exit", &sl);
    /* A resident block may end a pass: relaid, the next pass's first
     * positions are prefetched now (a streamed block's exit does it
     * below, from its new position). */
    if (!s && !sl && watch_exit(sc))
        return prefetch_from(sc, 0, sc->cfg.lookahead);
    if (s || !sl)
        return s;
    blk *b = &sc->layout.b[block];
    if (sc->capture.on && handle != sc->capture.handle) {
        /* The hold ends with this exit (stream.c): the slot too; the
         * capture is refused at its end. */
        if (sl->in_use && sl->block == (int64_t)block)
            sl->in_use = false;
        sc->capture.broken = true;
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_exit: block %u exited on another "
                           "stream than the capture in progress", block);
    }
    if (!sl->in_use || sl->block != (int64_t)block)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_exit: block %u is not running",
                           block);
    sl->in_use = false;
    if (sc->cuda && (s = laden__sched_compute_stream(sc, handle)))
        return s;
    /* A mark of an earlier trace was freed when that trace stopped: the
     * record carries the mark's session, and one of an ended trace is
     * dropped (laden__trace_emit), never read. */
    if (sl->trace_mark && LADEN__TRACING() && !sc->capture.on &&
        sl->trace_mark_session == laden__trace_session())
        laden__trace_stream(LADEN__EV_COMPUTE, sl->trace_mark_session,
                            sc->cfg.device, sl->trace_mark,
                            laden__dev_trace_mark(sc->run.compute), block, 0,
                            (uintptr_t)sc, bname(sc, block));
    sl->trace_mark = NULL;
    if (sc->cuda && (s = laden_dev_event_record(sl->free, sc->run.compute)))
        return s;
    if (sc->capture.on)
        sl->free_captured = true;
    (void)watch_exit(sc); /* may move b: its position is read after */
    /* The slot just freed may be the one a block ahead needs: when the
     * schedule's length is not a multiple of nslots, the first blocks of the
     * next pass share slots with the last of this one. */
    return prefetch_after(sc, (uint32_t)b->pos);
}

laden_status laden__sched_forget_stream(laden_sched_t *sc, uintptr_t handle)
{
    laden_status s = LADEN_OK;
    if (sc->run.compute && sc->run.compute_handle == handle) {
        s = laden_dev_stream_synchronize(sc->run.compute);
        laden_dev_stream_destroy(sc->run.compute);
        sc->run.compute = sc->run.compute_alt;
        sc->run.compute_handle = sc->run.compute_alt_handle;
        sc->run.compute_alt = NULL;
    }
    if (sc->run.compute_alt && sc->run.compute_alt_handle == handle) {
        s = laden_dev_stream_synchronize(sc->run.compute_alt);
        laden_dev_stream_destroy(sc->run.compute_alt);
        sc->run.compute_alt = NULL;
    }
    return s;
}

laden_status laden__sched_synchronize(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_synchronize: NULL");
    for (uint32_t i = 0; i < sc->run.nslots; i++)
        if (sc->run.slots[i].reads_pending)
            finish_reads(sc, &sc->run.slots[i], false);
    laden_status s = sc->run.copy
                         ? laden_dev_stream_synchronize(sc->run.copy)
                         : LADEN_OK;
    return s ? s : laden__sched_ll_damage(sc);
}

laden_status laden__sched_slot_fills(laden_sched_t *sc, uint32_t block,
                                     uint64_t *out)
{
    slot *sl;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_slot_fills: NULL");
    *out = 0;
    laden_status s = block_slot(sc, block, "laden_sched_slot_fills", &sl);
    if (s)
        return s;
    if (!sl)
        return laden__fail(LADEN_E_STATE, "laden_sched_slot_fills: block %u "
                           "is not streamed", block);
    if (sl->block == (int64_t)block)
        *out = sl->fills;
    return LADEN_OK;
}

laden_status laden__sched_refill(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_refill: NULL");
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if (sl->in_use)
            continue;
        if (sl->reads_pending)
            finish_reads(sc, sl, true);
        sl->block = -1;
    }
    return LADEN_OK;
}

/* ---- CUDA graphs of a pass ----------------------------------------------
 *
 * A graph replays the copies it captured, so it is valid only from the slot
 * contents it was captured over.  capture_begin takes them as they are
 * (after an eager pass: the steady state, with the first blocks already
 * prefetched) or, with LADEN_CAPTURE_STANDALONE, as empty (every block the
 * pass reads is copied by the graph, and prefetches stop at the schedule's
 * end).  The capture remembers both the contents it started from and the
 * ones it leaves; replay_begin copies in, eagerly, whatever the slots lack
 * of the former (nothing after the same pass or a replay), and replay_end
 * records the latter.  Copies run on the copy stream, forked from the
 * capturing stream by an event and joined back at capture_end; events
 * recorded before the capture are not waited for inside it (the fork and
 * replay_begin order them).  Disk reads are threads: refused. */

/* The compute stream waits for what the copy stream has enqueued (a
 * capture's copies joined back; eager copies before a replay). */
static laden_status join_copies(laden_sched_t *sc)
{
    laden_status s = laden_dev_event_record(sc->capture.fork, sc->run.copy);
    return s ? s
             : laden_dev_stream_wait_event(sc->run.compute, sc->capture.fork);
}

struct laden_sched_capture {
    const laden_sched_t *sched; /* captured on */
    uint64_t generation; /* the slots it was captured over */
    uint64_t bytes;      /* copied into slots by one replay */
    uint32_t nslots;
    int64_t *start, *end; /* block in each slot before and after (one
                             allocation: end = start + nslots) */
    int64_t end_pos;
    int32_t end_dir;
    bool alone; /* LADEN_CAPTURE_STANDALONE */
};

static laden_status graph_usable(laden_sched_t *sc, const char *call)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    if (sc->load.err)
        return laden__sched_load_failure(sc);
    if (!sc->cuda)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "%s: CUDA graphs need a CUDA device", call);
    if (!sc->run.started)
        return laden__fail(LADEN_E_STATE, "%s: the schedule is not started",
                           call);
    if (!sc->loaded)
        return laden__fail(LADEN_E_STATE,
                           "%s: the model is still loading (wait for it)",
                           call);
    if (sc->cache.on)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "%s: a cached model's blocks move between tiers, "
                           "which a graph cannot follow", call);
    if (sc->layout.any_disk)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "%s: blocks on the disk tier are read by threads, "
                           "which a graph cannot replay; give them RAM "
                           "(ram_budget) or keep them on the device", call);
    for (uint32_t i = 0; i < sc->run.nslots; i++)
        if (sc->run.slots[i].in_use)
            return laden__fail(LADEN_E_STATE, "%s: block %lld is running",
                               call, (long long)sc->run.slots[i].block);
    return LADEN_OK;
}

laden_status laden__sched_capture_begin(laden_sched_t *sc, uintptr_t handle,
                                        uint32_t flags)
{
    const char *call = "laden_sched_capture_begin";
    laden_status s = graph_usable(sc, call);
    if (s)
        return s;
    if (sc->capture.on)
        return laden__fail(LADEN_E_STATE, "%s: a capture is in progress",
                           call);
    if (flags & ~LADEN_CAPTURE_STANDALONE)
        return laden__fail(LADEN_E_INVAL, "%s: unknown flags 0x%x", call,
                           flags);
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (sc->layout.b[i].experts &&
            laden__sched_streamed(sc, &sc->layout.b[i]))
            return laden__fail(LADEN_E_UNSUPPORTED,
                               "%s: block %u streams its experts' rows, "
                               "which the router picks anew at every call: "
                               "a graph would replay one call's copies",
                               call, i);
    int cap = 0;
    if ((s = laden__sched_compute_stream(sc, handle)) ||
        (s = laden_dev_stream_capturing(sc->run.compute, &cap)))
        return s;
    if (!cap)
        return laden__fail(LADEN_E_STATE,
                           "%s: the stream is not capturing (begin the "
                           "capture first)", call);
    if ((s = settle(sc)))
        return s;
    /* Before the copy stream joins the capture: ordered after everything
     * the slots were last used and filled by (events that settle, or a
     * later one, records again on the copy stream keep that order). */
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if ((s = laden_dev_stream_wait_event(sc->run.copy, sl->free)) ||
            (s = laden_dev_stream_wait_event(sc->run.copy, sl->ready)))
            return s;
    }
    bool alone = flags & LADEN_CAPTURE_STANDALONE;
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        sl->at_capture = sl->block;
        sl->fills_at_capture = sl->fills;
        if (alone)
            sl->block = -1;
        sl->free_captured = sl->ready_captured = false;
    }
    if ((s = laden_dev_event_record(sc->capture.fork, sc->run.compute)) ||
        (s = laden_dev_stream_wait_event(sc->run.copy, sc->capture.fork)))
        goto undo;
    bool made = sc->capture.made, learn_off = sc->layout.learn_off;
    sc->capture.on = true;
    sc->capture.made = true; /* the positions stay (learn_order) */
    laden__sched_learn_order(sc, 0);
    sc->capture.broken = false;
    sc->capture.handle = handle;
    sc->capture.alone = alone;
    sc->capture.h2d = 0;
    sc->capture.pos = sc->run.last_pos;
    sc->capture.dir = sc->run.dir;
    if (!alone)
        return LADEN_OK;
    sc->run.dir = 1;
    sc->run.last_pos = -1;
    if (!(s = prefetch_from(sc, 0, sc->run.nslots)))
        return LADEN_OK;
    /* Joined back and as before: the caller ends its capture.  No graph
     * holds the positions: learning is as it was. */
    join_copies(sc);
    sc->capture.on = false;
    sc->capture.made = made;
    sc->layout.learn_off = learn_off;
    sc->capture.events = true;
    sc->run.last_pos = sc->capture.pos;
    sc->run.dir = sc->capture.dir;
undo:
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        sl->block = sl->at_capture;
        sl->fills = sl->fills_at_capture;
    }
    return s;
}

void laden_sched_capture_free(laden_sched_capture_t *c)
{
    if (!c)
        return;
    free(c->start); /* and end: one array */
    free(c);
}

uint64_t laden_sched_capture_bytes(const laden_sched_capture_t *c)
{
    return c ? c->bytes : 0;
}

laden_status laden__sched_capture_end(laden_sched_t *sc, uintptr_t handle,
                                      laden_sched_capture_t **out)
{
    const char *call = "laden_sched_capture_end";
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    if (!sc->capture.on)
        return laden__fail(LADEN_E_STATE, "%s: no capture in progress", call);
    bool running = false;
    for (uint32_t i = 0; i < sc->run.nslots; i++)
        running |= sc->run.slots[i].in_use;
    /* Joined and ended even when a block is still running, so that the
     * capture can be ended; the graph is refused then. */
    laden_status s = laden__sched_compute_stream(sc, handle);
    if (!s)
        s = join_copies(sc);
    laden_sched_capture_t *c = calloc(1, sizeof *c);
    if (c && !(c->start = calloc(2 * (size_t)sc->run.nslots + 1,
                                 sizeof *c->start))) {
        free(c);
        c = NULL;
    }
    if (c) {
        c->end = c->start + sc->run.nslots;
        c->sched = sc;
        c->generation = sc->st.generation;
        c->bytes = sc->capture.h2d;
        c->nslots = sc->run.nslots;
        c->end_pos = sc->run.last_pos;
        c->end_dir = sc->run.dir;
        c->alone = sc->capture.alone;
    }
    /* Nothing ran: the slots hold what they held at capture_begin. */
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if (c) { /* a standalone graph fills every slot itself */
            c->start[i] = c->alone ? -1 : sl->at_capture;
            c->end[i] = sl->block;
        }
        sl->block = sl->at_capture;
        sl->fills = sl->fills_at_capture;
    }
    sc->run.last_pos = sc->capture.pos;
    sc->run.dir = sc->capture.dir;
    sc->capture.on = false;
    sc->capture.events = true;
    if (!s && !c)
        s = laden__fail(LADEN_E_NOMEM, "%s: out of memory", call);
    if (!s && running)
        s = laden__fail(LADEN_E_STATE,
                        "%s: a block entered in the capture has not exited",
                        call);
    if (!s && sc->capture.broken)
        s = laden__fail(LADEN_E_STATE,
                        "%s: an enter or exit on another stream was refused "
                        "during the capture: its graph is not kept", call);
    if (s) {
        laden_sched_capture_free(c);
        return s;
    }
    *out = c;
    return LADEN_OK;
}

static laden_status replay_check(laden_sched_t *sc,
                                 const laden_sched_capture_t *c,
                                 const char *call)
{
    laden_status s = graph_usable(sc, call);
    if (s || (s = laden__sched_ll_damage(sc)))
        return s; /* a replay decodes too: refused as enter is */
    if (!c)
        return laden__fail(LADEN_E_INVAL, "%s: NULL capture", call);
    if (sc->capture.on)
        return laden__fail(LADEN_E_STATE, "%s: a capture is in progress",
                           call);
    if (c->sched != sc)
        return laden__fail(LADEN_E_INVAL,
                           "%s: the graph was captured on another schedule",
                           call);
    if (c->generation != sc->st.generation || c->nslots != sc->run.nslots)
        return laden__fail(LADEN_E_STATE,
                           "%s: the graph was captured over slots that have "
                           "since been replaced (the schedule was stopped "
                           "and started again); capture it again", call);
    return LADEN_OK;
}

laden_status laden__sched_replay_begin(laden_sched_t *sc, uintptr_t handle,
                                       const laden_sched_capture_t *c)
{
    const char *call = "laden_sched_replay_begin";
    laden_status s = replay_check(sc, c, call);
    if (s || (s = settle(sc)) ||
        (s = laden__sched_compute_stream(sc, handle)))
        return s;
    /* What the graph expects in the slots: copied in now where missing. */
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if (c->start[i] >= 0 && sl->block != c->start[i] &&
            (s = issue_load(sc, sl, (uint32_t)c->start[i])))
            return s;
    }
    if ((s = join_copies(sc)))
        return s;
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if ((s = laden_dev_stream_wait_event(sc->run.compute, sl->free)))
            return s;
        sl->block = -1; /* until replay_end: the graph writes it */
    }
    sc->run.last_pos = -1;
    return LADEN_OK;
}

laden_status laden__sched_replay_end(laden_sched_t *sc, uintptr_t handle,
                                     const laden_sched_capture_t *c)
{
    const char *call = "laden_sched_replay_end";
    laden_status s = replay_check(sc, c, call);
    if (s || (s = laden__sched_compute_stream(sc, handle)))
        return s;
    for (uint32_t i = 0; i < sc->run.nslots; i++) {
        slot *sl = &sc->run.slots[i];
        if ((s = laden_dev_event_record(sl->free, sc->run.compute)) ||
            (s = laden_dev_event_record(sl->ready, sc->run.compute)))
            return s;
        /* Standalone graphs may have changed their slots in place after
         * filling them (merged adapters): the slots are taken as empty, so
         * that an eager pass fills them again. */
        sl->block = c->alone ? -1 : c->end[i];
        if (!c->alone)
            sl->fills = ++sc->run.fill_seq;
    }
    sc->run.last_pos = c->alone ? -1 : c->end_pos;
    sc->run.dir = c->alone ? 1 : c->end_dir;
    sc->st.h2d_bytes += c->bytes;
    return LADEN_OK;
}
