// The unscale op family: contract, the backend interface and the op kernels' shared body.
//
// Three ops, one pass over every gradient of a list (any count, float16/bfloat16/float32/float64
// mixed, any size, one device per call); on CUDA one kernel launch per 2,032 work items of at
// most 64K elements (launch_table.h), so one launch for most models:
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
//     their found_inf values.  On CUDA the last block of the pass's last launch computes it.
//
//   ampfused::scaler_pass_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor state,
//       Tensor(c!) next_state, Tensor(d!)? grad_stats, float growth_factor,
//       float backoff_factor, int growth_interval, float min_scale, float max_scale,
//       int hysteresis, bool check_only, bool accumulate, float headroom=0.) -> ()
//     ampfused.GradScaler's pass: unscale_update_scale_ with the scaler's whole state in one
//     int32 tensor of kScalerStateSize elements (ScalerState in unscale_math.h: the scale's
//     float32 bits, the growth tracker, hysteresis left and the counters), next_state written
//     from state as next_scale/next_growth_tracker are above, by update_scale_state: torch's rule
//     extended by min_scale/max_scale (a backoff or growth beyond them is held there) and
//     hysteresis (>= 1; back off on that many consecutive overflowing iterations).  headroom > 0
//     selects the headroom policy (update_scale_state in unscale_math.h), headroom < 0 the same
//     with a margin learned up to -headroom (ScalePolicy::learned): the pass also measures
//     the largest finite |v| of the scaled values it reads (MagnitudeOf; with grad_stats, from
//     each item's abs-max times the scale) into next_state[kStateMagnitude] (with accumulate,
//     the max with what is there: +inf once a pass found inf/NaN), and the update moves the scale
//     by it and the history of caps in the state, instead of every growth_interval steps.
//     grad_stats, when given, is a float64 [grad_stats_rows(grads), kStatFields] contiguous
//     tensor that receives the pass header and per-item statistics (unscale_math.h, StatField;
//     what each field means exactly: ampfused/reference.py, grad_stats).  Gradients with
//     overlapping memory are refused when grad_stats is given.
//     Scale islands: islands, when not empty, gives each gradient's island (0: none, k >= 1:
//     island k, at most island_inv.numel() and 65535), and island_inv is a 1-D float32 tensor
//     on the pass's device: a gradient of island k carries the scale times a power-of-two
//     factor f_k, and island_inv[k - 1] = 1 / f_k.  Its elements are multiplied by the pass's
//     multiplier times island_inv[k - 1] (PassParams::item_inv), its statistics are of those
//     truly unscaled values, and its measured magnitude is taken at the global scale (divided
//     by f_k: what the pass would measure without the island); inf/NaN in it counts as
//     anywhere.
//
//   ampfused::scaler_update_(Tensor found_inf, Tensor state, Tensor(a!) next_state,
//       float growth_factor, float backoff_factor, int growth_interval, float min_scale,
//       float max_scale, int hysteresis, float headroom=0.) -> ()
//     next_state from state and found_inf (nonzero: inf/NaN was found) by the same rule: the
//     update when the verdict comes from elsewhere (several devices, a found_inf all-reduced).
//     With headroom != 0 the magnitude is read from next_state[kStateMagnitude] first (where the
//     passes, and an all-reduce, left it; +inf there counts as none: found_inf alone decides what
//     was found).
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
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "ops.h"
#include "unscale_math.h"

namespace ampfused {

// One dense run of gradient memory: what the backend kernels see.
struct Span {
  void* data;
  int64_t numel;
  c10::ScalarType dtype;
  int32_t island = 0;  // scale island (PassParams::island_inv): 0 for none
};

// A backend's pass over all spans, every pointer on the device of `on_device` (found_inf).
using LaunchFn = void (*)(const std::vector<Span>& spans, const PassParams& params,
                          const at::Tensor& on_device);
void launch_pass_cpu(const std::vector<Span>& spans, const PassParams& params,
                     const at::Tensor& on_device);
#ifdef AMPFUSED_WITH_CUDA
void launch_pass_cuda(const std::vector<Span>& spans, const PassParams& params,
                      const at::Tensor& any_device_tensor);
#endif

// The CUDA key's kernels in a build without CUDA: a RuntimeError saying how to rebuild.
void refuse_without_cuda(const at::Device& device);

// Shared by every backend's kernels (unscale.cpp).  Each check raises before anything is
// written, with the exception type the contract above gives.
at::Device check_found_inf(const at::Tensor& found_inf);  // returns the pass's device
void check_state(const at::Tensor& t, const char* name, c10::ScalarType dtype,
                 const at::Device& device);
void check_grads(at::TensorList grads, const at::Device& device);
// The scaler's int32 state (kScalerStateSize elements, contiguous) and its statistics table.
// `device_name` names the argument `device` was taken from, for the device mismatch message.
void check_scaler_state(const at::Tensor& t, const char* name, const at::Device& device,
                        const char* device_name = "found_inf");
void check_grad_stats(const at::Tensor& t, at::TensorList grads, const at::Device& device);
// Rows of grad_stats for `grads`: the header, then ceil(numel / kChunkSize) per gradient.
int64_t grad_stats_rows(at::TensorList grads);
// The scaler ops' PassParams for the update: pointers into state/next_state, the policy
// (checked: factors, hysteresis >= 1, min_scale <= max_scale).
PassParams scaler_params(const at::Tensor& state, const at::Tensor& next_state,
                         double growth_factor, double backoff_factor, int64_t growth_interval,
                         double min_scale, double max_scale, int64_t hysteresis, double headroom);
// Packs the non-dense grads, launches the pass over dense spans, writes the packed ones back.
// `islands`: empty, or each gradient's island (checked by check_islands).
void run_pass(at::TensorList grads, const at::Tensor& found_inf, const PassParams& params,
              LaunchFn launch, c10::IntArrayRef islands = {});
// scaler_pass_'s islands and island_inv (the contract above); returns island_inv's data, or
// null where islands is empty.
const float* check_islands(c10::IntArrayRef islands, const std::optional<at::Tensor>& island_inv,
                           at::TensorList grads, const at::Device& device);

// The op kernels of one backend, instantiated with its launcher where that backend registers
// them (csrc/cpu/unscale_cpu.cpp, csrc/cuda/unscale_cuda_ops.cpp): the checks and the
// PassParams are written once, here; the launcher is the backend's iteration.
template <LaunchFn Launch>
struct Kernels {
  static void non_finite_check_and_unscale_(at::TensorList grads, const at::Tensor& found_inf,
                                            const at::Tensor& inv_scale) {
    const at::Device device = check_found_inf(found_inf);
    check_state(inv_scale, "inv_scale", at::kFloat, device);
    check_grads(grads, device);
    PassParams p;
    p.scale = inv_scale.const_data_ptr<float>();
    p.scale_is_inverse = true;
    p.found_inf = found_inf.mutable_data_ptr<float>();
    run_pass(grads, found_inf, p, Launch);
  }

  static void non_finite_check_(at::TensorList grads, const at::Tensor& found_inf) {
    check_grads(grads, check_found_inf(found_inf));
    PassParams p;  // p.scale stays null: a check-only pass reads no scale
    p.check_only = true;
    p.found_inf = found_inf.mutable_data_ptr<float>();
    run_pass(grads, found_inf, p, Launch);
  }

  static void unscale_update_scale_(at::TensorList grads, const at::Tensor& found_inf,
                                    const at::Tensor& scale, const at::Tensor& growth_tracker,
                                    const at::Tensor& next_scale,
                                    const at::Tensor& next_growth_tracker, double growth_factor,
                                    double backoff_factor, int64_t growth_interval, bool check_only,
                                    bool accumulate) {
    const at::Device device = check_found_inf(found_inf);
    check_state(scale, "scale", at::kFloat, device);
    check_state(growth_tracker, "growth_tracker", at::kInt, device);
    check_state(next_scale, "next_scale", at::kFloat, device);
    check_state(next_growth_tracker, "next_growth_tracker", at::kInt, device);
    check_grads(grads, device);
    PassParams p;
    p.scale = scale.const_data_ptr<float>();
    p.check_only = check_only;
    p.found_inf = found_inf.mutable_data_ptr<float>();
    p.overwrite_found_inf = true;
    p.with_update = true;
    p.accumulate = accumulate;
    p.growth_tracker = growth_tracker.const_data_ptr<int32_t>();
    p.next_scale = next_scale.mutable_data_ptr<float>();
    p.next_growth_tracker = next_growth_tracker.mutable_data_ptr<int32_t>();
    p.policy.growth_factor = growth_factor;
    p.policy.backoff_factor = backoff_factor;
    p.policy.growth_interval = growth_interval;
    run_pass(grads, found_inf, p, Launch);
  }

  static void scaler_pass_(at::TensorList grads, const at::Tensor& found_inf,
                           const at::Tensor& state, const at::Tensor& next_state,
                           const std::optional<at::Tensor>& grad_stats, double growth_factor,
                           double backoff_factor, int64_t growth_interval, double min_scale,
                           double max_scale, int64_t hysteresis, bool check_only, bool accumulate,
                           double headroom, c10::IntArrayRef islands,
                           const std::optional<at::Tensor>& island_inv) {
    const at::Device device = check_found_inf(found_inf);
    check_scaler_state(state, "state", device);
    check_scaler_state(next_state, "next_state", device);
    check_grads(grads, device);
    const bool stats = grad_stats.has_value() && grad_stats->defined();
    if (stats) check_grad_stats(*grad_stats, grads, device);
    const float* inv_of_island = check_islands(islands, island_inv, grads, device);
    PassParams p = scaler_params(state, next_state, growth_factor, backoff_factor, growth_interval,
                                 min_scale, max_scale, hysteresis, headroom);
    p.check_only = check_only;
    p.found_inf = found_inf.mutable_data_ptr<float>();
    p.overwrite_found_inf = true;
    p.accumulate = accumulate;
    if (stats) p.grad_stats = grad_stats->mutable_data_ptr<double>();
    p.island_inv = inv_of_island;
    run_pass(grads, found_inf, p, Launch, inv_of_island != nullptr ? islands : c10::IntArrayRef());
  }

  static void scaler_update_(const at::Tensor& found_inf, const at::Tensor& state,
                             const at::Tensor& next_state, double growth_factor,
                             double backoff_factor, int64_t growth_interval, double min_scale,
                             double max_scale, int64_t hysteresis, double headroom) {
    const at::Device device = check_found_inf(found_inf);
    check_scaler_state(state, "state", device);
    check_scaler_state(next_state, "next_state", device);
    PassParams p = scaler_params(state, next_state, growth_factor, backoff_factor, growth_interval,
                                 min_scale, max_scale, hysteresis, headroom);
    p.found_in = found_inf.const_data_ptr<float>();
    p.magnitude_in = p.next_counters;
    run_pass({}, found_inf, p, Launch);
  }
};

// Registers Kernels<Launch> for every op, in a TORCH_LIBRARY_IMPL block of one dispatch key.
template <LaunchFn Launch>
void register_kernels(torch::Library& m) {
  m.impl(ops::non_finite_check_and_unscale_::kName,
         &Kernels<Launch>::non_finite_check_and_unscale_);
  m.impl(ops::non_finite_check_::kName, &Kernels<Launch>::non_finite_check_);
  m.impl(ops::unscale_update_scale_::kName, &Kernels<Launch>::unscale_update_scale_);
  m.impl(ops::scaler_pass_::kName, &Kernels<Launch>::scaler_pass_);
  m.impl(ops::scaler_update_::kName, &Kernels<Launch>::scaler_update_);
}

}  // namespace ampfused
