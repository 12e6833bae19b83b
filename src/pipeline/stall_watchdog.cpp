#include "stall_watchdog.hpp"

#include <algorithm>
#include <utility>

namespace weft::pipeline::detail {

namespace {

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

StallWatchdog::StallWatchdog(double after_s, std::function<void(double)> report)
    : after_(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::duration<double>(after_s))),
      report_(std::move(report)),
      thread_([this] { watch(); }) {}

StallWatchdog::~StallWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  thread_.join();
}

void StallWatchdog::arm() noexcept {
  generation_.fetch_add(1, std::memory_order_relaxed);
  start_ns_.store(now_ns(), std::memory_order_release);
}

void StallWatchdog::disarm() noexcept { start_ns_.store(0, std::memory_order_release); }

void StallWatchdog::watch() {
  // Unarmed (or reported), the thread looks again every quarter of the threshold: an arm() makes
  // no call that could wake it.
  const auto poll = std::max<std::chrono::nanoseconds>(after_ / 4, std::chrono::milliseconds(10));
  std::uint64_t reported = 0;
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    // The start first: arm() counts the generation before it stores the start.
    const std::int64_t start = start_ns_.load(std::memory_order_acquire);
    const std::uint64_t generation = generation_.load(std::memory_order_relaxed);
    if (start == 0 || generation == reported) {
      stop_cv_.wait_for(lock, poll, [&] { return stopping_; });
      continue;
    }
    const std::int64_t late_ns = now_ns() - start - after_.count();
    if (late_ns < 0) {
      stop_cv_.wait_for(lock, std::chrono::nanoseconds(-late_ns), [&] { return stopping_; });
      continue;
    }
    // Still the same progress()?
    if (start_ns_.load(std::memory_order_acquire) != start) continue;
    reported = generation;
    lock.unlock();
    report_(static_cast<double>(now_ns() - start) * 1e-9);
    lock.lock();
  }
}

}  // namespace weft::pipeline::detail
