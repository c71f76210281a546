/* The tables behind laden/abi.h, built by the compiler from the headers.
 * Each struct's fields are listed once, below, and offsetof and sizeof fill
 * in the rest: a field missing from a list shows as a hole the C test finds
 * (tests/test_abi.c); one listed out of order, as offsets that go down.
 * Each constant is listed by name and its value is the header's.
 *
 * A unit above the layers, not in core: describing every layer means
 * including every layer's header. */
#include <stddef.h>
#include <string.h>

#include "../core/internal.h"
#include "laden/abi.h"
#include "laden/cache.h"
#include "laden/dev.h"
#include "laden/gguf.h"
#include "laden/grads.h"
#include "laden/host.h"
#include "laden/io.h"
#include "laden/plan.h"
#include "laden/shm.h"
#include "laden/st.h"
#include "laden/stream.h"
#include "laden/trace.h"
#include "laden/lossless.h"
#include "laden/vram.h"

/* The structs the Python binding mirrors, by C tag, in the order
 * laden_abi_struct_name gives them. */
#define ABI_STRUCTS(S)        \
    S(laden_st_tensor)        \
    S(laden_dev_info)         \
    S(laden_io_config)        \
    S(laden_io_ways)          \
    S(laden_sched_config)     \
    S(laden_sched_stats)      \
    S(laden_vram_info)        \
    S(laden_vbar_info)        \
    S(laden_elastic_stats)    \
    S(laden_cache_evict)      \
    S(laden_cache_host_evict) \
    S(laden_cache_info)       \
    S(laden_cache_stats)      \
    S(laden_cache_activation) \
    S(laden_plan_input)       \
    S(laden_plan_result)      \
    S(laden_plan_readings)    \
    S(laden_plan_load_options) \
    S(laden_host_stats)       \
    S(laden_pinned_pool_stats) \
    S(laden_gguf_tensor)      \
    S(laden_gguf_kv)          \
    S(laden_trace_result)     \
    S(laden_shm_entry)        \
    S(laden_lossless_info)    \
    S(laden_lossless_cache_stats) \
    S(laden_lossless_cache_entry)

/* Each struct's fields in declaration order: F(T, field). */
#define FIELDS_laden_lossless_info(F, T)                                   \
    F(T, dtype) F(T, sub_log2) F(T, n_elems) F(T, nbits) F(T, nsub)        \
    F(T, bytes) F(T, raw_off) F(T, offs_off) F(T, sums_off)               \
    F(T, lanes_off) F(T, bits_off)
#define FIELDS_laden_st_tensor(F, T)                                       \
    F(T, name) F(T, dtype) F(T, ndim) F(T, shape) F(T, file_index)         \
    F(T, offset_bytes) F(T, size_bytes)
#define FIELDS_laden_gguf_tensor(F, T)                                     \
    F(T, name) F(T, type) F(T, ndim) F(T, dims) F(T, offset_bytes)         \
    F(T, size_bytes)
#define FIELDS_laden_gguf_kv(F, T)                                         \
    F(T, key) F(T, type) F(T, elem_type) F(T, count) F(T, u) F(T, i)       \
    F(T, f) F(T, str)
#define FIELDS_laden_dev_info(F, T)                                        \
    F(T, device) F(T, kind) F(T, name) F(T, total_bytes) F(T, cc_major)    \
    F(T, cc_minor) F(T, vmm_supported) F(T, vmm_granularity_bytes)
#define FIELDS_laden_io_config(F, T) \
    F(T, threads) F(T, chunk_bytes) F(T, direct)
#define FIELDS_laden_pinned_pool_stats(F, T)                               \
    F(T, budget_bytes) F(T, held_bytes) F(T, reused_bytes) F(T, kept_bytes) \
    F(T, freed_bytes)
#define FIELDS_laden_io_ways(F, T) \
    F(T, chosen) F(T, samples) F(T, direct_bps) F(T, buffered_bps)
#define FIELDS_laden_sched_config(F, T)                                    \
    F(T, device) F(T, lookahead) F(T, ram_budget_bytes) F(T, io)           \
    F(T, flags)
#define FIELDS_laden_sched_stats(F, T)                                     \
    F(T, gpu_bytes) F(T, ram_bytes) F(T, disk_bytes) F(T, slot_bytes)      \
    F(T, nslots) F(T, device_bytes) F(T, pinned_bytes) F(T, enters)        \
    F(T, misses) F(T, h2d_bytes) F(T, read_bytes) F(T, load_read_bytes)    \
    F(T, resident_bytes) F(T, registered_bytes) F(T, upload_bytes)         \
    F(T, generation) F(T, offloaded_bytes) F(T, load_cached_bytes)        \
    F(T, reorders) F(T, expert_rows) F(T, expert_rows_moved)             \
    F(T, expert_rows_cached) F(T, expert_cache_bytes)                     \
    F(T, lossless_bytes) F(T, lossless_raw_bytes)                         \
    F(T, lossless_cache_bytes)
#define FIELDS_laden_lossless_cache_stats(F, T)                            \
    F(T, files) F(T, tensors) F(T, coded) F(T, raw_bytes)                  \
    F(T, coded_raw_bytes) F(T, coded_bytes) F(T, file_bytes)
#define FIELDS_laden_lossless_cache_entry(F, T)                            \
    F(T, src_offset) F(T, n_elems) F(T, dtype) F(T, kept_raw)              \
    F(T, blob_bytes)
#define FIELDS_laden_vram_info(F, T)                                       \
    F(T, device) F(T, page_bytes) F(T, budget_bytes) F(T, mapped_bytes)    \
    F(T, pinned_bytes) F(T, charged_bytes) F(T, vbars) F(T, faults)        \
    F(T, offloaded) F(T, fail_fast) F(T, maps) F(T, evictions)             \
    F(T, evicted_bytes) F(T, spare_bytes)
#define FIELDS_laden_vbar_info(F, T)                                       \
    F(T, base) F(T, size_bytes) F(T, used_bytes) F(T, mapped_bytes)        \
    F(T, pinned_bytes) F(T, watermark) F(T, floor) F(T, priority)
#define FIELDS_laden_elastic_stats(F, T)                                   \
    F(T, allocs) F(T, frees) F(T, reuses) F(T, failures)                   \
    F(T, in_use_bytes) F(T, cached_bytes) F(T, peak_bytes)                 \
    F(T, evicted_bytes)
#define FIELDS_laden_cache_evict(F, T) \
    F(T, model) F(T, drop_bytes) F(T, keep_bytes)
#define FIELDS_laden_cache_host_evict(F, T) \
    F(T, cache) F(T, model) F(T, drop_bytes)
#define FIELDS_laden_cache_info(F, T)                                      \
    F(T, size_bytes) F(T, vram_bytes) F(T, pinned_bytes) F(T, uses)        \
    F(T, last_use) F(T, in_use)
#define FIELDS_laden_cache_stats(F, T)                                     \
    F(T, vram_budget_bytes) F(T, pinned_budget_bytes) F(T, vram_bytes)     \
    F(T, pinned_bytes) F(T, models) F(T, in_use) F(T, acquires)            \
    F(T, evictions) F(T, evicted_bytes) F(T, hits) F(T, upload_bytes)      \
    F(T, pin_bytes) F(T, unpin_bytes)
#define FIELDS_laden_cache_activation(F, T)                                \
    F(T, mode) F(T, resident_blocks) F(T, streamed_blocks)                 \
    F(T, evicted_models) F(T, upload_bytes) F(T, kept_bytes)               \
    F(T, reused_bytes) F(T, slot_bytes) F(T, evicted_bytes)                \
    F(T, pinned_bytes) F(T, unpinned_bytes) F(T, pin_failed)               \
    F(T, offloaded_blocks)
#define FIELDS_laden_plan_input(F, T)                                      \
    F(T, nblocks) F(T, block_bytes) F(T, asked) F(T, block_flags)          \
    F(T, rest_bytes) F(T, vram_free_bytes) F(T, max_vram_bytes)            \
    F(T, reserve_bytes) F(T, ram_total_bytes) F(T, ram_free_bytes)         \
    F(T, ram_budget_bytes) F(T, min_free_ram_bytes) F(T, resident_blocks)  \
    F(T, lookahead) F(T, disk_staging) F(T, host_device)                   \
    F(T, h2d_bytes_per_s) F(T, disk_bytes_per_s) F(T, ram_block_bytes)    \
    F(T, slot_block_bytes)
#define FIELDS_laden_plan_result(F, T)                                     \
    F(T, vram_avail_bytes) F(T, ram_avail_bytes) F(T, min_free_ram_bytes)  \
    F(T, ram_limit_bytes) F(T, gpu_bytes) F(T, ram_bytes) F(T, disk_bytes) \
    F(T, slot_bytes) F(T, nslots) F(T, staging_bytes)                      \
    F(T, vram_used_bytes) F(T, ram_used_bytes) F(T, predicted_ms)          \
    F(T, warnings) F(T, reserve_bytes)
#define FIELDS_laden_plan_readings(F, T)                                   \
    F(T, vram_free_bytes) F(T, vram_total_bytes) F(T, ram_free_bytes)      \
    F(T, ram_free_exact_bytes) F(T, ram_total_bytes)
#define FIELDS_laden_plan_load_options(F, T)                               \
    F(T, device) F(T, lookahead) F(T, vram_budget_bytes)                   \
    F(T, ram_budget_bytes) F(T, shared_bytes) F(T, vram_context_budget)
#define FIELDS_laden_host_stats(F, T)                                      \
    F(T, budget_bytes) F(T, in_use_bytes) F(T, cached_bytes)               \
    F(T, peak_bytes) F(T, allocs) F(T, reuses) F(T, pins) F(T, unpins)

#define FIELDS_laden_trace_result(F, T)                                    \
    F(T, events) F(T, dropped) F(T, threads) F(T, streams)                 \
    F(T, unresolved) F(T, seconds)
#define FIELDS_laden_shm_entry(F, T)                                       \
    F(T, name) F(T, file_bytes) F(T, data_bytes) F(T, age_ms) F(T, kind)   \
    F(T, users) F(T, state) F(T, creator_pid) F(T, what) F(T, label)

typedef struct abi_field {
    const char *name;
    uint64_t offset_bytes, size_bytes;
} abi_field;

typedef struct abi_struct {
    const char *name;
    uint64_t size_bytes;
    const abi_field *fields;
    uint32_t nfields;
} abi_struct;

#define FIELD(T, f) \
    {#f, offsetof(struct T, f), sizeof(((struct T *)0)->f)},
#define FIELD_TABLE(T) static const abi_field T##_fields[] = {FIELDS_##T(FIELD, T)};
ABI_STRUCTS(FIELD_TABLE)
#undef FIELD_TABLE
#undef FIELD

#define STRUCT_ENTRY(T) \
    {#T, sizeof(struct T), T##_fields, (uint32_t)LADEN__ARRAY_LEN(T##_fields)},
static const abi_struct abi_structs[] = {ABI_STRUCTS(STRUCT_ENTRY)};
#undef STRUCT_ENTRY

static const abi_struct *find(const char *name)
{
    for (size_t i = 0; i < LADEN__ARRAY_LEN(abi_structs); i++)
        if (strcmp(abi_structs[i].name, name) == 0)
            return &abi_structs[i];
    return NULL;
}

const char *laden_abi_struct_name(uint32_t i)
{
    return i < LADEN__ARRAY_LEN(abi_structs) ? abi_structs[i].name : NULL;
}

laden_status laden_abi_struct(const char *name, uint64_t *size_bytes,
                              uint32_t *nfields)
{
    if (size_bytes)
        *size_bytes = 0;
    if (nfields)
        *nfields = 0;
    if (!name || !size_bytes || !nfields)
        return laden__fail(LADEN_E_INVAL, "laden_abi_struct: NULL argument");
    const abi_struct *s = find(name);
    if (!s)
        return laden__fail(LADEN_E_NOTFOUND,
                           "laden_abi_struct: no struct '%s' is described "
                           "(names are C tags, such as laden_plan_input)",
                           name);
    *size_bytes = s->size_bytes;
    *nfields = s->nfields;
    return LADEN_OK;
}

laden_status laden_abi_field(const char *struct_name, uint32_t i,
                             const char **field_name, uint64_t *offset_bytes,
                             uint64_t *size_bytes)
{
    if (field_name)
        *field_name = NULL;
    if (offset_bytes)
        *offset_bytes = 0;
    if (size_bytes)
        *size_bytes = 0;
    if (!struct_name || !field_name || !offset_bytes || !size_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_abi_field: NULL argument");
    const abi_struct *s = find(struct_name);
    if (!s)
        return laden__fail(LADEN_E_NOTFOUND,
                           "laden_abi_field: no struct '%s' is described",
                           struct_name);
    if (i >= s->nfields)
        return laden__fail(LADEN_E_INVAL,
                           "laden_abi_field: %s has %u fields, asked for "
                           "field %u",
                           s->name, s->nfields, i);
    *field_name = s->fields[i].name;
    *offset_bytes = s->fields[i].offset_bytes;
    *size_bytes = s->fields[i].size_bytes;
    return LADEN_OK;
}

uint32_t laden_abi_version(void)
{
    return LADEN_ABI_VERSION;
}

/* The constants the Python binding reads, by their C names.  Values come
 * from the headers' own macros and enums, so they cannot drift from them;
 * a constant the binding starts to use is added here (the Python tests
 * fail on a name the package uses that the table lacks). */
#define ABI_CONSTS(C)                                                      \
    C(LADEN_DEVICE_CPU)                                                    \
    C(LADEN_TIER_AUTO) C(LADEN_TIER_GPU) C(LADEN_TIER_RAM)                 \
    C(LADEN_TIER_DISK) C(LADEN_TIER_VRAM)                                  \
    C(LADEN_LOOKAHEAD_DEFAULT) C(LADEN_LOOKAHEAD_MAX)                      \
    C(LADEN_SCHED_CACHE) C(LADEN_CAPTURE_STANDALONE)                       \
    C(LADEN_SHARE_NONE) C(LADEN_SHARE_MADE) C(LADEN_SHARE_ATTACHED)        \
    C(LADEN_SHARE_FELL_BACK)                                               \
    C(LADEN_CACHE_AUTO) C(LADEN_CACHE_RESIDENT) C(LADEN_CACHE_STREAMING)   \
    C(LADEN_COPY_H2D_PINNED) C(LADEN_COPY_H2D_PAGEABLE)                    \
    C(LADEN_COPY_D2H_PINNED)                                               \
    C(LADEN_PLAN_AUTO) C(LADEN_PLAN_WARN_DISK)                             \
    C(LADEN_PLAN_WARN_NO_RESERVE) C(LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE)   \
    C(LADEN_GRADS_ADD) C(LADEN_GRADS_PINNED)                               \
    C(LADEN_PLAN_READING_STEP) C(LADEN_CACHE_IDLE_HOST_BYTES)              \
    C(LADEN_CACHE_RAM_UNLIMITED) C(LADEN_SCHED_BLOCK_OFFLOADED)            \
    C(LADEN_STORE_COMPACT) C(LADEN_STORE_EXPANDS_BLOCKS)                   \
    C(LADEN_STORE_IN_BLOCK) C(LADEN_STORE_PARAM) C(LADEN_STORE_SCALED)     \
    C(LADEN_STORE_ASK_FP8) C(LADEN_STORE_ASK_BF16)                        \
    C(LADEN_STORE_PLAIN) C(LADEN_STORE_CHECKPOINT_FP8) C(LADEN_STORE_BLOCKS) \
    C(LADEN_STORE_FP8) C(LADEN_STORE_BF16)                                 \
    C(LADEN_SCHED_NO_SCALE) C(LADEN_SCALE_NONE) C(LADEN_SCALE_TENSOR)      \
    C(LADEN_SCALE_ROW) C(LADEN_SCALE_TILE128) C(LADEN_ST_TEXT_JSON)       \
    C(LADEN_IO_DIRECT_AUTO) C(LADEN_IO_DIRECT_OFF) C(LADEN_IO_DIRECT_ON)   \
    C(LADEN_IO_WAY_UNKNOWN) C(LADEN_IO_WAY_DIRECT) C(LADEN_IO_WAY_BUFFERED) \
    C(LADEN_EXPERT_CACHE_AUTO) C(LADEN_LOSSLESS_HEADER_BYTES)              \
    C(LADEN_LOSSLESS_SUB_LOG2) C(LADEN_LOSSLESS_MAX_CODE)                 \
    C(LADEN_LOSSLESS_LANES)

typedef struct abi_const {
    const char *name;
    uint64_t bits; /* the value converted to uint64 (modulo 2^64) */
    int32_t is_unsigned;
} abi_const;

/* Whether x's type, after the usual promotions, is unsigned: enum
 * constants and negative macros are int, "1u" and UINT64_MAX are not. */
#define ABI_UNSIGNED(x)                                                    \
    _Generic((x) + 0, unsigned int: 1, unsigned long: 1,                   \
             unsigned long long: 1, default: 0)
#define CONST_ENTRY(X) {#X, (uint64_t)(X), ABI_UNSIGNED(X)},
static const abi_const abi_consts[] = {ABI_CONSTS(CONST_ENTRY)};
#undef CONST_ENTRY

/* int64 is two's complement, so the bits say the value of a signed
 * constant exactly, and those of an unsigned one above INT64_MAX. */
static int64_t const_value(const abi_const *c)
{
    int64_t v;
    memcpy(&v, &c->bits, sizeof v);
    return v;
}

uint32_t laden_abi_const_count(void)
{
    return (uint32_t)LADEN__ARRAY_LEN(abi_consts);
}

laden_status laden_abi_const_at(uint32_t i, const char **name,
                                int64_t *value, int32_t *is_unsigned)
{
    if (name)
        *name = NULL;
    if (value)
        *value = 0;
    if (is_unsigned)
        *is_unsigned = 0;
    if (!name)
        return laden__fail(LADEN_E_INVAL, "laden_abi_const_at: NULL name");
    if (i >= LADEN__ARRAY_LEN(abi_consts))
        return laden__fail(LADEN_E_INVAL,
                           "laden_abi_const_at: %u constants are listed, "
                           "asked for constant %u",
                           laden_abi_const_count(), i);
    *name = abi_consts[i].name;
    if (value)
        *value = const_value(&abi_consts[i]);
    if (is_unsigned)
        *is_unsigned = abi_consts[i].is_unsigned;
    return LADEN_OK;
}

laden_status laden_abi_const(const char *name, int64_t *value,
                             int32_t *is_unsigned)
{
    if (value)
        *value = 0;
    if (is_unsigned)
        *is_unsigned = 0;
    if (!name || !value)
        return laden__fail(LADEN_E_INVAL, "laden_abi_const: NULL argument");
    for (size_t i = 0; i < LADEN__ARRAY_LEN(abi_consts); i++) {
        if (strcmp(abi_consts[i].name, name) == 0) {
            *value = const_value(&abi_consts[i]);
            if (is_unsigned)
                *is_unsigned = abi_consts[i].is_unsigned;
            return LADEN_OK;
        }
    }
    return laden__fail(LADEN_E_NOTFOUND,
                       "laden_abi_const: no constant '%s' is listed (names "
                       "are C names, such as LADEN_TIER_GPU)",
                       name);
}
