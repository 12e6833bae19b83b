// weft::pipeline::detail::StallWatchdog: the stall report of the sequential executor (private
// header). Its bodies run on the caller's thread, so no one waits for them there; this thread
// watches the clock instead.
//
// Contract: between arm() and disarm() (one progress()), `report(seconds)` is called once, on the
// watchdog's thread, when the progress() has run for about `after_s` (at most a quarter of it
// late). arm() and disarm() are two atomic stores each: the caller's path takes no lock and
// wakes no thread. The destructor joins the thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace weft::pipeline::detail {

class StallWatchdog {
 public:
  StallWatchdog(double after_s, std::function<void(double seconds)> report);
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;
  ~StallWatchdog();

  void arm() noexcept;     // a progress() starts now
  void disarm() noexcept;  // it returned

 private:
  void watch();

  std::chrono::nanoseconds after_;
  std::function<void(double)> report_;
  // The armed progress()'s start on the steady clock (ns), 0 while disarmed; its number.
  std::atomic<std::int64_t> start_ns_{0};
  std::atomic<std::uint64_t> generation_{0};
  std::mutex mutex_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace weft::pipeline::detail
