// What `weft run hstu` runs: the HSTU preset variants (cascade + thread-map preset) and schedule
// configs loaded from files (the JSON `weft plan --suggest --config-out` writes, or one written
// by hand), each as one RunVariant.
//
// A config's variant is hstu_schedule() (the d3 cascade, prefetch on) with the config applied
// (ScheduleConfig::apply) under the config's thread map, or the legacy map where it has none: the
// reading ScheduleConfig's own documentation gives. Its name is the file's stem
// ("weft-suggest-1" for weft-suggest-1.json), which names its trace and its rows.
//
//   auto variants = run_variants({"full_split_d6"}, {"weft-suggest-1.json"});
//   Engine engine(variants[1].schedule(rank.schedule(variants[1].cascade)), variants[1].thread_map,
//                 CudaBackend(device));
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/schedule_config.hpp"
#include "weft/pipeline/thread_map.hpp"

namespace weft::tools {

struct RunVariant {
  std::string name;
  hstu::HstuCascade cascade = hstu::HstuCascade::kD3;
  pipeline::ThreadMap thread_map = pipeline::ThreadMap::legacy();
  std::string thread_map_name;  // the preset's name, or "<file>: thread_map"
  std::optional<pipeline::ScheduleConfig> config;

  // `base` (hstu_schedule of this cascade, with the caller's bodies) with the config applied.
  pipeline::Schedule schedule(pipeline::Schedule base) const;
};

// The preset variants named ("all": every one, in hstu_variants() order), then one variant per
// config file. Everything is checked here, before a GPU is touched: an unknown variant, an
// unreadable or malformed file, and a config the HSTU schedule refuses (a task it lacks, a
// lookahead its rules refuse, a thread map that does not cover it) are weft::Error naming the
// file and the JSON path of the field; two variants of one name are refused.
std::vector<RunVariant> run_variants(const std::vector<std::string>& variant_names,
                                     const std::vector<std::string>& config_paths);

}  // namespace weft::tools
