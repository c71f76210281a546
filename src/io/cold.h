/* Internal to src/io: what the page cache holds of a file, and how the
 * bytes it does not hold are read on each file system (see cold.c). */
#ifndef LADEN_IO_COLD_H
#define LADEN_IO_COLD_H
#include <stdbool.h>
#include <stdint.h>

#include "../core/internal.h"
#include "laden/io.h"

/* The two ways to read bytes the page cache does not hold. */
enum { LADEN__WAY_DIRECT = 0, LADEN__WAY_BUFFERED = 1 };
/* A pool's mode, as laden_io_direct numbers it (io.c checks they agree). */
enum { LADEN__MODE_AUTO = 0, LADEN__MODE_OFF = 1, LADEN__MODE_ON = 2 };
/* What was measured on a file system: chosen -1 (not yet) or a way. */
typedef struct laden__ways {
    int chosen;
    uint32_t samples; /* windows measured, the fewer of the two ways */
    double direct_bps, buffered_bps;
} laden__ways;

/* Whether a mapping may be made to ask mincore: 4 KiB pages, an answer
 * that is the truth (mincore answers only the file's owner, whoever may
 * write it, and root; to others it says every page is cached), and a
 * process that does not lock its mappings (mlockall would read and lock
 * the whole range). */
bool laden__may_map(int fd, uint64_t uid);
/* Marks in vec[i] (one byte per page from off's page on) whether the page
 * cache holds page i of [off, off+len), without reading: cachestat(2)
 * where the kernel has it (6.5), else mincore over a mapping where
 * may_map.  false: the kernel will not say (vec untouched). */
bool laden__resident(int fd, bool may_map, uint64_t off, uint64_t len,
                     unsigned char *vec);
/* Bytes of file reads submitted to io into a destination not congruent
 * with their offset modulo 4 KiB (of reads of 4 KiB and more): read
 * O_DIRECT, they go through a reader's bounce buffer and a copy.  For
 * tests, which check that laden's buffers are laid so that they do not. */
uint64_t laden__io_misplaced_bytes(laden_io_t *io);
/* Tests: cachestat off (the mincore path, as on kernels before 6.5) or
 * on again. */
void laden__io_cachestat(bool on);

/* The way a pool whose mode is `mode` reads a cold part of len bytes of
 * a file on device dev that takes O_DIRECT (direct_ok).  Where the file
 * system's choice is not made yet the read is part of the trial (a window
 * of window_bytes, or at least 8 MiB, one way): *trial gets its window,
 * handed to laden__way_done when the read ended; else 0. */
int laden__way_for(int mode, uint64_t dev, bool direct_ok,
                   uint64_t len, uint64_t window_bytes, uint64_t *trial);
/* A read of the trial window `trial` (0: none) on device dev ended,
 * bytes of it read (0 if it failed). */
void laden__way_done(uint64_t dev, uint64_t trial, uint64_t bytes);
/* The mode LADEN_IO_DIRECT asks for, or `mode` where it is not set or the
 * mode is not AUTO.  LADEN_E_INVAL naming the value if it is not one of
 * auto, on, off. */
laden_status laden__way_env(int mode, int *out);
/* Sets dev's choice from a measurement of each way (a rate of 0: the way
 * is not available), in place of what trials found; *out gets it. */
void laden__way_measured(uint64_t dev, double direct_bps, double buffered_bps,
                         laden__ways *out);
/* What was measured on dev (chosen -1 and zeros where nothing was). */
void laden__ways_of(uint64_t dev, laden__ways *out);
/* Forgets it: the next cold reads there measure again. */
void laden__ways_forget(uint64_t dev);

#endif
