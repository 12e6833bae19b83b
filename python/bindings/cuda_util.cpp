// weft._weft.cuda: small CUDA utilities the Python package uses (a CUDA build only): hold_sms,
// the stand-in kernel of emulated communication (weft/cuda/hold_sms.hpp).
#include <nanobind/nanobind.h>

#include <cstdint>

#include "weft/core/error.hpp"
#include "weft/cuda/device_guard.hpp"
#include "weft/cuda/hold_sms.hpp"

namespace nb = nanobind;

namespace weft::python {

void bind_cuda_util(nb::module_& m) {
  m.def(
      "hold_sms",
      [](int num_sms, double duration_us, std::uintptr_t stream, int device) {
        WEFT_CHECK(duration_us >= 0.0, "hold_sms: duration_us must be >= 0, got ", duration_us);
        weft::cuda::DeviceGuard guard(device);
        weft::cuda::HoldSmsParams p;
        p.num_sms = num_sms;
        p.duration_ns = static_cast<uint64_t>(duration_us * 1e3 + 0.5);
        weft::cuda::hold_sms(p, reinterpret_cast<cudaStream_t>(stream));
      },
      nb::arg("num_sms"), nb::arg("duration_us"), nb::arg("stream"), nb::arg("device"),
      "Enqueues on stream (a cudaStream_t as an int, of device) a kernel that holds num_sms SMs "
      "for duration_us each (weft/cuda/hold_sms.hpp).");
}

}  // namespace weft::python
