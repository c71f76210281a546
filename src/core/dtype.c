/* Every dtype fact: names, bits, blocks and the ggml type numbers, in one
 * place below every layer (see include/laden/dtype.h).  The format readers
 * (st, gguf), the converter (stream) and the expansion kernels (dev) all
 * ask here, so none of them calls another for a dtype. */
#include "internal.h"

static const char *const dtype_names[] = {
#define NAME(name, bits) #name,
    LADEN_DTYPE_LIST(NAME)
#undef NAME
};
static const uint32_t dtype_bits[] = {
#define BITS(name, bits) bits,
    LADEN_DTYPE_LIST(BITS)
#undef BITS
};

const char *laden_dtype_name(laden_dtype d)
{
    return (unsigned)d < LADEN_DTYPE_COUNT ? dtype_names[d] : NULL;
}

uint32_t laden_dtype_bits(laden_dtype d)
{
    return (unsigned)d < LADEN_DTYPE_COUNT ? dtype_bits[d] : 0;
}

bool laden__dtype_of_name(const char *s, laden_dtype *out)
{
    for (unsigned i = 0; i < LADEN_DTYPE_COUNT; i++)
        if (dtype_bits[i] && strcmp(s, dtype_names[i]) == 0) {
            *out = (laden_dtype)i;
            return true;
        }
    return false;
}

/* ---- ggml's types ------------------------------------------------------- */

/* ggml's type numbers and blocks (elements, bytes), as ggml defines them:
 * all of them, so a GGUF file's type laden does not hold is named in the
 * error and its size still checked. */
static const struct {
    uint32_t type;
    const char *name;
    uint32_t elems, bytes;
} GGML_TYPES[] = {
    {0, "F32", 1, 4},        {1, "F16", 1, 2},        {2, "Q4_0", 32, 18},
    {3, "Q4_1", 32, 20},     {6, "Q5_0", 32, 22},     {7, "Q5_1", 32, 24},
    {8, "Q8_0", 32, 34},     {9, "Q8_1", 32, 40},     {10, "Q2_K", 256, 84},
    {11, "Q3_K", 256, 110},  {12, "Q4_K", 256, 144},  {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},  {15, "Q8_K", 256, 292},  {16, "IQ2_XXS", 256, 66},
    {17, "IQ2_XS", 256, 74}, {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},
    {20, "IQ4_NL", 32, 18},  {21, "IQ3_S", 256, 110}, {22, "IQ2_S", 256, 82},
    {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},       {25, "I16", 1, 2},
    {26, "I32", 1, 4},       {27, "I64", 1, 8},       {28, "F64", 1, 8},
    {29, "IQ1_M", 256, 56},  {30, "BF16", 1, 2},      {34, "TQ1_0", 256, 54},
    {35, "TQ2_0", 256, 66},  {39, "MXFP4", 32, 17},
};

bool laden__ggml_type(uint32_t type, const char **name, uint32_t *elems,
                      uint32_t *bytes)
{
    for (size_t i = 0; i < LADEN__ARRAY_LEN(GGML_TYPES); i++)
        if (GGML_TYPES[i].type == type) {
            if (name)
                *name = GGML_TYPES[i].name;
            if (elems)
                *elems = GGML_TYPES[i].elems;
            if (bytes)
                *bytes = GGML_TYPES[i].bytes;
            return true;
        }
    return false;
}

/* The ggml types laden holds, and as which dtype. */
static const struct {
    uint32_t ggml;
    laden_dtype dtype;
} AS_DTYPE[] = {
    {0, LADEN_DTYPE_F32},   {1, LADEN_DTYPE_F16},   {2, LADEN_DTYPE_Q4_0},
    {3, LADEN_DTYPE_Q4_1},  {6, LADEN_DTYPE_Q5_0},  {7, LADEN_DTYPE_Q5_1},
    {8, LADEN_DTYPE_Q8_0},  {10, LADEN_DTYPE_Q2_K}, {11, LADEN_DTYPE_Q3_K},
    {12, LADEN_DTYPE_Q4_K}, {13, LADEN_DTYPE_Q5_K}, {14, LADEN_DTYPE_Q6_K},
    {24, LADEN_DTYPE_I8},   {25, LADEN_DTYPE_I16},  {26, LADEN_DTYPE_I32},
    {27, LADEN_DTYPE_I64},  {28, LADEN_DTYPE_F64},  {30, LADEN_DTYPE_BF16},
};

laden_status laden_dtype_of_ggml(uint32_t ggml_type, laden_dtype *out)
{
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_dtype_of_ggml: NULL");
    for (size_t i = 0; i < LADEN__ARRAY_LEN(AS_DTYPE); i++)
        if (AS_DTYPE[i].ggml == ggml_type) {
            *out = AS_DTYPE[i].dtype;
            return LADEN_OK;
        }
    const char *n = NULL;
    laden__ggml_type(ggml_type, &n, NULL, NULL);
    return laden__fail(LADEN_E_UNSUPPORTED,
                       "ggml type %s (%u) is not one laden holds (F32, F16, "
                       "BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and "
                       "the integer types)",
                       n ? n : "unknown", ggml_type);
}

uint32_t laden_ggml_of_dtype(laden_dtype dtype)
{
    for (size_t i = 0; i < LADEN__ARRAY_LEN(AS_DTYPE); i++)
        if (AS_DTYPE[i].dtype == dtype)
            return AS_DTYPE[i].ggml;
    return UINT32_MAX;
}

laden_status laden_dtype_block(laden_dtype dtype, uint32_t *block_elems,
                               uint32_t *block_bytes)
{
    if (!block_elems || !block_bytes)
        return laden__fail(LADEN_E_INVAL, "laden_dtype_block: NULL");
    if ((unsigned)dtype >= LADEN_DTYPE_COUNT)
        return laden__fail(LADEN_E_DTYPE, "dtype %d out of range",
                           (int)dtype);
    uint32_t bits = laden_dtype_bits(dtype);
    if (bits) {
        *block_elems = bits % 8 ? 8 : 1;
        *block_bytes = bits % 8 ? bits : bits / 8;
        return LADEN_OK;
    }
    /* Every block dtype is in AS_DTYPE and GGML_TYPES. */
    if (!laden__ggml_type(laden_ggml_of_dtype(dtype), NULL, block_elems,
                          block_bytes))
        return laden__fail(LADEN_E_DTYPE, "unknown ggml type %u",
                           laden_ggml_of_dtype(dtype));
    return LADEN_OK;
}
