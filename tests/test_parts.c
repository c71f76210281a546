/* Parts of checkpoint tensors (laden_sched_add_tensor_part): a tensor-
 * parallel rank's shard, read alone -- rows as one range, columns as a
 * range per row -- packed, converted where asked, on every tier that can
 * hold it; the disk tier refuses a part of several ranges. */
#include "test.h"

#include "laden/dev.h"
#include "laden/stream.h"
#include "laden/trace.h"

#define R 6
#define C 10

/* w: F32 [R, C], w[i][j] = 100 i + j; v: F32 [2, 3, 4], v[a][b][c] =
 * 100 a + 10 b + c. */
static char *write_parts(void)
{
    float data[R * C + 24];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++)
            data[i * C + j] = (float)(100 * i + j);
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 4; c++)
                data[R * C + a * 12 + b * 4 + c] = (float)(100 * a + 10 * b + c);
    char hdr[512];
    snprintf(hdr, sizeof hdr,
             "{\"w\":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":"
             "[0,%d]},\"v\":{\"dtype\":\"F32\",\"shape\":[2,3,4],"
             "\"data_offsets\":[%d,%d]}}",
             R, C, R * C * 4, R * C * 4, R * C * 4 + 96);
    char *p = test_path("parts.safetensors");
    test_write_st(p, hdr, data, sizeof data);
    return p;
}

static float bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct {
    uint32_t dim;
    uint64_t start, count;
    laden_dtype dtype;
    const char *name;
} part;

static const part PARTS[] = {
    {0, 2, 2, LADEN_DTYPE_F32, "w"},   /* rows 2..3: one range */
    {1, 3, 4, LADEN_DTYPE_F32, "w"},   /* columns 3..6: a range per row */
    {1, 0, C, LADEN_DTYPE_F32, "w"},   /* every column: the whole tensor */
    {1, 7, 3, LADEN_DTYPE_BF16, "w"},  /* columns 7..9, converted */
    {2, 1, 2, LADEN_DTYPE_F32, "v"},   /* innermost of three dimensions */
    {1, 2, 1, LADEN_DTYPE_F32, "v"},   /* middle one */
};
#define NPARTS (sizeof PARTS / sizeof *PARTS)

/* The value element k of part p should hold. */
static float want(const part *p, uint64_t k)
{
    if (p->name[0] == 'w') {
        uint64_t cols = p->dim == 1 ? p->count : C;
        uint64_t i = k / cols, j = k % cols;
        if (p->dim == 0)
            i += p->start;
        else
            j += p->start;
        return (float)(100 * i + j);
    }
    uint64_t sh[3] = {2, 3, 4};
    sh[p->dim] = p->count;
    uint64_t a = k / (sh[1] * sh[2]), b = k / sh[2] % sh[1], c = k % sh[2];
    if (p->dim == 1)
        b += p->start;
    else
        c += p->start;
    return (float)(100 * a + 10 * b + c);
}

static void parts_on(int32_t dev)
{
    static const laden_tier tiers[] = {LADEN_TIER_RAM, LADEN_TIER_GPU};
    char *path = write_parts();
    for (size_t ti = 0; ti < 2; ti++) {
        laden_st_t *st;
        laden_sched_t *sc;
        CHECK_OK(laden_st_open(path, &st));
        laden_sched_config cfg = {.device = dev};
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        uint32_t blk;
        CHECK_OK(laden_sched_add_block(sc, tiers[ti], &blk));
        for (size_t i = 0; i < NPARTS; i++) {
            size_t idx;
            uint32_t k;
            CHECK_OK(laden_st_find(st, PARTS[i].name, &idx));
            CHECK_OK(laden_sched_add_tensor_part(sc, blk, st, idx,
                                                 PARTS[i].dtype, PARTS[i].dim,
                                                 PARTS[i].start,
                                                 PARTS[i].count, &k));
            CHECK_EQ(k, (uint32_t)i);
        }
        CHECK_OK(laden_sched_load(sc));
        laden_sched_stats_t s;
        CHECK_OK(laden_sched_stats(sc, &s));
        uint64_t read = 0;
        for (size_t i = 0; i < NPARTS; i++) {
            const part *p = &PARTS[i];
            uint64_t n = (p->name[0] == 'w' ? R * C : 24) /
                         (p->name[0] == 'w' ? (p->dim ? C : R)
                                            : (p->dim == 2 ? 4 : 3)) *
                         p->count;
            read += n * 4;
            laden_devptr_t dp = 0;
            if (!laden_sched_is_streamed(sc, blk))
                CHECK_OK(laden_sched_tensor_ptr(sc, blk, (uint32_t)i, &dp));
            uint64_t bytes = n * (p->dtype == LADEN_DTYPE_F32 ? 4 : 2);
            unsigned char *got = malloc(bytes);
            if (dev == LADEN_DEVICE_CPU) {
                memcpy(got, (void *)(uintptr_t)dp, bytes);
            } else {
                laden_dev_stream_t *rd;
                CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
                if (laden_sched_is_streamed(sc, blk)) {
                    CHECK_OK(laden_sched_start(sc, 0));
                    CHECK_OK(laden_sched_enter(sc, blk, 0));
                    CHECK_OK(laden_sched_tensor_ptr(sc, blk, (uint32_t)i,
                                                    &dp));
                }
                CHECK_OK(laden_dev_copy_d2h(rd, got, dp, bytes));
                CHECK_OK(laden_dev_stream_synchronize(rd));
                if (laden_sched_is_streamed(sc, blk)) {
                    CHECK_OK(laden_sched_exit(sc, blk, 0));
                    CHECK_OK(laden_sched_synchronize(sc));
                    CHECK_OK(laden_sched_stop(sc));
                }
                laden_dev_stream_destroy(rd);
            }
            for (uint64_t k = 0; k < n; k++) {
                float v;
                if (p->dtype == LADEN_DTYPE_F32) {
                    memcpy(&v, got + 4 * k, 4);
                } else {
                    uint16_t h;
                    memcpy(&h, got + 2 * k, 2);
                    v = bf16(h);
                }
                float d = v - want(p, k), tol = p->dtype == LADEN_DTYPE_F32
                                                     ? 0.0f
                                                     : want(p, k) / 128;
                if (d > tol || -d > tol) { /* bf16: 8 bits of mantissa */
                    fprintf(stderr, "device %d tier %zu part %zu element "
                            "%llu: %g, want %g\n", dev, ti, i,
                            (unsigned long long)k, v, want(p, k));
                    exit(1);
                }
            }
            free(got);
        }
        /* Only the parts were read. */
        CHECK_EQ(s.load_read_bytes, read);
        if (tiers[ti] == LADEN_TIER_GPU) { /* read again: counted once */
            CHECK_OK(laden_sched_reread(sc, blk, 1));
            laden_sched_stats_t s2;
            CHECK_OK(laden_sched_stats(sc, &s2));
            CHECK_EQ(s2.load_read_bytes - s.load_read_bytes, R * 4 * 4);
        }
        laden_sched_destroy(sc);
        laden_st_close(st);
    }
}

TEST(stream_parts_read_alone_on_every_device) { test_on_every_device(parts_on); }

TEST(stream_parts_refused)
{
    char *path = write_parts();
    laden_st_t *st;
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t disk, ram, k;
    size_t w;
    CHECK_OK(laden_st_find(st, "w", &w));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &disk));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &ram));
    /* Rows are one range: the disk tier streams them. */
    CHECK_OK(laden_sched_add_tensor_part(sc, disk, st, w, LADEN_DTYPE_F32, 0,
                                         1, 3, &k));
    CHECK_STATUS(laden_sched_add_tensor_part(sc, disk, st, w,
                                             LADEN_DTYPE_F32, 1, 1, 3, &k),
                 LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "ranges"));
    CHECK_STATUS(laden_sched_add_tensor_part(sc, ram, st, w, LADEN_DTYPE_F32,
                                             2, 0, 1, &k),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_add_tensor_part(sc, ram, st, w, LADEN_DTYPE_F32,
                                             0, 4, 3, &k),
                 LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "[4, 7)"));
    CHECK_OK(laden_sched_add_tensor_part(sc, ram, st, w, LADEN_DTYPE_F32, 1,
                                         2, 2, &k));
    CHECK_STATUS(laden_sched_set_rope_rows(sc, ram, k, 2), LADEN_E_UNSUPPORTED);
    CHECK_OK(laden_sched_load(sc));
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* ---- joined tensors (laden_sched_join_tensor) ------------------------------
 *
 * The inverse of a part: several checkpoint tensors laid end to end as one
 * tensor of the model -- transformers' fused MoE experts.  E experts of
 * w1, w3 [I, H] and w2 [H, I], stored in the file in another order than
 * the fused tensors' (w3 before w1); the model holds gate_up [E, 2I, H]
 * (w1_e then w3_e for each e) and down [E, H, I]. */

#define NE 3
#define NI 2
#define NH 4

static float expert_value(int e, int which, int k)
{
    return (float)(1000 * e + 100 * which + k); /* which: 1, 3 or 2 */
}

static char *write_experts(void)
{
    enum { PER = NI * NH };
    float data[NE * 3 * PER];
    char hdr[4096];
    size_t at = 0, n = 0, h = 0;
    h += (size_t)snprintf(hdr + h, sizeof hdr - h, "{");
    for (int e = 0; e < NE; e++) {
        static const int order[3] = {3, 1, 2};
        for (int w = 0; w < 3; w++) {
            int which = order[w];
            for (int k = 0; k < PER; k++)
                data[n++] = expert_value(e, which, k);
            h += (size_t)snprintf(
                hdr + h, sizeof hdr - h,
                "%s\"e.%d.w%d\":{\"dtype\":\"F32\",\"shape\":[%d,%d],"
                "\"data_offsets\":[%zu,%zu]}",
                h > 1 ? "," : "", e, which, which == 2 ? NH : NI,
                which == 2 ? NI : NH, at, at + PER * 4);
            at += PER * 4;
        }
    }
    snprintf(hdr + h, sizeof hdr - h, "}");
    char *p = test_path("experts.safetensors");
    test_write_st(p, hdr, data, sizeof data);
    return p;
}

/* Adds gate_up (w1_e, w3_e for each e) and down (w2_e) as two joined runs
 * to block blk; their first tensors' indices in *gu and *down. */
static void add_fused(laden_sched_t *sc, const laden_st_t *st, uint32_t blk,
                      laden_dtype dt, uint32_t *gu, uint32_t *down)
{
    char name[32];
    for (int f = 0; f < 2; f++) {
        for (int e = 0; e < NE; e++) {
            for (int w = 0; w < (f ? 1 : 2); w++) {
                snprintf(name, sizeof name, "e.%d.w%d", e, f ? 2 : w ? 3 : 1);
                size_t idx;
                uint32_t k;
                CHECK_OK(laden_st_find(st, name, &idx));
                CHECK_OK(laden_sched_add_tensor(sc, blk, st, idx, dt, &k));
                if (e == 0 && w == 0)
                    *(f ? down : gu) = k;
                else
                    CHECK_OK(laden_sched_join_tensor(sc, blk, k));
            }
        }
    }
}

/* The fused tensors' element k, as float. */
static float fused_want(int down, uint64_t k)
{
    uint64_t per = NI * NH;
    if (down)
        return expert_value((int)(k / per), 2, (int)(k % per));
    uint64_t e = k / (2 * per), r = k % (2 * per);
    return expert_value((int)e, r < per ? 1 : 3, (int)(r % per));
}

/* got: the fused tensor as dt, from tensors stored as `stored`. */
static void check_fused(const unsigned char *got, laden_dtype dt,
                        laden_dtype stored, int down, const char *what)
{
    uint64_t n = (uint64_t)NE * NI * NH * (down ? 1 : 2);
    for (uint64_t k = 0; k < n; k++) {
        float v;
        if (dt == LADEN_DTYPE_F32) {
            memcpy(&v, got + 4 * k, 4);
        } else {
            uint16_t h;
            memcpy(&h, got + 2 * k, 2);
            v = bf16(h);
        }
        float w = fused_want(down, k), d = v - w;
        float tol = stored == LADEN_DTYPE_F32 ? 0.0f : w / 128;
        if (d > tol || -d > tol) {
            fprintf(stderr, "%s: %s element %llu is %g, want %g\n", what,
                    down ? "down" : "gate_up", (unsigned long long)k, v, w);
            exit(1);
        }
    }
}

static void joined_on(int32_t dev)
{
    static const laden_tier tiers[] = {LADEN_TIER_RAM, LADEN_TIER_GPU,
                                       LADEN_TIER_DISK};
    char *path = write_experts();
    for (size_t ti = 0; ti < 3; ti++) {
        for (int conv = 0; conv < (tiers[ti] == LADEN_TIER_DISK ? 1 : 2);
             conv++) {
            laden_dtype dt = conv ? LADEN_DTYPE_BF16 : LADEN_DTYPE_F32;
            uint64_t es = conv ? 2 : 4;
            laden_st_t *st;
            laden_sched_t *sc;
            CHECK_OK(laden_st_open(path, &st));
            laden_sched_config cfg = {.device = dev, .lookahead = 1};
            CHECK_OK(laden_sched_create(&cfg, st, &sc));
            uint32_t blk, gu = 0, dn = 0;
            CHECK_OK(laden_sched_add_block(sc, tiers[ti], &blk));
            add_fused(sc, st, blk, dt, &gu, &dn);
            uint64_t bytes[2];
            CHECK_OK(laden_sched_tensor_layout(sc, blk, gu, &bytes[0], NULL,
                                               NULL));
            CHECK_OK(laden_sched_tensor_layout(sc, blk, dn, &bytes[1], NULL,
                                               NULL));
            CHECK_EQ(bytes[0], (uint64_t)NE * 2 * NI * NH * es);
            CHECK_EQ(bytes[1], (uint64_t)NE * NI * NH * es);
            CHECK_OK(laden_sched_load(sc));
            bool streamed = laden_sched_is_streamed(sc, blk);
            if (streamed) {
                CHECK_OK(laden_sched_start(sc, 0));
                CHECK_OK(laden_sched_enter(sc, blk, 0));
            }
            for (int f = 0; f < 2; f++) {
                laden_devptr_t dp = 0;
                CHECK_OK(laden_sched_tensor_ptr(sc, blk, f ? dn : gu, &dp));
                unsigned char *got = malloc(bytes[f]);
                if (dev == LADEN_DEVICE_CPU) {
                    memcpy(got, (void *)(uintptr_t)dp, bytes[f]);
                } else {
                    laden_dev_stream_t *rd;
                    CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
                    CHECK_OK(laden_dev_copy_d2h(rd, got, dp, bytes[f]));
                    CHECK_OK(laden_dev_stream_synchronize(rd));
                    laden_dev_stream_destroy(rd);
                }
                check_fused(got, dt, dt, f, "where it runs");
                free(got);
            }
            if (streamed) {
                CHECK_OK(laden_sched_exit(sc, blk, 0));
                CHECK_OK(laden_sched_synchronize(sc));
                CHECK_OK(laden_sched_stop(sc));
            }
            /* Its value (a state_dict's), in its dtype and as F32. */
            for (int f = 0; f < 2; f++) {
                uint64_t n = bytes[f] / es;
                unsigned char *v = malloc(n * 4);
                CHECK_OK(laden_sched_tensor_value(sc, blk, f ? dn : gu,
                                                  LADEN_DTYPE_F32, v, n * 4));
                check_fused(v, LADEN_DTYPE_F32, dt, f, "its value");
                CHECK_STATUS(laden_sched_tensor_value(sc, blk, f ? dn : gu,
                                                      LADEN_DTYPE_F32, v,
                                                      n * 4 - 4),
                             LADEN_E_INVAL);
                free(v);
            }
            laden_sched_destroy(sc);
            laden_st_close(st);
        }
    }
}

TEST(stream_joined_tensors_on_every_device)
{
    test_on_every_device(joined_on);
}

TEST(stream_joined_tensors_refused)
{
    char *path = write_experts();
    laden_st_t *st;
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t blk, k0, k1, k2;
    size_t a, b, c;
    CHECK_OK(laden_st_find(st, "e.0.w1", &a));
    CHECK_OK(laden_st_find(st, "e.0.w3", &b));
    CHECK_OK(laden_st_find(st, "e.1.w1", &c));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_STATUS(laden_sched_join_tensor(sc, blk, 0), LADEN_E_INVAL);
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, a, LADEN_DTYPE_F32, &k0));
    CHECK_STATUS(laden_sched_join_tensor(sc, blk, k0), LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "not its first"));
    /* Another dtype. */
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, b, LADEN_DTYPE_BF16, &k1));
    CHECK_STATUS(laden_sched_join_tensor(sc, blk, k1), LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "one dtype"));
    /* Quantized on load. */
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, c, LADEN_DTYPE_F8_E4M3, &k2));
    CHECK_STATUS(laden_sched_join_tensor(sc, blk, k2), LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "compact"));
    /* Not the last tensor. */
    CHECK_STATUS(laden_sched_join_tensor(sc, blk, k1), LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "last tensor"));
    laden_sched_destroy(sc);
    /* A joined run is never marked compact nor reordered, and joins once;
     * the run's bytes are counted as the block's. */
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, a, LADEN_DTYPE_F32, &k0));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, b, LADEN_DTYPE_F32, &k1));
    CHECK_OK(laden_sched_join_tensor(sc, blk, k1));
    CHECK_STATUS(laden_sched_join_tensor(sc, blk, k1), LADEN_E_STATE);
    CHECK_STATUS(laden_sched_set_expanded(sc, blk, k0, LADEN_DTYPE_F32, NH,
                                          LADEN_SCHED_NO_SCALE, 0),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_set_expanded(sc, blk, k1, LADEN_DTYPE_F32, NH,
                                          LADEN_SCHED_NO_SCALE, 0),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_set_rope_rows(sc, blk, k0, 1),
                 LADEN_E_UNSUPPORTED);
    CHECK_EQ(laden_sched_block_bytes(sc, blk), (uint64_t)2 * NI * NH * 4);
    CHECK_OK(laden_sched_load(sc));
    CHECK_STATUS(laden_sched_join_tensor(sc, blk, k1), LADEN_E_STATE);
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* ---- expert blocks (laden_sched_set_experts) -------------------------------
 *
 * The fused experts as a block of their own: a prefetch copies nothing,
 * an enter with the routed experts copies (on the disk tier: reads) their
 * rows alone, each at its place, counted as such. */

/* The fused tensors' rows of expert e, read back from where block blk
 * runs now (its slot, or in place) into `got` (both tensors, F32). */
static void rows_of(laden_sched_t *sc, int32_t dev, uint32_t blk,
                    uint32_t gu, uint32_t dn, int e, float *got)
{
    uint64_t per = NI * NH * 4;
    for (int f = 0; f < 2; f++) {
        laden_devptr_t dp = 0;
        CHECK_OK(laden_sched_tensor_ptr(sc, blk, f ? dn : gu, &dp));
        uint64_t row = f ? per : 2 * per;
        laden_devptr_t at = dp + (uint64_t)e * row;
        char *to = (char *)got + (f ? 2 * per : 0);
        if (dev == LADEN_DEVICE_CPU) {
            memcpy(to, (void *)(uintptr_t)at, row);
        } else {
            laden_dev_stream_t *rd;
            CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
            CHECK_OK(laden_dev_copy_d2h(rd, to, at, row));
            CHECK_OK(laden_dev_stream_synchronize(rd));
            laden_dev_stream_destroy(rd);
        }
    }
}

static void check_expert(const float *got, int e, const char *what)
{
    uint64_t per = NI * NH;
    for (uint64_t k = 0; k < 3 * per; k++) {
        float w = k < 2 * per ? fused_want(0, e * 2 * per + k)
                              : fused_want(1, e * per + (k - 2 * per));
        if (got[k] != w) {
            fprintf(stderr, "%s: expert %d element %llu is %g, want %g\n",
                    what, e, (unsigned long long)k, got[k], w);
            exit(1);
        }
    }
}

static void experts_on(int32_t dev)
{
    static const laden_tier tiers[] = {LADEN_TIER_RAM, LADEN_TIER_DISK};
    char *path = write_experts();
    const uint64_t row = 3 * NI * NH * 4; /* one expert: gate, up, down */
    for (size_t ti = 0; ti < 2; ti++) {
        laden_st_t *st;
        laden_sched_t *sc;
        CHECK_OK(laden_st_open(path, &st));
        laden_sched_config cfg = {.device = dev, .lookahead = 1};
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        uint32_t attn, ex, gu = 0, dn = 0, k;
        size_t w;
        CHECK_OK(laden_sched_add_block(sc, tiers[ti], &attn));
        CHECK_OK(laden_st_find(st, "e.0.w1", &w)); /* a stand-in */
        CHECK_OK(laden_sched_add_tensor(sc, attn, st, w, LADEN_DTYPE_F32,
                                        &k));
        CHECK_OK(laden_sched_add_block(sc, tiers[ti], &ex));
        CHECK_OK(laden_sched_set_block_name(sc, ex, "experts"));
        add_fused(sc, st, ex, LADEN_DTYPE_F32, &gu, &dn);
        CHECK_STATUS(laden_sched_set_experts(sc, ex, 5), LADEN_E_INVAL);
        CHECK(strstr(laden_last_error(), "equal rows"));
        CHECK_OK(laden_sched_set_experts(sc, ex, NE));
        CHECK_STATUS(laden_sched_set_expanded(sc, ex, gu, LADEN_DTYPE_F32, NH,
                                              LADEN_SCHED_NO_SCALE, 0),
                     LADEN_E_INVAL);
        CHECK_OK(laden_sched_load(sc));
        CHECK_OK(laden_sched_start(sc, 0));
        bool streamed = laden_sched_is_streamed(sc, ex);
        CHECK_EQ(streamed, dev != LADEN_DEVICE_CPU || ti == 1);
        if (streamed) {
            CHECK_STATUS(laden_sched_enter(sc, ex, 0), LADEN_E_STATE);
            CHECK(strstr(laden_last_error(), "laden_sched_enter_experts"));
            if (dev != LADEN_DEVICE_CPU)
                CHECK_STATUS(laden_sched_capture_begin(sc, 0, 0),
                             LADEN_E_UNSUPPORTED);
        }
        uint32_t bad = NE;
        CHECK_STATUS(laden_sched_enter_experts(sc, ex, &bad, 1, 0),
                     LADEN_E_INVAL);
        CHECK_STATUS(laden_sched_enter_experts(sc, attn, &bad, 0, 0),
                     LADEN_E_INVAL);
        float got[3 * NI * NH];
        /* Passes of the attention block, then the experts routed to: the
         * experts block keeps its slot (two slots, two blocks), so rows
         * it holds already do not cross again. */
        static const uint32_t routed[3][3] = {{2, 0, 2}, {1, 1, 1},
                                              {0, 1, 0}};
        static const uint64_t crossing[3] = {2, 1, 0};
        char *trace = test_path("experts-trace.json");
        CHECK_OK(laden_trace_start(0));
        for (int pass = 0; pass < 3; pass++) {
            CHECK_OK(laden_sched_enter(sc, attn, 0));
            CHECK_OK(laden_sched_exit(sc, attn, 0));
            laden_sched_stats_t a, b;
            CHECK_OK(laden_sched_synchronize(sc));
            CHECK_OK(laden_sched_stats(sc, &a));
            CHECK_OK(laden_sched_enter_experts(sc, ex, routed[pass], 3, 0));
            CHECK_OK(laden_sched_synchronize(sc));
            for (int e = 0; e < NE; e++) {
                bool want = e == (int)routed[pass][0] ||
                            e == (int)routed[pass][1] ||
                            e == (int)routed[pass][2];
                if (!want && streamed)
                    continue; /* stale: never read */
                rows_of(sc, dev, ex, gu, dn, e, got);
                check_expert(got, e, "routed");
            }
            CHECK_OK(laden_sched_exit(sc, ex, 0));
            CHECK_OK(laden_sched_synchronize(sc));
            CHECK_OK(laden_sched_stats(sc, &b));
            uint64_t moved = crossing[pass] * row;
            if (streamed) {
                CHECK_EQ(b.expert_rows - a.expert_rows,
                         pass == 1 ? 1u : 2u);
                CHECK_EQ(b.expert_rows_moved - a.expert_rows_moved,
                         crossing[pass]);
            }
            if (streamed && ti == 1)
                CHECK_EQ(b.read_bytes - a.read_bytes, moved);
            if (streamed && dev != LADEN_DEVICE_CPU)
                CHECK_EQ(b.h2d_bytes - a.h2d_bytes, moved);
            if (!streamed)
                CHECK_EQ(b.h2d_bytes + b.read_bytes,
                         a.h2d_bytes + a.read_bytes);
        }
        /* Traced: a miss for each enter that moved rows, and on a device
         * with a copy stream one copy span of exactly those rows' bytes. */
        laden_trace_result_t res;
        CHECK_OK(laden_trace_stop(trace, &res));
        CHECK_EQ(res.unresolved, 0);
        CHECK_EQ(test_lines_containing(trace, "\"name\":\"miss experts\""),
                 streamed ? 2u : 0u);
        bool copies = streamed && dev != LADEN_DEVICE_CPU;
        CHECK_EQ(test_lines_containing(trace, "\"name\":\"h2d experts\""),
                 copies ? 2u : 0u);
        for (int pass = 0; pass < 2; pass++) {
            char want[96];
            snprintf(want, sizeof want, "\"block\":%u,\"bytes\":%llu,", ex,
                     (unsigned long long)(crossing[pass] * row));
            CHECK_EQ(test_lines_containing(trace, want), copies ? 1u : 0u);
        }
        CHECK_OK(laden_sched_stop(sc));
        laden_sched_destroy(sc);
        laden_st_close(st);
    }
}

TEST(stream_experts_move_routed_rows_on_every_device)
{
    test_on_every_device(experts_on);
}

/* The expert cache: two expert blocks and an attention block take turns
 * in two slots, so no slot keeps an expert block's rows to its next enter;
 * experts that crossed once come back from the cache, device to device,
 * as long as it holds them.  What stays is what is routed to most often:
 * a newcomer replaces the least often routed entry (of equals the least
 * recently used, never one the same enter uses) only when it was routed
 * to more often; counts halve every 1024 routings, so a new routing takes
 * over the cache after a while, not at once. */
static void expert_cache_on(int32_t dev)
{
    static const laden_tier tiers[] = {LADEN_TIER_RAM, LADEN_TIER_DISK};
    char *path = write_experts();
    const uint64_t row = 3 * NI * NH * 4; /* one expert: gate, up, down */
    for (size_t ti = 0; ti < 2; ti++) {
        if (dev == LADEN_DEVICE_CPU && ti == 0)
            continue; /* the RAM tier runs in place there */
        laden_st_t *st;
        laden_sched_t *sc;
        CHECK_OK(laden_st_open(path, &st));
        laden_sched_config cfg = {.device = dev, .lookahead = 1};
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        uint32_t attn, ex[2], gu[2], dn[2], k;
        size_t w;
        CHECK_OK(laden_st_find(st, "e.0.w1", &w)); /* attn's stand-in */
        for (int b = 0; b < 3; b++) { /* ex0, attn, ex1: ex0, ex1 share */
            uint32_t *to = b == 1 ? &attn : &ex[b / 2];
            CHECK_OK(laden_sched_add_block(sc, tiers[ti], to));
            if (b == 1) {
                CHECK_OK(laden_sched_add_tensor(sc, attn, st, w,
                                                LADEN_DTYPE_F32, &k));
                continue;
            }
            add_fused(sc, st, *to, LADEN_DTYPE_F32, &gu[b / 2], &dn[b / 2]);
            CHECK_OK(laden_sched_set_experts(sc, *to, NE));
        }
        /* Two entries, and a byte short of a third. */
        CHECK_OK(laden_sched_set_expert_cache(sc, 3 * row - 1));
        CHECK_OK(laden_sched_load(sc));
        CHECK_OK(laden_sched_start(sc, 0));
        CHECK_STATUS(laden_sched_set_expert_cache(sc, 0), LADEN_E_STATE);
        laden_sched_stats_t a, b;
        CHECK_OK(laden_sched_stats(sc, &a));
        CHECK_EQ(a.expert_cache_bytes, 2 * row);
        CHECK_EQ(a.device_bytes, a.gpu_bytes + a.nslots * a.slot_bytes +
                                     2 * row);
        /* Per enter: the block, the experts routed to, and how many of
         * them cross the link and come from the cache; the entries after
         * it (block.expert) and the counts that decided. */
        static const struct {
            int blk;
            uint32_t n, routed[3];
            uint64_t moved, cached;
        } steps[] = {
            {0, 2, {0, 1}, 2, 0},    /* 0.0 0.1: free entries */
            {1, 1, {2}, 1, 0},       /* 0.0 0.1: 1.2 (1) is not kept */
            {0, 2, {0, 0}, 0, 1},    /* repeats count once: 0.0 = 2 */
            {1, 1, {2}, 1, 0},       /* 0.0 1.2: 1.2 (2) > 0.1 (1) */
            {0, 2, {1, 2}, 2, 0},    /* 0.1 (2) and 0.2 (1) are not kept */
            {1, 1, {1}, 1, 0},       /* 1.1 (1) is not kept */
            {0, 1, {1}, 1, 0},       /* 0.1 1.2: 0.1 (3) > 0.0 (2), the
                                        older of 0.0 and 1.2 (2 each) */
            {1, 1, {1}, 1, 0},       /* 1.1 (2) is not > 1.2 (2) */
            {0, 3, {0, 1, 2}, 2, 1}, /* 0.1 0.0: 0.0 (3) > 1.2 (2); 0.2
                                        finds both entries used by this
                                        enter, not kept */
            {1, 2, {1, 2}, 2, 0},    /* 1.1 and 1.2 (3) are not > 0.0 (3) */
            {0, 1, {2}, 1, 0},       /* 0.2 (3) is not > 0.0 (3) */
            {1, 1, {2}, 1, 0},       /* 0.1 1.2: 1.2 (4) > 0.0 (3) */
            {0, 1, {1}, 0, 1},
            {1, 1, {2}, 0, 1},
        };
        for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
            int bl = steps[i].blk;
            CHECK_OK(laden_sched_synchronize(sc));
            CHECK_OK(laden_sched_stats(sc, &a));
            CHECK_OK(laden_sched_enter_experts(sc, ex[bl], steps[i].routed,
                                               steps[i].n, 0));
            CHECK_OK(laden_sched_synchronize(sc));
            float got[3 * NI * NH];
            for (uint32_t j = 0; j < steps[i].n; j++) {
                rows_of(sc, dev, ex[bl], gu[bl], dn[bl],
                        (int)steps[i].routed[j], got);
                check_expert(got, (int)steps[i].routed[j], "cached");
            }
            CHECK_OK(laden_sched_exit(sc, ex[bl], 0));
            CHECK_OK(laden_sched_synchronize(sc));
            CHECK_OK(laden_sched_stats(sc, &b));
            CHECK_OK(laden_sched_enter(sc, attn, 0));
            CHECK_OK(laden_sched_exit(sc, attn, 0));
            if (b.expert_rows_moved - a.expert_rows_moved != steps[i].moved ||
                b.expert_rows_cached - a.expert_rows_cached !=
                    steps[i].cached) {
                fprintf(stderr, "device %d tier %zu step %zu: moved %llu "
                        "cached %llu\n", dev, ti, i,
                        (unsigned long long)(b.expert_rows_moved -
                                             a.expert_rows_moved),
                        (unsigned long long)(b.expert_rows_cached -
                                             a.expert_rows_cached));
                CHECK(0);
            }
            uint64_t link = steps[i].moved * row;
            CHECK_EQ(ti ? b.read_bytes - a.read_bytes
                        : b.h2d_bytes - a.h2d_bytes, link);
        }
        /* A new routing takes over, after the old one's counts halved:
         * 1500 rounds routed to 0.0 and 0.1 (every 512 rounds they halve),
         * then 1.0 and 1.1 are kept once routed to more often than those;
         * under recency alone they would be kept at once. */
        uint32_t two[2] = {0, 1};
        for (int r = 0; r < 1500; r++)
            for (int bl = 0; bl < 2; bl++) {
                CHECK_OK(laden_sched_enter_experts(sc, ex[bl], two,
                                                   bl ? 0 : 2, 0));
                CHECK_OK(laden_sched_exit(sc, ex[bl], 0));
                CHECK_OK(laden_sched_enter(sc, attn, 0));
                CHECK_OK(laden_sched_exit(sc, attn, 0));
            }
        int first_hit = -1;
        for (int r = 0; r < 1000 && first_hit < 0; r++)
            for (int bl = 0; bl < 2; bl++) {
                CHECK_OK(laden_sched_stats(sc, &a));
                CHECK_OK(laden_sched_enter_experts(sc, ex[bl], two,
                                                   bl ? 2 : 0, 0));
                CHECK_OK(laden_sched_exit(sc, ex[bl], 0));
                CHECK_OK(laden_sched_enter(sc, attn, 0));
                CHECK_OK(laden_sched_exit(sc, attn, 0));
                CHECK_OK(laden_sched_stats(sc, &b));
                if (bl && b.expert_rows_cached > a.expert_rows_cached)
                    first_hit = r;
            }
        CHECK_OK(laden_sched_synchronize(sc));
        if (first_hit < 400 || first_hit > 600)
            fprintf(stderr, "device %d tier %zu: the new routing was first "
                    "served from the cache in round %d\n", dev, ti,
                    first_hit);
        CHECK(first_hit >= 400 && first_hit <= 600);
        float got[3 * NI * NH];
        for (uint32_t j = 0; j < 2; j++) {
            CHECK_OK(laden_sched_enter_experts(sc, ex[1], two, 2, 0));
            CHECK_OK(laden_sched_synchronize(sc));
            rows_of(sc, dev, ex[1], gu[1], dn[1], (int)j, got);
            check_expert(got, (int)j, "cached after the routing changed");
            CHECK_OK(laden_sched_exit(sc, ex[1], 0));
        }
        CHECK_OK(laden_sched_stop(sc));
        CHECK_OK(laden_sched_stats(sc, &b));
        CHECK_EQ(b.expert_cache_bytes, 0);
        /* Started again: a cache as large as every streamed expert at most
         * (2 blocks of NE), and none when asked for none. */
        CHECK_OK(laden_sched_set_expert_cache(sc, 100 * row));
        CHECK_OK(laden_sched_start(sc, 0));
        CHECK_OK(laden_sched_stats(sc, &b));
        CHECK_EQ(b.expert_cache_bytes, 2 * NE * row);
        CHECK_OK(laden_sched_stop(sc));
        CHECK_OK(laden_sched_set_expert_cache(sc, 0));
        CHECK_OK(laden_sched_start(sc, 0));
        CHECK_OK(laden_sched_stats(sc, &b));
        CHECK_EQ(b.expert_cache_bytes, 0);
        uint32_t one = 1;
        for (int r = 0; r < 2; r++) { /* no cache: crosses every time */
            CHECK_OK(laden_sched_stats(sc, &a));
            CHECK_OK(laden_sched_enter_experts(sc, ex[r], &one, 1, 0));
            CHECK_OK(laden_sched_exit(sc, ex[r], 0));
            CHECK_OK(laden_sched_enter(sc, attn, 0));
            CHECK_OK(laden_sched_exit(sc, attn, 0));
            CHECK_OK(laden_sched_synchronize(sc));
            CHECK_OK(laden_sched_stats(sc, &b));
            CHECK_EQ(b.expert_rows_moved - a.expert_rows_moved, 1);
            CHECK_EQ(b.expert_rows_cached, a.expert_rows_cached);
        }
        CHECK_OK(laden_sched_stop(sc));
        /* AUTO without a plan: none. */
        CHECK_OK(laden_sched_set_expert_cache(sc, LADEN_EXPERT_CACHE_AUTO));
        CHECK_OK(laden_sched_start(sc, 0));
        CHECK_OK(laden_sched_stats(sc, &b));
        CHECK_EQ(b.expert_cache_bytes, 0);
        laden_sched_destroy(sc);
        laden_st_close(st);
    }
}

TEST(stream_expert_cache_on_every_device)
{
    test_on_every_device(expert_cache_on);
}

/* Not asked a size, a CUDA schedule's expert cache takes what the plan
 * left of the device memory it had, in whole entries; the CPU device's
 * takes none. */
static void expert_cache_auto_on(int32_t dev)
{
    char *path = write_experts();
    const uint64_t row = 3 * NI * NH * 4;
    laden_st_t *st;
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = dev, .lookahead = 1};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t ex, gu, dn;
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &ex));
    add_fused(sc, st, ex, LADEN_DTYPE_F32, &gu, &dn);
    CHECK_OK(laden_sched_set_experts(sc, ex, NE));
    laden_plan_input in = {0};
    in.ram_total_bytes = in.ram_free_bytes = 1ull << 40;
    in.resident_blocks = -1;
    laden_plan_result res;
    if (dev != LADEN_DEVICE_CPU) { /* what the slots take, then that and
                                      two and a half experts' room */
        in.vram_free_bytes = 1ull << 40;
        CHECK_OK(laden_sched_plan(sc, &in, NULL, &res));
        in.max_vram_bytes = res.vram_used_bytes + 2 * row + row / 2;
    }
    CHECK_OK(laden_sched_plan(sc, &in, NULL, &res));
    CHECK_OK(laden_sched_load(sc));
    CHECK_OK(laden_sched_start(sc, 0));
    laden_sched_stats_t b;
    CHECK_OK(laden_sched_stats(sc, &b));
    CHECK_EQ(b.expert_cache_bytes, dev == LADEN_DEVICE_CPU ? 0 : 2 * row);
    laden_sched_destroy(sc);
    laden_st_close(st);
}

TEST(stream_expert_cache_takes_what_the_plan_leaves)
{
    test_on_every_device(expert_cache_auto_on);
}

TEST(stream_experts_refused)
{
    char *path = write_experts();
    laden_st_t *st;
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t blk, k;
    size_t a;
    CHECK_OK(laden_st_find(st, "e.0.w1", &a));
    CHECK_STATUS(laden_sched_set_experts(sc, 0, 2), LADEN_E_INVAL);
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_STATUS(laden_sched_set_experts(sc, blk, 2), LADEN_E_INVAL);
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, a, LADEN_DTYPE_F8_E4M3, &k));
    CHECK_STATUS(laden_sched_set_experts(sc, blk, 2), LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "compact"));
    CHECK_STATUS(laden_sched_set_experts(sc, blk, 0), LADEN_E_INVAL);
    laden_sched_destroy(sc);
    /* After load: the layout is fixed. */
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, a, LADEN_DTYPE_F32, &k));
    CHECK_OK(laden_sched_load(sc));
    CHECK_STATUS(laden_sched_set_experts(sc, blk, 2), LADEN_E_STATE);
    laden_sched_destroy(sc);
    laden_sched_config cc = {.device = LADEN_DEVICE_CPU,
                             .flags = LADEN_SCHED_CACHE};
    CHECK_OK(laden_sched_create(&cc, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, a, LADEN_DTYPE_F32, &k));
    CHECK_STATUS(laden_sched_set_experts(sc, blk, 2), LADEN_E_UNSUPPORTED);
    CHECK_STATUS(laden_sched_set_expert_cache(sc, 1u << 20),
                 LADEN_E_UNSUPPORTED);
    CHECK_STATUS(laden_sched_set_expert_cache(NULL, 0), LADEN_E_INVAL);
    laden_sched_destroy(sc);
    laden_st_close(st);
}
