#include "weft/core/error.hpp"

#include <gtest/gtest.h>

#include <string>

namespace {

TEST(Error, CarriesFileLineAndMessage) {
  try {
    WEFT_CHECK(1 + 1 == 3, "arithmetic is ", "broken: ", 42);
    FAIL() << "WEFT_CHECK did not throw";
  } catch (const weft::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tests/cpu/core/error_test.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("arithmetic is broken: 42"), std::string::npos) << what;
    EXPECT_EQ(e.message(), "arithmetic is broken: 42");
    EXPECT_STREQ(e.file(), "tests/cpu/core/error_test.cpp");
    EXPECT_GT(e.line(), 0u);
  }
}

TEST(Error, CheckEvaluatesConditionOnceAndMessageOnlyOnFailure) {
  int conditions = 0;
  int messages = 0;
  auto message = [&] {
    ++messages;
    return "m";
  };
  WEFT_CHECK(++conditions == 1, message());
  EXPECT_EQ(conditions, 1);
  EXPECT_EQ(messages, 0);
  EXPECT_THROW(WEFT_CHECK(++conditions == 1, message()), weft::Error);
  EXPECT_EQ(conditions, 2);
  EXPECT_EQ(messages, 1);
}

TEST(Error, CheckWithoutMessageNamesTheCondition) {
  try {
    WEFT_CHECK(2 < 1);
    FAIL() << "no throw";
  } catch (const weft::Error& e) {
    EXPECT_EQ(e.message(), "check failed: 2 < 1");
  }
}

TEST(Error, FailThrowsWithMessage) {
  EXPECT_THROW(WEFT_FAIL("unknown thread map '", "nope", "'"), weft::Error);
  try {
    WEFT_FAIL("value ", 7);
  } catch (const weft::Error& e) {
    EXPECT_EQ(e.message(), "value 7");
  }
}

TEST(Error, ShortFileNameDropsMachinePrefix) {
  EXPECT_STREQ(weft::detail::short_file_name("/home/x/weft/src/pipeline/engine.cpp"),
               "src/pipeline/engine.cpp");
  EXPECT_STREQ(weft::detail::short_file_name("/a/b/include/weft/core/error.hpp"),
               "include/weft/core/error.hpp");
  EXPECT_STREQ(weft::detail::short_file_name("plain.cpp"), "plain.cpp");
  EXPECT_STREQ(weft::detail::short_file_name("/x/y/z.cpp"), "z.cpp");
}

}  // namespace
