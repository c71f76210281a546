/* Fuzz target for lossless cache files (laden/lossless.h): the input is a
 * whole cache file.  Its header and index are parsed as a load parses them
 * (src/stream/llcache.c); any input may be refused, none may crash, read
 * out of bounds or leak.  An index that parses keeps its promises: entries
 * in the checkpoint's order, each blob within the file before the index,
 * after the one before; each is then found by its tensor and checked as
 * a load checks it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "laden/lossless.h"
#include "stream/stream_lossless.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Entry e's blob checked as a load checks it in its block (a copy of
 * exactly its bytes: ASan sees a read past them).  Decoding a blob that
 * passes is fuzz_lossless.c's. */
static void blob(const uint8_t *data, const llc_entry *e)
{
    if (e->blob_bytes > (1u << 22))
        return;
    uint8_t *b = malloc(e->blob_bytes);
    laden_lossless_info in;
    if (!b)
        return;
    memcpy(b, data + e->blob_off, e->blob_bytes);
    if (laden_lossless_check(b, e->blob_bytes, &in) == LADEN_OK &&
        (in.bytes != e->blob_bytes || in.raw_off > in.bytes))
        __builtin_trap();
    free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    llc_head h;
    llc_entry *e = NULL;
    if (size < LADEN_LLC_HEAD ||
        laden__llc_parse_head(data, size, &h) != LADEN_OK)
        return 0;
    if (h.index_off > size || size - h.index_off < h.index_bytes)
        __builtin_trap(); /* the header promised its index is within */
    if (laden__llc_parse_index(&h, data + h.index_off, &e) != LADEN_OK) {
        if (e)
            __builtin_trap(); /* a failure leaves nothing */
        return 0;
    }
    laden_llc c = {.file = NULL, .e = e, .n = h.count};
    uint64_t end = 0;
    for (uint32_t k = 0; k < h.count; k++) {
        if ((k && e[k].src_off <= e[k - 1].src_off) ||
            laden__llc_find(&c, e[k].src_off, e[k].nelem, e[k].dtype) !=
                &e[k])
            __builtin_trap();
        if (e[k].kept_raw)
            continue;
        if (e[k].blob_off < end || e[k].blob_off > h.index_off ||
            h.index_off - e[k].blob_off < e[k].blob_bytes)
            __builtin_trap();
        end = e[k].blob_off + e[k].blob_bytes;
        blob(data, &e[k]);
    }
    free(e);
    return 0;
}
