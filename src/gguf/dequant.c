/* GGUF block types expanded to float32 on the CPU, with the reference's
 * arithmetic: each value rounded as ggml and the gguf package round it
 * (float32, a multiply then an add, never fused: this file is compiled
 * with -ffp-contract=off). */
#include <string.h>

#include "../core/internal.h"
#include "laden/gguf.h"

static float f16(const uint8_t *p)
{
    return laden__f32_of_f16((uint16_t)(p[0] | p[1] << 8));
}

static float bf16(const uint8_t *p)
{
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element e (0..31) of a 32-element block with 16 bytes of nibbles: the
 * low nibbles are elements 0..15, the high ones 16..31. */
static unsigned nibble(const uint8_t *qs, unsigned e)
{
    return e < 16 ? qs[e] & 0x0fu : qs[e - 16] >> 4;
}

static unsigned high_bit(const uint8_t *qh, unsigned e)
{
    uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 |
                 (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
    return (h >> e) & 1u;
}

static void block32(uint32_t type, const uint8_t *b, float *y)
{
    float d = f16(b);
    switch (type) {
    case 8: /* Q8_0: d, 32 x int8 */
        for (unsigned e = 0; e < 32; e++)
            y[e] = (float)(int8_t)b[2 + e] * d;
        break;
    case 2: /* Q4_0: d, 16 bytes of nibbles, minus 8 */
        for (unsigned e = 0; e < 32; e++)
            y[e] = d * (float)((int)nibble(b + 2, e) - 8);
        break;
    case 3: { /* Q4_1: d, m, nibbles */
        float m = f16(b + 2);
        for (unsigned e = 0; e < 32; e++)
            y[e] = d * (float)nibble(b + 4, e) + m;
        break;
    }
    case 6: /* Q5_0: d, 32 high bits, nibbles, minus 16 */
        for (unsigned e = 0; e < 32; e++)
            y[e] = d * (float)((int)(nibble(b + 6, e) |
                                     high_bit(b + 2, e) << 4) - 16);
        break;
    case 7: { /* Q5_1: d, m, 32 high bits, nibbles */
        float m = f16(b + 2);
        for (unsigned e = 0; e < 32; e++)
            y[e] = d * (float)(nibble(b + 8, e) | high_bit(b + 4, e) << 4) +
                   m;
        break;
    }
    }
}

laden_status laden_gguf_dequantize(uint32_t type, const void *src,
                                   uint64_t src_bytes, float *dst,
                                   uint64_t n_elems)
{
    uint32_t be, bb;
    laden_status s = laden_gguf_type_block(type, &be, &bb);
    if (s)
        return s;
    if ((!src && src_bytes) || (!dst && n_elems))
        return laden__fail(LADEN_E_INVAL, "laden_gguf_dequantize: NULL");
    if (n_elems % be || n_elems / be * bb != src_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_gguf_dequantize: %llu "
                           "elements of %s take %llu bytes, not %llu",
                           (unsigned long long)n_elems,
                           laden_gguf_type_name(type),
                           (unsigned long long)(n_elems / be * bb),
                           (unsigned long long)src_bytes);
    const uint8_t *p = src;
    switch (type) {
    case 0:
        memcpy(dst, src, (size_t)n_elems * 4);
        return LADEN_OK;
    case 1:
        for (uint64_t i = 0; i < n_elems; i++)
            dst[i] = f16(p + 2 * i);
        return LADEN_OK;
    case 30:
        for (uint64_t i = 0; i < n_elems; i++)
            dst[i] = bf16(p + 2 * i);
        return LADEN_OK;
    case 2: case 3: case 6: case 7: case 8:
        for (uint64_t k = 0; k < n_elems / 32; k++)
            block32(type, p + k * bb, dst + k * 32);
        return LADEN_OK;
    default:
        return laden__fail(LADEN_E_UNSUPPORTED, "expanding %s on the CPU is "
                           "not built yet (F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
                           "Q5_0 and Q5_1 are)", laden_gguf_type_name(type));
    }
}
