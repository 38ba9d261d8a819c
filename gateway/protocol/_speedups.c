/*
 * Optional C accelerator of gateway.protocol: `encode` for the common PUBLISH shapes.
 *
 * Why C here and nowhere else: the pure-Python PUBLISH writer in writers.py is already down to
 * one call, two dict lookups and one join (~250-350 ns), and what is left is interpreter
 * overhead (attribute loads, the join's tuple, branches). This file does the same work in one
 * C call (~60-80 ns) and returns byte-identical output; tests/protocol/test_protocol_speedups.py
 * checks that against the Python writer with hypothesis.
 *
 * Contract (read this before changing anything):
 *   - `encode(event, level)` handles exactly the shapes writers._encode_py handles on its fast
 *     path: a `Publish` (exact type) whose topic is already in the writers' topic cache (so it
 *     was validated), a `bytes` payload, QoS 0/1/2 as an int, RETAIN/DUP as bools, a packet id
 *     1..65535 for QoS > 0 (none and no DUP for QoS 0), no properties at level 5, level 3/4/5.
 *   - Everything else -- other events, uncached topics, bytearray payloads, bad values -- is
 *     handed to the Python fallback unchanged, which encodes it or raises the same
 *     LocalProtocolError it always did. The C code never raises a protocol error itself.
 *   - It reads the dataclass slots of `Publish` directly at the offsets of their member
 *     descriptors, found once by `configure`; `configure` refuses a class whose fields are not
 *     plain object slots, so a change to events.Publish cannot make this read garbage.
 *
 * Built by setup.py as an optional extension: if there is no compiler, lmqtt runs on the
 * Python writer alone. LMQTT_PURE_PYTHON=1 ignores a built module.
 *
 *     +-------+----------+------------------+-----------+--------------+---------+
 *     | byte1 | rem. len | topic (cached,   | packet id | properties   | payload |
 *     | flags | 1-4 B    | length-prefixed) | QoS > 0   | MQTT 5: 0x00 |         |
 *     +-------+----------+------------------+-----------+--------------+---------+
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#ifndef LMQTT_SOURCE_SHA256
#define LMQTT_SOURCE_SHA256 "unknown"
#endif

#define MAX_REMAINING_LENGTH 268435455 /* four varint bytes */

/* What `configure` was given; owned references, set once per process. */
static PyTypeObject *publish_type = NULL;
static PyObject *topic_cache = NULL; /* dict: topic str -> length-prefixed UTF-8 bytes */
static PyObject *fallback = NULL;    /* writers._encode_py */

enum { F_TOPIC, F_PAYLOAD, F_QOS, F_RETAIN, F_DUP, F_PACKET_ID, F_PROPERTIES, F_COUNT };
static const char *const field_names[F_COUNT] = {
    "topic", "payload", "qos", "retain", "dup", "packet_id", "properties",
};
static Py_ssize_t offsets[F_COUNT];

#define SLOT(obj, field) (*(PyObject **)((char *)(obj) + offsets[field]))

static PyObject *
call_fallback(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gateway.protocol._speedups is not configured");
        return NULL;
    }
    return PyObject_Vectorcall(fallback, args, nargs, kwnames);
}

/* A small non-negative int, or -1 for anything else (never leaves an exception set). */
static long
small_int(PyObject *obj)
{
    if (!PyLong_CheckExact(obj)) {
        return -1;
    }
    int overflow = 0;
    long value = PyLong_AsLongAndOverflow(obj, &overflow);
    if (overflow || value < 0) {
        PyErr_Clear();
        return -1;
    }
    return value;
}

static PyObject *
encode(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || kwnames != NULL || publish_type == NULL) {
        return call_fallback(args, nargs, kwnames);
    }
    PyObject *event = args[0];
    if (Py_TYPE(event) != publish_type) {
        return call_fallback(args, nargs, kwnames);
    }
    long level = small_int(args[1]);
    if (level < 3 || level > 5) {
        return call_fallback(args, nargs, kwnames);
    }
    PyObject *topic = SLOT(event, F_TOPIC);
    PyObject *payload = SLOT(event, F_PAYLOAD);
    PyObject *qos_obj = SLOT(event, F_QOS);
    PyObject *retain = SLOT(event, F_RETAIN);
    PyObject *dup = SLOT(event, F_DUP);
    PyObject *packet_id_obj = SLOT(event, F_PACKET_ID);
    PyObject *properties = SLOT(event, F_PROPERTIES);
    /* An unset slot is NULL: the fallback raises the AttributeError Python would. */
    if (topic == NULL || payload == NULL || qos_obj == NULL || retain == NULL || dup == NULL
        || packet_id_obj == NULL || properties == NULL) {
        return call_fallback(args, nargs, kwnames);
    }
    if (!PyBytes_CheckExact(payload) || !PyUnicode_CheckExact(topic)
        || (retain != Py_True && retain != Py_False) || (dup != Py_True && dup != Py_False)
        || (level == 5 && properties != Py_None)) {
        return call_fallback(args, nargs, kwnames);
    }
    long qos = small_int(qos_obj);
    unsigned int flags;
    long packet_id = 0;
    if (qos == 0) {
        if (packet_id_obj != Py_None || dup != Py_False) {
            return call_fallback(args, nargs, kwnames);
        }
        flags = retain == Py_True ? 1 : 0;
    }
    else if (qos == 1 || qos == 2) {
        packet_id = small_int(packet_id_obj);
        if (packet_id < 1 || packet_id > 0xFFFF) {
            return call_fallback(args, nargs, kwnames);
        }
        flags = (unsigned int)qos << 1 | (dup == Py_True ? 8 : 0) | (retain == Py_True ? 1 : 0);
    }
    else {
        return call_fallback(args, nargs, kwnames);
    }
    /* Only validated, non-empty topic names are in the cache (writers._encoded_topic). */
    PyObject *encoded = PyDict_GetItemWithError(topic_cache, topic); /* borrowed */
    if (encoded == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        return call_fallback(args, nargs, kwnames);
    }
    if (!PyBytes_CheckExact(encoded)) {
        return call_fallback(args, nargs, kwnames);
    }
    Py_ssize_t topic_len = PyBytes_GET_SIZE(encoded);
    Py_ssize_t payload_len = PyBytes_GET_SIZE(payload);
    Py_ssize_t length = topic_len + (qos ? 2 : 0) + (level == 5 ? 1 : 0) + payload_len;
    if (length > MAX_REMAINING_LENGTH) {
        return call_fallback(args, nargs, kwnames);
    }
    unsigned char header[5];
    Py_ssize_t header_len = 0;
    header[header_len++] = (unsigned char)(0x30 | flags);
    Py_ssize_t rest = length;
    do {
        unsigned char byte = (unsigned char)(rest & 0x7F);
        rest >>= 7;
        header[header_len++] = rest ? (unsigned char)(byte | 0x80) : byte;
    } while (rest);

    PyObject *out = PyBytes_FromStringAndSize(NULL, header_len + length);
    if (out == NULL) {
        return NULL;
    }
    char *p = PyBytes_AS_STRING(out);
    memcpy(p, header, (size_t)header_len);
    p += header_len;
    memcpy(p, PyBytes_AS_STRING(encoded), (size_t)topic_len);
    p += topic_len;
    if (qos) {
        *p++ = (char)(packet_id >> 8);
        *p++ = (char)(packet_id & 0xFF);
    }
    if (level == 5) {
        *p++ = 0; /* empty property block */
    }
    memcpy(p, PyBytes_AS_STRING(payload), (size_t)payload_len);
    return out;
}

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *type_obj, *cache, *fallback_fn;
    if (!PyArg_ParseTuple(args, "O!O!O:configure", &PyType_Type, &type_obj, &PyDict_Type, &cache,
                          &fallback_fn)) {
        return NULL;
    }
    if (!PyCallable_Check(fallback_fn)) {
        PyErr_SetString(PyExc_TypeError, "configure: fallback must be callable");
        return NULL;
    }
    Py_ssize_t found[F_COUNT];
    for (int i = 0; i < F_COUNT; i++) {
        PyObject *descr = PyObject_GetAttrString(type_obj, field_names[i]);
        if (descr == NULL) {
            return NULL;
        }
        int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type)
                 && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX
                 && !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
        if (ok) {
            found[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
        }
        Py_DECREF(descr);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "configure: %s.%s is not a plain object slot",
                         ((PyTypeObject *)type_obj)->tp_name, field_names[i]);
            return NULL;
        }
    }
    memcpy(offsets, found, sizeof(offsets));
    Py_INCREF(type_obj);
    Py_INCREF(cache);
    Py_INCREF(fallback_fn);
    Py_XSETREF(publish_type, (PyTypeObject *)type_obj);
    Py_XSETREF(topic_cache, cache);
    Py_XSETREF(fallback, fallback_fn);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL | METH_KEYWORDS,
     "encode(event, level) -> bytes: writers.encode, with the common PUBLISH shapes in C."},
    {"configure", configure, METH_VARARGS,
     "configure(publish_type, topic_cache, fallback): bind the Publish class, the writers' "
     "encoded-topic cache and the Python encoder used for every other shape."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "gateway.protocol._speedups",
    .m_doc = "Optional C accelerator of gateway.protocol (PUBLISH encoding).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    /* The SHA-256 of this file when it was compiled: a test compares it with the file on disk,
     * so a stale build of an older source is caught instead of silently tested. */
    if (PyModule_AddStringConstant(module, "SOURCE_SHA256", LMQTT_SOURCE_SHA256) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
