// Autocast on the emulated device: CUDA's cast policies (ATen's shared op lists), so
// torch.autocast("emu", dtype=...) casts what CUDA casts, and its weight cache keeps one
// cast copy of a leaf weight until the autocast region ends, as on CUDA. A file of its
// own: ATen/autocast_mode.h is heavy, and two files build in parallel.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

// The op lists name ATen's types unqualified: register from inside namespace at.
namespace at {
namespace {

#define EMU_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define EMU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define EMU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define EMU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  // Operators with no policy run as they are (autocast's key is skipped).
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(EMU_LOWER_PRECISION_FP)
  AT_FORALL_FP32(EMU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(EMU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(EMU_PROMOTE)
}

} // namespace
} // namespace at
