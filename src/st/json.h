/* A pull parser for the JSON of checkpoint headers and index files.  The
 * caller drives it with the schema it expects, so nothing is built that the
 * schema does not keep and every allocation is bounded by the input.
 * Strict RFC 8259: no comments, no trailing commas, UTF-8 validated. */
#ifndef LADEN_ST_JSON_H
#define LADEN_ST_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/internal.h"

/* Depth allowed when skipping a value found where a number was expected. */
#define LADEN__JSON_NUM_DEPTH 64u

typedef struct laden__json {
    const unsigned char *begin;
    const unsigned char *p;
    const unsigned char *end;
} laden__json;

/* buf may be NULL when len is 0. */
void laden__json_init(laden__json *j, const void *buf, size_t len);

/* Byte offset of the cursor, for messages. */
size_t laden__json_pos(const laden__json *j);

/* Skips white space; true if the next byte is c (not consumed). */
bool laden__json_peek(laden__json *j, char c);

/* Skips white space and consumes c, or fails with LADEN_E_JSON. */
laden_status laden__json_expect(laden__json *j, char c);

/* After an element of an object or array: consumes ',' (returns 1, another
 * element follows) or the closing byte (returns 0); else LADEN_E_JSON. */
laden_status laden__json_next(laden__json *j, char close, int *more);

/* Parses a string, decoding escapes into dst (cap bytes; a string's decoded
 * form never exceeds its encoded length minus two, plus a NUL).  *len gets
 * the decoded length, *has_nul whether it holds U+0000.  LADEN_E_JSON on bad
 * syntax or invalid UTF-8, LADEN_E_LIMIT if cap is too small. */
laden_status laden__json_string(laden__json *j, char *dst, size_t cap,
                                size_t *len, bool *has_nul);

/* Parses a number that must be a non-negative integer fitting 64 bits.
 * LADEN_E_SCHEMA for another number or value kind, LADEN_E_LIMIT on
 * overflow, LADEN_E_JSON on bad syntax. */
laden_status laden__json_uint(laden__json *j, uint64_t *out);

/* Skips one value of any kind, nested at most max_depth deep. */
laden_status laden__json_skip(laden__json *j, unsigned max_depth);

/* The kind of the next value: one of '{', '[', '"', 'n' (number), 't', 'f',
 * 'u' (null), or 0 at end/garbage.  Skips white space. */
char laden__json_kind(laden__json *j);

/* LADEN_E_JSON if no value starts at the cursor (end of input or a byte
 * that starts no value), LADEN_OK otherwise.  Lets callers tell a syntax
 * error from a value of the wrong kind. */
laden_status laden__json_need_value(laden__json *j);

/* True if only white space remains. */
bool laden__json_at_end(laden__json *j);

/* ---- small files (text.c) ---------------------------------------------- */

struct stat;
/* Opens a regular file for reading: O_NONBLOCK because open() itself
 * blocks on a FIFO until a writer comes (forever, for a stray FIFO named
 * like a checkpoint or a shard); O_NOCTTY so a terminal never becomes
 * ours.  Anything but a regular file is refused once open (LADEN_E_INVAL
 * naming what it is), and the descriptor is made blocking again for the
 * reads.  *size its stated size, *sb (may be NULL) its stat. */
laden_status laden__st_open_fd(const char *path, int *fd, uint64_t *size,
                               struct stat *sb);

/* ---- the index of a sharded checkpoint (index.c) ------------------- */

typedef struct laden__st_index_entry {
    const char *name;     /* tensor name, no NUL inside */
    const char *shard;    /* file name relative to the index's directory */
    uint32_t shard_index; /* into laden__st_index.shards */
} laden__st_index_entry;

typedef struct laden__st_index {
    char *pool;                 /* every string below points in here */
    laden__st_index_entry *map; /* sorted by name, names distinct */
    size_t nmap;                /* at least 1 */
    const char **shards;        /* distinct shards, in first-use order */
    size_t nshards;             /* 1..LADEN_ST_MAX_SHARDS */
} laden__st_index;

/* Parses the JSON of a *.safetensors.index.json (json[0..len), NULL when
 * len is 0) from memory: its "weight_map" of tensor name to shard file;
 * other keys are skipped.  Opens no file.  Fails with LADEN_E_JSON (syntax),
 * LADEN_E_INDEX (no or two weight_maps, a value that is not a string, a
 * name listed twice or holding a NUL, a shard name that is absolute, empty,
 * holds "..", an empty path component or a NUL), LADEN_E_LIMIT (input over
 * LADEN_ST_MAX_HEADER_BYTES, too many shards, nesting).  On success *out
 * owns its memory (laden__st_index_free); on failure it is zeroed.  Any
 * thread. */
laden_status laden__st_index_parse(const void *json, size_t len,
                                   laden__st_index *out);

/* Frees what laden__st_index_parse gave and zeroes *ix; NULL is a no-op. */
void laden__st_index_free(laden__st_index *ix);

/* Grows *arr (of *cap elements of elem bytes, doubling from 16) to hold
 * need; false, *arr unchanged, when out of memory (st.c). */
bool laden__st_grow(void **arr, size_t *cap, size_t need, size_t elem);

#endif
