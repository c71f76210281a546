/* libFuzzer target: the planner on arbitrary inputs.  Either it fails with
 * a status, or every invariant holds: budgets kept, asked tiers kept,
 * NO_DISK blocks off disk, sums consistent, the same answer twice.
 *
 * Input bytes, big-endian, read in this order (a short input reads zeros,
 * so a corpus file written before a field was added still means what it
 * meant): nblocks; per block size (4), shift (1), asked (1); the fields
 * of laden_plan_input; then a mode byte: bit 0 the host device (its VRAM
 * fields and disk_staging cleared unless bit 1), bit 2 per-block flags
 * follow (one byte each: 0xff is kept to test unknown bits, else bit 0),
 * bit 3 a lookahead byte follows (up to 71: past LADEN_LOOKAHEAD_MAX),
 * bit 4 per-block RAM-tier sizes follow (one byte k each: the block's
 * bytes * k / 128, so smaller or up to twice as large). */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "laden/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int fuzz_plan_check(const laden_plan_input *in);

#define MAXB 64

static uint64_t take(const uint8_t **p, size_t *n, unsigned bytes)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < bytes && *n; i++, (*p)++, (*n)--)
        v = v << 8 | **p;
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t bytes[MAXB];
    int32_t asked[MAXB];
    laden_plan_input in;
    memset(&in, 0, sizeof in);
    in.nblocks = (uint32_t)(take(&data, &size, 1) % MAXB);
    for (uint32_t i = 0; i < in.nblocks; i++) {
        bytes[i] = take(&data, &size, 4) << (take(&data, &size, 1) % 12);
        asked[i] = (int32_t)(take(&data, &size, 1) % 6) - 3;
        if (asked[i] < -1)
            asked[i] = -1;
    }
    in.block_bytes = bytes;
    in.asked = take(&data, &size, 1) & 1 ? asked : NULL;
    in.rest_bytes = take(&data, &size, 5);
    in.vram_free_bytes = take(&data, &size, 6);
    in.max_vram_bytes = take(&data, &size, 6);
    in.reserve_bytes = take(&data, &size, 5);
    in.ram_total_bytes = take(&data, &size, 6);
    in.ram_free_bytes = take(&data, &size, 6);
    in.ram_budget_bytes = take(&data, &size, 6);
    if (!in.ram_budget_bytes) /* the corpus's 0 meant "auto" */
        in.ram_budget_bytes = LADEN_PLAN_AUTO;
    in.min_free_ram_bytes = take(&data, &size, 1) & 1 ? UINT64_MAX
                                                      : take(&data, &size, 5);
    in.resident_blocks = (int32_t)(take(&data, &size, 1) % (MAXB + 1)) - 1;
    in.lookahead = (uint32_t)take(&data, &size, 1) % 5;
    in.disk_staging = (uint32_t)take(&data, &size, 1) & 1;
    in.h2d_bytes_per_s = (double)take(&data, &size, 4);
    in.disk_bytes_per_s = (double)take(&data, &size, 4);
    unsigned mode = (unsigned)take(&data, &size, 1);
    if (mode & 1) {
        in.host_device = 1;
        if (!(mode & 2))
            in.vram_free_bytes = in.max_vram_bytes = in.reserve_bytes =
                in.disk_staging = 0;
    }
    uint8_t flags[MAXB];
    if (mode & 4) {
        for (uint32_t i = 0; i < in.nblocks; i++) {
            uint8_t f = (uint8_t)take(&data, &size, 1);
            flags[i] = f == 0xff ? f
                                 : f & (LADEN_PLAN_BLOCK_NO_DISK |
                                        LADEN_PLAN_BLOCK_EXPERTS);
        }
        in.block_flags = flags;
    }
    if (mode & 8)
        in.lookahead = (uint32_t)take(&data, &size, 1) % 72;
    uint64_t ram[MAXB];
    if (mode & 16) {
        for (uint32_t i = 0; i < in.nblocks; i++)
            ram[i] = bytes[i] / 128 * take(&data, &size, 1);
        in.ram_block_bytes = ram;
    }
    fuzz_plan_check(&in);
    return 0;
}

/* Plans `in` twice and traps if an invariant breaks; 1 if it planned. */
int fuzz_plan_check(const laden_plan_input *pin)
{
    laden_plan_input in = *pin;
    const uint64_t *bytes = in.block_bytes;
    int32_t t1[MAXB], w1[MAXB], t2[MAXB], w2[MAXB];
    if (in.nblocks > MAXB)
        return 0;
    laden_plan_result r1, r2;
    int s1 = laden_plan_compute(&in, t1, w1, &r1);
    int s2 = laden_plan_compute(&in, t2, w2, &r2);
    if (s1 != s2)
        __builtin_trap();
    if (s1 != LADEN_OK)
        return 0;
    if (in.lookahead > LADEN_LOOKAHEAD_MAX)
        __builtin_trap();
    if (r1.ram_used_bytes > r1.ram_avail_bytes && r1.ram_bytes)
        __builtin_trap();
    if (r1.ram_used_bytes > r1.ram_limit_bytes)
        __builtin_trap();
    if (memcmp(&r1, &r2, sizeof r1) || memcmp(t1, t2, in.nblocks * 4) ||
        memcmp(w1, w2, in.nblocks * 4))
        __builtin_trap();
    if (r1.vram_used_bytes > r1.vram_avail_bytes)
        __builtin_trap();
    if (r1.disk_bytes && r1.staging_bytes > r1.ram_avail_bytes)
        __builtin_trap();
    uint64_t gpu = in.rest_bytes, ram = 0, disk = 0, mx = 0;
    uint32_t nmay = 0; /* blocks not asked resident: they may stream */
    for (uint32_t i = 0; i < in.nblocks; i++) {
        if (t1[i] < LADEN_TIER_GPU || t1[i] > LADEN_TIER_DISK ||
            !laden_plan_why_text(w1[i]))
            __builtin_trap();
        if (in.asked && in.asked[i] != LADEN_PLAN_FREE &&
            in.asked[i] != t1[i])
            __builtin_trap();
        if (in.block_flags && (in.block_flags[i] & LADEN_PLAN_BLOCK_NO_DISK) &&
            t1[i] == LADEN_TIER_DISK)
            __builtin_trap();
        uint64_t *sum = t1[i] == LADEN_TIER_GPU   ? &gpu
                        : t1[i] == LADEN_TIER_RAM ? &ram
                                                  : &disk;
        *sum += t1[i] == LADEN_TIER_RAM && in.ram_block_bytes
                    ? in.ram_block_bytes[i]
                    : bytes[i];
        if (!in.asked || in.asked[i] != LADEN_TIER_GPU) {
            nmay++;
            mx = bytes[i] > mx ? bytes[i] : mx;
        }
    }
    if (gpu != r1.gpu_bytes || ram != r1.ram_bytes || disk != r1.disk_bytes)
        __builtin_trap();
    if (in.host_device) {
        /* Everything is host memory: rest, resident and slots from the
         * free RAM; the RAM tier from the budget, or without one from
         * what they leave of the free RAM. */
        uint64_t slots = (uint64_t)r1.nslots * r1.slot_bytes, used;
        uint64_t free_left = in.ram_free_bytes > r1.min_free_ram_bytes
                                 ? in.ram_free_bytes - r1.min_free_ram_bytes
                                 : 0;
        bool budget = in.ram_budget_bytes != LADEN_PLAN_AUTO;
        if (r1.vram_avail_bytes || r1.vram_used_bytes || r1.staging_bytes ||
            r1.nslots != laden_slot_count(nmay, in.lookahead) ||
            r1.slot_bytes != mx ||
            __builtin_add_overflow(gpu, slots, &used) || used > free_left ||
            (!budget && (used + ram > r1.ram_limit_bytes ||
                         r1.ram_avail_bytes != r1.ram_limit_bytes - used)) ||
            (budget && (ram > r1.ram_limit_bytes ||
                        r1.ram_avail_bytes != r1.ram_limit_bytes)))
            __builtin_trap();
    }
    return 1;
}
