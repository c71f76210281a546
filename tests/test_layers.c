/* The C layers call only downward: every #include of a source file or a
 * public header names its own layer or one below it, in one order, so no
 * layer calls one above it and there is no circle.  The order, bottom up
 * (docs/DESIGN.md's layers):
 *
 *   core  status, errors, dtypes (core/dtype.c)
 *   trace events and gauges; resolves stream times through dev's hooks
 *   dev   the device table, the expansion kernels and the lossless
 *         format (its decoder is one of those kernels; dtypes from core)
 *   io    the reader pool
 *   host  the pinned arena and the shared segment
 *   vram  device memory
 *   plan  the planner (a pure function)
 *   gguf  GGUF headers and block dequantization
 *   st    checkpoints: safetensors, their indexes, and GGUF files read
 *         through gguf (one way)
 *   stream, cache, then the ABI table (api; core/abi.c until it moves)
 *
 * A new layer or public header must be placed here. */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

#define LEN(a) (sizeof(a) / sizeof((a)[0]))

static const char *const ORDER[] = {"core", "trace", "dev",  "io",
                                    "host", "vram",  "plan", "gguf",
                                    "st",   "stream", "cache", "api"};

/* Public headers named for no layer folder. */
static const struct {
    const char *header, *layer;
} HEADER_LAYER[] = {
    {"dtype.h", "core"}, {"expand.h", "dev"}, {"lossless.h", "dev"},
    {"shm.h", "host"},
    {"grads.h", "stream"}, {"abi.h", "api"},   {"laden.h", "core"},
};

static int rank_of(const char *layer, size_t n)
{
    for (size_t i = 0; i < LEN(ORDER); i++)
        if (strlen(ORDER[i]) == n && !strncmp(ORDER[i], layer, n))
            return (int)i;
    return -1;
}

/* The layer of include/laden/<name> (or laden.h). */
static int header_rank(const char *name)
{
    for (size_t i = 0; i < LEN(HEADER_LAYER); i++)
        if (!strcmp(HEADER_LAYER[i].header, name))
            return rank_of(HEADER_LAYER[i].layer,
                           strlen(HEADER_LAYER[i].layer));
    const char *dot = strrchr(name, '.');
    return dot ? rank_of(name, (size_t)(dot - name)) : -1;
}

/* The layer an #include "target" names, from a file of layer `self`
 * (public: the file is in include/laden/); -2 for a file of its own
 * folder. */
static int target_rank(const char *target, int self, bool public_header)
{
    if (!strcmp(target, "laden.h") || !strcmp(target, "../laden.h"))
        return header_rank("laden.h");
    if (!strncmp(target, "laden/", 6))
        return header_rank(target + 6);
    if (public_header)
        return header_rank(target);
    if (!strncmp(target, "../", 3)) {
        const char *layer = target + 3, *slash = strchr(layer, '/');
        return slash ? rank_of(layer, (size_t)(slash - layer)) : -1;
    }
    return strchr(target, '/') ? -1 : self;
}

/* Checks every #include "..." of path; counts the files and the
 * includes that cross layers, printing each. */
static unsigned check_file(const char *path, const char *shown, int self,
                           bool public_header, unsigned *crossing)
{
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    char line[512];
    unsigned bad = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "#include \"", 10))
            continue;
        char *end = strchr(line + 10, '"');
        CHECK(end != NULL);
        *end = '\0';
        const char *target = line + 10;
        int r = target_rank(target, self, public_header);
        if (r < 0) {
            fprintf(stderr, "%s: #include \"%s\": which layer is it? "
                    "(place it in tests/test_layers.c)\n", shown, target);
            bad++;
        } else if (r > self) {
            fprintf(stderr, "%s (%s) includes \"%s\" (%s), a layer above "
                    "it\n", shown, ORDER[self], target, ORDER[r]);
            bad++;
        } else if (r < self) {
            (*crossing)++;
        }
    }
    fclose(f);
    return bad;
}

static bool is_source(const char *name)
{
    size_t n = strlen(name);
    return n > 2 && name[n - 2] == '.' && (name[n - 1] == 'c' ||
                                           name[n - 1] == 'h');
}

TEST(layers_include_only_below)
{
    char dir[1024], path[2048], shown[600];
    unsigned bad = 0, files = 0, crossing = 0;
    snprintf(dir, sizeof dir, "%s/src", LADEN_SOURCE_DIR);
    DIR *top = opendir(dir);
    CHECK(top != NULL);
    struct dirent *l;
    while ((l = readdir(top))) {
        if (l->d_name[0] == '.')
            continue;
        int self = rank_of(l->d_name, strlen(l->d_name));
        char sub[1536];
        snprintf(sub, sizeof sub, "%s/%s", dir, l->d_name);
        DIR *d = opendir(sub);
        if (!d)
            continue;
        struct dirent *e;
        while ((e = readdir(d))) {
            if (!is_source(e->d_name))
                continue;
            snprintf(shown, sizeof shown, "src/%s/%s", l->d_name, e->d_name);
            snprintf(path, sizeof path, "%s/%s", sub, e->d_name);
            /* The ABI table includes every header to check their layouts:
             * it sits above every layer wherever it lives. */
            int r = !strcmp(shown, "src/core/abi.c")
                        ? rank_of("api", 3) : self;
            if (r < 0) {
                fprintf(stderr, "%s: src/%s is no layer of the order in "
                        "tests/test_layers.c\n", shown, l->d_name);
                bad++;
                continue;
            }
            bad += check_file(path, shown, r, false, &crossing);
            files++;
        }
        closedir(d);
    }
    closedir(top);
    snprintf(dir, sizeof dir, "%s/include/laden", LADEN_SOURCE_DIR);
    DIR *d = opendir(dir);
    CHECK(d != NULL);
    while ((l = readdir(d))) {
        if (!is_source(l->d_name))
            continue;
        snprintf(shown, sizeof shown, "include/laden/%s", l->d_name);
        snprintf(path, sizeof path, "%s/%s", dir, l->d_name);
        int r = header_rank(l->d_name);
        if (r < 0) {
            fprintf(stderr, "%s: which layer is it? (place it in "
                    "tests/test_layers.c)\n", shown);
            bad++;
            continue;
        }
        bad += check_file(path, shown, r, true, &crossing);
        files++;
    }
    closedir(d);
    CHECK(files > 40); /* it found the tree */
    CHECK(crossing > 0);
    CHECK_EQ(bad, 0);
}

/* The check itself: an include of a layer above is caught, one below or
 * in the file's own folder is not. */
TEST(layers_order_is_checked)
{
    int gguf = rank_of("gguf", 4), st = rank_of("st", 2);
    int core = rank_of("core", 4), dev = rank_of("dev", 3);
    CHECK(gguf >= 0 && st >= 0 && core >= 0 && dev >= 0);
    CHECK(target_rank("laden/st.h", gguf, false) > gguf);
    CHECK(target_rank("../st/json.h", gguf, false) > gguf);
    CHECK_EQ(target_rank("laden/gguf.h", st, false), gguf);
    CHECK_EQ(target_rank("../gguf/gguf_internal.h", st, false), gguf);
    CHECK_EQ(target_rank("laden/dtype.h", dev, false), core);
    CHECK_EQ(target_rank("json.h", st, false), st);
    CHECK_EQ(target_rank("dtype.h", dev, true), core);
    CHECK_EQ(target_rank("../laden.h", dev, true), core);
    CHECK_EQ(target_rank("laden/nothing.h", st, false), -1);
    CHECK_EQ(target_rank("x/y.h", st, false), -1);
}
