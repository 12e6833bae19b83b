#include "weft/plan/trace_reader.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "weft/core/error.hpp"

namespace weft::plan {
namespace {

using nlohmann::json;

// The engine's wait-rule names (pipeline::to_string(WaitRule)) -> the planner's.
WaitRule rule_from_flow_name(const std::string& name) {
  if (name.find("same_progress_sync") != std::string::npos) return WaitRule::kSyncBoth;
  if (name.find("stream_order") != std::string::npos) return WaitRule::kStreamOrder;
  if (name.find("ticket") != std::string::npos) return WaitRule::kTicket;
  return WaitRule::kSameLookahead;
}

struct Span {
  std::string task;
  int tid = 0;
  double begin = 0;
  double end = 0;
  long long batch = -1;
  long long iteration = -1;
  int lookahead = 0;
  int ticket = -1;
};

}  // namespace

VariantReport parse_chrome_trace(std::string_view json_text, std::string name) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    WEFT_FAIL("trace: not valid JSON: ", e.what());
  }
  const json* events = &root;
  if (root.is_object()) {
    WEFT_CHECK(root.contains("traceEvents"), "trace: no traceEvents array");
    events = &root["traceEvents"];
  }
  WEFT_CHECK(events->is_array(), "trace: traceEvents is not an array");

  int host_pid = -1, gpu_pid = -1;
  for (const auto& e : *events) {
    if (e.value("ph", "") == "M" && e.value("name", "") == "process_name") {
      const std::string process = e["args"].value("name", "");
      if (process == "host") host_pid = e.value("pid", -1);
      if (process == "gpu") gpu_pid = e.value("pid", -1);
    }
  }
  WEFT_CHECK(host_pid >= 0, "trace: no \"host\" process: not a trace written by weft's engine");
  std::map<int, std::string> thread_names, stream_names;
  std::vector<Span> host, gpu;
  std::map<long long, std::pair<int, double>> flow_start, flow_end;
  std::map<long long, std::string> flow_name;
  for (const auto& e : *events) {
    const std::string ph = e.value("ph", "");
    const int pid = e.value("pid", -1);
    const int tid = e.value("tid", 0);
    if (ph == "M" && e.value("name", "") == "thread_name") {
      (pid == host_pid ? thread_names : stream_names)[tid] = e["args"].value("name", "");
    } else if (ph == "X" && (pid == host_pid || pid == gpu_pid)) {
      Span s;
      s.task = e.value("name", "");
      s.tid = tid;
      s.begin = e.value("ts", 0.0);
      s.end = s.begin + e.value("dur", 0.0);
      if (e.contains("args")) {
        const json& a = e["args"];
        s.batch = a.value("batch", -1LL);
        s.iteration = a.value("iteration", -1LL);
        s.lookahead = a.value("lookahead", 0);
        s.ticket = a.value("ticket", -1);
      }
      (pid == host_pid ? host : gpu).push_back(std::move(s));
    } else if ((ph == "s" || ph == "f") && pid == host_pid) {
      const long long id = e.value("id", -1LL);
      (ph == "s" ? flow_start : flow_end)[id] = {tid, e.value("ts", 0.0)};
      flow_name[id] = e.value("name", "");
    }
  }
  WEFT_CHECK(!host.empty(), "trace: no host task spans");

  // Iterations in which every task ran; draw the second to last of them.
  std::set<std::string> all_tasks;
  for (const auto& s : host) all_tasks.insert(s.task);
  std::map<long long, std::vector<const Span*>> by_iteration;
  for (const auto& s : host) by_iteration[s.iteration].push_back(&s);
  std::vector<long long> full;
  for (const auto& [it, spans] : by_iteration) {
    std::set<std::string> names;
    for (const auto* s : spans) names.insert(s->task);
    if (names.size() == all_tasks.size()) full.push_back(it);
  }
  WEFT_CHECK(!full.empty(), "trace: no iteration in which every task ran (trace a longer run)");
  const long long drawn = full.size() >= 2 ? full[full.size() - 2] : full.back();
  auto begin_of = [&](long long it) {
    double b = 1e300;
    for (const auto* s : by_iteration[it]) b = std::min(b, s->begin);
    return b;
  };
  const double origin = begin_of(drawn);
  std::vector<double> gaps;
  for (std::size_t i = 1; i < full.size(); ++i) {
    if (full[i] == full[i - 1] + 1) gaps.push_back(begin_of(full[i]) - begin_of(full[i - 1]));
  }

  VariantReport report;
  report.name = std::move(name);
  report.cascade = "measured";
  report.source = "trace";
  Timeline& t = report.timeline;
  for (const auto& [tid, n] : thread_names) t.threads.push_back(n);
  auto thread_name = [&](int tid) {
    auto it = thread_names.find(tid);
    return it != thread_names.end() ? it->second : "thread " + std::to_string(tid);
  };
  auto stream_name = [&](int tid) {
    auto it = stream_names.find(tid);
    return it != stream_names.end() ? it->second : "stream " + std::to_string(tid);
  };
  std::vector<const Span*> drawn_spans = by_iteration[drawn];
  std::sort(drawn_spans.begin(), drawn_spans.end(),
            [](const Span* a, const Span* b) { return a->begin < b->begin; });
  double host_end = origin;
  std::map<std::string, std::string> stream_of_task;
  for (const auto& s : gpu) stream_of_task.emplace(s.task, stream_name(s.tid));
  for (const auto* s : drawn_spans) {
    t.host.push_back({s->task, thread_name(s->tid), s->begin - origin, s->end - origin, s->batch,
                      s->ticket});
    host_end = std::max(host_end, s->end);
    const auto stream = stream_of_task.count(s->task) ? stream_of_task[s->task] : "host";
    report.placement.push_back({s->task, stream, thread_name(s->tid), s->lookahead, s->ticket >= 0});
  }
  t.host_step_us = host_end - origin;
  if (gaps.empty()) {
    t.step_us = t.host_step_us;
  } else {
    std::nth_element(gaps.begin(), gaps.begin() + long(gaps.size() / 2), gaps.end());
    t.step_us = gaps[gaps.size() / 2];
  }
  const double window = std::max(t.step_us, t.host_step_us);
  std::set<std::string> streams;
  for (const auto& s : gpu) {
    const double b = std::max(s.begin, origin), e = std::min(s.end, origin + window);
    if (e <= b) continue;
    t.gpu.push_back({s.task, stream_name(s.tid), b - origin, e - origin});
    streams.insert(stream_name(s.tid));
  }
  for (const auto& [tid, n] : stream_names) {
    if (streams.count(n)) t.streams.push_back(n);
  }
  // Waits of the drawn iteration: flow arrows whose consumer span belongs to it.
  for (const auto& [id, end] : flow_end) {
    auto start = flow_start.find(id);
    if (start == flow_start.end()) continue;
    const Span* consumer = nullptr;
    for (const auto* s : drawn_spans) {
      if (s->tid == end.first && s->begin == end.second) consumer = s;
    }
    if (consumer == nullptr) continue;
    const Span* producer = nullptr;
    for (const auto& s : host) {
      if (s.tid == start->second.first && s.end == start->second.second) producer = &s;
    }
    if (producer == nullptr) continue;
    t.waits.push_back({producer->task, consumer->task, thread_name(producer->tid),
                       thread_name(consumer->tid), rule_from_flow_name(flow_name[id]),
                       producer->end - origin, std::max(0.0, consumer->begin - producer->end),
                       flow_name[id]});
  }
  for (const auto& n : t.threads) report.thread_map += (report.thread_map.empty() ? "" : " / ") + n;
  report.thread_map += " (" + std::to_string(t.threads.size()) + ")";
  return report;
}

VariantReport read_chrome_trace(const std::string& path) {
  std::ifstream in(path);
  WEFT_CHECK(in.good(), "cannot read trace '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  try {
    auto report = parse_chrome_trace(text.str(), std::filesystem::path(path).stem().string());
    report.source = "trace " + std::filesystem::path(path).filename().string();
    return report;
  } catch (const Error& e) {
    WEFT_FAIL(path, ": ", e.message());
  }
}

}  // namespace weft::plan
