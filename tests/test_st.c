#include <sys/stat.h>

#include "test.h"

#include "laden/st.h"

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
    CHECK(laden_st_count(st) == 4);
    CHECK(laden_st_file_count(st) == 1);
    CHECK(strcmp(laden_st_file_path(st, 0), p) == 0);
    CHECK(laden_st_total_bytes(st) == 36);
    laden_st_tensor_t t;
    const char *order[] = {"a", "b", "s", "z"};
    uint64_t base = 8 + strlen(hdr);
    for (size_t i = 0; i < 4; i++) {
        CHECK_OK(laden_st_tensor_at(st, i, &t));
        CHECK(strcmp(t.name, order[i]) == 0);
        size_t idx;
        CHECK_OK(laden_st_find(st, order[i], &idx));
        CHECK(idx == i);
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
    CHECK(laden_st_metadata_count(st) == 2);
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
    CHECK(LADEN_DTYPE_COUNT == sizeof want / sizeof want[0]);
    char hdr[8192] = "{";
    uint64_t off = 0;
    for (size_t i = 0; i < LADEN_DTYPE_COUNT; i++) {
        CHECK(strcmp(laden_dtype_name((laden_dtype)i), want[i].name) == 0);
        CHECK(laden_dtype_bits((laden_dtype)i) == want[i].bits);
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
    CHECK(laden_st_count(st) == LADEN_DTYPE_COUNT);
    for (size_t i = 0; i < LADEN_DTYPE_COUNT; i++) {
        laden_st_tensor_t t;
        CHECK_OK(laden_st_tensor_at(st, i, &t));
        CHECK(t.dtype == (laden_dtype)i);
    }
    CHECK(laden_dtype_name(LADEN_DTYPE_COUNT) == NULL);
    CHECK(laden_dtype_bits(LADEN_DTYPE_COUNT) == 0);
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
    CHECK(idx == 0);
    CHECK_OK(laden_st_find(st, "\xe6\x97\xa5.w", &idx));
    CHECK(idx == 1);
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
    CHECK(laden_st_count(st) == 1);
    CHECK(strcmp(laden_st_file_path(st, 0), "<memory>") == 0);
    laden_st_close(st);
    CHECK_STATUS(laden_st_open_memory(buf, n - 1, &st), LADEN_E_TRUNCATED);
    CHECK(st == NULL);
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
    CHECK(laden_st_total_bytes(st) == 30);
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
    CHECK(laden_st_count(st) == 2);
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
    CHECK(mkdir(dir, 0700) == 0);
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
    CHECK(laden_st_count(st) == n);
    laden_st_tensor_t t;
    CHECK_OK(laden_st_tensor_at(st, 0, &t));
    CHECK(strcmp(t.name, "blocks.0.w") == 0);
    size_t idx;
    CHECK_OK(laden_st_find(st, "blocks.12345.w", &idx));
    CHECK(idx == 12345);
    laden_st_close(st);
    free(hdr);
    free(data);
}
