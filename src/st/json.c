#include "json.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void laden__json_init(laden__json *j, const void *buf, size_t len)
{
    /* An empty input may come as NULL; the cursor then points at a static
     * byte, since NULL + 0 (and NULL - NULL) is undefined behaviour. */
    static const unsigned char empty[1];
    if (!buf)
        len = 0;
    j->begin = buf ? buf : empty;
    j->p = j->begin;
    j->end = j->begin + len;
}

size_t laden__json_pos(const laden__json *j)
{
    return (size_t)(j->p - j->begin);
}

static void skip_ws(laden__json *j)
{
    while (j->p < j->end &&
           (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

static laden_status syntax(laden__json *j, const char *what)
{
    if (j->p >= j->end)
        return laden__fail(LADEN_E_JSON, "%s at byte %zu (unexpected end)",
                           what, laden__json_pos(j));
    unsigned char c = *j->p;
    if (c >= 0x20 && c < 0x7f)
        return laden__fail(LADEN_E_JSON, "%s at byte %zu (found '%c')", what,
                           laden__json_pos(j), c);
    return laden__fail(LADEN_E_JSON, "%s at byte %zu (found byte 0x%02x)",
                       what, laden__json_pos(j), c);
}

bool laden__json_peek(laden__json *j, char c)
{
    skip_ws(j);
    return j->p < j->end && *j->p == (unsigned char)c;
}

laden_status laden__json_expect(laden__json *j, char c)
{
    skip_ws(j);
    if (j->p < j->end && *j->p == (unsigned char)c) {
        j->p++;
        return LADEN_OK;
    }
    char what[32] = "expected 'x'";
    what[10] = c;
    return syntax(j, what);
}

laden_status laden__json_next(laden__json *j, char close, int *more)
{
    skip_ws(j);
    if (j->p < j->end && *j->p == ',') {
        j->p++;
        *more = 1;
        return LADEN_OK;
    }
    if (j->p < j->end && *j->p == (unsigned char)close) {
        j->p++;
        *more = 0;
        return LADEN_OK;
    }
    return syntax(j, close == '}' ? "expected ',' or '}'"
                                  : "expected ',' or ']'");
}

char laden__json_kind(laden__json *j)
{
    skip_ws(j);
    if (j->p >= j->end)
        return 0;
    switch (*j->p) {
    case '{':
    case '[':
    case '"':
        return (char)*j->p;
    case 't':
        return 't';
    case 'f':
        return 'f';
    case 'n':
        return 'u';
    default:
        if (*j->p == '-' || (*j->p >= '0' && *j->p <= '9'))
            return 'n';
        return 0;
    }
}

laden_status laden__json_need_value(laden__json *j)
{
    return laden__json_kind(j) ? LADEN_OK : syntax(j, "expected a value");
}

bool laden__json_at_end(laden__json *j)
{
    skip_ws(j);
    return j->p == j->end;
}

static int hexval(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static bool read_hex4(laden__json *j, uint32_t *out)
{
    if (j->end - j->p < 4)
        return false;
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(j->p[i]);
        if (h < 0)
            return false;
        v = v << 4 | (uint32_t)h;
    }
    j->p += 4;
    *out = v;
    return true;
}

static size_t put_utf8(char *dst, uint32_t cp)
{
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xc0 | cp >> 6);
        dst[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xe0 | cp >> 12);
        dst[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        dst[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    dst[0] = (char)(0xf0 | cp >> 18);
    dst[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    dst[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    dst[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

laden_status laden__json_string(laden__json *j, char *dst, size_t cap,
                                size_t *len, bool *has_nul)
{
    size_t n = 0;
    bool nul = false;
    laden_status s = laden__json_expect(j, '"');
    if (s)
        return s;
    for (;;) {
        if (j->p >= j->end)
            return syntax(j, "unterminated string");
        unsigned char c = *j->p;
        char tmp[4];
        size_t k;
        if (c == '"') {
            j->p++;
            break;
        }
        if (c < 0x20)
            return syntax(j, "control character in string");
        if (c == '\\') {
            j->p++;
            if (j->p >= j->end)
                return syntax(j, "unterminated escape");
            unsigned char e = *j->p++;
            uint32_t cp;
            switch (e) {
            case '"':
            case '\\':
            case '/':
                cp = e;
                break;
            case 'b':
                cp = '\b';
                break;
            case 'f':
                cp = '\f';
                break;
            case 'n':
                cp = '\n';
                break;
            case 'r':
                cp = '\r';
                break;
            case 't':
                cp = '\t';
                break;
            case 'u':
                if (!read_hex4(j, &cp))
                    return syntax(j, "bad \\u escape");
                if (cp >= 0xdc00 && cp <= 0xdfff)
                    return syntax(j, "lone low surrogate in \\u escape");
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    uint32_t lo;
                    if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u')
                        return syntax(j, "lone high surrogate in \\u escape");
                    j->p += 2;
                    if (!read_hex4(j, &lo) || lo < 0xdc00 || lo > 0xdfff)
                        return syntax(j, "bad surrogate pair in \\u escape");
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                }
                break;
            default:
                j->p--;
                return syntax(j, "unknown escape");
            }
            if (cp == 0)
                nul = true;
            k = put_utf8(tmp, cp);
        } else {
            k = laden__utf8_len(j->p, j->end);
            if (k == 0)
                return syntax(j, "invalid UTF-8 in string");
            memcpy(tmp, j->p, k);
            j->p += k;
        }
        if (dst) {
            if (n + k + 1 > cap)
                return laden__fail(LADEN_E_LIMIT,
                                   "string at byte %zu is too long",
                                   laden__json_pos(j));
            memcpy(dst + n, tmp, k);
        }
        n += k;
    }
    if (dst)
        dst[n] = '\0';
    if (len)
        *len = n;
    if (has_nul)
        *has_nul = nul;
    return LADEN_OK;
}

/* Scans a JSON number; sets *is_uint and *value when it is a plain
 * non-negative integer ([0-9]+ without fraction or exponent). */
static laden_status scan_number(laden__json *j, bool *is_uint, bool *overflow,
                                uint64_t *value)
{
    const unsigned char *p = j->p;
    bool neg = false, frac = false;
    uint64_t v = 0;
    bool ovf = false;
    if (p < j->end && *p == '-') {
        neg = true;
        p++;
    }
    if (p >= j->end || *p < '0' || *p > '9') {
        j->p = p;
        return syntax(j, "bad number");
    }
    if (*p == '0' && p + 1 < j->end && p[1] >= '0' && p[1] <= '9') {
        j->p = p + 1;
        return syntax(j, "leading zero in number");
    }
    while (p < j->end && *p >= '0' && *p <= '9') {
        if (!laden__mul_u64(v, 10, &v) ||
            !laden__add_u64(v, (uint64_t)(*p - '0'), &v))
            ovf = true;
        p++;
    }
    if (p < j->end && *p == '.') {
        frac = true;
        p++;
        if (p >= j->end || *p < '0' || *p > '9') {
            j->p = p;
            return syntax(j, "bad fraction in number");
        }
        while (p < j->end && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < j->end && (*p == 'e' || *p == 'E')) {
        frac = true;
        p++;
        if (p < j->end && (*p == '+' || *p == '-'))
            p++;
        if (p >= j->end || *p < '0' || *p > '9') {
            j->p = p;
            return syntax(j, "bad exponent in number");
        }
        while (p < j->end && *p >= '0' && *p <= '9')
            p++;
    }
    j->p = p;
    *is_uint = !neg && !frac;
    *overflow = ovf;
    *value = v;
    return LADEN_OK;
}

laden_status laden__json_uint(laden__json *j, uint64_t *out)
{
    *out = 0;
    char k = laden__json_kind(j);
    if (k != 'n') {
        if (k == 0)
            return syntax(j, "expected a value");
        size_t at = laden__json_pos(j);
        laden_status s = laden__json_skip(j, LADEN__JSON_NUM_DEPTH);
        if (s)
            return s;
        return laden__fail(LADEN_E_SCHEMA,
                           "expected a non-negative integer at byte %zu", at);
    }
    size_t at = laden__json_pos(j);
    bool is_uint, ovf;
    uint64_t v;
    laden_status s = scan_number(j, &is_uint, &ovf, &v);
    if (s)
        return s;
    if (!is_uint)
        return laden__fail(LADEN_E_SCHEMA,
                           "expected a non-negative integer at byte %zu, "
                           "found a negative or fractional number",
                           at);
    if (ovf)
        return laden__fail(LADEN_E_LIMIT,
                           "integer at byte %zu does not fit 64 bits", at);
    *out = v;
    return LADEN_OK;
}

static laden_status literal(laden__json *j, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, word, n) != 0)
        return syntax(j, "bad literal");
    j->p += n;
    return LADEN_OK;
}

laden_status laden__json_skip(laden__json *j, unsigned max_depth)
{
    laden_status s;
    int more;
    switch (laden__json_kind(j)) {
    case '"':
        return laden__json_string(j, NULL, 0, NULL, NULL);
    case 'n': {
        bool u, o;
        uint64_t v;
        return scan_number(j, &u, &o, &v);
    }
    case 't':
        return literal(j, "true");
    case 'f':
        return literal(j, "false");
    case 'u':
        return literal(j, "null");
    case '[':
    case '{': {
        char open = (char)*j->p;
        char close = open == '[' ? ']' : '}';
        if (max_depth == 0)
            return laden__fail(LADEN_E_LIMIT,
                               "JSON nested too deeply at byte %zu",
                               laden__json_pos(j));
        j->p++;
        if (laden__json_peek(j, close)) {
            j->p++;
            return LADEN_OK;
        }
        do {
            if (open == '{') {
                if ((s = laden__json_string(j, NULL, 0, NULL, NULL)) ||
                    (s = laden__json_expect(j, ':')))
                    return s;
            }
            if ((s = laden__json_skip(j, max_depth - 1)) ||
                (s = laden__json_next(j, close, &more)))
                return s;
        } while (more);
        return LADEN_OK;
    }
    default:
        return syntax(j, "expected a value");
    }
}

/* See json.h.  The doubling and the byte count are checked: a count a
 * file can hold never wraps them, but this is the one place that grows
 * every array of the format's readers. */
bool laden__st_grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    size_t n = *cap ? *cap : 16;
    while (n < need) {
        if (n > SIZE_MAX / 2)
            return false;
        n *= 2;
    }
    if (elem && n > SIZE_MAX / elem)
        return false;
    void *p = realloc(*arr, n * elem);
    if (!p)
        return false;
    *arr = p;
    *cap = n;
    return true;
}
