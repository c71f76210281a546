/* The planner.  See include/laden/plan.h.
 *
 * Order of decisions, each deterministic:
 *  1. VRAM available = min(max_vram, free) - reserve; the rest of the model
 *     must fit there.
 *  2. Blocks asked to a tier keep it.  Free blocks become resident in
 *     schedule order while the rest, the resident blocks so far, this block
 *     and the slots for every block not yet resident fit (the slots are
 *     counted for all candidates, so an earlier choice never makes a later
 *     state infeasible).  With resident_blocks = n, exactly n, if that
 *     fits.  The k blocks so chosen are then spread: the streamed ones are
 *     placed evenly through the schedule instead of all at its end, so the
 *     copy engine fills the slots while resident blocks compute (with the
 *     streamed blocks at the end, two slots fill during the resident part
 *     and the engine then idles; measured on an H200: 1.20 x the ideal,
 *     against 1.04 spread).  If the spread set does not fit (blocks of
 *     unequal size), the prefix is kept.
 *  3. Streamed blocks go to RAM in order while they fit the RAM available
 *     (all of them if they fit without staging; otherwise the staging for
 *     the disk blocks is set aside first); the rest stay on disk. */
#include "laden/plan.h"

#include <stdio.h>
#include <string.h>

#include "../core/internal.h"

#define GIB (1ull << 30)

static const char *const why_text[] = {
#define WHY_TEXT(name, text) text,
    LADEN_PLAN_WHY_LIST(WHY_TEXT)
#undef WHY_TEXT
};

const char *laden_plan_why_text(int32_t why)
{
    return why >= 0 && why < LADEN_PLAN_WHY_COUNT ? why_text[why] : NULL;
}

#define B(x) (laden__bytes(x).s)

/* Of f free blocks of which s stream, whether the j-th streams: the count
 * floor((j + 1) * s / f) grows at evenly spaced j. */
static bool spread_streams(uint32_t j, uint32_t s, uint32_t f)
{
    return (uint64_t)(j + 1) * s / f > (uint64_t)j * s / f;
}

/* Slots needed for the blocks with tiers[i] != GPU (or all if tiers NULL),
 * skipping block `skip`. */
static uint64_t slots_for(const laden_plan_input *in, const int32_t *tiers,
                          uint32_t skip, uint32_t nslots_max, uint32_t *nslots,
                          uint64_t *slot_bytes)
{
    uint64_t mx = 0;
    uint32_t n = 0;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (i == skip || tiers[i] == 0)
            continue;
        n++;
        if (in->block_bytes[i] > mx)
            mx = in->block_bytes[i];
    }
    uint32_t k = n < nslots_max ? n : nslots_max;
    if (nslots)
        *nslots = k;
    if (slot_bytes)
        *slot_bytes = mx;
    return (uint64_t)k * mx;
}

laden_status laden_plan_compute(const laden_plan_input *in, int32_t *tiers,
                                int32_t *why, laden_plan_result *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!in || !out || (in->nblocks && (!in->block_bytes || !tiers || !why)))
        return laden__fail(LADEN_E_INVAL, "laden_plan_compute: NULL argument");
    uint32_t nslots_max = (in->lookahead ? in->lookahead : 2) + 1;
    uint64_t sum = in->rest_bytes;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        int32_t a = in->asked ? in->asked[i] : LADEN_PLAN_FREE;
        if (a < LADEN_PLAN_FREE || a > 2)
            return laden__fail(LADEN_E_INVAL, "block %u: unknown tier %d", i,
                               a);
        if (!laden__add_u64(sum, in->block_bytes[i], &sum))
            return laden__fail(LADEN_E_INVAL, "block sizes overflow");
    }

    /* 1. VRAM. */
    uint64_t cap = in->vram_free_bytes;
    if (in->max_vram_bytes) {
        if (in->max_vram_bytes > in->vram_free_bytes)
            out->warnings |= LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE;
        else
            cap = in->max_vram_bytes;
    }
    if (in->reserve_bytes == 0)
        out->warnings |= LADEN_PLAN_WARN_NO_RESERVE;
    if (cap < in->reserve_bytes)
        return laden__fail(LADEN_E_BUDGET,
                           "VRAM budget %s is smaller than the %s "
                           "kept for activations",
                           B(cap), B(in->reserve_bytes));
    uint64_t avail = cap - in->reserve_bytes;
    out->vram_avail_bytes = avail;

    /* 2. Resident blocks. */
    uint64_t gpu = in->rest_bytes;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        int32_t a = in->asked ? in->asked[i] : LADEN_PLAN_FREE;
        tiers[i] = a == LADEN_PLAN_FREE ? 1 : a; /* free: streamed for now */
        why[i] = a == 0   ? LADEN_PLAN_WHY_ASKED_RESIDENT
                 : a == 1 ? LADEN_PLAN_WHY_ASKED_RAM
                 : a == 2 ? LADEN_PLAN_WHY_ASKED_DISK
                          : -1;
        if (a == 0)
            gpu += in->block_bytes[i];
    }
    uint64_t need = gpu + slots_for(in, tiers, UINT32_MAX, nslots_max, NULL,
                                    NULL);
    if (need > avail)
        return laden__fail(LADEN_E_BUDGET,
                           "VRAM available %s (budget %s minus "
                           "%s kept for activations) is less than the "
                           "%s needed by the rest of the model, the "
                           "blocks asked resident and the slots for "
                           "streaming; at least %s of budget would fit",
                           B(avail), B(cap), B(in->reserve_bytes),
                           B(need), B(need + in->reserve_bytes));
    int32_t want = in->resident_blocks;
    int32_t made = 0;
    uint32_t nfree = 0;
    for (uint32_t i = 0; i < in->nblocks; i++)
        nfree += in->asked == NULL || in->asked[i] == LADEN_PLAN_FREE;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (why[i] != -1)
            continue;
        if (want >= 0 && made >= want)
            break;
        uint64_t s = slots_for(in, tiers, i, nslots_max, NULL, NULL);
        uint64_t total = gpu + in->block_bytes[i] + s;
        if (total <= avail) {
            tiers[i] = 0;
            why[i] = want >= 0 ? LADEN_PLAN_WHY_ASKED_RESIDENT
                               : LADEN_PLAN_WHY_FITS_VRAM;
            gpu += in->block_bytes[i];
            made++;
        } else if (want >= 0) {
            return laden__fail(LADEN_E_BUDGET,
                               "%d resident blocks asked, but only %d fit "
                               "the %s of VRAM available",
                               want, made, B(avail));
        } else {
            break; /* keep resident blocks a prefix: later ones stream */
        }
    }
    if (want >= 0 && made < want)
        return laden__fail(LADEN_E_BUDGET,
                           "%d resident blocks asked, but the model has %u "
                           "free blocks",
                           want, nfree);
    /* Spread: keep `made` free blocks resident with the streamed ones
     * evenly placed; adopt it only if it fits as the prefix did. */
    uint32_t nstream = nfree - (uint32_t)made;
    if (made > 0 && nstream > 0) {
        uint64_t g2 = gpu, mx = 0;
        uint32_t ns = 0, j = 0;
        for (uint32_t i = 0; i < in->nblocks; i++) {
            bool is_free = !in->asked || in->asked[i] == LADEN_PLAN_FREE;
            bool streams = is_free ? spread_streams(j++, nstream, nfree)
                                   : tiers[i] != 0;
            if (is_free && tiers[i] == 0 && streams)
                g2 -= in->block_bytes[i];
            else if (is_free && tiers[i] != 0 && !streams)
                g2 += in->block_bytes[i];
            if (streams) {
                ns++;
                if (in->block_bytes[i] > mx)
                    mx = in->block_bytes[i];
            }
        }
        if (g2 + (uint64_t)(ns < nslots_max ? ns : nslots_max) * mx <= avail) {
            j = 0;
            for (uint32_t i = 0; i < in->nblocks; i++) {
                if (in->asked && in->asked[i] != LADEN_PLAN_FREE)
                    continue;
                bool streams = spread_streams(j++, nstream, nfree);
                tiers[i] = streams ? 1 : 0;
                why[i] = streams        ? -1
                         : want >= 0    ? LADEN_PLAN_WHY_ASKED_RESIDENT
                                        : LADEN_PLAN_WHY_FITS_VRAM;
            }
            gpu = g2;
        }
    }
    out->gpu_bytes = gpu;
    out->vram_used_bytes =
        gpu + slots_for(in, tiers, UINT32_MAX, nslots_max, &out->nslots,
                        &out->slot_bytes);

    /* 3. RAM or disk for the streamed blocks. */
    uint64_t min_free = in->min_free_ram_bytes;
    if (min_free == UINT64_MAX) {
        min_free = in->ram_total_bytes / 100 * 8;
        if (min_free < GIB)
            min_free = GIB;
        if (min_free > 4 * GIB)
            min_free = 4 * GIB;
    }
    out->min_free_ram_bytes = min_free;
    uint64_t ram = in->ram_budget_bytes
                       ? in->ram_budget_bytes
                       : (in->ram_free_bytes > min_free
                              ? in->ram_free_bytes - min_free
                              : 0);
    out->ram_avail_bytes = ram;
    uint64_t max_streamed = 0, asked_ram = 0;
    uint32_t nstreamed = 0;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (tiers[i] == 0)
            continue;
        nstreamed++;
        if (in->block_bytes[i] > max_streamed)
            max_streamed = in->block_bytes[i];
        if (why[i] == LADEN_PLAN_WHY_ASKED_RAM)
            asked_ram += in->block_bytes[i];
    }
    bool any_asked_disk = false;
    for (uint32_t i = 0; i < in->nblocks; i++)
        any_asked_disk |= why[i] == LADEN_PLAN_WHY_ASKED_DISK;
    uint64_t staging = in->disk_staging
                           ? (uint64_t)(nstreamed < nslots_max ? nstreamed
                                                               : nslots_max) *
                                 max_streamed
                           : 0;
    uint64_t ram_cap;
    uint64_t free_streamed = 0;
    for (uint32_t i = 0; i < in->nblocks; i++)
        if (why[i] == -1)
            free_streamed += in->block_bytes[i];
    if (!any_asked_disk && asked_ram + free_streamed <= ram)
        ram_cap = ram; /* everything fits: no disk, no staging */
    else
        ram_cap = ram > staging ? ram - staging : 0;
    uint64_t used = asked_ram;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (why[i] != -1)
            continue;
        if (used + in->block_bytes[i] <= ram_cap) {
            tiers[i] = 1;
            why[i] = LADEN_PLAN_WHY_NO_VRAM_RAM;
            used += in->block_bytes[i];
        } else {
            tiers[i] = 2;
            why[i] = LADEN_PLAN_WHY_NO_RAM_DISK;
        }
    }
    uint64_t disk = 0, ram_tier = 0;
    uint32_t ndisk = 0;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (tiers[i] == 1)
            ram_tier += in->block_bytes[i];
        if (tiers[i] == 2) {
            disk += in->block_bytes[i];
            ndisk++;
        }
    }
    out->ram_bytes = ram_tier;
    out->disk_bytes = disk;
    out->staging_bytes = ndisk ? staging : 0;
    out->ram_used_bytes = ram_tier + out->staging_bytes;
    if (asked_ram > ram_cap && asked_ram > 0)
        return laden__fail(LADEN_E_BUDGET,
                           "blocks asked for RAM need %s, but %s of "
                           "RAM is available for them",
                           B(asked_ram), B(ram_cap));
    if (ndisk && out->staging_bytes > ram)
        return laden__fail(LADEN_E_BUDGET,
                           "streaming from disk needs %s of pinned "
                           "staging, but only %s of RAM is available",
                           B(out->staging_bytes), B(ram));
    if (ndisk)
        out->warnings |= LADEN_PLAN_WARN_DISK;
    if (in->h2d_bytes_per_s > 0) {
        double t = (double)(ram_tier + disk) / in->h2d_bytes_per_s;
        if (disk && in->disk_bytes_per_s > 0) {
            double td = (double)disk / in->disk_bytes_per_s;
            if (td > t)
                t = td;
        }
        out->predicted_ms = t * 1e3;
    }
    return LADEN_OK;
}
