/* Parts of checkpoint tensors (laden_sched_add_tensor_part): a tensor-
 * parallel rank's shard, read alone -- rows as one range, columns as a
 * range per row -- packed, converted where asked, on every tier that can
 * hold it; the disk tier refuses a part of several ranges. */
#include "test.h"

#include "laden/dev.h"
#include "laden/stream.h"

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
