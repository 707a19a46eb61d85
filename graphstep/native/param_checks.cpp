// The per-param reads of graphstep's pre-step checks, as C++ loops over a Python list of tensors
// (graphstep/native/param_checks.py wraps them and runs the same checks in Python where this is not built).
//
// Each function reads attributes of every tensor of a list and returns the index of the first tensor whose
// value differs from the one expected, or -1. The reads are those of the Python attributes (``data_ptr()``,
// ``.grad``, ``.requires_grad``, ``._version``) on the tensor itself, without a tensor subclass's
// ``__torch_function__``, in one visit per tensor: what a step must look at, without a Python object made and
// dropped for each read. ``first_unbound`` may also read each tensor as an attribute of the list's objects
// (FSDP2 keeps its tensors there), so that no list of them is made first.

#include <Python.h>

#include <cstdint>
#include <exception>

#include <torch/csrc/autograd/python_variable.h>

namespace {

// ``expected`` as a buffer of ``n`` int64s (``array('q')``), or false with a Python error set.
bool int64_buffer(PyObject* expected, Py_ssize_t n, Py_buffer* view) {
  if (PyObject_GetBuffer(expected, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
    return false;
  }
  const bool int64 = view->itemsize == 8 && view->format != nullptr &&
                     (view->format[0] == 'q' || view->format[0] == 'l') && view->format[1] == '\0';
  if (!int64 || view->len != n * 8) {
    PyBuffer_Release(view);
    PyErr_SetString(PyExc_ValueError, "expected values must be an array('q') as long as tensors");
    return false;
  }
  return true;
}

// The tensor ``item``, or nullptr with a Python error set naming ``what[i]``.
const at::Tensor* as_tensor(PyObject* item, Py_ssize_t i, const char* what) {
  if (!THPVariable_Check(item)) {
    PyErr_Format(PyExc_TypeError, "%s[%zd] is not a tensor", what, i);
    return nullptr;
  }
  return &THPVariable_Unpack(item);
}

const at::Tensor* tensor_at(PyObject* list, Py_ssize_t i, const char* what) {
  return as_tensor(PyList_GET_ITEM(list, i), i, what);
}

// A new reference, released when it goes out of scope.
struct Held {
  PyObject* object = nullptr;
  ~Held() { Py_XDECREF(object); }
};

// Index of the first tensor whose data pointer, grad or requires_grad is not the one expected, -1 if none, -2
// with a Python error set. Each check is skipped where its expectation is absent: ``data_ptrs`` null,
// ``grads`` null or ``grads[i]`` None, ``requires_grad`` -1. With ``attribute`` the tensors are that attribute
// of each object of the list (a Python attribute read, which may run Python code: the list is re-measured).
// One pass: each tensor is visited once.
Py_ssize_t first_unbound_in(PyObject* tensors, const int64_t* data_ptrs, PyObject* grads, int requires_grad,
                            PyObject* attribute) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyList_GET_SIZE(tensors) != n || (grads != nullptr && PyList_GET_SIZE(grads) != n)) {
      PyErr_SetString(PyExc_RuntimeError, "a list changed while it was read");
      return -2;
    }
    Held held;
    PyObject* item = PyList_GET_ITEM(tensors, i);
    if (attribute != nullptr) {
      held.object = PyObject_GetAttr(item, attribute);
      if (held.object == nullptr) {
        return -2;
      }
      item = held.object;
    }
    const at::Tensor* t = as_tensor(item, i, attribute == nullptr ? "tensors" : "the attribute of tensors");
    if (t == nullptr) {
      return -2;
    }
    if (data_ptrs != nullptr && reinterpret_cast<int64_t>(t->const_data_ptr()) != data_ptrs[i]) {
      return i;
    }
    if (requires_grad >= 0 && t->requires_grad() != static_cast<bool>(requires_grad)) {
      return i;
    }
    if (grads != nullptr && PyList_GET_ITEM(grads, i) != Py_None) {
      // A tensor's Python object and its TensorImpl are one to one: the grad is the very object ``grads[i]``
      // exactly when it is the same TensorImpl (an undefined grad, None in Python, is never one).
      const at::Tensor* grad = tensor_at(grads, i, "grads");
      if (grad == nullptr) {
        return -2;
      }
      if (t->grad().unsafeGetTensorImpl() != grad->unsafeGetTensorImpl()) {
        return i;
      }
    }
  }
  return -1;
}

PyObject* first_unbound(PyObject*, PyObject* args) {
  PyObject *tensors, *data_ptrs, *grads, *requires_grad, *attribute;
  if (!PyArg_ParseTuple(args, "O!OOOO", &PyList_Type, &tensors, &data_ptrs, &grads, &requires_grad, &attribute)) {
    return nullptr;
  }
  if (attribute != Py_None && !PyUnicode_Check(attribute)) {
    PyErr_SetString(PyExc_TypeError, "attribute must be a str or None");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  if (grads != Py_None && (!PyList_Check(grads) || PyList_GET_SIZE(grads) != n)) {
    PyErr_SetString(PyExc_ValueError, "grads must be a list as long as tensors");
    return nullptr;
  }
  const int flag = requires_grad == Py_None ? -1 : PyObject_IsTrue(requires_grad);
  if (flag == -1 && requires_grad != Py_None) {
    return nullptr;
  }
  Py_buffer ptrs{};
  if (data_ptrs != Py_None && !int64_buffer(data_ptrs, n, &ptrs)) {
    return nullptr;
  }
  Py_ssize_t first = -2;
  try {
    first = first_unbound_in(tensors, data_ptrs == Py_None ? nullptr : static_cast<const int64_t*>(ptrs.buf),
                             grads == Py_None ? nullptr : grads, flag, attribute == Py_None ? nullptr : attribute);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  if (data_ptrs != Py_None) {
    PyBuffer_Release(&ptrs);
  }
  return first == -2 ? nullptr : PyLong_FromSsize_t(first);
}

PyObject* first_other_version(PyObject*, PyObject* args) {
  PyObject *tensors, *expected;
  if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &tensors, &expected)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  Py_buffer versions{};
  if (!int64_buffer(expected, n, &versions)) {
    return nullptr;
  }
  Py_ssize_t first = -1;
  try {
    const auto* want = static_cast<const int64_t*>(versions.buf);
    for (Py_ssize_t i = 0; i < n && first == -1; ++i) {
      const at::Tensor* t = tensor_at(tensors, i, "tensors");
      if (t == nullptr) {
        first = -2;
      } else if (static_cast<int64_t>(t->unsafeGetTensorImpl()->version_counter().current_version()) != want[i]) {
        first = i;
      }
    }
  } catch (const std::exception& e) {  // an inference tensor has no version counter: the attribute raises too
    PyErr_SetString(PyExc_RuntimeError, e.what());
    first = -2;
  }
  PyBuffer_Release(&versions);
  return first == -2 ? nullptr : PyLong_FromSsize_t(first);
}

PyMethodDef methods[] = {
    {"first_unbound", first_unbound, METH_VARARGS,
     "first_unbound(tensors, data_ptrs, grads, requires_grad, attribute): the first i whose data_ptr() is not "
     "data_ptrs[i], whose .grad is not grads[i], or whose requires_grad is not requires_grad (None: not checked), "
     "or -1; with attribute (a str), of getattr(tensors[i], attribute) instead"},
    {"first_other_version", first_other_version, METH_VARARGS,
     "first_other_version(tensors, versions): the first i with tensors[i]._version != versions[i], or -1"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "graphstep_param_checks", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_graphstep_param_checks(void) {
  return PyModule_Create(&module);
}
