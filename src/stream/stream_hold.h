/* The schedule's hold part (sc->hold): one thread at a time.  The holding
 * thread's id, 0 when free, CLOSED once closed; the counts are the
 * holder's own.  laden_sched_load_begin's thread (loader_live until
 * joined) holds the schedule a step at a time as loader_tid, yielding to
 * the owner, who waits (owner_waiting) instead of being refused.  Owner:
 * stream.c (the guard every public call goes through); parts.c writes it
 * too, for the loader thread's start, join and holds (there, below
 * load.c, which drives the load on that thread).  build.c makes `mu` and
 * `cv` at create and destroys them with the description, load.c takes
 * `mu` to publish a background failure and share.c reads another
 * schedule's holder.  Not installed; see stream_layout.h for how a part
 * header is laid out. */
#ifndef LADEN_STREAM_HOLD_TYPES
#define LADEN_STREAM_HOLD_TYPES

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct sched_hold {
    _Atomic uint64_t holder;
    _Atomic bool loader_live;   /* a thread to join (claimed under mu) */
    pthread_t loader_thread;
    _Atomic uint64_t loader_tid;
    _Atomic int loader_stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t owner_waiting;     /* under mu */
    uint32_t depth;             /* holds of the holder, all kinds */
    uint32_t entered;           /* of those, blocks entered not yet exited */
    uint32_t begun;             /* of those, passes begun not yet ended */
} sched_hold;

#endif

#ifndef LADEN_STREAM_TYPES_ONLY
#ifndef LADEN_STREAM_HOLD_H
#define LADEN_STREAM_HOLD_H

#include "stream_internal.h"

/* In parts.c.  Whether the calling thread is the background loader's. */
bool laden__sched_on_loader(laden_sched_t *sc);
/* The background loader's thread and its holds. */
laden_status laden__sched_start_loader(laden_sched_t *sc,
                                       void *(*fn)(void *));
void laden__sched_join_loader(laden_sched_t *sc);
bool laden__sched_hold_loader(laden_sched_t *sc);
void laden__sched_unhold_loader(laden_sched_t *sc);

#endif
#endif
