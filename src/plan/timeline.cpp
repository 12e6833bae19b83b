#include "weft/plan/timeline.hpp"

#include <map>

namespace weft::plan {

const char* to_string(WaitRule rule) noexcept {
  switch (rule) {
    case WaitRule::kSameLookahead: return "same_lookahead";
    case WaitRule::kSyncCpu: return "sync_cpu";
    case WaitRule::kSyncGpu: return "sync_gpu";
    case WaitRule::kSyncBoth: return "sync_both";
    case WaitRule::kTicket: return "ticket";
    case WaitRule::kStreamOrder: return "stream_order";
  }
  return "unknown";
}

std::vector<ThreadLoad> thread_loads(const Timeline& timeline) {
  std::map<std::string, ThreadLoad> by_thread;
  for (const auto& thread : timeline.threads) by_thread[thread].thread = thread;
  for (const auto& span : timeline.host) {
    auto& load = by_thread[span.thread];
    load.thread = span.thread;
    load.busy_us += span.end_us - span.start_us;
  }
  for (const auto& wait : timeline.waits) {
    if (wait.rule == WaitRule::kSyncGpu) continue;  // a GPU-side wait blocks a stream, not a thread
    by_thread[wait.consumer_thread].wait_us += wait.waited_us;
  }
  std::vector<ThreadLoad> loads;
  for (const auto& thread : timeline.threads) loads.push_back(by_thread[thread]);
  return loads;
}

}  // namespace weft::plan
