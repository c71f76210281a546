/* The cache's state, shared by its decisions (cache.c) and the engine that
 * carries them out on the models' schedules (engine.c). */
#ifndef LADEN_CACHE_INTERNAL_H
#define LADEN_CACHE_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "laden/cache.h"

/* The default VRAM budget from a reading of free device memory (the
 * pure half of laden_cache_default_budget, for tests). */
uint64_t laden__cache_budget_from_free(uint64_t free_bytes);

typedef struct model {
    char *key; /* NULL once removed */
    uint64_t size, vram, pinned, uses, last_use;
    uint64_t dev_size; /* its device copies' bytes (size: its host copy's;
                          more with lossless tensors, decoded there) */
    bool in_use;
    laden_sched_t *sched; /* bound schedule (borrowed), or NULL */
    uint32_t fixed;       /* its first `fixed` blocks run without hooks */
    int32_t device;       /* the schedule's */
    uint64_t hits;        /* activations that copied nothing */
    bool keep_host;       /* its host copy is the only copy of its
                             weights: the host policy never drops it */
} model;

/* The caches of one host's devices (laden_cache_join): one pinned budget
 * and one clock of uses for all of them, so that pinned memory and the RAM
 * budget are the host's and recency compares across devices.  A cache
 * alone is a group of one.  `mu` guards the membership; everything else
 * is used under the caller's one lock, as a cache is. */
/* A host copy held for the group's models beside their own (an adapter
 * as read): an entry of the host policy (host.c).  A free slot has
 * `live` false; its id is used again. */
typedef struct host_entry {
    uint64_t bytes, last_use;
    bool live;
} host_entry;

typedef struct cache_group {
    pthread_mutex_t mu;
    laden_cache_t *first; /* members linked through laden_cache.next */
    uint32_t members;
    uint64_t pinned_budget;
    uint64_t clock;
    host_entry *e; /* the host entries' slots, e[0..ne) */
    uint32_t ne, ecap;
    uint32_t nlive;  /* live entries */
    uint64_t ebytes; /* their bytes */
} cache_group;

struct laden_cache {
    model *m;
    uint32_t n, cap;
    uint64_t vram_budget;
    uint64_t vram, pinned; /* totals, this cache's */
    cache_group *g;
    laden_cache_t *next; /* in g */
    int32_t device;      /* of its first bound schedule, */
    bool bound_once;     /* once there was one */
    laden_cache_stats_t st;
};

/* Pinned bytes held by every cache of c's group. */
uint64_t laden__cache_group_pinned(const laden_cache_t *c);

/* An idle model (model `id` of cache `c`, the `order`th of its group's
 * list) that may give way; sorted least recently used first (ties: the
 * cache earlier in the group, then the lower id) by laden__cmp_cand. */
typedef struct cand {
    uint64_t last_use;
    laden_cache_t *c;
    uint32_t order, id;
} cand;
int laden__cmp_cand(const void *a, const void *b);

/* The models' part of the host policy (laden_cache_plan_host_group, whose
 * arguments are checked): whole idle bound models of c's group but
 * `except` of c, least recently used first, so that `need` more fit
 * `budget` with the bound models' host copies. */
laden_status laden__cache_plan_models(laden_cache_t *c, uint32_t except,
                                      uint64_t budget, uint64_t need,
                                      laden_cache_host_evict_t *ev,
                                      uint32_t cap, uint32_t *out_n);
/* Host bytes of the bound models of c's group (their sizes). */
uint64_t laden__cache_group_host(laden_cache_t *c);

#endif
