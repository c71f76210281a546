/* abi: the binary interface as this library was compiled -- its version,
 * the layout of the public structs and the values of the constants the
 * binding uses.
 *
 * Why: the Python binding declares its own copy of every struct it passes
 * to C (ctypes Structure classes in python/laden/_lib.py), written by hand.
 * A field added, moved or resized in a header but not in the copy does not
 * fail to build: C reads or writes the wrong bytes.  These calls let a test
 * compare each copy with what the compiler laid out -- size, field names in
 * order, offsets and sizes -- so that a drifted copy fails the tests rather
 * than corrupting memory.
 *
 * Structs are named by their C tag ("laden_plan_input" for struct
 * laden_plan_input, typedef'd laden_plan_input; "laden_st_tensor" for
 * laden_st_tensor_t).  Only structs the binding mirrors are listed.  A
 * layout check, not a type check: a uint64_t mirrored as a double passes
 * (python/tests/test_abi.py checks the types against these headers).
 *
 * The unit sits above every layer (src/api/abi.c): it includes each
 * layer's header to describe it, which no layer may do.
 *
 * Every call reads constant tables: any thread, no blocking, no allocation;
 * returned strings are static storage. */
#ifndef LADEN_ABI_H
#define LADEN_ABI_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the binary interface: the functions' signatures, the
 * structs' layouts and the constants' meanings.  Whoever changes one of
 * them bumps it; the Python binding states the version it was written for
 * and refuses to load a library of another (python/laden/_lib.py), so that
 * a stale libladen.so fails at import with both numbers rather than
 * corrupting memory at the first call that drifted. */
#define LADEN_ABI_VERSION 6u

/* LADEN_ABI_VERSION as this library was compiled.  Any thread. */
LADEN_API uint32_t laden_abi_version(void);

/* The constants the Python binding uses (tiers, flags, defaults, limits),
 * by their C names ("LADEN_TIER_GPU"), with the values the compiler gave
 * the headers' macros and enums: the binding reads them at import instead
 * of copying numbers by hand.  Values are int64; *is_unsigned is 1 where
 * the constant's C type is unsigned, so that a 64-bit one above INT64_MAX
 * (LADEN_PLAN_AUTO) reads as its bits taken as uint64 (the int64 holds
 * them in two's complement).  Static storage; any thread. */

/* How many constants are listed (0, 1, ... count - 1 for
 * laden_abi_const_at).  Any thread. */
LADEN_API uint32_t laden_abi_const_count(void);

/* Constant i (a fixed order): its name (static storage), value and
 * signedness (either out may be NULL but name).  LADEN_E_INVAL for i past
 * the last one or a NULL name; on failure the outputs are NULL and 0.  Any
 * thread. */
LADEN_API laden_status laden_abi_const_at(uint32_t i, const char **name,
                                          int64_t *value,
                                          int32_t *is_unsigned);

/* The constant called `name` ("LADEN_TIER_GPU").  LADEN_E_NOTFOUND for a
 * name not listed, LADEN_E_INVAL for NULL name or value; on failure the
 * outputs are 0.  Any thread. */
LADEN_API laden_status laden_abi_const(const char *name, int64_t *value,
                                       int32_t *is_unsigned);

/* The name of the i-th struct described (0, 1, ... in a fixed order), or
 * NULL when i is past the last one.  Static storage; any thread. */
LADEN_API const char *laden_abi_struct_name(uint32_t i);

/* sizeof the struct called `name` and how many fields it has.
 * LADEN_E_NOTFOUND for a name not described, LADEN_E_INVAL for NULL
 * arguments; on failure the outputs are 0.  Any thread. */
LADEN_API laden_status laden_abi_struct(const char *name, uint64_t *size_bytes,
                                        uint32_t *nfields);

/* Field i (declaration order) of the struct called `struct_name`: its name
 * (static storage), offsetof and sizeof (a whole array for an array field).
 * LADEN_E_NOTFOUND for a struct not described, LADEN_E_INVAL for i past the
 * last field or NULL arguments; on failure the outputs are NULL and 0.
 * Any thread. */
LADEN_API laden_status laden_abi_field(const char *struct_name, uint32_t i,
                                       const char **field_name,
                                       uint64_t *offset_bytes,
                                       uint64_t *size_bytes);

#ifdef __cplusplus
}
#endif
#endif
