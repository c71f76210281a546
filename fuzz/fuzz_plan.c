/* libFuzzer target: the planner on arbitrary inputs.  Either it fails with
 * a status, or every invariant holds: budgets kept, asked tiers kept, sums
 * consistent, the same answer twice. */
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
    in.min_free_ram_bytes = take(&data, &size, 1) & 1 ? UINT64_MAX
                                                      : take(&data, &size, 5);
    in.resident_blocks = (int32_t)(take(&data, &size, 1) % (MAXB + 1)) - 1;
    in.lookahead = (uint32_t)take(&data, &size, 1) % 5;
    in.disk_staging = (uint32_t)take(&data, &size, 1) & 1;
    in.h2d_bytes_per_s = (double)take(&data, &size, 4);
    in.disk_bytes_per_s = (double)take(&data, &size, 4);
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
    if (r1.ram_used_bytes > r1.ram_avail_bytes && r1.ram_bytes)
        __builtin_trap();
    if (memcmp(&r1, &r2, sizeof r1) || memcmp(t1, t2, in.nblocks * 4) ||
        memcmp(w1, w2, in.nblocks * 4))
        __builtin_trap();
    if (r1.vram_used_bytes > r1.vram_avail_bytes)
        __builtin_trap();
    if (r1.disk_bytes && r1.staging_bytes > r1.ram_avail_bytes)
        __builtin_trap();
    uint64_t gpu = in.rest_bytes, ram = 0, disk = 0;
    for (uint32_t i = 0; i < in.nblocks; i++) {
        if (t1[i] < 0 || t1[i] > 2 || !laden_plan_why_text(w1[i]))
            __builtin_trap();
        if (in.asked && in.asked[i] != LADEN_PLAN_FREE &&
            in.asked[i] != t1[i])
            __builtin_trap();
        uint64_t *sum = t1[i] == 0 ? &gpu : t1[i] == 1 ? &ram : &disk;
        *sum += bytes[i];
    }
    if (gpu != r1.gpu_bytes || ram != r1.ram_bytes || disk != r1.disk_bytes)
        __builtin_trap();
    return 1;
}
