#include "weft/plan/timeline.hpp"

#include <algorithm>
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
    case WaitRule::kGpuWait: return "gpu_wait";
  }
  return "unknown";
}

bool is_lookahead_rule(WaitRule rule) noexcept {
  return rule != WaitRule::kTicket && rule != WaitRule::kStreamOrder &&
         rule != WaitRule::kGpuWait;
}

std::vector<ThreadLoad> thread_loads(const Timeline& timeline) {
  std::map<std::string, std::vector<const HostSpan*>> by_thread;
  for (const auto& span : timeline.host) by_thread[span.thread].push_back(&span);
  std::vector<ThreadLoad> loads;
  for (const auto& thread : timeline.threads) {
    ThreadLoad load;
    load.thread = thread;
    auto& spans = by_thread[thread];
    std::sort(spans.begin(), spans.end(),
              [](const HostSpan* a, const HostSpan* b) { return a->start_us < b->start_us; });
    // A thread runs its tasks back to back unless it waits: every gap before one of its tasks,
    // from the start of the progress on, is time spent waiting (counted once, however many
    // producers it waited for at the same time).
    double free_at = 0;
    for (const HostSpan* span : spans) {
      load.busy_us += span->end_us - span->start_us;
      load.wait_us += std::max(0.0, span->start_us - free_at);
      free_at = std::max(free_at, span->end_us);
    }
    loads.push_back(load);
  }
  return loads;
}

}  // namespace weft::plan
