#include "weft/pipeline/batch.hpp"

#include "weft/pipeline/compiled_schedule.hpp"

namespace weft::pipeline {

Batch::Batch(const CompiledSchedule& schedule)
    : schedule_(&schedule), values_(schedule.num_slots()) {}

void Batch::clear() noexcept {
  for (std::any& v : values_) v.reset();
}

std::any& Batch::value(std::string_view slot) {
  WEFT_CHECK(schedule_ != nullptr, "batch is not bound to a schedule");
  const auto id = schedule_->find_slot(slot);
  WEFT_CHECK(id.has_value(), "batch has no slot '", slot, "' (no task or input declares it)");
  return values_[*id];
}

const std::any& Batch::value(std::string_view slot) const {
  return const_cast<Batch*>(this)->value(slot);
}

}  // namespace weft::pipeline
