// Buffer::low_latency_layout: DeepEP's low_latency_dispatch results from the window rows of the
// latest (fixed-stride expanded) dispatch.
#include "buffer_state.hpp"
#include "checks.hpp"
#include "kernels/params.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/device_guard.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep {

void Buffer::low_latency_layout(const LowLatencyTargets& t, cudaStream_t stream) {
  throw_if_device_error();
  WEFT_CHECK(dispatch_sequence_ > 0, "low_latency_layout: no dispatch has run on this Buffer");
  const ExpandOptions& expand = state_->layout.expand;
  WEFT_CHECK(expand.enabled && expand.segment_stride > 0,
             "low_latency_layout: the latest dispatch must be an expanded one with fixed-stride ",
             "segments (ExpandOptions::segment_stride > 0)");
  refuse_overflowed_layout(state_->layout, "low_latency_layout");
  WEFT_CHECK(t.src_info != nullptr, "low_latency_layout: src_info is null");
  WEFT_CHECK(t.layout_range != nullptr, "low_latency_layout: layout_range is null");
  const bool fp8 = state_->latest_row_bytes != config_.row_bytes();
  WEFT_CHECK(fp8 || (t.scales == nullptr && t.ue8m0 == nullptr),
             "low_latency_layout: scales / ue8m0 need the latest dispatch to have moved fp8 rows");
  const int64_t num_groups = config_.hidden / kFp8GroupElements;
  WEFT_CHECK(t.ue8m0 == nullptr || num_groups % 4 == 0,
             "low_latency_layout: ue8m0 packs 4 scales per int32, but hidden ", config_.hidden,
             " has ", num_groups, " groups of 128");
  const detail::PointerHome home = detail::pointer_home(*group_, index_, device_);
  detail::check_pointer(t.src_info, "low_latency_layout: src_info", home, 4);
  detail::check_pointer(t.layout_range, "low_latency_layout: layout_range", home, 8);
  detail::check_pointer(t.scales, "low_latency_layout: scales", home, 4);
  detail::check_pointer(t.ue8m0, "low_latency_layout: ue8m0", home, 4);
  const auto& layout = group_->layout;
  const char* base = static_cast<const char*>(group_->team->window(index_));
  detail::LowLatencyLayoutParams p{};
  p.recv_src = reinterpret_cast<const int2*>(base + layout.recv_src);
  p.recv_x = base + layout.recv_x;
  p.row_bytes = state_->latest_row_bytes;
  p.hidden = config_.hidden;
  p.num_local_experts = config_.num_local_experts(num_ranks_);
  p.num_ranks = num_ranks_;
  p.segment_stride = expand.segment_stride;
  p.src_info = t.src_info;
  p.layout_range = t.layout_range;
  p.scales = t.scales;
  p.ue8m0 = t.ue8m0;
  cuda::DeviceGuard guard(device_);
  detail::launch_low_latency_layout(p, stream);
}

}  // namespace weft::ep
