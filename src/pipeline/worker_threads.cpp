// The engine's persistent host threads (one per thread-map entry): starting them, handing each
// step to them, waiting for them (with the stall report), and what each runs.
#include <cstdio>
#include <string>

#include "engine_core.hpp"
#include "weft/core/error.hpp"
#include "weft/pipeline/task_context.hpp"

namespace weft::pipeline::detail {

EngineCore::WorkerThreads::~WorkerThreads() {
  if (threads.empty()) return;
  stop();
  for (std::thread& t : threads) t.join();
}

void EngineCore::start_workers() {
  const auto num_threads = static_cast<std::uint32_t>(threads_.num_threads());
  workers_.stop = [this] {
    stopping_.store(true, std::memory_order_release);
    go_.value.fetch_add(1, std::memory_order_release);
    wake_all(go_);
  };
  remaining_.value.store(num_threads, std::memory_order_relaxed);
  workers_.threads.reserve(num_threads);
  for (std::uint32_t t = 0; t < num_threads; ++t) {
    workers_.threads.emplace_back([this, t] { worker_main(t); });
  }
  wait_for_workers();
}

void EngineCore::wait_for_workers() {
  bool reported = stall_reported_ || options_.stall_report_s <= 0;
  // Once the hook has thrown, the step is aborted: no second check.
  bool checking = options_.interrupt_check != nullptr;
  auto next_check = std::chrono::steady_clock::now() + kInterruptCheckInterval;
  std::uint32_t r;
  while ((r = remaining_.value.load(std::memory_order_acquire)) != 0) {
    wait_for_change(remaining_, r, spin_ns_);
    if (reported && !checking) continue;
    const auto now = std::chrono::steady_clock::now();
    if (checking && now >= next_check) {
      next_check = now + kInterruptCheckInterval;
      try {
        options_.interrupt_check();
      } catch (...) {
        checking = false;
        fail(std::current_exception());
      }
    }
    if (reported) continue;
    const double seconds = std::chrono::duration<double>(now - call_start_).count();
    if (seconds >= options_.stall_report_s) {
      report_stall(seconds);
      reported = stall_reported_ = true;
    }
  }
}

void EngineCore::report_stall(double seconds) const {
  char header[160];
  std::snprintf(header, sizeof(header),
                "weft engine: progress() has run %.1f s (iteration %lld):\n", seconds,
                static_cast<long long>(reported_iteration_.load(std::memory_order_relaxed)));
  std::string text = header;
  for (std::uint32_t t = 0; t < threads_.num_threads(); ++t) {
    const ThreadProgress::State p = progress_by_thread_[t].get();
    const auto& tasks = threads_.tasks_of_thread[t];
    text += "  thread '" + threads_.thread_names[t] + "': ";
    if (p.position >= tasks.size()) {
      text += "done\n";
      continue;
    }
    text += "in task '" + schedule_.task(tasks[p.position]).name() + "'";
    switch (p.wait) {
      case ThreadProgress::kTask:
        text += ", waiting for task '" + schedule_.task(p.wait_target).name() + "'";
        break;
      case ThreadProgress::kTicket:
        text += ", waiting for collective ticket " + std::to_string(p.wait_target - ticket_base_) +
                " (now serving " +
                std::to_string(ticket_.value.load(std::memory_order_relaxed) - ticket_base_) + ")";
        break;
      default:
        text += ", running its body";
    }
    text += "\n";
  }
  std::fputs(text.c_str(), stderr);
}

void EngineCore::worker_main(std::uint32_t thread) {
  std::uint32_t seen = 0;  // go_ is not bumped before every worker has reported below
  auto report_done = [this] {
    if (remaining_.value.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      wake_all(remaining_);
    }
  };
  try {
    backend_->on_thread_start();
    run_inits(thread);
  } catch (...) {
    fail(std::current_exception());
  }
  report_done();
  const std::vector<TaskId>& tasks = threads_.tasks_of_thread[thread];
  while (true) {
    std::uint32_t v;
    while ((v = go_.value.load(std::memory_order_acquire)) == seen) {
      wait_for_change(go_, seen, spin_ns_);
    }
    seen = v;
    if (stopping_.load(std::memory_order_acquire)) return;
    ThreadProgress& progress = progress_by_thread_[thread];
    for (std::uint32_t i = 0; i < tasks.size(); ++i) {
      const TaskId t = tasks[i];
      progress.set(i);
      try {
        run_task(plans_[t], thread, true);
      } catch (const AbortSignal&) {
        break;
      } catch (...) {
        fail(std::current_exception());
        break;
      }
    }
    progress.set(static_cast<std::uint32_t>(tasks.size()));
    report_done();
  }
}

}  // namespace weft::pipeline::detail
