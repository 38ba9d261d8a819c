/*
 * Optional C kernel of rocketmq_remoting: `records`, the loop of rocketmq_remoting/message.py
 * `_records` (what `decode_records` and `scan_records` return: a pull answer's CommitLog records
 * as MessageRecords, or only those dispatched to a wanted light queue). Its Python reference is
 * message.py `records_py`, which it must match exactly
 * (tests/rocketmq_remoting/test_records_speedup.py). The record layout is drawn in message.py;
 * the property names and separators, the MessageRecord class, the error class and the IPv6
 * host formatter come from Python (`configure`), so this file spells no property name.
 *
 * records(body, check_crc, wanted) -> (list of MessageRecord, CommitLog offset of the last
 * record read, passed over or not; -1 if none)
 *
 * `wanted` None: every record. Otherwise a container of light queue names: a record is decoded
 * only when one name of its dispatch property is `in wanted`; the others are passed over from
 * their properties alone (body neither copied nor checked).
 *
 * frame(buf, start, end) -> RemotingCommand: command.py `decode_frame` of buf[start:end] (a
 * remoting frame without its length prefix), exactly (tests/rocketmq_remoting/
 * test_frame_speedup.py). It decodes itself the frames every broker answer is: a JSON header
 * as fastjson writes it (compact, keys and values without escapes) and the body; any other
 * frame (a binary header, whitespace, an escape, a number that is not a plain integer, a
 * value of a type the reference converts, a malformed frame) goes to the reference, which
 * decodes it or raises as it always did. frame_fast is the same but answers None instead of
 * calling the reference (the tests use it to see which frames the C path takes).
 * The header keys it reads are command.py's (`configure_frames`).
 *
 * send_frames(pieces, first_opaque, born_ms, messages) -> bytes: send_frames.py
 * `SendFrames.frames_py`, exactly (tests/rocketmq_remoting/test_codec.py): the SEND_MESSAGE_V2
 * frames (binary header) of `messages` ((properties, body) pairs) one after the other, the
 * i-th with opaque first_opaque + i, each from the template's constant pieces (head, the bytes
 * after the opaque, up to g's value, between g's and i's, after i's; the frame limit).
 * ProtocolError if a frame would exceed the limit.
 *
 * Built by setup.py as an optional extension; accelerators.load decides whether it runs.
 */
#define _GNU_SOURCE 1 /* memmem */
#include "kernel.h"
#include <string.h>

/* What `configure` was given; owned references, set once per process. */
static PyObject *record_type = NULL;    /* message.MessageRecord */
static PyObject *protocol_error = NULL; /* errors.ProtocolError */
static PyObject *crc32_func = NULL;     /* zlib.crc32 */
static PyObject *host_v6 = NULL;        /* 16 raw bytes -> the address's text (ipaddress) */
static char dispatch_key[128];          /* "INNER_MULTI_DISPATCH" + name/value separator */
static Py_ssize_t dispatch_key_len = 0;
static unsigned char name_value_sep, property_sep, dispatch_sep;
static uint32_t magic_v1, magic_v2, blank_magic, sysflag_born_v6, sysflag_store_v6;

enum { FIXED_HEAD = 48 };
/* MessageRecord's slots, in its fields' order (its __slots__, read by `configure`): a record is
 * allocated and its slots set straight, without a call of its Python __init__. */
enum { RECORD_SLOTS = 14 };
static Py_ssize_t record_offsets[RECORD_SLOTS];

static int
record_slot_offsets(PyObject *type_obj)
{
    if (!PyType_Check(type_obj)) {
        PyErr_SetString(PyExc_TypeError, "configure: MessageRecord is not a type");
        return -1;
    }
    PyObject *slots = PyObject_GetAttrString(type_obj, "__slots__");
    if (slots == NULL) {
        return -1;
    }
    int rc = -1;
    const char *names[RECORD_SLOTS];
    if (!PyTuple_Check(slots) || PyTuple_GET_SIZE(slots) != RECORD_SLOTS) {
        PyErr_SetString(PyExc_TypeError, "configure: MessageRecord needs its 14 fields as slots");
        goto done;
    }
    for (int i = 0; i < RECORD_SLOTS; i++) {
        names[i] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(slots, i));
        if (names[i] == NULL) {
            goto done;
        }
    }
    rc = lmqtt_slot_offsets("configure", type_obj, names, RECORD_SLOTS, record_offsets);
done:
    Py_DECREF(slots);
    return rc;
}

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *type_obj, *error, *crc, *v6;
    const char *key;
    Py_ssize_t key_len;
    int nv, ps, ds;
    unsigned int m1, m2, blank, born6, store6;
    if (!PyArg_ParseTuple(args, "OOOOy#CCCIIIII:configure", &type_obj, &error, &crc, &v6, &key,
                          &key_len, &nv, &ps, &ds, &m1, &m2, &blank, &born6, &store6)) {
        return NULL;
    }
    if (key_len <= 0 || key_len >= (Py_ssize_t)sizeof(dispatch_key) || nv > 0x7F || ps > 0x7F
        || ds > 0x7F) {
        PyErr_SetString(PyExc_ValueError, "configure: unusable dispatch key or separators");
        return NULL;
    }
    if (record_slot_offsets(type_obj) < 0) {
        return NULL;
    }
    memcpy(dispatch_key, key, key_len);
    dispatch_key_len = key_len;
    name_value_sep = (unsigned char)nv;
    property_sep = (unsigned char)ps;
    dispatch_sep = (unsigned char)ds;
    magic_v1 = m1;
    magic_v2 = m2;
    blank_magic = blank;
    sysflag_born_v6 = born6;
    sysflag_store_v6 = store6;
    Py_INCREF(type_obj);
    Py_INCREF(error);
    Py_INCREF(crc);
    Py_INCREF(v6);
    Py_XSETREF(record_type, type_obj);
    Py_XSETREF(protocol_error, error);
    Py_XSETREF(crc32_func, crc);
    Py_XSETREF(host_v6, v6);
    Py_RETURN_NONE;
}

static inline uint32_t
u32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline int32_t
i32(const unsigned char *p)
{
    return (int32_t)u32(p);
}

static inline int16_t
i16(const unsigned char *p)
{
    return (int16_t)(((uint16_t)p[0] << 8) | p[1]);
}

static inline int64_t
i64(const unsigned char *p)
{
    return (int64_t)(((uint64_t)u32(p) << 32) | u32(p + 4));
}

/* Raise ProtocolError(`fmt` % a). */
static void
protocol(const char *fmt, long long a)
{
    PyObject *msg = PyUnicode_FromFormat(fmt, a);
    if (msg != NULL) {
        PyErr_SetObject(protocol_error, msg);
        Py_DECREF(msg);
    }
}

/* Whether the properties p[0:n] name a light queue in `wanted` in their dispatch property
 * (message.py `_dispatched_to`); -1 on error. */
static int
dispatched_to(const unsigned char *p, Py_ssize_t n, PyObject *wanted)
{
    Py_ssize_t at = -1;
    const unsigned char *from = p;
    while (from < p + n) {
        const unsigned char *hit = memmem(from, p + n - from, dispatch_key, dispatch_key_len);
        if (hit == NULL) {
            break;
        }
        if (hit == p || hit[-1] == property_sep) {
            at = hit - p;
            break;
        }
        from = hit + 1;
    }
    /* `props.find` from 0 finds an occurrence at 0 first; one inside a value's text (not
     * after a property separator) is passed over, as the Python loop does. */
    if (at < 0) {
        return 0;
    }
    Py_ssize_t start = at + dispatch_key_len, end = start;
    while (end < n && p[end] != property_sep) {
        end++;
    }
    Py_ssize_t name = start;
    for (Py_ssize_t i = start; i <= end; i++) {
        if (i == end || p[i] == dispatch_sep) {
            PyObject *s = PyUnicode_DecodeUTF8((const char *)p + name, i - name, "surrogateescape");
            if (s == NULL) {
                return -1;
            }
            int found = PySequence_Contains(wanted, s);
            Py_DECREF(s);
            if (found != 0) {
                return found;
            }
            name = i + 1;
        }
    }
    return 0;
}

/* The last host decoded per kind (born, store): most records of an answer share them, and a
 * tuple is immutable, so the same one is handed out again (equal to a new one). */
typedef struct {
    unsigned char raw[20];
    int len;
    PyObject *value;
} HostMemo;

/* (address text, port) of the host at p (v6: 16 bytes, else 4), then its port. */
static PyObject *
host_of(const unsigned char *p, int v6)
{
    PyObject *addr;
    if (v6) {
        PyObject *raw = PyBytes_FromStringAndSize((const char *)p, 16);
        if (raw == NULL) {
            return NULL;
        }
        addr = PyObject_CallOneArg(host_v6, raw);
        Py_DECREF(raw);
    }
    else {
        char text[16];
        int n = 0;
        for (int i = 0; i < 4; i++) {
            unsigned int v = p[i];
            if (i) {
                text[n++] = '.';
            }
            if (v >= 100) {
                text[n++] = (char)('0' + v / 100);
            }
            if (v >= 10) {
                text[n++] = (char)('0' + v / 10 % 10);
            }
            text[n++] = (char)('0' + v % 10);
        }
        addr = PyUnicode_FromStringAndSize(text, n);
    }
    if (addr == NULL) {
        return NULL;
    }
    PyObject *port = PyLong_FromLong(i32(p + (v6 ? 16 : 4)));
    if (port == NULL) {
        Py_DECREF(addr);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, addr, port);
    Py_DECREF(addr);
    Py_DECREF(port);
    return out;
}

/* host_of, remembered in `memo`; a new reference. */
static PyObject *
host(const unsigned char *p, int v6, HostMemo *memo)
{
    int len = v6 ? 20 : 8;
    if (memo->value != NULL && memo->len == len && memcmp(memo->raw, p, len) == 0) {
        Py_INCREF(memo->value);
        return memo->value;
    }
    PyObject *value = host_of(p, v6);
    if (value != NULL) {
        memcpy(memo->raw, p, len);
        memo->len = len;
        Py_INCREF(value);
        Py_XSETREF(memo->value, value);
    }
    return value;
}

/* Property names seen (their bytes and text): a few names repeat in every record, so each is
 * decoded once per answer. */
enum { NAME_MEMO = 32 };
typedef struct {
    const unsigned char *raw;
    Py_ssize_t len;
    PyObject *text;
} NameMemo;

typedef struct {
    HostMemo born, store;
    NameMemo names[NAME_MEMO];
    int n_names;
} Memo;

static void
memo_clear(Memo *memo)
{
    Py_CLEAR(memo->born.value);
    Py_CLEAR(memo->store.value);
    for (int i = 0; i < memo->n_names; i++) {
        Py_CLEAR(memo->names[i].text);
    }
    memo->n_names = 0;
}

/* The text of the property name s[0:len] (surrogateescape), a new reference. */
static PyObject *
name_text(const unsigned char *s, Py_ssize_t len, Memo *memo)
{
    for (int i = 0; i < memo->n_names; i++) {
        NameMemo *m = &memo->names[i];
        if (m->len == len && memcmp(m->raw, s, len) == 0) {
            Py_INCREF(m->text);
            return m->text;
        }
    }
    PyObject *text = PyUnicode_DecodeUTF8((const char *)s, len, "surrogateescape");
    if (text != NULL && memo->n_names < NAME_MEMO) {
        NameMemo *m = &memo->names[memo->n_names++];
        m->raw = s; /* points into the body, which outlives the memo */
        m->len = len;
        Py_INCREF(text);
        m->text = text;
    }
    return text;
}

/* message.py `decode_properties` over the raw bytes (decoding each name and value on its own
 * is the same as decoding the whole: the separators are ASCII, never inside a UTF-8 sequence,
 * and surrogateescape maps only bytes >= 0x80). */
static PyObject *
properties(const unsigned char *p, Py_ssize_t n, Memo *memo)
{
    PyObject *out = PyDict_New();
    if (out == NULL || n <= 0) {
        return out;
    }
    Py_ssize_t item = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (i < n && p[i] != property_sep) {
            continue;
        }
        const unsigned char *s = p + item;
        Py_ssize_t len = i - item;
        const unsigned char *sep = memchr(s, name_value_sep, len);
        if (sep != NULL && sep > s) {
            PyObject *k = name_text(s, sep - s, memo);
            PyObject *v = k == NULL ? NULL
                                    : PyUnicode_DecodeUTF8((const char *)sep + 1,
                                                           len - (sep - s) - 1, "surrogateescape");
            if (v == NULL || PyDict_SetItem(out, k, v) < 0) {
                Py_XDECREF(k);
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(k);
            Py_DECREF(v);
        }
        item = i + 1;
    }
    return out;
}

/* One record at b[pos:pos+size], decoded (message.py `_records`, the yield). */
static PyObject *
decode_one(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end, int check_crc, Memo *memo)
{
    const unsigned char *r = b + pos;
    int32_t size = i32(r);
    uint32_t magic = u32(r + 4), body_crc = u32(r + 8);
    int32_t queue_id = i32(r + 12), flag = i32(r + 16), sys_flag = i32(r + 36);
    int64_t queue_offset = i64(r + 20), phys = i64(r + 28), born_ts = i64(r + 40);
    int born6 = (sys_flag & sysflag_born_v6) != 0, store6 = (sys_flag & sysflag_store_v6) != 0;
    Py_ssize_t p = pos + FIXED_HEAD;
    /* born host, store timestamp, store host, reconsume times, prepared offset, body length */
    Py_ssize_t need = (born6 ? 20 : 8) + 8 + (store6 ? 20 : 8) + 4 + 8 + 4;
    if (p + need > end) {
        protocol("truncated record at %lld", (long long)pos);
        return NULL;
    }
    PyObject *born_host = NULL, *store_host = NULL, *payload = NULL, *topic = NULL;
    PyObject *props = NULL, *out = NULL;
    born_host = host(b + p, born6, &memo->born);
    if (born_host == NULL) {
        goto done;
    }
    p += born6 ? 20 : 8;
    int64_t store_ts = i64(b + p);
    p += 8;
    store_host = host(b + p, store6, &memo->store);
    if (store_host == NULL) {
        goto done;
    }
    p += store6 ? 20 : 8;
    int32_t reconsume = i32(b + p);
    int32_t body_len = i32(b + p + 12);
    p += 16;
    if (body_len < 0 || p + body_len > end) {
        protocol("truncated record at %lld", (long long)pos);
        goto done;
    }
    payload = PyBytes_FromStringAndSize((const char *)b + p, body_len);
    if (payload == NULL) {
        goto done;
    }
    p += body_len;
    if (check_crc) {
        PyObject *crc = PyObject_CallOneArg(crc32_func, payload);
        if (crc == NULL) {
            goto done;
        }
        unsigned long value = PyLong_AsUnsignedLong(crc);
        Py_DECREF(crc);
        if (value == (unsigned long)-1 && PyErr_Occurred()) {
            goto done;
        }
        if ((value & 0x7FFFFFFFUL) != body_crc) {
            protocol("body CRC mismatch in record at commitlog offset %lld", (long long)phys);
            goto done;
        }
    }
    Py_ssize_t topic_len;
    if (magic == magic_v2) {
        if (p + 2 > end) {
            protocol("truncated record at %lld", (long long)pos);
            goto done;
        }
        topic_len = i16(b + p);
        p += 2;
    }
    else {
        if (p + 1 > end) {
            protocol("truncated record at %lld", (long long)pos);
            goto done;
        }
        topic_len = b[p];
        p += 1;
    }
    if (topic_len < 0 || p + topic_len + 2 > end) {
        protocol("truncated record at %lld", (long long)pos);
        goto done;
    }
    topic = PyUnicode_DecodeUTF8((const char *)b + p, topic_len, NULL);
    if (topic == NULL) {
        goto done;
    }
    p += topic_len;
    Py_ssize_t props_len = i16(b + p);
    p += 2;
    if (props_len > end - p) {
        props_len = end - p; /* what a slice past the end leaves */
    }
    props = properties(b + p, props_len, memo);
    if (props == NULL) {
        goto done;
    }
    /* MessageRecord's fields, in order (message.py). */
    PyObject *ints[9] = {
        PyLong_FromLong(queue_id), PyLong_FromLongLong(queue_offset), PyLong_FromLongLong(phys),
        PyLong_FromLong(sys_flag), PyLong_FromLong(flag),          PyLong_FromLongLong(born_ts),
        PyLong_FromLongLong(store_ts), PyLong_FromLong(reconsume), PyLong_FromLong(size),
    };
    int ok = 1;
    for (int i = 0; i < 9; i++) {
        ok &= ints[i] != NULL;
    }
    if (ok) {
        PyObject *fields[RECORD_SLOTS] = {
            topic,    payload,  ints[0],    ints[1],   ints[2], ints[3], ints[4],
            ints[5],  ints[6],  born_host,  store_host, ints[7], props,  ints[8],
        };
        PyTypeObject *tp = (PyTypeObject *)record_type;
        out = tp->tp_alloc(tp, 0);
        if (out != NULL) { /* each slot takes a reference of its own */
            for (int i = 0; i < RECORD_SLOTS; i++) {
                Py_INCREF(fields[i]);
                *(PyObject **)((char *)out + record_offsets[i]) = fields[i];
            }
        }
    }
    for (int i = 0; i < 9; i++) {
        Py_XDECREF(ints[i]);
    }
done:
    Py_XDECREF(born_host);
    Py_XDECREF(store_host);
    Py_XDECREF(payload);
    Py_XDECREF(topic);
    Py_XDECREF(props);
    return out;
}

/* Where the properties of the record at b[pos:] start, and their length (-1: none). */
static Py_ssize_t
properties_at(const unsigned char *b, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t *len)
{
    const unsigned char *r = b + pos;
    uint32_t magic = u32(r + 4);
    int32_t sys_flag = i32(r + 36);
    Py_ssize_t q = pos + FIXED_HEAD;
    q += ((sys_flag & sysflag_born_v6) ? 20 : 8) + 8;
    q += ((sys_flag & sysflag_store_v6) ? 20 : 8) + 4 + 8;
    if (q + 4 > end) {
        return -1;
    }
    int32_t body_len = i32(b + q);
    q += 4 + (Py_ssize_t)body_len;
    if (magic == magic_v2) {
        if (q < 0 || q + 2 > end) {
            return -1;
        }
        q += 2 + i16(b + q);
    }
    else {
        if (q < 0 || q + 1 > end) {
            return -1;
        }
        q += 1 + b[q];
    }
    if (q < 0 || q + 2 > end) {
        return -1;
    }
    *len = i16(b + q);
    q += 2;
    if (*len > end - q) {
        *len = end - q; /* what a slice past the end leaves */
    }
    return q;
}

static PyObject *
records(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "records takes 3 arguments, not %zd", nargs);
        return NULL;
    }
    if (record_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "records: configure() was not called");
        return NULL;
    }
    int check_crc = PyObject_IsTrue(args[1]);
    if (check_crc < 0) {
        return NULL;
    }
    PyObject *wanted = args[2] == Py_None ? NULL : args[2];
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *b = view.buf;
    Py_ssize_t end = view.len, pos = 0;
    long long last = -1;
    Memo memo;
    memset(&memo, 0, sizeof(memo));
    PyObject *list = PyList_New(0);
    if (list == NULL) {
        goto fail;
    }
    while (pos < end) {
        if (end - pos < FIXED_HEAD) {
            protocol("truncated record at %lld", (long long)pos);
            goto fail;
        }
        int32_t size = i32(b + pos);
        uint32_t magic = u32(b + pos + 4);
        if (magic == blank_magic) {
            break;
        }
        if ((magic != magic_v1 && magic != magic_v2) || size <= 0 || pos + size > end) {
            PyObject *msg = PyUnicode_FromFormat("bad record at %zd: magic 0x%x, size %d", pos,
                                                 (unsigned int)magic, (int)size);
            if (msg != NULL) {
                PyErr_SetObject(protocol_error, msg);
                Py_DECREF(msg);
            }
            goto fail;
        }
        last = i64(b + pos + 28);
        if (wanted != NULL) {
            Py_ssize_t props_len = 0;
            Py_ssize_t q = properties_at(b, pos, end, &props_len);
            if (q < 0) {
                protocol("truncated record at %lld", (long long)pos);
                goto fail;
            }
            int keep = props_len > 0 ? dispatched_to(b + q, props_len, wanted) : 0;
            if (keep < 0) {
                goto fail;
            }
            if (!keep) {
                pos += size;
                continue;
            }
        }
        PyObject *rec = decode_one(b, pos, end, check_crc, &memo);
        if (rec == NULL || PyList_Append(list, rec) < 0) {
            Py_XDECREF(rec);
            goto fail;
        }
        Py_DECREF(rec);
        pos += size;
    }
    memo_clear(&memo);
    PyBuffer_Release(&view);
    return Py_BuildValue("(NL)", list, last);
fail:
    memo_clear(&memo);
    Py_XDECREF(list);
    PyBuffer_Release(&view);
    return NULL;
}

/* ---- frames: a JSON remoting header (see the top of this file) ------------------------------ */

static PyObject *command_type = NULL;   /* command.RemotingCommand */
static PyObject *json_type = NULL;      /* codes.SerializeType.JSON */
static PyObject *frame_reference = NULL; /* command.decode_frame */
/* The header's keys, as command.py names them: what the reference reads. */
enum { K_CODE, K_EXT, K_FLAG, K_LANGUAGE, K_OPAQUE, K_REMARK, K_VERSION, K_COUNT };
static char key_text[K_COUNT][32];
static Py_ssize_t key_len[K_COUNT];
/* RemotingCommand's slots, in its fields' order: set straight (no __init__ call). */
static const char *const command_slots[] = {
    "code", "opaque", "flag", "remark", "ext_fields", "body", "language", "version",
    "serialize_type",
};
enum { COMMAND_SLOTS = 9 };
static Py_ssize_t command_offsets[COMMAND_SLOTS];

static PyObject *
configure_frames(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *type_obj, *json, *reference, *keys;
    if (!PyArg_ParseTuple(args, "OOOO!:configure_frames", &type_obj, &json, &reference,
                          &PyTuple_Type, &keys)) {
        return NULL;
    }
    if (PyTuple_GET_SIZE(keys) != K_COUNT) {
        PyErr_SetString(PyExc_ValueError, "configure_frames: 7 header keys expected");
        return NULL;
    }
    for (int i = 0; i < K_COUNT; i++) {
        Py_ssize_t n;
        const char *k = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(keys, i), &n);
        if (k == NULL) {
            return NULL;
        }
        if (n <= 0 || n >= (Py_ssize_t)sizeof(key_text[i])) {
            PyErr_SetString(PyExc_ValueError, "configure_frames: unusable header key");
            return NULL;
        }
        memcpy(key_text[i], k, n);
        key_len[i] = n;
    }
    if (!PyType_Check(type_obj)
        || lmqtt_slot_offsets("configure_frames", type_obj, command_slots, COMMAND_SLOTS,
                              command_offsets) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "configure_frames: RemotingCommand is not a type");
        }
        return NULL;
    }
    Py_INCREF(type_obj);
    Py_INCREF(json);
    Py_INCREF(reference);
    Py_XSETREF(command_type, type_obj);
    Py_XSETREF(json_type, json);
    Py_XSETREF(frame_reference, reference);
    Py_RETURN_NONE;
}

/* A cursor over the header; every parse_* returns 0 when the text is not of the plain shape
 * (the caller then leaves the frame to the reference), -1 on a Python error. */
typedef struct {
    const unsigned char *p, *end;
} Cursor;

/* A string without escapes or control characters at c->p (the opening quote): its text's
 * bounds in *s, *n; the cursor moves past the closing quote. Non-ASCII bytes are refused
 * unless `utf8` (the caller then decodes the text: a bad sequence goes to the reference, as
 * does one in a string it would not decode, a key or a value it skips). */
static int
scan_text(Cursor *c, const unsigned char **s, Py_ssize_t *n, int utf8)
{
    if (c->p >= c->end || *c->p != '"') {
        return 0;
    }
    const unsigned char *q = c->p + 1;
    while (q < c->end && *q != '"') {
        if (*q == '\\' || *q < 0x20 || (*q >= 0x80 && !utf8)) {
            return 0;
        }
        q++;
    }
    if (q >= c->end) {
        return 0;
    }
    *s = c->p + 1;
    *n = q - (c->p + 1);
    c->p = q + 1;
    return 1;
}

static int
scan_string(Cursor *c, const unsigned char **s, Py_ssize_t *n)
{
    return scan_text(c, s, n, 0);
}

static PyObject *
string_at(Cursor *c, int *plain)
{
    const unsigned char *s;
    Py_ssize_t n;
    *plain = scan_text(c, &s, &n, 1);
    if (!*plain) {
        return NULL;
    }
    PyObject *out = PyUnicode_DecodeUTF8((const char *)s, n, NULL);
    if (out == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        *plain = 0;
    }
    return out;
}

/* A plain JSON integer (what json reads as an int: no leading zero, no fraction or exponent),
 * at most 18 digits. */
static int
parse_int(Cursor *c, long long *out)
{
    const unsigned char *q = c->p;
    int neg = 0;
    if (q < c->end && *q == '-') {
        neg = 1;
        q++;
    }
    const unsigned char *digits = q;
    long long v = 0;
    while (q < c->end && *q >= '0' && *q <= '9') {
        v = v * 10 + (*q - '0');
        q++;
        if (q - digits > 18) {
            return 0;
        }
    }
    Py_ssize_t nd = q - digits;
    if (nd == 0 || (nd > 1 && *digits == '0')) {
        return 0;
    }
    if (q < c->end && (*q == '.' || *q == 'e' || *q == 'E')) {
        return 0;
    }
    *out = neg ? -v : v;
    c->p = q;
    return 1;
}

static int
literal(Cursor *c, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) {
        return 0;
    }
    c->p += n;
    return 1;
}

/* Skip a value of a key the reference does not read: a string, an integer, null, true or
 * false (an object or array, or anything else, is left to the reference). */
static int
skip_value(Cursor *c)
{
    if (c->p >= c->end) {
        return 0;
    }
    const unsigned char *s;
    Py_ssize_t n;
    long long v;
    switch (*c->p) {
    case '"':
        return scan_string(c, &s, &n);
    case 'n':
        return literal(c, "null");
    case 't':
        return literal(c, "true");
    case 'f':
        return literal(c, "false");
    default:
        return parse_int(c, &v);
    }
}

/* extFields: an object of string values, or null (the reference's `or {}`: an empty dict).
 * 1 with a new dict in *out, 0 not plain, -1 error. */
static int
parse_ext(Cursor *c, PyObject **out)
{
    if (literal(c, "null")) {
        *out = PyDict_New();
        return *out == NULL ? -1 : 1;
    }
    if (c->p >= c->end || *c->p != '{') {
        return 0;
    }
    c->p++;
    PyObject *d = PyDict_New();
    if (d == NULL) {
        return -1;
    }
    if (c->p < c->end && *c->p == '}') {
        c->p++;
        *out = d;
        return 1;
    }
    for (;;) {
        int plain;
        PyObject *k = string_at(c, &plain);
        if (k == NULL) {
            goto not_plain;
        }
        if (c->p >= c->end || *c->p != ':') {
            Py_DECREF(k);
            plain = 0;
            goto not_plain;
        }
        c->p++;
        PyObject *v = string_at(c, &plain);
        if (v == NULL) {
            Py_DECREF(k);
            goto not_plain;
        }
        int r = PyDict_SetItem(d, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (r < 0) {
            Py_DECREF(d);
            return -1;
        }
        if (c->p < c->end && *c->p == ',') {
            c->p++;
            continue;
        }
        if (c->p < c->end && *c->p == '}') {
            c->p++;
            *out = d;
            return 1;
        }
        Py_DECREF(d);
        return 0;
    not_plain:
        Py_DECREF(d);
        return plain ? -1 : 0; /* string_at: NULL with plain set is a Python error */
    }
}

static int
key_is(const unsigned char *s, Py_ssize_t n, int k)
{
    return n == key_len[k] && memcmp(s, key_text[k], n) == 0;
}

/* The command of a frame buf[start:end] with a plain JSON header: a new reference, NULL with
 * no error set when the frame is not plain, NULL with an error set on a Python error. */
static PyObject *
json_frame(const unsigned char *buf, Py_ssize_t len)
{
    if (len < 4 || buf[0] != 0) { /* serialize type JSON only */
        return NULL;
    }
    Py_ssize_t header_len = ((Py_ssize_t)buf[1] << 16) | ((Py_ssize_t)buf[2] << 8) | buf[3];
    if (4 + header_len > len) {
        return NULL;
    }
    Cursor c = {buf + 4, buf + 4 + header_len};
    long long code = 0, opaque = 0, flag = 0, version = 0;
    int have_code = 0;
    PyObject *remark = NULL, *ext = NULL, *language = NULL, *result = NULL;
    if (c.p >= c.end || *c.p != '{') {
        return NULL;
    }
    c.p++;
    if (c.p < c.end && *c.p == '}') {
        goto done; /* {}: no code, left to the reference (which raises) */
    }
    for (;;) {
        const unsigned char *k;
        Py_ssize_t kn;
        if (!scan_string(&c, &k, &kn) || c.p >= c.end || *c.p != ':') {
            goto done;
        }
        c.p++;
        int ok;
        if (key_is(k, kn, K_CODE)) {
            ok = parse_int(&c, &code);
            have_code = ok;
        }
        else if (key_is(k, kn, K_OPAQUE)) {
            ok = parse_int(&c, &opaque);
        }
        else if (key_is(k, kn, K_FLAG)) {
            ok = parse_int(&c, &flag);
        }
        else if (key_is(k, kn, K_VERSION)) {
            ok = parse_int(&c, &version);
        }
        else if (key_is(k, kn, K_EXT)) {
            Py_CLEAR(ext);
            ok = parse_ext(&c, &ext);
            if (ok < 0) {
                goto error;
            }
        }
        else if (key_is(k, kn, K_REMARK) || key_is(k, kn, K_LANGUAGE)) {
            PyObject **slot = key_is(k, kn, K_REMARK) ? &remark : &language;
            Py_CLEAR(*slot);
            if (slot == &remark && literal(&c, "null")) {
                ok = 1; /* remark None */
            }
            else {
                int plain;
                *slot = string_at(&c, &plain);
                ok = *slot != NULL;
                if (!ok && plain) {
                    goto error;
                }
            }
        }
        else {
            ok = skip_value(&c);
        }
        if (!ok) {
            goto done;
        }
        if (c.p < c.end && *c.p == ',') {
            c.p++;
            continue;
        }
        if (c.p < c.end && *c.p == '}') {
            c.p++;
            break;
        }
        goto done;
    }
    if (c.p != c.end || !have_code) {
        goto done; /* anything after the object, or no code: the reference decides */
    }
    PyObject *items[COMMAND_SLOTS] = {NULL};
    items[0] = PyLong_FromLongLong(code);
    items[1] = PyLong_FromLongLong(opaque);
    items[2] = PyLong_FromLongLong(flag);
    items[3] = remark != NULL ? remark : Py_None;
    Py_INCREF(items[3]);
    if (ext == NULL) {
        ext = PyDict_New();
    }
    items[4] = ext;
    Py_XINCREF(items[4]);
    items[5] = PyBytes_FromStringAndSize((const char *)buf + 4 + header_len,
                                         len - 4 - header_len);
    items[6] = language != NULL ? language : PyUnicode_FromString("JAVA");
    if (language != NULL) {
        Py_INCREF(items[6]);
    }
    items[7] = PyLong_FromLongLong(version);
    items[8] = json_type;
    Py_INCREF(items[8]);
    int complete = 1;
    for (int i = 0; i < COMMAND_SLOTS; i++) {
        complete &= items[i] != NULL;
    }
    if (complete) {
        PyTypeObject *tp = (PyTypeObject *)command_type;
        result = tp->tp_alloc(tp, 0);
    }
    if (result != NULL) { /* the slots take the references */
        for (int i = 0; i < COMMAND_SLOTS; i++) {
            *(PyObject **)((char *)result + command_offsets[i]) = items[i];
        }
    }
    else {
        for (int i = 0; i < COMMAND_SLOTS; i++) {
            Py_XDECREF(items[i]);
        }
        goto error;
    }
done:
    Py_XDECREF(remark);
    Py_XDECREF(ext);
    Py_XDECREF(language);
    return result;
error:
    Py_XDECREF(remark);
    Py_XDECREF(ext);
    Py_XDECREF(language);
    if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_SystemError, "frame: error without an exception");
    }
    return NULL;
}

static int
frame_args(PyObject *const *args, Py_ssize_t nargs, const char *fname, Py_buffer *view,
           Py_ssize_t *start, Py_ssize_t *end)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s(buf, start, end) takes 3 arguments", fname);
        return -1;
    }
    if (command_type == NULL) {
        PyErr_Format(PyExc_RuntimeError, "%s: configure_frames was not called", fname);
        return -1;
    }
    *start = PyLong_AsSsize_t(args[1]);
    if (*start == -1 && PyErr_Occurred()) {
        return -1;
    }
    *end = PyLong_AsSsize_t(args[2]);
    if (*end == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (PyObject_GetBuffer(args[0], view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (*start < 0 || *end < *start || *end > view->len) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: [start, end) outside the buffer", fname);
        return -1;
    }
    return 0;
}

static PyObject *
frame_fast(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t start, end;
    if (frame_args(args, nargs, "frame_fast", &view, &start, &end) < 0) {
        return NULL;
    }
    PyObject *cmd = json_frame((const unsigned char *)view.buf + start, end - start);
    PyBuffer_Release(&view);
    if (cmd == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return cmd;
}

static PyObject *
frame(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t start, end;
    if (frame_args(args, nargs, "frame", &view, &start, &end) < 0) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf + start;
    PyObject *cmd = json_frame(p, end - start);
    if (cmd == NULL && !PyErr_Occurred()) {
        PyObject *raw = PyBytes_FromStringAndSize((const char *)p, end - start);
        if (raw != NULL) {
            cmd = PyObject_CallOneArg(frame_reference, raw);
            Py_DECREF(raw);
        }
    }
    PyBuffer_Release(&view);
    return cmd;
}

/* -- send_frames ------------------------------------------------------------------------- */

static inline unsigned char *
put_bytes(unsigned char *o, const char *b, Py_ssize_t n)
{
    memcpy(o, b, (size_t)n);
    return o + n;
}

enum { SEND_PIECES = 7 };

static PyObject *
send_frames(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "send_frames(pieces, first_opaque, born_ms, messages) takes 4 arguments");
        return NULL;
    }
    PyObject *pieces = args[0], *messages = args[3];
    if (!PyTuple_Check(pieces) || PyTuple_GET_SIZE(pieces) != SEND_PIECES ||
        !PyList_Check(messages)) {
        PyErr_SetString(PyExc_TypeError, "send_frames: pieces tuple and a list of messages");
        return NULL;
    }
    /* head (code, language, version), after the opaque (flag, remark), up to g's value,
     * between g's and i's, after i's; the mark's serialize type bits; the frame limit */
    const char *piece[5];
    Py_ssize_t piece_len[5];
    for (int k = 0; k < 5; k++) {
        PyObject *b = PyTuple_GET_ITEM(pieces, k);
        if (!PyBytes_Check(b)) {
            PyErr_SetString(PyExc_TypeError, "send_frames: template pieces must be bytes");
            return NULL;
        }
        piece[k] = PyBytes_AS_STRING(b);
        piece_len[k] = PyBytes_GET_SIZE(b);
    }
    long long mark = PyLong_AsLongLong(PyTuple_GET_ITEM(pieces, 5));
    long long frame_max = PyLong_AsLongLong(PyTuple_GET_ITEM(pieces, 6));
    long long first = PyLong_AsLongLong(args[1]);
    long long born = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    char g[24];
    int g_len = snprintf(g, sizeof g, "%lld", born);
    Py_ssize_t n = PyList_GET_SIZE(messages);
    /* Constant part of a frame: length, mark, head, opaque, after-opaque, fields length,
     * the field pieces and g's and i's length prefixes and g's value. */
    Py_ssize_t fixed = 4 + 4 + piece_len[0] + 4 + piece_len[1] + 4 + piece_len[2] + 4 + g_len +
                       piece_len[3] + 4 + piece_len[4];
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(m, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(m, 1))) {
            PyErr_SetString(PyExc_TypeError, "send_frames: messages are (bytes, bytes) pairs");
            return NULL;
        }
        Py_ssize_t length = fixed - 4 + PyBytes_GET_SIZE(PyTuple_GET_ITEM(m, 0)) +
                            PyBytes_GET_SIZE(PyTuple_GET_ITEM(m, 1));
        if (length > frame_max) {
            PyErr_Format(protocol_error != NULL ? protocol_error : PyExc_ValueError,
                         "frame of %zd bytes exceeds %lld", length, frame_max);
            return NULL;
        }
        total += 4 + length;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        PyObject *props = PyTuple_GET_ITEM(m, 0), *body = PyTuple_GET_ITEM(m, 1);
        Py_ssize_t props_len = PyBytes_GET_SIZE(props), body_len = PyBytes_GET_SIZE(body);
        Py_ssize_t fields_len = piece_len[2] + 4 + g_len + piece_len[3] + 4 + props_len +
                                piece_len[4];
        Py_ssize_t header_len = piece_len[0] + 4 + piece_len[1] + 4 + fields_len;
        o = lmqtt_put_be32(o, (uint32_t)(4 + header_len + body_len));
        o = lmqtt_put_be32(o, (uint32_t)mark | (uint32_t)header_len);
        o = put_bytes(o, piece[0], piece_len[0]);
        o = lmqtt_put_be32(o, (uint32_t)(first + i));
        o = put_bytes(o, piece[1], piece_len[1]);
        o = lmqtt_put_be32(o, (uint32_t)fields_len);
        o = put_bytes(o, piece[2], piece_len[2]);
        o = lmqtt_put_be32(o, (uint32_t)g_len);
        o = put_bytes(o, g, g_len);
        o = put_bytes(o, piece[3], piece_len[3]);
        o = lmqtt_put_be32(o, (uint32_t)props_len);
        o = put_bytes(o, PyBytes_AS_STRING(props), props_len);
        o = put_bytes(o, piece[4], piece_len[4]);
        o = put_bytes(o, PyBytes_AS_STRING(body), body_len);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(MessageRecord, ProtocolError, crc32, host_v6, dispatch key, name/value "
     "separator, property separator, dispatch separator, magic v1, magic v2, blank magic, "
     "born host v6 flag, store host v6 flag)"},
    {"records", (PyCFunction)(void (*)(void))records, METH_FASTCALL,
     "records(body, check_crc, wanted) -> (records, last CommitLog offset)"},
    {"configure_frames", configure_frames, METH_VARARGS,
     "configure_frames(RemotingCommand, SerializeType.JSON, decode_frame, header keys)"},
    {"frame", (PyCFunction)(void (*)(void))frame, METH_FASTCALL,
     "frame(buf, start, end) -> decode_frame(buf[start:end])"},
    {"frame_fast", (PyCFunction)(void (*)(void))frame_fast, METH_FASTCALL,
     "frame_fast(buf, start, end) -> the command of a plain JSON frame, else None"},
    {"send_frames", (PyCFunction)(void (*)(void))send_frames, METH_FASTCALL,
     "send_frames(pieces, first_opaque, born_ms, messages) -> the frames, joined"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "rocketmq_remoting._speedups", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return lmqtt_module(&module_def);
}
