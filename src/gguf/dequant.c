/* GGUF block types expanded to float32 on the CPU, with the reference's
 * arithmetic: each value rounded as ggml and the gguf package round it
 * (float32, a multiply then an add, never fused: this file is compiled
 * with -ffp-contract=off). */
#include <string.h>

#include "../core/internal.h"
#include "laden/gguf.h"

/* Little-endian halves, decoded by core's scalar conversions (the ones
 * every layer uses). */
static float f16(const uint8_t *p)
{
    return laden__f32_of_f16((uint16_t)(p[0] | p[1] << 8));
}

static float bf16(const uint8_t *p)
{
    return laden__f32_of_bf16((uint16_t)(p[0] | p[1] << 8));
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

/* The 6-bit scales and mins of Q4_K and Q5_K sub-blocks j = 0..7, as
 * packed in 12 bytes. */
static void scale_min(const uint8_t *s, unsigned j, unsigned *sc, unsigned *mn)
{
    if (j < 4) {
        *sc = s[j] & 63u;
        *mn = s[4 + j] & 63u;
    } else {
        *sc = (s[4 + j] & 0x0fu) | ((s[j - 4] >> 2) & 0x30u);
        *mn = (s[4 + j] >> 4) | ((s[j] >> 2) & 0x30u);
    }
}

/* Q4_K (144 bytes) and Q5_K (176): d, dmin, 12 bytes of scales, [32
 * bytes of high bits,] 128 bytes of nibbles; 8 sub-blocks of 32. */
static void block_k45(uint32_t type, const uint8_t *b, float *y)
{
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *sc6 = b + 4, *qh = b + 16;
    const uint8_t *qs = type == 13 ? b + 48 : b + 16;
    for (unsigned j = 0; j < 8; j++) {
        unsigned sc, mn;
        scale_min(sc6, j, &sc, &mn);
        float dd = d * (float)sc, dm = dmin * (float)mn;
        for (unsigned i = 0; i < 32; i++) {
            uint8_t byte = qs[(j / 2) * 32 + i];
            unsigned q = j % 2 ? byte >> 4 : byte & 0x0fu;
            if (type == 13)
                q |= ((qh[i] >> j) & 1u) << 4;
            y[j * 32 + i] = dd * (float)q - dm;
        }
    }
}

/* Q6_K (210 bytes): 128 bytes of low nibbles, 64 of 2-bit highs, 16
 * int8 scales, d; 16 sub-blocks of 16. */
static void block_q6k(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    float d = f16(b + 208);
    for (unsigned e = 0; e < 256; e++) {
        unsigned h = e / 128, w = e % 128;
        unsigned lo = (ql[h * 64 + w % 64] >> (4 * (w / 64))) & 0x0fu;
        unsigned hi = (qh[h * 32 + w % 32] >> (2 * (w / 32))) & 3u;
        float ds = d * (float)(int8_t)b[192 + e / 16];
        y[e] = ds * (float)((int)(lo | hi << 4) - 32);
    }
}

/* Q2_K (84 bytes): 16 bytes of 4-bit scale and min, 64 of 2-bit
 * values, d, dmin; 16 sub-blocks of 16. */
static void block_q2k(const uint8_t *b, float *y)
{
    const uint8_t *sc = b, *qs = b + 16;
    float d = f16(b + 80), dmin = f16(b + 82);
    for (unsigned e = 0; e < 256; e++) {
        unsigned g = e / 128, w = e % 128, k = e / 16;
        unsigned q = (qs[g * 32 + w % 32] >> (2 * (w / 32))) & 3u;
        float dl = d * (float)(sc[k] & 0x0fu), ml = dmin * (float)(sc[k] >> 4);
        y[e] = dl * (float)q - ml;
    }
}

/* Q3_K (110 bytes): 32 bytes of high-bit mask, 64 of 2-bit values, 12 of
 * 6-bit signed scales, d; 16 sub-blocks of 16.  A mask bit of 0 takes 4
 * off the value. */
static void block_q3k(const uint8_t *b, float *y)
{
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    float d = f16(b + 108);
    for (unsigned e = 0; e < 256; e++) {
        unsigned k = e / 16;
        unsigned ls = (k < 8 ? sc[k] : sc[k - 8] >> 4) & 0x0fu;
        unsigned hs = (sc[8 + k % 4] >> (2 * (k / 4))) & 3u;
        float dl = d * (float)((int)(ls | hs << 4) - 32);
        unsigned g = e / 128, w = e % 128;
        int ql = (qs[g * 32 + w % 32] >> (2 * (w / 32))) & 3;
        int qh = ((hm[e % 32] >> (e / 32)) & 1) ^ 1;
        y[e] = dl * (float)(ql - (qh << 2));
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
    case 12: case 13:
        for (uint64_t k = 0; k < n_elems / 256; k++)
            block_k45(type, p + k * bb, dst + k * 256);
        return LADEN_OK;
    case 14:
        for (uint64_t k = 0; k < n_elems / 256; k++)
            block_q6k(p + k * bb, dst + k * 256);
        return LADEN_OK;
    case 10: case 11:
        for (uint64_t k = 0; k < n_elems / 256; k++)
            (type == 10 ? block_q2k : block_q3k)(p + k * bb, dst + k * 256);
        return LADEN_OK;
    default:
        return laden__fail(LADEN_E_UNSUPPORTED, "expanding %s on the CPU is "
                           "not built yet (F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
                           "Q5_0, Q5_1 and Q2_K to Q6_K are)",
                           laden_gguf_type_name(type));
    }
}
