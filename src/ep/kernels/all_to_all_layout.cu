// weft::ep::all_to_all_layout (weft/ep/all_to_all_layout.hpp): one block per destination rank.
// Block r reads every token's selections twice: first it counts, per thread over a run of
// consecutive tokens, the tokens that select r, the pairs of lower destinations that come
// before r's, every selected pair, r's entries and the selections of no rank; a block scan and
// sums then give each thread where its tokens' pairs go, and the second pass writes them. The
// block owns r's T pairs, so no two blocks write one element and no block waits for another.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/ep/all_to_all_layout.hpp"

namespace weft::ep {
namespace {

constexpr int kThreads = 512;

struct Counts {
  int64_t own = 0;      // tokens that select this block's rank
  int64_t before = 0;   // selected pairs of lower ranks
  int64_t all = 0;      // selected pairs of every rank
  int64_t entries = 0;  // selections of this block's rank
  int64_t no_rank = 0;  // selections e >= R * num_local_experts
};

struct SumCounts {
  __device__ Counts operator()(const Counts& a, const Counts& b) const {
    return {a.own + b.own, a.before + b.before, a.all + b.all, a.entries + b.entries,
            a.no_rank + b.no_rank};
  }
};

// The rank of selection e: in [0, R) for a rank's expert, -1 for none, R for no rank's.
template <typename Idx>
__device__ int rank_of(Idx e, int64_t num_local_experts, int num_ranks) {
  if (e < 0) return -1;
  const int64_t rank = static_cast<int64_t>(e) / num_local_experts;
  return rank < num_ranks ? static_cast<int>(rank) : num_ranks;
}

template <typename Idx>
__device__ uint64_t destinations(const Idx* row, int top_k, int64_t num_local_experts,
                                 int num_ranks) {
  uint64_t mask = 0;
  for (int j = 0; j < top_k; ++j) {
    const int rank = rank_of(row[j], num_local_experts, num_ranks);
    if (rank >= 0 && rank < num_ranks) mask |= uint64_t{1} << rank;
  }
  return mask;
}

template <typename Idx>
__global__ void __launch_bounds__(kThreads)
    all_to_all_layout_kernel(AllToAllLayoutParams p) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  using Reduce = cub::BlockReduce<Counts, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ Counts block_counts;

  const Idx* idx = static_cast<const Idx*>(p.topk_idx);
  Idx* send_idx = static_cast<Idx*>(p.send_idx);
  const int r = static_cast<int>(blockIdx.x);
  const int64_t T = p.num_tokens;
  const int k = p.top_k;
  const uint64_t lower = (uint64_t{1} << r) - 1;
  // Each thread's tokens are consecutive, so thread order is token order.
  const int64_t per_thread = (T + kThreads - 1) / kThreads;
  const int64_t begin = min(T, per_thread * threadIdx.x);
  const int64_t end = min(T, begin + per_thread);

  Counts mine_counts;
  for (int64_t t = begin; t < end; ++t) {
    const Idx* row = idx + t * k;
    const uint64_t mask = destinations(row, k, p.num_local_experts, p.num_ranks);
    mine_counts.own += (mask >> r) & 1;
    mine_counts.before += __popcll(mask & lower);
    mine_counts.all += __popcll(mask);
    for (int j = 0; j < k; ++j) {
      const int rank = rank_of(row[j], p.num_local_experts, p.num_ranks);
      mine_counts.entries += rank == r;
      mine_counts.no_rank += rank == p.num_ranks;
    }
  }
  const Counts total = Reduce(temp.reduce).Reduce(mine_counts, SumCounts{});
  if (threadIdx.x == 0) block_counts = total;
  __syncthreads();  // block_counts is read below; temp is reused by the scan
  int64_t set_before_me = 0;  // r's selected pairs of the threads before this one
  Scan(temp.scan).ExclusiveSum(mine_counts.own, set_before_me);
  const Counts sums = block_counts;

  if (threadIdx.x == 0) {
    p.sizes[r * 3 + 0] = sums.own;
    p.sizes[r * 3 + 1] = sums.entries;
    p.sizes[r * 3 + 2] = sums.no_rank;
  }
  // Pair (r, t): if t selects r, at sums.before + (r's selected pairs before t); else after
  // every selected pair, at sums.all + (the unselected pairs of lower ranks, r * T -
  // sums.before) + (r's unselected pairs before t).
  const int64_t unselected_start = sums.all + int64_t{r} * T - sums.before;
  int64_t set_before = set_before_me;
  for (int64_t t = begin; t < end; ++t) {
    const Idx* row = idx + t * k;
    const bool selects = (destinations(row, k, p.num_local_experts, p.num_ranks) >> r) & 1;
    const int64_t pair = selects ? sums.before + set_before : unselected_start + t - set_before;
    set_before += selects;
    p.order[pair] = t;
    for (int j = 0; j < k; ++j) {
      const bool is_mine = rank_of(row[j], p.num_local_experts, p.num_ranks) == r;
      p.mine[pair * k + j] = is_mine;
      send_idx[pair * k + j] = is_mine ? static_cast<Idx>(row[j] % p.num_local_experts) : Idx{-1};
    }
  }
}

}  // namespace

void all_to_all_layout(const AllToAllLayoutParams& p, cudaStream_t stream) {
  WEFT_CHECK(p.idx_dtype == DType::kInt32 || p.idx_dtype == DType::kInt64,
             "all_to_all_layout: topk_idx must be int32 or int64, got ", dtype_name(p.idx_dtype));
  WEFT_CHECK(p.num_ranks >= 1 && p.num_ranks <= kMaxAllToAllLayoutRanks,
             "all_to_all_layout: num_ranks must be in [1, ", kMaxAllToAllLayoutRanks, "], got ",
             p.num_ranks);
  WEFT_CHECK(p.num_tokens >= 0, "all_to_all_layout: num_tokens must be >= 0, got ",
             p.num_tokens);
  WEFT_CHECK(p.top_k >= 1, "all_to_all_layout: top_k must be >= 1, got ", p.top_k);
  WEFT_CHECK(p.num_local_experts >= 1, "all_to_all_layout: num_local_experts must be >= 1, got ",
             p.num_local_experts);
  // Element indices of mine and send_idx fit int64: R * T * k.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  WEFT_CHECK(p.num_tokens <= kMax / p.num_ranks / p.top_k, "all_to_all_layout: num_tokens ",
             p.num_tokens, " x num_ranks x top_k overflows int64");
  WEFT_CHECK(p.sizes != nullptr, "all_to_all_layout: sizes is null");
  WEFT_CHECK(p.num_tokens == 0 || (p.topk_idx != nullptr && p.order != nullptr &&
                                   p.mine != nullptr && p.send_idx != nullptr),
             "all_to_all_layout: a null array with num_tokens ", p.num_tokens);
  if (p.idx_dtype == DType::kInt64) {
    all_to_all_layout_kernel<int64_t><<<p.num_ranks, kThreads, 0, stream>>>(p);
  } else {
    all_to_all_layout_kernel<int32_t><<<p.num_ranks, kThreads, 0, stream>>>(p);
  }
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::ep
