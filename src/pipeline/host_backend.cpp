#include "weft/pipeline/host_backend.hpp"

#include <utility>

#include "weft/core/error.hpp"
#include "weft/pipeline/task_context.hpp"

namespace weft::pipeline {

HostStream::HostStream(std::string name) : name_(std::move(name)), worker_([this] { run(); }) {}

HostStream::~HostStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  worker_.join();
}

void HostStream::enqueue(std::function<void()> work) {
  {
    std::lock_guard lock(mutex_);
    WEFT_CHECK(!stopping_, "host stream '", name_, "' is shutting down");
    queue_.push_back(std::move(work));
    num_enqueued_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_one();
}

void HostStream::run() {
  while (true) {
    std::function<void()> work;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      work();
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!first_error_) first_error_ = std::current_exception();
    }
    {
      std::lock_guard lock(completed_mutex_);
      num_completed_.fetch_add(1, std::memory_order_release);
    }
    completed_.notify_all();
  }
}

void HostStream::wait_for(std::uint64_t position) const {
  if (num_completed_.load(std::memory_order_acquire) >= position) return;
  std::unique_lock lock(completed_mutex_);
  completed_.wait(lock, [&] { return num_completed_.load(std::memory_order_acquire) >= position; });
}

void HostStream::synchronize() {
  wait_for(num_enqueued());
  std::exception_ptr error;
  {
    std::lock_guard lock(mutex_);
    error = std::exchange(first_error_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

HostBackend::~HostBackend() {
  // Each stream drains before it stops; markers only wait on work recorded earlier, which a
  // stream destroyed later still runs, so destroy in reverse creation order only after all drain.
  for (auto& s : streams_) s->wait_for(s->num_enqueued());
}

void HostBackend::bind(const CompiledSchedule& schedule) {
  WEFT_CHECK(streams_.empty(), "HostBackend: bound twice (one backend per engine)");
  for (StreamId s = 0; s < schedule.num_streams(); ++s) {
    streams_.push_back(std::make_unique<HostStream>(schedule.stream(s).name));
  }
  in_flight_ = static_cast<std::uint32_t>(schedule.in_flight());
  events_.assign(schedule.num_tasks() * in_flight_, Event{});
  awaited_.resize(events_.size());
}

void* HostBackend::stream_handle(StreamId stream) { return streams_.at(stream).get(); }

void HostBackend::record(TaskId task, std::uint32_t ring_slot, StreamId stream) {
  {
    std::lock_guard lock(*events_mutex_);
    Event& event = events_[task * in_flight_ + ring_slot];
    event = {stream, streams_[stream]->num_enqueued(), event.num_records + 1};
    auto& awaited = awaited_[task * in_flight_ + ring_slot];
    std::erase_if(awaited, [&](const std::shared_ptr<AwaitedRecord>& a) {
      if (a->num_records != event.num_records) return false;
      a->made = true;
      a->event = event;
      return true;
    });
  }
  record_made_->notify_all();
}

void HostBackend::wait_for_record(StreamId stream, TaskId producer, std::uint32_t ring_slot,
                                  std::uint64_t num_records) {
  auto awaited = std::make_shared<AwaitedRecord>();
  awaited->num_records = num_records;
  {
    std::lock_guard lock(*events_mutex_);
    const Event& event = events_[producer * in_flight_ + ring_slot];
    if (event.num_records >= num_records) {
      // Made already, and it is the latest: the next record of this event comes in_flight
      // iterations later.
      awaited->made = true;
      awaited->event = event;
    } else {
      awaited_[producer * in_flight_ + ring_slot].push_back(awaited);
    }
  }
  num_wait_markers_->fetch_add(1, std::memory_order_relaxed);
  streams_[stream]->enqueue([this, awaited] {
    Event event;
    {
      std::unique_lock lock(*events_mutex_);
      record_made_->wait(lock, [&] { return awaited->made; });
      event = awaited->event;
    }
    streams_[event.stream]->wait_for(event.position);
  });
}

void HostBackend::wait(StreamId stream, TaskId producer, std::uint32_t ring_slot) {
  Event event;
  {
    std::lock_guard lock(*events_mutex_);
    event = events_[producer * in_flight_ + ring_slot];
  }
  if (event.stream == stream) return;  // FIFO order already
  HostStream& source = *streams_[event.stream];
  if (source.num_completed() >= event.position) return;
  num_wait_markers_->fetch_add(1, std::memory_order_relaxed);
  streams_[stream]->enqueue([&source, position = event.position] { source.wait_for(position); });
}

void HostBackend::synchronize() {
  std::exception_ptr error;
  for (auto& s : streams_) {
    try {
      s->synchronize();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

void HostBackend::join_streams() {
  std::vector<std::uint64_t> ends;
  ends.reserve(streams_.size());
  for (const auto& s : streams_) ends.push_back(s->num_enqueued());
  for (std::size_t s = 0; s < streams_.size(); ++s) {
    for (std::size_t other = 0; other < streams_.size(); ++other) {
      if (other == s || streams_[other]->num_completed() >= ends[other]) continue;
      streams_[s]->enqueue(
          [&source = *streams_[other], position = ends[other]] { source.wait_for(position); });
    }
  }
}

std::uint64_t HostBackend::fence() {
  std::vector<std::uint64_t> positions;
  positions.reserve(streams_.size());
  for (const auto& s : streams_) positions.push_back(s->num_enqueued());
  pending_fences_.push_back(std::move(positions));
  return num_fences_++;
}

bool HostBackend::fence_completed(std::uint64_t fence) {
  auto complete = [&](const std::vector<std::uint64_t>& positions) {
    for (std::size_t s = 0; s < streams_.size(); ++s) {
      if (streams_[s]->num_completed() < positions[s]) return false;
    }
    return true;
  };
  while (!pending_fences_.empty() && complete(pending_fences_.front())) pending_fences_.pop_front();
  return fence < num_fences_ - pending_fences_.size();
}

HostStream& host_stream(TaskContext& context) {
  return host_stream(context, context.schedule().stream(context.stream_id()).name);
}

HostStream& host_stream(TaskContext& context, std::string_view stream) {
  auto* backend = dynamic_cast<HostBackend*>(&context.backend());
  WEFT_CHECK(backend != nullptr, "host_stream(): task '", context.name(), "' runs on the ",
             context.backend().name(), " backend, not the host backend");
  const auto id = context.schedule().find_stream(stream);
  WEFT_CHECK(id.has_value(), "host_stream(): no stream '", stream, "' in the schedule");
  return backend->stream(*id);
}

}  // namespace weft::pipeline
