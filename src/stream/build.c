/* A schedule's description: created, described (blocks and their
 * tensors), planned (each AUTO block's tier), and freed at the end of
 * destroy (laden__sched_free_description).  The layout that follows from
 * it (the streamed blocks' positions, the slots' size and charge, the
 * trace's names) is parts.c's, for the files above that use it.  Calls
 * only convert.c of the layer: share.c, the load, the run and stream.c
 * build on it. */
#define _POSIX_C_SOURCE 200809L /* strdup */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "stream_layout.h"
#include "stream_convert.h"

laden_status laden_sched_create(const laden_sched_config *cfg,
                                const laden_st_t *st, laden_sched_t **out)
{
    laden_status s;
    laden_dev_info_t info;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_create: out is NULL");
    *out = NULL;
    if (!cfg)
        return laden__fail(LADEN_E_INVAL, "laden_sched_create: NULL config");
    if ((s = laden_dev_info(cfg->device, &info)))
        return s;
    laden_sched_t *sc = calloc(1, sizeof *sc);
    if (!sc)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a schedule");
    sc->cfg = *cfg;
    if (sc->cfg.lookahead == 0)
        sc->cfg.lookahead = LADEN_LOOKAHEAD_DEFAULT;
    if (sc->cfg.lookahead > LADEN_LOOKAHEAD_MAX) {
        free(sc);
        return laden__fail(LADEN_E_INVAL, "lookahead %u: at most %u",
                           cfg->lookahead, LADEN_LOOKAHEAD_MAX);
    }
    sc->cuda = info.kind == LADEN_DEV_KIND_CUDA;
    sc->cache.on = (cfg->flags & LADEN_SCHED_CACHE) != 0;
    if (cfg->flags & ~LADEN_SCHED_CACHE) {
        free(sc);
        return laden__fail(LADEN_E_INVAL, "unknown schedule flags 0x%x",
                           cfg->flags);
    }
    pthread_mutex_init(&sc->hold.mu, NULL);
    pthread_cond_init(&sc->hold.cv, NULL);
    sc->layout.io = cfg->io;
    if (!sc->layout.io) {
        if ((s = laden_io_create(NULL, &sc->layout.io)))
            goto fail;
        sc->layout.own_io = true;
    }
    sc->layout.nfiles = st ? (uint32_t)laden_st_file_count(st) : 0;
    sc->layout.files = calloc(sc->layout.nfiles ? sc->layout.nfiles : 1,
                              sizeof *sc->layout.files);
    if (!sc->layout.files) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory creating a schedule");
        goto fail;
    }
    for (uint32_t i = 0; i < sc->layout.nfiles; i++)
        if ((s = laden_st_file_open(st, i, &sc->layout.files[i])))
            goto fail;
    if ((s = laden_host_create(cfg->device, cfg->ram_budget_bytes,
                               &sc->layout.host)))
        goto fail;
    *out = sc;
    return LADEN_OK;
fail:
    /* Nothing was loaded: the description is all there is to free. */
    laden__sched_free_description(sc);
    return s;
}

/* The description and the schedule itself (destroy's last step, load.c's
 * laden__sched_destroy, after what the load made). */
void laden__sched_free_description(laden_sched_t *sc)
{
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        for (uint32_t k = 0; k < sc->layout.b[i].nt; k++) {
            tref *r = &sc->layout.b[i].t[k];
            free((char *)r->name);
            if (r->host_owned)
                free((void *)r->host);
            free(r->ll);
        }
        free(sc->layout.b[i].t);
        free(sc->layout.b[i].name);
    }
    free(sc->layout.b);
    laden__sched_llc_free(sc);
    for (uint32_t i = 0; i < sc->layout.nfiles && sc->layout.files; i++)
        laden_io_file_close(sc->layout.files[i]);
    free(sc->layout.files);
    free(sc->share.key);
    laden_host_destroy(sc->layout.host);
    if (sc->layout.own_io)
        laden_io_destroy(sc->layout.io);
    pthread_cond_destroy(&sc->hold.cv);
    pthread_mutex_destroy(&sc->hold.mu);
    free(sc);
}

/* LADEN_OK if tensor r can stream from disk: the disk tier reads the file
 * as it is, so neither a conversion nor host memory can be there. */
laden_status laden__sched_disk_check(const tref *r)
{
    if (laden__sched_as_stored(r))
        return LADEN_OK;
    if (r->host)
        return laden__fail(LADEN_E_INVAL,
                           "a tensor from host memory cannot be on the disk "
                           "tier");
    if (r->pieces)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' is a part of the checkpoint's "
                           "tensor in %llu ranges and cannot be on the disk "
                           "tier, which reads one range per tensor; put its "
                           "block in RAM",
                           r->name, (unsigned long long)r->pieces);
    if (r->rope_heads)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' has its rows reordered on load "
                           "and cannot be on the disk tier, which reads the "
                           "file as it is; put its block in RAM",
                           r->name);
    return laden__fail(LADEN_E_INVAL,
                       "tensor '%.200s' is %s in the checkpoint and cannot "
                       "be stored as %s on the disk tier, which reads the "
                       "file as it is; put its block in RAM or keep its "
                       "dtype",
                       r->name, laden_dtype_name(r->src),
                       laden_dtype_name(r->dst));
}

/* An input of the plan changed: the blocks the planner placed are its
 * again (a plan of another description could break the budgets). */
void laden__sched_unplan(laden_sched_t *sc)
{
    /* Only after a plan: every block and tensor added calls this, and a
     * pass over the blocks each time made describing n blocks O(n^2)
     * (laden plan on a GGUF table of 131072 tensors: 140 s). */
    if (!sc->layout.planned)
        return;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (sc->layout.b[i].asked == LADEN_TIER_AUTO)
            sc->layout.b[i].tier = LADEN_TIER_AUTO;
    sc->layout.planned = false;
    sc->layout.vram_spare = 0;
    sc->layout.ram_estimated = false; /* the room checked was that plan's */
    sc->layout.ram_room = 0;
}

static laden_status grow_block(blk *b)
{
    if (b->nt < b->cap)
        return LADEN_OK;
    uint32_t n = b->cap ? b->cap * 2 : 8;
    tref *r = realloc(b->t, n * sizeof *r);
    if (!r)
        return laden__fail(LADEN_E_NOMEM, "out of memory adding a tensor");
    b->t = r;
    b->cap = n;
    return LADEN_OK;
}

/* Appends tensor r (its name borrowed, copied here) to block `block`,
 * placed after the block's last tensor at the next multiple of ALIGN (for
 * any kernel): the one rule for a block's layout, so that b->bytes is its
 * size before load (planning) as at load. */
static laden_status push_tensor(laden_sched_t *sc, uint32_t block,
                                const tref *r, uint32_t *out)
{
    blk *b = &sc->layout.b[block];
    laden_status s;
    uint64_t at, end;
    if (b->asked == LADEN_TIER_DISK && (s = laden__sched_disk_check(r)))
        return s;
    if (!laden__add_u64(b->bytes, ALIGN - 1, &at) ||
        !laden__add_u64(at & ~(uint64_t)(ALIGN - 1), r->dst_bytes, &end))
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s': block %u's size overflows",
                           r->name, block);
    if ((s = grow_block(b)))
        return s;
    tref *t = &b->t[b->nt];
    *t = *r;
    t->dst_off = at & ~(uint64_t)(ALIGN - 1);
    if (!(t->name = strdup(r->name)))
        return laden__fail(LADEN_E_NOMEM, "out of memory adding a tensor");
    *out = b->nt++;
    b->bytes = end;
    laden__sched_unplan(sc);
    return LADEN_OK;
}

laden_status laden__sched_add_block(laden_sched_t *sc, laden_tier tier,
                                    uint32_t *out)
{
    if (out)
        *out = 0;
    if (!sc || !out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_add_block: NULL");
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE, "blocks cannot be added after load");
    if (tier < LADEN_TIER_AUTO || tier > LADEN_TIER_VRAM)
        return laden__fail(LADEN_E_INVAL, "unknown tier %d", (int)tier);
    if (sc->cache.on && tier != LADEN_TIER_RAM)
        return laden__fail(LADEN_E_INVAL,
                           "a cache schedule keeps every block on the RAM "
                           "tier (residency is set after load)");
    if (sc->layout.nb == sc->layout.bcap) {
        uint32_t n = sc->layout.bcap ? sc->layout.bcap * 2 : 16;
        blk *b = realloc(sc->layout.b, n * sizeof *b);
        if (!b)
            return laden__fail(LADEN_E_NOMEM, "out of memory adding a block");
        sc->layout.b = b;
        sc->layout.bcap = n;
    }
    laden__sched_unplan(sc);
    blk *b = &sc->layout.b[sc->layout.nb];
    memset(b, 0, sizeof *b);
    b->tier = b->asked = tier;
    b->pos = -1;
    *out = sc->layout.nb++;
    return LADEN_OK;
}

/* Checkpoint tensor t stored as dtype: its reference, or why not. */
static laden_status tensor_ref(const laden_st_tensor_t *t, laden_dtype dtype,
                               tref *r)
{
    uint64_t nelem = 1;
    for (uint32_t d = 0; d < t->ndim; d++)
        nelem *= t->shape[d]; /* validated by st: cannot overflow */
    bool quantize =
        dtype == LADEN_DTYPE_F8_E4M3 && laden__convertible(t->dtype);
    if (quantize && t->ndim < 1)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': fp8 storage needs at least one "
                           "dimension (one scale per row)",
                           t->name);
    if (dtype != t->dtype && !quantize &&
        (!laden__decodable(t->dtype) || !laden__convertible(dtype)))
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': cannot store %s as %s (F32, "
                           "F16 and BF16 convert)",
                           t->name, laden_dtype_name(t->dtype),
                           laden_dtype_name(dtype) ? laden_dtype_name(dtype)
                                                   : "?");
    memset(r, 0, sizeof *r);
    r->file = t->file_index;
    r->off = t->offset_bytes;
    r->src_bytes = t->size_bytes;
    r->src = t->dtype;
    r->dst = dtype;
    r->nelem = nelem;
    r->nrows = t->ndim ? t->shape[0] : 1;
    r->dst_bytes = dtype == t->dtype ? t->size_bytes
                                     : nelem * (laden_dtype_bits(dtype) / 8);
    if (quantize) {
        /* e4m3 data, then one float32 scale per row, 16-byte aligned. */
        r->rows = t->shape[0];
        r->dst_bytes = laden__sched_scale_offset(nelem) + 4 * r->rows;
    }
    r->name = t->name;
    return LADEN_OK;
}

laden_status laden__sched_rope_rows(laden_sched_t *sc, uint32_t block,
                                    uint32_t index, uint64_t heads)
{
    if (!sc || block >= sc->layout.nb || index >= sc->layout.b[block].nt)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_set_rope_rows: bad schedule, block "
                           "or tensor");
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_set_rope_rows: after load");
    tref *r = &sc->layout.b[block].t[index];
    if (heads && (r->joined || (index + 1 < sc->layout.b[block].nt &&
                                sc->layout.b[block].t[index + 1].joined)))
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': a joined tensor cannot have its "
                           "rows reordered on load", r->name);
    if (r->part && heads)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': a part of a tensor cannot have "
                           "its rows reordered on load", r->name);
    if (r->host || r->rows)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': rope rows are put back only for "
                           "checkpoint tensors kept in their dtype or "
                           "converted to F32/F16/BF16",
                           r->name);
    if (!heads || r->nrows % heads || (r->nrows / heads) % 2 ||
        r->src_bytes % r->nrows)
        return laden__fail(LADEN_E_SHAPE,
                           "tensor '%.200s': %llu rows are not %llu heads of "
                           "an even number of rows",
                           r->name, (unsigned long long)r->nrows,
                           (unsigned long long)heads);
    r->rope_heads = heads;
    /* The tier asked, as push_tensor checks: a planned one is planned
     * again (laden__sched_unplan below; the planner keeps such blocks off
     * the disk). */
    laden_status s = sc->layout.b[block].asked == LADEN_TIER_DISK
                         ? laden__sched_disk_check(r)
                         : LADEN_OK;
    if (s) {
        r->rope_heads = 0;
        return s;
    }
    laden__sched_unplan(sc);
    return LADEN_OK;
}

/* Why tensor r cannot be a part of a joined run (NULL: it can). */
static const char *unjoinable(const tref *r)
{
    uint32_t elems = 1, bytes = 1;
    if (r->host)
        return "it is from host memory";
    if (r->rows || r->expands)
        return "it is stored compact (expanded where it runs)";
    if (r->rope_heads)
        return "its rows are reordered on load";
    if (!laden_dtype_bits(r->dst) || laden_dtype_bits(r->dst) % 8 ||
        (laden_dtype_block(r->dst, &elems, &bytes) == LADEN_OK && elems > 1))
        return "its dtype is not whole bytes per element";
    return NULL;
}

laden_status laden__sched_join_tensor(laden_sched_t *sc, uint32_t block,
                                      uint32_t index)
{
    if (!sc || block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_join_tensor: bad schedule or block");
    blk *b = &sc->layout.b[block];
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_join_tensor: after load");
    if (index == 0 || index >= b->nt || index + 1 != b->nt)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_join_tensor: tensor %u of block %u "
                           "(it has %u): join the block's last tensor, not "
                           "its first", index, block, b->nt);
    tref *prev = &b->t[index - 1], *r = &b->t[index];
    const char *why = unjoinable(r);
    const tref *bad = r;
    if (!why) {
        why = unjoinable(prev);
        bad = prev;
    }
    if (why)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' cannot be joined to another: %s",
                           bad->name ? bad->name : "?", why);
    if (r->joined)
        return laden__fail(LADEN_E_STATE, "tensor '%.200s': joined already",
                           r->name ? r->name : "?");
    if (prev->dst != r->dst)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' (%s) cannot be joined to "
                           "'%.200s' (%s): one tensor has one dtype",
                           r->name ? r->name : "?",
                           laden_dtype_name(r->dst),
                           prev->name ? prev->name : "?",
                           laden_dtype_name(prev->dst));
    /* It is the last tensor: moving it down to the end of the one before
     * changes nothing else in the block. */
    r->dst_off = prev->dst_off + prev->dst_bytes;
    b->bytes = r->dst_off + r->dst_bytes;
    r->joined = true;
    laden__sched_unplan(sc);
    return LADEN_OK;
}

laden_status laden__sched_set_experts(laden_sched_t *sc, uint32_t block,
                                      uint32_t experts)
{
    if (!sc || block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_set_experts: bad schedule or block");
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_set_experts: after load");
    if (sc->cache.on)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "laden_sched_set_experts: a cache schedule moves "
                           "whole blocks");
    blk *b = &sc->layout.b[block];
    if (!experts || !b->nt)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_set_experts: block %u: %u experts "
                           "of %u tensors", block, experts, b->nt);
    for (uint32_t k = 0; k < b->nt;) {
        uint64_t bytes;
        uint32_t run = laden__sched_run_of(b, k, &bytes);
        const tref *r = &b->t[k];
        const char *name = r->name ? r->name : "?";
        for (uint32_t j = k; j < k + run; j++)
            if (b->t[j].expands || b->t[j].rows)
                return laden__fail(LADEN_E_INVAL,
                                   "tensor '%.200s' of expert block %u is "
                                   "stored compact: experts move as stored",
                                   name, block);
        if (bytes % experts)
            return laden__fail(LADEN_E_INVAL,
                               "tensor '%.200s': %llu bytes are not %u equal "
                               "rows, one per expert",
                               name, (unsigned long long)bytes, experts);
        k += run;
    }
    b->experts = experts;
    laden__sched_unplan(sc);
    return LADEN_OK;
}

uint32_t laden__sched_run_of(const blk *b, uint32_t i, uint64_t *bytes)
{
    uint32_t n = 1;
    uint64_t sum = b->t[i].dst_bytes;
    while (i + n < b->nt && b->t[i + n].joined)
        sum += b->t[i + n++].dst_bytes;
    if (bytes)
        *bytes = sum;
    return n;
}

/* Checkpoint tensor st_index, checked to be addable to `block` (the
 * first steps of both ways to add one; `call` names the caller). */
static laden_status checkpoint_tensor(laden_sched_t *sc, uint32_t block,
                                      const laden_st_t *st, size_t st_index,
                                      const char *call, laden_st_tensor_t *t)
{
    laden_status s;
    if (!sc || !st || block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL, "%s: bad schedule or block", call);
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "tensors cannot be added after load");
    if ((s = laden_st_tensor_at(st, st_index, t)))
        return s;
    if (t->file_index >= sc->layout.nfiles)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' is from another checkpoint",
                           t->name);
    return LADEN_OK;
}

laden_status laden__sched_add_tensor(laden_sched_t *sc, uint32_t block,
                                     const laden_st_t *st, size_t st_index,
                                     laden_dtype dtype, uint32_t *out)
{
    laden_st_tensor_t t;
    laden_status s;
    tref r;
    if (out)
        *out = 0;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_add_tensor: NULL");
    if ((s = checkpoint_tensor(sc, block, st, st_index,
                               "laden_sched_add_tensor", &t)) ||
        (s = tensor_ref(&t, dtype, &r)))
        return s;
    return push_tensor(sc, block, &r, out);
}

laden_status laden__sched_add_tensor_part(laden_sched_t *sc, uint32_t block,
                                          const laden_st_t *st,
                                          size_t st_index, laden_dtype dtype,
                                          uint32_t dim, uint64_t start,
                                          uint64_t count, uint32_t *out)
{
    laden_st_tensor_t t;
    laden_status s;
    tref r;
    uint64_t shape[LADEN_ST_MAX_RANK];
    if (out)
        *out = 0;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_sched_add_tensor_part: NULL");
    if ((s = checkpoint_tensor(sc, block, st, st_index,
                               "laden_sched_add_tensor_part", &t)))
        return s;
    uint32_t bits = laden_dtype_bits(t.dtype);
    if (dim >= t.ndim || !bits || bits % 8) /* block types: 0 bits */
        return laden__fail(
            LADEN_E_INVAL,
            "tensor '%.200s': no part along dimension %u of a "
            "%u-dimensional %s tensor",
            t.name, dim, t.ndim,
            laden_dtype_name(t.dtype) ? laden_dtype_name(t.dtype) : "?");
    if (start > t.shape[dim] || count > t.shape[dim] - start)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s': part [%llu, %llu) of dimension "
                           "%u, which has %llu",
                           t.name, (unsigned long long)start,
                           (unsigned long long)(start + count), dim,
                           (unsigned long long)t.shape[dim]);
    /* inner: the bytes of one index of `dim`; outer: how many ranges
     * (the product of the dimensions before it). */
    uint64_t inner = bits / 8, outer = 1, full = t.shape[dim];
    for (uint32_t d = 0; d < t.ndim; d++) {
        shape[d] = d == dim ? count : t.shape[d];
        if (d > dim)
            inner *= t.shape[d];
        else if (d < dim)
            outer *= t.shape[d];
    }
    t.shape = shape;
    t.offset_bytes += start * inner;
    t.size_bytes = outer * count * inner;
    if ((s = tensor_ref(&t, dtype, &r)))
        return s;
    r.part = true;
    if (outer > 1 && count && count < full) {
        r.pieces = outer;
        r.stride = full * inner;
    }
    return push_tensor(sc, block, &r, out);
}

laden_status laden__sched_add_host_tensor(laden_sched_t *sc, uint32_t block,
                                          const void *src, laden_dtype sdt,
                                          uint64_t n, laden_dtype dtype,
                                          uint32_t *out)
{
    uint64_t bits, dbits;
    if (out)
        *out = 0;
    if (!sc || !out || block >= sc->layout.nb || (!src && n))
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_add_host_tensor: bad argument");
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "tensors cannot be added after load");
    if (!laden_dtype_bits(sdt) || !laden_dtype_bits(dtype) ||
        (sdt != dtype &&
         (!laden__convertible(sdt) || !laden__convertible(dtype))))
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "cannot store %s as %s (F32, F16 and BF16 convert)",
                           laden_dtype_name(sdt) ? laden_dtype_name(sdt) : "?",
                           laden_dtype_name(dtype) ? laden_dtype_name(dtype)
                                                   : "?");
    if (!laden__mul_u64(n, laden_dtype_bits(sdt), &bits) || bits % 8 ||
        !laden__mul_u64(n, laden_dtype_bits(dtype), &dbits))
        return laden__fail(LADEN_E_INVAL, "bad element count %llu",
                           (unsigned long long)n);
    tref r = {.host = src, .src_bytes = bits / 8, .src = sdt, .dst = dtype,
              .nelem = n, .dst_bytes = dbits / 8, .name = "<host tensor>"};
    return push_tensor(sc, block, &r, out);
}

/* ---- planning ----------------------------------------------------------- */

/* The planner's inputs for the schedule's blocks, in one allocation. */
typedef struct plan_arrays {
    uint64_t *bytes, *ram; /* ram: on the RAM tier (ram_bytes) */
    bool smaller;          /* some block is smaller there */
    int32_t *asked, *tiers, *why;
    uint8_t *flags;
} plan_arrays;

/* 1 if block b cannot stream from disk (LADEN_PLAN_BLOCK_NO_DISK). */
static bool no_disk(const blk *b)
{
    for (uint32_t k = 0; k < b->nt; k++)
        if (!laden__sched_as_stored(&b->t[k]))
            return true;
    return false;
}

/* The tier the planner is asked for block b.  A VRAM-tier block is asked
 * resident: it was chosen for the device, and is counted there (the
 * budget it is planned in is the one it should fit; the VRAM context
 * decides at load, and the slots are charged for it in case it streams). */
static int32_t asked_of(const blk *b)
{
    switch (b->asked) {
    case LADEN_TIER_AUTO:
        return LADEN_PLAN_FREE;
    case LADEN_TIER_VRAM:
        return LADEN_TIER_GPU;
    default:
        return b->asked;
    }
}

/* Block `block`'s bytes on the RAM tier: its tensors marked lossless
 * (compress.c) at their estimated coded sizes, laid out as compress.c's
 * pack will lay them. */
static uint64_t ram_bytes(const laden_sched_t *sc, uint32_t block)
{
    const blk *b = &sc->layout.b[block];
    uint64_t end = 0;
    for (uint32_t k = 0; k < b->nt; k++) {
        const tref *r = &b->t[k];
        end = laden__sched_place(r, end) +
              (r->ll_asked && !r->ll && r->ll_est ? r->ll_est
                                                  : r->dst_bytes);
    }
    return end;
}

uint64_t laden__sched_block_ram_bytes(const laden_sched_t *sc,
                                      uint32_t block)
{
    if (!sc || block >= sc->layout.nb)
        return 0;
    return sc->layout.laid_out ? sc->layout.b[block].bytes
                               : ram_bytes(sc, block);
}

static laden_status plan_arrays_new(const laden_sched_t *sc, plan_arrays *a)
{
    size_t n = sc->layout.nb ? sc->layout.nb : 1;
    a->bytes = calloc(2 * n, sizeof *a->bytes);
    a->asked = calloc(3 * n, sizeof *a->asked);
    a->flags = calloc(n, sizeof *a->flags);
    if (!a->bytes || !a->asked || !a->flags)
        return laden__fail(LADEN_E_NOMEM, "out of memory planning");
    a->ram = a->bytes + n;
    a->tiers = a->asked + n;
    a->why = a->tiers + n;
    a->smaller = false;
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        a->bytes[i] = b->bytes;
        a->ram[i] = ram_bytes(sc, i);
        a->smaller |= a->ram[i] != b->bytes;
        a->asked[i] = asked_of(b);
        a->flags[i] = (no_disk(b) ? LADEN_PLAN_BLOCK_NO_DISK : 0) |
                      (b->experts ? LADEN_PLAN_BLOCK_EXPERTS : 0);
    }
    return LADEN_OK;
}

static void plan_arrays_free(plan_arrays *a)
{
    free(a->bytes);
    free(a->asked);
    free(a->flags);
}

/* Caps in->vram_free_bytes at the room of the schedule's VRAM context, if
 * it has a budget: what the other users of the budget have not pinned or
 * charged.  *room gets it (UINT64_MAX: no cap). */
static laden_status cap_vram(laden_sched_t *sc, laden_plan_input *in,
                             uint64_t *room)
{
    laden_vram_info_t vi;
    laden_status s;
    *room = UINT64_MAX;
    if (!sc->cache.vram)
        return LADEN_OK;
    if ((s = laden_vram_info(sc->cache.vram, &vi)))
        return s;
    if (!vi.budget_bytes)
        return LADEN_OK;
    uint64_t used = vi.pinned_bytes + vi.charged_bytes;
    *room = vi.budget_bytes > used ? vi.budget_bytes - used : 0;
    if (in->vram_free_bytes > *room)
        in->vram_free_bytes = *room;
    return LADEN_OK;
}

/* Each AUTO block takes its planned tier: on the device in the VRAM
 * context (if it has room at load) when it has one. */
static void apply_plan(laden_sched_t *sc, const plan_arrays *a, int32_t *why)
{
    sc->layout.planned = true;
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        if (b->asked == LADEN_TIER_AUTO)
            b->tier = a->tiers[i] == LADEN_TIER_GPU && sc->cache.vram
                          ? LADEN_TIER_VRAM
                          : (laden_tier)a->tiers[i];
        if (why)
            why[i] = a->why[i];
    }
}

static laden_status plan_arg(laden_sched_t *sc, const laden_plan_input *in)
{
    if (!sc || !in)
        return laden__fail(LADEN_E_INVAL, "laden_sched_plan: NULL");
    if (sc->cache.on)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_plan: a cache schedule's residency is "
                           "decided by its cache, not planned");
    if (sc->loaded || sc->layout.laid_out || sc->broken)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_plan: the schedule is loaded; plan "
                           "before load");
    if (in->lookahead > LADEN_LOOKAHEAD_MAX)
        return laden__fail(LADEN_E_INVAL, "lookahead %u: at most %u",
                           in->lookahead, LADEN_LOOKAHEAD_MAX);
    return LADEN_OK;
}

laden_status laden__sched_plan(laden_sched_t *sc,
                               const laden_plan_input *budgets, int32_t *why,
                               laden_plan_result *out)
{
    laden_plan_result res;
    plan_arrays a = {0};
    uint64_t room;
    laden_status s = plan_arg(sc, budgets);
    if (!out)
        out = &res;
    memset(out, 0, sizeof *out);
    if (s)
        return s;
    laden_plan_input in = *budgets;
    if ((s = plan_arrays_new(sc, &a)) || (s = cap_vram(sc, &in, &room)))
        goto done;
    in.nblocks = sc->layout.nb;
    in.block_bytes = a.bytes;
    in.asked = a.asked;
    in.block_flags = a.flags;
    in.ram_block_bytes = a.smaller ? a.ram : NULL;
    in.slot_block_bytes = NULL; /* the blocks' own: as stored */
    in.rest_bytes = laden__sched_workspace_bytes(sc); /* always there */
    if (!in.lookahead)
        in.lookahead = sc->cfg.lookahead;
    in.disk_staging = sc->cuda && budgets->disk_staging;
    in.host_device = !sc->cuda;
    s = laden_plan_compute(&in, a.tiers, a.why, out);
    if (s == LADEN_E_BUDGET && room != UINT64_MAX)
        laden__error_prefix("the VRAM context has room for %s",
                            laden__bytes(room).s);
    if (!s) {
        apply_plan(sc, &a, why);
        /* What the plan leaves of the device memory it had: the expert
         * cache's when no size is given (experts.c). */
        sc->layout.vram_spare =
            sc->cuda && out->vram_avail_bytes > out->vram_used_bytes
                ? out->vram_avail_bytes - out->vram_used_bytes
                : 0;
        sc->layout.ram_estimated = a.smaller;
        sc->layout.ram_room = out->ram_avail_bytes > out->staging_bytes
                                  ? out->ram_avail_bytes - out->staging_bytes
                                  : 0;
    }
done:
    plan_arrays_free(&a);
    return s;
}

/* ---- pieces and storage dtypes ------------------------------------------ */

laden_status laden_sched_pieces(const uint64_t *bytes, uint32_t n,
                                uint64_t max_bytes, uint32_t *piece_of,
                                uint32_t *npieces)
{
    if (npieces)
        *npieces = 0;
    if (!npieces || (n && (!bytes || !piece_of)))
        return laden__fail(LADEN_E_INVAL, "laden_sched_pieces: NULL");
    if (!max_bytes)
        max_bytes = LADEN_SCHED_PIECE_BYTES;
    uint32_t piece = 0;
    uint64_t size = 0;
    for (uint32_t k = 0; k < n; k++) {
        /* A piece that holds something and would pass the bound (or
         * overflow) is closed: the next starts with this tensor. */
        if (k && (size > UINT64_MAX - bytes[k] ||
                  size + bytes[k] > max_bytes)) {
            piece++;
            size = 0;
        }
        piece_of[k] = piece;
        size += bytes[k];
    }
    *npieces = n ? piece + 1 : 0;
    return LADEN_OK;
}

static bool floating(laden_dtype d)
{
    switch (d) {
    case LADEN_DTYPE_F8_E5M2: case LADEN_DTYPE_F8_E4M3:
    case LADEN_DTYPE_F8_E8M0: case LADEN_DTYPE_F8_E4M3FNUZ:
    case LADEN_DTYPE_F8_E5M2FNUZ: case LADEN_DTYPE_F16: case LADEN_DTYPE_BF16:
    case LADEN_DTYPE_F32: case LADEN_DTYPE_F64: case LADEN_DTYPE_F4:
    case LADEN_DTYPE_F6_E2M3: case LADEN_DTYPE_F6_E3M2:
        return true;
    default:
        return false;
    }
}

laden_status laden_sched_storage_for(laden_dtype src, laden_dtype want,
                                     uint32_t ndim, uint64_t nelem,
                                     uint32_t flags, uint32_t *store)
{
    if (store)
        *store = LADEN_STORE_PLAIN;
    if (!store)
        return laden__fail(LADEN_E_INVAL, "laden_sched_storage_for: NULL");
    if ((unsigned)src >= LADEN_DTYPE_COUNT)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_storage_for: unknown dtype %d",
                           (int)src);
    bool known = (unsigned)want < LADEN_DTYPE_COUNT;
    bool want_float = known && floating(want);
    bool compact = flags & LADEN_STORE_COMPACT;
    bool in_block = flags & LADEN_STORE_IN_BLOCK;
    uint32_t kind = LADEN_STORE_PLAIN;
    if ((src == LADEN_DTYPE_F8_E4M3 || src == LADEN_DTYPE_F8_E5M2) &&
        want_float && laden_dtype_bits(want) > 8) {
        /* Kept as fp8 only where a block's hook expands it; elsewhere
         * decoded on load, which a scale tensor cannot follow. */
        if (compact && in_block)
            kind = LADEN_STORE_CHECKPOINT_FP8;
        else if (compact && (flags & LADEN_STORE_SCALED))
            return laden__fail(LADEN_E_UNSUPPORTED,
                               "fp8 with a scale tensor outside the streamed "
                               "blocks is not supported; offload the module "
                               "that holds it");
    } else if (laden_dtype_bits(src) == 0) { /* a GGUF block type */
        if (!want_float)
            return laden__fail(LADEN_E_UNSUPPORTED,
                               "GGUF block quantized, it expands only to a "
                               "floating dtype");
        if (compact && in_block && (flags & LADEN_STORE_EXPANDS_BLOCKS))
            kind = LADEN_STORE_BLOCKS;
    } else if (src != want &&
               !(laden__convertible(src) && known &&
                 laden__convertible(want))) {
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "laden converts only between F32, F16 and BF16");
    }
    if (kind == LADEN_STORE_PLAIN && in_block && want_float) {
        if ((flags & LADEN_STORE_ASK_FP8) && (flags & LADEN_STORE_PARAM) &&
            ndim == 2 && nelem >= LADEN_STORE_FP8_MIN_ELEMENTS)
            kind = LADEN_STORE_FP8;
        else if ((flags & LADEN_STORE_ASK_BF16) && want != LADEN_DTYPE_BF16)
            kind = LADEN_STORE_BF16;
    }
    *store = kind;
    return LADEN_OK;
}
