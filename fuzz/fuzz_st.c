/* libFuzzer target: a whole safetensors file from memory.  Any input may
 * fail to parse; none may crash, read out of bounds or leak.  Successful
 * parses are walked so every table entry is touched. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "laden/st.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    laden_st_t *st = NULL;
    if (laden_st_open_memory(data, size, &st) != LADEN_OK)
        return 0;
    uint64_t total = 0;
    for (size_t i = 0; i < laden_st_count(st); i++) {
        laden_st_tensor_t t;
        size_t idx;
        if (laden_st_tensor_at(st, i, &t) != LADEN_OK ||
            laden_st_find(st, t.name, &idx) != LADEN_OK || idx != i ||
            t.offset_bytes + t.size_bytes > size)
            __builtin_trap();
        for (uint32_t d = 0; d < t.ndim; d++)
            total += t.shape[d];
        total += strlen(t.name);
    }
    for (size_t i = 0; i < laden_st_metadata_count(st); i++) {
        const char *k, *v;
        if (laden_st_metadata_at(st, i, &k, &v) != LADEN_OK)
            __builtin_trap();
        total += strlen(k) + strlen(v);
    }
    if (laden_st_total_bytes(st) > size)
        __builtin_trap();
    laden_st_close(st);
    return (int)(total & 0);
}
