#include "test.h"

#include "laden/lossless.h"

#include <stddef.h>

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
#include "laden/vram.h"

/* The structs the tables must describe, with the compiler's answers written
 * here independently of src/api/abi.c. */
#define ONE(T) {#T, sizeof(struct T), _Alignof(struct T)}
static const struct {
    const char *name;
    size_t size, align;
} want[] = {
    ONE(laden_st_tensor),     ONE(laden_dev_info),
    ONE(laden_io_config),     ONE(laden_io_ways),
    ONE(laden_sched_config),
    ONE(laden_sched_stats),   ONE(laden_vram_info),
    ONE(laden_vbar_info),     ONE(laden_elastic_stats),
    ONE(laden_cache_evict),   ONE(laden_cache_host_evict), ONE(laden_cache_info),
    ONE(laden_cache_stats),   ONE(laden_cache_activation),
    ONE(laden_plan_input),    ONE(laden_plan_result),
    ONE(laden_plan_readings), ONE(laden_plan_load_options),
    ONE(laden_host_stats),    ONE(laden_pinned_pool_stats),
    ONE(laden_gguf_tensor),
    ONE(laden_gguf_kv),       ONE(laden_trace_result),
    ONE(laden_shm_entry),     ONE(laden_lossless_info),
    ONE(laden_lossless_cache_stats), ONE(laden_lossless_cache_entry),
};
#undef ONE

TEST(abi_lists_every_struct_once)
{
    uint32_t n = 0;
    while (laden_abi_struct_name(n))
        n++;
    CHECK_EQ(n, sizeof want / sizeof want[0]);
    for (uint32_t i = 0; i < n; i++) {
        int found = 0;
        for (size_t j = 0; j < sizeof want / sizeof want[0]; j++)
            found += strcmp(laden_abi_struct_name(i), want[j].name) == 0;
        if (found != 1)
            fprintf(stderr, "struct %s\n", laden_abi_struct_name(i));
        CHECK_EQ(found, 1);
    }
    CHECK_EQ(laden_abi_struct_name(UINT32_MAX), NULL);
}

TEST(abi_sizes_and_fields_match_the_compiler)
{
    for (size_t j = 0; j < sizeof want / sizeof want[0]; j++) {
        const char *s = want[j].name;
        uint64_t size = 0;
        uint32_t nf = 0;
        CHECK_OK(laden_abi_struct(s, &size, &nf));
        CHECK_EQ(size, want[j].size);
        CHECK(nf > 0);
        uint64_t end = 0; /* end of the previous field */
        for (uint32_t i = 0; i < nf; i++) {
            const char *f = NULL;
            uint64_t off = 0, fsize = 0;
            CHECK_OK(laden_abi_field(s, i, &f, &off, &fsize));
            CHECK(f && *f);
            CHECK(fsize > 0);
            /* In declaration order, not overlapping, inside the struct. */
            if (off < end)
                fprintf(stderr, "%s.%s at %llu overlaps or precedes the "
                        "previous field (ends at %llu)\n", s, f,
                        (unsigned long long)off, (unsigned long long)end);
            CHECK(off >= end);
            CHECK(off + fsize <= size);
            /* Padding before a field is less than its alignment, which is
             * at most its size and at most the struct's: a larger hole is
             * a field the table leaves out. */
            uint64_t align = fsize < want[j].align ? fsize : want[j].align;
            if (off - end >= align)
                fprintf(stderr, "%s: %llu bytes unaccounted for before "
                        "%s\n", s, (unsigned long long)(off - end), f);
            CHECK(off - end < align);
            for (uint32_t k = 0; k < i; k++) {
                const char *g = NULL;
                uint64_t o2, s2;
                CHECK_OK(laden_abi_field(s, k, &g, &o2, &s2));
                CHECK(strcmp(f, g) != 0);
            }
            end = off + fsize;
        }
        /* Tail padding is less than the struct's alignment. */
        if (size - end >= want[j].align)
            fprintf(stderr, "%s: %llu bytes unaccounted for at the end\n", s,
                    (unsigned long long)(size - end));
        CHECK(size - end < want[j].align);
    }
}

static void field_is(const char *s, const char *name, size_t off,
                     size_t size)
{
    uint64_t n = 0;
    uint32_t nf = 0;
    CHECK_OK(laden_abi_struct(s, &n, &nf));
    for (uint32_t i = 0; i < nf; i++) {
        const char *f;
        uint64_t o, z;
        CHECK_OK(laden_abi_field(s, i, &f, &o, &z));
        if (strcmp(f, name) == 0) {
            CHECK_EQ(o, off);
            CHECK_EQ(z, size);
            return;
        }
    }
    fprintf(stderr, "%s has no field %s\n", s, name);
    CHECK(0);
}

#define FIELD_IS(T, f) \
    field_is(#T, #f, offsetof(struct T, f), sizeof(((struct T *)0)->f))

TEST(abi_spot_checks)
{
    FIELD_IS(laden_plan_input, block_flags);
    FIELD_IS(laden_plan_input, host_device);
    FIELD_IS(laden_plan_input, disk_bytes_per_s);
    FIELD_IS(laden_plan_result, ram_limit_bytes);
    FIELD_IS(laden_plan_result, warnings);
    FIELD_IS(laden_dev_info, name);
    FIELD_IS(laden_sched_stats, offloaded_bytes);
    FIELD_IS(laden_cache_activation, offloaded_blocks);
    CHECK_EQ(sizeof(((struct laden_dev_info *)0)->name), 128);
}

TEST(abi_refuses_unknown_names_and_bad_indexes)
{
    uint64_t size = 7, off = 7;
    uint32_t nf = 7;
    const char *f = "x";
    CHECK_STATUS(laden_abi_struct("laden_nope", &size, &nf), LADEN_E_NOTFOUND);
    CHECK_CONTAINS(laden_last_error(), "laden_nope");
    CHECK_EQ(size, 0);
    CHECK_EQ(nf, 0);
    /* The typedef name is not the tag. */
    CHECK_STATUS(laden_abi_struct("laden_st_tensor_t", &size, &nf),
                 LADEN_E_NOTFOUND);
    CHECK_STATUS(laden_abi_struct("", &size, &nf), LADEN_E_NOTFOUND);
    CHECK_STATUS(laden_abi_struct(NULL, &size, &nf), LADEN_E_INVAL);
    CHECK_STATUS(laden_abi_struct("laden_plan_input", NULL, &nf),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_abi_struct("laden_plan_input", &size, NULL),
                 LADEN_E_INVAL);
    CHECK_EQ(size, 0);

    size = 7;
    CHECK_STATUS(laden_abi_field("laden_nope", 0, &f, &off, &size),
                 LADEN_E_NOTFOUND);
    CHECK_EQ(f, NULL);
    CHECK_EQ(off, 0);
    CHECK_EQ(size, 0);
    CHECK_OK(laden_abi_struct("laden_io_config", &size, &nf));
    CHECK_EQ(nf, 3);
    f = "x";
    CHECK_STATUS(laden_abi_field("laden_io_config", nf, &f, &off, &size),
                 LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "laden_io_config has 3 fields");
    CHECK_EQ(f, NULL);
    CHECK_EQ(size, 0);
    CHECK_STATUS(laden_abi_field("laden_io_config", UINT32_MAX, &f, &off,
                                 &size),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_abi_field("laden_io_config", 0, NULL, &off, &size),
                 LADEN_E_INVAL);
    CHECK_STATUS(laden_abi_field(NULL, 0, &f, &off, &size), LADEN_E_INVAL);
    CHECK_OK(laden_abi_field("laden_io_config", 2, &f, &off, &size));
    CHECK(strcmp(f, "direct") == 0);
}

TEST(abi_version_is_the_header_s)
{
    CHECK_EQ(laden_abi_version(), LADEN_ABI_VERSION);
    CHECK(laden_abi_version() > 0);
}

static int64_t const_of(const char *name, int32_t *is_unsigned)
{
    int64_t v = 7;
    CHECK_OK(laden_abi_const(name, &v, is_unsigned));
    return v;
}

/* The table's values against the macros and enums, read here from the
 * headers independently of src/api/abi.c. */
TEST(abi_constants_are_the_headers)
{
    int32_t u = 7;
    CHECK_EQ(const_of("LADEN_TIER_AUTO", &u), LADEN_TIER_AUTO);
    CHECK_EQ(u, 0);
    CHECK_EQ(const_of("LADEN_TIER_AUTO", NULL), -1);
    CHECK_EQ(const_of("LADEN_TIER_VRAM", &u), LADEN_TIER_VRAM);
    CHECK_EQ(const_of("LADEN_DEVICE_CPU", &u), LADEN_DEVICE_CPU);
    CHECK_EQ(u, 0);
    CHECK_EQ(const_of("LADEN_LOOKAHEAD_DEFAULT", &u), LADEN_LOOKAHEAD_DEFAULT);
    CHECK_EQ(u, 1);
    CHECK_EQ(const_of("LADEN_LOOKAHEAD_MAX", &u), LADEN_LOOKAHEAD_MAX);
    CHECK_EQ(const_of("LADEN_CACHE_STREAMING", &u), LADEN_CACHE_STREAMING);
    CHECK_EQ(const_of("LADEN_COPY_D2H_PINNED", &u), LADEN_COPY_D2H_PINNED);
    CHECK_EQ(const_of("LADEN_CAPTURE_STANDALONE", &u),
             LADEN_CAPTURE_STANDALONE);
    CHECK_EQ(const_of("LADEN_SHARE_FELL_BACK", &u), LADEN_SHARE_FELL_BACK);
    CHECK_EQ(const_of("LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE", &u),
             LADEN_PLAN_WARN_MAX_VRAM_ABOVE_FREE);
    CHECK_EQ(const_of("LADEN_GRADS_PINNED", &u), LADEN_GRADS_PINNED);
    /* UINT64_MAX: its bits, flagged unsigned. */
    int64_t v = const_of("LADEN_PLAN_AUTO", &u);
    CHECK_EQ(u, 1);
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    CHECK(bits == LADEN_PLAN_AUTO);
    CHECK_EQ(v, -1);
}

TEST(abi_constants_are_listed_once_by_name)
{
    uint32_t n = laden_abi_const_count();
    CHECK(n >= 20);
    for (uint32_t i = 0; i < n; i++) {
        const char *name = NULL;
        int64_t v = 0, w = 0;
        int32_t u = -1, uw = -1;
        CHECK_OK(laden_abi_const_at(i, &name, &v, &u));
        CHECK(name && strncmp(name, "LADEN_", 6) == 0);
        CHECK(u == 0 || u == 1);
        /* By name, the same; and no other entry has the name. */
        CHECK_OK(laden_abi_const(name, &w, &uw));
        CHECK_EQ(w, v);
        CHECK_EQ(uw, u);
        for (uint32_t k = 0; k < i; k++) {
            const char *other = NULL;
            CHECK_OK(laden_abi_const_at(k, &other, NULL, NULL));
            CHECK(strcmp(name, other) != 0);
        }
    }
}

TEST(abi_constants_refuse_unknown_names_and_bad_indexes)
{
    const char *name = "x";
    int64_t v = 7;
    int32_t u = 7;
    uint32_t n = laden_abi_const_count();
    CHECK_STATUS(laden_abi_const_at(n, &name, &v, &u), LADEN_E_INVAL);
    CHECK_CONTAINS(laden_last_error(), "constants are listed");
    CHECK_EQ(name, NULL);
    CHECK_EQ(v, 0);
    CHECK_EQ(u, 0);
    CHECK_STATUS(laden_abi_const_at(UINT32_MAX, &name, &v, &u),
                 LADEN_E_INVAL);
    v = u = 7;
    CHECK_STATUS(laden_abi_const_at(0, NULL, &v, &u), LADEN_E_INVAL);
    CHECK_EQ(v, 0);
    CHECK_EQ(u, 0);
    v = u = 7;
    CHECK_STATUS(laden_abi_const("LADEN_NOPE", &v, &u), LADEN_E_NOTFOUND);
    CHECK_CONTAINS(laden_last_error(), "LADEN_NOPE");
    CHECK_EQ(v, 0);
    CHECK_EQ(u, 0);
    /* C names only: the binding's short name is not one. */
    CHECK_STATUS(laden_abi_const("TIER_GPU", &v, &u), LADEN_E_NOTFOUND);
    CHECK_STATUS(laden_abi_const("", &v, &u), LADEN_E_NOTFOUND);
    CHECK_STATUS(laden_abi_const(NULL, &v, &u), LADEN_E_INVAL);
    CHECK_STATUS(laden_abi_const("LADEN_TIER_GPU", NULL, &u), LADEN_E_INVAL);
    CHECK_EQ(u, 0);
}
