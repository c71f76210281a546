/* The schedule, made of its parts.  Each part is a struct of its own,
 * declared in the header of the file that owns it, which says who else
 * may write it:
 *   sc->layout   stream_layout.h   build.c    blocks, tensors, files
 *   sc->load     stream_load.h     load.c     a load in progress or done
 *   sc->run      stream_run.h      run.c      slots, streams, the pass
 *   sc->capture  stream_run.h      run.c      a pass captured as a graph
 *   sc->cache    stream_cache.h    resident.c cache schedules' copies
 *   sc->share    stream_share.h    share.c    the shared host copy
 *   sc->hold     stream_hold.h     stream.c   the one-thread guard
 * (convert.c's stream_convert.h has no part; grads.c has none either.)
 * parts.c defines the few operations of the layout, run, load and hold
 * parts that files below their owner need, each declared in its part's
 * header.  The files call only downwards, bottom to top:
 *   parts.c, convert.c   call no file of the layer
 *   build.c              convert.c
 *   share.c              parts.c
 *   load.c               parts.c, build.c, share.c, convert.c
 *   run.c                parts.c, load.c
 *   resident.c           parts.c, build.c, load.c, run.c
 *   stream.c             all of them (the public laden_sched_* calls)
 * (grads.c calls convert.c only; experts.c, the run part's expert
 * cache, calls build.c, and run.c and parts.c call it; workspace.c, the
 * expansion workspace, calls convert.c; compress.c, the lossless
 * tensors, calls build.c and workspace.c, and load.c calls it.)
 * Here only the types: a file calls another's laden__sched_* operations
 * by including that file's part header, so its includes say which files
 * it depends on.  The operations are the public calls' bodies: they
 * assume the caller holds the schedule (stream.c does).  Not installed. */
#ifndef LADEN_STREAM_INTERNAL_H
#define LADEN_STREAM_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/internal.h"
#include "../trace/trace_internal.h"
#include "laden/host.h"
#include "laden/stream.h"
#include "laden/vram.h"

/* The parts' types without their files' operations. */
#define LADEN_STREAM_TYPES_ONLY
#include "stream_cache.h"
#include "stream_hold.h"
#include "stream_layout.h"
#include "stream_load.h"
#include "stream_run.h"
#include "stream_share.h"
#undef LADEN_STREAM_TYPES_ONLY

struct laden_sched {
    /* Fixed at create (build.c), or set once by the load (loaded, broken)
     * and read by every file. */
    laden_sched_config cfg;
    char name[64];          /* laden_sched_set_name; "" unnamed */
    const char *trace_name; /* name interned for the trace of ... */
    uint64_t trace_session; /* ... this session */
    bool cuda, loaded, broken;
    laden_sched_stats_t st; /* counted by load.c, run.c and resident.c */
    sched_layout layout;
    sched_load load;
    sched_run run;
    sched_capture capture;
    sched_cache cache;
    sched_share share;
    sched_hold hold;
};

#endif
