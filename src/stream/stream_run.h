/* The schedule's run part (sc->run) and capture part (sc->capture): the
 * slots streamed blocks run from, the copy and compute streams, where the
 * pass is and which way it goes, and a pass being captured into a CUDA
 * graph.  Owner: run.c (start/stop, enter/exit, prefetch, capture and
 * replay); parts.c's laden__sched_free_slots frees the slots and destroys
 * the streams (there, below load.c, whose free_all calls it too), and
 * resident.c uses the copy stream for the uploads of cache schedules.
 * Not installed; see stream_layout.h for how a part header is laid out. */
#ifndef LADEN_STREAM_RUN_TYPES
#define LADEN_STREAM_RUN_TYPES

#include <stdbool.h>
#include <stdint.h>

#include "../core/internal.h"
#include "laden/stream.h"

typedef struct slot {
    laden_devptr_t ptr;
    int64_t block; /* whose bytes are here or arriving; -1: none */
    bool in_use;
    bool reads_pending;
    laden_event_t *ready, *free, *staging_free;
    void *staging;        /* CUDA's disk tier: read into, copied from */
    uint64_t staging_bytes;
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
    /* An expert block's rows in the slot (laden_sched_enter_experts): bit
     * e set when expert e's rows are there, for block rows_block (-1:
     * none; any other fill of the slot makes it -1). */
    uint64_t *rows_ok;
    uint32_t rows_words;
    int64_t rows_block;
} slot;

/* One entry of the expert cache: the rows of expert `expert` of block
 * `block` (-1: free), last used by fill `used`. */
typedef struct expert_entry {
    int64_t block;
    uint32_t expert;
    uint64_t used;
} expert_entry;

/* The expert cache (experts.c): experts of streamed expert blocks kept
 * in device memory between their enters, so that one routed again after
 * its slot went to another block is copied from there instead of across
 * the link.  Made with the slots, freed with them. */
typedef struct expert_cache {
    bool set;              /* laden_sched_set_expert_cache was called */
    uint64_t ask;          /* its bytes (set) */
    laden_devptr_t base;   /* n entries of entry_bytes; 0: no cache */
    uint64_t entry_bytes;  /* the largest expert (its rows in every tensor) */
    uint32_t n;
    expert_entry *e;
    int32_t **where;       /* per block: per expert, its entry or -1 (NULL
                              for a block whose experts do not stream) */
    uint32_t **count;      /* per block: per expert, the fills routed to
                              it, halved every `window` counted */
    uint64_t counted;      /* counted since the last halving */
    uint64_t window;
    uint64_t rng;          /* sampling the victims of a large cache */
    uint64_t tick;         /* fills so far */
    uint64_t charged;      /* bytes charged to the VRAM context */
} expert_cache;

typedef struct sched_run {
    bool started;
    /* The direction blocks are entered in, from the last two streamed
     * positions entered: +1 in order (a forward), -1 in reverse (a
     * backward's recomputation); prefetches follow it. */
    int32_t dir;
    int64_t last_pos; /* -1: none yet */
    slot *slots;
    uint32_t nslots;
    uint64_t slot_gauge;  /* slot bytes counted in the trace's gauge */
    laden_devptr_t workspace; /* expansions (workspace.c), with the slots */
    uint64_t workspace_bytes; /* its size, as charged */
    /* CUDA, a schedule with lossless tensors: a word per block in pinned
     * host memory, which the device decoder sets when a blob's codes are
     * wrong (laden__sched_ll_damage reads those of ll_blocks, the blocks
     * with such tensors).  Made at the first start, kept across stop and
     * start (a damage seen once stays), freed with the load. */
    uint32_t *ll_bad;
    uint32_t *ll_blocks, n_ll_blocks;
    uint64_t fill_seq;    /* slot fills so far (laden_sched_slot_fills) */
    laden_dev_stream_t *copy;
    /* The compute stream of the last enter or exit, wrapped, and the one
     * before it (a training step exits blocks on the gradient sink's
     * stream: two handles alternate without wrapping again). */
    laden_dev_stream_t *compute, *compute_alt;
    uintptr_t compute_handle, compute_alt_handle;
    expert_cache xc;
} sched_run;

/* A pass being captured into a CUDA graph (laden_sched_capture_begin):
 * the copy stream is forked from the capturing stream and joined back
 * through `fork`; the bytes its copies move. */
typedef struct sched_capture {
    bool on;
    bool made;       /* a capture was begun: positions are fixed */
    bool alone;      /* LADEN_CAPTURE_STANDALONE */
    bool broken;     /* a call was refused during it */
    uintptr_t handle; /* the capturing stream */
    bool events;     /* slot events last recorded in a capture */
    int64_t pos;     /* run.last_pos and run.dir when the capture began */
    int32_t dir;
    laden_event_t *fork;
    uint64_t h2d;
} sched_capture;

#endif

#ifndef LADEN_STREAM_TYPES_ONLY
#ifndef LADEN_STREAM_RUN_H
#define LADEN_STREAM_RUN_H

#include "stream_internal.h"

/* Frees the slots and staging, after their copies and reads.  In
 * parts.c: load.c's free_all, below run.c, calls it too. */
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

laden_status laden__sched_start(laden_sched_t *sc, uint32_t lookahead);
laden_status laden__sched_learn_order(laden_sched_t *sc, int on);
laden_status laden__sched_stop(laden_sched_t *sc);
laden_status laden__sched_enter(laden_sched_t *sc, uint32_t block,
                                uintptr_t handle);
laden_status laden__sched_enter_experts(laden_sched_t *sc, uint32_t block,
                                        const uint32_t *experts, uint32_t n,
                                        uintptr_t handle);
laden_status laden__sched_exit(laden_sched_t *sc, uint32_t block,
                               uintptr_t handle);
laden_status laden__sched_synchronize(laden_sched_t *sc);
laden_status laden__sched_slot_fills(laden_sched_t *sc, uint32_t block,
                                     uint64_t *out);
laden_status laden__sched_refill(laden_sched_t *sc);
laden_status laden__sched_tensor_ptr(laden_sched_t *sc, uint32_t block,
                                     uint32_t i, laden_devptr_t *out);
laden_status laden__sched_host_ptr(laden_sched_t *sc, uint32_t block,
                                   uint32_t i, void **out);

/* experts.c: the expert cache, made with the slots (laden__sched_start)
 * and freed with them (laden__sched_free_slots).  Calls no file of the
 * layer but build.c's laden__sched_run_of. */
laden_status laden__sched_set_expert_cache(laden_sched_t *sc, uint64_t bytes);
laden_status laden__sched_experts_make(laden_sched_t *sc);
void laden__sched_experts_free(laden_sched_t *sc);
/* A new fill of expert rows begins: entries used from now on are this
 * fill's (laden__sched_expert_claim takes none of them). */
void laden__sched_experts_begin(laden_sched_t *sc);
/* The fill routes to expert e of block bi (once per fill): counted. */
void laden__sched_expert_count(laden_sched_t *sc, uint32_t bi, uint32_t e);
/* Expert e of block bi's entry, marked used by this fill, or -1. */
int64_t laden__sched_expert_find(laden_sched_t *sc, uint32_t bi, uint32_t e);
/* An entry for expert e of block bi, which is not cached: a free one,
 * else the least often routed (of equals the least recently used), not
 * used by this fill, when e was routed to more often (its expert is
 * forgotten); -1 when e is not kept or there is no cache. */
int64_t laden__sched_expert_claim(laden_sched_t *sc, uint32_t bi,
                                  uint32_t e);
/* Copies expert e of block bi between its entry and slot memory at `at`
 * (the block's first byte there): into the slot (to_slot) or out of it,
 * on the copy stream (the CPU device: now). */
laden_status laden__sched_expert_copy(laden_sched_t *sc, uint32_t bi,
                                      uint32_t e, int64_t entry,
                                      laden_devptr_t at, bool to_slot);

/* workspace.c: the expansion workspace, made and freed with the slots. */
laden_status laden__sched_set_expanded(laden_sched_t *sc, uint32_t block,
                                       uint32_t i, laden_dtype compute,
                                       uint64_t cols, uint32_t scale,
                                       laden_scale_kind kind);
/* run.c: expands block's compact tensors into the workspace on `handle`
 * (the stream it is entered on; the CPU device: now), after its bytes are
 * in place: laden__sched_enter's last step. */
laden_status laden__sched_expand_block(laden_sched_t *sc, uint32_t block,
                                       uintptr_t handle);
/* value.c: laden_sched_tensor_value's work. */
laden_status laden__sched_tensor_value(laden_sched_t *sc, uint32_t block,
                                       uint32_t i, laden_dtype dtype,
                                       void *dst, uint64_t dst_bytes);
/* LADEN_OK, or laden_expand_ready's error, where a tensor expands. */
laden_status laden__sched_can_expand(laden_sched_t *sc);
laden_status laden__sched_expanded_at(laden_sched_t *sc, uint32_t block,
                                      uint32_t i, laden_devptr_t *ptr,
                                      uint64_t *bytes);

#endif
/* LADEN_E_CORRUPT naming the block if the device decoder found a lossless
 * blob's codes wrong in any decode so far (CUDA: seen once the compute
 * stream has passed it), else LADEN_OK.  laden_sched_enter and
 * laden_sched_synchronize ask it: once set, every later enter is refused. */
laden_status laden__sched_ll_damage(laden_sched_t *sc);


#endif
