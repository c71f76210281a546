/* What the planner plans from: the readings, taken and rounded; the
 * link and drive probes; stream_load's budgets.  See include/laden/plan.h.
 * These are the plan layer's rules so that the CLI, the demo, the
 * planner's Python front and stream_load do not each keep their own. */
#include "laden/dev.h"
#include "laden/io.h"
#include "laden/plan.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>

#include "../core/internal.h"

static uint64_t round_down(uint64_t n)
{
    return n / LADEN_PLAN_READING_STEP * LADEN_PLAN_READING_STEP;
}

void laden_plan_readings_from(uint64_t vram_free, uint64_t vram_total,
                              uint64_t ram_free, uint64_t ram_total,
                              laden_plan_readings *out)
{
    if (!out)
        return;
    out->vram_free_bytes = round_down(vram_free);
    out->vram_total_bytes = vram_total;
    out->ram_free_bytes = round_down(ram_free);
    out->ram_free_exact_bytes = ram_free;
    out->ram_total_bytes = ram_total;
}

laden_status laden_plan_read(int32_t device, laden_plan_readings *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_plan_read: out is NULL");
    memset(out, 0, sizeof *out);
    uint64_t vf = 0, vt = 0, rf = 0, rt = 0;
    laden_status s = LADEN_OK;
    if (device != LADEN_DEVICE_CPU)
        s = laden_dev_mem_info(device, &vf, &vt);
    if (!s)
        s = laden_dev_mem_info(LADEN_DEVICE_CPU, &rf, &rt);
    if (!s)
        laden_plan_readings_from(vf, vt, rf, rt, out);
    return s;
}

/* Probes already taken in this process: a link's rate per device, a
 * drive's per file (its device and inode), so that planning again costs
 * no second measurement.  A small table; a full one forgets the oldest. */
enum { PROBES = 32 };
static struct probe {
    uint64_t key[2];
    double rate;
} probes[PROBES];
static unsigned nprobes, next_probe;
/* The table, and one measurement at a time: two at once would each see a
 * shared link or drive, and the skewed first one would be kept. */
static pthread_mutex_t measure_mu = PTHREAD_MUTEX_INITIALIZER;

/* Both called with measure_mu held. */
static bool probe_known(uint64_t a, uint64_t b, double *out)
{
    for (unsigned k = 0; k < nprobes; k++)
        if (probes[k].key[0] == a && probes[k].key[1] == b) {
            *out = probes[k].rate;
            return true;
        }
    return false;
}

static void probe_keep(uint64_t a, uint64_t b, double rate)
{
    probes[next_probe] = (struct probe){{a, b}, rate};
    next_probe = (next_probe + 1) % PROBES;
    if (nprobes < PROBES)
        nprobes++;
}

laden_status laden_plan_probe_h2d(int32_t device, double *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_plan_probe_h2d: out is "
                           "NULL");
    *out = 0.0;
    /* Keys of links: UINT64_MAX beside the device, no inode is that. */
    if (device == LADEN_DEVICE_CPU)
        return LADEN_OK;
    laden_status s = LADEN_OK;
    pthread_mutex_lock(&measure_mu);
    if (!probe_known((uint64_t)(uint32_t)device, UINT64_MAX, out) &&
        !(s = laden_dev_measure_copy(device, LADEN_COPY_H2D_PINNED,
                                     LADEN_PLAN_PROBE_BYTES,
                                     LADEN_PLAN_PROBE_REPEATS, out)))
        probe_keep((uint64_t)(uint32_t)device, UINT64_MAX, *out);
    pthread_mutex_unlock(&measure_mu);
    return s;
}

laden_status laden_plan_probe_disk(const char *path, double *out)
{
    if (!out || !path)
        return laden__fail(LADEN_E_INVAL, "laden_plan_probe_disk: NULL "
                           "argument");
    *out = 0.0;
    /* A drive that cannot be measured (no such regular file, a file on a
     * pipe, a filesystem without direct reads) only costs the plan its
     * prediction. */
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode))
        return LADEN_OK;
    pthread_mutex_lock(&measure_mu);
    if (!probe_known((uint64_t)sb.st_dev, (uint64_t)sb.st_ino, out)) {
        if (laden_io_measure_file(path, LADEN_PLAN_DISK_PROBE_BYTES, out))
            *out = 0.0;
        else
            probe_keep((uint64_t)sb.st_dev, (uint64_t)sb.st_ino, *out);
    }
    pthread_mutex_unlock(&measure_mu);
    return LADEN_OK;
}

/* The free RAM a shared load plans with: the segments it would attach to
 * count as free, at most the total. */
static uint64_t credited_ram(const laden_plan_readings *r, uint64_t shared)
{
    uint64_t free_b;
    if (!laden__add_u64(r->ram_free_exact_bytes, shared, &free_b) ||
        free_b > r->ram_total_bytes)
        free_b = r->ram_total_bytes;
    return round_down(free_b);
}

laden_status laden_plan_load_input(const laden_plan_load_options *opt,
                                   const laden_plan_readings *readings,
                                   laden_plan_input *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!opt || !out)
        return laden__fail(LADEN_E_INVAL, "laden_plan_load_input: NULL "
                           "argument");
    bool cpu = opt->device == LADEN_DEVICE_CPU;
    bool vram_budget = opt->vram_budget_bytes != LADEN_PLAN_AUTO;
    if (cpu && vram_budget)
        return laden__fail(LADEN_E_INVAL, "vram_budget %s: the model goes "
                           "to the CPU, which has no VRAM; ram_budget "
                           "bounds the host memory of the streamed blocks",
                           laden__bytes(opt->vram_budget_bytes).s);
    laden_plan_readings taken;
    if (!readings) {
        laden_status s = laden_plan_read(opt->device, &taken);
        if (s)
            return s;
        readings = &taken;
    }
    out->vram_free_bytes = cpu           ? 0
                           : vram_budget ? opt->vram_budget_bytes
                                         : readings->vram_free_bytes;
    out->reserve_bytes = 0; /* the caller's budget is the whole budget */
    out->ram_total_bytes = readings->ram_total_bytes;
    out->ram_budget_bytes = opt->ram_budget_bytes;
    out->ram_free_bytes = opt->ram_budget_bytes == LADEN_PLAN_AUTO &&
                                  opt->shared_bytes
                              ? credited_ram(readings, opt->shared_bytes)
                              : readings->ram_free_bytes;
    out->min_free_ram_bytes = LADEN_PLAN_AUTO;
    out->resident_blocks = vram_budget || opt->vram_context_budget ? -1 : 0;
    out->lookahead = opt->lookahead;
    out->host_device = cpu;
    return LADEN_OK;
}
