// weft::ep::all_to_all_layout: the layout of an all_to_all dispatcher (weft.moe's
// AllToAllDispatcher) in one kernel: per destination rank its sizes, and the order of the
// (destination, token) pairs it sends with their local expert ids. Without it the layout is two
// dozen small torch ops a call, and at a micro-batched step's rate their launches, not the GPU,
// set the step's time.
//
//   weft::ep::AllToAllLayoutParams p;
//   p.topk_idx = idx; p.idx_dtype = weft::ep::DType::kInt64;   // [num_tokens, top_k]
//   p.num_tokens = 1024; p.top_k = 8; p.num_ranks = 8; p.num_local_experts = 16;
//   p.sizes = sizes; p.order = order; p.mine = mine; p.send_idx = send_idx;
//   weft::ep::all_to_all_layout(p, stream);
//
// Contracts (R = num_ranks, T = num_tokens, k = top_k; arrays row-major, on the current device):
//  - A selection e >= 0 belongs to rank e / num_local_experts where that is < R; a negative one
//    selects nothing; one of no rank (e >= R * num_local_experts) selects nothing either and is
//    counted (sizes' third column), so that every rank can refuse it together.
//  - sizes [R, 3] int64: per rank r, its rows (tokens with a selection of r), its entries
//    (selections of r) and, the same in every row, the selections of no rank.
//  - The R * T (destination, token) pairs in destination-major order, those whose token selects
//    the destination first, then the others, each group in that order (a stable sort): order
//    [R * T] int64 holds each pair's token; mine [R * T, k] (bytes 0 or 1) which of its
//    selections are the destination's; send_idx [R * T, k] (idx_dtype) their local expert ids
//    (e % num_local_experts), -1 elsewhere. A dispatch sends the first sum(rows) pairs.
//  - Every element of the four outputs is written; topk_idx is only read. T == 0 writes sizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "weft/ep/types.hpp"

namespace weft::ep {

struct AllToAllLayoutParams {
  const void* topk_idx = nullptr;  // [num_tokens, top_k], idx_dtype
  DType idx_dtype = DType::kInt64;  // kInt32 or kInt64
  int64_t num_tokens = 0;           // >= 0
  int top_k = 0;                    // >= 1
  int num_ranks = 0;                // in [1, kMaxAllToAllLayoutRanks]
  int64_t num_local_experts = 0;    // experts per rank, >= 1
  int64_t* sizes = nullptr;         // [num_ranks, 3]
  int64_t* order = nullptr;         // [num_ranks * num_tokens]
  uint8_t* mine = nullptr;          // [num_ranks * num_tokens, top_k]
  void* send_idx = nullptr;         // [num_ranks * num_tokens, top_k], idx_dtype
};

// A token's destinations are a bit mask of one word.
inline constexpr int kMaxAllToAllLayoutRanks = 64;

// Enqueues the kernel on stream, a stream of the current device (weft::Error for bad params).
void all_to_all_layout(const AllToAllLayoutParams& params, cudaStream_t stream);

}  // namespace weft::ep
