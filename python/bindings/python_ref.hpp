// What the engine's threads need to hold Python objects and run Python code safely.
//
//  - PyRef: an owning reference that may be copied, moved and destroyed on any thread; it takes
//    the GIL for every reference-count change. Slot values and task bodies live in PyRefs, so the
//    engine may destroy them wherever its contract says (the caller's thread, after a fence)
//    whether or not that thread holds the GIL at that moment.
//  - ensure_python_thread_state(): gives an engine thread (a C++ thread Python does not know) one
//    Python thread state for its whole life, made at its first body: bodies then cost no
//    thread-state creation, and a body's threading.local values persist between its runs on that
//    thread. The state is deleted when the thread exits, which needs the GIL: whoever joins engine
//    threads must not hold it (the Python Engine releases it while the C++ engine is destroyed).
//  - PythonException: a Python exception caught in C++ (a body, the data iterator, Ctrl-C),
//    carried through the engine as a C++ exception and raised again, the same object with its
//    traceback, when it reaches Python (an exception translator does that).
//  - GilAcquire / GilRelease: the only ways weft's threads take and give back the GIL. Once the
//    interpreter exits (the exit hook, an atexit callback, has run), a thread other than the
//    exiting one that would take the GIL sleeps forever instead, as Python 3.14 makes such
//    threads do: before 3.14 Python ends them with pthread_exit(), whose unwinding through the
//    engine's noexcept C++ frames aborts the process. The hook first lets the threads that hold
//    the GIL through weft (a body that runs) finish, for at most kExitGraceSeconds.
#pragma once

#include <nanobind/nanobind.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace weft::python {

namespace nb = nanobind;

inline constexpr double kExitGraceSeconds = 2.0;

// Takes the GIL for its lifetime (a no-op count where the thread already holds it).
class GilAcquire {
 public:
  GilAcquire() noexcept;
  GilAcquire(const GilAcquire&) = delete;
  GilAcquire& operator=(const GilAcquire&) = delete;
  ~GilAcquire() noexcept;

 private:
  PyGILState_STATE state_;
  bool counted_;
};

// Gives the GIL back for its lifetime; the thread holds it and has a Python thread state.
class GilRelease {
 public:
  GilRelease() noexcept : state_(PyEval_SaveThread()) {}
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
  ~GilRelease() noexcept;

 private:
  PyThreadState* state_;
};

// Registers the exit hook with Python's atexit (once per process).
void register_exit_hook(nb::module_& m);

class PyRef {
 public:
  PyRef() = default;
  // Takes a new reference; the caller holds the GIL.
  explicit PyRef(nb::handle object) noexcept : ptr_(object.inc_ref().ptr()) {}
  PyRef(const PyRef& other) : ptr_(other.ptr_) {
    if (ptr_ != nullptr) {
      const GilAcquire gil;
      Py_INCREF(ptr_);
    }
  }
  PyRef(PyRef&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}
  PyRef& operator=(PyRef other) noexcept {
    std::swap(ptr_, other.ptr_);
    return *this;
  }
  ~PyRef() {
    if (ptr_ != nullptr) {
      const GilAcquire gil;
      Py_DECREF(ptr_);
    }
  }

  nb::handle handle() const noexcept { return ptr_; }
  PyObject* ptr() const noexcept { return ptr_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  PyObject* ptr_ = nullptr;
};

// Call without the GIL, on the thread about to run Python code; a no-op on threads Python knows.
void ensure_python_thread_state();

class PythonException : public std::runtime_error {
 public:
  // Takes the error Python has set (the GIL is held); `where` starts the C++ message, e.g.
  // "task 'forward'".
  static PythonException fetch(const std::string& where);

  // Sets the exception again as Python's current error (the GIL is held) and hands the
  // reference to Python: the engine keeps its error (for later what()s) past that point, and the
  // exception's traceback may reach the engine's own Python object, a cycle the garbage
  // collector cannot see through C++. A second restore raises a RuntimeError with what().
  void restore() const;

 private:
  PythonException(const std::string& message, PyRef value)
      : std::runtime_error(message), value_(std::move(value)) {}
  mutable PyRef value_;
};

// Registers the translator that raises a PythonException reaching Python as its own exception.
void register_python_exception_translator();

}  // namespace weft::python
