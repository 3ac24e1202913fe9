// The clip op: the total gradient norm and the clip factor from a pass's statistics table.
//
//   ampfused::clip_factor_(Tensor grad_stats, Tensor? state, Tensor(a!) total_norm,
//                          Tensor(b!) factor, float max_norm, float norm_type) -> ()
//     grad_stats is a table scaler_pass_ wrote (unscale.h): float64 [1 + items, kStatFields],
//     row 0 the header, then one row per work item.  From its item rows, reduced in the order of
//     clip_math.h (kTotalLanes lanes of rows, then a pairwise tree; float64 sums):
//       total_norm = float32(the norm of order norm_type of every unscaled element of the pass):
//                    2: sqrt(sum of the rows' sum_squares); inf: NaN if an element was NaN, inf
//                    if one was inf, else the largest finite magnitude.
//       factor     = inv * clamp((1 / (total_norm + 1e-6)) * max_norm, max=1), in float32, each
//                    step rounded (torch's clip_coef; NaN stays NaN), inv = float32(1 / float64
//                    (scale)) for the scale in `state` (the scaler's int32 state, ScalerState),
//                    or 1 when state is None.
//     Multiplying the gradients the table was made from by factor unscales and clips them in one
//     pass (ampfused.GradScaler.clip_grad_norm_).  One tiny kernel on CUDA, no host sync.
//
// Requirements (checked, naming the argument): grad_stats a contiguous float64 2-D tensor with
// kStatFields columns and at least the header row; total_norm and factor 1-element float32
// tensors and state a scaler state, all on grad_stats's device; norm_type 2 or inf
// (NotImplementedError otherwise: other norms are not in the table).  Nothing is written before
// every check passed.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>

#include "clip_math.h"

namespace ampfused {

using ClipLaunchFn = void (*)(const ClipParams& params, const at::Tensor& on_device);
void launch_clip_cpu(const ClipParams& params, const at::Tensor& on_device);
#ifdef AMPFUSED_WITH_CUDA
void launch_clip_cuda(const ClipParams& params, const at::Tensor& on_device);
#endif

// The op's checks and ClipParams (clip.cpp), shared by every backend's kernel.
ClipParams clip_params(const at::Tensor& grad_stats, const std::optional<at::Tensor>& state,
                       const at::Tensor& total_norm, const at::Tensor& factor, double max_norm,
                       double norm_type);

template <ClipLaunchFn Launch>
void clip_factor_kernel(const at::Tensor& grad_stats, const std::optional<at::Tensor>& state,
                        const at::Tensor& total_norm, const at::Tensor& factor, double max_norm,
                        double norm_type) {
  Launch(clip_params(grad_stats, state, total_norm, factor, max_norm, norm_type), grad_stats);
}

}  // namespace ampfused
