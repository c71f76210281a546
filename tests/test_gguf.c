/* GGUF headers: a valid file read back field by field, from a path and
 * from memory; every kind of bad header refused with its named error;
 * every prefix and every one-byte change of a valid file refused or read,
 * never a crash (ASan). */
#define _GNU_SOURCE /* memmem */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "test.h"

#include "laden/gguf.h"
#include "laden/st.h"
#include "laden/stream.h"

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *v, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, v, n);
    b->n += n;
}

static void u32(buf *b, uint32_t v)
{
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16),
                    (uint8_t)(v >> 24)};
    put(b, x, 4);
}

static void u64(buf *b, uint64_t v)
{
    uint8_t x[8];
    for (int i = 0; i < 8; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    put(b, x, 8);
}

static void str(buf *b, const char *s)
{
    u64(b, strlen(s));
    put(b, s, strlen(s));
}

static void pad_to(buf *b, size_t align)
{
    static const uint8_t zero[64];
    while (b->n % align)
        put(b, zero, 1);
}

/* The knobs a bad file turns. */
typedef struct {
    uint32_t version, alignment, type1;
    uint64_t dim0, off1, off2;
    const char *name2;
    int dup_key;
} shape;

static const shape GOOD = {3, 64, 8, 64, 128, 320, "blk.0.ffn.weight", 0};

/* version, 4 metadata entries, 3 tensors: F32 [8, 4] at 0 (128 bytes),
 * type1 [dim0, 2] at off1 (Q8_0: 136 bytes), Q4_K [256] at off2 (144). */
static buf make(const shape *s)
{
    buf b = {0};
    put(&b, "GGUF", 4);
    u32(&b, s->version);
    u64(&b, 3);
    u64(&b, 4 + (uint64_t)s->dup_key);
    str(&b, "general.architecture");
    u32(&b, LADEN_GGUF_STRING);
    str(&b, "llama");
    str(&b, "general.alignment");
    u32(&b, LADEN_GGUF_U32);
    u32(&b, s->alignment);
    str(&b, "tokenizer.ggml.tokens");
    u32(&b, LADEN_GGUF_ARRAY);
    u32(&b, LADEN_GGUF_STRING);
    u64(&b, 3);
    str(&b, "a");
    str(&b, "bc");
    str(&b, "");
    str(&b, "llama.block_count");
    u32(&b, LADEN_GGUF_I32);
    u32(&b, (uint32_t)-7);
    if (s->dup_key) {
        str(&b, "llama.block_count");
        u32(&b, LADEN_GGUF_U8);
        put(&b, "\1", 1);
    }
    str(&b, "token_embd.weight");
    u32(&b, 2);
    u64(&b, 8);
    u64(&b, 4);
    u32(&b, 0);
    u64(&b, 0);
    str(&b, "blk.0.attn_q.weight");
    u32(&b, 2);
    u64(&b, s->dim0);
    u64(&b, 2);
    u32(&b, s->type1);
    u64(&b, s->off1);
    str(&b, s->name2);
    u32(&b, 1);
    u64(&b, 256);
    u32(&b, 12);
    u64(&b, s->off2);
    pad_to(&b, s->alignment && !(s->alignment & (s->alignment - 1))
                   ? s->alignment : 32);
    size_t data = b.n;
    while (b.n < data + 320 + 144)
        put(&b, "\x5a", 1);
    return b;
}

TEST(gguf_valid_file_read_back)
{
    buf b = make(&GOOD);
    char *path = test_path("m.gguf");
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(b.p, 1, b.n, f) == b.n);
    fclose(f);
    for (int from_file = 0; from_file < 2; from_file++) {
        laden_gguf_t *g;
        CHECK_OK(from_file ? laden_gguf_open(path, &g)
                           : laden_gguf_open_memory(b.p, b.n, &g));
        CHECK_EQ(laden_gguf_version(g), 3);
        CHECK_EQ(laden_gguf_alignment(g), 64);
        CHECK_EQ(laden_gguf_data_offset(g) % 64, 0);
        CHECK_EQ(laden_gguf_count(g), 3);
        CHECK_EQ(laden_gguf_metadata_count(g), 4);
        laden_gguf_kv_t kv;
        CHECK_OK(laden_gguf_metadata_find(g, "general.architecture", &kv));
        CHECK(kv.type == LADEN_GGUF_STRING && !strcmp(kv.str, "llama"));
        CHECK_OK(laden_gguf_metadata_find(g, "tokenizer.ggml.tokens", &kv));
        CHECK(kv.type == LADEN_GGUF_ARRAY &&
              kv.elem_type == LADEN_GGUF_STRING);
        CHECK_EQ(kv.count, 3);
        CHECK_OK(laden_gguf_metadata_find(g, "llama.block_count", &kv));
        CHECK_EQ(kv.i, -7);
        CHECK_STATUS(laden_gguf_metadata_find(g, "nope", &kv),
                     LADEN_E_NOTFOUND);
        size_t i;
        laden_gguf_tensor_t t;
        CHECK_OK(laden_gguf_find(g, "blk.0.attn_q.weight", &i));
        CHECK_OK(laden_gguf_tensor_at(g, i, &t));
        CHECK_EQ(t.type, 8);
        CHECK_EQ(t.ndim, 2);
        CHECK_EQ(t.dims[0], 64);
        CHECK_EQ(t.dims[1], 2);
        CHECK_EQ(t.size_bytes, 136);
        CHECK_EQ(t.offset_bytes, laden_gguf_data_offset(g) + 128);
        CHECK_OK(laden_gguf_find(g, "blk.0.ffn.weight", &i));
        CHECK_OK(laden_gguf_tensor_at(g, i, &t));
        CHECK_EQ(t.size_bytes, 144);
        CHECK_STATUS(laden_gguf_find(g, "blk.1", &i), LADEN_E_NOTFOUND);
        CHECK_STATUS(laden_gguf_tensor_at(g, 3, &t), LADEN_E_INVAL);
        laden_gguf_close(g);
    }
    uint32_t e, n;
    CHECK_OK(laden_gguf_type_block(12, &e, &n));
    CHECK(e == 256 && n == 144 && !strcmp(laden_gguf_type_name(12), "Q4_K"));
    CHECK(laden_gguf_type_name(4) == NULL);
    CHECK_STATUS(laden_gguf_type_block(4, &e, &n), LADEN_E_DTYPE);
    laden_gguf_t *g;
    CHECK_STATUS(laden_gguf_open(test_path("none.gguf"), &g), LADEN_E_NOENT);
    free(b.p);
}

static void bad(const shape *s, laden_status want, const char *says)
{
    buf b = make(s);
    laden_gguf_t *g = NULL;
    CHECK_STATUS(laden_gguf_open_memory(b.p, b.n, &g), want);
    CHECK(g == NULL);
    CHECK_CONTAINS(laden_last_error(), says);
    free(b.p);
}

TEST(gguf_bad_headers_named)
{
    shape s = GOOD;
    s.version = 1;
    bad(&s, LADEN_E_HEADER, "version 1");
    s = GOOD;
    s.alignment = 48;
    bad(&s, LADEN_E_SCHEMA, "power of two");
    s = GOOD;
    s.type1 = 4;
    bad(&s, LADEN_E_DTYPE, "ggml type 4");
    s = GOOD;
    s.dim0 = 48;
    bad(&s, LADEN_E_SHAPE, "multiple of its blocks of 32");
    s = GOOD;
    s.off1 = 130;
    bad(&s, LADEN_E_RANGE, "alignment");
    s = GOOD;
    s.off2 = 192;
    bad(&s, LADEN_E_RANGE, "overlaps");
    s = GOOD;
    s.off2 = 1 << 20;
    bad(&s, LADEN_E_TRUNCATED, "ends at byte");
    s = GOOD;
    s.name2 = "blk.0.attn_q.weight";
    bad(&s, LADEN_E_NAME, "two tensors");
    s = GOOD;
    s.dup_key = 1;
    bad(&s, LADEN_E_SCHEMA, "appears twice");
    buf b = make(&GOOD);
    memcpy(b.p, "GGUG", 4);
    laden_gguf_t *g;
    CHECK_STATUS(laden_gguf_open_memory(b.p, b.n, &g), LADEN_E_HEADER);
    memcpy(b.p, "GGUF", 4);
    /* Counts a file cannot hold: refused before allocating for them. */
    uint8_t huge[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0};
    memcpy(b.p + 8, huge, 8);
    CHECK(laden_gguf_open_memory(b.p, b.n, &g) != LADEN_OK);
    free(b.p);
}

/* Names, keys and string values that are not UTF-8 are refused naming
 * the file, which string, and the offset of the first bad byte: Python
 * would have raised a bare UnicodeDecodeError decoding them. */
TEST(gguf_strings_not_utf8_named)
{
    static const char *const names[] = {
        "blk.\xff.w",        /* not a first byte */
        "blk.\xc3(.w",       /* a continuation missing */
        "blk.\xc0\xaf.w",    /* overlong */
        "blk.\xed\xa0\x80.w", /* a surrogate */
        "blk.\xf4\x90\x80\x80", /* above U+10FFFF */
        "blk.\xe2\x82",      /* cut at the end */
    };
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        shape s = GOOD;
        s.name2 = names[k];
        buf b = make(&s);
        laden_gguf_t *g = NULL;
        CHECK_STATUS(laden_gguf_open_memory(b.p, b.n, &g), LADEN_E_SCHEMA);
        CHECK(g == NULL);
        CHECK_CONTAINS(laden_last_error(), "GGUF in memory: tensor 2's name "
                                           "is not valid UTF-8 (byte 4 of it");
        uint8_t *at = memmem(b.p, b.n, names[k], strlen(names[k]));
        char want[64];
        snprintf(want, sizeof want, "at offset %zu of the file",
                 (size_t)(at - b.p) + 4);
        CHECK_CONTAINS(laden_last_error(), want);
        /* From a file too: the file named. */
        char *p = test_path("bad_name.gguf");
        test_write_file(p, b.p, b.n);
        CHECK_STATUS(laden_gguf_open(p, &g), LADEN_E_SCHEMA);
        CHECK_CONTAINS(laden_last_error(), p);
        laden_st_t *st = NULL;
        CHECK_STATUS(laden_st_open(p, &st), LADEN_E_SCHEMA);
        CHECK(st == NULL);
        CHECK_CONTAINS(laden_last_error(), "tensor 2's name");
        free(b.p);
    }
    /* A valid multi-byte name is read as it is. */
    shape s = GOOD;
    s.name2 = "blk.\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80.w";
    buf b = make(&s);
    laden_gguf_t *g;
    size_t i;
    CHECK_OK(laden_gguf_open_memory(b.p, b.n, &g));
    CHECK_OK(laden_gguf_find(g, s.name2, &i));
    CHECK_EQ(i, 2);
    laden_gguf_close(g);
    /* A key (entry 2) and a string value (entry 0's). */
    uint8_t *key = memmem(b.p, b.n, "tokenizer.ggml.tokens", 21);
    key[3] = 0x80;
    CHECK_STATUS(laden_gguf_open_memory(b.p, b.n, &g), LADEN_E_SCHEMA);
    CHECK_CONTAINS(laden_last_error(), "metadata key 2 is not valid UTF-8 "
                                       "(byte 3 of it");
    key[3] = 'e';
    uint8_t *val = memmem(b.p, b.n, "llama", 5);
    val[4] = 0xe0;
    CHECK_STATUS(laden_gguf_open_memory(b.p, b.n, &g), LADEN_E_SCHEMA);
    CHECK_CONTAINS(laden_last_error(), "the string of metadata "
                                       "'general.architecture' (entry 0) is "
                                       "not valid UTF-8 (byte 4 of it");
    val[4] = 'a';
    CHECK_OK(laden_gguf_open_memory(b.p, b.n, &g));
    laden_gguf_close(g);
    free(b.p);
}

TEST(gguf_every_prefix_and_byte_change)
{
    buf b = make(&GOOD);
    laden_gguf_t *g;
    size_t header = 0;
    CHECK_OK(laden_gguf_open_memory(b.p, b.n, &g));
    header = (size_t)laden_gguf_data_offset(g);
    laden_gguf_close(g);
    for (size_t n = 0; n < b.n; n++) { /* every prefix: refused */
        laden_status s = laden_gguf_open_memory(b.p, n, &g);
        if (s == LADEN_OK) {
            fprintf(stderr, "prefix of %zu bytes read\n", n);
            exit(1);
        }
    }
    uint8_t *m = malloc(b.n);
    for (size_t i = 0; i < header; i++) /* every byte of the header */
        for (int v = 0; v < 3; v++) {
            memcpy(m, b.p, b.n);
            m[i] ^= (uint8_t)(v == 0 ? 0x01 : v == 1 ? 0x80 : 0xff);
            if (laden_gguf_open_memory(m, b.n, &g) == LADEN_OK) {
                for (size_t k = 0; k < laden_gguf_count(g); k++) {
                    laden_gguf_tensor_t t;
                    CHECK_OK(laden_gguf_tensor_at(g, k, &t));
                    CHECK(t.offset_bytes + t.size_bytes <= b.n);
                }
                laden_gguf_close(g);
            }
        }
    free(m);
    free(b.p);
}

/* CPU expansion of block types (bit-exact against the gguf package in
 * python/tests/test_gguf.py): hand-made blocks here. */
TEST(gguf_dequantize_blocks)
{
    uint8_t q8[34] = {0x00, 0x38}; /* d = 0.5 */
    for (int e = 0; e < 32; e++)
        q8[2 + e] = (uint8_t)(int8_t)(e - 16);
    float y[32];
    CHECK_OK(laden_gguf_dequantize(8, q8, sizeof q8, y, 32));
    for (int e = 0; e < 32; e++)
        CHECK_FEQ(y[e], 0.5f * (float)(e - 16));
    uint8_t q41[20] = {0x00, 0x40, 0x00, 0xbc}; /* d = 2, m = -1 */
    for (int j = 0; j < 16; j++)
        q41[4 + j] = (uint8_t)(j | (15 - j) << 4);
    CHECK_OK(laden_gguf_dequantize(3, q41, sizeof q41, y, 32));
    for (int j = 0; j < 16; j++) {
        CHECK_FEQ(y[j], 2.0f * (float)j - 1.0f);
        CHECK_FEQ(y[16 + j], 2.0f * (float)(15 - j) - 1.0f);
    }
    uint8_t k[66] = {0};
    float y256[256];
    CHECK_STATUS(laden_gguf_dequantize(16, k, sizeof k, y256, 256),
                 LADEN_E_UNSUPPORTED);
    CHECK_CONTAINS(laden_last_error(), "IQ2_XXS");
    CHECK_STATUS(laden_gguf_dequantize(8, q8, 33, y, 32), LADEN_E_INVAL);
    CHECK_STATUS(laden_gguf_dequantize(8, q8, 34, y, 31), LADEN_E_INVAL);
    CHECK_STATUS(laden_gguf_dequantize(4, q8, 34, y, 32), LADEN_E_DTYPE);
}

/* A GGUF file opened as a checkpoint (laden_st_open): its table in
 * row-major shapes and laden dtypes, scalar metadata as strings; a
 * schedule keeps a Q8_0 tensor as stored, converts it to F32 on load, and
 * puts a Llama q projection's rows back in transformers' order; the disk
 * tier refuses reordered rows; an unsupported type names the tensor. */
TEST(gguf_as_checkpoint_loaded)
{
    enum { ROWS = 8, COLS = 32, RB = 34 }; /* Q8_0: one block per row */
    buf b = {0};
    put(&b, "GGUF", 4);
    u32(&b, 3);
    u64(&b, 2);
    u64(&b, 2);
    str(&b, "general.architecture");
    u32(&b, LADEN_GGUF_STRING);
    str(&b, "llama");
    str(&b, "llama.attention.head_count");
    u32(&b, LADEN_GGUF_U32);
    u32(&b, 2);
    str(&b, "blk.0.attn_q.weight");
    u32(&b, 2);
    u64(&b, COLS);
    u64(&b, ROWS);
    u32(&b, 8); /* Q8_0 */
    u64(&b, 0);
    str(&b, "output_norm.weight");
    u32(&b, 1);
    u64(&b, 4);
    u32(&b, 1); /* F16 */
    u64(&b, 288);
    pad_to(&b, 32);
    size_t data = b.n;
    uint8_t rows[ROWS][RB];
    for (int r = 0; r < ROWS; r++) {
        rows[r][0] = 0x00;
        rows[r][1] = (uint8_t)(0x30 + r); /* d: a finite f16 per row */
        for (int k = 0; k < 32; k++)
            rows[r][2 + k] = (uint8_t)(r * 16 + k - 64);
    }
    put(&b, rows, sizeof rows);
    pad_to(&b, 32);
    CHECK_EQ(b.n - data, 288);
    static const uint16_t ones[4] = {0x3c00, 0x3c00, 0x3c00, 0x3c00};
    put(&b, ones, sizeof ones);
    char *p = test_path("q.gguf");
    test_write_file(p, b.p, b.n);

    laden_st_t *st;
    CHECK_OK(laden_st_open(p, &st));
    CHECK_EQ(laden_st_count(st), 2);
    CHECK(strcmp(laden_st_format(st), "gguf") == 0);
    CHECK_EQ(laden_st_format(NULL), NULL);
    laden_st_tensor_t t;
    size_t qi, ni;
    CHECK_OK(laden_st_find(st, "blk.0.attn_q.weight", &qi));
    CHECK_OK(laden_st_find(st, "output_norm.weight", &ni));
    CHECK_OK(laden_st_tensor_at(st, qi, &t));
    CHECK(t.dtype == LADEN_DTYPE_Q8_0 && t.ndim == 2 && t.shape[0] == ROWS &&
          t.shape[1] == COLS && t.size_bytes == sizeof rows &&
          t.offset_bytes == data);
    CHECK_OK(laden_st_tensor_at(st, ni, &t));
    CHECK(t.dtype == LADEN_DTYPE_F16 && t.ndim == 1 && t.shape[0] == 4);
    CHECK_EQ(laden_st_metadata_count(st), 2);
    const char *k, *v;
    CHECK_OK(laden_st_metadata_at(st, 1, &k, &v));
    CHECK(!strcmp(k, "llama.attention.head_count") && !strcmp(v, "2"));

    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_sched_t *sc;
    uint32_t blk, i_raw, i_rope, i_f32, i_norm;
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &blk));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, qi, LADEN_DTYPE_Q8_0,
                                    &i_raw));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, qi, LADEN_DTYPE_Q8_0,
                                    &i_rope));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, qi, LADEN_DTYPE_F32,
                                    &i_f32));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, ni, LADEN_DTYPE_BF16,
                                    &i_norm));
    CHECK_STATUS(laden_sched_set_rope_rows(sc, blk, i_rope, 3),
                 LADEN_E_SHAPE);
    CHECK_OK(laden_sched_set_rope_rows(sc, blk, i_rope, 2));
    CHECK_OK(laden_sched_set_rope_rows(sc, blk, i_f32, 2));
    uint32_t i_bad;
    CHECK_STATUS(laden_sched_add_tensor(sc, blk, st, qi, LADEN_DTYPE_I8,
                                        &i_bad),
                 LADEN_E_UNSUPPORTED);
    CHECK_OK(laden_sched_load(sc));
    void *hp;
    CHECK_OK(laden_sched_host_ptr(sc, blk, i_raw, &hp));
    CHECK(memcmp(hp, rows, sizeof rows) == 0);
    /* Head h's rows 0..3 come from its rows 0, 2, 1, 3. */
    static const int from[ROWS] = {0, 2, 1, 3, 4, 6, 5, 7};
    uint8_t want[ROWS][RB];
    for (int r = 0; r < ROWS; r++)
        memcpy(want[r], rows[from[r]], RB);
    CHECK_OK(laden_sched_host_ptr(sc, blk, i_rope, &hp));
    CHECK(memcmp(hp, want, sizeof want) == 0);
    float wantf[ROWS * COLS];
    CHECK_OK(laden_gguf_dequantize(8, want, sizeof want, wantf, ROWS * COLS));
    CHECK_OK(laden_sched_host_ptr(sc, blk, i_f32, &hp));
    CHECK(memcmp(hp, wantf, sizeof wantf) == 0);
    CHECK_OK(laden_sched_host_ptr(sc, blk, i_norm, &hp));
    CHECK(((uint16_t *)hp)[3] == 0x3f80); /* 1.0 in bf16 */
    laden_sched_destroy(sc);

    /* The disk tier reads the file as it is. */
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_DISK, &blk));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, qi, LADEN_DTYPE_Q8_0,
                                    &i_raw));
    CHECK_STATUS(laden_sched_set_rope_rows(sc, blk, i_raw, 2),
                 LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "reordered") != NULL);
    laden_sched_destroy(sc);
    /* A block left to the planner, which put it on the disk, is planned
     * again instead: only one asked for the disk is refused. */
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_AUTO, &blk));
    CHECK_OK(laden_sched_add_tensor(sc, blk, st, qi, LADEN_DTYPE_Q8_0,
                                    &i_raw));
    laden_plan_input in = {0};
    in.ram_total_bytes = in.ram_free_bytes = 1ull << 40;
    in.resident_blocks = 0; /* and no RAM tier: the disk */
    CHECK_OK(laden_sched_plan(sc, &in, NULL, NULL));
    CHECK_EQ(laden_sched_block_tier(sc, blk), LADEN_TIER_DISK);
    CHECK_OK(laden_sched_set_rope_rows(sc, blk, i_raw, 2));
    CHECK_EQ(laden_sched_block_tier(sc, blk), LADEN_TIER_AUTO);
    laden_sched_destroy(sc);
    laden_st_close(st);

    /* A type laden does not hold (IQ4_NL: 18 bytes a block of 32, so the
     * data still fits) names the tensor. */
    const char *nm = "blk.0.attn_q.weight";
    uint8_t *at = memmem(b.p, data, nm, strlen(nm));
    CHECK(at != NULL);
    at += strlen(nm) + 4 + 8 + 8;
    at[0] = 20;
    test_write_file(p, b.p, b.n);
    st = NULL;
    CHECK_STATUS(laden_st_open(p, &st), LADEN_E_UNSUPPORTED);
    CHECK(st == NULL && strstr(laden_last_error(), nm) &&
          strstr(laden_last_error(), "IQ4_NL"));
    free(b.p);
}

/* A GGUF file of n F32 tensors of one element, "blk.<i>.w" at i * 32;
 * its path (test_path's). */
static char *wide_gguf(uint32_t n)
{
    buf b = {0};
    char name[32];
    put(&b, "GGUF", 4);
    u32(&b, 3);
    u64(&b, n);
    u64(&b, 1);
    str(&b, "general.architecture");
    u32(&b, LADEN_GGUF_STRING);
    str(&b, "llama");
    for (uint32_t i = 0; i < n; i++) {
        snprintf(name, sizeof name, "blk.%u.w", i);
        str(&b, name);
        u32(&b, 1);
        u64(&b, 1);
        u32(&b, 0);
        u64(&b, (uint64_t)i * 32);
    }
    pad_to(&b, 32);
    uint8_t zero[32] = {0};
    for (uint32_t i = 0; i < n; i++)
        put(&b, zero, 32);
    snprintf(name, sizeof name, "wide%u.gguf", n);
    char *p = test_path(name);
    test_write_file(p, b.p, b.n);
    free(b.p);
    return p;
}

/* CPU seconds (this thread: another process's load does not count) that
 * `laden plan` takes in C for file p: opened, each tensor its own AUTO
 * block, planned; its blocks checked planned. */
static double describe_and_plan(const char *p, uint32_t n)
{
    struct timespec t0, t1;
    laden_st_t *st;
    laden_sched_t *sc;
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_plan_input in = {0};
    in.ram_total_bytes = in.ram_free_bytes = 1ull << 40;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    CHECK_OK(laden_st_open(p, &st));
    CHECK_EQ(laden_st_count(st), n);
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    for (uint32_t i = 0; i < n; i++) {
        uint32_t blk, ti;
        CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_AUTO, &blk));
        CHECK_OK(laden_sched_add_tensor(sc, blk, st, i, LADEN_DTYPE_F32,
                                        &ti));
    }
    CHECK_OK(laden_sched_plan(sc, &in, NULL, NULL));
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    CHECK(laden_sched_block_tier(sc, 0) != LADEN_TIER_AUTO);
    CHECK(laden_sched_block_tier(sc, n - 1) != LADEN_TIER_AUTO);
    laden_sched_destroy(sc);
    laden_st_close(st);
    return (double)(t1.tv_sec - t0.tv_sec) +
           (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
}

/* `laden plan` on a wide GGUF table grew as the square of its tensors
 * (each block or tensor added walked every block to unplan it: 131072
 * tensors took 84 s).  A table 16 times larger must cost less than 64
 * times as much (linear: 16, the square: 256); the fastest of a few runs
 * of each, in CPU time, so that a loaded machine does not fail it. */
TEST(gguf_wide_table_planned_in_linear_time)
{
    enum { SMALL = 2048, LARGE = SMALL * 16 };
    char *ps = wide_gguf(SMALL), *pl = wide_gguf(LARGE);
    double small = 1e9, large = 1e9;
    for (int k = 0; k < 3; k++) {
        double t = describe_and_plan(ps, SMALL);
        small = t < small ? t : small;
    }
    if (small < 1e-4)
        small = 1e-4; /* a clock too coarse for it */
    for (int k = 0; k < 3 && large >= 64 * small; k++) {
        double t = describe_and_plan(pl, LARGE);
        large = t < large ? t : large;
    }
    if (large >= 64 * small)
        fprintf(stderr, "  %u tensors: %.4f s, %u: %.4f s (%.0fx)\n", SMALL,
                small, LARGE, large, large / small);
    CHECK(large < 64 * small);
}

/* A tensor or block added after a plan makes the planned blocks AUTO
 * again (laden__sched_unplan skips its walk until something is planned). */
TEST(gguf_added_after_plan_is_planned_again)
{
    char *p = wide_gguf(3);
    laden_st_t *st;
    laden_sched_t *sc;
    laden_sched_config cfg = {.device = LADEN_DEVICE_CPU};
    laden_plan_input in = {0};
    in.ram_total_bytes = in.ram_free_bytes = 1ull << 40;
    in.ram_budget_bytes = 1ull << 30;
    uint32_t b0, b1, b2, ti;
    CHECK_OK(laden_st_open(p, &st));
    CHECK_OK(laden_sched_create(&cfg, st, &sc));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_AUTO, &b0));
    CHECK_OK(laden_sched_add_tensor(sc, b0, st, 0, LADEN_DTYPE_F32, &ti));
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_RAM, &b1));
    CHECK_OK(laden_sched_plan(sc, &in, NULL, NULL));
    CHECK(laden_sched_block_tier(sc, b0) != LADEN_TIER_AUTO);
    CHECK_OK(laden_sched_add_tensor(sc, b1, st, 1, LADEN_DTYPE_F32, &ti));
    CHECK_EQ(laden_sched_block_tier(sc, b0), LADEN_TIER_AUTO);
    CHECK_EQ(laden_sched_block_tier(sc, b1), LADEN_TIER_RAM);
    CHECK_OK(laden_sched_plan(sc, &in, NULL, NULL));
    CHECK(laden_sched_block_tier(sc, b0) != LADEN_TIER_AUTO);
    CHECK_OK(laden_sched_add_block(sc, LADEN_TIER_AUTO, &b2));
    CHECK_EQ(laden_sched_block_tier(sc, b0), LADEN_TIER_AUTO);
    CHECK_EQ(laden_sched_block_tier(sc, b2), LADEN_TIER_AUTO);
    CHECK_OK(laden_sched_plan(sc, &in, NULL, NULL));
    CHECK(laden_sched_block_tier(sc, b0) != LADEN_TIER_AUTO &&
          laden_sched_block_tier(sc, b2) != LADEN_TIER_AUTO);
    laden_sched_destroy(sc);
    laden_st_close(st);
}

/* A GGUF of metadata alone: architecture "llama", then `n` entries of
 * u32 values or one f32, as `keys`/`vals` say (val < 0: f32 NaN). */
static laden_status model_check(const char *arch, int n,
                                const char *const *keys, const int64_t *vals)
{
    buf b = {0};
    put(&b, "GGUF", 4);
    u32(&b, 3);
    u64(&b, 0);
    u64(&b, 1 + (uint64_t)n);
    str(&b, "general.architecture");
    u32(&b, LADEN_GGUF_STRING);
    str(&b, arch);
    for (int k = 0; k < n; k++) {
        str(&b, keys[k]);
        if (vals[k] < 0) {
            float nan = 0.0f / 0.0f;
            u32(&b, LADEN_GGUF_F32);
            put(&b, &nan, 4);
        } else {
            u32(&b, LADEN_GGUF_U32);
            u32(&b, (uint32_t)vals[k]);
        }
    }
    laden_gguf_t *g;
    CHECK_OK(laden_gguf_open_memory(b.p, b.n, &g));
    laden_status s = laden_gguf_check_model(g, "m.gguf");
    laden_gguf_close(g);
    free(b.p);
    return s;
}

/* The metadata a config is built from: each bad value refused naming the
 * file, the key, the value and what laden needs. */
TEST(gguf_check_model_names_the_key)
{
    static const char *const k[] = {"llama.block_count",
                                    "llama.attention.head_count",
                                    "llama.attention.head_count_kv",
                                    "llama.embedding_length"};
    const int64_t good[] = {1, 8, 2, 64};
    CHECK_OK(model_check("llama", 4, k, good));
    const int64_t kv3[] = {1, 8, 3, 64};
    CHECK_EQ(model_check("llama", 4, k, kv3), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "m.gguf: GGUF metadata "
                                     "'llama.attention.head_count_kv' is 3"));
    CHECK(strstr(laden_last_error(), "does not divide"));
    const int64_t zero[] = {1, 0, 2, 64};
    CHECK_EQ(model_check("llama", 4, k, zero), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "'llama.attention.head_count' is 0: "
                                     "laden needs an integer from 1"));
    const int64_t blocks[] = {2, 8, 2, 64}; /* more blocks than tensors */
    CHECK_EQ(model_check("llama", 4, k, blocks), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "integer from 1 to 1"));
    const int64_t wide[] = {1, 128, 2, 64};
    CHECK_EQ(model_check("llama", 4, k, wide), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "more heads than"));
    static const char *const f[] = {"llama.rope.freq_base"};
    const int64_t nan[] = {-1};
    CHECK_EQ(model_check("llama", 1, f, nan), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "finite float above 0"));
    static const char *const ex[] = {"llama.expert_count",
                                     "llama.expert_used_count"};
    const int64_t used[] = {2, 4};
    CHECK_EQ(model_check("llama", 2, ex, used), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "more than llama.expert_count (2)"));
    char longname[80];
    memset(longname, 'a', 70);
    longname[70] = '\0';
    CHECK_EQ(model_check(longname, 0, k, good), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "at most 64"));
    CHECK_EQ(model_check("", 0, k, good), LADEN_E_SCHEMA);
    CHECK(strstr(laden_last_error(), "'general.architecture' is ''"));
    CHECK_EQ(laden_gguf_check_model(NULL, "x"), LADEN_E_INVAL);
}
