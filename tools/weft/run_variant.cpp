#include "run_variant.hpp"

#include <algorithm>
#include <filesystem>

#include "weft/core/error.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/schedule_error.hpp"

namespace weft::tools {
namespace {

RunVariant preset_variant(const hstu::HstuVariant& v) {
  return {.name = std::string(v.name),
          .cascade = v.cascade,
          .thread_map = pipeline::ThreadMap::preset(v.thread_map),
          .thread_map_name = std::string(v.thread_map),
          .config = std::nullopt};
}

// Loads a config and checks it against the HSTU schedule the run builds, so that a mistake in it
// is reported with the file before any GPU work.
RunVariant config_variant(const std::string& path) {
  RunVariant v;
  v.name = std::filesystem::path(path).stem().string();
  WEFT_CHECK(!v.name.empty(), path, ": a schedule config file needs a name (its stem names the "
             "run's variant)");
  v.config = pipeline::ScheduleConfig::load(path);  // names the file and the field itself
  if (v.config->thread_map) v.thread_map = *v.config->thread_map;
  v.thread_map_name = v.config->thread_map ? path + ": thread_map" : "legacy (no thread_map)";
  const pipeline::Schedule schedule = v.schedule(hstu::hstu_schedule({.cascade = v.cascade}));
  std::optional<pipeline::CompiledSchedule> compiled;
  try {
    compiled.emplace(schedule);
  } catch (const pipeline::ScheduleError& e) {
    // A rule the tuned schedule breaks comes from the config's value for that task and field.
    const std::string where =
        e.task() ? "task '" + schedule.tasks().at(*e.task()).name() + "', field '" + e.field() + "'"
                 : "field '" + e.field() + "'";
    WEFT_FAIL(path, ": ", where, ": the HSTU schedule refuses this config: ", e.message());
  }
  try {
    v.thread_map.assign(*compiled);
  } catch (const Error& e) {
    WEFT_FAIL(path, ": $.thread_map: ", e.message());
  }
  return v;
}

}  // namespace

pipeline::Schedule RunVariant::schedule(pipeline::Schedule base) const {
  if (config) config->apply(base);
  return base;
}

std::vector<RunVariant> run_variants(const std::vector<std::string>& variant_names,
                                     const std::vector<std::string>& config_paths) {
  std::vector<RunVariant> variants;
  for (const auto& name : variant_names) {
    if (name == "all") {
      for (const auto& v : hstu::hstu_variants()) variants.push_back(preset_variant(v));
    } else {
      variants.push_back(preset_variant(hstu::hstu_variant(name)));
    }
  }
  for (const auto& path : config_paths) {
    RunVariant v = config_variant(path);
    const bool taken = std::any_of(variants.begin(), variants.end(),
                                   [&](const RunVariant& other) { return other.name == v.name; });
    WEFT_CHECK(!taken, path, ": its variant name '", v.name,
               "' (the file's stem) is taken by another variant of the run; rename the file");
    variants.push_back(std::move(v));
  }
  WEFT_CHECK(!variants.empty(), "nothing to run: give --variant or --config");
  return variants;
}

}  // namespace weft::tools
