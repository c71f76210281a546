/* trace: a timeline of what laden did, written as a Chrome / Perfetto trace
 * (the Trace Event Format: chrome://tracing or ui.perfetto.dev opens it).
 *
 * While a trace is on, every layer records events into a lock-free ring of
 * its calling thread: reads of the reader pool, host-to-device copies per
 * block, the compute stream's waits on them, enter and exit of every block,
 * misses, loads, cache uploads and evictions, VBAR faults and evictions,
 * elastic allocations, host synchronizations, and counters of the memory
 * laden holds (device memory, slots, mapped VBAR pages, elastic blocks,
 * pinned host memory).  Host times come from the monotonic clock; the
 * times of copies and kernels on a stream come from timing events recorded
 * on that stream and resolved when the trace stops, so tracing adds no
 * host synchronization.  When no trace is on, an event costs one branch.
 *
 * One trace at a time per process.  laden_trace_stop writes the file. */
#ifndef LADEN_TRACE_H
#define LADEN_TRACE_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Starts recording.  max_events bounds the events kept (0: 1048576, 80
 * bytes each); past it events are dropped and counted, and no more stream
 * times are taken.  A thread keeps its records' memory until it records in
 * a later trace (or exits).  LADEN_E_STATE while a trace is on. */
LADEN_API laden_status laden_trace_start(uint64_t max_events);

typedef struct laden_trace_result {
    uint64_t events;   /* events written */
    uint64_t dropped;  /* events past max_events, not kept */
    uint64_t threads;  /* host threads that recorded */
    uint64_t streams;  /* device streams with timed work */
    uint64_t unresolved; /* stream times that could not be read (written
                            with host times instead) */
    double seconds;    /* from start to stop */
} laden_trace_result_t;

/* Stops recording and writes the events to `path` (NULL: discards them).
 * Waits for the timing events recorded on streams, which have completed
 * by then unless work is still queued.  *out (may be NULL) says what was
 * written.  LADEN_E_STATE when no trace is on; LADEN_E_IO naming the path
 * when it cannot be written (the events are dropped either way). */
LADEN_API laden_status laden_trace_stop(const char *path,
                                        laden_trace_result_t *out);

/* 1 while a trace is on. */
LADEN_API int laden_trace_active(void);

/* A counter sampled by the caller (PyTorch's allocator, from Python), as a
 * counter track `name` of `device` (LADEN_DEVICE_CPU: the host).  Nothing
 * when no trace is on. */
LADEN_API void laden_trace_counter(const char *name, int32_t device,
                                   uint64_t value);

/* A named range on the calling thread's track (begin = 1 opens it, 0
 * closes the innermost).  Nothing when no trace is on. */
LADEN_API void laden_trace_range(const char *name, int begin);

#ifdef __cplusplus
}
#endif
#endif
