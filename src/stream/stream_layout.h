/* The schedule's layout part (sc->layout): what was described (blocks,
 * their tensors, the checkpoint's files) and where each tensor lies in its
 * block.  Owner: build.c (create, add blocks and tensors, plan, free the
 * description).  Writers: build.c while describing; parts.c's relayout
 * (called by load.c and resident.c) for the streamed blocks' positions
 * and the slots' size, and its charge_slots (load.c, run.c) for their
 * charge; load.c lays the blocks out once (laid_out) and fills in their
 * memory;
 * resident.c and share.c set blocks' cache and share flags.  Everyone
 * else reads.
 *
 * Like every part header: the first half is the part's types (also taken
 * by stream_internal.h to make struct laden_sched), the second the calls
 * its owner makes for the other files, seen only by a file that includes
 * this header.  Not installed. */
#ifndef LADEN_STREAM_LAYOUT_TYPES
#define LADEN_STREAM_LAYOUT_TYPES

#include <stdbool.h>
#include <stdint.h>

#include "../core/internal.h"
#include "laden/host.h"
#include "laden/io.h"
#include "laden/lossless.h"
#include "laden/stream.h"

/* Each tensor of a block starts at a multiple of this, for any kernel. */
#define ALIGN 256u

typedef struct tref {
    uint32_t file;
    uint64_t off;       /* absolute offset in the file */
    uint64_t src_bytes;
    laden_dtype src, dst;
    uint64_t nelem;
    uint64_t dst_off;   /* offset in the block's region */
    uint64_t dev_off;   /* offset in a cache schedule's device copy, which
                           holds lossless tensors decoded (= dst_off
                           otherwise; load.c's layout) */
    uint64_t dst_bytes;
    const char *name;   /* for messages; copied */
    const void *host;   /* bytes in host memory instead of a file */
    uint64_t rows;      /* quantized to F8_E4M3: rows with one scale each */
    uint64_t rope_heads; /* rows in GGUF's rope order over this many heads:
                          * put back in transformers' order on load */
    uint64_t nrows;     /* shape[0] (1 for a scalar) */
    /* A part of a checkpoint tensor (laden_sched_add_tensor_part) that is
     * not one range: `pieces` ranges of src_bytes / pieces bytes, the
     * first at `off`, each `stride` bytes after the one before; 0: one
     * range. */
    uint64_t pieces, stride;
    bool part;          /* laden_sched_add_tensor_part */
    /* laden_sched_join_tensor: laid right after the tensor before it, the
     * two one tensor of the model (its first tensor's `joined` false). */
    bool joined;
    /* laden_sched_set_expanded: stored compact, expanded to `expanded`
     * in the workspace at ws_off before its block runs (workspace.c). */
    bool expands;
    laden_dtype expanded;
    uint64_t ws_off;
    /* fp8 from the checkpoint: its scale, tensor `scale` of the block
     * (LADEN_SCHED_NO_SCALE: none), applied as scale_kind, cols elements
     * a row; a scale not F32 widened at sws_off first (workspace.c). */
    uint32_t scale;
    laden_scale_kind scale_kind;
    uint64_t cols;
    uint64_t sws_off;
    /* laden_sched_set_lossless (compress.c): kept entropy-coded when its
     * block is on the RAM tier.  Compressed at load: `host` is then the
     * blob (the schedule's, host_owned), src_bytes and dst_bytes its size,
     * and ll what laden_lossless_check said of it (decoded by the
     * block's enter into the workspace, as an expanded tensor). */
    bool ll_asked;
    bool host_owned;
    laden_lossless_info *ll;
    /* Its blob read from this lossless cache file (llcache.c) at `off`,
     * src_bytes of it, instead of from files[file]; ll then filled in by
     * laden__sched_check_cached once the bytes are in (ll_unchecked until
     * then). */
    laden_io_file_t *cfile;
    bool ll_unchecked;
    /* Compressed at load and copied into its block's home by the encoder
     * (compress.c's settle_block): the load has nothing to put there. */
    bool in_home;
    /* Marked: its blob's size as estimated from samples of the file at
     * the mark (0: expected to stay as stored), what the plan counts for
     * the RAM tier (laden_plan_input's ram_block_bytes). */
    uint64_t ll_est;
} tref;

/* Where tensor r goes in its block once [0, end) is laid out: right
 * after the tensor before it when joined, else at the next multiple of
 * ALIGN (laden_sched_add_tensor's rule; compress.c packs a block again
 * by it, build.c counts a block's coded size on the RAM tier by it). */
static inline uint64_t laden__sched_place(const tref *r, uint64_t end)
{
    return r->joined ? end : (end + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
}

/* The start of block b's home mapping (b->ram less its shift). */
#define laden__sched_home_base(b) ((void *)((char *)(b)->ram - (b)->ram_shift))

/* The file tensor r is read from: the checkpoint's, or a lossless cache
 * file's. */
#define laden__sched_file(sc, r)                                           \
    ((r)->cfile ? (r)->cfile : (sc)->layout.files[(r)->file])

/* 1 if tensor r is kept as the checkpoint stores it, so that it can be
 * read straight into a slot: from the file, in the file's dtype. */
static inline bool laden__sched_as_stored(const tref *r)
{
    return !r->host && !r->in_home && r->src == r->dst && !r->rope_heads &&
           !r->pieces;
}


/* Where the float32 row scales of a tensor of nelem F8_E4M3 codes start
 * in its bytes: after the codes, 16-byte aligned (build.c lays them out,
 * convert.c writes them, laden_sched_tensor_layout says where). */
static inline uint64_t laden__sched_scale_offset(uint64_t nelem)
{
    return (nelem + 15) & ~(uint64_t)15;
}

/* Tensor r's stored bytes as laden_expand counts them: fp8 codes without
 * the row scales laid out after them, GGUF blocks, or whole elements. */
static inline uint64_t laden__sched_code_bytes(const tref *r)
{
    uint32_t elems = 1, bytes = 1;
    if (r->dst == LADEN_DTYPE_F8_E4M3 || r->dst == LADEN_DTYPE_F8_E5M2)
        return r->nelem;
    if (laden_dtype_block(r->dst, &elems, &bytes) == LADEN_OK && elems > 1)
        return r->nelem / elems * bytes;
    return r->nelem * (laden_dtype_bits(r->dst) / 8);
}

typedef struct blk {
    char *name;            /* laden_sched_set_block_name; NULL unnamed */
    uint64_t trace_entered; /* tracing: the session its open enters were
                               recorded in, and how many are open */
    uint32_t trace_open;
    const char *trace_name; /* name interned for the trace of ... */
    uint64_t trace_session; /* ... this session */
    laden_tier tier;
    laden_tier asked;      /* as added: LADEN_TIER_AUTO is the planner's */
    tref *t;
    uint32_t nt, cap;
    uint64_t bytes;        /* packed size, kept as tensors are added */
    uint64_t dev_bytes;    /* its device copy's (cache schedules: lossless
                              tensors decoded); = bytes otherwise */
    bool has_ll;           /* holds lossless tensors (once laid out) */
    bool has_compact;      /* holds other compact tensors (fp8 codes,
                              widened, ...: laid out with has_ll) */
    uint64_t ws_bytes;     /* its expanded tensors' workspace (workspace.c) */
    int32_t pos;           /* schedule position; -1 if not streamed */
    laden_devptr_t region; /* GPU tier on device; RAM tier on the CPU device;
                              cache schedules: the block's own device copy */
    void *ram;             /* RAM tier: pinned region (cache: pageable) */
    uint64_t ram_len;      /* cache schedules: the mapping's length */
    uint64_t ram_shift;    /* a home of its own: ram is this far past its
                              mapping's start (load.c's map_home), so
                              that its reads land in place */
    uint64_t read_shift;   /* laden__sched_read_shift, once laid out */
    bool filled;           /* cache schedules: host copy loaded */
    bool resident;         /* cache schedules: has a device copy of its own */
    bool in_place;         /* cache schedules, CPU device: the "device copy"
                              is the host copy itself (resident.c) */
    uint64_t voff;         /* cache schedules with a VBAR: its range there */
    uint64_t sig;          /* signature of the range when last written */
    bool pinned;           /* cache schedules: host copy pinned in place */
    uint64_t uploads;      /* cache schedules: times its device copy was
                              written from the host copy */
    bool ready;            /* its bytes are in place (a load in progress
                              marks the blocks as it goes: load.c) */
    bool offloaded;        /* VRAM tier without room at load: demoted to
                              the RAM tier (load.c) */
    bool shared;           /* its host copy is in sc->share.shm (share.c) */
    uint64_t share_off;    /* its place there */
    uint32_t running;      /* enters not exited yet (stream.c) */
    uint32_t experts;      /* laden_sched_set_experts: rows per tensor (0:
                              not an expert block) */
    uintptr_t enter_handle; /* the stream of its last enter, for an exit
                               laden_sched_end_all makes in its place */
} blk;

/* How far past a 4 KiB boundary block b's bytes should start so that its
 * tensors read from a file land at addresses congruent to their file
 * offsets modulo the 4 KiB O_DIRECT needs: their reads then land in place
 * instead of through the reader's bounce buffer and a copy, which halved
 * the reader's rate on the 2-core VM.  Tensors that lie as in the file
 * (whole 256-byte multiples in file order, as checkpoints of large
 * weights do) all want the same shift; where they want several (blobs
 * from a lossless cache file at 4 KiB multiples beside tensors read from
 * the checkpoint) the one most bytes want wins.  Only a multiple of 8
 * (safetensors puts its data at one: each tensor stays 8-byte aligned,
 * enough for every element and for the lossless format's words); 0 when
 * none is.
 * For a buffer that is only read into and copied from (a CUDA RAM-tier
 * home, a staging buffer), never one run in place. */
static inline uint64_t laden__sched_read_shift(const blk *b)
{
    enum { CANDIDATES = 8 };
    uint64_t shift[CANDIDATES], bytes[CANDIDATES];
    uint32_t n = 0, best = 0;
    for (uint32_t k = 0; k < b->nt; k++) {
        const tref *r = &b->t[k];
        if (!laden__sched_as_stored(r) || !r->src_bytes)
            continue;
        uint64_t want = (r->off - r->dst_off) & 4095u;
        if (want % 8)
            continue; /* never taken: it would misalign the elements */
        uint32_t j = 0;
        while (j < n && shift[j] != want)
            j++;
        if (j == n) {
            if (n == CANDIDATES)
                continue; /* a ninth way: too scattered to matter */
            shift[n] = want;
            bytes[n++] = 0;
        }
        bytes[j] += r->src_bytes;
        if (bytes[j] > bytes[best])
            best = j;
    }
    return n ? shift[best] : 0;
}

typedef struct sched_layout {
    blk *b;
    uint32_t nb, bcap;
    uint64_t max_blob;   /* the largest lossless blob (once laid out) */
    /* Set by laden__sched_relayout whenever the set of streamed blocks
     * changes (load, resident.c): */
    uint32_t *order;     /* position -> block */
    uint32_t nstreamed;
    /* The call order (run.c learns it from the blocks entered, a whole
     * pass at a time): each block's place in the last pass whose order was
     * taken, UINT32_MAX for a block never entered; streamed positions
     * follow it, else the order blocks were added in.  rec, seen, nrec:
     * the pass being watched. */
    uint32_t *call_rank, *rec;
    uint8_t *seen;
    uint32_t nrec, nrec_streamed; /* of rec, streamed (relayout counts) */
    bool learn_off; /* laden_sched_learn_order(0), or a capture was made */
    uint64_t slot_bytes; /* the largest streamed block: a slot's size */
    bool any_disk;       /* a streamed block reads from disk */
    /* Slot bytes charged to sc->cache.vram (laden__sched_charge_slots:
     * load.c as it places the blocks, run.c as it makes the slots). */
    uint64_t slot_charge;
    uint32_t max_nt; /* most tensors in one block */
    laden_io_t *io;
    bool own_io;
    laden_io_file_t **files;
    uint32_t nfiles;
    laden_host_t *host;
    bool laid_out;   /* load.c: offsets and tiers fixed */
    bool planned;    /* an AUTO block has a planned tier */
    /* Device memory the last plan left free beyond what it placed (the
     * expert cache's size when the caller does not give one). */
    uint64_t vram_spare;
    /* The last plan counted RAM-tier blocks at estimated coded sizes
     * (compress.c's marks): the RAM it had for the tier (less staging),
     * which the coded blocks must still fit once encoded. */
    bool ram_estimated;
    uint64_t ram_room;
    /* laden_sched_use_lossless_cache: each file's lossless cache
     * (llcache.c), NULL where it has none; how many were found and how
     * many were stale (made from another version of the file). */
    struct laden_llc **llc;
    uint32_t llc_found, llc_stale;
} sched_layout;

#endif

#ifndef LADEN_STREAM_TYPES_ONLY
#ifndef LADEN_STREAM_LAYOUT_H
#define LADEN_STREAM_LAYOUT_H

#include "stream_internal.h"

/* The description and the schedule itself: destroy's last step (and
 * create's on failure). */
void laden__sched_free_description(laden_sched_t *sc);
/* parts.c (below every file that calls them): */
/* 1 if block b runs from a slot. */
bool laden__sched_streamed(const laden_sched_t *sc, const blk *b);
/* Whether block b of a cache schedule has its device copy, which holds
 * its lossless tensors decoded (resident.c) instead of coded as its host
 * copy and slot do. */
static inline bool laden__sched_decoded_copy(const laden_sched_t *sc,
                                             const blk *b)
{
    return sc->cache.on && b->resident;
}
/* Positions and slot size after the set of streamed blocks changed. */
void laden__sched_relayout(laden_sched_t *sc);
/* Bytes charged to the VRAM context for the slots become `want`.
 * LADEN_E_BUDGET, with the charge as it was, if the context has no room. */
laden_status laden__sched_charge_slots(laden_sched_t *sc, uint64_t want);
/* The expansion workspace's bytes (workspace.c): the most any block's
 * expanded tensors need. */
uint64_t laden__sched_workspace_bytes(const laden_sched_t *sc);
/* The schedule's and a block's names for the trace (tracing only; the
 * block's NULL when it has none). */
const char *laden__sched_trace_name(laden_sched_t *sc);
const char *laden__sched_block_trace_name(blk *b);
/* build.c: */
/* LADEN_OK if tensor r can stream from disk, else the error naming it. */
laden_status laden__sched_disk_check(const tref *r);
/* Makes the planned blocks AUTO again: an input of the plan changed. */
void laden__sched_unplan(laden_sched_t *sc);
laden_status laden__sched_add_block(laden_sched_t *sc, laden_tier tier,
                                    uint32_t *out);
laden_status laden__sched_rope_rows(laden_sched_t *sc, uint32_t block,
                                    uint32_t index, uint64_t heads);
laden_status laden__sched_join_tensor(laden_sched_t *sc, uint32_t block,
                                      uint32_t index);
laden_status laden__sched_set_experts(laden_sched_t *sc, uint32_t block,
                                      uint32_t experts);
/* The tensors of the run that starts at tensor i of b: i and those joined
 * after it (1 for a tensor joined to nothing), and their bytes. */
uint32_t laden__sched_run_of(const blk *b, uint32_t i, uint64_t *bytes);
laden_status laden__sched_add_tensor(laden_sched_t *sc, uint32_t block,
                                     const laden_st_t *st, size_t st_index,
                                     laden_dtype dtype, uint32_t *out);
laden_status laden__sched_add_tensor_part(laden_sched_t *sc, uint32_t block,
                                          const laden_st_t *st,
                                          size_t st_index, laden_dtype dtype,
                                          uint32_t dim, uint64_t start,
                                          uint64_t count, uint32_t *out);
laden_status laden__sched_add_host_tensor(laden_sched_t *sc, uint32_t block,
                                          const void *src, laden_dtype sdt,
                                          uint64_t n, laden_dtype dtype,
                                          uint32_t *out);
uint64_t laden__sched_block_ram_bytes(const laden_sched_t *sc,
                                      uint32_t block);
laden_status laden__sched_plan(laden_sched_t *sc,
                               const laden_plan_input *budgets, int32_t *why,
                               laden_plan_result *out);
/* compress.c (calls build.c; load.c calls it): */
laden_status laden__sched_set_lossless(laden_sched_t *sc, uint32_t block,
                                       uint32_t i);
laden_status laden__sched_mark_lossless(laden_sched_t *sc, uint32_t *out);
/* llcache.c: the lossless cache files in dir of the schedule's files,
 * for the mark and the load (before either); freed by
 * laden__sched_llc_free (destroy). */
laden_status laden__sched_use_llc(laden_sched_t *sc, const char *dir);
void laden__sched_llc_free(laden_sched_t *sc);
/* Where a block encoded at load is put (load.c's, handed down so that
 * compress.c calls nothing above it): block b, packed at its coded
 * sizes, given its host memory within the RAM budget, beside `taken`
 * bytes of homes given so far (which it adds its own to). */
typedef laden_status (*laden_sched_place_fn)(laden_sched_t *sc, blk *b,
                                              _Atomic uint64_t *taken);
/* Before the layout is fixed: the marked tensors of RAM-tier blocks read
 * and encoded (on several threads), the blocks packed again at their new
 * sizes.  With `place`, each block's blobs go into its host memory as
 * soon as its last tensor is encoded; without, they are kept as host
 * tensors holding their blobs (a cache schedule's, copied when each
 * block is asked for). */
laden_status laden__sched_compress(laden_sched_t *sc,
                                   laden_sched_place_fn place);
/* The blobs, once the load copied them (and at destroy). */
void laden__sched_compress_free(laden_sched_t *sc);
/* Tensor r's blob freed, if it holds one of the schedule's (its bytes are
 * in its block now). */
void laden__sched_drop_blob(tref *r);
/* Block b's tensors read from lossless cache files, now in its host
 * memory: each blob checked (laden_lossless_check) and its info kept;
 * LADEN_E_CORRUPT naming the cache file and the tensor otherwise.  Before
 * the block is ready (load.c).  Nothing for a disk-tier block. */
laden_status laden__sched_check_cached(laden_sched_t *sc, blk *b);
/* Tensor r's blob from its lossless cache file, read to `at`: checked
 * (laden_lossless_check), its info kept the first time; a later read
 * (the disk tier reads at each fill, laden_sched_tensor_value reads
 * again) must find the same info, else the file changed: LADEN_E_CORRUPT,
 * naming the cache file and the tensor. */
laden_status laden__sched_check_blob(tref *r, const void *at);
/* laden__sched_check_blob for each of block b's tensors from a cache file,
 * b's bytes read to base (a disk-tier block's, at each read: run.c). */
laden_status laden__sched_check_blobs(laden_sched_t *sc, blk *b,
                                      const void *base);
int laden__sched_tensor_lossless(const laden_sched_t *sc, uint32_t block,
                                 uint32_t i);

#endif
#endif
