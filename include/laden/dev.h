/* dev: the device table.  One interface, two implementations: CUDA (the
 * driver, libcuda.so.1, is opened at run time; no CUDA SDK is needed to
 * build) and CPU (the same interface over host memory, with a worker thread
 * per stream standing in for the copy engine).
 *
 * Devices are named by an index: LADEN_DEVICE_CPU (-1) is the CPU device,
 * 0..n-1 are CUDA devices as the driver orders them (PyTorch's cuda:N when
 * CUDA_VISIBLE_DEVICES is the same).  CUDA work runs in the device's primary
 * context, the one PyTorch uses.  Set LADEN_DISABLE_CUDA=1 to hide CUDA.
 *
 * Ordering is by streams and events as in CUDA: work on one stream runs in
 * order; laden_dev_stream_wait_event makes a stream wait for the last record
 * of an event without blocking the host.  All calls may come from any
 * thread. */
#ifndef LADEN_DEV_H
#define LADEN_DEV_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LADEN_DEVICE_CPU (-1)

typedef uint64_t laden_devptr_t; /* device address (CPU: a host address) */
typedef uint64_t laden_phys_t;   /* a physical allocation for VA mapping */
typedef struct laden_dev_stream laden_dev_stream_t;
typedef struct laden_event laden_event_t;

typedef enum laden_dev_kind {
    LADEN_DEV_KIND_CPU = 0,
    LADEN_DEV_KIND_CUDA = 1,
} laden_dev_kind;

typedef struct laden_dev_info {
    int32_t device;
    laden_dev_kind kind;
    char name[128];
    uint64_t total_bytes;
    int32_t cc_major, cc_minor;   /* CUDA compute capability; 0 on CPU */
    int32_t vmm_supported;        /* virtual memory management calls work */
    uint64_t vmm_granularity_bytes; /* page size for va/phys calls */
} laden_dev_info_t;

/* Number of CUDA devices; 0 (and LADEN_OK) without a usable driver, in
 * which case laden_dev_cuda_error() says why. */
LADEN_API laden_status laden_dev_count(int32_t *out_cuda_count);
/* Why CUDA is unavailable ("" when it is available).  Static storage. */
LADEN_API const char *laden_dev_cuda_error(void);

LADEN_API laden_status laden_dev_info(int32_t device, laden_dev_info_t *out);
/* Free and total bytes of device memory (CPU: MemAvailable / MemTotal). */
LADEN_API laden_status laden_dev_mem_info(int32_t device, uint64_t *out_free,
                                          uint64_t *out_total);

/* Streams.  create: a new non-blocking stream owned by the caller.  wrap: an
 * existing CUDA stream handle (e.g. torch.cuda.current_stream().cuda_stream)
 * that laden orders work on but does not own (CPU: LADEN_E_UNSUPPORTED).
 * destroy waits for the stream's queued work, then frees it; NULL: no-op. */
LADEN_API laden_status laden_dev_stream_create(int32_t device,
                                               laden_dev_stream_t **out);
LADEN_API laden_status laden_dev_stream_wrap(int32_t device, uintptr_t handle,
                                             laden_dev_stream_t **out);
LADEN_API void laden_dev_stream_destroy(laden_dev_stream_t *stream);

/* The stream's CUDA handle (a CUstream), for a caller that orders its own
 * work after it; 0 on the CPU device. */
LADEN_API uintptr_t laden_dev_stream_handle(laden_dev_stream_t *stream);
/* Blocks the calling thread until the stream's queued work is done. */
LADEN_API laden_status laden_dev_stream_synchronize(laden_dev_stream_t *stream);
/* Makes the stream wait for the event's last record; does not block. */
LADEN_API laden_status laden_dev_stream_wait_event(laden_dev_stream_t *stream,
                                                   laden_event_t *event);

/* CUDA graphs.  capturing: *out 1 while the stream is capturing a graph
 * (always 0 on the CPU device).  capture_begin starts capturing the stream's
 * work (thread-local mode: other threads' calls are not refused), and
 * capture_end ends it and instantiates the graph, which graph_launch
 * replays on a stream.  The CPU device: LADEN_E_UNSUPPORTED. */
typedef struct laden_dev_graph laden_dev_graph_t;
LADEN_API laden_status laden_dev_stream_capturing(laden_dev_stream_t *stream,
                                                  int *out);
LADEN_API laden_status laden_dev_graph_capture_begin(laden_dev_stream_t *stream);
LADEN_API laden_status laden_dev_graph_capture_end(laden_dev_stream_t *stream,
                                                   laden_dev_graph_t **out);
LADEN_API laden_status laden_dev_graph_launch(laden_dev_graph_t *graph,
                                              laden_dev_stream_t *stream);
LADEN_API void laden_dev_graph_destroy(laden_dev_graph_t *graph);

/* Events.  timing != 0 allows laden_dev_event_elapsed_ms. */
LADEN_API laden_status laden_dev_event_create(int32_t device, int timing,
                                              laden_event_t **out);
LADEN_API void laden_dev_event_destroy(laden_event_t *event);
LADEN_API laden_status laden_dev_event_record(laden_event_t *event,
                                              laden_dev_stream_t *stream);
/* Blocks until the last record has completed (at once if never recorded). */
LADEN_API laden_status laden_dev_event_synchronize(laden_event_t *event);
/* *out_done = 1 if the last record has completed; does not block. */
LADEN_API laden_status laden_dev_event_query(laden_event_t *event,
                                             int *out_done);
LADEN_API laden_status laden_dev_event_elapsed_ms(laden_event_t *start,
                                                  laden_event_t *end,
                                                  float *out_ms);

/* Asynchronous copies on a stream.  Host memory from laden_dev_host_alloc
 * (pinned) moves at copy-engine speed; pageable memory works, slower, and
 * must stay valid until the stream has passed the copy. */
LADEN_API laden_status laden_dev_copy_h2d(laden_dev_stream_t *stream,
                                          laden_devptr_t dst, const void *src,
                                          uint64_t size_bytes);
LADEN_API laden_status laden_dev_copy_d2h(laden_dev_stream_t *stream, void *dst,
                                          laden_devptr_t src,
                                          uint64_t size_bytes);
LADEN_API laden_status laden_dev_copy_d2d(laden_dev_stream_t *stream,
                                          laden_devptr_t dst,
                                          laden_devptr_t src,
                                          uint64_t size_bytes);

/* Device memory (cuMemAlloc; CPU: aligned host memory). */
LADEN_API laden_status laden_dev_mem_alloc(int32_t device, uint64_t size_bytes,
                                           laden_devptr_t *out);
LADEN_API laden_status laden_dev_mem_free(int32_t device, laden_devptr_t ptr);

/* Pinned host memory usable for fast copies to the device (CUDA:
 * cuMemHostAlloc, portable; CPU: aligned host memory).  It starts at a
 * 4 KiB page boundary on every device (reads with O_DIRECT land in it in
 * place), though the driver packs its own allocations more tightly. */
LADEN_API laden_status laden_dev_host_alloc(int32_t device, uint64_t size_bytes,
                                            void **out);
LADEN_API laden_status laden_dev_host_free(int32_t device, void *ptr);

/* Pins host memory the caller allocated, in place, so copies from it run
 * at copy-engine speed (CUDA: cuMemHostRegister, portable; CPU: nothing to
 * do).  ptr and size_bytes must be multiples of the page size.  Unregister
 * after the copies from it have finished. */
LADEN_API laden_status laden_dev_host_register(int32_t device, void *ptr,
                                               uint64_t size_bytes);
LADEN_API laden_status laden_dev_host_unregister(int32_t device, void *ptr);

/* Virtual memory: reserve an address range, create physical pages, map them
 * (read-write for this device) and unmap them.  Sizes and addresses are
 * multiples of vmm_granularity_bytes.  CPU: emulated with mmap over memfd
 * pages, so the same code paths run everywhere. */
LADEN_API laden_status laden_dev_va_reserve(int32_t device, uint64_t size_bytes,
                                            laden_devptr_t *out);
LADEN_API laden_status laden_dev_va_release(int32_t device, laden_devptr_t va,
                                            uint64_t size_bytes);
LADEN_API laden_status laden_dev_phys_create(int32_t device,
                                             uint64_t size_bytes,
                                             laden_phys_t *out);
LADEN_API laden_status laden_dev_phys_release(int32_t device,
                                              laden_phys_t phys);
LADEN_API laden_status laden_dev_map(int32_t device, laden_devptr_t va,
                                     uint64_t size_bytes, laden_phys_t phys);
LADEN_API laden_status laden_dev_unmap(int32_t device, laden_devptr_t va,
                                       uint64_t size_bytes);

/* For tests of the failure paths (CPU device only): the n-th virtual
 * memory allocation call from now on (va_reserve, phys_create, map) fails
 * as a device out of memory would; 0 turns injection off.  Returns how
 * many such calls were made since the previous call.  And the number of
 * reservations and physical handles alive, to check for leaks. */
LADEN_API uint64_t laden_dev_cpu_fail_vmm_at(uint64_t n);
LADEN_API void laden_dev_cpu_vmm_live(uint64_t *reservations,
                                      uint64_t *phys_handles);

typedef enum laden_copy_kind {
    LADEN_COPY_H2D_PINNED = 0,
    LADEN_COPY_H2D_PAGEABLE = 1,
    LADEN_COPY_D2H_PINNED = 2,
} laden_copy_kind;

/* Measures a copy: allocates size_bytes on both sides, copies once to warm
 * up, then times `repeats` copies with events.  *out_bytes_per_s gets the
 * rate.  Blocks for the measurement. */
LADEN_API laden_status laden_dev_measure_copy(int32_t device,
                                              laden_copy_kind kind,
                                              uint64_t size_bytes,
                                              uint32_t repeats,
                                              double *out_bytes_per_s);

#ifdef __cplusplus
}
#endif
#endif
