// Each `weft <command>` lives in its own file and registers itself on the CLI11 app here.
// A command's callback returns through weft::Error on failure; main turns that into exit code 1.
#pragma once

#include <CLI/CLI.hpp>

namespace weft::tools {

void register_info(CLI::App& app);
void register_plan(CLI::App& app);
#ifdef WEFT_TOOLS_WITH_CUDA
void register_run(CLI::App& app);
#endif

}  // namespace weft::tools
