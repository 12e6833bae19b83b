// DLPack capsules of device memory that weft owns (a Buffer's symmetric window), so that any
// framework's from_dlpack wraps it without a copy and without the extension knowing the framework.
//
// Contract: the capsule holds `owner` (the C++ object that keeps the memory alive, never a Python
// object: a tensor that outlives the Python object it came from keeps no Python instance alive)
// until the consumer's tensor is released; the memory stays valid while it is held. The layout is DLPack's ABI (DLManagedTensor, capsule name "dltensor"), one dimension of
// bytes: the consumer views it as the dtype and shape it wants.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>

namespace weft::python {

// A capsule of `num_bytes` bytes at `data` on CUDA device `device`, kept alive by `owner`.
nanobind::object device_bytes_capsule(std::uintptr_t data, std::int64_t num_bytes, int device,
                                      std::shared_ptr<const void> owner);

}  // namespace weft::python
