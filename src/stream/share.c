/* One host copy of a model for the processes of a host (issue 19).
 *
 * laden_sched_share asks for it before the load.  When the load begins
 * (load.c: after the blocks are laid out, before the device blocks are
 * placed) the blocks whose memory is host memory -- the RAM tier, and on
 * the CPU device the GPU tier, which runs in place there -- are given
 * places in one segment of shared memory (laden/shm.h), in block order,
 * each at a page boundary.  The segment's name is a hash of everything
 * that determines those bytes: the files' identities and, per tensor, its
 * file, offset, sizes, dtypes, conversion and place.  So two processes
 * share a segment exactly when they would have read the same bytes into
 * the same places; any other difference (another checkpoint, a file
 * rewritten, another dtype, another budget that moves a block to another
 * tier) gives another name, and each goes its own way.
 *
 * The process that makes the segment loads into it as it would into
 * memory of its own and marks it ready when its load ends (or failed);
 * the others wait for that and read nothing.  Each pins the segment with
 * its own CUDA context (a RAM-tier block: as its bytes arrive for the
 * maker, at once for the others).  Blocks there are never written by
 * laden after the load: rereads are refused, and so are the callers'
 * writers in the Python package (adapters merged into host copies,
 * training). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "laden/io.h"
#include "laden/shm.h"
#include "stream_share.h"
#include "stream_load.h"

/* Waiting for another process's load: until it ends (or dies: shm.c
 * notices), with no limit of our own. */
#define ATTACH_WAIT_MS UINT32_MAX
#define PAGE 4096u

/* A 128-bit hash of 64-bit words: two independent multiply-xorshift
 * lanes.  Not cryptographic: names only need to differ for different
 * layouts of one user's checkpoints. */
typedef struct {
    uint64_t a, b;
} digest;

static uint64_t fmix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static void add(digest *d, uint64_t v)
{
    d->a = fmix(d->a ^ v) + 0x9e3779b97f4a7c15ull;
    d->b = fmix(d->b + v * 0xbf58476d1ce4e5b9ull) ^ (d->a >> 7);
}

static void add_text(digest *d, const char *s)
{
    uint64_t n = s ? strlen(s) : 0, w = 0;
    add(d, n);
    for (uint64_t i = 0; i < n; i++) {
        w = (w << 8) | (unsigned char)s[i];
        if (i % 8 == 7 || i + 1 == n) {
            add(d, w);
            w = 0;
        }
    }
}

/* Whether block b's host copy may go into the segment. */
static bool shareable(const laden_sched_t *sc, const blk *b)
{
    if (!b->bytes || !b->nt)
        return false;
    if (b->tier != LADEN_TIER_RAM && (sc->cuda || b->tier != LADEN_TIER_GPU))
        return false;
    for (uint32_t k = 0; k < b->nt; k++)
        if (b->t[k].host || b->t[k].in_home)
            return false; /* bytes from this process's memory, or encoded
                             by it into the block's home already
                             (compress.c's settle_block) */
    return true;
}

laden_status laden__sched_share(laden_sched_t *sc, const char *key)
{
    if (sc->layout.laid_out || sc->loaded || sc->load.loading || sc->broken)
        return laden__fail(LADEN_E_STATE, "laden_sched_share: call it "
                           "before the load");
    if (key && strlen(key) > 4096)
        return laden__fail(LADEN_E_INVAL, "laden_sched_share: key of %zu "
                           "characters (at most 4096)", strlen(key));
    char *k = strdup(key ? key : "");
    if (!k)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    free(sc->share.key);
    sc->share.key = k;
    return LADEN_OK;
}

laden_status laden__sched_share_info(laden_sched_t *sc, char *name,
                                     size_t name_cap, uint64_t *out_bytes,
                                     int32_t *out_state)
{
    if (name && name_cap)
        snprintf(name, name_cap, "%s",
                 sc->share.shm || sc->share.note[0] ? sc->share.name : "");
    if (out_bytes)
        *out_bytes = sc->share.shm ? laden_shm_bytes(sc->share.shm) : 0;
    if (out_state)
        *out_state = sc->share.note[0]    ? LADEN_SHARE_FELL_BACK
                     : !sc->share.shm          ? LADEN_SHARE_NONE
                     : sc->share.created ? LADEN_SHARE_MADE
                                         : LADEN_SHARE_ATTACHED;
    return LADEN_OK;
}

laden_status laden__sched_share_note(laden_sched_t *sc, char *why,
                                     size_t why_cap)
{
    if (!why || !why_cap)
        return laden__fail(LADEN_E_INVAL, "laden_sched_share_note: NULL");
    snprintf(why, why_cap, "%s", sc->share.note);
    return LADEN_OK;
}

void laden__sched_share_sweep(laden_sched_t *sc)
{
    if (sc->layout.nfiles) /* what it finds it cannot read is left */
        laden_shm_reclaim(NULL, 0, NULL, NULL);
}

/* What identifies these files as they were opened: a hash of their
 * identities (laden_io_file_identity: whatever the io layer records of a
 * file goes into it). */
static digest files_digest(laden_io_file_t *const *files, uint32_t n)
{
    digest d = {0x66696c65732d3139ull, 0x7072656669782d31ull};
    uint64_t id[4];
    add(&d, n);
    for (uint32_t f = 0; f < n; f++) {
        laden_io_file_identity(files[f], id);
        for (int j = 0; j < 4; j++)
            add(&d, id[j]);
    }
    return d;
}

/* The first part of the names of the segments made from these files:
 * "m" and 8 hex digits of their identities. */
static void files_prefix(laden_io_file_t *const *files, uint32_t n,
                         char out[16])
{
    digest d = files_digest(files, n);
    snprintf(out, 16, "m%08llx", (unsigned long long)(d.a >> 32));
}

laden_status laden_sched_shared_bytes(const laden_st_t *st,
                                      uint64_t *out_bytes)
{
    if (!out_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_sched_shared_bytes: NULL");
    *out_bytes = 0;
    if (!st)
        return laden__fail(LADEN_E_INVAL, "laden_sched_shared_bytes: NULL");
    uint32_t n = (uint32_t)laden_st_file_count(st);
    laden_io_file_t **files = calloc(n ? n : 1, sizeof *files);
    if (!files)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    laden_status s = LADEN_OK;
    for (uint32_t i = 0; i < n && !s; i++)
        s = laden_st_file_open(st, i, &files[i]);
    char prefix[16];
    if (!s) {
        files_prefix(files, n, prefix);
        s = laden_shm_held_bytes(prefix, out_bytes);
    }
    for (uint32_t i = 0; i < n; i++)
        laden_io_file_close(files[i]);
    free(files);
    return s;
}

/* The segment's name and size, each shared block's place in it, and
 * its identity in full (the name has 128 of its bits). */
static uint64_t lay_out_shared(laden_sched_t *sc, char *name, size_t cap,
                               laden_shm_ident *ident)
{
    digest d = {0x6c6164656e2d3139ull, 0x73686172652d7631ull};
    uint64_t off = 0, id[4];
    add_text(&d, sc->share.key);
    add(&d, sc->layout.nfiles);
    for (uint32_t f = 0; f < sc->layout.nfiles; f++) {
        laden_io_file_identity(sc->layout.files[f], id);
        for (int j = 0; j < 4; j++)
            add(&d, id[j]);
    }
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        b->shared = shareable(sc, b);
        if (!b->shared)
            continue;
        b->share_off = off;
        off += (b->bytes + PAGE - 1) & ~(uint64_t)(PAGE - 1);
        add(&d, i);
        add(&d, b->share_off);
        add(&d, b->bytes);
        add(&d, b->nt);
        for (uint32_t k = 0; k < b->nt; k++) {
            const tref *r = &b->t[k];
            uint64_t w[] = {r->file,     r->off,       r->src_bytes,
                            r->src,      r->dst,       r->nelem,
                            r->dst_off,  r->dst_bytes, r->rows,
                            r->rope_heads, r->nrows,  r->pieces,
                            r->stride};
            for (size_t j = 0; j < sizeof w / sizeof *w; j++)
                add(&d, w[j]);
        }
    }
    /* The files' prefix, then 96 bits of everything: a planning process
     * counts only its checkpoint's segments (laden_sched_shared_bytes). */
    char prefix[16];
    files_prefix(sc->layout.files, sc->layout.nfiles, prefix);
    snprintf(name, cap, "%s%016llx%08llx", prefix, (unsigned long long)d.a,
             (unsigned long long)(d.b >> 32));
    digest f = files_digest(sc->layout.files, sc->layout.nfiles);
    memset(ident, 0, sizeof *ident);
    ident->content[0] = d.a;
    ident->content[1] = d.b;
    ident->source[0] = f.a;
    ident->source[1] = f.b;
    const char *p =
        sc->layout.nfiles ? laden_io_file_path(sc->layout.files[0]) : NULL;
    if (sc->layout.nfiles > 1)
        snprintf(ident->label, sizeof ident->label, "%s (and %u more files)",
                 p ? p : "?", sc->layout.nfiles - 1);
    else
        snprintf(ident->label, sizeof ident->label, "%s", p ? p : "");
    return off;
}

/* The segments this process made and has not filled yet, and the
 * schedule filling each.  A load of this process that would attach to one
 * waits while something fills it: its schedule's background loader, or
 * another thread holding it (in its laden_sched_load).  A schedule
 * prepared on another thread and not begun yet is waited for a while
 * (Python begins it once it has bound the model's tensors); one prepared,
 * or held, by this very thread would never be filled while this thread
 * waits for it: that is refused at once. */
typedef struct making {
    struct making *next;
    const laden_sched_t *sc;
    uint64_t by; /* the thread that prepared it */
    char name[64];
} making;
static pthread_mutex_t making_mu = PTHREAD_MUTEX_INITIALIZER;
static making *makings;

/* How long a load waits for a maker prepared on another thread to begin. */
uint32_t laden__share_prepared_wait_ms = 10000;

static void making_add(const laden_sched_t *sc, const char *name)
{
    making *m = calloc(1, sizeof *m);
    if (!m)
        return; /* then only the wait is lost, as before */
    m->sc = sc;
    m->by = laden__thread_id();
    snprintf(m->name, sizeof m->name, "%s", name);
    pthread_mutex_lock(&making_mu);
    m->next = makings;
    makings = m;
    pthread_mutex_unlock(&making_mu);
}

static void making_drop(const laden_sched_t *sc)
{
    pthread_mutex_lock(&making_mu);
    for (making **l = &makings; *l;) {
        making *m = *l;
        if (m->sc == sc) {
            *l = m->next;
            free(m);
        } else {
            l = &m->next;
        }
    }
    pthread_mutex_unlock(&making_mu);
}

enum { MAKING_FILLED_ELSEWHERE, MAKING_PREPARED, MAKING_NEVER };

/* What fills segment `name`, for a load of this thread that would attach:
 * another process or a live load (wait for it), a schedule prepared on
 * another thread (wait for its begin), or nothing while this thread
 * waits. */
static int making_state(const char *name)
{
    int st = MAKING_FILLED_ELSEWHERE;
    uint64_t me = laden__thread_id();
    pthread_mutex_lock(&making_mu);
    for (making *m = makings; m; m = m->next) {
        if (strcmp(m->name, name))
            continue;
        laden_sched_t *o = (laden_sched_t *)m->sc;
        uint64_t holder = atomic_load(&o->hold.holder);
        if (atomic_load(&o->hold.loader_live) || (holder && holder != me))
            st = MAKING_FILLED_ELSEWHERE;
        else if (holder == me || m->by == me)
            st = MAKING_NEVER;
        else
            st = MAKING_PREPARED;
        break;
    }
    pthread_mutex_unlock(&making_mu);
    return st;
}

static uint64_t ms_since(const struct timespec *t0)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)(now.tv_sec - t0->tv_sec) * 1000 +
           (uint64_t)((now.tv_nsec - t0->tv_nsec) / 1000000);
}

/* Waits until segment `name` (attached as `shm`) is filled, or refuses a
 * wait that would never end. */
static laden_status await_maker(laden_shm_t *shm, const char *name)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int st = making_state(name);
        if (st == MAKING_FILLED_ELSEWHERE)
            return laden_shm_wait_ready(shm, ATTACH_WAIT_MS);
        if (st == MAKING_NEVER)
            return laden__fail(
                LADEN_E_STATE,
                "it is being made by another load in this process that is "
                "not reading it now (prepared, or driven by this very "
                "thread): waiting would never end; finish that load first, "
                "or load it in the background");
        if (ms_since(&t0) >= laden__share_prepared_wait_ms)
            return laden__fail(
                LADEN_E_STATE,
                "it is being made by another load in this process, "
                "prepared on another thread and not begun after %u ms "
                "(laden_sched_load_begin or laden_sched_load_wait fill it)",
                laden__share_prepared_wait_ms);
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
}

laden_status laden__sched_share_open(laden_sched_t *sc)
{
    if (!sc->share.key || sc->share.shm)
        return LADEN_OK;
    char name[sizeof sc->share.name];
    laden_shm_ident ident;
    uint64_t bytes = lay_out_shared(sc, name, sizeof name, &ident);
    if (!bytes)
        return LADEN_OK; /* nothing lives in host memory */
    laden_shm_t *shm = NULL;
    int created = 0;
    laden_status s = laden_shm_open(name, bytes, &ident, 0, &shm, &created);
    if (s == LADEN_E_STATE) {
        /* The name is held by something that is not this segment (a
         * segment of another content, a file laden did not make, a FIFO,
         * another user's file...), or kept busy: a copy of this load's
         * own, never a failure nor another model's bytes.  The caller
         * warns (LADEN_SHARE_FELL_BACK). */
        snprintf(sc->share.note, sizeof sc->share.note, "%s",
                 laden_last_error());
        memcpy(sc->share.name, name, sizeof name);
        for (uint32_t i = 0; i < sc->layout.nb; i++)
            sc->layout.b[i].shared = false;
        laden__error_clear();
        return LADEN_OK;
    }
    if (!s && sc->cuda && !laden_shm_pinnable(shm))
        s = laden__fail(LADEN_E_INVAL,
                        "%s is not on tmpfs or hugetlbfs, so CUDA cannot "
                        "pin it; point LADEN_SHM_DIR at /dev/shm or another "
                        "tmpfs", laden_shm_path(shm));
    if (!s && !created)
        s = await_maker(shm, name);
    if (s) {
        laden_shm_close(shm);
        for (uint32_t i = 0; i < sc->layout.nb; i++)
            sc->layout.b[i].shared = false;
        laden__error_prefix("the shared host copy");
        return s;
    }
    sc->share.shm = shm;
    sc->share.created = created;
    if (created)
        making_add(sc, name);
    memcpy(sc->share.name, name, sizeof name);
    char *data = laden_shm_data(shm);
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        if (!b->shared)
            continue;
        char *at = data + b->share_off;
        if (b->tier == LADEN_TIER_GPU) { /* the CPU device: runs in place */
            b->region = (laden_devptr_t)(uintptr_t)at;
            continue;
        }
        b->ram = at;
        b->ram_len = (b->bytes + PAGE - 1) & ~(uint64_t)(PAGE - 1);
        if (!sc->cuda && !sc->cache.on)
            b->region = (laden_devptr_t)(uintptr_t)at; /* runs in place */
    }
    if (created)
        return LADEN_OK;
    /* Attached: filled by the maker.  A cache schedule's blocks are then
     * loaded; a streaming schedule's RAM-tier blocks are pinned by this
     * process's context now (the maker pinned them as they arrived),
     * within this process's RAM budget as a load would be. */
    uint64_t homes = 0, budget = sc->cfg.ram_budget_bytes;
    for (uint32_t i = 0; i < sc->layout.nb && !sc->cache.on; i++)
        if (sc->layout.b[i].shared && sc->layout.b[i].tier == LADEN_TIER_RAM)
            homes += sc->layout.b[i].ram_len;
    if (sc->cuda && budget && homes > budget)
        return laden__fail(LADEN_E_BUDGET, "the shared host copy's %s of "
                           "RAM-tier blocks do not fit the %s RAM budget",
                           laden__bytes(homes).s, laden__bytes(budget).s);
    for (uint32_t i = 0; i < sc->layout.nb; i++) {
        blk *b = &sc->layout.b[i];
        if (!b->shared)
            continue;
        if (sc->cache.on) {
            b->filled = true;
            sc->cache.nfilled++;
        } else if (sc->cuda && b->tier == LADEN_TIER_RAM &&
                   (s = laden__sched_pin_home(sc, b))) {
            return s; /* free_all unpins what was pinned */
        }
    }
    return LADEN_OK;
}

laden_status laden__sched_share_end(laden_sched_t *sc, laden_status s)
{
    if (sc->share.shm && sc->share.created) {
        laden_shm_set_ready(sc->share.shm, s == LADEN_OK);
        making_drop(sc);
    }
    return s;
}

void laden__sched_share_close(laden_sched_t *sc)
{
    making_drop(sc);
    laden_shm_close(sc->share.shm);
    sc->share.shm = NULL;
}
