/* lossless: the format's encoder, its checks and the CPU decoder
 * (include/laden/lossless.h).  The decoding itself is expand_kernels.h's
 * ex_ll_* code, compiled here through expand.c for the CPU device and by
 * NVRTC for CUDA (expand.c launches it there). */
#include <stdlib.h>
#include <string.h>

#include "dev_internal.h"
#include "laden/lossless.h"

/* expand.c: decodes with the shared code, on the CPU (on the calling
 * thread; *bad sub-chunks were corrupt, the first *first) or queued on a
 * CUDA stream. */
/* expand.c: the canonical codes of 256 lengths, bit-reversed (written
 * least significant bit first), the decoder's own; 1 if they are no
 * code (a length above 12, or more codes than 12 bits hold). */
uint32_t laden__ll_codes(const uint8_t *lens, uint32_t *code);
laden_status laden__ll_decode(int32_t device, uintptr_t stream,
                              const laden_lossless_info *info,
                              laden_devptr_t blob, laden_devptr_t dst,
                              laden_devptr_t err, uint64_t *bad,
                              uint64_t *first);

#define BITS LADEN_LOSSLESS_MAX_CODE
#define LANES LADEN_LOSSLESS_LANES
#define SEED 0x811c9dc5u
#define KIND_BF16 1u
#define KIND_F16 2u

static uint64_t align8(uint64_t x)
{
    return (x + 7u) & ~(uint64_t)7u;
}

/* The blob's layout from its fields; false when it overflows. */
static bool layout(uint64_t n, uint32_t sub_log2, uint64_t nbits,
                   laden_lossless_info *in)
{
    uint64_t nsub = n ? ((n - 1u) >> sub_log2) + 1u : 0u;
    uint64_t words = nbits / 64u + (nbits % 64u != 0) + 1u;
    memset(in, 0, sizeof *in);
    in->n_elems = n;
    in->sub_log2 = sub_log2;
    in->nbits = nbits;
    in->nsub = nsub;
    in->raw_off = LADEN_LOSSLESS_HEADER_BYTES;
    if (n > UINT64_MAX / 4u || nbits > UINT64_MAX - 64u)
        return false;
    in->offs_off = in->raw_off + align8(n);
    in->sums_off = in->offs_off + 8u * nsub;
    in->lanes_off = in->sums_off + align8(4u * nsub);
    in->bits_off = in->lanes_off + 2u * LANES * nsub;
    return laden__add_u64(in->bits_off, 8u * words, &in->bytes);
}

static uint32_t kind_of(laden_dtype d)
{
    return d == LADEN_DTYPE_BF16 ? KIND_BF16
           : d == LADEN_DTYPE_F16 ? KIND_F16
                                  : 0u;
}

laden_status laden_lossless_bound(laden_dtype dtype, uint64_t n,
                                  uint64_t *out)
{
    if (out)
        *out = 0;
    if (!out)
        return laden__fail(LADEN_E_INVAL, "laden_lossless_bound: NULL");
    if (!kind_of(dtype))
        return laden__fail(LADEN_E_INVAL,
                           "laden_lossless_bound: %s is not BF16 or F16",
                           laden_dtype_name(dtype) ? laden_dtype_name(dtype)
                                                   : "an unknown dtype");
    laden_lossless_info in;
    if (n > UINT64_MAX / 64u ||
        !layout(n, LADEN_LOSSLESS_SUB_LOG2, n * BITS, &in))
        return laden__fail(LADEN_E_INVAL,
                           "laden_lossless_bound: %llu elements are too "
                           "many", (unsigned long long)n);
    *out = in.bytes;
    return LADEN_OK;
}

/* ---- the code: lengths at most BITS long ------------------------------ */

/* Huffman code lengths of the 256 symbols' counts (0 for a symbol that
 * does not occur), at most BITS long. */
static void code_lengths(const uint64_t *count, uint8_t *len)
{
    /* Nodes 0..255 are the symbols, 256.. the merged ones. */
    uint64_t w[511];
    int32_t parent[511], alive[511];
    uint32_t nodes = 256, nalive = 0;
    memset(len, 0, 256);
    for (uint32_t s = 0; s < 256; s++) {
        w[s] = count[s];
        parent[s] = -1;
        if (count[s])
            alive[nalive++] = (int32_t)s;
    }
    if (nalive == 0)
        return;
    if (nalive == 1) {
        len[alive[0]] = 1;
        return;
    }
    while (nalive > 1) { /* the two lightest, ties to the lower node */
        uint32_t a = 0, b = 1;
        if (w[alive[b]] < w[alive[a]])
            a = 1, b = 0;
        for (uint32_t k = 2; k < nalive; k++) {
            if (w[alive[k]] < w[alive[a]]) {
                b = a;
                a = k;
            } else if (w[alive[k]] < w[alive[b]]) {
                b = k;
            }
        }
        uint32_t m = nodes++;
        w[m] = w[alive[a]] + w[alive[b]];
        parent[m] = -1;
        parent[alive[a]] = parent[alive[b]] = (int32_t)m;
        uint32_t hi = a > b ? a : b, lo = a > b ? b : a;
        alive[hi] = alive[--nalive];
        alive[lo] = (int32_t)m;
    }
    uint32_t over = 0;
    for (uint32_t s = 0; s < 256; s++) {
        if (!count[s])
            continue;
        uint32_t d = 0;
        for (int32_t at = (int32_t)s; parent[at] >= 0; at = parent[at])
            d++;
        if (d > BITS) {
            d = BITS;
            over = 1;
        }
        len[s] = (uint8_t)d;
    }
    if (!over)
        return;
    /* Clamped: the code space is overfilled.  Lengthen the rarest of the
     * longest codes below BITS until it fits (each step frees the least
     * room there is to free; all at BITS always fits 256 symbols). */
    uint64_t kraft = 0;
    for (uint32_t s = 0; s < 256; s++)
        kraft += len[s] ? 1u << (BITS - len[s]) : 0u;
    while (kraft > (1u << BITS)) {
        int32_t pick = -1;
        for (uint32_t s = 0; s < 256; s++) {
            if (!len[s] || len[s] >= BITS)
                continue;
            if (pick < 0 || len[s] > len[pick] ||
                (len[s] == len[pick] && count[s] < count[pick]))
                pick = (int32_t)s;
        }
        kraft -= 1u << (BITS - len[pick] - 1u);
        len[pick]++;
    }
}

/* ---- encoding ------------------------------------------------------------ */

static void put16(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

/* A bit writer: codes least significant bit first, into little-endian
 * words (written 32 bits at a time: at most 2 x BITS bits added to fewer
 * than 32 pending ones never overflow the 64-bit accumulator, so there is
 * one predictable branch per put). */
typedef struct bitw {
    unsigned char *bits;
    uint64_t pos;  /* bytes written */
    uint64_t acc;  /* the bits not yet written, fill of them */
    uint32_t fill;
} bitw;

static inline void put_code(bitw *w, uint32_t code, uint32_t l)
{
    w->acc |= (uint64_t)code << w->fill;
    w->fill += l;
    if (w->fill >= 32) {
        laden__put32(w->bits + w->pos, (uint32_t)w->acc);
        w->pos += 4;
        w->acc >>= 32;
        w->fill -= 32;
    }
}

static inline uint64_t bits_written(const bitw *w)
{
    return 8 * w->pos + w->fill;
}

static inline uint32_t load16(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
}

/* A 16-bit value's symbol (the byte that is entropy-coded: BF16's
 * exponent, F16's high byte) and its raw byte (the rest, stored as is). */
static inline uint32_t sym_of(uint32_t bf16, uint32_t x)
{
    return bf16 ? (x >> 7) & 0xffu : x >> 8;
}

static inline uint32_t raw_of(uint32_t bf16, uint32_t x)
{
    return bf16 ? ((x >> 8) & 0x80u) | (x & 0x7fu) : x & 0xffu;
}

/* The symbols of cnt elements at p into sy (vectorizes). */
static void symbols(uint32_t bf16, const unsigned char *p, uint32_t cnt,
                    unsigned char *sy)
{
    if (bf16)
        for (size_t k = 0; k < cnt; k++)
            sy[k] = (unsigned char)sym_of(1, load16(p + 2 * k));
    else
        for (size_t k = 0; k < cnt; k++)
            sy[k] = p[2 * k + 1];
}

/* Sub-chunk [first, first + cnt) of the elements: its raw bytes into
 * raw[first..], its symbols counted into count[4][256] (four tables: no
 * increment waits for the one before), and its checksum: each lane's
 * FNV-1a over its 16-bit values, the lanes folded in order.  The lanes'
 * chains are independent, so the element-order loop vectorizes. */
static uint32_t first_pass(uint32_t bf16, const unsigned char *in,
                           uint64_t first, uint32_t cnt, unsigned char *raw,
                           uint64_t count[4][256])
{
    uint32_t h[LANES];
    for (uint32_t j = 0; j < LANES; j++)
        h[j] = SEED;
    const unsigned char *p = in + 2 * first;
    unsigned char *r = raw + first;
    uint32_t k = 0;
    /* Separate simple loops: each vectorizes. */
    if (bf16)
        for (k = 0; k < cnt; k++)
            r[k] = (unsigned char)raw_of(1, load16(p + 2 * k));
    else
        for (k = 0; k < cnt; k++)
            r[k] = p[2 * k];
    for (k = 0; k + LANES <= cnt; k += LANES) {
        const unsigned char *q = p + 2 * (size_t)k;
        for (size_t j = 0; j < LANES; j++)
            h[j] = (h[j] ^ load16(q + 2 * j)) * 0x01000193u;
    }
    for (uint32_t j = 0; k < cnt; k++, j++)
        h[j] = (h[j] ^ load16(p + 2 * k)) * 0x01000193u;
    unsigned char sy[(size_t)1 << LADEN_LOSSLESS_SUB_LOG2];
    symbols(bf16, p, cnt, sy);
    for (k = 0; k + 4 <= cnt; k += 4) {
        count[0][sy[k]]++;
        count[1][sy[k + 1]]++;
        count[2][sy[k + 2]]++;
        count[3][sy[k + 3]]++;
    }
    for (; k < cnt; k++)
        count[0][sy[k]]++;
    uint32_t sum = SEED;
    for (uint32_t j = 0; j < LANES; j++)
        sum = (sum ^ h[j]) * 0x01000193u;
    return sum;
}

laden_status laden_lossless_encode(laden_dtype dtype, const void *src,
                                   uint64_t n, void *dst, uint64_t cap,
                                   uint64_t *out_bytes)
{
    uint64_t bound;
    laden_status s;
    if (out_bytes)
        *out_bytes = 0;
    if (!dst || !out_bytes || (n && !src))
        return laden__fail(LADEN_E_INVAL, "laden_lossless_encode: NULL");
    if ((s = laden_lossless_bound(dtype, n, &bound)))
        return s;
    if (cap < bound)
        return laden__fail(LADEN_E_INVAL,
                           "laden_lossless_encode: %llu bytes of room, "
                           "laden_lossless_bound asks %llu",
                           (unsigned long long)cap,
                           (unsigned long long)bound);
    const unsigned char *in = src;
    unsigned char *out = dst;
    uint32_t kind = kind_of(dtype), bf16 = kind == KIND_BF16;
    /* Offsets and bits start after the raw bytes, whose count is known:
     * raw bytes, checksums and codes go straight to their place. */
    laden_lossless_info at;
    layout(n, LADEN_LOSSLESS_SUB_LOG2, 0, &at);
    unsigned char *rawp = out + at.raw_off, *offs = out + at.offs_off;
    unsigned char *sums = out + at.sums_off, *lanes = out + at.lanes_off;
    const uint64_t per = (uint64_t)1 << LADEN_LOSSLESS_SUB_LOG2;
    uint64_t count4[4][256];
    memset(count4, 0, sizeof count4);
    for (uint64_t i = 0; i < at.nsub; i++) {
        uint64_t first = i * per, cnt = n - first < per ? n - first : per;
        laden__put32(sums + 4 * i,
              first_pass(bf16, in, first, (uint32_t)cnt, rawp, count4));
    }
    uint64_t count[256];
    for (uint32_t c = 0; c < 256; c++)
        count[c] = count4[0][c] + count4[1][c] + count4[2][c] + count4[3][c];
    uint8_t len[256];
    uint32_t code[256];
    code_lengths(count, len);
    laden__ll_codes(len, code); /* limited to 12 bits: always a code */
    memset(out, 0, LADEN_LOSSLESS_HEADER_BYTES);
    memcpy(out, LADEN_LOSSLESS_MAGIC, 4);
    out[4] = (unsigned char)kind;
    out[6] = LADEN_LOSSLESS_SUB_LOG2;
    laden__put64(out + 8, n);
    memcpy(out + 32, len, 256);
    bitw w = {.bits = out + at.bits_off};
    for (uint64_t i = 0; i < at.nsub; i++) {
        uint64_t first = i * per, cnt = n - first < per ? n - first : per;
        unsigned char sy[(size_t)1 << LADEN_LOSSLESS_SUB_LOG2];
        symbols(bf16, in + 2 * first, (uint32_t)cnt, sy);
        uint64_t base = bits_written(&w);
        laden__put64(offs + 8 * i, base);
        for (uint32_t j = 0; j < LANES; j++) {
            put16(lanes + 2 * (LANES * i + j),
                  (uint32_t)(bits_written(&w) - base));
            /* Two codes at a time (at most 2 x BITS = 24 bits): the
             * writer's chain of shifts is half as long. */
            uint64_t k = j;
            for (; k + LANES < cnt; k += 2 * LANES) {
                uint32_t a = sy[k], b = sy[k + LANES];
                put_code(&w, code[a] | code[b] << len[a], len[a] + len[b]);
            }
            if (k < cnt)
                put_code(&w, code[sy[k]], len[sy[k]]);
        }
    }
    uint64_t nbits = bits_written(&w);
    uint64_t words = nbits / 64u + (nbits % 64u != 0);
    if (w.fill) {
        laden__put32(w.bits + w.pos, (uint32_t)w.acc);
        w.pos += 4;
    }
    /* The last word's bits past the codes, and the padding word. */
    memset(w.bits + w.pos, 0, 8 * (words + 1) - w.pos);
    memset(rawp + n, 0, at.offs_off - at.raw_off - n);
    memset(sums + 4 * at.nsub, 0, at.lanes_off - at.sums_off - 4 * at.nsub);
    laden__put64(out + 16, nbits);
    layout(n, LADEN_LOSSLESS_SUB_LOG2, nbits, &at);
    *out_bytes = at.bytes;
    return LADEN_OK;
}

/* ---- checking ------------------------------------------------------------ */

static laden_status corrupt(const char *what)
{
    return laden__fail(LADEN_E_CORRUPT, "lossless blob: %s", what);
}

laden_status laden_lossless_check(const void *blob, uint64_t bytes,
                                  laden_lossless_info *out)
{
    if (out)
        memset(out, 0, sizeof *out);
    if (!blob || !out)
        return laden__fail(LADEN_E_INVAL, "laden_lossless_check: NULL");
    const unsigned char *b = blob;
    if (bytes < LADEN_LOSSLESS_HEADER_BYTES)
        return corrupt("shorter than its header");
    if (memcmp(b, LADEN_LOSSLESS_MAGIC, 4) != 0)
        return corrupt("no LDL1 magic");
    uint32_t kind = b[4], sub_log2 = (uint32_t)b[6] | (uint32_t)b[7] << 8;
    if (kind != KIND_BF16 && kind != KIND_F16)
        return corrupt("unknown kind (neither BF16 nor F16)");
    if (b[5] != 0 || laden__get64(b + 24) != 0)
        return corrupt("reserved bytes are not zero");
    if (sub_log2 < 6 || sub_log2 > 12)
        return corrupt("sub-chunks of 2^sub_log2 elements, sub_log2 "
                       "outside 6..12");
    uint64_t n = laden__get64(b + 8), nbits = laden__get64(b + 16);
    uint32_t used = 0, code[256];
    for (uint32_t s = 0; s < 256; s++) {
        if (b[32 + s] > BITS)
            return corrupt("a code longer than 12 bits");
        used += b[32 + s] != 0;
    }
    if (laden__ll_codes(b + 32, code))
        return corrupt("more codes than 12 bits hold");
    if (n && !used)
        return corrupt("elements but no code");
    if (n > UINT64_MAX / 16u || nbits > n * BITS)
        return corrupt("more bits than the elements' longest codes");
    laden_lossless_info in;
    if (!layout(n, sub_log2, nbits, &in) || in.bytes != bytes)
        return corrupt("its size is not what its header says");
    uint64_t prev = 0;
    for (uint64_t i = 0; i < in.nsub; i++) {
        uint64_t o = laden__get64(b + in.offs_off + 8 * i);
        if ((i == 0 && o != 0) || o < prev || o > nbits)
            return corrupt("sub-chunk offsets out of order or past the "
                           "codes");
        prev = o;
    }
    for (uint64_t i = 0; i < in.nsub; i++) {
        uint64_t o = laden__get64(b + in.offs_off + 8 * i);
        uint64_t end = i + 1 < in.nsub
                           ? laden__get64(b + in.offs_off + 8 * (i + 1))
                           : nbits;
        const unsigned char *l = b + in.lanes_off + 2 * LANES * i;
        uint32_t last = 0;
        for (uint32_t j = 0; j < LANES; j++) {
            uint32_t at = (uint32_t)l[2 * j] | (uint32_t)l[2 * j + 1] << 8;
            if ((j == 0 && at != 0) || at < last || o + at > end)
                return corrupt("lane offsets out of order or past their "
                               "sub-chunk");
            last = at;
        }
    }
    in.dtype = kind == KIND_BF16 ? LADEN_DTYPE_BF16 : LADEN_DTYPE_F16;
    *out = in;
    return LADEN_OK;
}

/* ---- decoding ------------------------------------------------------------ */

static laden_status info_ok(const laden_lossless_info *in)
{
    laden_lossless_info want;
    if (!in || !kind_of(in->dtype) || in->sub_log2 < 6 ||
        in->sub_log2 > 12 || !layout(in->n_elems, in->sub_log2, in->nbits,
                                     &want) ||
        want.bytes != in->bytes || want.nsub != in->nsub ||
        want.raw_off != in->raw_off || want.offs_off != in->offs_off ||
        want.sums_off != in->sums_off || want.lanes_off != in->lanes_off ||
        want.bits_off != in->bits_off)
        return laden__fail(LADEN_E_INVAL,
                           "laden_lossless_decode: the info is not one "
                           "laden_lossless_check gave");
    return LADEN_OK;
}

laden_status laden_lossless_decode(int32_t device, uintptr_t stream,
                                   const laden_lossless_info *info,
                                   laden_devptr_t blob, laden_devptr_t dst,
                                   uint64_t dst_bytes, laden_devptr_t err)
{
    laden_status s = info_ok(info);
    if (s)
        return s;
    if (!blob || (!dst && info->n_elems))
        return laden__fail(LADEN_E_INVAL, "laden_lossless_decode: NULL");
    if (dst_bytes != 2 * info->n_elems || dst % 2)
        return laden__fail(LADEN_E_INVAL,
                           "laden_lossless_decode: dst is %llu bytes at "
                           "0x%llx; %llu elements take %llu, aligned to 2",
                           (unsigned long long)dst_bytes,
                           (unsigned long long)dst,
                           (unsigned long long)info->n_elems,
                           (unsigned long long)(2 * info->n_elems));
    if (!info->n_elems)
        return LADEN_OK;
    uint64_t bad = 0, first = 0;
    if ((s = laden__ll_decode(device, stream, info, blob, dst, err, &bad,
                              &first)))
        return s;
    if (bad)
        return laden__fail(LADEN_E_CORRUPT,
                           "lossless blob: the codes of %llu of %llu "
                           "sub-chunks are wrong (the first: %llu)",
                           (unsigned long long)bad,
                           (unsigned long long)info->nsub,
                           (unsigned long long)first);
    return LADEN_OK;
}
