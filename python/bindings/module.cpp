// weft._weft: the extension behind the `weft` Python package. It speaks only in device pointers,
// stream handles (integers), DLPack capsules and plain Python values; the package's pure-Python
// layer turns torch tensors, streams and process groups into those, so one build serves any torch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "weft/core/error.hpp"
#include "weft/core/version.hpp"

#ifdef WEFT_PYTHON_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "weft/cuda/nccl.hpp"
#endif

namespace nb = nanobind;

namespace weft::python {
void bind_ep(nb::module_& ep);
void bind_pipeline(nb::module_& pipeline);
void bind_plan(nb::module_& plan);
}

namespace {

#ifdef WEFT_PYTHON_WITH_CUDA
std::string nccl_version_string(int code) {
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." +
         std::to_string(code % 100);
}

std::string cuda_version_string(int code) {
  return std::to_string(code / 1000) + "." + std::to_string(code % 1000 / 10);
}
#endif

nb::dict info() {
  nb::dict d;
  d["version"] = weft::version();
  d["built_with_cuda"] = weft::built_with_cuda();
#ifdef WEFT_PYTHON_WITH_CUDA
  d["cuda_architectures"] = WEFT_PYTHON_CUDA_ARCHITECTURES;
  d["nccl_compiled"] = nccl_version_string(weft::cuda::nccl_compiled_version());
  int loaded = 0;
  d["nccl_loaded"] = ncclGetVersion(&loaded) == ncclSuccess ? nb::cast(nccl_version_string(loaded))
                                                              : nb::none();
  int runtime = 0;
  d["cuda_runtime"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess
                          ? nb::cast(cuda_version_string(runtime))
                          : nb::none();
  int driver = 0;
  // 0: no driver is installed.
  d["cuda_driver"] = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0
                         ? nb::cast(cuda_version_string(driver))
                         : nb::none();
  d["num_gpus"] = weft::cuda::device_count();
#endif
  return d;
}

}  // namespace

NB_MODULE(_weft, m) {
  m.doc() = "weft's extension: device pointers, streams and DLPack capsules (see the weft package)";
  // weft::Error and its CUDA/NCCL subclasses arrive in Python as weft.Error (a RuntimeError) whose
  // message is the C++ what(): "file:line: message". A message quoting bytes of the user's input
  // that are not UTF-8 shows them as \x escapes (a UnicodeDecodeError would hide the error).
  // The module keeps the type alive: it is the translator's payload.
  const nb::exception<weft::Error> error(m, "Error", PyExc_RuntimeError);
  nb::register_exception_translator(
      [](const std::exception_ptr& raised, void* type) {
        try {
          std::rethrow_exception(raised);
        } catch (const weft::Error& e) {
          const std::string_view what = e.what();
          const nb::object message = nb::steal(PyUnicode_DecodeUTF8(
              what.data(), static_cast<Py_ssize_t>(what.size()), "backslashreplace"));
          PyErr_SetObject(static_cast<PyObject*>(type), message.ptr());
        }
      },
      error.ptr());
  m.def("version", [] { return std::string(weft::version()); });
  m.def("info", &info, "What this build of weft contains and which NCCL / CUDA it runs with.");
  nb::module_ pipeline = m.def_submodule("pipeline", "weft::pipeline's engine with Python bodies");
  weft::python::bind_pipeline(pipeline);
  nb::module_ plan = m.def_submodule("plan", "weft::plan's simulator, report and trace reader");
  weft::python::bind_plan(plan);
  nb::module_ ep = m.def_submodule("ep", "weft::ep (needs a CUDA build)");
#ifdef WEFT_PYTHON_WITH_CUDA
  weft::python::bind_ep(ep);
#endif
}
