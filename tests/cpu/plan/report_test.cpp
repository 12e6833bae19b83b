#include "weft/plan/report.hpp"

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <string>
#include <vector>

namespace {

using weft::plan::HostSpan;
using weft::plan::VariantReport;
using weft::plan::WaitEdge;
using weft::plan::WaitRule;

VariantReport crowded_variant(const std::string& name) {
  VariantReport v;
  v.name = name;
  v.cascade = "custom";
  v.thread_map = "a / b (2)";
  v.source = "simulated";
  v.timeline.threads = {"a", "b"};
  v.timeline.streams = {"default"};
  // Many tasks far too short for their labels: all labels must go to lanes above the row.
  for (int i = 0; i < 12; ++i) {
    const std::string task = "task_with_a_long_name_" + std::to_string(i);
    v.placement.push_back({task, "default", i % 2 ? "b" : "a", i % 3, i == 4});
    v.timeline.host.push_back({task, i % 2 ? "b" : "a", 10.0 * i, 10.0 * i + 2, i, -1});
    v.timeline.gpu.push_back({task, "default", 10.0 * i + 2, 10.0 * i + 5});
  }
  v.timeline.waits.push_back({"task_with_a_long_name_0", "task_with_a_long_name_1", "a", "b",
                              WaitRule::kSameLookahead, 2, 8});
  v.timeline.host_step_us = 112;
  v.timeline.step_us = 115;
  return v;
}

std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

TEST(Report, EveryVariantHasGanttAndTopology) {
  const std::string html = weft::plan::render_html(
      {crowded_variant("one"), crowded_variant("two"), crowded_variant("three")}, {});
  EXPECT_EQ(count(html, "<svg class=gantt"), 3u);
  EXPECT_EQ(count(html, "<svg class=topology"), 3u);
  EXPECT_NE(html.find("id='one'"), std::string::npos);
  EXPECT_NE(html.find("task_with_a_long_name_4@1 (collective)"), std::string::npos);
  // The lookahead-rule wait is drawn red with an arrow.
  EXPECT_EQ(count(html, "marker-end='url(#arrow-one)'"), 1u);
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));  // nothing external
  EXPECT_EQ(html.find("<script"), std::string::npos);
}

TEST(Report, LabelsOutsideBarsNeverOverlap) {
  const std::string html = weft::plan::render_html({crowded_variant("v")}, {});
  // Labels placed above a row are preceded by their leader line; collect (y, x, text).
  const std::regex label(
      R"(<line x1='[0-9.]+' y1='[0-9.]+' x2='[0-9.]+' y2='[0-9.]+' stroke='#999'/><text x='([0-9.]+)' y='([0-9.]+)' fill='#222'>([^<]+)</text>)");
  std::map<std::string, std::vector<std::pair<double, double>>> by_y;
  std::size_t num_labels = 0;
  for (auto it = std::sregex_iterator(html.begin(), html.end(), label); it != std::sregex_iterator();
       ++it) {
    const double x = std::stod((*it)[1]);
    const double width = 6.3 * double((*it)[3].length());
    by_y[(*it)[2]].push_back({x, x + width});
    ++num_labels;
  }
  EXPECT_EQ(num_labels, 24u);  // 12 host + 12 GPU labels, none fits its bar
  for (auto& [y, extents] : by_y) {
    std::sort(extents.begin(), extents.end());
    for (std::size_t i = 1; i < extents.size(); ++i) {
      EXPECT_LE(extents[i - 1].second, extents[i].first + 1e-6) << "overlap at y=" << y;
    }
  }
}

TEST(Report, EscapesNamesAndDrawsCollectiveInventory) {
  auto v = crowded_variant("x<y");
  v.placement[0].task = "a&b";
  weft::plan::ReportOptions options;
  options.collectives["start_shuffle"] = {{"AllGather", "memcpy", 2048, 1, "workloads"}};
  const std::string html = weft::plan::render_html({v}, options);
  EXPECT_NE(html.find("x&lt;y"), std::string::npos);
  EXPECT_NE(html.find("a&amp;b"), std::string::npos);
  EXPECT_EQ(html.find("x<y"), std::string::npos);
  EXPECT_NE(html.find("<table id=collectives>"), std::string::npos);
  EXPECT_NE(html.find("2.0 KB"), std::string::npos);
}

TEST(Report, ThreadLoadsCountBusyTimeAndIdleGapsOnce) {
  auto v = crowded_variant("v");
  // Thread a runs tasks 0, 2, ..., 10 at 0, 20, ..., 100 for 2 us each: gaps 5 x 18 us.
  // Thread b runs tasks 1, 3, ..., 11 at 10, 30, ..., 110: a first gap of 10 us, then 5 x 18.
  const auto loads = weft::plan::thread_loads(v.timeline);
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0].thread, "a");
  EXPECT_DOUBLE_EQ(loads[0].busy_us, 12.0);
  EXPECT_DOUBLE_EQ(loads[0].wait_us, 90.0);
  EXPECT_DOUBLE_EQ(loads[1].busy_us, 12.0);
  EXPECT_DOUBLE_EQ(loads[1].wait_us, 100.0);
  // Two producers waited for at once are one wait, not two.
  v.timeline.waits.push_back({"p", "c", "a", "b", WaitRule::kSyncCpu, 0, 100});
  EXPECT_DOUBLE_EQ(weft::plan::thread_loads(v.timeline)[1].wait_us, 100.0);
}

// The variants table counts the same waits the variant's own list shows, and how many of them
// follow the schedule's lookahead rules.
TEST(Report, VariantsTableCountsTheWaitsTheDetailsList) {
  VariantReport v = crowded_variant("one");
  v.timeline.waits.push_back({"task_with_a_long_name_2", "task_with_a_long_name_3", "a", "b",
                              WaitRule::kTicket, 22, 1});
  v.timeline.waits.push_back({"task_with_a_long_name_4", "task_with_a_long_name_5", "a", "b",
                              WaitRule::kStreamOrder, 42, 1});
  const std::string html = weft::plan::render_html({v}, {});
  const auto table = html.substr(html.find("<table id=variants>"));
  const std::string row = table.substr(table.find("<tr><td>"), table.find("</tr>", table.find("<tr><td>")) - table.find("<tr><td>"));
  EXPECT_NE(html.find("<summary>3 cross-thread waits</summary>"), std::string::npos);
  EXPECT_NE(row.find("<td class=num>3</td><td class=num>1</td>"), std::string::npos) << row;
  EXPECT_NE(table.find("<th>cross-thread waits</th><th>of them lookahead rules</th>"),
            std::string::npos);
}
}  // namespace
