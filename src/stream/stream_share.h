/* The schedule's share part (sc->share): one host copy shared between
 * processes: asked for (key set), then the segment once the load began.
 * Owner and only writer: share.c; build.c's laden_sched_share call and
 * load.c read `key` to know whether sharing was asked for.  Not
 * installed; see stream_layout.h for how a part header is laid out. */
#ifndef LADEN_STREAM_SHARE_TYPES
#define LADEN_STREAM_SHARE_TYPES

#include <stdbool.h>

struct laden_shm;

typedef struct sched_share {
    char *key;                  /* asked for; NULL: not shared */
    struct laden_shm *shm;
    bool created;               /* this process made the segment */
    char name[64];
    /* Asked for, but the segment's name was held by something else (a
     * segment of another content, a file laden did not make...): why; the
     * load kept a private copy.  "" otherwise. */
    char note[512];
} sched_share;

#endif

#ifndef LADEN_STREAM_TYPES_ONLY
#ifndef LADEN_STREAM_SHARE_H
#define LADEN_STREAM_SHARE_H

#include "stream_internal.h"

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
    return b->shared && !sc->share.created;
}

#endif
#endif
