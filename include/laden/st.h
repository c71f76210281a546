/* st: safetensors checkpoints.  Parses and fully validates headers (single
 * files and sharded *.safetensors.index.json), and gives the tensor table:
 * lookup by name, iteration in file order.  No tensor data is read here; the
 * io layer reads byte ranges.  Untrusted bytes can produce an error, never a
 * crash, an out-of-bounds read or an allocation the file does not justify. */
#ifndef LADEN_ST_H
#define LADEN_ST_H

#include "../laden.h"
#include "dtype.h" /* laden_dtype, once declared here */
#include "io.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits on untrusted headers. */
#define LADEN_ST_MAX_HEADER_BYTES (100u * 1024u * 1024u) /* as safetensors */
#define LADEN_ST_MAX_TENSORS (1u << 22)
#define LADEN_ST_MAX_RANK 64u
#define LADEN_ST_MAX_DEPTH 64u /* JSON nesting inside skipped values */
#define LADEN_ST_MAX_SHARDS 65536u

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

/* A small file read whole and checked: the JSON and text files beside a
 * checkpoint (config.json, adapter_config.json, a tokenizer's files) and
 * laden's trace files.  Opened without blocking (a FIFO or device in its
 * place is refused, not waited on); a regular file of at most max_bytes;
 * UTF-8; with LADEN_ST_TEXT_JSON also one JSON value (RFC 8259, strict:
 * no NaN, comments or trailing commas) nested at most 64 deep.  *out a
 * NUL-terminated copy for laden_st_text_free, *len its bytes.  Errors,
 * each naming the path: LADEN_E_NOENT, LADEN_E_IO (cannot read it: the
 * system's reason), LADEN_E_INVAL (not a regular file, and what it is),
 * LADEN_E_LIMIT (larger than max_bytes, nested too deeply), LADEN_E_JSON
 * (not UTF-8, not JSON: the parser's reason, the line, column and text
 * there).  Any thread. */
#define LADEN_ST_TEXT_JSON 1u
LADEN_API laden_status laden_st_read_text(const char *path,
                                          uint64_t max_bytes, uint32_t flags,
                                          void **out, uint64_t *len);
LADEN_API void laden_st_text_free(void *text);

/* Total bytes of tensor data over all files. */
LADEN_API uint64_t laden_st_total_bytes(const laden_st_t *st);

#ifdef __cplusplus
}
#endif
#endif
