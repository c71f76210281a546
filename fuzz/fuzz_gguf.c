/* libFuzzer target: a whole GGUF file from memory.  Any input may fail to
 * parse; none may crash, read out of bounds or leak.  Successful parses
 * are walked so every table entry is touched and checked, and their
 * model metadata checked (laden_gguf_check_model). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "laden/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    laden_gguf_t *g = NULL;
    if (laden_gguf_open_memory(data, size, &g) != LADEN_OK)
        return 0;
    uint64_t total = 0;
    for (size_t i = 0; i < laden_gguf_count(g); i++) {
        laden_gguf_tensor_t t;
        size_t idx;
        if (laden_gguf_tensor_at(g, i, &t) != LADEN_OK ||
            laden_gguf_find(g, t.name, &idx) != LADEN_OK || idx != i ||
            t.offset_bytes + t.size_bytes > size ||
            laden_gguf_type_name(t.type) == NULL)
            __builtin_trap();
        total += strlen(t.name) + t.dims[0];
    }
    for (size_t i = 0; i < laden_gguf_metadata_count(g); i++) {
        laden_gguf_kv_t kv;
        if (laden_gguf_metadata_at(g, i, &kv) != LADEN_OK)
            __builtin_trap();
        total += strlen(kv.key) + (kv.str ? strlen(kv.str) : 0);
    }
    /* The config's metadata checked: an error or OK, never a crash. */
    laden_status s = laden_gguf_check_model(g, "fuzz.gguf");
    if (s != LADEN_OK && s != LADEN_E_SCHEMA)
        __builtin_trap();
    laden_gguf_close(g);
    return (int)(total & 0);
}
