// weft._weft.plan: weft::plan's simulator, report and trace reader (the layer over it is
// weft/plan.py). Schedules and thread maps are weft._weft.pipeline's objects; results are
// read-only copies of weft::plan's structs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>
#include <vector>

#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/pipeline/schedule.hpp"
#include "weft/pipeline/thread_map.hpp"
#include "weft/pipeline/trace.hpp"
#include "weft/plan/cost_model.hpp"
#include "weft/plan/report.hpp"
#include "weft/plan/simulated_variant.hpp"
#include "weft/plan/suggest.hpp"
#include "weft/plan/trace_costs.hpp"
#include "weft/plan/trace_reader.hpp"

namespace weft::python {

namespace nb = nanobind;

namespace {

namespace pl = weft::pipeline;

void bind_results(nb::module_& m) {
  nb::class_<plan::HostSpan>(m, "HostSpan")
      .def_ro("task", &plan::HostSpan::task)
      .def_ro("thread", &plan::HostSpan::thread)
      .def_ro("start_us", &plan::HostSpan::start_us)
      .def_ro("end_us", &plan::HostSpan::end_us)
      .def_ro("batch", &plan::HostSpan::batch)
      .def_ro("ticket", &plan::HostSpan::ticket);
  nb::class_<plan::GpuSpan>(m, "GpuSpan")
      .def_ro("task", &plan::GpuSpan::task)
      .def_ro("stream", &plan::GpuSpan::stream)
      .def_ro("start_us", &plan::GpuSpan::start_us)
      .def_ro("end_us", &plan::GpuSpan::end_us);
  nb::class_<plan::WaitEdge>(m, "WaitEdge")
      .def_ro("producer", &plan::WaitEdge::producer)
      .def_ro("consumer", &plan::WaitEdge::consumer)
      .def_ro("producer_thread", &plan::WaitEdge::producer_thread)
      .def_ro("consumer_thread", &plan::WaitEdge::consumer_thread)
      .def_prop_ro("rule", [](const plan::WaitEdge& w) { return std::string(to_string(w.rule)); })
      .def_ro("released_at_us", &plan::WaitEdge::released_at_us)
      .def_ro("waited_us", &plan::WaitEdge::waited_us)
      .def_ro("cause", &plan::WaitEdge::cause);
  nb::class_<plan::TaskPlacement>(m, "TaskPlacement")
      .def_ro("task", &plan::TaskPlacement::task)
      .def_ro("stream", &plan::TaskPlacement::stream)
      .def_ro("thread", &plan::TaskPlacement::thread)
      .def_ro("lookahead", &plan::TaskPlacement::lookahead)
      .def_ro("collective", &plan::TaskPlacement::collective);
  nb::class_<plan::Timeline>(m, "Timeline", "One steady-state progress() (times in us).")
      .def_ro("threads", &plan::Timeline::threads)
      .def_ro("streams", &plan::Timeline::streams)
      .def_ro("host", &plan::Timeline::host)
      .def_ro("gpu", &plan::Timeline::gpu)
      .def_ro("waits", &plan::Timeline::waits)
      .def_ro("host_step_us", &plan::Timeline::host_step_us)
      .def_ro("step_us", &plan::Timeline::step_us);
  nb::class_<plan::VariantReport>(m, "VariantReport", "One variant of the report.")
      .def_ro("name", &plan::VariantReport::name)
      .def_ro("cascade", &plan::VariantReport::cascade)
      .def_ro("thread_map", &plan::VariantReport::thread_map)
      .def_ro("source", &plan::VariantReport::source)
      .def_ro("placement", &plan::VariantReport::placement)
      .def_ro("timeline", &plan::VariantReport::timeline);
}

void bind_cost_model(nb::module_& m) {
  nb::class_<plan::CostModel>(m, "CostModel", "weft::plan::CostModel (docs/planner.md)")
      .def(nb::init<>())
      .def_static("parse", [](const std::string& text) { return plan::CostModel::parse(text); })
      .def_static("load", &plan::CostModel::load, nb::arg("path"))
      .def_static("hstu_defaults", &plan::CostModel::hstu_defaults)
      .def("to_json", &plan::CostModel::to_json)
      .def_ro("default_host_us", &plan::CostModel::default_host_us)
      .def("__eq__", [](const plan::CostModel& a, const plan::CostModel& b) { return a == b; });
}

void bind_suggest(nb::module_& m) {
  nb::class_<plan::Suggestion>(m, "Suggestion", "One suggested schedule (weft::plan::Suggestion).")
      .def_ro("config", &plan::Suggestion::config)
      .def_ro("placement", &plan::Suggestion::placement)
      .def_ro("step_us", &plan::Suggestion::step_us)
      .def_ro("host_step_us", &plan::Suggestion::host_step_us)
      .def_ro("num_threads", &plan::Suggestion::num_threads)
      .def_ro("busiest_thread", &plan::Suggestion::busiest_thread)
      .def_ro("busiest_thread_busy_us", &plan::Suggestion::busiest_thread_busy_us)
      .def_ro("bound", &plan::Suggestion::bound)
      .def_ro("waits", &plan::Suggestion::waits);
  nb::class_<plan::SuggestResult>(m, "SuggestResult", "What weft::plan::suggest found.")
      .def_ro("suggestions", &plan::SuggestResult::suggestions)
      .def_ro("start", &plan::SuggestResult::start)
      .def_ro("method", &plan::SuggestResult::method)
      .def_ro("searched", &plan::SuggestResult::searched)
      .def_ro("not_searched", &plan::SuggestResult::not_searched)
      .def_ro("num_evaluated", &plan::SuggestResult::num_evaluated)
      .def_ro("num_refused", &plan::SuggestResult::num_refused)
      .def("__str__", [](const plan::SuggestResult& r) { return plan::describe(r); });
  m.def(
      "suggest",
      [](const pl::Schedule& schedule, const plan::CostModel& costs, int max_threads,
         int min_lookahead, int max_lookahead, int num_best, int num_progress, int num_batches,
         int max_host_runahead, double wake_up_us, const std::vector<std::string>& gil_tasks,
         const std::string& slowed_stream, double overlap_slowdown,
         const std::vector<pl::ThreadMap>& start_maps) {
        plan::SuggestOptions options{.max_threads = max_threads,
                                     .min_lookahead = min_lookahead,
                                     .max_lookahead = max_lookahead,
                                     .num_best = num_best,
                                     .simulation = {.num_progress = num_progress,
                                                    .num_batches = num_batches,
                                                    .max_host_runahead = max_host_runahead,
                                                    .thread_wake_up_us = wake_up_us,
                                                    .gil_tasks = gil_tasks,
                                                    .slowed_stream = slowed_stream,
                                                    .overlap_slowdown = overlap_slowdown},
                                     .start_maps = start_maps};
        return plan::suggest(pl::CompiledSchedule(schedule), costs, options);
      },
      nb::arg("schedule"), nb::arg("costs"), nb::arg("max_threads"), nb::arg("min_lookahead"),
      nb::arg("max_lookahead"), nb::arg("num_best"), nb::arg("num_progress"),
      nb::arg("num_batches"), nb::arg("max_host_runahead"), nb::arg("wake_up_us"),
      nb::arg("gil_tasks"), nb::arg("slowed_stream"), nb::arg("overlap_slowdown"),
      nb::arg("start_maps"),
      "Searches thread maps and lookaheads (max_lookahead -1: the schedule's largest).");
}

// A pipeline::Trace from an engine's (weft._weft.pipeline.Trace), or from any object with its
// fields (task_names, stream_names; host_spans with task, batch, iteration, ticket, begin_us,
// end_us, failed; gpu_spans with task, stream, batch, begin_us, end_us, failed), such as the MoE
// step's merged traces: what plan::trace_costs reads.
pl::Trace trace_of(nb::handle obj) {
  if (nb::isinstance<pl::Trace>(obj)) return nb::cast<const pl::Trace&>(obj);
  pl::Trace t;
  t.task_names = nb::cast<std::vector<std::string>>(obj.attr("task_names"));
  t.stream_names = nb::cast<std::vector<std::string>>(obj.attr("stream_names"));
  for (nb::handle s : obj.attr("host_spans")) {
    t.host_spans.push_back({.task = nb::cast<pl::TaskId>(s.attr("task")),
                            .batch = nb::cast<std::int64_t>(s.attr("batch")),
                            .iteration = nb::cast<std::int64_t>(s.attr("iteration")),
                            .ticket = nb::cast<int>(s.attr("ticket")),
                            .begin_us = nb::cast<double>(s.attr("begin_us")),
                            .end_us = nb::cast<double>(s.attr("end_us")),
                            .failed = nb::cast<bool>(s.attr("failed"))});
  }
  for (nb::handle s : obj.attr("gpu_spans")) {
    t.gpu_spans.push_back({.task = nb::cast<pl::TaskId>(s.attr("task")),
                           .stream = nb::cast<std::uint32_t>(s.attr("stream")),
                           .batch = nb::cast<std::int64_t>(s.attr("batch")),
                           .begin_us = nb::cast<double>(s.attr("begin_us")),
                           .end_us = nb::cast<double>(s.attr("end_us")),
                           .failed = nb::cast<bool>(s.attr("failed"))});
  }
  return t;
}

void bind_trace_costs(nb::module_& m) {
  m.def(
      "trace_costs",
      [](nb::handle trace, const pl::Schedule* schedule, const std::string& gpu,
         double skip_fraction, const std::map<std::string, std::string>& gpu_waits) {
        plan::TraceCostOptions options{.gpu = plan::parse_gpu_cost(gpu),
                                       .skip_fraction = skip_fraction};
        options.gpu_waits.insert(gpu_waits.begin(), gpu_waits.end());
        return plan::trace_costs(trace_of(trace), schedule, options);
      },
      nb::arg("trace"), nb::arg("schedule").none(), nb::arg("gpu"), nb::arg("skip_fraction"),
      nb::arg("gpu_waits"),
      "weft::plan::trace_costs of an engine trace, or of any object with a trace's fields.");
  m.def("read_engine_trace", &plan::read_engine_trace, nb::arg("path"));
}

}  // namespace

void bind_plan(nb::module_& m) {
  bind_results(m);
  bind_cost_model(m);
  m.def(
      "simulate",
      [](const std::string& name, const std::string& cascade, const pl::Schedule& schedule,
         const pl::ThreadMap& map, const plan::CostModel& costs, int num_progress,
         int num_batches, int max_host_runahead, double wake_up_us,
         const std::vector<std::string>& gil_tasks, const std::string& slowed_stream,
         double overlap_slowdown) {
        const pl::CompiledSchedule compiled(schedule);
        costs.check_against(compiled);
        return plan::simulate_variant(name, cascade, compiled, map, costs,
                                      {.num_progress = num_progress,
                                       .num_batches = num_batches,
                                       .max_host_runahead = max_host_runahead,
                                       .thread_wake_up_us = wake_up_us,
                                       .gil_tasks = gil_tasks,
                                       .slowed_stream = slowed_stream,
                                       .overlap_slowdown = overlap_slowdown});
      },
      nb::arg("name"), nb::arg("cascade"), nb::arg("schedule"), nb::arg("thread_map"),
      nb::arg("costs"), nb::arg("num_progress"), nb::arg("num_batches"),
      nb::arg("max_host_runahead"), nb::arg("wake_up_us"), nb::arg("gil_tasks"),
      nb::arg("slowed_stream"), nb::arg("overlap_slowdown"),
      "Checks the costs against the schedule and simulates it under the thread map.");
  m.def(
      "render_html",
      [](const std::vector<plan::VariantReport>& variants, const std::string& title,
         const pl::Schedule* inventory_of) {
        plan::ReportOptions options{.title = title};
        if (inventory_of != nullptr) {
          plan::add_collective_inventory(pl::CompiledSchedule(*inventory_of), options);
        }
        return plan::render_html(variants, options);
      },
      nb::arg("variants"), nb::arg("title"), nb::arg("inventory_of").none(),
      "The report's HTML; the collective inventory is that of inventory_of (None: none).");
  m.def("read_chrome_trace", &plan::read_chrome_trace, nb::arg("path"));
  m.def("parse_chrome_trace", &plan::parse_chrome_trace, nb::arg("json_text"), nb::arg("name"));
  bind_suggest(m);
  bind_trace_costs(m);
}

}  // namespace weft::python
