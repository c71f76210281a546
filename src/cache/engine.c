/* The cache engine: carries the cache's decisions out on the models'
 * schedules.  See include/laden/cache.h.
 *
 * A bound model is a LADEN_SCHED_CACHE schedule: every block has a host
 * copy, and a block has a device copy of its own or streams through the
 * slots.  Activation decides the set of blocks with device copies, takes
 * the room from idle models (slots first, then blocks from the last: the
 * first blocks of a partly evicted model stay), and uploads only what is
 * missing.  The accounting of the decisions (cache.c) is set from what the
 * schedules report after each move, never from what was asked. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "../trace/trace_internal.h"
#include "cache_internal.h"
#include "laden/plan.h"

/* Device regions taken from blocks during one activation, handed to blocks
 * of the same size that need one (no device free and allocation on the
 * path of a switch); what is left is freed at its end. */
typedef struct region {
    laden_devptr_t ptr;
    uint64_t bytes;
} region;

typedef struct pool {
    region *r;
    uint32_t n, cap;
} pool;

static void traced_evict(uint32_t id, uint64_t bytes)
{
    if (LADEN__TRACING())
        laden__trace_point(LADEN__EV_EVICT, 0, id, bytes, 0,
                           "cache eviction");
}

static void pool_free(pool *p, int32_t dev)
{
    for (uint32_t i = 0; p && i < p->n; i++)
        laden_dev_mem_free(dev, p->r[i].ptr);
    if (p) {
        free(p->r);
        memset(p, 0, sizeof *p);
    }
}

/* Takes block i's device copy into the pool (freed if the pool is full or
 * NULL). */
static laden_status pool_take(pool *p, laden_sched_t *sc, uint32_t i)
{
    if (!p)
        return laden_sched_set_resident(sc, i, 0);
    if (p->n == p->cap) {
        uint32_t cap = p->cap ? 2 * p->cap : 16;
        region *r = realloc(p->r, cap * sizeof *r);
        if (!r)
            return laden_sched_set_resident(sc, i, 0);
        p->r = r;
        p->cap = cap;
    }
    region *r = &p->r[p->n];
    laden_status s = laden_sched_take_resident(sc, i, &r->ptr, &r->bytes);
    if (!s && r->ptr)
        p->n++;
    return s;
}

/* A pooled region of exactly n bytes, removed from the pool; 0 if none. */
static laden_devptr_t pool_get(pool *p, uint64_t n)
{
    for (uint32_t i = 0; p && i < p->n; i++)
        if (p->r[i].bytes == n) {
            laden_devptr_t ptr = p->r[i].ptr;
            p->r[i] = p->r[--p->n];
            return ptr;
        }
    return 0;
}

/* Sets the accounting of model id to what its schedule holds. */
static void account(laden_cache_t *c, uint32_t id)
{
    model *m = &c->m[id];
    laden_sched_stats_t st;
    if (!m->sched || laden_sched_stats(m->sched, &st))
        return;
    c->vram = c->vram - m->vram + st.device_bytes;
    m->vram = st.device_bytes;
    c->pinned = c->pinned - m->pinned + st.registered_bytes;
    m->pinned = st.registered_bytes;
}

/* Makes idle model id give up at least `drop` device bytes (slots first,
 * then blocks from the last) and at least `unpin` pinned host bytes (from
 * the last block).  *freed: device bytes freed. */
static laden_status shrink(laden_cache_t *c, uint32_t id, uint64_t drop,
                           uint64_t unpin, uint64_t *freed, pool *pl)
{
    model *m = &c->m[id];
    laden_sched_t *sc = m->sched;
    laden_status s = LADEN_OK;
    uint64_t before = m->vram, unpinned = 0;
    *freed = 0;
    if (!sc)
        return LADEN_OK;
    uint32_t nb = laden_sched_block_count(sc);
    if (drop) {
        if ((s = laden_sched_stop(sc)))
            goto out;
        account(c, id);
        for (uint32_t i = nb; i-- > 0 && before - m->vram < drop;) {
            if (!laden_sched_is_resident(sc, i))
                continue;
            if ((s = pool_take(pl, sc, i)))
                goto out;
            account(c, id);
        }
    }
    for (uint32_t i = nb; i-- > 0 && unpinned < unpin;) {
        if (!laden_sched_is_pinned(sc, i))
            continue;
        if ((s = laden_sched_pin(sc, i, 0)))
            goto out;
        uint64_t b = laden_sched_block_bytes(sc, i);
        unpinned += b;
        c->st.unpin_bytes += b;
    }
out:
    account(c, id);
    *freed = before > m->vram ? before - m->vram : 0;
    if (s)
        laden__error_prefix("evicting model '%.200s'", m->key);
    return s;
}

static laden_status bound(laden_cache_t *c, uint32_t id, model **out,
                          const char *call)
{
    *out = NULL;
    if (!c)
        return laden__fail(LADEN_E_INVAL, "%s: NULL cache", call);
    if (id >= c->n || !c->m[id].key)
        return laden__fail(LADEN_E_INVAL, "%s: no model %u", call, id);
    if (!c->m[id].sched)
        return laden__fail(LADEN_E_STATE,
                           "%s: model '%.200s' has no schedule bound", call,
                           c->m[id].key);
    *out = &c->m[id];
    return LADEN_OK;
}

laden_status laden_cache_bind(laden_cache_t *c, uint32_t id,
                              laden_sched_t *sc, uint32_t fixed)
{
    if (!c || !sc || id >= c->n || !c->m[id].key)
        return laden__fail(LADEN_E_INVAL, "laden_cache_bind: bad argument");
    model *m = &c->m[id];
    if (m->sched)
        return laden__fail(LADEN_E_STATE,
                           "model '%.200s' is bound to a schedule already",
                           m->key);
    uint32_t nb = laden_sched_block_count(sc);
    if (fixed > nb)
        return laden__fail(LADEN_E_INVAL,
                           "laden_cache_bind: %u fixed blocks of %u", fixed,
                           nb);
    if (!laden_sched_is_cache(sc))
        return laden__fail(LADEN_E_STATE,
                           "laden_cache_bind: model '%.200s': the schedule "
                           "must be a loaded LADEN_SCHED_CACHE schedule",
                           m->key);
    /* A cache is one device's, the device of its first bound schedule:
     * its budget, and the device regions it hands from evicted blocks to
     * uploads, are that device's. */
    int32_t dev = laden_sched_device(sc);
    if (c->bound_once && c->device != dev)
        return laden__fail(LADEN_E_INVAL,
                           "laden_cache_bind: model '%.200s' is on device "
                           "%d, the cache is device %d's: a cache is one "
                           "device's; join a cache per device "
                           "(laden_cache_join)",
                           m->key, dev, c->device);
    c->device = dev;
    c->bound_once = true;
    uint64_t size = 0, dev_size = 0;
    for (uint32_t i = 0; i < nb; i++) {
        size += laden_sched_block_bytes(sc, i);
        dev_size += laden_sched_block_device_bytes(sc, i);
    }
    m->sched = sc;
    m->dev_size = dev_size;
    m->device = dev;
    m->fixed = fixed;
    m->size = size;
    account(c, id);
    return LADEN_OK;
}

laden_status laden_cache_unbind(laden_cache_t *c, uint32_t id)
{
    model *m;
    uint64_t freed;
    laden_status s = bound(c, id, &m, "laden_cache_unbind");
    if (s)
        return s;
    if (m->in_use)
        return laden__fail(LADEN_E_STATE,
                           "model '%.200s' is in use and cannot be dropped",
                           m->key);
    if ((s = shrink(c, id, UINT64_MAX, UINT64_MAX, &freed, NULL)))
        return s;
    m->sched = NULL;
    return LADEN_OK;
}

laden_status laden_cache_drop(laden_cache_t *c, uint32_t id, uint64_t bytes,
                              int unpin, uint64_t *out_freed)
{
    model *m;
    uint64_t freed = 0;
    if (out_freed)
        *out_freed = 0;
    laden_status s = bound(c, id, &m, "laden_cache_drop");
    if (s)
        return s;
    if (m->in_use)
        return laden__fail(LADEN_E_STATE,
                           "model '%.200s' is in use: it can be evicted once "
                           "its use has ended",
                           m->key);
    s = shrink(c, id, bytes, unpin ? UINT64_MAX : 0, &freed, NULL);
    if (freed) {
        c->st.evictions++;
        c->st.evicted_bytes += freed;
        traced_evict(id, freed);
    }
    if (out_freed)
        *out_freed = freed;
    return s;
}

/* Carries out decisions on device memory; *total: bytes freed. */
static laden_status apply_vram(laden_cache_t *c, const laden_cache_evict_t *ev,
                               uint32_t n, uint64_t *total, pool *pl)
{
    laden_status s = LADEN_OK;
    *total = 0;
    for (uint32_t i = 0; i < n && !s; i++) {
        uint64_t freed = 0;
        s = shrink(c, ev[i].model, ev[i].drop_bytes, 0, &freed, pl);
        *total += freed;
        if (freed > ev[i].drop_bytes) /* whole blocks: a little more */
            c->st.evicted_bytes += freed - ev[i].drop_bytes;
    }
    return s;
}

laden_status laden_cache_free_vram(laden_cache_t *c, uint64_t bytes,
                                   laden_cache_evict_t *ev, uint32_t cap,
                                   uint32_t *out_n)
{
    uint64_t total;
    laden_status s = laden_cache_evict_bytes(c, bytes, ev, cap, out_n);
    if (s)
        return s;
    for (uint32_t i = 0; i < *out_n; i++)
        if (!c->m[ev[i].model].sched)
            return laden__fail(LADEN_E_STATE,
                               "laden_cache_free_vram: model '%.200s' has "
                               "no schedule bound",
                               c->m[ev[i].model].key);
    return apply_vram(c, ev, *out_n, &total, NULL);
}

/* Evicts every idle model's device copy (the device refused memory that
 * the budget allowed: something outside the cache holds it). */
static uint64_t evict_all_idle(laden_cache_t *c, uint32_t except)
{
    uint64_t total = 0, freed;
    for (uint32_t i = 0; i < c->n; i++) {
        model *o = &c->m[i];
        if (i == except || !o->key || o->in_use || !o->sched || !o->vram)
            continue;
        if (shrink(c, i, UINT64_MAX, 0, &freed, NULL) == LADEN_OK && freed) {
            c->st.evictions++;
            c->st.evicted_bytes += freed;
            traced_evict(i, freed);
            total += freed;
        }
    }
    return total;
}

/* Under c's group's lock: the idle bound models of every cache of the
 * group but model `except` of c (with `pinned`, only those holding pinned
 * bytes), least recently used first; NULL (*n 0) when out of memory. */
static cand *group_idle(laden_cache_t *c, uint32_t except, bool pinned,
                        uint32_t *n)
{
    uint32_t all = 0, k = 0, order = 0;
    for (laden_cache_t *o = c->g->first; o; o = o->next)
        all += o->n;
    cand *cs = malloc((all ? all : 1) * sizeof *cs);
    *n = 0;
    if (!cs)
        return NULL;
    for (laden_cache_t *o = c->g->first; o; o = o->next, order++)
        for (uint32_t i = 0; i < o->n; i++) {
            model *x = &o->m[i];
            if (x->key && x->sched && !x->in_use && !(o == c && i == except) &&
                (pinned ? x->pinned != 0 : !x->keep_host))
                cs[k++] = (cand){x->last_use, o, order, i};
        }
    qsort(cs, k, sizeof *cs, laden__cmp_cand);
    *n = k;
    return cs;
}

/* Pins model id's host copy, as much as the pinned budget allows after
 * unpinning idle models' copies, blocks in order.  The budget is the
 * group's: idle models of every cache of the group (the host's other
 * devices) give way, least recently used first, the last only in part;
 * what models in use hold stays. */
static void pin_model(laden_cache_t *c, uint32_t id,
                      laden_cache_activation_t *act)
{
    model *m = &c->m[id];
    uint32_t nb = laden_sched_block_count(m->sched);
    uint64_t want = m->size;
    if (m->pinned >= want)
        return;
    cache_group *g = c->g;
    if (g->pinned_budget) {
        uint64_t budget = g->pinned_budget, busy = 0, used = 0;
        uint32_t k = 0;
        pthread_mutex_lock(&g->mu);
        for (laden_cache_t *o = g->first; o; o = o->next) {
            used += o->pinned;
            for (uint32_t i = 0; i < o->n; i++)
                if (o->m[i].key && o->m[i].in_use && !(o == c && i == id))
                    busy += o->m[i].pinned;
        }
        cand *cs = group_idle(c, id, true, &k);
        uint64_t room = budget > busy ? budget - busy : 0;
        if (want > room)
            want = room;
        for (uint32_t j = 0; j < k && used - m->pinned + want > budget; j++) {
            model *x = &cs[j].c->m[cs[j].id];
            uint64_t before = x->pinned, freed;
            shrink(cs[j].c, cs[j].id, 0, used - m->pinned + want - budget,
                   &freed, NULL);
            act->unpinned_bytes += before - x->pinned;
            used -= before - x->pinned;
        }
        pthread_mutex_unlock(&g->mu);
        laden__error_clear();
        free(cs);
        room = budget > used - m->pinned ? budget - (used - m->pinned) : 0;
        if (want > room)
            want = room;
    }
    uint64_t have = m->pinned;
    for (uint32_t i = 0; i < nb; i++) {
        if (laden_sched_is_pinned(m->sched, i))
            continue;
        uint64_t b = laden_sched_block_bytes(m->sched, i);
        if (have + b > want)
            break;
        if (laden_sched_pin(m->sched, i, 1)) {
            act->pin_failed = 1; /* stays pageable: slower, still correct */
            laden__error_clear();
            break;
        }
        have += b;
        act->pinned_bytes += b;
        c->st.pin_bytes += b;
    }
    account(c, id);
}

/* The blocks that get device copies: all (resident) or the planner's
 * choice within `avail` (streaming).  *want: device bytes then held. */
static laden_status choose(laden_cache_t *c, model *m, laden_cache_mode mode,
                           uint32_t lookahead, uint64_t avail, uint8_t *res,
                           uint64_t *want, int32_t *chosen)
{
    laden_sched_t *sc = m->sched;
    uint32_t nb = laden_sched_block_count(sc), nf = nb - m->fixed;
    uint64_t total = m->dev_size, rest = 0;
    for (uint32_t i = 0; i < m->fixed; i++)
        rest += laden_sched_block_device_bytes(sc, i);
    bool whole = mode == LADEN_CACHE_RESIDENT || nf == 0 ||
                 (mode == LADEN_CACHE_AUTO && total <= avail);
    if (whole) {
        if (total > avail)
            return laden__fail(LADEN_E_BUDGET,
                               "model '%.200s' needs %s on the device to be "
                               "resident; the budget leaves %s after the "
                               "models in use",
                               m->key, laden__bytes(total).s,
                               laden__bytes(avail).s);
        memset(res, 1, nb);
        *want = total;
        *chosen = LADEN_CACHE_RESIDENT;
        return LADEN_OK;
    }
    uint64_t *bytes = malloc(2 * nf * sizeof *bytes), *slot = bytes + nf;
    int32_t *tiers = malloc(nf * sizeof *tiers);
    int32_t *why = malloc(nf * sizeof *why);
    laden_status s = LADEN_OK;
    if (!bytes || !tiers || !why) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory planning model "
                        "'%.200s'", m->key);
        goto out;
    }
    uint64_t ws = 0; /* the workspace a streamed block decodes into */
    for (uint32_t i = 0; i < nf; i++) {
        bytes[i] = laden_sched_block_device_bytes(sc, m->fixed + i);
        slot[i] = laden_sched_block_bytes(sc, m->fixed + i); /* as kept */
        uint64_t w = laden_sched_block_workspace_bytes(sc, m->fixed + i);
        ws = w > ws ? w : ws;
    }
    laden_plan_input in;
    memset(&in, 0, sizeof in);
    in.nblocks = nf;
    in.block_bytes = bytes;
    in.slot_block_bytes = slot; /* lossless tensors stream coded */
    in.rest_bytes = rest + ws; /* held beside the rest while it streams */
    in.vram_free_bytes = avail;
    in.ram_total_bytes = in.ram_free_bytes = in.ram_budget_bytes = total + 1;
    in.min_free_ram_bytes = 0;
    in.resident_blocks = mode == LADEN_CACHE_STREAMING ? 0 : -1;
    in.lookahead = lookahead;
    laden_plan_result r;
    if ((s = laden_plan_compute(&in, tiers, why, &r))) {
        laden__error_prefix("model '%.200s' cannot stream within the device "
                            "budget left after the models in use",
                            m->key);
        goto out;
    }
    for (uint32_t i = 0; i < nb; i++)
        res[i] = i < m->fixed || tiers[i - m->fixed] == LADEN_TIER_GPU;
    *want = r.vram_used_bytes;
    *chosen = LADEN_CACHE_STREAMING;
out:
    free(bytes);
    free(tiers);
    free(why);
    return s;
}

/* The most device memory model m holds while it makes the blocks res[]
 * resident, given `want` once it runs: the uploads' buffers
 * (laden_sched_block_upload_bytes: a CUDA cache schedule's lossless
 * upload buffers) lie beside the device copies until the uploads end,
 * which is before the slots are made (laden_sched_start frees them).
 * *buffers: the buffers' bytes. */
static uint64_t peak_bytes(const model *m, const uint8_t *res, uint64_t want,
                           uint64_t *buffers)
{
    laden_sched_t *sc = m->sched;
    uint32_t nb = laden_sched_block_count(sc);
    uint64_t up = 0, copies = 0;
    for (uint32_t i = 0; i < nb; i++) {
        if (!res[i])
            continue;
        copies += laden_sched_block_device_bytes(sc, i);
        uint64_t n = laden_sched_is_resident(sc, i)
                         ? 0
                         : laden_sched_block_upload_bytes(sc, i);
        up = n > up ? n : up;
    }
    *buffers = up;
    return up && copies + up > want ? copies + up : want;
}

/* Gives model id's schedule exactly the device copies in res[] and its
 * slots.  Uploads only the missing blocks. */
static laden_status place(laden_cache_t *c, uint32_t id, const uint8_t *res,
                          uint32_t lookahead, laden_cache_activation_t *act,
                          pool *pl)
{
    model *m = &c->m[id];
    laden_sched_t *sc = m->sched;
    laden_sched_stats_t st;
    laden_status s;
    uint32_t nb = laden_sched_block_count(sc), nstream = 0;
    bool same = true;
    for (uint32_t i = 0; i < nb; i++) {
        same &= laden_sched_is_resident(sc, i) == (int)res[i];
        nstream += !res[i];
    }
    if ((s = laden_sched_stats(sc, &st)))
        return s;
    bool started = st.nslots > 0;
    if (same && started == (nstream > 0) &&
        (!started || st.nslots == laden_slot_count(nstream, lookahead)))
        return LADEN_OK; /* everything is where it should be */
    if ((s = laden_sched_stop(sc)))
        return s;
    for (uint32_t i = 0; i < nb; i++) /* free first, then allocate */
        if (!res[i] && (s = pool_take(pl, sc, i)))
            return s;
    /* Regions no block of this model can use are freed before the
     * uploads, so the device has them back for the allocations. */
    if (pl && pl->n) {
        bool *keep = calloc(pl->n, sizeof *keep);
        if (keep) {
            for (uint32_t i = 0; i < nb; i++) {
                if (!res[i] || laden_sched_is_resident(sc, i))
                    continue;
                uint64_t n = laden_sched_block_device_bytes(sc, i);
                for (uint32_t k = 0; k < pl->n; k++)
                    if (!keep[k] && pl->r[k].bytes == n) {
                        keep[k] = true;
                        break;
                    }
            }
            uint32_t w = 0;
            for (uint32_t k = 0; k < pl->n; k++) {
                if (keep[k])
                    pl->r[w++] = pl->r[k];
                else
                    laden_dev_mem_free(m->device, pl->r[k].ptr);
            }
            pl->n = w;
            free(keep);
        }
    }
    /* In a VBAR: evictions in one batch before the uploads start, not
     * one page at a time between them (no-op otherwise). */
    if ((s = laden_sched_reserve_vram(sc, res, nb)))
        return s;
    for (uint32_t i = 0; i < nb; i++) {
        if (!res[i] || laden_sched_is_resident(sc, i))
            continue;
        uint64_t n = laden_sched_block_device_bytes(sc, i);
        uint64_t before = st.upload_bytes;
        laden_devptr_t r = pool_get(pl, n);
        if (r && (s = laden_sched_set_resident_at(sc, i, r, n))) {
            laden_dev_mem_free(m->device, r);
            return s;
        }
        if (!r && (s = laden_sched_set_resident(sc, i, 1))) {
            /* In a VBAR: offloaded.  A block streams instead; the parts
             * outside blocks cannot. */
            if (s != LADEN_E_BUDGET || !laden_sched_vbar(sc) ||
                i < m->fixed) {
                if (s == LADEN_E_BUDGET)
                    laden__error_prefix("model '%.200s', outside its "
                                        "blocks", m->key);
                return s;
            }
            laden__error_clear();
            nstream++;
            act->offloaded_blocks++;
            continue;
        }
        laden_sched_stats(sc, &st);
        uint64_t copied = st.upload_bytes - before; /* over the link */
        act->upload_bytes += copied;
        act->reused_bytes += r ? n : 0;
        /* In a VBAR, still as it was written: no copy.  (On the CPU
         * device nothing is copied either: the block runs from its host
         * copy; that is not a copy kept from an earlier use.) */
        if (!copied && laden_sched_vbar(sc))
            act->kept_bytes += n;
    }
    if (!nstream)
        return LADEN_OK;
    /* In a VBAR the slots are charged to the context: if it has no room
     * for them, the last resident blocks stream too, their pages unpinned
     * so that the charge can take them. */
    while ((s = laden_sched_start(sc, lookahead)) == LADEN_E_BUDGET &&
           laden_sched_vbar(sc)) {
        uint32_t k = nb;
        while (k > m->fixed && !laden_sched_is_resident(sc, k - 1))
            k--;
        if (k <= m->fixed)
            break;
        laden__error_clear();
        if ((s = laden_sched_set_resident(sc, k - 1, 0)))
            return s;
        act->offloaded_blocks++;
    }
    return s;
}

laden_status laden_cache_activate(laden_cache_t *c, uint32_t id,
                                  laden_cache_mode mode, uint32_t lookahead,
                                  uintptr_t handle, laden_cache_evict_t *ev,
                                  uint32_t cap, uint32_t *out_n,
                                  laden_cache_activation_t *out)
{
    model *m;
    laden_cache_activation_t act;
    memset(&act, 0, sizeof act);
    if (out)
        memset(out, 0, sizeof *out);
    if (out_n)
        *out_n = 0;
    uint64_t t0 = LADEN__TRACING() ? laden__now_ns() : 0;
    laden_status s = bound(c, id, &m, "laden_cache_activate");
    if (s)
        return s;
    if (!out_n || (cap && !ev))
        return laden__fail(LADEN_E_INVAL, "laden_cache_activate: NULL output");
    if (mode != LADEN_CACHE_AUTO && mode != LADEN_CACHE_RESIDENT &&
        mode != LADEN_CACHE_STREAMING)
        return laden__fail(LADEN_E_INVAL, "unknown cache mode %d", (int)mode);
    if (lookahead == 0)
        lookahead = LADEN_LOOKAHEAD_DEFAULT;
    if (lookahead > LADEN_LOOKAHEAD_MAX)
        return laden__fail(LADEN_E_INVAL, "lookahead %u: at most %u",
                           lookahead, LADEN_LOOKAHEAD_MAX);
    if (m->in_use)
        return laden__fail(LADEN_E_STATE,
                           "model '%.200s' is in use: a model has one "
                           "runtime, used by one caller at a time",
                           m->key);
    uint32_t nb = laden_sched_block_count(m->sched);
    uint64_t inuse = 0, want = 0;
    for (uint32_t i = 0; i < c->n; i++)
        if (i != id && c->m[i].key && c->m[i].in_use)
            inuse += c->m[i].vram;
    uint64_t avail = !c->vram_budget           ? UINT64_MAX
                     : c->vram_budget > inuse ? c->vram_budget - inuse
                                              : 0;
    pool pl;
    memset(&pl, 0, sizeof pl);
    uint8_t *res = calloc(nb ? nb : 1, sizeof *res);
    if (!res)
        return laden__fail(LADEN_E_NOMEM, "out of memory activating '%.200s'",
                           m->key);
    int32_t chosen = 0;
    if ((s = choose(c, m, mode, lookahead, avail, res, &want, &chosen)))
        goto out;
    /* The uploads' buffers lie beside the device copies while they run:
     * the budget holds them too, by evicting more or keeping fewer blocks
     * resident (the planner again, with the buffers' room less), or none
     * (streaming every block uploads only the fixed ones). */
    uint64_t up, peak = peak_bytes(m, res, want, &up);
    if (peak > avail) {
        s = choose(c, m, mode, lookahead, avail > up ? avail - up : 0, res,
                   &want, &chosen);
        if (s == LADEN_E_BUDGET && mode != LADEN_CACHE_RESIDENT) {
            laden__error_clear();
            s = choose(c, m, LADEN_CACHE_STREAMING, lookahead, avail, res,
                       &want, &chosen);
        }
        if (s == LADEN_E_BUDGET)
            laden__error_prefix("leaving %s for the lossless upload buffers",
                                laden__bytes(up).s);
        if (s)
            goto out;
        peak = peak_bytes(m, res, want, &up);
    }
    if ((s = laden_cache_acquire(c, id, peak, ev, cap, out_n))) {
        if (s == LADEN_E_BUDGET && peak > want)
            laden__error_prefix("model '%.200s' with its lossless upload "
                                "buffers (%s beside its device copies while "
                                "they upload)",
                                m->key, laden__bytes(peak - want).s);
        goto out;
    }
    act.mode = chosen;
    act.evicted_models = *out_n;
    if (laden_sched_vbar(m->sched)) /* first for its VRAM context too */
        laden_vbar_prioritize(laden_sched_vbar(m->sched));
    if ((s = apply_vram(c, ev, *out_n, &act.evicted_bytes, &pl)))
        goto undo;
    pin_model(c, id, &act);
    /* Blocks made resident now: on the CPU device that copies nothing
     * (they run from their host copies), and is still no hit. */
    uint32_t fresh = 0;
    for (uint32_t i = 0; i < nb; i++) {
        if (res[i] && laden_sched_is_resident(m->sched, i))
            act.kept_bytes += laden_sched_block_device_bytes(m->sched, i);
        else if (res[i] && m->device == LADEN_DEVICE_CPU)
            fresh++;
    }
    s = place(c, id, res, lookahead, &act, &pl);
    pool_free(&pl, m->device);
    if (s == LADEN_E_DEVICE_NOMEM || s == LADEN_E_NOMEM) {
        /* The device refused what the budget allows: memory outside the
         * cache.  Idle models give theirs up, once. */
        laden__error_clear();
        uint64_t freed = evict_all_idle(c, id);
        act.evicted_bytes += freed;
        account(c, id);
        s = place(c, id, res, lookahead, &act, NULL);
        if (s)
            laden__error_prefix("model '%.200s': the device has no room for "
                                "what the budget allows (%s freed from idle "
                                "models)",
                                m->key, laden__bytes(freed).s);
    }
    account(c, id);
    if (s)
        goto undo;
    if ((s = laden_sched_ready(m->sched, handle)))
        goto undo;
    account(c, id); /* ready gives back what only the uploads needed */
    laden_sched_stats_t st;
    laden_sched_stats(m->sched, &st);
    act.slot_bytes = (uint64_t)st.nslots * st.slot_bytes;
    for (uint32_t i = 0; i < nb; i++) {
        act.resident_blocks += res[i];
        act.streamed_blocks += !res[i];
    }
    c->st.upload_bytes += act.upload_bytes;
    if (!act.upload_bytes && !act.evicted_bytes && !fresh)
        c->st.hits++;
    if (t0 && LADEN__TRACING())
        laden__trace_span(LADEN__EV_UPLOAD, 0, t0, id, act.upload_bytes, 0,
                          "cache activate");
    if (out)
        *out = act;
    free(res);
    return LADEN_OK;
undo:
    pool_free(&pl, m->device);
    account(c, id);
    m->in_use = false;
    if (out)
        *out = act;
out:
    free(res);
    return s;
}

laden_status laden_cache_may_evict(laden_cache_t *c, uint32_t id,
                                  int32_t *out)
{
    model *m;
    if (out)
        *out = 0;
    laden_status s = bound(c, id, &m, "laden_cache_may_evict");
    if (s)
        return s;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_cache_may_evict: NULL");
    /* In a VRAM context the context, not the cache, takes idle models'
     * pages; without a budget activation takes nothing from the budget. */
    if (laden_sched_vbar(m->sched) || !c->vram_budget)
        return LADEN_OK;
    uint64_t lacks = m->dev_size > m->vram ? m->dev_size - m->vram : 0;
    uint64_t free_room = c->vram < c->vram_budget ? c->vram_budget - c->vram
                                                  : 0;
    *out = lacks && free_room < lacks;
    return LADEN_OK;
}

laden_status laden_cache_deactivate(laden_cache_t *c, uint32_t id,
                                    uintptr_t handle)
{
    model *m;
    laden_status s = bound(c, id, &m, "laden_cache_deactivate");
    if (s)
        return s;
    if (!m->in_use)
        return laden__fail(LADEN_E_STATE, "model '%.200s' is not in use",
                           m->key);
    s = laden_sched_fence(m->sched, handle);
    laden_status r = laden_cache_release(c, id);
    return s ? s : r;
}

laden_status laden_cache_plan_host_group(laden_cache_t *c, uint32_t except,
                                         uint64_t budget, uint64_t need,
                                         laden_cache_host_evict_t *ev,
                                         uint32_t cap, uint32_t *out_n)
{
    if (out_n)
        *out_n = 0;
    if (!c || !out_n || (cap && !ev))
        return laden__fail(LADEN_E_INVAL, "laden_cache_plan_host_group: NULL");
    return laden__cache_plan_models(c, except, budget, need, ev, cap, out_n);
}

/* Under g's lock: the host bytes of its bound models (saturated). */
static uint64_t group_host(const cache_group *g)
{
    uint64_t held = 0;
    for (const laden_cache_t *o = g->first; o; o = o->next)
        for (uint32_t i = 0; i < o->n; i++)
            if (o->m[i].key && o->m[i].sched &&
                !laden__add_u64(held, o->m[i].size, &held))
                held = UINT64_MAX;
    return held;
}

uint64_t laden__cache_group_host(laden_cache_t *c)
{
    pthread_mutex_lock(&c->g->mu);
    uint64_t held = group_host(c->g);
    pthread_mutex_unlock(&c->g->mu);
    return held;
}

laden_status laden__cache_plan_models(laden_cache_t *c, uint32_t except,
                                      uint64_t budget, uint64_t need,
                                      laden_cache_host_evict_t *ev,
                                      uint32_t cap, uint32_t *out_n)
{
    cache_group *g = c->g;
    pthread_mutex_lock(&g->mu);
    uint32_t k = 0;
    cand *cs = group_idle(c, except, false, &k);
    laden_status s = LADEN_OK;
    if (!cs) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory deciding evictions");
        goto out;
    }
    uint64_t held = group_host(g), idle = 0;
    for (uint32_t j = 0; j < k; j++)
        idle += cs[j].c->m[cs[j].id].size;
    uint64_t want;
    if (!laden__add_u64(held, need, &want))
        want = UINT64_MAX; /* more than any budget */
    uint64_t over = want > budget ? want - budget : 0;
    if (over > idle) {
        uint64_t kept = 0;
        for (const laden_cache_t *o = g->first; o; o = o->next)
            for (uint32_t i = 0; i < o->n; i++)
                if (o->m[i].key && o->m[i].sched && o->m[i].keep_host &&
                    !o->m[i].in_use)
                    kept += o->m[i].size;
        s = laden__fail(LADEN_E_BUDGET,
                        "%s of host copies do not fit the RAM budget of %s: "
                        "%s are held, %s of them by idle models that may "
                        "give way%s%s%s",
                        laden__bytes(need).s, laden__bytes(budget).s,
                        laden__bytes(held).s, laden__bytes(idle).s,
                        kept ? " (and " : "",
                        kept ? laden__bytes(kept).s : "",
                        kept ? " by idle trainable models, whose host copies "
                               "hold the only copy of their weights)"
                             : "");
        goto out;
    }
    uint64_t freed = 0;
    uint32_t n = 0;
    for (uint32_t j = 0; j < k && freed < over; j++) {
        if (n == cap) {
            s = laden__fail(LADEN_E_INVAL, "more than %u evictions are "
                            "needed", cap);
            n = 0;
            goto out;
        }
        uint64_t size = cs[j].c->m[cs[j].id].size;
        ev[n++] = (laden_cache_host_evict_t){cs[j].c, cs[j].id, size};
        freed += size;
    }
    *out_n = n;
out:
    pthread_mutex_unlock(&g->mu);
    free(cs);
    return s;
}
