/* host: pinned host memory with a byte budget and reuse.  The RAM tier and
 * the staging ring live here.  Pinning is slow (page-locking every page), so
 * freed blocks are cached and handed out again; the budget counts blocks in
 * use and cached blocks alike, and cached blocks are released first when a
 * new allocation needs the room.  On the CPU device the memory is ordinary
 * (page-aligned) host memory under the same budget.  Thread-safe. */
#ifndef LADEN_HOST_H
#define LADEN_HOST_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_host laden_host_t;

typedef struct laden_host_stats {
    uint64_t budget_bytes;
    uint64_t in_use_bytes;  /* handed out, not freed */
    uint64_t cached_bytes;  /* freed, kept pinned for reuse */
    uint64_t peak_bytes;    /* highest in_use + cached */
    uint64_t allocs, reuses, pins, unpins;
} laden_host_stats_t;

/* Creates an arena that pins for `device` (a CUDA device index, or
 * LADEN_DEVICE_CPU for ordinary memory).  budget_bytes 0 means no limit. */
LADEN_API laden_status laden_host_create(int32_t device, uint64_t budget_bytes,
                                         laden_host_t **out);

/* Frees every block, also those not returned; NULL is a no-op. */
LADEN_API void laden_host_destroy(laden_host_t *host);

/* Hands out size_bytes (rounded up to 64 KiB, 4 KiB aligned).  Reuses a
 * cached block of at least that size and at most twice it when one exists;
 * otherwise pins new memory, first unpinning cached blocks if the budget
 * requires.  LADEN_E_BUDGET if the blocks in use leave no room,
 * LADEN_E_NOMEM if pinning fails.  Blocks while pinning. */
LADEN_API laden_status laden_host_alloc(laden_host_t *host, uint64_t size_bytes,
                                        void **out);

/* Returns a block to the cache.  LADEN_E_INVAL for a pointer not from this
 * arena (nothing is changed). */
LADEN_API laden_status laden_host_free(laden_host_t *host, void *ptr);

/* Size of a block handed out (the rounded size), 0 if unknown. */
LADEN_API uint64_t laden_host_block_size(laden_host_t *host, const void *ptr);

/* Unpins every cached block. */
LADEN_API void laden_host_trim(laden_host_t *host);

/* Changes the budget; cached blocks over it are unpinned at once.  Blocks in
 * use are never taken back, so in_use may stay above a lowered budget until
 * they are freed. */
LADEN_API laden_status laden_host_set_budget(laden_host_t *host,
                                             uint64_t budget_bytes);

LADEN_API laden_status laden_host_stats(laden_host_t *host,
                                        laden_host_stats_t *out);

/* The process's pool of pinned host memory for `device` (a CUDA device
 * index): RAM-tier blocks of a released streaming schedule that fit its
 * budget stay pinned and mapped, and a later load in this process whose
 * blocks have those lengths takes them instead of pinning new pages (a
 * model released and loaded again: ComfyUI switching workflows).  0 (the
 * default): release gives every byte back.  Lowering it unpins the oldest
 * at once.  The memory held counts as used by the process (laden plans
 * with the free RAM it sees).  Any thread. */
LADEN_API laden_status laden_pinned_pool_set(int32_t device, uint64_t bytes);
typedef struct laden_pinned_pool_stats {
    uint64_t budget_bytes;
    uint64_t held_bytes;   /* pinned, waiting for a load */
    uint64_t reused_bytes; /* taken by loads instead of pinned anew */
    uint64_t kept_bytes;   /* given to the pool by releases */
    uint64_t freed_bytes;  /* unpinned to keep the budget */
} laden_pinned_pool_stats_t;
LADEN_API laden_status laden_pinned_pool_stats(int32_t device,
                                               laden_pinned_pool_stats_t *out);
/* Measures single-threaded host memcpy over size_bytes buffers. */
LADEN_API laden_status laden_host_measure_memcpy(uint64_t size_bytes,
                                                 double *out_bytes_per_s);

#ifdef __cplusplus
}
#endif
#endif
