/* expand: compact weights expanded to a float dtype where they are used,
 * in one pass: GGUF's block types (Q4_0 .. Q6_K), fp8 with float32 scales
 * (per tensor, per row, per 128 x 128 tile) and plain F32/F16/BF16, read
 * once and written once as F32, F16 or BF16.
 *
 * Values: the element's value in float32, computed with the reference's
 * operations in the reference's order (GGUF: laden_gguf_dequantize, which
 * is bit for bit gguf.quants.dequantize; fp8: the exact fp8 value times
 * the scale, one float32 multiply), then rounded once to the destination
 * (round to nearest even).  Every NaN comes out as the one quiet NaN,
 * positive: 0x7fc00000 (F32), 0x7e00 (F16), 0x7fc0 (BF16) -- GPUs do not
 * keep NaN payloads through arithmetic, so this is what makes the CPU and
 * CUDA results equal bit for bit in every case.  (The CPU reference in
 * laden_sched_convert keeps the payload and sign of a NaN; nothing else
 * differs.)  The CPU path assumes the thread's default floating-point
 * environment (no flush-to-zero).
 *
 * Devices.  The CPU device runs the C code the CUDA kernels are made from
 * (one source, compiled twice), on the calling thread.  A CUDA device runs
 * kernels compiled at run time by NVRTC, the CUDA runtime compiler:
 *  - why NVRTC: building laden needs no CUDA SDK (the driver is opened at
 *    run time, see dev.h), so there is no nvcc at build time to make
 *    kernels; NVRTC compiles them on the machine that runs them, for the
 *    device found there (a CUBIN for its exact sm_XY, so no PTX JIT and no
 *    list of architectures chosen in advance), from the same source the
 *    CPU path compiles;
 *  - where from: the path given to laden_expand_set_nvrtc, then the
 *    environment variable LADEN_NVRTC, then the sonames libnvrtc.so.13,
 *    libnvrtc.so.12, libnvrtc.so.11.2 and libnvrtc.so.  Its
 *    libnvrtc-builtins, which NVRTC opens by soname, is loaded first from
 *    NVRTC's own directory, so a pip-installed NVRTC (torch's wheels) works
 *    without LD_LIBRARY_PATH;
 *  - when: on a device's first laden_expand_ready or laden_expand, once
 *    per process and device (30 kernels: one per source format, for
 *    16-byte-aligned and for other addresses; some seconds of CPU time,
 *    spread over the cores with NVRTC's --split-compile; devices of one
 *    compute capability share the compiled image); later calls only
 *    launch;
 *  - without it (no NVRTC, or a driver without module calls):
 *    LADEN_E_UNSUPPORTED saying why; callers expand on the CPU instead
 *    (laden_sched_convert) and move the expanded bytes.
 * The loaded module is never unloaded: it lives as long as the device's
 * primary context, which laden never releases either.  Setting
 * LADEN_EXPAND_SOFT_CVT=1 before the first use compiles the kernels with
 * the C rounding code instead of the device's conversion instructions (the
 * same results, slower: for checking the fast path).
 *
 * All calls may come from any thread. */
#ifndef LADEN_EXPAND_H
#define LADEN_EXPAND_H

#include "../laden.h"
#include "dev.h"
#include "dtype.h" /* laden_dtype: dev sits below the format readers */

#ifdef __cplusplus
extern "C" {
#endif

/* Where the scales of an fp8 tensor are.  Values are stable. */
typedef enum laden_scale_kind {
    LADEN_SCALE_NONE = 0,   /* no scale: value = the fp8 value */
    LADEN_SCALE_TENSOR = 1, /* one float32 */
    LADEN_SCALE_ROW = 2,    /* one float32 per row (rows = n_elems / cols) */
    LADEN_SCALE_TILE128 = 3 /* float32 [ceil(rows/128)][ceil(cols/128)],
                               row-major: one per 128 x 128 tile */
} laden_scale_kind;

/* dst[0 .. n_elems) = the n_elems values of the compact tensor at src,
 * rounded once to dst_dtype (F32, F16 or BF16), as described above.
 *
 * src_dtype is one of
 *  - a GGUF block type (LADEN_DTYPE_Q4_0 .. Q6_K): n_elems a multiple of
 *    the block's elements, src_bytes = n_elems / block_elems * block_bytes
 *    (laden_dtype_block), kind NONE and scale 0 (blocks carry their own
 *    scales); cols is ignored;
 *  - F8_E4M3 or F8_E5M2: one byte per element (src_bytes = n_elems);
 *    value = fp8 value x scale in float32, the scale chosen by kind:
 *    NONE (scale 0), TENSOR (scale -> 1 float32), ROW or TILE128 (cols =
 *    elements per row, n_elems a multiple of it; scale -> rows, or
 *    ceil(rows/128) * ceil(cols/128), float32s; laden cannot check that
 *    many are there);
 *  - F32, F16 or BF16 with kind NONE: a plain conversion.
 * Sizes and alignment: n_elems > 0; src any alignment; dst aligned to its
 * element (2 or 4 bytes), scale to 4.  src, dst and scale must not
 * overlap.  With src and dst 16-byte aligned the kernels move 16 bytes per
 * access; otherwise they read bytes one at a time (correct, slower).
 *
 * device LADEN_DEVICE_CPU: host addresses; done on the calling thread
 * before the call returns; stream is ignored.
 * device >= 0: addresses of that CUDA device's memory (or memory it can
 * reach), used from its primary context, which this call makes current on
 * the calling thread; the work is queued on `stream` (a CUstream handle,
 * e.g. torch.cuda.current_stream().cuda_stream; 0 is the legacy default
 * stream) and the call returns once it is queued: src and scale must stay
 * valid and unchanged, and dst unread, until the stream has passed it.
 * The first call on a device compiles the kernels (see above).
 *
 * Errors: LADEN_E_INVAL for a NULL address, n_elems 0, sizes that do not
 * fit (the message names them), a scale kind the source cannot take, cols
 * 0 or not dividing n_elems with ROW/TILE128, a misaligned dst or scale;
 * LADEN_E_UNSUPPORTED for a dtype pair not expanded here or when the CUDA
 * kernels cannot be had (the message says why: NVRTC not found and the
 * names tried, the compile log's first lines, the driver lacking module
 * calls); LADEN_E_NODEVICE for a device that does not exist;
 * LADEN_E_DEVICE for a failed launch.  Nothing is written on failure. */
LADEN_API laden_status laden_expand(int32_t device, uintptr_t stream,
                                    laden_dtype src_dtype, laden_devptr_t src,
                                    uint64_t src_bytes, uint64_t n_elems,
                                    uint64_t cols, laden_devptr_t scale,
                                    laden_scale_kind kind,
                                    laden_dtype dst_dtype,
                                    laden_devptr_t dst);

/* Whether laden_expand works on `device`: LADEN_OK, or the error
 * laden_expand would give there.  CUDA: loads NVRTC, compiles and loads the
 * kernels now if that was not done yet (blocks for it, about a second);
 * later calls return at once.  A failure is remembered (later calls return
 * it without trying again) until laden_expand_set_nvrtc is called. */
LADEN_API laden_status laden_expand_ready(int32_t device);

/* Where NVRTC is: a path to libnvrtc.so.* tried before the environment
 * variable LADEN_NVRTC and the sonames (see above); NULL clears it.  The
 * string is copied.  Python passes the NVRTC of torch's CUDA wheels.
 * Devices whose kernels failed to load try again on their next use.
 * LADEN_E_STATE when NVRTC was already loaded from another path (a loaded
 * library is kept), LADEN_E_INVAL for an empty or overlong path. */
LADEN_API laden_status laden_expand_set_nvrtc(const char *path);

/* One line saying how `device` expands, for logs and benchmarks, into
 * out[0 .. out_bytes) (NUL-terminated, cut to fit): CPU "cpu: C, one
 * thread"; CUDA e.g. "cuda:0: sm_90 CUBIN from NVRTC 13.0
 * (/path/libnvrtc.so.13), 30 kernels, compiled and loaded in 812 ms".
 * Calls laden_expand_ready first and returns its error (out then holds
 * the message). */
LADEN_API laden_status laden_expand_describe(int32_t device, char *out,
                                             uint64_t out_bytes);

#ifdef __cplusplus
}
#endif
#endif
