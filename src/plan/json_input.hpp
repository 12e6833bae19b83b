// Helpers shared by the planner's JSON readers (private to src/plan). Every error they raise is a
// weft::Error whose message starts with the JSON path of the offending value ("$.tasks[0].name").
#pragma once

#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>

#include "weft/core/error.hpp"

namespace weft::plan::detail {

inline nlohmann::json parse_json(std::string_view text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    WEFT_FAIL("$: not valid JSON: ", e.what());
  }
}

inline void only_keys(const nlohmann::json& object, const std::string& path,
                      std::initializer_list<std::string_view> allowed) {
  WEFT_CHECK(object.is_object(), path, ": expected an object, got ", object.dump());
  for (const auto& [key, _] : object.items()) {
    bool known = false;
    for (auto a : allowed) known = known || key == a;
    WEFT_CHECK(known, path, ".", key, ": unknown key");
  }
}

// Reads `path` and parses it with `parse`; errors are prefixed with the file's path.
template <typename Parse>
auto load_json_file(const std::string& path, const char* what, Parse&& parse) {
  std::ifstream in(path);
  WEFT_CHECK(in.good(), "cannot read ", what, " '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return parse(text.str());
  } catch (const Error& e) {
    WEFT_FAIL(path, ": ", e.message());
  }
}

}  // namespace weft::plan::detail
