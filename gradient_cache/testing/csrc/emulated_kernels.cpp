// The emulated device's kernels: allocation, views and copies run here; every other
// operator goes through a boxed fallback that checks devices as CUDA does and runs the
// CPU kernel on CPU views of the same memory, so results equal the CPU's bit for bit.
#include "emulated_device.h"

#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <ATen/ops/_local_scalar_dense_ops.h>
#include <ATen/ops/convolution_backward_ops.h>
#include <ATen/ops/convolution_ops.h>
#include <ATen/ops/copy_ops.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace emu {

// ---- CPU views -----------------------------------------------------------------------

namespace {

// A CPU storage over a device storage's memory. Resizable: a CPU kernel that resizes an
// out= argument reallocates it on the CPU, and the fallback copies the result back.
c10::Storage cpu_storage_over(const c10::Storage& storage) {
  return c10::Storage(
      c10::Storage::use_byte_size_t(), storage.nbytes(),
      c10::DataPtr(storage.mutable_data(), c10::Device(c10::kCPU)), c10::GetCPUAllocator(),
      /*resizable=*/true);
}

// A read of freed memory (a storage resize_(0) and not refilled) raises rather than crash.
void check_in_bounds(const at::Tensor& t) {
  if (t.numel() == 0) {
    return;
  }
  const size_t needed = at::detail::computeStorageNbytes(
      t.sizes(), t.strides(), t.dtype().itemsize(), t.storage_offset());
  TORCH_CHECK(
      t.storage().nbytes() >= needed,
      "A tensor on the emulated device needs ", needed, " bytes of its storage, which holds ",
      t.storage().nbytes(), ": the storage was freed (resize_) and not refilled.");
}

at::Tensor tensor_over(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  t.unsafeGetTensorImpl()->_set_conj(like.is_conj());
  t.unsafeGetTensorImpl()->_set_neg(like.is_neg());
  return t;
}

} // namespace

at::Tensor cpu_view(const at::Tensor& t) {
  if (!on_device(t)) {
    return t;
  }
  check_in_bounds(t);
  return tensor_over(cpu_storage_over(t.storage()), c10::DispatchKey::CPU, t);
}

// Goes straight to the CPU kernel: nothing above it (autograd, a Python mode) sees it.
void copy_now(const at::Tensor& src, const at::Tensor& dst) {
  at::Tensor dst_view = cpu_view(dst);
  at::_ops::copy_::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), dst_view, cpu_view(src), false);
}

namespace {

// ---- allocation and views ------------------------------------------------------------

void check_options(std::optional<c10::Device> device, std::optional<c10::Layout> layout,
                   std::optional<bool> pin_memory) {
  TORCH_CHECK(
      !device.has_value() || device->index() <= 0,
      "The emulated device has one device (index 0), not ", device->index());
  TORCH_CHECK(
      c10::layout_or_default(layout) == c10::kStrided,
      "The emulated device supports strided tensors only");
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");
}

const c10::DispatchKeySet kDeviceKeys{c10::DispatchKey::PrivateUse1};

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory,
    std::optional<c10::MemoryFormat> memory_format) {
  check_options(device, layout, pin_memory);
  return at::detail::empty_generic(
      size, device_allocator(), kDeviceKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory) {
  check_options(device, layout, pin_memory);
  return at::detail::empty_strided_generic(
      size, stride, device_allocator(), kDeviceKeys, c10::dtype_or_default(dtype));
}

// A view: a new TensorImpl over self's storage.
at::Tensor make_view(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                     int64_t storage_offset) {
  auto view = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(self.storage()), self.key_set(), self.dtype());
  at::native::setStrided(view, size, stride, storage_offset);
  return view;
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return make_view(self, size, stride, storage_offset.value_or(self.storage_offset()));
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  const auto inferred = at::infer_size_dv(size, self.numel());
  const auto stride = at::detail::computeStride(self.sizes(), self.strides(), inferred);
  TORCH_CHECK(
      stride.has_value(),
      "view size is not compatible with input tensor's size and stride (at least one "
      "dimension spans across two contiguous subspaces). Use .reshape(...) instead.");
  return make_view(self, inferred, *stride, self.storage_offset());
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return make_view(self, size, stride, self.storage_offset());
}

void grow_storage_for(const at::Tensor& self) {
  const size_t needed = at::detail::computeStorageNbytes(
      self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
  if (needed > self.storage().nbytes()) {
    resize_bytes(self.storage().unsafeGetStorageImpl(), needed);
  }
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  if (self.sizes() != size) {
    impl->set_sizes_contiguous(size);
  }
  if (memory_format.has_value()) {
    TORCH_CHECK(
        *memory_format != c10::MemoryFormat::Preserve,
        "Unsupported memory format ", *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  grow_storage_for(self);
  return self;
}

at::Tensor& set_storage_offset_(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                                c10::IntArrayRef size, c10::IntArrayRef stride) {
  at::native::checkSetStorage(self, source, storage_offset, size, stride);
  auto* impl = self.unsafeGetTensorImpl();
  if (stride.data() != nullptr) {
    impl->set_sizes_and_strides(size, stride, storage_offset);
  } else {
    impl->set_sizes_contiguous(size);
    impl->set_storage_offset(storage_offset);
  }
  grow_storage_for(self);
  return self;
}

at::Tensor& set_storage_(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_offset_(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_tensor_(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) {
    return self;
  }
  return set_storage_offset_(self, source.storage(), source.storage_offset(), source.sizes(),
                             source.strides());
}

at::Tensor& set_empty_(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, device_allocator(), true);
  return set_storage_offset_(self, std::move(storage), 0, {0}, {});
}

// ---- copies ----------------------------------------------------------------------------

bool on_pinned_host(const at::Tensor& t) {
  return t.is_cpu() && is_pinned(t.storage().data());
}

// On CUDA these copies return before the bytes move: device to device, and between the
// device and pinned host memory.
bool asynchronous(const at::Tensor& src, const at::Tensor& dst) {
  return (on_device(src) && (on_device(dst) || on_pinned_host(dst))) ||
      (on_pinned_host(src) && on_device(dst));
}

at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  for (const at::Tensor* t : {&src, &dst}) {
    TORCH_CHECK(
        on_device(*t) || t->is_cpu(),
        "The emulated device copies to and from the CPU only, not ", t->device());
  }
  if (dst.numel() == 0) {
    return dst;
  }
  if (non_blocking && asynchronous(src, dst)) {
    enqueue_copy(src, dst);
    return dst;
  }
  land_current_stream(); // a blocking copy orders after the stream's pending copies
  copy_now(src, dst);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& src, const at::Tensor& dst) {
  resize_(dst, src.sizes(), std::nullopt);
  return copy_from(src, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  land_current_stream(); // .item() reads on the host after the stream's work
  return at::_ops::_local_scalar_dense::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), cpu_view(self));
}

void record_stream(at::Tensor& self, c10::Stream /*stream*/) {
  // A pending copy holds its tensors until it lands; recorded, a dropped destination is not
  // flagged when its copy lands (a GPU would hold the block back for that stream).
  if (on_device(self)) {
    record_use_on_stream(self.storage().data_ptr());
  }
}

// `param.data = tensor` across the CPU and this device: allowed as between the CPU and
// CUDA (stock PyTorch lists only its own dense backends as compatible).
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  const auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || on_device(t));
  };
  if (dense(self) && dense(from)) {
    return true;
  }
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// A new tensor on the device with a CPU tensor's values (and its strides where dense).
at::Tensor copy_to_device(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  at::Tensor out = t.is_non_overlapping_and_dense()
      ? empty_strided(t.sizes(), t.strides(), t.scalar_type(), std::nullopt, std::nullopt,
                      std::nullopt)
      : empty_memory_format(t.sizes(), t.scalar_type(), std::nullopt, std::nullopt,
                            std::nullopt, std::nullopt);
  copy_now(t, out);
  out.unsafeGetTensorImpl()->_set_conj(t.is_conj());
  out.unsafeGetTensorImpl()->_set_neg(t.is_neg());
  return out;
}

// ---- convolutions ----------------------------------------------------------------------

// A backend without its own convolution gets `convolution_overrideable`: run the CPU's
// convolution (which picks the CPU's algorithm, as a CPU run would) on CPU views.
at::Tensor convolution_overrideable(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
    bool transposed, c10::IntArrayRef output_padding, int64_t groups) {
  land_current_stream();
  const std::optional<at::Tensor> cpu_bias =
      bias.has_value() ? std::optional<at::Tensor>(cpu_view(*bias)) : std::nullopt;
  return copy_to_device(at::_ops::convolution::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), cpu_view(input), cpu_view(weight), cpu_bias,
      c10::fromIntArrayRefSlow(stride), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(dilation), transposed, c10::fromIntArrayRefSlow(output_padding),
      groups));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
    bool transposed, c10::IntArrayRef output_padding, int64_t groups,
    std::array<bool, 3> output_mask) {
  land_current_stream();
  // The CPU's kernels compute the bias gradient themselves: give them the bias's size.
  const int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
  const std::vector<int64_t> bias_sizes{channels};
  auto [grad_input, grad_weight, grad_bias] = at::_ops::convolution_backward::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), cpu_view(grad_output), cpu_view(input),
      cpu_view(weight),
      output_mask[2] ? at::OptionalSymIntArrayRef(c10::fromIntArrayRefSlow(bias_sizes))
                     : std::nullopt,
      c10::fromIntArrayRefSlow(stride), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(dilation), transposed, c10::fromIntArrayRefSlow(output_padding),
      groups, output_mask);
  return {copy_to_device(grad_input), copy_to_device(grad_weight), copy_to_device(grad_bias)};
}

// ---- attention ---------------------------------------------------------------------------

// scaled_dot_product_attention picks its kernel through a dispatch stub, not an operator:
// with no entry for this device it would take the math path, whose bits differ from the
// CPU's. Make the CPU's choice; the chosen CPU kernel then runs through the fallback.
int64_t sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  const std::optional<at::Tensor> cpu_mask =
      mask.has_value() ? std::optional<at::Tensor>(cpu_view(*mask)) : std::nullopt;
  return at::_ops::_fused_sdp_choice::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), cpu_view(query), cpu_view(key),
      cpu_view(value), cpu_mask, dropout_p, is_causal, scale, enable_gqa);
}

// ---- the boxed fallback --------------------------------------------------------------

// Which device tensors an operator may mix with, as on CUDA: 0-dim CPU tensors (scalars)
// anywhere, CPU tensors as indices (lists of optional tensors).
void check_devices(const c10::OperatorHandle& op, const torch::jit::Stack& args) {
  bool any_on_device = false;
  const at::Tensor* stranger = nullptr;
  const auto visit = [&](const at::Tensor& t, bool index) {
    if (!t.defined()) {
      return;
    }
    if (on_device(t)) {
      any_on_device = true;
    } else if (stranger == nullptr && !(t.is_cpu() && (t.dim() == 0 || index))) {
      stranger = &t;
    }
  };
  for (const auto& value : args) {
    if (value.isTensor()) {
      visit(value.toTensor(), false);
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) {
        visit(t, false);
      }
    } else if (value.isOptionalTensorList()) {
      for (const auto& t : value.toOptionalTensorVector()) {
        if (t.has_value()) {
          visit(*t, true);
        }
      }
    }
  }
  TORCH_CHECK(
      !any_on_device || stranger == nullptr,
      "Expected all tensors to be on the same device, but found at least two devices, ",
      device(), " and ", stranger->device(), "! (when checking arguments for ",
      op.schema().name(), ")");
}

// The CPU views given to a CPU kernel: one CPU storage per device storage (so the
// kernel's overlap checks see aliasing), and each tensor with its view.
struct Views {
  std::vector<std::pair<c10::Storage, c10::Storage>> storages; // device, CPU
  std::vector<std::pair<at::Tensor, at::Tensor>> tensors; // device, CPU

  at::Tensor view_of(const at::Tensor& t) {
    if (!on_device(t)) {
      return t;
    }
    check_in_bounds(t);
    const c10::Storage* cpu = nullptr;
    for (const auto& [device_storage, cpu_storage] : storages) {
      if (device_storage.is_alias_of(t.storage())) {
        cpu = &cpu_storage;
      }
    }
    if (cpu == nullptr) {
      storages.emplace_back(t.storage(), cpu_storage_over(t.storage()));
      cpu = &storages.back().second;
    }
    at::Tensor view = tensor_over(*cpu, c10::DispatchKey::CPU, t);
    tensors.emplace_back(t, view);
    return view;
  }

  c10::IValue to_cpu(const c10::IValue& value) {
    if (value.isTensor()) {
      return view_of(value.toTensor());
    }
    if (value.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : value.toTensorVector()) {
        list.push_back(view_of(t));
      }
      return list;
    }
    if (value.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> list;
      for (const auto& t : value.toOptionalTensorVector()) {
        list.push_back(t.has_value() ? std::optional<at::Tensor>(view_of(*t)) : std::nullopt);
      }
      return list;
    }
    if (value.isDevice() && value.toDevice().type() == kDeviceType) {
      return c10::Device(c10::kCPU); // a factory's device= argument
    }
    return value;
  }

  // After the kernel: a CPU kernel that resized an argument reallocated its CPU storage,
  // and may have changed its sizes and strides; bring both back to the device.
  void write_back() {
    for (auto& [device_storage, cpu_storage] : storages) {
      if (cpu_storage.data() != device_storage.data()) {
        resize_bytes(device_storage.unsafeGetStorageImpl(), cpu_storage.nbytes());
        if (cpu_storage.nbytes() > 0) {
          std::memcpy(device_storage.mutable_data(), cpu_storage.data(), cpu_storage.nbytes());
        }
      }
    }
    for (auto& [t, view] : tensors) {
      if (t.sizes() != view.sizes() || t.strides() != view.strides() ||
          t.storage_offset() != view.storage_offset()) {
        t.unsafeGetTensorImpl()->set_sizes_and_strides(
            view.sizes(), view.strides(), view.storage_offset());
      }
    }
  }

  // A result on the CPU: a view of an argument's memory becomes the same view on the
  // device; a new tensor is copied to the device.
  at::Tensor to_device(const at::Tensor& t) {
    if (!t.defined() || !t.is_cpu()) {
      return t;
    }
    for (const auto& [device_storage, cpu_storage] : storages) {
      if (cpu_storage.unsafeGetStorageImpl() == t.storage().unsafeGetStorageImpl()) {
        return tensor_over(device_storage, c10::DispatchKey::PrivateUse1, t);
      }
    }
    return copy_to_device(t);
  }

  c10::IValue to_device(const c10::IValue& value) {
    if (value.isTensor()) {
      return to_device(value.toTensor());
    }
    if (value.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : value.toTensorVector()) {
        list.push_back(to_device(t));
      }
      return list;
    }
    return value;
  }
};

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(num_arguments);
  const torch::jit::Stack originals(first, stack->end());
  check_devices(op, originals);
  land_current_stream(); // stream order: the stream's pending copies land first

  Views views;
  for (size_t i = 0; i < num_arguments; ++i) {
    *(first + static_cast<std::ptrdiff_t>(i)) = views.to_cpu(originals[i]);
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  views.write_back();

  const auto& returns = schema.returns();
  const auto results = stack->end() - static_cast<std::ptrdiff_t>(returns.size());
  for (size_t i = 0; i < returns.size(); ++i) {
    c10::IValue& result = *(results + static_cast<std::ptrdiff_t>(i));
    const auto* alias = returns[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      // In-place and out= operators return the very argument they wrote.
      for (size_t j = 0; j < num_arguments; ++j) {
        const auto* argument_alias = schema.arguments()[j].alias_info();
        if (argument_alias != nullptr && argument_alias->beforeSets() == alias->beforeSets()) {
          result = originals[j];
          break;
        }
      }
      continue;
    }
    result = views.to_device(result);
  }
}

// An operator with a CPU kernel and also a composite one would take the composite here
// (a backend without a kernel of its own gets it): a math decomposition whose bits differ
// from the CPU kernel's (layer_norm, group_norm), or a structured operator's out= wrapper.
// Send every such operator to the fallback, so the CPU's own kernel runs.
void route_to_cpu_kernels(torch::Library& m) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    const auto op = dispatcher.findOp(name);
    if (name.name.rfind("aten::", 0) != 0 || !op.has_value() ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !(op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          op->hasKernelForDispatchKey(
              c10::DispatchKey::CompositeExplicitAutogradNonFunctional))) {
      continue;
    }
    const std::string overload = name.overload_name.empty() ? "" : "." + name.overload_name;
    const std::string unqualified = name.name.substr(6) + overload;
    m.impl(unqualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
}

} // namespace
} // namespace emu

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(emu::empty_memory_format));
  m.impl("empty_strided", TORCH_FN(emu::empty_strided));
  m.impl("as_strided", TORCH_FN(emu::as_strided));
  m.impl("view", TORCH_FN(emu::view));
  m.impl("_reshape_alias", TORCH_FN(emu::reshape_alias));
  m.impl("resize_", TORCH_FN(emu::resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(emu::set_storage_offset_));
  m.impl("set_.source_Storage", TORCH_FN(emu::set_storage_));
  m.impl("set_.source_Tensor", TORCH_FN(emu::set_tensor_));
  m.impl("set_", TORCH_FN(emu::set_empty_));
  m.impl("_copy_from", TORCH_FN(emu::copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(emu::copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(emu::local_scalar_dense));
  m.impl("record_stream", TORCH_FN(emu::record_stream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(emu::has_compatible_shallow_copy_type));
  m.impl("convolution_overrideable", TORCH_FN(emu::convolution_overrideable));
  m.impl("convolution_backward_overrideable", TORCH_FN(emu::convolution_backward_overrideable));
  emu::route_to_cpu_kernels(m);
}

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &emu::sdp_choice)
} // namespace at::native

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&emu::fallback>());
}
