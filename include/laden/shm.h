/* shm: host memory that the processes of one host share by name, for one
 * host copy of a model that several processes stream from (issue 19; the
 * RAM tier maps it and each process registers it with its own CUDA
 * context).
 *
 * A segment is a file in LADEN_SHM_DIR (default /dev/shm) named
 * "laden-<name>": a header page, then `bytes` of data.  The first process
 * to open a name creates it (made under a temporary name and linked in
 * whole, so no process sees it half made), reserves its pages (a full
 * /dev/shm is an error here, never a SIGBUS later), fills the data and
 * marks it ready; the others attach and wait until it is ready.  Every
 * process using a segment holds a shared lock on its file, so:
 *   - the last to close it removes it;
 *   - a segment whose users all died (the locks go with them) is found
 *     unused by the next open, removed and made again;
 *   - a creator that dies while filling it (it holds a lock on the header
 *     while filling; its pid is checked too) is noticed by those waiting,
 *     who get LADEN_E_STATE;
 *   - making a segment first removes this user's segments that nobody
 *     holds and the temporary files of makers that died, whatever their
 *     names. 
 * Names: 1 to 200 characters of [A-Za-z0-9._-]; the caller makes them
 * from what identifies the content (the checkpoint and the load's
 * options).  Thread-safe for distinct handles; one handle is used by one
 * thread at a time. */
#ifndef LADEN_SHM_H
#define LADEN_SHM_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_shm laden_shm_t;

/* Only attach: LADEN_E_NOENT when no process has made it. */
#define LADEN_SHM_ATTACH_ONLY 1u

/* Opens segment `name` of `bytes` data bytes (> 0): *out_created is 1 if
 * this call made it (fill it, then laden_shm_set_ready), 0 if it attached
 * to one (laden_shm_wait_ready before reading).  LADEN_E_STATE if a
 * segment of that name exists with another size; LADEN_E_NOMEM if the
 * directory has no room for it (the message names the directory and the
 * size). */
LADEN_API laden_status laden_shm_open(const char *name, uint64_t bytes,
                                      uint32_t flags, laden_shm_t **out,
                                      int *out_created);

/* The data (page-aligned) and its size. */
LADEN_API void *laden_shm_data(laden_shm_t *shm);
LADEN_API uint64_t laden_shm_bytes(laden_shm_t *shm);

/* The creator: the data is filled (ok != 0) or will not be (ok == 0:
 * those waiting get LADEN_E_STATE).  LADEN_E_STATE from a process that
 * attached. */
LADEN_API laden_status laden_shm_set_ready(laden_shm_t *shm, int ok);

/* Waits until the creator marks the segment ready, at most timeout_ms
 * (0: does not wait).  LADEN_E_STATE if it failed, if its creator ended
 * before it was ready, or on timeout (the message says which). */
LADEN_API laden_status laden_shm_wait_ready(laden_shm_t *shm,
                                            uint32_t timeout_ms);

/* The segment's file. */
LADEN_API const char *laden_shm_path(laden_shm_t *shm);

/* 1 if the segment is memory a device driver may pin (tmpfs: /dev/shm);
 * 0 on a regular file system, whose pages CUDA cannot register. */
LADEN_API int laden_shm_pinnable(laden_shm_t *shm);

/* The bytes of this user's segments in the directory now (made or
 * being made) whose names begin with `prefix` (NULL or "": all), in
 * *out_bytes: a process planning how much RAM it may use counts them as
 * the memory it would attach to. */
LADEN_API laden_status laden_shm_held_bytes(const char *prefix,
                                            uint64_t *out_bytes);

/* Unmaps it; the last process to close a segment removes it, and so does
 * a creator closing one it did not mark ready.  NULL: no-op. */
LADEN_API void laden_shm_close(laden_shm_t *shm);

#ifdef __cplusplus
}
#endif
#endif
