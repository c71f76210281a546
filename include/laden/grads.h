/* Gradients leaving the device (issue 17): a streamed block's parameter
 * gradients are produced in device memory by its backward; the block's
 * weights live on the host, and so must their gradients, or device memory
 * would grow by the model's size over a backward.
 *
 * laden_grads_push enqueues, after the work already on the caller's
 * compute stream, a device-to-host copy of one gradient into a pinned
 * staging ring on the sink's own copy stream (so it overlaps the next
 * block's compute and the host-to-device prefetches, PCIe being full
 * duplex), and returns; the values reach their host destination, converted
 * and added there (an optimizer's .grad, fp32 or the parameter's dtype),
 * when the ring needs the space or at laden_grads_flush, which waits for
 * every push.  A copy into page-locked memory that needs no conversion
 * and adds nothing skips the ring (LADEN_GRADS_PINNED): the common case
 * of a training step, whose .grad buffers are reused from step to step.  The device gradient must stay allocated until its copy has
 * run: the caller orders its release after the sink's stream
 * (laden_grads_stream).  On the CPU device a push is done at once.
 *
 * The sink may be used from several threads (calls are serialized). */
#ifndef LADEN_GRADS_H
#define LADEN_GRADS_H

#include "dev.h"
#include "st.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_grads laden_grads_t;

/* A sink for `device` with staging_bytes of pinned staging (1 MiB at
 * least; a gradient larger than the ring moves in parts). */
LADEN_API laden_status laden_grads_create(int32_t device,
                                          uint64_t staging_bytes,
                                          laden_grads_t **out);

/* The staging a sink wants when its largest gradient has largest_bytes:
 * twice that, at least 1 MiB and at most 256 MiB.  Pure; any thread. */
LADEN_API uint64_t laden_grads_staging_bytes(uint64_t largest_bytes);

/* Waits for every push (what they were to write is written), then frees.
 * NULL is a no-op. */
LADEN_API void laden_grads_destroy(laden_grads_t *g);

/* What laden_grads_push does with the destination (bits of `flags`). */
enum {
    /* dst + value; without it dst = value. */
    LADEN_GRADS_ADD = 1,
    /* dst is page-locked host memory (cuMemHostAlloc'd or registered,
     * e.g. a tensor with pin_memory=True): when nothing is added and the
     * dtypes are equal, the copy goes straight into it, with no staging
     * and no host work at all.  Wrong, the copy is still correct, but the
     * driver then copies synchronously through its own staging. */
    LADEN_GRADS_PINNED = 2
};

/* n elements of src_dtype at device address src go to dst (host memory of
 * dst_dtype, n elements): dst = value, or dst + value with LADEN_GRADS_ADD
 * in `flags`, in fp32 arithmetic, rounded to nearest even.  Dtypes: F32,
 * F16, BF16.  compute_stream: the CUDA stream the gradient was written on
 * (0: the legacy default stream; ignored on the CPU).  Through the ring, a
 * gradient larger than half of it moves in parts; if enqueuing a later
 * part fails, the push returns the error and the parts before it still
 * land: the destination is then not whole.  Unknown flag bits: E_INVAL. */
LADEN_API laden_status laden_grads_push(laden_grads_t *g, laden_devptr_t src,
                                        laden_dtype src_dtype, uint64_t n,
                                        void *dst, laden_dtype dst_dtype,
                                        int flags, uintptr_t compute_stream);

/* Waits for every push so far and writes their values to their
 * destinations.  The first error of a push since the last flush is
 * returned here (and the pushes after it are still written). */
LADEN_API laden_status laden_grads_flush(laden_grads_t *g);

/* The work enqueued on compute_stream so far comes before anything
 * enqueued on the sink's stream from now on.  A block whose weights were
 * pushed (an optimizer stepped them in its slot) exits on the sink's
 * stream after this, so its slot is refilled only after they are copied. */
LADEN_API laden_status laden_grads_wait(laden_grads_t *g,
                                        uintptr_t compute_stream);

/* bytes of host memory at src to device memory at dst, on the sink's
 * upload stream (an optimizer's state brought up for a step while the
 * compute stream works); asynchronous when src is page-locked.  dst must
 * be free for that stream to write (e.g. allocated on it).  On the CPU
 * device, at once. */
LADEN_API laden_status laden_grads_fetch(laden_grads_t *g, laden_devptr_t dst,
                                         const void *src, uint64_t bytes);

/* The work enqueued on compute_stream from now on comes after every fetch
 * so far.  The upload stream's event is recorded here, once for the
 * fetches since the last call (not at each fetch), so an error recording
 * it is this call's; the fetches are still ordered at the next call or
 * complete at laden_grads_flush. */
LADEN_API laden_status laden_grads_fetched(laden_grads_t *g,
                                           uintptr_t compute_stream);

/* The sink's upload stream (a CUstream), 0 on the CPU device. */
LADEN_API uintptr_t laden_grads_upload_stream(laden_grads_t *g);

/* The sink's copy stream (a CUstream), 0 on the CPU device. */
LADEN_API uintptr_t laden_grads_stream(laden_grads_t *g);

/* Bytes copied off the device and pushes since the sink was made (both
 * paths). */
LADEN_API laden_status laden_grads_stats(laden_grads_t *g,
                                         uint64_t *out_bytes,
                                         uint64_t *out_pushes);

#ifdef __cplusplus
}
#endif

#endif
