/* Device expansion of compact weights (include/laden/expand.h).
 *
 * One source, expand_kernels.h, is compiled here as C (the CPU device runs
 * it, one "thread" walking every unit) and kept as text that NVRTC compiles
 * into the CUDA kernels at run time, one kernel per source format and
 * alignment (16-byte accesses or bytes).  Only what cannot be the same in
 * both -- loads, stores, bit casts, the paired roundings -- is written
 * twice, in the two prologues below.
 *
 * CUDA state is per device, made once under one mutex: the driver's module
 * and launch calls (resolved here, not in cuda.c, so that a driver without
 * them still runs the rest of laden), NVRTC (opened once, kept), the
 * compiled image (kept for the next device of the same compute
 * capability), the module and its functions (never unloaded).  After
 * that, laden_expand reads the device's state without locking. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"
#include "dev_internal.h"
#include "laden/expand.h"
#include "laden/lossless.h"

/* ---- the C prologue and the kernels as C ------------------------------ */

/* (CMake passes -ffp-contract=off for this file: see expand_c.h.) */
#include "expand_c.h"

/* ---- the kernels as text ----------------------------------------------- */

/* Units a CUDA thread has in flight (the kernels' EX_BATCH, see ex_loop).
 * 4 was measured against 2 on the H200 (2026-12-01, BENCHMARK.md): no
 * format faster, Q3_K/Q5_0/Q6_K 10-16 % slower (fewer threads resident
 * for the registers), so 2; 1 for the K-quants only: within noise but
 * Q6_K (7 % faster) and Q4_K (3 % slower).  Loading a Q4_K/Q5_K block's
 * 16 header bytes at once instead of four loads made them 7-9 % slower
 * (second session of 2026-12-01). */
#define EX_CUDA_BATCH 2u
#define EX_STR2(x) #x
#define EX_STR(x) EX_STR2(x)

/* What NVRTC sees before the shared code: the device's loads and stores
 * (global memory, read-only loads through the non-coherent path: src and
 * scale are not written while a kernel runs), bit casts, and the paired
 * round-to-nearest-even conversions of sm_80 and later. */
static const char cuda_prologue[] =
    "typedef unsigned char u8;\n"
    "typedef unsigned short u16;\n"
    "typedef unsigned int u32;\n"
    "typedef unsigned long long u64;\n"
    "#define EX_FN static __device__ __forceinline__\n"
    "#define EX_UNROLL _Pragma(\"unroll\")\n"
    "#define EX_BATCH " EX_STR(EX_CUDA_BATCH) "\n"
    /* Loads through __ldg (ld.global.nc), never inline asm: an asm
     * statement is pure to the compiler, which may then issue it before
     * the branch that guards it (found on the H200: the scale pointer,
     * NULL without a scale, read at the top of the fp8 kernel). */
    "EX_FN u32 ex_ld8(u64 a) { return __ldg((const unsigned char *)a); }\n"
    "EX_FN u32 ex_ld16(u64 a, u32 vec) { if (!vec) return ex_ld8(a) | "
    "ex_ld8(a + 1u) << 8; return __ldg((const unsigned short *)a); }\n"
    "EX_FN u32 ex_ld32(u64 a, u32 vec) { if (!vec) return ex_ld16(a, 0u) | "
    "ex_ld16(a + 2u, 0u) << 16; return __ldg((const unsigned int *)a); }\n"
    "EX_FN void ex_ld2x32(u64 a, u32 vec, u32 *x, u32 *y) { if (!vec) { *x "
    "= ex_ld32(a, 0u); *y = ex_ld32(a + 4u, 0u); return; } uint2 v = "
    "__ldg((const uint2 *)a); *x = v.x; *y = v.y; }\n"
    "EX_FN void ex_st16(u64 a, u32 h) { asm volatile(\"st.global.u16 [%0], "
    "%1;\" :: \"l\"(a), \"h\"((unsigned short)h)); }\n"
    "EX_FN void ex_st32(u64 a, u32 w) { asm volatile(\"st.global.u32 [%0], "
    "%1;\" :: \"l\"(a), \"r\"(w)); }\n"
    "EX_FN void ex_st4x32(u64 a, u32 x, u32 y, u32 z, u32 w) { asm "
    "volatile(\"st.global.v4.u32 [%0], {%1, %2, %3, %4};\" :: \"l\"(a), "
    "\"r\"(x), \"r\"(y), \"r\"(z), \"r\"(w)); }\n"
    "EX_FN float ex_u2f(u32 x) { return __uint_as_float(x); }\n"
    "EX_FN u32 ex_f2u(float f) { return __float_as_uint(f); }\n"
    "#if __CUDA_ARCH__ >= 800 && !defined(EX_SOFT_CVT)\n"
    "EX_FN u32 ex_hw_bf16x2(float lo, float hi) { u32 r; "
    "asm(\"cvt.rn.bf16x2.f32 %0, %1, %2;\" : \"=r\"(r) : \"f\"(hi), "
    "\"f\"(lo)); return r; }\n"
    "EX_FN u32 ex_hw_f16x2(float lo, float hi) { u32 r; "
    "asm(\"cvt.rn.f16x2.f32 %0, %1, %2;\" : \"=r\"(r) : \"f\"(hi), "
    "\"f\"(lo)); return r; }\n"
    "#else\n"
    "#define ex_hw_bf16x2(lo, hi) (ex_sw_bf16(ex_f2u(lo)) | "
    "ex_sw_bf16(ex_f2u(hi)) << 16)\n"
    "#define ex_hw_f16x2(lo, hi) (ex_sw_f16(ex_f2u(lo)) | "
    "ex_sw_f16(ex_f2u(hi)) << 16)\n"
    "#endif\n"
    /* The argument read where it lies (no copy to local memory) */
    "#if __CUDA_ARCH__ >= 700 && (__CUDACC_VER_MAJOR__ > 11 || "
    "(__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))\n"
    "#define EX_PARAM const __grid_constant__ ex_params\n"
    "#define EX_LL_PARAM const __grid_constant__ ex_ll_params\n"
    "#else\n"
    "#define EX_PARAM const ex_params\n"
    "#define EX_LL_PARAM const ex_ll_params\n"
    "#endif\n"
    "#define EX_KERNEL(name, fmt, vec) extern \"C\" __global__ void "
    "__launch_bounds__(256) name(EX_PARAM p) { ex_loop(&p, (u64)blockIdx.x "
    "* blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x, fmt, vec); }\n"
    "#line 1 \"expand_kernels.h (one line per EX block)\"\n";

#ifdef __GNUC__
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverlength-strings"
#endif
#define EX(...) #__VA_ARGS__ "\n",
static const char *const kernel_text[] = {
#include "expand_kernels.h"
};
#undef EX
#ifdef __GNUC__
#pragma GCC diagnostic pop
#endif

/* ---- formats ------------------------------------------------------------ */

#define THREADS 256u /* per block, as __launch_bounds__ says */
#define WAVES 4u      /* at most, see load_device */

/* Sizes of blocks come from the dtype table (laden_dtype_block). */
typedef struct format {
    laden_dtype dtype;
    const char *name; /* the kernels' names: laden_ex_<name>_<v|b> */
} format;

/* In EX_* order. */
static const format formats[EX_NFMT] = {
    {LADEN_DTYPE_Q4_0, "q4_0"},     {LADEN_DTYPE_Q4_1, "q4_1"},
    {LADEN_DTYPE_Q5_0, "q5_0"},     {LADEN_DTYPE_Q5_1, "q5_1"},
    {LADEN_DTYPE_Q8_0, "q8_0"},     {LADEN_DTYPE_Q2_K, "q2_k"},
    {LADEN_DTYPE_Q3_K, "q3_k"},     {LADEN_DTYPE_Q4_K, "q4_k"},
    {LADEN_DTYPE_Q5_K, "q5_k"},     {LADEN_DTYPE_Q6_K, "q6_k"},
    {LADEN_DTYPE_F8_E4M3, "e4m3"},  {LADEN_DTYPE_F8_E5M2, "e5m2"},
    {LADEN_DTYPE_F16, "f16"},       {LADEN_DTYPE_BF16, "bf16"},
    {LADEN_DTYPE_F32, "f32"},
};

static int format_of(laden_dtype d)
{
    for (int i = 0; i < EX_NFMT; i++)
        if (formats[i].dtype == d)
            return i;
    return -1;
}

static const char *dtype_text(laden_dtype d)
{
    const char *s = laden_dtype_name(d);
    return s ? s : "an unknown dtype";
}

/* ---- arguments ------------------------------------------------------------ */

/* Checks the call and fills the kernels' argument; *vec = 16-byte
 * accesses. */
static laden_status prepare(laden_dtype src_dtype, laden_devptr_t src,
                            uint64_t src_bytes, uint64_t n, uint64_t cols,
                            laden_devptr_t scale, laden_scale_kind kind,
                            laden_dtype dst_dtype, laden_devptr_t dst,
                            ex_params *p, uint32_t *vec)
{
    memset(p, 0, sizeof *p);
    int f = format_of(src_dtype);
    uint32_t out = dst_dtype == LADEN_DTYPE_F32    ? EX_OUT_F32
                   : dst_dtype == LADEN_DTYPE_F16  ? EX_OUT_F16
                   : dst_dtype == LADEN_DTYPE_BF16 ? EX_OUT_BF16
                                                   : UINT32_MAX;
    if (f < 0 || out == UINT32_MAX)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "laden_expand: cannot expand %s to %s (from GGUF's "
                           "Q4_0..Q6_K, F8_E4M3, F8_E5M2, F32, F16, BF16 to "
                           "F32, F16, BF16)",
                           dtype_text(src_dtype), dtype_text(dst_dtype));
    if (!src || !dst)
        return laden__fail(LADEN_E_INVAL, "laden_expand: %s is NULL",
                           !src ? "src" : "dst");
    if (n == 0)
        return laden__fail(LADEN_E_INVAL, "laden_expand: n_elems is 0");
    const format *fm = &formats[f];
    uint32_t block_elems = 1, block_bytes = 1;
    laden_dtype_block(src_dtype, &block_elems, &block_bytes);
    if (n % block_elems)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: %llu elements are not a multiple "
                           "of %s's %u-element blocks",
                           (unsigned long long)n, fm->name, block_elems);
    uint64_t want = 0, dst_bytes = 0;
    uint32_t out_size = laden_dtype_bits(dst_dtype) / 8;
    if (!laden__mul_u64(n / block_elems, block_bytes, &want) ||
        !laden__mul_u64(n, out_size, &dst_bytes))
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: %llu elements overflow the address "
                           "space", (unsigned long long)n);
    if (src_bytes != want)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: %llu elements of %s take %llu "
                           "bytes, not src_bytes %llu",
                           (unsigned long long)n, dtype_text(src_dtype),
                           (unsigned long long)want,
                           (unsigned long long)src_bytes);
    bool fp8 = f == EX_E4M3 || f == EX_E5M2;
    if ((unsigned)kind > LADEN_SCALE_TILE128)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: scale kind %d is not a "
                           "laden_scale_kind", (int)kind);
    if (kind != LADEN_SCALE_NONE && !fp8)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: a scale (kind %d) with %s: only fp8 "
                           "takes one (%s)",
                           (int)kind, dtype_text(src_dtype),
                           f < EX_E4M3 ? "GGUF blocks carry their own scales"
                                       : "a plain conversion has none");
    if (kind == LADEN_SCALE_NONE && scale)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: a scale address with "
                           "LADEN_SCALE_NONE (say which kind of scale it is)");
    if (kind != LADEN_SCALE_NONE && !scale)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: scale is NULL with scale kind %d",
                           (int)kind);
    if (scale % 4)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: scale 0x%llx is not aligned to the "
                           "4 bytes of a float32",
                           (unsigned long long)scale);
    if (kind == LADEN_SCALE_ROW || kind == LADEN_SCALE_TILE128) {
        if (cols == 0)
            return laden__fail(LADEN_E_INVAL,
                               "laden_expand: cols is 0 with a per-%s scale",
                               kind == LADEN_SCALE_ROW ? "row" : "tile");
        if (n % cols)
            return laden__fail(LADEN_E_INVAL,
                               "laden_expand: %llu elements are not whole "
                               "rows of cols %llu",
                               (unsigned long long)n,
                               (unsigned long long)cols);
        p->cols = cols;
        p->tcols = cols / 128 + (cols % 128 != 0);
    }
    if (dst % out_size)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: dst 0x%llx is not aligned to the %u "
                           "bytes of %s",
                           (unsigned long long)dst, out_size,
                           dtype_text(dst_dtype));
    uint64_t end;
    if (!laden__add_u64(src, src_bytes, &end) ||
        !laden__add_u64(dst, dst_bytes, &end))
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand: src or dst runs past the end of "
                           "the address space");
    p->src = src;
    p->dst = dst;
    p->scale = scale;
    p->n = n;
    p->units = n / 8 + (n % 8 != 0);
    p->fmt = (uint32_t)f;
    p->out = out;
    p->kind = (uint32_t)kind;
    p->n32 = n < (UINT64_C(1) << 32);
    *vec = src % 16 == 0 && dst % 16 == 0;
    return LADEN_OK;
}

/* ---- CUDA: driver calls --------------------------------------------------- */

#define MAX_DEVICES 64

static pthread_mutex_t ex_mu = PTHREAD_MUTEX_INITIALIZER;

/* Under ex_mu.  cuda.c has opened the driver (laden__cuda_load) and
 * resolved the module and launch calls if the driver has them. */
static laden_status resolve_driver(void)
{
    if (laden__cuda_kernel_error[0])
        return laden__fail(LADEN_E_UNSUPPORTED, "%s",
                           laden__cuda_kernel_error);
    return LADEN_OK;
}

static const char *cu_name(CUresult r)
{
    const char *s = "CUDA_ERROR_UNKNOWN";
    if (laden__cuk.cuGetErrorName)
        laden__cuk.cuGetErrorName(r, &s);
    return s ? s : "CUDA_ERROR_UNKNOWN";
}

/* ---- CUDA: NVRTC ------------------------------------------------------- */

typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;

#define NVRTC_FUNCS(X)                                                        \
    X(nvrtcVersion, (int *major, int *minor))                                 \
    X(nvrtcCreateProgram,                                                     \
      (nvrtcProgram * prog, const char *src, const char *name, int nheaders, \
       const char *const *headers, const char *const *include_names))       \
    X(nvrtcCompileProgram,                                                    \
      (nvrtcProgram prog, int nopts, const char *const *opts))                \
    X(nvrtcGetProgramLogSize, (nvrtcProgram prog, size_t *n))                 \
    X(nvrtcGetProgramLog, (nvrtcProgram prog, char *log))                     \
    X(nvrtcGetPTXSize, (nvrtcProgram prog, size_t *n))                        \
    X(nvrtcGetPTX, (nvrtcProgram prog, char *ptx))                            \
    X(nvrtcDestroyProgram, (nvrtcProgram * prog))
/* Newer than NVRTC 11.2's first release, used when there. */
#define NVRTC_OPTIONAL_FUNCS(X)                                               \
    X(nvrtcGetCUBINSize, (nvrtcProgram prog, size_t *n))                      \
    X(nvrtcGetCUBIN, (nvrtcProgram prog, char *cubin))                        \
    X(nvrtcGetNumSupportedArchs, (int *n))                                    \
    X(nvrtcGetSupportedArchs, (int *archs))

static struct {
    void *lib;
#define FIELD(name, args) nvrtcResult (*name) args;
    NVRTC_FUNCS(FIELD)
    NVRTC_OPTIONAL_FUNCS(FIELD)
#undef FIELD
    const char *(*nvrtcGetErrorString)(nvrtcResult);
    int major, minor;
    char opened[PATH_MAX]; /* as passed to dlopen */
    char path[PATH_MAX];   /* the file the loader found */
} nv;
static char nvrtc_asked[PATH_MAX]; /* laden_expand_set_nvrtc's */

static void append(char *buf, size_t cap, const char *fmt, const char *s)
{
    size_t len = strlen(buf);
    if (len < cap)
        snprintf(buf + len, cap - len, fmt, s);
}

/* NVRTC opens libnvrtc-builtins.so.<major>.<minor> itself, by soname, so
 * only from the loader's search path: a pip-installed NVRTC fails there
 * unless LD_LIBRARY_PATH names its directory.  Loaded first from NVRTC's
 * own directory, it is found by its soname (as torch does for its
 * wheels). */
static void preload_builtins(void)
{
    char dir[PATH_MAX], file[PATH_MAX + 320];
    snprintf(dir, sizeof dir, "%s", nv.path);
    char *slash = strrchr(dir, '/');
    if (!slash)
        return;
    *slash = 0;
    snprintf(file, sizeof file, "%s/libnvrtc-builtins.so.%d.%d", dir,
             nv.major, nv.minor);
    if (dlopen(file, RTLD_NOW | RTLD_GLOBAL))
        return;
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "libnvrtc-builtins.so",
                    strlen("libnvrtc-builtins.so")) != 0)
            continue;
        snprintf(file, sizeof file, "%s/%s", dir, e->d_name);
        if (dlopen(file, RTLD_NOW | RTLD_GLOBAL))
            break;
    }
    closedir(d);
}

/* Under ex_mu: opens NVRTC once. */
static laden_status load_nvrtc(void)
{
    if (nv.lib)
        return LADEN_OK;
    const char *env = getenv("LADEN_NVRTC");
    const char *names[] = {nvrtc_asked[0] ? nvrtc_asked : NULL,
                           env && *env ? env : NULL,
                           "libnvrtc.so.13",
                           "libnvrtc.so.12",
                           "libnvrtc.so.11.2",
                           "libnvrtc.so"};
    char tried[1024] = "";
    void *lib = NULL;
    size_t i;
    for (i = 0; i < LADEN__ARRAY_LEN(names) && !lib; i++) {
        if (!names[i])
            continue;
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (lib)
            break;
        if (strchr(names[i], '/')) {
            const char *why = dlerror();
            append(tried, sizeof tried, "%s", names[i]);
            append(tried, sizeof tried, " (%s), ", why ? why : "?");
        } else {
            append(tried, sizeof tried, "%s, ", names[i]);
        }
    }
    if (!lib) {
        size_t len = strlen(tried);
        if (len >= 2)
            tried[len - 2] = 0;
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "device expansion needs NVRTC, the CUDA runtime "
                           "compiler, and it was not found (tried %s): pass "
                           "its path to laden_expand_set_nvrtc or in "
                           "LADEN_NVRTC (torch's CUDA wheels and pip's "
                           "nvidia-cuda-nvrtc bring libnvrtc.so)",
                           tried);
    }
#define SYM(name, args)                                                      \
    {                                                                        \
        void *fn = dlsym(lib, #name);                                        \
        if (!fn)                                                             \
            return laden__fail(LADEN_E_UNSUPPORTED,                         \
                               "%s has no %s: not a usable NVRTC",          \
                               names[i], #name);                             \
        memcpy(&nv.name, &fn, sizeof fn);                                    \
    }
    NVRTC_FUNCS(SYM)
#undef SYM
#define OPTSYM(name, args)                                                   \
    {                                                                        \
        void *fn = dlsym(lib, #name);                                        \
        memcpy(&nv.name, &fn, sizeof fn);                                    \
    }
    NVRTC_OPTIONAL_FUNCS(OPTSYM)
    OPTSYM(nvrtcGetErrorString, ())
#undef OPTSYM
    if (nv.nvrtcVersion(&nv.major, &nv.minor) != 0)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "%s: nvrtcVersion failed", names[i]);
    snprintf(nv.opened, sizeof nv.opened, "%s", names[i]);
    Dl_info info;
    void *fn;
    memcpy(&fn, &nv.nvrtcVersion, sizeof fn);
    if (dladdr(fn, &info) && info.dli_fname)
        snprintf(nv.path, sizeof nv.path, "%s", info.dli_fname);
    else
        snprintf(nv.path, sizeof nv.path, "%s", names[i]);
    preload_builtins();
    nv.lib = lib;
    return LADEN_OK;
}

static const char *nvrtc_error(nvrtcResult r)
{
    const char *s = nv.nvrtcGetErrorString ? nv.nvrtcGetErrorString(r) : NULL;
    return s ? s : "NVRTC error";
}

/* The whole kernel source: prologue, shared code, one EX_KERNEL line per
 * format and alignment.  malloc'd; NULL when out of memory. */
/* The lossless decoder (lossless.h): each block builds the code's table
 * in shared memory, then each thread decodes sub-chunks. */
static const char ll_kernel[] =
    "extern \"C\" __global__ void __launch_bounds__(256) "
    "laden_ll_decode(EX_LL_PARAM p) {\n"
    "  __shared__ u16 lut[EX_LL_LUT];\n"
    "  __shared__ ex_ll_canon c;\n"
    "  __shared__ u32 bad;\n"
    "  u32 t = threadIdx.x, n = blockDim.x;\n"
    "  for (u32 s = t; s < 256u; s += n) ex_ll_canon_len(&p, &c, s);\n"
    "  __syncthreads();\n"
    "  for (u32 l = t; l <= (u32)EX_LL_BITS; l += n) "
    "ex_ll_canon_count(&c, l);\n"
    "  __syncthreads();\n"
    "  if (t == 0) bad = ex_ll_canon_start(&c);\n"
    "  __syncthreads();\n"
    "  if (!bad) for (u32 s = t; s < 256u; s += n) ex_ll_canon_place(&c, s);\n"
    "  __syncthreads();\n"
    "  if (!bad) for (u32 i = t; i < (u32)EX_LL_LUT; i += n) "
    "lut[i] = (u16)ex_ll_entry(&c, i);\n"
    "  __syncthreads();\n"
    "  u32 e = bad, j = t % 32u;\n"
    /* bad is the block's: a warp's lanes loop together (the shuffles) */
    "  if (!bad) for (u64 i = ((u64)blockIdx.x * n + t) / "
    "32u; i < p.nsub; i += (u64)gridDim.x * n / 32u) {\n"
    "    u32 h, sum = ex_ll_seed();\n"
    "    u32 b = ex_ll_lane(&p, lut, i, j, &h);\n"
    "    for (u32 k = 0; k < 32u; k++) sum = ex_ll_mix(sum, "
    "__shfl_sync(0xffffffffu, h, k));\n"
    "    e |= b | (j == 0u && sum != ex_ll_sum(&p, i));\n"
    "  }\n"
    "  if (e && p.err) ex_st32(p.err, 1u);\n"
    "}\n";

static char *kernel_source(void)
{
    size_t len = sizeof cuda_prologue + sizeof ll_kernel + 1;
    for (size_t i = 0; i < LADEN__ARRAY_LEN(kernel_text); i++)
        len += strlen(kernel_text[i]);
    len += (size_t)EX_NFMT * 2 * 96;
    char *s = malloc(len), *at = s;
    if (!s)
        return NULL;
    at += sprintf(at, "%s", cuda_prologue);
    for (size_t i = 0; i < LADEN__ARRAY_LEN(kernel_text); i++)
        at += sprintf(at, "%s", kernel_text[i]);
    for (int f = 0; f < EX_NFMT; f++)
        for (int v = 0; v < 2; v++)
            at += sprintf(at, "EX_KERNEL(laden_ex_%s_%c, %d, %du)\n",
                          formats[f].name, v ? 'v' : 'b', f, v);
    at += sprintf(at, "%s", ll_kernel);
    return s;
}

/* For tests: the source NVRTC compiles, malloc'd (free it), NULL when out
 * of memory. */
char *laden__expand_cuda_source(void);
char *laden__expand_cuda_source(void)
{
    return kernel_source();
}

/* The compiled image, kept for the next device of the same target. */
static struct {
    char target[32]; /* "sm_90" (CUBIN) or "compute_90" (PTX) */
    char *image;
    double ms;
} img;

/* Under ex_mu: compiles the kernels for compute capability cc (10 *
 * major + minor) into img, unless img already is for that target. */
static laden_status compile(int32_t dev, int cc, bool *reused)
{
    char target[32];
    bool cubin = nv.nvrtcGetCUBIN && nv.nvrtcGetCUBINSize;
    int best = cc, n = 0;
    if (nv.nvrtcGetNumSupportedArchs && nv.nvrtcGetSupportedArchs &&
        nv.nvrtcGetNumSupportedArchs(&n) == 0 && n > 0 && n < 1024) {
        int archs[1024];
        /* The list unread (the call failed): compile for the device and
         * let NVRTC say whether it can. */
        if (nv.nvrtcGetSupportedArchs(archs) == 0) {
            best = -1;
            for (int i = 0; i < n; i++)
                if (archs[i] <= cc && archs[i] > best)
                    best = archs[i];
        }
        if (best < 0)
            return laden__fail(LADEN_E_UNSUPPORTED,
                               "cuda:%d: NVRTC %d.%d (%s) cannot compile for "
                               "sm_%d (its oldest target is sm_%d)",
                               dev, nv.major, nv.minor, nv.path, cc,
                               archs[0]);
    }
    /* A CUBIN for the device itself; else PTX of the newest older target,
     * which the driver compiles. */
    if (best != cc)
        cubin = false;
    snprintf(target, sizeof target, "%s_%d", cubin ? "sm" : "compute", best);
    *reused = img.image && strcmp(img.target, target) == 0;
    if (*reused)
        return LADEN_OK;
    uint64_t t0 = laden__now_ns();
    char *src = kernel_source();
    if (!src)
        return laden__fail(LADEN_E_NOMEM, "out of memory for the kernels");
    char arch[64];
    snprintf(arch, sizeof arch, "--gpu-architecture=%s", target);
    /* Exact float32 arithmetic: no fused multiply-add, subnormals kept.
     * --split-compile=0 (NVRTC 12.1 on) compiles the kernels on all cores:
     * some seconds become a fraction of one. */
    const char *soft = getenv("LADEN_EXPAND_SOFT_CVT");
    const char *opts[8] = {arch, "--fmad=false", "--ftz=false",
                           "--prec-div=true", "--prec-sqrt=true",
                           "-default-device"};
    int nopts = 6, split = nv.major > 12 || (nv.major == 12 && nv.minor >= 1);
    if (soft && *soft && strcmp(soft, "0") != 0)
        opts[nopts++] = "-DEX_SOFT_CVT";
    nvrtcProgram prog = NULL;
    nvrtcResult r;
    for (;;) {
        opts[nopts] = "--split-compile=0";
        r = nv.nvrtcCreateProgram(&prog, src, "laden_expand.cu", 0, NULL,
                                  NULL);
        if (r != 0) {
            free(src);
            return laden__fail(LADEN_E_UNSUPPORTED,
                               "cuda:%d: nvrtcCreateProgram failed: %s", dev,
                               nvrtc_error(r));
        }
        r = nv.nvrtcCompileProgram(prog, nopts + split, opts);
        if (!(r == 5 /* NVRTC_ERROR_INVALID_OPTION */ && split))
            break;
        nv.nvrtcDestroyProgram(&prog);
        split = 0;
    }
    free(src);
    if (r != 0) {
        char log[600] = "";
        size_t need = 0;
        if (nv.nvrtcGetProgramLogSize(prog, &need) == 0 && need > 0) {
            char *full = malloc(need + 1);
            if (full && nv.nvrtcGetProgramLog(prog, full) == 0) {
                full[need] = 0;
                snprintf(log, sizeof log, "%s", full);
                for (char *c = log; *c; c++)
                    if (*c == '\n')
                        *c = ' ';
            }
            free(full);
        }
        nv.nvrtcDestroyProgram(&prog);
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "cuda:%d: NVRTC %d.%d (%s) failed to compile the "
                           "expand kernels for %s: %s: %s",
                           dev, nv.major, nv.minor, nv.path, target,
                           nvrtc_error(r), log[0] ? log : "(no log)");
    }
    size_t size = 0;
    r = cubin ? nv.nvrtcGetCUBINSize(prog, &size)
              : nv.nvrtcGetPTXSize(prog, &size);
    char *image = r == 0 && size ? malloc(size) : NULL;
    if (image)
        r = cubin ? nv.nvrtcGetCUBIN(prog, image)
                  : nv.nvrtcGetPTX(prog, image);
    nv.nvrtcDestroyProgram(&prog);
    if (!image || r != 0) {
        free(image);
        return laden__fail(r ? LADEN_E_UNSUPPORTED : LADEN_E_NOMEM,
                           "cuda:%d: cannot get the compiled kernels from "
                           "NVRTC: %s",
                           dev, r ? nvrtc_error(r) : "out of memory");
    }
    free(img.image);
    img.image = image;
    snprintf(img.target, sizeof img.target, "%s", target);
    img.ms = (double)(laden__now_ns() - t0) / 1e6;
    return LADEN_OK;
}

/* ---- CUDA: per device ------------------------------------------------- */

enum { DEV_UNTRIED = 0, DEV_READY = 1, DEV_FAILED = 2 };

static struct ex_dev {
    atomic_int state;
    laden_status err;
    char msg[1024];
    CUfunction fn[EX_NFMT][2];
    unsigned int max_blocks[EX_NFMT][2];
    CUfunction ll_fn; /* laden_ll_decode */
    unsigned int ll_max_blocks;
    char desc[PATH_MAX + 256];
} exdevs[MAX_DEVICES];

/* Under ex_mu, in the device's context: the kernels compiled (or the
 * image of an earlier device reused), loaded and sized. */
static laden_status load_module(int32_t dev, const laden_dev_info_t *info)
{
    laden_status st;
    CUdevice cud = 0;
    int sms = 0;
    if (laden__cuk.cuDeviceGet(&cud, dev) != CUDA_SUCCESS ||
        laden__cuk.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                cud) != CUDA_SUCCESS ||
        sms <= 0)
        sms = 16;
    if ((st = load_nvrtc()))
        return st;
    bool reused = false;
    uint64_t t0 = laden__now_ns();
    if ((st = compile(dev, info->cc_major * 10 + info->cc_minor, &reused)))
        return st;
    CUmodule mod = NULL;
    CUresult r = laden__cuk.cuModuleLoadData(&mod, img.image);
    if (r != CUDA_SUCCESS)
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "cuda:%d: cuModuleLoadData failed for the expand "
                           "kernels (%s from NVRTC %d.%d): %s",
                           dev, img.target, nv.major, nv.minor, cu_name(r));
    struct ex_dev *d = &exdevs[dev];
    for (int f = 0; f < EX_NFMT; f++)
        for (int v = 0; v < 2; v++) {
            char name[64];
            snprintf(name, sizeof name, "laden_ex_%s_%c", formats[f].name,
                     v ? 'v' : 'b');
            r = laden__cuk.cuModuleGetFunction(&d->fn[f][v], mod, name);
            if (r != CUDA_SUCCESS) {
                laden__cuk.cuModuleUnload(mod);
                return laden__fail(LADEN_E_UNSUPPORTED,
                                   "cuda:%d: cuModuleGetFunction(%s) failed: "
                                   "%s",
                                   dev, name, cu_name(r));
            }
            /* The most blocks: WAVES whole waves of as many blocks as the
             * SMs hold at once (so no wave runs part-empty at the end);
             * more work than that loops inside the threads. */
            int per_sm = 0;
            if (laden__cuk.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &per_sm, d->fn[f][v], (int)THREADS, 0) != CUDA_SUCCESS ||
                per_sm <= 0)
                per_sm = 4;
            d->max_blocks[f][v] = (unsigned int)sms * (unsigned int)per_sm *
                                  WAVES;
        }
    r = laden__cuk.cuModuleGetFunction(&d->ll_fn, mod, "laden_ll_decode");
    if (r != CUDA_SUCCESS) {
        laden__cuk.cuModuleUnload(mod);
        return laden__fail(LADEN_E_UNSUPPORTED,
                           "cuda:%d: cuModuleGetFunction(laden_ll_decode) "
                           "failed: %s", dev, cu_name(r));
    }
    int per_sm = 0;
    if (laden__cuk.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, d->ll_fn, (int)THREADS, 0) != CUDA_SUCCESS ||
        per_sm <= 0)
        per_sm = 4;
    d->ll_max_blocks = (unsigned int)sms * (unsigned int)per_sm * WAVES;
    double ms = (double)(laden__now_ns() - t0) / 1e6;
    snprintf(d->desc, sizeof d->desc,
             "cuda:%d: %s %s from NVRTC %d.%d (%s), %d kernels, %s in %.0f ms",
             dev, img.target,
             strncmp(img.target, "sm_", 3) == 0 ? "CUBIN" : "PTX", nv.major,
             nv.minor, nv.path, EX_NFMT * 2 + 1,
             reused ? "compiled for an earlier device, loaded"
                    : "compiled and loaded",
             ms);
    return LADEN_OK;
}

/* Under ex_mu: everything device `dev` needs, or why not. */
static laden_status load_device(int32_t dev)
{
    laden_dev_info_t info;
    laden__cuda_scope sc;
    laden_status st = resolve_driver();
    if (!st) {
        memset(&info, 0, sizeof info);
        st = laden__dev_cuda_ops.info(dev, &info);
    }
    if (st)
        return st;
    /* The module is loaded into the device's context. */
    if ((st = laden__cuda_enter(dev, &sc)))
        return st;
    st = load_module(dev, &info);
    laden__cuda_leave(&sc);
    return st;
}

laden_status laden_expand_ready(int32_t device)
{
    if (device == LADEN_DEVICE_CPU)
        return LADEN_OK;
    const laden__dev_ops *ops;
    laden_status st = laden__dev_resolve(device, &ops);
    if (st)
        return st;
    struct ex_dev *d = &exdevs[device];
    if (atomic_load_explicit(&d->state, memory_order_acquire) == DEV_READY)
        return LADEN_OK;
    pthread_mutex_lock(&ex_mu);
    int s = atomic_load_explicit(&d->state, memory_order_relaxed);
    if (s == DEV_UNTRIED) {
        st = load_device(device);
        if (st) {
            d->err = st;
            snprintf(d->msg, sizeof d->msg, "%s", laden_last_error());
        }
        atomic_store_explicit(&d->state, st ? DEV_FAILED : DEV_READY,
                              memory_order_release);
    } else if (s == DEV_FAILED) {
        st = d->err;
    }
    char msg[sizeof d->msg];
    snprintf(msg, sizeof msg, "%s", d->msg);
    pthread_mutex_unlock(&ex_mu);
    if (st)
        return laden__fail(st, "%s", msg);
    return LADEN_OK;
}

laden_status laden_expand_set_nvrtc(const char *path)
{
    if (path && (!*path || strlen(path) >= sizeof nvrtc_asked))
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand_set_nvrtc: the path is %s",
                           *path ? "too long" : "empty");
    laden_status st = LADEN_OK;
    pthread_mutex_lock(&ex_mu);
    if (nv.lib && path && strcmp(path, nv.opened) != 0 &&
        strcmp(path, nv.path) != 0) {
        char a[PATH_MAX], b[PATH_MAX];
        if (!realpath(path, a) || !realpath(nv.path, b) || strcmp(a, b) != 0)
            st = laden__fail(LADEN_E_STATE,
                             "laden_expand_set_nvrtc(%s): NVRTC is already "
                             "loaded from %s and stays",
                             path, nv.path);
    }
    if (!st) {
        snprintf(nvrtc_asked, sizeof nvrtc_asked, "%s", path ? path : "");
        for (int i = 0; i < MAX_DEVICES; i++)
            if (atomic_load_explicit(&exdevs[i].state, memory_order_relaxed) ==
                DEV_FAILED)
                atomic_store_explicit(&exdevs[i].state, DEV_UNTRIED,
                                      memory_order_relaxed);
    }
    pthread_mutex_unlock(&ex_mu);
    return st;
}

laden_status laden_expand_describe(int32_t device, char *out,
                                   uint64_t out_bytes)
{
    if (!out || out_bytes == 0)
        return laden__fail(LADEN_E_INVAL,
                           "laden_expand_describe: no room for the text");
    laden_status st = laden_expand_ready(device);
    if (st)
        snprintf(out, (size_t)out_bytes, "%s", laden_last_error());
    else if (device == LADEN_DEVICE_CPU)
        snprintf(out, (size_t)out_bytes,
                 "cpu: the kernels' C code, on the calling thread");
    else
        snprintf(out, (size_t)out_bytes, "%s", exdevs[device].desc);
    return st;
}

laden_status laden_expand(int32_t device, uintptr_t stream,
                          laden_dtype src_dtype, laden_devptr_t src,
                          uint64_t src_bytes, uint64_t n_elems, uint64_t cols,
                          laden_devptr_t scale, laden_scale_kind kind,
                          laden_dtype dst_dtype, laden_devptr_t dst)
{
    ex_params p;
    uint32_t vec = 0;
    laden_status st = prepare(src_dtype, src, src_bytes, n_elems, cols, scale,
                              kind, dst_dtype, dst, &p, &vec);
    if (st)
        return st;
    if (device == LADEN_DEVICE_CPU) {
        ex_loop(&p, 0, 1, p.fmt, vec);
        return LADEN_OK;
    }
    if ((st = laden_expand_ready(device)))
        return st;
    laden__cuda_scope sc;
    if ((st = laden__cuda_enter(device, &sc)))
        return st; /* the launch is in the device's context */
    struct ex_dev *d = &exdevs[device];
    uint64_t threads = p.units / EX_CUDA_BATCH + (p.units % EX_CUDA_BATCH != 0);
    uint64_t blocks = threads / THREADS + (threads % THREADS != 0);
    if (blocks > d->max_blocks[p.fmt][vec])
        blocks = d->max_blocks[p.fmt][vec];
    void *args[] = {&p};
    CUresult r = laden__cuk.cuLaunchKernel(d->fn[p.fmt][vec], (unsigned int)blocks, 1,
                                   1, THREADS, 1, 1, 0, (CUstream)stream, args,
                                   NULL);
    laden__cuda_leave(&sc);
    if (r != CUDA_SUCCESS)
        return laden__fail(LADEN_E_DEVICE,
                           "cuda:%d: cuLaunchKernel(laden_ex_%s_%c, %llu x "
                           "%u threads) failed: %s",
                           device, formats[p.fmt].name, vec ? 'v' : 'b',
                           (unsigned long long)blocks, THREADS, cu_name(r));
    return LADEN_OK;
}

/* ---- lossless (lossless.h; lossless.c checks the blob) ------------------ */

/* The CPU device's decode: sub-chunks [first, first + n), counting the
 * corrupt ones and the lowest of them. */
typedef struct ll_part {
    const ex_ll_params *p;
    const u16 *lut;
    u64 first, n, bad, lowest;
} ll_part;

static void *ll_part_run(void *arg)
{
    ll_part *w = arg;
    for (u64 i = w->first; i < w->first + w->n; i++)
        if (ex_ll_sub(w->p, w->lut, i) && !w->bad++)
            w->lowest = i;
    return NULL;
}

/* Large tensors are decoded by up to 8 threads, 64 sub-chunks (512 KiB
 * of values) or more each; a thread that cannot be had leaves its share
 * to this one. */
#define LL_THREADS 8u
#define LL_PER_THREAD 64u

static void ll_cpu(const ex_ll_params *p, const u16 *lut, uint64_t *bad,
                   uint64_t *first)
{
    u64 nsub = p->nsub, nt = nsub / LL_PER_THREAD;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    nt = nt > LL_THREADS ? LL_THREADS : nt;
    nt = cores > 0 && (u64)cores < nt ? (u64)cores : nt;
    nt = nt ? nt : 1;
    ll_part w[LL_THREADS];
    pthread_t th[LL_THREADS];
    bool run[LL_THREADS] = {false};
    for (u64 k = 0; k < nt; k++)
        w[k] = (ll_part){.p = p, .lut = lut, .first = nsub * k / nt,
                         .n = nsub * (k + 1) / nt - nsub * k / nt};
    for (u64 k = 1; k < nt; k++)
        run[k] = pthread_create(&th[k], NULL, ll_part_run, &w[k]) == 0;
    ll_part_run(&w[0]);
    for (u64 k = 1; k < nt; k++) {
        if (run[k])
            pthread_join(th[k], NULL);
        else
            ll_part_run(&w[k]);
    }
    *bad = *first = 0;
    for (u64 k = 0; k < nt; k++) { /* in order: the lowest comes first */
        if (w[k].bad && !*bad)
            *first = w[k].lowest;
        *bad += w[k].bad;
    }
}

/* The canonical codes of 256 code lengths, as the decoder builds them
 * (lossless.c's encoder and check use them too); 1 if the lengths are no
 * code. */
uint32_t laden__ll_codes(const uint8_t *lens, uint32_t *code);
uint32_t laden__ll_codes(const uint8_t *lens, uint32_t *code)
{
    ex_ll_params p;
    memset(&p, 0, sizeof p);
    p.lens = (u64)(uintptr_t)lens;
    return ex_ll_codes(&p, code);
}

/* The decoding table of 256 code lengths, built by entry as the decoders
 * build it (for tests: the same as one filled symbol by symbol from
 * laden__ll_codes' codes); 1 if the lengths are no code. */
uint32_t laden__ll_table(const uint8_t *lens, uint16_t *lut);
uint32_t laden__ll_table(const uint8_t *lens, uint16_t *lut)
{
    ex_ll_params p;
    ex_ll_canon c;
    memset(&p, 0, sizeof p);
    p.lens = (u64)(uintptr_t)lens;
    for (u32 s = 0; s < 256u; s++)
        ex_ll_canon_len(&p, &c, s);
    for (u32 l = 0; l <= (u32)EX_LL_BITS; l++)
        ex_ll_canon_count(&c, l);
    if (ex_ll_canon_start(&c))
        return 1u;
    for (u32 s = 0; s < 256u; s++)
        ex_ll_canon_place(&c, s);
    for (u32 i = 0; i < (u32)EX_LL_LUT; i++)
        lut[i] = (u16)ex_ll_entry(&c, i);
    return 0u;
}

laden_status laden__ll_decode(int32_t device, uintptr_t stream,
                              const laden_lossless_info *info,
                              laden_devptr_t blob, laden_devptr_t dst,
                              laden_devptr_t err, uint64_t *bad,
                              uint64_t *first);
laden_status laden__ll_decode(int32_t device, uintptr_t stream,
                              const laden_lossless_info *info,
                              laden_devptr_t blob, laden_devptr_t dst,
                              laden_devptr_t err, uint64_t *bad,
                              uint64_t *first)
{
    ex_ll_params p;
    memset(&p, 0, sizeof p);
    p.lens = blob + 32u;
    p.raw = blob + info->raw_off;
    p.offs = blob + info->offs_off;
    p.sums = blob + info->sums_off;
    p.lanes = blob + info->lanes_off;
    p.bits = blob + info->bits_off;
    p.dst = dst;
    p.err = err;
    p.n = info->n_elems;
    p.nbits = info->nbits;
    p.nsub = (u32)info->nsub;
    p.sub_log2 = info->sub_log2;
    p.kind = info->dtype == LADEN_DTYPE_BF16 ? EX_LL_BF16 : EX_LL_F16;
    p.vec = blob % 8u == 0;
    *bad = *first = 0;
    if (info->nsub > UINT32_MAX)
        return laden__fail(LADEN_E_INVAL,
                           "laden_lossless_decode: %llu sub-chunks; at most "
                           "2^32 - 1 in one call",
                           (unsigned long long)info->nsub);
    if (device == LADEN_DEVICE_CPU) {
        u16 *lut = calloc(EX_LL_LUT, sizeof *lut);
        if (!lut)
            return laden__fail(LADEN_E_NOMEM, "out of memory decoding");
        if (laden__ll_table((const uint8_t *)(uintptr_t)p.lens, lut))
            *bad = info->nsub; /* the table as the device builds it */
        else
            ll_cpu(&p, lut, bad, first);
        free(lut);
        if (*bad && err)
            ex_st32(err, 1u);
        return LADEN_OK;
    }
    laden_status st = laden_expand_ready(device);
    if (st)
        return st;
    laden__cuda_scope sc;
    if ((st = laden__cuda_enter(device, &sc)))
        return st;
    struct ex_dev *d = &exdevs[device];
    uint64_t warps = THREADS / 32u; /* a warp a sub-chunk */
    uint64_t blocks = info->nsub / warps + (info->nsub % warps != 0);
    if (blocks > d->ll_max_blocks)
        blocks = d->ll_max_blocks;
    void *args[] = {&p};
    CUresult r = laden__cuk.cuLaunchKernel(d->ll_fn, (unsigned int)blocks, 1,
                                           1, THREADS, 1, 1, 0,
                                           (CUstream)stream, args, NULL);
    laden__cuda_leave(&sc);
    if (r != CUDA_SUCCESS)
        return laden__fail(LADEN_E_DEVICE,
                           "cuda:%d: cuLaunchKernel(laden_ll_decode, %llu x "
                           "%u threads) failed: %s",
                           device, (unsigned long long)blocks, THREADS,
                           cu_name(r));
    return LADEN_OK;
}
