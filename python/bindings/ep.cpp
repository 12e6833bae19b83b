// weft._weft.ep: weft::ep::Buffer for the Python layer (weft/ep/). Tensors arrive as device
// pointers (the Python layer checks torch facts: device, dtype, contiguity; C++ owns shapes and
// limits), a call's arguments as one struct (DispatchArgs / CombineArgs, taken by value: the
// Python layer reuses one per kind of hot call and sets what varies), streams and
// events as integers (cudaStream_t, cudaEvent_t); results leave as pointers into the Buffer's
// window, which the Python layer wraps through DLPack capsules (Buffer.window_bytes).
//
// Lifetimes: a Communicator owns its ncclComm_t; every Buffer made on it keeps it alive, so the
// communicator is destroyed after the last of its windows. A Buffer's window lives until the
// Buffer object and every capsule of it are released (the capsules hold the window itself, not
// the Python object), or until destroy(), which frees it at once. Every call that may wait on the
// host (a communicator's creation, pacing, a count read, destruction) releases the GIL.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dlpack_capsule.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_guard.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/ep/all_to_all_layout.hpp"
#include "weft/ep/buffer.hpp"

namespace nb = nanobind;
namespace ep = weft::ep;
using weft::cuda::DeviceGuard;

namespace weft::python {
namespace {

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }
const void* as_ptr(std::uintptr_t p) { return reinterpret_cast<const void*>(p); }
std::uintptr_t as_int(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

nb::bytes unique_id() {
  ncclUniqueId id;
  WEFT_NCCL_CHECK(ncclGetUniqueId(&id));
  return nb::bytes(id.internal, sizeof(id.internal));
}

// An NCCL communicator of one rank, destroyed with the last Buffer made on it (or by release()).
struct CommCore {
  ncclComm_t comm = nullptr;
  int device = 0;

  ~CommCore() { release(); }
  void release() noexcept {
    if (comm == nullptr) return;
    DeviceGuard guard(device);
    ncclCommDestroy(comm);
    comm = nullptr;
  }
};

class PyCommunicator {
 public:
  PyCommunicator(nb::bytes id, int num_ranks, int rank, int device)
      : core_(std::make_shared<CommCore>()) {
    ncclUniqueId uid;
    WEFT_CHECK(id.size() == sizeof(uid.internal), "a unique id has ", sizeof(uid.internal),
               " bytes, got ", id.size());
    std::memcpy(uid.internal, id.c_str(), sizeof(uid.internal));
    WEFT_CHECK(num_ranks >= 1 && rank >= 0 && rank < num_ranks, "rank ", rank,
               " is not in [0, ", num_ranks, ")");
    weft::cuda::check_nccl_runtime();
    core_->device = device;
    nb::gil_scoped_release release;  // waits for the other ranks
    DeviceGuard guard(device);
    WEFT_NCCL_CHECK(ncclCommInitRank(&core_->comm, num_ranks, uid, rank));
    num_ranks_ = num_ranks;
    rank_ = rank;
  }
  ~PyCommunicator() {
    nb::gil_scoped_release release;
    core_.reset();
  }
  PyCommunicator(const PyCommunicator&) = delete;
  PyCommunicator& operator=(const PyCommunicator&) = delete;

  // Destroys the communicator now; the Buffers made on it must have been destroyed first.
  void destroy() {
    WEFT_CHECK(core_.use_count() == 1, "destroy the ", core_.use_count() - 1,
               " weft.ep Buffer(s) made on this communicator first");
    nb::gil_scoped_release release;
    core_->release();
  }

  const std::shared_ptr<CommCore>& core() const {
    WEFT_CHECK(core_->comm != nullptr, "this weft.ep communicator was destroyed");
    return core_;
  }
  int num_ranks() const { return num_ranks_; }
  int rank() const { return rank_; }
  int device() const { return core_->device; }
  bool alive() const { return core_->comm != nullptr; }

 private:
  std::shared_ptr<CommCore> core_;
  int num_ranks_ = 0;
  int rank_ = 0;
};

// The tokens' rows a dispatch moves, in any of x's forms: bf16 rows [num_tokens, hidden], packed
// fp8 rows (uint8 [num_tokens, fp8 row_bytes]), or the fp8 pair: the e4m3 payload (uint8
// [num_tokens, hidden]) with its scales, fp32 [num_tokens, hidden / 128] at these strides
// (elements), packed by the kernel.
struct TokenRowsArg {
  std::uintptr_t data = 0;
  ep::DType dtype = ep::DType::kBFloat16;
  int64_t num_tokens = 0;
  int64_t cols = 0;
  std::uintptr_t scales = 0;
  int64_t scales_token_stride = 0;
  int64_t scales_group_stride = 0;
  ep::TensorView view() const {
    return {reinterpret_cast<const void*>(data), dtype, num_tokens, cols};
  }
  ep::DispatchInputs::Fp8Scales scales_view() const {
    return {reinterpret_cast<const float*>(scales), scales_token_stride, scales_group_stride};
  }
};

// A call's arguments (the Python layer fills them by field: a new object per call, or for a hot
// call one reused object whose varying fields it sets).
struct DispatchArgs {
  TokenRowsArg x;
  std::uintptr_t topk_idx = 0;  // [num_tokens, top_k] int32 / int64 (null for a cached dispatch)
  bool topk_idx_int64 = true;
  std::uintptr_t topk_weights = 0;  // [num_tokens, top_k] fp32
  std::uintptr_t stats = 0;     // optional [num_local_experts] int32: the counts are added to it
  int num_sms = 0;              // most blocks; 0: the Buffer's
  bool expand = false;
  int expert_alignment = 1;
  bool zero_padding = false;
  int64_t segment_stride = 0;   // expanded: 0 packed segments, > 0 segment e at e * stride
  bool read_counts = false;     // copy the counts to the host and wait for them
  // read_counts: each returned per-expert count rounded up to a multiple of this (DeepEP's
  // expert_alignment of num_recv_tokens_per_expert_list); >= 1.
  int count_alignment = 1;
  // Streams: the call runs on `stream`. With comm_stream != 0 it runs there instead, after
  // previous_event (a cudaEvent_t) or else after the work queued so far on `stream`, and unless
  // async_finish, `stream` then waits for it.
  std::uintptr_t stream = 0;
  std::uintptr_t comm_stream = 0;
  std::uintptr_t previous_event = 0;
  bool async_finish = false;
  // The call goes on with copy_out (owned results): `stream` is not ordered after it yet.
  bool hold = false;
  // With read_counts and hold: return once the kernel is launched; finish_dispatch then waits
  // for the counts (the caller makes its owned tensors while the kernel runs).
  bool wait_later = false;
  bool defer_own_rows = false;  // ep::DispatchInputs::defer_own_rows (copy_out gets x again)
  // Every pointer comes from a tensor the Python layer checked is on the Buffer's device
  // (ep::DispatchInputs::pointers_checked: no CUDA pointer query per pointer and call).
  bool pointers_checked = false;
};

// Owned copies of the latest dispatch's results (ep::CopyOutTargets), on comm_stream (or
// `stream` where comm_stream is 0), which then hands back to `stream` as DispatchArgs does.
struct CopyOutArgs {
  int64_t num_rows = 0;
  std::uintptr_t x = 0;
  std::uintptr_t x_scales = 0;
  std::uintptr_t src = 0;
  int32_t pad_token = 0;
  std::uintptr_t topk_idx = 0;
  bool topk_idx_int64 = false;
  std::uintptr_t topk_weights = 0;
  int num_topk = 0;
  std::uintptr_t rank_prefix_matrix = 0;
  // The deferring dispatch's x (ep::CopyOutTargets::own_x).
  bool deferred_own_rows = false;
  TokenRowsArg own_x;
  std::uintptr_t stream = 0;
  std::uintptr_t comm_stream = 0;
  bool async_finish = false;
  bool pointers_checked = false;  // as DispatchArgs'
};

// The fixed arguments of one low-latency window (weft/ep/low_latency.py's slot), set once; a
// call passes the rest (PyBuffer::low_latency_dispatch / low_latency_combine).
struct LowLatencySlot {
  std::uintptr_t topk_weights = 0;  // [max_tokens, top_k] fp32 zeros: the dispatch moves none
  int64_t segment_stride = 0;       // > 0
  std::uintptr_t src_info = 0;      // ep::LowLatencyTargets
  std::uintptr_t layout_range = 0;
  std::uintptr_t scales = 0;        // used by a call with kLowLatencyFp8 (not kLowLatencyUe8m0)
  std::uintptr_t ue8m0 = 0;         // used by a call with kLowLatencyUe8m0
  std::uintptr_t comm_stream = 0;
};

// A low-latency call's flags (bits).
enum LowLatencyFlags : int {
  kLowLatencyFp8 = 1,         // dispatch: x cast to fp8 on the way (DispatchInputs::cast_to_fp8)
  kLowLatencyRoundScale = 2,  // ... with power-of-two scales
  kLowLatencyUe8m0 = 4,       // ... and the scales as UE8M0 bytes
  kLowLatencyOnComm = 8,      // on the comm stream after `stream` (async_finish / hook), no wait
                              // back; else on `stream` itself
  kLowLatencyAfter = 16,      // after `previous_stream`'s work too (the previous call's stream)
};

struct CombineArgs {
  std::uintptr_t expert_out = 0;  // [expert_out_rows, hidden] bf16
  int64_t expert_out_rows = 0;
  std::uintptr_t bias0 = 0;       // optional [T, hidden] bf16
  std::uintptr_t bias1 = 0;
  std::uintptr_t out = 0;         // [T, hidden] bf16
  // Optional [topk_weights_rows, topk_weights_cols] fp32, in the received-row order, and then
  // combined_weights [T, topk_weights_cols] fp32 out: per token, the sum of its rows' weights.
  std::uintptr_t topk_weights = 0;
  int64_t topk_weights_rows = 0;
  int64_t topk_weights_cols = 0;
  std::uintptr_t combined_weights = 0;
  // Optional [T, top_k] fp32 (expanded layout): each row weighted by its selections' weights.
  std::uintptr_t source_weights = 0;
  int num_sms = 0;
  std::uintptr_t stream = 0;      // as in DispatchArgs
  std::uintptr_t comm_stream = 0;
  std::uintptr_t previous_event = 0;
  bool async_finish = false;
  bool pointers_checked = false;  // as DispatchArgs'
};

// A dispatch's handle as a plain tuple (buffer_id, sequence, num_tokens, num_recv, expanded,
// expert_alignment, zero_padding, tokens_required, segment_stride): the Python layer keeps handles in objects
// that may outlive the extension's types (an autograd graph alive at interpreter exit), so a
// handle holds no instance of them.
using HandleTuple =
    std::tuple<uint64_t, uint64_t, int64_t, int64_t, bool, int, bool, int64_t, int64_t>;

HandleTuple to_tuple(const ep::Handle& h) {
  return {h.buffer_id, h.sequence, h.num_tokens, h.num_recv, h.expand.enabled,
          h.expand.expert_alignment, h.expand.zero_padding, h.tokens_required,
          h.expand.segment_stride};
}

ep::Handle from_tuple(const HandleTuple& t) {
  ep::Handle h;
  std::tie(h.buffer_id, h.sequence, h.num_tokens, h.num_recv, h.expand.enabled,
           h.expand.expert_alignment, h.expand.zero_padding, h.tokens_required,
           h.expand.segment_stride) = t;
  return h;
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
  std::uintptr_t rank_prefix_matrix = 0;  // [R][R] int32 on the device; deduplicated only
  // read_counts only: 0, or the largest T of any rank when that exceeded max_tokens (no row
  // moved on any rank: grow and dispatch again).
  int64_t tokens_required = -1;
  int64_t row_bytes = 0;
  int64_t capacity = 0;
  // With a copy given to dispatch: whether it was launched (and the hand-off back made).
  bool copied = false;
};

// out's handle and window addresses, from r.
void set_window_fields(const ep::DispatchResult& r, DispatchOut& out) {
  out.handle = r.handle;
  out.recv_x = as_int(r.recv_x != nullptr ? static_cast<const void*>(r.recv_x)
                                          : static_cast<const void*>(r.recv_x_fp8));
  out.recv_expert_idx = as_int(r.recv_expert_idx);
  out.recv_weights = as_int(r.recv_weights);
  out.recv_src = as_int(r.recv_src);
  out.tokens_per_local_expert_device = as_int(r.tokens_per_local_expert);
  out.num_recv_device = as_int(r.num_recv_device);
  out.segment_begin = as_int(r.segment_begin);
  out.rank_prefix_matrix = as_int(r.rank_prefix_matrix);
  out.row_bytes = r.row_bytes;
  out.capacity = r.capacity;
}

// A Buffer's window, its communicator and the host-side objects of its calls; shared by the
// Python Buffer and the capsules of its window.
struct BufferCore {
  std::shared_ptr<CommCore> comm;
  std::unique_ptr<ep::Buffer> buffer;
  int device = 0;
  int32_t* host_counts = nullptr;  // pinned [num_local_experts]
  cudaEvent_t counts_event = nullptr;
  cudaEvent_t entry_event = nullptr;  // reused by every call: a wait captures its state at once
  cudaEvent_t exit_event = nullptr;

  ~BufferCore() { release(); }
  void release() noexcept {
    if (buffer == nullptr && comm == nullptr) return;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    // The calls ran on streams of the Python layer's (torch's), and tensors may still be read
    // on others: the window goes only after everything queued on the device.
    cudaDeviceSynchronize();
    buffer.reset();
    if (counts_event != nullptr) cudaEventDestroy(counts_event);
    if (entry_event != nullptr) cudaEventDestroy(entry_event);
    if (exit_event != nullptr) cudaEventDestroy(exit_event);
    if (host_counts != nullptr) cudaFreeHost(host_counts);
    counts_event = entry_event = exit_event = nullptr;
    host_counts = nullptr;
    comm.reset();
    cudaSetDevice(previous);
  }
};

class PyBuffer {
 public:
  PyBuffer(const PyCommunicator& communicator, const ep::BufferConfig& config,
           const ep::BufferOptions& options)
      : core_(std::make_shared<BufferCore>()) {
    core_->comm = communicator.core();
    core_->device = communicator.device();
    nb::gil_scoped_release release;  // the window's creation waits for the other ranks
    DeviceGuard guard(core_->device);
    adopt(std::make_unique<ep::Buffer>(core_->comm->comm, config, options));
  }
  // A member of a virtual team (ep::Buffer::create_virtual_team): no communicator.
  explicit PyBuffer(std::unique_ptr<ep::Buffer> buffer) : core_(std::make_shared<BufferCore>()) {
    core_->device = buffer->device();
    DeviceGuard guard(core_->device);
    adopt(std::move(buffer));
  }
  ~PyBuffer() {
    nb::gil_scoped_release release;
    core_.reset();
  }
  PyBuffer(const PyBuffer&) = delete;
  PyBuffer& operator=(const PyBuffer&) = delete;

  // Frees the window now (after the work queued on the device): views of it are invalid after.
  void destroy() {
    nb::gil_scoped_release release;
    core_->release();
  }

  // A DLPack capsule of num_bytes of the window at data; it keeps the window alive.
  nb::object window_bytes(std::uintptr_t data, int64_t num_bytes) {
    live();
    return device_bytes_capsule(data, num_bytes, core_->device, core_);
  }

  // With `copy` (a dispatch made with hold, its owned tensors made before the launch), the
  // copy-out in the same call, so the GPU does not wait for the host between the two kernels:
  // without read_counts right behind the dispatch (copy->num_rows as given); with read_counts
  // once the count is out (published while the rows still move) and only where it fits
  // copy->num_rows, the rows every target array holds: then copy->num_rows is set to the count.
  // DispatchOut::copied says whether it ran; where not (the count exceeds the tensors, or some
  // rank's T exceeded max_tokens), the call stays held for the caller's own copy_out.
  // The arguments are taken by value: the Python layer reuses its argument objects across calls,
  // and this call reads them with the GIL released.
  DispatchOut dispatch(const DispatchArgs a, const std::optional<HandleTuple>& handle_tuple,
                       std::optional<CopyOutArgs> copy) {
    ep::Buffer& b = live();
    WEFT_CHECK(a.count_alignment >= 1, "count_alignment must be >= 1, got ", a.count_alignment);
    WEFT_CHECK(!copy || a.hold, "a dispatch given a copy-out must be made with hold");
    WEFT_CHECK(!a.wait_later || (a.read_counts && a.hold && !copy),
               "wait_later needs read_counts and hold, and takes its copy-out in finish_dispatch");
    std::optional<ep::Handle> handle_value;
    if (handle_tuple) handle_value = from_tuple(*handle_tuple);
    const ep::Handle* handle = handle_value ? &*handle_value : nullptr;
    const int top_k = b.config().top_k;
    ep::DispatchInputs in;
    in.x = a.x.view();
    in.x_scales = a.x.scales_view();
    if (handle == nullptr) {
      in.topk_idx = {as_ptr(a.topk_idx), a.topk_idx_int64 ? ep::DType::kInt64 : ep::DType::kInt32,
                     a.x.num_tokens, top_k};
      in.topk_weights = {as_ptr(a.topk_weights), ep::DType::kFloat32, a.x.num_tokens, top_k};
    }
    in.handle = handle;
    in.cumulative_local_expert_recv_stats = reinterpret_cast<uint32_t*>(a.stats);
    in.num_sms = a.num_sms;
    in.expand = {.enabled = a.expand, .expert_alignment = a.expert_alignment,
                 .zero_padding = a.zero_padding, .segment_stride = a.segment_stride};
    in.defer_own_rows = a.defer_own_rows;
    in.pointers_checked = a.pointers_checked;
    DispatchOut out;
    pending_.reset();  // a dispatch launched with wait_later and never finished: abandoned
    nb::gil_scoped_release release;  // pacing (pipeline_depth) and the count read wait
    DeviceGuard guard(core_->device);
    const cudaStream_t s = enter(a.stream, a.comm_stream, a.previous_event);
    ep::DispatchResult r =
        b.dispatch(in, s, a.read_counts ? ep::CountMode::kExact : ep::CountMode::kOnDevice);
    const bool counts_published = a.read_counts && handle == nullptr && !a.expand;
    if (a.read_counts) {
      const int num_local = b.config().num_local_experts(b.num_ranks());
      if (!counts_published) {  // the counts come when the kernel ends
        WEFT_CUDA_CHECK(cudaMemcpyAsync(core_->host_counts, r.tokens_per_local_expert,
                                        sizeof(int32_t) * std::size_t(num_local),
                                        cudaMemcpyDeviceToHost, s));
        WEFT_CUDA_CHECK(cudaEventRecord(core_->counts_event, s));
      }
      if (!a.hold) leave(a.stream, a.comm_stream, a.async_finish);
      if (a.wait_later) {
        pending_ = PendingCounts{r, s, a.count_alignment};
      } else {
        read_counts(r, s, a.count_alignment, copy, out);
      }
    } else if (copy) {
      run_copy_out(*copy, s);
      out.copied = true;
    } else if (!a.hold) {
      leave(a.stream, a.comm_stream, a.async_finish);
    }
    set_window_fields(r, out);
    return out;
  }

  // The rest of a dispatch launched with wait_later: the wait for its counts and, with copy, the
  // copy-out once they are out, where they fit (as dispatch does with copy). A failure leaves
  // the call held, as dispatch's does: the caller hands its stream back.
  DispatchOut finish_dispatch(std::optional<CopyOutArgs> copy) {
    live();
    WEFT_CHECK(pending_.has_value(),
               "finish_dispatch: no dispatch launched with wait_later is waiting for its counts");
    PendingCounts p = *pending_;
    pending_.reset();
    DispatchOut out;
    nb::gil_scoped_release release;  // the count read wait
    DeviceGuard guard(core_->device);
    read_counts(p.result, p.stream, p.count_alignment, copy, out);
    set_window_fields(p.result, out);
    return out;
  }

  // DeepEP's low_latency_dispatch: one kernel (the fp8 cast on the way, the fixed-stride
  // expanded dispatch, the low-latency results), launched as enter_low_latency says. The
  // pointers come from tensors the Python layer checked (pointers_checked).
  DispatchOut low_latency_dispatch(const LowLatencySlot& slot, std::uintptr_t x,
                                   int64_t num_tokens, std::uintptr_t topk_idx,
                                   bool topk_idx_int64, std::uintptr_t stats,
                                   std::uintptr_t stream, std::uintptr_t previous_stream,
                                   int flags) {
    ep::Buffer& b = live();
    const ep::BufferConfig& c = b.config();
    ep::DispatchInputs in;
    in.x = {as_ptr(x), ep::DType::kBFloat16, num_tokens, c.hidden};
    in.cast_to_fp8 = {.enabled = (flags & kLowLatencyFp8) != 0,
                      .round_scale = (flags & kLowLatencyRoundScale) != 0};
    in.topk_idx = {as_ptr(topk_idx), topk_idx_int64 ? ep::DType::kInt64 : ep::DType::kInt32,
                   num_tokens, c.top_k};
    in.topk_weights = {as_ptr(slot.topk_weights), ep::DType::kFloat32, num_tokens, c.top_k};
    in.cumulative_local_expert_recv_stats = reinterpret_cast<uint32_t*>(stats);
    in.expand = {.enabled = true, .expert_alignment = 1, .zero_padding = false,
                 .segment_stride = slot.segment_stride};
    ep::LowLatencyTargets t;
    t.src_info = reinterpret_cast<int32_t*>(slot.src_info);
    t.layout_range = reinterpret_cast<int64_t*>(slot.layout_range);
    if ((flags & kLowLatencyUe8m0) != 0) {
      t.ue8m0 = reinterpret_cast<int32_t*>(slot.ue8m0);
    } else if ((flags & kLowLatencyFp8) != 0) {
      t.scales = reinterpret_cast<float*>(slot.scales);
    }
    in.low_latency = &t;
    in.pointers_checked = true;
    DispatchOut out;
    // The GIL stays held: nothing here waits (the windows' Buffers have no pipeline_depth).
    DeviceGuard guard(core_->device);
    const cudaStream_t s = enter_low_latency(stream, slot.comm_stream, previous_stream, flags);
    ep::DispatchResult r;
    try {
      r = b.dispatch(in, s, ep::CountMode::kOnDevice);
    } catch (...) {
      leave_low_latency(stream, slot.comm_stream, flags);
      throw;
    }
    set_window_fields(r, out);
    return out;
  }

  // DeepEP's low_latency_combine: the weighted expanded combine of the handle's layout into out
  // [T, hidden] bf16, launched as enter_low_latency says; pointers as low_latency_dispatch's.
  void low_latency_combine(const LowLatencySlot& slot, std::uintptr_t expert_out,
                           int64_t expert_out_rows, std::uintptr_t source_weights,
                           std::uintptr_t out, const HandleTuple& handle_tuple,
                           std::uintptr_t stream, std::uintptr_t previous_stream, int flags) {
    ep::Buffer& b = live();
    const ep::Handle handle = from_tuple(handle_tuple);
    const int64_t hidden = b.config().hidden;
    ep::CombineInputs in;
    in.expert_out = {as_ptr(expert_out), ep::DType::kBFloat16, expert_out_rows, hidden};
    in.source_weights = {as_ptr(source_weights), ep::DType::kFloat32, handle.num_tokens,
                         b.config().top_k};
    in.pointers_checked = true;
    DeviceGuard guard(core_->device);
    const cudaStream_t s = enter_low_latency(stream, slot.comm_stream, previous_stream, flags);
    try {
      b.combine(in, handle, reinterpret_cast<void*>(out), s);
    } catch (...) {
      leave_low_latency(stream, slot.comm_stream, flags);
      throw;
    }
  }

  void combine(const CombineArgs a, const HandleTuple& handle_tuple) {  // by value, as dispatch's
    ep::Buffer& b = live();
    const ep::Handle handle = from_tuple(handle_tuple);
    const int64_t hidden = b.config().hidden;
    const int64_t T = handle.num_tokens;
    ep::CombineInputs in;
    in.expert_out = {as_ptr(a.expert_out), ep::DType::kBFloat16, a.expert_out_rows, hidden};
    if (a.bias0 != 0) in.bias0 = {as_ptr(a.bias0), ep::DType::kBFloat16, T, hidden};
    if (a.bias1 != 0) in.bias1 = {as_ptr(a.bias1), ep::DType::kBFloat16, T, hidden};
    if (a.topk_weights_cols > 0) {
      in.topk_weights = {as_ptr(a.topk_weights), ep::DType::kFloat32, a.topk_weights_rows,
                         a.topk_weights_cols};
      in.combined_weights = reinterpret_cast<float*>(a.combined_weights);
    }
    if (a.source_weights != 0) {
      in.source_weights = {as_ptr(a.source_weights), ep::DType::kFloat32, T, b.config().top_k};
    }
    in.num_sms = a.num_sms;
    in.pointers_checked = a.pointers_checked;
    nb::gil_scoped_release release;  // pacing (pipeline_depth)
    DeviceGuard guard(core_->device);
    const cudaStream_t s = enter(a.stream, a.comm_stream, a.previous_event);
    b.combine(in, handle, reinterpret_cast<void*>(a.out), s);
    leave(a.stream, a.comm_stream, a.async_finish);
  }

  // The owned copies that end a dispatch made with hold (DeepEP's owned results), then the
  // stream hand-off back to `stream`.
  void copy_out(const CopyOutArgs a) {  // by value, as dispatch's
    live();
    nb::gil_scoped_release release;
    DeviceGuard guard(core_->device);
    run_copy_out(a, a.comm_stream != 0 ? as_stream(a.comm_stream) : as_stream(a.stream));
  }

  // copy_out's launch on s (where the held dispatch ran) and the hand-off back; a refusal hands
  // back too (the caller's stream must not run ahead of the kernels that read its inputs) and
  // propagates.
  void run_copy_out(const CopyOutArgs& a, cudaStream_t s) {
    ep::Buffer& b = live();
    ep::CopyOutTargets t;
    t.num_rows = a.num_rows;
    t.x = reinterpret_cast<void*>(a.x);
    t.x_scales = reinterpret_cast<float*>(a.x_scales);
    t.src = reinterpret_cast<int32_t*>(a.src);
    t.pad_token = a.pad_token;
    t.topk_idx = reinterpret_cast<void*>(a.topk_idx);
    t.topk_idx_int64 = a.topk_idx_int64;
    t.topk_weights = reinterpret_cast<float*>(a.topk_weights);
    t.num_topk = a.num_topk;
    t.rank_prefix_matrix = reinterpret_cast<int32_t*>(a.rank_prefix_matrix);
    t.deferred_own_rows = a.deferred_own_rows;
    t.pointers_checked = a.pointers_checked;
    if (a.deferred_own_rows) {
      t.own_x = a.own_x.view();
      t.own_x_scales = a.own_x.scales_view();
    }
    try {
      b.copy_out(t, s);
    } catch (...) {
      leave(a.stream, a.comm_stream, false);
      throw;
    }
    leave(a.stream, a.comm_stream, a.async_finish);
  }

  // The stream hand-off of a call that the Python layer composes of several launches (DeepEP's
  // owned results): comm_stream waits for previous_event or `stream`'s queued work; later
  // `stream` waits for comm_stream's queued work.
  void enter_comm(std::uintptr_t stream, std::uintptr_t comm_stream,
                  std::uintptr_t previous_event) {
    live();
    DeviceGuard guard(core_->device);
    enter(stream, comm_stream, previous_event);
  }
  // Also abandons a dispatch launched with wait_later (a failed call hands its stream back so).
  void leave_comm(std::uintptr_t stream, std::uintptr_t comm_stream) {
    live();
    pending_.reset();
    DeviceGuard guard(core_->device);
    leave(stream, comm_stream, false);
  }

  // Throws the device error recorded by a completed call, if any.
  void check() {
    ep::Buffer& b = live();
    DeviceGuard guard(core_->device);
    b.check();
  }

  int device() const { return core_->device; }
  const ep::Buffer& buffer() const {
    WEFT_CHECK(core_->buffer != nullptr, "this weft.ep Buffer was destroyed");
    return *core_->buffer;
  }
  bool alive() const { return core_->buffer != nullptr; }

 private:
  ep::Buffer& live() {
    WEFT_CHECK(core_->buffer != nullptr, "this weft.ep Buffer was destroyed");
    return *core_->buffer;
  }

  // The stream a call runs on: `stream`, or comm_stream ordered after previous_event or else
  // after the work queued so far on `stream` (DeepEP's previous_event).
  cudaStream_t enter(std::uintptr_t stream, std::uintptr_t comm_stream,
                     std::uintptr_t previous_event) {
    if (comm_stream == 0) return as_stream(stream);
    cudaEvent_t event = reinterpret_cast<cudaEvent_t>(previous_event);
    if (event == nullptr) {
      event = core_->entry_event;
      WEFT_CUDA_CHECK(cudaEventRecord(event, as_stream(stream)));
    }
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(as_stream(comm_stream), event, 0));
    return as_stream(comm_stream);
  }

  // The stream a low-latency call launches on: `stream` itself, or with kLowLatencyOnComm
  // comm_stream after the work queued so far on `stream`; with kLowLatencyAfter also after the
  // work queued on previous_stream, the stream of the previous low-latency call of either window
  // of the Buffer (the Python layer's record: every rank must run the windows' kernels in one
  // order, and a window's calls must not overlap), which must still exist. A plain call on the
  // previous call's stream thus costs no stream operation. A stream being captured into a CUDA
  // graph does not wait for one that is not (a capture cannot; the graph's replays are ordered by
  // the stream that launches them); a call outside a capture whose previous call's stream is
  // still being captured is refused.
  cudaStream_t enter_low_latency(std::uintptr_t stream, std::uintptr_t comm_stream,
                                 std::uintptr_t previous_stream, int flags) {
    const bool on_comm = (flags & kLowLatencyOnComm) != 0;
    const cudaStream_t launch = as_stream(on_comm ? comm_stream : stream);
    const cudaStream_t previous = as_stream(previous_stream);
    if ((flags & kLowLatencyAfter) != 0 && previous != launch &&
        !(on_comm && previous == as_stream(stream))) {
      const bool launch_captured = capturing(launch);
      const bool previous_captured = previous != nullptr && capturing(previous);
      WEFT_CHECK(launch_captured || !previous_captured,
                 "low-latency call: the Buffer's previous low-latency call was captured on a "
                 "stream whose capture has not ended; end it (or make this call in it) first");
      if (launch_captured == previous_captured) {
        WEFT_CUDA_CHECK(cudaEventRecord(core_->exit_event, previous));
        WEFT_CUDA_CHECK(cudaStreamWaitEvent(launch, core_->exit_event, 0));
      }
    }
    if (on_comm) enter(stream, comm_stream, 0);
    return launch;
  }

  static bool capturing(cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    WEFT_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
    return status != cudaStreamCaptureStatusNone;
  }

  // A refused low-latency call: `stream` follows what enter_low_latency queued on comm_stream
  // (a capture's fork stays joined).
  void leave_low_latency(std::uintptr_t stream, std::uintptr_t comm_stream, int flags) {
    if ((flags & kLowLatencyOnComm) != 0) leave(stream, comm_stream, false);
  }

  // Orders `stream` after the call on comm_stream, unless async_finish (the caller then orders
  // its streams with an event recorded on comm_stream).
  void leave(std::uintptr_t stream, std::uintptr_t comm_stream, bool async_finish) {
    if (comm_stream == 0 || async_finish) return;
    WEFT_CUDA_CHECK(cudaEventRecord(core_->exit_event, as_stream(comm_stream)));
    WEFT_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), core_->exit_event, 0));
  }

  // Waits for the counts of r (a dispatch made with read_counts, on s) into out; with copy, the
  // copy-out as soon as they are out, where they fit copy->num_rows (then set to the count).
  void read_counts(ep::DispatchResult& r, cudaStream_t s, int count_alignment,
                   std::optional<CopyOutArgs>& copy, DispatchOut& out) {
    ep::Buffer& b = live();
    const int num_local = b.config().num_local_experts(b.num_ranks());
    b.wait_num_recv(r);
    if (copy && r.tokens_required == 0 && r.num_recv <= copy->num_rows) {
      copy->num_rows = r.num_recv;
      run_copy_out(*copy, s);
      out.copied = true;
    }
    const int32_t* counts = r.tokens_per_local_expert_host;
    if (counts == nullptr) {
      WEFT_CUDA_CHECK(cudaEventSynchronize(core_->counts_event));
      counts = core_->host_counts;
    }
    out.num_recv = r.num_recv;
    out.rows_required = r.rows_required;
    out.tokens_required = r.tokens_required;
    out.tokens_per_local_expert.assign(counts, counts + num_local);
    if (count_alignment > 1) {
      for (int64_t& c : out.tokens_per_local_expert) {
        c = (c + count_alignment - 1) / count_alignment * count_alignment;
      }
    }
  }

  // Takes the Buffer and makes the host-side objects of its calls (on its device).
  void adopt(std::unique_ptr<ep::Buffer> buffer) {
    const int num_local = buffer->config().num_local_experts(buffer->num_ranks());
    core_->buffer = std::move(buffer);
    WEFT_CUDA_CHECK(cudaMallocHost(&core_->host_counts, sizeof(int32_t) * std::size_t(num_local)));
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&core_->counts_event, cudaEventDisableTiming));
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&core_->entry_event, cudaEventDisableTiming));
    WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&core_->exit_event, cudaEventDisableTiming));
  }

  std::shared_ptr<BufferCore> core_;
  // A dispatch launched with wait_later, until finish_dispatch.
  struct PendingCounts {
    ep::DispatchResult result;
    cudaStream_t stream = nullptr;
    int count_alignment = 1;
  };
  std::optional<PendingCounts> pending_;
};

// num_ranks simulated ranks on the current device (docs/ep.md "Virtual team"), one Buffer each.
std::vector<PyBuffer*> virtual_team(int num_ranks, const ep::BufferConfig& config,
                                    const ep::BufferOptions& options) {
  std::vector<std::unique_ptr<ep::Buffer>> buffers;
  {
    nb::gil_scoped_release release;
    buffers = ep::Buffer::create_virtual_team(num_ranks, config, options);
  }
  std::vector<PyBuffer*> team;
  for (auto& b : buffers) team.push_back(new PyBuffer(std::move(b)));
  return team;
}

}  // namespace

void bind_ep(nb::module_& m) {
  m.def("unique_id", &unique_id, "A new NCCL unique id (bytes) for a Communicator.");
  m.def(
      "virtual_team",
      [](int num_ranks, int64_t max_tokens, int64_t hidden, int num_experts, int top_k,
         int expand_factor, int num_sms, int tokens_per_block, double timeout_s) {
        ep::BufferOptions options;
        options.num_sms = num_sms;
        options.tokens_per_block = tokens_per_block;
        options.timeout_s = timeout_s;
        return virtual_team(num_ranks, {max_tokens, hidden, num_experts, top_k, expand_factor},
                            options);
      },
      nb::arg("num_ranks"), nb::kw_only(), nb::arg("max_tokens"), nb::arg("hidden"),
      nb::arg("num_experts"), nb::arg("top_k"), nb::arg("expand_factor"), nb::arg("num_sms"),
      nb::arg("tokens_per_block"), nb::arg("timeout_s"), nb::rv_policy::take_ownership,
      "num_ranks Buffers of one virtual team on the current device (one process, one GPU).");
  m.def("virtual_team_num_sms", &ep::Buffer::virtual_team_num_sms, nb::arg("num_ranks"),
        nb::arg("device"), "The most blocks a virtual team member's kernel may take.");
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
  m.def(
      "all_to_all_layout",
      [](std::uintptr_t topk_idx, ep::DType idx_dtype, int64_t num_tokens, int top_k,
         int num_ranks, int64_t num_local_experts, std::uintptr_t sizes, std::uintptr_t order,
         std::uintptr_t mine, std::uintptr_t send_idx, std::uintptr_t stream, int device) {
        ep::AllToAllLayoutParams p;
        p.topk_idx = reinterpret_cast<const void*>(topk_idx);
        p.idx_dtype = idx_dtype;
        p.num_tokens = num_tokens;
        p.top_k = top_k;
        p.num_ranks = num_ranks;
        p.num_local_experts = num_local_experts;
        p.sizes = reinterpret_cast<int64_t*>(sizes);
        p.order = reinterpret_cast<int64_t*>(order);
        p.mine = reinterpret_cast<uint8_t*>(mine);
        p.send_idx = reinterpret_cast<void*>(send_idx);
        DeviceGuard guard(device);
        ep::all_to_all_layout(p, reinterpret_cast<cudaStream_t>(stream));
      },
      nb::arg("topk_idx"), nb::arg("idx_dtype"), nb::arg("num_tokens"), nb::arg("top_k"),
      nb::arg("num_ranks"), nb::arg("num_local_experts"), nb::arg("sizes"), nb::arg("order"),
      nb::arg("mine"), nb::arg("send_idx"), nb::arg("stream"), nb::arg("device"),
      "Enqueues the all_to_all dispatcher's layout kernel on stream (a cudaStream_t as an int, "
      "of device); the arrays are device addresses (weft/ep/all_to_all_layout.hpp).");
  m.attr("MAX_ALL_TO_ALL_LAYOUT_RANKS") = ep::kMaxAllToAllLayoutRanks;

  nb::enum_<ep::DType>(m, "DType")
      .value("bfloat16", ep::DType::kBFloat16)
      .value("float32", ep::DType::kFloat32)
      .value("int32", ep::DType::kInt32)
      .value("int64", ep::DType::kInt64)
      .value("uint8", ep::DType::kUInt8);

  nb::class_<TokenRowsArg>(m, "TokenRows")
      .def(nb::init<>())
      .def_rw("data", &TokenRowsArg::data)
      .def_rw("dtype", &TokenRowsArg::dtype)
      .def_rw("num_tokens", &TokenRowsArg::num_tokens)
      .def_rw("cols", &TokenRowsArg::cols)
      .def_rw("scales", &TokenRowsArg::scales)
      .def_rw("scales_token_stride", &TokenRowsArg::scales_token_stride)
      .def_rw("scales_group_stride", &TokenRowsArg::scales_group_stride);

  nb::class_<DispatchArgs>(m, "DispatchArgs")
      .def(nb::init<>())
      .def_rw("x", &DispatchArgs::x)
      .def_rw("hold", &DispatchArgs::hold)
      .def_rw("wait_later", &DispatchArgs::wait_later)
      .def_rw("defer_own_rows", &DispatchArgs::defer_own_rows)
      .def_rw("topk_idx", &DispatchArgs::topk_idx)
      .def_rw("topk_idx_int64", &DispatchArgs::topk_idx_int64)
      .def_rw("topk_weights", &DispatchArgs::topk_weights)
      .def_rw("stats", &DispatchArgs::stats)
      .def_rw("num_sms", &DispatchArgs::num_sms)
      .def_rw("expand", &DispatchArgs::expand)
      .def_rw("expert_alignment", &DispatchArgs::expert_alignment)
      .def_rw("zero_padding", &DispatchArgs::zero_padding)
      .def_rw("segment_stride", &DispatchArgs::segment_stride)
      .def_rw("read_counts", &DispatchArgs::read_counts)
      .def_rw("count_alignment", &DispatchArgs::count_alignment)
      .def_rw("stream", &DispatchArgs::stream)
      .def_rw("comm_stream", &DispatchArgs::comm_stream)
      .def_rw("previous_event", &DispatchArgs::previous_event)
      .def_rw("async_finish", &DispatchArgs::async_finish)
      .def_rw("pointers_checked", &DispatchArgs::pointers_checked);

  nb::class_<CopyOutArgs>(m, "CopyOutArgs")
      .def(nb::init<>())
      .def_rw("num_rows", &CopyOutArgs::num_rows)
      .def_rw("x", &CopyOutArgs::x)
      .def_rw("x_scales", &CopyOutArgs::x_scales)
      .def_rw("src", &CopyOutArgs::src)
      .def_rw("pad_token", &CopyOutArgs::pad_token)
      .def_rw("topk_idx", &CopyOutArgs::topk_idx)
      .def_rw("topk_idx_int64", &CopyOutArgs::topk_idx_int64)
      .def_rw("topk_weights", &CopyOutArgs::topk_weights)
      .def_rw("num_topk", &CopyOutArgs::num_topk)
      .def_rw("rank_prefix_matrix", &CopyOutArgs::rank_prefix_matrix)
      .def_rw("deferred_own_rows", &CopyOutArgs::deferred_own_rows)
      .def_rw("own_x", &CopyOutArgs::own_x)
      .def_rw("stream", &CopyOutArgs::stream)
      .def_rw("comm_stream", &CopyOutArgs::comm_stream)
      .def_rw("async_finish", &CopyOutArgs::async_finish)
      .def_rw("pointers_checked", &CopyOutArgs::pointers_checked);

  nb::class_<LowLatencySlot>(m, "LowLatencySlot")
      .def(nb::init<>())
      .def_rw("topk_weights", &LowLatencySlot::topk_weights)
      .def_rw("segment_stride", &LowLatencySlot::segment_stride)
      .def_rw("src_info", &LowLatencySlot::src_info)
      .def_rw("layout_range", &LowLatencySlot::layout_range)
      .def_rw("scales", &LowLatencySlot::scales)
      .def_rw("ue8m0", &LowLatencySlot::ue8m0)
      .def_rw("comm_stream", &LowLatencySlot::comm_stream);
  m.attr("LOW_LATENCY_FP8") = int(kLowLatencyFp8);
  m.attr("LOW_LATENCY_ROUND_SCALE") = int(kLowLatencyRoundScale);
  m.attr("LOW_LATENCY_UE8M0") = int(kLowLatencyUe8m0);
  m.attr("LOW_LATENCY_ON_COMM") = int(kLowLatencyOnComm);
  m.attr("LOW_LATENCY_AFTER") = int(kLowLatencyAfter);

  nb::class_<CombineArgs>(m, "CombineArgs")
      .def(nb::init<>())
      .def_rw("expert_out", &CombineArgs::expert_out)
      .def_rw("expert_out_rows", &CombineArgs::expert_out_rows)
      .def_rw("bias0", &CombineArgs::bias0)
      .def_rw("bias1", &CombineArgs::bias1)
      .def_rw("out", &CombineArgs::out)
      .def_rw("topk_weights", &CombineArgs::topk_weights)
      .def_rw("topk_weights_rows", &CombineArgs::topk_weights_rows)
      .def_rw("topk_weights_cols", &CombineArgs::topk_weights_cols)
      .def_rw("combined_weights", &CombineArgs::combined_weights)
      .def_rw("source_weights", &CombineArgs::source_weights)
      .def_rw("num_sms", &CombineArgs::num_sms)
      .def_rw("stream", &CombineArgs::stream)
      .def_rw("comm_stream", &CombineArgs::comm_stream)
      .def_rw("previous_event", &CombineArgs::previous_event)
      .def_rw("async_finish", &CombineArgs::async_finish)
      .def_rw("pointers_checked", &CombineArgs::pointers_checked);

  nb::class_<DispatchOut>(m, "DispatchOut")
      .def_prop_ro("handle", [](const DispatchOut& o) { return to_tuple(o.handle); })
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
      .def_ro("rank_prefix_matrix", &DispatchOut::rank_prefix_matrix)
      .def_ro("tokens_required", &DispatchOut::tokens_required)
      .def_ro("row_bytes", &DispatchOut::row_bytes)
      .def_ro("capacity", &DispatchOut::capacity)
      .def_ro("copied", &DispatchOut::copied);

  nb::class_<PyCommunicator>(m, "Communicator")
      .def(nb::init<nb::bytes, int, int, int>(), nb::arg("unique_id"), nb::arg("num_ranks"),
           nb::arg("rank"), nb::arg("device"))
      .def("destroy", &PyCommunicator::destroy)
      .def_prop_ro("num_ranks", &PyCommunicator::num_ranks)
      .def_prop_ro("rank", &PyCommunicator::rank)
      .def_prop_ro("device", &PyCommunicator::device)
      .def_prop_ro("alive", &PyCommunicator::alive);

  nb::class_<PyBuffer>(m, "Buffer")
      .def(
          "__init__",
          [](PyBuffer* self, const PyCommunicator& communicator, int64_t max_tokens,
             int64_t hidden, int num_experts, int top_k, int expand_factor, int num_sms,
             int tokens_per_block, double timeout_s, int pipeline_depth) {
            ep::BufferOptions options;
            options.num_sms = num_sms;
            options.tokens_per_block = tokens_per_block;
            options.timeout_s = timeout_s;
            options.pipeline_depth = pipeline_depth;
            new (self) PyBuffer(communicator,
                                {max_tokens, hidden, num_experts, top_k, expand_factor}, options);
          },
          nb::arg("communicator"), nb::kw_only(), nb::arg("max_tokens"), nb::arg("hidden"),
          nb::arg("num_experts"), nb::arg("top_k"), nb::arg("expand_factor"), nb::arg("num_sms"),
          nb::arg("tokens_per_block"), nb::arg("timeout_s"), nb::arg("pipeline_depth"))
      .def("destroy", &PyBuffer::destroy)
      .def("window_bytes", &PyBuffer::window_bytes, nb::arg("data"), nb::arg("num_bytes"))
      .def("dispatch", &PyBuffer::dispatch, nb::arg("args"), nb::arg("handle").none(),
           nb::arg("copy").none() = nb::none())
      .def("finish_dispatch", &PyBuffer::finish_dispatch, nb::arg("copy").none() = nb::none())
      .def("combine", &PyBuffer::combine, nb::arg("args"), nb::arg("handle"))
      .def("copy_out", &PyBuffer::copy_out, nb::arg("args"))
      .def("low_latency_dispatch", &PyBuffer::low_latency_dispatch, nb::arg("slot"),
           nb::arg("x"), nb::arg("num_tokens"), nb::arg("topk_idx"), nb::arg("topk_idx_int64"),
           nb::arg("stats"), nb::arg("stream"), nb::arg("previous_stream"), nb::arg("flags"))
      .def("low_latency_combine", &PyBuffer::low_latency_combine, nb::arg("slot"),
           nb::arg("expert_out"), nb::arg("expert_out_rows"), nb::arg("source_weights"),
           nb::arg("out"), nb::arg("handle"), nb::arg("stream"), nb::arg("previous_stream"),
           nb::arg("flags"))
      .def("enter_comm", &PyBuffer::enter_comm, nb::arg("stream"), nb::arg("comm_stream"),
           nb::arg("previous_event"))
      .def("leave_comm", &PyBuffer::leave_comm, nb::arg("stream"), nb::arg("comm_stream"))
      .def("check", &PyBuffer::check)
      .def_prop_ro("device", &PyBuffer::device)
      .def_prop_ro("alive", &PyBuffer::alive)
      .def_prop_ro("rank", [](const PyBuffer& b) { return b.buffer().rank(); })
      .def_prop_ro("num_ranks", [](const PyBuffer& b) { return b.buffer().num_ranks(); })
      .def_prop_ro("capacity", [](const PyBuffer& b) { return b.buffer().capacity(); })
      .def_prop_ro("expand_capacity",
                   [](const PyBuffer& b) { return b.buffer().expand_capacity(); })
      .def_prop_ro("max_tokens", [](const PyBuffer& b) { return b.buffer().config().max_tokens; })
      .def_prop_ro("hidden", [](const PyBuffer& b) { return b.buffer().config().hidden; })
      .def_prop_ro("num_experts",
                   [](const PyBuffer& b) { return b.buffer().config().num_experts; })
      .def_prop_ro("top_k", [](const PyBuffer& b) { return b.buffer().config().top_k; })
      .def_prop_ro("expand_factor",
                   [](const PyBuffer& b) { return b.buffer().config().expand_factor; });
}

}  // namespace weft::python
