/* abi: the layout of the public structs, as this library was compiled.
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
 * layout check, not a type check: a uint64_t mirrored as a double passes.
 *
 * Every call reads constant tables: any thread, no blocking, no allocation;
 * returned strings are static storage. */
#ifndef LADEN_ABI_H
#define LADEN_ABI_H

#include "../laden.h"

#ifdef __cplusplus
extern "C" {
#endif

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
