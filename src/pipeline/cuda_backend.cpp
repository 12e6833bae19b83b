#include "weft/pipeline/cuda_backend.hpp"

#include <algorithm>
#include <chrono>
#include <utility>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/pipeline/task_context.hpp"

namespace weft::pipeline {

CudaBackend::CudaBackend(int device, AdoptedStreams adopted)
    : device_(device), adopted_(std::move(adopted)) {}

CudaBackend::CudaBackend(CudaBackend&& other) noexcept
    : device_(other.device_),
      adopted_(std::move(other.adopted_)),
      streams_(std::move(other.streams_)),
      owned_(std::move(other.owned_)),
      priorities_(std::move(other.priorities_)),
      events_(std::move(other.events_)),
      in_flight_(other.in_flight_),
      pending_fences_(std::move(other.pending_fences_)),
      num_fences_(other.num_fences_),
      free_fence_events_(std::move(other.free_fence_events_)),
      gpu_spans_(other.gpu_spans_),
      spans_mutex_(std::move(other.spans_mutex_)),
      spans_(std::move(other.spans_)),
      free_timing_events_(std::move(other.free_timing_events_)),
      reference_(std::exchange(other.reference_, nullptr)),
      reference_host_ns_(other.reference_host_ns_) {
  other.streams_.clear();
  other.events_.clear();
  other.spans_.clear();
  other.free_timing_events_.clear();
  other.pending_fences_.clear();
  other.free_fence_events_.clear();
}

CudaBackend::~CudaBackend() { release(); }

void CudaBackend::release() noexcept {
  if (streams_.empty() && events_.empty() && spans_.empty() && free_timing_events_.empty() &&
      pending_fences_.empty() && free_fence_events_.empty()) {
    return;
  }
  cudaSetDevice(device_);
  for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  for (const PendingSpan& s : spans_) {
    cudaEventDestroy(s.begin);
    cudaEventDestroy(s.end);
  }
  for (cudaEvent_t e : free_timing_events_) cudaEventDestroy(e);
  for (const auto& fence : pending_fences_) {
    for (cudaEvent_t e : fence) cudaEventDestroy(e);
  }
  for (cudaEvent_t e : free_fence_events_) cudaEventDestroy(e);
  if (reference_ != nullptr) cudaEventDestroy(reference_);
  for (std::size_t s = 0; s < streams_.size(); ++s) {
    if (owned_[s]) cudaStreamDestroy(streams_[s]);
  }
  streams_.clear();
  owned_.clear();
  events_.clear();
  spans_.clear();
  free_timing_events_.clear();
  pending_fences_.clear();
  free_fence_events_.clear();
  reference_ = nullptr;
  cudaGetLastError();  // nothing sticky left behind by teardown
}

void CudaBackend::bind(const CompiledSchedule& schedule) {
  WEFT_CHECK(streams_.empty(), "CudaBackend: bound twice (one backend per engine)");
  WEFT_CUDA_CHECK(cudaSetDevice(device_));
  int least = 0;
  int greatest = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  for (const auto& [name, stream] : adopted_) {
    WEFT_CHECK(schedule.find_stream(name).has_value(), "CudaBackend: adopts stream '", name,
               "', which the schedule does not declare");
  }
  try {
    for (StreamId s = 0; s < schedule.num_streams(); ++s) {
      const auto adopted = adopted_.find(schedule.stream(s).name);
      if (adopted != adopted_.end()) {
        int priority = 0;
        WEFT_CUDA_CHECK(cudaStreamGetPriority(adopted->second, &priority));
        streams_.push_back(adopted->second);
        owned_.push_back(false);
        priorities_.push_back(priority);
        continue;
      }
      // CUDA: smaller numbers are more urgent, greatest <= least.
      const int priority = std::clamp(least - schedule.stream(s).priority, greatest, least);
      cudaStream_t stream = nullptr;
      WEFT_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority));
      streams_.push_back(stream);
      owned_.push_back(true);
      priorities_.push_back(priority);
    }
    in_flight_ = static_cast<std::uint32_t>(schedule.in_flight());
    const std::size_t num_events = schedule.num_tasks() * in_flight_;
    events_.reserve(num_events);
    for (std::size_t i = 0; i < num_events; ++i) {
      cudaEvent_t event = nullptr;
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
      events_.push_back(event);
    }
  } catch (...) {
    release();
    throw;
  }
}

void CudaBackend::on_thread_start() { WEFT_CUDA_CHECK(cudaSetDevice(device_)); }

void* CudaBackend::stream_handle(StreamId stream) { return streams_.at(stream); }

void CudaBackend::record(TaskId task, std::uint32_t ring_slot, StreamId stream) {
  WEFT_CUDA_CHECK(cudaEventRecord(events_[task * in_flight_ + ring_slot], streams_[stream]));
}

void CudaBackend::wait(StreamId stream, TaskId producer, std::uint32_t ring_slot) {
  WEFT_CUDA_CHECK(
      cudaStreamWaitEvent(streams_[stream], events_[producer * in_flight_ + ring_slot], 0));
}

void CudaBackend::synchronize() {
  WEFT_CUDA_CHECK(cudaSetDevice(device_));
  for (cudaStream_t s : streams_) WEFT_CUDA_CHECK(cudaStreamSynchronize(s));
}

void CudaBackend::join_streams() {
  if (streams_.size() < 2) return;
  WEFT_CUDA_CHECK(cudaSetDevice(device_));
  fence();  // an event recorded on every stream, kept until it completes
  const std::vector<cudaEvent_t>& events = pending_fences_.back();
  for (std::size_t s = 0; s < streams_.size(); ++s) {
    for (std::size_t other = 0; other < streams_.size(); ++other) {
      if (other != s) WEFT_CUDA_CHECK(cudaStreamWaitEvent(streams_[s], events[other], 0));
    }
  }
}

std::uint64_t CudaBackend::fence() {
  reap_fences();
  std::vector<cudaEvent_t> fence;
  fence.reserve(streams_.size());
  for (cudaStream_t s : streams_) {
    cudaEvent_t e = nullptr;
    if (free_fence_events_.empty()) {
      WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    } else {
      e = free_fence_events_.back();
      free_fence_events_.pop_back();
    }
    fence.push_back(e);
    WEFT_CUDA_CHECK(cudaEventRecord(e, s));
  }
  pending_fences_.push_back(std::move(fence));
  return num_fences_++;
}

void CudaBackend::reap_fences() {
  auto complete = [](const std::vector<cudaEvent_t>& events) {
    for (cudaEvent_t e : events) {
      const cudaError_t status = cudaEventQuery(e);
      if (status == cudaErrorNotReady) return false;
      WEFT_CUDA_CHECK(status);
    }
    return true;
  };
  while (!pending_fences_.empty() && complete(pending_fences_.front())) {
    for (cudaEvent_t e : pending_fences_.front()) free_fence_events_.push_back(e);
    pending_fences_.pop_front();
  }
}

bool CudaBackend::fence_completed(std::uint64_t fence) {
  reap_fences();
  return fence < num_fences_ - pending_fences_.size();
}

cudaEvent_t CudaBackend::pooled_timing_event() {
  if (!free_timing_events_.empty()) {
    cudaEvent_t e = free_timing_events_.back();
    free_timing_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  WEFT_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

std::uint64_t CudaBackend::begin_gpu_span(TaskId task, StreamId stream, std::int64_t batch) {
  if (!gpu_spans_) return 0;
  std::lock_guard lock(*spans_mutex_);
  if (reference_ == nullptr) {
    reference_ = pooled_timing_event();
    WEFT_CUDA_CHECK(cudaEventRecord(reference_, streams_[stream]));
    reference_host_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  }
  PendingSpan span{task, stream, batch, pooled_timing_event(), pooled_timing_event()};
  WEFT_CUDA_CHECK(cudaEventRecord(span.begin, streams_[stream]));
  spans_.push_back(span);
  return spans_.size();  // 1-based: 0 means "no span"
}

void CudaBackend::end_gpu_span(std::uint64_t span, StreamId stream) {
  if (span == 0) return;
  std::lock_guard lock(*spans_mutex_);
  WEFT_CUDA_CHECK(cudaEventRecord(spans_.at(span - 1).end, streams_[stream]));
}

void CudaBackend::restart_gpu_span(std::uint64_t span, StreamId stream) {
  if (span == 0) return;
  std::lock_guard lock(*spans_mutex_);
  WEFT_CUDA_CHECK(cudaEventRecord(spans_.at(span - 1).begin, streams_[stream]));
}

std::vector<GpuSpan> CudaBackend::take_gpu_spans(std::int64_t origin_ns) {
  synchronize();
  std::lock_guard lock(*spans_mutex_);
  std::vector<GpuSpan> out;
  const double reference_us = static_cast<double>(reference_host_ns_ - origin_ns) / 1e3;
  for (const PendingSpan& s : spans_) {
    float begin_ms = 0;
    float end_ms = 0;
    WEFT_CUDA_CHECK(cudaEventElapsedTime(&begin_ms, reference_, s.begin));
    WEFT_CUDA_CHECK(cudaEventElapsedTime(&end_ms, reference_, s.end));
    out.push_back({s.task, s.stream, s.batch, reference_us + begin_ms * 1e3,
                   reference_us + end_ms * 1e3});
    free_timing_events_.push_back(s.begin);
    free_timing_events_.push_back(s.end);
  }
  spans_.clear();
  if (reference_ != nullptr) free_timing_events_.push_back(std::exchange(reference_, nullptr));
  return out;
}

cudaStream_t cuda_stream(TaskContext& context) {
  return cuda_stream(context, context.schedule().stream(context.stream_id()).name);
}

cudaStream_t cuda_stream(TaskContext& context, std::string_view stream) {
  auto* backend = dynamic_cast<CudaBackend*>(&context.backend());
  WEFT_CHECK(backend != nullptr, "cuda_stream(): task '", context.name(), "' runs on the ",
             context.backend().name(), " backend, not the CUDA backend");
  const auto id = context.schedule().find_stream(stream);
  WEFT_CHECK(id.has_value(), "cuda_stream(): no stream '", stream, "' in the schedule");
  return backend->stream(*id);
}

void wait_event(TaskContext& context, cudaEvent_t event) {
  auto* backend = dynamic_cast<CudaBackend*>(&context.backend());
  WEFT_CHECK(backend != nullptr, "wait_event(): task '", context.name(), "' runs on the ",
             context.backend().name(), " backend, not the CUDA backend");
  WEFT_CUDA_CHECK(cudaStreamWaitEvent(backend->stream(context.stream_id()), event, 0));
  backend->restart_gpu_span(context.gpu_span(), context.stream_id());
}

}  // namespace weft::pipeline
