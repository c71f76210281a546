/* The planner.  See include/laden/plan.h.
 *
 * Order of decisions, each deterministic (one static function per step):
 *  0. check_input: tiers, flags, lookahead (at most LADEN_LOOKAHEAD_MAX)
 *     and, on the host device, that no VRAM field and no disk staging is
 *     set.  Blocks asked to a tier keep it.  The RAM limit is the RAM
 *     budget (for the RAM tier alone; 0: none), or, with
 *     LADEN_PLAN_AUTO, free RAM minus the minimum kept free.
 *  1. Budget.  CUDA device (vram_budget): VRAM available = min(max_vram,
 *     free) - reserve; the rest of the model, the blocks asked resident and
 *     the slots for all the others must fit there.  Host device
 *     (host_budget): the rest, the blocks asked resident and
 *     laden_slot_count(all blocks) slots of the largest block come out of
 *     the free RAM (less the minimum kept free) first, set aside before
 *     any block is placed, so that no
 *     earlier choice makes a later one infeasible.
 *  2. choose_resident: free blocks become resident in schedule order while
 *     the rest, the resident blocks so far, this block and the slots fit
 *     (on a CUDA device the slots are counted for every block not yet
 *     resident, so an earlier choice never makes a later state
 *     infeasible).  With resident_blocks = n, exactly n, if that fits.
 *     EXPERTS blocks (as many as fit) come after every other free block:
 *     a routed use moves a few of their experts, so a byte of them saves
 *     a fraction of a byte of a dense block per pass.  On
 *     the host device resident_blocks -1 means 0: a resident block costs
 *     host memory like a RAM block and only what was asked is resident.
 *  3. spread (CUDA device only): the k blocks so chosen are spread: the
 *     streamed ones are placed evenly through the schedule instead of all
 *     at its end, so the copy engine fills the slots while resident blocks
 *     compute (with the streamed blocks at the end, two slots fill during
 *     the resident part and the engine then idles; measured on an H200:
 *     1.20 x the ideal, against 1.04 spread).  The spread is adopted if it
 *     fits the VRAM as the prefix did (blocks of unequal size may not) and
 *     does not leave NO_DISK blocks without RAM where the prefix did not.
 *  4. place_streamed: streamed blocks go to RAM while they fit the RAM
 *     available (the RAM limit; on the host without a RAM budget, what
 *     the rest, the resident blocks and the slots leave of it).  All of them go to RAM if they fit
 *     without staging; otherwise the staging for the disk blocks (CUDA
 *     only) is set aside first.  Precedence: the blocks asked for RAM
 *     (they must fit), then the free NO_DISK blocks in schedule order (they
 *     must fit: they have no other place), then the other free blocks in
 *     schedule order while they fit, else disk.  Placing every block that
 *     cannot go to disk before any that can means that, for the resident
 *     choice made, a placement is found whenever one exists.
 *  5. totals: sums, warnings, the predicted transfer time.
 * On failure *out is zeroed; tiers[] and why[] are left unspecified. */
#include "laden/plan.h"

#include <stdio.h>
#include <string.h>

#include "../core/internal.h"

#define GIB (1ull << 30)
#define UNDECIDED (-1) /* why[i] of a free block not placed yet */

static const char *const why_text[] = {
#define WHY_TEXT(name, text) text,
    LADEN_PLAN_WHY_LIST(WHY_TEXT)
#undef WHY_TEXT
};

const char *laden_plan_why_text(int32_t why)
{
    return why >= 0 && why < LADEN_PLAN_WHY_COUNT ? why_text[why] : NULL;
}

const char *laden_plan_warning_text(uint32_t bit)
{
    /* The reasons behind the bits, said once here for every caller (the
     * Python Plan, the CLI) instead of a copy each. */
    switch (bit) {
    case LADEN_PLAN_WARN_DISK:
        return "some blocks stream from disk: the drive's speed sets a floor "
               "on the time per forward";
    case LADEN_PLAN_WARN_NO_RESERVE:
        return "no VRAM is kept for activations (headroom 0): a large input "
               "may run out of memory";
    case LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE:
        return "max_vram is above the free VRAM; the free VRAM was used";
    default:
        return NULL;
    }
}

#define B(x) (laden__bytes(x).s)

/* The state of one computation. */
typedef struct plan {
    const laden_plan_input *in;
    int32_t *tiers, *why;
    laden_plan_result *out;
    bool host;           /* host_device: the device is the CPU */
    int32_t want;        /* resident blocks asked; < 0: as many as fit */
    uint32_t nfree;      /* blocks asked LADEN_PLAN_FREE */
    uint32_t made;       /* free blocks made resident */
    bool experts_later;  /* choose_resident took EXPERTS blocks last */
    uint64_t gpu;        /* rest + resident blocks */
    uint64_t avail;      /* CUDA: VRAM available; host: free RAM left */
    uint64_t host_slots; /* host: slot memory set aside */
    uint64_t free_left;  /* free RAM minus the minimum kept free */
    bool budgeted;       /* a RAM budget was given */
    uint64_t ram;        /* RAM for the RAM tier and the staging */
} plan;

/* What streams under one choice of resident blocks. */
typedef struct streamed {
    uint64_t gpu;           /* rest + the blocks that do not stream */
    uint32_t n;             /* blocks that stream */
    uint64_t max_bytes;     /* the largest of them */
    uint64_t asked_ram;     /* bytes asked for RAM */
    uint64_t free_bytes;    /* bytes of the free blocks that stream */
    uint64_t no_disk_bytes; /* of those, the NO_DISK ones */
    bool asked_disk;
} streamed;

static int32_t asked_tier(const laden_plan_input *in, uint32_t i)
{
    return in->asked ? in->asked[i] : LADEN_PLAN_FREE;
}

static bool no_disk(const laden_plan_input *in, uint32_t i)
{
    return in->block_flags &&
           (in->block_flags[i] & LADEN_PLAN_BLOCK_NO_DISK);
}

static bool experts(const laden_plan_input *in, uint32_t i)
{
    return in->block_flags &&
           (in->block_flags[i] & LADEN_PLAN_BLOCK_EXPERTS);
}

/* Block i's bytes in a slot when it streams (slot_block_bytes). */
static uint64_t slot_size(const laden_plan_input *in, uint32_t i)
{
    return in->slot_block_bytes ? in->slot_block_bytes[i]
                                : in->block_bytes[i];
}

/* Block i's bytes on the RAM tier (ram_block_bytes: kept smaller). */
static uint64_t ram_size(const laden_plan_input *in, uint32_t i)
{
    return in->ram_block_bytes ? in->ram_block_bytes[i] : in->block_bytes[i];
}

/* Sums and products that saturate: a budget compared with UINT64_MAX
 * fails, as the true size would. */
static uint64_t sat_add(uint64_t a, uint64_t b)
{
    uint64_t s;
    return laden__add_u64(a, b, &s) ? s : UINT64_MAX;
}

/* Memory of the slots for `n` streamed blocks of at most `mx` bytes. */
static uint64_t slots_bytes(const laden_plan_input *in, uint32_t n,
                            uint64_t mx)
{
    uint64_t s;
    return laden__mul_u64(laden_slot_count(n, in->lookahead), mx, &s)
               ? s
               : UINT64_MAX;
}

/* Of f free blocks of which s stream, whether the j-th streams: the count
 * floor((j + 1) * s / f) grows at evenly spaced j. */
static bool spread_streams(uint32_t j, uint32_t s, uint32_t f)
{
    return (uint64_t)(j + 1) * s / f > (uint64_t)j * s / f;
}

/* Slots needed for the blocks with tiers[i] != GPU, skipping block
 * `skip`. */
static uint64_t slots_for(const plan *p, uint32_t skip, uint32_t *nslots,
                          uint64_t *slot_bytes)
{
    uint64_t mx = 0;
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->in->nblocks; i++) {
        if (i == skip || p->tiers[i] == LADEN_TIER_GPU)
            continue;
        n++;
        if (slot_size(p->in, i) > mx)
            mx = slot_size(p->in, i);
    }
    if (nslots)
        *nslots = laden_slot_count(n, p->in->lookahead);
    if (slot_bytes)
        *slot_bytes = mx;
    return slots_bytes(p->in, n, mx);
}

static laden_status check_block(const laden_plan_input *in, uint32_t i)
{
    int32_t a = asked_tier(in, i);
    uint8_t flags = in->block_flags ? in->block_flags[i] : 0;
    if (a < LADEN_TIER_AUTO || a > LADEN_TIER_DISK)
        return laden__fail(LADEN_E_INVAL, "block %u: unknown tier %d", i, a);
    if (flags & ~(LADEN_PLAN_BLOCK_NO_DISK | LADEN_PLAN_BLOCK_EXPERTS))
        return laden__fail(LADEN_E_INVAL, "block %u: unknown flags 0x%x", i,
                           (unsigned)flags);
    if (no_disk(in, i) && a == LADEN_TIER_DISK)
        return laden__fail(LADEN_E_INVAL,
                           "block %u is asked for disk, but it cannot "
                           "stream from disk (LADEN_PLAN_BLOCK_NO_DISK)",
                           i);
    return LADEN_OK;
}

static laden_status check_host_input(const laden_plan_input *in)
{
    const char *field = in->vram_free_bytes  ? "vram_free"
                        : in->max_vram_bytes ? "max_vram"
                        : in->reserve_bytes  ? "reserve"
                                             : NULL;
    if (field)
        return laden__fail(LADEN_E_INVAL,
                           "the CPU device has no VRAM: %s applies to CUDA "
                           "devices",
                           field);
    if (in->disk_staging)
        return laden__fail(LADEN_E_INVAL,
                           "the CPU device reads disk blocks straight into "
                           "its slots: disk_staging must be 0");
    return LADEN_OK;
}

/* 0. */
static laden_status check_input(const laden_plan_input *in)
{
    uint64_t sum = in->rest_bytes, ram = 0;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        laden_status s = check_block(in, i);
        if (s)
            return s;
        if (!laden__add_u64(sum, in->block_bytes[i], &sum) ||
            !laden__add_u64(ram, ram_size(in, i), &ram))
            return laden__fail(LADEN_E_INVAL, "block sizes overflow");
    }
    if (in->lookahead > LADEN_LOOKAHEAD_MAX)
        return laden__fail(LADEN_E_INVAL, "lookahead %u is above the "
                           "maximum, %u", in->lookahead, LADEN_LOOKAHEAD_MAX);
    if (in->host_device > 1)
        return laden__fail(LADEN_E_INVAL, "host_device %u: 0 (a CUDA "
                           "device) or 1 (the CPU)", in->host_device);
    return in->host_device ? check_host_input(in) : LADEN_OK;
}

/* 0. Blocks asked to a tier keep it; free ones stream for now. */
static void ask_tiers(plan *p)
{
    const laden_plan_input *in = p->in;
    p->gpu = in->rest_bytes;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        int32_t a = asked_tier(in, i);
        p->tiers[i] = a == LADEN_PLAN_FREE ? LADEN_TIER_RAM : a;
        p->why[i] = a == LADEN_TIER_GPU    ? LADEN_PLAN_WHY_ASKED_RESIDENT
                    : a == LADEN_TIER_RAM  ? LADEN_PLAN_WHY_ASKED_RAM
                    : a == LADEN_TIER_DISK ? LADEN_PLAN_WHY_ASKED_DISK
                                           : UNDECIDED;
        p->nfree += a == LADEN_PLAN_FREE;
        if (a == LADEN_TIER_GPU)
            p->gpu += in->block_bytes[i];
    }
}

/* 0. The RAM limit: the budget, or free RAM minus the minimum kept free
 * (also kept: the host device's rest, resident blocks and slots come from
 * it). */
static void ram_limit(plan *p)
{
    const laden_plan_input *in = p->in;
    uint64_t min_free = in->min_free_ram_bytes;
    if (min_free == LADEN_PLAN_AUTO) {
        min_free = in->ram_total_bytes / 100 * 8;
        if (min_free < GIB)
            min_free = GIB;
        if (min_free > 4 * GIB)
            min_free = 4 * GIB;
    }
    p->out->min_free_ram_bytes = min_free;
    p->free_left = in->ram_free_bytes > min_free ? in->ram_free_bytes -
                                                       min_free
                                                 : 0;
    p->budgeted = in->ram_budget_bytes != LADEN_PLAN_AUTO;
    p->ram = p->budgeted ? in->ram_budget_bytes : p->free_left;
    p->out->ram_limit_bytes = p->ram;
}

/* 1, CUDA device. */
static laden_status vram_budget(plan *p)
{
    const laden_plan_input *in = p->in;
    uint64_t cap = in->vram_free_bytes;
    if (in->max_vram_bytes) {
        if (in->max_vram_bytes > in->vram_free_bytes)
            p->out->warnings |= LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE;
        else
            cap = in->max_vram_bytes;
    }
    if (in->reserve_bytes == 0)
        p->out->warnings |= LADEN_PLAN_WARN_NO_RESERVE;
    if (cap < in->reserve_bytes)
        return laden__fail(LADEN_E_BUDGET, "VRAM budget %s is smaller than "
                           "the %s kept for activations",
                           B(cap), B(in->reserve_bytes));
    p->avail = p->out->vram_avail_bytes = cap - in->reserve_bytes;
    uint64_t need = sat_add(p->gpu, slots_for(p, UINT32_MAX, NULL, NULL));
    if (need > p->avail)
        return laden__fail(LADEN_E_BUDGET,
                           "VRAM available %s (budget %s minus %s kept for "
                           "activations) is less than the %s needed by the "
                           "rest of the model, the blocks asked resident "
                           "and the slots for streaming; at least %s of "
                           "budget would fit",
                           B(p->avail), B(cap), B(in->reserve_bytes),
                           B(need), B(sat_add(need, in->reserve_bytes)));
    return LADEN_OK;
}

/* 1, host device: the rest, the blocks asked resident and the slots come
 * from the free RAM (without a RAM budget, the RAM tier then takes what
 * they leave of it). */
static laden_status host_budget(plan *p)
{
    const laden_plan_input *in = p->in;
    uint64_t mx = 0;
    uint32_t n = 0; /* blocks that may stream: all but those asked resident */
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (asked_tier(in, i) == LADEN_TIER_GPU)
            continue;
        n++;
        if (slot_size(in, i) > mx)
            mx = slot_size(in, i);
    }
    p->out->nslots = laden_slot_count(n, in->lookahead);
    p->out->slot_bytes = mx;
    p->host_slots = slots_bytes(in, n, mx);
    p->avail = p->free_left;
    if (sat_add(p->gpu, p->host_slots) <= p->avail)
        return LADEN_OK;
    return laden__fail(LADEN_E_BUDGET, "free RAM %s (keeping %s free) "
                       "cannot hold the resident part (the rest of the model "
                       "and the blocks asked resident: %s) and %u slot%s (%s)",
                       B(p->avail), B(p->out->min_free_ram_bytes), B(p->gpu),
                       p->out->nslots, p->out->nslots == 1 ? "" : "s",
                       B(p->host_slots));
}

/* 2. Whether free block i fits as a resident block. */
static bool resident_fits(const plan *p, uint32_t i)
{
    uint64_t slots = p->host ? p->host_slots : slots_for(p, i, NULL, NULL);
    return sat_add(p->gpu + p->in->block_bytes[i], slots) <= p->avail;
}

/* 2. Dense blocks first, then (as many as fit, the CUDA device) the
 * EXPERTS blocks; each pass keeps its resident blocks a prefix of its
 * blocks. */
static laden_status choose_resident(plan *p)
{
    bool later = false; /* EXPERTS blocks are left for the second pass */
    for (uint32_t i = 0; p->want < 0 && i < p->in->nblocks; i++)
        later |= p->why[i] == UNDECIDED && experts(p->in, i);
    for (int pass = 0; pass < 1 + later; pass++) {
        for (uint32_t i = 0; i < p->in->nblocks; i++) {
            if (p->why[i] != UNDECIDED ||
                (later && experts(p->in, i) != (pass == 1)))
                continue;
            if (p->want >= 0 && p->made >= (uint32_t)p->want)
                break;
            if (resident_fits(p, i)) {
                p->tiers[i] = LADEN_TIER_GPU;
                p->why[i] = p->want >= 0 ? LADEN_PLAN_WHY_ASKED_RESIDENT
                                         : LADEN_PLAN_WHY_FITS_VRAM;
                p->gpu += p->in->block_bytes[i];
                p->made++;
            } else if (p->want >= 0) {
                return laden__fail(LADEN_E_BUDGET,
                                   "%d resident blocks asked, but only %u "
                                   "fit the %s of %s",
                                   p->want, p->made, B(p->avail),
                                   p->host ? "RAM (with the rest of the "
                                             "model and the slots)"
                                           : "VRAM available");
            } else {
                break; /* keep resident blocks a prefix: later ones stream */
            }
        }
    }
    p->experts_later = later;
    if (p->want >= 0 && p->made < (uint32_t)p->want)
        return laden__fail(LADEN_E_BUDGET, "%d resident blocks asked, but "
                           "the model has %u free blocks", p->want, p->nfree);
    return LADEN_OK;
}

/* What streams with the current tiers (nstream 0), or with nstream of the
 * free blocks streaming, spread. */
static streamed summarize(const plan *p, uint32_t nstream)
{
    const laden_plan_input *in = p->in;
    streamed s = {.gpu = in->rest_bytes};
    uint32_t j = 0;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        int32_t a = asked_tier(in, i);
        uint64_t b = in->block_bytes[i];
        bool streams = nstream && a == LADEN_PLAN_FREE
                           ? spread_streams(j++, nstream, p->nfree)
                           : p->tiers[i] != LADEN_TIER_GPU;
        if (!streams) {
            s.gpu += b;
            continue;
        }
        uint64_t r = ram_size(in, i); /* what the RAM tier would hold */
        uint64_t sl = slot_size(in, i);
        s.n++;
        s.max_bytes = sl > s.max_bytes ? sl : s.max_bytes;
        s.asked_ram += a == LADEN_TIER_RAM ? r : 0;
        s.asked_disk |= a == LADEN_TIER_DISK;
        s.free_bytes += a == LADEN_PLAN_FREE ? r : 0;
        s.no_disk_bytes += a == LADEN_PLAN_FREE && no_disk(in, i) ? r : 0;
    }
    return s;
}

static uint64_t staging_for(const plan *p, const streamed *s)
{
    return p->in->disk_staging ? slots_bytes(p->in, s->n, s->max_bytes) : 0;
}

/* RAM for the RAM tier: all of it if every streamed block fits without
 * staging, else what the staging leaves. */
static uint64_t ram_cap(const plan *p, const streamed *s)
{
    if (!s->asked_disk && s->asked_ram + s->free_bytes <= p->ram)
        return p->ram; /* everything fits: no disk, no staging */
    uint64_t staging = staging_for(p, s);
    return p->ram > staging ? p->ram - staging : 0;
}

static bool no_disk_fits(const plan *p, const streamed *s)
{
    return s->no_disk_bytes == 0 ||
           s->asked_ram + s->no_disk_bytes <= ram_cap(p, s);
}

/* 3. */
static void spread(plan *p)
{
    uint32_t nstream = p->nfree - p->made;
    if (p->made == 0 || nstream == 0 || p->experts_later)
        return; /* EXPERTS blocks: resident where it pays most, kept */
    streamed pre = summarize(p, 0), spr = summarize(p, nstream);
    uint64_t need = sat_add(spr.gpu, slots_bytes(p->in, spr.n, spr.max_bytes));
    if (need > p->avail || (!no_disk_fits(p, &spr) && no_disk_fits(p, &pre)))
        return;
    uint32_t j = 0;
    for (uint32_t i = 0; i < p->in->nblocks; i++) {
        if (asked_tier(p->in, i) != LADEN_PLAN_FREE)
            continue;
        bool streams = spread_streams(j++, nstream, p->nfree);
        p->tiers[i] = streams ? LADEN_TIER_RAM : LADEN_TIER_GPU;
        p->why[i] = streams          ? UNDECIDED
                    : p->want >= 0 ? LADEN_PLAN_WHY_ASKED_RESIDENT
                                   : LADEN_PLAN_WHY_FITS_VRAM;
    }
    p->gpu = spr.gpu;
}

/* 4. The free blocks with no_disk(i) == pass_no_disk, in order. */
static laden_status place_pass(plan *p, bool pass_no_disk, uint64_t cap,
                               uint64_t *used)
{
    const laden_plan_input *in = p->in;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (p->why[i] != UNDECIDED || no_disk(in, i) != pass_no_disk)
            continue;
        uint64_t b = ram_size(in, i);
        if (*used + b <= cap) {
            p->tiers[i] = LADEN_TIER_RAM;
            p->why[i] = p->host ? LADEN_PLAN_WHY_FITS_HOST_RAM
                                : LADEN_PLAN_WHY_NO_VRAM_RAM;
            *used += b;
        } else if (pass_no_disk) {
            return laden__fail(LADEN_E_BUDGET, "block %u (%s) is converted "
                               "on load, so it cannot stream from disk "
                               "(which is read as stored), and it does not "
                               "fit the %s of RAM left; ways out: %s more "
                               "RAM for the RAM tier (this block alone), "
                               "loading in the checkpoint's own dtypes (no "
                               "dtype, compute_dtype or storage_dtype: "
                               "blocks then stream from disk as stored), "
                               "or a checkpoint saved in the dtype wanted",
                               i, B(b), B(cap - *used), B(b - (cap - *used)));
        } else {
            p->tiers[i] = LADEN_TIER_DISK;
            p->why[i] = LADEN_PLAN_WHY_NO_RAM_DISK;
        }
    }
    return LADEN_OK;
}

/* 4. */
static laden_status place_streamed(plan *p)
{
    if (p->host && !p->budgeted)
        p->ram = p->avail - p->gpu - p->host_slots; /* fits: step 1, 2 */
    streamed s = summarize(p, 0);
    uint64_t cap = ram_cap(p, &s), used = s.asked_ram;
    if (s.asked_ram > cap)
        return laden__fail(LADEN_E_BUDGET, "blocks asked for RAM need %s, "
                           "but %s of RAM is available for them",
                           B(s.asked_ram), B(cap));
    laden_status st = place_pass(p, true, cap, &used);
    if (!st)
        st = place_pass(p, false, cap, &used);
    p->out->staging_bytes = staging_for(p, &s); /* kept if any disk block */
    return st;
}

/* 5. CUDA: the copies, or the disk reads if slower; 0 without an h2d
 * rate.  Host: nothing is copied, only the disk reads take time. */
static double predicted_ms(const plan *p, uint64_t ram_tier, uint64_t disk)
{
    const laden_plan_input *in = p->in;
    double t = 0;
    if (!p->host && in->h2d_bytes_per_s > 0)
        t = (double)(ram_tier + disk) / in->h2d_bytes_per_s;
    if ((p->host || in->h2d_bytes_per_s > 0) && disk &&
        in->disk_bytes_per_s > 0 && (double)disk / in->disk_bytes_per_s > t)
        t = (double)disk / in->disk_bytes_per_s;
    return t * 1e3;
}

/* 5. */
static laden_status totals(plan *p)
{
    const laden_plan_input *in = p->in;
    laden_plan_result *out = p->out;
    uint64_t disk = 0, ram_tier = 0;
    uint32_t ndisk = 0; /* counted: a block of 0 bytes still streams */
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (p->tiers[i] == LADEN_TIER_RAM)
            ram_tier += ram_size(in, i);
        if (p->tiers[i] == LADEN_TIER_DISK) {
            disk += in->block_bytes[i];
            ndisk++;
        }
    }
    out->gpu_bytes = p->gpu;
    if (!p->host)
        out->vram_used_bytes = sat_add(
            p->gpu, slots_for(p, UINT32_MAX, &out->nslots, &out->slot_bytes));
    out->ram_avail_bytes = p->ram;
    out->ram_bytes = ram_tier;
    out->disk_bytes = disk;
    out->staging_bytes = ndisk ? out->staging_bytes : 0;
    out->ram_used_bytes = ram_tier + out->staging_bytes;
    if (ndisk && out->staging_bytes > p->ram)
        return laden__fail(LADEN_E_BUDGET, "streaming from disk needs %s of "
                           "pinned staging, but only %s of RAM is available",
                           B(out->staging_bytes), B(p->ram));
    if (ndisk)
        out->warnings |= LADEN_PLAN_WARN_DISK;
    out->predicted_ms = predicted_ms(p, ram_tier, disk);
    return LADEN_OK;
}

static laden_status compute(plan *p)
{
    laden_status s = check_input(p->in);
    if (s)
        return s;
    ask_tiers(p);
    ram_limit(p);
    s = p->host ? host_budget(p) : vram_budget(p);
    if (!s)
        s = choose_resident(p);
    if (!s && !p->host)
        spread(p);
    if (!s)
        s = place_streamed(p);
    return s ? s : totals(p);
}

laden_status laden_plan_compute(const laden_plan_input *in, int32_t *tiers,
                                int32_t *why, laden_plan_result *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!in || !out || (in->nblocks && (!in->block_bytes || !tiers || !why)))
        return laden__fail(LADEN_E_INVAL, "laden_plan_compute: NULL argument");
    /* The default headroom is decided here, once, for every caller: on
     * the host device nothing is VRAM, so AUTO keeps nothing. */
    laden_plan_input eff = *in;
    if (eff.reserve_bytes == LADEN_PLAN_AUTO)
        eff.reserve_bytes = eff.host_device ? 0 : LADEN_PLAN_HEADROOM_DEFAULT;
    plan p = {.in = &eff, .tiers = tiers, .why = why, .out = out,
              .host = in->host_device != 0, .want = in->resident_blocks};
    if (p.host && p.want < 0)
        p.want = 0;
    laden_status s = compute(&p);
    if (s)
        memset(out, 0, sizeof *out);
    else
        out->reserve_bytes = eff.reserve_bytes;
    return s;
}
