// weft::cuda::copy_rows: several pitched device-to-device copies in one kernel launch.
//
//   weft::cuda::CopyRowsParams p;
//   p.add({dst, dst_pitch_bytes, src, src_pitch_bytes, width_bytes, num_rows});
//   weft::cuda::copy_rows(p, stream);
//
// Copy i writes num_rows rows of width_bytes each, row r from src + r * src_pitch_bytes to
// dst + r * dst_pitch_bytes. It moves the data with the SMs (16-byte accesses where every address,
// pitch and width allows, else the widest that does), which reads and writes device memory at
// close to its bandwidth where cudaMemcpy2DAsync between device buffers goes through the copy
// engines. The regions of one launch must not overlap. Both pointers live on the current device
// (or are mapped into it); the stream orders the kernel as usual.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace weft::cuda {

struct RowCopy {
  void* dst = nullptr;
  int64_t dst_pitch_bytes = 0;
  const void* src = nullptr;
  int64_t src_pitch_bytes = 0;
  int64_t width_bytes = 0;
  int64_t num_rows = 0;
};

struct CopyRowsParams {
  static constexpr int kMaxCopies = 8;
  RowCopy copies[kMaxCopies];
  int num_copies = 0;
  // Appends a copy (weft::Error past kMaxCopies or for a malformed one); empty ones are dropped.
  void add(const RowCopy& copy);
};

// Enqueues the copies on stream (one launch; nothing for no copies).
void copy_rows(const CopyRowsParams& params, cudaStream_t stream);

}  // namespace weft::cuda
