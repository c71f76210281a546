/* The expansion workspace: where a block's compact tensors (fp8 codes,
 * GGUF blocks, bf16 kept for a float32 model) are expanded to their
 * compute dtype before the block runs.  Blocks run one at a time on one
 * compute stream, so one workspace serves them all: as large as the block
 * whose expanded tensors need the most bytes.  Its offsets are fixed as
 * tensors are marked (before the load), so the plan counts its size; the
 * memory is made with the slots (run.c's start) inside the schedule's
 * VRAM context and freed with them; run.c's enter expands into it.  Calls
 * only convert.c's dtype facts in src/stream (parts.c and build.c call
 * it). */
#include "stream_run.h"
#include "stream_layout.h"
#include "stream_convert.h"

#include "laden/expand.h"

static uint64_t aligned(uint64_t n)
{
    return (n + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
}

uint64_t laden__sched_workspace_bytes(const laden_sched_t *sc)
{
    uint64_t most = 0;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (sc->layout.b[i].ws_bytes > most)
            most = sc->layout.b[i].ws_bytes;
    return most;
}

/* How many float32 scales tensor r's kind wants; 0 if cols does not fit. */
static uint64_t scales_wanted(const tref *r, laden_scale_kind kind,
                              uint64_t cols)
{
    if (kind == LADEN_SCALE_TENSOR)
        return 1;
    if (!cols || r->nelem % cols)
        return 0;
    uint64_t rows = r->nelem / cols;
    if (kind == LADEN_SCALE_ROW)
        return rows;
    return (rows / 128 + (rows % 128 != 0)) * (cols / 128 + (cols % 128 != 0));
}

/* LADEN_OK if tensor r of block b can take `scale` as `kind`. */
static laden_status check_scale(const blk *b, uint32_t i, uint64_t cols,
                                uint32_t scale, laden_scale_kind kind)
{
    const tref *r = &b->t[i];
    const char *name = r->name ? r->name : "?";
    if (kind == LADEN_SCALE_NONE && scale == LADEN_SCHED_NO_SCALE)
        return LADEN_OK;
    if (r->rows)
        return laden__fail(LADEN_E_INVAL, "tensor '%.200s': quantized on "
                           "load, it carries its own scales", name);
    if (!laden__fp8(r->dst) || (unsigned)kind > LADEN_SCALE_TILE128 ||
        kind == LADEN_SCALE_NONE || scale >= b->nt || scale == i)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s': scale %u of kind %d (an fp8 "
                           "tensor's scale is another tensor of its block, "
                           "added before it is marked)",
                           name, scale, (int)kind);
    const tref *sr = &b->t[scale];
    uint64_t want = scales_wanted(r, kind, cols);
    if (!laden__convertible(sr->dst) || !want || sr->nelem != want)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s': its scale has %llu %s values; "
                           "kind %d with %llu columns wants %llu float ones",
                           name, (unsigned long long)sr->nelem,
                           laden_dtype_name(sr->dst) ? laden_dtype_name(sr->dst)
                                                     : "?",
                           (int)kind, (unsigned long long)cols,
                           (unsigned long long)want);
    return LADEN_OK;
}

/* Reserves n bytes of block b's workspace; *off where they start. */
static laden_status reserve(blk *b, const tref *r, uint64_t n, uint64_t *off)
{
    n = aligned(n);
    if (b->ws_bytes > UINT64_MAX - n)
        return laden__fail(LADEN_E_INVAL, "tensor '%.200s': the workspace "
                           "would overflow", r->name ? r->name : "?");
    *off = b->ws_bytes;
    b->ws_bytes += n;
    return LADEN_OK;
}

laden_status laden__sched_set_expanded(laden_sched_t *sc, uint32_t block,
                                       uint32_t i, laden_dtype compute,
                                       uint64_t cols, uint32_t scale,
                                       laden_scale_kind kind)
{
    if (block >= sc->layout.nb || i >= sc->layout.b[block].nt)
        return laden__fail(LADEN_E_INVAL, "laden_sched_set_expanded: bad "
                                          "block or tensor");
    blk *b = &sc->layout.b[block];
    tref *r = &b->t[i];
    const char *name = r->name ? r->name : "?";
    if (!laden__convertible(compute))
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s': expanded to dtype %d; laden "
                           "expands to F32, F16 or BF16", name, (int)compute);
    if (!laden__convertible(r->dst) && !laden__fp8(r->dst) && laden_dtype_bits(r->dst))
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s': stored as %s, which laden does "
                           "not expand", name,
                           laden_dtype_name(r->dst) ? laden_dtype_name(r->dst)
                                                    : "?");
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_set_expanded: after load");
    if (r->expands)
        return laden__fail(LADEN_E_STATE,
                           "tensor '%.200s': already marked expanded", name);
    if (b->experts)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' is in an expert block, whose "
                           "rows move as stored", name);
    if (r->joined || (i + 1 < b->nt && b->t[i + 1].joined))
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' is joined to another "
                           "(laden_sched_join_tensor) and cannot be stored "
                           "compact", name);
    laden_status s = check_scale(b, i, cols, scale, kind);
    uint64_t before = b->ws_bytes, off = 0, soff = 0;
    /* nelem * 4 cannot overflow: the tensor's own bytes fit. */
    if (s || (s = reserve(b, r, r->nelem * (laden_dtype_bits(compute) / 8),
                          &off)))
        return s;
    if (scale != LADEN_SCHED_NO_SCALE && b->t[scale].dst != LADEN_DTYPE_F32 &&
        (s = reserve(b, r, b->t[scale].nelem * 4, &soff))) {
        b->ws_bytes = before;
        return s;
    }
    r->expands = true;
    r->expanded = compute;
    r->ws_off = off;
    r->scale = scale;
    r->scale_kind = kind;
    r->cols = r->rows ? r->nelem / r->rows : cols;
    r->sws_off = soff;
    return LADEN_OK;
}

laden_status laden__sched_can_expand(laden_sched_t *sc)
{
    if (!laden__sched_workspace_bytes(sc))
        return LADEN_OK;
    laden_status s = laden_expand_ready(sc->cfg.device);
    if (s)
        laden__error_prefix("compact tensors expand when their block runs");
    return s;
}

laden_status laden__sched_expanded_at(laden_sched_t *sc, uint32_t block,
                                      uint32_t i, laden_devptr_t *ptr,
                                      uint64_t *bytes)
{
    if (block >= sc->layout.nb || i >= sc->layout.b[block].nt ||
        !sc->layout.b[block].t[i].expands)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_expanded_at: bad block or tensor, "
                           "or a tensor not expanded");
    const tref *r = &sc->layout.b[block].t[i];
    if (r->ll && laden__sched_decoded_copy(sc, &sc->layout.b[block]))
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_expanded_at: block %u has a device "
                           "copy, which holds tensor '%.200s' decoded (its "
                           "address is laden_sched_tensor_ptr's)",
                           block, r->name ? r->name : "?");
    if (!sc->run.started || !sc->run.workspace)
        return laden__fail(LADEN_E_STATE, "laden_sched_expanded_at: the "
                                          "schedule is not started");
    *ptr = sc->run.workspace + r->ws_off;
    *bytes = r->nelem * (laden_dtype_bits(r->expanded) / 8);
    return LADEN_OK;
}
