/* Loading a schedule: each block laid out, given its memory (the device
 * or a VBAR of a VRAM context, pinned RAM, nothing for the disk tier) and
 * read from the checkpoint once, converted where stored in another dtype;
 * freeing what the load made, and destroy's work (laden__sched_destroy,
 * for stream.c's laden_sched_destroy and the loader's own thread).
 * Calls parts.c (positions, slot charge, free_slots, pin_home, the
 * loader thread), build.c, share.c and convert.c: run.c, resident.c and
 * stream.c are above it. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "stream_load.h"
#include "stream_convert.h"
#include "stream_hold.h"
#include "stream_layout.h"
#include "stream_run.h"
#include "../host/pool.h"
#include "stream_share.h"

/* A tensor being put in its place: its read (or NULL: done already),
 * and for a tensor stored in another dtype the buffer it is read into. */
typedef struct tread {
    const tref *r;
    laden_io_req_t *req;
    laden_io_req_t **reqs; /* a part of several ranges: one read each, in */
    uint64_t nreqs;        /* flight until wait_tread */
    void *tmp;
    char *to;
    bool read;       /* a part of several ranges read already (read_pieces) */
    bool copy;       /* req is a copy from host memory, not a read */
    uint64_t cached; /* of its bytes, from the page cache */
} tread;

/* Waits for c's reads (its request, or a part's several) and frees
 * them; *done (the tensor's bytes are in) and *cached (of them, from
 * the page cache) on success. */
static laden_status wait_tread(laden_sched_t *sc, tread *c, bool *done,
                               uint64_t *cached)
{
    laden_status s = LADEN_OK, w;
    uint64_t got = 0, sum = 0;
    *done = false;
    *cached = 0;
    if (c->req) {
        s = laden_io_wait_cached(sc->layout.io, c->req, &got);
        c->req = NULL;
        sum = got;
    } else if (c->reqs) {
        for (uint64_t i = 0; i < c->nreqs; i++)
            if ((w = laden_io_wait_cached(sc->layout.io, c->reqs[i], &got))) {
                if (!s)
                    s = w;
            } else {
                sum += got;
            }
        free(c->reqs);
        c->reqs = NULL;
        c->nreqs = 0;
    } else {
        return LADEN_OK;
    }
    if (!s) {
        *done = true;
        *cached = sum;
    }
    return s;
}

/* Converts tensor c->r, read into c->tmp, to its place: on the reader
 * thread that read its last chunk (laden_io_submit_then), so that
 * conversions run in parallel with each other and with later reads. */
static laden_status convert_then(void *arg)
{
    const tread *c = arg;
    const tref *r = c->r;
    if (r->rope_heads) {
        uint64_t rb = r->src_bytes / r->nrows;
        if (r->src == r->dst) {
            laden__unrope_rows(c->tmp, c->to, r->nrows, rb, r->rope_heads);
            return LADEN_OK;
        }
        void *t2 = malloc(r->src_bytes ? r->src_bytes : 1);
        if (!t2)
            return laden__fail(LADEN_E_NOMEM,
                               "out of memory converting '%.200s'", r->name);
        laden__unrope_rows(c->tmp, t2, r->nrows, rb, r->rope_heads);
        laden_status s =
            laden_sched_convert(r->src, t2, r->dst, c->to, r->nelem);
        free(t2);
        return s;
    }
    if (!r->rows)
        return laden_sched_convert(r->src, c->tmp, r->dst, c->to, r->nelem);
    uint64_t scales = laden__sched_scale_offset(r->nelem);
    laden__quantize_rows(r->src, c->tmp, r->rows, r->nelem / r->rows,
                         (uint8_t *)c->to,
                         (float *)(void *)(c->to + scales));
    return LADEN_OK;
}

/* Submits the reads of part r of a checkpoint tensor that is several
 * ranges (r->pieces) into dst, packed: all its ranges in flight at once,
 * kept in c until wait_tread (so the loader goes on starting reads
 * meanwhile).  On failure the reads submitted are waited for here. */
static laden_status submit_pieces(laden_sched_t *sc, const tref *r,
                                  char *dst, tread *c)
{
    uint64_t each = r->src_bytes / r->pieces;
    if (!(c->reqs = calloc(r->pieces, sizeof *c->reqs)))
        return laden__fail(LADEN_E_NOMEM, "out of memory reading '%.200s'",
                           r->name);
    laden_status s = LADEN_OK;
    for (uint64_t n = 0; n < r->pieces && !s; n++)
        if (!(s = laden_io_submit(sc->layout.io, laden__sched_file(sc, r),
                                  r->off + n * r->stride, each,
                                  dst + n * each, &c->reqs[c->nreqs])))
            c->nreqs++;
    if (s) {
        bool done;
        uint64_t cached;
        wait_tread(sc, c, &done, &cached);
    }
    return s;
}

/* The same, waiting for the reads (the part is converted next). */
static laden_status read_pieces(laden_sched_t *sc, const tref *r, char *dst,
                                tread *c)
{
    laden_status s = submit_pieces(sc, r, dst, c);
    if (s)
        return s;
    bool done;
    s = wait_tread(sc, c, &done, &c->cached);
    c->read = done; /* counted by the caller, as a request's bytes are */
    return s;
}

/* Host tensors from this size up are copied by the reader pool's threads
 * (laden_io_submit_copy): compression="lossless" hands the load gigabytes
 * of blobs, which one thread copied at a third of the drive's rate. */
#define COPY_ON_POOL (4ull << 20)

/* Starts putting tensor r at `to`, its place in the block: copied or
 * converted now from host memory, or a read submitted (c->req), into a
 * buffer of its own (c->tmp) and converted by the reader when it is
 * stored in another dtype. */
static laden_status start_tensor(laden_sched_t *sc, const tref *r, char *to,
                                 tread *c)
{
    laden_io_req_t **req = &c->req;
    if (r->in_home) /* encoded there (compress.c's settle_block) */
        return LADEN_OK;
    if (r->host && r->src == r->dst && r->src_bytes >= COPY_ON_POOL) {
        c->copy = true; /* a blob: many, large, on the pool's threads */
        return laden_io_submit_copy(sc->layout.io, r->host, r->src_bytes, to,
                                    req);
    }
    if (r->host && r->src == r->dst) {
        memcpy(to, r->host, r->src_bytes);
        return LADEN_OK;
    }
    if (r->host)
        return laden_sched_convert(r->src, r->host, r->dst, to, r->nelem);
    if (laden__sched_as_stored(r))
        return laden_io_submit(sc->layout.io, laden__sched_file(sc, r),
                               r->off, r->src_bytes, to, req);
    if (r->pieces && r->src == r->dst && !r->rope_heads)
        return submit_pieces(sc, r, to, c);
    if (!(c->tmp = malloc(r->src_bytes ? r->src_bytes : 1)))
        return laden__fail(LADEN_E_NOMEM, "out of memory converting '%.200s'",
                           r->name);
    c->r = r;
    c->to = to;
    if (r->pieces) { /* read, then converted here */
        laden_status s = read_pieces(sc, r, c->tmp, c);
        return s ? s : convert_then(c);
    }
    return laden_io_submit_then(sc->layout.io, laden__sched_file(sc, r),
                                r->off, r->src_bytes, c->tmp, convert_then, c,
                                req);
}

/* A piece of a block whose reads are in flight: tensors t0 and after,
 * whose packed bytes start at offset `base` of the block and land at
 * dst. */
typedef struct inflight {
    blk *b;
    char *dst;
    uint32_t t0;
    uint64_t base, bytes;
    tread *tr;
    uint32_t n; /* tensors started, from t0 */
    int staging; /* CUDA GPU tier: the staging buffer it is read into */
} inflight;

static char *tensor_dst(const inflight *f, uint32_t k)
{
    return f->dst + (f->b->t[k].dst_off - f->base);
}

/* Starts reading tensors [t0, t1) of block b into host memory at dst:
 * the reads go to the reader pool, which works on them while the caller
 * starts more.  finish_piece waits for them. */
static laden_status start_piece(laden_sched_t *sc, blk *b, uint32_t t0,
                                uint32_t t1, char *dst, inflight *f)
{
    laden_status s = LADEN_OK;
    uint32_t n = t1 - t0;
    *f = (inflight){.b = b, .dst = dst, .t0 = t0, .staging = -1};
    if (n) {
        f->base = b->t[t0].dst_off;
        f->bytes = b->t[t1 - 1].dst_off + b->t[t1 - 1].dst_bytes - f->base;
    }
    if (!(f->tr = calloc(n ? n : 1, sizeof *f->tr)))
        s = laden__fail(LADEN_E_NOMEM, "out of memory loading a block");
    for (; !s && f->n < n; f->n++)
        s = start_tensor(sc, &b->t[t0 + f->n], tensor_dst(f, t0 + f->n),
                         &f->tr[f->n]);
    return s;
}

/* Waits for piece f's reads and conversions (all of them, also after a
 * failure: their buffers are freed here). */
static laden_status finish_piece(laden_sched_t *sc, inflight *f,
                                 laden_status s)
{
    laden_status w;
    uint64_t cached;
    bool done;
    for (uint32_t i = 0; i < f->n && f->tr; i++) {
        if (f->tr[i].read) {
            sc->st.load_read_bytes += f->b->t[f->t0 + i].src_bytes;
            sc->st.load_cached_bytes += f->tr[i].cached;
        }
        if ((w = wait_tread(sc, &f->tr[i], &done, &cached)) && !s)
            s = w;
        else if (done && !f->tr[i].copy) {
            sc->st.load_read_bytes += f->b->t[f->t0 + i].src_bytes;
            sc->st.load_cached_bytes += cached;
        }
    }
    for (uint32_t i = 0; i < f->n && f->tr; i++)
        free(f->tr[i].tmp);
    /* The blobs compressed at load are in the block now: freed here, so
     * that a cache's block-by-block load (laden_sched_load_block) holds
     * the blobs of the blocks still to come beside the homes, not every
     * blob until its last block; and a whole load frees them as the reader
     * copies the next ones (all at its end took 0.2-0.35 s of a 9.66 GB
     * model's 2.8-3.3 s on the H200). */
    for (uint32_t i = 0; !s && i < f->n && f->tr; i++)
        laden__sched_drop_blob(&f->b->t[f->t0 + i]);
    free(f->tr);
    f->tr = NULL;
    return s;
}

/* Reads block b's tensors into host memory at dst and waits for them. */
static laden_status read_block_host(laden_sched_t *sc, blk *b, char *dst)
{
    inflight f;
    laden_status s = start_piece(sc, b, 0, b->nt, dst, &f);
    return finish_piece(sc, &f, s);
}

/* Where block b's tensors lie in its device copy: as in the block, but
 * in a cache schedule each lossless tensor decoded, so the tensors after
 * one move (the same placement rule as the block's).  Also what kinds of
 * compact tensors it holds, and the schedule's largest blob. */
static void device_layout(laden_sched_t *sc, blk *b)
{
    uint64_t end = 0;
    b->has_ll = b->has_compact = false;
    for (uint32_t k = 0; k < b->nt; k++) {
        const tref *r = &b->t[k];
        b->has_ll |= r->ll != NULL;
        b->has_compact |= r->expands && !r->ll;
        if (r->ll && r->dst_bytes > sc->layout.max_blob)
            sc->layout.max_blob = r->dst_bytes;
    }
    for (uint32_t k = 0; k < b->nt; k++) {
        tref *r = &b->t[k];
        if (!sc->cache.on || !b->has_ll) {
            r->dev_off = r->dst_off;
            continue;
        }
        r->dev_off = laden__sched_place(r, end);
        end = r->dev_off + (r->ll ? 2 * r->nelem : r->dst_bytes);
    }
    b->dev_bytes = sc->cache.on && b->has_ll ? end : b->bytes;
}

/* The damage words of a CUDA schedule with lossless tensors: a word per
 * block in pinned host memory, which the device decoder writes
 * (laden__sched_ll_damage reads them); kept until free_all. */
static laden_status make_ll_words(laden_sched_t *sc)
{
    laden_status s;
    uint32_t nll = 0, *list = calloc(sc->layout.nb ? sc->layout.nb : 1,
                                     sizeof *list);
    if (!list)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (sc->layout.b[i].has_ll)
            list[nll++] = i;
    void *w = NULL;
    uint64_t bytes = 4ull * sc->layout.nb;
    if (!nll || (s = laden_dev_host_alloc(sc->cfg.device, bytes, &w))) {
        free(list);
        return nll ? s : LADEN_OK;
    }
    memset(w, 0, bytes);
    sc->run.ll_bad = w;
    sc->run.ll_blocks = list;
    sc->run.n_ll_blocks = nll;
    return LADEN_OK;
}

/* A CUDA cache schedule with lossless tensors: the stream its uploads
 * decode on and the events that order it against the copies
 * (resident.c's upload_coded). */
static laden_status make_decode_stream(laden_sched_t *sc)
{
    laden_status s;
    int32_t dev = sc->cfg.device;
    laden_event_t **ev[] = {&sc->cache.copy_end, &sc->cache.copied[0],
                            &sc->cache.copied[1], &sc->cache.decoded[0],
                            &sc->cache.decoded[1]};
    for (size_t i = 0; i < LADEN__ARRAY_LEN(ev); i++)
        if ((s = laden_dev_event_create(dev, 0, ev[i])))
            return s; /* what was made is destroyed by free_all */
    return laden_dev_stream_create(dev, &sc->cache.decode);
}

/* Counts each tier's bytes (the tensors were placed as they were added),
 * orders the streamed blocks and creates the copy stream and events (the
 * damage words and the decode stream where lossless tensors need them).
 * Once. */
static laden_status layout(laden_sched_t *sc)
{
    laden_status s;
    int32_t dev = sc->cfg.device;
    if (sc->layout.laid_out)
        return LADEN_OK;
    laden__sched_share_sweep(sc); /* what dead processes left in shm */
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        if (b->nt > sc->layout.max_nt)
            sc->layout.max_nt = b->nt;
        b->read_shift = laden__sched_read_shift(b); /* its tensors placed */
        device_layout(sc, b);
        uint64_t *tier_bytes = b->tier == LADEN_TIER_RAM ? &sc->st.ram_bytes
                               : b->tier == LADEN_TIER_DISK
                                   ? &sc->st.disk_bytes
                                   : &sc->st.gpu_bytes;
        *tier_bytes += b->bytes;
    }
    size_t nb = sc->layout.nb ? sc->layout.nb : 1;
    sc->layout.order = calloc(nb, sizeof *sc->layout.order);
    sc->layout.call_rank = malloc(nb * sizeof *sc->layout.call_rank);
    sc->layout.rec = calloc(nb, sizeof *sc->layout.rec);
    sc->layout.seen = calloc(nb, 1);
    sc->layout.nrec = sc->layout.nrec_streamed = 0;
    if (!sc->layout.order || !sc->layout.call_rank || !sc->layout.rec ||
        !sc->layout.seen)
        return laden__fail(LADEN_E_NOMEM, "out of memory laying out blocks");
    for (size_t i = 0; i < nb; i++)
        sc->layout.call_rank[i] = UINT32_MAX;
    laden__sched_relayout(sc);
    if ((sc->cuda || sc->cache.on) &&
        (s = laden_dev_stream_create(dev, &sc->run.copy)))
        return s;
    if (sc->cache.on &&
        ((s = laden_dev_event_create(dev, 0, &sc->cache.uploaded)) ||
         (s = laden_dev_event_create(dev, 0, &sc->cache.last_use))))
        return s;
    if (sc->cuda && sc->layout.max_blob &&
        ((s = make_ll_words(sc)) ||
         (sc->cache.on && (s = make_decode_stream(sc)))))
        return s;
    sc->layout.laid_out = true;
    return LADEN_OK;
}

/* The length of a block's own mapping: whole pages, and whole huge pages
 * (2 MiB) from one up, so that the kernel can back it with them. */
#define HUGE_PAGE (2ull << 20)
static uint64_t home_len(uint64_t bytes)
{
    uint64_t page = bytes >= HUGE_PAGE ? HUGE_PAGE : 4096;
    return (bytes + page - 1) & ~(page - 1);
}

/* How far past its mapping's start block b's home begins
 * (laden__sched_read_shift): a home of its own is only copied from and
 * read (CUDA's RAM tier), never run in place. */
static uint64_t home_shift(const laden_sched_t *sc, const blk *b)
{
    return sc->cache.on || b->shared ? 0 : b->read_shift;
}

/* Block b's host copy, in a mapping of its own: a cache schedule's, or
 * the RAM tier of a CUDA schedule (pinned in place once read).  From 2
 * MiB up it is aligned to huge pages and asks for them (MADV_HUGEPAGE):
 * the reads then fault a 2 MiB page at a time instead of 4 KiB, and
 * pinning walks 512 times fewer pages. */
static laden_status map_home(laden_sched_t *sc, blk *b)
{
    uint64_t shift = home_shift(sc, b);
    uint64_t len = home_len(b->bytes + shift);
    void *kept;
    /* A RAM-tier home a released schedule left in the process's pinned
     * pool (laden_pinned_pool_set): pinned already (pin_home skips it). */
    if (!sc->cache.on && sc->cuda && b->tier == LADEN_TIER_RAM &&
        laden__pool_take(sc->cfg.device, len, &kept)) {
        b->ram = (char *)kept + shift;
        b->ram_len = len;
        b->ram_shift = shift;
        b->pinned = true;
        return LADEN_OK;
    }
    uint64_t extra = len >= HUGE_PAGE ? HUGE_PAGE : 0;
    char *m = mmap(NULL, (size_t)(len + extra), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return laden__fail(
            LADEN_E_NOMEM, "cannot allocate %s of host memory for block %u",
            laden__bytes(b->bytes).s, (unsigned)(b - sc->layout.b));
    if (extra) { /* trimmed to an aligned range of len bytes */
        uintptr_t at =
            ((uintptr_t)m + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
        size_t head = at - (uintptr_t)m;
        if (head)
            munmap(m, head);
        if (extra - head)
            munmap((char *)at + len, extra - head);
        m = (char *)at;
#ifdef MADV_HUGEPAGE
        (void)madvise(m, len, MADV_HUGEPAGE); /* a hint: refused is fine */
#endif
    }
    b->ram = m + shift;
    b->ram_len = len;
    b->ram_shift = shift;
    return LADEN_OK;
}

/* A home of its own let go: into the pinned pool if it is pinned and
 * the pool has room, else unpinned and unmapped. */
static void let_go_home(laden_sched_t *sc, blk *b)
{
    void *base = laden__sched_home_base(b);
    b->ram_shift = 0;
    if (b->pinned && laden__pool_keep(sc->cfg.device, base, b->ram_len))
        return;
    if (b->pinned)
        laden_dev_host_unregister(sc->cfg.device, base);
    munmap(base, b->ram_len);
}

static void unmap_home(laden_sched_t *sc, blk *b)
{
    if (b->ram && !b->shared)
        let_go_home(sc, b);
    b->ram = NULL;
    b->pinned = false;
}

static laden_status cancelled(void)
{
    return laden__fail(LADEN_E_STATE, "the load was cancelled by its "
                       "progress callback");
}

/* Cache schedules: block b's host copy is complete.  LADEN_E_STATE if
 * the progress callback asks to stop. */
static laden_status filled(laden_sched_t *sc, blk *b)
{
    b->filled = true;
    if (++sc->cache.nfilled == sc->layout.nb)
        sc->loaded = true;
    if (!sc->load.progress)
        return LADEN_OK;
    uint64_t done = 0, total = 0;
    for (uint32_t k = 0; k < sc->layout.nb; k++) {
        total += sc->layout.b[k].bytes;
        done += sc->layout.b[k].filled ? sc->layout.b[k].bytes : 0;
    }
    return sc->load.progress(sc->load.progress_arg, done, total) ? cancelled()
                                                       : LADEN_OK;
}

static laden_status fill_block(laden_sched_t *sc, uint32_t i)
{
    blk *b = &sc->layout.b[i];
    laden_status s;
    if (b->bytes && ((s = map_home(sc, b)) ||
                     (s = read_block_host(sc, b, b->ram)) ||
                     (s = laden__sched_check_cached(sc, b)))) {
        unmap_home(sc, b);
        return s;
    }
    (void)filled(sc, b); /* a cancel: the caller has control after it */
    laden__error_clear();
    return LADEN_OK;
}

laden_status laden__sched_load_block(laden_sched_t *sc, uint32_t block)
{
    laden_status s;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_load_block: NULL");
    if (!sc->cache.on)
        return laden__fail(LADEN_E_STATE, "laden_sched_load_block: only for "
                           "schedules created with LADEN_SCHED_CACHE");
    if (sc->broken)
        return laden__fail(LADEN_E_STATE, "the schedule failed to load");
    if (sc->load.loading)
        return laden__fail(LADEN_E_STATE, "laden_sched_load_block: the "
                           "schedule is loading");
    if (block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL, "laden_sched_load_block: no block "
                           "%u (%u blocks)", block, sc->layout.nb);
    if (sc->layout.b[block].filled)
        return laden__fail(LADEN_E_STATE, "block %u is loaded already",
                           block);
    if (sc->share.key)
        return laden__fail(LADEN_E_STATE, "laden_sched_load_block: a "
                           "schedule with a shared host copy loads whole "
                           "(laden_sched_load)");
    /* Marked tensors are encoded first, all of them (the layout needs
     * their sizes); each block's blobs are freed once it holds them. */
    if ((!sc->layout.laid_out && (s = laden__sched_compress(sc, NULL))) ||
        (s = layout(sc))) {
        laden__sched_free_all(sc);
        sc->broken = true;
        return s;
    }
    if ((s = fill_block(sc, block)) || !sc->loaded)
        return s;
    laden__sched_compress_free(sc);
    return LADEN_OK;
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
    b->offloaded = true;
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
    blk *b = &sc->layout.b[i];
    laden_status s = LADEN_OK;
    int res = 1;
    if (b->shared) { /* the CPU device, in the segment (share.c) */
        sc->st.device_bytes += b->bytes;
        return LADEN_OK;
    }
    if (b->bytes && sc->cache.vbar) {
        uint64_t sig;
        laden_vbar_alloc(sc->cache.vbar, b->bytes, &b->voff); /* sized so */
        if ((s = laden_vbar_fault(sc->cache.vbar, b->voff, b->bytes, &res,
                                  &sig)))
            return s;
        b->region = res ? sc->cache.vbar_base + b->voff : 0;
    } else if (b->bytes) {
        s = laden_dev_mem_alloc(sc->cfg.device, b->bytes, &b->region);
        res = s == LADEN_OK;
        if (s && s != LADEN_E_DEVICE_NOMEM)
            return s;
    }
    if (!res) {
        if (b->tier == LADEN_TIER_GPU)
            return sc->cache.vbar ? laden__fail(LADEN_E_BUDGET,
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
    if (sc->cache.vram) {
        uint64_t total = 0, largest = 0;
        uint32_t nmay = 0;
        for (uint32_t i = 0; i < sc->layout.nb; i++) {
            blk *b = &sc->layout.b[i];
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
            (total &&
             (s = laden__sched_new_vbar(sc->cache.vram, total, &sc->cache.vbar,
                                        &sc->cache.vbar_base))))
            return s;
    }
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < sc->layout.nb; i++)
            if (sc->layout.b[i].tier ==
                    (pass ? LADEN_TIER_VRAM : LADEN_TIER_GPU) &&
                (s = place_block(sc, i, &moved)))
                return s;
    if (moved)
        laden__sched_relayout(sc);
    if (!sc->layout.nstreamed)
        laden__sched_charge_slots(sc, 0);
    return LADEN_OK;
}

/* LADEN_OK if every block has a tier it can load into.  A planned block
 * is never on disk with a conversion; checked again here all the same. */
static laden_status check_tiers(const laden_sched_t *sc)
{
    laden_status s;
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        const blk *b = &sc->layout.b[i];
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

/* Bytes of reads kept in flight while loading: enough for the drive's
 * queue and the reader threads, bounded so that converted tensors' read
 * buffers do not add up. */
#define LOAD_WINDOW (512ull << 20)
/* CUDA GPU-tier blocks go through pinned staging in pieces of at most
 * this (a larger tensor is a piece of its own), so that the rest of a
 * model is not pinned whole to be copied once. */
#define STAGE_BYTES (256ull << 20)
#define QUEUE 64u

/* A load in progress (sc->load.ld): blocks are loaded in their order, a piece
 * at a time, by step(); whoever holds the schedule drives it (the caller
 * of laden_sched_load, the background thread of laden_sched_load_begin,
 * or the owner waiting for a block in laden_sched_await or enter). */
struct laden_loader {
    laden_sched_t *sc;
    inflight q[QUEUE]; /* a ring of pieces in flight */
    uint32_t head, count;
    uint64_t inflight_bytes, done_bytes, total_bytes;
    void *staging[2]; /* CUDA GPU tier: read here, then copied */
    laden_event_t *copied[2];
    uint64_t staging_bytes;
    uint32_t next, t0; /* the next piece to start: block, first tensor */
};

/* Whether block b is loaded through the staging buffers. */
static bool staged(const laden_sched_t *sc, const blk *b)
{
    return sc->cuda && !sc->cache.on && b->tier == LADEN_TIER_GPU;
}

/* Whether the loader reads block b (it has bytes in memory to fill). */
static bool to_load(const laden_sched_t *sc, const blk *b)
{
    return (b->tier == LADEN_TIER_RAM || b->tier == LADEN_TIER_GPU) &&
           b->bytes && b->nt && !(sc->cache.on && b->filled) &&
           !laden__sched_attached(sc, b);
}

/* The end of the piece of block b that starts at tensor t0: the tensors
 * whose packed bytes fit STAGE_BYTES when staged (at least one), else all
 * of them. */
static uint32_t piece_end(const laden_sched_t *sc, const blk *b, uint32_t t0)
{
    if (!staged(sc, b))
        return b->nt;
    uint64_t cap = sc->load.stage_bytes ? sc->load.stage_bytes : STAGE_BYTES;
    uint32_t t1 = t0 + 1;
    while (t1 < b->nt &&
           b->t[t1].dst_off + b->t[t1].dst_bytes - b->t[t0].dst_off <= cap)
        t1++;
    return t1;
}

static laden_status progress(loader *l, const inflight *f, bool last)
{
    laden_sched_t *sc = l->sc;
    if (sc->cache.on) /* counts the blocks loaded before too */
        return last ? filled(sc, f->b) : LADEN_OK;
    l->done_bytes += f->bytes;
    if (sc->load.progress && sc->load.progress(sc->load.progress_arg,
                                               l->done_bytes, l->total_bytes))
        return cancelled();
    return LADEN_OK;
}

/* Finishes the oldest piece in flight: waits for its reads, and for a
 * staged piece enqueues its copy to the device.  A block whose last piece
 * this is becomes ready: a staged one once its copy has finished, so that
 * work on any stream may read it. */
static laden_status finish_oldest(loader *l, laden_status s)
{
    laden_sched_t *sc = l->sc;
    inflight *f = &l->q[l->head];
    bool last = f->t0 + f->n == f->b->nt; /* completes its block */
    s = finish_piece(sc, f, s);
    if (!s && f->staging >= 0 &&
        !(s = laden_dev_copy_h2d(sc->run.copy, f->b->region + f->base, f->dst,
                                 f->bytes)) &&
        !(s = laden_dev_event_record(l->copied[f->staging], sc->run.copy)) &&
        last)
        s = laden_dev_event_synchronize(l->copied[f->staging]);
    if (!s && last)
        s = laden__sched_check_cached(sc, f->b);
    if (!s && last && sc->cuda && !sc->cache.on &&
        f->b->tier == LADEN_TIER_RAM)
        s = laden__sched_pin_home(sc, f->b);
    if (s && sc->cache.on)
        unmap_home(sc, f->b);
    if (!s && last)
        f->b->ready = true;
    l->inflight_bytes -= f->bytes;
    l->head = (l->head + 1) % QUEUE;
    l->count--;
    return s ? s : progress(l, f, last);
}

/* Whether block b's host copy is a home of its own (map_home): a cache
 * schedule's, or a CUDA schedule's RAM tier; else the CPU device's arena
 * or none. */
static bool own_home(const laden_sched_t *sc, const blk *b)
{
    return sc->cache.on || (b->tier == LADEN_TIER_RAM && sc->cuda);
}

/* Where block b's bytes are kept in the host: its home (a cache
 * schedule's host copy, or a RAM-tier block of a CUDA schedule, pinned
 * once read: pin_home), or on the CPU device its place in the arena,
 * where it runs; nothing for a block in a shared segment, or whose
 * memory is made already (the encoders': compress.c's settle_block).
 * Mapped, not touched: the reads make the pages, in parallel. */
static laden_status block_host_memory(laden_sched_t *sc, blk *b)
{
    if (b->ram || b->shared)
        return LADEN_OK;
    if (own_home(sc, b))
        return map_home(sc, b);
    if (b->tier != LADEN_TIER_RAM)
        return LADEN_OK;
    laden_status s = laden_host_alloc(sc->layout.host, b->bytes, &b->ram);
    if (!s)
        b->region = (laden_devptr_t)(uintptr_t)b->ram;
    return s;
}

/* What block b's host memory counts against the RAM budget: its home's
 * length (whole pages), 0 where it is not a home of a whole load's
 * budget (the CPU device's arena has its own). */
static uint64_t home_bytes(const laden_sched_t *sc, const blk *b)
{
    if (!own_home(sc, b))
        return 0;
    return b->shared ? b->ram_len : home_len(b->bytes + home_shift(sc, b));
}

/* LADEN_E_BUDGET naming block b if its home does not fit the RAM budget
 * beside `taken` bytes of homes (a cache schedule's budget is its
 * engine's). */
static laden_status home_budget(const laden_sched_t *sc, const blk *b,
                                uint64_t taken)
{
    uint64_t budget = sc->cfg.ram_budget_bytes, len = home_bytes(sc, b);
    if (sc->cache.on || !budget || taken + len <= budget)
        return LADEN_OK;
    return laden__fail(LADEN_E_BUDGET,
                       "block %u (%s) does not fit the %s RAM budget (%s "
                       "taken)",
                       (unsigned)(b - sc->layout.b), laden__bytes(len).s,
                       laden__bytes(budget).s, laden__bytes(taken).s);
}

/* The same, before the loader reads block b: a home within the RAM
 * budget (a shared block is in the segment, in 4 KiB pages (share.c), as
 * an attacher counts it too). */
static laden_status host_memory(loader *l, blk *b, uint64_t *homes_bytes)
{
    laden_sched_t *sc = l->sc;
    laden_status s = home_budget(sc, b, *homes_bytes);
    if (!s && !(s = block_host_memory(sc, b)))
        *homes_bytes += home_bytes(sc, b);
    return s;
}

/* A block encoded at load (laden__sched_compress's place, on the
 * encoder that ended it): its host memory made now, where the loader
 * would make it, within the RAM budget as the loader counts it (the
 * loader's own check, with every home, comes after; this one refuses
 * before the homes exceed it). */
static laden_status place_encoded(laden_sched_t *sc, blk *b,
                                  _Atomic uint64_t *taken)
{
    uint64_t len = home_bytes(sc, b);
    laden_status s = home_budget(sc, b, atomic_fetch_add(taken, len));
    if (!s && (s = block_host_memory(sc, b)))
        laden__error_prefix("block %u", (unsigned)(b - sc->layout.b));
    return s;
}

/* Where piece [t0, ...) of block b is read to: its block's host memory
 * (host_memory), its GPU region on the CPU device, or a staging buffer
 * whose last copy has finished. */
static laden_status destination(loader *l, blk *b, uint32_t t0, char **dst,
                                int *staging)
{
    laden_sched_t *sc = l->sc;
    laden_status s;
    *staging = -1;
    if (b->ram) {
        *dst = (char *)b->ram + b->t[t0].dst_off;
        return LADEN_OK;
    }
    if (!staged(sc, b)) {
        *dst = (char *)(uintptr_t)b->region + b->t[t0].dst_off;
        return LADEN_OK;
    }
    for (int k = 0; k < 2; k++) { /* one not used by a piece in flight */
        bool busy = false;
        for (uint32_t j = 0; j < l->count; j++)
            busy |= l->q[(l->head + j) % QUEUE].staging == k;
        if (busy)
            continue;
        if (!l->staging[k] &&
            ((s = laden_host_alloc(sc->layout.host, l->staging_bytes,
                                   &l->staging[k])) ||
             (s = laden_dev_event_create(sc->cfg.device, 0, &l->copied[k]))))
            return s;
        if ((s = laden_dev_event_synchronize(l->copied[k])))
            return s;
        /* As a home's shift: the piece's reads land in place. */
        const tref *r = &b->t[t0];
        uint64_t shift = laden__sched_as_stored(r) ? r->off & 4095u : 0;
        *staging = k;
        *dst = (char *)l->staging[k] + (shift % 8 ? 0 : shift);
        return LADEN_OK;
    }
    return laden__fail(LADEN_E_STATE, "no staging buffer free"); /* bug */
}

/* Whether the next piece must wait for the oldest in flight: the window
 * is full, or both staging buffers are being read into.  A piece read
 * into one staging buffer may start while the other's reads run or its
 * copy to the device does (destination waits for that copy). */
static bool must_wait(const loader *l)
{
    uint32_t staged_n = 0;
    if (l->inflight_bytes >= LOAD_WINDOW || l->count == QUEUE)
        return true;
    for (uint32_t j = 0; j < l->count; j++)
        staged_n += l->q[(l->head + j) % QUEUE].staging >= 0;
    return staged_n >= 2;
}

/* Moves l->next past the blocks that have nothing to read, marking them
 * ready (a failure: a shared copy's blob that is not what it claims). */
static laden_status skip_empty(loader *l)
{
    laden_sched_t *sc = l->sc;
    while (l->next < sc->layout.nb && !to_load(sc, &sc->layout.b[l->next])) {
        blk *b = &sc->layout.b[l->next++];
        /* An attached shared copy's blobs came from another process's
         * load: checked here as that one checked its own. */
        laden_status s = laden__sched_check_cached(sc, b);
        if (s)
            return s;
        b->ready = true;
    }
    return LADEN_OK;
}

static bool loader_done(const loader *l)
{
    return l->next >= l->sc->layout.nb && !l->count;
}

/* One unit of the load: the next piece started, or (when the window is
 * full, or every piece is started) the oldest finished. */
static laden_status step(loader *l)
{
    laden_sched_t *sc = l->sc;
    laden_status s;
    if (l->next < sc->layout.nb && !(l->count && must_wait(l))) {
        blk *b = &sc->layout.b[l->next];
        uint32_t t1 = piece_end(sc, b, l->t0);
        char *dst = NULL;
        int staging;
        if ((s = destination(l, b, l->t0, &dst, &staging)))
            return s;
        inflight *f = &l->q[(l->head + l->count) % QUEUE];
        s = start_piece(sc, b, l->t0, t1, dst, f);
        f->staging = staging;
        l->count++;
        l->inflight_bytes += f->bytes;
        l->t0 = t1;
        if (t1 == b->nt) {
            l->next++;
            l->t0 = 0;
            laden_status e = skip_empty(l);
            s = s ? s : e;
        }
        return s;
    }
    return l->count ? finish_oldest(l, LADEN_OK) : LADEN_OK;
}

/* A new load of every block that has bytes to read (cache schedules: not
 * loaded yet): host memory mapped for all of them first, so that their
 * addresses are known before their bytes. */
static laden_status loader_new(laden_sched_t *sc)
{
    loader *l = calloc(1, sizeof *l);
    if (!l)
        return laden__fail(LADEN_E_NOMEM, "out of memory starting a load");
    l->sc = sc;
    sc->load.ld = l;
    /* Counted against the RAM budget with the homes read here: those an
     * attached shared copy holds (share.c). */
    uint64_t homes_bytes = 0;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (laden__sched_attached(sc, &sc->layout.b[i]) &&
            sc->layout.b[i].tier == LADEN_TIER_RAM)
            homes_bytes += sc->layout.b[i].ram_len;
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        if (!to_load(sc, b))
            continue;
        l->total_bytes += b->bytes;
        laden_status s = host_memory(l, b, &homes_bytes);
        if (s)
            return s;
        for (uint32_t t0 = 0, t1; staged(sc, b) && t0 < b->nt; t0 = t1) {
            t1 = piece_end(sc, b, t0);
            uint64_t n = b->t[t1 - 1].dst_off + b->t[t1 - 1].dst_bytes -
                         b->t[t0].dst_off;
            n += 4096; /* room for the shift (destination) */
            l->staging_bytes = n > l->staging_bytes ? n : l->staging_bytes;
        }
    }
    return skip_empty(l);
}

/* Ends the load (sc->load.ld): the pieces in flight finished (also after a
 * failure s: the reads must end first), the staging freed.  The schedule
 * is loaded if all went well. */
static laden_status loader_end(laden_sched_t *sc, laden_status s)
{
    loader *l = sc->load.ld;
    if (!l)
        return s;
    while (l->count)
        s = finish_oldest(l, s);
    if (!s && !loader_done(l))
        s = laden__fail(LADEN_E_STATE, "the load was stopped");
    s = laden__sched_share_end(sc, s);
    if (!s && (l->staging[0] || l->staging[1]))
        s = laden_dev_stream_synchronize(sc->run.copy);
    for (int k = 0; k < 2; k++) {
        if (l->staging[k])
            laden_host_free(sc->layout.host, l->staging[k]);
        laden_dev_event_destroy(l->copied[k]);
    }
    laden_host_trim(sc->layout.host); /* the GPU tier's staging is not kept */
    free(l);
    sc->load.ld = NULL;
    sc->load.loading = false;
    if (!s) {
        sc->loaded = true;
        laden__sched_compress_free(sc); /* copied into the blocks */
    }
    if (sc->load.trace_t0 && LADEN__TRACING()) {
        uint64_t sess = laden__trace_session(); /* before the name */
        laden__trace_span(LADEN__EV_LOAD, sess, sc->load.trace_t0, 0,
                          sc->st.load_read_bytes, (uintptr_t)sc,
                          laden__sched_trace_name(sc));
    }
    sc->load.trace_t0 = 0;
    return s;
}

/* LADEN_OK if the schedule may be loaded now (nothing is changed). */
static laden_status may_load(const laden_sched_t *sc)
{
    if (sc->loaded || sc->broken || sc->load.loading)
        return laden__fail(LADEN_E_STATE, sc->load.loading
                                              ? "the schedule is loading"
                                              : "the schedule is already "
                                                "loaded");
    return sc->layout.laid_out ? LADEN_OK : check_tiers(sc);
}

/* Everything a load does before its first read: the blocks laid out, the
 * device and host memory given, the loader made. */
static laden_status begin(laden_sched_t *sc)
{
    laden_status s;
    sc->load.trace_t0 = LADEN__TRACING() ? laden__now_ns() : 0;
    if ((!sc->layout.laid_out &&
         (s = laden__sched_compress(sc, sc->cache.on ? NULL
                                                     : place_encoded))) ||
        (s = layout(sc)) || (s = laden__sched_share_open(sc)) ||
        (!sc->cache.on && (s = place_device_blocks(sc))) ||
        (s = loader_new(sc)))
        return s;
    sc->load.loading = true;
    return LADEN_OK;
}

/* A load that failed: everything freed, the schedule only destroyable. */
static laden_status failed(laden_sched_t *sc, laden_status s)
{
    if (sc->load.ld)
        s = loader_end(sc, s);
    sc->load.loading = false;
    laden__sched_free_all(sc);
    sc->broken = true;
    return s;
}

laden_status laden__sched_load(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_load: NULL schedule");
    laden_status s = may_load(sc);
    if (s)
        return s;
    if ((s = begin(sc)))
        return failed(sc, s);
    while (!s && !loader_done(sc->load.ld))
        s = step(sc->load.ld);
    if ((s = loader_end(sc, s)))
        return failed(sc, s);
    return LADEN_OK;
}

/* ---- loading in the background ------------------------------------------
 *
 * laden_sched_load_begin does what laden_sched_load does before its first
 * read, then returns; a thread of the schedule's drives the load a step at
 * a time, each step holding the schedule (stream.c: the owner's calls wait
 * for a step to end, and take precedence over the next).  The owner drives
 * it too, on its own thread, while it waits for a block (laden__sched_until
 * from laden_sched_await and enter), so that a forward pass runs as the
 * blocks arrive.  A failure is kept (sc->load.err) and returned by the
 * owner's next call that needs a block. */

laden_status laden__sched_load_failure(laden_sched_t *sc)
{
    return laden__fail(sc->load.err ? sc->load.err : LADEN_E_STATE,
                       "the schedule failed to load: %s", sc->load.msg);
}

/* The end of a background load, on whichever thread reached it. */
static void ended(laden_sched_t *sc, laden_status s)
{
    if (!(s = loader_end(sc, s)))
        return;
    sc->load.err = s;
    snprintf(sc->load.msg, sizeof sc->load.msg, "%s", laden_last_error());
    /* The memory stays (its addresses were handed out) until destroy;
     * the calls that need a block return the failure meanwhile. */
    sc->load.loading = true;
    sc->broken = true;
}

static void *load_thread(void *arg)
{
    laden_sched_t *sc = arg;
    while (!atomic_load(&sc->load.destroy_asked) &&
           laden__sched_hold_loader(sc)) {
        bool end = !sc->load.ld;
        if (!end) {
            laden_status s = step(sc->load.ld);
            if (s || loader_done(sc->load.ld)) {
                ended(sc, s);
                end = true;
            }
        }
        laden__sched_unhold_loader(sc);
        if (end)
            break;
    }
    if (atomic_load(&sc->load.destroy_asked)) {
        /* Destroyed from this thread (its progress callback): nobody is
         * left to join it, so it finishes the destroy itself. */
        pthread_mutex_lock(&sc->hold.mu);
        bool live = atomic_exchange(&sc->hold.loader_live, false);
        pthread_mutex_unlock(&sc->hold.mu);
        if (live)
            pthread_detach(pthread_self());
        atomic_store(&sc->hold.loader_tid, 0);
        laden__sched_destroy(sc);
    }
    return NULL;
}

laden_status laden__sched_load_prepare(laden_sched_t *sc)
{
    if (sc->load.loading && sc->load.ld && !sc->load.loader_started &&
        !sc->load.err)
        return LADEN_OK; /* prepared already */
    if (sc->cache.on)
        return laden__fail(LADEN_E_STATE, "a cache schedule loads with "
                           "laden_sched_load or laden_sched_load_block");
    laden_status s = may_load(sc);
    if (s)
        return s;
    if ((s = begin(sc)))
        return failed(sc, s);
    return LADEN_OK;
}

laden_status laden__sched_load_begin(laden_sched_t *sc)
{
    laden_status s = laden__sched_load_prepare(sc);
    if (s)
        return s;
    if (loader_done(sc->load.ld))
        return (s = loader_end(sc, LADEN_OK)) ? failed(sc, s) : LADEN_OK;
    if ((s = laden__sched_start_loader(sc, load_thread)))
        return failed(sc, s);
    return LADEN_OK;
}

/* Steps the load (sc->load.ld) on this thread until block `block` is in place
 * (-1: all of it), and ends it once it failed or is done: the load's
 * failure, if any. */
static laden_status drive(laden_sched_t *sc, int64_t block)
{
    bool done;
    return laden__sched_drive_for(sc, block, 0, &done);
}

/* drive() that gives up once `deadline_ns` (laden__now_ns; 0: never) has
 * passed, between two steps: *done says whether it got there (the block
 * in place, or the load ended).  A step is one piece of the load, so the
 * caller is back within a piece's read after the deadline: long waits
 * are made of short calls, between which Python sees Ctrl-C. */
laden_status laden__sched_drive_for(laden_sched_t *sc, int64_t block,
                                    uint64_t deadline_ns, bool *done)
{
    laden_status s = LADEN_OK;
    *done = true;
    while (!s && !loader_done(sc->load.ld) &&
           (block < 0 || !sc->layout.b[block].ready)) {
        if (deadline_ns && laden__now_ns() >= deadline_ns) {
            *done = false;
            return LADEN_OK;
        }
        s = step(sc->load.ld);
    }
    if (s || loader_done(sc->load.ld))
        ended(sc, s);
    return sc->load.err ? laden__sched_load_failure(sc) : LADEN_OK;
}

laden_status laden__sched_until(laden_sched_t *sc, uint32_t block)
{
    if (block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL, "no block %u (%u blocks)", block,
                           sc->layout.nb);
    if (sc->load.err) /* also for blocks read before it failed */
        return laden__sched_load_failure(sc);
    if (sc->layout.b[block].ready || sc->loaded)
        return LADEN_OK;
    if (!sc->load.ld)
        return laden__fail(LADEN_E_STATE, "the schedule is not loaded");
    return drive(sc, block);
}

laden_status laden__sched_await_for(laden_sched_t *sc, int64_t block,
                                    uint32_t timeout_ms, int *out_done)
{
    *out_done = 0;
    if (block >= (int64_t)sc->layout.nb)
        return laden__fail(LADEN_E_INVAL, "no block %lld (%u blocks)",
                           (long long)block, sc->layout.nb);
    if (sc->load.err)
        return laden__sched_load_failure(sc);
    if (block >= 0 && (sc->layout.b[block].ready || sc->loaded)) {
        *out_done = 1;
        return LADEN_OK;
    }
    if (!sc->load.ld) {
        if (block >= 0 || !sc->loaded)
            return laden__fail(LADEN_E_STATE, "the schedule is not "
                               "loaded (no load was begun)");
    } else {
        bool done;
        uint64_t deadline = laden__now_ns() + (uint64_t)timeout_ms * 1000000u;
        laden_status s = laden__sched_drive_for(sc, block, deadline, &done);
        if (s || !done)
            return s;
    }
    if (block < 0) {
        laden__sched_join_loader(sc);
        if (sc->load.err)
            return laden__sched_load_failure(sc);
    }
    *out_done = 1;
    return LADEN_OK;
}

laden_status laden__sched_load_cancel(laden_sched_t *sc)
{
    laden__sched_join_loader(sc); /* its step in progress ends first */
    if (sc->load.ld) {
        laden_status s = laden__fail(LADEN_E_STATE, "the load was "
                                     "cancelled (laden_sched_load_cancel)");
        ended(sc, s);
    }
    return LADEN_OK;
}

laden_status laden__sched_load_wait(laden_sched_t *sc)
{
    if (sc->load.ld)
        (void)drive(sc, -1);
    laden__sched_join_loader(sc);
    if (sc->load.err) /* the memory stays: its addresses were handed out */
        return laden__sched_load_failure(sc);
    return sc->loaded ? LADEN_OK
                      : laden__fail(LADEN_E_STATE, "the schedule is not "
                                    "loaded (no load was begun)");
}

/* After the background thread has stopped: the load it left, ended. */
void laden__sched_abandon_load(laden_sched_t *sc)
{
    if (sc->load.ld) {
        loader_end(sc, laden__fail(LADEN_E_STATE, "the load was stopped"));
        laden__error_clear();
        sc->broken = true;
    }
}

/* ---- reading a tensor again --------------------------------------------- */

laden_status laden__sched_reread(laden_sched_t *sc, uint32_t block, uint32_t i)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_sched_reread: NULL");
    if (!sc->loaded || sc->cache.on)
        return laden__fail(LADEN_E_STATE, "laden_sched_reread: %s",
                           sc->cache.on ? "a cache schedule's device copy is "
                                       "uploaded from its host copy"
                                     : "the schedule is not loaded");
    if (block >= sc->layout.nb || i >= sc->layout.b[block].nt)
        return laden__fail(LADEN_E_INVAL, "laden_sched_reread: no tensor %u "
                           "of block %u", i, block);
    blk *b = &sc->layout.b[block];
    const tref *r = &b->t[i];
    if (laden__sched_streamed(sc, b))
        return laden__fail(LADEN_E_STATE, "block %u is streamed: its slot is "
                           "filled again from its tier (laden_sched_refill)",
                           block);
    if (r->host || r->ll)
        return laden__fail(LADEN_E_STATE, "tensor '%.200s' was copied from "
                           "host memory at load: there is nothing to read it "
                           "again from", r->name);
    if (b->shared)
        return laden__fail(LADEN_E_STATE, "tensor '%.200s' is in the host "
                           "copy shared with other processes "
                           "(laden_sched_share), which laden never writes "
                           "after the load", r->name);
    bool bounce = sc->cuda && b->tier == LADEN_TIER_GPU;
    char *to = NULL;
    laden_status s = LADEN_OK, w;
    if (bounce &&
        (s = laden_host_alloc(sc->layout.host, r->dst_bytes ? r->dst_bytes : 1,
                              (void **)&to)))
        return s;
    if (!bounce)
        to = (char *)(uintptr_t)b->region + r->dst_off;
    tread c = {0};
    s = start_tensor(sc, r, to, &c);
    bool done;
    uint64_t cached = 0;
    if ((w = wait_tread(sc, &c, &done, &cached)) && !s)
        s = w;
    if (!c.read)
        c.cached = cached;
    free(c.tmp);
    if (!s && bounce &&
        !(s = laden_dev_copy_h2d(sc->run.copy, b->region + r->dst_off, to,
                                 r->dst_bytes)))
        s = laden_dev_stream_synchronize(sc->run.copy);
    if (bounce)
        laden_host_free(sc->layout.host, to);
    if (!s) {
        sc->st.load_read_bytes += r->src_bytes;
        sc->st.load_cached_bytes += c.cached;
    }
    return s;
}

/* ---- teardown ----------------------------------------------------------- */

void laden__sched_wait_uploads(laden_sched_t *sc)
{
    if (sc->run.copy)
        laden_dev_stream_synchronize(sc->run.copy);
    if (sc->cache.decode)
        laden_dev_stream_synchronize(sc->cache.decode);
}

void laden__sched_free_scratch(laden_sched_t *sc)
{
    if (!sc->cache.scratch[0])
        return;
    laden__sched_wait_uploads(sc); /* they may still read them */
    for (int k = 0; k < 2; k++)
        laden_dev_mem_free(sc->cfg.device, sc->cache.scratch[k]);
    uint64_t n = 2 * sc->cache.scratch_bytes;
    if (sc->cache.vram)
        laden_vram_uncharge(sc->cache.vram, n);
    sc->st.device_bytes -= n;
    sc->cache.scratch[0] = sc->cache.scratch[1] = 0;
    sc->cache.scratch_bytes = 0;
}


void laden__sched_free_all(laden_sched_t *sc)
{
    /* First: it waits for the decodes that write the device copies and
     * the damage words freed below. */
    laden__sched_free_scratch(sc);
    laden__sched_free_slots(sc);
    if (sc->run.ll_bad) /* a decode still queued: the free waits for it */
        laden_dev_host_free(sc->cfg.device, sc->run.ll_bad);
    free(sc->run.ll_blocks);
    sc->run.ll_bad = NULL;
    sc->run.ll_blocks = NULL;
    sc->run.n_ll_blocks = 0;
    if (sc->cache.fenced)
        laden_dev_event_synchronize(sc->cache.last_use);
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        bool in_segment = b->shared && b->tier == LADEN_TIER_GPU &&
                          !b->resident; /* the CPU device (share.c) */
        if ((b->tier == LADEN_TIER_GPU || b->resident) && b->region &&
            !sc->cache.vbar && !in_segment)
            laden_dev_mem_free(sc->cfg.device, b->region);
        if (b->shared) { /* in the segment, closed below (no shift) */
            if (b->pinned)
                laden_dev_host_unregister(sc->cfg.device, b->ram);
        } else if (b->ram && b->ram_len) { /* a mapping of its own (load.c) */
            let_go_home(sc, b);
        } else if (b->ram) {
            laden_host_free(sc->layout.host, b->ram);
        }
        b->region = 0;
        b->ram = NULL;
        b->ram_len = 0;
        b->resident = b->pinned = b->ready = false;
    }
    sc->load.pinned_homes = 0;
    laden__sched_share_close(sc);
    /* after the copies (free_slots synced) */
    laden_vbar_destroy(sc->cache.vbar);
    sc->cache.vbar = NULL;
    laden_dev_stream_destroy(sc->run.copy);
    sc->run.copy = NULL;
    laden_dev_event_destroy(sc->cache.uploaded);
    laden_dev_event_destroy(sc->cache.last_use);
    for (int k = 0; k < 2; k++) {
        laden_dev_event_destroy(sc->cache.copied[k]);
        laden_dev_event_destroy(sc->cache.decoded[k]);
        sc->cache.copied[k] = sc->cache.decoded[k] = NULL;
    }
    laden_dev_event_destroy(sc->cache.copy_end);
    sc->cache.copy_end = NULL;
    laden_dev_stream_destroy(sc->cache.decode);
    sc->cache.decode = NULL;
    sc->cache.uploaded = sc->cache.last_use = NULL;
    sc->cache.fenced = false;
    free(sc->layout.order);
    free(sc->layout.call_rank);
    free(sc->layout.rec);
    free(sc->layout.seen);
    sc->layout.order = sc->layout.call_rank = sc->layout.rec = NULL;
    sc->layout.seen = NULL;
    sc->layout.nrec = sc->layout.nrec_streamed = 0;
    laden_host_trim(sc->layout.host);
}

/* laden_sched_destroy's work, off the loader's thread (or on it, once it
 * no longer counts as the loader: load_thread): the loader stopped, then
 * what the load made, then the description (build.c). */
void laden__sched_destroy(laden_sched_t *sc)
{
    laden__sched_join_loader(sc); /* a load in the background stops */
    laden__sched_abandon_load(sc);
    /* Kernels of the model may still read its weights and slots (the
     * caller dropped it right after enqueueing a forward); VBAR pages are
     * unmapped without the implicit wait of a device free. */
    if (sc->cuda && sc->run.compute)
        laden_dev_stream_synchronize(sc->run.compute);
    if (sc->cuda && sc->run.compute_alt)
        laden_dev_stream_synchronize(sc->run.compute_alt);
    laden__sched_free_all(sc);
    laden__sched_free_description(sc);
}

laden_status laden__sched_check_block(laden_sched_t *sc, uint32_t block,
                                      const char *call)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    if (sc->load.err)
        return laden__sched_load_failure(sc);
    if (!laden__sched_usable(sc))
        return laden__fail(LADEN_E_STATE, "%s: the schedule is not loaded",
                           call);
    if (block >= sc->layout.nb)
        return laden__fail(LADEN_E_INVAL, "%s: no block %u (%u blocks)", call,
                           block, sc->layout.nb);
    return LADEN_OK;
}
