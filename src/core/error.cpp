#include "weft/core/error.hpp"

#include <array>
#include <cstring>
#include <string_view>

namespace weft {
namespace detail {

const char* short_file_name(const char* path) noexcept {
  if (path == nullptr) return "";
  // The last top-level folder of weft's tree found in the path marks where the project starts.
  static constexpr std::array<std::string_view, 6> kRoots = {"/src/",   "/include/", "/tests/",
                                                              "/tools/", "/bench/",   "/examples/"};
  const std::string_view full(path);
  std::size_t best = std::string_view::npos;
  for (auto root : kRoots) {
    const auto pos = full.rfind(root);
    if (pos != std::string_view::npos && (best == std::string_view::npos || pos > best)) best = pos;
  }
  if (best != std::string_view::npos) return path + best + 1;
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

void throw_check_failure(const char* condition, const std::string& message,
                         std::source_location where) {
  // A message written for the user says what went wrong; the bare condition is only the fallback.
  throw Error(message.empty() ? std::string("check failed: ") + condition : message, where);
}

}  // namespace detail

Error::Error(const std::string& message, std::source_location where)
    : std::runtime_error(std::string(detail::short_file_name(where.file_name())) + ":" +
                         std::to_string(where.line()) + ": " + message),
      message_(message),
      file_(detail::short_file_name(where.file_name())),
      line_(where.line()) {}

}  // namespace weft
