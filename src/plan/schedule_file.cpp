#include "weft/plan/schedule_file.hpp"

#include <nlohmann/json.hpp>

#include "json_input.hpp"
#include "weft/core/error.hpp"
#include "weft/pipeline/schedule_config.hpp"

namespace weft::plan {
namespace {

using nlohmann::json;
using detail::only_keys;

std::string string_at(const json& value, const std::string& path) {
  WEFT_CHECK(value.is_string() && !value.get<std::string>().empty(), path,
             ": expected a non-empty string, got ", value.dump());
  return value.get<std::string>();
}

int int_at(const json& value, const std::string& path) {
  WEFT_CHECK(value.is_number_integer(), path, ": expected an integer, got ", value.dump());
  return value.get<int>();
}

std::vector<std::string> strings_at(const json& value, const std::string& path) {
  WEFT_CHECK(value.is_array(), path, ": expected an array of names, got ", value.dump());
  std::vector<std::string> out;
  for (std::size_t i = 0; i < value.size(); ++i) {
    out.push_back(string_at(value[i], path + "[" + std::to_string(i) + "]"));
  }
  return out;
}

pipeline::Task parse_task(const json& entry, const std::string& path) {
  only_keys(entry, path,
            {"name", "stream", "lookahead", "reads", "writes", "depends_on",
             "cross_iter_depends_on", "same_progress_sync", "collective"});
  WEFT_CHECK(entry.contains("name"), path, ".name: missing");
  pipeline::Task task(string_at(entry["name"], path + ".name"));
  if (entry.contains("stream")) task.stream(string_at(entry["stream"], path + ".stream"));
  if (entry.contains("lookahead")) task.lookahead(int_at(entry["lookahead"], path + ".lookahead"));
  if (entry.contains("reads")) {
    for (const auto& s : strings_at(entry["reads"], path + ".reads")) task.reads(s);
  }
  if (entry.contains("writes")) {
    for (const auto& s : strings_at(entry["writes"], path + ".writes")) task.writes(s);
  }
  if (entry.contains("depends_on")) {
    for (const auto& s : strings_at(entry["depends_on"], path + ".depends_on")) task.depends_on(s);
  }
  if (entry.contains("cross_iter_depends_on")) {
    const json& list = entry["cross_iter_depends_on"];
    WEFT_CHECK(list.is_array(), path, ".cross_iter_depends_on: expected an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string p = path + ".cross_iter_depends_on[" + std::to_string(i) + "]";
      only_keys(list[i], p, {"producer", "offset"});
      WEFT_CHECK(list[i].contains("producer") && list[i].contains("offset"), p,
                 ": needs producer and offset");
      task.cross_iter_depends_on(string_at(list[i]["producer"], p + ".producer"),
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
          side = pipeline::parse_sync_side(string_at(list[i]["side"], p + ".side"));
        } catch (const Error& e) {
          WEFT_FAIL(p, ".side: ", e.message());
        }
      }
      task.same_progress_sync(string_at(list[i]["producer"], p + ".producer"), side);
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
        op.kind = string_at(c[i]["kind"], p + ".kind");
        op.stream = c[i].contains("stream") ? string_at(c[i]["stream"], p + ".stream")
                                            : task.stream();
        if (c[i].contains("bytes")) {
          WEFT_CHECK(c[i]["bytes"].is_number_unsigned() || c[i]["bytes"].is_number_integer(), p,
                     ".bytes: expected an integer");
          const auto bytes = c[i]["bytes"].get<long long>();
          WEFT_CHECK(bytes >= 0, p, ".bytes: expected >= 0, got ", bytes);
          op.num_bytes = std::size_t(bytes);
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
  const json root = detail::parse_json(json_text);
  only_keys(root, "$", {"streams", "inputs", "tasks", "thread_maps", "costs"});
  ScheduleFile file;
  if (root.contains("streams")) {
    const json& streams = root["streams"];
    WEFT_CHECK(streams.is_array(), "$.streams: expected an array");
    for (std::size_t i = 0; i < streams.size(); ++i) {
      const std::string p = "$.streams[" + std::to_string(i) + "]";
      if (streams[i].is_string()) {
        file.schedule.add_stream(string_at(streams[i], p));
      } else {
        only_keys(streams[i], p, {"name", "priority"});
        WEFT_CHECK(streams[i].contains("name"), p, ".name: missing");
        file.schedule.add_stream(string_at(streams[i]["name"], p + ".name"),
                                 streams[i].contains("priority")
                                     ? int_at(streams[i]["priority"], p + ".priority")
                                     : 0);
      }
    }
  }
  if (root.contains("inputs")) {
    for (const auto& s : strings_at(root["inputs"], "$.inputs")) file.schedule.add_input(s);
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
  return file;
}

ScheduleFile ScheduleFile::load(const std::string& path) {
  return detail::load_json_file(path, "schedule file", parse);
}

}  // namespace weft::plan
