// weft::pipeline::Trace: what an engine recorded while tracing, and its Chrome/Perfetto export.
//
// Host spans: one per task run (thread, batch, lookahead, iteration, ticket; failed when the body
// threw, also kept after a failed progress()). Waits: every
// cross-thread wait edge that actually blocked a consumer (the export draws it as a flow arrow
// from the producer's span to the consumer's). GPU spans: from backend events (CUDA backend).
// Times are in microseconds from the trace origin (when tracing was enabled). A Trace is a plain
// value, handed over by Engine::take_trace(): reading it needs no lock.
//
//   Engine engine(schedule, ThreadMap::preset("full_split"), HostBackend(), {.trace = true});
//   while (engine.progress()) {}
//   engine.take_trace().write_chrome_json("engine.trace.json");   // open in ui.perfetto.dev
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/pipeline/backend.hpp"
#include "weft/pipeline/wait_edges.hpp"

namespace weft::pipeline {

struct HostSpan {
  TaskId task = 0;
  std::uint32_t thread = 0;       // index into Trace::thread_names
  std::int64_t batch = 0;         // the batch the run worked on (StepRule::batch_at)
  int lookahead = 0;              // the task's lookahead in that run
  std::int64_t iteration = 0;     // the progress() call, counted from 0
  int ticket = -1;                // the collective ticket it held; -1 for a non-collective task
  double begin_us = 0;            // the body was called
  double end_us = 0;              // it returned (or threw); >= begin_us
  bool failed = false;  // the body threw: the span ends where it did
};

struct WaitRecord {
  TaskId producer = 0;
  TaskId consumer = 0;
  WaitRule rule = WaitRule::kOrderingSameProgress;
  std::int64_t iteration = 0;  // the consumer's progress() call
  double begin_us = 0;  // when the consumer started waiting
  double end_us = 0;    // when it saw the producer done
};

struct Trace {
  std::vector<std::string> task_names;    // by TaskId
  std::vector<std::string> thread_names;  // by engine thread index
  std::vector<std::string> stream_names;  // by StreamId
  std::vector<HostSpan> host_spans;       // sorted by begin
  std::vector<WaitRecord> waits;          // grouped by consumer thread, in order on each
  std::vector<GpuSpan> gpu_spans;         // empty unless the backend records them (CUDA)

  // Chrome trace-event JSON: process "host" (one track per engine thread), process "gpu" (one
  // track per stream), flow events for the waits.
  std::string to_chrome_json() const;
  void write_chrome_json(const std::string& path) const;
};

}  // namespace weft::pipeline
