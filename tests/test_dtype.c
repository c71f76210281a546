/* core's dtype facts and scalar conversions (src/core/dtype.c,
 * src/core/dtype_internal.h): the one table every layer reads, checked
 * against the format readers' public views of it, and each conversion
 * checked on every code of the narrow formats. */
#include <math.h>

#include "test.h"

#include "core/internal.h"
#include "laden/dtype.h"
#include "laden/gguf.h"

TEST(dtype_names_round_trip)
{
    for (unsigned i = 0; i < LADEN_DTYPE_COUNT; i++) {
        laden_dtype d = (laden_dtype)i, back = LADEN_DTYPE_COUNT;
        const char *name = laden_dtype_name(d);
        CHECK(name != NULL);
        bool named = laden__dtype_of_name(name, &back);
        /* A safetensors header names every dtype but the block types. */
        CHECK_EQ(named, laden_dtype_bits(d) != 0);
        if (named)
            CHECK_EQ(back, d);
    }
    laden_dtype d = LADEN_DTYPE_F32;
    CHECK(!laden__dtype_of_name("bf16", &d)); /* case matters */
    CHECK(!laden__dtype_of_name("", &d));
    CHECK(!laden__dtype_of_name("Q4_K", &d));
    CHECK_EQ(d, LADEN_DTYPE_F32); /* untouched when false */
    CHECK(laden_dtype_name(LADEN_DTYPE_COUNT) == NULL);
    CHECK(laden_dtype_name((laden_dtype)-1) == NULL);
    CHECK_EQ(laden_dtype_bits(LADEN_DTYPE_COUNT), 0);
}

/* Core's ggml table is what the gguf layer reports, and every dtype with
 * a ggml number maps there and back with the same block. */
TEST(dtype_ggml_table)
{
    unsigned known = 0;
    for (uint32_t t = 0; t < 64; t++) {
        const char *name = NULL;
        uint32_t e = 0, b = 0, ge = 0, gb = 0;
        bool is = laden__ggml_type(t, &name, &e, &b);
        CHECK(laden_gguf_type_name(t) == (is ? name : NULL));
        if (!is) {
            CHECK_STATUS(laden_gguf_type_block(t, &ge, &gb), LADEN_E_DTYPE);
            continue;
        }
        known++;
        CHECK(e >= 1 && b >= 1);
        CHECK_OK(laden_gguf_type_block(t, &ge, &gb));
        CHECK_EQ(ge, e);
        CHECK_EQ(gb, b);
        laden_dtype d;
        if (laden_dtype_of_ggml(t, &d) == LADEN_OK) {
            CHECK_EQ(strcmp(laden_dtype_name(d), name), 0);
            CHECK_OK(laden_dtype_block(d, &ge, &gb));
            CHECK_EQ(ge, e);
            CHECK_EQ(gb, b);
        } else {
            CHECK_CONTAINS(laden_last_error(), name);
        }
    }
    CHECK_EQ(known, 32);
    CHECK(laden__ggml_type(12, NULL, NULL, NULL)); /* outputs optional */
    for (unsigned i = 0; i < LADEN_DTYPE_COUNT; i++) {
        laden_dtype d = (laden_dtype)i, back;
        uint32_t g = laden_ggml_of_dtype(d);
        if (g == UINT32_MAX) {
            CHECK(laden_dtype_bits(d) != 0); /* every block type has one */
            continue;
        }
        CHECK_OK(laden_dtype_of_ggml(g, &back));
        CHECK_EQ(back, d);
    }
    laden_dtype d;
    CHECK_STATUS(laden_dtype_of_ggml(9, &d), LADEN_E_UNSUPPORTED);
    CHECK_CONTAINS(laden_last_error(), "Q8_1 (9)");
    CHECK_STATUS(laden_dtype_of_ggml(4, &d), LADEN_E_UNSUPPORTED);
    CHECK_CONTAINS(laden_last_error(), "unknown (4)");
    uint32_t e, b;
    CHECK_STATUS(laden_dtype_block(LADEN_DTYPE_COUNT, &e, &b), LADEN_E_DTYPE);
    CHECK_STATUS(laden_dtype_block(LADEN_DTYPE_F32, NULL, &b), LADEN_E_INVAL);
}

static float f32_of(uint32_t u) { return laden__f32_of_bits(u); }

/* Every half decodes exactly and rounds back to itself; ties go to even
 * and overflow to infinity at 65520. */
TEST(dtype_f16_every_code)
{
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = laden__f32_of_f16((uint16_t)h);
        bool nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
        CHECK_EQ(isnan(f) != 0, nan);
        if (nan)
            CHECK_EQ(laden__f16_of_f32(f) & 0x7fffu, 0x7e00u);
        else
            CHECK_EQ(laden__f16_of_f32(f), h);
    }
    CHECK_FEQ(laden__f32_of_f16(0x3c00), 1.0f);
    CHECK_FEQ(laden__f32_of_f16(0x0001), ldexpf(1.0f, -24));
    CHECK_EQ(laden__f16_of_f32(65519.0f), 0x7bff);
    CHECK_EQ(laden__f16_of_f32(65520.0f), 0x7c00);
    CHECK_EQ(laden__f16_of_f32(-1e10f), 0xfc00);
    /* Halfway between 1 and the next half (1 + 2^-10): to even, 1. */
    CHECK_EQ(laden__f16_of_f32(1.0f + ldexpf(1.0f, -11)), 0x3c00);
    CHECK_EQ(laden__f16_of_f32(1.0f + 3 * ldexpf(1.0f, -11)), 0x3c02);
    /* Subnormal steps: 2^-25 ties to 0, 3 * 2^-25 to 2 * 2^-24. */
    CHECK_EQ(laden__f16_of_f32(ldexpf(1.0f, -25)), 0x0000);
    CHECK_EQ(laden__f16_of_f32(3 * ldexpf(1.0f, -25)), 0x0002);
}

TEST(dtype_bf16_every_code)
{
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = laden__f32_of_bf16((uint16_t)h);
        CHECK_EQ(laden__bits_of_f32(f), h << 16);
        if (isnan(f))
            CHECK_EQ(laden__bf16_of_f32(f), h | 0x40u); /* made quiet */
        else
            CHECK_EQ(laden__bf16_of_f32(f), h);
    }
    CHECK_EQ(laden__bf16_of_f32(f32_of(0x3f808000u)), 0x3f80); /* tie, even */
    CHECK_EQ(laden__bf16_of_f32(f32_of(0x3f818000u)), 0x3f82); /* tie, even */
    CHECK_EQ(laden__bf16_of_f32(f32_of(0x3f808001u)), 0x3f81);
    CHECK_EQ(laden__bf16_of_f32(f32_of(0x7f7fffffu)), 0x7f80); /* to inf */
}

/* Every e4m3fn code decodes to a value that encodes back to it (NaN to
 * NaN); e5m2 is the top byte of a half. */
TEST(dtype_fp8_every_code)
{
    for (uint32_t v = 0; v < 256; v++) {
        float f = laden__f32_of_e4m3((uint8_t)v);
        bool nan = (v & 0x7fu) == 0x7fu;
        CHECK_EQ(isnan(f) != 0, nan);
        if (nan) /* the NaN's sign is the FPU's to keep or not */
            CHECK_EQ(laden__e4m3_of_f32(f) & 0x7fu, 0x7fu);
        else
            CHECK_EQ(laden__e4m3_of_f32(f), v);
        float g = laden__f32_of_e5m2((uint8_t)v);
        float h = laden__f32_of_f16((uint16_t)(v << 8));
        CHECK(isnan(g) ? isnan(h) != 0 : g == h);
    }
    CHECK_FEQ(laden__f32_of_e4m3(0x7e), 448.0f);
    CHECK_FEQ(laden__f32_of_e4m3(0x01), ldexpf(1.0f, -9));
    CHECK_EQ(laden__e4m3_of_f32(1000.0f), 0x7e);   /* saturates */
    CHECK_EQ(laden__e4m3_of_f32(-1000.0f), 0xfe);
    CHECK_EQ(laden__e4m3_of_f32(INFINITY), 0x7e);
    CHECK_EQ(laden__e4m3_of_f32(-0.0f), 0x80);
    /* Halfway between 1 and 1.125: to even, 1; between 1.125 and 1.25:
     * 1.25. */
    CHECK_EQ(laden__e4m3_of_f32(1.0625f), 0x38);
    CHECK_EQ(laden__e4m3_of_f32(1.1875f), 0x3a);
    /* Halfway between the two smallest subnormals (2^-9, 2 * 2^-9). */
    CHECK_EQ(laden__e4m3_of_f32(1.5f * ldexpf(1.0f, -9)), 0x02);
}
