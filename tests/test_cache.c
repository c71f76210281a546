#include "test.h"

#include "laden/cache.h"

/* Applies decisions as a caller would: drop the bytes they name. */
static void apply(laden_cache_t *c, const laden_cache_evict_t *ev, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        CHECK_OK(laden_cache_set_vram(c, ev[i].model, ev[i].keep_bytes));
}

static uint64_t vram_of(laden_cache_t *c, uint32_t id)
{
    laden_cache_info_t info;
    CHECK_OK(laden_cache_info(c, id, &info));
    return info.vram_bytes;
}

/* Three models of 4, room for two: used in rotation, the least recently
 * used idle one gives way each time. */
TEST(cache_rotation_is_lru)
{
    laden_cache_t *c;
    uint32_t m[3], n;
    laden_cache_evict_t ev[8];
    CHECK_OK(laden_cache_create(8, 0, &c));
    const char *keys[] = {"text-encoder", "unet", "vae"};
    for (int i = 0; i < 3; i++)
        CHECK_OK(laden_cache_add(c, keys[i], 4, &m[i]));
    for (int round = 0; round < 30; round++) {
        uint32_t id = m[round % 3];
        CHECK_OK(laden_cache_acquire(c, id, 4, ev, 8, &n));
        if (round < 2) {
            CHECK_EQ(n, 0);
        } else {
            /* The one used two activations ago is the LRU. */
            CHECK(n == 1 && ev[0].model == m[(round + 1) % 3]);
            CHECK(ev[0].drop_bytes == 4 && ev[0].keep_bytes == 0);
        }
        apply(c, ev, n);
        CHECK_OK(laden_cache_set_vram(c, id, 4));
        CHECK_OK(laden_cache_release(c, id));
        laden_cache_stats_t st;
        CHECK_OK(laden_cache_stats(c, &st));
        CHECK(st.vram_bytes <= 8);
    }
    /* Re-using a resident model decides nothing. */
    uint32_t last = m[29 % 3];
    CHECK_OK(laden_cache_acquire(c, last, 4, ev, 8, &n));
    CHECK_EQ(n, 0);
    CHECK_OK(laden_cache_release(c, last));
    laden_cache_info_t info;
    CHECK_OK(laden_cache_info(c, last, &info));
    CHECK(info.uses == 11 && !info.in_use && info.size_bytes == 4);
    laden_cache_destroy(c);
}

TEST(cache_partial_eviction_and_in_use)
{
    laden_cache_t *c;
    uint32_t a, b, d, n;
    laden_cache_evict_t ev[4];
    CHECK_OK(laden_cache_create(10, 0, &c));
    CHECK_OK(laden_cache_add(c, "a", 4, &a));
    CHECK_OK(laden_cache_add(c, "b", 4, &b));
    CHECK_OK(laden_cache_add(c, "d", 4, &d));
    CHECK_OK(laden_cache_acquire(c, a, 4, ev, 4, &n));
    CHECK_OK(laden_cache_set_vram(c, a, 4));
    CHECK_OK(laden_cache_release(c, a));
    CHECK_OK(laden_cache_acquire(c, b, 4, ev, 4, &n));
    CHECK_OK(laden_cache_set_vram(c, b, 4));
    /* b stays in use; d needs 4 of which 2 are free: a gives up 2. */
    CHECK_OK(laden_cache_acquire(c, d, 4, ev, 4, &n));
    CHECK(n == 1 && ev[0].model == a && ev[0].drop_bytes == 2 &&
          ev[0].keep_bytes == 2);
    apply(c, ev, n);
    CHECK_OK(laden_cache_set_vram(c, d, 4));
    CHECK_EQ(vram_of(c, a), 2);
    /* Another use of d, bigger: only a is idle (b, d in use)... */
    CHECK_STATUS(laden_cache_acquire(c, d, 4, ev, 4, &n), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "in use");
    CHECK_OK(laden_cache_release(c, d));
    /* ...d now wants 8: a's 2 are not enough while b is in use. */
    CHECK_STATUS(laden_cache_acquire(c, d, 8, ev, 4, &n), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "'d'");
    laden_cache_info_t info;
    CHECK_OK(laden_cache_info(c, d, &info));
    CHECK(!info.in_use && info.uses == 1); /* nothing changed */
    CHECK_STATUS(laden_cache_acquire(c, d, 11, ev, 4, &n), LADEN_E_BUDGET);
    CHECK_CONTAINS(laden_last_error(), "whole budget");
    /* Over the budget by reporting: refused, nothing changed. */
    CHECK_STATUS(laden_cache_set_vram(c, a, 5), LADEN_E_BUDGET);
    CHECK_EQ(vram_of(c, a), 2);
    /* Freeing on demand takes idle models only, LRU first. */
    CHECK_OK(laden_cache_evict_bytes(c, 100, ev, 4, &n));
    CHECK(n == 2 && ev[0].model == a && ev[1].model == d);
    apply(c, ev, n);
    CHECK_EQ(vram_of(c, b), 4);
    /* Removal needs an empty, idle model. */
    CHECK_STATUS(laden_cache_remove(c, b), LADEN_E_STATE);
    CHECK_OK(laden_cache_release(c, b));
    CHECK_OK(laden_cache_set_vram(c, b, 0));
    CHECK_OK(laden_cache_remove(c, b));
    uint32_t x;
    CHECK_STATUS(laden_cache_find(c, "b", &x), LADEN_E_NOTFOUND);
    CHECK_STATUS(laden_cache_release(c, b), LADEN_E_INVAL);
    CHECK_STATUS(laden_cache_add(c, "a", 1, &x), LADEN_E_STATE);
    CHECK_OK(laden_cache_find(c, "d", &x));
    CHECK(x == d && strcmp(laden_cache_key(c, d), "d") == 0);
    laden_cache_destroy(c);
    laden_cache_destroy(NULL);
}

TEST(cache_pinned_budget_and_small_cap)
{
    laden_cache_t *c;
    uint32_t a, b, n;
    laden_cache_evict_t ev[1];
    CHECK_OK(laden_cache_create(0, 6, &c)); /* no VRAM limit */
    CHECK_OK(laden_cache_add(c, "a", 4, &a));
    CHECK_OK(laden_cache_add(c, "b", 4, &b));
    CHECK_OK(laden_cache_plan_pin(c, a, 4, ev, 1, &n));
    CHECK_EQ(n, 0);
    CHECK_OK(laden_cache_set_pinned(c, a, 4));
    CHECK_OK(laden_cache_plan_pin(c, b, 4, ev, 1, &n));
    CHECK(n == 1 && ev[0].model == a && ev[0].drop_bytes == 2);
    CHECK_OK(laden_cache_acquire(c, a, 1000, ev, 1, &n)); /* no limit */
    CHECK_EQ(n, 0);
    CHECK_STATUS(laden_cache_plan_pin(c, b, 4, ev, 1, &n), LADEN_E_BUDGET);
    CHECK_OK(laden_cache_release(c, a));
    laden_cache_destroy(c);
    /* Too little room for the decisions: an error, nothing changed. */
    CHECK_OK(laden_cache_create(4, 0, &c));
    uint32_t m[3];
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof key, "m%d", i);
        CHECK_OK(laden_cache_add(c, key, 2, &m[i]));
    }
    for (int i = 0; i < 2; i++) {
        CHECK_OK(laden_cache_acquire(c, m[i], 2, ev, 1, &n));
        CHECK_OK(laden_cache_set_vram(c, m[i], 2));
        CHECK_OK(laden_cache_release(c, m[i]));
    }
    CHECK_STATUS(laden_cache_acquire(c, m[2], 4, ev, 1, &n), LADEN_E_INVAL);
    laden_cache_info_t info;
    CHECK_OK(laden_cache_info(c, m[2], &info));
    CHECK(!info.in_use);
    laden_cache_destroy(c);
}

/* Random rotations: budgets never exceeded, models in use never touched,
 * evictions among the least recently used idle models. */
TEST(cache_random_invariants)
{
    uint64_t x = 12345;
    for (int run = 0; run < 200; run++) {
        laden_cache_t *c;
        uint64_t budget = 16 + (x = x * 6364136223846793005ull + 1) % 64;
        CHECK_OK(laden_cache_create(budget, 0, &c));
        uint32_t ids[8];
        uint64_t size[8];
        int k = 2 + (int)((x >> 33) % 7);
        for (int i = 0; i < k; i++) {
            char key[16];
            snprintf(key, sizeof key, "m%d", i);
            size[i] = 1 + (x = x * 6364136223846793005ull + 1) % budget;
            CHECK_OK(laden_cache_add(c, key, size[i], &ids[i]));
        }
        bool busy[8] = {0};
        for (int step = 0; step < 100; step++) {
            x = x * 6364136223846793005ull + 1;
            int i = (int)((x >> 33) % (uint64_t)k);
            laden_cache_evict_t ev[8];
            uint32_t n;
            if (busy[i]) {
                CHECK_OK(laden_cache_release(c, ids[i]));
                busy[i] = false;
                continue;
            }
            uint64_t want = size[i] - (x >> 40) % (size[i] / 2 + 1);
            int s = laden_cache_acquire(c, ids[i], want, ev, 8, &n);
            if (s == LADEN_E_BUDGET)
                continue;
            CHECK_OK(s);
            uint64_t newest_evicted = 0;
            bool evicted[8] = {0};
            for (uint32_t e = 0; e < n; e++) {
                laden_cache_info_t info;
                CHECK(!busy[ev[e].model]);
                CHECK_OK(laden_cache_info(c, ev[e].model, &info));
                CHECK(!info.in_use);
                if (e + 1 < n)
                    CHECK_EQ(ev[e].keep_bytes, 0); /* only the last partly */
                if (info.last_use > newest_evicted)
                    newest_evicted = info.last_use;
                evicted[ev[e].model] = true;
            }
            /* LRU: every idle model left untouched was used more recently
             * than every model that gave way. */
            for (int j = 0; n && j < k; j++) {
                laden_cache_info_t info;
                CHECK_OK(laden_cache_info(c, ids[j], &info));
                if (j != i && !busy[j] && !evicted[j] && info.vram_bytes)
                    CHECK(info.last_use > newest_evicted);
            }
            apply(c, ev, n);
            CHECK_OK(laden_cache_set_vram(c, ids[i], want));
            busy[i] = true;
            laden_cache_stats_t st;
            CHECK_OK(laden_cache_stats(c, &st));
            CHECK(st.vram_bytes <= budget);
        }
        laden_cache_destroy(c);
    }
}

/* A new model's device among several: the cache with the most room left
 * (budget less what it holds), the first on a tie. */
TEST(cache_roomiest_device)
{
    laden_cache_t *c[3];
    uint32_t m, n, at = 99;
    laden_cache_evict_t ev[4];
    CHECK_OK(laden_cache_create(10, 0, &c[0]));
    CHECK_OK(laden_cache_create(16, 0, &c[1]));
    CHECK_OK(laden_cache_create(16, 0, &c[2]));
    CHECK_OK(laden_cache_roomiest(c, 3, &at));
    CHECK_EQ(at, 1); /* 16 free twice: the first of them */
    CHECK_OK(laden_cache_add(c[1], "unet", 8, &m));
    CHECK_OK(laden_cache_acquire(c[1], m, 8, ev, 4, &n));
    CHECK_OK(laden_cache_set_vram(c[1], m, 8));
    CHECK_OK(laden_cache_roomiest(c, 3, &at));
    CHECK_EQ(at, 2); /* cuda:1 holds 8 of its 16 */
    CHECK_STATUS(laden_cache_roomiest(c, 0, &at), LADEN_E_INVAL);
    laden_cache_t *none[1] = {NULL};
    CHECK_STATUS(laden_cache_roomiest(none, 1, &at), LADEN_E_INVAL);
    CHECK_OK(laden_cache_release(c[1], m));
    for (int i = 0; i < 3; i++)
        laden_cache_destroy(c[i]);
}

/* Host entries (adapters as read) without a RAM budget: idle ones keep at
 * most LADEN_CACHE_IDLE_HOST_BYTES, least recently used give way first;
 * kept ones never; a touch makes one the most recent.  Entries are the
 * group's: a cache that joins sees them, one holding some cannot join. */
TEST(cache_host_entries_idle_limit_lru)
{
    const uint64_t G = 1ull << 30;
    laden_cache_t *c, *d;
    uint32_t a, b, e, f, drop[8], nd, n, cnt;
    uint64_t bytes;
    CHECK_OK(laden_cache_create(0, 0, &c));
    CHECK_OK(laden_cache_host_add(c, G, &a));
    CHECK_OK(laden_cache_host_add(c, 2 * G, &b));
    CHECK_OK(laden_cache_host_add(c, 2 * G, &e));
    CHECK_OK(laden_cache_host_held(c, &bytes, &cnt));
    CHECK(bytes == 5 * G && cnt == 3);
    const uint64_t NONE = LADEN_CACHE_RAM_UNLIMITED;
    /* e kept: 3 GiB idle fit the 4 GiB. */
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, &e, 1, drop, 8,
                                   &nd, NULL, 0, &n));
    CHECK(nd == 0 && n == 0);
    CHECK_OK(laden_cache_host_add(c, 2 * G, &f));
    /* f kept: a, b, e idle (5 GiB); a, the least recent, goes. */
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, &f, 1, drop, 8,
                                   &nd, NULL, 0, &n));
    CHECK(nd == 1 && drop[0] == a && n == 0);
    /* Used again: b is the least recent now. */
    CHECK_OK(laden_cache_host_touch(c, a));
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, &f, 1, drop, 8,
                                   &nd, NULL, 0, &n));
    CHECK(nd == 1 && drop[0] == b);
    /* A kept entry counted once however often it is named. */
    uint32_t keep[3] = {f, f, a};
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, keep, 3, drop, 8,
                                   &nd, NULL, 0, &n));
    CHECK_EQ(nd, 0);
    /* Everything idle: 7 GiB, LRU first until 4 GiB are left. */
    CHECK_OK(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, NULL, 0, drop, 8,
                                   &nd, NULL, 0, &n));
    CHECK(nd == 2 && drop[0] == b && drop[1] == e);
    /* Room for fewer decisions than needed, an unknown entry: refused. */
    CHECK_STATUS(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, NULL, 0, drop,
                                       1, &nd, NULL, 0, &n),
                 LADEN_E_INVAL);
    CHECK_EQ(nd, 0);
    uint32_t bad = 99;
    CHECK_STATUS(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, &bad, 1, drop,
                                       8, &nd, NULL, 0, &n),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "no host entry 99");
    CHECK_STATUS(laden_cache_plan_host(c, UINT32_MAX, NONE, 0, NULL, 1, drop,
                                       8, &nd, NULL, 0, &n),
                 LADEN_E_INVAL);
    /* Removed: forgotten, its id given to the next entry. */
    CHECK_OK(laden_cache_host_remove(c, b));
    CHECK_STATUS(laden_cache_host_remove(c, b), LADEN_E_INVAL);
    CHECK_STATUS(laden_cache_host_touch(c, b), LADEN_E_INVAL);
    CHECK_OK(laden_cache_host_held(c, &bytes, NULL));
    CHECK_EQ(bytes, 5 * G);
    uint32_t again;
    CHECK_OK(laden_cache_host_add(c, 7, &again));
    CHECK_EQ(again, b);
    CHECK_STATUS(laden_cache_host_add(c, UINT64_MAX, &again), LADEN_E_INVAL);
    /* The group's: a joining cache decides over them; a cache holding
     * entries cannot join another. */
    CHECK_OK(laden_cache_create(0, 0, &d));
    CHECK_STATUS(laden_cache_join(c, d), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "host entries");
    CHECK_OK(laden_cache_join(d, c));
    CHECK_OK(laden_cache_host_held(d, &bytes, &cnt));
    CHECK(bytes == 5 * G + 7 && cnt == 4);
    laden_cache_destroy(c); /* the group, and its entries, stay with d */
    CHECK_OK(laden_cache_host_remove(d, a));
    CHECK_OK(laden_cache_host_held(d, &bytes, &cnt));
    CHECK(bytes == 4 * G + 7 && cnt == 3);
    laden_cache_destroy(d);
    CHECK_STATUS(laden_cache_host_add(NULL, 1, &again), LADEN_E_INVAL);
    CHECK_STATUS(laden_cache_host_held(NULL, &bytes, &cnt), LADEN_E_INVAL);
}
