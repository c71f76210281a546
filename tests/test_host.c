#include "test.h"

#include "laden/dev.h"
#include "laden/host.h"

static void host_suite(int32_t dev)
{
    laden_host_t *h;
    laden_host_stats_t st;
    void *a, *b, *c;
    const uint64_t mb = 1u << 20;
    CHECK_OK(laden_host_create(dev, 8 * mb, &h));
    CHECK_OK(laden_host_alloc(h, 3 * mb, &a));
    CHECK_EQ(((uintptr_t)a & 4095), 0);
    memset(a, 1, 3 * mb);
    CHECK_EQ(laden_host_block_size(h, a), 3 * mb);
    CHECK_OK(laden_host_alloc(h, 3 * mb, &b));
    /* 6 MiB in use, 8 MiB budget: 3 more do not fit. */
    c = (void *)1;
    CHECK_STATUS(laden_host_alloc(h, 3 * mb, &c), LADEN_E_BUDGET);
    CHECK_EQ(c, NULL);
    CHECK_CONTAINS(laden_last_error(), "budget");
    /* A freed block is reused, not pinned again. */
    CHECK_OK(laden_host_free(h, a));
    CHECK_OK(laden_host_alloc(h, 2 * mb, &c));
    CHECK_EQ(c, a);
    CHECK_OK(laden_host_stats(h, &st));
    CHECK(st.reuses == 1 && st.pins == 2 && st.in_use_bytes == 6 * mb);
    /* A cached block too large for the request (more than 2x) is unpinned
     * to make room when the budget needs it. */
    CHECK_OK(laden_host_free(h, c));
    CHECK_OK(laden_host_alloc(h, 1 * mb, &c));
    CHECK(c != a);
    CHECK_OK(laden_host_stats(h, &st));
    CHECK(st.in_use_bytes + st.cached_bytes <= 8 * mb);
    CHECK(st.peak_bytes <= 8 * mb);
    /* Bad frees change nothing. */
    int x;
    CHECK_STATUS(laden_host_free(h, &x), LADEN_E_INVAL);
    CHECK_OK(laden_host_free(h, b));
    CHECK_STATUS(laden_host_free(h, b), LADEN_E_INVAL);
    CHECK_OK(laden_host_stats(h, &st));
    CHECK_EQ(st.in_use_bytes, 1 * mb);
    laden_host_trim(h);
    CHECK_OK(laden_host_stats(h, &st));
    CHECK(st.cached_bytes == 0 && st.in_use_bytes == 1 * mb);
    /* Lowering the budget keeps blocks in use. */
    CHECK_OK(laden_host_set_budget(h, 512u << 10));
    CHECK_OK(laden_host_stats(h, &st));
    CHECK(st.in_use_bytes == 1 * mb && st.budget_bytes == (512u << 10));
    CHECK_STATUS(laden_host_alloc(h, 1, &a), LADEN_E_BUDGET);
    CHECK_STATUS(laden_host_alloc(h, 0, &a), LADEN_E_INVAL);
    CHECK_STATUS(laden_host_alloc(h, UINT64_MAX, &a), LADEN_E_INVAL);
    laden_host_destroy(h); /* frees c too */
    laden_host_destroy(NULL);

    /* No budget: no limit. */
    CHECK_OK(laden_host_create(dev, 0, &h));
    CHECK_OK(laden_host_alloc(h, 64 * mb, &a));
    CHECK_OK(laden_host_free(h, a));
    laden_host_destroy(h);
}

TEST(host_arena)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    host_suite(LADEN_DEVICE_CPU);
    for (int32_t d = 0; d < n; d++)
        host_suite(d);
    laden_host_t *h = (laden_host_t *)1;
    CHECK_STATUS(laden_host_create(77, 0, &h), LADEN_E_NODEVICE);
    CHECK_EQ(h, NULL);
}

TEST(host_measure_memcpy)
{
    double bps = 0;
    CHECK_OK(laden_host_measure_memcpy(16u << 20, &bps));
    CHECK(bps > 1e8);
}
