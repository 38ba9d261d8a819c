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
 * retain) in its `blocks`, or can have one made without the store (`new_block`: what
 * PublishProperties.new_plain does, a device's first publish to its topic), append (parent,
 * light queues, payload, block + the packet id pair for QoS > 0) to `messages` and the
 * block's properties dict to `props`. Stops untouched at any other: the Python loop routes
 * it and has its block encoded.
 *
 *     block + pid_head + <decimal packet id> + pid_tail      (QoS > 0 with a packet id)
 *
 * A new block (`configure_new` hands in the names and the kind middles):
 *
 *     topic_head + <UTF-8 name> + 0x02 + kind_middles[(qos, retain)] + publisher._client_raw
 *     properties: {keys[0]: name, keys[1]: str(qos), keys[2]: "1" | "0", keys[3]: client id}
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

/* What `configure_new` was given: how a new block is made (records.PublishProperties). */
static PyObject *s_client_id = NULL;   /* the publisher's client id attribute name */
static PyObject *s_client_raw = NULL;  /* its encoded client id + 0x02 (bytes, or None) */
static PyObject *kind_middles = NULL;  /* dict: (qos, retain) -> bytes */
static PyObject *topic_head = NULL;    /* bytes before a name */
static PyObject *prop_keys[4] = {NULL}; /* TOPIC, QOS, RETAIN, CLIENT */
static PyObject *text_one = NULL, *text_zero = NULL; /* "1", "0" */
static Py_ssize_t blocks_size = 0;     /* a publisher's blocks are cleared when this full */

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
configure_new(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *client_id, *client_raw, *middles, *head, *keys;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "UUO!SO!n:configure_new", &client_id, &client_raw, &PyDict_Type,
                          &middles, &head, &PyTuple_Type, &keys, &size)) {
        return NULL;
    }
    if (PyTuple_GET_SIZE(keys) != 4 || size < 1) {
        PyErr_SetString(PyExc_ValueError, "configure_new: four keys and a positive size");
        return NULL;
    }
    for (int k = 0; k < 4; k++) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(keys, k))) {
            PyErr_SetString(PyExc_TypeError, "configure_new: the keys must be str");
            return NULL;
        }
    }
    PyObject *one = PyUnicode_FromString("1"), *zero = PyUnicode_FromString("0");
    if (one == NULL || zero == NULL) {
        Py_XDECREF(one);
        Py_XDECREF(zero);
        return NULL;
    }
    Py_XSETREF(text_one, one);
    Py_XSETREF(text_zero, zero);
    for (int k = 0; k < 4; k++) {
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        Py_INCREF(key);
        Py_XSETREF(prop_keys[k], key);
    }
    Py_INCREF(client_id);
    Py_INCREF(client_raw);
    Py_INCREF(middles);
    Py_INCREF(head);
    Py_XSETREF(s_client_id, client_id);
    Py_XSETREF(s_client_raw, client_raw);
    Py_XSETREF(kind_middles, middles);
    Py_XSETREF(topic_head, head);
    blocks_size = size;
    Py_RETURN_NONE;
}

/*
 * PublishProperties.new_plain in C: the (block, properties) of `key` = (topic, qos, retain)
 * for `publisher`, whose `cache` (its blocks dict) has none, made and kept in `cache`. A new
 * reference; NULL with no exception set when the store must encode it (the kind's middle
 * unknown, no encoded client id, a separator in the name, a name that cannot be encoded):
 * nothing is kept then. NULL with an exception: a real error.
 */
static PyObject *
new_block(PyObject *publisher, PyObject *cache, PyObject *key, PyObject *topic, PyObject *qos,
          PyObject *retain)
{
    if (kind_middles == NULL) {
        return NULL; /* configure_new not called: Python makes it */
    }
    PyObject *kind = PyTuple_Pack(2, qos, retain);
    if (kind == NULL) {
        return NULL;
    }
    PyObject *middle = PyDict_GetItemWithError(kind_middles, kind); /* borrowed */
    Py_DECREF(kind);
    if (middle == NULL || !PyBytes_CheckExact(middle)) {
        return NULL;
    }
    Py_INCREF(middle); /* the dict is Python's: hold what is used */
    PyObject *client = PyObject_GetAttr(publisher, s_client_raw);
    PyObject *encoded = NULL, *block = NULL, *props = NULL, *hit = NULL;
    if (client == NULL || !PyBytes_CheckExact(client)) {
        goto done; /* None: the client id needs the store's check */
    }
    const char *name;
    Py_ssize_t nn;
    if (PyUnicode_IS_ASCII(topic)) {
        name = (const char *)PyUnicode_DATA(topic);
        nn = PyUnicode_GET_LENGTH(topic);
    }
    else {
        /* A temporary: PyUnicode_AsUTF8AndSize would keep a copy in the (cached) name. */
        encoded = PyUnicode_AsUTF8String(topic);
        if (encoded == NULL) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
                PyErr_Clear(); /* a lone surrogate: the store refuses it */
            }
            goto done;
        }
        name = PyBytes_AS_STRING(encoded);
        nn = PyBytes_GET_SIZE(encoded);
    }
    if (memchr(name, 0x01, (size_t)nn) != NULL || memchr(name, 0x02, (size_t)nn) != NULL) {
        goto done; /* a separator in the name: the store refuses it */
    }
    Py_ssize_t hn = PyBytes_GET_SIZE(topic_head), mn = PyBytes_GET_SIZE(middle);
    Py_ssize_t cn = PyBytes_GET_SIZE(client);
    block = PyBytes_FromStringAndSize(NULL, hn + nn + 1 + mn + cn);
    if (block == NULL) {
        goto done;
    }
    char *p = PyBytes_AS_STRING(block);
    memcpy(p, PyBytes_AS_STRING(topic_head), (size_t)hn);
    memcpy(p + hn, name, (size_t)nn);
    p[hn + nn] = 0x02;
    memcpy(p + hn + nn + 1, PyBytes_AS_STRING(middle), (size_t)mn);
    memcpy(p + hn + nn + 1 + mn, PyBytes_AS_STRING(client), (size_t)cn);
    int retained = PyObject_IsTrue(retain);
    PyObject *client_id = retained < 0 ? NULL : PyObject_GetAttr(publisher, s_client_id);
    PyObject *qos_text = client_id == NULL ? NULL : PyObject_Str(qos);
    props = qos_text == NULL ? NULL : PyDict_New();
    if (props == NULL || PyDict_SetItem(props, prop_keys[0], topic) < 0
        || PyDict_SetItem(props, prop_keys[1], qos_text) < 0
        || PyDict_SetItem(props, prop_keys[2], retained ? text_one : text_zero) < 0
        || PyDict_SetItem(props, prop_keys[3], client_id) < 0) {
        Py_XDECREF(client_id);
        Py_XDECREF(qos_text);
        goto done;
    }
    Py_DECREF(client_id);
    Py_DECREF(qos_text);
    hit = PyTuple_Pack(2, block, props);
    if (hit != NULL) {
        if (PyDict_GET_SIZE(cache) >= blocks_size) {
            PyDict_Clear(cache);
        }
        if (PyDict_SetItem(cache, key, hit) < 0) {
            Py_CLEAR(hit);
        }
    }
done:
    Py_DECREF(middle);
    Py_XDECREF(client);
    Py_XDECREF(encoded);
    Py_XDECREF(block);
    Py_XDECREF(props);
    return hit;
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
        Py_XINCREF(hit);
        if (hit == NULL && key != NULL && PyDict_CheckExact(cache) && !PyErr_Occurred()) {
            hit = new_block(PyList_GET_ITEM(blocks, i), cache, key, topic, qos, retain);
        }
        Py_XDECREF(key);
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
    {"configure_new", configure_new, METH_VARARGS,
     "configure_new(client_id_attr, client_raw_attr, kind_middles, topic_head, keys, size): "
     "how a publisher's new block is made (records.PublishProperties.new_plain)."},
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
