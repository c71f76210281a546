/* vram: device memory that gives way.  Per model a VBAR, a reserved
 * virtual address range whose physical pages are created and mapped on
 * demand, under one byte budget per device shared with other users of the
 * device (the elastic allocator's activations, laden_vram_charge).
 *
 * The use of a weight, as the comfy-aimdo seed describes it:
 *   laden_vbar_fault(range): resident = 1 -> the range is mapped and pinned;
 *     if the signature differs from the one saved when the range was last
 *     written, copy the weight in and save the new signature; run; then
 *     laden_vbar_unpin(range) so that it may be evicted under pressure.
 *   resident = 0 -> the range is offloaded: stream the weight through a
 *     temporary buffer instead.  Not an error.
 *
 * Priorities: the most recently prioritized VBAR first; within a VBAR,
 * lower offsets first.  A fault that needs room evicts unpinned pages of
 * lower priority (other VBARs least recently prioritized first, highest
 * offsets first; then this VBAR's pages above the range).  An eviction
 * lowers its VBAR's watermark to the evicted page (not below the floor);
 * faults that start at or above the watermark and are not mapped already
 * fail fast (resident = 0) instead of evicting in turn, so a model larger
 * than its share settles into a resident prefix.  laden_vbar_prioritize
 * makes a VBAR the most important and resets its watermark.
 *
 * Signatures: every page mapped gets a new number from a counter of the
 * context; a range's signature is the largest number among its pages, so
 * it changes exactly when a page of the range was replaced.
 *
 * Pages are `page_bytes` (a multiple of the device's VMM granularity): a
 * fault maps whole pages, and mapping costs per call, so pages much larger
 * than the granularity keep faults cheap.  Thread-safe: one lock per
 * context; the hot path (a range already mapped) takes it once. */
#ifndef LADEN_VRAM_H
#define LADEN_VRAM_H

#include <stddef.h>

#include "../laden.h"
#include "dev.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_vram laden_vram_t;
typedef struct laden_vbar laden_vbar_t;

#define LADEN_VRAM_DEFAULT_PAGE (32ull << 20)

typedef struct laden_vram_info {
    int32_t device;
    uint64_t page_bytes;
    uint64_t budget_bytes;      /* 0: no limit */
    uint64_t mapped_bytes;      /* pages mapped, all VBARs */
    uint64_t pinned_bytes;      /* of those, pinned */
    uint64_t charged_bytes;     /* charged by other users (activations) */
    uint32_t vbars;
    uint64_t faults;            /* resident results */
    uint64_t offloaded;         /* offloaded results */
    uint64_t fail_fast;         /* of those, above a watermark */
    uint64_t maps, evictions;   /* pages mapped, pages evicted */
    uint64_t evicted_bytes;
    uint64_t spare_bytes;       /* evicted pages kept for coming faults */
} laden_vram_info_t;

typedef struct laden_vbar_info {
    laden_devptr_t base;
    uint64_t size_bytes;        /* reserved */
    uint64_t used_bytes;        /* handed out by laden_vbar_alloc */
    uint64_t mapped_bytes;
    uint64_t pinned_bytes;
    uint64_t watermark;         /* size_bytes: no offloading */
    uint64_t floor;
    uint64_t priority;          /* larger is more important */
} laden_vbar_info_t;

/* A context for one device.  budget_bytes 0: no limit but the device's;
 * page_bytes 0: LADEN_VRAM_DEFAULT_PAGE (rounded up to the granularity). */
LADEN_API laden_status laden_vram_create(int32_t device, uint64_t budget_bytes,
                                         uint64_t page_bytes,
                                         laden_vram_t **out);
/* Frees every VBAR of the context and the context.  NULL: no-op. */
LADEN_API void laden_vram_destroy(laden_vram_t *ctx);
/* A lower budget takes effect at the next fault or charge. */
LADEN_API laden_status laden_vram_set_budget(laden_vram_t *ctx,
                                             uint64_t budget_bytes);
/* Evicts unpinned pages, lowest priority first, until at least `bytes`
 * have been freed (or none are left); *out_freed (may be NULL) gets what
 * was. */
LADEN_API laden_status laden_vram_free_memory(laden_vram_t *ctx,
                                              uint64_t bytes,
                                              uint64_t *out_freed);
/* Makes room for `bytes` of pages about to be faulted in, in one batch:
 * evicts unpinned pages as faults would (lowest priority first) but keeps
 * their physical pages as spares for those faults, which then map them
 * instead of allocating (a new device allocation is cleared by the driver
 * first).  Spares count as used; anything else that needs memory (charges,
 * laden_vram_free_memory) takes them back first.  Best effort: evicts
 * nothing if the room cannot be made. */
LADEN_API laden_status laden_vram_make_room(laden_vram_t *ctx, uint64_t bytes);
/* Counts `bytes` of other device memory (activations) against the budget,
 * evicting unpinned weight pages first if it would be exceeded.
 * LADEN_E_BUDGET, with nothing evicted or charged, if even evicting every
 * unpinned page would not make room. */
LADEN_API laden_status laden_vram_charge(laden_vram_t *ctx, uint64_t bytes);
LADEN_API laden_status laden_vram_uncharge(laden_vram_t *ctx, uint64_t bytes);
LADEN_API laden_status laden_vram_info(laden_vram_t *ctx,
                                       laden_vram_info_t *out);

/* Reserves a VBAR of at least size_bytes of address space (no memory yet);
 * it is the most important VBAR of the context. */
LADEN_API laden_status laden_vbar_create(laden_vram_t *ctx, uint64_t size_bytes,
                                         laden_vbar_t **out);
/* Unmaps and frees its pages and releases the range.  NULL: no-op. */
LADEN_API void laden_vbar_destroy(laden_vbar_t *vbar);
/* Hands out `size_bytes` of the range (256-byte aligned), in order:
 * allocate the most important weights first. */
LADEN_API laden_status laden_vbar_alloc(laden_vbar_t *vbar, uint64_t size_bytes,
                                        uint64_t *out_offset);
/* Makes [offset, offset+size) resident and pinned (*out_resident 1, and
 * *out_signature as in the header comment), or reports it offloaded
 * (*out_resident 0; nothing pinned).  Errors only for bad arguments or a
 * driver failure other than lack of memory. */
LADEN_API laden_status laden_vbar_fault(laden_vbar_t *vbar, uint64_t offset,
                                        uint64_t size_bytes, int *out_resident,
                                        uint64_t *out_signature);
/* Ends the pin of a fault on the same range.  LADEN_E_STATE if a page of
 * it is not pinned.  The work that used the range must have finished, or
 * be recorded with laden_vbar_unpin_after. */
LADEN_API laden_status laden_vbar_unpin(laden_vbar_t *vbar, uint64_t offset,
                                        uint64_t size_bytes);
/* As laden_vbar_unpin, after the work enqueued so far on `stream` (a CUDA
 * stream handle; 0 is the legacy default stream): a page evicted later is unmapped only once that work
 * has finished (the evicting thread waits for this VBAR's last recorded
 * use, not for the whole device).  Use one stream per VBAR, or unpin
 * after the last of them. */
LADEN_API laden_status laden_vbar_unpin_after(laden_vbar_t *vbar,
                                              uint64_t offset,
                                              uint64_t size_bytes,
                                              uintptr_t stream);
LADEN_API laden_status laden_vbar_prioritize(laden_vbar_t *vbar);
LADEN_API laden_status laden_vbar_deprioritize(laden_vbar_t *vbar);
/* Evictions never lower the watermark below `offset`: ranges below it keep
 * trying to fault after an eviction. */
LADEN_API laden_status laden_vbar_set_floor(laden_vbar_t *vbar,
                                            uint64_t offset);
LADEN_API laden_status laden_vbar_info(laden_vbar_t *vbar,
                                       laden_vbar_info_t *out);
/* Per page (out[0..n), n at most the VBAR's page count): 0 unmapped,
 * 1 mapped, 2 mapped and pinned.  *out_n gets the page count. */
LADEN_API laden_status laden_vbar_residency(laden_vbar_t *vbar, uint8_t *out,
                                            uint32_t n, uint32_t *out_n);

/* ---- the elastic allocator ------------------------------------------------
 * Device memory for PyTorch from the budget of a VRAM context, through a
 * supported seam: torch.cuda.memory.CUDAPluggableAllocator (or a MemPool
 * built on one) calls laden_elastic_malloc and laden_elastic_free.  An
 * allocation that would exceed the budget first takes the allocator's
 * cached blocks back, then evicts unpinned weight pages (lowest priority
 * first); only if that is not enough does it return NULL, which PyTorch
 * reports as out of memory.  A freed block is kept for reuse with an
 * event recorded on the stream that freed it: reused at once on that
 * stream, by another stream once the event has passed -- no device-wide
 * synchronize. */

typedef struct laden_elastic_stats {
    uint64_t allocs, frees, reuses, failures;
    uint64_t in_use_bytes, cached_bytes, peak_bytes;
    uint64_t evicted_bytes;  /* weight bytes evicted to make room */
} laden_elastic_stats_t;

/* Serves `device`'s allocations from ctx's budget (ctx on that device);
 * NULL detaches (cached blocks are freed; blocks in use stay charged until
 * freed).  One context per device. */
LADEN_API laden_status laden_elastic_attach(int32_t device, laden_vram_t *ctx);
/* The allocator entry points (signatures as PyTorch's pluggable allocator
 * wants them; stream is a cudaStream_t). */
LADEN_API void *laden_elastic_malloc(ptrdiff_t size, int device, void *stream);
LADEN_API void laden_elastic_free(void *ptr, ptrdiff_t size, int device,
                                  void *stream);
/* Frees the cached blocks whose last use has finished. */
LADEN_API laden_status laden_elastic_trim(int32_t device);
LADEN_API laden_status laden_elastic_stats(int32_t device,
                                           laden_elastic_stats_t *out);

#ifdef __cplusplus
}
#endif
#endif
