// weft._weft: the extension behind the `weft` Python package. It speaks only in device pointers,
// stream handles (integers), DLPack capsules and plain Python values; the package's pure-Python
// layer turns torch tensors, streams and process groups into those, so one build serves any torch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "weft/core/error.hpp"
#include "weft/core/version.hpp"

#ifdef WEFT_PYTHON_WITH_CUDA
#include <cuda_runtime_api.h>

#include "weft/cuda/nccl.hpp"
#include "weft/cuda/nccl_dlopen.hpp"
#endif

namespace nb = nanobind;

namespace weft::python {
void bind_cuda_util(nb::module_& cuda);
void bind_ep(nb::module_& ep);
void bind_pipeline(nb::module_& pipeline);
void bind_hstu(nb::module_& hstu);
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
  // The process's libnccl.so.2 (torch's, once torch is imported), whether or not weft is bound
  // to it yet; None where the process holds none.
  const std::optional<weft::cuda::LoadedNccl> loaded = weft::cuda::loaded_nccl();
  d["nccl_loaded"] = loaded && loaded->version != 0 ? nb::cast(nccl_version_string(loaded->version))
                                                    : nb::none();
  d["nccl_library"] = loaded ? nb::cast(loaded->path) : nb::none();
  d["nccl_bound"] = weft::cuda::nccl_dlopen::is_bound();
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
#ifdef WEFT_PYTHON_WITH_CUDA
  m.def(
      "nccl_bind",
      [](const std::string& path) {
        const weft::cuda::nccl_dlopen::BindResult r = weft::cuda::nccl_dlopen::bind(path);
        nb::dict d;
        d["bound"] = r.bound;
        d["path"] = r.path;
        d["version"] = r.version != 0 ? nb::cast(nccl_version_string(r.version)) : nb::none();
        d["error"] = r.error;
        return d;
      },
      nb::arg("path"),
      "Binds weft's NCCL calls to the process's libnccl.so.2, else to the one at path, if it is "
      "the version weft was compiled against (weft/cuda/nccl_dlopen.hpp). Returns bound, path, "
      "version, error.");
#endif
  nb::module_ pipeline = m.def_submodule("pipeline", "weft::pipeline's engine with Python bodies");
  weft::python::bind_pipeline(pipeline);
  nb::module_ hstu = m.def_submodule("hstu", "weft::hstu's preset schedule");
  weft::python::bind_hstu(hstu);
  nb::module_ plan = m.def_submodule("plan", "weft::plan's simulator, report and trace reader");
  weft::python::bind_plan(plan);
  nb::module_ ep = m.def_submodule("ep", "weft::ep (needs a CUDA build)");
  nb::module_ cuda = m.def_submodule("cuda", "CUDA utilities (need a CUDA build)");
#ifdef WEFT_PYTHON_WITH_CUDA
  weft::python::bind_ep(ep);
  weft::python::bind_cuda_util(cuda);
#endif
}
