#include "weft/ep/buffer.hpp"

#include <algorithm>
#include <cstddef>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <sstream>
#include <string>
#include <utility>

#include "async_state.hpp"
#include "team.hpp"
#include "weft/cuda/device_guard.hpp"
#include "kernels/params.hpp"
#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"
#include "weft/cuda/device_error.hpp"
#include "weft/cuda/nccl.hpp"

namespace weft::ep {
namespace detail {

// What the Buffers of one process (one per local rank) share: the team (team.hpp: the ranks,
// their windows and peer pointers, NCCL's or a virtual team's) and the window layout.
struct BufferGroup {
  std::unique_ptr<Team> team;
  WindowLayout layout;
};

// Per-Buffer device allocations (on the Buffer's device) and host-side sync objects.
struct BufferState {
  int device = 0;
  DeviceState* state = nullptr;  // one cudaMalloc holding everything below, zeroed
  int32_t* block_counts = nullptr;
  int32_t* expert_counts = nullptr;
  int32_t* send_slot = nullptr;
  int32_t* tokens_per_local_expert = nullptr;
  int32_t* rank_prefix_matrix = nullptr;  // [R][R] (DispatchParams::rank_prefix_matrix)
  // Expanded dispatch only (BufferConfig::expand_factor > 0), one cudaMalloc:
  // expand_info [E/R + 3] int64, expand_rows [max_tokens][top_k] int2 (ExpandDispatchParams),
  // block_expert_counts [SMs][E] int32.
  int64_t* expand_info = nullptr;
  int2* expand_rows = nullptr;
  int32_t* block_expert_counts = nullptr;
  // Pinned, 16 bytes: the count and tokens_required (one 8-byte copy of DeviceState::num_recv
  // and the word after it), then at byte 8 an expanded dispatch's rows_required.
  int32_t* host_count = nullptr;
  int32_t* host_tokens_required = nullptr;
  int64_t* host_rows_required = nullptr;
  char** peers = nullptr;         // [kMaxRanks] CommParams::peers of this rank (device)
  // Mapped pinned memory (kernels/params.hpp kPublishedHeaderWords): the counts an uncached
  // deduplicated dispatch with CountMode::kExact publishes early; its device address.
  int32_t* published = nullptr;
  int32_t* published_device = nullptr;
  bool count_published = false;   // the count_sequence dispatch publishes there
  int64_t latest_row_bytes = 0;   // of the latest dispatch (copy_out)
  cudaEvent_t count_event = nullptr;
  uint64_t count_sequence = 0;    // dispatch whose count the pinned word will hold
  cuda::DeviceErrorFlag error;    // bad data: thrown once, the Buffer stays usable
  cuda::DeviceErrorFlag fatal;    // timeouts (kErrTimeout, kErrPeerFailed): unusable after
  std::string unusable;           // the fatal error's message, thrown by every later call
  // The layout in place (the last uncached dispatch launched): what a handle must match.
  Handle layout;

  ~BufferState() {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (count_event != nullptr) cudaEventDestroy(count_event);
    if (host_count != nullptr) cudaFreeHost(host_count);
    if (state != nullptr) cudaFree(state);
    if (expand_info != nullptr) cudaFree(expand_info);
    if (peers != nullptr) cudaFree(peers);
    if (published != nullptr) cudaFreeHost(published);
    cudaSetDevice(previous);
  }
};

}  // namespace detail

namespace {

using cuda::DeviceGuard;

std::atomic<uint64_t> g_next_buffer_id{1};

const char* wait_name(int64_t what) {
  switch (what) {
    case detail::kWaitHandshake: return "the construction handshake of a peer";
    case detail::kWaitCounts: return "a peer's count vector (dispatch count exchange)";
    case detail::kWaitDispatchDone: return "a peer's dispatched rows (dispatch completion)";
    case detail::kWaitCombineEntry: return "a peer to enter combine (its slots to be free)";
    case detail::kWaitCombineRow: return "a peer's expert output row (combine store-back)";
    case detail::kWaitGridBarrier: return "the other blocks of its own kernel (grid barrier)";
    case detail::kWaitCachedEntry: return "a peer to enter a cached dispatch (its rows to be free)";
    default: return "an unknown event";
  }
}

detail::CommParams comm_params(const detail::BufferGroup& group, int rank,
                               int num_ranks, detail::BufferState& state, double timeout_s) {
  return {state.peers, group.layout, rank, num_ranks, state.state,
          state.error.device_record(), state.fatal.device_record(), uint64_t(timeout_s * 1e9)};
}

std::string describe(const cuda::DeviceErrorRecord& r, const BufferConfig& config,
                     double timeout_s) {
  std::ostringstream out;
  switch (r.code) {
    case detail::kErrBadExpert:
      out << "weft::ep dispatch on rank " << r.rank << ": token " << r.args[0] << " selection "
          << r.args[1] << " has expert id " << r.args[2] << ", out of range [0, "
          << config.num_experts << ") and not -1 (the selection was dropped)";
      break;
    case detail::kErrTimeout:
      out << "weft::ep on rank " << r.rank << " timed out after " << timeout_s
          << " s waiting for " << wait_name(r.args[0]);
      if (r.args[1] >= 0) out << " from rank " << r.args[1];
      out << " in call " << r.args[2];
      break;
    case detail::kErrPeerFailed:
      out << "weft::ep on rank " << r.rank << ": rank " << r.args[1] << " failed call "
          << r.args[2] << " (a wait timed out there) while this rank waited for "
          << wait_name(r.args[0]) << "; the rows of that call are incomplete";
      break;
    case detail::kErrTooManyRows:
      out << "weft::ep combine on rank " << r.rank << ": " << r.args[0]
          << " rows were received but " << (r.args[2] != 0 ? "topk_weights" : "expert_out")
          << " has only " << r.args[1]
          << " rows; none was read or sent, out was not written";
      break;
    case detail::kErrPeerRowsMissing:
      out << "weft::ep combine on rank " << r.rank << ": rank " << r.args[0]
          << " sent no rows (its expert_out has fewer rows than it received) in call "
          << r.args[1] << "; the tokens it contributes to were not written to out";
      break;
    case detail::kErrLayoutMismatch:
      out << "weft::ep on rank " << r.rank << ": a combine or cached dispatch of the layout of "
          << "dispatch " << r.args[0] << " ran while the layout of dispatch " << r.args[1]
          << " was in place (a CUDA graph replayed out of order?); the call was skipped";
      break;
    case detail::kErrBadSource:
      out << "weft::ep combine on rank " << r.rank << ": received row " << r.args[0]
          << " names source (rank " << r.args[1] << ", token " << r.args[2]
          << "), out of range (recv_src overwritten?); that row was not sent back";
      break;
    case detail::kErrTokensOverflow:
      out << "weft::ep dispatch on rank " << r.rank << ": rank " << r.args[0] << " dispatched "
          << r.args[1] << " tokens, above max_tokens " << r.args[2] << "; no rank moved any row "
          << "(num_recv 0, tokens_required " << r.args[1] << " on every rank); rebuild every "
          << "rank's Buffer with max_tokens >= " << r.args[1] << " and dispatch again "
          << "(CountMode::kExact reports this in DispatchResult::tokens_required instead)";
      break;
    case detail::kErrOverflowedLayout:
      out << "weft::ep combine or cached dispatch on rank " << r.rank << ": its layout is that "
          << "of a dispatch that moved no rows (rank " << r.args[0] << " dispatched " << r.args[1]
          << " tokens, above max_tokens " << r.args[2] << "); the call was skipped on every rank";
      break;
    case detail::kErrExpandOverflow:
      out << "weft::ep combine on rank " << r.rank << ": the expanded dispatch it combines "
          << "overflowed at rank " << r.args[0] << ", which needed " << r.args[1]
          << " rows for a capacity of " << r.args[2] << " (raise BufferConfig::expand_factor); "
          << "no rank combined anything, out was not written";
      break;
    default:
      out << "weft::ep on rank " << r.rank << ": device error code " << r.code;
  }
  return out.str();
}

void check_view(const TensorView& v, const char* name, std::initializer_list<DType> dtypes,
                int64_t rows, int64_t cols) {
  bool dtype_ok = false;
  std::string allowed;
  for (DType d : dtypes) {
    dtype_ok |= v.dtype == d;
    allowed += allowed.empty() ? dtype_name(d) : std::string(" or ") + dtype_name(d);
  }
  WEFT_CHECK(dtype_ok, name, " must be ", allowed, ", got ", dtype_name(v.dtype));
  WEFT_CHECK(v.rows == rows && v.cols == cols, name, " must be [", rows, ", ", cols, "], got [",
             v.rows, ", ", v.cols, "]");
  WEFT_CHECK(rows == 0 || v.data != nullptr, name, " is null");
}

const char* memory_type_name(cudaMemoryType type) {
  switch (type) {
    case cudaMemoryTypeUnregistered: return "host (not registered with CUDA)";
    case cudaMemoryTypeHost: return "pinned host";
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeManaged: return "managed";
  }
  return "unknown";
}

// The Buffer's device and its rank's window: what check_pointer accepts.
struct PointerHome {
  int device = 0;
  const char* window = nullptr;  // [window, window + window_bytes): the Buffer's own memory
  std::size_t window_bytes = 0;
};

PointerHome pointer_home(const detail::BufferGroup& group, std::size_t index, int device) {
  return {device, group.team->window(index), group.team->window_bytes()};
}

// Throws unless p is null or memory the kernels may read and write as `name`: aligned to
// `alignment` bytes, and device memory of the Buffer's device (or managed memory, or the window:
// dispatch results passed back, e.g. expert_out = recv_x). A misaligned or foreign pointer would
// fault inside a kernel, which ends the CUDA context.
void check_pointer(const void* p, const char* name, const PointerHome& home,
                   std::size_t alignment) {
  if (p == nullptr) return;
  WEFT_CHECK(reinterpret_cast<uintptr_t>(p) % alignment == 0, name, " must be ", alignment,
             "-byte aligned, got address ", p);
  const auto* byte = static_cast<const char*>(p);
  if (byte >= home.window && byte < home.window + home.window_bytes) return;
  const int device = home.device;
  cudaPointerAttributes a{};
  const cudaError_t status = cudaPointerGetAttributes(&a, p);
  if (status != cudaSuccess) {
    cudaGetLastError();  // the failed query must not surface as the next launch's error
    WEFT_FAIL(name, " (", p, ") is no memory CUDA knows: ", cudaGetErrorString(status));
  }
  WEFT_CHECK(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged, name, " (", p,
             ") is ", memory_type_name(a.type), " memory; it must be device memory of device ",
             device);
  WEFT_CHECK(a.type == cudaMemoryTypeManaged || a.device == device, name, " (", p,
             ") is memory of device ", a.device, ", not of the Buffer's device ", device);
}

// Throws unless h names the layout in place (`layout`, the last uncached dispatch of the Buffer
// `buffer_id`) with that layout's own fields: combine and a cached dispatch take T and the kernel
// from the layout, so a handle whose fields were changed would otherwise run the wrong one.
void check_handle(const Handle& h, const Handle& layout, uint64_t buffer_id, const char* call) {
  WEFT_CHECK(h.buffer_id == buffer_id, call, ": the handle is from another Buffer");
  WEFT_CHECK(h.sequence == layout.sequence, call, ": the handle is stale (its layout is dispatch ",
             h.sequence, "'s, but the layout in place is dispatch ", layout.sequence, "'s)");
  WEFT_CHECK(h.num_tokens == layout.num_tokens && h.expand == layout.expand &&
                 (h.num_recv < 0 || h.num_recv == layout.num_recv) &&
                 (h.tokens_required < 0 || h.tokens_required == layout.tokens_required),
             call, ": the handle does not match the layout of dispatch ", layout.sequence,
             " (num_tokens ", h.num_tokens, " for ", layout.num_tokens, ", num_recv ", h.num_recv,
             " for ", layout.num_recv, ", expand ", h.expand.enabled, " for ",
             layout.expand.enabled, "); a Handle must be used as the dispatch returned it");
}

int env_int(const char* a, const char* b, int fallback) {
  for (const char* name : {a, b}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  WEFT_CHECK(fallback >= 0, "launcher variable ", a, " (or ", b, ") is not set");
  return fallback;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
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
    const std::size_t bytes = info_words * 8 + num_selections * sizeof(int2) + count_words * 4;
    void* expand = nullptr;
    WEFT_CUDA_CHECK(cudaMalloc(&expand, bytes));
    WEFT_CUDA_CHECK(cudaMemset(expand, 0, bytes));
    state_->expand_info = static_cast<int64_t*>(expand);
    state_->expand_rows = reinterpret_cast<int2*>(state_->expand_info + info_words);
    state_->block_expert_counts = reinterpret_cast<int32_t*>(state_->expand_rows + num_selections);
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
    params.comm = comm_params(*b.group_, b.rank_, b.num_ranks_, *b.state_,
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

void cast_to_fp8(const void* x, int64_t num_tokens, int64_t hidden, void* out,
                 cudaStream_t stream) {
  const Fp8RowLayout l = fp8_row_layout(hidden);
  WEFT_CHECK(num_tokens >= 0, "cast_to_fp8: num_tokens must not be negative");
  WEFT_CHECK(num_tokens == 0 || (x != nullptr && out != nullptr), "cast_to_fp8: null pointer");
  if (num_tokens > 0) {
    PointerHome home;
    WEFT_CUDA_CHECK(cudaGetDevice(&home.device));
    check_pointer(x, "cast_to_fp8: x", home, 16);
    check_pointer(out, "cast_to_fp8: out", home, 16);
  }
  detail::launch_cast_fp8({static_cast<const uint16_t*>(x), static_cast<uint8_t*>(out), num_tokens,
                           hidden, l.raw_bytes, l.row_bytes},
                          stream);
}

void Buffer::throw_if_device_error() {
  detail::BufferState& st = *state_;
  // A fatal error first (a bad-data error recorded before it must not hide it), and for good.
  if (st.unusable.empty() && st.fatal.raised()) {
    st.unusable = describe(st.fatal.read(), config_, options_.timeout_s) +
                  "; the ranks no longer agree on the call sequence, so this Buffer refuses "
                  "every call: destroy the Buffers of every rank and build new ones";
  }
  WEFT_CHECK(st.unusable.empty(), st.unusable);
  st.error.throw_if_raised([&](const cuda::DeviceErrorRecord& r) {
    return describe(r, config_, options_.timeout_s);
  });
}

void Buffer::check() { throw_if_device_error(); }

int Buffer::first_store_peer() {
  throw_if_device_error();
  DeviceGuard guard(device_);
  int32_t peer = -1;
  WEFT_CUDA_CHECK(cudaMemcpy(&peer, &state_->state->first_store_peer, sizeof(peer),
                             cudaMemcpyDeviceToHost));
  return peer;
}

int combine_send_warps(int send_warps_at_two_ranks, int num_ranks) {
  if (num_ranks < 2) return send_warps_at_two_ranks;
  const int scaled = (2 * send_warps_at_two_ranks * (num_ranks - 1) + num_ranks / 2) / num_ranks;
  return std::clamp(scaled, 1, detail::kThreads / 32 - 1);
}

void Buffer::refuse_overflowed_layout(const Handle& layout, const char* call) const {
  // Known here from this rank's own T, or (any rank's) from wait_num_recv. A rank that does not
  // know launches the call, which its kernel skips without advancing the call number
  // (kErrOverflowedLayout), so refusing here keeps the ranks in step.
  WEFT_CHECK(layout.num_tokens <= config_.max_tokens && layout.tokens_required <= 0, call,
             ": the dispatch of this layout (", layout.sequence, ") moved no rows because a rank's ",
             "T exceeded max_tokens ", config_.max_tokens, " (this rank's T ", layout.num_tokens,
             ", tokens_required ", layout.tokens_required, ", -1: not waited for); rebuild the ",
             "Buffers with max_tokens >= tokens_required and dispatch again");
}

namespace {

// Bytes per received row of dispatch's x: bf16 [T, hidden], packed fp8 [T, fp8 row_bytes] uint8,
// or the fp8 pair's payload [T, hidden] uint8 with x_scales (packed on the way).
int64_t dispatch_row_bytes(const DispatchInputs& in, const BufferConfig& config) {
  const TensorView& x = in.x;
  if (in.x_scales.data != nullptr) {
    const Fp8RowLayout l = fp8_row_layout(config.hidden);
    check_view(x, "x (fp8 payload)", {DType::kUInt8}, x.rows, config.hidden);
    WEFT_CHECK(in.x_scales.token_stride >= 0 && in.x_scales.group_stride >= 0,
               "x_scales strides must not be negative, got (", in.x_scales.token_stride, ", ",
               in.x_scales.group_stride, ")");
    return l.row_bytes;
  }
  if (x.dtype == DType::kUInt8) {
    const Fp8RowLayout l = fp8_row_layout(config.hidden);
    check_view(x, "x (packed fp8 rows)", {DType::kUInt8}, x.rows, l.row_bytes);
    // The window's recv_x region is sized for bf16 rows: [cap][2 * hidden] bytes.
    WEFT_CHECK(l.row_bytes <= config.row_bytes(), "fp8 rows of ", l.row_bytes,
               " bytes do not fit the window's ", config.row_bytes(), "-byte rows");
    return l.row_bytes;
  }
  check_view(x, "x", {DType::kBFloat16}, x.rows, config.hidden);
  return config.row_bytes();
}

detail::RowSource row_source(const DispatchInputs& in, int64_t row_bytes, int64_t hidden) {
  return {in.x.data, row_bytes, in.x_scales.data, hidden, in.x_scales.token_stride,
          in.x_scales.group_stride};
}

}  // namespace

DispatchResult Buffer::make_result(int64_t row_bytes, const Handle& handle) const {
  const auto& layout = group_->layout;
  char* base = group_->team->window(index_);
  DispatchResult r;
  if (row_bytes == config_.row_bytes()) {
    r.recv_x = reinterpret_cast<const uint16_t*>(base + layout.recv_x);
  } else {
    r.recv_x_fp8 = reinterpret_cast<const uint8_t*>(base + layout.recv_x);
  }
  r.row_bytes = row_bytes;
  r.recv_expert_idx = reinterpret_cast<const int32_t*>(base + layout.recv_expert_idx);
  r.recv_weights = reinterpret_cast<const float*>(base + layout.recv_weights);
  r.recv_src = reinterpret_cast<const int32_t*>(base + layout.recv_src);
  r.tokens_per_local_expert = state_->tokens_per_local_expert;
  r.num_recv_device = &state_->state->num_recv;
  r.tokens_required_device = &state_->state->tokens_required;
  r.capacity = handle.expand.enabled ? expand_capacity() : capacity();
  if (!handle.expand.enabled) r.rank_prefix_matrix = state_->rank_prefix_matrix;
  if (handle.expand.enabled) {
    r.segment_begin = state_->expand_info;
    r.rows_required_device = state_->expand_info + config_.num_local_experts(num_ranks_);
  }
  r.handle = handle;
  r.num_recv = handle.num_recv;
  r.tokens_required = handle.tokens_required;
  return r;
}

DispatchResult Buffer::dispatch(const DispatchInputs& in, cudaStream_t stream, CountMode mode) {
  pace_host();
  throw_if_device_error();
  const int64_t T = in.x.rows;
  // The deduplicated uncached dispatch takes T above max_tokens (every rank then learns it in
  // the count exchange and moves no row: see DispatchResult::tokens_required), up to int32 rows;
  // the expanded one is refused here; a cached one must have its layout's T (dispatch_cached).
  if (in.handle == nullptr && !in.expand.enabled) {
    WEFT_CHECK(T >= 0 && T <= kMaxDispatchTokens, "dispatch of ", T, " tokens: at most ",
               kMaxDispatchTokens, " (int32 rows)");
  } else if (in.handle == nullptr) {
    WEFT_CHECK(T >= 0 && T <= config_.max_tokens, "expanded dispatch of ", T,
               " tokens, but the buffer was sized for at most ", config_.max_tokens,
               " (only the deduplicated dispatch reports tokens_required instead)");
  }
  const int64_t row_bytes = dispatch_row_bytes(in, config_);
  const PointerHome home = pointer_home(*group_, index_, device_);
  check_pointer(T > 0 ? in.x.data : nullptr, "x", home, 16);
  check_pointer(T > 0 ? in.x_scales.data : nullptr, "x_scales", home, 4);
  check_pointer(in.cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", home,
                4);
  if (in.handle != nullptr) return dispatch_cached(in, row_bytes, stream, mode);
  check_view(in.topk_idx, "topk_idx", {DType::kInt32, DType::kInt64}, T, config_.top_k);
  check_view(in.topk_weights, "topk_weights", {DType::kFloat32}, T, config_.top_k);
  if (T > 0) {
    check_pointer(in.topk_idx.data, "topk_idx", home, dtype_size(in.topk_idx.dtype));
    check_pointer(in.topk_weights.data, "topk_weights", home, 4);
  }
  if (in.expand.enabled) {
    in.expand.validate();
    WEFT_CHECK(config_.expand_factor >= 1, "an expanded dispatch needs a Buffer built with ",
               "BufferConfig::expand_factor >= 1 (it sizes the window's receive region)");
  }
  DeviceGuard guard(device_);
  detail::DispatchParams p{};
  p.comm = comm_params(*group_, rank_, num_ranks_, *state_, options_.timeout_s);
  p.x = row_source(in, row_bytes, config_.hidden);
  p.topk_idx = in.topk_idx.data;
  p.topk_idx_int64 = in.topk_idx.dtype == DType::kInt64;
  p.local_count = T <= detail::kLocalCountMaxTokens;
  p.topk_weights = static_cast<const float*>(in.topk_weights.data);
  p.num_tokens = T;
  p.max_tokens = config_.max_tokens;
  p.top_k = config_.top_k;
  p.num_experts = config_.num_experts;
  p.num_blocks = num_blocks(T, in.num_sms);
  p.block_counts = state_->block_counts;
  p.expert_counts = state_->expert_counts;
  p.send_slot = state_->send_slot;
  p.tokens_per_local_expert = state_->tokens_per_local_expert;
  p.rank_prefix_matrix = state_->rank_prefix_matrix;
  p.cumulative_stats = in.cumulative_local_expert_recv_stats;
  p.layout_id = dispatch_sequence_ + 1;
  p.report_overflow = mode == CountMode::kOnDevice;
  const bool publish = mode == CountMode::kExact && !in.expand.enabled;
  p.published = publish ? state_->published_device : nullptr;
  if (in.expand.enabled) {
    detail::ExpandDispatchParams ep{};
    ep.dispatch = p;
    ep.block_expert_counts = state_->block_expert_counts;
    ep.expand_info = state_->expand_info;
    ep.capacity = expand_capacity();
    ep.expert_alignment = in.expand.expert_alignment;
    ep.zero_padding = in.expand.zero_padding;
    ep.expand_rows = state_->expand_rows;
    detail::launch_expand_dispatch(ep, stream);
  } else {
    detail::launch_dispatch(p, stream);
  }
  ++dispatch_sequence_;
  state_->layout = {id_, dispatch_sequence_, T, -1,
                    in.expand.enabled ? in.expand : ExpandOptions{}};

  state_->latest_row_bytes = row_bytes;
  DispatchResult r = make_result(row_bytes, state_->layout);
  if (mode == CountMode::kExact) state_->count_published = publish;
  if (publish) {
    WEFT_CUDA_CHECK(cudaEventRecord(state_->count_event, stream));
    state_->count_sequence = dispatch_sequence_;
  } else if (mode == CountMode::kExact) {
    static_assert(offsetof(detail::DeviceState, tokens_required) ==
                      offsetof(detail::DeviceState, num_recv) + sizeof(int32_t),
                  "one copy gives the host num_recv and tokens_required");
    WEFT_CUDA_CHECK(cudaMemcpyAsync(state_->host_count, &state_->state->num_recv,
                                    2 * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    if (in.expand.enabled) {
      WEFT_CUDA_CHECK(cudaMemcpyAsync(state_->host_rows_required, r.rows_required_device,
                                      sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
    }
    WEFT_CUDA_CHECK(cudaEventRecord(state_->count_event, stream));
    state_->count_sequence = dispatch_sequence_;
  }
  note_launched(stream);
  return r;
}

DispatchResult Buffer::dispatch_cached(const DispatchInputs& in, int64_t row_bytes,
                                       cudaStream_t stream, CountMode mode) {
  check_handle(*in.handle, state_->layout, id_, "cached dispatch");
  const Handle& h = state_->layout;  // what the handle was checked to match
  refuse_overflowed_layout(h, "cached dispatch");
  WEFT_CHECK(!in.expand.enabled || in.expand == h.expand,
             "cached dispatch: expand must be left unset or equal the handle's (the layout, "
             "expanded or not, is the handle's)");
  WEFT_CHECK(in.topk_idx.data == nullptr && in.topk_idx.rows == 0 &&
                 in.topk_weights.data == nullptr && in.topk_weights.rows == 0,
             "cached dispatch: topk_idx and topk_weights must be empty (the handle's are reused)");
  WEFT_CHECK(in.x.rows == h.num_tokens, "cached dispatch: x has ", in.x.rows,
             " tokens, the handle's layout ", h.num_tokens);
  WEFT_CHECK(mode == CountMode::kOnDevice, "cached dispatch: the count is the handle's ",
             "(num_recv_device, or handle.num_recv after wait_num_recv); use CountMode::kOnDevice");
  DeviceGuard guard(device_);
  detail::CachedDispatchParams p{};
  p.comm = comm_params(*group_, rank_, num_ranks_, *state_, options_.timeout_s);
  p.x = row_source(in, row_bytes, config_.hidden);
  p.num_tokens = h.num_tokens;
  p.num_blocks = num_blocks(h.num_tokens, in.num_sms);
  p.send_slot = state_->send_slot;
  p.tokens_per_local_expert = state_->tokens_per_local_expert;
  p.num_local_experts = config_.num_local_experts(num_ranks_);
  p.cumulative_stats = in.cumulative_local_expert_recv_stats;
  if (h.expand.enabled) {
    p.expand_rows = state_->expand_rows;
    p.top_k = config_.top_k;
    p.segment_begin = state_->expand_info;
    p.zero_padding = h.expand.zero_padding;
  }
  p.layout_id = h.sequence;
  p.max_tokens = config_.max_tokens;
  detail::launch_cached_dispatch(p, stream);
  state_->latest_row_bytes = row_bytes;
  note_launched(stream);
  return make_result(row_bytes, *in.handle);
}

int64_t Buffer::wait_num_recv(DispatchResult& result) {
  WEFT_CHECK(result.handle.buffer_id == id_, "wait_num_recv: the result is from another Buffer");
  WEFT_CHECK(result.handle.sequence == state_->count_sequence,
             "wait_num_recv needs the latest dispatch made with CountMode::kExact");
  DeviceGuard guard(device_);
  if (state_->count_published) {
    wait_published(result);
  } else {
    WEFT_CUDA_CHECK(cudaEventSynchronize(state_->count_event));
    throw_if_device_error();
    result.num_recv = *state_->host_count;
    result.tokens_required = *state_->host_tokens_required;
  }
  result.handle.num_recv = result.num_recv;
  result.handle.tokens_required = result.tokens_required;
  if (state_->layout.sequence == result.handle.sequence) {
    state_->layout.num_recv = result.num_recv;
    state_->layout.tokens_required = result.tokens_required;
  }
  if (result.handle.expand.enabled) result.rows_required = *state_->host_rows_required;
  return result.num_recv;
}

// Waits on the host until the mapped counts carry this dispatch's layout id (published when its
// count exchange ended). Where its kernel ended without publishing (a wait timed out there: a
// fatal device error), throws that error.
void Buffer::wait_published(DispatchResult& result) {
  const auto* published_id = reinterpret_cast<const volatile uint64_t*>(state_->published);
  const uint64_t want = result.handle.sequence;
  // Between polls of the mapped word, now and then: has the kernel ended without publishing?
  constexpr int kPollsPerEventQuery = 64;
  for (int polls = 1; *published_id != want; ++polls) {
    if (polls % kPollsPerEventQuery != 0) continue;
    const cudaError_t status = cudaEventQuery(state_->count_event);
    if (status == cudaErrorNotReady) {
      std::this_thread::yield();
      continue;
    }
    WEFT_CUDA_CHECK(status);
    if (*published_id == want) break;
    throw_if_device_error();
    WEFT_FAIL("weft::ep dispatch ", want, " ended without publishing its counts");
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  throw_if_device_error();
  const int32_t* words = state_->published;
  result.num_recv = words[2];
  result.tokens_required = words[3];
  result.tokens_per_local_expert_host = words + detail::kPublishedHeaderWords;
}

void Buffer::copy_out(const CopyOutTargets& t, cudaStream_t stream) {
  throw_if_device_error();
  WEFT_CHECK(dispatch_sequence_ > 0, "copy_out: no dispatch has run on this Buffer");
  const bool fp8 = t.x_scales != nullptr;
  WEFT_CHECK(fp8 == (state_->latest_row_bytes != config_.row_bytes()),
             "copy_out: x_scales must be given exactly when the latest dispatch moved fp8 rows");
  WEFT_CHECK(t.num_rows >= 0, "copy_out: num_rows must not be negative, got ", t.num_rows);
  WEFT_CHECK(t.num_topk >= 0 && t.num_topk <= config_.top_k, "copy_out: num_topk ", t.num_topk,
             " is outside [0, top_k = ", config_.top_k, "]");
  WEFT_CHECK(t.num_rows == 0 || t.x != nullptr, "copy_out: x is null");
  const bool expanded = state_->layout.expand.enabled;
  WEFT_CHECK(!expanded || t.rank_prefix_matrix == nullptr,
             "copy_out: an expanded layout has no rank_prefix_matrix");
  const PointerHome home = pointer_home(*group_, index_, device_);
  if (t.num_rows > 0) {
    check_pointer(t.x, "copy_out: x", home, 16);
    check_pointer(t.x_scales, "copy_out: x_scales", home, 4);
    check_pointer(t.src, "copy_out: src", home, 8);
    check_pointer(t.topk_idx, "copy_out: topk_idx", home, t.topk_idx_int64 ? 8 : 4);
    check_pointer(t.topk_weights, "copy_out: topk_weights", home, 4);
  }
  check_pointer(t.rank_prefix_matrix, "copy_out: rank_prefix_matrix", home, 4);
  const auto& layout = group_->layout;
  const char* base = static_cast<const char*>(group_->team->window(index_));
  detail::CopyOutParams p{};
  p.recv_x = base + layout.recv_x;
  p.row_bytes = state_->latest_row_bytes;
  p.recv_src = reinterpret_cast<const int2*>(base + layout.recv_src);
  p.recv_expert_idx = reinterpret_cast<const int32_t*>(base + layout.recv_expert_idx);
  p.recv_weights = reinterpret_cast<const float*>(base + layout.recv_weights);
  p.num_recv = &state_->state->num_recv;
  p.top_k = config_.top_k;
  p.hidden = config_.hidden;
  p.num_rows = t.num_rows;
  p.valid_rows = std::min(t.num_rows, expanded ? expand_capacity() : capacity());
  p.x = t.x;
  p.x_scales = t.x_scales;
  p.src = reinterpret_cast<int2*>(t.src);
  p.pad_token = t.pad_token;
  p.topk_idx = t.topk_idx;
  p.topk_idx_int64 = t.topk_idx_int64;
  p.topk_weights = t.topk_weights;
  p.num_topk = t.num_topk;
  p.rank_prefix_matrix = state_->rank_prefix_matrix;
  p.rank_prefix_out = t.rank_prefix_matrix;
  p.num_ranks = num_ranks_;
  p.max_blocks = device_num_sms_ * 8;
  DeviceGuard guard(device_);
  detail::launch_copy_out(p, stream);
}

void Buffer::combine(const CombineInputs& in, const Handle& handle, void* out,
                     cudaStream_t stream) {
  pace_host();
  throw_if_device_error();
  check_handle(handle, state_->layout, id_, "combine");
  const Handle& layout = state_->layout;  // what the handle was checked to match
  refuse_overflowed_layout(layout, "combine");
  const int64_t T = layout.num_tokens;
  WEFT_CHECK(in.expert_out.dtype == DType::kBFloat16, "expert_out must be bfloat16, got ",
             dtype_name(in.expert_out.dtype));
  WEFT_CHECK(in.expert_out.cols == config_.hidden, "expert_out must have ", config_.hidden,
             " columns, got ", in.expert_out.cols);
  const int64_t rows_allowed = layout.expand.enabled ? expand_capacity() : capacity();
  WEFT_CHECK(in.expert_out.rows >= 0 && in.expert_out.rows <= rows_allowed, "expert_out has ",
             in.expert_out.rows, " rows, at most ", rows_allowed, " allowed");
  WEFT_CHECK(layout.num_recv < 0 || in.expert_out.rows >= layout.num_recv, "expert_out has ",
             in.expert_out.rows, " rows but ", layout.num_recv, " were received");
  WEFT_CHECK(in.expert_out.rows == 0 || in.expert_out.data != nullptr, "expert_out is null");
  const bool with_weights = in.topk_weights.cols != 0;
  if (with_weights) {
    const TensorView& w = in.topk_weights;
    WEFT_CHECK(!layout.expand.enabled, "combine: topk_weights with an expanded layout is not "
               "supported (its rows are per expert; combine the weights of the deduplicated one)");
    WEFT_CHECK(w.dtype == DType::kFloat32, "topk_weights must be float32, got ",
               dtype_name(w.dtype));
    WEFT_CHECK(w.cols >= 1 && w.cols <= config_.top_k, "topk_weights has ", w.cols,
               " columns; K must be in 1..top_k = ", config_.top_k);
    WEFT_CHECK(w.rows >= 0 && w.rows <= rows_allowed, "topk_weights has ", w.rows,
               " rows, at most ", rows_allowed, " allowed");
    WEFT_CHECK(layout.num_recv < 0 || w.rows >= layout.num_recv, "topk_weights has ", w.rows,
               " rows but ", layout.num_recv, " were received");
    WEFT_CHECK(w.rows == 0 || w.data != nullptr, "topk_weights is null");
    WEFT_CHECK(T == 0 || in.combined_weights != nullptr,
               "combined_weights is null but topk_weights is given");
  } else {
    WEFT_CHECK(in.combined_weights == nullptr,
               "combined_weights is given but topk_weights is not (cols == 0)");
  }
  if (in.bias0.data != nullptr) check_view(in.bias0, "bias0", {DType::kBFloat16}, T, config_.hidden);
  if (in.bias1.data != nullptr) check_view(in.bias1, "bias1", {DType::kBFloat16}, T, config_.hidden);
  WEFT_CHECK(T == 0 || out != nullptr, "out is null");
  const PointerHome home = pointer_home(*group_, index_, device_);
  check_pointer(in.expert_out.rows > 0 ? in.expert_out.data : nullptr, "expert_out", home, 16);
  if (T > 0) {
    check_pointer(in.bias0.data, "bias0", home, 16);
    check_pointer(in.bias1.data, "bias1", home, 16);
    check_pointer(out, "out", home, 16);
    check_pointer(in.combined_weights, "combined_weights", home, 4);
  }
  if (with_weights && in.topk_weights.rows > 0) {
    check_pointer(in.topk_weights.data, "topk_weights", home, 4);
  }
  DeviceGuard guard(device_);
  detail::CombineParams p{};
  p.comm = comm_params(*group_, rank_, num_ranks_, *state_, options_.timeout_s);
  p.expert_out = static_cast<const uint16_t*>(in.expert_out.data);
  p.expert_out_rows = in.expert_out.rows;
  p.bias0 = static_cast<const uint16_t*>(in.bias0.data);
  p.bias1 = static_cast<const uint16_t*>(in.bias1.data);
  p.out = static_cast<uint16_t*>(out);
  p.num_tokens = T;
  p.hidden = config_.hidden;
  p.max_tokens = config_.max_tokens;
  // The grid follows the rows this rank stores back as well as its tokens (a rank with few
  // tokens may have received many rows): num_recv where the host knows it (wait_num_recv), else
  // T alone (CountMode::kOnDevice: the count is on the device).
  p.num_blocks = num_blocks(std::max<int64_t>(T, layout.num_recv), in.num_sms);
  p.send_slot = state_->send_slot;
  p.num_send_warps = combine_send_warps(options_.combine_send_warps, num_ranks_);
  if (with_weights) {
    p.topk_weights = static_cast<const float*>(in.topk_weights.data);
    p.topk_weights_rows = in.topk_weights.rows;
    p.num_weights = int(in.topk_weights.cols);
    p.combined_weights = in.combined_weights;
  }
  p.top_k = config_.top_k;
  p.layout_id = layout.sequence;
  if (layout.expand.enabled) {
    p.num_send_warps = options_.expanded_combine_send_warps;
    p.expand_info = state_->expand_info;
    p.num_local_experts = config_.num_local_experts(num_ranks_);
    p.expand_capacity = expand_capacity();
  }
  detail::launch_combine(p, stream);
  note_launched(stream);
}

}  // namespace weft::ep
