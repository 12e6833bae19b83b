#include "weft/plan/trace_reader.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "core/json_input.hpp"
#include "weft/core/error.hpp"

namespace weft::plan {
namespace {

using json = json_input::Json;

// A long run's trace is tens of MiB; the limit keeps a wrong file from exhausting memory.
constexpr std::size_t kMaxTraceFileBytes = std::size_t(256) << 20;

// The engine's wait-rule names (pipeline::to_string(WaitRule)) -> the planner's.
WaitRule rule_from_flow_name(const std::string& name) {
  if (name.find("same_progress_sync") != std::string::npos) return WaitRule::kSyncBoth;
  if (name.find("stream_order") != std::string::npos) return WaitRule::kStreamOrder;
  if (name.find("ticket") != std::string::npos) return WaitRule::kTicket;
  return WaitRule::kSameLookahead;
}

// The fields of one trace event the reader uses, their JSON types checked: an error names the
// event and the field ("traceEvents[6].args.iteration: expected an integer, got \"three\"").
struct Event {
  std::size_t index = 0;  // in traceEvents
  std::string ph, name;
  int pid = -1, tid = 0;
  double ts = 0, dur = 0;
  long long id = -1;
  // args
  std::string args_name;
  long long batch = -1;
  std::optional<long long> iteration;
  int lookahead = 0;
  int ticket = -1;
  bool failed = false;
};

std::string event_path(std::size_t index) { return "traceEvents[" + std::to_string(index) + "]"; }

// The member `key` of `object` read by `read`, or `fallback` where there is none. Paths are
// made only for an error's message: a trace has millions of fields.
template <typename Read>
auto field_or(const json& object, const char* key, const std::string& path,
              decltype(std::declval<Read>()(object, path)) fallback, Read read) {
  const auto it = object.find(key);
  if (it == object.end()) return fallback;
  try {
    return read(*it, std::string());
  } catch (const Error& e) {
    WEFT_FAIL(path, ".", key, e.message());
  }
}

// Errors name the field from the event on (".args.batch: ..."); the caller prefixes the event.
Event read_event(const json& e, std::size_t index) {
  Event out;
  out.index = index;
  WEFT_CHECK(e.is_object(), ": expected an object, got ", json_input::excerpt(e));
  const std::string p;
  out.ph = field_or(e, "ph", p, std::string(), json_input::string_at);
  out.name = field_or(e, "name", p, std::string(), json_input::string_at);
  out.pid = field_or(e, "pid", p, -1, json_input::int_at);
  out.tid = field_or(e, "tid", p, 0, json_input::int_at);
  out.ts = field_or(e, "ts", p, 0.0, json_input::number_at);
  out.dur = field_or(e, "dur", p, 0.0, json_input::number_at);
  out.id = field_or(e, "id", p, -1LL, json_input::integer_at<long long>);
  const auto args = e.find("args");
  if (args != e.end()) {
    const std::string a = p + ".args";
    WEFT_CHECK(args->is_object(), a, ": expected an object, got ", json_input::excerpt(*args));
    out.args_name = field_or(*args, "name", a, std::string(), json_input::string_at);
    out.batch = field_or(*args, "batch", a, -1LL, json_input::integer_at<long long>);
    if (args->contains("iteration")) {
      out.iteration = field_or(*args, "iteration", a, 0LL, json_input::integer_at<long long>);
    }
    out.lookahead = field_or(*args, "lookahead", a, 0, json_input::int_at);
    out.ticket = field_or(*args, "ticket", a, -1, json_input::int_at);
    out.failed = field_or(*args, "failed", a, false, json_input::bool_at);
  }
  return out;
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
  bool failed = false;
};

// The trace's events, each one's fields read and checked.
std::vector<Event> read_events(std::string_view json_text) {
  json root;
  try {
    root = json_input::parse_json(json_text);
  } catch (const Error& e) {
    WEFT_FAIL("trace: ", e.message());
  }
  const json* event_list = &root;
  if (root.is_object()) {
    WEFT_CHECK(root.contains("traceEvents"), "trace: no traceEvents array");
    event_list = &root["traceEvents"];
  }
  WEFT_CHECK(event_list->is_array(), "trace: traceEvents is not an array");
  std::vector<Event> events;
  try {
    events.reserve(event_list->size());
    for (std::size_t i = 0; i < event_list->size(); ++i) {
      try {
        events.push_back(read_event((*event_list)[i], i));
      } catch (const Error& e) {
        WEFT_FAIL(event_path(i), e.message());
      }
    }
  } catch (const Error& e) {
    WEFT_FAIL("trace: ", e.message());
  }
  return events;
}

// What an engine's trace holds, by kind: the names of its threads and streams, the host and GPU
// spans, and the flow arrows (the waits) by id.
struct TraceContents {
  std::map<int, std::string> thread_names, stream_names;
  std::vector<Span> host, gpu;
  std::map<long long, std::pair<int, double>> flow_start, flow_end;
  std::map<long long, std::string> flow_name;

  std::string thread_name(int tid) const {
    auto it = thread_names.find(tid);
    return it != thread_names.end() ? it->second : "thread " + std::to_string(tid);
  }
  std::string stream_name(int tid) const {
    auto it = stream_names.find(tid);
    return it != stream_names.end() ? it->second : "stream " + std::to_string(tid);
  }
};

// Sorts the events of the "host" and "gpu" processes by kind; throws unless the trace is one
// weft's engine wrote.
TraceContents sort_events(const std::vector<Event>& events) {
  int host_pid = -1, gpu_pid = -1;
  for (const auto& e : events) {
    if (e.ph == "M" && e.name == "process_name") {
      if (e.args_name == "host") host_pid = e.pid;
      if (e.args_name == "gpu") gpu_pid = e.pid;
    }
  }
  WEFT_CHECK(host_pid >= 0, "trace: no \"host\" process: not a trace written by weft's engine");
  TraceContents trace;
  for (const auto& e : events) {
    if (e.ph == "M" && e.name == "thread_name") {
      (e.pid == host_pid ? trace.thread_names : trace.stream_names)[e.tid] = e.args_name;
    } else if (e.ph == "X" && (e.pid == host_pid || e.pid == gpu_pid)) {
      // Spans are grouped by iteration: without it every iteration would be drawn as one.
      WEFT_CHECK(e.pid != host_pid || e.iteration.has_value(), "trace: ", event_path(e.index),
                 ": host span '", e.name.substr(0, json_input::kMaxExcerptChars),
                 "' has no args.iteration (not a trace written by weft's engine)");
      (e.pid == host_pid ? trace.host : trace.gpu)
          .push_back({e.name, e.tid, e.ts, e.ts + e.dur, e.batch, e.iteration.value_or(-1),
                      e.lookahead, e.ticket, e.failed});
    } else if ((e.ph == "s" || e.ph == "f") && e.pid == host_pid) {
      (e.ph == "s" ? trace.flow_start : trace.flow_end)[e.id] = {e.tid, e.ts};
      trace.flow_name[e.id] = e.name;
    }
  }
  WEFT_CHECK(!trace.host.empty(), "trace: no host task spans");
  return trace;
}

// The iteration drawn, the second to last of those in which every task ran: its host spans in
// order of their begin, its begin, and the gaps between the begins of consecutive complete
// iterations (the step).
struct DrawnIteration {
  std::vector<const Span*> spans;
  double origin = 0;
  std::vector<double> gaps;
};

DrawnIteration drawn_iteration(const std::vector<Span>& host) {
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
  DrawnIteration result;
  result.origin = begin_of(drawn);
  for (std::size_t i = 1; i < full.size(); ++i) {
    if (full[i] == full[i - 1] + 1) {
      result.gaps.push_back(begin_of(full[i]) - begin_of(full[i - 1]));
    }
  }
  result.spans = by_iteration[drawn];
  std::sort(result.spans.begin(), result.spans.end(),
            [](const Span* a, const Span* b) { return a->begin < b->begin; });
  return result;
}

// Waits of the drawn iteration: flow arrows whose consumer span belongs to it. An arrow ends
// where its consumer's span begins and starts where its producer's span ends (thread, time);
// the spans are indexed by those, the last one written winning, so that reading stays linear
// in the trace's size.
std::vector<WaitEdge> drawn_waits(const TraceContents& trace, const DrawnIteration& drawn) {
  std::vector<WaitEdge> waits;
  std::map<std::pair<int, double>, const Span*> drawn_by_begin, host_by_end;
  for (const auto* s : drawn.spans) drawn_by_begin[{s->tid, s->begin}] = s;
  for (const auto& s : trace.host) host_by_end[{s.tid, s.end}] = &s;
  for (const auto& [id, end] : trace.flow_end) {
    auto start = trace.flow_start.find(id);
    if (start == trace.flow_start.end()) continue;
    const auto consumer_it = drawn_by_begin.find(end);
    if (consumer_it == drawn_by_begin.end()) continue;
    const Span* consumer = consumer_it->second;
    const auto producer_it = host_by_end.find(start->second);
    if (producer_it == host_by_end.end()) continue;
    const Span* producer = producer_it->second;
    const std::string& flow_name = trace.flow_name.at(id);  // recorded with every flow event
    waits.push_back({producer->task, consumer->task, trace.thread_name(producer->tid),
                     trace.thread_name(consumer->tid), rule_from_flow_name(flow_name),
                     producer->end - drawn.origin, std::max(0.0, consumer->begin - producer->end),
                     flow_name});
  }
  return waits;
}

}  // namespace

VariantReport parse_chrome_trace(std::string_view json_text, std::string name) {
  const TraceContents trace = sort_events(read_events(json_text));
  const DrawnIteration drawn = drawn_iteration(trace.host);
  const double origin = drawn.origin;

  VariantReport report;
  report.name = std::move(name);
  report.cascade = "measured";
  report.source = "trace";
  Timeline& t = report.timeline;
  for (const auto& [tid, n] : trace.thread_names) t.threads.push_back(n);
  double host_end = origin;
  std::map<std::string, std::string> stream_of_task;
  for (const auto& s : trace.gpu) stream_of_task.emplace(s.task, trace.stream_name(s.tid));
  for (const auto* s : drawn.spans) {
    t.host.push_back({s->task, trace.thread_name(s->tid), s->begin - origin, s->end - origin,
                      s->batch, s->ticket});
    host_end = std::max(host_end, s->end);
    const auto stream = stream_of_task.count(s->task) ? stream_of_task[s->task] : "host";
    report.placement.push_back(
        {s->task, stream, trace.thread_name(s->tid), s->lookahead, s->ticket >= 0});
  }
  t.host_step_us = host_end - origin;
  if (drawn.gaps.empty()) {
    t.step_us = t.host_step_us;
  } else {
    std::vector<double> gaps = drawn.gaps;
    std::nth_element(gaps.begin(), gaps.begin() + long(gaps.size() / 2), gaps.end());
    t.step_us = gaps[gaps.size() / 2];
  }
  const double window = std::max(t.step_us, t.host_step_us);
  std::set<std::string> streams;
  for (const auto& s : trace.gpu) {
    const double b = std::max(s.begin, origin), e = std::min(s.end, origin + window);
    if (e <= b) continue;
    t.gpu.push_back({s.task, trace.stream_name(s.tid), b - origin, e - origin});
    streams.insert(trace.stream_name(s.tid));
  }
  for (const auto& [tid, n] : trace.stream_names) {
    if (streams.count(n)) t.streams.push_back(n);
  }
  t.waits = drawn_waits(trace, drawn);
  for (const auto& n : t.threads) report.thread_map += (report.thread_map.empty() ? "" : " / ") + n;
  report.thread_map += " (" + std::to_string(t.threads.size()) + ")";
  return report;
}

pipeline::Trace parse_engine_trace(std::string_view json_text) {
  const TraceContents contents = sort_events(read_events(json_text));
  pipeline::Trace trace;
  auto names = [](const std::map<int, std::string>& by_tid, int largest, const char* kind) {
    std::vector<std::string> out;
    for (int tid = 0; tid <= largest; ++tid) {
      const auto it = by_tid.find(tid);
      out.push_back(it != by_tid.end() ? it->second : kind + std::to_string(tid));
    }
    return out;
  };
  int largest_thread = contents.thread_names.empty() ? -1 : contents.thread_names.rbegin()->first;
  int largest_stream = contents.stream_names.empty() ? -1 : contents.stream_names.rbegin()->first;
  std::map<std::string, pipeline::TaskId> task_of;
  auto task_id = [&](const std::string& name) {
    const auto [it, added] = task_of.emplace(name, pipeline::TaskId(trace.task_names.size()));
    if (added) trace.task_names.push_back(name);
    return it->second;
  };
  auto tid_of = [](const Span& s, const char* kind) {
    WEFT_CHECK(s.tid >= 0, "trace: a ", kind, " span of '",
               s.task.substr(0, json_input::kMaxExcerptChars), "' has tid ", s.tid);
    return std::uint32_t(s.tid);
  };
  for (const auto& s : contents.host) {
    largest_thread = std::max(largest_thread, s.tid);
    trace.host_spans.push_back({.task = task_id(s.task), .thread = tid_of(s, "host"),
                                .batch = s.batch, .lookahead = s.lookahead,
                                .iteration = s.iteration, .ticket = s.ticket,
                                .begin_us = s.begin, .end_us = s.end, .failed = s.failed});
  }
  for (const auto& s : contents.gpu) {
    largest_stream = std::max(largest_stream, s.tid);
    trace.gpu_spans.push_back({.task = task_id(s.task), .stream = tid_of(s, "GPU"),
                               .batch = s.batch, .begin_us = s.begin, .end_us = s.end,
                               .failed = s.failed});
  }
  trace.thread_names = names(contents.thread_names, largest_thread, "thread ");
  trace.stream_names = names(contents.stream_names, largest_stream, "stream ");
  std::stable_sort(trace.host_spans.begin(), trace.host_spans.end(),
                   [](const auto& a, const auto& b) { return a.begin_us < b.begin_us; });
  return trace;
}

pipeline::Trace read_engine_trace(const std::string& path) {
  return json_input::load_json_file(
      path, "trace", kMaxTraceFileBytes,
      [](const std::string& text) { return parse_engine_trace(text); });
}

VariantReport read_chrome_trace(const std::string& path) {
  auto report = json_input::load_json_file(path, "trace", kMaxTraceFileBytes, [&](const std::string& text) {
    return parse_chrome_trace(text, std::filesystem::path(path).stem().string());
  });
  report.source = "trace " + std::filesystem::path(path).filename().string();
  return report;
}

}  // namespace weft::plan
