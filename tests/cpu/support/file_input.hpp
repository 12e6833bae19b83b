// Helpers for the tests of weft's file readers (schedule configs, schedule, cost and trace files).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "weft/core/error.hpp"

namespace weft::testing {

// The message of the weft::Error `run` throws, or "no error".
template <typename Run>
std::string error_of(Run&& run) {
  try {
    run();
  } catch (const weft::Error& e) {
    return e.message();
  }
  return "no error";
}

// A file in the temporary folder holding `content`, removed when the object goes.
class TempFile {
 public:
  TempFile(const std::string& name, const std::string& content)
      : path_(std::filesystem::temp_directory_path() /
              ("weft-file-input-" + std::to_string(::getpid()) + "-" + name)) {
    std::ofstream(path_) << content;
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() { std::filesystem::remove(path_); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// `depth` arrays, each inside the one before: "[[[...]]]".
inline std::string nested_arrays(int depth) {
  return std::string(std::size_t(depth), '[') + std::string(std::size_t(depth), ']');
}

}  // namespace weft::testing
