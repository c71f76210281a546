/* The sizes and texts the Python package asks C for instead of working
 * them out itself (issue 34): a tensor's layout and its scales' offset,
 * the rest's pieces, a gradient sink's staging, the planner's warnings,
 * the state a load leaves a block in. */
#define _GNU_SOURCE /* setenv */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "laden/dev.h"
#include "laden/grads.h"
#include "laden/plan.h"
#include "laden/st.h"
#include "laden/stream.h"
#include "test.h"

/* No scale: laden_sched_set_expanded's last three arguments. */
#define NOSC 0, LADEN_SCHED_NO_SCALE, LADEN_SCALE_NONE

/* A checkpoint with one F32 tensor "w" of 2 x 11 and one F32 "b" of 3. */
static laden_st_t *two_tensors(void)
{
    float data[25];
    for (int i = 0; i < 25; i++)
        data[i] = (float)i - 5.0f;
    char *p = test_path("f.safetensors");
    test_write_st(p,
                  "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,11],"
                  "\"data_offsets\":[0,88]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[3],"
                  "\"data_offsets\":[88,100]}}",
                  data, sizeof data);
    laden_st_t *st;
    CHECK_OK(laden_st_open(p, &st));
    return st;
}

static uint32_t index_of(laden_st_t *st, const char *name)
{
    size_t k = 0;
    CHECK_OK(laden_st_find(st, name, &k));
    return (uint32_t)k;
}

/* Sizes as laid out: fp8 codes then one float32 scale per row, 16-byte
 * aligned (where the quantizer wrote them: the scales read there are the
 * rows' amax / 448); a converted or kept tensor is its elements. */
TEST(model_tensor_layout)
{
    laden_st_t *st = two_tensors();
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc;
    uint32_t b, q8, f16, f32;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
    uint32_t w = index_of(st, "w"), bias = index_of(st, "b");
    CHECK_OK(laden_sched_add_tensor(sc, b, st, w, LADEN_DTYPE_F8_E4M3, &q8));
    CHECK_OK(laden_sched_add_tensor(sc, b, st, w, LADEN_DTYPE_F16, &f16));
    CHECK_OK(laden_sched_add_tensor(sc, b, st, bias, LADEN_DTYPE_F32, &f32));
    uint64_t size, off, rows;
    /* Before load too: the layout is known once the tensor is added. */
    CHECK_OK(laden_sched_tensor_layout(sc, b, q8, &size, &off, &rows));
    CHECK_EQ(size, 32 + 2 * 4);
    CHECK_EQ(off, 32);
    CHECK_EQ(rows, 2);
    CHECK_OK(laden_sched_tensor_layout(sc, b, f16, &size, &off, &rows));
    CHECK(size == 44 && off == 0 && rows == 0);
    CHECK_OK(laden_sched_tensor_layout(sc, b, f32, &size, NULL, NULL));
    CHECK_EQ(size, 12);
    CHECK_OK(laden_sched_load(sc));
    void *hp;
    CHECK_OK(laden_sched_host_ptr(sc, b, q8, &hp));
    CHECK_OK(laden_sched_tensor_layout(sc, b, q8, &size, &off, &rows));
    float scales[2];
    memcpy(scales, (const char *)hp + off, sizeof scales);
    CHECK(scales[0] == 5.0f / 448.0f && scales[1] == 16.0f / 448.0f);
    /* Misuse: outputs zeroed, an error. */
    size = off = rows = 7;
    CHECK_EQ(laden_sched_tensor_layout(sc, b, 3, &size, &off, &rows),
             LADEN_E_INVAL);
    CHECK(size == 0 && off == 0 && rows == 0);
    CHECK_EQ(laden_sched_tensor_layout(sc, b + 1, 0, &size, NULL, NULL),
             LADEN_E_INVAL);
    CHECK_EQ(laden_sched_tensor_layout(NULL, 0, 0, &size, NULL, NULL),
             LADEN_E_INVAL);
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* The expansion workspace: each block's expanded tensors at 256-byte
 * offsets from one base, as large as the block that needs the most;
 * counted by the plan as always resident; made at start, gone at stop;
 * misuse refused. */
TEST(model_expansion_workspace)
{
    laden_st_t *st = two_tensors();
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc;
    uint32_t a, b, q8, f16, f32, bq8;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &a));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
    uint32_t w = index_of(st, "w"), bias = index_of(st, "b");
    CHECK_OK(laden_sched_add_tensor(sc, a, st, w, LADEN_DTYPE_F8_E4M3, &q8));
    CHECK_OK(laden_sched_add_tensor(sc, a, st, w, LADEN_DTYPE_F16, &f16));
    CHECK_OK(laden_sched_add_tensor(sc, a, st, bias, LADEN_DTYPE_F32, &f32));
    CHECK_OK(laden_sched_add_tensor(sc, b, st, w, LADEN_DTYPE_F8_E4M3, &bq8));
    CHECK_OK(laden_sched_set_expanded(sc, a, q8, LADEN_DTYPE_F32, NOSC));
    CHECK_OK(laden_sched_set_expanded(sc, a, f16, LADEN_DTYPE_F32, NOSC));
    CHECK_OK(laden_sched_set_expanded(sc, b, bq8, LADEN_DTYPE_BF16, NOSC));
    CHECK_EQ(laden_sched_set_expanded(sc, a, q8, LADEN_DTYPE_F32, NOSC),
             LADEN_E_STATE); /* once */
    CHECK_EQ(laden_sched_set_expanded(sc, a, f32, LADEN_DTYPE_F4, NOSC),
             LADEN_E_INVAL); /* not F32, F16, BF16 */
    CHECK_EQ(laden_sched_set_expanded(sc, a, f32, LADEN_DTYPE_F64, NOSC),
             LADEN_E_INVAL);
    CHECK_EQ(laden_sched_set_expanded(sc, a, 9, LADEN_DTYPE_F32, NOSC),
             LADEN_E_INVAL);
    CHECK_EQ(laden_sched_set_expanded(NULL, a, 0, LADEN_DTYPE_F32, NOSC),
             LADEN_E_INVAL);
    /* Scales: only on fp8, from another tensor of the block, as many as
     * the kind wants; one quantized on load has its own. */
    CHECK_EQ(laden_sched_set_expanded(sc, a, f32, LADEN_DTYPE_F32, 0, q8,
                                      LADEN_SCALE_TENSOR),
             LADEN_E_INVAL);
    CHECK_EQ(laden_sched_set_expanded(sc, b, bq8, LADEN_DTYPE_F32, 0, 0,
                                      LADEN_SCALE_TENSOR),
             LADEN_E_STATE); /* marked above: checked first */
    /* The plan holds 2 x 256 bytes on the device for it. */
    laden_plan_input in = {.ram_total_bytes = 1u << 30,
                           .ram_free_bytes = 1u << 30,
                           .ram_budget_bytes = 1u << 20};
    laden_plan_result res;
    CHECK_OK(laden_sched_plan(sc, &in, NULL, &res));
    CHECK_EQ(res.gpu_bytes, 512);
    laden_devptr_t p = 7, p2, pb;
    uint64_t n = 7;
    CHECK_EQ(laden_sched_expanded_at(sc, a, q8, &p, &n), LADEN_E_STATE);
    CHECK(p == 0 && n == 0);
    CHECK_OK(laden_sched_load(sc));
    CHECK_EQ(laden_sched_set_expanded(sc, a, f32, LADEN_DTYPE_F32, NOSC),
             LADEN_E_STATE); /* after the load */
    CHECK_OK(laden_sched_start(sc, 0));
    CHECK_OK(laden_sched_expanded_at(sc, a, q8, &p, &n));
    CHECK(p != 0 && n == 88);
    CHECK_OK(laden_sched_expanded_at(sc, a, f16, &p2, &n));
    CHECK(p2 == p + 256 && n == 88);
    CHECK_OK(laden_sched_expanded_at(sc, b, bq8, &pb, &n));
    CHECK(pb == p && n == 44);
    memset((void *)(uintptr_t)p, 0x5a, 512); /* all of it is there */
    CHECK_EQ(laden_sched_expanded_at(sc, a, f32, &p, &n), LADEN_E_INVAL);
    CHECK(p == 0 && n == 0);
    CHECK_EQ(laden_sched_expanded_at(sc, a, q8, NULL, &n), LADEN_E_INVAL);
    CHECK_OK(laden_sched_stop(sc));
    CHECK_EQ(laden_sched_expanded_at(sc, a, q8, &p, &n), LADEN_E_STATE);
    CHECK_OK(laden_sched_start(sc, 0)); /* made again; destroy frees it */
    CHECK_OK(laden_sched_expanded_at(sc, a, q8, &p, &n));
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* Enter expands: a streamed block's checkpoint fp8 with a BF16 tensor
 * scale and with F32 row scales, an F16 tensor widened, and a resident
 * block's fp8 quantized on load, each found in the workspace after the
 * block's one enter, as laden_expand gives them; the same values from
 * laden_sched_tensor_value without running, and a disk-tier tensor's
 * from its file. */
TEST(model_enter_expands)
{
    unsigned char data[32] = {
        0x38, 0x40, 0xB8, 0x3C, 0x00, 0x38, 0x40, 0x3C, /* q: 1 2 -1 1.5 ... */
        0x38, 0x38, 0x40, 0x40, 0xB8, 0xB8, 0x3C, 0x3C, /* q2 */
    };
    const float rs[2] = {2.0f, 0.25f};
    memcpy(data + 16, rs, sizeof rs);
    const uint16_t h[3] = {0x3C00, 0xC000, 0x3800}; /* 1, -2, 0.5 */
    memcpy(data + 24, h, sizeof h);
    const uint16_t half = 0x3F00; /* BF16 0.5 */
    memcpy(data + 30, &half, 2);
    char *p = test_path("fp8.safetensors");
    test_write_st(p,
                  "{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,4],"
                  "\"data_offsets\":[0,8]},"
                  "\"q2\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,4],"
                  "\"data_offsets\":[8,16]},"
                  "\"r\":{\"dtype\":\"F32\",\"shape\":[2],"
                  "\"data_offsets\":[16,24]},"
                  "\"h\":{\"dtype\":\"F16\",\"shape\":[3],"
                  "\"data_offsets\":[24,30]},"
                  "\"s\":{\"dtype\":\"BF16\",\"shape\":[],"
                  "\"data_offsets\":[30,32]},"
                  "\"e\":{\"dtype\":\"F16\",\"shape\":[0],"
                  "\"data_offsets\":[32,32]}}",
                  data, sizeof data);
    laden_st_t *st;
    CHECK_OK(laden_st_open(p, &st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t a, b, c, q, s, q2, r, hh, rq, dh, e, cq, cs;
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &a));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_GPU, &b));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &c));
    CHECK_OK(laden_sched_add_tensor(sc, c, st, index_of(st, "h"),
                                    LADEN_DTYPE_F16, &dh));
    /* The disk tier streams through a slot: its fp8 expands from there. */
    CHECK_OK(laden_sched_add_tensor(sc, c, st, index_of(st, "q"),
                                    LADEN_DTYPE_F8_E4M3, &cq));
    CHECK_OK(laden_sched_add_tensor(sc, c, st, index_of(st, "s"),
                                    LADEN_DTYPE_BF16, &cs));
    CHECK_OK(laden_sched_set_expanded(sc, c, cq, LADEN_DTYPE_F32, 4, cs,
                                      LADEN_SCALE_TENSOR));
    CHECK_OK(laden_sched_add_tensor(sc, a, st, index_of(st, "q"),
                                    LADEN_DTYPE_F8_E4M3, &q));
    CHECK_OK(laden_sched_add_tensor(sc, a, st, index_of(st, "s"),
                                    LADEN_DTYPE_BF16, &s));
    CHECK_OK(laden_sched_add_tensor(sc, a, st, index_of(st, "q2"),
                                    LADEN_DTYPE_F8_E4M3, &q2));
    CHECK_OK(laden_sched_add_tensor(sc, a, st, index_of(st, "r"),
                                    LADEN_DTYPE_F32, &r));
    CHECK_OK(laden_sched_add_tensor(sc, a, st, index_of(st, "h"),
                                    LADEN_DTYPE_F16, &hh));
    CHECK_OK(laden_sched_add_tensor(sc, b, st, index_of(st, "r"),
                                    LADEN_DTYPE_F8_E4M3, &rq));
    CHECK_EQ(laden_sched_set_expanded(sc, b, rq, LADEN_DTYPE_F32, 1, r,
                                      LADEN_SCALE_ROW),
             LADEN_E_INVAL); /* quantized on load: its own scales */
    CHECK_OK(laden_sched_set_expanded(sc, b, rq, LADEN_DTYPE_F32, NOSC));
    /* Wrong counts for the kind: refused. */
    CHECK_EQ(laden_sched_set_expanded(sc, a, q, LADEN_DTYPE_F32, 4, s,
                                      LADEN_SCALE_ROW),
             LADEN_E_INVAL);
    CHECK_EQ(laden_sched_set_expanded(sc, a, q2, LADEN_DTYPE_F32, 4, r,
                                      LADEN_SCALE_TENSOR),
             LADEN_E_INVAL);
    CHECK_EQ(laden_sched_set_expanded(sc, a, q2, LADEN_DTYPE_F32, 3, r,
                                      LADEN_SCALE_ROW),
             LADEN_E_INVAL); /* 3 columns do not divide 8 elements */
    CHECK_OK(laden_sched_set_expanded(sc, a, q, LADEN_DTYPE_F32, 4, s,
                                      LADEN_SCALE_TENSOR));
    CHECK_OK(laden_sched_set_expanded(sc, a, q2, LADEN_DTYPE_BF16, 4, r,
                                      LADEN_SCALE_ROW));
    CHECK_OK(laden_sched_set_expanded(sc, a, hh, LADEN_DTYPE_F32, NOSC));
    /* No elements: nothing to expand, the block's enter still works. */
    CHECK_OK(laden_sched_add_tensor(sc, a, st, index_of(st, "e"),
                                    LADEN_DTYPE_F16, &e));
    CHECK_OK(laden_sched_set_expanded(sc, a, e, LADEN_DTYPE_F32, NOSC));
    float v[8];
    uint16_t v16[8];
    CHECK_EQ(laden_sched_tensor_value(sc, a, q, LADEN_DTYPE_F32, v, 32),
             LADEN_E_STATE); /* nothing loaded yet */
    CHECK_CONTAINS(laden_last_error(), "not loaded");
    CHECK_OK(laden_sched_load(sc));
    /* A resident block's compact tensors expand only once started. */
    CHECK_EQ(laden_sched_enter(sc, b, 0), LADEN_E_STATE);
    CHECK_CONTAINS(laden_last_error(), "once the schedule is started");
    /* Values, without running a block: from the RAM tier's host copy,
     * the resident block's region and the disk tier's file. */
    CHECK_OK(laden_sched_tensor_value(sc, a, q, LADEN_DTYPE_F32, v, 32));
    const float wq[8] = {0.5f, 1.0f, -0.5f, 0.75f, 0.0f, 0.5f, 1.0f, 0.75f};
    CHECK(memcmp(v, wq, sizeof wq) == 0);
    CHECK_OK(laden_sched_tensor_value(sc, a, q2, LADEN_DTYPE_BF16, v16, 16));
    /* Rows times 2 and 0.25, in BF16: 2 2 4 4 / -0.25 -0.25 0.375 0.375 */
    const uint16_t wq2[8] = {0x4000, 0x4000, 0x4080, 0x4080,
                             0xBE80, 0xBE80, 0x3EC0, 0x3EC0};
    CHECK(memcmp(v16, wq2, sizeof wq2) == 0);
    CHECK_OK(laden_sched_tensor_value(sc, b, rq, LADEN_DTYPE_F32, v, 8));
    CHECK(v[0] > 1.999f && v[0] < 2.001f && v[1] > 0.2499f &&
          v[1] < 0.2501f);
    CHECK_OK(laden_sched_tensor_value(sc, c, dh, LADEN_DTYPE_F16, v16, 6));
    CHECK(memcmp(v16, h, sizeof h) == 0);
    CHECK_OK(laden_sched_tensor_value(sc, c, dh, LADEN_DTYPE_F32, v, 12));
    const float wh[3] = {1.0f, -2.0f, 0.5f};
    CHECK(memcmp(v, wh, sizeof wh) == 0);
    CHECK_EQ(laden_sched_tensor_value(sc, c, dh, LADEN_DTYPE_F32, v, 8),
             LADEN_E_INVAL); /* not its size */
    CHECK_EQ(laden_sched_tensor_value(sc, a, q, LADEN_DTYPE_F64, v, 64),
             LADEN_E_UNSUPPORTED);
    CHECK_EQ(laden_sched_tensor_value(sc, a, 9, LADEN_DTYPE_F32, v, 4),
             LADEN_E_INVAL);
    CHECK_OK(laden_sched_start(sc, 0));
    laden_devptr_t pq, pq2, ph;
    uint64_t n;
    CHECK_OK(laden_sched_expanded_at(sc, a, q, &pq, &n));
    CHECK_OK(laden_sched_expanded_at(sc, a, q2, &pq2, &n));
    CHECK_OK(laden_sched_expanded_at(sc, a, hh, &ph, &n));
    CHECK_OK(laden_sched_enter(sc, a, 0));
    CHECK(memcmp((void *)(uintptr_t)pq, wq, sizeof wq) == 0);
    CHECK(memcmp((void *)(uintptr_t)pq2, wq2, sizeof wq2) == 0);
    CHECK(memcmp((void *)(uintptr_t)ph, wh, sizeof wh) == 0);
    CHECK_OK(laden_sched_exit(sc, a, 0));
    laden_devptr_t pr;
    CHECK_OK(laden_sched_expanded_at(sc, b, rq, &pr, &n));
    CHECK(pr == pq && n == 8); /* one workspace: blocks run one at a time */
    CHECK_OK(laden_sched_enter(sc, b, 0)); /* resident: expanded too */
    const float *vr = (const float *)(uintptr_t)pr;
    CHECK(vr[0] > 1.999f && vr[0] < 2.001f && vr[1] > 0.2499f &&
          vr[1] < 0.2501f);
    CHECK_OK(laden_sched_exit(sc, b, 0));
    CHECK(laden_sched_is_streamed(sc, c)); /* from its slot, read from disk */
    laden_devptr_t pc;
    CHECK_OK(laden_sched_expanded_at(sc, c, cq, &pc, &n));
    memset((void *)(uintptr_t)pc, 0, sizeof wq);
    CHECK_OK(laden_sched_enter(sc, c, 0));
    CHECK(memcmp((void *)(uintptr_t)pc, wq, sizeof wq) == 0);
    CHECK_OK(laden_sched_exit(sc, c, 0));
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* Where the device cannot expand (the stand-in driver told to load no
 * module, so no kernels), a schedule with compact tensors is refused at
 * start, saying why, and a CPU schedule of the same tensors starts. */
TEST(stream_compact_start_needs_device_kernels)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    if (n == 0)
        SKIP("no CUDA driver");
    laden_dev_info_t info;
    CHECK_OK(laden_dev_info(0, &info));
    if (strncmp(info.name, "fake_cuda", 9) != 0)
        SKIP("a real CUDA device expands (the H200's pytest covers it)");
    setenv("FAKE_CUDA_NO_KERNELS", "1", 1); /* this test's process only */
    laden_st_t *st = two_tensors();
    for (int dev = 0; dev >= LADEN_DEVICE_CPU; dev--) {
        laden_sched_config cfg = {.device = dev};
        laden_sched_t *sc;
        uint32_t b, q8;
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b));
        CHECK_OK(laden_sched_add_tensor(sc, b, st, index_of(st, "w"),
                                        LADEN_DTYPE_F8_E4M3, &q8));
        CHECK_OK(laden_sched_set_expanded(sc, b, q8, LADEN_DTYPE_F32, NOSC));
        CHECK_OK(laden_sched_load(sc));
        if (dev == 0) {
            CHECK_STATUS(laden_sched_start(sc, 0), LADEN_E_UNSUPPORTED);
            CHECK_CONTAINS(laden_last_error(),
                           "compact tensors expand when their block runs");
            laden_devptr_t p;
            uint64_t bytes;
            CHECK_EQ(laden_sched_expanded_at(sc, b, q8, &p, &bytes),
                     LADEN_E_STATE); /* nothing was started */
        } else {
            CHECK_OK(laden_sched_start(sc, 0));
        }
        laden_sched_destroy(sc);
    }
    laden_st_close(st);
}

/* The rest's pieces: in order, a new piece when the next tensor would
 * pass the bound, a larger tensor alone, zero-byte tensors where they
 * fall, nothing for nothing. */
TEST(model_rest_pieces)
{
    uint32_t piece[8], n;
    const uint64_t a[] = {10, 20, 30, 5, 100, 1, 0, 40};
    CHECK_OK(laden_sched_pieces(a, 8, 40, piece, &n));
    const uint32_t want[] = {0, 0, 1, 1, 2, 3, 3, 4};
    for (int k = 0; k < 8; k++)
        CHECK_EQ(piece[k], want[k]);
    CHECK_EQ(n, 5);
    /* 0: laden's own bound. */
    const uint64_t big[] = {LADEN_SCHED_PIECE_BYTES - 1, 1, 1,
                            LADEN_SCHED_PIECE_BYTES};
    CHECK_OK(laden_sched_pieces(big, 4, 0, piece, &n));
    CHECK(piece[0] == 0 && piece[1] == 0 && piece[2] == 1 && piece[3] == 2);
    CHECK_EQ(n, 3);
    /* A sum that would overflow closes the piece instead. */
    const uint64_t huge[] = {UINT64_MAX - 1, 2};
    CHECK_OK(laden_sched_pieces(huge, 2, UINT64_MAX, piece, &n));
    CHECK(piece[0] == 0 && piece[1] == 1 && n == 2);
    n = 9;
    CHECK_OK(laden_sched_pieces(NULL, 0, 0, NULL, &n));
    CHECK_EQ(n, 0);
    CHECK_EQ(laden_sched_pieces(NULL, 2, 0, piece, &n), LADEN_E_INVAL);
    CHECK_EQ(laden_sched_pieces(a, 2, 0, NULL, &n), LADEN_E_INVAL);
    CHECK_EQ(laden_sched_pieces(a, 2, 0, piece, NULL), LADEN_E_INVAL);
}

/* Twice the largest gradient, within 1 MiB and 256 MiB, never wrapping. */
TEST(model_grads_staging_bytes)
{
    const uint64_t MiB = 1ull << 20;
    CHECK_EQ(laden_grads_staging_bytes(0), MiB);
    CHECK_EQ(laden_grads_staging_bytes(MiB / 2 - 1), MiB);
    CHECK_EQ(laden_grads_staging_bytes(3 * MiB), 6 * MiB);
    CHECK_EQ(laden_grads_staging_bytes(128 * MiB), 256 * MiB);
    CHECK_EQ(laden_grads_staging_bytes(128 * MiB + 1), 256 * MiB);
    CHECK_EQ(laden_grads_staging_bytes(UINT64_MAX), 256 * MiB);
}

/* Each warning bit has its text; nothing else has one. */
TEST(model_plan_warning_texts)
{
    const uint32_t bits[] = {LADEN_PLAN_WARN_DISK, LADEN_PLAN_WARN_NO_RESERVE,
                             LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE};
    for (int k = 0; k < 3; k++) {
        const char *t = laden_plan_warning_text(bits[k]);
        CHECK(t && strlen(t) > 10);
        for (int j = 0; j < k; j++)
            CHECK(strcmp(t, laden_plan_warning_text(bits[j])));
    }
    CHECK(strstr(laden_plan_warning_text(LADEN_PLAN_WARN_DISK), "disk"));
    CHECK(!laden_plan_warning_text(0));
    CHECK(!laden_plan_warning_text(LADEN_PLAN_WARN_DISK |
                                   LADEN_PLAN_WARN_NO_RESERVE));
    for (uint32_t bit = 8; bit; bit <<= 1)
        CHECK(!laden_plan_warning_text(bit));
}

/* A block's state without a VRAM context: the tier asked, never
 * offloaded; a bad block is an error with the outputs zeroed. */
TEST(model_block_state)
{
    laden_st_t *st = two_tensors();
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc;
    uint32_t b0, b1, i;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_GPU, &b0));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &b1));
    CHECK_OK(laden_sched_add_tensor(sc, b0, st, index_of(st, "b"),
                                    LADEN_DTYPE_F32, &i));
    CHECK_OK(laden_sched_add_tensor(sc, b1, st, index_of(st, "w"),
                                    LADEN_DTYPE_F32, &i));
    CHECK_OK(laden_sched_load(sc));
    int32_t tier;
    uint64_t bytes;
    uint32_t flags;
    CHECK_OK(laden_sched_block_state(sc, b0, &tier, &bytes, &flags));
    CHECK(tier == LADEN_TIER_GPU && bytes == 12 && flags == 0);
    CHECK_OK(laden_sched_block_state(sc, b1, &tier, &bytes, &flags));
    CHECK(tier == LADEN_TIER_DISK && bytes == 88 &&
          flags == LADEN_SCHED_BLOCK_STREAMED);
    CHECK_OK(laden_sched_block_state(sc, b1, NULL, NULL, NULL));
    tier = 5, bytes = 5, flags = 5;
    CHECK_EQ(laden_sched_block_state(sc, 2, &tier, &bytes, &flags),
             LADEN_E_INVAL);
    CHECK(tier == 0 && bytes == 0 && flags == 0);
    CHECK_EQ(laden_sched_block_state(NULL, 0, &tier, NULL, NULL),
             LADEN_E_INVAL);
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* The storage rule: which dtypes load into which, and when a compact form
 * is kept; the reason as the message when none. */
static uint32_t store_of(laden_dtype src, laden_dtype want, uint32_t ndim,
                         uint64_t nelem, uint32_t flags)
{
    uint32_t k = 99;
    CHECK_OK(laden_sched_storage_for(src, want, ndim, nelem, flags, &k));
    return k;
}

static void refused(laden_dtype src, laden_dtype want, uint32_t flags,
                    const char *why)
{
    uint32_t k = 99;
    CHECK_EQ(laden_sched_storage_for(src, want, 2, 4, flags, &k),
             LADEN_E_UNSUPPORTED);
    CHECK_EQ(k, LADEN_STORE_PLAIN);
    CHECK(strstr(laden_last_error(), why));
}

TEST(model_storage_for)
{
    const uint32_t C = LADEN_STORE_COMPACT, IN = LADEN_STORE_IN_BLOCK,
                   X = LADEN_STORE_EXPANDS_BLOCKS, P = LADEN_STORE_PARAM;
    const uint64_t BIG = LADEN_STORE_FP8_MIN_ELEMENTS;
    /* Kept as the model runs it, converted among the three floats. */
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F32, 2, 4, C | IN),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_BF16, LADEN_DTYPE_F16, 2, 4, 0),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_I64, LADEN_DTYPE_I64, 1, 4, C | IN),
             LADEN_STORE_PLAIN);
    refused(LADEN_DTYPE_I64, LADEN_DTYPE_F32, C | IN, "F32, F16 and BF16");
    refused(LADEN_DTYPE_F32, LADEN_DTYPE_I32, 0, "F32, F16 and BF16");
    refused(LADEN_DTYPE_F64, LADEN_DTYPE_F32, 0, "F32, F16 and BF16");
    refused(LADEN_DTYPE_F32, (laden_dtype)-1, 0, "F32, F16 and BF16");
    /* The checkpoint's fp8: kept where a block expands it, else decoded
     * on load (which a scale tensor cannot follow); into fp8 or an
     * integer it is a conversion like any other. */
    CHECK_EQ(store_of(LADEN_DTYPE_F8_E4M3, LADEN_DTYPE_BF16, 2, 4, C | IN),
             LADEN_STORE_CHECKPOINT_FP8);
    CHECK_EQ(store_of(LADEN_DTYPE_F8_E5M2, LADEN_DTYPE_F32, 2, 4, C | IN),
             LADEN_STORE_CHECKPOINT_FP8);
    CHECK_EQ(store_of(LADEN_DTYPE_F8_E4M3, LADEN_DTYPE_BF16, 2, 4, C),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_F8_E4M3, LADEN_DTYPE_BF16, 2, 4, IN),
             LADEN_STORE_PLAIN);
    refused(LADEN_DTYPE_F8_E4M3, LADEN_DTYPE_BF16, C | LADEN_STORE_SCALED,
            "outside the streamed blocks");
    CHECK_EQ(store_of(LADEN_DTYPE_F8_E4M3, LADEN_DTYPE_F8_E4M3, 2, 4, C | IN),
             LADEN_STORE_PLAIN);
    refused(LADEN_DTYPE_F8_E4M3, LADEN_DTYPE_I8, C | IN, "F32, F16 and BF16");
    /* GGUF blocks: kept where a block runs and the device expands them;
     * only ever into a floating dtype. */
    CHECK_EQ(store_of(LADEN_DTYPE_Q4_K, LADEN_DTYPE_F16, 2, 256, C | IN | X),
             LADEN_STORE_BLOCKS);
    CHECK_EQ(store_of(LADEN_DTYPE_Q4_K, LADEN_DTYPE_F16, 2, 256, C | IN),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_Q8_0, LADEN_DTYPE_F32, 2, 32, C | X),
             LADEN_STORE_PLAIN);
    refused(LADEN_DTYPE_Q6_K, LADEN_DTYPE_I32, C | IN | X,
            "expands only to a floating dtype");
    /* Storage asked: fp8 for large 2-D parameters of blocks, bf16 for the
     * blocks' floating tensors not already so. */
    const uint32_t F8 = LADEN_STORE_ASK_FP8, B16 = LADEN_STORE_ASK_BF16;
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F32, 2, BIG, IN | P | F8),
             LADEN_STORE_FP8);
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F32, 2, BIG - 1,
                      IN | P | F8),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F32, 3, BIG, IN | P | F8),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F32, 2, BIG, IN | F8),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F32, 2, BIG, P | F8),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_Q4_K, LADEN_DTYPE_F16, 2, BIG,
                      C | IN | P | F8),
             LADEN_STORE_FP8); /* expanded on load, then quantized */
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F16, 1, 4, IN | B16),
             LADEN_STORE_BF16);
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_BF16, 1, 4, IN | B16),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_I32, LADEN_DTYPE_I32, 1, 4, IN | B16),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_F32, LADEN_DTYPE_F16, 1, 4, B16),
             LADEN_STORE_PLAIN);
    CHECK_EQ(store_of(LADEN_DTYPE_F8_E4M3, LADEN_DTYPE_BF16, 2, BIG,
                      C | IN | P | F8),
             LADEN_STORE_CHECKPOINT_FP8); /* its own fp8 first */
    /* Misuse. */
    CHECK_EQ(laden_sched_storage_for(LADEN_DTYPE_F32, LADEN_DTYPE_F32, 1, 1,
                                     0, NULL),
             LADEN_E_INVAL);
    uint32_t k = 7;
    CHECK_EQ(laden_sched_storage_for(LADEN_DTYPE_COUNT, LADEN_DTYPE_F32, 1,
                                     1, 0, &k),
             LADEN_E_INVAL);
    CHECK_EQ(k, LADEN_STORE_PLAIN);
}
