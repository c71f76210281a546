/* Fuzz target for the lossless format (laden/lossless.h): the input is a
 * blob, checked and, when the check passes, decoded on the CPU into a
 * buffer with guard bytes on both sides (the decoder must never read or
 * write out of bounds, whatever the bytes); and, from its first byte's
 * low bit, also values to encode, which must come back bit for bit. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "laden/lossless.h"

#define GUARD 64u

static void decode(const uint8_t *data, size_t size)
{
    laden_lossless_info in;
    /* A copy of exactly `size` bytes: ASan sees any read past it. */
    uint8_t *blob = malloc(size ? size : 1);
    if (!blob)
        return;
    memcpy(blob, data, size);
    if (laden_lossless_check(blob, size, &in) != LADEN_OK ||
        in.n_elems > (1u << 22)) {
        free(blob);
        return;
    }
    size_t out_bytes = (size_t)(2 * in.n_elems);
    uint8_t *out = malloc(out_bytes + 2 * GUARD);
    uint32_t err = 0;
    if (out) {
        memset(out, 0xa5, out_bytes + 2 * GUARD);
        laden_status s = laden_lossless_decode(
            LADEN_DEVICE_CPU, 0, &in, (laden_devptr_t)(uintptr_t)blob,
            (laden_devptr_t)(uintptr_t)(out + GUARD), out_bytes,
            (laden_devptr_t)(uintptr_t)&err);
        if ((s != LADEN_OK && s != LADEN_E_CORRUPT) ||
            (s == LADEN_E_CORRUPT) != (err != 0))
            __builtin_trap();
        for (size_t k = 0; k < GUARD; k++)
            if (out[k] != 0xa5 || out[GUARD + out_bytes + k] != 0xa5)
                __builtin_trap();
        free(out);
    }
    free(blob);
}

static void round_trip(const uint8_t *data, size_t size)
{
    laden_dtype dt = data[0] & 2 ? LADEN_DTYPE_F16 : LADEN_DTYPE_BF16;
    uint64_t n = (size - 1) / 2, bound, got;
    if (laden_lossless_bound(dt, n, &bound) != LADEN_OK)
        __builtin_trap();
    uint8_t *blob = malloc(bound), *out = malloc(2 * n + 1);
    laden_lossless_info in;
    if (blob && out) {
        if (laden_lossless_encode(dt, data + 1, n, blob, bound, &got) ||
            got > bound || laden_lossless_check(blob, got, &in) ||
            laden_lossless_decode(LADEN_DEVICE_CPU, 0, &in,
                                  (laden_devptr_t)(uintptr_t)blob,
                                  (laden_devptr_t)(uintptr_t)out, 2 * n, 0) ||
            memcmp(out, data + 1, 2 * n) != 0)
            __builtin_trap();
    }
    free(blob);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    decode(data, size);
    if (size && (data[0] & 1))
        round_trip(data, size);
    return 0;
}
