/*
 * Optional C accelerator of gateway.protocol, the codec's hot loops: `encode` for the common
 * PUBLISH shapes and `scan`, fast_decoder.decode_batch's inline decoder over a bytes buffer.
 *
 * Why C here: the pure-Python PUBLISH writer in writers.py is already down to one call, two
 * dict lookups and one join, and what is left is interpreter overhead (attribute loads, the
 * join's tuple, branches). This file does the same work in one C call and returns
 * byte-identical output; tests/gateway/protocol/test_protocol_speedups.py checks that against
 * the Python writer with hypothesis.
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
#include "kernel.h"
#include <string.h>

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
    if (lmqtt_slot_offsets("configure", type_obj, field_names, F_COUNT, found) < 0) {
        return NULL;
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

/*
 * scan(buf, off, table, limit, v5, topics, in_qos1, out_flight, receive_maximum, in_flight_others,
 *      out) -> off: the inline loop of fast_decoder.decode_batch over a `bytes` buffer, in C.
 *
 * It decodes, from `off` on, the packets the Python loop decodes inline -- PUBLISH whose first
 * byte `table` maps to a QoS (fast_decoder.FAST_PUBLISH_QOS), with a remaining
 * length of 1-2 bytes, a topic in the readers' TOPIC_CACHE (a missing one of at most
 * TOPIC_CACHE_KEY_MAX bytes is checked and cached as cache_topic does), a non-zero packet id for
 * QoS 1, no MQTT 5 properties; and PUBACK without reason code -- appends one event per packet
 * to `out` (Publish / PubAck built as bare instances with every slot set, as in Python), records
 * QoS 1 ids in `in_qos1` and drops acknowledged ids from `out_flight`, exactly as the Python loop
 * does. It returns the offset of the first packet it did not decode: incomplete, or anything
 * the Python loop would hand to `_Slow` / the general path, or a QoS 1 PUBLISH before the
 * connection has packet ids (`in_qos1` None). Nothing about that packet is changed (every check
 * comes before any side effect), and the caller's Python loop handles it, with every rule and
 * the precise error. So the C code never raises a protocol error and never decides one.
 *
 *     PUBLISH  | 0x3X | rem. len 1-2 B | topic len 2 B | topic | [packet id 2 B] | [0x00] | payload
 *     PUBACK   | 0x40 | 0x02 | packet id 2 B
 */
static PyTypeObject *puback_type = NULL;
enum { A_PACKET_ID, A_REASON_CODE, A_PROPERTIES, A_COUNT };
static const char *const ack_field_names[A_COUNT] = {"packet_id", "reason_code", "properties"};
static Py_ssize_t ack_offsets[A_COUNT];
static PyObject *small_ints[4]; /* 0..3, owned */

#define ACK_SLOT(obj, field) (*(PyObject **)((char *)(obj) + ack_offsets[field]))

static PyObject *
new_bare(PyTypeObject *type)
{
    /* object.__new__(type): the slots start NULL and are all filled by the caller. */
    return type->tp_alloc(type, 0);
}

/*
 * A device's plain publishes (`take_plain`): where they go instead of `out`, and which ones.
 * NULL in `scan`.
 */
typedef struct {
    PyObject *topic;        /* the one topic taken (str): any other stops the run */
    PyObject *owners;       /* list: `owner` appended once per publish taken */
    PyObject *owner;        /* the connection */
    PyObject *blocks;       /* list: `owner_blocks` appended once per publish taken */
    PyObject *owner_blocks; /* the connection's property blocks */
    PyObject *acked;        /* list: the packet id of each PUBACK taken */
    PyObject *other;        /* list: the plain publish on another topic that ends the run */
} Plain;

/* The readers' topic cache bounds (readers.py TOPIC_CACHE_KEY_MAX, TOPIC_CACHE_SIZE) and what
 * a topic name must not contain (readers.py TOPIC_NAME_FORBIDDEN), from configure_scan. */
static Py_ssize_t topic_key_max = 0, topic_cache_size = 0;
#define FORBIDDEN_MAX 8
static Py_UCS4 topic_forbidden[FORBIDDEN_MAX];
static Py_ssize_t n_topic_forbidden = 0;

/*
 * readers.cache_topic in C, for a `raw` topic missing from `topics`: its name if valid for a
 * PUBLISH (strict UTF-8, not empty, none of TOPIC_NAME_FORBIDDEN), cached in `topics` (cleared when
 * full), as a reference borrowed from it. NULL with no exception when the Python loop must
 * decide (invalid, or too long to be cached: cache_topic decodes it each time); NULL with an
 * exception on a real error.
 */
static PyObject *
cache_new_topic(PyObject *topics, PyObject *raw)
{
    Py_ssize_t n = PyBytes_GET_SIZE(raw);
    if (n == 0 || n > topic_key_max) {
        return NULL;
    }
    PyObject *topic = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(raw), n, "strict");
    if (topic == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
        }
        return NULL;
    }
    Py_ssize_t len = PyUnicode_GET_LENGTH(topic);
    for (Py_ssize_t i = 0; i < n_topic_forbidden; i++) {
        if (PyUnicode_FindChar(topic, topic_forbidden[i], 0, len, 1) != -1) {
            Py_DECREF(topic);
            return NULL;
        }
    }
    if (PyDict_GET_SIZE(topics) >= topic_cache_size) {
        PyDict_Clear(topics);
    }
    int failed = PyDict_SetItem(topics, raw, topic);
    Py_DECREF(topic); /* the cache holds it */
    return failed ? NULL : topic;
}

/* Is `topic` (from the topics cache) the plain run's topic? Identity first: both come from
 * the readers' topic cache, so equal topics are almost always the same object. */
static int
plain_topic(const Plain *plain, PyObject *topic)
{
    if (plain->topic == Py_None) {
        return 0; /* no topic yet: no publish is taken */
    }
    if (topic == plain->topic) {
        return 1;
    }
    return PyUnicode_CheckExact(topic) && PyUnicode_CheckExact(plain->topic)
           && PyUnicode_Compare(topic, plain->topic) == 0;
}

static PyObject *
scan_core(PyObject *buf_obj, Py_ssize_t off, PyObject *table, Py_ssize_t limit, int v5,
          PyObject *topics, PyObject *in_qos1, PyObject *out_flight, Py_ssize_t receive_maximum,
          Py_ssize_t others, PyObject *out, const Plain *plain)
{
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(buf_obj);
    Py_ssize_t n = PyBytes_GET_SIZE(buf_obj);
    if (off < 0 || off > n) {
        PyErr_SetString(PyExc_ValueError, "scan: offset outside the buffer");
        return NULL;
    }
    int limited = receive_maximum < 0xFFFF;
    Py_ssize_t id_size = v5 ? 3 : 2;
    while (n - off >= 2) {
        unsigned int first = buf[off];
        PyObject *qos_obj = PyList_GET_ITEM(table, first);
        if (qos_obj == Py_None) {
            if (first == 0x40 && buf[off + 1] == 2 && n - off >= 4) {
                long acked = (long)buf[off + 2] << 8 | buf[off + 3];
                if (!acked) {
                    break;
                }
                PyObject *id_obj = PyLong_FromLong(acked);
                if (id_obj == NULL) {
                    return NULL;
                }
                if (out_flight != Py_None) { /* out_flight.pop(acked, None) */
                    PyObject *held = PyDict_GetItemWithError(out_flight, id_obj); /* borrowed */
                    if ((held == NULL && PyErr_Occurred())
                        || (held != NULL && PyDict_DelItem(out_flight, id_obj) < 0)) {
                        Py_DECREF(id_obj);
                        return NULL;
                    }
                }
                if (plain != NULL && out_flight == Py_None) {
                    Py_DECREF(id_obj);
                    break; /* no packet ids yet: the Python path makes them */
                }
                if (plain != NULL) { /* the id only: no PubAck event */
                    int failed = PyList_Append(plain->acked, id_obj);
                    Py_DECREF(id_obj);
                    if (failed) {
                        return NULL;
                    }
                    off += 4;
                    continue;
                }
                PyObject *ack = new_bare(puback_type);
                if (ack == NULL) {
                    Py_DECREF(id_obj);
                    return NULL;
                }
                ACK_SLOT(ack, A_PACKET_ID) = id_obj;
                Py_INCREF(small_ints[0]);
                ACK_SLOT(ack, A_REASON_CODE) = small_ints[0];
                Py_INCREF(Py_None);
                ACK_SLOT(ack, A_PROPERTIES) = Py_None;
                int failed = PyList_Append(out, ack);
                Py_DECREF(ack);
                if (failed) {
                    return NULL;
                }
                off += 4;
                continue;
            }
            break;
        }
        long qos = PyLong_AsLong(qos_obj);
        if (qos < 0 || qos > 1) {
            PyErr_Clear();
            break; /* the table holds 0 and 1 only; anything else: the Python loop */
        }
        if (plain != NULL && (first & 1)) {
            break; /* RETAIN: not plain */
        }
        Py_ssize_t length = buf[off + 1], start;
        if (length < 128) {
            start = off + 2;
        }
        else {
            if (n - off < 3) {
                break;
            }
            unsigned int second = buf[off + 2];
            if (second > 127 || !second) {
                break;
            }
            length = (length & 0x7F) | (Py_ssize_t)second << 7;
            start = off + 3;
            if (length + 3 > limit) {
                break;
            }
        }
        Py_ssize_t end = start + length;
        if (end > n || length < 2) {
            break;
        }
        Py_ssize_t pos = start + 2 + ((Py_ssize_t)buf[start] << 8 | buf[start + 1]);
        if (pos > end) {
            break;
        }
        PyObject *raw = PyBytes_FromStringAndSize((const char *)buf + start + 2, pos - start - 2);
        if (raw == NULL) {
            return NULL;
        }
        PyObject *topic = PyDict_GetItemWithError(topics, raw); /* borrowed */
        if (topic == NULL && !PyErr_Occurred()) {
            topic = cache_new_topic(topics, raw); /* borrowed from the cache */
        }
        Py_DECREF(raw);
        if (topic == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            break; /* invalid or long: the Python loop decides */
        }
        /* A plain publish on another topic ends a device's run: taken into `other` (its ACL
         * decision is the caller's), when the caller asks for it. */
        int to_other = 0;
        if (plain != NULL && !plain_topic(plain, topic)) {
            if (plain->other == NULL || PyList_GET_SIZE(plain->other) != 0) {
                break;
            }
            to_other = 1;
        }
        PyObject *packet_id;
        if (qos) {
            if (pos + id_size > end) {
                break;
            }
            long pid = (long)buf[pos] << 8 | buf[pos + 1];
            if (!pid || (v5 && buf[pos + 2]) || (in_qos1 == Py_None && !to_other)) {
                break; /* properties, id 0, or no packet ids yet: the Python loop */
            }
            packet_id = PyLong_FromLong(pid);
            if (packet_id == NULL) {
                return NULL;
            }
            if (in_qos1 == Py_None) {
                /* `other` on a connection with no packet ids: the caller makes them and
                 * records this id (the first of none in flight is always within quota). */
            }
            else if (limited) {
                int has = PySet_Contains(in_qos1, packet_id);
                if (has < 0) {
                    Py_DECREF(packet_id);
                    return NULL;
                }
                if (!has && PySet_GET_SIZE(in_qos1) + others >= receive_maximum) {
                    Py_DECREF(packet_id);
                    break;
                }
            }
            if (in_qos1 != Py_None && PySet_Add(in_qos1, packet_id) < 0) {
                Py_DECREF(packet_id);
                return NULL;
            }
            pos += id_size;
        }
        else {
            if (v5) {
                if (pos >= end || buf[pos]) {
                    break;
                }
                pos += 1;
            }
            Py_INCREF(Py_None);
            packet_id = Py_None;
        }
        PyObject *payload = PyBytes_FromStringAndSize((const char *)buf + pos, end - pos);
        if (payload == NULL) {
            Py_DECREF(packet_id);
            return NULL;
        }
        PyObject *pub = new_bare(publish_type);
        if (pub == NULL) {
            Py_DECREF(packet_id);
            Py_DECREF(payload);
            return NULL;
        }
        Py_INCREF(topic);
        SLOT(pub, F_TOPIC) = topic;
        SLOT(pub, F_PAYLOAD) = payload;
        Py_INCREF(small_ints[qos]);
        SLOT(pub, F_QOS) = small_ints[qos];
        PyObject *retain = first & 1 ? Py_True : Py_False;
        PyObject *dup = first & 8 ? Py_True : Py_False;
        Py_INCREF(retain);
        SLOT(pub, F_RETAIN) = retain;
        Py_INCREF(dup);
        SLOT(pub, F_DUP) = dup;
        SLOT(pub, F_PACKET_ID) = packet_id;
        Py_INCREF(Py_None);
        SLOT(pub, F_PROPERTIES) = Py_None;
        int failed = PyList_Append(to_other ? plain->other : out, pub);
        Py_DECREF(pub);
        if (failed) {
            return NULL;
        }
        if (to_other) {
            off = end;
            break; /* the caller decides about it before anything after it */
        }
        if (plain != NULL && (PyList_Append(plain->owners, plain->owner) < 0
                              || PyList_Append(plain->blocks, plain->owner_blocks) < 0)) {
            return NULL;
        }
        off = end;
    }
    return PyLong_FromSsize_t(off);
}

static PyObject *
scan(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "scan takes 11 arguments");
        return NULL;
    }
    if (publish_type == NULL || puback_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "scan: configure_scan was not called");
        return NULL;
    }
    PyObject *buf_obj = args[0], *table = args[2], *topics = args[5], *in_qos1 = args[6];
    PyObject *out_flight = args[7], *out = args[10];
    if (!PyBytes_CheckExact(buf_obj) || !PyList_CheckExact(table) || PyList_GET_SIZE(table) != 256
        || !PyDict_CheckExact(topics) || !PyList_CheckExact(out)
        || (in_qos1 != Py_None && !PySet_CheckExact(in_qos1))
        || (out_flight != Py_None && !PyDict_CheckExact(out_flight))) {
        PyErr_SetString(PyExc_TypeError, "scan: unexpected argument types");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    int v5 = PyObject_IsTrue(args[4]);
    Py_ssize_t receive_maximum = PyLong_AsSsize_t(args[8]);
    Py_ssize_t others = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred() || v5 < 0) {
        return NULL;
    }
    return scan_core(buf_obj, off, table, limit, v5, topics, in_qos1, out_flight, receive_maximum,
                     others, out, NULL);
}

/*
 * take_plain(buf, table, limit, v5, topics, in_qos1, out_flight, receive_maximum,
 *            in_flight_others, topic, pubs, owners, owner, blocks, owner_blocks, acked, other)
 *            -> off:
 * a device's read (or a subscriber's run of PUBACKs), in one call.
 *
 * `scan` from offset 0 restricted to what the connection's read path handles with no Python
 * per packet (Connection.take_plain, gateway/connection/client.py): PUBLISH QoS 0/1, not
 * RETAIN, on `topic`, the one topic its ACL already allowed (None: none), and PUBACK without
 * reason code, each with scan's every other condition. A publish taken is appended to `pubs`
 * (the turn's ingest batch, gateway/connection/ingest.py), with `owner` to `owners` and
 * `owner_blocks` to `blocks`; a PUBACK's packet id to `acked` (dropped from `out_flight` as
 * scan does). It stops at the first packet that is anything else and returns its offset: the
 * caller's Python path handles the rest, with every rule. `in_qos1` and `out_flight` are None
 * on a connection with no packet ids yet: then it stops at a QoS 1 PUBLISH or a PUBACK (the
 * Python path makes them). Like scan, it never raises a protocol error and never decides one.
 *
 * One exception to stopping: a PUBLISH plain in every way but its topic (another one, or the
 * connection has none yet: a device's first publish) is decoded into `other` (empty on entry)
 * as `next_event` would hand it out next, and the run ends right after it: the caller checks
 * its topic and ACL before anything that follows. Its packet id is recorded in `in_qos1`;
 * with no packet ids yet (`in_qos1` None) the caller makes them and records it.
 */
static PyObject *
take_plain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 17) {
        PyErr_SetString(PyExc_TypeError, "take_plain takes 17 arguments");
        return NULL;
    }
    if (publish_type == NULL || puback_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "take_plain: configure_scan was not called");
        return NULL;
    }
    PyObject *buf_obj = args[0], *table = args[1], *topics = args[4], *in_qos1 = args[5];
    PyObject *out_flight = args[6];
    Plain plain = {args[9], args[11], args[12], args[13], args[14], args[15], args[16]};
    if (!PyBytes_CheckExact(buf_obj) || !PyList_CheckExact(table) || PyList_GET_SIZE(table) != 256
        || !PyDict_CheckExact(topics) || (in_qos1 != Py_None && !PySet_CheckExact(in_qos1))
        || (out_flight != Py_None && !PyDict_CheckExact(out_flight))
        || (plain.topic != Py_None && !PyUnicode_CheckExact(plain.topic))
        || !PyList_CheckExact(args[10]) || !PyList_CheckExact(plain.owners)
        || !PyList_CheckExact(plain.blocks) || !PyList_CheckExact(plain.acked)
        || !PyList_CheckExact(plain.other)) {
        PyErr_SetString(PyExc_TypeError, "take_plain: unexpected argument types");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    int v5 = PyObject_IsTrue(args[3]);
    Py_ssize_t receive_maximum = PyLong_AsSsize_t(args[7]);
    Py_ssize_t others = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred() || v5 < 0) {
        return NULL;
    }
    return scan_core(buf_obj, 0, table, limit, v5, topics, in_qos1, out_flight, receive_maximum,
                     others, args[10], &plain);
}

/*
 * pubacks(packet_ids, in_qos1) -> bytes: Connection.pubacks' building loop in C. Drops each id
 * from `in_qos1` (a set, or None) and returns one PUBACK per id, in order, with reason code 0
 * and no properties (the same 4 bytes at every level):
 *
 *     | 0x40 | 0x02 | packet id 2 B |
 *
 * The ids come from decoded PUBLISH packets (ints 1..65535); anything else is a TypeError or
 * ValueError, never a packet. Whether PUBACKs may be sent at all is the caller's check.
 */
static PyObject *
pubacks(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[0])
        || (args[1] != Py_None && !PySet_CheckExact(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "pubacks(packet_ids: list, in_qos1: set | None)");
        return NULL;
    }
    PyObject *ids = args[0], *in_qos1 = args[1];
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *data = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (data == NULL) {
        return NULL;
    }
    unsigned char *at = (unsigned char *)PyBytes_AS_STRING(data);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id_obj = PyList_GET_ITEM(ids, i);
        long pid = PyLong_Check(id_obj) ? PyLong_AsLong(id_obj) : -1;
        if (pid < 1 || pid > 0xFFFF) {
            Py_DECREF(data);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "pubacks: a packet id is not in 1..65535");
            }
            return NULL;
        }
        if (in_qos1 != Py_None && PySet_Discard(in_qos1, id_obj) < 0) {
            Py_DECREF(data);
            return NULL;
        }
        at[0] = 0x40;
        at[1] = 2;
        at[2] = (unsigned char)(pid >> 8);
        at[3] = (unsigned char)pid;
        at += 4;
    }
    return data;
}

static PyObject *
configure_scan(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *type_obj, *forbidden;
    Py_ssize_t key_max, cache_size;
    if (!PyArg_ParseTuple(args, "O!nnU:configure_scan", &PyType_Type, &type_obj, &key_max,
                          &cache_size, &forbidden)) {
        return NULL;
    }
    if (key_max < 0 || cache_size < 1) {
        PyErr_SetString(PyExc_ValueError, "configure_scan: bad topic cache bounds");
        return NULL;
    }
    Py_ssize_t n_forbidden = PyUnicode_GET_LENGTH(forbidden);
    if (n_forbidden < 1 || n_forbidden > FORBIDDEN_MAX) {
        PyErr_SetString(PyExc_ValueError, "configure_scan: 1 to 8 forbidden characters");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_forbidden; i++) {
        topic_forbidden[i] = PyUnicode_READ_CHAR(forbidden, i);
    }
    n_topic_forbidden = n_forbidden;
    topic_key_max = key_max;
    topic_cache_size = cache_size;
    if (publish_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure_scan: call configure first");
        return NULL;
    }
    Py_ssize_t found[A_COUNT];
    if (lmqtt_slot_offsets("configure_scan", type_obj, ack_field_names, A_COUNT, found) < 0) {
        return NULL;
    }
    /* The slots of a bare instance must be exactly these fields (plus nothing with a
     * __dict__), else an unset slot would surface as an AttributeError later. */
    if (((PyTypeObject *)type_obj)->tp_dictoffset != 0 || publish_type->tp_dictoffset != 0) {
        PyErr_SetString(PyExc_TypeError, "configure_scan: event classes must use slots only");
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        if (small_ints[i] == NULL && (small_ints[i] = PyLong_FromLong(i)) == NULL) {
            return NULL;
        }
    }
    memcpy(ack_offsets, found, sizeof(ack_offsets));
    Py_INCREF(type_obj);
    Py_XSETREF(puback_type, (PyTypeObject *)type_obj);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL | METH_KEYWORDS,
     "encode(event, level) -> bytes: writers.encode, with the common PUBLISH shapes in C."},
    {"configure", configure, METH_VARARGS,
     "configure(publish_type, topic_cache, fallback): bind the Publish class, the writers' "
     "encoded-topic cache and the Python encoder used for every other shape."},
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(buf, off, table, limit, v5, topics, in_qos1, out_flight, receive_maximum, "
     "in_flight_others, out) -> off: fast_decoder.decode_batch's inline loop over bytes, in C."},
    {"take_plain", (PyCFunction)(void (*)(void))take_plain, METH_FASTCALL,
     "take_plain(buf, table, limit, v5, topics, in_qos1, out_flight, receive_maximum, "
     "in_flight_others, topic, pubs, owners, owner, blocks, owner_blocks, acked, other) -> off: "
     "a device's plain publishes and a subscriber's PUBACKs."},
    {"pubacks", (PyCFunction)(void (*)(void))pubacks, METH_FASTCALL,
     "pubacks(packet_ids, in_qos1) -> bytes: a PUBACK per id (dropped from in_qos1)."},
    {"configure_scan", configure_scan, METH_VARARGS,
     "configure_scan(puback_type, topic_key_max, topic_cache_size, topic_name_forbidden): bind "
     "the PubAck class, the readers' topic cache bounds and what a topic name must not contain "
     "(after configure)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "gateway.protocol._speedups",
    .m_doc = "Optional C accelerator of gateway.protocol (PUBLISH encoding, inbound scan).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return lmqtt_module(&module_def);
}
