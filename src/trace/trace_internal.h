/* What the layers call to record trace events (see include/laden/trace.h).
 * Every call site tests LADEN__TRACING() first: one relaxed load and a
 * branch when no trace is on.  Not installed. */
#ifndef LADEN_TRACE_INTERNAL_H
#define LADEN_TRACE_INTERNAL_H

#include <stdatomic.h>

#include "../core/internal.h"
#include "laden/trace.h"

extern atomic_int laden__tracing;
#define LADEN__TRACING() \
    __builtin_expect(atomic_load_explicit(&laden__tracing, \
                                          memory_order_relaxed), 0)

/* The events, and what a record's fields hold for each.  `sched` is the
 * schedule's address (the trace numbers schedules), `s` a string that lives
 * until the trace is written: a literal or laden__trace_intern's. */
typedef enum laden__ev {
    LADEN__EV_ENTER,   /* thread: a=block b=sched c=1 streamed|2 miss,
                          s=block's name or NULL, s2=model */
    LADEN__EV_EXIT,    /* thread: a=block b=sched, s=block's name or NULL */
    LADEN__EV_READ,    /* thread span: a=offset b=bytes c=cached, s=file */
    LADEN__EV_H2D,     /* stream span (m0..m1): a=block b=bytes c=sched */
    LADEN__EV_COMPUTE, /* stream span (m0..m1): a=block c=sched */
    LADEN__EV_STALL,   /* stream span (m0..m1) or thread span: a=block
                          b=laden__stall c=sched
                          (these three: s=the block's name or NULL) */
    LADEN__EV_SYNC,    /* thread span: host blocked on a device, s=what */
    LADEN__EV_MISS,    /* instant: a=block c=sched, s=block's name or NULL */
    LADEN__EV_LOAD,    /* thread span: b=bytes read c=sched, s=model */
    LADEN__EV_UPLOAD,  /* thread span: a=model b=bytes, s=what */
    LADEN__EV_EVICT,   /* instant: a=model b=bytes, s=what */
    LADEN__EV_FAULT,   /* instant: b=bytes mapped, s=what */
    LADEN__EV_COUNTER, /* counter: a=value, s=name */
    LADEN__EV_RANGE_BEGIN, /* thread: s=name */
    LADEN__EV_RANGE_END,
    LADEN__EV_EXPAND,  /* stream span (m0..m1; the CPU device: thread
                          span): a block's compact tensors expanded (and
                          lossless ones decoded) into the workspace before
                          it runs; a=block b=bytes out c=sched, s=the
                          block's name or NULL, s2="decode" (lossless
                          tensors among them) or "expand" */
} laden__ev;

typedef enum laden__stall {
    LADEN__STALL_COPY = 0,  /* compute waited for the block's copy */
    LADEN__STALL_READS = 1, /* the host waited for the block's reads */
    LADEN__STALL_STAGING = 2, /* the host waited for a staging buffer */
} laden__stall;

typedef struct laden__trace_rec {
    /* The trace the record's marks and names were made in: read (with
     * laden__trace_session) before the first of them; 0 when it holds
     * none.  A record of a trace that has ended is dropped: its marks and
     * names were freed with it. */
    uint64_t session;
    uint64_t t;   /* host ns at the start */
    uint64_t dur; /* host ns (thread spans) */
    uint64_t a, b, c;
    void *m0, *m1; /* stream timing marks (laden__trace_mark) */
    const char *s, *s2;
    uint16_t ev;
    int16_t dev;
    uint32_t pad;
} laden__trace_rec;

/* Appends to the calling thread's ring (call only when LADEN__TRACING());
 * false if it was dropped (its trace ended, or max_events). */
bool laden__trace_emit(const laden__trace_rec *r);

/* A copy of s that lives until the trace is written; "" if out of memory. */
const char *laden__trace_intern(const char *s);

/* Shorthands (sess as in laden__trace_rec). */
static inline void laden__trace_span(laden__ev ev, uint64_t sess, uint64_t t0,
                                     uint64_t a, uint64_t b, uint64_t c,
                                     const char *s)
{
    uint64_t t1 = laden__now_ns();
    laden__trace_rec r = {.session = sess, .t = t0, .dur = t1 - t0, .a = a,
                          .b = b, .c = c, .s = s, .ev = (uint16_t)ev,
                          .dev = -1};
    laden__trace_emit(&r);
}
static inline void laden__trace_point(laden__ev ev, uint64_t sess,
                                      uint64_t a, uint64_t b, uint64_t c,
                                      const char *s)
{
    laden__trace_rec r = {.session = sess, .t = laden__now_ns(), .a = a,
                          .b = b, .c = c, .s = s, .ev = (uint16_t)ev,
                          .dev = -1};
    laden__trace_emit(&r);
}
/* A span between two stream marks (either may be NULL: nothing then). */
static inline void laden__trace_stream(laden__ev ev, uint64_t sess,
                                       int32_t dev, void *m0, void *m1,
                                       uint64_t a, uint64_t b, uint64_t c,
                                       const char *s)
{
    if (!m0 || !m1)
        return;
    laden__trace_rec r = {.session = sess, .t = laden__now_ns(), .a = a,
                          .b = b, .c = c, .m0 = m0, .m1 = m1, .s = s,
                          .ev = (uint16_t)ev, .dev = (int16_t)dev};
    laden__trace_emit(&r);
}

/* Stream marks: the device layer records a timing event on a stream
 * (laden__dev_trace_mark) and, when the trace is written, says when it
 * ran (host clock) and on which stream; then releases them all. */
typedef struct laden__trace_marks {
    /* true and *t_ns, *track when the mark's time could be read */
    bool (*resolve)(void *mark, uint64_t *t_ns, uint64_t *track);
    /* true and *ns from mark a to mark b (exact for short spans, where a
     * time from the trace's start is rounded as a float) */
    bool (*between)(void *a, void *b, uint64_t *ns);
    void (*release_all)(void);
} laden__trace_marks;
void laden__trace_set_marks(const laden__trace_marks *m);

/* Defined by the dev layer: records a mark on the stream; NULL when no
 * trace is on or the mark could not be made (the span is then left out). */
struct laden_dev_stream;
void *laden__dev_trace_mark(struct laden_dev_stream *s);

/* The session (a number that grows with each laden_trace_start). */
uint64_t laden__trace_session(void);
/* Whether the trace still keeps events (max_events not reached). */
bool laden__trace_room(void);

/* Memory that laden holds, kept always (a few atomic adds on allocations,
 * none on the hot path) and written as counter tracks while tracing. */
typedef enum laden__gauge {
    LADEN__GAUGE_DEVICE = 0, /* device_bytes: laden's device allocations */
    LADEN__GAUGE_SLOTS,      /* slot_bytes: streamed blocks' slots */
    LADEN__GAUGE_VBAR,       /* vbar_mapped_bytes: mapped VBAR pages */
    LADEN__GAUGE_ELASTIC,    /* elastic_bytes: elastic blocks in use */
    LADEN__GAUGE_PINNED,     /* pinned_bytes: host memory laden pinned
                                (on the CPU device: its host memory) */
    LADEN__GAUGE_N
} laden__gauge;
#define LADEN__GAUGE_DEVICES 64
void laden__gauge_add(laden__gauge g, int32_t device, int64_t delta);
uint64_t laden__gauge_get(laden__gauge g, int32_t device);

#endif
