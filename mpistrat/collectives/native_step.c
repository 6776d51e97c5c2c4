/* MPISTRAT_CHECK=step's hot paths, compiled: the state every unchecked collective reads
   (StepState, the base of step_check.CompiledStepCheck: a collective's deferral and the record's
   code) and a learned step's closing handshake (Closing, closing.close_step's compiled twin).

   The Python code is the reference: step_check.PythonStepState, and closing.close_step's
   watched handshake. It runs where this was not built (no C compiler at `pip install .`) or
   MPISTRAT_NATIVE is off, to the same effect. StepState reads and writes its own fields alone (a
   kind's first code comes from the function it is made with, step_check.kind_code). Closing does
   what its twin does in its common case and returns False, having done nothing, for any other: the
   caller then takes the Python path. It reads and writes the attributes of the objects it is made
   with, by the names in PyInit_native_step (tests/collectives/test_step_twins.py pins each one);
   the handshake's slots are handshake.py's (MAGIC ... STOP, in that order). */

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

typedef struct {
    PyObject_HEAD
    PyObject *monitor, *acquire, *release, *append, *tally, *stop, *record;
    PyObject *start, *wait, *timeline, *monitoring, *kind, *disagreed, *nothing_pair;
    PyObject *send_owner, *recv_owner;
    Py_buffer send, recv;
    int64_t magic, kind_code, nothing, fold_every, mask;
    double timeout; /* < 0: none */
    Py_ssize_t closes; /* the closings done here (the others went to Python) */
} Closing;

static PyObject *s_seq, *s_thread, *s_last_thread, *s_kind, *s_start, *s_deadline,
    *s_last, *s_agreed, *s_completed, *s_handshakes, *s_failures, *s_outgoing, *s_requested,
    *s_reached, *s_filed, *s_fold, *s_writer, *s_exited;

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

static int set_float(PyObject *obj, PyObject *name, double value) {
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

static int add_to(PyObject *obj, PyObject *name, long step, long long *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    long long value = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (value == -1 && PyErr_Occurred()) return -1;
    value += step;
    v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    if (out != NULL) *out = value;
    return r;
}

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

/* (kind, seq, ended): the monitor's last collective. */
static PyObject *last_of(PyObject *kind, long long seq, double ended) {
    PyObject *number = PyLong_FromLongLong(seq), *end = PyFloat_FromDouble(ended), *last = NULL;
    if (number != NULL && end != NULL) last = PyTuple_Pack(3, kind, number, end);
    Py_XDECREF(number);
    Py_XDECREF(end);
    return last;
}

/* Whether the watch would poll this closing (Monitor.enter's `polled`): then Python waits. */
static int polled(Closing *self) {
    if (self->timeout < 0) return 0;
    PyObject *exited = PyObject_GetAttr(self->monitoring, s_exited);
    if (exited == NULL) return -1;
    int r = PyObject_IsTrue(exited);
    Py_DECREF(exited);
    return r;
}

/* close(collectives, kind, fingerprint, describe) -> bool: see the module's comment and
   closing.close_step, whose arguments these are (its fingerprint computed). */
static PyObject *Closing_close(Closing *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "close() takes the collectives, a kind, a fingerprint, a describe");
        return NULL;
    }
    PyObject *collectives = args[0];
    if (self->record == NULL) {
        PyErr_SetString(PyExc_TypeError, "close() needs an initialised Closing");
        return NULL;
    }
    if (args[1] != self->kind) Py_RETURN_FALSE; /* another kind than this closing's */
    int overflow;
    long long fingerprint = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (fingerprint == -1 && PyErr_Occurred()) return NULL;
    if (overflow) Py_RETURN_FALSE; /* not a 62-bit code: Python raises what packing it raises */
    int is_polled = polled(self);
    if (is_polled) return is_polled < 0 ? NULL : Py_NewRef(Py_False);
    PyObject *writer = PyObject_GetAttr(self->timeline, s_writer);
    if (writer == NULL) return NULL;
    int writing = writer != Py_None;
    Py_DECREF(writer);
    if (writing) Py_RETURN_FALSE;
    PyObject *got = PyObject_CallOneArg(self->acquire, Py_False);
    if (got == NULL) return NULL;
    int acquired = got == Py_True;
    Py_DECREF(got);
    if (!acquired) Py_RETURN_FALSE; /* another collective is under way: Python says what to do */

    PyObject *thread = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    PyObject *entry = NULL, *result = NULL;
    long long seq = 0;
    double began = monotonic(), ended = began;
    int failed = 1;
    if (thread == NULL || PyObject_SetAttr(self->monitor, s_thread, thread) < 0) goto release;
    if (add_to(collectives, s_seq, 1, &seq) < 0) goto release;
    if (PyObject_SetAttr(self->monitor, s_kind, self->kind) < 0 ||
        set_float(self->monitor, s_start, began) < 0)
        goto marks;
    if (self->timeout < 0 ? PyObject_SetAttr(self->monitor, s_deadline, Py_None) < 0
                          : set_float(self->monitor, s_deadline, began + self->timeout) < 0)
        goto marks;
    /* monitor.polled stays False: a closing that would poll runs in Python, and every collective
       leaves it False */

    /* the handshake (handshake._exchange) */
    if (PyList_GET_SIZE(self->record)) {
        Py_hash_t h;
        if (record_hash(self->record, &h) < 0) goto marks;
        fingerprint ^= (long long)(h & self->mask);
    }
    PyObject *outgoing = PyObject_GetAttr(self->tally, s_outgoing);
    if (outgoing == NULL) goto marks;
    long long last = -1, longest = -1;
    if (PyTuple_Check(outgoing) && PyTuple_GET_SIZE(outgoing) == 2) {
        last = PyLong_AsLongLong(PyTuple_GET_ITEM(outgoing, 0));
        if (!(last == -1 && PyErr_Occurred())) longest = PyLong_AsLongLong(PyTuple_GET_ITEM(outgoing, 1));
    } else {
        PyErr_SetString(PyExc_TypeError, "the straggler tally's outgoing is not a pair");
    }
    Py_DECREF(outgoing);
    if (PyErr_Occurred()) goto marks;
    PyObject *requested = PyObject_GetAttr(self->stop, s_requested);
    if (requested == NULL) goto marks;
    int stop = PyObject_IsTrue(requested);
    Py_DECREF(requested);
    if (stop < 0) goto marks;
    int64_t *send = (int64_t *)self->send.buf;
    const int64_t values[SLOTS] = {
        self->magic, seq, self->kind_code, fingerprint,
        -self->magic, -seq, -self->kind_code, -fingerprint,
        0, 0, last, longest, stop,
    };
    memcpy(send, values, sizeof values);
    if ((got = PyObject_CallNoArgs(self->start)) == NULL) goto marks;
    Py_DECREF(got);
    entry = flight_entry(seq, self->kind, fingerprint, began); /* flight.entry(), as _exchange builds it */
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
    /* the straggler tally: the previous handshake's arrivals (Tally.learn); then forget(), which
       close_step does whatever comes of the closing */
    if (top[LAST_ARRIVAL] > self->nothing) {
        PyObject *filed = PyObject_GetAttr(self->tally, s_filed);
        if (filed == NULL) goto marks;
        PyObject *pair[2] = {PyLong_FromLongLong(top[LAST_ARRIVAL]), PyLong_FromLongLong(top[LONGEST_WAIT])};
        int r = pair[0] == NULL || pair[1] == NULL || PyList_Append(filed, pair[0]) < 0 ||
                PyList_Append(filed, pair[1]) < 0;
        Py_XDECREF(pair[0]);
        Py_XDECREF(pair[1]);
        Py_ssize_t filed_now = r ? 0 : PyList_GET_SIZE(filed);
        Py_DECREF(filed);
        if (r) goto marks;
        if (filed_now >= self->fold_every) {
            if ((got = PyObject_CallMethodNoArgs(self->tally, s_fold)) == NULL) goto marks;
            Py_DECREF(got);
        }
    }
    if (PyObject_SetAttr(self->tally, s_outgoing, self->nothing_pair) < 0) goto marks;
    if (add_to(collectives, s_handshakes, 1, NULL) < 0) goto marks;
    if (top[STOP]) {
        if ((got = PyObject_CallMethodNoArgs(self->stop, s_reached)) == NULL) goto marks;
        Py_DECREF(got);
    }
    int differ = top[ERROR] != 0;
    for (int i = 0; i < 4; i++) differ |= top[i] + top[4 + i] != 0;
    if (differ) { /* raises on every rank alike, naming what differed */
        got = PyObject_CallFunctionObjArgs(self->disagreed, collectives, self->kind, args[3], Py_None, entry,
                                           NULL);
        Py_XDECREF(got);
        if (got != NULL) PyErr_SetString(PyExc_AssertionError, "the ranks disagreed, and nothing raised");
        goto marks;
    }
    if (set_float(self->monitor, s_agreed, began) < 0) goto marks;
    if (PyList_SetSlice(self->record, 0, PyList_GET_SIZE(self->record), NULL) < 0) goto marks;
    PyObject *completed = PyLong_FromLongLong(seq);
    if (completed == NULL) goto marks;
    int r = PyObject_SetAttr(self->monitor, s_completed, completed);
    Py_DECREF(completed);
    if (r < 0) goto marks;
    failed = 0;
    self->closes++;

marks: /* close_step's finally clauses, keeping the exception that is under way */
    {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (failed) ended = monotonic();
        PyObject *last_marks = last_of(self->kind, seq, ended);
        if (PyObject_SetAttr(self->monitor, s_start, Py_None) < 0) PyErr_Clear();
        if (PyObject_SetAttr(self->monitor, s_deadline, Py_None) < 0) PyErr_Clear();
        if (last_marks == NULL || PyObject_SetAttr(self->monitor, s_last, last_marks) < 0) PyErr_Clear();
        if (failed && add_to(collectives, s_failures, 1, NULL) < 0) PyErr_Clear();
        Py_XDECREF(last_marks);
        PyErr_Restore(type, value, traceback);
    }
release:
    {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (thread == NULL || PyObject_SetAttr(self->monitor, s_last_thread, thread) < 0) PyErr_Clear();
        if (PyObject_SetAttr(self->monitor, s_thread, Py_None) < 0) PyErr_Clear();
        PyObject *released = PyObject_CallNoArgs(self->release);
        if (released == NULL) PyErr_Clear();
        Py_XDECREF(released);
        PyErr_Restore(type, value, traceback);
    }
    Py_XDECREF(thread);
    Py_XDECREF(entry);
    if (!failed) result = Py_NewRef(Py_True);
    return result;
}


static int Closing_traverse(Closing *self, visitproc visit, void *arg) {
    Py_VISIT(self->monitor);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->append);
    Py_VISIT(self->tally);
    Py_VISIT(self->stop);
    Py_VISIT(self->record);
    Py_VISIT(self->start);
    Py_VISIT(self->wait);
    Py_VISIT(self->timeline);
    Py_VISIT(self->monitoring);
    Py_VISIT(self->kind);
    Py_VISIT(self->disagreed);
    Py_VISIT(self->nothing_pair);
    Py_VISIT(self->send_owner);
    Py_VISIT(self->recv_owner);
    return 0;
}

static int Closing_clear(Closing *self) {
    if (self->send.obj != NULL) PyBuffer_Release(&self->send);
    if (self->recv.obj != NULL) PyBuffer_Release(&self->recv);
    Py_CLEAR(self->monitor);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->append);
    Py_CLEAR(self->tally);
    Py_CLEAR(self->stop);
    Py_CLEAR(self->record);
    Py_CLEAR(self->start);
    Py_CLEAR(self->wait);
    Py_CLEAR(self->timeline);
    Py_CLEAR(self->monitoring);
    Py_CLEAR(self->kind);
    Py_CLEAR(self->disagreed);
    Py_CLEAR(self->nothing_pair);
    Py_CLEAR(self->send_owner);
    Py_CLEAR(self->recv_owner);
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
    static char *keywords[] = {"monitor", "busy", "flight", "tally", "stop", "record",
                               "send", "recv", "request", "timeline", "monitoring", "kind", "kind_code",
                               "magic", "timeout", "disagreed", "nothing", "fold_every", "mask", NULL};
    PyObject *monitor, *busy, *flight, *tally, *stop, *record, *send, *recv, *request;
    PyObject *timeline, *monitoring, *kind, *timeout, *disagreed;
    long long kind_code, magic, nothing, fold_every, mask;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OOOOOO!OOOOOULLOOLLL", keywords, &monitor,
                                     &busy, &flight, &tally, &stop, &PyList_Type, &record, &send, &recv,
                                     &request, &timeline, &monitoring, &kind, &kind_code, &magic, &timeout,
                                     &disagreed, &nothing, &fold_every, &mask))
        return -1;
    Closing_clear(self);
    if (take_buffer(send, &self->send, "send") < 0 || take_buffer(recv, &self->recv, "receive") < 0)
        return -1;
    self->send_owner = Py_NewRef(send);
    self->recv_owner = Py_NewRef(recv);
    if ((self->acquire = PyObject_GetAttrString(busy, "acquire")) == NULL ||
        (self->release = PyObject_GetAttrString(busy, "release")) == NULL ||
        (self->append = PyObject_GetAttrString(flight, "append")) == NULL ||
        (self->start = PyObject_GetAttrString(request, "Start")) == NULL ||
        (self->wait = PyObject_GetAttrString(request, "Wait")) == NULL)
        return -1;
    if (timeout == Py_None) {
        self->timeout = -1.0;
    } else if ((self->timeout = PyFloat_AsDouble(timeout)) == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    self->monitor = Py_NewRef(monitor);
    self->tally = Py_NewRef(tally);
    self->stop = Py_NewRef(stop);
    self->record = Py_NewRef(record);
    self->timeline = Py_NewRef(timeline);
    self->monitoring = Py_NewRef(monitoring);
    self->kind = Py_NewRef(kind);
    self->disagreed = Py_NewRef(disagreed);
    self->kind_code = kind_code;
    self->magic = magic;
    self->nothing = nothing;
    self->fold_every = fold_every;
    self->mask = mask;
    self->nothing_pair = Py_BuildValue("(LL)", nothing, nothing);
    return self->nothing_pair == NULL ? -1 : 0;
}

static PyMethodDef Closing_methods[] = {
    {"close", (PyCFunction)(void (*)(void))Closing_close, METH_FASTCALL,
     "close(collectives, kind, fingerprint, describe) -> bool: close the step here (True), or do nothing (False)."},
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

/* StepState: the phase, the record, the kinds' codes, the record's limit, the kind coder. */
typedef struct {
    PyObject_HEAD
    char learning;
    PyObject *record, *kinds, *coder;
    Py_ssize_t limit;
} StepState;

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
    "MPISTRAT_CHECK=step's hot paths, compiled: StepState (a call's deferral), Closing (a step's closing).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

/* The attributes Closing reads and writes of the objects it is made with (pinned by
   tests/collectives/test_step_twins.py: a rename in Python fails there, not silently here). */
#define CLOSING_NAMES                                                                                 \
    X(s_seq, "seq") X(s_thread, "thread") X(s_last_thread, "last_thread") X(s_kind, "kind")            \
    X(s_start, "start") X(s_deadline, "deadline") X(s_last, "last") X(s_agreed, "agreed")              \
    X(s_completed, "completed") X(s_handshakes, "handshakes") X(s_failures, "failures")                \
    X(s_outgoing, "outgoing") X(s_requested, "requested") X(s_reached, "reached") X(s_filed, "_filed") \
    X(s_fold, "_fold") X(s_writer, "writer") X(s_exited, "exited")

PyMODINIT_FUNC PyInit_native_step(void) {
#define X(name, text) if ((name = PyUnicode_InternFromString(text)) == NULL) return NULL;
    CLOSING_NAMES
#undef X
    if (PyType_Ready(&ClosingType) < 0 || PyType_Ready(&StepStateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Closing", (PyObject *)&ClosingType) < 0 ||
        PyModule_AddObjectRef(m, "StepState", (PyObject *)&StepStateType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
