/* Block streaming.  See include/laden/stream.h.
 *
 * Slots: streamed block at schedule position p always runs from slot
 * p % nslots.  A slot remembers which block's bytes it holds (or is
 * receiving); a prefetch for the block already there costs nothing, so
 * repeated forwards over a model that fits in the slots copy nothing.
 *
 * Ordering on CUDA, never a host synchronize in the steady state:
 *   copy stream:    wait(slot.free) -> H2D into slot -> record(slot.ready)
 *   compute stream: wait(slot.ready) -> block's kernels -> record(slot.free)
 * Disk blocks are first read by the reader pool into the slot's pinned
 * staging buffer; the H2D is enqueued once the reads have finished, which
 * enter/exit notice by polling (or, for the block about to run, by waiting).
 * Before a staging buffer is refilled the host waits for the event recorded
 * after its last H2D, which finished a lookahead ago in the steady state. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#define _POSIX_C_SOURCE 200809L
#include "laden/stream.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "../core/internal.h"
#include "laden/host.h"
#include "laden/vram.h"

#define ALIGN 256u
#define DEFAULT_LOOKAHEAD 2u

typedef struct tref {
    uint32_t file;
    uint64_t off;       /* absolute offset in the file */
    uint64_t src_bytes;
    laden_dtype src, dst;
    uint64_t nelem;
    uint64_t dst_off;   /* offset in the block's region */
    uint64_t dst_bytes;
    const char *name;   /* for messages; copied */
    const void *host;   /* bytes in host memory instead of a file */
    uint64_t rows;      /* quantized to F8_E4M3: rows with one scale each */
} tref;

typedef struct blk {
    laden_tier tier;
    tref *t;
    uint32_t nt, cap;
    uint64_t bytes;
    int32_t pos;          /* schedule position; -1 if not streamed */
    laden_devptr_t region; /* GPU tier on device; RAM tier on the CPU device;
                              cache schedules: the block's own device copy */
    void *ram;            /* RAM tier: pinned region (cache: pageable) */
    uint64_t ram_len;     /* cache schedules: the mapping's length */
    bool filled;          /* cache schedules: host copy loaded */
    bool resident;        /* cache schedules: has a device copy of its own */
    uint64_t voff;        /* cache schedules with a VBAR: its range there */
    uint64_t sig;         /* signature of the range when last written */
    bool pinned;          /* cache schedules: host copy pinned in place */
} blk;

typedef struct slot {
    laden_devptr_t ptr;
    int64_t block; /* whose bytes are here or arriving; -1: none */
    bool in_use;
    bool reads_pending;
    laden_event_t *ready, *free, *staging_free;
    void *staging;
    laden_io_req_t **reqs;
    uint32_t nreqs;
    laden_status err;
    char errmsg[512];
} slot;

struct laden_sched {
    laden_sched_config cfg;
    bool cuda, loaded, broken, started;
    bool any_disk;
    laden_io_t *io;
    bool own_io;
    laden_io_file_t **files;
    uint32_t nfiles;
    blk *b;
    uint32_t nb, bcap;
    uint32_t *order; /* position -> block */
    uint32_t nstreamed;
    slot *slots;
    uint32_t nslots;
    uint64_t slot_bytes;
    uint32_t max_nt;
    laden_host_t *host;
    laden_stream_t *copy;
    laden_stream_t *compute;
    uintptr_t compute_handle;
    bool cache;                 /* LADEN_SCHED_CACHE */
    bool laid_out;
    uint32_t nfilled;           /* cache: blocks whose host copy is loaded */
    laden_event_t *uploaded;    /* cache: after the last upload */
    laden_event_t *last_use;    /* cache: after the model's last work */
    bool fenced;
    laden_vbar_t *vbar;         /* device copies live here, or NULL */
    laden_devptr_t vbar_base;
    laden_vram_t *vram;         /* the VBAR's context (borrowed) */
    uint64_t slot_charge;       /* bytes charged to vram for the slots */
    laden_sched_stats_t st;
    /* One thread at a time (see hold): the holding thread's id, 0 when
     * free, CLOSED once closed.  The counts are the holder's own. */
    _Atomic uint64_t holder;
    uint32_t depth;             /* holds of the holder, all kinds */
    uint32_t entered;           /* of those, blocks entered not yet exited */
    uint32_t begun;             /* of those, passes begun not yet ended */
};

#define CLOSED UINT64_MAX

/* ---- dtype conversion --------------------------------------------------- */

static float f32_of_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t bits_of_f32(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static uint16_t bf16_of_f32(float f)
{
    uint32_t u = bits_of_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float f32_of_f16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f)
        return f32_of_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* man * 2^-24 */
        return sign ? -f : f;
    }
    return f32_of_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

static uint16_t f16_of_f32(float f)
{
    uint32_t u = bits_of_f32(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: subnormal or zero */
        /* Adding 0.5 aligns the mantissa so the FPU rounds to nearest even
         * at the half's subnormal step (2^-24). */
        float v = f32_of_bits(a) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(bits_of_f32(v) - 0x3f000000u));
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias exponent, round to nearest even */
    return (uint16_t)(sign | (uint16_t)(a >> 13));
}

/* float8 e4m3fn (bias 7, no infinities, 0x7f NaN, max 448) and e5m2
 * (bias 15, IEEE-like), decoded exactly. */
static float f32_of_e4m3(uint8_t v)
{
    float sign = v & 0x80 ? -1.0f : 1.0f;
    unsigned e = (v >> 3) & 0xf, m = v & 7;
    if (e == 15 && m == 7)
        return NAN;
    if (e == 0)
        return sign * ldexpf((float)m, -9);
    return sign * ldexpf(1.0f + (float)m / 8.0f, (int)e - 7);
}

static float f32_of_e5m2(uint8_t v)
{
    uint16_t h = (uint16_t)(v << 8); /* e5m2 is the top byte of a half */
    return f32_of_f16(h);
}

/* Round to nearest even, saturating to +-448 (as a scaled quantization
 * wants: values are within range by construction). */
static uint8_t e4m3_of_f32(float x)
{
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (isnan(x))
        return (uint8_t)(sign | 0x7f);
    if (a >= 448.0f)
        return (uint8_t)(sign | 0x7e);
    if (a < 0.015625f) { /* below the smallest normal, 2^-6: step 2^-9 */
        float q = nearbyintf(a * 512.0f);
        return (uint8_t)(sign | (uint8_t)q); /* q == 8 is the min normal */
    }
    int e;
    float fr = frexpf(a, &e); /* a = fr * 2^e, fr in [0.5, 1) */
    float m = nearbyintf((fr * 2.0f - 1.0f) * 8.0f);
    int exp = e - 1 + 7;
    if (m >= 8.0f) {
        m = 0;
        exp++;
    }
    if (exp > 15 || (exp == 15 && m >= 7.0f))
        return (uint8_t)(sign | 0x7e);
    return (uint8_t)(sign | (uint8_t)(exp << 3) | (uint8_t)m);
}

static float load_f(laden_dtype d, const void *p, uint64_t i)
{
    switch (d) {
    case LADEN_DTYPE_F8_E4M3:
        return f32_of_e4m3(((const uint8_t *)p)[i]);
    case LADEN_DTYPE_F8_E5M2:
        return f32_of_e5m2(((const uint8_t *)p)[i]);
    case LADEN_DTYPE_F32: {
        float f;
        memcpy(&f, (const char *)p + 4 * i, 4);
        return f;
    }
    case LADEN_DTYPE_F16: {
        uint16_t h;
        memcpy(&h, (const char *)p + 2 * i, 2);
        return f32_of_f16(h);
    }
    default: {
        uint16_t h;
        memcpy(&h, (const char *)p + 2 * i, 2);
        return f32_of_bits((uint32_t)h << 16);
    }
    }
}

static bool convertible(laden_dtype d)
{
    return d == LADEN_DTYPE_F32 || d == LADEN_DTYPE_F16 ||
           d == LADEN_DTYPE_BF16;
}

/* Sources that decode exactly to float: the three floats and fp8. */
static bool decodable(laden_dtype d)
{
    return convertible(d) || d == LADEN_DTYPE_F8_E4M3 ||
           d == LADEN_DTYPE_F8_E5M2;
}

/* Quantizes rows x cols floats to e4m3 with one float32 scale per row
 * (amax / 448), scales stored after the data at scale_off. */
static void quantize_rows(laden_dtype from, const void *src, uint64_t rows,
                          uint64_t cols, uint8_t *dst, float *scales)
{
    for (uint64_t r = 0; r < rows; r++) {
        float amax = 0.0f;
        for (uint64_t c = 0; c < cols; c++) {
            float v = fabsf(load_f(from, src, r * cols + c));
            if (v > amax && !isnan(v))
                amax = v;
        }
        float scale = amax > 0.0f && isfinite(amax) ? amax / 448.0f : 1.0f;
        float inv = 1.0f / scale;
        for (uint64_t c = 0; c < cols; c++)
            dst[r * cols + c] =
                e4m3_of_f32(load_f(from, src, r * cols + c) * inv);
        memcpy(&scales[r], &scale, sizeof scale);
    }
}

laden_status laden_stream_convert(laden_dtype from, const void *src,
                                  laden_dtype to, void *dst, uint64_t n)
{
    if (!decodable(from) || !convertible(to))
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "cannot convert %s to %s (F32, F16, BF16 and fp8 "
                           "to F32, F16, BF16)",
                           laden_dtype_name(from) ? laden_dtype_name(from)
                                                  : "?",
                           laden_dtype_name(to) ? laden_dtype_name(to) : "?");
    if (n && (!src || !dst))
        return laden__fail(LADEN_E_INVAL, "laden_stream_convert: NULL buffer");
    if (from == to) {
        memcpy(dst, src, n * (laden_dtype_bits(from) / 8));
        return LADEN_OK;
    }
    for (uint64_t i = 0; i < n; i++) {
        float f = load_f(from, src, i);
        if (to == LADEN_DTYPE_F32) {
            memcpy((char *)dst + 4 * i, &f, 4);
        } else {
            uint16_t h = to == LADEN_DTYPE_F16 ? f16_of_f32(f) : bf16_of_f32(f);
            memcpy((char *)dst + 2 * i, &h, 2);
        }
    }
    return LADEN_OK;
}

/* ---- creation ----------------------------------------------------------- */

laden_status laden_stream_create(const laden_sched_config *cfg,
                                 const laden_st_t *st, laden_sched_t **out)
{
    laden_status s;
    laden_dev_info_t info;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_stream_create: out is NULL");
    *out = NULL;
    if (!cfg)
        return laden__fail(LADEN_E_INVAL, "laden_stream_create: NULL config");
    if ((s = laden_dev_info(cfg->device, &info)))
        return s;
    laden_sched_t *sc = calloc(1, sizeof *sc);
    if (!sc)
        return laden__fail(LADEN_E_NOMEM, "out of memory creating a schedule");
    sc->cfg = *cfg;
    if (sc->cfg.lookahead == 0)
        sc->cfg.lookahead = DEFAULT_LOOKAHEAD;
    if (sc->cfg.lookahead > 63) {
        free(sc);
        return laden__fail(LADEN_E_INVAL, "lookahead %u: at most 63",
                           cfg->lookahead);
    }
    sc->cuda = info.kind == LADEN_DEV_KIND_CUDA;
    sc->cache = (cfg->flags & LADEN_SCHED_CACHE) != 0;
    if (cfg->flags & ~LADEN_SCHED_CACHE) {
        free(sc);
        return laden__fail(LADEN_E_INVAL, "unknown schedule flags 0x%x",
                           cfg->flags);
    }
    sc->io = cfg->io;
    if (!sc->io) {
        if ((s = laden_io_create(NULL, &sc->io)))
            goto fail;
        sc->own_io = true;
    }
    sc->nfiles = st ? (uint32_t)laden_st_file_count(st) : 0;
    sc->files = calloc(sc->nfiles ? sc->nfiles : 1, sizeof *sc->files);
    if (!sc->files) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory creating a schedule");
        goto fail;
    }
    for (uint32_t i = 0; i < sc->nfiles; i++)
        if ((s = laden_st_file_open(st, i, &sc->files[i])))
            goto fail;
    if ((s = laden_host_create(cfg->device, cfg->ram_budget_bytes, &sc->host)))
        goto fail;
    *out = sc;
    return LADEN_OK;
fail:
    laden_stream_destroy(sc);
    return s;
}

static laden_status grow_block(blk *b)
{
    if (b->nt < b->cap)
        return LADEN_OK;
    uint32_t n = b->cap ? b->cap * 2 : 8;
    tref *r = realloc(b->t, n * sizeof *r);
    if (!r)
        return laden__fail(LADEN_E_NOMEM, "out of memory adding a tensor");
    b->t = r;
    b->cap = n;
    return LADEN_OK;
}

static laden_status add_block(laden_sched_t *sc, laden_tier tier,
                              uint32_t *out)
{
    if (out)
        *out = 0;
    if (!sc || !out)
        return laden__fail(LADEN_E_INVAL, "laden_stream_add_block: NULL");
    if (sc->loaded || sc->laid_out)
        return laden__fail(LADEN_E_STATE, "blocks cannot be added after load");
    if (tier != LADEN_TIER_GPU && tier != LADEN_TIER_RAM &&
        tier != LADEN_TIER_DISK && tier != LADEN_TIER_VRAM)
        return laden__fail(LADEN_E_INVAL, "unknown tier %d", (int)tier);
    if (sc->cache && tier != LADEN_TIER_RAM)
        return laden__fail(LADEN_E_INVAL,
                           "a cache schedule keeps every block on the RAM "
                           "tier (residency is set after load)");
    if (sc->nb == sc->bcap) {
        uint32_t n = sc->bcap ? sc->bcap * 2 : 16;
        blk *b = realloc(sc->b, n * sizeof *b);
        if (!b)
            return laden__fail(LADEN_E_NOMEM, "out of memory adding a block");
        sc->b = b;
        sc->bcap = n;
    }
    memset(&sc->b[sc->nb], 0, sizeof sc->b[0]);
    sc->b[sc->nb].tier = tier;
    sc->b[sc->nb].pos = -1;
    *out = sc->nb++;
    return LADEN_OK;
}

static laden_status add_tensor(laden_sched_t *sc, uint32_t block,
                               const laden_st_t *st, size_t st_index,
                               laden_dtype dtype, uint32_t *out)
{
    laden_st_tensor_t t;
    laden_status s;
    if (out)
        *out = 0;
    if (!sc || !st || !out || block >= sc->nb)
        return laden__fail(LADEN_E_INVAL,
                           "laden_stream_add_tensor: bad schedule or block");
    if (sc->loaded || sc->laid_out)
        return laden__fail(LADEN_E_STATE, "tensors cannot be added after load");
    if ((s = laden_st_tensor_at(st, st_index, &t)))
        return s;
    if (t.file_index >= sc->nfiles)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s' is from another checkpoint",
                           t.name);
    blk *b = &sc->b[block];
    uint64_t nelem = 1;
    for (uint32_t d = 0; d < t.ndim; d++)
        nelem *= t.shape[d]; /* validated by st: cannot overflow */
    bool quantize = dtype == LADEN_DTYPE_F8_E4M3 && convertible(t.dtype);
    if (quantize && t.ndim < 1)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "tensor '%.200s': fp8 storage needs at least one "
                           "dimension (one scale per row)",
                           t.name);
    if (dtype != t.dtype && !quantize) {
        if (!decodable(t.dtype) || !convertible(dtype))
            return laden__fail(LADEN_E_UNSUPPORTED,
                               "tensor '%.200s': cannot store %s as %s (F32, "
                               "F16 and BF16 convert)",
                               t.name, laden_dtype_name(t.dtype),
                               laden_dtype_name(dtype) ? laden_dtype_name(dtype)
                                                       : "?");
        if (b->tier == LADEN_TIER_DISK)
            return laden__fail(LADEN_E_UNSUPPORTED,
                               "tensor '%.200s' is %s in the checkpoint and "
                               "cannot be stored as %s on the disk tier, "
                               "which reads the file as it is; put its block "
                               "in RAM or keep its dtype",
                               t.name, laden_dtype_name(t.dtype),
                               laden_dtype_name(dtype));
    }
    if ((s = grow_block(b)))
        return s;
    tref *r = &b->t[b->nt];
    memset(r, 0, sizeof *r);
    r->file = t.file_index;
    r->off = t.offset_bytes;
    r->src_bytes = t.size_bytes;
    r->src = t.dtype;
    r->dst = dtype;
    r->nelem = nelem;
    r->dst_bytes = dtype == t.dtype ? t.size_bytes
                                    : nelem * (laden_dtype_bits(dtype) / 8);
    if (quantize) {
        /* e4m3 data, then one float32 scale per row, 16-byte aligned. */
        r->rows = t.shape[0];
        r->dst_bytes = ((nelem + 15) & ~(uint64_t)15) + 4 * r->rows;
    }
    r->name = strdup(t.name);
    if (!r->name)
        return laden__fail(LADEN_E_NOMEM, "out of memory adding a tensor");
    *out = b->nt++;
    return LADEN_OK;
}

static laden_status add_host_tensor(laden_sched_t *sc, uint32_t block,
                                    const void *src, laden_dtype sdt,
                                    uint64_t n, laden_dtype dtype,
                                    uint32_t *out)
{
    laden_status s;
    uint64_t bytes;
    if (out)
        *out = 0;
    if (!sc || !out || block >= sc->nb || (!src && n))
        return laden__fail(LADEN_E_INVAL,
                           "laden_stream_add_host_tensor: bad argument");
    if (sc->loaded || sc->laid_out)
        return laden__fail(LADEN_E_STATE, "tensors cannot be added after load");
    blk *b = &sc->b[block];
    if (b->tier == LADEN_TIER_DISK)
        return laden__fail(LADEN_E_INVAL,
                           "a tensor from host memory cannot be on the disk "
                           "tier");
    if (!laden_dtype_bits(sdt) || !laden_dtype_bits(dtype) ||
        (sdt != dtype && (!convertible(sdt) || !convertible(dtype))))
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "cannot store %s as %s (F32, F16 and BF16 convert)",
                           laden_dtype_name(sdt) ? laden_dtype_name(sdt) : "?",
                           laden_dtype_name(dtype) ? laden_dtype_name(dtype)
                                                   : "?");
    if (!laden__mul_u64(n, laden_dtype_bits(sdt), &bytes) || bytes % 8)
        return laden__fail(LADEN_E_INVAL, "bad element count %llu",
                           (unsigned long long)n);
    if ((s = grow_block(b)))
        return s;
    tref *r = &b->t[b->nt];
    memset(r, 0, sizeof *r);
    r->host = src;
    r->src_bytes = bytes / 8;
    r->src = sdt;
    r->dst = dtype;
    r->nelem = n;
    r->dst_bytes = n * laden_dtype_bits(dtype) / 8;
    r->name = strdup("<host tensor>");
    if (!r->name)
        return laden__fail(LADEN_E_NOMEM, "out of memory adding a tensor");
    *out = b->nt++;
    return LADEN_OK;
}

/* ---- helpers ------------------------------------------------------------ */

static bool streamed(const laden_sched_t *sc, const blk *b)
{
    if (b->resident)
        return false;
    return b->tier == LADEN_TIER_DISK ||
           (b->tier == LADEN_TIER_RAM && (sc->cuda || sc->cache));
}

/* Reads block b's tensors into host memory at dst (its packed layout),
 * converting where the stored dtype differs. */
static laden_status read_block_host(laden_sched_t *sc, blk *b, char *dst)
{
    laden_status s = LADEN_OK, w;
    laden_io_req_t **reqs = calloc(b->nt ? b->nt : 1, sizeof *reqs);
    void **tmp = calloc(b->nt ? b->nt : 1, sizeof *tmp);
    if (!reqs || !tmp) {
        free(reqs);
        free(tmp);
        return laden__fail(LADEN_E_NOMEM, "out of memory loading a block");
    }
    uint32_t n = 0;
    for (; n < b->nt; n++) {
        tref *r = &b->t[n];
        char *to = dst + r->dst_off;
        if (r->host) {
            if (r->src == r->dst)
                memcpy(to, r->host, r->src_bytes);
            else if ((s = laden_stream_convert(r->src, r->host, r->dst, to,
                                               r->nelem)))
                break;
            reqs[n] = NULL;
            continue;
        }
        if (r->src != r->dst) {
            if (!(tmp[n] = malloc(r->src_bytes ? r->src_bytes : 1))) {
                s = laden__fail(LADEN_E_NOMEM,
                                "out of memory converting '%.200s'", r->name);
                break;
            }
            to = tmp[n];
        }
        if ((s = laden_io_submit(sc->io, sc->files[r->file], r->off,
                                 r->src_bytes, to, &reqs[n])))
            break;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (!reqs[i])
            continue;
        if ((w = laden_io_wait(sc->io, reqs[i])) && !s)
            s = w;
        else if (!w)
            sc->st.load_read_bytes += b->t[i].src_bytes;
    }
    for (uint32_t i = 0; i < b->nt && !s; i++) {
        tref *r = &b->t[i];
        if (!tmp[i] || r->host)
            continue;
        if (r->rows) {
            uint64_t cols = r->rows ? r->nelem / r->rows : 0;
            quantize_rows(r->src, tmp[i], r->rows, cols,
                          (uint8_t *)dst + r->dst_off,
                          (float *)(void *)(dst + r->dst_off +
                                            ((r->nelem + 15) & ~(uint64_t)15)));
        } else {
            s = laden_stream_convert(r->src, tmp[i], r->dst, dst + r->dst_off,
                                     r->nelem);
        }
    }
    for (uint32_t i = 0; i < b->nt; i++)
        free(tmp[i]);
    free(tmp);
    free(reqs);
    return s;
}

/* Bytes charged to the VRAM context for the slots become `want`.
 * LADEN_E_BUDGET, with the charge as it was, if the context has no room. */
static laden_status charge_slots(laden_sched_t *sc, uint64_t want)
{
    laden_status s;
    if (!sc->vram || want == sc->slot_charge)
        return LADEN_OK;
    if (want < sc->slot_charge) {
        laden_vram_uncharge(sc->vram, sc->slot_charge - want);
        sc->slot_charge = want;
        return LADEN_OK;
    }
    if ((s = laden_vram_charge(sc->vram, want - sc->slot_charge))) {
        laden__error_prefix("slots of %s", laden__bytes(want).s);
        return s;
    }
    sc->slot_charge = want;
    return LADEN_OK;
}

/* Frees the slots and staging, after their copies and reads. */
static void free_slots(laden_sched_t *sc)
{
    if (sc->copy)
        laden_dev_stream_synchronize(sc->copy);
    if (!sc->slots)
        sc->nslots = 0;
    for (uint32_t i = 0; i < sc->nslots; i++) {
        slot *sl = &sc->slots[i];
        for (uint32_t k = 0; k < sl->nreqs; k++)
            laden_io_wait(sc->io, sl->reqs[k]);
        sl->nreqs = 0;
        free(sl->reqs);
        laden_dev_event_destroy(sl->ready);
        laden_dev_event_destroy(sl->free);
        laden_dev_event_destroy(sl->staging_free);
        laden_dev_mem_free(sc->cfg.device, sl->ptr);
        if (sl->staging)
            laden_host_free(sc->host, sl->staging);
    }
    free(sc->slots);
    sc->slots = NULL;
    sc->nslots = 0;
    charge_slots(sc, 0);
    laden_dev_stream_destroy(sc->compute);
    sc->compute = NULL;
    if (sc->started)
        sc->st.generation++;
    sc->started = false;
    laden_host_trim(sc->host);
}

static void free_all(laden_sched_t *sc)
{
    free_slots(sc);
    if (sc->fenced)
        laden_dev_event_synchronize(sc->last_use);
    for (uint32_t i = 0; i < sc->nb; i++) {
        blk *b = &sc->b[i];
        if ((b->tier == LADEN_TIER_GPU || b->resident) && b->region &&
            !sc->vbar)
            laden_dev_mem_free(sc->cfg.device, b->region);
        if (b->ram && sc->cache) {
            if (b->pinned)
                laden_dev_host_unregister(sc->cfg.device, b->ram);
            munmap(b->ram, b->ram_len);
        } else if (b->ram) {
            laden_host_free(sc->host, b->ram);
        }
        b->region = 0;
        b->ram = NULL;
        b->resident = b->pinned = false;
    }
    laden_vbar_destroy(sc->vbar); /* after the copies (free_slots synced) */
    sc->vbar = NULL;
    laden_dev_stream_destroy(sc->copy);
    sc->copy = NULL;
    laden_dev_event_destroy(sc->uploaded);
    laden_dev_event_destroy(sc->last_use);
    sc->uploaded = sc->last_use = NULL;
    sc->fenced = false;
    free(sc->order);
    sc->order = NULL;
    laden_host_trim(sc->host);
}

void laden_stream_destroy(laden_sched_t *sc)
{
    if (!sc)
        return;
    /* Kernels of the model may still read its weights and slots (the
     * caller dropped it right after enqueueing a forward); VBAR pages are
     * unmapped without the implicit wait of a device free. */
    if (sc->cuda && sc->compute)
        laden_dev_stream_synchronize(sc->compute);
    free_all(sc);
    for (uint32_t i = 0; i < sc->nb; i++) {
        for (uint32_t k = 0; k < sc->b[i].nt; k++)
            free((char *)sc->b[i].t[k].name);
        free(sc->b[i].t);
    }
    free(sc->b);
    for (uint32_t i = 0; i < sc->nfiles && sc->files; i++)
        laden_io_file_close(sc->files[i]);
    free(sc->files);
    laden_host_destroy(sc->host);
    if (sc->own_io)
        laden_io_destroy(sc->io);
    free(sc);
}

/* ---- load ---------------------------------------------------------------- */

static void relayout(laden_sched_t *sc);

/* Packs each block's tensors (aligned for any kernel), orders the
 * streamed blocks and creates the copy stream and events.  Once. */
static laden_status layout(laden_sched_t *sc)
{
    laden_status s;
    int32_t dev = sc->cfg.device;
    if (sc->laid_out)
        return LADEN_OK;
    for (uint32_t i = 0; i < sc->nb; i++) {
        blk *b = &sc->b[i];
        uint64_t off = 0;
        for (uint32_t k = 0; k < b->nt; k++) {
            off = (off + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
            b->t[k].dst_off = off;
            off += b->t[k].dst_bytes;
        }
        b->bytes = off;
        if (b->nt > sc->max_nt)
            sc->max_nt = b->nt;
        uint64_t *tier_bytes = b->tier == LADEN_TIER_RAM    ? &sc->st.ram_bytes
                               : b->tier == LADEN_TIER_DISK ? &sc->st.disk_bytes
                                                            : &sc->st.gpu_bytes;
        *tier_bytes += b->bytes;
    }
    sc->order = calloc(sc->nb ? sc->nb : 1, sizeof *sc->order);
    if (!sc->order)
        return laden__fail(LADEN_E_NOMEM, "out of memory laying out blocks");
    relayout(sc);
    if ((sc->cuda || sc->cache) &&
        (s = laden_dev_stream_create(dev, &sc->copy)))
        return s;
    if (sc->cache && ((s = laden_dev_event_create(dev, 0, &sc->uploaded)) ||
                      (s = laden_dev_event_create(dev, 0, &sc->last_use))))
        return s;
    sc->laid_out = true;
    return LADEN_OK;
}

/* Cache schedules: block b's host copy, in a mapping of its own. */
static laden_status fill_block(laden_sched_t *sc, uint32_t i)
{
    blk *b = &sc->b[i];
    laden_status s;
    if (b->bytes) {
        b->ram_len = (b->bytes + 4095) & ~(uint64_t)4095;
        void *m = mmap(NULL, (size_t)b->ram_len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
            return laden__fail(LADEN_E_NOMEM,
                               "cannot allocate %s of host memory for block %u",
                               laden__bytes(b->bytes).s, i);
        b->ram = m;
        if ((s = read_block_host(sc, b, b->ram))) {
            munmap(b->ram, b->ram_len);
            b->ram = NULL;
            return s;
        }
    }
    b->filled = true;
    if (++sc->nfilled == sc->nb)
        sc->loaded = true;
    return LADEN_OK;
}

static laden_status load_block(laden_sched_t *sc, uint32_t block)
{
    laden_status s;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_load_block: NULL");
    if (!sc->cache)
        return laden__fail(LADEN_E_STATE, "laden_stream_load_block: only for "
                           "schedules created with LADEN_SCHED_CACHE");
    if (sc->broken)
        return laden__fail(LADEN_E_STATE, "the schedule failed to load");
    if (block >= sc->nb)
        return laden__fail(LADEN_E_INVAL, "laden_stream_load_block: no block "
                           "%u (%u blocks)", block, sc->nb);
    if (sc->b[block].filled)
        return laden__fail(LADEN_E_STATE, "block %u is loaded already",
                           block);
    if ((s = layout(sc))) {
        free_all(sc);
        sc->broken = true;
        return s;
    }
    return fill_block(sc, block);
}

/* 1 if block b streams, or may once placed (VRAM tier). */
static bool may_stream(const laden_sched_t *sc, const blk *b)
{
    return b->tier == LADEN_TIER_DISK ||
           ((b->tier == LADEN_TIER_RAM || b->tier == LADEN_TIER_VRAM) &&
            sc->cuda);
}

/* A VRAM-tier block that got no device memory streams from pinned RAM. */
static void demote(laden_sched_t *sc, blk *b)
{
    b->tier = LADEN_TIER_RAM;
    b->region = 0;
    sc->st.gpu_bytes -= b->bytes;
    sc->st.ram_bytes += b->bytes;
    sc->st.offloaded_bytes += b->bytes;
}

/* A VBAR of `total` bytes in vram, and its base address. */
static laden_status new_vbar(laden_vram_t *vram, uint64_t total,
                             laden_vbar_t **out, laden_devptr_t *base)
{
    laden_vbar_info_t vi;
    laden_status s = laden_vbar_create(vram, total ? total : 1, out);
    if (s)
        return s;
    laden_vbar_info(*out, &vi);
    *base = vi.base;
    return LADEN_OK;
}

/* Gives GPU- or VRAM-tier block i its device memory: the next range of
 * the VBAR, or an allocation of its own.  A VRAM-tier block that gets
 * none moves to the RAM tier (*moved); a GPU-tier block that gets none is
 * an error.  In a VBAR the pages stay pinned for the schedule's life:
 * nothing else holds the block's bytes. */
static laden_status place_block(laden_sched_t *sc, uint32_t i, bool *moved)
{
    blk *b = &sc->b[i];
    laden_status s = LADEN_OK;
    int res = 1;
    if (b->bytes && sc->vbar) {
        uint64_t sig;
        laden_vbar_alloc(sc->vbar, b->bytes, &b->voff); /* sized so */
        if ((s = laden_vbar_fault(sc->vbar, b->voff, b->bytes, &res, &sig)))
            return s;
        b->region = res ? sc->vbar_base + b->voff : 0;
    } else if (b->bytes) {
        s = laden_dev_mem_alloc(sc->cfg.device, b->bytes, &b->region);
        res = s == LADEN_OK;
        if (s && s != LADEN_E_DEVICE_NOMEM)
            return s;
    }
    if (!res) {
        if (b->tier == LADEN_TIER_GPU)
            return sc->vbar ? laden__fail(LADEN_E_BUDGET,
                                          "block %u (%s) must be on the "
                                          "device, and the VRAM context has "
                                          "no room for it",
                                          i, laden__bytes(b->bytes).s)
                            : s;
        laden__error_clear();
        demote(sc, b);
        *moved = true;
        return LADEN_OK;
    }
    b->tier = LADEN_TIER_GPU;
    sc->st.device_bytes += b->bytes;
    return LADEN_OK;
}

/* Gives the GPU tier, then the VRAM tier in order, their device memory
 * (place_block): the lower offsets of a VBAR are the more important.  In
 * a VRAM context the slots' room is charged first, for the largest block
 * that may stream, so that a block that does not fit can still stream. */
static laden_status place_device_blocks(laden_sched_t *sc)
{
    laden_status s;
    bool moved = false;
    if (sc->vram) {
        uint64_t total = 0, largest = 0;
        uint32_t nmay = 0;
        for (uint32_t i = 0; i < sc->nb; i++) {
            blk *b = &sc->b[i];
            if (b->tier == LADEN_TIER_GPU || b->tier == LADEN_TIER_VRAM)
                total += (b->bytes + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
            if (may_stream(sc, b)) {
                nmay++;
                if (b->bytes > largest)
                    largest = b->bytes;
            }
        }
        uint32_t nslots = nmay < sc->cfg.lookahead + 1
                              ? nmay
                              : sc->cfg.lookahead + 1;
        if ((s = charge_slots(sc, (uint64_t)nslots * largest)) ||
            (total && (s = new_vbar(sc->vram, total, &sc->vbar,
                                    &sc->vbar_base))))
            return s;
    }
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < sc->nb; i++)
            if (sc->b[i].tier == (pass ? LADEN_TIER_VRAM : LADEN_TIER_GPU) &&
                (s = place_block(sc, i, &moved)))
                return s;
    if (moved)
        relayout(sc);
    if (!sc->nstreamed)
        charge_slots(sc, 0);
    return LADEN_OK;
}

static laden_status load(laden_sched_t *sc)
{
    laden_status s = LADEN_OK;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_load: NULL schedule");
    if (sc->loaded || sc->broken)
        return laden__fail(LADEN_E_STATE, "the schedule is already loaded");
    if ((s = layout(sc)))
        goto fail;
    if (sc->cache) {
        for (uint32_t i = 0; i < sc->nb; i++)
            if (!sc->b[i].filled && (s = fill_block(sc, i)))
                goto fail;
        sc->loaded = true;
        return LADEN_OK;
    }
    if ((s = place_device_blocks(sc)))
        goto fail;
    uint64_t max_gpu = 0;
    for (uint32_t i = 0; i < sc->nb; i++)
        if (sc->b[i].tier == LADEN_TIER_GPU && sc->b[i].bytes > max_gpu)
            max_gpu = sc->b[i].bytes;
    /* The RAM tier, read in place; then the GPU tier through one pinned
     * buffer the size of the largest GPU block. */
    for (uint32_t i = 0; i < sc->nb; i++) {
        blk *b = &sc->b[i];
        if (b->tier != LADEN_TIER_RAM || !b->bytes)
            continue;
        if ((s = laden_host_alloc(sc->host, b->bytes, &b->ram)))
            goto fail;
        if (!sc->cuda)
            b->region = (laden_devptr_t)(uintptr_t)b->ram;
        if ((s = read_block_host(sc, b, b->ram)))
            goto fail;
    }
    void *tmp = NULL;
    for (uint32_t i = 0; i < sc->nb && !s; i++) {
        blk *b = &sc->b[i];
        if (b->tier != LADEN_TIER_GPU || !b->bytes)
            continue;
        if (!sc->cuda) {
            s = read_block_host(sc, b, (char *)(uintptr_t)b->region);
            continue;
        }
        if (!tmp && (s = laden_host_alloc(sc->host, max_gpu, &tmp)))
            break;
        if (!(s = read_block_host(sc, b, tmp)) &&
            !(s = laden_dev_copy_h2d(sc->copy, b->region, tmp, b->bytes)))
            s = laden_dev_stream_synchronize(sc->copy);
    }
    if (tmp)
        laden_host_free(sc->host, tmp);
    if (s)
        goto fail;
    laden_host_trim(sc->host); /* the GPU tier's buffer is not kept pinned */
    sc->loaded = true;
    return LADEN_OK;
fail:
    free_all(sc);
    sc->broken = true;
    return s;
}

/* Checks a (block, tensor) argument of a loaded schedule. */
static laden_status tensor_arg(laden_sched_t *sc, uint32_t block, uint32_t i,
                               bool have_out, const char *call)
{
    if (!sc || !have_out || block >= sc->nb || i >= sc->b[block].nt)
        return laden__fail(LADEN_E_INVAL, "%s: bad block or tensor", call);
    if (!sc->loaded && !(sc->cache && sc->b[block].filled))
        return laden__fail(LADEN_E_STATE, "%s: the schedule is not loaded",
                           call);
    return LADEN_OK;
}

static laden_status tensor_ptr(laden_sched_t *sc, uint32_t block,
                               uint32_t i, laden_devptr_t *out)
{
    if (out)
        *out = 0;
    laden_status s = tensor_arg(sc, block, i, out != NULL,
                                "laden_stream_tensor_ptr");
    if (s)
        return s;
    blk *b = &sc->b[block];
    if (streamed(sc, b) && !sc->started)
        return laden__fail(LADEN_E_STATE,
                           "block %u is streamed: its slot exists once the "
                           "schedule is started",
                           block);
    laden_devptr_t base = streamed(sc, b)
                              ? sc->slots[(uint32_t)b->pos % sc->nslots].ptr
                              : b->region;
    *out = base + b->t[i].dst_off;
    return LADEN_OK;
}

static laden_status host_ptr(laden_sched_t *sc, uint32_t block,
                             uint32_t i, void **out)
{
    if (out)
        *out = NULL;
    laden_status s = tensor_arg(sc, block, i, out != NULL,
                                "laden_stream_host_ptr");
    if (s)
        return s;
    blk *b = &sc->b[block];
    if (b->ram)
        *out = (char *)b->ram + b->t[i].dst_off;
    return LADEN_OK;
}

int laden_stream_is_streamed(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->nb && streamed(sc, &sc->b[block]);
}

/* ---- the hot path ---------------------------------------------------------- */

/* Waits for the slot's reads; on success enqueues staging -> slot. */
static laden_status finish_reads(laden_sched_t *sc, slot *sl, bool discard)
{
    laden_status s = LADEN_OK, w;
    for (uint32_t k = 0; k < sl->nreqs; k++)
        if ((w = laden_io_wait(sc->io, sl->reqs[k])) && !s) {
            s = w;
            snprintf(sl->errmsg, sizeof sl->errmsg, "%s", laden_last_error());
        }
    sl->nreqs = 0;
    sl->reads_pending = false;
    if (discard || sl->err)
        return LADEN_OK; /* a submit failed: the error is reported at enter */
    if (s) {
        sl->err = s;
        return LADEN_OK;
    }
    blk *b = &sc->b[sl->block];
    sc->st.read_bytes += b->bytes;
    if (!sc->cuda)
        return LADEN_OK; /* read straight into the slot */
    if ((s = laden_dev_stream_wait_event(sc->copy, sl->free)) ||
        (s = laden_dev_copy_h2d(sc->copy, sl->ptr, sl->staging, b->bytes)) ||
        (s = laden_dev_event_record(sl->ready, sc->copy)) ||
        (s = laden_dev_event_record(sl->staging_free, sc->copy)))
        return s;
    sc->st.h2d_bytes += b->bytes;
    return LADEN_OK;
}

/* Starts putting block bi's bytes into slot sl. */
static laden_status issue_load(laden_sched_t *sc, slot *sl, uint32_t bi)
{
    laden_status s;
    blk *b = &sc->b[bi];
    if (sl->reads_pending)
        finish_reads(sc, sl, true);
    sl->block = bi;
    sl->err = LADEN_OK;
    if (b->tier == LADEN_TIER_RAM) {
        if ((s = laden_dev_stream_wait_event(sc->copy, sl->free)) ||
            (s = laden_dev_copy_h2d(sc->copy, sl->ptr, b->ram, b->bytes)) ||
            (s = laden_dev_event_record(sl->ready, sc->copy))) {
            sl->block = -1;
            return s;
        }
        sc->st.h2d_bytes += b->bytes;
        return LADEN_OK;
    }
    char *dst = sc->cuda ? sl->staging : (char *)(uintptr_t)sl->ptr;
    if (sc->cuda && (s = laden_dev_event_synchronize(sl->staging_free))) {
        sl->block = -1;
        return s;
    }
    for (uint32_t k = 0; k < b->nt; k++) {
        tref *r = &b->t[k];
        s = laden_io_submit(sc->io, sc->files[r->file], r->off, r->src_bytes,
                            dst + r->dst_off, &sl->reqs[sl->nreqs]);
        if (s) {
            sl->err = s;
            snprintf(sl->errmsg, sizeof sl->errmsg, "%s", laden_last_error());
            break;
        }
        sl->nreqs++;
    }
    sl->reads_pending = true;
    return LADEN_OK;
}

/* Enqueues the copies of disk blocks whose reads have finished. */
static laden_status poll_reads(laden_sched_t *sc)
{
    for (uint32_t i = 0; i < sc->nslots; i++) {
        slot *sl = &sc->slots[i];
        if (!sl->reads_pending)
            continue;
        bool all = true;
        for (uint32_t k = 0; k < sl->nreqs && all; k++) {
            int done = 0;
            laden_io_poll(sc->io, sl->reqs[k], &done);
            all = done != 0;
        }
        if (all) {
            laden_status s = finish_reads(sc, sl, false);
            if (s)
                return s;
        }
    }
    return LADEN_OK;
}

/* Loads the blocks at positions pos..pos+count-1 (cyclically) into their
 * slots.  A slot wanted by a nearer block of the window is left to it: at
 * the wrap of the schedule two blocks of one window can share a slot. */
static laden_status prefetch_from(laden_sched_t *sc, uint32_t pos,
                                  uint32_t count)
{
    uint64_t claimed = 0;
    for (uint32_t k = 0; k < count && k < sc->nstreamed; k++) {
        uint32_t p = (pos + k) % sc->nstreamed;
        uint32_t bi = sc->order[p];
        uint32_t si = p % sc->nslots;
        slot *sl = &sc->slots[si];
        if (claimed & (1ull << si))
            break; /* the rest of the window must wait for this slot */
        claimed |= 1ull << si;
        if (sl->in_use || sl->block == (int64_t)bi)
            continue;
        laden_status s = issue_load(sc, sl, bi);
        if (s)
            return s;
    }
    return poll_reads(sc);
}

static laden_status start(laden_sched_t *sc, uint32_t lookahead)
{
    laden_status s = LADEN_OK;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_start: NULL schedule");
    if (!sc->loaded)
        return laden__fail(LADEN_E_STATE, "the schedule is not loaded");
    if (sc->started)
        return laden__fail(LADEN_E_STATE, "the schedule is already started");
    if (lookahead > 63)
        return laden__fail(LADEN_E_INVAL, "lookahead %u: at most 63",
                           lookahead);
    if (lookahead)
        sc->cfg.lookahead = lookahead;
    int32_t dev = sc->cfg.device;
    sc->nslots = sc->nstreamed < sc->cfg.lookahead + 1 ? sc->nstreamed
                                                       : sc->cfg.lookahead + 1;
    sc->slots = calloc(sc->nslots ? sc->nslots : 1, sizeof *sc->slots);
    if (!sc->slots) {
        s = laden__fail(LADEN_E_NOMEM, "out of memory creating slots");
        goto fail;
    }
    if ((s = charge_slots(sc, (uint64_t)sc->nslots * sc->slot_bytes)))
        goto fail;
    for (uint32_t i = 0; i < sc->nslots; i++) {
        slot *sl = &sc->slots[i];
        sl->block = -1;
        if (!(sl->reqs = calloc(sc->max_nt ? sc->max_nt : 1, sizeof *sl->reqs))) {
            s = laden__fail(LADEN_E_NOMEM, "out of memory creating slots");
            goto fail;
        }
        if ((s = laden_dev_mem_alloc(dev, sc->slot_bytes ? sc->slot_bytes : 1,
                                     &sl->ptr)))
            goto fail;
        if ((sc->cuda || sc->cache) &&
            ((s = laden_dev_event_create(dev, 0, &sl->ready)) ||
             (s = laden_dev_event_create(dev, 0, &sl->free)) ||
             (s = laden_dev_event_create(dev, 0, &sl->staging_free))))
            goto fail;
        if (sc->cuda && sc->any_disk &&
            (s = laden_host_alloc(sc->host, sc->slot_bytes, &sl->staging)))
            goto fail;
    }
    sc->started = true;
    sc->st.generation++; /* the slots' addresses */
    return prefetch_from(sc, 0, sc->nslots);
fail:
    free_slots(sc);
    return s;
}

static laden_status stop(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_stop: NULL schedule");
    if (!sc->started)
        return LADEN_OK;
    if (sc->fenced) {
        laden_status s = laden_dev_event_synchronize(sc->last_use);
        if (s)
            return s;
    }
    free_slots(sc);
    return LADEN_OK;
}

static laden_status compute_stream(laden_sched_t *sc, uintptr_t handle)
{
    if (sc->compute && sc->compute_handle == handle)
        return LADEN_OK;
    laden_dev_stream_destroy(sc->compute);
    sc->compute = NULL;
    laden_status s = laden_dev_stream_wrap(sc->cfg.device, handle, &sc->compute);
    if (!s)
        sc->compute_handle = handle;
    return s;
}

static laden_status check_block(laden_sched_t *sc, uint32_t block,
                                const char *call)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    if (!sc->loaded)
        return laden__fail(LADEN_E_STATE, "%s: the schedule is not loaded",
                           call);
    if (block >= sc->nb)
        return laden__fail(LADEN_E_INVAL, "%s: no block %u (%u blocks)", call,
                           block, sc->nb);
    return LADEN_OK;
}

/* The slot a streamed block runs from; *out NULL for a resident block. */
static laden_status block_slot(laden_sched_t *sc, uint32_t block,
                               const char *call, slot **out)
{
    *out = NULL;
    laden_status s = check_block(sc, block, call);
    if (s)
        return s;
    blk *b = &sc->b[block];
    if (!streamed(sc, b))
        return LADEN_OK;
    if (!sc->started)
        return laden__fail(LADEN_E_STATE, "%s: the schedule is not started",
                           call);
    *out = &sc->slots[(uint32_t)b->pos % sc->nslots];
    return LADEN_OK;
}

static laden_status enter(laden_sched_t *sc, uint32_t block,
                          uintptr_t handle)
{
    slot *sl;
    laden_status s = block_slot(sc, block, "laden_stream_enter", &sl);
    if (s || !sl)
        return s;
    blk *b = &sc->b[block];
    if (sl->in_use)
        return laden__fail(LADEN_E_STATE,
                           "block %u entered while block %lld, which shares "
                           "its slot, is still running",
                           block, (long long)sl->block);
    sc->st.enters++;
    if (sl->block != (int64_t)block) {
        sc->st.misses++;
        if ((s = issue_load(sc, sl, block)))
            return s;
    }
    if (sl->reads_pending && (s = finish_reads(sc, sl, false)))
        return s;
    if (sl->err) {
        s = sl->err;
        sl->err = LADEN_OK;
        sl->block = -1; /* the next enter reads again */
        return laden__fail(s, "%s", sl->errmsg);
    }
    if (sc->cuda && ((s = compute_stream(sc, handle)) ||
                     (s = laden_dev_stream_wait_event(sc->compute, sl->ready))))
        return s;
    if (!sc->cuda && b->tier == LADEN_TIER_RAM &&
        (s = laden_dev_event_synchronize(sl->ready)))
        return s; /* the CPU device's copy worker */
    sl->in_use = true;
    return prefetch_from(sc, (uint32_t)b->pos + 1, sc->cfg.lookahead);
}

static laden_status leave(laden_sched_t *sc, uint32_t block,
                          uintptr_t handle)
{
    slot *sl;
    laden_status s = block_slot(sc, block, "laden_stream_exit", &sl);
    if (s || !sl)
        return s;
    blk *b = &sc->b[block];
    if (!sl->in_use || sl->block != (int64_t)block)
        return laden__fail(LADEN_E_STATE,
                           "laden_stream_exit: block %u is not running",
                           block);
    sl->in_use = false;
    if (sc->cuda && ((s = compute_stream(sc, handle)) ||
                     (s = laden_dev_event_record(sl->free, sc->compute))))
        return s;
    /* The slot just freed may be the one a block ahead needs: when the
     * schedule's length is not a multiple of nslots, the first blocks of the
     * next pass share slots with the last of this one. */
    return prefetch_from(sc, (uint32_t)b->pos + 1, sc->cfg.lookahead);
}

static laden_status synchronize(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_synchronize: NULL");
    for (uint32_t i = 0; i < sc->nslots; i++)
        if (sc->slots[i].reads_pending)
            finish_reads(sc, &sc->slots[i], false);
    return sc->copy ? laden_dev_stream_synchronize(sc->copy) : LADEN_OK;
}

/* ---- cache schedules ------------------------------------------------------ */

/* Positions and slot size after the set of streamed blocks changed. */
static void relayout(laden_sched_t *sc)
{
    sc->nstreamed = 0;
    sc->slot_bytes = 0;
    sc->any_disk = false;
    for (uint32_t i = 0; i < sc->nb; i++) {
        blk *b = &sc->b[i];
        b->pos = -1;
        if (!streamed(sc, b))
            continue;
        b->pos = (int32_t)sc->nstreamed;
        sc->order[sc->nstreamed++] = i;
        if (b->bytes > sc->slot_bytes)
            sc->slot_bytes = b->bytes;
        sc->any_disk |= b->tier == LADEN_TIER_DISK;
    }
    sc->st.generation++;
}

static laden_status cache_block(laden_sched_t *sc, uint32_t block,
                                const char *call, blk **out)
{
    laden_status s = check_block(sc, block, call);
    if (s)
        return s;
    if (!sc->cache)
        return laden__fail(LADEN_E_STATE,
                           "%s: only for schedules created with "
                           "LADEN_SCHED_CACHE",
                           call);
    *out = &sc->b[block];
    return LADEN_OK;
}

/* Gives b a device copy and starts its upload.  In a VBAR: faults b's
 * range in and copies only if its pages were replaced since it was last
 * written, or LADEN_E_BUDGET if the range is offloaded (the caller
 * streams the block).  Otherwise in `given` (0: allocated here). */
static laden_status make_resident(laden_sched_t *sc, blk *b,
                                  laden_devptr_t given)
{
    laden_status s;
    int32_t dev = sc->cfg.device;
    bool copy = b->bytes != 0;
    uint64_t sig = 0;
    if (b->bytes && sc->vbar) {
        int res;
        if ((s = laden_vbar_fault(sc->vbar, b->voff, b->bytes, &res, &sig)))
            return s;
        if (!res)
            return laden__fail(LADEN_E_BUDGET,
                               "block of %s is offloaded: the VRAM budget has "
                               "no room for it (it streams)",
                               laden__bytes(b->bytes).s);
        b->region = sc->vbar_base + b->voff;
        copy = sig != b->sig;
    } else if (b->bytes) {
        b->region = given;
        if (!given && (s = laden_dev_mem_alloc(dev, b->bytes, &b->region))) {
            b->region = 0;
            return s;
        }
    }
    if (copy && ((s = laden_dev_copy_h2d(sc->copy, b->region, b->ram,
                                         b->bytes)) ||
                 (s = laden_dev_event_record(sc->uploaded, sc->copy)))) {
        laden_dev_stream_synchronize(sc->copy);
        if (sc->vbar)
            laden_vbar_unpin(sc->vbar, b->voff, b->bytes);
        else if (!given)
            laden_dev_mem_free(dev, b->region);
        b->region = 0;
        return s;
    }
    if (copy) {
        b->sig = sig;
        sc->st.upload_bytes += b->bytes;
        sc->st.h2d_bytes += b->bytes;
    }
    b->resident = true;
    sc->st.resident_bytes += b->bytes;
    sc->st.device_bytes += b->bytes;
    relayout(sc);
    return LADEN_OK;
}

/* Takes b's device copy away once its last users are done: freed, or
 * handed to the caller in *taken. */
static laden_status unreside(laden_sched_t *sc, blk *b, laden_devptr_t *taken)
{
    laden_status s;
    /* Its last users: the model's work (fence) and the upload. */
    if ((sc->fenced && (s = laden_dev_event_synchronize(sc->last_use))) ||
        (s = laden_dev_event_synchronize(sc->uploaded)))
        return s;
    if (sc->vbar) {
        /* Unpinned, not freed: the pages stay until the budget needs
         * them, and a later fault with the same signature copies nothing. */
        if (b->bytes && (s = laden_vbar_unpin(sc->vbar, b->voff, b->bytes)))
            return s;
        if (taken)
            *taken = 0;
    } else if (taken) {
        *taken = b->region;
    } else {
        laden_dev_mem_free(sc->cfg.device, b->region);
    }
    b->region = 0;
    b->resident = false;
    sc->st.resident_bytes -= b->bytes;
    sc->st.device_bytes -= b->bytes;
    relayout(sc);
    return LADEN_OK;
}

static laden_status residency_arg(laden_sched_t *sc, uint32_t block,
                                  const char *call, blk **b)
{
    laden_status s = cache_block(sc, block, call, b);
    if (s)
        return s;
    if (sc->started)
        return laden__fail(LADEN_E_STATE,
                           "%s: stop the schedule first (its slots are laid "
                           "out for the blocks that stream)",
                           call);
    return LADEN_OK;
}

static laden_status set_resident(laden_sched_t *sc, uint32_t block,
                                 int on)
{
    blk *b = NULL;
    laden_status s = cache_block(sc, block, "laden_stream_set_resident", &b);
    if (s || (on != 0) == b->resident)
        return s;
    if ((s = residency_arg(sc, block, "laden_stream_set_resident", &b)))
        return s;
    return on ? make_resident(sc, b, 0) : unreside(sc, b, NULL);
}

static laden_status take_resident(laden_sched_t *sc, uint32_t block,
                                  laden_devptr_t *out_ptr,
                                  uint64_t *out_bytes)
{
    blk *b = NULL;
    if (out_ptr)
        *out_ptr = 0;
    if (out_bytes)
        *out_bytes = 0;
    if (!out_ptr || !out_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_stream_take_resident: NULL");
    laden_status s = residency_arg(sc, block, "laden_stream_take_resident",
                                   &b);
    if (s || !b->resident)
        return s;
    uint64_t n = b->bytes;
    if ((s = unreside(sc, b, out_ptr)))
        return s;
    *out_bytes = n;
    return LADEN_OK;
}

static laden_status set_resident_at(laden_sched_t *sc, uint32_t block,
                                    laden_devptr_t ptr, uint64_t bytes)
{
    blk *b = NULL;
    laden_status s = residency_arg(sc, block, "laden_stream_set_resident_at",
                                   &b);
    if (s)
        return s;
    if (b->resident || sc->vbar)
        return laden__fail(LADEN_E_STATE,
                           "laden_stream_set_resident_at: block %u %s",
                           block, sc->vbar ? "lives in a VBAR"
                                           : "has a device copy already");
    if (bytes != b->bytes || (!ptr && bytes))
        return laden__fail(LADEN_E_INVAL,
                           "laden_stream_set_resident_at: block %u needs a "
                           "region of exactly %llu bytes, got %llu",
                           block, (unsigned long long)b->bytes,
                           (unsigned long long)bytes);
    return make_resident(sc, b, ptr);
}

static laden_status vram_arg(laden_sched_t *sc, laden_vram_t *vram)
{
    laden_vram_info_t vi;
    laden_status s;
    if (!vram)
        return LADEN_OK;
    if ((s = laden_vram_info(vram, &vi)))
        return s;
    if (vi.device != sc->cfg.device)
        return laden__fail(LADEN_E_INVAL,
                           "laden_stream_use_vram: the context is for "
                           "device %d, the schedule for %d",
                           vi.device, sc->cfg.device);
    return LADEN_OK;
}

static laden_status use_vram(laden_sched_t *sc, laden_vram_t *vram)
{
    laden_status s;
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_use_vram: NULL");
    if (!sc->cache) {
        /* Placed at load. */
        if (sc->loaded || sc->broken || sc->laid_out)
            return laden__fail(LADEN_E_STATE,
                               "laden_stream_use_vram: a schedule without "
                               "LADEN_SCHED_CACHE takes its context before "
                               "load");
        if ((s = vram_arg(sc, vram)))
            return s;
        sc->vram = vram;
        return LADEN_OK;
    }
    if (!sc->loaded)
        return laden__fail(LADEN_E_STATE, "laden_stream_use_vram: a cache "
                           "schedule takes its context once loaded");
    if (sc->started || sc->st.resident_bytes)
        return laden__fail(LADEN_E_STATE,
                           "laden_stream_use_vram: the schedule holds device "
                           "memory; give it all back first");
    for (uint32_t i = 0; i < sc->nb; i++)
        if (sc->b[i].resident)
            return laden__fail(LADEN_E_STATE,
                               "laden_stream_use_vram: block %u is resident",
                               i);
    if ((s = vram_arg(sc, vram)))
        return s;
    laden_vbar_t *v = NULL;
    laden_devptr_t base = 0;
    if (vram) {
        uint64_t total = 0;
        for (uint32_t i = 0; i < sc->nb; i++)
            total += (sc->b[i].bytes + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
        if ((s = new_vbar(vram, total, &v, &base)))
            return s;
        for (uint32_t i = 0; i < sc->nb; i++) {
            laden_vbar_alloc(v, sc->b[i].bytes, &sc->b[i].voff); /* sized so */
            sc->b[i].sig = 0;
        }
    }
    laden_vbar_destroy(sc->vbar);
    sc->vbar = v;
    sc->vram = vram;
    sc->vbar_base = base;
    return LADEN_OK;
}

static laden_status reserve_vram(laden_sched_t *sc,
                                 const uint8_t *want, uint32_t n)
{
    laden_status s;
    if (!sc || (!want && n))
        return laden__fail(LADEN_E_INVAL, "laden_stream_reserve_vram: NULL");
    if (!sc->cache || !sc->vbar)
        return LADEN_OK; /* nothing is faulted: nothing to prepare */
    if (n != sc->nb)
        return laden__fail(LADEN_E_INVAL,
                           "laden_stream_reserve_vram: %u flags for %u "
                           "blocks",
                           n, sc->nb);
    laden_vbar_info_t vi;
    laden_vram_info_t ci;
    if ((s = laden_vbar_info(sc->vbar, &vi)) ||
        (s = laden_vram_info(sc->vram, &ci)))
        return s;
    if (!ci.budget_bytes)
        return LADEN_OK;
    uint64_t page = ci.page_bytes;
    uint32_t np = (uint32_t)((vi.size_bytes + page - 1) / page), got = 0;
    uint8_t *state = malloc(np ? np : 1);
    if (!state)
        return laden__fail(LADEN_E_NOMEM, "out of memory");
    if ((s = laden_vbar_residency(sc->vbar, state, np, &got))) {
        free(state);
        return s;
    }
    /* The pages the wanted blocks lack, each counted once (the blocks'
     * ranges ascend). */
    uint64_t need = 0;
    int64_t last = -1;
    for (uint32_t i = 0; i < sc->nb; i++) {
        blk *b = &sc->b[i];
        if (!want[i] || b->resident || !b->bytes)
            continue;
        int64_t p0 = (int64_t)(b->voff / page);
        int64_t p1 = (int64_t)((b->voff + b->bytes - 1) / page);
        for (int64_t p = p0 > last ? p0 : last + 1; p <= p1 && p < got; p++)
            if (!state[p])
                need += page;
        if (p1 > last)
            last = p1;
    }
    free(state);
    return need ? laden_vram_make_room(sc->vram, need) : LADEN_OK;
}

laden_vbar_t *laden_stream_vbar(laden_sched_t *sc)
{
    return sc ? sc->vbar : NULL;
}

int laden_stream_block_tier(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->nb ? (int)sc->b[block].tier : -1;
}

int laden_stream_is_resident(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->nb && sc->b[block].resident;
}

static laden_status pin(laden_sched_t *sc, uint32_t block, int on)
{
    blk *b = NULL;
    laden_status s = cache_block(sc, block, "laden_stream_pin", &b);
    if (s)
        return s;
    if ((on != 0) == b->pinned || !b->ram)
        return LADEN_OK;
    if (on) {
        s = laden_dev_host_register(sc->cfg.device, b->ram, b->ram_len);
    } else {
        /* Copies from it may be in flight (uploads, slots). */
        if ((s = laden_dev_stream_synchronize(sc->copy)))
            return s;
        s = laden_dev_host_unregister(sc->cfg.device, b->ram);
    }
    if (s)
        return s;
    b->pinned = on != 0;
    if (on)
        sc->st.registered_bytes += b->bytes;
    else
        sc->st.registered_bytes -= b->bytes;
    return LADEN_OK;
}

int laden_stream_is_pinned(laden_sched_t *sc, uint32_t block)
{
    return sc && block < sc->nb && sc->b[block].pinned;
}

int laden_stream_is_cache(laden_sched_t *sc)
{
    return sc && sc->cache && sc->loaded;
}

int32_t laden_stream_device(laden_sched_t *sc)
{
    return sc ? sc->cfg.device : LADEN_DEVICE_CPU;
}

uint32_t laden_stream_block_count(laden_sched_t *sc)
{
    return sc ? sc->nb : 0;
}

uint64_t laden_stream_block_bytes(laden_sched_t *sc, uint32_t block)
{
    return sc && sc->loaded && block < sc->nb ? sc->b[block].bytes : 0;
}

/* LADEN_OK for a loaded cache schedule, else the error naming `call`. */
static laden_status loaded_cache(laden_sched_t *sc, const char *call)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    if (!sc->cache || !sc->loaded)
        return laden__fail(LADEN_E_STATE, "%s: not a loaded cache schedule",
                           call);
    return LADEN_OK;
}

static laden_status ready(laden_sched_t *sc, uintptr_t handle)
{
    laden_status s = loaded_cache(sc, "laden_stream_ready");
    if (s)
        return s;
    if (!sc->cuda)
        return laden_dev_event_synchronize(sc->uploaded);
    if ((s = compute_stream(sc, handle)))
        return s;
    return laden_dev_stream_wait_event(sc->compute, sc->uploaded);
}

static laden_status fence(laden_sched_t *sc, uintptr_t handle)
{
    laden_status s = loaded_cache(sc, "laden_stream_fence");
    if (s)
        return s;
    if (!sc->cuda)
        return LADEN_OK; /* the CPU's work is done when it returns */
    if ((s = compute_stream(sc, handle)) ||
        (s = laden_dev_event_record(sc->last_use, sc->compute)))
        return s;
    sc->fenced = true;
    return LADEN_OK;
}

static laden_status stats(laden_sched_t *sc, laden_sched_stats_t *out)
{
    laden_host_stats_t hs;
    if (!sc || !out)
        return laden__fail(LADEN_E_INVAL, "laden_stream_stats: NULL");
    *out = sc->st;
    out->slot_bytes = sc->slot_bytes;
    out->nslots = sc->nslots;
    out->device_bytes += (uint64_t)sc->nslots * sc->slot_bytes;
    if (laden_host_stats(sc->host, &hs) == LADEN_OK)
        out->pinned_bytes = hs.in_use_bytes + hs.cached_bytes;
    return LADEN_OK;
}

/* ---- the public calls: one thread at a time ------------------------------
 *
 * Every call holds the schedule for its duration, laden_stream_enter holds
 * it until laden_stream_exit and laden_stream_begin until laden_stream_end.
 * A call from another thread meanwhile is refused at once with
 * LADEN_E_STATE: two threads interleaving one schedule's slots, reads and
 * events corrupt both (the slots' request lists overflowed, reads were
 * waited for twice).  Holds of the holding thread nest.  After
 * laden_stream_close every call is refused. */

static laden_status hold(laden_sched_t *sc, const char *call)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "%s: NULL schedule", call);
    uint64_t me = laden__thread_id(), cur = 0;
    if (atomic_compare_exchange_strong(&sc->holder, &cur, me)) {
        sc->depth = 1;
        return LADEN_OK;
    }
    if (cur == me) {
        sc->depth++;
        return LADEN_OK;
    }
    if (cur == CLOSED)
        return laden__fail(LADEN_E_STATE,
                           "%s: the schedule is closed (its model was "
                           "released)",
                           call);
    return laden__fail(LADEN_E_STATE,
                       "%s: the schedule is in use by another thread (a "
                       "schedule is used by one thread at a time)",
                       call);
}

static void unhold(laden_sched_t *sc)
{
    if (--sc->depth == 0)
        atomic_store(&sc->holder, 0);
}

static bool holds(laden_sched_t *sc)
{
    return atomic_load(&sc->holder) == laden__thread_id();
}

/* Runs `expr` holding the schedule. */
#define HELD(call, expr)                                                   \
    do {                                                                   \
        laden_status held_ = hold(sc, call);                               \
        if (held_)                                                         \
            return held_;                                                  \
        held_ = (expr);                                                    \
        unhold(sc);                                                        \
        return held_;                                                      \
    } while (0)

laden_status laden_stream_begin(laden_sched_t *sc)
{
    laden_status s = hold(sc, "laden_stream_begin");
    if (!s)
        sc->begun++;
    return s;
}

laden_status laden_stream_end(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_end: NULL schedule");
    if (!holds(sc) || !sc->begun)
        return laden__fail(LADEN_E_STATE, "laden_stream_end: no pass was "
                           "begun on this thread");
    sc->begun--;
    unhold(sc);
    return LADEN_OK;
}

laden_status laden_stream_close(laden_sched_t *sc)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_close: NULL schedule");
    uint64_t cur = 0;
    if (atomic_compare_exchange_strong(&sc->holder, &cur, CLOSED) ||
        cur == CLOSED)
        return LADEN_OK;
    return laden__fail(LADEN_E_STATE,
                       cur == laden__thread_id()
                           ? "laden_stream_close: this thread is inside a "
                             "pass or a block of the schedule"
                           : "laden_stream_close: the schedule is in use by "
                             "another thread");
}

int laden_stream_is_closed(laden_sched_t *sc)
{
    return sc && atomic_load(&sc->holder) == CLOSED;
}

laden_status laden_stream_enter(laden_sched_t *sc, uint32_t block,
                                uintptr_t compute_stream)
{
    laden_status s = hold(sc, "laden_stream_enter");
    if (s)
        return s;
    if ((s = enter(sc, block, compute_stream))) {
        unhold(sc);
        return s;
    }
    sc->entered++;
    return LADEN_OK;
}

laden_status laden_stream_exit(laden_sched_t *sc, uint32_t block,
                               uintptr_t compute_stream)
{
    if (!sc)
        return laden__fail(LADEN_E_INVAL, "laden_stream_exit: NULL schedule");
    if (!holds(sc) || !sc->entered)
        return laden__fail(LADEN_E_STATE,
                           "laden_stream_exit: block %u was not entered on "
                           "this thread",
                           block);
    laden_status s = leave(sc, block, compute_stream);
    sc->entered--;
    unhold(sc);
    return s;
}

laden_status laden_stream_add_block(laden_sched_t *sc, laden_tier tier,
                                    uint32_t *out_block)
{
    if (out_block)
        *out_block = 0;
    HELD("laden_stream_add_block", add_block(sc, tier, out_block));
}

laden_status laden_stream_add_tensor(laden_sched_t *sc, uint32_t block,
                                     const laden_st_t *st, size_t st_index,
                                     laden_dtype dtype, uint32_t *out_index)
{
    if (out_index)
        *out_index = 0;
    HELD("laden_stream_add_tensor",
         add_tensor(sc, block, st, st_index, dtype, out_index));
}

laden_status laden_stream_add_host_tensor(laden_sched_t *sc, uint32_t block,
                                          const void *src,
                                          laden_dtype src_dtype,
                                          uint64_t n_elems, laden_dtype dtype,
                                          uint32_t *out_index)
{
    if (out_index)
        *out_index = 0;
    HELD("laden_stream_add_host_tensor",
         add_host_tensor(sc, block, src, src_dtype, n_elems, dtype,
                         out_index));
}

laden_status laden_stream_load(laden_sched_t *sc)
{
    HELD("laden_stream_load", load(sc));
}

laden_status laden_stream_load_block(laden_sched_t *sc, uint32_t block)
{
    HELD("laden_stream_load_block", load_block(sc, block));
}

laden_status laden_stream_start(laden_sched_t *sc, uint32_t lookahead)
{
    HELD("laden_stream_start", start(sc, lookahead));
}

laden_status laden_stream_stop(laden_sched_t *sc)
{
    HELD("laden_stream_stop", stop(sc));
}

laden_status laden_stream_tensor_ptr(laden_sched_t *sc, uint32_t block,
                                     uint32_t i, laden_devptr_t *out)
{
    if (out)
        *out = 0;
    HELD("laden_stream_tensor_ptr", tensor_ptr(sc, block, i, out));
}

laden_status laden_stream_host_ptr(laden_sched_t *sc, uint32_t block,
                                   uint32_t i, void **out)
{
    if (out)
        *out = NULL;
    HELD("laden_stream_host_ptr", host_ptr(sc, block, i, out));
}

laden_status laden_stream_synchronize(laden_sched_t *sc)
{
    HELD("laden_stream_synchronize", synchronize(sc));
}

laden_status laden_stream_stats(laden_sched_t *sc, laden_sched_stats_t *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    HELD("laden_stream_stats", stats(sc, out));
}

laden_status laden_stream_set_resident(laden_sched_t *sc, uint32_t block,
                                       int resident)
{
    HELD("laden_stream_set_resident", set_resident(sc, block, resident));
}

laden_status laden_stream_take_resident(laden_sched_t *sc, uint32_t block,
                                        laden_devptr_t *out_ptr,
                                        uint64_t *out_bytes)
{
    if (out_ptr)
        *out_ptr = 0;
    if (out_bytes)
        *out_bytes = 0;
    HELD("laden_stream_take_resident",
         take_resident(sc, block, out_ptr, out_bytes));
}

laden_status laden_stream_set_resident_at(laden_sched_t *sc, uint32_t block,
                                          laden_devptr_t ptr, uint64_t bytes)
{
    HELD("laden_stream_set_resident_at",
         set_resident_at(sc, block, ptr, bytes));
}

laden_status laden_stream_use_vram(laden_sched_t *sc, laden_vram_t *vram)
{
    HELD("laden_stream_use_vram", use_vram(sc, vram));
}

laden_status laden_stream_reserve_vram(laden_sched_t *sc, const uint8_t *want,
                                       uint32_t n)
{
    HELD("laden_stream_reserve_vram", reserve_vram(sc, want, n));
}

laden_status laden_stream_pin(laden_sched_t *sc, uint32_t block, int pinned)
{
    HELD("laden_stream_pin", pin(sc, block, pinned));
}

laden_status laden_stream_ready(laden_sched_t *sc, uintptr_t compute_stream)
{
    HELD("laden_stream_ready", ready(sc, compute_stream));
}

laden_status laden_stream_fence(laden_sched_t *sc, uintptr_t compute_stream)
{
    HELD("laden_stream_fence", fence(sc, compute_stream));
}
