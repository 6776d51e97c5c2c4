/* MPISTRAT_CHECK=step's hot paths, compiled: the state every unchecked collective reads
   (StepState, the base of step_check.CompiledStepCheck: a collective's deferral and the record's
   code), the marks every collective leaves (Marks, the base of step_check.CompiledMonitor) and a
   learned step's closing handshake (Closing, closing.close_step's compiled twin).

   The Python code is the reference: step_check.PythonStepState, monitor.PythonMarks and
   closing.close_step's watched handshake. It runs where this was not built (no C compiler at `pip
   install .`) or MPISTRAT_NATIVE is off, to the same effect. Each type reads and writes its own
   fields alone: Closing those of the Marks and the StepState it is made with (both this module's),
   and it calls the functions it is made with (a kind's first code, a handshake's Start and Wait,
   the tally's filing, ...) and is handed the rest per call. Closing does what its twin does in its
   common case and returns False, having done nothing, for any other: the caller then takes the
   Python path. The handshake's slots are handshake.py's (MAGIC ... STOP, in that order). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <structmember.h>

#if SIZEOF_PY_HASH_T != 8
#error "the record's code reproduces CPython's 64-bit tuple hash: a 32-bit Python runs the Python twins"
#endif

enum { SLOTS = 13, ERROR = 8, LAST_ARRIVAL = 10, LONGEST_WAIT = 11, STOP = 12, ENDED = 4 };

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* time.monotonic()'s clock on Linux and macOS */
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* CPython's tuple hash (Objects/tupleobject.c): xxHash's round per item, then the length. */
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)

static Py_uhash_t xx_round(Py_uhash_t acc, Py_uhash_t lane) {
    acc += lane * XXPRIME_2;
    acc = (acc << 31) | (acc >> 33);
    return acc * XXPRIME_1;
}

static Py_hash_t xx_end(Py_uhash_t acc, Py_ssize_t length) {
    acc += (Py_uhash_t)length ^ (XXPRIME_5 ^ 3527539UL);
    return acc == (Py_uhash_t)-1 ? 1546275796 : (Py_hash_t)acc;
}

/* hash(tuple(items[start::3])), the tuple unbuilt; -1 with an exception where an item has no hash */
static Py_hash_t every_third_hash(PyObject **items, Py_ssize_t n, Py_ssize_t start) {
    Py_uhash_t acc = XXPRIME_5;
    for (Py_ssize_t i = start; i < n; i += 3) {
        Py_hash_t lane = PyObject_Hash(items[i]);
        if (lane == -1) return -1;
        acc = xx_round(acc, (Py_uhash_t)lane);
    }
    return xx_end(acc, n > start ? (n - start + 2) / 3 : 0);
}

/* hash((tuple(record[0::3]), tuple(record[2::3]))): StepCheck.code() before its mask. */
static int record_hash(PyObject *record, Py_hash_t *out) {
    Py_ssize_t n = PyList_GET_SIZE(record);
    PyObject **items = ((PyListObject *)record)->ob_item;
    Py_hash_t numbers = every_third_hash(items, n, 0);
    if (numbers == -1) return -1;
    Py_hash_t codes = every_third_hash(items, n, 2);
    if (codes == -1) return -1;
    *out = xx_end(xx_round(xx_round(XXPRIME_5, (Py_uhash_t)numbers), (Py_uhash_t)codes), 2);
    return 0;
}

/* Marks: what one communicator's collectives are doing, as Monitor.enter, Monitor.leave, the watch
   and the handshake mark it (monitor.PythonMarks' fields: see the Monitor's docstring). */
typedef struct {
    PyObject_HEAD
    PyObject *kind, *start, *deadline, *polled, *thread, *last_thread, *last, *agreed, *completed,
        *handshakes;
} Marks;

#define MARKS_FIELDS X(kind) X(start) X(deadline) X(polled) X(thread) X(last_thread) X(last) X(agreed) \
    X(completed) X(handshakes)

static int Marks_init(Marks *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", keywords)) return -1;
    PyObject *kind = PyUnicode_FromString(""), *zero = PyLong_FromLong(0);
    if (kind == NULL || zero == NULL) {
        Py_XDECREF(kind);
        Py_XDECREF(zero);
        return -1;
    }
    Py_XSETREF(self->kind, kind);
    Py_XSETREF(self->start, Py_NewRef(Py_None));
    Py_XSETREF(self->deadline, Py_NewRef(Py_None));
    Py_XSETREF(self->polled, Py_NewRef(Py_False));
    Py_XSETREF(self->thread, Py_NewRef(Py_None));
    Py_XSETREF(self->last_thread, Py_NewRef(Py_None));
    Py_XSETREF(self->last, Py_NewRef(Py_None));
    Py_XSETREF(self->agreed, Py_NewRef(Py_None));
    Py_XSETREF(self->completed, Py_NewRef(zero));
    Py_XSETREF(self->handshakes, zero);
    return 0;
}

static int Marks_traverse(Marks *self, visitproc visit, void *arg) {
#define X(field) Py_VISIT(self->field);
    MARKS_FIELDS
#undef X
    return 0;
}

static int Marks_clear(Marks *self) {
#define X(field) Py_CLEAR(self->field);
    MARKS_FIELDS
#undef X
    return 0;
}

static void Marks_dealloc(Marks *self) {
    PyObject_GC_UnTrack(self);
    Marks_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Marks_members[] = {
#define X(field) {#field, T_OBJECT_EX, offsetof(Marks, field), 0, NULL},
    MARKS_FIELDS
#undef X
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MarksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpistrat.collectives.native_step.Marks",
    .tp_doc = "Marks(): what one communicator's collectives are doing (monitor.PythonMarks' fields).",
    .tp_basicsize = sizeof(Marks),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    /* .tp_new: object's (PyInit_native_step), so that a subclass's instance dict is laid out
       inline as a plain class's is (CPython specializes the monitor's other attributes on it) */
    .tp_init = (initproc)Marks_init,
    .tp_dealloc = (destructor)Marks_dealloc,
    .tp_traverse = (traverseproc)Marks_traverse,
    .tp_clear = (inquiry)Marks_clear,
    .tp_members = Marks_members,
};

/* StepState: the phase, the record, the kinds' codes, the record's limit, the kind coder. */
typedef struct {
    PyObject_HEAD
    char learning;
    PyObject *record, *kinds, *coder;
    Py_ssize_t limit;
} StepState;

static PyTypeObject StepStateType;

typedef struct {
    PyObject_HEAD
    Marks *marks;
    StepState *step;
    PyObject *append, *start, *wait, *file, *reached, *disagreed, *kind;
    PyObject *send_owner, *recv_owner;
    Py_buffer send, recv;
    int64_t magic, kind_code, nothing, mask;
    double timeout; /* < 0: none */
    Py_ssize_t closes; /* the closings done here (the others went to Python) */
} Closing;

#define CLOSING_OBJECTS X(marks) X(step) X(append) X(start) X(wait) X(file) X(reached) X(disagreed) \
    X(kind) X(send_owner) X(recv_owner)

static int set_float(PyObject **field, double value) {
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL) return -1;
    Py_XSETREF(*field, v);
    return 0;
}

static void set_object(PyObject **field, PyObject *value) { Py_XSETREF(*field, Py_NewRef(value)); }

/* [seq, kind, fingerprint, began, None, None, None]: a flight record's entry (diagnostics/flight.py). */
static PyObject *flight_entry(long long seq, PyObject *kind, long long fingerprint, double began) {
    PyObject *entry = PyList_New(7);
    if (entry == NULL) return NULL;
    PyObject *items[4] = {PyLong_FromLongLong(seq), Py_NewRef(kind), PyLong_FromLongLong(fingerprint),
                          PyFloat_FromDouble(began)};
    for (int i = 0; i < 7; i++) PyList_SET_ITEM(entry, i, i < 4 ? items[i] : Py_NewRef(Py_None));
    if (items[0] == NULL || items[2] == NULL || items[3] == NULL) Py_CLEAR(entry);
    return entry;
}

/* (kind, seq, ended): the last collective. */
static PyObject *last_of(PyObject *kind, PyObject *seq, double ended) {
    PyObject *end = PyFloat_FromDouble(ended);
    if (end == NULL) return NULL;
    PyObject *last = PyTuple_Pack(3, kind, seq, end);
    Py_DECREF(end);
    return last;
}

static PyObject *call_with_two(PyObject *fn, long long a, long long b) {
    PyObject *x = PyLong_FromLongLong(a), *y = PyLong_FromLongLong(b), *got = NULL;
    if (x != NULL && y != NULL) got = PyObject_CallFunctionObjArgs(fn, x, y, NULL);
    Py_XDECREF(x);
    Py_XDECREF(y);
    return got;
}

/* close(collectives, kind, seq, fingerprint, describe, requested, outgoing) -> bool: see the module's
   comment and closing._compiled, whose arguments these are (collectives only handed on to
   disagreed; seq the closing's number, taken already; requested the stop's; outgoing the tally's),
   called with the monitor's lock held. */
static PyObject *Closing_close(Closing *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "close() takes the collectives, a kind, a number, a fingerprint, a describe, the stop's "
                        "request and the tally's outgoing pair");
        return NULL;
    }
    if (self->marks == NULL) {
        PyErr_SetString(PyExc_TypeError, "close() needs an initialised Closing");
        return NULL;
    }
    Marks *marks = self->marks;
    PyObject *kind = args[1], *number = args[2], *outgoing = args[6];
    if (kind != self->kind) Py_RETURN_FALSE; /* another kind than this closing's */
    int overflow;
    long long fingerprint = PyLong_AsLongLongAndOverflow(args[3], &overflow);
    if (fingerprint == -1 && PyErr_Occurred()) return NULL;
    if (overflow) Py_RETURN_FALSE; /* not a 62-bit code: Python raises what packing it raises */
    long long seq = PyLong_AsLongLong(number);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    long long last = -1, longest = -1;
    if (!PyTuple_Check(outgoing) || PyTuple_GET_SIZE(outgoing) != 2) {
        PyErr_SetString(PyExc_TypeError, "the straggler tally's outgoing is not a pair");
        return NULL;
    }
    last = PyLong_AsLongLong(PyTuple_GET_ITEM(outgoing, 0));
    if (last == -1 && PyErr_Occurred()) return NULL;
    longest = PyLong_AsLongLong(PyTuple_GET_ITEM(outgoing, 1));
    if (longest == -1 && PyErr_Occurred()) return NULL;
    int stop = PyObject_IsTrue(args[5]);
    if (stop < 0) return NULL;

    PyObject *got, *thread = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    PyObject *entry = NULL, *result = NULL;
    double began = monotonic(), ended = began;
    int failed = 1;
    if (thread == NULL) goto release;
    set_object(&marks->thread, thread);
    /* Monitor.enter, its timeout the environment's (not polled: a closing that would poll runs in
       Python); start last, as there */
    set_object(&marks->kind, kind);
    if (self->timeout < 0) {
        set_object(&marks->deadline, Py_None);
    } else if (set_float(&marks->deadline, began + self->timeout) < 0) {
        goto marks;
    }
    set_object(&marks->polled, Py_False);
    if (set_float(&marks->start, began) < 0) goto marks;

    /* the handshake (handshake.exchange) */
    PyObject *record = self->step->record;
    if (PyList_GET_SIZE(record)) {
        Py_hash_t h;
        if (record_hash(record, &h) < 0) goto marks;
        fingerprint ^= (long long)(h & self->mask);
    }
    int64_t *send = (int64_t *)self->send.buf;
    const int64_t values[SLOTS] = {
        self->magic, seq, self->kind_code, fingerprint,
        -self->magic, -seq, -self->kind_code, -fingerprint,
        0, 0, last, longest, stop,
    };
    memcpy(send, values, sizeof values);
    if ((got = PyObject_CallNoArgs(self->start)) == NULL) goto marks;
    Py_DECREF(got);
    entry = flight_entry(seq, kind, fingerprint, began); /* flight.entry(), as exchange builds it */
    if (entry == NULL) goto marks;
    if ((got = PyObject_CallOneArg(self->append, entry)) == NULL) goto marks;
    Py_DECREF(got);
    if ((got = PyObject_CallNoArgs(self->wait)) == NULL) goto marks;
    Py_DECREF(got);
    ended = monotonic();
    PyObject *end = PyFloat_FromDouble(ended);
    if (end == NULL || PyList_SetItem(entry, ENDED, end) < 0) goto marks;
    int64_t top[SLOTS];
    memcpy(top, self->recv.buf, sizeof top);
    /* the straggler tally: the previous handshake's arrivals, where it was measured (Tally.learn;
       this one's the caller forgets, as close_step does whatever comes of the closing) */
    if (top[LAST_ARRIVAL] > self->nothing) {
        if ((got = call_with_two(self->file, top[LAST_ARRIVAL], top[LONGEST_WAIT])) == NULL) goto marks;
        Py_DECREF(got);
    }
    long long count = PyLong_AsLongLong(marks->handshakes);
    if (count == -1 && PyErr_Occurred()) goto marks;
    PyObject *handshakes = PyLong_FromLongLong(count + 1);
    if (handshakes == NULL) goto marks;
    Py_SETREF(marks->handshakes, handshakes);
    if (top[STOP]) {
        if ((got = PyObject_CallNoArgs(self->reached)) == NULL) goto marks;
        Py_DECREF(got);
    }
    int differ = top[ERROR] != 0;
    for (int i = 0; i < 4; i++) differ |= top[i] + top[4 + i] != 0;
    if (differ) { /* raises on every rank alike, naming what differed */
        got = PyObject_CallFunctionObjArgs(self->disagreed, args[0], kind, args[4], Py_None, entry, NULL);
        Py_XDECREF(got);
        if (got != NULL) PyErr_SetString(PyExc_AssertionError, "the ranks disagreed, and nothing raised");
        goto marks;
    }
    set_object(&marks->agreed, marks->start);
    if (PyList_SetSlice(record, 0, PyList_GET_SIZE(record), NULL) < 0) goto marks;
    set_object(&marks->completed, number);
    failed = 0;
    self->closes++;

marks: /* Monitor.leave, keeping the exception that is under way */
    {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (failed) ended = monotonic();
        PyObject *last_marks = last_of(kind, number, ended);
        set_object(&marks->start, Py_None);
        set_object(&marks->deadline, Py_None);
        set_object(&marks->polled, Py_False);
        if (last_marks == NULL) PyErr_Clear();
        else Py_XSETREF(marks->last, last_marks);
        PyErr_Restore(type, value, traceback);
    }
release: /* the watch's last marks (the caller releases the lock) */
    if (thread != NULL) set_object(&marks->last_thread, thread);
    set_object(&marks->thread, Py_None);
    Py_XDECREF(thread);
    Py_XDECREF(entry);
    if (!failed) result = Py_NewRef(Py_True);
    return result;
}

static int Closing_traverse(Closing *self, visitproc visit, void *arg) {
#define X(field) Py_VISIT(self->field);
    CLOSING_OBJECTS
#undef X
    return 0;
}

static int Closing_clear(Closing *self) {
    if (self->send.obj != NULL) PyBuffer_Release(&self->send);
    if (self->recv.obj != NULL) PyBuffer_Release(&self->recv);
#define X(field) Py_CLEAR(self->field);
    CLOSING_OBJECTS
#undef X
    return 0;
}

static void Closing_dealloc(Closing *self) {
    PyObject_GC_UnTrack(self);
    Closing_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int take_buffer(PyObject *owner, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(owner, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len != SLOTS * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "the handshake's %s buffer holds %zd bytes, expected %zd", name,
                     view->len, SLOTS * (Py_ssize_t)sizeof(int64_t));
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int Closing_init(Closing *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"marks", "step", "append", "start", "wait", "file", "reached", "disagreed",
                               "send", "recv", "kind", "kind_code", "magic", "timeout", "nothing", "mask",
                               NULL};
    PyObject *marks, *step, *append, *start, *wait, *file, *reached, *disagreed, *send, *recv, *kind, *timeout;
    long long kind_code, magic, nothing, mask;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!O!OOOOOOOOULLOLL", keywords, &MarksType, &marks,
                                     &StepStateType, &step, &append, &start, &wait, &file, &reached, &disagreed,
                                     &send, &recv, &kind, &kind_code, &magic, &timeout, &nothing, &mask))
        return -1;
    Closing_clear(self);
    if (((StepState *)step)->record == NULL) {
        PyErr_SetString(PyExc_TypeError, "Closing() needs an initialised StepState");
        return -1;
    }
    if (take_buffer(send, &self->send, "send") < 0 || take_buffer(recv, &self->recv, "receive") < 0)
        return -1;
    if (timeout == Py_None) {
        self->timeout = -1.0;
    } else if ((self->timeout = PyFloat_AsDouble(timeout)) == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    self->marks = (Marks *)Py_NewRef(marks);
    self->step = (StepState *)Py_NewRef(step);
#define X(field) self->field = Py_NewRef(field);
    X(append) X(start) X(wait) X(file) X(reached) X(disagreed) X(kind)
#undef X
    self->send_owner = Py_NewRef(send);
    self->recv_owner = Py_NewRef(recv);
    self->kind_code = kind_code;
    self->magic = magic;
    self->nothing = nothing;
    self->mask = mask;
    return 0;
}

static PyMethodDef Closing_methods[] = {
    {"close", (PyCFunction)(void (*)(void))Closing_close, METH_FASTCALL,
     "close(collectives, kind, seq, fingerprint, describe, requested, outgoing) -> bool: close the step "
     "here (True), or do nothing (False)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Closing_members[] = {
    {"closes", T_PYSSIZET, offsetof(Closing, closes), READONLY, "The closings done here, not in Python."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ClosingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpistrat.collectives.native_step.Closing",
    .tp_doc = "One communicator's compiled closing handshake (see closing.close_step).",
    .tp_basicsize = sizeof(Closing),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Closing_init,
    .tp_dealloc = (destructor)Closing_dealloc,
    .tp_traverse = (traverseproc)Closing_traverse,
    .tp_clear = (inquiry)Closing_clear,
    .tp_methods = Closing_methods,
    .tp_members = Closing_members,
};


static int StepState_init(StepState *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"limit", "coder", NULL};
    PyObject *coder;
    Py_ssize_t limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nO", keywords, &limit, &coder)) return -1;
    if (!PyCallable_Check(coder)) {
        PyErr_SetString(PyExc_TypeError, "StepState() needs a callable coder");
        return -1;
    }
    PyObject *record = PyList_New(0), *kinds = PyDict_New();
    if (record == NULL || kinds == NULL) {
        Py_XDECREF(record);
        Py_XDECREF(kinds);
        return -1;
    }
    Py_XSETREF(self->record, record);
    Py_XSETREF(self->kinds, kinds);
    Py_XSETREF(self->coder, Py_NewRef(coder));
    self->limit = limit;
    self->learning = 1;
    return 0;
}

static int StepState_traverse(StepState *self, visitproc visit, void *arg) {
    Py_VISIT(self->record);
    Py_VISIT(self->kinds);
    Py_VISIT(self->coder);
    return 0;
}

static int StepState_clear(StepState *self) {
    Py_CLEAR(self->record);
    Py_CLEAR(self->kinds);
    Py_CLEAR(self->coder);
    return 0;
}

static void StepState_dealloc(StepState *self) {
    PyObject_GC_UnTrack(self);
    StepState_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int initialised(StepState *self) {
    if (self->record != NULL) return 1;
    PyErr_SetString(PyExc_TypeError, "an uninitialised StepState");
    return 0;
}

/* defer(seq, kind, fingerprint) -> bool: PythonStepState.defer, whose arguments these are. */
static PyObject *StepState_defer(StepState *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "defer() takes a number, a kind and a fingerprint");
        return NULL;
    }
    if (!initialised(self)) return NULL;
    PyObject *record = self->record, *kind = args[1];
    if (self->learning || PyList_GET_SIZE(record) >= self->limit) Py_RETURN_FALSE;
    PyObject *code = PyDict_GetItemWithError(self->kinds, kind); /* borrowed */
    if (code != NULL) {
        Py_INCREF(code);
    } else if (PyErr_Occurred() || (code = PyObject_CallFunctionObjArgs(self->coder, self->kinds, kind, NULL)) == NULL) {
        return NULL; /* a kind's first unchecked call: the coder remembers its code in kinds */
    }
    PyObject *entry = PyNumber_Xor(code, args[2]);
    Py_DECREF(code);
    if (entry == NULL) return NULL;
    Py_ssize_t before = PyList_GET_SIZE(record);
    int failed = PyList_Append(record, args[0]) < 0 || PyList_Append(record, kind) < 0 ||
                 PyList_Append(record, entry) < 0;
    Py_DECREF(entry);
    if (failed) { /* all three or none, as the Python twin's += */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (PyList_SetSlice(record, before, PyList_GET_SIZE(record), NULL) < 0) PyErr_Clear();
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* record_code() -> int: hash((tuple(record[0::3]), tuple(record[2::3]))), the tuples unbuilt. */
static PyObject *StepState_record_code(StepState *self, PyObject *Py_UNUSED(ignored)) {
    if (!initialised(self)) return NULL;
    Py_hash_t h;
    if (record_hash(self->record, &h) < 0) return NULL;
    return PyLong_FromSsize_t(h);
}

static PyMethodDef StepState_methods[] = {
    {"defer", (PyCFunction)(void (*)(void))StepState_defer, METH_FASTCALL,
     "defer(seq, kind, fingerprint) -> bool: record call #seq unchecked (PythonStepState.defer)."},
    {"record_code", (PyCFunction)StepState_record_code, METH_NOARGS,
     "record_code() -> int: the hash of the record's numbers and codes (PythonStepState.record_code)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef StepState_members[] = {
    {"learning", T_BOOL, offsetof(StepState, learning), 0, "Every call sends (until a closing passes)."},
    {"record", T_OBJECT_EX, offsetof(StepState, record), READONLY, "The unchecked collectives, flat."},
    {"kinds", T_OBJECT_EX, offsetof(StepState, kinds), READONLY, "Each kind's code in the record."},
    {"limit", T_PYSSIZET, offsetof(StepState, limit), READONLY, "The record's length at most."},
    {"coder", T_OBJECT_EX, offsetof(StepState, coder), READONLY, "coder(kinds, kind): a kind's first code."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StepStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpistrat.collectives.native_step.StepState",
    .tp_doc = "StepState(limit, coder): the phase, record and kinds' codes of MPISTRAT_CHECK=step.",
    .tp_basicsize = sizeof(StepState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)StepState_init,
    .tp_dealloc = (destructor)StepState_dealloc,
    .tp_traverse = (traverseproc)StepState_traverse,
    .tp_clear = (inquiry)StepState_clear,
    .tp_methods = StepState_methods,
    .tp_members = StepState_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "native_step",
    "MPISTRAT_CHECK=step's hot paths, compiled: StepState (a call's deferral), Marks (what the collectives "
    "are doing), Closing (a step's closing).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_native_step(void) {
    MarksType.tp_new = PyBaseObject_Type.tp_new;
    if (PyType_Ready(&MarksType) < 0 || PyType_Ready(&ClosingType) < 0 || PyType_Ready(&StepStateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Marks", (PyObject *)&MarksType) < 0 ||
        PyModule_AddObjectRef(m, "Closing", (PyObject *)&ClosingType) < 0 ||
        PyModule_AddObjectRef(m, "StepState", (PyObject *)&StepStateType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
