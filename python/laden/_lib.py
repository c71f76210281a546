"""The binding to libladen, declared in one place.

Every C function the package calls is listed in ``_SIGNATURES`` with its
argument and return types; nothing else in the package touches ctypes
declarations.  ctypes releases the GIL during each call, so reads and copies
run while other Python threads work."""

from __future__ import annotations

import ctypes
import os
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_float,
                    c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64,
                    c_void_p)

from .errors import BY_STATUS, LadenError

status_t = c_int
p = c_void_p  # opaque handles


class StTensor(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("dtype", c_int),
        ("ndim", c_uint32),
        ("shape", POINTER(c_uint64)),
        ("file_index", c_uint32),
        ("offset_bytes", c_uint64),
        ("size_bytes", c_uint64),
    ]


class GgufTensor(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("type", c_uint32),
        ("ndim", c_uint32),
        ("dims", c_uint64 * 4),
        ("offset_bytes", c_uint64),
        ("size_bytes", c_uint64),
    ]


class GgufKv(Structure):
    _fields_ = [
        ("key", c_char_p),
        ("type", c_int),
        ("elem_type", c_int),
        ("count", c_uint64),
        ("u", c_uint64),
        ("i", ctypes.c_int64),
        ("f", ctypes.c_double),
        ("str", c_char_p),
    ]


class DevInfo(Structure):
    _fields_ = [
        ("device", c_int32),
        ("kind", c_int),
        ("name", c_char * 128),
        ("total_bytes", c_uint64),
        ("cc_major", c_int32),
        ("cc_minor", c_int32),
        ("vmm_supported", c_int32),
        ("vmm_granularity_bytes", c_uint64),
    ]


class IoConfig(Structure):
    _fields_ = [
        ("threads", c_uint32),
        ("chunk_bytes", c_uint64),
        ("direct", c_int),
    ]


class PinnedPoolStats(Structure):
    _fields_ = [
        ("budget_bytes", c_uint64), ("held_bytes", c_uint64),
        ("reused_bytes", c_uint64), ("kept_bytes", c_uint64),
        ("freed_bytes", c_uint64),
    ]


class IoWays(Structure):
    _fields_ = [
        ("chosen", c_int32),
        ("samples", c_uint32),
        ("direct_bps", c_double),
        ("buffered_bps", c_double),
    ]


class SchedConfig(Structure):
    _fields_ = [
        ("device", c_int32),
        ("lookahead", c_uint32),
        ("ram_budget_bytes", c_uint64),
        ("io", c_void_p),
        ("flags", c_uint32),
    ]


class ShmEntry(Structure):
    """laden_shm_entry: a file at a laden name in LADEN_SHM_DIR."""
    _fields_ = [
        ("name", c_char * 256), ("file_bytes", c_uint64),
        ("data_bytes", c_uint64), ("age_ms", c_int64), ("kind", c_int32),
        ("users", c_int32), ("state", c_int32), ("creator_pid", c_int32),
        ("what", c_char * 256), ("label", c_char * 1024),
    ]


class LosslessInfo(Structure):
    """laden_lossless_info: what a lossless blob holds."""
    _fields_ = [
        ("dtype", c_int32), ("sub_log2", c_uint32), ("n_elems", c_uint64),
        ("nbits", c_uint64), ("nsub", c_uint64), ("bytes", c_uint64),
        ("raw_off", c_uint64), ("offs_off", c_uint64),
        ("sums_off", c_uint64), ("lanes_off", c_uint64),
        ("bits_off", c_uint64),
    ]


class LosslessCacheStats(Structure):
    """laden_lossless_cache_stats: what laden_lossless_cache_write wrote."""
    _fields_ = [
        ("files", c_uint32), ("tensors", c_uint32), ("coded", c_uint32),
        ("raw_bytes", c_uint64), ("coded_raw_bytes", c_uint64),
        ("coded_bytes", c_uint64), ("file_bytes", c_uint64),
    ]


class LosslessCacheEntry(Structure):
    """laden_lossless_cache_entry: one tensor of a lossless cache file."""
    _fields_ = [
        ("src_offset", c_uint64), ("n_elems", c_uint64), ("dtype", c_int32),
        ("kept_raw", c_uint32), ("blob_bytes", c_uint64),
    ]


class SchedStats(Structure):
    _fields_ = [
        ("gpu_bytes", c_uint64), ("ram_bytes", c_uint64),
        ("disk_bytes", c_uint64), ("slot_bytes", c_uint64),
        ("nslots", c_uint32), ("device_bytes", c_uint64),
        ("pinned_bytes", c_uint64), ("enters", c_uint64),
        ("misses", c_uint64), ("h2d_bytes", c_uint64),
        ("read_bytes", c_uint64), ("load_read_bytes", c_uint64),
        ("resident_bytes", c_uint64), ("registered_bytes", c_uint64),
        ("upload_bytes", c_uint64), ("generation", c_uint64),
        ("offloaded_bytes", c_uint64), ("load_cached_bytes", c_uint64),
        ("reorders", c_uint64), ("expert_rows", c_uint64),
        ("expert_rows_moved", c_uint64), ("expert_rows_cached", c_uint64),
        ("expert_cache_bytes", c_uint64), ("lossless_bytes", c_uint64),
        ("lossless_raw_bytes", c_uint64), ("lossless_cache_bytes", c_uint64),
    ]


class VramInfo(Structure):
    _fields_ = [
        ("device", c_int32), ("page_bytes", c_uint64),
        ("budget_bytes", c_uint64), ("mapped_bytes", c_uint64),
        ("pinned_bytes", c_uint64), ("charged_bytes", c_uint64),
        ("vbars", c_uint32), ("faults", c_uint64), ("offloaded", c_uint64),
        ("fail_fast", c_uint64), ("maps", c_uint64), ("evictions", c_uint64),
        ("evicted_bytes", c_uint64), ("spare_bytes", c_uint64),
    ]


class VbarInfo(Structure):
    _fields_ = [
        ("base", c_uint64), ("size_bytes", c_uint64), ("used_bytes", c_uint64),
        ("mapped_bytes", c_uint64), ("pinned_bytes", c_uint64),
        ("watermark", c_uint64), ("floor", c_uint64), ("priority", c_uint64),
    ]


class ElasticStats(Structure):
    _fields_ = [
        ("allocs", c_uint64), ("frees", c_uint64), ("reuses", c_uint64),
        ("failures", c_uint64), ("in_use_bytes", c_uint64),
        ("cached_bytes", c_uint64), ("peak_bytes", c_uint64),
        ("evicted_bytes", c_uint64),
    ]


class CacheEvict(Structure):
    _fields_ = [("model", c_uint32), ("drop_bytes", c_uint64),
                ("keep_bytes", c_uint64)]


class CacheHostEvict(Structure):
    _fields_ = [("cache", ctypes.c_void_p), ("model", c_uint32),
                ("drop_bytes", c_uint64)]


class CacheInfo(Structure):
    _fields_ = [("size_bytes", c_uint64), ("vram_bytes", c_uint64),
                ("pinned_bytes", c_uint64), ("uses", c_uint64),
                ("last_use", c_uint64), ("in_use", c_int32)]


class CacheStats(Structure):
    _fields_ = [
        ("vram_budget_bytes", c_uint64), ("pinned_budget_bytes", c_uint64),
        ("vram_bytes", c_uint64), ("pinned_bytes", c_uint64),
        ("models", c_uint32), ("in_use", c_uint32),
        ("acquires", c_uint64), ("evictions", c_uint64),
        ("evicted_bytes", c_uint64), ("hits", c_uint64),
        ("upload_bytes", c_uint64), ("pin_bytes", c_uint64),
        ("unpin_bytes", c_uint64),
    ]


class CacheActivation(Structure):
    _fields_ = [
        ("mode", c_int32), ("resident_blocks", c_uint32),
        ("streamed_blocks", c_uint32), ("evicted_models", c_uint32),
        ("upload_bytes", c_uint64), ("kept_bytes", c_uint64),
        ("reused_bytes", c_uint64), ("slot_bytes", c_uint64), ("evicted_bytes", c_uint64),
        ("pinned_bytes", c_uint64), ("unpinned_bytes", c_uint64),
        ("pin_failed", c_int32), ("offloaded_blocks", c_uint32),
    ]


class PlanInput(Structure):
    _fields_ = [
        ("nblocks", c_uint32),
        ("block_bytes", POINTER(c_uint64)),
        ("asked", POINTER(c_int32)),
        ("block_flags", POINTER(ctypes.c_uint8)),
        ("rest_bytes", c_uint64),
        ("vram_free_bytes", c_uint64),
        ("max_vram_bytes", c_uint64),
        ("reserve_bytes", c_uint64),
        ("ram_total_bytes", c_uint64),
        ("ram_free_bytes", c_uint64),
        ("ram_budget_bytes", c_uint64),
        ("min_free_ram_bytes", c_uint64),
        ("resident_blocks", c_int32),
        ("lookahead", c_uint32),
        ("disk_staging", c_uint32),
        ("host_device", c_uint32),
        ("h2d_bytes_per_s", c_double),
        ("disk_bytes_per_s", c_double),
        ("ram_block_bytes", POINTER(c_uint64)),
        ("slot_block_bytes", POINTER(c_uint64)),
    ]


class PlanResult(Structure):
    _fields_ = [
        ("vram_avail_bytes", c_uint64), ("ram_avail_bytes", c_uint64),
        ("min_free_ram_bytes", c_uint64), ("ram_limit_bytes", c_uint64),
        ("gpu_bytes", c_uint64),
        ("ram_bytes", c_uint64), ("disk_bytes", c_uint64),
        ("slot_bytes", c_uint64), ("nslots", c_uint32),
        ("staging_bytes", c_uint64), ("vram_used_bytes", c_uint64),
        ("ram_used_bytes", c_uint64), ("predicted_ms", c_double),
        ("warnings", c_uint32), ("reserve_bytes", c_uint64),
    ]


class PlanReadings(Structure):
    _fields_ = [(n, c_uint64) for n in (
        "vram_free_bytes", "vram_total_bytes", "ram_free_bytes",
        "ram_free_exact_bytes", "ram_total_bytes")]


class PlanLoadOptions(Structure):
    _fields_ = [
        ("device", c_int32), ("lookahead", c_uint32),
        ("vram_budget_bytes", c_uint64), ("ram_budget_bytes", c_uint64),
        ("shared_bytes", c_uint64), ("vram_context_budget", c_uint32),
    ]


class HostStats(Structure):
    _fields_ = [(n, c_uint64) for n in (
        "budget_bytes", "in_use_bytes", "cached_bytes", "peak_bytes",
        "allocs", "reuses", "pins", "unpins")]


class TraceResult(Structure):
    _fields_ = [("events", c_uint64), ("dropped", c_uint64),
                ("threads", c_uint64), ("streams", c_uint64),
                ("unresolved", c_uint64), ("seconds", c_double)]


P = POINTER
# laden_sched_progress_fn: (arg, done_bytes, total_bytes) -> 0 to go on
PROGRESS_FN = ctypes.CFUNCTYPE(ctypes.c_int, c_void_p, c_uint64, c_uint64)
_SIGNATURES = {
    # core
    "laden_version": (c_char_p, []),
    "laden_status_name": (c_char_p, [c_int]),
    "laden_status_message": (c_char_p, [c_int]),
    "laden_last_error": (c_char_p, []),
    # abi
    "laden_abi_version": (c_uint32, []),
    "laden_abi_const_count": (c_uint32, []),
    "laden_abi_const_at": (status_t, [c_uint32, P(c_char_p), P(c_int64),
                                      P(c_int32)]),
    "laden_abi_const": (status_t, [c_char_p, P(c_int64), P(c_int32)]),
    "laden_abi_struct_name": (c_char_p, [c_uint32]),
    "laden_abi_struct": (status_t, [c_char_p, P(c_uint64), P(c_uint32)]),
    "laden_abi_field": (status_t, [c_char_p, c_uint32, P(c_char_p),
                                   P(c_uint64), P(c_uint64)]),
    # trace
    "laden_trace_start": (status_t, [c_uint64]),
    "laden_trace_stop": (status_t, [c_char_p, P(TraceResult)]),
    "laden_trace_active": (c_int, []),
    "laden_trace_counter": (None, [c_char_p, c_int32, c_uint64]),
    "laden_trace_range": (None, [c_char_p, c_int]),
    "laden_sched_set_name": (status_t, [c_void_p, c_char_p]),
    "laden_sched_set_block_name": (status_t, [c_void_p, c_uint32, c_char_p]),
    # st
    "laden_dtype_name": (c_char_p, [c_int]),
    "laden_dtype_bits": (c_uint32, [c_int]),
    "laden_dtype_block": (status_t, [c_int, P(c_uint32), P(c_uint32)]),
    "laden_dtype_of_ggml": (status_t, [c_uint32, P(c_int)]),
    "laden_ggml_of_dtype": (c_uint32, [c_int]),
    "laden_sched_set_rope_rows": (status_t, [p, c_uint32, c_uint32, c_uint64]),
    "laden_sched_join_tensor": (status_t, [p, c_uint32, c_uint32]),
    "laden_sched_set_experts": (status_t, [p, c_uint32, c_uint32]),
    "laden_sched_set_expert_cache": (status_t, [p, c_uint64]),
    "laden_sched_set_lossless": (status_t, [p, c_uint32, c_uint32]),
    "laden_sched_tensor_lossless": (c_int, [p, c_uint32, c_uint32]),
    "laden_sched_mark_lossless": (status_t, [p, P(c_uint32)]),
    "laden_sched_enter_experts": (status_t, [p, c_uint32,
                                             POINTER(c_uint32), c_uint32,
                                             ctypes.c_size_t]),
    # expand (device expansion of compact weights): entries below
    "laden_expand": (status_t, [c_int32, ctypes.c_size_t, c_int, c_uint64,
                                c_uint64, c_uint64, c_uint64, c_uint64, c_int,
                                c_int, c_uint64]),
    "laden_expand_ready": (status_t, [c_int32]),
    "laden_expand_set_nvrtc": (status_t, [c_char_p]),
    "laden_expand_describe": (status_t, [c_int32, c_char_p, c_uint64]),
    "laden_st_open": (status_t, [c_char_p, P(p)]),
    "laden_st_format": (c_char_p, [p]),
    "laden_st_read_text": (status_t, [c_char_p, c_uint64, c_uint32,
                                       P(c_void_p), P(c_uint64)]),
    "laden_st_text_free": (None, [c_void_p]),
    # gguf
    "laden_gguf_check_model": (status_t, [p, c_char_p]),
    "laden_gguf_open": (status_t, [c_char_p, P(p)]),
    "laden_gguf_close": (None, [p]),
    "laden_gguf_version": (c_uint32, [p]),
    "laden_gguf_alignment": (c_uint32, [p]),
    "laden_gguf_data_offset": (c_uint64, [p]),
    "laden_gguf_count": (c_size_t, [p]),
    "laden_gguf_tensor_at": (status_t, [p, c_size_t, P(GgufTensor)]),
    "laden_gguf_metadata_count": (c_size_t, [p]),
    "laden_gguf_metadata_at": (status_t, [p, c_size_t, P(GgufKv)]),
    "laden_gguf_type_name": (c_char_p, [c_uint32]),
    "laden_gguf_dequantize": (status_t, [c_uint32, c_void_p, c_uint64,
                                         c_void_p, c_uint64]),
    "laden_st_close": (None, [p]),
    "laden_st_count": (c_size_t, [p]),
    "laden_st_tensor_at": (status_t, [p, c_size_t, P(StTensor)]),
    "laden_st_find": (status_t, [p, c_char_p, P(c_size_t)]),
    "laden_st_file_count": (c_size_t, [p]),
    "laden_st_file_path": (c_char_p, [p, c_size_t]),
    "laden_st_file_size": (c_uint64, [p, c_size_t]),
    "laden_st_file_open": (status_t, [p, c_size_t, P(p)]),
    "laden_st_metadata_count": (c_size_t, [p]),
    "laden_st_metadata_at": (status_t, [p, c_size_t, P(c_char_p),
                                        P(c_char_p)]),
    "laden_st_total_bytes": (c_uint64, [p]),
    # io
    "laden_io_create": (status_t, [P(IoConfig), P(p)]),
    "laden_io_destroy": (None, [p]),
    "laden_io_file_open": (status_t, [c_char_p, P(p)]),
    "laden_io_file_close": (None, [p]),
    "laden_io_file_size": (c_uint64, [p]),
    "laden_io_file_direct": (c_int, [p]),
    "laden_io_read": (status_t, [p, p, c_uint64, c_uint64, c_void_p]),
    "laden_io_submit": (status_t, [p, p, c_uint64, c_uint64, c_void_p,
                                   P(p)]),
    "laden_io_wait": (status_t, [p, p]),
    "laden_io_drop_cache": (status_t, [p]),
    "laden_io_measure_read": (status_t, [c_char_p, c_uint64, P(c_double)]),
    "laden_io_measure_file": (status_t, [c_char_p, c_uint64, P(c_double)]),
    "laden_io_measure_ways": (status_t, [c_char_p, c_uint64, P(IoWays)]),
    "laden_io_file_ways": (status_t, [p, P(IoWays)]),
    "laden_io_forget_ways": (status_t, [p]),
    # grads
    "laden_grads_create": (status_t, [c_int32, c_uint64, P(p)]),
    "laden_grads_staging_bytes": (c_uint64, [c_uint64]),
    "laden_grads_destroy": (None, [p]),
    "laden_grads_push": (status_t, [p, c_uint64, c_int, c_uint64, c_void_p,
                                    c_int, c_int, c_size_t]),
    "laden_grads_flush": (status_t, [p]),
    "laden_grads_stream": (c_size_t, [p]),
    "laden_grads_stats": (status_t, [p, P(c_uint64), P(c_uint64)]),
    "laden_grads_wait": (status_t, [p, c_size_t]),
    "laden_grads_fetch": (status_t, [p, c_uint64, c_void_p, c_uint64]),
    "laden_grads_fetched": (status_t, [p, c_size_t]),
    "laden_grads_upload_stream": (c_size_t, [p]),
    # dev
    "laden_dev_count": (status_t, [P(c_int32)]),
    "laden_dev_cuda_error": (c_char_p, []),
    "laden_dev_info": (status_t, [c_int32, P(DevInfo)]),
    "laden_dev_mem_info": (status_t, [c_int32, P(c_uint64), P(c_uint64)]),
    "laden_dev_measure_copy": (status_t, [c_int32, c_int, c_uint64, c_uint32,
                                          P(c_double)]),
    "laden_dev_event_elapsed_ms": (status_t, [p, p, P(c_float)]),
    "laden_dev_stream_create": (status_t, [c_int32, P(p)]),
    "laden_dev_stream_wrap": (status_t, [c_int32, ctypes.c_size_t, P(p)]),
    "laden_dev_stream_destroy": (None, [p]),
    "laden_dev_stream_synchronize": (status_t, [p]),
    "laden_dev_copy_h2d": (status_t, [p, c_uint64, c_void_p, c_uint64]),
    "laden_dev_copy_d2h": (status_t, [p, c_void_p, c_uint64, c_uint64]),
    "laden_dev_mem_alloc": (status_t, [c_int32, c_uint64, P(c_uint64)]),
    "laden_dev_mem_free": (status_t, [c_int32, c_uint64]),
    # stream
    "laden_sched_create": (status_t, [P(SchedConfig), p, P(p)]),
    "laden_sched_destroy": (None, [p]),
    "laden_sched_add_block": (status_t, [p, c_int, P(c_uint32)]),
    "laden_sched_add_tensor": (status_t, [p, c_uint32, p, c_size_t, c_int,
                                           P(c_uint32)]),
    "laden_sched_add_tensor_part": (status_t, [p, c_uint32, p, c_size_t,
                                                c_int, c_uint32, c_uint64,
                                                c_uint64, P(c_uint32)]),
    "laden_sched_add_host_tensor": (status_t, [p, c_uint32, c_void_p, c_int,
                                                c_uint64, c_int,
                                                P(c_uint32)]),
    "laden_sched_load": (status_t, [p]),
    "laden_sched_load_block": (status_t, [p, c_uint32]),
    "laden_sched_load_begin": (status_t, [p]),
    "laden_sched_load_wait": (status_t, [p]),
    "laden_sched_await": (status_t, [p, c_uint32]),
    "laden_sched_await_for": (status_t, [p, ctypes.c_int64, c_uint32,
                                         POINTER(c_int)]),
    "laden_sched_load_cancel": (status_t, [p]),
    "laden_sched_is_loaded": (c_int, [p]),
    "laden_sched_start": (status_t, [p, c_uint32]),
    "laden_sched_stop": (status_t, [p]),
    "laden_sched_tensor_ptr": (status_t, [p, c_uint32, c_uint32,
                                           P(c_uint64)]),
    "laden_sched_set_expanded": (status_t, [p, c_uint32, c_uint32, c_int,
                                             c_uint64, c_uint32, c_int]),
    "laden_sched_tensor_value": (status_t, [p, c_uint32, c_uint32, c_int,
                                             c_void_p, c_uint64]),
    "laden_sched_expanded_at": (status_t, [p, c_uint32, c_uint32,
                                            P(c_uint64), P(c_uint64)]),
    "laden_sched_host_ptr": (status_t, [p, c_uint32, c_uint32,
                                         P(c_void_p)]),
    "laden_sched_is_streamed": (c_int, [p, c_uint32]),
    "laden_sched_block_tier": (c_int, [p, c_uint32]),
    "laden_sched_enter": (status_t, [p, c_uint32, ctypes.c_size_t]),
    "laden_sched_learn_order": (status_t, [p, c_int]),
    "laden_sched_generation_word": (P(c_uint64), [p]),
    "laden_sched_exit": (status_t, [p, c_uint32, ctypes.c_size_t]),
    "laden_sched_synchronize": (status_t, [p]),
    "laden_sched_forget_stream": (status_t, [p, c_size_t]),
    "laden_sched_capture_begin": (status_t, [p, c_size_t, c_uint32]),
    "laden_sched_capture_end": (status_t, [p, c_size_t, P(p)]),
    "laden_sched_replay_begin": (status_t, [p, c_size_t, p]),
    "laden_sched_replay_end": (status_t, [p, c_size_t, p]),
    "laden_sched_capture_bytes": (c_uint64, [p]),
    "laden_sched_capture_free": (None, [p]),
    "laden_sched_slot_fills": (status_t, [p, c_uint32, P(c_uint64)]),
    "laden_sched_refill": (status_t, [p]),
    "laden_sched_copy_fills": (status_t, [p, c_uint32, P(c_uint64)]),
    "laden_sched_reupload": (status_t, [p, c_uint32]),
    "laden_sched_reupload_tensor": (status_t, [p, c_uint32, c_uint32,
                                               ctypes.c_size_t]),
    "laden_sched_own_copy": (status_t, [p, c_uint32, POINTER(c_int)]),
    "laden_sched_reread": (status_t, [p, c_uint32, c_uint32]),
    "laden_sched_share": (status_t, [p, c_char_p]),
    "laden_shm_held_bytes": (status_t, [c_char_p, P(c_uint64)]),
    "laden_shm_dir": (status_t, [c_char_p, c_size_t]),
    "laden_shm_list": (status_t, [P(ShmEntry), c_uint32, P(c_uint32)]),
    "laden_shm_reclaim": (status_t, [P(ShmEntry), c_uint32, P(c_uint32),
                                     P(c_uint64)]),
    "laden_sched_share_note": (status_t, [p, c_char_p, c_size_t]),
    "laden_sched_shared_bytes": (status_t, [p, P(c_uint64)]),
    "laden_sched_share_info": (status_t, [p, c_char_p, c_size_t,
                                          P(c_uint64), P(c_int32)]),
    "laden_sched_begin": (status_t, [p]),
    "laden_sched_end": (status_t, [p]),
    "laden_sched_end_all": (status_t, [p, POINTER(c_uint32)]),
    "laden_sched_close": (status_t, [p]),
    "laden_sched_is_closed": (c_int, [p]),
    "laden_sched_stats": (status_t, [p, P(SchedStats)]),
    "laden_sched_is_resident": (c_int, [p, c_uint32]),
    "laden_sched_is_pinned": (c_int, [p, c_uint32]),
    "laden_sched_block_count": (c_uint32, [p]),
    "laden_sched_block_bytes": (c_uint64, [p, c_uint32]),
    "laden_sched_block_ram_bytes": (c_uint64, [p, c_uint32]),
    "laden_sched_block_device_bytes": (c_uint64, [p, c_uint32]),
    "laden_sched_block_workspace_bytes": (c_uint64, [p, c_uint32]),
    "laden_sched_block_upload_bytes": (c_uint64, [p, c_uint32]),
    "laden_sched_block_state": (status_t, [p, c_uint32, P(c_int32),
                                           P(c_uint64), P(c_uint32)]),
    "laden_sched_tensor_layout": (status_t, [p, c_uint32, c_uint32,
                                             P(c_uint64), P(c_uint64),
                                             P(c_uint64)]),
    "laden_sched_pieces": (status_t, [P(c_uint64), c_uint32, c_uint64,
                                      P(c_uint32), P(c_uint32)]),
    "laden_sched_storage_for": (status_t, [c_int, c_int, c_uint32,
                                           c_uint64, c_uint32, P(c_uint32)]),
    "laden_sched_use_vram": (status_t, [p, p]),
    # cache
    "laden_cache_create": (status_t, [c_uint64, c_uint64, P(p)]),
    "laden_cache_destroy": (None, [p]),
    "laden_cache_add": (status_t, [p, ctypes.c_char_p, c_uint64,
                                   P(c_uint32)]),
    "laden_cache_remove": (status_t, [p, c_uint32]),
    "laden_cache_bind": (status_t, [p, c_uint32, p, c_uint32]),
    "laden_cache_unbind": (status_t, [p, c_uint32]),
    "laden_cache_activate": (status_t, [p, c_uint32, c_int, c_uint32,
                                        ctypes.c_size_t, P(CacheEvict),
                                        c_uint32, P(c_uint32),
                                        P(CacheActivation)]),
    "laden_cache_deactivate": (status_t, [p, c_uint32, ctypes.c_size_t]),
    "laden_cache_drop": (status_t, [p, c_uint32, c_uint64, c_int,
                                    P(c_uint64)]),
    "laden_cache_free_vram": (status_t, [p, c_uint64, P(CacheEvict),
                                         c_uint32, P(c_uint32)]),
    "laden_cache_plan_host_group": (status_t, [p, c_uint32, c_uint64,
                                               c_uint64, P(CacheHostEvict),
                                               c_uint32, P(c_uint32)]),
    "laden_cache_plan_host": (status_t, [p, c_uint32, c_uint64, c_uint64,
                                         P(c_uint32), c_uint32, P(c_uint32),
                                         c_uint32, P(c_uint32),
                                         P(CacheHostEvict), c_uint32,
                                         P(c_uint32)]),
    "laden_cache_host_add": (status_t, [p, c_uint64, P(c_uint32)]),
    "laden_cache_host_touch": (status_t, [p, c_uint32]),
    "laden_cache_host_remove": (status_t, [p, c_uint32]),
    "laden_cache_host_held": (status_t, [p, P(c_uint64), P(c_uint32)]),
    "laden_cache_may_evict": (status_t, [p, c_uint32, P(c_int32)]),
    "laden_cache_join": (status_t, [p, p]),
    "laden_cache_default_budget": (status_t, [c_int32, c_uint64,
                                              P(c_uint64)]),
    "laden_cache_info": (status_t, [p, c_uint32, P(CacheInfo)]),
    "laden_cache_keep_host": (status_t, [p, c_uint32, c_int]),
    "laden_cache_roomiest": (status_t, [P(p), c_uint32, P(c_uint32)]),
    "laden_cache_stats": (status_t, [p, P(CacheStats)]),
    # vram
    "laden_vram_create": (status_t, [c_int32, c_uint64, c_uint64, P(p)]),
    "laden_vram_destroy": (None, [p]),
    "laden_vram_set_budget": (status_t, [p, c_uint64]),
    "laden_vram_free_memory": (status_t, [p, c_uint64, P(c_uint64)]),
    "laden_vram_charge": (status_t, [p, c_uint64]),
    "laden_vram_uncharge": (status_t, [p, c_uint64]),
    "laden_vram_info": (status_t, [p, P(VramInfo)]),
    "laden_vbar_create": (status_t, [p, c_uint64, P(p)]),
    "laden_vbar_destroy": (None, [p]),
    "laden_vbar_alloc": (status_t, [p, c_uint64, P(c_uint64)]),
    "laden_vbar_fault": (status_t, [p, c_uint64, c_uint64, P(c_int),
                                    P(c_uint64)]),
    "laden_vbar_unpin": (status_t, [p, c_uint64, c_uint64]),
    "laden_vbar_unpin_after": (status_t, [p, c_uint64, c_uint64,
                                          ctypes.c_size_t]),
    "laden_vbar_prioritize": (status_t, [p]),
    "laden_vbar_deprioritize": (status_t, [p]),
    "laden_vbar_set_floor": (status_t, [p, c_uint64]),
    "laden_vbar_info": (status_t, [p, P(VbarInfo)]),
    "laden_vbar_residency": (status_t, [p, P(ctypes.c_uint8), c_uint32,
                                        P(c_uint32)]),
    "laden_elastic_attach": (status_t, [c_int32, p]),
    "laden_elastic_trim": (status_t, [c_int32]),
    "laden_elastic_stats": (status_t, [c_int32, P(ElasticStats)]),
    "laden_dev_cpu_fail_vmm_at": (c_uint64, [c_uint64]),
    # plan
    "laden_sched_plan": (status_t, [p, P(PlanInput), P(c_int32),
                                    P(PlanResult)]),
    "laden_sched_set_progress": (status_t, [p, PROGRESS_FN, c_void_p]),
    "laden_plan_compute": (status_t, [P(PlanInput), P(c_int32), P(c_int32),
                                      P(PlanResult)]),
    "laden_plan_why_text": (c_char_p, [c_int32]),
    "laden_plan_read": (status_t, [c_int32, P(PlanReadings)]),
    "laden_plan_probe_h2d": (status_t, [c_int32, P(c_double)]),
    "laden_plan_probe_disk": (status_t, [c_char_p, P(c_double)]),
    "laden_plan_load_input": (status_t, [P(PlanLoadOptions),
                                         P(PlanReadings), P(PlanInput)]),
    "laden_plan_warning_text": (c_char_p, [c_uint32]),
    # host
    "laden_host_create": (status_t, [c_int32, c_uint64, P(p)]),
    "laden_pinned_pool_set": (status_t, [c_int32, c_uint64]),
    "laden_pinned_pool_stats": (status_t, [c_int32, P(PinnedPoolStats)]),
    "laden_host_destroy": (None, [p]),
    "laden_host_alloc": (status_t, [p, c_uint64, P(c_void_p)]),
    "laden_host_free": (status_t, [p, c_void_p]),
    "laden_host_stats": (status_t, [p, P(HostStats)]),
    "laden_host_measure_memcpy": (status_t, [c_uint64, P(c_double)]),
    # lossless
    "laden_lossless_bound": (status_t, [c_int32, c_uint64, P(c_uint64)]),
    "laden_lossless_encode": (status_t, [c_int32, c_void_p, c_uint64,
                                         c_void_p, c_uint64, P(c_uint64)]),
    "laden_lossless_check": (status_t, [c_void_p, c_uint64,
                                        P(LosslessInfo)]),
    "laden_lossless_decode": (status_t, [c_int32, ctypes.c_size_t,
                                         P(LosslessInfo), c_uint64, c_uint64,
                                         c_uint64, c_uint64]),
    "laden_lossless_cache_path": (status_t, [c_char_p, c_char_p, c_char_p,
                                             c_size_t]),
    "laden_lossless_cache_write": (status_t, [c_char_p, c_char_p,
                                              PROGRESS_FN,
                                              c_void_p,
                                              P(LosslessCacheStats)]),
    "laden_lossless_cache_entries": (status_t, [c_char_p, c_char_p,
                                                P(LosslessCacheEntry),
                                                c_uint32, P(c_uint32),
                                                P(c_int)]),
    "laden_sched_use_lossless_cache": (status_t, [p, c_char_p]),
    "laden_sched_lossless_cache_info": (status_t, [p, P(c_uint32),
                                                   P(c_uint32)]),
}

# The version of libladen's binary interface this binding is written for
# (LADEN_ABI_VERSION, include/laden/abi.h): a library of another is refused
# at import, since its signatures, structs or constants may not be these.
ABI_VERSION = 6


def _check_version(lib, path: str, where: str) -> None:
    fn = getattr(lib, "laden_abi_version", None)
    if fn is not None:
        fn.restype, fn.argtypes = c_uint32, []
    got = fn() if fn is not None else None
    if got != ABI_VERSION:
        has = (f"has ABI version {got}" if got is not None else
               "has no laden_abi_version (it is older than this package)")
        raise ImportError(
            f"libladen at {path}{where} {has}, but this laden package is "
            f"written for ABI version {ABI_VERSION}; rebuild and reinstall "
            "laden ('pip install .') or point LADEN_LIBRARY at a matching "
            "build")


def _load() -> ctypes.CDLL:
    env = os.environ.get("LADEN_LIBRARY")
    path = env or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "libladen.so")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(
            f"cannot load libladen from {path}: {e}; install laden with "
            "'pip install .' or set LADEN_LIBRARY") from None
    _check_version(lib, path, " (LADEN_LIBRARY)" if env else "")
    for name, (res, args) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


def _constants(lib: ctypes.CDLL) -> dict:
    """The library's table of constants, by their names without LADEN_
    (LADEN_TIER_GPU is TIER_GPU), as C's headers define them."""
    out = {}
    name, value, unsigned = c_char_p(), c_int64(), c_int32()
    for i in range(lib.laden_abi_const_count()):
        if lib.laden_abi_const_at(i, ctypes.byref(name), ctypes.byref(value),
                                  ctypes.byref(unsigned)) != 0:
            raise ImportError(f"libladen: constant {i} of its table is "
                              "unreadable")
        # An unsigned 64-bit constant above INT64_MAX comes as its bits.
        v = value.value % (1 << 64) if unsigned.value else value.value
        out[name.value.decode()[len("LADEN_"):]] = v
    return out


lib = _load()
# DEVICE_CPU, TIER_*, LOOKAHEAD_DEFAULT/MAX, SCHED_CACHE, CACHE_*, COPY_*,
# PLAN_AUTO, PLAN_WARN_*, CAPTURE_STANDALONE, SHARE_*, GRADS_*: from C, not
# copied (src/api/abi.c lists them).
CONSTANTS = _constants(lib)
if set(CONSTANTS) & set(globals()):  # a name added on one side only
    raise ImportError(f"libladen's constants would hide laden._lib's "
                      f"{sorted(set(CONSTANTS) & set(globals()))}")
globals().update(CONSTANTS)


def last_error() -> str:
    return (lib.laden_last_error() or b"").decode("utf-8", "replace")


def error_for(status: int) -> LadenError:
    """The typed exception for a failed call, with the thread's detail."""
    name = lib.laden_status_name(status).decode()
    detail = last_error() or lib.laden_status_message(status).decode()
    cls = BY_STATUS.get(name, LadenError)
    return cls(detail, name, status)


def check(status: int) -> None:
    if status != 0:
        raise error_for(status)
