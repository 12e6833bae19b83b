#include "weft/plan/schedule_file.hpp"

#include <cstdint>

#include "core/json_input.hpp"
#include "weft/core/error.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/schedule_config.hpp"

namespace weft::plan {
namespace {

using json = json_input::Json;
using json_input::int_at;
using json_input::only_keys;

// Schedule files are small; anything this large is not one.
constexpr std::size_t kMaxScheduleFileBytes = std::size_t(16) << 20;

std::string name_at(const json& value, const std::string& path) {
  WEFT_CHECK(value.is_string() && !value.get<std::string>().empty(), path,
             ": expected a non-empty string, got ", json_input::excerpt(value));
  return value.get<std::string>();
}

std::vector<std::string> names_at(const json& value, const std::string& path) {
  WEFT_CHECK(value.is_array(), path, ": expected an array of names, got ", json_input::excerpt(value));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < value.size(); ++i) {
    out.push_back(name_at(value[i], path + "[" + std::to_string(i) + "]"));
  }
  return out;
}

// The JSON path a schedule rule's error is about: the first task the message quotes, else the
// streams or inputs it concerns, else the task list as a whole (a cycle).
std::string path_of_rule_error(const std::string& message, const json& tasks) {
  const auto quoted = message.find("task '");
  if (quoted != std::string::npos) {
    const auto begin = quoted + 6;
    const std::string name = message.substr(begin, message.find('\'', begin) - begin);
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      if (tasks[i].value("name", "") == name) return "$.tasks[" + std::to_string(i) + "]";
    }
  }
  if (message.find("schedule: stream '") != std::string::npos) return "$.streams";
  if (message.find("input slot") != std::string::npos) return "$.inputs";
  return "$.tasks";
}

pipeline::Task parse_task(const json& entry, const std::string& path) {
  only_keys(entry, path,
            {"name", "stream", "lookahead", "reads", "writes", "depends_on",
             "cross_iter_depends_on", "same_progress_sync", "collective"});
  WEFT_CHECK(entry.contains("name"), path, ".name: missing");
  pipeline::Task task(name_at(entry["name"], path + ".name"));
  if (entry.contains("stream")) task.stream(name_at(entry["stream"], path + ".stream"));
  if (entry.contains("lookahead")) task.lookahead(int_at(entry["lookahead"], path + ".lookahead"));
  if (entry.contains("reads")) {
    for (const auto& s : names_at(entry["reads"], path + ".reads")) task.reads(s);
  }
  if (entry.contains("writes")) {
    for (const auto& s : names_at(entry["writes"], path + ".writes")) task.writes(s);
  }
  if (entry.contains("depends_on")) {
    for (const auto& s : names_at(entry["depends_on"], path + ".depends_on")) task.depends_on(s);
  }
  if (entry.contains("cross_iter_depends_on")) {
    const json& list = entry["cross_iter_depends_on"];
    WEFT_CHECK(list.is_array(), path, ".cross_iter_depends_on: expected an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string p = path + ".cross_iter_depends_on[" + std::to_string(i) + "]";
      only_keys(list[i], p, {"producer", "offset"});
      WEFT_CHECK(list[i].contains("producer") && list[i].contains("offset"), p,
                 ": needs producer and offset");
      task.cross_iter_depends_on(name_at(list[i]["producer"], p + ".producer"),
                                 int_at(list[i]["offset"], p + ".offset"));
    }
  }
  if (entry.contains("same_progress_sync")) {
    const json& list = entry["same_progress_sync"];
    WEFT_CHECK(list.is_array(), path, ".same_progress_sync: expected an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string p = path + ".same_progress_sync[" + std::to_string(i) + "]";
      only_keys(list[i], p, {"producer", "side"});
      WEFT_CHECK(list[i].contains("producer"), p, ".producer: missing");
      pipeline::SyncSide side = pipeline::SyncSide::kBoth;
      if (list[i].contains("side")) {
        try {
          side = pipeline::parse_sync_side(name_at(list[i]["side"], p + ".side"));
        } catch (const Error& e) {
          WEFT_FAIL(p, ".side: ", e.message());
        }
      }
      task.same_progress_sync(name_at(list[i]["producer"], p + ".producer"), side);
    }
  }
  if (entry.contains("collective")) {
    const json& c = entry["collective"];
    if (c.is_boolean()) {
      if (c.get<bool>()) task.collective();
    } else {
      WEFT_CHECK(c.is_array(), path, ".collective: expected true/false or an array of collectives");
      std::vector<pipeline::CollectiveOp> ops;
      for (std::size_t i = 0; i < c.size(); ++i) {
        const std::string p = path + ".collective[" + std::to_string(i) + "]";
        only_keys(c[i], p, {"kind", "stream", "bytes", "count"});
        pipeline::CollectiveOp op;
        WEFT_CHECK(c[i].contains("kind"), p, ".kind: missing");
        op.kind = name_at(c[i]["kind"], p + ".kind");
        op.stream = c[i].contains("stream") ? name_at(c[i]["stream"], p + ".stream")
                                            : task.stream();
        if (c[i].contains("bytes")) {
          op.num_bytes = json_input::integer_at<std::size_t>(c[i]["bytes"], p + ".bytes");
        }
        if (c[i].contains("count")) {
          op.count = int_at(c[i]["count"], p + ".count");
          WEFT_CHECK(op.count >= 1, p, ".count: expected >= 1, got ", op.count);
        }
        ops.push_back(std::move(op));
      }
      task.collective(std::move(ops));
    }
  }
  return task;
}

}  // namespace

ScheduleFile ScheduleFile::parse(std::string_view json_text) {
  const json root = json_input::parse_json(json_text);
  only_keys(root, "$", {"streams", "inputs", "tasks", "thread_maps", "costs"});
  ScheduleFile file;
  if (root.contains("streams")) {
    const json& streams = root["streams"];
    WEFT_CHECK(streams.is_array(), "$.streams: expected an array");
    for (std::size_t i = 0; i < streams.size(); ++i) {
      const std::string p = "$.streams[" + std::to_string(i) + "]";
      if (streams[i].is_string()) {
        file.schedule.add_stream(name_at(streams[i], p));
      } else {
        only_keys(streams[i], p, {"name", "priority"});
        WEFT_CHECK(streams[i].contains("name"), p, ".name: missing");
        file.schedule.add_stream(name_at(streams[i]["name"], p + ".name"),
                                 streams[i].contains("priority")
                                     ? int_at(streams[i]["priority"], p + ".priority")
                                     : 0);
      }
    }
  }
  if (root.contains("inputs")) {
    for (const auto& s : names_at(root["inputs"], "$.inputs")) file.schedule.add_input(s);
  }
  WEFT_CHECK(root.contains("tasks") && root["tasks"].is_array() && !root["tasks"].empty(),
             "$.tasks: expected a non-empty array of tasks");
  for (std::size_t i = 0; i < root["tasks"].size(); ++i) {
    file.schedule.add(parse_task(root["tasks"][i], "$.tasks[" + std::to_string(i) + "]"));
  }
  if (root.contains("thread_maps")) {
    const json& maps = root["thread_maps"];
    WEFT_CHECK(maps.is_array() && !maps.empty(), "$.thread_maps: expected a non-empty array");
    for (std::size_t i = 0; i < maps.size(); ++i) {
      const std::string p = "$.thread_maps[" + std::to_string(i) + "]";
      pipeline::ScheduleConfig config;
      try {
        config = pipeline::ScheduleConfig::parse(json{{"thread_map", maps[i]}}.dump());
      } catch (const Error& e) {
        WEFT_FAIL(p, ": ", e.message());
      }
      file.thread_maps.push_back(*config.thread_map);
      file.thread_map_names.push_back(maps[i].is_string() ? maps[i].get<std::string>()
                                                          : "explicit " + std::to_string(i));
    }
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
  // The schedule's own rules (and the costs' tasks and streams), checked here so that their
  // errors name the JSON path.
  try {
    const pipeline::CompiledSchedule compiled(file.schedule);
    if (file.costs) {
      try {
        file.costs->check_against(compiled);
      } catch (const Error& e) {
        WEFT_FAIL("$.costs", e.message().substr(1));
      }
    }
  } catch (const Error& e) {
    const std::string& message = e.message();
    if (message.rfind("$", 0) == 0) throw;
    WEFT_FAIL(path_of_rule_error(message, root["tasks"]), ": ", message);
  }
  return file;
}

ScheduleFile ScheduleFile::load(const std::string& path) {
  return json_input::load_json_file(path, "schedule file", kMaxScheduleFileBytes, parse);
}

}  // namespace weft::plan
