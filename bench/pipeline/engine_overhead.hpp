// Host overhead of one Engine::progress() of the HSTU schedule with empty task bodies, per
// variant; shared by the host-backend and CUDA-backend benchmark programs.
#pragma once

#include <benchmark/benchmark.h>

#include <functional>
#include <memory>
#include <string>

#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/pipeline.hpp"

namespace weft::pipeline::bench {

// Registers two benchmarks per HSTU variant: the default options (threads spin on hand-offs
// where the machine has the cores) and ".../nospin" (EngineOptions::spin_us = 0: every wait that
// is not already satisfied sleeps). make_backend gives each engine its backend.
inline void register_engine_overhead(
    const std::string& backend_name,
    std::function<std::unique_ptr<Backend>()> make_backend) {
  for (const hstu::HstuVariant& variant : hstu::hstu_variants())
    for (const bool spin : {true, false}) {
      const std::string name =
          "progress/" + backend_name + "/" + std::string(variant.name) + (spin ? "" : "/nospin");
      const EngineOptions options{.spin_us = spin ? -1.0 : 0.0};
      benchmark::RegisterBenchmark(
          name.c_str(),
          [variant, make_backend, options](benchmark::State& state) {
            Engine engine(hstu::hstu_schedule({.cascade = variant.cascade}),
                          ThreadMap::preset(variant.thread_map), make_backend(), options);
            engine.set_source([](Batch&) { return true; });   // endless: steady state only
            for (int i = 0; i < 100; ++i) engine.progress();  // prefill and warm-up
            for (auto _ : state) {
              auto step = engine.progress();
              benchmark::DoNotOptimize(step);
            }
            engine.synchronize();
            state.counters["threads"] = static_cast<double>(engine.threads().num_threads());
          })
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace weft::pipeline::bench
