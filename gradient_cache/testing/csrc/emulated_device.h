// The emulated device's shared declarations: an accelerator that lives in host RAM,
// registered as PyTorch's PrivateUse1 backend (named "emu" from Python).
//
// emulated_memory.cpp: the device's memory (counted, capped) and pinned host memory.
// emulated_device.cpp: streams, events, the queue of pending copies, the device guard and
//   the PrivateUse1 hooks.
// emulated_kernels.cpp: the few kernels that must know the device (allocation, views,
//   copies) and the boxed fallback that runs every other operator on the CPU.
// emulated_autocast.cpp: autocast's cast policies (CUDA's lists).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>
#include <c10/core/StorageImpl.h>

namespace emu {

constexpr c10::DeviceType kDeviceType = c10::DeviceType::PrivateUse1;

inline c10::Device device() {
  return c10::Device(kDeviceType, 0);
}

inline bool on_device(const at::Tensor& t) {
  return t.defined() && t.device().type() == kDeviceType;
}

c10::Allocator* device_allocator();
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr); // inside a live pinned block (a view's pointer counts)
void set_capacity(int64_t capacity); // bytes; -1: unlimited
int64_t capacity();

// The stream current on this thread (thread-local, as CUDA's).
c10::StreamId current_stream();

// Whether a GPU's caching allocator would hand a device block on to another allocation only
// after `stream`'s work: the block was made on `stream`, or `record_stream` named it (to
// any stream: not told apart here). Device blocks only (a DataPtr of `device_allocator()`).
bool reuse_ordered_after(const c10::DataPtr& data, c10::StreamId stream);
void record_use_on_stream(const c10::DataPtr& data); // `Tensor.record_stream`

// Pending copies. A non_blocking copy is queued on the current stream and runs ("lands")
// only when something orders after it; until then its destination keeps its old bytes.
void enqueue_copy(const at::Tensor& src, const at::Tensor& dst);
void land_current_stream();

// Runs a copy now, on CPU views of the same memory.
void copy_now(const at::Tensor& src, const at::Tensor& dst);

// A CPU tensor over the same memory as an emulated tensor (CPU tensors pass through).
at::Tensor cpu_view(const at::Tensor& t);

// Reallocates a storage of the emulated device to `nbytes`, keeping the common prefix.
void resize_bytes(c10::StorageImpl* storage, size_t nbytes);

} // namespace emu
