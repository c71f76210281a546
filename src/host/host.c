/* Pinned host arena.  See include/laden/host.h.  Blocks live on one list;
 * the arena holds few, large blocks (block regions of a model, staging
 * buffers), so linear search is cheaper than any index, and none of this is
 * on the per-block hot path. */
#include "laden/host.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "laden/dev.h"

#define ROUND (64u << 10)

typedef struct block {
    struct block *next;
    void *ptr;
    uint64_t size;
    bool in_use;
} block;

struct laden_host {
    pthread_mutex_t mu;
    int32_t device;
    uint64_t budget;
    block *blocks;
    laden_host_stats_t st;
};

laden_status laden_host_create(int32_t device, uint64_t budget,
                               laden_host_t **out)
{
    laden_dev_info_t info;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_host_create: out is NULL");
    *out = NULL;
    laden_status s = laden_dev_info(device, &info);
    if (s)
        return s;
    laden_host_t *h = calloc(1, sizeof *h);
    if (!h)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating an arena");
    pthread_mutex_init(&h->mu, NULL);
    h->device = device;
    h->budget = budget;
    h->st.budget_bytes = budget;
    *out = h;
    return LADEN_OK;
}

static void unpin(laden_host_t *h, block **link)
{
    block *b = *link;
    *link = b->next;
    laden_dev_host_free(h->device, b->ptr);
    h->st.cached_bytes -= b->size;
    h->st.unpins++;
    free(b);
}

/* Unpins cached blocks, largest first, until `need` more bytes fit. */
static void make_room(laden_host_t *h, uint64_t need)
{
    while (h->budget &&
           h->st.in_use_bytes + h->st.cached_bytes + need > h->budget) {
        block **best = NULL;
        for (block **l = &h->blocks; *l; l = &(*l)->next)
            if (!(*l)->in_use && (!best || (*l)->size > (*best)->size))
                best = l;
        if (!best)
            return;
        unpin(h, best);
    }
}

void laden_host_destroy(laden_host_t *h)
{
    if (!h)
        return;
    while (h->blocks) {
        block *b = h->blocks;
        h->blocks = b->next;
        laden_dev_host_free(h->device, b->ptr);
        free(b);
    }
    pthread_mutex_destroy(&h->mu);
    free(h);
}

laden_status laden_host_alloc(laden_host_t *h, uint64_t size, void **out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_host_alloc: out is NULL");
    *out = NULL;
    if (!h || size == 0)
        return laden__fail(LADEN_E_INVAL,
                           "laden_host_alloc: NULL arena or zero bytes");
    uint64_t rounded;
    if (!laden__add_u64(size, ROUND - 1, &rounded))
        return laden__fail(LADEN_E_INVAL, "laden_host_alloc: size overflows");
    rounded &= ~(uint64_t)(ROUND - 1);
    laden_status s = LADEN_OK;
    pthread_mutex_lock(&h->mu);
    block *best = NULL;
    for (block *b = h->blocks; b; b = b->next)
        if (!b->in_use && b->size >= rounded && b->size / 2 <= rounded &&
            (!best || b->size < best->size))
            best = b;
    if (best) {
        best->in_use = true;
        h->st.cached_bytes -= best->size;
        h->st.in_use_bytes += best->size;
        h->st.allocs++;
        h->st.reuses++;
        *out = best->ptr;
        goto done;
    }
    if (h->budget && h->st.in_use_bytes + rounded > h->budget) {
        s = laden__fail(LADEN_E_BUDGET,
                        "pinned budget of %s exceeded: %s in use, "
                        "%s more asked",
                        laden__bytes(h->budget).s,
                        laden__bytes(h->st.in_use_bytes).s,
                        laden__bytes(rounded).s);
        goto done;
    }
    make_room(h, rounded);
    block *b = calloc(1, sizeof *b);
    if (!b) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory tracking a block");
        goto done;
    }
    if ((s = laden_dev_host_alloc(h->device, rounded, &b->ptr))) {
        free(b);
        goto done;
    }
    b->size = rounded;
    b->in_use = true;
    b->next = h->blocks;
    h->blocks = b;
    h->st.in_use_bytes += rounded;
    h->st.allocs++;
    h->st.pins++;
    *out = b->ptr;
done:
    if (h->st.in_use_bytes + h->st.cached_bytes > h->st.peak_bytes)
        h->st.peak_bytes = h->st.in_use_bytes + h->st.cached_bytes;
    pthread_mutex_unlock(&h->mu);
    return s;
}

laden_status laden_host_free(laden_host_t *h, void *ptr)
{
    if (!h)
        return laden__fail(LADEN_E_INVAL, "laden_host_free: NULL arena");
    if (!ptr)
        return LADEN_OK;
    laden_status s = LADEN_OK;
    pthread_mutex_lock(&h->mu);
    block *b = h->blocks;
    while (b && b->ptr != ptr)
        b = b->next;
    if (!b || !b->in_use) {
        s = laden__fail(LADEN_E_INVAL,
                        "laden_host_free: %p is not a block in use from this "
                        "arena",
                        ptr);
    } else {
        b->in_use = false;
        h->st.in_use_bytes -= b->size;
        h->st.cached_bytes += b->size;
        make_room(h, 0);
    }
    pthread_mutex_unlock(&h->mu);
    return s;
}

uint64_t laden_host_block_size(laden_host_t *h, const void *ptr)
{
    uint64_t n = 0;
    if (!h)
        return 0;
    pthread_mutex_lock(&h->mu);
    for (block *b = h->blocks; b; b = b->next)
        if (b->ptr == ptr && b->in_use)
            n = b->size;
    pthread_mutex_unlock(&h->mu);
    return n;
}

void laden_host_trim(laden_host_t *h)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    block **l = &h->blocks;
    while (*l) {
        if ((*l)->in_use)
            l = &(*l)->next;
        else
            unpin(h, l);
    }
    pthread_mutex_unlock(&h->mu);
}

laden_status laden_host_set_budget(laden_host_t *h, uint64_t budget)
{
    if (!h)
        return laden__fail(LADEN_E_INVAL, "laden_host_set_budget: NULL arena");
    pthread_mutex_lock(&h->mu);
    h->budget = budget;
    h->st.budget_bytes = budget;
    make_room(h, 0);
    pthread_mutex_unlock(&h->mu);
    return LADEN_OK;
}

laden_status laden_host_stats(laden_host_t *h, laden_host_stats_t *out)
{
    if (!h || !out)
        return laden__fail(LADEN_E_INVAL, "laden_host_stats: NULL argument");
    pthread_mutex_lock(&h->mu);
    *out = h->st;
    pthread_mutex_unlock(&h->mu);
    return LADEN_OK;
}

laden_status laden_host_measure_memcpy(uint64_t size, double *out)
{
    if (out)
        *out = 0;
    if (!out || size < 4096)
        return laden__fail(LADEN_E_INVAL, "measure_memcpy: bad argument");
    char *a = malloc(size), *b = malloc(size);
    if (!a || !b) {
        free(a);
        free(b);
        return laden__fail(LADEN_E_NOMEM, "measure_memcpy: out of memory");
    }
    memset(a, 1, size);
    memset(b, 2, size);
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < 5; i++) {
        uint64_t t0 = laden__now_ns();
        memcpy(b, a, size);
        uint64_t t1 = laden__now_ns();
        if (t1 - t0 < best)
            best = t1 - t0;
        a[i] = b[size - 1 - (uint64_t)i]; /* keep the copies observable */
    }
    *out = (double)size / ((double)(best ? best : 1) * 1e-9);
    free(a);
    free(b);
    return LADEN_OK;
}
