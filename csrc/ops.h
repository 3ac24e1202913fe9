// Each ampfused op's schema and typed dispatcher handle, declared once (as ATen's at::_ops
// does for aten): ampfused.cpp defines the ops from these schemas, the kernels register under
// these names, and every C++ caller (grad_gather.cpp, the Autograd kernels) calls through these
// handles.  Contracts: unscale.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <utility>

namespace ampfused {
namespace ops {

// The typed handle of Op (found once, on first use) and calls through it.
template <typename Op>
struct Handle {
  // auto: Op is still incomplete where Handle<Op> is instantiated as its base.
  static const auto& handle() {
    static const auto h = c10::Dispatcher::singleton()
                              .findSchemaOrThrow(Op::kName, "")
                              .template typed<typename Op::Signature>();
    return h;
  }
  template <typename... Args>
  static void call(Args&&... args) {
    handle().call(std::forward<Args>(args)...);
  }
  template <typename... Args>
  static void redispatch(c10::DispatchKeySet keys, Args&&... args) {
    handle().redispatch(keys, std::forward<Args>(args)...);
  }
};

struct non_finite_check_and_unscale_ : Handle<non_finite_check_and_unscale_> {
  static constexpr const char* kName = "ampfused::non_finite_check_and_unscale_";
  static constexpr const char* kSchema =
      "ampfused::non_finite_check_and_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, "
      "Tensor inv_scale) -> ()";
  using Signature = void(at::TensorList, const at::Tensor&, const at::Tensor&);
};

struct non_finite_check_ : Handle<non_finite_check_> {
  static constexpr const char* kName = "ampfused::non_finite_check_";
  static constexpr const char* kSchema =
      "ampfused::non_finite_check_(Tensor[] grads, Tensor(a!) found_inf) -> ()";
  using Signature = void(at::TensorList, const at::Tensor&);
};

struct unscale_update_scale_ : Handle<unscale_update_scale_> {
  static constexpr const char* kName = "ampfused::unscale_update_scale_";
  static constexpr const char* kSchema =
      "ampfused::unscale_update_scale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor scale, "
      "Tensor growth_tracker, Tensor(c!) next_scale, Tensor(d!) next_growth_tracker, "
      "float growth_factor, float backoff_factor, int growth_interval, bool check_only, "
      "bool accumulate) -> ()";
  using Signature = void(at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, double, double, int64_t, bool, bool);
};

// The scaler's pass: unscale_update_scale_ over the scaler's whole state (ScalerState in
// unscale_math.h), with its scale policy, and the opt-in per-gradient statistics.
struct scaler_pass_ : Handle<scaler_pass_> {
  static constexpr const char* kName = "ampfused::scaler_pass_";
  static constexpr const char* kSchema =
      "ampfused::scaler_pass_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor state, "
      "Tensor(c!) next_state, Tensor(d!)? grad_stats, float growth_factor, float backoff_factor, "
      "int growth_interval, float min_scale, float max_scale, int hysteresis, bool check_only, "
      "bool accumulate, float headroom=0., int[] islands=[], Tensor? island_inv=None) -> ()";
  using Signature = void(at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const std::optional<at::Tensor>&, double, double, int64_t, double, double,
                         int64_t, bool, bool, double, c10::IntArrayRef,
                         const std::optional<at::Tensor>&);
};

// The scaler's update from a verdict computed elsewhere (found_inf: nonzero = inf/NaN found).
struct scaler_update_ : Handle<scaler_update_> {
  static constexpr const char* kName = "ampfused::scaler_update_";
  static constexpr const char* kSchema =
      "ampfused::scaler_update_(Tensor found_inf, Tensor state, Tensor(a!) next_state, "
      "float growth_factor, float backoff_factor, int growth_interval, float min_scale, "
      "float max_scale, int hysteresis, float headroom=0.) -> ()";
  using Signature = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                         int64_t, double, double, int64_t, double);
};

// float16/bfloat16/float32 gradients unscaled into float32 outputs (unscale_into.h).
struct unscale_into_ : Handle<unscale_into_> {
  static constexpr const char* kName = "ampfused::unscale_into_";
  static constexpr const char* kSchema =
      "ampfused::unscale_into_(Tensor[] grads, Tensor(a!)[] out, Tensor(b!) found_inf, "
      "Tensor inv_scale) -> ()";
  using Signature = void(at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&);
};

// The total gradient norm and clip factor from a scaler_pass_ statistics table (clip.h).
struct clip_factor_ : Handle<clip_factor_> {
  static constexpr const char* kName = "ampfused::clip_factor_";
  static constexpr const char* kSchema =
      "ampfused::clip_factor_(Tensor grad_stats, Tensor? state, Tensor(a!) total_norm, "
      "Tensor(b!) factor, float max_norm, float norm_type) -> ()";
  using Signature = void(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                         const at::Tensor&, double, double);
};

}  // namespace ops
}  // namespace ampfused
