/* The rules for what the planner plans from (src/plan/budget.c) and the
 * cache's default VRAM budget, with injected readings: none of these
 * tests depends on how much memory this machine has free. */
#include <string.h>

#include "test.h"

#include "laden/cache.h"
#include "laden/dev.h"
#include "laden/plan.h"

#include "../src/cache/cache_internal.h"

#define STEP LADEN_PLAN_READING_STEP
#define GIB (1ull << 30)

TEST(budget_readings_round_down_to_the_step)
{
    laden_plan_readings r;
    laden_plan_readings_from(3 * STEP + 5, 80 * GIB, 7 * STEP - 1,
                             64 * GIB, &r);
    CHECK_EQ(r.vram_free_bytes, 3 * STEP);
    CHECK_EQ(r.vram_total_bytes, 80 * GIB);
    CHECK_EQ(r.ram_free_bytes, 6 * STEP);
    CHECK_EQ(r.ram_free_exact_bytes, 7 * STEP - 1);
    CHECK_EQ(r.ram_total_bytes, 64 * GIB);
    /* Two runs a little apart read the same. */
    laden_plan_readings q;
    laden_plan_readings_from(3 * STEP + STEP - 1, 80 * GIB, 6 * STEP,
                             64 * GIB, &q);
    CHECK_EQ(q.vram_free_bytes, r.vram_free_bytes);
    CHECK_EQ(q.ram_free_bytes, r.ram_free_bytes);
    laden_plan_readings_from(STEP - 1, 0, 0, 0, &q);
    CHECK_EQ(q.vram_free_bytes, 0);
    laden_plan_readings_from(UINT64_MAX, 0, UINT64_MAX, 0, &q);
    CHECK_EQ(q.ram_free_bytes, UINT64_MAX / STEP * STEP);
    laden_plan_readings_from(1, 2, 3, 4, NULL); /* no crash */
}

TEST(budget_read_on_the_cpu_has_no_vram)
{
    laden_plan_readings r;
    CHECK_OK(laden_plan_read(LADEN_DEVICE_CPU, &r));
    CHECK_EQ(r.vram_free_bytes, 0);
    CHECK_EQ(r.vram_total_bytes, 0);
    CHECK(r.ram_total_bytes > 0);
    CHECK_EQ(r.ram_free_bytes % STEP, 0);
    CHECK(r.ram_free_bytes <= r.ram_free_exact_bytes);
    CHECK(r.ram_free_exact_bytes - r.ram_free_bytes < STEP);
    CHECK_STATUS(laden_plan_read(LADEN_DEVICE_CPU, NULL), LADEN_E_INVAL);
}

static laden_plan_input one_block(uint64_t *bytes, uint64_t reserve,
                                  uint32_t host)
{
    laden_plan_input in;
    memset(&in, 0, sizeof in);
    bytes[0] = 100;
    in.nblocks = 1;
    in.block_bytes = bytes;
    in.rest_bytes = 10;
    in.vram_free_bytes = host ? 0 : 4 * GIB;
    in.reserve_bytes = reserve;
    in.ram_total_bytes = 64 * GIB;
    in.ram_free_bytes = 32 * GIB;
    in.ram_budget_bytes = LADEN_PLAN_AUTO;
    in.min_free_ram_bytes = LADEN_PLAN_AUTO;
    in.resident_blocks = -1;
    in.host_device = host;
    return in;
}

TEST(budget_default_headroom_is_decided_by_the_planner)
{
    uint64_t b[1];
    int32_t t[1], w[1];
    laden_plan_result r;
    /* CUDA: AUTO keeps the default headroom, and says so. */
    laden_plan_input in = one_block(b, LADEN_PLAN_AUTO, 0);
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.reserve_bytes, LADEN_PLAN_HEADROOM_DEFAULT);
    CHECK_EQ(r.vram_avail_bytes, 4 * GIB - LADEN_PLAN_HEADROOM_DEFAULT);
    CHECK_EQ(r.warnings & LADEN_PLAN_WARN_NO_RESERVE, 0);
    CHECK_EQ(in.reserve_bytes, LADEN_PLAN_AUTO); /* the input is not
                                                    changed */
    /* An explicit 0 keeps nothing, and warns. */
    in.reserve_bytes = 0;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.reserve_bytes, 0);
    CHECK_EQ(r.vram_avail_bytes, 4 * GIB);
    CHECK(r.warnings & LADEN_PLAN_WARN_NO_RESERVE);
    in.reserve_bytes = 12345;
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.reserve_bytes, 12345);
    /* The default alone can be more than the free VRAM. */
    in.reserve_bytes = LADEN_PLAN_AUTO;
    in.vram_free_bytes = LADEN_PLAN_HEADROOM_DEFAULT - 1;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_BUDGET);
    CHECK(strstr(laden_last_error(), "1.50 GB kept for activations"));
    /* The host device: AUTO is no VRAM kept, not an error. */
    in = one_block(b, LADEN_PLAN_AUTO, 1);
    CHECK_OK(laden_plan_compute(&in, t, w, &r));
    CHECK_EQ(r.reserve_bytes, 0);
    in.reserve_bytes = 1;
    CHECK_STATUS(laden_plan_compute(&in, t, w, &r), LADEN_E_INVAL);
}

static laden_plan_load_options load_opts(int32_t device)
{
    laden_plan_load_options o;
    memset(&o, 0, sizeof o);
    o.device = device;
    o.lookahead = 2;
    o.vram_budget_bytes = LADEN_PLAN_AUTO;
    o.ram_budget_bytes = LADEN_PLAN_AUTO;
    return o;
}

TEST(budget_load_input_is_stream_loads_policy)
{
    laden_plan_readings r;
    laden_plan_readings_from(10 * GIB + 7, 80 * GIB, 20 * GIB + 3,
                             64 * GIB, &r);
    laden_plan_input in;
    /* No budget: the free VRAM read, nothing reserved, every block that
     * is not asked resident streams; the RAM tier from the free RAM. */
    laden_plan_load_options o = load_opts(0);
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.vram_free_bytes, 10 * GIB);
    CHECK_EQ(in.reserve_bytes, 0);
    CHECK_EQ(in.max_vram_bytes, 0);
    CHECK_EQ(in.resident_blocks, 0);
    CHECK_EQ(in.ram_budget_bytes, LADEN_PLAN_AUTO);
    CHECK_EQ(in.min_free_ram_bytes, LADEN_PLAN_AUTO);
    CHECK_EQ(in.ram_free_bytes, 20 * GIB);
    CHECK_EQ(in.ram_total_bytes, 64 * GIB);
    CHECK_EQ(in.lookahead, 2);
    CHECK_EQ(in.disk_staging, 0);
    CHECK_EQ(in.host_device, 0);
    CHECK(in.h2d_bytes_per_s == 0.0 && in.disk_bytes_per_s == 0.0);
    CHECK_EQ(in.nblocks, 0);
    CHECK(in.block_bytes == NULL);
    /* A VRAM budget stands for the reading; blocks stay resident while
     * they fit it.  So does a VRAM context's budget (the schedule caps). */
    o.vram_budget_bytes = 3 * GIB + 1;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.vram_free_bytes, 3 * GIB + 1);
    CHECK_EQ(in.resident_blocks, -1);
    o = load_opts(0);
    o.vram_context_budget = 1;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.vram_free_bytes, 10 * GIB);
    CHECK_EQ(in.resident_blocks, -1);
    /* A RAM budget is passed through, 0 included. */
    o = load_opts(0);
    o.ram_budget_bytes = 0;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.ram_budget_bytes, 0);
    /* The CPU: no VRAM field, and a VRAM budget is refused by name. */
    o = load_opts(LADEN_DEVICE_CPU);
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.vram_free_bytes, 0);
    CHECK_EQ(in.host_device, 1);
    CHECK_EQ(in.resident_blocks, 0);
    o.vram_budget_bytes = 1000000000;
    CHECK_STATUS(laden_plan_load_input(&o, &r, &in), LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "vram_budget 1.00 GB: the model goes "
                 "to the CPU, which has no VRAM; ram_budget bounds"));
    CHECK_EQ(in.host_device, 0); /* zeroed on failure */
    CHECK_STATUS(laden_plan_load_input(NULL, &r, &in), LADEN_E_INVAL);
    CHECK_STATUS(laden_plan_load_input(&o, &r, NULL), LADEN_E_INVAL);
    /* Readings NULL: taken now. */
    o = load_opts(LADEN_DEVICE_CPU);
    CHECK_OK(laden_plan_load_input(&o, NULL, &in));
    CHECK(in.ram_total_bytes > 0);
    CHECK_EQ(in.ram_free_bytes % STEP, 0);
}

TEST(budget_shared_segments_count_as_free_ram)
{
    laden_plan_readings r;
    laden_plan_readings_from(0, 0, 20 * GIB + STEP - 1, 64 * GIB, &r);
    laden_plan_input in;
    laden_plan_load_options o = load_opts(LADEN_DEVICE_CPU);
    /* The credit is added to the exact reading, then rounded: 1 byte of
     * segment lifts it over the next step here. */
    o.shared_bytes = 1;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.ram_free_bytes, 20 * GIB + STEP);
    o.shared_bytes = 5 * GIB;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.ram_free_bytes, 25 * GIB);
    /* Never above the total, even where the sum overflows. */
    o.shared_bytes = 60 * GIB;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.ram_free_bytes, 64 * GIB);
    o.shared_bytes = UINT64_MAX;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.ram_free_bytes, 64 * GIB);
    /* With a RAM budget every process plans the same anyway: no credit. */
    o.shared_bytes = 5 * GIB;
    o.ram_budget_bytes = 8 * GIB;
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.ram_free_bytes, 20 * GIB);
    /* No segment yet: the reading as rounded. */
    o = load_opts(LADEN_DEVICE_CPU);
    CHECK_OK(laden_plan_load_input(&o, &r, &in));
    CHECK_EQ(in.ram_free_bytes, 20 * GIB);
}

TEST(budget_probes_on_the_cpu)
{
    double rate = -1.0;
    /* The CPU copies nothing host to device: no rate, no error. */
    CHECK_OK(laden_plan_probe_h2d(LADEN_DEVICE_CPU, &rate));
    CHECK(rate == 0.0);
    CHECK_STATUS(laden_plan_probe_h2d(LADEN_DEVICE_CPU, NULL), LADEN_E_INVAL);
    /* A file that cannot be measured costs the prediction only. */
    rate = -1.0;
    CHECK_OK(laden_plan_probe_disk("/nonexistent/laden/probe", &rate));
    CHECK(rate == 0.0);
    CHECK_STATUS(laden_plan_probe_disk(NULL, &rate), LADEN_E_INVAL);
    /* A file measured once per process: the second call returns the
     * first measurement (two timings of a read would differ). */
    char *p = test_path("probe.bin");
    static char data[4 << 20];
    memset(data, 7, sizeof data);
    test_write_file(p, data, sizeof data);
    double a = -1.0, b = -2.0;
    CHECK_OK(laden_plan_probe_disk(p, &a));
    CHECK_OK(laden_plan_probe_disk(p, &b));
    if (a > 0.0) /* 0: the drive cannot be measured there (tmpfs) */
        CHECK(a == b);
    else
        CHECK(b == 0.0);
    /* A directory is not measured. */
    CHECK_OK(laden_plan_probe_disk(test_path(""), &rate));
    CHECK(rate == 0.0);
}

TEST(budget_cache_default_vram_budget)
{
    const uint64_t h = LADEN_CACHE_HEADROOM_DEFAULT;
    CHECK_EQ(h, 1536ull << 20);
    CHECK_EQ(laden__cache_budget_from_free(80 * GIB), 80 * GIB - h);
    CHECK_EQ(laden__cache_budget_from_free(h + 2), 2);
    /* Never 0, which would mean no limit. */
    CHECK_EQ(laden__cache_budget_from_free(h + 1), 1);
    CHECK_EQ(laden__cache_budget_from_free(h), 1);
    CHECK_EQ(laden__cache_budget_from_free(0), 1);
    uint64_t b = 7;
    /* The CPU: no limit; a VRAM context's budget wins on any device. */
    CHECK_OK(laden_cache_default_budget(LADEN_DEVICE_CPU, 0, &b));
    CHECK_EQ(b, 0);
    CHECK_OK(laden_cache_default_budget(LADEN_DEVICE_CPU, 5 * GIB, &b));
    CHECK_EQ(b, 5 * GIB);
    CHECK_OK(laden_cache_default_budget(3, 5 * GIB, &b));
    CHECK_EQ(b, 5 * GIB);
    CHECK_STATUS(laden_cache_default_budget(LADEN_DEVICE_CPU, 0, NULL),
                 LADEN_E_INVAL);
}
