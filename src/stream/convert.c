/* dtype conversion on load: F32, F16 and BF16 into each other, fp8
 * decoded, and F32/F16/BF16 quantized to F8_E4M3 with a scale per row.
 * Rounding is to nearest even, as torch's. */
#include <math.h>
#include <string.h>

#include "laden/gguf.h"
#include "../core/internal.h"
#include "stream_convert.h"

/* The scalar conversions are core's (src/core/dtype_internal.h): the
 * loops here call them once per element. */

static float load_f(laden_dtype d, const void *p, uint64_t i)
{
    switch (d) {
    case LADEN_DTYPE_F8_E4M3:
        return laden__f32_of_e4m3(((const uint8_t *)p)[i]);
    case LADEN_DTYPE_F8_E5M2:
        return laden__f32_of_e5m2(((const uint8_t *)p)[i]);
    case LADEN_DTYPE_F32: {
        float f;
        memcpy(&f, (const char *)p + 4 * i, 4);
        return f;
    }
    case LADEN_DTYPE_F16: {
        uint16_t h;
        memcpy(&h, (const char *)p + 2 * i, 2);
        return laden__f32_of_f16(h);
    }
    default: {
        uint16_t h;
        memcpy(&h, (const char *)p + 2 * i, 2);
        return laden__f32_of_bf16(h);
    }
    }
}

/* n elements of `from` (a float or fp8 dtype) as float32, and n float32
 * as `to` (F16 or BF16).  The dtype is picked once per call, not per
 * element, so that each loop is one conversion the compiler keeps tight:
 * the gradient sink lands its sums through laden_sched_convert. */
static inline void put_f32(uint8_t *out, uint64_t i, float f)
{
    memcpy(out + 4 * i, &f, 4);
}

static void floats_of(laden_dtype from, const void *src, void *dst,
                      uint64_t n)
{
    const uint8_t *p = src;
    uint8_t *out = dst; /* stored through memcpy: dst may be unaligned */
    switch (from) {
    case LADEN_DTYPE_F8_E4M3:
        for (uint64_t i = 0; i < n; i++)
            put_f32(out, i, laden__f32_of_e4m3(p[i]));
        return;
    case LADEN_DTYPE_F8_E5M2:
        for (uint64_t i = 0; i < n; i++)
            put_f32(out, i, laden__f32_of_e5m2(p[i]));
        return;
    case LADEN_DTYPE_F32:
        memcpy(out, src, n * 4);
        return;
    case LADEN_DTYPE_F16:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            put_f32(out, i, laden__f32_of_f16(h));
        }
        return;
    default:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            put_f32(out, i, laden__f32_of_bf16(h));
        }
        return;
    }
}

static void floats_to(const float *in, laden_dtype to, void *dst,
                      uint64_t n)
{
    uint8_t *p = dst;
    if (to == LADEN_DTYPE_F32) {
        memcpy(dst, in, n * 4);
        return;
    }
    bool f16 = to == LADEN_DTYPE_F16;
    if (f16)
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h = laden__f16_of_f32(in[i]);
            memcpy(p + 2 * i, &h, 2);
        }
    else
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h = laden__bf16_of_f32(in[i]);
            memcpy(p + 2 * i, &h, 2);
        }
}

bool laden__convertible(laden_dtype d)
{
    return d == LADEN_DTYPE_F32 || d == LADEN_DTYPE_F16 ||
           d == LADEN_DTYPE_BF16;
}

static bool is_block(laden_dtype d)
{
    return d >= LADEN_DTYPE_Q4_0 && d <= LADEN_DTYPE_Q6_K;
}

/* Sources that decode to float: the three floats, fp8 and GGUF's block
 * types (as the gguf reference dequantizes them). */
bool laden__decodable(laden_dtype d)
{
    return laden__convertible(d) || laden__fp8(d) || is_block(d);
}

bool laden__fp8(laden_dtype d)
{
    return d == LADEN_DTYPE_F8_E4M3 || d == LADEN_DTYPE_F8_E5M2;
}

/* A block type's n elements expanded to float32 a run of blocks at a
 * time, then rounded once to `to`. */
static laden_status convert_blocks(laden_dtype from, const void *src,
                                   laden_dtype to, void *dst, uint64_t n)
{
    uint32_t be, bb;
    laden_status s = laden_dtype_block(from, &be, &bb);
    if (s)
        return s;
    if (n % be)
        return laden__fail(LADEN_E_SHAPE,
                           "%llu elements of %s are not whole blocks of %u",
                           (unsigned long long)n, laden_dtype_name(from), be);
    uint32_t ggml = laden_ggml_of_dtype(from);
    if (to == LADEN_DTYPE_F32)
        return laden_gguf_dequantize(ggml, src, n / be * bb, dst, n);
    enum { RUN = 4096 }; /* a multiple of every block's elements */
    float tmp[RUN];
    for (uint64_t at = 0; at < n; at += RUN) {
        uint64_t k = n - at < RUN ? n - at : RUN;
        if ((s = laden_gguf_dequantize(ggml, (const char *)src + at / be * bb,
                                       k / be * bb, tmp, k)))
            return s;
        if ((s = laden_sched_convert(LADEN_DTYPE_F32, tmp, to,
                                     (char *)dst + 2 * at, k)))
            return s;
    }
    return LADEN_OK;
}

/* Quantizes rows x cols floats to e4m3 with one float32 scale per row
 * (amax / 448), scales stored after the data at scale_off. */
void laden__quantize_rows(laden_dtype from, const void *src, uint64_t rows,
                          uint64_t cols, uint8_t *dst, float *scales)
{
    for (uint64_t r = 0; r < rows; r++) {
        float amax = 0.0f;
        for (uint64_t c = 0; c < cols; c++) {
            float v = fabsf(load_f(from, src, r * cols + c));
            if (v > amax && !isnan(v))
                amax = v;
        }
        float scale = amax > 0.0f && isfinite(amax) ? amax / 448.0f : 1.0f;
        float inv = 1.0f / scale;
        for (uint64_t c = 0; c < cols; c++)
            dst[r * cols + c] =
                laden__e4m3_of_f32(load_f(from, src, r * cols + c) * inv);
        memcpy(&scales[r], &scale, sizeof scale);
    }
}

laden_status laden_sched_convert(laden_dtype from, const void *src,
                                 laden_dtype to, void *dst, uint64_t n)
{
    if (!laden__decodable(from) || !laden__convertible(to))
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "cannot convert %s to %s (F32, F16, BF16, fp8 "
                           "and GGUF's block types to F32, F16, BF16)",
                           laden_dtype_name(from) ? laden_dtype_name(from)
                                                  : "?",
                           laden_dtype_name(to) ? laden_dtype_name(to) : "?");
    if (n && (!src || !dst))
        return laden__fail(LADEN_E_INVAL, "laden_sched_convert: NULL buffer");
    if (from == to) {
        memcpy(dst, src, n * (laden_dtype_bits(from) / 8));
        return LADEN_OK;
    }
    if (is_block(from))
        return convert_blocks(from, src, to, dst, n);
    if (to == LADEN_DTYPE_F32) {
        floats_of(from, src, dst, n);
        return LADEN_OK;
    }
    enum { RUN = 1024 }; /* floats in a stack buffer, in cache */
    float tmp[RUN];
    uint32_t ss = laden_dtype_bits(from) / 8;
    for (uint64_t at = 0; at < n; at += RUN) {
        uint64_t k = n - at < RUN ? n - at : RUN;
        floats_of(from, (const char *)src + at * ss, tmp, k);
        floats_to(tmp, to, (char *)dst + 2 * at, k);
    }
    return LADEN_OK;
}

/* GGUF's Llama q/k rows: head h's row 2i + j holds transformers' row
 * j * d/2 + i (d rows per head): llama.cpp's converter interleaves the
 * two rotary halves; this undoes it. */
void laden__unrope_rows(const void *src, void *dst, uint64_t n_rows,
                        uint64_t row_bytes, uint64_t heads)
{
    uint64_t d = n_rows / heads, half = d / 2;
    for (uint64_t h = 0; h < heads; h++)
        for (uint64_t i = 0; i < half; i++)
            for (uint64_t j = 0; j < 2; j++)
                memcpy((char *)dst + (h * d + j * half + i) * row_bytes,
                       (const char *)src + (h * d + 2 * i + j) * row_bytes,
                       row_bytes);
}
