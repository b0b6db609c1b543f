/* Native column scanner for Kineto Chrome-trace JSON (the reader's fastest path; optional at build time).
 *
 * scan(buffer) parses a whole trace document - a JSON object whose "traceEvents" value is an array of event
 * objects - in one pass and returns the event fields the events table uses as columns: one row of int64s and
 * one row of int32 text codes per event (row-major), every text field interned per field (first-appearance
 * order, raw JSON bytes without the quotes; the caller unescapes the few unique texts that hold a backslash),
 * and the byte span of every other top-level value.
 *
 * It returns None - and the caller decodes the document the ordinary way (msgspec), which also salvages
 * damage and warns - for anything it does not read *exactly as the ordinary path would*: invalid JSON of any
 * kind (strict grammar, UTF-8 and control characters checked in every string, trailing bytes), a field of
 * an unexpected type (null, a float where an int belongs, a list of ranks, ...), an integer beyond int64, a
 * time with more than three decimals, an exponent or beyond int64 ns, a key written with an escape (it could
 * spell a field name), a duplicated known key, nesting deeper than 200. So it never has to be right about a
 * corner case; it only has to be right, or refuse.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* int64 columns of a row */
enum { I_PID, I_TID, I_TS, I_DUR, I_CORR, I_EXT, I_EXTL, I_DEVICE, I_STREAM, I_NBYTES, I_GSIZE, I_INN, I_OUTN,
       I_SEQ, I_SRC, I_DST, N_I64 };
/* int32 text-code columns of a row (one intern table each); -1: absent, or a number for the int|str fields */
enum { T_PH, T_CAT, T_NAME, T_PID, T_TID, T_DEVICE, T_STREAM, T_SEQ, T_COLL, T_PGNAME, T_PGDESC, T_PGRANKS,
       T_DTYPE, N_TXT };

#define MAX_DEPTH 200

typedef struct {
    const unsigned char *ptr;
    Py_ssize_t len;
} Span;

typedef struct {
    Span *spans;   /* by id */
    size_t count, cap;
    int32_t *slots; /* open addressing: id + 1, 0 = empty */
    uint64_t *hashes;
    size_t mask;
} Table;

typedef struct {
    const unsigned char *p, *end;
    int64_t *i64;
    int32_t *txt;
    size_t rows, cap;
    Table tables[N_TXT];
    int nomem;
} Scan;

static uint64_t hash_bytes(const unsigned char *s, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 31;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, (size_t)n);
    h = (h ^ w) * 0x94D049BB133111EBULL;
    h ^= h >> 29;
    return h;
}

static int table_init(Table *t) {
    t->cap = 64;
    t->count = 0;
    t->spans = malloc(t->cap * sizeof(Span));
    t->mask = 127;
    t->slots = calloc(t->mask + 1, sizeof(int32_t));
    t->hashes = malloc(t->cap * sizeof(uint64_t));
    return t->spans && t->slots && t->hashes;
}

static void table_free(Table *t) {
    free(t->spans);
    free(t->slots);
    free(t->hashes);
}

static int table_grow(Table *t) {
    size_t size = (t->mask + 1) * 2;
    int32_t *slots = calloc(size, sizeof(int32_t));
    if (!slots)
        return 0;
    for (size_t id = 0; id < t->count; id++) {
        size_t i = t->hashes[id] & (size - 1);
        while (slots[i])
            i = (i + 1) & (size - 1);
        slots[i] = (int32_t)id + 1;
    }
    free(t->slots);
    t->slots = slots;
    t->mask = size - 1;
    return 1;
}

/* id of the text, added in first-appearance order; -1 when out of memory */
static int32_t intern(Table *t, const unsigned char *s, Py_ssize_t n) {
    uint64_t h = hash_bytes(s, n);
    size_t i = h & t->mask;
    int32_t slot;
    while ((slot = t->slots[i])) {
        Span *span = &t->spans[slot - 1];
        if (t->hashes[slot - 1] == h && span->len == n && memcmp(span->ptr, s, (size_t)n) == 0)
            return slot - 1;
        i = (i + 1) & t->mask;
    }
    if (t->count == t->cap) {
        size_t cap = t->cap * 2;
        Span *spans = realloc(t->spans, cap * sizeof(Span));
        if (!spans)
            return -1;
        t->spans = spans;
        uint64_t *hashes = realloc(t->hashes, cap * sizeof(uint64_t));
        if (!hashes)
            return -1;
        t->hashes = hashes;
        t->cap = cap;
    }
    if (t->count > INT32_MAX - 2)
        return -1;
    int32_t id = (int32_t)t->count++;
    t->spans[id].ptr = s;
    t->spans[id].len = n;
    t->hashes[id] = h;
    t->slots[i] = id + 1;
    if (t->count * 2 > t->mask + 1 && !table_grow(t))
        return -1;
    return id;
}

static inline void ws(Scan *c) {
    const unsigned char *p = c->p, *end = c->end;
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    c->p = p;
}

static inline int is_hex(unsigned char ch) {
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
}

/* Whether 8 bytes are all plain string content: ASCII, not a control character, not '"' or '\\'
 * (word-at-a-time tests; each is exact about whether some byte matches). */
static inline int plain8(const unsigned char *p) {
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    uint64_t x;
    memcpy(&x, p, 8);
    if (x & highs)
        return 0;
    uint64_t control = (x - 0x20 * ones) & ~x & highs;
    uint64_t q = x ^ (0x22 * ones), b = x ^ (0x5C * ones);
    uint64_t quote = (q - ones) & ~q & highs, backslash = (b - ones) & ~b & highs;
    return !(control | quote | backslash);
}

/* A string at c->p (its opening quote): strict JSON, valid UTF-8. Sets the raw content span and whether it
 * holds an escape. 0 when invalid. */
static int string(Scan *c, const unsigned char **s, Py_ssize_t *n, int *escaped) {
    const unsigned char *p = c->p, *end = c->end;
    if (p >= end || *p != '"')
        return 0;
    p++;
    const unsigned char *start = p;
    int esc = 0;
    for (;;) {
        while (end - p >= 8 && plain8(p))
            p += 8;
        if (p >= end)
            return 0;
        unsigned char ch = *p;
        if (ch == '"')
            break;
        if (ch < 0x80) {
            if (ch == '\\') {
                esc = 1;
                if (p + 1 >= end)
                    return 0;
                unsigned char e = p[1];
                if (e == 'u') {
                    if (p + 5 >= end || !is_hex(p[2]) || !is_hex(p[3]) || !is_hex(p[4]) || !is_hex(p[5]))
                        return 0;
                    p += 6;
                } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' ||
                           e == 't') {
                    p += 2;
                } else {
                    return 0;
                }
                continue;
            }
            if (ch < 0x20)
                return 0;
            p++;
            continue;
        }
        /* UTF-8: no overlong forms, no surrogates, nothing beyond U+10FFFF */
        if (ch >= 0xC2 && ch <= 0xDF) {
            if (p + 1 >= end || (p[1] & 0xC0) != 0x80)
                return 0;
            p += 2;
        } else if (ch >= 0xE0 && ch <= 0xEF) {
            if (p + 2 >= end || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80)
                return 0;
            if ((ch == 0xE0 && p[1] < 0xA0) || (ch == 0xED && p[1] > 0x9F))
                return 0;
            p += 3;
        } else if (ch >= 0xF0 && ch <= 0xF4) {
            if (p + 3 >= end || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80)
                return 0;
            if ((ch == 0xF0 && p[1] < 0x90) || (ch == 0xF4 && p[1] > 0x8F))
                return 0;
            p += 4;
        } else {
            return 0;
        }
    }
    *s = start;
    *n = p - start;
    *escaped = esc;
    c->p = p + 1;
    return 1;
}

/* A JSON number at c->p, checked against the grammar. kind: 0 integer, 1 with a fraction and/or exponent.
 * For an integer, *value gets it when it fits int64 (*fits = 1). */
static int number(Scan *c, int *kind, int64_t *value, int *fits, const unsigned char **frac, int *frac_digits) {
    const unsigned char *p = c->p, *end = c->end;
    int negative = 0;
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    if (p >= end || *p < '0' || *p > '9')
        return 0;
    uint64_t mag = 0;
    int overflow = 0;
    if (*p == '0') {
        p++;
    } else {
        while (p < end && *p >= '0' && *p <= '9') {
            uint64_t d = (uint64_t)(*p - '0');
            if (mag > (UINT64_MAX - d) / 10)
                overflow = 1;
            else
                mag = mag * 10 + d;
            p++;
        }
    }
    *kind = 0;
    *frac = NULL;
    *frac_digits = 0;
    if (p < end && *p == '.') {
        p++;
        if (p >= end || *p < '0' || *p > '9')
            return 0;
        *frac = p;
        while (p < end && *p >= '0' && *p <= '9')
            p++;
        *frac_digits = (int)(p - *frac);
        *kind = 1;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || *p < '0' || *p > '9')
            return 0;
        while (p < end && *p >= '0' && *p <= '9')
            p++;
        *kind = 2;
    }
    *fits = 0;
    if (!overflow) {
        if (!negative && mag <= (uint64_t)INT64_MAX) {
            *value = (int64_t)mag;
            *fits = 1;
        } else if (negative && mag <= (uint64_t)INT64_MAX + 1) {
            *value = mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mag;
            *fits = 1;
        }
    }
    c->p = p;
    return 1;
}

static int literal(Scan *c, const char *word, size_t n) {
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0)
        return 0;
    c->p += n;
    return 1;
}

/* After a member of an object or array: 1 when a ',' follows (c->p then past it and its whitespace), 2 when the
 * closing bracket does (c->p past it), 0 for anything else. */
static int next_member(Scan *c, unsigned char close) {
    ws(c);
    if (c->p < c->end && *c->p == ',') {
        c->p++;
        ws(c);
        return 1;
    }
    if (c->p < c->end && *c->p == close) {
        c->p++;
        return 2;
    }
    return 0;
}

/* An object member's key and the ':' after it (c->p then at the value, past whitespace). ``plain``: the key
 * must hold no escape (a key the scanner compares could otherwise spell a field name it misses). 0 when not. */
static int member_key(Scan *c, const unsigned char **k, Py_ssize_t *n, int plain) {
    int escaped;
    if (!string(c, k, n, &escaped) || (plain && escaped))
        return 0;
    ws(c);
    if (c->p >= c->end || *c->p != ':')
        return 0;
    c->p++;
    ws(c);
    return 1;
}

static int skip_value(Scan *c, int depth);

static int skip_container(Scan *c, int depth, int object) {
    if (depth > MAX_DEPTH)
        return 0;
    c->p++;
    ws(c);
    unsigned char close = object ? '}' : ']';
    if (c->p < c->end && *c->p == close) {
        c->p++;
        return 1;
    }
    for (;;) {
        const unsigned char *k;
        Py_ssize_t n;
        if (object && !member_key(c, &k, &n, 0))
            return 0;
        if (!skip_value(c, depth + 1))
            return 0;
        int next = next_member(c, close);
        if (next != 1)
            return next == 2;
    }
}

static int skip_value(Scan *c, int depth) {
    ws(c);
    if (c->p >= c->end)
        return 0;
    unsigned char ch = *c->p;
    if (ch == '"') {
        const unsigned char *s;
        Py_ssize_t n;
        int e;
        return string(c, &s, &n, &e);
    }
    if (ch == '{' || ch == '[')
        return skip_container(c, depth, ch == '{');
    if (ch == '-' || (ch >= '0' && ch <= '9')) {
        int kind, fits, fd;
        int64_t v;
        const unsigned char *f;
        return number(c, &kind, &v, &fits, &f, &fd);
    }
    if (ch == 't')
        return literal(c, "true", 4);
    if (ch == 'f')
        return literal(c, "false", 5);
    if (ch == 'n')
        return literal(c, "null", 4);
    return 0;
}

/* An int64 field: a JSON integer that fits, nothing else. */
static int int_field(Scan *c, int64_t *out) {
    if (c->p >= c->end || !(*c->p == '-' || (*c->p >= '0' && *c->p <= '9')))
        return 0;
    int kind, fits, fd;
    const unsigned char *f;
    if (!number(c, &kind, out, &fits, &f, &fd))
        return 0;
    return kind == 0 && fits;
}

/* A text field: a string, interned (with any escape: the caller unescapes the unique texts). */
static int text_field(Scan *c, Table *t, int32_t *out) {
    const unsigned char *s;
    Py_ssize_t n;
    int e;
    if (!string(c, &s, &n, &e))
        return 0;
    int32_t id = intern(t, s, n);
    if (id < 0) {
        c->nomem = 1;
        return 0;
    }
    *out = id;
    return 1;
}

/* An int|str field: an integer that fits goes to *value, a string to the text table. */
static int int_or_text(Scan *c, Table *t, int64_t *value, int32_t *code) {
    if (c->p < c->end && *c->p == '"')
        return text_field(c, t, code);
    return int_field(c, value);
}

/* A time in µs -> exact ns: at most three decimals, no exponent, |ns| <= INT64_MAX. */
static int time_field(Scan *c, int64_t *out) {
    const unsigned char *start = c->p;
    if (c->p >= c->end || !(*c->p == '-' || (*c->p >= '0' && *c->p <= '9')))
        return 0;
    int kind, fits, fd;
    int64_t whole;
    const unsigned char *frac;
    if (!number(c, &kind, &whole, &fits, &frac, &fd))
        return 0;
    if (kind == 2 || fd > 3 || !fits)
        return 0;
    int negative = *start == '-';
    int64_t f = 0;
    for (int i = 0; i < 3; i++)
        f = f * 10 + (i < fd ? frac[i] - '0' : 0);
    int64_t ns;
    if (negative) {
        /* whole <= 0 here; ns = whole*1000 - f, refusing INT64_MIN itself (the ordinary path does) */
        if (whole < (INT64_MIN + 1000) / 1000)
            return 0;
        ns = whole * 1000 - f;
        if (ns == INT64_MIN)
            return 0;
    } else {
        if (whole > (INT64_MAX - 999) / 1000)
            return 0;
        ns = whole * 1000 + f;
    }
    *out = ns;
    return 1;
}

static int key_is(const unsigned char *s, Py_ssize_t n, const char *word) {
    size_t len = strlen(word);
    return (size_t)n == len && memcmp(s, word, len) == 0;
}

/* The args keys read, each with how: an int64 column, a text table, or both (int|str). */
enum { INT, TEXT, INT_OR_TEXT };
#define KEY(text) text, sizeof(text) - 1
static const struct {
    const char *key;
    Py_ssize_t len;
    int kind, i64, txt;
} ARGS[] = {
    {KEY("correlation"), INT, I_CORR, -1},
    {KEY("External id"), INT, I_EXT, -1},
    {KEY("external id"), INT, I_EXTL, -1},
    {KEY("device"), INT_OR_TEXT, I_DEVICE, T_DEVICE},
    {KEY("stream"), INT_OR_TEXT, I_STREAM, T_STREAM},
    {KEY("bytes"), INT, I_NBYTES, -1},
    {KEY("Collective name"), TEXT, -1, T_COLL},
    {KEY("Process Group Name"), TEXT, -1, T_PGNAME},
    {KEY("Process Group Description"), TEXT, -1, T_PGDESC},
    {KEY("Process Group Ranks"), TEXT, -1, T_PGRANKS},
    {KEY("Group size"), INT, I_GSIZE, -1},
    {KEY("In msg nelems"), INT, I_INN, -1},
    {KEY("Out msg nelems"), INT, I_OUTN, -1},
    {KEY("dtype"), TEXT, -1, T_DTYPE},
    {KEY("Seq"), INT_OR_TEXT, I_SEQ, T_SEQ},
    {KEY("Src Rank"), INT, I_SRC, -1},
    {KEY("Dst Rank"), INT, I_DST, -1},
};
#define N_ARGS ((int)(sizeof(ARGS) / sizeof(ARGS[0])))

static int args_object(Scan *c, int64_t *row, int32_t *txt) {
    /* c->p at '{' */
    c->p++;
    ws(c);
    if (c->p < c->end && *c->p == '}') {
        c->p++;
        return 1;
    }
    uint32_t seen = 0;
    for (;;) {
        const unsigned char *k;
        Py_ssize_t n;
        int ok = 1, field = -1;
        if (!member_key(c, &k, &n, 1))
            return 0;
        for (int i = 0; i < N_ARGS; i++) {
            if (n == ARGS[i].len && memcmp(k, ARGS[i].key, (size_t)n) == 0) {
                field = i;
                break;
            }
        }
        if (field < 0) {
            ok = skip_value(c, 3);
        } else {
            if (seen & (1u << field))
                return 0;
            seen |= 1u << field;
            int kind = ARGS[field].kind;
            if (kind == INT)
                ok = int_field(c, &row[ARGS[field].i64]);
            else if (kind == TEXT)
                ok = text_field(c, &c->tables[ARGS[field].txt], &txt[ARGS[field].txt]);
            else
                ok = int_or_text(c, &c->tables[ARGS[field].txt], &row[ARGS[field].i64], &txt[ARGS[field].txt]);
        }
        if (!ok)
            return 0;
        int next = next_member(c, '}');
        if (next != 1)
            return next == 2;
    }
}

static int new_row(Scan *c, int64_t **row, int32_t **txt) {
    if (c->rows == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 4096;
        int64_t *i64 = realloc(c->i64, cap * N_I64 * sizeof(int64_t));
        if (!i64) {
            c->nomem = 1;
            return 0;
        }
        c->i64 = i64;
        int32_t *t = realloc(c->txt, cap * N_TXT * sizeof(int32_t));
        if (!t) {
            c->nomem = 1;
            return 0;
        }
        c->txt = t;
        c->cap = cap;
    }
    int64_t *r = c->i64 + c->rows * N_I64;
    int32_t *x = c->txt + c->rows * N_TXT;
    for (int i = 0; i < N_I64; i++)
        r[i] = -1;
    r[I_TS] = r[I_DUR] = 0;
    for (int i = 0; i < N_TXT; i++)
        x[i] = -1;
    c->rows++;
    *row = r;
    *txt = x;
    return 1;
}

static const unsigned char EMPTY[1] = {0};

static int event_object(Scan *c) {
    int64_t *row;
    int32_t *txt;
    if (c->p >= c->end || *c->p != '{')
        return 0;
    if (!new_row(c, &row, &txt))
        return 0;
    c->p++;
    ws(c);
    uint32_t seen = 0;
    if (c->p < c->end && *c->p == '}') {
        c->p++;
    } else {
        for (;;) {
            const unsigned char *k;
            Py_ssize_t n;
            if (!member_key(c, &k, &n, 1))
                return 0;
            int field = -1, ok = 1;
            if (n == 2 && k[0] == 'p' && k[1] == 'h') {
                field = 0;
                ok = text_field(c, &c->tables[T_PH], &txt[T_PH]);
            } else if (n == 2 && k[0] == 't' && k[1] == 's') {
                field = 1;
                ok = time_field(c, &row[I_TS]);
            } else if (n == 3 && memcmp(k, "cat", 3) == 0) {
                field = 2;
                ok = text_field(c, &c->tables[T_CAT], &txt[T_CAT]);
            } else if (n == 3 && memcmp(k, "pid", 3) == 0) {
                field = 3;
                ok = int_or_text(c, &c->tables[T_PID], &row[I_PID], &txt[T_PID]);
            } else if (n == 3 && memcmp(k, "tid", 3) == 0) {
                field = 4;
                ok = int_or_text(c, &c->tables[T_TID], &row[I_TID], &txt[T_TID]);
            } else if (n == 3 && memcmp(k, "dur", 3) == 0) {
                field = 5;
                ok = time_field(c, &row[I_DUR]);
            } else if (n == 4 && memcmp(k, "name", 4) == 0) {
                field = 6;
                ok = text_field(c, &c->tables[T_NAME], &txt[T_NAME]);
            } else if (n == 4 && memcmp(k, "args", 4) == 0) {
                field = 7;
                if (c->p < c->end && *c->p == '{')
                    ok = args_object(c, row, txt);
                else
                    ok = literal(c, "null", 4);
            } else {
                ok = skip_value(c, 2);
            }
            if (field >= 0) {
                if (seen & (1u << field))
                    return 0;
                seen |= 1u << field;
            }
            if (!ok)
                return 0;
            int next = next_member(c, '}');
            if (next == 2)
                break;
            if (next == 0)
                return 0;
        }
    }
    /* ph, cat, name default to "" (interned where first absent, as the ordinary path factorises it) */
    for (int t = T_PH; t <= T_NAME; t++) {
        if (txt[t] < 0) {
            int32_t id = intern(&c->tables[t], EMPTY, 0);
            if (id < 0) {
                c->nomem = 1;
                return 0;
            }
            txt[t] = id;
        }
    }
    return 1;
}

static int events_array(Scan *c) {
    if (c->p >= c->end || *c->p != '[')
        return 0;
    c->p++;
    ws(c);
    if (c->p < c->end && *c->p == ']') {
        c->p++;
        return 1;
    }
    for (;;) {
        if (!event_object(c))
            return 0;
        int next = next_member(c, ']');
        if (next != 1)
            return next == 2;
    }
}

static PyObject *texts_list(Table *t) {
    PyObject *list = PyList_New((Py_ssize_t)t->count);
    if (!list)
        return NULL;
    for (size_t i = 0; i < t->count; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)t->spans[i].ptr, t->spans[i].len);
        if (!b) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, b);
    }
    return list;
}

static PyObject *scan(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Scan c;
    memset(&c, 0, sizeof(c));
    c.p = view.buf;
    c.end = c.p + view.len;
    const unsigned char *base = c.p;
    PyObject *top = PyDict_New(), *result = NULL;
    int ok = top != NULL, found = 0;
    for (int t = 0; t < N_TXT && ok; t++)
        ok = table_init(&c.tables[t]);
    if (!ok)  /* the dict or a table could not be allocated: a MemoryError is owed, not None */
        c.nomem = 1;
    if (ok) {
        ws(&c);
        ok = c.p < c.end && *c.p == '{';
        if (ok) {
            c.p++;
            ws(&c);
            if (c.p < c.end && *c.p == '}') {
                c.p++;
            } else {
                for (;;) {
                    const unsigned char *k;
                    Py_ssize_t n;
                    if (!member_key(&c, &k, &n, 1)) {
                        ok = 0;
                        break;
                    }
                    PyObject *key = PyUnicode_DecodeUTF8((const char *)k, n, "strict");
                    if (!key) {
                        ok = 0;
                        PyErr_Clear();
                        break;
                    }
                    int dup = PyDict_Contains(top, key);
                    if (dup != 0 || (found && key_is(k, n, "traceEvents"))) {
                        Py_DECREF(key);
                        if (dup < 0)
                            PyErr_Clear();
                        ok = 0;
                        break;
                    }
                    if (key_is(k, n, "traceEvents")) {
                        Py_DECREF(key);
                        found = 1;
                        /* The events pass touches no Python object (the buffer is held by the view), so
                         * other threads run meanwhile: several traces are scanned at once. */
                        Py_BEGIN_ALLOW_THREADS
                        ok = events_array(&c);
                        Py_END_ALLOW_THREADS
                    } else {
                        Py_ssize_t start = c.p - base;
                        ok = skip_value(&c, 1);
                        PyObject *span = ok ? Py_BuildValue("(nn)", start, (Py_ssize_t)(c.p - base)) : NULL;
                        if (ok && (!span || PyDict_SetItem(top, key, span) < 0)) {
                            c.nomem = 1;
                            ok = 0;
                        }
                        Py_XDECREF(span);
                        Py_DECREF(key);
                    }
                    if (!ok)
                        break;
                    int next = next_member(&c, '}');
                    if (next == 1)
                        continue;
                    ok = next == 2;
                    break;
                }
            }
        }
        if (ok) {
            ws(&c);
            ok = c.p == c.end && found;
        }
    }
    if (c.nomem) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
    } else if (!ok) {
        result = Py_NewRef(Py_None);
    } else {
        PyObject *texts = PyTuple_New(N_TXT);
        PyObject *i64 = PyBytes_FromStringAndSize((const char *)c.i64, (Py_ssize_t)(c.rows * N_I64 * 8));
        PyObject *txt = PyBytes_FromStringAndSize((const char *)c.txt, (Py_ssize_t)(c.rows * N_TXT * 4));
        int good = texts && i64 && txt;
        for (int t = 0; t < N_TXT && good; t++) {
            PyObject *list = texts_list(&c.tables[t]);
            if (!list)
                good = 0;
            else
                PyTuple_SET_ITEM(texts, t, list);
        }
        if (good)
            result = Py_BuildValue("{s:n,s:O,s:O,s:O,s:O}", "rows", (Py_ssize_t)c.rows, "i64", i64, "txt", txt,
                                   "texts", texts, "top", top);
        Py_XDECREF(texts);
        Py_XDECREF(i64);
        Py_XDECREF(txt);
    }
    for (int t = 0; t < N_TXT; t++)
        table_free(&c.tables[t]);
    free(c.i64);
    free(c.txt);
    Py_XDECREF(top);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O,
     "scan(buffer) -> dict | None: the trace's event columns, or None when the ordinary reader must decode it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kscan", "Native Kineto trace column scanner.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kscan(void) {
    PyObject *m = PyModule_Create(&module);
    if (m) {
        PyModule_AddIntConstant(m, "N_I64", N_I64);
        PyModule_AddIntConstant(m, "N_TXT", N_TXT);
    }
    return m;
}
