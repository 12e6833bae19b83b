#include "python_ref.hpp"

#include <exception>

namespace weft::python {

namespace {

bool interpreter_finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// One per engine thread: the Python thread state PyGILState_Ensure made for it, kept by one
// extra count on the thread's gilstate counter and released when the thread exits.
struct PinnedThreadState {
  bool pinned = false;
  ~PinnedThreadState() {
    // During finalization a thread other than the main one must not take the GIL; the state is
    // then left to the interpreter's own teardown.
    if (!pinned || interpreter_finalizing()) return;
    PyEval_RestoreThread(PyGILState_GetThisThreadState());
    // The count of the first Ensure: its release clears and deletes the state and drops the GIL.
    PyGILState_Release(PyGILState_UNLOCKED);
  }
};

}  // namespace

void ensure_python_thread_state() {
  thread_local PinnedThreadState state;
  if (state.pinned || PyGILState_GetThisThreadState() != nullptr) return;
  (void)PyGILState_Ensure();  // makes the thread state and takes the GIL
  state.pinned = true;
  (void)PyEval_SaveThread();
}

PythonException PythonException::fetch(const std::string& where) {
  nb::python_error error;  // takes Python's current error, traceback attached to the value
  PyRef value(error.value());
  std::string message = where + ": ";
  const nb::handle type = value.handle().type();
  message += nb::borrow<nb::str>(type.attr("__name__")).c_str();
  PyObject* text = PyObject_Str(value.ptr());
  if (text != nullptr) {
    const char* utf8 = PyUnicode_AsUTF8(text);
    if (utf8 != nullptr && *utf8 != '\0') message += std::string(": ") + utf8;
    Py_DECREF(text);
  }
  PyErr_Clear();
  return PythonException(message, std::move(value));
}

void PythonException::restore() const {
  if (!value_) {
    PyErr_SetString(PyExc_RuntimeError, what());
    return;
  }
  const PyRef taken = std::move(value_);
  PyObject* value = taken.ptr();
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(Py_NewRef(value));
#else
  PyErr_Restore(Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(value))), Py_NewRef(value),
                PyException_GetTraceback(value));
#endif
}

void register_python_exception_translator() {
  nb::register_exception_translator([](const std::exception_ptr& error, void*) {
    try {
      std::rethrow_exception(error);
    } catch (const PythonException& e) {
      e.restore();
    }
  });
}

}  // namespace weft::python
