#include "weft/pipeline/schedule_config.hpp"

#include "core/json_input.hpp"
#include "weft/core/error.hpp"

namespace weft::pipeline {

namespace {

using json = json_input::Json;
using json_input::excerpt;
using json_input::for_each_element;
using json_input::member_path;
using json_input::name_at;
using json_input::only_keys;
using json_input::required_member;
using json_input::short_text;

// Schedule configs are a few lines; anything this large is not one.
constexpr std::size_t kMaxConfigFileBytes = std::size_t(1) << 20;

ThreadMap parse_thread_map(const json& v, const std::string& path) {
  if (v.is_string()) {
    // A long name, cut, is still no preset, and the error then quotes it short.
    try {
      return ThreadMap::preset(short_text(v.get<std::string>()));
    } catch (const Error& e) {
      WEFT_FAIL(path, ": ", e.message());
    }
  }
  WEFT_CHECK(v.is_object(), path, ": expected a preset name or an object, got ", excerpt(v));
  only_keys(v, path, {"groups", "rest"});
  const json& groups = required_member(v, path, "groups");
  const std::string groups_path = path + ".groups";
  WEFT_CHECK(groups.is_object(), groups_path, ": expected an object {thread: [task, ...]}, got ",
             excerpt(groups));
  std::vector<ThreadGroup> out;
  for (const auto& [thread, tasks] : groups.items()) {
    const std::string thread_path = member_path(groups_path, thread);
    ThreadGroup group{thread, {}};
    for_each_element(tasks, thread_path, "task names", [&](const json& task, const std::string& p) {
      group.tasks.push_back(name_at(task, p, "a task name"));
    });
    out.push_back(std::move(group));
  }
  std::string rest;
  if (v.contains("rest")) rest = name_at(v.at("rest"), path + ".rest", "a thread name");
  return ThreadMap::groups(std::move(out), std::move(rest));
}

SyncEdgeConfig parse_sync_edge(const json& e, const std::string& path) {
  only_keys(e, path, {"producer", "consumer", "side"});
  SyncEdgeConfig edge;
  edge.producer = name_at(required_member(e, path, "producer"), path + ".producer", "a task name");
  edge.consumer = name_at(required_member(e, path, "consumer"), path + ".consumer", "a task name");
  if (e.contains("side")) {
    // As for presets: a long name, cut, is still no side.
    const std::string side = short_text(name_at(e.at("side"), path + ".side", "cpu|gpu|both"));
    try {
      edge.side = parse_sync_side(side);
    } catch (const Error& error) {
      WEFT_FAIL(path, ".side: ", error.message());
    }
  }
  return edge;
}

}  // namespace

ScheduleConfig ScheduleConfig::parse(std::string_view json_text) {
  const json root = json_input::parse_json(json_text);
  only_keys(root, "$", {"thread_map", "lookahead", "stream", "same_progress_sync"});
  ScheduleConfig config;
  if (root.contains("thread_map")) {
    config.thread_map = parse_thread_map(root.at("thread_map"), "$.thread_map");
  }
  if (root.contains("lookahead")) {
    const json& la = root.at("lookahead");
    WEFT_CHECK(la.is_object(), "$.lookahead: expected an object {task: lookahead}, got ",
               excerpt(la));
    for (const auto& [task, value] : la.items()) {
      config.lookahead[task] =
          json_input::integer_in(value, member_path("$.lookahead", task), 0, kMaxLookahead);
    }
  }
  if (root.contains("stream")) {
    const json& streams = root.at("stream");
    WEFT_CHECK(streams.is_object(), "$.stream: expected an object {task: stream}, got ",
               excerpt(streams));
    for (const auto& [task, value] : streams.items()) {
      config.stream[task] = name_at(value, member_path("$.stream", task), "a stream name");
    }
  }
  if (root.contains("same_progress_sync")) {
    for_each_element(root.at("same_progress_sync"), "$.same_progress_sync", "sync edges",
                     [&](const json& edge, const std::string& path) {
                       config.same_progress_sync.push_back(parse_sync_edge(edge, path));
                     });
  }
  return config;
}

ScheduleConfig ScheduleConfig::load(const std::string& path) {
  ScheduleConfig config =
      json_input::load_json_file(path, "schedule config", kMaxConfigFileBytes, parse);
  config.source = path;
  return config;
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
  if (!stream.empty()) root["stream"] = stream;
  if (!same_progress_sync.empty()) {
    json edges = json::array();
    for (const SyncEdgeConfig& e : same_progress_sync) {
      edges.push_back({{"producer", e.producer},
                       {"consumer", e.consumer},
                       {"side", std::string(to_string(e.side))}});
    }
    root["same_progress_sync"] = std::move(edges);
  }
  return root.dump(2);
}

void ScheduleConfig::check_task_names(const std::function<bool(std::string_view)>& has_task) const {
  const std::string file = source.empty() ? "" : source + ": ";
  auto check_task = [&](const std::string& task, const std::string& path) {
    WEFT_CHECK(has_task(task), file, path, ": the schedule has no task '", short_text(task), "'");
  };
  for (const auto& [task, la] : lookahead) check_task(task, member_path("$.lookahead", task));
  for (const auto& [task, s] : stream) check_task(task, member_path("$.stream", task));
  for (std::size_t i = 0; i < same_progress_sync.size(); ++i) {
    const SyncEdgeConfig& e = same_progress_sync[i];
    const std::string path = json_input::element_path("$.same_progress_sync", i);
    check_task(e.consumer, path + ".consumer");
    check_task(e.producer, path + ".producer");
  }
}

void ScheduleConfig::apply(Schedule& schedule) const {
  apply([&](std::string_view name) {
    return schedule.has_task(name) ? &schedule.task(name) : nullptr;
  });
}

void ScheduleConfig::apply(const std::function<Task*(std::string_view)>& task_of) const {
  check_task_names([&](std::string_view task) { return task_of(task) != nullptr; });
  const std::string file = source.empty() ? "" : source + ": ";
  for (const auto& [task, s] : stream) {
    // Checked on a copy, so that nothing changes when a later entry is refused.
    Task moved = *task_of(task);
    try {
      moved.move_to_stream(s);
    } catch (const Error& e) {
      WEFT_FAIL(file, member_path("$.stream", task), ": ", e.message());
    }
  }
  for (const auto& [task, la] : lookahead) task_of(task)->lookahead(la);
  for (const auto& [task, s] : stream) task_of(task)->move_to_stream(s);
  for (const SyncEdgeConfig& e : same_progress_sync) {
    task_of(e.consumer)->set_same_progress_sync(e.producer, e.side);
  }
}

bool ScheduleConfig::operator==(const ScheduleConfig& other) const {
  return thread_map == other.thread_map && lookahead == other.lookahead && stream == other.stream &&
         same_progress_sync == other.same_progress_sync;
}

}  // namespace weft::pipeline
