/* The metadata a model's config is built from, checked for type and range
 * (laden_gguf_check_model): transformers reads <architecture>.* into a
 * config, and a hostile file must get an error naming the key before it
 * builds a model of a billion layers or divides by a head count of 0. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "laden/gguf.h"

#include "../core/internal.h"
#include "gguf_internal.h"

/* Sizes: at least 1, at most this (what a transformers config or a C
 * dimension takes). */
#define MAX_SIZE ((1ull << 31) - 1)

static const char *const sizes[] = {
    "block_count",          "context_length",          "embedding_length",
    "feed_forward_length",  "attention.head_count",    "attention.head_count_kv",
    "rope.dimension_count", "vocab_size",              "expert_count",
    "expert_used_count"};
enum { BLOCKS, HEADS = 4, KV = 5, EMB = 2, EXPERTS = 8, USED = 9, NSIZES = 10 };
static const char *const floats[] = {"rope.freq_base",
                                     "attention.layer_norm_rms_epsilon",
                                     "attention.layer_norm_epsilon"};

/* Value v as the message shows it. */
static void shown(const laden_gguf_kv_t *v, char *out, size_t n)
{
    if (!v)
        snprintf(out, n, "missing");
    else if (v->type == LADEN_GGUF_STRING)
        snprintf(out, n, "'%.60s'", v->str);
    else if (v->type == LADEN_GGUF_ARRAY)
        snprintf(out, n, "an array of %llu", (unsigned long long)v->count);
    else if (v->type == LADEN_GGUF_BOOL)
        snprintf(out, n, "%s", v->u ? "true" : "false");
    else if (v->type == LADEN_GGUF_F32 || v->type == LADEN_GGUF_F64)
        snprintf(out, n, "%g", v->f);
    else if (v->type == LADEN_GGUF_I8 || v->type == LADEN_GGUF_I16 ||
             v->type == LADEN_GGUF_I32 || v->type == LADEN_GGUF_I64)
        snprintf(out, n, "%lld", (long long)v->i);
    else
        snprintf(out, n, "%llu", (unsigned long long)v->u);
}

static laden_status bad(const char *path, const char *key,
                        const laden_gguf_kv_t *v, const char *need)
{
    char val[96];
    shown(v, val, sizeof val);
    return laden__fail(LADEN_E_SCHEMA, "%s: GGUF metadata '%s' is %s: %s",
                       path, key, val, need);
}

/* Metadata `key`, or NULL where the file has none. */
static const laden_gguf_kv_t *find(const laden_gguf_t *g, const char *key,
                                   laden_gguf_kv_t *kv)
{
    return laden_gguf_metadata_find(g, key, kv) ? NULL : kv;
}

/* An integer type's value in 1..hi, else 0. */
static uint64_t size_of(const laden_gguf_kv_t *v, uint64_t hi)
{
    switch (v->type) {
    case LADEN_GGUF_U8: case LADEN_GGUF_U16: case LADEN_GGUF_U32:
    case LADEN_GGUF_U64:
        return v->u >= 1 && v->u <= hi ? v->u : 0;
    case LADEN_GGUF_I8: case LADEN_GGUF_I16: case LADEN_GGUF_I32:
    case LADEN_GGUF_I64:
        return v->i >= 1 && (uint64_t)v->i <= hi ? (uint64_t)v->i : 0;
    default:
        return 0;
    }
}

laden_status laden_gguf_check_model(const laden_gguf_t *g, const char *path)
{
    if (!g)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_check_model: NULL");
    path = path ? path : "GGUF file";
    laden_gguf_kv_t kv;
    const laden_gguf_kv_t *v = find(g, "general.architecture", &kv);
    if (!v || v->type != LADEN_GGUF_STRING || !v->count)
        return bad(path, "general.architecture", v,
                   "laden needs the architecture's name");
    if (v->count > 64 || strspn(v->str, "abcdefghijklmnopqrstuvwxyz"
                                        "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789_-.") != v->count)
        return bad(path, "general.architecture", v,
                   "an architecture's name is at most 64 letters, digits, "
                   "'_', '-' or '.'");
    char arch[128], key[256];
    snprintf(arch, sizeof arch, "%s", v->str);
    if ((v = find(g, "general.name", &kv)) && v->type != LADEN_GGUF_STRING)
        return bad(path, "general.name", v, "a name is a string");
    uint64_t got[NSIZES] = {0};
    size_t ntensors = laden_gguf_count(g);
    for (int k = 0; k < NSIZES; k++) {
        uint64_t hi = k == BLOCKS ? (ntensors ? ntensors : 1) : MAX_SIZE;
        snprintf(key, sizeof key, "%.100s.%s", arch, sizes[k]);
        if (!(v = find(g, key, &kv)))
            continue;
        if (!(got[k] = size_of(v, hi))) {
            char need[64];
            snprintf(need, sizeof need, "laden needs an integer from 1 to "
                     "%llu", (unsigned long long)hi);
            return bad(path, key, v, need);
        }
    }
    for (size_t k = 0; k < sizeof floats / sizeof *floats; k++) {
        snprintf(key, sizeof key, "%.100s.%s", arch, floats[k]);
        if ((v = find(g, key, &kv)) &&
            ((v->type != LADEN_GGUF_F32 && v->type != LADEN_GGUF_F64) ||
             !isfinite(v->f) || v->f <= 0))
            return bad(path, key, v, "laden needs a finite float above 0");
    }
    char need[256];
    if (got[HEADS] && got[EMB] && got[HEADS] > got[EMB]) {
        snprintf(key, sizeof key, "%.100s.%s", arch, sizes[HEADS]);
        snprintf(need, sizeof need, "more heads than %.100s.embedding_length "
                 "(%llu)", arch, (unsigned long long)got[EMB]);
        return bad(path, key, find(g, key, &kv), need);
    }
    if (got[HEADS] && got[KV] && got[HEADS] % got[KV]) {
        snprintf(key, sizeof key, "%.100s.%s", arch, sizes[KV]);
        snprintf(need, sizeof need, "it does not divide "
                 "%.100s.attention.head_count (%llu)", arch,
                 (unsigned long long)got[HEADS]);
        return bad(path, key, find(g, key, &kv), need);
    }
    if (got[USED] && got[EXPERTS] && got[USED] > got[EXPERTS]) {
        snprintf(key, sizeof key, "%.100s.%s", arch, sizes[USED]);
        snprintf(need, sizeof need, "more than %.100s.expert_count (%llu)", arch,
                 (unsigned long long)got[EXPERTS]);
        return bad(path, key, find(g, key, &kv), need);
    }
    return LADEN_OK;
}
