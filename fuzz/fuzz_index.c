/* libFuzzer target: the index of a sharded checkpoint
 * (*.safetensors.index.json) parsed from memory, as laden_st_open parses it
 * before it opens any shard.  Any input may fail to parse; none may crash,
 * read out of bounds or leak, and a failure leaves the result empty.  A
 * parse that succeeds keeps its promises: names sorted, distinct and without
 * NUL; shards distinct safe relative paths, each used, each entry's number
 * naming its shard; counts within limits. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "laden/st.h"
#include "st/json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void check_shard_name(const char *s, size_t size)
{
    size_t n = strlen(s);
    if (n == 0 || n > size || s[0] == '/' || s[n - 1] == '/' ||
        strstr(s, "//") || strcmp(s, "..") == 0 || strncmp(s, "../", 3) == 0 ||
        (n >= 3 && strcmp(s + n - 3, "/..") == 0) || strstr(s, "/../"))
        __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    laden__st_index ix;
    if (laden__st_index_parse(data, size, &ix) != LADEN_OK) {
        if (ix.pool || ix.map || ix.shards || ix.nmap || ix.nshards)
            __builtin_trap();
        return 0;
    }
    if (ix.nmap == 0 || ix.nshards == 0 || ix.nshards > ix.nmap ||
        ix.nshards > LADEN_ST_MAX_SHARDS)
        __builtin_trap();
    unsigned char *used = calloc(ix.nshards, 1);
    const char **sorted = malloc(ix.nshards * sizeof *sorted);
    if (!used || !sorted)
        __builtin_trap();
    for (size_t i = 0; i < ix.nmap; i++) {
        const laden__st_index_entry *e = &ix.map[i];
        if (strlen(e->name) > size ||
            (i && strcmp(ix.map[i - 1].name, e->name) >= 0) ||
            e->shard_index >= ix.nshards ||
            strcmp(ix.shards[e->shard_index], e->shard) != 0)
            __builtin_trap();
        used[e->shard_index] = 1;
    }
    for (size_t k = 0; k < ix.nshards; k++) {
        if (!used[k])
            __builtin_trap();
        check_shard_name(ix.shards[k], size);
        sorted[k] = ix.shards[k];
    }
    qsort(sorted, ix.nshards, sizeof *sorted, cmp_str);
    for (size_t k = 1; k < ix.nshards; k++)
        if (strcmp(sorted[k - 1], sorted[k]) == 0)
            __builtin_trap();
    free(sorted);
    free(used);
    laden__st_index_free(&ix);
    if (ix.pool || ix.map || ix.shards)
        __builtin_trap();
    return 0;
}
