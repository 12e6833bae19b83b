// weft._weft.ep: weft::ep::Buffer for the Python layer (weft/ep/). Tensors arrive as device
// pointers with their shape and dtype (the Python layer checks strides and devices first), streams
// as integers (cudaStream_t); results leave as pointers into the Buffer's window, which the Python
// layer wraps through device_bytes capsules.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/copy_rows.hpp"
#include "weft/cuda/device_guard.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/buffer.hpp"

namespace nb = nanobind;
namespace ep = weft::ep;
using weft::cuda::DeviceGuard;

namespace weft::python {
namespace {

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }
const void* as_ptr(std::uintptr_t p) { return reinterpret_cast<const void*>(p); }
std::uintptr_t as_int(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

ep::DType parse_dtype(const std::string& name) {
  if (name == "bfloat16") return ep::DType::kBFloat16;
  if (name == "float32") return ep::DType::kFloat32;
  if (name == "int32") return ep::DType::kInt32;
  if (name == "int64") return ep::DType::kInt64;
  if (name == "uint8") return ep::DType::kUInt8;
  WEFT_FAIL("unknown dtype '", name, "' (bfloat16, float32, int32, int64 or uint8)");
}

// One (dst, dst_pitch, src, src_pitch, width, rows) device-to-device copy per entry, enqueued on
// stream (a stream of device) in as few kernel launches as weft::cuda::copy_rows allows: the
// copy-out of a dispatch's results (pitches and width in bytes). The device comes from the caller
// because the stream may be capturing a CUDA graph, where it cannot be asked.
using Copy2d = std::tuple<std::uintptr_t, int64_t, std::uintptr_t, int64_t, int64_t, int64_t>;

void copy_rows(const std::vector<Copy2d>& copies, std::uintptr_t stream, int device) {
  DeviceGuard guard(device);
  weft::cuda::CopyRowsParams params;
  for (const auto& [dst, dst_pitch, src, src_pitch, width, rows] : copies) {
    if (params.num_copies == weft::cuda::CopyRowsParams::kMaxCopies) {
      weft::cuda::copy_rows(params, as_stream(stream));
      params = {};
    }
    params.add({reinterpret_cast<void*>(dst), dst_pitch, as_ptr(src), src_pitch, width, rows});
  }
  weft::cuda::copy_rows(params, as_stream(stream));
}

nb::bytes unique_id() {
  ncclUniqueId id;
  WEFT_NCCL_CHECK(ncclGetUniqueId(&id));
  return nb::bytes(id.internal, sizeof(id.internal));
}

// What dispatch returns to the Python layer: the handle, the counts when they were read, and the
// window addresses of the result arrays (fixed for the life of the Buffer).
struct DispatchOut {
  ep::Handle handle;
  int64_t num_recv = -1;               // read_counts only
  int64_t rows_required = -1;          // read_counts and expanded only
  std::vector<int64_t> tokens_per_local_expert;  // read_counts only
  std::uintptr_t recv_x = 0;           // bf16 or packed fp8 rows, row_bytes apart
  std::uintptr_t recv_expert_idx = 0;
  std::uintptr_t recv_weights = 0;
  std::uintptr_t recv_src = 0;
  std::uintptr_t tokens_per_local_expert_device = 0;
  std::uintptr_t num_recv_device = 0;
  std::uintptr_t segment_begin = 0;    // expanded only
  int64_t row_bytes = 0;
  int64_t capacity = 0;
};

// A weft::ep::Buffer with the NCCL communicator it was built on (made here from a unique id that
// the Python layer shared over its process group).
class PyBuffer {
 public:
  PyBuffer(nb::bytes id, int num_ranks, int rank, int device, const ep::BufferConfig& config,
           const ep::BufferOptions& options)
      : device_(device) {
    ncclUniqueId uid;
    WEFT_CHECK(id.size() == sizeof(uid.internal), "a unique id has ", sizeof(uid.internal),
               " bytes, got ", id.size());
    std::memcpy(uid.internal, id.c_str(), sizeof(uid.internal));
    WEFT_CHECK(num_ranks >= 1 && rank >= 0 && rank < num_ranks, "rank ", rank,
               " is not in [0, ", num_ranks, ")");
    weft::cuda::check_nccl_runtime();
    nb::gil_scoped_release release;  // both wait for the other ranks
    DeviceGuard guard(device);
    WEFT_NCCL_CHECK(ncclCommInitRank(&comm_, num_ranks, uid, rank));
    try {
      buffer_ = std::make_unique<ep::Buffer>(comm_, config, options);
      const int num_local = config.num_local_experts(num_ranks);
      WEFT_CUDA_CHECK(cudaMallocHost(&host_counts_, sizeof(int32_t) * std::size_t(num_local)));
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&counts_event_, cudaEventDisableTiming));
      // Reused by every call: a wait enqueued on an event captures its state at that moment.
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&entry_event_, cudaEventDisableTiming));
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&exit_event_, cudaEventDisableTiming));
    } catch (...) {
      release_resources();
      throw;
    }
  }
  ~PyBuffer() { release_resources(); }
  PyBuffer(const PyBuffer&) = delete;
  PyBuffer& operator=(const PyBuffer&) = delete;

  // Frees the window and the communicator now (waits for the work queued on the comm stream).
  void destroy() {
    nb::gil_scoped_release release;
    release_resources();
  }

  DispatchOut dispatch(std::uintptr_t x, const std::string& x_dtype, int64_t num_tokens,
                       int64_t x_cols, std::uintptr_t topk_idx, const std::string& topk_idx_dtype,
                       std::uintptr_t topk_weights, const ep::Handle* handle,
                       std::uintptr_t stats, int num_sms, bool expand, int expert_alignment,
                       bool zero_padding, std::uintptr_t stream, bool read_counts) {
    ep::Buffer& b = live();
    const int top_k = b.config().top_k;
    ep::DispatchInputs in;
    in.x = {as_ptr(x), parse_dtype(x_dtype), num_tokens, x_cols};
    if (handle == nullptr) {
      in.topk_idx = {as_ptr(topk_idx), parse_dtype(topk_idx_dtype), num_tokens, top_k};
      in.topk_weights = {as_ptr(topk_weights), ep::DType::kFloat32, num_tokens, top_k};
    }
    in.handle = handle;
    in.cumulative_local_expert_recv_stats = reinterpret_cast<uint32_t*>(stats);
    in.num_sms = num_sms;
    in.expand = {.enabled = expand, .expert_alignment = expert_alignment,
                 .zero_padding = zero_padding};
    DeviceGuard guard(device_);
    const cudaStream_t s = as_stream(stream);
    ep::DispatchResult r =
        b.dispatch(in, s, read_counts ? ep::CountMode::kExact : ep::CountMode::kOnDevice);
    DispatchOut out;
    if (read_counts) {
      const int num_local = b.config().num_local_experts(b.num_ranks());
      WEFT_CUDA_CHECK(cudaMemcpyAsync(host_counts_, r.tokens_per_local_expert,
                                      sizeof(int32_t) * std::size_t(num_local),
                                      cudaMemcpyDeviceToHost, s));
      WEFT_CUDA_CHECK(cudaEventRecord(counts_event_, s));
      {
        nb::gil_scoped_release release;
        b.wait_num_recv(r);
        WEFT_CUDA_CHECK(cudaEventSynchronize(counts_event_));
      }
      out.num_recv = r.num_recv;
      out.rows_required = r.rows_required;
      out.tokens_per_local_expert.assign(host_counts_, host_counts_ + num_local);
    }
    out.handle = r.handle;
    out.recv_x = as_int(r.recv_x != nullptr ? static_cast<const void*>(r.recv_x)
                                            : static_cast<const void*>(r.recv_x_fp8));
    out.recv_expert_idx = as_int(r.recv_expert_idx);
    out.recv_weights = as_int(r.recv_weights);
    out.recv_src = as_int(r.recv_src);
    out.tokens_per_local_expert_device = as_int(r.tokens_per_local_expert);
    out.num_recv_device = as_int(r.num_recv_device);
    out.segment_begin = as_int(r.segment_begin);
    out.row_bytes = r.row_bytes;
    out.capacity = r.capacity;
    return out;
  }

  void combine(std::uintptr_t expert_out, int64_t expert_out_rows, std::uintptr_t bias0,
               std::uintptr_t bias1, const ep::Handle& handle, std::uintptr_t out, int num_sms,
               std::uintptr_t stream) {
    ep::Buffer& b = live();
    const int64_t hidden = b.config().hidden;
    const int64_t T = handle.num_tokens;
    ep::CombineInputs in;
    in.expert_out = {as_ptr(expert_out), ep::DType::kBFloat16, expert_out_rows, hidden};
    if (bias0 != 0) in.bias0 = {as_ptr(bias0), ep::DType::kBFloat16, T, hidden};
    if (bias1 != 0) in.bias1 = {as_ptr(bias1), ep::DType::kBFloat16, T, hidden};
    in.num_sms = num_sms;
    DeviceGuard guard(device_);
    b.combine(in, handle, reinterpret_cast<void*>(out), as_stream(stream));
  }

  // Orders comm_stream after previous_event (a cudaEvent_t) or else after the work queued so far
  // on caller_stream: the start of every call (DeepEP's previous_event).
  void enter(std::uintptr_t caller_stream, std::uintptr_t previous_event,
             std::uintptr_t comm_stream) {
    const cudaStream_t comm = as_stream(comm_stream);
    cudaEvent_t event = reinterpret_cast<cudaEvent_t>(previous_event);
    if (event == nullptr) {
      event = entry_event_;
      WEFT_CUDA_CHECK(cudaEventRecord(event, as_stream(caller_stream)));
    }
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(comm, event, 0));
  }

  // Orders caller_stream after the work queued so far on comm_stream (async_finish=False).
  void leave(std::uintptr_t caller_stream, std::uintptr_t comm_stream) {
    WEFT_CUDA_CHECK(cudaEventRecord(exit_event_, as_stream(comm_stream)));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(as_stream(caller_stream), exit_event_, 0));
  }

  // Throws the device error recorded by a completed call, if any.
  void check() {
    DeviceGuard guard(device_);
    live().check();
  }

  int rank() { return live().rank(); }
  int num_ranks() { return live().num_ranks(); }
  int device() const { return device_; }
  int64_t capacity() { return live().capacity(); }
  int64_t expand_capacity() { return live().expand_capacity(); }
  const ep::BufferConfig& config() { return live().config(); }
  bool alive() const { return buffer_ != nullptr; }

 private:
  ep::Buffer& live() {
    WEFT_CHECK(buffer_ != nullptr, "this weft.ep Buffer was destroyed");
    return *buffer_;
  }

  void release_resources() noexcept {
    if (buffer_ == nullptr && comm_ == nullptr) return;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    // The calls ran on streams of the Python layer's (torch's), and tensors may still be read
    // on others: the window goes only after everything queued on the device.
    cudaDeviceSynchronize();
    buffer_.reset();
    if (counts_event_ != nullptr) cudaEventDestroy(counts_event_);
    if (entry_event_ != nullptr) cudaEventDestroy(entry_event_);
    if (exit_event_ != nullptr) cudaEventDestroy(exit_event_);
    if (host_counts_ != nullptr) cudaFreeHost(host_counts_);
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    counts_event_ = nullptr;
    entry_event_ = nullptr;
    exit_event_ = nullptr;
    host_counts_ = nullptr;
    comm_ = nullptr;
    cudaSetDevice(previous);
  }

  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<ep::Buffer> buffer_;
  int32_t* host_counts_ = nullptr;  // pinned [num_local_experts]
  cudaEvent_t counts_event_ = nullptr;
  cudaEvent_t entry_event_ = nullptr;
  cudaEvent_t exit_event_ = nullptr;
};

}  // namespace

void bind_ep(nb::module_& m) {
  m.def("copy_rows", &copy_rows, nb::arg("copies"), nb::arg("stream"), nb::arg("device"),
        "Device-to-device pitched copies (dst, dst_pitch, src, src_pitch, width, rows), in bytes, "
        "in one kernel per 8 copies on stream, a stream of device.");
  m.def("unique_id", &unique_id, "A new NCCL unique id (bytes) for PyBuffer's communicator.");
  m.def(
      "window_bytes",
      [](int64_t max_tokens, int64_t hidden, int num_experts, int top_k, int expand_factor,
         int num_ranks) {
        return ep::Buffer::window_bytes({max_tokens, hidden, num_experts, top_k, expand_factor},
                                        num_ranks);
      },
      nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("num_experts"), nb::arg("top_k"),
      nb::arg("expand_factor"), nb::arg("num_ranks"));
  m.def(
      "fp8_row_bytes", [](int64_t hidden) { return ep::fp8_row_layout(hidden).row_bytes; },
      nb::arg("hidden"));

  nb::class_<ep::Handle>(m, "Handle")
      .def_ro("buffer_id", &ep::Handle::buffer_id)
      .def_ro("sequence", &ep::Handle::sequence)
      .def_ro("num_tokens", &ep::Handle::num_tokens)
      .def_ro("num_recv", &ep::Handle::num_recv)
      .def_prop_ro("expanded", [](const ep::Handle& h) { return h.expand.enabled; });

  nb::class_<DispatchOut>(m, "DispatchOut")
      .def_ro("handle", &DispatchOut::handle)
      .def_ro("num_recv", &DispatchOut::num_recv)
      .def_ro("rows_required", &DispatchOut::rows_required)
      .def_ro("tokens_per_local_expert", &DispatchOut::tokens_per_local_expert)
      .def_ro("recv_x", &DispatchOut::recv_x)
      .def_ro("recv_expert_idx", &DispatchOut::recv_expert_idx)
      .def_ro("recv_weights", &DispatchOut::recv_weights)
      .def_ro("recv_src", &DispatchOut::recv_src)
      .def_ro("tokens_per_local_expert_device", &DispatchOut::tokens_per_local_expert_device)
      .def_ro("num_recv_device", &DispatchOut::num_recv_device)
      .def_ro("segment_begin", &DispatchOut::segment_begin)
      .def_ro("row_bytes", &DispatchOut::row_bytes)
      .def_ro("capacity", &DispatchOut::capacity);

  nb::class_<PyBuffer>(m, "Buffer")
      .def(
          "__init__",
          [](PyBuffer* self, nb::bytes id, int num_ranks, int rank, int device,
             int64_t max_tokens, int64_t hidden, int num_experts, int top_k, int expand_factor,
             int num_sms, int tokens_per_block, double timeout_s, int pipeline_depth) {
            ep::BufferOptions options;
            options.num_sms = num_sms;
            options.tokens_per_block = tokens_per_block;
            options.timeout_s = timeout_s;
            options.pipeline_depth = pipeline_depth;
            new (self) PyBuffer(id, num_ranks, rank, device,
                                {max_tokens, hidden, num_experts, top_k, expand_factor}, options);
          },
          nb::arg("unique_id"), nb::arg("num_ranks"), nb::arg("rank"), nb::arg("device"),
          nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("num_experts"), nb::arg("top_k"),
          nb::arg("expand_factor"), nb::arg("num_sms"), nb::arg("tokens_per_block"),
          nb::arg("timeout_s"), nb::arg("pipeline_depth"))
      .def("destroy", &PyBuffer::destroy)
      .def("dispatch", &PyBuffer::dispatch, nb::arg("x"), nb::arg("x_dtype"),
           nb::arg("num_tokens"), nb::arg("x_cols"), nb::arg("topk_idx"),
           nb::arg("topk_idx_dtype"), nb::arg("topk_weights"), nb::arg("handle").none(),
           nb::arg("stats"), nb::arg("num_sms"), nb::arg("expand"), nb::arg("expert_alignment"),
           nb::arg("zero_padding"), nb::arg("stream"), nb::arg("read_counts"))
      .def("combine", &PyBuffer::combine, nb::arg("expert_out"), nb::arg("expert_out_rows"),
           nb::arg("bias0"), nb::arg("bias1"), nb::arg("handle"), nb::arg("out"),
           nb::arg("num_sms"), nb::arg("stream"))
      .def("enter", &PyBuffer::enter, nb::arg("caller_stream"), nb::arg("previous_event"),
           nb::arg("comm_stream"))
      .def("leave", &PyBuffer::leave, nb::arg("caller_stream"), nb::arg("comm_stream"))
      .def("check", &PyBuffer::check)
      .def_prop_ro("rank", &PyBuffer::rank)
      .def_prop_ro("num_ranks", &PyBuffer::num_ranks)
      .def_prop_ro("device", &PyBuffer::device)
      .def_prop_ro("capacity", &PyBuffer::capacity)
      .def_prop_ro("expand_capacity", &PyBuffer::expand_capacity)
      .def_prop_ro("alive", &PyBuffer::alive)
      .def_prop_ro("max_tokens", [](PyBuffer& b) { return b.config().max_tokens; })
      .def_prop_ro("hidden", [](PyBuffer& b) { return b.config().hidden; })
      .def_prop_ro("num_experts", [](PyBuffer& b) { return b.config().num_experts; })
      .def_prop_ro("top_k", [](PyBuffer& b) { return b.config().top_k; })
      .def_prop_ro("expand_factor", [](PyBuffer& b) { return b.config().expand_factor; });
}

}  // namespace weft::python
