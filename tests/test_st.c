#define _DEFAULT_SOURCE /* alarm */
#define _POSIX_C_SOURCE 200809L /* utimensat */
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"

#include "laden/io.h"
#include "laden/st.h"
#include "st/json.h"

static laden_st_t *open_ok(const char *path)
{
    laden_st_t *st = NULL;
    CHECK_OK(laden_st_open(path, &st));
    CHECK(st != NULL);
    return st;
}

TEST(st_single_file_table)
{
    /* Header order differs from file order; metadata; padding spaces. */
    const char *hdr =
        "{\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[16,28]},"
        "\"__metadata__\":{\"format\":\"pt\",\"note\":\"h\\u00e9\"},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
        "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[28,36]},"
        "\"z\":{\"dtype\":\"U8\",\"shape\":[0,5],\"data_offsets\":[36,36]}}   ";
    unsigned char data[36];
    for (int i = 0; i < 36; i++)
        data[i] = (unsigned char)i;
    char *p = test_path("one.safetensors");
    test_write_st(p, hdr, data, sizeof data);
    laden_st_t *st = open_ok(p);
    CHECK_EQ(laden_st_count(st), 4);
    CHECK_EQ(laden_st_file_count(st), 1);
    CHECK_EQ(strcmp(laden_st_file_path(st, 0), p), 0);
    CHECK_EQ(laden_st_total_bytes(st), 36);
    laden_st_tensor_t t;
    const char *order[] = {"a", "b", "s", "z"};
    uint64_t base = 8 + strlen(hdr);
    for (size_t i = 0; i < 4; i++) {
        CHECK_OK(laden_st_tensor_at(st, i, &t));
        CHECK_EQ(strcmp(t.name, order[i]), 0);
        size_t idx;
        CHECK_OK(laden_st_find(st, order[i], &idx));
        CHECK_EQ(idx, i);
    }
    CHECK_OK(laden_st_tensor_at(st, 1, &t));
    CHECK(t.dtype == LADEN_DTYPE_BF16 && t.ndim == 2 && t.shape[0] == 2 &&
          t.shape[1] == 3 && t.size_bytes == 12 && t.offset_bytes == base + 16);
    CHECK_OK(laden_st_tensor_at(st, 2, &t));
    CHECK(t.ndim == 0 && t.size_bytes == 8);
    size_t idx;
    CHECK_STATUS(laden_st_find(st, "nope", &idx), LADEN_E_NOTFOUND);
    CHECK_CONTAINS(laden_last_error(), "nope");
    CHECK_STATUS(laden_st_tensor_at(st, 4, &t), LADEN_E_INVAL);
    CHECK_EQ(laden_st_metadata_count(st), 2);
    CHECK(strcmp(laden_st_format(st), "safetensors") == 0);
    const char *k, *v;
    CHECK_OK(laden_st_metadata_at(st, 1, &k, &v));
    CHECK(strcmp(k, "note") == 0 && strcmp(v, "h\xc3\xa9") == 0);
    laden_st_close(st);
    laden_st_close(NULL);
}

TEST(st_every_dtype)
{
    static const struct {
        const char *name;
        uint32_t bits;
    } want[] = {{"BOOL", 8},     {"U8", 8},         {"I8", 8},
                {"F8_E5M2", 8},  {"F8_E4M3", 8},    {"F8_E8M0", 8},
                {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"I16", 16},
                {"U16", 16},     {"F16", 16},       {"BF16", 16},
                {"I32", 32},     {"U32", 32},       {"F32", 32},
                {"C64", 64},     {"F64", 64},       {"I64", 64},
                {"U64", 64},     {"F4", 4},         {"F6_E2M3", 6},
                {"F6_E3M2", 6}};
    const size_t nst = sizeof want / sizeof want[0];
    CHECK_EQ(LADEN_DTYPE_Q4_0, nst); /* GGUF's block types follow */
    char hdr[8192] = "{";
    uint64_t off = 0;
    for (size_t i = 0; i < nst; i++) {
        CHECK_EQ(strcmp(laden_dtype_name((laden_dtype)i), want[i].name), 0);
        CHECK_EQ(laden_dtype_bits((laden_dtype)i), want[i].bits);
        uint64_t bytes = 8 * want[i].bits / 8; /* 8 elements */
        char e[256];
        snprintf(e, sizeof e,
                 "%s\"t_%s\":{\"dtype\":\"%s\",\"shape\":[2,4],"
                 "\"data_offsets\":[%llu,%llu]}",
                 i ? "," : "", want[i].name, want[i].name,
                 (unsigned long long)off, (unsigned long long)(off + bytes));
        strcat(hdr, e);
        off += bytes;
    }
    strcat(hdr, "}");
    char *data = calloc(1, off);
    char *p = test_path("dtypes.safetensors");
    test_write_st(p, hdr, data, off);
    laden_st_t *st = open_ok(p);
    CHECK_EQ(laden_st_count(st), nst);
    for (size_t i = 0; i < nst; i++) {
        laden_st_tensor_t t;
        CHECK_OK(laden_st_tensor_at(st, i, &t));
        CHECK_EQ(t.dtype, (laden_dtype)i);
    }
    /* Block types: no bits per element, blocks from GGUF's table, never
     * accepted from a safetensors header. */
    static const struct {
        laden_dtype d;
        const char *name;
        uint32_t elems, bytes, ggml;
    } blk[] = {{LADEN_DTYPE_Q4_0, "Q4_0", 32, 18, 2},
               {LADEN_DTYPE_Q8_0, "Q8_0", 32, 34, 8},
               {LADEN_DTYPE_Q4_K, "Q4_K", 256, 144, 12},
               {LADEN_DTYPE_Q6_K, "Q6_K", 256, 210, 14}};
    for (size_t i = 0; i < sizeof blk / sizeof blk[0]; i++) {
        uint32_t e, by;
        laden_dtype d;
        CHECK_EQ(strcmp(laden_dtype_name(blk[i].d), blk[i].name), 0);
        CHECK_EQ(laden_dtype_bits(blk[i].d), 0);
        CHECK_OK(laden_dtype_block(blk[i].d, &e, &by));
        CHECK(e == blk[i].elems && by == blk[i].bytes);
        CHECK_EQ(laden_ggml_of_dtype(blk[i].d), blk[i].ggml);
        CHECK_OK(laden_dtype_of_ggml(blk[i].ggml, &d));
        CHECK_EQ(d, blk[i].d);
    }
    uint32_t e, by;
    CHECK_OK(laden_dtype_block(LADEN_DTYPE_BF16, &e, &by));
    CHECK(e == 1 && by == 2);
    CHECK_OK(laden_dtype_block(LADEN_DTYPE_F4, &e, &by));
    CHECK(e == 8 && by == 4);
    laden_dtype d;
    CHECK_STATUS(laden_dtype_of_ggml(9 /* Q8_1 */, &d), LADEN_E_UNSUPPORTED);
    CHECK(strstr(laden_last_error(), "Q8_1") != NULL);
    CHECK_EQ(laden_ggml_of_dtype(LADEN_DTYPE_U8), UINT32_MAX);
    CHECK_STATUS(laden_dtype_block(LADEN_DTYPE_COUNT, &e, &by),
                 LADEN_E_DTYPE);
    const char *q = "{\"w\":{\"dtype\":\"Q4_K\",\"shape\":[256],"
                    "\"data_offsets\":[0,144]}}";
    char zeros[144] = {0};
    char *qp = test_path("q4k.safetensors");
    test_write_st(qp, q, zeros, sizeof zeros);
    laden_st_t *bad = NULL;
    CHECK(laden_st_open(qp, &bad) != LADEN_OK && bad == NULL);

    CHECK_EQ(laden_dtype_name(LADEN_DTYPE_COUNT), NULL);
    CHECK_EQ(laden_dtype_bits(LADEN_DTYPE_COUNT), 0);
    laden_st_close(st);
    free(data);
}

TEST(st_empty_and_unicode)
{
    char *p = test_path("empty.safetensors");
    test_write_st(p, "{}", NULL, 0);
    laden_st_t *st = open_ok(p);
    CHECK(laden_st_count(st) == 0 && laden_st_total_bytes(st) == 0);
    laden_st_close(st);

    /* Escapes and raw UTF-8 in names; unknown fields are ignored. */
    const char *hdr =
        "{\"\\ud83d\\ude00.w\":{\"dtype\":\"U8\",\"shape\":[1],"
        "\"data_offsets\":[0,1],\"extra\":{\"x\":[1,2.5e3,true,null]}},"
        "\"\xe6\x97\xa5.w\":{\"shape\":[1],\"data_offsets\":[1,2],"
        "\"dtype\":\"I8\"}}";
    p = test_path("uni.safetensors");
    test_write_st(p, hdr, "ab", 2);
    st = open_ok(p);
    size_t idx;
    CHECK_OK(laden_st_find(st, "\xf0\x9f\x98\x80.w", &idx));
    CHECK_EQ(idx, 0);
    CHECK_OK(laden_st_find(st, "\xe6\x97\xa5.w", &idx));
    CHECK_EQ(idx, 1);
    laden_st_close(st);
}

TEST(st_open_memory_matches_file)
{
    const char *hdr =
        "{\"w\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,6]}}";
    size_t n = 8 + strlen(hdr) + 6;
    unsigned char *buf = calloc(1, n);
    uint64_t hl = strlen(hdr);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(hl >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    laden_st_t *st = NULL;
    CHECK_OK(laden_st_open_memory(buf, n, &st));
    CHECK_EQ(laden_st_count(st), 1);
    CHECK(strcmp(laden_st_file_path(st, 0), "<memory>") == 0);
    laden_st_close(st);
    CHECK_STATUS(laden_st_open_memory(buf, n - 1, &st), LADEN_E_TRUNCATED);
    CHECK_EQ(st, NULL);
    CHECK_STATUS(laden_st_open_memory(NULL, 5, &st), LADEN_E_INVAL);
    CHECK_STATUS(laden_st_open_memory(buf, n, NULL), LADEN_E_INVAL);
    free(buf);
}

/* Every file in tests/data/bad produces the status EXPECTED names, with a
 * message, from a file and from memory alike. */
TEST(st_bad_corpus)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/bad/EXPECTED", LADEN_SOURCE_DIR);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        char file[256], want[64];
        if (line[0] == '#' || sscanf(line, "%255s %63s", file, want) != 2)
            continue;
        snprintf(path, sizeof path, "%s/tests/data/bad/%s", LADEN_SOURCE_DIR,
                 file);
        laden_st_t *st = (laden_st_t *)1;
        int s = laden_st_open(path, &st);
        if (strcmp(laden_status_name(s), want) != 0 || st != NULL ||
            !laden_last_error()[0]) {
            fprintf(stderr, "%s: got %s (%s), expected %s\n", file,
                    laden_status_name(s), laden_last_error(), want);
            exit(1);
        }
        CHECK_CONTAINS(laden_last_error(), file); /* names the file */
        /* The same bytes from memory give the same status. */
        FILE *g = fopen(path, "rb");
        CHECK(g);
        static unsigned char buf[1 << 16];
        size_t len = fread(buf, 1, sizeof buf, g);
        fclose(g);
        s = laden_st_open_memory(buf, len, &st);
        if (strcmp(laden_status_name(s), want) != 0) {
            fprintf(stderr, "%s from memory: got %s (%s), expected %s\n",
                    file, laden_status_name(s), laden_last_error(), want);
            exit(1);
        }
        n++;
    }
    fclose(f);
    CHECK(n >= 20);
}

TEST(st_error_messages_name_the_tensor)
{
    char *p = test_path("m.safetensors");
    test_write_st(p,
                  "{\"layers.3.w\":{\"dtype\":\"F32\",\"shape\":[3],"
                  "\"data_offsets\":[0,8]}}",
                  "12345678", 8);
    laden_st_t *st;
    CHECK_STATUS(laden_st_open(p, &st), LADEN_E_SHAPE);
    CHECK_CONTAINS(laden_last_error(), "layers.3.w");
    CHECK_CONTAINS(laden_last_error(), "12 bytes");
    CHECK_STATUS(laden_st_open(test_path("missing.safetensors"), &st),
                 LADEN_E_NOENT);
    CHECK_CONTAINS(laden_last_error(), "missing.safetensors");
    CHECK_STATUS(laden_st_open("", &st), LADEN_E_INVAL);
    CHECK_STATUS(laden_st_open(p, NULL), LADEN_E_INVAL);
}

static void write_shard(const char *name, const char *tensor, uint64_t nbytes,
                        unsigned char fill)
{
    char hdr[256];
    snprintf(hdr, sizeof hdr,
             "{\"%s\":{\"dtype\":\"U8\",\"shape\":[%llu],"
             "\"data_offsets\":[0,%llu]}}",
             tensor, (unsigned long long)nbytes, (unsigned long long)nbytes);
    unsigned char *d = malloc(nbytes);
    memset(d, fill, nbytes);
    test_write_st(test_path(name), hdr, d, nbytes);
    free(d);
}

static void write_index(const char *name, const char *map)
{
    char buf[1024];
    snprintf(buf, sizeof buf,
             "{\"metadata\": {\"total_size\": 30}, \"weight_map\": {%s}}", map);
    test_write_file(test_path(name), buf, strlen(buf));
}

TEST(st_sharded_index)
{
    write_shard("m-00001-of-00002.safetensors", "a", 10, 1);
    write_shard("m-00002-of-00002.safetensors", "b", 20, 2);
    write_index("m.safetensors.index.json",
                "\"b\": \"m-00002-of-00002.safetensors\", "
                "\"a\": \"m-00001-of-00002.safetensors\"");
    laden_st_t *st = open_ok(test_path("m.safetensors.index.json"));
    CHECK(laden_st_count(st) == 2 && laden_st_file_count(st) == 2);
    CHECK_EQ(laden_st_total_bytes(st), 30);
    /* Shards in first-use order of the weight map. */
    CHECK_CONTAINS(laden_st_file_path(st, 0), "m-00002-of-00002");
    laden_st_tensor_t t;
    size_t idx;
    CHECK_OK(laden_st_find(st, "a", &idx));
    CHECK_OK(laden_st_tensor_at(st, idx, &t));
    CHECK(t.file_index == 1 && t.size_bytes == 10);
    laden_st_close(st);

    /* A directory with one index opens it. */
    st = open_ok(test_tmpdir());
    CHECK_EQ(laden_st_count(st), 2);
    laden_st_close(st);
}

TEST(st_sharded_index_errors)
{
    laden_st_t *st;
    write_shard("s1.safetensors", "a", 4, 1);
    write_shard("s2.safetensors", "a", 4, 2);
    write_index("dup.index.json",
                "\"a\": \"s1.safetensors\", \"x\": \"s2.safetensors\"");
    CHECK_STATUS(laden_st_open(test_path("dup.index.json"), &st),
                 LADEN_E_NAME); /* 'a' in two shards */
    CHECK_CONTAINS(laden_last_error(), "two shards");

    write_index("missing.index.json", "\"a\": \"nope.safetensors\"");
    CHECK_STATUS(laden_st_open(test_path("missing.index.json"), &st),
                 LADEN_E_NOENT);
    CHECK_CONTAINS(laden_last_error(), "nope.safetensors");

    write_index("trav.index.json", "\"a\": \"../etc/passwd\"");
    CHECK_STATUS(laden_st_open(test_path("trav.index.json"), &st),
                 LADEN_E_INDEX);
    write_index("abs.index.json", "\"a\": \"/etc/passwd\"");
    CHECK_STATUS(laden_st_open(test_path("abs.index.json"), &st),
                 LADEN_E_INDEX);

    write_index("wrong.index.json",
                "\"a\": \"s1.safetensors\", \"b\": \"s1.safetensors\"");
    CHECK_STATUS(laden_st_open(test_path("wrong.index.json"), &st),
                 LADEN_E_INDEX);
    CHECK_CONTAINS(laden_last_error(), "'b'");

    test_write_file(test_path("nomap.index.json"), "{\"metadata\":{}}", 15);
    CHECK_STATUS(laden_st_open(test_path("nomap.index.json"), &st),
                 LADEN_E_INDEX);
    test_write_file(test_path("badjson.index.json"), "{\"weight_map\":", 14);
    CHECK_STATUS(laden_st_open(test_path("badjson.index.json"), &st),
                 LADEN_E_JSON);

    /* A bad shard's error names the shard. */
    test_write_file(test_path("broken.safetensors"), "xx", 2);
    write_index("broken.index.json", "\"a\": \"broken.safetensors\"");
    CHECK_STATUS(laden_st_open(test_path("broken.index.json"), &st),
                 LADEN_E_HEADER);
    CHECK_CONTAINS(laden_last_error(), "broken.safetensors");

    /* A directory with several candidates is ambiguous. */
    CHECK_STATUS(laden_st_open(test_tmpdir(), &st), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "open one file or one index");
}

TEST(st_directory_picks_model_safetensors)
{
    char *dir = test_path("d");
    CHECK_EQ(mkdir(dir, 0700), 0);
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    test_write_st(p, "{}", NULL, 0);
    snprintf(p, sizeof p, "%s/other.safetensors", dir);
    test_write_st(p, "{}", NULL, 0);
    laden_st_t *st = open_ok(dir);
    CHECK_CONTAINS(laden_st_file_path(st, 0), "model.safetensors");
    laden_st_close(st);
}

/* A header large enough to stress the parser: many tensors, all validated. */
TEST(st_many_tensors)
{
    size_t n = 20000;
    size_t cap = n * 100 + 16;
    char *hdr = malloc(cap);
    size_t at = 0;
    at += (size_t)snprintf(hdr + at, cap - at, "{");
    for (size_t i = 0; i < n; i++)
        at += (size_t)snprintf(hdr + at, cap - at,
                               "%s\"blocks.%zu.w\":{\"dtype\":\"F16\","
                               "\"shape\":[2],\"data_offsets\":[%zu,%zu]}",
                               i ? "," : "", n - 1 - i, 4 * (n - 1 - i),
                               4 * (n - i));
    snprintf(hdr + at, cap - at, "}");
    char *data = calloc(n, 4);
    char *p = test_path("many.safetensors");
    test_write_st(p, hdr, data, 4 * n);
    laden_st_t *st = open_ok(p);
    CHECK_EQ(laden_st_count(st), n);
    laden_st_tensor_t t;
    CHECK_OK(laden_st_tensor_at(st, 0, &t));
    CHECK(strcmp(t.name, "blocks.0.w") == 0);
    size_t idx;
    CHECK_OK(laden_st_find(st, "blocks.12345.w", &idx));
    CHECK_EQ(idx, 12345);
    laden_st_close(st);
    free(hdr);
    free(data);
}

/* The 10-byte file 02000000000000007b7d (header "{}", no data) is a valid,
 * empty checkpoint.  It once did pointer arithmetic on the NULL tensor
 * table (clang's UBSan: "applying zero offset to null pointer"). */
TEST(st_empty_header_is_valid)
{
    static const unsigned char bytes[10] = {2, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    char *p = test_path("ten.safetensors");
    test_write_file(p, bytes, sizeof bytes);
    laden_st_t *sts[2] = {open_ok(p), NULL};
    CHECK_OK(laden_st_open_memory(bytes, sizeof bytes, &sts[1]));
    for (int k = 0; k < 2; k++) {
        laden_st_t *st = sts[k];
        laden_st_tensor_t t;
        size_t idx;
        const char *key, *val;
        CHECK(laden_st_count(st) == 0 && laden_st_total_bytes(st) == 0);
        CHECK(laden_st_file_count(st) == 1 && laden_st_file_size(st, 0) == 10);
        CHECK_EQ(laden_st_metadata_count(st), 0);
        CHECK_STATUS(laden_st_tensor_at(st, 0, &t), LADEN_E_INVAL);
        CHECK_STATUS(laden_st_find(st, "a", &idx), LADEN_E_NOTFOUND);
        CHECK_STATUS(laden_st_metadata_at(st, 0, &key, &val), LADEN_E_INVAL);
        laden_st_close(st);
    }
    /* The same header followed by data: the bytes belong to no tensor. */
    static const unsigned char tail[12] = {2, 0, 0, 0, 0, 0, 0, 0,
                                           '{', '}', 0, 0};
    laden_st_t *st = NULL;
    CHECK_STATUS(laden_st_open_memory(tail, sizeof tail, &st), LADEN_E_RANGE);
    CHECK_EQ(st, NULL);
    CHECK_CONTAINS(laden_last_error(), "belong to no tensor");
}

/* Only rank-0 tensors: the dimension table stays NULL, which the shape
 * check and laden_st_tensor_at once offset by zero (clang's UBSan).  A
 * scalar's shape is a valid pointer to no dimensions. */
TEST(st_scalars_only)
{
    const char *hdr =
        "{\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
        "\"t\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[4,5]}}";
    char *p = test_path("scalars.safetensors");
    test_write_st(p, hdr, "abcde", 5);
    laden_st_t *st = open_ok(p);
    CHECK(laden_st_count(st) == 2 && laden_st_total_bytes(st) == 5);
    for (size_t i = 0; i < 2; i++) {
        laden_st_tensor_t t;
        CHECK_OK(laden_st_tensor_at(st, i, &t));
        CHECK(t.ndim == 0 && t.shape != NULL);
        CHECK_EQ(t.size_bytes, (i ? 1u : 4u));
    }
    laden_st_close(st);
    /* A scalar whose data_offsets disagree with its dtype. */
    test_write_st(p,
                  "{\"s\":{\"dtype\":\"F32\",\"shape\":[],"
                  "\"data_offsets\":[0,8]}}",
                  "abcdefgh", 8);
    CHECK_STATUS(laden_st_open(p, &st), LADEN_E_SHAPE);
    CHECK_CONTAINS(laden_last_error(), "'s'");
}

/* A FIFO, a directory or another non-regular file where a checkpoint, an
 * index or a shard should be is refused at once: open() on a FIFO blocks
 * until a writer comes, so it must never be opened blocking.  The alarm
 * turns a hang into a failure well before the runner's timeout. */
TEST(st_refuses_non_regular_files)
{
    laden_st_t *st = (laden_st_t *)1;
    alarm(20);
    CHECK(mkfifo(test_path("fifo.safetensors"), 0600) == 0);
    CHECK_STATUS(laden_st_open(test_path("fifo.safetensors"), &st),
                 LADEN_E_INVAL);
    CHECK_EQ(st, NULL);
    CHECK_CONTAINS(laden_last_error(), "not a regular file");
    CHECK_CONTAINS(laden_last_error(), "fifo.safetensors");

    /* The index itself a FIFO. */
    CHECK(mkfifo(test_path("f.safetensors.index.json"), 0600) == 0);
    CHECK_STATUS(laden_st_open(test_path("f.safetensors.index.json"), &st),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "not a regular file");
    CHECK_CONTAINS(laden_last_error(), "f.safetensors.index.json");

    /* A FIFO as a shard, after a good shard. */
    write_shard("good.safetensors", "a", 4, 1);
    write_index("fifo.index.json",
                "\"a\": \"good.safetensors\", \"b\": \"fifo.safetensors\"");
    CHECK_STATUS(laden_st_open(test_path("fifo.index.json"), &st),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "not a regular file");
    CHECK_CONTAINS(laden_last_error(), "fifo.safetensors");

    /* A directory as a shard. */
    CHECK(mkdir(test_path("dir.safetensors"), 0700) == 0);
    write_index("dir.index.json", "\"a\": \"dir.safetensors\"");
    CHECK_STATUS(laden_st_open(test_path("dir.index.json"), &st),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "not a regular file");
    CHECK_CONTAINS(laden_last_error(), "dir.safetensors");

    /* A directory whose only checkpoint is a FIFO, named as the preferred
     * file or otherwise. */
    char *d = test_path("d1");
    char p[512];
    CHECK_EQ(mkdir(d, 0700), 0);
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    CHECK_EQ(mkfifo(p, 0600), 0);
    CHECK_STATUS(laden_st_open(d, &st), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "not a regular file");
    d = test_path("d2");
    CHECK_EQ(mkdir(d, 0700), 0);
    snprintf(p, sizeof p, "%s/x.safetensors.index.json", d);
    CHECK_EQ(mkfifo(p, 0600), 0);
    CHECK_STATUS(laden_st_open(d, &st), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "x.safetensors.index.json");

    /* /dev/null is a character device. */
    CHECK_STATUS(laden_st_open("/dev/null", &st), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "not a regular file");
    CHECK_EQ(st, NULL);
}

/* The weight map is matched to shards by number, not by the end of the
 * path: 'y' sent to b.safetensors but stored in ab.safetensors is wrong. */
TEST(st_index_shard_names_that_end_alike)
{
    laden_st_t *st;
    write_shard("b.safetensors", "x", 4, 1);
    write_shard("ab.safetensors", "y", 4, 2);
    write_index("suffix.index.json",
                "\"x\": \"b.safetensors\", \"y\": \"b.safetensors\", "
                "\"z\": \"ab.safetensors\"");
    CHECK_STATUS(laden_st_open(test_path("suffix.index.json"), &st),
                 LADEN_E_INDEX);
    CHECK_CONTAINS(laden_last_error(), "ab.safetensors");
    write_index("suffix_ok.index.json",
                "\"x\": \"b.safetensors\", \"y\": \"ab.safetensors\"");
    st = open_ok(test_path("suffix_ok.index.json"));
    CHECK_EQ(laden_st_count(st), 2);
    laden_st_close(st);
}

/* The index parser from memory (the fuzz target's entry point). */
TEST(st_index_parse_from_memory)
{
    laden__st_index ix;
    const char *ok = "{\"metadata\":{\"total_size\":[1,{\"x\":null}]},"
                     "\"weight_map\":{\"c\":\"s2\",\"a\":\"d/s1\","
                     "\"b\":\"s2\",\"d\":\"s3\"}}";
    CHECK_OK(laden__st_index_parse(ok, strlen(ok), &ix));
    CHECK(ix.nmap == 4 && ix.nshards == 3);
    CHECK(strcmp(ix.shards[0], "s2") == 0 && strcmp(ix.shards[1], "d/s1") == 0 &&
          strcmp(ix.shards[2], "s3") == 0);
    static const char *const names[] = {"a", "b", "c", "d"};
    static const uint32_t shard[] = {1, 0, 0, 2};
    for (size_t i = 0; i < 4; i++)
        CHECK(strcmp(ix.map[i].name, names[i]) == 0 &&
              ix.map[i].shard_index == shard[i] &&
              strcmp(ix.map[i].shard, ix.shards[shard[i]]) == 0);
    laden__st_index_free(&ix);
    laden__st_index_free(&ix); /* zeroed: harmless */
    laden__st_index_free(NULL);

    static const struct {
        const char *json;
        laden_status want;
    } bad[] = {
        {"", LADEN_E_JSON},
        {"{}", LADEN_E_INDEX},
        {"{\"weight_map\":{}}", LADEN_E_INDEX},
        {"{\"weight_map\":[]}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":1}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"s\"},\"weight_map\":{}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"s\",\"a\":\"t\"}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\\u0000b\":\"s\"}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"s\\u0000\"}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"x/../s\"}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"x//s\"}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"\"}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"s/\"}}", LADEN_E_INDEX},
        /* Not the key weight_map, so there is none. */
        {"{\"weight_map\\u0000\":{\"a\":\"s\"}}", LADEN_E_INDEX},
        {"{\"weight_map\":{\"a\":\"s\"}} x", LADEN_E_JSON},
        {"{\"weight_map\":{\"a\":\"s\",}}", LADEN_E_JSON},
        {"{\"weight_map\":{\"a\":\"s\"}", LADEN_E_JSON},
        {"{\"m\":1e999999999999999999999,\"weight_map\":{\"a\":\"s\"}}",
         LADEN_OK},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        laden_status s =
            laden__st_index_parse(bad[i].json, strlen(bad[i].json), &ix);
        if (s != bad[i].want) {
            fprintf(stderr, "%s: got %s (%s), expected %s\n", bad[i].json,
                    laden_status_name(s), laden_last_error(),
                    laden_status_name(bad[i].want));
            exit(1);
        }
        CHECK(s == LADEN_OK || (ix.map == NULL && ix.nmap == 0 &&
                                ix.pool == NULL && ix.shards == NULL));
        laden__st_index_free(&ix);
    }
    CHECK_STATUS(laden__st_index_parse(NULL, 0, &ix), LADEN_E_JSON);
    CHECK_STATUS(laden__st_index_parse(NULL, 3, &ix), LADEN_E_INVAL);
    CHECK_STATUS(laden__st_index_parse(ok, strlen(ok), NULL), LADEN_E_INVAL);
}

/* Many entries over the most shards allowed parse in n log n (a linear
 * search per entry took minutes); one shard more is refused. */
TEST(st_index_many_shards)
{
    size_t nshards = LADEN_ST_MAX_SHARDS, n = 4 * nshards;
    size_t cap = 32 * n + 64, at = 0;
    char *buf = malloc(cap);
    laden__st_index ix;
    alarm(60);
    CHECK(buf != NULL);
    for (int extra = 0; extra < 2; extra++) {
        size_t ns = nshards + (size_t)extra;
        at = (size_t)snprintf(buf, cap, "{\"weight_map\":{");
        for (size_t i = 0; i < n + (size_t)extra; i++)
            at += (size_t)snprintf(buf + at, cap - at, "%s\"t%zu\":\"%zx\"",
                                   i ? "," : "", i,
                                   i < ns ? i : (i * 7919) % ns);
        at += (size_t)snprintf(buf + at, cap - at, "}}");
        CHECK(at < cap);
        laden_status s = laden__st_index_parse(buf, at, &ix);
        if (extra) {
            CHECK_EQ(s, LADEN_E_LIMIT);
            CHECK_CONTAINS(laden_last_error(), "shards");
            continue;
        }
        CHECK_OK(s);
        CHECK(ix.nmap == n && ix.nshards == nshards);
        for (size_t k = 0; k < 3; k++) {
            char want[32];
            snprintf(want, sizeof want, "%zx", k);
            CHECK_EQ(strcmp(ix.shards[k], want), 0);
        }
        for (size_t i = 0; i < ix.nmap; i++)
            CHECK(strcmp(ix.shards[ix.map[i].shard_index], ix.map[i].shard) ==
                  0);
        laden__st_index_free(&ix);
    }
    free(buf);
}

/* ---- a file that changed between its header and its reads ------------ */

/* Moves path's status change time past ctime0 and leaves its
 * modification time at mtime (waiting for the clock to tick if need be). */
static void move_ctime(const char *path, struct timespec mtime,
                       struct timespec ctime0)
{
    for (int i = 0; i < 400; i++) {
        struct timespec t[2] = {{0, UTIME_OMIT}, mtime};
        struct stat sb;
        CHECK_EQ(utimensat(AT_FDCWD, path, t, 0), 0);
        CHECK_EQ(stat(path, &sb), 0);
        if (sb.st_ctim.tv_sec != ctime0.tv_sec ||
            sb.st_ctim.tv_nsec != ctime0.tv_nsec)
            return;
        usleep(5000);
    }
    CHECK(!"the status change time never moved");
}

/* Overwrites byte `at` of path with v in place, its modification time
 * put back. */
static void poke_keep_mtime(const char *path, uint64_t at, char v)
{
    struct stat sb;
    CHECK_EQ(stat(path, &sb), 0);
    int fd = open(path, O_WRONLY);
    CHECK(fd >= 0);
    CHECK_EQ(pwrite(fd, &v, 1, (off_t)at), 1);
    close(fd);
    move_ctime(path, sb.st_mtim, sb.st_ctim);
}

static void chmod_keep_mtime(const char *path, mode_t mode)
{
    struct stat sb;
    CHECK_EQ(stat(path, &sb), 0);
    CHECK_EQ(chmod(path, mode), 0);
    move_ctime(path, sb.st_mtim, sb.st_ctim);
}

/* What laden_st_file_open compares with the file its header was read
 * from: a chmod changes nothing it reads; a header rewritten in place with
 * its modification time put back, or the file replaced (by a rename) with
 * one of the same size and time, is refused naming the file. */
static void file_open_cases(const char *p, uint64_t header_byte)
{
    laden_st_t *st = open_ok(p);
    laden_io_file_t *f;
    chmod_keep_mtime(p, 0444);
    CHECK_OK(laden_st_file_open(st, 0, &f));
    laden_io_file_close(f);
    chmod_keep_mtime(p, 0644);
    struct stat sb;
    CHECK_EQ(stat(p, &sb), 0);
    char was;
    int fd = open(p, O_RDONLY);
    CHECK_EQ(pread(fd, &was, 1, (off_t)header_byte), 1);
    close(fd);
    poke_keep_mtime(p, header_byte, (char)(was ^ 1));
    f = (laden_io_file_t *)1;
    CHECK_STATUS(laden_st_file_open(st, 0, &f), LADEN_E_CHANGED);
    CHECK_EQ(f, NULL);
    CHECK_CONTAINS(laden_last_error(), p);
    CHECK_CONTAINS(laden_last_error(), "header differs");
    poke_keep_mtime(p, header_byte, was); /* the bytes as they were */
    CHECK_OK(laden_st_file_open(st, 0, &f));
    laden_io_file_close(f);
    laden_st_close(st);

    st = open_ok(p);
    CHECK_EQ(stat(p, &sb), 0);
    size_t n = (size_t)sb.st_size;
    char *copy = malloc(n), *q = malloc(strlen(p) + 8);
    fd = open(p, O_RDONLY);
    CHECK_EQ(pread(fd, copy, n, 0), (ssize_t)n);
    close(fd);
    sprintf(q, "%s.new", p);
    test_write_file(q, copy, n);
    struct timespec t[2] = {{0, UTIME_OMIT}, sb.st_mtim};
    CHECK_EQ(utimensat(AT_FDCWD, q, t, 0), 0);
    CHECK_EQ(rename(q, p), 0);
    CHECK_STATUS(laden_st_file_open(st, 0, &f), LADEN_E_CHANGED);
    CHECK_CONTAINS(laden_last_error(), "another file");
    laden_st_close(st);
    free(copy);
    free(q);
}

TEST(st_file_open_refuses_a_changed_file)
{
    const char *hdr =
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}";
    unsigned char data[16] = {1, 2, 3};
    char *p = test_path("changes.safetensors");
    test_write_st(p, hdr, data, sizeof data);
    file_open_cases(p, 8 + 2); /* the tensor's name */
}

TEST(st_file_open_refuses_a_changed_gguf)
{
    /* GGUF 3, one tensor "w" (F32 [4] at 0), one metadata entry. */
    static const unsigned char head[] = {
        'G', 'G', 'U', 'F', 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
        1, 0, 0, 0, 0, 0, 0, 0,
        4, 0, 0, 0, 0, 0, 0, 0, 'n', 'o', 't', 'e', 8, 0, 0, 0,
        2, 0, 0, 0, 0, 0, 0, 0, 'h', 'i',
        1, 0, 0, 0, 0, 0, 0, 0, 'w', 1, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    unsigned char b[96 + 16];
    memset(b, 0, sizeof b);
    memcpy(b, head, sizeof head);
    for (int i = 0; i < 16; i++)
        b[96 + i] = (unsigned char)(i + 1);
    char *p = test_path("changes.gguf");
    test_write_file(p, b, sizeof b);
    laden_st_t *st = open_ok(p);
    CHECK_EQ(laden_st_count(st), 1);
    laden_st_tensor_t t;
    CHECK_OK(laden_st_tensor_at(st, 0, &t));
    CHECK_EQ(t.offset_bytes, 96);
    laden_st_close(st);
    file_open_cases(p, 48); /* the metadata string "hi" */
}

/* Small text and JSON files (laden_st_read_text): read whole and checked,
 * each refusal naming the path and what is wrong, with the line, column
 * and text where the JSON goes wrong. */
static laden_status read_text(const char *body, uint64_t max, uint32_t flags,
                              void **out)
{
    char *p = test_path("t.json");
    test_write_file(p, body, strlen(body));
    uint64_t n = 7;
    laden_status s = laden_st_read_text(p, max, flags, out, &n);
    CHECK(s ? (*out == NULL && n == 0) : n == strlen(body));
    return s;
}

TEST(st_read_text)
{
    void *t = NULL;
    CHECK_OK(read_text("{\"a\": [1, 2.5e3, \"\\u00e9\"]}\n", 1024,
                       LADEN_ST_TEXT_JSON, &t));
    CHECK(strcmp((const char *)t, "{\"a\": [1, 2.5e3, \"\\u00e9\"]}\n") == 0);
    laden_st_text_free(t);
    CHECK_OK(read_text("plain words, not JSON", 1024, 0, &t));
    laden_st_text_free(t);
    CHECK_EQ(read_text("{\"r\": 4,,}", 1024, LADEN_ST_TEXT_JSON, &t),
             LADEN_E_JSON);
    CHECK(strstr(laden_last_error(), "t.json") &&
          strstr(laden_last_error(), "line 1 column 9"));
    CHECK_EQ(read_text("{\n \"x\": NaN}", 1024, LADEN_ST_TEXT_JSON, &t),
             LADEN_E_JSON);
    CHECK(strstr(laden_last_error(), "line 2 column 7") &&
          strstr(laden_last_error(), "NaN"));
    CHECK_EQ(read_text("{} {}", 1024, LADEN_ST_TEXT_JSON, &t), LADEN_E_JSON);
    static char deep[301]; /* NUL-terminated */
    memset(deep, '[', 150);
    memset(deep + 150, ']', 150);
    CHECK_EQ(read_text(deep, 1024, LADEN_ST_TEXT_JSON, &t), LADEN_E_LIMIT);
    CHECK(strstr(laden_last_error(), "nested too deeply"));
    CHECK_EQ(read_text("\"\xc3\x28\"", 1024, 0, &t), LADEN_E_JSON);
    CHECK(strstr(laden_last_error(), "not UTF-8"));
    CHECK_EQ(read_text("{\"a\": 1}", 4, LADEN_ST_TEXT_JSON, &t),
             LADEN_E_LIMIT);
    CHECK(strstr(laden_last_error(), "larger than 4 bytes"));
    CHECK_OK(read_text("{\"a\": 1}", 8, LADEN_ST_TEXT_JSON, &t));
    laden_st_text_free(t);
    uint64_t n;
    CHECK_EQ(laden_st_read_text(test_path("absent.json"), 1024, 0, &t, &n),
             LADEN_E_NOENT);
    char *f = test_path("fifo.json");
    CHECK_EQ(mkfifo(f, 0600), 0);
    CHECK_EQ(laden_st_read_text(f, 1024, 0, &t, &n), LADEN_E_INVAL);
    CHECK(strstr(laden_last_error(), "not a regular file (a FIFO)"));
    CHECK_EQ(laden_st_read_text(NULL, 1024, 0, &t, &n), LADEN_E_INVAL);
    /* A file whose stated size (0) understates it: the buffer grows. */
    CHECK_OK(laden_st_read_text("/proc/self/status", 1 << 20, 0, &t, &n));
    CHECK(n > 100 && strstr((const char *)t, "Name:"));
    laden_st_text_free(t);
    CHECK_EQ(laden_st_read_text("/proc/self/status", 16, 0, &t, &n),
             LADEN_E_LIMIT);
    CHECK_OK(laden_st_read_text("/proc/self/status", UINT64_MAX, 0, &t, &n));
    laden_st_text_free(t);
}
