// `weft run hstu`: the HSTU-shaped training step (docs/hstu.md) on real GPUs, through the engine,
// under the variants of the HSTU benchmark's preset schedule. Per variant: step time (median,
// range), how busy the default stream is, communication left exposed, the engine's host overhead, a
// Chrome trace; then the planner calibrated on the legacy run predicts every variant, next to what
// was measured.
//
//   mpirun -np 2 --bind-to none weft run hstu --variant all --steps 200 --out-dir out
//   RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 NCCL_COMM_ID=127.0.0.1:29600 weft run hstu ... &  (rank 1 too)
//   weft run hstu --local-gpus 2 --variant full_split_d3      # one process, a thread per GPU
//   weft run hstu --local-gpus 2 --config weft-suggest-1.json   # a schedule config (run_variant.hpp)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "command.hpp"
#include "run_variant.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"
#include "weft/hstu/calibration.hpp"
#include "weft/hstu/launch.hpp"
#include "weft/hstu/rank.hpp"
#include "weft/pipeline/cuda_backend.hpp"
#include "weft/pipeline/pipeline.hpp"
#include "weft/plan/report.hpp"
#include "weft/plan/simulate.hpp"
#include "weft/plan/trace_reader.hpp"

namespace weft::tools {
namespace {

struct RunOptions {
  std::vector<std::string> variants{"all"};
  std::vector<std::string> configs;  // schedule config files, each run as one more variant
  int num_steps = 200;
  double warmup_fraction = 0.25;
  std::string out_dir = "weft-run-hstu";
  int local_gpus = 0;
  std::string rendezvous;
  // The planner's costs come from this variant's trace (the last variant run when it is not run);
  // a preset variant's name or a config's (its file's stem).
  // A threaded run's GPU spans are GPU time; the legacy run's are stretched by its host pace.
  std::string calibrate_from = "full_split_d3";
  hstu::HstuConfig shape;
};

struct Range {
  double median = 0, min = 0, max = 0;
};

Range range_of(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

struct VariantResult {
  std::string name;
  Range step_us, busy, exposed_comm_us;
  // Where the default stream waits, medians per step: the gap before each default-stream task
  // (HstuRank::default_stream_tasks() order), then the two all-to-all joins.
  std::vector<double> idle_before_us;
  double cod_join_us = 0, bwd_join_us = 0;
  double overhead_us = 0;
  double predicted_us = 0;
  double first_loss = 0, last_loss = 0;  // global loss, mean of the first / last 5 steps
  std::string trace_path;
};

// Median host time of one progress() of the variant's schedule with empty bodies on the CUDA
// backend: what the engine itself costs per step (events, waits, tickets, thread hand-offs).
double engine_overhead_us(const RunVariant& v, int device) {
  pipeline::Engine engine(v.schedule(hstu::hstu_schedule({.cascade = v.cascade})), v.thread_map,
                          pipeline::CudaBackend(device));
  engine.set_source([](pipeline::Batch&) { return true; });
  for (int i = 0; i < 50; ++i) engine.progress();
  std::vector<double> samples;
  for (int i = 0; i < 300; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    engine.progress();
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  engine.synchronize();
  return range_of(samples).median;
}

// Sum over ranks of a host vector (through NCCL, on the rank's device).
std::vector<float> all_reduce_sum(const std::vector<float>& values, ncclComm_t comm) {
  float* buffer = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&buffer, values.size() * sizeof(float)));
  std::vector<float> out(values.size());
  try {
    WEFT_CUDA_CHECK(cudaMemcpy(buffer, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice));
    WEFT_NCCL_CHECK(ncclAllReduce(buffer, buffer, values.size(), ncclFloat, ncclSum, comm, nullptr));
    WEFT_CUDA_CHECK(cudaMemcpy(out.data(), buffer, values.size() * sizeof(float), cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(buffer);
    throw;
  }
  WEFT_CUDA_CHECK(cudaFree(buffer));
  return out;
}

std::string human_bytes(double bytes) {
  char text[32];
  if (bytes >= 1 << 20) std::snprintf(text, sizeof text, "%.2f MiB", bytes / double(1 << 20));
  else if (bytes >= 1 << 10) std::snprintf(text, sizeof text, "%.1f KiB", bytes / 1024.0);
  else std::snprintf(text, sizeof text, "%.0f B", bytes);
  return text;
}

// What one rank's run gathers over the variants; rank 0 (lead) prints and writes the files.
struct RankRun {
  const RunOptions& options;
  const hstu::HstuConfig& config;
  ncclComm_t comm;
  int device;
  bool lead;
  const std::vector<RunVariant>& chosen;
  std::size_t skip = 0;  // warm-up steps left out of the figures
  int print_every = 1;
  std::vector<VariantResult> results;
  std::vector<pipeline::MeasuredCollective> inventory;  // of the first variant's run
  std::vector<plan::VariantReport> measured;            // lead: the traced runs, read back
  std::optional<plan::CostModel> costs;                 // lead: the calibration
  std::string calibrated_on;
};

// Rank 0: the run's shape, and a note when the engine threads would share too few CPUs.
void print_run_header(const RankRun& run) {
  const RunOptions& options = run.options;
  const hstu::HstuConfig& config = run.config;
  const auto& chosen = run.chosen;
  std::filesystem::create_directories(options.out_dir);
  std::printf(
      "weft run hstu: %d ranks, %zu variants x %d steps; local batch %d, Zipf(%.2f) <= %d, "
      "dim %d, %d x %d dense\n",
      config.world_size, chosen.size(), options.num_steps, config.local_batch, config.zipf_alpha,
      config.max_seq_len, config.embedding_dim, config.num_layers, config.hidden);
  std::size_t max_num_threads = 1;
  for (const auto& v : chosen) {
    const pipeline::CompiledSchedule schedule(v.schedule(hstu::hstu_schedule({.cascade = v.cascade})));
    max_num_threads = std::max(max_num_threads, v.thread_map.assign(schedule).num_threads());
  }
  if (pipeline::usable_cpus() <= max_num_threads) {
    std::printf(
        "note: this rank may use %zu CPU(s) for up to %zu engine threads and the caller; "
        "threaded variants will be host-starved (mpirun binds a rank to one core by "
        "default: pass --bind-to none)\n",
        pipeline::usable_cpus(), max_num_threads);
  }
  std::fflush(stdout);
}

// Two runs of the same steps per variant: the measured one without the engine's trace (its GPU
// spans add two timing events per task, which the default stream pays between tasks), then a
// traced one for the Chrome trace and the planner's calibration. Both compute the same bits.
// Before the first variant, one more untraced run that nothing is taken from: the first pass over
// the batches pays for what is loaded or chosen per new shape (kernel modules, cuBLAS heuristics
// for each token count, NCCL's first use of each size), which no variant's figures should carry
// (docs/decisions.md).
enum class Pass { kWarmUp, kMeasured, kTraced };

pipeline::Trace run_variant_once(RankRun& run, hstu::HstuRank& rank, const RunVariant& v,
                                 std::size_t vi, Pass pass) {
  const RunOptions& options = run.options;
  const bool lead = run.lead;
  const int device = run.device;
  const int print_every = run.print_every;
  const auto& chosen = run.chosen;
  auto& inventory = run.inventory;
  const bool traced = pass == Pass::kTraced;
  rank.reset();
  pipeline::Engine engine(v.schedule(rank.schedule(v.cascade)), v.thread_map,
                          pipeline::CudaBackend(device), {.trace = traced});
  engine.set_source(rank.source());
  const auto t0 = std::chrono::steady_clock::now();
  while (auto step = engine.progress()) {
    const std::int64_t i = step->batch_index();
    // Progress with the loss needs a host wait, so the measured pass prints none.
    if (lead && pass != Pass::kMeasured && (i + 1) % print_every == 0) {
      std::printf("[%zu/%zu] %-24.*s %s step %4lld/%d  loss share %.5f  %.1f s\n", vi + 1,
                  chosen.size(), int(v.name.size()), v.name.data(),
                  pass == Pass::kWarmUp ? "warm-up" : "traced ", static_cast<long long>(i + 1),
                  options.num_steps, double(rank.wait_loss(i)),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      std::fflush(stdout);
    }
  }
  engine.synchronize();
  if (inventory.empty()) inventory = engine.collective_inventory();
  return engine.take_trace();
}

// The measured run's figures (after the warm-up steps) and its losses, summed over the ranks.
void summarise_timings(const RankRun& run, const hstu::HstuRank& rank, VariantResult& r) {
  const std::size_t skip = run.skip;
  const ncclComm_t comm = run.comm;
  std::vector<double> step_us, busy, exposed;
  const auto timings = rank.step_timings();
  for (std::size_t i = skip; i < timings.size(); ++i) {
    step_us.push_back(timings[i].step_us);
    busy.push_back(timings[i].busy_fraction());
    exposed.push_back(timings[i].exposed_comm_us());
  }
  r.step_us = range_of(step_us);
  r.busy = range_of(busy);
  r.exposed_comm_us = range_of(exposed);
  auto median_of = [&](auto field) {
    std::vector<double> values;
    for (std::size_t i = skip; i < timings.size(); ++i) values.push_back(field(timings[i]));
    return range_of(std::move(values)).median;
  };
  for (std::size_t k = 0; k < hstu::HstuRank::default_stream_tasks().size(); ++k) {
    r.idle_before_us.push_back(
        median_of([k](const hstu::StepTiming& t) { return t.idle_before_us[k]; }));
  }
  r.cod_join_us = median_of([](const hstu::StepTiming& t) { return t.cod_join_us; });
  r.bwd_join_us = median_of([](const hstu::StepTiming& t) { return t.bwd_join_us; });
  const std::vector<float> global_loss = all_reduce_sum(rank.losses(), comm);
  const std::size_t n = global_loss.size(), k = std::min<std::size_t>(5, n);
  for (std::size_t i = 0; i < k; ++i) {
    r.first_loss += global_loss[i] / double(k);
    r.last_loss += global_loss[n - 1 - i] / double(k);
  }
}

// Rank 0: writes the traced run's Chrome trace, calibrates the planner on it when it is the
// variant asked for (or the last one), and prints the variant's line.
void keep_traced_run(RankRun& run, VariantResult& r, const pipeline::Trace& trace, std::size_t vi) {
  const RunOptions& options = run.options;
  const auto& chosen = run.chosen;
  auto& measured = run.measured;
  auto& costs = run.costs;
  auto& calibrated_on = run.calibrated_on;
  r.trace_path = options.out_dir + "/" + r.name + ".rank0.trace.json";
  trace.write_chrome_json(r.trace_path);
  measured.push_back(plan::read_chrome_trace(r.trace_path));
  measured.back().name = r.name + " (traced)";
  const bool last = vi + 1 == chosen.size();
  if (r.name == options.calibrate_from || (last && !costs)) {
    // The traced run's GPU is slower by the trace's own events: scale its GPU spans to the
    // measured (untraced) step, so that predictions compare with untraced measurements.
    const double traced_us = hstu::gpu_period_us(trace, "watchdog", options.warmup_fraction);
    const double gpu_scale = traced_us > 0 ? r.step_us.median / traced_us : 1.0;
    costs = hstu::cost_model_from_trace(trace, options.warmup_fraction, gpu_scale);
    std::printf(
        "calibration: costs from the trace of %s, GPU spans scaled by %.3f (step %.3f "
        "ms measured, %.3f ms traced)\n",
        r.name.c_str(), gpu_scale, r.step_us.median / 1e3, traced_us / 1e3);
    calibrated_on = r.name;
  }
  std::printf(
      "[%zu/%zu] %-24s step %.3f ms [%.3f-%.3f]  default busy %.1f%%  exposed comm "
      "%.3f ms  loss %.4f -> %.4f\n",
      vi + 1, chosen.size(), r.name.c_str(), r.step_us.median / 1e3, r.step_us.min / 1e3,
      r.step_us.max / 1e3, 100 * r.busy.median, r.exposed_comm_us.median / 1e3, r.first_loss,
      r.last_loss);
  std::fflush(stdout);
}

// The calibrated planner (costs from one variant's trace, every variant simulated) next to the
// measured traces: report.html and costs.json.
void write_report_files(RankRun& run) {
  const RunOptions& options = run.options;
  auto& results = run.results;
  auto& measured = run.measured;
  const auto& inventory = run.inventory;
  const auto& costs = run.costs;
  const auto& calibrated_on = run.calibrated_on;
  std::vector<plan::VariantReport> reports;
  for (std::size_t i = 0; i < results.size(); ++i) {
    auto& r = results[i];
    const RunVariant& v = run.chosen[i];
    const pipeline::CompiledSchedule compiled(v.schedule(hstu::hstu_schedule({.cascade = v.cascade})));
    const pipeline::ThreadMap& map = v.thread_map;
    plan::VariantReport sim;
    sim.name = r.name + " (calibrated plan)";
    sim.cascade = std::string(hstu::to_string(v.cascade)) + (v.config ? " + config" : "");
    sim.thread_map = v.thread_map_name;
    sim.source = "simulated, costs from " + calibrated_on;
    sim.placement = plan::placement(compiled, map.assign(compiled));
    sim.timeline = plan::simulate(compiled, map.assign(compiled), *costs);
    r.predicted_us = sim.timeline.step_us;
    reports.push_back(std::move(sim));
  }
  for (auto& m : measured) reports.push_back(std::move(m));
  plan::ReportOptions report_options{.title = "weft run hstu: measured vs calibrated plan", .collectives = {}};
  for (const auto& e : inventory) {
    report_options.collectives[e.task].push_back(
        {e.kind, e.stream, e.bytes_per_call, int(e.calls_per_run + 0.5), "measured"});
  }
  {
    std::ofstream html(options.out_dir + "/report.html");
    html << plan::render_html(reports, report_options);
    std::ofstream costs_file(options.out_dir + "/costs.json");
    costs_file << costs->to_json();
  }
}

void print_inventory(const RankRun& run) {
  const auto& results = run.results;
  const auto& inventory = run.inventory;
  std::printf("\nNCCL inventory per step (rank 0, measured in %s):\n", results.front().name.c_str());
  std::printf("  %-24s %-30s %-17s %12s %6s\n", "task", "collective", "stream", "bytes/call", "calls");
  int num_calls = 0;
  for (const auto& e : inventory) {
    std::printf("  %-24s %-30s %-17s %12s %6.2f\n", e.task.c_str(), e.kind.c_str(), e.stream.c_str(),
                human_bytes(e.bytes_per_call).c_str(), e.calls_per_run);
    num_calls += int(e.calls_per_run + 0.5);
  }
  std::printf("  %d collective calls per step\n\n", num_calls);
}

// The variants table, where the default stream waits, and results.json.
void print_results(const RankRun& run) {
  const RunOptions& options = run.options;
  const hstu::HstuConfig& config = run.config;
  const auto& results = run.results;
  const auto& inventory = run.inventory;
  const auto& calibrated_on = run.calibrated_on;
  const double legacy_us = results.front().name == "legacy_none" ? results.front().step_us.median : 0;
  std::printf("planner calibrated on the trace of %s\n", calibrated_on.c_str());
  std::printf("%-24s %-24s %8s %10s %12s %9s %16s %9s\n", "variant", "step ms median [min-max]",
              "vs legacy", "busy %", "exposed ms", "engine us", "plan ms (err)", "loss");
  nlohmann::json root = {{"world_size", config.world_size}, {"steps", options.num_steps},
                         {"calibrated_on", calibrated_on},
                         {"variants", nlohmann::json::array()}, {"inventory", nlohmann::json::array()}};
  for (const auto& r : results) {
    char range[64], vs[16], plan_text[32];
    std::snprintf(range, sizeof range, "%.3f [%.3f-%.3f]", r.step_us.median / 1e3, r.step_us.min / 1e3,
                  r.step_us.max / 1e3);
    std::snprintf(vs, sizeof vs, "%+.1f%%", legacy_us > 0 ? 100 * (r.step_us.median / legacy_us - 1) : 0.0);
    std::snprintf(plan_text, sizeof plan_text, "%.3f (%+.0f%%)", r.predicted_us / 1e3,
                  100 * (r.predicted_us / r.step_us.median - 1));
    std::printf("%-24s %-24s %8s %9.1f%% %12.3f %5.0f %4.2f%% %16s %.3f\n", r.name.c_str(), range,
                legacy_us > 0 ? vs : "-", 100 * r.busy.median, r.exposed_comm_us.median / 1e3,
                r.overhead_us, 100 * r.overhead_us / r.step_us.median, plan_text, r.last_loss);
    root["variants"].push_back({{"name", r.name}, {"step_us", {r.step_us.median, r.step_us.min, r.step_us.max}},
                                {"default_busy", {r.busy.median, r.busy.min, r.busy.max}},
                                {"exposed_comm_us", {r.exposed_comm_us.median, r.exposed_comm_us.min, r.exposed_comm_us.max}},
                                {"engine_overhead_us", r.overhead_us}, {"predicted_step_us", r.predicted_us},
                                {"loss_first", r.first_loss}, {"loss_last", r.last_loss}, {"trace", r.trace_path}});
  }
  // Where the default stream waits (medians per step, us): the gap before each of its tasks and
  // the two all-to-all joins.
  std::printf("\ndefault stream waits per step (median us): gap before each task, a2a joins\n%-24s",
              "variant");
  const auto tasks = hstu::HstuRank::default_stream_tasks();
  for (auto t : tasks) std::printf(" %8.8s", t.data());
  std::printf(" %8s %8s\n", "cod_join", "bwd_join");
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    std::printf("%-24s", r.name.c_str());
    nlohmann::json gaps;
    for (std::size_t k = 0; k < tasks.size(); ++k) {
      std::printf(" %8.1f", r.idle_before_us[k]);
      gaps[std::string(tasks[k])] = r.idle_before_us[k];
    }
    std::printf(" %8.1f %8.1f\n", r.cod_join_us, r.bwd_join_us);
    root["variants"][i]["idle_before_us"] = gaps;
    root["variants"][i]["join_us"] = {{"compute_output_dist", r.cod_join_us},
                                      {"optimizer_step", r.bwd_join_us}};
  }
  for (const auto& e : inventory) {
    root["inventory"].push_back({{"task", e.task}, {"kind", e.kind}, {"stream", e.stream},
                                 {"bytes_per_call", e.bytes_per_call}, {"calls_per_step", e.calls_per_run}});
  }
  std::ofstream(options.out_dir + "/results.json") << root.dump(2);
  std::printf("\nwrote %s/{results.json, report.html, costs.json, <variant>.rank0.trace.json}\n",
              options.out_dir.c_str());
}

// One rank's whole run. Rank 0 prints and writes the files.
void run_rank(const RunOptions& options, const std::vector<RunVariant>& variants,
              hstu::HstuConfig config, ncclComm_t comm, int device) {
  RankRun run{.options = options,
              .config = config,
              .comm = comm,
              .device = device,
              .lead = config.rank == 0,
              .chosen = variants};
  if (run.lead) print_run_header(run);
  WEFT_CUDA_CHECK(cudaSetDevice(device));
  hstu::HstuRank rank(config, comm, device, options.num_steps);
  run.skip = std::size_t(double(options.num_steps) * options.warmup_fraction);
  run.print_every = std::max(1, options.num_steps / 4);
  for (std::size_t vi = 0; vi < run.chosen.size(); ++vi) {
    const RunVariant& v = run.chosen[vi];
    if (vi == 0) run_variant_once(run, rank, v, vi, Pass::kWarmUp);
    run_variant_once(run, rank, v, vi, Pass::kMeasured);
    VariantResult r;
    r.name = v.name;
    summarise_timings(run, rank, r);
    r.overhead_us = engine_overhead_us(v, device);
    const pipeline::Trace trace = run_variant_once(run, rank, v, vi, Pass::kTraced);
    if (run.lead) keep_traced_run(run, r, trace, vi);
    run.results.push_back(std::move(r));
  }
  if (!run.lead) return;
  write_report_files(run);
  print_inventory(run);
  print_results(run);
}

// Every argument, checked before a GPU or NCCL is touched, so that a mistake is reported as
// itself rather than as whatever the GPUs say first; returns the variants to run.
std::vector<RunVariant> check_arguments(const RunOptions& options) {
  WEFT_CHECK(options.num_steps >= 8, "--steps must be >= 8");
  std::vector<RunVariant> variants = run_variants(options.variants, options.configs);
  const bool calibrate_from_run =
      std::any_of(variants.begin(), variants.end(),
                  [&](const RunVariant& v) { return v.name == options.calibrate_from; });
  if (!calibrate_from_run) {
    try {
      hstu::hstu_variant(options.calibrate_from);
    } catch (const Error& e) {
      WEFT_FAIL("--calibrate-from: ", e.message(), " or a config of the run");
    }
  }
  WEFT_CHECK(options.local_gpus >= 0, "--local-gpus ", options.local_gpus,
             ": expected >= 0 (0: one GPU per process)");
  const hstu::HstuConfig& shape = options.shape;
  WEFT_CHECK(shape.local_batch >= 1, "--local-batch ", shape.local_batch, ": expected >= 1");
  WEFT_CHECK(shape.max_seq_len >= 1, "--max-seq-len ", shape.max_seq_len, ": expected >= 1");
  WEFT_CHECK(shape.hidden >= 8 && shape.hidden % 8 == 0, "--hidden ", shape.hidden,
             ": expected a multiple of 8, >= 8 (tensor-core GEMMs)");
  WEFT_CHECK(shape.num_layers >= 1, "--layers ", shape.num_layers, ": expected >= 1");
  WEFT_CHECK(shape.num_layers >= shape.bucket_split_layer, "--layers ", shape.num_layers,
             ": expected >= ", shape.bucket_split_layer, " (the gradient AllReduce's first bucket ",
             "starts at layer ", shape.bucket_split_layer, ")");
  shape.validate();  // what is left (the world is known only after the launch)
  return variants;
}

void run_hstu(const RunOptions& options) {
  const std::vector<RunVariant> variants = check_arguments(options);
  cuda::check_nccl_runtime();
  if (options.local_gpus > 0) {
    WEFT_CHECK(cuda::device_count() >= options.local_gpus, "--local-gpus ", options.local_gpus,
               " but ", cuda::device_count(), " CUDA devices");
    auto comms = cuda::Communicators::init_all(options.local_gpus);
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(std::size_t(options.local_gpus));
    for (int r = 0; r < options.local_gpus; ++r) {
      threads.emplace_back([&, r] {
        try {
          hstu::HstuConfig config = options.shape;
          config.rank = r;
          config.world_size = options.local_gpus;
          run_rank(options, variants, config, comms[std::size_t(r)], r);
        } catch (...) {
          errors[std::size_t(r)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    return;
  }
  const hstu::LaunchEnv env = hstu::detect_launch_env(options.rendezvous);
  if (env.rank == 0) {
    std::printf("launcher: %s, world %d, rendezvous %s\n", env.launcher.c_str(), env.world_size,
                env.rendezvous.empty() ? "-" : env.rendezvous.c_str());
  }
  cuda::Communicators comms({hstu::init_communicator(env)});
  hstu::HstuConfig config = options.shape;
  config.rank = env.rank;
  config.world_size = env.world_size;
  run_rank(options, variants, config, comms[0], env.local_rank);
}

}  // namespace

void register_run(CLI::App& app) {
  auto options = std::make_shared<RunOptions>();
  auto* run = app.add_subcommand("run", "Run a preset workload on real GPUs through the engine");
  run->require_subcommand(1);
  auto* hstu = run->add_subcommand(
      "hstu", "The HSTU training step under the HSTU benchmark's preset variants");
  auto* variant = hstu->add_option("--variant", options->variants,
                                   "variant name, or all (repeatable; default all, none with --config)")
                      ->capture_default_str();
  hstu->add_option("--config", options->configs,
                   "a schedule config file (e.g. from weft plan --suggest --config-out), run as a "
                   "variant named after the file's stem (repeatable)");
  hstu->add_option("--steps", options->num_steps, "training steps per variant")->capture_default_str();
  hstu->add_option("--warmup", options->warmup_fraction, "fraction of steps left out of the figures")
      ->capture_default_str()->check(CLI::Range(0.0, 0.9));
  hstu->add_option("--out-dir", options->out_dir, "traces, results.json, report.html, costs.json")
      ->capture_default_str();
  hstu->add_option("--local-gpus", options->local_gpus,
                   "one process drives this many GPUs (a thread each) instead of one per process");
  hstu->add_option("--rendezvous", options->rendezvous, "host:port of rank 0's NCCL bootstrap");
  hstu->add_option("--calibrate-from", options->calibrate_from,
                   "variant whose trace gives the planner's task costs")->capture_default_str();
  hstu->add_option("--local-batch", options->shape.local_batch)->capture_default_str();
  hstu->add_option("--max-seq-len", options->shape.max_seq_len)->capture_default_str();
  hstu->add_option("--hidden", options->shape.hidden)->capture_default_str();
  hstu->add_option("--layers", options->shape.num_layers)->capture_default_str();
  hstu->add_option("--seed", options->shape.seed)->capture_default_str();
  hstu->add_flag("!--one-communicator", options->shape.communicator_per_role,
                 "every collective on one NCCL communicator (default: one per role, split from it)");
  hstu->callback([options, variant] {
    if (!options->configs.empty() && variant->count() == 0) options->variants.clear();
    run_hstu(*options);
  });
}

}  // namespace weft::tools
