#include "weft/ep/buffer.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "async_state.hpp"
#include "buffer_state.hpp"
#include "team.hpp"
#include "weft/cuda/device_guard.hpp"
#include "kernels/params.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"

namespace weft::ep {
namespace {

using cuda::DeviceGuard;

std::atomic<uint64_t> g_next_buffer_id{1};

int env_int(const char* a, const char* b, int fallback) {
  for (const char* name : {a, b}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  WEFT_CHECK(fallback >= 0, "launcher variable ", a, " (or ", b, ") is not set");
  return fallback;
}

}  // namespace

Buffer::Buffer(std::shared_ptr<detail::BufferGroup> group, std::size_t index,
               const BufferConfig& config, const BufferOptions& options)
    : group_(std::move(group)), index_(index), config_(config), options_(options) {
  const detail::Team& team = *group_->team;
  rank_ = team.rank(index);
  num_ranks_ = team.num_ranks();
  device_ = team.device(index);
  id_ = g_next_buffer_id.fetch_add(1);
  WEFT_CHECK(options.timeout_s > 0, "timeout_s must be positive");
  WEFT_CHECK(options.tokens_per_block >= 1, "tokens_per_block must be at least 1");
  WEFT_CHECK(options.combine_send_warps >= 1 && options.combine_send_warps < detail::kThreads / 32,
             "combine_send_warps must be in 1..", detail::kThreads / 32 - 1);
  WEFT_CHECK(options.pipeline_depth >= 0, "pipeline_depth must not be negative, got ",
             options.pipeline_depth);
  WEFT_CHECK(options.expanded_combine_send_warps >= 1 &&
                 options.expanded_combine_send_warps < detail::kThreads / 32,
             "expanded_combine_send_warps must be in 1..", detail::kThreads / 32 - 1);
  DeviceGuard guard(device_);
  int num_sms = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device_));
  device_num_sms_ = std::min(num_sms, detail::kMaxBlocks);
  WEFT_CHECK(options.num_sms >= 0, "num_sms must not be negative, got ", options.num_sms);
  num_blocks_ = options.num_sms > 0 ? options.num_sms : device_num_sms_;
  WEFT_CHECK(num_blocks_ <= device_num_sms_, "num_sms ", options.num_sms, " exceeds the device's ",
             num_sms, " SMs");
  // Ranks sharing the device (a virtual team) are resident at once only while each keeps to its
  // share of the SMs, so a call may not take more blocks than the Buffer's num_sms.
  call_sms_limit_ = team.ranks_share_device() ? num_blocks_ : device_num_sms_;

  state_ = std::make_unique<detail::BufferState>();
  state_->device = device_;
  const std::size_t R = std::size_t(num_ranks_);
  const std::size_t words = sizeof(detail::DeviceState) / 4 + 64 + detail::kMaxBlocks * R +
                            std::size_t(config.num_experts) +
                            std::size_t(config.max_tokens) * R +
                            std::size_t(config.num_local_experts(num_ranks_)) + R * R;
  void* memory = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&memory, words * 4));
  WEFT_CUDA_CHECK(cudaMemset(memory, 0, words * 4));
  state_->state = static_cast<detail::DeviceState*>(memory);
  int32_t* at = reinterpret_cast<int32_t*>(memory) + sizeof(detail::DeviceState) / 4 + 64;
  state_->block_counts = at;
  at += detail::kMaxBlocks * R;
  state_->expert_counts = at;
  at += config.num_experts;
  state_->send_slot = at;
  at += config.max_tokens * int64_t(R);
  state_->tokens_per_local_expert = at;
  at += config.num_local_experts(num_ranks_);
  state_->rank_prefix_matrix = at;
  if (config.expand_factor > 0) {
    const std::size_t info_words = std::size_t(config.num_local_experts(num_ranks_)) + 3;
    const std::size_t num_selections = std::size_t(config.max_tokens) * std::size_t(config.top_k);
    const std::size_t count_words = std::size_t(device_num_sms_) * std::size_t(config.num_experts);
    const std::size_t num_heads = R * std::size_t(config.max_tokens);
    const std::size_t bytes = info_words * 8 + (num_selections + num_heads) * sizeof(int2) +
                              count_words * 4;
    void* expand = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&expand, bytes));
    WEFT_CUDA_CHECK(cudaMemset(expand, 0, bytes));
    state_->expand_info = static_cast<int64_t*>(expand);
    state_->expand_rows = reinterpret_cast<int2*>(state_->expand_info + info_words);
    state_->sparse_heads = state_->expand_rows + num_selections;
    state_->block_expert_counts = reinterpret_cast<int32_t*>(state_->sparse_heads + num_heads);
  }
  void* host = nullptr;
  WEFT_CUDA_CHECK(cudaHostAlloc(&host, 2 * sizeof(int64_t), cudaHostAllocDefault));
  state_->host_count = static_cast<int32_t*>(host);
  state_->host_tokens_required = static_cast<int32_t*>(host) + 1;
  state_->host_rows_required = static_cast<int64_t*>(host) + 1;
  WEFT_CUDA_CHECK(cudaEventCreateWithFlags(&state_->count_event, cudaEventDisableTiming));
  void* published = nullptr;
  const std::size_t published_words =
      detail::kPublishedHeaderWords + std::size_t(config.num_local_experts(num_ranks_));
  WEFT_CUDA_CHECK(cudaHostAlloc(&published, published_words * 4, cudaHostAllocMapped));
  std::memset(published, 0, published_words * 4);
  state_->published = static_cast<int32_t*>(published);
  void* published_device = nullptr;
  WEFT_CUDA_CHECK(cudaHostGetDevicePointer(&published_device, published, 0));
  state_->published_device = static_cast<int32_t*>(published_device);
  void* peers = nullptr;
  WEFT_CUDA_CHECK(cudaMalloc(&peers, sizeof(char*) * detail::kMaxRanks));
  state_->peers = static_cast<char**>(peers);
  team.fill_peers(index_, state_->peers);
  WEFT_CUDA_CHECK(cudaDeviceSynchronize());
  async_ = detail::make_async_state(device_, options.pipeline_depth);
}

Buffer::~Buffer() = default;

namespace {
detail::WindowLayout window_layout(const BufferConfig& config, int num_ranks) {
  config.validate(num_ranks);
  return detail::make_window_layout(num_ranks, config.max_tokens, config.hidden, config.top_k,
                                    config.num_experts, config.expand_factor);
}

std::shared_ptr<detail::BufferGroup> make_group(cuda::Communicators comms,
                                                const BufferConfig& config) {
  const auto layout = window_layout(config, comms.num_ranks());
  auto team = detail::make_nccl_team(std::move(comms), layout.total_bytes);
  return std::make_shared<detail::BufferGroup>(detail::BufferGroup{std::move(team), layout});
}
}  // namespace

void Buffer::handshake(std::vector<Buffer*> buffers) {
  // The team's host barrier first (NCCL: an all-reduce): no peer may write a flag into a window
  // whose owner is still zeroing it.
  std::vector<int32_t*> scratch;
  for (Buffer* b : buffers) scratch.push_back(b->state_->block_counts);
  buffers.front()->group_->team->barrier(scratch);
  std::vector<cudaStream_t> streams(buffers.size());
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    Buffer& b = *buffers[i];
    DeviceGuard guard(b.device_);
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
    detail::HandshakeParams params{};
    params.comm = detail::comm_params(*b.group_, b.rank_, b.num_ranks_, *b.state_,
                              b.options_.timeout_s);
    detail::launch_handshake(params, streams[i]);
  }
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    Buffer& b = *buffers[i];
    DeviceGuard guard(b.device_);
    WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
    WEFT_CUDA_CHECK(cudaStreamDestroy(streams[i]));
    b.throw_if_device_error();
  }
}

Buffer::Buffer(ncclComm_t comm, const BufferConfig& config, const BufferOptions& options)
    : Buffer(make_group(cuda::Communicators({comm}, /*owned=*/false), config), 0, config,
             options) {
  handshake({this});
}

std::unique_ptr<Buffer> Buffer::from_env(const BufferConfig& config,
                                         const BufferOptions& options) {
  const int rank = env_int("RANK", "OMPI_COMM_WORLD_RANK", -1);
  const int world = env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", -1);
  const int local_rank = env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", rank);
  WEFT_CHECK(std::getenv("NCCL_COMM_ID") != nullptr,
             "Buffer::from_env needs NCCL_COMM_ID=host:port (NCCL's own rendezvous) on every rank");
  WEFT_CHECK(rank >= 0 && rank < world, "RANK ", rank, " is not in [0, WORLD_SIZE=", world, ")");
  WEFT_CUDA_CHECK(cudaSetDevice(local_rank));
  ncclUniqueId id;
  WEFT_NCCL_CHECK(ncclGetUniqueId(&id));  // with NCCL_COMM_ID set, the same id on every rank
  ncclComm_t comm = nullptr;
  WEFT_NCCL_CHECK(ncclCommInitRank(&comm, world, id, rank));
  auto group = make_group(cuda::Communicators({comm}, /*owned=*/true), config);
  std::unique_ptr<Buffer> buffer(new Buffer(std::move(group), 0, config, options));
  handshake({buffer.get()});
  return buffer;
}

std::vector<std::unique_ptr<Buffer>> Buffer::create_local(int num_devices,
                                                          const BufferConfig& config,
                                                          const BufferOptions& options) {
  auto group = make_group(cuda::Communicators::init_all(num_devices), config);
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::vector<Buffer*> raw;
  for (int i = 0; i < num_devices; ++i) {
    buffers.emplace_back(new Buffer(group, std::size_t(i), config, options));
    raw.push_back(buffers.back().get());
  }
  handshake(raw);
  return buffers;
}

std::vector<std::unique_ptr<Buffer>> Buffer::create_virtual_team(int num_ranks,
                                                                 const BufferConfig& config,
                                                                 const BufferOptions& options) {
  int device = 0;
  WEFT_CUDA_CHECK(cudaGetDevice(&device));
  const int share = virtual_team_num_sms(num_ranks, device);
  WEFT_CHECK(options.num_sms >= 0 && options.num_sms <= share, "virtual team of ", num_ranks,
             " ranks: num_sms ", options.num_sms, " exceeds a rank's share of the device's SMs (",
             share, "); every rank's grid must be resident at once");
  BufferOptions member = options;
  if (member.num_sms == 0) member.num_sms = share;
  const auto layout = window_layout(config, num_ranks);
  auto group = std::make_shared<detail::BufferGroup>(detail::BufferGroup{
      detail::make_virtual_team(device, num_ranks, layout.total_bytes), layout});
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::vector<Buffer*> raw;
  for (int i = 0; i < num_ranks; ++i) {
    buffers.emplace_back(new Buffer(group, std::size_t(i), config, member));
    raw.push_back(buffers.back().get());
  }
  handshake(raw);
  return buffers;
}

int Buffer::virtual_team_num_sms(int num_ranks, int device) {
  WEFT_CHECK(num_ranks >= 1 && num_ranks <= detail::kMaxRanks, "a virtual team has 1..",
             detail::kMaxRanks, " ranks, got ", num_ranks);
  int num_sms = 0;
  WEFT_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  const int share = std::min(num_sms, detail::kMaxBlocks) / num_ranks;
  WEFT_CHECK(share >= 1, "a virtual team of ", num_ranks, " ranks needs at least ", num_ranks,
             " SMs; device ", device, " has ", num_sms);
  return share;
}

uint64_t Buffer::window_bytes(const BufferConfig& config, int num_ranks) {
  return window_layout(config, num_ranks).total_bytes;
}

int Buffer::num_blocks(int64_t num_tokens) const noexcept {
  const int64_t wanted = (num_tokens + options_.tokens_per_block - 1) / options_.tokens_per_block;
  return int(std::clamp<int64_t>(wanted, 1, num_blocks_));
}

int Buffer::num_blocks(int64_t num_tokens, int num_sms) const {
  WEFT_CHECK(num_sms >= 0 && num_sms <= call_sms_limit_, "num_sms ", num_sms, " is outside [0, ",
             call_sms_limit_, "] (0: the Buffer's; at most the device's SMs",
             call_sms_limit_ < device_num_sms_ ? ", or a virtual team rank's share of them" : "",
             ")");
  const int most = num_sms > 0 ? num_sms : num_blocks_;
  const int64_t wanted = (num_tokens + options_.tokens_per_block - 1) / options_.tokens_per_block;
  return int(std::clamp<int64_t>(wanted, 1, most));
}

int Buffer::first_store_peer() {
  throw_if_device_error();
  DeviceGuard guard(device_);
  int32_t peer = -1;
  WEFT_CUDA_CHECK(cudaMemcpy(&peer, &state_->state->first_store_peer, sizeof(peer),
                             cudaMemcpyDeviceToHost));
  return peer;
}

}  // namespace weft::ep
