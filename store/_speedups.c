/*
 * The store's C accelerator: the twins of Python references in the store package, each
 * giving the same bytes and the same state as its reference (the tests name the pairs):
 *
 *   append_record  store.format.append_record: one CommitLog record, both CRCs included,
 *                  onto the batch buffer (tests/store/test_speedups.py)
 *   dispatch       store.consumequeue.dispatch: a unit joins its queues (test_speedups.py)
 *   write_run      store.append.write_run_py: the append loop's common case, built on the two
 *                  above (tests/store/test_write_run.py)
 *   prepare_run    store.append.prepare_run_py: the validation loop's common case (ditto)
 *   append_batch   store.append.append_batch_py: both loops' common case fused, one call per
 *                  batch, through the slots configure_batch names (tests/store/test_append_batch.py)
 *   stored_runs    store.results.stored_runs_py (tests/store/test_stored_runs.py)
 *
 * The record format is store/format.py's: it is drawn there, and `configure` hands this
 * module, once at load, what it writes (magic, CRC mask, the CRC trailer's key, the header
 * size and the offsets of the header fields it sets); nothing of it is spelled here but the
 * field widths, which `configure` checks. The light queues' property pair comes, per route,
 * from Python (format.inner_head); this code only appends the offsets and the separator.
 *
 *   header (header_size bytes, zeros but the fields set from `configure`'s offsets)
 *   | BODY | TOPICLENGTH 1 + TOPIC | PROPERTIESLENGTH 2 | user properties
 *   | inner_head o1,o2 \x02 | crc_prefix dddddddddd \x02   (crc32 of everything before, masked)
 *
 * The CRC is the zlib/IEEE CRC-32 (reflected 0xEDB88320), computed with slicing-by-8 tables
 * so that the module needs no zlib headers to build. Loaded (and configured) through
 * accelerators.load; without it, or with LMQTT_PURE_PYTHON, the references run.
 */
#include "kernel.h"
#include <stdint.h>
#include <string.h>

#define MAX_OFFSETS 4096
#define MAX_HEAD_SIZE 256
#define MAX_CRC_PREFIX 32
#define CRC_DIGITS 10
/* A consume-queue unit (store/format.py CQ_UNIT, ">qiq"): physical offset 8 | size 4 | tag 8. */
#define CQ_UNIT_SIZE 20

/* What `configure` was given (store.kernel.configure); set once per process. */
enum { H_TOTALSIZE, H_MAGIC, H_BODYCRC, H_QUEUEOFFSET, H_PHYSICALOFFSET, H_BORN, H_STORED,
       H_BODYLENGTH, H_COUNT };
static const int head_width[H_COUNT] = {4, 4, 4, 8, 8, 8, 8, 4};
static int configured = 0;
static uint32_t magic, crc_mask;
static Py_ssize_t head_size, head_at[H_COUNT];
static unsigned char crc_prefix[MAX_CRC_PREFIX];
static Py_ssize_t crc_prefix_len, crc_trailer_size;

static uint32_t crc_table[8][256];

static void
crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        }
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        for (int t = 1; t < 8; t++) {
            uint32_t prev = crc_table[t - 1][i];
            crc_table[t][i] = (prev >> 8) ^ crc_table[0][prev & 0xFF];
        }
    }
}

static uint32_t
crc32_of(const unsigned char *p, Py_ssize_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16
                           | (uint32_t)p[3] << 24);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF]
            ^ crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^ crc_table[3][p[4]]
            ^ crc_table[2][p[5]] ^ crc_table[1][p[6]] ^ crc_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n-- > 0) {
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

static unsigned char *
put64(unsigned char *p, long long value)
{
    uint64_t v = (uint64_t)value;
    for (int i = 7; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
    return p + 8;
}

/* Decimal digits of a non-negative value, written backwards from `end`; returns the start. */
static char *
decimal(char *end, unsigned long long v)
{
    do {
        *--end = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return end;
}

static int
as_ll(PyObject *obj, long long *out)
{
    *out = PyLong_AsLongLong(obj);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/*
 * configure(magic, crc_mask, crc_prefix, header_size, field_offsets, unit_size): the record
 * format, from store.kernel.configure. `field_offsets` are those of TOTALSIZE,
 * MAGICCODE, BODYCRC, QUEUEOFFSET, PHYSICALOFFSET, BORNTIMESTAMP, STORETIMESTAMP and
 * BODYLENGTH in the header; a layout this code cannot write (a field past the header, a
 * unit size other than its own) is refused.
 */
static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned long new_magic, new_mask;
    Py_buffer prefix;
    Py_ssize_t new_head, unit_size;
    PyObject *fields;
    if (!PyArg_ParseTuple(args, "kky*nO!n:configure", &new_magic, &new_mask, &prefix, &new_head,
                          &PyTuple_Type, &fields, &unit_size)) {
        return NULL;
    }
    Py_ssize_t at[H_COUNT];
    const char *error = NULL;
    if (prefix.len < 1 || prefix.len > MAX_CRC_PREFIX) {
        error = "configure: CRC trailer key of an unsupported length";
    }
    else if (new_head < 1 || new_head > MAX_HEAD_SIZE || unit_size != CQ_UNIT_SIZE
             || new_magic > 0xFFFFFFFFul || new_mask > 0xFFFFFFFFul) {
        error = "configure: a record layout this module cannot write";
    }
    else if (PyTuple_GET_SIZE(fields) != H_COUNT) {
        error = "configure: field_offsets needs one offset per header field written";
    }
    for (int k = 0; error == NULL && k < H_COUNT; k++) {
        at[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(fields, k));
        if (at[k] == -1 && PyErr_Occurred()) {
            PyBuffer_Release(&prefix);
            return NULL;
        }
        if (at[k] < 0 || at[k] + head_width[k] > new_head) {
            error = "configure: a header field outside the header";
        }
    }
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        PyBuffer_Release(&prefix);
        return NULL;
    }
    memcpy(crc_prefix, prefix.buf, (size_t)prefix.len);
    crc_prefix_len = prefix.len;
    crc_trailer_size = prefix.len + CRC_DIGITS + 1;
    PyBuffer_Release(&prefix);
    memcpy(head_at, at, sizeof(head_at));
    magic = (uint32_t)new_magic;
    crc_mask = (uint32_t)new_mask;
    head_size = new_head;
    configured = 1;
    Py_RETURN_NONE;
}

/*
 * The record step on C values: append one record (header, body, topic field, properties with
 * the light-queue offsets `offs[0..n)` after `head`, CRC trailer) to the bytearray `buf`.
 * *size_out is its size, or -1 (nothing appended) if it is larger than `room`. -1 on error.
 * Both append_record and append_batch write with it: one encoder, one set of bytes.
 */
static int
put_record(PyObject *buf, long long room, long long qoff, long long phys, long long born,
           long long stored, const Py_buffer *body, const Py_buffer *topic,
           const Py_buffer *uprops, const Py_buffer *head, const long long *offs, Py_ssize_t n,
           Py_ssize_t *size_out)
{
    if (n > MAX_OFFSETS) {
        PyErr_SetString(PyExc_ValueError, "append_record: too many light queues");
        return -1;
    }
    /* The offsets as text, "o1,o2,...,on\x02", at most 20 characters each with its comma. */
    char small[256];
    char *digits = small;
    Py_ssize_t cap = n * 21 + 1;
    if (cap > (Py_ssize_t)sizeof(small)) {
        digits = PyMem_Malloc((size_t)cap);
        if (digits == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    int rc = -1;
    Py_ssize_t dlen = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (offs[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "append_record: negative light-queue offset");
            goto done;
        }
        char tmp[24];
        char *start = decimal(tmp + sizeof(tmp), (unsigned long long)offs[i]);
        Py_ssize_t len = tmp + sizeof(tmp) - start;
        if (i) {
            digits[dlen++] = ',';
        }
        memcpy(digits + dlen, start, (size_t)len);
        dlen += len;
    }
    if (n) {
        digits[dlen++] = '\x02';
    }
    Py_ssize_t plen = uprops->len + (n ? head->len + dlen : 0) + crc_trailer_size;
    Py_ssize_t size = head_size + body->len + topic->len + 2 + plen;
    if (plen > 0xFFFF || size > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "append_record: record fields too long");
        goto done;
    }
    if (size > room) {
        *size_out = -1;
        rc = 0;
        goto done;
    }
    Py_ssize_t old = PyByteArray_GET_SIZE(buf);
    if (PyByteArray_Resize(buf, old + size) < 0) {
        goto done;
    }
    unsigned char *rec = (unsigned char *)PyByteArray_AS_STRING(buf) + old;
    unsigned char *p = rec;
    memset(p, 0, (size_t)head_size);
    lmqtt_put_be32(p + head_at[H_TOTALSIZE], (uint32_t)size);
    lmqtt_put_be32(p + head_at[H_MAGIC], magic);
    lmqtt_put_be32(p + head_at[H_BODYCRC], crc32_of(body->buf, body->len) & crc_mask);
    put64(p + head_at[H_QUEUEOFFSET], qoff);
    put64(p + head_at[H_PHYSICALOFFSET], phys);
    put64(p + head_at[H_BORN], born);
    put64(p + head_at[H_STORED], stored);
    lmqtt_put_be32(p + head_at[H_BODYLENGTH], (uint32_t)body->len);
    p += head_size;
    memcpy(p, body->buf, (size_t)body->len);
    p += body->len;
    memcpy(p, topic->buf, (size_t)topic->len);
    p += topic->len;
    *p++ = (unsigned char)(plen >> 8);
    *p++ = (unsigned char)(plen & 0xFF);
    memcpy(p, uprops->buf, (size_t)uprops->len);
    p += uprops->len;
    if (n) {
        memcpy(p, head->buf, (size_t)head->len);
        p += head->len;
        memcpy(p, digits, (size_t)dlen);
        p += dlen;
    }
    uint32_t crc = crc32_of(rec, p - rec) & crc_mask;
    memcpy(p, crc_prefix, (size_t)crc_prefix_len);
    p += crc_prefix_len;
    for (int i = CRC_DIGITS - 1; i >= 0; i--) {
        p[i] = (unsigned char)('0' + crc % 10);
        crc /= 10;
    }
    p[CRC_DIGITS] = '\x02';
    *size_out = size;
    rc = 0;
done:
    if (digits != small) {
        PyMem_Free(digits);
    }
    return rc;
}

/*
 * append_record(buf, room, queue_offset, physical_offset, born, stored, body, topic_field,
 *               user_props, inner_head, light_offsets) -> size, or -1 if size > room
 */
static PyObject *
append_record(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "append_record takes 11 arguments, not %zd", nargs);
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "store._speedups is not configured");
        return NULL;
    }
    PyObject *buf = args[0];
    if (!PyByteArray_Check(buf)) {
        PyErr_SetString(PyExc_TypeError, "append_record: buf must be a bytearray");
        return NULL;
    }
    long long room, qoff, phys, born, stored;
    if (as_ll(args[1], &room) || as_ll(args[2], &qoff) || as_ll(args[3], &phys)
        || as_ll(args[4], &born) || as_ll(args[5], &stored)) {
        return NULL;
    }
    PyObject *offsets = args[10];
    if (!PyTuple_Check(offsets)) {
        PyErr_SetString(PyExc_TypeError, "append_record: light_offsets must be a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(offsets);
    if (n > MAX_OFFSETS) {
        PyErr_SetString(PyExc_ValueError, "append_record: too many light queues");
        return NULL;
    }
    long long small[32];
    long long *offs = small;
    if (n > 32 && (offs = PyMem_Malloc(sizeof(long long) * (size_t)n)) == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_ll(PyTuple_GET_ITEM(offsets, i), &offs[i])) {
            goto fail_offs;
        }
    }
    Py_buffer body, topic, uprops, head;
    if (PyObject_GetBuffer(args[6], &body, PyBUF_SIMPLE) < 0) {
        goto fail_offs;
    }
    if (PyObject_GetBuffer(args[7], &topic, PyBUF_SIMPLE) < 0) {
        goto fail_body;
    }
    if (PyObject_GetBuffer(args[8], &uprops, PyBUF_SIMPLE) < 0) {
        goto fail_topic;
    }
    if (PyObject_GetBuffer(args[9], &head, PyBUF_SIMPLE) < 0) {
        goto fail_uprops;
    }
    Py_ssize_t size;
    if (put_record(buf, room, qoff, phys, born, stored, &body, &topic, &uprops, &head, offs, n,
                   &size) == 0) {
        result = PyLong_FromSsize_t(size);
    }
    PyBuffer_Release(&head);
fail_uprops:
    PyBuffer_Release(&uprops);
fail_topic:
    PyBuffer_Release(&topic);
fail_body:
    PyBuffer_Release(&body);
fail_offs:
    if (offs != small) {
        PyMem_Free(offs);
    }
    return result;
}

static PyObject *
crc32(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint32_t crc = crc32_of(data.buf, data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

/*
 * write_run(batch, i, now, buf, limit, state, generation, dirty, results, put_result)
 *   -> index of the first message not written
 *
 * Appender._section's loop over a batch (store/append.py), its common case in one
 * call: for each prepared message (route, body, user properties, born) from `i` whose route
 * is resolved for `generation` and whose record fits before `limit`, append the record (as
 * append_record does), dispatch its consume-queue unit to the route's queues (parent first:
 * store.consumequeue.dispatch, `dirty` marking a queue's first pending unit), and append its
 * PutResult(physical offset, queue offset, light offsets, end, now) to `results`. Stops
 * untouched at a route to resolve again or a record that needs the next segment: the Python
 * loop does that one (it rolls). `state` = [next physical offset, units dispatched] is
 * written back on every exit, errors included. The reference is store.append.write_run_py:
 * the same files, queues and results (tests/store/test_write_run.py, hypothesis).
 */

static PyObject *small_one;

static PyObject *w_generation, *w_parent, *w_cqs, *w_topic_field, *w_inner_head, *w_queues,
    *w_units, *w_max_offset, *w_name, *w_pending;

static int
intern_write_names(void)
{
    if (w_pending != NULL) {
        return 0;
    }
    struct { PyObject **slot; const char *text; } names[] = {
        {&w_generation, "generation"}, {&w_parent, "parent"}, {&w_cqs, "cqs"},
        {&w_topic_field, "topic_field"}, {&w_inner_head, "inner_head"},
        {&w_queues, "queues"}, {&w_units, "units"}, {&w_max_offset, "max_offset"},
        {&w_name, "name"}, {&w_pending, "pending"},
    };
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
        if ((*names[k].slot = PyUnicode_InternFromString(names[k].text)) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* cq.pending += unit; cq.max_offset += 1; a queue's first pending unit marks it dirty. */
static int
dispatch_unit(PyObject *cq, const unsigned char *unit, PyObject *dirty)
{
    PyObject *pending = PyObject_GetAttr(cq, w_pending);
    if (pending == NULL) {
        return -1;
    }
    if (!PyByteArray_Check(pending)) {
        PyErr_SetString(PyExc_TypeError, "write_run: ConsumeQueue.pending must be a bytearray");
        Py_DECREF(pending);
        return -1;
    }
    Py_ssize_t old = PyByteArray_GET_SIZE(pending);
    if (!old) {
        PyObject *name = PyObject_GetAttr(cq, w_name);
        int failed = name == NULL || PyDict_SetItem(dirty, name, cq) < 0;
        Py_XDECREF(name);
        if (failed) {
            Py_DECREF(pending);
            return -1;
        }
    }
    if (PyByteArray_Resize(pending, old + CQ_UNIT_SIZE) < 0) {
        Py_DECREF(pending);
        return -1;
    }
    memcpy(PyByteArray_AS_STRING(pending) + old, unit, CQ_UNIT_SIZE);
    Py_DECREF(pending);
    PyObject *max = PyObject_GetAttr(cq, w_max_offset);
    if (max == NULL) {
        return -1;
    }
    PyObject *next = PyNumber_Add(max, small_one);
    Py_DECREF(max);
    if (next == NULL) {
        return -1;
    }
    int failed = PyObject_SetAttr(cq, w_max_offset, next);
    Py_DECREF(next);
    return failed;
}

/*
 * dispatch(queues, unit, dirty): store.consumequeue.dispatch, the rule write_run dispatches
 * with; `unit` is one consume-queue unit (20 bytes).
 */
static PyObject *
dispatch(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "dispatch takes 3 arguments, not %zd", nargs);
        return NULL;
    }
    if (intern_write_names() < 0) {
        return NULL;
    }
    if (small_one == NULL && (small_one = PyLong_FromLong(1)) == NULL) {
        return NULL;
    }
    PyObject *dirty = args[2];
    if (!PyDict_Check(dirty)) {
        PyErr_SetString(PyExc_TypeError, "dispatch: dirty must be a dict");
        return NULL;
    }
    Py_buffer unit;
    if (PyObject_GetBuffer(args[1], &unit, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *queues = NULL;
    if (unit.len != CQ_UNIT_SIZE) {
        PyErr_SetString(PyExc_ValueError, "dispatch: a unit is 20 bytes");
        goto fail;
    }
    if ((queues = PySequence_Fast(args[0], "dispatch: queues must be a sequence")) == NULL) {
        goto fail;
    }
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(queues); k++) {
        if (dispatch_unit(PySequence_Fast_GET_ITEM(queues, k), unit.buf, dirty) < 0) {
            goto fail;
        }
    }
    Py_DECREF(queues);
    PyBuffer_Release(&unit);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(queues);
    PyBuffer_Release(&unit);
    return NULL;
}

/*
 * The runs' state = [next physical offset, units dispatched] written back into its list on
 * every exit, a pending error (`failed`) kept as it was: 0, or -1 with an error set (the
 * pending one, or a failed allocation's).
 */
static int
state_write_back(PyObject *state, long long phys, long long units, int failed)
{
    PyObject *exc_type = NULL, *exc = NULL, *exc_tb = NULL;
    if (failed) {
        PyErr_Fetch(&exc_type, &exc, &exc_tb);
    }
    PyObject *p = PyLong_FromLongLong(phys), *u = PyLong_FromLongLong(units);
    if (p == NULL || u == NULL) {
        Py_XDECREF(p);
        Py_XDECREF(u);
        Py_XDECREF(exc_type);
        Py_XDECREF(exc);
        Py_XDECREF(exc_tb);
        return -1;
    }
    PyList_SetItem(state, 0, p);
    PyList_SetItem(state, 1, u);
    if (failed) {
        PyErr_Restore(exc_type, exc, exc_tb);
        return -1;
    }
    return 0;
}

static PyObject *
write_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "write_run takes 10 arguments, not %zd", nargs);
        return NULL;
    }
    if (intern_write_names() < 0) {
        return NULL;
    }
    if (small_one == NULL && (small_one = PyLong_FromLong(1)) == NULL) {
        return NULL;
    }
    PyObject *batch = args[0], *now = args[2], *buf = args[3], *state = args[5];
    PyObject *gen = args[6], *dirty = args[7], *results = args[8];
    PyObject *put_result = args[9];
    if (!PyList_Check(batch) || !PyList_Check(state) || PyList_GET_SIZE(state) != 2
        || !PyDict_Check(dirty) || !PyList_Check(results) || !PyType_Check(put_result)
        || !PyType_IsSubtype((PyTypeObject *)put_result, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "write_run: unexpected argument types");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    long long limit, phys, units;
    if ((i == -1 && PyErr_Occurred()) || as_ll(args[4], &limit)
        || as_ll(PyList_GET_ITEM(state, 0), &phys) || as_ll(PyList_GET_ITEM(state, 1), &units)) {
        return NULL;
    }
    PyTypeObject *result_type = (PyTypeObject *)put_result;
    int failed = 0;
    Py_ssize_t n = PyList_GET_SIZE(batch);
    for (; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(batch, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_SetString(PyExc_TypeError, "write_run: a batch item is not a 4-tuple");
            failed = 1;
            break;
        }
        PyObject *route = PyTuple_GET_ITEM(item, 0), *born = PyTuple_GET_ITEM(item, 3);
        PyObject *rgen = PyObject_GetAttr(route, w_generation);
        if (rgen == NULL) {
            failed = 1;
            break;
        }
        int same = PyObject_RichCompareBool(rgen, gen, Py_EQ);
        Py_DECREF(rgen);
        if (same <= 0) {
            failed = same < 0;
            break; /* resolve the route first: the Python loop */
        }
        PyObject *parent = PyObject_GetAttr(route, w_parent);
        PyObject *cqs = parent ? PyObject_GetAttr(route, w_cqs) : NULL;
        PyObject *qoff = cqs ? PyObject_GetAttr(parent, w_max_offset) : NULL;
        PyObject *lo = qoff ? PyDict_New() : NULL;
        PyObject *offsets = NULL, *size_obj = NULL, *result = NULL;
        PyObject *room = NULL, *phys_obj = NULL, *queues = NULL;
        Py_ssize_t size = -1;
        if (lo == NULL || !PyTuple_Check(cqs)) {
            if (lo != NULL) {
                PyErr_SetString(PyExc_TypeError, "write_run: route.cqs must be a tuple");
            }
            failed = 1;
            goto next;
        }
        Py_ssize_t ncq = PyTuple_GET_SIZE(cqs);
        if ((offsets = PyTuple_New(ncq)) == NULL) {
            failed = 1;
            goto next;
        }
        for (Py_ssize_t k = 0; k < ncq; k++) {
            PyObject *cq = PyTuple_GET_ITEM(cqs, k);
            PyObject *name = PyObject_GetAttr(cq, w_name);
            PyObject *off = name ? PyObject_GetAttr(cq, w_max_offset) : NULL;
            if (off == NULL || PyDict_SetItem(lo, name, off) < 0) {
                Py_XDECREF(name);
                Py_XDECREF(off);
                failed = 1;
                goto next;
            }
            Py_DECREF(name);
            Py_DECREF(off);
        }
        /* tuple(lo.values()): a name twice in cqs keeps its first place, as in a dict */
        {
            Py_ssize_t pos = 0, k = 0;
            PyObject *key, *value;
            while (PyDict_Next(lo, &pos, &key, &value)) {
                Py_INCREF(value);
                PyTuple_SET_ITEM(offsets, k++, value);
            }
            if (k != ncq && _PyTuple_Resize(&offsets, k) < 0) {
                failed = 1;
                goto next;
            }
        }
        room = PyLong_FromLongLong(limit - phys);
        phys_obj = room ? PyLong_FromLongLong(phys) : NULL;
        PyObject *topic_field = phys_obj ? PyObject_GetAttr(route, w_topic_field) : NULL;
        PyObject *inner_head = topic_field ? PyObject_GetAttr(route, w_inner_head) : NULL;
        if (inner_head == NULL) {
            Py_XDECREF(topic_field);
            failed = 1;
            goto next;
        }
        PyObject *argv[11] = {buf, room, qoff, phys_obj, born == Py_None ? now : born, now,
                              PyTuple_GET_ITEM(item, 1), topic_field, PyTuple_GET_ITEM(item, 2),
                              inner_head, offsets};
        size_obj = append_record(module, argv, 11);
        Py_DECREF(topic_field);
        Py_DECREF(inner_head);
        if (size_obj == NULL || ((size = PyLong_AsSsize_t(size_obj)) == -1 && PyErr_Occurred())) {
            failed = 1;
            goto next;
        }
        if (size < 0) {
            goto next; /* the next segment: the Python loop rolls */
        }
        {
            unsigned char unit[CQ_UNIT_SIZE];
            put64(unit, phys);
            lmqtt_put_be32(unit + 8, (uint32_t)size);
            memset(unit + 12, 0, 8);
            queues = PyObject_GetAttr(route, w_queues);
            if (queues == NULL || !PyTuple_Check(queues)) {
                if (queues != NULL) {
                    PyErr_SetString(PyExc_TypeError, "write_run: route.queues must be a tuple");
                }
                failed = 1;
                goto next;
            }
            for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(queues); k++) {
                if (dispatch_unit(PyTuple_GET_ITEM(queues, k), unit, dirty) < 0) {
                    failed = 1;
                    goto next;
                }
            }
        }
        {
            long long route_units;
            PyObject *u = PyObject_GetAttr(route, w_units);
            int bad = u == NULL || as_ll(u, &route_units);
            Py_XDECREF(u);
            if (bad) {
                failed = 1;
                goto next;
            }
            units += route_units;
        }
        if ((result = result_type->tp_alloc(result_type, 5)) == NULL) {
            failed = 1;
            goto next;
        }
        PyObject *end = PyLong_FromLongLong(phys + size);
        if (end == NULL) {
            failed = 1;
            goto next;
        }
        Py_INCREF(phys_obj);
        PyTuple_SET_ITEM(result, 0, phys_obj);
        Py_INCREF(qoff);
        PyTuple_SET_ITEM(result, 1, qoff);
        Py_INCREF(lo);
        PyTuple_SET_ITEM(result, 2, lo);
        PyTuple_SET_ITEM(result, 3, end);
        Py_INCREF(now);
        PyTuple_SET_ITEM(result, 4, now);
        if (PyList_Append(results, result) < 0) {
            failed = 1;
            goto next;
        }
        phys += size;
    next:
        Py_XDECREF(parent);
        Py_XDECREF(cqs);
        Py_XDECREF(qoff);
        Py_XDECREF(lo);
        Py_XDECREF(offsets);
        Py_XDECREF(size_obj);
        Py_XDECREF(result);
        Py_XDECREF(room);
        Py_XDECREF(phys_obj);
        Py_XDECREF(queues);
        if (failed || size < 0) {
            break;
        }
    }
    if (state_write_back(state, phys, units, failed) < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(i);
}

/*
 * stored_runs(messages, props, results, stored_message) -> {queue: (messages, body bytes)}
 *
 * The StoredMessages an appended batch adds to each of its light queues, built from what
 * the append had and returned (no read back): message k is (parent topic, light queues,
 * body, property block) with its properties dict props[k] and its PutResult results[k]
 * (physical offset, parent queue offset, {light queue: offset}, end, store timestamp). Per
 * light queue, in batch order: StoredMessage(parent, body, props, light offset, physical
 * offset, timestamp, timestamp, parent offset, queues), where queues is the message's own
 * tuple when it names each light queue once, else the queues in dispatch order; with the
 * sum of their body lengths. The reference is store.results.stored_runs_py
 * (tests/store/test_stored_runs.py, hypothesis); gateway/messages/recent.py fills its cache with it.
 */
static PyObject *
stored_runs(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "stored_runs takes 4 arguments, not %zd", nargs);
        return NULL;
    }
    PyObject *messages = args[0], *props = args[1], *results = args[2], *type = args[3];
    if (!PyList_Check(messages) || !PyList_Check(props) || !PyList_Check(results)
        || !PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "stored_runs: unexpected argument types");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(messages);
    if (PyList_GET_SIZE(props) != n || PyList_GET_SIZE(results) != n) {
        PyErr_SetString(PyExc_ValueError, "stored_runs: messages, props and results differ in length");
        return NULL;
    }
    PyTypeObject *stored = (PyTypeObject *)type;
    PyObject *runs = PyDict_New();
    if (runs == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *m = PyList_GET_ITEM(messages, k), *r = PyList_GET_ITEM(results, k);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 4 || !PyTuple_Check(r)
            || PyTuple_GET_SIZE(r) < 5 || !PyDict_Check(PyTuple_GET_ITEM(r, 2))) {
            PyErr_SetString(PyExc_TypeError, "stored_runs: a message or result of another shape");
            goto fail;
        }
        PyObject *lights = PyTuple_GET_ITEM(r, 2);
        Py_ssize_t nl = PyDict_GET_SIZE(lights);
        if (!nl) {
            continue;
        }
        PyObject *routed = PyTuple_GET_ITEM(m, 1);
        PyObject *queues;
        if (PyObject_Length(routed) == nl) {
            Py_INCREF(routed);
            queues = routed;
        }
        else if (PyErr_Occurred() || (queues = PySequence_Tuple(lights)) == NULL) {
            goto fail;
        }
        PyObject *fields[9] = {PyTuple_GET_ITEM(m, 0), PyTuple_GET_ITEM(m, 2),
                               PyList_GET_ITEM(props, k), NULL, PyTuple_GET_ITEM(r, 0),
                               PyTuple_GET_ITEM(r, 4), PyTuple_GET_ITEM(r, 4),
                               PyTuple_GET_ITEM(r, 1), queues};
        Py_ssize_t pos = 0;
        PyObject *q, *off;
        while (PyDict_Next(lights, &pos, &q, &off)) {
            PyObject *sm = stored->tp_alloc(stored, 9);
            if (sm == NULL) {
                Py_DECREF(queues);
                goto fail;
            }
            fields[3] = off;
            for (int f = 0; f < 9; f++) {
                Py_INCREF(fields[f]);
                PyTuple_SET_ITEM(sm, f, fields[f]);
            }
            PyObject *run = PyDict_GetItemWithError(runs, q);
            int failed;
            if (run != NULL) {
                failed = PyList_Append(run, sm);
            }
            else if (PyErr_Occurred()) {
                failed = -1;
            }
            else {
                PyObject *fresh = PyList_New(1);
                failed = fresh == NULL ? -1 : 0;
                if (fresh != NULL) {
                    Py_INCREF(sm);
                    PyList_SET_ITEM(fresh, 0, sm);
                    failed = PyDict_SetItem(runs, q, fresh);
                    Py_DECREF(fresh);
                }
            }
            Py_DECREF(sm);
            if (failed < 0) {
                Py_DECREF(queues);
                goto fail;
            }
        }
        Py_DECREF(queues);
    }
    /* {queue: run} -> {queue: (run, body bytes)} */
    {
        Py_ssize_t pos = 0;
        PyObject *q, *run;
        while (PyDict_Next(runs, &pos, &q, &run)) {
            long long nbytes = 0;
            for (Py_ssize_t j = 0; j < PyList_GET_SIZE(run); j++) {
                Py_ssize_t len = PyObject_Length(PyTuple_GET_ITEM(PyList_GET_ITEM(run, j), 1));
                if (len < 0) {
                    goto fail;
                }
                nbytes += len;
            }
            PyObject *pair = Py_BuildValue("(OL)", run, nbytes);
            if (pair == NULL || PyDict_SetItem(runs, q, pair) < 0) { /* same key: no resize */
                Py_XDECREF(pair);
                goto fail;
            }
            Py_DECREF(pair);
        }
    }
    return runs;
fail:
    Py_DECREF(runs);
    return NULL;
}

/*
 * prepare_run(messages, i, routes, max_body, born, batch, touched) -> index of the first left
 *
 * Appender.append's validation loop, its common case: for each (topic, light
 * queues, body, property block) from `messages[i]` on whose route is cached (`routes`,
 * keyed by (topic, light queues)) and whose body and properties fit the route's worst-case
 * room (`size_room`, `props_room`) and `max_body`, append (route, body, block, born) to
 * `batch` and mark the route in `touched`. Stops untouched at a message to route or to check
 * in full: the Python loop does it (and raises what it must). The reference is
 * store.append.prepare_run_py (tests/store/test_write_run.py runs stores on both).
 */
static PyObject *w_size_room, *w_props_room;

static PyObject *
prepare_run(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "prepare_run takes 7 arguments, not %zd", nargs);
        return NULL;
    }
    PyObject *messages = args[0], *routes = args[2], *born = args[4];
    PyObject *batch = args[5], *touched = args[6];
    if (!PyList_Check(messages) || !PyDict_Check(routes) || !PyList_Check(batch)
        || !PyDict_Check(touched)) {
        PyErr_SetString(PyExc_TypeError, "prepare_run: unexpected argument types");
        return NULL;
    }
    if (w_props_room == NULL
        && ((w_size_room = PyUnicode_InternFromString("size_room")) == NULL
            || (w_props_room = PyUnicode_InternFromString("props_room")) == NULL)) {
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    long long max_body;
    if ((i == -1 && PyErr_Occurred()) || as_ll(args[3], &max_body)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(messages);
    for (; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 4) {
            break;
        }
        PyObject *body = PyTuple_GET_ITEM(m, 2), *uprops = PyTuple_GET_ITEM(m, 3);
        if (!PyBytes_Check(body) || !PyBytes_Check(uprops)) {
            break;
        }
        PyObject *key = PyTuple_Pack(2, PyTuple_GET_ITEM(m, 0), PyTuple_GET_ITEM(m, 1));
        if (key == NULL) {
            return NULL;
        }
        PyObject *route = PyDict_GetItemWithError(routes, key);
        Py_DECREF(key);
        if (route == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            break; /* a new route: validated and cached by the Python loop */
        }
        long long blen = PyBytes_GET_SIZE(body), plen = PyBytes_GET_SIZE(uprops);
        long long size_room, props_room;
        PyObject *a = PyObject_GetAttr(route, w_size_room);
        PyObject *b = a ? PyObject_GetAttr(route, w_props_room) : NULL;
        int bad = b == NULL || as_ll(a, &size_room) || as_ll(b, &props_room);
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (bad) {
            return NULL;
        }
        if (blen > max_body || blen + plen > size_room || plen > props_room) {
            break; /* checked in full (and refused, or not) by the Python loop */
        }
        PyObject *item = PyTuple_Pack(4, route, body, uprops, born);
        if (item == NULL || PyList_Append(batch, item) < 0
            || PyDict_SetItem(touched, route, Py_None) < 0) {
            Py_XDECREF(item);
            return NULL;
        }
        Py_DECREF(item);
    }
    return PyLong_FromSsize_t(i);
}

/*
 * append_batch(messages, routes, max_body, now, buf, limit, state, generation, dirty, results,
 *              put_result, ends) -> index of the first message not written, or -1
 *
 * Appender.append's common case as one call under the store lock (store/append.py
 * Appender._append_common): the validation of prepare_run and the writing of write_run fused,
 * with no prepared tuple per message. First every message (topic, light queues tuple, body,
 * property block) is checked: its route cached in `routes` (keyed by (topic, light queues)),
 * resolved for `generation`, body and properties within the route's worst-case room and
 * `max_body`. If one is not, nothing is written or changed and the answer is -1 (the general
 * loops do the batch). Otherwise the records are written from the first on as write_run
 * writes them (born = stored = `now`): record, its unit dispatched to the route's queues, its
 * PutResult(physical offset, queue offset, {light queue: offset}, end, now) in `results`.
 * A record that needs the next segment stops the run (the general loop rolls and writes the
 * rest); when all were written, `ends` gets what Appender._notify would tell the listeners:
 * every queue the batch touched and where it ends, the routes in batch order. `state` =
 * [next physical offset, units dispatched] is written back on every exit, errors included.
 *
 * Routes and consume-queue states are read and set through their slots, whose names
 * configure_batch was given (store.kernel.configure); an object of another type, or a slot
 * not set, makes the batch the general loops'. The reference is store.append.append_batch_py
 * (tests/store/test_append_batch.py: the same files, queues, results and notices).
 */
enum { R_GENERATION, R_PARENT, R_CQS, R_QUEUES, R_TOPIC, R_TOPIC_FIELD, R_INNER_HEAD, R_UNITS,
       R_SIZE_ROOM, R_PROPS_ROOM, R_COUNT };
enum { Q_NAME, Q_MAX_OFFSET, Q_PENDING, Q_COUNT };
static PyObject *route_type, *cq_type;
static Py_ssize_t route_at[R_COUNT], cq_at[Q_COUNT];
#define SLOT(obj, at) (*(PyObject **)((char *)(obj) + (at)))

/* configure_batch(route_type, route_slots, queue_type, queue_slots): the types append_batch
 * reads and their slot names, in the order of R_* and Q_* above (store.kernel.configure). */
static PyObject *
configure_batch(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *rtype, *rslots, *qtype, *qslots;
    if (!PyArg_ParseTuple(args, "O!O!O!O!:configure_batch", &PyType_Type, &rtype,
                          &PyTuple_Type, &rslots, &PyType_Type, &qtype, &PyTuple_Type, &qslots)) {
        return NULL;
    }
    if (PyTuple_GET_SIZE(rslots) != R_COUNT || PyTuple_GET_SIZE(qslots) != Q_COUNT) {
        PyErr_SetString(PyExc_ValueError, "configure_batch: a slot name per field read");
        return NULL;
    }
    const char *rnames[R_COUNT], *qnames[Q_COUNT];
    for (int k = 0; k < R_COUNT; k++) {
        if ((rnames[k] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(rslots, k))) == NULL) {
            return NULL;
        }
    }
    for (int k = 0; k < Q_COUNT; k++) {
        if ((qnames[k] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(qslots, k))) == NULL) {
            return NULL;
        }
    }
    Py_ssize_t rat[R_COUNT], qat[Q_COUNT];
    if (lmqtt_slot_offsets("configure_batch", rtype, rnames, R_COUNT, rat) < 0
        || lmqtt_slot_offsets("configure_batch", qtype, qnames, Q_COUNT, qat) < 0) {
        return NULL;
    }
    memcpy(route_at, rat, sizeof(rat));
    memcpy(cq_at, qat, sizeof(qat));
    Py_INCREF(rtype);
    Py_XSETREF(route_type, rtype);
    Py_INCREF(qtype);
    Py_XSETREF(cq_type, qtype);
    Py_RETURN_NONE;
}

/* A consume-queue state append_batch can dispatch to: its type, its slots set and typed. */
static int
usable_queue(PyObject *cq)
{
    if (!Py_IS_TYPE(cq, (PyTypeObject *)cq_type)) {
        return 0;
    }
    PyObject *name = SLOT(cq, cq_at[Q_NAME]), *max = SLOT(cq, cq_at[Q_MAX_OFFSET]);
    PyObject *pending = SLOT(cq, cq_at[Q_PENDING]);
    return name != NULL && PyUnicode_CheckExact(name) && max != NULL && PyLong_CheckExact(max)
           && pending != NULL && PyByteArray_CheckExact(pending);
}

/* A route append_batch can write: resolved for `gen`, its fields set and typed. */
static int
usable_route(PyObject *route, long long gen)
{
    if (!Py_IS_TYPE(route, (PyTypeObject *)route_type)) {
        return 0;
    }
    for (int k = 0; k < R_COUNT; k++) {
        if (SLOT(route, route_at[k]) == NULL) {
            return 0;
        }
    }
    PyObject *g = SLOT(route, route_at[R_GENERATION]);
    if (!PyLong_CheckExact(g) || PyLong_AsLongLong(g) != gen) {
        PyErr_Clear();
        return 0;
    }
    PyObject *cqs = SLOT(route, route_at[R_CQS]), *queues = SLOT(route, route_at[R_QUEUES]);
    if (!PyTuple_CheckExact(cqs) || !PyTuple_CheckExact(queues)
        || PyTuple_GET_SIZE(queues) != PyTuple_GET_SIZE(cqs) + 1
        || PyTuple_GET_SIZE(cqs) > MAX_OFFSETS
        || PyTuple_GET_ITEM(queues, 0) != SLOT(route, route_at[R_PARENT])
        || !PyBytes_CheckExact(SLOT(route, route_at[R_TOPIC_FIELD]))
        || !PyBytes_CheckExact(SLOT(route, route_at[R_INNER_HEAD]))
        || !PyUnicode_CheckExact(SLOT(route, route_at[R_TOPIC]))
        || !PyLong_CheckExact(SLOT(route, route_at[R_UNITS]))) {
        return 0;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(queues); k++) {
        if (!usable_queue(PyTuple_GET_ITEM(queues, k))
            || (k && PyTuple_GET_ITEM(queues, k) != PyTuple_GET_ITEM(cqs, k - 1))) {
            return 0;
        }
    }
    return 1;
}

/* dispatch's rule on a usable queue: the unit joins `pending`, max_offset moves by one. */
static int
dispatch_slot(PyObject *cq, const unsigned char *unit, PyObject *dirty)
{
    PyObject *pending = SLOT(cq, cq_at[Q_PENDING]);
    Py_ssize_t old = PyByteArray_GET_SIZE(pending);
    if (!old && PyDict_SetItem(dirty, SLOT(cq, cq_at[Q_NAME]), cq) < 0) {
        return -1;
    }
    if (PyByteArray_Resize(pending, old + CQ_UNIT_SIZE) < 0) {
        return -1;
    }
    memcpy(PyByteArray_AS_STRING(pending) + old, unit, CQ_UNIT_SIZE);
    long long max = PyLong_AsLongLong(SLOT(cq, cq_at[Q_MAX_OFFSET]));
    if (max == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *next = PyLong_FromLongLong(max + 1);
    if (next == NULL) {
        return -1;
    }
    Py_SETREF(SLOT(cq, cq_at[Q_MAX_OFFSET]), next);
    return 0;
}

static PyObject *
append_batch(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "append_batch takes 12 arguments, not %zd", nargs);
        return NULL;
    }
    if (!configured || route_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "store._speedups is not configured");
        return NULL;
    }
    PyObject *messages = args[0], *routes = args[1], *now = args[3], *buf = args[4];
    PyObject *state = args[6], *dirty = args[8], *results = args[9], *put_result = args[10];
    PyObject *ends = args[11];
    if (!PyList_Check(messages) || !PyDict_Check(routes) || !PyByteArray_Check(buf)
        || !PyList_Check(state) || PyList_GET_SIZE(state) != 2 || !PyDict_Check(dirty)
        || !PyList_Check(results) || !PyType_Check(put_result)
        || !PyType_IsSubtype((PyTypeObject *)put_result, &PyTuple_Type) || !PyDict_Check(ends)) {
        PyErr_SetString(PyExc_TypeError, "append_batch: unexpected argument types");
        return NULL;
    }
    long long max_body, now_ll, limit, gen, phys, units;
    if (as_ll(args[2], &max_body) || as_ll(now, &now_ll) || as_ll(args[5], &limit)
        || as_ll(args[7], &gen) || as_ll(PyList_GET_ITEM(state, 0), &phys)
        || as_ll(PyList_GET_ITEM(state, 1), &units)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(messages);
    /* The batch's messages and routes, held for the call: routes[k], messages[k] */
    PyObject **held = PyMem_Calloc((size_t)(2 * n + 1), sizeof(PyObject *));
    if (held == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t i = -1;
    int failed = 0;
    /* 1. The checks: every message on a usable route, within its room, or none is written. */
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *m = PyList_GET_ITEM(messages, k);
        if (!PyTuple_CheckExact(m) || PyTuple_GET_SIZE(m) != 4
            || !PyTuple_CheckExact(PyTuple_GET_ITEM(m, 1))
            || !PyBytes_Check(PyTuple_GET_ITEM(m, 2)) || !PyBytes_Check(PyTuple_GET_ITEM(m, 3))) {
            goto release;
        }
        PyObject *key = PyTuple_Pack(2, PyTuple_GET_ITEM(m, 0), PyTuple_GET_ITEM(m, 1));
        if (key == NULL) {
            failed = 1;
            goto release;
        }
        PyObject *route = PyDict_GetItemWithError(routes, key);
        Py_DECREF(key);
        if (route == NULL) {
            failed = PyErr_Occurred() != NULL;
            goto release;
        }
        if (!usable_route(route, gen)) {
            goto release;
        }
        long long size_room, props_room;
        if (as_ll(SLOT(route, route_at[R_SIZE_ROOM]), &size_room)
            || as_ll(SLOT(route, route_at[R_PROPS_ROOM]), &props_room)) {
            failed = 1;
            goto release;
        }
        long long blen = PyBytes_GET_SIZE(PyTuple_GET_ITEM(m, 2));
        long long plen = PyBytes_GET_SIZE(PyTuple_GET_ITEM(m, 3));
        if (blen > max_body || blen + plen > size_room || plen > props_room) {
            goto release;
        }
        Py_INCREF(route);
        held[k] = route;
        Py_INCREF(m);
        held[n + k] = m;
    }
    /* 2. The records, their units and results, as write_run makes them. */
    for (i = 0; i < n; i++) {
        PyObject *route = held[i], *m = held[n + i];
        PyObject *parent = SLOT(route, route_at[R_PARENT]), *cqs = SLOT(route, route_at[R_CQS]);
        PyObject *queues = SLOT(route, route_at[R_QUEUES]);
        Py_ssize_t ncq = PyTuple_GET_SIZE(cqs);
        PyObject *qoff = SLOT(parent, cq_at[Q_MAX_OFFSET]);
        Py_INCREF(qoff); /* dispatch replaces the slot's value */
        long long qoff_ll, offs_small[32];
        long long *offs = offs_small;
        PyObject *lo = PyDict_New(), *phys_obj = NULL, *end = NULL, *result = NULL;
        Py_ssize_t size = -1;
        if (lo == NULL || as_ll(qoff, &qoff_ll)) {
            failed = 1;
            goto next;
        }
        if (ncq > 32 && (offs = PyMem_Malloc(sizeof(long long) * (size_t)ncq)) == NULL) {
            PyErr_NoMemory();
            failed = 1;
            goto next;
        }
        for (Py_ssize_t k = 0; k < ncq; k++) {
            PyObject *cq = PyTuple_GET_ITEM(cqs, k);
            if (PyDict_SetItem(lo, SLOT(cq, cq_at[Q_NAME]), SLOT(cq, cq_at[Q_MAX_OFFSET])) < 0) {
                failed = 1;
                goto next;
            }
        }
        /* tuple(lo.values()): a name twice in cqs keeps its first place, as in a dict */
        Py_ssize_t nlo = 0;
        {
            Py_ssize_t pos = 0;
            PyObject *key, *value;
            while (PyDict_Next(lo, &pos, &key, &value)) {
                if (as_ll(value, &offs[nlo++])) {
                    failed = 1;
                    goto next;
                }
            }
        }
        {
            PyObject *body = PyTuple_GET_ITEM(m, 2), *uprops = PyTuple_GET_ITEM(m, 3);
            PyObject *tf = SLOT(route, route_at[R_TOPIC_FIELD]);
            PyObject *ih = SLOT(route, route_at[R_INNER_HEAD]);
            Py_buffer b = {0}, t = {0}, u = {0}, h = {0};
            b.buf = PyBytes_AS_STRING(body);
            b.len = PyBytes_GET_SIZE(body);
            t.buf = PyBytes_AS_STRING(tf);
            t.len = PyBytes_GET_SIZE(tf);
            u.buf = PyBytes_AS_STRING(uprops);
            u.len = PyBytes_GET_SIZE(uprops);
            h.buf = PyBytes_AS_STRING(ih);
            h.len = PyBytes_GET_SIZE(ih);
            if (put_record(buf, limit - phys, qoff_ll, phys, now_ll, now_ll, &b, &t, &u, &h, offs,
                           nlo, &size) < 0) {
                failed = 1;
                goto next;
            }
        }
        if (size < 0) {
            goto next; /* the next segment: the general loop rolls */
        }
        {
            unsigned char unit[CQ_UNIT_SIZE];
            put64(unit, phys);
            lmqtt_put_be32(unit + 8, (uint32_t)size);
            memset(unit + 12, 0, 8);
            for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(queues); k++) {
                if (dispatch_slot(PyTuple_GET_ITEM(queues, k), unit, dirty) < 0) {
                    failed = 1;
                    goto next;
                }
            }
            long long route_units;
            if (as_ll(SLOT(route, route_at[R_UNITS]), &route_units)) {
                failed = 1;
                goto next;
            }
            units += route_units;
        }
        if ((phys_obj = PyLong_FromLongLong(phys)) == NULL
            || (end = PyLong_FromLongLong(phys + size)) == NULL
            || (result = ((PyTypeObject *)put_result)->tp_alloc((PyTypeObject *)put_result, 5))
                   == NULL) {
            failed = 1;
            goto next;
        }
        PyTuple_SET_ITEM(result, 0, phys_obj);
        phys_obj = NULL;
        Py_INCREF(qoff);
        PyTuple_SET_ITEM(result, 1, qoff);
        Py_INCREF(lo);
        PyTuple_SET_ITEM(result, 2, lo);
        PyTuple_SET_ITEM(result, 3, end);
        end = NULL;
        Py_INCREF(now);
        PyTuple_SET_ITEM(result, 4, now);
        if (PyList_Append(results, result) < 0) {
            failed = 1;
            goto next;
        }
        phys += size;
    next:
        Py_DECREF(qoff);
        Py_XDECREF(lo);
        Py_XDECREF(phys_obj);
        Py_XDECREF(end);
        Py_XDECREF(result);
        if (offs != offs_small) {
            PyMem_Free(offs);
        }
        if (failed || size < 0) {
            break;
        }
    }
    /* 3. All written: where each queue touched ends, the routes in batch order. */
    for (Py_ssize_t k = 0; !failed && i == n && k < n; k++) {
        PyObject *route = held[k], *cqs = SLOT(route, route_at[R_CQS]);
        PyObject *parent = SLOT(route, route_at[R_PARENT]);
        if (PyDict_SetItem(ends, SLOT(route, route_at[R_TOPIC]),
                           SLOT(parent, cq_at[Q_MAX_OFFSET])) < 0) {
            failed = 1;
            break;
        }
        for (Py_ssize_t q = 0; q < PyTuple_GET_SIZE(cqs); q++) {
            PyObject *cq = PyTuple_GET_ITEM(cqs, q);
            if (PyDict_SetItem(ends, SLOT(cq, cq_at[Q_NAME]), SLOT(cq, cq_at[Q_MAX_OFFSET])) < 0) {
                failed = 1;
                break;
            }
        }
    }
    if (state_write_back(state, phys, units, failed) < 0) {
        failed = 1;
    }
release:
    for (Py_ssize_t k = 0; k < 2 * n; k++) {
        Py_XDECREF(held[k]);
    }
    PyMem_Free(held);
    if (failed) {
        return NULL;
    }
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(magic, crc_mask, crc_prefix, header_size, field_offsets, unit_size): the "
     "record format to write (store.kernel.configure)."},
    {"append_record", (PyCFunction)(void (*)(void))append_record, METH_FASTCALL,
     "append_record(buf, room, queue_offset, physical_offset, born, stored, body, "
     "topic_field, user_props, inner_head, light_offsets) -> record size, or -1 (nothing "
     "appended) if it is larger than room. See store.format.append_record."},
    {"crc32", crc32, METH_O, "crc32(data) -> zlib.crc32(data), by this module's tables."},
    {"stored_runs", (PyCFunction)(void (*)(void))stored_runs, METH_FASTCALL,
     "stored_runs(messages, props, results, stored_message) -> {queue: (messages, bytes)}: "
     "the StoredMessages an appended batch adds per light queue (store.results.stored_runs_py)."},
    {"prepare_run", (PyCFunction)(void (*)(void))prepare_run, METH_FASTCALL,
     "prepare_run(messages, i, routes, max_body, born, batch, touched) -> i: "
     "Appender.append's validation loop, its common case (store.append.prepare_run_py)."},
    {"dispatch", (PyCFunction)(void (*)(void))dispatch, METH_FASTCALL,
     "dispatch(queues, unit, dirty): the unit joins every queue (store.consumequeue.dispatch)."},
    {"configure_batch", configure_batch, METH_VARARGS,
     "configure_batch(route_type, route_slots, queue_type, queue_slots): what append_batch "
     "reads, by slot (store.kernel.configure)."},
    {"append_batch", (PyCFunction)(void (*)(void))append_batch, METH_FASTCALL,
     "append_batch(messages, routes, max_body, now, buf, limit, state, generation, dirty, "
     "results, put_result, ends) -> i, or -1: Appender.append's common case in one call "
     "(store.append.append_batch_py)."},
    {"write_run", (PyCFunction)(void (*)(void))write_run, METH_FASTCALL,
     "write_run(batch, i, now, buf, limit, state, generation, dirty, results, put_result) "
     "-> i: Appender._section's loop, its common case (store.append.write_run_py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "store._speedups",
    .m_doc = "Optional C accelerator of the store: twins of its append and dispatch loops.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    crc_init();
    return lmqtt_module(&module_def);
}
