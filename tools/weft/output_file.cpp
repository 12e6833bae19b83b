#include "output_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "weft/core/error.hpp"

namespace weft::tools {
namespace {

namespace fs = std::filesystem;

const char* kind_name(fs::file_type type) {
  switch (type) {
    case fs::file_type::directory: return "a folder";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    default: return "not a file";
  }
}

// Writes all of `content` to `fd`; false (errno set) on failure.
bool write_all(int fd, std::string_view content) {
  while (!content.empty()) {
    const ssize_t n = ::write(fd, content.data(), content.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    content.remove_prefix(std::size_t(n));
  }
  return true;
}

}  // namespace

OutputFile::OutputFile(std::string path) : path_(std::move(path)) {
  WEFT_CHECK(!path_.empty(), "an output path is empty");
  std::error_code ec;
  const fs::file_status status = fs::status(path_, ec);
  if (fs::is_character_file(status) || fs::is_fifo(status)) {
    // Opened by its own name: /dev/stdout on a pipe resolves to no path.
    stream_ = true;
    target_ = path_;
  } else if (fs::exists(status)) {
    WEFT_CHECK(fs::is_regular_file(status), "'", path_,
               "' is not a regular file, a character device or a FIFO (it is ",
               kind_name(status.type()), "); refusing to replace it");
    target_ = fs::canonical(path_, ec).string();
    WEFT_CHECK(!ec, "cannot resolve '", path_, "': ", ec.message());
  } else {
    // Absolute first: a bare name's weakly_canonical form has no folder to check.
    target_ = fs::weakly_canonical(fs::absolute(path_, ec), ec).string();
    WEFT_CHECK(!ec, "cannot resolve '", path_, "': ", ec.message());
    const fs::path folder = fs::path(target_).parent_path();
    WEFT_CHECK(fs::is_directory(folder, ec), "cannot write '", path_, "': no folder '",
               folder.string(), "'");
  }
}

OutputFile::~OutputFile() {
  if (!temporary_.empty()) ::unlink(temporary_.c_str());
}

void OutputFile::stage(std::string_view content) {
  WEFT_CHECK(temporary_.empty() && content_.empty(), "'", path_, "' staged twice");
  if (stream_) {
    content_ = content;
    return;
  }
  // A fresh name beside the target: O_EXCL | O_NOFOLLOW never opens what is already there.
  int fd = -1;
  std::string name;
  for (int attempt = 0; fd < 0; ++attempt) {
    name = target_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(attempt);
    fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    WEFT_CHECK(fd >= 0 || (errno == EEXIST && attempt < 100), "cannot write '", name, "': ",
               std::strerror(errno));
  }
  temporary_ = name;
  const bool written = write_all(fd, content);
  const int write_errno = errno;
  const bool closed = ::close(fd) == 0;
  WEFT_CHECK(written && closed, "writing '", name, "' failed: ",
             std::strerror(written ? errno : write_errno));
}

void OutputFile::commit() {
  if (stream_) {
    const int fd = ::open(target_.c_str(), O_WRONLY | O_CLOEXEC);
    WEFT_CHECK(fd >= 0, "cannot write '", path_, "': ", std::strerror(errno));
    const bool written = write_all(fd, content_);
    const int write_errno = errno;
    ::close(fd);
    WEFT_CHECK(written, "writing '", path_, "' failed: ", std::strerror(write_errno));
    return;
  }
  WEFT_CHECK(!temporary_.empty(), "'", path_, "' committed before it was staged");
  WEFT_CHECK(::rename(temporary_.c_str(), target_.c_str()) == 0, "cannot move the output to '",
             path_, "': ", std::strerror(errno));
  temporary_.clear();
}

}  // namespace weft::tools
