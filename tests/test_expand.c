/* Device expansion (laden/expand.h).  The CPU device against independent
 * references, bit for bit: GGUF blocks against laden_gguf_dequantize (the
 * gguf package's arithmetic) then laden_sched_convert's rounding; fp8
 * against a decoder written here.  Every error, with the message naming
 * what is wrong.  CUDA (when a device can expand): the same inputs expanded
 * on the device, at every alignment, compared bit for bit with the CPU
 * result.  Under tests/fake_cuda: the same, its launches running the
 * kernels' C build; with FAKE_CUDA_NO_KERNELS, LADEN_E_UNSUPPORTED with a
 * reason, nothing else broken. */
#define _GNU_SOURCE /* setenv */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

#include "laden/dev.h"
#include "laden/expand.h"
#include "laden/gguf.h"
#include "laden/st.h"
#include "laden/stream.h"

static const laden_dtype BLOCK_TYPES[] = {
    LADEN_DTYPE_Q4_0, LADEN_DTYPE_Q4_1, LADEN_DTYPE_Q5_0, LADEN_DTYPE_Q5_1,
    LADEN_DTYPE_Q8_0, LADEN_DTYPE_Q2_K, LADEN_DTYPE_Q3_K, LADEN_DTYPE_Q4_K,
    LADEN_DTYPE_Q5_K, LADEN_DTYPE_Q6_K};
static const laden_dtype OUTS[] = {LADEN_DTYPE_F32, LADEN_DTYPE_F16,
                                   LADEN_DTYPE_BF16};
#define NB (sizeof BLOCK_TYPES / sizeof BLOCK_TYPES[0])

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return (uint32_t)(x >> 16);
}

static uint32_t out_size(laden_dtype d)
{
    return d == LADEN_DTYPE_F32 ? 4 : 2;
}

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Byte offsets of a block's f16 scale fields (d, and dmin or m). */
static void scale_fields(laden_dtype t, int *a, int *b)
{
    *b = -1;
    switch (t) {
    case LADEN_DTYPE_Q4_1: case LADEN_DTYPE_Q5_1:
    case LADEN_DTYPE_Q4_K: case LADEN_DTYPE_Q5_K:
        *a = 0;
        *b = 2;
        break;
    case LADEN_DTYPE_Q2_K: *a = 80; *b = 82; break;
    case LADEN_DTYPE_Q3_K: *a = 108; break;
    case LADEN_DTYPE_Q6_K: *a = 208; break;
    default: *a = 0; break;
    }
}

/* Random blocks whose f16 scales are finite (an exponent of all ones is
 * cleared), so that bitwise comparison means something. */
static void random_blocks(laden_dtype t, uint8_t *p, uint64_t nblocks,
                          uint32_t bb)
{
    int fa, fb;
    scale_fields(t, &fa, &fb);
    for (uint64_t i = 0; i < nblocks * bb; i++)
        p[i] = (uint8_t)rnd();
    for (uint64_t k = 0; k < nblocks; k++)
        for (int j = 0; j < 2; j++) {
            int at = j ? fb : fa;
            if (at < 0)
                continue;
            uint8_t *h = p + k * bb + at + 1; /* the high byte */
            if ((*h & 0x7c) == 0x7c)
                *h &= (uint8_t)~0x40;
        }
}

/* Rounds n floats to `to` as the reference does (laden_sched_convert),
 * into out. */
static void round_ref(const float *f, uint64_t n, laden_dtype to, void *out)
{
    if (to == LADEN_DTYPE_F32)
        memcpy(out, f, n * 4);
    else
        CHECK_OK(laden_sched_convert(LADEN_DTYPE_F32, f, to, out, n));
}

static void check_same(const void *got, const void *want, uint64_t n,
                       laden_dtype to, const char *what)
{
    uint32_t sz = out_size(to);
    if (memcmp(got, want, n * sz) == 0)
        return;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t g = 0, w = 0;
        memcpy(&g, (const char *)got + i * sz, sz);
        memcpy(&w, (const char *)want + i * sz, sz);
        if (g != w) {
            fprintf(stderr, "%s to %s: element %llu is 0x%x, expected 0x%x\n",
                    what, laden_dtype_name(to), (unsigned long long)i, g, w);
            break;
        }
    }
    CHECK(!"results differ");
}

/* ---- GGUF blocks on the CPU ------------------------------------------- */

static void gguf_case(laden_dtype t, uint64_t nblocks, uint32_t src_off,
                      uint32_t dst_off)
{
    uint32_t be, bb;
    CHECK_OK(laden_dtype_block(t, &be, &bb));
    uint64_t n = nblocks * be, sb = nblocks * bb;
    uint8_t *srcbuf = malloc(sb + 16);
    uint8_t *src = srcbuf + src_off;
    float *f = malloc(n * 4);
    random_blocks(t, src, nblocks, bb);
    CHECK_OK(laden_gguf_dequantize(laden_ggml_of_dtype(t), src, sb, f, n));
    for (size_t o = 0; o < 3; o++) {
        laden_dtype to = OUTS[o];
        /* dst_off counts 2-byte elements: as many 4-byte ones for F32 */
        uint32_t off = dst_off * out_size(to) / 2;
        uint8_t *want = malloc(n * 4), *gotbuf = malloc(n * 4 + 32);
        uint8_t *got = gotbuf + off;
        round_ref(f, n, to, want);
        memset(gotbuf, 0xa5, n * 4 + 32);
        CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, t, (uintptr_t)src, sb, n,
                              0, 0, LADEN_SCALE_NONE, to, (uintptr_t)got));
        check_same(got, want, n, to, laden_dtype_name(t));
        /* nothing written past the end */
        for (uint64_t i = n * out_size(to); i < n * 4 + 32 - off; i++)
            CHECK_EQ(got[i], 0xa5);
        free(want);
        free(gotbuf);
    }
    free(f);
    free(srcbuf);
}

TEST(expand_gguf_cpu_matches_reference)
{
    for (size_t i = 0; i < NB; i++) {
        uint32_t be, bb;
        CHECK_OK(laden_dtype_block(BLOCK_TYPES[i], &be, &bb));
        gguf_case(BLOCK_TYPES[i], be == 32 ? 4099 : 517, 0, 0);
        gguf_case(BLOCK_TYPES[i], 3, 1, 2); /* unaligned src and dst */
        gguf_case(BLOCK_TYPES[i], 1, 0, 0);
    }
}

/* Non-finite scales give the one quiet NaN (and infinities stay). */
TEST(expand_gguf_cpu_non_finite_scales)
{
    uint8_t b[34] = {0x00, 0x7c}; /* Q8_0, d = +inf */
    b[2] = 0;                       /* inf * 0 = NaN */
    b[3] = 1;                       /* inf */
    b[4] = 0xff;                    /* -inf */
    uint32_t f32[32];
    uint16_t h[32];
    CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, LADEN_DTYPE_Q8_0,
                          (uintptr_t)b, 34, 32, 0, 0, LADEN_SCALE_NONE,
                          LADEN_DTYPE_F32, (uintptr_t)f32));
    CHECK_EQ(f32[0], 0x7fc00000u);
    CHECK_EQ(f32[1], 0x7f800000u);
    CHECK_EQ(f32[2], 0xff800000u);
    CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, LADEN_DTYPE_Q8_0,
                          (uintptr_t)b, 34, 32, 0, 0, LADEN_SCALE_NONE,
                          LADEN_DTYPE_BF16, (uintptr_t)h));
    CHECK_EQ(h[0], 0x7fc0);
    CHECK_EQ(h[1], 0x7f80);
    CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, LADEN_DTYPE_Q8_0,
                          (uintptr_t)b, 34, 32, 0, 0, LADEN_SCALE_NONE,
                          LADEN_DTYPE_F16, (uintptr_t)h));
    CHECK_EQ(h[0], 0x7e00);
    CHECK_EQ(h[2], 0xfc00);
    b[1] = 0x7e; /* d = NaN: every element NaN */
    CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, LADEN_DTYPE_Q8_0,
                          (uintptr_t)b, 34, 32, 0, 0, LADEN_SCALE_NONE,
                          LADEN_DTYPE_F32, (uintptr_t)f32));
    for (int i = 0; i < 32; i++)
        CHECK_EQ(f32[i], 0x7fc00000u);
}

/* ---- fp8 on the CPU ------------------------------------------------------ */

/* The fp8 value, decoded from its fields. */
static float fp8_value(uint8_t b, int e5)
{
    float sign = b & 0x80 ? -1.0f : 1.0f;
    if (e5) {
        int e = (b >> 2) & 31, m = b & 3;
        if (e == 31)
            return m ? NAN : sign * INFINITY;
        if (e == 0)
            return sign * ldexpf((float)m, -16);
        return sign * ldexpf(1.0f + (float)m / 4.0f, e - 15);
    }
    int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7)
        return NAN;
    if (e == 0)
        return sign * ldexpf((float)m, -9);
    return sign * ldexpf(1.0f + (float)m / 8.0f, e - 7);
}

/* One element rounded to `to`, NaN as the one quiet NaN. */
static void put_ref(float v, laden_dtype to, void *out, uint64_t i)
{
    if (isnan(v)) {
        uint32_t q = to == LADEN_DTYPE_F32   ? 0x7fc00000u
                     : to == LADEN_DTYPE_F16 ? 0x7e00u
                                             : 0x7fc0u;
        memcpy((char *)out + i * out_size(to), &q, out_size(to));
        return;
    }
    round_ref(&v, 1, to, (char *)out + i * out_size(to));
}

typedef struct fp8_shape {
    uint64_t rows, cols;
} fp8_shape;

static float scale_of(const float *s, laden_scale_kind kind, uint64_t cols,
                      uint64_t r, uint64_t c)
{
    uint64_t tcols = (cols + 127) / 128;
    return kind == LADEN_SCALE_TENSOR ? s[0]
           : kind == LADEN_SCALE_ROW  ? s[r]
                                      : s[(r / 128) * tcols + c / 128];
}

/* Random fp8 bytes: half the 8-byte units free of NaN and infinity codes
 * (the fast path), the others as they come. */
static void random_fp8(uint8_t *q, uint64_t n, int e5)
{
    for (uint64_t i = 0; i < n; i++)
        q[i] = (uint8_t)rnd();
    for (uint64_t u = 0; u < n; u += 8)
        if (rnd() & 1)
            for (uint64_t i = u; i < n && i < u + 8; i++)
                if (e5 ? (q[i] & 0x7c) == 0x7c : (q[i] & 0x7f) == 0x7f)
                    q[i] = 0x3a;
}

/* Scales, mostly ordinary, some zero, subnormal, huge (products overflow),
 * infinite, NaN. */
static void random_scales(float *s, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) {
        uint32_t k = rnd() % 16;
        s[i] = k == 0   ? 0.0f
               : k == 1 ? 3e-39f
               : k == 2 ? 3e38f
               : k == 3 ? INFINITY
               : k == 4 ? NAN
               : k == 5 ? -1e-30f
                        : ldexpf((float)(rnd() % 1000 + 1), (int)(rnd() % 24) - 16) *
                              (rnd() & 1 ? -1.0f : 1.0f);
    }
}

static void fp8_case(laden_dtype t, laden_scale_kind kind, fp8_shape sh,
                     uint32_t src_off, uint32_t dst_off)
{
    int e5 = t == LADEN_DTYPE_F8_E5M2;
    uint64_t n = sh.rows * sh.cols;
    uint64_t ns = kind == LADEN_SCALE_NONE     ? 0
                  : kind == LADEN_SCALE_TENSOR ? 1
                  : kind == LADEN_SCALE_ROW
                      ? sh.rows
                      : ((sh.rows + 127) / 128) * ((sh.cols + 127) / 128);
    uint8_t *qbuf = malloc(n + 16), *q = qbuf + src_off;
    float *s = malloc((ns + 1) * 4);
    random_fp8(q, n, e5);
    random_scales(s, ns);
    for (size_t o = 0; o < 3; o++) {
        laden_dtype to = OUTS[o];
        uint8_t *want = malloc(n * 4), *gotbuf = malloc(n * 4 + 32);
        uint8_t *got = gotbuf + dst_off * out_size(to) / 2;
        for (uint64_t r = 0; r < sh.rows; r++)
            for (uint64_t c = 0; c < sh.cols; c++) {
                float v = fp8_value(q[r * sh.cols + c], e5);
                if (kind != LADEN_SCALE_NONE)
                    v = v * scale_of(s, kind, sh.cols, r, c);
                put_ref(v, to, want, r * sh.cols + c);
            }
        CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, t, (uintptr_t)q, n,
                              n, sh.cols, ns ? (uintptr_t)s : 0, kind, to,
                              (uintptr_t)got));
        char what[96];
        snprintf(what, sizeof what, "%s scale %d %llux%llu",
                 laden_dtype_name(t), (int)kind,
                 (unsigned long long)sh.rows, (unsigned long long)sh.cols);
        check_same(got, want, n, to, what);
        free(want);
        free(gotbuf);
    }
    free(s);
    free(qbuf);
}

TEST(expand_fp8_cpu_matches_reference)
{
    static const fp8_shape shapes[] = {
        {130, 200}, {130, 203}, {257, 384}, {3, 7}, {1, 1001}, {300, 128}};
    for (int e5 = 0; e5 < 2; e5++) {
        laden_dtype t = e5 ? LADEN_DTYPE_F8_E5M2 : LADEN_DTYPE_F8_E4M3;
        for (int k = 0; k <= LADEN_SCALE_TILE128; k++)
            for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
                fp8_case(t, (laden_scale_kind)k, shapes[i], 0, 0);
        fp8_case(t, LADEN_SCALE_ROW, (fp8_shape){33, 40}, 3, 2);
        fp8_case(t, LADEN_SCALE_TILE128, (fp8_shape){130, 203}, 1, 6);
    }
}

/* Every fp8 code once, scale 1: the decoding itself. */
TEST(expand_fp8_cpu_every_code)
{
    for (int e5 = 0; e5 < 2; e5++) {
        uint8_t q[256];
        float f[256];
        for (int i = 0; i < 256; i++)
            q[i] = (uint8_t)i;
        CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0,
                              e5 ? LADEN_DTYPE_F8_E5M2 : LADEN_DTYPE_F8_E4M3,
                              (uintptr_t)q, 256, 256, 0, 0, LADEN_SCALE_NONE,
                              LADEN_DTYPE_F32, (uintptr_t)f));
        for (int i = 0; i < 256; i++) {
            float want = fp8_value((uint8_t)i, e5);
            if (isnan(want))
                CHECK_EQ(f2u(f[i]), 0x7fc00000u);
            else
                CHECK_EQ(f2u(f[i]), f2u(want));
        }
    }
    /* e4m3: 0x7e is 448, 0x01 is 2^-9, 0x80 is -0 */
    uint8_t q[8] = {0x7e, 0x01, 0x80, 0x38, 0, 0, 0, 0};
    float f[8];
    CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, LADEN_DTYPE_F8_E4M3,
                          (uintptr_t)q, 8, 8, 0, 0, LADEN_SCALE_NONE,
                          LADEN_DTYPE_F32, (uintptr_t)f));
    CHECK_FEQ(f[0], 448.0);
    CHECK_FEQ(f[1], 1.0 / 512);
    CHECK_EQ(f2u(f[2]), 0x80000000u);
    CHECK_FEQ(f[3], 1.0);
}

/* F32/F16/BF16 to each other, as laden_sched_convert, NaN made quiet. */
TEST(expand_plain_cpu_matches_convert)
{
    static const laden_dtype ins[] = {LADEN_DTYPE_F32, LADEN_DTYPE_F16,
                                      LADEN_DTYPE_BF16};
    const uint64_t n = 4099;
    for (size_t i = 0; i < 3; i++) {
        uint32_t isz = out_size(ins[i]);
        uint8_t *src = malloc(n * isz);
        for (uint64_t k = 0; k < n * isz; k++)
            src[k] = (uint8_t)rnd();
        for (size_t o = 0; o < 3; o++) {
            laden_dtype to = OUTS[o];
            uint8_t *want = malloc(n * 4), *got = malloc(n * 4);
            float *f = malloc(n * 4);
            CHECK_OK(laden_sched_convert(ins[i], src, LADEN_DTYPE_F32, f, n));
            for (uint64_t k = 0; k < n; k++)
                put_ref(f[k], to, want, k);
            CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, ins[i],
                                  (uintptr_t)src, n * isz, n, 0, 0,
                                  LADEN_SCALE_NONE, to, (uintptr_t)got));
            check_same(got, want, n, to, laden_dtype_name(ins[i]));
            free(want);
            free(got);
            free(f);
        }
        free(src);
    }
}

/* ---- errors ------------------------------------------------------------ */

#define EXPECT(status, needle, call)                 \
    do {                                             \
        CHECK_STATUS(call, status);                  \
        CHECK_CONTAINS(laden_last_error(), needle); \
    } while (0)

TEST(expand_errors_name_the_problem)
{
    uint8_t src[256 * 4] = {0};
    float scale[4] = {1, 1, 1, 1};
    uint16_t dst[1024];
    uintptr_t S = (uintptr_t)src, D = (uintptr_t)dst, C = (uintptr_t)scale;
    const int32_t cpu = LADEN_DEVICE_CPU;
    const laden_dtype Q4K = LADEN_DTYPE_Q4_K, E4 = LADEN_DTYPE_F8_E4M3,
                      BF = LADEN_DTYPE_BF16;
    EXPECT(LADEN_E_INVAL, "src is NULL",
           laden_expand(cpu, 0, Q4K, 0, 144, 256, 0, 0, 0, BF, D));
    EXPECT(LADEN_E_INVAL, "dst is NULL",
           laden_expand(cpu, 0, Q4K, S, 144, 256, 0, 0, 0, BF, 0));
    EXPECT(LADEN_E_INVAL, "n_elems is 0",
           laden_expand(cpu, 0, Q4K, S, 0, 0, 0, 0, 0, BF, D));
    EXPECT(LADEN_E_INVAL, "not a multiple of q4_k's 256-element blocks",
           laden_expand(cpu, 0, Q4K, S, 144, 255, 0, 0, 0, BF, D));
    EXPECT(LADEN_E_INVAL, "take 144 bytes, not src_bytes 145",
           laden_expand(cpu, 0, Q4K, S, 145, 256, 0, 0, 0, BF, D));
    EXPECT(LADEN_E_INVAL, "GGUF blocks carry their own scales",
           laden_expand(cpu, 0, Q4K, S, 144, 256, 0, C,
                        LADEN_SCALE_TENSOR, BF, D));
    EXPECT(LADEN_E_INVAL, "plain conversion has none",
           laden_expand(cpu, 0, LADEN_DTYPE_F16, S, 512, 256, 0, C,
                        LADEN_SCALE_TENSOR, BF, D));
    EXPECT(LADEN_E_UNSUPPORTED, "cannot expand Q4_K to I8",
           laden_expand(cpu, 0, Q4K, S, 144, 256, 0, 0, 0,
                        LADEN_DTYPE_I8, D));
    EXPECT(LADEN_E_UNSUPPORTED, "cannot expand I8 to BF16",
           laden_expand(cpu, 0, LADEN_DTYPE_I8, S, 256, 256, 0, 0, 0, BF,
                        D));
    EXPECT(LADEN_E_UNSUPPORTED, "an unknown dtype",
           laden_expand(cpu, 0, (laden_dtype)999, S, 256, 256, 0, 0, 0, BF,
                        D));
    EXPECT(LADEN_E_INVAL, "cols is 0 with a per-row scale",
           laden_expand(cpu, 0, E4, S, 256, 256, 0, C, LADEN_SCALE_ROW, BF,
                        D));
    EXPECT(LADEN_E_INVAL, "cols is 0 with a per-tile scale",
           laden_expand(cpu, 0, E4, S, 256, 256, 0, C, LADEN_SCALE_TILE128,
                        BF, D));
    EXPECT(LADEN_E_INVAL, "not whole rows of cols 100",
           laden_expand(cpu, 0, E4, S, 256, 256, 100, C, LADEN_SCALE_ROW, BF,
                        D));
    EXPECT(LADEN_E_INVAL, "take 256 bytes, not src_bytes 512",
           laden_expand(cpu, 0, E4, S, 512, 256, 0, 0, 0, BF, D));
    EXPECT(LADEN_E_INVAL, "scale is NULL with scale kind 1",
           laden_expand(cpu, 0, E4, S, 256, 256, 0, 0, LADEN_SCALE_TENSOR,
                        BF, D));
    EXPECT(LADEN_E_INVAL, "a scale address with LADEN_SCALE_NONE",
           laden_expand(cpu, 0, E4, S, 256, 256, 0, C, LADEN_SCALE_NONE, BF,
                        D));
    EXPECT(LADEN_E_INVAL, "scale kind 7",
           laden_expand(cpu, 0, E4, S, 256, 256, 0, C, (laden_scale_kind)7,
                        BF, D));
    EXPECT(LADEN_E_INVAL, "not aligned to the 4 bytes of a float32",
           laden_expand(cpu, 0, E4, S, 256, 256, 0, C + 2,
                        LADEN_SCALE_TENSOR, BF, D));
    EXPECT(LADEN_E_INVAL, "not aligned to the 2 bytes of BF16",
           laden_expand(cpu, 0, E4, S, 256, 256, 0, 0, 0, BF, D + 1));
    EXPECT(LADEN_E_INVAL, "overflow",
           laden_expand(cpu, 0, E4, S, UINT64_MAX, UINT64_MAX, 0, 0, 0,
                        LADEN_DTYPE_F32, D));
    EXPECT(LADEN_E_INVAL, "past the end of the address space",
           laden_expand(cpu, 0, E4, UINT64_MAX - 8, 256, 256, 0, 0, 0, BF,
                        D));
    EXPECT(LADEN_E_NODEVICE, "device 999",
           laden_expand(999, 0, E4, S, 256, 256, 0, 0, 0, BF, D));
    /* nothing written by a refused call */
    dst[0] = 0x1234;
    CHECK_STATUS(laden_expand(cpu, 0, E4, S, 256, 256, 100, C,
                              LADEN_SCALE_ROW, BF, D),
                 LADEN_E_INVAL);
    CHECK_EQ(dst[0], 0x1234);
    /* the other calls */
    CHECK_OK(laden_expand_ready(cpu));
    EXPECT(LADEN_E_NODEVICE, "999", laden_expand_ready(999));
    EXPECT(LADEN_E_INVAL, "empty", laden_expand_set_nvrtc(""));
    char longpath[8192];
    memset(longpath, 'a', sizeof longpath - 1);
    longpath[sizeof longpath - 1] = 0;
    EXPECT(LADEN_E_INVAL, "too long", laden_expand_set_nvrtc(longpath));
    CHECK_OK(laden_expand_set_nvrtc(NULL));
    char text[256];
    CHECK_OK(laden_expand_describe(cpu, text, sizeof text));
    CHECK_CONTAINS(text, "cpu");
    EXPECT(LADEN_E_INVAL, "no room", laden_expand_describe(cpu, NULL, 0));
}

/* ---- CUDA -------------------------------------------------------------- */

/* The first CUDA device, or -1 when there is none (saying why). */
static int32_t cuda_device(laden_dev_info_t *info)
{
    int32_t n = 0;
    CHECK_OK(laden_dev_count(&n));
    if (n == 0)
        return -1;
    CHECK_OK(laden_dev_info(0, info));
    return 0;
}

/* Under tests/fake_cuda with FAKE_CUDA_NO_KERNELS (a driver that loads no
 * module): no kernels; everything says so and nothing crashes. */
TEST(expand_cuda_unavailable_is_unsupported)
{
    laden_dev_info_t info;
    if (cuda_device(&info) < 0)
        SKIP("no CUDA driver");
    if (strncmp(info.name, "fake_cuda", 9) != 0)
        SKIP("a real CUDA device (expand_cuda_matches_cpu covers it)");
    setenv("FAKE_CUDA_NO_KERNELS", "1", 1); /* this test's process only */
    CHECK_OK(laden_expand_set_nvrtc("/nonexistent/libnvrtc.so.13"));
    laden_status st = laden_expand_ready(0);
    CHECK_STATUS(st, LADEN_E_UNSUPPORTED);
    const char *why = laden_last_error();
    fprintf(stderr, "why: %s\n", why);
    CHECK(strlen(why) > 10);
    if (strstr(why, "not found")) /* no NVRTC on this machine */
        CHECK_CONTAINS(why, "/nonexistent/libnvrtc.so.13");
    else /* NVRTC found (LADEN_NVRTC): the kernels compiled, then */
        CHECK_CONTAINS(why, "cuModuleLoadData");
    /* remembered, and what laden_expand says too */
    char text[1024];
    CHECK_STATUS(laden_expand_describe(0, text, sizeof text),
                 LADEN_E_UNSUPPORTED);
    CHECK(strlen(text) > 10);
    uint8_t q[8] = {0};
    uint16_t out[8];
    CHECK_STATUS(laden_expand(0, 0, LADEN_DTYPE_F8_E4M3, (uintptr_t)q, 8, 8,
                              0, 0, LADEN_SCALE_NONE, LADEN_DTYPE_BF16,
                              (uintptr_t)out),
                 LADEN_E_UNSUPPORTED);
    /* the CPU device still works */
    CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, LADEN_DTYPE_F8_E4M3,
                          (uintptr_t)q, 8, 8, 0, 0, LADEN_SCALE_NONE,
                          LADEN_DTYPE_BF16, (uintptr_t)out));
    CHECK_EQ(out[0], 0);
}

typedef struct gpu {
    int32_t dev;
    laden_dev_stream_t *s; /* the legacy default stream, wrapped */
} gpu;

/* Expands (src, scale) on the CPU and on the device, with src placed
 * src_off bytes and dst dst_off bytes past 16-byte-aligned device
 * addresses, and compares the two bit for bit. */
static void gpu_case(gpu *g, laden_dtype t, const uint8_t *src,
                     uint64_t src_bytes, uint64_t n, uint64_t cols,
                     const float *scale, uint64_t nscales,
                     laden_scale_kind kind, laden_dtype to, uint32_t src_off,
                     uint32_t dst_off)
{
    uint64_t out_bytes = n * out_size(to);
    uint8_t *want = malloc(out_bytes), *got = malloc(out_bytes);
    CHECK_OK(laden_expand(LADEN_DEVICE_CPU, 0, t, (uintptr_t)src, src_bytes, n,
                          cols, nscales ? (uintptr_t)scale : 0, kind, to,
                          (uintptr_t)want));
    laden_devptr_t dsrc, ddst, dscale = 0;
    CHECK_OK(laden_dev_mem_alloc(g->dev, src_bytes + 64, &dsrc));
    CHECK_OK(laden_dev_mem_alloc(g->dev, out_bytes + 64, &ddst));
    if (nscales) {
        CHECK_OK(laden_dev_mem_alloc(g->dev, nscales * 4, &dscale));
        CHECK_OK(laden_dev_copy_h2d(g->s, dscale, scale, nscales * 4));
    }
    CHECK_OK(laden_dev_copy_h2d(g->s, dsrc + src_off, src, src_bytes));
    memset(got, 0x5a, out_bytes);
    CHECK_OK(laden_dev_copy_h2d(g->s, ddst + dst_off, got, out_bytes));
    if (getenv("LADEN_TEST_TRACE"))
        fprintf(stderr, "case %s n %llu cols %llu scale %d src+%u dst+%u to %s\n",
                laden_dtype_name(t), (unsigned long long)n,
                (unsigned long long)cols, (int)kind, src_off, dst_off,
                laden_dtype_name(to));
    CHECK_OK(laden_expand(g->dev, 0, t, dsrc + src_off, src_bytes, n, cols,
                          dscale, kind, to, ddst + dst_off));
    CHECK_OK(laden_dev_copy_d2h(g->s, got, ddst + dst_off, out_bytes));
    CHECK_OK(laden_dev_stream_synchronize(g->s));
    char what[128];
    snprintf(what, sizeof what,
             "cuda:%d %s n %llu cols %llu scale %d src+%u dst+%u", g->dev,
             laden_dtype_name(t), (unsigned long long)n,
             (unsigned long long)cols, (int)kind, src_off, dst_off);
    check_same(got, want, n, to, what);
    CHECK_OK(laden_dev_mem_free(g->dev, dsrc));
    CHECK_OK(laden_dev_mem_free(g->dev, ddst));
    if (dscale)
        CHECK_OK(laden_dev_mem_free(g->dev, dscale));
    free(want);
    free(got);
}

static int gpu_open(gpu *g)
{
    laden_dev_info_t info;
    if (cuda_device(&info) < 0) {
        fprintf(stderr, "(no CUDA: %s)\n", laden_dev_cuda_error());
        return 0;
    }
    g->dev = 0;
    char text[1200];
    laden_status st = laden_expand_describe(0, text, sizeof text);
    if (st) {
        fprintf(stderr, "(cuda:0 (%s) cannot expand: %s)\n", info.name,
                text);
        return 0;
    }
    fprintf(stderr, "%s\n", text);
    CHECK_OK(laden_dev_stream_wrap(0, 0, &g->s));
    return 1;
}

TEST(expand_cuda_gguf_matches_cpu)
{
    gpu g;
    if (!gpu_open(&g))
        SKIP("no CUDA device that can expand (see above)");
    static const uint32_t offs[][2] = {{0, 0}, {1, 2}, {2, 4}, {16, 6},
                                       {4, 16}};
    for (size_t i = 0; i < NB; i++) {
        laden_dtype t = BLOCK_TYPES[i];
        uint32_t be, bb;
        CHECK_OK(laden_dtype_block(t, &be, &bb));
        uint64_t nblocks = be == 32 ? 20011 : 2503; /* odd, ~640k */
        uint8_t *src = malloc(nblocks * bb);
        random_blocks(t, src, nblocks, bb);
        for (size_t o = 0; o < 3; o++)
            for (size_t a = 0; a < sizeof offs / sizeof offs[0]; a++) {
                uint32_t doff = offs[a][1] % out_size(OUTS[o]) == 0
                                    ? offs[a][1] : 0;
                gpu_case(&g, t, src, nblocks * bb, nblocks * be, 0, NULL, 0,
                         LADEN_SCALE_NONE, OUTS[o], offs[a][0], doff);
            }
        /* a few blocks: fewer units than one warp */
        gpu_case(&g, t, src, bb, be, 0, NULL, 0, LADEN_SCALE_NONE,
                 LADEN_DTYPE_BF16, 0, 0);
        free(src);
    }
    /* non-finite scales: NaN and infinities as on the CPU */
    uint8_t b[34 * 4];
    random_blocks(LADEN_DTYPE_Q8_0, b, 4, 34);
    b[1] = 0x7c;            /* +inf */
    b[34 + 1] = 0x7e;       /* NaN */
    b[68 + 1] = 0xfc;       /* -inf */
    b[2] = 0;
    for (size_t o = 0; o < 3; o++) {
        gpu_case(&g, LADEN_DTYPE_Q8_0, b, sizeof b, 128, 0, NULL, 0,
                 LADEN_SCALE_NONE, OUTS[o], 0, 0);
        gpu_case(&g, LADEN_DTYPE_Q8_0, b, sizeof b, 128, 0, NULL, 0,
                 LADEN_SCALE_NONE, OUTS[o], 1, out_size(OUTS[o]));
    }
    laden_dev_stream_destroy(g.s);
}

TEST(expand_cuda_fp8_and_plain_match_cpu)
{
    gpu g;
    if (!gpu_open(&g))
        SKIP("no CUDA device that can expand (see above)");
    static const fp8_shape shapes[] = {{130, 200}, {130, 203}, {257, 384},
                                       {3, 7},     {1, 1001},  {1000, 1024}};
    static const uint32_t offs[][2] = {{0, 0}, {1, 2}, {8, 4}, {3, 16}};
    for (int e5 = 0; e5 < 2; e5++) {
        laden_dtype t = e5 ? LADEN_DTYPE_F8_E5M2 : LADEN_DTYPE_F8_E4M3;
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
            fp8_shape sh = shapes[i];
            uint64_t n = sh.rows * sh.cols;
            uint64_t ntile = ((sh.rows + 127) / 128) * ((sh.cols + 127) / 128);
            uint8_t *q = malloc(n);
            float *s = malloc((sh.rows + ntile) * 4);
            random_fp8(q, n, e5);
            random_scales(s, sh.rows + ntile);
            for (int k = 0; k <= LADEN_SCALE_TILE128; k++) {
                uint64_t ns = k == 0 ? 0 : k == 1 ? 1 : k == 2 ? sh.rows
                                                               : ntile;
                for (size_t o = 0; o < 3; o++)
                    for (size_t a = 0; a < sizeof offs / sizeof offs[0]; a++) {
                        uint32_t doff = offs[a][1] % out_size(OUTS[o]) == 0
                                            ? offs[a][1] : 0;
                        gpu_case(&g, t, q, n, n, sh.cols, s, ns,
                                 (laden_scale_kind)k, OUTS[o], offs[a][0],
                                 doff);
                    }
            }
            free(q);
            free(s);
        }
    }
    static const laden_dtype ins[] = {LADEN_DTYPE_F32, LADEN_DTYPE_F16,
                                      LADEN_DTYPE_BF16};
    const uint64_t n = 10007;
    uint8_t *src = malloc(n * 4);
    for (uint64_t k = 0; k < n * 4; k++)
        src[k] = (uint8_t)rnd();
    for (size_t i = 0; i < 3; i++)
        for (size_t o = 0; o < 3; o++) {
            gpu_case(&g, ins[i], src, n * out_size(ins[i]), n, 0, NULL, 0,
                     LADEN_SCALE_NONE, OUTS[o], 0, 0);
            gpu_case(&g, ins[i], src, n * out_size(ins[i]), n, 0, NULL, 0,
                     LADEN_SCALE_NONE, OUTS[o], 1, 4);
        }
    free(src);
    laden_dev_stream_destroy(g.s);
}

/* Large enough that every thread of the grid loops several times. */
TEST(expand_cuda_large_matches_cpu)
{
    gpu g;
    if (!gpu_open(&g))
        SKIP("no CUDA device that can expand (see above)");
    const uint64_t nblocks = 1u << 17; /* 32 Mi elements of Q4_K */
    uint8_t *src = malloc(nblocks * 144);
    random_blocks(LADEN_DTYPE_Q4_K, src, nblocks, 144);
    gpu_case(&g, LADEN_DTYPE_Q4_K, src, nblocks * 144, nblocks * 256, 0, NULL,
             0, LADEN_SCALE_NONE, LADEN_DTYPE_BF16, 0, 0);
    free(src);
    const uint64_t rows = 4096, cols = 7168; /* 29 Mi elements of fp8 */
    uint8_t *q = malloc(rows * cols);
    float *s = malloc(rows * 4);
    random_fp8(q, rows * cols, 0);
    for (uint64_t r = 0; r < rows; r++)
        s[r] = ldexpf((float)(rnd() % 1000 + 1), -12);
    gpu_case(&g, LADEN_DTYPE_F8_E4M3, q, rows * cols, rows * cols, cols, s,
             rows, LADEN_SCALE_ROW, LADEN_DTYPE_BF16, 0, 0);
    free(q);
    free(s);
    laden_dev_stream_destroy(g.s);
}
