// The device-side error flag: how a kernel reports bad input or a timed-out wait to the host.
//
// A kernel that finds a problem it cannot handle (an index out of range, a peer that never
// arrived) records it in a DeviceErrorRecord and skips the work that would touch memory it does
// not own; it never traps. The host reads the record after the kernel completed and turns it into
// a weft::Error. The first error raised wins; later ones are dropped.
//
//   DeviceErrorFlag flag;                         // host-mapped, one per stream of kernels
//   my_kernel<<<g, b, 0, s>>>({..., flag.device_record()});
//   WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
//   flag.throw_if_raised([](const DeviceErrorRecord& r) { return describe_my_codes(r); });
#pragma once

#include <cstdint>
#include <functional>
#include <source_location>
#include <string>

namespace weft::cuda {

// Layout shared by host and device; lives in pinned, mapped host memory.
struct DeviceErrorRecord {
  uint32_t claimed;  // 0 until some thread wins the right to fill the record
  uint32_t code;     // 0 = no error; module-specific otherwise; written last
  int32_t rank;      // the rank that detected it, or -1
  int32_t reserved;  // unused: pads the header to 16 bytes, so args is 8-byte aligned
  int64_t args[3];   // code-specific details (the bad value, the bound, what was waited for)
};

class DeviceErrorFlag {
 public:
  DeviceErrorFlag();
  ~DeviceErrorFlag();
  DeviceErrorFlag(const DeviceErrorFlag&) = delete;
  DeviceErrorFlag& operator=(const DeviceErrorFlag&) = delete;

  // The pointer kernels write through.
  DeviceErrorRecord* device_record() const noexcept { return device_; }

  // Host reads. Meaningful once every kernel that may write the record has completed.
  bool raised() const noexcept;
  DeviceErrorRecord read() const noexcept;
  void clear() noexcept;

  // If an error was raised: clears the record and throws weft::Error(describe(record)).
  void throw_if_raised(const std::function<std::string(const DeviceErrorRecord&)>& describe,
                       std::source_location where = std::source_location::current());

 private:
  DeviceErrorRecord* host_ = nullptr;
  DeviceErrorRecord* device_ = nullptr;
};

}  // namespace weft::cuda
