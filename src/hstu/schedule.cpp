#include "weft/hstu/schedule.hpp"

#include <array>
#include <string>

#include "weft/core/error.hpp"

namespace weft::hstu {

using pipeline::CollectiveOp;
using pipeline::SyncSide;
using pipeline::Task;

namespace {

constexpr std::array<std::string_view, 14> kTaskNames = {"h2d",
                                                         "start_shuffle",
                                                         "finish_shuffle",
                                                         "start_input_dist",
                                                         "wait_input_dist",
                                                         "prefetch_embeddings",
                                                         "zero_grad",
                                                         "global_tokens_allreduce",
                                                         "compute_output_dist",
                                                         "forward",
                                                         "backward",
                                                         "finalize_model_grads",
                                                         "optimizer_step",
                                                         "watchdog"};

constexpr std::array<HstuVariant, 9> kVariants = {{
    {"legacy_none", HstuCascade::kD3, "legacy"},
    {"default_d3", HstuCascade::kD3, "default"},
    {"by_stream_d3", HstuCascade::kD3, "by_stream"},
    {"per_task_d3", HstuCascade::kD3, "per_task"},
    {"io_prefetch_compute_d3", HstuCascade::kD3, "io_prefetch_compute"},
    {"io_data_dist_compute_d3", HstuCascade::kD3, "io_data_dist_compute"},
    {"full_split_d3", HstuCascade::kD3, "full_split"},
    {"default_d6", HstuCascade::kD6, "default"},
    {"full_split_d6", HstuCascade::kD6, "full_split"},
}};

// The HSTU benchmark's collective inventory, 11 NCCL kernels per step (docs/perf-hstu.md, "The
// HSTU benchmark's figures"). Byte counts are its orders of magnitude, for the planner, not
// exact sizes.
constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = 1024 * kKiB;

}  // namespace

std::string_view to_string(HstuCascade cascade) noexcept {
  return cascade == HstuCascade::kD3 ? "d3" : "d6";
}

std::span<const std::string_view> hstu_task_names() noexcept { return kTaskNames; }
std::span<const HstuVariant> hstu_variants() noexcept { return kVariants; }

const HstuVariant& hstu_variant(std::string_view name) {
  for (const HstuVariant& v : kVariants) {
    if (v.name == name) return v;
  }
  std::string known;
  for (const HstuVariant& v : kVariants) known += (known.empty() ? "" : ", ") + std::string(v.name);
  WEFT_FAIL("unknown HSTU variant '", name, "' (known: ", known, ")");
}

Schedule hstu_schedule(const HstuOptions& options) {
  const bool d6 = options.cascade == HstuCascade::kD6;
  for (const auto& [name, body] : options.bodies) {
    bool known = false;
    for (auto n : kTaskNames) known = known || n == name;
    WEFT_CHECK(known, "hstu_schedule: a body is given for '", name, "', which is no HSTU task");
    WEFT_CHECK(options.prefetch || name != "prefetch_embeddings",
               "hstu_schedule: a body is given for prefetch_embeddings but prefetch is off");
  }
  auto body = [&](std::string_view name) {
    const auto it = options.bodies.find(name);
    return it == options.bodies.end() ? TaskBody{} : it->second;
  };
  auto task = [&](const char* name) { return std::move(Task(name).body(body(name))); };

  Schedule s;
  s.add_stream("memcpy").add_stream("data_dist").add_stream("prefetch");
  // Comm streams used inside tasks (TorchRec's output_dist comm stream); no task is bound to it.
  s.add_stream("output_dist_comm");
  s.add_input("batch_cpu");

  s.add(task("h2d")
            .stream("memcpy")
            .lookahead(d6 ? 5 : 2)
            .reads("batch_cpu")
            .writes("batch_gpu", "ctx"));
  s.add(task("start_shuffle")
            .stream("memcpy")
            .lookahead(d6 ? 4 : 2)
            .reads("batch_gpu")
            .writes("shuffle_handle")
            .collective({{"AllGather", "memcpy", 2 * kKiB, 1}}));
  s.add(task("finish_shuffle")
            .stream("memcpy")
            .lookahead(d6 ? 3 : 2)
            .reads("batch_gpu", "shuffle_handle")
            .writes("shuffled_batch")
            .collective(
                {{"AllGather", "memcpy", 10 * kKiB, 1}, {"AllGatherV", "memcpy", 4 * kMiB, 1}}));
  s.add(task("start_input_dist")
            .stream("data_dist")
            .lookahead(d6 ? 3 : 1)
            .reads("shuffled_batch", "ctx")
            .writes("dist_request")
            .collective({{"SendRecv", "output_dist_comm", 512, 1}}));
  s.add(task("wait_input_dist")
            .stream("data_dist")
            .lookahead(d6 ? 2 : 1)
            .depends_on("start_input_dist")
            .collective({{"SendRecv", "output_dist_comm", 32 * kKiB, 1},
                         {"SendRecv", "output_dist_comm", 4 * kMiB, 1}}));
  if (options.prefetch) {
    s.add(
        task("prefetch_embeddings").stream("prefetch").lookahead(1).depends_on("wait_input_dist"));
  }
  s.add(task("zero_grad"));
  s.add(task("global_tokens_allreduce")
            .reads("batch_gpu")
            .writes("global_tokens")
            .collective({{"AllReduce", "default", 8, 1}}));
  Task output_dist = task("compute_output_dist");
  output_dist.depends_on("wait_input_dist");
  if (options.prefetch) output_dist.depends_on("prefetch_embeddings");
  // The embedding outputs the forward pass consumes: forward waits for them in its progress.
  output_dist.writes("embeddings").collective({{"SendRecv", "output_dist_comm", 32 * kMiB, 1}});
  s.add(std::move(output_dist));
  s.add(task("forward").reads("embeddings").writes("losses", "output"));
  Task backward = task("backward");
  backward.reads("losses", "global_tokens")
      .depends_on("zero_grad")
      .collective({{"SendRecv", "output_dist_comm", 32 * kMiB, 1}});
  if (options.prefetch) backward.same_progress_sync("prefetch_embeddings", SyncSide::kBoth);
  s.add(std::move(backward));
  s.add(task("finalize_model_grads")
            .depends_on("backward")
            .collective(
                {{"AllReduce", "default", 32 * kMiB, 1}, {"AllReduce", "default", 4 * kMiB, 1}}));
  s.add(task("optimizer_step").depends_on("finalize_model_grads").writes("step_result"));
  s.add(task("watchdog"));
  return s;
}

}  // namespace weft::hstu
