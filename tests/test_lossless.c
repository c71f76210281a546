#define _GNU_SOURCE /* truncate */
/* lossless: every 16-bit pattern comes back as it went in, weights take
 * about two thirds of their bytes, and a blob that changed is refused by
 * name, never read or written out of bounds. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h> /* AT_FDCWD */
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"

#include "laden/cache.h"
#include "laden/expand.h"
#include "laden/lossless.h"
#include "laden/trace.h"
#include "io/cold.h" /* laden__io_misplaced_bytes */

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t next32(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

enum { RANDOM, WEIGHTS, EQUAL, SPECIAL, NCLASS };

/* n values of class c for dtype: every pattern; weight-like (random sign
 * and mantissa, exponents clustered as a layer's are); one value; NaNs,
 * infinities, zeros and subnormals among weights. */
static uint16_t *values(laden_dtype dt, int c, uint64_t n)
{
    uint16_t *v = malloc(2 * (n ? n : 1));
    CHECK(v);
    bool bf = dt == LADEN_DTYPE_BF16;
    static const uint16_t special_bf[] = {0x7fc0, 0x7fc1, 0xffc0, 0x7f80,
                                          0xff80, 0x0000, 0x8000, 0x0001,
                                          0x807f, 0x0040};
    static const uint16_t special_f16[] = {0x7e00, 0x7c01, 0xfe00, 0x7c00,
                                           0xfc00, 0x0000, 0x8000, 0x0001,
                                           0x83ff, 0x0200};
    for (uint64_t k = 0; k < n; k++) {
        uint32_t r = next32();
        uint32_t e = 0; /* exponent: mostly a few values below one */
        while ((r & 1u) && e < 20) {
            e++;
            r >>= 1;
        }
        uint32_t sign = next32() & 1u, mant = next32();
        uint16_t w = bf ? (uint16_t)(sign << 15 | (121u - e) << 7 |
                                     (mant & 0x7fu))
                        : (uint16_t)(sign << 15 | (13u - e % 13u) << 10 |
                                     (mant & 0x3ffu));
        switch (c) {
        case RANDOM: v[k] = (uint16_t)next32(); break;
        case WEIGHTS: v[k] = w; break;
        case EQUAL: v[k] = bf ? 0x3f80 : 0x3c00; break;
        default:
            v[k] = next32() % 4 ? w : (bf ? special_bf : special_f16)
                                          [next32() % 10];
        }
    }
    return v;
}

/* Encodes, checks, decodes on the CPU; the blob (free it) and its size. */
static unsigned char *round_trip(laden_dtype dt, const uint16_t *v,
                                 uint64_t n, uint64_t *size)
{
    uint64_t bound;
    CHECK_OK(laden_lossless_bound(dt, n, &bound));
    unsigned char *blob = malloc(bound), *again = malloc(bound);
    CHECK(blob && again);
    CHECK_OK(laden_lossless_encode(dt, v, n, blob, bound, size));
    CHECK(*size <= bound);
    uint64_t size2;
    CHECK_OK(laden_lossless_encode(dt, v, n, again, bound, &size2));
    CHECK(size2 == *size && memcmp(blob, again, *size) == 0); /* the same */
    free(again);
    laden_lossless_info in;
    CHECK_OK(laden_lossless_check(blob, *size, &in));
    CHECK_EQ(in.dtype, dt);
    CHECK_EQ(in.n_elems, n);
    CHECK_EQ(in.bytes, *size);
    uint16_t *out = malloc(2 * n + 2);
    CHECK(out);
    memset(out, 0xa5, 2 * n + 2);
    CHECK_OK(laden_lossless_decode(LADEN_DEVICE_CPU, 0, &in,
                                   (laden_devptr_t)(uintptr_t)blob,
                                   (laden_devptr_t)(uintptr_t)out, 2 * n, 0));
    CHECK(n == 0 || memcmp(out, v, 2 * n) == 0);
    CHECK(((unsigned char *)out)[2 * n] == 0xa5); /* nothing past the end */
    free(out);
    return blob;
}

TEST(lossless_round_trip_every_shape_and_value)
{
    static const uint64_t sizes[] = {0, 1, 7, 63, 64, 1023, 1024, 1025,
                                     4097, 100003};
    static const laden_dtype dts[] = {LADEN_DTYPE_BF16, LADEN_DTYPE_F16};
    for (int d = 0; d < 2; d++)
        for (int c = 0; c < NCLASS; c++)
            for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
                uint64_t n = sizes[i], size;
                uint16_t *v = values(dts[d], c, n);
                free(round_trip(dts[d], v, n, &size));
                if (n == 100003 && c == WEIGHTS) {
                    double ratio = (double)size / (2.0 * (double)n);
                    fprintf(stderr, "%s weights: %.3f of their bytes\n",
                            d ? "F16" : "BF16", ratio);
                    /* BF16: 8 raw bits and ~2 for the exponent (these
                     * exponents' entropy); F16: 8 raw, ~5 coded (its
                     * sign and two mantissa bits are in the coded byte). */
                    CHECK(d ? ratio < 0.85 : ratio < 0.66);
                }
                if (c == EQUAL && n > 64) /* one symbol: a bit each */
                    CHECK(size < n + n / 8 + n / 64 + 1024);
                free(v);
            }
    /* Every one of the 65536 patterns, each once, both kinds. */
    uint16_t *all = malloc(2 * 65536);
    for (uint32_t k = 0; k < 65536; k++)
        all[k] = (uint16_t)(k * 40503u); /* a permutation */
    uint64_t size;
    free(round_trip(LADEN_DTYPE_BF16, all, 65536, &size));
    free(round_trip(LADEN_DTYPE_F16, all, 65536, &size));
    free(all);
}

/* Frequencies that halve from symbol to symbol would give Huffman codes
 * of 20 bits and more: they are limited to 12, and still decode. */
TEST(lossless_codes_at_most_twelve_bits)
{
    uint64_t n = 0;
    for (int s = 0; s < 24; s++)
        n += 1u << (23 - s < 0 ? 0 : 23 - s) >> 8 | 1u;
    uint16_t *v = malloc(2 * n);
    uint64_t k = 0;
    for (int s = 0; s < 24; s++)
        for (uint64_t j = 0; j < (1u << (23 - s) >> 8 | 1u); j++)
            v[k++] = (uint16_t)((100 + s) << 7 | (next32() & 0x807fu));
    uint64_t size;
    unsigned char *blob = round_trip(LADEN_DTYPE_BF16, v, n, &size);
    int longest = 0, used = 0;
    for (int s = 0; s < 256; s++) {
        longest = blob[32 + s] > longest ? blob[32 + s] : longest;
        used += blob[32 + s] != 0;
    }
    CHECK_EQ(longest, 12);
    CHECK_EQ(used, 24);
    free(blob);
    free(v);
}

uint32_t laden__ll_codes(const uint8_t *lens, uint32_t *code);
uint32_t laden__ll_table(const uint8_t *lens, uint16_t *lut);

/* The decoding table is built by entry (so a GPU block's threads share
 * it): for random codes, complete or not, it is the table filled symbol
 * by symbol from the canonical codes; lengths that are no code (above
 * 12, oversubscribed) are refused by both. */
TEST(lossless_table_by_entry_is_the_codes_table)
{
    static uint8_t lens[256];
    static uint16_t got[4096], want[4096];
    uint32_t code[256];
    for (int round = 0; round < 400; round++) {
        memset(lens, 0, sizeof lens);
        uint32_t kraft = 0, sym = next32() % 256;
        int tries = round % 4 == 3 ? 40 : 600; /* some incomplete */
        for (int k = 0; k < tries; k++) {
            uint32_t l = 1 + next32() % 12, s = (sym + 97u * k) % 256;
            if (!lens[s] && kraft + (4096u >> l) <= 4096u) {
                lens[s] = (uint8_t)l;
                kraft += 4096u >> l;
            }
        }
        if (round % 50 == 7) /* oversubscribed */
            for (int s = 0; s < 256; s++)
                lens[s] = lens[s] ? lens[s] : 1;
        if (round % 50 == 9)
            lens[next32() % 256] = 13;
        uint32_t bad = laden__ll_codes(lens, code);
        CHECK_EQ(laden__ll_table(lens, got), bad);
        if (bad)
            continue;
        memset(want, 0, sizeof want);
        for (int s = 0; s < 256; s++)
            for (uint32_t f = 0; lens[s] && f < (4096u >> lens[s]); f++)
                want[code[s] | f << lens[s]] =
                    (uint16_t)(lens[s] << 8 | s);
        CHECK(memcmp(got, want, sizeof want) == 0);
    }
}

/* Damaged blobs: a header field that is wrong is refused by the check;
 * any byte of the raw bytes, offsets, checks or codes changed is found by
 * the decode, which writes nothing outside its output. */
TEST(lossless_damage_is_typed)
{
    const uint64_t n = 5000;
    uint16_t *v = values(LADEN_DTYPE_BF16, WEIGHTS, n);
    uint64_t size;
    unsigned char *blob = round_trip(LADEN_DTYPE_BF16, v, n, &size);
    unsigned char *bad = malloc(size);
    laden_lossless_info in, good;
    CHECK_OK(laden_lossless_check(blob, size, &good));
    struct {
        uint64_t at;
        unsigned char to;
        const char *says;
    } fields[] = {
        {0, 'X', "magic"},     {4, 3, "kind"},
        {5, 1, "reserved"},    {24, 1, "reserved"},
        {6, 5, "sub_log2"},    {6, 17, "sub_log2"},
        {32 + 200, 13, "longer than 12"},
        {8, 0x89, "size"},     {16, 0xff, "bits"},
        {good.offs_off + 15, 0xff, "offsets"},
    };
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
        memcpy(bad, blob, size);
        bad[fields[i].at] = fields[i].to;
        CHECK_STATUS(laden_lossless_check(bad, size, &in), LADEN_E_CORRUPT);
        if (!strstr(laden_last_error(), fields[i].says))
            fprintf(stderr, "field %zu: %s\n", i, laden_last_error());
        CHECK(strstr(laden_last_error(), fields[i].says) ||
              strstr(laden_last_error(), "size"));
    }
    /* Oversubscribed: every symbol one bit long. */
    memcpy(bad, blob, size);
    memset(bad + 32, 1, 256);
    CHECK_STATUS(laden_lossless_check(bad, size, &in), LADEN_E_CORRUPT);
    CHECK(strstr(laden_last_error(), "more codes"));
    CHECK_STATUS(laden_lossless_check(blob, size - 8, &in), LADEN_E_CORRUPT);
    CHECK_STATUS(laden_lossless_check(blob, 100, &in), LADEN_E_CORRUPT);
    /* Each byte after the header, one at a time (a stride through the
     * raw bytes, every byte of the offsets, checks and codes). */
    uint16_t *out = malloc(2 * n + 8);
    uint32_t *err = malloc(4);
    for (uint64_t at = LADEN_LOSSLESS_HEADER_BYTES; at < size;
         at += at < good.offs_off ? 37 : 1) {
        memcpy(bad, blob, size);
        bad[at] ^= (unsigned char)(1u << (at % 8));
        laden_status s = laden_lossless_check(bad, size, &in);
        if (s) { /* an offset now out of order */
            CHECK_EQ(s, LADEN_E_CORRUPT);
            CHECK((at >= good.offs_off && at < good.sums_off) ||
                  (at >= good.lanes_off && at < good.bits_off));
            continue;
        }
        bool padding = (at >= good.raw_off + n && at < good.offs_off) ||
                       (at >= good.sums_off + 4 * good.nsub &&
                        at < good.lanes_off) ||
                       at >= good.bits_off + (good.nbits + 7) / 8;
        out[n] = 0x5a5a;
        *err = 0;
        s = laden_lossless_decode(LADEN_DEVICE_CPU, 0, &in,
                                  (laden_devptr_t)(uintptr_t)bad,
                                  (laden_devptr_t)(uintptr_t)out, 2 * n,
                                  (laden_devptr_t)(uintptr_t)err);
        CHECK_EQ(out[n], 0x5a5a);
        if (padding) { /* read by no one */
            CHECK_OK(s);
            continue;
        }
        if (s != LADEN_E_CORRUPT)
            fprintf(stderr, "byte %llu changed, decode says %s\n",
                    (unsigned long long)at, laden_status_name(s));
        CHECK_EQ(s, LADEN_E_CORRUPT);
        CHECK_EQ(*err, 1);
    }
    /* Misuse. */
    uint64_t b;
    CHECK_STATUS(laden_lossless_bound(LADEN_DTYPE_F32, 1, &b), LADEN_E_INVAL);
    CHECK_STATUS(laden_lossless_bound(LADEN_DTYPE_BF16, UINT64_MAX / 2, &b),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_lossless_encode(LADEN_DTYPE_BF16, v, n, bad, size, &b),
                 LADEN_E_INVAL); /* below the bound */
    CHECK_STATUS(laden_lossless_encode(LADEN_DTYPE_BF16, NULL, n, bad, size,
                                       &b), LADEN_E_INVAL);
    CHECK_STATUS(laden_lossless_check(NULL, size, &in), LADEN_E_INVAL);
    in = good;
    CHECK_STATUS(laden_lossless_decode(LADEN_DEVICE_CPU, 0, &in,
                                       (laden_devptr_t)(uintptr_t)blob,
                                       (laden_devptr_t)(uintptr_t)out, n, 0),
                 LADEN_E_INVAL); /* dst_bytes */
    in.bits_off += 8; /* not what the check gave */
    CHECK_STATUS(laden_lossless_decode(LADEN_DEVICE_CPU, 0, &in,
                                       (laden_devptr_t)(uintptr_t)blob,
                                       (laden_devptr_t)(uintptr_t)out, 2 * n,
                                       0),
                 LADEN_E_INVAL);
    free(err);
    free(out);
    free(bad);
    free(blob);
    free(v);
}

/* ---- CUDA: the same kernels' code, compiled by NVRTC ------------------- */

static int cuda_decoder(void)
{
    int32_t n = 0;
    if (laden_dev_count(&n) || n == 0) {
        fprintf(stderr, "(no CUDA: %s)\n", laden_dev_cuda_error());
        return 0;
    }
    char text[1200];
    if (laden_expand_describe(0, text, sizeof text)) {
        fprintf(stderr, "(cuda:0 cannot decode: %s)\n", text);
        return 0;
    }
    fprintf(stderr, "%s\n", text);
    return 1;
}

/* Decodes blob (size bytes, placed `off` bytes into device memory) on
 * cuda:0; the values in out; the error word's value. */
static uint32_t cuda_decode(const unsigned char *blob, uint64_t size,
                            uint32_t off, uint16_t *out, uint64_t n)
{
    laden_lossless_info in;
    CHECK_OK(laden_lossless_check(blob, size, &in));
    laden_dev_stream_t *s;
    CHECK_OK(laden_dev_stream_wrap(0, 0, &s));
    laden_devptr_t d, o, e;
    CHECK_OK(laden_dev_mem_alloc(0, size + off, &d));
    CHECK_OK(laden_dev_mem_alloc(0, 2 * n + 2, &o));
    CHECK_OK(laden_dev_mem_alloc(0, 4, &e));
    uint32_t zero = 0, err = 0;
    CHECK_OK(laden_dev_copy_h2d(s, d + off, blob, size));
    CHECK_OK(laden_dev_copy_h2d(s, e, &zero, 4));
    CHECK_OK(laden_lossless_decode(0, 0, &in, d + off, o, 2 * n, e));
    CHECK_OK(laden_dev_copy_d2h(s, out, o, 2 * n));
    CHECK_OK(laden_dev_copy_d2h(s, &err, e, 4));
    CHECK_OK(laden_dev_stream_synchronize(s));
    CHECK_OK(laden_dev_mem_free(0, d));
    CHECK_OK(laden_dev_mem_free(0, o));
    CHECK_OK(laden_dev_mem_free(0, e));
    laden_dev_stream_destroy(s);
    return err;
}

TEST(lossless_cuda_matches_cpu)
{
    if (!cuda_decoder())
        SKIP("no CUDA device that can run laden's kernels (see above)");
    static const uint64_t sizes[] = {1, 1023, 1025, 70001, 5u << 20};
    for (int d = 0; d < 2; d++)
        for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
            for (int c = 0; c < NCLASS; c++) {
                laden_dtype dt = d ? LADEN_DTYPE_F16 : LADEN_DTYPE_BF16;
                uint64_t n = sizes[i], size;
                uint16_t *v = values(dt, c, n), *out = malloc(2 * n);
                unsigned char *blob = round_trip(dt, v, n, &size);
                for (uint32_t off = 0; off < 16; off += 5) { /* 5, 15: not
                                                                 aligned */
                    memset(out, 0, 2 * n);
                    CHECK_EQ(cuda_decode(blob, size, off, out, n), 0);
                    CHECK(memcmp(out, v, 2 * n) == 0);
                }
                if (n == 70001 && c == WEIGHTS) { /* a code changed */
                    laden_lossless_info in;
                    CHECK_OK(laden_lossless_check(blob, size, &in));
                    blob[in.bits_off + 100] ^= 4;
                    CHECK_EQ(cuda_decode(blob, size, 0, out, n), 1);
                }
                free(blob);
                free(out);
                free(v);
            }
}

/* The kernels NVRTC compiles are C++17 with CUDA's keywords: with those
 * stubbed, a host C++ compiler checks their syntax here, where CI has no
 * GPU (laden__expand_cuda_source is the text NVRTC gets). */
char *laden__expand_cuda_source(void);

TEST(lossless_and_expand_kernels_are_cxx17)
{
    if (system("c++ --version >/dev/null 2>&1") != 0)
        SKIP("no host C++ compiler (c++)");
    char *src = laden__expand_cuda_source();
    CHECK(src);
    char *path = test_path("kernels.cpp");
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs("#define __device__\n#define __global__\n"
          "#define __forceinline__ inline\n#define __launch_bounds__(x)\n"
          "#define __grid_constant__\n#define __shared__ static\n"
          "#define __CUDA_ARCH__ 900\n#define __CUDACC_VER_MAJOR__ 13\n"
          "#define __CUDACC_VER_MINOR__ 0\n"
          "#define ex_noasm(...) ((void)0)\n"
          "struct uint2 { unsigned x, y; };\n"
          "template <class T> T __ldg(const T *p) { return *p; }\n"
          "struct dim3 { unsigned x, y, z; };\n"
          "static dim3 blockIdx, blockDim, threadIdx, gridDim;\n"
          "static void __syncthreads() {}\n"
          "static unsigned __shfl_sync(unsigned, unsigned v, unsigned) "
          "{ return v; }\n"
          "static float __uint_as_float(unsigned x) { float f; "
          "__builtin_memcpy(&f, &x, 4); return f; }\n"
          "static unsigned __float_as_uint(float f) { unsigned x; "
          "__builtin_memcpy(&x, &f, 4); return x; }\n", f);
    /* Inline assembly (PTX) is the device's: each asm statement becomes
     * a no-op call. */
    for (const char *at = src; *at;) {
        const char *a = strstr(at, "asm");
        if (!a) {
            fputs(at, f);
            break;
        }
        fwrite(at, 1, (size_t)(a - at), f);
        const char *p = a + 3;
        while (*p == ' ')
            p++;
        if (strncmp(p, "volatile", 8) == 0)
            p += 8;
        while (*p == ' ')
            p++;
        if (*p != '(' || (a > src && (a[-1] == '_' || (a[-1] >= 'a' &&
                                                      a[-1] <= 'z')))) {
            fwrite(a, 1, 3, f); /* a name that holds "asm" */
            at = a + 3;
            continue;
        }
        fputs("ex_noasm", f);
        at = p;
    }
    fclose(f);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "c++ -std=c++17 -fsyntax-only -Werror -Wall -Wno-unknown-pragmas "
             "-Wno-unused-function -Wno-unused-variable %s", path);
    int rc = system(cmd);
    if (rc != 0)
        fprintf(stderr, "%s failed (the source is %s)\n", cmd, path);
    CHECK_EQ(rc, 0);
    free(src);
}

/* ---- in a schedule (laden_sched_set_lossless) --------------------------- */

#include "laden/st.h"
#include "laden/stream.h"

/* A block of weight-like BF16 (compresses), random BF16 (does not) and
 * F16 weights on the RAM or disk tier, marked lossless: the blob is what
 * the RAM tier holds, the enter's workspace and laden_sched_tensor_value
 * give every bit back; on disk nothing is compressed. */
TEST(lossless_tensors_in_a_block)
{
    enum { N = 20000 };
    uint16_t *w = values(LADEN_DTYPE_BF16, WEIGHTS, N);
    uint16_t *r = values(LADEN_DTYPE_BF16, RANDOM, N);
    uint16_t *h = values(LADEN_DTYPE_F16, WEIGHTS, N);
    static char data[3 * N * 2];
    memcpy(data, w, 2 * N);
    memcpy(data + 2 * N, r, 2 * N);
    memcpy(data + 4 * N, h, 2 * N);
    char hdr[512];
    snprintf(hdr, sizeof hdr,
             "{\"w\":{\"dtype\":\"BF16\",\"shape\":[%d],\"data_offsets\":"
             "[0,%d]},\"r\":{\"dtype\":\"BF16\",\"shape\":[%d],"
             "\"data_offsets\":[%d,%d]},\"h\":{\"dtype\":\"F16\",\"shape\":"
             "[%d],\"data_offsets\":[%d,%d]}}",
             N, 2 * N, N, 2 * N, 4 * N, N, 4 * N, 6 * N);
    char *path = test_path("ll.safetensors");
    test_write_st(path, hdr, data, sizeof data);
    const uint16_t *want[3] = {w, r, h};
    static const laden_tier tiers[] = {LADEN_TIER_RAM, LADEN_TIER_DISK};
    for (int ti = 0; ti < 2; ti++) {
        laden_st_t *st;
        laden_sched_t *sc;
        CHECK_OK(laden_st_open(path, &st));
        laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        uint32_t blk, idx[3];
        CHECK_OK(laden_sched_add_block(sc, tiers[ti], &blk));
        static const char *const names[3] = {"w", "r", "h"};
        for (int k = 0; k < 3; k++) {
            size_t at;
            CHECK_OK(laden_st_find(st, names[k], &at));
            laden_dtype dt = k == 2 ? LADEN_DTYPE_F16 : LADEN_DTYPE_BF16;
            CHECK_OK(laden_sched_add_tensor(sc, blk, st, at, dt, &idx[k]));
            CHECK_OK(laden_sched_set_lossless(sc, blk, idx[k]));
        }
        CHECK_STATUS(laden_sched_set_lossless(sc, blk, idx[0]),
                     LADEN_E_UNSUPPORTED); /* already compact */
        uint64_t raw = laden_sched_block_bytes(sc, blk);
        CHECK_OK(laden_sched_load(sc));
        CHECK_STATUS(laden_sched_set_lossless(sc, blk, idx[1]),
                     LADEN_E_STATE);
        laden_sched_stats_t s;
        CHECK_OK(laden_sched_stats(sc, &s));
        if (ti == 0) { /* w and h compressed, r kept */
            CHECK_EQ(s.lossless_raw_bytes, 4u * N);
            CHECK(s.lossless_bytes < 3u * N);
            CHECK(laden_sched_block_bytes(sc, blk) < raw - N / 2);
            CHECK_EQ(s.ram_bytes, laden_sched_block_bytes(sc, blk));
        } else {
            CHECK_EQ(s.lossless_bytes, 0);
            CHECK_EQ(laden_sched_block_bytes(sc, blk), raw);
        }
        CHECK_OK(laden_sched_start(sc, 0));
        CHECK_OK(laden_sched_enter(sc, blk, 0));
        CHECK_OK(laden_sched_synchronize(sc));
        uint16_t *got = malloc(2 * N);
        for (int k = 0; k < 3; k++) {
            laden_devptr_t p;
            uint64_t bytes;
            bool packed = ti == 0 && k != 1;
            CHECK_EQ(laden_sched_tensor_lossless(sc, blk, idx[k]), packed);
            if (packed) {
                CHECK_OK(laden_sched_expanded_at(sc, blk, idx[k], &p,
                                                 &bytes));
            } else { /* plain again: where the block runs */
                CHECK_STATUS(laden_sched_expanded_at(sc, blk, idx[k], &p,
                                                     &bytes),
                             LADEN_E_INVAL);
                CHECK_OK(laden_sched_tensor_ptr(sc, blk, idx[k], &p));
                bytes = 2u * N;
            }
            CHECK_EQ(bytes, 2u * N);
            if (memcmp((const void *)(uintptr_t)p, want[k], 2 * N) != 0) {
                const uint16_t *g = (const uint16_t *)(uintptr_t)p;
                fprintf(stderr, "tier %d tensor %d: %04x %04x, want %04x "
                        "%04x\n", ti, k, g[0], g[1], want[k][0], want[k][1]);
                CHECK(0);
            }
            memset(got, 0, 2 * N);
            CHECK_OK(laden_sched_tensor_value(sc, blk, idx[k],
                                              k == 2 ? LADEN_DTYPE_F16
                                                     : LADEN_DTYPE_BF16,
                                              got, 2 * N));
            CHECK(memcmp(got, want[k], 2 * N) == 0);
        }
        float *f = malloc(4 * N); /* and widened, as a value asked in F32 */
        CHECK_OK(laden_sched_tensor_value(sc, blk, idx[0], LADEN_DTYPE_F32,
                                          f, 4 * N));
        for (int k = 0; k < N; k += 997) {
            uint32_t bits = (uint32_t)w[k] << 16;
            float v;
            memcpy(&v, &bits, 4);
            CHECK(memcmp(&v, &f[k], 4) == 0);
        }
        free(f);
        free(got);
        CHECK_OK(laden_sched_exit(sc, blk, 0));
        laden_sched_destroy(sc);
        laden_st_close(st);
    }
    /* laden_sched_mark_lossless: the BF16/F16 tensors as stored of the
     * RAM and disk tiers (not a converted one; a plan may move disk
     * blocks to RAM at their coded sizes, and those left on disk are
     * read as stored); none after load. */
    laden_st_t *st;
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t blk, k, dblk, marked = 99;
    size_t at;
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &dblk));
    for (size_t t = 0; t < 3; t++) {
        laden_dtype dt = t == 2 ? LADEN_DTYPE_F16 : LADEN_DTYPE_BF16;
        CHECK_OK(laden_sched_add_tensor(sc, blk, st, t, dt, &k));
        CHECK_OK(laden_sched_add_tensor(sc, dblk, st, t, dt, &k));
    }
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, 0, LADEN_DTYPE_F32, &k));
    CHECK_OK(laden_sched_mark_lossless(sc, &marked));
    CHECK_EQ(marked, 6);
    CHECK_OK(laden_sched_mark_lossless(sc, &marked)); /* taken already */
    CHECK_EQ(marked, 0);
    CHECK_OK(laden_sched_load(sc));
    CHECK_EQ(laden_sched_tensor_lossless(sc, blk, 0), 1);
    CHECK_EQ(laden_sched_tensor_lossless(sc, blk, 3), 0);
    CHECK_EQ(laden_sched_tensor_lossless(sc, dblk, 0), 0);
    CHECK_STATUS(laden_sched_mark_lossless(sc, &marked), LADEN_E_STATE);
    laden_sched_destroy(sc);
    /* Refused: another dtype, a converted tensor. */
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_st_find(st, "w", &at));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, at, LADEN_DTYPE_F32, &k));
    CHECK_STATUS(laden_sched_set_lossless(sc, blk, k), LADEN_E_UNSUPPORTED);
    CHECK(strstr(laden_last_error(), "BF16 or F16"));
    CHECK_STATUS(laden_sched_set_lossless(sc, blk, 7), LADEN_E_INVAL);
    laden_sched_destroy(sc);
    /* A model built on the CPU: its tensors are encoded from memory
     * (estimated from it too), a cache schedule's as a stream's. */
    for (int cache = 0; cache < 2; cache++) {
        laden_sched_config cc = {.device = LADEN_DEVICE_CPU,
                                 .flags = cache ? LADEN_SCHED_CACHE : 0};
        uint16_t *mem = values(LADEN_DTYPE_BF16, WEIGHTS, 100000);
        uint16_t *back = malloc(200000);
        CHECK_OK(laden_sched_create(&cc, st, &sc));
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
        CHECK_OK(laden_sched_add_host_tensor(sc, blk, mem, LADEN_DTYPE_BF16,
                                             100000, LADEN_DTYPE_BF16, &k));
        CHECK_OK(laden_sched_mark_lossless(sc, &marked));
        CHECK_EQ(marked, 1);
        if (!cache) /* a cache schedule is not planned: nothing estimated */
            CHECK(laden_sched_block_ram_bytes(sc, blk) < 200000 * 3 / 4);
        CHECK_OK(laden_sched_load(sc));
        CHECK_EQ(laden_sched_tensor_lossless(sc, blk, k), 1);
        CHECK(laden_sched_block_bytes(sc, blk) < 200000 * 3 / 4);
        CHECK_OK(laden_sched_tensor_value(sc, blk, k, LADEN_DTYPE_BF16, back,
                                          200000));
        CHECK(memcmp(back, mem, 200000) == 0);
        laden_sched_destroy(sc);
        free(mem);
        free(back);
    }
    laden_st_close(st);
    free(w);
    free(r);
    free(h);
}

/* Plans a CPU schedule with a RAM budget (nothing resident). */
static laden_status plan_ram(laden_sched_t *sc, uint64_t budget,
                             laden_plan_result *res)
{
    laden_plan_input in = {0};
    in.ram_total_bytes = in.ram_free_bytes = 1ull << 40;
    in.min_free_ram_bytes = 0;
    in.ram_budget_bytes = budget;
    return laden_sched_plan(sc, &in, NULL, res);
}

/* A schedule of nb blocks left to the planner, block k holding tensor
 * "t<k>" of the file at `path`. */
static laden_sched_t *blocks_of(const char *path, laden_st_t **st,
                                uint32_t nb)
{
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    CHECK_OK(laden_sched_create(&cfg, *st, &sc));
    for (uint32_t b = 0; b < nb; b++) {
        char name[16];
        size_t at;
        uint32_t blk, k;
        snprintf(name, sizeof name, "t%u", b);
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_AUTO, &blk));
        CHECK_OK(laden_st_find(*st, name, &at));
        CHECK_OK(laden_sched_add_tensor(sc, blk, *st, at, LADEN_DTYPE_BF16,
                                        &k));
    }
    return sc;
}

/* Writes nb BF16 tensors "t0".. of n elements each, their values v. */
static char *write_tensors(const char *file, uint32_t nb, uint64_t n,
                           const uint16_t *v)
{
    size_t cap = 64 + 128 * (size_t)nb;
    char *hdr = malloc(cap);
    CHECK(hdr);
    int at = snprintf(hdr, cap, "{");
    for (uint32_t b = 0; b < nb; b++)
        at += snprintf(hdr + at, cap - (size_t)at,
                       "%s\"t%u\":{\"dtype\":\"BF16\",\"shape\":[%llu],"
                       "\"data_offsets\":[%llu,%llu]}", b ? "," : "", b,
                       (unsigned long long)n,
                       (unsigned long long)(2 * n * b),
                       (unsigned long long)(2 * n * (b + 1)));
    snprintf(hdr + at, cap - (size_t)at, "}");
    char *path = test_path(file);
    test_write_st(path, hdr, v, 2 * n * nb);
    free(hdr);
    return path;
}

/* The plan counts a block marked lossless at its coded size on the RAM
 * tier (estimated from samples of the file): a RAM budget that holds
 * three of four weight-like BF16 blocks as stored holds all four coded,
 * and once encoded they fit it, every bit kept.  Samples that mislead
 * (the parts sampled compress, the rest does not) are caught at the load:
 * LADEN_E_BUDGET naming compression, not a RAM tier past its budget. */
TEST(lossless_plan_counts_coded_sizes)
{
    enum { NB = 4, N = 65536 };
    const uint64_t raw = 2u * N;
    uint16_t *w = values(LADEN_DTYPE_BF16, WEIGHTS, (uint64_t)NB * N);
    char *path = write_tensors("plan-ll.safetensors", NB, N, w);
    laden_st_t *st;
    laden_sched_t *sc = blocks_of(path, &st, NB);
    laden_plan_result res;
    uint64_t budget = raw * 7 / 2;
    CHECK_OK(plan_ram(sc, budget, &res));
    for (uint32_t b = 0; b < NB; b++)
        CHECK_EQ(laden_sched_block_tier(sc, b),
                 b < 3 ? LADEN_TIER_RAM : LADEN_TIER_DISK);
    uint32_t marked = 0;
    CHECK_OK(laden_sched_mark_lossless(sc, &marked));
    CHECK_EQ(marked, NB); /* the disk block's too */
    CHECK_OK(plan_ram(sc, budget, &res));
    for (uint32_t b = 0; b < NB; b++)
        CHECK_EQ(laden_sched_block_tier(sc, b), LADEN_TIER_RAM);
    CHECK(res.ram_bytes <= budget && res.ram_bytes < NB * raw * 3 / 4);
    CHECK_EQ(res.disk_bytes, 0);
    uint64_t counted = 0;
    for (uint32_t b = 0; b < NB; b++) { /* the estimates, stored as is */
        CHECK_EQ(laden_sched_block_bytes(sc, b), raw);
        CHECK(laden_sched_block_ram_bytes(sc, b) < raw * 3 / 4);
        counted += laden_sched_block_ram_bytes(sc, b);
    }
    CHECK_EQ(counted, res.ram_bytes);
    CHECK_EQ(laden_sched_block_ram_bytes(sc, NB), 0);
    CHECK_OK(laden_sched_load(sc));
    for (uint32_t b = 0; b < NB; b++) /* now the true coded sizes */
        CHECK_EQ(laden_sched_block_ram_bytes(sc, b),
                 laden_sched_block_bytes(sc, b));
    laden_sched_stats_t st_;
    CHECK_OK(laden_sched_stats(sc, &st_));
    CHECK(st_.ram_bytes <= res.ram_bytes); /* the estimate held */
    CHECK_EQ(st_.lossless_raw_bytes, NB * raw);
    uint16_t *got = malloc(raw);
    for (uint32_t b = 0; b < NB; b++) {
        CHECK_EQ(laden_sched_tensor_lossless(sc, b, 0), 1);
        CHECK_OK(laden_sched_tensor_value(sc, b, 0, LADEN_DTYPE_BF16, got,
                                          raw));
        CHECK(memcmp(got, w + (uint64_t)b * N, raw) == 0);
    }
    laden_sched_destroy(sc);
    laden_st_close(st);
    free(w);

    /* Misleading samples: the three runs read (start, middle, end) are
     * weight-like, the rest random; the plan at their estimate with a
     * budget of exactly that is refused by the load. */
    enum { M = 131072 };
    uint16_t *v = values(LADEN_DTYPE_BF16, RANDOM, M);
    uint16_t *like = values(LADEN_DTYPE_BF16, WEIGHTS, M);
    const uint64_t runs[3] = {0, (M - 16384) / 2, M - 16384};
    for (int k = 0; k < 3; k++)
        memcpy(v + runs[k], like + runs[k], 2 * 16384);
    char *p2 = write_tensors("plan-ll-misled.safetensors", 1, M, v);
    sc = blocks_of(p2, &st, 1);
    CHECK_OK(plan_ram(sc, 2u * M, &res));
    CHECK_OK(laden_sched_mark_lossless(sc, &marked));
    CHECK_EQ(marked, 1);
    CHECK_OK(plan_ram(sc, 2u * M, &res));
    uint64_t est = res.ram_bytes;
    CHECK(est < 2u * M * 3 / 4);
    CHECK_OK(plan_ram(sc, est, &res)); /* exactly the estimate */
    CHECK_EQ(laden_sched_block_tier(sc, 0), LADEN_TIER_RAM);
    CHECK_STATUS(laden_sched_load(sc), LADEN_E_BUDGET);
    CHECK(strstr(laden_last_error(), "lossless") != NULL);
    laden_sched_destroy(sc);
    laden_st_close(st);
    free(v);
    free(like);
    free(got);
}

static uint64_t seen_done, seen_total;
static int stop_after;

static int on_progress(void *arg, uint64_t done, uint64_t total)
{
    (void)arg;
    if (!seen_total) { /* the compression's report comes first */
        seen_done = done;
        seen_total = total;
    }
    return stop_after;
}

/* The load's progress callback hears of the compression (the bytes read
 * and encoded, before the blocks' load), and stopping it there fails the
 * load with a typed error and frees what it made (ASan, fd counts). */
TEST(lossless_compression_reports_progress_and_stops)
{
    enum { N = 50000 };
    uint16_t *w = values(LADEN_DTYPE_BF16, WEIGHTS, N);
    char hdr[256];
    snprintf(hdr, sizeof hdr,
             "{\"w\":{\"dtype\":\"BF16\",\"shape\":[%d],\"data_offsets\":"
             "[0,%d]}}", N, 2 * N);
    char *path = test_path("llp.safetensors");
    test_write_st(path, hdr, w, 2 * N);
    for (stop_after = 0; stop_after < 2; stop_after++) {
        laden_st_t *st;
        laden_sched_t *sc;
        CHECK_OK(laden_st_open(path, &st));
        laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
        CHECK_OK(laden_sched_create(&cfg, st, &sc));
        uint32_t blk, k;
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
        CHECK_OK(laden_sched_add_tensor(sc, blk, st, 0, LADEN_DTYPE_BF16,
                                        &k));
        CHECK_OK(laden_sched_set_lossless(sc, blk, k));
        CHECK_OK(laden_sched_set_progress(sc, on_progress, NULL));
        seen_done = seen_total = 0;
        if (stop_after) {
            CHECK_STATUS(laden_sched_load(sc), LADEN_E_STATE);
            CHECK(strstr(laden_last_error(), "while compressing"));
        } else {
            CHECK_OK(laden_sched_load(sc));
            CHECK_EQ(laden_sched_tensor_lossless(sc, blk, k), 1);
        }
        CHECK_EQ(seen_total, 2u * N);
        CHECK(seen_done <= seen_total);
        laden_sched_destroy(sc);
        laden_st_close(st);
    }
    free(w);
}

/* A tensor large enough for the CPU decoder's threads: the values come
 * back, and damage in one sub-chunk of the second half is reported as that
 * one alone. */
TEST(lossless_threads_decode_large_tensors)
{
    const uint64_t n = 192u * 4096u + 1000u; /* 193 sub-chunks */
    uint16_t *v = values(LADEN_DTYPE_BF16, WEIGHTS, n);
    uint64_t size;
    unsigned char *blob = round_trip(LADEN_DTYPE_BF16, v, n, &size);
    laden_lossless_info in;
    CHECK_OK(laden_lossless_check(blob, size, &in));
    CHECK_EQ(in.nsub, 193);
    blob[in.raw_off + 150u * 4096u + 77u] ^= 1; /* sub-chunk 150 */
    uint16_t *out = malloc(2 * n);
    CHECK_STATUS(laden_lossless_decode(LADEN_DEVICE_CPU, 0, &in,
                                       (laden_devptr_t)(uintptr_t)blob,
                                       (laden_devptr_t)(uintptr_t)out, 2 * n,
                                       0),
                 LADEN_E_CORRUPT);
    CHECK(strstr(laden_last_error(), "1 of 193"));
    CHECK(strstr(laden_last_error(), "the first: 150"));
    CHECK(memcmp(out, v, 2 * 150u * 4096u) == 0); /* the others decoded */
    CHECK(memcmp(out + 151u * 4096u, v + 151u * 4096u,
                 2 * (n - 151u * 4096u)) == 0);
    free(out);
    free(blob);
    free(v);
}

/* The file cut short under the schedule before the load: compressing
 * reads it first, and the load fails naming the tensor. */
TEST(lossless_compression_read_failure_names_the_tensor)
{
    enum { N = 20000 };
    uint16_t *w = values(LADEN_DTYPE_BF16, WEIGHTS, N);
    char hdr[256];
    snprintf(hdr, sizeof hdr,
             "{\"w\":{\"dtype\":\"BF16\",\"shape\":[%d],\"data_offsets\":"
             "[0,%d]}}", N, 2 * N);
    char *path = test_path("llcut.safetensors");
    test_write_st(path, hdr, w, 2 * N);
    laden_st_t *st;
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, &st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    uint32_t blk, k, marked;
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, 0, LADEN_DTYPE_BF16, &k));
    CHECK_OK(laden_sched_mark_lossless(sc, &marked));
    CHECK_EQ(marked, 1);
    laden_sched_t *sc2; /* marked only after the file changed */
    uint32_t blk2;
    CHECK_OK(laden_sched_create(&cfg, st, &sc2));
    CHECK_OK(laden_sched_add_block(sc2, LADEN_TIER_RAM, &blk2));
    CHECK_OK(laden_sched_add_tensor(sc2, blk2, st, 0, LADEN_DTYPE_BF16, &k));
    CHECK_EQ(truncate(path, 1000), 0);
    laden_status s = laden_sched_load(sc);
    CHECK(s == LADEN_E_TRUNCATED || s == LADEN_E_CHANGED);
    CHECK(strstr(laden_last_error(), "compressing tensor 'w'"));
    laden_sched_destroy(sc);
    /* The mark's samples read from the file too: a failure there is
     * typed and names the tensor. */
    s = laden_sched_mark_lossless(sc2, &marked);
    CHECK(s == LADEN_E_TRUNCATED || s == LADEN_E_CHANGED);
    CHECK(strstr(laden_last_error(), "tensor 'w': estimating"));
    CHECK_EQ(marked, 0);
    laden_sched_destroy(sc2);
    laden_st_close(st);
    free(w);
}

/* ---- lossless cache files ----------------------------------------------- */

static uint64_t le64_at(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* Flips bit 0 of byte `at` of the file at path. */
static void flip_byte(const char *path, uint64_t at)
{
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    CHECK_EQ(fseek(f, (long)at, SEEK_SET), 0);
    int c = fgetc(f);
    CHECK(c != EOF);
    CHECK_EQ(fseek(f, (long)at, SEEK_SET), 0);
    fputc(c ^ 1, f);
    fclose(f);
}

/* Entry k's field at byte `field` of the cache file's index. */
static uint64_t index_field(const char *cpath, uint32_t k, uint32_t field)
{
    unsigned char head[64], e[40];
    FILE *f = fopen(cpath, "rb");
    CHECK(f != NULL);
    CHECK_EQ(fread(head, 1, 64, f), 64);
    CHECK_EQ(fseek(f, (long)(le64_at(head + 16) + 40u * k), SEEK_SET), 0);
    CHECK_EQ(fread(e, 1, 40, f), 40);
    fclose(f);
    return le64_at(e + field);
}

static int cancel_write(void *arg, uint64_t done, uint64_t total)
{
    (void)arg;
    (void)done;
    (void)total;
    return 1;
}

/* Loads NB blocks of `path` on the RAM tier with dir's cache; asserts the
 * values are v's, and gives the stats. */
static laden_status load_cached(const char *path, const char *dir,
                                uint32_t nb, uint64_t n, const uint16_t *v,
                                laden_sched_stats_t *out, uint32_t *found,
                                uint32_t *stale)
{
    laden_st_t *st;
    laden_sched_t *sc = blocks_of(path, &st, nb);
    laden_plan_result res;
    uint32_t marked;
    laden_status s = laden_sched_use_lossless_cache(sc, dir);
    if (!s) {
        CHECK_OK(laden_sched_lossless_cache_info(sc, found, stale));
        CHECK_OK(laden_sched_mark_lossless(sc, &marked));
        CHECK_EQ(marked, nb);
        CHECK_OK(plan_ram(sc, 1ull << 40, &res));
        s = laden_sched_load(sc);
    }
    uint16_t *got = malloc(2 * n);
    for (uint32_t b = 0; !s && b < nb; b++) {
        s = laden_sched_tensor_value(sc, b, 0, LADEN_DTYPE_BF16, got, 2 * n);
        if (!s)
            CHECK(memcmp(got, v + (uint64_t)b * n, 2 * n) == 0);
    }
    if (!s)
        CHECK_OK(laden_sched_stats(sc, out));
    free(got);
    laden_sched_destroy(sc);
    laden_st_close(st);
    return s;
}

/* A cache file of more tensors than a batch holds (BATCH_JOBS, 512):
 * each batch's blobs are written in the file's order by whichever encoder
 * ends the one the file waits for (llcache.c's in_order), while the others
 * encode; the index lists them in order, each blob at a 4 KiB multiple
 * after the one before, and a load reads every value back. */
TEST(lossless_cache_file_of_many_tensors_is_written_in_order)
{
    enum { NB = 1100, N = 4096 };
    uint16_t *v = values(LADEN_DTYPE_BF16, WEIGHTS, (uint64_t)NB * N);
    char *path = write_tensors("llc-many.safetensors", NB, N, v);
    char *dir = test_path("llc-many-dir");
    laden_lossless_cache_stats cs;
    CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
    CHECK_EQ(cs.tensors, NB);
    CHECK_EQ(cs.coded, NB);
    char cpath[4096];
    CHECK_OK(laden_lossless_cache_path(path, dir, cpath, sizeof cpath));
    uint64_t end = 4096, sum = 0;
    for (uint32_t k = 0; k < NB; k++) {
        uint64_t src = index_field(cpath, k, 0),
                 off = index_field(cpath, k, 24),
                 bytes = index_field(cpath, k, 32);
        CHECK_EQ(src, index_field(cpath, 0, 0) + (uint64_t)k * 2 * N);
        CHECK_EQ(off, (end + 4095) & ~4095ull);
        end = off + bytes;
        sum += bytes;
    }
    CHECK_EQ(sum, cs.coded_bytes);
    laden_sched_stats_t ss;
    uint32_t found = 0, stale = 9;
    CHECK_OK(load_cached(path, dir, NB, N, v, &ss, &found, &stale));
    CHECK_EQ(found, 1);
    CHECK_EQ(ss.lossless_cache_bytes, cs.coded_bytes);
    free(v);
}

/* laden_lossless_cache_write encodes a checkpoint once; a load given its
 * directory reads the blobs (fewer bytes) and encodes nothing, with every
 * value as stored, the plan's sizes exact, a tensor that does not code
 * read as stored.  A cache made from another version of the file is not
 * used; a damaged one is refused with LADEN_E_CORRUPT naming it (index,
 * blob header) or found by the decoder (blob codes); a cancelled write
 * leaves nothing. */
TEST(lossless_cache_file_is_read_instead_of_encoding)
{
    enum { NB = 3, N = 65536 };
    const uint64_t raw = 2u * N;
    uint16_t *v = values(LADEN_DTYPE_BF16, WEIGHTS, (uint64_t)NB * N);
    uint16_t *noise = values(LADEN_DTYPE_BF16, RANDOM, N);
    memcpy(v + N, noise, raw); /* t1 does not code */
    char *path = write_tensors("llc.safetensors", NB, N, v);
    char *dir = test_path("llc-dir");
    laden_lossless_cache_stats cs;
    CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
    CHECK_EQ(cs.files, 1);
    CHECK_EQ(cs.tensors, NB);
    CHECK_EQ(cs.coded, 2);
    CHECK_EQ(cs.raw_bytes, NB * raw);
    CHECK_EQ(cs.coded_raw_bytes, 2 * raw);
    CHECK(cs.coded_bytes < 2 * raw * 3 / 4);
    char cpath[4096];
    CHECK_OK(laden_lossless_cache_path(path, dir, cpath, sizeof cpath));
    struct stat sb;
    CHECK_EQ(stat(cpath, &sb), 0);
    CHECK_EQ((uint64_t)sb.st_size, cs.file_bytes);
    CHECK(strstr(cpath, "/llc.safetensors.") && strstr(cpath, ".ldlc"));

    laden_lossless_cache_entry ent[NB];
    uint32_t count = 0;
    int is_stale = 9;
    CHECK_OK(laden_lossless_cache_entries(path, dir, ent, NB, &count,
                                          &is_stale));
    CHECK_EQ(count, NB);
    CHECK_EQ(is_stale, 0);
    CHECK_EQ(ent[1].kept_raw, 1); /* the noise */
    CHECK_EQ(ent[1].blob_bytes, 0);
    CHECK_EQ(ent[0].kept_raw, 0);
    CHECK_EQ(ent[0].n_elems, N);
    CHECK_EQ(ent[0].blob_bytes + ent[2].blob_bytes, cs.coded_bytes);
    CHECK(ent[0].src_offset < ent[1].src_offset);
    CHECK_STATUS(laden_lossless_cache_entries(path, "/nonexistent", ent, NB,
                                              &count, &is_stale),
                 LADEN_E_NOENT);

    laden_sched_stats_t ss;
    uint32_t found = 9, stale = 9;
    CHECK_OK(load_cached(path, dir, NB, N, v, &ss, &found, &stale));
    CHECK_EQ(found, 1);
    CHECK_EQ(stale, 0);
    CHECK_EQ(ss.lossless_cache_bytes, cs.coded_bytes);
    CHECK_EQ(ss.lossless_bytes, cs.coded_bytes);
    CHECK_EQ(ss.load_read_bytes, cs.coded_bytes + raw); /* t1 as stored */
    /* The same load without it encodes the same blobs. */
    laden_sched_stats_t plain;
    char *empty = test_path("llc-empty");
    CHECK_EQ(mkdir(empty, 0755) == 0 || errno == EEXIST, 1);
    CHECK_OK(load_cached(path, empty, NB, N, v, &plain, &found, &stale));
    CHECK_EQ(found, 0);
    CHECK_EQ(plain.lossless_cache_bytes, 0);
    CHECK_EQ(plain.lossless_bytes, cs.coded_bytes);

    /* Refused: a second call, a missing directory; as a file. */
    laden_st_t *st;
    laden_sched_t *sc = blocks_of(path, &st, NB);
    CHECK_OK(laden_sched_use_lossless_cache(sc, dir));
    CHECK_STATUS(laden_sched_use_lossless_cache(sc, dir), LADEN_E_STATE);
    laden_sched_destroy(sc);
    laden_st_close(st);
    sc = blocks_of(path, &st, NB);
    CHECK_STATUS(laden_sched_use_lossless_cache(sc, "/nonexistent/llc"),
                 LADEN_E_NOENT);
    CHECK_STATUS(laden_sched_use_lossless_cache(sc, path), LADEN_E_IO);
    CHECK(strstr(laden_last_error(), "not a directory"));
    laden_sched_destroy(sc);
    laden_st_close(st);

    /* Another version of the file (other values, the same size). */
    uint16_t *v2 = values(LADEN_DTYPE_BF16, WEIGHTS, (uint64_t)NB * N);
    memcpy(v2 + N, noise, raw);
    write_tensors("llc.safetensors", NB, N, v2);
    CHECK_OK(load_cached(path, dir, NB, N, v2, &ss, &found, &stale));
    CHECK_EQ(found, 0);
    CHECK_EQ(stale, 1);
    CHECK_OK(laden_lossless_cache_entries(path, dir, NULL, 0, &count,
                                          &is_stale));
    CHECK_EQ(is_stale, 1);
    CHECK_EQ(ss.lossless_cache_bytes, 0);

    /* Damage: the index; a blob's header; a blob's codes. */
    CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
    uint64_t t0_blob = index_field(cpath, 0, 24);
    CHECK_EQ(index_field(cpath, 1, 20) & 0xffffffffu, 1); /* t1 kept raw */
    flip_byte(cpath, (uint64_t)sb.st_size - 3);
    CHECK_STATUS(load_cached(path, dir, NB, N, v2, &ss, &found, &stale),
                 LADEN_E_CORRUPT);
    CHECK(strstr(laden_last_error(), cpath));
    CHECK(strstr(laden_last_error(), "checksum"));
    CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
    flip_byte(cpath, t0_blob + 1); /* its magic */
    CHECK_STATUS(load_cached(path, dir, NB, N, v2, &ss, &found, &stale),
                 LADEN_E_CORRUPT);
    CHECK(strstr(laden_last_error(), cpath));
    CHECK(strstr(laden_last_error(), "'t0'"));
    CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
    flip_byte(cpath, t0_blob + LADEN_LOSSLESS_HEADER_BYTES + 100); /* a raw
                                                                     byte */
    CHECK_STATUS(load_cached(path, dir, NB, N, v2, &ss, &found, &stale),
                 LADEN_E_CORRUPT);

    /* Called after the mark (its sizes came from samples): refused. */
    sc = blocks_of(path, &st, NB);
    uint32_t marked_n;
    CHECK_OK(laden_sched_mark_lossless(sc, &marked_n));
    CHECK_STATUS(laden_sched_use_lossless_cache(sc, dir), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "after the mark"));
    laden_sched_destroy(sc);
    laden_st_close(st);

    /* A file without a BF16/F16 tensor: an empty index, read back. */
    float f32[64] = {0};
    char *fpath = test_path("llc-f32.safetensors");
    test_write_st(fpath, "{\"f\":{\"dtype\":\"F32\",\"shape\":[64],"
                         "\"data_offsets\":[0,256]}}",
                  f32, sizeof f32);
    laden_lossless_cache_stats fs;
    CHECK_OK(laden_lossless_cache_write(fpath, dir, NULL, NULL, &fs));
    CHECK_EQ(fs.files, 1);
    CHECK_EQ(fs.tensors, 0);
    char fcache[4096];
    CHECK_OK(laden_lossless_cache_path(fpath, dir, fcache, sizeof fcache));
    CHECK_EQ(stat(fcache, &sb), 0);
    CHECK_EQ((uint64_t)sb.st_size, fs.file_bytes);
    CHECK_OK(laden_lossless_cache_entries(fpath, dir, NULL, 0, &count,
                                          &is_stale));
    CHECK_EQ(count, 0);
    CHECK_EQ(is_stale, 0);

    /* A cancelled write leaves no file behind. */
    CHECK_EQ(unlink(cpath), 0);
    CHECK_STATUS(laden_lossless_cache_write(path, dir, cancel_write, NULL,
                                            &cs),
                 LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "cancelled"));
    CHECK(stat(cpath, &sb) != 0);
    DIR *dd = opendir(dir); /* nor a temporary one */
    CHECK(dd != NULL);
    for (struct dirent *de; (de = readdir(dd));)
        CHECK(!strstr(de->d_name, ".ldlc."));
    closedir(dd);
    CHECK_STATUS(laden_lossless_cache_write("/nonexistent.safetensors", dir,
                                            NULL, NULL, &cs),
                 LADEN_E_NOENT);
    /* A directory that cannot be made (under a regular file), a path that
     * does not fit, NULL arguments, a cache schedule. */
    char under[4200];
    snprintf(under, sizeof under, "%s/sub", path);
    CHECK_STATUS(laden_lossless_cache_write(path, under, NULL, NULL, &cs),
                 LADEN_E_IO);
    CHECK(strstr(laden_last_error(), "lossless cache directory"));
    char tiny[8];
    CHECK_STATUS(laden_lossless_cache_path(path, dir, tiny, sizeof tiny),
                 LADEN_E_LIMIT);
    CHECK_EQ(tiny[0], 0);
    CHECK_STATUS(laden_lossless_cache_entries(path, dir, NULL, 3, &count,
                                              &is_stale),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_lossless_cache_write(path, "", NULL, NULL, &cs),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_sched_lossless_cache_info(NULL, &found, &stale),
                 LADEN_E_INVAL);
    free(v);
    free(v2);
    free(noise);
}

/* Writes NB blocks' tensors "n<b>" (NOISE values: kept raw by a cache)
 * then "w<b>" (n values), their data 8 bytes past a 16-byte multiple, as
 * safetensors' headers often leave it; v holds them in that order. */
enum { NOISE = 4096 };
static char *write_pairs(const char *file, uint32_t nb, uint64_t n,
                         const uint16_t *v)
{
    char hdr[2048];
    int at = snprintf(hdr, sizeof hdr, "{");
    uint64_t off = 0;
    for (uint32_t b = 0; b < nb; b++) {
        at += snprintf(hdr + at, sizeof hdr - (size_t)at,
                       "%s\"n%u\":{\"dtype\":\"BF16\",\"shape\":[%d],"
                       "\"data_offsets\":[%llu,%llu]},"
                       "\"w%u\":{\"dtype\":\"BF16\",\"shape\":[%llu],"
                       "\"data_offsets\":[%llu,%llu]}",
                       b ? "," : "", b, NOISE, (unsigned long long)off,
                       (unsigned long long)(off + 2 * NOISE), b,
                       (unsigned long long)n,
                       (unsigned long long)(off + 2 * NOISE),
                       (unsigned long long)(off + 2 * NOISE + 2 * n));
        off += 2 * NOISE + 2 * n;
    }
    at += snprintf(hdr + at, sizeof hdr - (size_t)at, "}");
    while ((8 + at) % 16 != 8)
        hdr[at++] = ' ';
    hdr[at] = 0;
    char *path = test_path(file);
    test_write_st(path, hdr, v, off);
    return path;
}

/* The values of write_pairs' nb blocks: NOISE random values (kept raw)
 * then n weight-like ones each.  malloc'd. */
static uint16_t *pairs_values(uint32_t nb, uint64_t n)
{
    const uint64_t per = NOISE + n;
    uint16_t *v = malloc(2 * per * nb);
    CHECK(v);
    for (uint32_t b = 0; b < nb; b++) {
        uint16_t *noise = values(LADEN_DTYPE_BF16, RANDOM, NOISE);
        uint16_t *w = values(LADEN_DTYPE_BF16, WEIGHTS, n);
        memcpy(v + b * per, noise, 2 * NOISE);
        memcpy(v + b * per + NOISE, w, 2 * n);
        free(noise);
        free(w);
    }
    return v;
}

/* bytes at device address p (a host address on the CPU device, rd
 * NULL) into out. */
static void read_back(laden_dev_stream_t *rd, void *out, laden_devptr_t p,
                      uint64_t bytes)
{
    if (rd) {
        CHECK_OK(laden_dev_copy_d2h(rd, out, p, bytes));
        CHECK_OK(laden_dev_stream_synchronize(rd));
    } else {
        memcpy(out, (const void *)(uintptr_t)p, bytes);
    }
}

/* Block b of a pairs schedule (n<b> as stored, w<b> coded; v: every
 * block's values, n elements in each w<b>): both tensors read back where
 * the block runs (w<b> decoded at enter when the block streams, in its
 * device copy when it is resident) and compared with v. */
static void check_pair(laden_sched_t *sc, laden_dev_stream_t *rd, void *got,
                       const uint16_t *v, uint32_t b, uint64_t n)
{
    const uint64_t per = NOISE + n;
    for (uint32_t k = 0; k < 2; k++) {
        uint64_t bytes = 2 * (k ? n : NOISE), at;
        laden_devptr_t p;
        if (k && !laden_sched_is_resident(sc, b)) {
            CHECK_OK(laden_sched_expanded_at(sc, b, k, &p, &at));
            CHECK_EQ(at, bytes);
        } else {
            CHECK_OK(laden_sched_tensor_ptr(sc, b, k, &p));
        }
        read_back(rd, got, p, bytes);
        CHECK(memcmp(got, v + b * per + (k ? NOISE : 0), bytes) == 0);
    }
}

/* A schedule (cfg) of NB blocks on `tier`, block b holding n<b> then
 * w<b> (w<b> first when w_first), marked lossless with dir's lossless
 * cache (none: NULL), not loaded. */
static laden_sched_t *pairs_marked(const char *path, const char *dir,
                                   laden_sched_config cfg, laden_tier tier,
                                   uint32_t nb, bool w_first,
                                   laden_st_t **st)
{
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, st));
    CHECK_OK(laden_sched_create(&cfg, *st, &sc));
    for (uint32_t b = 0; b < nb; b++) {
        uint32_t blk, k;
        CHECK_OK(laden_sched_add_block(sc, tier, &blk));
        for (int w = 0; w < 2; w++) {
            char name[16];
            size_t at;
            snprintf(name, sizeof name, "%c%u", (w != w_first) ? 'w' : 'n',
                     b);
            CHECK_OK(laden_st_find(*st, name, &at));
            CHECK_OK(laden_sched_add_tensor(sc, blk, *st, at,
                                            LADEN_DTYPE_BF16, &k));
        }
    }
    uint32_t marked;
    if (dir)
        CHECK_OK(laden_sched_use_lossless_cache(sc, dir));
    CHECK_OK(laden_sched_mark_lossless(sc, &marked));
    CHECK_EQ(marked, 2 * nb);
    return sc;
}

/* The same (n<b> first), loaded. */
static laden_sched_t *pairs_loaded(const char *path, const char *dir,
                                   int32_t dev, laden_io_t *io,
                                   laden_tier tier, uint32_t nb,
                                   uint32_t flags, laden_st_t **st)
{
    laden_sched_config cfg = {.device = dev, .io = io, .flags = flags};
    laden_sched_t *sc = pairs_marked(path, dir, cfg, tier, nb, false, st);
    CHECK_OK(laden_sched_load(sc));
    return sc;
}

/* Bytes the pool read, every way. */
static uint64_t io_read(laden_io_t *io)
{
    laden_io_stats_t s;
    CHECK_OK(laden_io_stats(io, &s));
    return s.direct_bytes + s.cached_bytes + s.buffered_bytes;
}

/* A disk-tier block streams its tensors' blobs from the lossless cache
 * file (fewer bytes than the checkpoint's), checked at each read and
 * decoded at enter, every value as stored; a blob damaged after the load
 * is refused at the enter that reads it, naming the cache file.  On
 * either tier a block's reads land in place where most of its bytes
 * want (the blobs lie at 4 KiB multiples in the cache file, the raw
 * tensor beside them as in the checkpoint). */
static void disk_from_cache(int32_t dev)
{
    enum { NB = 3, N = 65536 };
    const uint64_t per = NOISE + (uint64_t)N;
    uint16_t *v = pairs_values(NB, N);
    char *path = write_pairs("llc-disk.safetensors", NB, N, v);
    char *dir = test_path("llc-disk-dir");
    laden_lossless_cache_stats cs;
    CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
    CHECK_EQ(cs.coded, NB); /* the w's; the noise kept raw */
    int decodes = dev == LADEN_DEVICE_CPU || cuda_decoder();
    laden_dev_stream_t *rd = NULL;
    if (dev >= 0)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    uint16_t *got = malloc(2 * (uint64_t)N);
    for (int disk = 0; disk < 2; disk++) {
        laden_io_t *io;
        laden_st_t *st;
        CHECK_OK(laden_io_create(NULL, &io));
        laden_sched_t *sc =
            pairs_loaded(path, dir, dev, io,
                         disk ? LADEN_TIER_DISK : LADEN_TIER_RAM, NB, 0, &st);
        laden_sched_stats_t ss;
        CHECK_OK(laden_sched_stats(sc, &ss));
        CHECK_EQ(ss.lossless_cache_bytes, cs.coded_bytes);
        char *tpath = test_path("llc-disk-trace.json");
        if (disk && decodes) /* the decodes in the trace, a span a block */
            CHECK_OK(laden_trace_start(0));
        for (uint32_t b = 0; disk && decodes && b < NB; b++) {
            CHECK_OK(b ? LADEN_OK : laden_sched_start(sc, 1));
            CHECK_OK(laden_sched_enter(sc, b, 0));
            CHECK_EQ(laden_sched_tensor_lossless(sc, b, 0), 0); /* raw */
            CHECK_EQ(laden_sched_tensor_lossless(sc, b, 1), 1);
            CHECK(!laden_sched_is_resident(sc, b)); /* decoded at enter */
            check_pair(sc, rd, got, v, b, N);
            CHECK_OK(laden_sched_exit(sc, b, 0));
        }
        if (disk && decodes) {
            laden_trace_result_t tr;
            if (rd)
                CHECK_OK(laden_dev_stream_synchronize(rd));
            CHECK_OK(laden_trace_stop(tpath, &tr));
            CHECK_EQ(test_lines_containing(tpath, "\"cat\":\"expand\""), NB);
            CHECK_EQ(test_lines_containing(tpath, "\"name\":\"decode "), NB);
        }
        uint64_t read = io_read(io);
        if (disk && decodes) { /* every block read, coded (a prefetch
                                  past the last may read one again) */
            uint64_t blocks = 0;
            for (uint32_t b = 0; b < NB; b++) {
                uint64_t n = laden_sched_block_bytes(sc, b);
                CHECK(n < 2 * per * 3 / 4);
                blocks += n;
            }
            CHECK_OK(laden_sched_stats(sc, &ss));
            CHECK(ss.read_bytes >= blocks);
            CHECK(blocks >= cs.coded_bytes + 2 * NOISE * NB);
        }
        /* The raw tensors' 8 KiB misplaced, not the blobs (the disk tier
         * reads only at its enters: where the device decodes). */
        if (dev >= 0 && (!disk || decodes)) {
            CHECK(read > 2 * per * NB / 2);
            if (laden__io_misplaced_bytes(io) * 4 >= read)
                fprintf(stderr, "%s tier: %llu of %llu bytes read misplaced\n",
                        disk ? "disk" : "RAM",
                        (unsigned long long)laden__io_misplaced_bytes(io),
                        (unsigned long long)read);
            CHECK(laden__io_misplaced_bytes(io) * 4 < read);
        }
        /* The value as stored, from the cache file or the home. */
        CHECK_OK(laden_sched_tensor_value(sc, 1, 1, LADEN_DTYPE_BF16, got,
                                          2 * (uint64_t)N));
        CHECK(memcmp(got, v + per + NOISE, 2 * (uint64_t)N) == 0);
        laden_sched_destroy(sc);
        laden_st_close(st);
        laden_io_destroy(io);
    }
    if (decodes) { /* damaged after the load: refused at the read */
        laden_io_t *io;
        laden_st_t *st;
        CHECK_OK(laden_io_create(NULL, &io));
        laden_sched_t *sc =
            pairs_loaded(path, dir, dev, io, LADEN_TIER_DISK, NB, 0, &st);
        char cpath[4096];
        CHECK_OK(laden_lossless_cache_path(path, dir, cpath, sizeof cpath));
        /* w1's magic, the file's times kept (damage a change of the file
         * would not show: laden_io checks its size and times) */
        struct stat sb;
        CHECK_EQ(stat(cpath, &sb), 0);
        flip_byte(cpath, index_field(cpath, 3, 24) + 1);
        struct timespec was[2] = {sb.st_atim, sb.st_mtim};
        CHECK_EQ(utimensat(AT_FDCWD, cpath, was, 0), 0);
        CHECK_OK(laden_sched_start(sc, 1));
        CHECK_OK(laden_sched_enter(sc, 0, 0));
        CHECK_OK(laden_sched_exit(sc, 0, 0));
        CHECK_STATUS(laden_sched_enter(sc, 1, 0), LADEN_E_CORRUPT);
        CHECK(strstr(laden_last_error(), cpath));
        CHECK(strstr(laden_last_error(), "'w1'"));
        laden_sched_destroy(sc);
        laden_st_close(st);
        /* Changed in use, its time with it: LADEN_E_CHANGED at the read. */
        CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
        sc = pairs_loaded(path, dir, dev, io, LADEN_TIER_DISK, NB, 0, &st);
        flip_byte(cpath, index_field(cpath, 3, 24) + 1);
        struct timespec later[2] = {{0, UTIME_OMIT}, {sb.st_mtim.tv_sec + 5, 0}};
        CHECK_EQ(utimensat(AT_FDCWD, cpath, later, 0), 0);
        CHECK_OK(laden_sched_start(sc, 1));
        CHECK_STATUS(laden_sched_enter(sc, 0, 0), LADEN_E_CHANGED);
        CHECK(strstr(laden_last_error(), "changed"));
        laden_sched_destroy(sc);
        laden_st_close(st);
        /* A blob's codes damaged, its header whole: the decoder finds
         * it, at the enter on the CPU device; on CUDA once the compute
         * stream has passed the decode (the next enter or synchronize),
         * and from then on every enter is refused. */
        CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
        sc = pairs_loaded(path, dir, dev, io, LADEN_TIER_DISK, NB, 0, &st);
        CHECK_EQ(stat(cpath, &sb), 0);
        flip_byte(cpath, index_field(cpath, 3, 24) +
                             LADEN_LOSSLESS_HEADER_BYTES + 100);
        struct timespec kept[2] = {sb.st_atim, sb.st_mtim};
        CHECK_EQ(utimensat(AT_FDCWD, cpath, kept, 0), 0);
        CHECK_OK(laden_sched_start(sc, 1));
        CHECK_OK(laden_sched_enter(sc, 0, 0));
        CHECK_OK(laden_sched_exit(sc, 0, 0));
        if (dev < 0) {
            CHECK_STATUS(laden_sched_enter(sc, 1, 0), LADEN_E_CORRUPT);
            CHECK(strstr(laden_last_error(), "'w1'"));
        } else {
            CHECK_OK(laden_sched_enter(sc, 1, 0));
            CHECK_OK(laden_sched_exit(sc, 1, 0));
            CHECK_OK(laden_dev_stream_synchronize(rd));
            CHECK_STATUS(laden_sched_synchronize(sc), LADEN_E_CORRUPT);
            CHECK(strstr(laden_last_error(), "'w1'"));
            CHECK(strstr(laden_last_error(), cpath));
            CHECK_STATUS(laden_sched_enter(sc, 2, 0), LADEN_E_CORRUPT);
            CHECK_STATUS(laden_sched_enter(sc, 0, 0), LADEN_E_CORRUPT);
            CHECK_OK(laden_sched_stop(sc)); /* kept until loaded again */
            CHECK_OK(laden_sched_start(sc, 1));
            CHECK_STATUS(laden_sched_enter(sc, 0, 0), LADEN_E_CORRUPT);
        }
        laden_sched_destroy(sc);
        laden_st_close(st);
        laden_io_destroy(io);
    }
    laden_dev_stream_destroy(rd);
    free(got);
    free(v);
}

TEST(lossless_cache_streams_the_disk_tier)
{
    test_on_every_device(disk_from_cache);
}

/* A cache schedule (LADEN_SCHED_CACHE) keeps its lossless tensors coded
 * in the host copies and the slots, and decoded in its device copies:
 * uploaded coded and decoded into place on the copy stream.  Every value
 * as stored, resident or streamed; a device copy's size is the decoded
 * one (laden_sched_block_device_bytes), and a region handed over must be
 * of it.  A host copy damaged under a whole header is refused: at the
 * upload on the CPU device, at the next laden_sched_ready on CUDA (the
 * decoder's word).  Without a device decoder (the stand-in driver has no
 * NVRTC) the upload is refused with a typed error and nothing is left
 * resident. */
static void cache_schedule(int32_t dev)
{
    enum { NB = 3, N = 65536 };
    const uint64_t per = NOISE + (uint64_t)N;
    uint16_t *v = pairs_values(NB, N);
    char *path = write_pairs("llc-cache.safetensors", NB, N, v);
    char *dir = test_path("llc-cache-dir");
    laden_lossless_cache_stats cs;
    CHECK_OK(laden_lossless_cache_write(path, dir, NULL, NULL, &cs));
    int decodes = dev == LADEN_DEVICE_CPU || cuda_decoder();
    laden_dev_stream_t *rd = NULL;
    if (dev >= 0)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    uint16_t *got = malloc(2 * (uint64_t)N);
    for (int cached = 0; cached < 2; cached++) { /* encoded, or its file */
        laden_st_t *st;
        laden_sched_t *sc =
            pairs_loaded(path, cached ? dir : NULL, dev, NULL, LADEN_TIER_RAM,
                         NB, LADEN_SCHED_CACHE, &st);
        laden_sched_stats_t ss;
        CHECK_OK(laden_sched_stats(sc, &ss));
        CHECK_EQ(ss.lossless_cache_bytes, cached ? cs.coded_bytes : 0);
        for (uint32_t b = 0; b < NB; b++) {
            CHECK_EQ(laden_sched_tensor_lossless(sc, b, 0), 0); /* noise */
            CHECK_EQ(laden_sched_tensor_lossless(sc, b, 1), 1);
            CHECK(laden_sched_block_bytes(sc, b) < 2 * per * 3 / 4);
            CHECK_EQ(laden_sched_block_device_bytes(sc, b), 2 * per);
        }
        if (!decodes) { /* refused, typed; nothing left on the device */
            CHECK_STATUS(laden_sched_set_resident(sc, 0, 1),
                         LADEN_E_UNSUPPORTED);
            CHECK_EQ(laden_sched_is_resident(sc, 0), 0);
            CHECK_OK(laden_sched_stats(sc, &ss));
            CHECK_EQ(ss.resident_bytes, 0);
            laden_sched_destroy(sc);
            laden_st_close(st);
            continue;
        }
        CHECK_OK(laden_sched_set_resident(sc, 0, 1));
        CHECK_OK(laden_sched_set_resident(sc, 1, 1));
        CHECK_OK(laden_sched_stats(sc, &ss));
        CHECK_EQ(ss.resident_bytes, 4 * per);
        CHECK_EQ(ss.upload_bytes, laden_sched_block_bytes(sc, 0) +
                                      laden_sched_block_bytes(sc, 1));
        CHECK_OK(laden_sched_start(sc, 1)); /* block 2 streams */
        CHECK_OK(laden_sched_ready(sc, 0));
        {
            laden_devptr_t p;
            uint64_t at;
            CHECK_STATUS(laden_sched_expanded_at(sc, 0, 1, &p, &at),
                         LADEN_E_STATE); /* decoded in its device copy */
            CHECK(strstr(laden_last_error(), "laden_sched_tensor_ptr"));
        }
        for (uint32_t b = 0; b < NB; b++) {
            CHECK_OK(laden_sched_enter(sc, b, 0));
            /* block 2 streams: decoded at enter; the others in their
             * device copies */
            CHECK_EQ(laden_sched_is_resident(sc, b), b != 2);
            check_pair(sc, rd, got, v, b, N);
            CHECK_OK(laden_sched_exit(sc, b, 0));
        }
        CHECK_OK(laden_sched_synchronize(sc));
        /* A coded tensor's host copy is its blob: nothing to re-upload
         * from (a plain one beside it can be). */
        CHECK_STATUS(laden_sched_reupload_tensor(sc, 0, 1, 0),
                     LADEN_E_UNSUPPORTED);
        CHECK(strstr(laden_last_error(), "'w0'"));
        CHECK_OK(laden_sched_reupload_tensor(sc, 0, 0, 0));
        CHECK_OK(laden_sched_stop(sc));
        /* A device copy handed over is of the decoded size. */
        laden_devptr_t r;
        uint64_t n;
        CHECK_OK(laden_sched_take_resident(sc, 1, &r, &n));
        CHECK_EQ(n, laden_sched_block_device_bytes(sc, 1));
        CHECK_STATUS(laden_sched_set_resident_at(
                         sc, 2, r, laden_sched_block_bytes(sc, 2)),
                     LADEN_E_INVAL);
        CHECK_OK(laden_sched_set_resident_at(sc, 2, r, n));
        CHECK_OK(laden_sched_ready(sc, 0));
        laden_devptr_t p;
        CHECK_OK(laden_sched_tensor_ptr(sc, 2, 1, &p));
        read_back(rd, got, p, 2 * (uint64_t)N);
        CHECK(memcmp(got, v + 2 * per + NOISE, 2 * (uint64_t)N) == 0);
        CHECK_OK(laden_sched_tensor_value(sc, 2, 1, LADEN_DTYPE_BF16, got,
                                          2 * (uint64_t)N));
        CHECK(memcmp(got, v + 2 * per + NOISE, 2 * (uint64_t)N) == 0);
        /* A host copy damaged under a whole header. */
        void *h;
        CHECK_OK(laden_sched_host_ptr(sc, 0, 1, &h));
        ((unsigned char *)h)[LADEN_LOSSLESS_HEADER_BYTES + 100] ^= 0x5a;
        if (dev < 0) {
            CHECK_STATUS(laden_sched_reupload(sc, 0), LADEN_E_CORRUPT);
            CHECK(strstr(laden_last_error(), "'w0'"));
        } else {
            CHECK_OK(laden_sched_reupload(sc, 0));
            CHECK_STATUS(laden_sched_ready(sc, 0), LADEN_E_CORRUPT);
            CHECK(strstr(laden_last_error(), "block 0"));
            CHECK_OK(laden_sched_start(sc, 1));
            CHECK_STATUS(laden_sched_enter(sc, 2, 0), LADEN_E_CORRUPT);
        }
        CHECK_OK(laden_sched_stop(sc));
        for (uint32_t b = 0; b < NB; b++)
            CHECK_OK(laden_sched_set_resident(sc, b, 0));
        CHECK_OK(laden_sched_stats(sc, &ss));
        CHECK_EQ(ss.resident_bytes, 0);
        CHECK_EQ(ss.device_bytes, 0); /* the upload buffer given back */
        laden_sched_destroy(sc);
        laden_st_close(st);
    }
    laden_dev_stream_destroy(rd);
    free(got);
    free(v);
}

TEST(lossless_in_a_cache_schedule) { test_on_every_device(cache_schedule); }

/* A cache schedule's uploads take two device buffers in turn for the
 * blobs they decode: a blob copied into a buffer whose last decode has
 * not run yet would be decoded as the next blob's bytes.  Four blocks
 * made resident before one laden_sched_ready (their coded tensors go
 * through the buffers in turn, each taken twice), every value as stored.
 * On the stand-in driver, run with its streams in either order
 * (FAKE_CUDA_OLDEST_FIRST), a copy or a decode that does not wait for
 * the other fails here. */
static void cache_uploads_in_turn(int32_t dev)
{
    enum { NB = 4, N = 65536 };
    if (dev >= 0 && !cuda_decoder())
        return; /* no device decoder: cache_schedule checks the refusal */
    const uint64_t per = NOISE + (uint64_t)N;
    uint16_t *v = pairs_values(NB, N);
    char *path = write_pairs("llc-turns.safetensors", NB, N, v);
    laden_dev_stream_t *rd = NULL;
    if (dev >= 0)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    uint16_t *got = malloc(2 * per);
    laden_st_t *st;
    laden_sched_t *sc = pairs_loaded(path, NULL, dev, NULL, LADEN_TIER_RAM,
                                     NB, LADEN_SCHED_CACHE, &st);
    for (uint32_t b = 0; b < NB; b++) {
        CHECK_EQ(laden_sched_tensor_lossless(sc, b, 1), 1);
        CHECK_OK(laden_sched_set_resident(sc, b, 1));
    }
    CHECK_OK(laden_sched_ready(sc, 0));
    for (uint32_t b = 0; b < NB; b++) {
        CHECK(laden_sched_is_resident(sc, b));
        check_pair(sc, rd, got, v, b, N);
    }
    laden_sched_destroy(sc);
    laden_st_close(st);
    laden_dev_stream_destroy(rd);
    free(got);
    free(v);
}

TEST(lossless_cache_uploads_take_their_buffers_in_turn)
{
    test_on_every_device(cache_uploads_in_turn);
}

/* A whole load encodes its RAM-tier tensors on the pool's threads and
 * puts each block's blobs into the block's home once its last tensor is
 * encoded, while later blocks are read (compress.c's settle_block); the
 * loader then reads only what stays as stored (the noise) into the same
 * home, in place on CUDA (the shift the encoders mapped the home with is
 * the one the layout counts).  Every value as stored where the block
 * runs and by laden_sched_tensor_value.  Stopped by the progress
 * callback once all is encoded, the load fails typed and what it made is
 * freed (ASan); over a RAM budget the homes do not fit it fails as a
 * budget (not as a stop); asked to share its host copy, the settled
 * blocks stay private and every value is right. */
static void whole_load_places_blocks(int32_t dev)
{
    enum { NB = 6, N = 65536 };
    const uint64_t per = NOISE + (uint64_t)N;
    uint16_t *v = pairs_values(NB, N);
    char *path = write_pairs("ll-settle.safetensors", NB, N, v);
    int decodes = dev == LADEN_DEVICE_CPU || cuda_decoder();
    laden_dev_stream_t *rd = NULL;
    if (dev >= 0)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    uint16_t *got = malloc(2 * per);
    laden_io_t *io;
    laden_st_t *st;
    CHECK_OK(laden_io_create(NULL, &io));
    laden_sched_config cfg = {.device = dev, .io = io};
    laden_sched_t *sc =
        pairs_marked(path, NULL, cfg, LADEN_TIER_RAM, NB, true, &st);
    uint64_t misplaced = laden__io_misplaced_bytes(io); /* the samples */
    CHECK_OK(laden_sched_load(sc));
    if (dev >= 0)
        CHECK_EQ(laden__io_misplaced_bytes(io) - misplaced, 0);
    laden_sched_stats_t ss;
    CHECK_OK(laden_sched_stats(sc, &ss));
    CHECK_EQ(ss.lossless_raw_bytes, 2u * N * NB);
    /* The noise twice: by its encoder, which finds that it does not code
     * small enough, and by the loader. */
    CHECK_EQ(ss.load_read_bytes, 2 * per * NB + 2u * NOISE * NB);
    for (uint32_t b = 0; b < NB; b++) {
        CHECK_EQ(laden_sched_tensor_lossless(sc, b, 0), 1);
        CHECK_EQ(laden_sched_tensor_lossless(sc, b, 1), 0); /* noise */
        CHECK(laden_sched_block_bytes(sc, b) < 2 * per * 3 / 4);
        for (uint32_t k = 0; k < 2; k++) {
            uint64_t bytes = 2 * (k ? NOISE : (uint64_t)N);
            memset(got, 0, bytes);
            CHECK_OK(laden_sched_tensor_value(sc, b, k, LADEN_DTYPE_BF16,
                                              got, bytes));
            CHECK(memcmp(got, v + b * per + (k ? 0 : NOISE), bytes) == 0);
        }
    }
    for (uint32_t b = 0; decodes && b < NB; b++) { /* where it runs */
        CHECK_OK(b ? LADEN_OK : laden_sched_start(sc, 1));
        CHECK_OK(laden_sched_enter(sc, b, 0));
        for (uint32_t k = 0; k < 2; k++) {
            uint64_t bytes = 2 * (k ? NOISE : (uint64_t)N), at;
            laden_devptr_t p;
            if (k) {
                CHECK_OK(laden_sched_tensor_ptr(sc, b, k, &p));
            } else {
                CHECK_OK(laden_sched_expanded_at(sc, b, k, &p, &at));
                CHECK_EQ(at, bytes);
            }
            read_back(rd, got, p, bytes);
            CHECK(memcmp(got, v + b * per + (k ? 0 : NOISE), bytes) == 0);
        }
        CHECK_OK(laden_sched_exit(sc, b, 0));
    }
    laden_sched_destroy(sc);
    laden_st_close(st);
    /* Stopped after the last block was encoded and put in its home. */
    sc = pairs_marked(path, NULL, cfg, LADEN_TIER_RAM, NB, true, &st);
    stop_after = 1;
    seen_done = seen_total = 0;
    CHECK_OK(laden_sched_set_progress(sc, on_progress, NULL));
    CHECK_STATUS(laden_sched_load(sc), LADEN_E_STATE);
    CHECK(strstr(laden_last_error(), "while compressing"));
    CHECK_EQ(seen_total, 2 * per * NB);
    CHECK_STATUS(laden_sched_start(sc, 0), LADEN_E_STATE);
    stop_after = 0;
    laden_sched_destroy(sc);
    laden_st_close(st);
    /* A RAM budget the homes do not fit: refused as a budget, naming a
     * block (on the CPU device, the arena's budget), not as a stop. */
    laden_sched_config small = cfg;
    small.ram_budget_bytes = 2 * per * 2; /* about three blocks coded */
    sc = pairs_marked(path, NULL, small, LADEN_TIER_RAM, NB, true, &st);
    CHECK_STATUS(laden_sched_load(sc), LADEN_E_BUDGET);
    CHECK(strstr(laden_last_error(), "budget"));
    CHECK(!strstr(laden_last_error(), "cancelled"));
    laden_sched_destroy(sc);
    laden_st_close(st);
    /* Asked to share its host copy: a block its encoders put into a home
     * of this process's stays in it (never a segment the loader would
     * not fill), every value as stored. */
    setenv("LADEN_SHM_DIR", test_shm_dir(), 1);
    (void)mkdir(test_shm_dir(), 0700);
    sc = pairs_marked(path, NULL, cfg, LADEN_TIER_RAM, NB, true, &st);
    CHECK_OK(laden_sched_share(sc, "ll-settle"));
    CHECK_OK(laden_sched_load(sc));
    for (uint32_t b = 0; b < NB; b++) {
        CHECK_EQ(laden_sched_tensor_lossless(sc, b, 0), 1);
        memset(got, 0, 2 * (uint64_t)N);
        CHECK_OK(laden_sched_tensor_value(sc, b, 0, LADEN_DTYPE_BF16, got,
                                          2 * (uint64_t)N));
        CHECK(memcmp(got, v + b * per + NOISE, 2 * (uint64_t)N) == 0);
    }
    laden_sched_destroy(sc);
    laden_st_close(st);
    laden_io_destroy(io);
    laden_dev_stream_destroy(rd);
    free(got);
    free(v);
}

TEST(lossless_whole_load_puts_each_block_in_its_home_as_encoded)
{
    test_on_every_device(whole_load_places_blocks);
}

/* The cache engine keeps an activation's lossless upload buffers within
 * its VRAM budget (laden_sched_block_upload_bytes): beside an idle model
 * holding the rest of the budget, a model made resident makes the idle
 * one give up the buffers' bytes too, not only its blocks'; alone under
 * a budget its blocks just fit, it streams what the buffers need.  Every
 * value as stored.  (On the CPU device nothing is buffered.) */
static void engine_upload_buffers(int32_t dev)
{
    enum { NB = 3, N = 65536 };
    if (dev >= 0 && !cuda_decoder())
        return;
    const uint64_t per = NOISE + (uint64_t)N;
    uint16_t *v = pairs_values(NB, N);
    char *path = write_pairs("llc-engine.safetensors", NB, N, v);
    laden_st_t *st[2];
    laden_sched_t *sc[2];
    uint64_t total = 0, up = 0;
    for (int i = 0; i < 2; i++)
        sc[i] = pairs_loaded(path, NULL, dev, NULL, LADEN_TIER_RAM, NB,
                             LADEN_SCHED_CACHE, &st[i]);
    for (uint32_t b = 0; b < NB; b++) {
        total += laden_sched_block_device_bytes(sc[0], b);
        uint64_t n = laden_sched_block_upload_bytes(sc[0], b);
        up = n > up ? n : up;
    }
    CHECK_EQ(up != 0, dev >= 0); /* CUDA decodes through the buffers */
    CHECK(up < total);
    laden_dev_stream_t *rd = NULL;
    if (dev >= 0)
        CHECK_OK(laden_dev_stream_wrap(dev, 0, &rd));
    uint16_t *got = malloc(2 * per);
    for (int tight = 0; tight < 2; tight++) {
        uint64_t budget = tight ? total : 2 * total;
        laden_cache_t *c;
        uint32_t id[2], n;
        laden_cache_evict_t ev[4];
        laden_cache_activation_t act;
        CHECK_OK(laden_cache_create(budget, 0, &c));
        for (int i = 0; i < 2; i++) {
            char key[8];
            snprintf(key, sizeof key, "m%d", i);
            CHECK_OK(laden_cache_add(c, key, 0, &id[i]));
            CHECK_OK(laden_cache_bind(c, id[i], sc[i], 0));
        }
        laden_cache_info_t other;
        if (!tight) { /* the other model resident, then idle */
            CHECK_OK(laden_cache_activate(c, id[1], LADEN_CACHE_RESIDENT, 1,
                                          0, ev, 4, &n, &act));
            CHECK_OK(laden_cache_deactivate(c, id[1], 0));
            CHECK_OK(laden_cache_info(c, id[1], &other));
            CHECK_EQ(other.vram_bytes, total);
        }
        if (tight && dev >= 0) { /* its blocks fit, not with the buffers */
            CHECK_STATUS(laden_cache_activate(c, id[0], LADEN_CACHE_RESIDENT,
                                              1, 0, ev, 4, &n, &act),
                         LADEN_E_BUDGET);
            CHECK_CONTAINS(laden_last_error(), "lossless upload buffers");
            laden_cache_info_t self;
            CHECK_OK(laden_cache_info(c, id[0], &self));
            CHECK(!self.in_use && self.vram_bytes == 0); /* as it was */
        }
        CHECK_OK(laden_cache_activate(c, id[0],
                                      tight ? LADEN_CACHE_AUTO
                                            : LADEN_CACHE_RESIDENT,
                                      1, 0, ev, 4, &n, &act));
        laden_sched_stats_t ss;
        CHECK_OK(laden_sched_stats(sc[0], &ss));
        CHECK_OK(laden_cache_info(c, id[1], &other));
        /* What was on the device while the uploads ran: this model's
         * device copies and the buffers where it uploaded any (they go
         * before its slots are made), or its copies and slots after, and
         * what the other kept. */
        uint64_t uploading = ss.resident_bytes ? ss.resident_bytes + up : 0;
        uint64_t peak = (uploading > ss.device_bytes ? uploading
                                                     : ss.device_bytes) +
                        other.vram_bytes;
        if (peak > budget)
            fprintf(stderr, "budget %llu: %llu held, %llu buffers, %llu "
                            "kept by the other\n",
                    (unsigned long long)budget,
                    (unsigned long long)ss.device_bytes,
                    (unsigned long long)up,
                    (unsigned long long)other.vram_bytes);
        CHECK(peak <= budget);
        if (!tight)
            CHECK_EQ(ss.resident_bytes, total);
        for (uint32_t b = 0; b < NB; b++) {
            CHECK_OK(laden_sched_enter(sc[0], b, 0));
            check_pair(sc[0], rd, got, v, b, N);
            CHECK_OK(laden_sched_exit(sc[0], b, 0));
        }
        CHECK_OK(laden_cache_deactivate(c, id[0], 0));
        for (int i = 0; i < 2; i++) {
            CHECK_OK(laden_cache_unbind(c, id[i]));
            CHECK_OK(laden_cache_remove(c, id[i]));
        }
        laden_cache_destroy(c);
    }
    for (int i = 0; i < 2; i++) {
        laden_sched_destroy(sc[i]);
        laden_st_close(st[i]);
    }
    laden_dev_stream_destroy(rd);
    free(got);
    free(v);
}

TEST(lossless_cache_engine_counts_the_upload_buffers)
{
    test_on_every_device(engine_upload_buffers);
}

/* A cache schedule (LADEN_SCHED_CACHE) on the CPU device of the
 * checkpoint at path, opened into *st. */
static laden_sched_t *cpu_cache_schedule(const char *path, laden_st_t **st)
{
    laden_sched_t *sc;
    CHECK_OK(laden_st_open(path, st));
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU,
                              .flags = LADEN_SCHED_CACHE};
    CHECK_OK(laden_sched_create(&cfg, *st, &sc));
    return sc;
}

/* In a cache schedule's device copy the tensors after a decoded lossless
 * one lie further on than in the host copy (dev_off): a compact tensor
 * there (a BF16 widened to F32) expands from its own bytes, not from the
 * blob's place in the host copy.  The CPU device (its decoder is C). */
TEST(lossless_cache_copy_expands_what_follows_a_decoded_tensor)
{
    enum { N = 16384 };
    char hdr[256];
    snprintf(hdr, sizeof hdr,
             "{\"a\":{\"dtype\":\"BF16\",\"shape\":[%d],\"data_offsets\":"
             "[0,%d]},\"b\":{\"dtype\":\"BF16\",\"shape\":[%d],"
             "\"data_offsets\":[%d,%d]}}",
             N, 2 * N, N, 2 * N, 4 * N);
    uint16_t *w = values(LADEN_DTYPE_BF16, WEIGHTS, N);
    uint16_t *v = malloc(4 * (size_t)N);
    memcpy(v, w, 2 * (size_t)N);
    for (int i = 0; i < N; i++)
        v[N + i] = (uint16_t)(0x4000 + (i & 127)); /* 2.0 and on */
    char *path = test_path("llc-after.safetensors");
    test_write_st(path, hdr, v, 4 * (size_t)N);
    laden_st_t *st;
    laden_sched_t *sc = cpu_cache_schedule(path, &st);
    uint32_t blk, ka, kb;
    size_t at;
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_st_find(st, "a", &at));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, at, LADEN_DTYPE_BF16, &ka));
    CHECK_OK(laden_st_find(st, "b", &at));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, at, LADEN_DTYPE_BF16, &kb));
    CHECK_OK(laden_sched_set_lossless(sc, blk, ka));
    CHECK_OK(laden_sched_set_expanded(sc, blk, kb, LADEN_DTYPE_F32, N,
                                      LADEN_SCHED_NO_SCALE, 0));
    CHECK_OK(laden_sched_load(sc));
    CHECK_EQ(laden_sched_tensor_lossless(sc, blk, ka), 1);
    CHECK_OK(laden_sched_set_resident(sc, blk, 1));
    CHECK_OK(laden_sched_start(sc, 1));
    CHECK_OK(laden_sched_ready(sc, 0));
    CHECK_OK(laden_sched_enter(sc, blk, 0));
    laden_devptr_t p;
    uint64_t n;
    CHECK_OK(laden_sched_tensor_ptr(sc, blk, ka, &p));
    CHECK(memcmp((const void *)(uintptr_t)p, w, 2 * (size_t)N) == 0);
    CHECK_OK(laden_sched_expanded_at(sc, blk, kb, &p, &n));
    CHECK_EQ(n, 4 * (uint64_t)N);
    const float *f = (const float *)(uintptr_t)p;
    for (int i = 0; i < N; i++) {
        uint32_t bits = (uint32_t)v[N + i] << 16;
        float want;
        memcpy(&want, &bits, 4);
        CHECK(f[i] == want);
    }
    CHECK_OK(laden_sched_exit(sc, blk, 0));
    laden_sched_destroy(sc);
    laden_st_close(st);
    free(w);
    free(v);
}

/* In a cache schedule only the lossless tensors of a block with a device
 * copy are decoded ahead (at the upload): its other compact tensors (a
 * BF16 widened to F32 here) still expand at its enter, after a streamed
 * block used the workspace; and laden_sched_expanded_at refuses a
 * lossless tensor whose decoded copy is its block's. */
TEST(lossless_cache_schedule_still_expands_the_rest)
{
    enum { N = 256 };
    char hdr[512];
    snprintf(hdr, sizeof hdr,
             "{\"a\":{\"dtype\":\"BF16\",\"shape\":[%d],\"data_offsets\":"
             "[0,%d]},\"b\":{\"dtype\":\"BF16\",\"shape\":[%d],"
             "\"data_offsets\":[%d,%d]}}",
             N, 2 * N, N, 2 * N, 4 * N);
    uint16_t v[2 * N];
    for (int i = 0; i < N; i++) {
        v[i] = 0x3f80;     /* 1.0 */
        v[N + i] = 0x4000; /* 2.0 */
    }
    char *path = test_path("cache-expand.safetensors");
    test_write_st(path, hdr, v, sizeof v);
    laden_st_t *st;
    laden_sched_t *sc = cpu_cache_schedule(path, &st);
    uint32_t blk[2], k;
    const char *names[2] = {"a", "b"};
    for (int b = 0; b < 2; b++) {
        size_t at;
        CHECK_OK(laden_st_find(st, names[b], &at));
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk[b]));
        CHECK_OK(laden_sched_add_tensor(sc, blk[b], st, at, LADEN_DTYPE_BF16,
                                        &k));
        CHECK_OK(laden_sched_set_expanded(sc, blk[b], k, LADEN_DTYPE_F32, N,
                                          LADEN_SCHED_NO_SCALE, 0));
    }
    CHECK_OK(laden_sched_load(sc));
    CHECK_OK(laden_sched_set_resident(sc, blk[0], 1));
    CHECK_OK(laden_sched_start(sc, 1));
    CHECK_OK(laden_sched_ready(sc, 0));
    for (int b = 1; b >= 0; b--) { /* the streamed one first */
        laden_devptr_t p;
        uint64_t n;
        CHECK_OK(laden_sched_enter(sc, blk[b], 0));
        CHECK_OK(laden_sched_expanded_at(sc, blk[b], 0, &p, &n));
        CHECK_EQ(n, 4 * N);
        for (int i = 0; i < N; i++)
            CHECK(((const float *)(uintptr_t)p)[i] == (b ? 2.0f : 1.0f));
        CHECK_OK(laden_sched_exit(sc, blk[b], 0));
    }
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* A cache plans a model kept lossless by its decoded device copies, but
 * its slots at the coded bytes they hold: under a VRAM budget that fits
 * the rest, the workspace, three decoded blocks and three coded slots,
 * three blocks are resident (counting the slots decoded, three would not
 * fit); what it holds stays within the budget and every value is as
 * stored, resident or streamed.  The CPU device (its decoder is the C
 * one). */
TEST(lossless_cache_plans_slots_coded)
{
    enum { NB = 8, N = 16384 };
    laden_sched_t *sc;
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU,
                              .flags = LADEN_SCHED_CACHE};
    CHECK_OK(laden_sched_create(&cfg, NULL, &sc));
    uint16_t *v[NB];
    for (uint32_t b = 0; b < NB; b++) {
        uint32_t blk, k;
        v[b] = values(LADEN_DTYPE_BF16, WEIGHTS, N);
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
        CHECK_OK(laden_sched_add_host_tensor(sc, blk, v[b],
                                             LADEN_DTYPE_BF16, N,
                                             LADEN_DTYPE_BF16, &k));
    }
    uint32_t marked;
    CHECK_OK(laden_sched_mark_lossless(sc, &marked));
    CHECK_EQ(marked, NB);
    CHECK_OK(laden_sched_load(sc));
    uint64_t D = laden_sched_block_device_bytes(sc, 1), C = 0;
    for (uint32_t b = 1; b < NB; b++) {
        CHECK_EQ(laden_sched_block_device_bytes(sc, b), D);
        uint64_t c = laden_sched_block_bytes(sc, b);
        C = c > C ? c : C;
    }
    CHECK(C < D * 3 / 4);
    CHECK_EQ(laden_sched_block_workspace_bytes(sc, 1), D);
    /* rest + workspace + 3 resident + 3 slots, coded; decoded slots
     * would need 8 D */
    uint64_t budget = 2 * D + 3 * D + 3 * C;
    CHECK(budget < 8 * D);
    laden_cache_t *c;
    uint32_t id, n;
    CHECK_OK(laden_cache_create(budget, 0, &c));
    CHECK_OK(laden_cache_add(c, "coded", 0, &id));
    CHECK_OK(laden_cache_bind(c, id, sc, 1));
    laden_cache_evict_t ev[4];
    laden_cache_activation_t act;
    CHECK_OK(laden_cache_activate(c, id, LADEN_CACHE_AUTO, 2, 0, ev, 4, &n,
                                  &act));
    CHECK_EQ(act.mode, LADEN_CACHE_STREAMING);
    CHECK_EQ(act.resident_blocks, 1 + 3);
    CHECK_EQ(act.streamed_blocks, NB - 4);
    CHECK_EQ(act.slot_bytes, 3 * C);
    laden_sched_stats_t ss;
    CHECK_OK(laden_sched_stats(sc, &ss));
    CHECK(ss.device_bytes <= budget);
    uint16_t *got = malloc(2 * N);
    for (uint32_t b = 1; b < NB; b++) {
        laden_devptr_t p;
        uint64_t at;
        CHECK_OK(laden_sched_enter(sc, b, 0));
        if (laden_sched_is_resident(sc, b))
            CHECK_OK(laden_sched_tensor_ptr(sc, b, 0, &p));
        else
            CHECK_OK(laden_sched_expanded_at(sc, b, 0, &p, &at));
        memcpy(got, (const void *)(uintptr_t)p, 2 * N);
        CHECK(memcmp(got, v[b], 2 * N) == 0);
        CHECK_OK(laden_sched_exit(sc, b, 0));
    }
    CHECK_OK(laden_cache_deactivate(c, id, 0));
    CHECK_OK(laden_cache_unbind(c, id));
    laden_cache_destroy(c);
    laden_sched_destroy(sc);
    for (uint32_t b = 0; b < NB; b++)
        free(v[b]);
    free(got);
}
