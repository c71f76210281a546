/* io: reads byte ranges of checkpoint files into caller buffers with a pool
 * of threads.  Large preads, O_DIRECT where the file system allows it (into
 * the caller's buffer when the alignments agree, through a per-thread bounce
 * buffer when they do not), buffered reads for unaligned edges.  Short
 * reads, EINTR and I/O errors are handled and reported, never returned as
 * data.  Also a zero-copy private mapping for callers that want a view. */
#ifndef LADEN_IO_H
#define LADEN_IO_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_io laden_io_t;          /* reader pool, opaque */
typedef struct laden_io_file laden_io_file_t; /* an open file, opaque */
typedef struct laden_io_req laden_io_req_t;   /* a submitted read, opaque */

/* How bytes the page cache does not hold are read (what it holds is
 * copied from there in every mode). */
typedef enum laden_io_direct {
    /* The faster of O_DIRECT and buffered reads, measured per file system
     * by the first reads there (see laden_io_file_ways); the environment
     * variable LADEN_IO_DIRECT=auto|on|off overrides this mode only. */
    LADEN_IO_DIRECT_AUTO = 0,
    LADEN_IO_DIRECT_OFF = 1, /* buffered, pages dropped behind the copy */
    LADEN_IO_DIRECT_ON = 2,  /* O_DIRECT where the file system takes it */
} laden_io_direct;

typedef struct laden_io_config {
    uint32_t threads;     /* 0: default (one per two cores, 4..16) */
    uint64_t chunk_bytes; /* 0: default (16 MiB); rounded to 1 MiB */
    laden_io_direct direct;
} laden_io_config;

/* Creates a pool.  cfg may be NULL for defaults.  *out owns the pool;
 * destroy with laden_io_destroy.  Any thread. */
LADEN_API laden_status laden_io_create(const laden_io_config *cfg,
                                       laden_io_t **out);

/* Waits for submitted reads to finish, then stops the threads.  NULL: no-op.
 * Requests not yet waited for are freed. */
LADEN_API void laden_io_destroy(laden_io_t *io);

/* Opens a file for reading.  Keeps a buffered and, where supported, an
 * O_DIRECT descriptor.  What is not a regular file (a FIFO, a directory, a
 * device) is refused with LADEN_E_INVAL without blocking.  Its device,
 * inode, size, modification and status change times are recorded: a read
 * that finishes after the file was rewritten in place fails with
 * LADEN_E_CHANGED, and so does every read of it after that (a file
 * replaced by a rename goes on serving the original bytes).  A rewrite
 * with the modification time put back (touch -r) is found by the status
 * change time and a checksum of each chunk kept at its first read: a
 * chunk read again after the status change time moved is hashed again,
 * and refused if its bytes differ (a chmod changes none: its reads go
 * on).  Close with laden_io_file_close once no read on it is in flight. */
LADEN_API laden_status laden_io_file_open(const char *path,
                                          laden_io_file_t **out);
LADEN_API void laden_io_file_close(laden_io_file_t *file);
LADEN_API uint64_t laden_io_file_size(const laden_io_file_t *file);
LADEN_API const char *laden_io_file_path(const laden_io_file_t *file);
/* What identifies the file's content as it was opened: its device,
 * inode and size in id[0..2], and in id[3] its modification time (ns)
 * plus a mix of its status change time (ns), so that a file rewritten in
 * place with its modification time put back is another file (zeros for
 * NULL).  Fixed at open. */
LADEN_API void laden_io_file_identity(const laden_io_file_t *file,
                                      uint64_t id[4]);
/* The checksum laden keeps of the bytes it reads (see
 * laden_io_file_open): 64 bits, not cryptographic, at memory speed.  Pure;
 * any thread. */
LADEN_API uint64_t laden_io_checksum(const void *data, uint64_t size);
/* The file's modification and status change times (ns) at open (zeros
 * for NULL); NULL pointers are skipped. */
LADEN_API void laden_io_file_times(const laden_io_file_t *file,
                                   uint64_t *mtime_ns, uint64_t *ctime_ns);
/* Reads [offset, offset+size) of the file (buffered, a MiB at a time,
 * on the calling thread: blocks) and gives its laden_io_checksum. */
LADEN_API laden_status laden_io_file_checksum(laden_io_file_t *file,
                                              uint64_t offset, uint64_t size,
                                              uint64_t *out_sum);
/* 1 if reads of this file may use O_DIRECT. */
LADEN_API int laden_io_file_direct(const laden_io_file_t *file);

/* Queues a read of size bytes at offset into dst.  Does not block on the
 * read.  *out identifies it for laden_io_wait, which must be called exactly
 * once.  dst and file must stay valid until then.  Reads past the end of
 * the file fail (LADEN_E_TRUNCATED), they are not clipped; reads of a file
 * that changed since it was opened fail (LADEN_E_CHANGED). */
LADEN_API laden_status laden_io_submit(laden_io_t *io, laden_io_file_t *file,
                                       uint64_t offset, uint64_t size,
                                       void *dst, laden_io_req_t **out);

/* What a request does once all its bytes are in (laden_io_submit_then):
 * run on the reader thread that read its last chunk, before the request
 * counts as finished; a failure (with laden_last_error set) becomes the
 * request's status.  Not run if a read failed. */
typedef laden_status (*laden_io_then_fn)(void *arg);

/* As laden_io_submit, then `then(then_arg)` on a reader thread once every
 * chunk is in (at once, on the calling thread, for size 0): work on the
 * bytes (a conversion) done in parallel by the pool, not by the waiter. */
LADEN_API laden_status laden_io_submit_then(laden_io_t *io,
                                            laden_io_file_t *file,
                                            uint64_t offset, uint64_t size,
                                            void *dst, laden_io_then_fn then,
                                            void *then_arg,
                                            laden_io_req_t **out);

/* Copies size bytes from src to dst (host memory, not overlapping) on the
 * pool's threads, a chunk each, as a read is: a request waited for with
 * laden_io_wait, queued behind the reads before it.  For copies too large
 * for one thread to make at the rate reads arrive (a load's coded blobs
 * into their blocks). */
LADEN_API laden_status laden_io_submit_copy(laden_io_t *io, const void *src,
                                            uint64_t size, void *dst,
                                            laden_io_req_t **out);

/* Blocks until the request has finished, frees it and returns its status;
 * on failure laden_last_error() on the calling thread names file, offset and
 * cause.  Any thread. */
LADEN_API laden_status laden_io_wait(laden_io_t *io, laden_io_req_t *req);

/* As laden_io_wait; *cached_bytes (may be NULL) receives how many of the
 * request's bytes were read from the page cache (what was cached is
 * copied from there, at memory speed, not read again from the drive). */
LADEN_API laden_status laden_io_wait_cached(laden_io_t *io,
                                            laden_io_req_t *req,
                                            uint64_t *cached_bytes);

typedef struct laden_io_stats {
    uint64_t direct_bytes;   /* read from the drive with O_DIRECT */
    uint64_t cached_bytes;   /* copied from the page cache: cached already */
    uint64_t buffered_bytes; /* read from the drive buffered (the faster way
                                there, unaligned edges, a file system
                                without O_DIRECT) */
    uint32_t threads;
    uint64_t dropped_bytes;  /* of those, dropped from the page cache once
                                copied (what the pool brought in only) */
} laden_io_stats_t;

/* Bytes the pool has read each way since it was created.  Any thread. */
LADEN_API laden_status laden_io_stats(laden_io_t *io, laden_io_stats_t *out);

/* *out_done = 1 if the request has finished (laden_io_wait will not
 * block), 0 otherwise.  Does not block; does not free the request. */
LADEN_API laden_status laden_io_poll(laden_io_t *io, laden_io_req_t *req,
                                     int *out_done);

/* laden_io_submit then laden_io_wait. */
LADEN_API laden_status laden_io_read(laden_io_t *io, laden_io_file_t *file,
                                     uint64_t offset, uint64_t size,
                                     void *dst);

/* Maps the whole file privately: the view is zero-copy and reads come from
 * the page cache; writes through it (which callers should not make) go to
 * private copies, never to the file.  A page of the mapping that was not
 * yet read raises SIGBUS if the file is truncated below it: hand such
 * views only to code that can tolerate that (laden's Python package reads
 * instead).  *out_size gets the file size.  Unmap
 * with laden_io_unmap.  A file of zero bytes maps to a non-NULL dummy. */
LADEN_API laden_status laden_io_map(laden_io_file_t *file, void **out,
                                    uint64_t *out_size);
LADEN_API void laden_io_unmap(void *addr, uint64_t size);

/* Which way reads a file system's cold bytes faster, as far as this
 * process measured (LADEN_IO_DIRECT_AUTO pools measure as they read). */
typedef enum laden_io_way {
    LADEN_IO_WAY_UNKNOWN = 0, /* not measured enough yet */
    LADEN_IO_WAY_DIRECT = 1,
    LADEN_IO_WAY_BUFFERED = 2,
} laden_io_way;
typedef struct laden_io_ways {
    int32_t chosen;      /* laden_io_way */
    uint32_t samples;    /* windows measured (the fewer of the two ways) */
    double direct_bps;   /* measured rates; 0 where not measured */
    double buffered_bps;
} laden_io_ways;
/* What was measured for the file system the file lies on (zeros and
 * UNKNOWN where nothing was).  Any thread. */
LADEN_API laden_status laden_io_file_ways(const laden_io_file_t *file,
                                          laden_io_ways *out);
/* Forgets what was measured for the file's file system: the next cold
 * reads there measure again.  Any thread. */
LADEN_API laden_status laden_io_forget_ways(const laden_io_file_t *file);
/* Measures both ways in dir: writes a temporary file of size_bytes (at
 * least 32 MiB), reads one half with O_DIRECT and the other buffered, each
 * from a dropped page cache, deletes it, and keeps the faster for dir's
 * file system as AUTO pools would (*out: both rates and the choice; a
 * file system without O_DIRECT gives direct_bps 0).  Blocks. */
LADEN_API laden_status laden_io_measure_ways(const char *dir,
                                             uint64_t size_bytes,
                                             laden_io_ways *out);
/* Drops the file's pages from the page cache (written out first, then
 * posix_fadvise DONTNEED), so a following read measures the drive.  Used by benchmarks and probe. */
LADEN_API laden_status laden_io_drop_cache(laden_io_file_t *file);

/* Measures this machine's direct read rate: writes a temporary file of
 * size_bytes in dir, syncs it, drops it from the page cache, reads it back
 * through a pool and deletes it.  *out_bytes_per_s gets the read rate.
 * Blocks for the whole measurement. */
LADEN_API laden_status laden_io_measure_read(const char *dir,
                                             uint64_t size_bytes,
                                             double *out_bytes_per_s);

/* Measures the drive under an existing file: drops the file from the page
 * cache, reads up to max_bytes from its start through a pool, and returns
 * the rate.  The file is not changed.  Blocks for the read. */
LADEN_API laden_status laden_io_measure_file(const char *path,
                                             uint64_t max_bytes,
                                             double *out_bytes_per_s);

#ifdef __cplusplus
}
#endif
#endif
