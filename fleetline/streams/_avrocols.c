/*
 * Avro single-object messages -> column buffers, in one pass, for the telemetry sinks.
 *
 * The Python side (fleetline.streams.avrocols) compiles a writer schema into a flat program of
 * fixed-size instructions; this module runs that program over every message of a batch and
 * appends each value to its column. Nothing here knows the telemetry schema. Every read is
 * bounds-checked and every message must be consumed to its last byte, so a malformed message
 * fails the batch (the caller then decodes it record by record, naming the bad message) instead
 * of shifting the values of the messages after it.
 *
 * Instruction: four int32 (op, column, a, b).
 *   INT/LONG/FLOAT/DOUBLE/BOOL/STRING column: read one value into the column.
 *   SKIP_*: read and drop one value (a field the caller does not want).
 *   NULL column: append a null to the column (a union's null branch).
 *   UNION a: read a branch index, run the branch-th of the next a instructions, skip the rest.
 *   ARRAY column a: the next a instructions are the item; the column gets one end offset per
 *     array (Arrow list offsets), the item columns one value per item.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    OP_INT = 1, OP_LONG, OP_FLOAT, OP_DOUBLE, OP_BOOL, OP_STRING, OP_NULL, OP_UNION, OP_ARRAY,
    OP_SKIP_INT, OP_SKIP_FLOAT, OP_SKIP_DOUBLE, OP_SKIP_BOOL, OP_SKIP_STRING
};

/* A growable buffer that is already the Python bytes object handed back: no copy at the end. */
typedef struct {
    PyObject *obj;
    char *p;
    size_t len, cap;
} Buf;

static int reserve(Buf *b, size_t need) {
    if (need <= b->cap) return 0;
    size_t next = b->cap ? b->cap * 2 : 4096;
    while (next < need) next *= 2;
    if (!b->obj) {
        b->obj = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)next);
        if (!b->obj) return -1;
    } else if (_PyBytes_Resize(&b->obj, (Py_ssize_t)next)) {
        return -1;  /* _PyBytes_Resize released it */
    }
    b->p = PyBytes_AS_STRING(b->obj);
    b->cap = next;
    return 0;
}

/* Kinds, by the width of one value: 4 (int, float, list offsets), 8 (long, double), 1 (bool),
 * 0 (string: offsets + data). */
typedef struct {
    int width;
    Buf values;
    Buf offsets;            /* strings: count + 1 int32 offsets */
    size_t count;           /* number of values */
    uint8_t *valid;         /* one byte per value, only once a null was seen */
    size_t vcap;
    size_t nulls;
} Column;

/* A column's length before a message, to take the message back if it fails. */
typedef struct {
    size_t count, len, nulls;
} Mark;

typedef struct {
    const uint8_t *p, *end;
    const char *error;
} Reader;

/* b: the number of instructions this one spans, its body included (set by the compiler). */
typedef struct {
    int32_t op, col, a, b;
} Ins;

static int grow(void **buf, size_t *cap, size_t need, size_t unit) {
    if (need <= *cap) return 0;
    size_t next = *cap ? *cap : 1024;
    while (next < need) next *= 2;
    void *p = realloc(*buf, next * unit);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = p;
    *cap = next;
    return 0;
}

static inline int read_long(Reader *r, int64_t *out) {
    uint64_t v = 0;
    int shift = 0;
    while (r->p < r->end) {
        uint8_t b = *r->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = (int64_t)((v >> 1) ^ (~(v & 1) + 1));
            return 0;
        }
        shift += 7;
        if (shift > 63) { r->error = "varint longer than 10 bytes"; return -1; }
    }
    r->error = "message ends inside a number";
    return -1;
}

static inline int mark_valid(Column *c) {
    /* Called before a value is appended; keeps the validity bytes in step once they exist. */
    if (!c->valid) return 0;
    if (grow((void **)&c->valid, &c->vcap, c->count + 1, 1)) return -1;
    c->valid[c->count] = 1;
    return 0;
}

static inline int32_t *string_offsets(Column *c) { return (int32_t *)c->offsets.p; }

static int append_null(Column *c) {
    if (!c->valid) {
        if (grow((void **)&c->valid, &c->vcap, c->count + 1, 1)) return -1;
        memset(c->valid, 1, c->count);
    } else if (grow((void **)&c->valid, &c->vcap, c->count + 1, 1)) {
        return -1;
    }
    c->valid[c->count] = 0;
    c->nulls++;
    if (c->width == 0) {
        if (reserve(&c->offsets, (c->count + 2) * sizeof(int32_t))) return -1;
        string_offsets(c)[c->count + 1] = string_offsets(c)[c->count];
    } else {
        if (reserve(&c->values, c->values.len + (size_t)c->width)) return -1;
        memset(c->values.p + c->values.len, 0, (size_t)c->width);
        c->values.len += (size_t)c->width;
    }
    c->count++;
    return 0;
}

/* One value of a constant width N: a constant-size copy compiles to a move, not a call. */
#define APPEND_N(N)                                                                    \
    static inline int append_##N(Column *c, const void *v) {                          \
        if (mark_valid(c)) return -1;                                                  \
        if (c->values.len + N > c->values.cap && reserve(&c->values, c->values.len + N)) \
            return -1;                                                                 \
        memcpy(c->values.p + c->values.len, v, N);                                     \
        c->values.len += N;                                                            \
        c->count++;                                                                    \
        return 0;                                                                      \
    }
APPEND_N(1)
APPEND_N(4)
APPEND_N(8)

static inline int append_bytes(Column *c, const uint8_t *data, size_t n) {
    if (mark_valid(c)) return -1;
    if (c->values.len + n > INT32_MAX) return -1;
    if (c->values.len + n > c->values.cap && reserve(&c->values, c->values.len + n)) return -1;
    if ((c->count + 2) * sizeof(int32_t) > c->offsets.cap &&
        reserve(&c->offsets, (c->count + 2) * sizeof(int32_t)))
        return -1;
    memcpy(c->values.p + c->values.len, data, n);
    c->values.len += n;
    string_offsets(c)[c->count + 1] = (int32_t)c->values.len;
    c->count++;
    return 0;
}

static int run(const Ins *prog, size_t at, size_t stop, Column *cols, Reader *r);

static int step(const Ins *prog, size_t at, Column *cols, Reader *r) {
    const Ins *in = &prog[at];
    Column *c = in->col >= 0 ? &cols[in->col] : NULL;
    int64_t v;
    switch (in->op) {
    case OP_INT: {
        if (read_long(r, &v)) return -1;
        if (v < INT32_MIN || v > INT32_MAX) { r->error = "int out of range"; return -1; }
        int32_t x = (int32_t)v;
        return append_4(c, &x) ? (r->error = "column too large", -1) : 0;
    }
    case OP_LONG:
        if (read_long(r, &v)) return -1;
        return append_8(c, &v) ? (r->error = "column too large", -1) : 0;
    case OP_FLOAT:
        if (r->end - r->p < 4) { r->error = "message ends inside a number"; return -1; }
        if (append_4(c, r->p)) { r->error = "column too large"; return -1; }
        r->p += 4;
        return 0;
    case OP_DOUBLE:
        if (r->end - r->p < 8) { r->error = "message ends inside a number"; return -1; }
        if (append_8(c, r->p)) { r->error = "column too large"; return -1; }
        r->p += 8;
        return 0;
    case OP_BOOL: {
        if (r->p >= r->end) { r->error = "message ends inside a boolean"; return -1; }
        uint8_t b = *r->p++;
        if (b > 1) { r->error = "boolean is neither 0 nor 1"; return -1; }
        return append_1(c, &b) ? (r->error = "column too large", -1) : 0;
    }
    case OP_STRING:
    case OP_SKIP_STRING:
        if (read_long(r, &v)) return -1;
        if (v < 0 || v > r->end - r->p) { r->error = "string length past the message"; return -1; }
        if (in->op == OP_STRING && append_bytes(c, r->p, (size_t)v)) {
            r->error = "column too large";
            return -1;
        }
        r->p += v;
        return 0;
    case OP_SKIP_INT:
        return read_long(r, &v);
    case OP_SKIP_FLOAT:
    case OP_SKIP_DOUBLE: {
        size_t n = in->op == OP_SKIP_FLOAT ? 4 : 8;
        if ((size_t)(r->end - r->p) < n) { r->error = "message ends inside a number"; return -1; }
        r->p += n;
        return 0;
    }
    case OP_SKIP_BOOL:
        if (r->p >= r->end) { r->error = "message ends inside a boolean"; return -1; }
        r->p++;
        return 0;
    case OP_NULL:
        if (c && append_null(c)) { r->error = "column too large"; return -1; }
        return 0;
    case OP_UNION: {
        if (read_long(r, &v)) return -1;
        if (v < 0 || v >= in->a) { r->error = "union branch out of range"; return -1; }
        size_t branch = at + 1;
        for (int64_t i = 0; i < v; i++) branch += (size_t)prog[branch].b;
        return step(prog, branch, cols, r);
    }
    case OP_ARRAY: {
        size_t body = at + 1, stop = at + (size_t)in->b;
        size_t items = 0;
        for (;;) {
            int64_t n;
            if (read_long(r, &n)) return -1;
            if (n == 0) break;
            if (n < 0) {
                int64_t size;
                if (n == INT64_MIN) { r->error = "array block count out of range"; return -1; }
                n = -n;
                if (read_long(r, &size)) return -1;
            }
            if (n > r->end - r->p) { r->error = "array longer than the message"; return -1; }
            for (int64_t i = 0; i < n; i++) {
                if (run(prog, body, stop, cols, r)) return -1;
            }
            items += (size_t)n;
        }
        /* The list column's values are the end offsets of each array in its item column. */
        int32_t end = c->count ? ((int32_t *)c->values.p)[c->count - 1] : 0;
        if ((size_t)end + items > INT32_MAX) { r->error = "too many array items"; return -1; }
        end += (int32_t)items;
        return append_4(c, &end) ? (r->error = "column too large", -1) : 0;
    }
    default:
        r->error = "bad program";
        return -1;
    }
}

static int run(const Ins *prog, size_t at, size_t stop, Column *cols, Reader *r) {
    while (at < stop) {
        if (step(prog, at, cols, r)) return -1;
        at += (size_t)prog[at].b;
    }
    return 0;
}

/* Hands the column's buffers over as bytes objects, trimmed to their length. */
static PyObject *column_result(Column *c) {
    if (reserve(&c->values, 1)) return NULL;  /* an empty column still gets a buffer */
    if (c->width == 0 && reserve(&c->offsets, sizeof(int32_t))) return NULL;
    if (_PyBytes_Resize(&c->values.obj, (Py_ssize_t)c->values.len)) return NULL;
    PyObject *values = c->values.obj, *offsets = Py_None, *valid = Py_None;
    c->values.obj = NULL;
    if (c->width == 0) {
        if (_PyBytes_Resize(&c->offsets.obj, (Py_ssize_t)((c->count + 1) * sizeof(int32_t)))) {
            Py_DECREF(values);
            return NULL;
        }
        offsets = c->offsets.obj;
        c->offsets.obj = NULL;
    } else {
        Py_INCREF(Py_None);
    }
    if (c->nulls) {
        /* Arrow's validity bitmap, least significant bit first. */
        size_t nbytes = (c->count + 7) / 8;
        valid = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)nbytes);
        if (!valid) {
            Py_DECREF(values);
            Py_DECREF(offsets);
            return NULL;
        }
        uint8_t *bits = (uint8_t *)PyBytes_AS_STRING(valid);
        memset(bits, 0, nbytes);
        for (size_t i = 0; i < c->count; i++)
            if (c->valid[i]) bits[i >> 3] |= (uint8_t)(1u << (i & 7));
    } else {
        Py_INCREF(Py_None);
    }
    return Py_BuildValue("(NNNnn)", values, offsets, valid, (Py_ssize_t)c->count,
                         (Py_ssize_t)c->nulls);
}

static void free_columns(Column *cols, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(cols[i].values.obj);
        Py_XDECREF(cols[i].offsets.obj);
        free(cols[i].valid);
    }
    free(cols);
}

PyDoc_STRVAR(decode_doc,
"decode(program, columns, header, values, keys, key_column)\n"
"-> (columns, [(index, reason) of each message not decoded])\n\n"
"Runs `program` (packed int32 instructions) over each message in `values`, each of which must\n"
"start with `header` (magic and writer fingerprint) and be consumed exactly; one that fails\n"
"is left out of every column and listed with the reason. `columns` gives\n"
"each column's (value width or 0 for strings, bytes and values expected). When `key_column` >= 0, that string column's value\n"
"in each message must equal the message's key. A column is (values, offsets, validity, count,\n"
"null_count) as Arrow buffers.");

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer prog_buf;
    PyObject *specs, *values, *keys;
    const char *header;
    Py_ssize_t header_len, key_column;
    if (!PyArg_ParseTuple(args, "y*Oy#OOn", &prog_buf, &specs, &header, &header_len, &values,
                          &keys, &key_column))
        return NULL;
    PyObject *result = NULL, *failures = NULL;
    Column *cols = NULL;
    Mark *marks = NULL;
    Py_ssize_t ncols = 0;
    PyObject *vseq = PySequence_Fast(values, "values must be a sequence");
    PyObject *kseq = keys == Py_None ? NULL : PySequence_Fast(keys, "keys must be a sequence");
    PyObject *wseq = PySequence_Fast(specs, "columns must be a sequence");
    if (!vseq || !wseq || (keys != Py_None && !kseq)) goto done;
    if (prog_buf.len % sizeof(Ins)) {
        PyErr_SetString(PyExc_ValueError, "program is not whole instructions");
        goto done;
    }
    const Ins *prog = (const Ins *)prog_buf.buf;
    size_t nins = (size_t)prog_buf.len / sizeof(Ins);
    ncols = PySequence_Fast_GET_SIZE(wseq);
    for (size_t i = 0; i < nins; i++) {
        if (prog[i].col >= ncols || prog[i].a < 0 || prog[i].b < 1 ||
            i + (size_t)prog[i].b > nins) {
            PyErr_SetString(PyExc_ValueError, "program refers past its columns or end");
            goto done;
        }
    }
    cols = calloc((size_t)(ncols ? ncols : 1), sizeof(Column));
    if (!cols) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < ncols; i++) {
        Py_ssize_t w, bytes, count;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(wseq, i), "nnn", &w, &bytes, &count))
            goto done;
        cols[i].width = (int)w;
        /* Sized from the previous batch, so a batch like it is decoded without regrowing. */
        if (reserve(&cols[i].values, (size_t)(bytes > 0 ? bytes : 1))) goto done;
        if (w == 0) {
            if (reserve(&cols[i].offsets, ((size_t)(count > 0 ? count : 0) + 1) * sizeof(int32_t)))
                goto done;
            string_offsets(&cols[i])[0] = 0;
        }
    }
    if (kseq && PySequence_Fast_GET_SIZE(kseq) != PySequence_Fast_GET_SIZE(vseq)) {
        PyErr_SetString(PyExc_ValueError, "keys and values differ in length");
        goto done;
    }
    if (key_column >= ncols || (key_column >= 0 && (!kseq || cols[key_column].width != 0))) {
        PyErr_SetString(PyExc_ValueError, "key_column must be a string column, with keys");
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(vseq);
    failures = PyList_New(0);
    marks = calloc((size_t)(ncols ? ncols : 1), sizeof(Mark));
    if (!failures || !marks) { if (!marks) PyErr_NoMemory(); goto done; }
    size_t decoded = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(vseq, i);
        const char *reason = NULL;
        for (Py_ssize_t c = 0; c < ncols; c++) {
            marks[c].count = cols[c].count;
            marks[c].len = cols[c].values.len;
            marks[c].nulls = cols[c].nulls;
        }
        if (!PyBytes_Check(item)) {
            reason = "message is not bytes";
        } else {
            const uint8_t *buf = (const uint8_t *)PyBytes_AS_STRING(item);
            Py_ssize_t len = PyBytes_GET_SIZE(item);
            if (len < header_len || memcmp(buf, header, (size_t)header_len) != 0) {
                reason = "another writer schema or not single-object Avro";
            } else {
                Reader r = {buf + header_len, buf + len, NULL};
                if (run(prog, 0, nins, cols, &r)) {
                    if (PyErr_Occurred()) goto done;  /* out of memory, not a bad message */
                    reason = r.error;
                }
                else if (r.p != r.end) reason = "bytes left after the record";
            }
        }
        if (!reason && key_column >= 0) {
            PyObject *key = PySequence_Fast_GET_ITEM(kseq, i);
            Column *kc = &cols[key_column];
            size_t last = kc->count - 1;
            if (kc->count != decoded + 1 || !PyBytes_Check(key) ||
                (size_t)PyBytes_GET_SIZE(key) !=
                    (size_t)(string_offsets(kc)[last + 1] - string_offsets(kc)[last]) ||
                memcmp(PyBytes_AS_STRING(key), kc->values.p + string_offsets(kc)[last],
                       (size_t)PyBytes_GET_SIZE(key)) != 0)
                reason = "key differs from the record";
        }
        if (reason) {
            /* Take back what the message appended: the columns hold only whole records. */
            for (Py_ssize_t c = 0; c < ncols; c++) {
                cols[c].count = marks[c].count;
                cols[c].values.len = marks[c].len;
                cols[c].nulls = marks[c].nulls;
            }
            PyObject *failure = Py_BuildValue("(ns)", i, reason);
            if (!failure || PyList_Append(failures, failure)) {
                Py_XDECREF(failure);
                goto done;
            }
            Py_DECREF(failure);
        } else {
            decoded++;
        }
    }
    PyObject *out = PyList_New(ncols);
    if (!out) goto done;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        PyObject *col = column_result(&cols[i]);
        if (!col) { Py_DECREF(out); goto done; }
        PyList_SET_ITEM(out, i, col);
    }
    result = Py_BuildValue("(NO)", out, failures);
done:
    if (cols) free_columns(cols, ncols);
    free(marks);
    Py_XDECREF(failures);
    Py_XDECREF(vseq);
    Py_XDECREF(kseq);
    Py_XDECREF(wseq);
    PyBuffer_Release(&prog_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_avrocols",
    "Avro single-object messages to Arrow column buffers (see fleetline.streams.avrocols).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__avrocols(void) { return PyModule_Create(&module); }
