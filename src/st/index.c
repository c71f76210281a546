/* The index of a sharded safetensors checkpoint
 * (*.safetensors.index.json): its weight_map parsed from memory and
 * checked, the distinct shards listed in first-use order.  Opens no file:
 * st.c opens the index and its shards.  See json.h. */
#include <stdlib.h>
#include <string.h>

#include "laden/st.h"

#include "../core/internal.h"
#include "json.h"

static laden_status nomem(const char *what)
{
    return laden__fail(LADEN_E_NOMEM, "out of memory while %s", what);
}

static int cmp_map_name(const void *a, const void *b)
{
    return strcmp(((const laden__st_index_entry *)a)->name,
                  ((const laden__st_index_entry *)b)->name);
}

/* A relative path of non-empty components, none "..", and not ending in
 * '/' (the name of a directory). */
static bool safe_shard_name(const char *s)
{
    for (const char *p = s;;) {
        const char *q = strchr(p, '/');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        if (n == 0 || (n == 2 && p[0] == '.' && p[1] == '.'))
            return false;
        if (!q)
            return true;
        p = q + 1;
    }
}

/* A weight_map entry's shard and its position in the map: the distinct
 * shards are found in first-use order by sorting, since a linear search per
 * entry is quadratic (millions of entries times 65536 shards). */
typedef struct shard_use {
    const char *shard;
    size_t seq;
    uint32_t group; /* the shard's number in name order */
} shard_use;

static int cmp_use_shard(const void *a, const void *b)
{
    const shard_use *x = a, *y = b;
    int c = strcmp(x->shard, y->shard);
    return c ? c : x->seq < y->seq ? -1 : x->seq > y->seq;
}

static int cmp_use_seq(const void *a, const void *b)
{
    const shard_use *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

void laden__st_index_free(laden__st_index *ix)
{
    if (!ix)
        return;
    free(ix->pool);
    free(ix->map);
    free(ix->shards);
    memset(ix, 0, sizeof *ix);
}

/* Lists the distinct shards of ix->map in first-use order and numbers
 * each entry's shard accordingly. */
static laden_status index_shards(laden__st_index *ix)
{
    size_t n = ix->nmap, ngroups = 0;
    shard_use *use = malloc(n * sizeof *use);
    uint32_t *rank = NULL;
    laden_status s = LADEN_OK;
    if (!use)
        return nomem("reading an index");
    for (size_t i = 0; i < n; i++)
        use[i] = (shard_use){ix->map[i].shard, i, 0};
    qsort(use, n, sizeof *use, cmp_use_shard);
    /* Groups of one shard; the first of each (its first use) is moved to
     * the front, and every entry notes its group for now. */
    for (size_t i = 0; i < n; i++) {
        if (i == 0 || strcmp(use[i].shard, use[ngroups - 1].shard) != 0) {
            if (ngroups == LADEN_ST_MAX_SHARDS) {
                s = laden__fail(LADEN_E_LIMIT, "more than %u shards",
                                LADEN_ST_MAX_SHARDS);
                goto out;
            }
            use[ngroups] = use[i];
            use[ngroups].group = (uint32_t)ngroups;
            ngroups++;
        }
        ix->map[use[i].seq].shard_index = (uint32_t)(ngroups - 1);
    }
    qsort(use, ngroups, sizeof *use, cmp_use_seq);
    ix->shards = malloc(ngroups * sizeof *ix->shards);
    rank = malloc(ngroups * sizeof *rank);
    if (!ix->shards || !rank) {
        s = nomem("reading an index");
        goto out;
    }
    for (size_t r = 0; r < ngroups; r++) {
        ix->shards[r] = use[r].shard;
        rank[use[r].group] = (uint32_t)r;
    }
    ix->nshards = ngroups;
    for (size_t i = 0; i < n; i++)
        ix->map[i].shard_index = rank[ix->map[i].shard_index];
out:
    free(use);
    free(rank);
    return s;
}

laden_status laden__st_index_parse(const void *json, size_t len,
                                   laden__st_index *out)
{
    laden_status s = LADEN_OK;
    laden__st_index ix = {0};
    size_t cap = 0, pool_at = 0;
    bool seen_map = false;
    laden__json j;
    int more;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden__st_index_parse: out is NULL");
    memset(out, 0, sizeof *out);
    if (!json && len)
        return laden__fail(LADEN_E_INVAL, "laden__st_index_parse: json NULL");
    if (len > LADEN_ST_MAX_HEADER_BYTES)
        return laden__fail(LADEN_E_LIMIT,
                           "index of %zu bytes exceeds the %u-byte limit", len,
                           LADEN_ST_MAX_HEADER_BYTES);
    /* Decoded strings never outgrow their encoding: len + 1 holds them
     * all, NULs included. */
    if (!(ix.pool = malloc(len + 1)))
        return nomem("reading an index");
    laden__json_init(&j, json, len);
    if ((s = laden__json_expect(&j, '{')))
        goto out;
    more = !laden__json_peek(&j, '}');
    if (!more)
        j.p++;
    while (more) {
        char *key = ix.pool + pool_at;
        size_t n;
        if ((s = laden__json_string(&j, key, len + 1 - pool_at, &n, NULL)) ||
            (s = laden__json_expect(&j, ':')))
            goto out;
        /* By length too: "weight_map\u0000x" is some other key. */
        if (n != sizeof "weight_map" - 1 || strcmp(key, "weight_map") != 0) {
            /* Not kept: the next string reuses the space. */
            if ((s = laden__json_skip(&j, LADEN_ST_MAX_DEPTH)))
                goto out;
        } else {
            int m;
            if (seen_map) {
                s = laden__fail(LADEN_E_INDEX, "weight_map appears twice");
                goto out;
            }
            seen_map = true;
            if ((s = laden__json_need_value(&j)))
                goto out;
            if (laden__json_kind(&j) != '{') {
                s = laden__fail(LADEN_E_INDEX, "weight_map is not an object");
                goto out;
            }
            j.p++;
            m = !laden__json_peek(&j, '}');
            if (!m)
                j.p++;
            while (m) {
                char *name = ix.pool + pool_at, *shard;
                size_t k;
                bool nul;
                if ((s = laden__json_string(&j, name, len + 1 - pool_at, &k,
                                            &nul)) ||
                    (s = laden__json_expect(&j, ':')))
                    goto out;
                if (nul) {
                    s = laden__fail(LADEN_E_INDEX,
                                    "weight_map name '%.200s...' holds a NUL "
                                    "character",
                                    name);
                    goto out;
                }
                pool_at += k + 1;
                shard = ix.pool + pool_at;
                if ((s = laden__json_need_value(&j)))
                    goto out;
                if (laden__json_kind(&j) != '"') {
                    s = laden__fail(LADEN_E_INDEX,
                                    "weight_map value of '%.200s' is not a "
                                    "file name",
                                    name);
                    goto out;
                }
                if ((s = laden__json_string(&j, shard, len + 1 - pool_at, &k,
                                            &nul)))
                    goto out;
                pool_at += k + 1;
                if (nul || !safe_shard_name(shard)) {
                    s = laden__fail(LADEN_E_INDEX,
                                    "weight_map sends '%.200s' to '%.200s', "
                                    "which is not a relative path inside the "
                                    "index's directory",
                                    name, shard);
                    goto out;
                }
                if (!laden__st_grow((void **)&ix.map, &cap, ix.nmap + 1,
                                    sizeof *ix.map)) {
                    s = nomem("reading an index");
                    goto out;
                }
                ix.map[ix.nmap++] = (laden__st_index_entry){name, shard, 0};
                if ((s = laden__json_next(&j, '}', &m)))
                    goto out;
            }
        }
        if ((s = laden__json_next(&j, '}', &more)))
            goto out;
    }
    if (!laden__json_at_end(&j)) {
        s = laden__fail(LADEN_E_JSON, "bytes after the index object at "
                        "byte %zu", laden__json_pos(&j));
        goto out;
    }
    if (!seen_map || ix.nmap == 0) {
        s = laden__fail(LADEN_E_INDEX, "index has no weight_map entries");
        goto out;
    }
    if ((s = index_shards(&ix)))
        goto out;
    qsort(ix.map, ix.nmap, sizeof *ix.map, cmp_map_name);
    for (size_t i = 1; i < ix.nmap; i++)
        if (strcmp(ix.map[i - 1].name, ix.map[i].name) == 0) {
            s = laden__fail(LADEN_E_INDEX, "weight_map lists '%.200s' twice",
                            ix.map[i].name);
            goto out;
        }
out:
    if (s) {
        laden__st_index_free(&ix);
        return s;
    }
    *out = ix;
    return LADEN_OK;
}
