/* The schedule's cache part (sc->cache): a cache schedule's
 * (LADEN_SCHED_CACHE) device copies, their VBAR and VRAM context, and the
 * events that order uploads against the model's work.  Owner: resident.c
 * (device copies, pinning, VRAM contexts, fences); load.c makes the VBAR
 * and counts the host copies filled (nfilled, with share.c for attached
 * ones); load.c's free_all releases it; run.c charges its slots to
 * `vram`.  Not installed; see stream_layout.h for how a part header is
 * laid out. */
#ifndef LADEN_STREAM_CACHE_TYPES
#define LADEN_STREAM_CACHE_TYPES

#include <stdbool.h>
#include <stdint.h>

#include "../core/internal.h"
#include "laden/dev.h"
#include "laden/vram.h"

typedef struct sched_cache {
    bool on;                    /* LADEN_SCHED_CACHE */
    uint32_t nfilled;           /* blocks whose host copy is loaded */
    laden_event_t *uploaded;    /* after the last upload */
    laden_event_t *last_use;    /* after the model's last work */
    bool fenced;
    laden_vbar_t *vbar;         /* device copies live here, or NULL */
    laden_devptr_t vbar_base;
    laden_vram_t *vram;         /* the VBAR's context (borrowed) */
    /* Lossless blobs land in scratch[k] on their way to a device copy
     * (resident.c): copied there on the copy stream, decoded into place
     * on `decode`, the two buffers in turn so that the next blob's copy
     * runs while this one decodes.  copied[k]/decoded[k] order them;
     * `upload_bytes` per buffer.  Made at the first upload that decodes,
     * given back at laden_sched_ready (load.c's free_scratch). */
    laden_devptr_t scratch[2];
    uint64_t scratch_bytes;
    uint32_t next;              /* the buffer the next blob takes */
    laden_dev_stream_t *decode;
    laden_event_t *copied[2], *decoded[2], *copy_end;
} sched_cache;

#endif

#ifndef LADEN_STREAM_TYPES_ONLY
#ifndef LADEN_STREAM_CACHE_H
#define LADEN_STREAM_CACHE_H

#include "stream_internal.h"

/* The device bytes of the two upload buffers a cache schedule's block
 * needs to be made resident (laden_sched_block_upload_bytes). */
uint64_t laden__sched_block_upload_bytes(const laden_sched_t *sc,
                                         uint32_t block);
laden_status laden__sched_set_resident(laden_sched_t *sc, uint32_t block,
                                       int on);
laden_status laden__sched_take_resident(laden_sched_t *sc, uint32_t block,
                                        laden_devptr_t *out_ptr,
                                        uint64_t *out_bytes);
laden_status laden__sched_set_resident_at(laden_sched_t *sc, uint32_t block,
                                          laden_devptr_t ptr, uint64_t bytes);
laden_status laden__sched_use_vram(laden_sched_t *sc, laden_vram_t *vram);
laden_status laden__sched_reserve_vram(laden_sched_t *sc, const uint8_t *want,
                                       uint32_t n);
laden_status laden__sched_pin(laden_sched_t *sc, uint32_t block, int on);
laden_status laden__sched_ready(laden_sched_t *sc, uintptr_t handle);
laden_status laden__sched_copy_fills(laden_sched_t *sc, uint32_t block,
                                     uint64_t *out);
laden_status laden__sched_reupload(laden_sched_t *sc, uint32_t block);
laden_status laden__sched_reupload_tensor(laden_sched_t *sc, uint32_t block,
                                          uint32_t i, uintptr_t handle);
laden_status laden__sched_fence(laden_sched_t *sc, uintptr_t handle);
laden_status laden__sched_own_copy(laden_sched_t *sc, uint32_t block,
                                   int *out_made);

#endif
#endif
