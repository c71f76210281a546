/* cache: the decisions of a cache of models kept ready between uses.
 *
 * Models are registered by key with their size.  For each the cache tracks
 * the bytes it holds on the device and in pinned host memory, whether it is
 * in use, how often and how recently it was used.  When a model is
 * activated and needs device bytes, the cache decides which idle models
 * give them up: least recently used first, and only as much of the last
 * one as is needed (a partly resident model keeps the rest).  Pinned host
 * copies are decided the same way against their own budget.  A model in use
 * is never asked to give anything up.
 *
 * The cache only decides and accounts: the caller moves the bytes (frees a
 * model's device copy, unpins a host copy) and reports what each model now
 * holds with laden_cache_set_vram / laden_cache_set_pinned.  Budgets are
 * never exceeded by what the cache grants.  Not thread-safe: one cache is
 * used from one thread at a time (the caller's lock).
 *
 * The engine (laden_cache_bind and below) carries the decisions out itself
 * for models bound to a LADEN_SCHED_CACHE schedule: it gives blocks device
 * copies or takes them away, pins and unpins host copies, starts and stops
 * the slots of streamed blocks, and keeps the accounting equal to what the
 * schedules hold. */
#ifndef LADEN_CACHE_H
#define LADEN_CACHE_H

#include "../laden.h"
#include "stream.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_cache laden_cache_t;

/* One decision: model `model` should keep `keep_bytes` and give up
 * `drop_bytes` (of device memory, or of pinned memory for the pin calls). */
typedef struct laden_cache_evict {
    uint32_t model;
    uint64_t drop_bytes;
    uint64_t keep_bytes;
} laden_cache_evict_t;

typedef struct laden_cache_info {
    uint64_t size_bytes;   /* the model's weights */
    uint64_t vram_bytes;   /* held on the device */
    uint64_t pinned_bytes; /* held in pinned host memory */
    uint64_t uses;
    uint64_t last_use;     /* a counter: larger is more recent; 0 never */
    int32_t in_use;
} laden_cache_info_t;

typedef struct laden_cache_stats {
    uint64_t vram_budget_bytes, pinned_budget_bytes; /* 0: no limit; the
                                                        pinned one is the
                                                        group's */
    uint64_t vram_bytes, pinned_bytes;               /* held, all models
                                                        of this cache */
    uint32_t models, in_use;
    uint64_t acquires, evictions, evicted_bytes;
    /* Engine (bound models): */
    uint64_t hits;           /* activations that copied nothing */
    uint64_t upload_bytes;   /* copied to the device by activations */
    uint64_t pin_bytes;      /* host bytes pinned in place */
    uint64_t unpin_bytes;    /* host bytes unpinned to make room */
} laden_cache_stats_t;

/* Budgets of 0 mean no limit.  A cache is the cache of one device: its
 * VRAM budget is that device's. */
LADEN_API laden_status laden_cache_create(uint64_t vram_budget_bytes,
                                          uint64_t pinned_budget_bytes,
                                          laden_cache_t **out);
/* VRAM kept free for activations by a cache's default VRAM budget:
 * 1.5 GiB. */
#define LADEN_CACHE_HEADROOM_DEFAULT (1536ull << 20)

/* The VRAM budget for a cache of `device` when the caller gives none: a
 * VRAM context's budget if it has one (context_budget_bytes; 0: no
 * context, or one without a budget); else on a CUDA device its free
 * memory now less LADEN_CACHE_HEADROOM_DEFAULT, at least 1 byte (0 would
 * mean no limit); on LADEN_DEVICE_CPU 0, no limit. */
LADEN_API laden_status laden_cache_default_budget(
    int32_t device, uint64_t context_budget_bytes, uint64_t *out_bytes);
/* Leaves the cache's group, if any, and frees it. */
LADEN_API void laden_cache_destroy(laden_cache_t *cache);

/* Makes `cache` one of the group of `peer`: the caches of one host's
 * devices, which share the host's memory.  The group has one pinned
 * budget (the caches' own must be equal: LADEN_E_INVAL otherwise), so
 * that what every cache pins counts against it and the engine
 * (laden_cache_activate) unpins idle models of any cache of the group for
 * a model being pinned; one clock of uses, so that "least recently used"
 * compares models across devices; and laden_cache_plan_host_group decides
 * over all of them.  VRAM budgets stay each cache's own.  Join before
 * adding models (LADEN_E_STATE otherwise, or if `cache` is in a group
 * already).  Every call on any cache of a group is made under one lock of
 * the caller's, as for one cache: decisions read, and the engine changes,
 * the other caches' models.  Only membership has a lock of its own, so
 * that caches of a group may be destroyed from different threads; a
 * destroyed cache leaves its group. */
LADEN_API laden_status laden_cache_join(laden_cache_t *cache,
                                        laden_cache_t *peer);

/* Registers a model; *out_model is its id.  LADEN_E_STATE if the key is
 * registered already.  Keys are copied. */
LADEN_API laden_status laden_cache_add(laden_cache_t *cache, const char *key,
                                       uint64_t size_bytes,
                                       uint32_t *out_model);
/* Forgets a model, which must hold nothing and not be in use
 * (LADEN_E_STATE otherwise, naming what it still holds). */
LADEN_API laden_status laden_cache_remove(laden_cache_t *cache, uint32_t model);
/* LADEN_E_NOTFOUND if no model has the key. */
LADEN_API laden_status laden_cache_find(laden_cache_t *cache, const char *key,
                                        uint32_t *out_model);
LADEN_API const char *laden_cache_key(laden_cache_t *cache, uint32_t model);

/* Activates `model`, which will hold `want_bytes` on the device (its size
 * for a whole-model upload, less when it streams).  Decides the evictions
 * that make room (ev[0..*out_n), at most `cap`), marks the model in use and
 * counts a use.  LADEN_E_STATE if it is in use already; LADEN_E_BUDGET,
 * with nothing changed, if even evicting every idle model would not make
 * room (the message says how much would); LADEN_E_INVAL if `cap` is too
 * small for the decisions (nothing changed). */
LADEN_API laden_status laden_cache_acquire(laden_cache_t *cache, uint32_t model,
                                           uint64_t want_bytes,
                                           laden_cache_evict_t *ev,
                                           uint32_t cap, uint32_t *out_n);

/* Ends a use: the model becomes idle and most recently used. */
LADEN_API laden_status laden_cache_release(laden_cache_t *cache,
                                           uint32_t model);

/* Frees at least `bytes` of device memory from idle models, least recently
 * used first; fewer if the idle models hold less.  Decisions as for
 * acquire. */
LADEN_API laden_status laden_cache_evict_bytes(laden_cache_t *cache,
                                               uint64_t bytes,
                                               laden_cache_evict_t *ev,
                                               uint32_t cap, uint32_t *out_n);

/* Decides which idle models' pinned copies give way so that `model` can
 * pin `want_bytes`; LADEN_E_BUDGET if they cannot (the caller then keeps
 * the model pageable or file-backed).  The decisions are among this
 * cache's models; in a group the other caches' pinned bytes count against
 * the group's budget (the engine also takes from their idle models). */
LADEN_API laden_status laden_cache_plan_pin(laden_cache_t *cache,
                                            uint32_t model, uint64_t want_bytes,
                                            laden_cache_evict_t *ev,
                                            uint32_t cap, uint32_t *out_n);

/* What a model holds now, after the caller moved bytes.  LADEN_E_BUDGET if
 * the total would exceed the budget (nothing changed). */
LADEN_API laden_status laden_cache_set_vram(laden_cache_t *cache,
                                            uint32_t model, uint64_t bytes);
LADEN_API laden_status laden_cache_set_pinned(laden_cache_t *cache,
                                              uint32_t model, uint64_t bytes);

LADEN_API laden_status laden_cache_info(laden_cache_t *cache, uint32_t model,
                                        laden_cache_info_t *out);
/* Whether `model`'s host copy is the only copy of its weights (keep 1: a
 * trainable model, whose host copy an optimizer changed): the host policy
 * (laden_cache_plan_host_group, laden_cache_plan_host) then never chooses
 * it, so that no update is lost to a rebuild from its checkpoint.  Its
 * device copies and pinning give way as any idle model's. */
LADEN_API laden_status laden_cache_keep_host(laden_cache_t *cache,
                                             uint32_t model, int keep);
/* Where a new model goes among the caches of several devices: the index
 * (into caches[0..n)) of the one with the most room left in its VRAM
 * budget, its budget less what it holds; ties go to the first.
 * LADEN_E_INVAL for n == 0 or a NULL cache. */
LADEN_API laden_status laden_cache_roomiest(laden_cache_t *const *caches,
                                            uint32_t n, uint32_t *out_index);

LADEN_API laden_status laden_cache_stats(laden_cache_t *cache,
                                         laden_cache_stats_t *out);

/* ---- the engine ---------------------------------------------------------- */

typedef enum laden_cache_mode {
    LADEN_CACHE_AUTO = 0,      /* whole model if it fits, else streaming */
    LADEN_CACHE_RESIDENT = 1,  /* every block on the device */
    LADEN_CACHE_STREAMING = 2, /* what fits resident, the rest streamed */
} laden_cache_mode;

/* What one activation did. */
typedef struct laden_cache_activation {
    int32_t mode;              /* RESIDENT or STREAMING, as chosen */
    uint32_t resident_blocks;  /* blocks with a device copy */
    uint32_t streamed_blocks;  /* blocks streamed through slots */
    uint32_t evicted_models;   /* idle models that gave up device memory */
    uint64_t upload_bytes;     /* copied to the device now */
    uint64_t kept_bytes;       /* already on the device: not copied */
    uint64_t reused_bytes;     /* of upload_bytes, copied into device memory
                                  handed over from evicted blocks (no free
                                  and allocation) */
    uint64_t slot_bytes;       /* device memory of the slots */
    uint64_t evicted_bytes;    /* device memory taken from idle models */
    uint64_t pinned_bytes;     /* host bytes of this model pinned now */
    uint64_t unpinned_bytes;   /* pinned host bytes taken from idle models */
    int32_t pin_failed;        /* pinning failed: the copy stays pageable */
    uint32_t offloaded_blocks; /* VBAR schedules: blocks meant resident
                                  that the VRAM budget had no room for;
                                  they stream */
} laden_cache_activation_t;

/* Binds `model` to its schedule (a loaded LADEN_SCHED_CACHE schedule,
 * borrowed until laden_cache_unbind).  Its first `fixed_blocks` blocks are
 * the parts of the model that run without a block hook: they are on the
 * device whenever the model is in use.  The model's size becomes the sum of
 * its blocks.  LADEN_E_INVAL for a schedule of another device than the
 * cache's bound models: a cache is one device's. */
LADEN_API laden_status laden_cache_bind(laden_cache_t *cache, uint32_t model,
                                        laden_sched_t *sched,
                                        uint32_t fixed_blocks);

/* Drops whatever the model holds on the device and in pinned memory and
 * unbinds its schedule (which the caller may then destroy).
 * LADEN_E_STATE if it is in use. */
LADEN_API laden_status laden_cache_unbind(laden_cache_t *cache,
                                          uint32_t model);

/* Activates a bound model for use on compute_stream: decides resident or
 * streaming (mode), which blocks get device copies (the planner, within
 * what the budget leaves after the models in use), takes room from idle
 * models least recently used first (ev[0..*out_n) says which, as
 * laden_cache_acquire), pins its host copy within the pinned budget
 * (unpinning idle models' copies first), uploads only the blocks not on the
 * device yet, starts the slots, and makes compute_stream wait for the
 * uploads.  Re-activating a model whose blocks are all still there copies
 * nothing.  If the device refuses memory the budget allowed, idle models
 * are evicted and the upload is tried once more.  On error the model is
 * not in use and still consistent (it may hold fewer blocks).  `out` may
 * be NULL. */
LADEN_API laden_status laden_cache_activate(laden_cache_t *cache,
                                            uint32_t model,
                                            laden_cache_mode mode,
                                            uint32_t lookahead,
                                            uintptr_t compute_stream,
                                            laden_cache_evict_t *ev,
                                            uint32_t cap, uint32_t *out_n,
                                            laden_cache_activation_t *out);

/* Ends a use: records the model's work on compute_stream (its device
 * memory is freed later only after that work) and makes it idle.  Its
 * blocks stay on the device. */
LADEN_API laden_status laden_cache_deactivate(laden_cache_t *cache,
                                              uint32_t model,
                                              uintptr_t compute_stream);

/* Makes an idle bound model give up at least `vram_bytes` of device memory
 * (UINT64_MAX: all of it; slots first, then blocks from the last), and
 * with `unpin` its pinned host copy too.  *out_freed (may be NULL) gets
 * the device bytes freed.  LADEN_E_STATE if it is in use. */
LADEN_API laden_status laden_cache_drop(laden_cache_t *cache, uint32_t model,
                                        uint64_t vram_bytes, int unpin,
                                        uint64_t *out_freed);

/* Frees at least `bytes` of device memory from idle bound models, least
 * recently used first (fewer if they hold less); decisions in ev as
 * laden_cache_evict_bytes. */
LADEN_API laden_status laden_cache_free_vram(laden_cache_t *cache,
                                             uint64_t bytes,
                                             laden_cache_evict_t *ev,
                                             uint32_t cap, uint32_t *out_n);

/* One decision over the host copies of a group: model `model` of `cache`
 * gives up its host copy, `drop_bytes`. */
typedef struct laden_cache_host_evict {
    laden_cache_t *cache;
    uint32_t model;
    uint64_t drop_bytes;
} laden_cache_host_evict_t;

/* Decides which idle bound models give up their host copies (unbound and
 * rebuilt on their next use) so that `need_bytes` more fit within
 * `ram_budget_bytes` together with the host copies of the bound models of
 * every cache of `cache`'s group (the host's RAM is one): least recently
 * used first, whole models, from any cache of the group.  Model `except`
 * of `cache` is never chosen (UINT32_MAX: none).  LADEN_E_BUDGET if even
 * all of them would not make room (nothing decided); ev[i].drop_bytes is
 * the model's size. */
LADEN_API laden_status laden_cache_plan_host_group(
    laden_cache_t *cache, uint32_t except, uint64_t ram_budget_bytes,
    uint64_t need_bytes, laden_cache_host_evict_t *ev, uint32_t cap,
    uint32_t *out_n);

/* Whether activating `model` (bound, idle) may take device memory from
 * idle models and change their layout: it is not whole on the device and
 * the VRAM budget's free room is less than what it lacks.  Asked before
 * laden_cache_activate, which chooses resident or streaming only then, so
 * it answers for the whole model: 0 is sure, 1 may be cautious (a model
 * that streams may need less).  0 without a VRAM budget, and for a model
 * in a VRAM context, whose idle models' pages go whenever the context
 * needs room (the cache decides nothing there).  *out_may: 0 or 1. */
LADEN_API laden_status laden_cache_may_evict(laden_cache_t *cache,
                                             uint32_t model,
                                             int32_t *out_may);

/* ---- host copies held for the models: one host policy ------------------- */

/* Host memory the caller holds for its models that can be made again at
 * the cost of a read (an adapter's tensors as read from its files), kept
 * between uses: an entry of the group's host policy beside the models'
 * host copies, so that one policy decides what host RAM keeps.  Entries
 * belong to the group (host RAM is one), are kept least recently used
 * first, and never give way while they are in the `keep` list of a
 * decision (the adapters of the models in use).  The caller allocates and
 * frees the memory; the cache decides and accounts.  Under the caller's
 * one lock, as the rest of the cache. */

/* Idle entries kept at most where no RAM budget is given (RAM_UNLIMITED):
 * reading an adapter again is cheap, holding many is not. */
#define LADEN_CACHE_IDLE_HOST_BYTES (UINT64_C(4) << 30)
/* ram_budget_bytes of laden_cache_plan_host: no RAM budget. */
#define LADEN_CACHE_RAM_UNLIMITED UINT64_MAX

/* Registers `bytes` of host memory as an entry, most recently used;
 * *out_entry is its id in the group (ids of removed entries are used
 * again). */
LADEN_API laden_status laden_cache_host_add(laden_cache_t *cache,
                                            uint64_t bytes,
                                            uint32_t *out_entry);
/* The entry was used now: it becomes the most recently used. */
LADEN_API laden_status laden_cache_host_touch(laden_cache_t *cache,
                                              uint32_t entry);
/* Forgets an entry (the caller frees its memory). */
LADEN_API laden_status laden_cache_host_remove(laden_cache_t *cache,
                                               uint32_t entry);
/* Bytes of every entry of the group and how many there are (either out
 * may be NULL). */
LADEN_API laden_status laden_cache_host_held(laden_cache_t *cache,
                                             uint64_t *out_bytes,
                                             uint32_t *out_entries);

/* The host policy's decision before a model's host copy grows by
 * `need_bytes` (a build) or after the entries changed: which idle entries
 * (not in keep[0..nkeep), which may repeat) give way, least recently used
 * first, into drop[0..*out_ndrop); then, with a RAM budget, which idle
 * bound models give up their host copies, as laden_cache_plan_host_group
 * (ev[0..*out_n), model `except` of `cache` never), so that the models'
 * host copies, `need_bytes` and the entries left fit it.  Entries go
 * first, being cheap to make again, down to what the budget leaves after
 * the models, the need and the kept entries; without a budget
 * (LADEN_CACHE_RAM_UNLIMITED) idle entries keep at most
 * LADEN_CACHE_IDLE_HOST_BYTES and no model is chosen.  Decides only: the
 * caller removes the entries and drops the models.  LADEN_E_BUDGET if
 * even dropping every idle model would not make room: the entries'
 * decisions stand, no model is chosen; LADEN_E_INVAL for an unknown
 * entry in keep or a `drop_cap` or `cap` too small (nothing decided). */
LADEN_API laden_status laden_cache_plan_host(
    laden_cache_t *cache, uint32_t except, uint64_t ram_budget_bytes,
    uint64_t need_bytes, const uint32_t *keep, uint32_t nkeep,
    uint32_t *drop, uint32_t drop_cap, uint32_t *out_ndrop,
    laden_cache_host_evict_t *ev, uint32_t cap, uint32_t *out_n);

#ifdef __cplusplus
}
#endif
#endif
