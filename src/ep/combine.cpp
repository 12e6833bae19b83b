// Buffer::combine, and the send-warp count it scales by the number of ranks.
#include <algorithm>

#include "buffer_state.hpp"
#include "checks.hpp"
#include "kernels/params.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_guard.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep {

using cuda::DeviceGuard;

int combine_send_warps(int send_warps_at_two_ranks, int num_ranks) {
  if (num_ranks < 2) return send_warps_at_two_ranks;
  const int scaled = (2 * send_warps_at_two_ranks * (num_ranks - 1) + num_ranks / 2) / num_ranks;
  return std::clamp(scaled, 1, detail::kThreads / 32 - 1);
}

void Buffer::combine(const CombineInputs& in, const Handle& handle, void* out,
                     cudaStream_t stream) {
  pace_host();
  throw_if_device_error();
  detail::check_handle(handle, state_->layout, id_, "combine");
  const Handle& layout = state_->layout;  // what the handle was checked to match
  refuse_overflowed_layout(layout, "combine");
  const int64_t T = layout.num_tokens;
  WEFT_CHECK(in.expert_out.dtype == DType::kBFloat16, "expert_out must be bfloat16, got ",
             dtype_name(in.expert_out.dtype));
  WEFT_CHECK(in.expert_out.cols == config_.hidden, "expert_out must have ", config_.hidden,
             " columns, got ", in.expert_out.cols);
  const int64_t rows_allowed = layout.expand.enabled ? expand_capacity() : capacity();
  WEFT_CHECK(in.expert_out.rows >= 0 && in.expert_out.rows <= rows_allowed, "expert_out has ",
             in.expert_out.rows, " rows, at most ", rows_allowed, " allowed");
  WEFT_CHECK(layout.num_recv < 0 || in.expert_out.rows >= layout.num_recv, "expert_out has ",
             in.expert_out.rows, " rows but ", layout.num_recv, " were received");
  WEFT_CHECK(in.expert_out.rows == 0 || in.expert_out.data != nullptr, "expert_out is null");
  const bool with_weights = in.topk_weights.cols != 0;
  if (with_weights) {
    const TensorView& w = in.topk_weights;
    WEFT_CHECK(!layout.expand.enabled, "combine: topk_weights with an expanded layout is not "
               "supported (its rows are per expert; combine the weights of the deduplicated one)");
    WEFT_CHECK(w.dtype == DType::kFloat32, "topk_weights must be float32, got ",
               dtype_name(w.dtype));
    WEFT_CHECK(w.cols >= 1 && w.cols <= config_.top_k, "topk_weights has ", w.cols,
               " columns; K must be in 1..top_k = ", config_.top_k);
    WEFT_CHECK(w.rows >= 0 && w.rows <= rows_allowed, "topk_weights has ", w.rows,
               " rows, at most ", rows_allowed, " allowed");
    WEFT_CHECK(layout.num_recv < 0 || w.rows >= layout.num_recv, "topk_weights has ", w.rows,
               " rows but ", layout.num_recv, " were received");
    WEFT_CHECK(w.rows == 0 || w.data != nullptr, "topk_weights is null");
    WEFT_CHECK(T == 0 || in.combined_weights != nullptr,
               "combined_weights is null but topk_weights is given");
  } else {
    WEFT_CHECK(in.combined_weights == nullptr,
               "combined_weights is given but topk_weights is not (cols == 0)");
  }
  const bool source_weighted = in.source_weights.data != nullptr;
  if (source_weighted) {
    WEFT_CHECK(layout.expand.enabled, "combine: source_weights needs an expanded layout (its rows "
               "are per (token, expert)); the deduplicated one takes topk_weights");
    WEFT_CHECK(in.bias0.data == nullptr && in.bias1.data == nullptr,
               "combine: source_weights takes no bias");
    detail::check_view(in.source_weights, "source_weights", {DType::kFloat32}, T, config_.top_k);
  }
  if (in.bias0.data != nullptr) detail::check_view(in.bias0, "bias0", {DType::kBFloat16}, T, config_.hidden);
  if (in.bias1.data != nullptr) detail::check_view(in.bias1, "bias1", {DType::kBFloat16}, T, config_.hidden);
  WEFT_CHECK(T == 0 || out != nullptr, "out is null");
  const detail::PointerHome home =
      detail::pointer_home(*group_, index_, device_, in.pointers_checked);
  detail::check_pointer(in.expert_out.rows > 0 ? in.expert_out.data : nullptr, "expert_out", home, 16);
  if (T > 0) {
    detail::check_pointer(in.bias0.data, "bias0", home, 16);
    detail::check_pointer(in.bias1.data, "bias1", home, 16);
    detail::check_pointer(out, "out", home, 16);
    detail::check_pointer(in.combined_weights, "combined_weights", home, 4);
  }
  if (source_weighted && T > 0) detail::check_pointer(in.source_weights.data, "source_weights", home, 4);
  if (with_weights && in.topk_weights.rows > 0) {
    detail::check_pointer(in.topk_weights.data, "topk_weights", home, 4);
  }
  DeviceGuard guard(device_);
  detail::CombineParams p{};
  p.comm = detail::comm_params(*group_, rank_, num_ranks_, *state_, options_.timeout_s);
  p.expert_out = static_cast<const uint16_t*>(in.expert_out.data);
  p.expert_out_rows = in.expert_out.rows;
  p.bias0 = static_cast<const uint16_t*>(in.bias0.data);
  p.bias1 = static_cast<const uint16_t*>(in.bias1.data);
  p.out = static_cast<uint16_t*>(out);
  p.num_tokens = T;
  p.hidden = config_.hidden;
  p.max_tokens = config_.max_tokens;
  // The grid follows the rows this rank stores back as well as its tokens (a rank with few
  // tokens may have received many rows): num_recv where the host knows it (wait_num_recv), or a
  // fixed-stride layout's rows (mostly padding, scanned for chain heads, and many times the
  // tokens), else T alone (CountMode::kOnDevice: the count is on the device).
  const int64_t fixed_rows =
      layout.expand.enabled
          ? layout.expand.segment_stride * config_.num_local_experts(num_ranks_) : 0;
  p.num_blocks = num_blocks(std::max({T, layout.num_recv, fixed_rows}), in.num_sms);
  p.send_slot = state_->send_slot;
  p.num_send_warps = combine_send_warps(options_.combine_send_warps, num_ranks_);
  if (with_weights) {
    p.topk_weights = static_cast<const float*>(in.topk_weights.data);
    p.topk_weights_rows = in.topk_weights.rows;
    p.num_weights = int(in.topk_weights.cols);
    p.combined_weights = in.combined_weights;
  }
  p.top_k = config_.top_k;
  p.layout_id = layout.sequence;
  if (layout.expand.enabled) {
    p.num_send_warps = options_.expanded_combine_send_warps;
    p.expand_info = state_->expand_info;
    p.num_local_experts = config_.num_local_experts(num_ranks_);
    p.expand_capacity = expand_capacity();
    p.source_weighted = source_weighted;
    p.sparse_rows = layout.expand.segment_stride > 0;
    p.sparse_heads = state_->sparse_heads;
    p.max_sparse_heads = int64_t(num_ranks_) * config_.max_tokens;
  }
  // The window's comb_w region holds R * max_tokens * top_k floats (>= T * top_k); the expanded
  // combine uses it for nothing else. The kernel copies the weights there itself.
  if (source_weighted) p.source_weights = static_cast<const float*>(in.source_weights.data);
  detail::launch_combine(p, stream);
  note_launched(stream);
}

}  // namespace weft::ep
