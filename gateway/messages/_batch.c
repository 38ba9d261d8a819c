/*
 * Optional C kernel of gateway.messages: `encode_publishes`, PublishPath.append_publishes's
 * loop in its common case. Its Python reference is gateway/messages/publishing.py
 * `encode_publishes_py`, which it must match exactly (tests/gateway/messages/test_encode_publishes.py).
 * The record's packet id property (its name from topicmap/record.py PID, the store's
 * separators around it) and the Publish class come from Python (`configure`), so this file
 * spells no record key.
 *
 * encode_publishes(pubs, blocks, routes, messages, props, i) -> index of the first left
 *
 * For each PUBLISH from `pubs[i]` on (a Publish, exact type) with no MQTT 5 properties, whose
 * topic has a cached route (`routes`: topic -> (parent topic, light queues)) and whose
 * publisher (`blocks[k]`, a records.PublishProperties) has the block of its (topic, QoS,
 * retain) in its `blocks`, append (parent, light queues, payload, block + the packet id pair
 * for QoS > 0) to `messages` and the block's properties dict to `props`. Stops untouched at
 * any other: the Python loop routes it and has its block encoded.
 *
 *     block + pid_head + <decimal packet id> + pid_tail      (QoS > 0 with a packet id)
 *
 * Built by setup.py as an optional extension; accelerators.load decides whether it runs.
 */
#include "kernel.h"
#include <string.h>

/* What `configure` was given; owned references, set once per process. */
static PyTypeObject *publish_type = NULL;
static PyObject *s_blocks = NULL; /* the publisher's block cache attribute name */
static PyObject *pid_head = NULL; /* bytes before the decimal packet id */
static PyObject *pid_tail = NULL; /* bytes after it */

enum { F_TOPIC, F_PAYLOAD, F_QOS, F_RETAIN, F_PACKET_ID, F_PROPERTIES, F_COUNT };
static const char *const field_names[F_COUNT] = {
    "topic", "payload", "qos", "retain", "packet_id", "properties",
};
static Py_ssize_t offsets[F_COUNT];

#define SLOT(obj, field) (*(PyObject **)((char *)(obj) + offsets[field]))

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *type_obj, *attr, *head, *tail;
    if (!PyArg_ParseTuple(args, "O!USS:configure", &PyType_Type, &type_obj, &attr, &head,
                          &tail)) {
        return NULL;
    }
    Py_ssize_t found[F_COUNT];
    if (lmqtt_slot_offsets("configure", type_obj, field_names, F_COUNT, found) < 0) {
        return NULL;
    }
    memcpy(offsets, found, sizeof(offsets));
    Py_INCREF(type_obj);
    Py_INCREF(attr);
    Py_INCREF(head);
    Py_INCREF(tail);
    Py_XSETREF(publish_type, (PyTypeObject *)type_obj);
    Py_XSETREF(s_blocks, attr);
    Py_XSETREF(pid_head, head);
    Py_XSETREF(pid_tail, tail);
    Py_RETURN_NONE;
}


static PyObject *
encode_publishes(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "encode_publishes takes 6 arguments, not %zd", nargs);
        return NULL;
    }
    PyObject *pubs = args[0], *blocks = args[1], *routes = args[2];
    PyObject *messages = args[3], *props = args[4];
    if (!PyList_Check(pubs) || !PyList_Check(blocks) || !PyDict_Check(routes)
        || !PyList_Check(messages) || !PyList_Check(props)) {
        PyErr_SetString(PyExc_TypeError, "encode_publishes: unexpected argument types");
        return NULL;
    }
    if (PyList_GET_SIZE(blocks) != PyList_GET_SIZE(pubs)) {
        PyErr_SetString(PyExc_ValueError, "encode_publishes: pubs and blocks differ in length");
        return NULL;
    }
    if (publish_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gateway.messages._batch is not configured");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[5]);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(pubs);
    for (; i < n; i++) {
        PyObject *pub = PyList_GET_ITEM(pubs, i);
        if (Py_TYPE(pub) != publish_type
            || SLOT(pub, F_PROPERTIES) != Py_None) {
            break;
        }
        PyObject *topic = SLOT(pub, F_TOPIC), *qos = SLOT(pub, F_QOS);
        PyObject *retain = SLOT(pub, F_RETAIN), *pid = SLOT(pub, F_PACKET_ID);
        PyObject *payload = SLOT(pub, F_PAYLOAD);
        if (topic == NULL || qos == NULL || retain == NULL || pid == NULL || payload == NULL
            || !PyUnicode_CheckExact(topic)) {
            break;
        }
        PyObject *route = PyDict_GetItemWithError(routes, topic);
        if (route == NULL || !PyTuple_Check(route) || PyTuple_GET_SIZE(route) != 2) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            break;
        }
        PyObject *cache = PyObject_GetAttr(PyList_GET_ITEM(blocks, i), s_blocks);
        if (cache == NULL) {
            return NULL;
        }
        PyObject *key = PyTuple_Pack(3, topic, qos, retain);
        PyObject *hit = key && PyDict_Check(cache) ? PyDict_GetItemWithError(cache, key) : NULL;
        Py_XDECREF(key);
        Py_XINCREF(hit);
        Py_DECREF(cache);
        if (hit == NULL || !PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2
            || !PyBytes_CheckExact(PyTuple_GET_ITEM(hit, 0))) {
            Py_XDECREF(hit);
            if (PyErr_Occurred()) {
                return NULL;
            }
            break; /* a block to encode (and validate): PublishProperties.of */
        }
        int with_id = PyObject_IsTrue(qos);
        if (with_id < 0) {
            Py_DECREF(hit);
            return NULL;
        }
        PyObject *block;
        if (with_id && pid != Py_None) {
            long long id = PyLong_AsLongLong(pid);
            if (id == -1 && PyErr_Occurred()) {
                Py_DECREF(hit);
                return NULL;
            }
            /* hit[0] + pid_head + decimal packet id + pid_tail */
            char digits[24];
            int dn = snprintf(digits, sizeof(digits), "%lld", id);
            PyObject *head = PyTuple_GET_ITEM(hit, 0);
            Py_ssize_t hn = PyBytes_GET_SIZE(head);
            Py_ssize_t pn = PyBytes_GET_SIZE(pid_head), tn = PyBytes_GET_SIZE(pid_tail);
            block = PyBytes_FromStringAndSize(NULL, hn + pn + dn + tn);
            if (block != NULL) {
                char *p = PyBytes_AS_STRING(block);
                memcpy(p, PyBytes_AS_STRING(head), hn);
                memcpy(p + hn, PyBytes_AS_STRING(pid_head), pn);
                memcpy(p + hn + pn, digits, dn);
                memcpy(p + hn + pn + dn, PyBytes_AS_STRING(pid_tail), tn);
            }
        }
        else {
            block = PyTuple_GET_ITEM(hit, 0);
            Py_INCREF(block);
        }
        PyObject *message = block ? PyTuple_Pack(4, PyTuple_GET_ITEM(route, 0),
                                                 PyTuple_GET_ITEM(route, 1), payload, block)
                                  : NULL;
        Py_XDECREF(block);
        int failed = message == NULL || PyList_Append(messages, message) < 0
                     || PyList_Append(props, PyTuple_GET_ITEM(hit, 1)) < 0;
        Py_XDECREF(message);
        Py_DECREF(hit);
        if (failed) {
            return NULL;
        }
    }
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(publish_type, blocks_attr, pid_head, pid_tail): the Publish class, the "
     "publisher's block cache attribute and the bytes around a record's packet id."},
    {"encode_publishes", (PyCFunction)(void (*)(void))encode_publishes, METH_FASTCALL,
     "encode_publishes(pubs, blocks, routes, messages, props, i) -> i: PublishPath."
     "append_publishes's loop, its common case (gateway/messages/publishing.py "
     "encode_publishes_py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "gateway.messages._batch",
    .m_doc = "Optional C kernel of gateway.messages (the publish batch's encoding loop).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__batch(void)
{
    return lmqtt_module(&module_def);
}
