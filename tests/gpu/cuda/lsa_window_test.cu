// Every rank writes a block of words into every rank's symmetric window through load/store
// (LSA) pointers, then an LSA barrier; every word is checked on the host against the value its
// writer should have put there. Windows are poisoned before each round and each round draws a
// fresh seed, so a word that was not written, or written by the wrong rank, cannot pass.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "weft/cuda/check.hpp"
#include "weft/cuda/nccl.hpp"

namespace {

constexpr int kNumBlocks = 8;
constexpr int kThreads = 256;

__host__ __device__ inline uint32_t expected_word(uint32_t seed, int writer, int reader,
                                                  uint64_t index) {
  uint64_t x = (uint64_t(seed) << 32) ^ (uint64_t(writer) << 48) ^ (uint64_t(reader) << 40) ^ index;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return uint32_t(x) & 0x7FFFFFFFu;  // never equal to the 0xFF.. poison
}

// Window layout on every rank: [num_ranks][num_words] uint32; slot w is written by rank w.
__global__ void exchange_kernel(ncclDevComm dev_comm, ncclWindow_t window, uint64_t num_words,
                                uint32_t seed) {
  ncclLsaBarrierSession<ncclCoopCta> barrier(ncclCoopCta(), dev_comm, ncclTeamTagLsa(),
                                             blockIdx.x);
  // Entry: no peer writes into a window its owner may still be reading from the last round.
  barrier.sync(ncclCoopCta(), cuda::memory_order_relaxed);
  const int rank = dev_comm.rank;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (int peer = 0; peer < dev_comm.nRanks; ++peer) {
    auto* dst = static_cast<uint32_t*>(
        ncclGetLsaPointer(window, uint64_t(rank) * num_words * sizeof(uint32_t), peer));
    for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_words; i += stride) {
      dst[i] = expected_word(seed, rank, peer, i);
    }
  }
  // Exit: release our stores to the peers, acquire theirs into our window.
  barrier.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

TEST(LsaWindow, EveryRankWritesEveryRankEveryWordChecked) {
  const int num_devices = weft::cuda::device_count();
  if (num_devices < 2) GTEST_SKIP() << "needs 2 GPUs, found " << num_devices;

  auto comms = weft::cuda::Communicators::init_all(num_devices);
  auto dev_comms = weft::cuda::DevComms::create(comms, {.num_lsa_barriers = kNumBlocks});
  const uint64_t num_words = (uint64_t(3) << 20) + 17;  // not a multiple of the grid stride
  const std::size_t slot_bytes = num_words * sizeof(uint32_t);
  auto windows = weft::cuda::SymmetricWindows::allocate(comms, slot_bytes * num_devices);

  std::vector<cudaStream_t> streams(num_devices);
  for (int r = 0; r < num_devices; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(comms.device(r)));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
  }

  std::mt19937 rng(std::random_device{}());
  std::vector<uint32_t> host(num_words * num_devices);
  constexpr int kRounds = 20;
  for (int round = 0; round < kRounds; ++round) {
    const uint32_t seed = rng();
    for (int r = 0; r < num_devices; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(comms.device(r)));
      WEFT_CUDA_CHECK(cudaMemsetAsync(windows.local_ptr(r), 0xFF, slot_bytes * num_devices,
                                      streams[r]));
    }
    // The poison must land before any peer's writes: finish it everywhere first.
    for (int r = 0; r < num_devices; ++r) WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[r]));
    for (int r = 0; r < num_devices; ++r) {
      WEFT_CUDA_CHECK(cudaSetDevice(comms.device(r)));
      exchange_kernel<<<kNumBlocks, kThreads, 0, streams[r]>>>(dev_comms[r], windows.window(r),
                                                               num_words, seed);
      WEFT_CUDA_CHECK_LAUNCH();
    }
    for (int r = 0; r < num_devices; ++r) WEFT_CUDA_CHECK(cudaStreamSynchronize(streams[r]));

    for (int reader = 0; reader < num_devices; ++reader) {
      WEFT_CUDA_CHECK(cudaSetDevice(comms.device(reader)));
      WEFT_CUDA_CHECK(cudaMemcpy(host.data(), windows.local_ptr(reader), host.size() * 4,
                                 cudaMemcpyDeviceToHost));
      uint64_t num_wrong = 0;
      for (int writer = 0; writer < num_devices; ++writer) {
        for (uint64_t i = 0; i < num_words; ++i) {
          const uint32_t got = host[writer * num_words + i];
          const uint32_t want = expected_word(seed, writer, reader, i);
          if (got != want && num_wrong++ < 5) {
            ADD_FAILURE() << "round " << round << " reader " << reader << " writer " << writer
                          << " word " << i << ": got " << got << " want " << want;
          }
        }
      }
      ASSERT_EQ(num_wrong, 0u) << "round " << round << " reader " << reader;
    }
  }
  for (int r = 0; r < num_devices; ++r) {
    WEFT_CUDA_CHECK(cudaSetDevice(comms.device(r)));
    WEFT_CUDA_CHECK(cudaStreamDestroy(streams[r]));
  }
}

TEST(NcclRuntime, LoadedLibraryMatchesHeaders) {
  if (weft::cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  EXPECT_NO_THROW(weft::cuda::check_nccl_runtime());
}

}  // namespace
