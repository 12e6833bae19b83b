#include "weft/ep/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "weft/core/error.hpp"

namespace weft::ep {

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

void BufferConfig::validate(int num_ranks) const {
  WEFT_CHECK(num_ranks >= 1 && num_ranks <= 32, "weft::ep supports 1..32 ranks, got ", num_ranks);
  WEFT_CHECK(max_tokens >= 1, "max_tokens must be positive, got ", max_tokens);
  WEFT_CHECK(max_tokens <= (int64_t(1) << 24), "max_tokens ", max_tokens, " is above 2^24");
  WEFT_CHECK(hidden >= 8, "hidden must be at least 8 elements, got ", hidden);
  WEFT_CHECK((hidden * 2) % 16 == 0, "hidden ", hidden, " bf16 elements is ", hidden * 2,
             " bytes, not a multiple of 16 (rows move as 16-byte vectors)");
  WEFT_CHECK(num_experts >= num_ranks && num_experts % num_ranks == 0, "num_experts ",
             num_experts, " must be a positive multiple of the number of ranks ", num_ranks);
  WEFT_CHECK(num_experts <= 4096, "num_experts ", num_experts, " is above 4096");
  WEFT_CHECK(top_k >= 1 && top_k <= 32, "top_k must be in 1..32, got ", top_k);
  WEFT_CHECK(expand_factor >= 0, "expand_factor must not be negative (0: no expanded dispatch), ",
             "got ", expand_factor);
  WEFT_CHECK(expand_capacity(num_ranks) <= int64_t(INT32_MAX), "expand_factor ", expand_factor,
             " x ", num_ranks, " ranks x max_tokens ", max_tokens, " = ",
             expand_capacity(num_ranks), " rows is above 2^31 - 1 (rows are int32 indices)");
}

void ExpandOptions::validate() const {
  WEFT_CHECK(expert_alignment >= 1 && expert_alignment <= 4096,
             "expert_alignment must be in 1..4096, got ", expert_alignment);
  WEFT_CHECK(segment_stride >= 0 && segment_stride <= int64_t(INT32_MAX),
             "segment_stride must be in 0..2^31 - 1 (0: packed segments), got ", segment_stride);
}

Fp8RowLayout fp8_row_layout(int64_t hidden) {
  WEFT_CHECK(hidden > 0 && hidden % kFp8GroupElements == 0, "fp8 rows need hidden to be a ",
             "positive multiple of ", kFp8GroupElements, " (one fp32 scale per group), got ",
             hidden);
  Fp8RowLayout l;
  l.hidden = hidden;
  l.num_scales = hidden / kFp8GroupElements;
  l.scales_offset = hidden;
  l.raw_bytes = hidden + int64_t(sizeof(float)) * l.num_scales;
  const int64_t aligned16 = (l.raw_bytes + 15) / 16 * 16;
  const int64_t aligned512 = (l.raw_bytes + 511) / 512 * 512;
  const bool pad512 = double(aligned512 - l.raw_bytes) <=
                      kFp8Row512MaxPaddingFraction * double(l.raw_bytes);
  l.row_bytes = pad512 ? aligned512 : aligned16;
  return l;
}

namespace reference {
namespace {

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Rows of the expanded layout at destination d (the deduplicated layout is done inline below).
void expand_destination(const BufferConfig& config, std::span<const RankInput> inputs,
                        const DispatchOptions& options, int d, std::vector<RankLayout>& out) {
  const int num_ranks = static_cast<int>(inputs.size());
  const int epr = config.num_local_experts(num_ranks);
  const int top_k = config.top_k;
  const auto hidden = static_cast<std::size_t>(config.hidden);
  const std::size_t row_bytes =
      options.fp8 ? static_cast<std::size_t>(fp8_row_layout(config.hidden).row_bytes) : 0;
  RankLayout& dst = out[static_cast<std::size_t>(d)];
  dst.expanded = true;
  // Does token t of rank s select local expert e of d (at least once)?
  auto selects = [&](const RankInput& in, std::size_t t, int e) {
    const int64_t global = int64_t(d) * epr + e;
    for (int k = 0; k < top_k; ++k) {
      if (in.topk_idx[t * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k)] == global) {
        return true;
      }
    }
    return false;
  };
  dst.tokens_per_local_expert.assign(static_cast<std::size_t>(epr), 0);
  for (int e = 0; e < epr; ++e) {
    for (const RankInput& in : inputs) {
      for (std::size_t t = 0; t < static_cast<std::size_t>(in.num_tokens); ++t) {
        dst.tokens_per_local_expert[static_cast<std::size_t>(e)] += selects(in, t, e);
      }
    }
  }
  dst.segment_begin.assign(static_cast<std::size_t>(epr) + 1, 0);
  const int64_t stride = options.expand.segment_stride;
  int64_t largest = 0;  // the largest aligned count
  for (int e = 0; e < epr; ++e) {
    const int64_t aligned = align_up(dst.tokens_per_local_expert[static_cast<std::size_t>(e)],
                                     options.expand.expert_alignment);
    largest = std::max(largest, aligned);
    dst.segment_begin[static_cast<std::size_t>(e) + 1] =
        stride > 0 ? int64_t(e + 1) * stride : dst.segment_begin[static_cast<std::size_t>(e)] + aligned;
  }
  const int64_t capacity = config.expand_capacity(num_ranks);
  if (stride > 0) {
    dst.rows_required = int64_t(epr) * std::max(stride, largest);
    dst.overflowed = largest > stride || dst.rows_required > capacity;
    dst.segment_begin.back() = dst.rows_required;  // as packed: the last is rows_required
  } else {
    dst.rows_required = dst.segment_begin.back();
    dst.overflowed = dst.rows_required > capacity;
  }
  if (dst.overflowed) return;  // nothing moves; the sources' send slots stay -1

  dst.num_recv = dst.rows_required;
  const auto num_rows = static_cast<std::size_t>(dst.num_recv);
  dst.recv_src_rank.assign(num_rows, -1);
  dst.recv_src_token.assign(num_rows, -1);
  dst.recv_expert_idx.assign(num_rows * static_cast<std::size_t>(top_k), -1);
  dst.recv_weights.assign(num_rows * static_cast<std::size_t>(top_k), 0.0f);
  if (options.fp8) {
    dst.recv_x_fp8.assign(num_rows * row_bytes, 0);
  } else {
    dst.recv_x.assign(num_rows * hidden, 0);
  }
  for (int e = 0; e < epr; ++e) {
    auto row = static_cast<std::size_t>(dst.segment_begin[static_cast<std::size_t>(e)]);
    const int64_t global = int64_t(d) * epr + e;
    for (int s = 0; s < num_ranks; ++s) {
      const RankInput& in = inputs[static_cast<std::size_t>(s)];
      for (std::size_t t = 0; t < static_cast<std::size_t>(in.num_tokens); ++t) {
        if (!selects(in, t, e)) continue;
        int32_t& slot = out[static_cast<std::size_t>(s)]
                            .send_slot[t * static_cast<std::size_t>(num_ranks) +
                                       static_cast<std::size_t>(d)];
        if (slot < 0) slot = static_cast<int32_t>(row);  // segments ascend: the first is lowest
        dst.recv_src_rank[row] = s;
        dst.recv_src_token[row] = static_cast<int32_t>(t);
        for (int k = 0; k < top_k; ++k) {
          const std::size_t i = t * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k);
          if (in.topk_idx[i] != global) continue;
          dst.recv_expert_idx[row * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k)] = e;
          dst.recv_weights[row * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k)] =
              in.topk_weights[i];
        }
        if (options.fp8) {
          std::copy_n(in.x_fp8.begin() + static_cast<std::ptrdiff_t>(t * row_bytes), row_bytes,
                      dst.recv_x_fp8.begin() + static_cast<std::ptrdiff_t>(row * row_bytes));
        } else {
          std::copy_n(in.x.begin() + static_cast<std::ptrdiff_t>(t * hidden), hidden,
                      dst.recv_x.begin() + static_cast<std::ptrdiff_t>(row * hidden));
        }
        ++row;
      }
    }
  }
}

}  // namespace

std::vector<RankLayout> dispatch(const BufferConfig& config, std::span<const RankInput> inputs,
                                 const DispatchOptions& options) {
  const int num_ranks = static_cast<int>(inputs.size());
  config.validate(num_ranks);
  options.expand.validate();
  WEFT_CHECK(!options.expand.enabled || config.expand_factor >= 1,
             "an expanded dispatch needs BufferConfig::expand_factor >= 1 (its capacity)");
  const std::size_t fp8_row_bytes =
      options.fp8 ? static_cast<std::size_t>(fp8_row_layout(config.hidden).row_bytes) : 0;
  const int epr = config.num_local_experts(num_ranks);
  const int top_k = config.top_k;
  const int64_t hidden = config.hidden;
  std::vector<RankLayout> out(static_cast<std::size_t>(num_ranks));

  // Pass 1: per (source, token) destination mask, with input checks.
  std::vector<std::vector<uint32_t>> masks(inputs.size());
  for (int s = 0; s < num_ranks; ++s) {
    const RankInput& in = inputs[static_cast<std::size_t>(s)];
    const int64_t most_tokens = options.expand.enabled ? config.max_tokens : int64_t(INT32_MAX);
    WEFT_CHECK(in.num_tokens >= 0 && in.num_tokens <= most_tokens, "rank ", s, ": ",
               in.num_tokens, " tokens, at most ", most_tokens, " allowed",
               options.expand.enabled ? " (the expanded dispatch's max_tokens)" : "");
    const auto t_count = static_cast<std::size_t>(in.num_tokens);
    if (options.fp8) {
      WEFT_CHECK(in.x_fp8.size() == t_count * fp8_row_bytes, "rank ", s, ": x_fp8 has ",
                 in.x_fp8.size(), " bytes, expected ", t_count * fp8_row_bytes);
    } else {
      WEFT_CHECK(in.x.size() == t_count * static_cast<std::size_t>(hidden), "rank ", s,
                 ": x has ", in.x.size(), " elements, expected ", t_count * hidden);
    }
    WEFT_CHECK(in.topk_idx.size() == t_count * static_cast<std::size_t>(top_k) &&
                   in.topk_weights.size() == in.topk_idx.size(),
               "rank ", s, ": topk_idx/topk_weights sizes do not match [T, top_k]");
    auto& m = masks[static_cast<std::size_t>(s)];
    m.assign(t_count, 0u);
    for (std::size_t t = 0; t < t_count; ++t) {
      for (int k = 0; k < top_k; ++k) {
        const int64_t e = in.topk_idx[t * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k)];
        if (e == -1) continue;
        WEFT_CHECK(e >= 0 && e < config.num_experts, "rank ", s, " token ", t, " selection ", k,
                   ": expert id ", e, " is out of range [0, ", config.num_experts, ") and not -1");
        m[t] |= 1u << (e / epr);
      }
    }
  }

  // Pass 2: per destination, rows in (source rank, source token) order.
  for (int s = 0; s < num_ranks; ++s) {
    auto& layout = out[static_cast<std::size_t>(s)];
    layout.num_tokens = inputs[static_cast<std::size_t>(s)].num_tokens;
    layout.send_slot.assign(static_cast<std::size_t>(layout.num_tokens * num_ranks), -1);
  }
  if (options.expand.enabled) {
    for (int d = 0; d < num_ranks; ++d) expand_destination(config, inputs, options, d, out);
    return out;
  }
  // Tokens over max_tokens: every rank sees every T, so every rank moves nothing and reports the
  // largest T.
  int64_t required = 0;
  for (const RankInput& in : inputs) {
    if (in.num_tokens > config.max_tokens) required = std::max(required, in.num_tokens);
  }
  if (required > 0) {
    for (auto& layout : out) {
      layout.tokens_required = required;
      layout.tokens_per_local_expert.assign(static_cast<std::size_t>(epr), 0);
      layout.rank_prefix_matrix.assign(static_cast<std::size_t>(num_ranks) *
                                           static_cast<std::size_t>(num_ranks), 0);
    }
    return out;
  }
  for (int d = 0; d < num_ranks; ++d) {
    RankLayout& dst = out[static_cast<std::size_t>(d)];
    dst.tokens_per_local_expert.assign(static_cast<std::size_t>(epr), 0);
    for (int s = 0; s < num_ranks; ++s) {
      const RankInput& in = inputs[static_cast<std::size_t>(s)];
      const auto& m = masks[static_cast<std::size_t>(s)];
      for (std::size_t t = 0; t < m.size(); ++t) {
        if ((m[t] >> d & 1u) == 0) continue;
        const auto row = static_cast<int32_t>(dst.recv_src_rank.size());
        out[static_cast<std::size_t>(s)].send_slot[t * static_cast<std::size_t>(num_ranks) +
                                                   static_cast<std::size_t>(d)] = row;
        dst.recv_src_rank.push_back(s);
        dst.recv_src_token.push_back(static_cast<int32_t>(t));
        std::vector<bool> counted(static_cast<std::size_t>(epr), false);
        for (int k = 0; k < top_k; ++k) {
          const std::size_t i = t * static_cast<std::size_t>(top_k) + static_cast<std::size_t>(k);
          const int64_t e = in.topk_idx[i];
          const bool local = e >= 0 && e / epr == d;
          const int32_t local_e = local ? static_cast<int32_t>(e - int64_t(d) * epr) : -1;
          dst.recv_expert_idx.push_back(local_e);
          dst.recv_weights.push_back(local ? in.topk_weights[i] : 0.0f);
          if (local && !counted[static_cast<std::size_t>(local_e)]) {
            counted[static_cast<std::size_t>(local_e)] = true;
            ++dst.tokens_per_local_expert[static_cast<std::size_t>(local_e)];
          }
        }
        if (options.fp8) {
          const auto* src_row = in.x_fp8.data() + t * fp8_row_bytes;
          dst.recv_x_fp8.insert(dst.recv_x_fp8.end(), src_row, src_row + fp8_row_bytes);
        } else {
          const auto* src_row = in.x.data() + t * static_cast<std::size_t>(hidden);
          dst.recv_x.insert(dst.recv_x.end(), src_row, src_row + hidden);
        }
      }
    }
    dst.num_recv = static_cast<int64_t>(dst.recv_src_rank.size());
  }
  // rank_prefix_matrix[i][j] = rows j received from ranks 0..i (its rows are in source order).
  const auto R = static_cast<std::size_t>(num_ranks);
  std::vector<int32_t> prefix(R * R, 0);
  for (std::size_t j = 0; j < R; ++j) {
    for (const int32_t s : out[j].recv_src_rank) {
      for (auto i = static_cast<std::size_t>(s); i < R; ++i) ++prefix[i * R + j];
    }
  }
  for (auto& layout : out) layout.rank_prefix_matrix = prefix;
  return out;
}

namespace {

// combine of an expanded dispatch (see reference.hpp): per destination d, the bf16 partial sum of
// each of this rank's tokens' rows there, then the usual reduce over d ascending.
void combine_expanded(const BufferConfig& config, int rank, std::span<const RankLayout> layouts,
                      std::span<const std::vector<uint16_t>> expert_out,
                      std::span<const uint16_t> bias0, std::span<const uint16_t> bias1,
                      std::span<const std::vector<float>> source_weights,
                      std::vector<uint16_t>& out) {
  const int num_ranks = static_cast<int>(layouts.size());
  const auto hidden = static_cast<std::size_t>(config.hidden);
  const auto t_count = static_cast<std::size_t>(layouts[static_cast<std::size_t>(rank)].num_tokens);
  for (int d = 0; d < num_ranks; ++d) {
    const RankLayout& L = layouts[static_cast<std::size_t>(d)];
    WEFT_CHECK(L.expanded, "combine: rank ", d, "'s layout is not expanded but rank ", rank,
               "'s is");
    WEFT_CHECK(!L.overflowed, "combine: the expanded dispatch overflowed at rank ", d, " (",
               L.rows_required, " rows needed), so some rows were never received");
  }
  std::vector<float> acc(t_count * hidden, 0.0f);
  for (std::size_t t = 0; t < t_count; ++t) {
    for (std::size_t h = 0; h < hidden; ++h) {
      float a = 0.0f;
      if (!bias0.empty()) a += bf16_to_float(bias0[t * hidden + h]);
      if (!bias1.empty()) a += bf16_to_float(bias1[t * hidden + h]);
      acc[t * hidden + h] = a;
    }
  }
  std::vector<float> partial(t_count * hidden);
  std::vector<bool> sent(t_count);
  for (int d = 0; d < num_ranks; ++d) {
    const RankLayout& L = layouts[static_cast<std::size_t>(d)];
    const std::vector<uint16_t>& y = expert_out[static_cast<std::size_t>(d)];
    std::fill(partial.begin(), partial.end(), 0.0f);
    std::fill(sent.begin(), sent.end(), false);
    for (std::size_t j = 0; j < static_cast<std::size_t>(L.num_recv); ++j) {
      if (L.recv_src_rank[j] != rank) continue;
      const auto t = static_cast<std::size_t>(L.recv_src_token[j]);
      sent[t] = true;
      if (source_weights.empty()) {
        for (std::size_t h = 0; h < hidden; ++h) partial[t * hidden + h] += bf16_to_float(y[j * hidden + h]);
        continue;
      }
      const auto top_k = static_cast<std::size_t>(config.top_k);
      float w = 0.0f;  // the weights of the row's own selections, k ascending
      for (std::size_t k = 0; k < top_k; ++k) {
        if (L.recv_expert_idx[j * top_k + k] >= 0) {
          w += source_weights[static_cast<std::size_t>(rank)][t * top_k + k];
        }
      }
      for (std::size_t h = 0; h < hidden; ++h) {
        partial[t * hidden + h] = std::fma(w, bf16_to_float(y[j * hidden + h]), partial[t * hidden + h]);
      }
    }
    for (std::size_t t = 0; t < t_count; ++t) {
      if (!sent[t]) continue;
      for (std::size_t h = 0; h < hidden; ++h) {
        acc[t * hidden + h] += bf16_to_float(float_to_bf16(partial[t * hidden + h]));
      }
    }
  }
  for (std::size_t i = 0; i < t_count * hidden; ++i) out[i] = float_to_bf16(acc[i]);
}

}  // namespace

std::vector<uint16_t> combine(const BufferConfig& config, int rank,
                              std::span<const RankLayout> layouts,
                              std::span<const std::vector<uint16_t>> expert_out,
                              std::span<const uint16_t> bias0, std::span<const uint16_t> bias1) {
  const int num_ranks = static_cast<int>(layouts.size());
  WEFT_CHECK(rank >= 0 && rank < num_ranks, "rank ", rank, " out of range");
  WEFT_CHECK(expert_out.size() == layouts.size(), "one expert output per rank is needed");
  const auto hidden = static_cast<std::size_t>(config.hidden);
  const RankLayout& src = layouts[static_cast<std::size_t>(rank)];
  const auto t_count = static_cast<std::size_t>(src.num_tokens);
  WEFT_CHECK(src.tokens_required == 0, "combine: the dispatch moved no rows (a rank had ",
             src.tokens_required, " tokens, above max_tokens ", config.max_tokens, ")");
  WEFT_CHECK(bias0.empty() || bias0.size() == t_count * hidden, "bias0 must be [T, hidden]");
  WEFT_CHECK(bias1.empty() || bias1.size() == t_count * hidden, "bias1 must be [T, hidden]");
  for (int d = 0; d < num_ranks; ++d) {
    WEFT_CHECK(expert_out[static_cast<std::size_t>(d)].size() ==
                   static_cast<std::size_t>(layouts[static_cast<std::size_t>(d)].num_recv) * hidden,
               "expert_out of rank ", d, " must be [num_recv, hidden]");
  }
  std::vector<uint16_t> out(t_count * hidden);
  std::vector<float> acc(hidden);
  if (src.expanded) {
    combine_expanded(config, rank, layouts, expert_out, bias0, bias1, {}, out);
    return out;
  }
  for (std::size_t t = 0; t < t_count; ++t) {
    for (std::size_t h = 0; h < hidden; ++h) {
      float a = 0.0f;
      if (!bias0.empty()) a += bf16_to_float(bias0[t * hidden + h]);
      if (!bias1.empty()) a += bf16_to_float(bias1[t * hidden + h]);
      acc[h] = a;
    }
    for (int d = 0; d < num_ranks; ++d) {
      const int32_t row = src.send_slot[t * static_cast<std::size_t>(num_ranks) + static_cast<std::size_t>(d)];
      if (row < 0) continue;
      const uint16_t* y = expert_out[static_cast<std::size_t>(d)].data() + static_cast<std::size_t>(row) * hidden;
      for (std::size_t h = 0; h < hidden; ++h) acc[h] += bf16_to_float(y[h]);
    }
    for (std::size_t h = 0; h < hidden; ++h) out[t * hidden + h] = float_to_bf16(acc[h]);
  }
  return out;
}

std::vector<uint16_t> combine_weighted(const BufferConfig& config, int rank,
                                       std::span<const RankLayout> layouts,
                                       std::span<const std::vector<uint16_t>> expert_out,
                                       std::span<const std::vector<float>> source_weights) {
  const int num_ranks = static_cast<int>(layouts.size());
  WEFT_CHECK(rank >= 0 && rank < num_ranks, "rank ", rank, " out of range");
  WEFT_CHECK(expert_out.size() == layouts.size(), "one expert output per rank is needed");
  WEFT_CHECK(source_weights.size() == layouts.size(), "one source_weights per rank is needed");
  const auto hidden = static_cast<std::size_t>(config.hidden);
  const RankLayout& src = layouts[static_cast<std::size_t>(rank)];
  WEFT_CHECK(src.expanded, "combine_weighted: the layout is not expanded");
  for (int d = 0; d < num_ranks; ++d) {
    const auto du = static_cast<std::size_t>(d);
    WEFT_CHECK(expert_out[du].size() == static_cast<std::size_t>(layouts[du].num_recv) * hidden,
               "expert_out of rank ", d, " must be [num_recv, hidden]");
    WEFT_CHECK(source_weights[du].size() ==
                   static_cast<std::size_t>(layouts[du].num_tokens) *
                       static_cast<std::size_t>(config.top_k),
               "source_weights of rank ", d, " must be [T, top_k]");
  }
  std::vector<uint16_t> out(static_cast<std::size_t>(src.num_tokens) * hidden);
  combine_expanded(config, rank, layouts, expert_out, {}, {}, source_weights, out);
  return out;
}

std::vector<float> combine_weights(const BufferConfig& config, int rank,
                                   std::span<const RankLayout> layouts,
                                   std::span<const std::vector<float>> topk_weights,
                                   int num_weights) {
  const int num_ranks = static_cast<int>(layouts.size());
  WEFT_CHECK(rank >= 0 && rank < num_ranks, "rank ", rank, " out of range");
  WEFT_CHECK(topk_weights.size() == layouts.size(), "one topk_weights per rank is needed");
  WEFT_CHECK(num_weights >= 1 && num_weights <= config.top_k, "num_weights ", num_weights,
             " must be in 1..top_k = ", config.top_k);
  const auto K = static_cast<std::size_t>(num_weights);
  for (int d = 0; d < num_ranks; ++d) {
    const RankLayout& L = layouts[static_cast<std::size_t>(d)];
    WEFT_CHECK(!L.expanded, "combine_weights: the expanded layout is not supported");
    WEFT_CHECK(L.tokens_required == 0, "combine_weights: the dispatch moved no rows");
    WEFT_CHECK(topk_weights[static_cast<std::size_t>(d)].size() ==
                   static_cast<std::size_t>(L.num_recv) * K,
               "topk_weights of rank ", d, " must be [num_recv, num_weights]");
  }
  const RankLayout& src = layouts[static_cast<std::size_t>(rank)];
  const auto t_count = static_cast<std::size_t>(src.num_tokens);
  const auto R = static_cast<std::size_t>(num_ranks);
  std::vector<float> out(t_count * K);
  for (std::size_t t = 0; t < t_count; ++t) {
    for (std::size_t k = 0; k < K; ++k) {
      float w = 0.0f;
      for (std::size_t d = 0; d < R; ++d) {
        const int32_t row = src.send_slot[t * R + d];
        if (row >= 0) w += topk_weights[d][static_cast<std::size_t>(row) * K + k];
      }
      out[t * K + k] = w;
    }
  }
  return out;
}

std::vector<uint8_t> cast_to_fp8(int64_t hidden, int64_t num_tokens, std::span<const uint16_t> x,
                                 bool round_scale) {
  const Fp8RowLayout l = fp8_row_layout(hidden);
  WEFT_CHECK(num_tokens >= 0 && x.size() == static_cast<std::size_t>(num_tokens * hidden),
             "cast_to_fp8: x has ", x.size(), " elements, expected ", num_tokens, " x ", hidden);
  std::vector<uint8_t> rows(static_cast<std::size_t>(num_tokens * l.row_bytes), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    uint8_t* row = rows.data() + t * l.row_bytes;
    for (int64_t g = 0; g < l.num_scales; ++g) {
      const uint16_t* group = x.data() + t * hidden + g * kFp8GroupElements;
      float amax = 0.0f;
      for (int64_t i = 0; i < kFp8GroupElements; ++i) {
        amax = std::fmax(amax, std::fabs(bf16_to_float(group[i])));
      }
      amax = std::fmax(amax, kFp8MinAmax);
      const float plain_scale = amax * kFp8InverseE4M3Max;
      const float scale = round_scale ? fp8_round_scale(plain_scale) : plain_scale;
      const float inverse = round_scale ? 1.0f / scale : (1.0f / amax) * kFp8E4M3Max;
      for (int64_t i = 0; i < kFp8GroupElements; ++i) {
        row[g * kFp8GroupElements + i] = float_to_e4m3(bf16_to_float(group[i]) * inverse);
      }
      std::memcpy(row + l.scales_offset + g * int64_t(sizeof(float)), &scale, sizeof(float));
    }
  }
  return rows;
}

LowLatencyLayout low_latency_layout(const BufferConfig& config, int num_ranks,
                                    int64_t segment_stride, const RankLayout& layout) {
  const int epr = config.num_local_experts(num_ranks);
  const int64_t S = segment_stride;
  WEFT_CHECK(layout.expanded && S > 0 && !layout.overflowed && layout.num_recv == epr * S,
             "low_latency_layout: the layout must be an expanded dispatch of ", epr,
             " fixed-stride segments of segment_stride = ", S, " rows that did not overflow");
  LowLatencyLayout out;
  out.src_info.assign(static_cast<std::size_t>(epr * S), -1);
  out.layout_range.assign(static_cast<std::size_t>(epr) * static_cast<std::size_t>(num_ranks), 0);
  for (int e = 0; e < epr; ++e) {
    std::vector<int64_t> counts(static_cast<std::size_t>(num_ranks), 0);
    for (int64_t s = 0; s < S; ++s) {
      const auto row = static_cast<std::size_t>(e * S + s);
      out.src_info[row] = layout.recv_src_token[row];
      const int32_t rank = layout.recv_src_rank[row];
      if (rank >= 0) ++counts[static_cast<std::size_t>(rank)];
    }
    int64_t begin = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const int64_t count = counts[static_cast<std::size_t>(r)];
      out.layout_range[static_cast<std::size_t>(e * num_ranks + r)] = (begin << 32) | count;
      begin += count;
    }
  }
  if (layout.recv_x_fp8.empty()) return out;
  const Fp8RowLayout l = fp8_row_layout(config.hidden);
  const int64_t G = l.num_scales;
  out.scales.assign(static_cast<std::size_t>(epr * S * G), 0.0f);
  for (int64_t row = 0; row < epr * S; ++row) {
    const int64_t e = row / S;
    const int64_t s = row % S;
    for (int64_t g = 0; g < G; ++g) {
      std::memcpy(&out.scales[static_cast<std::size_t>((e * G + g) * S + s)],
                  layout.recv_x_fp8.data() + row * l.row_bytes + l.scales_offset + 4 * g,
                  sizeof(float));
    }
  }
  if (G % 4 != 0) return out;
  const int64_t W = G / 4;
  out.ue8m0.assign(static_cast<std::size_t>(epr * S * W), 0);
  for (int64_t e = 0; e < epr; ++e) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t w = 0; w < W; ++w) {
        uint32_t word = 0;
        for (int64_t i = 0; i < 4; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &out.scales[static_cast<std::size_t>((e * G + 4 * w + i) * S + s)],
                      sizeof(bits));
          word |= ((bits >> 23) & 0xFFu) << (8 * i);
        }
        out.ue8m0[static_cast<std::size_t>((e * W + w) * S + s)] = static_cast<int32_t>(word);
      }
    }
  }
  return out;
}

Fp8Unpacked unpack_fp8(int64_t hidden, int64_t num_tokens, std::span<const uint8_t> rows) {
  const Fp8RowLayout l = fp8_row_layout(hidden);
  WEFT_CHECK(num_tokens >= 0 && rows.size() == static_cast<std::size_t>(num_tokens * l.row_bytes),
             "unpack_fp8: ", rows.size(), " bytes, expected ", num_tokens, " rows of ",
             l.row_bytes);
  Fp8Unpacked u;
  u.payload.resize(static_cast<std::size_t>(num_tokens * hidden));
  u.scales.resize(static_cast<std::size_t>(num_tokens * l.num_scales));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const uint8_t* row = rows.data() + t * l.row_bytes;
    std::copy_n(row, hidden, u.payload.begin() + t * hidden);
    std::memcpy(u.scales.data() + t * l.num_scales, row + l.scales_offset,
                static_cast<std::size_t>(l.num_scales) * sizeof(float));
    for (int64_t b = l.raw_bytes; b < l.row_bytes; ++b) {
      WEFT_CHECK(row[b] == 0, "unpack_fp8: row ", t, " padding byte ", b, " is ", int(row[b]),
                 ", not zero");
    }
  }
  return u;
}

std::vector<float> dequantize_fp8(int64_t hidden, int64_t num_tokens,
                                  std::span<const uint8_t> rows) {
  const Fp8Unpacked u = unpack_fp8(hidden, num_tokens, rows);
  const int64_t num_scales = hidden / kFp8GroupElements;
  std::vector<float> x(u.payload.size());
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < hidden; ++h) {
      const auto i = static_cast<std::size_t>(t * hidden + h);
      x[i] = e4m3_to_float(u.payload[i]) *
             u.scales[static_cast<std::size_t>(t * num_scales + h / kFp8GroupElements)];
    }
  }
  return x;
}

void accumulate_local_expert_recv_stats(const RankLayout& layout, std::span<uint32_t> stats) {
  WEFT_CHECK(stats.size() == layout.tokens_per_local_expert.size(), "stats has ", stats.size(),
             " entries, expected one per local expert (", layout.tokens_per_local_expert.size(),
             ")");
  for (std::size_t e = 0; e < stats.size(); ++e) {
    stats[e] += static_cast<uint32_t>(layout.tokens_per_local_expert[e]);
  }
}

uint16_t identity_bf16(int rank, int64_t token, int64_t col, unsigned min_exponent,
                       unsigned num_exponents) {
  uint64_t x = (uint64_t(rank) << 56) ^ (uint64_t(token) << 24) ^ uint64_t(col);
  x ^= x >> 31;
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return uint16_t(((x & 1u) << 15) | ((min_exponent + (x >> 1) % num_exponents) << 7) |
                  ((x >> 8) & 0x7Fu));
}

}  // namespace reference
}  // namespace weft::ep
