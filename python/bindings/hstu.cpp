// weft._weft.hstu: weft::hstu's preset schedule, for weft/hstu/schedule.py (bodies are attached
// there: the C++ schedule is built without them and the Python layer adds its own).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "weft/core/error.hpp"
#include "weft/hstu/schedule.hpp"

namespace nb = nanobind;

namespace weft::python {

void bind_hstu(nb::module_& m) {
  m.def(
      "hstu_schedule",
      [](const std::string& cascade, bool prefetch, const std::vector<std::string>& body_names) {
        hstu::HstuOptions options;
        WEFT_CHECK(cascade == "d3" || cascade == "d6", "hstu_schedule: cascade '", cascade,
                   "' is neither d3 nor d6");
        options.cascade = cascade == "d3" ? hstu::HstuCascade::kD3 : hstu::HstuCascade::kD6;
        options.prefetch = prefetch;
        for (const std::string& name : body_names) options.bodies[name] = pipeline::TaskBody{};
        return hstu::hstu_schedule(options);
      },
      nb::arg("cascade"), nb::arg("prefetch"), nb::arg("body_names"));
  m.def("hstu_task_names", [] {
    std::vector<std::string> names;
    for (std::string_view n : hstu::hstu_task_names()) names.emplace_back(n);
    return names;
  });
  m.def("hstu_variants", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const hstu::HstuVariant& v : hstu::hstu_variants()) {
      out.emplace_back(v.name, std::string(hstu::to_string(v.cascade)), v.thread_map);
    }
    return out;
  });
  m.def("hstu_variant", [](const std::string& name) {
    const hstu::HstuVariant& v = hstu::hstu_variant(name);
    return std::make_tuple(std::string(hstu::to_string(v.cascade)), std::string(v.thread_map));
  });
}

}  // namespace weft::python
