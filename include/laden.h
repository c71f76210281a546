/* laden: run models larger than GPU memory by moving weights between disk,
 * host RAM and VRAM.  The base header: version, status codes, errors;
 * every layer header (laden/st.h, laden/stream.h, ...) includes it.
 *
 * Every function that can fail returns a laden_status: 0 on success, a
 * negative LADEN_E_* on failure.  On failure the out-parameters are set to
 * NULL or 0 and laden_last_error() holds a message naming what failed.
 *
 * Licensed under the Apache License, Version 2.0. */
#ifndef LADEN_H
#define LADEN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LADEN_VERSION_MAJOR 0
#define LADEN_VERSION_MINOR 1
#define LADEN_VERSION_PATCH 0

#if defined(LADEN_BUILDING)
#define LADEN_API __attribute__((visibility("default")))
#else
#define LADEN_API
#endif

/* The one list of statuses.  Names, messages and the enum are generated from
 * it; the Python binding reads the names at run time.  Values are stable. */
#define LADEN_STATUS_LIST(X)                                                   \
    X(OK, 0, "success")                                                        \
    X(E_INVAL, -1, "invalid argument")                                         \
    X(E_NOMEM, -2, "out of host memory")                                       \
    X(E_IO, -3, "I/O error")                                                   \
    X(E_NOENT, -4, "no such file")                                             \
    X(E_TRUNCATED, -5, "file is shorter than its header says")                 \
    X(E_HEADER, -6, "bad checkpoint header length")                            \
    X(E_JSON, -7, "malformed JSON in checkpoint header")                       \
    X(E_SCHEMA, -8, "checkpoint header entry has the wrong structure")         \
    X(E_DTYPE, -9, "unknown tensor dtype")                                     \
    X(E_SHAPE, -10, "tensor shape does not match its byte range")              \
    X(E_RANGE, -11, "tensor data ranges out of bounds, overlapping or gapped") \
    X(E_NAME, -12, "invalid or duplicate tensor name")                         \
    X(E_LIMIT, -13, "checkpoint header exceeds a limit")                       \
    X(E_INDEX, -14, "bad sharded checkpoint index")                            \
    X(E_NOTFOUND, -15, "no such tensor")                                       \
    X(E_DEVICE, -16, "device driver error")                                    \
    X(E_NODEVICE, -17, "no such device")                                       \
    X(E_DEVICE_NOMEM, -18, "out of device memory")                             \
    X(E_BUDGET, -19, "byte budget exceeded")                                   \
    X(E_UNSUPPORTED, -20, "operation not supported on this device")           \
    X(E_STATE, -21, "object is in the wrong state for this call")            \
    X(E_CHANGED, -22, "file changed while in use")                            \
    X(E_CORRUPT, -23, "compressed data is corrupt")

typedef enum laden_status {
#define LADEN__STATUS_ENUM(name, value, msg) LADEN_##name = value,
    LADEN_STATUS_LIST(LADEN__STATUS_ENUM)
#undef LADEN__STATUS_ENUM
} laden_status;

/* Where a block of weights lives (a schedule's tiers, the planner's
 * answer).  Values are stable: the Python binding mirrors them. */
typedef enum laden_tier {
    LADEN_TIER_AUTO = -1, /* not decided yet: laden_sched_plan decides */
    LADEN_TIER_GPU = 0,   /* on the device for good (resident) */
    LADEN_TIER_RAM = 1,   /* pinned host memory, copied into a slot to run */
    LADEN_TIER_DISK = 2,  /* only in the checkpoint, read when it runs */
    LADEN_TIER_VRAM = 3,  /* on the device if its VRAM context has room at
                             load, else on the RAM tier */
} laden_tier;

/* Blocks prefetched ahead of the one running, by default and at most.  A
 * prefetch window marks the slots it claims in a 64-bit mask, one bit per
 * slot; with lookahead + 1 slots the limit is 63. */
#define LADEN_LOOKAHEAD_DEFAULT 2u
#define LADEN_LOOKAHEAD_MAX 63u

/* Slots a schedule with `nstreamed` streamed blocks uses: one per block
 * prefetched plus the one running, never more than there are blocks. */
static inline uint32_t laden_slot_count(uint32_t nstreamed, uint32_t lookahead)
{
    uint32_t k = (lookahead ? lookahead : LADEN_LOOKAHEAD_DEFAULT) + 1;
    return nstreamed < k ? nstreamed : k;
}

/* "1.2.3".  Static storage; any thread. */
LADEN_API const char *laden_version(void);

/* The status's name without prefix ("E_INVAL"), or "UNKNOWN".  Static
 * storage; any thread. */
LADEN_API const char *laden_status_name(int status);

/* The status's fixed message, or "unknown status".  Static; any thread. */
LADEN_API const char *laden_status_message(int status);

/* The detail of the last failure on the calling thread: which file, tensor,
 * field or driver call failed, and why.  Thread-local storage, valid until
 * the next laden call on this thread; "" if nothing failed yet. */
LADEN_API const char *laden_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
