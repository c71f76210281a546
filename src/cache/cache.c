/* Cache decisions.  See include/laden/cache.h.  Few models (tens), decided
 * rarely (once per activation): plain arrays and a sort per decision. */
#define _POSIX_C_SOURCE 200809L
#include "laden/cache.h"
#include "laden/dev.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "cache_internal.h"

uint64_t laden__cache_budget_from_free(uint64_t free_bytes)
{
    return free_bytes > LADEN_CACHE_HEADROOM_DEFAULT + 1
               ? free_bytes - LADEN_CACHE_HEADROOM_DEFAULT
               : 1;
}

laden_status laden_cache_default_budget(int32_t device, uint64_t context,
                                        uint64_t *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_default_budget: out "
                           "is NULL");
    *out = 0;
    if (context) {
        *out = context;
        return LADEN_OK;
    }
    if (device == LADEN_DEVICE_CPU)
        return LADEN_OK;
    uint64_t free_b, total;
    laden_status s = laden_dev_mem_info(device, &free_b, &total);
    if (!s)
        *out = laden__cache_budget_from_free(free_b);
    return s;
}

laden_status laden_cache_create(uint64_t vram_budget, uint64_t pinned_budget,
                                laden_cache_t **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_create: out is NULL");
    laden_cache_t *c = calloc(1, sizeof *c);
    cache_group *g = calloc(1, sizeof *g);
    if (!c || !g) {
        free(c);
        free(g);
        *out = NULL;
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a cache");
    }
    pthread_mutex_init(&g->mu, NULL);
    g->first = c;
    g->members = 1;
    g->pinned_budget = pinned_budget;
    c->vram_budget = vram_budget;
    c->g = g;
    *out = c;
    return LADEN_OK;
}

laden_status laden_cache_join(laden_cache_t *c, laden_cache_t *peer)
{
    if (!c || !peer || c == peer)
        return laden__fail(LADEN_E_INVAL, "laden_cache_join: %s",
                           c && c == peer ? "a cache cannot join itself"
                                          : "NULL cache");
    if (c->n || c->g->members > 1 || c->g->nlive)
        return laden__fail(LADEN_E_STATE,
                           "laden_cache_join: the cache %s: join before "
                           "adding models or host entries",
                           c->n          ? "has models"
                           : c->g->nlive ? "has host entries"
                                         : "is in a group already");
    cache_group *g = peer->g;
    if (g->pinned_budget != c->g->pinned_budget)
        return laden__fail(LADEN_E_INVAL,
                           "laden_cache_join: pinned budgets differ (%s "
                           "and the group's %s): a group has one",
                           laden__bytes(c->g->pinned_budget).s,
                           laden__bytes(g->pinned_budget).s);
    pthread_mutex_destroy(&c->g->mu);
    free(c->g->e);
    free(c->g);
    pthread_mutex_lock(&g->mu);
    c->g = g;
    c->next = g->first;
    g->first = c;
    g->members++;
    pthread_mutex_unlock(&g->mu);
    return LADEN_OK;
}

uint64_t laden__cache_group_pinned(const laden_cache_t *c)
{
    uint64_t n = 0;
    pthread_mutex_lock(&c->g->mu);
    for (const laden_cache_t *k = c->g->first; k; k = k->next)
        n += k->pinned;
    pthread_mutex_unlock(&c->g->mu);
    return n;
}

void laden_cache_destroy(laden_cache_t *c)
{
    if (!c)
        return;
    cache_group *g = c->g;
    pthread_mutex_lock(&g->mu);
    for (laden_cache_t **l = &g->first; *l; l = &(*l)->next)
        if (*l == c) {
            *l = c->next;
            break;
        }
    uint32_t left = --g->members;
    pthread_mutex_unlock(&g->mu);
    if (!left) {
        pthread_mutex_destroy(&g->mu);
        free(g->e);
        free(g);
    }
    for (uint32_t i = 0; i < c->n; i++)
        free(c->m[i].key);
    free(c->m);
    free(c);
}

static laden_status get(laden_cache_t *c, uint32_t id, model **out,
                        const char *call)
{
    *out = NULL;
    if (!c)
        return laden__fail(LADEN_E_INVAL, "%s: NULL cache", call);
    if (id >= c->n || !c->m[id].key)
        return laden__fail(LADEN_E_INVAL, "%s: no model %u", call, id);
    *out = &c->m[id];
    return LADEN_OK;
}

laden_status laden_cache_add(laden_cache_t *c, const char *key, uint64_t size,
                             uint32_t *out)
{
    uint32_t id;
    if (out)
        *out = 0;
    if (!c || !key || !out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_add: NULL argument");
    if (laden_cache_find(c, key, &id) == LADEN_OK)
        return laden__fail(LADEN_E_STATE, "model '%.200s' is registered "
                           "already", key);
    laden__error_clear();
    if (c->n == c->cap) {
        uint32_t n = c->cap ? 2 * c->cap : 8;
        model *m = realloc(c->m, n * sizeof *m);
        if (!m)
            return laden__fail(LADEN_E_NOMEM, "out of memory adding a model");
        c->m = m;
        c->cap = n;
    }
    model *m = &c->m[c->n];
    memset(m, 0, sizeof *m);
    if (!(m->key = strdup(key)))
        return laden__fail(LADEN_E_NOMEM, "out of memory adding a model");
    m->size = size;
    *out = c->n++;
    return LADEN_OK;
}

laden_status laden_cache_remove(laden_cache_t *c, uint32_t id)
{
    model *m;
    laden_status s = get(c, id, &m, "laden_cache_remove");
    if (s)
        return s;
    if (m->in_use || m->vram || m->pinned)
        return laden__fail(LADEN_E_STATE,
                           "model '%.200s' cannot be removed: %s%s on "
                           "the device, %s pinned",
                           m->key, m->in_use ? "in use, " : "",
                           laden__bytes(m->vram).s,
                           laden__bytes(m->pinned).s);
    free(m->key);
    m->key = NULL;
    return LADEN_OK;
}

laden_status laden_cache_find(laden_cache_t *c, const char *key, uint32_t *out)
{
    if (out)
        *out = 0;
    if (!c || !key || !out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_find: NULL argument");
    for (uint32_t i = 0; i < c->n; i++)
        if (c->m[i].key && strcmp(c->m[i].key, key) == 0) {
            *out = i;
            return LADEN_OK;
        }
    return laden__fail(LADEN_E_NOTFOUND, "no model '%.200s' in the cache",
                       key);
}

const char *laden_cache_key(laden_cache_t *c, uint32_t id)
{
    return c && id < c->n ? c->m[id].key : NULL;
}

int laden__cmp_cand(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->last_use != y->last_use)
        return x->last_use < y->last_use ? -1 : 1;
    if (x->order != y->order)
        return x->order < y->order ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Decides which idle models (not `except`) give up `need` bytes of device
 * (vram) or pinned memory, least recently used first, the last one only
 * partly.  With `all`, fails (LADEN_E_BUDGET) unless the whole need is met.
 * *freed gets what the decisions free. */
static laden_status plan_free(laden_cache_t *c, bool vram, uint32_t except,
                              uint64_t need, bool all,
                              laden_cache_evict_t *ev, uint32_t cap,
                              uint32_t *out_n, uint64_t *freed)
{
    *out_n = 0;
    *freed = 0;
    if (need == 0)
        return LADEN_OK;
    cand *cs = malloc((c->n ? c->n : 1) * sizeof *cs);
    if (!cs)
        return laden__fail(LADEN_E_NOMEM, "out of memory deciding evictions");
    uint32_t k = 0;
    uint64_t idle = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        model *m = &c->m[i];
        uint64_t held = vram ? m->vram : m->pinned;
        if (m->key && !m->in_use && i != except && held) {
            cs[k++] = (cand){m->last_use, c, 0, i};
            idle += held;
        }
    }
    if (all && idle < need) {
        free(cs);
        return laden__fail(LADEN_E_BUDGET,
                           "%s more of %s are needed, but the idle "
                           "models hold only %s",
                           laden__bytes(need).s,
                           vram ? "device memory" : "pinned memory",
                           laden__bytes(idle).s);
    }
    qsort(cs, k, sizeof *cs, laden__cmp_cand);
    uint32_t n = 0;
    for (uint32_t j = 0; j < k && *freed < need; j++) {
        model *m = &c->m[cs[j].id];
        uint64_t held = vram ? m->vram : m->pinned;
        uint64_t take = need - *freed < held ? need - *freed : held;
        if (n == cap) {
            free(cs);
            *out_n = 0;
            *freed = 0;
            return laden__fail(LADEN_E_INVAL,
                               "more than %u evictions are needed; give "
                               "room for as many as there are models",
                               cap);
        }
        ev[n++] = (laden_cache_evict_t){cs[j].id, take, held - take};
        *freed += take;
    }
    free(cs);
    *out_n = n;
    return LADEN_OK;
}

static laden_status room(laden_cache_t *c, bool vram, uint32_t id,
                         uint64_t want, laden_cache_evict_t *ev, uint32_t cap,
                         uint32_t *out_n, const char *call)
{
    model *m = &c->m[id];
    uint64_t budget = vram ? c->vram_budget : c->g->pinned_budget;
    uint64_t held = vram ? m->vram : m->pinned;
    uint64_t freed;
    if (!budget)
        return LADEN_OK;
    uint64_t total = vram ? c->vram : laden__cache_group_pinned(c);
    if (want > budget)
        return laden__fail(LADEN_E_BUDGET,
                           "%s: model '%.200s' needs %s of %s, more "
                           "than the whole budget of %s",
                           call, m->key, laden__bytes(want).s,
                           vram ? "device memory" : "pinned memory",
                           laden__bytes(budget).s);
    uint64_t after = total - held + want;
    laden_status s = plan_free(c, vram, id, after > budget ? after - budget : 0,
                               true, ev, cap, out_n, &freed);
    if (s == LADEN_E_BUDGET)
        laden__error_prefix("%s: model '%.200s'", call, m->key);
    return s;
}

static void count_evictions(laden_cache_t *c, const laden_cache_evict_t *ev,
                            uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        c->st.evictions++;
        c->st.evicted_bytes += ev[i].drop_bytes;
    }
}

laden_status laden_cache_acquire(laden_cache_t *c, uint32_t id, uint64_t want,
                                 laden_cache_evict_t *ev, uint32_t cap,
                                 uint32_t *out_n)
{
    model *m;
    if (out_n)
        *out_n = 0;
    laden_status s = get(c, id, &m, "laden_cache_acquire");
    if (s)
        return s;
    if (!out_n || (cap && !ev))
        return laden__fail(LADEN_E_INVAL, "laden_cache_acquire: NULL output");
    if (m->in_use)
        return laden__fail(LADEN_E_STATE,
                           "model '%.200s' is in use: a model has one "
                           "runtime, used by one caller at a time",
                           m->key);
    if ((s = room(c, true, id, want, ev, cap, out_n, "acquire")))
        return s;
    m->in_use = true;
    m->uses++;
    m->last_use = ++c->g->clock;
    c->st.acquires++;
    count_evictions(c, ev, *out_n);
    return LADEN_OK;
}

laden_status laden_cache_release(laden_cache_t *c, uint32_t id)
{
    model *m;
    laden_status s = get(c, id, &m, "laden_cache_release");
    if (s)
        return s;
    if (!m->in_use)
        return laden__fail(LADEN_E_STATE, "model '%.200s' is not in use",
                           m->key);
    m->in_use = false;
    m->last_use = ++c->g->clock;
    return LADEN_OK;
}

laden_status laden_cache_evict_bytes(laden_cache_t *c, uint64_t bytes,
                                     laden_cache_evict_t *ev, uint32_t cap,
                                     uint32_t *out_n)
{
    uint64_t freed;
    if (out_n)
        *out_n = 0;
    if (!c || !out_n || (cap && !ev))
        return laden__fail(LADEN_E_INVAL, "laden_cache_evict_bytes: NULL");
    laden_status s = plan_free(c, true, UINT32_MAX, bytes, false, ev, cap,
                               out_n, &freed);
    if (!s)
        count_evictions(c, ev, *out_n);
    return s;
}

laden_status laden_cache_plan_pin(laden_cache_t *c, uint32_t id, uint64_t want,
                                  laden_cache_evict_t *ev, uint32_t cap,
                                  uint32_t *out_n)
{
    model *m;
    if (out_n)
        *out_n = 0;
    laden_status s = get(c, id, &m, "laden_cache_plan_pin");
    if (s)
        return s;
    if (!out_n || (cap && !ev))
        return laden__fail(LADEN_E_INVAL, "laden_cache_plan_pin: NULL");
    return room(c, false, id, want, ev, cap, out_n, "pin");
}

static laden_status set_held(laden_cache_t *c, uint32_t id, uint64_t bytes,
                             bool vram)
{
    model *m;
    laden_status s = get(c, id, &m, vram ? "laden_cache_set_vram"
                                         : "laden_cache_set_pinned");
    if (s)
        return s;
    uint64_t *held = vram ? &m->vram : &m->pinned;
    uint64_t *total = vram ? &c->vram : &c->pinned;
    uint64_t budget = vram ? c->vram_budget : c->g->pinned_budget;
    uint64_t after = *total - *held + bytes;
    /* The pinned budget is the group's: the other caches' bytes count. */
    uint64_t used = vram ? after : laden__cache_group_pinned(c) - *held + bytes;
    if (budget && used > budget && bytes > *held)
        return laden__fail(LADEN_E_BUDGET,
                           "model '%.200s' cannot hold %s of %s: "
                           "%s of the %s budget would be used",
                           m->key, laden__bytes(bytes).s,
                           vram ? "device memory" : "pinned memory",
                           laden__bytes(used).s, laden__bytes(budget).s);
    *total = after;
    *held = bytes;
    return LADEN_OK;
}

laden_status laden_cache_set_vram(laden_cache_t *c, uint32_t id, uint64_t b)
{
    return set_held(c, id, b, true);
}

laden_status laden_cache_set_pinned(laden_cache_t *c, uint32_t id, uint64_t b)
{
    return set_held(c, id, b, false);
}

laden_status laden_cache_keep_host(laden_cache_t *c, uint32_t id, int keep)
{
    model *m;
    laden_status s = get(c, id, &m, "laden_cache_keep_host");
    if (s)
        return s;
    /* The host policy reads it under the group's lock (another device's
     * cache may be deciding). */
    pthread_mutex_lock(&c->g->mu);
    m->keep_host = keep != 0;
    pthread_mutex_unlock(&c->g->mu);
    return LADEN_OK;
}

laden_status laden_cache_info(laden_cache_t *c, uint32_t id,
                              laden_cache_info_t *out)
{
    model *m;
    if (out)
        memset(out, 0, sizeof *out);
    laden_status s = get(c, id, &m, "laden_cache_info");
    if (s || !out)
        return s ? s : laden__fail(LADEN_E_INVAL, "laden_cache_info: NULL");
    out->size_bytes = m->size;
    out->vram_bytes = m->vram;
    out->pinned_bytes = m->pinned;
    out->uses = m->uses;
    out->last_use = m->last_use;
    out->in_use = m->in_use;
    return LADEN_OK;
}

laden_status laden_cache_roomiest(laden_cache_t *const *caches, uint32_t n,
                                  uint32_t *out)
{
    if (!caches || !n || !out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_roomiest: no caches");
    int64_t best = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!caches[i])
            return laden__fail(LADEN_E_INVAL,
                               "laden_cache_roomiest: cache %u is NULL", i);
        int64_t room = (int64_t)caches[i]->vram_budget -
                       (int64_t)caches[i]->vram;
        if (!i || room > best) {
            best = room;
            *out = i;
        }
    }
    return LADEN_OK;
}

laden_status laden_cache_stats(laden_cache_t *c, laden_cache_stats_t *out)
{
    if (!c || !out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_stats: NULL");
    *out = c->st;
    out->vram_budget_bytes = c->vram_budget;
    out->pinned_budget_bytes = c->g->pinned_budget;
    out->vram_bytes = c->vram;
    out->pinned_bytes = c->pinned;
    out->models = 0;
    out->in_use = 0;
    for (uint32_t i = 0; i < c->n; i++)
        if (c->m[i].key) {
            out->models++;
            out->in_use += c->m[i].in_use;
        }
    return LADEN_OK;
}
