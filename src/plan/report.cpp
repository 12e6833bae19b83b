#include "weft/plan/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <sstream>

namespace weft::plan {
namespace {

// Layout constants of the Gantt, in SVG pixels.
constexpr double kLabelWidth = 170;
constexpr double kPlotWidth = 1080;
constexpr double kBarHeight = 20;
constexpr double kLaneHeight = 13;
constexpr double kRowGap = 8;
constexpr double kCharWidth = 6.3;  // of the 11px sans-serif labels, a safe over-estimate
constexpr double kAxisHeight = 28;

const std::vector<std::string> kPalette = {"#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759",
                                           "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac",
                                           "#86bcb6", "#d37295", "#a0cbe8", "#8cd17d"};

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(double value, int decimals = 1) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

std::string hashed_colour(const std::string& name) {
  return kPalette[std::hash<std::string>{}(name) % kPalette.size()];
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB"};
  int unit = 0;
  while (bytes >= 1000 && unit < 3) {
    bytes /= 1000;
    ++unit;
  }
  return fmt(bytes, bytes < 10 && unit > 0 ? 1 : 0) + " " + units[unit];
}

double text_width(const std::string& text) { return kCharWidth * double(text.size()) + 6; }

// A "nice" tick step giving about 8 ticks over [0, extent].
double tick_step(double extent) {
  const double raw = extent / 8;
  const double magnitude = std::pow(10.0, std::floor(std::log10(std::max(raw, 1e-9))));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * magnitude) return m * magnitude;
  }
  return 10 * magnitude;
}

struct Bar {
  std::string label;
  std::string tooltip;
  std::string fill;
  double x0 = 0;
  double x1 = 0;
  int lane = -1;  // -1: label inside the bar; >= 0: label in that lane above the row
};

struct Row {
  std::string name;
  std::string colour;
  bool gpu = false;
  std::vector<Bar> bars;
  int num_lanes = 0;
  double y = 0;  // top of the bar band
};

Row make_row(std::string name, std::string colour, bool gpu) {
  Row row;
  row.name = std::move(name);
  row.colour = std::move(colour);
  row.gpu = gpu;
  return row;
}

// A bar is at least one pixel wide, so that instantaneous tasks stay visible.
Bar make_bar(std::string label, std::string tooltip, std::string fill, double x0, double x1) {
  Bar bar;
  bar.label = std::move(label);
  bar.tooltip = std::move(tooltip);
  bar.fill = std::move(fill);
  bar.x0 = x0;
  bar.x1 = std::max(x1, x0 + 1);
  return bar;
}

// Labels that do not fit inside their bar go into lanes above the row, greedily, so that no two
// labels overlap: a lane is reused once the previous label in it has ended.
void assign_label_lanes(Row& row) {
  std::sort(row.bars.begin(), row.bars.end(),
            [](const Bar& a, const Bar& b) { return a.x0 < b.x0; });
  std::vector<double> lane_end;
  for (auto& bar : row.bars) {
    if (text_width(bar.label) <= bar.x1 - bar.x0) continue;
    const double width = text_width(bar.label);
    int lane = 0;
    while (lane < int(lane_end.size()) && lane_end[lane] > bar.x0) ++lane;
    if (lane == int(lane_end.size())) lane_end.push_back(0);
    lane_end[lane] = bar.x0 + width;
    bar.lane = lane;
  }
  row.num_lanes = int(lane_end.size());
}

void write_legend(std::ostringstream& out, const std::vector<std::string>& streams,
                  const std::vector<std::string>& threads) {
  out << "<div class=legend><b>streams</b> ";
  for (const auto& s : streams) {
    out << "<span class=chip style='background:" << stream_colour(s) << "'></span>" << escape(s)
        << " ";
  }
  out << " &nbsp; <b>threads</b> ";
  for (const auto& t : threads) {
    out << "<span class=chip style='background:" << thread_colour(t) << "'></span>" << escape(t)
        << " ";
  }
  out << " &nbsp; <svg width=34 height=10><line x1=0 y1=5 x2=34 y2=5 stroke='#d62728' "
         "stroke-width=2 stroke-dasharray='5,3'/></svg> wait (same lookahead / same-progress sync)"
      << " &nbsp; <svg width=34 height=10><line x1=0 y1=5 x2=34 y2=5 stroke='#777' "
         "stroke-width=1.5 stroke-dasharray='2,3'/></svg> wait (collective ticket / stream order)"
      << " &nbsp; labels: task@lookahead</div>\n";
}

// The Gantt of one variant laid out: a row per host thread, then a row per GPU stream, each bar
// placed on the time axis (x_of) and its label in a lane.
struct GanttLayout {
  std::vector<Row> rows;
  std::map<std::string, std::size_t> host_row;  // thread -> its row
  double extent = 1;                            // the drawn time span, us
  double scale = 1;                             // px per us
  double height = 0;
  double width = kLabelWidth + kPlotWidth + 190;  // room for labels of the last bars
  bool has_gpu_rows = false;

  double x_of(double t) const { return kLabelWidth + t * scale; }
};

GanttLayout lay_out_gantt(const VariantReport& variant) {
  const Timeline& tl = variant.timeline;
  GanttLayout g;
  std::map<std::string, int> lookahead;
  std::map<std::string, std::string> stream_of;
  for (const auto& p : variant.placement) {
    lookahead[p.task] = p.lookahead;
    stream_of[p.task] = p.stream;
  }
  auto label_of = [&](const std::string& task) {
    auto it = lookahead.find(task);
    return it == lookahead.end() ? task : task + "@" + std::to_string(it->second);
  };
  for (const auto& s : tl.host) g.extent = std::max(g.extent, s.end_us);
  for (const auto& s : tl.gpu) g.extent = std::max(g.extent, s.end_us);
  g.scale = kPlotWidth / g.extent;

  for (const auto& thread : tl.threads) {
    g.host_row[thread] = g.rows.size();
    g.rows.push_back(make_row(thread, thread_colour(thread), false));
  }
  for (const auto& span : tl.host) {
    auto it = g.host_row.find(span.thread);
    if (it == g.host_row.end()) continue;
    const std::string stream = stream_of.count(span.task) ? stream_of[span.task] : "";
    std::string tip = span.task + " on " + span.thread + ": " + fmt(span.start_us) + " - " +
                      fmt(span.end_us) + " us";
    if (span.batch >= 0) tip += ", batch " + std::to_string(span.batch);
    if (span.ticket >= 0) tip += ", ticket " + std::to_string(span.ticket);
    g.rows[it->second].bars.push_back(make_bar(label_of(span.task), tip, stream_colour(stream),
                                               g.x_of(span.start_us), g.x_of(span.end_us)));
  }
  std::map<std::string, std::size_t> gpu_row;
  for (const auto& stream : tl.streams) {
    gpu_row[stream] = g.rows.size();
    g.rows.push_back(make_row("GPU " + stream, stream_colour(stream), true));
  }
  for (const auto& span : tl.gpu) {
    auto it = gpu_row.find(span.stream);
    if (it == gpu_row.end()) continue;
    g.rows[it->second].bars.push_back(
        make_bar(label_of(span.task),
                 span.task + " on GPU stream " + span.stream + ": " + fmt(span.start_us) + " - " +
                     fmt(span.end_us) + " us",
                 stream_colour(span.stream), g.x_of(span.start_us), g.x_of(span.end_us)));
  }

  double y = kAxisHeight;
  for (auto& row : g.rows) {
    assign_label_lanes(row);
    if (row.gpu && !g.has_gpu_rows) {
      y += 14;
      g.has_gpu_rows = true;
    }
    row.y = y + row.num_lanes * kLaneHeight;
    y = row.y + kBarHeight + kRowGap;
  }
  g.height = y + 6;
  return g;
}

// The time axis with its ticks, and the rule that separates the host rows from the GPU rows.
void write_time_axis(std::ostringstream& out, const GanttLayout& g) {
  const double step = tick_step(g.extent);
  for (double t = 0; t <= g.extent * 1.0001; t += step) {
    out << "<line x1='" << fmt(g.x_of(t)) << "' y1='" << kAxisHeight - 6 << "' x2='"
        << fmt(g.x_of(t)) << "' y2='" << fmt(g.height - 4) << "' stroke='#e4e4e4'/>"
        << "<text x='" << fmt(g.x_of(t)) << "' y='" << kAxisHeight - 10
        << "' text-anchor='middle' fill='#555'>" << fmt(t, t < 10 ? 1 : 0) << "</text>\n";
  }
  out << "<text x='4' y='" << kAxisHeight - 10 << "' fill='#555'>time (us)</text>\n";
  if (!g.has_gpu_rows) return;
  double gpu_y = 0;
  for (const auto& row : g.rows) {
    if (row.gpu) {
      gpu_y = row.y - row.num_lanes * kLaneHeight - 10;
      break;
    }
  }
  out << "<line x1='0' y1='" << fmt(gpu_y) << "' x2='" << fmt(g.width) << "' y2='" << fmt(gpu_y)
      << "' stroke='#999' stroke-dasharray='1,2'/>\n";
}

// Each row's name and bars; a label that does not fit its bar is drawn in its lane above the row.
void write_rows(std::ostringstream& out, const std::vector<Row>& rows) {
  for (const auto& row : rows) {
    out << "<rect x='2' y='" << fmt(row.y) << "' width='10' height='" << kBarHeight
        << "' fill='" << row.colour << "'/><text x='16' y='" << fmt(row.y + 14) << "'>"
        << escape(row.name) << "</text>\n";
    for (const auto& bar : row.bars) {
      out << "<g><title>" << escape(bar.tooltip) << "</title><rect x='" << fmt(bar.x0)
          << "' y='" << fmt(row.y) << "' width='" << fmt(bar.x1 - bar.x0) << "' height='"
          << kBarHeight << "' fill='" << bar.fill << "' fill-opacity='0.85' stroke='"
          << (row.gpu ? "#333" : thread_colour(row.name)) << "' stroke-width='1'/>";
      if (bar.lane < 0) {
        out << "<text x='" << fmt(bar.x0 + 3) << "' y='" << fmt(row.y + 14) << "' fill='#fff'>"
            << escape(bar.label) << "</text>";
      } else {
        const double label_y = row.y - 3 - bar.lane * kLaneHeight;
        out << "<line x1='" << fmt(bar.x0 + 1) << "' y1='" << fmt(label_y + 2) << "' x2='"
            << fmt(bar.x0 + 1) << "' y2='" << fmt(row.y) << "' stroke='#999'/>"
            << "<text x='" << fmt(bar.x0 + 2) << "' y='" << fmt(label_y) << "' fill='#222'>"
            << escape(bar.label) << "</text>";
      }
      out << "</g>\n";
    }
  }
}

// The cross-thread waits as arrows from the producer's end to the consumer's start: red dashed
// with an arrow head for the lookahead rules, grey dotted for the engine's own orderings.
void write_wait_arrows(std::ostringstream& out, const VariantReport& variant,
                       const GanttLayout& g) {
  const Timeline& tl = variant.timeline;
  auto find_span = [&](const std::string& task, const std::string& thread) -> const HostSpan* {
    for (const auto& s : tl.host) {
      if (s.task == task && s.thread == thread) return &s;
    }
    return nullptr;
  };
  for (const auto& wait : tl.waits) {
    const HostSpan* producer = find_span(wait.producer, wait.producer_thread);
    const HostSpan* consumer = find_span(wait.consumer, wait.consumer_thread);
    if (!producer || !consumer || !g.host_row.count(wait.producer_thread) ||
        !g.host_row.count(wait.consumer_thread)) {
      continue;
    }
    const Row& from = g.rows[g.host_row.at(wait.producer_thread)];
    const Row& to = g.rows[g.host_row.at(wait.consumer_thread)];
    const bool lookahead_rule = is_lookahead_rule(wait.rule);
    const double x0 = g.x_of(producer->end_us);
    const double x1 = g.x_of(consumer->start_us);
    const double y0 = from.y + kBarHeight / 2;
    const double y1 = to.y + kBarHeight / 2;
    out << "<g><title>"
        << escape(wait.producer + " -> " + wait.consumer + " (" + to_string(wait.rule) +
                  ", waited " + fmt(wait.waited_us) + " us) " + wait.cause)
        << "</title><path d='M" << fmt(x0) << "," << fmt(y0) << " C" << fmt(x0 + 18) << ","
        << fmt(y0) << " " << fmt(x1 - 18) << "," << fmt(y1) << " " << fmt(x1) << "," << fmt(y1)
        << "' fill='none' stroke='" << (lookahead_rule ? "#d62728" : "#777") << "' stroke-width='"
        << (lookahead_rule ? "2" : "1.5") << "' stroke-dasharray='"
        << (lookahead_rule ? "5,3" : "2,3") << "'"
        << (lookahead_rule ? " marker-end='url(#arrow-" + escape(variant.name) + ")'" : "")
        << "/></g>\n";
  }
}

void write_gantt(std::ostringstream& out, const VariantReport& variant) {
  const GanttLayout g = lay_out_gantt(variant);
  out << "<svg class=gantt xmlns='http://www.w3.org/2000/svg' width='" << fmt(g.width, 0)
      << "' height='" << fmt(g.height, 0) << "' viewBox='0 0 " << fmt(g.width, 0) << " "
      << fmt(g.height, 0) << "' font-family='sans-serif' font-size='11'>\n";
  out << "<defs><marker id='arrow-" << escape(variant.name)
      << "' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='6' markerHeight='6' "
         "orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#d62728'/></marker>"
         "</defs>\n";
  write_time_axis(out, g);
  write_rows(out, g.rows);
  write_wait_arrows(out, variant, g);
  out << "</svg>\n";
}

void write_topology(std::ostringstream& out, const VariantReport& variant) {
  std::vector<std::string> threads;
  std::vector<std::string> streams;
  for (const auto& p : variant.placement) {
    if (std::find(threads.begin(), threads.end(), p.thread) == threads.end()) {
      threads.push_back(p.thread);
    }
    if (std::find(streams.begin(), streams.end(), p.stream) == streams.end()) {
      streams.push_back(p.stream);
    }
  }
  constexpr double kRow = 22;
  const double num_rows = double(std::max<std::size_t>(
      {variant.placement.size(), threads.size(), streams.size(), std::size_t(1)}));
  const double height = 30 + num_rows * kRow;
  const double x_thread = 10, x_task = 300, x_stream = 700, width = 860;
  auto centre = [&](std::size_t i, std::size_t n) {
    return 30 + (num_rows * kRow) * (double(i) + 0.5) / double(n);
  };
  out << "<svg class=topology xmlns='http://www.w3.org/2000/svg' width='" << width
      << "' height='" << fmt(height, 0) << "' font-family='sans-serif' font-size='11'>\n"
      << "<text x='" << x_thread << "' y='16' font-weight='bold'>thread</text><text x='" << x_task
      << "' y='16' font-weight='bold'>task@lookahead</text><text x='" << x_stream
      << "' y='16' font-weight='bold'>stream</text>\n";
  const std::size_t n = variant.placement.size();
  for (std::size_t i = 0; i < n; ++i) {
    const auto& p = variant.placement[i];
    const double y = centre(i, n);
    const auto ti = std::size_t(std::find(threads.begin(), threads.end(), p.thread) - threads.begin());
    const auto si = std::size_t(std::find(streams.begin(), streams.end(), p.stream) - streams.begin());
    out << "<line x1='" << x_thread + 120 << "' y1='" << fmt(centre(ti, threads.size()))
        << "' x2='" << x_task << "' y2='" << fmt(y) << "' stroke='" << thread_colour(p.thread)
        << "' stroke-width='1.5'/><line x1='" << x_task + 200 << "' y1='" << fmt(y) << "' x2='"
        << x_stream << "' y2='" << fmt(centre(si, streams.size())) << "' stroke='"
        << stream_colour(p.stream) << "' stroke-width='1.5'/>\n"
        << "<rect x='" << x_task << "' y='" << fmt(y - 9) << "' width='200' height='18' rx='3' "
        << "fill='#fff' stroke='" << stream_colour(p.stream) << "' stroke-width='2'/><text x='"
        << x_task + 6 << "' y='" << fmt(y + 4) << "'>" << escape(p.task) << "@" << p.lookahead
        << (p.collective ? " (collective)" : "") << "</text>\n";
  }
  for (std::size_t i = 0; i < threads.size(); ++i) {
    const double y = centre(i, threads.size());
    out << "<rect x='" << x_thread << "' y='" << fmt(y - 9) << "' width='120' height='18' rx='3' "
        << "fill='" << thread_colour(threads[i]) << "'/><text x='" << x_thread + 6 << "' y='"
        << fmt(y + 4) << "' fill='#fff'>" << escape(threads[i]) << "</text>\n";
  }
  for (std::size_t i = 0; i < streams.size(); ++i) {
    const double y = centre(i, streams.size());
    out << "<rect x='" << x_stream << "' y='" << fmt(y - 9) << "' width='120' height='18' rx='3' "
        << "fill='" << stream_colour(streams[i]) << "'/><text x='" << x_stream + 6 << "' y='"
        << fmt(y + 4) << "' fill='#fff'>" << escape(streams[i]) << "</text>\n";
  }
  out << "</svg>\n";
}

}  // namespace

std::string stream_colour(const std::string& stream) {
  static const std::map<std::string, std::string> kKnown = {
      {"default", "#4e79a7"}, {"memcpy", "#f28e2b"}, {"data_dist", "#59a14f"},
      {"prefetch", "#b07aa1"}, {"output_dist_comm", "#e15759"}};
  auto it = kKnown.find(stream);
  return it != kKnown.end() ? it->second : hashed_colour(stream);
}

std::string thread_colour(const std::string& thread) {
  static const std::map<std::string, std::string> kKnown = {{"io", "#d4a017"},
                                                            {"compute", "#2f4b7c"},
                                                            {"data_dist", "#3c8d2f"},
                                                            {"prefetch", "#8e44ad"},
                                                            {"main", "#555555"}};
  auto it = kKnown.find(thread);
  return it != kKnown.end() ? it->second : hashed_colour("thread:" + thread);
}

std::string render_html(const std::vector<VariantReport>& variants, const ReportOptions& options) {
  std::ostringstream out;
  out << "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" << escape(options.title)
      << "</title>\n<style>body{font-family:sans-serif;margin:20px;color:#222}"
         "table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;"
         "padding:3px 8px;font-size:13px;text-align:left}th{background:#f2f2f2}"
         ".chip{display:inline-block;width:12px;height:12px;margin:0 3px 0 6px;"
         "vertical-align:middle}.legend{font-size:12px;margin:6px 0}"
         "section{margin-bottom:36px}h2{margin-bottom:4px}.num{text-align:right}</style>"
         "</head><body>\n<h1>"
      << escape(options.title) << "</h1>\n";

  std::vector<std::string> all_streams;
  std::vector<std::string> all_threads;
  for (const auto& v : variants) {
    for (const auto& p : v.placement) {
      if (std::find(all_streams.begin(), all_streams.end(), p.stream) == all_streams.end()) {
        all_streams.push_back(p.stream);
      }
      if (std::find(all_threads.begin(), all_threads.end(), p.thread) == all_threads.end()) {
        all_threads.push_back(p.thread);
      }
    }
  }
  write_legend(out, all_streams, all_threads);

  out << "<h2>Variants</h2>\n<table id=variants><tr><th>variant</th><th>cascade</th>"
         "<th>thread_map</th><th>#threads</th><th>step (us)</th><th>host per progress (us)</th>"
         "<th>cross-thread waits</th><th>of them lookahead rules</th><th>source</th></tr>\n";
  for (const auto& v : variants) {
    const auto num_lookahead_waits =
        std::count_if(v.timeline.waits.begin(), v.timeline.waits.end(),
                      [](const WaitEdge& w) { return is_lookahead_rule(w.rule); });
    out << "<tr><td><a href='#" << escape(v.name) << "'>" << escape(v.name) << "</a></td><td>"
        << escape(v.cascade) << "</td><td>" << escape(v.thread_map) << "</td><td class=num>"
        << v.timeline.threads.size() << "</td><td class=num>" << fmt(v.timeline.step_us)
        << "</td><td class=num>" << fmt(v.timeline.host_step_us) << "</td><td class=num>"
        << v.timeline.waits.size() << "</td><td class=num>" << num_lookahead_waits << "</td><td>"
        << escape(v.source) << "</td></tr>\n";
  }
  out << "</table>\n";

  for (const auto& v : variants) {
    out << "<section id='" << escape(v.name) << "'><h2>" << escape(v.name) << "</h2>\n<p>"
        << escape(v.cascade) << " cascade, thread map " << escape(v.thread_map) << "; "
        << escape(v.source) << ". One progress() in steady state: step "
        << fmt(v.timeline.step_us) << " us, host " << fmt(v.timeline.host_step_us) << " us.</p>\n";
    write_gantt(out, v);
    out << "<table><tr><th>thread</th><th>busy (us)</th><th>waiting (us)</th></tr>\n";
    for (const auto& load : thread_loads(v.timeline)) {
      out << "<tr><td>" << escape(load.thread) << "</td><td class=num>" << fmt(load.busy_us)
          << "</td><td class=num>" << fmt(load.wait_us) << "</td></tr>\n";
    }
    out << "</table>\n";
    if (!v.timeline.waits.empty()) {
      out << "<details><summary>" << v.timeline.waits.size()
          << " cross-thread waits</summary><table><tr><th>producer</th><th>consumer</th>"
             "<th>threads</th><th>rule</th><th>edge</th><th>waited (us)</th></tr>\n";
      for (const auto& w : v.timeline.waits) {
        out << "<tr><td>" << escape(w.producer) << "</td><td>" << escape(w.consumer)
            << "</td><td>" << escape(w.producer_thread) << " &rarr; " << escape(w.consumer_thread)
            << "</td><td>" << to_string(w.rule) << "</td><td>" << escape(w.cause)
            << "</td><td class=num>" << fmt(w.waited_us)
            << "</td></tr>\n";
      }
      out << "</table></details>\n";
    }
    write_topology(out, v);
    out << "</section>\n";
  }

  if (!options.collectives.empty()) {
    out << "<h2>Collective inventory per task</h2>\n<table id=collectives><tr><th>task</th>"
           "<th>collective</th><th>stream</th><th>payload per call</th><th>calls per step</th>"
           "<th>what</th></tr>\n";
    for (const auto& [task, calls] : options.collectives) {
      for (const auto& c : calls) {
        out << "<tr><td>" << escape(task) << "</td><td>" << escape(c.kind) << "</td><td>"
            << escape(c.stream) << "</td><td class=num>" << format_bytes(c.bytes)
            << "</td><td class=num>" << c.count << "</td><td>" << escape(c.note) << "</td></tr>\n";
      }
    }
    out << "</table>\n";
  }
  out << "</body></html>\n";
  return out.str();
}

}  // namespace weft::plan
