// The CPU reference of weft::ep dispatch and combine: plain C++, no CUDA. It is the contract the
// GPU implementation must reproduce element for element, and the oracle of the GPU tests.
//
//   std::vector<weft::ep::reference::RankInput> inputs(num_ranks);   // fill x, topk_idx, weights
//   auto layouts = weft::ep::reference::dispatch(config, inputs);
//   auto y0 = weft::ep::reference::combine(config, 0, layouts, expert_outputs, {}, {});
//
// Semantics (identical on the GPU):
//  - rank d hosts the experts [d * E/R, (d+1) * E/R); topk_idx == -1 is "no selection";
//  - token t of rank s is sent to rank d at most once, when any of its selections is on d
//    (per-(token, destination) dedup);
//  - rank d's received rows are ordered by source rank, then source token: the rows from rank s
//    start at sum_{s' < s} count(s' -> d);
//  - per received row: its local expert ids (the selection's expert minus d * E/R where that
//    expert is on d, else -1) and weights (the selection's weight where the expert is local,
//    else 0), in the token's top-k order;
//  - tokens_per_local_expert[e] counts received rows with local expert e among their selections;
//  - combine: out[t] = bf16( ((0 + bias0[t]) + bias1[t]) + sum over d ascending with t sent to
//    d of expert_out_d[row of t at d] ), every addition in fp32, in exactly this order. A token
//    sent nowhere returns its bias (or zero).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "weft/ep/types.hpp"

namespace weft::ep::reference {

struct RankInput {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;             // [num_tokens, hidden] bf16 bits
  std::vector<int64_t> topk_idx;       // [num_tokens, top_k], -1 = no selection
  std::vector<float> topk_weights;     // [num_tokens, top_k]
};

struct RankLayout {
  int64_t num_recv = 0;
  std::vector<int32_t> recv_src_rank;     // [num_recv]
  std::vector<int32_t> recv_src_token;    // [num_recv]
  std::vector<int32_t> recv_expert_idx;   // [num_recv, top_k], local ids or -1
  std::vector<float> recv_weights;        // [num_recv, top_k], 0 where not local
  std::vector<uint16_t> recv_x;           // [num_recv, hidden]
  std::vector<int32_t> tokens_per_local_expert;  // [num_experts / num_ranks]
  // Source side: send_slot[t * num_ranks + d] = the row of this rank's token t at rank d, or -1.
  std::vector<int32_t> send_slot;         // [num_tokens, num_ranks]
  int64_t num_tokens = 0;
};

// Throws weft::Error on bad input (expert id out of range, T above max_tokens, sizes that do not
// match). inputs.size() is the number of ranks.
std::vector<RankLayout> dispatch(const BufferConfig& config, std::span<const RankInput> inputs);

// The combine output of `rank`: [num_tokens of rank, hidden] bf16. expert_out[d] holds rank d's
// expert outputs, [layouts[d].num_recv, hidden]. bias0 / bias1: empty or [num_tokens, hidden].
std::vector<uint16_t> combine(const BufferConfig& config, int rank,
                              std::span<const RankLayout> layouts,
                              std::span<const std::vector<uint16_t>> expert_out,
                              std::span<const uint16_t> bias0, std::span<const uint16_t> bias1);

}  // namespace weft::ep::reference
