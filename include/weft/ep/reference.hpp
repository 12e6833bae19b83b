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
//  - fp8 (DispatchOptions::fp8): each rank's x_fp8 holds packed rows (types.hpp, Fp8RowLayout)
//    and they are moved as opaque bytes into recv_x_fp8; everything else is as for bf16.
//  - expanded (DispatchOptions::expand, types.hpp ExpandOptions; needs
//    BufferConfig::expand_factor >= 1, the capacity): rank d receives one row per
//    (source rank, source token, distinct local expert e of the token on d), in expert-major
//    segments (segment e: its rows in (source rank, source token) order, then padding rows up to
//    the aligned size). A row's recv_expert_idx / recv_weights mark only the selections of its
//    own expert (-1 / 0 elsewhere); a padding row has source (-1, -1), no selection and a zero
//    payload (on the GPU, zero only with zero_padding, otherwise not written: the reference's
//    zeros there are not part of the contract). Overflow (aligned rows above the capacity): rank
//    d receives no row (num_recv = 0), overflowed is set and rows_required says how many rows it
//    needed; counts and segments are still reported. combine of an expanded dispatch: rank d
//    first sums each source token's rows in row order (ascending local expert) in fp32 from 0
//    and rounds that to bf16, once per (token, d); the source then reduces these as above.
//    combine of a dispatch in which any rank overflowed throws.
//  - combine_weights: per token, 0 + each contributing rank's row of weights, ranks ascending,
//    in fp32 (the GPU's combined_weights, bit for bit).
//  - tokens over max_tokens (deduplicated): when any rank's T exceeds max_tokens, every rank
//    receives nothing and reports tokens_required = the largest T; combine of it throws.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "weft/ep/types.hpp"

namespace weft::ep::reference {

struct RankInput {
  int64_t num_tokens = 0;              // T of this rank
  std::vector<uint16_t> x;             // [num_tokens, hidden] bf16 bits
  std::vector<uint8_t> x_fp8;          // fp8 dispatch: [num_tokens, Fp8RowLayout::row_bytes]
  std::vector<int64_t> topk_idx;       // [num_tokens, top_k], -1 = no selection
  std::vector<float> topk_weights;     // [num_tokens, top_k]
};

struct RankLayout {
  int64_t num_recv = 0;                   // rows this rank received (0 when it overflowed)
  std::vector<int32_t> recv_src_rank;     // [num_recv]
  std::vector<int32_t> recv_src_token;    // [num_recv]
  std::vector<int32_t> recv_expert_idx;   // [num_recv, top_k], local ids or -1
  std::vector<float> recv_weights;        // [num_recv, top_k], 0 where not local
  std::vector<uint16_t> recv_x;           // [num_recv, hidden] (bf16 dispatch)
  std::vector<uint8_t> recv_x_fp8;        // [num_recv, Fp8RowLayout::row_bytes] (fp8 dispatch)
  std::vector<int32_t> tokens_per_local_expert;  // [num_experts / num_ranks]
  // [num_ranks][num_ranks], the same at every rank (DeepEP's rank_prefix_matrix): [i][j] = rows
  // rank j receives from ranks 0..i. Deduplicated layout only (empty when expanded).
  std::vector<int32_t> rank_prefix_matrix;
  // Source side: send_slot[t * num_ranks + d] = the row of this rank's token t at rank d, or -1
  // (expanded: its first row there, the one of its lowest local expert).
  std::vector<int32_t> send_slot;         // [num_tokens, num_ranks]
  int64_t num_tokens = 0;                 // this rank's T (RankInput::num_tokens)
  // Expanded layout only.
  bool expanded = false;
  std::vector<int64_t> segment_begin;     // [num_experts / num_ranks + 1]; last = aligned total
  int64_t rows_required = 0;              // = segment_begin.back()
  bool overflowed = false;                // rows_required > BufferConfig::expand_capacity(R)
  // Deduplicated layout: 0, or the largest T of any rank where some rank's T exceeded
  // BufferConfig::max_tokens; then no rank received a row (num_recv 0, send_slot all -1, the
  // counts and rank_prefix_matrix 0) and combine throws.
  int64_t tokens_required = 0;
};

struct DispatchOptions {
  bool fp8 = false;  // move RankInput::x_fp8 (hidden must be a multiple of 128) instead of x
  ExpandOptions expand{};  // enabled: the expanded layout (BufferConfig::expand_factor >= 1)
};

// Throws weft::Error on bad input (expert id out of range, sizes that do not match, T above
// max_tokens in an expanded dispatch or above INT32_MAX). A deduplicated dispatch with some T
// above max_tokens moves nothing (RankLayout::tokens_required). inputs.size() is the number of
// ranks.
std::vector<RankLayout> dispatch(const BufferConfig& config, std::span<const RankInput> inputs,
                                 const DispatchOptions& options = {});

// The packed fp8 rows of x ([num_tokens, hidden] bf16): [num_tokens, row_bytes], see types.hpp
// (round_scale: power-of-two scales).
std::vector<uint8_t> cast_to_fp8(int64_t hidden, int64_t num_tokens, std::span<const uint16_t> x,
                                 bool round_scale = false);

// DeepEP's low_latency_dispatch results (weft::ep::LowLatencyTargets, buffer.hpp) of rank
// layout's fixed-stride expanded dispatch: E = num_local_experts segments of S = segment_stride
// rows, G = hidden / 128, every array dense in DeepEP's element order.
struct LowLatencyLayout {
  std::vector<int32_t> src_info;      // [E, S]: source token, -1 for padding rows
  std::vector<int64_t> layout_range;  // [E, R]: rows from ranks < r << 32 | rows from rank r
  // fp8 only: scales[(e * G + g) * S + s] (fp32 [E, S, G] at strides (S * G, 1, S)); padding
  // rows hold the reference's zero rows' scales (0), which are not part of the contract.
  std::vector<float> scales;
  // fp8 with G a multiple of 4 only: ue8m0[(e * G / 4 + w) * S + s] (int32 [E, S, G / 4] at
  // strides (S * G / 4, 1, S)), byte i of word w = (bits of scale 4w + i >> 23) & 0xFF.
  std::vector<int32_t> ue8m0;
};
// Throws unless layout is an expanded dispatch with segment_begin[e] = e * segment_stride.
LowLatencyLayout low_latency_layout(const BufferConfig& config, int num_ranks,
                                    int64_t segment_stride, const RankLayout& layout);

// The inverse of the packing: payload [num_tokens, hidden] e4m3 bytes and scales
// [num_tokens, hidden / 128] from packed rows. Throws if a padding byte is not zero.
struct Fp8Unpacked {
  std::vector<uint8_t> payload;  // [num_tokens, hidden] e4m3 bytes
  std::vector<float> scales;     // [num_tokens, hidden / 128], row-major
};
Fp8Unpacked unpack_fp8(int64_t hidden, int64_t num_tokens, std::span<const uint8_t> rows);
// payload * scale per element, [num_tokens, hidden] fp32.
std::vector<float> dequantize_fp8(int64_t hidden, int64_t num_tokens,
                                  std::span<const uint8_t> rows);

// cumulative_local_expert_recv_stats: stats[e] += layout.tokens_per_local_expert[e] (wrapping
// uint32 arithmetic, as on the GPU). stats: [num_experts / num_ranks].
void accumulate_local_expert_recv_stats(const RankLayout& layout, std::span<uint32_t> stats);

// The combine output of `rank`: [num_tokens of rank, hidden] bf16. expert_out[d] holds rank d's
// expert outputs, [layouts[d].num_recv, hidden]. bias0 / bias1: empty or [num_tokens, hidden].
std::vector<uint16_t> combine(const BufferConfig& config, int rank,
                              std::span<const RankLayout> layouts,
                              std::span<const std::vector<uint16_t>> expert_out,
                              std::span<const uint16_t> bias0, std::span<const uint16_t> bias1);

// The weighted combine of an expanded dispatch (CombineInputs::source_weights, DeepEP's
// low-latency combine): as combine of an expanded layout without biases, except that rank d's
// partial sum of source token t is, over the token's rows there in row order, from 0 in fp32:
//   partial = fma(w(row), float(y[row]), partial),  w(row) = 0.0f + source_weights[s][t][k]
// over the selections k the row's recv_expert_idx marks (k ascending), then rounded once to
// bf16. source_weights[s]: rank s's [T_s, top_k] fp32.
std::vector<uint16_t> combine_weighted(const BufferConfig& config, int rank,
                                       std::span<const RankLayout> layouts,
                                       std::span<const std::vector<uint16_t>> expert_out,
                                       std::span<const std::vector<float>> source_weights);

// combine's top-k weights (DeepEP's combined_topk_weights) of `rank`: [num_tokens of rank,
// num_weights] fp32, out[t][k] = 0.0f + topk_weights[d][row of t at d][k] over the ranks d that t
// was sent to, in ascending d, each addition in fp32 (0 where t was sent nowhere).
// topk_weights[d]: rank d's [layouts[d].num_recv, num_weights], num_weights in 1..top_k.
// Deduplicated layouts only (throws for an expanded one, or one that moved no rows).
std::vector<float> combine_weights(const BufferConfig& config, int rank,
                                   std::span<const RankLayout> layouts,
                                   std::span<const std::vector<float>> topk_weights,
                                   int num_weights);

// A finite bf16 whose bits name (rank, token, column), for payloads of tests and benchmarks: a
// hash of the three picks the sign, the mantissa and a biased exponent in [min_exponent,
// min_exponent + num_exponents), so a misrouted row cannot look plausible. The default window
// gives |v| in [2^-9, 2^7).
uint16_t identity_bf16(int rank, int64_t token, int64_t col, unsigned min_exponent = 118,
                       unsigned num_exponents = 16);

}  // namespace weft::ep::reference
