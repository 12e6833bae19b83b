// weft::pipeline::StepRule: which tasks run at which internal iteration, on which batch.
//
// With L = max lookahead, a task of lookahead k runs at internal iteration i iff
//   L - k <= i < num_pulled + L - k,
// and then works on batch i - (L - k). Iteration i pulls batch i from the source (while it has
// data), so prefill, steady state and drain all follow from this one rule: M batches in give M
// la = 0 runs (M results), at iterations L .. L + M - 1.
//
//   StepRule rule(2);
//   rule.runs(2, 0, 1);      // true: the la = 2 task starts batch 0 at iteration 0
//   rule.batch_at(0, 2);     // 0: at iteration 2 the la = 0 tasks finish batch 0
#pragma once

#include <cstdint>

namespace weft::pipeline {

class StepRule {
 public:
  explicit constexpr StepRule(int max_lookahead) noexcept : max_lookahead_(max_lookahead) {}

  constexpr int max_lookahead() const noexcept { return max_lookahead_; }
  // The batch a task of lookahead `la` works on at iteration i (negative or >= num_pulled when
  // it does not run).
  constexpr std::int64_t batch_at(int la, std::int64_t iteration) const noexcept {
    return iteration - (max_lookahead_ - la);
  }
  constexpr bool runs(int la, std::int64_t iteration, std::int64_t num_pulled) const noexcept {
    const std::int64_t batch = batch_at(la, iteration);
    return batch >= 0 && batch < num_pulled;
  }
  // Internal iterations that M batches need in all (prefill + steady + drain).
  constexpr std::int64_t num_iterations(std::int64_t num_batches) const noexcept {
    return num_batches == 0 ? 0 : num_batches + max_lookahead_;
  }

 private:
  int max_lookahead_;
};

}  // namespace weft::pipeline
