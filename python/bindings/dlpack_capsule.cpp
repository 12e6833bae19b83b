#include "dlpack_capsule.hpp"

#include <Python.h>

#include <utility>

namespace nb = nanobind;

namespace weft::python {
namespace {

// DLPack's ABI (dlpack.h, version 0.8 / 1.0 unversioned tensor), declared here for the one type
// this module exports.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr int32_t kDLCUDA = 2;
constexpr uint8_t kDLUInt = 1;

struct Managed {
  DLManagedTensor tensor{};
  int64_t shape[1]{};
  std::shared_ptr<const void> owner;
};

void delete_managed(DLManagedTensor* self) {
  // The consumer may release its tensor on any thread, with or without the GIL: nothing here
  // touches Python.
  delete static_cast<Managed*>(self->manager_ctx);
}

void capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and then owns the tensor; an unconsumed
  // capsule still owns it.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    tensor->deleter(tensor);
  }
}

}  // namespace

nb::object device_bytes_capsule(std::uintptr_t data, std::int64_t num_bytes, int device,
                                std::shared_ptr<const void> owner) {
  auto* managed = new Managed;
  managed->shape[0] = num_bytes;
  managed->owner = std::move(owner);
  DLTensor& t = managed->tensor.dl_tensor;
  t.data = reinterpret_cast<void*>(data);
  t.device = {kDLCUDA, device};
  t.ndim = 1;
  t.dtype = {kDLUInt, 8, 1};
  t.shape = managed->shape;
  t.strides = nullptr;  // compact
  t.byte_offset = 0;
  managed->tensor.manager_ctx = managed;
  managed->tensor.deleter = delete_managed;
  PyObject* capsule = PyCapsule_New(&managed->tensor, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    delete_managed(&managed->tensor);
    throw nb::python_error();
  }
  return nb::steal(capsule);
}

}  // namespace weft::python
