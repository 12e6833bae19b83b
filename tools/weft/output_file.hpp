// weft::tools::OutputFile: a file a command writes (`weft plan -o PATH --json PATH`).
//
// What PATH is decides how it is written (symbolic links followed):
//  - a regular file, or nothing yet: stage() writes a new temporary file beside it (created
//    exclusively, never through a link), commit() renames it over PATH; a run that fails before
//    commit() leaves PATH as it was and no temporary behind;
//  - a character device or a FIFO (/dev/null, a terminal, a pipe, /dev/stdout on one of them):
//    commit() writes the content to it; the device or FIFO stays what it was;
//  - anything else (a folder, a block device, a socket), or a new file in a folder that does not
//    exist: the constructor throws weft::Error, before anything is written.
//
//   OutputFile html(html_path), json(json_path);   // both checked before any work
//   html.stage(render()); json.stage(dump());      // both written aside
//   html.commit(); json.commit();                  // then both put in place
#pragma once

#include <string>
#include <string_view>

namespace weft::tools {

class OutputFile {
 public:
  explicit OutputFile(std::string path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  // Writes `content` aside (a temporary file, or memory for a device or FIFO). Once per file.
  void stage(std::string_view content);
  // Puts the staged content in place.
  void commit();

  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;    // as given
  std::string target_;  // with symbolic links resolved
  bool stream_ = false;
  std::string temporary_;  // a staged temporary not yet renamed
  std::string content_;    // what a device or FIFO gets on commit()
};

}  // namespace weft::tools
