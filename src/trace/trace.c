/* The trace: per-thread rings of event records, the gauges of memory held,
 * and the writer of the Trace Event Format.  See include/laden/trace.h.
 *
 * Each thread appends to its own ring (a list of chunks it alone extends)
 * and publishes the count with a release store, so recording takes no lock
 * and threads never share a cache line.  A ring belongs to a session; the
 * first record of a new session resets it (by its own thread, so never
 * under a reader).  laden_trace_stop turns recording off, then reads every
 * ring of the session up to its published count; a record published after
 * that is left out.  Rings of threads that have exited stay readable until
 * the next start frees them. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "trace_internal.h"

#define CHUNK 4096u /* records per chunk: 320 kB */
#define DEFAULT_MAX (1u << 20) /* 80 MiB of records at most */
#define STALL_MIN_NS 2000u /* a compute wait shorter than this is the
                            * wait itself, not a stall */

typedef struct chunk {
    struct chunk *_Atomic next;
    laden__trace_rec r[CHUNK];
} chunk;

typedef struct ring {
    struct ring *next; /* all rings, under rings_mu */
    atomic_uint_fast64_t session; /* written by its thread alone */
    chunk *first, *cur;
    atomic_uint_fast64_t n; /* records of the session, published */
    int32_t tid;
    bool dead;
    char name[32];
} ring;

atomic_int laden__tracing;
static atomic_uint_fast64_t session;
static atomic_uint_fast64_t total, dropped, max_events;
static uint64_t t0_ns; /* under ctl_mu */

static pthread_mutex_t ctl_mu = PTHREAD_MUTEX_INITIALIZER; /* start/stop */
static pthread_mutex_t rings_mu = PTHREAD_MUTEX_INITIALIZER;
static ring *rings;
static pthread_key_t ring_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static _Thread_local ring *mine;

static pthread_mutex_t intern_mu = PTHREAD_MUTEX_INITIALIZER;
typedef struct interned {
    struct interned *next;
    char s[];
} interned;
static interned *strings;

static pthread_mutex_t marks_mu = PTHREAD_MUTEX_INITIALIZER;
static laden__trace_marks marks;

static atomic_int_fast64_t gauges[LADEN__GAUGE_N][LADEN__GAUGE_DEVICES + 1];
static const char *const gauge_names[LADEN__GAUGE_N] = {
    "device_bytes", "slot_bytes", "vbar_mapped_bytes", "elastic_bytes",
    "pinned_bytes"};

/* ---- rings --------------------------------------------------------------- */

static void ring_gone(void *p)
{
    ring *g = p;
    pthread_mutex_lock(&rings_mu);
    g->dead = true; /* freed at the next start, after any reader */
    pthread_mutex_unlock(&rings_mu);
}

static void make_key(void) { pthread_key_create(&ring_key, ring_gone); }

static ring *ring_new(void)
{
    pthread_once(&key_once, make_key);
    ring *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->first = g->cur = calloc(1, sizeof *g->first);
    if (!g->first) {
        free(g);
        return NULL;
    }
    g->tid = (int32_t)syscall(SYS_gettid);
    pthread_getname_np(pthread_self(), g->name, sizeof g->name);
    atomic_store(&g->session, atomic_load(&session));
    pthread_setspecific(ring_key, g);
    pthread_mutex_lock(&rings_mu);
    g->next = rings;
    rings = g;
    pthread_mutex_unlock(&rings_mu);
    return g;
}

bool laden__trace_emit(const laden__trace_rec *r)
{
    uint64_t sess = atomic_load_explicit(&session, memory_order_acquire);
    /* Made in a trace that has ended (another thread stopped it, and
     * perhaps started the next, meanwhile): its marks and names are gone.
     * Were it appended now, its ring (of the ended trace) is read by no
     * one, and reset at the thread's next record. */
    if (r->session && r->session != sess)
        return false;
    ring *g = mine;
    if (!g && !(g = mine = ring_new())) {
        atomic_fetch_add(&dropped, 1);
        return false;
    }
    if (atomic_load_explicit(&g->session, memory_order_relaxed) != sess) {
        /* A new trace: start over, chunks past the first given back,
         * and only then the new session (release): a reader that sees it
         * sees no old record and no freed chunk; one that does not, skips
         * the ring. */
        atomic_store_explicit(&g->n, 0, memory_order_relaxed);
        chunk *c = atomic_load_explicit(&g->first->next, memory_order_relaxed);
        atomic_store_explicit(&g->first->next, NULL, memory_order_relaxed);
        while (c) {
            chunk *nx = atomic_load_explicit(&c->next, memory_order_relaxed);
            free(c);
            c = nx;
        }
        g->cur = g->first;
        atomic_store_explicit(&g->session, sess, memory_order_release);
    }
    if (atomic_fetch_add_explicit(&total, 1, memory_order_relaxed) >=
        atomic_load_explicit(&max_events, memory_order_relaxed)) {
        atomic_fetch_add_explicit(&dropped, 1, memory_order_relaxed);
        return false;
    }
    uint64_t n = atomic_load_explicit(&g->n, memory_order_relaxed);
    uint32_t i = (uint32_t)(n % CHUNK);
    if (n && i == 0) {
        chunk *c = atomic_load_explicit(&g->cur->next, memory_order_relaxed);
        if (!c) {
            if (!(c = calloc(1, sizeof *c))) {
                atomic_fetch_add(&dropped, 1);
                return false;
            }
            atomic_store_explicit(&g->cur->next, c, memory_order_release);
        }
        g->cur = c;
    }
    g->cur->r[i] = *r;
    atomic_store_explicit(&g->n, n + 1, memory_order_release);
    return true;
}

const char *laden__trace_intern(const char *s)
{
    if (!s)
        return "";
    pthread_mutex_lock(&intern_mu);
    for (interned *x = strings; x; x = x->next)
        if (!strcmp(x->s, s)) {
            pthread_mutex_unlock(&intern_mu);
            return x->s;
        }
    size_t n = strlen(s);
    interned *x = malloc(sizeof *x + n + 1);
    if (!x) {
        pthread_mutex_unlock(&intern_mu);
        return "";
    }
    memcpy(x->s, s, n + 1);
    x->next = strings;
    strings = x;
    pthread_mutex_unlock(&intern_mu);
    return x->s;
}

void laden__trace_set_marks(const laden__trace_marks *m)
{
    pthread_mutex_lock(&marks_mu);
    marks = *m;
    pthread_mutex_unlock(&marks_mu);
}

uint64_t laden__trace_session(void) { return atomic_load(&session); }

bool laden__trace_room(void)
{
    return atomic_load_explicit(&total, memory_order_relaxed) <
           atomic_load_explicit(&max_events, memory_order_relaxed);
}

/* ---- gauges -------------------------------------------------------------- */

static int gauge_slot(int32_t device)
{
    if (device < -1 || device >= LADEN__GAUGE_DEVICES)
        return -1;
    return device + 1;
}

static void emit_counter(const char *name, int32_t device, uint64_t v)
{
    laden__trace_rec r = {.t = laden__now_ns(), .a = v, .s = name,
                          .ev = LADEN__EV_COUNTER, .dev = (int16_t)device};
    laden__trace_emit(&r);
}

void laden__gauge_add(laden__gauge g, int32_t device, int64_t delta)
{
    int k = gauge_slot(device);
    if (k < 0 || (unsigned)g >= LADEN__GAUGE_N || !delta)
        return;
    int64_t v = atomic_fetch_add(&gauges[g][k], delta) + delta;
    if (LADEN__TRACING())
        emit_counter(gauge_names[g], device, v < 0 ? 0 : (uint64_t)v);
}

uint64_t laden__gauge_get(laden__gauge g, int32_t device)
{
    int k = gauge_slot(device);
    if (k < 0 || (unsigned)g >= LADEN__GAUGE_N)
        return 0;
    int64_t v = atomic_load(&gauges[g][k]);
    return v < 0 ? 0 : (uint64_t)v;
}

/* ---- public calls -------------------------------------------------------- */

int laden_trace_active(void) { return LADEN__TRACING() ? 1 : 0; }

laden_status laden_trace_start(uint64_t max)
{
    pthread_mutex_lock(&ctl_mu);
    if (atomic_load(&laden__tracing)) {
        pthread_mutex_unlock(&ctl_mu);
        return laden__fail(LADEN_E_STATE, "laden_trace_start: a trace is "
                           "already on in this process (one at a time)");
    }
    /* Rings of threads gone since the last trace: nobody reads them now. */
    pthread_mutex_lock(&rings_mu);
    for (ring **l = &rings; *l;) {
        ring *g = *l;
        if (!g->dead) {
            l = &g->next;
            continue;
        }
        *l = g->next;
        for (chunk *c = g->first, *nx; c; c = nx) {
            nx = atomic_load(&c->next);
            free(c);
        }
        free(g);
    }
    pthread_mutex_unlock(&rings_mu);
    atomic_store(&max_events, max ? max : DEFAULT_MAX);
    atomic_store(&total, 0);
    atomic_store(&dropped, 0);
    atomic_fetch_add_explicit(&session, 1, memory_order_release);
    t0_ns = laden__now_ns();
    atomic_store(&laden__tracing, 1);
    /* Where memory stands as the trace begins. */
    for (int g = 0; g < LADEN__GAUGE_N; g++)
        for (int k = 0; k <= LADEN__GAUGE_DEVICES; k++) {
            int64_t v = atomic_load(&gauges[g][k]);
            if (v > 0)
                emit_counter(gauge_names[g], k - 1, (uint64_t)v);
        }
    pthread_mutex_unlock(&ctl_mu);
    return LADEN_OK;
}

void laden_trace_counter(const char *name, int32_t device, uint64_t value)
{
    if (!LADEN__TRACING() || !name)
        return;
    uint64_t sess = laden__trace_session();
    laden__trace_rec r = {.session = sess, .t = laden__now_ns(), .a = value,
                          .s = laden__trace_intern(name),
                          .ev = LADEN__EV_COUNTER, .dev = (int16_t)device};
    laden__trace_emit(&r);
}

void laden_trace_range(const char *name, int begin)
{
    if (!LADEN__TRACING())
        return;
    uint64_t sess = laden__trace_session();
    laden__trace_rec r = {.session = sess, .t = laden__now_ns(),
                          .s = begin ? laden__trace_intern(name ? name : "")
                                     : "",
                          .ev = (uint16_t)(begin ? LADEN__EV_RANGE_BEGIN
                                                 : LADEN__EV_RANGE_END),
                          .dev = -1};
    laden__trace_emit(&r);
}

/* ---- the writer ---------------------------------------------------------- */

typedef struct track {
    int32_t dev;
    uint64_t id;
    int32_t tid;
    const char *role;
} track;

typedef struct writer {
    FILE *f;
    int pid;
    bool first;
    uint64_t events, unresolved;
    const void **scheds;
    size_t nsched, capsched;
    track *tracks;
    size_t ntracks, captracks;
    laden__trace_marks marks;
} writer;

/* The length of the valid UTF-8 sequence at p, or 0. */
static int utf8_len(const unsigned char *p)
{
    int n = p[0] >= 0xf0 && p[0] <= 0xf4   ? 4
            : p[0] >= 0xe0 && p[0] <= 0xef ? 3
            : p[0] >= 0xc2 && p[0] <= 0xdf ? 2
                                           : 0;
    for (int i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if (n == 3 && ((p[0] == 0xe0 && p[1] < 0xa0) ||   /* overlong */
                   (p[0] == 0xed && p[1] >= 0xa0)))   /* surrogate */
        return 0;
    if (n == 4 && ((p[0] == 0xf0 && p[1] < 0x90) ||
                   (p[0] == 0xf4 && p[1] >= 0x90)))
        return 0;
    return n;
}

/* s as a JSON string; bytes that are not UTF-8 (a name cut inside a
 * character, a path in another encoding) become U+FFFD. */
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    const unsigned char *p = (const unsigned char *)(s ? s : "");
    while (*p) {
        if (*p == '"' || *p == '\\') {
            fprintf(f, "\\%c", *p++);
        } else if (*p < 0x20) {
            fprintf(f, "\\u%04x", *p++);
        } else if (*p < 0x80) {
            fputc(*p++, f);
        } else {
            int n = utf8_len(p);
            if (n) {
                fwrite(p, 1, (size_t)n, f);
                p += n;
            } else {
                fputs("\\ufffd", f);
                p++;
            }
        }
    }
    fputc('"', f);
}

static void dev_name(char *buf, size_t n, int32_t dev)
{
    if (dev < 0)
        snprintf(buf, n, "cpu");
    else
        snprintf(buf, n, "cuda:%d", (int)dev);
}

/* The schedule's number in this trace (1, 2, ... in order of appearance). */
static uint64_t sched_no(writer *w, uint64_t p)
{
    for (size_t i = 0; i < w->nsched; i++)
        if (w->scheds[i] == (const void *)(uintptr_t)p)
            return i + 1;
    if (w->nsched == w->capsched) {
        size_t cap = w->capsched ? 2 * w->capsched : 16;
        const void **s = realloc(w->scheds, cap * sizeof *s);
        if (!s)
            return 0;
        w->scheds = s;
        w->capsched = cap;
    }
    w->scheds[w->nsched++] = (const void *)(uintptr_t)p;
    return w->nsched;
}

/* The synthetic thread id of a stream's track; its name from the first
 * event on it (copies: "copy", kernels and stalls: "compute"). */
static int32_t stream_tid(writer *w, int32_t dev, uint64_t id,
                          const char *role)
{
    for (size_t i = 0; i < w->ntracks; i++)
        if (w->tracks[i].dev == dev && w->tracks[i].id == id)
            return w->tracks[i].tid;
    if (w->ntracks == w->captracks) {
        size_t cap = w->captracks ? 2 * w->captracks : 8;
        track *t = realloc(w->tracks, cap * sizeof *t);
        if (!t)
            return 0;
        w->tracks = t;
        w->captracks = cap;
    }
    track *t = &w->tracks[w->ntracks++];
    *t = (track){dev, id, (int32_t)(1000000000 + w->ntracks), role};
    return t->tid;
}

static void begin_event(writer *w)
{
    fputs(w->first ? "\n" : ",\n", w->f);
    w->first = false;
    w->events++;
}

static double us(uint64_t t) { return t >= t0_ns ? (t - t0_ns) / 1e3 : 0; }

static const char *stall_cause(uint64_t k)
{
    switch (k) {
    case LADEN__STALL_READS:
        return "reads";
    case LADEN__STALL_STAGING:
        return "staging";
    default:
        return "copy";
    }
}

static void write_rec(writer *w, const ring *g, const laden__trace_rec *r)
{
    FILE *f = w->f;
    char dn[16];
    dev_name(dn, sizeof dn, r->dev);
    int32_t tid = g->tid;
    uint64_t t = r->t, dur = r->dur;
    if (r->m0) { /* a span on a stream: its times from the marks */
        uint64_t a = 0, ta = 0, d = 0;
        bool ok = w->marks.resolve && w->marks.resolve(r->m0, &a, &ta) &&
                  w->marks.between(r->m0, r->m1, &d);
        if (!ok) {
            w->unresolved++;
            return;
        }
        if (r->ev == LADEN__EV_STALL && d < STALL_MIN_NS)
            return;
        t = a;
        dur = d;
        tid = stream_tid(w, r->dev, ta,
                         r->ev == LADEN__EV_H2D ? "copy" : "compute");
    }
    switch (r->ev) {
    case LADEN__EV_ENTER:
    case LADEN__EV_EXIT:
        begin_event(w);
        fputs("{\"name\":", f);
        if (r->s) {
            json_str(f, r->s);
        } else {
            fprintf(f, "\"block %" PRIu64 "\"", r->a);
        }
        fprintf(f, ",\"cat\":\"block\",\"ph\":\"%s\",\"ts\":%.3f,"
                "\"pid\":%d,\"tid\":%d",
                r->ev == LADEN__EV_ENTER ? "B" : "E", us(t), w->pid, tid);
        if (r->ev == LADEN__EV_ENTER) {
            fprintf(f, ",\"args\":{\"block\":%" PRIu64 ",\"schedule\":%"
                    PRIu64 ",\"streamed\":%d,\"miss\":%d,\"model\":",
                    r->a, sched_no(w, r->b), (int)(r->c & 1),
                    (int)((r->c >> 1) & 1));
            json_str(f, r->s2);
            fputc('}', f);
        }
        fputc('}', f);
        return;
    case LADEN__EV_RANGE_BEGIN:
    case LADEN__EV_RANGE_END:
        begin_event(w);
        fputs("{\"name\":", f);
        json_str(f, r->s);
        fprintf(f, ",\"cat\":\"range\",\"ph\":\"%s\",\"ts\":%.3f,\"pid\":%d,"
                "\"tid\":%d}",
                r->ev == LADEN__EV_RANGE_BEGIN ? "B" : "E", us(t), w->pid,
                tid);
        return;
    case LADEN__EV_COUNTER:
        begin_event(w);
        fputs("{\"name\":", f);
        char nm[160];
        snprintf(nm, sizeof nm, "%s %s", dn, r->s);
        json_str(f, nm);
        fprintf(f, ",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":%.3f,\"pid\":%d,"
                "\"args\":{\"bytes\":%" PRIu64 "}}",
                us(t), w->pid, r->a);
        return;
    default:
        break;
    }
    begin_event(w);
    const char *cat, *ph = "X";
    char name[192], bn[144];
    if (r->s)
        snprintf(bn, sizeof bn, "%s", r->s);
    else
        snprintf(bn, sizeof bn, "block %" PRIu64, r->a);
    switch (r->ev) {
    case LADEN__EV_READ:
        cat = "read";
        snprintf(name, sizeof name, "read");
        break;
    case LADEN__EV_H2D:
        cat = "h2d";
        snprintf(name, sizeof name, "h2d %s", bn);
        break;
    case LADEN__EV_COMPUTE:
        cat = "compute";
        snprintf(name, sizeof name, "%s", bn);
        break;
    case LADEN__EV_EXPAND:
        cat = "expand";
        snprintf(name, sizeof name, "%s %s", r->s2 ? r->s2 : "expand", bn);
        break;
    case LADEN__EV_STALL:
        cat = "stall";
        snprintf(name, sizeof name, "stall: %s of %s", stall_cause(r->b),
                 bn);
        break;
    case LADEN__EV_SYNC:
        cat = "sync";
        snprintf(name, sizeof name, "synchronize %s", r->s);
        break;
    case LADEN__EV_MISS:
        cat = "miss";
        ph = "i";
        snprintf(name, sizeof name, "miss %s", bn);
        break;
    case LADEN__EV_LOAD:
        cat = "load";
        snprintf(name, sizeof name, "load");
        break;
    case LADEN__EV_UPLOAD:
        cat = "cache";
        snprintf(name, sizeof name, "%s", r->s);
        break;
    case LADEN__EV_EVICT:
        cat = "evict";
        ph = "i";
        snprintf(name, sizeof name, "%s", r->s);
        break;
    case LADEN__EV_FAULT:
        cat = "vbar";
        ph = "i";
        snprintf(name, sizeof name, "%s", r->s);
        break;
    default:
        cat = "other";
        snprintf(name, sizeof name, "event %u", (unsigned)r->ev);
        break;
    }
    fputs("{\"name\":", f);
    json_str(f, name);
    fprintf(f, ",\"cat\":\"%s\",\"ph\":\"%s\",\"ts\":%.3f,", cat, ph, us(t));
    if (ph[0] == 'X')
        fprintf(f, "\"dur\":%.3f,", dur / 1e3);
    else
        fputs("\"s\":\"t\",", f);
    fprintf(f, "\"pid\":%d,\"tid\":%d,\"args\":{", w->pid, tid);
    switch (r->ev) {
    case LADEN__EV_READ:
        fprintf(f, "\"offset\":%" PRIu64 ",\"bytes\":%" PRIu64
                ",\"cached_bytes\":%" PRIu64 ",\"file\":",
                r->a, r->b, r->c);
        json_str(f, r->s);
        break;
    case LADEN__EV_H2D:
        fprintf(f, "\"block\":%" PRIu64 ",\"bytes\":%" PRIu64
                ",\"schedule\":%" PRIu64 ",\"device\":\"%s\"",
                r->a, r->b, sched_no(w, r->c), dn);
        break;
    case LADEN__EV_COMPUTE:
    case LADEN__EV_MISS:
        fprintf(f, "\"block\":%" PRIu64 ",\"schedule\":%" PRIu64, r->a,
                sched_no(w, r->c));
        break;
    case LADEN__EV_EXPAND:
        fprintf(f, "\"block\":%" PRIu64 ",\"bytes\":%" PRIu64
                ",\"schedule\":%" PRIu64 ",\"device\":\"%s\",\"on\":\"%s\"",
                r->a, r->b, sched_no(w, r->c), dn,
                r->m0 ? "stream" : "host");
        break;
    case LADEN__EV_STALL:
        fprintf(f, "\"block\":%" PRIu64 ",\"schedule\":%" PRIu64
                ",\"cause\":\"%s\",\"on\":\"%s\"",
                r->a, sched_no(w, r->c), stall_cause(r->b),
                r->m0 ? "stream" : "host");
        break;
    case LADEN__EV_SYNC:
        fprintf(f, "\"device\":\"%s\"", dn);
        break;
    case LADEN__EV_LOAD:
        fprintf(f, "\"read_bytes\":%" PRIu64 ",\"schedule\":%" PRIu64
                ",\"model\":",
                r->b, sched_no(w, r->c));
        json_str(f, r->s);
        break;
    case LADEN__EV_UPLOAD: /* the cache's own names (CacheStats) */
        fprintf(f, "\"model\":%" PRIu64 ",\"upload_bytes\":%" PRIu64, r->a,
                r->b);
        break;
    case LADEN__EV_EVICT:
        fprintf(f, "\"model\":%" PRIu64 ",\"evicted_bytes\":%" PRIu64, r->a,
                r->b);
        break;
    case LADEN__EV_FAULT:
        fprintf(f, "\"mapped_bytes\":%" PRIu64 ",\"device\":\"%s\"", r->b,
                dn);
        break;
    default:
        break;
    }
    fputs("}}", f);
}

static void write_meta(writer *w, int32_t tid, const char *name)
{
    begin_event(w);
    fprintf(w->f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,"
            "\"tid\":%d,\"args\":{\"name\":", w->pid, tid);
    json_str(w->f, name);
    fputs("}}", w->f);
}

laden_status laden_trace_stop(const char *path, laden_trace_result_t *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    pthread_mutex_lock(&ctl_mu);
    if (!atomic_load(&laden__tracing)) {
        pthread_mutex_unlock(&ctl_mu);
        return laden__fail(LADEN_E_STATE,
                           "laden_trace_stop: no trace is on");
    }
    atomic_store(&laden__tracing, 0);
    uint64_t t1 = laden__now_ns();
    uint64_t sess = atomic_load(&session);
    laden_status s = LADEN_OK;
    writer w = {.pid = (int)getpid(), .first = true};
    pthread_mutex_lock(&marks_mu);
    w.marks = marks;
    pthread_mutex_unlock(&marks_mu);
    uint64_t nthreads = 0;
    if (path && !(w.f = fopen(path, "w")))
        s = laden__fail(LADEN_E_IO, "trace file %s: %s", path,
                        strerror(errno));
    pthread_mutex_lock(&rings_mu);
    if (w.f) {
        fprintf(w.f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{"
                "\"laden\":\"%s\",\"dropped_events\":%" PRIu64
                ",\"seconds\":%.6f},\n\"traceEvents\":[",
                laden_version(), (uint64_t)atomic_load(&dropped),
                (t1 - t0_ns) / 1e9);
        begin_event(&w);
        fprintf(w.f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,"
                "\"args\":{\"name\":\"laden\"}}", w.pid);
        for (ring *g = rings; g; g = g->next) {
            if (atomic_load_explicit(&g->session, memory_order_acquire) !=
                sess)
                continue;
            uint64_t n = atomic_load_explicit(&g->n, memory_order_acquire);
            if (!n)
                continue;
            nthreads++;
            char nm[48];
            snprintf(nm, sizeof nm, "%s", g->name[0] ? g->name : "thread");
            write_meta(&w, g->tid, nm);
            chunk *c = g->first;
            for (uint64_t i = 0; i < n && c; i++) {
                if (i && i % CHUNK == 0)
                    c = atomic_load_explicit(&c->next,
                                             memory_order_acquire);
                if (c)
                    write_rec(&w, g, &c->r[i % CHUNK]);
            }
        }
        for (size_t i = 0; i < w.ntracks; i++) {
            char nm[48], dn[16];
            dev_name(dn, sizeof dn, w.tracks[i].dev);
            snprintf(nm, sizeof nm, "%s %s stream %zu", dn, w.tracks[i].role,
                     i + 1);
            write_meta(&w, w.tracks[i].tid, nm);
        }
        fputs("\n]}\n", w.f);
        if (ferror(w.f) && !s)
            s = laden__fail(LADEN_E_IO, "trace file %s: write failed", path);
        if (fclose(w.f) && !s)
            s = laden__fail(LADEN_E_IO, "trace file %s: %s", path,
                            strerror(errno));
    }
    pthread_mutex_unlock(&rings_mu);
    if (w.marks.release_all)
        w.marks.release_all();
    if (out) {
        out->events = w.events;
        out->dropped = atomic_load(&dropped);
        out->threads = nthreads;
        out->streams = w.ntracks;
        out->unresolved = w.unresolved;
        out->seconds = (t1 - t0_ns) / 1e9;
    }
    free(w.scheds);
    free(w.tracks);
    pthread_mutex_lock(&intern_mu);
    for (interned *x = strings, *nx; x; x = nx) {
        nx = x->next;
        free(x);
    }
    strings = NULL;
    pthread_mutex_unlock(&intern_mu);
    pthread_mutex_unlock(&ctl_mu);
    return s;
}
