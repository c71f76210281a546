/* The dtype facts other layers need beyond include/laden/dtype.h, and the
 * scalar conversions between the float formats.  The conversions are
 * inline: every element loop (conversion on load, dequantization, the
 * gradient sum) calls them once per element, and a call per element
 * would cost more than the arithmetic.  Rounding is to nearest even, as
 * torch's.  Not installed. */
#ifndef LADEN_CORE_DTYPE_INTERNAL_H
#define LADEN_CORE_DTYPE_INTERNAL_H

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "laden/dtype.h"

/* The dtype a safetensors header names ("BF16"); false for a name that is
 * not one, and for the block types (a safetensors header never holds
 * them). */
bool laden__dtype_of_name(const char *name, laden_dtype *out);

/* A ggml type number's name and block (elements, bytes), for every type
 * ggml defines, held by laden or not; false for a number ggml does not
 * define. */
bool laden__ggml_type(uint32_t type, const char **name, uint32_t *elems,
                      uint32_t *bytes);

static inline float laden__f32_of_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t laden__bits_of_f32(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* IEEE half to float, exactly. */
static inline float laden__f32_of_f16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f)
        return laden__f32_of_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* man * 2^-24 */
        return sign ? -f : f;
    }
    return laden__f32_of_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Float to IEEE half, round to nearest even, a NaN made 0x7e00. */
static inline uint16_t laden__f16_of_f32(float f)
{
    uint32_t u = laden__bits_of_f32(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to >= 65520: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: subnormal or zero */
        /* Adding 0.5 aligns the mantissa so the FPU rounds to nearest even
         * at the half's subnormal step (2^-24). */
        float v = laden__f32_of_bits(a) + 0.5f;
        return (uint16_t)(sign |
                          (uint16_t)(laden__bits_of_f32(v) - 0x3f000000u));
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias exponent, round to nearest even */
    return (uint16_t)(sign | (uint16_t)(a >> 13));
}

/* bfloat16 to float, exactly: the top half of a float. */
static inline float laden__f32_of_bf16(uint16_t h)
{
    return laden__f32_of_bits((uint32_t)h << 16);
}

/* Float to bfloat16, round to nearest even, a NaN kept and made quiet:
 * the one rounding of every F32 -> BF16 conversion on the host. */
static inline uint16_t laden__bf16_of_f32(float f)
{
    uint32_t u = laden__bits_of_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float8 e4m3fn (bias 7, no infinities, 0x7f NaN, max 448) and e5m2
 * (bias 15, IEEE-like), decoded exactly. */
static inline float laden__f32_of_e4m3(uint8_t v)
{
    float sign = v & 0x80 ? -1.0f : 1.0f;
    unsigned e = (v >> 3) & 0xf, m = v & 7;
    if (e == 15 && m == 7)
        return NAN;
    if (e == 0)
        return sign * ldexpf((float)m, -9);
    return sign * ldexpf(1.0f + (float)m / 8.0f, (int)e - 7);
}

static inline float laden__f32_of_e5m2(uint8_t v)
{
    /* e5m2 is the top byte of a half */
    return laden__f32_of_f16((uint16_t)(v << 8));
}

/* Float to e4m3fn, round to nearest even, saturating to +-448 (as a
 * scaled quantization wants: values are within range by construction). */
static inline uint8_t laden__e4m3_of_f32(float x)
{
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (isnan(x))
        return (uint8_t)(sign | 0x7f);
    if (a >= 448.0f)
        return (uint8_t)(sign | 0x7e);
    if (a < 0.015625f) { /* below the smallest normal, 2^-6: step 2^-9 */
        float q = nearbyintf(a * 512.0f);
        return (uint8_t)(sign | (uint8_t)q); /* q == 8 is the min normal */
    }
    int e;
    float fr = frexpf(a, &e); /* a = fr * 2^e, fr in [0.5, 1) */
    float m = nearbyintf((fr * 2.0f - 1.0f) * 8.0f);
    int exp = e - 1 + 7;
    if (m >= 8.0f) {
        m = 0;
        exp++;
    }
    if (exp > 15 || (exp == 15 && m >= 7.0f))
        return (uint8_t)(sign | 0x7e);
    return (uint8_t)(sign | (uint8_t)(exp << 3) | (uint8_t)m);
}

#endif
