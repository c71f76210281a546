/* The schedule's load part (sc->load): a load in progress or done, its
 * failure, its progress callback, and the pinned homes it made.  Owner:
 * load.c (lay out, place on the device, read the checkpoint, in the
 * foreground or on laden_sched_load_begin's thread); parts.c marks the
 * thread started (loader_started) and counts the homes it pins
 * (pinned_homes), stream.c's laden_sched_destroy asks a loader thread to
 * destroy on its way out (destroy_asked) and its guard reads `ld` to
 * drive a load for the owner.  Not installed; see stream_layout.h for
 * how a part header is laid out. */
#ifndef LADEN_STREAM_LOAD_TYPES
#define LADEN_STREAM_LOAD_TYPES

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "../core/internal.h"
#include "laden/stream.h"

typedef struct laden_loader loader; /* a load in progress (load.c) */

typedef struct sched_load {
    /* A load in progress (ld), driven by whoever holds the schedule:
     * the caller of laden_sched_load, or laden_sched_load_begin's thread
     * a step at a time (stream.c's hold part). */
    loader *ld;
    bool loading;
    bool loader_started;        /* laden_sched_load_begin started it */
    _Atomic bool destroy_asked; /* destroy was called on the loader's
                                   thread (a GC in its progress callback):
                                   the thread destroys on its way out */
    laden_status err;           /* a background load's failure */
    char msg[512];
    laden_sched_progress_fn progress; /* called as blocks finish loading */
    void *progress_arg;
    uint64_t trace_t0;          /* tracing: when the load began */
    uint64_t stage_bytes;       /* CUDA GPU-tier staging pieces; 0: default
                                   (tests set a small one) */
    uint64_t pinned_homes;      /* CUDA RAM-tier blocks pinned in place */
} sched_load;

#endif

#ifndef LADEN_STREAM_TYPES_ONLY
#ifndef LADEN_STREAM_LOAD_H
#define LADEN_STREAM_LOAD_H

#include "stream_internal.h"

/* Loaded, or loading (its memory given, its bytes arriving: a block's
 * users wait for it with laden__sched_until), and not failed. */
static inline bool laden__sched_usable(const laden_sched_t *sc)
{
    return (sc->loaded || sc->load.loading) && !sc->load.err;
}

/* A VBAR of `total` bytes in vram, and its base address. */
laden_status laden__sched_new_vbar(laden_vram_t *vram, uint64_t total,
                                   laden_vbar_t **out, laden_devptr_t *base);
/* Frees the blocks' memory, slots, streams and events (not the
 * description): what load made. */
void laden__sched_free_all(laden_sched_t *sc);
/* A cache schedule's lossless upload buffers (resident.c makes them)
 * given back, once the uploads that read them are done. */
void laden__sched_free_scratch(laden_sched_t *sc);
/* Waits on the host for every upload queued: the copies and the decodes. */
void laden__sched_wait_uploads(laden_sched_t *sc);
/* laden_sched_destroy's work, on any thread but the loader's: the loader
 * stopped and joined, then free_all, then the description. */
void laden__sched_destroy(laden_sched_t *sc);
laden_status laden__sched_load(laden_sched_t *sc);
/* LADEN_OK if sc is loaded and has block `block`; else names `call`. */
laden_status laden__sched_check_block(laden_sched_t *sc, uint32_t block,
                                      const char *call);
laden_status laden__sched_load_block(laden_sched_t *sc, uint32_t block);
laden_status laden__sched_load_begin(laden_sched_t *sc);
laden_status laden__sched_load_wait(laden_sched_t *sc);
laden_status laden__sched_drive_for(laden_sched_t *sc, int64_t block,
                                    uint64_t deadline_ns, bool *done);
laden_status laden__sched_await_for(laden_sched_t *sc, int64_t block,
                                    uint32_t timeout_ms, int *out_done);
laden_status laden__sched_load_cancel(laden_sched_t *sc);
laden_status laden__sched_until(laden_sched_t *sc, uint32_t block);
void laden__sched_abandon_load(laden_sched_t *sc);
laden_status laden__sched_load_prepare(laden_sched_t *sc);
/* Pins RAM-tier block b's host copy in place (CUDA streaming
 * schedules).  In parts.c: share.c, below load.c, calls it too. */
laden_status laden__sched_pin_home(laden_sched_t *sc, blk *b);
/* A background load's failure, as the error of the call that meets it. */
laden_status laden__sched_load_failure(laden_sched_t *sc);
laden_status laden__sched_reread(laden_sched_t *sc, uint32_t block,
                                 uint32_t i);

#endif
#endif
