#include "weft/plan/cost_model.hpp"

#include <nlohmann/json.hpp>

#include <charconv>
#include <string>

#include "core/json_input.hpp"
#include "weft/core/error.hpp"

namespace weft::plan {
namespace {

using json = json_input::Json;
using json_input::only_keys;

// Cost files are small; anything this large is not one.
constexpr std::size_t kMaxCostFileBytes = std::size_t(16) << 20;

// The shortest text that reads back as x: a value just past a limit is not shown as the limit.
std::string shortest(double x) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, x).ptr;
  return std::string(text, end);
}

double cost_at(const json& value, const std::string& path) {
  const double x = json_input::number_at(value, path);
  WEFT_CHECK(x >= 0, path, ": expected a cost >= 0, got ", shortest(x));
  WEFT_CHECK(x <= CostModel::kMaxCostUs, path, ": expected a cost <= ", CostModel::kMaxCostUs,
             " us, got ", shortest(x));
  return x;
}

}  // namespace

CostModel CostModel::parse(std::string_view json_text) {
  const json root = json_input::parse_json(json_text);
  only_keys(root, "$", {"default_host_us", "tasks"});
  CostModel model;
  if (root.contains("default_host_us")) {
    model.default_host_us = cost_at(root["default_host_us"], "$.default_host_us");
  }
  if (root.contains("tasks")) {
    const json& tasks = root["tasks"];
    WEFT_CHECK(tasks.is_object(), "$.tasks: expected an object of task name -> cost");
    for (const auto& [name, entry] : tasks.items()) {
      const std::string path = "$.tasks." + name;
      only_keys(entry, path, {"host_us", "gpu", "waits_for_gpu_of"});
      TaskCost cost;
      if (entry.contains("host_us")) cost.host_us = cost_at(entry["host_us"], path + ".host_us");
      if (entry.contains("waits_for_gpu_of")) {
        cost.waits_for_gpu_of = json_input::name_at(entry["waits_for_gpu_of"],
                                                    path + ".waits_for_gpu_of", "a task name");
      }
      if (entry.contains("gpu")) {
        json_input::for_each_element(
            entry["gpu"], path + ".gpu", "{stream, us}",
            [&](const json& segment, const std::string& p) {
              only_keys(segment, p, {"stream", "us"});
              std::string stream =
                  json_input::name_at(json_input::required_member(segment, p, "stream"),
                                      p + ".stream", "a stream name");
              cost.gpu.push_back(
                  {std::move(stream),
                   cost_at(json_input::required_member(segment, p, "us"), p + ".us")});
            });
      }
      model.tasks.emplace(name, std::move(cost));
    }
  }
  return model;
}

CostModel CostModel::load(const std::string& path) {
  return json_input::load_json_file(path, "cost file", kMaxCostFileBytes, parse);
}

std::string CostModel::to_json() const {
  json root;
  root["default_host_us"] = default_host_us;
  root["tasks"] = json::object();
  for (const auto& [name, cost] : tasks) {
    json entry;
    entry["host_us"] = cost.host_us;
    entry["gpu"] = json::array();
    for (const auto& seg : cost.gpu) entry["gpu"].push_back({{"stream", seg.stream}, {"us", seg.us}});
    if (!cost.waits_for_gpu_of.empty()) entry["waits_for_gpu_of"] = cost.waits_for_gpu_of;
    root["tasks"][name] = entry;
  }
  return root.dump(2);
}

TaskCost CostModel::cost_of(std::string_view task) const {
  auto it = tasks.find(task);
  if (it != tasks.end()) return it->second;
  TaskCost cost;
  cost.host_us = default_host_us;
  return cost;
}

TaskCost CostModel::placed_cost_of(const pipeline::Task& task) const {
  TaskCost cost = cost_of(task.name());
  for (GpuSegment& seg : cost.gpu) {
    if (task.may_run_on(seg.stream)) seg.stream = task.stream();
  }
  return cost;
}

void CostModel::check_against(const pipeline::CompiledSchedule& schedule) const {
  for (const auto& [name, cost] : tasks) {
    WEFT_CHECK(schedule.find_task(name).has_value(), "$.tasks.", name,
               ": the schedule has no task of that name");
    for (std::size_t i = 0; i < cost.gpu.size(); ++i) {
      WEFT_CHECK(schedule.find_stream(cost.gpu[i].stream).has_value(), "$.tasks.", name, ".gpu[", i,
                 "].stream: the schedule has no stream '", cost.gpu[i].stream, "'");
    }
    const std::string& producer = cost.waits_for_gpu_of;
    WEFT_CHECK(producer.empty() || (producer != name && schedule.find_task(producer)),
               "$.tasks.", name, ".waits_for_gpu_of: '", producer, "' is ",
               producer == name ? "the task itself" : "no task of the schedule");
  }
}

CostModel CostModel::hstu_defaults() {
  // Rough figures taken from the HSTU benchmark; docs/planner.md ("Where the HSTU defaults come
  // from") says where each comes from.
  CostModel model;
  model.default_host_us = 20;
  auto add = [&](const char* task, double host_us, std::vector<GpuSegment> gpu) {
    model.tasks[task] = TaskCost{host_us, std::move(gpu), {}};
  };
  add("h2d", 300, {{"memcpy", 800}});
  add("start_shuffle", 400, {{"memcpy", 40}});
  add("finish_shuffle", 900, {{"memcpy", 600}});
  add("start_input_dist", 1200, {{"data_dist", 60}});
  add("wait_input_dist", 1000, {{"data_dist", 500}});
  add("prefetch_embeddings", 1500, {{"prefetch", 2000}});
  add("zero_grad", 150, {{"default", 100}});
  add("global_tokens_allreduce", 200, {{"default", 40}});
  add("compute_output_dist", 1200, {{"output_dist_comm", 1800}});
  add("forward", 4000, {{"default", 25000}});
  add("backward", 3000, {{"default", 25000}, {"output_dist_comm", 1800}});
  add("finalize_model_grads", 600, {{"default", 2500}});
  add("optimizer_step", 800, {{"default", 1500}});
  add("watchdog", 100, {});
  return model;
}

}  // namespace weft::plan
