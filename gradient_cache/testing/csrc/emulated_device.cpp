// The emulated device's runtime: streams, events and the queue of pending copies, the
// device guard and the PrivateUse1 hooks.
#include "emulated_device.h"

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>

namespace emu {
namespace {

// ---- streams, events and pending copies ----------------------------------------------

// A queued copy holds both tensors (new TensorImpls over the same storages, so a later
// change of the caller's tensor metadata does not move it) and reads its source when it
// lands, so a write into the source before the wait is caught too.
struct PendingCopy {
  uint64_t seq;
  at::Tensor src;
  at::Tensor dst;
};

struct StreamQueue {
  uint64_t enqueued = 0; // sequence number of the last copy queued
  uint64_t landed = 0; // sequence number of the last copy landed
  std::deque<PendingCopy> pending;
};

struct EventState {
  c10::StreamId stream = 0;
  uint64_t seq = 0; // the stream's `enqueued` when the event was recorded
  std::chrono::steady_clock::time_point time;
};

// Recursive: a landing copy runs a CPU kernel, which must not deadlock should it come
// back here (it should not, but a Python dispatch mode may be active).
std::recursive_mutex& queue_mutex() {
  static auto* mutex = new std::recursive_mutex();
  return *mutex;
}

std::map<c10::StreamId, StreamQueue>& queues() {
  static auto* map = new std::map<c10::StreamId, StreamQueue>();
  return *map;
}

thread_local c10::StreamId tls_current_stream = 0;
std::atomic<c10::StreamId> next_stream_id{1};

c10::Stream make_stream(c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, device(), id);
}

// A tensor with its own TensorImpl over t's storage and t's metadata.
at::Tensor shallow_alias(const at::Tensor& t) {
  const auto key = on_device(t) ? c10::DispatchKey::PrivateUse1 : c10::DispatchKey::CPU;
  auto alias = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(t.storage()), c10::DispatchKeySet(key), t.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  alias.unsafeGetTensorImpl()->_set_conj(t.is_conj());
  alias.unsafeGetTensorImpl()->_set_neg(t.is_neg());
  return alias;
}

void check_storage_holds(const at::Tensor& t, const char* role) {
  const size_t needed = at::detail::computeStorageNbytes(
      t.sizes(), t.strides(), t.dtype().itemsize(), t.storage_offset());
  TORCH_CHECK(
      t.storage().nbytes() >= needed,
      "A non_blocking copy landed while its ", role, " storage holds ", t.storage().nbytes(),
      " bytes (it needs ", needed, "): the storage was freed (resize_) while the copy was "
      "pending, which a GPU would not report. Wait for the copy (event or stream) first.");
}

// A copy into device memory that only the queue still holds: its tensor was dropped before
// the copy was waited for. On a GPU the caching allocator hands that block on to the next
// allocation of the stream it was made on, which a copy on another stream may then
// overwrite. A copy on the stream that made the block, or a block `record_stream` named, is
// ordered before its reuse, and is not flagged.
void check_destination_kept(const at::Tensor& dst, c10::StreamId stream) {
  TORCH_CHECK(
      !on_device(dst) || dst.storage().use_count() > 1 ||
          reuse_ordered_after(dst.storage().data_ptr(), stream),
      "A non_blocking copy on stream ", stream, " landed in device memory that nothing else "
      "holds: its tensor was dropped while the copy was pending, and on a GPU the caching "
      "allocator would hand that memory on to the next allocation on another stream. Make the "
      "current stream wait for the copy (wait_stream / wait_event) before dropping it.");
}

// Lands the copies of `stream` up to and including sequence number `seq`, in order.
void land_until(c10::StreamId stream, uint64_t seq) {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex());
  auto found = queues().find(stream);
  if (found == queues().end()) {
    return;
  }
  StreamQueue& queue = found->second;
  while (!queue.pending.empty() && queue.pending.front().seq <= seq) {
    PendingCopy copy = std::move(queue.pending.front());
    queue.pending.pop_front();
    queue.landed = copy.seq;
    check_storage_holds(copy.dst, "destination");
    check_storage_holds(copy.src, "source");
    check_destination_kept(copy.dst, stream);
    copy_now(copy.src, copy.dst);
  }
}

void land_all() {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex());
  for (auto& entry : queues()) {
    land_until(entry.first, std::numeric_limits<uint64_t>::max());
  }
}

bool stream_idle(c10::StreamId stream) {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex());
  auto found = queues().find(stream);
  return found == queues().end() || found->second.pending.empty();
}

// Raises if a copy still pending (on any stream) reads or writes `storage`.
void check_nothing_pending_on(const c10::StorageImpl* storage) {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex());
  for (const auto& [stream, queue] : queues()) {
    for (const auto& copy : queue.pending) {
      const bool writes = copy.dst.storage().unsafeGetStorageImpl() == storage;
      const bool reads = copy.src.storage().unsafeGetStorageImpl() == storage;
      TORCH_CHECK(
          !writes && !reads,
          "resize_ of a storage that a pending non_blocking copy on stream ", stream,
          writes ? " writes into" : " reads from",
          ": on a GPU the copy would use freed memory. Make the current stream wait for "
          "that copy (wait_stream / wait_event) or synchronize before freeing it.");
    }
  }
}

// ---- the device guard: one device, thread-local current streams, events --------------

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kDeviceType;
  }

  static void check_index(c10::Device d) {
    TORCH_CHECK(
        d.index() <= 0, "The emulated device has one device (index 0), not ", d.index());
  }

  c10::Device exchangeDevice(c10::Device d) const override {
    check_index(d);
    return device();
  }

  c10::Device getDevice() const override {
    return device();
  }

  void setDevice(c10::Device d) const override {
    check_index(d);
  }

  void uncheckedSetDevice(c10::Device /*d*/) const noexcept override {}

  c10::Stream getStream(c10::Device /*d*/) const override {
    return make_stream(tls_current_stream);
  }

  c10::Stream getDefaultStream(c10::Device /*d*/) const override {
    return make_stream(0);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device /*d*/, bool /*high*/) const override {
    return make_stream(next_stream_id++);
  }

  c10::Stream getNewStream(c10::Device /*d*/, int /*priority*/) const override {
    return make_stream(next_stream_id++);
  }

  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::StreamId previous = tls_current_stream;
    tls_current_stream = s.id();
    return make_stream(previous);
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*d*/) const noexcept override {
    delete static_cast<EventState*>(event);
  }

  void record(
      void** event,
      const c10::Stream& stream,
      const c10::DeviceIndex /*d*/,
      const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) {
      *event = new EventState();
    }
    auto* state = static_cast<EventState*>(*event);
    std::lock_guard<std::recursive_mutex> lock(queue_mutex());
    state->stream = stream.id();
    state->seq = queues()[stream.id()].enqueued;
    state->time = std::chrono::steady_clock::now();
  }

  // A stream that waits on an event orders after the copies before it: land them now.
  void block(void* event, const c10::Stream& /*stream*/) const override {
    if (event != nullptr) {
      auto* state = static_cast<EventState*>(event);
      land_until(state->stream, state->seq);
    }
  }

  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;
    }
    auto* state = static_cast<EventState*>(event);
    std::lock_guard<std::recursive_mutex> lock(queue_mutex());
    return queues()[state->stream].landed >= state->seq;
  }

  void synchronizeEvent(void* event) const override {
    block(event, make_stream(0));
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }

  bool queryStream(const c10::Stream& stream) const override {
    return stream_idle(stream.id());
  }

  void synchronizeStream(const c10::Stream& stream) const override {
    land_until(stream.id(), std::numeric_limits<uint64_t>::max());
  }

  void synchronizeDevice(const c10::DeviceIndex /*d*/) const override {
    land_all();
  }

  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& /*s*/) const override {
    record_use_on_stream(p);
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*d*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "Both events must be recorded.");
    const auto span = static_cast<EventState*>(end)->time - static_cast<EventState*>(start)->time;
    return std::chrono::duration<double, std::milli>(span).count();
  }
};

// ---- PrivateUse1 hooks ---------------------------------------------------------------

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex /*d*/) const override {
    return true;
  }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override {
    return 1;
  }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    Guard::check_index(c10::Device(kDeviceType, d));
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return 0;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    Guard::check_index(c10::Device(kDeviceType, d));
    return 0;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex /*d*/) const override {
    return 0;
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }
  c10::Device getDeviceFromPtr(void* /*data*/) const override {
    return device();
  }
  // Storage.resize_ (FSDP2 frees and refills parameters this way).
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_bytes(storage.unsafeGetStorageImpl(), nbytes);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

const bool registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

int64_t pending_copies() {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex());
  int64_t count = 0;
  for (const auto& entry : queues()) {
    count += static_cast<int64_t>(entry.second.pending.size());
  }
  return count;
}

} // namespace

c10::StreamId current_stream() {
  return tls_current_stream;
}

void enqueue_copy(const at::Tensor& src, const at::Tensor& dst) {
  std::lock_guard<std::recursive_mutex> lock(queue_mutex());
  StreamQueue& queue = queues()[tls_current_stream];
  queue.enqueued += 1;
  queue.pending.push_back(PendingCopy{queue.enqueued, shallow_alias(src), shallow_alias(dst)});
}

void land_current_stream() {
  land_until(tls_current_stream, std::numeric_limits<uint64_t>::max());
}

void resize_bytes(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  // Stream order makes the current stream's own copies safe: they land first.
  land_current_stream();
  check_nothing_pending_on(storage);
  c10::DataPtr fresh = device_allocator()->allocate(nbytes);
  const size_t common = std::min(nbytes, storage->nbytes());
  if (common > 0) {
    std::memcpy(fresh.get(), storage->data(), common);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

} // namespace emu

TORCH_LIBRARY(gradient_cache_emu, m) {
  m.def("set_capacity(int capacity) -> ()", &emu::set_capacity);
  m.def("capacity() -> int", &emu::capacity);
  m.def("pending_copies() -> int", &emu::pending_copies);
}
