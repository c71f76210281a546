/* Between the VBARs (vram.c) and the elastic allocator (elastic.c). */
#ifndef LADEN_VRAM_INTERNAL_H
#define LADEN_VRAM_INTERNAL_H

#include "laden/vram.h"

/* Registers the function that gives back idle charged memory before
 * weights are evicted (NULL: none).  It is called with the context's lock
 * held and must not call back into the context; the bytes it returns are
 * uncharged by the caller. */
void laden__vram_set_reclaim(laden_vram_t *c,
                             uint64_t (*fn)(void *arg, uint64_t need),
                             void *arg);

#endif
