// The unscale op family: contract, shared types and the scale-update rule.
//
// Three ops, one pass over every gradient of a list (any count, float16/bfloat16/float32/float64
// mixed, any size, one device per call), each a single kernel launch on CUDA:
//
//   ampfused::non_finite_check_and_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf,
//                                           Tensor inv_scale) -> ()
//     torch._amp_foreach_non_finite_check_and_unscale_ with the same contract: every element v of
//     every grad becomes (inv_scale == 1 ? v : v * inv_scale), computed in opmath (float, or double
//     for float64 grads) and rounded to the grad's dtype; if any *input* element is inf/NaN,
//     found_inf is set to 1.0, otherwise it is left as it was (the caller zeroes it).
//
//   ampfused::non_finite_check_(Tensor[] grads, Tensor(a!) found_inf) -> ()
//     The same check, read-only: reads each gradient once and writes none of them.
//     found_inf as above (set to 1.0 or left unchanged).
//
//   ampfused::unscale_update_scale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor scale,
//       Tensor growth_tracker, Tensor(c!) next_scale, Tensor(d!) next_growth_tracker,
//       float growth_factor, float backoff_factor, int growth_interval, bool check_only,
//       bool accumulate) -> ()
//     The GradScaler pass.  inv_scale = float32(1.0 / float64(scale)), exactly as torch derives
//     it.  Unless check_only, grads are unscaled as above; with check_only nothing is written to
//     them.  found_inf is OVERWRITTEN: 1.0 if any element was inf/NaN, else 0.0 (no zeroing
//     launch needed).  Then the scale update of torch._amp_update_scale_ is computed from (scale,
//     growth_tracker, found) into (next_scale, next_growth_tracker), leaving scale and
//     growth_tracker untouched:
//       accumulate == false: next = update_rule(scale, growth_tracker, found)  (first pass of an
//                            iteration)
//       accumulate == true : next = update_rule(scale, growth_tracker, true) if found, else next
//                            is left as an earlier pass of the same iteration wrote it.
//     So after any number of passes in one iteration, next equals torch's update over the sum of
//     their found_inf values.  On CUDA the last block to finish computes it.
//
// Requirements (checked, with errors that name the argument): grads are float16, bfloat16,
// float32 or float64 strided tensors on one device, the device of found_inf; scale, inv_scale
// and found_inf are 1-element float32 tensors, growth_tracker and next_growth_tracker 1-element
// int32 tensors, next_scale a 1-element float32 tensor, all on that device.  Dense grads (any
// stride permutation, any storage offset) are processed in place; non-dense ones (gaps or
// overlapping elements) through a gather/scatter of their distinct memory locations, so each
// location is unscaled exactly once.  Zero-size grads and empty lists are fine.  No op syncs
// with the host.  Every argument is checked before anything is written, so a rejected call
// changes nothing (torch's kernels unscale the grads before a bad one).  A rejected input raises
// the exception type torch's ops raise for it, or a subclass: RuntimeError for a state tensor's
// dtype, element count or device and for a gradient on another device; NotImplementedError (a
// RuntimeError) for sparse arguments and for integer, bool, complex and float8 gradients;
// TypeError for an undefined (None) tensor.  Gradients that require grad are unscaled in place,
// as torch's ops do.
//
// Differences from torch, on purpose: bfloat16 works on CUDA; float64 grads are tested for
// finiteness in float64 on CUDA too (torch's CUDA kernel narrows them to float32 first, so it
// flags finite values above 3.4e38).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define AMPFUSED_HOST_DEVICE __host__ __device__
#else
#define AMPFUSED_HOST_DEVICE
#endif

namespace ampfused {

// One dense run of gradient memory: what the backend kernels see.
struct Span {
  void* data;
  int64_t numel;
  c10::ScalarType dtype;
};

// The epilogue of unscale_update_scale_: raw pointers, so the CPU host code and the last CUDA
// block share one implementation.
struct UpdateArgs {
  const float* scale;
  const int32_t* growth_tracker;
  float* next_scale;
  int32_t* next_growth_tracker;
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  bool accumulate;
};

// What a pass does, in raw pointers (no at::Tensor below the host wrappers).
struct PassArgs {
  const float* scale;  // scale (scale_is_inverse == false) or inv_scale (true)
  bool scale_is_inverse;
  bool check_only;  // read-only: no gradient is written
  float* found_inf;
  bool overwrite_found_inf;  // write 0.0 when nothing was found (else leave it)
  bool with_update;          // run the UpdateArgs epilogue
  UpdateArgs update;
};

// torch._amp_update_scale_, element for element (aten/src/ATen/native/cuda/AmpKernels.cu).
AMPFUSED_HOST_DEVICE inline void update_scale_rule(float scale, int32_t tracker, bool found,
                                                   double growth_factor, double backoff_factor,
                                                   int64_t growth_interval, float* out_scale,
                                                   int32_t* out_tracker) {
  if (found) {
    *out_scale = static_cast<float>(static_cast<double>(scale) * backoff_factor);
    *out_tracker = 0;
    return;
  }
  const int32_t successful = tracker + 1;
  if (successful == growth_interval) {
    const float grown = static_cast<float>(static_cast<double>(scale) * growth_factor);
    // A grown scale that overflowed float32 is not taken; the tracker still resets.
#if defined(__CUDA_ARCH__)
    const bool ok = isfinite(grown);
#else
    const bool ok = std::isfinite(grown);
#endif
    *out_scale = ok ? grown : scale;
    *out_tracker = 0;
  } else {
    *out_scale = scale;
    *out_tracker = successful;
  }
}

// Writes found_inf and, with_update, the pending scale/tracker.  Called once per pass, after
// every element has been checked.
AMPFUSED_HOST_DEVICE inline void finish_pass(bool found, const PassArgs& a) {
  if (found) {
    *a.found_inf = 1.0f;
  } else if (a.overwrite_found_inf) {
    *a.found_inf = 0.0f;
  }
  if (!a.with_update) return;
  const UpdateArgs& u = a.update;
  if (!u.accumulate || found) {
    update_scale_rule(*u.scale, *u.growth_tracker, found, u.growth_factor, u.backoff_factor,
                      u.growth_interval, u.next_scale, u.next_growth_tracker);
  }
}

// Backend kernels: one pass over all spans (all on the device of the PassArgs pointers).
void launch_pass_cpu(const std::vector<Span>& spans, const PassArgs& args);
#ifdef AMPFUSED_WITH_CUDA
void launch_pass_cuda(const std::vector<Span>& spans, const PassArgs& args,
                      const at::Tensor& any_device_tensor);
#endif

// Host wrappers behind the dispatcher (unscale.cpp), one per backend key.
void non_finite_check_and_unscale_(at::TensorList grads, const at::Tensor& found_inf,
                                   const at::Tensor& inv_scale);
void non_finite_check_(at::TensorList grads, const at::Tensor& found_inf);
void unscale_update_scale_(at::TensorList grads, const at::Tensor& found_inf,
                           const at::Tensor& scale, const at::Tensor& growth_tracker,
                           const at::Tensor& next_scale, const at::Tensor& next_growth_tracker,
                           double growth_factor, double backoff_factor, int64_t growth_interval,
                           bool check_only, bool accumulate);

}  // namespace ampfused
