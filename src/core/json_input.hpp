// Helpers shared by weft's JSON readers (schedule configs, schedule, cost and trace files; private
// to weft_core's sources). Every error they raise is a weft::Error whose message starts with the
// JSON path of the offending value ("$.tasks[0].name") and quotes at most a short excerpt of it.
//
// Limits: a file is read up to its kind's byte limit (an endless file such as /dev/zero is an
// error, not an ever-growing buffer); a document nested deeper than kMaxNestingDepth is refused
// while it is parsed. Objects keep the order of their keys as written (thread-map groups do).
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weft/core/error.hpp"

namespace weft::json_input {

using Json = nlohmann::ordered_json;

// Deeper than anything weft's formats need (they nest five levels at most).
constexpr int kMaxNestingDepth = 64;
constexpr std::size_t kMaxExcerptChars = 40;

// `text` for an error message: at most kMaxExcerptChars of it, "..." marking a cut.
inline std::string short_text(std::string_view text) {
  if (text.size() <= kMaxExcerptChars) return std::string(text);
  return std::string(text.substr(0, kMaxExcerptChars)) + "...";
}

// A short description of `value` for an error message: scalars as written (long strings cut),
// arrays and objects by their size.
inline std::string excerpt(const Json& value) {
  if (value.is_array()) return "an array of " + std::to_string(value.size()) + " values";
  if (value.is_object()) return "an object of " + std::to_string(value.size()) + " keys";
  return short_text(value.dump());
}

// The path of the member `key` of the object at `path`, a long key cut.
inline std::string member_path(const std::string& path, std::string_view key) {
  return path + "." + short_text(key);
}

// Refuses text nested deeper than kMaxNestingDepth, in one pass before it is parsed (brackets
// inside strings skipped). Not a parser callback: nlohmann's callback parser looks through the
// enclosing array at the end of each object, which makes a long array quadratic to read.
inline void check_nesting_depth(std::string_view text) {
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (depth >= kMaxNestingDepth) {
        WEFT_FAIL("$: nested deeper than ", kMaxNestingDepth, " levels");
      }
      ++depth;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

// Parses text of any size in time linear in its length.
inline Json parse_json(std::string_view text) {
  check_nesting_depth(text);
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    std::string what = e.what();
    if (what.size() > 4 * kMaxExcerptChars) what = what.substr(0, 4 * kMaxExcerptChars) + "...";
    WEFT_FAIL("$: not valid JSON: ", what);
  }
}

inline void only_keys(const Json& object, const std::string& path,
                      std::initializer_list<std::string_view> allowed) {
  WEFT_CHECK(object.is_object(), path, ": expected an object, got ", excerpt(object));
  for (const auto& [key, _] : object.items()) {
    bool known = false;
    for (auto a : allowed) known = known || key == a;
    WEFT_CHECK(known, member_path(path, key), ": unknown key");
  }
}

// The path of element `index` of the array at `path`.
inline std::string element_path(const std::string& path, std::size_t index) {
  return path + "[" + std::to_string(index) + "]";
}

// Calls visit(element, its path) for each element of the array `value` at `path`, in order; a
// value that is no array is an error "expected an array of <what>".
template <typename Visit>
void for_each_element(const Json& value, const std::string& path, std::string_view what,
                      Visit&& visit) {
  WEFT_CHECK(value.is_array(), path, ": expected an array of ", what, ", got ", excerpt(value));
  for (std::size_t i = 0; i < value.size(); ++i) visit(value[i], element_path(path, i));
}

// The member `key` of the object at `path`; a missing one is an error "<path>.<key>: missing".
inline const Json& required_member(const Json& object, const std::string& path,
                                   std::string_view key) {
  const auto it = object.find(std::string(key));
  WEFT_CHECK(it != object.end(), member_path(path, key), ": missing");
  return *it;
}

// A non-empty string (a name of a task, stream, slot or thread); `what` says which in the error.
inline std::string name_at(const Json& value, const std::string& path,
                           std::string_view what = "a non-empty string") {
  WEFT_CHECK(value.is_string() && !value.get_ref<const std::string&>().empty(), path, ": expected ",
             what, ", got ", excerpt(value));
  return value.get<std::string>();
}

// A list of names; `what` names one element in the error for a non-array.
inline std::vector<std::string> names_at(const Json& value, const std::string& path,
                                         std::string_view what = "names") {
  std::vector<std::string> names;
  for_each_element(value, path, what, [&](const Json& element, const std::string& element_path) {
    names.push_back(name_at(element, element_path));
  });
  return names;
}

inline std::string string_at(const Json& value, const std::string& path) {
  WEFT_CHECK(value.is_string(), path, ": expected a string, got ", excerpt(value));
  return value.get<std::string>();
}

inline bool bool_at(const Json& value, const std::string& path) {
  WEFT_CHECK(value.is_boolean(), path, ": expected true or false, got ", excerpt(value));
  return value.get<bool>();
}

inline double number_at(const Json& value, const std::string& path) {
  WEFT_CHECK(value.is_number(), path, ": expected a number, got ", excerpt(value));
  return value.get<double>();
}

// An integer in [min, max] (within Int's range); values outside it are errors, never wrapped.
template <typename Int>
Int integer_in(const Json& value, const std::string& path, Int min, Int max) {
  WEFT_CHECK(value.is_number_integer(), path, ": expected an integer, got ", excerpt(value));
  const auto within = [&](auto v) {
    return std::cmp_greater_equal(v, min) && std::cmp_less_equal(v, max);
  };
  const bool in_range = value.is_number_unsigned() ? within(value.get<std::uint64_t>())
                                                   : within(value.get<std::int64_t>());
  WEFT_CHECK(in_range, path, ": expected an integer in [", std::int64_t(min), ", ", max, "], got ",
             excerpt(value));
  return value.get<Int>();
}

// Any value of Int.
template <typename Int>
Int integer_at(const Json& value, const std::string& path) {
  return integer_in(value, path, std::numeric_limits<Int>::min(), std::numeric_limits<Int>::max());
}

inline int int_at(const Json& value, const std::string& path) {
  return integer_at<int>(value, path);
}

// Reads `path` whole, refusing files longer than max_bytes; errors name the file.
inline std::string read_text_file(const std::string& path, const char* what,
                                  std::size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in.good(), "cannot read ", what, " '", path, "'");
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, std::size_t(in.gcount()));
    WEFT_CHECK(text.size() <= max_bytes, path, ": larger than ", max_bytes >> 20,
               " MiB, too large for a ", what);
  }
  WEFT_CHECK(!in.bad(), "reading ", what, " '", path, "' failed");
  return text;
}

// Reads `path` (at most max_bytes) and parses it with `parse`; errors are prefixed with the path.
template <typename Parse>
auto load_json_file(const std::string& path, const char* what, std::size_t max_bytes,
                    Parse&& parse) {
  const std::string text = read_text_file(path, what, max_bytes);
  try {
    return parse(text);
  } catch (const Error& e) {
    WEFT_FAIL(path, ": ", e.message());
  }
}

}  // namespace weft::json_input
