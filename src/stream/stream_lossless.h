/* Lossless weights made once and kept (issue 37): compress.c's pool that
 * reads and encodes tensors on many threads, and llcache.c's cache files
 * (laden/lossless.h says the format), which a later load reads instead
 * of encoding.  compress.c runs the pool for a load; llcache.c runs it to
 * write a cache file and finds a schedule's cache files.  Not installed. */
#ifndef LADEN_STREAM_LOSSLESS_H
#define LADEN_STREAM_LOSSLESS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "laden/io.h"
#include "laden/lossless.h"
#include "laden/stream.h"

/* One tensor for the pool: nelem values of dtype (BF16 or F16) at `off`
 * in `file`, read and encoded.  What came of it: blob (malloc'd, the
 * caller's to free) of `size` bytes and its info, NULL when the blob
 * would not be at most 15/16 of the raw bytes (kept as stored); `cached`
 * the bytes the page cache held; s and msg a failure. */
typedef struct ll_job {
    laden_io_file_t *file; /* read from here, */
    const void *src;       /* or encoded from memory (not NULL) */
    uint64_t off, nelem;
    laden_dtype dtype;
    const char *name;
    void *owner; /* the caller's (compress.c: the tref) */
    uint32_t group; /* consecutive jobs of one group settle together */
    void *blob;
    uint64_t size, cached;
    laden_lossless_info info;
    laden_status s;
    char msg[320];
} ll_job;

/* What becomes of a group's blobs once the group's jobs have all ended:
 * called with them (jobs[0..n), every s LADEN_OK) by the worker that
 * ended the last, while the others read and encode later groups; it
 * takes the blobs it keeps (job.blob set to NULL).  *stop turns true
 * when the run stops (a cancel, a failure): long work ends there.  A
 * failure becomes the last job's and stops the run. */
typedef struct ll_settle {
    laden_status (*fn)(void *arg, ll_job *jobs, uint32_t n,
                       const atomic_bool *stop);
    void *arg;
} ll_settle;

/* Runs jobs[0..n) on up to 16 threads (the cores there are), reading in
 * job order, as many bytes at once as the reader pool reads (at least a
 * tensor), while the others encode.  settle, when set, hears each group
 * whose jobs all succeeded.  progress, when set, hears (base + bytes
 * done, total) every 50 ms from this thread and may stop the run
 * (LADEN_E_STATE naming `what`).  Every job's s is set; the first failure
 * is returned. */
laden_status laden__ll_run(laden_io_t *io, ll_job *jobs, uint32_t n,
                           const ll_settle *settle,
                           laden_sched_progress_fn progress, void *arg,
                           uint64_t base, uint64_t total, const char *what);

/* A blob at most this share of its raw bytes is kept coded. */
static inline bool laden__ll_worth(uint64_t size, uint64_t raw)
{
    return size <= raw - raw / 16;
}

/* ---- cache files (llcache.c) ------------------------------------------- */

#define LADEN_LLC_HEAD 64u
#define LADEN_LLC_ENTRY 40u
#define LADEN_LLC_ALIGN 4096u
/* v rounded up to a multiple of LADEN_LLC_ALIGN. */
static inline uint64_t laden__llc_aligned(uint64_t v)
{
    return (v + LADEN_LLC_ALIGN - 1) & ~(uint64_t)(LADEN_LLC_ALIGN - 1);
}
#define LADEN_LLC_MAX 16777216u /* entries */

typedef struct llc_head {
    uint32_t count;
    uint64_t index_off, index_bytes;
    uint64_t src_size, src_mtime_ns, src_sum, index_sum;
} llc_head;

/* One tensor of the source file: at src_off, nelem values of dtype;
 * kept_raw, or its blob of blob_bytes at blob_off. */
typedef struct llc_entry {
    uint64_t src_off, nelem;
    laden_dtype dtype;
    uint32_t kept_raw;
    uint64_t blob_off, blob_bytes;
} llc_entry;

/* A cache file open for a schedule's source file. */
typedef struct laden_llc {
    laden_io_file_t *file;
    llc_entry *e; /* sorted by src_off */
    uint32_t n;
} laden_llc;

/* The header's 64 bytes of a file of file_size bytes, checked.
 * LADEN_E_CORRUPT naming the field. */
laden_status laden__llc_parse_head(const uint8_t *head, uint64_t file_size,
                                   llc_head *out);
/* The index (h->index_bytes at bytes) of a checked header, checked
 * (its sum, each entry's fields and place); *out malloc'd. */
laden_status laden__llc_parse_index(const llc_head *h, const uint8_t *bytes,
                                    llc_entry **out);
/* The entry for the tensor at src_off of nelem values of dtype, or NULL. */
const llc_entry *laden__llc_find(const laden_llc *c, uint64_t src_off,
                                 uint64_t nelem, laden_dtype dtype);
void laden__llc_close(laden_llc *c);

#endif
