/* The few CUDA driver API types and constants laden uses, declared here so
 * that building needs no CUDA SDK.  Layouts follow the driver API's cuda.h
 * (CUDA 12/13); entry points are resolved at run time. */
#ifndef LADEN_CUDA_API_H
#define LADEN_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_READY 600

#define CU_STREAM_NON_BLOCKING 0x1
#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_EVENT_DEFAULT 0x0
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_MEMHOSTALLOC_PORTABLE 0x1
#define CU_MEMHOSTREGISTER_PORTABLE 0x1

#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102

#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define CU_MEM_HANDLE_TYPE_NONE 0x0
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0

typedef struct CUmemLocation_st {
    int type;
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

/* The driver entry points, one X per function: name, return, arguments. */
#define LADEN_CUDA_FUNCS(X)                                                   \
    X(cuInit, (unsigned int flags))                                           \
    X(cuDriverGetVersion, (int *version))                                     \
    X(cuDeviceGetCount, (int *count))                                         \
    X(cuDeviceGet, (CUdevice * dev, int ordinal))                             \
    X(cuDeviceGetName, (char *name, int len, CUdevice dev))                   \
    X(cuDeviceTotalMem, (size_t * bytes, CUdevice dev))                       \
    X(cuDeviceGetAttribute, (int *v, int attr, CUdevice dev))                 \
    X(cuDevicePrimaryCtxRetain, (CUcontext * ctx, CUdevice dev))              \
    X(cuCtxGetCurrent, (CUcontext * ctx))                                     \
    X(cuCtxSetCurrent, (CUcontext ctx))                                       \
    X(cuMemGetInfo, (size_t * fr, size_t *total))                             \
    X(cuStreamCreate, (CUstream * s, unsigned int flags))                     \
    X(cuStreamDestroy, (CUstream s))                                          \
    X(cuStreamSynchronize, (CUstream s))                                      \
    X(cuStreamWaitEvent, (CUstream s, CUevent e, unsigned int flags))         \
    X(cuStreamIsCapturing, (CUstream s, int *status))                         \
    X(cuStreamBeginCapture, (CUstream s, int mode))                           \
    X(cuStreamEndCapture, (CUstream s, CUgraph * g))                          \
    X(cuGraphInstantiateWithFlags,                                            \
      (CUgraphExec * e, CUgraph g, unsigned long long flags))                 \
    X(cuGraphLaunch, (CUgraphExec e, CUstream s))                             \
    X(cuGraphExecDestroy, (CUgraphExec e))                                    \
    X(cuGraphDestroy, (CUgraph g))                                            \
    X(cuEventCreate, (CUevent * e, unsigned int flags))                       \
    X(cuEventDestroy, (CUevent e))                                            \
    X(cuEventRecord, (CUevent e, CUstream s))                                 \
    X(cuEventSynchronize, (CUevent e))                                        \
    X(cuEventQuery, (CUevent e))                                              \
    X(cuEventElapsedTime, (float *ms, CUevent a, CUevent b))                  \
    X(cuMemcpyHtoDAsync,                                                      \
      (CUdeviceptr dst, const void *src, size_t n, CUstream s))               \
    X(cuMemcpyDtoHAsync,                                                      \
      (void *dst, CUdeviceptr src, size_t n, CUstream s))                     \
    X(cuMemcpyDtoDAsync,                                                      \
      (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s))               \
    X(cuMemAlloc, (CUdeviceptr * p, size_t n))                                \
    X(cuMemFree, (CUdeviceptr p))                                             \
    X(cuMemHostAlloc, (void **p, size_t n, unsigned int flags))               \
    X(cuMemFreeHost, (void *p))                                               \
    X(cuMemHostRegister, (void *p, size_t n, unsigned int flags))             \
    X(cuMemHostUnregister, (void *p))                                         \
    X(cuMemGetAllocationGranularity,                                          \
      (size_t * g, const CUmemAllocationProp *prop, int option))              \
    X(cuMemAddressReserve, (CUdeviceptr * p, size_t n, size_t align,          \
                            CUdeviceptr addr, unsigned long long flags))      \
    X(cuMemAddressFree, (CUdeviceptr p, size_t n))                            \
    X(cuMemCreate, (CUmemGenericAllocationHandle * h, size_t n,               \
                    const CUmemAllocationProp *prop, unsigned long long flags)) \
    X(cuMemRelease, (CUmemGenericAllocationHandle h))                         \
    X(cuMemMap, (CUdeviceptr p, size_t n, size_t off,                         \
                 CUmemGenericAllocationHandle h, unsigned long long flags))   \
    X(cuMemUnmap, (CUdeviceptr p, size_t n))                                  \
    X(cuMemSetAccess,                                                         \
      (CUdeviceptr p, size_t n, const CUmemAccessDesc *desc, size_t count))

/* Device expansion (src/dev/expand.c): kernels compiled by NVRTC, loaded
 * and launched.  Resolved by cuda.c with LADEN_CUDA_FUNCS but optional, so
 * that a driver (or tests/fake_cuda) without them runs everything else:
 * laden__cuk holds them once laden__cuda_kernel_error is "". */
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16

#define LADEN_CUDA_KERNEL_FUNCS(X)                                            \
    X(cuDeviceGet, (CUdevice * dev, int ordinal))                             \
    X(cuDeviceGetAttribute, (int *v, int attr, CUdevice dev))                 \
    X(cuGetErrorName, (CUresult r, const char **name))                        \
    X(cuModuleLoadData, (CUmodule * m, const void *image))                    \
    X(cuModuleGetFunction, (CUfunction * f, CUmodule m, const char *name))    \
    X(cuModuleUnload, (CUmodule m))                                           \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor,                            \
      (int *blocks, CUfunction f, int block_threads, size_t shared_bytes))    \
    X(cuLaunchKernel,                                                         \
      (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,       \
       unsigned int bx, unsigned int by, unsigned int bz,                     \
       unsigned int shared_bytes, CUstream s, void **params, void **extra))

typedef struct laden__cuda_kernel_fns {
#define LADEN__CUK_FIELD(name, args) CUresult (*name) args;
    LADEN_CUDA_KERNEL_FUNCS(LADEN__CUK_FIELD)
#undef LADEN__CUK_FIELD
} laden__cuda_kernel_fns;
extern laden__cuda_kernel_fns laden__cuk;
extern char laden__cuda_kernel_error[256];

#endif
