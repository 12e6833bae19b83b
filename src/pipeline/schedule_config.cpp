#include "weft/pipeline/schedule_config.hpp"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "weft/core/error.hpp"

namespace weft::pipeline {

namespace {

using json = nlohmann::ordered_json;

std::string type_name(const json& v) { return v.type_name(); }

void check_keys(const json& object, const std::string& path,
                std::initializer_list<std::string_view> allowed) {
  for (const auto& [key, value] : object.items()) {
    bool ok = false;
    for (auto a : allowed) ok = ok || a == key;
    if (ok) continue;
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    WEFT_FAIL(path, ".", key, ": unknown key (expected one of: ", list, ")");
  }
}

const std::string& expect_string(const json& v, const std::string& path, const char* what) {
  WEFT_CHECK(v.is_string(), path, ": expected ", what, " (a string), got ", type_name(v));
  return v.get_ref<const std::string&>();
}

ThreadMap parse_thread_map(const json& v, const std::string& path) {
  if (v.is_string()) {
    try {
      return ThreadMap::preset(v.get<std::string>());
    } catch (const Error& e) {
      WEFT_FAIL(path, ": ", e.message());
    }
  }
  WEFT_CHECK(v.is_object(), path, ": expected a preset name or an object, got ", type_name(v));
  check_keys(v, path, {"groups", "rest"});
  WEFT_CHECK(v.contains("groups"), path, ": an explicit thread map needs \"groups\"");
  const json& groups = v.at("groups");
  const std::string groups_path = path + ".groups";
  WEFT_CHECK(groups.is_object(), groups_path,
             ": expected an object {thread: [task, ...]}, got ", type_name(groups));
  std::vector<ThreadGroup> out;
  for (const auto& [thread, tasks] : groups.items()) {
    const std::string thread_path = groups_path + "." + thread;
    WEFT_CHECK(tasks.is_array(), thread_path, ": expected an array of task names, got ",
               type_name(tasks));
    ThreadGroup group{thread, {}};
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      group.tasks.push_back(
          expect_string(tasks[i], thread_path + "[" + std::to_string(i) + "]", "a task name"));
    }
    out.push_back(std::move(group));
  }
  std::string rest;
  if (v.contains("rest")) rest = expect_string(v.at("rest"), path + ".rest", "a thread name");
  return ThreadMap::groups(std::move(out), std::move(rest));
}

}  // namespace

ScheduleConfig ScheduleConfig::parse(std::string_view json_text) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::parse_error& e) {
    WEFT_FAIL("$: not valid JSON: ", e.what());
  }
  WEFT_CHECK(root.is_object(), "$: expected an object, got ", type_name(root));
  check_keys(root, "$", {"thread_map", "lookahead", "same_progress_sync"});
  ScheduleConfig config;
  if (root.contains("thread_map")) {
    config.thread_map = parse_thread_map(root.at("thread_map"), "$.thread_map");
  }
  if (root.contains("lookahead")) {
    const json& la = root.at("lookahead");
    WEFT_CHECK(la.is_object(), "$.lookahead: expected an object {task: lookahead}, got ",
               type_name(la));
    for (const auto& [task, value] : la.items()) {
      const bool ok = value.is_number_integer() && value.get<long long>() >= 0 &&
                      value.get<long long>() <= 1'000'000;
      WEFT_CHECK(ok, "$.lookahead.", task, ": expected an integer >= 0, got ", value.dump());
      config.lookahead[task] = value.get<int>();
    }
  }
  if (root.contains("same_progress_sync")) {
    const json& edges = root.at("same_progress_sync");
    WEFT_CHECK(edges.is_array(), "$.same_progress_sync: expected an array, got ",
               type_name(edges));
    for (std::size_t i = 0; i < edges.size(); ++i) {
      const std::string path = "$.same_progress_sync[" + std::to_string(i) + "]";
      const json& e = edges[i];
      WEFT_CHECK(e.is_object(), path, ": expected an object, got ", type_name(e));
      check_keys(e, path, {"producer", "consumer", "side"});
      WEFT_CHECK(e.contains("producer") && e.contains("consumer"), path,
                 ": needs \"producer\" and \"consumer\"");
      SyncEdgeConfig edge;
      edge.producer = expect_string(e.at("producer"), path + ".producer", "a task name");
      edge.consumer = expect_string(e.at("consumer"), path + ".consumer", "a task name");
      if (e.contains("side")) {
        const std::string side = expect_string(e.at("side"), path + ".side", "cpu|gpu|both");
        try {
          edge.side = parse_sync_side(side);
        } catch (const Error& error) {
          WEFT_FAIL(path, ".side: ", error.message());
        }
      }
      config.same_progress_sync.push_back(std::move(edge));
    }
  }
  return config;
}

ScheduleConfig ScheduleConfig::load(const std::string& path) {
  std::ifstream in(path);
  WEFT_CHECK(in.good(), "schedule config: cannot open '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return parse(text.str());
  } catch (const Error& e) {
    WEFT_FAIL(path, ": ", e.message());
  }
}

std::string ScheduleConfig::to_json() const {
  json root = json::object();
  if (thread_map) {
    if (thread_map->is_preset()) {
      root["thread_map"] = thread_map->name();
    } else {
      json groups = json::object();
      for (const ThreadGroup& g : thread_map->thread_groups()) groups[g.name] = g.tasks;
      json map = {{"groups", std::move(groups)}};
      if (!thread_map->rest().empty()) map["rest"] = thread_map->rest();
      root["thread_map"] = std::move(map);
    }
  }
  if (!lookahead.empty()) root["lookahead"] = lookahead;
  if (!same_progress_sync.empty()) {
    json edges = json::array();
    for (const SyncEdgeConfig& e : same_progress_sync) {
      edges.push_back({{"producer", e.producer}, {"consumer", e.consumer},
                       {"side", std::string(to_string(e.side))}});
    }
    root["same_progress_sync"] = std::move(edges);
  }
  return root.dump(2);
}

void ScheduleConfig::apply(Schedule& schedule) const {
  for (const auto& [task, la] : lookahead) {
    WEFT_CHECK(schedule.has_task(task), "$.lookahead.", task, ": the schedule has no task '",
               task, "'");
    schedule.task(task).lookahead(la);
  }
  for (std::size_t i = 0; i < same_progress_sync.size(); ++i) {
    const SyncEdgeConfig& e = same_progress_sync[i];
    const std::string path = "$.same_progress_sync[" + std::to_string(i) + "]";
    WEFT_CHECK(schedule.has_task(e.consumer), path, ".consumer: the schedule has no task '",
               e.consumer, "'");
    WEFT_CHECK(schedule.has_task(e.producer), path, ".producer: the schedule has no task '",
               e.producer, "'");
    schedule.task(e.consumer).set_same_progress_sync(e.producer, e.side);
  }
}

}  // namespace weft::pipeline
