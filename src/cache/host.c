/* The host policy's entries: host copies held for the models beside their
 * own (adapters as read), decided with the models' host copies by one
 * policy.  See include/laden/cache.h.  Few entries (tens), decided once
 * per use: plain arrays and a sort per decision. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "cache_internal.h"

static laden_status entry(laden_cache_t *c, uint32_t id, host_entry **out,
                          const char *call)
{
    *out = NULL;
    if (!c)
        return laden__fail(LADEN_E_INVAL, "%s: NULL cache", call);
    if (id >= c->g->ne || !c->g->e[id].live)
        return laden__fail(LADEN_E_INVAL, "%s: no host entry %u", call, id);
    *out = &c->g->e[id];
    return LADEN_OK;
}

laden_status laden_cache_host_add(laden_cache_t *c, uint64_t bytes,
                                  uint32_t *out)
{
    if (out)
        *out = 0;
    if (!c || !out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_host_add: NULL");
    cache_group *g = c->g;
    uint64_t total;
    if (!laden__add_u64(g->ebytes, bytes, &total))
        return laden__fail(LADEN_E_INVAL,
                           "laden_cache_host_add: %llu bytes overflow the "
                           "entries' total",
                           (unsigned long long)bytes);
    uint32_t id = 0;
    while (id < g->ne && g->e[id].live)
        id++;
    if (id == g->ne) {
        if (g->ne == UINT32_MAX)
            return laden__fail(LADEN_E_INVAL, "laden_cache_host_add: too "
                               "many host entries");
        if (g->ne == g->ecap) {
            uint32_t cap = g->ecap ? g->ecap * 2 : 8;
            if (cap < g->ecap) /* doubled past 2^32 */
                cap = UINT32_MAX;
            host_entry *e = realloc(g->e, (size_t)cap * sizeof *e);
            if (!e)
                return laden__fail(LADEN_E_NOMEM,
                                   "out of memory adding a host entry");
            g->e = e;
            g->ecap = cap;
        }
        g->ne++;
    }
    g->e[id] = (host_entry){bytes, ++g->clock, true};
    g->nlive++;
    g->ebytes = total;
    *out = id;
    return LADEN_OK;
}

laden_status laden_cache_host_touch(laden_cache_t *c, uint32_t id)
{
    host_entry *e;
    laden_status s = entry(c, id, &e, "laden_cache_host_touch");
    if (!s)
        e->last_use = ++c->g->clock;
    return s;
}

laden_status laden_cache_host_remove(laden_cache_t *c, uint32_t id)
{
    host_entry *e;
    laden_status s = entry(c, id, &e, "laden_cache_host_remove");
    if (s)
        return s;
    c->g->ebytes -= e->bytes;
    c->g->nlive--;
    memset(e, 0, sizeof *e);
    return LADEN_OK;
}

laden_status laden_cache_host_held(laden_cache_t *c, uint64_t *out_bytes,
                                   uint32_t *out_entries)
{
    if (out_bytes)
        *out_bytes = 0;
    if (out_entries)
        *out_entries = 0;
    if (!c)
        return laden__fail(LADEN_E_INVAL, "laden_cache_host_held: NULL cache");
    if (out_bytes)
        *out_bytes = c->g->ebytes;
    if (out_entries)
        *out_entries = c->g->nlive;
    return LADEN_OK;
}

static int cmp_last_use(const void *a, const void *b)
{
    const host_entry *const *x = a, *const *y = b;
    return (*x)->last_use < (*y)->last_use ? -1
                                           : (*x)->last_use > (*y)->last_use;
}

static uint64_t sat_add(uint64_t a, uint64_t b)
{
    uint64_t r;
    return laden__add_u64(a, b, &r) ? r : UINT64_MAX;
}

/* The idle entries (not marked kept) that give way, least recently used
 * first, until those left hold at most `limit`. */
static laden_status plan_entries(cache_group *g, const bool *kept,
                                 uint64_t idle, uint64_t limit,
                                 uint32_t *drop, uint32_t cap, uint32_t *out_n,
                                 uint64_t *out_freed)
{
    *out_n = 0;
    *out_freed = 0;
    if (idle <= limit)
        return LADEN_OK;
    host_entry **cs = malloc((g->ne ? g->ne : 1) * sizeof *cs);
    if (!cs)
        return laden__fail(LADEN_E_NOMEM, "out of memory deciding what host "
                           "memory keeps");
    uint32_t k = 0, n = 0;
    for (uint32_t i = 0; i < g->ne; i++)
        if (g->e[i].live && !kept[i])
            cs[k++] = &g->e[i];
    qsort(cs, k, sizeof *cs, cmp_last_use); /* the clock has no ties */
    uint64_t freed = 0;
    for (uint32_t j = 0; j < k && idle - freed > limit; j++) {
        if (n == cap) {
            free(cs);
            return laden__fail(LADEN_E_INVAL,
                               "more than %u host entries give way; give "
                               "room for as many as there are",
                               cap);
        }
        drop[n++] = (uint32_t)(cs[j] - g->e);
        freed += cs[j]->bytes;
    }
    free(cs);
    *out_n = n;
    *out_freed = freed;
    return LADEN_OK;
}

laden_status laden_cache_plan_host(laden_cache_t *c, uint32_t except,
                                   uint64_t budget, uint64_t need,
                                   const uint32_t *keep, uint32_t nkeep,
                                   uint32_t *drop, uint32_t drop_cap,
                                   uint32_t *out_ndrop,
                                   laden_cache_host_evict_t *ev, uint32_t cap,
                                   uint32_t *out_n)
{
    if (out_ndrop)
        *out_ndrop = 0;
    if (out_n)
        *out_n = 0;
    if (!c || !out_ndrop || !out_n || (nkeep && !keep) ||
        (drop_cap && !drop) || (cap && !ev))
        return laden__fail(LADEN_E_INVAL, "laden_cache_plan_host: NULL");
    cache_group *g = c->g;
    bool *kept = calloc(g->ne ? g->ne : 1, sizeof *kept);
    if (!kept)
        return laden__fail(LADEN_E_NOMEM, "out of memory deciding what host "
                           "memory keeps");
    /* An entry may be kept by several models: counted once. */
    uint64_t held = 0;
    for (uint32_t i = 0; i < nkeep; i++) {
        if (keep[i] >= g->ne || !g->e[keep[i]].live) {
            free(kept);
            return laden__fail(LADEN_E_INVAL,
                               "laden_cache_plan_host: keep[%u]: no host "
                               "entry %u",
                               i, keep[i]);
        }
        if (!kept[keep[i]])
            held += g->e[keep[i]].bytes; /* <= ebytes: no overflow */
        kept[keep[i]] = true;
    }
    bool unlimited = budget == LADEN_CACHE_RAM_UNLIMITED;
    uint64_t models = unlimited ? 0 : laden__cache_group_host(c);
    /* Idle entries get what the budget leaves after the models, the need
     * and the kept entries: they are cheaper to make again than a model. */
    uint64_t used = sat_add(sat_add(models, need), held);
    uint64_t limit = unlimited          ? LADEN_CACHE_IDLE_HOST_BYTES
                     : budget > used ? budget - used
                                     : 0;
    uint32_t nd;
    uint64_t freed;
    laden_status s = plan_entries(g, kept, g->ebytes - held, limit, drop,
                                  drop_cap, &nd, &freed);
    free(kept);
    if (s || unlimited) {
        *out_ndrop = s ? 0 : nd;
        return s;
    }
    /* Then whole idle models, for the need and the entries left. */
    s = laden__cache_plan_models(c, except, budget,
                                 sat_add(need, g->ebytes - freed), ev, cap,
                                 out_n);
    if (!s || s == LADEN_E_BUDGET)
        *out_ndrop = nd;
    return s;
}
