/* The schedule's state, shared by the files of the stream layer:
 *   build.c     create, describe (add blocks and tensors), plan, destroy
 *   load.c      lay out, place on the device, read the checkpoint
 *   run.c       slots, prefetch, enter/exit, start/stop
 *   resident.c  cache schedules: device copies, pinning, VRAM contexts
 *   convert.c   dtype conversion
 *   stream.c    the one-thread guard and the public calls
 * The laden__sched_* operations below are the public calls' bodies: they
 * assume the caller holds the schedule (stream.c does).  Not installed. */
#ifndef LADEN_STREAM_INTERNAL_H
#define LADEN_STREAM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "../core/internal.h"
#include "../trace/trace_internal.h"
#include "laden/host.h"
#include "laden/stream.h"
#include "laden/vram.h"

/* Each tensor of a block starts at a multiple of this, for any kernel. */
#define ALIGN 256u

typedef struct tref {
    uint32_t file;
    uint64_t off;       /* absolute offset in the file */
    uint64_t src_bytes;
    laden_dtype src, dst;
    uint64_t nelem;
    uint64_t dst_off;   /* offset in the block's region */
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
} tref;

/* 1 if tensor r is kept as the checkpoint stores it, so that it can be
 * read straight into a slot: from the file, in the file's dtype. */
static inline bool laden__sched_as_stored(const tref *r)
{
    return !r->host && r->src == r->dst && !r->rope_heads && !r->pieces;
}

/* Where the float32 row scales of a tensor of nelem F8_E4M3 codes start
 * in its bytes: after the codes, 16-byte aligned (build.c lays them out,
 * convert.c writes them, laden_sched_tensor_layout says where). */
static inline uint64_t laden__sched_scale_offset(uint64_t nelem)
{
    return (nelem + 15) & ~(uint64_t)15;
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
    int32_t pos;           /* schedule position; -1 if not streamed */
    laden_devptr_t region; /* GPU tier on device; RAM tier on the CPU device;
                              cache schedules: the block's own device copy */
    void *ram;             /* RAM tier: pinned region (cache: pageable) */
    uint64_t ram_len;      /* cache schedules: the mapping's length */
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
    bool shared;           /* its host copy is in sc->shm (share.c) */
    uint64_t share_off;    /* its place there */
    uint32_t running;      /* enters not exited yet (stream.c) */
    uintptr_t enter_handle; /* the stream of its last enter, for an exit
                               laden_sched_end_all makes in its place */
} blk;

typedef struct laden_loader loader; /* a load in progress (load.c) */

typedef struct slot {
    laden_devptr_t ptr;
    int64_t block; /* whose bytes are here or arriving; -1: none */
    bool in_use;
    bool reads_pending;
    laden_event_t *ready, *free, *staging_free;
    void *staging;
    laden_io_req_t **reqs;
    uint32_t nreqs;
    laden_status err;
    char errmsg[512];
    uint64_t fills; /* the schedule's fill_seq when last filled */
    bool free_captured;  /* capturing: `free` was recorded in this capture */
    bool ready_captured; /* and `ready` */
    int64_t at_capture;  /* block held when the capture began */
    uint64_t fills_at_capture;
    void *trace_mark; /* tracing: the compute stream's mark after the wait */
    uint64_t trace_mark_session; /* the trace it belongs to */
} slot;

struct laden_sched {
    laden_sched_config cfg;
    char name[64];          /* laden_sched_set_name; "" unnamed */
    const char *trace_name; /* name interned for the trace of ... */
    uint64_t trace_session; /* ... this session */
    uint64_t slot_gauge;    /* slot bytes counted in the trace's gauge */
    uint64_t trace_load_t0; /* tracing: when the load began */
    bool cuda, loaded, broken, started;
    bool any_disk;
    laden_io_t *io;
    bool own_io;
    laden_io_file_t **files;
    uint32_t nfiles;
    blk *b;
    uint32_t nb, bcap;
    uint32_t *order; /* position -> block */
    uint32_t nstreamed;
    /* The direction blocks are entered in, from the last two streamed
     * positions entered: +1 in order (a forward), -1 in reverse (a
     * backward's recomputation); prefetches follow it. */
    int32_t dir;
    int64_t last_pos; /* -1: none yet */
    slot *slots;
    uint32_t nslots;
    uint64_t slot_bytes;
    uint32_t max_nt;
    laden_host_t *host;
    laden_dev_stream_t *copy;
    /* The compute stream of the last enter or exit, wrapped, and the one
     * before it (a training step exits blocks on the gradient sink's
     * stream: two handles alternate without wrapping again). */
    laden_dev_stream_t *compute, *compute_alt;
    uintptr_t compute_handle, compute_alt_handle;
    /* A pass being captured into a CUDA graph (laden_sched_capture_begin):
     * the copy stream is forked from the capturing stream and joined back
     * through `fork`; the bytes its copies move. */
    bool capturing;
    bool capture_alone;   /* LADEN_CAPTURE_STANDALONE */
    bool capture_broken;  /* a call was refused during it */
    uintptr_t capture_handle; /* the capturing stream */
    bool captured_events; /* slot events last recorded in a capture */
    int64_t cap_pos;      /* last_pos and dir when the capture began */
    int32_t cap_dir;
    laden_event_t *fork;
    uint64_t capture_h2d;
    bool cache;                 /* LADEN_SCHED_CACHE */
    bool laid_out;
    bool planned;   /* an AUTO block has a planned tier (build.c) */
    uint32_t nfilled;           /* cache: blocks whose host copy is loaded */
    laden_event_t *uploaded;    /* cache: after the last upload */
    laden_event_t *last_use;    /* cache: after the model's last work */
    bool fenced;
    laden_vbar_t *vbar;         /* device copies live here, or NULL */
    laden_devptr_t vbar_base;
    laden_vram_t *vram;         /* the VBAR's context (borrowed) */
    uint64_t slot_charge;       /* bytes charged to vram for the slots */
    laden_sched_stats_t st;
    /* One host copy shared between processes (share.c): asked for
     * (share_key set), then the segment once the load began. */
    char *share_key;            /* asked for; NULL: not shared */
    struct laden_shm *shm;
    bool share_created;
    char share_name[64];
    /* Asked for, but the segment's name was held by something else (a
     * segment of another content, a file laden did not make...): why; the
     * load kept a private copy.  "" otherwise. */
    char share_note[512];
    uint64_t pinned_homes;      /* CUDA RAM-tier blocks pinned in place */
    uint64_t fill_seq;          /* slot fills so far (laden_sched_slot_fills) */
    uint64_t stage_bytes;       /* CUDA GPU-tier staging pieces; 0: default
                                   (tests set a small one) */
    laden_sched_progress_fn progress; /* called as blocks finish loading */
    void *progress_arg;
    /* One thread at a time (stream.c): the holding thread's id, 0 when
     * free, CLOSED once closed.  The counts are the holder's own. */
    _Atomic uint64_t holder;
    /* A load in progress (sc->ld), driven by whoever holds the schedule;
     * laden_sched_load_begin's thread (loader_live until joined) holds it
     * a step at a time as loader_tid, yielding to the owner, who waits
     * (owner_waiting) instead of being refused (stream.c). */
    loader *ld;
    bool loading;
    _Atomic bool loader_live;   /* a thread to join (claimed under mu) */
    bool loader_started;        /* laden_sched_load_begin started it */
    _Atomic bool destroy_asked; /* destroy was called on the loader's
                                   thread (a GC in its progress callback):
                                   the thread destroys on its way out */
    pthread_t loader_thread;
    _Atomic uint64_t loader_tid;
    _Atomic int loader_stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t owner_waiting;     /* under mu */
    laden_status load_err;      /* a background load's failure */
    char load_msg[512];
    uint32_t depth;             /* holds of the holder, all kinds */
    uint32_t entered;           /* of those, blocks entered not yet exited */
    uint32_t begun;             /* of those, passes begun not yet ended */
};

/* ---- convert.c ---------------------------------------------------------- */

/* F32, F16 or BF16: the dtypes converted to. */
bool laden__convertible(laden_dtype d);
/* The dtypes converted from: those and fp8, which decode exactly. */
bool laden__decodable(laden_dtype d);
/* Quantizes rows x cols floats to e4m3 with one float32 scale per row
 * (amax / 448). */
void laden__quantize_rows(laden_dtype from, const void *src, uint64_t rows,
                          uint64_t cols, uint8_t *dst, float *scales);

/* ---- build.c ------------------------------------------------------------ */

/* LADEN_OK if tensor r can stream from disk, else the error naming it. */
laden_status laden__sched_disk_check(const tref *r);
/* Makes the planned blocks AUTO again: an input of the plan changed. */
void laden__sched_unplan(laden_sched_t *sc);
/* Frees the blocks' memory, slots, streams and events (not the
 * description): what load made. */
void laden__sched_free_all(laden_sched_t *sc);
laden_status laden__sched_add_block(laden_sched_t *sc, laden_tier tier,
                                    uint32_t *out);
laden_status laden__sched_rope_rows(laden_sched_t *sc, uint32_t block,
                                    uint32_t index, uint64_t heads);
/* Rows of n_rows x row_bytes at src, in GGUF's rope order over `heads`
 * heads, written to dst in transformers' order. */
void laden__unrope_rows(const void *src, void *dst, uint64_t n_rows,
                        uint64_t row_bytes, uint64_t heads);
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
laden_status laden__sched_plan(laden_sched_t *sc,
                               const laden_plan_input *budgets, int32_t *why,
                               laden_plan_result *out);

/* ---- load.c ------------------------------------------------------------- */

/* A VBAR of `total` bytes in vram, and its base address. */
laden_status laden__sched_new_vbar(laden_vram_t *vram, uint64_t total,
                                   laden_vbar_t **out, laden_devptr_t *base);
laden_status laden__sched_load(laden_sched_t *sc);
laden_status laden__sched_load_block(laden_sched_t *sc, uint32_t block);
laden_status laden__sched_load_begin(laden_sched_t *sc);
laden_status laden__sched_load_wait(laden_sched_t *sc);
laden_status laden__sched_drive_for(laden_sched_t *sc, int64_t block,
                                    uint64_t deadline_ns, bool *done);
laden_status laden__sched_await_for(laden_sched_t *sc, int64_t block,
                                    uint32_t timeout_ms, int *out_done);
laden_status laden__sched_load_cancel(laden_sched_t *sc);
laden_status laden__sched_own_copy(laden_sched_t *sc, uint32_t block,
                                   int *out_made);
laden_status laden__sched_until(laden_sched_t *sc, uint32_t block);
void laden__sched_abandon_load(laden_sched_t *sc);
laden_status laden__sched_load_prepare(laden_sched_t *sc);
/* Pins RAM-tier block b's host copy in place (CUDA streaming
 * schedules). */
laden_status laden__sched_pin_home(laden_sched_t *sc, blk *b);
/* A background load's failure, as the error of the call that meets it. */
laden_status laden__sched_load_failure(laden_sched_t *sc);
bool laden__sched_on_loader(laden_sched_t *sc);
/* stream.c: the background loader's thread and its holds. */
laden_status laden__sched_start_loader(laden_sched_t *sc,
                                       void *(*fn)(void *));
void laden__sched_join_loader(laden_sched_t *sc);
bool laden__sched_hold_loader(laden_sched_t *sc);
void laden__sched_unhold_loader(laden_sched_t *sc);

/* ---- share.c ------------------------------------------------------------ */

laden_status laden__sched_share(laden_sched_t *sc, const char *key);
laden_status laden__sched_share_info(laden_sched_t *sc, char *name,
                                     size_t name_cap, uint64_t *out_bytes,
                                     int32_t *out_state);
/* At the start of a load, after layout and before device placement: the
 * blocks that go into the shared segment chosen, the segment opened
 * (made or attached to); nothing if sharing was not asked for. */
laden_status laden__sched_share_open(laden_sched_t *sc);
/* The load ended (ok or not): a segment this process made is marked
 * ready or failed (one it attached to was waited for, and its blocks
 * pinned, in laden__sched_share_open).  Called by load.c once the reads
 * are done. */
laden_status laden__sched_share_end(laden_sched_t *sc, laden_status s);
/* Closes the segment (free_all). */
void laden__sched_share_close(laden_sched_t *sc);
/* Every load of a checkpoint, at its start (load.c layout, once per
 * schedule): removes the segments that processes which ended left in
 * LADEN_SHM_DIR (laden_shm_reclaim), whether this load shares or not. */
void laden__sched_share_sweep(laden_sched_t *sc);
laden_status laden__sched_share_note(laden_sched_t *sc, char *why,
                                     size_t why_cap);
/* How long a load waits for a segment whose maker in this process was
 * prepared on another thread and not begun (10 s; tests shorten it). */
extern uint32_t laden__share_prepared_wait_ms;
/* Whether block b's host copy comes from another process's load. */
static inline bool laden__sched_attached(const laden_sched_t *sc,
                                         const blk *b)
{
    return b->shared && !sc->share_created;
}

/* ---- run.c -------------------------------------------------------------- */

/* 1 if block b runs from a slot. */
bool laden__sched_streamed(const laden_sched_t *sc, const blk *b);

/* Loaded, or loading (its memory given, its bytes arriving: a block's
 * users wait for it with laden__sched_until), and not failed. */
static inline bool laden__sched_usable(const laden_sched_t *sc)
{
    return (sc->loaded || sc->loading) && !sc->load_err;
}
/* Positions and slot size after the set of streamed blocks changed. */
void laden__sched_relayout(laden_sched_t *sc);
/* Bytes charged to the VRAM context for the slots become `want`.
 * LADEN_E_BUDGET, with the charge as it was, if the context has no room. */
laden_status laden__sched_charge_slots(laden_sched_t *sc, uint64_t want);
/* Frees the slots and staging, after their copies and reads. */
void laden__sched_free_slots(laden_sched_t *sc);
/* The compute stream of CUDA handle `handle`, wrapped once. */
laden_status laden__sched_compute_stream(laden_sched_t *sc, uintptr_t handle);
laden_status laden__sched_forget_stream(laden_sched_t *sc, uintptr_t handle);
laden_status laden__sched_capture_begin(laden_sched_t *sc, uintptr_t handle,
                                        uint32_t flags);
laden_status laden__sched_capture_end(laden_sched_t *sc, uintptr_t handle,
                                      laden_sched_capture_t **out);
laden_status laden__sched_replay_begin(laden_sched_t *sc, uintptr_t handle,
                                       const laden_sched_capture_t *c);
laden_status laden__sched_replay_end(laden_sched_t *sc, uintptr_t handle,
                                     const laden_sched_capture_t *c);
/* LADEN_OK if sc is loaded and has block `block`; else names `call`. */
laden_status laden__sched_check_block(laden_sched_t *sc, uint32_t block,
                                      const char *call);
/* The schedule's and a block's names for the trace (tracing only; the
 * block's NULL when it has none). */
const char *laden__sched_trace_name(laden_sched_t *sc);
const char *laden__sched_block_trace_name(blk *b);

laden_status laden__sched_start(laden_sched_t *sc, uint32_t lookahead);
laden_status laden__sched_stop(laden_sched_t *sc);
laden_status laden__sched_enter(laden_sched_t *sc, uint32_t block,
                                uintptr_t handle);
laden_status laden__sched_exit(laden_sched_t *sc, uint32_t block,
                               uintptr_t handle);
laden_status laden__sched_synchronize(laden_sched_t *sc);
laden_status laden__sched_slot_fills(laden_sched_t *sc, uint32_t block,
                                     uint64_t *out);
laden_status laden__sched_refill(laden_sched_t *sc);
laden_status laden__sched_reread(laden_sched_t *sc, uint32_t block,
                                 uint32_t i);
laden_status laden__sched_tensor_ptr(laden_sched_t *sc, uint32_t block,
                                     uint32_t i, laden_devptr_t *out);
laden_status laden__sched_host_ptr(laden_sched_t *sc, uint32_t block,
                                   uint32_t i, void **out);

/* ---- resident.c --------------------------------------------------------- */

laden_status laden__sched_set_resident(laden_sched_t *sc, uint32_t block,
                                       int on);
laden_status laden__sched_take_resident(laden_sched_t *sc, uint32_t block,
                                        laden_devptr_t *out_ptr,
                                        uint64_t *out_bytes);
laden_status laden__sched_set_resident_at(laden_sched_t *sc, uint32_t block,
                                          laden_devptr_t ptr, uint64_t bytes);
laden_status laden__sched_use_vram(laden_sched_t *sc, laden_vram_t *vram);
laden_status laden__sched_reserve_vram(laden_sched_t *sc, const uint8_t *want,
                                       uint32_t n);
laden_status laden__sched_pin(laden_sched_t *sc, uint32_t block, int on);
laden_status laden__sched_ready(laden_sched_t *sc, uintptr_t handle);
laden_status laden__sched_copy_fills(laden_sched_t *sc, uint32_t block,
                                     uint64_t *out);
laden_status laden__sched_reupload(laden_sched_t *sc, uint32_t block);
laden_status laden__sched_fence(laden_sched_t *sc, uintptr_t handle);

#endif
