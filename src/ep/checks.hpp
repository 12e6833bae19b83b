// The argument checks that the Buffer's calls share (internal to weft::ep's Buffer files). Each
// throws weft::Error naming the argument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "buffer_state.hpp"
#include "weft/ep/buffer.hpp"

namespace weft::ep::detail {

// Throws unless v is a [rows, cols] view of one of `dtypes`, non-null when it has rows.
void check_view(const TensorView& v, const char* name, std::initializer_list<DType> dtypes,
                int64_t rows, int64_t cols);

// The Buffer's device and its rank's window: what check_pointer accepts.
struct PointerHome {
  int device = 0;
  const char* window = nullptr;  // [window, window + window_bytes): the Buffer's own memory
  std::size_t window_bytes = 0;
  bool vouched = false;  // the caller vouches for where the pointers are (pointers_checked)
};

PointerHome pointer_home(const BufferGroup& group, std::size_t index, int device,
                         bool vouched = false);

// Throws unless p is null or memory the kernels may read and write as `name`: aligned to
// `alignment` bytes, and device memory of the Buffer's device (or managed memory, or the window:
// dispatch results passed back, e.g. expert_out = recv_x). A misaligned or foreign pointer would
// fault inside a kernel, which ends the CUDA context. Where home is vouched, only the alignment.
void check_pointer(const void* p, const char* name, const PointerHome& home,
                   std::size_t alignment);

// Throws unless h names the layout in place (`layout`, the last uncached dispatch of the Buffer
// `buffer_id`) with that layout's own fields: combine and a cached dispatch take T and the kernel
// from the layout, so a handle whose fields were changed would otherwise run the wrong one.
void check_handle(const Handle& h, const Handle& layout, uint64_t buffer_id, const char* call);

}  // namespace weft::ep::detail
