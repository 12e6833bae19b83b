// weft::pipeline::MeasuredCollective: one kind of collective a task enqueued in a real run, as
// the task's body reported it through TaskContext::record_collective().
//
//   Task("finalize_model_grads").collective().body([&](TaskContext& c) {
//     ncclAllReduce(grads, grads, n, ncclFloat, ncclSum, comm, cuda_stream(c));
//     c.record_collective("AllReduce", "default", n * sizeof(float));
//   });
//   for (const auto& m : engine.collective_inventory()) print(m.task, m.kind, m.bytes_per_call);
#pragma once

#include <string>

namespace weft::pipeline {

struct MeasuredCollective {
  std::string task;             // the task whose body recorded it
  std::string kind;             // as recorded, e.g. "AllReduce (grad bucket 1)"
  std::string stream;           // the stream the collective ran on
  double bytes_per_call = 0;    // payload per rank, averaged over the calls recorded
  double calls_per_run = 0;     // calls per run of the task
};

}  // namespace weft::pipeline
