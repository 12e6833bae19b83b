#include <cstdio>
#include <exception>

#include "command.hpp"
#include "weft/core/error.hpp"
#include "weft/core/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"weft: overlap communication with computation in multi-GPU training"};
  app.set_version_flag("--version", weft::version());
  app.require_subcommand(1);
  weft::tools::register_info(app);
  weft::tools::register_plan(app);
#ifdef WEFT_TOOLS_WITH_CUDA
  weft::tools::register_run(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const weft::Error& e) {
    std::fprintf(stderr, "weft: error: %s\n  (reported at %s:%u)\n", e.message().c_str(),
                 e.file(), e.line());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
