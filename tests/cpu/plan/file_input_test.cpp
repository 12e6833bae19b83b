// The planner's file readers (schedule, cost and trace files) on hostile or mistaken input: every
// problem is one short weft::Error naming the file and the JSON path, nothing crashes, nothing
// grows without bound, nothing is silently wrapped or reordered.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "../support/file_input.hpp"
#include "weft/pipeline/compiled_schedule.hpp"
#include "weft/plan/cost_model.hpp"
#include "weft/plan/schedule_file.hpp"
#include "weft/plan/trace_reader.hpp"

namespace {

using weft::pipeline::CompiledSchedule;
using weft::plan::CostModel;
using weft::plan::ScheduleFile;

using weft::testing::error_of;
using weft::testing::nested_arrays;
using weft::testing::TempFile;

TEST(FileInput, DeeplyNestedJsonIsRefusedWithAShortMessage) {
  const std::string deep = nested_arrays(70000);
  for (const auto& message :
       {error_of([&] { ScheduleFile::parse(deep); }), error_of([&] { CostModel::parse(deep); }),
        error_of([&] { weft::plan::parse_chrome_trace(deep, "x"); }),
        error_of([&] { ScheduleFile::parse(R"({"tasks": [{"name": "a", "reads": )" + deep + "}]}"); })}) {
    EXPECT_NE(message.find("nested deeper than"), std::string::npos) << message.substr(0, 200);
    EXPECT_LT(message.size(), 200u) << message.substr(0, 200);
  }
}

TEST(FileInput, AnEndlessFileIsRefused) {
  ASSERT_TRUE(std::filesystem::exists("/dev/zero"));
  for (const auto& message : {error_of([] { ScheduleFile::load("/dev/zero"); }),
                              error_of([] { CostModel::load("/dev/zero"); }),
                              error_of([] { weft::plan::read_chrome_trace("/dev/zero"); })}) {
    EXPECT_NE(message.find("/dev/zero: larger than"), std::string::npos) << message.substr(0, 200);
  }
}

TEST(FileInput, ErrorMessagesQuoteAShortExcerpt) {
  std::string long_array = "[";
  for (int i = 0; i < 10000; ++i) long_array += std::to_string(i) + ",";
  long_array += "0]";
  const std::string long_string = "\"" + std::string(5000, 'x') + "\"";
  for (const auto& message :
       {error_of([&] { ScheduleFile::parse(R"({"tasks": [{"name": "a", "lookahead": )" + long_array + "}]}"); }),
        error_of([&] { ScheduleFile::parse(R"({"tasks": [{"name": "a", "lookahead": )" + long_string + "}]}"); }),
        error_of([&] { CostModel::parse(R"({"tasks": {"a": )" + long_array + "}}"); }),
        error_of([&] { ScheduleFile::parse(long_array); })}) {
    EXPECT_NE(message.find("expected"), std::string::npos) << message.substr(0, 200);
    EXPECT_LT(message.size(), 200u) << message.substr(0, 200);
  }
}

TEST(FileInput, CostsBeyondTheSimulatedRangeAreRefused) {
  EXPECT_EQ(error_of([] { CostModel::parse(R"({"tasks": {"a": {"host_us": 1e308}}})"); }),
            "$.tasks.a.host_us: expected a cost <= 1e+09 us, got 1e+308");
  EXPECT_EQ(error_of([] { CostModel::parse(R"({"default_host_us": 2e9})"); }),
            "$.default_host_us: expected a cost <= 1e+09 us, got 2e+09");
  EXPECT_EQ(error_of([] { CostModel::parse(R"({"tasks": {"a": {"gpu": [{"stream": "s", "us": 1e300}]}}})"); }),
            "$.tasks.a.gpu[0].us: expected a cost <= 1e+09 us, got 1e+300");
  EXPECT_EQ(error_of([] { CostModel::parse(R"({"tasks": {"a": {"host_us": 1e9}}})"); }), "no error");
  // Just past the limit: the value as given, not rounded to the limit.
  EXPECT_EQ(error_of([] { CostModel::parse(R"({"tasks": {"a": {"host_us": 1000000001}}})"); }),
            "$.tasks.a.host_us: expected a cost <= 1e+09 us, got 1000000001");
  EXPECT_EQ(error_of([] { CostModel::parse(R"({"tasks": {"a": {"host_us": 1000000000.5}}})"); }),
            "$.tasks.a.host_us: expected a cost <= 1e+09 us, got 1000000000.5");
}

TEST(FileInput, IntegersBeyondIntRangeAreRefusedNotWrapped) {
  EXPECT_EQ(error_of([] { ScheduleFile::parse(R"({"tasks": [{"name": "a", "lookahead": 4294967297}]})"); }),
            "$.tasks[0].lookahead: expected an integer in [-2147483648, 2147483647], got 4294967297");
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a", "cross_iter_depends_on":
                                      [{"producer": "a", "offset": -4294967297}]}]})");
            }),
            "$.tasks[0].cross_iter_depends_on[0].offset: expected an integer in [-2147483648, "
            "2147483647], got -4294967297");
  EXPECT_EQ(error_of([] { ScheduleFile::parse(R"({"streams": [{"name": "s", "priority": 18446744073709551615}], "tasks": [{"name": "a"}]})"); }),
            "$.streams[0].priority: expected an integer in [-2147483648, 2147483647], got "
            "18446744073709551615");
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a", "collective": [{"kind": "AllReduce", "bytes": 18446744073709551615}]}]})");
            }),
            "no error");
}

TEST(FileInput, GpuSegmentOnAnUndeclaredStreamIsAnError) {
  const CompiledSchedule compiled(
      ScheduleFile::parse(R"({"streams": ["memcpy"], "tasks": [{"name": "a", "stream": "memcpy"}]})")
          .schedule);
  const auto costs = CostModel::parse(
      R"({"tasks": {"a": {"gpu": [{"stream": "memcpy", "us": 1}, {"stream": "mempcy", "us": 2}]}}})");
  EXPECT_EQ(error_of([&] { costs.check_against(compiled); }),
            "$.tasks.a.gpu[1].stream: the schedule has no stream 'mempcy'");
  // "default" always exists.
  EXPECT_EQ(error_of([&] {
              CostModel::parse(R"({"tasks": {"a": {"gpu": [{"stream": "default", "us": 1}]}}})")
                  .check_against(compiled);
            }),
            "no error");
  // The same inside a schedule file: the path is rooted at $.costs.
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a"}],
                "costs": {"tasks": {"a": {"gpu": [{"stream": "comm", "us": 1}]}}}})");
            }),
            "$.costs.tasks.a.gpu[0].stream: the schedule has no stream 'comm'");
}

TEST(FileInput, ScheduleRuleErrorsNameTheFileAndTheJsonPath) {
  const TempFile stream_file("bad-stream.json",
                             R"({"tasks": [{"name": "a"}, {"name": "b", "stream": "nope"}]})");
  const std::string stream_error = error_of([&] { ScheduleFile::load(stream_file.path()); });
  EXPECT_EQ(stream_error.rfind(stream_file.path() + ": $.tasks[1].stream: ", 0), 0u)
      << stream_error;
  EXPECT_NE(stream_error.find("'nope' which is not declared"), std::string::npos) << stream_error;

  const TempFile edge_file("bad-edge.json",
                           R"({"tasks": [{"name": "a"}, {"name": "b", "depends_on": ["ghost"]}]})");
  const std::string edge_error = error_of([&] { ScheduleFile::load(edge_file.path()); });
  EXPECT_EQ(edge_error.rfind(edge_file.path() + ": $.tasks[1].depends_on: ", 0), 0u) << edge_error;

  const TempFile cycle_file("cycle.json", R"({"tasks": [
      {"name": "a", "depends_on": ["b"]}, {"name": "b", "depends_on": ["a"]}]})");
  const std::string cycle_error = error_of([&] { ScheduleFile::load(cycle_file.path()); });
  EXPECT_EQ(cycle_error.rfind(cycle_file.path() + ": $.tasks: ", 0), 0u) << cycle_error;
  EXPECT_NE(cycle_error.find("cycle"), std::string::npos) << cycle_error;

  const TempFile twice_file("twice.json", R"({"streams": ["s", "s"], "tasks": [{"name": "a"}]})");
  const std::string twice_error = error_of([&] { ScheduleFile::load(twice_file.path()); });
  EXPECT_EQ(twice_error.rfind(twice_file.path() + ": $.streams: ", 0), 0u) << twice_error;
}

// The path comes from the task and field the schedule's error carries, whatever its message says.
TEST(FileInput, ScheduleRuleErrorsPointAtTheField) {
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a", "writes": ["x"]},
                                                 {"name": "b", "reads": ["y"]}]})");
            }).rfind("$.tasks[1].reads: ", 0),
            0u);
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a", "writes": ["x"]},
                                                 {"name": "b", "writes": ["x"]}]})");
            }).rfind("$.tasks[1].writes: ", 0),
            0u);
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a"}, {"name": "a"}]})");
            }).rfind("$.tasks[1].name: ", 0),
            0u);
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a", "collective":
                                       [{"kind": "AllReduce", "stream": "comm"}]}]})");
            }).rfind("$.tasks[0].collective: ", 0),
            0u);
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"inputs": ["x", "x"], "tasks": [{"name": "a"}]})");
            }).rfind("$.inputs: ", 0),
            0u);
  // The lookahead and cross_iter offset rules are the Task's own, the same as everywhere else.
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a", "cross_iter_depends_on":
                                                  [{"producer": "a", "offset": 0}]}]})");
            }).rfind("$.tasks[0].cross_iter_depends_on[0].offset: schedule: task 'a' has "
                     "cross_iter_depends_on 'a' with offset 0", 0),
            0u);
  EXPECT_EQ(error_of([] { ScheduleFile::parse(R"({"tasks": [{"name": "a", "lookahead": -1}]})"); }),
            "$.tasks[0].lookahead: schedule: task 'a' has lookahead -1 (rule: 0 <= lookahead <= "
            "1000)");
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(R"({"tasks": [{"name": "a", "lookahead": 1001}]})");
            }).rfind("$.tasks[0].lookahead: ", 0),
            0u);
  EXPECT_EQ(
      error_of([] { ScheduleFile::parse(R"({"tasks": [{"name": "a", "lookahead": 1000}]})"); }),
      "no error");
  // Array walks name the element and what was expected.
  EXPECT_EQ(error_of([] {
              ScheduleFile::parse(
                  R"({"tasks": [{"name": "a", "cross_iter_depends_on": [{"producer": "a"}]}]})");
            }),
            "$.tasks[0].cross_iter_depends_on[0].offset: missing");
  EXPECT_EQ(
      error_of([] { ScheduleFile::parse(R"({"streams": {"s": 1}, "tasks": [{"name": "a"}]})"); }),
      "$.streams: expected an array of streams, got an object of 1 keys");
  EXPECT_EQ(error_of([] { CostModel::parse(R"({"tasks": {"a": {"gpu": [{"us": 1}]}}})"); }),
            "$.tasks.a.gpu[0].stream: missing");
  EXPECT_EQ(
      error_of([] { CostModel::parse(R"({"tasks": {"a": {"gpu": [{"stream": "", "us": 1}]}}})"); }),
      "$.tasks.a.gpu[0].stream: expected a stream name, got \"\"");
}

TEST(FileInput, ThreadMapGroupOrderIsKept) {
  const auto file = ScheduleFile::parse(R"({
    "tasks": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    "thread_maps": [{"groups": {"zeta": ["a"], "alpha": ["b"]}, "rest": "middle"}]
  })");
  const CompiledSchedule compiled(file.schedule);
  const auto threads = file.thread_maps.at(0).assign(compiled);
  EXPECT_EQ(threads.thread_names, (std::vector<std::string>{"zeta", "alpha", "middle"}));
}

}  // namespace

// The lines of `file` from the first that starts with `first` after `heading` to the next that
// starts with `last` (both included when `inclusive`), each without its `strip` prefix.
std::string example_in(const std::string& file, const std::string& heading, const std::string& first,
                       const std::string& last, const std::string& strip, bool inclusive) {
  std::ifstream in(std::string(WEFT_SOURCE_DIR) + "/" + file);
  std::string line, text;
  bool after_heading = heading.empty(), inside = false;
  auto keep = [&] { text += (line.rfind(strip, 0) == 0 ? line.substr(strip.size()) : line) + "\n"; };
  while (std::getline(in, line)) {
    if (!after_heading) {
      after_heading = line.rfind(heading, 0) == 0;
    } else if (!inside) {
      inside = line.rfind(first, 0) == 0;
      if (inside && inclusive) keep();
    } else if (line.rfind(last, 0) == 0) {
      if (inclusive) keep();
      break;
    } else {
      keep();
    }
  }
  return text;
}

TEST(FileInput, TheDocumentedScheduleExamplesAreAccepted) {
  // include/weft/plan/schedule_file.hpp: the comment block from "//   {" to "//   }".
  const std::string header =
      example_in("include/weft/plan/schedule_file.hpp", "", "//   {", "//   }", "//   ", true);
  const std::string planner =
      example_in("docs/planner.md", "## Schedule files", "```json", "```", "", false);
  for (const auto& text : {header, planner}) {
    ASSERT_GT(text.size(), 100u) << text;
    const std::string error = error_of([&] {
      const auto file = ScheduleFile::parse(text);
      const CompiledSchedule compiled(file.schedule);
      for (const auto& map : file.thread_maps) map.assign(compiled);
    });
    EXPECT_EQ(error, "no error") << text;
  }
}
