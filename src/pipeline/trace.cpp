#include "weft/pipeline/trace.hpp"

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "weft/core/error.hpp"

namespace weft::pipeline {

namespace {

constexpr int kHostPid = 1;
constexpr int kGpuPid = 2;

nlohmann::json metadata(const char* what, int pid, int tid, const std::string& name) {
  return {{"ph", "M"}, {"name", what}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
}

}  // namespace

std::string Trace::to_chrome_json() const {
  using nlohmann::json;
  json events = json::array();
  events.push_back(metadata("process_name", kHostPid, 0, "host"));
  for (std::size_t t = 0; t < thread_names.size(); ++t) {
    events.push_back(metadata("thread_name", kHostPid, static_cast<int>(t), thread_names[t]));
  }
  if (!gpu_spans.empty()) {
    events.push_back(metadata("process_name", kGpuPid, 0, "gpu"));
    for (std::size_t s = 0; s < stream_names.size(); ++s) {
      events.push_back(metadata("thread_name", kGpuPid, static_cast<int>(s), stream_names[s]));
    }
  }
  // The span of (task, iteration) a flow arrow starts or ends at (the first one recorded).
  std::map<std::pair<TaskId, std::int64_t>, const HostSpan*> span_of;
  for (const HostSpan& s : host_spans) span_of.emplace(std::pair{s.task, s.iteration}, &s);
  auto find_span = [&](TaskId task, std::int64_t iteration) -> const HostSpan* {
    const auto it = span_of.find({task, iteration});
    return it == span_of.end() ? nullptr : it->second;
  };
  for (const HostSpan& s : host_spans) {
    json args = {{"batch", s.batch}, {"lookahead", s.lookahead}, {"iteration", s.iteration}};
    if (s.ticket >= 0) args["ticket"] = s.ticket;
    if (s.failed) args["failed"] = true;
    events.push_back({{"ph", "X"}, {"name", task_names.at(s.task)}, {"cat", "task"},
                      {"pid", kHostPid}, {"tid", s.thread}, {"ts", s.begin_us},
                      {"dur", s.end_us - s.begin_us}, {"args", std::move(args)}});
  }
  for (const GpuSpan& s : gpu_spans) {
    json args = {{"batch", s.batch}};
    if (s.failed) args["failed"] = true;
    events.push_back({{"ph", "X"}, {"name", task_names.at(s.task)}, {"cat", "gpu"},
                      {"pid", kGpuPid}, {"tid", s.stream}, {"ts", s.begin_us},
                      {"dur", s.end_us - s.begin_us}, {"args", std::move(args)}});
  }
  int flow_id = 0;
  for (const WaitRecord& w : waits) {
    const HostSpan* producer = find_span(w.producer, w.iteration);
    const HostSpan* consumer = find_span(w.consumer, w.iteration);
    if (producer == nullptr || consumer == nullptr) continue;
    const std::string name = "wait " + std::string(to_string(w.rule));
    events.push_back({{"ph", "s"}, {"name", name}, {"cat", "wait"}, {"id", flow_id},
                      {"pid", kHostPid}, {"tid", producer->thread}, {"ts", producer->end_us}});
    events.push_back({{"ph", "f"}, {"bp", "e"}, {"name", name}, {"cat", "wait"},
                      {"id", flow_id}, {"pid", kHostPid}, {"tid", consumer->thread},
                      {"ts", consumer->begin_us}});
    ++flow_id;
  }
  return json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ns"}}.dump();
}

void Trace::write_chrome_json(const std::string& path) const {
  std::ofstream out(path);
  WEFT_CHECK(out.good(), "trace: cannot open '", path, "' for writing");
  out << to_chrome_json();
  WEFT_CHECK(out.good(), "trace: writing '", path, "' failed");
}

}  // namespace weft::pipeline
