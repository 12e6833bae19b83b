#include "weft/cuda/copy_rows.hpp"

#include <algorithm>

#include "weft/core/error.hpp"
#include "weft/cuda/check.hpp"

namespace weft::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocksPerCopy = 1024;

// The widest access (16, 8, 4, 2 or 1 bytes) that every address, pitch and width of a copy is
// a multiple of.
int access_bytes(const RowCopy& c) {
  const auto bits = reinterpret_cast<uintptr_t>(c.dst) | reinterpret_cast<uintptr_t>(c.src) |
                    uintptr_t(c.dst_pitch_bytes) | uintptr_t(c.src_pitch_bytes) |
                    uintptr_t(c.width_bytes);
  for (int bytes = 16; bytes > 1; bytes /= 2) {
    if (bits % uintptr_t(bytes) == 0) return bytes;
  }
  return 1;
}

template <typename Word>
__device__ void copy_words(const RowCopy& c) {
  const int64_t words_per_row = c.width_bytes / int64_t(sizeof(Word));
  const int64_t num_words = words_per_row * c.num_rows;
  const int64_t dst_pitch = c.dst_pitch_bytes / int64_t(sizeof(Word));
  const int64_t src_pitch = c.src_pitch_bytes / int64_t(sizeof(Word));
  auto* dst = static_cast<Word*>(c.dst);
  const auto* src = static_cast<const Word*>(c.src);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_words;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / words_per_row;
    const int64_t col = i - row * words_per_row;
    dst[row * dst_pitch + col] = src[row * src_pitch + col];
  }
}

// Block (x, y) works on copy y; the access width of each copy is in access[y].
struct KernelParams {
  CopyRowsParams copies;
  int access[CopyRowsParams::kMaxCopies];
};

__global__ void __launch_bounds__(kThreads) copy_rows_kernel(const KernelParams p) {
  const RowCopy& c = p.copies.copies[blockIdx.y];
  switch (p.access[blockIdx.y]) {
    case 16: copy_words<int4>(c); break;
    case 8: copy_words<int2>(c); break;
    case 4: copy_words<int32_t>(c); break;
    case 2: copy_words<int16_t>(c); break;
    default: copy_words<int8_t>(c); break;
  }
}

}  // namespace

void CopyRowsParams::add(const RowCopy& copy) {
  WEFT_CHECK(copy.width_bytes >= 0 && copy.num_rows >= 0, "copy_rows: negative width ",
             copy.width_bytes, " or rows ", copy.num_rows);
  if (copy.width_bytes == 0 || copy.num_rows == 0) return;
  WEFT_CHECK(copy.dst != nullptr && copy.src != nullptr, "copy_rows: a null pointer");
  WEFT_CHECK(copy.dst_pitch_bytes >= copy.width_bytes && copy.src_pitch_bytes >= copy.width_bytes,
             "copy_rows: pitches ", copy.dst_pitch_bytes, " / ", copy.src_pitch_bytes,
             " are below the width ", copy.width_bytes);
  WEFT_CHECK(num_copies < kMaxCopies, "copy_rows: more than ", kMaxCopies, " copies in one call");
  copies[num_copies++] = copy;
}

void copy_rows(const CopyRowsParams& params, cudaStream_t stream) {
  if (params.num_copies == 0) return;
  KernelParams p{params, {}};
  int64_t max_words = 0;
  for (int i = 0; i < params.num_copies; ++i) {
    const RowCopy& c = params.copies[i];
    p.access[i] = access_bytes(c);
    max_words = std::max(max_words, c.width_bytes / p.access[i] * c.num_rows);
  }
  const auto blocks = static_cast<unsigned>(
      std::min<int64_t>(kMaxBlocksPerCopy, (max_words + kThreads - 1) / kThreads));
  copy_rows_kernel<<<dim3(blocks, unsigned(params.num_copies)), kThreads, 0, stream>>>(p);
  WEFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace weft::cuda
