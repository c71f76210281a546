/* The cache's state, shared by its decisions (cache.c) and the engine that
 * carries them out on the models' schedules (engine.c). */
#ifndef LADEN_CACHE_INTERNAL_H
#define LADEN_CACHE_INTERNAL_H

#include <stdbool.h>

#include "laden/cache.h"

typedef struct model {
    char *key; /* NULL once removed */
    uint64_t size, vram, pinned, uses, last_use;
    bool in_use;
    laden_sched_t *sched; /* bound schedule (borrowed), or NULL */
    uint32_t fixed;       /* its first `fixed` blocks run without hooks */
    int32_t device;       /* the schedule's */
    uint64_t hits;        /* activations that copied nothing */
} model;

struct laden_cache {
    model *m;
    uint32_t n, cap;
    uint64_t vram_budget, pinned_budget;
    uint64_t vram, pinned; /* totals */
    uint64_t clock;
    laden_cache_stats_t st;
};

/* An idle model that may give way; sorted least recently used first
 * (ties: lower id) by laden__cmp_cand. */
typedef struct cand {
    uint64_t last_use;
    uint32_t id;
} cand;
int laden__cmp_cand(const void *a, const void *b);

#endif
