/*
 * What every C kernel of lmqtt shares. Each kernel is its own extension module and includes
 * this header (it is compiled into each, not linked): setup.py adds this folder to the include
 * path and counts this file in every kernel's SOURCE_SHA256 (accelerators.source_digest).
 */
#ifndef LMQTT_KERNEL_H
#define LMQTT_KERNEL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#ifndef LMQTT_SOURCE_SHA256
#define LMQTT_SOURCE_SHA256 "unknown"
#endif

/* The offsets of `names` in instances of `type_obj`, each of which must be a plain writable
 * object slot (__slots__), so C can read and set them without attribute lookups. -1 with
 * TypeError (naming `fname`) when one is not. */
static inline int
lmqtt_slot_offsets(const char *fname, PyObject *type_obj, const char *const *names, int n,
                   Py_ssize_t *found)
{
    for (int i = 0; i < n; i++) {
        PyObject *descr = PyObject_GetAttrString(type_obj, names[i]);
        if (descr == NULL) {
            return -1;
        }
        int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type)
                 && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX
                 && !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
        if (ok) {
            found[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
        }
        Py_DECREF(descr);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%s: %s.%s is not a plain object slot", fname,
                         ((PyTypeObject *)type_obj)->tp_name, names[i]);
            return -1;
        }
    }
    return 0;
}

/* `v` written big-endian at `o` (the byte order of the store's records and of RocketMQ's
 * frames); returns the byte after it. */
static inline unsigned char *
lmqtt_put_be32(unsigned char *o, uint32_t v)
{
    o[0] = (unsigned char)(v >> 24);
    o[1] = (unsigned char)(v >> 16);
    o[2] = (unsigned char)(v >> 8);
    o[3] = (unsigned char)v;
    return o + 4;
}

/* The module of `def`, with SOURCE_SHA256: the digest of the sources it was compiled from,
 * which a test compares with the files on disk, so a stale build is caught instead of
 * silently tested. */
static inline PyObject *
lmqtt_module(struct PyModuleDef *def)
{
    PyObject *module = PyModule_Create(def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddStringConstant(module, "SOURCE_SHA256", LMQTT_SOURCE_SHA256) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}

#endif
