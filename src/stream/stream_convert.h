/* convert.c: dtype conversion and the rope-row reorder, for build.c (what
 * can be converted) and load.c (converting as it reads).  No part of the
 * schedule: these touch only the bytes they are given.  Not installed. */
#ifndef LADEN_STREAM_CONVERT_H
#define LADEN_STREAM_CONVERT_H

#include <stdbool.h>
#include <stdint.h>

#include "laden/stream.h"

/* F32, F16 or BF16: the dtypes converted to. */
bool laden__convertible(laden_dtype d);
/* The dtypes converted from: those and fp8, which decode exactly. */
bool laden__decodable(laden_dtype d);
/* F8_E4M3 or F8_E5M2. */
bool laden__fp8(laden_dtype d);
/* Quantizes rows x cols floats to e4m3 with one float32 scale per row
 * (amax / 448). */
void laden__quantize_rows(laden_dtype from, const void *src, uint64_t rows,
                          uint64_t cols, uint8_t *dst, float *scales);
/* Rows of n_rows x row_bytes at src, in GGUF's rope order over `heads`
 * heads, written to dst in transformers' order. */
void laden__unrope_rows(const void *src, void *dst, uint64_t n_rows,
                        uint64_t row_bytes, uint64_t heads);

#endif
