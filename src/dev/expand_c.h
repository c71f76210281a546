/* The expansion and lossless kernels' C build: the C prologue (loads,
 * stores, bit casts, the paired roundings as the C code does them) and
 * expand_kernels.h compiled as C.  Included by expand.c, where the CPU
 * device runs the kernels, and by tests/fake_cuda, whose stand-in driver
 * runs the same code for a launch of the CUDA kernels.  Compile with
 * -ffp-contract=off: the kernels' rounding is the reference's only
 * without fused multiply-adds. */
#ifndef LADEN_EXPAND_C_H
#define LADEN_EXPAND_C_H

#include <stdint.h>
#include <string.h>

/* The same said to clang, for the code below. */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
#define EX_FN static inline
#define EX_UNROLL
#define EX_BATCH 1u

static inline u32 ex_ld8(u64 a)
{
    return *(const uint8_t *)(uintptr_t)a;
}
static inline u32 ex_ld16(u64 a, u32 vec)
{
    uint16_t x;
    memcpy(&x, (const void *)(uintptr_t)a, 2);
    return x;
}
static inline u32 ex_ld32(u64 a, u32 vec)
{
    uint32_t x;
    memcpy(&x, (const void *)(uintptr_t)a, 4);
    return x;
}
static inline void ex_ld2x32(u64 a, u32 vec, u32 *x, u32 *y)
{
    *x = ex_ld32(a, vec);
    *y = ex_ld32(a + 4u, vec);
}
static inline void ex_st16(u64 a, u32 h)
{
    uint16_t x = (uint16_t)h;
    memcpy((void *)(uintptr_t)a, &x, 2);
}
static inline void ex_st32(u64 a, u32 w)
{
    memcpy((void *)(uintptr_t)a, &w, 4);
}
static inline void ex_st4x32(u64 a, u32 x, u32 y, u32 z, u32 w)
{
    u32 v[4] = {x, y, z, w};
    memcpy((void *)(uintptr_t)a, v, 16);
}
static inline float ex_u2f(u32 x)
{
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static inline u32 ex_f2u(float f)
{
    u32 x;
    memcpy(&x, &f, 4);
    return x;
}
#define ex_hw_bf16x2(lo, hi) \
    (ex_sw_bf16(ex_f2u(lo)) | ex_sw_bf16(ex_f2u(hi)) << 16)
#define ex_hw_f16x2(lo, hi) (ex_sw_f16(ex_f2u(lo)) | ex_sw_f16(ex_f2u(hi)) << 16)

#define EX(...) __VA_ARGS__
#include "expand_kernels.h"
#undef EX

#endif
