/*
 * Optional C kernel of gateway.delivery: `plain_run`, the delivery loop's plain path over a
 * batch (gateway/delivery/send.py `Sender._deliver` -> `Connection.send_prepared`) in one
 * C call, for the records of the canonical shape, straight from the stored properties to the
 * PUBLISH bytes: no RecordedPublish, no PreparedPublish. Its Python reference is
 * gateway/delivery/run.py `plain_run_py` (which encodes with PreparedPublish): the same
 * result, the same dict changes, the same bytes (tests/gateway/delivery/test_delivery_plain_run.py,
 * hypothesis). The delivery rule it applies is gateway/delivery/rules.py `decide` for one
 * subscription and a message without expiry, and it spells none of it: Python hands over, once
 * (`configure`), the record's key names (topicmap/record.py) and the rule's tables
 * (rules.py QOS_TABLE: message QoS x granted QoS -> delivered QoS; RETAIN_TABLE: retain x
 * level 5 x retain-as-published -> RETAIN), and per call the publisher whose messages the
 * subscription passes over (rules.py `passed_over`: None when it has no No Local).
 *
 * Per message (a StoredMessage tuple: topic, body, properties, queue_offset, ...):
 *   - skipped if queue_offset < the next offset;
 *   - stop, untouched (the caller's general path takes it, with every rule) unless: one
 *     subscription covers it (`others` is None: the session has one; or the message is in
 *     one queue; or none of its other queues is a key of `others`, the session's
 *     subscriptions by queue: overlap.py `covering` then answers "this one alone"), its
 *     properties are a dict whose QoS
 *     key is "0", "1" or "2" (or absent: 0), with no expiry key and, at level 5, none of the
 *     keys an MQTT 5 PUBLISH carries out, its topic (the topic key, else the record's) is in
 *     the writers' encoded-topic cache `topics` (so it is valid), its body is bytes, and for
 *     QoS > 0 the next packet id is free (not in flight, not in the codec's outbound map) and
 *     the codec's Receive Maximum not reached;
 *   - stop with `full` when it needs a window slot and none is free;
 *   - passed over without a packet when its publisher is `passed_over`;
 *   - else its PUBLISH (QoS and RETAIN from the tables, DUP 0) goes to `batch`,
 *     and for QoS > 0: outbound[pid] = unacked, inflight[pid] = inflight_new(pid, queue,
 *     offset, qos) (built here, without its Python __init__, when inflight_new is the class
 *     `configure_record` named), pending[offset] = pid.
 * `state` = [next offset, next packet id, packets sent, index of the last message passed]
 * is written back on every exit, errors included.
 *
 *     [0x30 | qos << 1 | retain][remaining length][topic, length-prefixed][id][0x00 at v5][body]
 *
 * Built by setup.py as an optional extension; accelerators.load decides whether it runs.
 */
#include "kernel.h"
#include <string.h>

#define MAX_REMAINING_LENGTH 268435455 /* four varint bytes */

enum {
    R_MESSAGES, R_INDEX, R_STATE, R_OTHERS, R_WINDOW, R_LEVEL, R_SUB_QOS, R_RAP, R_PASSED_OVER,
    R_QUEUE, R_INFLIGHT, R_PENDING, R_INFLIGHT_NEW, R_TOPICS, R_OUTBOUND, R_RECEIVE_MAXIMUM,
    R_UNACKED, R_BATCH, R_COUNT
};

/* The record schema's key names (topicmap/record.py), handed over by `configure`; owned. */
static PyObject *k_topic, *k_qos, *k_retain, *k_client, *k_expiry;
static PyObject *k_v5 = NULL; /* tuple of str: the keys only an MQTT 5 PUBLISH carries out */

/* The delivery rule's tables (rules.py QOS_TABLE, RETAIN_TABLE), handed over by `configure`:
 * qos_table[message QoS][granted QoS] -> delivered QoS (0..2);
 * retain_table[retain][level == 5][retain as published] -> RETAIN (0 or 1). */
static unsigned char qos_table[3][3];
static unsigned char retain_table[2][2][2];

/* Reads the nested tuples `table` of shape dims[0] x dims[1] x ... (`ndims` levels) into `out`,
 * row-major, each value an int in 0..max; -1 with an exception if it is not that. */
static int
read_table(PyObject *table, const Py_ssize_t *dims, int ndims, unsigned char *out, long max)
{
    if (!PyTuple_Check(table) || PyTuple_GET_SIZE(table) != dims[0]) {
        PyErr_SetString(PyExc_ValueError, "configure: a rule table has the wrong shape");
        return -1;
    }
    Py_ssize_t stride = 1;
    for (int k = 1; k < ndims; k++) {
        stride *= dims[k];
    }
    for (Py_ssize_t k = 0; k < dims[0]; k++) {
        PyObject *item = PyTuple_GET_ITEM(table, k);
        if (ndims > 1) {
            if (read_table(item, dims + 1, ndims - 1, out + k * stride, max) < 0) {
                return -1;
            }
            continue;
        }
        long value = PyLong_Check(item) ? PyLong_AsLong(item) : -1;
        if (value < 0 || value > max) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "configure: a rule table value is out of range");
            }
            return -1;
        }
        out[k] = (unsigned char)value;
    }
    return 0;
}

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *topic, *qos, *retain, *client, *expiry, *v5, *qos_rule, *retain_rule;
    if (!PyArg_ParseTuple(args, "UUUUUO!OO:configure", &topic, &qos, &retain, &client, &expiry,
                          &PyTuple_Type, &v5, &qos_rule, &retain_rule)) {
        return NULL;
    }
    static const Py_ssize_t qos_dims[2] = {3, 3}, retain_dims[3] = {2, 2, 2};
    unsigned char qos_read[3][3], retain_read[2][2][2];
    if (read_table(qos_rule, qos_dims, 2, &qos_read[0][0], 2) < 0
        || read_table(retain_rule, retain_dims, 3, &retain_read[0][0][0], 1) < 0) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(v5); k++) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(v5, k))) {
            PyErr_SetString(PyExc_TypeError, "configure: the MQTT 5 keys must be str");
            return NULL;
        }
    }
    PyObject **slots[5] = {&k_topic, &k_qos, &k_retain, &k_client, &k_expiry};
    PyObject *values[5] = {topic, qos, retain, client, expiry};
    for (int k = 0; k < 5; k++) {
        Py_INCREF(values[k]);
        Py_XSETREF(*slots[k], values[k]);
    }
    memcpy(qos_table, qos_read, sizeof qos_table);
    memcpy(retain_table, retain_read, sizeof retain_table);
    Py_INCREF(v5);
    Py_XSETREF(k_v5, v5); /* last: plain_run runs once it is set */
    Py_RETURN_NONE;
}

/* The in-flight record's class (gateway/session/model.py Inflight, a slotted dataclass), handed
 * over by `configure_record`: its fields' member descriptors in field order, and for each field
 * after the four plain_run fills (packet id, queue, offset, QoS) its default, or its default
 * factory (called per record: a fresh list). When `inflight_new` is this class, plain_run builds
 * the record here, through the descriptors, instead of running the dataclass's Python __init__:
 * the same object, field for field (tests/gateway/delivery/test_delivery_plain_run.py). */
static PyTypeObject *rec_type = NULL;
static PyObject *rec_fields = NULL;    /* tuple of member descriptors */
static PyObject *rec_defaults = NULL;  /* tuple: a default per field after the fourth */
static PyObject *rec_factories = NULL; /* tuple of bool: that default is a factory */
/* Where each field's slot lies in a record (its member descriptor's offset): record_new writes
 * there directly, which is what the descriptor's setter does on a new object. */
#define REC_MAX_FIELDS 32
static Py_ssize_t rec_offsets[REC_MAX_FIELDS];

static PyObject *
configure_record(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *type, *fields, *defaults, *factories;
    if (!PyArg_ParseTuple(args, "O!O!O!O!:configure_record", &PyType_Type, &type, &PyTuple_Type,
                          &fields, &PyTuple_Type, &defaults, &PyTuple_Type, &factories)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(fields);
    if (n < 4 || PyTuple_GET_SIZE(defaults) != n - 4 || PyTuple_GET_SIZE(factories) != n - 4) {
        PyErr_SetString(PyExc_ValueError,
                        "configure_record: four fields, then one default and flag per field");
        return NULL;
    }
    if (n > REC_MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "configure_record: too many fields");
        return NULL;
    }
    Py_ssize_t offsets[REC_MAX_FIELDS];
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *d = PyTuple_GET_ITEM(fields, k);
        if (!Py_IS_TYPE(d, &PyMemberDescr_Type)
            || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX
            || (((PyMemberDescrObject *)d)->d_member->flags & READONLY)
            || ((PyMemberDescrObject *)d)->d_common.d_type != (PyTypeObject *)type) {
            PyErr_SetString(PyExc_TypeError, "configure_record: a field is not a slot");
            return NULL;
        }
        offsets[k] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    memcpy(rec_offsets, offsets, sizeof offsets);
    Py_INCREF(fields);
    Py_XSETREF(rec_fields, fields);
    Py_INCREF(defaults);
    Py_XSETREF(rec_defaults, defaults);
    Py_INCREF(factories);
    Py_XSETREF(rec_factories, factories);
    Py_INCREF(type);
    Py_XSETREF(rec_type, (PyTypeObject *)type); /* last: plain_run uses it once it is set */
    Py_RETURN_NONE;
}

/* A new record of rec_type: fields 0..3 from `first`, the rest their defaults (a factory that
 * is `list` gives a new empty list without a call); NULL with an exception on failure. Each
 * value goes straight into its slot, empty in a new object (what the slot's setter does). */
static PyObject *
record_new(PyObject *const *first)
{
    PyObject *obj = rec_type->tp_alloc(rec_type, 0);
    if (obj == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(rec_fields);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *value;
        if (k < 4) {
            value = Py_NewRef(first[k]);
        } else if (PyTuple_GET_ITEM(rec_factories, k - 4) == Py_True) {
            PyObject *factory = PyTuple_GET_ITEM(rec_defaults, k - 4);
            value = factory == (PyObject *)&PyList_Type ? PyList_New(0)
                                                        : PyObject_CallNoArgs(factory);
            if (value == NULL) {
                Py_DECREF(obj);
                return NULL;
            }
        } else {
            value = Py_NewRef(PyTuple_GET_ITEM(rec_defaults, k - 4));
        }
        *(PyObject **)((char *)obj + rec_offsets[k]) = value;
    }
    return obj;
}

/* "0", "1", "2" -> 0..2; anything else -> -1 (not the canonical shape). */
static int
qos_of(PyObject *value)
{
    if (!PyUnicode_CheckExact(value) || PyUnicode_GET_LENGTH(value) != 1) {
        return -1;
    }
    Py_UCS4 c = PyUnicode_READ_CHAR(value, 0);
    return c >= '0' && c <= '2' ? (int)(c - '0') : -1;
}

/* 1 if `value` is the str "1" (what read_record calls retained), else 0. */
static int
is_one(PyObject *value)
{
    return value != NULL && PyUnicode_CheckExact(value) && PyUnicode_GET_LENGTH(value) == 1
           && PyUnicode_READ_CHAR(value, 0) == '1';
}

static PyObject *
plain_run(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != R_COUNT) {
        PyErr_Format(PyExc_TypeError, "plain_run takes %d arguments", R_COUNT);
        return NULL;
    }
    if (k_v5 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gateway.delivery._run is not configured");
        return NULL;
    }
    PyObject *messages = args[R_MESSAGES], *state = args[R_STATE];
    PyObject *inflight = args[R_INFLIGHT], *pending = args[R_PENDING];
    PyObject *topics = args[R_TOPICS], *outbound = args[R_OUTBOUND], *batch = args[R_BATCH];
    PyObject *others = args[R_OTHERS], *queue = args[R_QUEUE];
    if (!PyList_Check(messages) || !PyList_Check(state) || PyList_GET_SIZE(state) != 4
        || (others != Py_None && !PyDict_Check(others))
        /* inflight and pending exactly dicts: PyDict_SetItem would write past the read-only
         * subclass a session shares while it has none (gateway/session/model.py NO_INFLIGHT,
         * NO_PENDING), into every holder; the reference's writes raise there. */
        || !PyDict_CheckExact(inflight) || !PyDict_CheckExact(pending) || !PyDict_Check(topics)
        || !PyDict_Check(outbound) || !PyList_Check(batch)) {
        PyErr_SetString(PyExc_TypeError, "plain_run: unexpected argument types");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[R_INDEX]);
    long long next_offset = PyLong_AsLongLong(PyList_GET_ITEM(state, 0));
    long next_pid = PyLong_AsLong(PyList_GET_ITEM(state, 1));
    long long sent = PyLong_AsLongLong(PyList_GET_ITEM(state, 2));
    Py_ssize_t moved = PyLong_AsSsize_t(PyList_GET_ITEM(state, 3));
    long window = PyLong_AsLong(args[R_WINDOW]);
    long level = PyLong_AsLong(args[R_LEVEL]);
    long sub_qos = PyLong_AsLong(args[R_SUB_QOS]);
    long receive_maximum = PyLong_AsLong(args[R_RECEIVE_MAXIMUM]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (sub_qos < 0 || sub_qos > 2) {
        PyErr_SetString(PyExc_ValueError, "plain_run: the granted QoS is not 0, 1 or 2");
        return NULL;
    }
    int rap = PyObject_IsTrue(args[R_RAP]);
    if (rap < 0) {
        return NULL;
    }
    int v5 = level == 5;
    PyObject *passed_over = args[R_PASSED_OVER]; /* Py_None: passes over no one's messages */
    int retain_if = retain_table[1][v5][rap]; /* the RETAIN of a message published retained */
    int retain_else = retain_table[0][v5][rap]; /* and of one not */
    int read_retain = retain_if != retain_else; /* whether the message's own flag matters */
    PyObject *pid_obj = NULL, *flight = NULL, *data = NULL, *encoded = NULL;
    int full = 0, failed = 0;
    Py_ssize_t n = PyList_GET_SIZE(messages);
    for (; i < n; i++) {
        Py_CLEAR(encoded);
        PyObject *msg = PyList_GET_ITEM(messages, i);
        if (!PyTuple_Check(msg) || PyTuple_GET_SIZE(msg) < 9) {
            break;
        }
        PyObject *queues = PyTuple_GET_ITEM(msg, 8), *off_obj = PyTuple_GET_ITEM(msg, 3);
        PyObject *props = PyTuple_GET_ITEM(msg, 2), *body = PyTuple_GET_ITEM(msg, 1);
        if (!PyTuple_Check(queues) || !PyLong_CheckExact(off_obj) || !PyDict_Check(props)) {
            break;
        }
        long long off = PyLong_AsLongLong(off_obj);
        if (off == -1 && PyErr_Occurred()) {
            failed = 1;
            break;
        }
        if (off < next_offset) {
            continue;
        }
        if (others != Py_None && PyTuple_GET_SIZE(queues) > 1) {
            int covered = 0; /* by another of the session's subscriptions */
            for (Py_ssize_t k = 0; !covered && k < PyTuple_GET_SIZE(queues); k++) {
                PyObject *q = PyTuple_GET_ITEM(queues, k);
                int same = PyObject_RichCompareBool(q, queue, Py_EQ);
                covered = same == 0 ? PyDict_Contains(others, q) : (same < 0 ? -1 : 0);
            }
            if (covered) {
                failed = covered < 0;
                break; /* maybe covered by another subscription: overlap.py decides */
            }
        }
        /* read_record's fields, the canonical shape only (borrowed references). */
        PyObject *v = PyDict_GetItemWithError(props, k_qos);
        int qos = v == NULL ? 0 : qos_of(v);
        if (PyErr_Occurred()) {
            failed = 1;
            break;
        }
        if (qos < 0) {
            break;
        }
        int has = PyDict_Contains(props, k_expiry);
        for (Py_ssize_t k = 0; v5 && !has && k < PyTuple_GET_SIZE(k_v5); k++) {
            has = PyDict_Contains(props, PyTuple_GET_ITEM(k_v5, k));
        }
        if (has) {
            failed = has < 0;
            break;
        }
        PyObject *topic = PyDict_GetItemWithError(props, k_topic);
        if (topic == NULL) {
            if (PyErr_Occurred()) {
                failed = 1;
                break;
            }
            topic = PyTuple_GET_ITEM(msg, 0);
        }
        encoded = PyUnicode_CheckExact(topic) ? PyDict_GetItemWithError(topics, topic) : NULL;
        if (encoded == NULL || !PyBytes_CheckExact(encoded) || !PyBytes_CheckExact(body)) {
            encoded = NULL; /* borrowed: not ours to release */
            failed = PyErr_Occurred() != NULL;
            break; /* a topic the writers have not encoded (and checked) yet */
        }
        Py_INCREF(encoded); /* the cache may be cleared while this message is built */
        if (passed_over != Py_None) {
            PyObject *client = PyDict_GetItemWithError(props, k_client);
            int same;
            if (client != NULL) {
                same = PyObject_RichCompareBool(client, passed_over, Py_EQ);
            }
            else if (PyErr_Occurred()) {
                failed = 1;
                break;
            }
            else { /* absent: "" */
                same = PyUnicode_Check(passed_over) && PyUnicode_GET_LENGTH(passed_over) == 0;
            }
            if (same < 0) {
                failed = 1;
                break;
            }
            if (same) {
                goto passed;
            }
        }
        qos = qos_table[qos][sub_qos];
        if (qos > 0 && window - PyDict_GET_SIZE(inflight) <= 0) {
            full = 1;
            break;
        }
        int retain = retain_else;
        if (read_retain) {
            PyObject *r = PyDict_GetItemWithError(props, k_retain);
            if (r == NULL && PyErr_Occurred()) {
                failed = 1;
                break;
            }
            if (is_one(r)) {
                retain = retain_if;
            }
        }
        if (qos > 0) {
            /* Session.allocate_packet_id, the common case; publish_sent's checks. */
            if ((pid_obj = PyLong_FromLong(next_pid)) == NULL) {
                failed = 1;
                break;
            }
            int used = PyDict_Contains(inflight, pid_obj);
            int taken = used ? used : PyDict_Contains(outbound, pid_obj);
            if (used < 0 || taken < 0) {
                failed = 1;
                break;
            }
            if (used || taken || PyDict_GET_SIZE(outbound) >= receive_maximum) {
                break;
            }
        }
        Py_ssize_t tn = PyBytes_GET_SIZE(encoded), bn = PyBytes_GET_SIZE(body);
        Py_ssize_t remaining = tn + (qos ? 2 : 0) + v5 + bn;
        if (remaining > MAX_REMAINING_LENGTH) {
            break;
        }
        unsigned char head[5];
        int hn = 1;
        head[0] = (unsigned char)(0x30 | qos << 1 | retain);
        Py_ssize_t rl = remaining;
        do {
            unsigned char b = rl & 0x7F;
            rl >>= 7;
            head[hn++] = rl ? b | 0x80 : b;
        } while (rl);
        if ((data = PyBytes_FromStringAndSize(NULL, hn + remaining)) == NULL) {
            failed = 1;
            break;
        }
        char *p = PyBytes_AS_STRING(data);
        memcpy(p, head, hn);
        p += hn;
        memcpy(p, PyBytes_AS_STRING(encoded), tn);
        p += tn;
        if (qos) {
            *p++ = (char)(next_pid >> 8);
            *p++ = (char)(next_pid & 0xFF);
        }
        if (v5) {
            *p++ = 0;
        }
        memcpy(p, PyBytes_AS_STRING(body), bn);
        if (qos > 0) {
            if (PyDict_SetItem(outbound, pid_obj, args[R_UNACKED]) < 0) {
                failed = 1;
                break;
            }
            next_pid = next_pid % 65535 + 1;
            PyObject *fargs[4] = {pid_obj, args[R_QUEUE], off_obj, PyLong_FromLong(qos)};
            if (fargs[3] == NULL) {
                failed = 1;
                break;
            }
            flight = args[R_INFLIGHT_NEW] == (PyObject *)rec_type
                         ? record_new(fargs)
                         : PyObject_Vectorcall(args[R_INFLIGHT_NEW], fargs, 4, NULL);
            Py_DECREF(fargs[3]);
            if (flight == NULL || PyDict_SetItem(inflight, pid_obj, flight) < 0
                || PyDict_SetItem(pending, off_obj, pid_obj) < 0) {
                failed = 1;
                break;
            }
            Py_CLEAR(flight);
            Py_CLEAR(pid_obj);
        }
        if (PyList_Append(batch, data) < 0) {
            failed = 1;
            break;
        }
        Py_CLEAR(data);
        sent++;
    passed:
        next_offset = off + 1;
        moved = i;
    }
    Py_XDECREF(pid_obj);
    Py_XDECREF(flight);
    Py_XDECREF(data);
    Py_XDECREF(encoded);
    /* Written back whatever happened, so the caller's bookkeeping is exact. */
    PyObject *exc_type = NULL, *exc = NULL, *exc_tb = NULL;
    if (failed) {
        PyErr_Fetch(&exc_type, &exc, &exc_tb);
    }
    PyObject *values[4] = {PyLong_FromLongLong(next_offset), PyLong_FromLong(next_pid),
                           PyLong_FromLongLong(sent), PyLong_FromSsize_t(moved)};
    for (int k = 0; k < 4; k++) {
        if (values[k] == NULL) {
            for (int j = 0; j < 4; j++) {
                Py_XDECREF(values[j]);
            }
            Py_XDECREF(exc_type);
            Py_XDECREF(exc);
            Py_XDECREF(exc_tb);
            return NULL;
        }
    }
    for (int k = 0; k < 4; k++) {
        PyList_SetItem(state, k, values[k]); /* steals */
    }
    if (failed) {
        PyErr_Restore(exc_type, exc, exc_tb);
        return NULL;
    }
    return Py_BuildValue("(nO)", i, full ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(topic, qos, retain, client, expiry, v5_keys, qos_table, retain_table): the "
     "record schema's key names (topicmap/record.py) and the delivery rule's tables "
     "(gateway/delivery/rules.py), once, before plain_run."},
    {"configure_record", configure_record, METH_VARARGS,
     "configure_record(type, fields, defaults, factories): the in-flight record's class, its "
     "fields' member descriptors in order and, after the fourth, their defaults (a factory "
     "where the flag is true); plain_run then builds that class's records itself."},
    {"plain_run", (PyCFunction)(void (*)(void))plain_run, METH_FASTCALL,
     "plain_run(messages, i, state, others, window, level, sub_qos, rap, passed_over, queue, "
     "inflight, pending, inflight_new, topics, outbound, receive_maximum, unacked, batch) -> "
     "(i, full): the delivery loop's plain path over a batch (gateway/delivery/run.py "
     "plain_run_py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "gateway.delivery._run",
    .m_doc = "Optional C kernel of gateway.delivery (the plain delivery run).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__run(void)
{
    return lmqtt_module(&module_def);
}
