/* Lossless-compressed tensors (issue 37; the format: laden/lossless.h).
 *
 * laden_sched_set_lossless marks a BF16/F16 tensor kept as the checkpoint
 * stores it: it becomes an expanded tensor (workspace.c) of its own dtype,
 * so a block's enter puts its value in the workspace.  At load, before
 * the layout is fixed, the marked tensors of RAM-tier blocks are read and
 * encoded, on as many threads as the host has cores (up to 16), each on
 * a tensor at a time; a tensor whose blob is not at most 15/16 of its
 * bytes, or whose block is on another tier, is plain again (read as
 * stored, nothing expanded: laden_sched_tensor_lossless says which).  A compressed tensor
 * becomes a host tensor holding its blob (the load copies it into the
 * block's pinned home as it copies a model built on the CPU), its block
 * is packed again at the new sizes, so the RAM tier, the slots and every
 * copy into them shrink by what the blobs save; its enter decodes it into
 * the workspace (run.c, through laden_lossless_decode) on the compute
 * stream.  The blobs are freed once the load has copied them.  A tensor
 * a lossless cache file holds (llcache.c, laden_sched_use_lossless_cache)
 * is not read nor encoded here: its blob is read straight from the cache
 * file into its block by the load, as a tensor kept as stored is, and
 * checked there (laden__sched_check_cached).  A disk-tier block streams
 * its cached tensors' blobs from the cache file too, each read checked
 * before its block runs (laden__sched_check_blobs, run.c); without a cache
 * its tensors stay as stored (encoding at each read would cost more than
 * the bytes it saves).  The load's progress callback hears of the
 * bytes read and encoded (from the loading thread, every 50 ms), and may
 * stop it.  Calls build.c and workspace.c. */
#define _GNU_SOURCE /* sched_getaffinity */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "stream_layout.h"
#include "stream_load.h" /* the load's progress callback */
#include "stream_lossless.h"
#include "stream_run.h" /* workspace.c's laden__sched_set_expanded */

laden_status laden__sched_set_lossless(laden_sched_t *sc, uint32_t block,
                                       uint32_t i)
{
    if (!sc || block >= sc->layout.nb || i >= sc->layout.b[block].nt)
        return laden__fail(LADEN_E_INVAL, "laden_sched_set_lossless: bad "
                                          "schedule, block or tensor");
    blk *b = &sc->layout.b[block];
    tref *r = &b->t[i];
    const char *name = r->name ? r->name : "?";
    if (sc->loaded || sc->layout.laid_out)
        return laden__fail(LADEN_E_STATE,
                           "laden_sched_set_lossless: after load");
    if (r->src != r->dst ||
        (r->dst != LADEN_DTYPE_BF16 && r->dst != LADEN_DTYPE_F16))
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': kept lossless only as the "
                           "checkpoint's own BF16 or F16", name);
    /* As stored, or in memory as it runs (a model built on the CPU). */
    if (r->rope_heads || r->pieces || r->part || r->joined ||
        (i + 1 < b->nt && b->t[i + 1].joined) || r->expands || b->experts)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': kept lossless only when read "
                           "as one range and laid out alone (not a part, "
                           "joined, reordered, already compact or in an "
                           "expert block)", name);
    laden_status s = laden__sched_set_expanded(sc, block, i, r->dst, 0,
                                               LADEN_SCHED_NO_SCALE,
                                               LADEN_SCALE_NONE);
    if (s)
        return s;
    r->ll_asked = true;
    laden__sched_unplan(sc); /* the workspace grew */
    return LADEN_OK;
}

/* ---- what a marked tensor will take --------------------------------------
 *
 * The plan counts a RAM-tier block at its coded size, before anything is
 * read: SAMPLES runs of SAMPLE_ELEMS elements spread over the tensor
 * (all of it when smaller) are read and encoded, and their ratio, plus
 * MARGIN of the raw bytes and a header, is the estimate.  The load's
 * encoding then gives the true size; laden__sched_compress checks that
 * the RAM tier still fits what the plan gave it. */
enum { SAMPLES = 3, SAMPLE_ELEMS = 16384, MARGIN = 50 /* 1/50: 2 % */ };

static const llc_entry *cached_entry(const laden_sched_t *sc,
                                     const tref *r);

/* Tensor r's sample runs: how many (1 when smaller than SAMPLES runs),
 * of how many elements, the k-th starting at element first(k). */
static uint32_t sample_runs(const tref *r, uint64_t *per)
{
    uint64_t n = r->nelem;
    *per = n < SAMPLES * SAMPLE_ELEMS ? n : SAMPLE_ELEMS;
    return n < SAMPLES * SAMPLE_ELEMS ? 1 : SAMPLES;
}

static uint64_t sample_first(const tref *r, uint32_t runs, uint64_t per,
                             uint32_t k)
{
    return runs == 1 ? 0 : k * ((r->nelem - per) / (runs - 1));
}

/* Tensors whose samples are read at once: the reads of a window go to
 * the reader pool together (a cold drive answers several small reads in
 * the time of one), then each tensor's runs are encoded. */
enum { WINDOW = 128 };

/* Estimates the coded size of each tensor of rs[0..n) (ll_est): from a
 * cache file exactly, else from its samples. */
static laden_status estimate_all(laden_sched_t *sc, tref **rs, uint32_t n)
{
    laden_status s = LADEN_OK;
    char *buf = malloc((size_t)WINDOW * SAMPLES * SAMPLE_ELEMS * 2);
    laden_io_req_t **req = calloc((size_t)WINDOW * SAMPLES, sizeof *req);
    uint64_t bound = 0, f16 = 0;
    char *blob = NULL;
    if (!(s = laden_lossless_bound(LADEN_DTYPE_BF16, SAMPLES * SAMPLE_ELEMS,
                                   &bound)) &&
        !(s = laden_lossless_bound(LADEN_DTYPE_F16, SAMPLES * SAMPLE_ELEMS,
                                   &f16)))
        blob = malloc(bound > f16 ? bound : f16);
    bound = bound > f16 ? bound : f16;
    if (!s && (!buf || !req || !blob))
        s = laden__fail(LADEN_E_NOMEM, "out of memory estimating");
    for (uint32_t w0 = 0; w0 < n && !s; w0 += WINDOW) {
        uint32_t w1 = n - w0 < WINDOW ? n : w0 + WINDOW;
        for (uint32_t i = w0; i < w1 && !s; i++) {
            tref *r = rs[i];
            const llc_entry *e = cached_entry(sc, r);
            r->ll_est = 0;
            if (e) { /* a cache file says exactly (with the room pack()
                        may add before it, at most a 4 KiB alignment) */
                r->ll_est = e->kept_raw ? 0
                                        : e->blob_bytes + LADEN_LLC_ALIGN -
                                              ALIGN;
                continue;
            }
            uint64_t per;
            uint32_t runs = sample_runs(r, &per);
            for (uint32_t k = 0; k < runs && r->nelem && !r->host && !s; k++)
                s = laden_io_submit(
                    sc->layout.io, sc->layout.files[r->file],
                    r->off + 2 * sample_first(r, runs, per, k), per * 2,
                    buf + ((uint64_t)(i - w0) * SAMPLES + k) * SAMPLE_ELEMS *
                              2,
                    &req[(i - w0) * SAMPLES + k]);
            if (s)
                laden__error_prefix("tensor '%.200s': estimating its coded "
                                    "size", r->name ? r->name : "?");
        }
        /* Every read submitted is waited for, also after a failure. */
        for (uint32_t i = w0; i < w1; i++) {
            tref *r = rs[i];
            uint64_t per, coded = 0, read = 0, raw = 2 * r->nelem;
            uint32_t runs = sample_runs(r, &per);
            laden_status t = LADEN_OK;
            for (uint32_t k = 0; k < runs; k++) {
                laden_io_req_t **q = &req[(i - w0) * SAMPLES + k];
                laden_status w = *q ? laden_io_wait(sc->layout.io, *q)
                                    : LADEN_OK;
                *q = NULL;
                t = t ? t : w;
            }
            if (s || !r->nelem || cached_entry(sc, r))
                continue;
            for (uint32_t k = 0; k < runs && !t; k++) {
                uint64_t size = 0;
                const char *at =
                    r->host /* a model built on the CPU: its memory */
                        ? (const char *)r->host +
                              2 * sample_first(r, runs, per, k)
                        : buf + ((uint64_t)(i - w0) * SAMPLES + k) *
                                    SAMPLE_ELEMS * 2;
                t = laden_lossless_encode(r->dst, at, per, blob, bound,
                                          &size);
                coded += size;
                read += per * 2;
            }
            if (t) {
                s = t;
                laden__error_prefix("tensor '%.200s': estimating its coded "
                                    "size", r->name ? r->name : "?");
                continue;
            }
            uint64_t est = (uint64_t)((double)coded / (double)read *
                                      (double)raw) +
                           raw / MARGIN + LADEN_LOSSLESS_HEADER_BYTES;
            /* Near the load's cut (a blob over 15/16 stays as stored), a
             * tensor whose samples coded a little better than the rest of
             * it would be kept whole: counted whole already from 9/10. */
            r->ll_est = est <= raw - raw / 10 ? est : 0;
        }
    }
    free(buf);
    free(req);
    free(blob);
    return s;
}

laden_status laden__sched_mark_lossless(laden_sched_t *sc, uint32_t *out)
{
    uint32_t n = 0;
    if (out)
        *out = 0;
    if (!sc)
        return laden__fail(LADEN_E_INVAL,
                           "laden_sched_mark_lossless: NULL schedule");
    /* The tiers first: a mark unplans the schedule (its workspace grew).
     * Blocks on the disk tier, and blocks not planned yet, are marked
     * too: planned (again) at their coded sizes, some may fit the RAM
     * tier (those that end elsewhere are read as stored).  Marking
     * before the first plan lets blocks asked for the RAM tier that fit
     * it only coded be planned at all (stream_load(plan=p)). */
    uint32_t nb = sc->layout.nb;
    uint8_t *may_stream = calloc(nb ? nb : 1, 1); /* not on the device */
    if (!may_stream)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    for (uint32_t i = 0; i < nb; i++)
        may_stream[i] = sc->layout.b[i].tier != LADEN_TIER_GPU &&
                        sc->layout.b[i].tier != LADEN_TIER_VRAM;
    laden_status s = LADEN_OK;
    uint64_t cap = 0;
    for (uint32_t i = 0; i < nb; i++)
        cap += sc->layout.b[i].nt;
    tref **marked = calloc(cap ? cap : 1, sizeof *marked);
    if (!marked)
        s = laden__fail(LADEN_E_NOMEM, "out of memory");
    for (uint32_t i = 0; i < nb && !s; i++)
        for (uint32_t k = 0; may_stream[i] && k < sc->layout.b[i].nt && !s;
             k++) {
            const tref *r = &sc->layout.b[i].t[k];
            if (r->ll_asked || r->expands || r->src != r->dst ||
                (r->dst != LADEN_DTYPE_BF16 && r->dst != LADEN_DTYPE_F16))
                continue; /* taken already, or never: no error to make */
            s = laden__sched_set_lossless(sc, i, k);
            if (s == LADEN_E_UNSUPPORTED) /* a part, joined, ...: plain */
                s = LADEN_OK;
            else if (!s)
                marked[n++] = &sc->layout.b[i].t[k];
        }
    if (!s && !sc->cache.on) /* a cache schedule is not planned */
        s = estimate_all(sc, marked, n);
    free(marked);
    free(may_stream);
    if (out)
        *out = s ? 0 : n;
    return s;
}

/* ---- the pool: tensors read and encoded on many threads ---------------- */

/* io.c: the bytes a reader pool reads at once (its threads' chunks). */
uint64_t laden__io_depth_bytes(laden_io_t *io);

/* Reads at once: the workers read in job order (the file's, as the
 * blocks list it) and encode the rest of the time; a read starts once the
 * ones before it started and the bytes in flight leave room for it in
 * what the reader pool reads at once (laden__io_depth_bytes), or none is
 * in flight.  Sixteen whole tensors read at once, wherever they
 * lay, sent the drive sixteen scattered streams: a cold load took twice
 * cat's time on the H200.  Two at a time kept the reads in file order
 * but left most of the pool idle (a 34 MB tensor is three chunks), and
 * a cold load read at 0.65 x cat's rate. */

typedef struct pool {
    laden_io_t *io;
    ll_job *jobs;
    uint32_t n;
    const ll_settle *settle; /* NULL: none; else, for job k, */
    uint32_t *first;         /* the first job of its group, */
    atomic_uint *left;       /* at first[k]: the group's jobs not ended */
    atomic_uint next, finished;
    atomic_bool stop;          /* the run stops: */
    atomic_bool cancelled;     /* the progress callback asked it */
    atomic_uint_fast64_t done; /* bytes read and encoded */
    uint64_t depth;            /* bytes the reader pool reads at once */
    pthread_mutex_t mu;        /* guards what follows */
    pthread_cond_t cv;
    uint32_t turn;             /* the job whose read starts next */
    uint32_t reading;          /* reads started, not yet done */
    uint64_t inflight;         /* their bytes */
} pool;

/* Job k's turn to read its `bytes`: the jobs before it started theirs
 * and the reads in flight leave room (see above; a job in memory reads
 * nothing and waits for none).  false when the run stops meanwhile. */
static bool read_turn(pool *p, uint32_t k, uint64_t bytes)
{
    pthread_mutex_lock(&p->mu);
    while (!atomic_load(&p->stop) &&
           (p->turn != k ||
            (bytes && p->reading && p->inflight + bytes > p->depth)))
        pthread_cond_wait(&p->cv, &p->mu);
    bool go = !atomic_load(&p->stop);
    if (go) {
        p->turn++;
        p->reading++;
        p->inflight += bytes;
    }
    pthread_mutex_unlock(&p->mu);
    if (go)
        pthread_cond_broadcast(&p->cv);
    return go;
}

static void read_done(pool *p, uint64_t bytes)
{
    pthread_mutex_lock(&p->mu);
    p->reading--;
    p->inflight -= bytes;
    pthread_mutex_unlock(&p->mu);
    pthread_cond_broadcast(&p->cv);
}

/* Wakes workers waiting for their turn (the run stops). */
static void stop_all(pool *p)
{
    atomic_store(&p->stop, true);
    pthread_mutex_lock(&p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_cond_broadcast(&p->cv);
}

/* A worker's buffer for the tensor read, kept from job to job (grown
 * when a tensor is larger): fresh memory for every tensor cost a page
 * fault and a zeroed page per 4 KiB, a third of a compressed load's
 * time on the 2-core VM (perf: clear_page). */
typedef struct scratch {
    void *p;
    uint64_t cap;
} scratch;

static void *scratch_for(scratch *b, uint64_t bytes)
{
    if (bytes > b->cap || !b->p) {
        free(b->p);
        b->p = malloc(bytes ? bytes : 1);
        b->cap = b->p ? bytes : 0;
    }
    return b->p;
}

static void run_job(pool *p, uint32_t k, scratch *buf)
{
    ll_job *j = &p->jobs[k];
    uint64_t bound, raw_bytes = 2 * j->nelem;
    /* Read at the file offset's place modulo 4 KiB, so that O_DIRECT
     * reads land in place instead of through the reader's bounce buffer
     * (the encoder takes any alignment). */
    const char *raw = j->src; /* in memory already, or read: */
    char *to = raw ? NULL : scratch_for(buf, raw_bytes + 4096);
    laden_status s = raw || to ? LADEN_OK
                               : laden__fail(LADEN_E_NOMEM, "out of memory");
    if (to)
        to += (j->off - (uintptr_t)to) & 4095u;
    laden_io_req_t *req;
    uint64_t reads = to ? raw_bytes : 0;
    if (!read_turn(p, k, reads)) { /* stopped: nothing read (a job in
                                      memory takes its turn too: the reads
                                      go in order) */
        j->s = LADEN_E_STATE;
        snprintf(j->msg, sizeof j->msg, "tensor '%.200s': stopped",
                 j->name ? j->name : "?");
        return;
    }
    if (!s && to &&
        !(s = laden_io_submit(p->io, j->file, j->off, raw_bytes, to, &req)))
        s = laden_io_wait_cached(p->io, req, &j->cached);
    read_done(p, reads);
    raw = raw ? raw : to;
    if (!s)
        s = laden_lossless_bound(j->dtype, j->nelem, &bound);
    if (!s && !(j->blob = malloc(bound)))
        s = laden__fail(LADEN_E_NOMEM, "out of memory");
    if (!s)
        s = laden_lossless_encode(j->dtype, raw, j->nelem, j->blob, bound,
                                  &j->size);
    if (!s && laden__ll_worth(j->size, raw_bytes)) {
        void *fit = realloc(j->blob, j->size);
        j->blob = fit ? fit : j->blob;
        s = laden_lossless_check(j->blob, j->size, &j->info);
    } else if (!s) {
        free(j->blob); /* not worth it: kept as stored */
        j->blob = NULL;
    }
    if (s) {
        free(j->blob);
        j->blob = NULL;
    }
    j->s = s;
    if (s)
        snprintf(j->msg, sizeof j->msg, "tensor '%.200s': %s",
                 j->name ? j->name : "?", laden_last_error());
}

/* Job k ended: its group settles if it was the group's last (ll_settle). */
static void settle_after(pool *p, uint32_t k)
{
    uint32_t g = p->first[k], end = g;
    if (atomic_fetch_sub(&p->left[g], 1) != 1)
        return;
    while (end < p->n && p->jobs[end].group == p->jobs[g].group)
        end++;
    for (uint32_t i = g; i < end; i++)
        if (p->jobs[i].s)
            return; /* the run fails: the caller frees what is left */
    laden_status s =
        p->settle->fn(p->settle->arg, p->jobs + g, end - g, &p->stop);
    if (s) {
        ll_job *j = &p->jobs[k];
        j->s = s;
        snprintf(j->msg, sizeof j->msg, "%s", laden_last_error());
        stop_all(p);
    }
}

static void *worker(void *arg)
{
    pool *p = arg;
    scratch buf = {0};
    for (uint32_t k; !atomic_load(&p->stop) &&
                     (k = atomic_fetch_add(&p->next, 1)) < p->n;) {
        run_job(p, k, &buf);
        if (p->settle)
            settle_after(p, k);
        atomic_fetch_add(&p->done, 2 * p->jobs[k].nelem);
        atomic_fetch_add(&p->finished, 1);
    }
    free(buf.p);
    return NULL;
}

static uint32_t cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return (uint32_t)CPU_COUNT(&set);
    return 1;
}

laden_status laden__ll_run(laden_io_t *io, ll_job *jobs, uint32_t n,
                           const ll_settle *settle,
                           laden_sched_progress_fn progress, void *arg,
                           uint64_t base, uint64_t total, const char *what)
{
    if (!n)
        return LADEN_OK;
    pool p = {.io = io, .jobs = jobs, .n = n};
    if (settle && settle->fn) {
        p.first = malloc(n * sizeof *p.first);
        p.left = malloc(n * sizeof *p.left);
        if (!p.first || !p.left) {
            free(p.first);
            free(p.left);
            return laden__fail(LADEN_E_NOMEM, "out of memory");
        }
        for (uint32_t k = 0; k < n; k++) {
            p.first[k] = k && jobs[k].group == jobs[k - 1].group
                             ? p.first[k - 1]
                             : k;
            atomic_init(&p.left[k], 0);
        }
        for (uint32_t k = 0; k < n; k++)
            atomic_fetch_add(&p.left[p.first[k]], 1);
        p.settle = settle;
    }
    p.depth = laden__io_depth_bytes(io); /* 0 without a pool: one read at
                                            a time */
    uint32_t nt = cores();
    nt = nt > 16 ? 16 : nt;
    nt = nt > n ? n : nt;
    pthread_t th[16];
    uint32_t started = 0;
    atomic_init(&p.next, 0);
    atomic_init(&p.finished, 0);
    atomic_init(&p.stop, false);
    atomic_init(&p.cancelled, false);
    atomic_init(&p.done, 0);
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    for (; started < nt; started++)
        if (pthread_create(&th[started], NULL, worker, &p))
            break;
    if (!started) /* no thread to be had: this one does it all */
        worker(&p);
    /* This thread reports progress meanwhile. */
    while (atomic_load(&p.finished) < n && !atomic_load(&p.stop)) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
        if (progress && progress(arg, base + atomic_load(&p.done), total)) {
            atomic_store(&p.cancelled, true);
            stop_all(&p);
        }
    }
    for (uint32_t t = 0; t < started; t++)
        pthread_join(th[t], NULL);
    for (uint32_t k = atomic_load(&p.next); k < n; k++) { /* never taken */
        jobs[k].s = LADEN_E_STATE;
        snprintf(jobs[k].msg, sizeof jobs[k].msg, "stopped");
    }
    pthread_cond_destroy(&p.cv);
    pthread_mutex_destroy(&p.mu);
    free(p.first);
    free(p.left);
    /* A job's own failure first (a settle's too, which stopped the
     * run), then the callback's stop, then the jobs it left. */
    for (uint32_t k = 0; k < n; k++)
        if (jobs[k].s && jobs[k].s != LADEN_E_STATE)
            return laden__fail(jobs[k].s, "compressing %s", jobs[k].msg);
    if (atomic_load(&p.cancelled) ||
        (progress && progress(arg, base + atomic_load(&p.done), total)))
        return laden__fail(LADEN_E_STATE, "%s was cancelled by its progress "
                                          "callback (while compressing)",
                           what);
    for (uint32_t k = 0; k < n; k++)
        if (jobs[k].s)
            return laden__fail(jobs[k].s, "compressing %s", jobs[k].msg);
    return LADEN_OK;
}

/* ---- compressing at load ------------------------------------------------ */

/* Block b's tensors at their places again (laden__sched_place); a blob
 * read from a cache file, where blobs start at 4 KiB multiples, at a 4 KiB
 * multiple of the block too, so that its reads land in place (the home's
 * shift: load.c's map_home). */
static void pack(blk *b)
{
    uint64_t end = 0;
    for (uint32_t k = 0; k < b->nt; k++) {
        tref *r = &b->t[k];
        r->dst_off = r->cfile ? laden__llc_aligned(end)
                              : laden__sched_place(r, end);
        end = r->dst_off + r->dst_bytes;
    }
    b->bytes = end;
}

/* Tensor r, marked but not compressed, is plain again: its block reads
 * it as stored and nothing is expanded (its workspace stays reserved). */
static void keep_as_stored(tref *r)
{
    r->ll_asked = false;
    r->expands = false;
}

/* Tensor r's entry in its file's lossless cache (llcache.c), or NULL. */
static const llc_entry *cached_entry(const laden_sched_t *sc, const tref *r)
{
    const laden_llc *c =
        sc->layout.llc && !r->host ? sc->layout.llc[r->file] : NULL;
    return c ? laden__llc_find(c, r->off, r->nelem, r->dst) : NULL;
}

/* The blocks with coded tensors packed at their new sizes; the RAM tier
 * checked against the room the plan had when it counted estimates. */
static laden_status repack(laden_sched_t *sc)
{
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        for (uint32_t k = 0; k < sc->layout.b[i].nt; k++)
            if (sc->layout.b[i].t[k].ll) {
                pack(&sc->layout.b[i]);
                break;
            }
    /* The plan counted the RAM tier at estimated sizes: the true ones
     * must fit the room it had (samples that misled by more than the
     * margin are refused, not run past the budget). */
    uint64_t tier = 0;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        if (sc->layout.b[i].tier == LADEN_TIER_RAM)
            tier += sc->layout.b[i].bytes;
    laden_status s = LADEN_OK;
    if (sc->layout.ram_estimated && tier > sc->layout.ram_room)
        s = laden__fail(LADEN_E_BUDGET,
                        "compression=\"lossless\": the RAM tier's blocks "
                        "take %s once encoded, more than the %s of RAM the "
                        "plan had for them (it counted their coded sizes "
                        "as estimated from samples of each tensor, which "
                        "this checkpoint's weights did not follow); give "
                        "more RAM (ram_budget) or load without compression",
                        laden__bytes(tier).s,
                        laden__bytes(sc->layout.ram_room).s);
    return s;
}

/* Tensor r's blob is read straight from its cache file into its block
 * at load, as a tensor kept as stored is (its info checked then:
 * laden__sched_check_cached). */
static laden_status from_cache(laden_sched_t *sc, tref *r,
                               const llc_entry *e)
{
    laden_lossless_info *ll = calloc(1, sizeof *ll);
    if (!ll)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    r->ll = ll;
    r->ll_unchecked = true;
    r->cfile = sc->layout.llc[r->file]->file;
    r->off = e->blob_off;
    r->src_bytes = r->dst_bytes = e->blob_bytes;
    sc->st.lossless_bytes += e->blob_bytes;
    sc->st.lossless_raw_bytes += r->nelem * 2;
    sc->st.lossless_cache_bytes += e->blob_bytes;
    return LADEN_OK;
}

laden_status laden__sched_check_blob(tref *r, const void *at)
{
    laden_lossless_info info;
    laden_status s = laden_lossless_check(at, r->dst_bytes, &info);
    if (!s && (info.n_elems != r->nelem || info.dtype != r->dst))
        s = laden__fail(LADEN_E_CORRUPT,
                        "its blob holds %llu values of another tensor",
                        (unsigned long long)info.n_elems);
    if (!s && !r->ll_unchecked && memcmp(&info, r->ll, sizeof info))
        s = laden__fail(LADEN_E_CORRUPT, "its blob is not the one read "
                                         "before: the file changed");
    if (s) {
        laden__error_prefix("the lossless cache file %.300s: tensor "
                            "'%.200s'",
                            laden_io_file_path(r->cfile),
                            r->name ? r->name : "?");
        return s;
    }
    if (r->ll_unchecked) {
        *r->ll = info;
        r->ll_unchecked = false;
    }
    return LADEN_OK;
}

laden_status laden__sched_check_blobs(laden_sched_t *sc, blk *b,
                                      const void *base)
{
    for (uint32_t k = 0; sc->layout.llc && k < b->nt; k++) {
        tref *r = &b->t[k];
        laden_status s;
        if (r->ll && r->cfile &&
            (s = laden__sched_check_blob(r, (const char *)base + r->dst_off)))
            return s;
    }
    return LADEN_OK;
}

laden_status laden__sched_check_cached(laden_sched_t *sc, blk *b)
{
    /* A RAM-tier block's home holds its blobs (a disk-tier block's are
     * checked at each read, run.c). */
    return b->tier == LADEN_TIER_DISK ? LADEN_OK
                                      : laden__sched_check_blobs(sc, b, b->ram);
}

typedef struct settling {
    laden_sched_t *sc;
    laden_sched_place_fn place; /* NULL: the blobs are only adopted */
    _Atomic uint64_t homes;     /* the homes' bytes given so far */
} settling;

/* A block's encoded tensors (the pool's group: ll_settle), on the worker
 * that encoded the block's last: each blob kept becomes its tensor's,
 * the others are kept as stored.  On a whole load (not a cache's, which
 * fills each block's home when the block is asked for) the block is
 * packed and given its host memory here (st->place, load.c's), and the
 * blobs copied into it and freed: while the drive reads the blocks after
 * it, which a cold load waits for anyway.  Copied after every block was
 * encoded, 1.6 GB of blobs took 0.8 s of a 5.0 s cold load on the 2-core
 * VM (a drive at 0.6 GB/s), and a whole load held every blob beside its
 * copy.  Only this block's tensors and home are touched (one worker
 * settles a block); load.c lays out the same packing again. */
static laden_status settle_block(void *arg, ll_job *jobs, uint32_t n,
                                 const atomic_bool *stop)
{
    (void)stop; /* one block's copies: short */
    settling *st = arg;
    laden_sched_t *sc = st->sc;
    blk *b = &sc->layout.b[jobs[0].group];
    bool coded = false;
    for (uint32_t k = 0; k < n; k++) {
        ll_job *j = &jobs[k];
        tref *r = j->owner;
        if (!j->blob) {
            keep_as_stored(r);
            continue;
        }
        laden_lossless_info *ll = malloc(sizeof *ll);
        if (!ll)
            return laden__fail(LADEN_E_NOMEM, "out of memory compressing");
        *ll = j->info;
        r->ll = ll;
        r->host = j->blob;
        r->host_owned = true;
        r->src_bytes = r->dst_bytes = j->size;
        j->blob = NULL;
        coded = true;
    }
    if (!coded || !st->place)
        return LADEN_OK;
    pack(b);
    b->read_shift = laden__sched_read_shift(b);
    laden_status s = st->place(sc, b, &st->homes);
    if (s)
        return s;
    for (uint32_t k = 0; k < n; k++) {
        tref *r = jobs[k].owner;
        if (!r->ll)
            continue;
        memcpy((char *)b->ram + r->dst_off, r->host, r->dst_bytes);
        laden__sched_drop_blob(r);
        r->in_home = true;
    }
    return LADEN_OK;
}

laden_status laden__sched_compress(laden_sched_t *sc,
                                   laden_sched_place_fn place)
{
    uint32_t n = 0, cached = 0;
    laden_status s = LADEN_OK;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        for (uint32_t k = 0; k < sc->layout.b[i].nt && !s; k++) {
            tref *r = &sc->layout.b[i].t[k];
            const llc_entry *e = NULL;
            if (!r->ll_asked || r->ll)
                continue;
            laden_tier tier = sc->layout.b[i].tier;
            e = tier == LADEN_TIER_RAM || tier == LADEN_TIER_DISK
                    ? cached_entry(sc, r)
                    : NULL;
            if (e && !e->kept_raw && ++cached)
                s = from_cache(sc, r, e); /* read coded on either tier */
            else if (tier != LADEN_TIER_RAM || e)
                keep_as_stored(r); /* encoded only for the RAM tier; or
                                      the cache says it does not code
                                      small enough */
            else
                n++;
        }
    if (s || !n)
        return s ? s : cached ? repack(sc) : LADEN_OK;
    ll_job *jobs = calloc(n, sizeof *jobs);
    if (!jobs)
        return laden__fail(LADEN_E_NOMEM, "out of memory compressing");
    n = 0;
    uint64_t total = 0;
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        for (uint32_t k = 0; k < sc->layout.b[i].nt; k++) {
            tref *r = &sc->layout.b[i].t[k];
            if (!r->ll_asked || r->ll)
                continue;
            jobs[n++] = (ll_job){.file = r->host ? NULL
                                                 : sc->layout.files[r->file],
                                 .src = r->host,
                                 .off = r->off, .nelem = r->nelem,
                                 .dtype = r->dst, .name = r->name,
                                 .owner = r, .group = i};
            total += 2 * r->nelem;
        }
    settling st = {.sc = sc, .place = place};
    atomic_init(&st.homes, 0);
    ll_settle settle = {.fn = settle_block, .arg = &st};
    s = laden__ll_run(sc->layout.io, jobs, n, &settle, sc->load.progress,
                      sc->load.progress_arg, 0, total, "the load");
    for (uint32_t k = 0; k < n; k++) { /* read, whatever came of it */
        ll_job *j = &jobs[k];
        const tref *r = j->owner;
        free(j->blob); /* not settled: the run failed */
        if (!(j->s == LADEN_E_STATE && !j->cached && !j->size)) {
            sc->st.load_read_bytes += 2 * j->nelem;
            sc->st.load_cached_bytes += j->cached;
        }
        if (!s && r->ll) {
            sc->st.lossless_bytes += j->size;
            sc->st.lossless_raw_bytes += r->nelem * 2;
        }
    }
    free(jobs);
    return s ? s : repack(sc);
}

void laden__sched_drop_blob(tref *r)
{
    if (r->host_owned) {
        free((void *)r->host);
        r->host = NULL;
        r->host_owned = false;
    }
}

void laden__sched_compress_free(laden_sched_t *sc)
{
    for (uint32_t i = 0; i < sc->layout.nb; i++)
        for (uint32_t k = 0; k < sc->layout.b[i].nt; k++)
            laden__sched_drop_blob(&sc->layout.b[i].t[k]);
}

int laden__sched_tensor_lossless(const laden_sched_t *sc, uint32_t block,
                                 uint32_t i)
{
    return sc && block < sc->layout.nb && i < sc->layout.b[block].nt &&
           sc->layout.b[block].t[i].ll != NULL;
}
