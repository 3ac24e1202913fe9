// The out-of-place unscale: low-precision gradients into float32 ones (fp32 master gradients).
//
//   ampfused::unscale_into_(Tensor[] grads, Tensor(a!)[] out, Tensor(b!) found_inf,
//                           Tensor inv_scale) -> ()
//     For every i, out[i] becomes float32(grads[i]) unscaled: each element v (widened to float,
//     exactly) is written as (inv_scale == 1 ? v : v * inv_scale), one float32 multiply
//     (visit_into in unscale_math.h).  If any element of any grads[i] is inf/NaN, found_inf is
//     set to 1.0, otherwise it is left as it was (the caller zeroes it): torch's
//     _amp_foreach_non_finite_check_and_unscale_ contract, with the result in out instead of in
//     place.  A NaN stays a NaN; its payload and quiet bit are the converter's (F16C quiets a
//     signalling float16 NaN, c10's software conversion keeps it), as with torch's own copy_. grads
//     are only read: a float16 gradient costs 2 bytes read and 4 written per element, the cast and
//     the unscale in one pass (ampfused.MasterWeights' step).
//
// Requirements (checked before anything is written, naming the argument): found_inf and
// inv_scale one-element float32 tensors on one device; grads and out lists of the same length;
// grads[i] float16, bfloat16 or float32, out[i] float32, both strided on that device, of the same
// shape and the same strides, with no gaps or overlapping elements (non-overlapping and dense:
// torch.empty_like(grads[i], dtype=torch.float32) is such an out), and out[i] not sharing memory
// with grads[i] (zero-size pairs: same shape only).  No out may overlap another out or any
// other grads[j] (not checked).  Wrong dtypes or
// layouts raise NotImplementedError, the rest RuntimeError (TypeError for an undefined tensor),
// the types torch's foreach ops raise.  No host sync.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace ampfused {

// One pair of dense runs: numel elements of `dtype` at `in`, numel float32 at `out`.
struct IntoSpan {
  const void* in;
  float* out;
  int64_t numel;
  c10::ScalarType dtype;
};

// A backend's pass over the spans: found_inf set to 1.0 if any input element was inf/NaN.
using IntoLaunchFn = void (*)(const std::vector<IntoSpan>& spans, const float* inv_scale,
                              float* found_inf, const at::Tensor& on_device);
void launch_into_cpu(const std::vector<IntoSpan>& spans, const float* inv_scale, float* found_inf,
                     const at::Tensor& on_device);
#ifdef AMPFUSED_WITH_CUDA
void launch_into_cuda(const std::vector<IntoSpan>& spans, const float* inv_scale, float* found_inf,
                      const at::Tensor& on_device);
#endif

// The op's checks (unscale_into.cpp), shared by every backend's kernel: returns the spans.
std::vector<IntoSpan> into_spans(at::TensorList grads, at::TensorList out,
                                 const at::Tensor& found_inf, const at::Tensor& inv_scale);

template <IntoLaunchFn Launch>
void unscale_into_kernel(at::TensorList grads, at::TensorList out, const at::Tensor& found_inf,
                         const at::Tensor& inv_scale) {
  const std::vector<IntoSpan> spans = into_spans(grads, out, found_inf, inv_scale);
  if (spans.empty()) return;
  Launch(spans, inv_scale.const_data_ptr<float>(), found_inf.mutable_data_ptr<float>(), found_inf);
}

}  // namespace ampfused
