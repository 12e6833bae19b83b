// weft._weft.pipeline: weft::pipeline's engine with Python task bodies (the layer over it is
// weft/pipeline/).
//
// The GIL: progress() releases it for the whole step; an engine thread takes it only to run a
// body (and the caller's thread only to pull from the data iterator, to destroy slot values and,
// every kInterruptCheckInterval of waiting, to check for Ctrl-C). Slot values are PyRefs, so
// the engine may copy and destroy them on any thread. A Python exception raised in a
// body travels through the engine as a PythonException and is raised again by progress(), the
// same object with its traceback.
//
// One call at a time: an Engine's methods refuse, with weft.Error, a call made while another of
// its calls runs (from a second thread, from a body, or from a slot value's __del__ run by the
// engine), after close(), and in a process forked after the engine was built. The engine takes
// part in garbage collection: it reports the data iterator and the slot values it holds, and
// collecting it closes it.
#include "weft/pipeline/pipeline.hpp"

#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <pthread.h>

#include <any>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "python_ref.hpp"
#include "weft/core/error.hpp"

#ifdef WEFT_PYTHON_WITH_CUDA
#include "weft/pipeline/cuda_backend.hpp"
#endif

namespace weft::python {

namespace {

namespace pl = weft::pipeline;

// What a Python body receives: the engine's TaskContext while the body runs, nothing after (a
// context kept past its body raises instead of touching freed memory). One per task, reused:
// a task runs on one thread at a time.
struct BodyContext {
  pl::TaskContext* context = nullptr;

  pl::TaskContext& get() const {
    WEFT_CHECK(context != nullptr, "pipeline: a TaskContext used outside its task's body");
    return *context;
  }
};

// The body running on this thread, if any: its engine's schedule (one per engine) and its task.
// A body that drives another engine nests, so each body saves and restores the outer one.
struct RunningBody {
  const pl::CompiledSchedule* schedule = nullptr;
  std::string_view task;
};
thread_local RunningBody running_body;

// Runs `fn(ctx)` on an engine thread (or the caller's, for the sequential executor). `fn` is
// borrowed: the Python Engine keeps every body alive for as long as the C++ engine lives, in an
// attribute the garbage collector sees, so that a cycle through a body (a module-level engine
// whose bodies are the module's functions) is collectable.
pl::TaskBody python_body(nb::handle borrowed_fn, nb::handle ctx) {
  return [fn = borrowed_fn, ctx = PyRef(ctx)](pl::TaskContext& context) {
    ensure_python_thread_state();
    const GilAcquire gil;
    BodyContext* box = nb::inst_ptr<BodyContext>(ctx.handle());
    box->context = &context;
    const RunningBody outer = std::exchange(running_body, {&context.schedule(), context.name()});
    PyObject* result = PyObject_CallOneArg(fn.ptr(), ctx.ptr());
    running_body = outer;
    box->context = nullptr;
    if (result == nullptr) {
      // A StopIteration leaving progress() would end the caller's loop as if the data had ended
      // (PEP 479 makes generators turn it into a RuntimeError for the same reason).
      if (PyErr_ExceptionMatches(PyExc_StopIteration)) {
        const nb::python_error stop;
        const std::string message =
            "task '" + std::string(context.name()) + "' raised StopIteration";
        const nb::object error =
            nb::steal(PyObject_CallFunction(PyExc_RuntimeError, "s", message.c_str()));
        PyException_SetCause(error.ptr(), stop.value().inc_ref().ptr());
        PyErr_SetObject(PyExc_RuntimeError, error.ptr());
      }
      throw PythonException::fetch("task '" + std::string(context.name()) + "'");
    }
    Py_DECREF(result);
  };
}

// Python values as the fields of a pl::Task, converted without coercion (no float, str or bool
// is an int; a name is a str that encodes as UTF-8): TypeError for the wrong type, weft.Error for
// a value C++ cannot hold; both name the task and the field. Whether a value is right for its
// field is the pl::Task setter's and CompiledSchedule's to say. `task` is empty for the task's
// own name.
std::string where(const std::string& task, std::string_view field) {
  return (task.empty() ? std::string("task ") : "task '" + task + "': ") + std::string(field);
}

std::string name_of(nb::handle value, const std::string& task, std::string_view field) {
  if (!PyUnicode_Check(value.ptr())) {
    throw nb::type_error((where(task, field) + " must be a str, got " +
                          Py_TYPE(value.ptr())->tp_name + ": " + nb::repr(value).c_str())
                             .c_str());
  }
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (text == nullptr) {
    PyErr_Clear();
    WEFT_FAIL(where(task, field), " ", nb::repr(value).c_str(), " is not valid UTF-8");
  }
  return {text, static_cast<std::size_t>(size)};
}

std::vector<std::string> names_of(const std::vector<nb::handle>& values, const std::string& task,
                                  std::string_view field) {
  std::vector<std::string> out;
  const std::string entries = std::string(field) + " entries";
  for (nb::handle v : values) out.push_back(name_of(v, task, entries));
  return out;
}

int int_of(nb::handle value, const std::string& task, std::string_view field) {
  if (!PyLong_Check(value.ptr()) || PyBool_Check(value.ptr())) {
    throw nb::type_error((where(task, field) + " must be an int, got " +
                          Py_TYPE(value.ptr())->tp_name + ": " + nb::repr(value).c_str())
                             .c_str());
  }
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  WEFT_CHECK(
      overflow == 0 && n >= std::numeric_limits<int>::min() && n <= std::numeric_limits<int>::max(),
      where(task, field), " ", nb::str(value).c_str(), " is outside the range of an int");
  return static_cast<int>(n);
}

// The bound pl::Task: what weft.pipeline.Task holds. Its list fields only grow, as in C++ (the
// Python layer builds a new Task to replace one); a body or init is attached when the Python
// layer copies the task into a schedule (add), because the Python callables live there.
void bind_task(nb::module_& m) {
  // weft.pipeline.SyncSide (an IntFlag) maps onto these one to one (task.py).
  nb::enum_<pl::SyncSide>(m, "SyncSide", "weft::pipeline::SyncSide")
      .value("CPU", pl::SyncSide::kCpu)
      .value("GPU", pl::SyncSide::kGpu)
      .value("BOTH", pl::SyncSide::kBoth);
  nb::class_<pl::Task>(m, "Task", "weft::pipeline::Task (held by weft.pipeline.Task)")
      .def(
          "__init__",
          [](pl::Task* self, nb::handle name) { new (self) pl::Task(name_of(name, "", "name")); },
          nb::arg("name"))
      .def_prop_ro("name", [](const pl::Task& t) { return t.name(); })
      .def_prop_rw(
          "stream", [](const pl::Task& t) { return t.stream(); },
          [](pl::Task& t, nb::handle v) { t.stream(name_of(v, t.name(), "stream")); })
      .def_prop_rw(
          "movable_to", [](const pl::Task& t) { return t.movable_to(); },
          [](pl::Task& t, const std::vector<nb::handle>& v) {
            t.movable_to(names_of(v, t.name(), "movable_to"));
          })
      .def_prop_rw(
          "lookahead", [](const pl::Task& t) { return t.lookahead(); },
          [](pl::Task& t, nb::handle v) { t.lookahead(int_of(v, t.name(), "lookahead")); })
      .def_prop_ro("reads", [](const pl::Task& t) { return t.reads(); })
      .def_prop_ro("writes", [](const pl::Task& t) { return t.writes(); })
      .def_prop_ro("depends_on", [](const pl::Task& t) { return t.depends_on(); })
      .def_prop_ro("cross_iter_depends_on",
                   [](const pl::Task& t) {
                     std::vector<std::pair<std::string, int>> out;
                     for (const pl::CrossIterEdge& e : t.cross_iter_depends_on())
                       out.emplace_back(e.producer, e.offset);
                     return out;
                   })
      .def_prop_ro("same_progress_sync",
                   [](const pl::Task& t) {
                     std::vector<std::pair<std::string, pl::SyncSide>> out;
                     for (const pl::SyncEdge& e : t.same_progress_sync())
                       out.emplace_back(e.producer, e.side);
                     return out;
                   })
      .def_prop_ro("collective", &pl::Task::is_collective)
      .def_prop_ro("inventory",
                   [](const pl::Task& t) {
                     std::vector<std::tuple<std::string, std::string, std::size_t, int>> out;
                     for (const pl::CollectiveOp& op : t.collectives())
                       out.emplace_back(op.kind, op.stream, op.num_bytes, op.count);
                     return out;
                   })
      .def("add_reads",
           [](pl::Task& t, const std::vector<nb::handle>& v) {
             for (const std::string& s : names_of(v, t.name(), "reads")) t.reads(s);
           })
      .def("add_writes",
           [](pl::Task& t, const std::vector<nb::handle>& v) {
             for (const std::string& s : names_of(v, t.name(), "writes")) t.writes(s);
           })
      .def("add_depends_on",
           [](pl::Task& t, const std::vector<nb::handle>& v) {
             for (const std::string& s : names_of(v, t.name(), "depends_on")) t.depends_on(s);
           })
      .def(
          "add_cross_iter_depends_on",
          [](pl::Task& t, nb::handle producer, nb::handle offset) {
            const std::string p = name_of(producer, t.name(), "cross_iter_depends_on");
            const int o = int_of(offset, t.name(), "cross_iter_depends_on offset");
            t.cross_iter_depends_on(p, o);
          },
          nb::arg("producer"), nb::arg("offset"))
      .def(
          "add_same_progress_sync",
          [](pl::Task& t, nb::handle producer, pl::SyncSide side) {
            t.same_progress_sync(name_of(producer, t.name(), "same_progress_sync"), side);
          },
          nb::arg("producer"), nb::arg("side"))
      .def(
          "set_collective",
          [](pl::Task& t,
             const std::vector<std::tuple<nb::handle, nb::handle, std::size_t, int>>& inventory) {
            std::vector<pl::CollectiveOp> ops;
            for (const auto& [kind, stream, num_bytes, count] : inventory) {
              ops.push_back({name_of(kind, t.name(), "collective kind"),
                             name_of(stream, t.name(), "collective stream"), num_bytes, count});
            }
            t.collective(std::move(ops));
          },
          nb::arg("inventory"), "Marks the task collective, with this inventory.");
}

// Adds a copy of `task` with Python callables as its body and init (either may be None).
void add_task(pl::Schedule& schedule, const pl::Task& task, nb::handle body, nb::handle init) {
  pl::Task copy = task;
  if (!body.is_none() || !init.is_none()) {
    const nb::object ctx = nb::cast(BodyContext{});
    if (!body.is_none()) copy.body(python_body(body, ctx));
    if (!init.is_none()) copy.init(python_body(init, ctx));
  }
  schedule.add(std::move(copy));
}

std::vector<pl::ThreadGroup> to_groups(
    const std::vector<std::pair<std::string, std::vector<std::string>>>& groups) {
  std::vector<pl::ThreadGroup> out;
  for (const auto& [name, tasks] : groups) out.push_back({name, tasks});
  return out;
}

nb::object thread_map_groups(const pl::ThreadMap& map) {
  nb::list groups;
  for (const pl::ThreadGroup& g : map.thread_groups())
    groups.append(nb::make_tuple(g.name, g.tasks));
  return groups;
}

// Each thread's name and its tasks' names, in run order.
std::vector<std::pair<std::string, std::vector<std::string>>> thread_lists(
    const pl::ThreadAssignment& threads, const pl::CompiledSchedule& schedule) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (std::size_t i = 0; i < threads.num_threads(); ++i) {
    std::vector<std::string> tasks;
    for (pl::TaskId id : threads.tasks_of_thread[i]) tasks.push_back(schedule.task(id).name());
    out.emplace_back(threads.thread_names[i], std::move(tasks));
  }
  return out;
}

// Which backend an Engine runs on: "host", or "cuda" on `device` with the caller's streams
// (handles as integers) for the schedule streams they name.
struct BackendSpec {
  std::string kind;
  int device = 0;
  std::vector<std::pair<std::string, std::uintptr_t>> adopted_streams;
};

std::unique_ptr<pl::Backend> make_backend(const BackendSpec& spec) {
  if (spec.kind == "host") {
    WEFT_CHECK(spec.adopted_streams.empty(), "pipeline: the host backend adopts no streams");
    return std::make_unique<pl::HostBackend>();
  }
#ifdef WEFT_PYTHON_WITH_CUDA
  if (spec.kind == "cuda") {
    pl::AdoptedStreams adopted;
    for (const auto& [name, handle] : spec.adopted_streams) {
      adopted[name] = reinterpret_cast<cudaStream_t>(handle);
    }
    return std::make_unique<pl::CudaBackend>(spec.device, std::move(adopted));
  }
#else
  WEFT_CHECK(spec.kind != "cuda", "pipeline: the cuda backend needs a CUDA build of weft");
#endif
  WEFT_FAIL("pipeline: unknown backend '", spec.kind, "' (host or cuda)");
}

// Counts the fork()s this process descends from: an engine built under another count was built
// in an ancestor, whose threads the child does not have.
std::atomic<std::uint64_t> fork_generation{0};

void count_forks() {
  static std::once_flag once;
  std::call_once(once, [] {
    pthread_atfork(nullptr, nullptr,
                   [] { fork_generation.fetch_add(1, std::memory_order_relaxed); });
  });
}

// The engine, its Python data source and the slot a step returns. Every member is used with the
// GIL held, which orders the calls' checks among threads.
class PyEngine {
 public:
  PyEngine(const pl::Schedule& schedule, const pl::ThreadMap& threads, const BackendSpec& backend,
           pl::EngineOptions options, std::string result_slot, bool result_required)
      : result_slot_(std::move(result_slot)),
        fork_generation_(fork_generation.load(std::memory_order_relaxed)) {
    options.interrupt_check = [] {
      const GilAcquire gil;
      if (PyErr_CheckSignals() != 0) throw PythonException::fetch("progress() was interrupted");
    };
    {
      const GilRelease release;  // the inits run on the engine's threads, which join without it
      auto engine = std::make_unique<pl::Engine>(schedule, threads, make_backend(backend),
                                                 std::move(options));
      has_result_ = engine->schedule().find_slot(result_slot_).has_value();
      if (has_result_ || !result_required) engine_ = std::move(engine);
    }
    WEFT_CHECK(engine_ != nullptr, "engine: result slot '", result_slot_,
               "' is no slot of the schedule (a task writes it, or it is an input)");
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;
  ~PyEngine() { destroy_engine(); }

  // TorchRec's progress(dataloader_iter): a new iterator object starts a new source.
  nb::object progress(nb::handle iterator) {
    const Busy busy = enter("progress");
    if (!iterator.is(source_.handle())) set_source(iterator);
    std::optional<pl::Step> step;
    {
      const GilRelease release;
      step = engine_->progress();
    }
    if (!step) throw nb::stop_iteration();
    last_batch_index_ = step->batch_index();
    if (!has_result_ || !step->batch().has(result_slot_)) return nb::none();
    return nb::borrow(step->get<PyRef>(result_slot_).handle());
  }

  void reset() {
    const Busy busy = enter("reset");
    const GilRelease release;
    engine_->reset();
  }
  void synchronize() {
    const Busy busy = enter("synchronize");
    const GilRelease release;
    engine_->synchronize();
  }
  // Joins the threads and destroys the slot values now; a second close() does nothing.
  void close() {
    if (engine_ == nullptr) return;
    const Busy busy = enter("close");
    destroy_engine();
  }
  // For a call that only reads the engine: refused as a busy one would be.
  pl::Engine& engine(const char* call) {
    check_callable(call);
    return *engine_;
  }
  std::int64_t last_batch_index() {
    check_callable("last_batch_index");
    return last_batch_index_;
  }

  // The garbage collector's view (the GIL is held): the data source and, while no call runs,
  // the slot values. Values are left out while a call runs on another thread (they change
  // there): the collector then keeps them, and whatever they refer to, alive this time.
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(source_.ptr());
    Py_VISIT(iterator_.ptr());
    if (engine_ == nullptr || busy_call_ != nullptr || forked()) return 0;
    int result = 0;
    engine_->for_each_value([&](const std::any& value) {
      const auto* ref = std::any_cast<PyRef>(&value);
      if (result == 0 && ref != nullptr && *ref) result = visit(ref->ptr(), arg);
    });
    return result;
  }
  // Breaks a cycle the collector found: closes the engine (a garbage engine runs no call).
  void clear() {
    if (busy_call_ == nullptr) destroy_engine();
  }

 private:
  // Marks a call running for its lifetime.
  class Busy {
   public:
    explicit Busy(PyEngine& e, const char* call) : e_(e) {
      e_.busy_call_ = call;
      e_.busy_thread_ = std::this_thread::get_id();
    }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;
    ~Busy() { e_.busy_call_ = nullptr; }

   private:
    PyEngine& e_;
  };

  bool forked() const noexcept {
    return fork_generation_ != fork_generation.load(std::memory_order_relaxed);
  }

  void check_callable(const char* call) const {
    WEFT_CHECK(!forked(), "engine: ", call,
               "(): this engine was built before this process was forked, and a forked child "
               "has none of its threads (build a new Engine in the child)");
    WEFT_CHECK(engine_ != nullptr, "engine: the engine is closed (", call, "() after close())");
    if (running_body.schedule == &engine_->schedule()) {
      WEFT_FAIL("engine: ", call, "() called from inside task '", running_body.task,
                "' (a body must not call back into its own engine)");
    }
    if (busy_call_ == nullptr) return;
    WEFT_CHECK(busy_thread_ != std::this_thread::get_id(), "engine: ", call,
               "() called while the engine runs ", busy_call_,
               "() on this thread (from a slot value's __del__ or another callback)");
    WEFT_FAIL("engine: ", call, "() refused: ", busy_call_,
              "() is running on another thread (one thread at a time drives an Engine)");
  }

  Busy enter(const char* call) {
    check_callable(call);
    return Busy(*this, call);
  }

  // Joins the threads (each deletes its Python thread state, which takes the GIL) and destroys
  // the slot values. In a forked child the engine is left alone: its threads are not there to
  // join, and its locks may be held by threads that are gone. What it holds is then leaked on
  // purpose, which nanobind would report at exit as a reference-counting bug.
  void destroy_engine() {
    if (engine_ == nullptr) return;
    if (forked()) {
      (void)engine_.release();
      nb::set_leak_warnings(false);
      return;
    }
    {
      const GilRelease release;
      engine_.reset();
    }
    iterator_ = PyRef();
    source_ = PyRef();
  }

  void set_source(nb::handle iterable) {
    const nb::object iterator = nb::steal(PyObject_GetIter(iterable.ptr()));
    if (!iterator.is_valid()) throw nb::python_error();
    std::vector<std::string> inputs = engine_->schedule().source().inputs();
    // The source borrows the iterator, which iterator_ owns, so that the collector sees it.
    pl::Source source = [iterator = iterator.ptr(), inputs = std::move(inputs)](pl::Batch& batch) {
      const GilAcquire gil;
      const nb::object item = nb::steal(PyIter_Next(iterator));
      if (!item.is_valid()) {
        if (PyErr_Occurred() != nullptr) throw PythonException::fetch("the data iterator");
        return false;
      }
      if (inputs.size() == 1) {
        batch.set(inputs[0], PyRef(item));
        return true;
      }
      // Several inputs: each item maps input slot -> value.
      for (const std::string& slot : inputs) {
        const nb::object value =
            nb::steal(PyObject_GetItem(item.ptr(), nb::str(slot.c_str()).ptr()));
        if (!value.is_valid())
          throw PythonException::fetch("the data iterator's item, input '" + slot + "'");
        batch.set(slot, PyRef(value));
      }
      return true;
    };
    {
      const GilRelease release;
      engine_->set_source(std::move(source));
    }
    iterator_ = PyRef(iterator);
    // Kept as given, so that the next call with the same object continues this source.
    source_ = PyRef(iterable);
  }

  std::unique_ptr<pl::Engine> engine_;  // null once closed
  PyRef source_;
  PyRef iterator_;
  std::string result_slot_;
  bool has_result_ = false;
  std::int64_t last_batch_index_ = -1;
  std::uint64_t fork_generation_;
  const char* busy_call_ = nullptr;  // the call that runs now, or null
  std::thread::id busy_thread_;
};

int engine_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  return nb::inst_ptr<PyEngine>(self)->traverse(visit, arg);
}

int engine_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<PyEngine>(self)->clear();
  return 0;
}

PyType_Slot engine_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(engine_traverse)},
                              {Py_tp_clear, reinterpret_cast<void*>(engine_clear)},
                              {0, nullptr}};

// A Python int in [0, 2^64) as a byte count: TypeError for anything but an int (a bool, a
// float), weft.Error naming `field` for one out of range.
std::size_t byte_count(nb::handle value, const char* field) {
  if (!PyLong_Check(value.ptr()) || PyBool_Check(value.ptr())) {
    throw nb::type_error((std::string(field) + " must be an int, got " +
                          Py_TYPE(value.ptr())->tp_name)
                             .c_str());
  }
  const unsigned long long n = PyLong_AsUnsignedLongLong(value.ptr());
  if (n == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    WEFT_FAIL(field, " ", nb::str(value).c_str(), " is outside [0, 2^64 - 1]");
  }
  return static_cast<std::size_t>(n);
}

nb::object slot_value(const pl::TaskContext& c, const std::string& slot) {
  return nb::borrow(c.get<PyRef>(slot).handle());
}

void bind_context(nb::module_& m) {
  nb::class_<BodyContext>(m, "TaskContext",
                          "What a task body sees while it runs: its batch's slots and its task.")
      .def(
          "get",
          [](const BodyContext& b, const std::string& slot) { return slot_value(b.get(), slot); },
          nb::arg("slot"), "The slot's value; the task must declare it in reads or writes.")
      .def(
          "set",
          [](BodyContext& b, const std::string& slot, nb::handle value) {
            b.get().set(slot, PyRef(value));
          },
          nb::arg("slot"), nb::arg("value").none(), "Sets a slot the task declares in writes.")
      .def(
          "has", [](BodyContext& b, const std::string& slot) { return b.get().batch().has(slot); },
          nb::arg("slot"), "Whether the slot of this batch holds a value.")
      .def_prop_ro("name", [](const BodyContext& b) { return std::string(b.get().name()); })
      .def_prop_ro("lookahead", [](const BodyContext& b) { return b.get().lookahead(); })
      .def_prop_ro("batch_index", [](const BodyContext& b) { return b.get().batch_index(); })
      .def_prop_ro("iteration", [](const BodyContext& b) { return b.get().iteration(); })
      .def_prop_ro("ticket", [](const BodyContext& b) { return b.get().ticket(); })
      .def_prop_ro("thread_index", [](const BodyContext& b) { return b.get().thread_index(); })
      .def_prop_ro("stream",
                   [](const BodyContext& b) {
                     const pl::TaskContext& c = b.get();
                     return c.schedule().stream(c.stream_id()).name;
                   })
      .def_prop_ro("backend",
                   [](const BodyContext& b) { return std::string(b.get().backend().name()); })
      .def(
          "stream_handle",
          [](const BodyContext& b, std::optional<std::string> stream) {
            const pl::TaskContext& c = b.get();
            return reinterpret_cast<std::uintptr_t>(stream ? c.stream_handle(*stream)
                                                           : c.stream_handle());
          },
          nb::arg("stream") = nb::none(),
          "The backend's native stream (a cudaStream_t as an integer on the cuda backend).")
      .def(
          "record_collective",
          [](BodyContext& b, const std::string& kind, const std::string& stream,
             nb::handle num_bytes) {
            b.get().record_collective(kind, stream, byte_count(num_bytes, "num_bytes"));
          },
          nb::arg("kind"), nb::arg("stream"), nb::arg("num_bytes"),
          "Records one collective the body enqueued (for Engine.collective_inventory()).");
}

void bind_schedule(nb::module_& m) {
  nb::class_<pl::Schedule>(m, "Schedule",
                           "weft::pipeline::Schedule (built by weft.pipeline.Schedule)")
      .def(nb::init<>())
      .def("add_stream", [](pl::Schedule& s, const std::string& name,
                            int priority) { s.add_stream(name, priority); })
      .def("add_input", [](pl::Schedule& s, const std::string& slot) { s.add_input(slot); })
      .def("add", &add_task, nb::arg("task"), nb::arg("body").none(), nb::arg("init").none())
      .def_prop_ro("tasks", [](const pl::Schedule& s) { return s.tasks(); })
      .def_prop_ro("streams",
                   [](const pl::Schedule& s) {
                     std::vector<std::pair<std::string, int>> out;
                     for (const pl::StreamSpec& spec : s.streams())
                       out.emplace_back(spec.name, spec.priority);
                     return out;
                   })
      .def_prop_ro("inputs", [](const pl::Schedule& s) { return s.inputs(); })
      .def(
          "validate", [](const pl::Schedule& s) { pl::CompiledSchedule compiled(s); },
          "Raises weft.Error naming the task and the rule broken.")
      .def("run_order",
           [](const pl::Schedule& s) {
             pl::CompiledSchedule compiled(s);
             std::vector<std::string> names;
             for (pl::TaskId t : compiled.run_order()) names.push_back(compiled.task(t).name());
             return names;
           })
      .def("wait_edges", [](const pl::Schedule& s, const pl::ThreadMap& map) {
        pl::CompiledSchedule compiled(s);
        const pl::ThreadAssignment threads = map.assign(compiled);
        std::vector<std::string> lines;
        for (const pl::WaitEdge& e : pl::cross_thread_waits(compiled, threads)) {
          lines.push_back(pl::describe(e, compiled, threads));
        }
        return lines;
      });
}

void bind_thread_map(nb::module_& m) {
  nb::class_<pl::ThreadMap>(m, "ThreadMap", "weft::pipeline::ThreadMap")
      .def_static("legacy", &pl::ThreadMap::legacy)
      .def_static("by_stream", &pl::ThreadMap::by_stream)
      .def_static("per_task", &pl::ThreadMap::per_task)
      .def_static("preset", [](const std::string& name) { return pl::ThreadMap::preset(name); })
      .def_static(
          "groups",
          [](const std::vector<std::pair<std::string, std::vector<std::string>>>& groups,
             const std::string& rest) { return pl::ThreadMap::groups(to_groups(groups), rest); },
          nb::arg("groups"), nb::arg("rest") = "")
      .def_static("preset_names",
                  [] {
                    std::vector<std::string> names;
                    for (std::string_view n : pl::ThreadMap::preset_names()) names.emplace_back(n);
                    return names;
                  })
      .def_prop_ro("name", [](const pl::ThreadMap& t) { return t.name(); })
      .def_prop_ro("is_preset", &pl::ThreadMap::is_preset)
      .def_prop_ro("thread_groups", &thread_map_groups)
      .def_prop_ro("rest", [](const pl::ThreadMap& t) { return t.rest(); })
      .def("assign",
           [](const pl::ThreadMap& t, const pl::Schedule& s) {
             pl::CompiledSchedule compiled(s);
             return thread_lists(t.assign(compiled), compiled);
           })
      .def("__eq__", [](const pl::ThreadMap& a, const pl::ThreadMap& b) { return a == b; });

  nb::class_<pl::ScheduleConfig>(m, "ScheduleConfig", "weft::pipeline::ScheduleConfig")
      .def_static("parse", [](const std::string& text) { return pl::ScheduleConfig::parse(text); })
      .def_static("load", &pl::ScheduleConfig::load)
      .def("to_json", &pl::ScheduleConfig::to_json)
      .def(
          "apply",
          [](const pl::ScheduleConfig& c, const std::vector<pl::Task*>& tasks) {
            c.apply([&](std::string_view name) -> pl::Task* {
              for (pl::Task* t : tasks) {
                if (t->name() == name) return t;
              }
              return nullptr;
            });
          },
          nb::arg("tasks"),
          "ScheduleConfig::apply over these tasks (a Python schedule's), in place.")
      .def_prop_ro("thread_map", [](const pl::ScheduleConfig& c) { return c.thread_map; })
      .def_prop_ro("stream",
                   [](const pl::ScheduleConfig& c) {
                     return std::vector<std::pair<std::string, std::string>>(c.stream.begin(),
                                                                             c.stream.end());
                   })
      .def_prop_ro("lookahead",
                   [](const pl::ScheduleConfig& c) {
                     return std::vector<std::pair<std::string, int>>(c.lookahead.begin(),
                                                                     c.lookahead.end());
                   })
      .def_prop_ro("same_progress_sync",
                   [](const pl::ScheduleConfig& c) {
                     std::vector<std::tuple<std::string, std::string, pl::SyncSide>> out;
                     for (const pl::SyncEdgeConfig& e : c.same_progress_sync) {
                       out.emplace_back(e.producer, e.consumer, e.side);
                     }
                     return out;
                   })
      .def("__eq__",
           [](const pl::ScheduleConfig& a, const pl::ScheduleConfig& b) { return a == b; });
}

void bind_trace(nb::module_& m) {
  nb::class_<pl::HostSpan>(m, "HostSpan")
      .def_ro("task", &pl::HostSpan::task)
      .def_ro("thread", &pl::HostSpan::thread)
      .def_ro("batch", &pl::HostSpan::batch)
      .def_ro("lookahead", &pl::HostSpan::lookahead)
      .def_ro("iteration", &pl::HostSpan::iteration)
      .def_ro("ticket", &pl::HostSpan::ticket)
      .def_ro("begin_us", &pl::HostSpan::begin_us)
      .def_ro("end_us", &pl::HostSpan::end_us)
      .def_ro("failed", &pl::HostSpan::failed);
  nb::class_<pl::WaitRecord>(m, "WaitRecord")
      .def_ro("producer", &pl::WaitRecord::producer)
      .def_ro("consumer", &pl::WaitRecord::consumer)
      .def_prop_ro("rule",
                   [](const pl::WaitRecord& w) { return std::string(pl::to_string(w.rule)); })
      .def_ro("iteration", &pl::WaitRecord::iteration)
      .def_ro("begin_us", &pl::WaitRecord::begin_us)
      .def_ro("end_us", &pl::WaitRecord::end_us);
  nb::class_<pl::GpuSpan>(m, "GpuSpan")
      .def_ro("task", &pl::GpuSpan::task)
      .def_ro("stream", &pl::GpuSpan::stream)
      .def_ro("batch", &pl::GpuSpan::batch)
      .def_ro("begin_us", &pl::GpuSpan::begin_us)
      .def_ro("end_us", &pl::GpuSpan::end_us)
      .def_ro("failed", &pl::GpuSpan::failed);
  nb::class_<pl::Trace>(m, "Trace", "What an engine recorded while tracing (times in us).")
      .def_ro("task_names", &pl::Trace::task_names)
      .def_ro("thread_names", &pl::Trace::thread_names)
      .def_ro("stream_names", &pl::Trace::stream_names)
      .def_ro("host_spans", &pl::Trace::host_spans)
      .def_ro("waits", &pl::Trace::waits)
      .def_ro("gpu_spans", &pl::Trace::gpu_spans)
      .def("to_chrome_json", &pl::Trace::to_chrome_json,
           "Chrome trace-event JSON (open in ui.perfetto.dev).")
      .def("write_chrome_json", &pl::Trace::write_chrome_json, nb::arg("path"));
}

void bind_engine(nb::module_& m) {
  count_forks();
  nb::class_<PyEngine>(m, "Engine", "weft::pipeline::Engine driven from Python",
                       nb::type_slots(engine_slots))
      .def(
          "__init__",
          [](PyEngine* self, const pl::Schedule& schedule, const pl::ThreadMap& threads,
             const std::string& backend, int device,
             const std::vector<std::pair<std::string, std::uintptr_t>>& adopted_streams, bool trace,
             double stall_report_s, double spin_us, const std::string& result_slot,
             bool result_required) {
            pl::EngineOptions options;
            options.trace = trace;
            options.stall_report_s = stall_report_s;
            options.spin_us = spin_us;
            new (self) PyEngine(schedule, threads, BackendSpec{backend, device, adopted_streams},
                                std::move(options), result_slot, result_required);
          },
          nb::arg("schedule"), nb::arg("threads"), nb::arg("backend"), nb::arg("device"),
          nb::arg("adopted_streams"), nb::arg("trace"), nb::arg("stall_report_s"),
          nb::arg("spin_us"), nb::arg("result_slot"), nb::arg("result_required"))
      .def("progress", &PyEngine::progress, nb::arg("data_iter"))
      .def("reset", &PyEngine::reset)
      .def("synchronize", &PyEngine::synchronize)
      .def("close", &PyEngine::close)
      .def_prop_ro("last_batch_index", &PyEngine::last_batch_index)
      .def_prop_ro("failed", [](PyEngine& e) { return e.engine("failed").failed(); })
      .def_prop_ro("num_in_flight",
                   [](PyEngine& e) { return e.engine("num_in_flight").num_in_flight(); })
      .def_prop_ro("backend",
                   [](PyEngine& e) { return std::string(e.engine("backend").backend().name()); })
      .def("threads",
           [](PyEngine& e) {
             pl::Engine& engine = e.engine("threads");
             return thread_lists(engine.threads(), engine.schedule());
           })
      .def("stream_handle",
           [](PyEngine& e, const std::string& stream) {
             pl::Engine& engine = e.engine("stream_handle");
             const auto id = engine.schedule().find_stream(stream);
             WEFT_CHECK(id.has_value(), "engine: no stream '", stream, "' in the schedule");
             return reinterpret_cast<std::uintptr_t>(engine.backend().stream_handle(*id));
           })
      .def("take_trace", [](PyEngine& e) { return e.engine("take_trace").take_trace(); })
      .def("collective_inventory", [](PyEngine& e) {
        nb::list out;
        for (const pl::MeasuredCollective& c :
             e.engine("collective_inventory").collective_inventory()) {
          nb::dict d;
          d["task"] = c.task;
          d["kind"] = c.kind;
          d["stream"] = c.stream;
          d["bytes_per_call"] = c.bytes_per_call;
          d["calls_per_run"] = c.calls_per_run;
          out.append(d);
        }
        return out;
      });
  m.def("usable_cpus", &pl::usable_cpus);
}

}  // namespace

void bind_pipeline(nb::module_& m) {
  register_python_exception_translator();
  register_exit_hook(m);
  m.attr("MAX_LOOKAHEAD") = pl::kMaxLookahead;
  bind_context(m);
  bind_task(m);
  bind_schedule(m);
  bind_thread_map(m);
  bind_trace(m);
  bind_engine(m);
}

}  // namespace weft::python
