/* plan: decide which tier each block lives in.  A pure function: block
 * sizes, budgets, free-memory readings and bandwidths in; a tier and a
 * reason per block, the memory used and a predicted transfer time out.
 * The same inputs give the same plan.  No allocation, no I/O. */
#ifndef LADEN_PLAN_H
#define LADEN_PLAN_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Tiers are laden_tier (laden.h): GPU, RAM, DISK; a block asked
 * LADEN_TIER_AUTO (= LADEN_PLAN_FREE) is the planner's to place. */
#define LADEN_PLAN_FREE LADEN_TIER_AUTO

/* "Decide from the readings", for the byte fields that take it. */
#define LADEN_PLAN_AUTO UINT64_MAX

/* Per-block flags (laden_plan_input.block_flags). */
#define LADEN_PLAN_BLOCK_NO_DISK 1u /* kept in another form than the
                                       checkpoint's (converted on load), so
                                       it cannot stream from disk: never
                                       placed there.  Asked DISK:
                                       LADEN_E_INVAL; free: RAM before any
                                       free block that could go to disk,
                                       LADEN_E_BUDGET if it does not fit */

/* Why a block got its tier. */
#define LADEN_PLAN_WHY_LIST(X)                                                \
    X(FITS_VRAM, "resident: fits the VRAM left after the rest, the slots "    \
                 "and the reserve")                                          \
    X(ASKED_RESIDENT, "resident: asked for")                                  \
    X(NO_VRAM_RAM, "RAM: no VRAM left; fits the RAM budget")                  \
    X(ASKED_RAM, "RAM: asked for")                                            \
    X(NO_RAM_DISK, "disk: no RAM left")                                       \
    X(ASKED_DISK, "disk: asked for")                                       \
    X(FITS_HOST_RAM, "RAM: fits the host memory budget")

typedef enum laden_plan_why {
#define LADEN__WHY_ENUM(name, text) LADEN_PLAN_WHY_##name,
    LADEN_PLAN_WHY_LIST(LADEN__WHY_ENUM)
#undef LADEN__WHY_ENUM
    LADEN_PLAN_WHY_COUNT
} laden_plan_why;

/* Warnings, a bit mask. */
#define LADEN_PLAN_WARN_DISK 1u       /* some blocks stream from disk */
#define LADEN_PLAN_WARN_NO_RESERVE 2u /* nothing kept for activations */
#define LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE 4u /* max_vram > free VRAM */

typedef struct laden_plan_input {
    uint32_t nblocks;
    const uint64_t *block_bytes;  /* in schedule order */
    const int32_t *asked;         /* per block: a tier, or LADEN_PLAN_FREE;
                                     NULL: all free */
    const uint8_t *block_flags;   /* per block: LADEN_PLAN_BLOCK_*; NULL:
                                     none */
    uint64_t rest_bytes;          /* outside blocks: always resident */
    uint64_t vram_free_bytes;     /* reading of free device memory */
    uint64_t max_vram_bytes;      /* 0: no limit beyond the free memory */
    uint64_t reserve_bytes;       /* kept free: headroom or activations */
    uint64_t ram_total_bytes;
    uint64_t ram_free_bytes;      /* reading of available host memory */
    uint64_t ram_budget_bytes;    /* RAM for the RAM tier (and, with
                                     disk_staging, the staging);
                                     LADEN_PLAN_AUTO: ram_free - min_free_ram
                                     (on the host device less what the rest,
                                     the resident blocks and the slots take
                                     of it); 0: no RAM tier */
    uint64_t min_free_ram_bytes;  /* LADEN_PLAN_AUTO: 8 % of RAM, 1..4 GiB */
    int32_t resident_blocks;      /* -1: as many as fit; n: the first n free
                                     blocks */
    uint32_t lookahead;           /* slots = lookahead + 1 (0:
                                     LADEN_LOOKAHEAD_DEFAULT; at most
                                     LADEN_LOOKAHEAD_MAX) */
    uint32_t disk_staging;        /* 1: disk blocks need a pinned staging
                                     buffer per slot (CUDA); 0: they are
                                     read straight into host slots (CPU) */
    uint32_t host_device;         /* 1: the device is the CPU.  Its
                                     "device memory" is host memory: the
                                     rest, resident blocks and slots come
                                     from the free RAM (less min_free), RAM
                                     blocks (run in place) from the RAM
                                     budget as on CUDA, or, without one,
                                     from what the others leave of the free
                                     RAM; no VRAM field may be set
                                     (vram_free, max_vram, reserve: 0, else
                                     LADEN_E_INVAL), resident_blocks -1
                                     means 0, and nothing is copied host
                                     to device (h2d_bytes_per_s ignored) */
    double h2d_bytes_per_s;       /* 0: no prediction */
    double disk_bytes_per_s;
} laden_plan_input;

/* On the host device the VRAM fields are 0; gpu_bytes and the slots are
 * host memory too: gpu_bytes + nslots * slot_bytes <= free RAM less the
 * minimum kept free, and without a RAM budget gpu_bytes + ram_bytes +
 * nslots * slot_bytes <= ram_limit_bytes. */
typedef struct laden_plan_result {
    uint64_t vram_avail_bytes;  /* min(max_vram, free) - reserve */
    uint64_t ram_avail_bytes;   /* RAM for the RAM tier (and staging):
                                   the RAM budget, or on the host device
                                   without one what the rest, the
                                   resident blocks and the slots leave of
                                   the RAM limit */
    uint64_t min_free_ram_bytes;
    uint64_t ram_limit_bytes;   /* the RAM budget, or free RAM minus the
                                   minimum kept free */
    uint64_t gpu_bytes;         /* rest + resident blocks */
    uint64_t ram_bytes;         /* RAM tier */
    uint64_t disk_bytes;
    uint64_t slot_bytes;        /* one slot */
    uint32_t nslots;            /* on the host device, for every block not
                                   asked resident (laden_slot_count of
                                   their number), set aside before blocks
                                   are placed */
    uint64_t staging_bytes;     /* pinned staging for disk blocks */
    uint64_t vram_used_bytes;   /* gpu_bytes + slots (CUDA) */
    uint64_t ram_used_bytes;    /* RAM tier + staging */
    double predicted_ms;        /* transfer time per forward; 0 if unknown */
    uint32_t warnings;
} laden_plan_result;

/* Computes the plan.  tiers[i] and why[i] (nblocks entries each, caller's
 * arrays) receive block i's tier and reason.  LADEN_E_BUDGET when the
 * request cannot be met, with a message that says what would fit;
 * LADEN_E_INVAL for malformed input (an unknown tier or flag, a NO_DISK
 * block asked for disk, lookahead above LADEN_LOOKAHEAD_MAX, a VRAM field
 * or disk_staging on the host device).  On failure *out is zeroed and
 * tiers/why are unspecified.  Pure; any thread. */
LADEN_API laden_status laden_plan_compute(const laden_plan_input *in,
                                          int32_t *tiers, int32_t *why,
                                          laden_plan_result *out);

/* The text of a reason, or NULL. */
LADEN_API const char *laden_plan_why_text(int32_t why);

/* The text of one warning bit of laden_plan_result.warnings (a single
 * LADEN_PLAN_WARN_* value), or NULL for any other value.  Static; any
 * thread. */
LADEN_API const char *laden_plan_warning_text(uint32_t bit);

#ifdef __cplusplus
}
#endif
#endif
