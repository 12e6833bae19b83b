// The engine's Signal (engine_core.hpp): spin on the value for a while, then sleep on a futex;
// and how many CPUs this process may run on (what decides whether spinning pays).
#include <climits>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>
#endif

#include "engine_core.hpp"
#include "weft/pipeline/engine.hpp"

namespace weft::pipeline {

std::size_t usable_cpus() noexcept {
#if defined(__linux__)
  // The affinity mask, not the machine: a launcher such as mpirun binds each rank to one core
  // by default, and spinners there would take the core of the thread they wait for.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<std::size_t>(CPU_COUNT(&set));
#endif
  return std::thread::hardware_concurrency();
}

namespace detail {

void wait_for_change(Signal& signal, std::uint32_t old, std::int64_t spin_ns) noexcept {
  // Rounds of kNumPauses pauses (about 2 us), each followed by a yield: where another rank's
  // threads or NCCL's share the cores, a spinner gives its core back every round instead of
  // holding it for all of spin_ns. One round also when spin_ns == 0.
  constexpr int kNumPauses = 32;
  constexpr int kNumYields = 16;
  const bool spin = spin_ns > 0;  // no clock reads on the sleeping configuration's path
  const auto spin_end =
      spin ? std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns)
           : std::chrono::steady_clock::time_point{};
  do {
    for (int i = 0; i < kNumPauses; ++i) {
      if (signal.value.load(std::memory_order_acquire) != old) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    if (spin) std::this_thread::yield();
  } while (spin && std::chrono::steady_clock::now() < spin_end);
  for (int i = 0; i < kNumYields; ++i) {
    if (signal.value.load(std::memory_order_acquire) != old) return;
    std::this_thread::yield();
  }
  if (signal.value.load(std::memory_order_acquire) == old) {
    signal.num_sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (signal.value.load(std::memory_order_seq_cst) == old) {
#if defined(__linux__)
      // The kernel re-checks value == old atomically before sleeping.
      timespec timeout{0, 50'000'000};
      syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&signal.value), FUTEX_WAIT_PRIVATE, old,
              &timeout, nullptr, 0);
#else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
    }
    signal.num_sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
}

void wake_all(Signal& signal) noexcept {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (signal.num_sleepers.load(std::memory_order_seq_cst) == 0) return;
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&signal.value), FUTEX_WAKE_PRIVATE, INT_MAX,
          nullptr, nullptr, 0);
#endif
}

}  // namespace detail
}  // namespace weft::pipeline
