// weft::ep's symmetric window: the byte offsets of its regions (params.hpp WindowLayout).
#include <algorithm>
#include <cstdint>

#include "params.hpp"

namespace weft::ep::detail {
namespace {

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

WindowLayout make_window_layout(int num_ranks, int64_t max_tokens, int64_t hidden, int top_k,
                                int num_experts, int expand_factor) {
  const auto R = uint64_t(num_ranks);
  const auto cap = R * uint64_t(max_tokens) * uint64_t(std::max(1, expand_factor));
  const uint64_t expand_rows = expand_factor > 0 ? cap : 0;
  WindowLayout l;
  uint64_t at = 0;
  auto region = [&](uint64_t bytes) {
    const uint64_t start = at;
    at = align_up(at + bytes, 256);
    return start;
  };
  l.flags = region(sizeof(uint64_t) * kNumFlagKinds * kMaxRanks);
  l.count_matrix = region(sizeof(uint64_t) * 2 * R * (R + 1));
  l.expert_matrix = region(sizeof(uint64_t) * 2 * uint64_t(num_experts));
  l.comb_flags = region(sizeof(uint64_t) * R * uint64_t(max_tokens));
  l.recv_src = region(sizeof(int32_t) * 2 * cap);
  l.recv_expert_idx = region(sizeof(int32_t) * cap * uint64_t(top_k));
  l.recv_weights = region(sizeof(float) * cap * uint64_t(top_k));
  l.recv_x = region(2 * cap * uint64_t(hidden));
  l.comb_x = region(2 * R * uint64_t(max_tokens) * uint64_t(hidden));
  l.comb_w = region(sizeof(float) * R * uint64_t(max_tokens) * uint64_t(top_k));
  l.expand_matrix =
      region(expand_factor > 0 ? sizeof(uint64_t) * 2 * R * uint64_t(num_experts) : 0);
  l.expand_chain = region(sizeof(int32_t) * 2 * expand_rows);
  l.total_bytes = at;
  return l;
}

}  // namespace weft::ep::detail
