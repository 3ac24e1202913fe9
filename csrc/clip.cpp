// Host side of clip_factor_ (contract: clip.h): the checks, the CPU kernel, and the kernels of the
// CPU key and of the CUDA key in a CPU-only build.  The CUDA kernel is csrc/cuda/clip_cuda.cu.
#include "clip.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "ops.h"
#include "unscale.h"

namespace ampfused {

namespace {

void check_output(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_TYPE(t.defined(), name, " is undefined (None); pass a one-element float32 tensor");
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided, name,
                              " must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat, name,
              " must be a one-element float32 tensor (e.g. torch.empty(())), got ", t.scalar_type(),
              " of shape ", t.sizes());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but grad_stats is on ", device,
              "; allocate it on the device of the table");
}

}  // namespace

ClipParams clip_params(const at::Tensor& grad_stats, const std::optional<at::Tensor>& state,
                       const at::Tensor& total_norm, const at::Tensor& factor, double max_norm,
                       double norm_type) {
  TORCH_CHECK_TYPE(grad_stats.defined(),
                   "grad_stats is undefined (None); pass the table scaler_pass_ wrote");
  TORCH_CHECK_NOT_IMPLEMENTED(grad_stats.layout() == at::kStrided,
                              "grad_stats must be a dense (strided) tensor, got ",
                              grad_stats.layout());
  TORCH_CHECK(grad_stats.scalar_type() == at::kDouble && grad_stats.dim() == 2 &&
                  grad_stats.size(0) >= 1 && grad_stats.size(1) == kStatFields &&
                  grad_stats.is_contiguous(),
              "grad_stats must be the contiguous float64 [rows, ", int{kStatFields},
              "] table scaler_pass_ wrote (a header row, then the item rows), got ",
              grad_stats.scalar_type(), " of shape ", grad_stats.sizes());
  const at::Device device = grad_stats.device();
  check_output(total_norm, "total_norm", device);
  check_output(factor, "factor", device);
  const bool unscale = state.has_value() && state->defined();
  if (unscale) check_scaler_state(*state, "state", device, "grad_stats");
  TORCH_CHECK_NOT_IMPLEMENTED(
      norm_type == 2.0 || norm_type == INFINITY, "clip_factor_ computes norm_type 2 or inf, got ",
      norm_type, "; GradScaler.clip_grad_norm_ takes other norms through torch's clip_grad_norm_");
  ClipParams p;
  p.rows = grad_stats.const_data_ptr<double>() + kStatFields;
  p.num_rows = grad_stats.size(0) - 1;
  if (unscale) {
    p.scale = reinterpret_cast<const float*>(state->const_data_ptr<int32_t>() + kStateScale);
  }
  p.max_norm = static_cast<float>(max_norm);
  p.norm = norm_type == 2.0 ? kClipNorm2 : kClipNormInf;
  p.total_norm = total_norm.mutable_data_ptr<float>();
  p.factor = factor.mutable_data_ptr<float>();
  return p;
}

void launch_clip_cpu(const ClipParams& p, const at::Tensor&) {
  clip_finish(stat_total_rows(p.rows, p.num_rows), p);
}

namespace {

[[maybe_unused]] void launch_clip_without_cuda(const ClipParams&, const at::Tensor& on_device) {
  refuse_without_cuda(on_device.device());
}

// The checks raise before this could run: some argument is sparse.
void launch_clip_rejected(const ClipParams&, const at::Tensor&) {
  TORCH_INTERNAL_ASSERT(false, "clip_factor_: a sparse argument passed the layout checks");
}

}  // namespace
}  // namespace ampfused

TORCH_LIBRARY_IMPL(ampfused, CPU, m) {
  m.impl(ampfused::ops::clip_factor_::kName,
         &ampfused::clip_factor_kernel<ampfused::launch_clip_cpu>);
}

// A sparse argument routes the call to a sparse key: the checks reject it there, naming it.
TORCH_LIBRARY_IMPL(ampfused, SparseCPU, m) {
  m.impl(ampfused::ops::clip_factor_::kName,
         &ampfused::clip_factor_kernel<ampfused::launch_clip_rejected>);
}
TORCH_LIBRARY_IMPL(ampfused, SparseCUDA, m) {
  m.impl(ampfused::ops::clip_factor_::kName,
         &ampfused::clip_factor_kernel<ampfused::launch_clip_rejected>);
}

#ifndef AMPFUSED_WITH_CUDA
TORCH_LIBRARY_IMPL(ampfused, CUDA, m) {
  m.impl(ampfused::ops::clip_factor_::kName,
         &ampfused::clip_factor_kernel<ampfused::launch_clip_without_cuda>);
}
#endif
