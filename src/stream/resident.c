/* Cache schedules (LADEN_SCHED_CACHE): each block's host copy in pageable
 * memory of its own, pinned in place on demand, and a device copy per
 * block given and taken away while stopped, in a VBAR of the schedule's
 * VRAM context or allocated.  Also the VRAM context of any schedule. */
#include <stdlib.h>
#include <string.h>

#include "stream_cache.h"
#include "stream_layout.h"
#include "stream_load.h"
#include "stream_run.h"

static laden_status cache_block(laden_sched_t *sc, uint32_t block,
                                const char *call, blk **out)
{
    laden_status s = laden__sched_check_block(sc, block, call);
    if (s)
        return s;
    if (!sc->cache.on)
        return laden__fail(LADEN_E_STATE,
                           "%s: only for schedules created with "
                           "LADEN_SCHED_CACHE",
                           call);
    *out = &sc->layout.b[block];
    return LADEN_OK;
}

/* The device memory lossless blobs cross on their way into a device
 * copy: two buffers of the schedule's largest blob, made at the first
 * upload that needs them and given back at the start or
 * laden_sched_ready (charged to the VRAM context and counted as the
 * schedule's device memory).  The stream and events that decode from
 * them are the load's (load.c's layout). */
static laden_status get_scratch(laden_sched_t *sc)
{
    laden_status s;
    int32_t dev = sc->cfg.device;
    if (sc->cache.scratch[0])
        return LADEN_OK;
    uint64_t n = sc->layout.max_blob;
    if (sc->cache.vram && (s = laden_vram_charge(sc->cache.vram, 2 * n))) {
        laden__error_prefix("the lossless upload buffers (2 x %s)",
                            laden__bytes(n).s);
        return s;
    }
    for (int k = 0; k < 2; k++)
        if ((s = laden_dev_mem_alloc(dev, n, &sc->cache.scratch[k]))) {
            if (k)
                laden_dev_mem_free(dev, sc->cache.scratch[0]);
            sc->cache.scratch[0] = sc->cache.scratch[1] = 0;
            if (sc->cache.vram)
                laden_vram_uncharge(sc->cache.vram, 2 * n);
            laden__error_prefix("the lossless upload buffers (2 x %s)",
                                laden__bytes(n).s);
            return s;
        }
    sc->cache.scratch_bytes = n;
    sc->st.device_bytes += 2 * n;
    return LADEN_OK;
}

/* Block b's lossless tensor r into its place in the device copy: decoded
 * from the host copy on the CPU device; on CUDA copied into the next
 * upload buffer on the copy stream (once the decode that last read it is
 * done) and decoded from there on the decode stream (once the copy is
 * done), so that one blob's copy runs while the one before decodes.
 * Wrong codes set the block's word, as at enter. */
static laden_status upload_coded(laden_sched_t *sc, blk *b, const tref *r)
{
    laden_status s;
    laden_devptr_t bad =
        sc->run.ll_bad
            ? (laden_devptr_t)(uintptr_t)&sc->run.ll_bad[b - sc->layout.b]
            : 0;
    laden_devptr_t at = b->region + r->dev_off;
    if (!sc->cuda) {
        if ((s = laden_lossless_decode(
                 sc->cfg.device, 0, r->ll,
                 (laden_devptr_t)(uintptr_t)b->ram + r->dst_off, at,
                 2 * r->nelem, bad)))
            laden__error_prefix("tensor '%.200s'", r->name ? r->name : "?");
        return s;
    }
    uint32_t k = sc->cache.next;
    sc->cache.next ^= 1u;
    if ((s = laden_dev_stream_wait_event(sc->run.copy,
                                         sc->cache.decoded[k])) ||
        (s = laden_dev_copy_h2d(sc->run.copy, sc->cache.scratch[k],
                                (const char *)b->ram + r->dst_off,
                                r->dst_bytes)) ||
        (s = laden_dev_event_record(sc->cache.copied[k], sc->run.copy)) ||
        (s = laden_dev_stream_wait_event(sc->cache.decode,
                                         sc->cache.copied[k])))
        return s;
    if ((s = laden_lossless_decode(sc->cfg.device,
                                   laden_dev_stream_handle(sc->cache.decode),
                                   r->ll, sc->cache.scratch[k], at,
                                   2 * r->nelem, bad))) {
        laden__error_prefix("tensor '%.200s'", r->name ? r->name : "?");
        return s;
    }
    return laden_dev_event_record(sc->cache.decoded[k], sc->cache.decode);
}

/* sc->cache.uploaded recorded after every upload so far: the copy
 * stream's, and the decodes' where there are any (the decode stream
 * waits for the copy stream's last copy, then records it). */
static laden_status mark_uploaded(laden_sched_t *sc)
{
    laden_status s;
    if (!sc->cache.decode)
        return laden_dev_event_record(sc->cache.uploaded, sc->run.copy);
    if ((s = laden_dev_event_record(sc->cache.copy_end, sc->run.copy)) ||
        (s = laden_dev_stream_wait_event(sc->cache.decode,
                                         sc->cache.copy_end)))
        return s;
    return laden_dev_event_record(sc->cache.uploaded, sc->cache.decode);
}

/* Copies block b's host copy into its device copy on the copy stream: in
 * one piece, or for a block with lossless tensors each run of plain
 * tensors in one piece and each lossless one decoded into place
 * (upload_coded).  mark_uploaded follows it. */
static laden_status upload(laden_sched_t *sc, blk *b)
{
    laden_status s;
    if (!b->has_ll)
        return laden_dev_copy_h2d(sc->run.copy, b->region, b->ram, b->bytes);
    if (sc->cuda && (s = get_scratch(sc)))
        return s;
    for (uint32_t k = 0; k < b->nt;) {
        const tref *r = &b->t[k];
        if (r->ll) {
            if ((s = upload_coded(sc, b, r)))
                return s;
            k++;
            continue;
        }
        /* Plain tensors from k on, while they lie alike in both copies. */
        uint32_t m = k + 1;
        while (m < b->nt && !b->t[m].ll &&
               b->t[m].dst_off - r->dst_off == b->t[m].dev_off - r->dev_off)
            m++;
        const tref *last = &b->t[m - 1];
        uint64_t n = last->dst_off + last->dst_bytes - r->dst_off;
        if (n && (s = laden_dev_copy_h2d(sc->run.copy, b->region + r->dev_off,
                                         (const char *)b->ram + r->dst_off,
                                         n)))
            return s;
        k = m;
    }
    return LADEN_OK;
}

/* Gives b a device copy and starts its upload.  In a VBAR: faults b's
 * range in and copies only if its pages were replaced since it was last
 * written, or LADEN_E_BUDGET if the range is offloaded (the caller
 * streams the block).  Otherwise in `given` (0: allocated here).  A block
 * with lossless tensors holds them decoded (b->dev_bytes). */
static laden_status make_resident(laden_sched_t *sc, blk *b,
                                  laden_devptr_t given)
{
    laden_status s;
    int32_t dev = sc->cfg.device;
    uint64_t n = b->dev_bytes;
    bool copy = n != 0;
    uint64_t sig = 0;
    if (n && sc->cache.vbar) {
        int res;
        if ((s = laden_vbar_fault(sc->cache.vbar, b->voff, n, &res, &sig)))
            return s;
        if (!res)
            return laden__fail(LADEN_E_BUDGET,
                               "block of %s is offloaded: the VRAM budget has "
                               "no room for it (it streams)",
                               laden__bytes(n).s);
        b->region = sc->cache.vbar_base + b->voff;
        copy = sig != b->sig;
    } else if (n && !sc->cuda && !b->has_ll) {
        /* The CPU device runs from host memory: the host copy is where the
         * block runs, as the RAM tier of a streaming schedule is; a second
         * copy would double the model's RAM (offload_pipeline on the CPU
         * kept two).  A caller that writes into it asks for a copy of its
         * own first (laden_sched_own_copy).  A fill all the same: what was
         * written into an earlier copy is gone.  (A block with lossless
         * tensors runs from a decoded copy of its own.) */
        if (given)
            laden_dev_mem_free(dev, given);
        b->region = (laden_devptr_t)(uintptr_t)b->ram;
        b->in_place = true;
        copy = false;
        b->uploads++;
    } else if (n) {
        b->region = given;
        if (!given && (s = laden_dev_mem_alloc(dev, n, &b->region))) {
            b->region = 0;
            return s;
        }
    }
    if (copy && ((s = upload(sc, b)) || (s = mark_uploaded(sc)))) {
        laden__sched_wait_uploads(sc); /* what it queued, before the free */
        if (sc->cache.vbar)
            laden_vbar_unpin(sc->cache.vbar, b->voff, n);
        else if (!given)
            laden_dev_mem_free(dev, b->region);
        b->region = 0;
        if (!sc->st.resident_bytes) /* nothing left to upload into */
            laden__sched_free_scratch(sc);
        return s;
    }
    if (copy) {
        b->sig = sig;
        b->uploads++;
        sc->st.upload_bytes += b->bytes; /* what crossed the link */
        sc->st.h2d_bytes += b->bytes;
    }
    b->resident = true;
    sc->st.resident_bytes += n;
    sc->st.device_bytes += n;
    laden__sched_relayout(sc);
    return LADEN_OK;
}

/* Takes b's device copy away once its last users are done: freed, or
 * handed to the caller in *taken. */
static laden_status unreside(laden_sched_t *sc, blk *b, laden_devptr_t *taken)
{
    laden_status s;
    /* Its last users: the model's work (fence) and the upload. */
    if ((sc->cache.fenced &&
         (s = laden_dev_event_synchronize(sc->cache.last_use))) ||
        (s = laden_dev_event_synchronize(sc->cache.uploaded)))
        return s;
    if (sc->cache.vbar) {
        /* Unpinned, not freed: the pages stay until the budget needs
         * them, and a later fault with the same signature copies nothing. */
        if (b->dev_bytes &&
            (s = laden_vbar_unpin(sc->cache.vbar, b->voff, b->dev_bytes)))
            return s;
        if (taken)
            *taken = 0;
    } else if (b->in_place) {
        if (taken)
            *taken = 0; /* the host copy: nobody else's to write */
    } else if (taken) {
        *taken = b->region;
    } else {
        laden_dev_mem_free(sc->cfg.device, b->region);
    }
    b->in_place = false;
    b->region = 0;
    b->resident = false;
    sc->st.resident_bytes -= b->dev_bytes;
    sc->st.device_bytes -= b->dev_bytes;
    if (!sc->st.resident_bytes) /* no device copy left to upload into */
        laden__sched_free_scratch(sc);
    laden__sched_relayout(sc);
    return LADEN_OK;
}

static laden_status residency_arg(laden_sched_t *sc, uint32_t block,
                                  const char *call, blk **b)
{
    laden_status s = cache_block(sc, block, call, b);
    if (s)
        return s;
    if (sc->run.started)
        return laden__fail(LADEN_E_STATE,
                           "%s: stop the schedule first (its slots are laid "
                           "out for the blocks that stream)",
                           call);
    return LADEN_OK;
}

laden_status laden__sched_set_resident(laden_sched_t *sc, uint32_t block,
                                       int on)
{
    blk *b = NULL;
    laden_status s = cache_block(sc, block, "laden_sched_set_resident", &b);
    if (s || (on != 0) == b->resident)
        return s;
    if ((s = residency_arg(sc, block, "laden_sched_set_resident", &b)))
        return s;
    return on ? make_resident(sc, b, 0) : unreside(sc, b, NULL);
}

laden_status laden__sched_take_resident(laden_sched_t *sc, uint32_t block,
                                        laden_devptr_t *out_ptr,
                                        uint64_t *out_bytes)
{
    blk *b = NULL;
    if (out_ptr)
        *out_ptr = 0;
    if (out_bytes)
        *out_bytes = 0;
    if (!out_ptr || !out_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_sched_take_resident: NULL");
    laden_status s = residency_arg(sc, block, "laden_sched_take_resident",
                                   &b);
    if (s || !b->resident)
        return s;
    uint64_t n = b->dev_bytes;
    if ((s = unreside(sc, b, out_ptr)))
        return s;
    *out_bytes = n;
    return LADEN_OK;
}

laden_status laden__sched_set_resident_at(laden_sched_t *sc, uint32_t block,
                                          laden_devptr_t ptr, uint64_t bytes)
{
    blk *b = NULL;
    laden_status s = residency_arg(sc, block, "laden_sched_set_resident_at",
                                   &b);
    if (s)
        return s;
    if (b->resident || sc->cache.vbar)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_set_resident_at: block %u %s",
                           block, sc->cache.vbar ? "lives in a VBAR"
                                           : "has a device copy already");
    if (bytes != b->dev_bytes || (!ptr && bytes))
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_set_resident_at: block %u needs a "
                           "region of exactly %s, got %s",
                           block, laden__bytes(b->dev_bytes).s,
                           laden__bytes(bytes).s);
    return make_resident(sc, b, ptr);
}

static laden_status vram_arg(laden_sched_t *sc, laden_vram_t *vram)
{
    laden_vram_info_t vi;
    laden_status s;
    if (!vram)
        return LADEN_OK;
    if ((s = laden_vram_info(vram, &vi)))
        return s;
    if (vi.device != sc->cfg.device)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_use_vram: the context is for "
                           "device %d, the schedule for %d",
                           vi.device, sc->cfg.device);
    return LADEN_OK;
}

/* A streaming schedule's context: its blocks are placed at load, and the
 * context's room is an input of the plan. */
static laden_status use_vram_streaming(laden_sched_t *sc, laden_vram_t *vram)
{
    laden_status s;
    if (sc->loaded || sc->broken || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_use_vram: a schedule without "
                           "LADEN_SCHED_CACHE takes its context before "
                           "load");
    if ((s = vram_arg(sc, vram)))
        return s;
    if (sc->cache.vram != vram)
        laden__sched_unplan(sc);
    sc->cache.vram = vram;
    return LADEN_OK;
}

/* A cache schedule's blocks each get a range of a new VBAR in vram. */
static laden_status use_vram_cache(laden_sched_t *sc, laden_vram_t *vram)
{
    laden_status s;
    laden__sched_free_scratch(sc); /* charged to the context it leaves */
    laden_vbar_t *v = NULL;
    laden_devptr_t base = 0;
    if (vram) {
        uint64_t total = 0;
        for (uint32_t i = 0; i < sc->layout.nb; i++)
            total += (sc->layout.b[i].dev_bytes + ALIGN - 1) &
                     ~(uint64_t)(ALIGN - 1);
        if ((s = laden__sched_new_vbar(vram, total, &v, &base)))
            return s;
        for (uint32_t i = 0; i < sc->layout.nb; i++) {
            laden_vbar_alloc(v, sc->layout.b[i].dev_bytes,
                             &sc->layout.b[i].voff); /* sized so */
            sc->layout.b[i].sig = 0;
        }
    }
    laden_vbar_destroy(sc->cache.vbar);
    sc->cache.vbar = v;
    sc->cache.vram = vram;
    sc->cache.vbar_base = base;
    return LADEN_OK;
}

laden_status laden__sched_use_vram(laden_sched_t *sc, laden_vram_t *vram)
{
    laden_status s;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_use_vram: NULL");
    if (!sc->cache.on)
        return use_vram_streaming(sc, vram);
    if (!sc->loaded)
        return laden__fail(LADEN_E_STATE, "laden_sched_use_vram: a cache "
                           "schedule takes its context once loaded");
    if (sc->run.started || sc->st.resident_bytes)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_use_vram: the schedule holds device "
                           "memory; give it all back first");
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (sc->layout.b[i].resident)
            return laden__fail(LADEN_E_STATE,
                               "laden_sched_use_vram: block %u is resident",
                               i);
    if ((s = vram_arg(sc, vram)))
        return s;
    return use_vram_cache(sc, vram);
}

uint64_t laden__sched_block_upload_bytes(const laden_sched_t *sc,
                                         uint32_t block)
{
    if (!sc || block >= sc->layout.nb || !sc->cache.on || !sc->cuda ||
        !sc->layout.laid_out)
        return 0;
    return sc->layout.b[block].has_ll ? 2 * sc->layout.max_blob : 0;
}

laden_status laden__sched_reserve_vram(laden_sched_t *sc,
                                       const uint8_t *want, uint32_t n)
{
    laden_status s;
    if (!sc || (!want && n))
        return laden__fail(LADEN_E_INVAL, "laden_sched_reserve_vram: NULL");
    if (!sc->cache.on || !sc->cache.vbar)
        return LADEN_OK; /* nothing is faulted: nothing to prepare */
    if (n != sc->layout.nb)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_reserve_vram: %u flags for %u "
                           "blocks",
                           n, sc->layout.nb);
    laden_vbar_info_t vi;
    laden_vram_info_t ci;
    if ((s = laden_vbar_info(sc->cache.vbar, &vi)) ||
        (s = laden_vram_info(sc->cache.vram, &ci)))
        return s;
    if (!ci.budget_bytes)
        return LADEN_OK;
    uint64_t page = ci.page_bytes;
    uint32_t np = (uint32_t)((vi.size_bytes + page - 1) / page), got = 0;
    uint8_t *state = malloc(np ? np : 1);
    if (!state)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    if ((s = laden_vbar_residency(sc->cache.vbar, state, np, &got))) {
        free(state);
        return s;
    }
    /* The pages the wanted blocks lack, each counted once (the blocks'
     * ranges ascend). */
    uint64_t need = 0;
    int64_t last = -1;
    uint64_t up = 0; /* the upload buffers are charged too, once made */
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        if (!want[i] || b->resident || !b->dev_bytes)
            continue;
        uint64_t u = sc->cache.scratch[0]
                         ? 0
                         : laden__sched_block_upload_bytes(sc, i);
        up = u > up ? u : up;
        int64_t p0 = (int64_t)(b->voff / page);
        int64_t p1 = (int64_t)((b->voff + b->dev_bytes - 1) / page);
        for (int64_t p = p0 > last ? p0 : last + 1; p <= p1 && p < got; p++)
            if (!state[p])
                need += page;
        if (p1 > last)
            last = p1;
    }
    free(state);
    need += up;
    return need ? laden_vram_make_room(sc->cache.vram, need) : LADEN_OK;
}

laden_status laden__sched_pin(laden_sched_t *sc, uint32_t block, int on)
{
    blk *b = NULL;
    laden_status s = cache_block(sc, block, "laden_sched_pin", &b);
    if (s)
        return s;
    if ((on != 0) == b->pinned || !b->ram)
        return LADEN_OK;
    if (on) {
        s = laden_dev_host_register(sc->cfg.device,
                                    laden__sched_home_base(b), b->ram_len);
    } else {
        /* Copies from it may be in flight (uploads, slots). */
        if ((s = laden_dev_stream_synchronize(sc->run.copy)))
            return s;
        s = laden_dev_host_unregister(sc->cfg.device,
                                      laden__sched_home_base(b));
    }
    if (s)
        return s;
    b->pinned = on != 0;
    if (on)
        sc->st.registered_bytes += b->bytes;
    else
        sc->st.registered_bytes -= b->bytes;
    return LADEN_OK;
}

/* LADEN_OK for a loaded cache schedule, else the error naming `call`. */
static laden_status loaded_cache(laden_sched_t *sc, const char *call)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    if (!sc->cache.on || !sc->loaded)
        return laden__fail(LADEN_E_STATE, "%s: not a loaded cache schedule",
                           call);
    return LADEN_OK;
}

laden_status laden__sched_ready(laden_sched_t *sc, uintptr_t handle)
{
    laden_status s = loaded_cache(sc, "laden_sched_ready");
    if (s)
        return s;
    if (!sc->cuda)
        return laden_dev_event_synchronize(sc->cache.uploaded);
    /* The lossless upload buffers go once the uploads are done, so that
     * the use's device memory is its device copies and slots alone (kept,
     * they counted against the budget and made the next switch evict a
     * block more); then the decodes' words are final. */
    laden__sched_free_scratch(sc);
    if ((s = laden__sched_ll_damage(sc)))
        return s; /* a device copy decoded from a damaged blob */
    if ((s = laden__sched_compute_stream(sc, handle)))
        return s;
    return laden_dev_stream_wait_event(sc->run.compute, sc->cache.uploaded);
}

laden_status laden__sched_fence(laden_sched_t *sc, uintptr_t handle)
{
    laden_status s = loaded_cache(sc, "laden_sched_fence");
    if (s)
        return s;
    if (!sc->cuda)
        return LADEN_OK; /* the CPU's work is done when it returns */
    if ((s = laden__sched_compute_stream(sc, handle)) ||
        (s = laden_dev_event_record(sc->cache.last_use, sc->run.compute)))
        return s;
    sc->cache.fenced = true;
    return LADEN_OK;
}

laden_status laden__sched_copy_fills(laden_sched_t *sc, uint32_t block,
                                     uint64_t *out)
{
    blk *b = NULL;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_copy_fills: NULL");
    *out = 0;
    laden_status s = cache_block(sc, block, "laden_sched_copy_fills", &b);
    if (s)
        return s;
    if (b->resident)
        *out = b->uploads;
    return LADEN_OK;
}

laden_status laden__sched_own_copy(laden_sched_t *sc, uint32_t block,
                                   int *out_made)
{
    blk *b = NULL;
    *out_made = 0;
    laden_status s = cache_block(sc, block, "laden_sched_own_copy", &b);
    if (s)
        return s;
    if (!b->resident)
        return laden__fail(LADEN_E_STATE, "laden_sched_own_copy: block %u "
                           "has no device copy", block);
    if (!b->in_place)
        return LADEN_OK;
    laden_devptr_t r = 0;
    if ((sc->cache.fenced &&
         (s = laden_dev_event_synchronize(sc->cache.last_use))) ||
        (s = laden_dev_mem_alloc(sc->cfg.device, b->bytes, &r)))
        return s;
    memcpy((void *)(uintptr_t)r, b->ram, b->bytes); /* the CPU device */
    b->region = r;
    b->in_place = false;
    b->uploads++;
    sc->st.upload_bytes += b->bytes;
    laden__sched_relayout(sc); /* an address changed: a new generation */
    *out_made = 1;
    return LADEN_OK;
}

laden_status laden__sched_reupload(laden_sched_t *sc, uint32_t block)
{
    blk *b = NULL;
    laden_status s = cache_block(sc, block, "laden_sched_reupload", &b);
    if (s)
        return s;
    if (!b->resident)
        return laden__fail(LADEN_E_STATE, "laden_sched_reupload: block %u "
                           "has no device copy", block);
    if (b->in_place)
        return LADEN_OK; /* the host copy itself: the base already */
    /* The model's earlier work may still read the copy. */
    if ((sc->cache.fenced &&
         (s = laden_dev_event_synchronize(sc->cache.last_use))) ||
        (b->bytes && ((s = upload(sc, b)) || (s = mark_uploaded(sc)) ||
                      (s = laden_dev_event_synchronize(sc->cache.uploaded))))) {
        /* What the upload queued before it failed is done before the
         * copy can be taken away (uploaded does not cover it). */
        laden__sched_wait_uploads(sc);
        laden__sched_free_scratch(sc);
        return s;
    }
    laden__sched_free_scratch(sc); /* used by this upload alone */
    b->uploads++;
    sc->st.upload_bytes += b->bytes;
    sc->st.h2d_bytes += b->bytes;
    return LADEN_OK;
}

laden_status laden__sched_reupload_tensor(laden_sched_t *sc, uint32_t block,
                                          uint32_t i, uintptr_t handle)
{
    blk *b = NULL;
    laden_status s = cache_block(sc, block, "laden_sched_reupload_tensor",
                                 &b);
    if (s)
        return s;
    if (i >= b->nt)
        return laden__fail(LADEN_E_INVAL, "laden_sched_reupload_tensor: "
                           "block %u has %u tensors, not %u", block, b->nt,
                           i + 1);
    if (!b->resident)
        return laden__fail(LADEN_E_STATE, "laden_sched_reupload_tensor: "
                           "block %u has no device copy", block);
    const tref *r = &b->t[i];
    if (b->in_place || !r->dst_bytes)
        return LADEN_OK; /* runs from the host copy itself */
    if (r->ll)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "laden_sched_reupload_tensor: tensor '%.200s' is "
                           "kept lossless: its host copy is its blob, which "
                           "nothing steps",
                           r->name ? r->name : "?");
    laden_devptr_t to = b->region + r->dev_off;
    const char *from = (const char *)b->ram + r->dst_off;
    if (!sc->cuda) {
        /* The CPU's work is done when its calls return. */
        if ((s = laden_dev_copy_h2d(sc->run.copy, to, from, r->dst_bytes)) ||
            (s = laden_dev_stream_synchronize(sc->run.copy)))
            return s;
    } else {
        /* After the work on the compute stream so far (it may still read
         * the old bytes), before what it is given next. */
        if ((s = laden__sched_compute_stream(sc, handle)) ||
            (s = laden_dev_event_record(sc->cache.last_use,
                                        sc->run.compute)) ||
            (s = laden_dev_stream_wait_event(sc->run.copy,
                                             sc->cache.last_use)) ||
            (s = laden_dev_copy_h2d(sc->run.copy, to, from, r->dst_bytes)) ||
            (s = mark_uploaded(sc)) || /* the decodes queued too */
            (s = laden_dev_stream_wait_event(sc->run.compute,
                                             sc->cache.uploaded)))
            return s;
    }
    sc->st.upload_bytes += r->dst_bytes;
    sc->st.h2d_bytes += r->dst_bytes;
    return LADEN_OK;
}
