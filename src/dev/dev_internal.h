/* The device table: what each implementation provides. */
#ifndef LADEN_DEV_INTERNAL_H
#define LADEN_DEV_INTERNAL_H

#include "laden/dev.h"

#include "../core/internal.h"

typedef struct laden__dev_ops {
    laden_status (*info)(int32_t dev, laden_dev_info_t *out);
    laden_status (*mem_info)(int32_t dev, uint64_t *free, uint64_t *total);
    laden_status (*stream_create)(int32_t dev, void **out);
    laden_status (*stream_wrap)(int32_t dev, uintptr_t handle, void **out);
    void (*stream_destroy)(int32_t dev, void *s, bool owned);
    laden_status (*stream_sync)(int32_t dev, void *s);
    laden_status (*stream_wait_event)(int32_t dev, void *s, void *e);
    /* CUDA graphs (NULL on the CPU device). */
    laden_status (*stream_capturing)(int32_t dev, void *s, int *out);
    laden_status (*capture_begin)(int32_t dev, void *s);
    laden_status (*capture_end)(int32_t dev, void *s, void **out);
    laden_status (*graph_launch)(int32_t dev, void *g, void *s);
    void (*graph_destroy)(int32_t dev, void *g);
    laden_status (*event_create)(int32_t dev, int timing, void **out);
    void (*event_destroy)(int32_t dev, void *e);
    laden_status (*event_record)(int32_t dev, void *e, void *s);
    laden_status (*event_sync)(int32_t dev, void *e);
    laden_status (*event_query)(int32_t dev, void *e, int *done);
    laden_status (*event_elapsed)(int32_t dev, void *a, void *b, float *ms);
    laden_status (*copy_h2d)(int32_t dev, void *s, laden_devptr_t dst,
                             const void *src, uint64_t n);
    laden_status (*copy_d2h)(int32_t dev, void *s, void *dst,
                             laden_devptr_t src, uint64_t n);
    laden_status (*copy_d2d)(int32_t dev, void *s, laden_devptr_t dst,
                             laden_devptr_t src, uint64_t n);
    laden_status (*mem_alloc)(int32_t dev, uint64_t n, laden_devptr_t *out);
    laden_status (*mem_free)(int32_t dev, laden_devptr_t p);
    laden_status (*host_alloc)(int32_t dev, uint64_t n, void **out);
    laden_status (*host_free)(int32_t dev, void *p);
    laden_status (*host_register)(int32_t dev, void *p, uint64_t n);
    laden_status (*host_unregister)(int32_t dev, void *p);
    laden_status (*va_reserve)(int32_t dev, uint64_t n, laden_devptr_t *out);
    laden_status (*va_release)(int32_t dev, laden_devptr_t va, uint64_t n);
    laden_status (*phys_create)(int32_t dev, uint64_t n, laden_phys_t *out);
    laden_status (*phys_release)(int32_t dev, laden_phys_t p);
    laden_status (*map)(int32_t dev, laden_devptr_t va, uint64_t n,
                        laden_phys_t p);
    laden_status (*unmap)(int32_t dev, laden_devptr_t va, uint64_t n);
} laden__dev_ops;

extern const laden__dev_ops laden__dev_cpu_ops;
/* When a completed CPU-device event completed (host monotonic ns). */
uint64_t laden__dev_cpu_event_ns(void *impl);
extern const laden__dev_ops laden__dev_cuda_ops;

/* The implementation of device `dev`, or LADEN_E_NODEVICE saying why
 * there is none (CUDA unavailable, or no such device). */
laden_status laden__dev_resolve(int32_t dev, const laden__dev_ops **ops);

/* Loads the CUDA driver once; returns the device count (0 if unusable) and
 * leaves the reason in laden__cuda_error. */
int32_t laden__cuda_load(void);
extern char laden__cuda_error[512];

/* Device `dev`'s primary context made current on this thread, and the
 * caller's put back after: every CUDA call of laden's runs between the
 * two, so that laden never changes the context (and with it PyTorch's
 * current device) of a thread that calls it.  enter fails, leaving
 * nothing to put back, when the device cannot be used. */
typedef struct laden__cuda_scope {
    void *prev;
    int switched;
} laden__cuda_scope;
laden_status laden__cuda_enter(int32_t dev, laden__cuda_scope *sc);
void laden__cuda_leave(laden__cuda_scope *sc);

#endif
