/* The expansion workspace: where a block's compact tensors (fp8 codes,
 * GGUF blocks, bf16 kept for a float32 model) are expanded to their
 * compute dtype before the block runs.  Blocks run one at a time on one
 * compute stream, so one workspace serves them all: as large as the block
 * whose expanded tensors need the most bytes.  Its offsets are fixed as
 * tensors are marked (before the load), so the plan counts its size; the
 * memory is made with the slots (run.c's start) inside the schedule's
 * VRAM context and freed with them. */
#include "stream_run.h"
#include "stream_layout.h"

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

laden_status laden__sched_set_expanded(laden_sched_t *sc, uint32_t block,
                                       uint32_t i, laden_dtype compute)
{
    if (block >= sc->layout.nb || i >= sc->layout.b[block].nt)
        return laden__fail(LADEN_E_INVAL, "laden_sched_set_expanded: bad "
                                          "block or tensor");
    uint32_t bits = laden_dtype_bits(compute);
    if (!bits || bits % 8)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_set_expanded: dtype %d has no whole "
                           "bytes per element", (int)compute);
    blk *b = &sc->layout.b[block];
    tref *r = &b->t[i];
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_set_expanded: after load");
    if (r->expands)
        return laden__fail(LADEN_E_STATE,
                           "tensor '%.200s': already marked expanded",
                           r->name ? r->name : "?");
    /* nelem * bits / 8 cannot overflow: the tensor's own bytes fit. */
    uint64_t n = aligned(r->nelem * (bits / 8));
    if (b->ws_bytes > UINT64_MAX - n)
        return laden__fail(LADEN_E_INVAL, "tensor '%.200s': the workspace "
                           "would overflow", r->name ? r->name : "?");
    r->expands = true;
    r->expanded = compute;
    r->ws_off = b->ws_bytes;
    b->ws_bytes += n;
    return LADEN_OK;
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
    if (!sc->run.started || !sc->run.workspace)
        return laden__fail(LADEN_E_STATE, "laden_sched_expanded_at: the "
                                          "schedule is not started");
    const tref *r = &sc->layout.b[block].t[i];
    *ptr = sc->run.workspace + r->ws_off;
    *bytes = r->nelem * (laden_dtype_bits(r->expanded) / 8);
    return LADEN_OK;
}
