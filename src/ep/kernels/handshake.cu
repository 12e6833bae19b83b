// weft::ep's construction kernels: the peer table of an NCCL window and the handshake.
#include <cuda_runtime.h>

#include <cstdint>

#include "params.hpp"
#include "protocol.cuh"
#include "weft/cuda/nccl_include.hpp"

namespace weft::ep::detail {
namespace {

__global__ void peer_table_kernel(ncclWindow_t window, int num_ranks, char** out) {
  const int r = int(threadIdx.x);
  if (r < num_ranks) out[r] = static_cast<char*>(ncclGetLsaPointer(window, 0, r));
}

// Every rank writes its flag into every peer's window and waits for all of them, which proves
// that the peer table reaches every window before the first real call.
__global__ void handshake_kernel(const HandshakeParams p) {
  const CommParams& c = p.comm;
  const uint64_t seq = c.state->sequence + 1;
  if (threadIdx.x == 0) {
    raise_at_all_peers(c, c.peers, kFlagHandshake, seq);
    wait_all_peers(c, c.peers[c.rank], kFlagHandshake, seq, kWaitHandshake);
    c.state->sequence = seq;
  }
}

}  // namespace

void launch_peer_table(ncclWindow_t window, int num_ranks, char** out, cudaStream_t stream) {
  peer_table_kernel<<<1, kMaxRanks, 0, stream>>>(window, num_ranks, out);
  WEFT_CUDA_CHECK_LAUNCH();
}

void launch_handshake(const HandshakeParams& params, cudaStream_t stream) {
  handshake_kernel<<<1, 32, 0, stream>>>(params);
  WEFT_CUDA_CHECK_LAUNCH();
}

}  // namespace weft::ep::detail
