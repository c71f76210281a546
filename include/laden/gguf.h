/* GGUF files (llama.cpp's format): the header, its metadata and its tensor
 * table, parsed and validated before anything is read from the data.
 *
 * Layout (little-endian, versions 2 and 3): "GGUF", version u32, tensor
 * count u64, metadata count u64; the metadata key/values (a string key, a
 * u32 value type, the value: a scalar, a string of u64 length, or an array
 * of one type with a u64 count); the tensor infos (a name, u32 dimensions,
 * u64 each innermost first, u32 ggml type, u64 offset into the data); the
 * data, aligned to general.alignment (default 32), every tensor at a
 * multiple of it.  Every field is checked: counts and lengths against the
 * file's size and laden's limits, types against the known ones, each
 * tensor's byte size against its shape and type, its range inside the data
 * and apart from every other.  A bad file gets a named error
 * (LADEN_E_HEADER, _SCHEMA, _DTYPE, _SHAPE, _RANGE, _NAME, _LIMIT,
 * _TRUNCATED), never a crash. */
#ifndef LADEN_GGUF_H
#define LADEN_GGUF_H

#include "laden.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_gguf laden_gguf_t;

/* Metadata value types, as GGUF numbers them. */
typedef enum laden_gguf_value_type {
    LADEN_GGUF_U8 = 0,
    LADEN_GGUF_I8 = 1,
    LADEN_GGUF_U16 = 2,
    LADEN_GGUF_I16 = 3,
    LADEN_GGUF_U32 = 4,
    LADEN_GGUF_I32 = 5,
    LADEN_GGUF_F32 = 6,
    LADEN_GGUF_BOOL = 7,
    LADEN_GGUF_STRING = 8,
    LADEN_GGUF_ARRAY = 9,
    LADEN_GGUF_U64 = 10,
    LADEN_GGUF_I64 = 11,
    LADEN_GGUF_F64 = 12
} laden_gguf_value_type;

/* One metadata entry.  Scalars: the value in `u` (unsigned and bool), `i`
 * (signed) or `f` (floating); strings in `str` (NUL-terminated; `count`
 * is its length).  Arrays: `elem_type` and `count` (the values are not
 * kept). */
typedef struct laden_gguf_kv {
    const char *key;
    laden_gguf_value_type type;
    laden_gguf_value_type elem_type;
    uint64_t count;
    uint64_t u;
    int64_t i;
    double f;
    const char *str;
} laden_gguf_kv_t;

#define LADEN_GGUF_MAX_DIMS 4

/* One tensor: its ggml type (see laden_gguf_type_name), dimensions
 * innermost first as GGUF stores them, and its bytes in the file. */
typedef struct laden_gguf_tensor {
    const char *name;
    uint32_t type;
    uint32_t ndim;
    uint64_t dims[LADEN_GGUF_MAX_DIMS];
    uint64_t offset_bytes; /* absolute, in the file */
    uint64_t size_bytes;
} laden_gguf_tensor_t;

LADEN_API laden_status laden_gguf_open(const char *path, laden_gguf_t **out);
/* The same from bytes in memory (the whole file). */
LADEN_API laden_status laden_gguf_open_memory(const void *bytes, size_t size,
                                              laden_gguf_t **out);
LADEN_API void laden_gguf_close(laden_gguf_t *g);

LADEN_API uint32_t laden_gguf_version(const laden_gguf_t *g);
LADEN_API uint32_t laden_gguf_alignment(const laden_gguf_t *g);
LADEN_API uint64_t laden_gguf_data_offset(const laden_gguf_t *g);

LADEN_API size_t laden_gguf_count(const laden_gguf_t *g);
LADEN_API laden_status laden_gguf_tensor_at(const laden_gguf_t *g, size_t i,
                                            laden_gguf_tensor_t *out);
/* LADEN_E_NOTFOUND if no tensor has that name. */
LADEN_API laden_status laden_gguf_find(const laden_gguf_t *g,
                                       const char *name, size_t *out);

LADEN_API size_t laden_gguf_metadata_count(const laden_gguf_t *g);
LADEN_API laden_status laden_gguf_metadata_at(const laden_gguf_t *g,
                                              size_t i, laden_gguf_kv_t *out);
/* LADEN_E_NOTFOUND if no entry has that key. */
LADEN_API laden_status laden_gguf_metadata_find(const laden_gguf_t *g,
                                                const char *key,
                                                laden_gguf_kv_t *out);

/* The metadata a model's config is built from (transformers reads it
 * as <architecture>.*), checked for type and range before anything is
 * built: general.architecture a non-empty string, general.name a string;
 * the sizes of <architecture>.* (block count, context, embedding and
 * feed-forward lengths, head counts, rope dimensions, vocabulary, expert
 * counts) integers from 1 to 2^31 - 1, the block count at most the
 * tensor count; head counts at most the embedding length, kv heads
 * dividing heads, experts used at most the experts; rope base and norm
 * epsilons finite floats above 0.  LADEN_E_SCHEMA naming `path` (for
 * messages), the key, its value and what laden needs; LADEN_E_INVAL for
 * NULL.  Any thread. */
LADEN_API laden_status laden_gguf_check_model(const laden_gguf_t *g,
                                              const char *path);

/* A ggml type's name ("Q4_K"), or NULL for a number laden does not know;
 * its block: elements per block and bytes per block. */
LADEN_API const char *laden_gguf_type_name(uint32_t type);
LADEN_API laden_status laden_gguf_type_block(uint32_t type,
                                             uint32_t *block_elems,
                                             uint32_t *block_bytes);

/* Expands n_elems elements of ggml type `type` from their blocks at src
 * (exactly src_bytes: n_elems / block_elems blocks) to float32 at dst, on
 * the CPU, with the reference's arithmetic (float32, one rounding per
 * operation, as ggml and the gguf package compute it): bit for bit
 * equal to gguf.quants.dequantize.  Types: F32, F16, BF16, Q8_0, Q4_0,
 * Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; another known type
 * is LADEN_E_UNSUPPORTED. */
LADEN_API laden_status laden_gguf_dequantize(uint32_t type, const void *src,
                                             uint64_t src_bytes, float *dst,
                                             uint64_t n_elems);

#ifdef __cplusplus
}
#endif

#endif
