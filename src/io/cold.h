/* Internal to src/io: what the page cache holds of a file, and how the
 * bytes it does not hold are read on each file system (see cold.c). */
#ifndef LADEN_IO_COLD_H
#define LADEN_IO_COLD_H
#include <stdbool.h>
#include <stdint.h>

#include "laden/io.h"

/* The two ways to read bytes the page cache does not hold. */
enum { LADEN__WAY_DIRECT = 0, LADEN__WAY_BUFFERED = 1 };

/* Whether the kernel tells this process which pages of the file it caches
 * (mincore answers truthfully only to the file's owner, to whoever may
 * write it, and to root). */
bool laden__residency_known(int fd, uint64_t uid);
/* Marks in vec[i] (one byte per page from off's page on) whether the page
 * cache holds page i of [off, off+len).  Reads nothing.  false: the
 * mapping failed (vec untouched). */
bool laden__resident(int fd, uint64_t off, uint64_t len, unsigned char *vec);

/* The way a pool whose mode is `mode` reads a cold part of len bytes of
 * a file on device dev that takes O_DIRECT (direct_ok).  Where the file
 * system's choice is not made yet the read is part of the trial (a window
 * of window_bytes, or at least 8 MiB, one way): *trial gets its window,
 * handed to laden__way_done when the read ended; else 0. */
int laden__way_for(laden_io_direct mode, uint64_t dev, bool direct_ok,
                   uint64_t len, uint64_t window_bytes, uint64_t *trial);
/* A read of the trial window `trial` (0: none) on device dev ended,
 * bytes of it read (0 if it failed). */
void laden__way_done(uint64_t dev, uint64_t trial, uint64_t bytes);
/* The mode LADEN_IO_DIRECT asks for, or `mode` where it is not set or the
 * mode is not AUTO.  LADEN_E_INVAL naming the value if it is not one of
 * auto, on, off. */
laden_status laden__way_env(laden_io_direct mode, laden_io_direct *out);
/* Sets dev's choice from a measurement of each way (a rate of 0: the way
 * is not available), in place of what trials found; *out gets it. */
void laden__way_measured(uint64_t dev, double direct_bps, double buffered_bps,
                         laden_io_ways *out);

#endif
