/* A tensor's value as its model computes with it, into the caller's host
 * memory (laden_sched_tensor_value): for a state_dict entry whose module
 * holds nothing (a disk-tier tensor, a compact one that exists expanded
 * only inside its block).  Read from where laden keeps the tensor, then
 * expanded on the calling thread by the code the CPU device runs
 * (laden_expand), so the value is the one a block computes with.  Calls
 * parts.c and convert.c, and the dev and io layers. */
#include <stdlib.h>
#include <string.h>

#include "stream_run.h"
#include "stream_layout.h"
#include "stream_load.h"
#include "stream_convert.h"

#include "laden/expand.h"

/* Tensor r of block b as laid out (r->dst_bytes) into out: its host copy,
 * else its own device copy (copied back), else the checkpoint, where a
 * disk-tier tensor is kept as stored. */
static laden_status laid_out(laden_sched_t *sc, uint32_t block,
                             const tref *r, void *out)
{
    blk *b = &sc->layout.b[block];
    if (b->ram) {
        memcpy(out, (const char *)b->ram + r->dst_off, r->dst_bytes);
        return LADEN_OK;
    }
    if (b->region && !laden__sched_streamed(sc, b)) {
        laden_devptr_t at = b->region + r->dst_off;
        if (sc->cfg.device == LADEN_DEVICE_CPU) {
            memcpy(out, (const void *)(uintptr_t)at, r->dst_bytes);
            return LADEN_OK;
        }
        laden_dev_stream_t *st;
        laden_status s = laden_dev_stream_create(sc->cfg.device, &st);
        if (!s && !(s = laden_dev_copy_d2h(st, out, at, r->dst_bytes)))
            s = laden_dev_stream_synchronize(st);
        laden_dev_stream_destroy(st);
        return s;
    }
    if (!laden__sched_as_stored(r) || r->file >= sc->layout.nfiles)
        return laden__fail(LADEN_E_STATE,
                           "tensor '%.200s' has no copy in memory and is not "
                           "kept as the checkpoint stores it",
                           r->name ? r->name : "?");
    return laden_io_read(sc->layout.io, laden__sched_file(sc, r), r->off,
                         r->src_bytes, out);
}

/* Decodes r's laid-out bytes `raw` into dst as dtype (scale: its scale's
 * values as float32, or NULL): a compact tensor as laden_sched_enter
 * expands it, a plain one copied or converted. */
static laden_status decode(const tref *r, const void *raw, const float *scale,
                           laden_dtype dtype, void *dst)
{
    uintptr_t src = (uintptr_t)raw;
    bool codes = laden__fp8(r->dst) || r->rows;
    if (r->ll) { /* lossless: decoded here, then in the dtype asked */
        void *v = dtype == r->dst ? dst : malloc(2 * r->nelem);
        if (!v)
            return laden__fail(LADEN_E_NOMEM, "out of memory decoding");
        laden_status s = laden_lossless_decode(LADEN_DEVICE_CPU, 0, r->ll,
                                               src, (uintptr_t)v,
                                               2 * r->nelem, 0);
        if (!s && v != dst)
            s = laden_sched_convert(r->dst, v, dtype, dst, r->nelem);
        if (v != dst)
            free(v);
        return s;
    }
    if (r->dst == dtype && !r->rows && !(r->expands && r->scale !=
                                         LADEN_SCHED_NO_SCALE)) {
        memcpy(dst, raw, r->dst_bytes); /* a dtype to itself */
        return LADEN_OK;
    }
    if (!codes && !r->expands && laden_dtype_bits(r->dst))
        return laden_sched_convert(r->dst, raw, dtype, dst, r->nelem);
    laden_scale_kind kind = scale ? r->scale_kind : LADEN_SCALE_NONE;
    uintptr_t at = (uintptr_t)scale;
    if (r->rows) { /* quantized on load: the row scales after the codes */
        kind = LADEN_SCALE_ROW;
        at = src + laden__sched_scale_offset(r->nelem);
    }
    return laden_expand(LADEN_DEVICE_CPU, 0, r->dst, src,
                        laden__sched_code_bytes(r), r->nelem,
                        r->rows ? r->nelem / r->rows : r->cols, at, kind,
                        dtype, (uintptr_t)dst);
}

/* Tensor r of block `block` decoded as dtype into dst (r->nelem
 * elements). */
static laden_status piece_value(laden_sched_t *sc, uint32_t block,
                                tref *r, laden_dtype dtype, void *dst)
{
    blk *b = &sc->layout.b[block];
    const char *name = r->name ? r->name : "?";
    bool scaled = laden__fp8(r->dst) && !r->rows && r->expands &&
                  r->scale != LADEN_SCHED_NO_SCALE;
    const tref *sr = scaled ? &b->t[r->scale] : NULL;
    void *raw = malloc(r->dst_bytes ? r->dst_bytes : 1);
    void *sraw = sr ? malloc(sr->dst_bytes) : NULL;
    float *scale = sr ? malloc(sr->nelem * sizeof *scale) : NULL;
    laden_status s = LADEN_OK;
    if (!raw || (sr && (!sraw || !scale)))
        s = laden__fail(LADEN_E_NOMEM, "tensor '%.200s': out of memory for "
                        "its value", name);
    if (!s && sr && !(s = laid_out(sc, block, sr, sraw)))
        s = laden_sched_convert(sr->dst, sraw, LADEN_DTYPE_F32, scale,
                                sr->nelem);
    if (!s && !(s = laid_out(sc, block, r, raw)) && r->nelem &&
        !(s = r->ll && r->cfile ? laden__sched_check_blob(r, raw)
                                : LADEN_OK))
        s = decode(r, raw, scale, dtype, dst);
    free(scale);
    free(sraw);
    free(raw);
    return s;
}

laden_status laden__sched_tensor_value(laden_sched_t *sc, uint32_t block,
                                       uint32_t i, laden_dtype dtype,
                                       void *dst, uint64_t dst_bytes)
{
    if (block >= sc->layout.nb || i >= sc->layout.b[block].nt || !dst)
        return laden__fail(LADEN_E_INVAL, "laden_sched_tensor_value: bad "
                                          "block, tensor or destination");
    blk *b = &sc->layout.b[block];
    const tref *r = &b->t[i];
    const char *name = r->name ? r->name : "?";
    /* A joined run (laden_sched_join_tensor) is one tensor: its pieces'
     * values end to end.  Its pieces are plain (never scaled). */
    uint32_t run = laden__sched_run_of(b, i, NULL);
    uint64_t nelem = 0, want = 0, bits = laden_dtype_bits(dtype);
    for (uint32_t k = 0; k < run; k++)
        nelem += b->t[i + k].nelem; /* each fits memory: no overflow */
    if (!bits || bits % 8 || !laden__mul_u64(nelem, bits / 8, &want) ||
        want != dst_bytes)
        return laden__fail(LADEN_E_INVAL,
                           "tensor '%.200s': %llu elements as dtype %d are "
                           "not %llu bytes",
                           name, (unsigned long long)nelem, (int)dtype,
                           (unsigned long long)dst_bytes);
    bool usable = laden__sched_usable(sc) || (sc->cache.on && b->filled);
    if (!usable || !(b->ready || sc->loaded || (sc->cache.on && b->filled)))
        return laden__fail(LADEN_E_STATE, "tensor '%.200s': %s", name,
                           usable ? "its block is still loading"
                                  : "the schedule is not loaded");
    laden_status s = LADEN_OK;
    for (uint32_t k = 0; k < run && !s; k++) {
        s = piece_value(sc, block, &b->t[i + k], dtype, dst);
        dst = (char *)dst + b->t[i + k].nelem * (bits / 8);
    }
    if (s && s != LADEN_E_NOMEM)
        laden__error_prefix("the value of tensor '%.200s'", name);
    return s;
}
