// weft::pipeline::Batch: the values of one batch in the ring, one per named slot.
//
// Slots hold any copyable or movable value (std::any); a slot is empty until its writer (or the
// source, for inputs) sets it. A batch's values are destroyed after it has left the ring, once
// the stream work enqueued while they were live has completed (docs/pipeline.md).
// Thread safety: different slots of one batch may be accessed from different threads at once;
// one slot is ordered by the schedule's edges (its writer runs before every reader).
//
//   engine.set_source([&](Batch& b) {
//     if (next == data.size()) return false;   // end of data
//     b.set("batch_cpu", data[next++]);
//     return true;
//   });
#pragma once

#include <any>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "weft/core/error.hpp"

namespace weft::pipeline {

class CompiledSchedule;
class TaskContext;

namespace detail {
class EngineCore;
}

class Batch {
 public:
  Batch() = default;
  explicit Batch(const CompiledSchedule& schedule);

  // Index of the batch within the current data source (0 = the first pulled).
  std::int64_t index() const noexcept { return index_; }

  bool has(std::string_view slot) const { return value(slot).has_value(); }
  template <typename T>
  const T& get(std::string_view slot) const {
    return cast<const T>(value(slot), slot);
  }
  template <typename T>
  T& get(std::string_view slot) {
    return cast<T>(value(slot), slot);
  }
  template <typename T>
  void set(std::string_view slot, T&& v) {
    value(slot) = std::forward<T>(v);
  }
  // Empties every slot (keeps the storage).
  void clear() noexcept;

  // The slot's storage; throws weft::Error for a name the schedule does not know.
  std::any& value(std::string_view slot);
  const std::any& value(std::string_view slot) const;
  std::any& value_by_id(std::uint32_t slot) { return values_.at(slot); }

 private:
  friend class detail::EngineCore;
  friend class TaskContext;

  template <typename T, typename Any>
  static T& cast(Any& any, std::string_view slot) {
    auto* typed = std::any_cast<std::remove_const_t<T>>(&any);
    if (typed == nullptr) {
      WEFT_FAIL("batch slot '", slot, "' ", any.has_value() ? "holds another type" : "is empty");
    }
    return *typed;
  }

  const CompiledSchedule* schedule_ = nullptr;
  std::vector<std::any> values_;
  std::int64_t index_ = -1;
};

}  // namespace weft::pipeline
