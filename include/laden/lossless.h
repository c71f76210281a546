/* lossless: 16-bit floats (BF16, F16) in fewer bytes, every bit kept.
 *
 * A weight's sign and mantissa look random, but its exponent does not:
 * a layer's weights share a few magnitudes, so a BF16 exponent byte
 * carries some 2.5-3 bits of information.  laden keeps the byte that is
 * noise as it is and codes the other with a Huffman code of the tensor's
 * own frequencies, at most 12 bits long: about 0.67 of the bytes for
 * BF16 weights; F16, whose sign and ten mantissa bits are noise, about
 * 0.85.  Decoding is one table lookup per element.  A tensor is cut into
 * sub-chunks of 4096 elements that decode independently, each in 32
 * lanes (lane j: its elements j, j + 32, ...), so on a GPU a warp decodes
 * a sub-chunk with consecutive lanes reading consecutive raw bytes and
 * writing consecutive values; the CPU device runs the same code as C (one
 * source, expand.h says how).
 *
 * The format ("LDL1"; all integers little-endian), a blob of
 *   0    4  magic "LDL1"
 *   4    1  kind: 1 BF16 (the coded symbol is the exponent, bits 14..7;
 *           the raw byte is the sign, bit 15, then the mantissa, bits
 *           6..0), 2 F16 (the symbol is the high byte; the raw byte the
 *           low one)
 *   5    1  0
 *   6    2  sub_log2: elements per sub-chunk, as a power of two (6..12)
 *   8    8  n: elements
 *   16   8  nbits: bits of codes
 *   24   8  0
 *   32 256  the code length of each symbol (0: absent; at most 12); the
 *           code is the canonical one (shorter codes first, then by
 *           symbol), written least significant bit first
 *   288  n  raw bytes, one per element, in element order; then zeros to
 *           a multiple of 8
 *   ...  8 * nsub  where each sub-chunk's codes start (bit offsets; the
 *           first 0, none decreasing, none past nbits), nsub =
 *           ceil(n / 2^sub_log2)
 *   ...  4 * nsub  each sub-chunk's check: FNV-1a (32 bits, from
 *           0x811c9dc5, prime 0x01000193, a step per 32-bit unit) over
 *           its 32 lanes' checks, each the FNV-1a of the lane's 16-bit
 *           values in order; then zeros to a multiple of 8
 *   ...  64 * nsub  each sub-chunk's 32 lane offsets (u16, bits from the
 *           sub-chunk's start; the first 0, none decreasing, none past
 *           the sub-chunk's end)
 *   ...  the bitstream: ceil(nbits / 64) words of codes, then one word
 *           of padding (zero).  Sub-chunk i's codes are its lanes' in
 *           lane order, lane j's for its elements in order.
 * The blob's size is therefore fixed by n, sub_log2 and nbits, and every
 * reader checks it.  A lane's codes end exactly where the next lane's
 * start (the last lane's: where the next sub-chunk's start, or at nbits),
 * and a sub-chunk's values give its check: a byte changed anywhere in the
 * raw bytes or the codes is found by the decoder (a check of 32 bits: it
 * misses one change in 2^32 at worst, never a single value changed).
 *
 * A blob is laden's own, but it may be read from a file or memory that
 * changed: every field is checked before anything is decoded, and the
 * decoder never reads outside the blob or writes outside the output,
 * whatever the bytes (fuzz/fuzz_lossless.c). */
#ifndef LADEN_LOSSLESS_H
#define LADEN_LOSSLESS_H

#include "../laden.h"
#include "dev.h"
#include "dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LADEN_LOSSLESS_MAGIC "LDL1"
#define LADEN_LOSSLESS_HEADER_BYTES 288u
#define LADEN_LOSSLESS_SUB_LOG2 12u  /* what laden_lossless_encode writes */
#define LADEN_LOSSLESS_LANES 32u
#define LADEN_LOSSLESS_MAX_CODE 12u

/* What a blob holds (laden_lossless_check). */
typedef struct laden_lossless_info {
    laden_dtype dtype;   /* LADEN_DTYPE_BF16 or LADEN_DTYPE_F16 */
    uint32_t sub_log2;
    uint64_t n_elems;
    uint64_t nbits;
    uint64_t nsub;
    uint64_t bytes;      /* the blob's size */
    uint64_t raw_off, offs_off, sums_off, lanes_off, bits_off; /* parts */
} laden_lossless_info;

/* The most bytes laden_lossless_encode may write for n_elems of dtype
 * (BF16 or F16): the header, the raw bytes, the offsets and every code at
 * its longest.  LADEN_E_INVAL for another dtype, LADEN_E_LIMIT when the
 * size would not fit in 64 bits. */
LADEN_API laden_status laden_lossless_bound(laden_dtype dtype,
                                            uint64_t n_elems,
                                            uint64_t *out_bytes);

/* Encodes the n_elems values at src (BF16 or F16, any alignment) into
 * dst, which has dst_cap bytes, at least laden_lossless_bound's; the
 * blob's size in *out_bytes.  Deterministic: the same values give the
 * same blob.  Whether it is worth keeping (its size against 2 * n_elems)
 * is the caller's choice.  LADEN_E_INVAL for NULL pointers (src may be
 * NULL when n_elems is 0), another dtype or a dst_cap below the bound.
 * On the calling thread; any thread. */
LADEN_API laden_status laden_lossless_encode(laden_dtype dtype,
                                             const void *src,
                                             uint64_t n_elems, void *dst,
                                             uint64_t dst_cap,
                                             uint64_t *out_bytes);

/* Checks a blob's header, lengths and offsets against its size and fills
 * *out.  LADEN_E_CORRUPT naming the first field that is wrong (the codes
 * themselves are checked as they are decoded). */
LADEN_API laden_status laden_lossless_check(const void *blob, uint64_t bytes,
                                            laden_lossless_info *out);

/* Decodes the blob at `blob` (its info from laden_lossless_check of the
 * same bytes) into dst, 2 * n_elems bytes aligned to 2.
 * device LADEN_DEVICE_CPU: host addresses, done before the call returns
 * (a blob of 128 sub-chunks or more by up to 8 threads, the calling one
 * among them);
 * LADEN_E_CORRUPT when a sub-chunk's codes or check are wrong (the
 * other sub-chunks are decoded; dst's elements of that one are
 * unspecified).
 * device >= 0: device addresses; queued on `stream` (as laden_expand:
 * the kernels of expand.h, compiled at the device's first use); a corrupt
 * sub-chunk sets the 4-byte word at `err` (device memory, 0: not wanted) to
 * nonzero once the stream has passed the decode, and are never read or
 * written out of bounds.  LADEN_E_INVAL for NULL addresses, a dst_bytes
 * that is not 2 * n_elems, or an info whose sizes do not add up. */
LADEN_API laden_status laden_lossless_decode(int32_t device, uintptr_t stream,
                                             const laden_lossless_info *info,
                                             laden_devptr_t blob,
                                             laden_devptr_t dst,
                                             uint64_t dst_bytes,
                                             laden_devptr_t err);

/* ---- lossless cache files ------------------------------------------------
 *
 * A checkpoint's BF16/F16 tensors encoded once, for loads that take them
 * (laden_sched_use_lossless_cache) instead of encoding at load: one file
 * per checkpoint file, "<name>.<16 hex digits>.ldlc" in a directory the
 * user names, the digits a checksum of the checkpoint file's absolute
 * path.  The format ("LDLCACHE"; integers little-endian):
 *   0   8  magic "LDLCACHE"
 *   8   4  version 1
 *   12  4  count: entries in the index
 *   16  8  index_off (a multiple of 4096, after every blob)
 *   24  8  index_bytes = 40 * count
 *   32  8  the checkpoint file's size, 40 its modification time (ns),
 *   48  8  laden_io_checksum of its first min(size, 1 MiB) bytes
 *   56  8  laden_io_checksum of the index
 *   the blobs (this header's format), each at a multiple of 4096
 *   the index: per BF16/F16 tensor of the checkpoint file, in the file's
 *   order, 40 bytes: u64 its offset in the checkpoint file, u64 its
 *   values, u32 its dtype (laden_dtype), u32 1 if kept raw (its blob
 *   would not be at most 15/16 of its bytes; then 0 and 0 follow) else
 *   0, u64 its blob's offset, u64 its blob's bytes.
 * A reader checks every field before it uses one, and each blob as it
 * reads it (laden_lossless_check, and that it is the tensor's). */

typedef struct laden_lossless_cache_stats {
    uint32_t files;       /* cache files written */
    uint32_t tensors;     /* BF16/F16 tensors in them */
    uint32_t coded;       /* of those, kept coded */
    uint64_t raw_bytes;   /* the tensors' bytes */
    uint64_t coded_raw_bytes; /* of those, the coded tensors' */
    uint64_t coded_bytes; /* their blobs' */
    uint64_t file_bytes;  /* the cache files' */
} laden_lossless_cache_stats;

/* laden_lossless_cache_write's progress: (bytes done, total) from the
 * calling thread; nonzero stops it.  The same as laden_sched_progress_fn. */
typedef int (*laden_lossless_progress_fn)(void *arg, uint64_t done_bytes,
                                          uint64_t total_bytes);

/* The path of checkpoint file `file`'s cache file in `dir` (laden does not
 * look whether it exists) into out, cap bytes.  LADEN_E_NOENT if `file`
 * does not exist, LADEN_E_LIMIT if the path would not fit. */
LADEN_API laden_status laden_lossless_cache_path(const char *file,
                                                 const char *dir, char *out,
                                                 size_t cap);

/* One entry of a cache file's index (laden_lossless_cache_entries). */
typedef struct laden_lossless_cache_entry {
    uint64_t src_offset;  /* the tensor's offset in the checkpoint file */
    uint64_t n_elems;
    int32_t dtype;        /* laden_dtype: BF16 or F16 */
    uint32_t kept_raw;    /* 1: its blob would not be at most 15/16 of it */
    uint64_t blob_bytes;  /* 0 when kept raw */
} laden_lossless_cache_entry;

/* The index of checkpoint file `file`'s cache file in `dir`, checked as a
 * load checks it: *count its entries (in the file's order), the first cap
 * of them into out (may be NULL with cap 0); *stale 1 when it was made
 * from another version of `file` (a load would not use it).
 * LADEN_E_NOENT when there is none, LADEN_E_CORRUPT naming a damaged
 * one. */
LADEN_API laden_status laden_lossless_cache_entries(
    const char *file, const char *dir, laden_lossless_cache_entry *out,
    uint32_t cap, uint32_t *count, int *stale);

/* Writes the cache file of each file of `checkpoint` (a path
 * laden_st_open takes) into `dir`, made if missing (one level): every
 * BF16/F16 tensor read and encoded on the host's cores, the file written
 * under a temporary name and renamed into place when whole (a cache file
 * there before is replaced).  progress (may be NULL) hears (bytes done,
 * total) from the calling thread every 50 ms and stops the write by
 * returning nonzero (LADEN_E_STATE, nothing left behind).  *out (may be
 * NULL) says what was written.  Errors name the file: those of
 * laden_st_open, read failures naming the tensor, LADEN_E_IO when dir
 * cannot be made or written (e.g. full). */
LADEN_API laden_status laden_lossless_cache_write(
    const char *checkpoint, const char *dir,
    laden_lossless_progress_fn progress, void *arg,
    laden_lossless_cache_stats *out);

#ifdef __cplusplus
}
#endif
#endif
