/* The expansion code, one source compiled twice: by the C compiler into
 * libladen (the CPU device runs it) and, as text, by NVRTC into the CUDA
 * kernels.  expand.c includes this file twice: once with EX(...) expanding
 * to its argument (C code), once with EX(...) expanding to the argument as
 * a string literal (the kernel source).  So:
 *  - everything here is inside EX(...), one block per function (NVRTC's
 *    log then names a block by its line number);
 *  - no preprocessor directives inside EX(...): what differs between the
 *    C compiler and NVRTC is in the two prologues in expand.c (types u8 ..
 *    u64, EX_FN, EX_UNROLL, loads ex_ld*, stores ex_st*, bit casts
 *    ex_u2f/ex_f2u, the paired roundings ex_hw_*);
 *  - the code is C11 and C++17 at once (no bool, casts written out).
 *
 * The work: unit u is output elements [8u, 8u + 8): one 16-byte store of
 * F16/BF16 (two of F32).  A CUDA thread takes units u, u + stride, ...
 * (grid-stride loop), EX_BATCH of them at once: loads for all first, then
 * the results, so each thread has EX_BATCH sets of loads in flight.  Consecutive threads write
 * consecutive 16 bytes: a warp's stores fill whole lines.
 *
 * Exactness: every float operation is the reference's, in its order
 * (src/gguf/dequant.c; fp8: value x scale), compiled without contraction
 * (-ffp-contract=off, NVRTC --fmad=false) or flushing of subnormals.
 * Small integers become floats through the exponent of 2^23 (0x4B000000
 * | q is 2^23 + q; minus 2^23 is q exactly): the same value as the
 * reference's int-to-float conversion, without the slower conversion
 * instruction.
 *
 * Clean and not: a unit whose scales are finite (and, for fp8, whose
 * bytes hold no NaN or infinity code) cannot produce a NaN, so it is
 * rounded two at a time with the device's conversion instruction
 * (ex_hw_*, IEEE round to nearest even, the same bits as the C rounding
 * for every value but NaN) and stored 16 bytes at once.  Any other unit is
 * finished element by element with the C rounding, which gives every NaN
 * as the one quiet NaN. */

EX(
enum { EX_Q4_0, EX_Q4_1, EX_Q5_0, EX_Q5_1, EX_Q8_0, EX_Q2_K, EX_Q3_K,
       EX_Q4_K, EX_Q5_K, EX_Q6_K, EX_E4M3, EX_E5M2, EX_F16, EX_BF16, EX_F32,
       EX_NFMT };
enum { EX_OUT_F32, EX_OUT_F16, EX_OUT_BF16 };
enum { EX_SCALE_NONE, EX_SCALE_TENSOR, EX_SCALE_ROW, EX_SCALE_TILE };

/* The kernels' one argument, passed by value: the same layout on both
 * sides (only 8- and 4-byte fields). */
typedef struct ex_params {
    u64 src, dst, scale; /* addresses */
    u64 n;               /* elements */
    u64 units;           /* ceil(n / 8) */
    u64 cols;            /* elements per row (fp8 ROW, TILE) */
    u64 tcols;           /* tiles per row, ceil(cols / 128) */
    u32 fmt, out, kind;  /* EX_<format>, EX_OUT_<dtype>, EX_SCALE_<kind> */
    u32 n32;             /* n < 2^32: rows by 32-bit division */
} ex_params;

/* What one unit loaded, by format (see each ex_load_*). */
typedef struct ex_raw {
    u32 w[8];
} ex_raw;
)

EX(
/* (float)q, exactly, for q < 2^23. */
EX_FN float ex_i2f(u32 q)
{
    return ex_u2f(0x4B000000u | q) - 8388608.0f;
}

/* IEEE half to float, exactly (as laden__f32_of_f16). */
EX_FN float ex_f16f(u32 h)
{
    u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu)
        return ex_u2f(sign | 0x7f800000u | (m << 13));
    if (e == 0u) {
        float f = ex_i2f(m) * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    return ex_u2f(sign | ((e + 112u) << 23) | (m << 13));
}

/* A half's exponent is not all ones: it is finite. */
EX_FN u32 ex_fin16(u32 h)
{
    return (h & 0x7c00u) != 0x7c00u;
}

/* Byte i (0..7) of the eight bytes held in r->w[k], r->w[k + 1]. */
EX_FN u32 ex_byte(const ex_raw *r, u32 k, u32 i)
{
    return (r->w[k + (i >> 2)] >> (8u * (i & 3u))) & 0xffu;
}

/* Four bytes at an address aligned to 2 (vec) or not. */
EX_FN u32 ex_ld32a2(u64 a, u32 vec)
{
    return ex_ld16(a, vec) | ex_ld16(a + 2u, vec) << 16;
}
)

EX(
/* float bits to bf16, round to nearest even; NaN: 0x7fc0. */
EX_FN u32 ex_sw_bf16(u32 x)
{
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0u;
    return (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}

/* float bits to half, round to nearest even (laden_sched_convert's
 * arithmetic); NaN: 0x7e00. */
EX_FN u32 ex_sw_f16(u32 x)
{
    u32 sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u)
        return 0x7e00u;
    if (a >= 0x477ff000u) /* rounds to 65520 or more: infinity */
        return sign | 0x7c00u;
    if (a < 0x38800000u) /* below 2^-14: adding 0.5 rounds at 2^-24 */
        return sign | (ex_f2u(ex_u2f(a) + 0.5f) - 0x3f000000u);
    return sign | (((a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13) & 0xffffu);
}

/* float bits, NaN made the one quiet NaN. */
EX_FN u32 ex_canon(u32 x)
{
    return (x & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : x;
}

/* Element e of the output: the slow, exact path for any value. */
EX_FN void ex_out1(const ex_params *p, u64 e, float v)
{
    u32 x = ex_f2u(v);
    if (p->out == EX_OUT_F32)
        ex_st32(p->dst + 4u * e, ex_canon(x));
    else
        ex_st16(p->dst + 2u * e,
                p->out == EX_OUT_F16 ? ex_sw_f16(x) : ex_sw_bf16(x));
}

/* Unit u of the output from eight values none of which is NaN. */
EX_FN void ex_out8(const ex_params *p, u64 u, const float *v, u32 vec)
{
    u32 w[4];
    if (p->out == EX_OUT_F32) {
        u64 a = p->dst + 32u * u;
        if (vec) {
            ex_st4x32(a, ex_f2u(v[0]), ex_f2u(v[1]), ex_f2u(v[2]),
                      ex_f2u(v[3]));
            ex_st4x32(a + 16u, ex_f2u(v[4]), ex_f2u(v[5]), ex_f2u(v[6]),
                      ex_f2u(v[7]));
        } else {
            EX_UNROLL for (u32 i = 0; i < 8u; i++)
                ex_st32(a + 4u * i, ex_f2u(v[i]));
        }
        return;
    }
    if (p->out == EX_OUT_F16) {
        EX_UNROLL for (u32 i = 0; i < 4u; i++)
            w[i] = ex_hw_f16x2(v[2u * i], v[2u * i + 1u]);
    } else {
        EX_UNROLL for (u32 i = 0; i < 4u; i++)
            w[i] = ex_hw_bf16x2(v[2u * i], v[2u * i + 1u]);
    }
    u64 a = p->dst + 16u * u;
    if (vec) {
        ex_st4x32(a, w[0], w[1], w[2], w[3]);
    } else {
        EX_UNROLL for (u32 i = 0; i < 4u; i++) {
            ex_st16(a + 4u * i, w[i] & 0xffffu);
            ex_st16(a + 4u * i + 2u, w[i] >> 16);
        }
    }
}

/* A unit of a block type: clean, at once; else element by element. */
EX_FN void ex_fin8(const ex_params *p, u64 u, const float *v, u32 clean,
                   u32 vec)
{
    if (clean) {
        ex_out8(p, u, v, vec);
        return;
    }
    for (u32 i = 0; i < 8u; i++)
        ex_out1(p, 8u * u + i, v[i]);
}
)

EX(
/* Q8_0 (34 bytes: d, 32 x int8), four units a block.  w0 d, w1..2 the
 * unit's 8 int8s.  Blocks are 2-byte aligned. */
EX_FN void ex_load_q8_0(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u64 b = p->src + (u >> 2) * 34u, q = b + 2u + 8u * ((u32)u & 3u);
    r->w[0] = ex_ld16(b, vec);
    r->w[1] = ex_ld32a2(q, vec);
    r->w[2] = ex_ld32a2(q + 4u, vec);
}

EX_FN void ex_emit_q8_0(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    float d = ex_f16f(r->w[0]), v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++)
        v[i] = (ex_u2f(0x4B000000u | (ex_byte(r, 1, i) ^ 0x80u)) -
                8388736.0f) * d;
    ex_fin8(p, u, v, ex_fin16(r->w[0]), vec);
}

/* Q4_0 (18 bytes: d, 16 bytes of nibbles; elements 0..15 low nibbles,
 * 16..31 high).  w0 d, w1..2 the 8 bytes the unit's nibbles are in. */
EX_FN void ex_load_q4_0(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u64 b = p->src + (u >> 2) * 18u, q = b + 2u + 8u * ((u32)u & 1u);
    r->w[0] = ex_ld16(b, vec);
    r->w[1] = ex_ld32a2(q, vec);
    r->w[2] = ex_ld32a2(q + 4u, vec);
}

EX_FN void ex_emit_q4_0(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    u32 sh = 4u * (((u32)u >> 1) & 1u);
    float d = ex_f16f(r->w[0]), v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++) /* d * (float)(q - 8) */
        v[i] = d * (ex_u2f(0x4B000000u | ((ex_byte(r, 1, i) >> sh) & 15u)) -
                    8388616.0f);
    ex_fin8(p, u, v, ex_fin16(r->w[0]), vec);
}
)

EX(
/* Q4_1 (20 bytes: d, m, nibbles; 4-byte aligned).  w0 d | m << 16. */
EX_FN void ex_load_q4_1(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u64 b = p->src + (u >> 2) * 20u, q = b + 4u + 8u * ((u32)u & 1u);
    r->w[0] = ex_ld32(b, vec);
    r->w[1] = ex_ld32(q, vec);
    r->w[2] = ex_ld32(q + 4u, vec);
}

EX_FN void ex_emit_q4_1(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    u32 sh = 4u * (((u32)u >> 1) & 1u);
    float d = ex_f16f(r->w[0] & 0xffffu), m = ex_f16f(r->w[0] >> 16), v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++)
        v[i] = d * ex_i2f((ex_byte(r, 1, i) >> sh) & 15u) + m;
    ex_fin8(p, u, v, ex_fin16(r->w[0]) & ex_fin16(r->w[0] >> 16), vec);
}

/* Q5_0 (22 bytes: d, 32 high bits, nibbles; 2-byte aligned).  w0 d, w1..2
 * nibbles, w3 the high bits. */
EX_FN void ex_load_q5_0(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u64 b = p->src + (u >> 2) * 22u, q = b + 6u + 8u * ((u32)u & 1u);
    r->w[0] = ex_ld16(b, vec);
    r->w[3] = ex_ld32a2(b + 2u, vec);
    r->w[1] = ex_ld32a2(q, vec);
    r->w[2] = ex_ld32a2(q + 4u, vec);
}

EX_FN void ex_emit_q5_0(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    u32 part = (u32)u & 3u, sh = 4u * (part >> 1);
    float d = ex_f16f(r->w[0]), v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++) { /* d * (float)(q - 16) */
        u32 q = ((ex_byte(r, 1, i) >> sh) & 15u) |
                ((r->w[3] >> (8u * part + i)) & 1u) << 4;
        v[i] = d * (ex_u2f(0x4B000000u | q) - 8388624.0f);
    }
    ex_fin8(p, u, v, ex_fin16(r->w[0]), vec);
}

/* Q5_1 (24 bytes: d, m, 32 high bits, nibbles; 8-byte aligned). */
EX_FN void ex_load_q5_1(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u64 b = p->src + (u >> 2) * 24u;
    r->w[0] = ex_ld32(b, vec);
    r->w[3] = ex_ld32(b + 4u, vec);
    ex_ld2x32(b + 8u + 8u * ((u32)u & 1u), vec, &r->w[1], &r->w[2]);
}

EX_FN void ex_emit_q5_1(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    u32 part = (u32)u & 3u, sh = 4u * (part >> 1);
    float d = ex_f16f(r->w[0] & 0xffffu), m = ex_f16f(r->w[0] >> 16), v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++) {
        u32 q = ((ex_byte(r, 1, i) >> sh) & 15u) |
                ((r->w[3] >> (8u * part + i)) & 1u) << 4;
        v[i] = d * ex_i2f(q) + m;
    }
    ex_fin8(p, u, v, ex_fin16(r->w[0]) & ex_fin16(r->w[0] >> 16), vec);
}
)

EX(
/* Q2_K (84 bytes: 16 scale/min bytes, 64 bytes of 2-bit values, d, dmin;
 * 4-byte aligned), 32 units a block.  w0 d | dmin << 16, w1 the unit's
 * scale byte, w2..3 the 8 bytes its values are in. */
EX_FN void ex_load_q2_k(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u32 part = (u32)u & 31u;
    u64 b = p->src + (u >> 5) * 84u;
    u64 q = b + 16u + 32u * (part >> 4) + 8u * (part & 3u);
    r->w[0] = ex_ld32(b + 80u, vec);
    r->w[1] = ex_ld8(b + (part >> 1));
    r->w[2] = ex_ld32(q, vec);
    r->w[3] = ex_ld32(q + 4u, vec);
}

EX_FN void ex_emit_q2_k(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    u32 part = (u32)u & 31u, sh = 2u * ((part >> 2) & 3u);
    float d = ex_f16f(r->w[0] & 0xffffu), dmin = ex_f16f(r->w[0] >> 16);
    float dl = d * ex_i2f(r->w[1] & 15u), ml = dmin * ex_i2f(r->w[1] >> 4);
    float v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++)
        v[i] = dl * ex_i2f((ex_byte(r, 2, i) >> sh) & 3u) - ml;
    ex_fin8(p, u, v, ex_fin16(r->w[0]) & ex_fin16(r->w[0] >> 16), vec);
}

/* Q3_K (110 bytes: 32 bytes of high-bit mask, 64 of 2-bit values, 12 of
 * scales, d; 2-byte aligned).  w0 d, w1 the byte with the scale's low 4
 * bits, w2 the one with its high 2, w3..4 mask bytes, w5..6 value bytes. */
EX_FN void ex_load_q3_k(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u32 part = (u32)u & 31u, k = part >> 1;
    u64 b = p->src + (u >> 5) * 110u;
    u64 m = b + 8u * (part & 3u), q = b + 32u + 32u * (part >> 4) +
                                      8u * (part & 3u);
    r->w[0] = ex_ld16(b + 108u, vec);
    r->w[1] = ex_ld8(b + 96u + (k & 7u));
    r->w[2] = ex_ld8(b + 104u + (k & 3u));
    r->w[3] = ex_ld32a2(m, vec);
    r->w[4] = ex_ld32a2(m + 4u, vec);
    r->w[5] = ex_ld32a2(q, vec);
    r->w[6] = ex_ld32a2(q + 4u, vec);
}

EX_FN void ex_emit_q3_k(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    u32 part = (u32)u & 31u, k = part >> 1;
    u32 sh = 2u * ((part >> 2) & 3u), hsh = part >> 2;
    u32 ls = (k < 8u ? r->w[1] : r->w[1] >> 4) & 15u;
    u32 hs = (r->w[2] >> (2u * (k >> 2))) & 3u;
    /* dl = d * (float)(scale - 32); value = dl * (float)(ql - 4 * !bit) */
    float dl = ex_f16f(r->w[0]) * (ex_u2f(0x4B000000u | ls | hs << 4) -
                                   8388640.0f);
    float v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++) {
        u32 q = ((ex_byte(r, 5, i) >> sh) & 3u) |
                ((ex_byte(r, 3, i) >> hsh) & 1u) << 2;
        v[i] = dl * (ex_u2f(0x4B000000u | q) - 8388612.0f);
    }
    ex_fin8(p, u, v, ex_fin16(r->w[0]), vec);
}
)

EX(
/* Q4_K (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 of
 * nibbles) and Q5_K (176: the same with 32 bytes of high bits before the
 * nibbles); 16-byte aligned.  w0 d | dmin << 16, w1..3 the scale bytes of
 * the unit's sub-block (see dequant.c's scale_min), w4..5 nibble bytes,
 * w6..7 high-bit bytes (Q5_K). */
EX_FN void ex_load_q45_k(const ex_params *p, u64 u, u32 vec, ex_raw *r,
                         u32 q5)
{
    u32 part = (u32)u & 31u, j = part >> 2, i0 = 8u * (part & 3u);
    u64 b = p->src + (u >> 5) * (q5 ? 176u : 144u), s = b + 4u;
    r->w[0] = ex_ld32(b, vec);
    r->w[1] = ex_ld8(s + (j & 3u));
    r->w[2] = ex_ld8(s + 4u + j);
    r->w[3] = j < 4u ? 0u : ex_ld8(s + j);
    ex_ld2x32(b + (q5 ? 48u : 16u) + 32u * (j >> 1) + i0, vec, &r->w[4],
              &r->w[5]);
    if (q5)
        ex_ld2x32(b + 16u + i0, vec, &r->w[6], &r->w[7]);
}

EX_FN void ex_emit_q45_k(const ex_params *p, u64 u, u32 vec,
                         const ex_raw *r, u32 q5)
{
    u32 part = (u32)u & 31u, j = part >> 2, sh = 4u * (j & 1u), sc, mn;
    if (j < 4u) {
        sc = r->w[1] & 63u;
        mn = r->w[2] & 63u;
    } else {
        sc = (r->w[2] & 15u) | ((r->w[1] >> 2) & 0x30u);
        mn = (r->w[2] >> 4) | ((r->w[3] >> 2) & 0x30u);
    }
    float d = ex_f16f(r->w[0] & 0xffffu), dmin = ex_f16f(r->w[0] >> 16);
    float dd = d * ex_i2f(sc), dm = dmin * ex_i2f(mn), v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++) {
        u32 q = (ex_byte(r, 4, i) >> sh) & 15u;
        if (q5)
            q |= ((ex_byte(r, 6, i) >> j) & 1u) << 4;
        v[i] = dd * ex_i2f(q) - dm;
    }
    ex_fin8(p, u, v, ex_fin16(r->w[0]) & ex_fin16(r->w[0] >> 16), vec);
}

/* Q6_K (210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8
 * scales, d; 2-byte aligned).  w0 d, w1 the unit's scale, w2..3 low
 * bytes, w4..5 high bytes. */
EX_FN void ex_load_q6_k(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u32 part = (u32)u & 31u, h = part >> 4, w = 8u * (part & 15u);
    u64 b = p->src + (u >> 5) * 210u;
    u64 lo = b + 64u * h + (w & 63u), hi = b + 128u + 32u * h + (w & 31u);
    r->w[0] = ex_ld16(b + 208u, vec);
    r->w[1] = ex_ld8(b + 192u + (part >> 1));
    r->w[2] = ex_ld32a2(lo, vec);
    r->w[3] = ex_ld32a2(lo + 4u, vec);
    r->w[4] = ex_ld32a2(hi, vec);
    r->w[5] = ex_ld32a2(hi + 4u, vec);
}

EX_FN void ex_emit_q6_k(const ex_params *p, u64 u, u32 vec, const ex_raw *r)
{
    u32 w = 8u * ((u32)u & 15u), lsh = 4u * (w >> 6), hsh = 2u * (w >> 5);
    /* ds = d * (float)(int8)scale; value = ds * (float)(q - 32) */
    float ds = ex_f16f(r->w[0]) *
               (ex_u2f(0x4B000000u | (r->w[1] ^ 0x80u)) - 8388736.0f);
    float v[8];
    EX_UNROLL for (u32 i = 0; i < 8u; i++) {
        u32 q = ((ex_byte(r, 2, i) >> lsh) & 15u) |
                ((ex_byte(r, 4, i) >> hsh) & 3u) << 4;
        v[i] = ds * (ex_u2f(0x4B000000u | q) - 8388640.0f);
    }
    ex_fin8(p, u, v, ex_fin16(r->w[0]), vec);
}
)

EX(
/* fp8, exactly: e4m3fn (bias 7, 0x7f/0xff NaN, no infinity) and e5m2
 * (bias 15, IEEE-like).  The fast decode puts the 7 bits below the sign
 * into a float's exponent and mantissa and multiplies by 2^(127 - bias):
 * exact for every finite code, subnormals included (the float is then
 * subnormal too, which the device keeps: no flush to zero). */
EX_FN float ex_f8_fast(u32 b, u32 e5)
{
    u32 sign = (b & 0x80u) << 24;
    if (e5)
        return ex_u2f(sign | (b & 0x7fu) << 21) * ex_u2f(0x77800000u);
    return ex_u2f(sign | (b & 0x7fu) << 20) * ex_u2f(0x7b800000u);
}

EX_FN float ex_f8_slow(u32 b, u32 e5)
{
    if (!e5 && (b & 0x7fu) == 0x7fu)
        return ex_u2f(0x7fc00000u);
    if (e5 && (b & 0x7cu) == 0x7cu)
        return ex_u2f((b & 3u) ? 0x7fc00000u
                               : ((b & 0x80u) << 24) | 0x7f800000u);
    return ex_f8_fast(b, e5);
}

/* Some byte of the four in w is a NaN (e4m3) or NaN/infinity (e5m2). */
EX_FN u32 ex_f8_special(u32 w, u32 e5)
{
    if (e5)
        return (((w & 0x7c7c7c7cu) + 0x04040404u) & 0x80808080u) != 0u;
    return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0u;
}

EX_FN void ex_rowcol(const ex_params *p, u64 e, u64 *row, u64 *col)
{
    u64 r = p->n32 ? (u64)((u32)e / (u32)p->cols) : e / p->cols;
    *row = r;
    *col = e - r * p->cols;
}

/* The scale of the element at row, col. */
EX_FN float ex_scale_at(const ex_params *p, u64 row, u64 col)
{
    if (p->kind == EX_SCALE_TENSOR)
        return ex_u2f(ex_ld32(p->scale, 1u));
    if (p->kind == EX_SCALE_ROW)
        return ex_u2f(ex_ld32(p->scale + 4u * row, 1u));
    return ex_u2f(ex_ld32(p->scale + 4u * ((row >> 7) * p->tcols +
                                           (col >> 7)), 1u));
}
)

EX(
/* w0..1 the unit's 8 bytes, w2 its scale (1.0 without), w3 1 when the
 * unit is whole and one scale covers it; else 0 (then it is done element
 * by element). */
EX_FN void ex_load_f8(const ex_params *p, u64 u, u32 vec, ex_raw *r)
{
    u64 e = 8u * u, row, col;
    r->w[3] = 0u;
    if (e + 8u > p->n)
        return;
    ex_ld2x32(p->src + e, vec, &r->w[0], &r->w[1]);
    if (p->kind == EX_SCALE_NONE) {
        r->w[2] = 0x3f800000u;
    } else if (p->kind == EX_SCALE_TENSOR) {
        r->w[2] = ex_ld32(p->scale, 1u);
    } else {
        ex_rowcol(p, e, &row, &col);
        if (col + 8u > p->cols ||
            (p->kind == EX_SCALE_TILE && (col & 127u) + 8u > 128u))
            return;
        r->w[2] = ex_f2u(ex_scale_at(p, row, col));
    }
    r->w[3] = 1u;
}

EX_FN void ex_emit_f8(const ex_params *p, u64 u, u32 vec, const ex_raw *r,
                      u32 e5)
{
    u64 e = 8u * u, end = e + 8u < p->n ? e + 8u : p->n, row = 0, col = 0;
    if (r->w[3] && (r->w[2] & 0x7f800000u) != 0x7f800000u &&
        !ex_f8_special(r->w[0], e5) && !ex_f8_special(r->w[1], e5)) {
        float s = ex_u2f(r->w[2]), v[8];
        EX_UNROLL for (u32 i = 0; i < 8u; i++)
            v[i] = ex_f8_fast(ex_byte(r, 0, i), e5) * s;
        ex_out8(p, u, v, vec);
        return;
    }
    if (p->kind >= EX_SCALE_ROW)
        ex_rowcol(p, e, &row, &col);
    for (; e < end; e++) {
        float x = ex_f8_slow(ex_ld8(p->src + e), e5);
        if (p->kind != EX_SCALE_NONE)
            x = x * ex_scale_at(p, row, col);
        ex_out1(p, e, x);
        if (++col == p->cols) {
            col = 0;
            row++;
        }
    }
}

/* F16, BF16, F32 to any of them: element by element. */
EX_FN void ex_emit_plain(const ex_params *p, u64 u, u32 vec, u32 fmt)
{
    u64 e = 8u * u, end = e + 8u < p->n ? e + 8u : p->n;
    for (; e < end; e++) {
        float x;
        if (fmt == EX_F32)
            x = ex_u2f(ex_ld32(p->src + 4u * e, vec));
        else if (fmt == EX_F16)
            x = ex_f16f(ex_ld16(p->src + 2u * e, vec));
        else
            x = ex_u2f(ex_ld16(p->src + 2u * e, vec) << 16);
        ex_out1(p, e, x);
    }
}
)

EX(
EX_FN void ex_load(const ex_params *p, u32 fmt, u64 u, u32 vec, ex_raw *r)
{
    switch (fmt) {
    case EX_Q4_0: ex_load_q4_0(p, u, vec, r); break;
    case EX_Q4_1: ex_load_q4_1(p, u, vec, r); break;
    case EX_Q5_0: ex_load_q5_0(p, u, vec, r); break;
    case EX_Q5_1: ex_load_q5_1(p, u, vec, r); break;
    case EX_Q8_0: ex_load_q8_0(p, u, vec, r); break;
    case EX_Q2_K: ex_load_q2_k(p, u, vec, r); break;
    case EX_Q3_K: ex_load_q3_k(p, u, vec, r); break;
    case EX_Q4_K: ex_load_q45_k(p, u, vec, r, 0u); break;
    case EX_Q5_K: ex_load_q45_k(p, u, vec, r, 1u); break;
    case EX_Q6_K: ex_load_q6_k(p, u, vec, r); break;
    case EX_E4M3: case EX_E5M2: ex_load_f8(p, u, vec, r); break;
    default: break;
    }
}

EX_FN void ex_emit(const ex_params *p, u32 fmt, u64 u, u32 vec,
                   const ex_raw *r)
{
    switch (fmt) {
    case EX_Q4_0: ex_emit_q4_0(p, u, vec, r); break;
    case EX_Q4_1: ex_emit_q4_1(p, u, vec, r); break;
    case EX_Q5_0: ex_emit_q5_0(p, u, vec, r); break;
    case EX_Q5_1: ex_emit_q5_1(p, u, vec, r); break;
    case EX_Q8_0: ex_emit_q8_0(p, u, vec, r); break;
    case EX_Q2_K: ex_emit_q2_k(p, u, vec, r); break;
    case EX_Q3_K: ex_emit_q3_k(p, u, vec, r); break;
    case EX_Q4_K: ex_emit_q45_k(p, u, vec, r, 0u); break;
    case EX_Q5_K: ex_emit_q45_k(p, u, vec, r, 1u); break;
    case EX_Q6_K: ex_emit_q6_k(p, u, vec, r); break;
    case EX_E4M3: ex_emit_f8(p, u, vec, r, 0u); break;
    case EX_E5M2: ex_emit_f8(p, u, vec, r, 1u); break;
    default: ex_emit_plain(p, u, vec, fmt); break;
    }
}

/* Units first, first + stride, ...: EX_BATCH at a time, the loads of all
 * before the work of any, so each thread has EX_BATCH units' loads in
 * flight. */
EX_FN void ex_loop(const ex_params *p, u64 first, u64 stride, u32 fmt,
                   u32 vec)
{
    for (u64 u = first; u < p->units; u += EX_BATCH * stride) {
        ex_raw r[EX_BATCH], zero = {{0}};
        EX_UNROLL for (u32 k = 0; k < EX_BATCH; k++) {
            u64 uk = u + k * stride;
            r[k] = zero;
            if (uk < p->units)
                ex_load(p, fmt, uk, vec, &r[k]);
        }
        EX_UNROLL for (u32 k = 0; k < EX_BATCH; k++) {
            u64 uk = u + k * stride;
            if (uk < p->units)
                ex_emit(p, fmt, uk, vec, &r[k]);
        }
    }
}
)

EX(
/* ---- lossless: laden's entropy-coded 16-bit floats -------------------
 *
 * The format is include/laden/lossless.h's.  A sub-chunk (elements
 * [i << sub_log2, ...)) is 32 lanes: lane j holds its elements j, j + 32,
 * j + 64, ..., coded one after another in the lanes' order from bit
 * offs[i] + lane_off[i][j]; a lane ends where the next one starts (the
 * last: where the next sub-chunk starts, or at nbits).  On a GPU a warp
 * decodes a sub-chunk, a lane each, so consecutive lanes read consecutive
 * raw bytes and write consecutive values.  A code is read least
 * significant bit first through a table of 2^12 entries ((length << 8) |
 * symbol; 0: no code): one lookup decodes one element.  Every read is
 * checked against the lane's end before it is made, so corrupt data reads
 * nothing outside the bitstream and writes nothing outside the lane's
 * elements; an unused code, a lane that does not end where the next
 * starts, or a sub-chunk whose values do not give its check is reported
 * and the decoder goes on. */
enum { EX_LL_BITS = 12, EX_LL_LUT = 4096, EX_LL_BF16 = 1, EX_LL_F16 = 2,
       EX_LL_LANES = 32 };

typedef struct ex_ll_params {
    u64 lens;  /* 256 code lengths, a byte each */
    u64 raw;   /* n bytes: each element's byte that is not coded */
    u64 offs;  /* nsub u64 bit offsets into the bitstream */
    u64 sums;  /* nsub u32 checks (ex_ll_mix) */
    u64 lanes; /* nsub x 32 u16 lane offsets from the sub-chunk's start */
    u64 bits;  /* the bitstream: nbits bits, then a word of padding */
    u64 dst;   /* n 16-bit values out */
    u64 err;   /* a u32 set to 1 on corrupt data (0: none) */
    u64 n;     /* elements */
    u64 nbits; /* bits of codes */
    u32 nsub, sub_log2, kind, vec; /* vec: 8-aligned offs, sums, lanes,
                                      bits */
} ex_ll_params;

EX_FN u64 ex_ll_ld64(u64 a, u32 vec)
{
    u32 x, y;
    ex_ld2x32(a, vec, &x, &y);
    return (u64)x | (u64)y << 32;
}

/* The checks' first value (FNV-1a's offset basis). */
EX_FN u32 ex_ll_seed(void)
{
    return 0x811c9dc5u;
}

/* One step of the checks: FNV-1a, 32 bits (each step a bijection of the
 * running value, so one value changed always changes the result). */
EX_FN u32 ex_ll_mix(u32 h, u32 x)
{
    return (h ^ x) * 0x01000193u;
}

/* code[s] = the canonical code of symbol s, bit-reversed (read least
 * significant bit first), from the lengths; 1 if the lengths are no code
 * (a length above 12, or more codes than 12 bits hold), else 0. */
EX_FN u32 ex_ll_codes(const ex_ll_params *p, u32 *code)
{
    u32 count[EX_LL_BITS + 1], next[EX_LL_BITS + 1];
    for (u32 l = 0; l <= (u32)EX_LL_BITS; l++)
        count[l] = 0u;
    for (u32 s = 0; s < 256u; s++) {
        u32 l = ex_ld8(p->lens + s);
        if (l > (u32)EX_LL_BITS)
            return 1u;
        count[l]++;
    }
    count[0] = 0u;
    u32 c = 0u;
    next[0] = 0u;
    for (u32 l = 1; l <= (u32)EX_LL_BITS; l++) {
        c = (c + count[l - 1u]) << 1;
        next[l] = c;
    }
    if (next[EX_LL_BITS] + count[EX_LL_BITS] > (u32)EX_LL_LUT)
        return 1u; /* oversubscribed: it shows at the longest length */
    for (u32 s = 0; s < 256u; s++) {
        u32 l = ex_ld8(p->lens + s), v = l ? next[l]++ : 0u, r = 0u;
        for (u32 b = 0; b < l; b++)
            r |= ((v >> b) & 1u) << (l - 1u - b);
        code[s] = r;
    }
    return 0u;
}

/* The decoding table, built by entry so that a GPU block's threads share
 * the work evenly (a symbol of a 1-bit code owns 2048 entries; building
 * by symbol left one thread to write them, after one thread had read the
 * 256 lengths from global memory one by one).  The CPU builds it the
 * same way.  Steps, each a loop a GPU block splits among its threads:
 * ex_ll_canon_len (per symbol: its length, into the block's memory),
 * ex_ll_canon_count (per length 0..12: how many symbols have it),
 * ex_ll_canon_start (one thread: each length's first canonical code and
 * where its symbols start in the symbols sorted by (length, symbol); 1 if
 * the lengths are no code, as ex_ll_codes says), ex_ll_canon_place (per
 * symbol: its place in that order), ex_ll_entry (per entry i: the symbol
 * whose code the low bits of i spell, read least significant bit first:
 * the shortest l whose first l bits, as a number, lie among length l's
 * codes; 0 where none does).  The table is the one ex_ll_codes' codes
 * give: entry code[s] | (f << l) is (l << 8) | s for every f. */
typedef struct ex_ll_canon {
    u32 count[EX_LL_BITS + 1], first[EX_LL_BITS + 1], base[EX_LL_BITS + 1];
    u8 len[256], sorted[256];
} ex_ll_canon;

EX_FN void ex_ll_canon_len(const ex_ll_params *p, ex_ll_canon *c, u32 s)
{
    c->len[s] = (u8)ex_ld8(p->lens + s);
}

EX_FN void ex_ll_canon_count(ex_ll_canon *c, u32 l)
{
    u32 n = 0u;
    for (u32 s = 0; s < 256u; s++)
        n += c->len[s] == l;
    c->count[l] = n;
}

EX_FN u32 ex_ll_canon_start(ex_ll_canon *c)
{
    u32 all = 0u, code = 0u, at = 0u;
    for (u32 l = 0; l <= (u32)EX_LL_BITS; l++)
        all += c->count[l];
    if (all != 256u)
        return 1u; /* a length above 12 */
    c->first[0] = c->base[0] = 0u;
    for (u32 l = 1; l <= (u32)EX_LL_BITS; l++) {
        code = (code + (l > 1u ? c->count[l - 1u] : 0u)) << 1;
        c->first[l] = code;
        c->base[l] = at;
        at += c->count[l];
    }
    /* oversubscribed: it shows at the longest length */
    return c->first[EX_LL_BITS] + c->count[EX_LL_BITS] > (u32)EX_LL_LUT;
}

EX_FN void ex_ll_canon_place(ex_ll_canon *c, u32 s)
{
    u32 l = c->len[s], rank = 0u;
    for (u32 t = 0; t < 256u; t++) /* the same loop in every thread */
        rank += (t < s) & (c->len[t] == l);
    if (l)
        c->sorted[c->base[l] + rank] = (u8)s;
}

EX_FN u32 ex_ll_entry(const ex_ll_canon *c, u32 i)
{
    u32 rev = 0u;
    for (u32 b = 0; b < (u32)EX_LL_BITS; b++)
        rev |= ((i >> b) & 1u) << ((u32)EX_LL_BITS - 1u - b);
    for (u32 l = 1; l <= (u32)EX_LL_BITS; l++) {
        u32 v = rev >> ((u32)EX_LL_BITS - l);
        if (v - c->first[l] < c->count[l]) /* first <= v < first + count */
            return (l << 8) | c->sorted[c->base[l] + (v - c->first[l])];
    }
    return 0u;
}

/* Lane j's offset in sub-chunk i, from the sub-chunk's first bit (lane
 * 32: the sub-chunk's length); UINT64 max when it lies past the codes. */
EX_FN u64 ex_ll_lane_at(const ex_ll_params *p, u64 i, u32 j)
{
    u64 start = ex_ll_ld64(p->offs + 8u * i, p->vec);
    if (j < (u32)EX_LL_LANES)
        return start + ex_ld16(p->lanes + 64u * i + 2u * j, p->vec);
    return i + 1u < p->nsub ? ex_ll_ld64(p->offs + 8u * (i + 1u), p->vec)
                            : p->nbits;
}

/* Decodes lane j of sub-chunk i; its check in *h (the FNV-1a of its
 * values from ex_ll_seed()); 0, or 1 when its data is corrupt. */
EX_FN u32 ex_ll_lane(const ex_ll_params *p, const u16 *lut, u64 i, u32 j,
                     u32 *h)
{
    u64 first = i << p->sub_log2, cnt = p->n - first;
    if (cnt > ((u64)1 << p->sub_log2))
        cnt = (u64)1 << p->sub_log2;
    u64 at = ex_ll_lane_at(p, i, j), end = ex_ll_lane_at(p, i, j + 1u);
    *h = ex_ll_seed();
    if (at > end || end > p->nbits)
        return 1u;
    /* The lane's next bits, from `at`: `have` of them in `buf`, refilled
     * (64 from `at`) when fewer than a longest code remain, so a refill
     * serves ~20 codes of ~2.7 bits instead of two loads a code.  A
     * refill reads the word holding bit `at` (< end <= nbits) and the
     * one after it, at most the padding word. */
    u64 buf = 0u;
    u32 have = 0u;
    for (u64 k = j; k < cnt; k += (u32)EX_LL_LANES) {
        if (at >= end)
            return 1u;
        if (have < (u32)EX_LL_BITS) {
            u64 w = at >> 6;
            u32 sh = (u32)(at & 63u);
            buf = ex_ll_ld64(p->bits + 8u * w, p->vec) >> sh;
            if (sh)
                buf |= ex_ll_ld64(p->bits + 8u * (w + 1u), p->vec)
                       << (64u - sh);
            have = 64u;
        }
        u32 e = lut[(u32)buf & ((u32)EX_LL_LUT - 1u)], l = e >> 8;
        if (!l || at + l > end)
            return 1u;
        at += l;
        buf >>= l;
        have -= l;
        u32 sym = e & 255u, r = ex_ld8(p->raw + first + k);
        u32 x = p->kind == (u32)EX_LL_BF16
                    ? ((r & 0x80u) << 8) | (sym << 7) | (r & 0x7fu)
                    : (sym << 8) | r;
        ex_st16(p->dst + 2u * (first + k), x);
        *h = ex_ll_mix(*h, x);
    }
    return at != end;
}

/* Sub-chunk i's stored check. */
EX_FN u32 ex_ll_sum(const ex_ll_params *p, u64 i)
{
    return ex_ld32(p->sums + 4u * i, p->vec);
}

/* Decodes sub-chunk i, its lanes one after another (the CPU); 0, or 1
 * when its data is corrupt. */
EX_FN u32 ex_ll_sub(const ex_ll_params *p, const u16 *lut, u64 i)
{
    u32 bad = 0u, sum = ex_ll_seed();
    for (u32 j = 0; j < (u32)EX_LL_LANES; j++) {
        u32 h;
        bad |= ex_ll_lane(p, lut, i, j, &h);
        sum = ex_ll_mix(sum, h);
    }
    return bad | (sum != ex_ll_sum(p, i));
}
)
