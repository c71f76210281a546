/* Loading a schedule: each block laid out, given its memory (the device
 * or a VBAR of a VRAM context, pinned RAM, nothing for the disk tier) and
 * read from the checkpoint once, converted where stored in another dtype. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "stream_internal.h"

/* Starts putting tensor r at `to`, its place in the block: copied or
 * converted now from host memory, or a read submitted (*req), into a
 * buffer of its own (*tmp) when it is converted. */
static laden_status start_tensor(laden_sched_t *sc, const tref *r, char *to,
                                 void **tmp, laden_io_req_t **req)
{
    *req = NULL;
    if (r->host && r->src == r->dst) {
        memcpy(to, r->host, r->src_bytes);
        return LADEN_OK;
    }
    if (r->host)
        return laden_sched_convert(r->src, r->host, r->dst, to, r->nelem);
    if (r->src != r->dst) {
        if (!(*tmp = malloc(r->src_bytes ? r->src_bytes : 1)))
            return laden__fail(LADEN_E_NOMEM,
                               "out of memory converting '%.200s'", r->name);
        to = *tmp;
    }
    return laden_io_submit(sc->io, sc->files[r->file], r->off, r->src_bytes,
                           to, req);
}

/* Converts tensor r, read into tmp, to its place `to`. */
static laden_status finish_tensor(const tref *r, const void *tmp, char *to)
{
    if (!r->rows)
        return laden_sched_convert(r->src, tmp, r->dst, to, r->nelem);
    uint64_t scales = (r->nelem + 15) & ~(uint64_t)15;
    laden__quantize_rows(r->src, tmp, r->rows, r->nelem / r->rows,
                         (uint8_t *)to, (float *)(void *)(to + scales));
    return LADEN_OK;
}

/* Reads block b's tensors into host memory at dst (its packed layout),
 * converting where the stored dtype differs. */
static laden_status read_block_host(laden_sched_t *sc, blk *b, char *dst)
{
    laden_status s = LADEN_OK, w;
    laden_io_req_t **reqs = calloc(b->nt ? b->nt : 1, sizeof *reqs);
    void **tmp = calloc(b->nt ? b->nt : 1, sizeof *tmp);
    if (!reqs || !tmp) {
        free(reqs);
        free(tmp);
        return laden__fail(LADEN_E_NOMEM, "out of memory loading a block");
    }
    uint32_t n = 0;
    for (; n < b->nt; n++)
        if ((s = start_tensor(sc, &b->t[n], dst + b->t[n].dst_off, &tmp[n],
                              &reqs[n])))
            break;
    for (uint32_t i = 0; i < n; i++) {
        if (!reqs[i])
            continue;
        if ((w = laden_io_wait(sc->io, reqs[i])) && !s)
            s = w;
        else if (!w)
            sc->st.load_read_bytes += b->t[i].src_bytes;
    }
    for (uint32_t i = 0; i < b->nt && !s; i++)
        if (tmp[i])
            s = finish_tensor(&b->t[i], tmp[i], dst + b->t[i].dst_off);
    for (uint32_t i = 0; i < b->nt; i++)
        free(tmp[i]);
    free(tmp);
    free(reqs);
    return s;
}

/* Packs each block's tensors (aligned for any kernel), orders the
 * streamed blocks and creates the copy stream and events.  Once. */
static laden_status layout(laden_sched_t *sc)
{
    laden_status s;
    int32_t dev = sc->cfg.device;
    if (sc->laid_out)
        return LADEN_OK;
    for (uint32_t i = 0; i < sc->nb; i++) {
        blk *b = &sc->b[i];
        b->bytes = laden__sched_pack(b, true);
        if (b->nt > sc->max_nt)
            sc->max_nt = b->nt;
        uint64_t *tier_bytes = b->tier == LADEN_TIER_RAM    ? &sc->st.ram_bytes
                               : b->tier == LADEN_TIER_DISK ? &sc->st.disk_bytes
                                                            : &sc->st.gpu_bytes;
        *tier_bytes += b->bytes;
    }
    sc->order = calloc(sc->nb ? sc->nb : 1, sizeof *sc->order);
    if (!sc->order)
        return laden__fail(LADEN_E_NOMEM, "out of memory laying out blocks");
    laden__sched_relayout(sc);
    if ((sc->cuda || sc->cache) &&
        (s = laden_dev_stream_create(dev, &sc->copy)))
        return s;
    if (sc->cache && ((s = laden_dev_event_create(dev, 0, &sc->uploaded)) ||
                      (s = laden_dev_event_create(dev, 0, &sc->last_use))))
        return s;
    sc->laid_out = true;
    return LADEN_OK;
}

/* Cache schedules: block b's host copy, in a mapping of its own. */
static laden_status fill_block(laden_sched_t *sc, uint32_t i)
{
    blk *b = &sc->b[i];
    laden_status s;
    if (b->bytes) {
        b->ram_len = (b->bytes + 4095) & ~(uint64_t)4095;
        void *m = mmap(NULL, (size_t)b->ram_len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
            return laden__fail(LADEN_E_NOMEM,
                               "cannot allocate %s of host memory for block %u",
                               laden__bytes(b->bytes).s, i);
        b->ram = m;
        if ((s = read_block_host(sc, b, b->ram))) {
            munmap(b->ram, b->ram_len);
            b->ram = NULL;
            return s;
        }
    }
    b->filled = true;
    if (++sc->nfilled == sc->nb)
        sc->loaded = true;
    return LADEN_OK;
}

laden_status laden__sched_load_block(laden_sched_t *sc, uint32_t block)
{
    laden_status s;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_load_block: NULL");
    if (!sc->cache)
        return laden__fail(LADEN_E_STATE, "laden_sched_load_block: only for "
                           "schedules created with LADEN_SCHED_CACHE");
    if (sc->broken)
        return laden__fail(LADEN_E_STATE, "the schedule failed to load");
    if (block >= sc->nb)
        return laden__fail(LADEN_E_INVAL, "laden_sched_load_block: no block "
                           "%u (%u blocks)", block, sc->nb);
    if (sc->b[block].filled)
        return laden__fail(LADEN_E_STATE, "block %u is loaded already",
                           block);
    if ((s = layout(sc))) {
        laden__sched_free_all(sc);
        sc->broken = true;
        return s;
    }
    return fill_block(sc, block);
}

/* 1 if block b streams, or may once placed (VRAM tier). */
static bool may_stream(const laden_sched_t *sc, const blk *b)
{
    return b->tier == LADEN_TIER_DISK ||
           ((b->tier == LADEN_TIER_RAM || b->tier == LADEN_TIER_VRAM) &&
            sc->cuda);
}

/* A VRAM-tier block that got no device memory streams from pinned RAM. */
static void demote(laden_sched_t *sc, blk *b)
{
    b->tier = LADEN_TIER_RAM;
    b->region = 0;
    sc->st.gpu_bytes -= b->bytes;
    sc->st.ram_bytes += b->bytes;
    sc->st.offloaded_bytes += b->bytes;
}

/* A VBAR of `total` bytes in vram, and its base address. */
laden_status laden__sched_new_vbar(laden_vram_t *vram, uint64_t total,
                                   laden_vbar_t **out, laden_devptr_t *base)
{
    laden_vbar_info_t vi;
    laden_status s = laden_vbar_create(vram, total ? total : 1, out);
    if (s)
        return s;
    laden_vbar_info(*out, &vi);
    *base = vi.base;
    return LADEN_OK;
}

/* Gives GPU- or VRAM-tier block i its device memory: the next range of
 * the VBAR, or an allocation of its own.  A VRAM-tier block that gets
 * none moves to the RAM tier (*moved); a GPU-tier block that gets none is
 * an error.  In a VBAR the pages stay pinned for the schedule's life:
 * nothing else holds the block's bytes. */
static laden_status place_block(laden_sched_t *sc, uint32_t i, bool *moved)
{
    blk *b = &sc->b[i];
    laden_status s = LADEN_OK;
    int res = 1;
    if (b->bytes && sc->vbar) {
        uint64_t sig;
        laden_vbar_alloc(sc->vbar, b->bytes, &b->voff); /* sized so */
        if ((s = laden_vbar_fault(sc->vbar, b->voff, b->bytes, &res, &sig)))
            return s;
        b->region = res ? sc->vbar_base + b->voff : 0;
    } else if (b->bytes) {
        s = laden_dev_mem_alloc(sc->cfg.device, b->bytes, &b->region);
        res = s == LADEN_OK;
        if (s && s != LADEN_E_DEVICE_NOMEM)
            return s;
    }
    if (!res) {
        if (b->tier == LADEN_TIER_GPU)
            return sc->vbar ? laden__fail(LADEN_E_BUDGET,
                                          "block %u (%s) must be on the "
                                          "device, and the VRAM context has "
                                          "no room for it",
                                          i, laden__bytes(b->bytes).s)
                            : s;
        laden__error_clear();
        demote(sc, b);
        *moved = true;
        return LADEN_OK;
    }
    b->tier = LADEN_TIER_GPU;
    sc->st.device_bytes += b->bytes;
    return LADEN_OK;
}

/* Gives the GPU tier, then the VRAM tier in order, their device memory
 * (place_block): the lower offsets of a VBAR are the more important.  In
 * a VRAM context the slots' room is charged first, for the largest block
 * that may stream, so that a block that does not fit can still stream. */
static laden_status place_device_blocks(laden_sched_t *sc)
{
    laden_status s;
    bool moved = false;
    if (sc->vram) {
        uint64_t total = 0, largest = 0;
        uint32_t nmay = 0;
        for (uint32_t i = 0; i < sc->nb; i++) {
            blk *b = &sc->b[i];
            if (b->tier == LADEN_TIER_GPU || b->tier == LADEN_TIER_VRAM)
                total += (b->bytes + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
            if (may_stream(sc, b)) {
                nmay++;
                if (b->bytes > largest)
                    largest = b->bytes;
            }
        }
        uint32_t nslots = laden_slot_count(nmay, sc->cfg.lookahead);
        if ((s = laden__sched_charge_slots(sc, (uint64_t)nslots * largest)) ||
            (total && (s = laden__sched_new_vbar(sc->vram, total, &sc->vbar,
                                    &sc->vbar_base))))
            return s;
    }
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < sc->nb; i++)
            if (sc->b[i].tier == (pass ? LADEN_TIER_VRAM : LADEN_TIER_GPU) &&
                (s = place_block(sc, i, &moved)))
                return s;
    if (moved)
        laden__sched_relayout(sc);
    if (!sc->nstreamed)
        laden__sched_charge_slots(sc, 0);
    return LADEN_OK;
}

/* LADEN_OK if every block has a tier it can load into.  A planned block
 * is never on disk with a conversion; checked again here all the same. */
static laden_status check_tiers(const laden_sched_t *sc)
{
    laden_status s;
    for (uint32_t i = 0; i < sc->nb; i++) {
        const blk *b = &sc->b[i];
        if (b->tier == LADEN_TIER_AUTO)
            return laden__fail(LADEN_E_STATE,
                               "block %u has no tier yet (LADEN_TIER_AUTO): "
                               "plan it first (laden_sched_plan)",
                               i);
        for (uint32_t k = 0; b->tier == LADEN_TIER_DISK && k < b->nt; k++)
            if ((s = laden__sched_disk_check(&b->t[k]))) {
                laden__error_prefix("block %u", i);
                return s;
            }
    }
    return LADEN_OK;
}

/* The RAM tier, read in place (on the CPU device it runs there). */
static laden_status load_ram_tier(laden_sched_t *sc)
{
    laden_status s;
    for (uint32_t i = 0; i < sc->nb; i++) {
        blk *b = &sc->b[i];
        if (b->tier != LADEN_TIER_RAM || !b->bytes)
            continue;
        if ((s = laden_host_alloc(sc->host, b->bytes, &b->ram)))
            return s;
        if (!sc->cuda)
            b->region = (laden_devptr_t)(uintptr_t)b->ram;
        if ((s = read_block_host(sc, b, b->ram)))
            return s;
    }
    return LADEN_OK;
}

/* The GPU tier, in place on the CPU device; on CUDA through one pinned
 * buffer the size of the largest GPU block, not kept. */
static laden_status load_gpu_tier(laden_sched_t *sc)
{
    laden_status s = LADEN_OK;
    uint64_t max_gpu = 0;
    void *tmp = NULL;
    for (uint32_t i = 0; i < sc->nb; i++)
        if (sc->b[i].tier == LADEN_TIER_GPU && sc->b[i].bytes > max_gpu)
            max_gpu = sc->b[i].bytes;
    for (uint32_t i = 0; i < sc->nb && !s; i++) {
        blk *b = &sc->b[i];
        if (b->tier != LADEN_TIER_GPU || !b->bytes)
            continue;
        if (!sc->cuda) {
            s = read_block_host(sc, b, (char *)(uintptr_t)b->region);
            continue;
        }
        if (!tmp && (s = laden_host_alloc(sc->host, max_gpu, &tmp)))
            break;
        if (!(s = read_block_host(sc, b, tmp)) &&
            !(s = laden_dev_copy_h2d(sc->copy, b->region, tmp, b->bytes)))
            s = laden_dev_stream_synchronize(sc->copy);
    }
    if (tmp)
        laden_host_free(sc->host, tmp);
    laden_host_trim(sc->host);
    return s;
}

laden_status laden__sched_load(laden_sched_t *sc)
{
    laden_status s = LADEN_OK;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_load: NULL schedule");
    if (sc->loaded || sc->broken)
        return laden__fail(LADEN_E_STATE, "the schedule is already loaded");
    if (!sc->laid_out && (s = check_tiers(sc)))
        return s;
    if ((s = layout(sc)))
        goto fail;
    if (sc->cache) {
        for (uint32_t i = 0; i < sc->nb; i++)
            if (!sc->b[i].filled && (s = fill_block(sc, i)))
                goto fail;
        sc->loaded = true;
        return LADEN_OK;
    }
    if ((s = place_device_blocks(sc)) || (s = load_ram_tier(sc)) ||
        (s = load_gpu_tier(sc)))
        goto fail;
    sc->loaded = true;
    return LADEN_OK;
fail:
    laden__sched_free_all(sc);
    sc->broken = true;
    return s;
}
