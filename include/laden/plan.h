/* plan: decide which tier each block lives in.  laden_plan_compute is a
 * pure function: block sizes, budgets, free-memory readings and
 * bandwidths in; a tier and a reason per block, the memory used and a
 * predicted transfer time out.  The same inputs give the same plan.  No
 * allocation, no I/O.  Beside it (src/plan/budget.c), the rules for what
 * goes in: the readings taken and rounded (laden_plan_read), the link
 * and drive probes (laden_plan_probe_*), and stream_load's budgets
 * (laden_plan_load_input), so that no caller decides them itself. */
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
#define LADEN_PLAN_BLOCK_EXPERTS 2u /* a mixture-of-experts layer's
                                       experts (laden_sched_set_experts):
                                       a use moves only the experts it is
                                       routed to, so a byte of it resident
                                       saves less than a byte of any other
                                       block.  Free: resident only once
                                       every other free block is (as many
                                       resident blocks as fit; the streamed
                                       ones are then not spread) */

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
    uint64_t reserve_bytes;       /* kept free: headroom or activations;
                                     LADEN_PLAN_AUTO: the default
                                     headroom on a CUDA device
                                     (LADEN_PLAN_HEADROOM_DEFAULT), 0 on
                                     the host device */
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
    const uint64_t *ram_block_bytes; /* per block: its bytes on the RAM
                                     tier, where laden may keep it smaller
                                     (compression="lossless": an estimate
                                     of its coded size); NULL: block_bytes.
                                     The RAM tier's room and ram_bytes
                                     count these; VRAM, the slots and the
                                     disk tier count block_bytes */
    const uint64_t *slot_block_bytes; /* per block: what its slot (and
                                     disk staging) holds when it streams,
                                     where that is less than what it takes
                                     resident (a cache keeps lossless
                                     tensors coded in the slots, decoded
                                     in device copies); NULL: block_bytes */
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
    uint64_t reserve_bytes;     /* kept free for activations: the input's,
                                   or the default it resolved to */
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

/* ---- what the planner plans from ---------------------------------------- */

/* Free-memory readings are rounded down to this, so that two runs whose
 * free memory differs by a little plan the same. */
#define LADEN_PLAN_READING_STEP (256ull << 20)
/* VRAM kept free for activations on a CUDA device when no headroom is
 * given (reserve_bytes LADEN_PLAN_AUTO): 1.5 GB. */
#define LADEN_PLAN_HEADROOM_DEFAULT 1500000000ull
/* The link probe: pinned host-to-device copies of this size (a streamed
 * block's order of size, where the link reaches its rate), timed this
 * many times.  The drive probe reads at most LADEN_PLAN_DISK_PROBE_BYTES
 * of the checkpoint. */
#define LADEN_PLAN_PROBE_BYTES (256ull << 20)
#define LADEN_PLAN_PROBE_REPEATS 5u
#define LADEN_PLAN_DISK_PROBE_BYTES (256ull << 20)

typedef struct laden_plan_readings {
    uint64_t vram_free_bytes;      /* rounded down to the step; 0 on the
                                      host device */
    uint64_t vram_total_bytes;     /* 0 on the host device */
    uint64_t ram_free_bytes;       /* available host memory, rounded down
                                      to the step */
    uint64_t ram_free_exact_bytes; /* as read (a shared load's credit is
                                      added to it before rounding) */
    uint64_t ram_total_bytes;
} laden_plan_readings;

/* The readings from raw numbers (the pure half of laden_plan_read, and
 * how a test injects readings): the free bytes rounded down to
 * LADEN_PLAN_READING_STEP, the totals as given. */
LADEN_API void laden_plan_readings_from(uint64_t vram_free_bytes,
                                        uint64_t vram_total_bytes,
                                        uint64_t ram_free_bytes,
                                        uint64_t ram_total_bytes,
                                        laden_plan_readings *out);

/* Reads free and total memory of `device` (a CUDA index; for
 * LADEN_DEVICE_CPU the VRAM fields are 0) and of the host, rounded as
 * laden_plan_readings_from does.  On failure *out is zeroed. */
LADEN_API laden_status laden_plan_read(int32_t device,
                                       laden_plan_readings *out);

/* The host-to-device rate of `device` in bytes/s: pinned copies of
 * LADEN_PLAN_PROBE_BYTES, LADEN_PLAN_PROBE_REPEATS times (the one probe
 * the planner, the CLI and the demo share), measured once per device and
 * process: later calls return the first measurement.  0 for
 * LADEN_DEVICE_CPU, which copies nothing host to device.  Blocks for the
 * measurement.  Any thread. */
LADEN_API laden_status laden_plan_probe_h2d(int32_t device,
                                            double *out_bytes_per_s);

/* The read rate of the drive under the file at `path` (at most
 * LADEN_PLAN_DISK_PROBE_BYTES of it, dropped from the page cache first),
 * or 0 when it cannot be measured (not a regular file, ...): no
 * prediction, not an error.  Measured once per file (device and inode)
 * and process.  Any thread. */
LADEN_API laden_status laden_plan_probe_disk(const char *path,
                                             double *out_bytes_per_s);

/* stream_load's budgets, in the caller's words. */
typedef struct laden_plan_load_options {
    int32_t device;             /* CUDA index or LADEN_DEVICE_CPU */
    uint32_t lookahead;
    uint64_t vram_budget_bytes; /* bounds the device bytes (rest,
                                   resident blocks, slots) in place of the
                                   free VRAM; LADEN_PLAN_AUTO: none given.
                                   On the CPU: LADEN_E_INVAL */
    uint64_t ram_budget_bytes;  /* the RAM tier alone (0: every streamed
                                   block on disk); LADEN_PLAN_AUTO: none,
                                   the free RAM less the minimum kept
                                   free */
    uint64_t shared_bytes;      /* for a shared load, the bytes of the
                                   segments already made from its
                                   checkpoint (laden_sched_shared_bytes);
                                   0 otherwise */
    uint32_t vram_context_budget; /* 1: a VRAM context with a budget
                                     holds the model (the schedule caps
                                     the device bytes at its room) */
} laden_plan_load_options;

/* Fills *out (its block fields empty) with stream_load's policy: no
 * headroom kept (nothing reserved; the budget is the caller's), no rates;
 * blocks stay resident while they fit a VRAM budget or a VRAM context's
 * budget, and without either every block not asked resident streams
 * (resident_blocks 0).  Without a RAM budget, a shared load counts the
 * segments already made from its files as free RAM (capped at the total,
 * then rounded): the reading drops by a segment's size once the first
 * process made it, and without the credit a later process would plan
 * fewer RAM-tier blocks, get another layout and share nothing.
 * `readings` NULL: taken now (laden_plan_read). */
LADEN_API laden_status laden_plan_load_input(
    const laden_plan_load_options *opt, const laden_plan_readings *readings,
    laden_plan_input *out);

/* The text of one warning bit of laden_plan_result.warnings (a single
 * LADEN_PLAN_WARN_* value), or NULL for any other value.  Static; any
 * thread. */
LADEN_API const char *laden_plan_warning_text(uint32_t bit);

#ifdef __cplusplus
}
#endif
#endif
