// weft::Error and the check macros every part of weft uses.
//
// Contract: every error weft reports is a weft::Error (or a subclass) whose what() reads
// "file:line: message", where file:line is the place in weft's sources that detected it. A check
// without a message reports "check failed: <condition>".
// The check macros evaluate each argument at most once, and build the message only on failure.
//
//   WEFT_CHECK(num_tokens <= max_tokens, "num_tokens ", num_tokens, " exceeds ", max_tokens);
//   WEFT_FAIL("unknown thread map '", name, "'");
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace weft {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message,
                 std::source_location where = std::source_location::current());

  // The message without the location prefix.
  const std::string& message() const noexcept { return message_; }
  // The source file (relative to weft's source tree where recognisable) and line that threw.
  const char* file() const noexcept { return file_; }
  unsigned line() const noexcept { return line_; }

 private:
  std::string message_;
  const char* file_;
  unsigned line_;
};

namespace detail {

// Concatenates anything streamable; no arguments gives an empty string.
template <typename... Args>
std::string concat(Args&&... args) {
  if constexpr (sizeof...(Args) == 0) {
    return {};
  } else {
    std::ostringstream out;
    (out << ... << std::forward<Args>(args));
    return out.str();
  }
}

// Strips the machine-specific prefix of a __FILE__ path, keeping e.g. "src/pipeline/engine.cpp".
const char* short_file_name(const char* path) noexcept;

[[noreturn]] void throw_check_failure(const char* condition, const std::string& message,
                                      std::source_location where);

}  // namespace detail
}  // namespace weft

#define WEFT_CHECK(condition, ...)                                                            \
  do {                                                                                        \
    if (!(condition)) [[unlikely]] {                                                          \
      ::weft::detail::throw_check_failure(#condition, ::weft::detail::concat(__VA_ARGS__),    \
                                          std::source_location::current());                   \
    }                                                                                         \
  } while (0)

#define WEFT_FAIL(...) throw ::weft::Error(::weft::detail::concat(__VA_ARGS__))
