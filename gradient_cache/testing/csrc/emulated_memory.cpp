// The emulated device's memory: its own (host RAM, counted and capped) and the pinned host
// memory its non_blocking copies know.
#include "emulated_device.h"

#include <atomic>

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>

namespace emu {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;

// ---- device memory -------------------------------------------------------------------

// Host RAM, counted and capped. No caching: each tensor's bytes are allocated and freed
// as it lives, so `allocated` is what live tensors hold (CUDA's memory_allocated()).
// A device allocation: its memory, the stream current when it was made (a GPU's caching
// allocator hands a freed block on to that stream's next allocation) and whether
// `record_stream` named it to another stream (the hand-on then waits for that stream).
struct DeviceBlock {
  void* ptr;
  size_t nbytes;
  c10::StreamId stream;
  std::atomic<bool> recorded{false};
};

class DeviceMemory final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const int64_t allocated = stats_.allocated_bytes[0].current;
      if (capacity_ >= 0 && allocated + static_cast<int64_t>(nbytes) > capacity_) {
        stats_.num_ooms += 1;
        TORCH_CHECK_WITH(
            OutOfMemoryError, false,
            "Emulated device out of memory: tried to allocate ", nbytes, " bytes with ",
            allocated, " bytes allocated and a capacity of ", capacity_, " bytes.");
      }
      count(nbytes, /*allocating=*/true);
    }
    void* ptr = nullptr;
    if (nbytes > 0) {
      try {
        ptr = c10::alloc_cpu(nbytes);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        count(nbytes, /*allocating=*/false);
        throw;
      }
      // Bytes nothing wrote read as NaN (0xFF...), so a read before a copy lands shows.
      std::memset(ptr, 0xFF, nbytes);
    }
    return {ptr, new DeviceBlock{ptr, nbytes, current_stream()}, &DeviceMemory::release, device()};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr; // the context (a DeviceBlock) is not the data pointer
  }

  void copy_data(void* dst, const void* src, std::size_t count) const override {
    std::memcpy(dst, src, count);
  }

  bool initialized() override {
    return true;
  }

  void emptyCache(c10::MempoolId_t /*pool*/) override {}

  void recordStream(const c10::DataPtr& ptr, c10::Stream /*stream*/) override {
    record_use_on_stream(ptr);
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex /*d*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void resetAccumulatedStats(c10::DeviceIndex /*d*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat([](Stat& stat) { stat.reset_accumulated(); });
    stats_.num_ooms = 0;
    stats_.num_device_alloc = 0;
    stats_.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex /*d*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for_each_stat([](Stat& stat) { stat.reset_peak(); });
  }

  // (free, total): the cap, or the host's RAM when uncapped, less what is allocated. The
  // host's other use of its RAM is not this device's: a GPU's memory in use outside its
  // allocator (free = total - allocated - outside) is none here, capped or not.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex /*d*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t allocated = stats_.allocated_bytes[0].current;
    int64_t total = capacity_;
    if (total < 0) {
      total = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
    }
    return {static_cast<size_t>(std::max<int64_t>(total - allocated, 0)),
            static_cast<size_t>(total)};
  }

  void set_capacity(int64_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    capacity_ = capacity;
  }

  int64_t capacity() {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
  }

 private:
  static void release(void* context);

  // Every pool counts the same bytes: there is no cache, so reserved == allocated.
  void count(size_t nbytes, bool allocating) {
    const auto pool = nbytes >= (1 << 20) ? StatType::LARGE_POOL : StatType::SMALL_POOL;
    for (auto type : {StatType::AGGREGATE, pool}) {
      const auto i = static_cast<size_t>(type);
      for (Stat* stat : {&stats_.allocated_bytes[i], &stats_.reserved_bytes[i],
                         &stats_.active_bytes[i], &stats_.requested_bytes[i]}) {
        allocating ? stat->increase(nbytes) : stat->decrease(nbytes);
      }
      for (Stat* stat : {&stats_.allocation[i], &stats_.segment[i], &stats_.active[i]}) {
        allocating ? stat->increase(1) : stat->decrease(1);
      }
    }
    allocating ? ++stats_.num_device_alloc : ++stats_.num_device_free;
  }

  template <typename F>
  void for_each_stat(F f) {
    for (auto* array : {&stats_.allocation, &stats_.segment, &stats_.active,
                        &stats_.inactive_split, &stats_.allocated_bytes,
                        &stats_.reserved_bytes, &stats_.active_bytes,
                        &stats_.inactive_split_bytes, &stats_.requested_bytes}) {
      for (Stat& stat : *array) {
        f(stat);
      }
    }
  }

  std::mutex mutex_;
  int64_t capacity_ = -1; // -1: unlimited
  c10::CachingDeviceAllocator::DeviceStats stats_;
};

// Leaked on purpose: tensors may be freed after static destructors have run.
DeviceMemory& device_memory() {
  static auto* memory = new DeviceMemory();
  return *memory;
}

void DeviceMemory::release(void* context) {
  auto* block = static_cast<DeviceBlock*>(context);
  if (block->ptr != nullptr) {
    c10::free_cpu(block->ptr);
  }
  {
    auto& memory = device_memory();
    std::lock_guard<std::mutex> lock(memory.mutex_);
    memory.count(block->nbytes, /*allocating=*/false);
  }
  delete block;
}

// ---- pinned host memory --------------------------------------------------------------

// Page-locking is meaningless here; what matters is that pinned tensors are known, so a
// non_blocking copy to or from them is queued (as on CUDA) and one from pageable memory
// is not.
class PinnedMemory final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes > 0 ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[reinterpret_cast<uintptr_t>(ptr)] = nbytes;
      stats_.allocations.increase(1);
      stats_.allocated_bytes.increase(nbytes);
      stats_.active_requests.increase(1);
      stats_.active_bytes.increase(nbytes);
      stats_.num_host_alloc += 1;
    }
    return {ptr, ptr, &PinnedMemory::release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &PinnedMemory::release;
  }

  void copy_data(void* dst, const void* src, std::size_t count) const override {
    std::memcpy(dst, src, count);
  }

  // Whether ptr falls inside a live pinned block (a view's pointer may not be its start).
  bool contains(const void* ptr) {
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.upper_bound(address);
    if (it == blocks_.begin()) {
      return false;
    }
    --it;
    return address < it->first + it->second;
  }

  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override {
    return true; // nothing to record: a pending copy holds its tensors until it lands
  }

  void empty_cache() override {}

  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Stat* stat : {&stats_.allocations, &stats_.allocated_bytes,
                       &stats_.active_requests, &stats_.active_bytes}) {
      stat->reset_accumulated();
    }
  }

  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Stat* stat : {&stats_.allocations, &stats_.allocated_bytes,
                       &stats_.active_requests, &stats_.active_bytes}) {
      stat->reset_peak();
    }
  }

 private:
  static void release(void* ptr);

  std::mutex mutex_;
  std::map<uintptr_t, size_t> blocks_; // start -> size
  at::HostStats stats_;
};

PinnedMemory& pinned_memory() {
  static auto* memory = new PinnedMemory();
  return *memory;
}

void PinnedMemory::release(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  auto& memory = pinned_memory();
  {
    std::lock_guard<std::mutex> lock(memory.mutex_);
    auto it = memory.blocks_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != memory.blocks_.end()) {
      for (Stat* stat : {&memory.stats_.allocated_bytes, &memory.stats_.active_bytes}) {
        stat->decrease(it->second);
      }
      for (Stat* stat : {&memory.stats_.allocations, &memory.stats_.active_requests}) {
        stat->decrease(1);
      }
      memory.stats_.num_host_free += 1;
      memory.blocks_.erase(it);
    }
  }
  c10::free_cpu(ptr);
}

} // namespace

bool reuse_ordered_after(const c10::DataPtr& data, c10::StreamId stream) {
  const auto* block = static_cast<const DeviceBlock*>(data.get_context());
  return block == nullptr || block->stream == stream || block->recorded.load();
}

void record_use_on_stream(const c10::DataPtr& data) {
  auto* block = static_cast<DeviceBlock*>(data.get_context());
  if (block != nullptr) {
    block->recorded.store(true);
  }
}

c10::Allocator* device_allocator() {
  return &device_memory();
}

c10::Allocator* pinned_allocator() {
  return &pinned_memory();
}

bool is_pinned(const void* ptr) {
  return ptr != nullptr && pinned_memory().contains(ptr);
}

void set_capacity(int64_t capacity) {
  device_memory().set_capacity(capacity);
}

int64_t capacity() {
  return device_memory().capacity();
}

namespace {
const bool registered = [] {
  c10::SetAllocator(kDeviceType, &device_memory());
  at::setHostAllocator(kDeviceType, &pinned_memory());
  return true;
}();
} // namespace

} // namespace emu
