/* dtype: the element types laden holds, and what is known about each:
 * its name, its bits per element, its blocks, and its ggml type number.
 * Every layer takes these facts from here (src/core/dtype.c), so a format
 * reader (st, gguf), the converter (stream) and the expansion kernels
 * (dev) agree on them without calling each other.  Pure functions; any
 * thread. */
#ifndef LADEN_DTYPE_H
#define LADEN_DTYPE_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every dtype of the safetensors format, then GGUF's block-quantized types
 * (bits 0: elements come in blocks, see laden_dtype_block; a GGUF file's
 * tensors of these types are read by laden_st_open as they are stored,
 * never named in a safetensors header).  Bits per element in the list. */
#define LADEN_DTYPE_LIST(X)   \
    X(BOOL, 8)                \
    X(U8, 8)                  \
    X(I8, 8)                  \
    X(F8_E5M2, 8)             \
    X(F8_E4M3, 8)             \
    X(F8_E8M0, 8)             \
    X(F8_E4M3FNUZ, 8)         \
    X(F8_E5M2FNUZ, 8)         \
    X(I16, 16)                \
    X(U16, 16)                \
    X(F16, 16)                \
    X(BF16, 16)               \
    X(I32, 32)                \
    X(U32, 32)                \
    X(F32, 32)                \
    X(C64, 64)                \
    X(F64, 64)                \
    X(I64, 64)                \
    X(U64, 64)                \
    X(F4, 4)                  \
    X(F6_E2M3, 6)             \
    X(F6_E3M2, 6)             \
    X(Q4_0, 0)                \
    X(Q4_1, 0)                \
    X(Q5_0, 0)                \
    X(Q5_1, 0)                \
    X(Q8_0, 0)                \
    X(Q2_K, 0)                \
    X(Q3_K, 0)                \
    X(Q4_K, 0)                \
    X(Q5_K, 0)                \
    X(Q6_K, 0)

typedef enum laden_dtype {
#define LADEN__DTYPE_ENUM(name, bits) LADEN_DTYPE_##name,
    LADEN_DTYPE_LIST(LADEN__DTYPE_ENUM)
#undef LADEN__DTYPE_ENUM
    LADEN_DTYPE_COUNT
} laden_dtype;

/* The format's name ("BF16") or NULL for an out-of-range value. */
LADEN_API const char *laden_dtype_name(laden_dtype dtype);
/* Bits per element (4, 6, 8, 16, 32 or 64), 0 for a block type or an
 * out-of-range value. */
LADEN_API uint32_t laden_dtype_bits(laden_dtype dtype);
/* Elements and bytes per block: a block type's (Q4_K: 256, 144), else 1
 * and bits/8 for whole-byte dtypes (8, 4 and 6 bit ones: 8 elements and
 * their bytes).  LADEN_E_DTYPE for an out-of-range value. */
LADEN_API laden_status laden_dtype_block(laden_dtype dtype,
                                         uint32_t *block_elems,
                                         uint32_t *block_bytes);
/* The laden dtype of a ggml type number (GGUF's F32, F16, BF16, I8..I64,
 * F64 and the block types above); LADEN_E_UNSUPPORTED naming the type for
 * one laden does not hold. */
LADEN_API laden_status laden_dtype_of_ggml(uint32_t ggml_type,
                                           laden_dtype *out);
/* The ggml type number of a block dtype or of F32/F16/BF16 (inverse of
 * laden_dtype_of_ggml), or UINT32_MAX. */
LADEN_API uint32_t laden_ggml_of_dtype(laden_dtype dtype);

#ifdef __cplusplus
}
#endif
#endif
