// weft::hstu's preset schedule, the HSTU benchmark's (docs/pipeline.md "HSTU presets"): 14 tasks on
// the streams default, memcpy, data_dist and prefetch, in two lookahead cascades, and the HSTU
// benchmark's nine variants (cascade + thread map). Bodies are the caller's; a task without one
// does nothing. Part of weft::core (no CUDA): the engine's tests and the planner use it.
//
//   auto variant = hstu_variant("full_split_d6");
//   Engine engine(hstu_schedule({.cascade = variant.cascade, .bodies = my_bodies}),
//                 ThreadMap::preset(variant.thread_map), CudaBackend(0));
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>

#include "weft/pipeline/schedule.hpp"

namespace weft::hstu {

using pipeline::Schedule;
using pipeline::TaskBody;

// d3: h2d / start_shuffle / finish_shuffle at la 2, start_input_dist / wait_input_dist /
// prefetch_embeddings at la 1, the rest at 0. d6: h2d@5, start_shuffle@4, finish_shuffle@3,
// start_input_dist@3, wait_input_dist@2, prefetch_embeddings@1, the rest at 0.
enum class HstuCascade { kD3, kD6 };
std::string_view to_string(HstuCascade cascade) noexcept;

struct HstuOptions {
  HstuCascade cascade = HstuCascade::kD3;  // the lookaheads (above)
  // With prefetch, prefetch_embeddings exists and backward same_progress_syncs on it (kBoth).
  bool prefetch = true;
  // Task name -> body; an unknown name is an error.
  std::map<std::string, TaskBody, std::less<>> bodies;
};

// Throws weft::Error for a body whose name is not an HSTU task.
Schedule hstu_schedule(const HstuOptions& options = {});
// The 14 task names in declaration order.
std::span<const std::string_view> hstu_task_names() noexcept;

struct HstuVariant {
  std::string_view name;  // e.g. "full_split_d6"
  HstuCascade cascade;          // the lookaheads it runs with
  std::string_view thread_map;  // a ThreadMap::preset name
};
// legacy_none, default_d3, by_stream_d3, per_task_d3, io_prefetch_compute_d3,
// io_data_dist_compute_d3, full_split_d3, default_d6, full_split_d6.
std::span<const HstuVariant> hstu_variants() noexcept;
// Throws weft::Error naming the known variants for an unknown name.
const HstuVariant& hstu_variant(std::string_view name);

}  // namespace weft::hstu
