/* Internal: the process's pool of pinned host memory (pool.c), for the
 * schedules' RAM-tier homes. */
#ifndef LADEN_HOST_POOL_H
#define LADEN_HOST_POOL_H
#include <stdbool.h>
#include <stdint.h>

/* A mapping of exactly len bytes, registered (pinned) for `device`, from
 * the pool: *out, or false where the pool holds none of that length. */
bool laden__pool_take(int32_t device, uint64_t len, void **out);
/* Keeps mapping p of len bytes, registered for `device`, for a later
 * take, if the pool's budget has room: true (the caller lets go of it
 * without unregistering or unmapping); false (the caller frees it). */
bool laden__pool_keep(int32_t device, void *p, uint64_t len);

#endif
