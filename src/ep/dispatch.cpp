// Buffer::dispatch (uncached and cached), its count on the host (wait_num_recv), copy_out of
// its rows, and the fp8 cast of dispatch inputs.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>

#include "buffer_state.hpp"
#include "checks.hpp"
#include "kernels/params.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_guard.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep {

using cuda::DeviceGuard;

namespace {

// Bytes per received row of dispatch's x: bf16 [T, hidden], packed fp8 [T, fp8 row_bytes] uint8,
// or the fp8 pair's payload [T, hidden] uint8 with x_scales (packed on the way). The pair is
// told from packed rows by its width (a packed row is wider than hidden), since an empty pair's
// scales may have no address.
int64_t dispatch_row_bytes(const DispatchInputs& in, const BufferConfig& config) {
  const TensorView& x = in.x;
  if (in.cast_to_fp8.enabled) {
    WEFT_CHECK(in.expand.enabled && in.handle == nullptr && in.x_scales.data == nullptr,
               "cast_to_fp8 is for an uncached expanded dispatch of bf16 x (no x_scales)");
    const Fp8RowLayout l = fp8_row_layout(config.hidden);
    detail::check_view(x, "x (cast to fp8)", {DType::kBFloat16}, x.rows, config.hidden);
    return l.row_bytes;
  }
  if (in.x_scales.data != nullptr || (x.dtype == DType::kUInt8 && x.cols == config.hidden)) {
    const Fp8RowLayout l = fp8_row_layout(config.hidden);
    detail::check_view(x, "x (fp8 payload)", {DType::kUInt8}, x.rows, config.hidden);
    WEFT_CHECK(x.rows == 0 || in.x_scales.data != nullptr, "x_scales is null, but x is the fp8 ",
               "payload of ", x.rows, " tokens (a pair needs its scales)");
    WEFT_CHECK(in.x_scales.token_stride >= 0 && in.x_scales.group_stride >= 0,
               "x_scales strides must not be negative, got (", in.x_scales.token_stride, ", ",
               in.x_scales.group_stride, ")");
    return l.row_bytes;
  }
  if (x.dtype == DType::kUInt8) {
    const Fp8RowLayout l = fp8_row_layout(config.hidden);
    detail::check_view(x, "x (packed fp8 rows)", {DType::kUInt8}, x.rows, l.row_bytes);
    // The window's recv_x region is sized for bf16 rows: [cap][2 * hidden] bytes.
    WEFT_CHECK(l.row_bytes <= config.row_bytes(), "fp8 rows of ", l.row_bytes,
               " bytes do not fit the window's ", config.row_bytes(), "-byte rows");
    return l.row_bytes;
  }
  detail::check_view(x, "x", {DType::kBFloat16}, x.rows, config.hidden);
  return config.row_bytes();
}

detail::RowSource row_source(const DispatchInputs& in, int64_t row_bytes, int64_t hidden) {
  return {in.x.data,         row_bytes,
          in.x_scales.data,  hidden,
          in.x_scales.token_stride, in.x_scales.group_stride,
          in.cast_to_fp8.enabled, in.cast_to_fp8.round_scale};
}

// The kernel's LowLatencyOut of a dispatch's LowLatencyTargets (null: none), checked.
detail::ExpandDispatchParams::LowLatencyOut low_latency_out(const DispatchInputs& in,
                                                           const BufferConfig& config,
                                                           int64_t row_bytes,
                                                           const detail::PointerHome& home) {
  const LowLatencyTargets* t = in.low_latency;
  if (t == nullptr) return {};
  WEFT_CHECK(in.expand.enabled && in.expand.segment_stride > 0 && in.handle == nullptr,
             "low_latency targets need an uncached expanded dispatch with fixed-stride segments ",
             "(ExpandOptions::segment_stride > 0)");
  WEFT_CHECK(t->src_info != nullptr, "low_latency: src_info is null");
  WEFT_CHECK(t->layout_range != nullptr, "low_latency: layout_range is null");
  WEFT_CHECK(row_bytes != config.row_bytes() || (t->scales == nullptr && t->ue8m0 == nullptr),
             "low_latency: scales / ue8m0 need a dispatch of fp8 rows");
  const int64_t num_groups = config.hidden / kFp8GroupElements;
  WEFT_CHECK(t->ue8m0 == nullptr || num_groups % 4 == 0,
             "low_latency: ue8m0 packs 4 scales per int32, but hidden ", config.hidden, " has ",
             num_groups, " groups of 128");
  detail::check_pointer(t->src_info, "low_latency: src_info", home, 4);
  detail::check_pointer(t->layout_range, "low_latency: layout_range", home, 8);
  detail::check_pointer(t->scales, "low_latency: scales", home, 4);
  detail::check_pointer(t->ue8m0, "low_latency: ue8m0", home, 4);
  return {t->src_info, t->layout_range, t->scales, t->ue8m0};
}

}  // namespace

DispatchResult Buffer::make_result(int64_t row_bytes, const Handle& handle) const {
  const auto& layout = group_->layout;
  char* base = group_->team->window(index_);
  DispatchResult r;
  if (row_bytes == config_.row_bytes()) {
    r.recv_x = reinterpret_cast<const uint16_t*>(base + layout.recv_x);
  } else {
    r.recv_x_fp8 = reinterpret_cast<const uint8_t*>(base + layout.recv_x);
  }
  r.row_bytes = row_bytes;
  r.recv_expert_idx = reinterpret_cast<const int32_t*>(base + layout.recv_expert_idx);
  r.recv_weights = reinterpret_cast<const float*>(base + layout.recv_weights);
  r.recv_src = reinterpret_cast<const int32_t*>(base + layout.recv_src);
  r.tokens_per_local_expert = state_->tokens_per_local_expert;
  r.num_recv_device = &state_->state->num_recv;
  r.tokens_required_device = &state_->state->tokens_required;
  r.capacity = handle.expand.enabled ? expand_capacity() : capacity();
  if (!handle.expand.enabled) r.rank_prefix_matrix = state_->rank_prefix_matrix;
  if (handle.expand.enabled) {
    r.segment_begin = state_->expand_info;
    r.rows_required_device = state_->expand_info + config_.num_local_experts(num_ranks_);
  }
  r.handle = handle;
  r.num_recv = handle.num_recv;
  r.tokens_required = handle.tokens_required;
  return r;
}

DispatchResult Buffer::dispatch(const DispatchInputs& in, cudaStream_t stream, CountMode mode) {
  pace_host();
  throw_if_device_error();
  const int64_t T = in.x.rows;
  // The deduplicated uncached dispatch takes T above max_tokens (every rank then learns it in
  // the count exchange and moves no row: see DispatchResult::tokens_required), up to int32 rows;
  // the expanded one is refused here; a cached one must have its layout's T (dispatch_cached).
  if (in.handle == nullptr && !in.expand.enabled) {
    WEFT_CHECK(T >= 0 && T <= kMaxDispatchTokens, "dispatch of ", T, " tokens: at most ",
               kMaxDispatchTokens, " (int32 rows)");
  } else if (in.handle == nullptr) {
    WEFT_CHECK(T >= 0 && T <= config_.max_tokens, "expanded dispatch of ", T,
               " tokens, but the buffer was sized for at most ", config_.max_tokens,
               " (only the deduplicated dispatch reports tokens_required instead)");
  }
  const int64_t row_bytes = dispatch_row_bytes(in, config_);
  const detail::PointerHome home =
      detail::pointer_home(*group_, index_, device_, in.pointers_checked);
  detail::check_pointer(T > 0 ? in.x.data : nullptr, "x", home, 16);
  detail::check_pointer(T > 0 ? in.x_scales.data : nullptr, "x_scales", home, 4);
  detail::check_pointer(in.cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", home,
                4);
  const detail::ExpandDispatchParams::LowLatencyOut low_latency =
      low_latency_out(in, config_, row_bytes, home);
  if (in.handle != nullptr) return dispatch_cached(in, row_bytes, stream, mode);
  detail::check_view(in.topk_idx, "topk_idx", {DType::kInt32, DType::kInt64}, T, config_.top_k);
  detail::check_view(in.topk_weights, "topk_weights", {DType::kFloat32}, T, config_.top_k);
  if (T > 0) {
    detail::check_pointer(in.topk_idx.data, "topk_idx", home, dtype_size(in.topk_idx.dtype));
    detail::check_pointer(in.topk_weights.data, "topk_weights", home, 4);
  }
  WEFT_CHECK(!(in.defer_own_rows && in.expand.enabled),
             "defer_own_rows is for the deduplicated layout, not an expanded dispatch");
  if (in.expand.enabled) {
    in.expand.validate();
    WEFT_CHECK(config_.expand_factor >= 1, "an expanded dispatch needs a Buffer built with ",
               "BufferConfig::expand_factor >= 1 (it sizes the window's receive region)");
    const int64_t fixed_rows = in.expand.segment_stride * config_.num_local_experts(num_ranks_);
    WEFT_CHECK(fixed_rows <= expand_capacity(), "segment_stride ", in.expand.segment_stride,
               " x ", config_.num_local_experts(num_ranks_), " local experts = ", fixed_rows,
               " rows, above the expanded capacity ", expand_capacity(),
               " (raise BufferConfig::expand_factor)");
  }
  DeviceGuard guard(device_);
  detail::DispatchParams p{};
  p.comm = detail::comm_params(*group_, rank_, num_ranks_, *state_, options_.timeout_s);
  p.x = row_source(in, row_bytes, config_.hidden);
  p.topk_idx = in.topk_idx.data;
  p.topk_idx_int64 = in.topk_idx.dtype == DType::kInt64;
  p.local_count = T <= detail::kLocalCountMaxTokens;
  p.topk_weights = static_cast<const float*>(in.topk_weights.data);
  p.num_tokens = T;
  p.max_tokens = config_.max_tokens;
  p.top_k = config_.top_k;
  p.num_experts = config_.num_experts;
  // A fixed-stride expanded layout writes the metadata of every padding row of its segments
  // (write_padding): the grid follows those rows where they outnumber the tokens.
  p.num_blocks = num_blocks(std::max(T, in.expand.enabled ? in.expand.segment_stride *
                                                                config_.num_local_experts(num_ranks_)
                                                          : int64_t(0)),
                            in.num_sms);
  p.block_counts = state_->block_counts;
  p.expert_counts = state_->expert_counts;
  p.send_slot = state_->send_slot;
  p.tokens_per_local_expert = state_->tokens_per_local_expert;
  p.rank_prefix_matrix = state_->rank_prefix_matrix;
  p.cumulative_stats = in.cumulative_local_expert_recv_stats;
  p.layout_id = dispatch_sequence_ + 1;
  p.report_overflow = mode == CountMode::kOnDevice;
  const bool publish = mode == CountMode::kExact && !in.expand.enabled;
  p.published = publish ? state_->published_device : nullptr;
  p.defer_own_rows = in.defer_own_rows;
  if (in.expand.enabled) {
    detail::ExpandDispatchParams ep{};
    ep.dispatch = p;
    ep.block_expert_counts = state_->block_expert_counts;
    ep.expand_info = state_->expand_info;
    ep.capacity = expand_capacity();
    ep.expert_alignment = in.expand.expert_alignment;
    ep.zero_padding = in.expand.zero_padding;
    ep.segment_stride = in.expand.segment_stride;
    ep.expand_rows = state_->expand_rows;
    ep.low_latency = low_latency;
    detail::launch_expand_dispatch(ep, stream);
  } else {
    detail::launch_dispatch(p, stream);
  }
  ++dispatch_sequence_;
  state_->layout = {id_, dispatch_sequence_, T, -1,
                    in.expand.enabled ? in.expand : ExpandOptions{}};

  note_latest(row_bytes, in);
  DispatchResult r = make_result(row_bytes, state_->layout);
  if (mode == CountMode::kExact) state_->count_published = publish;
  if (publish) {
    WEFT_CUDA_CHECK(cudaEventRecord(state_->count_event, stream));
    state_->count_sequence = dispatch_sequence_;
  } else if (mode == CountMode::kExact) {
    static_assert(offsetof(detail::DeviceState, tokens_required) ==
                      offsetof(detail::DeviceState, num_recv) + sizeof(int32_t),
                  "one copy gives the host num_recv and tokens_required");
    WEFT_CUDA_CHECK(cudaMemcpyAsync(state_->host_count, &state_->state->num_recv,
                                    2 * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    if (in.expand.enabled) {
      WEFT_CUDA_CHECK(cudaMemcpyAsync(state_->host_rows_required, r.rows_required_device,
                                      sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    }
    WEFT_CUDA_CHECK(cudaEventRecord(state_->count_event, stream));
    state_->count_sequence = dispatch_sequence_;
  }
  note_launched(stream);
  return r;
}

DispatchResult Buffer::dispatch_cached(const DispatchInputs& in, int64_t row_bytes,
                                       cudaStream_t stream, CountMode mode) {
  detail::check_handle(*in.handle, state_->layout, id_, "cached dispatch");
  const Handle& h = state_->layout;  // what the handle was checked to match
  refuse_overflowed_layout(h, "cached dispatch");
  WEFT_CHECK(!in.expand.enabled || in.expand == h.expand,
             "cached dispatch: expand must be left unset or equal the handle's (the layout, "
             "expanded or not, is the handle's)");
  WEFT_CHECK(in.topk_idx.data == nullptr && in.topk_idx.rows == 0 &&
                 in.topk_weights.data == nullptr && in.topk_weights.rows == 0,
             "cached dispatch: topk_idx and topk_weights must be empty (the handle's are reused)");
  WEFT_CHECK(in.x.rows == h.num_tokens, "cached dispatch: x has ", in.x.rows,
             " tokens, the handle's layout ", h.num_tokens);
  WEFT_CHECK(mode == CountMode::kOnDevice, "cached dispatch: the count is the handle's ",
             "(num_recv_device, or handle.num_recv after wait_num_recv); use CountMode::kOnDevice");
  WEFT_CHECK(!(in.defer_own_rows && h.expand.enabled),
             "cached dispatch: defer_own_rows is for the deduplicated layout, not an expanded one");
  const int blocks = num_blocks(h.num_tokens, in.num_sms);  // checks num_sms in any case
  // At one rank with the own rows deferred no row is sent and no peer waited for: the call is
  // its checks of the layout (and the statistics). Without statistics it launches nothing and
  // the copy_out that must follow makes those checks (CopyOutParams::cached_call); with them,
  // one block makes the protocol round without the other blocks' fences and arrivals.
  const bool one_rank_deferred = num_ranks_ == 1 && in.defer_own_rows;
  if (one_rank_deferred && in.cumulative_local_expert_recv_stats == nullptr) {
    note_latest(row_bytes, in, true);
    return make_result(row_bytes, *in.handle);
  }
  DeviceGuard guard(device_);
  detail::CachedDispatchParams p{};
  p.comm = detail::comm_params(*group_, rank_, num_ranks_, *state_, options_.timeout_s);
  p.x = row_source(in, row_bytes, config_.hidden);
  p.num_tokens = h.num_tokens;
  p.num_blocks = one_rank_deferred ? 1 : blocks;
  p.send_slot = state_->send_slot;
  p.tokens_per_local_expert = state_->tokens_per_local_expert;
  p.num_local_experts = config_.num_local_experts(num_ranks_);
  p.cumulative_stats = in.cumulative_local_expert_recv_stats;
  if (h.expand.enabled) {
    p.expand_rows = state_->expand_rows;
    p.top_k = config_.top_k;
    p.segment_begin = state_->expand_info;
    p.zero_padding = h.expand.zero_padding;
  }
  p.layout_id = h.sequence;
  p.max_tokens = config_.max_tokens;
  p.defer_own_rows = in.defer_own_rows;
  detail::launch_cached_dispatch(p, stream);
  note_latest(row_bytes, in);
  note_launched(stream);
  return make_result(row_bytes, *in.handle);
}

void Buffer::note_latest(int64_t row_bytes, const DispatchInputs& in,
                         bool unlaunched_cached_call) {
  state_->latest_row_bytes = row_bytes;
  state_->latest_deferred_own = in.defer_own_rows;
  state_->unlaunched_cached_call = unlaunched_cached_call;
}

int64_t Buffer::wait_num_recv(DispatchResult& result) {
  WEFT_CHECK(result.handle.buffer_id == id_, "wait_num_recv: the result is from another Buffer");
  WEFT_CHECK(result.handle.sequence == state_->count_sequence,
             "wait_num_recv needs the latest dispatch made with CountMode::kExact");
  DeviceGuard guard(device_);
  if (state_->count_published) {
    wait_published(result);
  } else {
    WEFT_CUDA_CHECK(cudaEventSynchronize(state_->count_event));
    throw_if_device_error();
    result.num_recv = *state_->host_count;
    result.tokens_required = *state_->host_tokens_required;
  }
  result.handle.num_recv = result.num_recv;
  result.handle.tokens_required = result.tokens_required;
  if (state_->layout.sequence == result.handle.sequence) {
    state_->layout.num_recv = result.num_recv;
    state_->layout.tokens_required = result.tokens_required;
  }
  if (result.handle.expand.enabled) result.rows_required = *state_->host_rows_required;
  return result.num_recv;
}

// Waits on the host until the mapped counts carry this dispatch's layout id (published when its
// count exchange ended). Where its kernel ended without publishing (a wait timed out there: a
// fatal device error), throws that error.
void Buffer::wait_published(DispatchResult& result) {
  const auto* published_id = reinterpret_cast<const volatile uint64_t*>(state_->published);
  const uint64_t want = result.handle.sequence;
  // Between polls of the mapped word, now and then: has the kernel ended without publishing?
  constexpr int kPollsPerEventQuery = 64;
  for (int polls = 1; *published_id != want; ++polls) {
    if (polls % kPollsPerEventQuery != 0) continue;
    const cudaError_t status = cudaEventQuery(state_->count_event);
    if (status == cudaErrorNotReady) {
      std::this_thread::yield();
      continue;
    }
    WEFT_CUDA_CHECK(status);
    if (*published_id == want) break;
    throw_if_device_error();
    WEFT_FAIL("weft::ep dispatch ", want, " ended without publishing its counts");
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  throw_if_device_error();
  const int32_t* words = state_->published;
  result.num_recv = words[2];
  result.tokens_required = words[3];
  result.tokens_per_local_expert_host = words + detail::kPublishedHeaderWords;
}

void Buffer::copy_out(const CopyOutTargets& t, cudaStream_t stream) {
  throw_if_device_error();
  WEFT_CHECK(dispatch_sequence_ > 0, "copy_out: no dispatch has run on this Buffer");
  const bool fp8 = t.x_scales != nullptr;
  WEFT_CHECK(fp8 == (state_->latest_row_bytes != config_.row_bytes()),
             "copy_out: x_scales must be given exactly when the latest dispatch moved fp8 rows");
  WEFT_CHECK(t.num_rows >= 0, "copy_out: num_rows must not be negative, got ", t.num_rows);
  WEFT_CHECK(t.num_topk >= 0 && t.num_topk <= config_.top_k, "copy_out: num_topk ", t.num_topk,
             " is outside [0, top_k = ", config_.top_k, "]");
  WEFT_CHECK(t.num_rows == 0 || t.x != nullptr, "copy_out: x is null");
  const bool expanded = state_->layout.expand.enabled;
  WEFT_CHECK(!expanded || t.rank_prefix_matrix == nullptr,
             "copy_out: an expanded layout has no rank_prefix_matrix");
  const detail::PointerHome home =
      detail::pointer_home(*group_, index_, device_, t.pointers_checked);
  if (t.num_rows > 0) {
    detail::check_pointer(t.x, "copy_out: x", home, 16);
    detail::check_pointer(t.x_scales, "copy_out: x_scales", home, 4);
    detail::check_pointer(t.src, "copy_out: src", home, 8);
    detail::check_pointer(t.topk_idx, "copy_out: topk_idx", home, t.topk_idx_int64 ? 8 : 4);
    detail::check_pointer(t.topk_weights, "copy_out: topk_weights", home, 4);
  }
  detail::check_pointer(t.rank_prefix_matrix, "copy_out: rank_prefix_matrix", home, 4);
  // The own rows' source: the deferring dispatch's x, in the form it was given.
  const bool deferred = state_->latest_deferred_own;
  WEFT_CHECK(deferred == t.deferred_own_rows,
             deferred ? "copy_out: the latest dispatch deferred its own rows (defer_own_rows): "
                        "give its x as own_x"
                      : "copy_out: own_x is only for a dispatch that deferred its own rows");
  detail::RowSource own{};
  if (deferred) {
    DispatchInputs source;
    source.x = t.own_x;
    source.x_scales = t.own_x_scales;
    WEFT_CHECK(t.own_x.rows == state_->layout.num_tokens, "copy_out: own_x has ",
               t.own_x.rows, " tokens, the deferring dispatch ", state_->layout.num_tokens);
    const int64_t own_row_bytes = dispatch_row_bytes(source, config_);
    WEFT_CHECK(own_row_bytes == state_->latest_row_bytes, "copy_out: own_x makes ",
               own_row_bytes, "-byte rows, the deferring dispatch moved ",
               state_->latest_row_bytes, "-byte rows");
    if (t.own_x.rows > 0) {
      detail::check_pointer(t.own_x.data, "copy_out: own_x", home, 16);
      detail::check_pointer(t.own_x_scales.data, "copy_out: own_x_scales", home, 4);
    }
    own = row_source(source, own_row_bytes, config_.hidden);
  }
  const auto& layout = group_->layout;
  const char* base = static_cast<const char*>(group_->team->window(index_));
  detail::CopyOutParams p{};
  p.recv_x = base + layout.recv_x;
  p.row_bytes = state_->latest_row_bytes;
  p.recv_src = reinterpret_cast<const int2*>(base + layout.recv_src);
  p.recv_expert_idx = reinterpret_cast<const int32_t*>(base + layout.recv_expert_idx);
  p.recv_weights = reinterpret_cast<const float*>(base + layout.recv_weights);
  p.state = state_->state;
  p.error = state_->error.device_record();
  p.layout_id = state_->layout.sequence;
  p.cached_call = state_->unlaunched_cached_call;
  p.rank = rank_;
  p.max_tokens = config_.max_tokens;
  p.top_k = config_.top_k;
  p.hidden = config_.hidden;
  p.num_rows = t.num_rows;
  p.valid_rows = std::min(t.num_rows, expanded ? expand_capacity() : capacity());
  p.x = t.x;
  p.x_scales = t.x_scales;
  p.src = reinterpret_cast<int2*>(t.src);
  p.pad_token = t.pad_token;
  p.topk_idx = t.topk_idx;
  p.topk_idx_int64 = t.topk_idx_int64;
  p.topk_weights = t.topk_weights;
  p.num_topk = t.num_topk;
  p.rank_prefix_matrix = state_->rank_prefix_matrix;
  p.rank_prefix_out = t.rank_prefix_matrix;
  p.own_x = own;
  p.num_ranks = num_ranks_;
  p.max_blocks = device_num_sms_ * 8;
  DeviceGuard guard(device_);
  detail::launch_copy_out(p, stream);
  state_->unlaunched_cached_call = false;  // its check is queued
}

void cast_to_fp8(const void* x, int64_t num_tokens, int64_t hidden, void* out,
                 cudaStream_t stream, bool round_scale) {
  const Fp8RowLayout l = fp8_row_layout(hidden);
  WEFT_CHECK(num_tokens >= 0, "cast_to_fp8: num_tokens must not be negative");
  WEFT_CHECK(num_tokens == 0 || (x != nullptr && out != nullptr), "cast_to_fp8: null pointer");
  if (num_tokens > 0) {
    detail::PointerHome home;
    WEFT_CUDA_CHECK(cudaGetDevice(&home.device));
    detail::check_pointer(x, "cast_to_fp8: x", home, 16);
    detail::check_pointer(out, "cast_to_fp8: out", home, 16);
  }
  detail::launch_cast_fp8({static_cast<const uint16_t*>(x), static_cast<uint8_t*>(out), num_tokens,
                           hidden, l.raw_bytes, l.row_bytes, round_scale},
                          stream);
}

}  // namespace weft::ep
