/* stream: run a model whose weights do not fit the device by streaming its
 * blocks through a fixed ring of device slots.
 *
 * A schedule holds blocks, each a list of checkpoint tensors packed into one
 * contiguous region, and a tier per block:
 *   LADEN_TIER_GPU   the region lives on the device for good;
 *   LADEN_TIER_RAM   the region lives in pinned host memory and is copied
 *                    into a slot, with one copy, when the block runs (on the
 *                    CPU device the RAM region is used in place);
 *   LADEN_TIER_DISK  nothing is held; the block's tensors are read from the
 *                    checkpoint into the slot's pinned staging buffer ahead
 *                    of use, then copied into the slot;
 *   LADEN_TIER_VRAM  on the device if it has room at load, else on the RAM
 *                    tier: the device memory comes from the schedule's VRAM
 *                    context (laden_sched_use_vram), or is allocated, and a
 *                    block the context has no room for (or whose allocation
 *                    fails for lack of device memory) streams instead.
 *                    After load the block reports the tier it got
 *                    (laden_sched_block_tier).
 * Streamed blocks (RAM, DISK) are ordered by the order they were added: that
 * is the schedule.  Block i always runs from slot (i mod nslots), nslots =
 * lookahead + 1, so its tensors have one address for the whole life of the
 * schedule and callers point their parameters at it once.
 *
 * laden_sched_enter(b) before a block runs makes the compute stream wait
 * until b's bytes are in its slot (loading them now if no prefetch did:
 * blocks called out of schedule order are correct, only slower), then
 * prefetches the next `lookahead` blocks of the schedule, cyclically, in
 * the direction blocks are being entered: in order, or in reverse once a
 * block is entered right after the one behind it (a backward pass
 * recomputing blocks last to first streams as well as a forward).
 * laden_sched_exit(b) after it has been enqueued records that the slot may
 * be overwritten once the compute stream has passed that point.  Neither
 * blocks the host in the steady state; neither allocates.
 *
 * One thread at a time, enforced: every call holds the schedule while it
 * runs, laden_sched_enter holds it until laden_sched_exit, and
 * laden_sched_begin until laden_sched_end (a whole forward).  A call from
 * another thread meanwhile fails at once with LADEN_E_STATE, never waits
 * and never races.  Holds by the holding thread nest.  The int-returning
 * queries (laden_sched_is_streamed, ..._block_count) read without holding:
 * call them from the thread that uses the schedule. */
#ifndef LADEN_STREAM_H
#define LADEN_STREAM_H

#include "../laden.h"
#include "dev.h"
#include "expand.h"
#include "io.h"
#include "plan.h"
#include "st.h"
#include "vram.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct laden_sched laden_sched_t;

/* Schedule flags.
 *
 * LADEN_SCHED_CACHE: the schedule of a model kept in a cache between uses.
 * Every block is on the RAM tier, in pageable host memory of its own that
 * laden_sched_pin pins in place (and unpins) without a copy.  A block is
 * streamed through the slots unless laden_sched_set_resident gave it a
 * device copy of its own, which it keeps until taken away; on the CPU
 * device too the blocks run from "device" copies, so that every path of
 * the cache runs in CI. */
#define LADEN_SCHED_CACHE 1u

typedef struct laden_sched_config {
    int32_t device;             /* CUDA index or LADEN_DEVICE_CPU */
    uint32_t lookahead;         /* blocks prefetched ahead; 0: default 2 */
    uint64_t ram_budget_bytes;  /* pinned bytes (RAM tier + staging);
                                   0: no limit */
    laden_io_t *io;             /* reader pool to use (borrowed); NULL: own */
    uint32_t flags;             /* LADEN_SCHED_* */
} laden_sched_config;

typedef struct laden_sched_stats {
    uint64_t gpu_bytes, ram_bytes, disk_bytes; /* tensor bytes per tier */
    uint64_t slot_bytes;        /* bytes of one slot */
    uint32_t nslots;
    uint64_t device_bytes;      /* device memory held: GPU tier or device
                                   copies, slots, the expansion workspace,
                                   a cache's lossless upload buffers */
    uint64_t pinned_bytes;      /* pinned host memory held */
    uint64_t enters;            /* laden_sched_enter calls on streamed blocks */
    uint64_t misses;            /* of those, blocks not prefetched in time */
    uint64_t h2d_bytes;         /* bytes copied into slots */
    uint64_t read_bytes;        /* bytes read from disk while streaming */
    uint64_t load_read_bytes;   /* bytes read from the checkpoint at load */
    /* LADEN_SCHED_CACHE schedules: */
    uint64_t resident_bytes;    /* blocks with a device copy of their own */
    uint64_t registered_bytes;  /* host copies pinned in place */
    uint64_t upload_bytes;      /* copied by laden_sched_set_resident */
    uint64_t generation;        /* changes whenever a tensor's address does */
    uint64_t offloaded_bytes;   /* VRAM-tier blocks that went to RAM at load */
    uint64_t load_cached_bytes; /* of load_read_bytes, read from the page
                                   cache (at memory speed) */
    uint64_t reorders;          /* times the streamed blocks' positions
                                   took the order they are called in
                                   (laden_sched_learn_order) */
    uint64_t expert_rows;       /* experts entered in streamed expert
                                   blocks (laden_sched_enter_experts),
                                   each counted once per enter */
    uint64_t expert_rows_moved; /* of those, the ones that crossed the
                                   link (copied from host memory or read
                                   from disk) */
    uint64_t expert_rows_cached; /* of those, the ones copied from the
                                    expert cache in device memory; the
                                    rest were in the slot already */
    uint64_t expert_cache_bytes; /* device memory the expert cache holds
                                    (laden_sched_set_expert_cache) */
    uint64_t lossless_bytes;     /* tensors kept lossless-compressed
                                    (laden_sched_set_lossless): their
                                    blobs' bytes ... */
    uint64_t lossless_raw_bytes; /* ... and their own */
    uint64_t lossless_cache_bytes; /* of the load's reads, the blobs read
                                      from lossless cache files
                                      (laden_sched_use_lossless_cache) */
} laden_sched_stats_t;

/* Creates an empty schedule for the checkpoint `st`, whose files are opened
 * now and kept open (disk blocks read from them later; LADEN_E_CHANGED if
 * one's size differs from when `st` read its header).  `st` itself is not
 * retained; it may be NULL when every tensor comes from host memory
 * (laden_sched_add_host_tensor).  Destroy with laden_sched_destroy. */
LADEN_API laden_status laden_sched_create(const laden_sched_config *cfg,
                                          const laden_st_t *st,
                                          laden_sched_t **out);

/* Frees everything the schedule holds (device regions, slots, pinned
 * memory), after waiting for its copies and reads and, on CUDA, for the
 * work enqueued on the compute stream it last saw.  NULL: no-op.  No other
 * thread may be calling into the schedule (closing it first makes any such
 * call fail instead of racing). */
LADEN_API void laden_sched_destroy(laden_sched_t *sched);

/* Refuses every later call on the schedule with LADEN_E_STATE ("closed"),
 * from any thread, while its memory stays valid until
 * laden_sched_destroy: for callers whose views of the memory may outlive
 * the model (laden's Python package destroys the schedule when the last
 * tensor over it is gone).  LADEN_E_STATE, changing nothing, if a thread
 * holds the schedule now (inside laden_sched_enter/exit or begin/end, or
 * in a call); the caller may retry.  Closing twice is a no-op. */
LADEN_API laden_status laden_sched_close(laden_sched_t *sched);

/* 1 once laden_sched_close succeeded. */
LADEN_API int laden_sched_is_closed(laden_sched_t *sched);

/* Holds the schedule for the calling thread until laden_sched_end: the
 * calls of one pass over the model (a forward) are then refused to other
 * threads from its first block to its last, and laden_sched_close waits
 * for nothing, it is refused.  Nests.  LADEN_E_STATE if another thread
 * holds it or it is closed. */
LADEN_API laden_status laden_sched_begin(laden_sched_t *sched);

/* Ends a pass begun on this thread (LADEN_E_STATE if none). */
LADEN_API laden_status laden_sched_end(laden_sched_t *sched);

/* Ends every pass this thread began on the schedule and exits every block
 * it entered and did not exit, each exit ordered on the stream its block
 * was entered on: what an interrupted forward left (a KeyboardInterrupt
 * that lands between a call into C and the Python that would have ended
 * it).  For the outermost caller only: a pass or block still running on
 * this thread's stack is ended too.  LADEN_OK at once when this thread
 * holds nothing; LADEN_E_STATE, ending nothing, during a CUDA graph
 * capture of this thread (end the capture first); otherwise the first
 * exit's failure, if any, with everything ended anyway.  *out_exited
 * (may be NULL) is the number of blocks it exited.  Never blocks beyond
 * recording events. */
LADEN_API laden_status laden_sched_end_all(laden_sched_t *sched,
                                           uint32_t *out_exited);

/* Adds a block with the given tier; *out_block is its index (0, 1, ...).
 * LADEN_TIER_AUTO leaves the tier to laden_sched_plan (not for cache
 * schedules).  Adding a block or a tensor after a plan makes the planned
 * blocks AUTO again: the description changed, plan it again. */
LADEN_API laden_status laden_sched_add_block(laden_sched_t *sched,
                                             laden_tier tier,
                                             uint32_t *out_block);

/* Adds the part of checkpoint tensor `st_index` that one rank of a
 * tensor-parallel group holds: along dimension `dim`, the `count` indices
 * from `start`, the other dimensions whole -- a row-major tensor's local
 * shard, packed.  Stored as `dtype` as by laden_sched_add_tensor.  Only
 * the part is read: one range when the dimensions before `dim` are all 1
 * (dimension 0 of a matrix: its rows), else one range per index of them
 * (a column shard: a range per row), which the disk tier cannot stream
 * (refused there).  Whole-byte dtypes only; no GGUF row reordering. */
LADEN_API laden_status laden_sched_add_tensor_part(
    laden_sched_t *sched, uint32_t block, const laden_st_t *st,
    size_t st_index, laden_dtype dtype, uint32_t dim, uint64_t start,
    uint64_t count, uint32_t *out_index);

/* Lays tensor `index` of `block` right after tensor index - 1, with no
 * gap: the two (with those joined before) are then one tensor of the
 * model, their bytes end to end -- checkpoint tensors that the model holds
 * fused into one (transformers' MoE experts: each expert's gate and up
 * projections in turn, stacked over the experts).  `index` must be the
 * block's last tensor so far; both are checkpoint tensors kept in the same
 * whole-byte dtype, neither quantized on load, reordered, nor marked
 * expanded.  Before the plan.  The joined run's laden_sched_tensor_layout
 * size and laden_sched_tensor_value are asked of its first tensor (a view
 * at its laden_sched_tensor_ptr spans the run).  LADEN_E_INVAL naming the
 * tensor otherwise. */
LADEN_API laden_status laden_sched_join_tensor(laden_sched_t *sched,
                                               uint32_t block,
                                               uint32_t index);

/* Block `block` holds the experts of one mixture-of-experts layer: each of
 * its tensors (a joined run counts as one) is `experts` rows of equal
 * bytes, one per expert, in order (a transformers experts module:
 * gate_up_proj [E, 2I, H], down_proj [E, H, I], their biases).  When it
 * streams, a prefetch copies nothing into its slot: it is entered with
 * laden_sched_enter_experts, which copies (on the disk tier: reads) the
 * rows of the experts a call is routed to, alone; the slot then holds each
 * of those rows at its place and the others stale, so a kernel that
 * indexes the tensors by expert computes as with the whole tensors.  Not
 * in cache schedules, nor with compact tensors; a schedule with a streamed
 * expert block cannot be captured (its rows change every call).  Before
 * the plan.  LADEN_E_INVAL naming the tensor whose bytes are not
 * `experts` equal rows. */
LADEN_API laden_status laden_sched_set_experts(laden_sched_t *sched,
                                               uint32_t block,
                                               uint32_t experts);

/* Enters expert block `block` (laden_sched_set_experts) for a call routed
 * to experts[0..n) (each below the block's experts; any order, repeats
 * allowed): as laden_sched_enter, but a streamed block's slot receives
 * only those experts' rows, on the copy stream (the disk tier: read, then
 * copied), counted in h2d_bytes and read_bytes as such.  A block that does
 * not stream is entered as by laden_sched_enter.  laden_sched_enter of a
 * streamed expert block is refused (LADEN_E_STATE): its slot would hold no
 * row. */
LADEN_API laden_status laden_sched_enter_experts(laden_sched_t *sched,
                                                 uint32_t block,
                                                 const uint32_t *experts,
                                                 uint32_t n,
                                                 uintptr_t compute_stream);

/* Tensor `index` of `block` (the checkpoint's own BF16 or F16, read as
 * one range and laid out alone) is kept lossless-compressed
 * (laden/lossless.h) where its block is on the RAM tier: at load it is
 * read, encoded on the host's cores, and its blob kept in the block's
 * home in its place, so the RAM tier, the slots and every copy into them
 * hold fewer bytes; the block's enter decodes it, bit for bit, into the
 * expansion workspace (as laden_sched_set_expanded's tensors, whose
 * rules it follows: its address is laden_sched_expanded_at's).  A tensor
 * whose blob would not be at most 15/16 of its bytes, or whose block is
 * on another tier, is kept as stored, plain (laden_sched_tensor_lossless
 * says which).  A tensor in host memory (laden_sched_add_host_tensor, its
 * dtype kept) is encoded from there.  In a cache schedule
 * (LADEN_SCHED_CACHE) the host copy and the slots hold the blob, and a
 * block's device copy holds the tensor decoded (decoded as it is
 * uploaded: its address is then laden_sched_tensor_ptr's, and its size
 * counts in laden_sched_block_device_bytes); a streamed block decodes it
 * at its enter, as above.
 * Counted in lossless_bytes and lossless_raw_bytes.  Before the load;
 * LADEN_E_UNSUPPORTED (saying why) for another dtype, a tensor converted,
 * a part, joined, reordered or compact, or an expert block's;
 * LADEN_E_STATE after the load. */
LADEN_API laden_status laden_sched_set_lossless(laden_sched_t *sched,
                                                uint32_t block,
                                                uint32_t index);

/* Marks (laden_sched_set_lossless) every tensor it takes of the blocks
 * not on the device: on the RAM or disk tier (planned or asked) or not
 * planned yet (LADEN_TIER_AUTO), leaving the others plain, and estimates
 * each one's coded size from three 32 KB samples of the file (a plan
 * counts a RAM-tier block at those sizes: laden_sched_block_ram_bytes;
 * the load encodes only the RAM tier's and refuses, LADEN_E_BUDGET, when
 * the true sizes pass the room the plan had).  *out_marked (may be NULL)
 * counts those marked.  The plan is undone when one is (their workspace
 * counts): plan (again) before the load.  LADEN_E_STATE after the load;
 * a read failure while sampling is returned naming the tensor. */
LADEN_API laden_status laden_sched_mark_lossless(laden_sched_t *sched,
                                                 uint32_t *out_marked);

/* Takes the lossless cache files laden_lossless_cache_write made in
 * `dir` (laden/lossless.h) for the schedule's files: the mark
 * (laden_sched_mark_lossless) then counts their tensors at their exact
 * coded sizes, reading no samples, and the load reads their blobs from
 * the cache instead of reading and encoding the tensors (a tensor the
 * cache keeps raw is read as stored).  A file without a cache file in
 * dir is encoded at load, as without; a cache file made from another
 * version of its file (its size, modification time or first MiB
 * differ) is not used.  Before the mark and the load; once.  Errors:
 * LADEN_E_CORRUPT naming a cache file that is not one or is damaged
 * (its header or index: a blob is checked as it is read), LADEN_E_IO /
 * LADEN_E_NOENT for dir, LADEN_E_STATE after the load or a second
 * call; nothing is taken then. */
LADEN_API laden_status laden_sched_use_lossless_cache(laden_sched_t *sched,
                                                      const char *dir);
/* Of laden_sched_use_lossless_cache's files: those whose cache file was
 * taken, and those whose cache file was stale (not taken). */
LADEN_API laden_status laden_sched_lossless_cache_info(laden_sched_t *sched,
                                                       uint32_t *found,
                                                       uint32_t *stale);

/* 1 if tensor `index` of `block` is kept lossless-compressed (decoded by
 * its block's enter into the workspace, or in a cache schedule into its
 * block's device copy), else 0: not marked, or kept as
 * stored at load.  Known once the load began (laden_sched_load or
 * laden_sched_load_prepare). */
LADEN_API int laden_sched_tensor_lossless(laden_sched_t *sched,
                                          uint32_t block, uint32_t index);

/* Device memory for the expert cache (LADEN_EXPERT_CACHE_AUTO: as the
 * schedule decides).  Experts of streamed expert blocks that crossed the
 * link are kept there (those routed to most often: see experts.c), so that an
 * enter routed to one again after its slot held another block copies it
 * from there, device to device, instead of across the link; counted in
 * expert_rows_cached.  Entries are all the size of the largest expert;
 * `bytes` is rounded down to whole entries and capped at every streamed
 * expert.  AUTO: on CUDA the device memory the last laden_sched_plan left
 * free (its vram_avail_bytes less vram_used_bytes; none if the tiers
 * were not planned, or when that memory cannot be had at start), on the
 * CPU device none (its copy would be one more in host memory); 0: none.
 * Made at laden_sched_start with the slots and charged like them to the
 * VRAM context; a size given that cannot be had fails the start.
 * LADEN_E_STATE once started, LADEN_E_UNSUPPORTED for a cache schedule. */
#define LADEN_EXPERT_CACHE_AUTO UINT64_MAX
LADEN_API laden_status laden_sched_set_expert_cache(laden_sched_t *sched,
                                                    uint64_t bytes);

/* Adds checkpoint tensor `st_index` to a block, stored as `dtype` (the
 * checkpoint's own dtype, or F32/F16/BF16 converted from one of those on
 * load; disk-tier blocks must keep the checkpoint's dtype).  *out_index is
 * the tensor's index within the block. */
LADEN_API laden_status laden_sched_add_tensor(laden_sched_t *sched,
                                              uint32_t block,
                                              const laden_st_t *st,
                                              size_t st_index,
                                              laden_dtype dtype,
                                              uint32_t *out_index);

/* Tensor `index` of `block` (a checkpoint tensor) has its rows in the
 * order llama.cpp's converter writes a Llama-family q or k projection:
 * within each of `heads` heads of d rows, row 2i + j holds row
 * j * d/2 + i.  The load puts them back in transformers' order (whole
 * rows move: block-quantized rows too), which makes the block one that
 * cannot stream from disk.  LADEN_E_SHAPE unless the rows are `heads`
 * heads of an even count; before the plan. */
LADEN_API laden_status laden_sched_set_rope_rows(laden_sched_t *sched,
                                                 uint32_t block,
                                                 uint32_t index,
                                                 uint64_t heads);

/* Adds a tensor whose bytes are in host memory (a model built on the CPU):
 * n_elems elements of src_dtype at src, stored as dtype (converted as for
 * checkpoint tensors).  The bytes are copied at load; src must stay valid
 * until then.  Not allowed on the disk tier. */
LADEN_API laden_status laden_sched_add_host_tensor(laden_sched_t *sched,
                                                   uint32_t block,
                                                   const void *src,
                                                   laden_dtype src_dtype,
                                                   uint64_t n_elems,
                                                   laden_dtype dtype,
                                                   uint32_t *out_index);

/* Plans the described schedule (blocks added, not loaded): sizes every
 * block as it will be laid out (laden_sched_block_bytes is valid from
 * now on), marks the blocks whose tensors are converted on load as unable
 * to stream from disk (LADEN_PLAN_BLOCK_NO_DISK), and runs the planner
 * (plan.h) over them with the budgets, readings and rates of `budgets`,
 * whose block fields (nblocks, block_bytes, asked, block_flags,
 * ram_block_bytes, slot_block_bytes, rest_bytes) are ignored, the
 * schedule supplying them.  The schedule also
 * supplies: lookahead (its own when budgets->lookahead is 0), host_device
 * (from its device; disk_staging is the caller's on CUDA: whether the
 * staging counts against the RAM budget, and 0 on the CPU), and, with a
 * VRAM context
 * (laden_sched_use_vram) that has a budget, the context's room as the cap
 * on vram_free_bytes.  Blocks added with LADEN_TIER_AUTO are the
 * planner's; the others keep their tier (asked; a VRAM-tier block is
 * asked resident).  Each AUTO block then
 * takes its planned tier (a planned GPU block in a VRAM context takes
 * LADEN_TIER_VRAM: on the device if the context has room at load).
 * why[i] (block-count entries, or NULL) receives each block's reason.
 * LADEN_E_BUDGET when the budgets cannot be met (nothing changes), with a
 * message that says what would fit.  May be called again before load.
 * LADEN_E_STATE for a cache schedule (its cache decides residency) and
 * once loaded. */
LADEN_API laden_status laden_sched_plan(laden_sched_t *sched,
                                        const laden_plan_input *budgets,
                                        int32_t *why, laden_plan_result *out);

/* One host copy for the processes of a host (issue 19): the blocks that
 * live in host memory -- the RAM tier, and on the CPU device the GPU
 * tier too, where they run in place -- go into one segment of shared
 * memory (laden/shm.h) named from what determines their bytes: the
 * checkpoint files' identities (laden_io_file_identity: device, inode,
 * size, modification and status change times),
 * every such tensor's place, dtypes and conversion, and `key` (the
 * caller's own text, may be NULL).  The first process to load it reads
 * the checkpoint into the segment; the others that load the same layout
 * attach to it and read nothing (each pins it with its own CUDA
 * context); the last to destroy its schedule removes it, and one left by
 * processes that died is made again by the next load.  A block with a
 * tensor from host memory (laden_sched_add_host_tensor) keeps a copy of
 * its own, as do VRAM-tier blocks a VRAM context had no room for.
 * Blocks in the segment are read-only to laden: laden_sched_reread is
 * refused there, and laden_sched_load_block (a cache schedule loads
 * whole).  Call before the load.  An attaching load waits for the
 * process filling the segment; LADEN_E_STATE if that process fails or
 * ends first. */
LADEN_API laden_status laden_sched_share(laden_sched_t *sched,
                                         const char *key);

/* The bytes of this user's shared segments made from checkpoint `st`'s
 * files (as they are now: the same identities), whatever their layout: a
 * process planning a shared load counts them as memory it would attach
 * to, not as memory in use. */
LADEN_API laden_status laden_sched_shared_bytes(const laden_st_t *st,
                                                uint64_t *out_bytes);

/* Whether the schedule's host copy is shared: *out_state 0 not shared
 * (or not loaded yet), 1 this process made and filled the segment, 2 it
 * attached to one another process made, 3 it was asked for but the
 * segment's name was held by something else (a segment of another
 * content, a file laden did not make, a FIFO, a symlink, another user's
 * file: never used), so the load kept a private copy
 * (laden_sched_share_note says why); its name (without the directory,
 * NUL-terminated in name_cap bytes; NULL: not wanted) and data bytes. */
LADEN_API laden_status laden_sched_share_info(laden_sched_t *sched,
                                              char *name, size_t name_cap,
                                              uint64_t *out_bytes,
                                              int32_t *out_state);
/* laden_sched_share_info's states, by name (for the binding's table). */
#define LADEN_SHARE_NONE 0
#define LADEN_SHARE_MADE 1
#define LADEN_SHARE_ATTACHED 2
#define LADEN_SHARE_FELL_BACK 3

/* Why a load asked to share kept a private copy (state 3 of
 * laden_sched_share_info), NUL-terminated in why (why_cap bytes); "" if
 * it did not.  Does not block; the schedule's thread. */
LADEN_API laden_status laden_sched_share_note(laden_sched_t *sched,
                                              char *why, size_t why_cap);

/* Called by laden_sched_load and laden_sched_load_block on the loading
 * thread each time a block is in place: bytes of blocks done so far, and
 * of all the blocks being loaded.  Returns 0 to go on.  Anything else
 * cancels laden_sched_load: the reads in flight are waited for and it
 * fails with LADEN_E_STATE ("cancelled"), after which the schedule can
 * only be destroyed (laden_sched_load_block ignores it: its caller gets
 * control back after each block anyway). */
typedef int (*laden_sched_progress_fn)(void *arg, uint64_t done_bytes,
                                       uint64_t total_bytes);

/* Names the schedule (its model) for traces (laden_trace_start); at most
 * 63 bytes are kept. */
LADEN_API laden_status laden_sched_set_name(laden_sched_t *sched,
                                            const char *name);

/* Names a block (its module's path) for traces; at most 127 bytes are
 * kept.  LADEN_E_INVAL for a block that does not exist. */
LADEN_API laden_status laden_sched_set_block_name(laden_sched_t *sched,
                                                  uint32_t block,
                                                  const char *name);

/* Sets (or, with NULL, clears) the load progress callback. */
LADEN_API laden_status laden_sched_set_progress(laden_sched_t *sched,
                                                laden_sched_progress_fn fn,
                                                void *arg);

/* Lays the blocks out, allocates the GPU-tier regions on the device and the
 * RAM tier in pinned memory, and reads each of their tensors once, into its
 * final tier: blocks are read in order with several in flight, the RAM
 * tier's memory allocated while earlier blocks are read, chunks already in
 * the page cache copied from it.  Blocks until done.  On failure everything allocated is freed
 * again and the schedule can only be destroyed. */
LADEN_API laden_status laden_sched_load(laden_sched_t *sched);

/* Everything laden_sched_load does before its first read: tiers checked,
 * device and host memory given, so that laden_sched_tensor_ptr and
 * laden_sched_host_ptr are valid (their bytes are not yet).  Then
 * laden_sched_load_begin reads in the background, or laden_sched_load_wait
 * reads on the calling thread.  Not for cache schedules. */
LADEN_API laden_status laden_sched_load_prepare(laden_sched_t *sched);

/* laden_sched_load without waiting: prepares (if not yet) and returns
 * while a thread of the schedule's reads the blocks in order.  Meanwhile
 * the schedule's calls work: each waits for the loader's current step (one
 * piece of a block) instead of being refused.  laden_sched_await(b) waits
 * until block b's bytes are in place, driving the load on the calling
 * thread meanwhile, and laden_sched_enter does the same for a streamed
 * block, so that a forward pass runs as the blocks arrive; a resident
 * block (GPU tier, or the RAM tier on the CPU device) must be awaited
 * before its bytes are read: enter does not wait for it.  A failure is
 * returned by every later await, enter of a streamed block and
 * laden_sched_load_wait; the memory stays (its addresses were handed
 * out) until laden_sched_destroy.  laden_sched_close and
 * laden_sched_destroy stop the load (its reads in flight finish first).
 * The progress callback is called on the loading thread; destroying the
 * schedule from there is deferred to the end of the thread.  Not for
 * cache schedules. */
LADEN_API laden_status laden_sched_load_begin(laden_sched_t *sched);

/* Waits for a load begun with laden_sched_load_begin (or prepared) to
 * end, driving it on the calling thread, and returns its status (a
 * failure again on every call).  LADEN_OK at once if loaded. */
LADEN_API laden_status laden_sched_load_wait(laden_sched_t *sched);

/* Waits until block `block`'s bytes are in place (see
 * laden_sched_load_begin); LADEN_OK at once once loaded, the load's
 * failure if it failed.  A GPU-tier block's copy to the device has
 * finished when it returns. */
LADEN_API laden_status laden_sched_await(laden_sched_t *sched, uint32_t block);

/* laden_sched_await (block >= 0) or laden_sched_load_wait (block -1)
 * that waits at most about `timeout_ms`: it drives the load on the
 * calling thread a piece at a time and gives up between pieces once the
 * time has passed, *out_done 0 and LADEN_OK; *out_done 1 with the load's
 * status once the block is in place or the load ended.  Long waits are
 * then a loop of short calls, between which the caller can be
 * interrupted (Ctrl-C reaches Python only between calls into C). */
LADEN_API laden_status laden_sched_await_for(laden_sched_t *sched,
                                             int64_t block,
                                             uint32_t timeout_ms,
                                             int *out_done);

/* Stops a load in the background (laden_sched_load_begin): its step in
 * progress ends, the loading thread is joined, and the load fails for
 * good with LADEN_E_STATE "the load was cancelled": every later await,
 * enter of a streamed block and load wait returns that; the memory stays
 * until laden_sched_destroy (its addresses were handed out).  LADEN_OK
 * and nothing changed when no load is in progress.  Blocks for the end
 * of one step. */
LADEN_API laden_status laden_sched_load_cancel(laden_sched_t *sched);

/* 1 once every block is loaded (laden_sched_load, or the end of a load
 * begun with laden_sched_load_begin), else 0. */
LADEN_API int laden_sched_is_loaded(laden_sched_t *sched);

/* Cache schedules: loads one block's host copy, so that a caller holding
 * the source tensors can release each block's sources as soon as it is
 * copied (peak host memory: the model plus one block, not twice the
 * model).  Blocks may be loaded in any order; once all are, the schedule
 * is loaded.  On failure the block stays unloaded (the others are kept);
 * laden_sched_host_ptr works for loaded blocks before the rest. */
LADEN_API laden_status laden_sched_load_block(laden_sched_t *sched,
                                              uint32_t block);

/* Allocates the slots (lookahead + 1 of them, each the size of the largest
 * streamed block) and the disk tier's pinned staging buffers, and starts
 * loading the first blocks of the schedule so the first forward does not
 * wait for them.  lookahead 0 keeps the configured one.  After
 * laden_sched_stop it may be called again with another lookahead. */
/* Whether the schedule learns the order its blocks are entered in (on by
 * default).  Streamed blocks are prefetched by position, which starts as
 * the order they were added; learning, a pass that enters every streamed
 * block once (a block entered again ends it) in another order than the
 * positions' or their reverse makes that order the positions' at the
 * next enter: a new generation, since blocks then run from other slots
 * (whoever holds views of the slots takes them again; see
 * laden_sched_generation_word).  Not while a block is running.  A model
 * whose call order is fixed is relaid once, at its second pass, and
 * misses nothing from then on; one whose order changes is relaid at each
 * change.  Off: positions stay (what was half watched is dropped).  On
 * again is refused (LADEN_E_STATE) once a CUDA graph was captured from
 * the schedule, which turns it off for good. */
LADEN_API laden_status laden_sched_learn_order(laden_sched_t *sched, int on);

/* The address of the schedule's generation (laden_sched_stats'
 * generation), valid until laden_sched_destroy, for callers that check it
 * at every enter without a call (a relayout changes it inside
 * laden_sched_enter).  Read it on the thread that calls enter.  NULL for
 * NULL. */
LADEN_API const uint64_t *laden_sched_generation_word(laden_sched_t *sched);

LADEN_API laden_status laden_sched_start(laden_sched_t *sched,
                                         uint32_t lookahead);

/* Waits for the slots' copies and reads, then frees slots and staging.  The
 * GPU and RAM tiers stay.  No-op if not started. */
LADEN_API laden_status laden_sched_stop(laden_sched_t *sched);

/* Where block b's tensor i runs from: a device address (CPU device: a host
 * address), stable until laden_sched_stop.  GPU-tier blocks (and RAM-tier
 * blocks on the CPU device): valid after load; streamed blocks: after
 * start. */
LADEN_API laden_status laden_sched_tensor_ptr(laden_sched_t *sched,
                                              uint32_t block, uint32_t i,
                                              laden_devptr_t *out);

/* Where block b's tensor i is kept in host memory (RAM tier), or NULL with
 * LADEN_OK for other tiers.  Valid after load. */
LADEN_API laden_status laden_sched_host_ptr(laden_sched_t *sched,
                                            uint32_t block, uint32_t i,
                                            void **out);

/* 1 if the block runs from a slot (RAM tier on CUDA, disk tier). */
LADEN_API int laden_sched_is_streamed(laden_sched_t *sched, uint32_t block);

/* Before block b runs: see the header comment.  compute_stream is the
 * CUDA stream handle the block's kernels run on (0: the legacy default
 * stream); ignored on the CPU device, where enter blocks until the bytes
 * are in place.  Errors from reading (a file truncated or gone) are
 * returned here, for this block; the schedule stays usable. */
LADEN_API laden_status laden_sched_enter(laden_sched_t *sched, uint32_t block,
                                         uintptr_t compute_stream);

/* After block b's work has been enqueued on compute_stream.  Must be
 * called on the thread that entered it; it ends the hold of that enter
 * even when it fails. */
LADEN_API laden_status laden_sched_exit(laden_sched_t *sched, uint32_t block,
                                        uintptr_t compute_stream);

/* The CUDA stream `handle` is about to be destroyed: if the schedule holds
 * it (from an enter or exit on it) it waits for its work and lets it go.
 * No-op on the CPU device and for a stream it does not hold.  Works on a
 * closed schedule too (laden_sched_close), before it is destroyed. */
LADEN_API laden_status laden_sched_forget_stream(laden_sched_t *sched,
                                                 uintptr_t handle);

/* CUDA graphs of a streamed pass.  laden_sched_capture_begin, on a stream
 * that is capturing (the caller began it: laden_dev_graph_capture_begin,
 * or torch.cuda.graph), starts a pass that a graph can replay: the copy
 * stream joins the capture (an event forks it from compute_stream) and
 * the copies of the blocks the pass enters are captured.  The graph is
 * valid from the slot contents it was captured over: by default those
 * the slots hold at capture_begin (after an eager pass of the same order,
 * the first blocks are already there, as the pass leaves them for the
 * next), or with LADEN_CAPTURE_STANDALONE none (every block is copied by
 * the graph and prefetches stop at the schedule's end: slower when the
 * link is the bottleneck, but nothing in place is assumed; needed when
 * something changes a slot's bytes after it is filled, as merged
 * adapters do).  Enter and exit the blocks as usual, then
 * laden_sched_capture_end joins the copy stream back (before the caller
 * ends the capture) and returns the capture's description (free it with
 * laden_sched_capture_free).  Around each launch of the graph on a
 * stream: laden_sched_replay_begin copies in what the slots lack of the
 * graph's starting contents and orders the launch after the slots'
 * earlier work (LADEN_E_STATE if the slots were replaced since: capture
 * again), laden_sched_replay_end orders later work after it and takes the
 * slots as the graph leaves them.  Refused with LADEN_E_UNSUPPORTED on
 * the CPU device, for cached models and for disk-tier blocks (their reads
 * are threads); a block entered on a stream that is capturing outside
 * laden_sched_capture_begin is refused with LADEN_E_STATE (the graph
 * would lack its copies). */
#define LADEN_CAPTURE_STANDALONE 1u
typedef struct laden_sched_capture laden_sched_capture_t;
LADEN_API laden_status laden_sched_capture_begin(laden_sched_t *sched,
                                                 uintptr_t compute_stream,
                                                 uint32_t flags);
LADEN_API laden_status laden_sched_capture_end(laden_sched_t *sched,
                                               uintptr_t compute_stream,
                                               laden_sched_capture_t **out);
LADEN_API laden_status laden_sched_replay_begin(
    laden_sched_t *sched, uintptr_t compute_stream,
    const laden_sched_capture_t *capture);
LADEN_API laden_status laden_sched_replay_end(
    laden_sched_t *sched, uintptr_t compute_stream,
    const laden_sched_capture_t *capture);
/* Bytes one replay copies into the slots (0 for NULL). */
LADEN_API uint64_t laden_sched_capture_bytes(
    const laden_sched_capture_t *capture);
LADEN_API void laden_sched_capture_free(laden_sched_capture_t *capture);

/* Waits for every copy and read the schedule has in flight. */
LADEN_API laden_status laden_sched_synchronize(laden_sched_t *sched);

/* Streamed block b: a number that names the last time bytes were put in
 * its slot (it grows with every fill of any slot, and never repeats, also
 * across laden_sched_stop and _start), or 0 when the slot does not hold
 * b.  Whoever changes
 * a slot's bytes after enter (an adapter merged in place) records it, and
 * changes them again only once it grows: the next fill brings the
 * original bytes back. */
LADEN_API laden_status laden_sched_slot_fills(laden_sched_t *sched,
                                              uint32_t block, uint64_t *out);

/* Cache schedules: how many times block b's device copy was written from
 * its host copy (*out grows with every upload; 0 without a device copy).
 * Whoever changes the device copy in place records it, and after an
 * upload changes it again. */
LADEN_API laden_status laden_sched_copy_fills(laden_sched_t *sched,
                                              uint32_t block, uint64_t *out);

/* Cache schedules: writes block b's device copy from its host copy again
 * (after the model's earlier work), and waits: what was changed in place
 * is undone.  LADEN_E_STATE without a device copy.  On the CPU device a
 * resident block runs from its host copy in place (no second copy in
 * RAM): nothing to undo there. */
LADEN_API laden_status laden_sched_reupload(laden_sched_t *sched,
                                            uint32_t block);

/* Cache schedules: writes tensor i of block b into the block's device
 * copy from its host copy, which the caller changed (an optimizer stepped
 * a trainable model's host copy), without waiting: on CUDA the copy runs
 * after the work enqueued on compute_stream so far (which may still read
 * the old bytes) and compute_stream waits for it.  Nothing to do where
 * the block runs from its host copy in place (the CPU device).
 * LADEN_E_STATE without a device copy, LADEN_E_INVAL for a tensor the
 * block does not have. */
LADEN_API laden_status laden_sched_reupload_tensor(laden_sched_t *sched,
                                                   uint32_t block, uint32_t i,
                                                   uintptr_t compute_stream);

/* Cache schedules: makes sure block b's device copy is memory of its own
 * before the caller writes into it (an adapter merged in place).  On the
 * CPU device a resident block runs from its host copy, which laden never
 * changes: it gets a copy of its own, *out_made 1, its address changes
 * (a new generation: rebind the tensors) and its copy count grows; else
 * nothing happens, *out_made 0.  The copy lasts until the block's device
 * copy is taken away.  LADEN_E_STATE without a device copy; blocks for
 * the model's earlier work. */
LADEN_API laden_status laden_sched_own_copy(laden_sched_t *sched,
                                            uint32_t block, int *out_made);

/* Forgets what every slot not in use holds, so that each block is filled
 * again from its tier when next entered (the bytes changed in place
 * are replaced by the original ones). */
LADEN_API laden_status laden_sched_refill(laden_sched_t *sched);

/* Reads tensor i of a loaded block that is not streamed (its bytes in a
 * place of their own: the GPU tier, or the RAM tier on the CPU device)
 * from the checkpoint again, converted as at load, into its place, and
 * waits for it: what was changed there in place is undone.  LADEN_E_STATE
 * for a streamed block and for a tensor from host memory (it has no
 * source to read again). */
LADEN_API laden_status laden_sched_reread(laden_sched_t *sched,
                                          uint32_t block, uint32_t i);

LADEN_API laden_status laden_sched_stats(laden_sched_t *sched,
                                         laden_sched_stats_t *out);

/* ---- LADEN_SCHED_CACHE schedules ----------------------------------------
 * Residency changes only while the schedule is stopped: slots are laid out
 * for the blocks that stream. */

/* Gives block b a device copy of its own (resident = 1): allocated now and
 * filled by an asynchronous copy (see laden_sched_ready), after which the
 * block no longer streams; or takes it away (0), once the work recorded by
 * laden_sched_fence has finished, and the block streams again.  No-op if
 * the block already is so.  LADEN_E_STATE while started or for a schedule
 * without LADEN_SCHED_CACHE; an allocation failure changes nothing. */
LADEN_API laden_status laden_sched_set_resident(laden_sched_t *sched,
                                                uint32_t block, int resident);

/* As laden_sched_set_resident(b, 0), but the device region is handed to
 * the caller (*out_ptr, *out_bytes; 0 if b had none) instead of freed, to
 * give to a block of the same size (laden_sched_set_resident_at) or free
 * with laden_dev_mem_free: moving weights between models without a device
 * free and allocation. */
LADEN_API laden_status laden_sched_take_resident(laden_sched_t *sched,
                                                 uint32_t block,
                                                 laden_devptr_t *out_ptr,
                                                 uint64_t *out_bytes);

/* As laden_sched_set_resident(b, 1), in a device region of exactly the
 * block's device bytes (laden_sched_block_device_bytes) given by the
 * caller (from laden_sched_take_resident or
 * laden_dev_mem_alloc on the schedule's device); the schedule owns it from
 * then on. */
LADEN_API laden_status laden_sched_set_resident_at(laden_sched_t *sched,
                                                   uint32_t block,
                                                   laden_devptr_t ptr,
                                                   uint64_t bytes);

/* Keeps the schedule's device memory in a VBAR of `vram` (created by the
 * schedule, owned by it; vram must outlive it) and charges the slots to
 * vram's budget, so that weights, slots, other models and the elastic
 * allocator share one budget.
 *
 * A streaming schedule (no LADEN_SCHED_CACHE) takes its context before
 * laden_sched_load, which charges room for the slots first (the largest
 * block that may stream, lookahead + 1 times), then faults the GPU tier in
 * (LADEN_E_BUDGET if it has no room) and the VRAM tier in order, moving
 * the blocks that get no room to the RAM tier.  Their pages stay pinned
 * for the schedule's life (nothing else holds their bytes).  The work that
 * used them must have finished before laden_sched_destroy.  Taking
 * another context after laden_sched_plan makes the planned blocks AUTO
 * again: the context is an input of the plan.
 *
 * A cache schedule takes it once loaded, while it holds no device memory:
 * laden_sched_set_resident(b, 1) faults b's range in and copies it only
 * if its pages were replaced since it was last written, or fails with
 * LADEN_E_BUDGET if the range is offloaded (the caller streams the block);
 * laden_sched_set_resident(b, 0) unpins it, so its pages stay until the
 * budget needs them.  NULL: back to allocations.
 *
 * laden_sched_start then fails with LADEN_E_BUDGET if the context has no
 * room for the slots; laden_sched_stop gives their room back. */
LADEN_API laden_status laden_sched_use_vram(laden_sched_t *sched,
                                            laden_vram_t *vram);
/* Cache schedules in a VBAR: makes room in the VRAM context, in one
 * batch, for the pages that the blocks flagged in want[0..n) (n = the
 * block count) lack, so that laden_sched_set_resident only maps and
 * copies.  Evicts other VBARs' unpinned pages, lowest priority first (as
 * faults would, one at a time between the uploads).  No-op without a VBAR
 * or a budget, or if the room is there. */
LADEN_API laden_status laden_sched_reserve_vram(laden_sched_t *sched,
                                                const uint8_t *want,
                                                uint32_t n);
/* The schedule's VBAR, or NULL. */
LADEN_API laden_vbar_t *laden_sched_vbar(laden_sched_t *sched);

/* Block b's tier: as added or planned (LADEN_TIER_AUTO before
 * laden_sched_plan), and after load the one it got (a VRAM-tier block
 * reports LADEN_TIER_GPU or LADEN_TIER_RAM); -2 for a bad block. */
LADEN_API int laden_sched_block_tier(laden_sched_t *sched, uint32_t block);

/* 1 if block b has a device copy of its own. */
LADEN_API int laden_sched_is_resident(laden_sched_t *sched, uint32_t block);

/* Pins block b's host copy in place (1) or unpins it (0), after the copies
 * from it have finished.  No-op if already so. */
LADEN_API laden_status laden_sched_pin(laden_sched_t *sched, uint32_t block,
                                       int pinned);

/* 1 if block b's host copy is pinned. */
LADEN_API int laden_sched_is_pinned(laden_sched_t *sched, uint32_t block);

/* 1 if the schedule is a loaded LADEN_SCHED_CACHE schedule. */
LADEN_API int laden_sched_is_cache(laden_sched_t *sched);

/* The device the schedule runs on. */
LADEN_API int32_t laden_sched_device(laden_sched_t *sched);

/* Number of blocks. */
LADEN_API uint32_t laden_sched_block_count(laden_sched_t *sched);

/* Bytes of block b as laid out (its packed size: each tensor aligned to
 * 256 bytes), once described, before load too; 0 for a bad block. */
LADEN_API uint64_t laden_sched_block_bytes(laden_sched_t *sched,
                                           uint32_t block);

/* Bytes of block b's device copy in a cache schedule (LADEN_SCHED_CACHE),
 * once loaded: laden_sched_block_bytes, but with its lossless tensors
 * decoded (a cache keeps them coded in the host copy and the slots,
 * decoded in device copies); laden_sched_block_bytes for any other
 * schedule or before the load; 0 for a bad block. */
LADEN_API uint64_t laden_sched_block_device_bytes(laden_sched_t *sched,
                                                  uint32_t block);

/* Bytes of the expansion workspace block b needs while it runs from a
 * slot (its compact and lossless tensors expanded); 0 for a bad block or
 * one without such tensors.  The workspace is the largest of these over
 * the blocks that expand at their enter. */
LADEN_API uint64_t laden_sched_block_workspace_bytes(laden_sched_t *sched,
                                                     uint32_t block);

/* Device memory beside the device copies that uploading block b into its
 * device copy takes while the uploads run: a CUDA cache schedule decodes
 * a block's lossless tensors through two buffers of its largest blob,
 * made at the first upload that needs them, shared by the blocks (what
 * uploads need is the largest of these over the blocks uploaded, not
 * their sum) and freed when the uploads end (laden_sched_start, before
 * it makes the slots; laden_sched_ready; laden_sched_stop).  0 for a
 * block without lossless tensors, any other schedule, before the load,
 * or a bad block.  The cache engine counts it in an activation's device
 * memory, so that the uploads stay within its budget. */
LADEN_API uint64_t laden_sched_block_upload_bytes(laden_sched_t *sched,
                                                  uint32_t block);

/* Bytes block b takes on the RAM tier: before the load what the plan
 * counts (tensors marked lossless, laden_sched_mark_lossless, at the
 * coded sizes estimated from samples of the file; the others as stored),
 * after it laden_sched_block_bytes (the true coded sizes); 0 for a bad
 * block. */
LADEN_API uint64_t laden_sched_block_ram_bytes(laden_sched_t *sched,
                                               uint32_t block);

/* Block b's state as the plan and the load left it: *tier what
 * laden_sched_block_tier says, *size_bytes what laden_sched_block_bytes
 * says, *flags LADEN_SCHED_BLOCK_* bits.  Any may be NULL.  LADEN_E_INVAL
 * for a bad schedule or block (outputs zeroed).  Does not hold the
 * schedule: call it from the thread that loads it, or after the load. */
#define LADEN_SCHED_BLOCK_OFFLOADED 1u /* chosen for the device (VRAM
                                        * tier), the VRAM context had no
                                        * room at load: streams from RAM */
#define LADEN_SCHED_BLOCK_STREAMED 2u  /* runs from a slot */
LADEN_API laden_status laden_sched_block_state(laden_sched_t *sched,
                                               uint32_t block, int32_t *tier,
                                               uint64_t *size_bytes,
                                               uint32_t *flags);

/* Block b's tensor i is kept compact (fp8 codes, GGUF blocks, bf16 for
 * a float32 model, ...) and expanded to `compute` (F32, F16 or BF16) by
 * laden_sched_enter, on the stream the block is entered on, before its
 * block runs: the caller binds the view laden_sched_expanded_at gives
 * and does nothing per tensor.  The tensor's stored dtype (as added) is
 * what is expanded: a GGUF block type, F8_E4M3 or F8_E5M2, F16, BF16 or
 * F32.  fp8 scales: a tensor quantized to F8_E4M3 on load carries its own
 * row scales (pass LADEN_SCALE_NONE); the checkpoint's fp8 names its
 * scale by `scale`, the index of a tensor of the same block added before
 * this call (F32, F16 or BF16: one not F32 is widened into the workspace
 * first), applied as `kind` says, `cols` the elements per row (ROW,
 * TILE128); LADEN_SCHED_NO_SCALE and LADEN_SCALE_NONE for none.
 * The workspace is one for all blocks, ordered by the one stream blocks
 * are entered on: enter consecutive blocks with compact tensors on one
 * stream.
 * laden_sched_start then also allocates the expansion workspace: as many
 * bytes as the block with the most expanded bytes needs (each tensor
 * aligned to 256 bytes), inside the schedule's VRAM context, freed with
 * the slots; the plan counts it as always resident; it fails with
 * laden_expand_ready's error where the device cannot expand.  Before the
 * load; once per tensor.  LADEN_E_INVAL for a bad schedule, block,
 * tensor, dtype (compute not F32/F16/BF16, a stored dtype laden_expand
 * does not take) or scale (not in the block, not a float, a count or
 * cols that do not fit the kind, a scale on what is not fp8),
 * LADEN_E_STATE after the load or a second time. */
#define LADEN_SCHED_NO_SCALE UINT32_MAX
LADEN_API laden_status laden_sched_set_expanded(laden_sched_t *sched,
                                                uint32_t block, uint32_t i,
                                                laden_dtype compute,
                                                uint64_t cols, uint32_t scale,
                                                laden_scale_kind kind);

/* Where tensor i of block b is expanded while its block runs: *ptr its
 * address in the workspace, *size_bytes its expanded bytes.  The
 * workspace is one for all blocks (they run one at a time): what is
 * there is only the entered block's.  LADEN_E_INVAL for a bad schedule,
 * block or tensor or one not laden_sched_set_expanded; LADEN_E_STATE
 * before laden_sched_start (outputs zeroed). */
LADEN_API laden_status laden_sched_expanded_at(laden_sched_t *sched,
                                               uint32_t block, uint32_t i,
                                               laden_devptr_t *ptr,
                                               uint64_t *size_bytes);

/* Block b's tensor i's value as its model computes with it, as `dtype`,
 * into host memory dst (dst_bytes: its elements in dtype): read from
 * where laden keeps it -- its host copy, its own device copy (copied
 * back), or the checkpoint (the disk tier keeps tensors as stored) -- and
 * expanded as laden_sched_enter expands it (fp8 times its scale, GGUF
 * blocks, bf16 widened), or converted, on the calling thread.  For a
 * state_dict entry whose module holds nothing.  LADEN_E_INVAL for a bad
 * schedule, block, tensor or size; LADEN_E_STATE before the load, while
 * its block is still loading, or for a tensor laden keeps nowhere it can
 * read; LADEN_E_UNSUPPORTED for a conversion laden does not make (to F32,
 * F16 or BF16, or a dtype to itself); the reader's and the device's
 * errors (LADEN_E_CHANGED: the file changed under it). */
LADEN_API laden_status laden_sched_tensor_value(laden_sched_t *sched,
                                                uint32_t block, uint32_t i,
                                                laden_dtype dtype, void *dst,
                                                uint64_t dst_bytes);

/* How block b's tensor i is laid out where laden keeps it: *size_bytes
 * its bytes (the length of a view at laden_sched_tensor_ptr or
 * laden_sched_host_ptr), *scale_offset_bytes where its float32 scales
 * start inside them (a tensor quantized to F8_E4M3 on load: one scale per
 * row after the codes) or 0 when it has none, *rows the number of those
 * scales (0 without).  Any may be NULL.  Valid once the tensor is added;
 * does not hold the schedule (the layout does not change after load).
 * For the first tensor of a joined run (laden_sched_join_tensor) the size
 * is the whole run's.
 * LADEN_E_INVAL for a bad schedule, block or tensor (outputs zeroed). */
LADEN_API laden_status laden_sched_tensor_layout(laden_sched_t *sched,
                                                 uint32_t block, uint32_t i,
                                                 uint64_t *size_bytes,
                                                 uint64_t *scale_offset_bytes,
                                                 uint64_t *rows);

/* The bytes of a piece when a schedule's rest (the tensors outside the
 * blocks) is added as several blocks instead of one: a cache schedule
 * does so, so that a model gives up device memory in steps, not whole. */
#define LADEN_SCHED_PIECE_BYTES (256ull << 20)

/* Splits n tensors of bytes[k] bytes, in order, into pieces of at most
 * max_bytes (0: LADEN_SCHED_PIECE_BYTES) each; a tensor larger than that
 * is a piece of its own.  piece_of[k] (n entries, the caller's) receives
 * tensor k's piece, *npieces the number of pieces (0 when n is 0).
 * LADEN_E_INVAL for NULL arrays with n > 0; a sum that would overflow
 * starts a new piece.  Pure; any thread. */
LADEN_API laden_status laden_sched_pieces(const uint64_t *bytes, uint32_t n,
                                          uint64_t max_bytes,
                                          uint32_t *piece_of,
                                          uint32_t *npieces);

/* What a checkpoint tensor is kept as between load and use
 * (laden_sched_storage_for). */
#define LADEN_STORE_PLAIN 0u       /* the dtype it runs in, converted on load */
#define LADEN_STORE_CHECKPOINT_FP8 1u /* the checkpoint's fp8, expanded
                                        * (times its scale) when it runs */
#define LADEN_STORE_BLOCKS 2u      /* GGUF blocks as stored, expanded when
                                    * it runs */
#define LADEN_STORE_FP8 3u         /* quantized to F8_E4M3 on load, one
                                    * float32 scale per row */
#define LADEN_STORE_BF16 4u        /* kept in BF16, widened when it runs */

/* Facts about the tensor and the caller, for laden_sched_storage_for. */
#define LADEN_STORE_COMPACT 1u   /* the caller expands compact forms when a
                                  * block runs (streaming; a plain load
                                  * decodes them on load) */
#define LADEN_STORE_EXPANDS_BLOCKS 2u /* the device can expand GGUF blocks
                                       * where blocks run */
#define LADEN_STORE_IN_BLOCK 4u  /* the tensor belongs to a block (only a
                                  * block's hook expands) */
#define LADEN_STORE_PARAM 8u     /* a parameter, not a buffer */
#define LADEN_STORE_SCALED 16u   /* fp8 with a scale tensor of its own */
#define LADEN_STORE_ASK_FP8 32u  /* storage "fp8" asked */
#define LADEN_STORE_ASK_BF16 64u /* storage "bf16" asked */
/* Large 2-D weights only are quantized by LADEN_STORE_ASK_FP8: smaller
 * tensors (norms, biases) cost little and lose the most. */
#define LADEN_STORE_FP8_MIN_ELEMENTS (1ull << 16)

/* How a checkpoint tensor of dtype src is kept for a model that runs it
 * in dtype want (a value outside laden_dtype: a dtype laden has no name
 * for), given its rank, element count and LADEN_STORE_* flags: *store
 * receives a LADEN_STORE_* kind.  The one place that says which dtypes
 * load into which and when a compact form is kept.  LADEN_E_UNSUPPORTED,
 * with the reason as the message (the caller names the tensor), when the
 * checkpoint's dtype cannot become want: GGUF blocks into anything but a
 * floating dtype, a conversion other than between F32, F16 and BF16, an
 * fp8 tensor with a scale outside the blocks.  Pure; any thread. */
LADEN_API laden_status laden_sched_storage_for(laden_dtype src,
                                               laden_dtype want,
                                               uint32_t ndim, uint64_t nelem,
                                               uint32_t flags,
                                               uint32_t *store);

/* Makes compute_stream wait until every copy laden_sched_set_resident
 * started has finished (the CPU device: waits for them).  Where uploads
 * decoded lossless tensors (CUDA), it first waits for them on the host
 * and gives their upload buffers back; LADEN_E_CORRUPT, naming the block
 * and tensor, if a decode found a blob's codes wrong (from then on every
 * call is refused until the schedule is loaded again). */
LADEN_API laden_status laden_sched_ready(laden_sched_t *sched,
                                         uintptr_t compute_stream);

/* Records that the model's work so far was enqueued on compute_stream: a
 * device copy taken away later is freed only after that work. */
LADEN_API laden_status laden_sched_fence(laden_sched_t *sched,
                                         uintptr_t compute_stream);

/* Converts n elements of F32, F16, BF16, fp8 (F8_E4M3, F8_E5M2) or a GGUF
 * block type (n whole blocks; the gguf reference's values) to F32, F16 or
 * BF16, rounding once to nearest even.  LADEN_E_UNSUPPORTED for other
 * pairs. */
LADEN_API laden_status laden_sched_convert(laden_dtype from, const void *src,
                                           laden_dtype to, void *dst,
                                           uint64_t n);

#ifdef __cplusplus
}
#endif
#endif
