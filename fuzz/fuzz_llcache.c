/* Fuzz target for lossless cache files (laden/lossless.h): the input is a
 * whole cache file.  Its header and index are parsed as a load parses them
 * (src/stream/llcache.c); any input may be refused, none may crash, read
 * out of bounds or leak.  An index that parses keeps its promises: entries
 * in the checkpoint's order, each blob within the file before the index,
 * after the one before; each is then found by its tensor, checked as a
 * load checks it and, when the check passes, decoded on the CPU into a
 * buffer with guard bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "laden/lossless.h"
#include "stream/stream_lossless.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define GUARD 64u

static void blob(const uint8_t *data, const llc_entry *e)
{
    if (e->blob_bytes > (1u << 22))
        return;
    uint8_t *b = malloc(e->blob_bytes); /* exactly: ASan sees overreads */
    laden_lossless_info in;
    if (!b)
        return;
    memcpy(b, data + e->blob_off, e->blob_bytes);
    if (laden_lossless_check(b, e->blob_bytes, &in) == LADEN_OK &&
        in.n_elems == e->nelem && in.dtype == e->dtype) {
        size_t out_bytes = (size_t)(2 * in.n_elems);
        uint8_t *out = malloc(out_bytes + 2 * GUARD);
        uint32_t err = 0;
        if (out) {
            memset(out, 0xa5, out_bytes + 2 * GUARD);
            laden_status s = laden_lossless_decode(
                LADEN_DEVICE_CPU, 0, &in, (laden_devptr_t)(uintptr_t)b,
                (laden_devptr_t)(uintptr_t)(out + GUARD), out_bytes,
                (laden_devptr_t)(uintptr_t)&err);
            if (s != LADEN_OK && s != LADEN_E_CORRUPT)
                __builtin_trap();
            for (size_t k = 0; k < GUARD; k++)
                if (out[k] != 0xa5 || out[GUARD + out_bytes + k] != 0xa5)
                    __builtin_trap();
            free(out);
        }
    }
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
