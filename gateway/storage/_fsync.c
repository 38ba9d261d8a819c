/*
 * FsyncThread: a POSIX thread that fdatasyncs one file on request and says so through an
 * eventfd, without ever taking the GIL. The twin of PyFsyncThread, its pure-Python reference
 * (gateway/storage/fsync_thread.py: the protocol, the diagram, the rules); same methods, same
 * answers (tests/gateway/storage/test_fsync_thread.py runs both).
 *
 *     loop thread (GIL)                         fsync thread (no GIL)
 *     request(upto): requested = upto  ------>  wait on cond; fd, upto = current
 *                                               fdatasync(fd)
 *     eventfd readable  <---------------------  synced = upto; fsyncs++; write(efd, 1)
 *     collect() -> (synced, fsyncs, errno)
 *
 * Every field below is read and written under `mu` (the thread's and the loop's); the GIL
 * plays no part. Both sides signal after unlocking `mu` (the condition, the eventfd): the
 * other side, woken while `mu` is still held, would block on it at once and need a second
 * wake-up (two more futex calls per fsync on each side). The object holds a reference to
 * itself while its thread runs; stop() joins the thread and drops it.
 *
 * Built by setup.py as an optional extension; accelerators.load decides whether it runs.
 */
#include "kernel.h"
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cond;
    pthread_t thread;
    int running;    /* the thread was started and not joined */
    int stopping;
    int efd;        /* eventfd: written once per fsync ended; -1 after stop */
    int fd;         /* the file (owned); -1: none */
    int using;      /* the fd an fsync in progress uses; -1: none */
    int retired;    /* replaced while in use: closed by the thread after that fsync */
    long long requested, started_upto, synced, fsyncs;
    int error;      /* errno of a failed fsync since the last collect; 0: none */
} FsyncThread;

static void *
fsync_run(void *arg)
{
    FsyncThread *self = (FsyncThread *)arg;
    pthread_mutex_lock(&self->mu);
    for (;;) {
        while (!self->stopping && self->requested <= self->started_upto) {
            pthread_cond_wait(&self->cond, &self->mu);
        }
        if (self->stopping) {
            break;
        }
        long long upto = self->started_upto = self->requested;
        int fd = self->using = self->fd;
        pthread_mutex_unlock(&self->mu);
        int error = 0;
        if (fd < 0) {
            error = EBADF; /* no file to sync */
        }
        else if (fdatasync(fd) != 0) {
            error = errno ? errno : EIO;
        }
        pthread_mutex_lock(&self->mu);
        self->using = -1;
        if (self->retired >= 0) {
            close(self->retired);
            self->retired = -1;
        }
        if (error) {
            self->error = error;
            /* Nothing pending: the next request (a higher position) tries again. */
            self->requested = self->started_upto = self->synced;
        }
        else if (upto > self->synced) {
            self->synced = upto;
        }
        self->fsyncs++;
        int efd = self->efd; /* closed only by stop(), after joining this thread */
        pthread_mutex_unlock(&self->mu);
        uint64_t one = 1;
        ssize_t w;
        do {
            w = write(efd, &one, sizeof one);
        } while (w < 0 && errno == EINTR);
        pthread_mutex_lock(&self->mu);
    }
    pthread_mutex_unlock(&self->mu);
    return NULL;
}

static PyObject *
FsyncThread_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "FsyncThread() takes no arguments");
        return NULL;
    }
    int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    FsyncThread *self = (FsyncThread *)type->tp_alloc(type, 0);
    if (self == NULL) {
        close(efd);
        return NULL;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cond, NULL);
    self->efd = efd;
    self->fd = self->using = self->retired = -1;
    return (PyObject *)self;
}

static void
close_fds(FsyncThread *self)
{
    int fds[3] = {self->fd, self->retired, self->efd};
    self->fd = self->retired = self->efd = -1;
    for (int i = 0; i < 3; i++) {
        if (fds[i] >= 0) {
            close(fds[i]);
        }
    }
}

static PyObject *
FsyncThread_stop(FsyncThread *self, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&self->mu);
    self->stopping = 1;
    pthread_cond_signal(&self->cond);
    int running = self->running;
    self->running = 0;
    pthread_mutex_unlock(&self->mu);
    if (running) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(self->thread, NULL);
        Py_END_ALLOW_THREADS
    }
    close_fds(self);
    if (running) {
        Py_DECREF(self); /* the thread's reference */
    }
    Py_RETURN_NONE;
}

static void
FsyncThread_dealloc(FsyncThread *self)
{
    /* Never running here: a running thread holds a reference. */
    close_fds(self);
    pthread_cond_destroy(&self->cond);
    pthread_mutex_destroy(&self->mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
FsyncThread_fileno(FsyncThread *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(self->efd);
}

static PyObject *
FsyncThread_set_fd(FsyncThread *self, PyObject *arg)
{
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (value < 0 || value > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "set_fd: not a file descriptor");
        return NULL;
    }
    int fd = (int)value;
    pthread_mutex_lock(&self->mu);
    int old = self->fd;
    self->fd = fd;
    if (old >= 0 && old == self->using) {
        self->retired = old;
        old = -1;
    }
    pthread_mutex_unlock(&self->mu);
    if (old >= 0) {
        close(old);
    }
    Py_RETURN_NONE;
}

static PyObject *
FsyncThread_request(FsyncThread *self, PyObject *arg)
{
    long long upto = PyLong_AsLongLong(arg);
    if (upto == -1 && PyErr_Occurred()) {
        return NULL;
    }
    pthread_mutex_lock(&self->mu);
    if (self->stopping) {
        pthread_mutex_unlock(&self->mu);
        Py_RETURN_NONE;
    }
    if (upto > self->requested) {
        self->requested = upto;
    }
    if (!self->running) {
        Py_INCREF(self); /* the thread's reference, dropped by stop() */
        int rc = pthread_create(&self->thread, NULL, fsync_run, self);
        if (rc != 0) {
            pthread_mutex_unlock(&self->mu);
            Py_DECREF(self);
            errno = rc;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        self->running = 1;
    }
    pthread_mutex_unlock(&self->mu);
    pthread_cond_signal(&self->cond);
    Py_RETURN_NONE;
}

static PyObject *
FsyncThread_collect(FsyncThread *self, PyObject *Py_UNUSED(ignored))
{
    uint64_t count;
    if (self->efd >= 0 && read(self->efd, &count, sizeof count) < 0 && errno != EAGAIN) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pthread_mutex_lock(&self->mu);
    long long synced = self->synced, fsyncs = self->fsyncs;
    int error = self->error;
    self->fsyncs = 0;
    self->error = 0;
    pthread_mutex_unlock(&self->mu);
    return Py_BuildValue("(LLi)", synced, fsyncs, error);
}

static PyMethodDef FsyncThread_methods[] = {
    {"fileno", (PyCFunction)FsyncThread_fileno, METH_NOARGS,
     "The eventfd the loop watches: readable once an fsync ended (-1 after stop)."},
    {"set_fd", (PyCFunction)FsyncThread_set_fd, METH_O,
     "Sync `fd` from now on; the thread owns it (closes it when replaced or stopped)."},
    {"request", (PyCFunction)FsyncThread_request, METH_O,
     "Make the file durable up to position `upto` (starts the thread at the first)."},
    {"collect", (PyCFunction)FsyncThread_collect, METH_NOARGS,
     "(synced position, fsyncs since the last collect, errno of a failed one or 0)."},
    {"stop", (PyCFunction)FsyncThread_stop, METH_NOARGS,
     "End the thread (after the fsync it runs) and close the descriptors."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FsyncThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.storage._fsync.FsyncThread",
    .tp_basicsize = sizeof(FsyncThread),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A thread that fdatasyncs one file on request, without the GIL (fsync_thread.py).",
    .tp_new = FsyncThread_new,
    .tp_dealloc = (destructor)FsyncThread_dealloc,
    .tp_methods = FsyncThread_methods,
};

static struct PyModuleDef fsync_module = {
    PyModuleDef_HEAD_INIT, "gateway.storage._fsync",
    "The fsync thread of group commit, without the GIL (see gateway/storage/fsync_thread.py).",
    -1, NULL,
};

PyMODINIT_FUNC
PyInit__fsync(void)
{
    if (PyType_Ready(&FsyncThreadType) < 0) {
        return NULL;
    }
    PyObject *module = lmqtt_module(&fsync_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&FsyncThreadType);
    if (PyModule_AddObject(module, "FsyncThread", (PyObject *)&FsyncThreadType) < 0) {
        Py_DECREF(&FsyncThreadType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
