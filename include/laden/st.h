/* st: safetensors checkpoints.  Parses and fully validates headers (single
 * files and sharded *.safetensors.index.json), and gives the tensor table:
 * lookup by name, iteration in file order.  No tensor data is read here; the
 * io layer reads byte ranges.  Untrusted bytes can produce an error, never a
 * crash, an out-of-bounds read or an allocation the file does not justify. */
#ifndef LADEN_ST_H
#define LADEN_ST_H

#include "../laden.h"
#include "io.h"

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

/* Limits on untrusted headers. */
#define LADEN_ST_MAX_HEADER_BYTES (100u * 1024u * 1024u) /* as safetensors */
#define LADEN_ST_MAX_TENSORS (1u << 22)
#define LADEN_ST_MAX_RANK 64u
#define LADEN_ST_MAX_DEPTH 64u /* JSON nesting inside skipped values */
#define LADEN_ST_MAX_SHARDS 65536u

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

typedef struct laden_st laden_st_t; /* an open checkpoint, opaque */

/* One tensor.  Pointers are owned by the checkpoint and valid until
 * laden_st_close. */
typedef struct laden_st_tensor {
    const char *name;       /* UTF-8, NUL-terminated, no interior NUL */
    laden_dtype dtype;
    uint32_t ndim;
    const uint64_t *shape;  /* ndim entries */
    uint32_t file_index;    /* which file of the checkpoint */
    uint64_t offset_bytes;  /* absolute offset in that file */
    uint64_t size_bytes;
} laden_st_tensor_t;

/* Opens a checkpoint: a .safetensors file, a *.safetensors.index.json of a
 * sharded checkpoint, or a directory holding exactly one of
 * model.safetensors / model.safetensors.index.json / a single *.safetensors.
 * Reads and validates every header; keeps no file descriptor open.
 * On success *out owns the table (free with laden_st_close).  Blocks on
 * file reads.  Any thread. */
LADEN_API laden_status laden_st_open(const char *path, laden_st_t **out);

/* Parses a whole safetensors file held in memory (bytes[0..size) is the
 * file).  Same validation as laden_st_open; the checkpoint's single file
 * path is "<memory>".  The bytes are not retained. */
LADEN_API laden_status laden_st_open_memory(const void *bytes, size_t size,
                                            laden_st_t **out);

/* Frees the checkpoint; NULL is a no-op. */
LADEN_API void laden_st_close(laden_st_t *st);

/* Number of tensors. */
LADEN_API size_t laden_st_count(const laden_st_t *st);

/* The i-th tensor in file order (file index, then offset). */
LADEN_API laden_status laden_st_tensor_at(const laden_st_t *st, size_t i,
                                          laden_st_tensor_t *out);

/* Finds a tensor by exact name; LADEN_E_NOTFOUND if absent.  *out_index is
 * its position in file order.  O(log n). */
LADEN_API laden_status laden_st_find(const laden_st_t *st, const char *name,
                                     size_t *out_index);

/* Files of the checkpoint: one, or the shards in first-use order. */
LADEN_API size_t laden_st_file_count(const laden_st_t *st);
/* Path as opened (shards: joined to the index's directory), and size. */
LADEN_API const char *laden_st_file_path(const laden_st_t *st, size_t i);
LADEN_API uint64_t laden_st_file_size(const laden_st_t *st, size_t i);

/* Opens file i for reading (laden_io_file_open) and checks it is the file
 * whose header was read: LADEN_E_CHANGED, nothing open, if its size
 * differs (it was replaced or rewritten since; the header's offsets would
 * point anywhere in it).  Close with laden_io_file_close. */
LADEN_API laden_status laden_st_file_open(const laden_st_t *st, size_t i,
                                          laden_io_file_t **out);

/* __metadata__ of the (first) file: string pairs in header order. */
LADEN_API size_t laden_st_metadata_count(const laden_st_t *st);
LADEN_API laden_status laden_st_metadata_at(const laden_st_t *st, size_t i,
                                            const char **key,
                                            const char **value);

/* "gguf" for a checkpoint opened from a GGUF file (its names and q/k rows
 * are llama.cpp's), else "safetensors"; NULL for NULL.  Static storage. */
LADEN_API const char *laden_st_format(const laden_st_t *st);

/* Total bytes of tensor data over all files. */
LADEN_API uint64_t laden_st_total_bytes(const laden_st_t *st);

#ifdef __cplusplus
}
#endif
#endif
