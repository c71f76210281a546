#include "test.h"

#include "laden/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int fuzz_plan_check(const laden_plan_input *in);

static laden_plan_input base(uint64_t *bytes, uint32_t n)
{
    laden_plan_input in;
    memset(&in, 0, sizeof in);
    for (uint32_t i = 0; i < n; i++)
        bytes[i] = 100;
    in.nblocks = n;
    in.block_bytes = bytes;
    in.rest_bytes = 50;
    in.vram_free_bytes = 1000;
    in.reserve_bytes = 100;
    in.ram_total_bytes = 64ull << 30;
    in.ram_budget_bytes = 600;
    in.resident_blocks = -1;
    in.lookahead = 2;
    in.disk_staging = 1;
    in.h2d_bytes_per_s = 1e9;
    in.disk_bytes_per_s = 1e8;
    return in;
}

TEST(plan_fills_vram_then_ram_then_disk)
{
    uint64_t b[10];
    int32_t t[10], w[10];
    laden_plan_result r;
    laden_plan_input in = base(b, 10);
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    /* 900 available: rest 50 + 5 blocks + 3 slots of 100 = 850; the five
     * streamed blocks are spread through the schedule. */
    for (int i = 0; i < 10; i++)
        CHECK(t[i] == (i % 2 ? 1 : 0));
    CHECK(w[0] == LADEN_PLAN_WHY_FITS_VRAM && w[5] == LADEN_PLAN_WHY_NO_VRAM_RAM);
    CHECK(r.vram_avail_bytes == 900 && r.vram_used_bytes == 850);
    CHECK(r.nslots == 3 && r.slot_bytes == 100);
    CHECK(r.ram_bytes == 500 && r.disk_bytes == 0 && r.staging_bytes == 0);
    CHECK(r.predicted_ms > 0.49e-3 && r.predicted_ms < 0.51e-3);
    /* Less RAM: staging is set aside, the rest goes to disk. */
    in.ram_budget_bytes = 450;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(t[1] == 1 && t[3] == 2 && t[9] == 2);
    CHECK(w[3] == LADEN_PLAN_WHY_NO_RAM_DISK);
    CHECK(r.staging_bytes == 300 && r.ram_used_bytes == 400);
    CHECK(r.warnings & LADEN_PLAN_WARN_DISK);
    /* Disk time dominates the prediction: 400 bytes at 1e8 B/s. */
    CHECK(r.predicted_ms > 3.9e-3 && r.predicted_ms < 4.1e-3);
    in.ram_budget_bytes = 250; /* not even the staging */
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "staging");
    /* Same inputs, same plan. */
    in.ram_budget_bytes = 450;
    int32_t t2[10], w2[10];
    laden_plan_result r2;
    CHECK_OK(laden_plan_compute(&in, t2, w2, &r2));
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(memcmp(t, t2, sizeof t) == 0 && memcmp(&r, &r2, sizeof r) == 0);
}

TEST(plan_resident_blocks_and_asked_tiers)
{
    uint64_t b[10];
    int32_t t[10], w[10], asked[10];
    laden_plan_result r;
    laden_plan_input in = base(b, 10);
    in.resident_blocks = 2;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    /* Two resident, eight streamed spread among them: 0 and 5 stay. */
    for (int i = 0; i < 10; i++)
        CHECK((t[i] == 0) == (i == 0 || i == 5));
    CHECK(w[0] == LADEN_PLAN_WHY_ASKED_RESIDENT);
    in.resident_blocks = 8;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "only 5 fit");
    in.resident_blocks = 11;
    in.vram_free_bytes = 1ull << 40;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "10 free blocks");
    in = base(b, 10);
    for (int i = 0; i < 10; i++)
        asked[i] = LADEN_PLAN_FREE;
    asked[0] = 2;
    asked[7] = 0;
    asked[8] = 1;
    in.asked = asked;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(t[0] == 2 && w[0] == LADEN_PLAN_WHY_ASKED_DISK);
    CHECK(t[7] == 0 && w[7] == LADEN_PLAN_WHY_ASKED_RESIDENT);
    CHECK(t[8] == 1 && w[8] == LADEN_PLAN_WHY_ASKED_RAM);
    asked[3] = 7;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
}

TEST(plan_impossible_budget_says_what_would_fit)
{
    uint64_t b[4];
    int32_t t[4], w[4];
    laden_plan_result r;
    laden_plan_input in = base(b, 4);
    in.max_vram_bytes = 300; /* rest 50 + 3 slots 300 > 300 - 100 */
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "at least 450 B"); /* tiny sizes */
    in.max_vram_bytes = 50;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "kept for activations");
    in.max_vram_bytes = 2000; /* above free: free wins, with a warning */
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(r.warnings & LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE);
    CHECK(r.vram_avail_bytes == 900);
    /* min_free_ram auto: 8 % of RAM clamped to 1..4 GiB. */
    in.ram_budget_bytes = 0;
    in.min_free_ram_bytes = UINT64_MAX;
    in.ram_total_bytes = 16ull << 30;
    in.ram_free_bytes = 10ull << 30;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(r.min_free_ram_bytes == (16ull << 30) / 100 * 8);
    in.ram_total_bytes = 4ull << 30;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(r.min_free_ram_bytes == 1ull << 30);
    CHECK(laden_plan_why_text(99) == NULL);
    CHECK(laden_plan_why_text(LADEN_PLAN_WHY_NO_RAM_DISK) != NULL);
}

static uint64_t rnd(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* The fuzz target's invariants (budgets kept, asked tiers kept, resident
 * blocks a prefix, deterministic) over random but plausible models and
 * machines; most of them must plan. */
TEST(plan_invariants_random_models)
{
    uint64_t x = 0x9e3779b97f4a7c15ull, bytes[64];
    int32_t asked[64];
    int planned = 0, runs = 20000;
    for (int k = 0; k < runs; k++) {
        laden_plan_input in;
        memset(&in, 0, sizeof in);
        in.nblocks = 1 + (uint32_t)(rnd(&x) % 64);
        uint64_t unit = 1ull << (20 + rnd(&x) % 10); /* 1 MiB .. 512 MiB */
        for (uint32_t i = 0; i < in.nblocks; i++) {
            bytes[i] = unit * (1 + rnd(&x) % 8);
            asked[i] = rnd(&x) % 8 ? LADEN_PLAN_FREE : (int32_t)(rnd(&x) % 3);
        }
        in.block_bytes = bytes;
        in.asked = rnd(&x) % 2 ? asked : NULL;
        in.rest_bytes = unit * (rnd(&x) % 4);
        in.vram_free_bytes = unit * (8 + rnd(&x) % 256);
        in.max_vram_bytes = rnd(&x) % 2 ? unit * (rnd(&x) % 256) : 0;
        in.reserve_bytes = unit * (rnd(&x) % 4);
        in.ram_total_bytes = unit * 512;
        in.ram_free_bytes = unit * (rnd(&x) % 512);
        in.ram_budget_bytes = rnd(&x) % 2 ? unit * (rnd(&x) % 256) : 0;
        in.min_free_ram_bytes = rnd(&x) % 2 ? UINT64_MAX : unit;
        in.resident_blocks = (int32_t)(rnd(&x) % 12) - 4;
        if (in.resident_blocks < -1)
            in.resident_blocks = -1;
        in.lookahead = (uint32_t)(rnd(&x) % 4);
        in.disk_staging = (uint32_t)(rnd(&x) % 2);
        in.h2d_bytes_per_s = 5e10;
        in.disk_bytes_per_s = 2e9;
        planned += fuzz_plan_check(&in);
    }
    fprintf(stderr, "%d of %d random requests planned\n", planned, runs);
    CHECK(planned > runs / 5);
}

/* And over arbitrary bytes, as the fuzzer feeds them. */
TEST(plan_invariants_random_bytes)
{
    uint8_t buf[512];
    uint64_t x = 88172645463325252ull;
    for (int k = 0; k < 50000; k++) {
        size_t n = (size_t)(x % sizeof buf);
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            buf[i] = (uint8_t)x;
        }
        LLVMFuzzerTestOneInput(buf, n);
    }
}
