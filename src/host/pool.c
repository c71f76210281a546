/* The process's pool of pinned host memory, per device: a model released
 * and loaded again in one process (ComfyUI switching workflows) takes the
 * pinned mappings its last load left instead of pinning new pages, which
 * costs about as much as reading them from the page cache.  Off unless the
 * user gives the pool bytes (laden_pinned_pool_set): by default release
 * gives every byte back.  Mappings are matched by length, exactly (a model
 * loaded again has the same blocks); the oldest go first when the budget
 * is lowered or a mapping does not fit. */
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../core/internal.h"
#include "laden/dev.h"
#include "laden/host.h"

#define DEVICES 64

typedef struct entry {
    struct entry *next; /* newest first */
    void *p;
    uint64_t len;
} entry;

typedef struct pool {
    uint64_t budget, held, reused, kept, freed;
    entry *head;
} pool;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pool pools[DEVICES];

static pool *pool_of(int32_t device)
{
    return device >= 0 && device < DEVICES ? &pools[device] : NULL;
}

static void free_entry(int32_t device, entry *e)
{
    laden_dev_host_unregister(device, e->p);
    munmap(e->p, (size_t)e->len);
    free(e);
}

/* Frees the oldest mappings until held + need fits the budget.  mu held. */
static void make_room(int32_t device, pool *pl, uint64_t need)
{
    while (pl->head && pl->held + need > pl->budget) {
        entry **last = &pl->head;
        while ((*last)->next)
            last = &(*last)->next;
        entry *e = *last;
        *last = NULL;
        pl->held -= e->len;
        pl->freed += e->len;
        free_entry(device, e);
    }
}

laden_status laden_pinned_pool_set(int32_t device, uint64_t bytes)
{
    pool *pl = pool_of(device);
    if (!pl)
        return laden__fail(LADEN_E_INVAL, "laden_pinned_pool_set: device "
                           "%d: a CUDA device index (the CPU device pins "
                           "nothing)", device);
    pthread_mutex_lock(&mu);
    pl->budget = bytes;
    make_room(device, pl, 0);
    pthread_mutex_unlock(&mu);
    return LADEN_OK;
}

laden_status laden_pinned_pool_stats(int32_t device,
                                     laden_pinned_pool_stats_t *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    pool *pl = pool_of(device);
    if (!pl || !out)
        return laden__fail(LADEN_E_INVAL, "laden_pinned_pool_stats: bad "
                           "device %d or NULL", device);
    pthread_mutex_lock(&mu);
    out->budget_bytes = pl->budget;
    out->held_bytes = pl->held;
    out->reused_bytes = pl->reused;
    out->kept_bytes = pl->kept;
    out->freed_bytes = pl->freed;
    pthread_mutex_unlock(&mu);
    return LADEN_OK;
}

bool laden__pool_take(int32_t device, uint64_t len, void **out)
{
    pool *pl = pool_of(device);
    *out = NULL;
    if (!pl)
        return false;
    pthread_mutex_lock(&mu);
    for (entry **at = &pl->head; *at; at = &(*at)->next)
        if ((*at)->len == len) {
            entry *e = *at;
            *at = e->next;
            pl->held -= len;
            pl->reused += len;
            *out = e->p;
            free(e);
            break;
        }
    pthread_mutex_unlock(&mu);
    return *out != NULL;
}

bool laden__pool_keep(int32_t device, void *p, uint64_t len)
{
    pool *pl = pool_of(device);
    if (!pl || !p || !len)
        return false;
    entry *e = malloc(sizeof *e);
    if (!e)
        return false;
    pthread_mutex_lock(&mu);
    bool keep = len <= pl->budget;
    if (keep) {
        make_room(device, pl, len);
        *e = (entry){pl->head, p, len};
        pl->head = e;
        pl->held += len;
        pl->kept += len;
    }
    pthread_mutex_unlock(&mu);
    if (!keep)
        free(e);
    return keep;
}
