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
        CHECK_EQ(t[i], (i % 2 ? 1 : 0));
    CHECK(w[0] == LADEN_PLAN_WHY_FITS_VRAM && w[5] == LADEN_PLAN_WHY_NO_VRAM_RAM);
    CHECK(r.vram_avail_bytes == 900 && r.vram_used_bytes == 850);
    CHECK(r.nslots == 3 && r.slot_bytes == 100);
    CHECK(r.ram_bytes == 500 && r.disk_bytes == 0 && r.staging_bytes == 0);
    CHECK(r.predicted_ms > 0.49e-3 && r.predicted_ms < 0.51e-3);
    /* Less RAM: staging is set aside, the rest goes to disk. */
    in.ram_budget_bytes = 450;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(t[1] == 1 && t[3] == 2 && t[9] == 2);
    CHECK_EQ(w[3], LADEN_PLAN_WHY_NO_RAM_DISK);
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
        CHECK_EQ((t[i] == 0), (i == 0 || i == 5));
    CHECK_EQ(w[0], LADEN_PLAN_WHY_ASKED_RESIDENT);
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
    CHECK_EQ(r.vram_avail_bytes, 900);
    /* min_free_ram auto: 8 % of RAM clamped to 1..4 GiB. */
    in.ram_budget_bytes = LADEN_PLAN_AUTO;
    in.min_free_ram_bytes = UINT64_MAX;
    in.ram_total_bytes = 16ull << 30;
    in.ram_free_bytes = 10ull << 30;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.min_free_ram_bytes, (16ull << 30) / 100 * 8);
    in.ram_total_bytes = 4ull << 30;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(r.min_free_ram_bytes == 1ull << 30);
    CHECK_EQ(laden_plan_why_text(99), NULL);
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
        in.max_vram_bytes = rnd(&x) % 2 ? unit * (rnd(&x) % 256) : LADEN_PLAN_AUTO;
        in.reserve_bytes = unit * (rnd(&x) % 4);
        in.ram_total_bytes = unit * 512;
        in.ram_free_bytes = unit * (rnd(&x) % 512);
        in.ram_budget_bytes = rnd(&x) % 2 ? unit * (rnd(&x) % 256) : LADEN_PLAN_AUTO;
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

/* A CPU-device request: 10 blocks of 100 B, rest 50, 900 B of free RAM
 * (none kept) and no RAM budget, 3 slots of 100: 550 left for the RAM
 * tier. */
static laden_plan_input host_base(uint64_t *bytes, uint32_t n)
{
    laden_plan_input in = base(bytes, n);
    in.host_device = 1;
    in.vram_free_bytes = in.reserve_bytes = 0;
    in.disk_staging = 0;
    in.ram_budget_bytes = LADEN_PLAN_AUTO;
    in.ram_free_bytes = 900;
    in.min_free_ram_bytes = 0;
    return in;
}

TEST(plan_no_disk_blocks_get_ram_first)
{
    uint64_t b[10];
    int32_t t[10], w[10];
    uint8_t f[10] = {0};
    laden_plan_result r;
    laden_plan_input in = base(b, 10);
    in.block_flags = f;
    in.ram_budget_bytes = 450; /* 300 of staging: RAM for one block */
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(t[1], LADEN_TIER_RAM); /* no flag set: as without flags */
    CHECK_EQ(t[9], LADEN_TIER_DISK);
    /* Block 9 cannot stream from disk: it takes the RAM before block 1,
     * which can. */
    f[9] = LADEN_PLAN_BLOCK_NO_DISK;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(t[9], LADEN_TIER_RAM);
    CHECK_EQ(w[9], LADEN_PLAN_WHY_NO_VRAM_RAM);
    CHECK_EQ(t[1], LADEN_TIER_DISK);
    CHECK_EQ(r.ram_bytes, 100);
    CHECK_EQ(r.ram_used_bytes, 400);
    CHECK_EQ(r.ram_limit_bytes, 450);
    f[7] = LADEN_PLAN_BLOCK_NO_DISK; /* two of them do not fit */
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "block 9 (100 B) is converted on "
                                       "load, so it cannot stream from disk");
    CHECK_CONTAINS(laden_last_error(), "the 50 B of RAM left");
    CHECK_CONTAINS(laden_last_error(), "checkpoint's own dtypes");
    CHECK_EQ(r.ram_limit_bytes, 0); /* zeroed on failure */
    /* With RAM for everything there is no staging and no disk. */
    in.ram_budget_bytes = 500;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.disk_bytes, 0);
    CHECK_EQ(r.staging_bytes, 0);
}

TEST(plan_no_disk_block_asked_for_disk_is_invalid)
{
    uint64_t b[4];
    int32_t t[4], w[4], asked[4] = {LADEN_PLAN_FREE, LADEN_PLAN_FREE,
                                    LADEN_PLAN_FREE, LADEN_TIER_DISK};
    uint8_t f[4] = {0, 0, 0, LADEN_PLAN_BLOCK_NO_DISK};
    laden_plan_result r;
    laden_plan_input in = base(b, 4);
    in.asked = asked;
    in.block_flags = f;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "block 3 is asked for disk, but it "
                                       "cannot stream from disk");
    asked[3] = LADEN_TIER_RAM;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(t[3], LADEN_TIER_RAM);
    f[2] = 0x80;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "block 2: unknown flags 0x80");
}

/* The spread would stream NO_DISK block 1, which has no RAM: the prefix
 * (blocks 0 and 1 resident) is kept. */
TEST(plan_spread_keeps_no_disk_block_resident)
{
    uint64_t b[4];
    int32_t t[4], w[4];
    uint8_t f[4] = {0};
    laden_plan_result r;
    laden_plan_input in = base(b, 4);
    in.resident_blocks = 2;
    in.disk_staging = 0;
    in.ram_budget_bytes = 1;
    in.block_flags = f;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    int32_t spread[4] = {0, 2, 0, 2};
    for (int i = 0; i < 4; i++)
        CHECK_EQ(t[i], spread[i]);
    f[1] = LADEN_PLAN_BLOCK_NO_DISK;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    int32_t prefix[4] = {0, 0, 2, 2};
    for (int i = 0; i < 4; i++)
        CHECK_EQ(t[i], prefix[i]);
    CHECK_EQ(w[1], LADEN_PLAN_WHY_ASKED_RESIDENT);
}

/* A mixture-of-experts model: layers of 10 bytes, each followed by its
 * experts' block of 200.  The dense layers are all resident before any
 * experts block, which then take what is left in order; without the
 * flag the resident blocks are a prefix (and spread), which keeps two
 * experts blocks and streams layers. */
TEST(plan_experts_blocks_resident_after_dense_ones)
{
    uint64_t b[8];
    int32_t t[8], w[8];
    uint8_t f[8] = {0};
    laden_plan_result r;
    laden_plan_input in = base(b, 8);
    for (int i = 0; i < 8; i++)
        b[i] = i % 2 ? 200 : 10;
    in.rest_bytes = 0;
    in.reserve_bytes = 0;
    in.ram_budget_bytes = 1ull << 30;
    /* 2 slots of 200 + 4 layers + 1 experts block = 640; 2 experts
     * blocks would be 840, the slots still needed. */
    in.lookahead = 1;
    in.vram_free_bytes = 700;
    in.block_flags = f;
    for (int i = 1; i < 8; i += 2)
        f[i] = LADEN_PLAN_BLOCK_EXPERTS;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    int32_t want[8] = {0, 0, 0, 1, 0, 1, 0, 1};
    for (int i = 0; i < 8; i++)
        CHECK_EQ(t[i], want[i]);
    CHECK_EQ(w[6], LADEN_PLAN_WHY_FITS_VRAM);
    CHECK_EQ(r.gpu_bytes, 240);
    CHECK_EQ(r.vram_used_bytes, 640);
    /* Less room: every layer before any experts block. */
    in.vram_free_bytes = 500;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    for (int i = 0; i < 8; i++)
        CHECK_EQ(t[i], i % 2 ? 1 : 0);
    /* Without the flag: a prefix, spread, which streams layers. */
    memset(f, 0, sizeof f);
    in.vram_free_bytes = 700;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    uint32_t layers = 0;
    for (int i = 0; i < 8; i += 2)
        layers += t[i] == 0;
    CHECK(layers < 4);
    /* Exactly n resident blocks asked: as without the flag. */
    in.resident_blocks = 2;
    in.vram_free_bytes = 1ull << 20;
    int32_t t2[8], w2[8];
    CHECK_OK(laden_plan_compute(&in, t2, w2, &r));
    for (int i = 1; i < 8; i += 2)
        f[i] = LADEN_PLAN_BLOCK_EXPERTS;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(memcmp(t, t2, sizeof t) == 0);
    f[0] = 4; /* an unknown flag */
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
}

TEST(plan_host_device_fills_ram_then_disk)
{
    uint64_t b[10];
    int32_t t[10], w[10];
    uint8_t f[10] = {0};
    laden_plan_result r;
    laden_plan_input in = host_base(b, 10);
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    for (int i = 0; i < 10; i++)
        CHECK_EQ(t[i], i < 5 ? LADEN_TIER_RAM : LADEN_TIER_DISK);
    CHECK_EQ(w[0], LADEN_PLAN_WHY_FITS_HOST_RAM);
    CHECK(strcmp(laden_plan_why_text(w[0]),
                 "RAM: fits the host memory budget") == 0);
    CHECK_EQ(w[5], LADEN_PLAN_WHY_NO_RAM_DISK);
    CHECK_EQ(r.vram_avail_bytes, 0);
    CHECK_EQ(r.vram_used_bytes, 0);
    CHECK_EQ(r.gpu_bytes, 50);
    CHECK_EQ(r.nslots, 3);
    CHECK_EQ(r.slot_bytes, 100);
    CHECK_EQ(r.ram_limit_bytes, 900);
    CHECK_EQ(r.ram_avail_bytes, 550); /* 900 - rest 50 - slots 300 */
    CHECK_EQ(r.ram_bytes, 500);
    CHECK_EQ(r.disk_bytes, 500);
    CHECK_EQ(r.staging_bytes, 0);
    CHECK_EQ(r.warnings, LADEN_PLAN_WARN_DISK); /* no reserve warning */
    /* Only the disk reads take time (500 B at 1e8 B/s); h2d is ignored. */
    CHECK(r.predicted_ms > 4.9e-3 && r.predicted_ms < 5.1e-3);
    in.h2d_bytes_per_s = 1;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK(r.predicted_ms > 4.9e-3 && r.predicted_ms < 5.1e-3);
    in.disk_bytes_per_s = 0;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_FEQ(r.predicted_ms, 0);
    /* Resident blocks cost host memory like RAM blocks. */
    in.resident_blocks = 2;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(t[0], LADEN_TIER_GPU);
    CHECK_EQ(w[1], LADEN_PLAN_WHY_ASKED_RESIDENT);
    CHECK_EQ(t[2], LADEN_TIER_RAM);
    CHECK_EQ(t[4], LADEN_TIER_RAM);
    CHECK_EQ(t[5], LADEN_TIER_DISK);
    CHECK_EQ(r.gpu_bytes, 250);
    CHECK_EQ(r.ram_avail_bytes, 350);
    /* A NO_DISK block takes RAM before earlier blocks that can stream. */
    in.resident_blocks = -1;
    in.block_flags = f;
    f[9] = LADEN_PLAN_BLOCK_NO_DISK;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(t[9], LADEN_TIER_RAM);
    CHECK_EQ(t[4], LADEN_TIER_DISK);
    CHECK_EQ(t[3], LADEN_TIER_RAM);
}

TEST(plan_host_device_budget_errors)
{
    uint64_t b[10];
    int32_t t[10], w[10], asked[10];
    uint8_t f[10];
    laden_plan_result r;
    laden_plan_input in = host_base(b, 10);
    in.ram_free_bytes = 300;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "free RAM 300 B (keeping 0 B free) "
                                       "cannot hold the resident part (the "
                                       "rest of the model and the blocks "
                                       "asked resident: 50 B) and 3 slots "
                                       "(300 B)");
    /* A RAM budget bounds the RAM tier alone: the rest and the slots
     * still need the free RAM. */
    in.ram_budget_bytes = 1000;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    in.ram_budget_bytes = LADEN_PLAN_AUTO;
    for (int i = 0; i < 10; i++)
        asked[i] = LADEN_PLAN_FREE;
    asked[0] = LADEN_TIER_GPU;
    in.asked = asked;
    in.ram_free_bytes = 400;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "asked resident: 150 B) and 3 slots "
                                       "(300 B)");
    /* A large block asked resident (how a schedule passes the rest of
     * the model) never streams: it does not size the slots. */
    b[0] = 1000;
    in.ram_free_bytes = 1050 + 300 + 900;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.slot_bytes, 100);
    CHECK_EQ(r.nslots, 3);
    CHECK_EQ(r.ram_avail_bytes, 900);
    b[0] = 100;
    in.asked = NULL;
    in.ram_free_bytes = 900;
    in.resident_blocks = 7; /* 550 left: 5 fit */
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "7 resident blocks asked, but only 5 "
                                       "fit");
    in.resident_blocks = -1;
    memset(f, LADEN_PLAN_BLOCK_NO_DISK, sizeof f);
    in.block_flags = f;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "block 5 (100 B) is converted on load");
    CHECK_CONTAINS(laden_last_error(), "the 50 B of RAM left");
    /* No RAM budget: free RAM minus the minimum kept free (auto: 4 GiB of
     * 64 GiB), here nothing. */
    in.block_flags = NULL;
    in.ram_budget_bytes = LADEN_PLAN_AUTO;
    in.min_free_ram_bytes = UINT64_MAX;
    in.ram_free_bytes = 3ull << 30;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "free RAM 0 B (keeping 4.29 GB free)");
    in.ram_free_bytes = (4ull << 30) + 900;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.ram_limit_bytes, 900);
    CHECK_EQ(r.min_free_ram_bytes, 4ull << 30);
}

TEST(plan_host_device_refuses_cuda_fields)
{
    uint64_t b[4];
    int32_t t[4], w[4];
    laden_plan_result r;
    laden_plan_input in = host_base(b, 4);
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    in.vram_free_bytes = 1;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "the CPU device has no VRAM: "
                                       "vram_free applies to CUDA devices");
    in = host_base(b, 4);
    in.max_vram_bytes = 1;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "the CPU device has no VRAM: "
                                       "max_vram applies to CUDA devices");
    in = host_base(b, 4);
    in.reserve_bytes = 1;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "reserve applies to CUDA devices");
    in = host_base(b, 4);
    in.disk_staging = 1;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "disk_staging must be 0");
    in = host_base(b, 4);
    in.host_device = 2;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "host_device 2");
}

TEST(plan_ram_limit_and_lookahead)
{
    uint64_t b[10];
    int32_t t[10], w[10];
    laden_plan_result r;
    laden_plan_input in = base(b, 10);
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.ram_limit_bytes, 600); /* the RAM budget */
    in.ram_budget_bytes = LADEN_PLAN_AUTO;
    in.ram_total_bytes = 16ull << 30;
    in.ram_free_bytes = 10ull << 30;
    in.min_free_ram_bytes = UINT64_MAX;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.ram_limit_bytes, (10ull << 30) - (16ull << 30) / 100 * 8);
    CHECK_EQ(r.ram_avail_bytes, r.ram_limit_bytes);
    in = base(b, 10);
    in.lookahead = 0; /* LADEN_LOOKAHEAD_DEFAULT */
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.nslots, LADEN_LOOKAHEAD_DEFAULT + 1);
    in.vram_free_bytes = 1ull << 40;
    in.resident_blocks = 0;
    in.ram_budget_bytes = 1000; /* all ten in RAM */
    in.lookahead = LADEN_LOOKAHEAD_MAX;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.nslots, 10); /* never more slots than blocks */
    in.lookahead = LADEN_LOOKAHEAD_MAX + 1;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "lookahead 64 is above the maximum, "
                                       "63");
}

/* Plans `in` (valid by construction) and checks the plan's invariants;
 * returns the status. */
static int check_properties(const laden_plan_input *in, int32_t *t)
{
    int32_t w[64], t2[64], w2[64];
    laden_plan_result r, r2;
    int s = laden_plan_compute(in, t, w, &r);
    CHECK_EQ(laden_plan_compute(in, t2, w2, &r2), s);
    if (s != LADEN_OK) {
        CHECK_EQ(s, LADEN_E_BUDGET);
        return s;
    }
    CHECK_EQ(memcmp(t, t2, in->nblocks * sizeof *t), 0);
    CHECK_EQ(memcmp(w, w2, in->nblocks * sizeof *w), 0);
    CHECK_EQ(memcmp(&r, &r2, sizeof r), 0);
    uint64_t gpu = in->rest_bytes, ram = 0;
    for (uint32_t i = 0; i < in->nblocks; i++) {
        if (in->block_flags && in->block_flags[i])
            CHECK(t[i] != LADEN_TIER_DISK);
        if (in->asked && in->asked[i] != LADEN_PLAN_FREE)
            CHECK_EQ(t[i], in->asked[i]);
        gpu += t[i] == LADEN_TIER_GPU ? in->block_bytes[i] : 0;
        ram += t[i] == LADEN_TIER_RAM ? in->block_bytes[i] : 0;
    }
    CHECK_EQ(r.gpu_bytes, gpu);
    CHECK_EQ(r.ram_bytes, ram);
    CHECK(r.ram_bytes + r.staging_bytes <= r.ram_limit_bytes);
    if (in->host_device) {
        uint64_t dev = gpu + (uint64_t)r.nslots * r.slot_bytes;
        CHECK(dev <= in->ram_free_bytes - r.min_free_ram_bytes);
        if (in->ram_budget_bytes == LADEN_PLAN_AUTO)
            CHECK(dev + ram <= r.ram_limit_bytes);
        CHECK_EQ(r.vram_used_bytes, 0);
    } else {
        CHECK(r.vram_used_bytes <= r.vram_avail_bytes);
    }
    return s;
}

/* Random CUDA-like and CPU-device requests with NO_DISK blocks: every plan
 * keeps the invariants, and the flags never fail a request whose plan
 * without them kept the flagged blocks off disk anyway. */
TEST(plan_properties_flags_and_host_device)
{
    uint64_t x = 0x2545f4914f6cdd1dull, bytes[64];
    int32_t asked[64], t[64], t0[64];
    uint8_t flags[64];
    int planned[2] = {0, 0}, no_disk_ram = 0, runs = 4000;
    for (int k = 0; k < runs; k++) {
        laden_plan_input in;
        memset(&in, 0, sizeof in);
        in.nblocks = 1 + (uint32_t)(rnd(&x) % 64);
        uint64_t unit = 1ull << (20 + rnd(&x) % 10);
        for (uint32_t i = 0; i < in.nblocks; i++) {
            bytes[i] = unit * (1 + rnd(&x) % 8);
            flags[i] = rnd(&x) % 4 ? 0 : LADEN_PLAN_BLOCK_NO_DISK;
            asked[i] = rnd(&x) % 8 ? LADEN_PLAN_FREE : (int32_t)(rnd(&x) % 3);
            if (flags[i] && asked[i] == LADEN_TIER_DISK)
                asked[i] = LADEN_PLAN_FREE;
        }
        in.block_bytes = bytes;
        in.asked = rnd(&x) % 2 ? asked : NULL;
        in.host_device = (uint32_t)(rnd(&x) % 2);
        in.rest_bytes = unit * (rnd(&x) % 4);
        if (!in.host_device) {
            in.vram_free_bytes = unit * (8 + rnd(&x) % 256);
            in.max_vram_bytes = rnd(&x) % 2 ? unit * (rnd(&x) % 256) : LADEN_PLAN_AUTO;
            in.reserve_bytes = unit * (rnd(&x) % 4);
            in.disk_staging = (uint32_t)(rnd(&x) % 2);
        }
        in.ram_total_bytes = unit * 512;
        in.ram_free_bytes = unit * (rnd(&x) % 512);
        in.ram_budget_bytes = rnd(&x) % 2 ? unit * (rnd(&x) % 512) : LADEN_PLAN_AUTO;
        in.min_free_ram_bytes = rnd(&x) % 2 ? UINT64_MAX : unit;
        in.resident_blocks = (int32_t)(rnd(&x) % 12) - 4;
        if (in.resident_blocks < -1)
            in.resident_blocks = -1;
        in.lookahead = (uint32_t)(rnd(&x) % 6);
        in.h2d_bytes_per_s = 5e10;
        in.disk_bytes_per_s = 2e9;
        int s0 = check_properties(&in, t0); /* without flags */
        in.block_flags = flags;
        int s = check_properties(&in, t);
        bool kept_off_disk = s0 == LADEN_OK;
        for (uint32_t i = 0; kept_off_disk && i < in.nblocks; i++)
            kept_off_disk = !flags[i] || t0[i] != LADEN_TIER_DISK;
        if (kept_off_disk)
            CHECK_EQ(s, LADEN_OK);
        if (s == LADEN_OK) {
            planned[in.host_device]++;
            for (uint32_t i = 0; i < in.nblocks; i++)
                no_disk_ram += flags[i] && t[i] == LADEN_TIER_RAM &&
                               s0 == LADEN_OK && t0[i] == LADEN_TIER_DISK;
        }
    }
    fprintf(stderr, "%d CUDA-like and %d host plans of %d; %d NO_DISK "
            "blocks moved from disk to RAM\n", planned[0], planned[1], runs,
            no_disk_ram);
    CHECK(planned[0] > runs / 10 && planned[1] > runs / 10);
    CHECK(no_disk_ram > 0);
}

/* Blocks whose slots hold fewer bytes than their resident copies (a
 * cache's lossless blocks: coded in the slots, decoded on the device):
 * the slots are counted at those bytes, so the room they free holds
 * another resident block; without them, as before. */
TEST(plan_slots_counted_at_their_own_bytes)
{
    uint64_t bytes[10], slot[10];
    for (int i = 0; i < 10; i++) {
        bytes[i] = 100;
        slot[i] = 60;
    }
    int32_t tiers[10], why[10];
    laden_plan_result r;
    laden_plan_input in = base(bytes, 10);
    CHECK_OK(laden_plan_compute(&in, tiers, why, &r));
    uint32_t plain = 0;
    for (int i = 0; i < 10; i++)
        plain += tiers[i] == LADEN_TIER_GPU;
    CHECK_EQ(plain, 5); /* 50 + 5 x 100 + 3 slots x 100 = 850 of 900 */
    CHECK_EQ(r.slot_bytes, 100);
    in.slot_block_bytes = slot;
    CHECK_OK(laden_plan_compute(&in, tiers, why, &r));
    uint32_t coded = 0;
    for (int i = 0; i < 10; i++)
        coded += tiers[i] == LADEN_TIER_GPU;
    CHECK_EQ(coded, 6); /* 50 + 6 x 100 + 3 x 60 = 830 */
    CHECK_EQ(r.slot_bytes, 60);
    CHECK_EQ(r.vram_used_bytes, 830);
    CHECK(r.vram_used_bytes <= r.vram_avail_bytes);
}
