/*
 * Optional C accelerator of the store: `append_record`, the per-message step of
 * MessageStore._write_locked (build one CommitLog record, both CRCs included, onto the batch
 * buffer).
 *
 * Why C: in a publisher flood the batch writer spent ~1.9 us per message in Python, a quarter
 * of the gateway's CPU per message, nearly all of it interpreter overhead around a header
 * pack, two CRCs, a property format, two joins and the trailer format. This does the same in
 * one call. The Python reference is store.format.append_record; the two produce the same
 * bytes (tests/store/test_speedups.py, hypothesis), and the store falls back to it when this
 * module was not built or LMQTT_PURE_PYTHON=1.
 *
 * The record layout is drawn in store/format.py; in short (big-endian):
 *
 *   0 TOTALSIZE 4 | MAGIC 4 | BODYCRC 4 | QUEUEID+FLAG 8 (0) | QUEUEOFFSET 8 | PHYSICALOFFSET 8
 *   | SYSFLAG 4 (0) | BORNTIMESTAMP 8 | BORNHOST 8 (0) | STORETIMESTAMP 8 | STOREHOST 8 (0)
 *   | RECONSUMETIMES 4 (0) | PREPAREDTXOFFSET 8 (0) | BODYLENGTH 4   = 88 bytes
 *   BODY | TOPICLENGTH 1 + TOPIC | PROPERTIESLENGTH 2 | user properties
 *   | INNER_MULTI_DISPATCH \x01 q1,q2 \x02 INNER_MULTI_QUEUE_OFFSET \x01 o1,o2 \x02
 *   | "__CRC32#" \x01 dddddddddd \x02      (crc32 of everything before it, & 0x7FFFFFFF)
 *
 * The CRC is the zlib/IEEE CRC-32 (reflected 0xEDB88320), computed here with slicing-by-8
 * tables so that the module needs no zlib headers to build.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef LMQTT_SOURCE_SHA256
#define LMQTT_SOURCE_SHA256 "unknown"
#endif

#define MAGIC 0xDAA320A7u
#define CRC_MASK 0x7FFFFFFFu
#define HEAD_SIZE 88
#define CRC_TRAILER_SIZE 20
#define MAX_OFFSETS 4096

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
put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
    return p + 4;
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
    PyObject *result = NULL;
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
    /* The offsets as text, "o1,o2,...,on\x02", at most 20 characters each with its comma. */
    char small[256];
    char *digits = small;
    Py_ssize_t cap = n * 21 + 1;
    if (cap > (Py_ssize_t)sizeof(small)) {
        digits = PyMem_Malloc((size_t)cap);
        if (digits == NULL) {
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t dlen = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        if (as_ll(PyTuple_GET_ITEM(offsets, i), &v)) {
            goto fail_digits;
        }
        if (v < 0) {
            PyErr_SetString(PyExc_ValueError, "append_record: negative light-queue offset");
            goto fail_digits;
        }
        char tmp[24];
        char *start = decimal(tmp + sizeof(tmp), (unsigned long long)v);
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

    Py_buffer body, topic, uprops, head;
    if (PyObject_GetBuffer(args[6], &body, PyBUF_SIMPLE) < 0) {
        goto fail_digits;
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
    Py_ssize_t plen = uprops.len + (n ? head.len + dlen : 0) + CRC_TRAILER_SIZE;
    Py_ssize_t size = HEAD_SIZE + body.len + topic.len + 2 + plen;
    if (plen > 0xFFFF || size > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "append_record: record fields too long");
        goto done;
    }
    if (size > room) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    Py_ssize_t old = PyByteArray_GET_SIZE(buf);
    if (PyByteArray_Resize(buf, old + size) < 0) {
        goto done;
    }
    unsigned char *rec = (unsigned char *)PyByteArray_AS_STRING(buf) + old;
    unsigned char *p = rec;
    memset(p, 0, HEAD_SIZE);
    put32(p, (uint32_t)size);
    put32(p + 4, MAGIC);
    put32(p + 8, crc32_of(body.buf, body.len) & CRC_MASK);
    put64(p + 20, qoff);
    put64(p + 28, phys);
    put64(p + 40, born);
    put64(p + 56, stored);
    put32(p + 84, (uint32_t)body.len);
    p += HEAD_SIZE;
    memcpy(p, body.buf, (size_t)body.len);
    p += body.len;
    memcpy(p, topic.buf, (size_t)topic.len);
    p += topic.len;
    *p++ = (unsigned char)(plen >> 8);
    *p++ = (unsigned char)(plen & 0xFF);
    memcpy(p, uprops.buf, (size_t)uprops.len);
    p += uprops.len;
    if (n) {
        memcpy(p, head.buf, (size_t)head.len);
        p += head.len;
        memcpy(p, digits, (size_t)dlen);
        p += dlen;
    }
    uint32_t crc = crc32_of(rec, p - rec) & CRC_MASK;
    memcpy(p, "__CRC32#\x01", 9);
    p += 9;
    for (int i = 9; i >= 0; i--) {
        p[i] = (unsigned char)('0' + crc % 10);
        crc /= 10;
    }
    p[10] = '\x02';
    result = PyLong_FromSsize_t(size);
done:
    PyBuffer_Release(&head);
fail_uprops:
    PyBuffer_Release(&uprops);
fail_topic:
    PyBuffer_Release(&topic);
fail_body:
    PyBuffer_Release(&body);
    if (digits != small) {
        PyMem_Free(digits);
    }
    return result;
fail_digits:
    if (digits != small) {
        PyMem_Free(digits);
    }
    return NULL;
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

static PyMethodDef methods[] = {
    {"append_record", (PyCFunction)(void (*)(void))append_record, METH_FASTCALL,
     "append_record(buf, room, queue_offset, physical_offset, born, stored, body, "
     "topic_field, user_props, inner_head, light_offsets) -> record size, or -1 (nothing "
     "appended) if it is larger than room. See store.format.append_record."},
    {"crc32", crc32, METH_O, "crc32(data) -> zlib.crc32(data), by this module's tables."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "store._speedups",
    .m_doc = "Optional C accelerator of the store (CommitLog record building).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    crc_init();
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddStringConstant(module, "SOURCE_SHA256", LMQTT_SOURCE_SHA256) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
