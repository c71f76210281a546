/* VBARs: reserved ranges with pages mapped on demand under one budget.
 * See include/laden/vram.h.
 *
 * Few VBARs (one per model), many pages (a 10 GB model has 300 of 32 MiB):
 * plain arrays.  Eviction scans for the lowest-priority VBAR with an
 * unpinned page and takes its highest one; that is O(VBARs x pages) per
 * evicted page, rare next to the cost of mapping. */
#define _POSIX_C_SOURCE 200809L
#include "laden/vram.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "../trace/trace_internal.h"
#include "vram_internal.h"

typedef struct page {
    uint64_t gen;       /* 0: not mapped */
    laden_phys_t phys;
    uint32_t pins;
} page;

struct laden_vbar {
    laden_vram_t *ctx;
    laden_vbar_t *next;
    laden_devptr_t va;
    uint64_t size, used;
    uint32_t npages;
    page *pages;
    uint64_t prio;
    uint64_t watermark, floor;
    uint64_t mapped, pinned_pages;
    /* The work that used its pages, as the last unpin recorded it: pages
     * are unmapped only after it (a wait for this VBAR's work, not a
     * device-wide synchronize). */
    laden_event_t *last_use;
    laden_dev_stream_t *wrapped;
    uintptr_t wrapped_handle;
    bool fenced;
};

struct laden_vram {
    pthread_mutex_t mu;
    int32_t device;
    uint64_t page, budget, mapped, charged, clock, gen;
    laden_vbar_t *vbars;
    laden_vram_info_t st;
    /* Memory charged but idle (the elastic allocator's cached blocks),
     * given back before weights are evicted: returns the bytes freed,
     * which are uncharged here.  Called with mu held. */
    uint64_t (*reclaim)(void *arg, uint64_t need);
    void *reclaim_arg;
    /* Spare physical pages: evicted to make room for faults, kept for
     * them (mapping a page the process already owns costs no new device
     * allocation, which the driver must clear first).  Counted as used;
     * given back first when memory is wanted for anything else. */
    laden_phys_t *spare;
    uint32_t nspare, spare_cap;
};

void laden__vram_set_reclaim(laden_vram_t *c,
                             uint64_t (*fn)(void *arg, uint64_t need),
                             void *arg)
{
    pthread_mutex_lock(&c->mu);
    c->reclaim = fn;
    c->reclaim_arg = arg;
    pthread_mutex_unlock(&c->mu);
}

laden_status laden_vram_create(int32_t device, uint64_t budget,
                               uint64_t page_bytes, laden_vram_t **out)
{
    laden_dev_info_t info;
    laden_status s;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_vram_create: out is NULL");
    *out = NULL;
    if ((s = laden_dev_info(device, &info)))
        return s;
    if (!info.vmm_supported || !info.vmm_granularity_bytes)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "device %d has no virtual memory management: "
                           "VBARs need it",
                           device);
    uint64_t g = info.vmm_granularity_bytes;
    if (!page_bytes)
        page_bytes = LADEN_VRAM_DEFAULT_PAGE;
    page_bytes = (page_bytes + g - 1) / g * g;
    laden_vram_t *c = calloc(1, sizeof *c);
    if (!c)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a VRAM "
                           "context");
    pthread_mutex_init(&c->mu, NULL);
    c->device = device;
    c->page = page_bytes;
    c->budget = budget;
    *out = c;
    return LADEN_OK;
}

static bool keep_spare(laden_vram_t *c, laden_phys_t ph)
{
    if (c->nspare == c->spare_cap) {
        uint32_t n = c->spare_cap ? c->spare_cap * 2 : 16;
        laden_phys_t *sp = realloc(c->spare, n * sizeof *sp);
        if (!sp)
            return false;
        c->spare = sp;
        c->spare_cap = n;
    }
    c->spare[c->nspare++] = ph;
    return true;
}

/* Gives spare pages back to the device until `bytes` are (or none are
 * left); returns the bytes given back. */
static uint64_t drop_spares(laden_vram_t *c, uint64_t bytes)
{
    uint64_t n = 0;
    while (n < bytes && c->nspare) {
        laden_dev_phys_release(c->device, c->spare[--c->nspare]);
        n += c->page;
    }
    return n;
}

/* Unmaps page i; its physical page is kept as a spare (keep) or given
 * back. */
static void unmap_page(laden_vbar_t *v, uint32_t i, bool keep)
{
    laden_vram_t *c = v->ctx;
    page *p = &v->pages[i];
    if (v->fenced) {
        laden_dev_event_synchronize(v->last_use);
        v->fenced = false;
    }
    laden_dev_unmap(c->device, v->va + (uint64_t)i * c->page, c->page);
    if (!keep || !keep_spare(c, p->phys))
        laden_dev_phys_release(c->device, p->phys);
    p->gen = 0;
    p->phys = 0;
    if (p->pins)
        v->pinned_pages--;
    p->pins = 0;
    v->mapped -= c->page;
    c->mapped -= c->page;
}

static void destroy_locked(laden_vbar_t *v)
{
    laden_vram_t *c = v->ctx;
    for (uint32_t i = 0; i < v->npages; i++)
        if (v->pages[i].gen)
            unmap_page(v, i, false);
    laden_dev_va_release(c->device, v->va, v->size);
    laden_dev_event_destroy(v->last_use);
    laden_dev_stream_destroy(v->wrapped);
    for (laden_vbar_t **pp = &c->vbars; *pp; pp = &(*pp)->next)
        if (*pp == v) {
            *pp = v->next;
            break;
        }
    c->st.vbars--;
    free(v->pages);
    free(v);
}

void laden_vram_destroy(laden_vram_t *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->mu);
    while (c->vbars)
        destroy_locked(c->vbars);
    drop_spares(c, UINT64_MAX);
    free(c->spare);
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

laden_status laden_vram_set_budget(laden_vram_t *c, uint64_t budget)
{
    if (!c)
        return laden__fail(LADEN_E_INVAL, "laden_vram_set_budget: NULL");
    pthread_mutex_lock(&c->mu);
    c->budget = budget;
    pthread_mutex_unlock(&c->mu);
    return LADEN_OK;
}

/* ---- eviction ------------------------------------------------------------ */

/* Whether a requester (NULL: anyone) may evict pages of v, and from
 * which page up: VBARs of lower priority whole, its own above `above`. */
static bool evicts_in(const laden_vbar_t *v, const laden_vbar_t *req,
                      uint32_t above, uint32_t *from)
{
    if (req && v != req && v->prio >= req->prio)
        return false;
    *from = v == req ? above + 1 : 0;
    return true;
}

/* Evictable bytes for a requester. */
static uint64_t evictable(laden_vram_t *c, laden_vbar_t *req, uint32_t above)
{
    uint64_t n = 0;
    uint32_t from;
    for (laden_vbar_t *v = c->vbars; v; v = v->next) {
        if (!evicts_in(v, req, above, &from))
            continue;
        for (uint32_t i = from; i < v->npages; i++)
            if (v->pages[i].gen && !v->pages[i].pins)
                n += c->page;
    }
    return n;
}

/* Evicts one page, the least important evictable for the requester:
 * of the lowest-priority VBAR with one (the requester's own pages above
 * the range last), its highest.  False if there is none. */
static bool evict_one(laden_vram_t *c, laden_vbar_t *req, uint32_t above,
                      bool keep)
{
    laden_vbar_t *best = NULL;
    uint32_t best_i = 0;
    uint64_t best_rank = 0;
    uint32_t from;
    for (laden_vbar_t *v = c->vbars; v; v = v->next) {
        uint64_t rank = v == req ? UINT64_MAX : v->prio;
        if (!evicts_in(v, req, above, &from) || (best && rank >= best_rank))
            continue;
        for (uint32_t i = v->npages; i-- > from;)
            if (v->pages[i].gen && !v->pages[i].pins) {
                best = v;
                best_i = i;
                best_rank = rank;
                break;
            }
    }
    if (!best)
        return false;
    unmap_page(best, best_i, keep);
    uint64_t wm = (uint64_t)best_i * c->page;
    if (wm < best->floor)
        wm = best->floor;
    if (wm < best->watermark)
        best->watermark = wm;
    c->st.evictions++;
    c->st.evicted_bytes += c->page;
    if (LADEN__TRACING())
        laden__trace_point(LADEN__EV_EVICT, 0, 0, c->page, 0,
                           "vbar page evicted");
    return true;
}

/* Makes `need` bytes fit the budget, if the evictable pages allow;
 * evicts nothing otherwise.  For pages (faults) spare pages count as room
 * and evicted pages become spares; for anything else spares are given
 * back first and evicted pages given back. */
static bool make_room(laden_vram_t *c, laden_vbar_t *req, uint32_t above,
                      uint64_t need, bool pages)
{
    if (!c->budget)
        return true;
    uint64_t spare = (uint64_t)c->nspare * c->page;
    uint64_t used = c->mapped + c->charged + spare;
    uint64_t room = (used < c->budget ? c->budget - used : 0) +
                    (pages ? spare : 0);
    if (need <= room)
        return true;
    if (!pages && spare) {
        room += drop_spares(c, need - room);
        if (need <= room)
            return true;
    }
    if (c->reclaim) {
        uint64_t got = c->reclaim(c->reclaim_arg, need - room);
        got = got < c->charged ? got : c->charged;
        c->charged -= got;
        room += got;
        if (need <= room)
            return true;
    }
    uint64_t over = need - room;
    if (need > c->budget || evictable(c, req, above) < over)
        return false;
    uint64_t freed = 0;
    while (freed < over && evict_one(c, req, above, pages))
        freed += c->page;
    return freed >= over;
}

laden_status laden_vram_free_memory(laden_vram_t *c, uint64_t bytes,
                                    uint64_t *out_freed)
{
    if (out_freed)
        *out_freed = 0;
    if (!c)
        return laden__fail(LADEN_E_INVAL, "laden_vram_free_memory: NULL");
    pthread_mutex_lock(&c->mu);
    uint64_t freed = drop_spares(c, bytes);
    while (freed < bytes && evict_one(c, NULL, 0, false))
        freed += c->page;
    pthread_mutex_unlock(&c->mu);
    if (out_freed)
        *out_freed = freed;
    return LADEN_OK;
}

laden_status laden_vram_make_room(laden_vram_t *c, uint64_t bytes)
{
    if (!c)
        return laden__fail(LADEN_E_INVAL, "laden_vram_make_room: NULL");
    pthread_mutex_lock(&c->mu);
    make_room(c, NULL, 0, bytes, true); /* best effort: faults decide */
    pthread_mutex_unlock(&c->mu);
    return LADEN_OK;
}

laden_status laden_vram_charge(laden_vram_t *c, uint64_t bytes)
{
    if (!c)
        return laden__fail(LADEN_E_INVAL, "laden_vram_charge: NULL");
    pthread_mutex_lock(&c->mu);
    laden_status s = LADEN_OK;
    if (!make_room(c, NULL, 0, bytes, false))
        s = laden__fail(LADEN_E_BUDGET,
                        "%s more do not fit the VRAM budget of %s: %s of "
                        "weights are mapped (%s of them pinned by running "
                        "work), %s charged",
                        laden__bytes(bytes).s, laden__bytes(c->budget).s,
                        laden__bytes(c->mapped).s,
                        laden__bytes(c->mapped - evictable(c, NULL, 0)).s,
                        laden__bytes(c->charged).s);
    else
        c->charged += bytes;
    pthread_mutex_unlock(&c->mu);
    return s;
}

laden_status laden_vram_uncharge(laden_vram_t *c, uint64_t bytes)
{
    if (!c)
        return laden__fail(LADEN_E_INVAL, "laden_vram_uncharge: NULL");
    pthread_mutex_lock(&c->mu);
    laden_status s = LADEN_OK;
    if (bytes > c->charged)
        s = laden__fail(LADEN_E_STATE, "uncharge of %s, but only %s are "
                        "charged", laden__bytes(bytes).s,
                        laden__bytes(c->charged).s);
    else
        c->charged -= bytes;
    pthread_mutex_unlock(&c->mu);
    return s;
}

laden_status laden_vram_info(laden_vram_t *c, laden_vram_info_t *out)
{
    if (!c || !out)
        return laden__fail(LADEN_E_INVAL, "laden_vram_info: NULL");
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    out->device = c->device;
    out->page_bytes = c->page;
    out->budget_bytes = c->budget;
    out->mapped_bytes = c->mapped;
    out->charged_bytes = c->charged;
    out->spare_bytes = (uint64_t)c->nspare * c->page;
    out->pinned_bytes = 0;
    for (laden_vbar_t *v = c->vbars; v; v = v->next)
        out->pinned_bytes += v->pinned_pages * c->page;
    pthread_mutex_unlock(&c->mu);
    return LADEN_OK;
}

/* ---- VBARs ------------------------------------------------------------------ */

laden_status laden_vbar_create(laden_vram_t *c, uint64_t size,
                               laden_vbar_t **out)
{
    laden_status s;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_create: out is NULL");
    *out = NULL;
    if (!c || size == 0)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_create: %s",
                           c ? "zero bytes" : "NULL context");
    uint64_t n = (size + c->page - 1) / c->page;
    if (n > UINT32_MAX)
        return laden__fail(LADEN_E_INVAL, "VBAR of %s: too many pages",
                           laden__bytes(size).s);
    laden_vbar_t *v = calloc(1, sizeof *v);
    page *pages = calloc(n, sizeof *pages);
    if (!v || !pages) {
        free(v);
        free(pages);
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a VBAR");
    }
    v->ctx = c;
    v->npages = (uint32_t)n;
    v->size = n * c->page;
    v->pages = pages;
    v->watermark = v->size;
    if ((s = laden_dev_va_reserve(c->device, v->size, &v->va))) {
        free(pages);
        free(v);
        laden__error_prefix("VBAR of %s", laden__bytes(size).s);
        return s;
    }
    pthread_mutex_lock(&c->mu);
    v->prio = ++c->clock;
    v->next = c->vbars;
    c->vbars = v;
    c->st.vbars++;
    pthread_mutex_unlock(&c->mu);
    *out = v;
    return LADEN_OK;
}

void laden_vbar_destroy(laden_vbar_t *v)
{
    if (!v)
        return;
    laden_vram_t *c = v->ctx;
    pthread_mutex_lock(&c->mu);
    destroy_locked(v);
    pthread_mutex_unlock(&c->mu);
}

laden_status laden_vbar_alloc(laden_vbar_t *v, uint64_t size, uint64_t *out)
{
    if (out)
        *out = 0;
    if (!v || !out)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_alloc: NULL");
    pthread_mutex_lock(&v->ctx->mu);
    uint64_t off = (v->used + 255) & ~(uint64_t)255;
    laden_status s = LADEN_OK;
    if (off > v->size || size > v->size - off)
        s = laden__fail(LADEN_E_BUDGET,
                        "VBAR of %s: %s more do not fit (%s handed out)",
                        laden__bytes(v->size).s, laden__bytes(size).s,
                        laden__bytes(v->used).s);
    else {
        v->used = off + size;
        *out = off;
    }
    pthread_mutex_unlock(&v->ctx->mu);
    return s;
}

static laden_status range_arg(laden_vbar_t *v, uint64_t off, uint64_t size,
                              const char *call)
{
    if (!v)
        return laden__fail(LADEN_E_INVAL, "%s: NULL VBAR", call);
    if (off > v->size || size > v->size - off)
        return laden__fail(LADEN_E_INVAL,
                           "%s: [%llu, +%llu) is outside the VBAR of %llu "
                           "bytes",
                           call, (unsigned long long)off,
                           (unsigned long long)size,
                           (unsigned long long)v->size);
    return LADEN_OK;
}

/* Maps page i; *oom if the device has no memory for it. */
static laden_status map_page(laden_vbar_t *v, uint32_t i, bool *oom)
{
    laden_vram_t *c = v->ctx;
    laden_phys_t ph = 0;
    bool spare = c->nspare > 0;
    laden_status s = LADEN_OK;
    if (spare)
        ph = c->spare[--c->nspare];
    else
        s = laden_dev_phys_create(c->device, c->page, &ph);
    if (!s && (s = laden_dev_map(c->device, v->va + (uint64_t)i * c->page,
                                 c->page, ph))) {
        if (spare)
            c->nspare++; /* still there */
        else
            laden_dev_phys_release(c->device, ph);
    }
    *oom = s == LADEN_E_DEVICE_NOMEM;
    if (s)
        return s;
    v->pages[i].phys = ph;
    v->pages[i].gen = ++c->gen;
    v->mapped += c->page;
    c->mapped += c->page;
    c->st.maps++;
    if (LADEN__TRACING())
        laden__trace_point(LADEN__EV_FAULT, 0, 0, c->page, 0,
                           "vbar page mapped");
    return LADEN_OK;
}

laden_status laden_vbar_fault(laden_vbar_t *v, uint64_t off, uint64_t size,
                              int *out_resident, uint64_t *out_sig)
{
    if (out_resident)
        *out_resident = 0;
    if (out_sig)
        *out_sig = 0;
    laden_status s = range_arg(v, off, size, "laden_vbar_fault");
    if (s)
        return s;
    if (!out_resident || !out_sig)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_fault: NULL output");
    if (size == 0) {
        *out_resident = 1;
        return LADEN_OK;
    }
    laden_vram_t *c = v->ctx;
    uint32_t p0 = (uint32_t)(off / c->page);
    uint32_t p1 = (uint32_t)((off + size - 1) / c->page);
    pthread_mutex_lock(&c->mu);
    uint32_t missing = 0;
    for (uint32_t i = p0; i <= p1; i++)
        missing += v->pages[i].gen == 0;
    if (missing && off >= v->watermark) {
        c->st.offloaded++;
        c->st.fail_fast++;
        goto offloaded;
    }
    if (missing && !make_room(c, v, p1, (uint64_t)missing * c->page, true)) {
        c->st.offloaded++;
        goto offloaded;
    }
    for (uint32_t i = p0; i <= p1; i++) {
        if (v->pages[i].gen)
            continue;
        bool oom;
        s = map_page(v, i, &oom);
        if (s && oom && evict_one(c, v, p1, true)) { /* the device is fuller */
            laden__error_clear();              /* than the budget says */
            s = map_page(v, i, &oom);
        }
        if (s && oom) {
            laden__error_clear();
            c->st.offloaded++;
            goto offloaded; /* the pages mapped stay, unpinned */
        }
        if (s)
            goto out;
    }
    uint64_t sig = 0;
    for (uint32_t i = p0; i <= p1; i++) {
        if (v->pages[i].pins++ == 0)
            v->pinned_pages++;
        if (v->pages[i].gen > sig)
            sig = v->pages[i].gen;
    }
    c->st.faults++;
    *out_resident = 1;
    *out_sig = sig;
    s = LADEN_OK;
    goto out;
offloaded:
    s = LADEN_OK;
out:
    pthread_mutex_unlock(&c->mu);
    return s;
}

static laden_status unpin(laden_vbar_t *v, uint64_t off, uint64_t size,
                          bool after, uintptr_t stream);

laden_status laden_vbar_unpin(laden_vbar_t *v, uint64_t off, uint64_t size)
{
    return unpin(v, off, size, false, 0);
}

/* Records the VBAR's last use on stream `handle` (0: the legacy default
 * stream; CUDA only). */
static laden_status fence(laden_vbar_t *v, uintptr_t handle)
{
    laden_vram_t *c = v->ctx;
    laden_status s;
    if (c->device == LADEN_DEVICE_CPU)
        return LADEN_OK;
    if (!v->last_use &&
        (s = laden_dev_event_create(c->device, 0, &v->last_use)))
        return s;
    if (!v->wrapped || v->wrapped_handle != handle) {
        laden_dev_stream_destroy(v->wrapped);
        v->wrapped = NULL;
        if ((s = laden_dev_stream_wrap(c->device, handle, &v->wrapped)))
            return s;
        v->wrapped_handle = handle;
    }
    if ((s = laden_dev_event_record(v->last_use, v->wrapped)))
        return s;
    v->fenced = true;
    return LADEN_OK;
}

laden_status laden_vbar_unpin_after(laden_vbar_t *v, uint64_t off,
                                    uint64_t size, uintptr_t stream)
{
    return unpin(v, off, size, true, stream);
}

static laden_status unpin(laden_vbar_t *v, uint64_t off, uint64_t size,
                          bool after, uintptr_t stream)
{
    laden_status s = range_arg(v, off, size, "laden_vbar_unpin");
    if (s || size == 0)
        return s;
    laden_vram_t *c = v->ctx;
    uint32_t p0 = (uint32_t)(off / c->page);
    uint32_t p1 = (uint32_t)((off + size - 1) / c->page);
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = p0; i <= p1 && !s; i++)
        if (!v->pages[i].pins)
            s = laden__fail(LADEN_E_STATE,
                            "laden_vbar_unpin: [%llu, +%llu) is not pinned "
                            "(page %u)",
                            (unsigned long long)off, (unsigned long long)size,
                            i);
    if (!s && after)
        s = fence(v, stream);
    for (uint32_t i = p0; i <= p1 && !s; i++)
        if (--v->pages[i].pins == 0)
            v->pinned_pages--;
    pthread_mutex_unlock(&c->mu);
    return s;
}

laden_status laden_vbar_prioritize(laden_vbar_t *v)
{
    if (!v)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_prioritize: NULL");
    pthread_mutex_lock(&v->ctx->mu);
    v->prio = ++v->ctx->clock;
    v->watermark = v->size;
    pthread_mutex_unlock(&v->ctx->mu);
    return LADEN_OK;
}

laden_status laden_vbar_deprioritize(laden_vbar_t *v)
{
    if (!v)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_deprioritize: NULL");
    pthread_mutex_lock(&v->ctx->mu);
    v->prio = 0;
    pthread_mutex_unlock(&v->ctx->mu);
    return LADEN_OK;
}

laden_status laden_vbar_set_floor(laden_vbar_t *v, uint64_t off)
{
    if (!v || off > v->size)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_set_floor: %s",
                           v ? "offset beyond the VBAR" : "NULL");
    pthread_mutex_lock(&v->ctx->mu);
    v->floor = off;
    if (v->watermark < off)
        v->watermark = off;
    pthread_mutex_unlock(&v->ctx->mu);
    return LADEN_OK;
}

laden_status laden_vbar_info(laden_vbar_t *v, laden_vbar_info_t *out)
{
    if (!v || !out)
        return laden__fail(LADEN_E_INVAL, "laden_vbar_info: NULL");
    pthread_mutex_lock(&v->ctx->mu);
    out->base = v->va;
    out->size_bytes = v->size;
    out->used_bytes = v->used;
    out->mapped_bytes = v->mapped;
    out->pinned_bytes = v->pinned_pages * v->ctx->page;
    out->watermark = v->watermark;
    out->floor = v->floor;
    out->priority = v->prio;
    pthread_mutex_unlock(&v->ctx->mu);
    return LADEN_OK;
}

laden_status laden_vbar_residency(laden_vbar_t *v, uint8_t *out, uint32_t n,
                                  uint32_t *out_n)
{
    if (!v || !out_n || (n && !out))
        return laden__fail(LADEN_E_INVAL, "laden_vbar_residency: NULL");
    pthread_mutex_lock(&v->ctx->mu);
    *out_n = v->npages;
    for (uint32_t i = 0; i < n && i < v->npages; i++)
        out[i] = !v->pages[i].gen ? 0 : v->pages[i].pins ? 2 : 1;
    pthread_mutex_unlock(&v->ctx->mu);
    return LADEN_OK;
}
