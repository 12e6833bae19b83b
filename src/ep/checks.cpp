#include "checks.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "weft/core/error.hpp"

namespace weft::ep {
namespace detail {
namespace {

const char* memory_type_name(cudaMemoryType type) {
  switch (type) {
    case cudaMemoryTypeUnregistered: return "host (not registered with CUDA)";
    case cudaMemoryTypeHost: return "pinned host";
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeManaged: return "managed";
  }
  return "unknown";
}

}  // namespace

void check_view(const TensorView& v, const char* name, std::initializer_list<DType> dtypes,
                int64_t rows, int64_t cols) {
  bool dtype_ok = false;
  std::string allowed;
  for (DType d : dtypes) {
    dtype_ok |= v.dtype == d;
    allowed += allowed.empty() ? dtype_name(d) : std::string(" or ") + dtype_name(d);
  }
  WEFT_CHECK(dtype_ok, name, " must be ", allowed, ", got ", dtype_name(v.dtype));
  WEFT_CHECK(v.rows == rows && v.cols == cols, name, " must be [", rows, ", ", cols, "], got [",
             v.rows, ", ", v.cols, "]");
  WEFT_CHECK(rows == 0 || v.data != nullptr, name, " is null");
}

PointerHome pointer_home(const BufferGroup& group, std::size_t index, int device, bool vouched) {
  return {device, group.team->window(index), group.team->window_bytes(), vouched};
}

void check_pointer(const void* p, const char* name, const PointerHome& home,
                   std::size_t alignment) {
  if (p == nullptr) return;
  WEFT_CHECK(reinterpret_cast<uintptr_t>(p) % alignment == 0, name, " must be ", alignment,
             "-byte aligned, got address ", p);
  const auto* byte = static_cast<const char*>(p);
  if (home.vouched) return;
  if (byte >= home.window && byte < home.window + home.window_bytes) return;
  const int device = home.device;
  cudaPointerAttributes a{};
  const cudaError_t status = cudaPointerGetAttributes(&a, p);
  if (status != cudaSuccess) {
    cudaGetLastError();  // the failed query must not surface as the next launch's error
    WEFT_FAIL(name, " (", p, ") is no memory CUDA knows: ", cudaGetErrorString(status));
  }
  WEFT_CHECK(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged, name, " (", p,
             ") is ", memory_type_name(a.type), " memory; it must be device memory of device ",
             device);
  WEFT_CHECK(a.type == cudaMemoryTypeManaged || a.device == device, name, " (", p,
             ") is memory of device ", a.device, ", not of the Buffer's device ", device);
}

void check_handle(const Handle& h, const Handle& layout, uint64_t buffer_id, const char* call) {
  WEFT_CHECK(h.buffer_id == buffer_id, call, ": the handle is from another Buffer");
  WEFT_CHECK(h.sequence == layout.sequence, call, ": the handle is stale (its layout is dispatch ",
             h.sequence, "'s, but the layout in place is dispatch ", layout.sequence, "'s)");
  WEFT_CHECK(h.num_tokens == layout.num_tokens && h.expand == layout.expand &&
                 (h.num_recv < 0 || h.num_recv == layout.num_recv) &&
                 (h.tokens_required < 0 || h.tokens_required == layout.tokens_required),
             call, ": the handle does not match the layout of dispatch ", layout.sequence,
             " (num_tokens ", h.num_tokens, " for ", layout.num_tokens, ", num_recv ", h.num_recv,
             " for ", layout.num_recv, ", expand ", h.expand.enabled, " for ",
             layout.expand.enabled, "); a Handle must be used as the dispatch returned it");
}

}  // namespace detail

void Buffer::refuse_overflowed_layout(const Handle& layout, const char* call) const {
  // Known here from this rank's own T, or (any rank's) from wait_num_recv. A rank that does not
  // know launches the call, which its kernel skips without advancing the call number
  // (kErrOverflowedLayout), so refusing here keeps the ranks in step.
  WEFT_CHECK(layout.num_tokens <= config_.max_tokens && layout.tokens_required <= 0, call,
             ": the dispatch of this layout (", layout.sequence, ") moved no rows because a rank's ",
             "T exceeded max_tokens ", config_.max_tokens, " (this rank's T ", layout.num_tokens,
             ", tokens_required ", layout.tokens_required, ", -1: not waited for); rebuild the ",
             "Buffers with max_tokens >= tokens_required and dispatch again");
}

}  // namespace weft::ep
