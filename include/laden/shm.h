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
 *   - every load of a checkpoint (laden_shm_reclaim, from the stream
 *     layer), and making a segment, remove this user's segments that
 *     nobody holds and the temporary files of makers that died, whatever
 *     their names (issue 33: a SIGKILLed user's segment does not wait for
 *     the next shared load of its checkpoint).
 * The directory is made absolute when a value of LADEN_SHM_DIR is first
 * used (relative to the working directory then): a later chdir changes
 * nothing, and a handle keeps the path it was opened under.
 * The header holds the name the segment was made under and its identity
 * (laden_shm_ident: what its content was made from); an open attaches
 * only to a segment whose header says the same.  Whatever else holds the
 * name -- a segment of another content (hard-linked there), a file laden
 * did not make, a FIFO, a symlink, a directory, another user's file -- is
 * never read into, waited on, followed or removed: the open says
 * LADEN_E_STATE and the caller keeps a private copy.
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

/* What a segment's content was made from, kept in its header: an open
 * attaches only where all of it matches.  `content`: a hash of everything
 * that determines the bytes (the stream layer: the layout the name is made
 * from, in full); `source`: a hash of the checkpoint files' identities;
 * `label`: for people (laden shm list), the checkpoint's path. */
typedef struct laden_shm_ident {
    uint64_t content[2];
    uint64_t source[2];
    char label[1024];
} laden_shm_ident;

/* Only attach: LADEN_E_NOENT when no process has made it. */
#define LADEN_SHM_ATTACH_ONLY 1u

/* Opens segment `name` of `bytes` data bytes (> 0) made from `ident`
 * (NULL: all zeros; copied): *out_created is 1 if this call made it (fill
 * it, then laden_shm_set_ready), 0 if it attached to one
 * (laden_shm_wait_ready before reading).  LADEN_E_STATE if the name cannot
 * be used for it: held by a segment of another size or identity, by what
 * laden did not make (the message says what), or kept busy by other
 * processes; nothing there is changed, and the caller may go on with
 * memory of its own.  LADEN_E_NOMEM if the directory has no room for it
 * (the message names the directory and the size).  Blocks only for the
 * moments other processes hold the name's lock (at most 10 s); never on a
 * FIFO.  Any thread. */
LADEN_API laden_status laden_shm_open(const char *name, uint64_t bytes,
                                      const laden_shm_ident *ident,
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

/* The segments' directory as laden uses it (LADEN_SHM_DIR made absolute,
 * default /dev/shm), NUL-terminated in `out` (cap bytes; LADEN_E_INVAL if
 * it does not fit).  Any thread. */
LADEN_API laden_status laden_shm_dir(char *out, size_t cap);

/* What laden shm list shows of one file at a laden name in the
 * directory. */
typedef enum laden_shm_kind {
    LADEN_SHM_SEGMENT = 0,   /* a segment (laden-<name>) */
    LADEN_SHM_TEMPORARY = 1, /* one being made (.laden-<name>.<pid>...) */
    LADEN_SHM_FOREIGN = 2,   /* at a laden name, but not laden's or not
                                this user's: never opened nor removed */
} laden_shm_kind;

typedef struct laden_shm_entry {
    char name[256];      /* the file's name in the directory */
    uint64_t file_bytes; /* its size (header included; 0 if not a file) */
    uint64_t data_bytes; /* the segment's data, from its header (0: none) */
    int64_t age_ms;      /* since it was made (its header, else mtime) */
    int32_t kind;        /* laden_shm_kind */
    int32_t users;       /* 1: a live process holds it; 0: none (dead:
                            laden_shm_reclaim removes it); -1: unknown */
    int32_t state;       /* 0 filling, 1 ready, 2 failed; -1 unknown */
    int32_t creator_pid; /* the process that made it (0: unknown) */
    char what[256];      /* FOREIGN: why it is not laden's; else "" */
    char label[1024];    /* the checkpoint it holds, "" if not known */
} laden_shm_entry;

/* The files at laden names in the directory, at most `cap` of them into
 * `out` (NULL if cap is 0), and how many there are in *out_count (call
 * again with more room if it is larger than cap).  Reading who holds a
 * segment takes its lock for an instant; nothing is changed, no symlink
 * followed, no other user's file opened.  Blocks on the directory only.
 * Any thread. */
LADEN_API laden_status laden_shm_list(laden_shm_entry *out, uint32_t cap,
                                      uint32_t *out_count);

/* Removes what processes that ended left in the directory: this user's
 * segments that no live process holds (a flock every user holds; the
 * kernel drops a dead one's) and the temporary files of makers that died.
 * Never a segment a live process makes or uses, a symlink, a file laden
 * did not make or another user's.  The removed files go into `removed`
 * (at most cap; may be NULL with cap 0), their number into *out_count and
 * their bytes into *out_bytes (each may be NULL).  Every load of a
 * checkpoint calls it.  Blocks on the directory only.  Any thread. */
LADEN_API laden_status laden_shm_reclaim(laden_shm_entry *removed,
                                         uint32_t cap, uint32_t *out_count,
                                         uint64_t *out_bytes);

/* Unmaps it; the last process to close a segment removes it, and so does
 * a creator closing one it did not mark ready.  NULL: no-op. */
LADEN_API void laden_shm_close(laden_shm_t *shm);

#ifdef __cplusplus
}
#endif
#endif
