// weft::pipeline::ScheduleConfig on hostile or mistaken input: every problem is one short
// weft::Error naming the file (for a loaded config) and the JSON path; nothing crashes, nothing
// grows without bound, no integer is wrapped.
#include <gtest/gtest.h>

#include <string>

#include "../support/file_input.hpp"
#include "weft/hstu/schedule.hpp"
#include "weft/pipeline/schedule_config.hpp"

namespace weft::pipeline {
namespace {

using weft::testing::error_of;
using weft::testing::nested_arrays;
using weft::testing::TempFile;

std::string parse_error(const std::string& text) {
  return error_of([&] { ScheduleConfig::parse(text); });
}

TEST(ScheduleConfigInput, DeeplyNestedJsonIsRefusedWithAShortMessage) {
  const std::string deep = nested_arrays(70000);
  for (const std::string& text : {deep, R"({"lookahead": {"h2d": )" + deep + "}}",
                                  R"({"thread_map": {"groups": {"io": )" + deep + "}}}",
                                  R"({"same_progress_sync": [{"producer": )" + deep + "}]}"}) {
    const std::string message = parse_error(text);
    EXPECT_EQ(message, "$: nested deeper than 64 levels") << message.substr(0, 200);
  }
}

TEST(ScheduleConfigInput, AnEndlessFileIsRefused) {
  const std::string message = error_of([] { ScheduleConfig::load("/dev/zero"); });
  EXPECT_EQ(message.rfind("/dev/zero: larger than", 0), 0u) << message.substr(0, 200);
}

TEST(ScheduleConfigInput, ErrorMessagesQuoteAShortExcerpt) {
  std::string long_array = "[";
  for (int i = 0; i < 10000; ++i) long_array += std::to_string(i) + ",";
  long_array += "0]";
  const std::string long_string = "\"" + std::string(5000, 'x') + "\"";
  const std::string texts[] = {
      R"({"lookahead": {"h2d": )" + long_array + "}}",
      R"({"lookahead": {"h2d": )" + long_string + "}}",
      R"({"lookahead": {)" + long_string + ": -1}}",
      "{" + long_string + ": 1}",
      R"({"thread_map": )" + long_array + "}",
      R"({"thread_map": {"groups": {)" + long_string + ": 3}}}",
      R"({"thread_map": {"groups": {"io": [)" + long_array + "]}}}",
      R"({"same_progress_sync": [{"producer": )" + long_array + R"(, "consumer": "a"}]})",
      R"({"same_progress_sync": [{"producer": "a", "consumer": "b", "side": )" + long_string +
          "}]}",
  };
  for (const std::string& text : texts) {
    const std::string message = parse_error(text);
    EXPECT_NE(message, "no error");
    EXPECT_LT(message.size(), 200u) << message.substr(0, 400);
  }
  // A task the schedule lacks, named by a long key.
  Schedule s = hstu::hstu_schedule();
  const std::string message = error_of(
      [&] { ScheduleConfig::parse(R"({"lookahead": {)" + long_string + ": 1}}").apply(s); });
  EXPECT_NE(message.find("the schedule has no task"), std::string::npos) << message.substr(0, 400);
  EXPECT_LT(message.size(), 200u) << message.substr(0, 400);
}

TEST(ScheduleConfigInput, LookaheadsOutsideTheirRangeAreRefusedNotWrapped) {
  for (const char* value : {"4294967297", "18446744073709551615", "-4294967297", "-1", "1001",
                            "1000000"}) {
    EXPECT_EQ(parse_error(std::string(R"({"lookahead": {"h2d": )") + value + "}}"),
              std::string("$.lookahead.h2d: expected an integer in [0, 1000], got ") + value);
  }
  EXPECT_EQ(parse_error(R"({"lookahead": {"h2d": 5.0}})"),
            "$.lookahead.h2d: expected an integer, got 5.0");
  // The limit is the engine's, one for every way a lookahead is set.
  EXPECT_EQ(ScheduleConfig::parse(R"({"lookahead": {"h2d": 1000}})").lookahead.at("h2d"),
            kMaxLookahead);
}

TEST(ScheduleConfigInput, ErrorsNameTheFileAndTheJsonPath) {
  const TempFile bad_type("config-type.json", R"({"lookahead": {"h2d": "5"}})");
  EXPECT_EQ(error_of([&] { ScheduleConfig::load(bad_type.path()); }),
            bad_type.path() + R"(: $.lookahead.h2d: expected an integer, got "5")");

  const TempFile bad_json("config-json.json", R"({"lookahead": )");
  EXPECT_EQ(error_of([&] {
              ScheduleConfig::load(bad_json.path());
            }).rfind(bad_json.path() + ": $: not valid JSON: ", 0),
            0u);

  EXPECT_EQ(error_of([] { ScheduleConfig::load("/nonexistent/config.json"); }),
            "cannot read schedule config '/nonexistent/config.json'");

  // Rule errors found when a loaded config is applied name its file too.
  const TempFile ghost("config-ghost.json", R"({"lookahead": {"ghost": 1}})");
  const ScheduleConfig loaded = ScheduleConfig::load(ghost.path());
  Schedule s = hstu::hstu_schedule();
  EXPECT_EQ(error_of([&] { loaded.apply(s); }),
            ghost.path() + ": $.lookahead.ghost: the schedule has no task 'ghost'");
  const TempFile edge("config-edge.json",
                      R"({"same_progress_sync": [{"producer": "x", "consumer": "forward"}]})");
  EXPECT_EQ(error_of([&] { ScheduleConfig::load(edge.path()).apply(s); }),
            edge.path() + ": $.same_progress_sync[0].producer: the schedule has no task 'x'");
  // Where a config was read from is not part of what it configures.
  EXPECT_EQ(loaded, ScheduleConfig::parse(R"({"lookahead": {"ghost": 1}})"));
}

}  // namespace
}  // namespace weft::pipeline
