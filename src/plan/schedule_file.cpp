#include "weft/plan/schedule_file.hpp"

#include <cstdint>
#include <string>
#include <utility>

#include "core/json_input.hpp"
#include "weft/core/error.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/schedule_config.hpp"
#include "weft/pipeline/schedule_error.hpp"

namespace weft::plan {
namespace {

using json = json_input::Json;
using json_input::element_path;
using json_input::for_each_element;
using json_input::int_at;
using json_input::name_at;
using json_input::names_at;
using json_input::only_keys;
using json_input::required_member;

// Schedule files are small; anything this large is not one.
constexpr std::size_t kMaxScheduleFileBytes = std::size_t(16) << 20;

// Runs `set` (a Task builder call that checks its value) and prefixes its error with `path`.
template <typename Set>
void set_checked(const std::string& path, Set&& set) {
  try {
    set();
  } catch (const Error& e) {
    WEFT_FAIL(path, ": ", e.message());
  }
}

pipeline::CollectiveOp parse_collective_op(const json& entry, const std::string& path,
                                           const std::string& task_stream) {
  only_keys(entry, path, {"kind", "stream", "bytes", "count"});
  pipeline::CollectiveOp op;
  op.kind = name_at(required_member(entry, path, "kind"), path + ".kind");
  op.stream = entry.contains("stream") ? name_at(entry["stream"], path + ".stream") : task_stream;
  if (entry.contains("bytes")) {
    op.num_bytes = json_input::integer_at<std::size_t>(entry["bytes"], path + ".bytes");
  }
  if (entry.contains("count")) {
    op.count = int_at(entry["count"], path + ".count");
    WEFT_CHECK(op.count >= 1, path, ".count: expected >= 1, got ", op.count);
  }
  return op;
}

void parse_edges(const json& entry, const std::string& path, pipeline::Task& task) {
  if (entry.contains("depends_on")) {
    for (const auto& s : names_at(entry["depends_on"], path + ".depends_on")) task.depends_on(s);
  }
  if (entry.contains("cross_iter_depends_on")) {
    for_each_element(entry["cross_iter_depends_on"], path + ".cross_iter_depends_on",
                     "{producer, offset}", [&](const json& edge, const std::string& p) {
                       only_keys(edge, p, {"producer", "offset"});
                       std::string producer =
                           name_at(required_member(edge, p, "producer"), p + ".producer");
                       const int offset = int_at(required_member(edge, p, "offset"), p + ".offset");
                       set_checked(p + ".offset", [&] {
                         task.cross_iter_depends_on(std::move(producer), offset);
                       });
                     });
  }
  if (entry.contains("same_progress_sync")) {
    for_each_element(entry["same_progress_sync"], path + ".same_progress_sync", "{producer, side}",
                     [&](const json& edge, const std::string& p) {
                       only_keys(edge, p, {"producer", "side"});
                       pipeline::SyncSide side = pipeline::SyncSide::kBoth;
                       if (edge.contains("side")) {
                         const std::string text = name_at(edge["side"], p + ".side");
                         set_checked(p + ".side", [&] { side = pipeline::parse_sync_side(text); });
                       }
                       task.same_progress_sync(
                           name_at(required_member(edge, p, "producer"), p + ".producer"), side);
                     });
  }
}

pipeline::Task parse_task(const json& entry, const std::string& path) {
  only_keys(entry, path,
            {"name", "stream", "movable_to", "lookahead", "reads", "writes", "depends_on",
             "cross_iter_depends_on", "same_progress_sync", "collective"});
  pipeline::Task task(name_at(required_member(entry, path, "name"), path + ".name"));
  if (entry.contains("stream")) task.stream(name_at(entry["stream"], path + ".stream"));
  if (entry.contains("movable_to")) {
    task.movable_to(names_at(entry["movable_to"], path + ".movable_to", "stream names"));
  }
  if (entry.contains("lookahead")) {
    const int la = int_at(entry["lookahead"], path + ".lookahead");
    set_checked(path + ".lookahead", [&] { task.lookahead(la); });
  }
  if (entry.contains("reads")) {
    for (const auto& s : names_at(entry["reads"], path + ".reads")) task.reads(s);
  }
  if (entry.contains("writes")) {
    for (const auto& s : names_at(entry["writes"], path + ".writes")) task.writes(s);
  }
  parse_edges(entry, path, task);
  if (entry.contains("collective")) {
    const json& c = entry["collective"];
    if (c.is_boolean()) {
      if (c.get<bool>()) task.collective();
    } else {
      WEFT_CHECK(c.is_array(), path, ".collective: expected true/false or an array of collectives");
      std::vector<pipeline::CollectiveOp> ops;
      for_each_element(c, path + ".collective", "collectives",
                       [&](const json& op, const std::string& p) {
                         ops.push_back(parse_collective_op(op, p, task.stream()));
                       });
      task.collective(std::move(ops));
    }
  }
  return task;
}

void parse_streams(const json& streams, pipeline::Schedule& schedule) {
  for_each_element(streams, "$.streams", "streams", [&](const json& s, const std::string& p) {
    if (s.is_string()) {
      schedule.add_stream(name_at(s, p));
      return;
    }
    only_keys(s, p, {"name", "priority"});
    schedule.add_stream(name_at(required_member(s, p, "name"), p + ".name"),
                        s.contains("priority") ? int_at(s["priority"], p + ".priority") : 0);
  });
}

void parse_thread_maps(const json& maps, ScheduleFile& file) {
  WEFT_CHECK(maps.is_array() && !maps.empty(), "$.thread_maps: expected a non-empty array");
  for (std::size_t i = 0; i < maps.size(); ++i) {
    pipeline::ScheduleConfig config;
    set_checked(element_path("$.thread_maps", i), [&] {
      config = pipeline::ScheduleConfig::parse(json{{"thread_map", maps[i]}}.dump());
    });
    file.thread_maps.push_back(*config.thread_map);
    file.thread_map_names.push_back(maps[i].is_string() ? maps[i].get<std::string>()
                                                        : "explicit " + std::to_string(i));
  }
}

// The JSON path of what a schedule rule's error is about, from the data the error carries.
std::string path_of(const pipeline::ScheduleError& e) {
  if (!e.task()) return "$." + e.field();
  return element_path("$.tasks", *e.task()) + (e.field().empty() ? "" : "." + e.field());
}

// Checks the schedule's own rules (and the costs' tasks and streams) here, so that their errors
// name the JSON path.
void check_rules(const ScheduleFile& file) {
  std::optional<pipeline::CompiledSchedule> compiled;
  try {
    compiled.emplace(file.schedule);
  } catch (const pipeline::ScheduleError& e) {
    WEFT_FAIL(path_of(e), ": ", e.message());
  }
  if (!file.costs) return;
  try {
    file.costs->check_against(*compiled);
  } catch (const Error& e) {
    WEFT_FAIL("$.costs", e.message().substr(1));  // its paths start at the cost model's "$"
  }
}

}  // namespace

ScheduleFile ScheduleFile::parse(std::string_view json_text) {
  const json root = json_input::parse_json(json_text);
  only_keys(root, "$", {"streams", "inputs", "tasks", "thread_maps", "costs"});
  ScheduleFile file;
  if (root.contains("streams")) parse_streams(root["streams"], file.schedule);
  if (root.contains("inputs")) {
    for (const auto& s : names_at(root["inputs"], "$.inputs")) file.schedule.add_input(s);
  }
  WEFT_CHECK(root.contains("tasks") && root["tasks"].is_array() && !root["tasks"].empty(),
             "$.tasks: expected a non-empty array of tasks");
  for_each_element(root["tasks"], "$.tasks", "tasks", [&](const json& t, const std::string& p) {
    file.schedule.add(parse_task(t, p));
  });
  if (root.contains("thread_maps")) {
    parse_thread_maps(root["thread_maps"], file);
  } else {
    for (const char* name : {"legacy", "by_stream", "per_task"}) {
      file.thread_maps.push_back(pipeline::ThreadMap::preset(name));
      file.thread_map_names.push_back(name);
    }
  }
  if (root.contains("costs")) {
    try {
      file.costs = CostModel::parse(root["costs"].dump());
    } catch (const Error& e) {
      // Re-root the cost model's paths under $.costs.
      std::string message = e.message();
      if (message.rfind("$", 0) == 0) message = "$.costs" + message.substr(1);
      WEFT_FAIL(message);
    }
  }
  check_rules(file);
  return file;
}

ScheduleFile ScheduleFile::load(const std::string& path) {
  return json_input::load_json_file(path, "schedule file", kMaxScheduleFileBytes, parse);
}

}  // namespace weft::plan
