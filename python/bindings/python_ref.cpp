#include "python_ref.hpp"

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>

namespace weft::python {

namespace {

// The exit protocol (python_ref.hpp): a thread that takes the GIL through weft counts itself
// in num_holding, then reads exiting; the hook sets exiting, then reads num_holding. Both
// seq_cst: one of the two sees the other, so no thread enters after the hook's wait ends.
std::atomic<bool> exiting{false};
std::atomic<int> num_holding{0};
std::atomic<std::thread::id> exit_thread{};

[[noreturn]] void sleep_forever() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// Counts the calling thread in; sleeps forever when the interpreter exits, unless the calling
// thread is the one that runs the exit.
void enter_gil_section() noexcept {
  num_holding.fetch_add(1, std::memory_order_seq_cst);
  if (exiting.load(std::memory_order_seq_cst) &&
      exit_thread.load(std::memory_order_relaxed) != std::this_thread::get_id()) {
    num_holding.fetch_sub(1, std::memory_order_seq_cst);
    sleep_forever();
  }
}

void leave_gil_section() noexcept { num_holding.fetch_sub(1, std::memory_order_seq_cst); }

// Python's atexit callback: runs on the exiting thread with the GIL, after the non-daemon
// threads were joined and before the interpreter starts finalizing.
void before_exit() {
  exit_thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  exiting.store(true, std::memory_order_seq_cst);
  if (num_holding.load(std::memory_order_seq_cst) == 0) return;
  const GilRelease release;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(kExitGraceSeconds);
  while (num_holding.load(std::memory_order_seq_cst) != 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

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
    // Once the interpreter exits a thread other than the exiting one must not take the GIL; the
    // state is then left to the interpreter's own teardown.
    if (!pinned || interpreter_finalizing() || exiting.load(std::memory_order_seq_cst)) return;
    PyEval_RestoreThread(PyGILState_GetThisThreadState());
    // The count of the first Ensure: its release clears and deletes the state and drops the GIL.
    PyGILState_Release(PyGILState_UNLOCKED);
  }
};

}  // namespace

GilAcquire::GilAcquire() noexcept : counted_(PyGILState_Check() == 0) {
  if (counted_) enter_gil_section();
  state_ = PyGILState_Ensure();
}

GilAcquire::~GilAcquire() noexcept {
  PyGILState_Release(state_);
  if (counted_) leave_gil_section();
}

GilRelease::~GilRelease() noexcept {
  enter_gil_section();
  PyEval_RestoreThread(state_);
  leave_gil_section();
}

void register_exit_hook(nb::module_& m) {
  m.def("_before_exit", &before_exit);
  nb::module_::import_("atexit").attr("register")(m.attr("_before_exit"));
}

void ensure_python_thread_state() {
  thread_local PinnedThreadState state;
  if (state.pinned || PyGILState_GetThisThreadState() != nullptr) return;
  enter_gil_section();
  (void)PyGILState_Ensure();  // makes the thread state and takes the GIL
  state.pinned = true;
  (void)PyEval_SaveThread();
  leave_gil_section();
}

PythonException PythonException::fetch(const std::string& where) {
  nb::python_error error;  // takes Python's current error, traceback attached to the value
  PyRef value(error.value());
  std::string message = where + ": ";
  // The type's C-level name: a lookup of __name__ runs Python code, which may raise.
  message += Py_TYPE(value.ptr())->tp_name;
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
