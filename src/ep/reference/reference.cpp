#include "weft/ep/reference.hpp"

#include <cstddef>

#include "weft/core/error.hpp"

namespace weft::ep {

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
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
}

namespace reference {

std::vector<RankLayout> dispatch(const BufferConfig& config, std::span<const RankInput> inputs) {
  const int num_ranks = static_cast<int>(inputs.size());
  config.validate(num_ranks);
  const int epr = config.num_local_experts(num_ranks);
  const int top_k = config.top_k;
  const int64_t hidden = config.hidden;
  std::vector<RankLayout> out(static_cast<std::size_t>(num_ranks));

  // Pass 1: per (source, token) destination mask, with input checks.
  std::vector<std::vector<uint32_t>> masks(inputs.size());
  for (int s = 0; s < num_ranks; ++s) {
    const RankInput& in = inputs[static_cast<std::size_t>(s)];
    WEFT_CHECK(in.num_tokens >= 0 && in.num_tokens <= config.max_tokens, "rank ", s, ": ",
               in.num_tokens, " tokens, the buffer holds at most ", config.max_tokens);
    const auto t_count = static_cast<std::size_t>(in.num_tokens);
    WEFT_CHECK(in.x.size() == t_count * static_cast<std::size_t>(hidden), "rank ", s,
               ": x has ", in.x.size(), " elements, expected ", t_count * hidden);
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
        const auto* src_row = in.x.data() + t * static_cast<std::size_t>(hidden);
        dst.recv_x.insert(dst.recv_x.end(), src_row, src_row + hidden);
      }
    }
    dst.num_recv = static_cast<int64_t>(dst.recv_src_rank.size());
  }
  return out;
}

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
  WEFT_CHECK(bias0.empty() || bias0.size() == t_count * hidden, "bias0 must be [T, hidden]");
  WEFT_CHECK(bias1.empty() || bias1.size() == t_count * hidden, "bias1 must be [T, hidden]");
  for (int d = 0; d < num_ranks; ++d) {
    WEFT_CHECK(expert_out[static_cast<std::size_t>(d)].size() ==
                   static_cast<std::size_t>(layouts[static_cast<std::size_t>(d)].num_recv) * hidden,
               "expert_out of rank ", d, " must be [num_recv, hidden]");
  }
  std::vector<uint16_t> out(t_count * hidden);
  std::vector<float> acc(hidden);
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

}  // namespace reference
}  // namespace weft::ep
